"""The IQ2_XXS decode GEMV on the int8 tensor cores (imma.py's MMA): out[T, N] = W[ids[t]] ·
x[t] (or W · x[t]) for a packed IQ2_XXS weight (gemv_lowbit's planes, unchanged).

Why: the routed experts' fused gate+up (6 of 256 experts, 4096 x 4096 IQ2_XXS each, ~26 MB a
step and layer) is gemv_lowbit's dp4a kernel's largest launch, and Nsight shows it bound by
instruction issue, not memory: 6.2 thread instructions a weight (a grid lookup, ~11
instructions of signs and 4 dp4a per 8 weights), the issue slots 71% busy, DRAM 7% (H100,
BENCHMARKS 2026-12-05 (j)). Here one MMA takes 16 rows x one 32-column group (512 weights),
and the codes come from two table lookups and two byte permutes per 8 weights: 2.75 thread
instructions a weight (SASS, (k)).

- A: lane c's 8 columns of the group are its grid row c, of rows g and g + 8.
- B: x as int16 per 32-column group (s = max|x| / 32000), hi and lo bytes (imma.py).
- Scales: a weight is d · (2 ls + 1) / 8 · code · sign (ls: the group's 4-bit scale, d: the
  256-column super-block's float16), so a group adds float(v · (2 ls + 1)) · s to a super-block
  sum (|v · (2 ls + 1)| < 2^31), and each super-block adds that sum · d / 8.

Codes: a grid row's 8 magnitudes are 8, 25 or 43, and a lane makes its 8 int8 codes with two
``prmt`` (byte permute) from the constant words (8, 25, 43, 0) and (-8, -25, -43, 0): the
selector nibble of byte k is its magnitude's index (``_code_nibbles``, by grid index) plus 4 if
negative (``_sign_nibbles``, by the 7 sign bits, the parity bit included; or, a candidate, by
two multiplies). The tables sit in shared memory, REPS copies so that a warp's lookups spread
over the banks (measured: still ~3 of 32 random lookups a bank, (k)). The quad's four lanes
hold the same C (B's column pairs repeat x's two byte planes), so a candidate build scales
each group on one lane of the quad only and adds the quad's sums at the end.

Block: WARPS warps on one tile of 16 rows, splitting K: warp w takes the 512-column stages
w, w + WARPS, ... Each stage's 16 rows x 128 bytes are loaded coalesced (a lane 4 x 16 bytes,
each instruction 4 whole rows' 128 bytes) a stage ahead into registers, stored to the warp's
shared rows (padded: the 8 rows one LDS reads sit in distinct banks), and read back 8 bytes a
row and group. Blocks loop over the tiles of their token (a persistent grid of the resident
blocks). The warps' sums meet in shared memory.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64
from numba.types import float16

from .. import quants
from ..quants import GGMLType
from .bench import BenchCase
from .device import (SIMULATOR, cdiv, kernel, launch_shared, resident_blocks,
                     stream_buffer, xor_shfl)
from .imma import (ROWS, WARPS, XCH, _lds_u32, _mma_s8, _shared_at, _shf_r, _syncwarp,
                   graph_cases, hi_lo_bytes, quad_sums, routed_setup, tile_out,
                   tile_thread)
from .lowbit_layout import _ld_flat, _ld_u64x2, _ld_u64x2_flat, _prmt
from .qweight import QWeight

GROUP = 32  # columns a group (the MMA's K; one IQ2_XXS scale)
STAGE = 16  # groups a warp stages at a time: 512 columns, 128 bytes of each row
STAGE_LD = STAGE + 2  # uint64 words a staged row takes in shared memory (module doc: banks)
STAGED_WORDS = WARPS * ROWS * STAGE_LD  # the warps' staged rows in shared memory
REPS = 8  # copies of each table in shared memory (lane l reads copy l % REPS)
TILE_REGS = 128  # the one-tile builds' registers: 4 blocks of WARPS warps an SM
PREP_THREADS = 128  # x preparation: threads a block (a thread makes 8 columns)
SHF = PREP_THREADS if SIMULATOR else 1  # simulator lane exchange (x preparation)
SHF_TILE = 32 * WARPS if SIMULATOR else 1  # ... and the GEMV's (its quad sums)
SM_SUBS = 4  # the SM-wide build: tiles a block works on at once, WARPS warps each
SM_REPS = 32  # ... and its table copies: one a lane, no bank conflicts
SM_XCH = SM_SUBS * XCH if SIMULATOR else 1  # its simulator MMA exchange (blockDim threads)
SM_WARPS = SM_SUBS * WARPS
# The wide layout (``wide`` builds): the tables' copies in a 64 KB-aligned 64 KB region of
# shared memory, code entry i's 32 copies at bytes 256 i .. 256 i + 127 (copy l at 4 l), sign
# entry s's at 256 s + 128 ..: a lane's code address is its 4 l and the region's high bytes
# with the grid index as byte 1 (one prmt of the group word and lane_at), its sign address the
# rotated sign bits or-ed in (one lop3), where the packed tables take a multiply-add and an
# add. WIDE_SMEM (or 64 KB and twice the staged rows, where more) holds the region wherever the
# dynamic shared memory starts (< 64 KB) and the staged rows before it (where they fit) or
# after it.
WIDE_SMEM = 2 * 65536


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
_POS = 8 | 25 << 8 | 43 << 16  # the magnitudes as bytes (prmt source a: selector 0-3)
_NEG = (256 - 8) | (256 - 25) << 8 | (256 - 43) << 16  # negated (source b: selector 4-7)



@cuda.jit(device=True)
def _signs_by_multiplies(s7):
    """The sign nibbles of _sign_nibbles()[s7] in registers: the parity bit, then the even and
    the odd sign bits each spread to bit 2 of their nibble by one multiply (k -> 4k + 2; the
    shifted copies that collide sit at even bits, so their carries reach only odd ones, which
    the masks drop)."""
    s8 = s7 | ((uint32(cuda.popc(s7)) & uint32(1)) << uint32(7))
    even = ((s8 & uint32(0x55)) * uint32(0x104104)) & uint32(0x04040404)
    odd = ((s8 & uint32(0xAA)) * uint32(0x820820)) & uint32(0x40404040)
    return uint32(even | odd)


@cuda.jit(device=True)
def _odd(w):
    """2 ls + 1 of the group word ``w`` as int32 (ls: its top 4 bits; bit 27 below them, a sign
    bit, is replaced by the 1)."""
    return int32(uint32(w >> uint64(59)) | uint32(1))


@cuda.jit(device=True)
def _odd_scaled(v, w):
    """float(v · (2 ls + 1)): a group's integer dot product v times its odd scale (_odd)."""
    return float32(int32(v * _odd(w)))


