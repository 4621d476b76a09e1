"""The Memory Indexer in a generation: cadence, commit, two-level selection, statistics
(flashmemory.md §1, §6, §7), on the NumPy forward.

The forward calls four hooks (``model.Forward.memory``):

    begin(pos0, T)                  a forward call starts: is it decode step s = pos0 - n_prompt?
    observe(layer, u)               a target layer's attention input (x of the scorer), when due
    select(layer, scores, n_vis, chosen)   a CSA layer's native top-k, restricted / replaced
    end(state)                      the step is done: score + select at a boundary, commit

Cadence (§6): decode steps s = 0, 1, ... are the single-token calls after the prompt (the prompt
itself, however it is chunked, runs fully resident). At s ≡ 0 (mod interval) the retriever
scores every chunk with this step's x; the set is committed for the steps AFTER s (the n → n+1
commit: the x of step s exists only mid-step, and consecutive windows overlap by 63/64).
Step 0 runs fully resident. Chunks formed after a boundary are resident until the next one (the
engine's decode region; the 128-token window covers them too).

Commit lag (``--commit-lag L``, flashmemory.md §6: "with asynchronous recall a set can become
effective a few steps later still"): the set of boundary s is computed from step s's x but
takes effect after step s + L, so that the GPU engine can read the scores back, select, and
swap the chunks in while steps s+1 .. s+L run (engine/memory.py). L = 0 is the plain n -> n+1
commit. The lag is part of the selection's meaning, so the NumPy forward honours it too.

Level 2 (§7): in every CSA layer the native indexer's top-k is taken over resident chunks only.
``global-topk`` (the seed's mode) instead replaces the native choice with the ensemble's global
top-``index_topk`` in every CSA layer, rescored every step.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..config import ModelConfig
from ..errors import InputError
from ..numerics import rope_tables
from .checkpoint import Retriever, RetrieverGeometry, csa_layers
from .scorer import retriever_logits_keys_ref, retriever_query_ref
from .selection import (NEEDS_RETRIEVER, SelectionConfig, edge_chunks, ensemble_keep,
                        random_chunks, select_chunks, select_pages)

CHUNK_TOKENS = 4  # one CSA entry = 4 tokens


@dataclass
class PendingCycle:
    """A cycle started at a boundary, in force after step ``due`` (boundary + lag)."""

    due: int
    n: int     # chunks at the boundary
    pos: int   # the boundary step's position (the scorer's query position)
    z: object  # z[L, n], a callable that waits for it, or None (no retriever)
    in_graph: bool = False  # global-topk on the GPU: selected inside the step
    result: tuple | None = None  # resolve()'s


class MemoryIndexer:
    """Level-1 selection for one sequence at a time; ``start`` before each generation."""

    def __init__(self, cfg: ModelConfig, sel: SelectionConfig, retriever: Retriever | None,
                 freq_compressed: np.ndarray, hadamard: np.ndarray):
        sel.check()
        if sel.mode in NEEDS_RETRIEVER and retriever is None:
            raise InputError(f"--selection {sel.mode}: needs --memory-indexer CKPT (a "
                             "checkpoint from make-retriever or the official safetensors)")
        self.cfg, self.sel, self.retriever = cfg, sel, retriever
        self.freq, self.hadamard = freq_compressed, hadamard.astype(np.float32)
        g = retriever.geometry if retriever else RetrieverGeometry.for_model(cfg)
        self.page = sel.page_size or g.page_size
        self.tail = g.recency_tail if sel.recency_tail is None else sel.recency_tail
        self.kmax_default = g.kmax if sel.kmax is None else sel.kmax
        self.max_position = g.max_position
        self.interval = 1 if sel.mode == "global-topk" else sel.interval
        self.targets = ({r.layer: r for r in retriever.layers}
                        if retriever is not None and sel.mode in NEEDS_RETRIEVER else {})
        self.csa = set(csa_layers(cfg))
        self.on_cycle = None  # called with each cycle's stats dict (``run --stats``)
        # steps from a boundary to its set taking effect: --commit-lag, or what the run's KV
        # swap plan chose (generate() sets it per run)
        self.lag = sel.commit_lag or 0
        self.start(0, cfg.ctx_train)

    # ---- per generation ---------------------------------------------------------------------
    def start(self, n_prompt: int, ctx: int) -> None:
        """Reset for a sequence of ``n_prompt`` prompt tokens in a context of ``ctx``."""
        self.n_prompt = n_prompt
        ctx_pages = -(-(ctx // CHUNK_TOKENS) // self.page)
        self.kmax = (math.ceil(self.sel.kmax_ratio * ctx_pages) if self.sel.kmax_ratio > 0
                     else self.kmax_default)
        self.active: np.ndarray | None = None  # resident[n_commit]; None = everything
        self.active_ids: np.ndarray | None = None  # global-topk: the chosen chunk ids
        self.n_resident = 0  # chunks of the committed set (O(1) per-step accounting)
        self.has_set = False  # a set has been committed (before: everything resident)
        self.n_commit = 0
        self.step: int | None = None
        self._x: dict[int, np.ndarray] = {}
        self.rng = np.random.default_rng(self.sel.seed)
        self.pending: PendingCycle | None = None  # computed at a boundary, not yet in force
        self.cycles: list[dict] = []
        self.fractions: list[float] = []
        self.recall_hits = self.recall_total = 0

    def _due(self) -> bool:
        return self.step is not None and self.step % self.interval == 0

    def cycle_due(self) -> bool:
        """Whether the current step (after ``begin``) is a boundary that starts a cycle."""
        return self._due() and self.sel.mode != "full"

    # ---- forward hooks ----------------------------------------------------------------------
    def begin(self, pos0: int, T: int) -> None:
        self.step = pos0 - self.n_prompt if T == 1 and pos0 >= self.n_prompt else None
        self._x.clear()

    def observe(self, layer: int, u: np.ndarray) -> None:
        if layer in self.targets and self._due():
            self._x[layer] = np.array(u[-1], np.float32)

    def resident(self, n_now: int) -> np.ndarray | None:
        """resident[n_now] in force at this step (chunks past the commit count as resident),
        or None when everything is."""
        if self.step is None or self.sel.mode == "full":
            return None
        if self.active_ids is not None:
            r = np.zeros(n_now, bool)
            r[self.active_ids[self.active_ids < n_now]] = True
            return r
        if self.active is None:
            return None
        r = np.ones(n_now, bool)
        r[:min(n_now, self.n_commit)] = self.active[:n_now]
        return r

    def select(self, layer: int, scores, n_vis, chosen) -> np.ndarray:
        """Level 2: the native top-k ``chosen`` [T, k] restricted to the resident set (or, in
        global-topk mode, replaced by it). -1 pads; the attention treats the set as a mask."""
        res = self.resident(scores.shape[1])
        if res is None:
            return chosen
        if self.active_ids is not None:
            out = np.full_like(chosen, -1)
            ids = self.active_ids[self.active_ids < int(n_vis[0])][:chosen.shape[1]]
            out[0, :len(ids)] = ids
        else:
            out = np.empty_like(chosen)
            ops.topk_visible(out, np.where(res[None, :], scores, -np.inf), n_vis)
            out[(out >= 0) & ~res[np.maximum(out, 0)]] = -1
        if self.sel.recall_diagnostic:
            native = chosen[chosen >= 0]
            self.recall_hits += int(res[native].sum())
            self.recall_total += len(native)
        return out

    def end(self, state) -> None:
        self.step_done(state.pos, lambda n, pos: self.layer_logits(state, n, pos))

    def step_done(self, n_tokens: int, logits_fn) -> bool:
        """After a step that leaves ``n_tokens`` in the context: count the resident share; at a
        boundary start a cycle with ``logits_fn(n, pos)`` -> z[L, n], or a zero-argument
        callable that waits for z (the GPU engine scores asynchronously); None: global-topk
        selected on the device inside the step, only counted here. Returns whether a new set
        was committed, i.e. is in force from the next step (``lag`` steps after its boundary)."""
        if self.step is None:
            return False
        n = n_tokens // CHUNK_TOKENS  # chunks formed so far (visible to the next step)
        if n:  # the share in force at this step, counted without building the mask
            full = not self.has_set
            new = 0 if self.sel.mode == "global-topk" else n - self.n_commit
            self.fractions.append(1.0 if full else (self.n_resident + new) / n)
        if self.cycle_due():
            z = None
            if self.sel.mode in NEEDS_RETRIEVER and logits_fn is not None:
                z = logits_fn(n, n_tokens - 1)
            self.pending = PendingCycle(self.step + self.lag, n, n_tokens - 1, z,
                                        in_graph=logits_fn is None)
        if self.pending is not None and self.step >= self.pending.due:
            self._commit(self.resolve())
            return True
        return False

    # ---- one cycle --------------------------------------------------------------------------
    def resolve(self) -> tuple:
        """Select the pending cycle's set (waiting for its logits); idempotent. Returns
        (resident[n] bool or None, chosen ids or None, n, n_resident, stats)."""
        p = self.pending
        if p.result is None:
            p.result = self._select(p)
        return p.result

    def pending_set(self) -> tuple[np.ndarray | None, int] | None:
        """(resident[n], n) of the pending cycle once resolved (None: nothing pending)."""
        if self.pending is None:
            return None
        resident, _, n, _, _ = self.resolve()
        return resident, n

    def _select(self, p: PendingCycle) -> tuple:
        t0 = time.perf_counter()
        sel, n = self.sel, p.n
        stats = {"step": p.due - self.lag, "position": p.pos, "chunks": n}
        if self.lag:
            stats["commit_step"] = p.due
        if sel.mode == "recency":
            resident, _ = edge_chunks(n, self.tail, 0)
        elif sel.mode == "random":
            resident = random_chunks(n, self.tail, sel.random_ratio, self.rng)
        elif sel.mode == "global-topk" and p.in_graph:  # chosen inside the GPU step
            stats["resident"] = min(self.cfg.index_topk, n)
            return None, None, n, stats["resident"], stats
        else:
            z = p.z() if callable(p.z) else p.z
            if sel.mode == "global-topk":
                keep, e = ensemble_keep(z, sel.ensemble, sel.threshold, self.cfg.index_topk)
                ids = np.flatnonzero(keep)
                stats.update(resident=len(ids), ms=_ms(t0))
                return None, ids, n, len(ids), stats
            keep, e = ensemble_keep(z, sel.ensemble, sel.threshold, sel.topk)
            stats.update(kept=int(keep.sum()), score_mean=float(e.mean()) if n else 0.0,
                         score_max=float(e.max()) if n else 0.0)
            if self.kmax > 0:
                resident, pages = select_pages(keep, self.page, self.kmax, self.tail, sel.sink)
                stats["pages"] = len(pages)
            else:
                resident = select_chunks(keep, self.tail, sel.sink)
        stats.update(resident=int(resident.sum()), ms=_ms(t0))
        return resident, None, n, stats["resident"], stats

    def _commit(self, result: tuple) -> None:
        """The pending set is in force from the next step."""
        resident, ids, n, n_resident, stats = result
        self.pending = None
        if ids is not None:
            self.active_ids = ids
        elif resident is not None:
            self.active = resident
        self.n_commit, self.n_resident = n, n_resident
        self.has_set = True
        self.cycles.append(stats)
        if self.on_cycle is not None:
            self.on_cycle(stats)

    def layer_logits(self, state, n: int, pos: int) -> np.ndarray:
        """z[L, n]: each target layer's logits over its own first n indexer keys."""
        p = min(max(pos, 0), self.max_position - 1)  # the position clamp (§3.4)
        cos, sin = rope_tables(self.freq, np.array([p]), np.float32)
        DI = self.cfg.index_dim
        z = np.empty((len(self.targets), n), np.float32)
        for row, (layer, r) in enumerate(sorted(self.targets.items())):
            q, w = np.empty((r.heads, DI), np.float32), np.empty(r.heads, np.float32)
            retriever_query_ref(q, w, self._x[layer], r, cos, sin, self.hadamard)
            retriever_logits_keys_ref(z[row], q, w, state.layers[layer].index_keys[:n])
        return z

    # ---- reporting --------------------------------------------------------------------------
    def summary(self) -> dict:
        """``resident_fraction``: mean share of compressed entries resident over decode steps."""
        out = {"selection": self.sel.mode,
               "resident_fraction": round(float(np.mean(self.fractions)), 6)
               if self.fractions else 1.0,
               "memory_cycles": self.cycles}
        if self.sel.recall_diagnostic:
            out["native_topk_recall"] = (round(self.recall_hits / self.recall_total, 6)
                                         if self.recall_total else 1.0)
        return out


def format_cycle(c: dict) -> str:
    """One ``--stats`` line per cycle."""
    parts = [f"step={c['step']}", f"chunks={c['chunks']}", f"resident={c['resident']}"]
    if c["chunks"]:
        parts.append(f"({100.0 * c['resident'] / c['chunks']:.1f}%)")
    for k in ("kept", "pages", "score_mean", "score_max"):
        if k in c:
            parts.append(f"{k}={c[k]:.4f}" if isinstance(c[k], float) else f"{k}={c[k]}")
    if "ms" in c:  # (global-topk on the GPU selects inside the step: no host time)
        parts.append(f"ms={c['ms']:.2f}")
    return "memory_cycle " + " ".join(parts)


def _ms(t0: float) -> float:
    return round(1e3 * (time.perf_counter() - t0), 3)
