"""The Memory Indexer's scorer on the GPU (flashmemory.md §3-§4): query encoder, then logits.

    retriever_query   q[H, DI], w[H] <- x[D]           per target layer, once per 64 steps
    retriever_logits  z[N]           = Σ_h w[h] · ReLU(q[h] · k_n)  for n < n_visible, else -inf
    RetrieverScorer   z[L, N]        for every retriever layer: position, uploads, both ops

The NumPy spec is pocketfm/memory/scorer.py. Almost everything here is an existing kernel:

    a = wq_a · x                 gemv_f32               (gemv.py; fp32 planes of QWeight)
    a = RMSNorm(a) ⊙ g           rmsnorm, in place      (norm_rope.py)
    q = wq_b · a                 gemv_f32
    q = bf16(RoPE(bf16(q)))      rope_bf16              NEW: one kernel, cos/sin table
    q_h = Hadamard(q_h)          hadamard_fp4, fp4 off  (qat.py; the float64 butterfly)
    w = weights_proj' · x        gemv_f32               1/√(DI·H) folded into the weight
    z = Σ_h w_h ReLU(q_h · k)    indexer_scores         (indexer.py; packed FP4 keys)

The norm_rope RoPE computes its angles from device positions; the scorer gets cos/sin tables
built on the host (rope_tables, as the reference), and the deployment rounds q to bf16 on both
sides of the rotation (§3.6): one small elementwise kernel does all three, so the only new
kernel is ``_rope_bf16_pairs``. The indexer's register-tile kernel holds q in dynamic shared
memory, 4·HI·DI bytes: 32 KB at 64 heads, but 64 KB (+ the key stage) at 128, past the 48 KB a
launch gets without an opt-in attribute. 128 heads are therefore scored as two 64-head groups
whose logits add up (exact, §4 "head groups add"), through gemv's split-sum kernel; -inf + -inf
stays -inf past n_visible. Dimension letters: D hidden, H retriever heads, DI head dim,
R rope dims (P = R/2 pairs), N chunks (keys), L retriever layers, G head groups.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64, int32

from .. import ops
from ..memory.scorer import RMS_EPS, retriever_logits_keys_ref, round_bf16, sigmoid
from ..memory.scorer import retriever_query_ref  # noqa: F401  (the spec of retriever_query)
from ..numerics import rope_tables
from . import device, kvpack
from .bench import BenchCase
from .device import cdiv
from .gemv import _sum_splits, gemv_f32, pack_f32  # _sum_splits: out = Σ_g part[g], fixed order
from .indexer import indexer_scores, random_packed_keys
from .norm_rope import rmsnorm
from .qat import bf16_bits, hadamard_fp4, scalar_fn
from .qweight import QWeight

HEAD_GROUP = 64  # heads per indexer_scores launch: q staged in 32 KB of shared memory (DI 128)


# ---- NumPy references (the spec; retriever_query_ref is memory/scorer.py's) ----------------------
def rope_bf16_ref(out, x, cos, sin, bf16: bool) -> None:
    """out[T, H, n] <- x[T, H, n] with the last 2P dims rotated by cos/sin [T, P] (float32
    arithmetic, ops.rope); with ``bf16`` the input and the result rounded to bf16 (§3.6)."""
    y = round_bf16(x) if bf16 else x.astype(np.float32)
    ops.rope(y, y, cos.astype(np.float32), sin.astype(np.float32))
    out[...] = round_bf16(y) if bf16 else y


def retriever_logits_ref(out, q, w, keys_packed, n_visible) -> None:
    """out[N] <- z_n for n < n_visible[0] (memory/scorer.py on the unpacked keys), -inf beyond;
    q [H, DI], w [H], keys_packed [Ncap, bytes] uint8."""
    n = max(0, min(int(n_visible[0]), len(out), len(keys_packed)))
    keys = np.empty((n, q.shape[1]), np.float32)
    kvpack.unpack_index_key_ref(keys, keys_packed[:n])
    out[...] = -np.inf
    retriever_logits_keys_ref(out[:n], q, w, keys.astype(out.dtype))


# ---- rope_bf16: the one new kernel ---------------------------------------------------------------
@scalar_fn
def _round_bf16(v):
    """float32 v rounded to the nearest bf16, ties to even (quants.float32_to_bf16), as float32:
    qat's bits from the value, kvpack's decode back (both bit-exact, simulator-safe)."""
    b = bf16_bits(v)
    return float32(kvpack.bf16_decode(b & 255, b >> 8))


@device.kernel
def _rope_bf16_pairs(out, x, cos, sin, bf16):
    """One thread per adjacent pair (2k, 2k+1) of every head (grid-stride): round, rotate if the
    pair is one of the last P, round again. out/x [T, H, n] (in place is fine: a thread reads its
    pair before writing it), cos/sin [T, P] f32."""
    T, H, n = x.shape
    P = cos.shape[1]
    half = n // 2
    nope = half - P  # pairs that pass through (only rounded)
    for i in range(cuda.grid(1), T * H * half, cuda.gridsize(1)):
        t = i // (H * half)
        h = i // half - t * H
        k = i - (t * H + h) * half
        x0 = x[t, h, 2 * k]
        x1 = x[t, h, 2 * k + 1]
        if bf16:
            x0 = _round_bf16(x0)
            x1 = _round_bf16(x1)
        if k >= nope:  # float32 products and sums, as ops.rope on float32 arrays
            c = cos[t, k - nope]
            s = sin[t, k - nope]
            y0 = x0 * c - x1 * s
            y1 = x0 * s + x1 * c
            x0, x1 = y0, y1
        if bf16:
            x0 = _round_bf16(x0)
            x1 = _round_bf16(x1)
        out[t, h, 2 * k] = x0
        out[t, h, 2 * k + 1] = x1


def rope_bf16(out, x, cos, sin, bf16: bool, stream=0, threads=None) -> None:
    """out[T, H, n] f32 <- x[T, H, n] f32 (may be the same array): rope_bf16_ref on the GPU;
    cos/sin [T, P] f32 device tables (rope_tables), n even, 2P <= n."""
    T, H, n = x.shape
    P = cos.shape[1]
    if n % 2 or 2 * P > n:
        raise ValueError(f"rope_bf16: head dim {n} must be even and hold the {2 * P} rope dims")
    nt = threads or 128
    _rope_bf16_pairs[min(cdiv(T * H * n // 2, nt), 4096), nt, stream](out, x, cos, sin,
                                                                     bool(bf16))


# ---- the query encoder ---------------------------------------------------------------------------
@dataclass
class DeviceRetrieverLayer:
    """One RetrieverLayer on the GPU: fp32 weights uploaded once as F32 QWeights (gemv's layout
    is the plain [1, N, K] array), plus the layer's two scratch vectors."""

    layer: int  # the transformer layer whose x it reads
    wq_a: QWeight  # [rank, D]
    q_norm: object  # [rank] f32
    wq_b: QWeight  # [H·DI, rank]
    weights_proj: QWeight  # [H, D], already times 1/√(DI·H)
    heads: int  # H
    index_dim: int  # DI
    a: object  # [1, rank] f32 scratch: the normed latent
    q_pre: object  # [1, H·DI] f32 scratch: q before the Hadamard

    @classmethod
    def from_host(cls, layer, stream=0) -> "DeviceRetrieverLayer":
        """Upload a memory.checkpoint.RetrieverLayer (float32 arrays)."""
        H, rank = layer.heads, layer.rank
        DI = layer.wq_b.shape[0] // H

        def f32(w):
            w = np.ascontiguousarray(w, np.float32)
            return pack_f32(w, *w.shape).to_device(stream)

        # w = (W_p · x) / √(DI·H) becomes (W_p / √(DI·H)) · x: no scale kernel, no extra launch.
        # Exact when DI·H is a power of 4 (V4: 128·128, s = 1/128), else one more fp32 rounding.
        wp = layer.weights_proj.astype(np.float64) / math.sqrt(DI * H)
        g = device.to_device(np.ascontiguousarray(layer.q_norm, np.float32), stream)
        return cls(layer.layer, f32(layer.wq_a), g, f32(layer.wq_b), f32(wp), H, DI,
                   a=device.device_empty((1, rank), np.float32, stream),
                   q_pre=device.device_empty((1, H * DI), np.float32, stream))

    @staticmethod
    def planned_bytes(layer) -> int:
        """Device bytes ``from_host(layer)`` allocates, without uploading (``pocketfm plan``;
        tests compare with ``nbytes``): the four tensors as float32, then the two scratch rows."""
        weights = (layer.wq_a, layer.q_norm, layer.wq_b, layer.weights_proj)
        return 4 * (sum(w.size for w in weights) + layer.rank + layer.wq_b.shape[0])

    @property
    def nbytes(self) -> int:
        arrays = (*self.wq_a.planes, self.q_norm, *self.wq_b.planes, *self.weights_proj.planes,
                  self.a, self.q_pre)
        return sum(int(a.nbytes) for a in arrays)


