"""The DeepSeek-V4 forward pass over an op table (spec §4–§5).

``forward(tokens, state)`` runs a chunk of T consecutive tokens — T = 1 is a decode step, larger T
a prefill chunk — and the two agree (tested): every causal rule of the spec (window t-W+1..t,
compressed entries j < ⌊(t+1)/r⌋, indexer top-k over the entries visible at t) is applied per
token inside the chunk. ``ops`` is the NumPy op table; the CUDA backend supplies one with the same
signatures. The decode state is explicit and allocated once (``RunState``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import ops as numpy_ops
from .config import ModelConfig
from .numerics import hadamard_matrix, rope_frequencies, rope_tables
from .quants import bf16_to_float32, float32_to_bf16
from .weights import Block, Weights


@dataclass
class LayerState:
    """Per-layer decode state. Rows of the compressor state: CSA 2r (previous block, current
    block), HCA r. Scores start at -inf so that absent candidates get zero weight (§4.6)."""

    window: np.ndarray  # [W, K] raw kv ring, slot = position mod W
    comp: np.ndarray | None = None  # [N, K] compressed kv entries (ratio > 0)
    comp_kv: np.ndarray | None = None  # [rows, coff·K] compressor values a_t
    comp_score: np.ndarray | None = None  # [rows, coff·K] compressor scores g_t + ape
    index_keys: np.ndarray | None = None  # [N, DI] indexer keys (CSA)
    index_kv: np.ndarray | None = None  # [2r, 2·DI]
    index_score: np.ndarray | None = None  # [2r, 2·DI]


class RunState:
    """Everything one sequence carries between forward calls, sized for ``capacity`` tokens."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype=np.float32):
        self.capacity, self.pos = capacity, 0
        self.layers = []
        for i in range(cfg.n_layers):
            st = LayerState(window=np.zeros((cfg.window, cfg.head_dim), dtype))
            r = cfg.ratio(i)
            if r > 0:
                rows, width = (2 * r if cfg.is_csa(i) else r), cfg.coff(i) * cfg.head_dim
                st.comp = np.zeros((capacity // r, cfg.head_dim), dtype)
                st.comp_kv = np.zeros((rows, width), dtype)
                st.comp_score = np.full((rows, width), -np.inf, dtype)
            if cfg.is_csa(i):
                st.index_keys = np.zeros((capacity // r, cfg.index_dim), dtype)
                st.index_kv = np.zeros((2 * r, 2 * cfg.index_dim), dtype)
                st.index_score = np.full((2 * r, 2 * cfg.index_dim), -np.inf, dtype)
            self.layers.append(st)

    def n_compressed(self, layer_ratio: int) -> int:
        return self.pos // layer_ratio


class Forward:
    """DeepSeek-V4 forward for one loaded model; ``qat`` switches the FP8/FP4 round-trips.

    ``packed_kv`` (default: on with QAT) gives every stored kv entry — window ring and compressed
    — the rounding of the GPU's packed 584-byte format: the FP8 dims are exact already, the rope
    dims are rounded to bf16 (spec §6.3). Both backends then attend over the same values;
    ``packed_kv=False`` keeps them in full precision (fidelity tests against the reference).
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, qat: bool = True,
                 dtype=np.float32, ops=numpy_ops, packed_kv: bool | None = None):
        self.cfg, self.w, self.qat, self.dtype, self.ops = cfg, weights, qat, np.dtype(dtype), ops
        self.packed_kv = qat if packed_kv is None else bool(packed_kv)
        self.freq_window = rope_frequencies(cfg.rope_dim, cfg.rope_base)  # ratio-0 layers
        self.freq_compressed = rope_frequencies(
            cfg.rope_dim, cfg.compress_rope_base, cfg.yarn_factor, cfg.yarn_orig_ctx,
            cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        self.hadamard = hadamard_matrix(cfg.index_dim).astype(self.dtype)
        self.memory = None  # a memory.MemoryIndexer: Level-1 selection (FlashMemory), or None

    def new_state(self, capacity: int) -> RunState:
        return RunState(self.cfg, capacity, self.dtype)

    def _empty(self, *shape):
        return np.empty(shape, self.dtype)

    # ---- whole model ----------------------------------------------------------------------
    def forward(self, tokens, state: RunState, all_logits: bool = True,
                trace: dict | None = None) -> np.ndarray:
        """Run tokens at positions state.pos … state.pos+T-1; logits [T, vocab] (or [1, vocab])."""
        cfg, ops = self.cfg, self.ops
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        if state.pos + T > state.capacity:
            raise ValueError(f"state holds {state.capacity} tokens; {state.pos}+{T} requested")
        pos = state.pos + np.arange(T)
        if self.memory is not None:
            self.memory.begin(state.pos, T)
        e = self._empty(T, cfg.dim)
        ops.embed(e, self.w.token_embd, tokens)
        X = np.repeat(e[:, None, :], cfg.hc_mult, axis=1)  # [T, HC, D]: 4 copies (§4.1)
        _record(trace, "embed_out", e)
        for i, blk in enumerate(self.w.blocks):
            X = self.attention_block(i, blk, X, pos, state.layers[i], trace)
            X = self.ffn_block(i, blk, X, tokens, trace)
            _record(trace, f"block{i}.out", X)
        state.pos += T
        if self.memory is not None:  # a cycle boundary scores here; its set applies next step
            self.memory.end(state)
        if not all_logits:
            X = X[-1:]
        u = self._empty(X.shape[0], cfg.dim)
        ops.hc_head(u, X, self.w.output_hc_fn, self.w.output_hc_base, self.w.output_hc_scale,
                    cfg.rms_eps, cfg.hc_eps)
        ops.rmsnorm(u, u, self.w.output_norm, cfg.rms_eps)
        _record(trace, "final_norm_out", u)
        logits = self._empty(X.shape[0], cfg.vocab)
        ops.matmul(logits, self.w.output, u)
        return logits

    # ---- attention sublayer (§4.4–§4.10) -----------------------------------------------------
    def attention_block(self, i: int, blk: Block, X, pos, st: LayerState, trace):
        cfg, ops = self.cfg, self.ops
        T, H, K = X.shape[0], cfg.n_heads, cfg.head_dim
        u, post, comb = self._empty(T, cfg.dim), self._empty(T, cfg.hc_mult), \
            self._empty(T, cfg.hc_mult, cfg.hc_mult)
        ops.hc_pre(u, post, comb, X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale,
                   cfg.rms_eps, cfg.hc_eps, cfg.hc_iters)
        ops.rmsnorm(u, u, blk.attn_norm, cfg.rms_eps)
        _record(trace, f"block{i}.attn_norm_out", u)
        if self.memory is not None:  # the retriever's x: this layer's indexer input (§2)
            self.memory.observe(i, u)
        ratio = cfg.ratio(i)
        cos, sin = rope_tables(self.freq_compressed if ratio else self.freq_window, pos,
                               self.dtype)

        cq = self._empty(T, cfg.q_rank)  # query latent, also the indexer's query input
        ops.matmul(cq, blk.attn_q_a, u)
        ops.rmsnorm(cq, cq, blk.attn_q_a_norm, cfg.rms_eps)
        q = self._empty(T, H, K)
        ops.matmul(q.reshape(T, H * K), blk.attn_q_b, cq)
        ops.rmsnorm(q, q, None, cfg.rms_eps)  # per-head weightless norm (§8 pitfall 2)
        ops.rope(q, q, cos, sin)
        kv = self._empty(T, K)  # the shared K = V vector
        ops.matmul(kv, blk.attn_kv, u)
        ops.rmsnorm(kv, kv, blk.attn_kv_a_norm, cfg.rms_eps)
        ops.rope(kv, kv, cos, sin)
        if self.qat:
            ops.kv_roundtrip(kv, kv, cfg.rope_dim)
        self._storage_rounding(kv)

        keys, mask = self._window_keys(st, kv, pos)  # also pushes kv into the ring
        if ratio > 0:
            a, g = self._compressor_inputs(blk.attn_compressor_kv, blk.attn_compressor_gate,
                                           blk.attn_compressor_ape, u, pos, ratio)
            self._compress(a, g, pos, ratio, st.comp_kv, st.comp_score, st.comp,
                           blk.attn_compressor_norm, K, self._emit_kv)
            n_now = (int(pos[-1]) + 1) // ratio  # entries emitted so far
            n_vis = (pos + 1) // ratio  # entries visible to each token
            if cfg.is_csa(i):
                chosen = self.indexer(i, blk, st, u, cq, cos, sin, pos, n_now, n_vis)
                cmask = np.zeros((T, n_now), bool)
                rows = np.repeat(np.arange(T), chosen.shape[1])
                sel = chosen.reshape(-1)
                cmask[rows[sel >= 0], sel[sel >= 0]] = True
                _record(trace, f"block{i}.indexer_topk", chosen)
            else:  # HCA attends to every visible entry
                cmask = np.arange(n_now)[None, :] < n_vis[:, None]
            keys = np.concatenate([keys, st.comp[:n_now]])
            mask = np.concatenate([mask, cmask], axis=1)

        o = self._empty(T, H, K)
        sinks = blk.attn_sinks.dense(self.dtype)
        ops.sink_attention(o, q, keys, mask, sinks, 1.0 / math.sqrt(K))
        ops.rope(o, o, cos, sin, inverse=True)  # values carry rotated dims (§4.9)
        G = cfg.o_groups
        y = self._empty(T, G, cfg.o_rank)
        ops.grouped_matmul(y, blk.attn_output_a, o.reshape(T, G, cfg.heads_per_group * K))
        f = self._empty(T, cfg.dim)
        ops.matmul(f, blk.attn_output_b, y.reshape(T, G * cfg.o_rank))
        _record(trace, f"block{i}.attn_out", f)
        Xn = np.empty_like(X)
        ops.hc_post(Xn, f, X, post, comb)
        return Xn

    def _window_keys(self, st: LayerState, kv, pos):
        """Keys for the chunk's window: the ring's earlier entries then the chunk's own kv.

        Returns keys [M, K] and mask [T, M] (key position in t-W+1..t); updates the ring.
        """
        W = self.cfg.window
        p0 = int(pos[0])
        prev = np.arange(max(0, p0 - W + 1), p0)
        keys = np.concatenate([st.window[prev % W], kv])
        kpos = np.concatenate([prev, pos])
        mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - W)
        tail = pos[-W:]
        st.window[tail % W] = kv[-len(tail):]
        return keys, mask

    # ---- compressors (§4.6) -----------------------------------------------------------------
    def _compressor_inputs(self, w_kv, w_gate, ape, u, pos, ratio):
        """a_t = wkv·u and g_t = wgate·u + ape[t mod r] for every token of the chunk."""
        T, width = u.shape[0], w_kv.shape[0]
        a, g = self._empty(T, width), self._empty(T, width)
        self.ops.matmul(a, w_kv, u)
        self.ops.matmul(g, w_gate, u)
        g += ape.dense(self.dtype)[pos % ratio]
        return a, g

    def _compress(self, a, g, pos, ratio, state_kv, state_score, store, norm, d, emit):
        """Advance a compressor over the chunk token by token; emit each completed block.

        CSA (2r state rows, coff 2): block j pools, per dimension, lane A (dims [0, d)) of block
        j-1 and lane B (dims [d, 2d)) of block j — 8 candidates at stride 4. HCA pools its r rows.
        """
        overlap = state_kv.shape[0] == 2 * ratio
        pooled, blocks = [], []
        for t in range(len(pos)):
            p = int(pos[t])
            row = (ratio if overlap else 0) + p % ratio
            state_kv[row], state_score[row] = a[t], g[t]
            if (p + 1) % ratio:
                continue
            if overlap:
                kv = np.concatenate([state_kv[:ratio, :d], state_kv[ratio:, d:]])
                sc = np.concatenate([state_score[:ratio, :d], state_score[ratio:, d:]])
            else:
                kv, sc = state_kv, state_score
            c = self._empty(d)
            self.ops.softmax_pool(c, kv, sc)
            pooled.append(c)
            blocks.append((p + 1) // ratio - 1)
            if overlap:  # the current block becomes the previous one
                state_kv[:ratio], state_score[:ratio] = state_kv[ratio:], state_score[ratio:]
        if pooled:
            blocks = np.array(blocks)
            store[blocks] = emit(np.stack(pooled), norm, blocks * ratio)

    def _emit_kv(self, c, norm, first_pos):
        """Compressed kv entry: RMSNorm → RoPE at the block's first position → FP8 (§4.6)."""
        self.ops.rmsnorm(c, c, norm, self.cfg.rms_eps)
        cos, sin = rope_tables(self.freq_compressed, first_pos, self.dtype)
        self.ops.rope(c, c, cos, sin)
        if self.qat:
            self.ops.kv_roundtrip(c, c, self.cfg.rope_dim)
        self._storage_rounding(c)
        return c

    def _storage_rounding(self, kv):
        """The packed format's bf16 rope dims (see ``packed_kv``), in place."""
        if self.packed_kv:
            tail = kv[..., -self.cfg.rope_dim:]
            tail[...] = bf16_to_float32(float32_to_bf16(tail.astype(np.float32)))

    def _emit_index_key(self, c, norm, first_pos):
        """Indexer key: RMSNorm → RoPE at the block's first position → Hadamard (+ FP4)."""
        self.ops.rmsnorm(c, c, norm, self.cfg.rms_eps)
        cos, sin = rope_tables(self.freq_compressed, first_pos, self.dtype)
        self.ops.rope(c, c, cos, sin)
        self._rotate_index(c)
        return c

    def _rotate_index(self, x):
        """Hadamard on the last axis, then FP4 with QAT on. The Hadamard is orthonormal and
        applied to both q and keys, so without FP4 it leaves every score unchanged."""
        if self.qat:
            self.ops.indexer_roundtrip(x, x, self.hadamard)
        else:
            x[...] = x @ self.hadamard

    # ---- lightning indexer (§4.7) -------------------------------------------------------------
    def indexer(self, i: int, blk: Block, st: LayerState, u, cq, cos, sin, pos, n_now, n_vis):
        """Top-k compressed entries for each token; returns chosen [T, k] (-1 pads). With a
        Memory Indexer, the top-k is taken inside its resident set (two-level selection)."""
        cfg, ops = self.cfg, self.ops
        T, HI, DI = u.shape[0], cfg.index_heads, cfg.index_dim
        a, g = self._compressor_inputs(blk.indexer_compressor_kv, blk.indexer_compressor_gate,
                                       blk.indexer_compressor_ape, u, pos, 4)
        self._compress(a, g, pos, 4, st.index_kv, st.index_score, st.index_keys,
                       blk.indexer_compressor_norm, DI, self._emit_index_key)
        qi = self._empty(T, HI, DI)
        ops.matmul(qi.reshape(T, HI * DI), blk.indexer_attn_q_b, cq)
        ops.rope(qi, qi, cos, sin)
        self._rotate_index(qi)
        wts = self._empty(T, HI)
        ops.matmul(wts, blk.indexer_proj, u)
        wts *= 1.0 / math.sqrt(DI * HI)
        scores = self._empty(T, n_now)
        ops.indexer_scores(scores, qi, wts, st.index_keys[:n_now])
        chosen = np.empty((T, min(cfg.index_topk, max(n_now, 1))), np.int64)
        ops.topk_visible(chosen, scores, n_vis)
        if self.memory is not None:
            chosen = self.memory.select(i, scores, n_vis, chosen)
        return chosen

    # ---- MoE sublayer (§4.11) ------------------------------------------------------------------
    def ffn_block(self, i: int, blk: Block, X, tokens, trace):
        cfg, ops = self.cfg, self.ops
        T, D = X.shape[0], cfg.dim
        v, post, comb = self._empty(T, D), self._empty(T, cfg.hc_mult), \
            self._empty(T, cfg.hc_mult, cfg.hc_mult)
        ops.hc_pre(v, post, comb, X, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale,
                   cfg.rms_eps, cfg.hc_eps, cfg.hc_iters)
        ops.rmsnorm(v, v, blk.ffn_norm, cfg.rms_eps)
        _record(trace, f"block{i}.ffn_norm_out", v)
        logits = self._empty(T, cfg.n_experts)
        ops.matmul(logits, blk.ffn_gate_inp, v)
        k = cfg.n_experts_used
        idx, wts = np.empty((T, k), np.int64), self._empty(T, k)
        if cfg.is_hash_layer(i):
            hashed = np.asarray(blk.ffn_gate_tid2eid.raw)[tokens].astype(np.int64)
            ops.route(idx, wts, logits, None, hashed, cfg.routed_scale, cfg.norm_topk)
        else:
            bias = blk.exp_probs_b.dense(self.dtype)
            ops.route(idx, wts, logits, bias, None, cfg.routed_scale, cfg.norm_topk)
        _record(trace, f"block{i}.route_experts", idx)
        _record(trace, f"block{i}.route_weights", wts)
        f = self._empty(T, D)
        ops.moe_experts(f, v, idx, wts, blk.ffn_gate_exps, blk.ffn_up_exps, blk.ffn_down_exps,
                        cfg.swiglu_clamp[i])
        if cfg.n_shared_experts:
            s = self._empty(T, D)
            ops.shared_expert(s, v, blk.ffn_gate_shexp, blk.ffn_up_shexp, blk.ffn_down_shexp,
                              cfg.swiglu_clamp_shared[i])
            f += s
        _record(trace, f"block{i}.ffn_out", f)
        Xn = np.empty_like(X)
        ops.hc_post(Xn, f, X, post, comb)
        return Xn


def _record(trace, name, value):
    """Keep an intermediate for debugging against the reference's debug dumps."""
    if trace is not None:
        trace.setdefault(name, []).append(np.array(value))
