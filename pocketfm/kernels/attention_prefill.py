"""Chunked-prefill sink attention over the packed caches, without a dense mask (spec §4.9, §6.3).

    attention_prefill  out[T, H, K] <- q[T, H, K]: token t (position p = pos0 + t) attends
                       (1) the ring's entries of positions max(0, p-W+1) .. pos0-1,
                       (2) the chunk's own entries t' <= t with p - (pos0 + t') < W,
                       (3) compressed rows sel[t, s] >= 0 (CSA) or every j < n_comp_visible[t]
                           (HCA, ``all_visible``)
    store_chunk_rows   window ring <- the chunk's last min(T, W) entries at slots (pos0+t) mod W

Each token's key list is computed from pos0, W and its own row of sel / n_comp_visible, so no
[T, M] mask exists (attention.attention_chunk's mask is O(T·M): 134M bytes at T = 512 over a
262K-entry pool). Keys are their own values, in kvpack's packed format (V4: 584 B = 448 FP8
codes + 64 bf16 rope dims + 7 ue8m0 scales); the sink z_h sits in the denominator only, as in
ops.sink_attention. pos0, sel and n_comp_visible are device arrays: a captured graph reads the
current chunk's values. Order in a layer: attention_prefill reads the ring as it was BEFORE the
chunk, then store_chunk_rows pushes the chunk into it.

The fast kernel is the decode kernel's tile loop (attention.py) with one block per (token,
head group) and no split-K: a chunk has T x groups blocks (2048 at T = 512, H = 64), plenty to
fill the GPU, so each block runs the whole online softmax and applies the sink itself (no
partials, no combine launch, no scratch). Per tile of KC key slots the block decodes the keys
once into shared memory; its warps own HPW heads each, lanes own K/32 dims (K a multiple of
128, at most 512). Letters: T tokens, H heads, K head dim, R rope dims, W window slots,
S selected slots, N compressed entries.

On a GPU the launcher takes the tensor-core kernel instead (``mma``; the tile kernel ran at ~9
TFLOP/s on the H200, 813 ms of a 1,024-token chunk at 256K). All H heads of a token share its
keys (one latent kv head), so per token S = Q·Kᵀ and O += P·V are GEMMs with the heads as M: a
block takes one token and MT m-tiles of 16 heads (4·MT warps). Per tile of KT key slots (16
in the decode form and without ``keys``; 32 with them, the engine's prefill):

1. keys into shared memory, key-major, the one tile both MMAs read: the scores' B fragments
   by ldmatrix, P·V's by ldmatrix.trans (V is the same latent vector as K). Every value is
   exact in bf16 (e4m3 times a power of two; rope dims are bf16 already), so only q and P
   are split as hi + lo (mma.py's bf16x3 idea: two MMAs, float32 sums, rel. error ~1e-5).
   With ``keys`` (the PRE build, every layer of the engine's prefill) the compressed rows
   the chunk sees and the window's keys by position are decoded once a layer and chunk into
   a bf16 workspace (``decode_rows``: ~1 KB a row, 66 MB at 256K for CSA's 65,536 rows), and
   each key of a token's list is a row of it: its compressed slots first (HCA's rows in
   order, CSA's as sel picks them), then its window; cp.async copies the next tile's rows
   into one of two buffers while the other one's tile is in the MMAs. Without ``keys`` each
   thread takes (key, uint64 word) items, keys fastest, and decodes 8 FP8 codes (or copies 4
   bf16 rope dims) itself; on the H200 that cost HCA ~1.45x and CSA ~1.3x (2026-12-04 (e)).
2. scores: warp (m-tile, quarter) multiplies its 16 heads' q over K/4 dims (A fragments in
   registers for the whole launch) by the KT keys; the four quarters' partials meet in shared.
3. softmax: 8 threads per head row (max, exp, sum by xor shuffles), P written as bf16 hi + lo.
4. P·V: the warp rescales its 16 heads x K/4 output dims (registers) and adds P·V.

The next tile's words (or rows) are requested right after step 1's barrier (in flight
during the MMAs), the key codes of the tile after that one tile earlier still (a CSA code
reads sel first). Key-major rows are K/2 + 4 words long (4 mod 32), so the eight
16-byte rows an ldmatrix reads fall in different banks.

With ``q_norm_rope`` (the engine's prefill) q arrives as the q_b GEMM wrote it: a warp's
lanes hold their q values raw until the block barrier before the first tile, the four
quarters' sums of squares of each head meet in shared memory, and the token's cos / sin
table is made by R/2 threads; then each value is normalised, rotated and split. The store
rotates out back (the inverse RoPE). A chunk's q [T, H, K] is then read once, by the
attention, instead of three more times (the norm's read and write, RoPE's) and out once less.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .. import ops
from . import device, kvpack
from .attention import (DPL, HPW, HPWDPL, KC, _ALIGN, _attend, _dim, _finish, _init_heads,
                        _inline, _put, _tile_softmax, _unpack, random_packed_kv, rope_dim_of)
from .bench import BenchCase
from .device import cdiv, xor_shfl
from .gemv import _bits_f32
from .lowbit_layout import _f32_bits
from .mma import (_cp_async16, _cp_async_commit, _cp_async_wait0, _cp_async_wait1, _ldsm_x4,
                  _ldsm_x4_trans, _mma_bf16, _split_pair)
from .norm_rope import rmsnorm_rope, rope, rope_ref

WIN, CHUNK, COMP = 0, 1, 2  # key sources; a tile slot's code is 4·row + source (-1: no key)
# The tile kernel needs 156 registers unbounded (the decode kernel 128: three key sources and
# the token's list bounds stay live), so only one 256-thread block fits an SM; capped at 128,
# ptxas spills 12 bytes (values used once per tile) and two blocks fit. Unmeasured on the H200.
_TILE_OPTS = {} if device.SIMULATOR else {"max_registers": 128}


# ---- NumPy references (the spec) --------------------------------------------------------------
def attention_prefill_ref(out, q, window_packed, chunk_packed, comp_packed, sel, n_comp_visible,
                          all_visible, pos0, sinks, scale, q_norm_rope=None) -> None:
    """out[T, H, K] <- q[T, H, K]; window_packed[W, bytes] (the ring before the chunk),
    chunk_packed[T, bytes], comp_packed[Ncap, bytes] uint8 entries; sel[T, S] int32 (-1 =
    none), n_comp_visible[T] int32, pos0[1] int32; sinks[H]. The key list and a boolean mask
    built in NumPy, then ops.sink_attention. ``q_norm_rope`` (eps, pos[T], freqs[R/2]): q's
    (token, head) rows first get the weightless RMSNorm and the RoPE at pos, out then the
    inverse RoPE (the V4 attention's steps around it, spec §4.9), in q's precision."""
    T, H, K = q.shape
    if q_norm_rope is not None:
        eps, pos, freqs = (np.asarray(a) for a in q_norm_rope)
        qn = np.empty_like(q)
        ops.rmsnorm(qn, q, None, float(eps))
        rope_ref(qn, qn, pos, freqs, False)
        attention_prefill_ref(out, qn, window_packed, chunk_packed, comp_packed, sel,
                              n_comp_visible, all_visible, pos0, sinks, scale)
        rope_ref(out, out, pos, freqs, True)
        return
    W = window_packed.shape[0]
    R = rope_dim_of(K, window_packed.shape[1])
    p0 = int(np.asarray(pos0).reshape(-1)[0])
    pos = p0 + np.arange(T)
    prev = np.arange(max(0, p0 - W + 1), p0)  # ring positions any token of the chunk can see
    kpos = np.concatenate([prev, pos])
    wmask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - W)
    sel = np.asarray(sel)
    nvis = np.asarray(n_comp_visible).astype(np.int64)
    if all_visible:  # HCA: rows 0 .. n_comp_visible[t]-1
        rows = np.arange(nvis.max(initial=0))
        cmask = rows[None, :] < nvis[:, None]
    else:  # CSA: the distinct selected rows, and which token picked which
        rows = np.unique(sel[sel >= 0])
        cmask = (sel[:, :, None] == rows[None, None, :]).any(axis=1)
    kv = np.concatenate([_unpack(window_packed, prev % W, K, R),
                         _unpack(chunk_packed, np.arange(T), K, R),
                         _unpack(comp_packed, rows, K, R)]).astype(out.dtype)
    mask = np.concatenate([wmask, cmask], axis=1)
    ops.sink_attention(out, q, kv, mask, sinks, scale)


def _bf16_pairs(packed, K, R):
    """Packed entries [n, bytes] as bf16 pairs [n, K/2] uint32 (dim 2i in the low half): every
    unpacked value is exact in bf16, so its bits are float32's top half."""
    vals = np.empty((len(packed), K), np.float32)
    kvpack.unpack_kv_ref(vals, packed, R)
    half = (vals.view(np.uint32) >> np.uint32(16)).reshape(len(packed), K // 2, 2)
    return half[:, :, 0] | (half[:, :, 1] << np.uint32(16))


def decode_rows_ref(keys, comp_packed, n_comp_visible, window_packed, chunk_packed,
                    pos0) -> None:
    """keys[r, K/2] uint32 (bf16 pairs) <- every key row of the tensor-core kernel's PRE build:
    - comp_packed row r for r < n = min(n_comp_visible[-1], Ncap); rows n .. n rounded up to
      ROW_TILE zeroed (a tile's rows past a token's count are masked, and must be finite for
      P = 0 times them to vanish);
    - from row C = Ncap rounded up to ROW_TILE: the window's keys by position, row C + r for
      position pos0 - W + r: the ring's entries (zeros below position 0), then the chunk's T,
      then ROW_TILE rows of zeros (a token's last window tile may run past the chunk).
    The rest is left as it is."""
    K = 2 * keys.shape[1]
    ncap, W, T = comp_packed.shape[0], window_packed.shape[0], chunk_packed.shape[0]
    R = rope_dim_of(K, comp_packed.shape[1])
    n = max(0, min(int(np.asarray(n_comp_visible).reshape(-1)[-1]), ncap))
    keys[:n] = _bf16_pairs(comp_packed[:n], K, R)
    keys[n:-(-n // ROW_TILE) * ROW_TILE] = 0
    C = -(-ncap // ROW_TILE) * ROW_TILE
    p0 = int(np.asarray(pos0).reshape(-1)[0])
    pos = p0 - W + np.arange(W)
    keys[C:C + W + T + ROW_TILE] = 0
    ring = pos >= 0
    keys[C:C + W][ring] = _bf16_pairs(window_packed[pos[ring] % W], K, R)
    keys[C + W:C + W + T] = _bf16_pairs(chunk_packed, K, R)


def key_rows(ncap: int, W: int, T: int) -> int:
    """Rows the ``keys`` workspace needs for Ncap compressed rows, W window slots and a T-token
    chunk (decode_rows_ref's layout)."""
    return -(-ncap // ROW_TILE) * ROW_TILE + W + T + ROW_TILE


def store_chunk_rows_ref(window_packed, chunk_packed, pos0) -> None:
    """window_packed[W, bytes] <- chunk_packed[T, bytes]: entry t of the last min(T, W) goes
    to slot (pos0 + t) mod W (earlier ones would be overwritten within the chunk anyway)."""
    W, T = window_packed.shape[0], chunk_packed.shape[0]
    p0 = int(np.asarray(pos0).reshape(-1)[0])
    t = np.arange(T - min(T, W), T)
    window_packed[(p0 + t) % W] = chunk_packed[t]


# ---- the key list of one token ----------------------------------------------------------------
@_inline
def _key_code(m, t, p0, W, nwc, sel, all_visible, ncap):
    """Code (4·row + source, or -1) of slot m of token t's key list: slots 0 .. nwc-1 are the
    positions p-nwc+1 .. p (ring rows below pos0, chunk rows from pos0 on), then compressed
    slot i = m - nwc: row i (HCA) or row sel[t, i] (CSA; -1 or out of range: no key)."""
    if m < nwc:
        kp = p0 + t - nwc + 1 + m  # the key's position
        if kp < p0:
            return 4 * (kp % W) + WIN
        return 4 * (kp - p0) + CHUNK
    i = m - nwc
    if all_visible:
        return 4 * i + COMP
    j = int(sel[t, i])
    return 4 * j + COMP if j >= 0 and j < ncap else -1


@_inline
def _window_count(t, p0, W):
    """Ring + chunk keys of token t (positions max(0, p-W+1) .. p): min(p, W-1) + 1."""
    return min(p0 + t, W - 1) + 1


@_inline
def _comp_count(t, sel, n_comp, all_visible, ncap):
    """Compressed slots of token t: S (CSA, holes included) or its visible count (HCA)."""
    return max(0, min(int(n_comp[t]), ncap)) if all_visible else sel.shape[1]


# ---- naive kernel: one thread per (token, head), keys decoded where they are used -------------
@device.kernel
def _attention_prefill_naive(out, q, win, chunk, comp, sel, n_comp, all_visible, pos0, sinks,
                             scale, R):
    """out[T, H, K] as the running accumulator. The key list walked as the spec states it (by
    position, then the compressed rows), independently of the fast kernel's _key_code. (Built
    on _key_code, this kernel made NVVM 13.5 fail under lineinfo=True: "Symbol name with
    unsupported characters", from two of its debug-value records.)"""
    T, H, K = q.shape
    W = win.shape[0]
    ncap = comp.shape[0]
    p0 = int(pos0[0])
    for g in range(cuda.grid(1), T * H, cuda.gridsize(1)):
        t = g // H
        h = g - t * H
        orow = out[t, h]
        for d in range(K):
            orow[d] = float32(0.0)
        m = float32(-math.inf)
        l = float32(0.0)
        p = p0 + t
        for kp in range(max(0, p - W + 1), p + 1):  # ring before the chunk, then the chunk
            src = win if kp < p0 else chunk
            row = kp % W if kp < p0 else kp - p0
            m, l = _attend(orow, q[t, h], src, row, K - R, R, scale, m, l)
        for i in range(_comp_count(t, sel, n_comp, all_visible, ncap)):
            j = i if all_visible else int(sel[t, i])
            if j >= 0 and j < ncap:
                m, l = _attend(orow, q[t, h], comp, j, K - R, R, scale, m, l)
        _finish(orow, m, l, sinks[h])


# ---- fast kernel: shared-memory key tiles, one block per (token, head group) ------------------
@_inline
def _entry_word(win, chunk, comp, code, j):
    """Word j (in the arrays' dtype) of the packed entry that a key code names (a negative
    code: ring row 0)."""
    code = max(code, 0)
    src = comp if code & 3 == COMP else (chunk if code & 3 == CHUNK else win)
    return src[code >> 2, j]


@_inline
def _fetch3(win, chunk, comp, kcode, it, KW, NOPE, R):
    """(packed word, word holding its FP8 block's scale) of tile item ``it``: word it % KW of
    the tile's key it // KW, from the source its code names. Branch-free like attention's
    _fetch (clamped to a valid row and item), so several fetches issue back to back."""
    itc = min(it, KC * KW - 1)
    kk = itc // KW
    wd = itc - kk * KW
    code = kcode[kk]
    sb = NOPE + 2 * R + min(wd, NOPE // 4 - 1) // 16  # scale byte of dims 4wd.. (64 a block)
    return (int(_entry_word(win, chunk, comp, code, wd)),
            int(_entry_word(win, chunk, comp, code, sb // 4)) >> (8 * (sb % 4)))


_TILES: dict = {}


def _tile_kernel(K: int, R: int, NT: int):
    """(kernel, dynamic shared bytes) for head dim K, R rope dims and NT threads a block
    (closure constants, as attention._split_kernel: literal offsets, unrolled lane loops)."""
    key = (K, R, NT)
    if key in _TILES:
        return _TILES[key]
    if K % 128 or K > 32 * DPL or (K - R) % 64 or R % 2 or NT % 32 or not 0 < NT <= 1024:
        raise ValueError(f"attention_prefill: no layout for K={K}, R={R}, threads={NT}")
    ND = K // 32  # dims per lane: see attention._dim
    NOPE = K - R
    KW = NOPE // 4 + R // 2  # uint32 words per key to decode (FP8 codes, then bf16 pairs)
    NWARP = NT // 32
    SC = KC * K  # after the tile: per warp its 32 scores s[hh·KC + kk]
    XS = SC + NWARP * 32  # (simulator only) per warp: the [32][33] transpose of _lane_sums

    @device.kernel(**_TILE_OPTS)
    def _attention_prefill_tiles(out, q, win, chunk, comp, sel, n_comp, all_visible, pos0,
                                 sinks, scale):
        """out[t, h0 .. h0 + NWARP·HPW - 1] for t = blockIdx.x, head group blockIdx.y.

        win[W, words], chunk[T, words], comp[Ncap, words]: packed entries as uint32 words.
        Per tile of KC slots of the token's key list (_key_code): decode into shared memory;
        scores (lane partials over its dims, summed across lanes by _lane_sums); online
        softmax; finally the sink joins the denominator.
        """
        smem = cuda.shared.array(0, float32, alignment=_ALIGN)
        smem_u = cuda.shared.array(0, uint32, alignment=_ALIGN)  # same bytes: bf16 bit moves
        kcode = cuda.shared.array(KC, int32)
        H = q.shape[1]
        W = win.shape[0]
        ncap = comp.shape[0]
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        h0 = cuda.blockIdx.y * (NWARP * HPW) + wid * HPW
        qr = cuda.local.array(HPWDPL, float32)
        acc = cuda.local.array(HPWDPL, float32)
        kv = cuda.local.array(DPL, float32)
        v = cuda.local.array(32, float32)
        mr = cuda.local.array(HPW, float32)
        lr = cuda.local.array(HPW, float32)
        _init_heads(qr, acc, mr, lr, q[t], h0, lane, scale, ND)
        p0 = int(pos0[0])
        nwc = _window_count(t, p0, W)
        nslot = nwc + _comp_count(t, sel, n_comp, all_visible, ncap)
        for t0 in range(0, nslot, KC):
            if tid < KC:
                m = t0 + tid
                kcode[tid] = _key_code(m, t, p0, W, nwc, sel, all_visible, ncap) if m < nslot \
                    else -1
            cuda.syncthreads()
            # decode the tile, one packed word (4 FP8 codes or 2 bf16 dims) per item; four
            # fetches per thread before any decode (four L2 round trips overlap)
            for it in range(tid, KC * KW, 4 * NT):
                w0, x0 = _fetch3(win, chunk, comp, kcode, it, KW, NOPE, R)
                w1, x1 = _fetch3(win, chunk, comp, kcode, it + NT, KW, NOPE, R)
                w2, x2 = _fetch3(win, chunk, comp, kcode, it + 2 * NT, KW, NOPE, R)
                w3, x3 = _fetch3(win, chunk, comp, kcode, it + 3 * NT, KW, NOPE, R)
                _put(smem, smem_u, kcode, it, w0, x0, K, KW, NOPE, KC)
                _put(smem, smem_u, kcode, it + NT, w1, x1, K, KW, NOPE, KC)
                _put(smem, smem_u, kcode, it + 2 * NT, w2, x2, K, KW, NOPE, KC)
                _put(smem, smem_u, kcode, it + 3 * NT, w3, x3, K, KW, NOPE, KC)
            cuda.syncthreads()
            _tile_softmax(smem, kcode, qr, kv, v, acc, mr, lr, lane, wid, K, ND, SC, XS)
        for hh in range(HPW):  # the sink: exp(z - M) + l·exp(m - M) in the denominator
            h = h0 + hh
            if h < H:
                z = sinks[h]
                M = max(mr[hh], z)
                a = float32(math.exp(mr[hh] - M))  # no key at all: m = -inf, a = 0
                f = a / (lr[hh] * a + float32(math.exp(z - M)))
                for i in range(ND):
                    out[t, h, _dim(i, lane)] = acc[hh * DPL + i] * f

    smem_bytes = 4 * (XS + (NWARP * 32 * 33 if device.SIMULATOR else 0))
    _TILES[key] = (_attention_prefill_tiles, smem_bytes)
    return _TILES[key]


# ---- tensor-core kernel: S = Q·Kᵀ and O += P·V as MMAs, one block per (token, 16·MT heads) ----
MKC = 16  # key slots per tile of the decode form (attention.py plans its splits in these)
KT_MAX = 64  # the prefill's tiles: up to 4 k-steps of P·V per pass of the softmax
# the prefill's tiles by default: with ``keys`` (PRE: every tile copied, no packed words held
# in registers) 32 keys; keys decoded in the kernel 16 (at 32, 404 bytes of spills)
KEY_TILE_PRE, KEY_TILE = 32, 16
ROW_TILE = KT_MAX  # decoded compressed rows are zeroed up to a multiple of this (whole tiles)
MAX_MT = 2  # m-tiles (16 heads each) per block: 4 warps each
MXCH = 32 * 4 * MAX_MT * 6 if device.SIMULATOR else 1  # simulator MMA exchange (mma.py)
MSHF = 32 * 4 * MAX_MT if device.SIMULATOR else 1  # simulator lane exchange
_MMAS: dict = {}
# float32, not Python's float: a variable once assigned -math.inf is typed float64 by Numba,
# and the softmax's exps then ran in double precision (43 DFMAs a tile in the SASS)
NEG_INF = np.float32(-np.inf)


@_inline
def _fp8_bf16(b, c):
    """bf16 bits of e4m3 byte b times the block scale c = 2**(s - 127): the 7 magnitude bits
    moved into a float32's exponent and mantissa read as 2**(e-127)·(1 + m/8) (a denormal
    m/8·2**-126 for e = 0), times 2**120 and c: both exact, so the bf16 is the top half."""
    v = _bits_f32(uint32((b & 0x7F) << 20)) * float32(2.0 ** 120) * c
    return (_f32_bits(v) >> uint32(16)) | uint32((b & 0x80) << 8)


@_inline
def _block_scale(sword, j):
    """The float32 scale 2**(s - 127) of FP8 word j's 64-dim block from the entry's scale word
    (s = 0: 2**-127, which float32 holds only as a denormal)."""
    sb = uint32(sword >> uint64(8 * (j // 8))) & uint32(255)
    return _bits_f32(sb << uint32(23)) if sb > 0 else float32(2.0 ** -127)


@_inline
def _fp8x4_pairs(wd, cs):
    """Four e4m3 codes (bytes of wd, low first) times cs as two bf16-pair words."""
    b0 = _fp8_bf16(wd & uint32(255), cs)
    b1 = _fp8_bf16((wd >> uint32(8)) & uint32(255), cs)
    b2 = _fp8_bf16((wd >> uint32(16)) & uint32(255), cs)
    b3 = _fp8_bf16(wd >> uint32(24), cs)
    return b0 | (b1 << uint32(16)), b2 | (b3 << uint32(16))


@_inline
def _pre_key_row(m, t, nwc, ncs, ncomp, wrow, sel, all_visible, ncap):
    """Row of ``keys`` (decode_rows_ref's layout) of slot m of token t's key list in the PRE
    build, or -1 (no key): the compressed slots first (ncs of them, whole tiles: HCA's row m
    below its count ncomp, CSA's sel[t, m]), then the window's nwc keys, from row wrow on."""
    if m < ncs:
        if all_visible:
            return m if m < ncomp else -1
        if m >= ncomp:
            return -1
        j = int(sel[t, m])
        return j if j >= 0 and j < ncap else -1
    i = m - ncs
    return wrow + i if i < nwc else -1


@_inline
def _decode_key_code(m, nwin, W, sel, all_visible, ncap):
    """Code of slot m of the decode's key list (attention.attention_decode's order): window
    row m (valid below nwin), then compressed slot i = m - W: row i (HCA) or sel[0, i] (CSA)."""
    if m < W:
        return 4 * m + WIN if m < nwin else -1
    i = m - W
    if all_visible:
        return 4 * i + COMP
    j = int(sel[0, i])
    return 4 * j + COMP if j >= 0 and j < ncap else -1


def _mma_kernel(K: int, R: int, MT: int, DEC: bool = False, PRE: bool = False,
                KT: int = MKC, QF: bool = False, QS: bool = False):
    """(kernel, threads, dynamic shared bytes) of the tensor-core prefill attention for head
    dim K, R rope dims, MT m-tiles of 16 heads a block and KT key slots a tile (closure
    constants: literal offsets, register arrays of fixed size). ``DEC``: the decode form
    (attention_decode_mma, 16-key tiles): one token, its key list split over blockIdx.x,
    partials out. ``PRE``: every key a row of the decoded workspace (``keys``, decode_rows_ref's
    layout): a token's compressed slots in whole tiles, then its window, each tile's rows
    copied by cp.async into one of two buffers (the next one in flight during this one's
    MMAs). (A separate build: the branches and the second buffer made the other forms ~15%
    slower.) ``QF``: q as the q_b GEMM left it: each (token, head) row's weightless RMSNorm
    and its RoPE at qpos[t] applied as q is loaded, out's inverse RoPE as it is stored
    (attention_prefill's ``q_norm_rope``). ``QS`` (decode only): q and the partials staged in
    shared memory, both moved in coalesced runs: the block's q rows by cp.async, all in flight
    at once, and its partials a warp a row, lanes on consecutive words (read straight into the
    fragments and written from them, q took ~8 round trips of a few loads each and the
    partials' stores waited on the LSU queue: a third and a fifth of HCA's stall samples;
    staged, HCA at 256K 26.6 against 37.8 µs with the combine, H100, 2026-12-06 (r))."""
    key = (K, R, MT, DEC, PRE, KT, QF, QS)
    if key in _MMAS:
        return _MMAS[key]
    if K % 64 or (K - R) % 64 or R % 4 or K - R > 512 or not 1 <= MT <= MAX_MT or \
            KT not in (16, 32, 64) or DEC and (KT != MKC or QF) or QS and not DEC:
        raise ValueError(f"attention_prefill: no tensor-core layout for K={K}, R={R}, MT={MT}, "
                         f"{KT} keys a tile")
    NOPE = K - R
    NT = 128 * MT
    HG = 16 * MT  # heads per block
    NF8 = NOPE // 8  # uint64 words per entry: NF8 of FP8 codes, R/4 of rope dims, the scales
    NW8 = NF8 + R // 4
    NLD = 1 if PRE else cdiv(KT * NW8, NT)  # a tile's words per thread (PRE copies them all)
    SQ = K // 64  # score k-steps per warp (its K/4 dims)
    NS = KT // 8  # score n-tiles per warp (8 keys each)
    # with two n-tiles (16 keys) q's hi and lo products go to two accumulators (four chains
    # of MMAs, not two); wider tiles have chains enough, and one accumulator saves registers
    SPLIT = NS <= 2
    NSH, NSL = 4 * NS, 4 * NS if SPLIT else 1
    KP = KT // 16  # key pairs per softmax thread (8 threads a head row)
    NEV = 2 * KP  # (a literal for cuda.local.array)
    LDP = KT // 2  # words per row of P (bf16 key pairs)
    NI = K // 32  # output n-tiles per warp (its K/4 dims, 8 each)
    NQ, NACC = 4 * SQ, 4 * NI  # (literals for cuda.local.array)
    NP = max(R // 2, 1)  # QF: the token's rotated pairs (cos / sin tables in shared memory)
    QSS = 4 * HG  # QF: the quarters' sums of squares, [quarter][head]
    # key-major rows of LDK words, 4 mod 32: the 8 16-byte rows an ldmatrix reads sit in
    # different banks
    LDK = K // 2 + 4
    # kt[2][key][dim pair], two buffers (tile i in buffer i % 2): the B operand of S = Q·Kᵀ,
    # and (transposed) of O += P·V
    KT0 = 0
    KTB = KT * LDK  # words per buffer (one buffer without PRE: its tiles are all decoded
    # in the kernel, after the barrier that ends the last reader of the previous tile)
    NCP = cdiv(KT * K // 8, NT)  # 16-byte copies per thread of a decoded tile (``keys``)
    # sp[quarter][head][key]: the warps' partial scores (float32)
    SP0 = KT0 + (2 if PRE else 1) * KTB
    PH0 = SP0 + 4 * HG * (KT + 1)  # P as bf16 pairs, hi then lo, [head][key pair]
    PL0 = PH0 + HG * LDP
    AL0 = PL0 + HG * LDP  # per head: the tile's rescale factor, running max, running sum
    M0 = AL0 + HG
    L0 = M0 + HG
    WORDS = L0 + HG
    # QS: q's rows [head][dim], then the partials' rows [head][dim | max | sum], LDQ words
    # apart (16-byte rows for cp.async; 8 mod 32: a fragment's 8 rows x 4 lanes meet in pairs
    # of banks at most)
    LDQ = K + 8
    Q0 = WORDS
    NQC = cdiv(HG * K // 4, NT)  # q's 16-byte pieces per thread
    RUNS = cdiv(K + 2, 32)  # a partial row's stores per lane
    TOTAL = WORDS + (HG * LDQ if QS else 0)

    @_inline
    def _request_tile(wv, win, chunk, comp, kcode, b, tid):
        """Load the words of the tile whose codes are kcode[b] into wv (items: key fastest,
        clamped), and return the scale word of key ``tid`` (threads tid < KT)."""
        for u in range(NLD):
            it = min(tid + u * NT, KT * NW8 - 1)
            j = it // KT
            wv[u] = _entry_word(win, chunk, comp, kcode[b, it - j * KT], j)
        return _entry_word(win, chunk, comp, kcode[b, min(tid, KT - 1)], NW8)

    @_inline
    def _copy_tile(smem_u, dst, keys, kcode, b, zrow, tid):
        """cp.async the decoded keys rows kcode[b, ·] (no key: row zrow, zeros) into the kt
        buffer at word dst (16-byte pieces, a row's pieces on consecutive threads)."""
        for u in range(NCP):
            it = tid + u * NT
            if it < KT * K // 8:
                kk = it // (K // 8)
                p = it - kk * (K // 8)
                row = kcode[b, kk]
                row = zrow if row < 0 else row
                _cp_async16(smem_u, dst + kk * LDK + 4 * p, keys, row * (K // 2) + 4 * p)

    @device.kernel
    def _attention_prefill_mma(out, q, win, chunk, comp, keys, sel, n_comp, all_visible, pos0,
                               sinks, scale, qpos, freqs, eps):
        """out[t, h0 .. h0 + HG-1] for t = blockIdx.x, h0 = HG·blockIdx.y (module doc);
        win, chunk, comp: the packed entries as uint64 words; keys: comp's rows decoded
        (uint32 bf16 pairs [rows, K/2]; read by the PRE build only, else a placeholder);
        qpos [T] int32, freqs [R/2] float64, eps: read by the QF build only."""
        smem_u = cuda.shared.array(0, uint32)
        smem_f = cuda.shared.array(0, float32)  # the same bytes
        kcode = cuda.shared.array((3, KT), int32)  # tiles i, i+1, i+2 (at i % 3 ..)
        kscl = cuda.shared.array((2, KT), uint64)  # tiles i, i+1 (at i % 2 ..): scale words
        xch = cuda.shared.array(MXCH, np.int64)
        shf = cuda.shared.array(MSHF, float32)
        H = q.shape[1]
        W = win.shape[0]
        ncap = comp.shape[0]
        t = 0 if DEC else cuda.blockIdx.x
        h0 = cuda.blockIdx.y * HG
        tid = cuda.threadIdx.x
        lane, w = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        mt, wq = w >> 2, w & 3  # the warp's m-tile (heads 16mt ..) and dim quarter
        hr = 16 * mt  # its first row of the block's heads
        zero = float32(0.0)
        # q's A fragments for this warp's dims, scaled, hi + lo (QF: q's float32 bits until
        # the head's norm is known, after the first barrier; the quarters' sums of squares
        # meet in qss, the token's cos / sin in qcs / qsn, as _rmsnorm_rope_rows makes them)
        qh = cuda.local.array(NQ, uint32)
        ql = cuda.local.array(NQ, uint32)
        qss = cuda.shared.array(QSS, float32)
        qcs = cuda.shared.array(NP, float32)
        qsn = cuda.shared.array(NP, float32)
        ss0, ss1 = zero, zero  # QF: rows g and g + 8 of this warp's m-tile
        if QS:  # the block's q rows on their way (read after the first tile's request)
            for u in range(NQC):
                it = tid + u * NT
                hh = it // (K // 4)
                if it < HG * K // 4 and h0 + hh < H:
                    p = it - hh * (K // 4)
                    _cp_async16(smem_u, Q0 + hh * LDQ + 4 * p, q, (t * H + h0 + hh) * K + 4 * p)
            _cp_async_commit()
        for s in range(0 if QS else SQ):
            for r in range(4):  # (g, 2c), (g+8, 2c), (g, 2c+8), (g+8, 2c+8)
                h = h0 + hr + g + 8 * (r & 1)
                d = (K // 4) * wq + 16 * s + 2 * c + 8 * (r >> 1)
                if QF:
                    v0 = q[t, h, d] if h < H else zero
                    v1 = q[t, h, d + 1] if h < H else zero
                    qh[4 * s + r], ql[4 * s + r] = _f32_bits(v0), _f32_bits(v1)
                    if r & 1:
                        ss1 += v0 * v0 + v1 * v1
                    else:
                        ss0 += v0 * v0 + v1 * v1
                else:
                    v0 = q[t, h, d] * scale if h < H else zero
                    v1 = q[t, h, d + 1] * scale if h < H else zero
                    qh[4 * s + r], ql[4 * s + r] = _split_pair(v0, v1)
        if QF:
            ss0 += xor_shfl(ss0, 1, shf)  # the row's 4 lanes (c)
            ss0 += xor_shfl(ss0, 2, shf)
            ss1 += xor_shfl(ss1, 1, shf)
            ss1 += xor_shfl(ss1, 2, shf)
            if c == 0:
                qss[wq * HG + hr + g] = ss0
                qss[wq * HG + hr + g + 8] = ss1
            if tid < R // 2:
                ang = float(qpos[t]) * freqs[tid]  # float64: positions reach 1M
                qcs[tid] = math.cos(ang)
                qsn[tid] = math.sin(ang)
        wv = cuda.local.array(NLD, uint64)  # the next tile's packed words, in flight
        sh = cuda.local.array(NSH, float32)  # score tiles: q hi (and lo, SPLIT) products
        sl = cuda.local.array(NSL, float32)  # (SPLIT: q lo's)
        ev = cuda.local.array(NEV, float32)  # the softmax thread's scores, then exps
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = zero
        if tid < HG:
            smem_f[M0 + tid] = NEG_INF
            smem_f[L0 + tid] = zero
        p0 = int(pos0[0])  # DEC: the window's entry count
        if DEC:  # this split's whole tiles of the list: slots tb0·KT .. send-1
            nwc = W
            nslot = W + _comp_count(0, sel, n_comp, all_visible, ncap)
            per = ((nslot + KT - 1) // KT + cuda.gridDim.x - 1) // cuda.gridDim.x
            tb0 = cuda.blockIdx.x * per
            send = min(nslot, (tb0 + per) * KT)
        else:
            nwc = _window_count(t, p0, W)
            nslot = nwc + _comp_count(t, sel, n_comp, all_visible, ncap)
            tb0 = 0
            send = nslot
        # PRE: every key a row of ``keys``, copied: the compressed slots first, in whole
        # tiles, then the window's keys (decode_rows_ref's layout)
        ncomp = nslot - nwc
        nct = (ncomp + KT - 1) // KT if PRE else 0
        ntile = 0
        wrow = 0  # PRE: the keys row of the token's first window key
        zrow = 0  # PRE: a row of zeros (the one after the chunk's rows)
        if PRE:
            send = nct * KT + nwc
            ntile = nct + (nwc + KT - 1) // KT
            C = (ncap + ROW_TILE - 1) // ROW_TILE * ROW_TILE
            wrow = C + t + W - nwc + 1
            zrow = C + W + chunk.shape[0]
        # The pipeline: tile i's words (and its keys' scale words) are requested during tile
        # i-1's MMAs, its key codes during tile i-2 (a code may need sel[t, ·] first: two
        # dependent reads kept off the path between barriers).
        # (_key_code is called in place: an inlined wrapper of it makes NVVM 13.5 fail under
        # lineinfo=True, as the naive kernel's doc says)
        if tid < KT:
            for i in range(2):
                m = (tb0 + i) * KT + tid
                code = -1
                if m < send:
                    if DEC:
                        code = _decode_key_code(m, p0, W, sel, all_visible, ncap)
                    elif PRE:
                        code = _pre_key_row(m, t, nwc, nct * KT, ncomp, wrow, sel,
                                            all_visible, ncap)
                    else:
                        code = _key_code(m, t, p0, W, nwc, sel, all_visible, ncap)
                kcode[i, tid] = code
        sw = uint64(0)
        if PRE:  # tile 0 on its way to buffer 0 (a group committed either way)
            cuda.syncthreads()  # (its rows, just written)
            if ntile > 0:
                _copy_tile(smem_u, KT0, keys, kcode, 0, zrow, tid)
            _cp_async_commit()
        cuda.syncthreads()
        if not PRE:
            sw = _request_tile(wv, win, chunk, comp, kcode, 0, tid)
            if tid < KT:
                kscl[0, tid] = sw
        if QS:
            _cp_async_wait0()
        cuda.syncthreads()
        if QS:  # q's fragments from shared memory, scaled, split
            for s in range(SQ):
                for r in range(4):
                    hh = hr + g + 8 * (r & 1)
                    d = (K // 4) * wq + 16 * s + 2 * c + 8 * (r >> 1)
                    v0 = smem_f[Q0 + hh * LDQ + d] * scale if h0 + hh < H else zero
                    v1 = smem_f[Q0 + hh * LDQ + d + 1] * scale if h0 + hh < H else zero
                    qh[4 * s + r], ql[4 * s + r] = _split_pair(v0, v1)
        if QF:  # q normalised, rotated, scaled, split (the sums and tables: before a barrier)
            ra, rb = hr + g, hr + g + 8  # (a padded head's zeros stay: 0 bits are bf16 zeros)
            inv0 = float32(1.0 / math.sqrt((qss[ra] + qss[HG + ra] + qss[2 * HG + ra]
                                            + qss[3 * HG + ra]) / K + eps))
            inv1 = float32(1.0 / math.sqrt((qss[rb] + qss[HG + rb] + qss[2 * HG + rb]
                                            + qss[3 * HG + rb]) / K + eps))
            for s in range(SQ):  # (constant bounds, no branch around an index: qh / ql stay
                for r in range(4):  # in registers)
                    d = (K // 4) * wq + 16 * s + 2 * c + 8 * (r >> 1)
                    inv = inv1 if r & 1 else inv0
                    v0 = _bits_f32(qh[4 * s + r]) * inv
                    v1 = _bits_f32(ql[4 * s + r]) * inv
                    if d >= NOPE:
                        k = (d - NOPE) >> 1
                        v0, v1 = v0 * qcs[k] - v1 * qsn[k], v0 * qsn[k] + v1 * qcs[k]
                    if h0 + hr + g + 8 * (r & 1) < H:
                        qh[4 * s + r], ql[4 * s + r] = _split_pair(v0 * scale, v1 * scale)
        for ti in range(max(0, (send - tb0 * KT + KT - 1) // KT)):
            cur, nxt = ti % 3, (ti + 1) % 3
            kb = KT0 + (ti & 1) * KTB if PRE else KT0  # this tile's buffer
            # 1. this tile into kt: copied (PRE: decoded rows, on their way since the last
            # tile) or decoded here from the packed words in wv
            if not PRE:
                for u in range(NLD):
                    it = tid + u * NT
                    if it < KT * NW8:
                        j = it // KT
                        kk = it - j * KT
                        x = wv[u] if kcode[cur, kk] >= 0 else uint64(0)
                        lo, hi = uint32(x & uint64(0xFFFFFFFF)), uint32(x >> uint64(32))
                        o = kb + kk * LDK
                        if j < NF8:  # 8 FP8 dims 8j .. 8j+7
                            cs = _block_scale(kscl[ti & 1, kk], j)
                            smem_u[o + 4 * j], smem_u[o + 4 * j + 1] = _fp8x4_pairs(lo, cs)
                            smem_u[o + 4 * j + 2], smem_u[o + 4 * j + 3] = _fp8x4_pairs(hi, cs)
                        else:  # 4 bf16 rope dims, as they are
                            d = NOPE + 4 * (j - NF8)
                            smem_u[o + d // 2] = lo
                            smem_u[o + d // 2 + 1] = hi
            if PRE:  # the next tile into the other buffer (tile i-1's)
                if ti + 1 < ntile:
                    _copy_tile(smem_u, KT0 + ((ti + 1) & 1) * KTB, keys, kcode, nxt, zrow, tid)
                _cp_async_commit()
                _cp_async_wait1()  # this tile's copies have landed (the group before the last)
            cuda.syncthreads()
            # the next tile's words and the codes of the one after, requested now: in flight
            # during this tile's MMAs
            if not PRE:
                sw = _request_tile(wv, win, chunk, comp, kcode, nxt, tid)
            m = (tb0 + ti + 2) * KT + tid
            code2 = -1
            if tid < KT and m < send:
                if DEC:
                    code2 = _decode_key_code(m, p0, W, sel, all_visible, ncap)
                elif PRE:
                    code2 = _pre_key_row(m, t, nwc, nct * KT, ncomp, wrow, sel, all_visible,
                                         ncap)
                else:
                    code2 = _key_code(m, t, p0, W, nwc, sel, all_visible, ncap)
            # 2. this warp's part of the scores: its K/4 dims, NS n-tiles, hi and lo. One
            # ldmatrix a k-step and 16 keys: lane 8m + r points at key r + 8(m >> 1), dims
            # + 8(m & 1)
            for i in range(NSH):
                sh[i] = zero
            if SPLIT:
                for i in range(NSL):
                    sl[i] = zero
            lm = lane >> 3
            ks = kb + ((lane & 7) + 8 * (lm >> 1)) * LDK + (K // 8) * wq + 4 * (lm & 1)
            for s in range(SQ):
                for np_ in range(NS // 2):
                    kf = _ldsm_x4(smem_u, ks + 16 * np_ * LDK + 8 * s, xch)
                    for e in range(2):
                        b0, b1 = kf[2 * e], kf[2 * e + 1]
                        j = 4 * (2 * np_ + e)
                        sh[j], sh[j + 1], sh[j + 2], sh[j + 3] = _mma_bf16(
                            qh[4 * s], qh[4 * s + 1], qh[4 * s + 2], qh[4 * s + 3], b0, b1,
                            sh[j], sh[j + 1], sh[j + 2], sh[j + 3], xch)
                        if SPLIT:
                            sl[j], sl[j + 1], sl[j + 2], sl[j + 3] = _mma_bf16(
                                ql[4 * s], ql[4 * s + 1], ql[4 * s + 2], ql[4 * s + 3], b0,
                                b1, sl[j], sl[j + 1], sl[j + 2], sl[j + 3], xch)
                        else:
                            sh[j], sh[j + 1], sh[j + 2], sh[j + 3] = _mma_bf16(
                                ql[4 * s], ql[4 * s + 1], ql[4 * s + 2], ql[4 * s + 3], b0,
                                b1, sh[j], sh[j + 1], sh[j + 2], sh[j + 3], xch)
            for ni in range(NS):
                for r in range(4):  # C: (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1)
                    row = hr + g + 8 * (r >> 1)
                    key = 8 * ni + 2 * c + (r & 1)
                    v = sh[4 * ni + r]
                    if SPLIT:
                        v += sl[4 * ni + r]
                    smem_f[SP0 + (wq * HG + row) * (KT + 1) + key] = v
            cuda.syncthreads()
            # 3. online softmax: 8 threads per head row, key pairs i, i + 8, .. (KP of them)
            row, i = tid >> 3, tid & 7
            mx = NEG_INF
            for u in range(KP):
                kk = 2 * (i + 8 * u)
                for e in range(2):
                    sv = zero
                    for qq in range(4):
                        sv += smem_f[SP0 + (qq * HG + row) * (KT + 1) + kk + e]
                    if kcode[cur, kk + e] < 0:
                        sv = NEG_INF
                    ev[2 * u + e] = sv
                    mx = max(mx, sv)
            mx = max(mx, xor_shfl(mx, 1, shf))
            mx = max(mx, xor_shfl(mx, 2, shf))
            mx = max(mx, xor_shfl(mx, 4, shf))
            m_old = smem_f[M0 + row]
            m_new = max(m_old, mx)
            alpha = float32(1.0)
            ps = zero
            for u in range(2 * KP):
                e0 = zero
                if m_new > NEG_INF:  # (a row that has seen no key yet keeps alpha = 1)
                    e0 = float32(math.exp(ev[u] - m_new))  # -inf: 0
                ev[u] = e0
                ps += e0
            if m_new > NEG_INF:
                alpha = float32(math.exp(m_old - m_new))  # first live tile: 0
            ps += xor_shfl(ps, 1, shf)
            ps += xor_shfl(ps, 2, shf)
            ps += xor_shfl(ps, 4, shf)
            for u in range(KP):
                hi, lo = _split_pair(ev[2 * u], ev[2 * u + 1])
                smem_u[PH0 + row * LDP + i + 8 * u] = hi
                smem_u[PL0 + row * LDP + i + 8 * u] = lo
            if i == 0:
                smem_f[AL0 + row] = alpha
                smem_f[M0 + row] = m_new
                smem_f[L0 + row] = smem_f[L0 + row] * alpha + ps
            if tid < KT:  # (tile i-1 was the last reader of both slots)
                kscl[(ti + 1) & 1, tid] = sw
                kcode[(ti + 2) % 3, tid] = code2
            cuda.syncthreads()
            # 4. O = alpha·O + P·V over this warp's heads and output dims, a k-step per 16 keys
            al0, al1 = smem_f[AL0 + hr + g], smem_f[AL0 + hr + g + 8]
            for ni in range(NI):
                acc[4 * ni] *= al0
                acc[4 * ni + 1] *= al0
                acc[4 * ni + 2] *= al1
                acc[4 * ni + 3] *= al1
            for kq in range(KP):
                pa = PH0 + (hr + g) * LDP + c + 8 * kq
                pb = PL0 + (hr + g) * LDP + c + 8 * kq
                ah0, ah1, ah2, ah3 = smem_u[pa], smem_u[pa + 8 * LDP], smem_u[pa + 4], \
                    smem_u[pa + 8 * LDP + 4]
                al_0, al_1, al_2, al_3 = smem_u[pb], smem_u[pb + 8 * LDP], smem_u[pb + 4], \
                    smem_u[pb + 8 * LDP + 4]
                # V = the same key-major tile, transposed by ldmatrix: lane 8m + r points at
                # key 16kq + r + 8(m & 1), output dims 8(ni + (m >> 1)) ..; one load, two
                # n-tiles
                vs = kb + ((lane & 7) + 8 * (lm & 1) + 16 * kq) * LDK + (K // 8) * wq + \
                    4 * (lm >> 1)
                for nj in range(NI // 2):
                    vb = _ldsm_x4_trans(smem_u, vs + 8 * nj, xch)
                    for e in range(2):
                        b0, b1 = vb[2 * e], vb[2 * e + 1]
                        j = 8 * nj + 4 * e
                        acc[j], acc[j + 1], acc[j + 2], acc[j + 3] = _mma_bf16(
                            ah0, ah1, ah2, ah3, b0, b1, acc[j], acc[j + 1], acc[j + 2],
                            acc[j + 3], xch)
                        acc[j], acc[j + 1], acc[j + 2], acc[j + 3] = _mma_bf16(
                            al_0, al_1, al_2, al_3, b0, b1, acc[j], acc[j + 1], acc[j + 2],
                            acc[j + 3], xch)
            cuda.syncthreads()  # every warp is done with kt and P: the next tile
        if QS:  # partials [split, head, Σ p·k | max | sum]: rows into shared, then out in runs
            for r in range(2):
                o = Q0 + (hr + g + 8 * r) * LDQ + (K // 4) * wq + 2 * c
                for ni in range(NI):
                    smem_f[o + 8 * ni] = acc[4 * ni + 2 * r]
                    smem_f[o + 8 * ni + 1] = acc[4 * ni + 2 * r + 1]
            if tid < HG:
                smem_f[Q0 + tid * LDQ + K] = smem_f[M0 + tid]
                smem_f[Q0 + tid * LDQ + K + 1] = smem_f[L0 + tid]
            cuda.syncthreads()
            b = cuda.blockIdx.x
            for hh in range(w, min(HG, H - h0), NT // 32):  # a warp a row, lanes on its words
                for j in range(RUNS):
                    d = lane + 32 * j
                    if d < K + 2:
                        out[b, h0 + hh, d] = smem_f[Q0 + hh * LDQ + d]
        for r in range(0 if QS else 2):  # the sink: exp(z - M) + l·exp(m - M) in the denominator
            row = hr + g + 8 * r
            h = h0 + row
            if DEC and h < H:  # partials [split, head, Σ p·k | max | sum]: combined later
                b = cuda.blockIdx.x
                for ni in range(NI):
                    d = (K // 4) * wq + 8 * ni + 2 * c
                    out[b, h, d] = acc[4 * ni + 2 * r]
                    out[b, h, d + 1] = acc[4 * ni + 2 * r + 1]
                if wq == 0 and c == 0:
                    out[b, h, K] = smem_f[M0 + row]
                    out[b, h, K + 1] = smem_f[L0 + row]
            elif h < H:
                z = sinks[h]
                mr = smem_f[M0 + row]
                M = max(mr, z)
                a = float32(math.exp(mr - M))  # no key at all: m = -inf, a = 0
                f = a / (smem_f[L0 + row] * a + float32(math.exp(z - M)))
                for ni in range(NI):
                    d = (K // 4) * wq + 8 * ni + 2 * c
                    o0 = acc[4 * ni + 2 * r] * f
                    o1 = acc[4 * ni + 2 * r + 1] * f
                    if QF and d >= NOPE:  # the inverse RoPE: the angle's sine negated
                        k = (d - NOPE) >> 1
                        sn = -qsn[k]
                        o0, o1 = o0 * qcs[k] - o1 * sn, o0 * sn + o1 * qcs[k]
                    out[t, h, d] = o0
                    out[t, h, d + 1] = o1

    if DEC:
        _attention_prefill_mma.__name__ = "_attention_decode_mma"
    if PRE:
        _attention_prefill_mma.__name__ = "_attention_prefill_mma_decoded"
    if QF:  # (its own name in a profile)
        _attention_prefill_mma.__name__ += "_qnorm"
    if QS:
        _attention_prefill_mma.__name__ += "_staged"
    _MMAS[key] = (_attention_prefill_mma, NT, 4 * TOTAL)
    return _MMAS[key]


@_inline
def _decode_row_word(keys, kr, src, sr, j, live, NF8, NW8):
    """keys[kr] words of packed uint64 word j of src[sr] (NF8 FP8 words, then rope words, the
    scales in word NW8), or zeros where not ``live``."""
    x = src[sr, j] if live else uint64(0)
    lo, hi = uint32(x & uint64(0xFFFFFFFF)), uint32(x >> uint64(32))
    if j < NF8:  # 8 FP8 dims 8j .. 8j+7
        cs = _block_scale(src[sr, NW8] if live else uint64(0), j)
        keys[kr, 4 * j], keys[kr, 4 * j + 1] = _fp8x4_pairs(lo, cs)
        keys[kr, 4 * j + 2], keys[kr, 4 * j + 3] = _fp8x4_pairs(hi, cs)
    else:  # 4 bf16 rope dims
        d = 8 * NF8 + 4 * (j - NF8)
        keys[kr, d // 2] = lo
        keys[kr, d // 2 + 1] = hi


@device.kernel
def _decode_rows(keys, comp, n_comp, win, chunk, pos0):
    """keys <- decode_rows_ref's rows: comp's visible rows and their zeros to ROW_TILE, then the
    window's W + T + ROW_TILE rows by position. One uint64 word a thread, grid-stride; comp,
    win, chunk as uint64 words [rows, NW8 + 1] (the last word holds the scales), keys uint32."""
    KH = keys.shape[1]
    NW8 = comp.shape[1] - 1
    NF8 = KH // 2 - NW8  # FP8 words: NW8 = NOPE/8 + R/4 and K = NOPE + R
    ncap = comp.shape[0]
    W, T = win.shape[0], chunk.shape[0]
    n = max(0, min(int(n_comp[n_comp.shape[0] - 1]), ncap))
    nz = (n + ROW_TILE - 1) // ROW_TILE * ROW_TILE
    C = (ncap + ROW_TILE - 1) // ROW_TILE * ROW_TILE
    p0 = int(pos0[0])
    for i in range(cuda.grid(1), (nz + W + T + ROW_TILE) * NW8, cuda.gridsize(1)):
        r = i // NW8
        j = i - r * NW8
        if r < nz:
            _decode_row_word(keys, r, comp, min(r, ncap - 1), j, r < n, NF8, NW8)
        else:
            r -= nz  # window row r: position p0 - W + r
            p = p0 - W + r
            if r < W:
                _decode_row_word(keys, C + r, win, max(p, 0) % W, j, p >= 0, NF8, NW8)
            else:
                _decode_row_word(keys, C + r, chunk, min(r - W, T - 1), j, r < W + T, NF8,
                                 NW8)


@device.kernel
def _store_chunk_rows(win, chunk, pos0):
    """win[W, words] <- the last min(T, W) rows of chunk[T, words], row t at (pos0 + t) mod W
    (one uint32 word per thread, grid-stride)."""
    W, NW = win.shape
    T = chunk.shape[0]
    n = min(T, W)
    p0 = int(pos0[0])
    for i in range(cuda.grid(1), n * NW, cuda.gridsize(1)):
        r = i // NW
        w = i - r * NW
        t = T - n + r
        win[(p0 + t) % W, w] = chunk[t, w]


# ---- launchers --------------------------------------------------------------------------------
def attention_prefill(out, q, window_packed, chunk_packed, comp_packed, sel, n_comp_visible,
                      all_visible: int, pos0, sinks, scale: float, stream=0, threads=None,
                      naive: bool = False, mma=None, keys=None, key_tile=None,
                      q_norm_rope=None, fold_q_norm_rope: bool = True) -> None:
    """out[T, H, K] f32 <- chunked-prefill sink attention of q[T, H, K] (see the module doc):
    window_packed[W, bytes] the ring before the chunk, chunk_packed[T, bytes] the chunk's own
    entries, comp_packed[Ncap, bytes]; sel[T, S] int32 (CSA; -1 = none; S = 1 of -1 for
    window-only layers), n_comp_visible[T] int32 (HCA, with ``all_visible``), pos0[1] int32,
    sinks[H] f32 — all device arrays. One launch, no allocation, no host sync.

    ``mma`` True / False / None (pick): the tensor-core kernel, by default on a GPU; the
    simulator's engine keeps the tile kernel (``mma=True`` forces it, for its tests).
    ``keys``: a uint32 workspace [>= key_rows(Ncap, W, T), K/2] for the tensor cores: comp's
    visible rows and the window's keys by position are decoded into it once (``decode_rows``),
    and every block copies its keys' rows (cp.async) instead of decoding each entry again per
    token. Only rows below n_comp_visible[T-1] are decoded, so with ``keys`` CSA's ``sel`` must
    name rows below it (the engine's top-k picks among each token's visible rows); a row past
    it reads a stale workspace row.
    ``key_tile``: key slots a tile of the tensor-core kernel (16, 32 or 64; by default
    KEY_TILE_PRE with ``keys``, else KEY_TILE).
    ``q_norm_rope`` (eps, pos [T] int32, freqs [R/2] float64): q as the q_b GEMM left it. Each
    (token, head) row gets the weightless RMSNorm and the RoPE at pos (norm_rope.rmsnorm_rope),
    and out the inverse RoPE: the tensor-core kernel does both as it loads q and stores out,
    which saves the prefill two passes over q and one over out a layer; the other forms run
    those launches around the kernel, q normalised in place; so does the tensor-core kernel
    with ``fold_q_norm_rope`` False (the launches the fold replaced, for an A/B)."""
    T, H, K = q.shape
    if T == 0:
        return
    R = rope_dim_of(K, window_packed.shape[1])
    on_mma = (not device.SIMULATOR) if mma is None else mma
    if q_norm_rope is not None and (naive or not on_mma or not fold_q_norm_rope):
        eps, pos, freqs = q_norm_rope
        serial = device.SIMULATOR  # (the serial forms, as the simulator's engine runs them)
        rmsnorm_rope(q, q, sinks, eps, False, pos, freqs, stream, naive=serial)
        attention_prefill(out, q, window_packed, chunk_packed, comp_packed, sel,
                          n_comp_visible, all_visible, pos0, sinks, scale, stream, threads,
                          naive, mma, keys, key_tile)
        rope(out, out, pos, freqs, True, stream, naive=serial)
        return
    if q_norm_rope is not None and 2 * q_norm_rope[2].shape[0] != R:
        raise ValueError(f"attention_prefill: freqs {q_norm_rope[2].shape}, need {R // 2} "
                         f"pairs for {R} rope dims")
    args = (window_packed, chunk_packed, comp_packed)
    rest = (sel, n_comp_visible, int32(all_visible), pos0, sinks, float32(scale))
    if naive:
        nt = threads or 64
        _attention_prefill_naive[min(cdiv(T * H, nt), 4096), nt, stream](out, q, *args, *rest, R)
        return
    if on_mma:
        mt = 1 if H <= 16 else MAX_MT
        pre = keys is not None
        kt = key_tile or (KEY_TILE_PRE if pre else KEY_TILE)
        fold = q_norm_rope is not None
        kern, nt, smem = _mma_kernel(K, R, mt, PRE=pre, KT=kt, QF=fold)
        words = tuple(a.view(np.uint64) for a in args)
        kd = _no_keys(K)
        if pre:
            if keys.shape[1] != K // 2:
                raise ValueError(f"attention_prefill: keys {keys.shape}, need {K // 2} columns")
            decode_rows(keys, comp_packed, n_comp_visible, window_packed, chunk_packed, pos0,
                        stream)
            kd = keys
        eps, pos, freqs = q_norm_rope if fold else (0.0, *_no_rope())
        device.launch_shared(kern, (T, cdiv(H, 16 * mt)), nt, stream, smem, out, q, *words, kd,
                             *rest, pos, freqs, float32(eps))
        return
    # a block of NT threads owns NT/32·HPW heads; small H: no idle warps
    nt = threads or min(256, cdiv(H, HPW) * 32)
    kern, smem = _tile_kernel(K, R, nt)
    words = tuple(a.view(np.uint32) for a in args)
    kern[(T, cdiv(H, nt // 32 * HPW)), nt, stream, smem](out, q, *words, *rest)


def decode_rows(keys, comp_packed, n_comp_visible, window_packed, chunk_packed, pos0,
                stream=0) -> None:
    """keys <- the compressed rows the last token of the chunk sees and the window's keys by
    position, as bf16 pairs (decode_rows_ref; device arrays, keys uint32
    [>= key_rows(Ncap, W, T), K/2])."""
    ncap, W, T = comp_packed.shape[0], window_packed.shape[0], chunk_packed.shape[0]
    rope_dim_of(2 * keys.shape[1], comp_packed.shape[1])  # (raises unless keys' K fits)
    need = key_rows(ncap, W, T)
    if keys.shape[0] < need:
        raise ValueError(f"attention_prefill: keys {keys.shape}, need at least {need} rows")
    comp, win, chunk = (a.view(np.uint64) for a in (comp_packed, window_packed, chunk_packed))
    words = need * (comp.shape[1] - 1)  # (an upper bound: the grid strides)
    _decode_rows[min(cdiv(words, 256), 1024), 256, stream](keys, comp, n_comp_visible, win,
                                                            chunk, pos0)


_NO_KEYS: list = []


def _no_keys(K: int):
    """The [1, 1] placeholder passed as ``keys`` to the builds that do not read it."""
    if not _NO_KEYS:
        _NO_KEYS.append(cuda.device_array((1, 1), np.uint32))
    return _NO_KEYS[0]


def _no_rope():
    """The (pos, freqs) placeholders passed to the builds that do not read them."""
    return device.empty_vector(np.int32), device.empty_vector(np.float64)


def store_chunk_rows(window_packed, chunk_packed, pos0, stream=0, threads=None) -> None:
    """window_packed[W, bytes] <- chunk_packed[T, bytes] at slots (pos0 + t) mod W for the last
    min(T, W) entries (device arrays; pos0[1] int32). Run it after attention_prefill."""
    W, T = window_packed.shape[0], chunk_packed.shape[0]
    nt = threads or 128
    n = min(T, W) * (window_packed.shape[1] // 4)
    if n == 0:
        return
    _store_chunk_rows[min(cdiv(n, nt), 1024), nt, stream](
        window_packed.view(np.uint32), chunk_packed.view(np.uint32), pos0)


# ---- CI lane B and the benchmark --------------------------------------------------------------
_F3 = "float32[:, :, ::1]"
_TAIL = "int32[:, ::1], int32[::1], int32, int32[::1], float32[::1], float32"
_MMA_TAIL = f"{_TAIL}, int32[::1], float64[::1], float32"  # (+ qpos, freqs, eps)
PTX_SIGNATURES = [
    (_attention_prefill_naive, f"void({_F3}, {_F3}, uint8[:, ::1], uint8[:, ::1], "
                               f"uint8[:, ::1], {_TAIL}, int64)"),
    (_tile_kernel(512, 64, 256)[0], f"void({_F3}, {_F3}, uint32[:, ::1], uint32[:, ::1], "
                                    f"uint32[:, ::1], {_TAIL})"),  # V4-Flash, 256 threads
    (_mma_kernel(512, 64, MAX_MT)[0], f"void({_F3}, {_F3}, uint64[:, ::1], uint64[:, ::1], "
                                      f"uint64[:, ::1], uint32[:, ::1], {_MMA_TAIL})"),  # V4-Flash
    *((_mma_kernel(512, 64, MAX_MT, DEC=True, QS=qs)[0],
       f"void({_F3}, {_F3}, uint64[:, ::1], uint64[:, ::1], uint64[:, ::1], uint32[:, ::1], "
       f"{_MMA_TAIL})") for qs in (False, True)),
    (_mma_kernel(512, 64, MAX_MT, PRE=True, KT=KEY_TILE_PRE)[0],
     f"void({_F3}, {_F3}, uint64[:, ::1], uint64[:, ::1], uint64[:, ::1], uint32[:, ::1], "
     f"{_MMA_TAIL})"),
    (_mma_kernel(512, 64, MAX_MT, PRE=True, KT=KEY_TILE_PRE, QF=True)[0],
     f"void({_F3}, {_F3}, uint64[:, ::1], uint64[:, ::1], uint64[:, ::1], uint32[:, ::1], "
     f"{_MMA_TAIL})"),  # the engine's prefill: q's norm and RoPE folded in
    (_decode_rows, "void(uint32[:, ::1], uint64[:, ::1], int32[::1], uint64[:, ::1], "
                   "uint64[:, ::1], int32[::1])"),
    (_store_chunk_rows, "void(uint32[:, ::1], uint32[:, ::1], int32[::1])"),
]


def bench_cases(stream) -> list[BenchCase]:
    """V4-Flash prefill: a T = 512 chunk, H = 64 heads x K = 512 (R = 64), a full 128-entry
    ring; CSA picks 512 rows per token from a 65,536-entry pool (262K context), HCA attends all
    of about 2048 entries."""
    from ..numerics import rope_frequencies

    rng = np.random.default_rng(0)
    T, H, K, R, W, S = 512, 64, 512, 64, 128, 512
    B = kvpack.kv_entry_bytes(K, R)
    cases = []
    for mode in ("CSA", "HCA"):
        hca = mode == "HCA"
        ncap = 2048 if hca else 65_536
        p0 = ncap * (128 if hca else 4) - T  # the chunk ends where the pool does
        nvis = ((p0 + np.arange(T) + 1) // (128 if hca else 4)).astype(np.int32)
        sel = (np.full((T, 1), -1, np.int32) if hca else
               np.stack([np.sort(rng.choice(int(n), S, replace=False)) for n in nvis]))
        dev = {n: cuda.to_device(a, stream=stream) for n, a in {
            "q": (rng.normal(size=(T, H, K)) / 8).astype(np.float32),
            "win": random_packed_kv(rng, W, K, R),
            "chunk": random_packed_kv(rng, T, K, R),
            "comp": random_packed_kv(rng, ncap, K, R),
            "sel": sel.astype(np.int32),
            "nc": nvis,
            "p0": np.array([p0], np.int32),
            "sinks": rng.normal(size=H).astype(np.float32),
        }.items()}
        out = cuda.device_array((T, H, K), np.float32, stream=stream)

        ncomp = nvis.astype(np.int64) if hca else np.full(T, S)
        keys = int((np.minimum(p0 + np.arange(T), W - 1) + 1 + ncomp).sum())
        rows = ncap if hca else len(np.unique(sel))  # each distinct entry read once, ideally
        nbytes = (W + T + rows) * B + 2 * out.nbytes + (0 if hca else sel.nbytes)
        # and with the keys decoded once into a workspace, as the engine runs both modes;
        # last with q's norm and RoPE and out's inverse RoPE folded in (the engine's form:
        # against the one before it plus norm_rope's "prefill" cases, which it replaces)
        kd = cuda.device_array((key_rows(ncap, W, T), K // 2), np.uint32, stream=stream)
        fold = (1e-6, cuda.to_device((p0 + np.arange(T)).astype(np.int32), stream=stream),
                cuda.to_device(rope_frequencies(R, 160000.0, 16.0, 65536), stream=stream))
        runs = [(False, None, None), (True, None, None), (True, kd, None), (True, kd, fold)]
        for mma, kd, qf in runs:
            def launch(d=dev, out=out, hca=hca, mma=mma, kd=kd, qf=qf):
                attention_prefill(out, d["q"], d["win"], d["chunk"], d["comp"], d["sel"],
                                  d["nc"], int(hca), d["p0"], d["sinks"], 1 / math.sqrt(K),
                                  stream=stream, mma=mma, keys=kd, q_norm_rope=qf)
            how = ("tensor cores, rows decoded once" if kd is not None else
                   "tensor cores" if mma else "tiles")
            how += ", q norm + RoPE folded" if qf is not None else ""
            cases.append(BenchCase(
                "attention_prefill",
                f"attention_prefill {how} {mode} T={T} H={H} "
                f"K={K} W={W} comp={'%d visible' % ncap if hca else '%d of %d' % (S, ncap)}",
                launch, nbytes, flops=4 * H * K * keys))
    return cases
