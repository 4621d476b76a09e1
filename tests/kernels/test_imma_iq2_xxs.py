"""The IQ2_XXS decode GEMV on the int8 tensor cores (imma_iq2_xxs.py) against gemv_lowbit's
reference.

The kernel rounds x to int16 per 32-column group (|q| <= 32000 of the group's max): each x
element is off by at most max|x| / 64000, so an output may be off by that times Σ|w| of its
row; the test checks that bound per output and rel-L2 <= 1e-3 (as the dp4a kernels' test).
Shapes: one, two and four 512-column stages a row (1, 2 and 4 warps splitting K), 16-row tiles
with a partial last one, ids with x per token and one x row shared by every id.
"""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned, rel_err
from pocketfm import quants
from pocketfm.kernels import gemv_lowbit as gl
from pocketfm.kernels import imma_iq2_xxs as imma
from pocketfm.quants import GGMLType

X_STEP = 1.0 / 64000

# (experts, N, K, T, ids, one x row for every id)
SHAPES = [(3, 33, 512, 3, True, False), (1, 16, 2048, 1, False, False),
          (3, 40, 1024, 2, True, True)]


def _case(E, N, K, T, with_ids, one_x):
    rng = fresh_rng()
    raw = quants.random_blocks(GGMLType.IQ2_XXS, (E, N, K), rng, std=0.05)
    w = gl.pack_iq2_xxs(raw, N, K)
    x = rng.standard_normal((1 if one_x else T, K)).astype(np.float32)
    ids = rng.integers(0, E, T).astype(np.int32) if with_ids else None
    xt = np.repeat(x, T, axis=0) if one_x else x
    ref = np.empty((T, N), np.float64)
    gl.gemv_iq2_xxs_ref(ref, w, xt, ids)
    W = np.abs(quants.dequantize(raw, GGMLType.IQ2_XXS).astype(np.float64))
    W = W[ids if with_ids else [0] * T]  # [T, N, K]
    bound = X_STEP * np.abs(xt).max(axis=1)[:, None] * W.sum(axis=2)
    return w, x, ids, ref, bound


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[1]}-K{s[2]}-T{s[3]}")
def test_imma_gemv_equals_reference(shape):
    w, x, ids, ref, bound = _case(*shape)
    out = poisoned(ref.shape)
    imma.gemv_iq2_xxs_imma(out, w.to_device(), cuda.to_device(x),
                           None if ids is None else cuda.to_device(ids))
    got = out.copy_to_host()
    assert rel_err(got, ref) <= 1e-3
    assert np.all(np.abs(got - ref) <= bound + 1e-6 * np.abs(ref) + 1e-7)


def test_shared_x_row_equals_its_copies():
    """One x row for every id gives the same bits as a copy of the row per id."""
    w, x, ids, _, _ = _case(3, 16, 512, 3, True, True)
    dw, di = w.to_device(), cuda.to_device(ids)
    one, rep = poisoned((3, 16)), poisoned((3, 16))
    imma.gemv_iq2_xxs_imma(one, dw, cuda.to_device(x), di)
    imma.gemv_iq2_xxs_imma(rep, dw, cuda.to_device(np.repeat(x, 3, axis=0)), di)
    assert np.array_equal(one.copy_to_host(), rep.copy_to_host())


