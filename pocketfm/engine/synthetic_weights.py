"""Device weights of any geometry without a file: V4-Flash's 81 GB made directly on the GPU.

For ``pocketfm bench``: the decode step reads exactly the bytes a real file would give it, in
the same types (the ``make-model`` mixes of synthetic.py), so its time is the real file's time.
Small tensors (norms, HC mixes, compressor position biases, sinks, biases, the hash table)
are drawn in full on the host as ``make-model`` draws them. Each matrix is built from a pool
of ``POOL_ROWS`` random rows drawn and packed on the host the same way: its device planes are
filled by one kernel that copies pool row hash(i) into row i, so 80 GB need neither host
memory nor minutes of host quantisation. Rows repeat (256 distinct per matrix) but every row
has its own address, so the GPU reads all of them as it would a real file.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int64

from ..config import ModelConfig
from ..kernels import device
from ..kernels.device import cdiv, grid_stride_shape
from ..kernels.gemv import pack_weight
from ..kernels.qweight import QWeight
from ..quants import GGMLType, dequantize
from ..synthetic import _draw, tensor_type
from ..weights import TensorSpec, attr_name, tensor_specs

POOL_ROWS = 256


@device.kernel
def _tile_rows(dst, pool, salt):
    """dst[r] = pool[hash(r, salt) mod P], grid-stride over rows x words."""
    R, B = dst.shape
    P = pool.shape[0]
    start = cuda.grid(1)
    for i in range(start, R * B, cuda.gridsize(1)):
        r = i // B
        h = (int64(r) * 2654435761 + salt) & 0xFFFFFFFF  # Knuth's multiplicative hash
        h ^= h >> 15
        dst[r, i - r * B] = pool[h % P, i - r * B]


def tile_rows(dst, pool, salt: int, stream=0) -> None:
    """dst [R, B] <- rows of pool [P, B] (device arrays of uint32 or uint8 words)."""
    # (256 threads a word took most of a simulated bench's time to build the tiny model's
    # weights: the simulator's shape is two blocks of 32 threads)
    nt, most = grid_stride_shape(65535)
    blocks = min(cdiv(dst.shape[0] * dst.shape[1], nt), most)
    _tile_rows[blocks, nt, stream](dst, pool, np.uint32(salt % 2**32))


PTX_SIGNATURES = [(_tile_rows, "void(uint32[:, ::1], uint32[:, ::1], uint32)"),
                  (_tile_rows, "void(uint8[:, ::1], uint8[:, ::1], uint32)")]


class SyntheticSource:
    """The device-weight source interface of device_weights.GGUFSource, drawn instead of read."""

    def __init__(self, cfg: ModelConfig, quant: str = "ds4-q2", seed: int = 0, stream=0):
        self.cfg, self.quant, self.seed, self.stream, self.nbytes = cfg, quant, seed, stream, 0
        self.specs = {}
        for n, spec in enumerate(tensor_specs(cfg)):
            layer = int(spec.name.split(".")[1]) if spec.name.startswith("blk.") else None
            self.specs[layer, attr_name(spec.name)] = (n, spec)

    def _rng(self, layer, attr):
        n, _ = self.specs[layer, attr]
        return np.random.Generator(np.random.PCG64([self.seed, n]))

    def _put(self, a: np.ndarray):
        self.nbytes += a.nbytes
        return cuda.to_device(np.ascontiguousarray(a), stream=self.stream)

    def array(self, a):
        return self._put(a)

    def vector(self, layer, attr):
        _, spec = self.specs[layer, attr]
        a = _draw(spec, GGMLType.F32, self._rng(layer, attr), self.cfg.n_experts)
        return self._put(a.view(np.float32) if a.dtype == np.uint8 else a)  # raw F32 bytes

    def ints(self, layer, attr, k: int):
        _, spec = self.specs[layer, attr]
        return self._put(_draw(spec, GGMLType.I32, self._rng(layer, attr), self.cfg.n_experts))

    def _pool(self, layer, attr):
        """(qtype, K, host pool QWeight of POOL_ROWS rows) for a matrix spec."""
        _, spec = self.specs[layer, attr]
        qtype = tensor_type(spec, self.quant)
        K = spec.ne[0]
        pool_spec = TensorSpec(spec.name, (K, POOL_ROWS), spec.role)
        raw = _draw(pool_spec, qtype, self._rng(layer, attr), self.cfg.n_experts)
        return spec, qtype, K, raw

    def _tiled(self, qtype, host: QWeight, experts: int, rows: int, salt: int) -> QWeight:
        planes = []
        for j, p in enumerate(host.planes):
            p = np.ascontiguousarray(p)
            row_bytes = p[0, 0].nbytes
            word = np.uint32 if row_bytes % 4 == 0 else np.uint8
            d = cuda.device_array((experts, rows) + p.shape[2:], p.dtype, stream=self.stream)
            flat = d.reshape(experts * rows, row_bytes // p.itemsize).view(word)
            pool = cuda.to_device(p.reshape(p.shape[1], -1).view(word), stream=self.stream)
            tile_rows(flat, pool, salt + 7919 * j, self.stream)
            self.nbytes += d.nbytes
            planes.append(d)
        return QWeight(qtype, rows, host.cols, experts, tuple(planes))

    def matrix(self, layer, attr, groups: int = 1, stacked: int = 1) -> QWeight:
        """[E, N, K] (or G groups of [N/G, K]; ``stacked`` copies of N rows per expert)."""
        spec, qtype, K, raw = self._pool(layer, attr)
        shape = tuple(reversed(spec.ne))  # [E?, N, K]
        N, E = shape[-2], (shape[0] if len(shape) == 3 else 1)
        host = pack_weight(raw, qtype, POOL_ROWS, K)
        salt = self.specs[layer, attr][0]
        return self._tiled(qtype, host, E * groups, stacked * N // groups, salt)

    def fused(self, layer, gate: str, up: str) -> QWeight:
        """Gate and up stacked per expert [E, 2F, D] (as moe.fuse_gate_up): one tiled matrix."""
        return self.matrix(layer, gate, stacked=2)

    def table(self, layer, attr):
        """The embedding [V, D] in the dtype the embed kernel reads (F16 / F32 rows)."""
        spec, qtype, K, raw = self._pool(layer, attr)
        V = spec.ne[1]
        if qtype == GGMLType.F16:
            pool = np.ascontiguousarray(raw).view(np.float16).reshape(POOL_ROWS, K)
        else:
            pool = dequantize(raw, qtype).reshape(POOL_ROWS, K).astype(np.float32)
        d = cuda.device_array((V, K), pool.dtype, stream=self.stream)
        tile_rows(d.view(np.uint32), cuda.to_device(pool.view(np.uint32), stream=self.stream),
                  self.specs[layer, attr][0], self.stream)
        self.nbytes += d.nbytes
        return d