def retriever_query(q_out, w_out, x, layer: DeviceRetrieverLayer, cos, sin, hadamard=None,
                    bf16_rope: bool = True, stream=0, threads=None, naive: bool = False) -> None:
    """q_out[H, DI], w_out[H] f32 <- x[D] f32: memory.scorer.retriever_query_ref on the GPU.

    cos/sin [1, P] f32 device tables at the clamped position. ``hadamard`` is only checked for
    shape: the kernel applies numerics.hadamard_matrix(DI) as the float64 butterfly (what every
    caller passes; DI a power of two). Six launches, no allocation (graph-capturable).
    ``naive``: the serial norm and Hadamard kernels (the engine's choice in the simulator).
    """
    H, DI = q_out.shape
    if (H, DI) != (layer.heads, layer.index_dim) or w_out.shape != (H,):
        raise ValueError(f"retriever_query: q {q_out.shape}, w {w_out.shape} for a layer of "
                         f"{layer.heads} heads x {layer.index_dim}")
    if hadamard is not None and hadamard.shape != (DI, DI):
        raise ValueError(f"retriever_query: hadamard {hadamard.shape}, want ({DI}, {DI})")
    x1 = x.reshape(1, x.shape[0])
    gemv_f32(layer.a, layer.wq_a, x1, stream=stream, threads=threads)
    # in place: the block-per-row kernel reads the row before its block sum's barrier
    rmsnorm(layer.a, layer.a, layer.q_norm, RMS_EPS, True, stream, threads, naive)
    gemv_f32(layer.q_pre, layer.wq_b, layer.a, stream=stream, threads=threads)
    q3 = layer.q_pre.reshape(1, H, DI)
    rope_bf16(q3, q3, cos, sin, bf16_rope, stream, threads)
    hadamard_fp4(q_out.reshape(1, H, DI), q3, False, stream, threads, naive)
    gemv_f32(w_out.reshape(1, H), layer.weights_proj, x1, stream=stream, threads=threads)


