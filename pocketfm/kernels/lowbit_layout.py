"""The device layout of the low-bit GGUF types (Q2_K, Q4_K, IQ2_XXS, MXFP4) for gemv_lowbit:
packing on the host (``pack_<t>`` / ``unpack_<t>``; the plane table is in gemv_lowbit's
docstring) and reading it in registers on the device.

Device functions per type ``<t>`` over the planes:
- ``_<t>_elem(planes, e, n, k)``: element k of row n of expert e as float32 (naive kernel);
- ``_<t>_word(planes, e, n, c)``: columns 4c .. 4c+3 as 4 float32 (GEMM tile fill);
- ``_<t>_xcol(sl, k)`` and ``_<t>_dot(...)``: the decode kernel's 16-byte slots, dotted with
  int16 x in integer arithmetic (``dp4a``).
The float paths follow quants.py's (ggml's) float32 operation order. PTX instructions numba does
not expose (dp4a, prmt, float bit casts) are inline-asm intrinsics on the GPU and plain Python in
the simulator.
"""
from __future__ import annotations

import math
import struct

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .. import quants
from ..quants import GGMLType, IQ2_XXSBlock, MXFP4Block, Q2_KBlock, Q4_KBlock
from .device import SIMULATOR
from .qweight import QWeight

# Copies of the IQ2_XXS grid in shared memory (16 KB): lane l reads copy l % REPS, which sits in
# its own bank pair, so of the 16 lanes of a half-warp (one 8-byte shared load wavefront) at most
# two share a bank pair. On the H200, 8 and 16 copies measured the same. Only the index
# arithmetic matters in the simulator (no banks), where fewer copies keep the table fill cheap.
GRID_REPS = 2 if SIMULATOR else 8
IQ2_TABLE_WORDS = GRID_REPS * 256  # uint64 words: the grid rows' magnitudes

# ---- tables ---------------------------------------------------------------------------------
# IQ2_XXS grid rows as 8 magnitude bytes (8, 25 or 43) in a little-endian uint64 (the decode dot
# applies the signs itself).
_GRID_F32 = quants.IQ2XXS_GRID  # [256, 8] float32
_GRID_U64 = quants.IQ2XXS_GRID.astype(np.uint8).view("<u8").reshape(256)
_KSIGNS = quants.KSIGNS_IQ2XS  # [128] uint8
_KVALUES_F32 = quants.KVALUES_MXFP4.astype(np.float32)  # [16] doubled e2m1 values
# The doubled e2m1 values as int8 bytes: codes 0..7 in (T0, T1), codes 8..15 (negated) in (T2, T3).
_KV_WORDS = quants.KVALUES_MXFP4.view(np.uint8).view("<u4").astype(np.int64)
_KV0, _KV1, _KV2, _KV3 = (int(v) for v in _KV_WORDS)



