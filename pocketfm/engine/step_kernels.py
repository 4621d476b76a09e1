"""The decode step's bookkeeping on the device, so that a captured graph replays every step.

A decode step reads everything that changes from token to token out of one small int32 array,
``meta``, and the token ids ``ids[capacity + 1]`` (the prompt, then the sampled tokens)::

    meta[0]  pos        position of this step's token
    meta[1]  n_prompt   prompt length: steps at pos < n_prompt - 1 only ingest
    meta[2]  n_window   window entries visible now, min(pos + 1, W)
    meta[3+i]           compressed entries emitted so far for ratio i, (pos + 1) // ratios[i]

``begin_step`` derives meta[2:], the step's token and its sampling uniform from ``pos``;
``end_step`` stores the sampled id as the next token (once the prompt is consumed) and advances
``pos``. ``store_row`` writes the step's packed kv entry into the window ring at pos mod W.
Each kernel has a NumPy twin with the same signature (tests).
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from ..kernels import device
from ..kernels.device import cdiv, grid_stride_shape

META_POS, META_PROMPT, META_WINDOW, META_RATIOS = 0, 1, 2, 3


# ---- NumPy references ---------------------------------------------------------------------------
def begin_step_ref(meta, ids, token, u, uniforms, ratios, window: int) -> None:
    """token[0] = ids[pos]; u[0] = uniforms[pos + 1 - n_prompt] (0 outside the table);
    meta[2] = min(pos + 1, window); meta[3 + i] = (pos + 1) // ratios[i]."""
    pos = int(meta[META_POS])
    token[0] = ids[pos]
    j = pos + 1 - int(meta[META_PROMPT])
    u[0] = uniforms[j] if 0 <= j < len(uniforms) else 0.0
    meta[META_WINDOW] = min(pos + 1, window)
    for i, r in enumerate(ratios):
        meta[META_RATIOS + i] = (pos + 1) // int(r)


def end_step_ref(meta, ids, next_token) -> None:
    """ids[pos + 1] = next_token[0] once pos + 1 >= n_prompt (inside ids); pos += 1."""
    pos = int(meta[META_POS])
    if pos + 1 >= int(meta[META_PROMPT]) and pos + 1 < len(ids):
        ids[pos + 1] = next_token[0]
    meta[META_POS] = pos + 1


def store_row_ref(ring, row, meta) -> None:
    """ring[pos mod W] = row[0] (uint8 rows)."""
    ring[int(meta[META_POS]) % ring.shape[0]] = row[0]


def scale_ref(x, c: float) -> None:
    """x[T, n] *= c in place."""
    x *= np.float32(c)


def fill_words_ref(words, bits: int) -> None:
    """words[R, n] uint32 = bits everywhere."""
    words[...] = np.uint32(bits)


def mask_nonresident_ref(scores, resident, n_commit) -> None:
    """scores[j] = -inf for each committed chunk j < n_commit[0] not resident (resident[j] 0):
    the native indexer's top-k then picks inside the Memory Indexer's set (two-level)."""
    n = min(int(n_commit[0]), len(scores))
    scores[:n][resident[:n] == 0] = -np.inf


def drop_nonresident_ref(sel, resident, n_commit) -> None:
    """sel[i] = -1 where it names a committed chunk that is not resident (a top-k over fewer
    resident entries than k fills up with masked ones)."""
    n = int(n_commit[0])
    for i in range(len(sel)):
        j = sel[i]
        if 0 <= j < n and resident[j] == 0:
            sel[i] = -1


def copy_if_flag_ref(dst, src, flag) -> None:
    """dst[k] = src[k] when flag[0] != 0 (int32 arrays)."""
    if flag[0]:
        dst[...] = src


def flag_after_prompt_ref(flag, meta) -> None:
    """flag[0] = 1 once this step's token is past the prompt (pos >= n_prompt), else 0."""
    flag[0] = int(meta[META_POS] >= meta[META_PROMPT])


