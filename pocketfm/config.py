"""Model configuration: a frozen dataclass built in one function from GGUF metadata.

``ModelConfig.from_metadata`` names every ``deepseek4.*`` key it reads (spec §7.1) and fails early
with the key's name. The synthetic presets (``tiny``, ``small``, ``flash``) build the same dataclass
directly, so ``make-model`` and the planner share one definition of a model's geometry.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import InputError

ARCH = "deepseek4"
GATING_SQRTSOFTPLUS = 4  # llama.cpp's ExpertGatingFuncType.SQRTSOFTPLUS; the only one V4 uses


@dataclass(frozen=True)
class ModelConfig:
    """Geometry and hyper-parameters of one DeepSeek-V4 model (spec §1.1).

    Dimension letters used across pocketfm: T tokens, D hidden (``dim``), H attention heads,
    K head dim, R rope dims, E experts, N compressed entries, HC hyper-connection streams.
    """

    n_layers: int  # transformer blocks (MTP excluded)
    ctx_train: int  # deepseek4.context_length
    dim: int  # D
    vocab: int
    n_heads: int  # H (one shared KV head)
    head_dim: int  # K: q/k/v width per head
    rope_dim: int  # R: RoPE acts on the last R dims of a head
    q_rank: int  # q_lora_rank
    o_rank: int  # output_lora_rank
    o_groups: int  # output_group_count
    window: int  # sliding window of raw kv entries
    compress_ratios: tuple[int, ...]  # per layer: 0 window-only, 4 CSA, other >0 HCA
    compress_rope_base: float
    index_heads: int
    index_dim: int
    index_topk: int
    rms_eps: float
    rope_base: float
    yarn_factor: float
    yarn_orig_ctx: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    n_experts: int  # E
    n_experts_used: int
    n_shared_experts: int
    moe_dim: int  # expert_feed_forward_length
    routed_scale: float
    norm_topk: bool
    n_hash_layers: int
    swiglu_clamp: tuple[float, ...]  # per layer, routed experts
    swiglu_clamp_shared: tuple[float, ...]  # per layer, shared expert
    hc_mult: int  # HC
    hc_iters: int
    hc_eps: float
    n_nextn: int = 0  # MTP blocks in the file (ignored by pocketfm)

    # ---- derived sizes -------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_csa(self, layer: int) -> bool:
        """Spec §8b.10: overlap lanes and the indexer exist iff the ratio is exactly 4."""
        return self.compress_ratios[layer] == 4

    def coff(self, layer: int) -> int:
        """Compressor width multiplier: 2 for overlapping (ratio 4) lanes, else 1."""
        return 2 if self.is_csa(layer) else 1

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def hc_mix(self) -> int:
        """Rows of hc_*_fn: HC pre weights + HC post weights + HC×HC comb matrix."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    def n_params(self) -> int:
        """Parameter count of the main model (what the tensor table holds)."""
        from .weights import tensor_specs  # local import: weights depends on config

        return sum(math.prod(s.ne) for s in tensor_specs(self))

    # ---- construction from GGUF metadata -------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: dict, source: str = "GGUF") -> "ModelConfig":
        """Build the config from a GGUF metadata dict; every missing/invalid key is an InputError."""
        arch = meta.get("general.architecture")
        if arch != ARCH:
            raise InputError(f"{source}: general.architecture is {arch!r}, expected {ARCH!r}")
        reader = _KeyReader(meta, source)
        n_layers = reader.int("block_count", lo=1)
        n_nextn = reader.int("nextn_predict_layers", lo=0, default=0)
        # llama.cpp counts the MTP block in block_count when it lives in the same file
        n_layers -= n_nextn
        ratios = reader.int_list("attention.compress_ratios")
        if len(ratios) < n_layers:
            raise InputError(f"{source}: key deepseek4.attention.compress_ratios has {len(ratios)} "
                             f"entries, expected at least block_count={n_layers}")
        clamp = reader.float_list("swiglu_clamp_exp", n_layers, default=10.0)
        cfg = cls(
            n_layers=n_layers,
            ctx_train=reader.int("context_length", lo=1),
            dim=reader.int("embedding_length", lo=1),
            vocab=reader.int("vocab_size", lo=2),
            n_heads=reader.int("attention.head_count", lo=1),
            head_dim=reader.int("attention.key_length", lo=2),
            rope_dim=reader.int("rope.dimension_count", lo=2),
            q_rank=reader.int("attention.q_lora_rank", lo=1),
            o_rank=reader.int("attention.output_lora_rank", lo=1),
            o_groups=reader.int("attention.output_group_count", lo=1),
            window=reader.int("attention.sliding_window", lo=1),
            compress_ratios=tuple(int(r) for r in ratios[:n_layers]),
            compress_rope_base=reader.float("attention.compress_rope_freq_base", lo=1.0),
            index_heads=reader.int("attention.indexer.head_count", lo=1),
            index_dim=reader.int("attention.indexer.key_length", lo=2),
            index_topk=reader.int("attention.indexer.top_k", lo=1),
            rms_eps=reader.float("attention.layer_norm_rms_epsilon", lo=0.0),
            rope_base=reader.float("rope.freq_base", lo=1.0),
            yarn_factor=reader.float("rope.scaling.factor", lo=1.0, default=1.0),
            yarn_orig_ctx=reader.int("rope.scaling.original_context_length", lo=0, default=0),
            yarn_beta_fast=reader.float("rope.scaling.yarn_beta_fast", lo=0.0, default=32.0),
            yarn_beta_slow=reader.float("rope.scaling.yarn_beta_slow", lo=0.0, default=1.0),
            n_experts=reader.int("expert_count", lo=1),
            n_experts_used=reader.int("expert_used_count", lo=1),
            n_shared_experts=reader.int("expert_shared_count", lo=0, default=1),
            moe_dim=reader.int("expert_feed_forward_length", lo=1),
            routed_scale=reader.float("expert_weights_scale", lo=0.0, default=1.0),
            norm_topk=reader.bool("expert_weights_norm", default=True),
            n_hash_layers=reader.int("hash_layer_count", lo=0, default=0),
            swiglu_clamp=clamp,
            swiglu_clamp_shared=reader.float_list("swiglu_clamp_shexp", n_layers, default=clamp),
            hc_mult=reader.int("hyper_connection.count", lo=1),
            hc_iters=reader.int("hyper_connection.sinkhorn_iterations", lo=1),
            hc_eps=reader.float("hyper_connection.epsilon", lo=0.0),
            n_nextn=n_nextn,
        )
        reader.check_equal("attention.head_count_kv", 1)
        reader.check_equal("attention.value_length", cfg.head_dim)
        reader.check_equal("expert_gating_func", GATING_SQRTSOFTPLUS, optional=True)
        for key in ("expert_group_count", "expert_group_used_count"):
            reader.check_equal(key, 0, optional=True)  # V4 routes flat top-k (no groups)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        """Cross-key checks the forward pass relies on; each names the keys involved."""
        k = f"{source}: key {ARCH}."

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise InputError(k + msg)

        need(self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim,
             f"rope.dimension_count={self.rope_dim} must be even and <= key_length={self.head_dim}")
        need(self.n_heads % self.o_groups == 0,
             f"attention.output_group_count={self.o_groups} must divide head_count={self.n_heads}")
        need(self.n_experts_used <= self.n_experts,
             f"expert_used_count={self.n_experts_used} exceeds expert_count={self.n_experts}")
        need(self.n_hash_layers <= self.n_layers,
             f"hash_layer_count={self.n_hash_layers} exceeds block_count={self.n_layers}")
        need(self.n_shared_experts <= 1,
             f"expert_shared_count={self.n_shared_experts}, expected 0 or 1")
        need(all(r >= 0 for r in self.compress_ratios),
             f"attention.compress_ratios={list(self.compress_ratios)} has a negative ratio")
        # FP8 round-trip blocks of 64 start at dim 0 of the non-rope slice (spec §8b.4)
        need(self.nope_dim % 64 == 0,
             f"key_length - rope.dimension_count = {self.nope_dim} must be a multiple of 64")
        if any(self.is_csa(i) for i in range(self.n_layers)):
            d = self.index_dim
            need(d >= 32 and d & (d - 1) == 0,
                 f"attention.indexer.key_length={d} must be a power of two >= 32 "
                 "(Hadamard + FP4 blocks of 32)")
            need(self.rope_dim <= d,
                 f"rope.dimension_count={self.rope_dim} exceeds indexer.key_length={d}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


class _KeyReader:
    """Reads ``deepseek4.<name>`` keys with type and range checks; errors name the full key."""

    def __init__(self, meta: dict, source: str):
        self.meta, self.source = meta, source

    _MISSING = object()

    def _get(self, name, default=_MISSING):
        key = f"{ARCH}.{name}"
        if key in self.meta:
            return key, self.meta[key]
        if default is self._MISSING:
            raise InputError(f"{self.source}: missing metadata key {key}")
        return key, default

    def _fail(self, key, value, expected):
        raise InputError(f"{self.source}: key {key}={value!r}, expected {expected}")

    def int(self, name, lo, default=_MISSING) -> int:
        key, v = self._get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            self._fail(key, v, f"an integer >= {lo}")
        return int(v)

    def float(self, name, lo, default=_MISSING) -> float:
        key, v = self._get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
            self._fail(key, v, f"a finite number >= {lo}")
        return float(v)

    def bool(self, name, default=_MISSING) -> bool:
        key, v = self._get(name, default)
        if not isinstance(v, (bool, int)):
            self._fail(key, v, "a bool")
        return bool(v)

    def int_list(self, name) -> list[int]:
        key, v = self._get(name)
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) for x in v):
            self._fail(key, v, "an array of integers")
        return list(v)

    def float_list(self, name, n, default=_MISSING) -> tuple[float, ...]:
        key, v = self._get(name, default)
        if isinstance(v, (int, float)):
            return (float(v),) * n
        if not isinstance(v, (list, tuple)) or len(v) < n:
            self._fail(key, v, f"an array of at least {n} numbers")
        return tuple(float(x) for x in v[:n])

    def check_equal(self, name, expected, optional=False):
        key = f"{ARCH}.{name}"
        if key not in self.meta:
            if optional:
                return
            raise InputError(f"{self.source}: missing metadata key {key}")
        if self.meta[key] != expected:
            self._fail(key, self.meta[key], f"{expected} (DeepSeek-V4)")
