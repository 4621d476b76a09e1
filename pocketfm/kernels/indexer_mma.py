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
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

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


def indexer_scores_chunk_mma(out, q, w, keys_packed, n_visible, stream=0) -> None:
    """Chunk form: out[T, N] f32 <- q[T, HI, DI], w[T, HI], keys_packed, n_visible[T]."""
    T, HI, DI = q.shape
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
]
