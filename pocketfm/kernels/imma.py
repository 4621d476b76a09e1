"""Integer tensor-core GEMM for the code types: out[T, N] = x[T, K] · W[N, K]ᵀ for Q8_0, IQ2_XXS
and Q2_K on ``mma.sync.aligned.m16n8k32`` with int8 operands and int32 accumulation (PTX).

Why: a prefill chunk's routed experts are ~0.3 TFLOP a layer over ~24 rows per expert, and
mma.py's bf16 codes kernel spends its time making bf16 tiles in shared memory (per weight: a
float conversion, a pair pack, a store; two barriers a K step; 11-17 TFLOP/s on the H200).
These three types are small integers times a scale, so the weights go into the MMA as they
are, int8, built in registers straight from the packed planes (loaded a K step ahead): no
weight tile in shared memory.

x goes in as three int8 limbs per value: per 32 columns of a row s = max|x| / (2^22 - 1),
q = round(x / s) = 65536·hi + 256·mid + lo (hi signed, mid and lo unsigned), so x ≈ s·q to 22
bits of the slot's largest value. (Two limbs, the decode GEMVs' 15 bits, measured too coarse
for the prefill: on `small` after a 1K prompt the greedy tokens left NumPy's at step 11.) A K
step of 32 columns is three MMAs: A·hi, then A·mid accumulating onto 256·(A·hi) (exact in
int32, < 2^27), and A·lo; f = 256·that + A·lo in float32, then one update per output:
    Q8_0, IQ2_XXS  acc += (d_row · s) · f                    (d_row: the row's 32-column scale)
    Q2_K           acc += s · (d · f - dmin · (m0·Σq_0 + m1·Σq_1))
Q2_K's 4-bit sub-block scale is folded into the codes (q·sc <= 45 fits a byte) and its mins
use the sums of q per 16 columns, which the x preparation makes anyway.

Fragments (PTX ISA, mma.m16n8k32 .s8): lane (g = lane / 4, c = lane % 4) holds A words
(row g, MMA columns 4c..4c+3), (g+8, 4c..), (g, 16+4c..), (g+8, 16+4c..), B words (token g,
the same columns) and C (row g, tokens 2c, 2c+1), (g+8, 2c, 2c+1). MMA columns 4c.. and
16+4c.. are the K step's columns 8c..8c+7 (for A and B alike), so a lane's weights are one
8-byte word: Q8_0's codes and Q2_K's 2-bit codes as packed; IQ2_XXS one grid row with its
sign masks, from a 3 KB table in shared memory.

Block: 4 warps, each 32 weight rows x 32 tokens (2 x 4 MMA tiles), so a block is 128 rows x
32 tokens; rows: dense tokens, or the MoE's (token, expert) rows in expert_order's tiles as
mma.py takes them (one expert per block with ``tiles``; else a pass per expert in the tile,
rows of other experts masked to zero). The tile's x (limb words, scales, sums) is staged in
shared memory 256 columns at a time, coalesced, so the four warps do not each fetch it.
"""
from __future__ import annotations

import os

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from ..engine.layout import expert_tiles_capacity
from ..quants import IQ2XXS_GRID, KSIGNS_IQ2XS, GGMLType
from .bench import BenchCase
from .device import SIMULATOR, cdiv, kernel, stream_buffer, xor_shfl
from .gemv import _dummies, gemv_ref
from .gemv_lowbit import PREP_THREADS, swiglu_scalar
from .lowbit_layout import _f32_bits, _half
from .mma import ALIGNED, _device_const, _next_expert, _no_tiles, _tile_rows, expert_order
from .qweight import QWeight

KT = 32  # columns per K step: one MMA's k, one x slot, one Q8_0 / IQ2_XXS block
THREADS = 128  # 4 warps
MI, NI = 2, 4  # a warp's MMA tiles: 2 x 16 weight rows, 4 x 8 tokens
BM, BN = 4 * 16 * MI, 8 * NI  # 128 rows x 32 tokens a block
N_ACC = MI * NI * 4  # accumulators a thread
CH = 256  # columns of x staged in shared memory at a time (8 K steps)
XW = CH // 4 + 4  # a token's staged words, padded: the fragment reads hit 32 distinct banks
XS_W, XM_W = CH // KT, CH // 16  # a token's staged scales and sums
XCH = 128 * 6 if SIMULATOR else 1  # simulator MMA exchange: 6 fragment words per thread
XCH_PREP = PREP_THREADS if SIMULATOR else 1  # simulator lane exchange of the x preparation


