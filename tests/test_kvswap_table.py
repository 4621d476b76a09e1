"""The KV swap residency table: exact LRU order and counters, the errors, a randomized comparison
with a plain-Python model of the same rules, and a byte-level replay of the plans."""
import numpy as np
import pytest

from pocketfm.errors import InputError
from pocketfm.kvswap.table import SwapTable


def state(table):
    """Everything a cycle may change, as plain values (to compare before/after a refused call)."""
    c = table.counters
    return (table.slot_of_chunk.tolist(), table.chunk_of_slot.tolist(), table.stamp.tolist(),
            table.ready.tolist(), table.clock, table.formed,
            (c.hits, c.misses, c.stores, c.evictions))


def test_eviction_is_least_recently_used_then_lowest_slot():
    t = SwapTable(n_slots=3, n_chunks=10)
    t.prompt_stored(6)
    plan = t.cycle(np.array([2, 0, 1, 1]), 6, 0)  # cycle 0: slots 0,1,2 <- chunks 0,1,2
    assert plan.miss_chunks.tolist() == [0, 1, 2] and plan.miss_slots.tolist() == [0, 1, 2]
    t.cycle(np.array([1, 2]), 6, 0)  # cycle 1: chunk 0 not used
    t.cycle(np.array([2, 0]), 6, 0)  # cycle 2: chunk 1 not used; stamps 2, 1, 2
    plan = t.cycle(np.array([3]), 6, 0)
    assert plan.evicted_chunks.tolist() == [1] and plan.miss_slots.tolist() == [1]
    # Chunks 0 and 2 were both last used in cycle 2: the tie goes to the lower slot (slot 0).
    plan = t.cycle(np.array([4, 3]), 6, 0)
    assert plan.evicted_chunks.tolist() == [0] and plan.miss_slots.tolist() == [0]
    assert t.slot_of_chunk[:6].tolist() == [-1, -1, 2, 1, 0, -1]
    t.check()


def test_counters_and_decode_region_become_stores():
    t = SwapTable(n_slots=4, n_chunks=20)
    t.prompt_stored(4)
    plan = t.cycle(np.array([1, 0]), 4, 2)
    assert (plan.miss_chunks.tolist(), plan.miss_slots.tolist()) == ([0, 1], [0, 1])
    assert (plan.reserve_chunks.tolist(), plan.reserve_slots.tolist()) == ([4, 5], [2, 3])
    assert t.ready.tolist() == [True, True, False, False]
    t.check()

    # Chunks 4 and 5 were formed in the window: stored now, not swapped in.
    plan = t.cycle(np.array([1, 4]), 6, 1)
    assert (plan.store_chunks.tolist(), plan.store_slots.tolist()) == ([4, 5], [2, 3])
    assert plan.hits == 2 and plan.miss_chunks.size == 0
    assert plan.reserve_chunks.tolist() == [6] and plan.evicted_chunks.tolist() == [0]
    assert plan.reserve_slots.tolist() == [0]  # chunks 0 and 5 both stamped 0: lower slot

    plan = t.cycle(np.array([5, 6, 6]), 7, 0)
    assert (plan.store_chunks.tolist(), plan.hits) == ([6], 2)
    plan = t.cycle(np.array([3, 2]), 7, 0)  # stamps now 2, 1, 1, 2: slots 1 and 2 go
    assert (plan.miss_chunks.tolist(), plan.miss_slots.tolist()) == ([2, 3], [1, 2])
    assert plan.evicted_chunks.tolist() == [1, 4]
    c = t.counters
    assert (c.hits, c.misses, c.stores, c.evictions) == (4, 4, 3, 3)
    chunks, slots = t.staged()
    assert (chunks.tolist(), slots.tolist()) == ([2, 3, 5, 6], [1, 2, 3, 0])
    t.check()


def test_region_is_clipped_to_the_pool_and_kept_when_already_reserved():
    t = SwapTable(n_slots=4, n_chunks=6)
    t.prompt_stored(3)
    plan = t.cycle(np.array([0]), 3, 2)
    assert plan.reserve_chunks.tolist() == [3, 4]
    plan = t.cycle(np.array([0]), 4, 5)  # only chunk 3 formed; 4 keeps its slot; 5 is the last
    assert plan.store_chunks.tolist() == [3] and plan.reserve_chunks.tolist() == [5]
    assert plan.hits == 1 and plan.evicted_chunks.size == 0
    t.check()


