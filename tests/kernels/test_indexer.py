"""Lightning indexer kernels vs their NumPy references (simulator in CI; a GPU with CUDASIM=0)."""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm import ops
from pocketfm.kernels import indexer as ix
from pocketfm.kernels.device import SIMULATOR

DI = 128  # V4 index dim: 68-byte keys
HI = 8 if SIMULATOR else 64  # a multiple of the register tile's 8 heads


def scorer_inputs(rng, T, ncap):
    keys = ix.random_packed_keys(rng, ncap, DI)
    q = rng.normal(size=(T, HI, DI)).astype(np.float32)
    w = rng.normal(size=(T, HI)).astype(np.float32)
    return q, w, keys


def check_scores(out, ref, n_visible):
    for t, n in enumerate(n_visible):
        assert rel_err(out[t, :n], ref[t, :n]) <= 1e-4
        assert np.all(np.isneginf(out[t, n:]))


@pytest.mark.parametrize("naive", [True, False])
def test_indexer_scores_decode(naive):
    rng = fresh_rng()
    ncap, N, n = 45, 43, 37  # N, n_visible: multiples of nothing
    q, w, keys = scorer_inputs(rng, 1, ncap)
    nv = np.array([n], np.int32)
    ref = np.empty((1, N))
    ix.indexer_scores_ref(ref[0], q[0].astype(np.float64), w[0].astype(np.float64), keys, nv)
    out = poisoned(N)
    ix.indexer_scores(out, cuda.to_device(q[0]), cuda.to_device(w[0]), cuda.to_device(keys),
                      cuda.to_device(nv), threads=THREADS, naive=naive, mma=False)
    check_scores(out.copy_to_host()[None], ref, [n])


def test_indexer_scores_ref_is_ops_on_unpacked_keys():
    rng = fresh_rng()
    q, w, keys = scorer_inputs(rng, 2, 20)
    x = np.empty((20, DI), np.float32)
    ix.kvpack.unpack_index_key_ref(x, keys)
    ref, want = np.empty((2, 20)), np.empty((2, 20))
    ix.indexer_scores_chunk_ref(ref, q, w, keys, np.array([20, 20], np.int32))
    ops.indexer_scores(want, q.astype(np.float64), w.astype(np.float64), x.astype(np.float64))
    assert np.array_equal(ref, want)


@pytest.mark.parametrize("naive", [True, False])
def test_indexer_scores_chunk(naive):
    rng = fresh_rng()
    T, ncap, N = 3, 41, 41
    q, w, keys = scorer_inputs(rng, T, ncap)
    nv = np.array([5, 30, 41], np.int32)
    ref = np.empty((T, N))
    ix.indexer_scores_chunk_ref(ref, q.astype(np.float64), w.astype(np.float64), keys, nv)
    out = poisoned((T, N))
    ix.indexer_scores_chunk(out, cuda.to_device(q), cuda.to_device(w), cuda.to_device(keys),
                            cuda.to_device(nv), threads=THREADS, naive=naive, mma=False)
    check_scores(out.copy_to_host(), ref, nv)


def test_indexer_scores_many_tiles():
    """Register tiles: several blocks, and tiles past n_visible (only the -inf fill)."""
    rng = fresh_rng()
    ncap, n = (800, 530) if SIMULATOR else (100_000, 90_001)  # GPU: > 4 tiles per SM
    q, w, keys = scorer_inputs(rng, 1, ncap)
    nv = np.array([n], np.int32)
    ref = np.empty((1, ncap))
    ix.indexer_scores_ref(ref[0], q[0].astype(np.float64), w[0].astype(np.float64), keys, nv)
    out = poisoned(ncap)
    ix.indexer_scores(out, cuda.to_device(q[0]), cuda.to_device(w[0]), cuda.to_device(keys),
                      cuda.to_device(nv), threads=THREADS, mma=False)
    check_scores(out.copy_to_host()[None], ref, [n])


def ascending(ref):
    """The radix top-k's order: the picks ascending, the -1 pads last."""
    picks = sorted(int(j) for j in ref if j >= 0)
    return picks + [-1] * (len(ref) - len(picks))


def run_topk(scores, n, k, naive, work=None, threads=THREADS):
    out = cuda.to_device(np.full(k, -7, np.int32))
    ix.topk(out, cuda.to_device(scores.astype(np.float32)), cuda.to_device(np.array([n], np.int32)),
            k, threads=threads, naive=naive, work=work)
    ref = np.empty(k, np.int32)
    ix.topk_ref(ref, scores, np.array([n]), k)
    return out.copy_to_host(), ref