# ---- device layout ----------------------------------------------------------------------------
def _blocks(raw: np.ndarray, rows: int, cols: int, record) -> tuple[int, np.ndarray]:
    """GGUF data uint8 [E?, N, K/elems*bytes] -> (E, blocks uint8 [E*N*K/elems, bytes])."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    row_bytes = cols // record.ELEMS * record.BYTES
    if cols % record.ELEMS or raw.shape[-1] != row_bytes or raw.size % (rows * row_bytes):
        raise ValueError(f"raw {raw.shape} is not [E?, {rows}, {row_bytes}]")
    return raw.size // (rows * row_bytes), raw.reshape(-1, record.BYTES)


def _plane(a: np.ndarray, dtype, E: int, N: int) -> np.ndarray:
    """Per-block fields [B, k] -> one contiguous plane [E, N, S*k / itemsize] of ``dtype``."""
    return np.ascontiguousarray(a).view(dtype).reshape(E, N, -1)


# Q2_K scale bytes in lane-slot order: word 2h+u holds sub-blocks 8h + 2j + u for j = 0..3.
_Q2K_SC_ORDER = np.array([8 * h + 2 * j + u for h in range(2) for u in range(2)
                          for j in range(4)])
_Q2K_SC_INVERSE = np.argsort(_Q2K_SC_ORDER)


def pack_q2_k(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """Q2_K data [E?, N, S*84] -> QWeight planes (qs uint64, sc uint32, dm f16), module doc."""
    E, blocks = _blocks(raw, rows, cols, Q2_KBlock)
    b = Q2_KBlock.from_bytes(blocks)
    planes = (_plane(b.qs, "<u8", E, rows), _plane(b.scales[:, _Q2K_SC_ORDER], "<u4", E, rows),
              _plane(np.concatenate([b.d, b.dmin], axis=1), "<f2", E, rows))
    return QWeight(GGMLType.Q2_K, rows, cols, E, planes)


def unpack_q2_k(w: QWeight) -> np.ndarray:
    """Inverse of pack_q2_k: the GGUF bytes uint8 [E, N, S*84]."""
    qs, sc, dm = (np.asarray(p) for p in w.planes)
    n = qs.size // 8
    dm = dm.reshape(n, 2)
    b = Q2_KBlock(sc.view(np.uint8).reshape(n, 16)[:, _Q2K_SC_INVERSE],
                  qs.view(np.uint8).reshape(n, 64), dm[:, :1], dm[:, 1:])
    return b.to_bytes().reshape(w.experts, w.rows, -1)


def pack_q4_k(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """Q4_K data [E?, N, S*144] -> QWeight planes (qs uint64, sc uint32, dm f16), module doc."""
    E, blocks = _blocks(raw, rows, cols, Q4_KBlock)
    b = Q4_KBlock.from_bytes(blocks)
    sc, mn = Q4_KBlock.unpack_scales(b.scales)  # [B, 8] each
    words = np.stack([sc[:, 0::2], sc[:, 1::2], mn[:, 0::2], mn[:, 1::2]], axis=2)  # [B, 4, 4]
    planes = (_plane(b.qs, "<u8", E, rows), _plane(words.astype(np.uint8), "<u4", E, rows),
              _plane(np.concatenate([b.d, b.dmin], axis=1), "<f2", E, rows))
    return QWeight(GGMLType.Q4_K, rows, cols, E, planes)


def unpack_q4_k(w: QWeight) -> np.ndarray:
    """Inverse of pack_q4_k: the GGUF bytes uint8 [E, N, S*144]."""
    qs, scw, dm = (np.asarray(p) for p in w.planes)
    n = qs.size // 16
    words = scw.view(np.uint8).reshape(n, 4, 4)
    sc = np.stack([words[:, :, 0], words[:, :, 1]], axis=2).reshape(n, 8)
    mn = np.stack([words[:, :, 2], words[:, :, 3]], axis=2).reshape(n, 8)
    dm = dm.reshape(n, 2)
    b = Q4_KBlock(dm[:, :1], dm[:, 1:], Q4_KBlock.pack_scales(sc, mn),
                  qs.view(np.uint8).reshape(n, 128))
    return b.to_bytes().reshape(w.experts, w.rows, -1)


def pack_iq2_xxs(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """IQ2_XXS data [E?, N, S*66] -> QWeight planes (qs uint64, d f16), module doc."""
    E, blocks = _blocks(raw, rows, cols, IQ2_XXSBlock)
    planes = (_plane(blocks[:, 2:], "<u8", E, rows), _plane(blocks[:, :2], "<f2", E, rows))
    return QWeight(GGMLType.IQ2_XXS, rows, cols, E, planes)


def unpack_iq2_xxs(w: QWeight) -> np.ndarray:
    """Inverse of pack_iq2_xxs: the GGUF bytes uint8 [E, N, S*66]."""
    qs, d = (np.asarray(p) for p in w.planes)
    n = d.size
    raw = np.concatenate([d.view(np.uint8).reshape(n, 2), qs.view(np.uint8).reshape(n, 64)], 1)
    return raw.reshape(w.experts, w.rows, -1)


def pack_mxfp4(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """MXFP4 data [E?, N, K/32*17] -> QWeight planes (qs uint64, e uint8), module doc."""
    E, blocks = _blocks(raw, rows, cols, MXFP4Block)
    planes = (_plane(blocks[:, 1:], "<u8", E, rows), _plane(blocks[:, :1], np.uint8, E, rows))
    return QWeight(GGMLType.MXFP4, rows, cols, E, planes)


def unpack_mxfp4(w: QWeight) -> np.ndarray:
    """Inverse of pack_mxfp4: the GGUF bytes uint8 [E, N, K/32*17]."""
    qs, e = (np.asarray(p) for p in w.planes)
    n = e.size
    raw = np.concatenate([e.reshape(n, 1), qs.view(np.uint8).reshape(n, 16)], axis=1)
    return raw.reshape(w.experts, w.rows, -1)


# ---- register-level helpers -------------------------------------------------------------------
# dp4a (4 int8 products summed into an int32), prmt (byte permute) and the float32 bit pattern
# are one PTX instruction each; numba exposes none of them. On the GPU they are inline-asm
# intrinsics; in the simulator plain Python computes the same thing.
if SIMULATOR:
    _I8X4, _U8X4 = struct.Struct("<4b"), struct.Struct("<4B")

    def _bytes4(v, fmt):
        return fmt.unpack((int(v) & 0xFFFFFFFF).to_bytes(4, "little"))

    def _dp4a_ss(a, b, c):
        """c + sum_k int8(a_k) * int8(b_k) over the 4 bytes of a and b."""
        (a0, a1, a2, a3), (b0, b1, b2, b3) = _bytes4(a, _I8X4), _bytes4(b, _I8X4)
        return np.int32(int(c) + a0 * b0 + a1 * b1 + a2 * b2 + a3 * b3)

    def _dp4a_su(a, b, c):
        """c + sum_k int8(a_k) * uint8(b_k)."""
        (a0, a1, a2, a3), (b0, b1, b2, b3) = _bytes4(a, _I8X4), _bytes4(b, _U8X4)
        return np.int32(int(c) + a0 * b0 + a1 * b1 + a2 * b2 + a3 * b3)

    def _prmt(a, b, sel):
        """PTX prmt.b32 (default mode): byte k of the result is byte sel_k & 7 of (b:a),
        or its sign replicated when sel_k & 8."""
        src = (int(a) & 0xFFFFFFFF) | ((int(b) & 0xFFFFFFFF) << 32)
        r = 0
        for k in range(4):
            s = (int(sel) >> (4 * k)) & 15
            byte = (src >> (8 * (s & 7))) & 255
            r |= ((255 if byte & 128 else 0) if s & 8 else byte) << (8 * k)
        return np.uint32(r)

    def _f32_bits(f):
        """The bit pattern of float32 ``f`` as uint32."""
        return np.float32(f).view(np.uint32)

    def _ld_u64x2(a, e, n, j):
        """a[e, n, j], a[e, n, j + 1] (on the GPU one 16-byte ld.global.nc; j even)."""
        return a[e, n, j], a[e, n, j + 1]

    def _flat(a, off):
        """The element of C-contiguous 3-d ``a`` at flat offset ``off``."""
        _, n1, n2 = a.shape
        return a[off // (n1 * n2), (off // n2) % n1, off % n2]

    def _ld_u64x2_flat(a, off):
        """a.flat[off], a.flat[off + 1] (on the GPU one 16-byte ld.global.nc; off even)."""
        return _flat(a, off), _flat(a, off + 1)

    def _ld_flat(a, off):
        """a.flat[off] of a C-contiguous array (on the GPU one load from a multiply-add)."""
        return _flat(a, off)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _asm_intrinsic(ptx: str, result):
        """An intrinsic for one PTX instruction on three 32-bit registers ($0 = result)."""
        @intrinsic
        def op(typingctx, a, b, c):
            if not all(isinstance(v, types.Integer) for v in (a, b, c)):
                return None

            def codegen(context, builder, sig, args):
                i32 = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
                fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 3)
                return builder.call(ir.InlineAsm(fnty, ptx, "=r,r,r,r"), i32)
            return result(a, b, c), codegen
        return op

    _dp4a_ss = _asm_intrinsic("dp4a.s32.s32 $0, $1, $2, $3;", types.int32)
    _dp4a_su = _asm_intrinsic("dp4a.s32.u32 $0, $1, $2, $3;", types.int32)
    _prmt = _asm_intrinsic("prmt.b32 $0, $1, $2, $3;", types.uint32)

    @intrinsic
    def _f32_bits(typingctx, f):
        if f != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(f), codegen

    @intrinsic
    def _ld_u64x2(typingctx, a, e, n, j):
        """a[e, n, j], a[e, n, j + 1] in one 16-byte read-only load (16-byte aligned: j even
        and the row length even, which the packed planes guarantee)."""
        if not (isinstance(a, types.Array) and a.ndim == 3 and a.dtype == types.uint64):
            return None

        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, value=args[0])
            inds = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, inds)
            fnty = ir.FunctionType(ir.LiteralStructType([ir.IntType(64)] * 2), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.global.nc.v2.u64 {$0, $1}, [$2];", "=l,=l,l")
            v = builder.call(asm, [ptr])
            return cgutils.pack_array(builder, [builder.extract_value(v, i) for i in range(2)])
        return types.UniTuple(types.uint64, 2)(a, e, n, j), codegen

    def _flat_ptr(context, builder, aryty, ary, off, offty):
        # the address of C-contiguous ``ary``'s element at flat offset ``off`` (unsigned: one
        # widening multiply-add, where indexing by (e, n, j) takes 64-bit strides and adds)
        arr = context.make_array(aryty)(context, builder, value=ary)
        i64 = context.cast(builder, off, offty, types.uint64)
        return builder.gep(arr.data, [i64])

    @intrinsic
    def _ld_u64x2_flat(typingctx, a, off):
        """a.flat[off], a.flat[off + 1] of C-contiguous uint64 ``a`` in one 16-byte read-only
        load (off even, unsigned: a uint32 offset is one multiply-add from the base)."""
        if not (isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.uint64
                and isinstance(off, types.Integer) and not off.signed):
            return None

        def codegen(context, builder, sig, args):
            ptr = _flat_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([ir.IntType(64)] * 2), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.global.nc.v2.u64 {$0, $1}, [$2];", "=l,=l,l")
            v = builder.call(asm, [ptr])
            return cgutils.pack_array(builder, [builder.extract_value(v, i) for i in range(2)])
        return types.UniTuple(types.uint64, 2)(a, off), codegen

    @intrinsic
    def _ld_flat(typingctx, a, off):
        """a.flat[off] of C-contiguous ``a`` (any element type; unsigned off: one multiply-add
        from the base, where (e, n, j) indexing takes 64-bit strides, adds and the
        wrap-around of signed indices)."""
        if not (isinstance(a, types.Array) and a.layout == "C"
                and isinstance(off, types.Integer) and not off.signed):
            return None

        def codegen(context, builder, sig, args):
            return builder.load(_flat_ptr(context, builder, sig.args[0], args[0], args[1],
                                          sig.args[1]))
        return a.dtype(a, off), codegen


@cuda.jit(device=True)
def _half(w, k):
    """32-bit half k (0 low, 1 high) of a uint64 word, as uint32."""
    return uint32((w >> uint64(32 * k)) & uint64(0xFFFFFFFF))


# ---- scalar dequantisers (naive kernel): element k of row n of expert e, float32 ----------------
# Same float32 operation order as quants.py (which follows ggml).
@cuda.jit(device=True)
def _q2_k_elem(planes, e, n, k):
    qs, sc, dm = planes
    s, i = k >> 8, k & 255
    h, j, l = i >> 7, (i >> 5) & 3, i & 31
    byte = int32((qs[e, n, s * 8 + ((32 * h + l) >> 3)] >> uint64(8 * (l & 7))) & uint64(255))
    q = (byte >> (2 * j)) & 3
    sb = int32((sc[e, n, s * 4 + 2 * h + (l >> 4)] >> uint32(8 * j)) & uint32(255))
    dl = float32(dm[e, n, 2 * s]) * float32(sb & 15)
    return dl * float32(q) - float32(dm[e, n, 2 * s + 1]) * float32(sb >> 4)


@cuda.jit(device=True)
def _q4_k_elem(planes, e, n, k):
    qs, sc, dm = planes
    s, i = k >> 8, k & 255
    p, half, l = i >> 6, (i >> 5) & 1, i & 31
    byte = int32((qs[e, n, s * 16 + ((32 * p + l) >> 3)] >> uint64(8 * (l & 7))) & uint64(255))
    q = (byte >> (4 * half)) & 15
    scw = int32(sc[e, n, s * 4 + p])
    dl = float32(dm[e, n, 2 * s]) * float32((scw >> (8 * half)) & 255)
    ml = float32(dm[e, n, 2 * s + 1]) * float32((scw >> (16 + 8 * half)) & 255)
    return dl * float32(q) - ml


@cuda.jit(device=True)
def _iq2_xxs_elem(planes, e, n, k):
    qs, d = planes
    grid = cuda.const.array_like(_GRID_F32)
    ksigns = cuda.const.array_like(_KSIGNS)
    w = qs[e, n, k >> 5]
    sub, kk = (k >> 3) & 3, k & 7
    idx = int32((_half(w, 0) >> uint32(8 * sub)) & uint32(255))
    sw = _half(w, 1)
    sign = int32(ksigns[int32((sw >> uint32(7 * sub)) & uint32(127))])
    db = float32(d[e, n, k >> 8]) * (float32(0.5) + float32(sw >> uint32(28))) * float32(0.25)
    v = db * grid[idx, kk]
    return -v if (sign >> kk) & 1 else v


@cuda.jit(device=True)
def _mxfp4_scale(eb):
    """2^(e - 128): the halved ue8m0 scale that goes with the doubled e2m1 table."""
    return float32(math.ldexp(float32(1.0), int(eb) - 128))


@cuda.jit(device=True)
def _mxfp4_elem(planes, e, n, k):
    qs, eb = planes
    kv = cuda.const.array_like(_KVALUES_F32)
    blk, i = k >> 5, k & 31
    bi = i & 15
    byte = int32((qs[e, n, blk * 2 + (bi >> 3)] >> uint64(8 * (bi & 7))) & uint64(255))
    return _mxfp4_scale(eb[e, n, blk]) * kv[(byte >> (4 * (i >> 4))) & 15]


# ---- word dequantisers (GEMM tiles): columns 4c .. 4c+3 of row n, as 4 float32 -----------------
@cuda.jit(device=True)
def _q2_k_word(planes, e, n, c):
    qs, sc, dm = planes
    k = 4 * c
    s, i = k >> 8, k & 255
    h, j, l = i >> 7, (i >> 5) & 3, i & 31
    w = _half(qs[e, n, s * 8 + ((32 * h + l) >> 3)], (l >> 2) & 1) >> uint32(2 * j)
    sb = int32((sc[e, n, s * 4 + 2 * h + (l >> 4)] >> uint32(8 * j)) & uint32(255))
    dl = float32(dm[e, n, 2 * s]) * float32(sb & 15)
    ml = float32(dm[e, n, 2 * s + 1]) * float32(sb >> 4)
    return (dl * float32(w & uint32(3)) - ml, dl * float32((w >> uint32(8)) & uint32(3)) - ml,
            dl * float32((w >> uint32(16)) & uint32(3)) - ml,
            dl * float32((w >> uint32(24)) & uint32(3)) - ml)


@cuda.jit(device=True)
def _q4_k_word(planes, e, n, c):
    qs, sc, dm = planes
    k = 4 * c
    s, i = k >> 8, k & 255
    p, half, l = i >> 6, (i >> 5) & 1, i & 31
    w = _half(qs[e, n, s * 16 + ((32 * p + l) >> 3)], (l >> 2) & 1) >> uint32(4 * half)
    scw = int32(sc[e, n, s * 4 + p])
    dl = float32(dm[e, n, 2 * s]) * float32((scw >> (8 * half)) & 255)
    ml = float32(dm[e, n, 2 * s + 1]) * float32((scw >> (16 + 8 * half)) & 255)
    m = uint32(15)
    return (dl * float32(w & m) - ml, dl * float32((w >> uint32(8)) & m) - ml,
            dl * float32((w >> uint32(16)) & m) - ml, dl * float32((w >> uint32(24)) & m) - ml)


@cuda.jit(device=True)
def _iq2_xxs_word(planes, e, n, c):
    qs, d = planes
    grid = cuda.const.array_like(_GRID_F32)
    ksigns = cuda.const.array_like(_KSIGNS)
    k = 4 * c
    w = qs[e, n, k >> 5]
    sub, k0 = (k >> 3) & 3, k & 4
    idx = int32((_half(w, 0) >> uint32(8 * sub)) & uint32(255))
    sw = _half(w, 1)
    sign = int32(ksigns[int32((sw >> uint32(7 * sub)) & uint32(127))]) >> k0
    db = float32(d[e, n, k >> 8]) * (float32(0.5) + float32(sw >> uint32(28))) * float32(0.25)
    v0, v1 = db * grid[idx, k0], db * grid[idx, k0 + 1]
    v2, v3 = db * grid[idx, k0 + 2], db * grid[idx, k0 + 3]
    return (-v0 if sign & 1 else v0, -v1 if sign & 2 else v1,
            -v2 if sign & 4 else v2, -v3 if sign & 8 else v3)


@cuda.jit(device=True)
def _mxfp4_word(planes, e, n, c):
    qs, eb = planes
    kv = cuda.const.array_like(_KVALUES_F32)
    k = 4 * c
    blk, i = k >> 5, k & 31
    bi = i & 15
    w = int32(_half(qs[e, n, blk * 2 + (bi >> 3)], (bi >> 2) & 1) >> uint32(4 * (i >> 4)))
    sc = _mxfp4_scale(eb[e, n, blk])
    return (sc * kv[w & 15], sc * kv[(w >> 8) & 15], sc * kv[(w >> 16) & 15],
            sc * kv[(w >> 24) & 15])


# ---- decode slots: the 16 quant bytes a lane owns in each row -----------------------------------
# A slot is words 2*sl, 2*sl+1 of the row's qs plane (the same for every type). ``<t>_xcol(sl, k)``
# is the first of the 4 columns that x word k of slot sl pairs with. ``<t>_aux(planes, e, n, sl)``
# loads the rest of what the slot needs from the other planes, as (u, fa, fb): a scale word and
# two float scales (0 where unused), so that the kernel may request them a step ahead with the
# quant words (gemv_lowbit's ``aux_ahead``, chosen per type as measured). ``<t>_dot`` takes the
# two words, the aux and the lane's x registers and returns the slot's partial dot product in
# units of the x scale. Integer sums stay far below 2^31 (bounds beside each).
@cuda.jit(device=True)
def _q2_k_xcol(sl, k):
    # slot sl = super-block sl >> 2, lane slot 2h + u; x word k = 4j + v: columns
    # 128h + 32j + 16u + 4v, the elements whose codes sit in bits 2j of qs word 8h + 4u + v.
    return 256 * (sl >> 2) + 128 * ((sl >> 1) & 1) + 32 * (k >> 2) + 16 * (sl & 1) + 4 * (k & 3)


@cuda.jit(device=True)
def _q2_k_aux(planes, e, n, sl):
    qs, sc, dm = planes
    s = sl >> 2
    return sc[e, n, sl], float32(dm[e, n, 2 * s]), float32(dm[e, n, 2 * s + 1])


@cuda.jit(device=True)
def flat_at(row, cols, col):
    """row · cols + col in uint32 (numba widens uint32 arithmetic to 64 bits: each step cast
    back, so that the offset is one 32-bit multiply-add)."""
    return uint32(uint32(uint32(row) * uint32(cols)) + uint32(col))


@cuda.jit(device=True)
def _q2_k_aux_flat(planes, fr, sl):
    # _q2_k_aux of flat row fr = e · N + n (uint32) by flat offsets (the dp4a kernel's flat
    # build: its elements < 2^32)
    qs, sc, dm = planes
    at = flat_at(fr, dm.shape[2], 2 * (sl >> 2))
    return (_ld_flat(sc, flat_at(fr, sc.shape[2], sl)), float32(_ld_flat(dm, at)),
            float32(_ld_flat(dm, uint32(at + uint32(1)))))


@cuda.jit(device=True)
def _q2_k_dot(scw, d, dmin, wa, wb, xh, xl, xsum, tab, lane):
    isc = int32(0)  # sum_j sc_j * (x . q)_j   <= 4 * 15 * 16 * 3 * 32767 = 9.4e7
    imn = int32(0)  # sum_j mn_j * sum(x)_j    <= 4 * 15 * 16 * 32767
    for j in range(4):
        hi = int32(0)
        lo = int32(0)
        for v in range(4):
            c = (_half(wa if v < 2 else wb, v & 1) >> uint32(2 * j)) & uint32(0x03030303)
            hi = _dp4a_ss(c, xh[4 * j + v], hi)
            lo = _dp4a_su(c, xl[4 * j + v], lo)
        sb = int32((scw >> uint32(8 * j)) & uint32(255))
        isc += (sb & 15) * (hi * 256 + lo)
        imn += (sb >> 4) * xsum[j]
    return d * float32(isc) - dmin * float32(imn)


@cuda.jit(device=True)
def _q4_k_xcol(sl, k):
    # slot sl = super-block sl >> 3, qs bytes 32p + 16u..+16 (lane slot 2p + u); x word
    # k = 4*half + v: columns 64p + 32*half + 16u + 4v (low nibbles: half 0).
    return 256 * (sl >> 3) + 64 * ((sl >> 1) & 3) + 32 * (k >> 2) + 16 * (sl & 1) + 4 * (k & 3)


@cuda.jit(device=True)
def _q4_k_aux(planes, e, n, sl):
    qs, sc, dm = planes
    s = sl >> 3
    return sc[e, n, sl >> 1], float32(dm[e, n, 2 * s]), float32(dm[e, n, 2 * s + 1])


@cuda.jit(device=True)
def _q4_k_dot(scw, d, dmin, wa, wb, xh, xl, xsum, tab, lane):
    isc = int32(0)  # <= 2 * 63 * 16 * 15 * 32767 = 9.9e8
    imn = int32(0)
    for half in range(2):
        hi = int32(0)
        lo = int32(0)
        for v in range(4):
            c = (_half(wa if v < 2 else wb, v & 1) >> uint32(4 * half)) & uint32(0x0F0F0F0F)
            hi = _dp4a_ss(c, xh[4 * half + v], hi)
            lo = _dp4a_su(c, xl[4 * half + v], lo)
        isc += int32((scw >> uint32(8 * half)) & uint32(255)) * (hi * 256 + lo)
        imn += int32((scw >> uint32(16 + 8 * half)) & uint32(255)) * xsum[half]
    return d * float32(isc) - dmin * float32(imn)


@cuda.jit(device=True)
def _iq2_xxs_xcol(sl, k):
    return 64 * sl + 4 * k  # two groups of 32, in order


@cuda.jit(device=True)
def _iq2_xxs_aux(planes, e, n, sl):
    qs, d = planes
    return uint32(0), float32(d[e, n, sl >> 2]), float32(0)


@cuda.jit(device=True)
def _sign_bits(s):
    """The low 4 bits of s spread to the low bit of 4 bytes (byte k: bit k)."""
    return uint32(((s & uint32(15)) * uint32(0x00204081)) & uint32(0x01010101))


@cuda.jit(device=True)
def _iq2_xxs_signed(mag, sw, i):
    """Grid row i of a 32-column IQ2_XXS block as signed code bytes (int8 in two uint32):
    ``mag`` its 8 magnitude bytes, ``sw`` the block's sign / scale word (see _iq2_xxs_dot)."""
    s7 = (sw >> uint32(7 * i)) & uint32(127)
    s8 = s7 | ((uint32(cuda.popc(s7)) & uint32(1)) << uint32(7))
    b0 = _sign_bits(s8)
    b1 = _sign_bits(s8 >> uint32(4))
    return (uint32((_half(mag, 0) ^ (b0 * uint32(255))) + b0),
            uint32((_half(mag, 1) ^ (b1 * uint32(255))) + b1))


