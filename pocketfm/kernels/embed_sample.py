"""Token embedding and sampling kernels: the first and the last op of a decode step.

Dimension letters: T tokens, D hidden, V vocabulary (129280 in V4).

- ``embed``: out[T, D] = table[tokens] for F32 (float32), F16 (float16) and BF16 (stored as
  uint16 bits: no bf16 type in the simulator; decoded with kvpack.bf16_decode) tables.
- ``argmax``: greedy decoding, ties to the lowest id (as np.argmax; logits must not be NaN).
- ``sample_top_p``: temperature + nucleus sampling with a uniform u drawn by the caller. The
  reference ``sample_top_p_ref`` is the definition (pocketfm.generate samples with it on the CPU,
  so CPU and GPU draw the same ids from the same u):

  1. p = softmax(logits / temperature);
  2. keep = the smallest set of highest-probability tokens whose mass is >= top_p, i.e. every
     token with p >= tau, tau the largest threshold that still keeps mass >= top_p (ties at tau
     all kept; top_p >= 1 keeps everything);
  3. the id is the first kept id, in ASCENDING id order, whose cumulative renormalised mass
     exceeds u (u in [0, 1); if rounding leaves none, the last kept id).

  The kernel is one block (sampling runs once per token): the max, then tau by a radix
  select on order-preserving integer keys of the logits (kept = key >= lambda is the same set,
  p being monotone in the logit; equal logits share a key, so ties stay together), 1-3
  histogram passes of fixed-point masses; then the ordered inverse CDF as an exact block prefix
  sum over contiguous per-thread id chunks. exp is float32, so the float64 reference can differ
  only when u or top_p falls within ~1e-7 of a cumulative-mass boundary.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .. import ops
from ..generate import sample_top_p_ref  # noqa: F401  (the reference, numpy-only)
from ..quants import bf16_to_float32
from . import device
from .bench import BenchCase
from .device import cdiv
from .kvpack import bf16_decode
from .device import block_max_warps, block_sum_warps

MAX_THREADS = 1024


# ---- embedding ----------------------------------------------------------------------------------
class _Table:
    """``Tensor.dense`` over a float32 / float16 / bf16-bits (uint16) [V, D] table."""

    def __init__(self, a):
        self.a = np.asarray(a)

    def dense(self, dtype=np.float32):
        a = bf16_to_float32(self.a) if self.a.dtype == np.uint16 else self.a
        return a.astype(dtype)


def embed_ref(out, table, tokens) -> None:
    """out[T, D] = table[tokens] (table float32, float16, or uint16 bf16 bits [V, D])."""
    ops.embed(out, _Table(table), np.asarray(tokens))


@device.kernel
def _embed_rows(out, table, tokens):
    """Block (d-chunk, t): one element per thread; F32 and F16 tables (compiled per dtype)."""
    t = cuda.blockIdx.y
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if d < out.shape[1]:
        out[t, d] = np.float32(table[tokens[t], d])


@device.kernel
def _embed_bf16(out, table, tokens):
    """As _embed_rows for a BF16 table held as uint16 bits."""
    t = cuda.blockIdx.y
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if d < out.shape[1]:
        b = np.int32(table[tokens[t], d])
        out[t, d] = bf16_decode(b & 255, b >> 8)


def embed(out, table, tokens, stream=0, threads=None) -> None:
    """Launcher: out [T, D] float32, table [V, D] float32 / float16 / uint16 (bf16 bits),
    tokens [T] int32 (device arrays)."""
    T, D = out.shape
    nt = threads or 256
    kern = _embed_bf16 if table.dtype == np.uint16 else _embed_rows
    kern[(cdiv(D, nt), T), nt, stream](out, table, tokens)


# ---- argmax -------------------------------------------------------------------------------------
def argmax_ref(out_id, logits) -> None:
    """out_id[0] = the lowest id of the largest logit."""
    out_id[0] = int(np.argmax(logits))


@cuda.jit(device=True)
def _block_argmax(v, i, scratch, wsum):
    """(max v, lowest i holding it) over the block, returned to every thread. i < 2**24."""
    m = block_max_warps(v, scratch, wsum)
    cand = np.float32(-i) if v == m else np.float32(-(1 << 24))
    return m, np.int32(-block_max_warps(cand, scratch, wsum))


@device.kernel
def _argmax_partials(vals, ids, logits):
    """Block b: the best (value, lowest id) of its grid-stride share, into vals[b], ids[b]."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    wsum = cuda.shared.array(32, np.float32)
    buf = cuda.local.array(UNROLL, np.float32)
    V = logits.shape[0]
    best, bi = np.float32(-math.inf), np.int32(V)
    stride = cuda.gridDim.x * cuda.blockDim.x
    for i0 in range(cuda.grid(1), V, stride * UNROLL):
        for k in range(UNROLL):  # UNROLL loads in flight
            buf[k] = logits[min(i0 + k * stride, V - 1)]
        for k in range(UNROLL):  # ids increase: strict > keeps the first
            if i0 + k * stride < V and (buf[k] > best or bi == V):
                best, bi = buf[k], np.int32(i0 + k * stride)
    m, mi = _block_argmax(best, bi, scratch, wsum)
    if cuda.threadIdx.x == 0:
        vals[cuda.blockIdx.x] = m
        ids[cuda.blockIdx.x] = mi


