"""The decode's one-warp indexer scorer vs the NumPy reference, and the top-k's first digit
counted by it (the MMA emulated per warp in the simulator; mma.sync on a GPU)."""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned
from kernels.test_indexer import check_scores
from kernels.test_indexer_mma import _fp4_spread
from pocketfm.kernels import indexer as ix
from pocketfm.kernels import indexer_warp
from pocketfm.kernels.device import SIMULATOR


@pytest.mark.parametrize("HI,DI,n", [(64, 128, 261), (32, 128, 300), (16, 64, 7),
                                     (64, 128, 0)])
def test_scores_decode_one_warp_all_heads(HI, DI, n):
    # q on the FP4 grid with 32-dim blocks 2^-40 .. 2^40 apart and a zero first block (scale
    # byte 0): one warp holds every head; steps of 64 keys a block (4 warps x 16), the last one
    # partly visible; n = 0: nothing visible, all -inf
    rng = fresh_rng()
    ncap, N = 300, 290
    keys = np.empty((ncap, ix.kvpack.index_key_bytes(DI)), np.uint8)
    ix.kvpack.pack_index_key_ref(keys, _fp4_spread(rng, (ncap, DI)))
    q = _fp4_spread(rng, (1, HI, DI))[0]
    w = rng.normal(size=HI).astype(np.float32)
    nv = np.array([n], np.int32)
    ref = np.empty((1, N))
    ix.indexer_scores_ref(ref[0], q.astype(np.float64), w.astype(np.float64), keys, nv)
    out = poisoned(N)
    assert indexer_warp.fits_warp(HI, DI)
    ix.indexer_scores(out, cuda.to_device(q), cuda.to_device(w), cuda.to_device(keys),
                      cuda.to_device(nv), mma=True, q_fp4=True)
    check_scores(out.copy_to_host()[None], ref, [min(n, N)])


@pytest.mark.parametrize("n,k", [(261, 24), (20, 24)])
def test_scorer_counts_the_top_ks_first_digit(n, k):
    """indexer_scores(top_k=(work, k)) counts the top-k's first radix digit into its workspace,
    and topk(first_digit_counted=True) picks from those counts what the reference picks,
    leaving the workspace clean for the next pair (twice over; with n <= k nothing is counted:
    the top-k takes every visible key)."""
    rng = fresh_rng()
    HI, DI, ncap, N = 32, 128, 300, 290
    keys = cuda.to_device(ix.random_packed_keys(rng, ncap, DI))
    work = ix.topk_workspace()
    for _ in range(2):
        q = _fp4_spread(rng, (1, HI, DI))[0]
        w = rng.normal(size=HI).astype(np.float32)
        nv = cuda.to_device(np.array([n], np.int32))
        scores = poisoned(N)
        counted = ix.indexer_scores(scores, cuda.to_device(q), cuda.to_device(w), keys, nv,
                                    mma=True, q_fp4=True, top_k=(work, k))
        assert counted
        if n > k:
            hist = work.copy_to_host()[:indexer_warp.FIRST_DIGIT_BINS]
            got = scores.copy_to_host()[:n].view(np.uint32)
            keys_ord = np.array([indexer_warp.order_key(b) for b in got], np.int64)
            want = np.bincount(keys_ord >> indexer_warp.FIRST_DIGIT_SHIFT,
                               minlength=indexer_warp.FIRST_DIGIT_BINS)
            assert np.array_equal(hist, want)
        else:
            assert not work.copy_to_host().any()
        out = cuda.to_device(np.full(k, -7, np.int32))
        ix.topk(out, scores, nv, k, threads=96 if SIMULATOR else 512, work=work,
                first_digit_counted=counted)
        ref = np.empty(k, np.int32)
        ix.topk_ref(ref, scores.copy_to_host(), np.array([n]), k)
        picks = sorted(r for r in ref if r >= 0)
        assert list(out.copy_to_host()) == picks + [-1] * (k - len(picks))
        assert not work.copy_to_host()[:ix._WS_GT].any()  # the three histograms cleared


def test_q_fragment_index_places_every_pair_once():
    for HI, DI in ((16, 64), (64, 128)):
        at = [indexer_warp.q_fragment_index(h, d, DI) for h in range(HI) for d in range(0, DI, 2)]
        assert sorted(at) == list(range(HI * DI // 2))


@pytest.mark.parametrize("n,k", [(261, 24), (0, 24)])
def test_scorer_reads_q_fragments_made_ahead(n, k):
    """indexer_scores(q_frag=q_fragments_ref(q)): the same scores bit for bit, and the same
    first-digit counts, as the scorer staging q itself."""
    rng = fresh_rng()
    HI, DI, ncap, N = 32, 128, 300, 290
    keys = cuda.to_device(ix.random_packed_keys(rng, ncap, DI))
    q = _fp4_spread(rng, (1, HI, DI))[0]
    w = cuda.to_device(rng.normal(size=HI).astype(np.float32))
    nv = cuda.to_device(np.array([n], np.int32))
    got = []
    for frag in (None, cuda.to_device(indexer_warp.q_fragments_ref(q))):
        work = ix.topk_workspace()
        scores = poisoned(N)
        ix.indexer_scores(scores, cuda.to_device(q), w, keys, nv, mma=True, q_fp4=True,
                          top_k=(work, k), q_frag=frag)
        got.append((scores.copy_to_host(), work.copy_to_host()))
    assert np.array_equal(got[0][0].view(np.uint32), got[1][0].view(np.uint32))
    assert np.array_equal(got[0][1], got[1][1])


def test_fits_warp():
    assert indexer_warp.fits_warp(64, 128) and indexer_warp.fits_warp(16, 256)
    assert not indexer_warp.fits_warp(128, 128)  # 256 A registers a lane
    assert not indexer_warp.fits_warp(64, 48)  # not whole 32-dim FP4 blocks
