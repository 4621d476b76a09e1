"""The IQ2_XXS decode GEMV on the int8 tensor cores: out[T, N] = W[ids[t]] · x[t] (or W · x[t])
for a packed IQ2_XXS weight (gemv_lowbit's planes, unchanged), by ``mma.sync.aligned.m16n8k32``
with int8 operands and int32 accumulation (PTX).

Why: the routed experts' fused gate+up (6 of 256 experts, 4096 x 4096 IQ2_XXS each, ~26 MB a
step and layer) is gemv_lowbit's dp4a kernel's largest launch, and Nsight shows it bound by
instruction issue, not memory: 6.2 thread instructions a weight (a grid lookup, ~11
instructions of signs and 4 dp4a per 8 weights), the issue slots 71% busy, DRAM 7% (H100,
BENCHMARKS 2026-12-05 (j)). Here one MMA takes 16 rows x 32 columns (512 weights), and the
codes come from two table lookups and two byte permutes per 8 weights.

Operands (PTX ISA, mma.m16n8k32 .s8; lane = 4 g + c):
- A, the weights: lane (g, c) holds 4 int8 of row g and of row g + 8 at MMA columns 4c .. 4c+3
  and 16 + 4c .. 16 + 4c + 3. A dot product does not mind the order of its terms, so those 8
  columns are grid row c of the IQ2_XXS group (columns 8c .. 8c+7 of the 32): one group is one
  MMA, and a lane makes one grid row of each of its two rows.
- B, x: column n of B is held by lanes with g = n, at the same MMA columns as A, so lane (g, c)
  loads the 8 bytes of x at the group's columns 8c .. 8c+7. x is int16 per group of 32 (q =
  round(x / s), |q| <= 32000, s = max|x| / 32000) split into two signed bytes, q = 256 hi + lo
  (hi = (q + 128) >> 8, lo in [-128, 127]): the even B columns are hi, the odd ones lo, so every
  lane's C holds (row g · hi, row g · lo) and the same for row g + 8, and v = 256 C0 + C1 is the
  group's integer dot product (|v| <= 2^26).
- Scales: a weight is d · (2 ls + 1) / 8 · code · sign (ls: the group's 4-bit scale, d: the
  256-column super-block's float16), so a group adds float(v · (2 ls + 1)) · s to a super-block
  sum (|v · (2 ls + 1)| < 2^31), and each super-block adds that sum · d / 8.

Codes: a grid row's 8 magnitudes are 8, 25 or 43, and a lane makes its 8 int8 codes with two
``prmt`` (byte permute) from the constant words (8, 25, 43, 0) and (-8, -25, -43, 0): the
selector nibble of byte k is its magnitude's index (table ``_CODE_NIBBLES`` by grid index) plus 4
if negative (table ``_SIGN_NIBBLES`` by the 7 sign bits, the parity bit included). Both tables
sit in shared memory, REPS copies so that a warp's lookups spread over the banks.

Block: ``WARPS`` warps on one tile of 16 rows, splitting K: warp w takes the 512-column stages
w, w + WARPS, ... Each stage's 16 rows x 128 bytes are loaded coalesced (a lane 4 x 16 bytes,
each instruction 4 whole rows' 128 bytes) a stage ahead into registers, stored to the warp's
shared rows (padded: the 8 rows one LDS reads sit in distinct banks), and read back 8 bytes a
row and group. Blocks loop over the tiles (a persistent grid of the resident blocks). The warps'
sums meet in shared memory.

In the simulator the MMA is emulated per warp through a shared exchange (every thread calls it)
and the byte permutes in Python; sizes stay tiny there.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .. import quants
from ..quants import GGMLType
from .bench import BenchCase
from .device import SIMULATOR, cdiv, kernel, resident_blocks, stream_buffer, xor_shfl
from .lowbit_layout import _f32_bits, _ld_u64x2, _prmt
from .qweight import QWeight

ROWS = 16  # rows a tile (the MMA's M)
GROUP = 32  # columns a group (the MMA's K; one IQ2_XXS scale)
STAGE = 16  # groups a warp stages at a time: 512 columns, 128 bytes of each row
STAGE_LD = STAGE + 2  # uint64 words a staged row takes in shared memory (module doc: banks)
WARPS = 4  # warps a block at most (they split K; fewer where the stages do not divide)
STAGED_WORDS = WARPS * ROWS * STAGE_LD  # the warps' staged rows in shared memory
REPS = 8  # copies of each code table in shared memory (lane l reads copy l % REPS)
PREP_THREADS = 128  # x preparation: threads a block (a thread makes 8 columns)
XCH = 32 * WARPS * 6 if SIMULATOR else 1  # simulator MMA exchange: 6 words a thread
SHF = PREP_THREADS if SIMULATOR else 1  # simulator lane exchange (x preparation)


# ---- tables ---------------------------------------------------------------------------------
def _code_nibbles() -> np.ndarray:
    """uint32 [256]: nibble k = the index (0, 1, 2) of grid row i's magnitude k in (8, 25, 43)."""
    grid = quants.IQ2XXS_GRID.astype(np.int64)  # [256, 8]
    code = np.searchsorted(np.array([8, 25, 43]), grid)
    assert np.array_equal(np.array([8, 25, 43])[code], grid), "IQ2_XXS grid: 8, 25 or 43 only"
    return (code << (4 * np.arange(8))).sum(axis=1).astype(np.uint32)


