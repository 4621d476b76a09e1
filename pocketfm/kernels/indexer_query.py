"""The CSA indexer's decode query in one launch (spec §4.7):

    indexer_query   out[1, H, DI] <- FP4(Hadamard(RoPE(W_h · x̂)))   for every head h,
                    x̂ = rmsnorm(x) · nw (or x itself), W [H·DI, K] a float weight (V4: F16)

A block a head. Its warps share the head's DI rows, each warp holding all of x (gemv's decode
kernel's lane layout and its norm: the same sums in the same order, so the same values as
gemv(norm=)), the rows' words loaded a step ahead; the DI dot products meet in shared
memory, where the block RoPEs, rotates and rounds the vector as hadamard_fp4 does
(qat.rotate_block_vector). Before, two launches in a row on every CSA layer's path: the GEMV
(12.4 µs for V4's 16.8 MB F16 weight) and hadamard_fp4 (8.2 µs), H100, ncu, 2026-12-06 (p).
The cost: only H blocks (64) read the weight.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32

from . import device
from .bench import BenchCase
from .device import warp_sum
from .gemv import _TYPES, _Q8_0, _decode_shape, _dummies, _load_rows, _norm_x, gemv_ref
from .indexer_warp import q_fragment_index_device
from .mma import _split_pair
from .norm_rope import rmsnorm_ref, rope_ref
from .qat import FP4_BLOCK, MAX_DI, hadamard_fp4, hadamard_fp4_ref, rotate_block_vector
from .qweight import QWeight

THREADS = 256  # 8 warps: 16 of the head's 128 rows each (V4)
ROWS_A_STEP = 2  # rows a warp loads a step (twice that in flight): 128 registers at F16
_SCRATCH = 1024 if device.SIMULATOR else 1  # warp_sum's simulator staging (a block's threads)


def indexer_query_ref(out, w: QWeight, x, norm, rope, fp4: bool) -> None:
    """out[1, H, DI] <- W · x̂ ([H·DI] read as [H, DI]), RoPE'd (forward) at pos with freqs
    (``rope`` = (pos [1], freqs [P]) or None), rotated and rounded as hadamard_fp4_ref; x̂ =
    rmsnorm(x[1, K]) · nw with ``norm`` = (nw [K], eps), else x."""
    xn = x.astype(np.float32)
    if norm is not None:
        xn = np.empty_like(xn)
        rmsnorm_ref(xn, x, norm[0], norm[1], True)
    q = np.empty((1, w.rows), np.float32)
    gemv_ref(q, w, xn)
    q = q.reshape(out.shape)
    if rope is not None:
        rope_ref(q, q.copy(), rope[0], rope[1], False)
    hadamard_fp4_ref(out, q, fp4)


def fits(w: QWeight, DI: int, threads: int = THREADS, rows: int = ROWS_A_STEP) -> bool:
    """Whether indexer_query serves ``w`` with head vectors of DI: a float type, a row one warp
    holds whole (as gemv(norm=)), DI a power of two from FP4_BLOCK to MAX_DI (hadamard_fp4's)
    and a multiple of a step of every warp."""
    ty = _TYPES.get(w.qtype)
    if ty is None or ty is _Q8_0 or w.rows % DI or not FP4_BLOCK <= DI <= MAX_DI or DI & (DI - 1):
        return False
    EC = 4 * ty.epw
    return (w.cols % EC == 0 and w.cols // EC <= 32 * _decode_shape(ty, 1)[0]
            and DI % (threads // 32 * rows) == 0)


_KERNELS: dict = {}


def _query_kernel(qtype: int, NT: int, R: int, NORM: bool, FRAG: bool = False):
    """The kernel for weights of ``qtype``, NT threads, R rows a warp a step, x normalised by
    the kernel (NORM) or taken as given; with FRAG the vector also goes out as the scorer's A
    fragments. Arguments: (out [1, H, DI] f32, wq [1, H·DI, K/EPW] words, x [1, K] f32, nw [K]
    f32, eps f32, pos [1] int32, freqs [P] f64, fp4 int32, frag [H·DI/2] uint32)."""
    key = (qtype, NT, R, NORM, FRAG)
    if key in _KERNELS:
        return _KERNELS[key]
    ty = _TYPES[qtype]
    EPW, dq, WDT = ty.epw, ty.dq, ty.wdtype
    EC = 4 * EPW  # elements a 16-byte chunk
    CPL = _decode_shape(ty, 1)[0]  # chunks a lane: gemv's decode layout at one token
    NWARP = NT // 32
    N_W, N_XF = R * CPL * 4, CPL * EC

    @device.kernel
    def _indexer_query(out, wq, x, nw, eps, pos, freqs, fp4, frag):
        H, DI = out.shape[1], out.shape[2]
        K = x.shape[1]
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        nchunk, kw = K // EC, K // EPW
        rw = DI // NWARP  # the warp's rows: row0 .. row0 + rw - 1
        row0 = cuda.blockIdx.x * DI + warp * rw
        scratch = cuda.shared.array(_SCRATCH, float32)
        vals = cuda.shared.array(MAX_DI, float32)  # the head's DI dot products
        xf = cuda.local.array(N_XF, float32)
        wv = cuda.local.array(N_W, WDT)
        wn = cuda.local.array(N_W, WDT)
        sv = cuda.local.array(1, float32)  # (no scale plane)
        _load_rows(wn, sv, wq, wq, row0, row0 + rw, kw, 1, lane, nchunk, R, CPL, 1, False)
        for j in range(CPL):
            c = lane + j * 32
            for i in range(EC):
                xf[j * EC + i] = x[0, c * EC + i] if c < nchunk else float32(0)
        if NORM:
            _norm_x(xf, 0, nw, eps, K, lane, nchunk, CPL, EC, scratch)
        for s in range(0, rw, R):
            for i in range(N_W):
                wv[i] = wn[i]
            _load_rows(wn, sv, wq, wq, row0 + s + R, row0 + rw, kw, 1, lane, nchunk, R, CPL, 1,
                       False)  # (past the warp's rows: its last row again, never used)
            for i in range(R):
                acc = float32(0)
                for j in range(CPL):  # gemv's decode kernel's order: a chunk's sum, then acc
                    q = (i * CPL + j) * 4
                    tb = float32(0)
                    for m in range(4):
                        for kk in range(EPW):
                            tb += dq(wv[q + m], kk) * xf[j * EC + m * EPW + kk]
                    acc += tb
                v = warp_sum(acc, scratch)
                if lane == 0:
                    vals[warp * rw + s + i] = v
        cuda.syncthreads()
        h = cuda.blockIdx.x
        rotate_block_vector(out, 0, h, vals, fp4, pos, freqs)
        if FRAG:  # the head's bf16 pairs where the scorer's warps hold them (exact on FP4)
            cuda.syncthreads()  # (the block's writes of out[0, h] before they are read back)
            for p in range(cuda.threadIdx.x, DI // 2, NT):
                frag[q_fragment_index_device(h, 2 * p, DI)] = _split_pair(out[0, h, 2 * p],
                                                                   out[0, h, 2 * p + 1])[0]

    _KERNELS[key] = _indexer_query
    return _indexer_query


def indexer_query(out, w: QWeight, x, norm=None, rope=None, fp4: bool = True, stream=0,
                  threads: int | None = None, rows: int = ROWS_A_STEP, frag=None) -> None:
    """out[1, H, DI] f32 <- FP4(Hadamard(RoPE(W · x̂))) per head (indexer_query_ref), one
    launch of H blocks; device arrays: x [1, K] f32, ``norm`` (nw [K] f32, eps) or None,
    ``rope`` (pos [1] int32, freqs [P] float64) or None. ``fits`` must hold. ``frag`` uint32
    [H·DI/2]: also q's bf16 pairs in the one-warp scorer's fragment order
    (indexer_warp.q_fragments_ref of out), for indexer_scores(q_frag=)."""
    nt = threads or THREADS
    _, H, DI = out.shape
    assert fits(w, DI, nt, rows) and w.rows == H * DI and x.shape == (1, w.cols), (w, out.shape)
    assert frag is None or (frag.shape == (H * DI // 2,) and H % 16 == 0), (frag.shape, H, DI)
    nw, eps = norm if norm is not None else (_dummies()[2], 0.0)
    pos, freqs = rope or (device.empty_vector(np.int32), device.empty_vector(np.float64))
    kern = _query_kernel(w.qtype, nt, rows, norm is not None, frag is not None)
    if frag is None:
        frag = device.empty_vector(np.uint32)
    kern[H, nt, stream](out, w.planes[0], x, nw, np.float32(eps), pos, freqs, np.int32(fp4),
                        frag)


# ---- CI lane B and benchmarks --------------------------------------------------------------------
_SIG = ("void(float32[:, :, ::1], int32[:, :, ::1], float32[:, ::1], float32[::1], float32, "
        "int32[::1], float64[::1], int32, uint32[::1])")
PTX_SIGNATURES = [(_query_kernel(ty.qtype, nt, ROWS_A_STEP, norm, frag), _SIG)
                  for ty in (_TYPES[q] for q in _TYPES) if ty is not _Q8_0 and ty.epw == 2
                  for nt in (256, 512) for norm in (True, False) for frag in (False, True)
                  if nt == 256 or not frag]


def bench_cases(stream) -> list[BenchCase]:
    """V4-Flash: the indexer's wq_b (F16, 8,192 x 1,024) rotated through 256 MB of copies (as
    in the engine, the weight comes from DRAM), x normalised by the kernel, RoPE on the last
    64 of 128 dims, FP4: one launch at 256 and 512 threads, against the two launches it
    replaces (gemv(norm=), then hadamard_fp4); graphs of 16 calls."""
    from ..numerics import rope_frequencies
    from .device import capture_graph, cdiv
    from .gemv import gemv, pack_f16

    rng = np.random.default_rng(0)
    H, DI, K, reps = 64, 128, 1024, 16
    raw = (rng.normal(size=(H * DI, K)) * 0.03).astype(np.float16)
    host = pack_f16(raw, H * DI, K)
    copies = [host.to_device(stream) for _ in range(cdiv(256 << 20, raw.nbytes))]
    xh = rng.normal(size=(1, K)).astype(np.float32)
    nwh = rng.uniform(0.5, 1.5, size=K).astype(np.float32)
    x, nw = cuda.to_device(xh, stream=stream), cuda.to_device(nwh, stream=stream)
    posh, freqs = np.array([100_000], np.int32), rope_frequencies(64, 160000.0, 16.0, 65536)
    rope = (cuda.to_device(posh, stream=stream), cuda.to_device(freqs, stream=stream))
    out = cuda.device_array((1, H, DI), np.float32, stream=stream)
    q = cuda.device_array((1, H, DI), np.float32, stream=stream)
    nbytes = raw.nbytes + x.nbytes + out.nbytes

    def check():
        ref = np.empty((1, H, DI))
        indexer_query_ref(ref, host, xh, (nwh, 1e-6), (posh, freqs), True)
        got = out.copy_to_host(stream=stream)
        stream.synchronize()
        return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

    def fused(w, nt):
        return lambda: indexer_query(out, w, x, (nw, 1e-6), rope, True, stream, threads=nt)

    def two(w):
        def launch():
            gemv(q.reshape(1, H * DI), w, x, None, stream, norm=(nw, 1e-6))
            hadamard_fp4(out, q, True, stream=stream, rope=rope)
        return launch
    cases = [BenchCase("indexer_query", f"indexer_query one launch, {nt} threads H={H} DI={DI} "
                       f"K={K}", capture_graph([fused(copies[i % len(copies)], nt)
                                                for i in range(reps)], stream),
                       reps * nbytes, check=check, launches=reps) for nt in (256, 512)]
    cases.append(BenchCase("indexer_query", f"indexer_query as gemv(norm=) + hadamard_fp4 H={H} "
                           f"DI={DI} K={K}", capture_graph([two(copies[i % len(copies)])
                                                           for i in range(reps)], stream),
                           reps * nbytes, check=check, launches=reps))
    return cases
