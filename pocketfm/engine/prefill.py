"""Chunked prefill on the GPU: the prompt in chunks of T tokens, each layer batched over the chunk.

A chunk runs the decode step's sublayers with every activation [T, ...] instead of [1, ...]::

    embed        e[T] = token_embd[ids[p0 .. p0+T)]; X = 4 copies
    per layer    HC pre, norms, q / kv as GEMMs over the chunk, RoPE at each token's position
                 (q's per-head norm and RoPE inside the attention's load of q),
                 kv packed into the chunk's 584 B entries; the compressors over the chunk
                 (compressor_chunk: every block the chunk completes, emitted into the caches);
                 on CSA layers the indexer scores each token's visible keys and keeps its
                 top-k (indexer_scores_chunk + topk_chunk); sink attention of every token over
                 the ring, the chunk's own earlier entries and its compressed entries
                 (attention_prefill), then the chunk enters the ring; the grouped output
                 projection as one GEMM per group; HC post. MoE: router GEMM, per-token routes,
                 the routed experts over the T·k (token, expert) rows grouped by expert
                 (expert_order + hmma.py's float16 tensor-core GEMM, one expert per block: each
                 expert's weights are read once per 32 of its rows; x read per token, the
                 SwiGLU inside the down's x preparation), the shared expert as GEMMs.
    no head      the chunk's logits are never needed: prefill stops one token short of the
                 prompt, and the decode step ingests the last prompt token and samples.

Every causal rule is per token (window, visible compressed entries, top-k among the visible),
so the result equals the decode step's token by token (tested in the simulator against the
NumPy forward). Chunks are launched eagerly from Python, ~1,000 launches per chunk (~20 ms of
launch time, small beside a chunk's work); their positions reach the kernels through one small
int32 table copied to the device per chunk. Buffers are allocated once, for the largest chunk.
"""
from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager

import numpy as np
from numba import cuda

from ..kernels import device
from ..kernels.device import SIMULATOR
from ..kernels.attention_prefill import attention_prefill, store_chunk_rows
from ..kernels.compressor import MODE_INDEX_FP4, MODE_KV_FP8, compressor_chunk
from ..kernels.embed_sample import embed
from ..kernels.gemv import DECODE_MAX_TOKENS, gemv
from ..kernels.hc import hc_post, hc_pre
from ..kernels.indexer import indexer_scores_chunk, takes_decoded_keys, topk_chunk
from ..kernels.indexer_mma import decode_keys
from ..kernels import hmma
from ..kernels.mma import expert_order, gemm_mma, supports
from ..kernels.moe import broadcast_rows, combine_chunk, route_chunk, swiglu_fused
from ..kernels.norm_rope import rmsnorm, rmsnorm_rope
from ..kernels.qat import hadamard_fp4, kv_pack
from ..plan import DEFAULT_PREFILL_CHUNK
from . import step_kernels as sk
from .device_weights import index_weight_scale
from .layout import (compressor_widths, hc_mix_shape, prefill_buffer_specs,
                     prefill_shared_buffers)


# the GEMMs that run beside the main chain on a side stream (``ChunkPrefill.branch_sites``):
# kv, the compressors' and the indexer's input GEMMs beside q_a; q_b beside the indexer's
# chain (CSA layers); the shared expert's gate|up beside the routing and the routed gate|up
BRANCH_SITES = ("attention inputs", "q_b", "shared expert")


