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
  * a cycle is staged on the cycle stream while the last window's steps still run
    (engine/memory.py): one kernel stores the chunks formed up to the boundary (staging ->
    pool; the copy stream has waited for the boundary step), one kernel gathers the misses of
    all layers whose slots the running window cannot read (pool -> staging), and the new LUT
    goes to ``lut_next``. When the set takes effect (``switch``, on the decode stream, after
    it has waited for the staging): the misses whose slots the last window still read are
    gathered, ``lut_next`` is copied over ``lut``. The running window never sees a slot
    change under it: it reads only slots stamped in the last cycle (kvswap/table.py).
  * the first switch leaves the direct mode: the chunks that the direct steps formed after the
    boundary (the lag) went to the pool; they are gathered into their reserved slots.
``validate`` byte-compares every staged slot with the pool after each switch (a host sync).
"""
from __future__ import annotations

import time

import numpy as np
from numba import cuda

from ..errors import InputError
from ..kernels import device
from ..kernels.kvgather import (gather_to_slots, mapped_device_view, store_to_pool,
                                validate_staged)
from ..kernels.kvpack import index_key_bytes, kv_entry_bytes
from ..kvswap.table import SwapTable
from . import step_kernels as sk
from .layout import COPY_KINDS, swap_specs

MIB = 1 << 20
MAPPED = ("pool", "key_pool")  # pinned arrays the kernels address (the others are copy sources)


def pinned_pool_bytes(cfg, capacity: int, gpu_chunks: int, key_layers=()) -> int:
    """Pinned host bytes of a swap: the cold pool (every CSA layer's packed entries, and the
    indexer keys of ``key_layers``, for every chunk) and the pinned sources of the cycle's
    uploads (layout.swap_specs' pinned arrays)."""
    return sum(a.nbytes for a in swap_specs(cfg, capacity, gpu_chunks, key_layers)
               if a.where == "pinned")


def checked_pinned_bytes(cfg, capacity: int, gpu_chunks: int, key_layers, cap_mib: int) -> int:
    """The pinned bytes, or the seed's error when they exceed the ``--pinned-mib`` cap."""
    need = pinned_pool_bytes(cfg, capacity, gpu_chunks, key_layers)
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
        self.pinned_bytes = checked_pinned_bytes(cfg, eng.capacity, S, self.key_layers,
                                                 cap_mib)
        self.key_pool = self.key_staging = self.slot_scores = self.n_slots = None
        self.specs = swap_specs(cfg, eng.capacity, S, self.key_layers)  # = pocketfm plan's
        for spec in self.specs:  # the pools mapped (the GPU reads them), upload sources pinned
            setattr(self, spec.name, cuda.device_array(spec.shape, spec.dtype, stream=s)
                    if spec.where == "gpu" else cuda.mapped_array(spec.shape, spec.dtype)
                    if spec.name in MAPPED else cuda.pinned_array(spec.shape, spec.dtype))
        self.lut.copy_to_device(np.full(N, -1, np.int32), stream=s)
        # lut_next: the staged cycle's LUT, from lut_host (pinned; memory.py syncs its reuse).
        # idx_host/idx_dev: the (chunks, slots) lists of a cycle's copies, a row per kind
        # (COPY_KINDS). Uploads go from pinned memory: from pageable memory the driver copies
        # synchronously, so the host would wait for the stream (the decode stream's queued
        # replays, or the cycle stream's wait for the boundary step).
        self.switched = None if device.SIMULATOR else cuda.event(timing=False)
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
        self.pending = None  # the staged cycle's late work, until its switch
        self.cycle_ms: list[float] = []
        self.late = self.validated = 0

    @property
    def gpu_bytes(self) -> int:
        return int(sum(getattr(self, a.name).nbytes for a in self.specs if a.where == "gpu"))

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

        if not self.staged:  # the pool is host memory, read over the bus: the register-tile
            # kernel reads each key once per block, the tensor-core one once per warp
            indexer_scores(scores, q, w, self.key_pool_views[layer], n_visible, stream=stream,
                           threads=threads, mma=False)
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
        self.pending = None
        self.cycle_ms, self.late, self.validated = [], 0, 0

    def stage(self, active: np.ndarray | None, n_formed: int, c) -> None:
        """Stage the committed set ``active`` (resident[n_formed] bool, chunk ids < n_formed;
        None: all) plus the next window's decode region, on stream ``c`` (which has waited
        for the boundary step): stores, early swap-ins, ``lut_next``. ``switch`` finishes."""
        t0 = time.perf_counter()
        t = self.table
        if not self.staged:  # everything so far was written straight into the pool
            self.direct_stores = n_formed
            t.prompt_stored(n_formed)
        ids = (np.flatnonzero(active[:n_formed]) if active is not None
               else np.arange(n_formed)).astype(np.int32)
        plan = t.cycle(ids, n_formed, self.region)
        if len(plan.store_chunks):  # first: the slots may be reused by the gathers below
            self._copy("store", plan.store_chunks, plan.store_slots, c)
        early = ~plan.miss_late
        if early.any():  # every layer's misses in one launch (two: entries, keys)
            self._copy("early", plan.miss_chunks[early], plan.miss_slots[early], c)
        self.lut_host[:] = t.slot_of_chunk
        self.lut_next.copy_to_device(self.lut_host, stream=c)
        self.pending = dict(n_formed=n_formed, late=(plan.miss_chunks[~early],
                                                     plan.miss_slots[~early]),
                            ms=1e3 * (time.perf_counter() - t0))

    def switch(self, n_now: int) -> None:
        """The staged set takes effect from the next replay (decode stream, which has waited
        for the staging): the late swap-ins, the LUT. ``n_now``: chunks formed so far."""
        t0 = time.perf_counter()
        s, p = self.eng.stream, self.pending
        if self.switched is not None:
            self.switched.synchronize()  # the last switch's lists are out of the pinned rows
        if not self.staged:  # the direct steps since the boundary wrote their chunks to the pool
            lag = np.arange(p["n_formed"], min(n_now, self.N), dtype=np.int32)
            if len(lag):
                self._copy("lag", lag, self.table.slot_of_chunk[lag], s)
        chunks, slots = p["late"]
        if len(chunks):
            self._copy("late", chunks, slots, s)
            self.late += len(chunks)
        self.lut.copy_to_device(self.lut_next, stream=s)
        if self.switched is not None:
            self.switched.record(s)
        self.staged, self.pending = True, None
        if self.validate:
            self.check_staged()
        elif self.sync:
            s.synchronize()
        self.cycle_ms.append(p["ms"] + 1e3 * (time.perf_counter() - t0))

    def _copy(self, kind: str, chunks: np.ndarray, slots: np.ndarray, stream) -> None:
        """One launch over all CSA layers (one more for the swapped keys): ``store`` staging ->
        pool, the others (swap-ins) pool -> staging."""
        k, m = COPY_KINDS.index(kind), len(chunks)
        self.idx_host[k, :m], self.idx_host[k, m:2 * m] = chunks, slots
        dev = self.idx_dev[k, :2 * m]
        dev.copy_to_device(self.idx_host[k, :2 * m], stream=stream)
        c, sl = dev[:m], dev[m:]
        pairs = [(self.pool_dev, self.staging)]
        if self.key_layers:
            pairs.append((self.key_pool_dev, self.key_staging))
        for pool, staging in pairs:
            if kind == "store":
                store_to_pool(pool, staging, c, sl, stream)
            else:
                gather_to_slots(staging, pool, c, sl, stream)

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
        chunks dropped for others), late_misses (misses copied at the switch, after the
        running window, because their slot was in use); bytes each way over all layers.
        ``cycles`` counts switches; a cycle staged just before the generation ends is in the
        table's counts though it never took effect."""
        c, L = self.table.counters, len(self.layers)
        per_chunk = L * self.B + len(self.key_layers) * index_key_bytes(self.eng.cfg.index_dim)
        stores = c.stores + self.direct_stores
        return dict(layers=L, key_layers=len(self.key_layers), gpu_chunks=self.S,
                    compressed_cap=self.N, hits=c.hits, misses=c.misses, stores=stores,
                    evictions=c.evictions, late_misses=self.late,
                    h2d_mib=round(c.misses * per_chunk / MIB, 3),
                    d2h_mib=round(stores * per_chunk / MIB, 3), cycles=len(self.cycle_ms),
                    cycle_ms_mean=round(float(np.mean(self.cycle_ms)), 3) if self.cycle_ms
                    else 0.0, validated_rows=self.validated)


