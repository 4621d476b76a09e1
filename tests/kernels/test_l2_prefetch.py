"""The L2 prefetch (l2_prefetch.py): a cache hint, so its test is that it runs over arrays of
any plane's shape and type and changes none of them (the engine's logits with it on: test_engine;
what it saves: BENCHMARKS)."""
import numpy as np
from numba import cuda

from kernels.kernel_testing import fresh_rng
from pocketfm.kernels import l2_prefetch as pf


def test_prefetch_changes_no_byte_of_any_plane():
    rng = fresh_rng()
    host = [rng.integers(0, 256, size=(3, 5, 70), dtype=np.uint8),  # odd sizes: a last line
            rng.normal(size=(7, 33)).astype(np.float16),  # partly past the array
            rng.integers(0, 2**31, size=(2, 4100), dtype=np.int64).astype(np.uint64),
            rng.normal(size=1).astype(np.float32)]
    dev = [cuda.to_device(h) for h in host]
    pf.prefetch_l2(dev, blocks=2, threads=32)
    pf.prefetch_l2_ref(host)
    for d, h in zip(dev, host):
        assert np.array_equal(d.copy_to_host(), h)


def test_byte_view_is_the_same_memory():
    a = cuda.to_device(np.arange(12, dtype=np.float32).reshape(3, 4))
    v = pf.byte_view(a)
    assert v.shape == (48,) and v.dtype == np.uint8
    assert np.array_equal(v.copy_to_host().view(np.float32), np.arange(12, dtype=np.float32))
