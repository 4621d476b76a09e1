"""RMSNorm and RoPE kernels vs their NumPy references (simulator in CI, real GPU on the H200)."""
import numpy as np
import pytest
from numba import cuda

from pocketfm.kernels import norm_rope
from pocketfm.numerics import rope_frequencies

from .kernel_testing import THREADS, fresh_rng, poisoned, rel_err


@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("use_weight", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_rmsnorm(naive, use_weight, in_place):
    rng = fresh_rng()
    R, n = 5, 72  # n not a multiple of the block: the strided loops' tails run
    x = (rng.standard_normal((R, n)) * rng.uniform(0.1, 10, (R, 1))).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    ref = np.empty((R, n))
    norm_rope.rmsnorm_ref(ref, x.astype(np.float64), w, 1e-6, use_weight)
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    out = dx if in_place else poisoned((R, n))
    norm_rope.rmsnorm(out, dx, dw, 1e-6, use_weight, threads=THREADS, naive=naive)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_rmsnorm_per_head_view():
    """The weightless per-head q norm: q[T, H, K] viewed as [T*H, K] rows."""
    rng = fresh_rng()
    T, H, K = 2, 3, 32
    q = rng.standard_normal((T, H, K)).astype(np.float32)
    ref = np.empty((T, H, K))
    norm_rope.rmsnorm_ref(ref, q.astype(np.float64), None, 1e-6, False)
    dq = cuda.to_device(q.reshape(T * H, K))
    norm_rope.rmsnorm(dq, dq, cuda.to_device(np.ones(K, np.float32)), 1e-6, False,
                      threads=THREADS)
    assert rel_err(dq.copy_to_host().reshape(T, H, K), ref) <= 1e-4


@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_rope(naive, inverse, in_place):
    rng = fresh_rng()
    T, H, n, R = 3, 3, 24, 16
    # positions up to ~1M (float32 angles would be off by ~0.06 rad there) and YaRN frequencies
    pos = np.array([0, *rng.integers(0, 1 << 20, T - 1)], np.int32)
    freqs = rope_frequencies(R, 160000.0, 16.0, 65536)
    x = rng.standard_normal((T, H, n)).astype(np.float32)
    ref = np.empty((T, H, n))
    norm_rope.rope_ref(ref, x.astype(np.float64), pos, freqs, inverse)
    dx = cuda.to_device(x)
    out = dx if in_place else poisoned((T, H, n))
    norm_rope.rope(out, dx, cuda.to_device(pos), cuda.to_device(freqs), inverse,
                   threads=THREADS, naive=naive, heads_per_block=2)  # 2 head groups, one short
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_rope_kv_single_head_roundtrip():
    """kv [T, 1, K] (H = 1); the inverse rotation undoes the forward one."""
    rng = fresh_rng()
    T, K = 4, 16
    pos = (rng.integers(0, 1 << 13, T) * 128).astype(np.int32)  # compressed entries at r * j
    freqs = rope_frequencies(8, 10000.0)
    x = rng.standard_normal((T, 1, K)).astype(np.float32)
    dx, dp, df = cuda.to_device(x), cuda.to_device(pos), cuda.to_device(freqs)
    y = poisoned((T, 1, K))
    norm_rope.rope(y, dx, dp, df, False, threads=THREADS)
    ref = np.empty((T, 1, K))
    norm_rope.rope_ref(ref, x.astype(np.float64), pos, freqs, False)
    assert rel_err(y.copy_to_host(), ref) <= 1e-4
    norm_rope.rope(y, y, dp, df, True, threads=THREADS)
    assert rel_err(y.copy_to_host(), x) <= 1e-4


@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("use_weight", [True, False])
def test_rmsnorm_rope_fused(naive, use_weight):
    """One launch = rmsnorm then rope (the decode's q heads, weightless; its kv row, weighted):
    against the references, and bit for bit against the two fast launches."""
    rng = fresh_rng()
    T, H, n, R = 2, 3, 72, 16  # n not a multiple of the block
    pos = np.array([0, *rng.integers(0, 1 << 20, T - 1)], np.int32)
    freqs = rope_frequencies(R, 160000.0, 16.0, 65536)
    x = (rng.standard_normal((T, H, n)) * rng.uniform(0.1, 10, (T, H, 1))).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    ref = np.empty((T, H, n))
    norm_rope.rmsnorm_rope_ref(ref, x.astype(np.float64), w, 1e-6, use_weight, pos, freqs)
    dx, dw, dp, df = (cuda.to_device(a) for a in (x, w, pos, freqs))
    out = poisoned((T, H, n))
    norm_rope.rmsnorm_rope(out, dx, dw, 1e-6, use_weight, dp, df, threads=THREADS, naive=naive)
    got = out.copy_to_host()
    assert rel_err(got, ref) <= 1e-4
    if not naive:  # in place, as the engine runs it, and = the separate kernels
        two = cuda.to_device(x)
        norm_rope.rmsnorm(two.reshape(T * H, n), two.reshape(T * H, n), dw, 1e-6, use_weight,
                          threads=THREADS)
        norm_rope.rope(two, two, dp, df, False, threads=THREADS)
        norm_rope.rmsnorm_rope(dx, dx, dw, 1e-6, use_weight, dp, df, threads=THREADS)
        assert np.array_equal(dx.copy_to_host(), two.copy_to_host())
        assert np.array_equal(got, two.copy_to_host())
