"""Fused dequant + GEMV / GEMM for F32, F16, BF16 and Q8_0 weights, and the type dispatcher.

out[T, N] = x[T, K] · W[N, K]ᵀ, or with ``ids`` int32 [T]: out[t] = W[ids[t]] · x[t]
(expert-indexed rows: the MoE runs its selected experts in one launch). Letters: T tokens,
N rows, K columns, E stacked experts. Each weight is repacked once at load (``pack_<type>``)
into 32-bit word planes, losslessly (same bytes as the GGUF blocks):

    F32   w  float32 [E, N, K]
    F16   w  int32   [E, N, K/2]     element 2j in the low half of word j
    BF16  w  int32   [E, N, K/2]     likewise
    Q8_0  qs int32   [E, N, K/4]     the int8 quants, element 4j + i in byte i of word j
          d  float16 [E, N, K/32]    the block scales

Kernels, picked by the launcher from T (``gemv_<t>(..., method=...)`` forces one):
- ``_gemv_<t>_block_per_row``: one block per (row, token), grid-stride over the row, block
  reduction. The obviously-right baseline (H200: 0.84 TB/s on Q8_0 4096 x 8192).
- ``_gemv_<t>_xregs_prefetch_splitk_b<B>`` (decode, T = B <= 4): each warp keeps its K-slice of
  x in registers for the whole launch (K split over the warps of a block, partial sums added in
  shared memory) and streams rows past it; each lane issues R x CPL independent 16-byte
  ``ld.global.nc.v4`` loads per step, and the next step's loads go out before this step's math.
  Blocks are persistent (grid-stride over row groups), so x is read once per block.
- ``_gemv_q8_0_dp4a_prefetch_splitk_b1`` (Q8_0 decode, one token per weight, weights of 16 M
  elements and more: the output head, attn_q_b / output_a / output_b, the shared expert's
  gate+up; see DP4A_MIN_ELEMENTS): the same with x split
  into three int8 limbs so that dp4a does the Q8_0 dot products at float32 accuracy (see
  ``_x_limbs``). ``_q8_0_x_limbs`` makes the limbs once per launch (a second, tiny launch);
  every block loads its lanes' limbs from that copy instead of quantising x itself. dp4a takes
  ~20 instructions per 16 weight bytes where the float kernel takes ~80. ``q8_0_limbs`` makes
  the limbs ahead of the GEMV (``gemv_q8_0(limbs=)``), optionally with an RMSNorm of x in the
  same launch (``_q8_0_x_limbs_norm``: the decode's q_a norm before q_b, on the layers without
  an indexer: 0.3% faster a step there, slower where q_b runs beside the indexer).
- ``_gemm_<t>_smem_tiles`` (prefill, T > 4): a shared-memory tiled SGEMM; each weight tile is
  dequantised once into shared memory and reused by a tile of tokens. On a GPU the launcher
  hands these shapes to the tensor-core GEMM of mma.py instead (bf16x3 MMAs, float32-exact to
  ~1e-5); the simulator keeps this kernel, and ``method="batched"`` still forces it.

The decode grids are one wave of the compiled kernel (``device.resident_blocks``): registers,
not threads, bound the blocks an SM holds (128 / 142 registers: 4 / 3 blocks of 128 threads).

Measured on the H200 (copy bandwidth 4.06 TB/s; graphs of 20 launches over >= 256 MB of weight
copies, so L2 serves nothing; 2026-12-02): Q8_0 decode 94% of copy bandwidth on the output head
(143.9 µs), 58% on attn_q_b 32768 x 1024 (15.1 µs), 49% on attn_output_b 4096 x 8192 (17.9
µs), 17% / 11% on the 4 MB / 2 MB attn_q_a / attn_kv (latency bound: a few µs whatever the
kernel); F32 74%, F16 / BF16 54% at 4096 x 4096. Naive Q8_0: 20%.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import numpy as np
from numba import cuda
from numba.types import float16

from ..quants import GGMLType, Q8_0Block, dequantize, random_blocks, type_name
from .bench import BenchCase
from .device import (SIMULATOR, block_sum, block_sum_warps, capture_graph, cdiv, kernel,
                     resident_blocks, sm_count, stream_buffer, warp_sum, xor_shfl)
from .lowbit_layout import _f32_bits
from .qweight import QWeight

DECODE_MAX_TOKENS = 4  # shared weights: up to this many tokens use the decode kernel
DECODE_MAX_IDS = 16  # expert-indexed: up to this many (token, expert) pairs run one by one
# The Q8_0 decode takes dp4a (x prepared by one more launch) for weights of at least this many
# elements (over all ids), the float kernel below: H200, graphs of 20, one wave (2026-12-02),
# dp4a / float µs: attn_q_b 32768 x 1024 15.1 / 17.5, output head 143.9 / 180.8, attn_output_b
# 4096 x 8192 17.9 / 19.5, shared gate+up 4096 x 4096 12.7 / 13.2; shared down 4096 x 2048
# 9.9 / 9.1, attn_q_a 9.0 / 6.4, attn_kv 7.9 / 4.8 (the extra launch is most of a small one).
DP4A_MIN_ELEMENTS = 1 << 24
# Registers of the dp4a kernel: capped from 142 to 128, 4 blocks of 128 threads an SM instead of
# 3 (no spills): output head 152.8 -> 143.9 µs, attn_output_b 22.0 -> 17.9; 96 or 64 spill and
# lose (same sweep).
DP4A_REGS = 128

# ---- register-level helpers: 16-byte loads, bit casts, dp4a ------------------------------------
# Numba has no vector loads, no int<->float bit casts and no dp4a. On the GPU each is a few lines
# of LLVM (inline PTX for the load and dp4a); in the simulator NumPy does the same thing.
if SIMULATOR:
    def _ld_x4(a, i):
        """Elements i .. i+3 of C-contiguous ``a`` in flat order (on the GPU one 16-byte
        ld.global.nc.v4; i % 4 == 0)."""
        f = a.ravel()
        return f[i], f[i + 1], f[i + 2], f[i + 3]

    def _ld_x2(a, i):
        """Elements i, i+1 of C-contiguous ``a`` in flat order (on the GPU one 8-byte
        ld.global.nc.v2; i % 2 == 0)."""
        f = a.ravel()
        return f[i], f[i + 1]

    def _ld(a, i):
        """Element i of C-contiguous ``a`` in flat order."""
        return a.ravel()[i]

    def _bits_f32(v):
        """The float32 whose bits are the low 32 bits of integer ``v``."""
        return np.uint32(int(v) & 0xFFFFFFFF).view(np.float32)

    def _bits_f16(v):
        """The float16 whose bits are the low 16 bits of ``v``, widened (exactly) to float32."""
        return np.float32(np.uint16(int(v) & 0xFFFF).view(np.float16))

    def _dp4a(a, b, c):
        """c + the dot product of the four signed bytes of ``a`` and of ``b`` (PTX dp4a)."""
        for k in range(4):
            c += (((int(a) >> 8 * k) + 128) % 256 - 128) * (((int(b) >> 8 * k) + 128) % 256 - 128)
        return c
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _flat_ptr(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, value=args[0])
        return builder.gep(arr.data, [context.cast(builder, args[1], sig.args[1], types.intp)])

    def _flat_ok(a, i):
        return isinstance(a, types.Array) and a.layout == "C" and isinstance(i, types.Integer)

    def _vector_load(n):
        """An intrinsic loading elements i .. i+n-1 of a C-contiguous 32-bit array in one
        ld.global.nc.v{n} (i % n == 0)."""
        @intrinsic
        def load(typingctx, a, i):
            if not (_flat_ok(a, i) and a.dtype.bitwidth == 32):
                return None
            code = "f" if isinstance(a.dtype, types.Float) else "r"
            regs = ", ".join(f"${k}" for k in range(n))
            ptx = f"ld.global.nc.v{n}.{'f32' if code == 'f' else 'b32'} {{{regs}}}, [${n}];"

            def codegen(context, builder, sig, args):
                ptr = _flat_ptr(context, builder, sig, args)
                elt = context.get_value_type(sig.args[0].dtype)
                fty = ir.FunctionType(ir.LiteralStructType([elt] * n), [ptr.type])
                asm = ir.InlineAsm(fty, ptx, ",".join([f"={code}"] * n + ["l"]))
                s = builder.call(asm, [ptr])
                return cgutils.pack_array(builder, [builder.extract_value(s, k)
                                                    for k in range(n)])
            return types.UniTuple(a.dtype, n)(a, i), codegen
        return load

    _ld_x4 = _vector_load(4)
    _ld_x2 = _vector_load(2)

    @intrinsic
    def _ld(typingctx, a, i):
        if not _flat_ok(a, i):
            return None
        return a.dtype(a, i), lambda ctx, b, sig, args: b.load(_flat_ptr(ctx, b, sig, args))

    def _i32(builder, v, t):
        return builder.trunc(v, ir.IntType(32)) if t.bitwidth > 32 else v

    def _bitcast_intrinsic(width, ftype, result):
        @intrinsic
        def cast(typingctx, v):
            if not isinstance(v, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                bits = builder.trunc(args[0], ir.IntType(width)) if v.bitwidth > width else args[0]
                f = builder.bitcast(bits, ftype)
                return builder.fpext(f, ir.FloatType()) if width < 32 else f
            return result(v), codegen
        return cast

    _bits_f32 = _bitcast_intrinsic(32, ir.FloatType(), types.float32)
    _bits_f16 = _bitcast_intrinsic(16, ir.HalfType(), types.float32)

    @intrinsic
    def _dp4a(typingctx, a, b, c):
        if not all(isinstance(v, types.Integer) for v in (a, b, c)):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), "dp4a.s32.s32 $0, $1, $2, $3;",
                               "=r,r,r,r")
            return builder.call(asm, [_i32(builder, v, t) for v, t in zip(args, sig.args)])
        return types.int32(a, b, c), codegen


# Element k of a 32-bit word, as float32 (exact). k is a compile-time constant after unrolling.
@cuda.jit(device=True)
def _dq_f32(w, k):
    return w


@cuda.jit(device=True)
def _dq_f16(w, k):
    return _bits_f16(w >> (16 * k))


@cuda.jit(device=True)
def _dq_bf16(w, k):
    return _bits_f32((w << 16) if k == 0 else ((w >> 16) << 16))  # bf16: top half of a float32


@cuda.jit(device=True)
def _dq_q8_0(w, k):
    # Byte k as int8 q without an int->float conversion (those issue at 1/8 of the FMA rate):
    # (byte ^ 0x80) = q + 128, placed in the mantissa of 2^23, is the float 2^23 + 128 + q.
    return _bits_f32(((w >> (8 * k)) & 0xFF) ^ 0x4B000080) - np.float32(8388736.0)


# ---- type table and packing (host, once at load) ------------------------------------------------
class _Type(NamedTuple):
    name: str
    qtype: int
    epw: int  # elements per 32-bit word
    sblock: int  # elements per scale (0: no scale plane)
    dq: object
    wdtype: type  # dtype of the word plane


_F32 = _Type("f32", GGMLType.F32, 1, 0, _dq_f32, np.float32)
_F16 = _Type("f16", GGMLType.F16, 2, 0, _dq_f16, np.int32)
_BF16 = _Type("bf16", GGMLType.BF16, 2, 0, _dq_bf16, np.int32)
_Q8_0 = _Type("q8_0", GGMLType.Q8_0, 4, 32, _dq_q8_0, np.int32)


def _words(raw: np.ndarray, rows: int, cols: int, dtype, epw: int) -> np.ndarray:
    """Any raw tensor of rows x cols elements (+ leading expert dim) -> words [E, N, K / epw]."""
    if cols % epw:
        raise ValueError(f"row length {cols} is not a multiple of {epw}")
    b = np.ascontiguousarray(raw).view(np.uint8)
    return b.reshape(-1).view(dtype).reshape(-1, rows, cols // epw)


def pack_f32(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """raw float32 [E?, N, K] -> QWeight (w float32 [E, N, K])."""
    w = _words(raw, rows, cols, np.float32, 1)
    return QWeight(GGMLType.F32, rows, cols, len(w), (w,))


def pack_f16(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """raw float16 [E?, N, K] -> QWeight (w int32 [E, N, K/2], two halves per word)."""
    w = _words(raw, rows, cols, np.int32, 2)
    return QWeight(GGMLType.F16, rows, cols, len(w), (w,))


def pack_bf16(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """raw uint8 [E?, N, 2K] or uint16 [E?, N, K] -> QWeight (w int32 [E, N, K/2])."""
    w = _words(raw, rows, cols, np.int32, 2)
    return QWeight(GGMLType.BF16, rows, cols, len(w), (w,))


def pack_q8_0(raw: np.ndarray, rows: int, cols: int) -> QWeight:
    """raw uint8 [E?, N, K/32*34] -> QWeight (qs int32 [E, N, K/4], d float16 [E, N, K/32])."""
    blocks = Q8_0Block.from_bytes(np.ascontiguousarray(raw, np.uint8).reshape(-1, 34))
    qs = np.ascontiguousarray(blocks.q).view(np.int32).reshape(-1, rows, cols // 4)
    d = np.ascontiguousarray(blocks.d).reshape(len(qs), rows, cols // 32)
    return QWeight(GGMLType.Q8_0, rows, cols, len(qs), (qs, d))


def _dense(w: QWeight) -> np.ndarray:
    """Host planes -> float32 [E, N, K] through quants.dequantize on the rebuilt GGUF bytes."""
    if w.qtype == GGMLType.Q8_0:
        qs, d = (np.asarray(p) for p in w.planes)
        raw = Q8_0Block(d.reshape(-1, 1), qs.view(np.int8).reshape(-1, 32)).to_bytes()
    else:
        raw = np.asarray(w.planes[0]).view(np.uint8)
    return dequantize(raw.reshape(w.experts, w.rows, -1), w.qtype)


def _gemv_ref(out: np.ndarray, w: QWeight, x: np.ndarray, ids: np.ndarray | None = None) -> None:
    """out[T, N] = W[0 or ids[t]] · x[t] in out's dtype (NumPy; the weight through
    quants.dequantize)."""
    W = _dense(w).astype(out.dtype, copy=False)
    x = x.astype(out.dtype, copy=False)
    if ids is None:
        np.matmul(x, W[0].T, out=out)
        return
    for e in np.unique(ids):
        sel = ids == e
        out[sel] = x[sel] @ W[e].T


gemv_f32_ref = gemv_f16_ref = gemv_bf16_ref = gemv_q8_0_ref = _gemv_ref

# ---- kernels -------------------------------------------------------------------------------------
def _named(fn, name, **opts):
    fn.__name__ = fn.__qualname__ = name
    return kernel(fn, **opts)


def _plain_dq(ty: _Type):
    """The type's dequant helper; in the simulator its plain Python function (the simulator's
    device-call wrapper costs more than the helper itself, once per weight element)."""
    return ty.dq.py_func if SIMULATOR else ty.dq


def _thread_per_row_kernel(ty: _Type):
    EPW, SB, dq = ty.epw, max(1, ty.sblock), _plain_dq(ty)
    HAS_SCALE = ty.sblock > 0

    def k(out, wq, ws, x, ids, per_token, K):
        # grid (blocks, T): a thread per output element at a time, serial over its row, striding
        # over the rows. Slow on a GPU (uncoalesced); the cheapest path in the simulator, where
        # every thread is a Python thread (started at ~0.3 ms each: one block of few threads).
        t = cuda.blockIdx.y
        e = ids[t] if per_token else 0
        for n in range(cuda.grid(1), out.shape[1], cuda.gridDim.x * cuda.blockDim.x):
            acc = np.float32(0)
            for j in range(K // EPW):
                w = wq[e, n, j]
                s = np.float32(ws[e, n, j * EPW // SB]) if HAS_SCALE else np.float32(1)
                for i in range(EPW):
                    acc += (dq(w, i) * s) * x[t, j * EPW + i]
            out[t, n] = acc
    return _named(k, f"_gemv_{ty.name}_thread_per_row")


def _naive_kernel(ty: _Type):
    EPW, SB, dq = ty.epw, max(1, ty.sblock), _plain_dq(ty)
    HAS_SCALE = ty.sblock > 0

    def k(out, wq, ws, x, ids, per_token, K):
        # grid (N, T): one block per output element; threads stride over the row's words
        n, t = cuda.blockIdx.x, cuda.blockIdx.y
        e = ids[t] if per_token else 0
        scratch = cuda.shared.array(1024, np.float32)
        acc = np.float32(0)
        for j in range(cuda.threadIdx.x, K // EPW, cuda.blockDim.x):
            w = wq[e, n, j]
            s = np.float32(ws[e, n, j * EPW // SB]) if HAS_SCALE else np.float32(1)
            for i in range(EPW):
                acc += (dq(w, i) * s) * x[t, j * EPW + i]
        total = block_sum(acc, scratch)
        if cuda.threadIdx.x == 0:
            out[t, n] = total
    return _named(k, f"_gemv_{ty.name}_block_per_row")


# x for the int8 dot products: three int8 "limbs" per element, x = s1*q1 + s2*q2 + s3*q3 with
# s2 = s1/254, s3 = s2/254, so |error| <= s3/2 = amax * 3e-8: float32 precision, unlike
# llama.cpp's single q8_1 limb (4e-3). dp4a then does 4 multiply-adds per instruction on the raw
# Q8_0 words, and its int32 sums become floats by the 1.5 * 2^23 trick below (no I2F).
_LIMB = np.float32(1 / 254)
_MAGIC = 0x4B400000  # the float 1.5 * 2^23; as int + n (|n| < 2^22) it is the float 1.5 * 2^23 + n
_MAGIC_F = np.float32(12582912.0)


@cuda.jit(device=True)
def _x_limbs(x, t, base, ok):
    """x[t, base : base + 16] (zeros if not ok) -> (12 words: limb l's elements 4m .. 4m+3 in
    word 4l + m, element 4m + k in byte k; the 3 limb scales). Returned by value so the caller's
    arrays stay in registers."""
    words = cuda.local.array(12, np.int32)
    amax = np.float32(0)
    if ok:
        for i in range(16):
            amax = max(amax, abs(x[t, base + i]))
    s1, s2, s3, i1, i2, i3 = _limb_scales(amax)
    for m in range(4):
        a1, a2, a3 = 0, 0, 0
        for k in range(4):
            b1, b2, b3 = _limb_bytes(x[t, base + 4 * m + k] if ok else np.float32(0),
                                     s1, s2, s3, i1, i2, i3)
            a1 += b1 << (8 * k)
            a2 += b2 << (8 * k)
            a3 += b3 << (8 * k)
        words[m] = _as_int32(a1)
        words[4 + m] = _as_int32(a2)
        words[8 + m] = _as_int32(a3)
    return ((words[0], words[1], words[2], words[3], words[4], words[5], words[6], words[7],
             words[8], words[9], words[10], words[11]), (s1, s2, s3))


@cuda.jit(device=True)
def _limb_scales(amax):
    """(s1, s2, s3, i1, i2, i3): the three limbs' scales of a chunk whose largest |x| is amax,
    and their inverses (multiplied, not divided, per element; 0 for an all-zero chunk)."""
    s1 = amax / np.float32(127)
    s2 = s1 * _LIMB
    s3 = s2 * _LIMB
    i1 = np.float32(1) / s1 if amax > 0 else np.float32(0)
    return s1, s2, s3, i1, i1 * np.float32(254), i1 * np.float32(254) * np.float32(254)


@cuda.jit(device=True)
def _limb(r, s, inv):
    """(q, r - q*s) with q ~ round(r / s) in [-127, 127] (inv ~ 1/s); a rounding slip only
    leaves more for the next limb."""
    q = min(127, max(-127, int(math.floor(r * inv + np.float32(0.5)))))
    return q, r - np.float32(q) * s


@cuda.jit(device=True)
def _limb_bytes(v, s1, s2, s3, i1, i2, i3):
    """v's three limbs (``_limb`` on what each leaves) as the bytes a limb word holds: every
    maker of the dp4a GEMV's x (a thread a chunk, four, the attention's combine) rounds so."""
    q1, r = _limb(v, s1, i1)
    q2, r = _limb(r, s2, i2)
    q3, r = _limb(r, s3, i3)
    return q1 & 0xFF, q2 & 0xFF, q3 & 0xFF


@cuda.jit(device=True)
def _as_int32(a):
    """A limb word assembled from four bytes (0 .. 2^32 - 1) as the int32 it is stored as."""
    return a - (1 << 32) if a >= 1 << 31 else a


XLW = 16  # words of prepared x per 16-column chunk: 12 limb words, s1's bits, 3 zero (64 bytes)


@kernel
def _q8_0_x_limbs(xl, x):
    """xl[t, XLW c : XLW (c + 1)] <- the limbs of x[t, 16 c : 16 (c + 1)] (``_x_limbs``): x is
    quantised once per launch here, not once per block of the dp4a GEMV that reads it."""
    i = cuda.grid(1)
    T, K = x.shape
    nchunk = K // 16
    if i < T * nchunk:
        t = i // nchunk
        c = i - t * nchunk
        limbs, scales = _x_limbs(x, t, 16 * c, True)
        for j in range(12):
            xl[t, XLW * c + j] = limbs[j]
        xl[t, XLW * c + 12] = _f32_bits(scales[0])  # s2, s3 follow from s1 (exactly as there)
        for j in range(13, XLW):
            xl[t, XLW * c + j] = 0


@cuda.jit(device=True)
def _chunk_words(xl, t, c, m, vals, scratch, ok):
    """Thread m of the four (consecutive lanes) of 16-column chunk c of token t holds the
    chunk's elements 4m .. 4m+3 in vals: the chunk's max by 2 xor shuffles over the four, the
    3 limbs of its elements (``_x_limbs``' arithmetic), and, if ok, word m of each limb and
    word 12 + m (the scale, or a zero) into xl. Every thread of the block calls it."""
    amax = np.float32(0)
    for k in range(4):
        amax = max(amax, abs(vals[k]))
    amax = max(amax, xor_shfl(amax, 1, scratch))
    amax = max(amax, xor_shfl(amax, 2, scratch))
    s1, s2, s3, i1, i2, i3 = _limb_scales(amax)
    a1, a2, a3 = 0, 0, 0
    for k in range(4):
        b1, b2, b3 = _limb_bytes(vals[k], s1, s2, s3, i1, i2, i3)
        a1 += b1 << (8 * k)
        a2 += b2 << (8 * k)
        a3 += b3 << (8 * k)
    if ok:
        o = XLW * c
        xl[t, o + m] = _as_int32(a1)
        xl[t, o + 4 + m] = _as_int32(a2)
        xl[t, o + 8 + m] = _as_int32(a3)
        xl[t, o + 12 + m] = np.int64(_f32_bits(s1)) if m == 0 else np.int64(0)


@kernel
def _q8_0_x_limbs_words(xl, x):
    """xl as _q8_0_x_limbs makes it (the same words), four threads a 16-column chunk instead of
    one (``_chunk_words``): a thread's serial chain is 4 elements' 3 roundings, not 16's
    (decode: the x of attn_output_a / _b, q_b, the shared expert)."""
    scratch = cuda.shared.array(1024, np.float32)  # (the simulator's shuffles)
    vals = cuda.local.array(4, np.float32)
    T, K = x.shape
    nchunk = K // 16
    total = T * nchunk * 4
    j = min(cuda.grid(1), total - 1)  # (past the end: a copy of the last thread, not written)
    m, c, t = j % 4, j // 4 % nchunk, j // (4 * nchunk)
    for k in range(4):
        vals[k] = x[t, 16 * c + 4 * m + k]
    _chunk_words(xl, t, c, m, vals, scratch, cuda.grid(1) < total)


def _make_limbs(xl, x, stream) -> None:
    """x float32 [T, K] -> its limbs xl, by _q8_0_x_limbs_words (four threads a chunk), or
    with ``limbs_kernel("serial")`` in force by _q8_0_x_limbs (one): the same words."""
    T, K = x.shape
    n = T * (K // 16)
    if _STATE.get("limbs") == "serial":
        _q8_0_x_limbs[cdiv(n, 128), 128, stream](xl, x)
    else:
        _q8_0_x_limbs_words[cdiv(4 * n, 128), 128, stream](xl, x)


@contextlib.contextmanager
def limbs_kernel(name: str):
    """Which kernel makes x's limbs for the Q8_0 dp4a GEMVs launched inside: "words" (four
    threads a chunk, the default) or "serial" (a thread a chunk): an A/B (the decode engine's
    ``limbs_by_words``)."""
    assert name in ("words", "serial")
    before = _STATE.get("limbs")
    _STATE["limbs"] = name
    try:
        yield
    finally:
        _STATE["limbs"] = before


@kernel
def _q8_0_x_limbs_norm(xl, xn, x, w, eps):
    """One block, one row (x [1, K], K <= NORM_LIMBS_MAX_K): xn = x / sqrt(mean(x^2) + eps) * w,
    the RMSNorm with its weight, then xl <- the limbs of xn, the same words as _q8_0_x_limbs
    makes of it: the decode's q_a norm and q_b's x preparation in one launch (off the CSA
    layers).
    Four threads a 16-column chunk (``_chunk_words``), each holding its 4 elements from the
    load through the norm to the limbs."""
    scratch = cuda.shared.array(1024, np.float32)  # (the simulator's shuffles and warp sums)
    wsum = cuda.shared.array(32, np.float32)
    vals = cuda.local.array(4, np.float32)
    K = x.shape[1]
    ok = cuda.threadIdx.x < K // 4
    j = min(cuda.threadIdx.x, K // 4 - 1)
    ss = np.float32(0)
    for k in range(4):
        v = x[0, 4 * j + k]
        vals[k] = v
        ss += v * v
    inv = np.float32(1.0 / math.sqrt(block_sum_warps(ss if ok else np.float32(0), scratch, wsum)
                                     / K + eps))
    for k in range(4):
        y = vals[k] * inv * w[4 * j + k]
        vals[k] = y
        if ok:
            xn[0, 4 * j + k] = y
    _chunk_words(xl, 0, j // 4, j % 4, vals, scratch, ok)


@cuda.jit(device=True, inline="always")
def _limbs_dot(wv, q, xq, xq0, xs, xs0):
    """The dot product of the 16 int8 codes in words wv[q .. q+3] with a chunk of x in its three
    limbs (words xq[xq0 ..], 4 a limb; scales xs[xs0 ..]): a dp4a chain a limb from the _MAGIC
    offset, the limbs added under their scales (inlined at Numba IR level: the kernels' local
    arrays stay in registers)."""
    d1, d2, d3 = _MAGIC, _MAGIC, _MAGIC
    for m in range(4):
        d1 = _dp4a(wv[q + m], xq[xq0 + m], d1)
        d2 = _dp4a(wv[q + m], xq[xq0 + 4 + m], d2)
        d3 = _dp4a(wv[q + m], xq[xq0 + 8 + m], d3)
    return (xs[xs0] * (_bits_f32(d1) - _MAGIC_F) + xs[xs0 + 1] * (_bits_f32(d2) - _MAGIC_F)
            + xs[xs0 + 2] * (_bits_f32(d3) - _MAGIC_F))


@cuda.jit(device=True)
def _load_rows(wv, sv, wq, ws, row0, row_end, kw, ks, c0, nchunk, R, CPL, CPS, SCALED):
    """Issue the R x CPL 16-byte loads (and scales) of flat rows row0 .. row0 + R - 1, without
    a branch: rows clamp to row_end - 1 (their sums are never written) and chunks past the row
    end to the last chunk (those lanes hold x = 0). The scales stay in ws's type (sv's): a
    conversion here would wait for the load at once, where the caller prefetches them a step
    ahead (2026-12-07 (x): the float16 -> float32 conversions sat right after the loads)."""
    for i in range(R):
        row = min(row0 + i, row_end - 1)
        for j in range(CPL):
            c = min(c0 + j * 32, nchunk - 1)
            q = (i * CPL + j) * 4
            wv[q], wv[q + 1], wv[q + 2], wv[q + 3] = _ld_x4(wq, row * kw + c * 4)
            if SCALED:
                sv[i * CPL + j] = _ld(ws, row * ks + c // CPS)


@cuda.jit(device=True)
def _norm_x(xf, base, nw, eps, K, c0, nchunk, CPL, EC, scratch):
    """x <- rmsnorm(x) * nw on the x a lane holds, xf[base + j·EC + i] (element i of chunk
    c0 + 32j, j < CPL; x = 0 past the row), where the warp's lanes hold the whole row of K:
    one warp sum of squares (norm_row's formula)."""
    ss = np.float32(0)
    for j in range(CPL):
        for i in range(EC):
            v = xf[base + j * EC + i]
            ss += v * v
    tot = warp_sum(ss, scratch)
    inv = np.float32(1.0 / math.sqrt(tot / K + eps))
    for j in range(CPL):
        c = min(c0 + j * 32, nchunk - 1)
        for i in range(EC):
            sl = base + j * EC + i
            xf[sl] = xf[sl] * inv * nw[c * EC + i]


def _decode_kernel(ty: _Type, B: int, CPL: int, R: int, int8: bool = False, norm: bool = False,
                   **opts):
    """B tokens sharing the rows (or 1 expert-indexed token per blockIdx.y); each lane owns CPL
    16-byte chunks of its warp's K-slice and holds their x; R rows per warp per step. The next
    step's loads are issued before this step's math (registers double-buffered), so a warp
    always has loads in flight. ``int8`` (Q8_0 only): dp4a on three int8 limbs of x, which
    x then holds: int32 [T, K / 16 * XLW] from ``_q8_0_x_limbs``. ``norm`` (float types, a
    warp's K-slice the whole row): x is taken as rmsnorm(x) * nw (nw [K], eps), each warp
    normalising the x it holds (one warp sum, norm_row's formula): no norm launch before the
    GEMV (the other kernels take nw and eps and ignore them)."""
    EPW, dq, WDT = ty.epw, ty.dq, ty.wdtype
    EC = 4 * EPW  # elements per 16-byte chunk
    INT8 = int8
    SCALED, SB = ty.sblock > 0, max(1, ty.sblock)
    CPS = max(1, ty.sblock // EC)  # chunks per scale (Q8_0: 2)
    # local / shared array sizes must be plain constants for Numba's typing
    N_PART, N_W, N_S, N_ACC = 2 * 32 * R * B, R * CPL * 4, R * CPL, R * B
    N_XF = 1 if INT8 else B * CPL * EC
    N_XQ, N_XS = (B * CPL * 12, B * CPL * 3) if INT8 else (1, 1)
    NORM = norm and not int8

    def k(out, wq, ws, x, ids, per_token, N, K, wk_n, span, nw, eps):
        # out [T, N]; wq [E, N, K/EPW]; ws [E, N, K/SB] or dummy; x [T, K]; ids [T] or dummy;
        # nw [K] float32, eps: NORM only
        # block = wr_n x wk_n warps: warp (wr, wk) takes row slot wr, K-slice wk of `span` chunks
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        wk, wr = warp % wk_n, warp // wk_n
        wr_n = cuda.blockDim.x // 32 // wk_n
        t0 = cuda.blockIdx.y * B
        e = ids[t0] if per_token else 0
        nchunk, kw, ks = K // EC, K // EPW, K // SB
        c0 = wk * span + lane  # my first chunk; the others follow every 32
        scratch = cuda.shared.array(1024, np.float32)  # warp_sum staging (simulator only)
        part = cuda.shared.array(N_PART, np.float32)  # [parity, warp, R, B] K-slice partials
        xf = cuda.local.array(N_XF, np.float32)  # x of my chunks (float types)
        xq = cuda.local.array(N_XQ, np.int32)  # x limbs of my chunks (Q8_0)
        xs = cuda.local.array(N_XS, np.float32)
        wv = cuda.local.array(N_W, WDT)  # the words of this step
        sv = cuda.local.array(N_S, float16)  # (ws's type: converted where used)
        wn = cuda.local.array(N_W, WDT)  # ... and of the next one
        sn = cuda.local.array(N_S, float16)
        acc = cuda.local.array(N_ACC, np.float32)
        tb = cuda.local.array(B, np.float32)
        ngroups = (N + wr_n * R - 1) // (wr_n * R)
        g = cuda.blockIdx.x
        # the first step's loads need no x: send them before preparing it
        _load_rows(wn, sn, wq, ws, e * N + (g * wr_n + wr) * R, e * N + N, kw, ks, c0, nchunk,
                   R, CPL, CPS, SCALED)
        for j in range(CPL):
            c = c0 + j * 32
            ok = j * 32 + lane < span and c < nchunk
            for b in range(B):
                sl = b * CPL + j
                if INT8:  # x is _q8_0_x_limbs' output; chunks past the row get scale 0
                    base = ((t0 + b) * nchunk + min(c, nchunk - 1)) * XLW
                    for m in range(3):
                        q = sl * 12 + 4 * m
                        xq[q], xq[q + 1], xq[q + 2], xq[q + 3] = _ld_x4(x, base + 4 * m)
                    s1 = _bits_f32(_ld(x, base + 12)) if ok else np.float32(0)
                    s2 = s1 * _LIMB
                    xs[sl * 3] = s1
                    xs[sl * 3 + 1] = s2
                    xs[sl * 3 + 2] = s2 * _LIMB
                else:
                    for i in range(EC):
                        xf[sl * EC + i] = x[t0 + b, c * EC + i] if ok else np.float32(0)
        if NORM:  # (wk_n = 1: the warp's lanes hold the whole row of each token)
            for b in range(B):
                _norm_x(xf, b * CPL * EC, nw, eps, K, c0, nchunk, CPL, EC, scratch)
        p = 0
        while g < ngroups:  # persistent blocks: grid-stride over groups of wr_n * R rows
            n0 = (g * wr_n + wr) * R
            for i in range(N_W):
                wv[i] = wn[i]
            for i in range(N_S):
                sv[i] = sn[i]
            _load_rows(wn, sn, wq, ws, e * N + n0 + cuda.gridDim.x * wr_n * R, e * N + N, kw, ks,
                       c0, nchunk, R, CPL, CPS, SCALED)
            for i in range(R):
                for b in range(B):
                    acc[i * B + b] = np.float32(0)
                for j in range(CPL):
                    q = (i * CPL + j) * 4
                    if INT8:
                        for b in range(B):
                            sl = b * CPL + j
                            dot = _limbs_dot(wv, q, xq, sl * 12, xs, sl * 3)
                            acc[i * B + b] += np.float32(sv[i * CPL + j]) * dot
                    else:
                        for b in range(B):
                            tb[b] = np.float32(0)
                        for m in range(4):
                            for kk in range(EPW):
                                f = dq(wv[q + m], kk)  # dequantised once, used by all B tokens
                                for b in range(B):
                                    tb[b] += f * xf[(b * CPL + j) * EC + m * EPW + kk]
                        for b in range(B):
                            acc[i * B + b] += (tb[b] * np.float32(sv[i * CPL + j]) if SCALED
                                               else tb[b])
            for i in range(R):
                for b in range(B):
                    v = warp_sum(acc[i * B + b], scratch)
                    if lane == 0:
                        if wk_n == 1:
                            if n0 + i < N:
                                out[t0 + b, n0 + i] = v
                        else:
                            part[((p * 32 + warp) * R + i) * B + b] = v
            if wk_n > 1:  # add the K-slices in a fixed order; parity buffers: one barrier
                cuda.syncthreads()
                t = cuda.threadIdx.x
                if t < wr_n * R * B:
                    r, i, b = t // (R * B), t // B % R, t % B
                    n = (g * wr_n + r) * R + i
                    if n < N:
                        s = np.float32(0)
                        for kw_ in range(wk_n):
                            s += part[((p * 32 + r * wk_n + kw_) * R + i) * B + b]
                        out[t0 + b, n] = s
                p ^= 1
            g += cuda.gridDim.x
    form = "dp4a" if INT8 else "xregs_norm" if NORM else "xregs"
    return _named(k, f"_gemv_{ty.name}_{form}_prefetch_splitk_b{B}", **opts)


TK = 32  # K step of the tiled GEMM (one Q8_0 block)
GEMM_MICRO = 8  # outputs per thread per side: 8 x 8 ran 11.1 TFLOP/s on the H200, 4 x 4 8.2
_TILE_MAX = 128  # largest row / token tile (smem arrays are sized statically)
_TILE_STRIDE = _TILE_MAX + 1  # padded: k-major stores from consecutive threads hit other banks


def _batched_kernel(ty: _Type, MN: int, MB: int):
    """Each thread owns an MN x MB micro-tile (rows ty + i*TNT, tokens tx + j*TBT)."""
    EPW, SB, dq = ty.epw, max(1, ty.sblock), ty.dq
    HAS_SCALE = ty.sblock > 0
    WPS = TK // EPW  # words per row per K step
    N_ACC = MN * MB

    def k(out, wq, ws, x, ids, per_token, N, K, tnt, ks):
        # out [S, T, N]; grid (N / TN, T / TB, S); block = tnt x tbt threads. Split s sums
        # the K columns [s·ks, (s+1)·ks) into out[s] (S = 1: the whole row, the result).
        T = x.shape[0]
        kb = cuda.blockIdx.z * ks
        ke = min(K, kb + ks)
        nt = cuda.blockDim.x
        tid = cuda.threadIdx.x
        tbt = nt // tnt
        ty_, tx = tid // tbt, tid % tbt
        TN, TB = tnt * MN, tbt * MB
        n0, t0 = cuda.blockIdx.x * TN, cuda.blockIdx.y * TB
        wt = cuda.shared.array((TK, _TILE_STRIDE), np.float32)  # dequantised W tile, k-major
        xt = cuda.shared.array((TK, _TILE_STRIDE), np.float32)  # x tile, k-major
        acc = cuda.local.array(N_ACC, np.float32)
        for i in range(N_ACC):
            acc[i] = np.float32(0)
        e_prev = -1
        while True:
            # experts of this token tile in increasing order; a tile of tokens sorted by
            # expert (as the MoE hands them over) takes one or two passes
            e = 1 << 30
            if per_token:
                for tt in range(t0, min(t0 + TB, T)):
                    if e_prev < ids[tt] < e:
                        e = ids[tt]
            elif e_prev < 0:
                e = 0
            if e == 1 << 30:
                break
            for k0 in range(kb, ke, TK):
                for idx in range(tid, TN * WPS, nt):
                    r, wj = idx // WPS, idx % WPS
                    n, kw = n0 + r, k0 // EPW + wj
                    if n < N and kw * EPW < ke:
                        w = wq[e, n, kw]
                        s = np.float32(ws[e, n, kw * EPW // SB]) if HAS_SCALE else np.float32(1)
                        for i in range(EPW):
                            wt[wj * EPW + i, r] = dq(w, i) * s
                    else:
                        for i in range(EPW):
                            wt[wj * EPW + i, r] = np.float32(0)
                for idx in range(tid, TB * TK, nt):
                    tt, kk = idx // TK, idx % TK
                    t = t0 + tt
                    ok = t < T and k0 + kk < ke
                    if ok and per_token:
                        ok = ids[t] == e
                    xt[kk, tt] = x[t, k0 + kk] if ok else np.float32(0)
                cuda.syncthreads()
                for kk in range(TK):
                    for i in range(MN):
                        a = wt[kk, ty_ + i * tnt]
                        for j in range(MB):
                            acc[i * MB + j] += a * xt[kk, tx + j * tbt]
                cuda.syncthreads()
            e_prev = e
        for i in range(MN):
            n = n0 + ty_ + i * tnt
            for j in range(MB):
                t = t0 + tx + j * tbt
                if n < N and t < T:
                    out[cuda.blockIdx.z, t, n] = acc[i * MB + j]
    return _named(k, f"_gemm_{ty.name}_smem_tiles_splitk")


@kernel
def _sum_splits(out, part):
    """out[T, N] = Σ_s part[s, T, N], in a fixed order (deterministic, unlike atomics)."""
    S, T, N = part.shape
    for i in range(cuda.grid(1), T * N, cuda.gridsize(1)):
        t = i // N
        n = i - t * N
        acc = part[0, t, n]
        for s_ in range(1, S):
            acc += part[s_, t, n]
        out[t, n] = acc


def gemm_splits(blocks: int, K: int) -> int:
    """K splits for a tiled GEMM of ``blocks`` output tiles: enough for two blocks per SM
    (a 512-token chunk through a 1024-row weight has only 32 tiles for 132 SMs), each split at
    least two TK steps long."""
    want = cdiv(2 * sm_count(), blocks)
    return max(1, min(want, K // (2 * TK)))


def _split_partials(S: int, T: int, N: int):
    """[S, T, N] f32 partial sums, from one workspace that only grows. Outgrown buffers are
    kept: a captured graph may still write them."""
    bufs = _STATE.setdefault("gemm_partials", [])
    if not bufs or bufs[-1].size < S * T * N:
        bufs.append(cuda.device_array(max(S * T * N, 1 << 20), np.float32))
    return bufs[-1][:S * T * N].reshape(S, T, N)


def _decode_shape(ty: _Type, B: int) -> tuple[int, int]:
    """(CPL, R): ~32 x registers per lane at B = 1, and R x CPL 16-byte loads per lane per step
    (twice that in flight with the prefetch); the best of an H200 sweep (see the report)."""
    cpl = max(1, 32 // (B * 4 * ty.epw))
    return cpl, 2 if ty.epw == 1 or (ty.epw == 4 and B > 1) else 4


class _Kernels(NamedTuple):
    naive: object
    decode: dict  # B -> kernel
    batched: object
    dp4a: object  # Q8_0, B = 1: the int8 decode kernel (None for the float types)
    norm: object  # float types, B = 1: the decode kernel normalising its x (None for Q8_0)


_KERNELS = {ty.qtype: _Kernels(_naive_kernel(ty),
                               {B: _decode_kernel(ty, B, *_decode_shape(ty, B))
                                for B in range(1, DECODE_MAX_TOKENS + 1)},
                               _batched_kernel(ty, GEMM_MICRO, GEMM_MICRO),
                               _decode_kernel(ty, 1, 2, 4, int8=True, max_registers=DP4A_REGS)
                               if ty is _Q8_0 else None,
                               None if ty is _Q8_0 else
                               _decode_kernel(ty, 1, *_decode_shape(ty, 1), norm=True))
            for ty in (_F32, _F16, _BF16, _Q8_0)}
_TYPES = {ty.qtype: ty for ty in (_F32, _F16, _BF16, _Q8_0)}
_ROWS = {ty.qtype: _thread_per_row_kernel(ty) for ty in (_F32, _F16, _BF16, _Q8_0)}


# ---- launchers -----------------------------------------------------------------------------------
_STATE: dict = {}


def _dummies():
    """(ids int32 [1], scales float16 [1, 1, 1], norm weight float32 [1]): stand-ins for absent
    arguments, allocated once so a launch allocates nothing (and can be captured in a CUDA
    graph)."""
    if "ids" not in _STATE:
        _STATE["ids"] = cuda.to_device(np.zeros(1, np.int32))
        _STATE["scale"] = cuda.to_device(np.zeros((1, 1, 1), np.float16))
        _STATE["norm"] = cuda.to_device(np.zeros(1, np.float32))
    return _STATE["ids"], _STATE["scale"], _STATE["norm"]


def simulator_prefers_rows(on: bool = True) -> None:
    """In the simulator, run every automatic choice through the thread-per-row kernel: each
    simulated thread is a Python thread, and it does the least work there (~20x faster than
    the decode kernels, whose own tests cover them). The engine's simulator runs use it; no
    effect on a GPU."""
    _STATE["sim_rows"] = bool(on)


def _sim_rows() -> bool:
    """Whether the simulator's thread-per-row preference (simulator_prefers_rows) is in force."""
    return SIMULATOR and bool(_STATE.get("sim_rows"))


def _wave(kern, args, threads: int, rows: int) -> int:
    """Blocks a grid row of the persistent decode kernel gets: one wave of the compiled kernel
    over all ``rows`` grid rows (2 in the simulator: tests reach the grid-stride loop), times
    the share ``grid_waves`` sets (1 unless inside it). With ids
    (the grouped attn_output_a: 8 rows of x, 8 weights) each row's blocks then stream several
    row groups and load their slice of x once for them (a block per row group read as many x
    bytes from L2 as weight bytes: 32.5 µs for the 35.6 MB out_a, ncu 2026-12-02)."""
    wave = resident_blocks(kern, args, threads, simulated=2 * rows)
    return max(1, int(wave * _STATE.get("waves", 1.0)) // rows)


def grid_waves_or_not(share: float | None):
    """grid_waves(share), or (None) the share in force left as it is."""
    return contextlib.nullcontext() if share is None else grid_waves(share)


@contextlib.contextmanager
def grid_waves(share: float):
    """The persistent decode GEMVs launched inside get ``share`` of a wave of blocks (below 1:
    room for the blocks of kernels on other streams, which would otherwise hold some of a
    full wave's blocks back until they end): the decode engine's ``gemv_waves`` (0.9)."""
    assert share > 0
    before = _STATE.get("waves", 1.0)
    _STATE["waves"] = float(share)
    try:
        yield
    finally:
        _STATE["waves"] = before


def _launch(ty: _Type, out, w: QWeight, x, ids, stream, threads, method=None, split_k=None,
            limbs=None, norm=None):
    """Pick and launch a kernel. ``method`` ("naive" / "decode" / "dp4a" / "batched" / "mma") and
    ``split_k`` (decode: warps per row; batched: K splits) override the choice; tests use them
    to reach every path. ``limbs``: x's limbs already made (q8_0_limbs): the dp4a kernel alone.
    ``norm`` (nw [K] float32, eps): W · (rmsnorm(x) * nw), the norm made by the decode kernel
    (takes_norm must hold)."""
    if limbs is not None:  # (with ids: row t of the limbs is token t, as x's would be)
        assert x is None and ty is _Q8_0
        method = "dp4a"
    if norm is not None:
        assert takes_norm(w, x.shape[0], ids) and method in (None, "decode"), "takes_norm"
        method = "decode"
    T = x.shape[0] if limbs is None else limbs.shape[0]
    K = x.shape[1] if limbs is None else limbs.shape[1] // XLW * 16
    assert w.qtype == ty.qtype and K == w.cols and out.shape == (T, w.rows)
    N = w.rows
    kern = _KERNELS[ty.qtype]
    ids_dummy, scale_dummy, norm_dummy = _dummies()
    ws = w.planes[1] if ty.sblock else scale_dummy
    per_token = 0 if ids is None else 1
    ids_arg = ids_dummy if ids is None else ids
    B = 1 if per_token else T
    EC = 4 * ty.epw
    auto = method is None
    if auto and _sim_rows():
        method = "rows"
    elif auto:
        limit = DECODE_MAX_IDS if per_token else DECODE_MAX_TOKENS
        fits = K % EC == 0 and K // EC <= 32 * 32 * _decode_shape(ty, min(B, limit))[0]
        method = "decode" if T <= limit and fits else "batched"
        if method == "batched" and not SIMULATOR and K % TK == 0:
            method = "mma"  # tensor cores (mma.py); the simulator keeps the CUDA-core tiles
    if method == "mma":
        from .mma import gemm_mma  # mma.py builds on this module's helpers
        gemm_mma(out, w, x, ids, None, stream, split_k)
    elif method == "naive":
        kern.naive[(N, T), threads or 128, stream](out, w.planes[0], ws, x, ids_arg, per_token, K)
    elif method == "rows":
        nt = threads or (32 if SIMULATOR else 128)
        blocks = 1 if SIMULATOR else cdiv(N, nt)  # (simulator: striding, fewer Python threads)
        _ROWS[ty.qtype][(blocks, T), nt, stream](out, w.planes[0], ws, x, ids_arg, per_token, K)
    elif method in ("decode", "dp4a"):
        cpl, R = _decode_shape(ty, B)  # Q8_0 at B = 1: (2, 4), the dp4a kernel's shape too
        nchunk = K // EC
        wk_n = split_k or cdiv(nchunk, 32 * cpl)
        span = cdiv(nchunk, wk_n)
        assert K % EC == 0 and span <= 32 * cpl and wk_n <= 32, (K, wk_n)
        wr_n = max(1, (threads or 128) // (32 * wk_n))
        nt = 32 * wk_n * wr_n
        groups, rows = cdiv(N, wr_n * R), T // B
        k = kern.decode[B] if norm is None else kern.norm
        nw, eps = (norm_dummy, 0.0) if norm is None else norm
        args = (out, w.planes[0], ws, x, ids_arg, per_token, N, K, wk_n, span, nw,
                np.float32(eps))
        if auto and kern.dp4a is not None and B == 1 and rows * N * K >= DP4A_MIN_ELEMENTS:
            method = "dp4a"
        if method == "dp4a":  # x -> int8 limbs once (unless made already), then the GEMV
            xl = limbs if limbs is not None else q8_0_limbs(x, stream)
            k, args = kern.dp4a, args[:3] + (xl,) + args[4:]
        k[(min(groups, _wave(k, args, nt, rows)), rows), nt, stream](*args)
    else:
        nt = min(threads or 256, 256)  # tiles of at most _TILE_MAX rows and tokens
        tnt = 1 << (nt.bit_length() // 2)  # 256 threads: 16 x 16 -> 128 rows x 128 tokens
        gx, gy = cdiv(N, tnt * GEMM_MICRO), cdiv(T, nt // tnt * GEMM_MICRO)
        ks = cdiv(cdiv(K, split_k or gemm_splits(gx * gy, K)), TK) * TK
        S = cdiv(K, ks)
        dest = out.reshape(1, T, N) if S == 1 else _split_partials(S, T, N)
        kern.batched[(gx, gy, S), nt, stream](dest, w.planes[0], ws, x, ids_arg, per_token, N,
                                              K, tnt, ks)
        if S > 1:
            _sum_splits[min(cdiv(T * N, 256), 4096), 256, stream](out, dest)


NORM_LIMBS_MAX_K = 4096  # q8_0_limbs(norm=): four elements a thread, one block


def takes_limbs(w: QWeight, norm: bool = False, grouped: bool = False) -> bool:
    """Whether the one-token GEMV of ``w`` runs the dp4a kernel (Q8_0 of >= DP4A_MIN_ELEMENTS,
    a K the decode kernel holds; not where the simulator prefers the thread-per-row kernel):
    then its x may come as limbs made beforehand (``q8_0_limbs``, ``gemv_q8_0(limbs=)``);
    ``norm``: limbs made with a norm, too (``q8_0_limbs(norm=)``: K <= NORM_LIMBS_MAX_K);
    ``grouped``: w's experts each take one row of x by ids (attn_output_a's groups)."""
    if w.qtype != GGMLType.Q8_0 or _sim_rows():
        return False
    cpl = _decode_shape(_Q8_0, 1)[0]
    K = w.cols
    return ((w.experts == 1 or grouped) and K % 16 == 0 and K // 16 <= 32 * 32 * cpl
            and w.rows * K * (w.experts if grouped else 1) >= DP4A_MIN_ELEMENTS
            and (not norm or K <= NORM_LIMBS_MAX_K))


def q8_0_limbs(x, stream=0, norm=None, name: str = "q8_0 x limbs"):
    """The int8 limbs of x float32 [T, K] that the Q8_0 dp4a GEMV reads, in a stream buffer
    called ``name`` (another name: limbs that must outlive the next GEMV's on this stream).
    ``norm`` (out [1, K], w [K], eps), T = 1 and K <= NORM_LIMBS_MAX_K: out = rmsnorm(x) * w,
    and the limbs are those of out, in the same launch (``_q8_0_x_limbs_norm``)."""
    T, K = x.shape
    assert K % 16 == 0
    xl = stream_buffer(name, stream, (T, K // 16 * XLW), np.int32)
    if norm is None:
        _make_limbs(xl, x, stream)
        return xl
    out, w, eps = norm
    assert T == 1 and out.shape == x.shape and K <= NORM_LIMBS_MAX_K
    _q8_0_x_limbs_norm[1, 32 * cdiv(K // 4, 32), stream](xl, out, x, w, np.float32(eps))
    return xl


def gemv_f32(out, w: QWeight, x, ids=None, stream=0, threads=None, **how) -> None:
    """out float32 [T, N] (device) = W · x for F32 device planes; x float32 [T, K]; ids int32 [T]
    device array or None. T <= 4 (<= 16 with ids): decode kernel, else the tiled GEMM;
    ``method=`` / ``split_k=`` force a kernel (tests, benchmarks)."""
    _launch(_F32, out, w, x, ids, stream, threads, **how)


def gemv_f16(out, w: QWeight, x, ids=None, stream=0, threads=None, **how) -> None:
    """As gemv_f32, F16 weights."""
    _launch(_F16, out, w, x, ids, stream, threads, **how)


def gemv_bf16(out, w: QWeight, x, ids=None, stream=0, threads=None, **how) -> None:
    """As gemv_f32, BF16 weights."""
    _launch(_BF16, out, w, x, ids, stream, threads, **how)


def gemv_q8_0(out, w: QWeight, x, ids=None, stream=0, threads=None, **how) -> None:
    """As gemv_f32, Q8_0 weights; ``limbs=`` (x None; one token, or a row per id): x's limbs
    from q8_0_limbs (or attention_decode(limbs=)), the dp4a kernel alone."""
    _launch(_Q8_0, out, w, x, ids, stream, threads, **how)


# ---- dispatch on the tensor's type ---------------------------------------------------------------
def _by_type(qtype: int, fmt: str):
    """This module's function for F32/F16/BF16/Q8_0, gemv_lowbit's for the others."""
    if qtype in _TYPES:
        return globals()[fmt.format(_TYPES[qtype].name)]
    from . import gemv_lowbit  # written alongside; imported only when a low-bit type shows up

    fn = getattr(gemv_lowbit, fmt.format(type_name(qtype).lower()), None)
    if fn is None:
        raise ValueError(f"no GEMV for tensor type {type_name(qtype)}")
    return fn


def pack_weight(raw: np.ndarray, qtype: int, rows: int, cols: int) -> QWeight:
    """GGUF tensor data (as GGUFReader returns it) -> QWeight in the type's device layout."""
    return _by_type(qtype, "pack_{}")(raw, rows, cols)


def gemv_ref(out, w: QWeight, x, ids=None) -> None:
    """NumPy reference for any supported weight type."""
    _by_type(w.qtype, "gemv_{}_ref")(out, w, x, ids)


def gemv(out, w: QWeight, x, ids=None, stream=0, threads=None, norm=None) -> None:
    """Launch the GEMV / GEMM for ``w``'s type (device arrays only). ``norm`` (nw [K], eps):
    of rmsnorm(x) * nw instead of x, made by the GEMV itself (takes_norm must hold)."""
    how = {} if norm is None else {"norm": norm}
    _by_type(w.qtype, "gemv_{}")(out, w, x, ids, stream=stream, threads=threads, **how)


def takes_norm(w: QWeight, T: int = 1, ids=None) -> bool:
    """Whether gemv(norm=) serves ``w`` for T tokens: a float type (F32 / F16 / BF16), one
    token, no ids, and a K one warp holds whole (the decode kernel's K-slice); not where the
    simulator prefers the thread-per-row kernel."""
    ty = _TYPES.get(w.qtype)
    if ty is None or ty is _Q8_0 or T != 1 or ids is not None or _sim_rows():
        return False
    EC = 4 * ty.epw
    return w.cols % EC == 0 and w.cols // EC <= 32 * _decode_shape(ty, 1)[0]


# ---- CI lane B and benchmarks --------------------------------------------------------------------
def _signatures():
    head = "void(float32[:, ::1], {}[:, :, ::1], float16[:, :, ::1], float32[:, ::1], int32[::1], "
    for ty in (_F32, _F16, _BF16, _Q8_0):
        h = head.format(np.dtype(ty.wdtype).name)
        ks = _KERNELS[ty.qtype]
        yield ks.naive, h + "int64, int64)"
        yield _ROWS[ty.qtype], h + "int64, int64)"
        tail = "int64, int64, int64, int64, int64, float32[::1], float32)"
        for kd in ks.decode.values():
            yield kd, h + tail
        if ks.norm:
            yield ks.norm, h + tail
        if ks.dp4a:  # x: the prepared limbs
            yield ks.dp4a, h.replace("float32[:, ::1], int32[::1]", "int32[:, ::1], int32[::1]") \
                + tail
        yield ks.batched, h.replace("void(float32[:, ::1]", "void(float32[:, :, ::1]") + \
            "int64, int64, int64, int64, int64)"
    yield _sum_splits, "void(float32[:, ::1], float32[:, :, ::1])"
    yield _q8_0_x_limbs, "void(int32[:, ::1], float32[:, ::1])"
    yield _q8_0_x_limbs_words, "void(int32[:, ::1], float32[:, ::1])"
    yield (_q8_0_x_limbs_norm,
           "void(int32[:, ::1], float32[:, ::1], float32[:, ::1], float32[::1], float32)")


PTX_SIGNATURES = list(_signatures())


def _random_weight(ty: _Type, N: int, K: int, rng, E: int = 1) -> QWeight:
    """Random planes at a real shape without quantising gigabytes on the host: random words
    (finite values for the float types) and Q8_0 scales of ~1e-3; E stacked weights (Q8_0)."""
    if ty is _Q8_0:
        qs = rng.integers(-2**31, 2**31, (E, N, K // 4), dtype=np.int32)
        d = rng.uniform(5e-4, 1.5e-3, (E, N, K // 32)).astype(np.float16)
        return QWeight(ty.qtype, N, K, E, (qs, d))
    raw = random_blocks(ty.qtype, (N, K), rng, 0.02)
    return globals()[f"pack_{ty.name}"](raw, N, K)


def _dense_bench_arrays(qtype, N: int, K: int, T: int, rng, stream):
    """A GEMM bench case's arrays: (host weight, its device copy, x on the host [T, K], x on
    the device, out [T, N] on the device), the weight drawn first."""
    host = _random_weight(_TYPES[qtype], N, K, rng)
    xh = rng.standard_normal((T, K)).astype(np.float32)
    return (host, host.to_device(stream), xh, cuda.to_device(xh, stream=stream),
            cuda.device_array((T, N), np.float32, stream=stream))


def bench_cases(stream) -> list[BenchCase]:
    """Decode GEMVs at V4-Flash shapes (the launcher's own kernel choice), each timed as a graph
    of 20 launches rotating over enough weight copies (>= 256 MB) that L2 (60 MB) cannot serve
    them; the batched GEMM at a 512-token prefill chunk; the naive kernel for comparison."""
    rng = np.random.default_rng()
    shapes = [("attn_q_b", 32768, 1024), ("attn_output_b", 4096, 8192), ("attn_q_a", 1024, 4096),
              ("attn_kv", 512, 4096), ("output", 129280, 4096), ("shexp_gate", 2048, 4096),
              ("shexp_down", 4096, 2048)]
    plan = [(_Q8_0, n, N, K, 1, m) for n, N, K in shapes for m in ("decode", "xregs")]
    # attn_output_a: 8 groups, each its own 1024 x 4096 weight and its own row of x (ids)
    plan += [(_Q8_0, "attn_output_a", 1024, 4096, 8, m) for m in ("decode", "xregs")]
    plan += [(_Q8_0, "attn_q_b", 32768, 1024, T, "decode") for T in (2, 4)]
    plan += [(ty, "square", 4096, 4096, 1, "decode") for ty in (_F32, _F16, _BF16)]
    plan += [(_Q8_0, "attn_output_b", 4096, 8192, 1, "naive"),
             (_Q8_0, "prefill", 4096, 4096, 512, "batched")]
    cases = []
    for ty, name, N, K, T, method in plan:
        grouped = name == "attn_output_a"
        host = _random_weight(ty, N, K, rng, E=T if grouped else 1)
        ids = cuda.to_device(np.arange(T, dtype=np.int32), stream=stream) if grouped else None
        copies = [host.to_device(stream) for _ in range(max(1, cdiv(256 << 20, host.nbytes)))]
        xh = rng.standard_normal((T, K)).astype(np.float32)
        x = cuda.to_device(xh, stream=stream)
        out = cuda.device_array((T, N), np.float32, stream=stream)
        fn = globals()[f"gemv_{ty.name}"]
        reps = 20 if method in ("decode", "xregs") else 2
        how = {"decode": None, "xregs": "decode"}.get(method, method)  # decode: as the model runs

        def one(w, fn=fn, out=out, x=x, how=how, ids=ids):
            return lambda: fn(out, w, x, ids, stream=stream, method=how)
        launch = capture_graph([one(copies[i % len(copies)]) for i in range(reps)], stream)

        def check(host=host, xh=xh, out=out, N=N):
            rows = min(N, 256)
            sub = QWeight(host.qtype, rows, host.cols, host.experts,
                          tuple(p[:, :rows] for p in host.planes))
            ref = np.empty((len(xh), rows))
            _gemv_ref(ref, sub, xh, np.arange(len(xh)) if host.experts > 1 else None)
            got = out.copy_to_host(stream=stream)[:, :rows]
            stream.synchronize()
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        target = ">= 75% copy bw" if ty is _Q8_0 and method == "decode" and (T == 1 or grouped) \
            else ""
        cases.append(BenchCase(
            "gemv", f"{method} {ty.name} {name} {N}x{K} T={T} (x{reps} per graph)", launch,
            bytes=reps * (host.nbytes + 4 * T * (K + N)), flops=reps * 2 * T * N * K,
            target=target, check=check, launches=reps))
    return cases
