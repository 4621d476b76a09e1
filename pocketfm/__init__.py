"""pocketfm: a minimalist long-context inference engine for DeepSeek-V4 GGUF models.

Python API::

    import pocketfm
    model = pocketfm.load("model.gguf")          # device="cpu", qat=True
    logits = model.logits([0, 17, 42])          # [T, vocab], teacher-forced from position 0
    out = model.generate("Hello", max_tokens=16)
"""
from . import _compat  # noqa: F401  (numpy/numba-cuda shim, must run before numba compiles)

__version__ = "0.1.0"


def load(path: str, device: str | None = None, qat: bool = True, dtype="float32"):
    """Load a deepseek4 GGUF; see ``pocketfm.generate.Model``."""
    import numpy as np

    from .generate import load as _load

    return _load(path, device=device, qat=qat, dtype=np.dtype(dtype))


def embedded_model_path() -> str:
    """Path of the embedded tiny model (built into the user cache on first use)."""
    from .cli import embedded_model_path as _path

    return _path()
