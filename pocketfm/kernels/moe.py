"""The MoE sublayer on the GPU (spec §4.11): routing, SwiGLU, combine, and the decode layer.

Decode runs the sublayer as a fixed sequence of launches over buffers allocated once
(``MoEScratch``), so the whole sequence can be captured in a CUDA graph (gpu_notes.md §7)::

    router gemv  logits[1, E]     = W_gate_inp[E, D] · x               (F16 in ds4 files)
    route        ids[k], w[k]     = top-k of sqrt(softplus(logits)) + bias, or tid2eid[token]
    gate/up      gu[j]            = W_gate_up[ids[j]] · x, j < k; gu[k] = shared · x
    swiglu       h[k+1, F]        = w_ext[j] · silu(min(gate, c)) ⊙ clamp(up, ±c); w_ext[k] = 1
    down         down[k+1, D]     = W_down[ids[j]] · h[j]; down[k] = W_shexp_down · h[k]
    combine      out[D]           = Σ_{j<k} down[j] + down[k]

gate and up are best stacked into one weight per expert at load (``fuse_gate_up``): one GEMV
launch then yields both. The shared expert's row sits behind the routed ones in the same
buffers, so one SwiGLU launch serves both when their clamps agree (V4: both 10) and combine
reads one array. The GEMVs live in gemv.py / gemv_lowbit.py; this module only orders them.

Fewer launches where the types allow (each saves a launch and, in a graph, a dependent gap):
- the low-bit ids-GEMV reads the one row x for every id; gemv.py's types take a row per id,
  so for them a ``broadcast`` launch first copies x into x_rep[k, D];
- fused gate/up with a low-bit W_down: the SwiGLU is no launch of its own; the down GEMV's x
  preparation computes h (``gemv_swiglu``, the same float32 bits). Not when the shared expert
  runs in line and shares the routed SwiGLU launch.
V4-Flash in the engine (IQ2_XXS gate/up + Q2_K down routed, Q8_0 shared on a side stream;
a low-bit GEMV is two launches: its x preparation, then the dp4a kernel, or with
``imma_gate_up`` / ``imma_down`` the int8 tensor-core kernels of imma_iq2_xxs.py /
imma_q2_k.py)::

    main:   router gemv -> route -> join x -> gate/up -> SwiGLU x slots (Q2_K) -> down
            -> join -> combine (the engine: no combine; the next layer's HC mix adds the
            parts, moe_layer without ``out``)
    side_x: x slots (IQ2_XXS: the routed gate/up's x, needing x alone)
    side:   shared gate/up -> swiglu -> shared down

Step-dependent inputs are device arrays (``token[1]`` int32, the chosen ``ids``): nothing the
host decides per step reaches a kernel argument. Layer constants (``use_hash``, clamps, the
routed scale) are Python scalars, fixed at capture.
Letters: T tokens, D hidden, E experts, k experts per token, F expert width, V vocabulary.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from .. import ops
from ..quants import GGMLType, random_blocks, type_name
from . import device, imma_iq2_xxs, imma_q2_k
from .bench import BenchCase
from .device import capture_graph, cdiv
from .gemv import gemv, gemv_ref
from .gemv_lowbit import (fuses_swiglu, gemv_prepared, gemv_swiglu, prepare_x, shares_x_row,
                          swiglu_scalar, takes_prepared_x)
from .qweight import QWeight

MAX_E = 512  # experts a route block can hold in shared memory (V4: 256)
MAX_K = 16  # experts per token (V4: 6)


# ---- NumPy references (the spec: thin wrappers over pocketfm.ops) -----------------------------
def route_chunk_ref(out_ids, out_w, logits, bias, tid2eid, tokens, use_hash, routed_scale,
                    normalise) -> None:
    """out_ids[T, k], out_w[T, k] <- logits[T, E]; hash layers read tid2eid[V, k][tokens[T]]."""
    hashed = np.asarray(tid2eid)[np.asarray(tokens)] if use_hash else None
    ops.route(out_ids, out_w, logits, None if use_hash else bias, hashed, routed_scale,
              bool(normalise))


def route_ref(out_ids, out_w, logits, bias, tid2eid, token, use_hash, routed_scale,
              normalise) -> None:
    """Decode form: out_ids[k], out_w[k] <- logits[E]; ``token[1]`` picks the tid2eid row."""
    route_chunk_ref(out_ids[None], out_w[None], logits[None], bias, tid2eid, token, use_hash,
                    routed_scale, normalise)


def swiglu_ref(out_h, gate, up, w, clamp) -> None:
    """out_h[k, F] = w[k] · silu(min(gate, c)) ⊙ clamp(up, -c, c); c <= 0: no clamp."""
    out_h[...] = ops.swiglu(gate, up, clamp) * w[:, None]


def swiglu_fused_ref(out_h, gate_up, w, clamp) -> None:
    """swiglu_ref on gate_up[k, 2F] = [gate | up]."""
    F = out_h.shape[1]
    swiglu_ref(out_h, gate_up[:, :F], gate_up[:, F:], w, clamp)


def broadcast_rows_ref(out, x) -> None:
    """out[R, D]: each row of x[T, D] repeated R / T times (row r = x[r // (R / T)])."""
    out[...] = np.repeat(x, out.shape[0] // x.shape[0], axis=0)


def combine_chunk_ref(out, down_out, shared_out) -> None:
    """out[T, D] = Σ_k down_out[T, k, D] + shared_out[T, D]."""
    out[...] = down_out.sum(axis=1) + shared_out


def combine_ref(out, down_out, shared_out) -> None:
    """out[D] = Σ_k down_out[k, D] + shared_out[D]."""
    combine_chunk_ref(out[None], down_out[None], shared_out[None])


class _Dense:
    """A weight as the ops functions take it (``.dense()``, ``.expert(e)``).

    A ``weights.Tensor`` passes through. A host QWeight is dequantised one expert at a time, on
    first use, by the public ``gemv_ref`` applied to the identity (out[j] = W_e[:, j], exact),
    so every type the gemv modules support works here unchanged.
    """

    def __init__(self, w):
        self.w, self.cache = w, {}

    def expert(self, e: int, dtype=np.float32) -> np.ndarray:  # [N, K]
        w = self.w
        if not isinstance(w, QWeight):
            return w.expert(e, dtype)
        if e not in self.cache:
            planes = tuple(np.ascontiguousarray(np.asarray(p)[e:e + 1]) for p in w.planes)
            cols = np.empty((w.cols, w.rows))  # [K, N] = W_eᵀ
            gemv_ref(cols, QWeight(w.qtype, w.rows, w.cols, 1, planes), np.eye(w.cols))
            self.cache[e] = cols.T
        return self.cache[e].astype(dtype)

    def dense(self, dtype=np.float32) -> np.ndarray:  # [N, K] of a plain weight
        return self.w.dense(dtype) if not isinstance(self.w, QWeight) else self.expert(0, dtype)


def moe_layer_ref(out, x, gate_inp, bias, tid2eid, token, use_hash, gate_exps, up_exps,
                  down_exps, shared_gate, shared_up, shared_down, clamp, clamp_shared,
                  routed_scale, scratch=None, normalise=1) -> None:
    """out[1, D] <- x[1, D] through ops.route / ops.moe_experts / ops.shared_expert on the
    dequantised weights: QWeights with host planes, or the model's ``weights.Tensor``s (only
    the selected experts are dequantised). ``scratch`` is unused."""
    dt = out.dtype
    E, k = len(bias), np.asarray(tid2eid).shape[1]
    logits = np.empty((1, E), dt)
    ops.matmul(logits, _Dense(gate_inp), x)
    ids, w = np.empty((1, k), np.int64), np.empty((1, k), dt)
    route_chunk_ref(ids, w, logits, bias, tid2eid, token, use_hash, routed_scale, normalise)
    ops.moe_experts(out, x, ids, w, _Dense(gate_exps), _Dense(up_exps), _Dense(down_exps), clamp)
    if shared_gate is not None:
        sh = np.empty_like(out)
        ops.shared_expert(sh, x, _Dense(shared_gate), _Dense(shared_up), _Dense(shared_down),
                          clamp_shared)
        out += sh


# ---- routing kernels ----------------------------------------------------------------------
@cuda.jit(device=True)
def _score(x):
    """s = sqrt(softplus(x)), softplus = log1p(exp(x)) taken as x above 20: there the two differ
    below float32 resolution, and exp(x) would overflow from 88 on."""
    return float32(math.sqrt(x if x > 20.0 else math.log1p(math.exp(x))))


@device.kernel
def _route_serial(out_ids, out_w, logits, bias, tid2eid, tokens, use_hash, routed_scale,
                  normalise):
    """Naive: one thread per token, k passes over the E scores.

    Pass j takes the best entry strictly below pass j-1's pick in the order (score desc, index
    asc), which is exactly a stable argsort's order: ties go to the lowest index.
    """
    t = cuda.grid(1)
    if t >= logits.shape[0]:
        return
    E = logits.shape[1]
    k = out_ids.shape[1]
    prev_v = float32(0.0)
    prev_e = -1
    tot = float32(0.0)
    for j in range(k):
        if use_hash:
            best = int32(tid2eid[tokens[t], j])
        else:
            best = -1
            best_v = float32(0.0)
            for e in range(E):
                v = _score(logits[t, e]) + bias[e]
                below = prev_e < 0 or v < prev_v or (v == prev_v and e > prev_e)
                if below and (best < 0 or v > best_v):
                    best, best_v = e, v
            prev_v, prev_e = best_v, best
        out_ids[t, j] = best
        tot += _score(logits[t, best])
    for j in range(k):
        wv = _score(logits[t, out_ids[t, j]])
        if normalise:
            wv = wv / tot
        out_w[t, j] = wv * routed_scale


GROUP = 32  # experts per group in the first round of _route_group_rank
MAX_CAND = MAX_E // GROUP * MAX_K  # candidate slots after that round


@device.kernel
def _route_group_rank(out_ids, out_w, logits, bias, tid2eid, tokens, use_hash, routed_scale,
                      normalise):
    """One block per token; top-k by counting ranks in the order (score desc, index asc).

    An expert's rank is how many entries beat it; it is selected iff rank < k, in slot rank.
    Counting against all E entries costs E steps per thread (V4: 256), so it runs in two rounds:
    1. rank within its group of 32 experts; the group's top k fill candidate slots g·k + rank;
    2. each candidate counts only the candidates that beat it (G·k steps, V4: 48).
    Exact: whatever beats a global top-k expert is itself in the global top-k, hence in its
    group's top k, hence a candidate; a candidate outside the top k is beaten by the k
    selected, all candidates, so its count is >= k too.
    """
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    E = logits.shape[1]
    k = out_ids.shape[1]
    G = (E + GROUP - 1) // GROUP
    s = cuda.shared.array(MAX_E, float32)  # unbiased scores: they give the weights
    sel = cuda.shared.array(MAX_E, float32)  # biased scores: they only pick
    cand = cuda.shared.array(MAX_CAND, int32)  # [G, k] expert ids, -1: none
    cand_v = cuda.shared.array(MAX_CAND, float32)  # their sel values (no dependent loads)
    ids = cuda.shared.array(MAX_K, int32)
    for e in range(tid, E, nt):
        v = _score(logits[t, e])
        s[e] = v
        sel[e] = v + bias[e]
    if use_hash:
        for j in range(tid, k, nt):
            ids[j] = tid2eid[tokens[t], j]
    cuda.syncthreads()
    if not use_hash:
        for e in range(tid, E, nt):  # round 1: rank within the group
            v = sel[e]
            lo = e - e % GROUP
            rank = 0
            for i in range(GROUP):  # a constant trip count: the compiler unrolls it
                j = lo + i
                if j < E:
                    o = sel[j]
                    if o > v or (o == v and j < e):
                        rank += 1
            if rank < k:
                cand[lo // GROUP * k + rank] = e
                cand_v[lo // GROUP * k + rank] = v
        for c in range(tid, G * k, nt):  # slots a short last group leaves empty
            if c % k >= min(GROUP, E - c // k * GROUP):
                cand[c] = -1
        cuda.syncthreads()
        for c in range(tid, G * k, nt):  # round 2: rank among the candidates
            e = cand[c]
            if e >= 0:
                v = cand_v[c]
                rank = 0
                for i in range(G * k):
                    f = cand[i]
                    o = cand_v[i]
                    if f >= 0 and (o > v or (o == v and f < e)):
                        rank += 1
                if rank < k:
                    ids[rank] = e
    cuda.syncthreads()
    for j in range(tid, k, nt):
        tot = float32(0.0)
        for i in range(k):  # k <= 16: each writer sums redundantly rather than wait on one
            tot += s[ids[i]]
        wv = s[ids[j]]
        if normalise:
            wv = wv / tot
        out_ids[t, j] = ids[j]
        out_w[t, j] = wv * routed_scale


# (A warp a token instead of _route_group_rank's block, lane l holding experts l, l + 32, ..
# and the k picks made by xor-butterfly argmaxes, no barrier: the same bits, but slower in the
# step, 6.000 against 5.906 ms, H100, 30 layers, BENCHMARKS 2026-12-07 (aa): one warp does 8
# scores a lane and k rounds of 15 dependent shuffles with no other warp to hide them. Removed.)
def route_chunk(out_ids, out_w, logits, bias, tid2eid, tokens, use_hash: int,
                routed_scale: float, normalise: int, stream=0, threads=None,
                naive: bool = False) -> None:
    """Pick k experts per token: out_ids[T, k] int32, out_w[T, k] f32 <- logits[T, E] f32.

    Selection: top-k of s + bias[E] (s = sqrt(softplus(logits)); ties to the lowest index), or
    on hash layers (``use_hash``) the row tid2eid[V, k] int32 [tokens[T] int32]. Weights: s at
    the chosen ids, divided by their sum if ``normalise``, times ``routed_scale``. ``bias``,
    ``tid2eid`` and ``tokens`` are always passed (a dummy where the layer does not use them),
    so a captured graph reads the current token from device memory.
    """
    T, E = logits.shape
    k = out_ids.shape[1]
    if E > MAX_E or k > MAX_K:
        raise ValueError(f"route: E={E}, k={k} exceed MAX_E={MAX_E}, MAX_K={MAX_K}")
    args = (out_ids, out_w, logits, bias, tid2eid, tokens, int32(use_hash),
            float32(routed_scale), int32(normalise))
    if naive:
        nt = threads or 128
        _route_serial[cdiv(T, nt), nt, stream](*args)
    else:
        nt = threads or min(1024, cdiv(E, 32) * 32)
        _route_group_rank[T, nt, stream](*args)


def route(out_ids, out_w, logits, bias, tid2eid, token, use_hash: int, routed_scale: float,
          normalise: int, stream=0, threads=None) -> None:
    """Decode form: out_ids[k], out_w[k] <- logits[E]; token[1] int32 (see route_chunk)."""
    k, E = out_ids.shape[0], logits.shape[0]
    route_chunk(out_ids.reshape(1, k), out_w.reshape(1, k), logits.reshape(1, E), bias,
                tid2eid, token, use_hash, routed_scale, normalise, stream, threads)


# ---- elementwise kernels (grid-stride; at decode sizes one wave of blocks) -----------------
def _blocks(out, nt: int) -> int:
    return min(cdiv(out.shape[0] * out.shape[1], nt), 1024)


@device.kernel
def _swiglu_elementwise(out_h, gate, up, w, clamp, up_col):
    """Grid-stride over the k·F elements; the routing weight rides along per row. ``up`` is
    read from column ``up_col`` on: 0 for its own array, F when gate and up share one [k, 2F]
    output of a fused gate+up GEMV."""
    k, F = out_h.shape
    for i in range(cuda.grid(1), k * F, cuda.gridsize(1)):
        r = i // F
        c = i - r * F
        # the formula lives in gemv_lowbit, whose fused down preparation must match it bitwise
        out_h[r, c] = swiglu_scalar(gate[r, c], up[r, up_col + c], w[r], clamp)


def _swiglu_launch(out_h, gate, up, w, clamp, up_col, stream, threads):
    nt = threads or 256
    _swiglu_elementwise[_blocks(out_h, nt), nt, stream](out_h, gate, up, w, float32(clamp),
                                                        int32(up_col))


def swiglu(out_h, gate, up, w, clamp: float, stream=0, threads=None) -> None:
    """out_h[k, F] = w[k] · silu(min(gate, c)) ⊙ clamp(up, -c, c) (c <= 0: no clamp).

    For the shared expert pass w = a ones array.
    """
    _swiglu_launch(out_h, gate, up, w, clamp, 0, stream, threads)


def swiglu_fused(out_h, gate_up, w, clamp: float, stream=0, threads=None) -> None:
    """As swiglu with gate = gate_up[:, :F] and up = gate_up[:, F:] (gate_up [k, 2F]: the output
    of a GEMV over a ``fuse_gate_up`` weight)."""
    _swiglu_launch(out_h, gate_up, gate_up, w, clamp, out_h.shape[1], stream, threads)


@device.kernel
def _combine_sum(out, down_out, shared_out):
    """Grid-stride over T·D outputs; each sums its k expert rows (coalesced along D)."""
    T, D = out.shape
    k = down_out.shape[1]
    for i in range(cuda.grid(1), T * D, cuda.gridsize(1)):
        t = i // D
        d = i - t * D
        acc = shared_out[t, d]
        for j in range(k):
            acc += down_out[t, j, d]
        out[t, d] = acc


def combine_chunk(out, down_out, shared_out, stream=0, threads=None) -> None:
    """out[T, D] f32 = Σ_k down_out[T, k, D] + shared_out[T, D] (weights applied before down)."""
    nt = threads or 256
    _combine_sum[_blocks(out, nt), nt, stream](out, down_out, shared_out)


def combine(out, down_out, shared_out, stream=0, threads=None) -> None:
    """Decode form: out[D] = Σ_k down_out[k, D] + shared_out[D]."""
    (k, D) = down_out.shape
    combine_chunk(out.reshape(1, D), down_out.reshape(1, k, D), shared_out.reshape(1, D),
                  stream, threads)


@device.kernel
def _broadcast_rows_copy(out, x):
    """Grid-stride over the R·D outputs."""
    R, D = out.shape
    rep = R // x.shape[0]
    for i in range(cuda.grid(1), R * D, cuda.gridsize(1)):
        r = i // D
        out[r, i - r * D] = x[r // rep, i - r * D]


def broadcast_rows(out, x, stream=0, threads=None) -> None:
    """out[R, D] <- x[T, D], each row repeated R / T times: the k inputs of an ids-gemv per
    token (decode: T = 1), or the HC streams of a chunk's embeddings."""
    if out.shape[0] % x.shape[0] or out.shape[1] != x.shape[1]:
        raise ValueError(f"broadcast_rows: out {out.shape} is not whole repeats of x {x.shape}")
    nt = threads or 256
    _broadcast_rows_copy[_blocks(out, nt), nt, stream](out, x)



# ---- the decode sublayer ------------------------------------------------------------------
def fuse_gate_up(gate: QWeight, up: QWeight) -> QWeight:
    """One weight [E, 2F, D] from gate and up [E, F, D] (host planes, once at load): rows
    stacked per expert, so one GEMV launch yields both projections, [k, 2F] = [gate | up].
    Every packed plane has leading dims [E, N] (qweight.py), so this holds for any type.
    V4-Flash on the H200: the ids-GEMV pair 67 µs -> 49 µs, the shared pair 20 -> 18 µs."""
    assert (gate.qtype, gate.experts, gate.rows, gate.cols) == \
        (up.qtype, up.experts, up.rows, up.cols)
    planes = tuple(np.concatenate([np.asarray(g), np.asarray(u)], axis=1)
                   for g, u in zip(gate.planes, up.planes))
    return QWeight(gate.qtype, 2 * gate.rows, gate.cols, gate.experts, planes)


class MoEScratch:
    """Every intermediate buffer of one decode MoE call, allocated once and reused per step.

    The shared expert owns row k of the projection, ``h`` and ``down`` buffers (module
    docstring). Views over the routed rows [:k] and the shared row [k:] are taken here, once:
    a call builds no device-array objects (host time; nothing may allocate inside a graph).
    """

    def __init__(self, D: int, F: int, E: int, k: int, stream=0):
        f32 = np.float32

        def buf(*shape, dtype=f32):
            return cuda.device_array(shape, dtype, stream=stream)
        self.D, self.F, self.E, self.k = D, F, E, k
        self.logits = buf(1, E)  # [1, E] router logits
        self.ids = buf(1, k, dtype=np.int32)  # [1, k] chosen experts
        # [k + 1] routing weights, then 1.0 for the shared expert
        self.w_ext = cuda.to_device(np.ones(k + 1, f32), stream=stream)
        self.x_rep = buf(k, D)  # [k, D] x in every row (for routed experts not low-bit)
        self.gate, self.up = buf(k + 1, F), buf(k + 1, F)  # [k + 1, F] each
        self.gate_up = buf(k + 1, 2 * F)  # [k + 1, 2F] when gate and up are fused
        self.h = buf(k + 1, F)  # [k + 1, F] SwiGLU output (not written where gemv_swiglu fuses it)
        self.down = buf(k + 1, D)  # [k + 1, D]
        self.zero = cuda.to_device(np.zeros((1, D), f32), stream=stream)  # no shared expert
        self.ids_k = self.ids.reshape(k)  # [k] as the ids-GEMV takes them
        self.w_routed = self.w_ext[:k].reshape(1, k)  # [1, k] as route_chunk writes them
        self.w_k, self.w_one = self.w_ext[:k], self.w_ext[k:]
        self.routed = {n: getattr(self, n)[:k] for n in ("gate", "up", "gate_up", "h", "down")}
        self.shared = {n: getattr(self, n)[k:] for n in ("gate", "up", "gate_up", "h", "down")}
        self.down_r3 = self.routed["down"].reshape(1, k, D)  # [1, k, D] for combine_chunk
        # [1, k + 1, D]: the routed rows, then the shared row: the sublayer's output in parts
        # (moe_layer without ``out``), summed by their reader in combine's order
        self.parts = self.down.reshape(1, k + 1, D)

    @classmethod
    def allocate(cls, D: int, F: int, E: int, k: int, stream=0) -> "MoEScratch":
        return cls(D, F, E, k, stream)

    @property
    def nbytes(self) -> int:
        """Device bytes of the buffers (engine/layout.py's moe_scratch_specs must agree)."""
        owned = ("logits", "ids", "w_ext", "x_rep", "gate", "up", "gate_up", "h", "down", "zero")
        return sum(int(getattr(self, n).nbytes) for n in owned)


def _swiglu_down(rows, w_down, g, u, col, weights, clamp, ids, stream, threads,
                 imma_down=False, down_flat=False) -> None:
    """rows["down"] = W_down[ids] · h, h = weights · SwiGLU(rows[g], rows[u]): h made inside the
    down GEMV's x preparation (gemv_swiglu, one launch fewer, rows["h"] left unwritten) when
    gate and up are fused and W_down is low-bit (with ``imma_down`` and Q2_K: imma_q2_k's int8
    tensor-core kernel; with ``down_flat`` the dp4a kernel's flat-offset build), else the SwiGLU
    launch into rows["h"] first."""
    if g == u and imma_down and imma_q2_k.takes_imma_q2_k(w_down):
        imma_q2_k.gemv_swiglu_imma(rows["down"], w_down, rows[g], weights, clamp, ids, stream)
    elif g == u and fuses_swiglu(w_down, threads):
        gemv_swiglu(rows["down"], w_down, rows[g], weights, clamp, ids, stream, threads,
                    down_flat)
    else:
        _swiglu_launch(rows["h"], rows[g], rows[u], weights, clamp, col, stream, threads)
        gemv(rows["down"], w_down, rows["h"], ids, stream, threads)


def moe_layer(out, x, gate_inp, bias, tid2eid, token, use_hash: int, gate_exps, up_exps,
              down_exps, shared_gate, shared_up, shared_down, clamp: float, clamp_shared: float,
              routed_scale: float, scratch: MoEScratch, normalise: int = 1, stream=0,
              threads=None, side=None, side_x=None, imma_gate_up=False,
              imma_down: bool = False, down_flat: bool = False) -> None:
    """The decode MoE sublayer: out[1, D] f32 <- x[1, D] f32 (the ffn_norm output), §4.11.

    gate_inp: QWeight [E, D] router; bias [E] f32; tid2eid [V, k] int32 and token [1] int32
    (read on hash layers only, ``use_hash``); gate_exps / up_exps: QWeight [E × F, D], or
    ``up_exps=None`` with gate_exps = fuse_gate_up(gate, up) [E × 2F, D]; down_exps: QWeight
    [E × D, F]; shared_gate / shared_up / shared_down likewise [F, D] / [D, F] (fused when the
    routed ones are), or all None: no shared expert. ``clamp`` / ``clamp_shared``: SwiGLU
    clamps (<= 0: none). ``side``: a device.SideStream; the shared expert then runs on it,
    beside the routed chain. ``side_x``: another one; the routed gate/up's x preparation
    (low-bit dp4a) then runs on it beside the router and the routing. ``imma_gate_up`` (True,
    or a name of imma_iq2_xxs.CANDIDATES): the fused routed gate/up on imma_iq2_xxs.py's int8
    kernel where it takes the weight (IQ2_XXS), instead of the dp4a one (its x preparation on
    ``side_x`` alike); ``imma_down``: the routed down on imma_q2_k's kernel where it takes the
    weight (Q2_K, gate and up fused); ``down_flat``: its dp4a kernel reading by flat offsets
    (gemv_lowbit.FLAT_DECODE, a candidate). Launches only, into ``scratch``: graph-capturable.
    Which launches depends on the weight types (module docstring); the fusions change no bit
    of the result. ``out`` None (with a shared expert): no combine launch; the output is left
    in parts, ``scratch.parts`` [1, k + 1, D], for a reader that adds them in combine's order
    (the shared row, then the routed ones: hc's Gram mix, which makes the next HC post).
    """
    sc, F = scratch, scratch.F
    fused, has_shared = up_exps is None, shared_gate is not None
    assert out is not None or has_shared, "the output in parts needs the shared expert's row"
    assert not (fused and has_shared and shared_up is not None), "fuse both or neither"
    R, S = sc.routed, sc.shared
    g, u, col = ("gate_up", "gate_up", F) if fused else ("gate", "up", 0)
    # one SwiGLU launch over all k + 1 rows when the clamps agree (V4: both 10) and the shared
    # expert runs in line with the routed ones
    one_swiglu = has_shared and clamp == clamp_shared and side is None
    if has_shared:
        ss = stream if side is None else side.fork(stream)
        if fused:
            gemv(S["gate_up"], shared_gate, x, None, ss, threads)
        else:
            gemv(S["gate"], shared_gate, x, None, ss, threads)
            gemv(S["up"], shared_up, x, None, ss, threads)
        if not one_swiglu:
            _swiglu_down(S, shared_down, g, u, col, sc.w_one, clamp_shared, None, ss, threads)
    # the routed gate/up's kernel and x preparation: imma's tensor cores or the dp4a GEMV
    on_imma = bool(imma_gate_up) and fused and imma_iq2_xxs.takes_imma(gate_exps)
    build = None if imma_gate_up is True else imma_gate_up  # (a name: one of its candidates)
    sb = imma_iq2_xxs.needs_super_block_x(build)  # (its x scaled per super-block)
    prepared = None  # x for the routed gate/up, made beside the router: it needs only x
    if side_x is not None and on_imma:
        prepared = imma_iq2_xxs.prepare_x(x, side_x.fork(stream), sb)
    elif side_x is not None and fused and takes_prepared_x(gate_exps, threads):
        prepared = prepare_x(gate_exps, x, side_x.fork(stream))
    gemv(sc.logits, gate_inp, x, None, stream, threads)
    # (the routing inside the SM-wide gate+up's launch, every block picking the experts itself,
    # measured slower: 6.048 against 5.977 ms a step, H100, 30 layers, BENCHMARKS 2026-12-07
    # (ab); removed)
    route_chunk(sc.ids, sc.w_routed, sc.logits, bias, tid2eid, token, use_hash, routed_scale,
                normalise, stream, threads)
    # the low-bit ids-GEMVs read the one row x for every id; gemv.py's types want k copies
    one_x = all(shares_x_row(w) for w in (gate_exps, up_exps) if w is not None)
    if not one_x:
        broadcast_rows(sc.x_rep, x, stream, threads)
    x_ids = x if one_x else sc.x_rep
    if prepared is not None:
        side_x.join(stream)
        if on_imma:
            imma_iq2_xxs.gemv_prepared(R["gate_up"], gate_exps, prepared, sc.ids_k, stream, build)
        else:
            gemv_prepared(R["gate_up"], gate_exps, prepared, sc.ids_k, stream, threads)
    elif on_imma:
        imma_iq2_xxs.gemv_prepared(R["gate_up"], gate_exps,
                                   imma_iq2_xxs.prepare_x(x, stream, sb), sc.ids_k, stream, build)
    elif fused:
        gemv(R["gate_up"], gate_exps, x_ids, sc.ids_k, stream, threads)
    else:
        gemv(R["gate"], gate_exps, x_ids, sc.ids_k, stream, threads)
        gemv(R["up"], up_exps, x_ids, sc.ids_k, stream, threads)
    if one_swiglu:
        _swiglu_launch(sc.h, getattr(sc, g), getattr(sc, u), sc.w_ext, clamp, col, stream,
                       threads)
        gemv(R["down"], down_exps, R["h"], sc.ids_k, stream, threads)
        gemv(S["down"], shared_down, S["h"], None, stream, threads)
    else:
        _swiglu_down(R, down_exps, g, u, col, sc.w_k, clamp, sc.ids_k, stream, threads,
                     imma_down, down_flat)
    if has_shared and side is not None:
        side.join(stream)
    if out is not None:
        combine_chunk(out, sc.down_r3, S["down"] if has_shared else sc.zero, stream, threads)


# ---- benchmarks (H200, V4-Flash shapes) ---------------------------------------------------
class _Tiled:
    """A stacked ``weights.Tensor`` of P experts standing for E = P·r of them (e -> e mod P)."""

    def __init__(self, t, period):
        self.t, self.period = t, period

    def expert(self, e, dtype=np.float32):
        return self.t.expert(e % self.period, dtype)


def _bench_weight(qtype, E, N, K, rng, unique=16):
    """(host QWeight of E experts, the weights.Tensor the reference reads). Only ``unique``
    experts are drawn; their packed planes are tiled to E, so every expert still has its own
    device bytes (no cache sharing) while the host setup takes seconds, not minutes."""
    from ..weights import Tensor
    from .gemv import pack_weight
    P = min(E, unique)
    raw = random_blocks(qtype, (P, N, K) if E > 1 else (N, K), rng, 0.02)
    w = pack_weight(raw, qtype, N, K)
    planes = tuple(np.tile(np.asarray(p), (E // P, 1, 1)) for p in w.planes)
    t = Tensor(type_name(qtype), qtype, (K, N, P) if E > 1 else (K, N), raw)
    return QWeight(qtype, N, K, E, planes), (_Tiled(t, P) if E > 1 else t)


def _router_then_route(sc, router, x, bias, tid2eid, token, stream) -> None:
    """The router GEMV, then the routing: moe_layer's first two launches (10.2 µs, H100,
    2026-12-06; the routing in the GEMV's last block instead, one launch, took 15.1 and was
    removed)."""
    gemv(sc.logits, router, x, None, stream)
    route_chunk(sc.ids, sc.w_routed, sc.logits, bias, tid2eid, token, 0, 1.5, 1, stream)


def bench_cases(stream) -> list[BenchCase]:
    """route / swiglu at decode shapes (20 launches per CUDA graph), and the whole decode MoE at
    V4-Flash shapes: F16 router, IQ2_XXS gate/up (fused) + Q2_K down routed, Q8_0 shared
    (fused gate/up). The graph runs the layer for 4 tokens, each with its own x (so its own
    experts) and its own router and shared-expert copies: ~285 MB per replay, so L2 (60 MB)
    serves nothing twice. ``eager`` is one layer launched from Python, for contrast."""
    rng = np.random.default_rng()
    D, F, E, k, reps = 4096, 2048, 256, 6, 20
    f32 = np.float32

    def dev(a):
        return cuda.to_device(np.ascontiguousarray(a), stream=stream)
    bias_h = rng.normal(0, 0.1, E).astype(f32)
    bias, logits = dev(bias_h), dev(rng.normal(0, 1.5, (1, E)).astype(f32))
    tid2eid, token = dev(rng.integers(0, E, (8, k)).astype(np.int32)), dev(np.zeros(1, np.int32))
    sc = MoEScratch.allocate(D, F, E, k, stream)
    sc.gate_up.copy_to_device(rng.normal(0, 3, (k + 1, 2 * F)).astype(f32), stream=stream)
    rw = _bench_weight(GGMLType.F16, 1, E, D, rng)[0].to_device(stream)
    x1 = dev(rng.normal(0, 1, (1, D)).astype(f32))
    cases = [
        BenchCase("moe", f"route E={E} k={k} (x{reps} per graph)", capture_graph(
            [lambda: route_chunk(sc.ids, sc.w_routed, logits, bias, tid2eid, token, 0, 1.5, 1,
                                 stream)] * reps, stream), bytes=reps * (2 * E * 4 + k * 8), launches=reps),
        BenchCase("moe", f"router F16 {E}x{D} + route E={E} k={k}, two launches "
                  f"(x{reps} per graph)",
                  capture_graph([lambda: _router_then_route(sc, rw, x1, bias, tid2eid, token,
                                                            stream)] * reps, stream),
                  bytes=reps * (E * D * 2 + D * 4), launches=reps),
        BenchCase("moe", f"swiglu_fused k={k}+1 F={F} (x{reps} per graph)", capture_graph(
            [lambda: swiglu_fused(sc.h, sc.gate_up, sc.w_ext, 10.0, stream)] * reps, stream),
            bytes=reps * (3 * (k + 1) * F * 4 + (k + 1) * 4), launches=reps),
    ]
    (g, t_gate), (u, t_up) = (_bench_weight(GGMLType.IQ2_XXS, E, F, D, rng) for _ in "gu")
    gate_up = fuse_gate_up(g, u).to_device(stream)
    down, t_down = _bench_weight(GGMLType.Q2_K, E, D, F, rng)
    down = down.to_device(stream)
    tokens = []
    for _ in range(4):
        router, t_router = _bench_weight(GGMLType.F16, 1, E, D, rng)
        (sg, t_sg), (su, t_su), (sd, t_sd) = (_bench_weight(GGMLType.Q8_0, 1, n, kk, rng)
                                              for n, kk in ((F, D), (F, D), (D, F)))
        xh = rng.normal(size=(1, D)).astype(f32)
        tokens.append(dict(x=dev(xh), xh=xh, out=cuda.device_array((1, D), f32),
                           w=(router.to_device(stream), fuse_gate_up(sg, su).to_device(stream),
                              sd.to_device(stream)), ref=(t_router, t_sg, t_su, t_sd)))

    def layer(tk):
        router, shared_gu, shared_down = tk["w"]
        return lambda: moe_layer(tk["out"], tk["x"], router, bias, tid2eid, token, 0, gate_up,
                                 None, down, shared_gu, None, shared_down, 10.0, 10.0, 1.5, sc,
                                 stream=stream)

    def check(tk=tokens[-1]):
        ref = np.empty((1, D))
        r, sg, su, sd = tk["ref"]
        moe_layer_ref(ref, tk["xh"].astype(np.float64), r, bias_h, np.zeros((1, k), np.int32),
                      np.zeros(1, np.int32), 0, t_gate, t_up, t_down, sg, su, sd, 10.0, 10.0,
                      1.5)
        got = tk["out"].copy_to_host(stream=stream)
        stream.synchronize()
        return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

    per_token = (k * (2 * F * D * 66 // 256 + D * F * 84 // 256)  # routed: IQ2_XXS, Q2_K
                 + 3 * F * D * 34 // 32 + E * D * 2  # shared Q8_0, router F16
                 + 2 * D * 4 + E * 4)  # x, out, bias
    shape = f"D={D} F={F} E={E} k={k} IQ2_XXS+Q2_K, Q8_0 shared"
    return cases + [
        BenchCase("moe", f"moe_layer {shape} (graph, 4 tokens)",
                  capture_graph([layer(tk) for tk in tokens], stream), bytes=4 * per_token,
                  target=">= 70% of copy bw on the bytes it must read", check=check,
                  launches=len(tokens)),
        BenchCase("moe", f"moe_layer {shape} (eager)", layer(tokens[0]), bytes=per_token),
    ]


# ---- CI lane B: every kernel with the exact argument types its launcher passes ---------------
_ROUTE_SIG = ("void(int32[:, ::1], float32[:, ::1], float32[:, ::1], float32[::1], int32[:, ::1],"
              " int32[::1], int32, float32, int32)")
PTX_SIGNATURES = [
    (_route_serial, _ROUTE_SIG),
    (_route_group_rank, _ROUTE_SIG),
    (_swiglu_elementwise,
     "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[::1], float32, int32)"),
    (_combine_sum, "void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1])"),
    (_broadcast_rows_copy, "void(float32[:, ::1], float32[:, ::1])"),
]
