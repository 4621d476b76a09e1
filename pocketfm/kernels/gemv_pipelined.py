"""The Q8_0 dp4a decode GEMV with its weights streamed through shared memory by cp.async, STAGES
steps deep, beside gemv.py's register-prefetched dp4a kernel (same work split, same sums, the
same bits). Measured and not used: on the H200 (2026-12-06, BENCHMARKS (l)) it is no faster
with 2 stages and slower with 3 or 4 (attn_q_b 11.8 µs in registers against 14.1 / 19.4 /
20.7; attn_output_b 13.6 against 13.8 / 14.9 / 15.4; the output head 141 against 138), and
the decode step with it on the engine's Q8_0 GEMVs took 10.79 ms against 10.37. What the
register kernel waits on at these sizes is not one step of loads in flight. Kept, with its
bench family, so the finding can be re-measured on another GPU.

Why it was built: gemv.py's kernel holds the next step's weights in registers, one step
ahead (128 bytes a lane: 64 KB an SM at 4 blocks of 128 threads or 2 of 256), and a ~36 MB
weight (attn_q_b, attn_output_a / _b) is ~4 steps a block of its one-wave grid, so a launch
looked like ~4 memory latencies end to end: 49-58% of the copy bandwidth (H200, 2026-12-02),
against 94% for the output head (~120 steps a block). Here each lane copies its step's 8 x 16
bytes into shared memory with cp.async, STAGES - 1 steps ahead, holding no registers for them,
so STAGES - 1 steps are in flight from the first instruction on.

- A lane reads back only the words it copied itself (its own cp.async groups: no barrier).
- A step's block scales (a row's 32 float16 for the warp's 64 chunks) are copied by 16 lanes of
  the warp and read by all after a __syncwarp.
- Shared memory, in 16-byte units: unit (slot, q, thread) at (slot · 8 + q) · threads + thread,
  so a warp's 16-byte reads and copies are conflict-free; then the scales, 64 words a warp and
  slot.

Shapes: K a multiple of 1,024 (each warp's K-slice exactly 64 chunks of 16 columns; attn_q_b
1,024, attn_output_a and the shared expert 4,096, attn_output_b 8,192); others keep gemv.py's.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, uint32, uint64

from .device import SIMULATOR, cdiv, kernel, launch_shared, resident_blocks, warp_sum
from .gemv import _LIMB, XLW, _bits_f16, _bits_f32, _dummies, _ld, _ld_x4, _limbs_dot
from .imma import _syncwarp
from .mma import _cp_async16, _cp_async_commit, _cp_async_wait0, _cp_async_wait1, \
    _cp_async_wait2

STAGES = 3  # steps in shared memory: STAGES - 1 in flight while one is summed
CPL, R = 2, 4  # 16-byte chunks a lane holds of each row, rows a warp a step (gemv.py's shape)
NQ = R * CPL  # 16-byte units a lane copies a step
SPAN = 32 * CPL  # chunks of a warp's K-slice: exactly (takes_pipelined)
SCALE_WORDS = R * SPAN // 4  # a warp's step of scales: R rows x 32 float16, in uint32 words
N_PART = 2 * 32 * R
N_XQ, N_XS, N_WV = CPL * 12, CPL * 3, NQ * 4  # (literals for cuda.local.array)
_ALIGN = None if SIMULATOR else 16
THREADS = 128  # threads a block where K leaves room for more than one row slot of warps


def takes_pipelined(K: int) -> bool:
    """Whether a Q8_0 weight of K columns fits this kernel (every warp a 64-chunk K-slice)."""
    return K % (16 * SPAN) == 0 and K // (16 * SPAN) <= 32


def shared_bytes(threads: int, stages: int = STAGES) -> int:
    """Dynamic shared memory of a block: the weight units, then the warps' scales."""
    return 4 * stages * (NQ * threads * 4 + threads // 32 * SCALE_WORDS)


def _kernel(S: int):
    """The kernel with S stages (2-4: S - 1 steps in flight)."""
    assert 2 <= S <= 4

    @cuda.jit(device=True)
    def wait_oldest():
        # the oldest of the S - 1 groups in flight has landed
        if S == 2:
            _cp_async_wait0()
        elif S == 3:
            _cp_async_wait1()
        else:
            _cp_async_wait2()

    @cuda.jit(device=True)
    def issue(smem, wq, ws, slot, row0, row_end, c0, wk, lane, warp, kw, ksw, tid, nt, nwarp):
        # copy a step (rows row0 .. row0 + R - 1, clamped) into ``slot``: the lane's 8 units,
        # and lanes 0 .. 4R - 1 the rows' 16-byte quarters of scales; one cp.async group
        for i in range(R):
            row = min(row0 + i, row_end - 1)
            for j in range(CPL):
                u = (slot * NQ + i * CPL + j) * nt + tid
                _cp_async16(smem, 4 * u, wq, row * kw + (c0 + 32 * j) * 4)
        if lane < 4 * R:
            row = min(row0 + (lane >> 2), row_end - 1)
            at = nt * 4 * NQ * S + (slot * nwarp + warp) * SCALE_WORDS + 4 * lane
            _cp_async16(smem, at, ws, row * ksw + wk * (SPAN // 4) + 4 * (lane & 3))
        _cp_async_commit()

    def k(out, wq, ws, x, ids, per_token, N, K, wk_n, span):
        # out [T, N]; wq uint32 [E, N, K/4] (the Q8_0 codes), ws uint32 [E, N, K/64] (their
        # float16 scales in pairs); x: the limbs [T, K/16 · XLW]. Block = wr_n x wk_n warps:
        # warp (wr, wk) takes row slot wr, K-slice wk (span = SPAN chunks). As gemv.py's.
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        lane, warp = tid % 32, tid // 32
        nwarp = nt // 32
        wk, wr = warp % wk_n, warp // wk_n
        wr_n = nwarp // wk_n
        t0 = cuda.blockIdx.y
        e = ids[t0] if per_token else 0
        nchunk, kw, ksw = K // 16, K // 4, K // 64
        c0 = wk * span + lane
        smem = cuda.shared.array(0, uint32, alignment=_ALIGN)
        scratch = cuda.shared.array(1024, np.float32)  # warp_sum staging (simulator only)
        part = cuda.shared.array(N_PART, np.float32)
        xq = cuda.local.array(N_XQ, np.int32)
        xs = cuda.local.array(N_XS, np.float32)
        wv = cuda.local.array(N_WV, np.int32)
        sv = cuda.local.array(NQ, np.float32)
        acc = cuda.local.array(R, np.float32)
        ngroups = (N + wr_n * R - 1) // (wr_n * R)
        G = cuda.gridDim.x
        g = cuda.blockIdx.x
        row_end = e * N + N
        for st in range(S - 1):  # the first S - 1 steps in flight before anything else
            issue(smem, wq, ws, st, e * N + ((g + st * G) * wr_n + wr) * R, row_end, c0, wk, lane,
                  warp, kw, ksw, tid, nt, nwarp)
        for j in range(CPL):
            base = (t0 * nchunk + c0 + 32 * j) * XLW
            for m in range(3):
                q = j * 12 + 4 * m
                xq[q], xq[q + 1], xq[q + 2], xq[q + 3] = _ld_x4(x, base + 4 * m)
            s1 = _bits_f32(_ld(x, base + 12))
            xs[j * 3] = s1
            xs[j * 3 + 1] = s1 * _LIMB
            xs[j * 3 + 2] = s1 * _LIMB * _LIMB
        p = 0
        it = 0
        while g < ngroups:  # persistent blocks: grid-stride over groups of wr_n * R rows
            n0 = (g * wr_n + wr) * R
            wait_oldest()
            _syncwarp()  # the warp's scale copies are visible (and last step's reads done)
            slot = it % S
            for q in range(NQ):
                u = uint64(4 * ((slot * NQ + q) * nt + tid))
                for m in range(4):
                    wv[4 * q + m] = np.int32(smem[u + uint64(m)])
            sb = nt * 4 * NQ * S + (slot * nwarp + warp) * SCALE_WORDS
            for i in range(R):
                for j in range(CPL):
                    h = (lane >> 1) + 16 * j  # the chunk's block among the row's 32
                    word = smem[sb + i * (SPAN // 4) + (h >> 1)]
                    sv[i * CPL + j] = _bits_f16(word >> uint32(16 * (h & 1)))
            # the step S - 1 ahead goes into the slot the last step was read from
            issue(smem, wq, ws, (it + S - 1) % S,
                  e * N + ((g + (S - 1) * G) * wr_n + wr) * R, row_end, c0, wk, lane, warp, kw,
                  ksw, tid, nt, nwarp)
            for i in range(R):
                acc[i] = np.float32(0)
                for j in range(CPL):
                    dot = _limbs_dot(wv, (i * CPL + j) * 4, xq, j * 12, xs, j * 3)
                    acc[i] += sv[i * CPL + j] * dot
            for i in range(R):
                v = warp_sum(acc[i], scratch)
                if lane == 0:
                    if wk_n == 1:
                        if n0 + i < N:
                            out[t0, n0 + i] = v
                    else:
                        part[(p * 32 + warp) * R + i] = v
            if wk_n > 1:  # the K-slices added in a fixed order; parity buffers: one barrier
                cuda.syncthreads()
                if tid < wr_n * R:
                    r, i = tid // R, tid % R
                    n = (g * wr_n + r) * R + i
                    if n < N:
                        s = np.float32(0)
                        for kk in range(wk_n):
                            s += part[(p * 32 + r * wk_n + kk) * R + i]
                        out[t0, n] = s
                p ^= 1
            g += G
            it += 1
        _cp_async_wait0()  # (the copies past the last step: none left running at exit)

    kern = kernel(k)
    kern.__name__ = kern.__qualname__ = f"_gemv_q8_0_dp4a_cp_async_s{S}"
    return kern


KERNELS = {S: _kernel(S) for S in (2, 3, 4)}


def gemv_q8_0_pipelined(out, w, xl, ids=None, stream=0, stages: int = STAGES) -> None:
    """out[T, N] = W · x[t] (or W[ids[t]] · x[t]) for a Q8_0 QWeight w on x's limbs ``xl``
    (gemv.q8_0_limbs: int32 [T, K/16 · XLW]), one token a grid row: gemv.gemv_q8_0(limbs=)'s
    work on this kernel; takes_pipelined(w.cols) must hold."""
    T, N = out.shape
    K = w.cols
    assert takes_pipelined(K) and w.rows == N and xl.shape == (T, K // 16 * XLW), (w, xl.shape)
    qs, d = w.planes
    wq = qs.view(np.uint32)
    ws = d.view(np.uint32)
    wk_n = K // (16 * SPAN)
    nt = 32 * wk_n * max(1, THREADS // (32 * wk_n))
    wr_n = nt // 32 // wk_n
    ids_dummy = _dummies()[0]
    args = (out, wq, ws, xl, ids_dummy if ids is None else ids, 0 if ids is None else 1, N, K,
            wk_n, SPAN)
    kern = KERNELS[stages]
    smem = shared_bytes(nt, stages)
    blocks = max(1, resident_blocks(kern, args, nt, smem, simulated=2 * T) // T)
    launch_shared(kern, (min(cdiv(N, wr_n * R), blocks), T), nt, stream, smem, *args)


_SIG = ("void(float32[:, ::1], uint32[:, :, ::1], uint32[:, :, ::1], int32[:, ::1], int32[::1], "
        "int64, int64, int64, int64, int64)")
PTX_SIGNATURES = [(k, _SIG) for k in KERNELS.values()]


def bench_cases(stream, shapes=None) -> list:
    """gemv.py's register-prefetched dp4a kernel against this one (2, 3, 4 stages) at the decode
    shapes of V4-Flash's big Q8_0 weights (``shapes``: (name, N, K, T) others), on the same
    prepared limbs (the GEMV alone), each a graph of 20 launches rotating over >= 256 MB of
    weight copies (L2 serves nothing)."""
    from . import gemv
    from .bench import BenchCase
    from .device import capture_graph

    rng = np.random.default_rng()
    shapes = shapes or [("attn_q_b", 32768, 1024, 1), ("attn_output_b", 4096, 8192, 1),
                        ("attn_output_a", 1024, 4096, 8), ("shexp_gate_up", 4096, 4096, 1),
                        ("output", 129280, 4096, 1)]
    cases = []
    for name, N, K, T in shapes:
        host = gemv._random_weight(gemv._Q8_0, N, K, rng, E=T)
        ids = cuda.to_device(np.arange(T, dtype=np.int32), stream=stream) if T > 1 else None
        n_copies = 1 if SIMULATOR else max(1, cdiv(256 << 20, host.nbytes))
        copies = [host.to_device(stream) for _ in range(n_copies)]
        xh = rng.standard_normal((T, K)).astype(np.float32)
        xl = gemv.q8_0_limbs(cuda.to_device(xh, stream=stream), stream,
                             name=f"bench limbs {name}")  # (a buffer a case: all checked last)
        out = cuda.device_array((T, N), np.float32, stream=stream)

        def check(host=host, xh=xh, out=out, N=N, T=T):
            rows = min(N, 256)
            sub = type(host)(host.qtype, rows, host.cols, host.experts,
                             tuple(p[:, :rows] for p in host.planes))
            ref = np.empty((T, rows))
            gemv._gemv_ref(ref, sub, xh, np.arange(T) if T > 1 else None)
            got = out.copy_to_host(stream=stream)[:, :rows]
            stream.synchronize()
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        builds = [("registers (gemv.py)", None)] + [(f"cp.async, {s} stages", s)
                                                    for s in (2, 3, 4)]
        for label, s in builds:
            def one(w, s=s, out=out, xl=xl, ids=ids):
                if s is None:
                    return lambda: gemv.gemv_q8_0(out, w, None, ids, stream=stream, limbs=xl)
                return lambda: gemv_q8_0_pipelined(out, w, xl, ids, stream, s)
            launch = capture_graph([one(copies[i % len(copies)]) for i in range(20)], stream)
            cases.append(BenchCase(
                "gemv_pipelined", f"{label} Q8_0 {name} {T} x {N}x{K} (x20 per graph)", launch,
                bytes=20 * (host.nbytes + 4 * T * (K // 16 * XLW + N)), flops=20 * 2 * T * N * K,
                target=">= 75% copy bw", check=check, launches=20))
    return cases
