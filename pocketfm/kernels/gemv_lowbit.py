"""Fused dequantise + GEMV / GEMM for the low-bit GGUF types Q2_K, Q4_K, IQ2_XXS and MXFP4.

out[T, N] = x[T, K] · W[N, K]ᵀ, or with ``ids`` int32 [T]: out[t] = W[ids[t]] · x[t] (the MoE's
selected experts in one launch, spec §4.11), where x may also be one row [1, K] that every id
shares (decode's routed gate/up: no copies of x). ``gemv_swiglu`` takes the MoE's gate|up output
instead of x and applies the SwiGLU on the way in (the down projection). Letters: T tokens,
N rows, K columns, E stacked experts, S = K / 256 super-blocks per row. Block layouts:
quants.py and spec §7.4.

Device layout (``pack_<type>``, lowbit_layout.py, once at load): the GGUF blocks split into
planes. Quants become uint64 words (a lane's 16 bytes of a row are two: one 16-byte load); scale
bytes are reordered so that a lane finds its own in one word. ``unpack_<type>`` gives the GGUF
bytes back, and the references dequantise through it, so the packing is tested lossless.

    Q2_K     qs uint64 [E, N, K/32]  the 64 qs bytes of each super-block, in order
             sc uint32 [E, N, K/64]  the 16 scale bytes; word 2h+u of a super-block holds the
                                     sub-blocks 8h + 2j + u, j = 0..3 (those of lane slot 2h+u)
             dm f16    [E, N, 2S]    d, dmin
    Q4_K     qs uint64 [E, N, K/16]  the 128 qs bytes
             sc uint32 [E, N, K/64]  word p = sc[2p], sc[2p+1], mn[2p], mn[2p+1]: the 6-bit values
                                     unpacked from GGUF's 12 bytes (16 B here; +3% bytes read)
             dm f16    [E, N, 2S]    d, dmin
    IQ2_XXS  qs uint64 [E, N, K/32]  group of 32 elements: 4 grid indices | sign/scale word << 32
             d  f16    [E, N, S]
    MXFP4    qs uint64 [E, N, K/16]  the 16 nibble bytes of each 32-element block
             e  uint8  [E, N, K/32]  ue8m0 exponent

Kernels per type ``<t>`` (the launcher picks by T):
- ``_gemv_<t>_block_per_row``: one block per (row, token), a thread per element, block
  reduction; scalar float dequant. The obviously-right baseline.
- ``_gemv_<t>_dp4a_slots`` (decode, T <= DECODE_MAX_TOKENS, or any T with ids): a lane owns one
  16-byte "slot" of every row (64 or 32 columns). x[t] comes prepared by ``_x_slots_<t>`` (a
  small launch before it, once for all blocks; one row when the ids share x): int16 per slot
  split into a signed high and an unsigned low byte plane, x ~ scale·(256·hi + lo), in slot
  order, with the sums per 16 columns. ``_x_slots_swiglu_<t>`` prepares h = SwiGLU(gate, up)
  instead, computed there with moe.swiglu's float32 formula (``swiglu_scalar``): the same
  bits as a separate SwiGLU launch followed by ``_x_slots_<t>``. The block requests its first
  rows (16-byte ld.global.nc), then loads its slot's x into registers. Rows stream past R_ROWS
  at a time, the next step's loads issued before this step's math; codes become int8 in
  registers and meet x in ``dp4a`` (4 multiply-adds per integer instruction: the float pipe is
  not the limit). IQ2_XXS takes its grid rows from shared memory, in copies that
  spread a half-warp's lookups over the banks, and makes the signs in registers. Each slot's
  scales (``<t>_aux``) are loaded just before its dot, or (``aux_ahead``) a step ahead with
  its quant words, whichever measured faster for the type. Per-row sums: xor
  butterfly in the warp, then shared memory. The grid is one wave (blocks resident at once,
  from the compiled kernel's occupancy).
  Accuracy: x carries 15 bits per slot, |error| <= 1.6e-5 · max|x| over the slot (float32 x
  would give ~1e-7; the test bound is 1e-4); measured rel. error 2.1-2.4e-5 at V4 shapes.
- ``_gemm_<t>_smem_tiles`` (prefill, larger T, no ids): a tile of rows is dequantised once into
  shared memory (float32) and reused by a tile of tokens; 4 x 4 outputs per thread. On a GPU
  the launcher picks mma.py's tensor-core GEMM for these shapes; the simulator keeps this one.

H200, 6 of 256 experts (graph replay; ~13-17 MB read per launch; 2026-12-02): IQ2_XXS gate+up
18.7-21.6 µs (24.3 with the sign and negation tables: three shared lookups per 8 weights, the
kernel's main stall under ncu), Q2_K down 15 µs (15-16% / 27% of the 4.1 TB/s copy bandwidth).
A load-only kernel with the same access pattern takes 6-7 µs (~50%): at this size latency and
ramp-up, not bandwidth, set the floor.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .. import ops, quants
from ..quants import GGMLType
from . import device
from .bench import BenchCase
from .device import (SIMULATOR, block_sum, cdiv, kernel, resident_blocks, stream_buffer,
                     xor_shfl)
from .lowbit_layout import (GRID_REPS, IQ2_TABLE_WORDS, _GRID_U64, _f32_bits, _iq2_xxs_aux,
                            _iq2_xxs_dot, _iq2_xxs_elem, _iq2_xxs_word, _iq2_xxs_xcol, _ld_u64x2,
                            _ld_u64x2_flat, _mxfp4_aux, _mxfp4_dot, _mxfp4_elem, _mxfp4_word,
                            _mxfp4_xcol, _q2_k_aux, _q2_k_aux_flat, _q2_k_dot, _q2_k_elem,
                            _q2_k_word, _q2_k_xcol, _q4_k_aux, flat_at,
                            _q4_k_dot, _q4_k_elem, _q4_k_word, _q4_k_xcol, pack_iq2_xxs,
                            pack_mxfp4, pack_q2_k, pack_q4_k, unpack_iq2_xxs, unpack_mxfp4,
                            unpack_q2_k, unpack_q4_k)
from .mma import gemm_mma, supports
from .qweight import QWeight

__all__ = ["pack_q2_k", "pack_q4_k", "pack_iq2_xxs", "pack_mxfp4", "unpack_q2_k", "unpack_q4_k",
           "unpack_iq2_xxs", "unpack_mxfp4", "gemv_q2_k_ref", "gemv_q4_k_ref", "gemv_iq2_xxs_ref",
           "gemv_mxfp4_ref", "gemv_q2_k", "gemv_q4_k", "gemv_iq2_xxs", "gemv_mxfp4",
           "gemv_swiglu_ref", "gemv_swiglu", "fuses_swiglu", "shares_x_row", "swiglu_scalar"]

DECODE_MAX_TOKENS = 6  # shared-weight GEMV up to this many tokens; the MoE's 6 experts use ids
R_ROWS = 2  # rows a decode lane has in flight per step (x2 with the next step's prefetch)
KC = 32  # GEMM: columns per shared-memory tile
MAX_TILE = 128  # GEMM: rows / tokens per tile at most (4 per thread)
TILE_LD = MAX_TILE + 1  # GEMM shared tile row length (the +1 spreads the fill's stores over banks)


# ---- NumPy references -------------------------------------------------------------------------
def _gemv_ref(unpack, out: np.ndarray, w: QWeight, x: np.ndarray, ids) -> None:
    """out[T, N] = W[e_t] · x[t] in float64, W from quants.dequantize of the unpacked bytes."""
    host = QWeight(w.qtype, w.rows, w.cols, w.experts, tuple(np.asarray(p) for p in w.planes))
    raw = unpack(host)  # [E, N, row_bytes]
    experts = np.zeros(len(x), np.int64) if ids is None else np.asarray(ids, np.int64)
    for e in np.unique(experts):
        W = quants.dequantize(raw[e], w.qtype).astype(np.float64)  # [N, K]
        sel = experts == e
        out[sel] = np.asarray(x, np.float64)[sel] @ W.T


def gemv_q2_k_ref(out, w, x, ids=None):
    """out[T, N] float32 = x[T, K] · W[N, K]ᵀ, or W[ids[t]] · x[t]; W a packed Q2_K weight."""
    _gemv_ref(unpack_q2_k, out, w, x, ids)


def gemv_q4_k_ref(out, w, x, ids=None):
    """As gemv_q2_k_ref for a packed Q4_K weight."""
    _gemv_ref(unpack_q4_k, out, w, x, ids)


def gemv_iq2_xxs_ref(out, w, x, ids=None):
    """As gemv_q2_k_ref for a packed IQ2_XXS weight."""
    _gemv_ref(unpack_iq2_xxs, out, w, x, ids)


def gemv_mxfp4_ref(out, w, x, ids=None):
    """As gemv_q2_k_ref for a packed MXFP4 weight."""
    _gemv_ref(unpack_mxfp4, out, w, x, ids)


def gemv_swiglu_ref(out, w, gate_up, weights, clamp, ids=None):
    """out[T, N] = W[ids[t]] · h[t], h = weights[:, None] · ops.swiglu(gate, up, clamp) of
    gate_up[T, 2F] = [gate | up]: the spec of gemv_swiglu (moe.swiglu_fused_ref, then the GEMV)."""
    F = gate_up.shape[1] // 2
    h = ops.swiglu(gate_up[:, :F], gate_up[:, F:], clamp) * np.asarray(weights)[:, None]
    REFS[w.qtype](out, w, h, ids)


# ---- lane-group exchange (the simulator has no shuffles: stage through shared memory) -----------
if SIMULATOR:
    @cuda.jit(device=True)
    def _slot_sums(part, rs, scratch):
        """part[r] += part[r] of the lanes rs, 2rs, .. apart in the warp (xor butterfly), for
        every row r; staged R_ROWS at a time per barrier pair. Every thread must call it."""
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        off = 16
        while off >= rs:
            for r in range(R_ROWS):
                scratch[r * nt + t] = part[r]
            cuda.syncthreads()
            for r in range(R_ROWS):
                part[r] += scratch[r * nt + (t ^ off)]
            cuda.syncthreads()
            off >>= 1
else:
    @cuda.jit(device=True)
    def _slot_sums(part, rs, scratch):
        # the rows' butterflies side by side, a step at a time: R_ROWS independent shuffles in
        # flight instead of one row's dependent chain after another's (the same sums; the
        # chains' shuffle latency was 11.6% of the routed gate+up's stall samples, H100, (j))
        off = 16
        while off >= rs:
            for r in range(R_ROWS):
                part[r] += cuda.shfl_xor_sync(0xFFFFFFFF, part[r], off)
            off >>= 1


# ---- kernels -----------------------------------------------------------------------------------
def _block_per_row_kernel(elem):
    def gemv_block_per_row(out, planes, x, ids):
        # grid (N, T): block (n, t) computes out[t, n]; a thread per element, strided.
        n, b = cuda.blockIdx.x, cuda.blockIdx.y
        e = ids[b] if b < ids.shape[0] else 0  # ids = [0] when there are none
        bx = min(b, x.shape[0] - 1)  # x row: b's own, or the one row every id shares
        scratch = cuda.shared.array(1024, float32)
        acc = float32(0)
        for k in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            acc += elem(planes, e, n, k) * x[bx, k]
        s = block_sum(acc, scratch)
        if cuda.threadIdx.x == 0:
            out[b, n] = s
    return kernel(gemv_block_per_row)


K_MAX = 8192  # decode: longest row (per-slot tables in shared memory)
RED_FLOATS = 1024  # decode: warp partials, rows per block x warps
XCH_FLOATS = R_ROWS * 256 if SIMULATOR else 1  # simulator lane exchanges (threads <= 256)
PREP_THREADS = 128  # x preparation: threads per block


@cuda.jit(device=True)
def swiglu_scalar(g, u, w, clamp):
    """w · silu(min(g, c)) · clamp(u, ±c) in float32 (c <= 0: no clamp). The one copy of the
    formula: moe.swiglu's kernel and the fused down preparation both call it, so h has the same
    bits whichever launch makes it."""
    if clamp > 0:
        g = min(g, clamp)
        u = min(max(u, -clamp), clamp)
    # silu(g) = g · sigmoid(g), sigmoid from e^-|g| <= 1: no overflow for any g
    one = float32(1.0)
    z = math.exp(-abs(g))
    sig = one / (one + z) if g >= 0 else z / (one + z)
    return w * (g * sig) * u


def _x_slots_kernel(xcol, slot_cols):
    """(prepare_x_slots, prepare_x_slots_swiglu) for a type's slot order: the decode kernel's x
    from x itself, or from a gate|up GEMV output through the SwiGLU. One quantiser serves both."""
    xw = slot_cols // 4  # x words per slot (4 columns each)

    @cuda.jit(device=True)
    def to_slots(xq, xsum, xs, b, i, K, v0, v1, v2, v3):
        # x[b] -> int16 q = round(x / s) per slot (|q| <= 32000, s = max|x| / 32000 over the
        # slot), one 4-column word per thread: high bytes (signed) | low bytes (unsigned) << 32
        # into xq[b], in slot order; x . w = s * (256 dp4a(w, high) + dp4a(w, low)). Also the
        # sums of q per 16 columns (the K-quants' mins) and s per slot. Rounding by adding
        # 1.5 * 2^23 (no float->int conversion instruction). The xw words of a slot sit in
        # consecutive lanes, so slot maxima and 16-column sums are xor butterflies (every
        # thread takes part: lanes past K // 4 carry a copy of columns 0-3 and store nothing).
        xch = cuda.shared.array(XCH_FLOATS, float32)
        a = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
        off = xw >> 1
        while off > 0:
            a = max(a, xor_shfl(a, off, xch))
            off >>= 1
        inv = float32(32000) / a if a > 0 else float32(0)
        q0 = int32(_f32_bits(v0 * inv + float32(12582912.0))) - int32(0x4B400000)
        q1 = int32(_f32_bits(v1 * inv + float32(12582912.0))) - int32(0x4B400000)
        q2 = int32(_f32_bits(v2 * inv + float32(12582912.0))) - int32(0x4B400000)
        q3 = int32(_f32_bits(v3 * inv + float32(12582912.0))) - int32(0x4B400000)
        hw = (uint32((q0 >> 8) & 255) | (uint32((q1 >> 8) & 255) << uint32(8))
              | (uint32((q2 >> 8) & 255) << uint32(16))
              | (uint32((q3 >> 8) & 255) << uint32(24)))
        lw = (uint32(q0 & 255) | (uint32(q1 & 255) << uint32(8))
              | (uint32(q2 & 255) << uint32(16)) | (uint32(q3 & 255) << uint32(24)))
        qsum = float32(q0 + q1 + q2 + q3)
        qsum += xor_shfl(qsum, 1, xch)
        qsum += xor_shfl(qsum, 2, xch)
        if i < K // 4:
            xq[b, i] = uint64(hw) | (uint64(lw) << uint64(32))
            if i % 4 == 0:
                xsum[b, i // 4] = int32(qsum)
            if i % xw == 0:
                xs[b, i // xw] = a / float32(32000)

    def prepare_x_slots(xq, xsum, xs, x):
        # grid (K / 4 / threads, T): thread i quantises the 4 columns of x[b] that make word i
        # of slot order; the GEMV's blocks all read this once-made copy.
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        K = x.shape[1]
        c0 = xcol(i // xw, i % xw) if i < K // 4 else 0
        to_slots(xq, xsum, xs, b, i, K, x[b, c0], x[b, c0 + 1], x[b, c0 + 2], x[b, c0 + 3])

    def prepare_x_slots_swiglu(xq, xsum, xs, gate_up, w, clamp):
        # as prepare_x_slots for x[b] = h[b] = swiglu_scalar(gate, up, w[b], clamp) of
        # gate_up[b] = [gate | up] (F columns each), made here instead of in a SwiGLU launch:
        # the same float32 h, without its launch and round trip through memory.
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        b = cuda.blockIdx.y
        F = gate_up.shape[1] // 2
        c0 = xcol(i // xw, i % xw) if i < F // 4 else 0
        wb = w[b]
        to_slots(xq, xsum, xs, b, i, F,
                 swiglu_scalar(gate_up[b, c0], gate_up[b, F + c0], wb, clamp),
                 swiglu_scalar(gate_up[b, c0 + 1], gate_up[b, F + c0 + 1], wb, clamp),
                 swiglu_scalar(gate_up[b, c0 + 2], gate_up[b, F + c0 + 2], wb, clamp),
                 swiglu_scalar(gate_up[b, c0 + 3], gate_up[b, F + c0 + 3], wb, clamp))
    return kernel(prepare_x_slots), kernel(prepare_x_slots_swiglu)


def _dp4a_slots_kernel(aux, dot, slot_cols, table_words, aux_ahead, flat_aux=None,
                       **jit_opts):
    """The dp4a decode GEMV of a type (its aux / dot functions). ``flat_aux``: a candidate
    build whose quant words and scales are read by uint32 flat offsets (flat_aux(planes, fr,
    sl), fr the flat row e · N + n: lowbit_layout's _ld_flat), where (e, n, j) indexing makes
    64-bit strides, adds and the wrap-around of signed indices a load; the planes' elements
    must be < 2^32 (the launcher checks)."""
    flat = flat_aux is not None
    assert not (flat and aux_ahead)
    xw = slot_cols // 4  # x words per slot (4 columns each)
    runs = max(xw // 4, 1)  # 16-column runs per slot (the K-quant sub-blocks)

    def gemv_dp4a_slots(out, planes, xq, xsum, xs, ids, rows_per_block):
        # grid (row blocks, T); thread t = slot * rs + row lane: the rs lanes of a slot take rs
        # consecutive rows, the S slots of a row are spread over the block's warps. x[b] comes
        # prepared (xq, xsum, xs: prepare_x_slots), or x[0] when one row serves every id.
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        b = cuda.blockIdx.y
        e = ids[b] if b < ids.shape[0] else 0
        bx = min(b, xq.shape[0] - 1)
        N = out.shape[1]
        K = 4 * xq.shape[1]
        rs = nt // (K // slot_cols)
        sl = t // rs
        rl = t - sl * rs
        lane = t & 31
        nw = nt >> 5
        qs = planes[0]
        row0 = cuda.blockIdx.x * rows_per_block
        nrows = min(rows_per_block, N - row0)
        step = rs * R_ROWS
        # The first step's weights (quant words, and with aux_ahead the scales) are requested
        # before anything else, so the DRAM latency overlaps the x loads below; each later step
        # is requested a step ahead.
        wa = cuda.local.array(R_ROWS, uint64)
        wb = cuda.local.array(R_ROWS, uint64)
        au = cuda.local.array(R_ROWS, uint32)
        af = cuda.local.array(R_ROWS, float32)
        ag = cuda.local.array(R_ROWS, float32)
        fr0 = flat_at(e, N, 0)  # (flat: the expert's first row)
        for r in range(R_ROWS):
            n = row0 + min(r * rs + rl, nrows - 1)
            if flat:
                wa[r], wb[r] = _ld_u64x2_flat(qs, flat_at(fr0 + uint32(n), qs.shape[2], 2 * sl))
            else:
                wa[r], wb[r] = _ld_u64x2(qs, e, n, 2 * sl)
            if aux_ahead:
                au[r], af[r], ag[r] = aux(planes, e, n, sl)
        tab = cuda.shared.array(table_words, uint64)  # the IQ2_XXS tables
        red = cuda.shared.array(RED_FLOATS, float32)
        xch = cuda.shared.array(XCH_FLOATS, float32)

        # 1. my slot's x: xw words, split into the high and low byte planes
        xh = cuda.local.array(xw, uint32)
        xl = cuda.local.array(xw, uint32)
        xsl = cuda.local.array(runs, int32)
        for k in range(xw):
            v = xq[bx, sl * xw + k]
            xh[k] = uint32(v & uint64(0xFFFFFFFF))
            xl[k] = uint32(v >> uint64(32))
        for k in range(runs):
            xsl[k] = xsum[bx, sl * runs + k]
        xsc = xs[bx, sl]
        if table_words > 1:  # IQ2_XXS: the grid rows, GRID_REPS copies
            grid = cuda.const.array_like(_GRID_U64)
            for i in range(t, table_words, nt):
                tab[i] = grid[i // GRID_REPS]
            cuda.syncthreads()

        # 2. Rows stream past, R_ROWS 16-byte loads in flight per lane: the next step's are
        # issued before this step's math; each warp's per-row sums go to shared memory (no
        # block barrier until the end).
        na = cuda.local.array(R_ROWS, uint64)
        nb = cuda.local.array(R_ROWS, uint64)
        nu = cuda.local.array(R_ROWS, uint32)
        nf = cuda.local.array(R_ROWS, float32)
        ng = cuda.local.array(R_ROWS, float32)
        part = cuda.local.array(R_ROWS, float32)
        for r0 in range(0, nrows, step):
            if r0 + step < nrows:  # the same for the whole block
                for r in range(R_ROWS):
                    n = row0 + min(r0 + step + r * rs + rl, nrows - 1)
                    if flat:
                        na[r], nb[r] = _ld_u64x2_flat(
                            qs, flat_at(fr0 + uint32(n), qs.shape[2], 2 * sl))
                    else:
                        na[r], nb[r] = _ld_u64x2(qs, e, n, 2 * sl)
                    if aux_ahead:
                        nu[r], nf[r], ng[r] = aux(planes, e, n, sl)
            for r in range(R_ROWS):
                if flat:
                    au[r], af[r], ag[r] = flat_aux(
                        planes, uint32(fr0 + uint32(row0 + min(r0 + r * rs + rl, nrows - 1))), sl)
                elif not aux_ahead:
                    au[r], af[r], ag[r] = aux(planes, e, row0 + min(r0 + r * rs + rl, nrows - 1),
                                              sl)
                part[r] = dot(au[r], af[r], ag[r], wa[r], wb[r], xh, xl, xsl, tab, lane) * xsc
            for r in range(R_ROWS):
                wa[r] = na[r]
                wb[r] = nb[r]
                if aux_ahead:
                    au[r] = nu[r]
                    af[r] = nf[r]
                    ag[r] = ng[r]
            _slot_sums(part, rs, xch)
            if lane < rs:
                for r in range(R_ROWS):
                    i = r0 + r * rs + lane
                    if i < nrows:
                        if nw > 1:
                            red[i * nw + (t >> 5)] = part[r]
                        else:
                            out[b, row0 + i] = part[r]
        if nw > 1:  # 3. sum the warps' partials of each row
            cuda.syncthreads()
            for i in range(t, nrows, nt):
                s = float32(0)
                for w in range(nw):
                    s += red[i * nw + w]
                out[b, row0 + i] = s
    return kernel(gemv_dp4a_slots, **jit_opts)


def _smem_tiles_kernel(word):
    def gemm_smem_tiles(out, planes, x, rows_tile):
        # grid (N / rows_tile, T / toks_tile); thread (tr, tc) owns rows n0 + i*rt + tr and
        # tokens t0 + j*ct + tc, i, j < 4 (strided so shared reads are conflict-free).
        t = cuda.threadIdx.x
        rt = rows_tile // 4
        ct = cuda.blockDim.x // rt
        tr = t % rt
        tc = t // rt
        T, N = out.shape
        K = x.shape[1]
        n0 = cuda.blockIdx.x * rows_tile
        t0 = cuda.blockIdx.y * 4 * ct
        ws = cuda.shared.array((KC, TILE_LD), float32)  # [column, row] of the W tile
        xt = cuda.shared.array((KC, TILE_LD), float32)  # [column, token] of the x tile
        acc = cuda.local.array(16, float32)
        for i in range(16):
            acc[i] = 0
        for k0 in range(0, K, KC):
            for i in range(t, rows_tile * (KC // 4), cuda.blockDim.x):
                r, c = i // (KC // 4), i % (KC // 4)
                v0, v1, v2, v3 = word(planes, 0, min(n0 + r, N - 1), k0 // 4 + c)
                ws[4 * c, r] = v0
                ws[4 * c + 1, r] = v1
                ws[4 * c + 2, r] = v2
                ws[4 * c + 3, r] = v3
            for i in range(t, 4 * ct * KC, cuda.blockDim.x):
                j, c = i // KC, i % KC
                xt[c, j] = x[min(t0 + j, T - 1), k0 + c]
            cuda.syncthreads()
            for c in range(KC):
                for i in range(4):
                    a = ws[c, i * rt + tr]
                    for j in range(4):
                        acc[4 * i + j] += a * xt[c, j * ct + tc]
            cuda.syncthreads()
        for i in range(4):
            for j in range(4):
                if n0 + i * rt + tr < N and t0 + j * ct + tc < T:
                    out[t0 + j * ct + tc, n0 + i * rt + tr] = acc[4 * i + j]
    return kernel(gemm_smem_tiles)


class _Spec(NamedTuple):
    name: str
    qtype: int
    slot_cols: int  # decode: columns per 16-byte slot
    naive: object
    decode: object
    gemm: object
    prep: object  # the decode kernel's x preparation
    prep_swiglu: object  # ... with x = SwiGLU of a gate|up output (gemv_swiglu)


# The decode kernels want several blocks per SM with up to 47 KB of static shared memory each;
# the driver's default L1/shared split fits one (ncu, H200), so ask for the largest carveout.
_DECODE_JIT = {} if SIMULATOR else {"shared_memory_carveout": "MaxShared"}


def _spec(name, qtype, slot_cols, elem, xcol, aux, dot, word, aux_ahead: bool,
          table_words=1) -> _Spec:
    naive = _block_per_row_kernel(elem)
    decode = _dp4a_slots_kernel(aux, dot, slot_cols, table_words, aux_ahead, **_DECODE_JIT)
    gemm = _smem_tiles_kernel(word)
    prep, prep_swiglu = _x_slots_kernel(xcol, slot_cols)
    for k, kname in ((naive, f"_gemv_{name}_block_per_row"), (decode, f"_gemv_{name}_dp4a_slots"),
                     (gemm, f"_gemm_{name}_smem_tiles"), (prep, f"_x_slots_{name}"),
                     (prep_swiglu, f"_x_slots_swiglu_{name}")):
        k.__name__ = kname
    return _Spec(name, qtype, slot_cols, naive, decode, gemm, prep, prep_swiglu)


# aux_ahead: the slot's scales requested a step ahead with its quant words, or just before its
# dot. Measured on the H200 (6 of 256 experts, graphs of 16; BENCHMARKS 2026-12-02 (e)): ahead
# is slower for Q2_K / Q4_K / IQ2_XXS (15.2 / 21.8 / 18.7 µs against 16.8 / 24.1 / 20.5: more
# registers live across the step), faster for MXFP4 (26.0 against 27.4). Q2_K's a step ahead
# again in the decode step (its build at 126 registers, no spill: ptxas of CUDA 13): 7.919
# against 7.839 ms, H200, 43 layers, BENCHMARKS 2026-12-07 (ac), though Nsight puts 15% of the
# routed down's stall samples on the scale loaded just before the dot.
_Q2_K = _spec("q2_k", GGMLType.Q2_K, 64, _q2_k_elem, _q2_k_xcol, _q2_k_aux, _q2_k_dot,
               _q2_k_word, aux_ahead=False)
_Q4_K = _spec("q4_k", GGMLType.Q4_K, 32, _q4_k_elem, _q4_k_xcol, _q4_k_aux, _q4_k_dot,
               _q4_k_word, aux_ahead=False)
_IQ2_XXS = _spec("iq2_xxs", GGMLType.IQ2_XXS, 64, _iq2_xxs_elem, _iq2_xxs_xcol, _iq2_xxs_aux,
                 _iq2_xxs_dot, _iq2_xxs_word, table_words=IQ2_TABLE_WORDS, aux_ahead=False)
_MXFP4 = _spec("mxfp4", GGMLType.MXFP4, 32, _mxfp4_elem, _mxfp4_xcol, _mxfp4_aux, _mxfp4_dot,
               _mxfp4_word, aux_ahead=True)
SPECS = {s.qtype: s for s in (_Q2_K, _Q4_K, _IQ2_XXS, _MXFP4)}
# A candidate (the routed down's type only): the decode kernel reading its quant words and
# scales by uint32 flat offsets (_dp4a_slots_kernel's flat_aux), gemv_swiglu(..., flat=True);
# its loop 14% fewer SASS instructions (ptxas, offline; not yet measured on a GPU).
FLAT_DECODE = {GGMLType.Q2_K: _dp4a_slots_kernel(_q2_k_aux, _q2_k_dot, 64, 1, False,
                                                 flat_aux=_q2_k_aux_flat, **_DECODE_JIT)}
FLAT_DECODE[GGMLType.Q2_K].__name__ = "_gemv_q2_k_dp4a_slots_flat"

# Named per kernel for readers and profilers (the factories above build one of each per type).
(_gemv_q2_k_block_per_row, _gemv_q2_k_dp4a_slots, _gemm_q2_k_smem_tiles, _x_slots_q2_k,
 _x_slots_swiglu_q2_k) = _Q2_K[3:]
(_gemv_q4_k_block_per_row, _gemv_q4_k_dp4a_slots, _gemm_q4_k_smem_tiles, _x_slots_q4_k,
 _x_slots_swiglu_q4_k) = _Q4_K[3:]
(_gemv_iq2_xxs_block_per_row, _gemv_iq2_xxs_dp4a_slots, _gemm_iq2_xxs_smem_tiles,
 _x_slots_iq2_xxs, _x_slots_swiglu_iq2_xxs) = _IQ2_XXS[3:]
(_gemv_mxfp4_block_per_row, _gemv_mxfp4_dp4a_slots, _gemm_mxfp4_smem_tiles,
 _x_slots_mxfp4, _x_slots_swiglu_mxfp4) = _MXFP4[3:]


# ---- launchers ---------------------------------------------------------------------------------
_NO_IDS = []  # the 1-element dummy ids array ([0]: every token uses expert 0), made once


_FLOAT_X = []  # non-empty: decode through the float block-per-row kernel (float32 x)


def decode_with_float_x(on: bool = True) -> None:
    """Diagnostics: decode with float32 x (the block-per-row kernel, several times slower)
    instead of the dp4a kernels' 15-bit x, to tell their rounding from anything else."""
    _FLOAT_X[:] = [True] if on else []


def _no_ids():
    if not _NO_IDS:
        _NO_IDS.append(cuda.to_device(np.zeros(1, np.int32)))
    return _NO_IDS[0]


def _pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def decode_threads(spec: _Spec, K: int, threads: int | None) -> int | None:
    """Block size of the decode kernel for rows of K, or None if K does not fit it (slots per
    row a power of two, at most 256; K <= K_MAX)."""
    S = K // spec.slot_cols
    if K % spec.slot_cols or S & (S - 1) or S > 256 or K > K_MAX:
        return None
    nt = min(_pow2_floor(threads or 256), 256, 32 * S)  # rs = nt / S <= 32 lanes per slot
    return max(nt, S, 32)


def decode_config(spec: _Spec, T: int, N: int, K: int, nt: int, resident: int):
    """(rows_per_block, grid) of the decode kernel: rows in whole steps (rs * R_ROWS), split
    over about ``resident`` blocks in all."""
    step = nt // (K // spec.slot_cols) * R_ROWS
    steps = cdiv(N, step)
    rows_per_block = cdiv(steps, min(steps, max(1, resident // T))) * step
    rows_per_block = min(rows_per_block, RED_FLOATS // (nt // 32))  # partials fit in shared
    return rows_per_block, (cdiv(N, rows_per_block), T)


def _x_slots(spec: _Spec, prep, T: int, K: int, stream, *src):
    """(xq, xsum, xs): T rows of K columns in the decode kernel's slots, made by ``prep`` from
    ``src`` in one small launch, into buffers of the stream's own (the GEMV after it reads
    them on the same stream)."""
    xq = stream_buffer(f"{spec.name} x slots", stream, (T, K // 4), np.uint64)
    xsum = stream_buffer(f"{spec.name} x sums", stream, (T, K // 16), np.int32)
    xs = stream_buffer(f"{spec.name} x scales", stream, (T, K // spec.slot_cols), np.float32)
    prep[(cdiv(K // 4, PREP_THREADS), T), PREP_THREADS, stream](xq, xsum, xs, *src)
    return xq, xsum, xs


def _decode(spec: _Spec, out, w: QWeight, slots, ids_arr, nt: int, stream,
            flat: bool = False) -> None:
    """The dp4a GEMV on prepared x (``_x_slots``): one row per output row, or one for all
    (``flat``: FLAT_DECODE's build where the type has one)."""
    T, N = out.shape
    K = 4 * slots[0].shape[1]
    args = (out, w.planes, *slots, ids_arr, 0)
    k = FLAT_DECODE.get(spec.qtype, spec.decode) if flat else spec.decode
    assert k is spec.decode or all(p.size < 2**32 for p in w.planes)  # (its uint32 offsets)
    resident = resident_blocks(k, args, nt, simulated=8)  # (simulator: a row split)
    rows_per_block, grid = decode_config(spec, T, N, K, nt, resident)
    k[grid, nt, stream](*args[:-1], rows_per_block)


def _launch(spec: _Spec, out, w: QWeight, x, ids, stream, threads, how: str | None = None):
    """Run one of the type's kernels: ``how`` = 'naive' | 'decode' | 'gemm' | None (pick).
    With ``ids`` x may be one row [1, K] that every id shares (no per-id copies of x)."""
    T, N = out.shape
    K = x.shape[1]
    assert w.qtype == spec.qtype and (w.rows, w.cols) == (N, K), (w, out.shape, x.shape)
    assert x.shape[0] == T or (ids is not None and x.shape[0] == 1), (out.shape, x.shape)
    ids_arr = _no_ids() if ids is None else ids
    nt = decode_threads(spec, K, threads)
    if how is None:
        how = "decode" if (ids is not None or T <= DECODE_MAX_TOKENS) else "gemm"
        how = "naive" if how == "decode" and (nt is None or _FLOAT_X) else how
        if how == "gemm" and not SIMULATOR and supports(w):
            gemm_mma(out, w, x, None, None, stream)  # tensor cores
            return
    if how == "naive":
        nt = min(_pow2_floor(threads or 128), 1024)
        spec.naive[(N, T), nt, stream](out, w.planes, x, ids_arr)
    elif how == "decode":  # x prepared once (a small launch, one row if shared), then the GEMV
        _decode(spec, out, w, prepare_x(w, x, stream), ids_arr, nt, stream)
    else:
        assert ids is None, "the GEMM kernel runs one weight for all tokens"
        nt = min(_pow2_floor(threads or 256), 256)
        rt = min(1 << ((nt.bit_length() - 1 + 1) // 2), MAX_TILE // 4)
        rt = max(rt, nt // (MAX_TILE // 4))
        grid = (cdiv(N, 4 * rt), cdiv(T, 4 * (nt // rt)))
        spec.gemm[grid, nt, stream](out, w.planes, x, 4 * rt)


def gemv_q2_k(out, w, x, ids=None, stream=0, threads=None):
    """out[T, N] = W · x[t] (or W[ids[t]] · x[t]) for a packed Q2_K weight on the GPU. With
    ids, x may be [1, K]: one row shared by every id (the MoE's routed gate/up at decode)."""
    _launch(_Q2_K, out, w, x, ids, stream, threads)


def gemv_q4_k(out, w, x, ids=None, stream=0, threads=None):
    """As gemv_q2_k for a packed Q4_K weight."""
    _launch(_Q4_K, out, w, x, ids, stream, threads)


def gemv_iq2_xxs(out, w, x, ids=None, stream=0, threads=None):
    """As gemv_q2_k for a packed IQ2_XXS weight."""
    _launch(_IQ2_XXS, out, w, x, ids, stream, threads)


def gemv_mxfp4(out, w, x, ids=None, stream=0, threads=None):
    """As gemv_q2_k for a packed MXFP4 weight."""
    _launch(_MXFP4, out, w, x, ids, stream, threads)


def shares_x_row(w: QWeight) -> bool:
    """Whether the ids-GEMV of ``w`` takes one x row [1, K] for all ids: the low-bit types do
    (this module's launchers); gemv.py's F32/F16/BF16/Q8_0 want a row per id."""
    return w.qtype in SPECS


def takes_prepared_x(w: QWeight, threads=None) -> bool:
    """Whether ``w``'s decode runs the dp4a kernel on x prepared by its own launch (so that
    ``prepare_x`` / ``gemv_prepared`` apply): a low-bit type whose rows fit that kernel,
    float-x diagnostics off."""
    spec = SPECS.get(w.qtype)
    return spec is not None and not _FLOAT_X and decode_threads(spec, w.cols, threads) is not None


def fuses_swiglu(w: QWeight, threads=None) -> bool:
    """Whether gemv_swiglu takes ``w`` (the fused preparation feeds only the dp4a kernel)."""
    return takes_prepared_x(w, threads)


def prepare_x(w: QWeight, x, stream=0):
    """x [T, K] in the slots of ``w``'s dp4a decode kernel, launched on ``stream`` into buffers
    of that stream's own: the first half of a decode GEMV, so that it can run on a branch
    beside other work (the MoE's router); ``gemv_prepared`` is the second half."""
    spec = SPECS[w.qtype]
    return _x_slots(spec, spec.prep, x.shape[0], w.cols, stream, x)


def gemv_prepared(out, w: QWeight, slots, ids=None, stream=0, threads=None) -> None:
    """out[T, N] = W · x[t] (or W[ids[t]] · x[t]) on x prepared by ``prepare_x`` (the stream
    that made it joined into ``stream``); one x row may serve every id."""
    spec = SPECS[w.qtype]
    _decode(spec, out, w, slots, _no_ids() if ids is None else ids,
            decode_threads(spec, w.cols, threads), stream)


def gemv_swiglu(out, w, gate_up, weights, clamp: float, ids=None, stream=0,
                threads=None, flat: bool = False) -> None:
    """out[T, N] = W[ids[t]] · h[t] (or W · h[t]), h[t] = weights[t] · silu(min(gate, c)) ⊙
    clamp(up, ±c) of gate_up[T, 2F] = [gate | up] (c <= 0: no clamp): the MoE down projection
    straight from the fused gate+up output. h is made in the x preparation with moe.swiglu's
    float32 formula (``swiglu_scalar``), so the result equals moe.swiglu_fused then the GEMV,
    bit for bit, one launch fewer. ``fuses_swiglu(w)`` must hold; T: decode sizes. ``flat``:
    FLAT_DECODE's build (a candidate; the same sums)."""
    spec = SPECS[w.qtype]
    T, N = out.shape
    F = gate_up.shape[1] // 2
    assert fuses_swiglu(w, threads) and (w.rows, w.cols) == (N, F), (w, out.shape)
    assert gate_up.shape == (T, 2 * F) and weights.shape[0] == T, (gate_up.shape, weights.shape)
    slots = _x_slots(spec, spec.prep_swiglu, T, F, stream, gate_up, weights, float32(clamp))
    _decode(spec, out, w, slots, _no_ids() if ids is None else ids,
            decode_threads(spec, F, threads), stream, flat)


# ---- compile check and benchmarks ------------------------------------------------------------
_PLANE_SIGS = {
    "q2_k": "uint64[:, :, ::1], uint32[:, :, ::1], float16[:, :, ::1]",
    "q4_k": "uint64[:, :, ::1], uint32[:, :, ::1], float16[:, :, ::1]",
    "iq2_xxs": "uint64[:, :, ::1], float16[:, :, ::1]",
    "mxfp4": "uint64[:, :, ::1], uint8[:, :, ::1]",
}
_OUT_X = "float32[:, ::1], Tuple(({})), float32[:, ::1]"
_SLOTS = "uint64[:, ::1], int32[:, ::1], float32[:, ::1]"  # xq, xsum, xs
PTX_SIGNATURES = [
    sig for s in SPECS.values() for sig in (
        (s.naive, f"void({_OUT_X.format(_PLANE_SIGS[s.name])}, int32[::1])"),
        (s.decode, f"void(float32[:, ::1], Tuple(({_PLANE_SIGS[s.name]})), uint64[:, ::1], "
                   "int32[:, ::1], float32[:, ::1], int32[::1], int64)"),
        (s.gemm, f"void({_OUT_X.format(_PLANE_SIGS[s.name])}, int64)"),
        (s.prep, f"void({_SLOTS}, float32[:, ::1])"),
        (s.prep_swiglu, f"void({_SLOTS}, float32[:, ::1], float32[::1], float32)"))]
PTX_SIGNATURES.append((FLAT_DECODE[GGMLType.Q2_K], dict(PTX_SIGNATURES)[_Q2_K.decode]))

PACKERS = {GGMLType.Q2_K: pack_q2_k, GGMLType.Q4_K: pack_q4_k, GGMLType.IQ2_XXS: pack_iq2_xxs,
           GGMLType.MXFP4: pack_mxfp4}
REFS = {GGMLType.Q2_K: gemv_q2_k_ref, GGMLType.Q4_K: gemv_q4_k_ref,
        GGMLType.IQ2_XXS: gemv_iq2_xxs_ref, GGMLType.MXFP4: gemv_mxfp4_ref}


def _bench_weight(qtype, E, N, K, rng, distinct=8):
    """A stacked expert weight [E, N, K] on the GPU: ``distinct`` random experts tiled to E
    (each expert at its own address, so rotating ids really reads new memory)."""
    raw = quants.random_blocks(qtype, (distinct, N, K), rng, std=0.02)
    host = PACKERS[qtype](np.tile(raw, (cdiv(E, distinct), 1, 1))[:E], N, K)
    return host, host.to_device()


def bench_cases(stream) -> list[BenchCase]:
    """V4-Flash expert shapes (spec §1.1): gate/up [2048 x 4096] IQ2_XXS, down [4096 x 2048]
    Q2_K (Q4_K and MXFP4 at the same shapes), 6 of 256 experts per decode step. The ids rotate
    over 16 sets (~100 experts, well past the 60 MB L2) so each launch reads its weights from HBM,
    as a real decode step does. The 16 launches are one CUDA graph replay per case (an eager
    launch costs ~25 µs of Python, more than the kernel): bytes and FLOPs count all 16."""
    rng = np.random.default_rng(0)
    cases = []
    E, T = 256, 6
    id_sets = [cuda.to_device(rng.choice(E, T, replace=False).astype(np.int32), stream=stream)
               for _ in range(16)]

    def decode_case(spec, N, K, target=""):
        host, dev = _bench_weight(spec.qtype, E, N, K, rng)
        x = cuda.to_device(rng.standard_normal((T, K)).astype(np.float32), stream=stream)
        out = cuda.device_array((T, N), np.float32, stream=stream)
        launches = [functools.partial(_launch, spec, out, dev, x, ids, stream, None, "decode")
                    for ids in id_sets]
        replay = device.capture_graph(launches, stream)

        def check():
            launches[0]()
            ref = np.empty((T, N), np.float64)
            REFS[spec.qtype](ref, host, x.copy_to_host(), id_sets[0].copy_to_host())
            got = out.copy_to_host(stream=stream)
            stream.synchronize()
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        n = len(launches)
        nbytes = T * dev.nbytes // E + 4 * T * (K + N)  # 6 experts' planes, x, out
        cases.append(BenchCase("gemv_lowbit", f"{spec.decode.__name__} 6 of {E} x {N}x{K},"
                               f" {n} launches per graph", replay, n * nbytes,
                               n * 2 * T * N * K, target, check, launches=n))

    decode_case(_IQ2_XXS, 2048, 4096, ">= 75% copy bw")
    decode_case(_Q2_K, 4096, 2048, ">= 75% copy bw")
    decode_case(_Q4_K, 2048, 4096)
    decode_case(_MXFP4, 2048, 4096)

    # prefill: 512 tokens through one expert's gate (no ids), and the naive kernel at one shape
    host, dev = _bench_weight(GGMLType.IQ2_XXS, 1, 2048, 4096, rng, distinct=1)
    xp = cuda.to_device(rng.standard_normal((512, 4096)).astype(np.float32), stream=stream)
    outp = cuda.device_array((512, 2048), np.float32, stream=stream)
    cases.append(BenchCase("gemv_lowbit", f"{_IQ2_XXS.gemm.__name__} 512 tok x 2048x4096",
                           lambda: _launch(_IQ2_XXS, outp, dev, xp, None, stream, None, "gemm"),
                           dev.nbytes + xp.nbytes + outp.nbytes, 2 * 512 * 2048 * 4096))
    x1, out1 = xp[:1], outp[:1]
    cases.append(BenchCase("gemv_lowbit", f"{_IQ2_XXS.naive.__name__} 1 tok x 2048x4096",
                           lambda: _launch(_IQ2_XXS, out1, dev, x1, None, stream, None, "naive"),
                           dev.nbytes + 4 * (4096 + 2048), 2 * 2048 * 4096))
    return cases
