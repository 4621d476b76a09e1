"""Helpers shared by the kernel tests (simulator in CI, real GPU with NUMBA_ENABLE_CUDASIM=0)."""
import numpy as np
from numba import cuda

from pocketfm.kernels.device import SIMULATOR

# Simulated launches are Python threads: keep blocks at 32 threads there, wider on a GPU.
THREADS = 32 if SIMULATOR else 128


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere fails)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def poisoned(shape, dtype=np.float32):
    """A device output pre-filled with NaN, so an unwritten element fails the check."""
    return cuda.to_device(np.full(shape, np.nan, dtype))


def fresh_rng():
    """A new random stream per call: kernels must compute the function on any valid input."""
    return np.random.default_rng()
