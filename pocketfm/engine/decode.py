"""The V4 decode step on the GPU: a fixed sequence of kernel launches over state allocated once.

One step consumes the token at ``meta[pos]`` and, once the prompt is in, writes the next one::

    begin_step   token = ids[pos]; window / compressed counts; the step's sampling uniform
    embed        e = token_embd[token]; X = 4 copies (HC streams)
    per layer    attention sublayer (HC pre, norms, q / kv, RoPE, FP8 pack into the window ring,
                 compressor + indexer on CSA layers, sink attention over packed entries,
                 inverse RoPE, grouped output projection), then the MoE sublayer; each
                 sublayer's HC post is made by the next HC pre's mix launch (hc_pre's
                 ``post_from``), the last one before the head
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

import contextlib
import math
import time

import numpy as np
from numba import cuda

from ..config import ModelConfig
from ..errors import InputError
from ..kernels import device
from ..kernels.attention import MMA_TILES, attention_decode
from ..kernels.compressor import MODE_INDEX_FP4, MODE_KV_FP8, compressor_step
from ..kernels.embed_sample import argmax, embed, sample_top_p
from ..kernels.gemv import (XLW, gemv, gemv_q8_0, grid_waves, grid_waves_or_not,
                            limbs_kernel, q8_0_limbs,
                            simulator_prefers_rows, takes_limbs, takes_norm)
from ..kernels.hc import MAX_PARTS, gram_path, hc_head, hc_post, hc_pre
from ..kernels.indexer import default_topk_workspace, indexer_scores, topk
from ..kernels.indexer_query import fits as fits_indexer_query, indexer_query
from ..kernels.indexer_warp import fits_warp
from ..kernels.l2_prefetch import prefetch_l2
from ..kernels.moe import MoEScratch, broadcast_rows, moe_layer
from ..kernels.norm_rope import rmsnorm, rmsnorm_rope
from ..kernels.qat import hadamard_fp4, kv_pack
from ..plan import DEFAULT_PREFILL_CHUNK
from . import step_kernels as sk
from ..weights import Weights
from .device_weights import DeviceWeights, GGUFSource, index_weight_scale
from .layout import compressor_widths, layer_specs, step_buffer_specs, total_bytes


NEG_INF_BITS = int(np.array(-np.inf, np.float32).view(np.uint32))  # 0xFF800000


class LayerCache:
    """One layer's device-resident cache: window ring, compressed entries, compressor state.

    The arrays and their shapes are engine/layout.py's ``layer_specs`` (what ``pocketfm plan``
    adds up); those the layer type lacks stay None. ``gpu_chunks`` (KV swap): a CSA layer has
    no ``comp`` here, its entries live in the engine's staging and host pool (kvswap.py)."""

    def __init__(self, cfg: ModelConfig, i: int, capacity: int, stream,
                 gpu_chunks: int | None = None, swap_keys: bool = False):
        self.ratio = cfg.ratio(i)
        self.window = self.comp = self.state_kv = self.state_score = None
        self.index_keys = self.index_kv = self.index_score = None
        for spec in layer_specs(cfg, i, capacity, swap=gpu_chunks is not None,
                                swap_keys=swap_keys):
            setattr(self, spec.name, cuda.device_array(spec.shape, spec.dtype, stream=stream))

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
                 stream=None, progress=None, swap=None):
        """``swap``: a kvswap.config.SwapPlanConfig (KV swap when ``enabled``: the CSA layers'
        compressed KV — and the indexer keys of its ``key_layers`` — in a pinned host pool, the
        selected chunks in ``gpu_chunks`` staging slots; ``cap_mib`` / ``validate`` / ``sync``
        as engine/kvswap.py reads them); None: every cache on the GPU."""
        if not qat:
            raise InputError("--no-qat: the CUDA backend stores the packed FP8/FP4 caches, which "
                             "need QAT on; run --no-qat with --device cpu")
        self.cfg, self.capacity = cfg, capacity
        self.stream = stream or cuda.stream()
        s = self.stream
        source = GGUFSource(weights, s) if isinstance(weights, Weights) else weights
        self.w = DeviceWeights(cfg, source, progress)
        slots = swap.gpu_chunks if swap is not None and swap.enabled else None
        key_layers = set(swap.key_layers) if slots is not None else set()
        self.caches = [LayerCache(cfg, i, capacity, s, gpu_chunks=slots,
                                  swap_keys=i in key_layers) for i in range(cfg.n_layers)]
        self.swap = None  # engine/kvswap.py, when the compressed KV is swapped
        if slots is not None:
            from .kvswap import EngineSwap

            self.swap = EngineSwap(self, slots, swap.region, swap.cap_mib, swap.validate,
                                   swap.sync, swap.key_layers)
        self.ratios = sorted({cfg.ratio(i) for i in range(cfg.n_layers)} - {0})
        self._alloc_step_buffers()
        self._graph, self._warm, self._prefill = None, None, None
        self.n_prompt = 0
        self.mem = None  # engine/memory.py: the Memory Indexer's resident set, when attached
        # The simulator runs each thread as a Python thread: small blocks, thread-per-row GEMVs
        # and the serial forms of the norm / RoPE / HC / Hadamard / attention kernels (their fast
        # forms have their own tests) keep a simulated step in seconds. On a GPU every launcher
        # picks its own shape and the fast kernels.
        self.nt = 32 if device.SIMULATOR else None
        self.sim = {"naive": True} if device.SIMULATOR else {}
        # independent parts of a step run on other streams: concurrent branches of the captured
        # graph (``branches = False``: one stream, e.g. to profile). Beside the main stream's
        # query and indexer: the kv entry on ``side`` (the compressor and HC's post + comb on
        # streams of their own, below); the attention heads' q_b + norm + RoPE on ``side_q``,
        # the indexer's keys on ``side_idx`` (its head weights on ``side_w``), so that the query,
        # the indexer's query and its keys are made at once (each of these chains is ~20 µs of
        # small launches on a CSA layer). The shared expert runs beside the routed ones on
        # ``side``.
        self.side, self.branches = device.SideStream(), True
        self.side_q, self.side_idx = device.SideStream(), device.SideStream()
        # HC pre's post + Sinkhorn comb (one thread's ~17.5 µs under ncu, H100, 2026-12-06 (o))
        # on a stream of their own (``side_post``): on ``side`` they delayed the kv entry and the
        # compressor (or the shared expert) forked after them, and on the HCA layers that branch
        # ended ~15 µs after the query, the attention waiting for it; and the compressor on a
        # branch of its own (``side_comp``) beside the kv entry's. H200, 43 layers, --decode-ab:
        # 8.983 ms with both against 9.320 without, 9.255 / 9.078 with one (2026-12-06 (p))
        self.side_post, self.side_comp = device.SideStream(), device.SideStream()
        self.post_own_stream = True
        self.compressor_own_stream = True
        # on the CSA layers the q_a norm made by both its readers, the idx_q_b GEMV
        # (gemv(norm=): each warp normalises the x it holds) and q_b's limbs on the side stream
        # (q8_0_limbs(norm=)), no RMSNorm launch on the indexer's path (5.5 µs alone, ncu,
        # H100); and the indexer's head weights (idx_proj, its scale) on a branch of their own
        # (``side_w``) beside its keys', which otherwise bound the indexer's path (~26 µs of
        # kernels after u, against ~27 on the main stream). H200, 43 layers: 8.891 ms with the
        # two streams above against 8.983 (9.298 against 9.320 alone, 2026-12-06 (p))
        self.side_w = device.SideStream()
        self.q_a_norm_in_readers = True
        # the q_a norm inside q_b's x preparation, where q_b takes the dp4a kernel (one launch
        # fewer on the query's path), on the layers without an indexer ("non-csa"): there q_b
        # is on the path; on CSA layers it runs beside the indexer, whose path the fold would
        # lengthen (True: every layer, a slower candidate; False: the norm's own launch). H100,
        # 30 layers, bench --decode-ab: 7.795 / 7.655 against 7.814 / 7.678 ms (2026-12-05 (j))
        self.fold_q_a_norm = "non-csa"
        # HC pre's u block: None, its own choice (V4: 1024 threads, the norm from registers);
        # 512: the block before that (two-pass norm), for bench --decode-ab
        self.hc_u_threads = None
        # HC pre's u block loading its stream values before the mix partials
        # (hc._hc_pre_finish_u4: one wait on memory where there were two in a row) and HC
        # post + mix with every load first (hc._hc_post_mix_split4), both twice a layer on the
        # critical path (the graph's kernels under ncu, H200: 10.8-11.1 and 6.7-7.1 µs,
        # 2026-12-06 (m)). H100, 30 layers, bench --decode-ab: 7.328 ms with both against
        # 7.554 without, 7.455 / 7.437 with one (2026-12-06 (n)); False: the kernels before.
        # (Both apply where hc_u_gram does not: the u block's one-block path.)
        self.hc_u_prefetch = True
        self.hc_mix_prefetch = True
        # HC pre's u and its norm made by D / 512 blocks instead of one, the norm's sum of
        # squares from the streams' Gram matrix, whose partials the split mix leaves beside its
        # own (hc._hc_mix_gram4, _hc_pre_u_gram4): the one block was ~20k cycles of one SM
        # (ncu, H100: 12.4 µs, twice a layer, 2026-12-06 (n)); False: the one block (above)
        self.hc_u_gram = True
        # the MoE's output left in parts (the routed rows and the shared one) for the next
        # layer's Gram mix to add as it makes the HC post: no combine launch on the path
        # (moe_layer without out), where the next HC pre takes the Gram path; the same sums in
        # the same order. H100, 30 layers, --decode-ab: 7.231 against 7.301 ms (2026-12-06 (n))
        self.moe_parts = True
        # (removed candidates, H100, 30 layers, --decode-ab, 2026-12-06: the routing in the
        # router GEMV's last block 7.134, q_a + its norm + q_b's limbs in one launch 7.207
        # against 7.023 ms: the last block's serial tail after a fence cost more than the
        # launch it saved)
        # the CUDA-core split attention of two heads a warp (where attn_head_warps, below, is
        # off) loading its next tile's packed words while it scores this one, a tile's words
        # all at once (attention._split_kernel prefetch); False: each tile loaded after the last
        # is scored, four words a thread at a time. attn_split_tiles: its least tiles a split
        # (None: attention.SPLIT_TILES; the head-warp kernel's: 1)
        self.attn_prefetch = True
        self.attn_split_tiles = None
        # that split attention with one head a warp over 32-slot tiles, 512 threads a block
        # (attention._head_warp_kernel): a warp's serial chain, which sets the kernel's ~20 µs
        # whatever the keys (Nsight, H100, BENCHMARKS 2026-12-07 (x)), about halved. Alone, CSA
        # 128 + 512: 20.7 against 21.7 µs with its combine (at 2 tiles a split 30.9; H100,
        # graphs of 20, 2026-12-07 (y)); H100, 30 layers, --decode-ab, two calls: 5.964 /
        # 5.949 against 6.012 / 6.006 ms (2026-12-07 (z)). False: two heads a warp over 16-slot
        # tiles (the attn_prefetch / attn_split_tiles kernel)
        self.attn_head_warps = True
        # that kernel holding its decoded tile as bf16 (every value exact there): its 16 heads
        # read the whole tile from shared memory twice, 2 MB a block in float32, ~8 µs at 128
        # bytes a cycle (attention._head_warp_kernel BF16). Alone (with the combine), CSA 128 +
        # 512: 19.7 against 20.7 µs; H100, 30 layers, --decode-ab: 5.893 against 5.911 ms
        # (2026-12-07 (z)). False: the tile in float32
        self.attn_bf16_tile = True
        # HCA's tensor-core split attention moving q and its partials through shared memory in
        # coalesced runs, the CUDA-core one (CSA, window-only) its partials (attention_decode
        # staged; False: straight between registers and memory); attn_mma_tiles: the tensor-core
        # one's 16-slot tiles a split (3: 6.483 against 6.534 ms at 4, H100, 30 layers,
        # --decode-ab, 2026-12-06 (r); 2 tiles, 64 splits, 6.330 against 6.297, 2026-12-07
        # (w); CSA's on the tensor cores too, at 1 or 2 tiles a split: 6.449 / 6.435 against
        # 6.436 ms, nil, removed)
        self.attn_staged = True
        self.attn_mma_tiles = MMA_TILES
        # the attention's combine with the splits spread over this many groups of a block's
        # threads, every partial's load issued at once (attention._spread_combine): alone, at
        # P = 20 / 46 / 64 splits, 4.7 / 5.2 / 5.6 µs against 6.9 / 10.7 / 13.6 for a thread a
        # dim, 16 loads at a time (0); 2 groups 5.1-6.1, 8 groups 5.5-7.0 (H100, graphs of
        # 20, BENCHMARKS 2026-12-06 (v)); in the step 6.297 ms against 6.430 a thread a dim,
        # 6.311 / 6.319 at 2 / 8 groups (H100, 30 layers, --decode-ab, 2026-12-07 (w))
        self.attn_combine_groups = 4
        # the Q8_0 dp4a GEMVs' x limbs four threads a chunk (False: one, for bench --decode-ab)
        self.limbs_by_words = True
        # the persistent decode GEMVs' grids at 0.9 of a wave of blocks (gemv.grid_waves):
        # room for the side streams' blocks beside them: 5.967 against 5.977 / 5.979 ms at a
        # full wave, twice (0.75: 5.977; H100, 30 layers, BENCHMARKS 2026-12-07 (ab))
        self.gemv_waves = 0.9
        # the side streams' small GEMVs (the kv entry's, the compressors', the indexer keys' and
        # weights') at a quarter of a wave, leaving the main stream's kernels more of the SMs:
        # 5.839 against 5.863 ms a step (H100, 30 layers, one process, BENCHMARKS 2026-12-07
        # (ac); None: gemv_waves, as before). The MoE's shared expert's GEMVs at half a wave
        # beside the routed chain measured nil (5.864) and stay at gemv_waves.
        self.side_gemv_waves = 0.25
        # a candidate: the CSA layers' q_b (35.7 MB, on its branch beside the indexer's query,
        # scores and top-k, the longer path to the attention) at a smaller share of a wave,
        # leaving the indexer's kernels more of the SMs (None: gemv_waves)
        self.side_q_b_waves = None
        # the indexer's scores by one warp holding every head (indexer_warp.indexer_scores_warp)
        # instead of a warp per 16 heads, which also counts the top-k's first radix digit (not
        # with the Memory Indexer's mask between the two): 7.678 against 7.814 / 7.707 ms
        self.indexer_one_warp = True
        self.scorer_counts_first_digit = True
        # (the top-k's write-out placed from counts each block left before the second digit's
        # grid barrier, one barrier fewer, measured slower: 5.942 against 5.918 ms a step, H100,
        # 30 layers, BENCHMARKS 2026-12-07 (aa); removed)
        # (that scorer on int8 MMAs, one m16n8k32 a 32-dim block with the same scores bit for
        # bit, measured slower twice: 20.1 against 15.1 µs alone, 6.270 against 6.212 ms a
        # step, H100, 2026-12-07 (w); removed)
        # attn_output_a's weights (the names of these output projections: "out_a", "out_b")
        # requested into L2 by 8 blocks on a stream of their own beside the attention and its
        # combine (~30-47 µs a layer that leave DRAM idle), so that its GEMV reads L2
        # (l2_prefetch.py; () none). out_a took 18.6-20.0 µs for its 35.6 MB under ncu (H100,
        # 2026-12-06 (p)). H100, 30 layers, --decode-ab, one process: 6.575 ms against 6.744
        # without, 6.660 / 6.679 / 6.713 by 4 / 16 / 24 blocks (more take the attention's SMs;
        # 2 blocks 7.471: the branch, joined after out_b, ends late); out_b's weights too
        # 6.826-6.839 (71 MB: more than L2 keeps)
        self.side_pf = device.SideStream()
        self.l2_prefetch = ("out_a",)
        self.l2_prefetch_blocks = 8
        # the next layer's q_a weights (4.4 MB, 8.3 µs on every attention layer's path) the
        # same way beside the MoE's HC pre, router and routing (~26 µs), joined at the MoE's
        # end: H100, 30 layers, --decode-ab, one process, 2026-12-06 (q): 6.538 against 6.573
        # ms without; with the next q_b too 6.686 (the routed experts' ~43 MB pass through L2
        # between), and q_b's and idx_q_b's from the attention sublayer's start 6.785
        self.l2_prefetch_next = ("q_a",)
        # (the first 15-45% of out_b's rows after out_a's, or of the next q_b's with its q_a:
        # 5.880-6.009 / 5.885-5.930 against 5.888 ms, H100, 30 layers, 2026-12-07 (z); removed)
        # attn_output_a's x limbs made by the attention's combine (one launch fewer on every
        # layer's path), where out_a runs the dp4a kernel: 7.803 / 7.653 against 7.814 / 7.678
        self.limbs_in_combine = True
        # candidate: the indexer query's Hadamard + FP4 a warp a vector (DI compiled in; the
        # prefill's kernel) instead of a block a vector (None: the launcher's pick, the block):
        # 7.816 / 7.675 against 7.814 / 7.678 ms, nil
        self.hadamard_warp = None
        # the indexer query's GEMV, RoPE, Hadamard and FP4 in one launch, a block a head
        # (kernels/indexer_query.py; where idx_q_b is a float weight a warp holds); False: the
        # GEMV, then hadamard_fp4 (12.4 + 8.2 µs on every CSA layer's path, ncu, H100,
        # 2026-12-06 (p)). H100, 30 layers, --decode-ab, one process: 6.230 against 6.297 ms
        # (BENCHMARKS 2026-12-07 (w))
        self.idx_query_one_launch = True
        # (that launch with each head over 2-8 blocks, the head's last block finishing the
        # Hadamard: 14.9-15.8 against 15.3 µs alone, 5.874-5.926 against 5.888 ms a step, H100,
        # 2026-12-07 (z); removed)
        # that launch also writes q's bf16 pairs in the one-warp scorer's fragment order, which
        # the scorer then loads straight into its registers instead of staging q through shared
        # memory (its staging: 47% of its samples in the step, Nsight, H100, BENCHMARKS
        # 2026-12-07 (x)). H100, 30 layers, --decode-ab, two calls: 5.929 / 5.928 against 6.012
        # / 6.006 ms, ~6 µs a CSA layer (2026-12-07 (z)); False: q staged by the scorer
        self.scorer_q_fragments = True
        # the routed experts' fused IQ2_XXS gate+up on the int8 tensor cores
        # (kernels/imma_iq2_xxs.py: one MMA a 16 x 32 tile, the codes by two lookups and two byte
        # permutes) instead of the dp4a GEMV, whose issue slots bound it (ncu, (j)): 10.257
        # against 10.366 ms a step, H200, 43 layers (2026-12-06 (l)); False: the dp4a GEMV, or
        # the name of one of imma_iq2_xxs.CANDIDATES' builds: "sm3", one block an SM of three
        # tiles' warps sharing a table copy a lane, 27.1 against 28.7 µs alone and 6.276 against
        # 6.297 ms a step (H100, 30 layers, --decode-ab, one process, BENCHMARKS 2026-12-07 (w);
        # 23.6 against 26.7 µs alone with its first stage requested before its set-up, (y);
        # True: the one-tile blocks). The routed Q2_K down likewise (kernels/imma_q2_k.py), a
        # candidate: 10.343 with both against 10.257
        self.imma_gate_up = "sm3"
        self.imma_down = False
        # a candidate: the routed Q2_K down's dp4a kernel reading its quant words and scales by
        # uint32 flat offsets (gemv_lowbit.FLAT_DECODE; its loop 6% fewer SASS instructions,
        # the same sums; not yet measured on a GPU)
        self.down_flat_loads = False
        if device.SIMULATOR:
            simulator_prefers_rows()

    @contextlib.contextmanager
    def settings(self, **values):
        """These attributes (branches, fold_q_a_norm, hc_u_threads, limbs_by_words, gemv_waves,
        indexer_one_warp, scorer_counts_first_digit, limbs_in_combine, hadamard_warp,
        idx_query_one_launch, scorer_q_fragments, imma_gate_up, imma_down, down_flat_loads,
        hc_u_prefetch,
        hc_mix_prefetch,
        hc_u_gram, moe_parts,
        attn_prefetch, attn_split_tiles, attn_head_warps, attn_bf16_tile, attn_staged,
        attn_mma_tiles,
        attn_combine_groups,
        post_own_stream, compressor_own_stream, q_a_norm_in_readers, l2_prefetch,
        l2_prefetch_blocks, l2_prefetch_next, side_gemv_waves, side_q_b_waves)
        set while inside, as they were after it; the step is captured anew under each (an A/B
        of the step; an unknown name raises AttributeError)."""
        before = {k: getattr(self, k) for k in values}
        try:
            for k, v in values.items():
                setattr(self, k, v)
            self._graph = self._warm = None
            yield self
        finally:
            for k, v in before.items():
                setattr(self, k, v)
            self._graph = self._warm = None

    # ---- buffers -------------------------------------------------------------------------------
    def _alloc_step_buffers(self):
        """Every step buffer, as layout.step_buffer_specs lists it (the planner's numbers): each
        becomes the attribute of its name, a pair ``X.0`` / ``X.1`` the tuple ``self.X``.
        MoEScratch allocates its own; the total is checked against the specs here, once."""
        cfg, s = self.cfg, self.stream
        specs = step_buffer_specs(cfg, self.capacity)
        fills = dict(ratio_arr=np.array(self.ratios or [1]), no_sel=-1, no_comp=0, zero_count=0,
                     ones=1)  # ones: the weightless norm's weight
        b = device.allocate([sp for sp in specs if not sp.name.startswith("moe.")], s, fills)
        for name, a in b.items():
            if "." not in name:
                setattr(self, name, a)
        self.X = (b["X.0"], b["X.1"])  # HC streams, ping-pong between sublayers
        self.comp_in = {w: (b[f"comp_in.{w}.0"], b[f"comp_in.{w}.1"])
                        for w in compressor_widths(cfg)}
        self.idx_in = (b["idx_in.0"], b["idx_in.1"])
        self.pos = self.meta[sk.META_POS:sk.META_POS + 1]
        self.n_window = self.meta[sk.META_WINDOW:sk.META_WINDOW + 1]
        self.n_comp = {r: self.meta[sk.META_RATIOS + j:sk.META_RATIOS + j + 1]
                       for j, r in enumerate(self.ratios)}
        self.moe = MoEScratch.allocate(cfg.dim, cfg.moe_dim, cfg.n_experts, cfg.n_experts_used, s)
        self.step_bytes = sum(int(a.nbytes) for a in b.values()) + self.moe.nbytes
        if self.step_bytes != total_bytes(specs):
            raise AssertionError(f"step buffers: {self.step_bytes} B allocated, "
                                 f"layout.step_buffer_specs says {total_bytes(specs)} B")

    @property
    def cache_bytes(self) -> int:
        """GPU bytes of every KV cache (with KV swap: the staging, not the host pool)."""
        return sum(c.nbytes for c in self.caches) + (self.swap.gpu_bytes if self.swap else 0)

    def comp_of(self, i: int):
        """Layer i's compressed entries as the prefill / a direct step reads and writes them:
        its GPU array, or with KV swap (CSA layers) its rows of the mapped host pool."""
        c = self.caches[i]
        if c.comp is not None or self.swap is None:
            return c.comp
        return self.swap.pool_views.get(i)  # None: a window-only layer has no entries

    def keys_of(self, i: int):
        """Layer i's indexer keys as the prefill / a direct step reads and writes them: its GPU
        array, or with swapped keys its rows of the mapped host key pool."""
        c = self.caches[i]
        if c.index_keys is not None or self.swap is None:
            return c.index_keys
        return self.swap.key_pool_views.get(i)

    # ---- one step -------------------------------------------------------------------------------
    def launch_step(self, temperature: float = 0.0, top_p: float = 1.0) -> None:
        """Launch one decode step on the engine's stream (no host sync)."""
        with limbs_kernel("words" if self.limbs_by_words else "serial"), grid_waves(
                self.gemv_waves):
            self._launch_step(temperature, top_p)

    def _launch_step(self, temperature: float, top_p: float) -> None:
        cfg, s, w = self.cfg, self.stream, self.w
        nt, sim = self.nt, self.sim
        sk.begin_step(self.meta, self.ids, self.token, self.u, self.uniforms, self.ratio_arr,
                      cfg.window, s)
        embed(self.e, w.embed, self.token, s, threads=nt)
        broadcast_rows(self.X[0].reshape(cfg.hc_mult, cfg.dim), self.e, s, threads=nt)
        X, post = 0, None  # post: the HC post still to be made (by the next HC pre's mix)
        for i in range(cfg.n_layers):
            post = self._attention(i, self.X[X], post)
            post = self._ffn(i, self.X[1 - X], post)
        hc_post(self.X[X], *post, s, threads=nt, **sim)
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

    def _post_side(self):
        """The stream of HC pre's post + comb (None: the one stream)."""
        if not self.branches:
            return None
        return self.side_post if self.post_own_stream else self.side

    def _hc_pre_forms(self) -> dict:
        """hc_pre's kernel choices under this engine's settings (both sublayers')."""
        return dict(u_threads=self.hc_u_threads, u_prefetch=self.hc_u_prefetch,
                    mix_prefetch=self.hc_mix_prefetch, u_gram=self.hc_u_gram)

    def _attention(self, i: int, X, post_from):
        """The attention sublayer on streams X (first made as the HC post ``post_from`` of the
        sublayer before, if any); returns its own HC post's inputs, for the next HC pre."""
        cfg, s, L, c = self.cfg, self.stream, self.w.layers[i], self.caches[i]
        nt, sim = self.nt, self.sim
        H, K, R, eps = cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.rms_eps
        u = self.u_norm
        pside = self._post_side()  # post + comb beside u (joined below)
        hc_pre(self.u_in, self.post, self.comb, X, *L.hc_attn, eps, cfg.hc_eps, cfg.hc_iters, s,
               threads=nt, side=pside, norm=(u, L.attn_norm), post_from=post_from,
               **self._hc_pre_forms(), **sim)  # u = attn_norm(HC pre)
        if self.mem is not None:  # a retriever target layer's x (§2 of flashmemory.md)
            self.mem.snapshot(i, u, s, nt)
        if cfg.is_csa(i):  # the indexer's keys and weights, from u alone: on their own branch
            self._indexer_keys(i, L, c, self.side_idx.fork(s) if self.branches else s)
        # the kv entry and the compressor on the side stream, beside the query and the indexer
        s2 = self.side.fork(s) if self.branches else s
        with self._side_waves():
            gemv(self.kv, L.kv, u, None, s2, threads=nt)
        kv3 = self.kv.reshape(1, 1, K)
        rmsnorm_rope(kv3, kv3, L.kv_norm, eps, True, self.pos, L.freqs, s2, threads=nt, **sim)
        kv_pack(self.kv_row, self.kv, R, stream=s2, threads=nt, **sim)  # FP8 + the 584 B entry
        sk.store_row(c.window, self.kv_row, self.meta, s2)
        comp_own = self.branches and self.compressor_own_stream and c.ratio
        if c.ratio:
            s2 = self.side_comp.fork(s) if comp_own else s2
            a, g = self.comp_in[c.state_kv.shape[1]]
            with self._side_waves():
                gemv(a, L.comp_kv, u, None, s2, threads=nt)
                gemv(g, L.comp_gate, u, None, s2, threads=nt)
            out, rowmap = c.comp, None
            if self.swap is not None and cfg.is_csa(i):  # the pool, or this chunk's slot
                out, rowmap = self.swap.compressor_target(i)
            compressor_step(c.state_kv, c.state_score, a.reshape(a.shape[1]),
                            g.reshape(g.shape[1]), L.comp_ape, self.pos, c.ratio,
                            cfg.is_csa(i), L.comp_norm, L.freqs, eps, MODE_KV_FP8, None, out,
                            stream=s2, threads=nt, rowmap=rowmap)
        gemv(self.cq, L.q_a, u, None, s, threads=nt)
        limbs = None  # q_b's x as int8 limbs, made with the q_a norm in one launch (dp4a q_b)
        fold = self.fold_q_a_norm is True or (self.fold_q_a_norm == "non-csa"
                                                and not cfg.is_csa(i))
        idx_x = (self.cq_norm, None)  # the idx_q_b GEMV's x, and the norm it makes of it
        in_readers = self._q_a_norm_in_readers(i, L)
        if fold and takes_limbs(L.q_b, norm=True):
            limbs = q8_0_limbs(self.cq, s, norm=(self.cq_norm, L.q_a_norm, eps), name="q_b limbs")
        elif in_readers:
            idx_x = (self.cq, (L.q_a_norm, eps))
        else:
            rmsnorm(self.cq_norm, self.cq, L.q_a_norm, eps, True, s, threads=nt, **sim)
        sq = self.side_q.fork(s) if self.branches and cfg.is_csa(i) else s  # beside the indexer
        if in_readers and limbs is None:  # (q_b's limbs with the norm, beside the indexer)
            limbs = q8_0_limbs(self.cq, sq, norm=(self.cq_norm, L.q_a_norm, eps),
                               name="q_b limbs")
        with grid_waves_or_not(self.side_q_b_waves if sq is not s else None):
            if limbs is not None:
                gemv_q8_0(self.q.reshape(1, H * K), L.q_b, None, stream=sq, threads=nt,
                          limbs=limbs)
            else:
                gemv(self.q.reshape(1, H * K), L.q_b, self.cq_norm, None, sq, threads=nt)
        q2 = self.q.reshape(H, K)
        # the weightless per-head norm, then RoPE (made by HCA's tensor-core attention as it
        # loads q instead: its build spills, and it measured nil with post + comb and the
        # compressor apart: 8.988 against 8.983 ms, H200, 43 layers, 2026-12-06 (p); made by
        # the q_b GEMV's warp that wrote a head's last rows: 6.092 against 5.867 ms, H100, 30
        # layers, 2026-12-07 (ab); both removed)
        rmsnorm_rope(self.q, self.q, self.ones[:K], eps, False, self.pos, L.freqs, sq,
                     threads=nt, **sim)
        if cfg.is_csa(i):
            self._indexer(i, L, c, idx_x)
        if self.branches:
            if sq is not s:
                self.side_q.join(s)
            self.side.join(s)
            if comp_own:
                self.side_comp.join(s)
            if pside is not self.side:
                pside.join(s)
        scale = 1.0 / math.sqrt(K)
        back = (self.pos, L.freqs)  # the output's inverse RoPE, inside the combine
        if cfg.is_csa(i):
            comp, sel, n_comp, every = c.comp, self.sel, self.n_comp[c.ratio], 0
            if self.swap is not None:  # staging rows through the remapped top-k, or the pool
                comp, sel = self.swap.attention_source(i, self.sel, s)
        elif c.ratio:  # HCA: every emitted entry
            comp, sel, n_comp, every = c.comp, self.no_sel, self.n_comp[c.ratio], 1
        else:
            comp, sel, n_comp, every = self.no_comp, self.no_sel, self.zero_count, 0
        G = cfg.o_groups
        xo = None  # out_a's x limbs, made by the attention's combine
        if self.limbs_in_combine and takes_limbs(L.out_a, grouped=True):
            xo = device.stream_buffer("attention out limbs", s, (G, H * K // G // 16 * XLW),
                                      np.int32)
        # out_a's weights into L2 while the attention reads little
        late = self._prefetch_into_l2(i, self.l2_prefetch)
        attention_decode(self.o.reshape(H, K), q2, c.window, self.n_window, comp, sel, n_comp,
                         every, L.sinks, scale, stream=s, threads=nt, out_rope=back, limbs=xo,
                         prefetch=self.attn_prefetch, split_tiles=self.attn_split_tiles,
                         staged=self.attn_staged, tiles_per_split=self.attn_mma_tiles,
                         combine_groups=self.attn_combine_groups,
                         head_warps=self.attn_head_warps, bf16_tile=self.attn_bf16_tile,
                         **sim)
        if xo is not None:
            gemv_q8_0(self.y, L.out_a, None, self.w.group_ids, s, threads=nt, limbs=xo)
        else:
            gemv(self.y, L.out_a, self.o.reshape(G, H // G * K), self.w.group_ids, s, threads=nt)
        gemv(self.f, L.out_b, self.y.reshape(1, G * cfg.o_rank), None, s, threads=nt)
        if late:
            self.side_pf.join(s)
        return self.f, X, self.post, self.comb  # made by the FFN's HC pre

    def _side_waves(self):
        """The side streams' small GEMVs' share of a wave (side_gemv_waves), where they run on
        side streams."""
        return grid_waves_or_not(self.side_gemv_waves if self.branches else None)

    def _prefetch_into_l2(self, i: int, names) -> bool:
        """Fork ``side_pf`` off the main stream and request the lines of layer i's weights of
        these names into L2 on it (l2_prefetch.py; a name that is no weight field raises
        AttributeError). False, nothing launched: no branches, no layer i, or none of these
        weights in it (idx_q_b off the CSA layers)."""
        if not self.branches or not names or i >= self.cfg.n_layers:
            return False
        L = self.w.layers[i]
        ws = [w for w in (getattr(L, n) for n in names) if w is not None]
        if not ws:
            return False
        sp = self.side_pf.fork(self.stream)
        for w in ws:
            prefetch_l2(w.planes, sp, blocks=self.l2_prefetch_blocks)
        return True

    def _indexer_keys(self, i: int, L, c, s) -> None:
        """On stream ``s``: emit this token's indexer key (every 4th token) and make the
        indexer's head weights, both from u alone; ``_indexer`` joins them before scoring."""
        cfg, u, nt = self.cfg, self.u_norm, self.nt
        DI = cfg.index_dim
        ia, ig = self.idx_in
        with self._side_waves():
            gemv(ia, L.idx_kv, u, None, s, threads=nt)
            gemv(ig, L.idx_gate, u, None, s, threads=nt)
        swapped = self.swap is not None and i in self.swap.krank
        keys, rowmap = (self.swap.key_compressor_target(i) if swapped
                        else (c.index_keys, None))  # (swapped: the pool, or the chunk's slot)
        compressor_step(c.index_kv, c.index_score, ia.reshape(2 * DI), ig.reshape(2 * DI),
                        L.idx_ape, self.pos, c.ratio, True, L.idx_norm, L.freqs, cfg.rms_eps,
                        MODE_INDEX_FP4, None, keys, stream=s, threads=nt, rowmap=rowmap)
        if self.branches and self._q_a_norm_in_readers(i, L):  # (a branch of their own)
            s = self.side_w.fork(self.stream)
        with self._side_waves():
            gemv(self.idx_w, L.idx_proj, u, None, s, threads=nt)
        sk.scale(self.idx_w, index_weight_scale(cfg), s)

    def _q_a_norm_in_readers(self, i: int, L) -> bool:
        """Whether layer i's q_a norm is made by its readers (see q_a_norm_in_readers)."""
        return bool(self.q_a_norm_in_readers and self.cfg.is_csa(i) and takes_norm(L.idx_q_b)
                    and takes_limbs(L.q_b, norm=True))

    def _indexer(self, i: int, L, c, idx_x) -> None:
        """The indexer's query, then (its keys and weights joined) the scores and the top-k.
        idx_x: (the idx_q_b GEMV's x, None or the norm the GEMV makes of it: (weight, eps))."""
        cfg, s = self.cfg, self.stream
        nt, sim = self.nt, self.sim
        HI, DI = cfg.index_heads, cfg.index_dim
        x, norm = idx_x
        frag = None  # q's fragments for the one-warp scorer, made by the one-launch query
        if self.idx_query_one_launch and not device.SIMULATOR and fits_indexer_query(
                L.idx_q_b, DI):  # (the simulator's engine runs keep the naive kernels)
            if self.scorer_q_fragments and self.indexer_one_warp and fits_warp(HI, DI):
                frag = device.stream_buffer("indexer q fragments", s, (HI * DI // 2,),
                                            np.uint32)
            indexer_query(self.qi_rot, L.idx_q_b, x, norm, (self.pos, L.freqs), True, s,
                          frag=frag)
        else:
            gemv(self.qi.reshape(1, HI * DI), L.idx_q_b, x, None, s, threads=nt, norm=norm)
            hadamard_fp4(self.qi_rot, self.qi, True, stream=s, threads=nt,
                         rope=(self.pos, L.freqs), warp=self.hadamard_warp, **sim)
        if self.branches:
            self.side_idx.join(s)
            if self._q_a_norm_in_readers(i, L):
                self.side_w.join(s)
        swapped = self.swap is not None and i in self.swap.krank
        n = self.n_comp[c.ratio]
        scores = self.scores[:max(1, self.capacity // c.ratio)]
        q, w = self.qi_rot.reshape(HI, DI), self.idx_w.reshape(HI)
        work = default_topk_workspace(s)
        if swapped:  # over the staged keys, back in chunk order (or over the pool, direct)
            self.swap.score_staged_keys(i, scores, q, w, n, s, nt)
            counted = False
        else:  # (with the top-k's first digit counted, where the scorer can)
            both = self.scorer_counts_first_digit and self.mem is None
            counted = indexer_scores(scores, q, w, c.index_keys, n, stream=s, threads=nt,
                                     q_fp4=self.indexer_one_warp,  # (hadamard_fp4's q)
                                     top_k=(work, cfg.index_topk) if both else None,
                                     q_frag=frag)
        if self.mem is not None:  # top-k inside the Memory Indexer's resident set
            self.mem.mask_scores(scores, s)
        # the picks in ascending order: attention sums them in list order, so a run repeats
        topk(self.sel, scores, n, cfg.index_topk, stream=s, threads=nt, work=work,
             first_digit_counted=counted)
        if self.mem is not None:  # (the global set comes in ascending order too)
            self.mem.drop_selected(self.sel, s)

    def _ffn(self, i: int, X, post_from):
        """The MoE sublayer on streams X, made first as the attention's HC post; returns its
        own HC post's inputs (as _attention)."""
        cfg, s, L = self.cfg, self.stream, self.w.layers[i]
        nt, sim = self.nt, self.sim
        # the shared expert beside the routed ones (in line before them, one SwiGLU launch for
        # both: 6.226 against 5.875 ms a step, H100, 30 layers, BENCHMARKS 2026-12-07 (ac))
        side = self.side if self.branches else None
        pside = self._post_side()  # post + comb beside u and the MoE
        ahead = self._prefetch_into_l2(i + 1, self.l2_prefetch_next)  # (the next layer's)
        hc_pre(self.u_in, self.post, self.comb, X, *L.hc_ffn, cfg.rms_eps, cfg.hc_eps,
               cfg.hc_iters, s, threads=nt, side=pside, norm=(self.u_norm, L.ffn_norm),
               post_from=post_from, **self._hc_pre_forms(), **sim)
        # the output in parts where the next layer's HC pre adds them (not before the head)
        parts = (self.moe_parts and i + 1 < cfg.n_layers and L.shared_gate_up is not None
                 and self.moe.k + 1 <= MAX_PARTS
                 and gram_path(X, pside, self.u_norm, self.hc_u_gram, **sim))
        out = None if parts else self.f
        moe_layer(out, self.u_norm, L.router, L.bias, L.tid2eid, self.token,
                  int(cfg.is_hash_layer(i)), L.gate_up, None, L.down, L.shared_gate_up, None,
                  L.shared_down, cfg.swiglu_clamp[i], cfg.swiglu_clamp_shared[i],
                  cfg.routed_scale, self.moe, int(cfg.norm_topk), s, threads=nt,
                  side=side, side_x=self.side_q if self.branches else None,
                  imma_gate_up=self.imma_gate_up, imma_down=self.imma_down,
                  down_flat=self.down_flat_loads)
        if side is not None:  # (moe_layer joins it too, when it has a shared expert)
            side.join(s)
            if pside is not side:
                pside.join(s)
        if ahead:
            self.side_pf.join(s)
        f = self.moe.parts if parts else self.f
        return f, X, self.post, self.comb  # made by the next HC pre (or before the head)

    # ---- a sequence -----------------------------------------------------------------------------
    def start(self, prompt: list[int], uniforms: np.ndarray | None = None) -> None:
        """Reset the caches and load a prompt (and the sampling uniforms, one per generated
        token, drawn by the caller so that CPU and GPU sample alike)."""
        n = len(prompt)
        if not 0 < n <= self.capacity:
            raise InputError(f"prompt: {n} tokens, the engine holds 1..{self.capacity}")
        s = self.stream
        if self.mem is not None:  # a cycle staged at the end of the last sequence
            self.mem.drain()
        for c in self.caches:
            c.reset(s)
        if self.swap is not None:
            self.swap.reset()
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
            if self.mem is not None:
                self.mem.drain()
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
        from .prefill import ChunkPrefill

        chunk = chunk or DEFAULT_PREFILL_CHUNK
        if self._prefill is None or self._prefill.T != chunk:
            self._prefill = None
            self._prefill = ChunkPrefill(self, chunk)
        return self._prefill

    def step(self, temperature: float = 0.0, top_p: float = 1.0, graph: bool = True) -> None:
        """One step. On a GPU the first step with given sampling settings runs eagerly (it
        compiles and lazily allocates), the second captures the step as a CUDA graph, and every
        later one replays it. The simulator, and ``graph=False``, launch eagerly."""
        direct = self.swap is not None and not self.swap.staged
        if not graph or device.SIMULATOR or direct:  # (KV swap: direct steps are the first
            self.launch_step(temperature, top_p)     # two; they read the pool, not staging)
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
        tokens per chunk, default plan.DEFAULT_PREFILL_CHUNK; 0: one decode step per token);
        the decode step then ingests the last one and samples. ``on_prefill(done, total,
        seconds)`` reports chunks.
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
        res = dict(tokens=out, prefill_s=prefill_s, decode_s=decode_s,
                   decode_steps=done - n, stop=stop)
        if self.swap is not None:
            res["kv_swap"] = self.swap.stats()
        return res

    def read_ids(self, start: int, stop: int) -> np.ndarray:
        """ids[start:stop] on the host (a sync)."""
        out = self.ids[start:stop].copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out

    def read_logits(self) -> np.ndarray:
        out = self.logits.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out[0]
