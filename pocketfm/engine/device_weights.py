"""Upload a loaded GGUF to the GPU once: matrices stay quantised, vectors become float32.

Every matrix becomes a device ``QWeight`` in its type's packed layout (kernels/gemv.py,
kernels/lowbit_layout.py: the same bits as the GGUF blocks). Norm weights, HC mixes, biases,
sinks and compressor position embeddings are small and go up as float32. Layout choices:

- ``attn_output_a`` [G·o_rank, (H/G)·K] is uploaded as G stacked matrices [o_rank, (H/G)·K]:
  the grouped projection is then one expert-indexed GEMV with ids 0..G-1 (``group_ids``).
- routed gate and up are stacked per expert into one [E, 2F, D] weight (moe.fuse_gate_up), and
  the shared expert's likewise: one launch yields both projections.
- the token embedding stays F32 / F16 / BF16 (read by row); other types are dequantised to
  float32 (only small models store it quantised).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..config import ModelConfig
from .. import quants
from ..numerics import rope_frequencies
from ..quants import GGMLType
from ..kernels.gemv import pack_weight
from ..kernels.moe import fuse_gate_up
from ..kernels.qweight import QWeight
from ..weights import Tensor, Weights


def host_matrix(t: Tensor) -> QWeight:
    """A [.., N, K] tensor in its packed device layout (host planes)."""
    return pack_weight(np.asarray(t.raw), t.qtype, t.shape[-2], t.shape[-1])


def grouped_matrix(t: Tensor, groups: int) -> QWeight:
    """[G·R, Kg] as G stacked [R, Kg] matrices (one expert-indexed GEMV per projection)."""
    rows = t.shape[0] // groups
    return pack_weight(np.asarray(t.raw), t.qtype, rows, t.shape[1])


# the embedding's device dtype by GGUF type (read by row as stored); any other type: float32
EMBED_DTYPES = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16}


def embedding_table(t: Tensor) -> np.ndarray:
    """[V, D] in a dtype the embed kernel reads: float32, float16 or uint16 bf16 bits."""
    dtype = EMBED_DTYPES.get(t.qtype)
    if dtype is None:
        return t.dense(np.float32)
    return np.ascontiguousarray(t.raw).view(dtype).reshape(t.shape)


@dataclass
class DeviceLayer:
    """One block's device tensors; absent parts (by layer type) are None."""

    hc_attn: tuple  # (fn [M, HC·D], base [M], scale [3])
    hc_ffn: tuple
    attn_norm: object
    ffn_norm: object
    q_a: QWeight
    q_a_norm: object
    q_b: QWeight
    kv: QWeight
    kv_norm: object
    sinks: object
    out_a: QWeight  # G stacked [o_rank, (H/G)·K]
    out_b: QWeight
    freqs: object  # float64 [R/2] RoPE frequencies of this layer
    comp_kv: QWeight | None = None
    comp_gate: QWeight | None = None
    comp_ape: object = None  # [r, coff·K]
    comp_norm: object = None
    idx_q_b: QWeight | None = None
    idx_proj: QWeight | None = None
    idx_kv: QWeight | None = None
    idx_gate: QWeight | None = None
    idx_ape: object = None
    idx_norm: object = None
    router: QWeight | None = None
    bias: object = None  # [E] selection bias (zeros on hash layers)
    tid2eid: object = None  # [V, k] int32 on hash layers, else a [1, k] dummy
    gate_up: QWeight | None = None  # [E, 2F, D]
    down: QWeight | None = None
    shared_gate_up: QWeight | None = None
    shared_down: QWeight | None = None


