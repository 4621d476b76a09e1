"""KV swap on the GPU engine: the CSA layers' compressed KV in a pinned host cold pool, the chunks
the Memory Indexer selects in GPU staging slots.

Storage (engine/layout.py sizes it, ``pocketfm plan`` prints it):
    pool         uint8 [n_csa, N, 584] mapped pinned host memory: every chunk of every CSA
                 layer, in the packed entry format the kernels read (no conversion on the way)
    staging      uint8 [n_csa, S, 584] GPU: S slots, ONE slot mapping for all CSA layers (the
                 paper's design: the same chunk ids are staged for every layer)
    key_pool     uint8 [n_key, N, 68]  the packed FP4 indexer keys of the CSA layers that are
                 not retriever targets (the paper: target layers' keys stay on the GPU — the
                 scorer reads all of them — the others may be offloaded), host
    key_staging  uint8 [n_key, S, 68]  their staged keys, same slots
    lut          int32 [N]             GPU: slot_of_chunk of the swap table (kvswap/table.py)

Who writes what:
  * the prompt (chunked prefill) and the decode steps before the first committed set run
    "direct": their compressors write the pool, their attention reads it, over PCIe (the
    prompt runs fully resident, flashmemory.md §6; a pool read is 584 B per selected entry);
  * from the first committed set on, the captured step runs "staged": a CSA layer's
    compressor writes the new chunk into its reserved staging slot (``rowmap`` = lut), the
    native top-k (over logical chunk ids, restricted to the resident set as without swap) is
    remapped to slots on the device (``remap_rows``) and attention reads the staging rows. A
    layer with swapped keys scores the staged keys and puts the scores back in chunk order
    (``scores_by_chunk``) first, so the top-k and its tie rule are those of the run without
    swap: the same tokens.
    The step never touches the host: the decode graph stays one graph;
  * at each cycle boundary, between two replays: one kernel stores the chunks formed in the
    last window (staging -> pool), one kernel gathers the misses of all layers (pool ->
    staging), the LUT is uploaded. Same stream, so the next replay sees them.
``validate`` byte-compares every staged slot with the pool after each swap-in.
"""
from __future__ import annotations

import time

import numpy as np
from numba import cuda

from ..errors import InputError
from ..kernels.kvgather import (gather_to_slots, mapped_device_view, store_to_pool,
                                validate_staged)
from ..kernels.kvpack import index_key_bytes, kv_entry_bytes
from ..kvswap.table import SwapTable
from . import step_kernels as sk
from .layout import swap_specs

MIB = 1 << 20


def pinned_pool_bytes(cfg, capacity: int, key_layers=()) -> int:
    """Bytes of the host cold pool: every CSA layer's packed entries, and the indexer keys of
    ``key_layers``, for every chunk (layout.swap_specs' pinned arrays)."""
    return sum(a.nbytes for a in swap_specs(cfg, capacity, 1, key_layers) if a.where == "pinned")


def checked_pinned_bytes(cfg, capacity: int, key_layers, cap_mib: int) -> int:
    """The pool's bytes, or the seed's error when they exceed the ``--pinned-mib`` cap."""
    need = pinned_pool_bytes(cfg, capacity, key_layers)
    if need > cap_mib * MIB:
        raise InputError(f"KV swap pinned cache exceeds cap: required_mib={need / MIB:.1f} "
                         f"cap_mib={cap_mib} (raise --pinned-mib or lower --ctx)")
    return need


