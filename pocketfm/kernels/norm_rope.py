"""RMSNorm and RoPE kernels (spec §4.2 step 5, §4.4, §4.5, §4.9).

Dimension letters: R rows (tokens, or tokens x heads for the per-head weightless q norm: callers
view q[T, H, K] as [T*H, K]), n row length, T tokens, H heads, P = len(freqs) rotated pairs.

- ``rmsnorm``: out = w * x / sqrt(mean(x^2) + eps) per row; ``use_weight=False`` is the
  weightless norm (the launcher still takes a weight array: pass any float32 [n] dummy).
- ``rope``: rotate the last 2P dims of every head in adjacent pairs (2i, 2i+1) by pos * omega_i,
  the first n - 2P dims pass through; ``inverse`` rotates by -theta (attention output, §4.9).
  The angle is formed in float64 inside the kernel: positions reach 1M and a float32 angle
  pos * omega would be off by up to ~0.06 rad there. In place is allowed (``out is x``).
  Also used with H = 1 (kv [T, 1, K]) and for compressed entries at positions r * j.
- ``rmsnorm_rope``: both, one launch (the decode's q heads and kv row). ``norm_row`` is the
  norm of one row as a device function: hc.py's u block calls it too.

Both ops have a naive kernel (one thread per row, all serial) kept as the readable baseline
and a fast one: one block per row for the norm; a per-token cos/sin table in shared memory for
RoPE, shared by all the heads a block rotates.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .. import ops
from ..numerics import rope_tables
from . import device
from .bench import BenchCase
from .device import block_sum_warps, cdiv

MAX_THREADS = 1024
MAX_PAIRS = 64  # rope dims <= 128: the shared cos/sin table size
UNROLL = 4  # independent loads per thread before their first use


class Dense:
    """Adapter giving a plain array the ``Tensor.dense(dtype)`` interface pocketfm.ops expects."""

    def __init__(self, a):
        self.a = np.asarray(a)

    def dense(self, dtype=np.float32):
        return self.a.astype(dtype)


# ---- RMSNorm -------------------------------------------------------------------------------------
def rmsnorm_ref(out, x, w, eps: float, use_weight: bool) -> None:
    """out[R, n] = x / sqrt(mean(x^2) + eps) (* w[n] when use_weight), via pocketfm.ops."""
    ops.rmsnorm(out, x, Dense(w) if use_weight else None, eps)


@device.kernel
def _rmsnorm_naive(out, x, w, eps, use_weight):
    """One thread per row: sum of squares, then the scaled copy."""
    r = cuda.grid(1)
    if r >= x.shape[0]:
        return
    n = x.shape[1]
    ss = 0.0
    for i in range(n):
        ss += x[r, i] * x[r, i]
    inv = 1.0 / math.sqrt(ss / n + eps)
    for i in range(n):
        v = x[r, i] * inv
        out[r, i] = v * w[i] if use_weight else v


@cuda.jit(device=True)
def norm_row(out, x, w, r, eps, use_weight, scratch, wsum):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) (* w): one block, every thread calls it.
    Coalesced loads, UNROLL in flight per thread (a single row is latency-bound), one block
    sum; every read of row r happens before the sum's barrier, so out may be x."""
    vals = cuda.local.array(UNROLL, np.float32)
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    ss = np.float32(0.0)
    for i0 in range(t, n, nt * UNROLL):
        for k in range(UNROLL):
            vals[k] = x[r, min(i0 + k * nt, n - 1)]
        for k in range(UNROLL):
            if i0 + k * nt < n:
                ss += vals[k] * vals[k]
    tot = block_sum_warps(ss, scratch, wsum)
    inv = np.float32(1.0 / math.sqrt(tot / n + eps))
    for i0 in range(t, n, nt * UNROLL):
        for k in range(UNROLL):
            i = min(i0 + k * nt, n - 1)
            vals[k] = x[r, i] * inv * (w[i] if use_weight else np.float32(1.0))
        for k in range(UNROLL):
            if i0 + k * nt < n:
                out[r, i0 + k * nt] = vals[k]


