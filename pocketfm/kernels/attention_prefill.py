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
from .device import cdiv

WIN, CHUNK, COMP = 0, 1, 2  # key sources; a tile slot's code is 4·row + source (-1: no key)
# The tile kernel needs 156 registers unbounded (the decode kernel 128: three key sources and
# the token's list bounds stay live), so only one 256-thread block fits an SM; capped at 128,
# ptxas spills 12 bytes (values used once per tile) and two blocks fit. Unmeasured on the H200.
_TILE_OPTS = {} if device.SIMULATOR else {"max_registers": 128}


# ---- NumPy references (the spec) --------------------------------------------------------------
def attention_prefill_ref(out, q, window_packed, chunk_packed, comp_packed, sel, n_comp_visible,
                          all_visible, pos0, sinks, scale) -> None:
    """out[T, H, K] <- q[T, H, K]; window_packed[W, bytes] (the ring before the chunk),
    chunk_packed[T, bytes], comp_packed[Ncap, bytes] uint8 entries; sel[T, S] int32 (-1 =
    none), n_comp_visible[T] int32, pos0[1] int32; sinks[H]. The key list and a boolean mask
    built in NumPy, then ops.sink_attention."""
    T, H, K = q.shape
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
def _fetch3(win, chunk, comp, kcode, it, KW, NOPE, R):
    """(packed word, word holding its FP8 block's scale) of tile item ``it``: word it % KW of
    the tile's key it // KW, from the source its code names. Branch-free like attention's
    _fetch (clamped to a valid row and item), so several fetches issue back to back."""
    itc = min(it, KC * KW - 1)
    kk = itc // KW
    wd = itc - kk * KW
    code = max(kcode[kk], 0)
    src = comp if code & 3 == COMP else (chunk if code & 3 == CHUNK else win)
    sb = NOPE + 2 * R + min(wd, NOPE // 4 - 1) // 16  # scale byte of dims 4wd.. (64 a block)
    return int(src[code >> 2, wd]), int(src[code >> 2, sb // 4]) >> (8 * (sb % 4))


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
                _put(smem, smem_u, kcode, it, w0, x0, K, KW, NOPE)
                _put(smem, smem_u, kcode, it + NT, w1, x1, K, KW, NOPE)
                _put(smem, smem_u, kcode, it + 2 * NT, w2, x2, K, KW, NOPE)
                _put(smem, smem_u, kcode, it + 3 * NT, w3, x3, K, KW, NOPE)
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
                      naive: bool = False) -> None:
    """out[T, H, K] f32 <- chunked-prefill sink attention of q[T, H, K] (see the module doc):
    window_packed[W, bytes] the ring before the chunk, chunk_packed[T, bytes] the chunk's own
    entries, comp_packed[Ncap, bytes]; sel[T, S] int32 (CSA; -1 = none; S = 1 of -1 for
    window-only layers), n_comp_visible[T] int32 (HCA, with ``all_visible``), pos0[1] int32,
    sinks[H] f32 — all device arrays. One launch, no allocation, no host sync."""
    T, H, K = q.shape
    if T == 0:
        return
    R = rope_dim_of(K, window_packed.shape[1])
    args = (window_packed, chunk_packed, comp_packed)
    rest = (sel, n_comp_visible, int32(all_visible), pos0, sinks, float32(scale))
    if naive:
        nt = threads or 64
        _attention_prefill_naive[min(cdiv(T * H, nt), 4096), nt, stream](out, q, *args, *rest, R)
        return
    # a block of NT threads owns NT/32·HPW heads; small H: no idle warps
    nt = threads or min(256, cdiv(H, HPW) * 32)
    kern, smem = _tile_kernel(K, R, nt)
    words = tuple(a.view(np.uint32) for a in args)
    kern[(T, cdiv(H, nt // 32 * HPW)), nt, stream, smem](out, q, *words, *rest)


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
PTX_SIGNATURES = [
    (_attention_prefill_naive, f"void({_F3}, {_F3}, uint8[:, ::1], uint8[:, ::1], "
                               f"uint8[:, ::1], {_TAIL}, int64)"),
    (_tile_kernel(512, 64, 256)[0], f"void({_F3}, {_F3}, uint32[:, ::1], uint32[:, ::1], "
                                    f"uint32[:, ::1], {_TAIL})"),  # V4-Flash, 256 threads
    (_store_chunk_rows, "void(uint32[:, ::1], uint32[:, ::1], int32[::1])"),
]


def bench_cases(stream) -> list[BenchCase]:
    """V4-Flash prefill: a T = 512 chunk, H = 64 heads x K = 512 (R = 64), a full 128-entry
    ring; CSA picks 512 rows per token from a 65,536-entry pool (262K context), HCA attends all
    of about 2048 entries."""
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

        def launch(d=dev, out=out, hca=hca):
            attention_prefill(out, d["q"], d["win"], d["chunk"], d["comp"], d["sel"], d["nc"],
                              int(hca), d["p0"], d["sinks"], 1 / math.sqrt(K), stream=stream)

        ncomp = nvis.astype(np.int64) if hca else np.full(T, S)
        keys = int((np.minimum(p0 + np.arange(T), W - 1) + 1 + ncomp).sum())
        rows = ncap if hca else len(np.unique(sel))  # each distinct entry read once, ideally
        nbytes = (W + T + rows) * B + 2 * out.nbytes + (0 if hca else sel.nbytes)
        cases.append(BenchCase("attention_prefill",
                               f"attention_prefill {mode} T={T} H={H} K={K} W={W} "
                               f"comp={'%d visible' % ncap if hca else '%d of %d' % (S, ncap)}",
                               launch, nbytes, flops=4 * H * K * keys))
    return cases