def memory_lines(eng, ctx: int) -> list[str]:
    """The seed's load-time lines (MEM_PROFILE): ``gguf_kv_cache`` (the engine's caches, GPU
    and pinned) and ``gguf_mem`` (the device's memory once the engine is built; left out where
    the device reports none, as the simulator)."""
    cfg, gib = eng.cfg, float(1 << 30)
    pinned = eng.swap.pinned_bytes if eng.swap is not None else 0
    lines = [f"gguf_kv_cache max_capacity={ctx} sparse_layers="
             f"{sum(cfg.ratio(i) > 0 for i in range(cfg.n_layers))} n_layers={cfg.n_layers} "
             f"kv_cache_gib={eng.cache_bytes / gib:.3f} pinned_gib={pinned / gib:.3f}"]
    free, total = cuda.current_context().get_memory_info()
    if np.isfinite(free) and np.isfinite(total):
        lines.append(mem_line("after_kv_cache", free, total))
    return lines


def mem_line(tag: str, free: float, total: float) -> str:
    """``gguf_mem tag=… free_gib=… total_gib=… used_gib=…`` (the seed's format, one GPU)."""
    gib = float(1 << 30)
    return (f"gguf_mem tag={tag} tp_rank=0 free_gib={free / gib:.2f} total_gib={total / gib:.2f} "
            f"used_gib={(total - free) / gib:.2f}")


def stats_line(st: dict) -> str:
    """The seed's end-of-run line, with stores and evictions counted apart from swap-ins."""
    return (f"gguf_kv_swap_stats layers={st['layers']} key_layers={st['key_layers']} "
            f"gpu_chunks_total={st['gpu_chunks'] * st['layers']} "
            f"compressed_cap_total={st['compressed_cap'] * st['layers']} hits={st['hits']} "
            f"misses={st['misses']} late_misses={st['late_misses']} stores={st['stores']} "
            f"evictions={st['evictions']} "
            f"h2d_mib={st['h2d_mib']} d2h_mib={st['d2h_mib']} cycles={st['cycles']} "
            f"cycle_ms_mean={st['cycle_ms_mean']} validated_rows={st['validated_rows']}")