def _sign_nibbles() -> np.ndarray:
    """uint32 [128]: bit 2 of nibble k = sign bit k of the 7-bit index s with its parity bit
    (an even count of minus signs: quants.KSIGNS_IQ2XS)."""
    s8 = quants.KSIGNS_IQ2XS.astype(np.int64)  # [128]
    bits = (s8[:, None] >> np.arange(8)) & 1
    return (bits << (4 * np.arange(8) + 2)).sum(axis=1).astype(np.uint32)


_TABLES = np.concatenate([_code_nibbles(), _sign_nibbles()])  # [384]: codes, then signs
SIGNS_AT = 256 * REPS  # where the sign table's copies start in shared memory
TABLE_WORDS = len(_TABLES) * REPS
_POS = 8 | 25 << 8 | 43 << 16  # the magnitudes as bytes (prmt source a: selector 0-3)
_NEG = (256 - 8) | (256 - 25) << 8 | (256 - 43) << 16  # negated (source b: selector 4-7)


# ---- the MMA instruction ------------------------------------------------------------------------
if SIMULATOR:
    from .mma import _fragment_index

    _FRAG_A, _FRAG_B = _fragment_index(K=32, per=4)  # (lane, register, byte) of A and B

    @cuda.jit(device=True)
    def _mma_s8(a0, a1, a2, a3, b0, b1, xch):
        """One warp's m16n8k32 int8 MMA with C = 0 -> (D[g, 2c], D[g, 2c+1], D[g+8, 2c],
        D[g+8, 2c+1]) int32 for lane (g, c) (simulator: the fragments exchanged through
        ``xch`` between barriers, so every thread of the block calls it)."""
        t = cuda.threadIdx.x
        base, lane = t - t % 32, t % 32
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            xch[t * 6 + i] = int(v) & 0xFFFFFFFF
        cuda.syncthreads()
        words = np.array(xch[base * 6:(base + 32) * 6]).astype("<u4").reshape(32, 6)
        cuda.syncthreads()
        s8 = words.view(np.int8).reshape(32, 6, 4).astype(np.int64)
        D = s8[_FRAG_A] @ s8[_FRAG_B]  # [16, 32] @ [32, 8]
        g, c = lane >> 2, lane & 3
        return (np.int32(D[g, 2 * c]), np.int32(D[g, 2 * c + 1]), np.int32(D[g + 8, 2 * c]),
                np.int32(D[g + 8, 2 * c + 1]))

    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncthreads()  # (the simulator's threads of a warp are not in lockstep)

    def _bfe(a, pos, n):
        """PTX bfe.u32: bits pos .. pos + n - 1 of a."""
        return np.uint32((int(a) >> int(pos)) & ((1 << int(n)) - 1))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from .lowbit_layout import _asm_intrinsic

    @intrinsic
    def _mma_s8(typingctx, a0, a1, a2, a3, b0, b1, xch):
        """m16n8k32 .s8 x .s8 -> .s32 with C = 0 (``xch`` unused on the GPU)."""
        if not all(isinstance(v, types.Integer) for v in (a0, a1, a2, a3, b0, b1)):
            return None
        ptx = ("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, "
               "{$4, $5, $6, $7}, {$8, $9}, {0, 0, 0, 0};")

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            regs = [context.cast(builder, v, t, types.uint32)
                    for v, t in zip(args[:6], sig.args[:6])]
            fty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * 6)
            s = builder.call(ir.InlineAsm(fty, ptx, "=r,=r,=r,=r,r,r,r,r,r,r"), regs)
            return cgutils.pack_array(builder, [builder.extract_value(s, k) for k in range(4)])
        return types.UniTuple(types.int32, 4)(a0, a1, a2, a3, b0, b1, xch), codegen

    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncwarp(0xFFFFFFFF)

    _bfe = _asm_intrinsic("bfe.u32 $0, $1, $2, $3;", types.uint32)


