"""The Memory Indexer's scorer, NumPy reference (flashmemory.md §3-§4): the spec for the kernels.

For one target layer, with x [D] that layer's attention input (after HC pre + attn_norm) for the
current token at position p, and keys [N, DI] that layer's own indexer keys:

    a  = RMSNorm(wq_a · x) ⊙ g                      eps 1e-6, fp32
    q  = wq_b · a  as [H, DI]                        head-major rows
    q  = bf16(RoPE_p(bf16(q)))                       last R dims, the compressed layers' YaRN
    q_h = Hadamard(q_h)                               orthonormal, as the stored keys
    w  = (weights_proj · x) / √(DI·H)                signed, from x (1/128 for H = DI = 128)
    z_n = Σ_h w_h · ReLU(q_h · k_n)                   the logit;  score σ(z_n)

The deployment casts q to bf16 around RoPE (§3.6); ``bf16_rope`` reproduces it. Positions are
clamped to [0, max_position - 1] (§3.4). Keys come from the packed FP4 store (power-of-two block
scales): each key factors as k_n = s_n · k'_n with s_n a power of two, and since ReLU commutes
with a positive scale, z_n = s_n · Σ_h w_h ReLU(q_h · k'_n) — the scale applied once, after the
head sum (§4, exact). Dimension letters: D hidden, H retriever heads, DI head dim, N chunks,
L retriever layers.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..quants import bf16_to_float32, float32_to_bf16
from .checkpoint import RetrieverLayer

RMS_EPS = 1e-6  # the retriever's own q_norm epsilon (§3.2), whatever the model's is


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), back as float32."""
    return bf16_to_float32(float32_to_bf16(x))


def retriever_query_ref(q_out, w_out, x, layer: RetrieverLayer, cos, sin, hadamard,
                        bf16_rope: bool = True) -> None:
    """q_out[H, DI], w_out[H] <- x[D]; cos/sin [1, R/2] at the (clamped) position;
    hadamard [DI, DI] orthonormal."""
    H, DI = q_out.shape
    a = layer.wq_a @ x.astype(np.float32)
    a = a / np.sqrt(np.mean(a * a) + RMS_EPS) * layer.q_norm
    q = (layer.wq_b @ a).reshape(1, H, DI).astype(np.float32)
    if bf16_rope:
        q = round_bf16(q)
    ops.rope(q, q, cos.astype(np.float32), sin.astype(np.float32))
    if bf16_rope:
        q = round_bf16(q)
    q_out[...] = q[0] @ hadamard  # H is symmetric: q_h·H = H·q_h
    w_out[...] = (layer.weights_proj @ x.astype(np.float32)) / math.sqrt(DI * H)


def split_key_scale(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """keys[N, DI] -> (unit[N, DI], scale[N]) with keys = scale · unit exactly: scale the
    power of two at or above each key's largest magnitude (1 for a zero key)."""
    amax = np.abs(keys).max(axis=1)
    e = np.ceil(np.log2(np.where(amax > 0, amax, 1.0)))
    scale = np.exp2(e).astype(np.float32)
    return (keys / scale[:, None]).astype(np.float32), scale


def retriever_logits_ref(out, q, w, unit_keys, scale) -> None:
    """out[N] <- scale[n] · Σ_h w[h] · ReLU(q[h] · unit_keys[n]); q [H, DI], w [H]."""
    dots = unit_keys @ q.T  # [N, H]
    out[...] = scale * (np.maximum(dots, 0.0) @ w)


def retriever_logits_keys_ref(out, q, w, keys) -> None:
    """out[N] <- z_n over float keys [N, DI] (split into unit keys and scales, then scored)."""
    unit, scale = split_key_scale(keys)
    retriever_logits_ref(out, q, w, unit, scale)


def sigmoid(z: np.ndarray) -> np.ndarray:
    """σ(z) without overflow warnings for large |z| (the tanh form)."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, np.float64)))
