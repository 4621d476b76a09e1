"""Sink attention over packed KV entries on the GPU (spec §4.9, §6.3).

    attention_decode  out[H, K] <- q[H, K] over the window entries j < n_window plus the
                      compressed entries sel[S] (CSA; -1 = none) or all j < n_comp_visible (HCA)
    attention_chunk   out[T, H, K] <- q[T, H, K] over keys_packed[M] where mask[T, M] is set

Every key is its own value (K = V) and is read in the packed KV format of kvpack.py (V4:
584 B = 448 FP8 codes + 64 bf16 rope dims + 7 ue8m0 scales). Per head, with the learned sink
z_h only in the denominator:  p = exp(s - m) / (exp(z_h - m) + Σ exp(s' - m)),  o = Σ p · k.
Counts and selections are device arrays, so a captured graph reads the current step's values.

Decode is flash-decoding: all H heads share each key, so a block decodes a tile of KC keys
once into shared memory and its warps (HPW heads each, q and the output held in registers,
each lane owning K/32 of the dims; K a multiple of 128) score and accumulate them with an
online softmax (the naive kernels take any K with K - R a multiple of 64); a thread's packed
words of the next tile load into registers while this one is scored (H100, CSA: split +
combine 27.7 -> 23.0 µs, -1.3% a step, 2026-12-06 (o)). Blocks
split the key slots (grid x) and own head groups (grid y); a second kernel merges the splits'
(max, sum, accumulator) partials with the sink. Letters: H heads, K head dim, R rope dims,
W window slots, S selected slots, N compressed entries, M keys, T tokens, P splits.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .. import ops
from . import device, kvpack
from .bench import BenchCase
from .device import cdiv
from .gemv import XLW, _as_int32, _bits_f32, _ld_x2, _limb_bytes, _limb_scales, _make_limbs
from .imma import _syncwarp
from .lowbit_layout import _f32_bits
from .norm_rope import rope, rope_element

HPW = 2  # heads per warp: a lane holds q and the accumulator of HPW heads x K/32 dims
DPL = 16  # dims per lane at most (K <= 512)
KC = 16  # keys per shared-memory tile; HPW·KC = 32 (score s[hh, kk] is summed onto lane hh·KC+kk)
HPWDPL = HPW * DPL  # (literals for cuda.local.array)
KC2 = 2 * KC
MAX_ITEMS = 16  # packed words a thread decodes a tile, at most, where the kernel prefetches
MAX_SPLITS = 64  # each split writes a whole H x K partial: more cost more than they gain
COMBINE_THREADS = MAX_COMBINE_THREADS = 128  # the combine's block: dims of one head
# the CUDA-core decode kernel's least KC-slot tiles a split (decode_splits). H200, graphs of 20
# (2026-12-02), CSA 128 + 512: 1 tile 30.1 µs, 2 tiles 28.7, 4 tiles 44.3, 8 tiles 78.7
SPLIT_TILES = 2
MMA_TILES = 3  # the tensor-core kernel's 16-slot tiles a split (attention_decode)
_ALIGN = None if device.SIMULATOR else 16  # 16-byte shared arrays: 128-bit loads (no sim support)
_SHF = 512 if device.SIMULATOR else 1  # the simulator's shuffle scratch (the spread combine's
# blocks: 64 x MAX_GROUPS threads)
_LIMB_BYTES = 3 * MAX_COMBINE_THREADS  # (a literal for cuda.shared.array)
assert HPW * KC == 32 and COMBINE_THREADS % 16 == 0


def _inline(fn):
    """A device helper inlined at Numba-IR level (plain device functions need a driver to
    compile, which CI lane B does not have)."""
    return cuda.jit(device=True, inline="always")(getattr(fn, "py_func", fn))


_bf16 = _inline(kvpack.bf16_decode)


@_inline
def _fp8_scaled(b, sexp):
    """e4m3fn byte ``b`` times 2**(sexp - 127) (the ue8m0 block scale), as one ldexp."""
    b = int(b)
    e = (b >> 3) & 15
    m = b & 7
    if e == 0:
        v = float32(math.ldexp(float32(m), int(sexp) - 136))  # (m/8)·2**-6, subnormal
    else:
        v = float32(math.ldexp(float32(8 + m), e + int(sexp) - 137))  # (1 + m/8)·2**(e-7)
    return -v if b & 128 else v


@_inline
def _kv_elem(packed, row, d, nope, R):
    """Dim d of packed KV entry ``row`` (uint8 rows): FP8 x block scale, or a bf16 rope dim."""
    if d < nope:
        return _fp8_scaled(packed[row, d], packed[row, nope + 2 * R + d // 64])
    o = nope + 2 * (d - nope)
    return float32(_bf16(packed[row, o], packed[row, o + 1]))


def rope_dim_of(K: int, entry_bytes: int) -> int:
    """The rope dims R of a packed entry of width ``entry_bytes`` for head dim K: the one R
    (K - R a multiple of 64) with kvpack.kv_entry_bytes(K, R) == entry_bytes (V4: 584 -> 64)."""
    for R in range(K % 64, K + 1, 64):
        if kvpack.kv_entry_bytes(K, R) == entry_bytes:
            return R
    raise ValueError(f"no KV entry layout of {entry_bytes} bytes for head dim {K}")


# ---- NumPy references (the spec) --------------------------------------------------------------
def _unpack(packed, rows, K, R):
    kv = np.empty((len(rows), K), np.float32)
    kvpack.unpack_kv_ref(kv, np.asarray(packed)[rows], R)
    return kv


def attention_decode_ref(out, q, window_packed, n_window, comp_packed, sel, n_comp_visible,
                         all_visible, sinks, scale) -> None:
    """out[H, K] <- q[H, K]; window_packed[W, bytes], comp_packed[Ncap, bytes] uint8 entries;
    n_window[1], sel[S] (-1 = none), n_comp_visible[1] int32; sinks[H]. CSA reads the rows in
    ``sel``, HCA (``all_visible``) every row < n_comp_visible: ops.sink_attention on them."""
    K = q.shape[1]
    R = rope_dim_of(K, window_packed.shape[1])
    sel = np.asarray(sel)
    comp = np.arange(int(n_comp_visible[0])) if all_visible else sel[sel >= 0]
    kv = np.concatenate([_unpack(window_packed, np.arange(int(n_window[0])), K, R),
                         _unpack(comp_packed, comp, K, R)]).astype(out.dtype)
    ops.sink_attention(out[None], q[None], kv, np.ones((1, len(kv)), bool), sinks, scale)


def attention_chunk_ref(out, q, keys_packed, mask, sinks, scale) -> None:
    """out[T, H, K] <- q[T, H, K], keys_packed[M, bytes] uint8, mask[T, M] uint8 (nonzero =
    query t attends key m), sinks[H]: ops.sink_attention on the unpacked keys."""
    K = q.shape[2]
    kv = _unpack(keys_packed, np.arange(len(keys_packed)), K, rope_dim_of(K, keys_packed.shape[1]))
    ops.sink_attention(out, q, kv.astype(out.dtype), np.asarray(mask) != 0, sinks, scale)


# ---- naive kernels: one thread per (token, head), keys decoded where they are used ------------
@_inline
def _attend(orow, qrow, packed, row, nope, R, scale, m, l):
    """Online-softmax step for one key: orow[K] (the running Σ p·k) and (max m, sum l)."""
    K = qrow.shape[0]
    s = float32(0.0)
    for d in range(K):
        s += qrow[d] * _kv_elem(packed, row, d, nope, R)
    s *= scale
    mn = max(m, s)
    alpha = float32(math.exp(m - mn))  # m = -inf (no key yet): 0
    e = float32(math.exp(s - mn))
    for d in range(K):
        orow[d] = orow[d] * alpha + e * _kv_elem(packed, row, d, nope, R)
    return mn, l * alpha + e


@_inline
def _finish(orow, m, l, sink):
    """orow /= the softmax denominator with the sink: exp(z - M) + l·exp(m - M)."""
    M = max(m, sink)
    a = float32(math.exp(m - M))
    inv = float32(1.0) / (l * a + float32(math.exp(sink - M)))
    for d in range(orow.shape[0]):
        orow[d] = orow[d] * a * inv


@device.kernel
def _attention_decode_naive(out, q, win, n_window, comp, sel, n_comp, all_visible, sinks,
                            scale, R):
    """out[H, K] as the running accumulator, one thread per head."""
    H, K = q.shape
    h = cuda.grid(1)
    if h >= H:
        return
    orow = out[h]
    for d in range(K):
        orow[d] = float32(0.0)
    m = float32(-math.inf)
    l = float32(0.0)
    for r in range(min(int(n_window[0]), win.shape[0])):
        m, l = _attend(orow, q[h], win, r, K - R, R, scale, m, l)
    ns = min(int(n_comp[0]), comp.shape[0]) if all_visible else sel.shape[0]
    for i in range(ns):
        j = i if all_visible else int(sel[i])
        if j >= 0 and j < comp.shape[0]:
            m, l = _attend(orow, q[h], comp, j, K - R, R, scale, m, l)
    _finish(orow, m, l, sinks[h])


@device.kernel
def _attention_chunk_naive(out, q, keys, mask, sinks, scale, R):
    """out[T, H, K] as the running accumulator, one thread per (token, head)."""
    T, H, K = q.shape
    for i in range(cuda.grid(1), T * H, cuda.gridsize(1)):
        t = i // H
        h = i - t * H
        orow = out[t, h]
        for d in range(K):
            orow[d] = float32(0.0)
        m = float32(-math.inf)
        l = float32(0.0)
        for r in range(keys.shape[0]):
            if mask[t, r] != 0:
                m, l = _attend(orow, q[t, h], keys, r, K - R, R, scale, m, l)
        _finish(orow, m, l, sinks[h])


# ---- decode: split-K over shared-memory key tiles ---------------------------------------------
if device.SIMULATOR:
    @_inline
    def _lane_sums(v, lane, scratch):
        """Lane l <- Σ over the warp's lanes of v[l] (v: 32 values per lane). Simulator (no
        shuffles): a [32][33] shared-memory transpose; every thread of the block calls it."""
        for i in range(32):
            scratch[i * 33 + lane] = v[i]
        cuda.syncthreads()
        s = float32(0.0)
        for x in range(32):
            s += scratch[lane * 33 + x]
        cuda.syncthreads()
        return s
else:
    @_inline
    def _half_swap(v, lane, off):
        """Butterfly step: keep the half of v[0:2·off] that this lane's bit ``off`` selects,
        plus the partner lane's copy of that half."""
        up = (lane & off) != 0
        for i in range(off):
            send = v[i] if up else v[i + off]
            keep = v[i + off] if up else v[i]
            v[i] = keep + cuda.shfl_xor_sync(0xFFFFFFFF, send, off)

    @_inline
    def _lane_sums(v, lane, scratch):
        """Lane l <- Σ over the warp's lanes of v[l]: a reduce-scatter butterfly, 31 shuffles
        for all 32 sums (separate warp reductions would take 160)."""
        _half_swap(v, lane, 16)
        _half_swap(v, lane, 8)
        _half_swap(v, lane, 4)
        _half_swap(v, lane, 2)
        _half_swap(v, lane, 1)
        return v[0]


