"""Half-precision tensor-core GEMM for the code types: out[T, N] = x[T, K] · W[N, K]ᵀ for Q8_0,
IQ2_XXS and Q2_K (and F16, whose weights are float16 already) on ``mma.sync.aligned.m16n8k16``
with float16 operands and float32 accumulation (PTX).

Why: a prefill chunk is ~26 GFLOP a V4-Flash token, most of it in these three types (the
routed experts' IQ2_XXS gate+up and Q2_K down, the attention's Q8_0), and mma.py's bf16 codes
kernel spends its time making bf16 tiles in shared memory (11-17 TFLOP/s on the H200). Their
weights are small integers times a scale, exact in float16, so they go into the MMA as they
are, built in registers straight from the packed planes (loaded a K step ahead): no weight tile
in shared memory. x splits into two float16 limbs:
    x' = 2^p · x (p per row: max|x'| in [2^14, 2^15), inside float16's range),
    hi = f16(x'), lo = f16(x' - hi)          (22 bits of each value)
(bf16's two limbs, 16 bits, and int8 limbs of 15 bits measured too coarse for the prefill: on
`small` after a 1K prompt the greedy tokens left NumPy's. Three int8 limbs of 22 bits of each
32-column slot's largest value, three MMAs and three int32 -> float conversions per output
and K step, ran 5-30% slower than this on the H200; git history has that kernel.) A K step
of 32 columns is four MMAs chained on one float32 C (codes · hi and codes · lo, two 16-column
halves), then one multiply-add per output:
    Q8_0, IQ2_XXS, Q2_K  acc += d · C         (d: the row's scale of the step's 32 columns)
and the store multiplies by 2^-p (F16: the weights are the pairs, scale 1; the ds4 mix's
compressors, indexer and router, which mma.py's split kernel ran 3-4x slower on the H200, with x
to 16 bits). Q2_K's 4-bit sub-block scale is folded into the codes (q·sc <= 45); its mins
term, -dmin · Σ m·Σx' over a 256-column super-block's 16 sub-blocks, is a pair of MMAs a
super-block of its own (A: the mins, exact in float16; B: the tokens' sums of x' per 16
columns, /16 as two float16 limbs, which the x preparation makes): on the H200 the routed down
took 2.02 ms instead of 2.37 with two FFMAs an output and K step (BENCHMARKS 2026-12-05).

Codes to float16 pairs: two bytes b go into the low bytes of two halves whose high byte is
0x64 (prmt): the halves are 1024 + b; one fma.f16x2 takes 1024 away (1152 for signed bytes,
whose sign bit is flipped first: 1024 + (b + 128)). IQ2_XXS's grid rows come as magnitude
bytes from a 2 KB table in shared memory and are signed in registers.

Fragments (PTX ISA, mma.m16n8k16 .f16): lane (g = lane / 4, c = lane % 4) holds A pairs (row
g, MMA columns 2c, 2c+1), (g+8, ..), (g, 2c+8, 2c+9), (g+8, ..) and B pairs (token g, the same
columns); C (row g, tokens 2c, 2c+1), (g+8, ..). A dot product does not mind the order of its
terms, so the two MMAs of a K step give lane c the step's columns 8c..8c+3 and 8c+4..8c+7: a
lane's weights are one 8-byte word of the planes (Q8_0, Q2_K) or one IQ2_XXS grid row, and
its x two 8-byte words of each limb.

Block: 4 warps, each 64 weight rows x 32 tokens (4 x 4 MMA tiles, so that each x fragment
read from shared memory feeds 8 MMAs; a build with 2 x 4 exists for A/B), so a block is 256
rows x 32 tokens; rows: dense tokens, or the MoE's (token, expert) rows in expert_order's
tiles as mma.py takes them (one expert per block with ``tiles``; else a pass per expert in
the tile, rows of other experts masked to zero). The tile's x (limb words, Q2_K's sums) is
staged in shared memory 256 columns at a time, coalesced, so the four warps do not each fetch
it; a
thread's 32 loads of a stage go out together (one round trip to L2 a stage, not 16). The
8-token MMA tiles with no row in a pass are skipped (an expert's tile holds ~24 rows at 1,024
tokens); the K loop is built twice, with and without those branches, so a full tile has none.
Indices into the weight planes and x are unsigned: Numba adds negative-index code otherwise.
KERNELS_T64 (IQ2_XXS, Q2_K and Q8_0, for A/B) is 2 x 8 tiles a warp: 128 rows x 64 tokens a
block, x staged 128 columns at a time (with ids: over expert_order's 64-row tiles). Measured
(H100, 2,048 tokens, 2026-12-05 (i)): against the 32-token build Q8_0 out_b 1.03x and IQ2_XXS
gate+up 1.02x the time, Q2_K down 0.99x; in the prefill chunk both candidates were slower.

In the simulator an MMA is emulated per warp (mma.py), and the float16 pair arithmetic in
NumPy; sizes stay tiny there.
"""
from __future__ import annotations

import os
import struct

import numpy as np
from numba import cuda, float32, int32, uint32, uint64
from numba.types import float16

from ..engine.layout import expert_tiles_capacity, f16_x_floats, f16_x_rows
from ..quants import GGMLType
from .bench import BenchCase
from .device import SIMULATOR, cdiv, kernel, stream_buffer
from .gemv import _bits_f32, _dummies, gemv_ref
from .gemv_lowbit import swiglu_scalar
from .lowbit_layout import (_GRID_U64, _Q2K_SC_ORDER, _f32_bits, _half, _iq2_xxs_signed,
                            _prmt)
from .mma import ALIGNED, _device_const, _mma_f16, _next_expert, _no_tiles, _tile_rows
from .qweight import QWeight

KT = 32  # columns per K step: two MMAs' k, one Q8_0 / IQ2_XXS block
THREADS = 128  # 4 warps
MI, NI = 4, 4  # a warp's MMA tiles: 4 x 16 weight rows (or 2: _hmma_kernel's mi), 4 x 8 tokens
BN = 8 * NI  # 32 tokens a block (and 64·mi rows)
CH = 256  # columns of x staged in shared memory at a time (8 K steps)
BATCH = 8  # staging words a thread has in flight at once (of CH / 16)
XW = CH // 4 + 4  # a token's staged uint64 words, padded: the fragment reads hit distinct banks
XM_W = CH // 32  # a token's staged sum words (Q2_K: one super-block's 16 sums, two limbs)
XCH = 128 * 6 if SIMULATOR else 1  # simulator MMA exchange: 6 fragment words per thread
PREP = 128  # x preparation: threads per block (one block a row)
PREP_ILP = 8  # ... and values a thread loads at once for the row's largest magnitude
PREP_VALS = 17 * PREP  # a pass's 16·PREP values, 17 words a group: conflict-free sums
assert THREADS == 4 * BN and CH % 64 == 0 and (CH // 16) % BATCH == 0  # _stage_x

# ---- codes to float16 pairs --------------------------------------------------------------------
if SIMULATOR:
    _WORD, _PAIR = struct.Struct("<I"), struct.Struct("<ee")

    def _hfma2_numpy(a, b, c):
        def halves(v):
            return np.array([int(v) & 0xFFFF, (int(v) >> 16) & 0xFFFF], np.uint16).view(
                np.float16).astype(np.float64)
        with np.errstate(over="ignore"):  # a finite overflow gives inf, as the PTX does
            r = (halves(a) * halves(b) + halves(c)).astype(np.float16).view(np.uint16)
        return np.uint32(int(r[0]) | (int(r[1]) << 16))

    def _hfma2(a, b, c):
        """PTX fma.rn.f16x2 on the bits of three float16 pairs, in float64 (the products
        exact) and then rounded to float16, as the NumPy form above (the kernels' uses are
        exact: codes + 1024 - 1024). struct's float16 rounds as NumPy's does and is ~7x faster
        in the simulator's hot loop, but raises on a finite overflow (which must give inf):
        that case takes the NumPy form."""
        (a0, a1), (b0, b1), (c0, c1) = (_PAIR.unpack(_WORD.pack(int(v))) for v in (a, b, c))
        try:
            return np.uint32(_WORD.unpack(_PAIR.pack(a0 * b0 + c0, a1 * b1 + c1))[0])
        except OverflowError:
            return _hfma2_numpy(a, b, c)
else:
    from numba import types

    from .lowbit_layout import _asm_intrinsic
    _hfma2 = _asm_intrinsic("fma.rn.f16x2 $0, $1, $2, $3;", types.uint32)

ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)
ONE2 = 0x3C003C00  # float16 pair (1, 1)
MINUS_1024 = 0xE400E400  # (-1024, -1024)
MINUS_1152 = 0xE480E480  # (-1152, -1152)


