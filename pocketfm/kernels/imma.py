"""The int8 tensor-core MMA for the low-bit decode GEMVs (imma_iq2_xxs.py, imma_q2_k.py):
``mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32`` as inline PTX (the way mma.py emits its
bf16 / f16 MMA), 32-bit shared-memory reads and shifts Numba does not emit, and the pieces the
two kernels share: their x as two signed bytes and their tile's output.

Fragments (PTX ISA, mma.m16n8k32 .s8; lane = 4 g + c): lane (g, c) holds A (16 x 32) bytes
(row g, columns 4c .. 4c+3), (row g + 8, the same), (row g, 16 + 4c ..), (row g + 8, 16 + 4c ..)
and B (32 x 8) bytes (columns 4c .. 4c+3, then 16 + 4c .., of B column g); D (row g, columns 2c,
2c + 1), (row g + 8, the same). A dot product does not mind the order of its terms, so the
kernels give lane c the group's columns 8c .. 8c+7 in both A and B: a lane's A is 8 bytes of
each of its two rows, its B 8 bytes of x.

x for both kernels: q = round(x / s) per scale block (|q| <= 32000), q = 256 hi + lo with hi =
(q + 128) >> 8 and lo in [-128, 127], two signed byte planes (``hi_lo_bytes``): B's even
columns hi, its odd ones lo, so D's (row · hi, row · lo) give the row's integer dot product v =
256 D0 + D1, the same on the quad's four lanes.

In the simulator the MMA is emulated per warp through a shared exchange (every thread calls
it), and the PTX helpers are plain Python.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .device import SIMULATOR, xor_shfl
from .lowbit_layout import _f32_bits

ROWS = 16  # rows a tile (the MMA's M)
WARPS = 4  # warps a block at most (the kernels' warps split K)
XCH = 32 * WARPS * 6 if SIMULATOR else 1  # simulator MMA exchange: 6 words a thread


# ---- the MMA instruction ------------------------------------------------------------------------
if SIMULATOR:
    from .mma import _fragment_index

    _FRAG_A, _FRAG_B = _fragment_index(K=32, per=4)  # (lane, register, byte) of A and B

    def _mma_emulated(a0, a1, a2, a3, b0, b1, xch):
        """The warp's int8 A · B [16, 8] (int64), the fragments exchanged through ``xch``
        between barriers (every thread of the block calls), and this lane's (g, c)."""
        t = cuda.threadIdx.x
        base, lane = t - t % 32, t % 32
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            xch[t * 6 + i] = int(v) & 0xFFFFFFFF
        cuda.syncthreads()
        words = np.array(xch[base * 6:(base + 32) * 6]).astype("<u4").reshape(32, 6)
        cuda.syncthreads()
        s8 = words.view(np.int8).reshape(32, 6, 4).astype(np.int64)
        return s8[_FRAG_A] @ s8[_FRAG_B], lane >> 2, lane & 3  # [16, 32] @ [32, 8]

    @cuda.jit(device=True)
    def _mma_s8(a0, a1, a2, a3, b0, b1, xch):
        """One warp's m16n8k32 int8 MMA with C = 0 -> (D[g, 2c], D[g, 2c+1], D[g+8, 2c],
        D[g+8, 2c+1]) int32 for lane (g, c) (simulator: the fragments exchanged through
        ``xch`` between barriers, so every thread of the block calls it)."""
        D, g, c = _mma_emulated(a0, a1, a2, a3, b0, b1, xch)
        return (np.int32(D[g, 2 * c]), np.int32(D[g, 2 * c + 1]), np.int32(D[g + 8, 2 * c]),
                np.int32(D[g + 8, 2 * c + 1]))

    @cuda.jit(device=True)
    def _mma_s8_acc(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch):
        """As _mma_s8 with the int32 accumulator (c0, c1, c2, c3) added: D = A · B + C."""
        D, g, c = _mma_emulated(a0, a1, a2, a3, b0, b1, xch)
        return (np.int32(D[g, 2 * c] + c0), np.int32(D[g, 2 * c + 1] + c1),
                np.int32(D[g + 8, 2 * c] + c2), np.int32(D[g + 8, 2 * c + 1] + c3))

    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncthreads()  # (the simulator's threads of a warp are not in lockstep)

    @cuda.jit(device=True)
    def _shared_at(words):
        """The shared address of ``words``' first element (simulator: 0, addresses are byte
        offsets into the array)."""
        return uint32(0)

    @cuda.jit(device=True)
    def _lds_u32(words, at):
        """The uint32 at shared address ``at`` in ``words``."""
        return words[at // 4]

    def _shf_r(a, b, n):
        """PTX shf.r.clamp.b32: the low 32 bits of (b:a) >> n (n <= 32)."""
        return np.uint32((((int(b) & 0xFFFFFFFF) << 32 | (int(a) & 0xFFFFFFFF)) >> int(n))
                         & 0xFFFFFFFF)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from .lowbit_layout import _asm_intrinsic
    from .mma import _shared_u32

    @intrinsic
    def _shared_at(typingctx, words):
        """The 32-bit shared-window address of shared uint32 ``words``' first element."""
        if not (isinstance(words, types.Array) and words.dtype == types.uint32):
            return None

        def codegen(context, builder, sig, args):
            return _shared_u32(context, builder, sig.args[0], args[0], types.int64,
                               ir.Constant(ir.IntType(64), 0))
        return types.uint32(words), codegen

    @intrinsic
    def _lds_u32(typingctx, words, at):
        """The uint32 at shared address ``at`` (in ``words``, from _shared_at): one ld.shared
        on a 32-bit address (Numba's indexing makes a 64-bit one: a shift, an or and 64-bit
        adds more a lookup here)."""
        if not (isinstance(words, types.Array) and words.dtype == types.uint32
                and isinstance(at, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            # side effect: it reads shared memory, so it stays after the barrier that fills it
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "ld.shared.u32 $0, [$1];",
                               "=r,r,~{memory}", side_effect=True)
            return builder.call(asm, [context.cast(builder, args[1], sig.args[1], types.uint32)])
        return types.uint32(words, at), codegen

    def _mma_intrinsic(with_c: bool):
        """m16n8k32 .s8 x .s8 -> .s32: D = A · B (+ C with ``with_c``; ``xch`` unused on the
        GPU)."""
        c_regs = "{$10, $11, $12, $13}" if with_c else "{0, 0, 0, 0}"
        ptx = ("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, "
               f"{{$4, $5, $6, $7}}, {{$8, $9}}, {c_regs};")
        n_in = 10 if with_c else 6

        def typer(typingctx, *args):
            if not all(isinstance(v, types.Integer) for v in args[:n_in]):
                return None

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                regs = [context.cast(builder, v, t, types.int32 if k >= 6 else types.uint32)
                        for k, (v, t) in enumerate(zip(args[:n_in], sig.args[:n_in]))]
                fty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * n_in)
                cons = "=r,=r,=r,=r," + ",".join(["r"] * n_in)
                s = builder.call(ir.InlineAsm(fty, ptx, cons), regs)
                return cgutils.pack_array(builder,
                                          [builder.extract_value(s, k) for k in range(4)])
            return types.UniTuple(types.int32, 4)(*args), codegen
        if with_c:
            def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch):
                return typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, xch)
        else:
            def mma(typingctx, a0, a1, a2, a3, b0, b1, xch):
                return typer(typingctx, a0, a1, a2, a3, b0, b1, xch)
        return intrinsic(mma)

    _mma_s8, _mma_s8_acc = _mma_intrinsic(False), _mma_intrinsic(True)

    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncwarp(0xFFFFFFFF)

    # one 32-bit shift (Numba widens uint32 arithmetic to 64 bits, and a variable 64-bit
    # shift is several instructions)
    _shf_r = _asm_intrinsic("shf.r.clamp.b32 $0, $1, $2, $3;", types.uint32)