@cuda.jit(device=True)
def _grid_row_codes(w, pick, shift, tab, rep):
    """A grid row of the IQ2_XXS group word ``w`` (4 grid indices | sign / scale word << 32) as
    8 int8 codes, magnitude · sign, in two uint32 (module doc: two lookups, two permutes).
    The row is the lane's c: ``pick`` = 0x4440 + c (prmt: its index byte alone) and ``shift``
    = 7 c (its 7 sign bits)."""
    idx = _prmt(uint32(w & uint64(0xFFFFFFFF)), 0, pick)
    s7 = _bfe(uint32(w >> uint64(32)), shift, 7)
    sel = uint32(tab[uint32(idx * uint32(REPS)) + rep]
                 | tab[uint32(SIGNS_AT) + uint32(s7 * uint32(REPS)) + rep])
    return _prmt(_POS, _NEG, sel), _prmt(_POS, _NEG, sel >> uint32(16))


@cuda.jit(device=True)
def _scaled_dot(hi, lo, w):
    """float(v · (2 ls + 1)), v = 256 hi + lo: a group's integer dot product times its odd
    scale (ls: the top 4 bits of ``w``; bit 27 below them, a sign bit, is replaced by the 1)."""
    v = int32(hi * int32(256) + lo)
    return float32(int32(v * int32(uint32(w >> uint64(59)) | uint32(1))))


