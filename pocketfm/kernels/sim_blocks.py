"""Numba's CUDA simulator with a block's threads taking turns (CI lane A's speed).

numba-cuda's simulator (0.30) starts a new OS thread for every simulated thread of every block,
lets them all run at once, and has the launching thread poll them in a busy loop to release the
barriers. In a CPU-bound test most of the time goes there: a decode step of the engine's test
model (188 launches, 11,872 simulated threads) spent 48 of its 60 s in ``Thread.start`` waiting
for the GIL, and an hmma test 270 of 280 s in the polling loop (cProfile, 2026-12-05).

Here a block's threads are taken from a pool that lives as long as the process, and only one
of them runs at a time: it runs until it reaches a barrier or ends, then hands the turn to the
next one; when every thread of the block has arrived at the barrier or ended, the first waiting
one starts the next phase. Any order of the threads between two barriers is one a GPU may run,
so a kernel without data races computes what it computes under numba's scheduler (which
interleaves them where the GIL switches). The simulated thread's view is unchanged: the kernel
API asks ``threading.current_thread()`` for ``threadIdx``, ``blockIdx``, ``thread_id`` and the
``syncthreads`` family, and a pool thread answers for the simulated thread it runs.

A thread that spins on a value another thread of its block writes without a barrier between
them would wait forever here (under numba's scheduler it waits until the GIL switches); no
kernel of this project does. ``POCKETFM_SIM_SCHEDULER=numba`` keeps numba's own scheduler.
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np


class _Aborted(Exception):
    """Raised at a barrier in the other threads of a block one of whose threads failed."""


class _PoolThread(threading.Thread):
    """One OS thread that runs simulated threads, one at a time, for as long as the process."""

    def __init__(self):
        super().__init__(daemon=True, name="pocketfm-sim")
        self._turn = threading.Lock()  # held while parked; released to give this thread a turn
        self._turn.acquire()
        self.block = None
        self.start()

    def run(self):
        while True:
            self._turn.acquire()
            block = self.block
            try:
                if block.error is None:  # (a thread not yet started when another failed: skip)
                    block.fn()
            except _Aborted:
                pass
            except Exception as e:  # noqa: BLE001 - re-raised in the launching thread
                block.fail(self, e, sys.exc_info()[2])
            block.ended(self)

    # ---- the kernel API's view of the current simulated thread --------------------------
    def syncthreads(self):
        block = self.block
        block.arrive(self)
        self._turn.acquire()
        if block.error is not None:
            raise _Aborted

    def _vote(self, value, reduce):
        block = self.block
        block.votes[self.thread_id] = bool(value)
        self.syncthreads()
        result = reduce(block.votes)
        self.syncthreads()  # everyone read the votes before any thread writes the next ones
        return result

    def syncthreads_count(self, value):
        return self._vote(value, lambda v: int(np.count_nonzero(v)))

    def syncthreads_and(self, value):
        return self._vote(value, lambda v: 1 if all(v) else 0)

    def syncthreads_or(self, value):
        return self._vote(value, lambda v: 1 if any(v) else 0)


_POOL: list[_PoolThread] = []
_POOL_LOCK = threading.Lock()


def _threads(n):
    with _POOL_LOCK:
        while len(_POOL) < n:
            _POOL.append(_PoolThread())
        return _POOL[:n]


class TurnBlockManager:
    """Drop-in for numba's ``simulator.kernel.BlockManager``: runs one block of a launch."""

    def __init__(self, f, grid_dim, block_dim, debug):
        from numba.cuda.simulator.kernelapi import Dim3

        self._f, self._debug, self._dim3 = f, debug, Dim3
        self._block_dim = tuple(block_dim)
        self.size = int(np.prod(self._block_dim))
        self.votes = [False] * self.size

    def run(self, grid_point, *args):
        f, debug = self._f, self._debug

        def body():
            if debug:
                np.seterr(divide="raise")
            f(*args)
        self.fn = body
        self.error = None
        bx, by, _ = self._block_dim
        threads = _threads(self.size)
        block_idx = self._dim3(*grid_point)
        for t, point in zip(threads, np.ndindex(*self._block_dim)):
            t.block = self
            t.threadIdx, t.blockIdx = self._dim3(*point), block_idx
            t.thread_id = point[0] + bx * (point[1] + by * point[2])
        self._queue = list(reversed(threads))  # who runs next in this phase (popped from the end)
        self._waiting = []  # arrived at the barrier, in arrival order
        self._done = threading.Lock()
        self._done.acquire()
        self._next()
        self._done.acquire()  # released by the last thread to end
        if self.error is not None:
            raise self.error[0].with_traceback(self.error[1])

    # ---- called by the thread holding the turn ------------------------------------------
    def _next(self):
        """Give the turn to the next thread of this phase, or start the next phase, or end."""
        if not self._queue and self._waiting:
            self._queue, self._waiting = list(reversed(self._waiting)), []
        if self._queue:
            self._queue.pop()._turn.release()
        else:
            self._done.release()

    def arrive(self, thread):
        self._waiting.append(thread)
        self._next()

    def ended(self, thread):
        self._next()

    def fail(self, thread, e, tb):
        """The first failure is the launch's error, named by thread as numba names it; the
        other threads of the block are stopped at their next barrier."""
        if self.error is None:
            where = f"tid={list(thread.threadIdx)} ctaid={list(thread.blockIdx)}"
            try:
                e = type(e)(f"{where}: {e}" if str(e) else where)
            except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                pass
            self.error = (e, tb)


def install():
    """Use TurnBlockManager for every simulated launch of this process (no-op where numba's
    simulator is not the one this was written against, or when POCKETFM_SIM_SCHEDULER=numba)."""
    if os.environ.get("POCKETFM_SIM_SCHEDULER", "") == "numba":
        return
    from numba.cuda.simulator import kernel as sim_kernel

    if getattr(sim_kernel, "BlockManager", None) is not None:
        sim_kernel.BlockManager = TurnBlockManager