@device.kernel
def _rmsnorm_block_rows(out, x, w, eps, use_weight):
    """One block per row (grid-stride over rows): ``norm_row``."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    wsum = cuda.shared.array(32, np.float32)
    for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        norm_row(out, x, w, r, eps, use_weight, scratch, wsum)


def norm_threads(n: int) -> int:
    """Block size of ``norm_row`` over rows of n: UNROLL elements a thread."""
    return min(MAX_THREADS, max(32, 32 * cdiv(n // UNROLL, 32)))


def rmsnorm(out, x, w, eps: float, use_weight: bool, stream=0, threads=None,
            naive: bool = False) -> None:
    """Launcher: device arrays out[R, n], x[R, n], w[n] float32 (a dummy when not use_weight)."""
    R, n = x.shape
    eps = np.float32(eps)
    if naive:
        nt = threads or 128
        _rmsnorm_naive[cdiv(R, nt), nt, stream](out, x, w, eps, bool(use_weight))
        return
    nt = threads or norm_threads(n)
    assert nt % 32 == 0 and nt <= MAX_THREADS
    _rmsnorm_block_rows[min(R, 65535), nt, stream](out, x, w, eps, bool(use_weight))


# ---- RoPE ----------------------------------------------------------------------------------------
def rope_ref(out, x, pos, freqs, inverse: bool) -> None:
    """out[T, H, n] = x with the last 2P dims rotated at pos[T] * freqs[P] (float64 tables)."""
    cos, sin = rope_tables(np.asarray(freqs, np.float64), np.asarray(pos))
    ops.rope(out, x, cos, sin, inverse)


@device.kernel
def _rope_naive(out, x, pos, freqs, inverse):
    """One thread per (token, head) row: copy the head dims, rotate the tail pairs."""
    T, H, n = x.shape
    row = cuda.grid(1)
    if row >= T * H:
        return
    t, h = row // H, row % H
    P = freqs.shape[0]
    nope = n - 2 * P
    for i in range(nope):
        out[t, h, i] = x[t, h, i]
    p = float(pos[t])
    for k in range(P):
        ang = p * freqs[k]  # float64: exact enough at 1M positions
        c, s = math.cos(ang), math.sin(ang)
        if inverse:
            s = -s
        x0, x1 = x[t, h, nope + 2 * k], x[t, h, nope + 2 * k + 1]
        out[t, h, nope + 2 * k] = x0 * c - x1 * s
        out[t, h, nope + 2 * k + 1] = x0 * s + x1 * c


@device.kernel
def _rope_shared_table(out, x, pos, freqs, inverse, copy_nope, heads_per_block):
    """Block (token t, head group): cos/sin of the P angles computed once into shared memory
    (float64 angle, float32 table), then every head of the group rotated from that table."""
    cs = cuda.shared.array(MAX_PAIRS, np.float32)
    sn = cuda.shared.array(MAX_PAIRS, np.float32)
    T, H, n = x.shape
    P = freqs.shape[0]
    nope = n - 2 * P
    t = cuda.blockIdx.x
    h0 = cuda.blockIdx.y * heads_per_block
    nh = min(heads_per_block, H - h0)
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    for k in range(tid, P, nt):
        ang = float(pos[t]) * freqs[k]
        cs[k] = math.cos(ang)
        sn[k] = -math.sin(ang) if inverse else math.sin(ang)
    cuda.syncthreads()
    for e in range(tid, nh * P, nt):  # one pair per step, consecutive threads on adjacent pairs
        h, k = h0 + e // P, e % P
        i = nope + 2 * k
        x0, x1 = x[t, h, i], x[t, h, i + 1]
        out[t, h, i] = x0 * cs[k] - x1 * sn[k]
        out[t, h, i + 1] = x0 * sn[k] + x1 * cs[k]
    if copy_nope:  # skipped in place: those dims already hold the right values
        for e in range(tid, nh * nope, nt):
            h, i = h0 + e // nope, e % nope
            out[t, h, i] = x[t, h, i]


@cuda.jit(device=True)
def rope_element(v, partner, pos, freq, even, inverse):
    """One element of a rotated pair, for kernels whose thread holds one element and can read
    its partner: v is element 2k (``even``) or 2k + 1 of the pair, partner the other one; the
    angle pos * freq in float64, its cos / sin rounded to float32 (as _rope_shared_table)."""
    ang = float(pos) * freq
    c = np.float32(math.cos(ang))
    s = np.float32(-math.sin(ang)) if inverse else np.float32(math.sin(ang))
    return v * c - partner * s if even else partner * s + v * c


def rope(out, x, pos, freqs, inverse: bool, stream=0, threads=None, naive: bool = False,
         heads_per_block: int = 8) -> None:
    """Launcher: out/x [T, H, n] float32 (may be the same array), pos [T] int32, freqs [P]
    float64 (pocketfm.numerics.rope_frequencies)."""
    T, H, n = x.shape
    P = freqs.shape[0]
    assert 2 * P <= n and P <= MAX_PAIRS
    if naive:
        nt = threads or 128
        _rope_naive[cdiv(T * H, nt), nt, stream](out, x, pos, freqs, bool(inverse))
        return
    hb = max(1, min(H, heads_per_block))
    nt = threads or min(256, 32 * cdiv(hb * P, 32))
    _rope_shared_table[(T, cdiv(H, hb)), nt, stream](out, x, pos, freqs, bool(inverse),
                                                      out is not x, hb)


# ---- both, one launch (decode: the q heads, the kv row) ------------------------------------------
def rmsnorm_rope_ref(out, x, w, eps: float, use_weight: bool, pos, freqs) -> None:
    """out[T, H, n] = rope(rmsnorm(x) per (token, head) row) at pos[T], forward."""
    T, H, n = x.shape
    normed = np.empty((T * H, n), np.float32)
    rmsnorm_ref(normed, x.reshape(T * H, n), w, eps, use_weight)
    rope_ref(out, normed.reshape(T, H, n), pos, freqs, False)


@device.kernel
def _rmsnorm_rope_rows(out, x, w, eps, use_weight, pos, freqs, heads):
    """Block per row r = t * heads + h of out/x [T * heads, n]: ``norm_row``, then the row's
    last 2P dims rotated at pos[t] (the cos/sin table as _rope_shared_table makes it), so the
    result is bit for bit the two launches' (rmsnorm, then rope in place)."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    wsum = cuda.shared.array(32, np.float32)
    cs = cuda.shared.array(MAX_PAIRS, np.float32)
    sn = cuda.shared.array(MAX_PAIRS, np.float32)
    r = cuda.blockIdx.x
    P, n = freqs.shape[0], x.shape[1]
    nope = n - 2 * P
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    for k in range(tid, P, nt):  # (visible after norm_row's barriers)
        ang = float(pos[r // heads]) * freqs[k]
        cs[k] = math.cos(ang)
        sn[k] = math.sin(ang)
    norm_row(out, x, w, r, eps, use_weight, scratch, wsum)
    cuda.syncthreads()  # the block's writes of out[r] are visible to all its threads
    for k in range(tid, P, nt):
        i = nope + 2 * k
        x0, x1 = out[r, i], out[r, i + 1]
        out[r, i] = x0 * cs[k] - x1 * sn[k]
        out[r, i + 1] = x0 * sn[k] + x1 * cs[k]


def rmsnorm_rope(out, x, w, eps: float, use_weight: bool, pos, freqs, stream=0, threads=None,
                 naive: bool = False) -> None:
    """Launcher: out/x [T, H, n] float32 (may be the same array), w [n] (a dummy when not
    use_weight), pos [T] int32, freqs [P] float64: RMSNorm of every (token, head) row, then the
    forward RoPE, in one launch (``naive``: the two naive kernels)."""
    T, H, n = x.shape
    P = freqs.shape[0]
    assert 2 * P <= n and P <= MAX_PAIRS
    if naive:
        rmsnorm(out.reshape(T * H, n), x.reshape(T * H, n), w, eps, use_weight, stream, threads,
                naive=True)
        rope(out, out, pos, freqs, False, stream, threads, naive=True)
        return
    nt = threads or norm_threads(n)
    assert nt % 32 == 0 and nt <= MAX_THREADS
    _rmsnorm_rope_rows[T * H, nt, stream](out.reshape(T * H, n), x.reshape(T * H, n), w,
                                          np.float32(eps), bool(use_weight), pos, freqs, H)


# ---- CI lane B and the H200 benchmark -----------------------------------------------------------
_RMS_SIG = "void(float32[:, ::1], float32[:, ::1], float32[::1], float32, boolean)"
_ROPE_SIG = "float32[:, :, ::1], float32[:, :, ::1], int32[::1], float64[::1], boolean"
PTX_SIGNATURES = [
    (_rmsnorm_naive, _RMS_SIG),
    (_rmsnorm_block_rows, _RMS_SIG),
    (_rope_naive, f"void({_ROPE_SIG})"),
    (_rope_shared_table, f"void({_ROPE_SIG}, boolean, int64)"),
    (_rmsnorm_rope_rows, "void(float32[:, ::1], float32[:, ::1], float32[::1], float32, boolean, "
                         "int32[::1], float64[::1], int64)"),
]


def bench_cases(stream):
    """V4-Flash shapes: attn_norm (D = 4096, T = 1), the per-head q norm 64 x 512, RoPE on
    q [1, 64, 512] and kv [1, 1, 512] in place (64 rope dims of 512); and a 512-token prefill
    chunk's per-head q norm and q RoPE (attention_prefill's T = 512 cases: the prefill's q
    norm, its RoPE and the output's inverse RoPE are folded into the attention there)."""
    from ..numerics import rope_frequencies

    rng = np.random.default_rng(0)

    def dev(a):
        return device.to_device(np.ascontiguousarray(a), stream)

    cases = []
    for name, R, n, wt in (("rmsnorm attn_norm 1x4096", 1, 4096, True),
                           ("rmsnorm q per-head 64x512", 64, 512, False),
                           ("rmsnorm q per-head 512x64x512 (prefill)", 512 * 64, 512, False)):
        x = dev(rng.standard_normal((R, n), dtype=np.float32))
        w = dev(rng.standard_normal(n, dtype=np.float32))
        o = device.device_empty((R, n), np.float32, stream)
        for naive in (False, True) if R <= 64 else (False,):
            cases.append(BenchCase(
                "norm_rope", name + (" naive" if naive else ""),
                lambda o=o, x=x, w=w, wt=wt, nv=naive: rmsnorm(o, x, w, 1e-6, wt, stream,
                                                               naive=nv),
                bytes=2 * R * n * 4 + (n * 4 if wt else 0), flops=4 * R * n))
    freqs = dev(rope_frequencies(64, 160000.0, 16.0, 65536))
    for name, T, H in (("rope q [1,64,512] in place", 1, 64), ("rope kv [1,1,512] in place", 1, 1),
                       ("rope q [512,64,512] in place (prefill)", 512, 64)):
        x = dev(rng.standard_normal((T, H, 512), dtype=np.float32))
        pos = dev(np.arange(1_000_000, 1_000_000 + T, dtype=np.int32))
        for naive in (False, True) if T == 1 else (False,):
            cases.append(BenchCase(
                "norm_rope", name + (" naive" if naive else ""),
                lambda x=x, p=pos, nv=naive: rope(x, x, p, freqs, False, stream, naive=nv),
                bytes=2 * T * H * 64 * 4, flops=6 * T * H * 32))
    return cases