def sort_selected_ref(sel) -> None:
    """sel[T, k] int32 in place: each row ascending, the -1 pads last."""
    key = np.where(sel < 0, np.iinfo(np.int32).max, sel)
    key.sort(axis=1)
    sel[...] = np.where(key == np.iinfo(np.int32).max, -1, key)


def remap_rows_ref(out, sel, lut) -> None:
    """out[i] = lut[sel[i]] for sel[i] >= 0, else -1: a top-k of logical chunk ids turned into
    KV-swap staging slots (lut = the swap table's slot_of_chunk; -1 = not staged). An id past
    the LUT maps to -1 too."""
    ok = (sel >= 0) & (sel < len(lut))
    out[...] = -1
    out[ok] = lut[sel[ok]]


def scores_by_chunk_ref(scores, slot_scores, lut, n_visible) -> None:
    """scores[j] = slot_scores[lut[j]] for the visible chunks j < n_visible[0] (-inf where the
    chunk is not staged): the native indexer, run over the KV-swap staging slots' keys, back in
    chunk order, where the unchanged top-k (and its tie rule) takes over."""
    n = min(int(n_visible[0]), len(scores))
    slot = lut[:n]
    scores[:n] = np.where(slot >= 0, slot_scores[np.maximum(slot, 0)], -np.inf)


def swap_leading_ref(out, x) -> None:
    """out[B, A, C] = x[A, B, C] with the two leading axes swapped."""
    out[...] = np.swapaxes(x, 0, 1)


# ---- kernels ------------------------------------------------------------------------------------
@device.kernel
def _begin_step(meta, ids, token, u, uniforms, ratios, window):
    if cuda.grid(1) != 0:
        return
    pos = meta[0]
    token[0] = ids[pos]
    j = pos + 1 - meta[1]
    u[0] = uniforms[j] if j >= 0 and j < uniforms.shape[0] else np.float32(0.0)
    meta[2] = min(pos + 1, window)
    for i in range(ratios.shape[0]):
        meta[3 + i] = (pos + 1) // ratios[i]


@device.kernel
def _end_step(meta, ids, next_token):
    if cuda.grid(1) != 0:
        return
    pos = meta[0]
    if pos + 1 >= meta[1] and pos + 1 < ids.shape[0]:
        ids[pos + 1] = next_token[0]
    meta[0] = pos + 1


@device.kernel
def _store_row(ring, row, meta):
    slot = meta[0] % ring.shape[0]
    i = cuda.grid(1)
    if i < ring.shape[1]:
        ring[slot, i] = row[0, i]


