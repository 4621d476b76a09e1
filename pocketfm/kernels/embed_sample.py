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

  The algorithm: the max, then tau by a radix select on order-preserving integer keys of the
  logits (kept = key >= lambda is the same set, p being monotone in the logit; equal logits
  share a key, so ties stay together), 1-3 histogram passes of fixed-point masses; then the
  ordered inverse CDF by exact prefix sums over contiguous id ranges. exp is float32 and masses
  are multiples of 2**-40, so the float64 reference can differ only when u or top_p falls
  within ~1e-7 of a cumulative-mass boundary (u = 0 included: a kept token whose mass rounds
  to 0 is never drawn). The naive kernel runs it in one block; the default splits every pass
  over ~V / 2048 blocks, one launch per phase (6 launches, 3 at top_p >= 1), with the same
  integer arithmetic, so both return the same id bit for bit.
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
# prefix scans and the final walk agree bit for bit, in one block or split over many, and a given
# u always picks the same id.
FIX = 2.0 ** 40
UNROLL = 8  # loads in flight per thread (split kernels: UNROLL logits per thread, one load each)
RADIX = 11  # key bits resolved per histogram pass
NBUCKET = 1 << RADIX
NLEV = 3  # histogram passes at most: the first range spans < 2**32 keys (shift <= 21), -11 each
SAMPLE_THREADS = 512  # the one-block kernel's registers do not fit a 1024-thread block (H200)
SPLIT_THREADS = 256  # split kernels: 64 blocks of 2048 logits at V = 129280 (not tuned)
# Split workspace (one per block count, allocated on first use): rows of part [4, nb] ...
P_KMAX, P_ZQ, P_KEPT, P_LAST = range(4)  # largest key, all mass, kept mass, last kept id
# ... and columns of state [NLEV + 1, 6]: the threshold search at the start of each level
S_LO, S_HI, S_SHIFT, S_ABOVE, S_TARGET, S_DONE = range(6)


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
    """buf[k], kb[k] = logits / bits at i0 + k * step (k < UNROLL), -inf / -1 (key 0) past
    ``end``: UNROLL independent loads issued before any is used."""
    for k in range(UNROLL):
        i = i0 + k * step
        j = min(i, end - 1)  # clamped, not branched: the loads stay unconditional
        v, b = logits[j], bits[j]
        buf[k] = v if i < end else -math.inf
        kb[k] = b if i < end else -1


if device.SIMULATOR:
    @cuda.jit(device=True)
    def _warp_scan(v, sc, suffix):
        """Inclusive sum of the int64 v over the lanes <= this one of its warp (``suffix``:
        lanes >= this one). Simulator path: staged through sc [blockDim], 2 barriers."""
        t = cuda.threadIdx.x
        sc[t] = v
        cuda.syncthreads()
        base = t - t % 32
        lo, hi = (t, min(base + 32, cuda.blockDim.x)) if suffix else (base, t + 1)
        s = np.int64(0)
        for j in range(lo, hi):
            s += sc[j]
        cuda.syncthreads()
        return s
else:
    @cuda.jit(device=True)
    def _warp_scan(v, sc, suffix):
        """Inclusive sum of the int64 v over the lanes <= this one of its warp (``suffix``:
        lanes >= this one): shuffles; sc is unused here."""
        lane = cuda.laneid
        for off in (1, 2, 4, 8, 16):
            if suffix:
                y = cuda.shfl_down_sync(device.FULL_MASK, v, off)
                if lane + off < 32:
                    v += y
            else:
                y = cuda.shfl_up_sync(device.FULL_MASK, v, off)
                if lane >= off:
                    v += y
        return v


