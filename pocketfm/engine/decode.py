"""The V4 decode step on the GPU: a fixed sequence of kernel launches over state allocated once.

One step consumes the token at ``meta[pos]`` and, once the prompt is in, writes the next one::

    begin_step   token = ids[pos]; window / compressed counts; the step's sampling uniform
    embed        e = token_embd[token]; X = 4 copies (HC streams)
    per layer    attention sublayer (HC pre, norms, q / kv, RoPE, FP8 pack into the window ring,
                 compressor + indexer on CSA layers, sink attention over packed entries,
                 inverse RoPE, grouped output projection, HC post), then the MoE sublayer
    head         HC head collapse, norm, logits, argmax or top-p sample -> next_token
    end_step     ids[pos + 1] = next_token (after the prompt); pos += 1

Nothing the host decides per step reaches a kernel argument: positions, counts, the token, the
selected entries and the sampling uniform all live in device memory, so the step is captured
once as a CUDA graph and replayed per token (``DecodeEngine.generate``); the host only reads
the sampled ids every ``sync_every`` steps. The prompt but its last token goes through the
chunked prefill (prefill.py), which fills the same caches; the step then ingests the last
prompt token and samples.

Storage is the packed format (spec §6.3): window ring and compressed entries 584 B (FP8 + bf16
rope dims + scales), indexer keys 68 B (FP4), exactly what the NumPy forward computes with
``packed_kv`` (its default with QAT). QAT off is not supported here (the values are not on the
FP8 / FP4 grids, so they would need unpacked storage): use the CPU backend for it.
Letters: D hidden, HC streams, H heads, K head dim, R rope dims, G output groups, W window.
"""
from __future__ import annotations

import math
import time

import numpy as np
from numba import cuda

from ..config import ModelConfig
from ..errors import InputError
from ..kernels import device
from ..kernels.attention import attention_decode
from ..kernels.compressor import MODE_INDEX_FP4, MODE_KV_FP8, compressor_step
from ..kernels.embed_sample import argmax, embed, sample_top_p
from ..kernels.gemv import gemv, simulator_prefers_rows
from ..kernels.hc import hc_head, hc_post, hc_pre
from ..kernels.indexer import indexer_scores, topk
from ..kernels.kvpack import index_key_bytes, kv_entry_bytes
from ..kernels.moe import MoEScratch, broadcast_rows, moe_layer
from ..kernels.norm_rope import rmsnorm, rope
from ..kernels.qat import hadamard_fp4, kv_pack
from . import step_kernels as sk
from ..weights import Weights
from .device_weights import DeviceWeights, GGUFSource, index_weight_scale


NEG_INF_BITS = int(np.array(-np.inf, np.float32).view(np.uint32))  # 0xFF800000


