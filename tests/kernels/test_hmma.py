"""The float16 tensor-core GEMM (kernels/hmma.py) against the NumPy references.

In the simulator each MMA is emulated per warp from the fragment layouts, so a wrong fragment
index, a wrong code conversion or a wrong scale shows up as a wrong product. Sizes are odd
where the kernel must mask: rows past N, tokens past the tile, experts sharing a tile.
"""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned, rel_err
from pocketfm import quants
from pocketfm.kernels import hmma, moe
from pocketfm.kernels.gemv import pack_weight
from pocketfm.kernels.mma import expert_order, expert_tiles_capacity
from pocketfm.quants import GGMLType

TYPES = {"q8_0": GGMLType.Q8_0, "f16": GGMLType.F16, "q2_k": GGMLType.Q2_K,
         "iq2_xxs": GGMLType.IQ2_XXS}
BOUND = 1e-4  # the bar for float32-accumulating kernels


@pytest.fixture(params=[2, 4], ids=["mi2", "mi4"])
def tiles_mi(request, monkeypatch):
    """Both kernel shapes: 2 or 4 16-row MMA tiles a warp (64·mi rows a block)."""
    mi = request.param
    for qt in hmma._SPECS:
        if hmma.TILES_MI[qt] != mi:
            assert mi == 2, "the 2-tile build is the only other"
            monkeypatch.setitem(hmma._KERNELS, qt, hmma.KERNELS_2[qt])
            monkeypatch.setitem(hmma.TILES_MI, qt, mi)
    return mi


def _weight(qtype, E, N, K, rng):
    return pack_weight(quants.random_blocks(qtype, (E, N, K), rng, std=0.05), qtype, N, K)


def _x(rng, R, K):
    """Rows of very different magnitudes, with an outlier: the row scales must follow."""
    x = rng.standard_normal((R, K)).astype(np.float32) * rng.uniform(0.1, 10, (R, 1))
    x[rng.integers(R), rng.integers(K)] *= 50
    return x.astype(np.float32)


def test_prepare_x_limbs_sums_and_scales():
    rng = fresh_rng()
    x = _x(rng, 6, 512)  # two super-blocks: the sums are written (Q2_K's)
    x[1] *= 1e-30  # a tiny row: its scale must bring it up
    x[2] *= 1e30  # a huge one: down, inside float16's range
    x[3] = 0  # an all-zero row
    xh, xl, xsum, xs = (a.copy_to_host() for a in hmma.prepare_x(cuda.to_device(x)))
    hi, lo, sums, inv = hmma.prepare_x_ref(x)
    np.testing.assert_array_equal(xs, inv)
    np.testing.assert_array_equal(xh, hi)
    np.testing.assert_array_equal(xl, lo)
    # the sums / 16 as two float16 limbs in Q2_K's lane-slot order: the limbs' sum per entry
    # (the kernel adds in column order, NumPy pairwise: a last-bit difference moves the split)
    def joined(a):
        a = a.astype(np.float32).reshape(6, 2, 4, 2, 4)
        return a[:, :, :, 0] + a[:, :, :, 1]
    got, want = joined(xsum), joined(sums)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # ... and the order is the scale bytes': position 4c + j holds sub-block 8h + 2j + u
    s16 = (hi.astype(np.float32) + lo.astype(np.float32)).reshape(6, 2, 16, 16).sum(axis=3)
    assert np.allclose(want[:, 1, 3, 2] * 16, s16[:, 1, 8 + 4 + 1], rtol=1e-5,
                       atol=1e-5 * np.abs(s16).max())  # c = 3: h = 1, u = 1; j = 2
    v = hi.astype(np.float32) + lo.astype(np.float32)
    m = np.abs(v).max(axis=1)
    assert ((m[[0, 1, 2, 4, 5]] >= 2 ** 14) & (m[[0, 1, 2, 4, 5]] < 2 ** 15)).all()
    # two float16 limbs hold x to 22 bits of each value (23 of the row's largest)
    err = np.abs(v * xs[:, None] - x)
    assert (err <= np.abs(x) * 2.0 ** -21 + np.abs(x).max(axis=1, keepdims=True) * 2.0 ** -23).all()


