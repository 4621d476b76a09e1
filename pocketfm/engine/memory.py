"""The Memory Indexer on the GPU engine: the resident set where the captured step can read it.

The decode graph stays one graph. Inside it, each step
  * copies the attention input of every retriever target layer into ``xs[L, D]`` (the scorer's
    x, at a fixed address);
  * in every CSA layer, sets the native indexer's score of each committed, non-resident chunk to
    -inf before its top-k and drops such chunks from the top-k after it (fewer resident chunks
    than k), reading ``resident[N]`` (uint8) and ``n_commit[1]`` (chunks the set covers; newer
    chunks stay selectable: the decode region).
Between two replays, at a cycle boundary (every ``interval`` decode steps, memory/runtime.py),
the host launches the retriever scorer over each target layer's packed keys, reads the logits
back (the one host sync of a cycle, not of a step), selects in NumPy (memory/selection.py, the
same code as the CPU path) and uploads the new set for the next replay (the n -> n+1 commit).

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
        self.rows = {layer: row for row, layer in enumerate(sorted(memory.targets))}
        self.scorer = None
        if self.rows:
            from ..kernels.retriever import RetrieverScorer

            self.xs = cuda.to_device(np.zeros((len(self.rows), cfg.dim), np.float32), stream=s)
            self.z = cuda.device_array((len(self.rows), self.n4), np.float32, stream=s)
            self.scorer = RetrieverScorer(memory.retriever, memory.freq, self.n4, stream=s)
            self._score(1, 0)  # compile the scorer now, not inside the first decode cycle
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
             work=self.topk_work)
        sk.sort_selected(self.gsel, stream)
        sk.flag_after_prompt(self.g_active, eng.meta, stream)

    # ---- between replays ----------------------------------------------------------------------
    def reset(self, n_prompt: int) -> None:
        """A new sequence: everything resident until the first boundary."""
        self.memory.start(n_prompt, self.eng.capacity)
        self._upload(None, 0)
        if self.global_mode:
            self.g_active.copy_to_device(np.zeros(1, np.int32), stream=self.eng.stream)

    def begin(self, pos: int) -> None:
        self.memory.begin(pos, 1)

    def after_step(self, n_tokens: int) -> None:
        """The step that leaves ``n_tokens`` in the context has been launched: at a boundary,
        score, select and commit the set for the next replay."""
        if self.global_mode:  # selected inside the step: the host only counts
            self.memory.step_done(n_tokens, None)
        elif self.memory.step_done(n_tokens, self._logits):
            m = self.memory
            self._upload(m.active, m.n_commit)

    def _score(self, n: int, pos: int) -> None:
        keys = [self.eng.caches[layer].index_keys for layer in sorted(self.rows)]
        self.scorer.score(self.z, self.xs, pos, keys, n, stream=self.eng.stream)

    def _logits(self, n: int, pos: int) -> np.ndarray:
        """z[L, n] of the target layers, scored on the GPU after the step that wrote xs."""
        s = self.eng.stream
        self._score(n, pos)
        z = self.z.copy_to_host(stream=s)
        s.synchronize()
        return z[:, :n]

    def _upload(self, active, n_commit: int) -> None:
        """The committed set for the next replays (and, with KV swap, its chunks staged)."""
        if self.eng.swap is not None and n_commit > 0:
            self.eng.swap.commit(active, n_commit)
        res = np.ones(self.n4, np.uint8)
        if active is not None:
            res[:n_commit] = active[:n_commit]
        s = self.eng.stream
        self.resident.copy_to_device(res, stream=s)
        self.n_commit.copy_to_device(np.array([n_commit], np.int32), stream=s)