# ---- shared by the kernels -----------------------------------------------------------------------
@cuda.jit(device=True)
def tile_thread(ids, xs, blocks_a_row):
    """Who the calling thread of a tile kernel is: (warp w, lane, g, c, token b = blockIdx.y,
    its expert e (ids[b], or 0 without ids), its x row bx (b, or the one row every id shares:
    ``xs`` holds ``blocks_a_row`` scales a row))."""
    t = cuda.threadIdx.x
    lane = t & 31
    b = cuda.blockIdx.y
    e = ids[b] if b < ids.shape[0] else 0
    bx = min(b, xs.shape[0] // blocks_a_row - 1)
    return t >> 5, lane, lane >> 2, lane & 3, b, e, bx


@cuda.jit(device=True)
def quad_sums(acc0, acc1, shf):
    """acc0, acc1 summed over the lane's quad (xor butterflies; ``shf``: the simulator's float32
    exchange of blockDim, unused on the GPU): where the quad's lanes each hold part of a row's
    sum. Every thread calls."""
    acc0 += xor_shfl(acc0, 1, shf)
    acc0 += xor_shfl(acc0, 2, shf)
    acc1 += xor_shfl(acc1, 1, shf)
    acc1 += xor_shfl(acc1, 2, shf)
    return acc0, acc1


@cuda.jit(device=True)
def tile_out(out, red, acc0, acc1, b, n0, nw, scale, first):
    """out[b, n0 + r] = scale · the sum over the nw warps from warp ``first`` on (the calling
    thread's tile's warps: 0 unless a block holds several tiles) of lane (g = r % 8, c = 0)'s
    acc0 (rows r < 8) or acc1 (rows r >= 8), through ``red`` [the block's warps, ROWS]; no
    row past the end (n0 + r >= N); every thread of the block calls."""
    t = cuda.threadIdx.x
    lane = t & 31
    if lane & 3 == 0:
        red[t >> 5, lane >> 2] = acc0
        red[t >> 5, (lane >> 2) + 8] = acc1
    cuda.syncthreads()
    r = t - 32 * first
    if r < ROWS and n0 + r < out.shape[1]:
        s = float32(0)
        for v in range(nw):
            s += red[first + v, r]
        out[b, n0 + r] = s * scale
    cuda.syncthreads()


@cuda.jit(device=True)
def hi_lo_bytes(v, inv):
    """The 8 values v (a local array) as q = round(v · inv) (|q| <= 32000 for inv = 32000 /
    max|v| over its scale's columns) split into q = 256 hi + lo, hi = (q + 128) >> 8 and lo in
    [-128, 127]: (the hi bytes, the lo bytes) as uint64, and Σq as float32 (exact)."""
    hw = uint64(0)
    lw = uint64(0)
    qsum = float32(0)
    for k in range(8):
        # round by adding 1.5 * 2^23 (no float -> int conversion instruction)
        q = int32(_f32_bits(v[k] * inv + float32(12582912.0))) - int32(0x4B400000)
        hi = (q + int32(128)) >> int32(8)
        lo = q - (hi << int32(8))
        hw |= uint64(hi & int32(255)) << uint64(8 * k)
        lw |= uint64(lo & int32(255)) << uint64(8 * k)
        qsum += float32(q)
    return hw, lw, qsum


# ---- benchmarks (shared by imma_iq2_xxs.py and imma_q2_k.py) --------------------------------
def routed_setup(qtype, N: int, K: int, stream, E: int = 256, k: int = 6):
    """(host QWeight, its device copy, 16 device id sets of k of E experts, out [k, N]): E
    experts of [N x K] (8 random ones tiled, each at its own address) whose rotating ids make
    every launch read its weights from HBM, as a decode step does."""
    from .. import quants
    from .gemv_lowbit import PACKERS

    rng = np.random.default_rng(0)
    raw = quants.random_blocks(qtype, (8, N, K), rng, std=0.02)
    host = PACKERS[qtype](np.tile(raw, (E // 8, 1, 1)), N, K)
    id_sets = [cuda.to_device(rng.choice(E, k, replace=False).astype(np.int32), stream=stream)
               for _ in range(16)]
    return host, host.to_device(), id_sets, cuda.device_array((k, N), np.float32, stream=stream)


def graph_cases(family: str, label: str, makers, id_sets, out, ref, stream, nbytes: int,
                flops: int) -> list:
    """A BenchCase per (name, make) of ``makers``: make(ids) -> one launch; the 16 launches
    (one an id set) are one CUDA graph replay; ``ref()`` -> the float64 reference of the first
    launch's ``out``. ``nbytes`` / ``flops``: one launch's."""
    from . import device
    from .bench import BenchCase

    def check(launch):
        def rel():
            launch()
            r = ref()
            got = out.copy_to_host(stream=stream)
            stream.synchronize()
            return float(np.linalg.norm(got - r) / np.linalg.norm(r))
        return rel

    cases = []
    for name, make in makers:
        launches = [make(ids) for ids in id_sets]
        n = len(launches)
        cases.append(BenchCase(family, f"{name} {label}, {n} launches per graph",
                               device.capture_graph(launches, stream), n * nbytes, n * flops, "",
                               check(launches[0]), launches=n))
    return cases

