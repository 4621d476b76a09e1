"""Shared test fixtures: paths, the official-tiny golden model, GGUF rewriting for bad-input tests."""
import os
import sys

# Kernel tests run in Numba's CUDA simulator unless told otherwise (NUMBA_ENABLE_CUDASIM=0 on a
# GPU machine). It must be set before numba is first imported (gpu_notes.md §4).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
    sys.setswitchinterval(1e-4)  # 4-5x faster simulated syncthreads


def _thread_safe_simulated_shared_arrays():
    """numba-cuda 0.30.4's simulator creates a block's shared array on first use with an
    unlocked check-then-insert: two threads can each make their own copy, and the block then
    computes with two different "shared" arrays (seen: 8 wrong results in 3000 launches). Same
    logic as FakeCUDAShared.array, under a lock; the allocation stays keyed by the caller's
    source line (so this function must be called directly by the kernel, as the original is)."""
    import threading
    import traceback

    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = kernelapi.np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
    _thread_safe_simulated_shared_arrays()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OFFICIAL = os.path.join(HERE, "fixtures", "official-tiny")
sys.path.insert(0, HERE)


@pytest.fixture(scope="session")
def official_path():
    return os.path.join(OFFICIAL, "model.gguf")


@pytest.fixture(scope="session")
def official_tokens():
    return np.load(os.path.join(OFFICIAL, "tokens.npy"))


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """The tiny preset as an f32 GGUF (exact weights: chunked-vs-decode checks in float64)."""
    from pocketfm.presets import tiny
    from pocketfm.synthetic import write_model

    path = str(tmp_path_factory.mktemp("models") / "tiny-f32.gguf")
    write_model(tiny(), path, quant="f32", seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_q2_path(tmp_path_factory):
    """The tiny preset in the ds4 2-bit type mix (F16 / Q8_0 with its fallbacks)."""
    from pocketfm.presets import tiny
    from pocketfm.synthetic import write_model

    path = str(tmp_path_factory.mktemp("models") / "tiny-ds4q2.gguf")
    write_model(tiny(), path, quant="ds4-q2", seed=2)
    return path


@pytest.fixture(scope="session")
def micro_path(tmp_path_factory):
    """tiny shrunk so a few simulated engine steps show every cache path: window 4 (the ring
    wraps), CSA ratio 4 with top-1 selection, HCA ratio 8 (tests/test_engine.py, test_kvswap.py)."""
    from pocketfm.presets import tiny
    from pocketfm.synthetic import write_model

    path = str(tmp_path_factory.mktemp("engine") / "micro.gguf")
    write_model(tiny().replace(window=4, index_topk=1), path, quant="f32", seed=5)
    return path


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the embedded model out of the user's real cache during tests (built once per run)."""
    cache = tmp_path_factory.getbasetemp() / "pocketfm-cache"
    monkeypatch.setenv("POCKETFM_CACHE", str(cache))


@pytest.fixture(autouse=True)
def _gemv_choice_restored():
    """A simulator engine turns on gemv's thread-per-row preference for the whole process
    (gemv.simulator_prefers_rows): restore it after every test, so that a kernel test that a
    worker runs after an engine test still reaches the kernels it names (gemv(norm=) refuses
    under the preference)."""
    from pocketfm.kernels import gemv

    before = gemv._sim_rows()
    yield
    gemv.simulator_prefers_rows(before)
