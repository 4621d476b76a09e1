"""Kernel benchmark harness: each family's ``bench_cases()`` feeds ``bin/bench-kernels``.

A case is a zero-argument callable that launches the kernel once on ``stream`` at V4-Flash
shapes, plus the ideal bytes it must move (each input read once, each output written once) and
its FLOPs. Timing uses CUDA events around ``reps`` launches after warm-up; the reported GB/s is
ideal bytes over median time, and the percentage is against the device-to-device copy bandwidth
measured in the same run (read + write counted), the practical ceiling (gpu_notes.md §9).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numba import cuda


@dataclass
class BenchCase:
    family: str
    name: str  # what runs, at which shape, e.g. "gemv_q8_0 32768x1024"
    launch: Callable[[], None]  # one launch on the case's stream
    bytes: int  # ideal bytes moved
    flops: int = 0
    target: str = ""  # the target for this case, if any ("75% copy bw", "<= 150 us")
    check: Callable[[], float] | None = None  # returns rel error vs the reference (optional)
    extra: dict = field(default_factory=dict)
    launches: int = 1  # kernel launches per call of ``launch`` (a captured graph of several);
    # bytes and FLOPs count all of them, the reported time is per launch


def time_launches(launch: Callable[[], None], stream, reps: int = 50, warmup: int = 5,
                  rounds: int = 5) -> float:
    """Median seconds per launch over ``rounds`` event-timed batches of ``reps`` launches."""
    for _ in range(warmup):
        launch()
    stream.synchronize()
    times = []
    for _ in range(rounds):
        e0, e1 = cuda.event(), cuda.event()
        e0.record(stream)
        for _ in range(reps):
            launch()
        e1.record(stream)
        e1.synchronize()
        times.append(cuda.event_elapsed_time(e0, e1) / 1e3 / reps)
    return statistics.median(times)


def copy_bandwidth(stream, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    n = nbytes // 4
    a = cuda.to_device(np.random.default_rng(0).random(n, dtype=np.float32), stream=stream)
    b = cuda.device_array_like(a, stream=stream)
    t = time_launches(lambda: b.copy_to_device(a, stream=stream), stream, reps=10, rounds=5)
    return 2 * nbytes / t
