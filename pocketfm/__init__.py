"""pocketfm: a minimalist long-context inference engine for DeepSeek-V4 GGUF models."""
from . import _compat  # noqa: F401  (numpy/numba-cuda shim, must run before numba compiles)

__version__ = "0.1.0"
