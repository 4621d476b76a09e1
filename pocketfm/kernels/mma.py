"""Tensor-core GEMM for prefill: out[T, N] = x[T, K] · W[N, K]ᵀ for every weight type, on
``mma.sync`` (bf16 in, float32 accumulate) through inline PTX.

Why: a prefill chunk is matrix work (≈ 26 GFLOP per V4-Flash token), and the CUDA-core tiled
GEMMs (gemv.py, gemv_lowbit.py) run at 7-11.5 TFLOP/s on the H200, which caps prefill near 300
tok/s. numba-cuda exposes no tensor-core instruction, so ``_mma_bf16`` emits
``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` as inline PTX (the same way gemv.py
emits dp4a).

Accuracy: bf16 keeps 8 significant bits, too few for a reference-equal engine (the tests ask
rel. error <= 1e-4). Every value v is split as v ≈ hi + lo, hi = bf16(v), lo = bf16(v - hi)
(16 significant bits, |error| <= 2^-16 |v|), and each tile product is hi·hi + hi·lo + lo·hi
(the lo·lo term is below the error of the split): three MMAs per tile, "bf16x3". The weights
are dequantised to float32 by their type's ``word`` function (4 consecutive columns) as the
tile is filled, so one kernel serves Q8_0, F16, BF16, F32, Q2_K, Q4_K, IQ2_XXS and MXFP4.

Layout of one block (128 threads = 4 warps), per K step of KT = 32 columns:

    shared  w_hi, w_lo [BM, LDW] uint32   the BM weight rows, bf16 pairs (column 2i in the low half)
            x_hi, x_lo [BN, LDW] uint32   the BN tokens of the tile, likewise
    warp    WM x WN outputs = MI x NI tiles of 16 rows x 8 tokens, float32 in registers

An MMA's A operand is 16 weight rows x 16 columns ("row": K contiguous, as W is stored) and
its B operand 16 columns x 8 tokens ("col": K contiguous per token, as x is stored), so both
tiles are filled row by row. Fragment of lane (g = lane / 4, c = lane % 4), PTX ISA
"mma.m16n8k16": A regs = pairs (row g, pair c), (g+8, c), (g, c+4), (g+8, c+4); B regs = pairs
(token g, pair c), (g, c+4); C = (row g, tokens 2c, 2c+1), (row g+8, tokens 2c, 2c+1). LDW = 20
words per row: the 32 lanes' fragment reads g·20 + c land in 32 different banks.

Two kernels: the split kernel above for F32/F16/BF16/Q4_K/MXFP4, and for the types whose
weights are small integer codes times a scale (Q8_0, IQ2_XXS, Q2_K) a "codes" kernel with
exact bf16 codes and two MMAs per tile (see _mma_codes_kernel): only x is rounded. On a GPU
``gemm_mma`` hands those three types and F16 to hmma.py's float16 kernel (faster, x to 22
bits); the codes kernel and the split kernel's F16 stay for the simulator's tests and for A/B
runs (``f16=False``, POCKETFM_HMMA=0).

Expert-indexed rows (``ids``: the MoE's (token, expert) rows, the grouped output projection's
(group, token) rows): ``order`` lists the rows grouped by expert (``expert_order``), a tile
takes BN consecutive entries of it and loops over the experts present in the tile in
increasing order; in expert e's pass the rows of other experts hold x = 0, so each output gets
exactly its own expert's product (the others add exact zeros). Grouped rows make that one or
two passes per tile. The prefill's MoE goes further: expert_order also cuts each expert's
group into tiles of at most EXPERT_TILE = 32 rows (``tiles``), and block y takes tile y, so
every block makes one pass and fills its expert's weight tile for up to 32 rows (~24 rows per
expert in a 1,024-token chunk: about one fill per expert; tiles cut anywhere in ``order`` made
~2.5). Shared weights: 64 x 64 tiles.

In the simulator an MMA is emulated per warp through shared memory (every thread of the block
must call it, as with the shuffles elsewhere); sizes stay tiny there.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from ..engine.layout import EXPERT_TILE, expert_tiles_capacity
from ..quants import IQ2XXS_GRID, KSIGNS_IQ2XS, GGMLType
from .bench import BenchCase
from .device import SIMULATOR, cdiv, kernel, xor_shfl
from .gemv import (_STATE, _bits_f32, _dq_bf16, _dq_f16, _dq_q8_0, _dummies, _split_partials,
                   _sum_splits, gemm_splits, gemv_ref)
from .lowbit_layout import _f32_bits, _half, _mxfp4_word, _q4_k_word
from .qweight import QWeight

KT = 32  # columns per K step (one Q8_0 block; 256-column super-blocks hold 8)
LDW = KT // 2 + 4  # shared row length in uint32 words: 16 bf16 pairs + 4 (bank spread)
THREADS = 128  # 4 warps per block
XCH = 128 * 6 if SIMULATOR else 1  # simulator MMA exchange: 6 fragment words per thread
SHF = 128 if SIMULATOR else 1  # simulator lane exchange
MAX_E = 1024  # experts expert_order can count in shared memory
ALIGNED = 2  # per_token value of a launch over expert_order's tiles (1: BN entries of order)

# ---- the MMA instruction ------------------------------------------------------------------------
if SIMULATOR:
    def _fragment_index(K: int = 16, per: int = 2):
        """Where lane (g, c)'s fragment registers put A[r, k] and B[k, n] of an m16n8 MMA with
        ``K`` columns, ``per`` elements a 32-bit register (PTX ISA: mma.m16n8k16 .bf16 / .f16,
        K = 16, per = 2; mma.m16n8k32 .s8, K = 32, per = 4): (lane, register, element) per
        element, for the emulation; B's registers follow A's four."""
        h = K // 2
        r, k = np.meshgrid(np.arange(16), np.arange(K), indexing="ij")
        a = ((r % 8) * 4 + (k % h) // per, (r >= 8) + 2 * (k >= h), k % per)
        k, n = np.meshgrid(np.arange(K), np.arange(8), indexing="ij")
        b = (n * 4 + (k % h) // per, 4 + (k >= h), k % per)
        return a, b
    _FRAG_A, _FRAG_B = _fragment_index()

    def _half_matrix(words, frag, f16):
        lane, reg, half = frag
        bits = (words[lane, reg] >> (16 * half).astype(np.uint32)) & np.uint32(0xFFFF)
        if f16:
            return bits.astype(np.uint16).view(np.float16).astype(np.float64)
        return (bits << np.uint32(16)).view(np.float32).astype(np.float64)

    def _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch, f16):
        """The warp's fragments exchanged through ``xch`` (6 words a thread) between two
        barriers, so every thread of the block calls; then A·B + C for this lane."""
        t = cuda.threadIdx.x
        base, lane = t - t % 32, t % 32
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            xch[t * 6 + i] = int(v)
        cuda.syncthreads()
        words = np.array(xch[base * 6:(base + 32) * 6]).astype(np.uint32).reshape(32, 6)
        cuda.syncthreads()
        d = _half_matrix(words, _FRAG_A, f16) @ _half_matrix(words, _FRAG_B, f16)  # [16, 8]
        g, c = lane >> 2, lane & 3
        return (np.float32(d[g, 2 * c] + c0), np.float32(d[g, 2 * c + 1] + c1),
                np.float32(d[g + 8, 2 * c] + c2), np.float32(d[g + 8, 2 * c + 1] + c3))

    @cuda.jit(device=True)
    def _mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch):
        """One warp's m16n8k16 MMA: (d0, d1, d2, d3) = A·B + C on this lane's fragments
        (simulator: the warp's fragments exchanged through ``xch`` with barriers, so every
        thread of the block calls it)."""
        return _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch, False)

    @cuda.jit(device=True)
    def _mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch):
        """As _mma_bf16 with float16 operands (the same fragment layout)."""
        return _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch, True)

    def _ldsm_emulated(words, i, xch, trans):
        """ldmatrix.x4 for the simulator: each lane's row address (a word index into
        ``words``) exchanged through ``xch`` between two barriers, so every thread calls."""
        t = cuda.threadIdx.x
        base, lane = t - t % 32, t % 32
        xch[t * 6] = int(i)
        cuda.syncthreads()
        rows = [int(xch[(base + k) * 6]) for k in range(32)]
        cuda.syncthreads()
        g, c = lane >> 2, lane & 3

        def half(r, col):  # element col (0 .. 7) of the 8-element row at word index r
            return (int(words[r + col // 2]) >> (16 * (col % 2))) & 0xFFFF
        out = []
        for m in range(4):
            if trans:  # (row 2c, column g), (row 2c+1, column g)
                out.append(half(rows[8 * m + 2 * c], g) | half(rows[8 * m + 2 * c + 1], g) << 16)
            else:  # row g, columns 2c and 2c+1: its word c
                out.append(int(words[rows[8 * m + g] + c]))
        return tuple(np.uint32(v) for v in out)

    @cuda.jit(device=True)
    def _ldsm_x4(words, i, xch):
        """ldmatrix.m8n8.x4.b16 from shared ``words`` (uint32): lane 8m + r gives row r of
        matrix m as the word index ``i`` of its 8 bf16 (16 bytes, 16-byte aligned); returns the
        lane's word of each matrix (row g, columns 2c, 2c+1), as an MMA fragment wants them."""
        return _ldsm_emulated(words, i, xch, False)

    @cuda.jit(device=True)
    def _ldsm_x4_trans(words, i, xch):
        """As _ldsm_x4, transposed: the lane's word of matrix m is (row 2c, column g) in the
        low half and (row 2c+1, column g) in the high half."""
        return _ldsm_emulated(words, i, xch, True)

    @cuda.jit(device=True)
    def _cp_async16(dst, i, src, j):
        """Copy 16 bytes, global uint32 (or float32: its bits) src[j .. j+3] -> shared uint32
        dst[i .. i+3] (i, j multiples of 4), asynchronously on a GPU (cp.async.cg): complete
        after the thread's _cp_async_wait of its group, visible to the block after a barrier."""
        # (j: a flat index, as the GPU's pointer arithmetic)
        flat = src.reshape(src.size).view(np.uint32)
        for k in range(4):
            dst[i + k] = flat[j + k]

    @cuda.jit(device=True)
    def _cp_async_commit():
        """Close the thread's group of cp.async copies issued since the last commit."""
        return

    @cuda.jit(device=True)
    def _cp_async_wait1():
        """Wait until at most one of the thread's committed groups is still in flight."""
        return

    @cuda.jit(device=True)
    def _cp_async_wait0():
        """Wait until every one of the thread's committed groups has landed."""
        return

    @cuda.jit(device=True)
    def _cp_async_wait2():
        """Wait until at most two of the thread's committed groups are still in flight."""
        return
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _mma_intrinsic(ab: str):
        """m16n8k16 with ``ab`` (bf16 or f16) operands and float32 C / D."""
        ptx = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 {{$0, $1, $2, $3}}, "
               "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            if not (all(isinstance(v, types.Integer) for v in (a0, a1, a2, a3, b0, b1))
                    and all(v == types.float32 for v in (c0, c1, c2, c3))):
                return None

            def codegen(context, builder, sig, args):
                i32, f32 = ir.IntType(32), ir.FloatType()
                regs = [builder.trunc(v, i32) if t.bitwidth > 32 else v
                        for v, t in zip(args[:6], sig.args[:6])]
                fty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(fty, ptx, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                s = builder.call(asm, regs + list(args[6:]))
                return cgutils.pack_array(builder,
                                          [builder.extract_value(s, k) for k in range(4)])
            sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
            return sig, codegen
        return mma

    _mma_ptx, _mma_f16_ptx = _mma_intrinsic("bf16"), _mma_intrinsic("f16")

    def _shared_u32(context, builder, aty, ary_val, ity, i_val):
        """The 32-bit shared-window address of element i of shared array value ``ary_val``:
        the array's base converted once (a cvta with no side effect, so LLVM hoists it and
        shares it between accesses), then a 32-bit add that ptxas folds into the access's
        immediate offset (a generic address costs three 64-bit instructions an access)."""
        i32, i64 = ir.IntType(32), ir.IntType(64)
        ary = context.make_array(aty)(context, builder, ary_val)
        cvta = ir.InlineAsm(ir.FunctionType(i64, [i64]), "cvta.to.shared.u64 $0, $1;", "=l,l")
        base = builder.trunc(builder.call(cvta, [builder.ptrtoint(ary.data, i64)]), i32)
        k = builder.trunc(context.cast(builder, i_val, ity, types.int64), i32)
        size = context.get_abi_sizeof(context.get_data_type(aty.dtype))
        return builder.add(base, builder.mul(k, ir.Constant(i32, size)))

    def _ldsm_intrinsic(trans: bool):
        """ldmatrix.m8n8.x4 (``trans``: .trans) of shared uint32 words[i]."""
        ptx = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
               "{$0, $1, $2, $3}, [$4];")

        @intrinsic
        def ldsm(typingctx, words, i):
            if not (isinstance(words, types.Array) and words.dtype == types.uint32
                    and isinstance(i, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                addr = _shared_u32(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                fty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
                # side effect: it reads shared memory, so it stays between its barriers
                asm = ir.InlineAsm(fty, ptx, "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                s = builder.call(asm, [addr])
                return cgutils.pack_array(builder,
                                          [builder.extract_value(s, m) for m in range(4)])
            return types.UniTuple(types.uint32, 4)(words, i), codegen
        return ldsm

    _ldsm_ptx, _ldsm_trans_ptx = _ldsm_intrinsic(False), _ldsm_intrinsic(True)

    @cuda.jit(device=True)
    def _ldsm_x4(words, i, xch):
        return _ldsm_ptx(words, i)

    @cuda.jit(device=True)
    def _ldsm_x4_trans(words, i, xch):
        return _ldsm_trans_ptx(words, i)

    def _generic_ptr(context, builder, aty, ary_val, ity, i_val):
        """The generic address (i64) of element i of array value ``ary_val``."""
        ary = context.make_array(aty)(context, builder, ary_val)
        k = context.cast(builder, i_val, ity, types.int64)
        return builder.ptrtoint(builder.gep(ary.data, [k]), ir.IntType(64))

    @intrinsic
    def _cp_async_ptx(typingctx, dst, i, src, j):
        if not (isinstance(dst, types.Array) and dst.dtype == types.uint32 and
                isinstance(src, types.Array) and src.dtype in (types.uint32, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            d = _shared_u32(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            s = _generic_ptr(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            ptx = ("{ .reg .u64 ga; cvta.to.global.u64 ga, $1; "
                   "cp.async.cg.shared.global [$0], [ga], 16; }")
            fty = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64)])
            builder.call(ir.InlineAsm(fty, ptx, "r,l,~{memory}", side_effect=True), [d, s])
            return context.get_dummy_value()
        return types.none(dst, i, src, j), codegen

    def _asm_barrier(ptx: str):
        """An intrinsic that runs ``ptx`` (no operands) as a memory side effect."""
        @intrinsic
        def op(typingctx):
            def codegen(context, builder, sig, args):
                fty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fty, ptx, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return types.none(), codegen
        return op

    _commit_ptx = _asm_barrier("cp.async.commit_group;")
    _wait1_ptx = _asm_barrier("cp.async.wait_group 1;")
    _wait0_ptx = _asm_barrier("cp.async.wait_group 0;")
    _wait2_ptx = _asm_barrier("cp.async.wait_group 2;")

    @cuda.jit(device=True)
    def _cp_async16(dst, i, src, j):
        _cp_async_ptx(dst, i, src, j)

    @cuda.jit(device=True)
    def _cp_async_commit():
        _commit_ptx()

    @cuda.jit(device=True)
    def _cp_async_wait1():
        _wait1_ptx()

    @cuda.jit(device=True)
    def _cp_async_wait0():
        _wait0_ptx()

    @cuda.jit(device=True)
    def _cp_async_wait2():
        _wait2_ptx()

    @cuda.jit(device=True)
    def _mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch):
        return _mma_ptx(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @cuda.jit(device=True)
    def _mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch):
        return _mma_f16_ptx(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


# ---- bf16 split ----------------------------------------------------------------------------------
@cuda.jit(device=True)
def _bf16_round(v):
    """The bits of float32 ``v`` rounded to the nearest bf16 (ties to even), in the top half."""
    b = _f32_bits(v)
    return (b + uint32(0x7FFF) + ((b >> uint32(16)) & uint32(1))) & uint32(0xFFFF0000)


@cuda.jit(device=True)
def _split_pair(v0, v1):
    """(hi, lo) bf16 pairs of two float32 values (v0 in the low halves): v ≈ hi + lo."""
    h0, h1 = _bf16_round(v0), _bf16_round(v1)
    l0 = _bf16_round(v0 - _bits_f32(h0))
    l1 = _bf16_round(v1 - _bits_f32(h1))
    return (h0 >> uint32(16)) | h1, (l0 >> uint32(16)) | l1


def split_bf16_ref(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy form of the split (float32 arrays hi, lo with v ≈ hi + lo), for the tests."""
    def rnd(a):
        b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    hi = rnd(v)
    return hi, rnd(np.asarray(v, np.float32) - hi)


# ---- four consecutive columns of a weight row, as float32 (gemv.py's types) ----------------------
@cuda.jit(device=True)
def _f32_word(planes, e, n, c):
    w = planes[0]
    return w[e, n, 4 * c], w[e, n, 4 * c + 1], w[e, n, 4 * c + 2], w[e, n, 4 * c + 3]


@cuda.jit(device=True)
def _f16_word(planes, e, n, c):
    w0, w1 = planes[0][e, n, 2 * c], planes[0][e, n, 2 * c + 1]
    return _dq_f16(w0, 0), _dq_f16(w0, 1), _dq_f16(w1, 0), _dq_f16(w1, 1)


@cuda.jit(device=True)
def _bf16_word(planes, e, n, c):
    w0, w1 = planes[0][e, n, 2 * c], planes[0][e, n, 2 * c + 1]
    return _dq_bf16(w0, 0), _dq_bf16(w0, 1), _dq_bf16(w1, 0), _dq_bf16(w1, 1)


# ---- pieces both kernels share -------------------------------------------------------------------
@cuda.jit(device=True)
def _block_coords(WC, BM, BN, K, ks):
    """This thread's fragment coordinates (g, c), its warp's place (wr, wc) in the WR x WC warp
    grid, the block's first weight row and tile entry, and its K split [kb, ke)."""
    lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
    kb = cuda.blockIdx.z * ks
    return (lane >> 2, lane & 3, warp // WC, warp % WC, cuda.blockIdx.x * BM,
            cuda.blockIdx.y * BN, kb, min(K, kb + ks))


@cuda.jit(device=True)
def _tile_rows(rows, exps, ids, order, tiles, per_token, i0, T):
    """rows[j], exps[j]: the x / out row of the tile's entry j and its expert (-1: none).
    The tile is entries [i0, i0 + BN) of ``order``, or with per_token == ALIGNED the entries
    [tiles[0, y], tiles[1, y]): one expert's rows (expert_order's tiles)."""
    first, end = i0, T
    if per_token == ALIGNED:
        first, end = tiles[0, cuda.blockIdx.y], tiles[1, cuda.blockIdx.y]
    for j in range(cuda.threadIdx.x, rows.shape[0], cuda.blockDim.x):
        r, ex = -1, -1
        if first + j < end:
            r = order[first + j] if per_token else first + j
            ex = ids[r] if per_token else 0
        rows[j], exps[j] = r, ex
    cuda.syncthreads()


@cuda.jit(device=True)
def _next_expert(exps, e_prev):
    """The smallest expert above e_prev among the tile's rows (1 << 30: none left)."""
    e = 1 << 30
    for j in range(exps.shape[0]):
        if e_prev < exps[j] < e:
            e = exps[j]
    return e


@cuda.jit(device=True)
def _store_tile(out, acc, rows, n_warp, N, j_warp, MI, NI):
    """Write the warp's MI x NI accumulator tiles (rows from n_warp, tile entries from j_warp)
    to out[split, row, n], by the C fragment layout."""
    lane = cuda.threadIdx.x & 31
    g, c = lane >> 2, lane & 3
    z = cuda.blockIdx.z
    for mi in range(MI):
        na = n_warp + mi * 16 + g
        for ni in range(NI):
            j = j_warp + ni * 8 + 2 * c
            q = (mi * NI + ni) * 4
            for h in range(2):
                r = rows[j + h]
                if r >= 0:
                    if na < N:
                        out[z, r, na] = acc[q + h]
                    if na + 8 < N:
                        out[z, r, na + 8] = acc[q + 2 + h]


# ---- the split kernel ----------------------------------------------------------------------------
def _mma_kernel(name: str, word, MI: int, NI: int, WR: int, WC: int):
    """Block tile BM = WR·16·MI weight rows x BN = WC·8·NI tokens; warp (wr, wc) of the WR x WC
    grid owns MI x NI MMA tiles."""
    WM, WN = 16 * MI, 8 * NI
    BM, BN = WR * WM, WC * WN
    WPR = KT // 4  # 4-column words per row per K step
    N_ACC = MI * NI * 4

    def k(out, planes, x, ids, order, tiles, tab_g, per_token, N, K, ks):
        # out [S, T, N]; grid (N / BM, T / BN, S): split s sums columns [s·ks, (s+1)·ks)
        T = x.shape[0]
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        g, c, wr, wc, n0, i0, kb, ke = _block_coords(WC, BM, BN, K, ks)
        w_hi = cuda.shared.array((BM, LDW), uint32)
        w_lo = cuda.shared.array((BM, LDW), uint32)
        x_hi = cuda.shared.array((BN, LDW), uint32)
        x_lo = cuda.shared.array((BN, LDW), uint32)
        rows = cuda.shared.array(BN, int32)  # the x / out row of each tile entry (-1: none)
        exps = cuda.shared.array(BN, int32)  # its expert
        xch = cuda.shared.array(XCH, np.int64)
        acc = cuda.local.array(N_ACC, float32)
        for i in range(N_ACC):
            acc[i] = float32(0)
        _tile_rows(rows, exps, ids, order, tiles, per_token, i0, T)
        e_prev = -1
        while True:  # one pass per expert present in the tile, in increasing order
            e = _next_expert(exps, e_prev)
            if e == 1 << 30:
                break
            for k0 in range(kb, ke, KT):
                for idx in range(tid, BM * WPR, nt):
                    r, cw = idx // WPR, idx % WPR
                    n = n0 + r
                    v0, v1, v2, v3 = float32(0), float32(0), float32(0), float32(0)
                    if n < N and k0 + 4 * cw < ke:
                        v0, v1, v2, v3 = word(planes, e, n, (k0 >> 2) + cw)
                    w_hi[r, 2 * cw], w_lo[r, 2 * cw] = _split_pair(v0, v1)
                    w_hi[r, 2 * cw + 1], w_lo[r, 2 * cw + 1] = _split_pair(v2, v3)
                for idx in range(tid, BN * WPR, nt):
                    j, cw = idx // WPR, idx % WPR
                    r, col = rows[j], k0 + 4 * cw
                    v0, v1, v2, v3 = float32(0), float32(0), float32(0), float32(0)
                    if r >= 0 and exps[j] == e and col < ke:
                        v0, v1, v2, v3 = x[r, col], x[r, col + 1], x[r, col + 2], x[r, col + 3]
                    x_hi[j, 2 * cw], x_lo[j, 2 * cw] = _split_pair(v0, v1)
                    x_hi[j, 2 * cw + 1], x_lo[j, 2 * cw + 1] = _split_pair(v2, v3)
                cuda.syncthreads()
                for kk in range(0, KT // 2, 8):  # two k16 steps, in pair units
                    for mi in range(MI):
                        ra = wr * WM + mi * 16 + g
                        ah0, ah1 = w_hi[ra, kk + c], w_hi[ra + 8, kk + c]
                        ah2, ah3 = w_hi[ra, kk + c + 4], w_hi[ra + 8, kk + c + 4]
                        al0, al1 = w_lo[ra, kk + c], w_lo[ra + 8, kk + c]
                        al2, al3 = w_lo[ra, kk + c + 4], w_lo[ra + 8, kk + c + 4]
                        for ni in range(NI):
                            tb = wc * WN + ni * 8 + g
                            bh0, bh1 = x_hi[tb, kk + c], x_hi[tb, kk + c + 4]
                            bl0, bl1 = x_lo[tb, kk + c], x_lo[tb, kk + c + 4]
                            q = (mi * NI + ni) * 4
                            d0, d1, d2, d3 = _mma_bf16(ah0, ah1, ah2, ah3, bl0, bl1, acc[q],
                                                       acc[q + 1], acc[q + 2], acc[q + 3], xch)
                            d0, d1, d2, d3 = _mma_bf16(al0, al1, al2, al3, bh0, bh1, d0, d1,
                                                       d2, d3, xch)
                            d0, d1, d2, d3 = _mma_bf16(ah0, ah1, ah2, ah3, bh0, bh1, d0, d1,
                                                       d2, d3, xch)
                            acc[q], acc[q + 1], acc[q + 2], acc[q + 3] = d0, d1, d2, d3
                cuda.syncthreads()
            e_prev = e
        _store_tile(out, acc, rows, n0 + wr * WM, N, wc * WN, MI, NI)
    k.__name__ = k.__qualname__ = f"_gemm_{name}_mma_{BM}x{BN}"
    return kernel(k), BM, BN



# ---- the codes kernel: exact integer weight codes, scales applied per 16 columns -----------------
# Q8_0, IQ2_XXS and Q2_K weights are small integers ("codes": int8, ±grid bytes, 0..3) times a
# scale per 16 or 32 columns (minus a min per 16 for Q2_K). Codes are exact in bf16, so the A
# operand needs no split: per 16 columns h the MMAs give D = codes · (x_hi + x_lo) (two MMAs,
# not three), and out += s[row, h] · D - m[row, h] · Σx[token, h]. Filling the tile is bit
# work on the packed words (no float dequantisation per weight): these types' tiles fill
# several times faster than through ``word``, and they are the bulk of a ds4 file.
#
# Per type two functions, so that the kernel can issue the next K step's global loads before
# this step's MMAs (the loads' latency hides behind them):
#   load(planes, e, n, k) -> raw: the words that hold row n, columns k .. k+15 (global reads)
#   codes(raw, k, tab) -> (8 bf16 code pairs of those columns; s; m): bit work only

@cuda.jit(device=True)
def _bf16_bits(v):
    """bf16 bits (low half) of float32 ``v`` that bf16 holds exactly (small integers)."""
    return _f32_bits(v) >> uint32(16)


@cuda.jit(device=True)
def _q8_0_load(planes, e, n, k):
    qs, d = planes
    return (qs[e, n, k >> 2], qs[e, n, (k >> 2) + 1], qs[e, n, (k >> 2) + 2],
            qs[e, n, (k >> 2) + 3], float32(d[e, n, k >> 5]))


@cuda.jit(device=True)
def _q8_0_codes(raw, k, tab):
    w0, w1, w2, w3, d = raw
    p = (_bf16_bits(_dq_q8_0(w0, 0)) | (_bf16_bits(_dq_q8_0(w0, 1)) << uint32(16)),
         _bf16_bits(_dq_q8_0(w0, 2)) | (_bf16_bits(_dq_q8_0(w0, 3)) << uint32(16)),
         _bf16_bits(_dq_q8_0(w1, 0)) | (_bf16_bits(_dq_q8_0(w1, 1)) << uint32(16)),
         _bf16_bits(_dq_q8_0(w1, 2)) | (_bf16_bits(_dq_q8_0(w1, 3)) << uint32(16)),
         _bf16_bits(_dq_q8_0(w2, 0)) | (_bf16_bits(_dq_q8_0(w2, 1)) << uint32(16)),
         _bf16_bits(_dq_q8_0(w2, 2)) | (_bf16_bits(_dq_q8_0(w2, 3)) << uint32(16)),
         _bf16_bits(_dq_q8_0(w3, 0)) | (_bf16_bits(_dq_q8_0(w3, 1)) << uint32(16)),
         _bf16_bits(_dq_q8_0(w3, 2)) | (_bf16_bits(_dq_q8_0(w3, 3)) << uint32(16)))
    return p, d, float32(0)


# IQ2_XXS: the 256 grid rows as bf16 pairs of magnitudes (4 words a row), then KSIGNS as words;
# copied into shared memory once per block. A pair's signs are an XOR of its two sign bits.
_IQ2_TAB = np.concatenate([
    (IQ2XXS_GRID.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32).reshape(256, 4, 2)
    .dot(np.array([1, 1 << 16], np.uint64)).astype(np.uint32).ravel(),
    KSIGNS_IQ2XS.astype(np.uint32)])
IQ2_TAB_WORDS = len(_IQ2_TAB)  # 1024 + 128


@cuda.jit(device=True)
def _iq2_xxs_pairs(tab, idx, signs, p):
    """Pair p (elements 2p, 2p+1) of grid row idx with the signs of 8-bit mask ``signs``."""
    m = (((signs >> uint32(2 * p)) & uint32(1)) << uint32(15)) | (
        ((signs >> uint32(2 * p + 1)) & uint32(1)) << uint32(31))
    return tab[idx * 4 + p] ^ m


@cuda.jit(device=True)
def _iq2_xxs_load(planes, e, n, k):
    qs, d = planes
    return qs[e, n, k >> 5], float32(d[e, n, k >> 8])


@cuda.jit(device=True)
def _iq2_xxs_codes(raw, k, tab):
    w, d = raw
    grids, sw = _half(w, 0), _half(w, 1)
    sub = (k >> 3) & 2  # the first of the two 8-column sub-groups
    i0 = int32((grids >> uint32(8 * sub)) & uint32(255))
    i1 = int32((grids >> uint32(8 * sub + 8)) & uint32(255))
    s0 = tab[1024 + int32((sw >> uint32(7 * sub)) & uint32(127))]
    s1 = tab[1024 + int32((sw >> uint32(7 * sub + 7)) & uint32(127))]
    db = d * (float32(0.5) + float32(sw >> uint32(28))) * float32(0.25)
    p = (_iq2_xxs_pairs(tab, i0, s0, 0), _iq2_xxs_pairs(tab, i0, s0, 1),
         _iq2_xxs_pairs(tab, i0, s0, 2), _iq2_xxs_pairs(tab, i0, s0, 3),
         _iq2_xxs_pairs(tab, i1, s1, 0), _iq2_xxs_pairs(tab, i1, s1, 1),
         _iq2_xxs_pairs(tab, i1, s1, 2), _iq2_xxs_pairs(tab, i1, s1, 3))
    return p, db, float32(0)


@cuda.jit(device=True)
def _q2_pair(b, j, lo):
    """bf16 pair of the 2-bit codes at shift 2j of bytes ``lo`` and ``lo + 1`` of word b."""
    q0 = (b >> uint64(8 * lo + 2 * j)) & uint64(3)
    q1 = (b >> uint64(8 * lo + 8 + 2 * j)) & uint64(3)
    return uint32(_bf16_of_q(q0)) | (uint32(_bf16_of_q(q1)) << uint32(16))


@cuda.jit(device=True)
def _bf16_of_q(q):
    """bf16 bits of the float q in 0..3 (0x0000, 0x3F80, 0x4000, 0x4040)."""
    return (uint64(0x404040003F800000) >> (uint64(16) * q)) & uint64(0xFFFF)


@cuda.jit(device=True)
def _q2_k_load(planes, e, n, k):
    qs, sc, dm = planes
    s, i = k >> 8, k & 255
    h, l0 = i >> 7, i & 16
    q = s * 8 + ((32 * h + l0) >> 3)
    return (qs[e, n, q], qs[e, n, q + 1], sc[e, n, s * 4 + 2 * h + (l0 >> 4)],
            float32(dm[e, n, 2 * s]), float32(dm[e, n, 2 * s + 1]))


@cuda.jit(device=True)
def _q2_k_codes(raw, k, tab):
    a, b, scw, d, dmin = raw
    j = (k >> 5) & 3
    sb = int32((scw >> uint32(8 * j)) & uint32(255))
    p = (_q2_pair(a, j, 0), _q2_pair(a, j, 2), _q2_pair(a, j, 4), _q2_pair(a, j, 6),
         _q2_pair(b, j, 0), _q2_pair(b, j, 2), _q2_pair(b, j, 4), _q2_pair(b, j, 6))
    return p, d * float32(sb & 15), dmin * float32(sb >> 4)


@cuda.jit(device=True)
def _load_x(xv, x, rows, exps, e, k0, tid, XPT):
    """xv[4u .. 4u+3] <- the 4 x columns of tile word tid + u·THREADS at K step k0 (zeros for
    rows of other experts or none)."""
    for u in range(XPT):
        idx = tid + u * THREADS
        j, cw = idx // (KT // 4), idx % (KT // 4)
        r, col = rows[j], k0 + 4 * cw
        v0, v1, v2, v3 = float32(0), float32(0), float32(0), float32(0)
        if r >= 0 and exps[j] == e:
            v0, v1, v2, v3 = x[r, col], x[r, col + 1], x[r, col + 2], x[r, col + 3]
        xv[4 * u], xv[4 * u + 1], xv[4 * u + 2], xv[4 * u + 3] = v0, v1, v2, v3


def _mma_codes_kernel(name: str, load, codes, MI: int, NI: int, WR: int, WC: int, TAB: int,
                      MINS: bool):
    """As _mma_kernel, for a type with codes (``load`` + ``codes``): one code plane, scales per
    16 columns, two MMAs per tile; ``TAB`` words of ``tab`` (global) copied into shared first;
    ``MINS``: the type subtracts a min per 16 columns (Q2_K), so the tile needs Σx.

    Each thread fills one (row, 16 columns) of the weight tile and XPT 4-column words of x per
    K step (BM = 64 rows: 2 x 64 = the block's 128 threads). The next step's weight words and x
    are loaded into registers right after this step's tile is in shared memory, so their
    global latency overlaps the MMAs instead of stalling the fill."""
    WM, WN = 16 * MI, 8 * NI
    BM, BN = WR * WM, WC * WN
    N_ACC = MI * NI * 4
    N_TAB = max(TAB, 1)
    XPT = BN * (KT // 4) // THREADS  # x words per thread per K step
    assert 2 * BM == THREADS and XPT * THREADS == BN * (KT // 4), (BM, BN)
    N_XV = 4 * XPT

    def k(out, planes, x, ids, order, tiles, tab_g, per_token, N, K, ks):
        T = x.shape[0]
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        g, c, wr, wc, n0, i0, kb, ke = _block_coords(WC, BM, BN, K, ks)
        w_c = cuda.shared.array((BM, LDW), uint32)  # bf16 code pairs
        w_s = cuda.shared.array((BM, 2), float32)  # scale per 16 columns
        w_m = cuda.shared.array((BM, 2), float32)  # min per 16 columns (Q2_K)
        x_hi = cuda.shared.array((BN, LDW), uint32)
        x_lo = cuda.shared.array((BN, LDW), uint32)
        x_sum = cuda.shared.array((BN, 2), float32)  # Σx per 16 columns
        tab = cuda.shared.array(N_TAB, uint32)
        rows = cuda.shared.array(BN, int32)
        exps = cuda.shared.array(BN, int32)
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        acc = cuda.local.array(N_ACC, float32)
        xv = cuda.local.array(N_XV, float32)  # this thread's x words of the next K step
        for i in range(N_ACC):
            acc[i] = float32(0)
        for i in range(tid, TAB, nt):
            tab[i] = tab_g[i]
        _tile_rows(rows, exps, ids, order, tiles, per_token, i0, T)
        rf, hf = tid >> 1, tid & 1  # this thread's weight row and 16 columns in the tile
        nf = min(n0 + rf, N - 1)  # rows past N load row N - 1 and store zeros
        e_prev = -1
        while True:
            e = _next_expert(exps, e_prev)
            if e == 1 << 30:
                break
            raw = load(planes, e, nf, kb + 16 * hf)
            _load_x(xv, x, rows, exps, e, kb, tid, XPT)
            for k0 in range(kb, ke, KT):
                p, sc, mn = codes(raw, k0 + 16 * hf, tab)
                if n0 + rf < N:
                    for q in range(8):
                        w_c[rf, 8 * hf + q] = p[q]
                    w_s[rf, hf], w_m[rf, hf] = sc, mn
                else:
                    for q in range(8):
                        w_c[rf, 8 * hf + q] = uint32(0)
                    w_s[rf, hf], w_m[rf, hf] = float32(0), float32(0)
                for u in range(XPT):
                    idx = tid + u * THREADS
                    j, cw = idx // (KT // 4), idx % (KT // 4)
                    v0, v1, v2, v3 = xv[4 * u], xv[4 * u + 1], xv[4 * u + 2], xv[4 * u + 3]
                    x_hi[j, 2 * cw], x_lo[j, 2 * cw] = _split_pair(v0, v1)
                    x_hi[j, 2 * cw + 1], x_lo[j, 2 * cw + 1] = _split_pair(v2, v3)
                    if MINS:  # Σx of 16 columns: the 4 lanes cw = 4h .. 4h+3 (THREADS % 8 == 0)
                        sm = (v0 + v1) + (v2 + v3)
                        sm += xor_shfl(sm, 1, shf)
                        sm += xor_shfl(sm, 2, shf)
                        if cw % 4 == 0:
                            x_sum[j, cw >> 2] = sm
                cuda.syncthreads()
                if k0 + KT < ke:  # the next step's loads, in flight during the MMAs below
                    raw = load(planes, e, nf, k0 + KT + 16 * hf)
                    _load_x(xv, x, rows, exps, e, k0 + KT, tid, XPT)
                for h in range(2):
                    kk = 8 * h
                    for mi in range(MI):
                        ra = wr * WM + mi * 16 + g
                        a0, a1 = w_c[ra, kk + c], w_c[ra + 8, kk + c]
                        a2, a3 = w_c[ra, kk + c + 4], w_c[ra + 8, kk + c + 4]
                        sa, sb = w_s[ra, h], w_s[ra + 8, h]
                        ma, mb = (w_m[ra, h], w_m[ra + 8, h]) if MINS else (sa, sb)
                        for ni in range(NI):
                            tb = wc * WN + ni * 8 + g
                            z = float32(0)
                            d0, d1, d2, d3 = _mma_bf16(a0, a1, a2, a3, x_lo[tb, kk + c],
                                                       x_lo[tb, kk + c + 4], z, z, z, z, xch)
                            d0, d1, d2, d3 = _mma_bf16(a0, a1, a2, a3, x_hi[tb, kk + c],
                                                       x_hi[tb, kk + c + 4], d0, d1, d2, d3, xch)
                            j0 = wc * WN + ni * 8 + 2 * c
                            q = (mi * NI + ni) * 4
                            if MINS:
                                acc[q] += sa * d0 - ma * x_sum[j0, h]
                                acc[q + 1] += sa * d1 - ma * x_sum[j0 + 1, h]
                                acc[q + 2] += sb * d2 - mb * x_sum[j0, h]
                                acc[q + 3] += sb * d3 - mb * x_sum[j0 + 1, h]
                            else:
                                acc[q] += sa * d0
                                acc[q + 1] += sa * d1
                                acc[q + 2] += sb * d2
                                acc[q + 3] += sb * d3
                cuda.syncthreads()
            e_prev = e
        _store_tile(out, acc, rows, n0 + wr * WM, N, wc * WN, MI, NI)
    k.__name__ = k.__qualname__ = f"_gemm_{name}_mma_codes_{BM}x{BN}"
    return kernel(k), BM, BN


@kernel
def _expert_order(order, ids, n_experts, tiles, tile_rows):
    """order[R]: the rows 0..R-1 grouped by ids[row], experts increasing (one block; inside a
    group the order is whatever the atomics give: no output depends on it, see the module
    docstring). tile_rows > 0: also tiles[:, i] = (first, end) positions in ``order`` of the
    i-th tile of at most tile_rows rows of one expert, experts increasing; (0, 0) past them."""
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    R = ids.shape[0]
    start = cuda.shared.array(MAX_E, int32)
    count = cuda.shared.array(MAX_E, int32)
    tfirst = cuda.shared.array(MAX_E, int32)  # the expert's first tile
    total = cuda.shared.array(1, int32)
    for e in range(tid, n_experts, nt):
        start[e] = 0
    cuda.syncthreads()
    for i in range(tid, R, nt):
        cuda.atomic.add(start, ids[i], 1)
    cuda.syncthreads()
    if tid == 0:
        run, tr = 0, 0
        for e in range(n_experts):
            cnt = start[e]
            start[e], count[e], tfirst[e] = run, cnt, tr
            run += cnt
            if tile_rows > 0:
                tr += (cnt + tile_rows - 1) // tile_rows
        total[0] = tr
    cuda.syncthreads()
    if tile_rows > 0:  # before the scatter below moves start[e] on
        for e in range(tid, n_experts, nt):
            for j in range((count[e] + tile_rows - 1) // tile_rows):
                tiles[0, tfirst[e] + j] = start[e] + j * tile_rows
                tiles[1, tfirst[e] + j] = start[e] + min(count[e], (j + 1) * tile_rows)
        for i in range(total[0] + tid, tiles.shape[1], nt):
            tiles[0, i], tiles[1, i] = 0, 0
        cuda.syncthreads()
    for i in range(tid, R, nt):
        order[cuda.atomic.add(start, ids[i], 1)] = i


def expert_order_ref(order, ids, n_experts, tiles=None, tile: int = EXPERT_TILE) -> None:
    """NumPy reference: the rows sorted by expert, stably (the kernel's order inside an
    expert's group may differ), and the expert-aligned tiles of ``tile`` rows."""
    order[:] = np.argsort(np.asarray(ids), kind="stable").astype(np.int32)
    if tiles is not None:
        counts = np.bincount(np.asarray(ids), minlength=n_experts)
        starts = np.concatenate([[0], np.cumsum(counts)])
        spans = [(starts[e] + j, min(starts[e + 1], starts[e] + j + tile))
                 for e in range(n_experts) for j in range(0, counts[e], tile)]
        tiles[:] = 0
        if spans:
            tiles[:, :len(spans)] = np.array(spans, np.int32).T


def expert_order(order, ids, n_experts: int, stream=0, tiles=None,
                 tile: int = EXPERT_TILE) -> None:
    """order int32 [R] (device) <- the rows of ids int32 [R] grouped by expert, increasing;
    ``tiles`` int32 [2, expert_tiles_capacity(R, n_experts, tile)]: also the tiles of at most
    ``tile`` rows of one expert each, for gemm_mma(..., tiles=) (EXPERT_TILE) or hmma's
    64-token build (64)."""
    if n_experts > MAX_E:
        raise ValueError(f"expert_order counts at most {MAX_E} experts, got {n_experts}")
    R = ids.shape[0]
    if tiles is not None:
        need = expert_tiles_capacity(R, n_experts, tile)
        assert tiles.shape[0] == 2 and tiles.shape[1] >= need, (tiles.shape, need)
    _expert_order[1, 64 if SIMULATOR else 1024, stream](
        order, ids, n_experts, _no_tiles() if tiles is None else tiles,
        0 if tiles is None else tile)


# ---- launcher ------------------------------------------------------------------------------------
_WORDS = {GGMLType.F32: ("f32", _f32_word), GGMLType.F16: ("f16", _f16_word),
          GGMLType.BF16: ("bf16", _bf16_word), GGMLType.Q4_K: ("q4_k", _q4_k_word),
          GGMLType.MXFP4: ("mxfp4", _mxfp4_word)}
_CODES = {GGMLType.Q8_0: ("q8_0", _q8_0_load, _q8_0_codes, 0, False),
          GGMLType.Q2_K: ("q2_k", _q2_k_load, _q2_k_codes, 0, True),
          GGMLType.IQ2_XXS: ("iq2_xxs", _iq2_xxs_load, _iq2_xxs_codes, IQ2_TAB_WORDS, False)}
# (wide, narrow) per type: 64 weight rows x 64 tokens (2 x 2 warps of 32 x 32) for shared
# weights; 64 x 32 (4 warps of 16 x 32) for expert rows, ~24 per expert in a 1,024-token MoE
# chunk: with expert_order's tiles each expert's weight tile is then filled about once per
# chunk (with 16-token tiles cut anywhere in ``order`` it was ~2.5 times). Q8_0 takes its codes
# kernel for both although the split kernel runs dense Q8_0 faster
# (H200 2026-12-01, attn_q_b: 23.8 TFLOP/s against 17.8): a weight q·d carries up to 19
# significant bits, so its hi + lo split rounds it (2^-17), while the codes are exact; on
# `small` after a 1K prompt that was 30 of 64 greedy steps above the 1e-3 logits bar and a
# token flip at step 36 (split) against none above it and 64 / 64 equal tokens (codes).
_KERNELS = {qt: [_mma_kernel(nm, wd, 2, 4, 2, 2)] for qt, (nm, wd) in _WORDS.items()}
for qt, (nm, ld, cd, tw, mins) in _CODES.items():
    _KERNELS[qt] = [_mma_codes_kernel(nm, ld, cd, 2, 4, 2, 2, tw, mins),
                    _mma_codes_kernel(nm, ld, cd, 1, 4, 4, 1, tw, mins)]
    assert _KERNELS[qt][1][2] == EXPERT_TILE
NARROW_ROWS_PER_EXPERT = 32  # fewer rows per expert on average: the narrow tile


def supports(w: QWeight) -> bool:
    """Whether gemm_mma runs this weight (its type, and rows of whole K steps)."""
    return w.qtype in _KERNELS and w.cols % KT == 0


def _device_const(key: str, host: np.ndarray):
    """A constant device array, uploaded once."""
    if key not in _STATE:
        _STATE[key] = cuda.to_device(host)
    return _STATE[key]


def _no_tiles():
    """int32 [2, 1]: stands in for absent expert tiles."""
    return _device_const("mma_no_tiles", np.zeros((2, 1), np.int32))


def gemm_mma(out, w: QWeight, x, ids=None, order=None, stream=0, split_k=None,
             narrow=None, tiles=None, f16=None) -> None:
    """out float32 [T, N] (device) = W · x[t], or W[ids[t]] · x[t]; x float32 [T, K].
    ``order`` (int32 [T], from expert_order) lists the rows grouped by expert; without it the
    rows are taken as they come (right, and fast when already grouped). ``tiles`` (with ids and
    order: expert_order's tiles of the same call) makes each block one expert's rows, so an
    expert's weight tile is filled once per EXPERT_TILE of its rows. ``split_k`` forces the
    K splits (default: enough for two blocks per SM; none with ids), ``narrow`` the 32-token
    tile (default: with tiles, or with ids and fewer than NARROW_ROWS_PER_EXPERT rows per
    expert). ``f16``: run Q8_0 / IQ2_XXS / Q2_K / F16 on hmma.py's float16 kernel (default:
    on a GPU, ``hmma.takes``), not this module's bf16 codes kernel (which split_k / narrow ask
    for)."""
    T, N, K = x.shape[0], w.rows, w.cols
    assert out.shape == (T, N) and supports(w), (out.shape, w, x.shape)
    from . import hmma  # builds on this module
    if (hmma.takes(w) if f16 is None else f16) and split_k is None and narrow is None:
        hmma.gemm_hmma(out, w, x, ids, order, stream, tiles)
        return
    per_token = ids is not None
    assert tiles is None or (per_token and order is not None), "tiles come with ids and order"
    kernels = _KERNELS[w.qtype]
    if narrow is None:
        narrow = per_token and (tiles is not None or T < NARROW_ROWS_PER_EXPERT * w.experts)
    kern, BM, BN = kernels[1 if narrow and len(kernels) > 1 else 0]
    assert tiles is None or BN >= EXPERT_TILE  # a tile's rows fit the block (any kernel here)
    one = _dummies()[0]  # int32 [1]: stands in for absent ids / order
    if per_token and order is None:
        order = _device_const(f"mma_identity_{T}", np.arange(T, dtype=np.int32))
    tab = (_device_const("mma_iq2_tab", _IQ2_TAB) if w.qtype == GGMLType.IQ2_XXS else
           _device_const("mma_no_tab", np.zeros(1, np.uint32)))
    gx, gy = cdiv(N, BM), (cdiv(T, BN) if tiles is None else tiles.shape[1])
    ks = cdiv(cdiv(K, split_k or (1 if per_token else gemm_splits(gx * gy, K))), KT) * KT
    S = cdiv(K, ks)
    dest = out.reshape(1, T, N) if S == 1 else _split_partials(S, T, N)
    kern[(gx, gy, S), THREADS, stream](dest, w.planes, x, ids if per_token else one,
                                       order if per_token else one,
                                       _no_tiles() if tiles is None else tiles, tab,
                                       ALIGNED if tiles is not None else int(per_token), N, K, ks)
    if S > 1:
        _sum_splits[min(cdiv(T * N, 256), 4096), 256, stream](out, dest)


def gemm_mma_ref(out, w: QWeight, x, ids=None, order=None) -> None:
    """NumPy reference (``order`` changes the kernel's schedule, not the result)."""
    gemv_ref(out, w, x, ids)


# ---- CI lane B and benchmarks --------------------------------------------------------------------
_PLANES = {  # the planes tuple of each type, as Numba types
    GGMLType.F32: "UniTuple(float32[:, :, ::1], 1)", GGMLType.F16: "UniTuple(int32[:, :, ::1], 1)",
    GGMLType.BF16: "UniTuple(int32[:, :, ::1], 1)",
    GGMLType.Q8_0: "Tuple((int32[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.Q2_K: "Tuple((uint64[:, :, ::1], uint32[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.Q4_K: "Tuple((uint64[:, :, ::1], uint32[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.IQ2_XXS: "Tuple((uint64[:, :, ::1], float16[:, :, ::1]))",
    GGMLType.MXFP4: "Tuple((uint64[:, :, ::1], uint8[:, :, ::1]))",
}
PTX_SIGNATURES = [
    (kern, f"void(float32[:, :, ::1], {_PLANES[qt]}, float32[:, ::1], int32[::1], int32[::1], "
           "int32[:, ::1], uint32[::1], int64, int64, int64, int64)")
    for qt, ks in _KERNELS.items() for kern, _, _ in ks
] + [(_expert_order, "void(int32[::1], int32[::1], int64, int32[:, ::1], int64)")]


def bench_cases(stream) -> list[BenchCase]:
    """A 512-token prefill chunk at V4-Flash shapes: the shared Q8_0 projections q_b and out_b,
    and the routed experts (IQ2_XXS gate+up, Q2_K down) over the 3,072 (token, expert) rows of
    256 experts, grouped by expert_order (with and without its expert tiles; the prefill uses
    them), beside the expert-indexed dp4a GEMV that ran them before (same rows, same
    weights)."""
    from . import gemv_lowbit
    from .gemv import _dense_bench_arrays
    rng = np.random.default_rng(0)
    cases = []
    T = 512
    for name, N, K in (("attn_q_b", 32768, 1024), ("attn_output_b", 4096, 8192)):
        host, dev, xh, x, out = _dense_bench_arrays(GGMLType.Q8_0, N, K, T, rng, stream)

        def check(host=host, xh=xh, out=out, N=N):
            rows = min(N, 256)
            sub = QWeight(host.qtype, rows, host.cols, 1, tuple(p[:, :rows] for p in host.planes))
            ref = np.empty((T, rows))
            gemv_ref(ref, sub, xh)
            got = out.copy_to_host(stream=stream)[:, :rows]
            stream.synchronize()
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        def run(out=out, dev=dev, x=x):
            gemm_mma(out, dev, x, stream=stream, f16=False)
        cases.append(BenchCase("mma", f"gemm_mma q8_0 {name} {T} tok x {N}x{K}", run,
                               dev.nbytes + 4 * T * (N + K), 2 * T * N * K, check=check))
    E, k = 256, 6
    ids_h = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32).ravel()
    ids = cuda.to_device(ids_h, stream=stream)
    order = cuda.device_array(T * k, np.int32, stream=stream)
    tiles = cuda.device_array((2, expert_tiles_capacity(T * k, E)), np.int32, stream=stream)
    for qtype, N, K in ((GGMLType.IQ2_XXS, 4096, 4096), (GGMLType.Q2_K, 4096, 2048)):
        host, dev = gemv_lowbit._bench_weight(qtype, E, N, K, rng, distinct=8)
        xh = rng.standard_normal((T * k, K)).astype(np.float32)
        x = cuda.to_device(xh, stream=stream)
        out = cuda.device_array((T * k, N), np.float32, stream=stream)
        spec = gemv_lowbit.SPECS[qtype]

        def grouped(out=out, dev=dev, x=x):
            expert_order(order, ids, E, stream)
            gemm_mma(out, dev, x, ids, order, stream, f16=False)

        def aligned(out=out, dev=dev, x=x):
            expert_order(order, ids, E, stream, tiles=tiles)
            gemm_mma(out, dev, x, ids, order, stream, tiles=tiles, f16=False)

        def dp4a(out=out, dev=dev, x=x, spec=spec):
            gemv_lowbit._launch(spec, out, dev, x, ids, stream, None, "decode")

        def check(host=host, xh=xh, out=out, N=N):
            rows = 12  # two tokens' (token, expert) rows against the reference
            ref = np.empty((rows, N))
            gemv_lowbit.REFS[host.qtype](ref, host, xh[:rows], ids_h[:rows])
            got = out.copy_to_host(stream=stream)[:rows]
            stream.synchronize()
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        touched = len(np.unique(ids_h))
        nbytes = touched * dev.nbytes // E + 4 * T * k * (N + K)
        for how, fn in (("gemm_mma grouped", grouped), ("gemm_mma expert tiles", aligned),
                        ("dp4a ids-GEMV", dp4a)):
            cases.append(BenchCase("mma", f"{how} {spec.name} experts {T}x{k} rows x {N}x{K}",
                                   fn, nbytes, 2 * T * k * N * K, check=check))
    return cases
