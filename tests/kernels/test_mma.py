"""The tensor-core GEMM (kernels/mma.py) against the NumPy references, every weight type.

In the simulator each MMA is emulated per warp (fragment layouts included), so a wrong
fragment index, a wrong bf16 split or a wrong expert pass shows up as a wrong product. Sizes
are odd where the kernel must mask: rows past N, tokens past the tile, K in several splits.
"""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned, rel_err
from pocketfm import quants
from pocketfm.kernels import mma
from pocketfm.kernels.device import SIMULATOR
from pocketfm.kernels.gemv import pack_weight
from pocketfm.quants import GGMLType

TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16, "q8_0": GGMLType.Q8_0,
         "q2_k": GGMLType.Q2_K, "q4_k": GGMLType.Q4_K, "iq2_xxs": GGMLType.IQ2_XXS,
         "mxfp4": GGMLType.MXFP4}
LOWBIT = (GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS, GGMLType.MXFP4)
BOUND = 1e-4  # the bar for float32-accumulating kernels


def _weight(qtype, E, N, K, rng):
    raw = quants.random_blocks(qtype, (E, N, K), rng, std=0.05)
    return pack_weight(raw, qtype, N, K)


def _run(qtype, E, N, K, T, with_ids, grouped=False, shuffled=False, aligned=False, **how):
    """rel. error of gemm_mma against the reference; ``grouped``: unsorted ids and the rows
    grouped by expert_order (``aligned``: and its expert tiles, as the prefill's MoE);
    ``shuffled``: unsorted ids taken as they come; else sorted ids."""
    rng = fresh_rng()
    w = _weight(qtype, E, N, K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32) * rng.uniform(0.1, 10)
    ids = rng.integers(0, E, T).astype(np.int32) if with_ids else None
    if with_ids and not (grouped or shuffled):
        ids = np.sort(ids)
    ref = np.empty((T, N), np.float64)
    mma.gemm_mma_ref(ref, w, x, ids)
    out = poisoned((T, N))
    d_ids = None if ids is None else cuda.to_device(ids)
    order = None
    if grouped:
        order = cuda.to_device(np.zeros(T, np.int32))
        if aligned:  # poisoned spare columns: the kernel must clear them
            how["tiles"] = cuda.to_device(np.full((2, mma.expert_tiles_capacity(T, E) + 3),
                                                  7, np.int32))
        mma.expert_order(order, d_ids, E, tiles=how.get("tiles"))
    mma.gemm_mma(out, w.to_device(), cuda.to_device(x), d_ids, order, **how)
    return rel_err(out.copy_to_host(), ref)


def test_split_bf16_keeps_16_bits():
    v = fresh_rng().standard_normal(10_000).astype(np.float32) * 1e3
    hi, lo = mma.split_bf16_ref(v)
    assert (hi.view(np.uint32) & 0xFFFF == 0).all() and (lo.view(np.uint32) & 0xFFFF == 0).all()
    err = np.abs((hi.astype(np.float64) + lo) - v) / np.abs(v)
    assert err.max() <= 2.0 ** -16


@pytest.mark.parametrize("name", TYPES)
def test_shared_weight_every_type(name):
    qtype = TYPES[name]
    K = 256 if qtype in LOWBIT else 64
    # 40 rows and 19 tokens: partial row and token tiles (the simulator's MMAs are slow)
    assert _run(qtype, 1, 40, K, 19, False, split_k=1) <= BOUND


@pytest.mark.parametrize("name", ["q8_0", "q2_k", "iq2_xxs"])
def test_codes_kernels_expert_rows_grouped(name):
    # the 16-token tiles of the MoE: 3 experts over 21 unsorted rows, grouped by expert_order;
    # tiles hold several experts (a pass each)
    qtype = TYPES[name]
    assert _run(qtype, 3, 33, 256, 21, True, grouped=True, narrow=True) <= BOUND


@pytest.mark.parametrize("name", ["q2_k", "iq2_xxs", "mxfp4"])
def test_expert_aligned_tiles(name):
    # expert_order's tiles: 2 experts over 75 rows, so one expert spans several 32-row tiles
    # and the last tile of each is partial; mxfp4 has no narrow kernel (its wide tile serves)
    assert _run(TYPES[name], 2, 20, 256, 75, True, grouped=True, aligned=True) <= BOUND


def test_expert_rows_and_split_k():
    # 3 experts over 70 sorted rows in 64-token tiles: tiles with one and with two experts
    assert _run(GGMLType.Q8_0, 3, 20, 64, 70, True, split_k=1) <= BOUND
    assert _run(GGMLType.F16, 1, 20, 96, 9, False, split_k=2) <= BOUND  # 3 K steps in 2 splits
    assert _run(GGMLType.Q2_K, 1, 20, 512, 9, False, split_k=2) <= BOUND


def test_unsorted_rows_still_right():
    # no order: every tile holds every expert; still one exact product per row
    assert _run(GGMLType.BF16, 4, 20, 64, 9, True, shuffled=True) <= BOUND
    assert _run(GGMLType.IQ2_XXS, 4, 20, 256, 9, True, shuffled=True, narrow=False) <= BOUND


def test_expert_order_groups_rows():
    rng = fresh_rng()
    E, R = 7, 50
    ids = rng.integers(0, E, R).astype(np.int32)
    order = cuda.to_device(np.full(R, -1, np.int32))
    mma.expert_order(order, cuda.to_device(ids), E)
    got = order.copy_to_host()
    ref = np.empty(R, np.int32)
    mma.expert_order_ref(ref, ids, E)
    assert sorted(got) == list(range(R))  # a permutation
    np.testing.assert_array_equal(ids[got], ids[ref])  # grouped by expert, increasing
    # with tiles (90 rows over 4 experts: some expert needs 2-3 tiles; spare columns cleared)
    R, E = 90, 4
    ids = np.repeat(np.arange(E, dtype=np.int32), [50, 0, 7, 33])[rng.permutation(R)]
    cap = mma.expert_tiles_capacity(R, E)
    tiles = cuda.to_device(np.full((2, cap + 2), -5, np.int32))
    order = cuda.to_device(np.full(R, -1, np.int32))
    mma.expert_order(order, cuda.to_device(ids), E, tiles=tiles)
    ref_order, ref_tiles = np.empty(R, np.int32), np.empty((2, cap + 2), np.int32)
    mma.expert_order_ref(ref_order, ids, E, ref_tiles)
    np.testing.assert_array_equal(tiles.copy_to_host(), ref_tiles)
    assert (ref_tiles[1] - ref_tiles[0]).tolist()[:5] == [32, 18, 7, 32, 1]
    with pytest.raises(ValueError, match="at most"):
        mma.expert_order(order, cuda.to_device(ids), mma.MAX_E + 1)


@pytest.mark.skipif(SIMULATOR, reason="GPU sizes")
@pytest.mark.parametrize("name", ["q8_0", "q2_k", "iq2_xxs", "f16"])
def test_gpu_sizes(name):
    qtype = TYPES[name]
    assert _run(qtype, 1, 1000, 2048, 300, False) <= BOUND
    assert _run(qtype, 16, 512, 1024, 600, True) <= BOUND  # 16 experts, sorted rows
    assert _run(qtype, 64, 256, 1024, 700, True, grouped=True) <= BOUND
    assert _run(qtype, 64, 256, 1024, 700, True, grouped=True, aligned=True) <= BOUND  # MoE
