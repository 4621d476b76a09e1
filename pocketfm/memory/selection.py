"""Which compressed chunks stay resident: ensembles, threshold / top-k, recency tail, sink and
page recall (flashmemory.md §5, §5.1, §14). Pure functions over NumPy arrays, one call per cycle.

A chunk is one CSA entry (4 tokens); chunk ids are logical, 0 .. N-1 at the cycle's boundary.
Letters: L retriever layers, N chunks, P pages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

MODES = ("lookahead", "global-topk", "full", "recency", "random")
ENSEMBLES = ("max", "mean", "or")
NEEDS_RETRIEVER = ("lookahead", "global-topk")


@dataclass(frozen=True)
class SelectionConfig:
    """Run-time selection options (the CLI's ``--selection`` and its knobs).

    ``topk`` 0 selects by ``threshold`` (strict >, deployment), K > 0 keeps the K best chunks.
    ``kmax`` pages (or ``kmax_ratio`` of the context's pages when > 0) caps the resident set in
    page mode; ``kmax`` 0 keeps chunk granularity. None = the checkpoint's geometry.
    """

    mode: str = "lookahead"
    ensemble: str = "max"
    threshold: float = 0.5
    topk: int = 0
    interval: int = 64
    recency_tail: int | None = None  # chunks
    sink: int = 0  # chunks
    kmax: int | None = None  # pages
    kmax_ratio: float = 0.0
    page_size: int | None = None  # chunks
    random_ratio: float = 0.10
    seed: int = 7777  # the random baseline's RNG (§14)
    recall_diagnostic: bool = False
    commit_lag: int | None = None  # steps from a boundary to its set; None: 0, or with an
    # overlapped KV swap kvswap.config.OVERLAP_LAG

    def check(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"--selection {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.ensemble not in ENSEMBLES:
            raise InputError(f"--ensemble {self.ensemble!r}: expected one of "
                             f"{', '.join(ENSEMBLES)}")
        if not 0.0 < self.threshold < 1.0:
            raise InputError(f"--threshold {self.threshold}: expected a probability in (0, 1)")
        if self.interval < 1:
            raise InputError(f"--interval {self.interval}: expected >= 1 decode steps")
        for name in ("topk", "sink", "recency_tail", "kmax", "page_size"):
            v = getattr(self, name)
            if v is not None and v < (1 if name == "page_size" else 0):
                raise InputError(f"--{name.replace('_', '-')} {v}: expected >= "
                                 f"{1 if name == 'page_size' else 0}")
        if self.commit_lag is not None and not 0 <= self.commit_lag < self.interval:
            raise InputError(f"--commit-lag {self.commit_lag}: expected 0 <= lag < --interval "
                             f"{self.interval} (a set takes effect before the next boundary)")
        if self.commit_lag and self.mode == "global-topk":
            raise InputError(f"--commit-lag {self.commit_lag}: global-topk selects inside "
                             "every step, there is no cycle to delay; use 0")
        if not 0.0 <= self.kmax_ratio <= 1.0 or not 0.0 < self.random_ratio <= 1.0:
            raise InputError("--kmax-ratio / --random-ratio: expected a fraction in (0, 1]")


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def ensemble_keep(z: np.ndarray, ensemble: str, threshold: float, topk: int = 0):
    """keep[N], e[N] from per-layer logits z[L, N] (§5).

    e is the ensemble score: max (and ``or``) = σ(max_l z), mean = mean_l σ(z). Threshold mode
    keeps e > threshold, decided on logits for max/or (max_l z > logit(threshold)) so that the
    strict rule stays exact where σ rounds to 0.5 in floating point: at 0.5, kept ⇔ some layer's
    z > 0. Top-k mode keeps the K best by the same order (ties: the lower chunk id).
    """
    from .scorer import sigmoid

    z = np.atleast_2d(z)
    if ensemble in ("max", "or"):
        rank_key = z.max(axis=0)
        e = sigmoid(rank_key)
        cut = logit(threshold)
    else:
        e = sigmoid(z).mean(axis=0)
        rank_key, cut = e, threshold
    N = z.shape[1]
    if topk > 0:
        keep = np.zeros(N, bool)
        keep[np.argsort(-rank_key, kind="stable")[:topk]] = True
    else:
        keep = rank_key > cut
    return keep, e


def edge_chunks(n: int, tail: int, sink: int) -> tuple[np.ndarray, np.ndarray]:
    """recent[N] (j >= n - tail, chunk ids, not tokens: §15.11) and sink[N] (j < sink)."""
    j = np.arange(n)
    return j >= n - tail, j < sink


def select_chunks(keep: np.ndarray, tail: int, sink: int) -> np.ndarray:
    """Chunk mode: resident = keep ∪ recency tail ∪ sink."""
    recent, first = edge_chunks(len(keep), tail, sink)
    return keep | recent | first


def select_pages(keep: np.ndarray, page: int, kmax: int, tail: int, sink: int):
    """Page recall (§5.1): resident[N], pages[K] (sorted).

    page score = #kept chunks in it; recency-tail and sink pages score +inf; the K = min(KMAX,
    pages) best pages are resident, every chunk of them (the last page may be partial). Ties go
    to the more recent page, so a tail longer than KMAX pages keeps its newest pages.
    """
    n = len(keep)
    n_pages = -(-n // page)
    score = np.bincount(np.arange(n) // page, weights=keep, minlength=n_pages).astype(np.float64)
    score[max(0, (n - tail)) // page:] = np.inf
    score[:-(-sink // page)] = np.inf
    K = min(kmax, n_pages)
    order = np.lexsort((-np.arange(n_pages), -score))  # score desc, then newer first
    pages = np.sort(order[:K])
    resident = np.zeros(n_pages, bool)
    resident[pages] = True
    return np.repeat(resident, page)[:n], pages


def random_chunks(n: int, tail: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """The random baseline (§14): the recency tail plus max(1, ratio·n) random older chunks."""
    resident, _ = edge_chunks(n, tail, 0)
    older = np.flatnonzero(~resident)
    if len(older):
        pick = rng.choice(older, size=min(len(older), max(1, int(ratio * n))), replace=False)
        resident[pick] = True
    return resident