@_inline
def _dim(i, lane):
    """The head dim of a lane's i-th value: 4 consecutive dims in every 128, so one 128-bit
    shared load per lane covers 512 contiguous bytes across the warp (4 wavefronts, no bank
    conflict; a contiguous K/32 run per lane would put 16 lanes on the same 4 banks)."""
    return (i >> 2) * 128 + lane * 4 + (i & 3)


@_inline
def _fetch(win, comp, kcode, it, KW, NOPE, R, NK):
    """(packed word, word holding its FP8 block's scale) of decode item ``it`` of a tile of NK
    keys: word it % KW of the tile's key it // KW. Branch-free (clamped to a valid row and
    item), so several fetches issue back to back; _put skips the clamped ones."""
    itc = min(it, NK * KW - 1)
    kk = itc // KW
    wd = itc - kk * KW
    code = max(kcode[kk], 0)
    src = comp if code & 1 else win
    sb = NOPE + 2 * R + min(wd, NOPE // 4 - 1) // 16  # scale byte of dims 4wd.. (64 a block)
    return int(src[code >> 1, wd]), int(src[code >> 1, sb // 4]) >> (8 * (sb % 4))


@_inline
def _put(smem, smem_u, kcode, it, word, sword, K, KW, NOPE, NK):
    """Decode item ``it`` (see _fetch) into the tile ks[kk][K] of NK keys in shared memory."""
    if it >= NK * KW:
        return
    kk = it // KW
    wd = it - kk * KW
    nfp8 = NOPE // 4
    o = kk * K + (4 * wd if wd < nfp8 else NOPE + 2 * (wd - nfp8))
    _store_word(smem, smem_u, o, wd < nfp8, kcode[kk] < 0, word, sword)


@_inline
def _e4m3_scaled(b, c):
    """e4m3 byte b times the block scale: e4m3 = mant · 2**-10 with mant = (8 + m) << e (e > 0)
    or 2m (subnormal), exact in float32, then one multiply by c = 2**(s - 137) (the scale
    2**(s - 127) with the 2**-10 folded in)."""
    ex = (b >> 3) & 15
    mant = ((8 + (b & 7)) << ex) if ex > 0 else ((b & 7) << 1)
    val = float32(mant) * c
    return -val if b & 128 else val


@_inline
def _store_word(smem, smem_u, o, fp8, empty, word, sword):
    """A packed word into the tile at float offset o: 4 FP8 codes (``fp8``; scale byte: the
    low byte of ``sword``) or 2 bf16 dims, or zeros where the slot is ``empty``."""
    # uint64 offsets: the 4 (or 2) stores below merge into one 128-bit (64-bit) shared store
    o = uint64(o)
    if empty:  # no key in this slot: zeros (the score is masked to -inf anyway)
        smem_u[o] = 0
        smem_u[o + uint64(1)] = 0
        if fp8:
            smem_u[o + uint64(2)] = 0
            smem_u[o + uint64(3)] = 0
    elif fp8:
        c = float32(math.ldexp(float32(1.0), (sword & 255) - 137))
        for e in range(4):
            smem[o + uint64(e)] = _e4m3_scaled((word >> (8 * e)) & 255, c)
    else:  # bf16 -> float32 is the bf16 bits in the high half: move the bits
        smem_u[o] = (word & 0xFFFF) << 16
        smem_u[o + uint64(1)] = word & 0xFFFF0000


@_inline
def _store_word_bf16(smem_u, o, fp8, empty, word, sword):
    """_store_word into a tile of bf16 elements two a word (element o: o even): the FP8 codes'
    values as _store_word makes them, each exact in bf16 (4 significant bits times a power of
    two, above float32's subnormals: block scales above 2**-100), the bf16 dims as they
    are."""
    o = uint64(o) >> uint64(1)
    if empty:
        smem_u[o] = 0
        if fp8:
            smem_u[o + uint64(1)] = 0
    elif fp8:
        c = float32(math.ldexp(float32(1.0), (sword & 255) - 137))
        for e2 in range(2):
            lo = _f32_bits(_e4m3_scaled((word >> (16 * e2)) & 255, c))
            hi = _f32_bits(_e4m3_scaled((word >> (16 * e2 + 8)) & 255, c))
            smem_u[o + uint64(e2)] = (lo >> uint32(16)) | (hi & uint32(0xFFFF0000))
    else:
        smem_u[o] = word


@_inline
def _init_heads(qr, acc, mr, lr, qrows, h0, lane, scale, ND):
    """This warp's heads h0 .. h0+HPW-1: its lane's dims of q (scaled) in qr, accumulators
    zero, running max -inf, running sum 0 (qrows [H, K]: one token's queries)."""
    H = qrows.shape[0]
    zero = float32(0.0)
    for hh in range(HPW):
        h = h0 + hh
        mr[hh] = -math.inf
        lr[hh] = zero
        for i in range(DPL):
            ok = h < H and i < ND
            qr[hh * DPL + i] = qrows[h, _dim(i, lane)] * scale if ok else zero
            acc[hh * DPL + i] = zero


@_inline
def _tile_softmax(smem, kcode, qr, kv, v, acc, mr, lr, lane, wid, K, ND, SC, XS):
    """A decoded tile of KC keys (shared memory, codes kcode; -1 = no key) into this warp's
    heads: scores, then the online softmax (rescale acc / lr by the new running max mr, add
    p·key). Block-uniform, and ends on a block barrier: the caller decodes the next tile."""
    live = 0
    for kk in range(KC):
        live += 1 if kcode[kk] >= 0 else 0
    if live == 0:  # block-uniform: nothing valid in this tile (e.g. CSA holes)
        cuda.syncthreads()
        return
    kb = uint64(lane * 4)
    _scores4(smem, kb, qr, kv, v, 0, K, ND)  # four calls: v's indices stay literal
    _scores4(smem, kb, qr, kv, v, 4, K, ND)
    _scores4(smem, kb, qr, kv, v, 8, K, ND)
    _scores4(smem, kb, qr, kv, v, 12, K, ND)
    s = _lane_sums(v, lane, smem[XS + wid * 32 * 33:])
    smem[SC + wid * 32 + lane] = s if kcode[lane % KC] >= 0 else -math.inf
    cuda.syncthreads()
    for hh in range(HPW):  # online softmax: rescale by the new running max
        mt = mr[hh]
        for kk in range(KC):
            mt = max(mt, smem[SC + wid * 32 + hh * KC + kk])
        alpha = float32(math.exp(mr[hh] - mt))  # first live tile: exp(-inf) = 0
        for i in range(DPL):
            acc[hh * DPL + i] *= alpha
        lr[hh] *= alpha
        mr[hh] = mt
    for kk in range(KC):
        kb = uint64(kk * K + lane * 4)
        for i in range(DPL):
            kv[i] = smem[kb + uint64(_dim(i, 0))] if i < ND else float32(0.0)
        for hh in range(HPW):
            pv = float32(math.exp(smem[SC + wid * 32 + hh * KC + kk] - mr[hh]))
            lr[hh] += pv
            for i in range(DPL):
                acc[hh * DPL + i] += pv * kv[i]
    cuda.syncthreads()


@_inline
def _scores4(smem, kb, qr, kv, v, k0, K, ND):
    """v[hh·KC + kk] = this lane's part of q_hh · key kk, for kk = k0 .. k0+3 (its ND dims)."""
    for u in range(4):
        b = kb + uint64((k0 + u) * K)
        for i in range(DPL):
            kv[i] = smem[b + uint64(_dim(i, 0))] if i < ND else float32(0.0)
        for hh in range(HPW):
            s = float32(0.0)
            for i in range(DPL):
                s += qr[hh * DPL + i] * kv[i]
            v[hh * KC + k0 + u] = s


@_inline
def _slot_code(m, s1, W, nwin, all_visible, sel, ncap):
    """The code of key slot m of a split ending at s1: 2·row for window row m, 2·row + 1 for
    the compressed row it names (sel[m - W], or m - W where all are visible), -1 for none."""
    code = -1
    if m < s1:
        if m < W:
            code = 2 * m if m < nwin else -1
        elif all_visible:
            code = 2 * (m - W) + 1
        else:
            j = int(sel[m - W])
            code = 2 * j + 1 if j >= 0 and j < ncap else -1
    return code


@_inline
def _split_slots(W, ncap, sel, n_comp, all_visible, P, tile):
    """(s0, s1): the key slots of split blockIdx.x of P, whole tiles of ``tile`` slots each
    (slots past the visible ones, HCA's n_comp, are cut)."""
    slots = ncap if all_visible else sel.shape[0]
    per = ((W + slots + P - 1) // P + tile - 1) // tile * tile
    s0 = cuda.blockIdx.x * per
    return s0, min(s0 + per, W + (min(int(n_comp[0]), ncap) if all_visible else slots))


_SPLITS: dict = {}


def _split_kernel(K: int, R: int, NT: int, prefetch: bool = True, staged: bool = True):
    """The split kernel compiled for head dim K, R rope dims and NT threads a block (closure
    constants: literal shared-memory offsets, unrolled lane loops, 128-bit shared loads).

    ``prefetch``: a thread's packed words of the next tile (MAX_ITEMS at most) load into
    registers while this tile is scored, and a tile's words all load at once; without it a
    tile's words load after the previous tile is scored, four a thread at a time.

    ``staged``: the partials leave through the tile's shared memory (free after the last
    tile), a warp's rows in runs of consecutive words: a lane's values sit 4 words in every
    128 (_dim), so storing them straight takes 4x the sectors (the stores waited on the LSU
    queue, Nsight, H100, 2026-12-06 (q)). Needs the block's heads to fit the tile's KC rows."""
    NI = cdiv(KC * (K - R) // 4 + KC * R // 2, NT)  # the words a thread decodes a tile
    PREFETCH = prefetch and NI <= MAX_ITEMS
    STAGED = staged and NT // 32 * HPW <= KC
    key = (K, R, NT, PREFETCH, STAGED)
    if key in _SPLITS:
        return _SPLITS[key]
    if K % 128 or K > 32 * DPL or (K - R) % 64 or R % 2 or NT % 32:
        raise ValueError(f"attention_decode: no layout for K={K}, R={R}, threads={NT}")
    ND = K // 32  # dims per lane: see _dim
    NOPE = K - R
    NFP8 = NOPE // 4  # words of FP8 codes, then R/2 words of bf16 pairs, then the scales
    KW = NFP8 + R // 2
    NWARP = NT // 32
    SC = KC * K  # per warp: its 32 scores s[hh·KC + kk]
    XS = SC + NWARP * 32  # (simulator only) per warp: the [32][33] transpose scratch

    @device.kernel
    def _attention_decode_split_tiles(part, q, win, n_window, comp, sel, n_comp, all_visible,
                                      scale):
        """part[P, H, K+2] <- (Σ p·k, max, sum) of split blockIdx.x for head group blockIdx.y.

        win[W, words], comp[Ncap, words]: the packed entries as uint32 words. Key slot m < W
        is window row m (valid below n_window); slot W+i is comp row sel[i] (CSA) or i (HCA).
        Warp w owns heads h0 .. h0+HPW-1, lane l their dims _dim(i, l). Per tile of KC slots:
        decode into shared memory; scores (lane partials over its dims, summed across lanes by
        _lane_sums); online softmax.
        """
        smem = cuda.shared.array(0, float32, alignment=_ALIGN)
        smem_u = cuda.shared.array(0, uint32, alignment=_ALIGN)  # same bytes: bf16 bit moves
        # 2·row (window), 2·row + 1 (compressed), -1: a tile's slots (two tiles' with PREFETCH)
        kcode = cuda.shared.array(KC2, int32)
        H = q.shape[0]
        W = win.shape[0]
        ncap = comp.shape[0]
        P = part.shape[0]
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
        wb = cuda.local.array(MAX_ITEMS, uint32)  # PREFETCH: the next tile's words, and
        sb = cuda.local.array(MAX_ITEMS, uint32)  # the words of their FP8 scales
        nwin = min(int(n_window[0]), W)
        s0, s1 = _split_slots(W, ncap, sel, n_comp, all_visible, P, KC)
        if PREFETCH:  # the slots' codes, then q, then the first tile's words: all in flight
            if tid < KC:
                kcode[tid] = _slot_code(s0 + tid, s1, W, nwin, all_visible, sel, ncap)
            _init_heads(qr, acc, mr, lr, q, h0, lane, scale, ND)
            cuda.syncthreads()
            for j in range(NI):
                wb[j], sb[j] = _fetch(win, comp, kcode, tid + j * NT, KW, NOPE, R, KC)
            cur = 0
            for t0 in range(s0, s1, KC):
                cw = kcode[cur * KC:]
                for j in range(NI):
                    _put(smem, smem_u, cw, tid + j * NT, int(wb[j]), int(sb[j]), K, KW, NOPE,
                         KC)
                nw = kcode[(1 - cur) * KC:]
                if tid < KC:
                    nw[tid] = _slot_code(t0 + KC + tid, s1, W, nwin, all_visible, sel, ncap)
                cuda.syncthreads()
                if t0 + KC < s1:  # the next tile's words load while this one is scored
                    for j in range(NI):
                        wb[j], sb[j] = _fetch(win, comp, nw, tid + j * NT, KW, NOPE, R, KC)
                _tile_softmax(smem, cw, qr, kv, v, acc, mr, lr, lane, wid, K, ND, SC, XS)
                cur = 1 - cur
        else:
            _init_heads(qr, acc, mr, lr, q, h0, lane, scale, ND)
            for t0 in range(s0, s1, KC):
                if tid < KC:
                    kcode[tid] = _slot_code(t0 + tid, s1, W, nwin, all_visible, sel, ncap)
                cuda.syncthreads()
                # decode the tile, one packed word (4 FP8 codes or 2 bf16 dims) per item; each
                # thread fetches four items before decoding any (four L2 round trips overlap)
                for it in range(tid, KC * KW, 4 * NT):
                    w0, x0 = _fetch(win, comp, kcode, it, KW, NOPE, R, KC)
                    w1, x1 = _fetch(win, comp, kcode, it + NT, KW, NOPE, R, KC)
                    w2, x2 = _fetch(win, comp, kcode, it + 2 * NT, KW, NOPE, R, KC)
                    w3, x3 = _fetch(win, comp, kcode, it + 3 * NT, KW, NOPE, R, KC)
                    _put(smem, smem_u, kcode, it, w0, x0, K, KW, NOPE, KC)
                    _put(smem, smem_u, kcode, it + NT, w1, x1, K, KW, NOPE, KC)
                    _put(smem, smem_u, kcode, it + 2 * NT, w2, x2, K, KW, NOPE, KC)
                    _put(smem, smem_u, kcode, it + 3 * NT, w3, x3, K, KW, NOPE, KC)
                cuda.syncthreads()
                _tile_softmax(smem, kcode, qr, kv, v, acc, mr, lr, lane, wid, K, ND, SC, XS)
        b = cuda.blockIdx.x
        if STAGED:  # (the last tile ended on a barrier: no warp reads the tile any more)
            for hh in range(HPW):
                row = (wid * HPW + hh) * K
                for i in range(ND):
                    smem[row + _dim(i, lane)] = acc[hh * DPL + i]
            cuda.syncthreads()
        for hh in range(HPW):
            h = h0 + hh
            if h < H:
                if STAGED:
                    row = (wid * HPW + hh) * K
                    for j in range(ND):
                        part[b, h, lane + 32 * j] = smem[row + lane + 32 * j]
                else:
                    for i in range(ND):
                        part[b, h, _dim(i, lane)] = acc[hh * DPL + i]
                if lane == 0:
                    part[b, h, K] = mr[hh]
                    part[b, h, K + 1] = lr[hh]

    smem_bytes = 4 * (XS + (NWARP * 32 * 33 if device.SIMULATOR else 0))
    _SPLITS[key] = (_attention_decode_split_tiles, smem_bytes)
    return _SPLITS[key]


# ---- decode: one head a warp, 32-key tiles (the engine's CSA / window-only kernel) -------------
KH = 32  # the head-warp kernel's keys a tile: after the lane sums, lane l holds key l's score
KH2 = 2 * KH
HEAD_WARP_REGS = 128  # its registers: a block of 512 threads an SM (ptxas: 12 bytes spilled)
MAX_HEAD_ITEMS = 144  # its packed words a thread decodes a tile, at most (KW / TPK; V4 at
# 512 threads: 9 in registers)
_HEAD_WARPS: dict = {}


@_inline
def _group_dim(i, lane, DG):
    """The head dim of a lane's i-th value with DG consecutive dims a lane in every 32·DG
    (DG = 4: _dim; DG = 8: a bf16 tile's 16 bytes a lane, one 128-bit load)."""
    return (i // DG) * (32 * DG) + lane * DG + i % DG


@_inline
def _tile_dims(smem, smem_u, b, kv, ND, BF, DG):
    """kv[i] <- dim _group_dim(i, lane, DG) of the tile's key whose lane-0 dims start at
    element b (b: the key's first element + lane·DG), zero past ND: float32 elements, or
    (BF) bf16 elements two a word, widened by moving their bits."""
    if BF:
        bw = b >> uint64(1)
        for g in range(DPL // DG):
            for u in range(DG // 2):
                w = smem_u[bw + uint64(g * 16 * DG + u)] if g * DG < ND else uint32(0)
                kv[g * DG + 2 * u] = _bits_f32(w << uint32(16))
                kv[g * DG + 2 * u + 1] = _bits_f32(w & uint32(0xFFFF0000))
    else:
        for i in range(DPL):
            kv[i] = smem[b + uint64(_group_dim(i, 0, DG))] if i < ND else float32(0.0)


@_inline
def _head_scores8(smem, smem_u, kb, qr, kv, v, k0, K, ND, BF, DG):
    """v[k0 + u] = this lane's part of q · key k0 + u for u = 0 .. 7 (its ND dims)."""
    for u in range(8):
        _tile_dims(smem, smem_u, kb + uint64((k0 + u) * K), kv, ND, BF, DG)
        s = float32(0.0)
        for i in range(DPL):
            s += qr[i] * kv[i]
        v[k0 + u] = s


@_inline
def _head_tile(smem, smem_u, kcode, nk, qr, kv, v, acc, m, l, lane, wid, red, K, ND, PS, XS,
               BF, DG):
    """A decoded tile of KH keys into this warp's one head: the lane sums leave key l's score
    on lane l, so the tile's max and sum are two warp reductions and each lane takes one exp
    (p of its key, through shared memory to every lane for P·V). -> (m, l) after the tile.
    Called by every thread of the block with a live tile (a key in it)."""
    kb = uint64(lane * DG)
    _head_scores8(smem, smem_u, kb, qr, kv, v, 0, K, ND, BF, DG)  # four calls: v's indices
    _head_scores8(smem, smem_u, kb, qr, kv, v, 8, K, ND, BF, DG)  # stay literal
    _head_scores8(smem, smem_u, kb, qr, kv, v, 16, K, ND, BF, DG)
    _head_scores8(smem, smem_u, kb, qr, kv, v, 24, K, ND, BF, DG)
    s = _lane_sums(v, lane, smem[XS + wid * 32 * 33:])
    s = s if kcode[lane] >= 0 else float32(-math.inf)
    mt = max(m, device.warp_max(s, red))  # finite: the tile has a key
    alpha = float32(math.exp(m - mt))  # first live tile: exp(-inf) = 0
    p = float32(math.exp(s - mt))
    l = l * alpha + device.warp_sum(p, red)
    for i in range(DPL):
        acc[i] *= alpha
    smem[PS + wid * 32 + lane] = p
    _syncwarp()
    pb = uint64(PS + wid * 32)  # (unsigned offsets: no negative-index wraparound code)
    # a loop of 2 keys a turn, not unrolled: 32 keys' loads hoisted would spill (an odd nk
    # reads one key past the split: zeros, weight 0)
    for k2 in range(0, nk, 2):
        for u in range(2):
            kk = uint64(k2 + u)
            pk = smem[pb + kk]
            _tile_dims(smem, smem_u, kk * uint64(K) + kb, kv, ND, BF, DG)
            for i in range(DPL):
                acc[i] += pk * kv[i]
    return mt, l



@_inline
def _fetch_key(wb, sb, win, comp, code, w0, TPK, NI, NF, SB):
    """wb[j] <- word w0 + TPK·j of the entry that ``code`` names (2·row window, 2·row + 1
    compressed; < 0: window row 0, stored as zeros), sb[j] <- its FP8 block's scale byte
    (j < NF; SB: the first scale's byte). All at once: NI + NF loads in flight."""
    c = max(code, 0)
    src = comp if c & 1 else win
    row = c >> 1
    for j in range(NI):
        wb[j] = src[row, w0 + TPK * j]
    for j in range(NF):
        b = SB + TPK * j // 16  # (w0 < TPK, a divisor of 16: its word's block)
        sb[j] = src[row, b // 4] >> (8 * (b % 4))


def _head_warp_kernel(K: int, R: int, NT: int, BF16: bool = False):
    """(kernel, dynamic shared bytes): the split kernel with one head a warp and KH-key tiles,
    NT threads a block (NT / 32 heads). The split kernel's warp holds two heads over 16-key
    tiles and runs ~7,600 instructions in a row at ~4 cycles each whatever the keys (Nsight,
    H100, 2026-12-07 (x)): here a warp's chain for CSA's 32-slot split is one tile of half
    the heads, with one exp a lane instead of one a key and head, and twice the warps an SM
    hide each other's latency. The tile's words are loaded a tile ahead (registers), as the
    split kernel's prefetch; the partials leave through the tile's shared memory.

    BF16: the decoded tile held as bf16 (every value of it is exact there): each of the
    block's NT / 32 heads reads the whole tile from shared memory twice (scores, P·V), 2 MB a
    block of 16 heads over CSA's 32-key split in float32, which at 128 bytes a cycle is ~8 µs
    of the launch; half that in bf16, for a shift or mask a value."""
    key = (K, R, NT, BF16)
    if key in _HEAD_WARPS:
        return _HEAD_WARPS[key]
    if K % 128 or K > 32 * DPL or (K - R) % 64 or R % 32 or NT not in (32, 64, 128, 256, 512):
        raise ValueError(f"attention_decode: no head-warp layout for K={K}, R={R}, threads={NT}")
    ND = K // 32  # dims per lane: see _group_dim
    DG = 8 if BF16 and K % 256 == 0 else 4  # a lane's consecutive dims (128-bit loads)
    NOPE = K - R
    NFP8 = NOPE // 4  # words of FP8 codes, then R/2 words of bf16 pairs, then the scales
    KW = NFP8 + R // 2
    # the tile's words: TPK threads a key (a divisor of 16), thread t word t % TPK + TPK·j of
    # key t // TPK, FP8 for j < NF: every index but the row's is a constant of j, so nothing
    # per item stays live in registers across the tile's math (the split kernel's items,
    # spread over keys, made ptxas keep each one's offsets and spill at 128 registers)
    TPK = NT // KH
    NI = KW // TPK
    NF = NFP8 // TPK
    SB = NOPE + 2 * R  # the byte of the first FP8 block's scale (64 dims a block)
    NWARP = NT // 32
    PS = KH * K  # per warp: its tile's 32 probabilities
    XS = PS + NWARP * 32  # (simulator only) per warp: the [32][33] transpose of _lane_sums
    RED = NT if device.SIMULATOR else 1  # (the simulator's warp reductions)

    @device.kernel(max_registers=HEAD_WARP_REGS)
    def _attention_decode_head_warps(part, q, win, n_window, comp, sel, n_comp, all_visible,
                                     scale):
        """part[P, H, K+2] <- (Σ p·k, max, sum) of split blockIdx.x for heads blockIdx.y ·
        NWARP + warp: as _attention_decode_split_tiles, a warp one head and lane l its dims
        _dim(i, l), the tiles KH key slots."""
        smem = cuda.shared.array(0, float32, alignment=_ALIGN)
        smem_u = cuda.shared.array(0, uint32, alignment=_ALIGN)  # same bytes: bf16 bit moves
        kcode = cuda.shared.array(KH2, int32)  # this tile's slot codes and the next one's
        red = cuda.shared.array(RED, float32)
        H = q.shape[0]
        W = win.shape[0]
        ncap = comp.shape[0]
        P = part.shape[0]
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        h = cuda.blockIdx.y * NWARP + wid
        qr = cuda.local.array(DPL, float32)
        acc = cuda.local.array(DPL, float32)
        kv = cuda.local.array(DPL, float32)
        v = cuda.local.array(32, float32)
        wb = cuda.local.array(MAX_HEAD_ITEMS, uint32)  # a tile's words, loaded a tile ahead,
        sb = cuda.local.array(MAX_HEAD_ITEMS, uint32)  # and their FP8 scales (low byte)
        kk = tid // TPK  # this thread's key of a tile, and its first word
        w0 = tid - kk * TPK
        nwin = min(int(n_window[0]), W)
        s0, s1 = _split_slots(W, ncap, sel, n_comp, all_visible, P, KH)
        if tid < KH:
            kcode[tid] = _slot_code(s0 + tid, s1, W, nwin, all_visible, sel, ncap)
        for i in range(DPL):
            ok = h < H and i < ND
            qr[i] = q[h, _group_dim(i, lane, DG)] * scale if ok else float32(0.0)
            acc[i] = float32(0.0)
        m = float32(-math.inf)
        l = float32(0.0)
        cuda.syncthreads()
        _fetch_key(wb, sb, win, comp, kcode[kk], w0, TPK, NI, NF, SB)
        cur = 0
        for t0 in range(s0, s1, KH):
            cw = kcode[cur * KH:]
            empty = cw[kk] < 0
            for j in range(NI):
                o = kk * K + (4 * (w0 + TPK * j) if j < NF else NOPE + 2 * (w0 + TPK * (j - NF)))
                if BF16:
                    _store_word_bf16(smem_u, o, j < NF, empty, int(wb[j]), int(sb[j]))
                else:
                    _store_word(smem, smem_u, o, j < NF, empty, int(wb[j]), int(sb[j]))
            nw = kcode[(1 - cur) * KH:]
            if tid < KH:
                nw[tid] = _slot_code(t0 + KH + tid, s1, W, nwin, all_visible, sel, ncap)
            # the barrier after the tile's stores, and whether it has a key (block-uniform)
            live = cuda.syncthreads_or(1 if tid < KH and cw[tid] >= 0 else 0)
            if t0 + KH < s1:  # the next tile's words load while this one is scored
                _fetch_key(wb, sb, win, comp, nw[kk], w0, TPK, NI, NF, SB)
            if live:
                m, l = _head_tile(smem, smem_u, cw, min(KH, s1 - t0), qr, kv, v, acc, m, l,
                                  lane, wid, red, K, ND, PS, XS, BF16, DG)
            cuda.syncthreads()  # the tile is read: the next one may overwrite it
            cur = 1 - cur
        b = cuda.blockIdx.x
        row = wid * K  # (NWARP <= KH rows: the tile's shared memory holds the block's heads)
        for i in range(ND):
            smem[row + _group_dim(i, lane, DG)] = acc[i]
        cuda.syncthreads()
        if h < H:
            for j in range(ND):
                part[b, h, lane + 32 * j] = smem[row + lane + 32 * j]
            if lane == 0:
                part[b, h, K] = m
                part[b, h, K + 1] = l

    smem_bytes = 4 * (XS + (NWARP * 32 * 33 if device.SIMULATOR else 0))
    _HEAD_WARPS[key] = (_attention_decode_head_warps, smem_bytes)
    return _HEAD_WARPS[key]


@_inline
def _split_weights(wts, part, sinks, h, K):
    """wts[p] <- w_p = exp(m_p - M) / den for the P splits of head h (shared memory, MAX_SPLITS),
    M = max(max_p m_p, z_h), den = Σ_p exp(m_p - M) l_p + exp(z_h - M); ends at a barrier.
    Every warp reads split p's (m_p, l_p) on lane p % 32 (P <= 64: two a lane) and takes M
    and the denominator by shuffles; warp 0 keeps the weights. Two exps a thread, where taking
    every split's exp in every thread cost 2P + 1 (41 at P = 20) in a row. Every thread of
    the block must call it."""
    P = part.shape[0]
    t = cuda.threadIdx.x
    lane = t & 31
    red = cuda.shared.array(_SHF, float32)  # (the simulator's warp sums)
    ninf = float32(-math.inf)
    m0 = part[lane, h, K] if lane < P else ninf
    m1 = part[lane + 32, h, K] if lane + 32 < P else ninf
    l0 = part[lane, h, K + 1] if lane < P else float32(0.0)
    l1 = part[lane + 32, h, K + 1] if lane + 32 < P else float32(0.0)
    M = device.warp_max(max(max(m0, m1), sinks[h]), red)
    e0 = float32(math.exp(m0 - M))  # an empty split (m = -inf): weight 0
    e1 = float32(math.exp(m1 - M))
    den = device.warp_sum(e0 * l0 + e1 * l1, red) + float32(math.exp(sinks[h] - M))
    if t < 32:
        inv = float32(1.0) / den
        if lane < P:
            wts[lane] = e0 * inv
        if lane + 32 < P:
            wts[lane + 32] = e1 * inv
    cuda.syncthreads()


@_inline
def _combined(out, part, sinks, pos, freqs):
    """The combine of this thread's dim (below): writes out[h, d] and returns it (0 past
    K). Every thread of the block must call it."""
    P = part.shape[0]
    H, K = out.shape
    h = cuda.blockIdx.y
    t = cuda.threadIdx.x
    wts = cuda.shared.array(MAX_SPLITS, float32)  # w_p = exp(m_p - M) / den
    _split_weights(wts, part, sinks, h, K)
    d = cuda.blockIdx.x * cuda.blockDim.x + t
    o = float32(0.0)
    if d < K:
        # 16 accumulator loads in flight, not one L2 trip a split (all P loaded with the
        # (max, sum) pairs, one wait fewer: nil a step, H100, 2026-12-06 (o))
        for p0 in range(0, P, 16):
            for u in range(16):
                p = min(p0 + u, P - 1)
                o += part[p, h, d] * (wts[p] if p0 + u < P else float32(0.0))
    nope = K - 2 * freqs.shape[0]
    if freqs.shape[0] > 0 and cuda.blockIdx.x * cuda.blockDim.x + cuda.blockDim.x > nope:
        mine = cuda.shared.array(MAX_COMBINE_THREADS, float32)  # (uniform branch per block)
        mine[t] = o if d < K else float32(0.0)
        cuda.syncthreads()
        if nope <= d < K:
            even = (d - nope) % 2 == 0
            o = rope_element(o, mine[t + 1] if even else mine[t - 1], pos[0],
                             freqs[(d - nope) // 2], even, True)
    if d < K:
        out[h, d] = o
    return o


@device.kernel
def _attention_combine(out, part, sinks, pos, freqs):
    """out[H, K] <- the P split partials of head blockIdx.y, dims blockIdx.x·blockDim.x + t,
    merged with the sink in the denominator. Each warp reads the P (max, sum) pairs, a split a
    lane, and reduces them by shuffles; warp 0 leaves the P weights exp(m_p - M) / den in
    shared memory, so a thread takes two exps (it took 2P + 1) and then only loads and FMAs,
    16 accumulator loads at a time. With freqs [R/2] not empty, the last R dims
    are then rotated back by the inverse RoPE at pos[0] (§4.9) with norm_rope.rope's float32
    cos/sin of a float64 angle: the pair partner is the neighbouring thread (R and K - R even,
    blocks a multiple of 2 wide), through shared memory."""
    _combined(out, part, sinks, pos, freqs)


@_inline
def _put_limbs(xl, o, d, K):
    """out's limbs (see _attention_combine_limbs) from thread t's element o = out[h, d]
    (h = blockIdx.y; the threads past MAX_COMBINE_THREADS hold none: d = K). Every thread of
    the block must call it."""
    h = cuda.blockIdx.y
    t = cuda.threadIdx.x
    xch = cuda.shared.array(_SHF, float32)  # (the simulator's shuffles)
    qb = cuda.shared.array(_LIMB_BYTES, int32)  # the limbs' bytes, by thread
    amax = abs(o) if d < K else float32(0.0)
    for off in (1, 2, 4, 8):
        amax = max(amax, device.xor_shfl(amax, off, xch))
    s1, s2, s3, i1, i2, i3 = _limb_scales(amax)
    if t < MAX_COMBINE_THREADS:
        qb[t], qb[MAX_COMBINE_THREADS + t], qb[2 * MAX_COMBINE_THREADS + t] = _limb_bytes(
            o, s1, s2, s3, i1, i2, i3)
    cuda.syncthreads()
    if d < K and d % 4 == 0:
        f = h * K + d  # out's flat index: row, 16-column chunk c, word m of the chunk
        rw = xl.shape[1] // XLW * 16
        row = f // rw
        c = (f - row * rw) // 16
        m = (f - row * rw) % 16 // 4
        for li in range(3):
            b = li * MAX_COMBINE_THREADS + t
            a = qb[b] + (qb[b + 1] << 8) + (qb[b + 2] << 16) + (qb[b + 3] << 24)
            xl[row, XLW * c + 4 * li + m] = _as_int32(a)
        xl[row, XLW * c + 12 + m] = np.int64(_f32_bits(s1)) if m == 0 else np.int64(0)


@device.kernel
def _attention_combine_limbs(out, xl, part, sinks, pos, freqs):
    """_attention_combine, and then the int8 limbs of out that attn_output_a's dp4a GEMV reads
    (gemv.py's words: XLW a 16-column chunk of out viewed as rows of xl.shape[1] / XLW · 16
    values), made here instead of by a launch of their own on the step's critical path. A chunk
    is 16 neighbouring threads (K and the block a multiple of 16): its max by 4 xor shuffles,
    each thread its element's 3 roundings (gemv._limb_bytes, as _q8_0_x_limbs_words makes them:
    the same words), and one thread in four packs four elements' bytes through shared memory."""
    o = _combined(out, part, sinks, pos, freqs)
    _put_limbs(xl, o, cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, out.shape[1])


SPREAD_DIMS = 128  # the spread combine's dims a block: 64 pairs, a pair a thread of a group
MAX_GROUPS = 8  # its split groups at most (64 x 8 = 512 threads)
_SPREAD_SUMS = MAX_GROUPS * SPREAD_DIMS  # (a literal for cuda.shared.array)
_SPREAD: dict = {}  # (groups, limbs) -> the spread combine kernel
_NO_LIMBS: list = []  # the spread combine's xl where it makes no limbs (allocated once)


def _spread_combine(G: int, limbs: bool):
    """The combine with the splits spread over G groups of a block's threads (G a divisor of
    MAX_SPLITS, at most MAX_GROUPS; 64·G threads, SPREAD_DIMS dims a block): thread t of group
    g = t // 64 loads dims (2c, 2c + 1), c = t % 64, of splits g, g + G, ... (at most
    MAX_SPLITS / G, one 8-byte load each, all issued at once, before the weights are known),
    the groups' sums meet in shared memory (added in group order), and the block's first
    SPREAD_DIMS threads finish as _attention_combine (the inverse RoPE; with ``limbs`` out's
    limbs as _attention_combine_limbs). The 128-thread combine keeps a thread's P loads in
    batches of 16 a thread, each a round trip after the last, and 8 warps an SM. Arguments:
    (out, xl, part, sinks, pos, freqs); xl is ignored without ``limbs``."""
    if (G, limbs) in _SPREAD:
        return _SPREAD[G, limbs]
    assert MAX_SPLITS % G == 0 and G <= MAX_GROUPS and SPREAD_DIMS == MAX_COMBINE_THREADS
    J = MAX_SPLITS // G  # splits a thread, at most
    J2 = 2 * J
    LIMBS = limbs

    @device.kernel
    def _attention_combine_spread(out, xl, part, sinks, pos, freqs):
        P = part.shape[0]
        H, K = out.shape
        h = cuda.blockIdx.y
        t = cuda.threadIdx.x
        g = t // 64
        c2 = 2 * (t % 64)
        d0 = cuda.blockIdx.x * SPREAD_DIMS + c2
        first = h * (K + 2) + min(d0, K - 2)  # part[0, h, d0], flat (K even: 8-byte aligned)
        acc = cuda.local.array(J2, float32)
        for j in range(J):
            p = g + G * j
            if p < P and d0 < K:
                acc[2 * j], acc[2 * j + 1] = _ld_x2(part, p * H * (K + 2) + first)
            else:
                acc[2 * j] = float32(0.0)
                acc[2 * j + 1] = float32(0.0)
        wts = cuda.shared.array(MAX_SPLITS, float32)
        _split_weights(wts, part, sinks, h, K)
        o0 = float32(0.0)
        o1 = float32(0.0)
        for j in range(J):
            p = g + G * j
            w = wts[p] if p < P else float32(0.0)
            o0 += acc[2 * j] * w
            o1 += acc[2 * j + 1] * w
        sums = cuda.shared.array(_SPREAD_SUMS, float32)
        sums[g * SPREAD_DIMS + c2] = o0
        sums[g * SPREAD_DIMS + c2 + 1] = o1
        cuda.syncthreads()
        tt = min(t, SPREAD_DIMS - 1)  # the first SPREAD_DIMS threads: dim tt of the block
        d = cuda.blockIdx.x * SPREAD_DIMS + t if t < SPREAD_DIMS else K
        o = float32(0.0)
        for gg in range(G):
            o += sums[gg * SPREAD_DIMS + tt]
        nope = K - 2 * freqs.shape[0]
        if nope <= d < K:  # the pair partner: the neighbouring dim, its sums in the same order
            other = float32(0.0)
            for gg in range(G):
                other += sums[gg * SPREAD_DIMS + (tt ^ 1)]
            even = (d - nope) % 2 == 0
            o = rope_element(o, other, pos[0], freqs[(d - nope) // 2], even, True)
        if d < K:
            out[h, d] = o
        if LIMBS:
            _put_limbs(xl, o, d, K)

    _SPREAD[G, limbs] = _attention_combine_spread
    return _attention_combine_spread


_SCRATCH: dict = {}  # (P, H, K) -> the split partials part[P, H, K+2], allocated once


def decode_splits(H: int, K: int, slots: int, threads: int, split_tiles: int = 1,
                  heads_per_warp: int = HPW, tile: int = KC) -> tuple[int, int]:
    """(splits P, head groups) of the decode grid for ``slots`` key slots (W + S or W + Ncap):
    about four blocks per SM, at least ``split_tiles`` tiles of ``tile`` slots a split and at
    most MAX_SPLITS. Every split writes an H x (K + 2) partial that the combine reads back: at
    one 16-slot tile a split, CSA's 640 slots make 40 splits, 5.3 MB of partials for 374 KB of
    keys. (The split kernel's warps hold HPW heads over KC-slot tiles, the head-warp kernel's
    one over KH.)"""
    groups = cdiv(H, threads // 32 * heads_per_warp)
    sms = device.sm_count()
    P = max(1, min(cdiv(slots, tile * split_tiles), cdiv(4 * sms, groups), MAX_SPLITS))
    return P, groups




def mma_splits(H: int, slots: int, tiles_per_split: int) -> tuple[int, int]:
    """(splits P, head groups) of the tensor-core decode grid for ``slots`` key slots (its
    blocks take 255 registers x 256 threads: one per SM): ``tiles_per_split`` 16-slot tiles a
    split, one wave of blocks at most, at most MAX_SPLITS."""
    from .attention_prefill import MAX_MT, MKC

    groups = cdiv(H, 16 * (1 if H <= 16 else MAX_MT))
    sms = 8 if device.SIMULATOR else device.sm_count()  # (simulator: tests reach the splits)
    P = min(cdiv(slots, MKC * tiles_per_split), max(1, sms // groups), MAX_SPLITS)
    return max(P, 1), groups


def _partials(P: int, H: int, K: int, stream):
    """The split partials' scratch [P, H, K+2] f32, one per shape, module-wide (so reused by
    every layer: concurrent streams need their own)."""
    if (P, H, K) not in _SCRATCH:
        _SCRATCH[P, H, K] = cuda.device_array((P, H, K + 2), np.float32, stream=stream)
    return _SCRATCH[P, H, K]


def attention_decode(out, q, window_packed, n_window, comp_packed, sel, n_comp_visible,
                     all_visible: int, sinks, scale: float, stream=0, threads=None,
                     naive: bool = False, part=None, mma=None, tiles_per_split: int = MMA_TILES,
                     out_rope=None, split_tiles: int | None = None, limbs=None,
                     prefetch: bool = True, staged: bool = True,
                     combine_groups: int = 0, head_warps: bool = False,
                     bf16_tile: bool = False) -> None:
    """out[H, K] f32 <- sink attention of q[H, K] over the window entries (n_window of
    window_packed[W, bytes]) and the compressed entries of comp_packed[Ncap, bytes]: the rows
    in sel[S] int32 (CSA; -1 = none) or, with ``all_visible`` (HCA), every row below
    n_comp_visible[1]. Entries are kvpack's packed KV (head dim K; the rope dims follow from
    the entry width). ``part`` is the split partials' scratch [P, H, K+2] f32 (default:
    ``_partials``). Launches: the split kernel, then the combine.

    ``mma`` True / False / None (pick): the split kernel on the tensor cores (attention_prefill's
    kernel in its decode form, ``tiles_per_split`` 16-slot tiles a block: 3, HCA at 256K 26.6
    µs against 29.0 at 1, and −0.6% a step against 4, H100, 2026-12-06 (r)) or on the CUDA
    cores.
    The pick: tensor cores for HCA on a GPU, where they win (H200, 2026-12-02, graphs of 20,
    BENCHMARKS.md: 128 + 2,048 entries 62.9 -> 42.6 µs, 128 + 8,192 148.7 -> 72.2 µs); CUDA
    cores for CSA's 640 slots (29.8 µs; tensor cores 31.0-37.7: at that size neither kernel's
    time is its arithmetic) and in the simulator (``mma=True`` forces the tensor cores there).

    ``split_tiles``: the CUDA-core kernel's least KC-slot tiles a split (SPLIT_TILES);
    ``prefetch``: its next tile's words loaded while a tile is scored (_split_kernel).
    ``staged``: the tensor-core kernel moves q and its partials through shared memory in
    coalesced runs (attention_prefill._mma_kernel's ``QS``), the CUDA-core kernel its
    partials (_split_kernel).

    ``out_rope`` (pos [1] int32, freqs [R/2] float64): out leaves with the last R dims rotated
    back by the inverse RoPE at pos (§4.9), inside the combine (naive: norm_rope.rope after).

    ``limbs``: int32 [rows, cols / 16 · XLW] gets the int8 limbs of out viewed as [rows, cols]
    (gemv.q8_0_limbs' words; the x of attn_output_a's dp4a GEMV, gemv_q8_0(limbs=)), made by
    the combine itself (K a multiple of 16; naive: a limbs launch after).

    ``combine_groups`` > 0: the combine with the splits spread over that many groups of a
    block's threads, every load issued at once (_spread_combine); 0: a thread a dim.

    ``head_warps`` (CUDA cores): the kernel with one head a warp over KH-slot tiles, 512
    threads a block by default (_head_warp_kernel; ``split_tiles`` counts its tiles, 1 by
    default), instead of two heads a warp over KC-slot tiles; ``bf16_tile``: that kernel
    holding its decoded tile as bf16 (the same values: half the shared-memory reads)."""
    H, K = q.shape
    R = rope_dim_of(K, window_packed.shape[1])
    args = (q, window_packed, n_window, comp_packed, sel, n_comp_visible, int32(all_visible))
    if naive:
        nt = threads or 64
        _attention_decode_naive[cdiv(H, nt), nt, stream](out, *args, sinks, float32(scale), R)
        if out_rope is not None:
            o3 = out.reshape(1, H, K)
            rope(o3, o3, *out_rope, True, stream, naive=True)
        if limbs is not None:
            _make_limbs(limbs, out.reshape(limbs.shape[0], H * K // limbs.shape[0]), stream)
        return
    slots = window_packed.shape[0] + (comp_packed.shape[0] if all_visible else sel.shape[0])
    if (all_visible and not device.SIMULATOR) if mma is None else mma:
        from .attention_prefill import MAX_MT, _mma_kernel, _no_keys, _no_rope

        kern, nt, smem = _mma_kernel(K, R, 1 if H <= 16 else MAX_MT, DEC=True, QS=staged)
        P, groups = mma_splits(H, slots, tiles_per_split)
        part = _partials(P, H, K, stream) if part is None else part
        win = window_packed.view(np.uint64)
        device.launch_shared(
            kern, (P, groups), nt, stream, smem, part, q.reshape(1, H, K), win, win,
            comp_packed.view(np.uint64), _no_keys(K), sel.reshape(1, sel.shape[0]),
            n_comp_visible, int32(all_visible), n_window, sinks, float32(scale), *_no_rope(),
            float32(0.0))
    elif head_warps:
        nt = threads or 512
        kern, smem = _head_warp_kernel(K, R, nt, bf16_tile)
        P, groups = decode_splits(H, K, slots, nt, split_tiles or 1, 1, KH)
        part = _partials(P, H, K, stream) if part is None else part
        device.launch_shared(
            kern, (P, groups), nt, stream, smem, part, q, window_packed.view(np.uint32),
            n_window, comp_packed.view(np.uint32), sel, n_comp_visible, int32(all_visible),
            float32(scale))
    else:
        nt = threads or 256
        kern, smem = _split_kernel(K, R, nt, prefetch, staged)
        P, groups = decode_splits(H, K, slots, nt, split_tiles or SPLIT_TILES)
        part = _partials(P, H, K, stream) if part is None else part
        kern[(P, groups), nt, stream, smem](
            part, q, window_packed.view(np.uint32), n_window, comp_packed.view(np.uint32),
            sel, n_comp_visible, int32(all_visible), float32(scale))
    pos, freqs = out_rope or (device.empty_vector(np.int32), device.empty_vector(np.float64))
    _combine(out, part, sinks, pos, freqs, limbs, stream, combine_groups)


def _combine(out, part, sinks, pos, freqs, limbs, stream, groups: int = 0) -> None:
    """attention_decode's second launch: the combine of the partials into out [H, K] (and
    out's limbs, where ``limbs`` is given); ``groups`` > 0: the spread combine of that many
    split groups (_spread_combine)."""
    H, K = out.shape
    if limbs is not None:
        assert K % 16 == 0 and H * K == limbs.shape[0] * limbs.shape[1] // XLW * 16, limbs.shape
    if groups:
        assert K % 2 == 0, K  # (a thread's 8-byte loads: pairs of dims)
        if not _NO_LIMBS:
            _NO_LIMBS.append(cuda.device_array((1, XLW), np.int32))
        kern = _spread_combine(groups, limbs is not None)
        xl = _NO_LIMBS[0] if limbs is None else limbs
        kern[(cdiv(K, SPREAD_DIMS), H), 64 * groups, stream](out, xl, part, sinks, pos, freqs)
        return
    grid = (cdiv(K, COMBINE_THREADS), H)
    if limbs is None:
        _attention_combine[grid, COMBINE_THREADS, stream](out, part, sinks, pos, freqs)
    else:
        _attention_combine_limbs[grid, COMBINE_THREADS, stream](out, limbs, part, sinks, pos,
                                                                freqs)


def attention_chunk(out, q, keys_packed, mask, sinks, scale: float, stream=0,
                    threads=None) -> None:
    """out[T, H, K] f32 <- q[T, H, K] over keys_packed[M, bytes] where mask[T, M] uint8 is set
    (the caller concatenates window ring, chunk and compressed entries); sinks[H]."""
    T, H, K = q.shape
    nt = threads or 64
    _attention_chunk_naive[min(cdiv(T * H, nt), 4096), nt, stream](
        out, q, keys_packed, mask, sinks, float32(scale), rope_dim_of(K, keys_packed.shape[1]))


# ---- CI lane B and the benchmark --------------------------------------------------------------
_PART = "float32[:, :, ::1]"
PTX_SIGNATURES = [
    (_attention_decode_naive, "void(float32[:, ::1], float32[:, ::1], uint8[:, ::1], int32[::1], "
                              "uint8[:, ::1], int32[::1], int32[::1], int32, float32[::1], "
                              "float32, int64)"),
    (_attention_chunk_naive, "void(float32[:, :, ::1], float32[:, :, ::1], uint8[:, ::1], "
                             "uint8[:, ::1], float32[::1], float32, int64)"),
    *((_split_kernel(512, 64, 256, prefetch, staged)[0],  # V4-Flash: K = 512, R = 64, 256
       f"void({_PART}, float32[:, ::1], uint32[:, ::1], int32[::1], uint32[:, ::1], int32[::1], "
       "int32[::1], int32, float32)") for prefetch in (True, False) for staged in (True, False)),
    *((_head_warp_kernel(512, 64, 512, bf)[0],  # the head-warp kernel (the engine's CSA)
       f"void({_PART}, float32[:, ::1], uint32[:, ::1], int32[::1], uint32[:, ::1], int32[::1], "
       "int32[::1], int32, float32)") for bf in (False, True)),
    (_attention_combine, f"void(float32[:, ::1], {_PART}, float32[::1], int32[::1], "
                         "float64[::1])"),
    (_attention_combine_limbs, f"void(float32[:, ::1], int32[:, ::1], {_PART}, float32[::1], "
                               "int32[::1], float64[::1])"),
    *((_spread_combine(groups, limbs), f"void(float32[:, ::1], int32[:, ::1], {_PART}, "
                                       "float32[::1], int32[::1], float64[::1])")
      for groups in (2, 4, 8) for limbs in (True, False)),
]


def random_packed_kv(rng, n: int, K: int, R: int) -> np.ndarray:
    """[n, kv_entry_bytes(K, R)] uint8: random entries through the model's FP8 round-trip."""
    from ..numerics import fp8_roundtrip

    x = rng.normal(size=(n, K)).astype(np.float32)
    x[:, :K - R] = fp8_roundtrip(x[:, :K - R], 64)
    out = np.empty((n, kvpack.kv_entry_bytes(K, R)), np.uint8)
    kvpack.pack_kv_ref(out, x, R)
    return out


def bench_cases(stream) -> list[BenchCase]:
    """V4-Flash decode: H = 64 heads x K = 512 (R = 64), a full 128-entry window plus 512
    selected compressed entries (CSA) or 2048 / 8192 visible ones (HCA at 256K / 1M context);
    the CUDA-core split kernel (with and without its next tile's prefetch) and the tensor-core
    one at 1-4 tiles a split (and without q and its partials staged in shared memory); the
    launcher's pick with out_a's x limbs made in the combine, and with a limbs launch after."""
    rng = np.random.default_rng(0)
    H, K, R, W = 64, 512, 64, 128
    cases = []
    kernels = {"split": dict(mma=False), "mma 1 tile/split": dict(mma=True, tiles_per_split=1),
               "mma 2 tiles/split": dict(mma=True, tiles_per_split=2),
               "mma 4 tiles/split": dict(mma=True, tiles_per_split=4),
               "mma 3 tiles/split": dict(mma=True, tiles_per_split=3),
               **{f"mma {t} tiles/split, q and partials unstaged": dict(
                   mma=True, tiles_per_split=t, staged=False) for t in (2, 4)},
               **{f"split {t} tiles/split": dict(mma=False, split_tiles=t) for t in (1, 2, 4)},
               "split 2 tiles/split, partials unstaged": dict(mma=False, split_tiles=2,
                                                              staged=False),
               "split, a head a warp (512 threads)": dict(mma=False, head_warps=True),
               "split, a head a warp, bf16 tile": dict(mma=False, head_warps=True,
                                                       bf16_tile=True),
               **{f"split {t} tiles/split, no prefetch": dict(mma=False, split_tiles=t,
                                                              prefetch=False) for t in (1, 2, 4)}}
    for mode, ncomp in (("CSA", 512), ("HCA", 2048), ("HCA", 8192)):
        hca = mode == "HCA"
        ncap = ncomp if hca else 262_144 // 16  # CSA: a 64K-entry pool, 512 rows picked from it
        dev = {n: cuda.to_device(a, stream=stream) for n, a in {
            "q": (rng.normal(size=(H, K)) / 8).astype(np.float32),
            "win": random_packed_kv(rng, W, K, R),
            "comp": random_packed_kv(rng, ncap, K, R),
            "nw": np.array([W], np.int32),
            "sel": (np.arange(ncomp, dtype=np.int32) if hca else
                    np.sort(rng.choice(ncap, ncomp, replace=False)).astype(np.int32)),
            "nc": np.array([ncomp], np.int32),
            "sinks": rng.normal(size=H).astype(np.float32),
        }.items()}
        M = W + ncomp
        nbytes = M * kvpack.kv_entry_bytes(K, R) + 2 * H * K * 4 + 4 * ncomp
        for kname, how in kernels.items():
            out = cuda.device_array((H, K), np.float32, stream=stream)

            def launch(d=dev, out=out, hca=hca, how=how):
                attention_decode(out, d["q"], d["win"], d["nw"], d["comp"], d["sel"], d["nc"],
                                 int(hca), d["sinks"], 1 / math.sqrt(K), stream=stream, **how)

            cases.append(BenchCase("attention", f"attention_decode {kname} {mode} H={H} K={K} "
                                   f"M={W}+{ncomp}", launch, nbytes, flops=4 * H * K * M,
                                   target="<= 20 us" if mode == "CSA" else ""))
        # the launcher's pick with attn_output_a's x limbs made by the combine (8 groups), and
        # the limbs launch it saves, as the engine would run it without
        out = cuda.device_array((H, K), np.float32, stream=stream)
        xl = cuda.device_array((8, H * K // 8 // 16 * XLW), np.int32, stream=stream)
        for fused in (True, False):
            def with_limbs(d=dev, out=out, hca=hca, xl=xl, fused=fused):
                attention_decode(out, d["q"], d["win"], d["nw"], d["comp"], d["sel"], d["nc"],
                                 int(hca), d["sinks"], 1 / math.sqrt(K), stream=stream,
                                 limbs=xl if fused else None)
                if not fused:
                    _make_limbs(xl, out.reshape(8, H * K // 8), stream)
            how = "limbs in the combine" if fused else "then a limbs launch"
            cases.append(BenchCase("attention", f"attention_decode {how} {mode} H={H} K={K} "
                                   f"M={W}+{ncomp}", with_limbs, nbytes + xl.nbytes,
                                   flops=4 * H * K * M))
        cases += _combine_cases(rng, stream, mode, H, K, R, M, xl, dev["sinks"])
    return cases


def _combine_cases(rng, stream, mode: str, H: int, K: int, R: int, M: int, xl, sinks):
    """The combine alone, as the engine runs it (out_a's limbs, the inverse RoPE), over the
    partials of the launcher's pick for M key slots (HCA: tensor cores at MMA_TILES, CSA: the
    CUDA-core kernel), filled with random values (its time does not depend on them): the
    combine's part of the pair's time; a thread a dim, and spread over 2, 4, 8 split groups."""
    P = mma_splits(H, M, MMA_TILES)[0] if mode == "HCA" else \
        decode_splits(H, K, M, 256, SPLIT_TILES)[0]
    part = rng.normal(size=(P, H, K + 2)).astype(np.float32)
    part[:, :, K + 1] = np.abs(part[:, :, K + 1]) * 16  # the sums of exps: positive
    part = cuda.to_device(part, stream=stream)
    pos = cuda.to_device(np.array([100_000], np.int32), stream=stream)
    freqs = cuda.to_device(10_000.0 ** (-np.arange(R // 2) / (R // 2)), stream=stream)
    out = cuda.device_array((H, K), np.float32, stream=stream)

    cases = []
    for groups in (0, 2, 4, 8):
        def combine(groups=groups):
            _combine(out, part, sinks, pos, freqs, xl, stream, groups)
        how = f"spread over {groups} groups" if groups else "alone"
        cases.append(BenchCase("attention", f"attention_decode combine {how} (P={P}) {mode} "
                               f"H={H} K={K} M={M}", combine,
                               part.nbytes + out.nbytes + xl.nbytes))
    return cases
