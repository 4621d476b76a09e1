"""Lightning indexer on the GPU (spec §4.7): scores over the packed FP4 keys, then top-k.

    indexer_scores   out[N]     = Σ_h w[h] · ReLU(q[h] · key_j)  for j < n_visible, else -inf
    topk             out_idx[k] = the k best j < n_visible, ascending (ties: lowest index; -1 pads)
    topk_chunk       out_idx[T, k] = topk of row t of scores[T, N] among its n_visible[t]

Keys are the 68-byte FP4 records of kvpack.py (DI = 128: 64 bytes of e2m1 nibbles, 4 ue8m0
scales). ``n_visible`` is a device int32[1] (one per token in the chunk form), so a captured
graph reads the current count: grids are sized for the capacity and tiles past the count only
write -inf.

The scorer is an fp32 matrix product [HI, DI] x [DI, N] with a ReLU and a weighted row sum on
top: 4.3 GFLOP at N = 262,144, against 17.8 MB of keys. On a GPU it runs on the tensor cores
(indexer_mma.py: bf16 MMAs through inline PTX, exact on the FP4 values); the CUDA-core kernel
here is the simulator's engine path and the kvswap pool's (host memory over the bus). It is
FMA-bound: each key is decoded to float once per block into shared memory (the per-32 scale
folded in: 128 multiplies per key against 8,192 FMAs for its 64 dot products, so factoring the
scale out of the inner sum would save nothing) and each thread keeps an HT x KT register tile
of (head, key) accumulators, so each shared load feeds several FMAs. Dimension letters: HI
index heads, DI index dim, N keys, T tokens.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from .. import ops
from . import device, indexer_mma, indexer_warp, kvpack
from .bench import BenchCase
from .device import cdiv

HT = 8  # heads per thread in the register tile (HI must be a multiple)
KT = 8  # keys per thread in the register tile
HTKT = HT * KT  # (a literal for cuda.local.array)
CD = 16  # key dims decoded into shared memory per stage (half an FP4 scale block)
RADIX_BITS = 11  # radix-select digit width: passes over bits 31..21, 20..10, 9..0
TOPK_THREADS = 512
# the radix kernel's threads a block at most: ptxas gives it ~106 registers a thread (sm_90), and
# 1,024 threads of those overflow an SM's 65,536 (the launch fails: out of resources)
TOPK_MAX_THREADS = 512
_ALIGN = None if device.SIMULATOR else 16  # 16-byte shared arrays: 128-bit loads (no sim support)


def _inline(fn):
    """A device helper inlined at Numba-IR level. Plain ``cuda.jit(device=True)`` helpers are
    compiled for the *current device*, which CI lane B (compile_ptx, no driver) does not have."""
    return cuda.jit(device=True, inline="always")(getattr(fn, "py_func", fn))


_e2m1 = _inline(kvpack.e2m1_decode)


# ---- NumPy references (the spec) --------------------------------------------------------------
def indexer_scores_chunk_ref(out, q, w, keys_packed, n_visible) -> None:
    """out[T, N] <- q[T, HI, DI], w[T, HI], keys_packed[Ncap, bytes] uint8, n_visible[T] int32.

    Row t scores keys j < n_visible[t] (ops.indexer_scores on the unpacked keys); -inf beyond.
    """
    T, HI, DI = q.shape
    for t in range(T):
        n = min(int(n_visible[t]), out.shape[1], len(keys_packed))
        keys = np.empty((n, DI), np.float32)
        kvpack.unpack_index_key_ref(keys, keys_packed[:n])
        out[t] = -np.inf
        ops.indexer_scores(out[t:t + 1, :n], q[t:t + 1], w[t:t + 1], keys.astype(out.dtype))


def indexer_scores_ref(out, q, w, keys_packed, n_visible) -> None:
    """Decode form: out[N] <- q[HI, DI], w[HI], keys_packed, n_visible[1]."""
    indexer_scores_chunk_ref(out[None], q[None], w[None], keys_packed, n_visible)


def topk_ref(out_idx, scores, n_visible, k: int) -> None:
    """out_idx[k] <- the k largest scores[j], j < n_visible[0], in the order (-score, index).

    The index breaks ties, so the selected SET is unique and the kernels must return exactly
    it (ops.topk_visible leaves ties arbitrary; on tie-free scores the two sets agree). With
    n_visible <= k this is 0 .. n_visible-1 followed by -1 padding.
    """
    n = max(0, min(int(n_visible[0]), len(scores)))  # (a negative count: none visible)
    order = np.lexsort((np.arange(n), -np.asarray(scores[:n], np.float64)))[:k]
    out_idx[...] = -1
    out_idx[:len(order)] = order


def topk_chunk_ref(out_idx, scores, n_visible, k: int) -> None:
    """Chunk (prefill) form: out_idx[T, k] <- per token t, topk_ref on scores[t] (scores[T, N])
    with its own visible count n_visible[t]."""
    for t in range(out_idx.shape[0]):
        topk_ref(out_idx[t], scores[t], n_visible[t:t + 1], k)


# ---- scores: naive ----------------------------------------------------------------------------
@device.kernel
def _indexer_scores_naive(out, q, w, keys, n_visible):
    """One thread per (token, key): decode each element where it is used, all in registers.

    q[T, HI, DI] f32, w[T, HI], keys[Ncap, bytes] uint8, n_visible[T], out[T, N]."""
    T, HI, DI = q.shape
    N = out.shape[1]
    for i in range(cuda.grid(1), T * N, cuda.gridsize(1)):
        t = i // N
        j = i - t * N
        n = min(int(n_visible[t]), N, keys.shape[0])
        if j >= n:
            out[t, j] = -math.inf
            continue
        s = float32(0.0)
        for h in range(HI):
            dot = float32(0.0)
            for d in range(DI):
                b = int32(keys[j, d // 2])
                nib = (b >> 4) if d & 1 else (b & 15)
                scale = float32(math.ldexp(1.0, int(keys[j, DI // 2 + d // 32]) - 127))
                dot += q[t, h, d] * float32(_e2m1(nib)) * scale
            s += w[t, h] * max(dot, float32(0.0))
        out[t, j] = s


# ---- scores: register tiles -------------------------------------------------------------------
@_inline
def _qcol(hg, half, d, HG, SWM):
    """Where the 4 heads hg·8 + 4·half .. +3 sit in row d of the staged q: 4-float chunks,
    first halves of all head groups then second halves, the chunk index XOR-swizzled by
    (2·(d & 3) + half) & SWM. A warp's 8 groups then read 8 distinct chunks (one wavefront
    per 128-bit load), and the staging stores of 4 rows x 8 heads hit 32 distinct banks."""
    return 4 * (half * HG + (hg ^ ((2 * (d & 3) + half) & SWM)))


@_inline
def _fma_tile(smem, q0, q1, kb, acc, qv, kv):
    """acc[HT, KT] += q (this thread's 8 heads: 4 at q0, 4 at q1) outer k[KT keys at kb]."""
    for i in range(4):
        qv[i] = smem[q0 + uint64(i)]
        qv[4 + i] = smem[q1 + uint64(i)]
    for j in range(KT):
        kv[j] = smem[kb + uint64(j)]
    for i in range(HT):
        for j in range(KT):
            acc[i * KT + j] += qv[i] * kv[j]


@_inline
def _score_tiles(out, q, w, keys32, keys8, n, smem, acc, qv, kv, wr, HI, DI, NT):
    """Score every TILE-key tile of ``out`` assigned to this block (grid-stride over tiles).

    out[N], q[HI, DI], w[HI]; keys32/keys8 = the same packed keys as uint32 words / bytes.
    HI, DI, NT (= blockDim.x) are compile-time constants of the calling kernel, so the
    shared-memory offsets fold into immediates. Thread (hg, kg) owns heads hg·8 .. hg·8+7 and
    keys kg·KT .. kg·KT+KT-1 of the tile, read as 16-byte-aligned runs: 128-bit shared loads
    (hot indices are uint64: Numba wraps signed indices, which hides the pattern from the
    vectoriser). smem (16-byte aligned): q transposed [DI][HI] (layout: _qcol); the decoded
    key stage [CD][TILE], which doubles as the [HG][TILE] head-sum scratch; the 16 FP4 values.
    acc[HT·KT], qv[HT], kv[KT], wr[HT]: the caller's local arrays (registers once unrolled).
    """
    N = out.shape[0]
    tid = cuda.threadIdx.x
    HG = HI // HT
    KG = NT // HG
    TILE = KG * KT
    SWM = min(HG & -HG, 8) - 1  # swizzle mask: keeps chunk ^ s inside its half-row
    hg = tid % HG
    kg = tid // HG
    KOFF = HI * DI
    LOFF = KOFF + max(CD, HG) * TILE
    # q: a warp stages an 8-head x 4-dim block (rows read 16 B at a time)
    for it in range(tid, HI * DI, NT):
        blk = it // 32
        h = (blk % HG) * 8 + (it & 7)
        d = (blk // HG) * 4 + ((it & 31) >> 3)
        smem[d * HI + _qcol(h >> 3, (h >> 2) & 1, d, HG, SWM) + (h & 3)] = q[h, d]
    if tid < 16:
        smem[LOFF + tid] = _e2m1(tid)
    for i in range(HT):
        wr[i] = w[hg * HT + i]
    # this thread's two q chunks in rows with d & 3 = 0 .. 3 (row u's offset u·HI included)
    q00 = uint64(_qcol(hg, 0, 0, HG, SWM))
    q01 = uint64(_qcol(hg, 1, 0, HG, SWM))
    q10 = uint64(HI + _qcol(hg, 0, 1, HG, SWM))
    q11 = uint64(HI + _qcol(hg, 1, 1, HG, SWM))
    q20 = uint64(2 * HI + _qcol(hg, 0, 2, HG, SWM))
    q21 = uint64(2 * HI + _qcol(hg, 1, 2, HG, SWM))
    q30 = uint64(3 * HI + _qcol(hg, 0, 3, HG, SWM))
    q31 = uint64(3 * HI + _qcol(hg, 1, 3, HG, SWM))
    zero = float32(0.0)
    for tile in range(cuda.blockIdx.x, (N + TILE - 1) // TILE, cuda.gridDim.x):
        k0 = tile * TILE
        cuda.syncthreads()  # q staged / the previous tile's head sums consumed
        if k0 >= n:  # past the visible keys (block-uniform): only the -inf fill
            for kk in range(tid, TILE, NT):
                if k0 + kk < N:
                    out[k0 + kk] = -math.inf
            continue
        for a in range(HTKT):
            acc[a] = zero
        for c in range(DI // CD):
            # stage: dims c·CD .. c·CD+CD-1 of the tile's keys as floats, scale applied
            for kk in range(tid, TILE, NT):
                j = k0 + kk
                dst = uint64(KOFF + kk)
                if j < n:
                    sc = float32(math.ldexp(float32(1.0), int(keys8[j, DI // 2 + c * CD // 32])
                                            - 127))
                    for wd in range(CD // 8):
                        word = uint64(keys32[j, c * (CD // 8) + wd])  # 8 nibbles, low first
                        for e in range(8):
                            nib = (word >> uint64(4 * e)) & uint64(15)
                            smem[dst] = smem[uint64(LOFF) + nib] * sc
                            dst += uint64(TILE)
                else:
                    for d in range(CD):
                        smem[dst] = zero
                        dst += uint64(TILE)
            cuda.syncthreads()
            for d4 in range(CD // 4):  # four d per step: d & 3, so the swizzle, is fixed
                qb = uint64((c * CD + 4 * d4) * HI)
                kb = uint64(KOFF + 4 * d4 * TILE + kg * KT)
                _fma_tile(smem, qb + q00, qb + q01, kb, acc, qv, kv)
                _fma_tile(smem, qb + q10, qb + q11, kb + uint64(TILE), acc, qv, kv)
                _fma_tile(smem, qb + q20, qb + q21, kb + uint64(2 * TILE), acc, qv, kv)
                _fma_tile(smem, qb + q30, qb + q31, kb + uint64(3 * TILE), acc, qv, kv)
            cuda.syncthreads()
        # ReLU per head, weighted sum over this thread's heads, then over the HG head groups
        for j in range(KT):
            part = zero
            for i in range(HT):
                part += wr[i] * max(acc[i * KT + j], zero)
            smem[KOFF + hg * TILE + kg * KT + j] = part
        cuda.syncthreads()
        for kk in range(tid, TILE, NT):
            j = k0 + kk
            if j < N:
                s = zero
                for g in range(HG):
                    s += smem[KOFF + g * TILE + kk]
                out[j] = s if j < n else -math.inf


_SCORERS: dict = {}


def _scorer_kernels(HI: int, DI: int, NT: int):
    """(decode kernel, chunk kernel) of the register-tile scorer, compiled for HI x DI and
    NT threads per block: the shapes are closure constants (literal offsets, unrolled loops)."""
    key = (HI, DI, NT)
    if key in _SCORERS:
        return _SCORERS[key]
    if HI % HT or DI % CD or NT % (HI // HT) or NT // (HI // HT) * KT % 4:
        raise ValueError(f"indexer: no register-tile layout for HI={HI}, DI={DI}, threads={NT}")

    @device.kernel
    def _indexer_scores_register_tiles(out, q, w, keys32, keys8, n_visible):
        """Decode form: out[N], q[HI, DI], w[HI], n_visible[1]; persistent grid of tiles."""
        smem = cuda.shared.array(0, float32, alignment=_ALIGN)
        n = min(int(n_visible[0]), out.shape[0], keys8.shape[0])
        _score_tiles(out, q, w, keys32, keys8, n, smem, cuda.local.array(HTKT, float32),
                     cuda.local.array(HT, float32), cuda.local.array(KT, float32),
                     cuda.local.array(HT, float32), HI, DI, NT)

    @device.kernel
    def _indexer_scores_chunk_register_tiles(out, q, w, keys32, keys8, n_visible):
        """Chunk form: out[T, N], q[T, HI, DI], w[T, HI], n_visible[T]; blockIdx.y = token."""
        smem = cuda.shared.array(0, float32, alignment=_ALIGN)
        t = cuda.blockIdx.y
        n = min(int(n_visible[t]), out.shape[1], keys8.shape[0])
        _score_tiles(out[t], q[t], w[t], keys32, keys8, n, smem,
                     cuda.local.array(HTKT, float32), cuda.local.array(HT, float32),
                     cuda.local.array(KT, float32), cuda.local.array(HT, float32), HI, DI, NT)

    _SCORERS[key] = (_indexer_scores_register_tiles, _indexer_scores_chunk_register_tiles)
    return _SCORERS[key]


def _tile_grid(kern, args, HI: int, N: int, nt: int, smem: int) -> int:
    """Persistent grid of the register-tile scorer: every block stages q once, then walks
    tiles; no more blocks than fit at once (more would only add q staging and a tail)."""
    tile = nt // (HI // HT) * KT
    return max(1, min(cdiv(N, tile), device.resident_blocks(kern, args, nt, smem)))


def _tile_smem(HI: int, DI: int, nt: int) -> int:
    HG = HI // HT
    return 4 * (HI * DI + max(CD, HG) * (nt // HG * KT) + 16)


def _use_mma(mma, naive: bool, HI: int, DI: int) -> bool:
    """The tensor-core scorer (indexer_mma.py): by default on a GPU when the geometry fits it;
    the simulator's engine keeps the register tiles (``mma=True`` forces it, for its tests)."""
    if naive:
        return False
    if mma is None:
        return not device.SIMULATOR and indexer_mma.fits(HI, DI)
    return bool(mma)


def takes_decoded_keys(HI: int, DI: int, mma=None) -> bool:
    """Whether indexer_scores_chunk(..., mma, q_fp4=True) reads keys decoded by
    indexer_mma.decode_keys (``key_ws``) rather than the packed ones."""
    return _use_mma(mma, False, HI, DI) and indexer_mma.fits_tiles(HI, DI)


def indexer_scores_chunk(out, q, w, keys_packed, n_visible, stream=0, threads=None,
                         naive: bool = False, mma=None, q_fp4: bool = False,
                         key_ws=None) -> None:
    """out[T, N] f32 <- q[T, HI, DI] f32, w[T, HI] f32, keys_packed[Ncap, bytes] uint8,
    n_visible[T] int32 (prefill: one visible count per token; -inf past it). ``naive`` /
    ``mma`` (True / False / None: pick) choose the kernel; ``q_fp4``: q is on the FP4 grid
    (hadamard_fp4's output), which lets the tensor cores take several tokens a block over
    ``key_ws``, keys_packed decoded once (indexer_mma.decode_keys; None: decoded here)."""
    T, HI, DI = q.shape
    N = out.shape[1]
    if _use_mma(mma, naive, HI, DI):
        indexer_mma.indexer_scores_chunk_mma(out, q, w, keys_packed, n_visible, stream, q_fp4,
                                             key_ws)
        return
    if naive:
        nt = threads or 128
        _indexer_scores_naive[min(cdiv(T * N, nt), 4096), nt, stream](out, q, w, keys_packed,
                                                                     n_visible)
        return
    nt = threads or 128
    kern = _scorer_kernels(HI, DI, nt)[1]
    args = (out, q, w, keys_packed.view(np.uint32), keys_packed, n_visible)
    smem = _tile_smem(HI, DI, nt)
    kern[(cdiv(_tile_grid(kern, args, HI, N, nt, smem), T), T), nt, stream, smem](*args)


def indexer_scores(out, q, w, keys_packed, n_visible, stream=0, threads=None,
                   naive: bool = False, mma=None, q_fp4: bool = False, top_k=None,
                   q_frag=None) -> bool:
    """Decode form: out[N] f32 <- q[HI, DI], w[HI], keys_packed[Ncap, bytes], n_visible[1].
    ``q_fp4``: q is on the FP4 grid (hadamard_fp4's output), which lets one warp of the
    tensor-core scorer hold every head (indexer_warp.indexer_scores_warp). ``top_k`` = (work,
    k): the top-k to follow on these scores (its topk_workspace and k), whose first radix
    digit that kernel then counts. Returns whether it did: pass it on as topk's
    ``first_digit_counted``. ``q_frag``: q's fragments made ahead (indexer_query(frag=)), for
    the one-warp scorer (ignored by the others)."""
    HI, DI = q.shape
    if q_fp4 and _use_mma(mma, naive, HI, DI) and indexer_warp.fits_warp(HI, DI):
        counted = top_k is not None and keys_packed.shape[0] >= out.shape[0]  # (the same n)
        indexer_warp.indexer_scores_warp(out, q, w, keys_packed, n_visible, stream,
                                         first_digit=top_k if counted else None, q_frag=q_frag)
        return counted
    if _use_mma(mma, naive, HI, DI):
        indexer_mma.indexer_scores_mma(out, q, w, keys_packed, n_visible, stream)
        return False
    if naive:
        indexer_scores_chunk(out.reshape(1, out.shape[0]), q.reshape(1, HI, DI),
                             w.reshape(1, HI), keys_packed, n_visible, stream, threads, True)
        return False
    nt = threads or 128
    kern = _scorer_kernels(HI, DI, nt)[0]
    args = (out, q, w, keys_packed.view(np.uint32), keys_packed, n_visible)
    smem = _tile_smem(HI, DI, nt)
    kern[_tile_grid(kern, args, HI, out.shape[0], nt, smem), nt, stream, smem](*args)
    return False


# ---- top-k: naive rank ------------------------------------------------------------------------
@device.kernel
def _topk_rank(out_idx, scores, n_visible):
    """One thread per entry: its rank in the order (-score, index) is the number of entries that
    beat it; rank < k selects it, into slot ``rank``. O(N²), the reference made parallel."""
    k = out_idx.shape[0]
    n = min(int(n_visible[0]), scores.shape[0])
    for j in range(cuda.grid(1), max(scores.shape[0], k), cuda.gridsize(1)):
        if j < k and j >= n:
            out_idx[j] = -1  # padding: fewer visible entries than k
        if j < n:
            v = scores[j]
            rank = 0
            for i in range(n):
                o = scores[i]
                if o > v or (o == v and i < j):
                    rank += 1
            if rank < k:
                out_idx[rank] = j


# ---- top-k: radix select in one launch ------------------------------------------------------
# The float's bits map to an unsigned key with the same order (negative: all bits flipped,
# otherwise the sign bit set). Three histogram passes over 11/11/10-bit digits, each counting
# only entries whose higher digits equal the k-th largest key's, pin that key exactly (two
# passes when no scores tie there). The picks are then written in index order, so the list
# needs no sort: block b owns entries [lo, hi) (index order is block order), counts its entries
# above the key and equal to it, and after a grid barrier each block starts at the number of
# picks in the blocks before it. Of the entries equal to the key the first ``need`` in index
# order are picks (the tie rule); within a block, a scan of per-thread counts ranks them.
# Grid-wide barriers separate the phases (numba's cooperative-groups grid sync cannot be
# compiled without a driver, so CI lane B could not check it; this is the same
# counter-and-generation barrier). Every block redundantly scans the global histogram, so no
# extra phase is needed to publish the chosen digit. The histograms start zeroed (the
# workspace is made zeroed) and are zeroed again by block 0 once every block has read them,
# so no barrier is spent clearing them at the start.
_HIST = 1 << RADIX_BITS
_MAX_BLOCKS = 1024
_WS_GT = 3 * _HIST  # per-block counts of entries above the threshold key
_WS_EQ = _WS_GT + _MAX_BLOCKS  # ... and equal to it
_WS_BAR = _WS_EQ + _MAX_BLOCKS  # barrier: arrivals, generation (never cleared by the kernel)
_WS_LEN = _WS_BAR + 2


@_inline
def _barrier_generation(ws):
    """The barrier's generation as this launch starts (thread 0's, for _grid_barrier): read
    once, with the block's first loads, instead of at every barrier (one L2 round trip fewer
    on each barrier's path: the top-k alone 20.2 -> 19.9 µs at 65,536 scores, H100,
    2026-12-07 (x))."""
    return int32(cuda.atomic.add(ws, _WS_BAR + 1, 0)) if cuda.threadIdx.x == 0 else int32(0)


@_inline
def _grid_barrier(ws, G, gen):
    """Every block of the grid meets here; returns the generation after it (thread 0's
    ``gen``: _barrier_generation's, then each barrier's return). All G blocks must be
    resident at once: the launcher keeps G <= one block per SM. The arrival count returns to 0
    after each use; the generation only grows (wrapping), so that a later launch can read its
    start from it."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.threadfence()  # this block's writes before its arrival
        if cuda.atomic.add(ws, _WS_BAR, 1) == G - 1:
            cuda.atomic.add(ws, _WS_BAR, -G)
            cuda.threadfence()
            cuda.atomic.add(ws, _WS_BAR + 1, 1)
        else:
            while cuda.atomic.add(ws, _WS_BAR + 1, 0) == gen:
                cuda.nanosleep(64)
        cuda.threadfence()
    cuda.syncthreads()
    return int32(gen + int32(1))


_order_key = _inline(indexer_warp.order_key)  # (the scorer counts the first digit with it too)
assert indexer_warp.FIRST_DIGIT_BINS == _HIST and indexer_warp.FIRST_DIGIT_SHIFT == 32 - RADIX_BITS


@_inline
def _pick_digit(h, base, nb, need, wsum, xch, found):
    """The digit of the ``need``-th largest entry, from the counts h[base + d] of the nb digits:
    thread t sums the t-th slice of the bins in descending order and a block scan places it
    (_span_scan: warp shuffles and two barriers, where a Hillis-Steele scan over 512 threads
    had 19 barriers). Sets found[0] = the digit, found[1] = the entries in higher bins,
    found[2] = in its bin; every thread must call it (whole warps), and reads ``found`` after
    its closing barrier."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    per = (nb + nt - 1) // nt
    v = 0
    for r in range(tid * per, min(nb, tid * per + per)):
        v += h[base + nb - 1 - r]
    incl, _ = _span_scan(v, wsum, xch)
    cum = incl - v
    if cum < need and need <= incl:
        for r in range(tid * per, min(nb, tid * per + per)):
            c = h[base + nb - 1 - r]
            if cum + c >= need:
                found[0] = nb - 1 - r
                found[1] = cum
                found[2] = c
                break
            cum += c
    cuda.syncthreads()


_PER_THREAD = 4  # write-out: consecutive entries a thread owns per pass (one 16-byte load)
_XCH = 1024 if device.SIMULATOR else 1  # the simulator's shuffle scratch (floats, blockDim)


@_inline
def _span_scan(v, wsum, xch):
    """(inclusive prefix sum of the int ``v`` over the block, the block's total): xor
    butterflies within each warp (no barrier on a GPU), the warps' totals through ``wsum``
    (int32[32]), two barriers. Every thread must call it (blockDim a multiple of 32); ``xch``
    is the simulator's shuffle scratch (exact: the packed counts stay below 2^24 there)."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    incl = v
    tot = v  # after step ``off``: the total of this lane's group of 2 * off lanes
    off = 1
    while off < 32:
        y = int(device.xor_shfl(int32(tot), off, xch))
        if lane & off:
            incl += y  # the lower half of the group comes before this lane
        tot += y
        off *= 2
    if lane == 0:
        wsum[tid >> 5] = tot
    cuda.syncthreads()
    before = 0
    total = 0
    for w in range(cuda.blockDim.x >> 5):
        x = wsum[w]
        if w < tid >> 5:
            before += x
        total += x
    cuda.syncthreads()  # every thread has read wsum before the next call writes it
    return incl + before, total


@_inline
def _load_keys(keys, bits, j, n):
    """keys[i] <- the order key of entry j + i, i < _PER_THREAD (entries from n - 1 on read
    entry n - 1: every load unconditional, so all go out before the first is used)."""
    for i in range(_PER_THREAD):
        keys[i] = _order_key(bits[min(j + i, n - 1)])


@_inline
def _picks4(keys, j, hi, prefix, pmask):
    """Entries j .. j+3 (< hi; their order keys in keys, _load_keys) against the threshold:
    (count above it + count equal to it << 16, a bit per entry above, a bit per entry
    equal)."""
    gt = 0
    eq = 0
    for i in range(_PER_THREAD):
        if j + i < hi:
            u = keys[i] & pmask
            if u > prefix:
                gt |= 1 << i
            elif u == prefix:
                eq |= 1 << i
    return cuda.popc(gt) + (cuda.popc(eq) << 16), gt, eq


@_inline
def _scan_span(keys, j0, hi, prefix, pmask, wsum, xch):
    """_picks4 of this thread's entries j0 .. j0+3, ranked over the block by _span_scan:
    (packed count of the span's entries before j0, the span's packed total, gt / eq bits)."""
    v, gt, eq = _picks4(keys, j0, hi, prefix, pmask)
    incl, total = _span_scan(v, wsum, xch)
    return incl - v, total, gt, eq


@_inline
def _write_picks(out, j0, gt, eq, ex, run_gt, run_eq, need):
    """Write the picks among entries j0 .. j0+3 (bits gt / eq from _picks4) to their places in
    index order: ``ex`` is the packed count of entries before j0 in this span (exclusive scan),
    run_gt / run_eq those before the span. An entry above the threshold goes after every pick
    before it: the entries above it, and of the equal ones at most ``need``."""
    n_gt = run_gt + (ex & 0xFFFF)
    n_eq = run_eq + (ex >> 16)
    for i in range(_PER_THREAD):
        if gt & (1 << i):
            out[n_gt + min(need, n_eq)] = j0 + i
            n_gt += 1
        elif eq & (1 << i):
            if n_eq < need:
                out[n_gt + n_eq] = j0 + i
            n_eq += 1


@device.kernel
def _topk_radix_select(out_idx, bits, n_visible, ws, counted):
    """out_idx[k] <- bits[N] (the scores as uint32), n_visible[1], in ascending index order;
    ws[_WS_LEN] int32 scratch, its histograms zero on entry (and on exit) except, with
    ``counted``, the first digit's counts (ws[:_HIST], made by the scorer: that pass skipped).

    Every block must be resident at once (grid barriers; the launcher sizes the grid)."""
    k = out_idx.shape[0]
    n = min(int(n_visible[0]), bits.shape[0])
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    b = cuda.blockIdx.x
    G = cuda.gridDim.x
    if n <= k:  # everything visible is selected (grid-uniform branch: no barrier skipped)
        for i in range(cuda.grid(1), k, cuda.gridsize(1)):
            out_idx[i] = i if i < n else -1
        return
    hist = cuda.shared.array(_HIST, int32)
    found = cuda.shared.array(3, int32)
    wsum = cuda.shared.array(32, int32)
    xch = cuda.shared.array(_XCH, float32)
    chunk = (n + G - 1) // G  # block b owns entries [lo, hi): index order is rank order
    lo = b * chunk
    hi = min(n, lo + chunk)
    # One span (the usual case: N <= 2,048 a block): a thread's _PER_THREAD consecutive
    # entries loaded once, here, in flight during the first digit's pick, and every pass then
    # reads them from registers (a pass's loop over the block's stride waited on memory for
    # each of its entries in turn, and the write-out loaded them again: 65,536 scores 21.5 ->
    # 20.7 / 20.4 µs, H100, graphs of 20, BENCHMARKS 2026-12-06 (s))
    span = _PER_THREAD * nt
    j0 = lo + _PER_THREAD * tid
    keys = cuda.local.array(_PER_THREAD, int64)
    one_span = hi - lo <= span  # (block-uniform)
    if one_span:
        _load_keys(keys, bits, j0, n)
    gen = _barrier_generation(ws)
    prefix = 0
    pmask = 0
    need = k  # how many of the entries matching ``prefix`` still belong to the top k
    for p in range(3):
        shift = 21 - 11 * p if p < 2 else 0
        nb = _HIST if p < 2 else 1024
        if p > 0 or not counted:  # (grid-uniform)
            for i in range(tid, nb, nt):
                hist[i] = 0
            cuda.syncthreads()
            if one_span:
                for i in range(_PER_THREAD):
                    u = keys[i]
                    if j0 + i < hi and (u & pmask) == prefix:
                        cuda.atomic.add(hist, (u >> shift) & (nb - 1), 1)
            else:
                for j in range(lo + tid, hi, nt):
                    u = _order_key(bits[j])
                    if (u & pmask) == prefix:
                        cuda.atomic.add(hist, (u >> shift) & (nb - 1), 1)
            cuda.syncthreads()
            for i in range(tid, nb, nt):
                if hist[i] > 0:
                    cuda.atomic.add(ws, p * _HIST + i, hist[i])
            gen = _grid_barrier(ws, G, gen)
        _pick_digit(ws, p * _HIST, nb, need, wsum, xch, found)
        prefix |= int(found[0]) << shift
        pmask |= (nb - 1) << shift
        need -= int(found[1])
        done = int(found[2]) == need  # typical after two passes when no scores tie
        cuda.syncthreads()
        if done:
            break
    # entries whose digits so far beat ``prefix`` are picks, and the first ``need`` (in index
    # order) of those equal to it. Thread t owns _PER_THREAD consecutive entries of each span;
    # a block scan of (above, equal) counts ranks them, and the counts of the whole range go to
    # ws for the blocks after this one. With one span its entries and scan stay in registers
    # across the grid barrier.
    if not one_span:
        _load_keys(keys, bits, j0, n)
    ex, first, gt, eq = _scan_span(keys, j0, hi, prefix, pmask, wsum, xch)
    n_gt = first & 0xFFFF  # this block's counts
    n_eq = first >> 16
    for c0 in range(lo + span, hi, span):  # more spans: their counts only, for now
        _load_keys(keys, bits, c0 + _PER_THREAD * tid, n)
        _, last, _, _ = _scan_span(keys, c0 + _PER_THREAD * tid, hi, prefix, pmask, wsum, xch)
        n_gt += last & 0xFFFF
        n_eq += last >> 16
    if tid == 0:
        ws[_WS_GT + b] = n_gt
        ws[_WS_EQ + b] = n_eq
        found[0] = 0
        found[1] = 0
    _grid_barrier(ws, G, gen)
    if b == 0:  # every block has read the histograms (before the barrier): clear them
        for i in range(tid, 3 * _HIST, nt):
            ws[i] = 0
    for i in range(tid, b, nt):  # the counts of the blocks before this one
        cuda.atomic.add(found, 0, ws[_WS_GT + i])
        cuda.atomic.add(found, 1, ws[_WS_EQ + i])
    cuda.syncthreads()
    run_gt = int(found[0])  # block-uniform from here on
    run_eq = int(found[1])
    for c0 in range(lo, hi, span):
        last = first
        if c0 > lo:  # a later span: its entries and scan again
            j0 = c0 + _PER_THREAD * tid
            _load_keys(keys, bits, j0, n)
            ex, last, gt, eq = _scan_span(keys, j0, hi, prefix, pmask, wsum, xch)
        _write_picks(out_idx, j0, gt, eq, ex, run_gt, run_eq, need)
        run_gt += last & 0xFFFF
        run_eq += last >> 16


def topk_workspace(stream=0):
    """Scratch for ``topk`` (histograms, counters, the grid barrier: it must start zeroed);
    one per stream that runs top-k."""
    return cuda.to_device(np.zeros(_WS_LEN, np.int32), stream=stream)


_WORKSPACE = []


def default_topk_workspace(stream=0):
    """The module-wide ``topk`` workspace (made on first use): calls on one stream only."""
    if not _WORKSPACE:
        _WORKSPACE.append(topk_workspace(stream))
    return _WORKSPACE[0]


def topk(out_idx, scores, n_visible, k: int, stream=0, threads=None, naive: bool = False,
         work=None, blocks=None, first_digit_counted: bool = False) -> None:
    """out_idx[k] int32 <- the indices of the k largest scores[N] f32 among j < n_visible[1].

    The picks come in ascending index order (the naive kernel: by rank); ties at the k-th
    value go to the lowest index; with n_visible <= k the result is 0 .. n_visible-1 padded
    with -1. ``work`` is a ``topk_workspace()``; by default one module-wide buffer (calls on
    one stream only).
    ``threads``: the block (whole warps, at most TOPK_MAX_THREADS; more are capped there).
    ``blocks``: the grid (benchmarks; default one block per ~4 entries a thread, <= SMs).
    ``first_digit_counted``: the scorer has counted the first radix digit of these scores into
    ``work`` (indexer_scores(..., top_k=(work, k))), so that pass is skipped.
    """
    if out_idx.shape[0] != k:
        raise ValueError(f"topk: out_idx has {out_idx.shape[0]} slots, k = {k}")
    N = scores.shape[0]
    if naive:
        nt = threads or 128
        _topk_rank[min(cdiv(max(N, k), nt), 4096), nt, stream](out_idx, scores, n_visible)
        return
    if work is None:
        work = default_topk_workspace(stream)
    nt = max(32, min(threads or TOPK_THREADS, TOPK_MAX_THREADS) // 32 * 32)  # whole warps
    # at most one block per SM, so all are resident for the grid barriers; ~4 entries a thread
    if blocks is None:
        blocks = 1 if device.SIMULATOR else max(1, min(device.sm_count(), cdiv(N, 4 * nt)))
    assert 1 <= blocks <= max(1, device.sm_count()), "topk: every block must be resident"
    _topk_radix_select[blocks, nt, stream](out_idx, scores.view(np.uint32), n_visible, work,
                                           int(first_digit_counted))


# ---- top-k: chunk form, one block per token ---------------------------------------------------
# A prefill chunk selects for T tokens at once, each among its own n_visible[t] entries: block t
# runs the three digit passes above on row t with the histogram in shared memory (no grid
# barrier, no workspace), then one write-out pass over the row. (Or, where the first pass's
# threshold bin is small, one more pass lists the bin's entries in shared memory and the rest
# runs on the list: _topk_chunk_kernel.) Entries above the threshold take
# slots 0 .. k-need-1 through a shared counter; entries equal to it take the last ``need`` slots
# in index order, ranked by a 0/1 block scan per chunk of blockDim entries: each thread sets its
# bit in a shared mask and counts the set bits below it (popc), one barrier per chunk. Three
# masks rotate so a chunk's mask is cleared two barriers before it is reused.
_EQ_WORDS = 32  # mask words per chunk: blockDim <= 1024
_EQ_LEN = 3 * _EQ_WORDS  # (a literal for cuda.shared.array)
# entries a thread loads before it uses the first: a row's pass with one load in flight a
# thread waits out a memory latency per entry (~65K entries a row, 512 threads: 128 in turn;
# H200, 2026-12-04 (c): 0.72 ms a call of ~680 rows of 65,536, four passes each)
_ROW_ILP = 8


@_inline
def _load_ilp(got, row, j0, nt, n):
    """got[e] <- row[j0 + e·nt] for e < _ROW_ILP, clamped to the row's last entry (the
    caller masks those): every load is issued before the first use."""
    for e in range(_ROW_ILP):
        got[e] = row[min(j0 + e * nt, n - 1)]


_CAND = 4096  # candidates a block keeps in shared memory (the threshold's top-digit bin)
# Ties at the k-th score ranked on the list: at most this many (they are copied to one array
# and each counts the lower indices among them: a loop as long as the ties); more take one more
# pass over the row after the list. Ranking them against the whole list instead (ties x list
# steps) made the 256K prefill's top-k 2.8x slower than the four passes: the synthetic caches
# repeat every key 256 times, so every row ties 256 ways at the threshold (Nsight, H100,
# 2026-12-05 (f)). 512 rows of 65,536 with 256 ties (H100): ranked on the list 233.9 us, by
# the row pass 219.6, tie-free 192.3; the ranking's cost grows with the ties, so the two
# break even near 170 ties.
_TIE_LIST = 128  # (<= buf's 1024 entries)
_CHUNK_TOPK: dict = {}


def _topk_chunk_kernel(cand: int, tie_list: int = _TIE_LIST):
    """The chunk top-k kernel keeping up to ``cand`` candidates in shared memory (a closure
    constant: the arrays' size). After the first digit pass, a row whose threshold bin holds
    at most ``cand`` entries is read once more: entries above the bin are picks, written at
    once, and the bin's entries (index, key) go to a shared list, on which the other two digit
    passes and the write-out run. Two passes over the row instead of four (three when more than
    ``tie_list`` entries tie at the k-th score); a larger bin takes the row passes below."""
    assert 1 <= tie_list <= 1024, "topk_chunk: tied entries are ranked in buf (1024 entries)"
    if (cand, tie_list) in _CHUNK_TOPK:
        return _CHUNK_TOPK[cand, tie_list]

    @device.kernel
    def _topk_chunk_radix_select(out_idx, bits, n_visible):
        """out_idx[T, k] <- bits[T, N] (the scores as uint32), n_visible[T]; a block per row
        t (grid T), blockDim whole warps, <= 1024."""
        k = out_idx.shape[1]
        t = cuda.blockIdx.x
        n = min(int(n_visible[t]), bits.shape[1])
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        row = bits[t]
        out = out_idx[t]
        if n <= k:  # everything visible is selected (block-uniform branch)
            for i in range(tid, k, nt):
                out[i] = i if i < n else -1
            return
        hist = cuda.shared.array(_HIST, int32)
        buf = cuda.shared.array(1024, int32)
        found = cuda.shared.array(6, int32)  # digit, above it, in it; slot, candidate, tie counters
        wsum = cuda.shared.array(32, int32)  # _pick_digit's scan
        xch = cuda.shared.array(_XCH, float32)
        eqmask = cuda.shared.array(_EQ_LEN, uint32)
        cidx = cuda.shared.array(cand, int32)  # the candidates: index, order key
        ckey = cuda.shared.array(cand, uint32)
        got = cuda.local.array(_ROW_ILP, uint32)
        for i in range(tid, _EQ_LEN, nt):
            eqmask[i] = 0
        if tid == 0:
            found[3] = 0
            found[4] = 0
            found[5] = 0
        prefix = 0
        pmask = 0
        need = k  # how many of the entries matching ``prefix`` still belong to the top k
        done = False  # the entries matching ``prefix`` are exactly ``need``: all are taken
        listed = False  # the bin's entries are in cidx / ckey (block-uniform)
        ncand = 0
        for p in range(3):
            shift = 21 - 11 * p if p < 2 else 0
            nb = _HIST if p < 2 else 1024
            for i in range(tid, nb, nt):
                hist[i] = 0  # (the previous pass read hist before _pick_digit's last barrier)
            cuda.syncthreads()
            if listed:
                for i in range(tid, ncand, nt):
                    u = int(ckey[i])
                    if (u & pmask) == prefix:
                        cuda.atomic.add(hist, (u >> shift) & (nb - 1), 1)
            else:
                for j0 in range(tid, n, nt * _ROW_ILP):
                    _load_ilp(got, row, j0, nt, n)
                    for e in range(_ROW_ILP):
                        u = _order_key(got[e])
                        if j0 + e * nt < n and (u & pmask) == prefix:
                            cuda.atomic.add(hist, (u >> shift) & (nb - 1), 1)
            cuda.syncthreads()
            _pick_digit(hist, 0, nb, need, wsum, xch, found)
            prefix |= int(found[0]) << shift
            pmask |= (nb - 1) << shift
            need -= int(found[1])
            done = int(found[2]) == need
            if done:
                break
            if p == 0 and int(found[2]) <= cand:  # the row once more: picks and candidates
                for j0 in range(tid, n, nt * _ROW_ILP):
                    _load_ilp(got, row, j0, nt, n)
                    for e in range(_ROW_ILP):
                        key = _order_key(got[e])
                        if j0 + e * nt < n:
                            if (key & pmask) > prefix:
                                out[cuda.atomic.add(found, 3, 1)] = j0 + e * nt
                            elif (key & pmask) == prefix:
                                slot = cuda.atomic.add(found, 4, 1)
                                cidx[slot] = j0 + e * nt
                                ckey[slot] = uint32(key)
                cuda.syncthreads()
                listed = True
                ncand = int(found[4])
        if listed:  # the write-out from the list; ties at the k-th score go to buf if few
            ties = int(found[2])  # (not done: all three digits passed, so exact ties)
            few = done or ties <= tie_list  # block-uniform
            for i in range(tid, ncand, nt):
                u = int(ckey[i]) & pmask
                if u > prefix or u == prefix and done:
                    out[cuda.atomic.add(found, 3, 1)] = cidx[i]
                elif u == prefix and few:
                    buf[cuda.atomic.add(found, 5, 1)] = cidx[i]
            if done:
                return
            if few:  # each tied entry's rank: the tied entries with lower indices
                cuda.syncthreads()
                for i in range(tid, ties, nt):
                    j = buf[i]
                    rank = 0
                    for o in range(ties):
                        rank += 1 if buf[o] < j else 0
                    if rank < need:
                        out[k - need + rank] = j
                return
            # many ties: ranked by the row scan below (the entries above are written)
        elif done:  # the entries matching ``prefix`` are exactly the ones still needed: no ranks
            for j0 in range(tid, n, nt * _ROW_ILP):
                _load_ilp(got, row, j0, nt, n)
                for e in range(_ROW_ILP):
                    if j0 + e * nt < n and (_order_key(got[e]) & pmask) >= prefix:
                        out[cuda.atomic.add(found, 3, 1)] = j0 + e * nt
            return
        lane = uint32(tid & 31)
        below = (uint32(1) << lane) - uint32(1)  # this thread's lower lanes in its mask word
        run = 0  # entries equal to the threshold in earlier chunks (block-uniform)
        for c in range((n + nt - 1) // nt):
            if listed and run >= need:  # (block-uniform) the rest of the row holds no picks
                break
            j = c * nt + tid
            u = (_order_key(row[j]) & pmask) if j < n else -1
            if u > prefix and not listed:
                out[cuda.atomic.add(found, 3, 1)] = j
            if run < need:  # block-uniform: run comes from syncthreads_count
                m = _EQ_WORDS * (c % 3)
                eq = u == prefix
                if eq:
                    cuda.atomic.or_(eqmask, m + (tid >> 5), uint32(1) << lane)
                cnt = cuda.syncthreads_count(int32(1 if eq else 0))
                if eq:
                    rank = run + int(cuda.popc(eqmask[m + (tid >> 5)] & below))
                    for i in range(tid >> 5):
                        rank += int(cuda.popc(eqmask[m + i]))
                    if rank < need:
                        out[k - need + rank] = j
                # chunk c-1's mask: read before this chunk's barrier, next set in chunk c+2
                for i in range(tid, _EQ_WORDS, nt):
                    eqmask[_EQ_WORDS * ((c + 2) % 3) + i] = 0
                run += cnt

    _CHUNK_TOPK[cand, tie_list] = _topk_chunk_radix_select
    return _topk_chunk_radix_select


def topk_chunk(out_idx, scores, n_visible, k: int, stream=0, threads=None,
               cand: int = _CAND, tie_list: int = _TIE_LIST) -> None:
    """out_idx[T, k] int32 <- for every token t, the indices of the k largest scores[t, j] f32
    among j < n_visible[t] (scores[T, N], n_visible[T] int32): the prefill form of ``topk``.

    One launch, one block per token; same tie rule and -1 padding as ``topk``, order within a
    row arbitrary (the prefill sorts the rows). No workspace and no host sync, so it can be
    captured in a graph. ``cand``: the shared candidate list's size (tests: a small one sends
    rows down the four-pass path); ``tie_list``: the most ties at the k-th score ranked on the
    list (tests: a small one sends them to the row scan).
    """
    T = scores.shape[0]
    if out_idx.shape != (T, k):
        raise ValueError(f"topk_chunk: out_idx is {out_idx.shape}, want ({T}, {k})")
    if T == 0:
        return
    nt = max(32, min(threads or TOPK_THREADS, 1024) // 32 * 32)  # whole warps (_pick_digit)
    _topk_chunk_kernel(cand, tie_list)[T, nt, stream](out_idx, scores.view(np.uint32),
                                                      n_visible)


# ---- CI lane B and the benchmark --------------------------------------------------------------
_SCORES_SIG = ("void(float32[::1], float32[:, ::1], float32[::1], uint32[:, ::1], uint8[:, ::1], "
               "int32[::1])")
_CHUNK_SIG = ("void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], uint32[:, ::1], "
              "uint8[:, ::1], int32[::1])")
_V4_SCORERS = _scorer_kernels(64, 128, 128)  # V4-Flash: HI = 64, DI = 128, 128 threads
PTX_SIGNATURES = [
    (_indexer_scores_naive, "void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], "
                            "uint8[:, ::1], int32[::1])"),
    (_V4_SCORERS[0], _SCORES_SIG),
    (_V4_SCORERS[1], _CHUNK_SIG),
    (_topk_rank, "void(int32[::1], float32[::1], int32[::1])"),
    (_topk_radix_select, "void(int32[::1], uint32[::1], int32[::1], int32[::1], int64)"),
    (_topk_chunk_kernel(_CAND), "void(int32[:, ::1], uint32[:, ::1], int32[::1])"),
]


def random_packed_keys(rng, n: int, DI: int) -> np.ndarray:
    """[n, index_key_bytes(DI)] uint8: random keys through the model's FP4 round-trip, packed."""
    from ..numerics import fp4_roundtrip

    x = fp4_roundtrip(rng.normal(size=(n, DI)).astype(np.float32), 32)
    out = np.empty((n, kvpack.index_key_bytes(DI)), np.uint8)
    kvpack.pack_index_key_ref(out, x)
    return out


_KIND = {False: "register tiles", True: "tensor cores"}


def bench_cases(stream) -> list[BenchCase]:
    """V4-Flash shapes: HI = 64, DI = 128, k = 512, N = 262,144 (1M context) and 65,536, q on
    the FP4 grid as the model's (hadamard_fp4); the scorer alone by kernel (register tiles,
    tensor cores; the engine's one-warp form) and with the top-k as the engine runs them (the
    first digit counted by the scorer) and as it did (by the top-k); a prefill chunk's scores
    (T = 256 tokens over 65,536 keys) by kernel (the per-token blocks, and the chunk tiles the
    prefill takes), and its top-k over a chunk of T = 512 tokens."""
    from ..numerics import fp4_roundtrip
    rng = np.random.default_rng(0)
    HI, DI, k = 64, 128, 512
    cases = []

    def q_fp4(*shape):
        return fp4_roundtrip(rng.normal(size=shape), 32).astype(np.float32)
    for N in (262_144, 65_536):
        keys = cuda.to_device(random_packed_keys(rng, N, DI), stream=stream)
        q = cuda.to_device(q_fp4(HI, DI), stream=stream)
        w = cuda.to_device((rng.normal(size=HI) / 90.51).astype(np.float32), stream=stream)
        nv = cuda.to_device(np.array([N], np.int32), stream=stream)
        scores = cuda.device_array(N, np.float32, stream=stream)
        idx = cuda.device_array(k, np.int32, stream=stream)
        work = topk_workspace(stream)
        nbytes = keys.nbytes + q.nbytes + w.nbytes + scores.nbytes
        for mma in (False, True):
            def scores_only(scores=scores, q=q, w=w, keys=keys, nv=nv, mma=mma):
                indexer_scores(scores, q, w, keys, nv, stream=stream, mma=mma)
            cases.append(BenchCase("indexer", f"indexer_scores {_KIND[mma]} N={N} HI={HI}",
                                   scores_only, nbytes, flops=2 * N * HI * (DI + 1)))
        for groups in (1, 2):  # the engine's: q on the FP4 grid, one warp every head
            def one_warp(scores=scores, q=q, w=w, keys=keys, nv=nv, groups=groups):
                indexer_warp.indexer_scores_warp(scores, q, w, keys, nv, stream, groups=groups)
            cases.append(BenchCase("indexer", f"indexer_scores tensor cores, a warp every head "
                                   f"({8 * groups} keys a step) N={N} HI={HI}", one_warp, nbytes,
                                   flops=2 * N * HI * (DI + 1)))

        for fused in (True, False):
            def launch(scores=scores, q=q, w=w, keys=keys, nv=nv, idx=idx, work=work,
                       fused=fused):
                counted = indexer_scores(scores, q, w, keys, nv, stream=stream, q_fp4=fused,
                                         top_k=(work, k) if fused else None)
                topk(idx, scores, nv, k, stream=stream, work=work, first_digit_counted=counted)

            how = "" if fused else " (before: 16 heads a warp, the top-k's own first pass)"
            cases.append(BenchCase("indexer", f"indexer_scores+topk N={N} HI={HI} k={k}{how}",
                                   launch, nbytes + scores.nbytes + idx.nbytes,
                                   flops=2 * N * HI * (DI + 1),
                                   target="<= 150 us" if N == 262_144 and fused else ""))
        for blocks in (None, 1, 4, 16):  # the top-k alone, by grid (the scores of the case above)
            def select(scores=scores, nv=nv, idx=idx, work=work, blocks=blocks):
                topk(idx, scores, nv, k, stream=stream, work=work, blocks=blocks)
            cases.append(BenchCase("indexer", f"topk N={N} k={k} blocks={blocks or 'auto'}",
                                   select, scores.nbytes + idx.nbytes, flops=0))
    T, N = 256, 65_536  # prefill: a chunk's tokens each over (nearly) every key
    keys = cuda.to_device(random_packed_keys(rng, N, DI), stream=stream)
    q = cuda.to_device(q_fp4(T, HI, DI), stream=stream)
    w = cuda.to_device((rng.normal(size=(T, HI)) / 90.51).astype(np.float32), stream=stream)
    nv = cuda.to_device(np.arange(N - T + 1, N + 1, dtype=np.int32), stream=stream)
    scores = cuda.device_array((T, N), np.float32, stream=stream)
    ws = cuda.device_array((indexer_mma.key_ws_rows(N), DI // 2), np.uint32, stream=stream)
    key_ws = indexer_mma.decode_keys(ws, keys, N, stream)  # (the prefill: once a layer)
    for mma, tiles in ((False, False), (True, False), (True, True)):
        def chunk(scores=scores, q=q, w=w, nv=nv, mma=mma, tiles=tiles):
            indexer_scores_chunk(scores, q, w, keys, nv, stream=stream, mma=mma, q_fp4=tiles,
                                 key_ws=key_ws)
        kind = "tensor-core tiles (keys decoded)" if tiles else _KIND[mma]
        cases.append(BenchCase("indexer", f"indexer_scores_chunk {kind} T={T} N={N}", chunk,
                               keys.nbytes + q.nbytes + w.nbytes + scores.nbytes,
                               flops=2 * T * N * HI * (DI + 1)))

    def decode(ws=ws, keys=keys):
        indexer_mma.decode_keys(ws, keys, N, stream)
    cases.append(BenchCase("indexer", f"decode_keys N={N} (FP4 -> bf16 rows)", decode,
                           keys.nbytes + ws.nbytes, flops=0))
    T = 512  # a prefill chunk ending the context: token t sees N - (T-1-t) entries
    # "256 copies": each row 256 distinct scores, tiled, as the bench's synthetic caches make
    # them (every key 256 times): 256 ties at the k-th score
    for N, copies in ((262_144, False), (65_536, False), (65_536, True)):
        nv_host = np.arange(N - T + 1, N + 1, dtype=np.int32)
        if copies:
            scores = np.tile(rng.standard_normal((T, 256), dtype=np.float32), N // 256)
        else:
            scores = rng.standard_normal((T, N), dtype=np.float32)
        for t in range(T):
            scores[t, nv_host[t]:] = -np.inf
        scores = cuda.to_device(scores, stream=stream)
        nv = cuda.to_device(nv_host, stream=stream)
        idx = cuda.device_array((T, k), np.int32, stream=stream)
        variants = [(_CAND, _TIE_LIST, ""), (1, _TIE_LIST, " rows read each pass (cand 1)")]
        if copies:  # (the default sends these 256 ties to the row pass)
            variants.insert(1, (_CAND, 1024, " ties ranked on the list (tie_list 1024)"))
        for cand, tie_list, how in variants:
            def launch(idx=idx, scores=scores, nv=nv, cand=cand, tie_list=tie_list):
                topk_chunk(idx, scores, nv, k, stream=stream, cand=cand, tie_list=tie_list)

            what = " 256 copies" if copies else ""
            cases.append(BenchCase("indexer", f"topk_chunk T={T} N={N}{what} k={k}{how}",
                                   launch, 4 * int(nv_host.sum()) + nv.nbytes + idx.nbytes))
    return cases