class ChunkPrefill:
    """Prefill for one ``DecodeEngine`` (its weights and caches), chunks of up to ``chunk``."""

    def __init__(self, eng, chunk: int = DEFAULT_PREFILL_CHUNK):
        self.eng, self.cfg, self.T = eng, eng.cfg, int(chunk)
        # GEMMs of one prepared x that are independent of the main chain run beside it (the
        # small ones leave most SMs idle alone); only on hmma.py's path, whose GEMMs read the
        # main stream's prepared limbs and allocate nothing per stream
        self.side_a, self.side_b = device.SideStream(), device.SideStream()
        self.branches = True  # False: everything on the main stream (launch-by-launch timing)
        self.branch_sites = frozenset(BRANCH_SITES)  # which of them branch (an A/B: a subset)
        self.fold_q_norm_rope = True  # False: q's norm and RoPE as launches (an A/B)
        # 64: the routed gate+up and down, and the dense Q8_0 GEMMs, on hmma.py's 64-token
        # build (the experts over 64-row tiles): candidates, both slower in the chunk (H100,
        # 2026-12-05 (i): routed +3.2%, dense +1.1%; bench --prefill-ab times each;
        # POCKETFM_HMMA_T64=1 turns both on for a run)
        t64 = os.environ.get("POCKETFM_HMMA_T64", "") == "1"
        self.routed_tokens = self.dense_tokens = 64 if t64 else hmma.BN
        self._alloc()
        self._group_ids = {}  # T -> ids [G·T] of the group-major rows (g·T + t -> g)
        self._mix_views = {}  # T -> hc_pre's mix workspace for T tokens (a view of hc_mix)

    # ---- buffers, for the largest chunk; a shorter chunk takes views [:T] ----------------------
    def _alloc(self):
        """The buffers of layout.prefill_buffer_specs (what ``pocketfm plan`` counts), each the
        attribute of its name; pairs ``X.0`` / ``X.1`` become tuples, per-width / per-ratio
        buffers dicts."""
        eng, cfg = self.eng, self.cfg
        fills = dict(no_sel=-1, zeros_T=0, ones_T=1, sh_down=0)  # sh_down: no shared expert
        b = device.allocate(prefill_buffer_specs(cfg, eng.capacity, self.T), eng.stream, fills)
        self._buffers = list(b.values())
        for name, a in b.items():
            if "." not in name and "|" not in name:
                setattr(self, name, a)
        for name, views in prefill_shared_buffers(cfg, eng.capacity, self.T).items():
            for view, shape in views.items():
                setattr(self, view, b[name][:int(np.prod(shape))].reshape(shape))
        self.attn_keys = self.attn_keys.view(np.uint32)  # (bf16 pairs in a float32 buffer)
        self.idx_keys = self.idx_keys.view(np.uint32)
        self.X = (b["X.0"], b["X.1"])
        self.comp_in = {w: (b[f"comp_in.{w}.0"], b[f"comp_in.{w}.1"])
                        for w in compressor_widths(cfg)}
        self.comp_scratch = {r: b[f"comp_scratch.{r}"] for r in eng.ratios}
        self.idx_in = (b["idx_in.0"], b["idx_in.1"])
        hmma.use_workspace(eng.stream, self.f16_x)

    @contextmanager
    def settings(self, **values):
        """These attributes (branches, branch_sites, fold_q_norm_rope, routed_tokens,
        dense_tokens) set while inside, as they were after it (an A/B of the chunk; an unknown
        name raises AttributeError)."""
        before = {k: getattr(self, k) for k in values}
        try:
            for k, v in values.items():
                setattr(self, k, v)
            yield self
        finally:
            for k, v in before.items():
                setattr(self, k, v)

    def one_stream(self):
        """Every launch on the main stream while inside (profiling: each launch timed alone)."""
        return self.settings(branches=False)

    @property
    def nbytes(self) -> int:
        """Device bytes of the chunk buffers (the prefill's workspace)."""
        return sum(int(a.nbytes) for a in self._buffers)

    # ---- the prompt ----------------------------------------------------------------------------
    def ingest(self, n: int, progress=None, start: int = 0) -> float:
        """Run positions start .. n-1 (the tokens already in ``eng.ids``) through every layer,
        in chunks; the caches then hold them and the next decode step is position n. Returns
        seconds (synchronised). ``progress(done, n, seconds)`` as each chunk completes: the
        host waits for chunk c only once chunk c+1 is launched, so the GPU never idles while
        Python launches a chunk's ~1,000 kernels."""
        eng = self.eng
        t0 = time.perf_counter()
        queued = None  # (event after the previous chunk, its end position)
        for p0 in range(start, n, self.T):
            self.chunk(p0, min(self.T, n - p0))
            if progress:
                done = cuda.event()
                done.record(eng.stream)
                if queued:
                    queued[0].synchronize()
                    progress(queued[1], n, time.perf_counter() - t0)
                queued = (done, min(n, p0 + self.T))
        eng.set_position(n)
        eng.stream.synchronize()
        if queued:
            progress(queued[1], n, time.perf_counter() - t0)
        return time.perf_counter() - t0

    def chunk(self, p0: int, T: int) -> None:
        """Launch one chunk: tokens at positions p0 .. p0+T-1 (no host sync)."""
        eng, cfg, s = self.eng, self.cfg, self.eng.stream
        pos = np.arange(p0, p0 + T, dtype=np.int32)
        table = np.concatenate([[p0], pos, *[(pos + 1) // r for r in eng.ratios]]).astype(np.int32)
        self.table[:len(table)].copy_to_device(table, stream=s)
        self.pos0, self.pos, self.end = self.table[0:1], self.table[1:1 + T], p0 + T
        self.visible = {r: self.table[1 + (j + 1) * T:1 + (j + 2) * T]
                        for j, r in enumerate(eng.ratios)}
        tokens = eng.ids[p0:p0 + T]
        embed(self.e[:T], eng.w.embed, tokens, s, threads=eng.nt)
        X = self.X[0][:T]
        broadcast_rows(X.reshape(T * cfg.hc_mult, cfg.dim), self.e[:T], s, threads=eng.nt)
        a, b = self.X[0][:T], self.X[1][:T]
        for i in range(cfg.n_layers):
            self._attention(i, T, a, b)
            self._ffn(i, T, tokens, b, a)

    def _hc_mix(self, T: int):
        """HC pre's mix workspace: the mix as one GEMM over the chunk. None in the simulator,
        whose engine takes the serial HC kernel (a thread per token; the GEMM path and its
        finish kernel have their own simulator tests)."""
        if self.eng.sim:
            return None
        if T not in self._mix_views:  # (made once: a device-array view costs the host ~0.1 ms)
            shape = hc_mix_shape(T, self.cfg.hc_mult)
            self._mix_views[T] = self.hc_mix[:math.prod(shape)].reshape(shape)
        return self._mix_views[T]

    @staticmethod
    def _limbs_here(T: int) -> bool:
        """Whether a chunk of T tokens prepares hmma.py's x itself for the GEMMs that take it
        (not in the simulator, with POCKETFM_HMMA=0, or for few enough tokens for gemv's decode
        kernels)."""
        return hmma.ENABLED and not SIMULATOR and T > DECODE_MAX_TOKENS

    def _limbs(self, x, T: int):
        """hmma.py's float16 limbs of x [T, K] for the GEMMs that read it, made once (None:
        not _limbs_here)."""
        return hmma.prepare_x(x, self.eng.stream) if self._limbs_here(T) else None

    def _gemm(self, out, w, x, limbs, stream=None) -> None:
        """out = W · x: from x's prepared ``limbs`` where hmma.py takes the weight, else gemv
        (on the main stream: a side stream only takes GEMMs of limbs, see _beside)."""
        if limbs is not None and hmma.takes(w):
            hmma.gemm_hmma_prepared(out, w, limbs, stream=stream or self.eng.stream,
                                    tokens=self._dense_tokens(w))
        else:
            gemv(out, w, x, None, self.eng.stream, threads=self.eng.nt)

    def _dense_tokens(self, w) -> int:
        """Tokens a block of hmma.py's GEMM of the dense weight ``w`` (dense_tokens 64: its
        64-token build where it has one)."""
        return 64 if self.dense_tokens == 64 and w.qtype in hmma.KERNELS_T64 else hmma.BN

    def _beside(self, side, limbs, site: str):
        """The stream for GEMMs of ``limbs`` beside the main chain at ``site`` (BRANCH_SITES):
        ``side`` forked from the main stream now (after the limbs' preparation), or the main
        stream without limbs or with that site off."""
        if limbs is None or not self.branches or site not in self.branch_sites:
            return self.eng.stream
        return side.fork(self.eng.stream)

    def _attention(self, i: int, T: int, X, X_out) -> None:
        eng, cfg, s = self.eng, self.cfg, self.eng.stream
        L, c, nt, sim = eng.w.layers[i], eng.caches[i], eng.nt, eng.sim
        H, K, R, eps = cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.rms_eps
        u, cq, q, kv = self.u[:T], self.cq[:T], self.q[:T], self.kv[:T]
        hc_pre(self.u_in[:T], self.post[:T], self.comb[:T], X, *L.hc_attn, eps, cfg.hc_eps,
               cfg.hc_iters, s, threads=nt, mix=self._hc_mix(T), norm=(u, L.attn_norm), **sim)
        # every GEMM that reads u first, on one preparation of its limbs (the next GEMM's x
        # preparation, q_b's, overwrites them): q_a and its norm on the main stream, kv and
        # the compressors' on side_a, the indexer's on side_b, joined before q_b
        xu = self._limbs(u, T)
        sa = self._beside(self.side_a, xu, "attention inputs")
        sb = self._beside(self.side_b, xu, "attention inputs")
        self._gemm(kv, L.kv, u, xu, sa)
        if c.ratio:
            a, g = (x[:T] for x in self.comp_in[c.state_kv.shape[1]])
            self._gemm(a, L.comp_kv, u, xu, sa)
            self._gemm(g, L.comp_gate, u, xu, sa)
        if cfg.is_csa(i):
            ia, ig = (x[:T] for x in self.idx_in)
            self._gemm(ia, L.idx_kv, u, xu, sb)
            self._gemm(ig, L.idx_gate, u, xu, sb)
            self._gemm(self.idx_w[:T], L.idx_proj, u, xu, sb)
        self._gemm(cq, L.q_a, u, xu)
        rmsnorm(cq, cq, L.q_a_norm, eps, True, s, threads=nt, **sim)
        if xu is not None:
            self.side_a.join(s)
            self.side_b.join(s)
        # cq's limbs made once, for q_b and the indexer's q_b; on CSA layers q_b beside the
        # indexer's chain (its top-k passes leave the tensor cores idle), joined before the
        # attention (nothing on the main stream prepares an x until then)
        xc = self._limbs(cq, T)
        sq = self._beside(self.side_a, xc, "q_b") if cfg.is_csa(i) else s
        self._gemm(q.reshape(T, H * K), L.q_b, cq, xc, sq)
        # (q's per-head weightless RMSNorm and RoPE, and the output's inverse RoPE: inside
        # the attention, ``q_norm_rope``)
        kv3 = kv.reshape(T, 1, K)
        rmsnorm_rope(kv3, kv3, L.kv_norm, eps, True, self.pos, L.freqs, s, threads=nt, **sim)
        rows = self.kv_rows[:T]
        kv_pack(rows, kv, R, stream=s, threads=nt, **sim)  # the chunk's own 584 B entries
        comp = eng.comp_of(i)  # (KV swap: the CSA layers' rows of the host pool)
        if c.ratio:  # every block the chunk completes lands in comp before attention reads it
            compressor_chunk(c.state_kv, c.state_score, a, g, L.comp_ape, self.pos0, c.ratio,
                             cfg.is_csa(i), L.comp_norm, L.freqs, eps, MODE_KV_FP8, None, comp,
                             scratch=self.comp_scratch[c.ratio], stream=s, threads=nt)
        o = self.o[:T]
        args = (o, q, c.window, rows)
        scale = 1.0 / math.sqrt(K)
        opts = dict(stream=s, threads=nt, keys=self.attn_keys,
                    q_norm_rope=(eps, self.pos, L.freqs), fold_q_norm_rope=self.fold_q_norm_rope)
        if cfg.is_csa(i):
            sel = self._indexer(i, T, L, c, xc)
            if xc is not None:
                self.side_a.join(s)
            attention_prefill(*args, comp, sel, self.visible[c.ratio], 0, self.pos0, L.sinks,
                              scale, **opts)
        elif c.ratio:  # HCA: every visible entry
            attention_prefill(*args, comp, self.no_sel[:T], self.visible[c.ratio], 1,
                              self.pos0, L.sinks, scale, **opts)
        else:
            attention_prefill(*args, eng.no_comp, self.no_sel[:T], self.zeros_T[:T], 0,
                              self.pos0, L.sinks, scale, **opts)
        store_chunk_rows(c.window, rows, self.pos0, stream=s, threads=nt)
        f = self.f[:T]
        self._output_projection(i, T, o, f)
        hc_post(X_out, f, X, self.post[:T], self.comb[:T], s, threads=nt, **sim)

    def _output_projection(self, i: int, T: int, o, f) -> None:
        """f = out_b · y, y[t, g] = out_a[g] · o[t, g]: out_a over the rows in group-major order,
        so that the expert-indexed GEMM's token tiles each hold one group (one weight). On
        hmma.py's kernel the x preparations read o and y_groups in the order they are written
        (no transposes); else o goes to group-major order and y back to token-major."""
        cfg, s, nt = self.cfg, self.eng.stream, self.eng.nt
        L, G = self.eng.w.layers[i], cfg.o_groups
        o3 = o.reshape(T, G, o.shape[1] // G * o.shape[2])
        y_g = self._view(self.y_groups, G, T)
        if T not in self._group_ids:
            self._group_ids[T] = cuda.to_device(np.repeat(np.arange(G, dtype=np.int32), T),
                                                stream=s)
        if self._limbs_here(T) and hmma.takes(L.out_a) and hmma.takes(L.out_b):
            hmma.gemm_hmma_prepared(y_g.reshape(G * T, cfg.o_rank), L.out_a,
                                    hmma.prepare_x_group_major(o3, s), self._group_ids[T], stream=s,
                                    tokens=self._dense_tokens(L.out_a))
            hmma.gemm_hmma_prepared(f, L.out_b, hmma.prepare_x_token_major(y_g, s), stream=s,
                                    tokens=self._dense_tokens(L.out_b))
            return
        o_g = self._view(self.o_groups, G, T)
        sk.swap_leading(o_g, o3, s)
        gemv(y_g.reshape(G * T, cfg.o_rank), L.out_a, o_g.reshape(G * T, o_g.shape[2]),
             self._group_ids[T], s, threads=nt)
        sk.swap_leading(self.y[:T], y_g, s)
        gemv(f, L.out_b, self.y[:T].reshape(T, G * cfg.o_rank), None, s, threads=nt)

    @staticmethod
    def _view(full, G: int, T: int):
        """The first G·T rows of a [G, Tmax, n] buffer as a contiguous [G, T, n] array."""
        n = full.shape[2]
        return full.reshape(G * full.shape[1] * n)[:G * T * n].reshape(G, T, n)

    def _indexer(self, i: int, T: int, L, c, xc):
        """Each token's top-k visible compressed entries, sel[T, k] (-1 pads); ``xc``: cq's
        prepared limbs (or None)."""
        eng, cfg, s, nt, sim = self.eng, self.cfg, self.eng.stream, self.eng.nt, self.eng.sim
        HI, DI = cfg.index_heads, cfg.index_dim
        ia, ig = (x[:T] for x in self.idx_in)  # (its GEMMs on u ran with the attention's)
        keys = eng.keys_of(i)  # (KV swap, a non-target layer: its rows of the host key pool)
        # on a GPU the keys are decoded once (for every scoring pass, host-pool keys read once
        # over the bus); else host-pool keys keep the register tiles (each key read once per
        # block, not once per warp) and device keys take the launcher's choice
        decoded = takes_decoded_keys(HI, DI)
        use_mma = None if decoded or c.index_keys is not None else False
        compressor_chunk(c.index_kv, c.index_score, ia, ig, L.idx_ape, self.pos0, c.ratio, True,
                         L.idx_norm, L.freqs, cfg.rms_eps, MODE_INDEX_FP4, None, keys,
                         scratch=self.idx_scratch, stream=s, threads=nt)
        qi, qi_rot, w = self.qi[:T], self.qi_rot[:T], self.idx_w[:T]
        self._gemm(qi.reshape(T, HI * DI), L.idx_q_b, self.cq[:T], xc)
        hadamard_fp4(qi_rot, qi, True, stream=s, threads=nt, rope=(self.pos, L.freqs), **sim)
        sk.scale(w, index_weight_scale(cfg), s)
        n_keys = max(1, self.end // c.ratio)  # entries visible to the chunk's last token
        key_ws = decode_keys(self.idx_keys, keys, n_keys, s) if decoded else None
        rows = max(1, min(T, self.scores.shape[0] // n_keys))
        visible, sel = self.visible[c.ratio], self.sel[:T]
        # q_fp4: hadamard_fp4(..., True) left qi_rot on the FP4 grid (exact in bf16)
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            scores = self.scores[:(t1 - t0) * n_keys].reshape(t1 - t0, n_keys)
            indexer_scores_chunk(scores, qi_rot[t0:t1], w[t0:t1], keys, visible[t0:t1],
                                 stream=s, threads=nt, mma=use_mma, q_fp4=True,
                                 key_ws=key_ws)
            topk_chunk(sel[t0:t1], scores, visible[t0:t1], cfg.index_topk, stream=s,
                       threads=nt)
        sk.sort_selected(sel, s)  # a repeatable order for the attention's sums
        return sel

    def _ffn(self, i: int, T: int, tokens, X, X_out) -> None:
        eng, cfg, s = self.eng, self.cfg, self.eng.stream
        L, nt, sim, k = eng.w.layers[i], eng.nt, eng.sim, cfg.n_experts_used
        v = self.u[:T]
        hc_pre(self.u_in[:T], self.post[:T], self.comb[:T], X, *L.hc_ffn, cfg.rms_eps,
               cfg.hc_eps, cfg.hc_iters, s, threads=nt, mix=self._hc_mix(T),
               norm=(v, L.ffn_norm), **sim)
        ids, w = self.route_ids[:T], self.route_w[:T]
        shared = self.sh_down[:T]  # stays zero when the model has no shared expert
        sgu = self.sh_gate_up[:T]
        xv = self._limbs(v, T)  # the router's, the shared expert's and the routed gate|up's x
        grouped = not SIMULATOR and supports(L.gate_up) and supports(L.down)
        if grouped and hmma.takes(L.gate_up) and hmma.takes(L.down) and \
                L.shared_gate_up is not None:  # the shared gate|up first, while xv holds v,
            # beside the router, the routing, expert_order and the routed gate|up (sgu: o's
            # buffer, which this path leaves alone: it writes no x_rep or h)
            self._gemm(sgu, L.shared_gate_up, v, xv,
                       self._beside(self.side_a, xv, "shared expert"))
        self._gemm(self.router[:T], L.router, v, xv)
        route_chunk(ids, w, self.router[:T], L.bias, L.tid2eid, tokens,
                    int(cfg.is_hash_layer(i)), cfg.routed_scale, int(cfg.norm_topk), s,
                    threads=nt)
        # routed experts: row t·k + j is token t through expert ids[t, j], weight w[t, j]
        Tk = T * k
        x_rep, gu, h, down = self.x_rep[:Tk], self.gate_up[:Tk], self.h[:Tk], self.down[:Tk]
        flat_ids = ids.reshape(Tk)
        # on a GPU: tensor cores over the rows grouped by expert, so each expert's weight tile
        # is filled once for all its rows (the simulator keeps the expert-indexed GEMV); in
        # hmma.py's kernel x is read per token (no copies) and the down's x is made
        # from gate|up through the SwiGLU in its preparation (no h)
        on_hmma = grouped and hmma.takes(L.gate_up) and hmma.takes(L.down)
        gu64, dn64 = (on_hmma and self.routed_tokens == 64 and m.qtype in hmma.KERNELS_T64
                      for m in (L.gate_up, L.down))
        if grouped:
            # 32-row tiles for the GEMMs on 32-token kernels, 64-row ones for those on hmma's
            # 64-token build: tiles are spans of each expert's positions in order, whatever the
            # order inside a group, so a second grouping leaves the first one's tiles valid
            order, tiles = self.route_order[:Tk], self.route_tiles
            if not (gu64 and dn64):
                expert_order(order, flat_ids, L.gate_up.experts, s, tiles=tiles)
            if gu64 or dn64:
                expert_order(order, flat_ids, L.gate_up.experts, s, tiles=self.route_tiles64,
                             tile=64)
        if on_hmma:
            xg = xv if xv is not None else hmma.prepare_x(v, s)
            gu_tiles, gu_tokens = (self.route_tiles64, 64) if gu64 else (tiles, hmma.BN)
            hmma.gemm_hmma_prepared(gu, L.gate_up, xg, flat_ids, order, s, tiles=gu_tiles,
                                    x_div=k, tokens=gu_tokens)
            if xv is not None:  # (the shared gate|up read xv: before the SwiGLU's x reuses it)
                self.side_a.join(s)
            h_limbs = hmma.prepare_x_swiglu(gu, w.reshape(Tk), cfg.swiglu_clamp[i], s)
            dn_tiles, dn_tokens = (self.route_tiles64, 64) if dn64 else (tiles, hmma.BN)
            hmma.gemm_hmma_prepared(down, L.down, h_limbs, flat_ids, order, s, tiles=dn_tiles,
                                    tokens=dn_tokens)
        else:
            broadcast_rows(x_rep, v, s, threads=nt)
            if grouped:
                gemm_mma(gu, L.gate_up, x_rep, flat_ids, order, s, tiles=tiles)
            else:
                gemv(gu, L.gate_up, x_rep, flat_ids, s, threads=nt)
            swiglu_fused(h, gu, w.reshape(Tk), cfg.swiglu_clamp[i], s, threads=nt)
            if grouped:
                gemm_mma(down, L.down, h, flat_ids, order, s, tiles=tiles)
            else:
                gemv(down, L.down, h, flat_ids, s, threads=nt)
            if L.shared_gate_up is not None:
                gemv(sgu, L.shared_gate_up, v, None, s, threads=nt)
        if L.shared_gate_up is not None:
            sh = self.sh_h[:T]
            swiglu_fused(sh, sgu, self.ones_T[:T], cfg.swiglu_clamp_shared[i], s, threads=nt)
            gemv(shared, L.shared_down, sh, None, s, threads=nt)
        f = self.f[:T]
        combine_chunk(f, down.reshape(T, k, cfg.dim), shared, s, threads=nt)
        hc_post(X_out, f, X, self.post[:T], self.comb[:T], s, threads=nt, **sim)
