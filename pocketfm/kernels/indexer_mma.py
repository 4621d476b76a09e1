"""Lightning-indexer scores on the tensor cores: out[j] = Σ_h w[h] · ReLU(q[h] · key_j).

Why: the register-tile scorer (indexer.py) runs the [HI, DI] x [DI, N] product on the CUDA
cores and is FMA-bound (H200: 52 µs per CSA layer at 65,536 keys, 138 µs at 262,144, ~33
TFLOP/s in prefill chunks). The keys are FP4 — e2m1 codes times a power-of-two scale per 32
dims — so every key value is exact in bf16, and ``mma.sync`` (mma.py's inline PTX) takes them
as they are. q is split as hi + lo, two bf16 values (mma.py's ``_split_pair``, |error| <=
2^-16 |q|); the model's q has been through the FP4 round-trip (hadamard_fp4), so lo is zero, and
a block that finds every lo zero skips those MMAs: one MMA per tile, exact products, float32
sums — the same numbers as the CUDA-core scorer up to the order of the sums.

Layout. A block is HI / 16 warps; warp w owns heads 16w .. 16w+15 (the A operand, kept in
registers for the whole launch: DI/16 k-steps x 4 registers, hi and lo), and every warp walks
the same keys, 8 per MMA (the B operand, decoded from the packed key straight into fragment
registers). Inside a k-step s (16 dims) lane c = lane % 4 holds dims 16s + 4c .. 16s + 4c + 3
of both operands — a permutation of the MMA's k index, which leaves the sum unchanged — so the
lane's B registers are the two bytes 8s + 2c, 8s + 2c + 1 of the key (one 32-bit word, a
256-entry byte -> bf16-pair table in shared memory) and its A registers four consecutive q
dims. A 32-dim scale block is two k-steps: their MMAs start from zero and the result is scaled
per key (column) and added to the float32 accumulator (the scale is a power of two: exact).

Epilogue of 8 keys: C holds heads (g, g + 8) x keys (2c, 2c + 1) per lane; ReLU, times w[head],
summed over the lane's two heads, then over g (xor shuffles 4, 8, 16), then over the warps in
warp order through shared memory. Letters: HI index heads, DI index dim, N keys, T tokens.

Chunk tiles (``indexer_scores_chunk_mma(q_fp4=True)``, the prefill's form). The per-token
blocks above decode every key once per warp for 16 heads, and their time is that decode, the
per-block scale epilogue and their latency (~50 TFLOP/s), not the MMAs. When q is on the FP4
grid (the model's q always is: hadamard_fp4 output) hi is exact and lo zero, so a block of 8
warps takes TB = 8 / (HI / 32) tokens: warp w owns token w // (HI / 32) and 32 of its heads
(two m-tiles: every B fragment feeds two MMAs). Per step of 32 keys the block decodes the keys
ONCE into shared memory, in fragment order (one 8-byte word per lane, k-step and 8-key
n-tile), as bf16 with the key's scale folded into the exponent (FP4 times a power of two is
exact in bf16), so the 8 k-steps accumulate straight in the MMAs' float32 C with no per-block
epilogue. One (key, k-step) pair per thread: a byte -> (bf16 pair, nonzero halves) table; the
scale enters as one integer multiply-add on the pair's exponent fields. The next step's key
words are loaded before this step's MMAs; keys and partial sums are double-buffered, so a
step takes one barrier. Summation order differs from the per-token kernel (float32 sums).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32, uint64

from .device import SIMULATOR, cdiv, kernel, resident_blocks, xor_shfl
from .gemv import _bits_f32
from .mma import _mma_bf16, _split_pair

GROUPS = 4  # 8-key MMA groups per block step (their key loads are issued together)
STEP_KEYS = 8 * GROUPS
MAX_WARPS = 8  # HI <= 128
XCH = 32 * MAX_WARPS * 6 if SIMULATOR else 1  # simulator MMA exchange (mma.py's emulation)
SHF = 32 * MAX_WARPS if SIMULATOR else 1  # simulator lane exchange
PART = MAX_WARPS * STEP_KEYS


def fits(HI: int, DI: int) -> bool:
    """Whether the tensor-core scorer takes this geometry (16-head warps, 32-dim FP4 blocks)."""
    return HI % 16 == 0 and 16 <= HI <= 16 * MAX_WARPS and DI % 32 == 0


@cuda.jit(device=True)
def _e2m1_bf16(nib):
    """bf16 bits of the e2m1 nibble's value (0, .5, 1, 1.5, 2, 3, 4, 6, signed by bit 3):
    codes m >= 2 are 2^(m/2 - 1) with m's low bit as the top mantissa bit."""
    m = nib & 7
    bits = ((126 + (m >> 1)) << 7) | ((m & 1) << 6)
    if m == 1:
        bits = 0x3F00  # 0.5
    if m == 0:
        bits = 0
    return bits | ((nib & 8) << 12)


