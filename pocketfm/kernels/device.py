"""Every numba-cuda touch point in one place: jit options, the simulator switch, reductions.

Kernels run in two lanes (gpu_notes.md §4, §5):
- CI lane A, Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``): no warp intrinsics, no bf16,
  no profiler-only jit options. Kernels stay correct there through ``warp_sum``'s shared-memory
  path and through explicit int32 casts on packed bytes (NumPy scalars wrap otherwise).
- CI lane B, ``compile_ptx`` for sm_90: every kernel in ``PTX_SIGNATURES`` of its module is
  compiled in a separate process, so Numba typing errors the simulator never sees fail CI.
On the H200 the same launchers run the real kernels.

Inside kernels the module must be referred to as ``cuda`` (the simulator swaps that global).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from . import kcache, leave_out, pdl

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
if SIMULATOR:  # a block's simulated threads take turns (sim_blocks.py: CI lane A's speed)
    from . import sim_blocks

    sim_blocks.install()
WARP = 32
FULL_MASK = 0xFFFFFFFF


def kernel(fn=None, **opts):
    """``cuda.jit`` with fastmath off by default and profiler / register options dropped in
    the simulator (it raises TypeError on ``lineinfo`` and ``max_registers``). On a GPU the
    kernel gets pdl.py's prologue (programmatic dependent launch) unless POCKETFM_PDL=0, and
    kcache.py's disk cache unless POCKETFM_KERNEL_CACHE=off. ``source_fn`` of the
    dispatcher is ``fn`` (pdl.py compiles a wrapper of it)."""
    if SIMULATOR:
        opts.pop("lineinfo", None)
        opts.pop("max_registers", None)
    else:
        opts.setdefault("lineinfo", True)
    jit = cuda.jit(**opts)

    def deco(f):
        if not pdl.ENABLED:
            disp = jit(f)
        else:
            pdl.install()
            disp = pdl.marked(jit(pdl.with_prologue(f)))
        disp.source_fn = f
        leave_out.skippable(disp)  # (bench --decode-without: nothing skipped unless asked)
        if not SIMULATOR:
            kcache.attach(disp, f, dict(opts, pdl=pdl.ENABLED))
        return disp
    return deco(fn) if fn is not None else deco


def device_fn(fn):
    """A ``cuda.jit(device=True)`` helper, inlined by the compiler."""
    return cuda.jit(device=True)(fn)


if SIMULATOR:
    @cuda.jit(device=True)
    def warp_sum(v, scratch):
        """Sum of ``v`` over the calling warp, returned to every lane.

        Simulator path: stage through ``scratch`` (a float32 shared array of blockDim.x) and
        barriers, so EVERY thread of the block must call it (no divergent calls).
        """
        t = cuda.threadIdx.x
        scratch[t] = v
        cuda.syncthreads()
        base = t - t % 32
        s = scratch[base] * 0
        for i in range(32):
            if base + i < cuda.blockDim.x:
                s += scratch[base + i]
        cuda.syncthreads()
        return s

    @cuda.jit(device=True)
    def warp_max(v, scratch):
        """Maximum of ``v`` over the calling warp (simulator path; see warp_sum)."""
        t = cuda.threadIdx.x
        scratch[t] = v
        cuda.syncthreads()
        base = t - t % 32
        m = scratch[base]
        for i in range(1, 32):
            if base + i < cuda.blockDim.x:
                m = max(m, scratch[base + i])
        cuda.syncthreads()
        return m
    @cuda.jit(device=True)
    def xor_shfl(v, off, scratch):
        """v of lane (lane ^ off) (simulator path: through ``scratch``, a float32 shared array
        of blockDim.x, so the value comes back as float32 and every thread must call it)."""
        t = cuda.threadIdx.x
        scratch[t] = v
        cuda.syncthreads()
        r = scratch[t ^ off]
        cuda.syncthreads()
        return r
else:
    @cuda.jit(device=True)
    def xor_shfl(v, off, scratch):
        """v of lane (lane ^ off), by shfl.sync (``scratch`` unused on the GPU)."""
        return cuda.shfl_xor_sync(FULL_MASK, v, off)

    @cuda.jit(device=True)
    def warp_sum(v, scratch):
        """Sum of ``v`` over the calling warp, returned to every lane (butterfly shuffles;
        ``scratch`` is unused on the GPU and may be any array)."""
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
        return v

    @cuda.jit(device=True)
    def warp_max(v, scratch):
        """Maximum of ``v`` over the calling warp, returned to every lane."""
        for off in (16, 8, 4, 2, 1):
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
        return v


@cuda.jit(device=True)
def block_sum(v, scratch):
    """Sum of ``v`` over the whole block (any size <= 1024), returned to every thread.

    ``scratch``: float32 shared array of at least blockDim.x. Every thread must call it.
    Shared-memory tree reduction: runs in the simulator and on the GPU alike.
    """
    t = cuda.threadIdx.x
    n = cuda.blockDim.x
    scratch[t] = v
    cuda.syncthreads()
    step = 1
    while step < n:
        step *= 2
    step //= 2
    while step > 0:
        if t < step and t + step < n:
            scratch[t] += scratch[t + step]
        cuda.syncthreads()
        step //= 2
    s = scratch[0]
    cuda.syncthreads()
    return s


@cuda.jit(device=True)
def block_max(v, scratch):
    """Maximum of ``v`` over the whole block, returned to every thread (see block_sum)."""
    t = cuda.threadIdx.x
    n = cuda.blockDim.x
    scratch[t] = v
    cuda.syncthreads()
    step = 1
    while step < n:
        step *= 2
    step //= 2
    while step > 0:
        if t < step and t + step < n:
            scratch[t] = max(scratch[t], scratch[t + step])
        cuda.syncthreads()
        step //= 2
    m = scratch[0]
    cuda.syncthreads()
    return m


@cuda.jit(device=True)
def block_sum_warps(v, scratch, wsum):
    """Sum of ``v`` over the block, returned to every thread: warp sums, then one pass over the
    per-warp partials (2 barriers instead of a tree's log2(blockDim)).

    scratch: shared [blockDim] of v's dtype (only the simulator's warp_sum uses it); wsum: shared
    [32] of v's dtype. Every thread must call it; blockDim must be a multiple of 32.
    """
    t = cuda.threadIdx.x
    s = warp_sum(v, scratch)
    if t % 32 == 0:
        wsum[t // 32] = s
    cuda.syncthreads()
    tot = wsum[0]
    for i in range(1, cuda.blockDim.x // 32):
        tot += wsum[i]
    cuda.syncthreads()
    return tot


@cuda.jit(device=True)
def block_max_warps(v, scratch, wsum):
    """Maximum of ``v`` over the block, returned to every thread (see block_sum_warps)."""
    t = cuda.threadIdx.x
    m = warp_max(v, scratch)
    if t % 32 == 0:
        wsum[t // 32] = m
    cuda.syncthreads()
    tot = wsum[0]
    for i in range(1, cuda.blockDim.x // 32):
        tot = max(tot, wsum[i])
    cuda.syncthreads()
    return tot


def grid_stride_shape(most_blocks: int) -> tuple[int, int]:
    """(threads, most blocks) of a grid-stride copy / fill launch. The simulator runs each
    thread as a Python thread, and starting one costs ~20x a loop iteration: there two blocks
    of 32 threads (blockIdx and the grid stride both still take part) fill a tiny model's
    caches ~15x faster. The kernel is the same; on a GPU, 256 threads and many blocks."""
    return (32, 2) if SIMULATOR else (256, most_blocks)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def to_device(a, stream=0):
    return cuda.to_device(a, stream=stream)


def device_empty(shape, dtype, stream=0):
    return cuda.device_array(shape, dtype=dtype, stream=stream)


def allocate(specs, stream=0, fills=None) -> dict:
    """{spec.name: device array} for GPU ``engine.layout.ArraySpec``s, uninitialised except the
    names in ``fills`` (a value or a host array, broadcast to the spec's shape and copied in)."""
    out = {}
    for sp in specs:
        assert sp.where == "gpu", sp
        if fills and sp.name in fills:
            host = np.broadcast_to(np.asarray(fills[sp.name], sp.dtype), sp.shape)
            out[sp.name] = cuda.to_device(np.ascontiguousarray(host), stream=stream)
        else:
            out[sp.name] = cuda.device_array(sp.shape, dtype=sp.dtype, stream=stream)
    return out


_SM_COUNT: list = []


def sm_count() -> int:
    """Multiprocessors of the current device, read once (1 in the simulator, which has no
    device attributes): the launchers size their grids from it."""
    if not _SM_COUNT:
        _SM_COUNT.append(1 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT)
    return _SM_COUNT[0]


_RESIDENT: dict = {}  # (kernel, argument types, threads, smem) -> blocks resident at once


def resident_blocks(kern, args, threads: int, smem: int = 0, simulated: int = 4) -> int:
    """How many blocks of ``threads`` threads of ``kern`` (compiled for ``args``, with ``smem``
    bytes of dynamic shared memory) the whole GPU holds at once: the compiled kernel's
    registers and shared memory decide. A persistent grid of this size is one wave: every
    block streams from the start and none waits for a second round (a Q8_0 GEMV sized for 8
    blocks an SM but holding 3 ran in 2.7 waves: ncu, 2026-12-02). The simulator has no
    occupancy: ``simulated`` blocks (enough for the caller's tests to reach its grid-stride
    loops)."""
    if SIMULATOR:
        return simulated
    types = tuple(kern.typeof_pyval(a) for a in args)
    key = (kern, types, threads, smem)
    if key not in _RESIDENT:
        compiled = kern.compile(types)
        if smem > SHARED_DEFAULT:  # the occupancy of a size the kernel is not yet allowed: 0
            _allow_shared(compiled, smem)
        _RESIDENT[key] = compiled.max_cooperative_grid_blocks(threads, smem)
    return _RESIDENT[key]


SHARED_DEFAULT = 48 * 1024  # dynamic shared bytes a launch may ask for without opting in
_SHARED_ALLOWED: dict = {}  # id of a loaded kernel -> the dynamic shared bytes it may take


def launch_shared(kern, grid, threads: int, stream, smem: int, *args) -> None:
    """``kern[grid, threads, stream, smem](*args)``, the kernel first allowed ``smem`` bytes of
    dynamic shared memory where that is over 48 KiB: numba-cuda does not opt in, and such a
    launch fails with CUDA_ERROR_INVALID_VALUE (gpu_notes.md). The attribute is set once per
    loaded kernel, from a pre-launch callback (numba compiles for the arguments first)."""
    config = kern[grid, threads, stream, smem]
    if smem > SHARED_DEFAULT and not SIMULATOR:
        config.pre_launch_callbacks.append(lambda k, c: _allow_shared(k, c.sharedmem))
    config(*args)


def _allow_shared(kernel, smem: int) -> None:
    """Let compiled ``kernel`` take ``smem`` bytes of dynamic shared memory."""
    from numba.cuda.cudadrv.driver import binding, driver

    fn = kernel._codelibrary.get_cufunc()
    if _SHARED_ALLOWED.get(id(fn), 0) < smem:
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, smem, fn.handle, fn.device.id)
        _SHARED_ALLOWED[id(fn)] = smem


