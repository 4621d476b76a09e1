"""Weights pulled into the L2 cache ahead of their GEMV, on a side stream, while the main stream
runs kernels that leave DRAM idle.

    prefetch_l2(arrays)   every 128-byte line of each array requested into L2 (no output)

Why: a decode step's main stream alternates latency-bound kernels (the sink attention and its
combine: ~30-47 µs a layer that read a few MB) with GEMVs that stream their weights from DRAM
(attn_output_a: 35.6 MB, ~20 µs on the H100, of which ~8 µs are fixed costs: BENCHMARKS
2026-12-06 (p)). Launched beside the attention, ``prefetch.global.L2::evict_last`` of the next
GEMV's lines uses the idle DRAM, and the GEMV then reads L2 (H100/H200: 50 MB). A prefetch
changes no value: its reference is to do nothing, and the engine's logits must not move.
In the simulator the kernel walks the lines and requests nothing.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from . import device
from .device import cdiv

LINE = 128  # bytes an L2 request covers
THREADS = 256
BLOCKS = 8  # few SMs: the attention beside it keeps the rest (decode.py: measured)

if device.SIMULATOR:
    def _prefetch_line(a, i):
        """(simulator: nothing to request)"""
        return None
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _prefetch_line(typingctx, a, i):
        """Request the L2 line holding a[i] (a: 1-D), kept with eviction priority evict_last
        (the GEMV's reads, and the traffic between, evict first what was not asked for)."""
        if not (isinstance(a, types.Array) and a.ndim == 1 and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, value=args[0])
            ind = context.cast(builder, args[1], sig.args[1], types.intp)
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, [ind])
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type])
            asm = ir.InlineAsm(fnty, "prefetch.global.L2::evict_last [$0];", "l",
                               side_effect=True)
            builder.call(asm, [ptr])
            return context.get_dummy_value()
        return types.void(a, i), codegen


@device.kernel
def _prefetch_lines(a):
    """Every LINE-byte line of a[N] (uint8) requested into L2: the grid's threads take the
    lines in turn."""
    n = a.shape[0]
    step = cuda.gridsize(1) * LINE
    for i in range(cuda.grid(1) * LINE, n, step):
        _prefetch_line(a, i)


def prefetch_l2_ref(arrays) -> None:
    """The reference: a cache hint computes nothing."""
    return None


def byte_view(a):
    """A C-contiguous device array as uint8 [nbytes] (the same memory)."""
    return a.reshape(a.size).view(np.uint8)


def prefetch_l2(arrays, stream=0, blocks: int = BLOCKS, threads: int = THREADS) -> None:
    """Request every line of each device array (C-contiguous) into L2, on ``stream``."""
    for a in arrays:
        flat = byte_view(a)
        nb = min(blocks, max(1, cdiv(flat.shape[0], LINE * threads)))
        _prefetch_lines[nb, threads, stream](flat)


PTX_SIGNATURES = [(_prefetch_lines, "void(uint8[::1])")]


def bench_cases(stream) -> list:
    """attn_output_b's shape (Q8_0 4096 x 8192, 35.6 MB), copies rotating over >= 256 MB so
    that L2 cannot serve a launch from the one before: the prefetch alone by 8 and 16 blocks,
    the GEMV alone (from DRAM), and each prefetch followed by its GEMV on one stream (the
    pair's time less the prefetch's: the GEMV from L2)."""
    from . import gemv
    from .bench import BenchCase
    from .device import capture_graph

    rng = np.random.default_rng(0)
    N, K, reps = 4096, 8192, 10
    host = gemv._random_weight(gemv._Q8_0, N, K, rng)
    copies = [host.to_device(stream) for _ in range(max(1, cdiv(256 << 20, host.nbytes)))]
    x = cuda.to_device(rng.standard_normal((1, K)).astype(np.float32), stream=stream)
    out = cuda.device_array((1, N), np.float32, stream=stream)

    def fetch(w, blocks):
        return lambda: prefetch_l2(w.planes, stream, blocks=blocks)

    def multiply(w):
        return lambda: gemv.gemv_q8_0(out, w, x, None, stream=stream)

    def graph(parts):
        return capture_graph(parts, stream)
    nb = host.nbytes
    cases = []
    for blocks in (8, 16):
        ws = [copies[i % len(copies)] for i in range(reps)]
        cases.append(BenchCase("l2_prefetch", f"prefetch_l2 {nb / 1e6:.1f} MB by {blocks} blocks",
                               graph([fetch(w, blocks) for w in ws]), reps * nb,
                               launches=reps))
    ws = [copies[i % len(copies)] for i in range(reps)]
    cases.append(BenchCase("l2_prefetch", f"gemv_q8_0 {N}x{K} from DRAM",
                           graph([multiply(w) for w in ws]), reps * nb,
                           flops=reps * 2 * N * K, launches=reps))
    pairs = []
    for w in ws:
        pairs += [fetch(w, 8), multiply(w)]
    cases.append(BenchCase("l2_prefetch", f"prefetch_l2 by 8 blocks, then gemv_q8_0 {N}x{K} "
                           "(a pair)", graph(pairs), reps * 2 * nb, flops=reps * 2 * N * K,
                           launches=reps))
    return cases