@cuda.jit(device=True)
def _code_pairs(u, signed):
    """Four code bytes (int8, or uint8 when not ``signed``) of a uint32 as two float16 pairs
    (bytes 0, 1 and 2, 3; the lower byte in the low half). prmt selector 0x4140 makes the word
    (byte 0, 0x64, byte 1, 0x64): halves 1024 + byte, which the fma takes the offset from."""
    if signed:
        u = u ^ uint32(0x80808080)
    m = uint32(MINUS_1152 if signed else MINUS_1024)
    hi = uint32(0x64646464)
    return (_hfma2(_prmt(u, hi, uint32(0x4140)), uint32(ONE2), m),
            _hfma2(_prmt(u, hi, uint32(0x4342)), uint32(ONE2), m))


@cuda.jit(device=True)
def _word_pairs(w, signed):
    """The 8 code bytes of a uint64 as four float16 pairs, in column order."""
    p0, p1 = _code_pairs(_half(w, 0), signed)
    p2, p3 = _code_pairs(_half(w, 1), signed)
    return p0, p1, p2, p3


# ---- A fragments per type ------------------------------------------------------------------------
# Lane c of a quad owns the 8 consecutive columns 8c .. 8c+7 of the K step (see the docstring).
# load(planes, e, n, k0, c) -> raw words (loads only: issued a K step ahead);
# frag(raw, tab, c, k0) -> (4 float16 code pairs of columns 8c.., the step's scale) of row n
# (Q2_K's mins: a super-block's MMA of their own, _q2_k_mins_tile).
@cuda.jit(device=True)
def _q8_0_load(planes, e, n, k0, c):
    qs, d = planes  # qs viewed as uint64: 8 codes a word
    return qs[e, n, uint32(k0 >> 3) + uint32(c)], d[e, n, uint32(k0 >> 5)]


@cuda.jit(device=True)
def _q8_0_frag(raw, tab, c, k0):
    w, d = raw
    p0, p1, p2, p3 = _word_pairs(w, True)
    return p0, p1, p2, p3, float32(d)


@cuda.jit(device=True)
def _f16_load(planes, e, n, k0, c):
    (w,) = planes  # viewed as uint64: 4 halves a word, a lane's 8 columns in two
    i = uint32(k0 >> 2) + uint32(2 * c)
    return w[e, n, i], w[e, n, i + uint32(1)]


@cuda.jit(device=True)
def _f16_frag(raw, tab, c, k0):
    """F16 weights are their own float16 pairs, scale 1 (exact: as the codes types' codes)."""
    w0, w1 = raw
    return _half(w0, 0), _half(w0, 1), _half(w1, 0), _half(w1, 1), float32(1)


# IQ2_XXS: the 256 grid rows as 8 magnitude bytes (8, 25, 43; lowbit_layout's uint64 words,
# a 2 KB table in shared memory), one 8-byte load a row and K step; the signs are made in
# registers (lowbit_layout._iq2_xxs_signed) and the signed bytes go through the same prmt / fma
# as Q8_0's codes. (The first build looked up float16 grid rows and sign masks, four 8-byte
# loads a row: Nsight Compute found them 6.4-way bank-conflicted and the shared-memory pipe 86%
# busy. H200 2026-12-04, gate+up of 2,048 tokens x 6 experts: 6.57 -> 4.95 ms; 2 or 4
# interleaved copies of the table, a copy per lane, made no difference: 5.03, 5.00 ms.)
IQ2_TAB = _GRID_U64
TAB_WORDS = len(IQ2_TAB)  # 256


@cuda.jit(device=True)
def _iq2_xxs_frag(raw, tab, c, k0):
    w, d = raw
    grids, sw = _half(w, 0), _half(w, 1)
    c0, c1 = _iq2_xxs_signed(tab[(grids >> uint32(8 * c)) & uint32(255)], sw, c)  # row c
    p0, p1 = _code_pairs(c0, True)
    p2, p3 = _code_pairs(c1, True)
    db = float32(d) * (float32(0.5) + float32(sw >> uint32(28))) * float32(0.25)
    return p0, p1, p2, p3, db


@cuda.jit(device=True)
def _iq2_xxs_load(planes, e, n, k0, c):
    qs, d = planes
    return qs[e, n, uint32(k0 >> 5)], d[e, n, uint32(k0 >> 8)]


@cuda.jit(device=True)
def _q2_k_load(planes, e, n, k0, c):
    """The K step's 32 columns are one (half h, shift j) of a super-block: bytes 32h .. 32h+31
    of its 64 qs bytes (lane c: 32h + 8c ..), sub-blocks 8h + 2j (columns 0-15, scale word
    2h) and 8h + 2j + 1 (16-31, word 2h + 1)."""
    qs, sc, dm = planes
    s, h = uint32(k0 >> 8), uint32((k0 >> 7) & 1)
    w = uint32(4) * s + uint32(2) * h  # unsigned indices: no negative-index wrap code
    return (qs[e, n, uint32(8) * s + uint32(4) * h + uint32(c)], sc[e, n, w],
            sc[e, n, w + uint32(1)], dm[e, n, uint32(2) * s])


@cuda.jit(device=True)
def _q2_k_frag(raw, tab, c, k0):
    w, sc0, sc1, d = raw
    j = uint32((k0 >> 5) & 3)
    sc = (sc0 if c < 2 else sc1) >> (uint32(8) * j)  # columns 0-15: sub-block word 2h, else 2h+1
    q = (w >> uint64(2 * j)) & uint64(0x0303030303030303)
    v = q * uint64(sc & uint32(15))  # q·sc <= 45: no carry between bytes
    p0, p1, p2, p3 = _word_pairs(v, False)
    return p0, p1, p2, p3, float32(d)


@cuda.jit(device=True)
def _q2_k_mins_load(planes, e, n, kc, c):
    """Row n's mins of the super-block at column kc, for lane c: scale word c (4 bytes, the
    sub-blocks of lane-slot positions 4c .. 4c+3, mins in the high nibbles) and dmin."""
    qs, sc, dm = planes
    s = uint32(kc >> 8)
    return sc[e, n, uint32(4) * s + uint32(c)], dm[e, n, uint32(2) * s + uint32(1)]


@cuda.jit(device=True)
def _q2_k_mins_tile(acc, q, ra, rb, hw, lw, xch):
    """acc[q ..] -= Σ over the super-block's 16 sub-blocks of dmin·m·Σx' for a 16-row x
    8-token tile, as two MMAs: A the mins m (exact in float16) of rows g and g + 8 (raw mins
    words ``ra``, ``rb``), B the tokens' Σx'/16 limbs (``hw``, ``lw``: staged words)."""
    wa, da = ra
    wb, db = rb
    a0, a1 = _code_pairs((wa >> uint32(4)) & uint32(0x0F0F0F0F), False)
    b0, b1 = _code_pairs((wb >> uint32(4)) & uint32(0x0F0F0F0F), False)
    z = float32(0)
    d0, d1, d2, d3 = _mma_f16(a0, b0, a1, b1, _half(hw, 0), _half(hw, 1), z, z, z, z, xch)
    d0, d1, d2, d3 = _mma_f16(a0, b0, a1, b1, _half(lw, 0), _half(lw, 1), d0, d1, d2, d3, xch)
    fa, fb = float32(16) * float32(da), float32(16) * float32(db)  # (B holds Σx' / 16)
    acc[q] -= fa * d0
    acc[q + 1] -= fa * d1
    acc[q + 2] -= fb * d2
    acc[q + 3] -= fb * d3


@cuda.jit(device=True)
def _store_quad(out, acc, q, na, r0, s0, r1, s1, N):
    """A lane's C quad acc[q .. q + 3] of one MMA tile: rows na, na + 8 of tokens r0, r1
    (-1: none), times the tokens' x scales s0, s1."""
    if r0 >= 0:
        if na < N:
            out[r0, na] = acc[q] * s0
        if na + 8 < N:
            out[r0, na + 8] = acc[q + 2] * s0
    if r1 >= 0:
        if na < N:
            out[r1, na] = acc[q + 1] * s1
        if na + 8 < N:
            out[r1, na + 8] = acc[q + 3] * s1