def test_prepare_x_in_group_and_token_major_order():
    # the grouped output projection's x read in place: the same limbs, sums and scales as
    # prepare_x of the transposed array (bit for bit: the same values in the same order)
    rng = fresh_rng()
    T, G, n = 5, 3, 256  # whole super-blocks: the sums are written too
    o = _x(rng, T * G, n).reshape(T, G, n)
    got = [a.copy_to_host() for a in hmma.prepare_x_group_major(cuda.to_device(o))]
    want = [a.copy_to_host() for a in
            hmma.prepare_x(cuda.to_device(np.ascontiguousarray(o.transpose(1, 0, 2))
                                          .reshape(G * T, n)))]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    y = _x(rng, G * T, n).reshape(G, T, n)
    got = [a.copy_to_host() for a in hmma.prepare_x_token_major(cuda.to_device(y))]
    want = [a.copy_to_host() for a in
            hmma.prepare_x(cuda.to_device(np.ascontiguousarray(y.transpose(1, 0, 2))
                                          .reshape(T, G * n)))]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _dense_rel_err(qtype, N, T, K):
    """gemm_hmma of T fresh tokens by a fresh N x K weight against the reference."""
    rng = fresh_rng()
    w = _weight(qtype, 1, N, K, rng)
    x = _x(rng, T, K)
    ref = np.empty((T, N))
    hmma.gemm_hmma_ref(ref, w, x)
    out = poisoned((T, N))
    hmma.gemm_hmma(out, w.to_device(), cuda.to_device(x))
    return rel_err(out.copy_to_host(), ref)


@pytest.mark.parametrize("name", TYPES)
def test_dense_every_type(name, tiles_mi):
    qtype = TYPES[name]
    K = 64 if qtype in (GGMLType.Q8_0, GGMLType.F16) else 256
    # 72 rows: every row tile of the first warp (either shape) and a partial one after it;
    # 41 tokens: a full token tile (the K loop without per-tile branches) and one of 9 tokens
    # (two busy 8-token tiles, two skipped)
    assert _dense_rel_err(qtype, 72, 41, K) <= BOUND


@pytest.mark.parametrize("name,K", [("q8_0", 352), ("q2_k", 512)])
def test_x_staged_over_several_chunks(name, K):
    # x goes through shared memory hmma.CH = 256 columns at a time: Q8_0 over a full chunk
    # and a partial one; Q2_K over two super-blocks, each with its own mins' sums
    assert hmma.CH == 256
    assert _dense_rel_err(TYPES[name], 20, 11, K) <= BOUND


@pytest.mark.parametrize("name,aligned", [("q8_0", True), ("q2_k", True), ("iq2_xxs", True),
                                          ("iq2_xxs", False)])
def test_expert_rows_with_shared_x(name, aligned, tiles_mi):
    # 9 tokens x k = 3 experts each of E = 4: rows grouped by expert_order; without tiles a
    # block holds several experts (a pass each), with tiles one; x is one row per token
    qtype = TYPES[name]
    rng = fresh_rng()
    E, N, K, T, k = 4, 33, 256, 9, 3
    w = _weight(qtype, E, N, K, rng)
    x = _x(rng, T, K)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32).ravel()
    ref = np.empty((T * k, N))
    hmma.gemm_hmma_ref(ref, w, x, ids, x_div=k)
    d_ids = cuda.to_device(ids)
    order = cuda.to_device(np.zeros(T * k, np.int32))
    tiles = None
    if aligned:  # poisoned spare columns: expert_order must clear them
        tiles = cuda.to_device(np.full((2, expert_tiles_capacity(T * k, E) + 3), 7, np.int32))
    expert_order(order, d_ids, E, tiles=tiles)
    out = poisoned((T * k, N))
    hmma.gemm_hmma(out, w.to_device(), cuda.to_device(x), d_ids, order, tiles=tiles, x_div=k)
    assert rel_err(out.copy_to_host(), ref) <= BOUND


