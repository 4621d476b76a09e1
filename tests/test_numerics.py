"""The model's own numerics: FP8/FP4 round-trips, Hadamard, RoPE/YaRN, and the NumPy ops."""
import math

import numpy as np
import pytest

from pocketfm import ops
from pocketfm.numerics import (fp4_roundtrip, fp8_roundtrip, hadamard_matrix, rope_frequencies,
                               rope_tables)


def all_e4m3_values():
    """Every finite e4m3fn value, decoded from its byte per the spec's codec table (§4.8)."""
    vals = []
    for b in range(256):
        s, E, M = b >> 7, (b >> 3) & 15, b & 7
        if E == 15 and M == 7:
            continue  # NaN codes 0x7F, 0xFF
        v = (M / 8) * 2.0 ** -6 if E == 0 else (1 + M / 8) * 2.0 ** (E - 7)
        vals.append(-v if s else v)
    return np.unique(vals)


def test_fp8_roundtrip_lands_on_grid_and_rounds_to_nearest():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 128)) * np.exp(rng.normal(size=(50, 1)) * 3)
    y = fp8_roundtrip(x, 64)
    grid = all_e4m3_values()
    xb, yb = x.reshape(-1, 64), y.reshape(-1, 64)
    for xr, yr in zip(xb, yb):
        amax = max(np.abs(xr).max(), 1e-4)
        s = 2.0 ** math.ceil(math.log2(np.float32(amax) * np.float32(1 / 448)))
        q = yr / s
        assert np.isin(q, grid).all()  # every value is an e4m3 code times the block scale
        # nearest grid value (brute force; ties do not occur with random inputs)
        near = grid[np.abs(xr[:, None] / s - grid[None, :]).argmin(axis=1)]
        assert np.array_equal(q, near)


def test_fp8_scale_is_power_of_two_and_ties_go_to_even():
    x = np.zeros(64)
    x[0] = 448.0  # amax/448 = 1 exactly -> scale 1
    x[1] = 1.0625  # halfway between 1.0 (mantissa 0, even) and 1.125 -> 1.0
    x[2] = 1.1875  # halfway between 1.125 (odd) and 1.25 (even) -> 1.25
    y = fp8_roundtrip(x, 64)
    assert y[0] == 448.0 and y[1] == 1.0 and y[2] == 1.25


def test_fp4_roundtrip_grid_and_ties():
    x = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 24)
    # ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert fp4_roundtrip(x, 32)[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 64))
    y = fp4_roundtrip(x, 32).reshape(-1, 32)
    for xb, yb in zip(x.reshape(-1, 32), y):
        s = 2.0 ** math.ceil(math.log2(np.float32(np.abs(xb).max()) * np.float32(1 / 6)))
        assert np.isin(np.abs(yb) / s, [0, 0.5, 1, 1.5, 2, 3, 4, 6]).all()


def test_hadamard_orthonormal_and_sylvester():
    h = hadamard_matrix(128)
    assert np.allclose(h @ h.T, np.eye(128), atol=1e-12)
    assert np.allclose(h[:2, :4] * math.sqrt(128), [[1, 1, 1, 1], [1, -1, 1, -1]])


def test_yarn_ramp_for_v4_flash():
    """Spec §4.5: low = 15, high = 25 for base 160000, factor 16, original 65536."""
    f = rope_frequencies(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    base = 160000.0 ** (-np.arange(32) * 2 / 64)
    assert np.allclose(f[:16], base[:16])  # i <= 15 keeps f_i
    assert np.allclose(f[25:], base[25:] / 16)  # i >= 25 uses f_i / 16
    assert np.all((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16))
    assert np.allclose(rope_frequencies(64, 10000.0), 10000.0 ** (-np.arange(32) * 2 / 64))


def test_rope_inverse_and_adjacent_pairs():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 3, 24))
    cos, sin = rope_tables(rope_frequencies(8, 10000.0), np.arange(5) + 7)
    y = np.empty_like(x)
    ops.rope(y, x, cos, sin)
    assert np.array_equal(y[..., :16], x[..., :16])  # only the last R dims rotate
    # pair (16, 17) rotates by pos * w_0 as a complex number
    z = (x[..., 16] + 1j * x[..., 17]) * np.exp(1j * (np.arange(5) + 7) * 1.0)[:, None]
    assert np.allclose(y[..., 16], z.real) and np.allclose(y[..., 17], z.imag)
    back = np.empty_like(x)
    ops.rope(back, y, cos, sin, inverse=True)
    assert np.allclose(back, x)


def test_sink_attention_equals_explicit_softmax():
    rng = np.random.default_rng(3)
    q, kv = rng.normal(size=(3, 2, 8)), rng.normal(size=(5, 8))
    mask = rng.random((3, 5)) < 0.7
    mask[:, 0] = True
    sinks = rng.normal(size=2)
    out = np.empty((3, 2, 8))
    ops.sink_attention(out, q, kv, mask, sinks, 0.3)
    for t in range(3):
        for h in range(2):
            s = np.array([q[t, h] @ kv[m] * 0.3 for m in range(5) if mask[t, m]])
            e = np.exp(s)
            p = e / (e.sum() + np.exp(sinks[h]))
            assert np.allclose(out[t, h], p @ kv[mask[t]])


def test_route_bias_selects_only_and_hash_rows():
    logits = np.array([[0.0, 1.0, 2.0, 3.0]])
    bias = np.array([10.0, 0.0, 0.0, 0.0])
    idx, w = np.empty((1, 2), np.int64), np.empty((1, 2))
    ops.route(idx, w, logits, bias, None, 1.5, True)
    s = np.sqrt(np.log1p(np.exp(logits[0])))
    assert sorted(idx[0]) == [0, 3]  # the bias pulled expert 0 in
    assert np.allclose(sorted(w[0]), sorted(s[[0, 3]] / s[[0, 3]].sum() * 1.5))
    ops.route(idx, w, logits, None, np.array([[2, 1]]), 1.0, True)
    assert idx[0].tolist() == [2, 1] and np.isclose(w[0].sum(), 1.0)


@pytest.mark.parametrize("clamp", [0.0, 10.0])
def test_swiglu_clamp(clamp):
    g, u = np.array([20.0, -20.0, 1.0]), np.array([30.0, -30.0, 2.0])
    h = ops.swiglu(g, u, clamp)
    if clamp:
        sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
        assert np.allclose(h, [10 * sig(10) * 10, -20 * sig(-20) * -10, 1 * sig(1) * 2])
    else:
        assert np.allclose(h, g / (1 + np.exp(-g)) * u)


def test_hc_sinkhorn_is_doubly_stochastic():
    rng = np.random.default_rng(4)

    class T:  # a stand-in Tensor: .dense() is all the op reads
        def __init__(self, a):
            self.a = a

        def dense(self, dtype):
            return self.a.astype(dtype)

    HC, D = 4, 8
    X = rng.normal(size=(2, HC, D))
    u, post, comb = np.empty((2, D)), np.empty((2, HC)), np.empty((2, HC, HC))
    ops.hc_pre(u, post, comb, X, T(rng.normal(size=(24, HC * D))), T(rng.normal(size=24)),
               T(np.array([0.5, 0.5, 0.5])), 1e-6, 1e-6, 20)
    assert np.allclose(comb.sum(axis=1), 1.0, atol=1e-5)  # columns exactly (last step)
    assert np.allclose(comb.sum(axis=2), 1.0, atol=2e-2)  # rows nearly (20 iterations)
    assert np.all((post > 0) & (post < 2))
