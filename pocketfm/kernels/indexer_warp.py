"""The decode's indexer scores with one warp holding every head, and the top-k's first radix
digit counted on the way (indexer.indexer_scores(q_fp4=True, top_k=...); the engine's, with
DecodeEngine.indexer_one_warp / scorer_counts_first_digit: −1.8% a step, H100, BENCHMARKS
2026-12-05 (j)).

    indexer_scores_warp   out[N] = Σ_h w[h] · ReLU(q[h] · key_j), j < n_visible; -inf after

indexer_mma.py's decode kernel splits the heads over a block's warps (16 each): each key is
loaded and decoded once per warp, four times at V4's HI = 64, and every 32-key step ends in two
block barriers to sum the warps' partial scores (H100, 256K: 25.7 µs for 65,536 keys, ~5% of
what the tensor cores and the 4.5 MB of keys allow; BENCHMARKS 2026-12-05 (i)). The model's q
is on the FP4 grid (hadamard_fp4), so its bf16 hi half is exact and the lo MMAs never run: one
warp can hold every head's A fragments (HI/16 m-tiles x DI/16 k-steps x 4 registers, 128 at
64 x 128), decode each key once into B (indexer_mma's byte -> bf16-pair table and k order),
feed it to HI/16 MMAs, and sum the heads in registers and 3 xor shuffles, with no barrier after
q is staged. Letters as in indexer.py: HI heads, DI dims, N keys.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from . import kvpack
from .device import cdiv, kernel, resident_blocks, xor_shfl
from .gemv import _bits_f32
from .indexer_mma import SHF, XCH, _e2m1_bf16
from .lowbit_layout import _f32_bits
from .imma import _mma_s8
from .mma import _mma_bf16, _split_pair


# ---- the top-k's first digit, counted by the scorer ---------------------------------------------
FIRST_DIGIT_SHIFT = 21  # indexer.topk's first radix pass: the order key's top 11 bits
FIRST_DIGIT_BINS = 1 << (32 - FIRST_DIGIT_SHIFT)


def order_key(bits):
    """Order-preserving unsigned key (int64) of a float32's bits; -0.0 ranks as +0.0 (the
    top-k's order: indexer.py inlines this same function)."""
    u = int(bits)
    if u == 0x80000000:
        u = 0
    return (0xFFFFFFFF - u) if u >= 0x80000000 else (u + 0x80000000)


_order_key = cuda.jit(device=True, inline="always")(order_key)


# ---- the kernel -------------------------------------------------------------------------------
# The warps walk their own WARP_GROUPS x 8 keys a step, the next step's key words requested
# before this step's MMAs. q reaches the registers through shared memory in fragment order (a
# lane's word i at i·32 + lane: no bank conflicts), staged once a block.
# With ``hist`` (indexer.topk's workspace, k > 0 and more than k keys visible) the kernel also
# counts the top-k's first radix digit of every visible score, in shared memory and then into
# hist[0 : FIRST_DIGIT_BINS], so that topk(..., first_digit_counted=True) starts at its pick:
# one pass over the scores and one grid barrier fewer.
WARP_GROUPS = 2  # 8-key MMA groups a warp takes a step
WARP_A_REGS = 128  # A registers a lane may hold (q's fragments)
WARP_THREADS = 128  # a block: 4 warps (two blocks an SM at 250 registers: ptxas, sm_90)


