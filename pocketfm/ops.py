"""The NumPy op table: every op of the V4 forward, output first, writing into preallocated arrays.

These functions are the specification for the CUDA kernels (``pocketfm/kernels/``), which take
the same arguments. Each op works in the dtype of its output (float32 to run, float64 in tests).
Dimension letters: T tokens, D hidden, H heads, K head dim, R rope dims, G output groups,
HC hyper-connection streams, E experts, F expert width, N compressed entries, M attended keys.
"""
from __future__ import annotations

import numpy as np

from .numerics import fp4_roundtrip, fp8_roundtrip
from .weights import Tensor


# ---- projections -------------------------------------------------------------------------
def embed(out: np.ndarray, table: Tensor, tokens: np.ndarray) -> None:
    """out[T, D] = table[tokens]."""
    out[...] = table.dense(out.dtype)[tokens]


def matmul(out: np.ndarray, w: Tensor, x: np.ndarray) -> None:
    """out[T, N] = x[T, Kin] · W[N, Kin]ᵀ (W dequantised from its GGUF type)."""
    np.matmul(x, w.dense(out.dtype).T, out=out)


def grouped_matmul(out: np.ndarray, w: Tensor, x: np.ndarray) -> None:
    """out[T, G, R] = per group g: x[T, g, Kg] · W[g·R:(g+1)·R, Kg]ᵀ (spec §4.10, wo_a)."""
    T, G, R = out.shape
    wg = w.dense(out.dtype).reshape(G, R, x.shape[-1])
    out[...] = np.einsum("tgk,grk->tgr", x, wg)


# ---- norms and rotary embedding ----------------------------------------------------------
def rmsnorm(out: np.ndarray, x: np.ndarray, w: Tensor | None, eps: float) -> None:
    """out = w ⊙ x / sqrt(mean(x²) + eps) over the last axis; ``w=None`` is the weightless norm."""
    r = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    out[...] = x * r if w is None else x * r * w.dense(out.dtype)


def rope(out: np.ndarray, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
         inverse: bool = False) -> None:
    """Rotate the last R dims of x[T, ..., n] in adjacent pairs (2i, 2i+1); cos/sin [T, R/2].

    The first n - R dims pass through. ``inverse`` rotates by -θ (attention output, spec §4.9).
    """
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    tail = x[..., -2 * half:]
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    out[..., : x.shape[-1] - 2 * half] = x[..., : x.shape[-1] - 2 * half]
    out[..., -2 * half::2] = r0
    out[..., -2 * half + 1::2] = r1


def kv_roundtrip(out: np.ndarray, x: np.ndarray, rope_dim: int) -> None:
    """FP8 round-trip (blocks of 64) on the non-rope dims of kv entries; rope dims pass (§8b.4)."""
    n = x.shape[-1] - rope_dim
    out[..., :n] = fp8_roundtrip(x[..., :n], 64)
    out[..., n:] = x[..., n:]


def indexer_roundtrip(out: np.ndarray, x: np.ndarray, hadamard: np.ndarray) -> None:
    """Hadamard over the last axis, then the FP4 round-trip in blocks of 32 (spec §4.7)."""
    out[...] = fp4_roundtrip(x @ hadamard, 32)


# ---- hyper-connections (spec §4.2, §4.3, §4.12) -------------------------------------------
def _hc_mix(X: np.ndarray, fn: Tensor, rms_eps: float) -> np.ndarray:
    """m[T, rows] = r · (fn · flatten(X)), r = 1/sqrt(mean(x̂²) + eps) per token."""
    xf = X.reshape(X.shape[0], -1)
    r = 1.0 / np.sqrt(np.mean(np.square(xf), axis=-1, keepdims=True) + rms_eps)
    return (xf @ fn.dense(X.dtype).T) * r


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def hc_pre(out_u: np.ndarray, out_post: np.ndarray, out_comb: np.ndarray, X: np.ndarray,
           fn: Tensor, base: Tensor, scale: Tensor, rms_eps: float, hc_eps: float,
           iters: int) -> None:
    """Collapse the HC streams X[T, HC, D] into the sublayer input u[T, D].

    Also returns the post weights [T, HC] and the Sinkhorn-normalised comb matrix [T, HC, HC]
    (row = source stream j, column = destination k) that ``hc_post`` uses.
    """
    hc = X.shape[1]
    dt = out_u.dtype
    m = _hc_mix(X, fn, rms_eps)
    b, s = base.dense(dt), scale.dense(dt)
    pre = sigmoid(m[:, :hc] * s[0] + b[:hc]) + hc_eps
    out_post[...] = 2.0 * sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    logits = (m[:, 2 * hc:] * s[2] + b[2 * hc:]).reshape(-1, hc, hc)
    # Sinkhorn: row softmax (+eps), column normalise, then (iters-1) x (row, column) normalise
    c = np.exp(logits - logits.max(axis=-1, keepdims=True))
    c = c / c.sum(axis=-1, keepdims=True) + hc_eps
    c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + hc_eps)
        c = c / (c.sum(axis=-2, keepdims=True) + hc_eps)
    out_comb[...] = c
    out_u[...] = np.einsum("th,thd->td", pre, X)


def hc_post(out: np.ndarray, f: np.ndarray, X: np.ndarray, post: np.ndarray,
            comb: np.ndarray) -> None:
    """out[T, k] = post[k] · f + Σ_j comb[j, k] · X[j]  (k, j over HC streams)."""
    out[...] = post[:, :, None] * f[:, None, :] + np.einsum("tjk,tjd->tkd", comb, X)


