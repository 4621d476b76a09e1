"""GGUF reading: the deepseek4 tensor table, per-tensor shape/type checks, lazy dequantisation.

Files are opened through ``gguf.GGUFReader``, which memory-maps them: nothing is copied until a
tensor is used, and quantised tensors stay raw blocks (``Tensor.raw``) until dequantised. The
tensor table (``tensor_specs``) is the single source of truth for names, shapes and roles; the
loader, ``make-model`` and the planner all read it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from . import quants
from .config import ModelConfig
from .errors import InputError
from .quants import GGMLType

FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the innermost (input) dim
    role: str  # what the tensor is for; picks its type in make-model and its type check here


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of a deepseek4 GGUF (spec §7.2), in file order; MTP tensors are not listed."""
    D, K, HC = cfg.dim, cfg.head_dim, cfg.hc_mult
    specs = [
        TensorSpec("token_embd.weight", (D, cfg.vocab), "embed"),  # [vocab, D]
        TensorSpec("output.weight", (D, cfg.vocab), "output"),  # [vocab, D] untied head
        TensorSpec("output_norm.weight", (D,), "norm"),
        TensorSpec("output_hc_fn.weight", (HC * D, HC), "hc"),  # [HC, HC·D]
        TensorSpec("output_hc_base.weight", (HC,), "vector"),
        TensorSpec("output_hc_scale.weight", (1,), "vector"),
    ]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        s = [
            (b + "hc_attn_fn.weight", (HC * D, cfg.hc_mix), "hc"),  # [(2+HC)·HC, HC·D]
            (b + "hc_attn_base.weight", (cfg.hc_mix,), "vector"),
            (b + "hc_attn_scale.weight", (3,), "vector"),
            (b + "hc_ffn_fn.weight", (HC * D, cfg.hc_mix), "hc"),
            (b + "hc_ffn_base.weight", (cfg.hc_mix,), "vector"),
            (b + "hc_ffn_scale.weight", (3,), "vector"),
            (b + "attn_norm.weight", (D,), "norm"),
            (b + "ffn_norm.weight", (D,), "norm"),
            (b + "attn_sinks.weight", (cfg.n_heads,), "vector"),  # [H] learned sink logits
            (b + "attn_q_a.weight", (D, cfg.q_rank), "attn"),  # [q_rank, D]
            (b + "attn_q_a_norm.weight", (cfg.q_rank,), "norm"),
            (b + "attn_q_b.weight", (cfg.q_rank, cfg.n_heads * K), "attn"),  # [H·K, q_rank]
            (b + "attn_kv.weight", (D, K), "attn"),  # [K, D] shared K = V
            (b + "attn_kv_a_norm.weight", (K,), "norm"),
            # [G·o_rank, (H/G)·K]: G stacked per-group blocks
            (b + "attn_output_a.weight", (cfg.heads_per_group * K, cfg.o_groups * cfg.o_rank),
             "attn"),
            (b + "attn_output_b.weight", (cfg.o_groups * cfg.o_rank, D), "attn"),  # [D, G·o_rank]
        ]
        ratio = cfg.ratio(i)
        if ratio > 0:
            w = cfg.coff(i) * K
            s += [
                (b + "attn_compressor_kv.weight", (D, w), "compressor"),  # [coff·K, D]
                (b + "attn_compressor_gate.weight", (D, w), "compressor"),
                (b + "attn_compressor_ape.weight", (w, ratio), "compressor"),  # [ratio, coff·K]
                (b + "attn_compressor_norm.weight", (K,), "norm"),
            ]
        if cfg.is_csa(i):
            di, w = cfg.index_dim, 2 * cfg.index_dim
            s += [
                (b + "indexer.attn_q_b.weight", (cfg.q_rank, cfg.index_heads * di), "indexer"),
                (b + "indexer.proj.weight", (D, cfg.index_heads), "indexer"),  # [HI, D]
                (b + "indexer_compressor_kv.weight", (D, w), "indexer"),  # [2·DI, D]
                (b + "indexer_compressor_gate.weight", (D, w), "indexer"),
                (b + "indexer_compressor_ape.weight", (w, ratio), "indexer"),  # [4, 2·DI]
                (b + "indexer_compressor_norm.weight", (di,), "norm"),
            ]
        s.append((b + "ffn_gate_inp.weight", (D, cfg.n_experts), "router"))  # [E, D]
        if cfg.is_hash_layer(i):
            # token id -> expert ids, I32 [vocab, k]
            s.append((b + "ffn_gate_tid2eid.weight", (cfg.n_experts_used, cfg.vocab), "tid2eid"))
        else:
            s.append((b + "exp_probs_b.bias", (cfg.n_experts,), "vector"))  # selection-only bias
        if cfg.n_shared_experts:
            s += [
                (b + "ffn_gate_shexp.weight", (D, cfg.moe_dim), "shared"),  # [F, D]
                (b + "ffn_up_shexp.weight", (D, cfg.moe_dim), "shared"),
                (b + "ffn_down_shexp.weight", (cfg.moe_dim, D), "shared"),  # [D, F]
            ]
        s += [
            (b + "ffn_gate_exps.weight", (D, cfg.moe_dim, cfg.n_experts), "expert_gate_up"),
            (b + "ffn_up_exps.weight", (D, cfg.moe_dim, cfg.n_experts), "expert_gate_up"),
            (b + "ffn_down_exps.weight", (cfg.moe_dim, D, cfg.n_experts), "expert_down"),
        ]
        specs += [TensorSpec(n, ne, role) for n, ne, role in s]
    return specs