# ---- x: a power-of-two row scale, two float16 limbs ----------------------------------------------
@cuda.jit(device=True)
def _row_scale(m):
    """2^p with m · 2^p in [2^14, 2^15) (m >= 0; 2^127 for m below 2^-113)."""
    e = max(int32((_f32_bits(m) >> uint32(23)) & uint32(255)), 14)
    return _bits_f32(uint32(268 - e) << uint32(23))


@cuda.jit(device=True)
def _store_sum(xsum, b, gi, t):
    """Σx' ``t`` of 16-column group gi of row b into xsum[b] (float16): t / 16 as two limbs
    (|t| / 16 < 2^15), in Q2_K's lane-slot order so that a lane's B fragment is two words.
    Super-block s's 16 groups take halves 32s .. 32s + 31: uint64 word 2c the high limbs of
    lane-slot positions 4c .. 4c + 3, word 2c + 1 their low limbs; sub-block 8h + 2j + u sits
    at position 4(2h + u) + j (lowbit_layout._Q2K_SC_ORDER, the order of the scale bytes)."""
    sb = gi & 15
    i = 32 * (gi >> 4) + 8 * (2 * (sb >> 3) + (sb & 1)) + ((sb >> 1) & 3)
    v = t * float32(0.0625)
    h = float16(v)
    xsum[b, i] = h
    xsum[b, i + 4] = float16(v - float32(h))


def _prep_kernel(value):
    """Grid (R,), PREP threads: row b of x (``value(src, w, clamp, b, i)``) as 2^p · x in two
    float16 limbs, Σ per 16 columns of 2^p · x (rows of whole 256-column super-blocks:
    _store_sum), and 2^-p. Two passes over the row: its largest
    magnitude (PREP_ILP loads in flight a thread), then 16·PREP columns at a time the limbs
    (coalesced) with the scaled values parked in shared memory, from which thread i sums group
    i of the pass in column order. (The first build read each value three times, one load in
    flight a thread, and summed from global memory. H200, graphs of 20: 1,024 x 8,192 57.8 ->
    34.9 µs, 1,024 x 4,096 25.8 -> 18.2; narrow rows lose: 8,192 x 1,024 44.8 -> 59.2.)"""
    def k(xh, xl, xsum, xs, src, w, clamp):
        b, tid = cuda.blockIdx.x, cuda.threadIdx.x
        K = xh.shape[1]
        red = cuda.shared.array(PREP, float32)
        vals = cuda.shared.array(PREP_VALS, float32)
        got = cuda.local.array(16, float32)
        m = float32(0)
        for i0 in range(tid, K, PREP_ILP * PREP):
            for u in range(PREP_ILP):  # clamped loads, so all go out before the first max
                got[u] = value(src, w, clamp, b, min(i0 + u * PREP, K - 1))
            for u in range(PREP_ILP):
                m = max(m, abs(got[u]))
        red[tid] = m
        cuda.syncthreads()
        half = PREP // 2
        while half > 0:
            if tid < half:
                red[tid] = max(red[tid], red[tid + half])
            cuda.syncthreads()
            half //= 2
        scale = _row_scale(red[0])
        for kc in range(0, K, 16 * PREP):
            for u in range(16):
                got[u] = value(src, w, clamp, b, min(kc + u * PREP + tid, K - 1)) * scale
            for u in range(16):
                i = u * PREP + tid  # column kc + i; group i // 16
                if kc + i < K:
                    h = float16(got[u])
                    xh[b, kc + i] = h
                    xl[b, kc + i] = float16(got[u] - float32(h))
                    vals[(i >> 4) * 17 + (i & 15)] = got[u]
            cuda.syncthreads()
            if kc + 16 * tid < K and K % 256 == 0:
                t = float32(0)
                for i in range(16):
                    t += vals[tid * 17 + i]
                _store_sum(xsum, b, (kc >> 4) + tid, t)
            cuda.syncthreads()
        if tid == 0:
            xs[b] = float32(1) / scale
    return kernel(k)


@cuda.jit(device=True)
def _x_value(src, w, clamp, b, i):
    return src[b, i]


@cuda.jit(device=True)
def _swiglu_value(src, w, clamp, b, i):
    F = src.shape[1] // 2
    return swiglu_scalar(src[b, i], src[b, F + i], w[b], clamp)


@cuda.jit(device=True)
def _group_major_value(src, w, clamp, b, i):
    """Row b = g·T + t of src [T, G, n]'s group-major rows: src[t, g, i]."""
    T = src.shape[0]
    g = b // T
    return src[b - g * T, g, i]


@cuda.jit(device=True)
def _token_major_value(src, w, clamp, b, i):
    """Row b (a token) of src [G, T, n] in token-major order: column i is src[i // n, b, i % n]."""
    n = src.shape[2]
    g = i // n
    return src[g, b, i - g * n]


_prep_x = _prep_kernel(_x_value)
_prep_x_swiglu = _prep_kernel(_swiglu_value)
_prep_x_group_major = _prep_kernel(_group_major_value)
_prep_x_token_major = _prep_kernel(_token_major_value)


_WORKSPACES: dict = {}  # id(stream) -> (stream, float32 device array)
# (id(stream), rows, K) -> (stream, XLimbs): a prefill chunk asks for the same few shapes ~400
# times, and Numba's slicing and views of device arrays cost the host ~0.1 ms each (H200 host,
# 2026-12-03: carving x was 23% of a chunk's launch time under cProfile)
_CARVED: dict = {}


class XLimbs(tuple):
    """(xh, xl, xsum, xs) as prepare_x returns them, with ``words``: the limbs and the sums as
    the uint64 views the GEMM kernel reads (made once with the buffers, not per launch)."""
    words: tuple


def use_workspace(stream, flat) -> None:
    """Carve the x of launches on ``stream`` out of ``flat`` (float32 [n]; the prefill's
    ``f16_x``, sized by layout.prefill_f16_x_floats) rather than stream-private buffers, so
    that the planner counts it. Launches on one stream run in order: one x at a time.
    ``flat`` None: back to stream-private buffers."""
    if flat is None:
        _WORKSPACES.pop(id(stream), None)
    else:
        _WORKSPACES[id(stream)] = (stream, flat)
    for key in [k for k in _CARVED if k[0] == id(stream)]:  # views of the old workspace
        del _CARVED[key]