class EngineSwap:
    """The swap state of one DecodeEngine (built with the engine: fixed addresses for the graph)."""

    def __init__(self, eng, gpu_chunks: int, region: int, cap_mib: int,
                 validate: bool = False, sync: bool = False, key_layers=()):
        cfg, s = eng.cfg, eng.stream
        self.eng, self.region, self.validate, self.sync = eng, region, validate, sync
        self.layers = [i for i in range(cfg.n_layers) if cfg.is_csa(i)]
        self.rank = {layer: r for r, layer in enumerate(self.layers)}
        self.N = N = max(1, eng.capacity // 4)
        self.S = S = gpu_chunks
        self.B = kv_entry_bytes(cfg.head_dim, cfg.rope_dim)
        self.key_layers = sorted(key_layers)
        self.krank = {layer: r for r, layer in enumerate(self.key_layers)}
        if not set(self.krank) <= set(self.rank):
            raise ValueError(f"EngineSwap: key layers {self.key_layers} must be CSA layers")
        self.pinned_bytes = checked_pinned_bytes(cfg, eng.capacity, self.key_layers, cap_mib)
        self.key_pool = self.key_staging = self.slot_scores = self.n_slots = None
        for spec in swap_specs(cfg, eng.capacity, S, self.key_layers):  # = pocketfm plan's
            setattr(self, spec.name, cuda.mapped_array(spec.shape, spec.dtype)
                    if spec.where == "pinned" else
                    cuda.device_array(spec.shape, spec.dtype, stream=s))
        self.lut.copy_to_device(np.full(N, -1, np.int32), stream=s)
        self.pool_dev = mapped_device_view(self.pool)
        self.pool_views = {layer: mapped_device_view(self.pool, r)
                           for layer, r in self.rank.items()}
        self.key_pool_views = {}
        if self.key_layers:
            self.n_slots.copy_to_device(np.array([S], np.int32), stream=s)
            self.key_pool_dev = mapped_device_view(self.key_pool)
            self.key_pool_views = {layer: mapped_device_view(self.key_pool, r)
                                   for layer, r in self.krank.items()}
        self.staged = False  # the step reads staging (True) or the pool (direct)
        self.table = SwapTable(S, N)
        self.direct_stores = 0  # chunks the direct steps wrote into the pool (counted as stores)
        self.cycle_ms: list[float] = []
        self.validated = 0

    @property
    def gpu_bytes(self) -> int:
        return int(sum(a.nbytes for a in (self.staging, self.key_staging, self.lut,
                                          self.sel_slots, self.slot_scores, self.n_slots)
                       if a is not None))

    # ---- inside the step ------------------------------------------------------------------------
    def compressor_target(self, layer: int):
        """(out_packed, rowmap) of a CSA layer's decode compressor."""
        if self.staged:
            return self.staging[self.rank[layer]], self.lut
        return self.pool_views[layer], None

    def key_compressor_target(self, layer: int):
        """(out_packed, rowmap) of a swapped-key layer's indexer-key compressor."""
        if self.staged:
            return self.key_staging[self.krank[layer]], self.lut
        return self.key_pool_views[layer], None

    def score_staged_keys(self, layer: int, scores, q, w, n_visible, stream, threads=None):
        """A swapped-key layer's native scores, in chunk order, for the visible chunks: over
        the staged keys (then put back through the LUT), or over the pool in direct steps."""
        from ..kernels.indexer import indexer_scores

        if not self.staged:
            indexer_scores(scores, q, w, self.key_pool_views[layer], n_visible, stream=stream,
                           threads=threads)
            return
        indexer_scores(self.slot_scores, q, w, self.key_staging[self.krank[layer]],
                       self.n_slots, stream=stream, threads=threads)
        sk.scores_by_chunk(scores, self.slot_scores, self.lut, n_visible, stream)

    def attention_source(self, layer: int, sel, stream):
        """(comp, sel) the CSA attention reads: staging rows through the remapped selection,
        or the pool itself in direct steps."""
        if self.staged:
            sk.remap_rows(self.sel_slots, sel, self.lut, stream)
            return self.staging[self.rank[layer]], self.sel_slots
        return self.pool_views[layer], sel

    # ---- between replays ------------------------------------------------------------------------
    def reset(self) -> None:
        """A new sequence: nothing staged; the next steps run direct."""
        self.staged = False
        self.table = SwapTable(self.S, self.N)
        self.direct_stores = 0
        self.cycle_ms, self.validated = [], 0

    def commit(self, active: np.ndarray | None, n_formed: int) -> dict:
        """A cycle boundary: stage the committed set ``active`` (resident[n_formed] bool, chunk
        ids < n_formed) plus the next window's decode region. Returns the cycle's swap counts."""
        t0 = time.perf_counter()
        s, t = self.eng.stream, self.table
        if not self.staged:  # everything so far was written straight into the pool
            self.direct_stores = n_formed
            t.prompt_stored(n_formed)
        ids = (np.flatnonzero(active[:n_formed]) if active is not None
               else np.arange(n_formed)).astype(np.int32)
        plan = t.cycle(ids, n_formed, self.region)
        keys = bool(self.key_layers)
        if len(plan.store_chunks):  # first: the slots may be reused by the gather below
            c, sl = (cuda.to_device(a, stream=s) for a in (plan.store_chunks, plan.store_slots))
            store_to_pool(self.pool_dev, self.staging, c, sl, s)
            if keys:
                store_to_pool(self.key_pool_dev, self.key_staging, c, sl, s)
        if len(plan.miss_chunks):  # every layer's misses in one launch (two: entries, keys)
            c, sl = (cuda.to_device(a, stream=s) for a in (plan.miss_chunks, plan.miss_slots))
            gather_to_slots(self.staging, self.pool_dev, c, sl, s)
            if keys:
                gather_to_slots(self.key_staging, self.key_pool_dev, c, sl, s)
        self.lut.copy_to_device(t.slot_of_chunk, stream=s)
        self.staged = True
        if self.validate:
            self.check_staged()
        elif self.sync:
            s.synchronize()
        self.cycle_ms.append(1e3 * (time.perf_counter() - t0))
        return dict(hits=plan.hits, misses=len(plan.miss_chunks),
                    stores=len(plan.store_chunks), evictions=len(plan.evicted_chunks))

    def check_staged(self) -> None:
        """VALIDATE: every ready slot byte for byte against the pool (a host sync)."""
        s = self.eng.stream
        chunks, slots = self.table.staged()
        pairs = [(self.staging, self.pool, self.layers)]
        if self.key_layers:
            pairs.append((self.key_staging, self.key_pool,
                          [f"{layer} (indexer keys)" for layer in self.key_layers]))
        for staging, pool, names in pairs:
            staged = staging.copy_to_host(stream=s)
            s.synchronize()
            host = pool if isinstance(pool, np.ndarray) else pool.copy_to_host()
            self.validated += validate_staged(staged, host, chunks, slots, names)

    # ---- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters with exact meanings, in chunks (one slot mapping: a chunk moves the entries
        of every CSA layer and the keys of every swapped-key layer): hits (selected chunks
        already staged), misses (swap-ins from the host pool), stores (new chunks written to
        the pool: by the direct steps, or from staging at a boundary), evictions (staged
        chunks dropped for others); bytes each way over all layers."""
        c, L = self.table.counters, len(self.layers)
        per_chunk = L * self.B + len(self.key_layers) * index_key_bytes(self.eng.cfg.index_dim)
        stores = c.stores + self.direct_stores
        return dict(layers=L, key_layers=len(self.key_layers), gpu_chunks=self.S,
                    compressed_cap=self.N, hits=c.hits, misses=c.misses, stores=stores,
                    evictions=c.evictions, h2d_mib=round(c.misses * per_chunk / MIB, 3),
                    d2h_mib=round(stores * per_chunk / MIB, 3), cycles=len(self.cycle_ms),
                    cycle_ms_mean=round(float(np.mean(self.cycle_ms)), 3) if self.cycle_ms
                    else 0.0, validated_rows=self.validated)


def stats_line(st: dict) -> str:
    """The seed's end-of-run line, with stores and evictions counted apart from swap-ins."""
    return (f"gguf_kv_swap_stats layers={st['layers']} key_layers={st['key_layers']} "
            f"gpu_chunks_total={st['gpu_chunks'] * st['layers']} "
            f"compressed_cap_total={st['compressed_cap'] * st['layers']} hits={st['hits']} "
            f"misses={st['misses']} stores={st['stores']} evictions={st['evictions']} "
            f"h2d_mib={st['h2d_mib']} d2h_mib={st['d2h_mib']} cycles={st['cycles']} "
            f"cycle_ms_mean={st['cycle_ms_mean']} validated_rows={st['validated_rows']}")