@pytest.mark.parametrize("naive", [True, False])
def test_topk_distinct_scores(naive):
    rng = fresh_rng()
    N, n, k = (301, 283, 24) if SIMULATOR else (30_011, 29_989, 512) if naive else (
        262_144, 262_139, 512)
    scores = rng.permutation(N).astype(np.float32) * np.float32(0.37) - np.float32(N / 5)
    scores[n:] = 1e9  # invisible entries never win
    out, ref = run_topk(scores, n, k, naive)
    assert sorted(out) == sorted(ref)
    if naive:
        assert np.array_equal(out, ref)  # rank order: exactly the reference's order
    else:
        assert list(out) == ascending(ref)  # index order: no sort needed after it
    alt = np.empty((1, k), np.int64)
    ops.topk_visible(alt, scores[None].astype(np.float64), np.array([n]))
    assert set(alt[0]) == set(ref)  # no ties: the reference agrees with the model's op


@pytest.mark.parametrize("naive,threads", [(True, THREADS), (False, THREADS),
                                           (False, 96 if SIMULATOR else 512),
                                           (False, 96 if SIMULATOR else 1024)])
def test_topk_ties_go_to_the_lowest_index(naive, threads):
    # (several warps: the digit picks' scans cross warps; on a GPU 1,024 threads asked for,
    # which topk caps at TOPK_MAX_THREADS: its registers do not let 1,024 launch)
    rng = fresh_rng()
    N, n, k = (257, 250, 20) if SIMULATOR else (20_003, 19_999, 512) if naive else (
        100_003, 99_999, 512)
    scores = rng.integers(0, 6, size=N).astype(np.float32) - 2.0  # heavy ties, -0/+0 too
    scores[rng.integers(0, n, size=5)] = -0.0
    out, ref = run_topk(scores, n, k, naive, threads=threads)
    assert sorted(out) == sorted(ref)
    assert naive or list(out) == ascending(ref)
    top = np.sort(scores[:n])[::-1]
    assert top[k - 1] == top[k]  # the k-th value really is tied across the cut


@pytest.mark.parametrize("naive", [True, False])
def test_topk_fewer_visible_than_k(naive):
    scores = fresh_rng().normal(size=50).astype(np.float32)
    out, ref = run_topk(scores, 13, 32, naive)
    assert sorted(out) == sorted(ref) == [-1] * 19 + list(range(13))
    assert naive or list(out) == list(range(13)) + [-1] * 19


def test_topk_reuses_its_workspace():
    """The radix kernel leaves its barrier's arrival count and its histograms at zero, and each
    launch reads the barrier's generation where the last left it: back-to-back calls (ties at
    the cut in some, so they take all three digit passes; on a GPU over ~35 blocks, so every
    grid barrier waits) stay correct."""
    work = ix.topk_workspace()
    rng = fresh_rng()
    N = 101 if SIMULATOR else 70_001
    for n, ties in ((97, False), (90, True), (40, False), (5, False), (101, False),
                    (96, True), (101, True)):
        n = n * N // 101
        scores = rng.normal(size=N).astype(np.float32)
        if ties:
            scores = np.round(scores * 4).astype(np.float32)
        out, ref = run_topk(scores, n, 16 if SIMULATOR else 512, False, work)
        assert list(out) == ascending(ref)
    left = work.copy_to_host()
    assert not left[:3 * ix._HIST].any() and left[ix._WS_BAR] == 0


def run_topk_chunk(scores, nv, k, threads=THREADS, cand=ix._CAND, tie_list=ix._TIE_LIST):
    T = scores.shape[0]
    out = cuda.to_device(np.full((T, k), -7, np.int32))  # an unwritten slot shows as -7
    ix.topk_chunk(out, cuda.to_device(scores.astype(np.float32)),
                  cuda.to_device(np.asarray(nv, np.int32)), k, threads=threads, cand=cand,
                  tie_list=tie_list)
    ref = np.empty((T, k), np.int32)
    ix.topk_chunk_ref(ref, scores, np.asarray(nv), k)
    alt = np.empty((T, k), np.int64)  # the model's op: same tie rule, independent code
    ops.topk_visible(alt, scores.astype(np.float64), np.minimum(nv, scores.shape[1]))
    out = out.copy_to_host()
    for t in range(T):
        assert sorted(out[t]) == sorted(ref[t]) == sorted(alt[t]), f"row {t}, n_visible {nv[t]}"
    return out, ref


def test_topk_chunk_ref_is_topk_ref_per_row():
    rng = fresh_rng()
    scores = rng.integers(0, 4, size=(3, 40)).astype(np.float32)
    nv, k = np.array([0, 9, 40]), 10
    ref = np.empty((3, k), np.int32)
    ix.topk_chunk_ref(ref, scores, nv, k)
    for t in range(3):
        row = np.empty(k, np.int32)
        ix.topk_ref(row, scores[t], nv[t:t + 1], k)
        assert np.array_equal(ref[t], row)
    assert list(ref[0]) == [-1] * k and sorted(ref[1]) == [-1] + list(range(9))