def _x_buffers(stream, rows: int, K: int) -> XLimbs:
    """(xh, xl, xsum, xs) for ``rows`` rows, for layout.f16_x_rows(rows) rows: from the
    stream's workspace if it has one large enough, else stream-private buffers."""
    key = (id(stream), rows, K)
    hit = _CARVED.get(key)
    if hit is not None and hit[0] is stream:  # (not a dead stream's id reused)
        return hit[1]
    cap = f16_x_rows(rows)
    ws = _WORKSPACES.get(id(stream))
    if ws is not None and ws[1].shape[0] >= f16_x_floats(rows, K):
        flat, n, m = ws[1], cap * K // 2, cap * (K // 16)
        bufs = XLimbs((flat[:n].view(np.float16).reshape(cap, K)[:rows],
                       flat[n:2 * n].view(np.float16).reshape(cap, K)[:rows],
                       flat[2 * n:2 * n + m].view(np.float16).reshape(cap, K // 8)[:rows],
                       flat[2 * n + m:2 * n + m + cap][:rows]))
    else:
        bufs = XLimbs((stream_buffer("hmma x hi", stream, (cap, K), np.float16)[:rows],
                       stream_buffer("hmma x lo", stream, (cap, K), np.float16)[:rows],
                       stream_buffer("hmma x sums", stream, (cap, K // 8), np.float16)[:rows],
                       stream_buffer("hmma x scales", stream, (cap,), np.float32)[:rows]))
    bufs.words = tuple(a.view(np.uint64) for a in bufs[:3])
    _CARVED[key] = (stream, bufs)
    return bufs


def prepare_x(x, stream=0):
    """x float32 [R, K] -> (xh, xl float16 [R, K]: 2^p·x ≈ xh + xl, p per row; xsum float16
    [R, K/8]: Σ 2^p·x per 16 columns / 16 as two limbs in Q2_K's order (_store_sum; written
    when K is whole 256-column super-blocks); xs float32 [R]: 2^-p)."""
    R, K = x.shape
    bufs = _x_buffers(stream, R, K)
    one = _dummies()[0]
    _prep_x[R, PREP, stream](*bufs, x, one, float32(0))
    return bufs


def prepare_x_group_major(x, stream=0):
    """As prepare_x for the rows of x [T, G, n] in group-major order (row g·T + t is x[t, g]):
    the grouped output projection's x, read where the attention wrote it (H200 2026-12-04: a
    transpose launch there and one back took 0.57 ms a layer at 2,048 tokens)."""
    T, G, n = x.shape
    bufs = _x_buffers(stream, G * T, n)
    _prep_x_group_major[G * T, PREP, stream](*bufs, x, _dummies()[0], float32(0))
    return bufs


def prepare_x_token_major(x, stream=0):
    """As prepare_x for x [G, T, n] read as T token rows of G·n columns (row t is x[0, t],
    x[1, t], ...): the grouped output projection's output as out_b's x."""
    G, T, n = x.shape
    bufs = _x_buffers(stream, T, G * n)
    _prep_x_token_major[T, PREP, stream](*bufs, x, _dummies()[0], float32(0))
    return bufs


def prepare_x_swiglu(gate_up, weights, clamp: float, stream=0):
    """As prepare_x for h = weights · SwiGLU(gate, up) of gate_up [R, 2F] (moe.swiglu's float32
    formula: the same h as a SwiGLU launch would write, without its launch and round trip)."""
    R, F = gate_up.shape[0], gate_up.shape[1] // 2
    bufs = _x_buffers(stream, R, F)
    _prep_x_swiglu[R, PREP, stream](*bufs, gate_up, weights, float32(clamp))
    return bufs


# ---- the kernel ----------------------------------------------------------------------------------
def _stager(ch: int, bn: int):
    """_stage_x for ``ch`` staged columns and ``bn`` tokens a block (closure constants: the
    local arrays' sizes and the loops' bounds are literals)."""
    assert ch % 64 == 0 and (ch // 16) % BATCH == 0 and bn % 32 == 0 and THREADS == 128

    @cuda.jit(device=True)
    def _stage_words(dst_h, dst_l, hrow, lrow, j, q, base, last, keep, nw, FULL):
        """Words base + 4m (m < ch / 16) of a token's two limb rows into shared-memory row j.
        Loads go out BATCH at a time before any store (a load then its store, 16 times over,
        was 16 round trips to L2 a chunk) at constant offsets from one address; ``keep`` (all
        ones or zero) zeroes entries not in this pass. A partial chunk (not FULL) clamps to
        word ``last`` and zeroes the words past ``nw``."""
        hv = cuda.local.array(BATCH, uint64)
        lv = cuda.local.array(BATCH, uint64)
        # word p of a K step goes to slot p / 2 (even p) or 4 + p / 2 (odd): lane c's two words
        # (columns 8c ..) land in slots c and c + 4, so each fragment read is conflict-free.
        # For word q + 4m that is slot sq + 8 (m / 2) + 2 (m % 2).
        sq = (q >> uint32(1)) + uint32(4) * (q & uint32(1))
        for m0 in range(0, ch // 16, BATCH):
            for u in range(BATCH):
                i = base + uint64(4 * (m0 + u))
                if not FULL:
                    i = min(i, last)
                hv[u], lv[u] = hrow[i], lrow[i]
            for u in range(BATCH):
                m = m0 + u
                slot = sq + uint32(8 * (m >> 1) + 2 * (m & 1))
                ok = keep
                if not FULL and q + uint32(4 * m) >= nw:
                    ok = uint64(0)
                dst_h[j, slot] = hv[u] & ok
                dst_l[j, slot] = lv[u] & ok

    @cuda.jit(device=True)
    def _stage_x(xh_s, xl_s, xm_s, xh, xl, xsum, xr, kc, K, MINS):
        """The tile's x for columns [kc, kc + ch) into shared memory: the limbs' words (4
        columns a uint64) and (Q2_K) the super-block's Σx' words; zeros for entries not in
        this pass. Four threads a token (thread q of a token: words q, q + 4, ..., so a token's
        32 bytes are one load), bn / 32 tokens a thread."""
        tid = cuda.threadIdx.x
        q = uint32(tid & 3)
        nw = uint32(min(ch, K - kc) >> 2)
        base = uint64(kc >> 2) + uint64(q)
        last = uint64(kc >> 2) + uint64(nw - uint32(1))
        for jj in range(bn // 32):
            j = uint32(tid >> 2) + uint32(32 * jj)
            r = xr[j]
            keep = ALL_ONES if r >= 0 else uint64(0)  # all ones for an entry in this pass (a
            # select: 0 - 1 in uint64 wraps the same on a GPU, but NumPy warns of it in the
            # simulator)
            hrow, lrow = xh[max(r, 0)], xl[max(r, 0)]
            if nw == ch // 4:
                _stage_words(xh_s, xl_s, hrow, lrow, j, q, base, last, keep, nw, True)
            else:
                _stage_words(xh_s, xl_s, hrow, lrow, j, q, base, last, keep, nw, False)
            if MINS:  # the super-block's 8 sum words (Q2_K: K is whole super-blocks)
                srow = xsum[max(r, 0)]
                i = uint64(kc >> 5) + uint64(2) * uint64(q)
                v0, v1 = srow[i], srow[i + uint64(1)]
                xm_s[j, uint32(2) * q] = v0 & keep
                xm_s[j, uint32(2) * q + uint32(1)] = v1 & keep
    return _stage_x


@cuda.jit(device=True)
def _k_step(acc, q, a, b, h1, h2, l1, l2, xch):
    """One 16-row x 8-token tile's K step: C = codes · (hi + lo) over the step's 32 columns
    (four chained MMAs), then acc[q ..] += the rows' scales times C (``a``, ``b``: the frag
    tuples of rows g and g + 8)."""
    z = float32(0)
    d0, d1, d2, d3 = _mma_f16(a[0], b[0], a[1], b[1], _half(h1, 0), _half(h1, 1), z, z, z, z,
                              xch)
    d0, d1, d2, d3 = _mma_f16(a[0], b[0], a[1], b[1], _half(l1, 0), _half(l1, 1), d0, d1, d2,
                              d3, xch)
    d0, d1, d2, d3 = _mma_f16(a[2], b[2], a[3], b[3], _half(h2, 0), _half(h2, 1), d0, d1, d2,
                              d3, xch)
    d0, d1, d2, d3 = _mma_f16(a[2], b[2], a[3], b[3], _half(l2, 0), _half(l2, 1), d0, d1, d2,
                              d3, xch)
    acc[q] += a[4] * d0
    acc[q + 1] += a[4] * d1
    acc[q + 2] += b[4] * d2
    acc[q + 3] += b[4] * d3


def _hmma_kernel(name: str, load, frag, TAB: int, MINS: bool, mi: int = MI, ni: int = NI,
                 ch: int = CH, **opts):
    """The GEMM kernel for one code type; ``mi`` 16-row MMA tiles a warp (2 or 4: a block is
    64·mi rows; every x fragment read from shared memory feeds 2·mi MMAs), ``ni`` 8-token
    tiles a warp (4, or 8 with mi = 2: a block is 8·ni tokens, and each weight fragment made
    feeds ni token tiles), ``ch`` columns of x staged at a time."""
    N_TAB = max(TAB, 1)
    NI_, BN_, CH_ = ni, 8 * ni, ch
    XW_, XM_W_ = ch // 4 + 4, 8  # (Q2_K: a super-block's 16 sums, staged with its first ch)
    BMK, NACC = 64 * mi, mi * ni * 4
    assert mi in (2, 4) and (ni == 4 or (ni == 8 and mi == 2)) and ch in (128, 256)
    _stage_x = _stager(ch, BN_)

    @cuda.jit(device=True)
    def steps(acc, r0, r1, r2, r3, planes, e, n0, n1, n2, n3, c, g, tab, kc, K, xh_s, xl_s,
              busy, xch, ALL):
        """The K steps of the staged chunk at kc for the warp's 2 x 4 tiles; the next step's
        weight words (r0 .. r3, rows n0 .. n3) come back. Unless ALL, the 8-token tiles not in
        ``busy`` are skipped (a branch each: the kernel takes ALL when all are busy)."""
        for k0 in range(kc, min(kc + CH_, K), KT):
            f0, f1 = frag(r0, tab, c, k0), frag(r1, tab, c, k0)
            f2, f3 = frag(r2, tab, c, k0), frag(r3, tab, c, k0)
            if k0 + KT < K:
                r0 = load(planes, e, n0, k0 + KT, c)
                r1 = load(planes, e, n1, k0 + KT, c)
                r2 = load(planes, e, n2, k0 + KT, c)
                r3 = load(planes, e, n3, k0 + KT, c)
            kw = (k0 - kc) >> 2
            for ni in range(NI_):
                if ALL or (busy >> ni) & 1:
                    jb = ni * 8 + g
                    h1, h2 = xh_s[jb, kw + c], xh_s[jb, kw + 4 + c]
                    l1, l2 = xl_s[jb, kw + c], xl_s[jb, kw + 4 + c]
                    _k_step(acc, ni * 4, f0, f1, h1, h2, l1, l2, xch)
                    _k_step(acc, (NI_ + ni) * 4, f2, f3, h1, h2, l1, l2, xch)
        return r0, r1, r2, r3

    @cuda.jit(device=True)
    def steps4(acc, rr, planes, e, nn, c, g, tab, kc, K, xh_s, xl_s, busy, xch, ALL):
        """As steps for 4 x 4 tiles: rows nn[0 .. 7], their next weight words rr[0 .. 7]."""
        r0, r1, r2, r3, r4, r5, r6, r7 = rr
        for k0 in range(kc, min(kc + CH_, K), KT):
            f0, f1 = frag(r0, tab, c, k0), frag(r1, tab, c, k0)
            f2, f3 = frag(r2, tab, c, k0), frag(r3, tab, c, k0)
            f4, f5 = frag(r4, tab, c, k0), frag(r5, tab, c, k0)
            f6, f7 = frag(r6, tab, c, k0), frag(r7, tab, c, k0)
            if k0 + KT < K:
                r0, r1, r2, r3, r4, r5, r6, r7 = _loads8(planes, e, nn, k0 + KT, c)
            kw = (k0 - kc) >> 2
            ff = (f0, f1, f2, f3, f4, f5, f6, f7)
            # one call per token tile with a literal ni: the accumulators' indices are then
            # constants and acc stays in registers (a loop over ni left it in local memory)
            _tile4(acc, 0, ff, g, c, kw, xh_s, xl_s, busy, xch, ALL)
            _tile4(acc, 1, ff, g, c, kw, xh_s, xl_s, busy, xch, ALL)
            _tile4(acc, 2, ff, g, c, kw, xh_s, xl_s, busy, xch, ALL)
            _tile4(acc, 3, ff, g, c, kw, xh_s, xl_s, busy, xch, ALL)
        return r0, r1, r2, r3, r4, r5, r6, r7

    @cuda.jit(device=True)
    def _tile4(acc, ni, ff, g, c, kw, xh_s, xl_s, busy, xch, ALL):
        """Token tile ni of a K step for the warp's four row tiles (frags ff)."""
        if ALL or (busy >> ni) & 1:
            jb = ni * 8 + g
            h1, h2 = xh_s[jb, kw + c], xh_s[jb, kw + 4 + c]
            l1, l2 = xl_s[jb, kw + c], xl_s[jb, kw + 4 + c]
            _k_step(acc, ni * 4, ff[0], ff[1], h1, h2, l1, l2, xch)
            _k_step(acc, (NI_ + ni) * 4, ff[2], ff[3], h1, h2, l1, l2, xch)
            _k_step(acc, (2 * NI_ + ni) * 4, ff[4], ff[5], h1, h2, l1, l2, xch)
            _k_step(acc, (3 * NI_ + ni) * 4, ff[6], ff[7], h1, h2, l1, l2, xch)

    @cuda.jit(device=True)
    def _mins_col(acc, ni, mw, xm_s, g, c, busy, xch, ALL):
        """Q2_K: token tile ni's super-block mins for the warp's row tiles (mw: the rows' mins
        words, _mins_loads)."""
        if ALL or (busy >> ni) & 1:
            jb = ni * 8 + g
            hw, lw = xm_s[jb, 2 * c], xm_s[jb, 2 * c + 1]
            _q2_k_mins_tile(acc, ni * 4, mw[0], mw[1], hw, lw, xch)
            _q2_k_mins_tile(acc, (NI_ + ni) * 4, mw[2], mw[3], hw, lw, xch)
            if mi == 4:
                _q2_k_mins_tile(acc, (2 * NI_ + ni) * 4, mw[4], mw[5], hw, lw, xch)
                _q2_k_mins_tile(acc, (3 * NI_ + ni) * 4, mw[6], mw[7], hw, lw, xch)

    @cuda.jit(device=True)
    def _mins(acc, mw, xm_s, g, c, busy, xch, ALL):
        # one call per token tile with a literal ni (acc's indices constant: see steps4)
        _mins_col(acc, 0, mw, xm_s, g, c, busy, xch, ALL)
        _mins_col(acc, 1, mw, xm_s, g, c, busy, xch, ALL)
        _mins_col(acc, 2, mw, xm_s, g, c, busy, xch, ALL)
        _mins_col(acc, 3, mw, xm_s, g, c, busy, xch, ALL)
        if NI_ == 8:
            _mins_col(acc, 4, mw, xm_s, g, c, busy, xch, ALL)
            _mins_col(acc, 5, mw, xm_s, g, c, busy, xch, ALL)
            _mins_col(acc, 6, mw, xm_s, g, c, busy, xch, ALL)
            _mins_col(acc, 7, mw, xm_s, g, c, busy, xch, ALL)

    @cuda.jit(device=True)
    def _mins_loads(planes, e, nn, kc, c):
        """The mins words of the warp's rows nn for the super-block at kc."""
        if mi == 2:
            return (_q2_k_mins_load(planes, e, nn[0], kc, c),
                    _q2_k_mins_load(planes, e, nn[1], kc, c),
                    _q2_k_mins_load(planes, e, nn[2], kc, c),
                    _q2_k_mins_load(planes, e, nn[3], kc, c))
        return (_q2_k_mins_load(planes, e, nn[0], kc, c), _q2_k_mins_load(planes, e, nn[1], kc, c),
                _q2_k_mins_load(planes, e, nn[2], kc, c), _q2_k_mins_load(planes, e, nn[3], kc, c),
                _q2_k_mins_load(planes, e, nn[4], kc, c), _q2_k_mins_load(planes, e, nn[5], kc, c),
                _q2_k_mins_load(planes, e, nn[6], kc, c), _q2_k_mins_load(planes, e, nn[7], kc, c))

    @cuda.jit(device=True)
    def _loads8(planes, e, nn, k0, c):
        return (load(planes, e, nn[0], k0, c), load(planes, e, nn[1], k0, c),
                load(planes, e, nn[2], k0, c), load(planes, e, nn[3], k0, c),
                load(planes, e, nn[4], k0, c), load(planes, e, nn[5], k0, c),
                load(planes, e, nn[6], k0, c), load(planes, e, nn[7], k0, c))

    @cuda.jit(device=True)
    def _store_col(out, acc, ni, rows, xs, x_div, na, c, N):
        """Token tile ni's outputs of the lane (rows na + 16m and na + 16m + 8, its tokens
        2c, 2c + 1) times their x rows' 2^-p. The two tokens' x rows and scales are looked up
        once for the warp's mi row tiles. (The first build looped over the row tiles, the
        token tiles and the two tokens: acc went through local memory, and each output waited
        on its own 64-bit division and scale load: Nsight Compute's samples, H100 2026-12-05,
        put 24% of q_b's warp stalls (1,024 columns) in that epilogue. Same H100, 1,024
        tokens, before -> after: Q8_0 q_b 768.7 -> 673.0 µs, out_b 648.8 -> 632.2, the routed
        IQ2_XXS gate+up 2,780 -> 2,726 and Q2_K down 2,021 -> 1,929. ptxas: no local memory
        for Q8_0, F16, IQ2_XXS; Q2_K spills 36 bytes at 255 registers.)"""
        jt = ni * 8 + 2 * c
        r0, r1 = rows[jt], rows[jt + 1]
        s0 = xs[uint32(r0) // uint32(x_div)] if r0 >= 0 else float32(0)
        s1 = xs[uint32(r1) // uint32(x_div)] if r1 >= 0 else float32(0)
        _store_quad(out, acc, ni * 4, na, r0, s0, r1, s1, N)
        _store_quad(out, acc, (NI_ + ni) * 4, na + 16, r0, s0, r1, s1, N)
        if mi == 4:
            _store_quad(out, acc, (2 * NI_ + ni) * 4, na + 32, r0, s0, r1, s1, N)
            _store_quad(out, acc, (3 * NI_ + ni) * 4, na + 48, r0, s0, r1, s1, N)

    @cuda.jit(device=True)
    def _k_chunk(acc, rr, planes, e, nn, c, g, tab, kc, K, xh_s, xl_s, busy, xch, ALL):
        """The K steps of a staged chunk for this kernel's mi (rr: the next weight words)."""
        if mi == 2:
            r0, r1, r2, r3 = rr
            n0, n1, n2, n3 = nn
            return steps(acc, r0, r1, r2, r3, planes, e, n0, n1, n2, n3, c, g, tab, kc, K,
                         xh_s, xl_s, busy, xch, ALL)
        return steps4(acc, rr, planes, e, nn, c, g, tab, kc, K, xh_s, xl_s, busy, xch, ALL)

    @cuda.jit(device=True)
    def _first(planes, e, n_w, g, c, N):
        """The warp's rows of lane g (clamped: rows past N are not stored) and their first
        weight words."""
        if mi == 2:
            nn = (min(n_w + g, N - 1), min(n_w + g + 8, N - 1), min(n_w + g + 16, N - 1),
                  min(n_w + g + 24, N - 1))
            return nn, (load(planes, e, nn[0], 0, c), load(planes, e, nn[1], 0, c),
                        load(planes, e, nn[2], 0, c), load(planes, e, nn[3], 0, c))
        nn = (min(n_w + g, N - 1), min(n_w + g + 8, N - 1), min(n_w + g + 16, N - 1),
              min(n_w + g + 24, N - 1), min(n_w + g + 32, N - 1), min(n_w + g + 40, N - 1),
              min(n_w + g + 48, N - 1), min(n_w + g + 56, N - 1))
        return nn, _loads8(planes, e, nn, 0, c)

    def k(out, planes, xh, xl, xsum, xs, ids, order, tiles, tab_g, per_token, x_div, N, K):
        tid = cuda.threadIdx.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        n_w = cuda.blockIdx.x * BMK + warp * 16 * mi  # the warp's first weight row
        tab = cuda.shared.array(N_TAB, uint64)
        rows = cuda.shared.array(BN_, int32)
        exps = cuda.shared.array(BN_, int32)
        xr = cuda.shared.array(BN_, int32)  # x row of each tile entry in this pass, -1: none
        xh_s = cuda.shared.array((BN_, XW_), uint64)  # the chunk's hi limb words
        xl_s = cuda.shared.array((BN_, XW_), uint64)  # its lo limb words
        xm_s = cuda.shared.array((BN_, XM_W_), uint64)  # its super-block's Σx' words (Q2_K)
        xch = cuda.shared.array(XCH, np.int64)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0)
        for i in range(tid, TAB, THREADS):
            tab[i] = tab_g[i]
        _tile_rows(rows, exps, ids, order, tiles, per_token, cuda.blockIdx.y * BN_,
                   out.shape[0])
        e_prev = -1
        while True:
            e = _next_expert(exps, e_prev)
            if e == 1 << 30:
                break
            for j in range(tid, BN_, THREADS):
                r = rows[j]
                xr[j] = r // x_div if r >= 0 and exps[j] == e else -1
            cuda.syncthreads()
            # the 8-token MMA tiles with an entry in this pass (an expert's tile holds ~24 of
            # 32 rows at 1,024 tokens): the others' MMAs, x reads and multiply-adds are skipped
            busy = 0
            for j in range(BN_):
                if xr[j] >= 0:
                    busy |= 1 << (j >> 3)
            # the weight words are loaded a K step ahead, into registers
            nn, rr = _first(planes, e, n_w, g, c, N)
            if MINS and CH_ != 256:  # (defined on every path: set again below)
                mw = _mins_loads(planes, e, nn, 0, c)
            for kc in range(0, K, CH_):
                # Q2_K: a super-block's mins with its first stage (every stage when ch is 256)
                sb = MINS and (CH_ == 256 or (kc & 255) == 0)
                if MINS and sb:  # (loads issued before the staging's, used after its barrier)
                    mw = _mins_loads(planes, e, nn, kc, c)
                cuda.syncthreads()  # xr is set; the last chunk's x is no longer read
                _stage_x(xh_s, xl_s, xm_s, xh, xl, xsum, xr, kc, K, sb)
                cuda.syncthreads()
                if busy == (1 << NI_) - 1:  # every tile busy: no per-tile branches
                    if MINS and sb:  # (MINS first: a constant, pruned)
                        _mins(acc, mw, xm_s, g, c, busy, xch, True)
                    rr = _k_chunk(acc, rr, planes, e, nn, c, g, tab, kc, K, xh_s, xl_s, busy,
                                  xch, True)
                else:
                    if MINS and sb:  # (MINS first: a constant, pruned)
                        _mins(acc, mw, xm_s, g, c, busy, xch, False)
                    rr = _k_chunk(acc, rr, planes, e, nn, c, g, tab, kc, K, xh_s, xl_s, busy,
                                  xch, False)
            e_prev = e
        # one call per token tile with a literal ni (acc's indices constant: see steps4)
        _store_col(out, acc, 0, rows, xs, x_div, n_w + g, c, N)
        _store_col(out, acc, 1, rows, xs, x_div, n_w + g, c, N)
        _store_col(out, acc, 2, rows, xs, x_div, n_w + g, c, N)
        _store_col(out, acc, 3, rows, xs, x_div, n_w + g, c, N)
        if NI_ == 8:
            _store_col(out, acc, 4, rows, xs, x_div, n_w + g, c, N)
            _store_col(out, acc, 5, rows, xs, x_div, n_w + g, c, N)
            _store_col(out, acc, 6, rows, xs, x_div, n_w + g, c, N)
            _store_col(out, acc, 7, rows, xs, x_div, n_w + g, c, N)
    k.__name__ = k.__qualname__ = (f"_gemm_{name}_hmma" + ("" if mi == MI else f"_mi{mi}")
                                   + ("" if ni == NI else f"_t{BN_}"))
    return kernel(**opts)(k)


_SPECS = {GGMLType.Q8_0: ("q8_0", _q8_0_load, _q8_0_frag, 0, False),
          GGMLType.F16: ("f16", _f16_load, _f16_frag, 0, False),
          GGMLType.IQ2_XXS: ("iq2_xxs", _iq2_xxs_load, _iq2_xxs_frag, TAB_WORDS, False),
          GGMLType.Q2_K: ("q2_k", _q2_k_load, _q2_k_frag, 0, True)}
# Register caps of the 2-tile build (H200, 2026-12-03, a 1,024-token chunk): 128 gives 4
# blocks an SM. Q8_0 takes 130 uncapped (attn_q_b 1.03 ms at 128, 1.18-1.25 at 136 or 168);
# IQ2_XXS 134 (16 bytes of spill at 128: 4.07 ms, 4.41-4.57 at 136-168). Q2_K wants 218
# since the batched staging and the busy-tile paths (0.4 KB of spill at 128): 168, 3 blocks an
# SM, ran its routed down in 2.64 ms against 2.72 at 128 (the first build was faster at 128:
# 3.09 against 3.31).
# Those were for 2 row tiles a warp. Nsight Compute then showed the shared memory the limit
# (IQ2_XXS "memory throughput" 96%, Q2_K 90%, issue slots 33-43% busy): every warp reads the
# block's x fragments, each feeding 2·mi MMAs. With 4 row tiles a warp (255 registers, 2
# blocks an SM; ptxas: no spill for Q8_0, 40 bytes for IQ2_XXS, 0.2 KB for Q2_K), H200
# 2026-12-04, graphs of 10, two rounds:
# IQ2_XXS gate+up 3.76-3.78 -> 3.51-3.53 ms, Q2_K down 2.55-2.58 -> 2.28-2.29, Q8_0 out_b
# 0.75 -> 0.63-0.66, but q_b 0.74 -> 0.78 (32,768 rows: enough blocks that the warps count).
# The prefill at 256K with all three at 4: 1,260 -> 1,328 tok/s (BENCHMARKS.md, 2026-12-04).
MAX_REGISTERS_2 = {GGMLType.Q8_0: 128, GGMLType.F16: 128, GGMLType.IQ2_XXS: 128,
                   GGMLType.Q2_K: 168}
MAX_REGISTERS = {qt: 255 for qt in _SPECS}
# 16-row MMA tiles a warp per type (the launcher's grid follows; tests and scripts swap a
# kernel and its entry here together)
TILES_MI = {qt: MI for qt in _SPECS}
_KERNELS = {qt: _hmma_kernel(*spec, mi=TILES_MI[qt], max_registers=MAX_REGISTERS[qt])
            for qt, spec in _SPECS.items()}
# the 2-tile build, for A/B (CI compiles and tests both)
KERNELS_2 = {qt: _hmma_kernel(*spec, mi=2, max_registers=MAX_REGISTERS_2[qt])
             for qt, spec in _SPECS.items()}
# 64 tokens a block (2 row tiles x 8 token tiles a warp, x staged 128 columns at a time: the
# 32-token build's shared memory), for A/B on the routed experts: Nsight's samples put half of
# the IQ2_XXS gate+up's warp stalls in making its grid rows into float16 codes, issue-bound,
# and a third of the Q2_K down's in loading its weights and x (2026-12-05 (h)); here each
# weight word loaded and made feeds 8 token tiles, not 4 (an expert with 33-64 rows of a
# chunk, most at 2,048 tokens, is one tile, not two), for twice the x fragment reads an MMA.
# Q2_K's mins go with each super-block's first stage. ptxas, IQ2_XXS: 216 registers uncapped,
# 168 without spill (3 blocks an SM, 12 warps, against the 32-token build's 8), 128 spills 168
# bytes. Not yet measured on a GPU; gemm_hmma_prepared(..., tokens=64) over
# expert_order(..., tile=64)'s tiles.
# Q2_K: 68 bytes of spill at 168 registers, none at 255 (254: 2 blocks an SM). Q8_0 (the dense
# GEMMs, whose Nsight stalls wait on the weight loads: each word loaded here feeds twice the
# tokens): no spill at 168.
KERNELS_T64 = {qt: _hmma_kernel(*_SPECS[qt], mi=2, ni=8, ch=128, max_registers=168)
               for qt in (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q8_0)}


# ---- launchers -----------------------------------------------------------------------------------
# Grids of fewer 4-tile blocks than this take the 2-tile build: None is the GPU's SM count,
# looked up at the first launch (0 in the simulator, whose tests pick the build through
# TILES_MI). H200 2026-12-04, 2,048 tokens (µs, 2 / 4 row tiles a warp): below one block an SM
# the 2-tile grid wins (router 256 rows: 108 / 121, comp_kv of HCA 512: 127 / 135,
# idx_proj 64: 88 / 106), at 256 blocks the 4-tile one (attn_q_a 1,024: 182 / 156, comp_kv of
# CSA: 199 / 184).
SMALL_GRID = 0 if SIMULATOR else None
ENABLED = os.environ.get("POCKETFM_HMMA", "1").strip().lower() not in ("0", "off", "false", "no")


def supports(w: QWeight) -> bool:
    """Whether gemm_hmma runs this weight (its type, rows of whole blocks: 256 columns for the
    super-block types, a K step for Q8_0 and F16)."""
    whole = KT if w.qtype in (GGMLType.Q8_0, GGMLType.F16) else 256
    return w.qtype in _KERNELS and w.cols % whole == 0


def takes(w: QWeight) -> bool:
    """Whether the GEMMs of a prefill chunk run ``w`` here rather than on mma.py's bf16 codes
    kernel: on a GPU (the simulator's MMAs are for the tests), unless POCKETFM_HMMA=0 (A/B)."""
    return ENABLED and not SIMULATOR and supports(w)


def _planes(w: QWeight):
    """The planes as the kernels take them: Q8_0's codes and F16's halves as uint64 words, the
    view made once and kept on the weight (a device array view costs the host ~0.1 ms)."""
    if w.qtype not in (GGMLType.Q8_0, GGMLType.F16):
        return w.planes
    planes = w.__dict__.get("_hmma_planes")
    if planes is None:
        planes = (w.planes[0].view(np.uint64),) + tuple(w.planes[1:])
        object.__setattr__(w, "_hmma_planes", planes)  # (QWeight is frozen: a cache, not state)
    return planes


def _table(w: QWeight):
    if w.qtype == GGMLType.IQ2_XXS:
        return _device_const("hmma_iq2_tab", IQ2_TAB)
    return _device_const("hmma_no_tab", np.zeros(1, np.uint64))


def _kernel_for(qtype: int, N: int, gy: int):
    """(kernel, mi) for N rows and gy token tiles: the type's build, or the 2-tile one when the
    4-tile grid would have fewer than SMALL_GRID blocks (narrow weights such as the router's
    256 rows: one block a 32-token tile; the 2-tile build makes two, half as long)."""
    global SMALL_GRID
    if SMALL_GRID is None:
        SMALL_GRID = cuda.get_current_device().MULTIPROCESSOR_COUNT
    mi = TILES_MI[qtype]
    if mi == 4 and cdiv(N, 64 * mi) * gy < SMALL_GRID:
        return KERNELS_2[qtype], 2
    return _KERNELS[qtype], mi


def gemm_hmma_prepared(out, w: QWeight, x_limbs, ids=None, order=None, stream=0, tiles=None,
                       x_div: int = 1, tokens: int = BN) -> None:
    """out float32 [R, N] = W · x[r // x_div] (or W[ids[r]] · ...) on x made by prepare_x /
    prepare_x_swiglu; ``order`` / ``tiles`` as in mma.gemm_mma (expert_order's, of at most
    ``tokens`` rows each). ``tokens`` 64: KERNELS_T64's build (A/B)."""
    R, N, K = out.shape[0], w.rows, w.cols
    xh, xl, xsum, xs = x_limbs
    wh, wl, ws = (x_limbs.words if isinstance(x_limbs, XLimbs) else
                  tuple(a.view(np.uint64) for a in (xh, xl, xsum)))
    assert supports(w) and out.shape[1] == N and xh.shape[1] == K, (out.shape, w, xh.shape)
    assert xh.shape[0] * x_div >= R, (xh.shape, x_div, R)
    per_token = ids is not None
    assert tiles is None or (per_token and order is not None), "tiles come with ids and order"
    one = _dummies()[0]
    if per_token and order is None:
        order = _device_const(f"mma_identity_{R}", np.arange(R, dtype=np.int32))
    if tokens == BN:
        gy = cdiv(R, BN) if tiles is None else tiles.shape[1]
        kern, mi = _kernel_for(w.qtype, N, gy)
    else:
        if tokens != 64 or w.qtype not in KERNELS_T64:
            raise ValueError(f"gemm_hmma: no {tokens}-token build for {GGMLType(w.qtype).name}")
        gy = cdiv(R, tokens) if tiles is None else tiles.shape[1]
        kern, mi = KERNELS_T64[w.qtype], 2
    kern[(cdiv(N, 64 * mi), gy), THREADS, stream](
        out, _planes(w), wh, wl, ws, xs,
        ids if per_token else one, order if per_token else one,
        _no_tiles() if tiles is None else tiles, _table(w),
        ALIGNED if tiles is not None else int(per_token), x_div, N, K)


def gemm_hmma(out, w: QWeight, x, ids=None, order=None, stream=0, tiles=None,
              x_div: int = 1, tokens: int = BN) -> None:
    """out float32 [R, N] = W · x[r // x_div], or W[ids[r]] · x[r // x_div]; x float32 [R', K].
    ``x_div`` > 1: rows share x (the MoE's k (token, expert) rows of a token: no copies)."""
    gemm_hmma_prepared(out, w, prepare_x(x, stream), ids, order, stream, tiles, x_div, tokens)


def gemm_hmma_ref(out, w: QWeight, x, ids=None, order=None, tiles=None, x_div: int = 1) -> None:
    """NumPy reference (order and tiles change the schedule, not the result)."""
    x = np.asarray(x)
    if x_div > 1:
        x = np.repeat(x, x_div, axis=0)[:out.shape[0]]
    gemv_ref(out, w, x, ids)


def prepare_x_ref(x):
    """(hi, lo float16 [R, K], sums float16 [R, K/8] (None unless K % 256 == 0), inverse
    scales float32 [R]) of prepare_x."""
    x = np.asarray(x, np.float32)
    m = np.abs(x).max(axis=1)
    e = np.maximum((m.view(np.uint32) >> 23) & 255, 14).astype(np.uint32)
    scale = ((268 - e) << 23).astype(np.uint32).view(np.float32)
    v = (x * scale[:, None]).astype(np.float32)
    hi = v.astype(np.float16)
    lo = (v - hi.astype(np.float32)).astype(np.float16)
    return hi, lo, _sums_ref(v), (np.float32(1) / scale).astype(np.float32)


def _sums_ref(v):
    """_store_sum's layout of the sums per 16 columns of v float32 [R, K]."""
    R, K = v.shape
    if K % 256:
        return None
    t = (v.reshape(R, K // 256, 16, 16).sum(axis=3, dtype=np.float32)[:, :, _Q2K_SC_ORDER]
         * np.float32(0.0625)).astype(np.float32)  # [R, super-block, position]
    hi = t.astype(np.float16)
    lo = (t - hi.astype(np.float32)).astype(np.float16)
    out = np.empty((R, K // 256, 4, 2, 4), np.float16)  # [.., c, limb, j]: position 4c + j
    out[:, :, :, 0] = hi.reshape(R, K // 256, 4, 4)
    out[:, :, :, 1] = lo.reshape(R, K // 256, 4, 4)
    return out.reshape(R, K // 8)


# ---- CI lane B and benchmarks --------------------------------------------------------------------
_PLANES = {
    GGMLType.Q8_0: "Tuple((uint64[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.F16: "UniTuple(uint64[:, :, ::1], 1)",
    GGMLType.Q2_K: "Tuple((uint64[:, :, ::1], uint32[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.IQ2_XXS: "Tuple((uint64[:, :, ::1], float16[:, :, ::1]))",
}
PTX_SIGNATURES = [
    (kern, f"void(float32[:, ::1], {_PLANES[qt]}, uint64[:, ::1], uint64[:, ::1], "
           "uint64[:, ::1], float32[::1], int32[::1], int32[::1], int32[:, ::1], uint64[::1], "
           "int64, int64, int64, int64)")
    for kernels in (_KERNELS, KERNELS_2, KERNELS_T64) for qt, kern in kernels.items()] + [
    (_prep_x, "void(float16[:, ::1], float16[:, ::1], float16[:, ::1], float32[::1], "
              "float32[:, ::1], int32[::1], float32)"),
    (_prep_x_swiglu, "void(float16[:, ::1], float16[:, ::1], float16[:, ::1], float32[::1], "
                     "float32[:, ::1], float32[::1], float32)")] + [
    (kern, "void(float16[:, ::1], float16[:, ::1], float16[:, ::1], float32[::1], "
           "float32[:, :, ::1], int32[::1], float32)")
    for kern in (_prep_x_group_major, _prep_x_token_major)]


def bench_cases(stream) -> list[BenchCase]:
    """A 1,024-token prefill chunk at V4-Flash shapes, beside mma.py's bf16 kernels on the
    same data: q_b and out_b (Q8_0, dense), the indexer's q_b and the router (F16), the
    routed experts' gate+up (IQ2_XXS) and down (Q2_K) over 6,144 (token, expert) rows of 256
    experts in expert_order's tiles."""
    from . import gemv_lowbit
    from .gemv import _dense_bench_arrays, _TYPES
    from .mma import expert_order, gemm_mma
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
        cases.append(BenchCase("hmma", label, fn, nbytes, flops, check=check))

    for qt, name, N, K in ((GGMLType.Q8_0, "attn_q_b", 32768, 1024),
                           (GGMLType.Q8_0, "attn_output_b", 4096, 8192),
                           (GGMLType.F16, "indexer.attn_q_b", 8192, 1024),
                           (GGMLType.F16, "ffn_gate_inp", 256, 4096)):
        host, dev, xh, x, out = _dense_bench_arrays(qt, N, K, T, rng, stream)
        nb, fl = dev.nbytes + 4 * T * (N + K), 2 * T * N * K
        other = "bf16 codes" if qt == GGMLType.Q8_0 else "bf16 split"
        for how, f16 in (("gemm_hmma", True), (f"gemm_mma ({other})", False)):
            case(f"{how} {_TYPES[qt].name} {name} {T} tok x {N}x{K}",
                 lambda out=out, dev=dev, x=x, f16=f16: gemm_mma(out, dev, x, stream=stream,
                                                                 f16=f16),
                 nb, fl, host, xh, out)
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

        def f16(out=out, dev=dev, x=x, x_div=x_div):
            expert_order(order, ids, E, stream, tiles=tiles)
            gemm_hmma(out, dev, x, ids, order, stream, tiles=tiles, x_div=x_div)

        def bf16(out=out, dev=dev, x_rep=x_rep):
            expert_order(order, ids, E, stream, tiles=tiles)
            gemm_mma(out, dev, x_rep, ids, order, stream, tiles=tiles, f16=False)
        touched = len(np.unique(ids_h))
        nb = touched * dev.nbytes // E + 4 * T * k * (N + K)
        for how, fn in (("gemm_hmma", f16), ("gemm_mma (bf16 codes)", bf16)):
            case(f"{how} expert tiles {spec.name} experts {T}x{k} rows x {N}x{K}", fn, nb,
                 2 * T * k * N * K, host, xh, out, ids_h, x_div, rows=12)
    # a 2,048-token chunk: the dense Q8_0 q_b and out_b, then the routed experts (~48 rows an
    # expert), on the 32-token build (32-row expert tiles) against KERNELS_T64 (64-row ones)
    T2 = 2048
    for name, N, K in (("attn_q_b", 32768, 1024), ("attn_output_b", 4096, 8192)):
        host, dev, xh, x, out = _dense_bench_arrays(GGMLType.Q8_0, N, K, T2, rng, stream)
        for tok in (BN, 64):
            case(f"gemm_hmma {tok}-token tiles q8_0 {name} {T2} tok x {N}x{K}",
                 lambda out=out, dev=dev, x=x, tok=tok: gemm_hmma(out, dev, x, stream=stream,
                                                                 tokens=tok),
                 dev.nbytes + 4 * T2 * (N + K), 2 * T2 * N * K, host, xh, out)
    ids2_h = np.stack([rng.choice(E, k, replace=False) for _ in range(T2)]).astype(np.int32)
    ids2 = cuda.to_device(ids2_h.ravel(), stream=stream)
    order2 = cuda.device_array(T2 * k, np.int32, stream=stream)
    for qtype, N, K, x_div in ((GGMLType.IQ2_XXS, 4096, 4096, k), (GGMLType.Q2_K, 4096, 2048, 1)):
        host, dev = gemv_lowbit._bench_weight(qtype, E, N, K, rng, distinct=8)
        out = cuda.device_array((T2 * k, N), np.float32, stream=stream)
        xh = rng.standard_normal((T2 * k // x_div, K)).astype(np.float32)
        x = cuda.to_device(xh, stream=stream)
        nb = len(np.unique(ids2_h)) * dev.nbytes // E + 4 * T2 * k * (N + K)
        for tok in (BN, 64):
            tl = cuda.device_array((2, expert_tiles_capacity(T2 * k, E, tok)), np.int32,
                                   stream=stream)

            def fn(tok=tok, tl=tl, dev=dev, x=x, x_div=x_div, out=out):
                expert_order(order2, ids2, E, stream, tiles=tl, tile=tok)
                gemm_hmma(out, dev, x, ids2, order2, stream, tiles=tl, x_div=x_div, tokens=tok)
            case(f"gemm_hmma {tok}-token tiles {GGMLType(qtype).name.lower()} experts "
                 f"{T2}x{k} rows x {N}x{K}", fn, nb, 2 * T2 * k * N * K, host, xh, out,
                 ids2_h.ravel(), x_div, rows=12)
    return cases
