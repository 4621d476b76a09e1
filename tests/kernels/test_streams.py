"""device.first_stream and capture_graph(node_priority=): the decode engine's main stream above
its side streams, and a graph run at its nodes' own priorities computing what it captured."""
import numpy as np
import pytest
from numba import cuda

from pocketfm.kernels import device
from pocketfm.kernels.device import SIMULATOR


@cuda.jit
def _times_two_plus(out, a, b):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = 2 * a[i] + b[i]


def test_first_stream_runs_kernels():
    """first_stream is a stream like any other (the simulator's is a plain one)."""
    s = device.first_stream()
    a = cuda.to_device(np.arange(64, dtype=np.float32))
    out = cuda.device_array(64, np.float32)
    _times_two_plus[1, 64, s](out, a, a)
    s.synchronize()
    assert np.array_equal(out.copy_to_host(), 3 * np.arange(64, dtype=np.float32))
    if SIMULATOR:
        assert device.stream_priority(s) is None


@pytest.mark.skipif(SIMULATOR, reason="stream priorities and graphs: a GPU test")
def test_first_stream_goes_before_plain_streams():
    assert device.stream_priority(device.first_stream()) < device.stream_priority(cuda.stream())


@pytest.mark.skipif(SIMULATOR, reason="stream priorities and graphs: a GPU test")
@pytest.mark.parametrize("node_priority", [False, True])
def test_a_graph_at_its_nodes_priorities_computes_what_it_captured(node_priority):
    """A main stream (first_stream) forking a side stream (least priority) and joining it
    again, captured and replayed with and without node priorities: the fork and the join
    still order the kernels (the side's input is main's output, main's last kernel reads
    the side's)."""
    main, side = device.first_stream(), device.SideStream()
    rng = np.random.default_rng()
    x = rng.standard_normal(1 << 16).astype(np.float32)
    a, b, c, d, e = (cuda.to_device(v) for v in [x] + [np.zeros_like(x)] * 4)
    n, nt = x.size, 256

    def step():
        _times_two_plus[n // nt, nt, main](b, a, a)  # b = 3x
        s = side.fork(main)
        _times_two_plus[n // nt, nt, s](c, b, a)  # c = 7x, on the side
        _times_two_plus[n // nt, nt, main](e, a, b)  # e = 5x, beside it
        side.join(main)
        _times_two_plus[n // nt, nt, main](d, c, e)  # d = 19x
    replay = device.capture_graph([step], main, node_priority=node_priority)
    d.copy_to_device(np.zeros_like(x), stream=main)
    replay()
    main.synchronize()
    assert np.allclose(d.copy_to_host(), 19 * x, rtol=1e-6, atol=1e-6)
