"""The residency table of the GPU staging slots: which compressed-KV chunk each slot holds.

Dimension letters: N chunks (one chunk = one CSA entry = 4 tokens), S staging slots.

One table serves every CSA layer. The Memory Indexer selects the same chunk ids for all of them,
so slot s holds chunk c in every layer's staging buffer at once and one remap LUT
(``slot_of_chunk``, uploaded as is) turns a selected chunk id into a staging row in all layers.

The table is a few NumPy arrays updated by vectorised NumPy once per retrieval cycle (every
``interval`` decode steps), never per step: O(S + selected) work, no per-chunk Python objects.
PocketLLM kept a ``std::list`` LRU and searched it linearly on every touch, every step.

A cycle (``cycle``) turns the next window's selection into a ``SwapPlan`` that the caller
carries out in this order, before the window's first step:

    1. stores      staging -> host pool, the chunks formed during the last window
    2. misses      host pool -> staging, selected chunks that were not staged
    3. reserves    nothing to copy: the GPU compressor writes these chunks during the window

Overlap. The engine plans a cycle while the last window's steps still run (engine/kvswap.py):
its stores and most of its misses go on a copy stream beside them. A miss may be copied that
early only into a slot the running window cannot read: one that was free or not used in the
last cycle (``SwapPlan.miss_late`` marks the others, which wait for the window's end). Slots
are taken free first, then least recently used, so with headroom (more slots than one window
needs) no miss waits.

Decode region. Chunks formed during a window are written by the GPU compressor straight into a
slot reserved for them at the boundary before, inside the captured CUDA graph: the step needs
no host sync to learn where a new chunk goes, and the chunk is readable by attention at once.
At the next boundary those chunks are copied from staging to the host pool (the stores), after
which they are ordinary staged chunks that may be evicted.

Counters have one meaning each: ``hits`` (selected and already staged), ``misses`` (swap-ins,
host pool -> staging), ``stores`` (new chunks, staging -> host pool) and ``evictions`` (slots
taken from another chunk). PocketLLM conflated them: its ``misses`` included new-chunk stores
and its ``swap_outs`` counted stores, not evictions (pocketllm_kv_swap.md §6, §8).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError

NO_SLOT = -1  # in slot_of_chunk: the chunk is not staged
FREE = -1     # in chunk_of_slot: the slot holds no chunk


@dataclass
class SwapCounters:
    """Cumulative counts over a generation (see the module docstring for what each one means)."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0


def _empty() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass
class SwapPlan:
    """The copies of one cycle, each list sorted by chunk id, to be done in field order."""

    store_chunks: np.ndarray = field(default_factory=_empty)    # int32 [stores] staging -> pool
    store_slots: np.ndarray = field(default_factory=_empty)     # int32 [stores]
    miss_chunks: np.ndarray = field(default_factory=_empty)     # int32 [misses] pool -> staging
    miss_slots: np.ndarray = field(default_factory=_empty)      # int32 [misses]
    reserve_chunks: np.ndarray = field(default_factory=_empty)  # int32 [reserves] GPU writes them
    reserve_slots: np.ndarray = field(default_factory=_empty)   # int32 [reserves]
    evicted_chunks: np.ndarray = field(default_factory=_empty)  # int32 [evictions], sorted
    miss_late: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # bool [misses]
    # True: the miss's slot was used in the last cycle (its window may still read it)
    hits: int = 0                                               # selected and already staged