def test_x_preparation_rounds_to_the_group_scale():
    """x = s · (256 hi + lo) to half a step (and float32's roundings), s = max|x| / 32000 per 32
    columns, both bytes in int8 range (a group of zeros gives zeros)."""
    T, K = 2, 512
    x = fresh_rng().standard_normal((T, K)).astype(np.float32)
    x[1, 32:64] = 0
    xq, xs = imma.prepare_x(cuda.to_device(x))
    planes = xq.copy_to_host().view(np.int8).reshape(T, 2, K).astype(np.int64)
    s = xs.copy_to_host().reshape(T, K // 32)
    np.testing.assert_allclose(s, np.abs(x).reshape(T, -1, 32).max(axis=2) / 32000, rtol=1e-6)
    q = 256 * planes[:, 0] + planes[:, 1]
    assert np.abs(q).max() <= 32000
    step = np.repeat(s, 32, axis=1)
    # half a step, plus x · (32000 / max) against x / s in float32: |x / s| <= 32000 times a
    # few roundings of 6e-8 (~0.01 of a step)
    assert np.all(np.abs(q * step - x) <= 0.52 * step + 1e-12)
    assert np.all(q[1, 32:64] == 0)


def test_x_preparation_for_integer_sums_takes_the_super_block_scale():
    """prepare_x(super_blocks=True): every group's scale is its 256-column super-block's max /
    32000, x rounded to it (half a step), the bytes as prepare_x's."""
    T, K = 2, 1024
    x = fresh_rng().standard_normal((T, K)).astype(np.float32)
    x[0, 256:288] *= 40  # (one group's max over the others': their scale follows it)
    xq, xs = imma.prepare_x(cuda.to_device(x), super_blocks=True)
    planes = xq.copy_to_host().view(np.int8).reshape(T, 2, K).astype(np.int64)
    s = xs.copy_to_host().reshape(T, K // 32)
    want = np.repeat(np.abs(x).reshape(T, -1, 256).max(axis=2) / 32000, 8, axis=1)
    np.testing.assert_allclose(s, want, rtol=1e-6)
    q = 256 * planes[:, 0] + planes[:, 1]
    step = np.repeat(s, 32, axis=1)
    assert np.abs(q).max() <= 32000
    assert np.all(np.abs(q * step - x) <= 0.52 * step + 1e-12)


def test_integer_sums_builds_equal_the_default_on_super_block_x():
    """sm3_int_sums over 9 tiles of 4 stages (two rounds, sub-blocks past the end) on x scaled
    per super-block: the default build's sums of the same codes, up to its float roundings
    (a group's product a float there, a super-block's integer sum here), and the reference
    within the rounding of x to 15 bits of its super-block's max; sm3_int_wide and
    sm_int_wide (its tables in the wide layout, 3 and 4 tiles a block): the same bits."""
    w, x, ids, ref, bound = _case(3, 130, 2048, 2, True, False)
    dw, dx, di = w.to_device(), cuda.to_device(x), cuda.to_device(ids)
    base, out = poisoned((2, 130)), poisoned((2, 130))
    imma.gemv_prepared(base, dw, imma.prepare_x(dx, super_blocks=True), di)
    assert imma.needs_super_block_x("sm3_int_sums") and not imma.needs_super_block_x("sm3")
    imma.gemv_prepared(out, dw, imma.prepare_x(dx, super_blocks=True), di, build="sm3_int_sums")
    got, b = out.copy_to_host(), base.copy_to_host()
    np.testing.assert_allclose(got, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())
    assert rel_err(got, ref) <= 1e-3
    # (x rounded to a super-block's max: within the row-max bound of the per-group test)
    assert np.all(np.abs(got - ref) <= bound + 1e-5 * np.abs(ref) + 1e-6)
    # the same codes from the wide table layout, summed in the same order: the same bits
    for build in ("sm3_int_wide", "sm_int_wide"):
        wide = poisoned((2, 130))
        imma.gemv_prepared(wide, dw, imma.prepare_x(dx, super_blocks=True), di, build=build)
        assert np.array_equal(wide.copy_to_host(), got), build


def test_tables_make_the_signed_grid():
    """The code and sign nibbles, through prmt's selection, give every grid row's signed bytes
    for every 7-bit sign index (the reference's grid · ksigns)."""
    codes, signs = imma._TABLES[:256].astype(np.int64), imma._TABLES[256:].astype(np.int64)
    src = np.array([8, 25, 43, 0, -8, -25, -43, 0])
    sel = (codes[:, None] | signs[None, :])  # [256, 128]
    got = np.stack([src[(sel >> (4 * k)) & 7] for k in range(8)], axis=-1)
    s8 = quants.KSIGNS_IQ2XS.astype(np.int64)
    neg = (s8[None, :, None] >> np.arange(8)) & 1
    want = quants.IQ2XXS_GRID.astype(np.int64)[:, None, :] * (1 - 2 * neg)
    np.testing.assert_array_equal(got, want)


def test_takes_only_whole_stages_of_iq2_xxs():
    rng = fresh_rng()
    for qtype, K, ok in ((GGMLType.IQ2_XXS, 512, True), (GGMLType.IQ2_XXS, 256, False),
                         (GGMLType.Q2_K, 512, False)):
        raw = quants.random_blocks(qtype, (4, K), rng, std=0.05)
        assert imma.takes_imma(gl.PACKERS[qtype](raw, 4, K)) is ok


def test_candidate_builds_give_the_same_bits():
    """More table copies and the signs by multiplies make the same codes: the same outputs; a
    group scaled on one lane of its quad sums the same terms in another order."""
    w, x, ids, _, _ = _case(3, 16, 512, 2, True, False)
    dw, dx, di = w.to_device(), cuda.to_device(x), cuda.to_device(ids)
    base = poisoned((2, 16))
    imma.gemv_prepared(base, dw, imma.prepare_x(dx), di)
    for build in imma.CANDIDATES:  # (the SM-wide ones take the default here: one stage a row)
        out = poisoned((2, 16))
        imma.gemv_prepared(out, dw, imma.prepare_x(dx), di, build=build)
        if "quad" in build:
            np.testing.assert_allclose(out.copy_to_host(), base.copy_to_host(), rtol=1e-5,
                                       atol=1e-6 * np.abs(base.copy_to_host()).max())
        else:
            assert np.array_equal(out.copy_to_host(), base.copy_to_host()), build


@pytest.mark.parametrize("build", ["sm", "sm3", "sm3_alu_signs"])  # (sm3: the engine's)
def test_sm_wide_build_equals_the_default_over_rounds(build):
    """The SM-wide build (3-4 tiles a block at once, one table copy a lane) over 9 tiles (the
    last partial) of 4 stages (4 warps a tile): its grid of 2 blocks a token takes 6-8 tiles a
    round, so the second round has sub-blocks past the end, which must store nothing. The same
    codes and sums: the same bits."""
    w, x, ids, ref, _ = _case(3, 130, 2048, 2, True, False)
    dw, dx, di = w.to_device(), cuda.to_device(x), cuda.to_device(ids)
    base, out = poisoned((2, 130)), poisoned((2, 130))
    imma.gemv_prepared(base, dw, imma.prepare_x(dx), di)
    imma.gemv_prepared(out, dw, imma.prepare_x(dx), di, build=build)
    assert np.array_equal(out.copy_to_host(), base.copy_to_host())
    assert rel_err(out.copy_to_host(), ref) <= 1e-3