def hc_head(out_u: np.ndarray, X: np.ndarray, fn: Tensor, base: Tensor, scale: Tensor,
            rms_eps: float, hc_eps: float) -> None:
    """Output-head collapse: sigmoid pre weights only, no Sinkhorn, no post."""
    m = _hc_mix(X, fn, rms_eps)
    pre = sigmoid(m * scale.dense(out_u.dtype)[0] + base.dense(out_u.dtype)) + hc_eps
    out_u[...] = np.einsum("th,thd->td", pre, X)


# ---- compressed attention ----------------------------------------------------------------
def softmax_pool(out: np.ndarray, kv: np.ndarray, score: np.ndarray) -> None:
    """out[d] = Σ_rows softmax_rows(score[:, d]) · kv[:, d] (per-dimension pooling, §4.6).

    Rows with score -inf (absent candidates) get weight 0.
    """
    m = score.max(axis=0, keepdims=True)
    p = np.exp(score - m)
    out[...] = (p * kv).sum(axis=0) / p.sum(axis=0)


def indexer_scores(out: np.ndarray, q: np.ndarray, w: np.ndarray, keys: np.ndarray) -> None:
    """out[T, N] = Σ_h w[T, h] · ReLU(q[T, h] · keys[N]) — ReLU before the head sum (§4.7)."""
    dots = np.einsum("thd,nd->thn", q, keys)
    out[...] = np.einsum("th,thn->tn", w, np.maximum(dots, 0.0))


def topk_visible(out: np.ndarray, scores: np.ndarray, n_visible: np.ndarray) -> None:
    """out[T, k]: the indices of the top-k scores among entries j < n_visible[t]; -1 pads.

    Order within the selection is irrelevant (attention is a set operation); ties at the k-th
    score go to the lowest indices, so the set is unique (the GPU top-k picks the same one).
    """
    k = out.shape[1]
    out[...] = -1
    for t in range(scores.shape[0]):
        n = int(n_visible[t])
        if n <= k:
            out[t, :n] = np.arange(n)
        else:
            out[t] = np.argsort(-scores[t, :n], kind="stable")[:k]


def sink_attention(out: np.ndarray, q: np.ndarray, kv: np.ndarray, mask: np.ndarray,
                   sinks: np.ndarray, scale: float) -> None:
    """out[T, H, K] = Σ_m p[t, h, m] · kv[m], with K = V = kv[M, K] and a per-head sink.

    p = softmax over the allowed keys (mask[T, M]) of scale·(q·k), with exp(sink_h - max) added
    to the denominator only: the sink is a virtual key of zero value (spec §4.9).
    """
    s = np.einsum("thk,mk->thm", q, kv) * scale
    s = np.where(mask[:, None, :], s, -np.inf)
    sk = sinks[None, :, None]
    m = np.maximum(s.max(axis=-1, keepdims=True), sk)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True) + np.exp(sk - m)
    out[...] = np.einsum("thm,mk->thk", p / denom, kv)


# ---- mixture of experts (spec §4.11) -------------------------------------------------------
def route(out_idx: np.ndarray, out_w: np.ndarray, logits: np.ndarray, bias: np.ndarray | None,
          hashed: np.ndarray | None, routed_scale: float, normalise: bool) -> None:
    """Pick k experts per token and their weights.

    scores = sqrt(softplus(logits)); the bias steers selection only; hash layers take the ids
    from ``hashed[T, k]`` (tid2eid rows). Weights come from the unbiased scores, renormalised over
    the chosen k, times the routed scale.
    """
    k = out_idx.shape[1]
    s = np.sqrt(np.logaddexp(0.0, logits))
    if hashed is not None:
        idx = hashed
    else:
        sel = s + bias[None, :]
        idx = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(s, idx, axis=1)
    if normalise:
        w = w / w.sum(axis=1, keepdims=True)
    out_idx[...] = idx
    out_w[...] = w * routed_scale


def swiglu(x_gate: np.ndarray, x_up: np.ndarray, clamp: float) -> np.ndarray:
    """silu(min(gate, c)) ⊙ clamp(up, -c, c); c <= 0 disables the clamp."""
    if clamp > 0:
        x_gate = np.minimum(x_gate, clamp)
        x_up = np.clip(x_up, -clamp, clamp)
    return x_gate * sigmoid(x_gate) * x_up


def moe_experts(out: np.ndarray, x: np.ndarray, idx: np.ndarray, w: np.ndarray, gate: Tensor,
                up: Tensor, down: Tensor, clamp: float) -> None:
    """out[T, D] = Σ_k down_e (w_k · swiglu(gate_e x, up_e x)) over the selected experts only.

    The routing weight multiplies the hidden activation before the down projection.
    """
    dt = out.dtype
    out[...] = 0.0
    for e in np.unique(idx):
        rows, slot = np.nonzero(idx == e)
        xe = x[rows]
        h = swiglu(xe @ gate.expert(e, dt).T, xe @ up.expert(e, dt).T, clamp)
        out[rows] += (h * w[rows, slot][:, None]) @ down.expert(e, dt).T


def shared_expert(out: np.ndarray, x: np.ndarray, gate: Tensor, up: Tensor, down: Tensor,
                  clamp: float) -> None:
    """out[T, D] = down · swiglu(gate x, up x): the always-on expert, weight 1."""
    dt = out.dtype
    h = swiglu(x @ gate.dense(dt).T, x @ up.dense(dt).T, clamp)
    np.matmul(h, down.dense(dt).T, out=out)