@device.kernel
def _argmax_finish(out_id, vals, ids):
    """One block: the best of the per-block partials (ties: lowest id)."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    wsum = cuda.shared.array(32, np.float32)
    n = vals.shape[0]
    best, bi = np.float32(-math.inf), np.int32(1 << 24)
    for b in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        if vals[b] > best or (vals[b] == best and ids[b] < bi):
            best, bi = vals[b], ids[b]
    m, mi = _block_argmax(best, bi, scratch, wsum)
    if cuda.threadIdx.x == 0:
        out_id[0] = mi


_WORK: dict = {}  # argmax partials per block count, allocated once (before any graph capture)


def argmax(out_id, logits, stream=0, threads=None, naive=False) -> None:
    """Launcher: out_id [1] int32, logits [V] float32. ``naive``: one block does it all.

    The split version spreads the read over ~V / (4 * threads) blocks, then one block reduces
    their partials (kept in a module-level buffer allocated on first use).
    """
    V = logits.shape[0]
    assert V < 1 << 24
    nt = threads or 256
    assert nt % 32 == 0 and nt <= MAX_THREADS
    if naive:
        vals, ids = _work(1)
        _argmax_partials[1, nt, stream](vals, ids, logits)
        _argmax_finish[1, 32, stream](out_id, vals, ids)
        return
    nb = max(1, min(1024, cdiv(V, 4 * nt)))
    vals, ids = _work(nb)
    _argmax_partials[nb, nt, stream](vals, ids, logits)
    _argmax_finish[1, min(MAX_THREADS, 32 * cdiv(nb, 32)), stream](out_id, vals, ids)


def _work(nb):
    if nb not in _WORK:
        _WORK[nb] = (cuda.device_array(nb, np.float32), cuda.device_array(nb, np.int32))
    return _WORK[nb]


# ---- temperature + top-p sampling ---------------------------------------------------------------
# Kernel constants. Masses are fixed point, round(e * 2**40) with e = exp((l - max) / T) <= 1, in
# int64 (V * 2**40 < 2**63): integer sums are exact in any order, so the histogram atomics, the
# prefix scan and the final walk agree bit for bit and a given u always picks the same id.
FIX = 2.0 ** 40
UNROLL = 8  # loads in flight per thread: one block must hide L2 latency on its own
RADIX = 11  # key bits resolved per histogram pass
NBUCKET = 1 << RADIX
SAMPLE_THREADS = 512  # the kernel's registers do not fit a 1024-thread block (H200)


@cuda.jit(device=True)
def _key(b):
    """Order-preserving key in [0, 2**32) of a float32 given as its int32 bits; -0.0 -> +0.0."""
    k = np.int64(b)
    if k == -2147483648:
        k = 0
    return k + 2147483648 if k >= 0 else -1 - k


@cuda.jit(device=True)
def _key_floor(x):
    """A key <= that of every float32 >= x (finite float64 x): x rounded down to a signed power
    of two, built from frexp (no bit casts in kernels) -- at most an octave below the true key."""
    if x == 0.0:
        return np.int64(2147483648)
    m, e = math.frexp(abs(x))  # |x| = m * 2**e, m in [0.5, 1)
    if x > 0:  # 2**(e-1) <= x: exponent field e + 126 (none: key of +0)
        return np.int64(2147483648) + (np.int64(max(e + 126, 0)) << 23)
    if e + 127 >= 255:  # below the float32 range: below every key
        return np.int64(0)
    return np.int64(2147483647) - (np.int64(max(e + 127, 1)) << 23)  # -2**e <= x


@cuda.jit(device=True)
def _fix(l, mx, inv_t):
    """Fixed-point mass of logit l (float32 exp, deterministic: the same in every pass)."""
    return np.int64(float(math.exp((l - mx) * inv_t)) * FIX + 0.5)


@cuda.jit(device=True)
def _load(buf, kb, logits, bits, i0, step, end):
    """buf[k], kb[k] = logits / bits at i0 + k * step (k < UNROLL), -inf / 0 past ``end``:
    UNROLL independent loads issued before any is used."""
    for k in range(UNROLL):
        i = i0 + k * step
        j = min(i, end - 1)  # clamped, not branched: the loads stay unconditional
        v, b = logits[j], bits[j]
        buf[k] = v if i < end else -math.inf
        kb[k] = b if i < end else 0


@device.kernel
def _sample_top_p_radix(out_id, logits, bits, temperature, top_p, u):
    """One block (a multiple of 32, <= SAMPLE_THREADS) samples one id; see the module docstring.

    bits is logits viewed as int32 (the keys). Each threshold pass histograms the mass of the
    keys still in question into NBUCKET buckets (shared int64 atomics, exact in any order) and
    keeps the bucket where the mass counted from the top reaches top_p * Z; it stops when that
    bucket holds one logit or one key. Then the ordered inverse CDF over per-thread id chunks.
    """
    hist = cuda.shared.array(NBUCKET, np.int64)
    cnt = cuda.shared.array(NBUCKET, np.int32)
    sc = cuda.shared.array(MAX_THREADS, np.int64)  # scans, int reductions
    w64 = cuda.shared.array(32, np.int64)
    fsc = cuda.shared.array(MAX_THREADS, np.float32)  # float reductions
    w32 = cuda.shared.array(32, np.float32)
    slot = cuda.shared.array(2, np.int64)
    buf = cuda.local.array(UNROLL, np.float32)
    kb = cuda.local.array(UNROLL, np.int32)
    V = logits.shape[0]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    inv_t = np.float32(1.0 / temperature)
    # 1. the largest logit (e <= 1 and Z >= 1 from here on)
    v, kmax = np.float32(-math.inf), np.int64(0)
    for i0 in range(tid, V, nt * UNROLL):
        _load(buf, kb, logits, bits, i0, nt, V)
        for k in range(UNROLL):
            v = max(v, buf[k])
            kmax = max(kmax, _key(kb[k]))
    mx = block_max_warps(v, fsc, w32)
    kmax = block_max_warps(kmax, sc, w64)
    # 2. lam_key: kept = key >= lam_key. The keys in question are [lo_k, hi_k), bucketed by
    # (key - lo_k) >> shift into <= NBUCKET buckets; invariant: above (the mass of the keys
    # >= hi_k) < target <= above + the mass in [lo_k, hi_k). The first range starts at lam0:
    # below it every e < (1 - top_p) / (2V) <= Z (1 - top_p) / (2V), so all of those together
    # hold less than half the mass top-p may drop.
    lam_key = np.int64(0)
    if top_p < 1.0:
        lam0 = mx + temperature * math.log((1.0 - top_p) / (2.0 * V))
        lo_k, hi_k = _key_floor(lam0), kmax + 1
        shift = 0
        while (hi_k - 1 - lo_k) >> shift >= NBUCKET:
            shift += 1
        above, target = np.int64(0), np.int64(1)
        for level in range(4):  # shift <= 21 at first, -11 per level: 3 levels at most
            for d in range(tid, NBUCKET, nt):
                hist[d], cnt[d] = 0, 0
            cuda.syncthreads()
            zq = np.int64(0)
            for i0 in range(tid, V, nt * UNROLL):
                _load(buf, kb, logits, bits, i0, nt, V)
                for k in range(UNROLL):
                    key = _key(kb[k])
                    inside = lo_k <= key and key < hi_k
                    if i0 + k * nt < V and (level == 0 or inside):
                        q = _fix(buf[k], mx, inv_t)
                        zq += q
                        if inside:
                            d = (key - lo_k) >> shift
                            cuda.atomic.add(hist, d, q)
                            cuda.atomic.add(cnt, d, 1)
            if level == 0:  # the first pass sees every logit: Z and the target
                zq = block_sum_warps(zq, sc, w64)
                target = max(np.int64(1), np.int64(math.ceil(top_p * float(zq))))
            cuda.syncthreads()
            # bucket d* = the largest d with above + sum(hist[d:]) >= target: thread t owns
            # buckets [t * per, (t+1) * per); suffix-scan the per-thread sums, walk down
            per = (NBUCKET + nt - 1) // nt
            ls = np.int64(0)
            for d in range(tid * per, min(tid * per + per, NBUCKET)):
                ls += hist[d]
            sc[tid] = ls
            cuda.syncthreads()
            off = 1
            while off < nt:
                add = sc[tid + off] if tid + off < nt else np.int64(0)
                cuda.syncthreads()
                sc[tid] += add
                cuda.syncthreads()
                off *= 2
            run, cand, run_above = sc[tid] - ls, -1, np.int64(0)
            for d in range(min(tid * per + per, NBUCKET) - 1, tid * per - 1, -1):
                if above + run + hist[d] >= target:
                    cand, run_above = d, run
                    break
                run += hist[d]
            cuda.syncthreads()
            dstar = np.int64(block_max_warps(np.float32(cand), fsc, w32))
            if cand == dstar:
                slot[0] = run_above
            cuda.syncthreads()
            above += slot[0]
            lo_k += dstar << shift
            hi_k = min(hi_k, lo_k + (np.int64(1) << shift))
            done = cnt[dstar] == 1 or shift == 0
            shift = max(0, shift - RADIX)
            cuda.syncthreads()
            if done:
                break
        lam_key = lo_k
    # 3. ordered inverse CDF: thread t owns ids [t * ch, (t+1) * ch); exact int64 prefix sums
    ch = (V + nt - 1) // nt
    i0, i1 = tid * ch, min(tid * ch + ch, V)
    s, last = np.int64(0), -1
    for j0 in range(i0, i1, UNROLL):
        _load(buf, kb, logits, bits, j0, 1, i1)
        for k in range(UNROLL):
            if j0 + k < i1 and _key(kb[k]) >= lam_key:
                s += _fix(buf[k], mx, inv_t)
                last = j0 + k
    sc[tid] = s
    cuda.syncthreads()
    off = 1
    while off < nt:
        add = sc[tid - off] if tid >= off else np.int64(0)
        cuda.syncthreads()
        sc[tid] += add
        cuda.syncthreads()
        off *= 2
    incl = sc[tid]
    xq = np.int64(float(u[0]) * float(sc[nt - 1]))  # first kept id whose cumulative mass > xq
    owner = cuda.syncthreads_count(np.int32(incl <= xq))  # exact sums: monotone
    last_all = block_max_warps(np.float32(last), fsc, w32)
    if tid == owner:
        run, pick = incl - s, -1
        for j0 in range(i0, i1, UNROLL):
            _load(buf, kb, logits, bits, j0, 1, i1)
            for k in range(UNROLL):
                if pick < 0 and j0 + k < i1 and _key(kb[k]) >= lam_key:
                    run += _fix(buf[k], mx, inv_t)
                    if run > xq:
                        pick = j0 + k
            if pick >= 0:
                break
        out_id[0] = pick
    elif tid == 0 and owner >= nt:  # only when u >= 1: the last kept id
        out_id[0] = np.int32(last_all)


def sample_top_p(out_id, logits, temperature: float, top_p: float, u, stream=0,
                 threads=None) -> None:
    """Launcher: out_id [1] int32, logits [V] float32, u [1] float32 (the step's uniform, in
    device memory so a captured graph can replay it). temperature > 0."""
    nt = threads or SAMPLE_THREADS
    assert nt % 32 == 0 and nt <= SAMPLE_THREADS and temperature > 0
    _sample_top_p_radix[1, nt, stream](out_id, logits, logits.view(np.int32), float(temperature),
                                       float(top_p), u)


# ---- CI lane B and the H200 benchmark -----------------------------------------------------------
_EMB = "void(float32[:, ::1], {}[:, ::1], int32[::1])"
PTX_SIGNATURES = [
    (_embed_rows, _EMB.format("float32")),
    (_embed_rows, _EMB.format("float16")),
    (_embed_bf16, _EMB.format("uint16")),
    (_argmax_partials, "void(float32[::1], int32[::1], float32[::1])"),
    (_argmax_finish, "void(int32[::1], float32[::1], int32[::1])"),
    (_sample_top_p_radix,
     "void(int32[::1], float32[::1], int32[::1], float64, float64, float32[::1])"),
]


def bench_cases(stream):
    """V4-Flash: embedding rows from the F16 [129280, 4096] table at T = 1 and 512; argmax and
    top-p sampling over 129280 logits."""
    rng = np.random.default_rng(0)
    V, D = 129280, 4096

    def dev(a):
        return device.to_device(np.ascontiguousarray(a), stream)

    table = dev(rng.standard_normal((V, D), dtype=np.float32).astype(np.float16))
    cases = []
    for T in (1, 512):
        tok = dev(rng.integers(0, V, T).astype(np.int32))
        out = device.device_empty((T, D), np.float32, stream)
        cases.append(BenchCase("embed_sample", f"embed F16 T={T} D={D}",
                               lambda o=out, tk=tok: embed(o, table, tk, stream),
                               bytes=T * D * (2 + 4) + T * 4))
    logits = dev((rng.standard_normal(V) * 3).astype(np.float32))
    oid, u = device.device_empty(1, np.int32, stream), dev(np.array([0.37], np.float32))
    for naive in (False, True):
        cases.append(BenchCase("embed_sample", f"argmax V={V}" + (" naive" if naive else ""),
                               lambda nv=naive: argmax(oid, logits, stream, naive=nv),
                               bytes=V * 4))
    for tp in (0.9, 1.0):
        cases.append(BenchCase("embed_sample", f"sample_top_p V={V} T=0.8 top_p={tp}",
                               lambda tp=tp: sample_top_p(oid, logits, 0.8, tp, u, stream),
                               bytes=V * 4))
    return cases