@device.kernel
def _scale(x, c):
    T, n = x.shape
    for i in range(cuda.grid(1), T * n, cuda.gridsize(1)):
        x[i // n, i % n] *= c


@device.kernel
def _fill_words(words, bits):
    R, n = words.shape
    for i in range(cuda.grid(1), R * n, cuda.gridsize(1)):
        words[i // n, i % n] = bits


@device.kernel
def _swap_leading(out, x):
    """Grid-stride over the outputs, consecutive threads along C (both sides coalesced)."""
    B, A, C = out.shape
    for i in range(cuda.grid(1), B * A * C, cuda.gridsize(1)):
        c = i % C
        a = (i // C) % A
        b = i // (C * A)
        out[b, a, c] = x[a, b, c]


@device.kernel
def _mask_nonresident(scores, resident, n_commit):
    n = min(n_commit[0], scores.shape[0])
    for j in range(cuda.grid(1), n, cuda.gridsize(1)):
        if resident[j] == 0:
            scores[j] = -np.inf


@device.kernel
def _drop_nonresident(sel, resident, n_commit):
    i = cuda.grid(1)
    if i < sel.shape[0]:
        j = sel[i]
        if j >= 0 and j < n_commit[0] and resident[j] == 0:
            sel[i] = -1


@device.kernel
def _remap_rows(out, sel, lut):
    i = cuda.grid(1)
    if i < out.shape[0]:
        j = sel[i]
        out[i] = lut[j] if j >= 0 and j < lut.shape[0] else -1


@device.kernel
def _scores_by_chunk(scores, slot_scores, lut, n_visible):
    n = min(n_visible[0], scores.shape[0])
    for j in range(cuda.grid(1), n, cuda.gridsize(1)):
        slot = lut[j]
        scores[j] = slot_scores[slot] if slot >= 0 else -np.inf


@device.kernel
def _copy_if_flag(dst, src, flag):
    i = cuda.grid(1)
    if i < dst.shape[0] and flag[0] != 0:
        dst[i] = src[i]


@device.kernel
def _flag_after_prompt(flag, meta):
    if cuda.grid(1) == 0:
        flag[0] = 1 if meta[0] >= meta[1] else 0


SORT_MAX = 1024  # entries a row of sort_selected may hold (index_topk is 512 in V4)
_PAD = 0x7FFFFFFF  # -1 pads sort as the largest key


@device.kernel
def _sort_selected(sel):
    """A block per row: bitonic sort in shared memory over the next power of two P >= k, a
    thread per compare-exchange pair (P / 2 threads; fewer loop over the pairs). Index math in
    int32, pair positions by bit operations: the loop is 45 barrier-separated stages at k = 512,
    so each stage's few instructions are the kernel's time."""
    k = sel.shape[1]
    row, tid, nt = cuda.blockIdx.x, int32(cuda.threadIdx.x), int32(cuda.blockDim.x)
    sh = cuda.shared.array(SORT_MAX, int32)
    P = int32(1)
    while P < k:
        P *= int32(2)
    for i in range(tid, P, nt):
        v = sel[row, i] if i < k else int32(-1)
        sh[i] = v if v >= 0 else int32(_PAD)
    cuda.syncthreads()
    half = P >> int32(1)
    size = int32(2)
    while size <= P:
        stride = size >> int32(1)
        while stride > 0:
            for t in range(tid, half, nt):
                low = t & (stride - int32(1))
                i = ((t - low) << int32(1)) | low  # pair t's lower position; j = i + stride
                a, b = sh[i], sh[i + stride]
                if (a > b) == ((i & size) == 0):  # ascending runs where bit `size` is 0
                    sh[i], sh[i + stride] = b, a
            cuda.syncthreads()
            stride >>= int32(1)
        size <<= int32(1)
    for i in range(tid, k, nt):
        v = sh[i]
        sel[row, i] = v if v != _PAD else int32(-1)


# ---- launchers ----------------------------------------------------------------------------------
def begin_step(meta, ids, token, u, uniforms, ratios, window: int, stream=0) -> None:
    """meta int32 [3 + len(ratios)], ids int32 [cap + 1], token int32 [1], u float32 [1],
    uniforms float32 [n], ratios int32 [r] (device arrays)."""
    _begin_step[1, 32, stream](meta, ids, token, u, uniforms, ratios, int32(window))


def end_step(meta, ids, next_token, stream=0) -> None:
    _end_step[1, 32, stream](meta, ids, next_token)


def store_row(ring, row, meta, stream=0) -> None:
    """ring uint8 [W, bytes], row uint8 [1, bytes]."""
    nt = 128
    _store_row[cdiv(ring.shape[1], nt), nt, stream](ring, row, meta)


def scale(x, c: float, stream=0) -> None:
    """x float32 [T, n] *= c."""
    nt = 128
    _scale[min(cdiv(x.size, nt), 1024), nt, stream](x, np.float32(c))


def fill_words(words, bits: int, stream=0) -> None:
    """words uint32 [R, n] = bits: a cache reset on the device (a float32 or packed uint8 array
    seen as 32-bit words), instead of copying gigabytes of host zeros at a long context."""
    nt, most = grid_stride_shape(4096)
    _fill_words[min(cdiv(words.size, nt), most), nt, stream](words, np.uint32(bits))


def swap_leading(out, x, stream=0) -> None:
    """out float32 [B, A, C] <- x [A, B, C]: a chunk's [tokens, groups, ...] activations to
    group-major order and back, so that each output group runs as one GEMM over its tokens."""
    A, B, C = x.shape
    if out.shape != (B, A, C):
        raise ValueError(f"swap_leading: out {out.shape}, want {(B, A, C)}")
    nt, most = grid_stride_shape(4096)
    _swap_leading[min(cdiv(x.size, nt), most), nt, stream](out, x)


def mask_nonresident(scores, resident, n_commit, stream=0) -> None:
    """scores float32 [N], resident uint8 [>= N], n_commit int32 [1] (device; a graph replay
    reads the set committed last)."""
    nt = 256
    _mask_nonresident[min(cdiv(scores.shape[0], nt), 1024), nt, stream](scores, resident,
                                                                       n_commit)


def drop_nonresident(sel, resident, n_commit, stream=0) -> None:
    """sel int32 [k] (a top-k), resident uint8 [N], n_commit int32 [1]."""
    nt = 128
    _drop_nonresident[cdiv(sel.shape[0], nt), nt, stream](sel, resident, n_commit)


def remap_rows(out, sel, lut, stream=0) -> None:
    """out int32 [k] <- the staging slot of each selected chunk in sel int32 [k], through the
    device LUT int32 [N] (KV swap: attention then reads the staging rows; the LUT is uploaded
    between graph replays, so a replay reads the set committed last)."""
    nt = 128
    _remap_rows[cdiv(out.shape[0], nt), nt, stream](out, sel, lut)


def scores_by_chunk(scores, slot_scores, lut, n_visible, stream=0) -> None:
    """scores float32 [N] <- slot_scores float32 [S] through lut int32 [N] (slot of each chunk,
    -1: not staged) for j < n_visible int32 [1] (device)."""
    nt = 256
    _scores_by_chunk[min(cdiv(scores.shape[0], nt), 1024), nt, stream](scores, slot_scores, lut,
                                                                       n_visible)


def copy_if_flag(dst, src, flag, stream=0) -> None:
    """dst int32 [k] <- src [k] when the device flag int32[1] is set (a captured graph's
    choice between the native and the global top-k)."""
    nt = 128
    _copy_if_flag[cdiv(dst.shape[0], nt), nt, stream](dst, src, flag)


def flag_after_prompt(flag, meta, stream=0) -> None:
    _flag_after_prompt[1, 32, stream](flag, meta)


def sort_selected(sel, stream=0) -> None:
    """sel int32 [T, k] (k <= 1024): every row in ascending order, pads last. The prefill's
    top-k kernel writes its picks in atomic-counter order, which varies from run to run;
    attention sums the picks in list order, so sorting them makes a run repeat bit for bit.
    (The decode top-k writes them in ascending order itself.)"""
    T, k = sel.shape
    if k > SORT_MAX:
        raise ValueError(f"sort_selected: rows of {k} > {SORT_MAX}")
    nt = 32 if device.SIMULATOR else min(512, max(32, k // 2))  # a thread per pair
    _sort_selected[T, nt, stream](sel)


PTX_SIGNATURES = [
    (_begin_step, "void(int32[::1], int32[::1], int32[::1], float32[::1], float32[::1], "
                  "int32[::1], int32)"),
    (_end_step, "void(int32[::1], int32[::1], int32[::1])"),
    (_store_row, "void(uint8[:, ::1], uint8[:, ::1], int32[::1])"),
    (_scale, "void(float32[:, ::1], float32)"),
    (_swap_leading, "void(float32[:, :, ::1], float32[:, :, ::1])"),
    (_fill_words, "void(uint32[:, ::1], uint32)"),
    (_mask_nonresident, "void(float32[::1], uint8[::1], int32[::1])"),
    (_drop_nonresident, "void(int32[::1], uint8[::1], int32[::1])"),
    (_sort_selected, "void(int32[:, ::1])"),
    (_copy_if_flag, "void(int32[::1], int32[::1], int32[::1])"),
    (_remap_rows, "void(int32[::1], int32[::1], int32[::1])"),
    (_scores_by_chunk, "void(float32[::1], float32[::1], int32[::1], int32[::1])"),
    (_flag_after_prompt, "void(int32[::1], int32[::1])"),
]
