"""The Memory Indexer on the GPU engine: the resident set where the captured step can read it.

The decode graph stays one graph. Inside it, each step
  * copies the attention input of every retriever target layer into ``xs[L, D]`` (the scorer's
    x, at a fixed address);
  * in every CSA layer, sets the native indexer's score of each committed, non-resident chunk to
    -inf before its top-k and drops such chunks from the top-k after it (fewer resident chunks
    than k), reading ``resident[N]`` (uint8) and ``n_commit[1]`` (chunks the set covers; newer
    chunks stay selectable: the decode region).
A cycle runs between replays, off the decode stream (memory/runtime.py, flashmemory.md §6):

  boundary step s   launched; xs copied to ``xs_cycle`` and an event recorded on the decode
                    stream. The cycle stream waits for it, scores every chunk of each target
                    layer and copies the logits to pinned host memory (event ``scored``).
  steps s+1 ..      keep replaying with the old set. Once ``scored`` has fired (polled after each
                    launch, never waited for) the host selects in NumPy (memory/selection.py,
                    the same code as the CPU path) and stages the new set on the cycle stream:
                    ``resident``/``n_commit`` into their ``_next`` copies and, with KV swap, the
                    stores, the early swap-ins and the LUT (engine/kvswap.py) (event ``staged``).
  after step s+lag  the decode stream waits for ``staged``, swaps in what could not go early,
                    copies the ``_next`` buffers over the live ones; step s+lag+1 sees the set.

With ``lag`` 0 (``--commit-lag 0``, the default without KV swap) the host waits for the scores
at the boundary itself: the plain n -> n+1 commit.

``global-topk`` (the seed's mode) rescores every step, so it runs inside the graph instead: at
the end of each step the scorer (position and chunk count read on the device), the ensemble and
a top-``index_topk`` fill ``gsel``; from the next decode step on (``g_active``, set once the
prompt is consumed) every CSA layer's top-k is replaced by it. No host sync at all.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from ..errors import InputError
from ..kernels.moe import broadcast_rows
from ..kernels import device
from . import step_kernels as sk


class EngineMemory:
    """Device side of one ``memory.MemoryIndexer`` attached to a ``DecodeEngine``."""

    def __init__(self, eng, memory):
        if memory.sel.recall_diagnostic:
            raise InputError("--recall-diagnostic: runs on the CPU path only (it needs the "
                             "native full-history top-k beside the restricted one)")
        self.eng, self.memory = eng, memory
        s, cfg = eng.stream, eng.cfg
        self.n4 = max(1, eng.capacity // 4)
        self.resident = cuda.to_device(np.ones(self.n4, np.uint8), stream=s)  # resident[N]
        self.n_commit = cuda.to_device(np.zeros(1, np.int32), stream=s)
        # the next set, staged on the cycle stream from pinned host copies
        self.resident_next = cuda.device_array_like(self.resident, stream=s)
        self.n_commit_next = cuda.device_array_like(self.n_commit, stream=s)
        self.resident_host = cuda.pinned_array(self.n4, np.uint8)
        self.n_commit_host = cuda.pinned_array(1, np.int32)
        self.cycle_stream = s if device.SIMULATOR else cuda.stream()
        self.boundary, self.scored, self.staged = (None if device.SIMULATOR else
                                                   cuda.event(timing=False) for _ in range(3))
        self.prepared = False  # the pending cycle's set is staged
        self.rows = {layer: row for row, layer in enumerate(sorted(memory.targets))}
        self.scorer = None
        if self.rows:
            from ..kernels.retriever import RetrieverScorer

            self.xs = cuda.to_device(np.zeros((len(self.rows), cfg.dim), np.float32), stream=s)
            self.xs_cycle = cuda.device_array_like(self.xs, stream=s)  # the boundary's x
            self.z = cuda.device_array((len(self.rows), self.n4), np.float32, stream=s)
            self.z_host = cuda.pinned_array((len(self.rows), self.n4), np.float32)
            # (the engine's launch shapes: in the simulator 32 threads and the serial norm /
            # Hadamard, as retriever_query says; their fast forms have their own tests)
            self.scorer = RetrieverScorer(memory.retriever, memory.freq, self.n4, stream=s,
                                          threads=eng.nt, **eng.sim)
            self._score(1, 0, s)  # compile the scorer now, not inside the first decode cycle
        self.global_mode = memory.sel.mode == "global-topk"
        if self.global_mode:
            from ..kernels.indexer import topk_workspace

            k = cfg.index_topk
            self.gsel = cuda.to_device(np.full((1, k), -1, np.int32), stream=s)  # [1, k]
            self.g_active = cuda.to_device(np.zeros(1, np.int32), stream=s)
            self.e = cuda.device_array(self.n4, np.float32, stream=s)
            self.topk_work = topk_workspace(s)

    # ---- inside the captured step ---------------------------------------------------------------
    def snapshot(self, layer: int, u, stream, threads=None) -> None:
        """xs[row] <- u [1, D] for a target layer (the retriever's x, §2)."""
        row = self.rows.get(layer)
        if row is not None:
            broadcast_rows(self.xs[row:row + 1], u, stream, threads=threads)

    def mask_scores(self, scores, stream) -> None:
        sk.mask_nonresident(scores, self.resident, self.n_commit, stream)

    def drop_selected(self, sel, stream) -> None:
        sk.drop_nonresident(sel, self.resident, self.n_commit, stream)
        if self.global_mode:  # the seed's mode: the global set replaces the native choice
            sk.copy_if_flag(sel, self.gsel.reshape(sel.shape[0]), self.g_active, stream)

    def end_of_step(self, stream, threads=None) -> None:
        """global-topk: score this step's x over every visible chunk, ensemble, top-k: the set
        of the next step (n -> n+1), active once the prompt is consumed."""
        if not self.global_mode:
            return
        from ..kernels.indexer import topk
        from ..kernels.retriever import ENSEMBLE_MAX, ENSEMBLE_MEAN, ensemble

        eng, k = self.eng, self.eng.cfg.index_topk
        n = eng.n_comp[4]  # chunks visible after this step's token
        keys = [eng.caches[layer].index_keys for layer in sorted(self.rows)]
        self.scorer.score_in_graph(self.z, self.xs, eng.pos, n, keys, stream)
        how = ENSEMBLE_MEAN if self.memory.sel.ensemble == "mean" else ENSEMBLE_MAX
        ensemble(self.e, self.z, n, how, stream)
        topk(self.gsel.reshape(k), self.e, n, k, stream=stream, threads=threads,
             work=self.topk_work)  # (ascending: as the native top-k's)
        sk.flag_after_prompt(self.g_active, eng.meta, stream)

    # ---- between replays ----------------------------------------------------------------------
    def reset(self, n_prompt: int) -> None:
        """A new sequence: everything resident until the first boundary."""
        self.memory.start(n_prompt, self.eng.capacity)
        self.prepared = False
        s = self.eng.stream
        self.resident.copy_to_device(np.ones(self.n4, np.uint8), stream=s)
        self.n_commit.copy_to_device(np.zeros(1, np.int32), stream=s)
        if self.global_mode:
            self.g_active.copy_to_device(np.zeros(1, np.int32), stream=s)

    def drain(self) -> None:
        """Wait for the cycle stream: a cycle staged as the last sequence ended may still be
        storing into the pool that the next prompt rewrites."""
        self.cycle_stream.synchronize()

    def begin(self, pos: int) -> None:
        self.memory.begin(pos, 1)

    def after_step(self, n_tokens: int) -> None:
        """The step that leaves ``n_tokens`` in the context has been launched: mark a boundary,
        stage a pending set whose scores are in, put a due set in force (module docstring)."""
        m = self.memory
        if self.global_mode:  # selected inside the step: the host only counts
            m.step_done(n_tokens, None)
            return
        if m.cycle_due():
            self.mark_boundary()
        if m.step_done(n_tokens, self._launch_scores):  # due: in force from the next step
            if not self.prepared:
                self.stage(m.active, m.n_commit)
            self.switch(n_tokens)
        elif m.pending is not None and not self.prepared and self._scores_in():
            self.stage(*m.pending_set())

    def mark_boundary(self) -> None:
        """The step just launched is a boundary: the cycle stream starts after it."""
        s = self.eng.stream
        if self.rows:  # step s+1 rewrites xs while the cycle stream scores
            self.xs_cycle.copy_to_device(self.xs, stream=s)
        if self.boundary is not None:
            self.boundary.record(s)
            self.boundary.wait(self.cycle_stream)

    def _scores_in(self) -> bool:
        return self.scored is None or self.scored.query()

    def _score(self, n: int, pos: int, stream, xs=None) -> None:
        keys = [self.eng.caches[layer].index_keys for layer in sorted(self.rows)]
        self.scorer.score(self.z, self.xs if xs is None else xs, pos, keys, n, stream=stream)

    def _launch_scores(self, n: int, pos: int):
        """Score the boundary's x on the cycle stream; returns the wait for z[L, n]."""
        c = self.cycle_stream
        self._score(n, pos, c, self.xs_cycle)
        self.z.copy_to_host(self.z_host, stream=c)
        if self.scored is not None:
            self.scored.record(c)

        def wait() -> np.ndarray:
            if self.scored is None:
                c.synchronize()
            else:
                self.scored.synchronize()
            return np.array(self.z_host[:, :n])
        return wait

    def stage(self, active, n_commit: int) -> None:
        """Stage the set (resident[n_commit] bool, or None: all) on the cycle stream: its
        ``_next`` buffers and, with KV swap, its chunks (engine/kvswap.py)."""
        c = self.cycle_stream
        if self.staged is not None:
            self.staged.synchronize()  # the last cycle's copies out of the pinned buffers
        if self.eng.swap is not None and n_commit > 0:
            self.eng.swap.stage(active, n_commit, c)
        self.resident_host[:] = 1
        if active is not None:
            self.resident_host[:n_commit] = active[:n_commit]
        self.n_commit_host[0] = n_commit
        self.resident_next.copy_to_device(self.resident_host, stream=c)
        self.n_commit_next.copy_to_device(self.n_commit_host, stream=c)
        if self.staged is not None:
            self.staged.record(c)
        self.prepared = True

    def switch(self, n_tokens: int) -> None:
        """Put the staged set in force for the next replay (decode stream, no host wait)."""
        s = self.eng.stream
        if self.staged is not None:
            self.staged.wait(s)
        if self.eng.swap is not None and self.eng.swap.pending:
            self.eng.swap.switch(n_tokens // 4)
        self.resident.copy_to_device(self.resident_next, stream=s)
        self.n_commit.copy_to_device(self.n_commit_next, stream=s)
        self.prepared = False

    def commit(self, active, n_commit: int, n_tokens: int) -> None:
        """A boundary, staged and switched at once (no lag; the benchmark's first set)."""
        self.mark_boundary()
        self.stage(active, n_commit)
        self.switch(n_tokens)