def fits_warp(HI: int, DI: int) -> bool:
    """Whether one warp can hold every head's q fragments (and a key row is whole 32-bit
    words: the kernel reads codes and scales as words)."""
    return (HI % 16 == 0 and DI % 32 == 0 and (HI // 16) * (DI // 16) * 4 <= WARP_A_REGS
            and kvpack.index_key_bytes(DI) % 4 == 0)


@cuda.jit(device=True, inline="always")
def _key_scales(sw, base, SW, b):
    """The power-of-two scales of scale block b of the lane's two C columns' keys (their scale
    words at sw[base ..] and sw[base + SW ..]); byte 0 gives 0.0."""
    sh = uint32(8 * (b & 3))
    sa = _bits_f32(int32((sw[base + (b >> 2)] >> sh) & uint32(255)) << 23)
    sb = _bits_f32(int32((sw[base + SW + (b >> 2)] >> sh) & uint32(255)) << 23)
    return sa, sb


_SHARED_STEPS: dict = {}


def _shared_steps(HI: int, DI: int, groups: int):
    """The steps both decode scorers (bf16, int8) take alike, as inline device functions:
    (load_scales: the scale words of a lane's C columns' keys; emit: a group's heads summed,
    its two scores stored and counted; flush: a block's first-digit counts into ``hist``)."""
    if (HI, DI, groups) in _SHARED_STEPS:
        return _SHARED_STEPS[HI, DI, groups]
    MT, NB = HI // 16, DI // 32
    SW, SW0 = cdiv(NB, 4), DI // 8  # a key's scale words, the first of them

    @cuda.jit(device=True, inline="always")
    def load_scales(sw, keys32, k0, n, c):
        """The keys of the lane's C columns, k0 + 8·gi + 2c and + 1 (clamped to n - 1)."""
        for gi in range(groups):
            ja = min(k0 + 8 * gi + 2 * c, n - 1)
            jb = min(ja + 1, n - 1)
            for i in range(SW):
                sw[2 * gi * SW + i] = uint32(keys32[ja, SW0 + i])
                sw[(2 * gi + 1) * SW + i] = uint32(keys32[jb, SW0 + i])

    @cuda.jit(device=True, inline="always")
    def emit(out, hs, acc, ws, g, j, n, count, shf):
        """Scores j and j + 1 (the lane's C columns) from acc: the lane's 2·MT heads
        ReLU-weighted, then summed over g by 3 xor shuffles; the g = 0 lanes store them (-inf
        from n on) and, with ``count``, count their first digit in ``hs``."""
        N = out.shape[0]
        zero = float32(0.0)
        pa, pb = zero, zero
        for mt in range(MT):
            w0, w1 = ws[16 * mt + g], ws[16 * mt + g + 8]
            pa += w0 * max(acc[4 * mt], zero) + w1 * max(acc[4 * mt + 2], zero)
            pb += w0 * max(acc[4 * mt + 1], zero) + w1 * max(acc[4 * mt + 3], zero)
        for off in (4, 8, 16):
            pa += xor_shfl(pa, off, shf)
            pb += xor_shfl(pb, off, shf)
        if g == 0 and j < N:
            out[j] = pa if j < n else -math.inf
        if g == 0 and j + 1 < N:
            out[j + 1] = pb if j + 1 < n else -math.inf
        if count and g == 0 and j < n:
            cuda.atomic.add(hs, _order_key(_f32_bits(pa)) >> FIRST_DIGIT_SHIFT, 1)
        if count and g == 0 and j + 1 < n:
            cuda.atomic.add(hs, _order_key(_f32_bits(pb)) >> FIRST_DIGIT_SHIFT, 1)

    @cuda.jit(device=True, inline="always")
    def flush(hist, hs):
        """The block's counts into the top-k's workspace (its nonzero bins)."""
        cuda.syncthreads()
        for i in range(cuda.threadIdx.x, FIRST_DIGIT_BINS, cuda.blockDim.x):
            if hs[i] > 0:
                cuda.atomic.add(hist, i, hs[i])

    _SHARED_STEPS[HI, DI, groups] = load_scales, emit, flush
    return load_scales, emit, flush


def _warp_scorer(HI: int, DI: int, groups: int):
    """The one-warp decode kernel for HI heads of DI dims, ``groups`` 8-key MMA groups a warp a
    step (closure constants: register arrays)."""
    MT, S, NB = HI // 16, DI // 16, DI // 32  # m-tiles, k-steps, scale blocks
    NA = 4 * MT * S  # A registers a lane
    NC = 4 * MT  # C registers a lane (per accumulator)
    QF = 32 * NA  # q's fragments, every lane's
    SW = cdiv(NB, 4)  # scale words of a key
    NK = groups * S  # key words a lane loads a step
    NS = groups * 2 * SW  # scale words a lane loads a step (its two C columns' keys)
    KPW = 8 * groups  # keys a warp a step

    load_scales, emit, flush = _shared_steps(HI, DI, groups)

    @cuda.jit(device=True)
    def load(kw, sw, keys32, k0, n, g, c):
        """This lane's key words of keys k0 .. k0 + KPW - 1 (clamped to n - 1): for B, key
        k0 + 8·gi + g's words 2s + c/2 (the dims 16s + 4c .. +3 of k-step s in its half); for
        the scales, the keys of its C columns, k0 + 8·gi + 2c and + 1."""
        for gi in range(groups):
            j = min(k0 + 8 * gi + g, n - 1)
            for s in range(S):
                kw[gi * S + s] = uint32(keys32[j, 2 * s + (c >> 1)])
        load_scales(sw, keys32, k0, n, c)

    def scores_warp(out, q, w, keys32, n_visible, hist, k):
        # out [N], q [HI, DI] on the FP4 grid, w [HI], keys32 [Ncap, row words], n_visible [1];
        # hist int32 [>= FIRST_DIGIT_BINS] with k > 0: the top-k's first digit counted there
        # (only when more than k keys are visible: topk takes them all otherwise). Persistent
        # grid over steps of (warps x KPW) keys.
        N = out.shape[0]
        n = min(int(n_visible[0]), N, keys32.shape[0])
        count = k > 0 and n > k  # (grid-uniform)
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        step_keys = (nt >> 5) * KPW
        kw = cuda.local.array(NK, uint32)
        sw = cuda.local.array(NS, uint32)
        st0 = cuda.blockIdx.x
        if st0 * step_keys < n:  # the first keys requested before q is staged
            load(kw, sw, keys32, st0 * step_keys + warp * KPW, n, g, c)
        tab = cuda.shared.array(256, uint32)  # byte -> bf16 pair (low nibble in the low half)
        qf = cuda.shared.array(QF, uint32)  # q's A fragments: word i of lane l at i·32 + l
        ws = cuda.shared.array(HI, float32)
        hs = cuda.shared.array(FIRST_DIGIT_BINS, int32)  # this block's first-digit counts
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        for i in range(tid, 256, nt):
            tab[i] = uint32(_e2m1_bf16(i & 15)) | (uint32(_e2m1_bf16(i >> 4)) << uint32(16))
        if count:
            for i in range(tid, FIRST_DIGIT_BINS, nt):
                hs[i] = 0
        for i in range(tid, QF, nt):
            # register r = 4(mt·S + s) + v of lane (gl, cl): head 16mt + gl (+8 for odd v),
            # dims 16s + 4cl (+2 for v >= 2) and the next
            r, l = i >> 5, i & 31
            v, ms = r & 3, r >> 2
            h = 16 * (ms // S) + (l >> 2) + 8 * (v & 1)
            d = 16 * (ms % S) + 4 * (l & 3) + 2 * (v >> 1)
            qf[i] = _split_pair(q[h, d], q[h, d + 1])[0]  # exact: q is on the FP4 grid
        for i in range(tid, HI, nt):
            ws[i] = w[i]
        cuda.syncthreads()
        qa = cuda.local.array(NA, uint32)
        for r in range(NA):
            qa[r] = qf[r * 32 + lane]
        zero = float32(0.0)
        half = uint32(16 * (c & 1))
        nkw = cuda.local.array(NK, uint32)
        nsw = cuda.local.array(NS, uint32)
        t = cuda.local.array(NC, float32)
        acc = cuda.local.array(NC, float32)
        for st in range(st0, (N + step_keys - 1) // step_keys, cuda.gridDim.x):
            kb = st * step_keys
            if kb >= n:  # past the visible keys (block-uniform): only the -inf fill
                for i in range(tid, step_keys, nt):
                    if kb + i < N:
                        out[kb + i] = -math.inf
                continue
            k0 = kb + warp * KPW
            nxt = kb + cuda.gridDim.x * step_keys
            if nxt < n:  # the next step's words, in flight during this step's MMAs
                load(nkw, nsw, keys32, nxt + warp * KPW, n, g, c)
            for gi in range(groups):
                for i in range(NC):
                    acc[i] = zero
                for b in range(NB):  # a 32-dim scale block: two k-steps, then the key's scale
                    for i in range(NC):
                        t[i] = zero
                    for s in range(2 * b, 2 * b + 2):
                        pair = (kw[gi * S + s] >> half) & uint32(0xFFFF)
                        b0 = tab[pair & uint32(0xFF)]
                        b1 = tab[pair >> uint32(8)]
                        for mt in range(MT):
                            a = 4 * (mt * S + s)
                            t[4 * mt], t[4 * mt + 1], t[4 * mt + 2], t[4 * mt + 3] = _mma_bf16(
                                qa[a], qa[a + 1], qa[a + 2], qa[a + 3], b0, b1, t[4 * mt],
                                t[4 * mt + 1], t[4 * mt + 2], t[4 * mt + 3], xch)
                    sa, sb = _key_scales(sw, 2 * gi * SW, SW, b)
                    for mt in range(MT):  # C: (h0, key 2c) (h0, 2c+1) (h1, 2c) (h1, 2c+1)
                        acc[4 * mt] += t[4 * mt] * sa
                        acc[4 * mt + 1] += t[4 * mt + 1] * sb
                        acc[4 * mt + 2] += t[4 * mt + 2] * sa
                        acc[4 * mt + 3] += t[4 * mt + 3] * sb
                emit(out, hs, acc, ws, g, k0 + 8 * gi + 2 * c, n, count, shf)
            for i in range(NK):
                kw[i] = nkw[i]
            for i in range(NS):
                sw[i] = nsw[i]
        if count:
            flush(hist, hs)
    name = f"_indexer_scores_warp_hi{HI}_di{DI}_g{groups}"
    scores_warp.__name__ = scores_warp.__qualname__ = name  # (the qualname: debug line info)
    return kernel(scores_warp)


# ---- the int8 build (candidate) ------------------------------------------------------------------
# q and the keys are both on the FP4 grid, so a 32-dim block's values are integers times a
# power of two: a key's 2·e2m1 codes are -12 .. 12, and q over pq = 2^(⌊log2 amax⌋ - 4) is
# at most 31 (and whole: the block's ue8m0 scale is pq times 8 or more). One m16n8k32 int8 MMA a
# block and m-tile (imma._mma_s8) gives the block's exact integer dot product, the value the
# bf16 build's two MMAs sum in float32 exactly, so the scores are equal bit for bit: half the
# MMAs, half the A registers (64 at V4's 64 x 128), and each key word loaded by one lane (the
# bf16 B fragments take half a word on two lanes).
def _e2m1_twice(nib):
    """2 · the e2m1 nibble's value as an int (0, 1, 2, 3, 4, 6, 8, 12; signed by bit 3)."""
    m = nib & 7
    v = m if m < 2 else (2 + (m & 1)) << ((m >> 1) - 1)
    return -v if nib & 8 else v


_e2m1_twice_dev = cuda.jit(device=True, inline="always")(_e2m1_twice)


@cuda.jit(device=True, inline="always")
def _small_int_f32(d):
    """float32(d) for |d| < 2^22 by an integer add and a float subtract (2^23 + 2^22 + d's
    bits): both at full rate, where the I2F conversion runs at a quarter (64 a lane a group
    a step made the first build 21.1 against 15.0 µs, H100)."""
    return _bits_f32(int32(d) + int32(0x4B400000)) - float32(12582912.0)


def _warp_scorer_i8(HI: int, DI: int, groups: int, max_registers=None):
    """As _warp_scorer on int8 MMAs (see above); ``max_registers``: ptxas's cap (sm_90, V4's
    64 x 128: 172 / 178 registers at 1 / 2 groups uncapped, two blocks of 4 warps an SM; at
    168, three, with 4 / 28 bytes spilled)."""
    MT, NB = HI // 16, DI // 32  # m-tiles, scale blocks (= k-steps of 32)
    NA = 4 * MT * NB  # A registers a lane
    NC = 4 * MT  # C registers a lane
    NP = 2 * MT * NB  # q's block quanta a lane uses: its rows g, g + 8 of each m-tile, a block
    QF, QB = 32 * NA, HI * NB  # q's A words (every lane's), q's blocks
    SW = cdiv(NB, 4)
    NK = groups * NB  # key words a lane loads a step: one a block
    NS = groups * 2 * SW
    KPW = 8 * groups
    load_scales, emit, flush = _shared_steps(HI, DI, groups)

    @cuda.jit(device=True)
    def load(kw, sw, keys32, k0, n, g, c):
        """Key k0 + 8·gi + g's word 4b + c (clamped to n - 1): the dims 32b + 8c .. +7, B's
        two registers of block b; the scale words as the bf16 build's."""
        for gi in range(groups):
            j = min(k0 + 8 * gi + g, n - 1)
            for b in range(NB):
                kw[gi * NB + b] = uint32(keys32[j, 4 * b + c])
        load_scales(sw, keys32, k0, n, c)

    def scores_warp_i8(out, q, w, keys32, n_visible, hist, k):
        # the arguments as _warp_scorer's kernel
        N = out.shape[0]
        n = min(int(n_visible[0]), N, keys32.shape[0])
        count = k > 0 and n > k  # (grid-uniform)
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        step_keys = (nt >> 5) * KPW
        kw = cuda.local.array(NK, uint32)
        sw = cuda.local.array(NS, uint32)
        st0 = cuda.blockIdx.x
        if st0 * step_keys < n:  # the first keys requested before q is staged
            load(kw, sw, keys32, st0 * step_keys + warp * KPW, n, g, c)
        tab = cuda.shared.array(256, uint32)  # byte -> its two nibbles' 2·e2m1 as int8 bytes
        qf = cuda.shared.array(QF, uint32)  # q's A words: word i of lane l at i·32 + l
        qp = cuda.shared.array(QB, float32)  # q's quanta / 2 (B holds 2·e2m1), at h·NB + b
        ws = cuda.shared.array(HI, float32)
        hs = cuda.shared.array(FIRST_DIGIT_BINS, int32)
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        for i in range(tid, 256, nt):
            tab[i] = (uint32(_e2m1_twice_dev(i & 15) & 255)
                      | (uint32(_e2m1_twice_dev(i >> 4) & 255) << uint32(8)))
        if count:
            for i in range(tid, FIRST_DIGIT_BINS, nt):
                hs[i] = 0
        for hb in range(tid, QB, nt):  # a (head, block) a thread: its 32 loads all in flight
            h, b = hb // NB, hb % NB
            v = cuda.local.array(32, float32)
            for d in range(32):
                v[d] = q[h, 32 * b + d]
            amax = float32(0.0)
            for d in range(32):
                amax = max(amax, abs(v[d]))
            # pq = 2^e, e = ⌊log2 amax⌋ - 4 from amax's exponent bits; e >= -125 keeps pq / 2
            # a normal float (exact while amax >= 2^-121: a block of q below that is rounded)
            e = min(max(int32((_f32_bits(amax) >> uint32(23)) & uint32(255)) - 131, -125), 126)
            inv = _bits_f32(int32((127 - e) << 23))
            # A word r = 4(mt·NB + b) + v of lane (gl, cl): head 16mt + gl (+8 for odd v), dims
            # 32b + 8cl (+4 for v >= 2) .. +3; this block's 4-dim run d4 is lane 4gl + d4 / 2's
            hr = h & 15
            r0 = 4 * ((h >> 4) * NB + b) + (hr >> 3)
            for d4 in range(8):
                word = uint32(0)
                for m in range(4):
                    word |= (uint32(int32(v[4 * d4 + m] * inv)) & uint32(255)) << uint32(8 * m)
                qf[(r0 + 2 * (d4 & 1)) * 32 + 4 * (hr & 7) + (d4 >> 1)] = word
            qp[hb] = _bits_f32(int32((e + 126) << 23))
        for i in range(tid, HI, nt):
            ws[i] = w[i]
        cuda.syncthreads()
        qa = cuda.local.array(NA, uint32)
        for r in range(NA):
            qa[r] = qf[r * 32 + lane]
        pq = cuda.local.array(NP, float32)  # (mt, b): rows g, g + 8
        for mt in range(MT):
            for b in range(NB):
                pq[2 * (mt * NB + b)] = qp[(16 * mt + g) * NB + b]
                pq[2 * (mt * NB + b) + 1] = qp[(16 * mt + g + 8) * NB + b]
        zero = float32(0.0)
        nkw = cuda.local.array(NK, uint32)
        nsw = cuda.local.array(NS, uint32)
        acc = cuda.local.array(NC, float32)
        for st in range(st0, (N + step_keys - 1) // step_keys, cuda.gridDim.x):
            kb = st * step_keys
            if kb >= n:  # past the visible keys (block-uniform): only the -inf fill
                for i in range(tid, step_keys, nt):
                    if kb + i < N:
                        out[kb + i] = -math.inf
                continue
            k0 = kb + warp * KPW
            nxt = kb + cuda.gridDim.x * step_keys
            if nxt < n:  # the next step's words, in flight during this step's MMAs
                load(nkw, nsw, keys32, nxt + warp * KPW, n, g, c)
            for gi in range(groups):
                for i in range(NC):
                    acc[i] = zero
                for b in range(NB):  # a 32-dim scale block: one MMA a m-tile
                    kwd = kw[gi * NB + b]
                    b0 = tab[kwd & uint32(0xFF)] | (tab[(kwd >> uint32(8)) & uint32(0xFF)]
                                                    << uint32(16))
                    b1 = tab[(kwd >> uint32(16)) & uint32(0xFF)] | (tab[kwd >> uint32(24)]
                                                                    << uint32(16))
                    sa, sb = _key_scales(sw, 2 * gi * SW, SW, b)
                    for mt in range(MT):  # the block's exact sum, times q's quantum / 2
                        a = 4 * (mt * NB + b)
                        d0, d1, d2, d3 = _mma_s8(qa[a], qa[a + 1], qa[a + 2], qa[a + 3], b0, b1,
                                                 xch)
                        p0, p1 = pq[2 * (mt * NB + b)], pq[2 * (mt * NB + b) + 1]
                        acc[4 * mt] += (_small_int_f32(d0) * p0) * sa
                        acc[4 * mt + 1] += (_small_int_f32(d1) * p0) * sb
                        acc[4 * mt + 2] += (_small_int_f32(d2) * p1) * sa
                        acc[4 * mt + 3] += (_small_int_f32(d3) * p1) * sb
                emit(out, hs, acc, ws, g, k0 + 8 * gi + 2 * c, n, count, shf)
            for i in range(NK):
                kw[i] = nkw[i]
            for i in range(NS):
                sw[i] = nsw[i]
        if count:
            flush(hist, hs)
    name = f"_indexer_scores_warp_i8_hi{HI}_di{DI}_g{groups}_r{max_registers or 0}"
    scores_warp_i8.__name__ = scores_warp_i8.__qualname__ = name
    return kernel(scores_warp_i8, max_registers=max_registers)


_WARP_KERNELS: dict = {}


def _warp_kernel(HI: int, DI: int, groups: int = WARP_GROUPS, int8: bool = False,
                 max_registers=None):
    key = (HI, DI, groups, int8, max_registers if int8 else None)
    if key not in _WARP_KERNELS:
        _WARP_KERNELS[key] = (_warp_scorer_i8(HI, DI, groups, max_registers) if int8
                              else _warp_scorer(HI, DI, groups))
    return _WARP_KERNELS[key]


_NO_HIST = []  # a 1-element int32 stand-in for ``hist`` (made once)


def indexer_scores_warp(out, q, w, keys_packed, n_visible, stream=0,
                        threads: int = WARP_THREADS, groups: int = WARP_GROUPS,
                        first_digit=None, int8: bool = False, max_registers=None) -> None:
    """Decode form (as indexer_scores_mma) for q on the FP4 grid (hadamard_fp4's output), one
    warp holding every head: fits_warp(HI, DI) must hold. ``first_digit`` = (workspace, k):
    also count the top-k's first digit into that topk_workspace (see above). ``threads`` /
    ``groups``: the block and the 8-key groups a warp takes a step (benchmarks). ``int8``: the
    int8-MMA build (a candidate; the same scores bit for bit), capped at ``max_registers``."""
    HI, DI = q.shape
    assert fits_warp(HI, DI), (HI, DI)
    kern = _warp_kernel(HI, DI, groups, int8, max_registers)
    if first_digit is None:
        if not _NO_HIST:
            _NO_HIST.append(cuda.to_device(np.zeros(1, np.int32)))
        first_digit = (_NO_HIST[0], 0)
    hist, k = first_digit
    args = (out, q, w, keys_packed.view(np.uint32), n_visible, hist, int(k))
    step_keys = threads // 32 * 8 * groups
    grid = max(1, min(cdiv(out.shape[0], step_keys), resident_blocks(kern, args, threads)))
    kern[grid, threads, stream](*args)


I8_CAPPED_REGS = 168  # the int8 build's cap for three blocks an SM (a candidate)

# CI lane B compiles them at V4's geometry
PTX_SIGNATURES = [
    (_warp_kernel(64, 128, groups, int8, regs), "void(float32[::1], float32[:, ::1], "
     "float32[::1], uint32[:, ::1], int32[::1], int32[::1], int64)")
    for groups in (1, 2) for int8, regs in ((False, None), (True, None), (True, I8_CAPPED_REGS))
]
