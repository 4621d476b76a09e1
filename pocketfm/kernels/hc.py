"""Hyper-connection kernels: HC pre, HC post and the output-head collapse (spec §4.2, §4.3, §4.12).

Dimension letters: T tokens, HC streams (4 in V4), D hidden (4096), C = HC * D flattened stream
columns, M mix rows: (2 + HC) * HC = 24 for pre/post, HC for the head.

The mix m[T, M] = r * (fn[M, C] . flatten(X[t])) reads all of fn (24 x 16384 float32 = 1.5 MB)
for every token: at decode (T = 1) that is the whole cost, so it is split over C: block b of
``_hc_mix_split`` takes 128 consecutive flattened columns, leaves one partial dot per mix row
(plus a partial sum of squares for r), and a one-block-per-token finish adds them up, runs the
tiny sigmoid / Sinkhorn part on one thread and writes u = sum_i pre_i X_i.

The partials are parked in out_u itself (row t holds M+1 partials per split, laid out row-major
[M+1, splits]): the finish block reads them all before a barrier and only then overwrites the
row with u, so no workspace is needed; that requires (M+1) * splits <= D, which the launcher
guarantees by widening the blocks (and falls back to the naive kernel for tiny D).

The decode engine passes a side stream instead (``side``): the partials then go to a
workspace, ``_hc_pre_finish_u`` makes u on the main stream and ``_hc_pre_finish_post`` post
and the Sinkhorn comb beside it, off the path to the sublayer (hc_post is their only reader);
with ``norm=`` the u block also writes the sublayer's input RMSNorm (one launch fewer), from
u still in its registers where the block covers D in one round (V4: 1,024 threads; H100,
2026-12-05: −1.6% a decode step against the 512-thread block that read u back). The engine
now takes the Gram path there instead (``u_gram``, HC = 4): the split mix (_hc_mix_gram4) also
leaves the partials of the streams' Gram matrix, and u with its norm is made by D / 512
blocks (_hc_pre_u_gram4), the norm's sum of squares as preᵀ G pre (H100: the u block 12.4 →
5.2 µs, 2026-12-06 (n)); there the previous sublayer's output may come in parts (the MoE's
routed rows and shared row, added by the mix).

A prefill chunk passes a ``mix`` workspace instead: the mix is then ``_hc_mix_chunk``, a
GEMM over the chunk's tokens on the CUDA cores (its N, the 24 mix rows, is too narrow for the
tensor-core tiles: as mma.py's split kernel it took ~316 µs a 2,048-token chunk on the H200
for 134 MB of X, 8x its read time). A warp takes 4 tokens and a slice of the flattened
columns, a lane every 32nd column: per column 4 loads of x (coalesced), 24 of fn (L1 / L2:
fn's 1.5 MB are shared by every block), 100 FMAs into registers (the 4 x 24 dots and the 4
sums of squares), then one warp sum each. The column slices (blocks) a token group are as
many as fill the GPU once (layout.hc_mix_shape: 3 at 2,048 tokens); ``_hc_pre_finish_mix``
(one block per token) adds the slices' partials (so X is read once for the mix and the norm,
once more for u) and does the rest.

fn must be float32: ds4 files store the HC fn tensors as F16; callers convert them once at load.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .. import ops
from ..engine.layout import HC_MIX_TOKENS, hc_mix_shape
from ..quants import GGMLType
from . import device
from .bench import BenchCase
from .device import block_sum_warps, cdiv, warp_sum
from .gemv import gemv
from .norm_rope import Dense, norm_row, rmsnorm
from .qweight import QWeight

MAX_THREADS = 1024
MAX_HC = 8
MAX_ROWS = (2 + MAX_HC) * MAX_HC  # 80 mix rows at HC = 8
MAX_CB = 1024  # flattened columns per mix block
UNROLL = 4  # independent loads issued per thread before their first use
FINISH_THREADS = 512  # the finish kernels' registers do not fit 1024-thread blocks (H200)
# shared/local array sizes must be plain global constants (no arithmetic inside kernels)
MAX_HC2, MAX_ROWS1, MAX_HC1 = MAX_HC * MAX_HC, MAX_ROWS + 1, MAX_HC + 1
MAX_PC = MAX_HC * (MAX_HC + 1)
POST_BLOCKS = 2048  # hc_post: blocks enough (more tokens: one a token, striding over D)
MIX_TOKENS, MIX_WARPS = 4, 4  # _hc_mix_chunk: tokens a warp (their sums in registers), warps
assert MIX_TOKENS * MIX_WARPS == HC_MIX_TOKENS  # (engine/layout.py sizes its workspace)


# ---- NumPy references (pocketfm.ops with array adapters) --------------------------------------
def hc_pre_ref(out_u, out_post, out_comb, X, fn, base, scale, rms_eps, hc_eps, iters) -> None:
    """u[T, D], post[T, HC], comb[T, HC, HC] from X[T, HC, D] (spec §4.2)."""
    ops.hc_pre(out_u, out_post, out_comb, X, Dense(fn), Dense(base), Dense(scale), rms_eps,
               hc_eps, iters)


def hc_post_ref(out, f, X, post, comb) -> None:
    """out[T, k] = post[k] f + sum_j comb[j, k] X[j] (spec §4.3)."""
    ops.hc_post(out, f, X, post, comb)


def hc_head_ref(out_u, X, fn, base, scale, rms_eps, hc_eps) -> None:
    """u[T, D] = sum_i pre_i X_i with sigmoid pre weights only (spec §4.12)."""
    ops.hc_head(out_u, X, Dense(fn), Dense(base), Dense(scale), rms_eps, hc_eps)


# ---- device helpers ------------------------------------------------------------------------------
@cuda.jit(device=True)
def _sigmoid(v):
    one = np.float32(1.0)
    return one / (one + math.exp(-v))


@cuda.jit(device=True)
def _rms_factor(ss, X, rms_eps):
    """1 / rms of a token's HC x D stream values, from their sum of squares ss."""
    return np.float32(1.0 / math.sqrt(ss / (X.shape[1] * X.shape[2]) + rms_eps))


@cuda.jit(device=True)
def _sinkhorn(c, n, iters, eps):
    """Sinkhorn in place on the n x n logits c[j * n + k] (row j = source stream, column k =
    destination): row softmax + eps, column normalise, then (iters - 1) x (row, column).

    One thread runs it: a dependent chain of 2 * iters normalisations, so each row / column
    takes one reciprocal and n multiplies (n divides would triple the latency; <= 1 ulp apart).
    """
    one, zero = np.float32(1.0), np.float32(0.0)
    for j in range(n):
        mx = c[j * n]
        for k in range(1, n):
            mx = max(mx, c[j * n + k])
        s = zero
        for k in range(n):
            e = math.exp(c[j * n + k] - mx)
            c[j * n + k] = e
            s += e
        r = one / s
        for k in range(n):
            c[j * n + k] = c[j * n + k] * r + eps
    for it in range(iters):
        if it > 0:  # the first pass is the column step only (the softmax did the rows)
            for j in range(n):
                s = zero
                for k in range(n):
                    s += c[j * n + k]
                r = one / (s + eps)
                for k in range(n):
                    c[j * n + k] *= r
        for k in range(n):
            s = zero
            for j in range(n):
                s += c[j * n + k]
            r = one / (s + eps)
            for j in range(n):
                c[j * n + k] *= r