class GGUFSource:
    """Device tensors from a loaded GGUF: host packing (lossless) then one upload each."""

    def __init__(self, weights: Weights, stream=0):
        self.w, self.stream, self.nbytes = weights, stream, 0

    def _t(self, layer: int | None, attr: str) -> Tensor:
        return getattr(self.w if layer is None else self.w.blocks[layer], attr)

    def _put(self, a: np.ndarray):
        self.nbytes += a.nbytes
        return cuda.to_device(np.ascontiguousarray(a), stream=self.stream)

    def _up(self, q: QWeight) -> QWeight:
        self.nbytes += q.nbytes
        return q.to_device(self.stream)

    def vector(self, layer, attr):
        return self._put(self._t(layer, attr).dense(np.float32))

    def ints(self, layer, attr, k: int):
        return self._put(np.asarray(self._t(layer, attr).raw, np.int32).reshape(-1, k))

    def table(self, layer, attr):
        return self._put(embedding_table(self._t(layer, attr)))

    def matrix(self, layer, attr, groups: int = 1) -> QWeight:
        t = self._t(layer, attr)
        return self._up(grouped_matrix(t, groups) if groups > 1 else host_matrix(t))

    def fused(self, layer, gate: str, up: str) -> QWeight:
        return self._up(fuse_gate_up(host_matrix(self._t(layer, gate)),
                                     host_matrix(self._t(layer, up))))

    def array(self, a: np.ndarray):
        return self._put(a)


class SizeSource:
    """The source interface with nothing read, drawn or uploaded: each call adds the bytes
    GGUFSource / SyntheticSource put on the GPU for that tensor, so that
    ``DeviceWeights(cfg, SizeSource(...)).nbytes`` is the weights' GPU size, walked through the
    very code that uploads them (which tensors, grouped and fused matrices, extra arrays).

    A matrix costs its packed planes (pack_weight's layout, not the GGUF bytes: Q4_K, e.g.,
    unpacks its scales): every plane has leading dims [E, N] (qweight.py), so it is E·N times
    the planes of one zero row packed the same way. Vectors go up as float32, the hash table as
    int32, the embedding as EMBED_DTYPES says. ``tensors``: (layer or None, attr) -> (GGML
    type, numpy shape)."""

    def __init__(self, tensors: dict):
        self.tensors, self.nbytes = tensors, 0

    @classmethod
    def of_weights(cls, w: Weights) -> "SizeSource":
        """A loaded GGUF's tensor table (memory-mapped: no tensor data is read)."""
        tree = [(None, vars(w))] + [(b.index, vars(b)) for b in w.blocks]
        return cls({(layer, attr): (t.qtype, t.shape) for layer, attrs in tree
                    for attr, t in attrs.items() if isinstance(t, Tensor)})

    @classmethod
    def of_specs(cls, cfg: ModelConfig, quant: str) -> "SizeSource":
        """The tensor table make-model (and SyntheticSource) would give ``cfg`` in ``quant``."""
        from ..synthetic import tensor_type
        from ..weights import attr_name, tensor_specs

        return cls({(int(s.name.split(".")[1]) if s.name.startswith("blk.") else None,
                     attr_name(s.name)): (tensor_type(s, quant), tuple(reversed(s.ne)))
                    for s in tensor_specs(cfg)})

    def _add(self, nbytes: int) -> None:
        self.nbytes += int(nbytes)  # DeviceWeights keeps None where a device tensor would be

    def vector(self, layer, attr):
        return self._add(4 * math.prod(self.tensors[layer, attr][1]))

    def ints(self, layer, attr, k: int):
        return self._add(4 * math.prod(self.tensors[layer, attr][1]))

    def table(self, layer, attr):
        qtype, shape = self.tensors[layer, attr]
        return self._add(np.dtype(EMBED_DTYPES.get(qtype, np.float32)).itemsize *
                         math.prod(shape))

    def matrix(self, layer, attr, groups: int = 1):
        qtype, shape = self.tensors[layer, attr]  # [E?, N, K]; G groups keep E·N rows in all
        return self._add(math.prod(shape[:-1]) * packed_row_bytes(qtype, shape[-1]))

    def fused(self, layer, gate: str, up: str):
        self.matrix(layer, gate)
        return self.matrix(layer, up)

    def array(self, a: np.ndarray):
        return self._add(a.nbytes)


@functools.lru_cache(maxsize=None)
def packed_row_bytes(qtype: int, cols: int) -> int:
    """Device bytes of one row of ``cols`` elements of a ``qtype`` matrix (its packed planes)."""
    raw = np.zeros((1, quants.row_bytes(qtype, cols)), np.uint8)
    return pack_weight(raw, qtype, 1, cols).nbytes


