"""The Q2_K decode GEMV on the int8 tensor cores: out[T, N] = W[ids[t]] · x[t] (or W · x[t]) for a
packed Q2_K weight (gemv_lowbit's planes, unchanged), by imma.py's ``mma.sync.m16n8k32`` .s8;
with ``gemv_swiglu`` x is the SwiGLU of the MoE's gate|up output, made in the x preparation (the
routed experts' down projection at decode, 6 of 256 experts of 4096 x 2048).

Why Q2_K suits the MMA better than IQ2_XXS (imma.py): a weight is d · sc · q - dmin · m, q in
0..3, sc and m 4-bit per 16-column sub-block, d and dmin float16 per 256-column super-block. So
- A is q · sc, at most 45: the sub-block scale goes into the codes (two multiplies a lane and
  row: a byte times sc carries into no other byte), and no table is read;
- with x scaled per super-block, the MMA's int32 C runs through the super-block's 8 groups
  (|C| < 2^31: 8 groups x 32 columns x 45 x 127 x 256 < 2^29) and is converted once;
- the mins term is dmin · s · Σ m · Σq over the 16 sub-blocks, the integer column sums Σq of
  x made by the x preparation; the quad's 4 lanes take 4 sub-blocks each.

Operands as in imma.py (lane = 4 g + c holds rows g and g + 8 at the group's columns 8c ..
8c+7; B columns: x's hi bytes at even, lo at odd). Q2_K's 64 code bytes of a super-block hold
groups 4n + j (n = 0, 1; j = 0..3) at bits 2j of bytes 32n .. 32n+31, so a lane's 8 columns of
group 4n + j are 2-bit fields of the uint64 qs word 4n + c; their sub-block is 8n + 2j + u, u =
c >> 1, whose scale and min are byte j of the sc word 2n + u (gemv_lowbit's reordered scales).

x preparation: q = round(x / s), |q| <= 32000, s = max|x| / 32000 per 256 columns (one warp a
super-block), q = 256 hi + lo as two signed byte planes (imma.py), and the sums of q per
16-column sub-block, in the order a lane reads them: for sub-block 8n + 2j + u at 4 (2n + u) + j.

Block: WARPS warps on a tile of 16 rows split K by super-blocks (warp w: w, w + nw, ..); each
lane loads its rows' qs words and scale words directly (8 rows x 32 contiguous bytes an
instruction), a super-block ahead. Blocks loop over the tiles of their token, as in imma.py.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from ..quants import GGMLType
from .bench import BenchCase
from .device import SIMULATOR, cdiv, kernel, resident_blocks, stream_buffer, xor_shfl
from .gemv_lowbit import swiglu_scalar
from .imma import (ROWS, WARPS, XCH, _mma_s8_acc, graph_cases, hi_lo_bytes, quad_sums,
                   routed_setup, tile_out, tile_thread)
from .qweight import QWeight

SUPER = 256  # columns a super-block (a scale of x; the MMA's C runs through it)
PREP_THREADS = 128  # x preparation: 4 warps, a warp a super-block (8 columns a thread)
SHF = PREP_THREADS if SIMULATOR else 1  # simulator lane exchanges (a float32 a thread)
LOW2 = 0x0303030303030303  # the low 2 bits of each byte


# ---- kernels -------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _load_super(qw, sw, dm, qs, sc, dmp, e, n0, sb, N, g, c):
    """Request super-block sb of expert e's rows n0 + g and n0 + g + 8: their qs words c and
    4 + c (qw[2 r + n]), scale words u and 2 + u, u = c >> 1 (sw[2 r + n]), and d, dmin
    (dm[2 r], dm[2 r + 1]); rows past N read the last."""
    for r in range(2):
        n = min(n0 + g + 8 * r, N - 1)
        for h in range(2):
            qw[2 * r + h] = qs[e, n, 8 * sb + 4 * h + c]
            sw[2 * r + h] = sc[e, n, 4 * sb + 2 * h + (c >> 1)]
        dm[2 * r] = float32(dmp[e, n, 2 * sb])
        dm[2 * r + 1] = float32(dmp[e, n, 2 * sb + 1])


@cuda.jit(device=True)
def _codes(word, j, scw):
    """The lane's 8 columns of group j of a half as q · sc bytes (two uint32): the 2-bit fields
    at bits 2j of ``word``'s bytes times the sub-block's scale (the low nibble of byte j of the
    scale word ``scw``)."""
    q = (word >> uint64(2 * j)) & uint64(LOW2)
    s = (scw >> uint32(8 * j)) & uint32(15)
    return (uint32(uint32(q & uint64(0xFFFFFFFF)) * s),
            uint32(uint32(q >> uint64(32)) * s))


def gemv_q2_k_imma_tiles(out, qs, sc, dmp, xq, xs, xsum, ids, nw):
    # grid (row blocks, T): block (a, b) loops over the row tiles a, a + gridDim.x, .. of token
    # b; nw warps (blockDim = 32 nw) take the super-blocks w, w + nw, .. of every row.
    N = out.shape[1]
    S = qs.shape[2] // 8  # super-blocks a row
    w, lane, g, c, b, e, bx = tile_thread(ids, xs, S)
    per_warp = S // nw
    tiles_n = (N + ROWS - 1) // ROWS
    red = cuda.shared.array((WARPS, ROWS), float32)
    xch = cuda.shared.array(XCH, uint64)
    shf = cuda.shared.array(SHF, float32)
    qw = cuda.local.array(4, uint64)  # [row g / g + 8, half n]
    sw = cuda.local.array(4, uint32)
    dm = cuda.local.array(4, float32)  # d, dmin of rows g, g + 8
    nq = cuda.local.array(4, uint64)  # the next super-block's, in flight
    ns = cuda.local.array(4, uint32)
    nd = cuda.local.array(4, float32)
    mine = c & 1  # the half whose 4 sub-blocks' mins this lane sums
    xrow = uint32((2 * bx + (g & 1)) * 32 * S + c)  # B: this lane's x bytes (plane g & 1)
    tn = cuda.blockIdx.x
    if tn < tiles_n:
        _load_super(nq, ns, nd, qs, sc, dmp, e, tn * ROWS, w, N, g, c)
    while tn < tiles_n:
        acc0 = float32(0)
        acc1 = float32(0)
        for j in range(per_warp):
            sb = w + j * nw
            for i in range(4):
                qw[i] = nq[i]
                sw[i] = ns[i]
                dm[i] = nd[i]
            if j + 1 < per_warp:  # the next super-block's words in flight during this one
                _load_super(nq, ns, nd, qs, sc, dmp, e, tn * ROWS, sb + nw, N, g, c)
            elif tn + cuda.gridDim.x < tiles_n:
                _load_super(nq, ns, nd, qs, sc, dmp, e, (tn + cuda.gridDim.x) * ROWS, w, N, g,
                            c)
            xr = xq[xrow + uint32(32 * sb):]  # the super-block's 8 groups, 4 words each
            c0 = int32(0)
            c1 = int32(0)
            c2 = int32(0)
            c3 = int32(0)
            for h in range(2):
                for k in range(4):
                    a0, a2 = _codes(qw[h], k, sw[h])
                    a1, a3 = _codes(qw[2 + h], k, sw[2 + h])
                    bv = xr[4 * (4 * h + k)]
                    c0, c1, c2, c3 = _mma_s8_acc(a0, a1, a2, a3, uint32(bv & uint64(0xFFFFFFFF)),
                                                 uint32(bv >> uint64(32)), c0, c1, c2, c3, xch)
            # mins: sub-blocks 8 mine + 2k + u (k = 0..3) of both rows, against their Σq
            u = c >> 1
            m0 = int32(0)
            m8 = int32(0)
            sm0 = sw[1] if mine else sw[0]  # (a select: an index by lane would go to memory)
            sm8 = sw[3] if mine else sw[2]
            for k in range(4):
                qsum = xsum[uint32(bx * 16 * S + 16 * sb + 4 * (2 * mine + u) + k)]
                m0 = int32(m0 + int32((sm0 >> uint32(8 * k + 4)) & uint32(15)) * qsum)
                m8 = int32(m8 + int32((sm8 >> uint32(8 * k + 4)) & uint32(15)) * qsum)
            s = xs[uint32(bx * S + sb)]
            first = float32(1) if c == 0 else float32(0)  # C is the same on the quad's lanes
            acc0 += s * (first * dm[0] * float32(int32(c0 * int32(256) + c1))
                         - dm[1] * float32(m0))
            acc1 += s * (first * dm[2] * float32(int32(c2 * int32(256) + c3))
                         - dm[3] * float32(m8))
        # the quad's mins partials, then the warps' sums
        acc0, acc1 = quad_sums(acc0, acc1, shf)
        tile_out(out, red, acc0, acc1, b, tn * ROWS, nw, float32(1), 0)
        tn += cuda.gridDim.x


@cuda.jit(device=True)
def _quantise(xq, xs, xsum, b, i, K, v, shf):
    # thread i of row b holds columns 8i .. 8i+7 of x in v; a warp is a super-block (every
    # thread takes part in the butterflies: those past K / 8 on a copy, storing nothing)
    a = float32(0)
    for k in range(8):
        a = max(a, abs(v[k]))
    for off in (16, 8, 4, 2, 1):
        a = max(a, xor_shfl(a, off, shf))
    hw, lw, qsum = hi_lo_bytes(v, float32(32000) / a if a > 0 else float32(0))
    qsum += xor_shfl(qsum, 1, shf)  # the sub-block's 16 columns (exact: |Σq| < 2^24)
    if i < K // 8:
        xq[(2 * b) * (K // 8) + i] = hw
        xq[(2 * b + 1) * (K // 8) + i] = lw
        sub = (i % 32) // 2  # sub-block 8n + 2j + u of the super-block, stored at 4(2n+u) + j
        if i % 2 == 0:
            at = 4 * (2 * (sub >> 3) + (sub & 1)) + ((sub >> 1) & 3)
            xsum[b * (K // 16) + (i // 32) * 16 + at] = int32(qsum)
        if i % 32 == 0:
            xs[b * (K // SUPER) + i // 32] = a / float32(32000)


def x_q2_k_imma(xq, xs, xsum, x):
    # grid (K / 8 / threads, T): thread i makes columns 8i .. 8i+7 of x[b]
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    K = x.shape[1]
    shf = cuda.shared.array(SHF, float32)
    c0 = 8 * i if i < K // 8 else 0
    v = cuda.local.array(8, float32)
    for k in range(8):
        v[k] = x[b, c0 + k]
    _quantise(xq, xs, xsum, b, i, K, v, shf)


def x_q2_k_imma_swiglu(xq, xs, xsum, gate_up, w, clamp):
    # as x_q2_k_imma for x[b] = swiglu_scalar(gate, up, w[b], clamp) of gate_up[b] = [gate |
    # up] (F columns each): gemv_lowbit's formula, so h has the bits of moe.swiglu's launch
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    F = gate_up.shape[1] // 2
    shf = cuda.shared.array(SHF, float32)
    c0 = 8 * i if i < F // 8 else 0
    v = cuda.local.array(8, float32)
    wb = w[b]
    for k in range(8):
        v[k] = swiglu_scalar(gate_up[b, c0 + k], gate_up[b, F + c0 + k], wb, clamp)
    _quantise(xq, xs, xsum, b, i, F, v, shf)


_gemv_q2_k_imma_tiles = kernel(gemv_q2_k_imma_tiles)
_x_q2_k_imma = kernel(x_q2_k_imma)
_x_q2_k_imma_swiglu = kernel(x_q2_k_imma_swiglu)
for _k, _name in ((_gemv_q2_k_imma_tiles, "_gemv_q2_k_imma_tiles"),
                  (_x_q2_k_imma, "_x_q2_k_imma"), (_x_q2_k_imma_swiglu, "_x_q2_k_imma_swiglu")):
    _k.__name__ = _k.__qualname__ = _name


# ---- launchers ---------------------------------------------------------------------------------
def takes_imma_q2_k(w: QWeight) -> bool:
    """Whether ``w`` runs this kernel: Q2_K (its rows are whole super-blocks)."""
    return w.qtype == GGMLType.Q2_K


def _buffers(T: int, K: int, stream):
    xq = stream_buffer("imma q2_k x bytes", stream, (T * 2 * K // 8,), np.uint64)
    xs = stream_buffer("imma q2_k x scales", stream, (T * K // SUPER,), np.float32)
    xsum = stream_buffer("imma q2_k x sums", stream, (T * K // 16,), np.int32)
    return xq, xs, xsum


def prepare_x(x, stream=0):
    """x float32 [T, K] -> (xq uint64 [T * 2 * K/8]: per row its hi then lo byte plane, xs
    float32 [T * K/256]: the super-blocks' scales, xsum int32 [T * K/16]: the sub-blocks' Σq
    in lane order; flat) in buffers of ``stream``'s own, in one small launch."""
    T, K = x.shape
    bufs = _buffers(T, K, stream)
    _x_q2_k_imma[(cdiv(K // 8, PREP_THREADS), T), PREP_THREADS, stream](*bufs, x)
    return bufs


def prepare_x_swiglu(gate_up, weights, clamp: float, stream=0):
    """As prepare_x for x[t] = weights[t] · silu(min(gate, c)) ⊙ clamp(up, ±c) of gate_up[T, 2F]
    = [gate | up] (c <= 0: no clamp): the MoE's down projection input, made here."""
    T, F = gate_up.shape[0], gate_up.shape[1] // 2
    bufs = _buffers(T, F, stream)
    _x_q2_k_imma_swiglu[(cdiv(F // 8, PREP_THREADS), T), PREP_THREADS, stream](
        *bufs, gate_up, weights, float32(clamp))
    return bufs


def gemv_prepared(out, w: QWeight, prepared, ids=None, stream=0) -> None:
    """out[T, N] = W · x[t] (or W[ids[t]] · x[t]) on x from ``prepare_x`` /
    ``prepare_x_swiglu`` (one x row may serve every id); ``takes_imma_q2_k(w)`` must hold."""
    from .gemv_lowbit import _no_ids

    T, N = out.shape
    xq, xs, xsum = prepared
    S = w.cols // SUPER
    assert takes_imma_q2_k(w) and w.rows == N and xs.size % S == 0, (w, out.shape)
    nw = next(n for n in (WARPS, 2, 1) if S % n == 0)
    args = (out, *w.planes, xq, xs, xsum, _no_ids() if ids is None else ids, nw)
    resident = resident_blocks(_gemv_q2_k_imma_tiles, args, 32 * nw, simulated=2 * T)
    grid = (min(cdiv(N, ROWS), max(1, resident // T)), T)
    _gemv_q2_k_imma_tiles[grid, 32 * nw, stream](*args)


def gemv_q2_k_imma(out, w: QWeight, x, ids=None, stream=0) -> None:
    """out[T, N] float32 = W · x[t], or W[ids[t]] · x[t]: the signature of
    gemv_lowbit.gemv_q2_k_ref, on the tensor cores."""
    gemv_prepared(out, w, prepare_x(x, stream), ids, stream)


def gemv_swiglu_imma(out, w: QWeight, gate_up, weights, clamp: float, ids=None,
                     stream=0) -> None:
    """The signature of gemv_lowbit.gemv_swiglu_ref (the MoE's down projection from its gate|up
    output), for a Q2_K weight on the tensor cores."""
    gemv_prepared(out, w, prepare_x_swiglu(gate_up, weights, clamp, stream), ids, stream)


# ---- compile check ---------------------------------------------------------------------------
_PREP = "uint64[::1], float32[::1], int32[::1]"
PTX_SIGNATURES = [
    (_gemv_q2_k_imma_tiles, "void(float32[:, ::1], uint64[:, :, ::1], uint32[:, :, ::1], "
                            "float16[:, :, ::1], uint64[::1], float32[::1], int32[::1], "
                            "int32[::1], int64)"),
    (_x_q2_k_imma, f"void({_PREP}, float32[:, ::1])"),
    (_x_q2_k_imma_swiglu, f"void({_PREP}, float32[:, ::1], float32[::1], float32)"),
]


def bench_cases(stream) -> list[BenchCase]:
    """The routed experts' down projection at decode, as the engine runs it: 6 of 256 experts of
    [4096 x 2048] Q2_K (V4-Flash, spec §1.1) on the SwiGLU of their gate|up rows, this kernel
    and gemv_lowbit's dp4a one on the same weights (each after its own x preparation, which
    makes the SwiGLU)."""
    from . import gemv_lowbit as gl

    N, K = 4096, 2048
    host, dev, id_sets, out = routed_setup(GGMLType.Q2_K, N, K, stream)
    k = out.shape[0]
    rng = np.random.default_rng(1)
    gu = cuda.to_device(rng.standard_normal((k, 2 * K)).astype(np.float32), stream=stream)
    wts = cuda.to_device(rng.random(k).astype(np.float32), stream=stream)

    def imma(ids):
        return lambda: gemv_swiglu_imma(out, dev, gu, wts, 10.0, ids, stream)

    def dp4a(ids):
        return lambda: gl.gemv_swiglu(out, dev, gu, wts, 10.0, ids, stream)

    def ref():
        r = np.empty((k, N), np.float64)
        gl.gemv_swiglu_ref(r, host, gu.copy_to_host(), wts.copy_to_host(), 10.0,
                           id_sets[0].copy_to_host())
        return r
    return graph_cases("imma_q2_k", f"+ SwiGLU x prep, {k} of 256 x {N}x{K} (down)",
                       [("_gemv_q2_k_imma_tiles", imma), ("_gemv_q2_k_dp4a_slots", dp4a)],
                       id_sets, out, ref, stream, k * dev.nbytes // 256 + 4 * k * (2 * K + N),
                       2 * k * N * K)
