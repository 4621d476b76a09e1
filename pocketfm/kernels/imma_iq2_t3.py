"""IQ2_XXS transcoded to 3-bit planes, and its decode GEMV on the int8 tensor cores: out[T, N]
= W[ids[t]] · x[t] (or W · x[t]) with no table lookups (a candidate: not yet in the engine).

Why: imma_iq2_xxs.py, the routed experts' gate+up, is latency-bound on its shared-memory
tables: every 8 weights take two lookups (the grid row's magnitude indices, the 7 sign bits'
signs), a third of its stall samples wait on them and half their wavefronts are bank
conflicts, while DRAM idles (H100 28.9 µs for ~26 MB, BENCHMARKS 2026-12-05 (k)). The
lookups only turn an 8-bit grid index and a 7-bit sign index into 8 selector nibbles for two
``prmt``; a weight's selector is 3 bits (its magnitude 8 / 25 / 43, its sign). Stored as such,
a lane makes its selectors with a few shifts and masks from words it loaded: 1.55x the bytes
(102 against 66 a 256-weight row block), no shared-memory reads but the staged rows.

Layout (``transcode``, exact: the same weights bit for bit), per expert, row and 32-column
group k (the IQ2_XXS group: 4 grid rows of 8 weights, lane c of a quad takes grid row c):
- ``mag`` uint64 [E, N, G]: the 2-bit magnitude indices (0, 1, 2 for 8, 25, 43). Weight 8c + i
  of the group sits at bits 4i + 2(c & 1) of 32-bit half c >> 1, so lane c's 8 selectors are
  (half >> 2(c & 1)) & 0x33333333, one a nibble.
- ``sgn`` uint64 [E, N, G / 2]: a 32-bit word a group (groups 2j, 2j + 1 in word j), the sign
  of weight 8c + i at bit 4i + c (the parity sign made explicit), so lane c's signs are
  ((s >> c) << 2) & 0x44444444, at bit 2 of each nibble: + 4 selects the negated magnitude.
- ``ls`` uint32 [E, N, G / 8]: the 8 groups' 4-bit scales of a 256-column super-block, group j
  at bits 4j; ``d`` float16 [E, N, G / 8] as IQ2_XXS's.
Everything else is imma_iq2_xxs.py's kernel: x as int16 hi / lo bytes per group, 16-row tiles,
warps splitting K by 512-column stages staged a stage ahead, a group adding float(v · (2 ls +
1)) · s and a super-block that sum · d / 8: the same MMAs on the same codes in the same order,
so the same output bits.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .. import quants
from ..quants import GGMLType
from .bench import BenchCase
from .device import cdiv, kernel, resident_blocks
from .imma import (ROWS, WARPS, XCH, _mma_s8, _shf_r, _syncwarp, graph_cases, routed_setup,
                   routed_x_and_ref, tile_out, tile_thread)
from .imma_iq2_xxs import (_NEG, _POS, GROUP, STAGE, STAGE_LD, STAGED_WORDS, _code_nibbles,
                           _load_stage, prepare_x, stage_rows)
from .lowbit_layout import _ld_u64x2, _prmt
from .qweight import QWeight

SGN_LD = STAGE // 2 + 1  # uint64 words a staged row's signs take in shared memory (padded)
SGN_WORDS = WARPS * ROWS * SGN_LD


# ---- the layout ----------------------------------------------------------------------------------
def transcode(w: QWeight) -> QWeight:
    """An IQ2_XXS QWeight (gemv_lowbit.pack_iq2_xxs's planes: qs uint64 [E, N, G], d) -> the
    same weight as (mag, sgn, ls, d) planes (module doc), on the host; only this module reads
    them (``is_t3``)."""
    assert w.qtype == GGMLType.IQ2_XXS and len(w.planes) == 2, "an IQ2_XXS weight"
    qs, d = (np.asarray(p) for p in w.planes)
    E, N, G = qs.shape
    code = _code_nibbles().astype(np.uint64)  # [256]: nibble i = magnitude index of weight i
    aux = qs >> np.uint64(32)
    half = [np.zeros(qs.shape, np.uint64), np.zeros(qs.shape, np.uint64)]
    sgn = np.zeros(qs.shape, np.uint64)
    for c in range(4):
        idx = (qs >> np.uint64(8 * c)) & np.uint64(0xFF)
        half[c >> 1] |= code[idx] << np.uint64(2 * (c & 1))
        s8 = quants.KSIGNS_IQ2XS.astype(np.uint64)[(aux >> np.uint64(7 * c)) & np.uint64(127)]
        for i in range(8):
            sgn |= ((s8 >> np.uint64(i)) & np.uint64(1)) << np.uint64(4 * i + c)
    mag = half[0] | (half[1] << np.uint64(32))
    sgn2 = sgn.reshape(E, N, G // 2, 2)
    sgn64 = sgn2[..., 0] | (sgn2[..., 1] << np.uint64(32))
    ls = (aux >> np.uint64(28)).reshape(E, N, G // 8, 8)
    ls32 = (ls << (np.uint64(4) * np.arange(8, dtype=np.uint64))).sum(axis=3).astype(np.uint32)
    return QWeight(w.qtype, w.rows, w.cols, w.experts,
                   (mag, np.ascontiguousarray(sgn64), ls32, d))


def is_t3(w: QWeight) -> bool:
    """Whether ``w`` is in this module's layout (transcode's four planes)."""
    return w.qtype == GGMLType.IQ2_XXS and len(w.planes) == 4


def dequantize_t3(w: QWeight) -> np.ndarray:
    """The float32 weights [E, N, K] of a transcoded weight (host planes): the reference the
    layout is tested by (it must equal quants.dequantize of the IQ2_XXS blocks)."""
    mag, sgn64, ls32, d = (np.asarray(p) for p in w.planes)
    E, N, G = mag.shape
    sgn = np.stack([sgn64 & np.uint64(0xFFFFFFFF), sgn64 >> np.uint64(32)], axis=3)
    sgn = sgn.reshape(E, N, G)
    out = np.empty((E, N, G, 4, 8), np.float32)
    levels = np.array([8, 25, 43], np.float32)
    for c in range(4):
        h = (mag >> np.uint64(32 * (c >> 1))) & np.uint64(0xFFFFFFFF)
        for i in range(8):
            m = (h >> np.uint64(4 * i + 2 * (c & 1))) & np.uint64(3)
            s = (sgn >> np.uint64(4 * i + c)) & np.uint64(1)
            out[..., c, i] = np.where(s == 1, -levels[m], levels[m])
    ls = (ls32[..., None] >> (np.uint32(4) * np.arange(8, dtype=np.uint32))) & np.uint32(15)
    scale = d.astype(np.float32)[..., None] * (0.5 + ls.astype(np.float32)) * np.float32(0.25)
    out *= scale.reshape(E, N, G)[..., None, None]
    return out.reshape(E, N, G * 32)


# ---- the kernel --------------------------------------------------------------------------------
@cuda.jit(device=True)
def _row_codes(half, s, mshift, c):
    """Lane c's grid row of a group as 8 int8 codes in two uint32: its magnitude half (the
    32-bit half c >> 1 of the group's mag word), the group's sign word s, mshift = 2 (c & 1)."""
    sel = (_shf_r(half, 0, mshift) & uint32(0x33333333)) | (
        (_shf_r(s, 0, c) << uint32(2)) & uint32(0x44444444))
    return _prmt(_POS, _NEG, sel), _prmt(_POS, _NEG, sel >> uint32(16))


@cuda.jit(device=True)
def _group_dot(rows, sgns, r0, r8, q0, q8, k, xr, sr, mshift, c, l0, l8, xch, s0, s1):
    """Group k (0 .. 15) of the staged stage: s0, s1 += float(v · (2 ls + 1)) · s for rows g,
    g + 8 (imma_iq2_xxs's group_dot on these planes; l0, l8: the rows' ls words of k's
    super-block)."""
    w0 = rows[r0 + k]
    w8 = rows[r8 + k]
    g0 = sgns[q0 + (k >> 1)]
    g8 = sgns[q8 + (k >> 1)]
    sh = uint64(32 * (k & 1))
    h0 = uint32(w0 >> uint64(32)) if c >= 2 else uint32(w0 & uint64(0xFFFFFFFF))
    h8 = uint32(w8 >> uint64(32)) if c >= 2 else uint32(w8 & uint64(0xFFFFFFFF))
    a0, a2 = _row_codes(h0, uint32((g0 >> sh) & uint64(0xFFFFFFFF)), mshift, c)
    a1, a3 = _row_codes(h8, uint32((g8 >> sh) & uint64(0xFFFFFFFF)), mshift, c)
    bv = xr[4 * k]
    c0, c1, c2, c3 = _mma_s8(a0, a1, a2, a3, uint32(bv & uint64(0xFFFFFFFF)),
                             uint32(bv >> uint64(32)), xch)
    v0 = int32(c0 * int32(256) + c1)
    v8 = int32(c2 * int32(256) + c3)
    j = uint32(4 * (k & 7))
    o0 = int32(((l0 >> j) & uint32(15)) * uint32(2) + uint32(1))
    o8 = int32(((l8 >> j) & uint32(15)) * uint32(2) + uint32(1))
    sx = sr[k]
    return s0 + float32(int32(v0 * o0)) * sx, s1 + float32(int32(v8 * o8)) * sx


@cuda.jit(device=True)
def _super_block(rows, sgns, r0, r8, q0, q8, k0, xr, sr, mshift, c, l0, l8, xch):
    """The 8 groups k0 .. k0 + 7 of a super-block -> the sums of rows g, g + 8 (written out: a
    loop of this size stays rolled, with 64-bit counters)."""
    a = (rows, sgns, r0, r8, q0, q8)
    b = (xr, sr, mshift, c, l0, l8, xch)
    s0, s1 = _group_dot(*a, k0, *b, float32(0), float32(0))
    s0, s1 = _group_dot(*a, k0 + 1, *b, s0, s1)
    s0, s1 = _group_dot(*a, k0 + 2, *b, s0, s1)
    s0, s1 = _group_dot(*a, k0 + 3, *b, s0, s1)
    s0, s1 = _group_dot(*a, k0 + 4, *b, s0, s1)
    s0, s1 = _group_dot(*a, k0 + 5, *b, s0, s1)
    s0, s1 = _group_dot(*a, k0 + 6, *b, s0, s1)
    return _group_dot(*a, k0 + 7, *b, s0, s1)


@cuda.jit(device=True)
def _load_signs_ls(spre, lpre, sgn, ls, e, n0, stage, N, lane, g):
    """Request a stage's sign words (this lane: 16 bytes of rows n0 + (lane >> 2) and + 8, at
    word 2 (lane & 3) of the row's 8) and the ls words of rows n0 + g, n0 + g + 8 for the
    stage's two super-blocks (rows past N: the last)."""
    r = lane >> 2
    q = 2 * (lane & 3)
    spre[0], spre[1] = _ld_u64x2(sgn, e, min(n0 + r, N - 1), stage * (STAGE // 2) + q)
    spre[2], spre[3] = _ld_u64x2(sgn, e, min(n0 + r + 8, N - 1), stage * (STAGE // 2) + q)
    lpre[0] = ls[e, min(n0 + g, N - 1), 2 * stage]
    lpre[1] = ls[e, min(n0 + g + 8, N - 1), 2 * stage]
    lpre[2] = ls[e, min(n0 + g, N - 1), 2 * stage + 1]
    lpre[3] = ls[e, min(n0 + g + 8, N - 1), 2 * stage + 1]


def gemv_iq2_t3_imma_tiles(out, mag, sgn, ls, d, xq, xs, ids, nw):
    # grid (row blocks, T), nw warps a block splitting K by stages: imma_iq2_xxs's tile loop,
    # the magnitude words staged as its group words, the sign words beside them
    t = cuda.threadIdx.x
    N = out.shape[1]
    G = mag.shape[2]
    w, lane, g, c, b, e, bx = tile_thread(ids, xs, G)
    per_warp = G // STAGE // nw
    tiles_n = (N + ROWS - 1) // ROWS
    rows = cuda.shared.array(STAGED_WORDS, uint64)  # [warp, row, STAGE_LD]
    sgns = cuda.shared.array(SGN_WORDS, uint64)  # [warp, row, SGN_LD]
    red = cuda.shared.array((WARPS, ROWS), float32)
    xch = cuda.shared.array(XCH, uint64)
    mshift = uint32(2 * (c & 1))
    lr, lc = lane >> 3, lane & 7  # (the magnitude words' staging: imma_iq2_xxs)
    r0 = uint32((w * ROWS + g) * STAGE_LD)
    r8 = r0 + uint32(8 * STAGE_LD)
    q0 = uint32((w * ROWS + g) * SGN_LD)
    q8 = q0 + uint32(8 * SGN_LD)
    pre = cuda.local.array(8, uint64)
    dpre = cuda.local.array(4, float32)
    spre = cuda.local.array(4, uint64)
    lpre = cuda.local.array(4, uint32)
    tn = cuda.blockIdx.x
    if tn < tiles_n:
        _load_stage(pre, dpre, mag, d, e, tn * ROWS, w, N, lr, lc, g)
        _load_signs_ls(spre, lpre, sgn, ls, e, tn * ROWS, w, N, lane, g)
    while tn < tiles_n:
        acc0 = float32(0)
        acc1 = float32(0)
        for j in range(per_warp):
            stage = w + j * nw
            _syncwarp()  # the warp's rows are free (the last stage's reads are done)
            stage_rows(rows, pre, w, lr, lc)
            for i in range(2):
                at = uint32((w * ROWS + (lane >> 2) + 8 * i) * SGN_LD + 2 * (lane & 3))
                sgns[at] = spre[2 * i]
                sgns[at + uint32(1)] = spre[2 * i + 1]
            d0, d8, d0b, d8b = dpre[0], dpre[1], dpre[2], dpre[3]
            l0, l8, l0b, l8b = lpre[0], lpre[1], lpre[2], lpre[3]
            _syncwarp()
            if j + 1 < per_warp:  # the next stage's words in flight during this one's math
                _load_stage(pre, dpre, mag, d, e, tn * ROWS, stage + nw, N, lr, lc, g)
                _load_signs_ls(spre, lpre, sgn, ls, e, tn * ROWS, stage + nw, N, lane, g)
            elif tn + cuda.gridDim.x < tiles_n:
                n1 = (tn + cuda.gridDim.x) * ROWS
                _load_stage(pre, dpre, mag, d, e, n1, w, N, lr, lc, g)
                _load_signs_ls(spre, lpre, sgn, ls, e, n1, w, N, lane, g)
            col0 = uint32(stage * STAGE)
            xr = xq[uint32((2 * bx + (g & 1)) * 4 * G + c) + uint32(4) * col0:]
            sr = xs[uint32(bx * G) + col0:]
            s0, s1 = _super_block(rows, sgns, r0, r8, q0, q8, 0, xr, sr, mshift, c, l0, l8,
                                  xch)
            acc0 += s0 * d0
            acc1 += s1 * d8
            s0, s1 = _super_block(rows, sgns, r0, r8, q0, q8, 8, xr, sr, mshift, c, l0b, l8b,
                                  xch)
            acc0 += s0 * d0b
            acc1 += s1 * d8b
        tile_out(out, red, acc0, acc1, b, tn * ROWS, nw, float32(0.125))
        tn += cuda.gridDim.x


def _tiles_kernel(max_registers=None):
    """The GEMV kernel, its registers capped at ``max_registers`` (more blocks an SM; ptxas,
    sm_90: 172 uncapped, 2 blocks of 4 warps an SM; 168: 3 blocks, 4 bytes spilled; 128: 4
    blocks, 72 bytes spilled) or not (None)."""
    opts = {} if max_registers is None else {"max_registers": max_registers}
    k = kernel(gemv_iq2_t3_imma_tiles, **opts)
    if max_registers is not None:
        k.__name__ = k.__qualname__ = f"_gemv_iq2_t3_imma_tiles_r{max_registers}"
    return k


_gemv_iq2_t3_imma_tiles = _tiles_kernel()
CANDIDATES = {"r168": _tiles_kernel(168), "r128": _tiles_kernel(128)}  # (timed by bench_cases)


# ---- launchers -----------------------------------------------------------------------------------
def takes_t3(w: QWeight) -> bool:
    """Whether ``w`` runs this kernel: transcoded, rows of whole 512-column stages."""
    return is_t3(w) and w.cols % (GROUP * STAGE) == 0


def gemv_prepared(out, w: QWeight, prepared, ids=None, stream=0, build=None) -> None:
    """out[T, N] = W · x[t] (or W[ids[t]] · x[t]) on x from imma_iq2_xxs.prepare_x (one x row
    may serve every id); ``takes_t3(w)`` must hold. ``build``: a key of CANDIDATES."""
    from .gemv_lowbit import _no_ids

    T, N = out.shape
    xq, xs = prepared
    assert takes_t3(w) and w.rows == N and xs.size % (w.cols // GROUP) == 0, (w, out.shape)
    stages = w.cols // (GROUP * STAGE)
    nw = next(n for n in (WARPS, 2, 1) if stages % n == 0)
    args = (out, *w.planes, xq, xs, _no_ids() if ids is None else ids, nw)
    k = _gemv_iq2_t3_imma_tiles if build is None else CANDIDATES[build]
    resident = resident_blocks(k, args, 32 * nw, simulated=2 * T)
    grid = (min(cdiv(N, ROWS), max(1, resident // T)), T)
    k[grid, 32 * nw, stream](*args)


def gemv_iq2_t3_imma(out, w: QWeight, x, ids=None, stream=0) -> None:
    """out[T, N] float32 = W · x[t], or W[ids[t]] · x[t] (x [T, K], or [1, K] for every id)."""
    gemv_prepared(out, w, prepare_x(x, stream), ids, stream)


# ---- compile check and benchmarks ------------------------------------------------------------
PTX_SIGNATURES = [(k, "void(float32[:, ::1], uint64[:, :, ::1], uint64[:, :, ::1], "
                      "uint32[:, :, ::1], float16[:, :, ::1], uint64[::1], float32[::1], "
                      "int32[::1], int64)")
                  for k in (_gemv_iq2_t3_imma_tiles, *CANDIDATES.values())]


def bench_cases(stream) -> list[BenchCase]:
    """The routed experts' fused gate+up at decode (6 of 256 experts of [4096 x 4096], one x
    row for all, each launch after its x preparation, as imma_iq2_xxs's cases): this kernel on
    the transcoded weights against imma_iq2_xxs's on the IQ2_XXS ones (the engine's)."""
    from . import imma_iq2_xxs

    N, K = 4096, 4096
    host, dev, id_sets, out = routed_setup(GGMLType.IQ2_XXS, N, K, stream)
    # (routed_setup's 256 experts are 8 random ones tiled: transcode those 8, then tile)
    eight = transcode(QWeight(host.qtype, N, K, 8, tuple(p[:8] for p in host.planes)))
    t3 = QWeight(host.qtype, N, K, host.experts,
                 tuple(np.tile(p, (host.experts // 8, 1, 1)) for p in eight.planes))
    t3 = t3.to_device(stream)
    k = out.shape[0]
    x, ref = routed_x_and_ref(host, id_sets, N, K, stream)

    def t3_gemv(ids, build=None):
        return lambda: gemv_prepared(out, t3, prepare_x(x, stream), ids, stream, build)

    def iq2(ids):
        return lambda: imma_iq2_xxs.gemv_prepared(out, dev, prepare_x(x, stream), ids, stream)

    label = f"+ x prep, {k} of 256 x {N}x{K} (gate+up)"
    makers = [("_gemv_iq2_t3_imma_tiles (transcoded)", t3_gemv, t3)]
    makers += [(f"_gemv_iq2_t3_imma_tiles_{b} (transcoded)",
                lambda ids, b=b: t3_gemv(ids, b), t3) for b in CANDIDATES]
    makers.append(("_gemv_iq2_xxs_imma_tiles (IQ2_XXS, the engine's)", iq2, dev))
    return [case for name, make, w in makers
            for case in graph_cases("imma_iq2_t3", label, [(name, make)], id_sets, out, ref,
                                    stream, k * w.nbytes // 256 + 4 * (K + k * N),
                                    2 * k * N * K)]