class DeviceWeights:
    """The whole model on the GPU, from a ``source`` (GGUFSource, or the synthetic one of
    engine/synthetic_weights.py). ``progress(done, total, name)`` is called per layer."""

    def __init__(self, cfg: ModelConfig, source, progress=None):
        self.cfg, self.src = cfg, source
        steps = cfg.n_layers + 3
        tell = progress or (lambda done, total, name: None)
        tell(0, steps, "embedding")
        self.embed = source.table(None, "token_embd")
        self.output = source.matrix(None, "output")
        self.output_norm = source.vector(None, "output_norm")
        self.output_hc = tuple(source.vector(None, a) for a in
                               ("output_hc_fn", "output_hc_base", "output_hc_scale"))
        tell(1, steps, "output head")
        self.freq_window = source.array(rope_frequencies(cfg.rope_dim, cfg.rope_base))
        self.freq_compressed = source.array(rope_frequencies(
            cfg.rope_dim, cfg.compress_rope_base, cfg.yarn_factor, cfg.yarn_orig_ctx,
            cfg.yarn_beta_fast, cfg.yarn_beta_slow))
        self.group_ids = source.array(np.arange(cfg.o_groups, dtype=np.int32))
        self.layers = []
        for i in range(cfg.n_layers):
            self.layers.append(self._layer(i))
            tell(i + 2, steps, f"layer {i}")
        tell(steps, steps, "done")

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    def _layer(self, i: int) -> DeviceLayer:
        cfg, src = self.cfg, self.src
        ratio = cfg.ratio(i)
        vec = lambda a: src.vector(i, a)  # noqa: E731
        mat = lambda a: src.matrix(i, a)  # noqa: E731
        L = DeviceLayer(
            hc_attn=tuple(vec(a) for a in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale")),
            hc_ffn=tuple(vec(a) for a in ("hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale")),
            attn_norm=vec("attn_norm"), ffn_norm=vec("ffn_norm"),
            q_a=mat("attn_q_a"), q_a_norm=vec("attn_q_a_norm"), q_b=mat("attn_q_b"),
            kv=mat("attn_kv"), kv_norm=vec("attn_kv_a_norm"), sinks=vec("attn_sinks"),
            out_a=src.matrix(i, "attn_output_a", cfg.o_groups), out_b=mat("attn_output_b"),
            freqs=self.freq_compressed if ratio else self.freq_window)
        if ratio:
            L.comp_kv, L.comp_gate = mat("attn_compressor_kv"), mat("attn_compressor_gate")
            L.comp_ape, L.comp_norm = vec("attn_compressor_ape"), vec("attn_compressor_norm")
        if cfg.is_csa(i):
            L.idx_q_b, L.idx_proj = mat("indexer_attn_q_b"), mat("indexer_proj")
            L.idx_kv, L.idx_gate = mat("indexer_compressor_kv"), mat("indexer_compressor_gate")
            L.idx_ape, L.idx_norm = vec("indexer_compressor_ape"), vec("indexer_compressor_norm")
        k = cfg.n_experts_used
        L.router = mat("ffn_gate_inp")
        if cfg.is_hash_layer(i):
            L.bias = src.array(np.zeros(cfg.n_experts, np.float32))
            L.tid2eid = src.ints(i, "ffn_gate_tid2eid", k)
        else:
            L.bias = vec("exp_probs_b")
            L.tid2eid = src.array(np.zeros((1, k), np.int32))
        L.gate_up = src.fused(i, "ffn_gate_exps", "ffn_up_exps")
        L.down = mat("ffn_down_exps")
        if cfg.n_shared_experts:
            L.shared_gate_up = src.fused(i, "ffn_gate_shexp", "ffn_up_shexp")
            L.shared_down = mat("ffn_down_shexp")
        return L


def index_weight_scale(cfg: ModelConfig) -> float:
    """The indexer head weights' factor 1/sqrt(DI·HI) (spec §4.7)."""
    return 1.0 / math.sqrt(cfg.index_dim * cfg.index_heads)