@cuda.jit(device=True)
def _key_scale(keys8, j, col):
    """2^(e - 127) of scale byte ``col`` of key j, as float32 bits (e = 0 reads as 0)."""
    return _bits_f32(int32(keys8[j, col]) << 23)


def _scorer(DI: int):
    """The block routine for keys of DI dims (a closure constant: fixed register arrays)."""
    S = DI // 16  # k-steps
    NB = DI // 32  # scale blocks (two k-steps each)
    NQ = 4 * S  # A registers per lane, per half (hi / lo)
    NW = GROUPS * S  # key words per lane per block step

    @cuda.jit(device=True)
    def score(out, q, w, keys32, keys8, n):
        """out[N] for keys j < n (-inf from n on), q[HI, DI], w[HI]; persistent grid over
        STEP_KEYS-key steps. Every thread of the block must call it."""
        N = out.shape[0]
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        nwarps = nt >> 5
        tab = cuda.shared.array(256, uint32)  # byte -> bf16 pair (low nibble in the low half)
        part = cuda.shared.array(PART, float32)  # [warp, key] head-group partial scores
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        for i in range(tid, 256, nt):
            tab[i] = uint32(_e2m1_bf16(i & 15)) | (uint32(_e2m1_bf16(i >> 4)) << uint32(16))
        qhi = cuda.local.array(NQ, uint32)
        qlo = cuda.local.array(NQ, uint32)
        h0, h1 = 16 * warp + g, 16 * warp + g + 8
        any_lo = 0
        for s in range(S):
            d = 16 * s + 4 * c
            for r in range(2):  # registers (h0, d..d+1), (h1, d..d+1), (h0, d+2..), (h1, d+2..)
                hi, lo = _split_pair(q[h0, d + 2 * r], q[h0, d + 2 * r + 1])
                qhi[4 * s + 2 * r], qlo[4 * s + 2 * r] = hi, lo
                any_lo |= int32(lo != 0)
                hi, lo = _split_pair(q[h1, d + 2 * r], q[h1, d + 2 * r + 1])
                qhi[4 * s + 2 * r + 1], qlo[4 * s + 2 * r + 1] = hi, lo
                any_lo |= int32(lo != 0)
        w0, w1 = w[h0], w[h1]
        split = cuda.syncthreads_or(any_lo)  # also: the table is complete
        zero = float32(0.0)
        half = uint32(16 * (c & 1))
        wv = cuda.local.array(NW, uint32)
        for k0 in range(cuda.blockIdx.x * STEP_KEYS, N, cuda.gridDim.x * STEP_KEYS):
            if k0 >= n:  # past the visible keys (block-uniform): only the -inf fill
                for i in range(tid, STEP_KEYS, nt):
                    if k0 + i < N:
                        out[k0 + i] = -math.inf
                continue
            for gi in range(GROUPS):  # every key word this lane needs, loaded up front
                j = min(k0 + 8 * gi + g, n - 1)
                for s in range(S):
                    wv[gi * S + s] = uint32(keys32[j, 2 * s + (c >> 1)])
            for gi in range(GROUPS):
                ja = min(k0 + 8 * gi + 2 * c, n - 1)  # the keys of this lane's C columns
                jb = min(ja + 1, n - 1)
                a0, a1, a2, a3 = zero, zero, zero, zero
                for b in range(NB):
                    t0, t1, t2, t3 = zero, zero, zero, zero
                    for s in range(2 * b, 2 * b + 2):
                        pair = (wv[gi * S + s] >> half) & uint32(0xFFFF)
                        b0 = tab[pair & uint32(0xFF)]
                        b1 = tab[pair >> uint32(8)]
                        t0, t1, t2, t3 = _mma_bf16(qhi[4 * s], qhi[4 * s + 1], qhi[4 * s + 2],
                                                   qhi[4 * s + 3], b0, b1, t0, t1, t2, t3, xch)
                        if split:
                            t0, t1, t2, t3 = _mma_bf16(qlo[4 * s], qlo[4 * s + 1],
                                                       qlo[4 * s + 2], qlo[4 * s + 3], b0, b1,
                                                       t0, t1, t2, t3, xch)
                    sa = _key_scale(keys8, ja, DI // 2 + b)
                    sb = _key_scale(keys8, jb, DI // 2 + b)
                    a0 += t0 * sa
                    a1 += t1 * sb
                    a2 += t2 * sa
                    a3 += t3 * sb
                # C: (h0, key 2c) (h0, key 2c+1) (h1, key 2c) (h1, key 2c+1)
                pa = w0 * max(a0, zero) + w1 * max(a2, zero)
                pb = w0 * max(a1, zero) + w1 * max(a3, zero)
                for off in (4, 8, 16):
                    pa += xor_shfl(pa, off, shf)
                    pb += xor_shfl(pb, off, shf)
                if g == 0:
                    part[warp * STEP_KEYS + 8 * gi + 2 * c] = pa
                    part[warp * STEP_KEYS + 8 * gi + 2 * c + 1] = pb
            cuda.syncthreads()
            for i in range(tid, STEP_KEYS, nt):
                j = k0 + i
                if j < N:
                    sc = zero
                    for wi in range(nwarps):
                        sc += part[wi * STEP_KEYS + i]
                    out[j] = sc if j < n else -math.inf
            cuda.syncthreads()  # part is rewritten by the next step
    return score


_KERNELS: dict = {}


def _kernels(DI: int):
    """(decode kernel, chunk kernel) for keys of DI dims."""
    if DI not in _KERNELS:
        score = _scorer(DI)

        def decode(out, q, w, keys32, keys8, n_visible):
            # out [N], q [HI, DI], w [HI], n_visible [1]
            n = min(int(n_visible[0]), out.shape[0], keys8.shape[0])
            score(out, q, w, keys32, keys8, n)

        def chunk(out, q, w, keys32, keys8, n_visible):
            # out [T, N], q [T, HI, DI], w [T, HI], n_visible [T]; blockIdx.y = token
            t = cuda.blockIdx.y
            n = min(int(n_visible[t]), out.shape[1], keys8.shape[0])
            score(out[t], q[t], w[t], keys32, keys8, n)
        decode.__name__ = f"_indexer_scores_mma_di{DI}"
        chunk.__name__ = f"_indexer_scores_chunk_mma_di{DI}"
        _KERNELS[DI] = (kernel(decode), kernel(chunk))
    return _KERNELS[DI]


# ---- chunk tiles: several tokens a block, keys decoded once into shared memory ---------------
TILE_WARPS = 8
TILE_KEYS = 32  # keys per block step: 4 n-tiles of 8 for every warp
TILE_NT = TILE_KEYS // 8
TILE_REGS = 128  # two blocks of 8 warps an SM


def fits_tiles(HI: int, DI: int) -> bool:
    """Whether the chunk tiles kernel takes this geometry (32-head warps, at most 8 a token;
    q's fragments, DI / 2 registers, held for the whole launch)."""
    return HI % 32 == 0 and 32 <= HI <= 32 * TILE_WARPS and DI % 32 == 0 and DI <= 128


@cuda.jit(device=True)
def _e2m1_nonzero(nib):
    return int32((nib & 7) != 0)


@cuda.jit(device=True)
def _scaled_pair(t, e7):
    """A table entry's bf16 pair with e7 = 128 (e - 127) added to the exponent field of each
    nonzero half (the entry's high word: 1 for the low half, 65536 for the high one): one
    integer multiply-add, no carry between the halves while the exponents stay in 1 .. 254."""
    return uint32(int64(t & np.uint64(0xFFFFFFFF)) + e7 * int64(t >> np.uint64(32)))


def _tile_scorer(HI: int, DI: int):
    """The chunk tiles kernel for HI heads of DI dims (closure constants: register arrays)."""
    S = DI // 16  # k-steps
    WPT = HI // 32  # warps a token
    TB = TILE_WARPS // WPT  # tokens a block
    PAIRS = TILE_KEYS * S  # (key, k-step) pairs decoded a step: at most one a thread
    FRAG = S * TILE_NT * 32  # fragment words (8 bytes: b0, b1) of one step's keys
    NQ = 2 * S * 4  # A registers: two m-tiles x S k-steps x 4
    NH = TILE_NT // 2  # n-tiles a pass
    NACC = 2 * NH * 4  # C registers: two m-tiles x a pass's n-tiles x 4
    PART = TILE_WARPS * TILE_KEYS
    FRAG2, PART2 = 2 * FRAG, 2 * PART  # double buffers

    @cuda.jit(device=True)
    def load_pair(keys32, keys8, j, p):
        """The packed words of key j for k-step p // TILE_KEYS, and its scale byte."""
        s = p // TILE_KEYS
        return (uint32(keys32[j, 2 * s]), uint32(keys32[j, 2 * s + 1]),
                int32(keys8[j, DI // 2 + (s >> 1)]))

    @cuda.jit(device=True)
    def store_pair(frag, base, tab, p, w0, w1, e):
        """Decode a pair's two words (16 dims: lanes 4g .. 4g+3 of n-tile kk // 8) into the
        step's fragment buffer: bf16 values times 2^(e - 127), exact for e in 2 .. 252."""
        s, kk = p // TILE_KEYS, p % TILE_KEYS
        lane0 = base + (s * TILE_NT + (kk >> 3)) * 32 + 4 * (kk & 7)
        e7 = int64(e - 127) * 128
        for h in range(2):
            word = w0 if h == 0 else w1
            for half in range(2):
                b0 = _scaled_pair(tab[(word >> uint32(16 * half)) & uint32(0xFF)], e7)
                b1 = _scaled_pair(tab[(word >> uint32(16 * half + 8)) & uint32(0xFF)], e7)
                frag[lane0 + 2 * h + half] = np.uint64(b0) | (np.uint64(b1) << np.uint64(32))

    @cuda.jit(device=True)
    def combine(out, part, pbuf, ntok, t_base, k0, T, N):
        """out[t, k0 + i] for the block's tokens: the warps' partial sums, -inf past n_t."""
        for idx in range(cuda.threadIdx.x, TB * TILE_KEYS, cuda.blockDim.x):
            tw, i = idx // TILE_KEYS, idx % TILE_KEYS
            t, j = t_base + tw, k0 + i
            if t < T and j < N:
                sc = float32(0.0)
                for hb in range(WPT):
                    sc += part[pbuf * PART + (tw * WPT + hb) * TILE_KEYS + i]
                out[t, j] = sc if j < ntok[tw] else -math.inf

    def chunk_tiles(out, q, w, keys32, keys8, n_visible):
        # out [T, N], q [T, HI, DI] (on the FP4 grid), w [T, HI], n_visible [T];
        # blockIdx.y = group of TB tokens, blockIdx.x strides over the key steps
        T, N = out.shape
        ncap = keys8.shape[0]
        tid = cuda.threadIdx.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        tw, hb = warp // WPT, warp % WPT
        t_base = cuda.blockIdx.y * TB
        t = t_base + tw
        tab = cuda.shared.array(256, uint64)  # byte -> (bf16 pair, nonzero-halves mult.)
        frag = cuda.shared.array(FRAG2, uint64)
        part = cuda.shared.array(PART2, float32)
        ntok = cuda.shared.array(TILE_WARPS, int32)
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        lo, hi = tid & 15, tid >> 4  # the launch's 256 threads: one table entry each
        tab[tid] = (np.uint64(uint32(_e2m1_bf16(lo)) | (uint32(_e2m1_bf16(hi)) << uint32(16)))
                    | (np.uint64(_e2m1_nonzero(lo) + 65536 * _e2m1_nonzero(hi))
                       << np.uint64(32)))
        n_blk = 0
        for k in range(TB):  # the block's largest visible count bounds its steps
            tk = t_base + k
            nk = min(int(n_visible[tk]), N, ncap) if tk < T else 0
            nk = max(nk, 0)
            n_blk = max(n_blk, nk)
            if tid == k:
                ntok[k] = nk
        # q's fragments: (h0, d..d+1), (h1, d..d+1), (h0, d+2..), (h1, d+2..) per m-tile and
        # k-step, d = 16s + 4c; a token past T scores zeros (its outputs are not written)
        qa = cuda.local.array(NQ, uint32)
        wv = cuda.local.array(4, float32)
        tq = min(t, T - 1)
        for mt in range(2):
            h0 = 32 * hb + 16 * mt + g
            for s in range(S):
                d = 16 * s + 4 * c
                for r in range(2):
                    for hh in range(2):
                        v0 = q[tq, h0 + 8 * hh, d + 2 * r] if t < T else float32(0.0)
                        v1 = q[tq, h0 + 8 * hh, d + 2 * r + 1] if t < T else float32(0.0)
                        qa[(mt * S + s) * 4 + 2 * r + hh] = _split_pair(v0, v1)[0]
            wv[2 * mt] = w[tq, h0]
            wv[2 * mt + 1] = w[tq, h0 + 8]
        acc = cuda.local.array(NACC, float32)
        zero = float32(0.0)
        stride = cuda.gridDim.x * TILE_KEYS
        k0 = cuda.blockIdx.x * TILE_KEYS
        w0, w1, e = uint32(0), uint32(0), int32(0)
        if k0 < n_blk and tid < PAIRS:
            w0, w1, e = load_pair(keys32, keys8, min(k0 + tid % TILE_KEYS, n_blk - 1), tid)
        cuda.syncthreads()  # the table and ntok
        step = 0
        while k0 < n_blk:  # block-uniform: the steps with visible keys
            buf = step & 1
            if tid < PAIRS:
                store_pair(frag, buf * FRAG, tab, tid, w0, w1, e)
            k1 = k0 + stride
            if k1 < n_blk and tid < PAIRS:  # the next step's words, in flight over the MMAs
                w0, w1, e = load_pair(keys32, keys8, min(k1 + tid % TILE_KEYS, n_blk - 1),
                                      tid)
            cuda.syncthreads()
            if step > 0:
                combine(out, part, buf ^ 1, ntok, t_base, k0 - stride, T, N)
            for h in range(2):  # two n-tiles at a time: 16 accumulators, not 32, live
                for i in range(NACC):
                    acc[i] = zero
                for s in range(S):
                    for n in range(NH):
                        bw = frag[buf * FRAG + (s * TILE_NT + NH * h + n) * 32 + lane]
                        b0 = uint32(bw & np.uint64(0xFFFFFFFF))
                        b1 = uint32(bw >> np.uint64(32))
                        for mt in range(2):
                            a, o = (mt * S + s) * 4, (mt * NH + n) * 4
                            acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = _mma_bf16(
                                qa[a], qa[a + 1], qa[a + 2], qa[a + 3], b0, b1,
                                acc[o], acc[o + 1], acc[o + 2], acc[o + 3], xch)
                # C: (head g, key 2c) (g, 2c+1) (g+8, 2c) (g+8, 2c+1) of each m- and n-tile
                for n in range(NH):
                    pa, pb = zero, zero
                    for mt in range(2):
                        o = (mt * NH + n) * 4
                        w0h, w1h = wv[2 * mt], wv[2 * mt + 1]
                        pa += w0h * max(acc[o], zero) + w1h * max(acc[o + 2], zero)
                        pb += w0h * max(acc[o + 1], zero) + w1h * max(acc[o + 3], zero)
                    for off in (4, 8, 16):
                        pa += xor_shfl(pa, off, shf)
                        pb += xor_shfl(pb, off, shf)
                    if g == 0:
                        col = buf * PART + warp * TILE_KEYS + 8 * (NH * h + n) + 2 * c
                        part[col] = pa
                        part[col + 1] = pb
            k0 = k1
            step += 1
        if step > 0:
            cuda.syncthreads()
            combine(out, part, (step - 1) & 1, ntok, t_base, k0 - stride, T, N)
        while k0 < N:  # past every token's visible keys: only the -inf fill
            for idx in range(tid, TB * TILE_KEYS, cuda.blockDim.x):
                tt, j = t_base + idx // TILE_KEYS, k0 + idx % TILE_KEYS
                if tt < T and j < N:
                    out[tt, j] = -math.inf
            k0 += stride

    chunk_tiles.__name__ = f"_indexer_scores_chunk_tiles_hi{HI}_di{DI}"
    return kernel(chunk_tiles, max_registers=TILE_REGS)


_TILE_KERNELS: dict = {}


def _tile_kernel(HI: int, DI: int):
    if (HI, DI) not in _TILE_KERNELS:
        _TILE_KERNELS[HI, DI] = _tile_scorer(HI, DI)
    return _TILE_KERNELS[HI, DI]


def indexer_scores_mma(out, q, w, keys_packed, n_visible, stream=0) -> None:
    """Decode form (indexer.indexer_scores' arguments): out[N] f32 <- q[HI, DI], w[HI],
    keys_packed[Ncap, bytes] uint8, n_visible[1] int32."""
    HI, DI = q.shape
    assert fits(HI, DI), (HI, DI)
    kern = _kernels(DI)[0]
    args = (out, q, w, keys_packed.view(np.uint32), keys_packed, n_visible)
    nt = 2 * HI
    grid = max(1, min(cdiv(out.shape[0], STEP_KEYS), resident_blocks(kern, args, nt)))
    kern[grid, nt, stream](*args)


def indexer_scores_chunk_mma(out, q, w, keys_packed, n_visible, stream=0,
                             q_fp4: bool = False) -> None:
    """Chunk form: out[T, N] f32 <- q[T, HI, DI], w[T, HI], keys_packed, n_visible[T].
    ``q_fp4``: q is on the FP4 grid (exact in bf16), so the chunk tiles kernel may take it."""
    T, HI, DI = q.shape
    if q_fp4 and fits_tiles(HI, DI):
        kern = _tile_kernel(HI, DI)
        args = (out, q, w, keys_packed.view(np.uint32), keys_packed, n_visible)
        nt = 32 * TILE_WARPS
        groups = cdiv(T, TILE_WARPS // (HI // 32))
        resident = resident_blocks(kern, args, nt)
        per_group = max(1, min(cdiv(out.shape[1], TILE_KEYS), cdiv(resident, groups)))
        kern[(per_group, groups), nt, stream](*args)
        return
    assert fits(HI, DI), (HI, DI)
    kern = _kernels(DI)[1]
    args = (out, q, w, keys_packed.view(np.uint32), keys_packed, n_visible)
    nt = 2 * HI
    resident = resident_blocks(kern, args, nt)
    per_token = max(1, min(cdiv(out.shape[1], STEP_KEYS), cdiv(resident, T)))
    kern[(per_token, T), nt, stream](*args)


# CI lane B compiles both forms at V4's DI = 128
_SIG = "uint32[:, ::1], uint8[:, ::1]"
PTX_SIGNATURES = [
    (_kernels(128)[0], f"void(float32[::1], float32[:, ::1], float32[::1], {_SIG}, int32[::1])"),
    (_kernels(128)[1], f"void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], {_SIG}, "
                       "int32[::1])"),
    (_tile_kernel(64, 128), f"void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], "
                            f"{_SIG}, int32[::1])"),
]