def test_errors_leave_the_table_unchanged():
    t = SwapTable(n_slots=2, n_chunks=10)
    t.prompt_stored(4)
    t.cycle(np.array([0]), 4, 1)
    before = state(t)
    with pytest.raises(InputError, match=r"^KV swap selected more chunks than GPU staging "
                                         r"capacity: selected=3 gpu_chunks=2$"):
        t.cycle(np.array([0, 1, 1]), 5, 1)
    with pytest.raises(InputError, match=r"selected chunk before it was stored: chunk=5 "
                                         r"stored=5"):
        t.cycle(np.array([0, 5]), 5, 0)
    with pytest.raises(InputError, match=r"selected chunk out of range: chunk=10 n_chunks=10"):
        t.cycle(np.array([10]), 5, 0)
    with pytest.raises(InputError, match=r"selected chunk out of range: chunk=-1"):
        t.cycle(np.array([-1]), 5, 0)
    with pytest.raises(InputError, match=r"n_formed=11"):
        t.cycle(np.array([0]), 11, 0)
    with pytest.raises(RuntimeError, match=r"^KV swap: chunk 5 was formed without a staging "
                                           r"slot \(decode region too small\)$"):
        t.cycle(np.array([0]), 6, 0)  # only chunk 4 was reserved
    assert state(t) == before
    with pytest.raises(InputError, match=r"n=3 formed=4"):
        t.prompt_stored(3)
    with pytest.raises(RuntimeError, match=r"prompt chunks were given staging slots"):
        t.prompt_stored(5)  # chunk 4 holds a reservation
    assert state(t) == before


class ListLRUModel:
    """The same rules written the plain way: a dict for the LUT and a list of occupied slots,
    least recently used first, each cycle's wanted slots moved to the end in slot order."""

    def __init__(self, n_slots, n_chunks):
        self.n_slots, self.n_chunks = n_slots, n_chunks
        self.slot = {}                     # chunk -> slot
        self.chunk = [None] * n_slots      # slot -> chunk
        self.lru = []                      # occupied slots, oldest use first
        self.formed = 0
        self.counts = [0, 0, 0, 0]         # hits, misses, stores, evictions

    def cycle(self, active, n_formed, region):
        stores = [(c, self.slot[c]) for c in range(self.formed, n_formed)]
        self.formed = n_formed
        selected = sorted(set(int(c) for c in active))
        reserved = list(range(n_formed, min(n_formed + region, self.n_chunks)))
        wanted = set(selected) | set(reserved)
        hits = sum(c in self.slot for c in selected)
        misses = [c for c in selected if c not in self.slot]
        reserves = [c for c in reserved if c not in self.slot]
        free = [s for s in range(self.n_slots) if self.chunk[s] is None]
        victims = [s for s in self.lru if self.chunk[s] not in wanted]
        taken = (free + victims)[:len(misses) + len(reserves)]
        evicted = sorted(self.chunk[s] for s in taken if self.chunk[s] is not None)
        for c in evicted:
            del self.slot[c]
        for c, s in zip(misses + reserves, taken):
            self.slot[c], self.chunk[s] = s, c
        used = sorted(self.slot[c] for c in wanted)
        self.lru = [s for s in self.lru if s not in used] + used
        self.counts = [a + b for a, b in zip(self.counts, (hits, len(misses), len(stores),
                                                           len(evicted)))]
        return dict(stores=stores, misses=list(zip(misses, taken)),
                    reserves=list(zip(reserves, taken[len(misses):])), evicted=evicted, hits=hits)


def pairs(chunks, slots):
    assert chunks.dtype == np.int32 and slots.dtype == np.int32
    return list(zip(chunks.tolist(), slots.tolist()))


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_matches_the_list_lru_model_on_random_cycles(seed):
    rng = np.random.default_rng(seed)
    n_slots, n_chunks = int(rng.integers(6, 20)), 120
    t, model = SwapTable(n_slots, n_chunks), ListLRUModel(n_slots, n_chunks)
    n_formed = int(rng.integers(1, 10))
    t.prompt_stored(n_formed)
    model.formed = n_formed
    region = 0
    for _ in range(200):
        n_formed = min(n_chunks, n_formed + int(rng.integers(0, region + 1)))
        region = int(rng.integers(0, 4))
        budget = n_slots - min(region, n_chunks - n_formed)
        k = int(rng.integers(0, budget + 1))
        recent = rng.integers(max(0, n_formed - 2 * n_slots), n_formed, k)  # repeats -> hits
        anywhere = rng.integers(0, n_formed, k)
        active = np.where(rng.random(k) < 0.7, recent, anywhere)
        active = active[np.isin(active, np.unique(active)[:budget])]  # at most `budget` distinct
        plan = t.cycle(active, n_formed, region)
        want = model.cycle(active, n_formed, region)
        t.check()
        assert pairs(plan.store_chunks, plan.store_slots) == want["stores"]
        assert pairs(plan.miss_chunks, plan.miss_slots) == want["misses"]
        assert pairs(plan.reserve_chunks, plan.reserve_slots) == want["reserves"]
        assert plan.evicted_chunks.tolist() == want["evicted"] and plan.hits == want["hits"]
        lut = np.full(n_chunks, -1)
        lut[list(model.slot)] = list(model.slot.values())
        assert t.slot_of_chunk.tolist() == lut.tolist()
        c = t.counters
        assert [c.hits, c.misses, c.stores, c.evictions] == model.counts
    assert t.counters.evictions > 0 and t.counters.hits > 0 and t.counters.stores > 0