@cuda.jit(device=True)
def _comb(out_comb, c, n, mv, rinv, base, scale, hc_eps, iters, t):
    """comb[t] = Sinkhorn(m[2n:] * scale_2 + base[2n:]) through the n x n scratch c."""
    for e in range(n * n):
        c[e] = mv[2 * n + e] * rinv * scale[2] + base[2 * n + e]
    _sinkhorn(c, n, iters, hc_eps)
    for e in range(n * n):
        out_comb[t, e // n, e % n] = c[e]


@cuda.jit(device=True)
def _post_comb(out_post, out_comb, mv, rinv, base, scale, hc_eps, iters, t):
    """post[t] and the Sinkhorn comb[t] from the raw mix mv (dots before the rms factor rinv).
    One thread: ~1k dependent flops on a 4 x 4 matrix."""
    hc = out_post.shape[1]
    for i in range(hc):
        out_post[t, i] = 2 * _sigmoid(mv[hc + i] * rinv * scale[1] + base[hc + i])
    if hc == 4:  # V4: a constant size of its own lets the compiler keep the matrix in registers
        c4 = cuda.local.array(16, np.float32)
        _comb(out_comb, c4, 4, mv, rinv, base, scale, hc_eps, iters, t)
    else:
        c = cuda.local.array(MAX_HC2, np.float32)
        _comb(out_comb, c, hc, mv, rinv, base, scale, hc_eps, iters, t)


# ---- naive kernels: one thread per token, everything serial -------------------------------------
@cuda.jit(device=True)
def _mix_serial(mv, X, fn, t):
    """mv[r] = fn[r] . flatten(X[t]) for every row; returns sum(x^2)."""
    hc, D = X.shape[1], X.shape[2]
    ss = 0.0
    for s in range(hc):
        for d in range(D):
            ss += X[t, s, d] * X[t, s, d]
    for r in range(fn.shape[0]):
        acc = 0.0
        for s in range(hc):
            for d in range(D):
                acc += fn[r, s * D + d] * X[t, s, d]
        mv[r] = acc
    return ss


@cuda.jit(device=True)
def _collapse_streams(out_u, pre, X, t):
    """out_u[t] = Σ_s pre[s] · X[t, s]: the HC streams folded into one sublayer input."""
    for d in range(X.shape[2]):
        u = 0.0
        for s in range(X.shape[1]):
            u += pre[s] * X[t, s, d]
        out_u[t, d] = u


@device.kernel
def _hc_pre_naive(out_u, out_post, out_comb, X, fn, base, scale, rms_eps, hc_eps, iters):
    t = cuda.grid(1)
    if t >= X.shape[0]:
        return
    hc = X.shape[1]
    mv = cuda.local.array(MAX_ROWS, np.float32)
    ss = _mix_serial(mv, X, fn, t)
    rinv = _rms_factor(ss, X, rms_eps)
    _post_comb(out_post, out_comb, mv, rinv, base, scale, hc_eps, iters, t)
    for i in range(hc):  # pre overwrites the first HC mix rows (no longer needed)
        mv[i] = _sigmoid(mv[i] * rinv * scale[0] + base[i]) + hc_eps
    _collapse_streams(out_u, mv, X, t)


@device.kernel
def _hc_head_naive(out_u, X, fn, base, scale, rms_eps, hc_eps):
    t = cuda.grid(1)
    if t >= X.shape[0]:
        return
    hc = X.shape[1]
    mv = cuda.local.array(MAX_HC, np.float32)
    ss = _mix_serial(mv, X, fn, t)
    rinv = _rms_factor(ss, X, rms_eps)
    for i in range(hc):
        mv[i] = _sigmoid(mv[i] * rinv * scale[0] + base[i]) + hc_eps
    _collapse_streams(out_u, mv, X, t)


@device.kernel
def _hc_post_naive(out, f, X, post, comb):
    """One thread per output element out[t, k, d]."""
    T, hc, D = out.shape
    i = cuda.grid(1)
    if i >= T * hc * D:
        return
    t, k, d = i // (hc * D), (i // D) % hc, i % D
    acc = post[t, k] * f[t, d]
    for j in range(hc):
        acc += comb[t, j, k] * X[t, j, d]
    out[t, k, d] = acc


# ---- split kernels (decode: spread the 1.5 MB fn read over ~128 blocks) ------------------------
# At T = 1 every one of these kernels is latency-bound, so loads are issued UNROLL (or HC) at a
# time into registers before any is used, and stores come after all loads (the compiler cannot
# move a load of X above a store to out_u: it does not know they never alias).
@cuda.jit(device=True)
def _mix_round(acc, xs, vals, e0, cb, r, M):
    """acc plus one round of a lane's split-mix terms: vals[k] · xs[e] for its staged columns
    e = e0 + 32k (mix row r < M), or xs[e]^2 (row M, the sum of squares)."""
    for k in range(UNROLL):
        e = e0 + 32 * k
        if e < cb and r <= M:
            acc += xs[e] * xs[e] if r == M else vals[k] * xs[e]
    return acc


@cuda.jit(device=True)
def _put_partial(part, acc, scratch, lane, r, M, t, b, splits):
    """part[t, r * splits + b] <- the warp's sum of acc (row r <= M). Every lane calls it."""
    acc = warp_sum(acc, scratch)
    if lane == 0 and r <= M:
        part[t, r * splits + b] = acc


@cuda.jit(device=True)
def _mix_partials(part, xs, fn, c0, cb, C, t):
    """The split mix over the cb staged columns xs (flattened columns c0 ..): warp w takes mix
    rows w, w + warps, ... and its lanes read the row's fn values coalesced. Writes
    part[t, r * splits + b]: the partial dot of row r, and for r = M the partial sum of x^2.
    The staging must be complete (a barrier after it)."""
    b, splits = cuda.blockIdx.x, cuda.gridDim.x
    M = fn.shape[0]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    vals = cuda.local.array(UNROLL, np.float32)
    lane, w, nw = tid % 32, tid // 32, nt // 32
    for r0 in range(0, M + 1, nw):  # the same trip count in every warp (warp_sum needs all)
        r = r0 + w
        rr = min(r, M - 1)  # row M (sum of squares) reads no fn: its loads are just unused
        acc = np.float32(0.0)
        for e0 in range(lane, cb, 32 * UNROLL):
            for k in range(UNROLL):
                vals[k] = fn[rr, min(c0 + e0 + 32 * k, C - 1)]
            acc = _mix_round(acc, xs, vals, e0, cb, r, M)
        _put_partial(part, acc, scratch, lane, r, M, t, b, splits)


@device.kernel
def _hc_mix_split(part, X, fn, cb):
    """Block (b, t): flattened columns [b * cb, (b+1) * cb) of x^ = flatten(X[t]) (stream-major),
    staged in shared memory, then ``_mix_partials``."""
    xs = cuda.shared.array(MAX_CB, np.float32)
    b, t = cuda.blockIdx.x, cuda.blockIdx.y
    hc, D = X.shape[1], X.shape[2]
    C = hc * D
    c0 = b * cb
    for e in range(cuda.threadIdx.x, cb, cuda.blockDim.x):
        c = c0 + e
        xs[e] = X[t, c // D, c % D] if c < C else np.float32(0.0)
    cuda.syncthreads()
    _mix_partials(part, xs, fn, c0, cb, C, t)


_MIX_CHUNK: dict = {}


def _mix_chunk_kernel(M: int):
    """``_hc_mix_chunk`` for M mix rows (a closure constant: a warp's MIX_TOKENS x (M + 1)
    sums are a register array)."""
    if M in _MIX_CHUNK:
        return _MIX_CHUNK[M]
    NR = M + 1  # the mix rows, then the sum of squares
    TPW = MIX_TOKENS
    NA = TPW * NR
    assert TPW == 4  # (the kernel's four _flush calls)

    @cuda.jit(device=True, inline="always")
    def _flush(part, acc, scratch, s, t, k, lane):
        """part[s, t + k, r] <- the warp's sums of acc[k·NR + r] (k a literal at each call, so
        that every index into acc is a constant and acc stays in registers)."""
        for r in range(NR):
            v = warp_sum(acc[k * NR + r], scratch)  # every lane calls it (the simulator's
            if lane == (k * NR + r) % 32 and t + k < part.shape[1]:  # needs the block)
                part[s, t + k, r] = v

    @device.kernel
    def _hc_mix_chunk(part, X, fn):
        """part[s, t, r] = sum over column slice s of fn[r, c] · X[t, c] (r < M), of X[t, c]^2
        (r = M); X [T, C] flattened, block (token group, slice s), warp w tokens
        (MIX_WARPS·group + w)·TPW .., lane every 32nd column of the slice."""
        scratch = cuda.shared.array(MAX_THREADS, np.float32)  # (the simulator's warp_sum)
        acc = cuda.local.array(NA, np.float32)
        xv = cuda.local.array(TPW, np.float32)
        T, C = X.shape
        lane, w = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
        t0 = (cuda.blockIdx.x * MIX_WARPS + w) * TPW
        S = cuda.gridDim.y  # a slice's columns: whole warps of them
        per = ((C + 31) // 32 + S - 1) // S * 32
        c0 = cuda.blockIdx.y * per
        c1 = min(C, c0 + per)
        for j in range(NA):
            acc[j] = np.float32(0.0)
        for c in range(c0 + lane, c1, 32):
            for k in range(TPW):
                xv[k] = X[min(t0 + k, T - 1), c]  # (rows past T: computed, not written)
            for r in range(M):
                f = fn[r, c]
                for k in range(TPW):
                    acc[k * NR + r] += f * xv[k]
            for k in range(TPW):
                acc[k * NR + M] += xv[k] * xv[k]
        s = cuda.blockIdx.y
        _flush(part, acc, scratch, s, t0, 0, lane)
        _flush(part, acc, scratch, s, t0, 1, lane)
        _flush(part, acc, scratch, s, t0, 2, lane)
        _flush(part, acc, scratch, s, t0, 3, lane)

    _MIX_CHUNK[M] = _hc_mix_chunk
    return _hc_mix_chunk


@cuda.jit(device=True)
def _stage_post_coeffs(pc, post, comb, t):
    """pc = comb[t] (row-major), then post[t]: the HC post's coefficients in shared memory,
    complete after the barrier this ends on (blockDim.x >= HC * (HC + 1))."""
    hc = post.shape[1]
    tid = cuda.threadIdx.x
    if tid < hc * hc:
        pc[tid] = comb[t, tid // hc, tid % hc]
    elif tid < hc * hc + hc:
        pc[tid] = post[t, tid - hc * hc]
    cuda.syncthreads()


@device.kernel
def _hc_post_mix_split(part, X, f, X_prev, post, comb, fn, cb):
    """The previous sublayer's HC post fused into this one's split mix: block (b, t) makes its
    columns of X[t] = hc_post(f, X_prev, post, comb) (spec §4.3), writes them (the sublayer's
    streams, read later by u and the next post) and mixes them as ``_hc_mix_split`` does. One
    launch instead of two on the decode's critical path; each column is made by one block."""
    xs = cuda.shared.array(MAX_CB, np.float32)
    pc = cuda.shared.array(MAX_PC, np.float32)
    b, t = cuda.blockIdx.x, cuda.blockIdx.y
    hc, D = X.shape[1], X.shape[2]
    C = hc * D
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    _stage_post_coeffs(pc, post, comb, t)
    c0 = b * cb
    for e in range(tid, cb, nt):
        c = c0 + e
        v = np.float32(0.0)
        if c < C:
            k, d = c // D, c % D
            v = pc[hc * hc + k] * f[t, d]
            for j in range(hc):
                v += pc[j * hc + k] * X_prev[t, j, d]
            X[t, k, d] = v
        xs[e] = v
    cuda.syncthreads()
    _mix_partials(part, xs, fn, c0, cb, C, t)


@cuda.jit(device=True)
def _post4(pc, k, fd, x0, x1, x2, x3):
    """Stream k of the HC post at HC = 4 from the staged coefficients pc (comb, then post),
    in _post_column's order: the post term, then the four previous streams."""
    v = pc[16 + k] * fd
    v += pc[k] * x0
    v += pc[4 + k] * x1
    v += pc[8 + k] * x2
    v += pc[12 + k] * x3
    return v


@device.kernel
def _hc_post_mix_split4(part, X, f, X_prev, post, comb, fn, cb):
    """The decode's _hc_post_mix_split at HC = 4 with cb <= 32 * UNROLL columns a block and
    a warp for every mix row (V4's decode: 128 columns, 25 warps of 800 threads): the same
    arithmetic (the same bits in the simulator; on the GPU ~1e-5 apart in the logits, the
    multiply-adds fused otherwise), but every load is issued first: the warp's fn values, the
    thread's column of f and of the four previous streams, then the post coefficients. The
    block then waits on memory once, where _hc_post_mix_split waits three times in a row (the
    coefficients, the previous streams after their barrier, fn after the next one)."""
    xs = cuda.shared.array(MAX_CB, np.float32)
    pc = cuda.shared.array(MAX_PC, np.float32)
    scratch = cuda.shared.array(MAX_THREADS, np.float32)  # (the simulator's warp_sum)
    fv = cuda.local.array(UNROLL, np.float32)
    b, t = cuda.blockIdx.x, cuda.blockIdx.y
    D = X.shape[2]
    C = 4 * D
    M = fn.shape[0]
    tid = cuda.threadIdx.x
    lane, w = tid % 32, tid // 32
    c0 = b * cb
    rr = min(w, M - 1)  # (row M, the sum of squares, reads no fn: its loads go unused)
    for k in range(UNROLL):
        fv[k] = fn[rr, min(c0 + lane + 32 * k, C - 1)]
    c = min(c0 + tid, C - 1)  # thread e < cb makes column c0 + e
    kc, d = c // D, c % D
    fd = f[t, d]
    x0, x1, x2, x3 = X_prev[t, 0, d], X_prev[t, 1, d], X_prev[t, 2, d], X_prev[t, 3, d]
    _stage_post_coeffs(pc, post, comb, t)
    if tid < cb:
        v = np.float32(0.0)
        if c0 + tid < C:
            v = _post4(pc, kc, fd, x0, x1, x2, x3)
            X[t, kc, d] = v
        xs[tid] = v
    cuda.syncthreads()
    acc = _mix_round(np.float32(0.0), xs, fv, lane, cb, w, M)  # (one round: cb <= 32·UNROLL)
    _put_partial(part, acc, scratch, lane, w, M, t, b, cuda.gridDim.x)


@cuda.jit(device=True)
def _lane_row_sum(part, t, r, splits, lane):
    """The lane's share of sum over splits of part[t, r * splits + b]: b = lane, lane + 32, ...
    (coalesced), UNROLL loads in flight; a warp_sum of it is the row's sum."""
    vals = cuda.local.array(UNROLL, np.float32)
    n = part.shape[1]
    acc = np.float32(0.0)
    for b0 in range(lane, splits, 32 * UNROLL):
        for k in range(UNROLL):
            vals[k] = part[t, min(r * splits + b0 + 32 * k, n - 1)]
        for k in range(UNROLL):
            if b0 + 32 * k < splits:
                acc += vals[k]
    return acc


@cuda.jit(device=True)
def _gather_partials(mv, part, t, rows, splits, scratch):
    """mv[r] = sum over splits of part[t, r * splits + b], r < rows: warp per row, lanes over
    splits (coalesced). Every thread of the block must call it."""
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    lane, w, nw = tid % 32, tid // 32, nt // 32
    for r0 in range(0, rows, nw):
        r = r0 + w
        acc = warp_sum(_lane_row_sum(part, t, min(r, rows - 1), splits, lane), scratch)
        if lane == 0 and r < rows:
            mv[r] = acc
    cuda.syncthreads()  # after this barrier no thread reads part[t] again


@cuda.jit(device=True)
def _u_values(uk, X, pre, t, d0, n):
    """uk[k] = sum_{s < n} pre[s] X[t, s, d0 + k * blockDim] (d clamped to D - 1): UNROLL * n
    loads in flight with a literal n."""
    D, nt = X.shape[2], cuda.blockDim.x
    for k in range(UNROLL):
        d = min(d0 + k * nt, D - 1)
        u = np.float32(0.0)
        for s in range(n):
            u += pre[s] * X[t, s, d]
        uk[k] = u


@cuda.jit(device=True)
def _collapse(out_u, X, pre, t, n):
    """out_u[t, d] = sum_{s < n} pre[s] X[t, s, d] for this thread's d (block-strided);
    with a literal n the loops unroll into UNROLL * n loads in flight."""
    D = X.shape[2]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    uk = cuda.local.array(UNROLL, np.float32)
    for d0 in range(tid, D, nt * UNROLL):
        _u_values(uk, X, pre, t, d0, n)
        for k in range(UNROLL):
            if d0 + k * nt < D:
                out_u[t, d0 + k * nt] = uk[k]


@cuda.jit(device=True)
def _pre_weight(mv, i, rinv, base, scale, hc_eps):
    """Stream i's pre weight sigmoid(mv[i] · rinv · scale_0 + base[i]) + eps from the raw mix."""
    return _sigmoid(mv[i] * rinv * scale[0] + base[i]) + hc_eps


@cuda.jit(device=True)
def _pre_weights(pre, X, mv, base, scale, rms_eps, hc_eps):
    """pre[i] = sigmoid(...) + eps (threads i < HC) from the raw mix mv[:HC] and the sum of
    squares mv[M]; returns the rms factor rinv. Ends on a block barrier."""
    hc = X.shape[1]
    M = (2 + hc) * hc
    rinv = _rms_factor(mv[M], X, rms_eps)
    tid = cuda.threadIdx.x
    if tid < hc:
        pre[tid] = _pre_weight(mv, tid, rinv, base, scale, hc_eps)
    cuda.syncthreads()
    return rinv


@cuda.jit(device=True)
def _collapse_pre(out_u, X, pre, t):
    """_collapse with HC a literal for V4 (4: the loads unroll), else as it is."""
    if X.shape[1] == 4:
        _collapse(out_u, X, pre, t, 4)
    else:
        _collapse(out_u, X, pre, t, X.shape[1])


@cuda.jit(device=True)
def _pre_from_mix(out_u, out_post, out_comb, X, mv, pre, base, scale, rms_eps, hc_eps, iters, t):
    """The finish of token t from its raw mix mv[:M] and sum of squares mv[M] (shared memory,
    complete): pre weights, post + Sinkhorn on one thread, then u = sum_i pre_i X_i."""
    rinv = _pre_weights(pre, X, mv, base, scale, rms_eps, hc_eps)
    if cuda.threadIdx.x == cuda.blockDim.x - 1:  # the last warp has the least u work
        _post_comb(out_post, out_comb, mv, rinv, base, scale, hc_eps, iters, t)
    _collapse_pre(out_u, X, pre, t)


@device.kernel
def _hc_pre_finish(out_u, out_post, out_comb, X, base, scale, rms_eps, hc_eps, iters, splits):
    """One block per token: gather the partials, post + Sinkhorn on one thread, then u."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    mv = cuda.shared.array(MAX_ROWS1, np.float32)
    pre = cuda.shared.array(MAX_HC, np.float32)
    t = cuda.blockIdx.x
    hc = X.shape[1]
    _gather_partials(mv, out_u, t, (2 + hc) * hc + 1, splits, scratch)
    _pre_from_mix(out_u, out_post, out_comb, X, mv, pre, base, scale, rms_eps, hc_eps, iters, t)


@device.kernel
def _hc_pre_finish_mix(out_u, out_post, out_comb, X, mix, base, scale, rms_eps, hc_eps, iters,
                       out_norm, norm_w):
    """One block per token after _hc_mix_chunk: its slices' partials added (mix[s, t, r]: the
    mix rows r < M, the sum of squares r = M), then as _hc_pre_finish; with a norm weight
    (norm_w not empty) also out_norm[t] = rmsnorm(u) * norm_w, as _hc_pre_finish_u does."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    wsum = cuda.shared.array(32, np.float32)
    mv = cuda.shared.array(MAX_ROWS1, np.float32)
    pre = cuda.shared.array(MAX_HC, np.float32)
    t = cuda.blockIdx.x
    for r in range(cuda.threadIdx.x, mix.shape[2], cuda.blockDim.x):
        v = np.float32(0.0)
        for s in range(mix.shape[0]):
            v += mix[s, t, r]
        mv[r] = v
    cuda.syncthreads()
    _pre_from_mix(out_u, out_post, out_comb, X, mv, pre, base, scale, rms_eps, hc_eps, iters, t)
    if norm_w.shape[0] > 0:
        cuda.syncthreads()  # the block's writes of out_u[t] are visible to all its threads
        norm_row(out_norm, out_u, norm_w, t, rms_eps, True, scratch, wsum)


@cuda.jit(device=True)
def _inv_rms(ss, D, rms_eps, scratch, wsum):
    """1 / rms of a row of D values from each thread's sum of squares ss: norm_row's
    arithmetic (block_sum_warps, then the float64 root). Every thread calls it."""
    tot = block_sum_warps(ss, scratch, wsum)
    return np.float32(1.0 / math.sqrt(tot / D + rms_eps))


@cuda.jit(device=True)
def _collapse_norm(out_u, out_norm, norm_w, X, pre, t, n, rms_eps, scratch, wsum):
    """_collapse (D <= UNROLL * blockDim: one round) and out_norm[t] = rmsnorm(u) * norm_w from
    the u values still in registers: norm_row's arithmetic (the same elements a thread, summed
    in the same order, the same bits) without its second read of u. Every thread calls it."""
    D = X.shape[2]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    uk = cuda.local.array(UNROLL, np.float32)
    _u_values(uk, X, pre, t, tid, n)
    ss = np.float32(0.0)
    for k in range(UNROLL):
        if tid + k * nt < D:
            out_u[t, tid + k * nt] = uk[k]
            ss += uk[k] * uk[k]
    inv = _inv_rms(ss, D, rms_eps, scratch, wsum)
    for k in range(UNROLL):
        d = tid + k * nt
        if d < D:
            out_norm[t, d] = uk[k] * inv * norm_w[d]


XV4 = 4 * UNROLL  # a thread's stream values in _hc_pre_finish_u4: V4's HC = 4 x UNROLL dims


@device.kernel(max_registers=64)
def _hc_pre_finish_u4(out_u, X, part, base, scale, rms_eps, hc_eps, splits, out_norm, norm_w):
    """The decode's _hc_pre_finish_u at HC = 4 with the norm and D <= UNROLL * blockDim
    (V4's decode), one block a token: the same arithmetic as _gather_partials, _pre_weights
    and _collapse_norm (the same bits), but the thread's X values are loaded first, before the
    partials (they need nothing the partials give: one wait on memory where there were two in
    a row), the norm weights before the block sum, and every thread makes the four pre weights
    itself (no barrier for them). Uncapped, ptxas (sm_90) gives it 64 or 71 registers by
    version; ``max_registers=64`` keeps 1,024-thread blocks fitting (CI's register check
    compiles without the cap, so the kernel is not in REGISTER_BUDGETS)."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    wsum = cuda.shared.array(32, np.float32)
    mv = cuda.shared.array(MAX_ROWS1, np.float32)
    t = cuda.blockIdx.x
    D = X.shape[2]
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    xv = cuda.local.array(XV4, np.float32)
    wv = cuda.local.array(UNROLL, np.float32)
    uk = cuda.local.array(UNROLL, np.float32)
    for k in range(UNROLL):
        d = min(tid + k * nt, D - 1)
        for st in range(4):
            xv[k * 4 + st] = X[t, st, d]
    _gather_partials(mv, part, t, 25, splits, scratch)  # (2 + 4) * 4 mix rows + the squares
    rinv = _rms_factor(mv[24], X, rms_eps)
    p0 = _pre_weight(mv, 0, rinv, base, scale, hc_eps)  # every thread, no barrier
    p1 = _pre_weight(mv, 1, rinv, base, scale, hc_eps)
    p2 = _pre_weight(mv, 2, rinv, base, scale, hc_eps)
    p3 = _pre_weight(mv, 3, rinv, base, scale, hc_eps)
    ss = np.float32(0.0)
    for k in range(UNROLL):
        u = np.float32(0.0)  # _u_values' order
        u += p0 * xv[k * 4]
        u += p1 * xv[k * 4 + 1]
        u += p2 * xv[k * 4 + 2]
        u += p3 * xv[k * 4 + 3]
        uk[k] = u
        if tid + k * nt < D:
            out_u[t, tid + k * nt] = u
            ss += u * u
    for k in range(UNROLL):  # in flight during the block sum
        wv[k] = norm_w[min(tid + k * nt, D - 1)]
    inv = _inv_rms(ss, D, rms_eps, scratch, wsum)
    for k in range(UNROLL):
        d = tid + k * nt
        if d < D:
            out_norm[t, d] = uk[k] * inv * wv[k]


# ---- the u block spread over the GPU (decode, HC = 4) ----------------------------------------
# One block making u and its norm is ~20k cycles of one SM (ncu, H100: 12.4 µs, twice a layer
# on the critical path, 2026-12-06 (n)). u = sum_i pre_i X_i is per dim once the four pre
# weights are known, so any block can make its dims; only the norm's sum of squares needs all
# of u. It comes from the streams' Gram matrix G (G_ab = sum_d X_a[d] X_b[d]) instead:
# sum_d u_d^2 = sum_ab pre_a pre_b G_ab, whose partials the split mix adds beside its own (a mix
# block takes the same 32 dims of each stream, so it holds every product's factors).
GRAM = 10  # G's distinct entries at HC = 4: the 4 diagonal ones, then the 6 above it
GRAM_COLS = 32  # dims of each stream a Gram mix block takes (its 4 x 32 flattened columns)
U_ROWS = 5 + GRAM  # partial rows the u kernel adds: the 4 pre mix rows, the sum of squares, G
U_THREADS = 512  # the u kernel's block: a warp for each of its U_ROWS rows, a dim a thread
MAX_PARTS = 8  # rows of f in parts the Gram mix adds (V4's MoE: 6 routed experts + shared)


@cuda.jit(device=True)
def _gram_pair(g):
    """Streams (a, b) of Gram entry g: (0, 0) .. (3, 3), then (0, 1), (0, 2), (0, 3), (1, 2),
    (1, 3), (2, 3)."""
    if g < 4:
        return g, g
    if g < 7:
        return 0, g - 3
    if g < 9:
        return 1, g - 5
    return 2, 3


@cuda.jit(device=True)
def _f_from_parts(f, t, d):
    """f[t, P - 1, d] + f[t, 0, d] + ... + f[t, P - 2, d] (P <= MAX_PARTS): the sublayer output
    from its parts in moe.combine's order (the shared expert's row last in f, first in the
    sum), the P loads issued together; P = 1: f[t, 0, d]."""
    P = f.shape[1]
    fv = cuda.local.array(MAX_PARTS, np.float32)
    for p in range(MAX_PARTS):
        fv[p] = f[t, min(p, P - 1), d]
    acc = fv[0]
    for p in range(1, MAX_PARTS):  # (literal indices: fv stays in registers)
        if p == P - 1:
            acc = fv[p]
    for p in range(MAX_PARTS - 1):
        if p < P - 1:
            acc += fv[p]
    return acc


@device.kernel
def _hc_mix_gram4(part, X, f, X_prev, post, comb, fn, with_post):
    """The decode's split mix at HC = 4 for the spread u (_hc_pre_u_gram4): block (b, t) takes
    dims [32 b, 32 b + 32) of each of the 4 streams (so D / 32 blocks), warp w < M + 1 leaves
    its mix row's partial as _hc_post_mix_split4 does (rows r < M: fn · x; row M: the sum of
    squares), and warp g < GRAM also the partial of Gram entry g in row M + 1 + g. With
    ``with_post`` the block first makes its columns of X[t] = hc_post(f, X_prev, post, comb),
    else it reads them (f, X_prev, post, comb then unused). Every load is issued before the
    first barrier. f [T, P, D]: the sublayer's output in P parts (_f_from_parts; P = 1: whole).
    Block: 32 (M + 1) threads (V4: 800)."""
    xs = cuda.shared.array(MAX_CB, np.float32)
    pc = cuda.shared.array(MAX_PC, np.float32)
    scratch = cuda.shared.array(MAX_THREADS, np.float32)  # (the simulator's warp_sum)
    fv = cuda.local.array(4, np.float32)
    b, t, splits = cuda.blockIdx.x, cuda.blockIdx.y, cuda.gridDim.x
    D = X.shape[2]
    M = fn.shape[0]
    tid = cuda.threadIdx.x
    lane, w = tid % 32, tid // 32
    d = b * GRAM_COLS + lane  # < D: the launcher's grid is D / 32 blocks
    rr = min(w, M - 1)  # (row M, the sum of squares, reads no fn: its loads go unused)
    for k in range(4):
        fv[k] = fn[rr, k * D + d]
    ks = min(w, 3)  # warp ks < 4 makes stream ks's 32 columns
    if with_post:
        fd = _f_from_parts(f, t, d)
        x0, x1, x2, x3 = X_prev[t, 0, d], X_prev[t, 1, d], X_prev[t, 2, d], X_prev[t, 3, d]
        _stage_post_coeffs(pc, post, comb, t)
        if w < 4:
            v = _post4(pc, ks, fd, x0, x1, x2, x3)
            X[t, ks, d] = v
            xs[tid] = v
    elif w < 4:
        xs[tid] = X[t, ks, d]
    cuda.syncthreads()
    acc = _mix_round(np.float32(0.0), xs, fv, lane, 4 * GRAM_COLS, w, M)  # xs[32 k + lane]
    _put_partial(part, acc, scratch, lane, w, M, t, b, splits)
    a, c = _gram_pair(min(w, GRAM - 1))
    g = warp_sum(xs[a * GRAM_COLS + lane] * xs[c * GRAM_COLS + lane], scratch)
    if lane == 0 and w < GRAM:
        part[t, (M + 1 + w) * splits + b] = g


@device.kernel
def _hc_pre_u_gram4(out_u, X, part, base, scale, rms_eps, hc_eps, splits, out_norm, norm_w):
    """HC pre's u and the sublayer's input norm at HC = 4 after _hc_mix_gram4, block (b, t)
    making dims [b nt, (b + 1) nt) of token t (V4: 8 blocks of 512 threads, where one block made
    all 4,096 dims). Its thread's stream values and norm weight are loaded first; warp w <
    U_ROWS adds one partial row over the splits (the 4 pre mix rows, the sum of squares, the
    10 Gram entries); then every thread makes the pre weights (_pre_weight's arithmetic),
    sum_d u_d^2 = pre^T G pre in float64 (the norm's 1 / rms; the bits differ from a sum over u
    by rounding, not by more: pre > 0 and the streams are not opposed in practice, so its
    terms hardly cancel), and its dim's u and normed u."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)  # (the simulator's warp_sum)
    mv = cuda.shared.array(U_ROWS, np.float32)
    b, t = cuda.blockIdx.x, cuda.blockIdx.y
    D = X.shape[2]
    M = 24  # (2 + 4) * 4 mix rows
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    lane, w = tid % 32, tid // 32
    d = min(b * nt + tid, D - 1)
    x0, x1, x2, x3 = X[t, 0, d], X[t, 1, d], X[t, 2, d], X[t, 3, d]
    wd = norm_w[d]
    r = w if w < 4 else M + min(w, U_ROWS - 1) - 4  # warp 4: the squares, 5 ..: G
    acc = warp_sum(_lane_row_sum(part, t, r, splits, lane), scratch)
    if lane == 0 and w < U_ROWS:
        mv[w] = acc
    cuda.syncthreads()
    rinv = _rms_factor(mv[4], X, rms_eps)
    p0 = _pre_weight(mv, 0, rinv, base, scale, hc_eps)
    p1 = _pre_weight(mv, 1, rinv, base, scale, hc_eps)
    p2 = _pre_weight(mv, 2, rinv, base, scale, hc_eps)
    p3 = _pre_weight(mv, 3, rinv, base, scale, hc_eps)
    q0, q1, q2, q3 = np.float64(p0), np.float64(p1), np.float64(p2), np.float64(p3)
    ss = (q0 * q0 * mv[5] + q1 * q1 * mv[6] + q2 * q2 * mv[7] + q3 * q3 * mv[8]
          + 2.0 * (q0 * (q1 * mv[9] + q2 * mv[10] + q3 * mv[11])
                   + q1 * (q2 * mv[12] + q3 * mv[13]) + q2 * q3 * mv[14]))
    inv = np.float32(1.0 / math.sqrt(max(ss, 0.0) / D + rms_eps))
    u = np.float32(0.0)  # _u_values' order
    u += p0 * x0
    u += p1 * x1
    u += p2 * x2
    u += p3 * x3
    if b * nt + tid < D:
        out_u[t, d] = u
        out_norm[t, d] = u * inv * wd


@device.kernel
def _hc_pre_finish_u(out_u, X, part, base, scale, rms_eps, hc_eps, splits, out_norm, norm_w):
    """One block per token: gather the partials (part, not parked in out_u), then only the pre
    weights and u = sum_i pre_i X_i; post and comb come from _hc_pre_finish_post. With a norm
    weight (norm_w not empty) the block also writes out_norm[t] = rmsnorm(u) * norm_w, the
    sublayer's input norm: one launch less on the decode's critical path. Where the block
    covers D in one round (the decode launches V4's D = 4096 with 1024 threads), the norm takes
    u from registers (``_collapse_norm``), else it reads u back (``norm_row``)."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    wsum = cuda.shared.array(32, np.float32)
    mv = cuda.shared.array(MAX_ROWS1, np.float32)
    pre = cuda.shared.array(MAX_HC, np.float32)
    t = cuda.blockIdx.x
    hc, D = X.shape[1], X.shape[2]
    _gather_partials(mv, part, t, (2 + hc) * hc + 1, splits, scratch)
    _pre_weights(pre, X, mv, base, scale, rms_eps, hc_eps)
    if norm_w.shape[0] > 0 and D <= UNROLL * cuda.blockDim.x:
        if hc == 4:
            _collapse_norm(out_u, out_norm, norm_w, X, pre, t, 4, rms_eps, scratch, wsum)
        else:
            _collapse_norm(out_u, out_norm, norm_w, X, pre, t, hc, rms_eps, scratch, wsum)
        return
    _collapse_pre(out_u, X, pre, t)
    if norm_w.shape[0] > 0:
        cuda.syncthreads()  # the block's writes of out_u[t] are visible to all its threads
        norm_row(out_norm, out_u, norm_w, t, rms_eps, True, scratch, wsum)


@device.kernel
def _hc_pre_finish_post(out_post, out_comb, X, part, base, scale, rms_eps, hc_eps, iters,
                        splits):
    """One block per token: gather the partials, then post and the Sinkhorn comb (one thread)."""
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    mv = cuda.shared.array(MAX_ROWS1, np.float32)
    t = cuda.blockIdx.x
    hc = X.shape[1]
    M = (2 + hc) * hc
    _gather_partials(mv, part, t, M + 1, splits, scratch)
    if cuda.threadIdx.x == 0:
        rinv = _rms_factor(mv[M], X, rms_eps)
        _post_comb(out_post, out_comb, mv, rinv, base, scale, hc_eps, iters, t)


@device.kernel
def _hc_head_finish(out_u, X, base, scale, rms_eps, hc_eps, splits):
    scratch = cuda.shared.array(MAX_THREADS, np.float32)
    mv = cuda.shared.array(MAX_HC1, np.float32)
    pre = cuda.shared.array(MAX_HC, np.float32)
    t = cuda.blockIdx.x
    hc = X.shape[1]
    _gather_partials(mv, out_u, t, hc + 1, splits, scratch)
    rinv = _rms_factor(mv[hc], X, rms_eps)
    tid = cuda.threadIdx.x
    if tid < hc:
        pre[tid] = _pre_weight(mv, tid, rinv, base, scale, hc_eps)
    cuda.syncthreads()
    if hc == 4:
        _collapse(out_u, X, pre, t, 4)
    else:
        _collapse(out_u, X, pre, t, hc)


@cuda.jit(device=True)
def _post_column(out, f, X, pc, t, d, n):
    """out[t, k, d] = post[k] f[t, d] + sum_j comb[j, k] X[t, j, d], k < n (pc = comb, post)."""
    xv = cuda.local.array(MAX_HC, np.float32)
    fv = f[t, d]
    for j in range(n):
        xv[j] = X[t, j, d]
    for k in range(n):
        acc = pc[n * n + k] * fv
        for j in range(n):
            acc += pc[j * n + k] * xv[j]
        out[t, k, d] = acc


@device.kernel
def _hc_post_streams(out, f, X, post, comb):
    """Thread per (t, d) computing all HC outputs from one read of the HC + 1 inputs; the
    token's comb and post staged in shared memory."""
    pc = cuda.shared.array(MAX_PC, np.float32)
    T, hc, D = out.shape
    t = cuda.blockIdx.y
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    _stage_post_coeffs(pc, post, comb, t)
    for d in range(cuda.blockIdx.x * nt + tid, D, cuda.gridDim.x * nt):
        if hc == 4:
            _post_column(out, f, X, pc, t, d, 4)
        else:
            _post_column(out, f, X, pc, t, d, hc)


# ---- launchers -----------------------------------------------------------------------------------
def _split_plan(D: int, hc: int, rows: int):
    """(cb, splits) for the mix: 128 columns per block where the partials of a token
    ((rows + 1) * splits floats) fit in its out_u row, wider blocks where not; None: too small
    a D to park them (the launcher then runs the naive kernel)."""
    cb = 128
    while cb <= MAX_CB:
        splits = cdiv(hc * D, cb)
        if (rows + 1) * splits <= D:
            return cb, splits
        cb *= 2
    return None


def _mix_chunk(part, X2, fn, stream) -> None:
    """Launch _hc_mix_chunk: part [S, T, M+1] <- the column slices' partials of X2 [T, C]."""
    T = X2.shape[0]
    grid = (cdiv(T, MIX_WARPS * MIX_TOKENS), part.shape[0])
    _mix_chunk_kernel(fn.shape[0])[grid, 32 * MIX_WARPS, stream](part, X2, fn)


def _finish_threads(D: int, threads=None) -> int:
    """Block size of the finish kernels: UNROLL u values a thread, at most FINISH_THREADS."""
    return _threads(threads, min(FINISH_THREADS, 32 * cdiv(D // UNROLL, 32)))


def _u_threads(args, D: int, threads=None) -> int:
    """Block size of _hc_pre_finish_u: D in one round, UNROLL u values a thread (V4: 1024
    threads, which also gives each of its 25 partial rows a warp of its own), where the compiled
    kernel's registers allow that many (sm_90: 64, exactly a 1,024-thread block's share; with
    more it would fall back, so REGISTER_BUDGETS holds it to 64 in CI), else _finish_threads'."""
    if threads:
        return _threads(threads, 0)
    nt = min(MAX_THREADS, 32 * cdiv(D // UNROLL, 32))
    return nt if device.resident_blocks(_hc_pre_finish_u, args, nt) else _finish_threads(D)


def _threads(threads, default):
    nt = threads or default
    assert nt % 32 == 0 and nt <= MAX_THREADS, "block size: a multiple of 32, at most 1024"
    return nt


def _mix(dest, X, fn, rows, stream, threads, post_from=None, prefetch=False):
    """Launch the split mix into ``dest`` (out_u, where the partials are parked, or a
    workspace); returns the split count, or None when D is too small for it. ``post_from``
    (f, X_prev, post, comb): X is first made as hc_post of them, in the same launch
    (``prefetch``: by the candidate _hc_post_mix_split4 where it applies)."""
    T, hc, D = X.shape
    plan = _split_plan(D, hc, rows)
    if plan is None:
        return None
    cb, splits = plan
    nt = _threads(threads, min(MAX_THREADS, 32 * (rows + 1)))
    if post_from is None:
        _hc_mix_split[(splits, T), nt, stream](dest, X, fn, cb)
    else:
        assert nt >= hc * hc + hc
        fits = hc == 4 and cb <= 32 * UNROLL and cb <= nt and nt >= 32 * (rows + 1)
        kern = _hc_post_mix_split4 if prefetch and fits else _hc_post_mix_split
        kern[(splits, T), nt, stream](dest, X, *post_from, fn, cb)
    return splits


def gram_path(X, side, norm, u_gram: bool, naive: bool = False, mix=None) -> bool:
    """Whether hc_pre on streams X [T, HC, D] with these arguments takes the Gram path
    (_hc_mix_gram4, _hc_pre_u_gram4), where post_from's f may come in parts."""
    T, hc, D = X.shape
    return bool(u_gram and side is not None and norm is not None and not naive and mix is None
                and hc == 4 and D % GRAM_COLS == 0
                and _split_plan(D, hc, (2 + hc) * hc) is not None)


def _mix_gram(part, X, fn, stream, post_from=None) -> None:
    """Launch _hc_mix_gram4 (HC = 4, D a multiple of GRAM_COLS): part [T, (M + 1 + GRAM) *
    D / 32] <- the mix, squares and Gram partials of X, first made as hc_post of
    ``post_from`` (f, X_prev, post, comb) when given; f [T, D], or [T, P, D] in parts."""
    T, _, D = X.shape
    M = fn.shape[0]
    f, X_prev, post, comb = post_from or (X, X, part, X)  # (unread without a post)
    if f.ndim == 2:  # whole: one part
        f = f.reshape(T, 1, D)
    _hc_mix_gram4[(D // GRAM_COLS, T), 32 * (M + 1), stream](part, X, f, X_prev, post, comb, fn,
                                                              int(post_from is not None))


def hc_pre(out_u, out_post, out_comb, X, fn, base, scale, rms_eps, hc_eps, iters, stream=0,
           threads=None, naive=False, mix=None, side=None, norm=None, post_from=None,
           u_threads=None, u_prefetch: bool = False, mix_prefetch: bool = False,
           u_gram: bool = False) -> None:
    """Launcher: out_u [T, D], out_post [T, HC], out_comb [T, HC, HC], X [T, HC, D], fn [M, C],
    base [M], scale [3], all float32 device arrays; out_u must not alias X.

    ``mix`` float32 hc_mix_shape(T, HC) (a prefill chunk's workspace): the mix runs as one
    GEMM over the chunk (_hc_mix_chunk, float32 on the CUDA cores), reading fn once a token
    group instead of once a token (H200, 2,048 tokens: 6 ms per call with the split mix).

    ``side`` (a device.SideStream; decode): post and comb, the Sinkhorn's serial chain of
    2·iters normalisations, are made on the side stream while ``stream`` goes on with u and
    the sublayer (they are only read by hc_post after it): the caller joins the side stream
    before hc_post, and before the next hc_pre (its mix rewrites the partials).

    ``norm`` (out_norm [T, D], w [D]): also out_norm = rmsnorm(u) * w at eps rms_eps (the
    sublayer's input norm); with ``side`` or ``mix`` in the same launch as u, else a launch
    after.

    ``post_from`` (f, X_prev, post, comb): the previous sublayer's HC post is still to be done;
    X is first written as hc_post(X, f, X_prev, post, comb). With ``side`` that is the mix's
    own launch (the decode: one launch fewer a sublayer), else an hc_post launch before.

    ``u_threads`` (with ``side``): the block size of _hc_pre_finish_u instead of its own choice
    (``_u_threads``); an A/B of the decode step. The kernels that issue their loads first (with
    ``side``, HC = 4; the decode engine's choice, H100: −3% a step): ``u_prefetch``,
    _hc_pre_finish_u4 (with ``norm``, D within one round of the u block); ``mix_prefetch``,
    _hc_post_mix_split4 (with ``post_from``). ``u_gram`` (with ``side`` and ``norm``, HC = 4,
    D a multiple of 32; the decode engine's choice): the split mix also leaves the streams'
    Gram partials (_hc_mix_gram4) and u with its norm is made by D / 512 blocks
    (_hc_pre_u_gram4) instead of one; u_threads, u_prefetch and mix_prefetch then do not
    apply. On that path (``gram_path``) post_from's f may also be [T, P, D], the sublayer's
    output in P parts (moe_layer without ``out``), added by the mix."""
    T, hc, D = X.shape
    M = fn.shape[0]
    assert hc <= MAX_HC and M == (2 + hc) * hc
    eps = (np.float32(rms_eps), np.float32(hc_eps), int(iters))
    nf = _finish_threads(D, threads)
    plan = None if naive else _split_plan(D, hc, M)
    gram = gram_path(X, side, norm, u_gram, naive, mix)
    if post_from is not None and post_from[0].ndim == 3 and not gram:
        raise ValueError("hc_pre: post_from's f in parts [T, P, D] needs the Gram path "
                         "(gram_path)")
    if post_from is not None and post_from[0].ndim == 3 and post_from[0].shape[1] > MAX_PARTS:
        raise ValueError(f"hc_pre: post_from's f in {post_from[0].shape[1]} parts, at most "
                         f"{MAX_PARTS}")
    if post_from is not None and (side is None or plan is None or mix is not None):
        hc_post(X, *post_from, stream, threads, naive=naive)
        post_from = None
    if mix is not None:  # a chunk: the mix as one GEMM, fn read once a token group
        if mix.shape[1:] != hc_mix_shape(T, hc)[1:]:
            raise ValueError(f"hc_pre: mix workspace {mix.shape}, need [S, {T}, {M + 1}]")
        _mix_chunk(mix, X.reshape(T, hc * D), fn, stream)
        out_norm, norm_w = norm or (out_u, device.empty_vector(np.float32))
        _hc_pre_finish_mix[T, nf, stream](out_u, out_post, out_comb, X, mix, base, scale, *eps,
                                          out_norm, norm_w)
        return
    if side is not None and plan is not None:
        if gram:
            splits = D // GRAM_COLS
            part = device.stream_buffer("hc_pre partials", stream,
                                        (T, (M + 1 + GRAM) * splits), np.float32)
            _mix_gram(part, X, fn, stream, post_from)
        else:
            part = device.stream_buffer("hc_pre partials", stream, (T, (M + 1) * plan[1]),
                                        np.float32)
            splits = _mix(part, X, fn, M, stream, threads, post_from, mix_prefetch)
        _hc_pre_finish_post[T, 128, side.fork(stream)](out_post, out_comb, X, part, base, scale,
                                                       *eps, splits)
        out_norm, norm_w = norm or (out_u, device.empty_vector(np.float32))
        args = (out_u, X, part, base, scale, *eps[:2], splits, out_norm, norm_w)
        if gram:
            _hc_pre_u_gram4[(cdiv(D, U_THREADS), T), U_THREADS, stream](*args)
            return
        nt = _u_threads(args, D, u_threads or threads)
        if u_prefetch and hc == 4 and norm is not None and D <= UNROLL * nt:
            _hc_pre_finish_u4[T, nt, stream](*args)
        else:
            _hc_pre_finish_u[T, nt, stream](*args)
        return
    splits = None if naive else _mix(out_u, X, fn, M, stream, threads)
    if splits is None:
        _hc_pre_naive[cdiv(T, 32), 32, stream](out_u, out_post, out_comb, X, fn, base, scale,
                                               *eps)
    else:
        _hc_pre_finish[T, nf, stream](out_u, out_post, out_comb, X, base, scale, *eps, splits)
    if norm is not None:
        rmsnorm(norm[0], out_u, norm[1], rms_eps, True, stream, threads, naive=naive)


def hc_head(out_u, X, fn, base, scale, rms_eps, hc_eps, stream=0, threads=None,
            naive=False) -> None:
    """Launcher: out_u [T, D], X [T, HC, D], fn [HC, C], base [HC], scale [1] (float32)."""
    T, hc, D = X.shape
    assert hc <= MAX_HC and fn.shape[0] == hc
    eps = (np.float32(rms_eps), np.float32(hc_eps))
    splits = None if naive else _mix(out_u, X, fn, hc, stream, threads)
    if splits is None:
        _hc_head_naive[cdiv(T, 32), 32, stream](out_u, X, fn, base, scale, *eps)
        return
    nf = _finish_threads(D, threads)
    _hc_head_finish[T, nf, stream](out_u, X, base, scale, *eps, splits)


def hc_post(out, f, X, post, comb, stream=0, threads=None, naive=False) -> None:
    """Launcher: out [T, HC, D] (not aliasing X), f [T, D], X [T, HC, D], post [T, HC],
    comb [T, HC, HC] (float32)."""
    T, hc, D = X.shape
    assert hc <= MAX_HC
    nt = _threads(threads, 256)
    if naive:
        _hc_post_naive[cdiv(T * hc * D, nt), nt, stream](out, f, X, post, comb)
        return
    assert nt >= hc * hc + hc
    # a prefill chunk's thousands of tokens: one block a token, its threads striding over D
    # (a block per nt columns made 32,768 blocks of one column a thread at 2,048 tokens, each
    # staging the coefficients and meeting a barrier for 5 loads: ~183 us on the H200 for
    # 300 MB, 2026-12-04 (c)); a few tokens (the decode): blocks over D
    gx = max(1, min(cdiv(D, nt), POST_BLOCKS // T))
    _hc_post_streams[(gx, T), nt, stream](out, f, X, post, comb)


# ---- CI lane B and the H200 benchmark -----------------------------------------------------------
# ptx_check fails a kernel over its budget: _u_threads gives the u block 1,024 threads only while
# the kernel fits 64 registers (H100 decode step: −1.6% against 512, 2026-12-05 (i))
REGISTER_BUDGETS = {_hc_pre_finish_u: (64, "hc._u_threads: 1,024 threads a block"),
                    _hc_mix_gram4: (80, "hc._mix_gram: 32 (M + 1) = 800 threads a block")}
_F1, _F2, _F3 = "float32[::1]", "float32[:, ::1]", "float32[:, :, ::1]"
_PRE_OUT = f"{_F2}, {_F2}, {_F3}"
PTX_SIGNATURES = [
    (_hc_pre_naive,
     f"void({_PRE_OUT}, {_F3}, {_F2}, {_F1}, {_F1}, float32, float32, int64)"),
    (_hc_head_naive, f"void({_F2}, {_F3}, {_F2}, {_F1}, {_F1}, float32, float32)"),
    (_hc_post_naive, f"void({_F3}, {_F2}, {_F3}, {_F2}, {_F3})"),
    (_hc_mix_split, f"void({_F2}, {_F3}, {_F2}, int64)"),
    (_hc_post_mix_split, f"void({_F2}, {_F3}, {_F2}, {_F3}, {_F2}, {_F3}, {_F2}, int64)"),
    (_hc_post_mix_split4, f"void({_F2}, {_F3}, {_F2}, {_F3}, {_F2}, {_F3}, {_F2}, int64)"),
    (_hc_pre_finish,
     f"void({_PRE_OUT}, {_F3}, {_F1}, {_F1}, float32, float32, int64, int64)"),
    (_hc_pre_finish_mix,
     f"void({_PRE_OUT}, {_F3}, {_F3}, {_F1}, {_F1}, float32, float32, int64, {_F2}, {_F1})"),
    (_mix_chunk_kernel(24), f"void({_F3}, {_F2}, {_F2})"),  # V4: HC = 4
    (_hc_pre_finish_u,
     f"void({_F2}, {_F3}, {_F2}, {_F1}, {_F1}, float32, float32, int64, {_F2}, {_F1})"),
    (_hc_pre_finish_u4,
     f"void({_F2}, {_F3}, {_F2}, {_F1}, {_F1}, float32, float32, int64, {_F2}, {_F1})"),
    (_hc_mix_gram4, f"void({_F2}, {_F3}, {_F3}, {_F3}, {_F2}, {_F3}, {_F2}, int64)"),
    (_hc_pre_u_gram4,
     f"void({_F2}, {_F3}, {_F2}, {_F1}, {_F1}, float32, float32, int64, {_F2}, {_F1})"),
    (_hc_pre_finish_post,
     f"void({_F2}, {_F3}, {_F3}, {_F2}, {_F1}, {_F1}, float32, float32, int64, int64)"),
    (_hc_head_finish, f"void({_F2}, {_F3}, {_F1}, {_F1}, float32, float32, int64)"),
    (_hc_post_streams, f"void({_F3}, {_F2}, {_F3}, {_F2}, {_F3})"),
]


def _chunk_cases(stream, T: int = 2048):
    """The prefill's HC over a T-token chunk: hc_post, the mix kernel alone, the F32 GEMM it
    replaced (gemv: mma.py's split kernel on a GPU), and mix + finish as the engine runs them."""
    rng = np.random.default_rng(1)
    hc, D = 4, 4096
    M, C = (2 + hc) * hc, hc * D

    def dev(a):
        return device.to_device(np.ascontiguousarray(a, np.float32), stream)

    X, fn = dev(rng.standard_normal((T, hc, D))), dev(rng.standard_normal((M, C)) * 0.01)
    base, scale = dev(rng.standard_normal(M)), dev(rng.uniform(0.5, 2, 3))
    u, post, comb = dev(np.zeros((T, D))), dev(np.zeros((T, hc))), dev(np.zeros((T, hc, hc)))
    mix, gemm_out = dev(np.zeros(hc_mix_shape(T, hc))), dev(np.zeros((T, M)))

    def as_gemm():
        gemv(gemm_out, QWeight(GGMLType.F32, M, C, 1, (fn.reshape(1, M, C),)), X.reshape(T, C),
             None, stream)

    x_bytes, fl = T * C * 4, 2 * M * C * T
    f, Xn = dev(rng.standard_normal((T, D))), dev(np.zeros((T, hc, D)))
    return [BenchCase("hc", f"hc_post T={T} (prefill chunk)",
                      lambda: hc_post(Xn, f, X, post, comb, stream),
                      bytes=2 * x_bytes + T * D * 4, flops=2 * (hc + 1) * C * T),
            BenchCase("hc", f"hc mix T={T} (prefill chunk) _hc_mix_chunk",
                      lambda: _mix_chunk(mix, X.reshape(T, C), fn, stream),
                      bytes=M * C * 4 + x_bytes, flops=fl),
            BenchCase("hc", f"hc mix T={T} (prefill chunk) as an F32 GEMM (gemv, before)",
                      as_gemm, bytes=M * C * 4 + x_bytes, flops=fl),
            BenchCase("hc", f"hc_pre T={T} (prefill chunk) mix + finish",
                      lambda: hc_pre(u, post, comb, X, fn, base, scale, 1e-6, 1e-6, 20, stream,
                                     mix=mix),
                      bytes=M * C * 4 + 2 * x_bytes + T * D * 4, flops=fl)]


def bench_cases(stream):
    """V4-Flash decode: T = 1, HC = 4, D = 4096, fn 24 x 16384 float32 (head: 4 x 16384); and
    the prefill's HC pre over a 2,048-token chunk (_chunk_cases)."""
    rng = np.random.default_rng(0)
    T, hc, D = 1, 4, 4096
    M, C = (2 + hc) * hc, hc * D

    def dev(a):
        return device.to_device(np.ascontiguousarray(a, np.float32), stream)

    X = dev(rng.standard_normal((T, hc, D)))
    fn, fnh = dev(rng.standard_normal((M, C)) * 0.01), dev(rng.standard_normal((hc, C)) * 0.01)
    base, baseh = dev(rng.standard_normal(M)), dev(rng.standard_normal(hc))
    scale, scaleh = dev(rng.uniform(0.5, 2, 3)), dev(rng.uniform(0.5, 2, 1))
    u, post, comb = dev(np.zeros((T, D))), dev(np.zeros((T, hc))), dev(np.zeros((T, hc, hc)))
    f, Xn = dev(rng.standard_normal((T, D))), dev(np.zeros((T, hc, D)))
    x_bytes = T * C * 4
    side = device.SideStream()
    part = dev(np.zeros((T, (M + 1) * _split_plan(D, hc, M)[1])))
    nf = _finish_threads(D)

    def pre_side():  # as the decode engine runs it (joined at the end here)
        hc_pre(u, post, comb, X, fn, base, scale, 1e-6, 1e-6, 20, stream, side=side)
        side.join(stream)

    def u_path():  # what stays on the engine's main stream: the mix, then u
        splits = _mix(part, X, fn, M, stream, None)
        _hc_pre_finish_u[T, nf, stream](u, X, part, base, scale, np.float32(1e-6),
                                        np.float32(1e-6), splits, u,
                                        device.empty_vector(np.float32))

    def post_then_pre(**how):  # the decode's sublayer boundary: the last post inside the mix
        hc_pre(u, post, comb, Xn, fn, base, scale, 1e-6, 1e-6, 20, stream, side=side,
               post_from=(f, X, post, comb), norm=(un, w), **how)
        side.join(stream)

    un, w = dev(np.zeros((T, D))), dev(rng.uniform(0.5, 2, D))

    cases = [BenchCase("hc", "hc_pre T=1 side stream (post + Sinkhorn beside u), joined",
                       pre_side, bytes=M * C * 4 + x_bytes + T * D * 4, flops=2 * M * C * T),
             *[BenchCase("hc", f"hc_pre T=1 side stream, the previous hc_post in its mix "
                         f"launch, the norm, {name}",
                         lambda how=how: post_then_pre(**how),
                         bytes=M * C * 4 + 3 * x_bytes + 4 * T * D * 4,
                         flops=2 * M * C * T + 2 * (hc + 1) * C * T)
               for name, how in (("u by one block", dict(u_prefetch=True, mix_prefetch=True)),
                                 ("u spread (Gram partials)", dict(u_gram=True)))],
             BenchCase("hc", "hc_pre T=1 main-stream part only (mix + u)", u_path,
                       bytes=M * C * 4 + x_bytes + T * D * 4, flops=2 * M * C * T)]
    for naive in (False, True):
        sfx = " naive" if naive else ""
        cases += [
            BenchCase("hc", "hc_pre T=1 D=4096 fn 24x16384" + sfx,
                      lambda nv=naive: hc_pre(u, post, comb, X, fn, base, scale, 1e-6, 1e-6, 20,
                                              stream, naive=nv),
                      bytes=M * C * 4 + x_bytes + T * D * 4, flops=2 * M * C * T),
            BenchCase("hc", "hc_head T=1 D=4096 fn 4x16384" + sfx,
                      lambda nv=naive: hc_head(u, X, fnh, baseh, scaleh, 1e-6, 1e-6, stream,
                                               naive=nv),
                      bytes=hc * C * 4 + x_bytes + T * D * 4, flops=2 * hc * C * T),
            BenchCase("hc", "hc_post T=1 D=4096" + sfx,
                      lambda nv=naive: hc_post(Xn, f, X, post, comb, stream, naive=nv),
                      bytes=2 * x_bytes + T * D * 4, flops=2 * (hc + 1) * C * T),
        ]
    return cases + _chunk_cases(stream)