# ---- logits --------------------------------------------------------------------------------------
def logits_workspace(H: int, N: int, stream=0):
    """[G, 1, N] f32 per-group logits for H > HEAD_GROUP heads (None when one group does)."""
    if H <= HEAD_GROUP:
        return None
    if H % HEAD_GROUP:
        raise ValueError(f"retriever_logits: {H} heads, want <= {HEAD_GROUP} or a multiple")
    return device.device_empty((H // HEAD_GROUP, 1, N), np.float32, stream)


_WORKSPACES: dict = {}


def retriever_logits(out, q, w, keys_packed, n_visible, stream=0, threads=None,
                     work=None) -> None:
    """out[N] f32 <- q[H, DI] f32, w[H] f32, keys_packed[Ncap, bytes] uint8 (kvpack's FP4 keys),
    n_visible int32[1] device (-inf past it). Up to 64 heads: one indexer_scores. More: one per
    64-head group into ``work`` (a logits_workspace; by default one module buffer per shape,
    allocated on first use: calls on one stream only), then out = the sum of the groups."""
    H, DI = q.shape
    N = out.shape[0]
    if H <= HEAD_GROUP:
        indexer_scores(out, q, w, keys_packed, n_visible, stream, threads)
        return
    if work is None:
        if (H, N) not in _WORKSPACES:
            _WORKSPACES[H, N] = logits_workspace(H, N, stream)
        work = _WORKSPACES[H, N]
    G = H // HEAD_GROUP
    if H % HEAD_GROUP or work.shape != (G, 1, N):
        raise ValueError(f"retriever_logits: {H} heads, workspace {work.shape}; want a multiple "
                         f"of {HEAD_GROUP} and ({G}, 1, {N})")
    for g in range(G):
        hs = slice(g * HEAD_GROUP, (g + 1) * HEAD_GROUP)
        indexer_scores(work[g, 0], q[hs], w[hs], keys_packed, n_visible, stream, threads)
    _sum_splits[min(cdiv(N, 256), 4096), 256, stream](out.reshape(1, N), work)


# ---- all layers, once per cycle ------------------------------------------------------------------
class RetrieverScorer:
    """Scores every retriever layer for the current token (flashmemory.md §6: every 64 steps,
    outside the decode graph). Weights and workspaces are allocated once, here.

    ``freq``: the compressed layers' RoPE frequencies [P] (numerics.rope_frequencies), the ones
    the stored keys were rotated with. ``capacity``: Ncap, the width of z_out; when not given,
    the head-group workspace (H > 64) is allocated by the first score() (outside any graph).
    """

    def __init__(self, retriever, freq, capacity: int | None = None, bf16_rope: bool = True,
                 stream=0, threads=None, naive: bool = False):
        self.layers = [DeviceRetrieverLayer.from_host(r, stream) for r in retriever.layers]
        shapes = {(r.heads, r.index_dim) for r in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"RetrieverScorer: layers of different shapes {sorted(shapes)}")
        H, DI = shapes.pop()
        self.max_position = retriever.geometry.max_position
        self.freq = np.asarray(freq, np.float64)
        self.heads, self.bf16_rope = H, bool(bf16_rope)
        self.threads, self.naive = threads, naive  # launch shapes: see retriever_query
        self.q = device.device_empty((H, DI), np.float32, stream)
        self.w = device.device_empty(H, np.float32, stream)
        self.work = None if capacity is None else logits_workspace(H, capacity, stream)
        # Host staging kept alive and refilled in place: an upload never reads a freed buffer,
        # even when a benchmark captures score() into a graph. Pinned, so that an upload on a
        # stream that waits for other work returns at once (from pageable memory the driver
        # copies synchronously: the host would wait for that stream).
        P = len(self.freq)
        self.host_cos, self.host_sin = (cuda.pinned_array((1, P), np.float32) for _ in range(2))
        self.host_n = cuda.pinned_array(1, np.int32)
        self.cos = device.device_empty((1, P), np.float32, stream)
        self.sin = device.device_empty((1, P), np.float32, stream)
        self.n_visible = device.device_empty(1, np.int32, stream)
        self.freq_dev = device.to_device(self.freq, stream)  # score_in_graph's device tables

    def score(self, z_out, xs, pos: int, keys, n: int, stream=0) -> None:
        """z_out[L, Ncap] f32 (device) <- each layer's logits over its keys; xs [L, D] f32 the
        layers' attention inputs, ``pos`` the token's position (clamped to max_position - 1),
        keys[l] [Ncap, bytes] uint8 layer l's packed indexer keys, n valid chunks (-inf past)."""
        if len(xs) != len(self.layers) or len(keys) != len(self.layers):
            raise ValueError(f"RetrieverScorer.score: {len(xs)} x rows and {len(keys)} key "
                             f"arrays for {len(self.layers)} layers")
        N = z_out.shape[1]
        if self.heads > HEAD_GROUP and (self.work is None or self.work.shape[2] != N):
            self.work = logits_workspace(self.heads, N, stream)
        p = min(max(int(pos), 0), self.max_position - 1)  # §3.4: positions clamped
        self.host_cos[...], self.host_sin[...] = rope_tables(self.freq, [p], np.float32)
        self.host_n[0] = n
        self.cos.copy_to_device(self.host_cos, stream=stream)
        self.sin.copy_to_device(self.host_sin, stream=stream)
        self.n_visible.copy_to_device(self.host_n, stream=stream)
        self._score_layers(z_out, xs, keys, self.n_visible, stream)

    def score_in_graph(self, z_out, xs, pos, n_visible, keys, stream=0) -> None:
        """As ``score``, with the position pos int32[1] and the chunk count n_visible int32[1]
        read on the device (the cos/sin tables built there): capturable in the decode graph,
        for the per-step global-topk mode. The head-group workspace must exist already
        (``capacity`` given, or one ``score`` before capture)."""
        if self.heads > HEAD_GROUP and (self.work is None or self.work.shape[2] != z_out.shape[1]):
            raise ValueError("RetrieverScorer.score_in_graph: no workspace for "
                             f"{z_out.shape[1]} chunks (give capacity= at construction)")
        rope_table(self.cos, self.sin, pos, self.freq_dev, self.max_position, stream)
        self._score_layers(z_out, xs, keys, n_visible, stream)

    def _score_layers(self, z_out, xs, keys, n_visible, stream) -> None:
        for i, layer in enumerate(self.layers):  # one q/w pair reused: launches are in order
            retriever_query(self.q, self.w, xs[i], layer, self.cos, self.sin, None,
                            self.bf16_rope, stream, self.threads, self.naive)
            retriever_logits(z_out[i], self.q, self.w, keys[i], n_visible, stream,
                             self.threads, self.work)


# ---- device-side cos/sin and the ensemble (per-step global top-k) ---------------------------------
def rope_table_ref(cos, sin, pos, freq, max_position: int) -> None:
    """cos/sin [1, P] f32 <- the angles pos[0]·freq (float64), pos clamped to [0, max_pos - 1]."""
    p = min(max(int(pos[0]), 0), max_position - 1)
    cos[...], sin[...] = rope_tables(np.asarray(freq, np.float64), [p], np.float32)


@device.kernel
def _rope_table(cos, sin, pos, freq, max_position):
    k = cuda.grid(1)
    if k < freq.shape[0]:
        p = min(max(pos[0], 0), max_position - 1)
        ang = float64(p) * freq[k]  # float64, as rope_tables: positions reach 1M
        cos[0, k] = math.cos(ang)
        sin[0, k] = math.sin(ang)


def rope_table(cos, sin, pos, freq, max_position: int, stream=0) -> None:
    """cos/sin [1, P] f32 device <- pos int32[1] device, freq [P] float64 device."""
    P = freq.shape[0]
    _rope_table[cdiv(P, 64), 64, stream](cos, sin, pos, freq, int32(max_position))


ENSEMBLE_MAX, ENSEMBLE_MEAN = 0, 1


def ensemble_ref(e, z, n_visible, how: int) -> None:
    """e[N] f32 <- the ensemble ranking key over z[L, N] logits for j < n_visible[0], -inf
    beyond: max_l z (``max`` / ``or``: σ is monotone, so it orders as max σ) or mean_l σ(z)."""
    n = min(int(n_visible[0]), len(e))
    e[...] = -np.inf
    zz = z[:, :n].astype(np.float64)
    e[:n] = zz.max(axis=0) if how == ENSEMBLE_MAX else sigmoid(zz).mean(axis=0)


@device.kernel
def _ensemble(e, z, n_visible, how):
    L, N = z.shape[0], e.shape[0]
    n = min(n_visible[0], N)
    for j in range(cuda.grid(1), N, cuda.gridsize(1)):
        if j >= n:
            e[j] = -math.inf
            continue
        acc = -math.inf if how == ENSEMBLE_MAX else 0.0
        for l in range(L):
            v = z[l, j]
            if how == ENSEMBLE_MAX:
                acc = max(acc, v)
            else:
                acc += 0.5 * (1.0 + math.tanh(0.5 * v))
        e[j] = acc if how == ENSEMBLE_MAX else acc / L


def ensemble(e, z, n_visible, how: int, stream=0) -> None:
    """e[N] f32 <- z[L, Ncap] f32 (Ncap >= N), n_visible int32[1]: ensemble_ref on the GPU."""
    nt = 256
    _ensemble[min(cdiv(e.shape[0], nt), 4096), nt, stream](e, z, n_visible, int32(how))


# ---- CI lane B and the benchmark -----------------------------------------------------------------
_F3, _F2 = "float32[:, :, ::1]", "float32[:, ::1]"
PTX_SIGNATURES = [
    (_rope_bf16_pairs, f"void({_F3}, {_F3}, {_F2}, {_F2}, boolean)"),
    (_rope_table, f"void({_F2}, {_F2}, int32[::1], float64[::1], int32)"),
    (_ensemble, f"void(float32[::1], {_F2}, int32[::1], int32)"),
]


def bench_cases(stream, D=4096, H=128, DI=128, rank=2048, R=64, N=262_144, L=3):
    """V4-Flash shapes (official checkpoint: H = 128, rank 2048; 1M context: N = 262,144
    chunks): the query encoder of one layer, the logits over N keys, and a whole
    RetrieverScorer.score cycle over L = 3 layers (uploads and Python launches included, as the
    engine runs it outside the graph). Smaller shapes via the arguments (tests)."""
    from ..memory.checkpoint import Retriever, RetrieverGeometry, RetrieverLayer
    from ..numerics import rope_frequencies

    rng = np.random.default_rng(0)

    def rand(*shape, fan_in=1):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)

    host = [RetrieverLayer(i, i, rand(rank, D, fan_in=D), 1 + 0.1 * rand(rank),
                           rand(H * DI, rank, fan_in=rank), rand(H, D, fan_in=D))
            for i in range(L)]
    freq = rope_frequencies(R, 160000.0, 16.0, 65536)
    keys_host = random_packed_keys(rng, N, DI)
    keys = [device.to_device(keys_host, stream) for _ in range(L)]  # L2 cannot serve layer 2+
    xs = device.to_device(rand(L, D), stream)
    scorer = RetrieverScorer(Retriever(host, RetrieverGeometry()), freq, N, stream=stream)
    q, w, z = scorer.q, scorer.w, device.device_empty((L, N), np.float32, stream)
    cos, sin = rope_tables(freq, [123_456], np.float32)
    cos, sin = device.to_device(cos, stream), device.to_device(sin, stream)
    nv = device.to_device(np.array([N], np.int32), stream)
    lay, x0, z0 = scorer.layers[0], xs[0], z[0]  # (views made once, not per launch)
    wbytes = lay.wq_a.nbytes + lay.wq_b.nbytes + lay.weights_proj.nbytes + 4 * rank
    qbytes, qflops = wbytes + 4 * (D + H * DI + H), 2 * (rank * D + H * DI * rank + H * D)
    lbytes, lflops = keys_host.nbytes + 4 * N + 4 * H * (DI + 1), 2 * N * H * (DI + 1)

    def check_logits():
        got = z0.copy_to_host(stream=stream)[:1024]
        ref = np.empty(min(N, 1024))
        retriever_logits_ref(ref, q.copy_to_host(stream=stream).astype(np.float64),
                             w.copy_to_host(stream=stream).astype(np.float64), keys_host[:1024],
                             np.array([N], np.int32))
        return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))

    return [
        BenchCase("retriever", f"retriever_query D={D} H={H} DI={DI} rank={rank}",
                  lambda: retriever_query(q, w, x0, lay, cos, sin, None, True, stream),
                  qbytes, qflops),
        BenchCase("retriever", f"retriever_logits N={N} H={H} DI={DI}",
                  lambda: retriever_logits(z0, q, w, keys[0], nv, stream, work=scorer.work),
                  lbytes, lflops, check=check_logits),
        BenchCase("retriever", f"RetrieverScorer.score L={L} N={N} H={H}",
                  lambda: scorer.score(z, xs, 123_456, keys, N, stream),
                  L * (qbytes + lbytes), L * (qflops + lflops), target="<= 2 ms"),
    ]