@pytest.mark.parametrize("seed", [21, 22])
def test_plans_replayed_on_bytes_keep_staging_equal_to_the_pool(seed):
    """Carry out each plan on fake byte arrays, as the engine would: stores first, then misses;
    during the window a fake compressor writes each new chunk into its reserved slot. Attention
    must then read every selected chunk's true bytes through the LUT."""
    rng = np.random.default_rng(seed)
    n_slots, n_chunks, entry = 10, 80, 16
    truth = rng.integers(0, 256, (n_chunks, entry), dtype=np.uint8)  # the bytes of each chunk
    pool = np.zeros((n_chunks, entry), np.uint8)
    staging = np.full((n_slots, entry), 0xEE, np.uint8)  # stale bytes before first use
    t = SwapTable(n_slots, n_chunks)
    n_formed = 5
    pool[:n_formed] = truth[:n_formed]  # the prefill writes the pool directly
    t.prompt_stored(n_formed)
    for _ in range(120):
        region = int(rng.integers(0, 4))
        budget = n_slots - min(region, n_chunks - n_formed)
        active = rng.integers(0, n_formed, int(rng.integers(0, budget + 1)))
        plan = t.cycle(active, n_formed, region)
        pool[plan.store_chunks] = staging[plan.store_slots]
        staging[plan.miss_slots] = pool[plan.miss_chunks]
        chunks, slots = t.staged()
        assert np.array_equal(staging[slots], pool[chunks])
        assert np.array_equal(pool[:n_formed], truth[:n_formed])
        assert np.array_equal(staging[t.slot_of_chunk[active]], truth[active])
        # The window: the compressor forms some of the reserved chunks, straight into staging.
        grown = int(rng.integers(0, min(region, n_chunks - n_formed) + 1))
        new = np.arange(n_formed, n_formed + grown)
        assert np.all(t.slot_of_chunk[new] >= 0)
        staging[t.slot_of_chunk[new]] = truth[new]
        n_formed += grown
    assert t.counters.stores > 0 and t.counters.evictions > 0


def test_misses_into_slots_of_the_running_window_are_late():
    """A miss may be copied while the last window still runs only into a slot that window
    cannot read: free, or not used in the last cycle. The others are ``miss_late``."""
    t = SwapTable(n_slots=6, n_chunks=40)
    t.prompt_stored(8)
    plan = t.cycle(np.array([0, 1, 2]), 8, 0)  # cycle 0: nothing runs yet, all early
    assert plan.miss_late.tolist() == [False] * 3
    plan = t.cycle(np.array([3, 4]), 8, 0)  # slots 3, 4 were free: early
    assert plan.miss_slots.tolist() == [3, 4] and plan.miss_late.tolist() == [False] * 2
    # cycle 2: chunk 4 hits; free slot 5 first, then the LRU slots 0, 1 (last used in cycle 0,
    # not by the running window of cycle 1): all early
    plan = t.cycle(np.array([5, 6, 7, 4]), 8, 0)
    assert plan.miss_slots.tolist() == [5, 0, 1] and not plan.miss_late.any()
    # cycle 3: chunk 2 (slot 2) and 4 hit; the LRU slot 3 (cycle 1) is early, the next one,
    # slot 0 (cycle 2: the running window reads chunk 6 there), late
    plan = t.cycle(np.array([0, 1, 2, 4]), 8, 0)
    assert plan.miss_chunks.tolist() == [0, 1] and plan.miss_slots.tolist() == [3, 0]
    assert plan.miss_late.tolist() == [False, True]
    t.check()