class SwapTable:
    """Slot <-> chunk maps, LRU stamps and ready flags of the S staging slots (see module doc).

    Invariant (``check``): a slot is ``ready`` exactly when it holds a chunk below ``formed``;
    a slot holding a chunk at or above ``formed`` is a decode-region reservation whose bytes
    the GPU compressor has not written yet.
    """

    def __init__(self, n_slots: int, n_chunks: int):
        if n_slots < 1 or n_chunks < 1:
            raise InputError(f"KV swap: need at least one staging slot and one chunk: "
                             f"n_slots={n_slots} n_chunks={n_chunks}")
        self.n_slots, self.n_chunks = int(n_slots), int(n_chunks)
        self.slot_of_chunk = np.full(n_chunks, NO_SLOT, np.int32)  # [N] the remap LUT
        self.chunk_of_slot = np.full(n_slots, FREE, np.int32)      # [S]
        self.stamp = np.full(n_slots, -1, np.int64)                # [S] cycle of last use
        self.ready = np.zeros(n_slots, bool)                       # [S] holds its chunk's bytes
        self.clock = 0   # cycles run
        self.formed = 0  # chunks 0..formed-1 are in the host pool
        self.counters = SwapCounters()

    def prompt_stored(self, n: int) -> None:
        """The prefill (or first step) wrote chunks 0..n-1 straight into the host pool: they
        are formed, and no store is counted since no staging slot was involved."""
        if not self.formed <= n <= self.n_chunks:
            raise InputError(f"KV swap: prompt chunks must be between the chunks already formed "
                             f"and the pool size: n={n} formed={self.formed} "
                             f"n_chunks={self.n_chunks}")
        if np.any(self.slot_of_chunk[self.formed:n] != NO_SLOT):
            # A reserved slot would never be stored, and the GPU might still write it.
            raise RuntimeError("KV swap: prompt chunks were given staging slots before the "
                               "prompt stored them")
        self.formed = n

    def cycle(self, active: np.ndarray, n_formed: int, region: int) -> SwapPlan:
        """Stage the chunks of the next window; return the copies that make it so.

        active    chunk ids the attention may read in the next window (any order, duplicates
                  allowed), each below ``n_formed``
        n_formed  chunks formed so far (those formed since the last cycle are stored now)
        region    chunks that will be formed during the next window: [n_formed, n_formed +
                  region), clipped to the pool, get a slot reserved for the GPU compressor

        Every check runs before the table changes, so an exception leaves it as it was (the
        caller never sees a plan for a half-applied cycle).
        """
        active = np.asarray(active).ravel()
        if active.size and active.dtype.kind not in "iu":
            raise InputError(f"KV swap: selected chunks must be integers, got {active.dtype}")
        active = active.astype(np.int64)
        if not self.formed <= n_formed <= self.n_chunks:
            raise InputError(f"KV swap: formed chunks must be between the chunks already formed "
                             f"and the pool size: n_formed={n_formed} formed={self.formed} "
                             f"n_chunks={self.n_chunks}")
        if region < 0:
            raise InputError(f"KV swap: decode region must be >= 0 chunks, got {region}")
        # Checks, all of them before the first change.
        new = np.arange(self.formed, n_formed)
        new_slots = self.slot_of_chunk[new]
        if np.any(new_slots == NO_SLOT):
            c = int(new[np.argmax(new_slots == NO_SLOT)])
            raise RuntimeError(f"KV swap: chunk {c} was formed without a staging slot "
                               "(decode region too small)")
        out = (active < 0) | (active >= self.n_chunks)
        if out.any():
            raise InputError(f"KV swap: selected chunk out of range: chunk={active[out][0]} "
                             f"n_chunks={self.n_chunks}")
        early = active >= n_formed
        if early.any():
            raise InputError(f"KV swap: selected chunk before it was stored: "
                             f"chunk={active[early][0]} stored={n_formed}")
        selected = np.unique(active)  # sorted
        reserved = np.arange(n_formed, min(n_formed + region, self.n_chunks))
        # selected < n_formed <= reserved: the two sets are disjoint, no union needed.
        wanted = np.concatenate([selected, reserved])
        if len(wanted) > self.n_slots:
            raise InputError(f"KV swap selected more chunks than GPU staging capacity: "
                             f"selected={len(wanted)} gpu_chunks={self.n_slots}")

        # Stores: the decode region of the last window now holds bytes the pool lacks.
        plan = SwapPlan(store_chunks=new.astype(np.int32), store_slots=new_slots)
        self.ready[new_slots] = True
        self.counters.stores += len(new)
        self.formed = n_formed

        # Hits keep their slot; misses and reservations need one.
        staged = self.slot_of_chunk[selected] != NO_SLOT
        plan.hits = int(staged.sum())
        self.counters.hits += plan.hits
        plan.miss_chunks = selected[~staged].astype(np.int32)
        plan.reserve_chunks = reserved[self.slot_of_chunk[reserved] == NO_SLOT].astype(np.int32)
        need = len(plan.miss_chunks) + len(plan.reserve_chunks)
        slots = self._take_slots(need, wanted)
        plan.miss_slots = slots[:len(plan.miss_chunks)]
        plan.reserve_slots = slots[len(plan.miss_chunks):]
        # (stamps of the last cycle, before this one's update: the running window's slots)
        taken = plan.miss_slots
        plan.miss_late = ((self.chunk_of_slot[taken] != FREE)
                          & (self.stamp[taken] == self.clock - 1))

        # Evict whatever the taken slots held.
        evicted = self.chunk_of_slot[slots]
        plan.evicted_chunks = np.sort(evicted[evicted != FREE])
        self.slot_of_chunk[plan.evicted_chunks] = NO_SLOT
        self.counters.evictions += len(plan.evicted_chunks)
        self.counters.misses += len(plan.miss_chunks)
        for chunks, chunk_slots, ready in ((plan.miss_chunks, plan.miss_slots, True),
                                           (plan.reserve_chunks, plan.reserve_slots, False)):
            self.slot_of_chunk[chunks] = chunk_slots
            self.chunk_of_slot[chunk_slots] = chunks
            self.ready[chunk_slots] = ready

        # LRU: every wanted chunk was used in this cycle, reservations included.
        self.stamp[self.slot_of_chunk[wanted]] = self.clock
        self.clock += 1
        return plan

    def _take_slots(self, k: int, wanted: np.ndarray) -> np.ndarray:
        """k slots for new chunks: free slots first (lowest index first), then slots whose
        chunk is not wanted, least recently used first (ties: lowest index first)."""
        if k == 0:
            return _empty()
        free = np.flatnonzero(self.chunk_of_slot == FREE)
        if len(free) >= k:
            return free[:k].astype(np.int32)
        keep = np.zeros(self.n_slots, bool)
        held = self.slot_of_chunk[wanted]
        keep[held[held != NO_SLOT]] = True
        victims = np.flatnonzero((self.chunk_of_slot != FREE) & ~keep)
        # A stable sort on the stamp keeps index order among equal stamps: deterministic.
        lru = victims[np.argsort(self.stamp[victims], kind="stable")]
        # The capacity check guarantees enough: free + victims = S - |wanted staged| >= k.
        return np.concatenate([free, lru[:k - len(free)]]).astype(np.int32)

    def staged(self) -> tuple[np.ndarray, np.ndarray]:
        """(chunks, slots) of the slots that hold their chunk's bytes, sorted by chunk: what a
        byte-compare validator checks against the host pool."""
        slots = np.flatnonzero(self.ready)
        chunks = self.chunk_of_slot[slots]
        order = np.argsort(chunks, kind="stable")
        return chunks[order].astype(np.int32), slots[order].astype(np.int32)

    def check(self) -> None:
        """Raise AssertionError unless the maps are each other's inverse and ``ready`` marks
        exactly the occupied slots whose chunk is formed (see the class docstring)."""
        def require(ok, what: str) -> None:
            if not ok:
                raise AssertionError(f"KV swap table: {what}")

        occupied = np.flatnonzero(self.chunk_of_slot != FREE)
        chunks = self.chunk_of_slot[occupied]
        require(np.all((chunks >= 0) & (chunks < self.n_chunks)), "chunk id out of range")
        require(np.array_equal(self.slot_of_chunk[chunks], occupied),
                "slot_of_chunk does not point back at a slot's chunk")
        # Every staged chunk is pointed back at, and each slot holds one chunk: so no chunk can
        # sit in two slots, and no stale LUT entry survives an eviction.
        require(np.count_nonzero(self.slot_of_chunk != NO_SLOT) == len(occupied),
                "a chunk is in the LUT without holding a slot")
        expected_ready = np.zeros(self.n_slots, bool)
        expected_ready[occupied[chunks < self.formed]] = True
        require(np.array_equal(self.ready, expected_ready),
                "ready differs from 'occupied and formed'")
        require(np.all(self.stamp < self.clock), "a stamp from the future")