# ---- the MMA instruction -------------------------------------------------------------------------
if SIMULATOR:
    from .mma import fragment_index, warp_fragments
    _FRAG_A, _FRAG_B = fragment_index(4)  # (lane, register, byte) of A[r, k], B[k, n]

    def _byte_matrix(words, frag, signed):
        lane, reg, byte = frag
        v = ((words[lane, reg] >> (8 * byte).astype(np.uint64)) & np.uint64(255)).astype(np.int64)
        return np.where(v >= 128, v - 256, v) if signed else v

    @cuda.jit(device=True)
    def _imma(a0, a1, a2, a3, b0, b1, b_signed, c0, c1, c2, c3, xch):
        """One warp's m16n8k32 int8 MMA: (d0, d1, d2, d3) = A·B + C, B signed or not
        (simulator: the fragments exchanged through ``xch``; every thread of the block calls)."""
        words = warp_fragments(xch, a0, a1, a2, a3, b0, b1)
        d = _byte_matrix(words, _FRAG_A, True) @ _byte_matrix(words, _FRAG_B, b_signed)
        lane = cuda.threadIdx.x % 32
        g, c = lane >> 2, lane & 3
        return (int32(d[g, 2 * c] + c0), int32(d[g, 2 * c + 1] + c1),
                int32(d[g + 8, 2 * c] + c2), int32(d[g + 8, 2 * c + 1] + c3))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _imma_intrinsic(btype: str):
        ptx = (f"mma.sync.aligned.m16n8k32.row.col.s32.s8.{btype}.s32 {{$0, $1, $2, $3}}, "
               "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

        @intrinsic
        def imma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            if not all(isinstance(v, types.Integer)
                       for v in (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)):
                return None

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                regs = [builder.trunc(v, i32) if t.bitwidth > 32 else
                        (builder.zext(v, i32) if t.bitwidth < 32 else v)
                        for v, t in zip(args, sig.args)]
                fty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * 10)
                asm = ir.InlineAsm(fty, ptx, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r")
                s = builder.call(asm, regs)
                return cgutils.pack_array(builder, [builder.extract_value(s, k) for k in range(4)])
            return types.UniTuple(types.int32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen
        return imma

    _imma_ss, _imma_su = _imma_intrinsic("s8"), _imma_intrinsic("u8")

    @cuda.jit(device=True)
    def _imma(a0, a1, a2, a3, b0, b1, b_signed, c0, c1, c2, c3, xch):
        if b_signed:
            return _imma_ss(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return _imma_su(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


# ---- x: three int8 limbs per value, 32-column slots -------------------------------------------
Q_MAX = 4194303  # |q| <= 2^22 - 1: q = 65536·hi + 256·mid + lo, hi in [-64, 63]
MAGIC = 12582912.0  # 1.5·2^23: adding it rounds a float32 below 2^22 to an integer (half to even)


@cuda.jit(device=True)
def _round_q(v, inv):
    return int32(_f32_bits(v * inv + float32(MAGIC))) - int32(0x4B400000)


@cuda.jit(device=True)
def _limb_bytes(q0, q1, q2, q3, shift):
    """Byte ``shift`` / 8 of four int32 codes, packed into one word (column order)."""
    sh = uint32(shift)
    return ((uint32(q0 >> sh) & uint32(255)) | ((uint32(q1 >> sh) & uint32(255)) << uint32(8))
            | ((uint32(q2 >> sh) & uint32(255)) << uint32(16))
            | ((uint32(q3 >> sh) & uint32(255)) << uint32(24)))


@cuda.jit(device=True)
def _store_limbs(xq, xl, xsum, xs, b, i, K, v0, v1, v2, v3):
    """Thread i quantises columns 4i .. 4i+3 of row b: per 32-column slot (8 threads, xor
    butterflies: every thread of the block takes part; i past K / 4 stores nothing)
    s = max|x| / Q_MAX, q = round(x / s); hi | mid << 32 into xq[b, i], lo into xl[b, i], Σq per
    16 columns into xsum, s per slot into xs."""
    xch = cuda.shared.array(XCH_PREP, float32)
    a = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
    for off in (4, 2, 1):
        a = max(a, xor_shfl(a, off, xch))
    inv = float32(Q_MAX) / a if a > 0 else float32(0)
    q0, q1, q2, q3 = _round_q(v0, inv), _round_q(v1, inv), _round_q(v2, inv), _round_q(v3, inv)
    # Σq over 16 columns reaches 2^26, past float32's integers (the simulator's shuffles carry
    # float32): summed as q = 2048·(q >> 11) + (q & 2047), each part exact
    s_hi = float32((q0 >> 11) + (q1 >> 11) + (q2 >> 11) + (q3 >> 11))
    s_lo = float32((q0 & 2047) + (q1 & 2047) + (q2 & 2047) + (q3 & 2047))
    for off in (1, 2):
        s_hi += xor_shfl(s_hi, off, xch)
        s_lo += xor_shfl(s_lo, off, xch)
    if i < K // 4:
        xq[b, i] = (uint64(_limb_bytes(q0, q1, q2, q3, 16))
                    | (uint64(_limb_bytes(q0, q1, q2, q3, 8)) << uint64(32)))
        xl[b, i] = _limb_bytes(q0, q1, q2, q3, 0)
        if i % 4 == 0:
            xsum[b, i // 4] = int32(s_hi) * 2048 + int32(s_lo)
        if i % 8 == 0:
            xs[b, i // 8] = a / float32(Q_MAX)


@kernel
def _prep_x(xq, xl, xsum, xs, x):
    """Grid (K / 4 / PREP, R): x[b] in limbs (``_store_limbs``)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    K = x.shape[1]
    c0 = 4 * i if i < K // 4 else 0
    _store_limbs(xq, xl, xsum, xs, b, i, K, x[b, c0], x[b, c0 + 1], x[b, c0 + 2], x[b, c0 + 3])


@kernel
def _prep_x_swiglu(xq, xl, xsum, xs, gate_up, w, clamp):
    """As _prep_x for h[b] = swiglu_scalar(gate, up, w[b], clamp) of gate_up[b] = [gate | up]
    (moe.swiglu's float32 formula: the h a SwiGLU launch would write)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    F = gate_up.shape[1] // 2
    c0 = 4 * i if i < F // 4 else 0
    wb = w[b]
    _store_limbs(xq, xl, xsum, xs, b, i, F,
                 swiglu_scalar(gate_up[b, c0], gate_up[b, F + c0], wb, clamp),
                 swiglu_scalar(gate_up[b, c0 + 1], gate_up[b, F + c0 + 1], wb, clamp),
                 swiglu_scalar(gate_up[b, c0 + 2], gate_up[b, F + c0 + 2], wb, clamp),
                 swiglu_scalar(gate_up[b, c0 + 3], gate_up[b, F + c0 + 3], wb, clamp))


def _x_buffers(stream, rows: int, K: int):
    """(xq, xl, xsum, xs) for ``rows`` rows: stream-private, sized up to a power of two of rows
    so that a prompt's chunks (the last one shorter) share one allocation."""
    cap = 1 << max(6, (rows - 1).bit_length())
    xq = stream_buffer("imma x hi|mid", stream, (cap, K // 4), np.uint64)[:rows]
    xl = stream_buffer("imma x lo", stream, (cap, K // 4), np.uint32)[:rows]
    xsum = stream_buffer("imma x sums", stream, (cap, K // 16), np.int32)[:rows]
    xs = stream_buffer("imma x scales", stream, (cap, K // KT), np.float32)[:rows]
    return xq, xl, xsum, xs


def prepare_x(x, stream=0):
    """x float32 [R, K] -> (xq uint64 [R, K/4] (hi word | mid word << 32, 4 columns a word),
    xl uint32 [R, K/4] (lo words), xsum int32 [R, K/16] (Σq per 16 columns), xs float32
    [R, K/32] (s per slot))."""
    R, K = x.shape
    bufs = _x_buffers(stream, R, K)
    _prep_x[(cdiv(K // 4, PREP_THREADS), R), PREP_THREADS, stream](*bufs, x)
    return bufs


def prepare_x_swiglu(gate_up, weights, clamp: float, stream=0):
    """As prepare_x for h = weights · SwiGLU(gate, up) of gate_up [R, 2F] (moe.swiglu's float32
    formula: the same h as a SwiGLU launch would write, without its launch and round trip)."""
    R, F = gate_up.shape[0], gate_up.shape[1] // 2
    bufs = _x_buffers(stream, R, F)
    _prep_x_swiglu[(cdiv(F // 4, PREP_THREADS), R), PREP_THREADS, stream](
        *bufs, gate_up, weights, float32(clamp))
    return bufs


# ---- A fragments per type ------------------------------------------------------------------------
# Lane c of a quad owns the 8 consecutive columns 8c .. 8c+7 of the K step: its fragment words
# (MMA columns 4c.. and 16+4c..) are columns 8c..8c+3 and 8c+4..8c+7, for A and B alike (a dot
# product does not mind the order of its terms). So a lane's weights are one 8-byte word of the
# planes (Q8_0, Q2_K) or one IQ2_XXS grid row, and its x two adjacent limb words.
# load(planes, e, n, k0, c) -> raw words (loads only: issued a K step ahead);
# frag(raw, tab, c, k0) -> (A word of columns 8c.., of 8c+4.., scale, dmin, m0, m1) of row n.
@cuda.jit(device=True)
def _q8_0_load(planes, e, n, k0, c):
    qs, d = planes  # qs viewed as uint64: 8 codes a word
    return qs[e, n, (k0 >> 3) + c], d[e, n, k0 >> 5]


@cuda.jit(device=True)
def _q8_0_frag(raw, tab, c, k0):
    w, d = raw
    z = float32(0)
    return _half(w, 0), _half(w, 1), float32(d), z, z, z


# IQ2_XXS: the 256 grid rows as 8 magnitude bytes (a uint64 each), then the 128 sign indices as
# 8 byte masks (0xFF: negative). A signed byte is (m ^ s) + (s & 1): magnitudes are 8..43, so
# the negation's +1 never carries into the next byte.
_GRID_BYTES = IQ2XXS_GRID.astype(np.uint8).reshape(256, 8)
_SIGN_BYTES = np.where((KSIGNS_IQ2XS[:, None].astype(np.int64) >> np.arange(8)) & 1, 255,
                       0).astype(np.uint8)
IQ2_TAB = np.concatenate([_GRID_BYTES.view(np.uint64).ravel(),
                          _SIGN_BYTES.view(np.uint64).ravel()])
IQ2_SIGNS = 256  # first sign mask in IQ2_TAB
TAB_WORDS = len(IQ2_TAB)  # 384


@cuda.jit(device=True)
def _iq2_xxs_load(planes, e, n, k0, c):
    qs, d = planes
    return qs[e, n, k0 >> 5], d[e, n, k0 >> 8]


@cuda.jit(device=True)
def _iq2_xxs_frag(raw, tab, c, k0):
    w, d = raw
    grids, sw = _half(w, 0), _half(w, 1)
    mag = tab[int32((grids >> uint32(8 * c)) & uint32(255))]  # grid row c: columns 8c ..
    neg = tab[IQ2_SIGNS + int32((sw >> uint32(7 * c)) & uint32(127))]
    v = (mag ^ neg) + (neg & uint64(0x0101010101010101))
    z = float32(0)
    db = float32(d) * (float32(0.5) + float32(sw >> uint32(28))) * float32(0.25)
    return _half(v, 0), _half(v, 1), db, z, z, z


@cuda.jit(device=True)
def _q2_k_load(planes, e, n, k0, c):
    """The K step's 32 columns are one (half h, shift j) of a super-block: bytes 32h .. 32h+31
    of its 64 qs bytes (lane c: 32h + 8c ..), sub-blocks 8h + 2j (columns 0-15, scale word
    2h) and 8h + 2j + 1 (16-31, word 2h + 1)."""
    qs, sc, dm = planes
    s, h = k0 >> 8, (k0 >> 7) & 1
    return (qs[e, n, s * 8 + 4 * h + c], sc[e, n, 4 * s + 2 * h], sc[e, n, 4 * s + 2 * h + 1],
            dm[e, n, 2 * s], dm[e, n, 2 * s + 1])


@cuda.jit(device=True)
def _q2_k_frag(raw, tab, c, k0):
    w, sc0, sc1, d, dmin = raw
    j = (k0 >> 5) & 3
    b0 = int32((sc0 >> uint32(8 * j)) & uint32(255))
    b1 = int32((sc1 >> uint32(8 * j)) & uint32(255))
    q = (w >> uint64(2 * j)) & uint64(0x0303030303030303)
    v = q * uint64((b0 if c < 2 else b1) & 15)  # q·sc <= 45: no carry between bytes
    return (_half(v, 0), _half(v, 1), float32(d), float32(dmin), float32(b0 >> 4),
            float32(b1 >> 4))


# ---- the kernel ----------------------------------------------------------------------------------
@cuda.jit(device=True)
def _stage_x(xq_s, xl_s, xs_s, xm_s, xq, xl, xsum, xs, xr, kc, K, MINS):
    """The tile's x for columns [kc, kc + CH) into shared memory, coalesced: limb words, the
    slots' scales and (Q2_K) Σq per 16 columns (as float32); zeros for entries that are not
    this pass's."""
    tid = cuda.threadIdx.x
    nw = min(CH, K - kc) >> 2
    for i in range(tid, BN * (CH // 4), THREADS):
        j, w = i // (CH // 4), i % (CH // 4)
        v, lo = uint64(0), uint32(0)
        if xr[j] >= 0 and w < nw:
            v, lo = xq[xr[j], (kc >> 2) + w], xl[xr[j], (kc >> 2) + w]
        # word p of a K step to slot p / 2 (even p) or 4 + p / 2 (odd): lane c's two words
        # (columns 8c ..) land in slots c and c + 4, as the fragment reads take them
        p = w & 7
        slot = (w & ~7) + (p >> 1) + 4 * (p & 1)
        xq_s[j, slot], xl_s[j, slot] = v, lo
    for i in range(tid, BN * (CH // KT), THREADS):
        j, w = i // (CH // KT), i % (CH // KT)
        xs_s[j, w] = xs[xr[j], (kc >> 5) + w] if xr[j] >= 0 and 8 * w < nw else float32(0)
    if MINS:
        for i in range(tid, BN * (CH // 16), THREADS):
            j, w = i // (CH // 16), i % (CH // 16)
            xm_s[j, w] = (float32(xsum[xr[j], (kc >> 4) + w]) if xr[j] >= 0 and 4 * w < nw
                          else float32(0))


def _imma_kernel(name: str, load, frag, TAB: int, MINS: bool, **opts):
    N_TAB = max(TAB, 1)

    def k(out, planes, xq, xl, xsum, xs, ids, order, tiles, tab_g, per_token, x_div, N, K):
        tid = cuda.threadIdx.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        n_w = cuda.blockIdx.x * BM + warp * 16 * MI  # the warp's first weight row
        tab = cuda.shared.array(N_TAB, uint64)
        rows = cuda.shared.array(BN, int32)
        exps = cuda.shared.array(BN, int32)
        xr = cuda.shared.array(BN, int32)  # x row of each tile entry in this pass, -1: none
        xq_s = cuda.shared.array((BN, XW), uint64)  # the chunk's x hi | mid limb words
        xl_s = cuda.shared.array((BN, XW), uint32)  # its lo limb words
        xs_s = cuda.shared.array((BN, XS_W), float32)  # its slot scales
        xm_s = cuda.shared.array((BN, XM_W), float32)  # its Σq per 16 columns (Q2_K)
        xch = cuda.shared.array(XCH, np.int64)
        acc = cuda.local.array(N_ACC, float32)
        for i in range(N_ACC):
            acc[i] = float32(0)
        for i in range(tid, TAB, THREADS):
            tab[i] = tab_g[i]
        _tile_rows(rows, exps, ids, order, tiles, per_token, cuda.blockIdx.y * BN, out.shape[0])
        n0, n1 = min(n_w + g, N - 1), min(n_w + g + 8, N - 1)  # rows past N: not stored
        n2, n3 = min(n_w + g + 16, N - 1), min(n_w + g + 24, N - 1)
        e_prev = -1
        while True:
            e = _next_expert(exps, e_prev)
            if e == 1 << 30:
                break
            for j in range(tid, BN, THREADS):
                r = rows[j]
                xr[j] = r // x_div if r >= 0 and exps[j] == e else -1
            # the weight words are loaded a K step ahead, into registers: the block's few warps
            # would otherwise wait out a global load every step
            r0, r1 = load(planes, e, n0, 0, c), load(planes, e, n1, 0, c)
            r2, r3 = load(planes, e, n2, 0, c), load(planes, e, n3, 0, c)
            for kc in range(0, K, CH):
                cuda.syncthreads()  # xr is set; the last chunk's x is no longer read
                _stage_x(xq_s, xl_s, xs_s, xm_s, xq, xl, xsum, xs, xr, kc, K, MINS)
                cuda.syncthreads()
                for k0 in range(kc, min(kc + CH, K), KT):
                    c0, c1, c2, c3 = r0, r1, r2, r3
                    if k0 + KT < K:
                        r0 = load(planes, e, n0, k0 + KT, c)
                        r1 = load(planes, e, n1, k0 + KT, c)
                        r2 = load(planes, e, n2, k0 + KT, c)
                        r3 = load(planes, e, n3, k0 + KT, c)
                    kw, ks = (k0 - kc) >> 2, (k0 - kc) >> 5
                    for mi in range(MI):
                        a0, a2, sa, ma, m0a, m1a = frag(c0 if mi == 0 else c2, tab, c, k0)
                        a1, a3, sb, mb, m0b, m1b = frag(c1 if mi == 0 else c3, tab, c, k0)
                        for ni in range(NI):
                            jb = ni * 8 + g
                            u0, u1 = xq_s[jb, kw + c], xq_s[jb, kw + 4 + c]
                            z = int32(0)
                            h0, h1, h2, h3 = _imma(a0, a1, a2, a3, _half(u0, 0), _half(u1, 0),
                                                   True, z, z, z, z, xch)
                            # A·(256·hi + mid): the mid MMA accumulates onto 256·(A·hi)
                            # (|.| < 2^27), then A·lo apart: 256·that + A·lo needs 2^35
                            m0, m1, m2, m3 = _imma(a0, a1, a2, a3, _half(u0, 1), _half(u1, 1),
                                                   False, h0 << 8, h1 << 8, h2 << 8, h3 << 8,
                                                   xch)
                            l0, l1, l2, l3 = _imma(a0, a1, a2, a3, xl_s[jb, kw + c],
                                                   xl_s[jb, kw + 4 + c], False, z, z, z, z, xch)
                            q = (mi * NI + ni) * 4
                            for t in range(2):  # this lane's C tokens 2c, 2c + 1
                                jc = ni * 8 + 2 * c + t
                                s = xs_s[jc, ks]
                                fa = (float32(m0 if t == 0 else m1) * float32(256)
                                      + float32(l0 if t == 0 else l1))
                                fb = (float32(m2 if t == 0 else m3) * float32(256)
                                      + float32(l2 if t == 0 else l3))
                                if MINS:
                                    v0, v1 = xm_s[jc, 2 * ks], xm_s[jc, 2 * ks + 1]
                                    acc[q + t] += s * (sa * fa - ma * (m0a * v0 + m1a * v1))
                                    acc[q + 2 + t] += s * (sb * fb - mb * (m0b * v0 + m1b * v1))
                                else:
                                    acc[q + t] += (sa * s) * fa
                                    acc[q + 2 + t] += (sb * s) * fb
            e_prev = e
        for mi in range(MI):
            na = n_w + mi * 16 + g
            for ni in range(NI):
                q = (mi * NI + ni) * 4
                for t in range(2):
                    r = rows[ni * 8 + 2 * c + t]
                    if r >= 0:
                        if na < N:
                            out[r, na] = acc[q + t]
                        if na + 8 < N:
                            out[r, na + 8] = acc[q + 2 + t]
    k.__name__ = k.__qualname__ = f"_gemm_{name}_imma"
    return kernel(**opts)(k)


_SPECS = {GGMLType.Q8_0: ("q8_0", _q8_0_load, _q8_0_frag, 0, False),
          GGMLType.IQ2_XXS: ("iq2_xxs", _iq2_xxs_load, _iq2_xxs_frag, TAB_WORDS, False),
          GGMLType.Q2_K: ("q2_k", _q2_k_load, _q2_k_frag, 0, True)}
# Register caps (H200, 2026-12-03, 1,024-token chunk; uncapped the kernels take 168-214): 128
# gives 4 blocks an SM, Q8_0 1.21 -> 1.07 ms (attn_q_b), 1.45 -> 1.11 (attn_output_b), IQ2_XXS
# 4.27 -> 4.09; Q2_K spills ~0.5 KB at 128 (4.74 ms) and is best at 168 (4.42 -> 3.98).
MAX_REGISTERS = {GGMLType.Q8_0: 128, GGMLType.IQ2_XXS: 128, GGMLType.Q2_K: 168}
_KERNELS = {qt: _imma_kernel(*spec, max_registers=MAX_REGISTERS[qt])
            for qt, spec in _SPECS.items()}


# ---- launchers -----------------------------------------------------------------------------------
ENABLED = os.environ.get("POCKETFM_IMMA", "1").strip().lower() not in ("0", "off", "false", "no")


def supports(w: QWeight) -> bool:
    """Whether gemm_imma runs this weight (its type, rows of whole super-blocks)."""
    return w.qtype in _KERNELS and w.cols % (256 if w.qtype != GGMLType.Q8_0 else KT) == 0


def takes(w: QWeight) -> bool:
    """Whether the GEMMs of a prefill chunk run ``w`` here rather than on mma.py's bf16 codes
    kernel: on a GPU (the simulator's MMAs are for the tests), unless POCKETFM_IMMA=0 (A/B)."""
    return ENABLED and not SIMULATOR and supports(w)


def _planes(w: QWeight):
    """The planes as the kernels take them: Q8_0's codes as uint64 words (a lane's 8)."""
    if w.qtype == GGMLType.Q8_0:
        return (w.planes[0].view(np.uint64), w.planes[1])
    return w.planes


def _table(w: QWeight):
    if w.qtype == GGMLType.IQ2_XXS:
        return _device_const("imma_iq2_tab", IQ2_TAB)
    return _device_const("imma_no_tab", np.zeros(1, np.uint64))


def gemm_imma_prepared(out, w: QWeight, x_limbs, ids=None, order=None, stream=0, tiles=None,
                       x_div: int = 1) -> None:
    """out float32 [R, N] = W · x[r // x_div] (or W[ids[r]] · ...) on x made by prepare_x /
    prepare_x_swiglu; ``order`` / ``tiles`` as in mma.gemm_mma (expert_order's)."""
    R, N, K = out.shape[0], w.rows, w.cols
    xq, xl, xsum, xs = x_limbs
    assert supports(w) and out.shape[1] == N and xq.shape[1] * 4 == K, (out.shape, w, xq.shape)
    assert xq.shape[0] * x_div >= R, (xq.shape, x_div, R)
    per_token = ids is not None
    assert tiles is None or (per_token and order is not None), "tiles come with ids and order"
    one = _dummies()[0]
    if per_token and order is None:
        order = _device_const(f"mma_identity_{R}", np.arange(R, dtype=np.int32))
    gy = cdiv(R, BN) if tiles is None else tiles.shape[1]
    _KERNELS[w.qtype][(cdiv(N, BM), gy), THREADS, stream](
        out, _planes(w), xq, xl, xsum, xs, ids if per_token else one,
        order if per_token else one,
        _no_tiles() if tiles is None else tiles, _table(w),
        ALIGNED if tiles is not None else int(per_token), x_div, N, K)


def gemm_imma(out, w: QWeight, x, ids=None, order=None, stream=0, tiles=None,
              x_div: int = 1) -> None:
    """out float32 [R, N] = W · x[r // x_div], or W[ids[r]] · x[r // x_div]; x float32 [R', K].
    ``x_div`` > 1: rows share x (the MoE's k (token, expert) rows of a token: no copies)."""
    gemm_imma_prepared(out, w, prepare_x(x, stream), ids, order, stream, tiles, x_div)


def gemm_imma_ref(out, w: QWeight, x, ids=None, order=None, tiles=None, x_div: int = 1) -> None:
    """NumPy reference (order and tiles change the schedule, not the result)."""
    x = np.asarray(x)
    if x_div > 1:
        x = np.repeat(x, x_div, axis=0)[:out.shape[0]]
    gemv_ref(out, w, x, ids)


def prepare_x_ref(x):
    """(q int64 [R, K], s float32 [R, K/32]) of prepare_x: x ≈ s · q per 32-column slot."""
    x = np.asarray(x, np.float32)
    R, K = x.shape
    a = np.abs(x.reshape(R, K // KT, KT)).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(a > 0, np.float32(Q_MAX) / a, np.float32(0)).astype(np.float32)
    q = np.rint(x.reshape(R, K // KT, KT) * inv[:, :, None]).astype(np.int64).reshape(R, K)
    return q, (a / np.float32(Q_MAX)).astype(np.float32)


# ---- CI lane B and benchmarks --------------------------------------------------------------------
_PLANES = {
    GGMLType.Q8_0: "Tuple((uint64[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.Q2_K: "Tuple((uint64[:, :, ::1], uint32[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.IQ2_XXS: "Tuple((uint64[:, :, ::1], float16[:, :, ::1]))",
}
PTX_SIGNATURES = [
    (kern, f"void(float32[:, ::1], {_PLANES[qt]}, uint64[:, ::1], uint32[:, ::1], "
           "int32[:, ::1], float32[:, ::1], int32[::1], int32[::1], int32[:, ::1], uint64[::1], "
           "int64, int64, int64, int64)")
    for qt, kern in _KERNELS.items()]


def bench_cases(stream) -> list[BenchCase]:
    """A 1,024-token prefill chunk at V4-Flash shapes, beside mma.py's bf16 codes kernel on the
    same data: q_b and out_b (Q8_0, dense), the routed experts' gate+up (IQ2_XXS) and down
    (Q2_K) over 6,144 (token, expert) rows of 256 experts in expert_order's tiles."""
    from . import gemv_lowbit
    from .gemv import _random_weight, _TYPES
    from .mma import gemm_mma
    rng = np.random.default_rng(0)
    cases = []
    T = 1024

    def case(label, fn, nbytes, flops, host, xh, out, ids_h=None, x_div=1, rows=256):
        def check():
            r = min(rows, out.shape[0])
            sub_ids = None if ids_h is None else ids_h[:r]
            ref = np.empty((r, host.rows))
            xr = np.repeat(xh, x_div, axis=0)[:r] if x_div > 1 else xh[:r]
            gemv_ref(ref, host, xr, sub_ids)
            got = out.copy_to_host(stream=stream)[:r]
            stream.synchronize()
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        cases.append(BenchCase("imma", label, fn, nbytes, flops, check=check))

    for name, N, K in (("attn_q_b", 32768, 1024), ("attn_output_b", 4096, 8192)):
        host = _random_weight(_TYPES[GGMLType.Q8_0], N, K, rng)
        dev = host.to_device(stream)
        xh = rng.standard_normal((T, K)).astype(np.float32)
        x = cuda.to_device(xh, stream=stream)
        out = cuda.device_array((T, N), np.float32, stream=stream)
        nb, fl = dev.nbytes + 4 * T * (N + K), 2 * T * N * K
        case(f"gemm_imma q8_0 {name} {T} tok x {N}x{K}",
             lambda out=out, dev=dev, x=x: gemm_imma(out, dev, x, stream=stream), nb, fl,
             host, xh, out)
        case(f"gemm_mma (bf16 codes) q8_0 {name} {T} tok x {N}x{K}",
             lambda out=out, dev=dev, x=x: gemm_mma(out, dev, x, stream=stream, int8=False),
             nb, fl,
             host, xh, out)
    E, k = 256, 6
    ids_h = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32).ravel()
    ids = cuda.to_device(ids_h, stream=stream)
    order = cuda.device_array(T * k, np.int32, stream=stream)
    tiles = cuda.device_array((2, expert_tiles_capacity(T * k, E)), np.int32, stream=stream)
    for qtype, N, K, x_div in ((GGMLType.IQ2_XXS, 4096, 4096, k), (GGMLType.Q2_K, 4096, 2048, 1)):
        host, dev = gemv_lowbit._bench_weight(qtype, E, N, K, rng, distinct=8)
        xh = rng.standard_normal((T * k // x_div, K)).astype(np.float32)
        x = cuda.to_device(xh, stream=stream)
        x_rep = cuda.to_device(np.repeat(xh, x_div, axis=0), stream=stream)
        out = cuda.device_array((T * k, N), np.float32, stream=stream)
        spec = gemv_lowbit.SPECS[qtype]

        def imma(out=out, dev=dev, x=x, x_div=x_div):
            expert_order(order, ids, E, stream, tiles=tiles)
            gemm_imma(out, dev, x, ids, order, stream, tiles=tiles, x_div=x_div)

        def bf16(out=out, dev=dev, x_rep=x_rep):
            expert_order(order, ids, E, stream, tiles=tiles)
            gemm_mma(out, dev, x_rep, ids, order, stream, tiles=tiles, int8=False)
        touched = len(np.unique(ids_h))
        nb = touched * dev.nbytes // E + 4 * T * k * (N + K)
        for how, fn in (("gemm_imma", imma), ("gemm_mma (bf16 codes)", bf16)):
            case(f"{how} expert tiles {spec.name} experts {T}x{k} rows x {N}x{K}", fn, nb,
                 2 * T * k * N * K, host, xh, out, ids_h, x_div, rows=12)
    return cases