@cuda.jit(device=True)
def _iq2_xxs_dot(u, d, unused, wa, wb, xh, xl, xsum, tab, lane):
    # tab: the grid rows' magnitude bytes g (8, 25 or 43), GRID_REPS copies apart. The signs are
    # made in registers (no table: shared-memory lookups were the kernel's main stall): the
    # 7-bit sign index s gets its parity bit (an even count of minus signs), each half's 4 bits
    # are spread to the low bit of 4 bytes (x 0x00204081: no two shifted copies overlap, so no
    # carries), and a byte with its bit set becomes -g = (g ^ 0xFF) + 1 (no carry out: g > 0).
    # Each half of a grid row has its own pair of dp4a sums: four chains 4 deep instead of two
    # 8 deep (H200, 6 experts' gate+up: 34.3 -> 28.8 µs, the same sums exactly).
    acc = float32(0)
    grow = lane % GRID_REPS
    for g in range(2):
        w = wa if g == 0 else wb
        idx4 = _half(w, 0)
        sw = _half(w, 1)
        hi0 = int32(0)  # each <= 16 * 43 * 128
        lo0 = int32(0)
        hi1 = int32(0)
        lo1 = int32(0)
        for i in range(4):
            mag = tab[int32((idx4 >> uint32(8 * i)) & uint32(255)) * GRID_REPS + grow]
            c0, c1 = _iq2_xxs_signed(mag, sw, i)
            hi0 = _dp4a_ss(c0, xh[8 * g + 2 * i], hi0)
            lo0 = _dp4a_su(c0, xl[8 * g + 2 * i], lo0)
            hi1 = _dp4a_ss(c1, xh[8 * g + 2 * i + 1], hi1)
            lo1 = _dp4a_su(c1, xl[8 * g + 2 * i + 1], lo1)
        db = d * (float32(0.5) + float32(sw >> uint32(28))) * float32(0.25)
        # (int32: the sum fits, |.| <= 2 * 16 * 43 * 32767; Numba would widen it to int64 and
        # convert from there, a few instructions more a group)
        acc += db * float32(int32((hi0 + hi1) * 256 + lo0 + lo1))
    return acc