# ---- kernels -------------------------------------------------------------------------------------
def gemv_iq2_xxs_imma_tiles(out, qs, d, xq, xs, ids, nw):
    # grid: a persistent loop over the tiles (token b, 16 rows); ``nw`` warps a block take the
    # 512-column stages w, w + nw, .. of every row (blockDim = 32 nw). xq, xs: prepare_x's
    # planes flattened (indices here are unsigned: Numba adds negative-index code otherwise).
    t = cuda.threadIdx.x
    w, lane = t >> 5, t & 31
    g, c = lane >> 2, lane & 3
    rep = uint32(lane % REPS)
    pick = uint32(0x4440 + c)
    shift = uint32(7 * c)
    T, N = out.shape
    G = qs.shape[2]  # groups a row
    K8 = 4 * G  # uint64 words of x a row and plane (8 columns each)
    n_stages = G // STAGE
    per_warp = n_stages // nw
    tiles_n = (N + ROWS - 1) // ROWS
    tiles = T * tiles_n
    tab = cuda.shared.array(TABLE_WORDS, uint32)
    rows = cuda.shared.array(STAGED_WORDS, uint64)  # [warp, row, STAGE_LD]
    red = cuda.shared.array((WARPS, ROWS), float32)
    xch = cuda.shared.array(XCH, uint64)
    consts = cuda.const.array_like(_TABLES)
    for i in range(t, TABLE_WORDS, cuda.blockDim.x):
        tab[i] = consts[i // REPS]
    # this lane's share of a stage: rows lr, lr + 4, + 8, + 12 of the tile, 16 bytes at byte
    # 16 lc of each row's 128; the rows it reads back: g and g + 8
    lr, lc = lane >> 3, lane & 7
    r0 = uint32((w * ROWS + g) * STAGE_LD)
    r8 = r0 + uint32(8 * STAGE_LD)
    pre = cuda.local.array(8, uint64)
    dpre = cuda.local.array(4, float32)  # d of rows g, g + 8 for the stage's 2 super-blocks
    dcur = cuda.local.array(4, float32)
    # item i: tile blockIdx + (i // per_warp) gridDim, stage w + (i % per_warp) nw
    items = (tiles - cuda.blockIdx.x + cuda.gridDim.x - 1) // cuda.gridDim.x * per_warp
    if items > 0:
        _load_stage(pre, dpre, qs, d, ids, cuda.blockIdx.x, w, tiles_n, N, lr, lc, g)
    cuda.syncthreads()  # the tables
    acc0 = float32(0)
    acc1 = float32(0)
    for i in range(items):
        tile = cuda.blockIdx.x + (i // per_warp) * cuda.gridDim.x
        stage = w + (i % per_warp) * nw
        b = tile // tiles_n
        bx = min(b, xs.shape[0] // G - 1)  # x row b, or the one row every id shares
        _syncwarp()  # the warp's rows are free (the last item's reads are done)
        for j in range(4):
            at = uint32((w * ROWS + lr + 4 * j) * STAGE_LD + 2 * lc)
            rows[at] = pre[2 * j]
            rows[at + uint32(1)] = pre[2 * j + 1]
        for j in range(4):
            dcur[j] = dpre[j]
        _syncwarp()
        if i + 1 < items:  # the next item's bytes in flight during this one's math
            nt = cuda.blockIdx.x + ((i + 1) // per_warp) * cuda.gridDim.x
            _load_stage(pre, dpre, qs, d, ids, nt, w + ((i + 1) % per_warp) * nw, tiles_n, N,
                        lr, lc, g)
        col0 = uint32(stage * STAGE)  # the stage's first group
        xb = uint32((2 * bx + (g & 1)) * K8 + c) + uint32(4) * col0  # B: this lane's x bytes
        sb = uint32(bx * G) + col0  # the groups' x scales
        for half in range(2):  # the stage's two super-blocks
            s0 = float32(0)
            s1 = float32(0)
            for k in range(8):
                kk = uint32(8 * half + k)
                w0 = rows[r0 + kk]
                w8 = rows[r8 + kk]
                bv = xq[xb + uint32(4) * kk]
                a0, a2 = _grid_row_codes(w0, pick, shift, tab, rep)
                a1, a3 = _grid_row_codes(w8, pick, shift, tab, rep)
                c0, c1, c2, c3 = _mma_s8(a0, a1, a2, a3, uint32(bv & uint64(0xFFFFFFFF)),
                                         uint32(bv >> uint64(32)), xch)
                sx = xs[sb + kk]
                s0 += _scaled_dot(c0, c1, w0) * sx
                s1 += _scaled_dot(c2, c3, w8) * sx
            acc0 += s0 * dcur[2 * half]
            acc1 += s1 * dcur[2 * half + 1]
        if i % per_warp == per_warp - 1:  # the tile's last stage: the warps' sums meet
            if c == 0:
                red[w, g] = acc0
                red[w, g + 8] = acc1
            acc0 = float32(0)
            acc1 = float32(0)
            cuda.syncthreads()
            n = (tile - b * tiles_n) * ROWS + t
            if t < ROWS and n < N:
                s = float32(0)
                for v in range(nw):
                    s += red[v, t]
                out[b, n] = s * float32(0.125)
            cuda.syncthreads()


@cuda.jit(device=True)
def _load_stage(pre, dpre, qs, d, ids, tile, stage, tiles_n, N, lr, lc, g):
    """Request a stage of ``tile``: this lane's 4 x 16 bytes of the rows' group words (rows
    lr + 4 j), and d of rows g, g + 8 for the stage's two super-blocks (rows past N: the last)."""
    b = tile // tiles_n
    e = ids[b] if b < ids.shape[0] else 0
    n0 = (tile - b * tiles_n) * ROWS
    for j in range(4):
        pre[2 * j], pre[2 * j + 1] = _ld_u64x2(qs, e, min(n0 + lr + 4 * j, N - 1),
                                               stage * STAGE + 2 * lc)
    for h in range(2):
        dpre[2 * h] = float32(d[e, min(n0 + g, N - 1), 2 * stage + h])
        dpre[2 * h + 1] = float32(d[e, min(n0 + g + 8, N - 1), 2 * stage + h])


def x_imma_groups(xq, xs, x):
    # grid (K / 8 / threads, T): thread i makes columns 8i .. 8i+7 of x[b], one uint64 of each
    # byte plane; the 4 threads of a 32-column group share its scale (xor butterflies: every
    # thread takes part, those past K / 8 on a copy of columns 0-7, storing nothing).
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    K = x.shape[1]
    xch = cuda.shared.array(SHF, float32)
    c0 = 8 * i if i < K // 8 else 0
    a = float32(0)
    for k in range(8):
        a = max(a, abs(x[b, c0 + k]))
    a = max(a, xor_shfl(a, 1, xch))
    a = max(a, xor_shfl(a, 2, xch))
    inv = float32(32000) / a if a > 0 else float32(0)
    hw = uint64(0)
    lw = uint64(0)
    for k in range(8):
        # round(x / s) by adding 1.5 * 2^23 (no float -> int instruction); then q = 256 hi + lo
        q = int32(_f32_bits(x[b, c0 + k] * inv + float32(12582912.0))) - int32(0x4B400000)
        hi = (q + int32(128)) >> int32(8)
        lo = q - (hi << int32(8))
        hw |= uint64(hi & int32(255)) << uint64(8 * k)
        lw |= uint64(lo & int32(255)) << uint64(8 * k)
    if i < K // 8:
        xq[(2 * b) * (K // 8) + i] = hw
        xq[(2 * b + 1) * (K // 8) + i] = lw
        if i % 4 == 0:
            xs[b * (K // 32) + i // 4] = a / float32(32000)


_gemv_iq2_xxs_imma_tiles = kernel(gemv_iq2_xxs_imma_tiles)
_x_imma_groups = kernel(x_imma_groups)
for _k, _name in ((_gemv_iq2_xxs_imma_tiles, "_gemv_iq2_xxs_imma_tiles"),
                  (_x_imma_groups, "_x_imma_groups")):
    _k.__name__ = _name


# ---- launchers ---------------------------------------------------------------------------------
def takes_imma(w: QWeight) -> bool:
    """Whether ``w`` runs this kernel: IQ2_XXS, rows of whole 512-column stages."""
    return w.qtype == GGMLType.IQ2_XXS and w.cols % (GROUP * STAGE) == 0


def prepare_x(x, stream=0):
    """x float32 [T, K] -> (xq uint64 [T * 2 * K/8]: per row the hi then the lo byte plane, xs
    float32 [T * K/32]: the groups' scales; flat, as the GEMV indexes them) in buffers of
    ``stream``'s own, in one small launch: the first half of the GEMV, so that it can run on a
    branch beside other work (the router)."""
    T, K = x.shape
    xq = stream_buffer("imma x bytes", stream, (T * 2 * K // 8,), np.uint64)
    xs = stream_buffer("imma x scales", stream, (T * K // GROUP,), np.float32)
    _x_imma_groups[(cdiv(K // 8, PREP_THREADS), T), PREP_THREADS, stream](xq, xs, x)
    return xq, xs


def gemv_prepared(out, w: QWeight, prepared, ids=None, stream=0) -> None:
    """out[T, N] = W · x[t] (or W[ids[t]] · x[t]) on x from ``prepare_x`` (one x row may serve
    every id); ``takes_imma(w)`` must hold."""
    from .gemv_lowbit import _no_ids

    T, N = out.shape
    xq, xs = prepared
    assert takes_imma(w) and w.rows == N and xs.size % (w.cols // GROUP) == 0, (w, out.shape)
    stages = w.cols // (GROUP * STAGE)
    nw = next(n for n in (WARPS, 2, 1) if stages % n == 0)
    qs, d = w.planes
    args = (out, qs, d, xq, xs, _no_ids() if ids is None else ids, nw)
    tiles = T * cdiv(N, ROWS)
    grid = min(tiles, resident_blocks(_gemv_iq2_xxs_imma_tiles, args, 32 * nw, simulated=2))
    _gemv_iq2_xxs_imma_tiles[grid, 32 * nw, stream](*args)


def gemv_iq2_xxs_imma(out, w: QWeight, x, ids=None, stream=0) -> None:
    """out[T, N] float32 = W · x[t], or W[ids[t]] · x[t] (x [T, K], or [1, K] for every id): the
    signature of gemv_lowbit.gemv_iq2_xxs_ref, on the tensor cores."""
    gemv_prepared(out, w, prepare_x(x, stream), ids, stream)


# ---- compile check and benchmarks ------------------------------------------------------------
PTX_SIGNATURES = [
    (_gemv_iq2_xxs_imma_tiles, "void(float32[:, ::1], uint64[:, :, ::1], float16[:, :, ::1], "
                               "uint64[::1], float32[::1], int32[::1], int64)"),
    (_x_imma_groups, "void(uint64[::1], float32[::1], float32[:, ::1])"),
]


def bench_cases(stream) -> list[BenchCase]:
    """The routed experts' fused gate+up at decode, as the engine runs it: 6 of 256 experts of
    [4096 x 4096] IQ2_XXS (gate | up of V4-Flash, spec §1.1), one x row for all, this kernel
    and gemv_lowbit's dp4a kernel on the same weights (each after its own x preparation, as in
    the step). The ids rotate over 16 sets so each launch reads its weights from HBM; the 16
    launches are one CUDA graph replay a case."""
    from . import device, gemv_lowbit as gl

    rng = np.random.default_rng(0)
    E, k, N, K = 256, 6, 4096, 4096
    raw = quants.random_blocks(GGMLType.IQ2_XXS, (8, N, K), rng, std=0.02)
    host = gl.pack_iq2_xxs(np.tile(raw, (E // 8, 1, 1)), N, K)
    dev = host.to_device()
    id_sets = [cuda.to_device(rng.choice(E, k, replace=False).astype(np.int32), stream=stream)
               for _ in range(16)]
    x = cuda.to_device(rng.standard_normal((1, K)).astype(np.float32), stream=stream)
    out = cuda.device_array((k, N), np.float32, stream=stream)

    def imma(ids):
        return lambda: gemv_prepared(out, dev, prepare_x(x, stream), ids, stream)

    def dp4a(ids):
        return lambda: gl.gemv_prepared(out, dev, gl.prepare_x(dev, x, stream), ids, stream)

    def check(launch):
        def rel():
            launch()
            ref = np.empty((k, N), np.float64)
            gl.gemv_iq2_xxs_ref(ref, host, x.copy_to_host(), id_sets[0].copy_to_host())
            got = out.copy_to_host(stream=stream)
            stream.synchronize()
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        return rel

    cases = []
    nbytes = k * dev.nbytes // E + 4 * (K + k * N)
    for name, make in (("_gemv_iq2_xxs_imma_tiles", imma), ("_gemv_iq2_xxs_dp4a_slots", dp4a)):
        launches = [make(ids) for ids in id_sets]
        cases.append(BenchCase("imma", f"{name} + x prep, {k} of {E} x {N}x{K} (gate+up), "
                               f"{len(launches)} launches per graph",
                               device.capture_graph(launches, stream), 16 * nbytes,
                               16 * 2 * k * N * K, "", check(launches[0]), launches=16))
    return cases
