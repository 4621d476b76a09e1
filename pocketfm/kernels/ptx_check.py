"""CI lane B: compile every kernel for sm_90 with ``numba.cuda.compile_ptx`` (no GPU needed).

    python -m pocketfm.kernels.ptx_check        # exit 0 ok, 1 a kernel failed, 3 no NVVM
    python -m pocketfm.kernels.ptx_check --only gemv,attention   # these modules' kernels
    python -m pocketfm.kernels.ptx_check --skip gemv,attention   # every other module's

Must run WITHOUT the simulator (``NUMBA_ENABLE_CUDASIM`` unset or 0), in its own process: the
simulator and the compiler cannot share one. Needs the nvidia-nvvm, nvidia-cuda-nvrtc and
nvidia-nvjitlink wheels (the ``[ptx]`` extra): each kernel's PTX is also assembled (nvJitLink),
and a kernel with a register budget (its module's ``REGISTER_BUDGETS``) checked against it.
With programmatic dependent launch on (pdl.py; the default outside the simulator) each kernel's
PTX must also wait for its predecessor before its first global memory access.
"""
from __future__ import annotations

import importlib
import os
import sys
import time

from . import FAMILIES


ENGINE_MODULES = ("pocketfm.engine.step_kernels", "pocketfm.engine.synthetic_weights")  # kernels outside the op families


def module_names() -> dict[str, str]:
    """Every module with kernels, short name -> full name: the op families', then the engine's."""
    full = [f"pocketfm.kernels.{fam}" for fam in FAMILIES] + list(ENGINE_MODULES)
    return {name.rsplit(".", 1)[-1]: name for name in full}


def all_signatures(only=None, skip=()):
    """(module, kernel, signature) for every kernel of every family and of the engine (of the
    modules whose short names are in ``only``, if given, and not in ``skip``)."""
    for short, name in module_names().items():
        if (only is not None and short not in only) or short in skip:
            continue
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # family not written yet
            raise
        for kern, sig in getattr(mod, "PTX_SIGNATURES", []):
            yield name.rsplit(".", 1)[-1], kern, sig


class _FakeDevice:
    compute_capability = (9, 0)


def _pretend_sm90_device():
    """Let device functions compile without a driver.

    ``compile_ptx`` of a kernel compiles the ``cuda.jit(device=True)`` helpers it calls through
    ``Dispatcher.compile_device``, which asks the *current device* for its compute capability
    and so needs a driver (numba-cuda 0.30.4). CI has none: answer sm_90 for it. This only
    affects this checking process.
    """
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: _FakeDevice()


def _names(argv, flag):
    """The comma-separated module names after ``flag`` in argv (None if absent, {""} if the
    flag has no value: not a module name, so main reports it)."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    return set(argv[i + 1].split(",")) if i + 1 < len(argv) else {""}


def nvjitlink_missing() -> str | None:
    """None if libnvJitLink loads (the ``[ptx]`` extra's wheel), else why not."""
    try:
        from cuda.bindings import nvjitlink

        nvjitlink.destroy(nvjitlink.create(1, ["-arch=sm_90"]))
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


EIATTR_REGCOUNT = 0x2F  # an .nv.info attribute: (function symbol, registers), format 4 (sized)


def cubin_registers(cubin: bytes) -> int:
    """The most registers any function of an sm_90 ``cubin`` (ELF) uses, from its .nv.info
    sections' EIATTR_REGCOUNT entries (what ``ptxas -v`` prints as "Used N registers")."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
             for i in range(shnum)]
    names = heads[shstrndx][4]
    most = 0
    for h in heads:
        name = cubin[names + h[0]:cubin.index(b"\0", names + h[0])]
        if not name.startswith(b".nv.info"):
            continue
        data, i = cubin[h[4]:h[4] + h[5]], 0
        while i + 4 <= len(data):
            fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
            if fmt == 4 and attr == EIATTR_REGCOUNT:
                most = max(most, struct.unpack_from("<I", data, i + 8)[0])
            i += 4 + (size if fmt == 4 else 0)
    return most


def register_budget(kern):
    """(most registers, why) that ``kern``'s module promises for it (its ``REGISTER_BUDGETS``,
    kernel -> (n, why)), or None: a kernel whose launcher relies on a block size only so few
    registers allow, and would fall back without a word if a change grew it."""
    fn = getattr(kern, "source_fn", None) or kern.py_func
    return getattr(sys.modules.get(fn.__module__), "REGISTER_BUDGETS", {}).get(kern)


def _assemble(ptx: str, name: str, budget=None) -> str | None:
    """Assemble ``ptx`` for sm_90 with nvJitLink (ptxas inside): None, or the first line of its
    error log. NVVM can emit PTX that ptxas refuses (a branch to a label it never defined,
    2026-12-02): compiling to PTX alone would pass such a kernel. ``budget`` (n, why): also an
    error where the assembled kernel uses more than n registers."""
    from cuda.bindings import nvjitlink

    data = ptx.encode()
    h = nvjitlink.create(1, ["-arch=sm_90"])
    try:
        nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), name)
        nvjitlink.complete(h)
        if budget is not None:
            cubin = bytearray(nvjitlink.get_linked_cubin_size(h))
            nvjitlink.get_linked_cubin(h, cubin)
            used = cubin_registers(bytes(cubin))
            if used > budget[0]:
                return f"uses {used} registers, its budget is {budget[0]} ({budget[1]})"
        return None
    except nvjitlink.nvJitLinkError as e:
        log = bytearray(max(1, nvjitlink.get_error_log_size(h)))
        nvjitlink.get_error_log(h, log)
        lines = bytes(log).rstrip(b"\0").decode(errors="replace").strip().splitlines()
        return f"ptxas: {lines[0]}" if lines else f"ptxas: {e}"
    finally:
        nvjitlink.destroy(h)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only, skip = _names(argv, "--only"), _names(argv, "--skip") or set()
    known = module_names()
    unknown = ((only or set()) | skip) - set(known)
    if unknown:
        print(f"ptx_check: --only / --skip take module names, got {', '.join(sorted(unknown))!r};"
              f" known: {', '.join(sorted(known))}")
        return 2
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        print("ptx_check: unset NUMBA_ENABLE_CUDASIM (the simulator cannot compile PTX)")
        return 2
    from numba import cuda

    from . import pdl

    try:
        from numba.cuda.cudadrv.nvvm import NVVM

        NVVM()
    except Exception as e:  # no libnvvm: the wheels are not installed
        print(f"ptx_check: NVVM unavailable ({type(e).__name__}: {e})")
        return 3
    missing = nvjitlink_missing()
    if missing:
        print(f"ptx_check: nvJitLink unavailable ({missing})")
        return 3
    _pretend_sm90_device()
    failed, n, t0 = [], 0, time.time()
    for fam, kern, sig in all_signatures(only, skip):
        n += 1
        name = getattr(kern, "__name__", None) or getattr(kern, "py_func", kern).__name__
        try:
            ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0), lineinfo=True)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            failed.append(f"{fam}.{name} {sig}: {first}")
            continue
        wrong = ((pdl.check_prologue(ptx) if pdl.ENABLED else None)
                 or _assemble(ptx, name, register_budget(kern)))
        if wrong:
            failed.append(f"{fam}.{name} {sig}: {wrong}")
    for f in failed:
        print("FAILED", f)
    print(f"ptx_check: {n - len(failed)}/{n} kernels compiled and assembled for sm_90 in "
          f"{time.time() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