@cuda.jit(device=True)
def _block_scan(v, sc, w64, suffix):
    """(inclusive sum of the int64 v over the threads <= this one, block total); ``suffix``:
    over the threads >= this one. Warp scans, then each thread adds the totals of the warps
    before (after) its own from w64 [32]. Every thread must call it (blockDim % 32 == 0)."""
    t = cuda.threadIdx.x
    w = t // 32
    x = _warp_scan(v, sc, suffix)
    if t % 32 == (0 if suffix else 31):  # the lane holding its warp's total
        w64[w] = x
    cuda.syncthreads()
    off, tot = np.int64(0), np.int64(0)
    for j in range(cuda.blockDim.x // 32):
        tot += w64[j]
        if (j > w) if suffix else (j < w):
            off += w64[j]
    cuda.syncthreads()
    return x + off, tot


@cuda.jit(device=True)
def _first_range(mx, kmax, temperature, top_p, V):
    """The keys [lo_k, hi_k) the threshold search starts from, and the first bucket shift. The
    range starts at lam0: below it every e < (1 - top_p) / (2V) <= Z (1 - top_p) / (2V), so all
    of those together hold less than half the mass top-p may drop. That needs the dropped mass,
    (1 - top_p) Z >= (1 - top_p) 2**40 in fixed point, to dwarf the rounding (V / 2 from the
    masses, ~32 from target = ceil(top_p * float(Z))); top_p closer to 1 starts at key 0."""
    lo_k, hi_k = np.int64(0), kmax + 1
    if (1.0 - top_p) * FIX > 2.0 * V + 128.0:
        lo_k = _key_floor(mx + temperature * math.log((1.0 - top_p) / (2.0 * V)))
    shift = np.int64(0)
    while (hi_k - 1 - lo_k) >> shift >= NBUCKET:
        shift += 1
    return lo_k, hi_k, shift


@cuda.jit(device=True)
def _count(hist, cnt, buf, kb, i, step, end, lo_k, hi_k, shift, mx, inv_t, every):
    """Histogram the loaded logits (ids i + k * step < end) with keys in [lo_k, hi_k): mass into
    hist, 1 into cnt at bucket (key - lo_k) >> shift (shared atomics, exact in any order).
    Returns the mass of those (``every``: of all the loaded logits)."""
    z = np.int64(0)
    for k in range(UNROLL):
        key = _key(kb[k])
        inside = lo_k <= key and key < hi_k
        if i + k * step < end and (every or inside):
            q = _fix(buf[k], mx, inv_t)
            z += q
            if inside:
                d = (key - lo_k) >> shift
                cuda.atomic.add(hist, d, q)
                cuda.atomic.add(cnt, d, 1)
    return z


@cuda.jit(device=True)
def _narrow(hist, cnt, lo_k, hi_k, shift, above, target, sc, w64, slot):
    """One radix step of the threshold search over the histogram of [lo_k, hi_k) (hist: masses,
    cnt: counts per bucket). Invariant: above (the mass of keys >= hi_k) < target <= above + the
    mass in [lo_k, hi_k). Keeps bucket d* = the largest d with above + sum(hist[d:]) >= target;
    returns the narrowed (lo_k, hi_k, shift, above, done), done when d* holds one logit or key."""
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    per = (NBUCKET + nt - 1) // nt  # thread t owns buckets [t * per, (t+1) * per)
    d0, d1 = min(tid * per, NBUCKET), min(tid * per + per, NBUCKET)
    ls = np.int64(0)
    for d in range(d0, d1):
        ls += hist[d]
    incl, _ = _block_scan(ls, sc, w64, True)  # suffix sums of the per-thread sums
    run = incl - ls
    if above + run < target and target <= above + incl:  # the one thread holding d*: walk down
        for d in range(d1 - 1, d0 - 1, -1):
            if above + run + hist[d] >= target:
                slot[0], slot[1] = d, run
                break
            run += hist[d]
    cuda.syncthreads()
    dstar = slot[0]
    above += slot[1]
    lo_k += dstar << shift
    hi_k = min(hi_k, lo_k + (np.int64(1) << shift))
    done = cnt[dstar] == 1 or shift == 0
    cuda.syncthreads()  # slot is reused
    return lo_k, hi_k, max(0, shift - RADIX), above, done


@cuda.jit(device=True)
def _kept_mass(logits, bits, i0, i1, mx, inv_t, lam_key, buf, kb):
    """(fixed-point mass, last id) of the kept logits (key >= lam_key) among ids [i0, i1)."""
    s, last = np.int64(0), -1
    for j0 in range(i0, i1, UNROLL):
        _load(buf, kb, logits, bits, j0, 1, i1)
        for k in range(UNROLL):
            if j0 + k < i1 and _key(kb[k]) >= lam_key:
                s += _fix(buf[k], mx, inv_t)
                last = j0 + k
    return s, last


@cuda.jit(device=True)
def _first_above(logits, bits, i0, i1, mx, inv_t, lam_key, run, xq, buf, kb):
    """The first kept id in [i0, i1) where run + the kept mass up to it exceeds xq (-1: none)."""
    pick = -1
    for j0 in range(i0, i1, UNROLL):
        _load(buf, kb, logits, bits, j0, 1, i1)
        for k in range(UNROLL):
            if pick < 0 and j0 + k < i1 and _key(kb[k]) >= lam_key:
                run += _fix(buf[k], mx, inv_t)
                if run > xq:
                    pick = j0 + k
        if pick >= 0:
            break
    return pick


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
    # 2. lam_key: kept = key >= lam_key, by radix steps over histograms of the keys in question
    lam_key = np.int64(0)
    if top_p < 1.0:
        lo_k, hi_k, shift = _first_range(mx, kmax, temperature, top_p, V)
        above, target = np.int64(0), np.int64(1)
        for level in range(NLEV):
            for d in range(tid, NBUCKET, nt):
                hist[d], cnt[d] = 0, 0
            cuda.syncthreads()
            zq = np.int64(0)
            for i0 in range(tid, V, nt * UNROLL):
                _load(buf, kb, logits, bits, i0, nt, V)
                zq += _count(hist, cnt, buf, kb, i0, nt, V, lo_k, hi_k, shift, mx, inv_t,
                             level == 0)
            if level == 0:  # the first pass sees every logit: Z and the target
                zq = block_sum_warps(zq, sc, w64)
                target = max(np.int64(1), np.int64(math.ceil(top_p * float(zq))))
            cuda.syncthreads()
            lo_k, hi_k, shift, above, done = _narrow(hist, cnt, lo_k, hi_k, shift, above,
                                                     target, sc, w64, slot)
            if done:
                break
        lam_key = lo_k
    # 3. ordered inverse CDF: thread t owns ids [t * ch, (t+1) * ch); exact int64 prefix sums
    ch = (V + nt - 1) // nt
    i0, i1 = min(tid * ch, V), min(tid * ch + ch, V)
    s, last = _kept_mass(logits, bits, i0, i1, mx, inv_t, lam_key, buf, kb)
    incl, tot = _block_scan(s, sc, w64, False)
    xq = np.int64(float(u[0]) * float(tot))  # first kept id whose cumulative mass > xq
    owner = cuda.syncthreads_count(np.int32(incl <= xq))  # exact sums: monotone
    last_all = block_max_warps(np.float32(last), fsc, w32)
    if tid == owner:
        out_id[0] = _first_above(logits, bits, i0, i1, mx, inv_t, lam_key, incl - s, xq, buf, kb)
    elif tid == 0 and owner >= nt:  # only when u >= 1: the last kept id
        out_id[0] = np.int32(last_all)


# ---- the split sampler: the same search over nb blocks, one launch per phase --------------------
# Block b owns the chunk of ids [b C, b C + C), C = UNROLL * blockDim: one load per thread and
# logit, issued first in every kernel so that the loads fly while the block re-derives what the
# previous launches left in the workspace (every block alike: no signalling inside a launch).
#   _sample_split_max     per-block largest logit and key; clears the level histograms
#   _sample_split_level   (top_p < 1; levels 0, 1, 2) narrow the search by the previous level's
#                         histogram, then add the chunk's keys in range to hist[level] (level 0
#                         also sums the chunk's mass, for Z); a level after the end returns
#   _sample_split_sum     the end of the search (lam_key); per-block kept mass and last kept id
#   _sample_split_finish  one block: the owning block from the per-block kept masses in id
#                         order, then the one-block inverse CDF inside its chunk
@cuda.jit(device=True)
def _chunk(buf, kb, logits, bits):
    """Load this thread's UNROLL logits of its block's chunk: ids i + k * blockDim; returns i."""
    nt = cuda.blockDim.x
    i = cuda.blockIdx.x * nt * UNROLL + cuda.threadIdx.x
    _load(buf, kb, logits, bits, i, nt, logits.shape[0])
    return i


@cuda.jit(device=True)
def _grid_max(pmax, fsc, w32):
    """The largest logit, from the per-block maxima pmax [nb]."""
    v = np.float32(-math.inf)
    for b in range(cuda.threadIdx.x, pmax.shape[0], cuda.blockDim.x):
        v = max(v, pmax[b])
    return block_max_warps(v, fsc, w32)


@cuda.jit(device=True)
def _stage(dst, src, tmp):
    """dst[:NBUCKET] = src (global -> shared), UNROLL coalesced loads in flight per thread."""
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    for d0 in range(tid, NBUCKET, nt * UNROLL):
        for k in range(UNROLL):
            tmp[k] = src[min(d0 + k * nt, NBUCKET - 1)]
        for k in range(UNROLL):
            if d0 + k * nt < NBUCKET:
                dst[d0 + k * nt] = tmp[k]
    cuda.syncthreads()


@cuda.jit(device=True)
def _record(state, level, lo_k, hi_k, shift, above, target, done):
    """Block 0 keeps the search state at the start of ``level`` for the next launch."""
    if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        state[level, S_LO], state[level, S_HI], state[level, S_SHIFT] = lo_k, hi_k, shift
        state[level, S_ABOVE], state[level, S_TARGET] = above, target
        state[level, S_DONE] = np.int64(done)


@cuda.jit(device=True)
def _resume(state, hist, part, level, top_p, hsh, tmp, sc, w64, slot):
    """The search at the start of ``level`` (1 .. NLEV; NLEV: its end): state[level - 1]
    narrowed by hist[level - 1] (staged in the shared hsh) unless done already. Every block
    computes the same; block 0 records it in state[level]."""
    p = level - 1
    lo_k, hi_k, shift = state[p, S_LO], state[p, S_HI], state[p, S_SHIFT]
    above, target, done = state[p, S_ABOVE], state[p, S_TARGET], state[p, S_DONE] != 0
    if level == 1:  # level 0 summed Z per block: now the target mass
        z = np.int64(0)
        for b in range(cuda.threadIdx.x, part.shape[1], cuda.blockDim.x):
            z += part[P_ZQ, b]
        z = block_sum_warps(z, sc, w64)
        target = max(np.int64(1), np.int64(math.ceil(top_p * float(z))))
    if not done:
        _stage(hsh, hist[p, 0], tmp)
        lo_k, hi_k, shift, above, done = _narrow(hsh, hist[p, 1], lo_k, hi_k, shift, above,
                                                 target, sc, w64, slot)
    _record(state, level, lo_k, hi_k, shift, above, target, done)
    return lo_k, hi_k, shift, above, done


@device.kernel
def _sample_split_max(pmax, part, hist, logits, bits):
    """Block b: the largest logit and key of its chunk -> pmax[b], part[P_KMAX, b]. The grid also
    clears hist [NLEV, 2, NBUCKET] (masses, counts) for this call's levels."""
    fsc = cuda.shared.array(MAX_THREADS, np.float32)
    w32 = cuda.shared.array(32, np.float32)
    sc = cuda.shared.array(MAX_THREADS, np.int64)
    w64 = cuda.shared.array(32, np.int64)
    buf = cuda.local.array(UNROLL, np.float32)
    kb = cuda.local.array(UNROLL, np.int32)
    _chunk(buf, kb, logits, bits)
    v, kmax = np.float32(-math.inf), np.int64(0)
    for k in range(UNROLL):
        v = max(v, buf[k])
        kmax = max(kmax, _key(kb[k]))
    v = block_max_warps(v, fsc, w32)
    kmax = block_max_warps(kmax, sc, w64)
    if cuda.threadIdx.x == 0:
        pmax[cuda.blockIdx.x] = v
        part[P_KMAX, cuda.blockIdx.x] = kmax
    n = 2 * NBUCKET
    for j in range(cuda.grid(1), hist.shape[0] * n, cuda.gridsize(1)):
        hist[j // n, (j // NBUCKET) % 2, j % NBUCKET] = 0


@device.kernel
def _sample_split_level(hist, state, pmax, part, logits, bits, temperature, top_p, level):
    """Level ``level`` of the threshold search, block b: resume the search, then histogram the
    chunk's keys in the new range in shared memory and add each non-empty bucket to
    hist[level] (global int64 atomics). Level 0 also sums the chunk's mass into part[P_ZQ, b]."""
    hsh = cuda.shared.array(NBUCKET, np.int64)
    csh = cuda.shared.array(NBUCKET, np.int32)
    sc = cuda.shared.array(MAX_THREADS, np.int64)
    w64 = cuda.shared.array(32, np.int64)
    fsc = cuda.shared.array(MAX_THREADS, np.float32)
    w32 = cuda.shared.array(32, np.float32)
    slot = cuda.shared.array(2, np.int64)
    buf = cuda.local.array(UNROLL, np.float32)
    kb = cuda.local.array(UNROLL, np.int32)
    tmp = cuda.local.array(UNROLL, np.int64)
    V, nb = logits.shape[0], pmax.shape[0]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    i = _chunk(buf, kb, logits, bits)
    if level > 0 and state[level - 1, S_DONE] != 0:  # the search has ended: pass its state on
        if cuda.blockIdx.x == 0 and tid < 6:
            state[level, tid] = state[level - 1, tid]
        return
    mx = _grid_max(pmax, fsc, w32)
    if level == 0:
        kmax = np.int64(0)
        for b in range(tid, nb, nt):
            kmax = max(kmax, part[P_KMAX, b])
        kmax = block_max_warps(kmax, sc, w64)
        lo_k, hi_k, shift = _first_range(mx, kmax, temperature, top_p, V)
        above, done = np.int64(0), False
        _record(state, 0, lo_k, hi_k, shift, above, np.int64(1), done)  # target: after Z
    else:
        lo_k, hi_k, shift, above, done = _resume(state, hist, part, level, top_p, hsh, tmp, sc,
                                                 w64, slot)
        if done:  # the same in every thread: the whole block leaves
            return
    for d in range(tid, NBUCKET, nt):
        hsh[d], csh[d] = 0, 0
    cuda.syncthreads()
    zq = _count(hsh, csh, buf, kb, i, nt, V, lo_k, hi_k, shift, mx,
                np.float32(1.0 / temperature), level == 0)
    if level == 0:
        zq = block_sum_warps(zq, sc, w64)
        if tid == 0:
            part[P_ZQ, cuda.blockIdx.x] = zq
    cuda.syncthreads()
    for d in range(tid, NBUCKET, nt):
        if csh[d] > 0:
            cuda.atomic.add(hist, (level, 0, d), hsh[d])
            cuda.atomic.add(hist, (level, 1, d), np.int64(csh[d]))


@device.kernel
def _sample_split_sum(state, hist, pmax, part, logits, bits, temperature, top_p):
    """Block b: the end of the search (lam_key: kept = key >= lam_key, into state[NLEV]), then
    the kept mass and the last kept id of its chunk -> part[P_KEPT, b], part[P_LAST, b]."""
    hsh = cuda.shared.array(NBUCKET, np.int64)
    sc = cuda.shared.array(MAX_THREADS, np.int64)
    w64 = cuda.shared.array(32, np.int64)
    fsc = cuda.shared.array(MAX_THREADS, np.float32)
    w32 = cuda.shared.array(32, np.float32)
    slot = cuda.shared.array(2, np.int64)
    buf = cuda.local.array(UNROLL, np.float32)
    kb = cuda.local.array(UNROLL, np.int32)
    tmp = cuda.local.array(UNROLL, np.int64)
    V = logits.shape[0]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    i = _chunk(buf, kb, logits, bits)
    mx = _grid_max(pmax, fsc, w32)
    lam_key = np.int64(0)  # top_p >= 1: every key
    if top_p < 1.0:
        lam_key = _resume(state, hist, part, NLEV, top_p, hsh, tmp, sc, w64, slot)[0]
    elif cuda.blockIdx.x == 0 and tid == 0:
        state[NLEV, S_LO] = lam_key
    inv_t = np.float32(1.0 / temperature)
    s, last = np.int64(0), -1
    for k in range(UNROLL):
        if i + k * nt < V and _key(kb[k]) >= lam_key:
            s += _fix(buf[k], mx, inv_t)
            last = i + k * nt
    s = block_sum_warps(s, sc, w64)
    last_b = block_max_warps(np.float32(last), fsc, w32)  # ids < 2**24: exact in float32
    if tid == 0:
        part[P_KEPT, cuda.blockIdx.x] = s
        part[P_LAST, cuda.blockIdx.x] = np.int64(last_b)


@device.kernel
def _sample_split_finish(out_id, state, pmax, part, logits, bits, temperature, u):
    """One block as wide as the split blocks: xq = u * S; the block b* whose chunk holds the
    first kept id where the mass summed in id order exceeds xq (a scan over the per-block
    masses); then, inside b*'s chunk, the one-block inverse CDF over runs of UNROLL ids."""
    sc = cuda.shared.array(MAX_THREADS, np.int64)
    w64 = cuda.shared.array(32, np.int64)
    fsc = cuda.shared.array(MAX_THREADS, np.float32)
    w32 = cuda.shared.array(32, np.float32)
    slot = cuda.shared.array(2, np.int64)
    buf = cuda.local.array(UNROLL, np.float32)
    kb = cuda.local.array(UNROLL, np.int32)
    V, nb = logits.shape[0], pmax.shape[0]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    mx = _grid_max(pmax, fsc, w32)
    inv_t = np.float32(1.0 / temperature)
    lam_key = state[NLEV, S_LO]
    per = (nb + nt - 1) // nt  # thread t owns blocks [t * per, (t+1) * per)
    b0, b1 = min(tid * per, nb), min(tid * per + per, nb)
    s, last = np.int64(0), np.int64(-1)
    for b in range(b0, b1):
        s += part[P_KEPT, b]
        last = max(last, part[P_LAST, b])
    incl, tot = _block_scan(s, sc, w64, False)
    xq = np.int64(float(u[0]) * float(tot))  # first kept id whose cumulative mass > xq
    run = incl - s
    if run <= xq and xq < incl:  # exact sums: exactly one thread holds the crossing
        for b in range(b0, b1):
            if run + part[P_KEPT, b] > xq:
                slot[0], slot[1] = b, run
                break
            run += part[P_KEPT, b]
    if cuda.syncthreads_count(np.int32(xq < incl)) == 0:  # only when u >= 1: the last kept id
        last_all = block_max_warps(np.float32(last), fsc, w32)
        if tid == 0:
            out_id[0] = np.int32(last_all)
        return
    c0 = slot[0] * nt * UNROLL  # block b*'s chunk, after the kept mass slot[1]
    c1 = min(c0 + nt * UNROLL, V)
    i0, i1 = min(c0 + tid * UNROLL, c1), min(c0 + tid * UNROLL + UNROLL, c1)
    s, _ = _kept_mass(logits, bits, i0, i1, mx, inv_t, lam_key, buf, kb)
    incl, tot = _block_scan(s, sc, w64, False)
    incl += slot[1]
    owner = cuda.syncthreads_count(np.int32(incl <= xq))
    if tid == owner:
        out_id[0] = _first_above(logits, bits, i0, i1, mx, inv_t, lam_key, incl - s, xq, buf, kb)


_SAMPLE_WORK: dict = {}  # split-sampler workspace per block count (before any graph capture)


def _sample_work(nb):
    """(pmax f32 [nb], part i64 [4, nb], hist i64 [NLEV, 2, NBUCKET], state i64 [NLEV + 1, 6])."""
    if nb not in _SAMPLE_WORK:
        _SAMPLE_WORK[nb] = (cuda.device_array(nb, np.float32),
                            cuda.device_array((4, nb), np.int64),
                            cuda.device_array((NLEV, 2, NBUCKET), np.int64),
                            cuda.device_array((NLEV + 1, 6), np.int64))
    return _SAMPLE_WORK[nb]


def sample_top_p(out_id, logits, temperature: float, top_p: float, u, stream=0,
                 threads=None, naive=False) -> None:
    """Launcher: out_id [1] int32, logits [V] float32, u [1] float32 (the step's uniform, in
    device memory so a captured graph can replay it). temperature > 0.

    ``naive``: one block does it all (_sample_top_p_radix). Otherwise the split kernels over
    cdiv(V, UNROLL * threads) blocks: 6 launches when top_p < 1, 3 when top_p >= 1 (no search),
    over a module-level workspace allocated on the first call (one stream at a time)."""
    V = logits.shape[0]
    assert V < 1 << 24 and temperature > 0
    bits = logits.view(np.int32)
    t, p = float(temperature), float(top_p)
    if naive:
        nt = threads or SAMPLE_THREADS
        assert nt % 32 == 0 and nt <= SAMPLE_THREADS
        _sample_top_p_radix[1, nt, stream](out_id, logits, bits, t, p, u)
        return
    nt = threads or SPLIT_THREADS
    assert nt % 32 == 0 and nt <= SAMPLE_THREADS
    nb = cdiv(V, UNROLL * nt)
    pmax, part, hist, state = _sample_work(nb)
    _sample_split_max[nb, nt, stream](pmax, part, hist, logits, bits)
    if p < 1.0:
        for level in range(NLEV):  # a level after the search is done returns at once
            _sample_split_level[nb, nt, stream](hist, state, pmax, part, logits, bits, t, p,
                                                level)
    _sample_split_sum[nb, nt, stream](state, hist, pmax, part, logits, bits, t, p)
    _sample_split_finish[1, nt, stream](out_id, state, pmax, part, logits, bits, t, u)


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
    (_sample_split_max,
     "void(float32[::1], int64[:, ::1], int64[:, :, ::1], float32[::1], int32[::1])"),
    (_sample_split_level, "void(int64[:, :, ::1], int64[:, ::1], float32[::1], int64[:, ::1], "
                          "float32[::1], int32[::1], float64, float64, int64)"),
    (_sample_split_sum, "void(int64[:, ::1], int64[:, :, ::1], float32[::1], int64[:, ::1], "
                        "float32[::1], int32[::1], float64, float64)"),
    (_sample_split_finish, "void(int32[::1], int64[:, ::1], float32[::1], int64[:, ::1], "
                           "float32[::1], int32[::1], float64, float32[::1])"),
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
    tied = dev(np.round(rng.standard_normal(V) * 6).astype(np.float32) / 2)  # many equal keys
    for naive in (False, True):  # split: 3 launches at top_p 1, 6 below; naive: 1
        for tp, lg, what in ((0.9, logits, ""), (1.0, logits, ""), (0.9, tied, " tied")):
            cases.append(BenchCase(
                "embed_sample", f"sample_top_p V={V} T=0.8 top_p={tp}{what}"
                + (" naive" if naive else ""),
                lambda tp=tp, lg=lg, nv=naive: sample_top_p(oid, lg, 0.8, tp, u, stream,
                                                            naive=nv),
                bytes=V * 4))
    return cases
