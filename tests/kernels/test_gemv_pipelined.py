"""The Q8_0 dp4a GEMV streamed through shared memory (gemv_pipelined.py) against gemv.py's
register-prefetched dp4a kernel (the same sums in the same order: the same bits) and the NumPy
reference, on fresh random weights and x."""
import numpy as np
import pytest
from numba import cuda

from pocketfm.kernels import gemv, gemv_pipelined as gp


def _case(rng, N, K, E=1):
    host = gemv._random_weight(gemv._Q8_0, N, K, rng, E=E)
    T = E
    xh = rng.standard_normal((T, K)).astype(np.float32)
    ids = np.arange(T, dtype=np.int32)[::-1].copy() if E > 1 else None
    return host, xh, ids


# rows: several steps a block (the simulator's grid is 2 blocks a token), so the stages wrap;
# 100 and 9: a last step of clamped rows
@pytest.mark.parametrize("N, K, E, stages", [(160, 1024, 1, 3), (72, 2048, 1, 2),
                                             (100, 1024, 2, 4), (9, 1024, 1, 3)])
def test_pipelined_equals_the_register_kernel_and_the_reference(N, K, E, stages):
    rng = np.random.default_rng()
    host, xh, ids = _case(rng, N, K, E)
    w = host.to_device()
    x = cuda.to_device(xh)
    d_ids = None if ids is None else cuda.to_device(ids)
    xl = gemv.q8_0_limbs(x)
    got = cuda.device_array((E, N), np.float32)
    gp.gemv_q8_0_pipelined(got, w, xl, d_ids, stages=stages)
    want = cuda.device_array((E, N), np.float32)
    gemv.gemv_q8_0(want, w, None, d_ids, limbs=xl)
    ref = np.empty((E, N))
    gemv._gemv_ref(ref, host, xh, ids)
    g = got.copy_to_host()
    assert np.array_equal(g, want.copy_to_host())
    assert np.linalg.norm(g - ref) / np.linalg.norm(ref) <= 1e-4


def test_shapes_it_takes():
    assert gp.takes_pipelined(1024) and gp.takes_pipelined(8192) and gp.takes_pipelined(4096)
    assert not gp.takes_pipelined(2048 + 512) and not gp.takes_pipelined(512)
    assert 2 * gp.shared_bytes(256, 3) <= 227 * 1024  # two blocks of 256 threads an SM


def test_bench_cases_run_and_check(monkeypatch):
    """bin/bench-kernels' cases at a tiny shape: every build launches and matches the reference
    (a broken case would cost a device call)."""
    from pocketfm.kernels import device

    monkeypatch.setattr(device, "capture_graph", lambda launches, stream: launches[0])
    cases = gp.bench_cases(cuda.stream(), shapes=[("tiny", 40, 1024, 1), ("tiny grouped", 16, 1024, 2)])
    assert len(cases) == 8
    for case in cases:
        case.launch()
        assert case.check() <= 1e-4, case.name
