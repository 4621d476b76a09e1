"""Shared test fixtures: paths, the official-tiny golden model, GGUF rewriting for bad-input tests."""
import os
import sys

# Kernel tests run in Numba's CUDA simulator unless told otherwise (NUMBA_ENABLE_CUDASIM=0 on a
# GPU machine). It must be set before numba is first imported (gpu_notes.md §4).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if os.environ["NUMBA_ENABLE_CUDASIM"] == "1":
    sys.setswitchinterval(1e-4)  # 4-5x faster simulated syncthreads

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


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the embedded model out of the user's real cache during tests (built once per run)."""
    cache = tmp_path_factory.getbasetemp() / "pocketfm-cache"
    monkeypatch.setenv("POCKETFM_CACHE", str(cache))