def gpu_available() -> bool:
    """True on a real CUDA device (never in the simulator)."""
    return not SIMULATOR and cuda.is_available()


class SideStream:
    """A second stream for work that is independent of the main stream's, inside one step.

    ``side = fork(main)`` makes the side stream wait for everything launched on ``main`` so far
    and returns it; ``join(main)`` makes ``main`` wait for everything launched on the side.
    Inside a stream capture the event record / wait pairs become graph edges, so the captured
    graph runs the two branches concurrently — many decode kernels are small and latency-bound
    and leave most SMs idle. In the simulator (launches run one by one) ``fork`` returns
    ``main`` itself and ``join`` does nothing."""

    def __init__(self):
        self.stream = None if SIMULATOR else cuda.stream()
        self.forked = None if SIMULATOR else cuda.event(timing=False)
        self.joined = None if SIMULATOR else cuda.event(timing=False)

    def fork(self, main):
        if self.stream is None:
            return main
        self.forked.record(main)
        self.forked.wait(self.stream)
        return self.stream

    def join(self, main) -> None:
        if self.stream is not None:
            self.joined.record(self.stream)
            self.joined.wait(main)


_EMPTY_VECTORS: dict = {}


def empty_vector(dtype):
    """A zero-length 1-D device array of ``dtype``, made once: the stand-in for an optional
    vector argument that is absent (no allocation per call, none inside a graph capture)."""
    key = np.dtype(dtype).str
    if key not in _EMPTY_VECTORS:
        _EMPTY_VECTORS[key] = cuda.device_array(0, dtype)
    return _EMPTY_VECTORS[key]