@pytest.mark.parametrize("name", ["iq2_xxs", "q2_k", "q8_0"])
def test_64_token_build_dense(name):
    # KERNELS_T64: 128 rows x 64 tokens a block, x staged 128 columns at a time. 72 rows (a
    # partial row block), 77 tokens (a full 64-token block: no per-tile branches; then 13: two
    # busy 8-token tiles of 8), K = 512 (four stages; Q2_K: two super-blocks, each one's mins
    # with its first stage)
    rng = fresh_rng()
    qtype, N, T, K = TYPES[name], 72, 77, 512
    w = _weight(qtype, 1, N, K, rng)
    x = _x(rng, T, K)
    ref = np.empty((T, N))
    hmma.gemm_hmma_ref(ref, w, x)
    out = poisoned((T, N))
    hmma.gemm_hmma(out, w.to_device(), cuda.to_device(x), tokens=64)
    assert rel_err(out.copy_to_host(), ref) <= BOUND


@pytest.mark.parametrize("name,aligned", [("iq2_xxs", True), ("iq2_xxs", False),
                                          ("q2_k", True), ("q8_0", False)])
def test_64_token_build_expert_rows(name, aligned):
    # 40 tokens through both of E = 2 experts (x shared by a token's 2 rows): with
    # expert_order's 64-row tiles each expert's 40 rows are one block (5 busy token tiles);
    # without tiles a block's 64 entries of order span both experts (a pass each)
    rng = fresh_rng()
    qtype, E, N, K, T, k = TYPES[name], 2, 20, 256, 40, 2
    w = _weight(qtype, E, N, K, rng)
    x = _x(rng, T, K)
    ids = np.stack([rng.permutation(E) for _ in range(T)]).astype(np.int32).ravel()
    ref = np.empty((T * k, N))
    hmma.gemm_hmma_ref(ref, w, x, ids, x_div=k)
    d_ids = cuda.to_device(ids)
    order = cuda.to_device(np.zeros(T * k, np.int32))
    tiles = None
    if aligned:
        assert expert_tiles_capacity(T * k, E, 64) == 4
        tiles = cuda.to_device(np.full((2, 4), 7, np.int32))
    expert_order(order, d_ids, E, tiles=tiles, tile=64)
    if aligned:
        np.testing.assert_array_equal(tiles.copy_to_host(), [[0, 40, 0, 0], [40, 80, 0, 0]])
    out = poisoned((T * k, N))
    hmma.gemm_hmma(out, w.to_device(), cuda.to_device(x), d_ids, order, tiles=tiles, x_div=k,
                   tokens=64)
    assert rel_err(out.copy_to_host(), ref) <= BOUND


def test_64_token_build_not_for_f16():
    rng = fresh_rng()
    w = _weight(GGMLType.F16, 1, 8, 64, rng)
    out = cuda.device_array((3, 8), np.float32)
    with pytest.raises(ValueError, match="no 64-token build for F16"):
        hmma.gemm_hmma(out, w.to_device(), cuda.to_device(_x(rng, 3, 64)), tokens=64)


def test_swiglu_preparation_matches_swiglu_then_gemm():
    rng = fresh_rng()
    R, F, N = 7, 256, 20
    w = _weight(GGMLType.Q2_K, 1, N, F, rng)
    gate_up = (rng.standard_normal((R, 2 * F)) * 4).astype(np.float32)
    weights = rng.uniform(0.1, 1, R).astype(np.float32)
    h = np.empty((R, F), np.float32)
    moe.swiglu_fused_ref(h, gate_up, weights, 10.0)
    ref = np.empty((R, N))
    hmma.gemm_hmma_ref(ref, w, h)
    limbs = hmma.prepare_x_swiglu(cuda.to_device(gate_up), cuda.to_device(weights), 10.0)
    out = poisoned((R, N))
    hmma.gemm_hmma_prepared(out, w.to_device(), limbs)
    assert rel_err(out.copy_to_host(), ref) <= BOUND


