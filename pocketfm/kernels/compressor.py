"""CSA / HCA compressors on the GPU (spec §4.6): state update, pooling and entry emission.

Truth: ``pocketfm.model.Forward._compress`` with ``_emit_kv`` / ``_emit_index_key``; the
references below call that code. Per token t at position p the compressor writes
``a_t`` and ``g_t + ape[p mod r]`` into state row (r if CSA) + p mod r. A token with
(p+1) mod r == 0 completes block j = (p+1)/r - 1, which is pooled per dimension e
(softmax over the candidates' scores, weighted sum of their values):

    CSA (2r rows, coff 2)  rows 0..r-1, dim e      (lane A of block j-1)
                           rows r..2r-1, dim d+e   (lane B of block j); then rows r.. -> 0..
    HCA (r rows, coff 1)   rows 0..r-1, dim e

and emitted: RMSNorm(norm_w) -> RoPE of the last R dims at position r·j (float64 angle)
-> ``mode``: 0 FP8 round-trip (attention kv, d = 512), 1 none (kv, QAT off), 2 Hadamard + FP4
(indexer key, d = 128), 3 Hadamard only (indexer, QAT off).

Outputs: ``out_entries[N, d]`` float32 (row j written when j < N, so a zero-row array turns
it off) and, for modes 0 / 2, ``out_packed[N, bytes]`` in kvpack's formats (584 B / 68 B),
equal to packing the float32 entry. The decode step keeps ``pos`` in device memory (CUDA graph).
Letters: T tokens, d entry width, r ratio, R rope dims, N entries.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32

from ..model import Forward
from ..numerics import rope_frequencies
from ..presets import tiny
from ..quants import GGMLType
from ..weights import Tensor
from . import device
from .bench import BenchCase
from .device import cdiv, device_fn
from .kvpack import index_key_bytes, kv_entry_bytes, pack_index_key_ref, pack_kv_ref
from .qat import (FP4_BLOCK, FP8_BLOCK, bf16_bits, e4m3_code, fp4_code, fp4_exp, fp4_pack_exp,
                  fp4_value, fp8_exp, fp8_pack_exp, fp8_value, group_absmax, hadamard_shared,
                  GRAPH_REPS, empty_rows, repeat_graph, scalar_fn)

MODE_KV_FP8, MODE_KV, MODE_INDEX_FP4, MODE_INDEX = 0, 1, 2, 3
MAX_D = 512  # entry width a block holds in shared memory (V4: 512 attention, 128 indexer)
# emission blocks use more than 64 registers a thread: 1024-thread blocks fail to launch on the
# H200 (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, measured), 512 run
MAX_THREADS = 512
MAX_D_PARTS, MAX_D_BLOCKS = MAX_D // 8, MAX_D // FP4_BLOCK  # shared sizes must be constants


# ---- NumPy references: the model's own compressor code ----------------------------------------
def compressor_chunk_ref(state_kv, state_score, a, g, ape, pos0, ratio, overlap, norm_w, freqs,
                         rms_eps, mode, out_entries, out_packed=None) -> None:
    """Tokens pos0[0] .. pos0[0]+T-1: state_kv/score [rows, coff·d] (updated), a/g [T, coff·d],
    ape [r, coff·d], norm_w [d], freqs [R/2] f64 -> out_entries[N, d] (and out_packed) rows j.

    Runs ``Forward._compress`` in out_entries' dtype on a Forward whose compressor numerics are
    these (rope dims, eps, frequencies, QAT switch); only the g + ape line is restated here.
    """
    d = norm_w.shape[0]
    if (state_kv.shape[0] == 2 * ratio) != bool(overlap):
        raise ValueError("compressor: CSA state has 2r rows, HCA r rows")
    indexer = mode in (MODE_INDEX_FP4, MODE_INDEX)
    R = 2 * len(freqs)
    cfg = tiny().replace(head_dim=max(d, R), rope_dim=R, rms_eps=float(rms_eps),
                         index_dim=d if indexer else 64)
    # packed_kv off: out_entries are the float entries; out_packed applies the bf16 rounding
    fw = Forward(cfg, None, qat=mode in (MODE_KV_FP8, MODE_INDEX_FP4), dtype=out_entries.dtype,
                 packed_kv=False)
    fw.freq_compressed = np.asarray(freqs, np.float64)
    pos = int(pos0[0]) + np.arange(a.shape[0])
    gs = g + ape[pos % ratio]  # Forward._compressor_inputs
    norm = Tensor("compressor.norm", GGMLType.F32, (d,), np.asarray(norm_w, np.float32))
    fw._compress(a, gs, pos, ratio, state_kv, state_score, out_entries, norm, d,
                 fw._emit_index_key if indexer else fw._emit_kv)
    js = np.arange(int(pos0[0]) // ratio, (int(pos[-1]) + 1) // ratio)  # the emitted entries
    if out_packed is not None and len(js) and mode in (MODE_KV_FP8, MODE_INDEX_FP4):
        rows = np.empty((len(js), out_packed.shape[1]), np.uint8)
        if mode == MODE_KV_FP8:
            pack_kv_ref(rows, out_entries[js].astype(np.float32), R)
        else:
            pack_index_key_ref(rows, out_entries[js].astype(np.float32))
        out_packed[js] = rows


def compressor_step_ref(state_kv, state_score, a, g, ape, pos, ratio, overlap, norm_w, freqs,
                        rms_eps, mode, out_entries, out_packed=None, rowmap=None) -> None:
    """Decode form: one token a/g [coff·d] at position pos[0]; ``rowmap`` sends entry j to
    row rowmap[j] of both outputs (-1: nowhere)."""
    if rowmap is None:
        compressor_chunk_ref(state_kv, state_score, a[None], g[None], ape, pos, ratio, overlap,
                             norm_w, freqs, rms_eps, mode, out_entries, out_packed)
        return
    j = (int(pos[0]) + 1) // ratio - 1  # the entry this token would complete
    tmp_f = np.zeros((max(j + 1, 0), out_entries.shape[1]), out_entries.dtype)
    tmp_p = None if out_packed is None else np.zeros((tmp_f.shape[0], out_packed.shape[1]),
                                                     np.uint8)
    compressor_chunk_ref(state_kv, state_score, a[None], g[None], ape, pos, ratio, overlap,
                         norm_w, freqs, rms_eps, mode, tmp_f, tmp_p)
    emits = (int(pos[0]) + 1) % ratio == 0 and 0 <= j < len(rowmap)
    o = int(rowmap[j]) if emits else -1
    if o >= 0 and o < out_entries.shape[0]:
        out_entries[o] = tmp_f[j]
    if o >= 0 and tmp_p is not None and o < out_packed.shape[0]:
        out_packed[o] = tmp_p[j]


# ---- pooling (shared by every kernel, so chunk and step results agree bit for bit) -------------
NO_INPUT = 2 ** 31 - 1  # pfirst for "every candidate is in the state"


@scalar_fn
def _candidate(state_kv, state_score, a, g, ape, pfirst, cur, j, row, e, d, ratio, overlap):
    """(score, value) of candidate ``row`` (state order) of entry j at dim e.

    Its token p comes from the inputs a/g [T, coff·d] when p >= pfirst (row p - pfirst), else
    from the state, where block ``cur`` sits in rows r.. (CSA) and any other block in rows 0..
    """
    i = row
    jb = j
    col = e
    if overlap:
        if row < ratio:
            jb = j - 1  # lane A: the previous block
        else:
            i = row - ratio
            col = d + e  # lane B: this block
    p = jb * ratio + i
    if p >= pfirst:
        t = p - pfirst
        return g[t, col] + ape[i, col], a[t, col]
    srow = ratio + i if (overlap and jb == cur) else i
    return state_score[srow, col], state_kv[srow, col]


@scalar_fn
def _pool(state_kv, state_score, a, g, ape, pfirst, cur, j, e, d, ratio, overlap):
    """ops.softmax_pool over dim e's 2r (CSA) or r (HCA) candidates in float32: max, then
    Σ exp(s - max)·v / Σ exp(s - max) accumulated in row order; -inf scores weigh 0."""
    n = 2 * ratio if overlap else ratio
    m, _ = _candidate(state_kv, state_score, a, g, ape, pfirst, cur, j, 0, e, d, ratio, overlap)
    for row in range(1, n):
        s, _ = _candidate(state_kv, state_score, a, g, ape, pfirst, cur, j, row, e, d, ratio,
                          overlap)
        m = max(m, s)
    sp = float32(0.0)
    sv = float32(0.0)
    for row in range(n):
        s, v = _candidate(state_kv, state_score, a, g, ape, pfirst, cur, j, row, e, d, ratio,
                          overlap)
        p = math.exp(s - m)
        sp += p
        sv += p * v
    return sv / sp


# ---- emission: one block turns pooled values into entry j ---------------------------------------
@device_fn
def _emit(vals, h, part, gmax, red, j, jo, ratio, norm_w, freqs, rms_eps, mode, out_f, out_p):
    """vals[0:d] (float32 shared, pooled) -> RMSNorm -> RoPE at r·j -> QAT of ``mode`` ->
    out_f[jo] / out_p[jo] (jo = j, or the KV-swap staging slot of entry j; < 0 writes nothing).
    Every thread of the block calls it (barriers); h, part, gmax and red
    are shared scratch (float64 [d], float32 [d/8], [d/32], [blockDim])."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    d = norm_w.shape[0]
    half = freqs.shape[0]
    nope = d - 2 * half
    # RMSNorm in float32 as ops.rmsnorm: x · (1 / sqrt(mean(x²) + eps)) · w
    ss = float32(0.0)
    for e in range(tid, d, nt):
        ss += vals[e] * vals[e]
    ss = device.block_sum(ss, red)
    rinv = float32(1.0) / math.sqrt(ss / float32(d) + rms_eps)
    for e in range(tid, d, nt):
        vals[e] = vals[e] * rinv * norm_w[e]
    cuda.syncthreads()
    # RoPE on adjacent pairs of the last R dims at the block's first position r·j (§4.6); the
    # angle in float64 and cos/sin rounded to float32, as rope_tables does
    for i in range(tid, half, nt):
        ang = float(ratio * j) * freqs[i]
        c = float32(math.cos(ang))
        s = float32(math.sin(ang))
        x0 = vals[nope + 2 * i]
        x1 = vals[nope + 2 * i + 1]
        vals[nope + 2 * i] = x0 * c - x1 * s
        vals[nope + 2 * i + 1] = x0 * s + x1 * c
    cuda.syncthreads()
    if mode >= MODE_INDEX_FP4:  # indexer: orthonormal Hadamard over all d (float64 butterfly)
        for e in range(tid, d, nt):
            h[e] = vals[e]
        cuda.syncthreads()
        hadamard_shared(h, d)
        inv = 1.0 / math.sqrt(float(d))
        for e in range(tid, d, nt):
            vals[e] = h[e] * inv
        cuda.syncthreads()
    write_f = 0 <= jo < out_f.shape[0]
    write_p = 0 <= jo < out_p.shape[0]
    if mode == MODE_KV_FP8:
        group_absmax(vals, nope, FP8_BLOCK, part, gmax)
        for e in range(tid, d, nt):
            v = vals[e]
            if e < nope:
                b = e // FP8_BLOCK
                es = fp8_exp(gmax[b])
                q = fp8_value(float(v), es)
                if write_f:
                    out_f[jo, e] = q
                if write_p:
                    k = fp8_pack_exp(float(gmax[b]), es)
                    out_p[jo, e] = e4m3_code(math.ldexp(q, -k))
                    if e % FP8_BLOCK == 0:
                        out_p[jo, d + 2 * half + b] = k + 127
            else:
                if write_f:
                    out_f[jo, e] = v
                if write_p:
                    bits = bf16_bits(v)
                    out_p[jo, 2 * e - nope] = bits & 255
                    out_p[jo, 2 * e - nope + 1] = bits >> 8
        if write_p:
            for o in range(d + 2 * half + nope // FP8_BLOCK + tid, out_p.shape[1], nt):
                out_p[jo, o] = 0
    elif mode == MODE_INDEX_FP4:
        group_absmax(vals, d, FP4_BLOCK, part, gmax)
        for u in range(tid, d // 2, nt):  # a thread per packed byte: elements 2u, 2u+1
            b = (2 * u) // FP4_BLOCK
            es = fp4_exp(gmax[b])
            q0 = fp4_value(float(vals[2 * u]), es)
            q1 = fp4_value(float(vals[2 * u + 1]), es)
            if write_f:
                out_f[jo, 2 * u] = q0
                out_f[jo, 2 * u + 1] = q1
            if write_p:
                k = fp4_pack_exp(float(gmax[b]), es)
                out_p[jo, u] = fp4_code(q0, k) | (fp4_code(q1, k) << 4)
                if (2 * u) % FP4_BLOCK == 0:
                    out_p[jo, d // 2 + b] = k + 127
        if write_p:
            for o in range(d // 2 + d // FP4_BLOCK + tid, out_p.shape[1], nt):
                out_p[jo, o] = 0
    elif write_f:
        for e in range(tid, d, nt):
            out_f[jo, e] = vals[e]


# ---- decode step ----------------------------------------------------------------------------------
@device.kernel
def _compressor_step_block(state_kv, state_score, a, g, ape, pos, ratio, overlap, norm_w, freqs,
                           rms_eps, mode, out_f, out_p, rowmap):
    """One block: write the token's state row; if it completes a block (decided on the device
    from pos[0], uniformly for the block), pool every dimension, shift the CSA rows, emit into
    row j, or row rowmap[j] when rowmap is not empty (KV swap: the staging slot of chunk j)."""
    vals = cuda.shared.array(MAX_D, float32)
    h = cuda.shared.array(MAX_D, float64)
    part = cuda.shared.array(MAX_D_PARTS, float32)
    gmax = cuda.shared.array(MAX_D_BLOCKS, float32)
    red = cuda.shared.array(MAX_THREADS, float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    d = norm_w.shape[0]
    width = state_kv.shape[1]
    p = pos[0]
    i = p % ratio
    row = ratio + i if overlap else i
    for c in range(tid, width, nt):
        state_kv[row, c] = a[0, c]
        state_score[row, c] = g[0, c] + ape[i, c]
    if i != ratio - 1:
        return
    cuda.syncthreads()
    j = p // ratio
    for e in range(tid, d, nt):
        vals[e] = _pool(state_kv, state_score, a, g, ape, NO_INPUT, j, j, e, d, ratio, overlap)
    cuda.syncthreads()
    if overlap:  # the current block becomes the previous one
        for x in range(tid, ratio * width, nt):
            r0 = x // width
            c = x - r0 * width
            state_kv[r0, c] = state_kv[ratio + r0, c]
            state_score[r0, c] = state_score[ratio + r0, c]
    jo = j if rowmap.shape[0] == 0 else (rowmap[j] if j < rowmap.shape[0] else -1)
    _emit(vals, h, part, gmax, red, j, jo, ratio, norm_w, freqs, rms_eps, mode, out_f, out_p)


def compressor_step(state_kv, state_score, a, g, ape, pos, ratio: int, overlap: bool, norm_w,
                    freqs, rms_eps: float, mode: int, out_entries, out_packed=None, stream=0,
                    threads=None, rowmap=None) -> None:
    """One decode token: state_kv/score [rows, coff·d] f32 (updated), a/g [coff·d] f32,
    ape [r, coff·d] f32, pos[1] int32 (device, so a graph replays it), norm_w [d] f32,
    freqs [R/2] f64; emits entry j = (pos+1)/r - 1 into out_entries[N, d] f32 and, for modes
    0 / 2, out_packed[N, bytes] uint8 when the token completes a block. Either output may be
    None (nothing written there). ``rowmap`` [N] int32 (KV swap): write row rowmap[j] instead
    of j (the chunk's GPU staging slot; -1 writes nothing)."""
    d = _check(state_kv, ape, ratio, overlap, norm_w, freqs, mode, out_packed)
    width = state_kv.shape[1]
    nt = _block_threads(threads, d)
    _compressor_step_block[1, nt, stream](
        state_kv, state_score, a.reshape(1, width), g.reshape(1, width), ape, pos, int32(ratio),
        int32(overlap), norm_w, freqs, float32(rms_eps), int32(mode),
        _or_empty(out_entries, np.float32), _or_empty(out_packed, np.uint8),
        device.empty_vector(np.int32) if rowmap is None else rowmap)


# ---- prefill chunk ------------------------------------------------------------------------------
@device.kernel
def _chunk_pool_scan(state_kv, state_score, a, g, ape, pos0, ratio, overlap, scratch):
    """Naive: one thread per dimension e runs the tokens in order, exactly like the decode
    step (columns e and d+e are all it touches), pooling completed block k into scratch[k]."""
    d = scratch.shape[1]
    e = cuda.grid(1)
    if e >= d:
        return
    p0 = pos0[0]
    k = 0
    for t in range(a.shape[0]):
        p = p0 + t
        i = p % ratio
        row = ratio + i if overlap else i
        state_kv[row, e] = a[t, e]
        state_score[row, e] = g[t, e] + ape[i, e]
        if overlap:
            state_kv[row, d + e] = a[t, d + e]
            state_score[row, d + e] = g[t, d + e] + ape[i, d + e]
        if i == ratio - 1:
            j = p // ratio
            scratch[k, e] = _pool(state_kv, state_score, a, g, ape, NO_INPUT, j, j, e, d, ratio,
                                  overlap)
            k += 1
            if overlap:
                for r0 in range(ratio):
                    state_kv[r0, e] = state_kv[ratio + r0, e]
                    state_score[r0, e] = state_score[ratio + r0, e]
                    state_kv[r0, d + e] = state_kv[ratio + r0, d + e]
                    state_score[r0, d + e] = state_score[ratio + r0, d + e]


@device.kernel
def _chunk_pool_gather(state_kv, state_score, a, g, ape, pos0, ratio, overlap, scratch):
    """One thread per (entry k, dim e), all entries at once: a candidate comes from the chunk's
    a/g when its token is in the chunk, else from the state as it stood before the chunk."""
    d = scratch.shape[1]
    x = cuda.grid(1)
    k = x // d
    e = x - k * d
    p0 = pos0[0]
    if k >= (p0 + a.shape[0]) // ratio - p0 // ratio:
        return
    scratch[k, e] = _pool(state_kv, state_score, a, g, ape, p0, p0 // ratio, p0 // ratio + k, e,
                          d, ratio, overlap)


@device.kernel
def _chunk_state_tail(state_kv, state_score, a, g, ape, pos0, ratio, overlap):
    """The state after the chunk, grid-stride over (i < r, column), launched after the gather:
    row (r+)i holds the last token ≡ i (mod r); after an emission CSA row i holds the last
    emitted block's token (taken from the chunk, or from row r+i before it is overwritten)."""
    width = state_kv.shape[1]
    p0 = pos0[0]
    pend = p0 + a.shape[0]
    emitted = pend // ratio > p0 // ratio
    for x in range(cuda.grid(1), ratio * width, cuda.gridsize(1)):
        i = x // width
        c = x - i * width
        if overlap and emitted:
            pp = (pend // ratio - 1) * ratio + i
            if pp >= p0:
                state_kv[i, c] = a[pp - p0, c]
                state_score[i, c] = g[pp - p0, c] + ape[i, c]
            else:
                state_kv[i, c] = state_kv[ratio + i, c]
                state_score[i, c] = state_score[ratio + i, c]
        q = pend - 1 - i
        if q >= 0 and pend - 1 - q % ratio >= p0:
            t = pend - 1 - q % ratio - p0
            row = ratio + i if overlap else i
            state_kv[row, c] = a[t, c]
            state_score[row, c] = g[t, c] + ape[i, c]


@device.kernel
def _emit_entries(scratch, pos0, ntok, ratio, norm_w, freqs, rms_eps, mode, out_f, out_p):
    """One block per entry the chunk completes (entry j = pos0 // r + block index)."""
    vals = cuda.shared.array(MAX_D, float32)
    h = cuda.shared.array(MAX_D, float64)
    part = cuda.shared.array(MAX_D_PARTS, float32)
    gmax = cuda.shared.array(MAX_D_BLOCKS, float32)
    red = cuda.shared.array(MAX_THREADS, float32)
    p0 = pos0[0]
    k = cuda.blockIdx.x
    if k >= (p0 + ntok) // ratio - p0 // ratio:
        return
    for e in range(cuda.threadIdx.x, norm_w.shape[0], cuda.blockDim.x):
        vals[e] = scratch[k, e]
    cuda.syncthreads()
    j = p0 // ratio + k
    _emit(vals, h, part, gmax, red, j, j, ratio, norm_w, freqs, rms_eps, mode, out_f, out_p)


def compressor_chunk(state_kv, state_score, a, g, ape, pos0, ratio: int, overlap: bool, norm_w,
                     freqs, rms_eps: float, mode: int, out_entries, out_packed=None,
                     scratch=None, stream=0, threads=None, naive: bool = False) -> None:
    """Prefill: tokens pos0[0] .. pos0[0]+T-1 with a/g [T, coff·d]; the same result as T calls
    of compressor_step (bit for bit). ``scratch`` [T//r + 1, d] f32 holds the pooled entries
    (allocated here when None). Naive: a sequential scan per dimension; default: every entry
    pooled in parallel, then the final state written in one pass."""
    T, width = a.shape
    d = _check(state_kv, ape, ratio, overlap, norm_w, freqs, mode, out_packed)
    rows = T // ratio + 1  # entries a chunk of T tokens can complete
    if scratch is None:
        scratch = cuda.device_array((rows, d), np.float32, stream=stream)
    nt = threads or 256
    args = (state_kv, state_score, a, g, ape, pos0, int32(ratio), int32(overlap))
    if naive:
        _chunk_pool_scan[cdiv(d, nt), nt, stream](*args, scratch)
    else:
        _chunk_pool_gather[cdiv(rows * d, nt), nt, stream](*args, scratch)
        # a few elements per thread: plain copies, enough threads for HCA's r·d = 65536
        _chunk_state_tail[cdiv(ratio * width, 8 * nt), nt, stream](*args)
    nte = _block_threads(threads, d)
    _emit_entries[rows, nte, stream](scratch, pos0, int32(T), int32(ratio), norm_w, freqs,
                                     float32(rms_eps), int32(mode),
                                     _or_empty(out_entries, np.float32),
                                     _or_empty(out_packed, np.uint8))


# ---- launch helpers -----------------------------------------------------------------------------
def _or_empty(arr, dtype):
    return empty_rows(dtype) if arr is None else arr


def _block_threads(threads, d: int) -> int:
    """Threads of an emitting block: a thread per dimension by default (d = 512 / 128)."""
    nt = threads or min(MAX_THREADS, cdiv(d, 32) * 32)
    if nt > MAX_THREADS:
        raise ValueError(f"compressor: {nt} threads per emitting block, at most {MAX_THREADS}")
    return nt


def _check(state_kv, ape, ratio, overlap, norm_w, freqs, mode, out_packed) -> int:
    d = norm_w.shape[0]
    R = 2 * freqs.shape[0]
    width = (2 if overlap else 1) * d
    rows = (2 if overlap else 1) * ratio
    if d > MAX_D or state_kv.shape != (rows, width) or ape.shape != (ratio, width) or R > d:
        raise ValueError(f"compressor: d={d} (max {MAX_D}), state {state_kv.shape} / ape "
                         f"{ape.shape}, expected ({rows}, {width}) / ({ratio}, {width}), R={R}")
    if mode in (MODE_KV_FP8, MODE_KV) and (d - R) % FP8_BLOCK:
        raise ValueError(f"compressor: kv width {d} - rope {R} must be a multiple of 64")
    if mode in (MODE_INDEX_FP4, MODE_INDEX) and (d < FP4_BLOCK or d & (d - 1)):
        raise ValueError(f"compressor: indexer width {d} must be a power of two >= 32")
    if out_packed is not None:
        want = kv_entry_bytes(d, R) if mode == MODE_KV_FP8 else index_key_bytes(d)
        if mode not in (MODE_KV_FP8, MODE_INDEX_FP4) or out_packed.shape[1] != want:
            raise ValueError(f"compressor: packed rows of {out_packed.shape[1]} B in mode {mode}")
    return d


# ---- CI lane B: every kernel with the exact argument types its launcher passes ---------------
_F1, _F2, _U2 = "float32[::1]", "float32[:, ::1]", "uint8[:, ::1]"
_STATE = f"{_F2}, {_F2}, {_F2}, {_F2}, {_F2}, int32[::1], int32, int32"  # state, a, g, ape, pos
_EMIT = f"{_F1}, float64[::1], float32, int32, {_F2}, {_U2}"  # norm_w, freqs, eps, mode, outs
PTX_SIGNATURES = [
    (_compressor_step_block, f"void({_STATE}, {_EMIT}, int32[::1])"),
    (_chunk_pool_scan, f"void({_STATE}, {_F2})"),
    (_chunk_pool_gather, f"void({_STATE}, {_F2})"),
    (_chunk_state_tail, f"void({_STATE})"),
    (_emit_entries, f"void({_F2}, int32[::1], int32, int32, {_EMIT})"),
]


# ---- benchmarks (H200) ------------------------------------------------------------------------
def bench_cases(stream) -> list[BenchCase]:
    """V4-Flash shapes: decode steps of the CSA attention compressor (r 4, d 512, coff 2) with
    and without an emission, HCA (r 128) and the indexer's (d 128, FP4) emitting steps, and
    512-token chunks (CSA, HCA). QAT modes write packed entries only, as the engine does. Each
    case is a graph of GRAPH_REPS launches (the step repeats the same position)."""
    rng = np.random.default_rng(0)
    freqs = cuda.to_device(rope_frequencies(64, 160000.0, 16.0, 65536), stream=stream)
    cases, N, reps = [], 256, GRAPH_REPS

    def dev(*shape):
        return cuda.to_device(rng.normal(size=shape).astype(np.float32), stream=stream)

    def case(name, r, overlap, d, T, pos, mode):
        width, rows = (2 if overlap else 1) * d, (2 if overlap else 1) * r
        kv, sc, ape, norm = dev(rows, width), dev(rows, width), dev(r, width), dev(d)
        a, g = (dev(width), dev(width)) if T == 1 else (dev(T, width), dev(T, width))
        p = cuda.to_device(np.array([pos], np.int32), stream=stream)
        nb = kv_entry_bytes(d, 64) if mode == MODE_KV_FP8 else index_key_bytes(d)
        packed = cuda.device_array((N, nb), np.uint8, stream=stream)
        args = (kv, sc, a, g, ape, p, r, overlap, norm, freqs, 1e-6, mode, None, packed)
        if T == 1:
            def launch():
                compressor_step(*args, stream=stream)
        else:
            scratch = cuda.device_array((T // r + 1, d), np.float32, stream=stream)

            def launch():
                compressor_chunk(*args, scratch=scratch, stream=stream)
        # ideal: inputs once, the state row(s) written; an emission also reads the candidates,
        # rewrites the CSA previous-block rows and writes the packed entry
        nbytes = 4 * (2 * T * width + r * width + 2 * min(T, rows) * width)
        n_emit = (pos + T) // r - pos // r
        if n_emit:
            nbytes += 4 * (2 * rows * width + (2 * r * width if overlap else 0)) + n_emit * nb
        cases.append(BenchCase("compressor", f"{name} (x{reps} graph)",
                               repeat_graph(launch, stream), bytes=reps * nbytes,
                               flops=reps * (n_emit * rows * d * 6 + 2 * T * width),
                               launches=reps))

    case("compressor_step CSA kv d512 r4, no emission", 4, True, 512, 1, 41, MODE_KV_FP8)
    case("compressor_step CSA kv d512 r4, emission", 4, True, 512, 1, 43, MODE_KV_FP8)
    case("compressor_step HCA kv d512 r128, emission", 128, False, 512, 1, 127, MODE_KV_FP8)
    case("compressor_step CSA indexer d128 r4, emission", 4, True, 128, 1, 43, MODE_INDEX_FP4)
    case("compressor_chunk CSA kv 512 tokens", 4, True, 512, 512, 0, MODE_KV_FP8)
    case("compressor_chunk HCA kv 512 tokens", 128, False, 512, 512, 0, MODE_KV_FP8)
    return cases