_STREAM_BUFFERS: dict = {}


def stream_buffer(name: str, stream, shape: tuple, dtype):
    """A device array for ``name`` private to ``stream``: scratch that one launch writes and the
    next on the same stream reads (launches on one stream run in order, so they can share it;
    the decode's concurrent branches get their own). Allocated on first use — before any graph
    capture, since capture_graph warms its launches — and kept, as a captured graph holds its
    address."""
    key = (name, id(stream), tuple(shape), np.dtype(dtype).str)
    if key not in _STREAM_BUFFERS:  # the entry keeps the stream alive: its id is not reused
        _STREAM_BUFFERS[key] = (stream, cuda.device_array(shape, dtype))
    return _STREAM_BUFFERS[key][1]


def capture_graph(launches, stream, warm: bool = True):
    """Capture ``launches`` (zero-argument callables launching on ``stream``) as one CUDA graph;
    returns a zero-argument ``replay`` (gpu_notes §7: ~1.2 µs per kernel on replay instead of
    20-120 µs per Python launch).

    With ``warm`` each launch runs once first so that compilation, module load and any lazy
    allocation happen outside the capture (``warm=False`` when running them would change state
    the caller keeps: the caller has run them already). The graph holds raw device pointers,
    so ``replay`` keeps the launch callables — and through them every array they use — alive
    for as long as it lives.
    """
    from cuda.bindings import driver as drv

    def ok(result):
        if result[0] != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA graph capture failed: {result[0]}")
        return result[1] if len(result) > 1 else None

    launches = list(launches)
    for launch in dict.fromkeys(launches) if warm else ():  # warm each distinct callable once
        launch()
    stream.synchronize()
    h = stream.handle
    cs = drv.CUstream(h.value if hasattr(h, "value") else int(h))
    ok(drv.cuStreamBeginCapture(cs, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    try:
        for launch in launches:
            launch()
    finally:
        graph = ok(drv.cuStreamEndCapture(cs))
    exe = ok(drv.cuGraphInstantiate(graph, 0))

    def replay():
        ok(drv.cuGraphLaunch(exe, cs))

    replay.launches = launches  # keep every captured array alive with the graph
    replay.graph = (graph, exe)
    return replay
