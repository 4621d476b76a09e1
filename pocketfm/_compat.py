"""Compatibility shims applied before anything compiles (see gpu_notes.md §2.1).

numba-cuda 0.30.x registers an overload for ``np.row_stack`` whenever numpy >= 2.0, but numpy 2.5
removed that function, so the first kernel compile on the GPU image fails without this alias.
"""
import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
