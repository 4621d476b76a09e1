"""Programmatic dependent launch (Hopper): a kernel is launched before its predecessor is done.

A decode step is ~1,800 dependent launches, most of them a few µs long. Launched with
programmatic stream serialization (sm_90, CUDA >= 12.3; stream capture keeps it as
programmatic graph edges), a kernel may start once every block of the kernel before it on
its stream has exited (or triggered), without waiting for that grid's completion to be
processed; its threads then stop at ``griddepcontrol.wait`` until the predecessor has
completed and its memory is visible. The order of the stream is kept exactly; only launch
latency moves.

How pocketfm uses it (``device.kernel`` applies it to every kernel when ``ENABLED``):
- every kernel body runs behind a prologue, ``griddepcontrol.wait``, before any load or
  store: no kernel touches memory before its stream predecessor has finished, so a chain
  A -> B -> C also orders C after A (C waits for B, which waited for A);
- no kernel triggers its successor early (``griddepcontrol.launch_dependents`` at the top of
  every kernel measured 4% slower on the H200; not investigated, a likely cause is the
  successor's blocks parked at their wait on SMs; at the top of only the four small kernels
  before the dense GEMVs, whose first weight loads then went out before their wait, 1.4%
  slower on the H100, and those loads before the wait without the early trigger 0.9%
  slower, BENCHMARKS 2026-12-06 (n)), so the trigger is each block's exit;
- their launches carry the serialization attribute (``install`` wraps numba's launch
  function, ``marked`` each of these kernels; numba's own kernels and cooperative launches
  keep numba's path). ``USE_ATTRIBUTE = False`` launches the same kernels plainly (the wait
  then returns at once): for A/B measurements.

Off in the simulator, on a GPU below sm_90 (``device_takes_it``), and where ``POCKETFM_PDL``
is 0 / off / false / no. The prologue is sm_90 PTX, which CI lane B compiles and checks
(``check_prologue``).
"""
from __future__ import annotations

import inspect
import linecache
import os

import numba
from numba import cuda

_OFF = ("0", "off", "false", "no")


def device_takes_it() -> bool:
    """False on a GPU below sm_90 (no griddepcontrol there); True on sm_90 and newer, and where
    no driver answers (CI's compile lane, which targets sm_90). Asks the driver directly: this
    runs at import, before numba has made a context."""
    try:
        from cuda.bindings import driver as drv

        ok = drv.CUresult.CUDA_SUCCESS
        if drv.cuInit(0)[0] != ok:
            return True
        err, dev = drv.cuDeviceGet(0)
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        err2, major = drv.cuDeviceGetAttribute(attr, dev) if err == ok else (err, 0)
        return err2 != ok or major >= 9
    except Exception:  # no driver library at all
        return True


ENABLED = (not numba.config.ENABLE_CUDASIM
           and os.environ.get("POCKETFM_PDL", "1").strip().lower() not in _OFF
           and device_takes_it())
USE_ATTRIBUTE = True

if not numba.config.ENABLE_CUDASIM:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _wait_for_predecessor(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "griddepcontrol.wait;",
                               "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return types.void(), codegen


def with_prologue(fn):
    """A kernel function with ``fn``'s name and parameters whose body is the wait, then ``fn``
    (compiled as an inlined device function): what ``device.kernel`` compiles."""
    params = ", ".join(inspect.signature(fn).parameters)
    body = cuda.jit(device=True)(fn)
    ns = {"_prologue": _wait_for_predecessor, "_body": body}
    src = f"def {fn.__name__}({params}):\n    _prologue()\n    _body({params})\n"
    name = f"<pdl prologue of {fn.__module__}.{fn.__qualname__}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # for lineinfo
    exec(compile(src, name, "exec"), ns)
    wrapper = ns[fn.__name__]
    wrapper.__qualname__, wrapper.__doc__ = fn.__qualname__, fn.__doc__
    wrapper.__module__ = fn.__module__
    return wrapper


# the PTX instructions that touch global memory (a prologue must come before each of them)
_GLOBAL_ACCESS = ("ld.global", "st.global", "atom.global", "red.global", "ld.volatile.global",
                  "st.volatile.global", "prefetch.global", "cp.async")


def check_prologue(ptx: str) -> str | None:
    """None if the kernel's PTX waits for its predecessor (``griddepcontrol.wait``) exactly
    once and before its first global memory access, else what is wrong (CI lane B checks
    every kernel: a launch with the attribute would otherwise race its predecessor)."""
    waits = ptx.count("griddepcontrol.wait")
    if waits != 1:
        return f"{waits} griddepcontrol.wait instructions, expected 1"
    first = min((i for i in (ptx.find(op) for op in _GLOBAL_ACCESS) if i >= 0), default=-1)
    if 0 <= first < ptx.find("griddepcontrol.wait"):
        line = ptx[first:].split("\n", 1)[0].strip()
        return f"global memory accessed before griddepcontrol.wait: {line!r}"
    return None


_installed: list = []
_launching: list = []  # non-empty while one of pocketfm's kernels (with the prologue) launches


def install() -> None:
    """Let pocketfm's kernels launch with programmatic stream serialization (once per process;
    a no-op unless ENABLED). numba-cuda launches through ``cuda.core.launch(stream, config,
    kernel, *args)``; its dispatcher's reference to that function is wrapped so that the launch
    config carries the attribute, but only inside ``marked`` dispatchers' calls: numba's own
    kernels (a device array's slice assignment launches one) have no prologue, and with the
    attribute they could start before their predecessor had finished."""
    if _installed or not ENABLED:
        return
    from numba.cuda import dispatcher

    core_launch = dispatcher.launch

    def launch(stream, config, kern, *args):
        configure(config)
        core_launch(stream, config, kern, *args)

    dispatcher.launch = launch
    _installed.append(core_launch)


def configure(config) -> None:
    """Set the attribute on a cuda.core launch config if a ``marked`` kernel is launching."""
    if _launching and USE_ATTRIBUTE and not getattr(config, "is_cooperative", False):
        config.programmatic_stream_serialization = True


def marked(disp):
    """``disp`` (a kernel compiled from ``with_prologue``) with its launches marked for the
    attribute: its ``call``, which every ``disp[grid, block, stream](...)`` goes through."""
    call = disp.call

    def marked_call(args, launch_config):
        _launching.append(True)
        try:
            return call(args, launch_config)
        finally:
            _launching.pop()
    disp.call = marked_call
    return disp
