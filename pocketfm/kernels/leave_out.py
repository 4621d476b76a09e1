"""Launches left out on purpose: what one kernel costs a decode step (``bench --decode-without``).

A step is a chain of ~20 dependent launches a layer; a kernel's time alone (ncu) is not what
removing it would save, since its launch, ramp and the wait of the kernel after it are in the
step too. Leaving its launches out of the captured step and timing the replays measures that
saving directly: the upper bound of fusing the kernel into its neighbours, before building it.
Timing only: every buffer those launches would have written keeps its last contents, so the
step's outputs are wrong while a pattern is set (and the step as landed must have run first:
an expert id or a top-k pick never written would be garbage to the kernels that index by it).

``device.kernel`` makes every pocketfm kernel skippable; nothing is left out unless a caller
is inside ``leaving_out``.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter

_PATTERNS: list = []  # compiled; while non-empty, a kernel whose name matches the last is skipped
counts: Counter = Counter()  # kernel name -> launches left out since the last ``leaving_out``


@contextlib.contextmanager
def leaving_out(pattern: str | None):
    """Inside: launches of kernels whose names match ``pattern`` (re.search; None: none) are
    not made, and ``counts`` counts them by name."""
    counts.clear()
    if pattern is None:
        yield counts
        return
    _PATTERNS.append(re.compile(pattern))
    try:
        yield counts
    finally:
        _PATTERNS.pop()


def kernel_name(disp) -> str:
    """A kernel's name as ncu shows its function (a dispatcher's own ``__name__`` where a
    module gave it one, else its Python function's)."""
    return disp.__dict__.get("__name__") or getattr(disp, "py_func", disp).__name__


def _left_out(disp) -> bool:
    if not _PATTERNS:
        return False
    name = kernel_name(disp)
    if _PATTERNS[-1].search(name) is None:
        return False
    counts[name] += 1
    return True


def skippable(disp):
    """``disp`` with its launches skipped inside ``leaving_out`` when its name matches: on a
    GPU through the dispatcher's ``call`` (every ``disp[grid, block, stream](...)`` goes
    through it), in the simulator through its kernel object's class (it has no ``call``)."""
    if hasattr(disp, "call"):
        call = disp.call

        def call_unless_left_out(args, launch_config):
            return None if _left_out(disp) else call(args, launch_config)
        call_unless_left_out.__wrapped__ = call  # (pdl's marked_call, on sm_90)
        disp.call = call_unless_left_out
    else:
        disp.__class__ = _simulated(type(disp))
    return disp


_SIM_CLASSES: dict = {}


def _simulated(cls):
    """A subclass of the simulator's kernel class whose launches check the patterns first."""
    if cls not in _SIM_CLASSES:
        def __call__(self, *args):
            return None if _left_out(self) else cls.__call__(self, *args)
        _SIM_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _SIM_CLASSES[cls]
