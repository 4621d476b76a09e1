"""A quantised weight in its device layout: the GGUF blocks repacked once, losslessly.

GGUF block records are byte-packed (a Q8_0 block is 34 bytes: 2-byte aligned at best), which
forces narrow loads. Each type's ``pack_<type>`` (in gemv.py / gemv_lowbit.py) splits the blocks
into planes — e.g. quants as 32-bit words and scales as their own array — so kernels issue
4- or 16-byte loads. The planes hold exactly the GGUF bits, so dequantised values are unchanged
(tested against ``quants.dequantize`` on the raw blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

from numba import cuda


@dataclass(frozen=True)
class QWeight:
    qtype: int  # GGMLType id of the source tensor
    rows: int  # N: output rows (per expert)
    cols: int  # K: input columns
    experts: int  # E: stacked matrices (1 for a plain weight)
    planes: tuple  # the type's packed arrays, leading dims [E, N, ...]; NumPy or device arrays

    def to_device(self, stream=0) -> "QWeight":
        """The same weight with every plane copied to the GPU (once, at load)."""
        planes = tuple(cuda.to_device(p, stream=stream) for p in self.planes)
        return QWeight(self.qtype, self.rows, self.cols, self.experts, planes)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.planes)