def test_supports():
    rng = fresh_rng()
    assert hmma.supports(_weight(GGMLType.Q2_K, 1, 8, 256, rng))
    assert hmma.supports(_weight(GGMLType.Q8_0, 1, 8, 64, rng))
    assert hmma.supports(_weight(GGMLType.F16, 1, 8, 64, rng))
    assert not hmma.supports(_weight(GGMLType.F16, 1, 8, 48, rng))  # not whole K steps
    assert not hmma.supports(_weight(GGMLType.BF16, 1, 8, 64, rng))  # not exact in float16
    assert not hmma.supports(_weight(GGMLType.Q4_K, 1, 8, 256, rng))


def test_workspace_carving():
    # the prefill registers its f16_x workspace for its stream: x is carved out of it (the
    # planner counts it), the GEMM reads the carved limbs; a too-small workspace is not used
    from pocketfm.engine.layout import f16_x_floats
    rng = fresh_rng()
    R, K, N = 5, 256, 12
    w = _weight(GGMLType.IQ2_XXS, 1, N, K, rng)
    x = _x(rng, R, K)
    stream = cuda.stream()
    flat = cuda.to_device(np.zeros(f16_x_floats(R, K), np.float32))
    hmma.use_workspace(stream, flat)
    try:
        limbs = hmma.prepare_x(cuda.to_device(x), stream)
        hi = hmma.prepare_x_ref(x)[0]
        n = 64 * K // 2  # one limb of f16_x_rows(5) = 64 rows
        carved = flat.copy_to_host()[:n].view(np.float16).reshape(64, K)[:R]
        np.testing.assert_array_equal(carved, hi)
        ref = np.empty((R, N))
        hmma.gemm_hmma_ref(ref, w, x)
        out = poisoned((R, N))
        hmma.gemm_hmma_prepared(out, w.to_device(), limbs, stream=stream)
        assert rel_err(out.copy_to_host(), ref) <= BOUND
        big = hmma.prepare_x(cuda.to_device(_x(rng, 70, K)), stream)  # 128 rows: too many
        assert big[0].shape == (70, K)
        np.testing.assert_array_equal(flat.copy_to_host()[:n].view(np.float16).reshape(64, K)[:R],
                                      hi)
        # carved once per shape; a workspace registered anew replaces the carving
        assert hmma.prepare_x(cuda.to_device(x), stream)[0] is limbs[0]
        flat2 = cuda.to_device(np.zeros(f16_x_floats(R, K), np.float32))
        hmma.use_workspace(stream, flat2)
        moved = hmma.prepare_x(cuda.to_device(x), stream)
        assert moved[0] is not limbs[0]
        np.testing.assert_array_equal(
            flat2.copy_to_host()[:n].view(np.float16).reshape(64, K)[:R], hi)
    finally:
        hmma.use_workspace(stream, None)


@pytest.mark.skipif(not hmma.SIMULATOR, reason="the simulator's emulation of fma.rn.f16x2")
def test_simulated_f16_pair_fma_is_numpys():
    """The fast struct-based emulation rounds as the NumPy form, overflow to inf included."""
    rng = fresh_rng()
    words = rng.integers(0, 2 ** 32, (20000, 3), dtype=np.uint64)
    finite = (((words >> 10) & 0x1F) != 0x1F) & (((words >> 26) & 0x1F) != 0x1F)  # no inf / NaN
    cases = [tuple(int(v) for v in w) for w in words[finite.all(axis=1)]]
    cases += [(0x7BFF7BFF, 0x7BFF7BFF, 0), (0x7BFF3C00, 0x40003C00, 0x7BFF0000)]  # overflows
    for a, b, c in cases:
        assert hmma._hfma2(a, b, c) == hmma._hfma2_numpy(a, b, c), (hex(a), hex(b), hex(c))
    assert hmma._hfma2(0x7BFF7BFF, 0x7BFF7BFF, 0) == 0x7C007C00  # (inf, inf)