def attr_name(gguf_name: str) -> str:
    """``blk.3.indexer.attn_q_b.weight`` -> ``indexer_attn_q_b`` (the field name in the tree)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    if parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return "_".join(parts)


class Tensor:
    """One GGUF tensor: raw (memory-mapped) data plus its type; dequantised on first use."""

    def __init__(self, name: str, qtype: int, ne: tuple[int, ...], raw: np.ndarray):
        self.name, self.qtype, self.ne, self.raw = name, int(qtype), tuple(ne), raw
        self._dense: dict = {}

    @property
    def shape(self) -> tuple[int, ...]:
        """NumPy order (outermost first), e.g. [out, in] for a matrix."""
        return tuple(reversed(self.ne))

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dense(self, dtype=np.float32) -> np.ndarray:
        """The whole tensor as ``dtype`` (cached: pocketfm's CPU path runs small models)."""
        key = np.dtype(dtype)
        if key not in self._dense:
            x = quants.dequantize(np.asarray(self.raw), self.qtype)
            self._dense[key] = x.reshape(self.shape).astype(dtype, copy=False)
        return self._dense[key]

    def expert(self, e: int, dtype=np.float32) -> np.ndarray:
        """Matrix ``e`` of a stacked [E, out, in] expert tensor; dequantises only that slice."""
        key = (np.dtype(dtype), e)
        if key not in self._dense:
            x = quants.dequantize(np.asarray(self.raw[e]), self.qtype)
            self._dense[key] = x.reshape(self.shape[1:]).astype(dtype, copy=False)
        return self._dense[key]

    def __repr__(self):
        return f"Tensor({self.name}, {quants.type_name(self.qtype)}, ne={list(self.ne)})"


class Block:
    """The tensors of one transformer block, as attributes named after their GGUF names."""

    def __init__(self, index: int):
        self.index = index

    def __getattr__(self, name):  # only reached for tensors this layer type does not have
        raise AttributeError(f"blk.{self.index} has no tensor {name!r}")


@dataclass
class Weights:
    """The weight tree: top-level tensors plus one ``Block`` per layer."""

    token_embd: Tensor  # [vocab, D]
    output: Tensor  # [vocab, D]
    output_norm: Tensor  # [D]
    output_hc_fn: Tensor  # [HC, HC·D]
    output_hc_base: Tensor  # [HC]
    output_hc_scale: Tensor  # [1]
    blocks: list[Block] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # tensors pocketfm does not use (e.g. MTP)


@dataclass
class GGUFModelFile:
    path: str
    meta: dict
    config: ModelConfig
    weights: Weights
    file_bytes: int
    alignment: int = 32
    tensors: list[Tensor] = field(default_factory=list)  # in file order


def read_metadata(reader, path: str) -> dict:
    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = fld.contents()
        except Exception as exc:  # a corrupted field: name it
            raise InputError(f"{path}: metadata key {key} is unreadable ({exc})") from None
    return meta


def open_reader(path: str):
    """GGUFReader over ``path`` with every failure mode turned into a one-line InputError."""
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise InputError(f"{path}: not a GGUF file (bad magic, expected b'GGUF')")
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # gguf raises assorted errors on truncated/corrupt headers
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: corrupted or truncated GGUF ({msg})") from None


def load_gguf(path: str) -> GGUFModelFile:
    """Open a deepseek4 GGUF, check every tensor of the table, and return the weight tree."""
    reader = open_reader(path)
    meta = read_metadata(reader, path)
    cfg = ModelConfig.from_metadata(meta, source=path)
    size = os.path.getsize(path)
    found = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise InputError(f"{path}: tensor {t.name} ends at byte {end}, past the end of the "
                             f"file ({size} bytes): the file is truncated")
        found[t.name] = t
    tensors = {}
    for spec in tensor_specs(cfg):
        t = found.get(spec.name)
        if t is None:
            raise InputError(f"{path}: missing tensor {spec.name} (ne {list(spec.ne)})")
        tensors[spec.name] = _checked_tensor(path, spec, t)
    top = {attr_name(n): tensors[n] for n in tensors if not n.startswith("blk.")}
    weights = Weights(**top)
    for i in range(cfg.n_layers):
        blk = Block(i)
        prefix = f"blk.{i}."
        for n, t in tensors.items():
            if n.startswith(prefix):
                setattr(blk, attr_name(n), t)
        weights.blocks.append(blk)
    weights.extra = [n for n in found if n not in tensors]
    align = meta.get("general.alignment", 32)
    return GGUFModelFile(path, meta, cfg, weights, size, align, list(tensors.values()))


def _checked_tensor(path: str, spec: TensorSpec, t) -> Tensor:
    ne = tuple(int(x) for x in t.shape)
    qtype = int(t.tensor_type)
    where = f"{path}: tensor {spec.name}"
    if ne != spec.ne:
        raise InputError(f"{where} has ne {list(ne)}, expected {list(spec.ne)}")
    if qtype not in quants.SUPPORTED_TYPES:
        names = ", ".join(sorted(quants.type_name(q) for q in quants.SUPPORTED_TYPES))
        raise InputError(f"{where} has type {quants.type_name(qtype)}, expected one of {names}")
    if spec.role == "tid2eid" and qtype != GGMLType.I32:
        raise InputError(f"{where} has type {quants.type_name(qtype)}, expected I32")
    if spec.role in ("norm", "vector") and qtype not in FLOAT_TYPES:
        raise InputError(f"{where} has type {quants.type_name(qtype)}, expected F32, F16 or BF16")
    if spec.role != "tid2eid" and qtype == GGMLType.I32:
        raise InputError(f"{where} has type I32, expected a float or quantised type")
    n_bytes = quants.row_bytes(qtype, ne[0]) * math.prod(ne[1:])
    if int(t.n_bytes) != n_bytes:
        raise InputError(f"{where} holds {int(t.n_bytes)} bytes, expected {n_bytes}")
    return Tensor(spec.name, qtype, ne, t.data)