class LayerCache:
    """One layer's device-resident cache: window ring, compressed entries, compressor state."""

    def __init__(self, cfg: ModelConfig, i: int, capacity: int, stream):
        K, R = cfg.head_dim, cfg.rope_dim
        kvb = kv_entry_bytes(K, R)
        self.window = cuda.device_array((cfg.window, kvb), np.uint8, stream=stream)
        self.ratio = r = cfg.ratio(i)
        self.comp = self.state_kv = self.state_score = None
        self.index_keys = self.index_kv = self.index_score = None
        if r:
            rows, width = (2 * r if cfg.is_csa(i) else r), cfg.coff(i) * K
            self.comp = cuda.device_array((max(1, capacity // r), kvb), np.uint8, stream=stream)
            self.state_kv = cuda.device_array((rows, width), np.float32, stream=stream)
            self.state_score = cuda.device_array((rows, width), np.float32, stream=stream)
        if cfg.is_csa(i):
            DI = cfg.index_dim
            self.index_keys = cuda.device_array((max(1, capacity // r), index_key_bytes(DI)),
                                                np.uint8, stream=stream)
            self.index_kv = cuda.device_array((2 * r, 2 * DI), np.float32, stream=stream)
            self.index_score = cuda.device_array((2 * r, 2 * DI), np.float32, stream=stream)

    def reset(self, stream) -> None:
        """A fresh sequence: empty ring and entries, compressor scores -inf (RunState's); filled
        on the device (no host copy of the whole cache)."""
        for a in (self.window, self.comp, self.state_kv, self.index_keys, self.index_kv):
            if a is not None:
                sk.fill_words(a.view(np.uint32), 0, stream)
        for a in (self.state_score, self.index_score):
            if a is not None:
                sk.fill_words(a.view(np.uint32), NEG_INF_BITS, stream)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.window, self.comp, self.state_kv, self.state_score,
                                            self.index_keys, self.index_kv, self.index_score)
                   if a is not None)


class DecodeEngine:
    """Device weights + caches for one sequence of up to ``capacity`` tokens, and its step.

    ``weights``: a loaded GGUF's ``Weights``, or a device-weight source (synthetic_weights)."""

    def __init__(self, cfg: ModelConfig, weights, capacity: int, qat: bool = True,
                 stream=None, progress=None):
        if not qat:
            raise InputError("--no-qat: the CUDA backend stores the packed FP8/FP4 caches, which "
                             "need QAT on; run --no-qat with --device cpu")
        self.cfg, self.capacity = cfg, capacity
        self.stream = stream or cuda.stream()
        s = self.stream
        source = GGUFSource(weights, s) if isinstance(weights, Weights) else weights
        self.w = DeviceWeights(cfg, source, progress)
        self.caches = [LayerCache(cfg, i, capacity, s) for i in range(cfg.n_layers)]
        self.ratios = sorted({cfg.ratio(i) for i in range(cfg.n_layers)} - {0})
        self._alloc_step_buffers()
        self._graph, self._warm, self._prefill = None, None, None
        self.n_prompt = 0
        self.mem = None  # engine/memory.py: the Memory Indexer's resident set, when attached
        # The simulator runs each thread as a Python thread: small blocks, thread-per-row GEMVs
        # and the serial forms of the norm / RoPE / HC / Hadamard kernels (their fast forms have
        # their own tests) keep a simulated step in seconds. On a GPU every launcher picks its
        # own shape and the fast kernels.
        self.nt = 32 if device.SIMULATOR else None
        self.sim = {"naive": True} if device.SIMULATOR else {}
        # independent parts of a step (the kv entry + compressor beside the query + indexer;
        # the shared expert beside the routed ones) run on a second stream: concurrent
        # branches of the captured graph (``branches = False``: one stream, e.g. to profile)
        self.side, self.branches = device.SideStream(), True
        if device.SIMULATOR:
            simulator_prefers_rows()

    # ---- buffers -------------------------------------------------------------------------------
    def _alloc_step_buffers(self):
        cfg, s = self.cfg, self.stream
        D, HC, H, K = cfg.dim, cfg.hc_mult, cfg.n_heads, cfg.head_dim
        f32 = np.float32

        def buf(*shape, dtype=f32):
            return cuda.device_array(shape, dtype, stream=s)
        self.meta = buf(sk.META_RATIOS + max(1, len(self.ratios)), dtype=np.int32)
        self.ids = buf(self.capacity + 1, dtype=np.int32)
        self.ratio_arr = cuda.to_device(np.array(self.ratios or [1], np.int32), stream=s)
        self.uniforms = buf(max(1, self.capacity), dtype=f32)
        self.token, self.next_token = buf(1, dtype=np.int32), buf(1, dtype=np.int32)
        self.u = buf(1)
        self.pos = self.meta[sk.META_POS:sk.META_POS + 1]
        self.n_window = self.meta[sk.META_WINDOW:sk.META_WINDOW + 1]
        self.n_comp = {r: self.meta[sk.META_RATIOS + j:sk.META_RATIOS + j + 1]
                       for j, r in enumerate(self.ratios)}
        self.e = buf(1, D)
        self.X = (buf(1, HC, D), buf(1, HC, D))  # HC streams, ping-pong between sublayers
        self.u_in, self.u_norm = buf(1, D), buf(1, D)
        self.post, self.comb = buf(1, HC), buf(1, HC, HC)
        self.cq, self.cq_norm = buf(1, cfg.q_rank), buf(1, cfg.q_rank)
        self.q = buf(1, H, K)
        self.kv = buf(1, K)
        self.kv_row = buf(1, kv_entry_bytes(K, cfg.rope_dim), dtype=np.uint8)
        widths = {cfg.coff(i) * K for i in range(cfg.n_layers) if cfg.ratio(i)}
        self.comp_in = {w: (buf(1, w), buf(1, w)) for w in widths}
        HI, DI = cfg.index_heads, cfg.index_dim
        self.idx_in = (buf(1, 2 * DI), buf(1, 2 * DI))
        self.qi, self.qi_rot = buf(1, HI, DI), buf(1, HI, DI)
        self.idx_w = buf(1, HI)
        n4 = max(1, self.capacity // 4)
        self.scores = buf(n4)
        self.sel = buf(cfg.index_topk, dtype=np.int32)
        self.no_sel = cuda.to_device(np.full(1, -1, np.int32), stream=s)
        self.no_comp = cuda.to_device(np.zeros((1, self.kv_row.shape[1]), np.uint8), stream=s)
        self.zero_count = cuda.to_device(np.zeros(1, np.int32), stream=s)
        self.ones = cuda.to_device(np.ones(max(K, D), f32), stream=s)  # weightless-norm dummy
        self.o = buf(1, H, K)
        G = cfg.o_groups
        self.y = buf(G, cfg.o_rank)
        self.f = buf(1, D)
        self.moe = MoEScratch.allocate(D, cfg.moe_dim, cfg.n_experts, cfg.n_experts_used, s)
        self.head_u, self.head_norm = buf(1, D), buf(1, D)
        self.logits = buf(1, cfg.vocab)

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    # ---- one step -------------------------------------------------------------------------------
    def launch_step(self, temperature: float = 0.0, top_p: float = 1.0) -> None:
        """Launch one decode step on the engine's stream (no host sync)."""
        cfg, s, w = self.cfg, self.stream, self.w
        nt, sim = self.nt, self.sim
        sk.begin_step(self.meta, self.ids, self.token, self.u, self.uniforms, self.ratio_arr,
                      cfg.window, s)
        embed(self.e, w.embed, self.token, s, threads=nt)
        broadcast_rows(self.X[0].reshape(cfg.hc_mult, cfg.dim), self.e, s, threads=nt)
        X = 0
        for i in range(cfg.n_layers):
            self._attention(i, self.X[X], self.X[1 - X])
            self._ffn(i, self.X[1 - X], self.X[X])
        if self.mem is not None:  # global-topk: the next step's set, scored on the device
            self.mem.end_of_step(s, nt)
        hc_head(self.head_u, self.X[X], *w.output_hc, cfg.rms_eps, cfg.hc_eps, s, threads=nt, **sim)
        rmsnorm(self.head_norm, self.head_u, w.output_norm, cfg.rms_eps, True, s, threads=nt, **sim)
        gemv(self.logits, w.output, self.head_norm, None, s, threads=nt)
        if temperature > 0:
            sample_top_p(self.next_token, self.logits.reshape(cfg.vocab), temperature, top_p,
                         self.u, s, threads=nt)
        else:
            argmax(self.next_token, self.logits.reshape(cfg.vocab), s, threads=nt)
        sk.end_step(self.meta, self.ids, self.next_token, s)

    def _attention(self, i: int, X, X_out) -> None:
        cfg, s, L, c = self.cfg, self.stream, self.w.layers[i], self.caches[i]
        nt, sim = self.nt, self.sim
        H, K, R, eps = cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.rms_eps
        u = self.u_norm
        hc_pre(self.u_in, self.post, self.comb, X, *L.hc_attn, eps, cfg.hc_eps, cfg.hc_iters, s,
               threads=nt, **sim)
        rmsnorm(u, self.u_in, L.attn_norm, eps, True, s, threads=nt, **sim)
        if self.mem is not None:  # a retriever target layer's x (§2 of flashmemory.md)
            self.mem.snapshot(i, u, s, nt)
        # the kv entry and the compressor on the side stream, beside the query and the indexer
        s2 = self.side.fork(s) if self.branches else s
        gemv(self.kv, L.kv, u, None, s2, threads=nt)
        rmsnorm(self.kv, self.kv, L.kv_norm, eps, True, s2, threads=nt, **sim)
        kv3 = self.kv.reshape(1, 1, K)
        rope(kv3, kv3, self.pos, L.freqs, False, s2, threads=nt, **sim)
        kv_pack(self.kv_row, self.kv, R, stream=s2, threads=nt)  # FP8 + the 584 B entry
        sk.store_row(c.window, self.kv_row, self.meta, s2)
        if c.ratio:
            a, g = self.comp_in[c.state_kv.shape[1]]
            gemv(a, L.comp_kv, u, None, s2, threads=nt)
            gemv(g, L.comp_gate, u, None, s2, threads=nt)
            compressor_step(c.state_kv, c.state_score, a.reshape(a.shape[1]),
                            g.reshape(g.shape[1]), L.comp_ape, self.pos, c.ratio,
                            cfg.is_csa(i), L.comp_norm, L.freqs, eps, MODE_KV_FP8, None, c.comp,
                            stream=s2, threads=nt)
        gemv(self.cq, L.q_a, u, None, s, threads=nt)
        rmsnorm(self.cq_norm, self.cq, L.q_a_norm, eps, True, s, threads=nt, **sim)
        gemv(self.q.reshape(1, H * K), L.q_b, self.cq_norm, None, s, threads=nt)
        q2 = self.q.reshape(H, K)
        rmsnorm(q2, q2, self.ones[:K], eps, False, s, threads=nt, **sim)  # weightless, per head
        rope(self.q, self.q, self.pos, L.freqs, False, s, threads=nt, **sim)
        if cfg.is_csa(i):
            self._indexer(i, L, c)
        if self.branches:
            self.side.join(s)
        scale = 1.0 / math.sqrt(K)
        if cfg.is_csa(i):
            attention_decode(self.o.reshape(H, K), q2, c.window, self.n_window, c.comp,
                             self.sel, self.n_comp[c.ratio], 0, L.sinks, scale, stream=s,
                             threads=nt)
        elif c.ratio:  # HCA: every emitted entry
            attention_decode(self.o.reshape(H, K), q2, c.window, self.n_window, c.comp,
                             self.no_sel, self.n_comp[c.ratio], 1, L.sinks, scale, stream=s,
                             threads=nt)
        else:
            attention_decode(self.o.reshape(H, K), q2, c.window, self.n_window, self.no_comp,
                             self.no_sel, self.zero_count, 0, L.sinks, scale, stream=s, threads=nt)
        rope(self.o, self.o, self.pos, L.freqs, True, s, threads=nt, **sim)
        G = cfg.o_groups
        gemv(self.y, L.out_a, self.o.reshape(G, H // G * K), self.w.group_ids, s, threads=nt)
        gemv(self.f, L.out_b, self.y.reshape(1, G * cfg.o_rank), None, s, threads=nt)
        hc_post(X_out, self.f, X, self.post, self.comb, s, threads=nt, **sim)

    def _indexer(self, i: int, L, c) -> None:
        """Emit this token's indexer key (every 4th token), score the visible keys, top-k."""
        cfg, s, u = self.cfg, self.stream, self.u_norm
        nt, sim = self.nt, self.sim
        HI, DI = cfg.index_heads, cfg.index_dim
        ia, ig = self.idx_in
        gemv(ia, L.idx_kv, u, None, s, threads=nt)
        gemv(ig, L.idx_gate, u, None, s, threads=nt)
        compressor_step(c.index_kv, c.index_score, ia.reshape(2 * DI), ig.reshape(2 * DI),
                        L.idx_ape, self.pos, c.ratio, True, L.idx_norm, L.freqs, cfg.rms_eps,
                        MODE_INDEX_FP4, None, c.index_keys, stream=s, threads=nt)
        gemv(self.qi.reshape(1, HI * DI), L.idx_q_b, self.cq_norm, None, s, threads=nt)
        rope(self.qi, self.qi, self.pos, L.freqs, False, s, threads=nt, **sim)
        hadamard_fp4(self.qi_rot, self.qi, True, stream=s, threads=nt, **sim)
        gemv(self.idx_w, L.idx_proj, u, None, s, threads=nt)
        sk.scale(self.idx_w, index_weight_scale(cfg), s)
        n = self.n_comp[c.ratio]
        scores = self.scores[:c.index_keys.shape[0]]
        indexer_scores(scores, self.qi_rot.reshape(HI, DI), self.idx_w.reshape(HI),
                       c.index_keys, n, stream=s, threads=nt)
        if self.mem is not None:  # top-k inside the Memory Indexer's resident set
            self.mem.mask_scores(scores, s)
        topk(self.sel, scores, n, cfg.index_topk, stream=s, threads=nt)
        sk.sort_selected(self.sel.reshape(1, cfg.index_topk), s)  # a repeatable order
        if self.mem is not None:  # (after the sort: the global set comes sorted already)
            self.mem.drop_selected(self.sel, s)

    def _ffn(self, i: int, X, X_out) -> None:
        cfg, s, L = self.cfg, self.stream, self.w.layers[i]
        nt, sim = self.nt, self.sim
        hc_pre(self.u_in, self.post, self.comb, X, *L.hc_ffn, cfg.rms_eps, cfg.hc_eps,
               cfg.hc_iters, s, threads=nt, **sim)
        rmsnorm(self.u_norm, self.u_in, L.ffn_norm, cfg.rms_eps, True, s, threads=nt, **sim)
        moe_layer(self.f, self.u_norm, L.router, L.bias, L.tid2eid, self.token,
                  int(cfg.is_hash_layer(i)), L.gate_up, None, L.down, L.shared_gate_up, None,
                  L.shared_down, cfg.swiglu_clamp[i], cfg.swiglu_clamp_shared[i],
                  cfg.routed_scale, self.moe, int(cfg.norm_topk), s, threads=nt,
                  side=self.side if self.branches else None)
        hc_post(X_out, self.f, X, self.post, self.comb, s, threads=nt, **sim)

    # ---- a sequence -----------------------------------------------------------------------------
    def start(self, prompt: list[int], uniforms: np.ndarray | None = None) -> None:
        """Reset the caches and load a prompt (and the sampling uniforms, one per generated
        token, drawn by the caller so that CPU and GPU sample alike)."""
        n = len(prompt)
        if not 0 < n <= self.capacity:
            raise InputError(f"prompt: {n} tokens, the engine holds 1..{self.capacity}")
        s = self.stream
        for c in self.caches:
            c.reset(s)
        ids = np.zeros(self.capacity + 1, np.int32)
        ids[:n] = prompt
        self.ids.copy_to_device(ids, stream=s)
        self.n_prompt = n
        self.set_position(0)
        if self.mem is not None:
            self.mem.reset(n)
        un = np.zeros(self.uniforms.shape, np.float32)
        if uniforms is not None:
            un[:len(uniforms)] = uniforms[:len(un)]
        self.uniforms.copy_to_device(un, stream=s)
        s.synchronize()

    def attach_memory(self, memory) -> None:
        """Run with a ``memory.MemoryIndexer`` (None: without); the step is captured anew."""
        from .memory import EngineMemory

        if (self.mem and self.mem.memory) is not memory:
            self.mem = EngineMemory(self, memory) if memory is not None else None
            self._graph = self._warm = None

    def set_position(self, pos: int) -> None:
        """The next step consumes position ``pos`` (after a prefill has filled the caches up to
        it); begin_step derives the counts from it."""
        meta = np.zeros(self.meta.shape, np.int32)
        meta[sk.META_POS], meta[sk.META_PROMPT] = pos, self.n_prompt
        self.meta.copy_to_device(meta, stream=self.stream)

    def prefill(self, chunk: int = 0):
        """The chunked prefill of this engine (buffers allocated on first use, for ``chunk``
        tokens; a different size reallocates them)."""
        from .prefill import DEFAULT_CHUNK, ChunkPrefill

        chunk = chunk or DEFAULT_CHUNK
        if self._prefill is None or self._prefill.T != chunk:
            self._prefill = None
            self._prefill = ChunkPrefill(self, chunk)
        return self._prefill

    def step(self, temperature: float = 0.0, top_p: float = 1.0, graph: bool = True) -> None:
        """One step. On a GPU the first step with given sampling settings runs eagerly (it
        compiles and lazily allocates), the second captures the step as a CUDA graph, and every
        later one replays it. The simulator, and ``graph=False``, launch eagerly."""
        if not graph or device.SIMULATOR:
            self.launch_step(temperature, top_p)
            return
        key = (float(temperature), float(top_p))
        if self._graph is None or self._graph[0] != key:
            if self._warm != key:
                self.launch_step(temperature, top_p)
                self._warm = key
                return
            self._graph = (key, device.capture_graph(
                [lambda: self.launch_step(temperature, top_p)], self.stream, warm=False))
        self._graph[1]()

    def generate(self, prompt: list[int], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, uniforms=None, eos_id: int | None = None,
                 on_token=None, sync_every: int = 16, graph: bool = True,
                 prefill_chunk: int | None = None, on_prefill=None, memory=None) -> dict:
        """Ingest ``prompt`` and generate up to ``max_tokens`` ids (stopping after ``eos_id``).

        The prompt but its last token goes through the chunked prefill (``prefill_chunk``
        tokens per chunk, default 512; 0: one decode step per token); the decode step then
        ingests the last one and samples. ``on_prefill(done, total, seconds)`` reports chunks.
        The host looks at the ids every ``sync_every`` steps (streaming them to ``on_token``);
        steps already launched past an end-of-sequence are discarded. ``memory``: a
        ``memory.MemoryIndexer`` (its cycles run between replays, see engine/memory.py).
        Returns tokens, timings and the stop reason.
        """
        n = len(prompt)
        steps_total = min(n + max_tokens - 1, self.capacity)
        self.attach_memory(memory)
        self.start(prompt, uniforms)
        t0 = time.perf_counter()
        if prefill_chunk != 0 and n > 1:
            report = on_prefill and (lambda done, _, s: on_prefill(done, n, s))
            self.prefill(prefill_chunk or 0).ingest(n - 1, report)
        else:
            for _ in range(n - 1):
                self.step(temperature, top_p, graph)
        self.step(temperature, top_p, graph)  # the step at pos n-1 yields the first generated id
        self.stream.synchronize()
        prefill_s = time.perf_counter() - t0
        if on_prefill:
            on_prefill(n, n, prefill_s)
        out, stop, t1, done = [], "max_tokens", time.perf_counter(), n
        while True:
            got = self.read_ids(n + len(out), done + 1)
            for tok in got.tolist():
                out.append(tok)
                if on_token:
                    on_token(tok)
                if eos_id is not None and tok == eos_id:
                    stop = "eos"
                    break
                if len(out) == max_tokens:
                    break
            if stop == "eos" or len(out) >= max_tokens:
                break
            if done >= steps_total:
                stop = "ctx"
                break
            for _ in range(min(sync_every, steps_total - done)):
                if self.mem is not None:
                    self.mem.begin(done)
                self.step(temperature, top_p, graph)
                done += 1
                if self.mem is not None:  # a cycle boundary: score, select, commit
                    self.mem.after_step(done)
        decode_s = time.perf_counter() - t1
        return dict(tokens=out, prefill_s=prefill_s, decode_s=decode_s,
                    decode_steps=done - n, stop=stop)

    def read_ids(self, start: int, stop: int) -> np.ndarray:
        """ids[start:stop] on the host (a sync)."""
        out = self.ids[start:stop].copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out

    def read_logits(self) -> np.ndarray:
        out = self.logits.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out[0]
