"""The Q2_K decode GEMV on the int8 tensor cores (imma_q2_k.py) against gemv_lowbit's references.

x is rounded to int16 per 256-column super-block (|q| <= 32000 of its max): each element is off
by at most max|x| / 64000, so an output may be off by that times Σ|w| of its row; the tests
check that bound per output and rel-L2 <= 1e-3. Shapes: one, two and four super-blocks a row
(1, 2 and 4 warps splitting K), a partial last 16-row tile, ids and none, one x row for every
id; the SwiGLU made in the x preparation, with and without the clamp biting.
"""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned, rel_err
from pocketfm import ops, quants
from pocketfm.kernels import gemv_lowbit as gl
from pocketfm.kernels import imma_q2_k as iq
from pocketfm.quants import GGMLType

X_STEP = 1.0 / 64000
SHAPES = [(3, 33, 512, 3, True), (1, 16, 1024, 1, False), (3, 20, 256, 2, True)]


def _weight(E, N, K):
    raw = quants.random_blocks(GGMLType.Q2_K, (E, N, K), fresh_rng(), std=0.05)
    return raw, gl.pack_q2_k(raw, N, K)


def _bound(raw, x, ids):
    W = np.abs(quants.dequantize(raw, GGMLType.Q2_K).astype(np.float64))
    W = W[ids if ids is not None else [0] * len(x)]  # [T, N, K]
    return X_STEP * np.abs(x).max(axis=1)[:, None] * W.sum(axis=2)


def _check(got, ref, bound):
    assert rel_err(got, ref) <= 1e-3
    assert np.all(np.abs(got - ref) <= bound + 1e-6 * np.abs(ref) + 1e-7)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[1]}-K{s[2]}-T{s[3]}")
def test_imma_q2_k_gemv_equals_reference(shape):
    E, N, K, T, with_ids = shape
    rng = fresh_rng()
    raw, w = _weight(E, N, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    ids = rng.integers(0, E, T).astype(np.int32) if with_ids else None
    ref = np.empty((T, N), np.float64)
    gl.gemv_q2_k_ref(ref, w, x, ids)
    out = poisoned((T, N))
    iq.gemv_q2_k_imma(out, w.to_device(), cuda.to_device(x),
                      None if ids is None else cuda.to_device(ids))
    _check(out.copy_to_host(), ref, _bound(raw, x, ids))


@pytest.mark.parametrize("clamp", [0.0, 1.0])
def test_gemv_swiglu_imma_equals_reference(clamp):
    """The down projection straight from the gate|up rows: the SwiGLU in the x preparation."""
    E, N, F, T = 3, 24, 512, 3
    rng = fresh_rng()
    raw, w = _weight(E, N, F)
    gu = (2 * rng.standard_normal((T, 2 * F))).astype(np.float32)
    wts = rng.random(T).astype(np.float32)
    ids = rng.integers(0, E, T).astype(np.int32)
    ref = np.empty((T, N), np.float64)
    gl.gemv_swiglu_ref(ref, w, gu, wts, clamp, ids)
    out = poisoned((T, N))
    iq.gemv_swiglu_imma(out, w.to_device(), cuda.to_device(gu), cuda.to_device(wts), clamp,
                        cuda.to_device(ids))
    h = ops.swiglu(gu[:, :F], gu[:, F:], clamp) * wts[:, None]
    _check(out.copy_to_host(), ref, _bound(raw, h, ids))


def test_x_preparation_scales_bytes_and_sub_block_sums():
    """x = s · (256 hi + lo) to half a step, s = max|x| / 32000 per 256 columns; the sums of q
    per 16 columns, sub-block 8n + 2j + u of each super-block at 4 (2n + u) + j."""
    T, K = 2, 512
    x = fresh_rng().standard_normal((T, K)).astype(np.float32)
    xq, xs, xsum = iq.prepare_x(cuda.to_device(x))
    planes = xq.copy_to_host().view(np.int8).reshape(T, 2, K).astype(np.int64)
    s = xs.copy_to_host().reshape(T, K // 256)
    np.testing.assert_allclose(s, np.abs(x).reshape(T, -1, 256).max(axis=2) / 32000, rtol=1e-6)
    q = 256 * planes[:, 0] + planes[:, 1]
    step = np.repeat(s, 256, axis=1)
    assert np.abs(q).max() <= 32000
    assert np.all(np.abs(q * step - x) <= 0.52 * step + 1e-12)
    sums = q.reshape(T, K // 256, 16, 16).sum(axis=3)  # [T, super-block, sub-block]
    sub = np.arange(16)
    at = 4 * (2 * (sub >> 3) + (sub & 1)) + ((sub >> 1) & 3)
    got = xsum.copy_to_host().reshape(T, K // 256, 16)
    np.testing.assert_array_equal(got[:, :, at], sums)