def _group_math(reps: int, sign_alu: bool, quad: bool = False, int_sums: bool = False,
                wide: bool = False):
    """The stage loop both GEMV bodies run (tile_stages, on grid_row_codes and super_block) for
    ``reps`` copies of the tables in shared memory, the signs from the sign table or
    (``sign_alu``) by _signs_by_multiplies; with ``quad`` each lane scales one group in four
    (its sums are a quarter of the row's: the caller adds the quad's); with ``int_sums`` a
    super-block's groups are summed as integers, x's scale the same for all 8 of them
    (prepare_x(super_blocks=True)): per group and row two multiply-adds of the MMA's hi and lo
    sums by the odd scale, where the float sums take a combine, a multiply, a conversion and a
    multiply-add, and x's scale is read once a super-block (|Σ c · (2 ls + 1)| <= 8 · 32 · 43 ·
    128 · 31 < 2^26: no overflow). ``wide``: the tables as _sm_tiles_body lays them out for
    ``wide`` (reps = SM_REPS): lane_at = (the 64 KB-aligned region's address + 4 lane, that +
    128 behind an identity prmt), pick = 0x7604 + 16 c, and a lookup's address made by one prmt
    (codes) or one lop3 (signs: LLVM would move a visible + 128 out of the or, a second lop3);
    with int_sums only; the stages' loads and x by unsigned flat offsets (_load_stage_flat)."""
    assert not (wide and (sign_alu or quad or not int_sums or reps != SM_REPS))
    signs_at = 256 * reps  # where the sign table's copies start (uint32 words)
    at = (4 * reps).bit_length() - 1  # log2 of a table entry's bytes over the copies
    assert 4 * reps == 1 << at, reps

    @cuda.jit(device=True)
    def grid_row_codes(w, pick, shift, tab, lane_at):
        # A grid row of the IQ2_XXS group word w (4 grid indices | sign / scale word << 32) as
        # 8 int8 codes, magnitude · sign, in two uint32 (module doc: lookups and two permutes).
        # The row is the lane's c: pick = 0x4440 + c (prmt: its index byte alone), shift = 7 c
        # (its 7 sign bits); lane_at: the shared address of the lane's copy of the tables.
        wh = uint32(w >> uint64(32))
        if wide:
            # the lane's code entry: the region's bytes 0, 2, 3 and 4 lane with the index byte
            # as byte 1 (entries 256 bytes apart); its sign entry: the 7 bits rotated to bit 8,
            # or-ed into lane_at's bits with the half-entry's 128 (the wide layout: WIDE_SMEM)
            code_base, sign_base = lane_at
            code_at = _prmt(uint32(w & uint64(0xFFFFFFFF)), code_base, pick)
            s7_at = _shf_r(wh, wh, (shift - uint32(8)) & uint32(31)) & uint32(127 << 8)
            sel = _lds_u32(tab, code_at) | _lds_u32(tab, s7_at | sign_base)
            return _prmt(_POS, _NEG, sel), _prmt(_POS, _NEG, sel >> uint32(16))
        idx = _prmt(uint32(w & uint64(0xFFFFFFFF)), 0, pick)
        if sign_alu:
            sg = _signs_by_multiplies(_shf_r(wh, 0, shift) & uint32(127))
        else:
            # the 7 sign bits rotated to bit ``at``: already the entry's byte offset (a rotate
            # and a mask where a shift, a mask, a multiply and an add made it; the rotate
            # count is loop-invariant)
            s7_at = _shf_r(wh, wh, (shift - uint32(at)) & uint32(31)) & uint32(127 << at)
            sg = _lds_u32(tab, lane_at + uint32(4 * signs_at) + s7_at)
        sel = _lds_u32(tab, lane_at + idx * uint32(4 * reps)) | sg
        return _prmt(_POS, _NEG, sel), _prmt(_POS, _NEG, sel >> uint32(16))

    @cuda.jit(device=True)
    def group_v(rows, r0, r8, k, xr, pick, shift, tab, lane_at, xch):
        # group k's integer dot products v = 256 hi + lo of rows g and g + 8 (words r0 + k,
        # r8 + k of rows), and the two group words
        w0 = rows[r0 + k]
        w8 = rows[r8 + k]
        bv = xr[4 * k]
        a0, a2 = grid_row_codes(w0, pick, shift, tab, lane_at)
        a1, a3 = grid_row_codes(w8, pick, shift, tab, lane_at)
        c0, c1, c2, c3 = _mma_s8(a0, a1, a2, a3, uint32(bv & uint64(0xFFFFFFFF)),
                                 uint32(bv >> uint64(32)), xch)
        return int32(c0 * int32(256) + c1), int32(c2 * int32(256) + c3), w0, w8

    @cuda.jit(device=True)
    def group_dot(rows, r0, r8, k, xr, sr, pick, shift, tab, lane_at, xch, s0, s1):
        # group k of the staged stage against x (xr: the lane's x bytes from the stage's first
        # group on, 4 words a group; sr: the groups' scales): s0, s1 += float(v · (2 ls + 1))
        # · s for rows g, g + 8 (module doc)
        v0, v8, w0, w8 = group_v(rows, r0, r8, k, xr, pick, shift, tab, lane_at, xch)
        sx = sr[k]
        return s0 + _odd_scaled(v0, w0) * sx, s1 + _odd_scaled(v8, w8) * sx

    @cuda.jit(device=True)
    def quad_groups(rows, r0, r8, k0, xr, sr, pick, shift, tab, lane_at, xch, c):
        # groups k0 .. k0 + 3, lane c scaling only group k0 + c's v (the quad's lanes hold the
        # same v: B's column pairs repeat x's two byte planes): selects instead of 3 of the 4
        # scalings (an integer multiply, a conversion, a multiply-add a row each)
        v0, v8, w0, w8 = group_v(rows, r0, r8, k0, xr, pick, shift, tab, lane_at, xch)
        for j in (1, 2, 3):
            u0, u8, x0, x8 = group_v(rows, r0, r8, k0 + j, xr, pick, shift, tab, lane_at, xch)
            v0 = u0 if c == j else v0
            v8 = u8 if c == j else v8
            w0 = x0 if c == j else w0
            w8 = x8 if c == j else w8
        sx = sr[k0 + c]
        return _odd_scaled(v0, w0) * sx, _odd_scaled(v8, w8) * sx

    @cuda.jit(device=True)
    def group_int(rows, r0, r8, k, xr, pick, shift, tab, lane_at, xch, h0, l0, h8, l8):
        # group k's MMA sums (x's hi and lo planes) of rows g and g + 8 times their odd scales,
        # added to the super-block's integer sums
        w0 = rows[r0 + k]
        w8 = rows[r8 + k]
        if wide:
            xa, xo = xr
            bv = xa[xo + uint32(4 * k)]
        else:
            bv = xr[4 * k]
        a0, a2 = grid_row_codes(w0, pick, shift, tab, lane_at)
        a1, a3 = grid_row_codes(w8, pick, shift, tab, lane_at)
        c0, c1, c2, c3 = _mma_s8(a0, a1, a2, a3, uint32(bv & uint64(0xFFFFFFFF)),
                                 uint32(bv >> uint64(32)), xch)
        o0 = _odd(w0)
        o8 = _odd(w8)
        # (int32 again: numba widens an int32 product to int64, a wide multiply-add each)
        return (int32(h0 + c0 * o0), int32(l0 + c1 * o0), int32(h8 + c2 * o8),
                int32(l8 + c3 * o8))

    @cuda.jit(device=True)
    def super_block(rows, r0, r8, k0, xr, sr, pick, shift, tab, lane_at, xch, c):
        # the 8 groups k0 .. k0 + 7 of a super-block -> the sums of rows g, g + 8; written
        # out, not a loop: LLVM leaves a loop of this size rolled, with 64-bit counters
        if int_sums:
            h0 = int32(0)
            l0 = int32(0)
            h8 = int32(0)
            l8 = int32(0)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0 + 1, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0 + 2, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0 + 3, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0 + 4, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0 + 5, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0 + 6, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            h0, l0, h8, l8 = group_int(rows, r0, r8, k0 + 7, xr, pick, shift, tab, lane_at,
                                       xch, h0, l0, h8, l8)
            if wide:
                sa, so = sr
                sx = sa[so + uint32(k0)]  # (every group's of the super-block)
            else:
                sx = sr[k0]
            return ((float32(h0) * float32(256) + float32(l0)) * sx,
                    (float32(h8) * float32(256) + float32(l8)) * sx)
        if quad:
            s0, s1 = quad_groups(rows, r0, r8, k0, xr, sr, pick, shift, tab, lane_at, xch, c)
            t0, t1 = quad_groups(rows, r0, r8, k0 + 4, xr, sr, pick, shift, tab, lane_at, xch,
                                 c)
            return s0 + t0, s1 + t1
        s0 = float32(0)
        s1 = float32(0)
        s0, s1 = group_dot(rows, r0, r8, k0, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        s0, s1 = group_dot(rows, r0, r8, k0 + 1, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        s0, s1 = group_dot(rows, r0, r8, k0 + 2, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        s0, s1 = group_dot(rows, r0, r8, k0 + 3, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        s0, s1 = group_dot(rows, r0, r8, k0 + 4, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        s0, s1 = group_dot(rows, r0, r8, k0 + 5, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        s0, s1 = group_dot(rows, r0, r8, k0 + 6, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        s0, s1 = group_dot(rows, r0, r8, k0 + 7, xr, sr, pick, shift, tab, lane_at, xch, s0, s1)
        return s0, s1

    @cuda.jit(device=True)
    def tile_stages(rows, rows_at, w, stage0, nw, per_warp, pre, dpre, qs, d, e, n0, n_next, N,
                    lr, lc, g, c, bx, G, xq, xs, r0, r8, pick, shift, tab, lane_at, xch):
        # warp w's stages stage0, stage0 + nw, .. of the tile at row n0 -> the sums of rows
        # g, g + 8 (before the tile's d scale of 1/8). Each stage's bytes (in pre / dpre, loaded
        # a stage ahead) go to the warp's rows (from word rows_at on) and the next stage's, or
        # the next tile's first (row n_next, when >= 0), are requested during this one's math
        acc0 = float32(0)
        acc1 = float32(0)
        for j in range(per_warp):
            stage = stage0 + j * nw
            _syncwarp()  # the warp's rows are free (the last stage's reads are done)
            for i in range(4):
                at = uint32(rows_at + (w * ROWS + lr + 4 * i) * STAGE_LD + 2 * lc)
                rows[at] = pre[2 * i]
                rows[at + uint32(1)] = pre[2 * i + 1]
            d0, d8 = float32(dpre[0]), float32(dpre[1])  # (converted here, not at the load:
            d0b, d8b = float32(dpre[2]), float32(dpre[3])  # the load's latency stays hidden)
            _syncwarp()
            if wide:
                if j + 1 < per_warp:
                    _load_stage_flat(pre, dpre, qs, d, e, n0, stage + nw, N, lr, lc, g)
                elif n_next >= 0:
                    _load_stage_flat(pre, dpre, qs, d, e, n_next, stage0, N, lr, lc, g)
            elif j + 1 < per_warp:
                _load_stage(pre, dpre, qs, d, e, n0, stage + nw, N, lr, lc, g)
            elif n_next >= 0:
                _load_stage(pre, dpre, qs, d, e, n_next, stage0, N, lr, lc, g)
            col0 = uint32(stage * STAGE)  # the stage's first group
            if wide:  # (x by unsigned offsets: no slice's bounds to clamp)
                xr = (xq, uint32((2 * bx + (g & 1)) * 4 * G + c) + uint32(4) * col0)
                sr = (xs, uint32(bx * G) + col0)
            else:
                xr = xq[uint32((2 * bx + (g & 1)) * 4 * G + c) + uint32(4) * col0:]
                sr = xs[uint32(bx * G) + col0:]
            s0, s1 = super_block(rows, r0, r8, 0, xr, sr, pick, shift, tab, lane_at, xch, c)
            acc0 += s0 * d0
            acc1 += s1 * d8
            s0, s1 = super_block(rows, r0, r8, 8, xr, sr, pick, shift, tab, lane_at, xch, c)
            acc0 += s0 * d0b
            acc1 += s1 * d8b
        return acc0, acc1
    return tile_stages


def _tiles_body(reps: int, sign_alu: bool, quad: bool):
    """The GEMV kernel's function for ``reps`` table copies, the signs by table or multiplies,
    each group scaled on every lane of a quad or (``quad``) on one."""
    tile_stages = _group_math(reps, sign_alu, quad)
    table_words = (256 if sign_alu else 384) * reps  # the code (and sign) tables' copies
    tables = _TABLES[:table_words // reps]

    def gemv_iq2_xxs_imma_tiles(out, qs, d, xq, xs, ids, nw):
        # grid (row blocks, T): block (a, b) loops over the row tiles a, a + gridDim.x, .. of
        # token b (a persistent grid of the resident blocks); nw warps (blockDim = 32 nw) take
        # the 512-column stages w, w + nw, .. of every row. xq, xs: prepare_x's flat planes.
        t = cuda.threadIdx.x
        N = out.shape[1]
        G = qs.shape[2]  # groups a row
        w, lane, g, c, b, e, bx = tile_thread(ids, xs, G)
        per_warp = G // STAGE // nw
        tiles_n = (N + ROWS - 1) // ROWS
        tab = cuda.shared.array(table_words, uint32)
        rows = cuda.shared.array(STAGED_WORDS, uint64)  # [warp, row, STAGE_LD]
        red = cuda.shared.array((WARPS, ROWS), float32)
        xch = cuda.shared.array(XCH, uint64)
        shf = cuda.shared.array(SHF_TILE, float32)
        # this lane's share of a stage: rows lr, lr + 4, + 8, + 12 of the tile, 16 bytes at
        # byte 16 lc of each row's 128; the rows it reads back: g and g + 8
        lr, lc = lane >> 3, lane & 7
        pre = cuda.local.array(8, uint64)
        dpre = cuda.local.array(4, float16)  # d of rows g, g + 8 for the stage's super-blocks
        tn = cuda.blockIdx.x
        if tn < tiles_n:  # (in flight while the tables are written)
            _load_stage(pre, dpre, qs, d, e, tn * ROWS, w, N, lr, lc, g)
        consts = cuda.const.array_like(tables)
        for i in range(t, table_words, cuda.blockDim.x):
            tab[i] = consts[i // reps]
        lane_at = _shared_at(tab) + uint32(4 * (lane % reps))  # the lane's copy of the tables
        pick = uint32(0x4440 + c)
        shift = uint32(7 * c)
        r0 = uint32((w * ROWS + g) * STAGE_LD)
        r8 = r0 + uint32(8 * STAGE_LD)
        cuda.syncthreads()  # the tables
        while tn < tiles_n:
            tn_next = tn + cuda.gridDim.x
            acc0, acc1 = tile_stages(rows, 0, w, w, nw, per_warp, pre, dpre, qs, d, e,
                                     tn * ROWS, tn_next * ROWS if tn_next < tiles_n else -1, N,
                                     lr, lc, g, c, bx, G, xq, xs, r0, r8, pick, shift, tab,
                                     lane_at, xch)
            if quad:  # the quad's lanes each scaled a quarter of the groups
                acc0, acc1 = quad_sums(acc0, acc1, shf)
            tile_out(out, red, acc0, acc1, b, tn * ROWS, nw, float32(0.125), 0)
            tn += cuda.gridDim.x
    return gemv_iq2_xxs_imma_tiles


def _sm_tiles_body(sign_alu: bool, subs: int, int_sums: bool = False, wide: bool = False):
    """The SM-wide build: one block of subs x WARPS warps an SM (subs <= SM_SUBS; 128-168
    registers a thread: the whole register file) sharing one set of SM_REPS table copies, a
    copy a lane, so that no lookup meets another in a bank ((k): 51% of the shared wavefronts
    were conflicts with 8 copies; a copy a lane in each 4-warp block was slower, its 42 KB
    filled by every block). Sub-block s (warps s·WARPS ..) takes the tiles s + subs·blockIdx.x,
    then every subs·gridDim.x-th, all sub-blocks the same number of rounds (a tile past the end
    reads the last rows and stores nothing) so that they meet at the block's barriers. The
    tables and the staged rows sit in dynamic shared memory (86 KB at 4 sub-blocks: over the
    48 KB a static array may take).

    Set-up, before the tiles: the first stage's words are requested first; then thread t
    loads table entry t once and writes its SM_REPS copies, lane l's k-th store at copy
    (l + k) mod 32 so that a warp's stores meet no bank twice (Nsight, H100, 2026-12-07 (x): a
    quarter of the samples were this set-up when every thread loaded and stored 32 words four
    at a time, each load a constant-cache round trip, the first stage requested only after).
    ``int_sums``: _group_math's integer super-block sums (x from prepare_x(super_blocks=True));
    ``wide``: the tables in the wide layout (WIDE_SMEM), the rows before or after them."""
    tile_stages = _group_math(SM_REPS, sign_alu, int_sums=int_sums, wide=wide)
    table_words = (256 if sign_alu else 384) * SM_REPS
    tables = _TABLES[:table_words // SM_REPS]
    rows_bytes = 8 * subs * WARPS * ROWS * STAGE_LD
    NT = 32 * WARPS * subs  # the block's threads
    entries = table_words // SM_REPS
    assert SM_REPS == 32 and entries <= NT, (SM_REPS, entries, NT)

    def gemv_iq2_xxs_imma_sm_tiles(out, qs, d, xq, xs, ids, nw):
        # grid (blocks, T): see _sm_tiles_body; WARPS warps a tile (blockDim = 32 WARPS subs;
        # the launcher passes nw = WARPS)
        t = cuda.threadIdx.x
        N = out.shape[1]
        G = qs.shape[2]
        w, lane, g, c, b, e, bx = tile_thread(ids, xs, G)
        nw = WARPS  # (a constant: 8 registers fewer than the argument, and no spills at 128)
        sub = w // nw
        sw = w - sub * nw  # the warp's place in its tile
        per_warp = G // STAGE // nw
        tiles_n = (N + ROWS - 1) // ROWS
        span = cuda.gridDim.x * subs  # tiles a round
        tab = cuda.shared.array(0, uint32)
        rows = cuda.shared.array(0, uint64)  # (the same bytes: the rows after the tables)
        red = cuda.shared.array((SM_WARPS, ROWS), float32)
        xch = cuda.shared.array(SM_XCH, uint64)
        lr, lc = lane >> 3, lane & 7
        pre = cuda.local.array(8, uint64)
        dpre = cuda.local.array(4, float16)
        tn = cuda.blockIdx.x * subs + sub
        _load_stage(pre, dpre, qs, d, e, min(tn, tiles_n - 1) * ROWS, sw, N, lr, lc, g)
        consts = cuda.const.array_like(tables)
        if wide:
            base = _shared_at(tab)
            region = (base + uint32(65535)) & uint32(0xFFFF0000)
            # the rows (uint64 words from tab's first) before the region where they fit
            # (even, as it is: tab's first byte is 16-byte aligned, and the compiler then
            # knows a row's two words at even k for one 16-byte load)
            rows_at = (uint32(0) if region - base >= uint32(rows_bytes)
                       else (region - base + uint32(65536)) // uint32(8)) & uint32(0xFFFFFFFE)
            if t < entries:  # entry t's word in tab: a code, or sign t - 256 (WIDE_SMEM)
                at = (region - base) // uint32(4) + uint32(
                    64 * t if t < 256 else 64 * (t - 256) + 32)
                v = consts[t]
                for k in range(SM_REPS):
                    tab[at + uint32((t + k) & (SM_REPS - 1))] = v
            code_base = region + uint32(4 * lane)
            lane_at = (code_base, _prmt(code_base + uint32(128), 0, 0x3210))  # (_group_math)
            pick = uint32(0x7604 + 16 * c)
        else:
            rows_at = uint32(table_words // 2)  # (uint64 words: the rows after the tables)
            if t < entries:
                v = consts[t]
                for k in range(SM_REPS):
                    tab[t * SM_REPS + ((t + k) & (SM_REPS - 1))] = v
            lane_at = _shared_at(tab) + uint32(4 * lane)  # the lane's copy of the tables
            pick = uint32(0x4440 + c)
        shift = uint32(7 * c)
        r0 = uint32(rows_at + (w * ROWS + g) * STAGE_LD)
        r8 = r0 + uint32(8 * STAGE_LD)
        cuda.syncthreads()  # the tables
        while tn - sub < tiles_n:  # (the block's first tile: the same for all its warps)
            n_next = min(tn + span, tiles_n - 1) * ROWS if tn - sub + span < tiles_n else -1
            acc0, acc1 = tile_stages(rows, rows_at, w, sw, nw, per_warp, pre, dpre, qs, d, e,
                                     min(tn, tiles_n - 1) * ROWS, n_next, N, lr, lc, g, c, bx,
                                     G, xq, xs, r0, r8, pick, shift, tab, lane_at, xch)
            tile_out(out, red, acc0, acc1, b, tn * ROWS, nw, float32(0.125), sub * nw)
            tn += span
    return gemv_iq2_xxs_imma_sm_tiles


def sm_tiles_smem(sign_alu: bool = False, subs: int = SM_SUBS, wide: bool = False) -> int:
    """Dynamic shared bytes of the SM-wide build of ``subs`` sub-blocks: the tables' copies,
    then the staged rows (``wide``: WIDE_SMEM)."""
    if wide:  # the region and the rows before it, or (the rows not fitting there) after it
        return max(WIDE_SMEM, 65536 + 2 * 8 * subs * WARPS * ROWS * STAGE_LD)
    return 4 * (256 if sign_alu else 384) * SM_REPS + 8 * subs * WARPS * ROWS * STAGE_LD


@cuda.jit(device=True)
def _load_stage(pre, dpre, qs, d, e, n0, stage, N, lr, lc, g):
    """Request a stage of expert e's rows n0 ..: this lane's 4 x 16 bytes of the rows' group
    words (rows n0 + lr + 4 i), and d of rows n0 + g, n0 + g + 8 for the stage's two
    super-blocks (rows past N: the last)."""
    for i in range(4):
        pre[2 * i], pre[2 * i + 1] = _ld_u64x2(qs, e, min(n0 + lr + 4 * i, N - 1),
                                               stage * STAGE + 2 * lc)
    dpre[0] = d[e, min(n0 + g, N - 1), 2 * stage]
    dpre[1] = d[e, min(n0 + g + 8, N - 1), 2 * stage]
    dpre[2] = d[e, min(n0 + g, N - 1), 2 * stage + 1]
    dpre[3] = d[e, min(n0 + g + 8, N - 1), 2 * stage + 1]


@cuda.jit(device=True)
def _load_stage_flat(pre, dpre, qs, d, e, n0, stage, N, lr, lc, g):
    """_load_stage by uint32 flat offsets (qs's and d's elements < 2^32: gemv_prepared): a
    row's address one multiply-add, where (e, n, j) indexing takes 64-bit strides, adds and
    the wrap-around of signed indices."""
    # (these expressions as written: the same in flat_at's strict 32 bits let LLVM hoist each
    # row's base out of the stage loop as 64-bit pointers, 40 instructions more a stage)
    G = uint32(qs.shape[2])
    D = uint32(d.shape[2])
    first = uint32(e) * uint32(N)  # the expert's first row
    col = uint32(stage * STAGE + 2 * lc)
    for i in range(4):
        n = first + uint32(min(n0 + lr + 4 * i, N - 1))
        pre[2 * i], pre[2 * i + 1] = _ld_u64x2_flat(qs, n * G + col)
    at0 = (first + uint32(min(n0 + g, N - 1))) * D + uint32(2 * stage)
    at8 = (first + uint32(min(n0 + g + 8, N - 1))) * D + uint32(2 * stage)
    dpre[0] = _ld_flat(d, at0)
    dpre[1] = _ld_flat(d, at8)
    dpre[2] = _ld_flat(d, at0 + uint32(1))
    dpre[3] = _ld_flat(d, at8 + uint32(1))


def _x_prep(lanes: int):
    """The x preparation kernel whose scale spans ``lanes`` threads' 8 columns each: 4 (a
    32-column group: prepare_x) or 32 (a 256-column super-block, every group's scale entry
    that of its super-block: prepare_x(super_blocks=True))."""
    offs = tuple(1 << j for j in range(lanes.bit_length() - 1))  # the xor butterflies
    assert 1 << len(offs) == lanes

    def x_imma_groups(xq, xs, x):
        # grid (K / 8 / threads, T): thread i makes columns 8i .. 8i+7 of x[b], one uint64 of
        # each byte plane; the ``lanes`` threads of a scale share it (xor butterflies: every
        # thread takes part, those past K / 8 on a copy of columns 0-7, storing nothing).
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        K = x.shape[1]
        xch = cuda.shared.array(SHF, float32)
        c0 = 8 * i if i < K // 8 else 0
        v = cuda.local.array(8, float32)
        a = float32(0)
        for k in range(8):
            v[k] = x[b, c0 + k]
            a = max(a, abs(v[k]))
        for off in offs:
            a = max(a, xor_shfl(a, off, xch))
        hw, lw, _ = hi_lo_bytes(v, float32(32000) / a if a > 0 else float32(0))
        if i < K // 8:
            xq[(2 * b) * (K // 8) + i] = hw
            xq[(2 * b + 1) * (K // 8) + i] = lw
            if i % 4 == 0:  # (the group's scale entry)
                xs[b * (K // 32) + i // 4] = a / float32(32000)
    return x_imma_groups


def _tiles_kernel(reps: int = REPS, sign_alu: bool = False, quad: bool = False,
                  max_registers: int = TILE_REGS):
    """The GEMV kernel: ``reps`` copies of the tables, the signs by table or multiplies, each
    group scaled on one lane of a quad (``quad``) or all four, the registers capped at
    ``max_registers`` (TILE_REGS: 4 blocks an SM; without the cap ptxas may take 130 and hold
    3)."""
    k = kernel(_tiles_body(reps, sign_alu, quad), max_registers=max_registers)
    k.__name__ = k.__qualname__ = "_gemv_iq2_xxs_imma_tiles" + "".join(
        f"_{v}" for v, on in ((f"reps{reps}", reps != REPS), ("alu_signs", sign_alu),
                              ("quad", quad), (f"r{max_registers}", max_registers != TILE_REGS))
        if on)
    return k


def _sm_tiles_kernel(sign_alu: bool = False, subs: int = SM_SUBS, int_sums: bool = False,
                     wide: bool = False):
    """The SM-wide build (_sm_tiles_body) of ``subs`` sub-blocks, its registers capped so
    that one block fills the register file (128 a thread at 4, 8 bytes spilled; 168 at 3).
    ``smem``: its dynamic shared bytes; ``subs``: its tiles at once; ``super_x``: whether it
    needs x scaled per super-block (``int_sums``); ``wide``: the tables in the wide layout
    (WIDE_SMEM)."""
    assert 1 <= subs <= SM_SUBS
    k = kernel(_sm_tiles_body(sign_alu, subs, int_sums, wide),
               max_registers=65536 // (32 * WARPS * subs) // 8 * 8)
    k.__name__ = k.__qualname__ = "_gemv_iq2_xxs_imma_sm_tiles" + "".join(
        f"_{v}" for v, on in (("alu_signs", sign_alu), (f"subs{subs}", subs != SM_SUBS),
                              ("int_sums", int_sums), ("wide", wide)) if on)
    k.smem, k.subs, k.super_x = sm_tiles_smem(sign_alu, subs, wide), subs, int_sums
    return k


_gemv_iq2_xxs_imma_tiles = _tiles_kernel()
# candidates, timed by bench_cases: more table copies (fewer bank conflicts), the signs by
# multiplies (no sign table: fewer lookups, more integer instructions), a group scaled on one
# lane of its quad (~4 instructions fewer a group; the sums in another order). H200 (2026-12-06
# (l)): 27.2-28.8 µs against the default's 28.1. A copy a lane (32: no conflicts, 42 KB with
# the signs by multiplies) was slower, 30.9-32.6 µs, and was dropped. The SM-wide builds (one
# block an SM sharing a copy a lane): sm 27.6, sm3 27.1, their alu_signs 29.3 / 28.6 against
# 28.7 µs (H100, 2026-12-06 (v)); in the step (H100, 30 layers, 2026-12-07 (w)) sm3 6.276 and
# sm3_alu_signs 6.311 against 6.297 ms: the decode engine runs "sm3". With one stage loop
# (_group_math's tile_stages) for both bodies, sm3 26.5 against 27.0 µs, sm 26.8 against 27.6
# (H100, 2026-12-07 (x); the sign rotate beside it: no change, 26.5). sm3_int_sums: sm3 with a
# super-block's groups summed as integers, x scaled per super-block (~5 instructions fewer a
# group of ~42, no conversion a group; not yet measured); sm3_int_wide: that with the tables in
# the wide layout (WIDE_SMEM; 2 instructions fewer a grid row; not yet measured);
# sm_int_wide: that at 4 tiles a block, 128 registers without a spill (sm spills at 128: 44
# bytes), 16 warps an SM.
CANDIDATES = {"reps16": _tiles_kernel(16), "alu_signs": _tiles_kernel(sign_alu=True),
              "reps16_alu_signs": _tiles_kernel(16, sign_alu=True),
              "quad": _tiles_kernel(quad=True), "reps16_quad": _tiles_kernel(16, quad=True),
              "sm": _sm_tiles_kernel(), "sm_alu_signs": _sm_tiles_kernel(sign_alu=True),
              "sm3": _sm_tiles_kernel(subs=3), "sm3_alu_signs": _sm_tiles_kernel(True, 3),
              "sm3_int_sums": _sm_tiles_kernel(subs=3, int_sums=True),
              "sm3_int_wide": _sm_tiles_kernel(subs=3, int_sums=True, wide=True),
              "sm_int_wide": _sm_tiles_kernel(int_sums=True, wide=True)}
_x_imma_groups = kernel(_x_prep(4))
_x_imma_groups.__name__ = "_x_imma_groups"
_x_imma_super_blocks = kernel(_x_prep(32))
_x_imma_super_blocks.__name__ = "_x_imma_super_blocks"


# ---- launchers ---------------------------------------------------------------------------------
def takes_imma(w: QWeight) -> bool:
    """Whether ``w`` runs this kernel: IQ2_XXS, rows of whole 512-column stages."""
    return w.qtype == GGMLType.IQ2_XXS and w.cols % (GROUP * STAGE) == 0


def prepare_x(x, stream=0, super_blocks: bool = False):
    """x float32 [T, K] -> (xq uint64 [T * 2 * K/8]: per row the hi then the lo byte plane, xs
    float32 [T * K/32]: the groups' scales; flat, as the GEMV indexes them) in buffers of
    ``stream``'s own, in one small launch: the first half of the GEMV, so that it can run on a
    branch beside other work (the router). ``super_blocks``: each group's scale that of its
    256-column super-block (the max over 256 columns: what an ``int_sums`` build needs; every
    build takes it)."""
    T, K = x.shape
    xq = stream_buffer("imma x bytes", stream, (T * 2 * K // 8,), np.uint64)
    xs = stream_buffer("imma x scales", stream, (T * K // GROUP,), np.float32)
    k = _x_imma_super_blocks if super_blocks else _x_imma_groups
    k[(cdiv(K // 8, PREP_THREADS), T), PREP_THREADS, stream](xq, xs, x)
    return xq, xs


def needs_super_block_x(build) -> bool:
    """Whether the GEMV build ``build`` (None / True: the default; a CANDIDATES key) takes x
    only from prepare_x(super_blocks=True)."""
    return isinstance(build, str) and getattr(CANDIDATES[build], "super_x", False)


def gemv_prepared(out, w: QWeight, prepared, ids=None, stream=0, build=None) -> None:
    """out[T, N] = W · x[t] (or W[ids[t]] · x[t]) on x from ``prepare_x`` (one x row may serve
    every id); ``takes_imma(w)`` must hold. ``build``: a key of CANDIDATES (A/B; an SM-wide
    one where the rows are whole multiples of WARPS stages, else the default build)."""
    from .gemv_lowbit import _no_ids

    T, N = out.shape
    xq, xs = prepared
    assert takes_imma(w) and w.rows == N and xs.size % (w.cols // GROUP) == 0, (w, out.shape)
    stages = w.cols // (GROUP * STAGE)
    nw = next(n for n in (WARPS, 2, 1) if stages % n == 0)
    qs, d = w.planes
    assert qs.size < 2**32 and xq.size < 2**32  # (the wide build's uint32 offsets)
    args = (out, qs, d, xq, xs, _no_ids() if ids is None else ids, nw)
    k = _gemv_iq2_xxs_imma_tiles if build is None else CANDIDATES[build]
    if getattr(k, "subs", 1) > 1 and nw != WARPS:  # the SM-wide build takes WARPS warps a tile
        k = _gemv_iq2_xxs_imma_tiles
    subs, smem = getattr(k, "subs", 1), getattr(k, "smem", 0)  # (the SM-wide build's)
    resident = resident_blocks(k, args, 32 * nw * subs, smem, simulated=2 * T)
    grid = (min(cdiv(cdiv(N, ROWS), subs), max(1, resident // T)), T)
    launch_shared(k, grid, 32 * nw * subs, stream, smem, *args)


def gemv_iq2_xxs_imma(out, w: QWeight, x, ids=None, stream=0) -> None:
    """out[T, N] float32 = W · x[t], or W[ids[t]] · x[t] (x [T, K], or [1, K] for every id): the
    signature of gemv_lowbit.gemv_iq2_xxs_ref, on the tensor cores."""
    gemv_prepared(out, w, prepare_x(x, stream), ids, stream)


# ---- compile check and benchmarks ------------------------------------------------------------
_TILES_SIG = ("void(float32[:, ::1], uint64[:, :, ::1], float16[:, :, ::1], uint64[::1], "
              "float32[::1], int32[::1], int64)")
PTX_SIGNATURES = [(k, _TILES_SIG) for k in (_gemv_iq2_xxs_imma_tiles, *CANDIDATES.values())]
PTX_SIGNATURES += [(k, "void(uint64[::1], float32[::1], float32[:, ::1])")
                   for k in (_x_imma_groups, _x_imma_super_blocks)]


def bench_cases(stream) -> list[BenchCase]:
    """The routed experts' fused gate+up at decode, as the engine runs it: 6 of 256 experts of
    [4096 x 4096] IQ2_XXS (gate | up of V4-Flash, spec §1.1), one x row for all, this kernel
    (and its candidate builds) and gemv_lowbit's dp4a kernel on the same weights, each after
    its own x preparation, as in the step."""
    from . import gemv_lowbit as gl

    N, K = 4096, 4096
    host, dev, id_sets, out = routed_setup(GGMLType.IQ2_XXS, N, K, stream)
    k = out.shape[0]
    x = cuda.to_device(np.random.default_rng(1).standard_normal((1, K)).astype(np.float32),
                       stream=stream)

    def imma(ids, build=None):
        sb = needs_super_block_x(build)
        return lambda: gemv_prepared(out, dev, prepare_x(x, stream, sb), ids, stream, build)

    def dp4a(ids):
        return lambda: gl.gemv_prepared(out, dev, gl.prepare_x(dev, x, stream), ids, stream)

    def ref():
        r = np.empty((k, N), np.float64)
        gl.gemv_iq2_xxs_ref(r, host, np.repeat(x.copy_to_host(), k, axis=0),
                            id_sets[0].copy_to_host())
        return r
    makers = [("_gemv_iq2_xxs_imma_tiles", imma), ("_gemv_iq2_xxs_dp4a_slots", dp4a)]
    makers += [(kern.__name__, lambda ids, b=b: imma(ids, b)) for b, kern in CANDIDATES.items()]
    return graph_cases("imma_iq2_xxs", f"+ x prep, {k} of 256 x {N}x{K} (gate+up)", makers,
                       id_sets, out, ref, stream, k * dev.nbytes // 256 + 4 * (K + k * N),
                       2 * k * N * K)
