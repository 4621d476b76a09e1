"""The simulator's turn-taking block scheduler (kernels/sim_blocks.py) keeps the CUDA semantics
the kernels rely on: barriers, votes, threads that end before a barrier, a failing thread."""
import numpy as np
import pytest
from numba import cuda, float32, int32

from kernels.kernel_testing import fresh_rng
from pocketfm.kernels import sim_blocks
from pocketfm.kernels.device import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the simulator's scheduler")


@cuda.jit
def _tree_sum(out, x):
    """A shared-memory tree reduction per block: wrong at once if a thread of a level reads
    before the level below it is written (a barrier not kept)."""
    sh = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    sh[t] = x[cuda.blockIdx.x, t]
    cuda.syncthreads()
    step = 32
    while step:
        if t < step:
            sh[t] += sh[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[cuda.blockIdx.x] = sh[0]


@cuda.jit
def _votes(out, x):
    t = cuda.threadIdx.x + cuda.blockDim.x * cuda.threadIdx.y
    v = x[t]
    out[0] = cuda.syncthreads_count(v > 0)
    out[1] = cuda.syncthreads_and(v > 0)
    out[2] = cuda.syncthreads_or(v > 0)


@cuda.jit
def _ids(out):
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    b = cuda.blockIdx.x
    out[b, ty, tx, 0] = b
    out[b, ty, tx, 1] = cuda.laneid


@cuda.jit
def _half_leave(out, x):
    """The upper half ends before the barrier the lower half waits at."""
    sh = cuda.shared.array(32, int32)
    t = cuda.threadIdx.x
    if t >= 16:
        return
    sh[t] = x[t]
    cuda.syncthreads()
    out[t] = sh[15 - t]


@cuda.jit
def _fails(out, x):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    out[t] = x[99 if t == 8 else t]  # thread 8 fails; the others then wait at the barrier
    cuda.syncthreads()


def test_the_scheduler_is_installed():
    from numba.cuda.simulator import kernel as sim_kernel

    assert sim_kernel.BlockManager is sim_blocks.TurnBlockManager


def _tree_sum_ref(x):
    """The kernel's sums in its own order, in float32: its result bit for bit (a sum in
    another order can differ by more than any fixed tolerance when the terms cancel)."""
    sh = x.astype(np.float32).copy()
    step = sh.shape[1] // 2
    while step:
        sh[:, :step] += sh[:, step:2 * step]
        step //= 2
    return sh[:, 0]


def test_barriers_order_a_tree_reduction():
    x = fresh_rng().standard_normal((3, 64)).astype(np.float32)
    out = cuda.device_array(3, np.float32)
    _tree_sum[3, 64](out, cuda.to_device(x))
    np.testing.assert_array_equal(out.copy_to_host(), _tree_sum_ref(x))


def test_votes_and_thread_ids_of_a_2d_block():
    x = fresh_rng().choice([-1, 1], 48).astype(np.int32)
    for case in (x, np.ones(48, np.int32), -np.ones(48, np.int32)):
        out = cuda.device_array(3, np.int32)
        _votes[1, (16, 3)](out, cuda.to_device(case))
        pos = case > 0
        assert out.copy_to_host().tolist() == [pos.sum(), int(pos.all()), int(pos.any())]
    out = cuda.device_array((2, 3, 16, 2), np.int32)
    _ids[2, (16, 3)](out)
    got = out.copy_to_host()
    assert (got[..., 0] == np.arange(2)[:, None, None]).all()
    assert (got[..., 1] == np.arange(48).reshape(3, 16) % 32).all()


def test_threads_that_end_before_a_barrier_do_not_hold_it():
    x = cuda.to_device(np.arange(32, dtype=np.int32))
    out = cuda.to_device(np.full(32, -1, np.int32))
    _half_leave[2, 32](out, x)
    assert out.copy_to_host().tolist() == list(range(15, -1, -1)) + [-1] * 16


def test_a_failing_thread_is_reported_and_the_pool_stays_usable():
    x = cuda.to_device(np.zeros(48, np.float32))
    out = cuda.device_array(32, np.float32)
    with pytest.raises(IndexError, match=r"tid=\[8, 0, 0\] ctaid=\[0, 0, 0\]"):
        _fails[1, 32](out, x)
    test_barriers_order_a_tree_reduction()  # the threads parked at the barrier were released