@cuda.jit(device=True)
def _mxfp4_xcol(sl, k):
    return 32 * sl + 16 * (k >> 2) + 4 * (k & 3)  # low nibbles are elements 0..15


@cuda.jit(device=True)
def _mxfp4_aux(planes, e, n, sl):
    qs, eb = planes
    return uint32(0), _mxfp4_scale(eb[e, n, sl]), float32(0)


@cuda.jit(device=True)
def _mxfp4_dot(u, scale, unused, wa, wb, xh, xl, xsum, tab, lane):
    hi = int32(0)  # <= 32 * 12 * 128
    lo = int32(0)
    for half in range(2):
        for v in range(4):
            c = (_half(wa if v < 2 else wb, v & 1) >> uint32(4 * half)) & uint32(0x0F0F0F0F)
            # 3-bit indices as a prmt selector (one nibble per byte), then the value bytes from
            # the positive (codes 0-7) or negated (8-15) half of the table, by bit 3
            i3 = c & uint32(0x07070707)
            y = i3 | (i3 >> uint32(4))
            sel = (y & uint32(0xFF)) | ((y >> uint32(8)) & uint32(0xFF00))
            neg = ((c >> uint32(3)) & uint32(0x01010101)) * uint32(255)
            val = (_prmt(_KV0, _KV1, sel) & ~neg) | (_prmt(_KV2, _KV3, sel) & neg)
            hi = _dp4a_ss(val, xh[4 * half + v], hi)
            lo = _dp4a_su(val, xl[4 * half + v], lo)
    return scale * float32(hi * 256 + lo)
