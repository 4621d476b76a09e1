"""Synthetic model geometries: ``tiny`` (CPU + CUDA simulator), ``small`` (GPU tests), ``flash``.

``flash`` is the real DeepSeek-V4-Flash geometry (spec §1.1); the others keep its structure at a
smaller size. Constraints that every preset honours (spec §8b): head_dim - rope_dim a multiple of
64 (FP8 blocks), index_dim a power of two >= 32 (Hadamard + FP4 blocks), and >= 16 indexer heads so
that indexer top-k decisions are free of exact ties.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .config import ModelConfig
from .errors import InputError


def _v4_ratios(n_layers: int, n_window: int, hca: int) -> tuple[int, ...]:
    """V4-Flash schedule: ``n_window`` window-only layers, then CSA on even and HCA on odd layers."""
    return tuple(0 if i < n_window else (4 if i % 2 == 0 else hca) for i in range(n_layers))


def _config(**kw) -> ModelConfig:
    common = dict(
        compress_rope_base=160000.0, rms_eps=1e-6, rope_base=10000.0, yarn_factor=16.0,
        yarn_orig_ctx=65536, yarn_beta_fast=32.0, yarn_beta_slow=1.0, n_shared_experts=1,
        routed_scale=1.5, norm_topk=True, hc_mult=4, hc_iters=20, hc_eps=1e-6,
    )
    common.update(kw)
    n = common["n_layers"]
    common.setdefault("swiglu_clamp", (10.0,) * n)
    common.setdefault("swiglu_clamp_shared", (10.0,) * n)
    # GGUF stores these as f32: round them the same way so a written file reads back equal
    for k, v in common.items():
        if isinstance(v, float):
            common[k] = float(np.float32(v))
        elif isinstance(v, tuple) and v and isinstance(v[0], float):
            common[k] = tuple(float(np.float32(x)) for x in v)
    cfg = ModelConfig(**common)
    cfg.validate("preset")
    return cfg


def tiny() -> ModelConfig:
    """Every layer type in 5 layers, hidden 64: window-only, CSA (ratio 4 + indexer), HCA (ratio 8),
    two hash-routed layers (one window-only, one CSA) and biased top-k routing elsewhere."""
    return _config(
        n_layers=5, ctx_train=4096, dim=64, vocab=512, n_heads=4, head_dim=128, rope_dim=64,
        q_rank=32, o_rank=32, o_groups=2, window=16, compress_ratios=(0, 4, 8, 4, 0),
        index_heads=16, index_dim=64, index_topk=8, n_experts=8, n_experts_used=2, moe_dim=32,
        n_hash_layers=2,
    )


def small() -> ModelConfig:
    """A ~1.3 B-parameter V4 for GPU tests: 23 layers (11 CSA, 10 HCA), real head/window sizes."""
    return _config(
        n_layers=23, ctx_train=1048576, dim=1024, vocab=4096, n_heads=16, head_dim=512,
        rope_dim=64, q_rank=512, o_rank=512, o_groups=4, window=128,
        compress_ratios=_v4_ratios(23, 2, 128), index_heads=32, index_dim=128, index_topk=512,
        n_experts=32, n_experts_used=6, moe_dim=512, n_hash_layers=3,
    )


def flash() -> ModelConfig:
    """DeepSeek-V4-Flash exactly (spec §1.1): 43 layers, hidden 4096, 256 experts, 284 B params."""
    return _config(
        n_layers=43, ctx_train=1048576, dim=4096, vocab=129280, n_heads=64, head_dim=512,
        rope_dim=64, q_rank=1024, o_rank=1024, o_groups=8, window=128,
        compress_ratios=_v4_ratios(43, 2, 128), index_heads=64, index_dim=128, index_topk=512,
        n_experts=256, n_experts_used=6, moe_dim=2048, n_hash_layers=3,
    )


PRESETS = {"tiny": tiny, "small": small, "flash": flash}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise InputError(f"--preset {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]()


def first_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The geometry cut to its first ``n`` blocks: each kept layer is the full model's (same type,
    same shapes), so a per-layer time measured on it is the full model's. For a bench of the
    ``flash`` geometry on a card smaller than its 87 GB of weights."""
    if not 1 <= n <= cfg.n_layers:
        raise InputError(f"--layers {n}: expected 1 to {cfg.n_layers} (the model's layers)")
    cut = dataclasses.replace(
        cfg, n_layers=n, compress_ratios=cfg.compress_ratios[:n],
        swiglu_clamp=cfg.swiglu_clamp[:n], swiglu_clamp_shared=cfg.swiglu_clamp_shared[:n],
        n_hash_layers=min(cfg.n_hash_layers, n))
    cut.validate("preset")
    return cut