@pytest.mark.parametrize("threads", [THREADS, 96 if SIMULATOR else 1024])
def test_topk_chunk_ties_and_visible_counts(threads):
    """Rows with n_visible 0, < k, = k, k + 1, > k and > N; heavy ties, -0/+0 and -inf."""
    rng = fresh_rng()
    T, N, k = (6, 400, 24) if SIMULATOR else (6, 100_003, 512)
    scores = rng.integers(0, 6, size=(T, N)).astype(np.float32) - 2.0  # few values: ties
    scores[rng.random((T, N)) < 0.05] = -0.0
    scores[rng.random((T, N)) < 0.1] = -np.inf
    scores[:, N - 3:] = 1e9  # past n_visible in every row but the last two: never selected
    nv = np.array([0, k - 5, k, k + 1, N - 3, N + 10])
    out, ref = run_topk_chunk(scores, nv, k, threads)
    top = np.sort(scores[4, :N - 3])[::-1]
    assert top[k - 1] == top[k]  # the k-th value really is tied across the cut


@pytest.mark.parametrize("cand", [ix._CAND, 8])
def test_topk_chunk_distinct_scores(cand):
    """Tie-free rows (one to three digit passes), N not a multiple of the block; the bins
    listed in shared memory, and (cand 8: more than 8 in the bin) the rows read each pass."""
    rng = fresh_rng()
    T, N, k = (3, 601, 64) if SIMULATOR else (8, 262_144, 512)
    scores = rng.normal(size=(T, N)).astype(np.float32) * np.float32(30.0)
    scores[1] = rng.permutation(N).astype(np.float32)  # integers: long runs of equal high bits
    nv = np.array([N, N - 100, k + 37])
    if not SIMULATOR:
        nv = np.linspace(k + 1, N, T).astype(np.int64)
    run_topk_chunk(scores, nv, k, cand=cand)


def test_topk_chunk_ties_in_a_listed_bin():
    """A few exact ties at the k-th score, the threshold bin small enough to be listed: the
    lowest indices of the tied entries win, ranked on the list. Row 1: all tied are taken."""
    rng = fresh_rng()
    T, N, k = (2, 500, 32) if SIMULATOR else (2, 65_536, 512)
    scores = rng.normal(size=(T, N)).astype(np.float32)
    for t, ties in ((0, 5), (1, 1)):
        kth = np.sort(scores[t])[::-1][k - 1]
        others = np.flatnonzero(scores[t] < kth)
        scores[t, rng.choice(others, ties, replace=False)] = kth  # ties + 1 entries at kth
    out, ref = run_topk_chunk(scores, np.array([N, N]), k)
    kth = np.sort(scores[0])[::-1][k - 1]
    assert (scores[0] == kth).sum() == 6 and (np.sort(scores[0])[::-1][k] == kth)


@pytest.mark.parametrize("cand, tie_list", [(ix._CAND, ix._TIE_LIST), (ix._CAND, 3), (8, 3)])
def test_topk_chunk_rows_of_repeated_scores(cand, tie_list):
    """Rows that repeat a few distinct scores (as the bench's synthetic caches: every key many
    times), so many entries tie at the k-th score: ranked on the list (few ties), by a row
    pass after the list (tie_list 3: it must not write the listed picks again), or by the
    four passes (cand 8)."""
    rng = fresh_rng()
    T, N, k, R = (3, 500, 32, 25) if SIMULATOR else (3, 63_000, 512, 1500)  # 42 copies
    scores = np.tile(rng.normal(size=(T, R)).astype(np.float32), N // R)
    # row 1 in runs, highest first: every entry above the k-th score comes before the ties
    scores[1] = np.repeat(np.sort(scores[1, :R])[::-1], N // R)
    nv = np.array([N, N - R // 2 - 1, k + R + 3])
    run_topk_chunk(scores, nv, k, cand=cand, tie_list=tie_list)
    top = np.sort(scores[0])[::-1]
    ties = (scores[0] == top[k - 1]).sum()
    assert top[k] == top[k - 1] and 3 < ties <= ix._TIE_LIST  # each path taken as named


def test_topk_chunk_minus_inf_threshold():
    """Fewer finite entries than k: the top k fill up with -inf entries, lowest index first."""
    rng = fresh_rng()
    T, N, k = (3, 300, 16) if SIMULATOR else (3, 50_000, 512)
    scores = np.full((T, N), -np.inf, np.float32)
    scores[0, rng.choice(N, k // 2, replace=False)] = rng.normal(size=k // 2)
    scores[2, rng.choice(N, 3 * k, replace=False)] = rng.normal(size=3 * k)
    out, ref = run_topk_chunk(scores, np.array([N, N, N - 7]), k)
    assert sorted(out[1]) == list(range(k))  # all -inf: the first k


def test_topk_chunk_checks_k():
    with pytest.raises(ValueError):
        ix.topk_chunk(cuda.to_device(np.zeros((2, 4), np.int32)),
                      cuda.to_device(np.zeros((2, 9), np.float32)),
                      cuda.to_device(np.array([9, 9], np.int32)), 5)
