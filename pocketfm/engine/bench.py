"""``pocketfm bench``: decode speed of a model geometry at a given context, no file needed.

Weights come from ``SyntheticSource`` (the make-model type mix, made on the GPU). The context
is a synthetic fill of the caches, documented here because it stands in for a prefill: every
layer's window ring, compressed entries and indexer keys hold valid random packed entries for
``ctx`` positions and the step counter starts at ``ctx``. The decode work is then exactly that
of a real run at that context — the same kernels over the same number of entries (the indexer
scores all ctx/4 keys and attends its top 512; HCA attends all ctx/128 entries) — only the
values differ. The step is timed as CUDA-graph replays with CUDA events.
"""
from __future__ import annotations

import time

import numpy as np
from numba import cuda

from ..config import ModelConfig
from ..errors import InputError
from ..kernels import device, leave_out
from ..kernels.attention import random_packed_kv
from ..kernels.indexer import default_topk_workspace, random_packed_keys
from ..kernels.kvpack import index_key_bytes
from ..plan import DEFAULT_PREFILL_CHUNK
from . import step_kernels as sk
from .decode import DecodeEngine
from .synthetic_weights import POOL_ROWS, SyntheticSource, tile_rows


# Distinct indexer keys drawn for fill_caches (fewer where no layer keeps that many): with the
# weights' 256-row pools every score of a row came 256 times, and the top-k's cost depends on
# ties at the k-th score (2026-12-05 (f): 256 ties cost the prefill's top-k 14%, and an older
# tie ranking 2.8x), which a real model's keys rarely give. Hashed into 65,536 rows, a layer's
# rows repeat a few times at most (1M context: ~4 times). ~3 s of host time for V4-Flash.
KEY_POOL_ROWS = 65_536


def fill_caches(eng: DecodeEngine, ctx: int, seed: int = 0) -> None:
    """Valid random packed entries in every cache row; the next step is position ``ctx``."""
    cfg, s = eng.cfg, eng.stream
    rng = np.random.default_rng(seed)
    kv_pool = cuda.to_device(random_packed_kv(rng, POOL_ROWS, cfg.head_dim, cfg.rope_dim)
                             .view(np.uint32), stream=s)
    keys = [eng.keys_of(i) for i in range(len(eng.caches))]
    key_rows = max([k.shape[0] for k in keys if k is not None], default=1)
    key_pool = cuda.to_device(random_packed_keys(rng, min(KEY_POOL_ROWS, key_rows),
                                                 cfg.index_dim).view(np.uint32), stream=s)
    for i, c in enumerate(eng.caches):
        c.reset(s)
        comp = eng.comp_of(i)  # (KV swap: the layer's rows of the host pool)
        for a, pool in ((c.window, kv_pool), (comp, kv_pool), (keys[i], key_pool)):
            if a is not None:
                tile_rows(a.view(np.uint32), pool, 31 * i + a.shape[0], s)
    meta = np.zeros(eng.meta.shape, np.int32)
    meta[sk.META_POS] = ctx
    eng.meta.copy_to_device(meta, stream=s)
    eng.ids.copy_to_device(np.zeros(eng.ids.shape, np.int32), stream=s)
    s.synchronize()


def bytes_per_token(eng: DecodeEngine, ctx: int) -> dict:
    """Bytes one decode step at context ``ctx`` must read, by component (ideal: once each)."""
    cfg, w = eng.cfg, eng.w
    k_frac = cfg.n_experts_used / cfg.n_experts
    weights = w.output.nbytes + w.embed.nbytes // w.embed.shape[0]
    experts = 0
    for L in w.layers:
        for name, v in vars(L).items():
            if v is None or name == "freqs":
                continue
            parts = v if isinstance(v, tuple) else (v,)
            n = sum(int(p.nbytes) for p in parts)
            if name in ("gate_up", "down"):
                experts += int(n * k_frac)
            elif name != "tid2eid":
                weights += n
    kv = 0
    B = eng.kv_row.shape[1]
    for i, c in enumerate(eng.caches):
        kv += cfg.window * B
        if cfg.is_csa(i):
            n = ctx // c.ratio
            kv += n * index_key_bytes(cfg.index_dim) + min(n, cfg.index_topk) * B
        elif c.ratio:
            kv += (ctx // c.ratio) * B
    return dict(weights=weights, routed_experts=experts, kv_and_index=kv,
                total=weights + experts + kv)


def _timed(work, stream) -> float:
    """Milliseconds of GPU time for ``work`` by CUDA events (wall time in the simulator)."""
    if device.SIMULATOR:
        t0 = time.perf_counter()
        work()
        return (time.perf_counter() - t0) * 1e3
    e0, e1 = cuda.event(), cuda.event()
    e0.record(stream)
    work()
    e1.record(stream)
    e1.synchronize()
    return cuda.event_elapsed_time(e0, e1)


PROFILED = ("hc_pre", "hc_post", "hc_head", "rmsnorm", "rmsnorm_rope", "attention_decode",
            "kv_pack", "hadamard_fp4", "compressor_step", "indexer_scores", "topk", "moe_layer",
            "embed", "argmax", "sample_top_p", "broadcast_rows", "gemv")


def profile_step(eng: DecodeEngine, repeats: int = 20) -> dict:
    """GPU milliseconds per launcher (GEMVs per weight) in one step. Each call of the step is
    recorded, then captured alone as a graph of ``repeats`` copies and timed by CUDA events
    (as bin/bench-kernels does): timing eager launches would measure Python, not the GPU."""
    from collections import Counter

    from ..kernels.bench import time_launches
    from . import decode

    names = _weight_names(eng)
    calls, saved = [], {n: getattr(decode, n) for n in PROFILED}

    def record(n, fn):
        def call(*a, **k):
            fn(*a, **k)
            label = f"gemv {names.get(id(a[1]), '?')}" if n == "gemv" else n
            calls.append((label, lambda: fn(*a, **k)))
        return call
    branches, eng.branches = eng.branches, False  # every call on the main stream
    try:
        for n, fn in saved.items():
            setattr(decode, n, record(n, fn))
        eng.launch_step()
    finally:
        for n, fn in saved.items():
            setattr(decode, n, fn)
        eng.branches = branches
    eng.stream.synchronize()
    ms = Counter()
    for label, launch in calls:
        replay = device.capture_graph([launch] * repeats, eng.stream, warm=False)
        ms[label] += time_launches(replay, eng.stream, reps=3, warmup=1, rounds=3) * 1e3 / repeats
    return dict(ms.most_common())


def ncu_step(eng: DecodeEngine, graph: bool = False) -> None:
    """One more step, launched eagerly on the engine's one stream (no concurrent branches)
    between cudaProfilerStart and cudaProfilerStop, for Nsight Compute: ``ncu
    --profile-from-start off ... pocketfm bench --ncu-step`` then profiles every kernel of one
    step, each alone (ncu serialises them and, by default, flushes the caches before each;
    their sum is therefore above the replayed graph's step). ``graph`` (``--ncu-graph``): with
    the engine's side streams, so the kernels are the captured graph's own (the branch forms
    of HC pre, q_b's limbs, ...) and each keeps its stream in ncu's CSV. The simulator has no
    profiler: the step just runs."""
    branches, eng.branches = eng.branches, eng.branches if graph else False
    try:
        if not device.SIMULATOR:
            cuda.profile_start()
        eng.launch_step()
        cuda.synchronize()  # (the side streams too)
    finally:
        if not device.SIMULATOR:
            cuda.profile_stop()
        eng.branches = branches


def time_prefill(eng: DecodeEngine, start: int, n: int, chunk: int, seed: int = 0) -> dict:
    """Chunked prefill of ``n`` random tokens at positions start .. start+n-1 (after a fill:
    each token's indexer scores every key before it). One untimed chunk first compiles the
    kernels (on a GPU); its positions are then run again, timed, with the rest."""
    from .prefill import ChunkPrefill

    ids = np.random.default_rng(seed + 1).integers(0, eng.cfg.vocab, n).astype(np.int32)
    eng.ids[start:start + n].copy_to_device(ids, stream=eng.stream)
    pf = eng.prefill(chunk)
    t0 = time.perf_counter()
    if not device.SIMULATOR:  # (nothing to compile there)
        pf.chunk(start, min(chunk, n))
    eng.stream.synchronize()
    first_s = time.perf_counter() - t0
    # the same chunk again, compiled: how long Python takes to launch it against how long the
    # GPU takes to run it (launch time near run time: the prefill is bound by the host). The
    # simulator runs each kernel as it is launched, so there the two are one figure that says
    # nothing (None, as its memory use): the chunk is not run twice.
    launch_s = run_s = None
    if not device.SIMULATOR:
        t0 = time.perf_counter()
        pf.chunk(start, min(chunk, n))
        launch_s = time.perf_counter() - t0
        eng.stream.synchronize()
        run_s = time.perf_counter() - t0
    done = []  # when each chunk of the timed run completed (the host waits for chunk c only
    # once chunk c+1 is launched, so this costs the GPU nothing): a slow chunk shows up here
    seconds = pf.ingest(start + n, start=start, progress=lambda d, total, t: done.append(t))
    return dict(prefill_tokens=n, prefill_chunk=chunk, prefill_tok_s=n / seconds,
                prefill_s=seconds, prefill_first_chunk_s=first_s,
                prefill_chunk_launch_s=launch_s, prefill_chunk_run_s=run_s,
                prefill_chunks_s=[b - a for a, b in zip([0.0] + done, done)],
                prefill_workspace_bytes=pf.nbytes)


def _prefill_variants() -> dict:
    """What ``bench --prefill-ab`` times against the prefill as landed: ChunkPrefill settings
    that undo one change each (the side streams, each branch site, the q norm / RoPE fold),
    and candidates not landed (the routed experts, the dense Q8_0 GEMMs on hmma.py's 64-token
    build)."""
    from .prefill import BRANCH_SITES

    every = frozenset(BRANCH_SITES)
    return {"as landed": {}, "one stream": dict(branches=False),
            **{f"without the {s} branch": dict(branch_sites=every - {s}) for s in BRANCH_SITES},
            "q norm + RoPE as launches": dict(fold_q_norm_rope=False),
            "routed experts in 64-token tiles": dict(routed_tokens=64),
            "dense Q8_0 in 64-token tiles": dict(dense_tokens=64)}


def time_prefill_variants(pf, p0: int, T: int, rounds: int = 2, names=None) -> dict:
    """The prefill chunk at positions p0 .. p0+T-1 again under each variant of
    _prefill_variants (``names``: a subset), the variants in turn ``rounds`` times: one
    process on one machine, where a separate bench per build differs by ~1% between machines
    and pays the engine's build each time. Each variant runs once untimed first (on a GPU: it
    compiles what only it launches). -> {variant: {"best_s", "median_s"}}, GPU seconds a
    chunk (the host waits for each)."""
    variants = _prefill_variants()
    names = list(variants) if names is None else list(names)
    s = pf.eng.stream

    def run(name):
        with pf.settings(**variants[name]):
            s.synchronize()
            t0 = time.perf_counter()
            pf.chunk(p0, T)
            s.synchronize()
        return time.perf_counter() - t0

    times = {n: [] for n in names}
    for n in names if not device.SIMULATOR else ():
        run(n)
    for _ in range(rounds):
        for n in names:
            times[n].append(run(n))
    return {n: dict(best_s=min(v), median_s=float(np.median(v))) for n, v in times.items()}


def _decode_variants() -> dict:
    """What ``bench --decode-ab`` times against the step as landed: DecodeEngine settings that undo
    one change each (the side streams; HC pre's u block over D / 512 blocks from the Gram partials;
    the MoE's output added up by the next Gram mix; the u block's one block of 1,024 threads with
    the norm from registers; that block and HC post + mix with their loads issued first; the dp4a
    GEMVs' x limbs four threads a chunk; the q_a norm inside q_b's limbs off the CSA layers; the
    indexer's scores by one warp holding every head, and the top-k's first digit counted by it;
    out_a's limbs made by the attention's combine; the routed gate+up on imma_iq2_xxs.py's int8
    tensor cores instead of the dp4a GEMV; the split attention with one head a warp over 32-slot
    tiles, its decoded tile held as bf16 (before it: float32; two heads a warp, its next tile loaded
    while it scores this one, 2 tiles a split); HC pre's post + comb and the compressor on streams
    of their own, and the CSA q_a norm made by its readers with the indexer's weights on a branch of
    their own; out_a's weights prefetched into L2 beside the attention, by 8 blocks, and the next
    layer's q_a beside the MoE; the attention's combine with its splits over 4 thread groups; the
    indexer query in one launch, which also makes the scorer's q fragments; the routed gate+up's
    SM-wide build of 3 tiles a block; the persistent decode GEMVs' grids at 0.9 of a wave, room
    for the side streams' blocks; the side streams' small GEMVs, the kv entry's, the compressors'
    and the indexer's, at a quarter of a wave, leaving the main stream more of the SMs) or try a
    candidate (those grids at 0.75 of a wave: nil; the side streams' small GEMVs at 0.125 or
    0.5 of a wave; the CSA layers' q_b, beside the indexer's longer path, at 0.5 or 0.25; the q_a
    norm folded on every layer: slower, the CSA layers' indexer path gets longer; the indexer
    query's Hadamard a warp a vector: nil, H100, 2026-12-05 (j); the routed gate+up's
    super-blocks summed as integers, x scaled per 256 columns, its tables packed or wide (a
    lookup's address by one instruction); the routed down's dp4a kernel reading by uint32 flat
    offsets; the routed Q2_K down on
    imma_q2_k.py's tensor cores too: slower, H200, 2026-12-06 (l)). The routing inside the routed
    gate+up's launch (6.048 against 5.977 ms), the Q8_0 dp4a GEMVs taking their row groups from
    a counter (6.840), capped at 255 registers (6.168) or built for 2 rows a step (5.981) or a
    chunk a lane (6.414), and q's norm + RoPE made by the q_b GEMV (6.092 against 5.867 on
    another H100) were candidates too (H100, 30 layers, 2026-12-07 (ab)), dropped; so were the
    captured step's kernels at their streams' priorities, the main stream's first (5.878 against
    5.875 ms), and the MoE's shared expert in line before the routed chain (6.226; H100, 30
    layers), the routed Q2_K down's scales a step ahead (7.919 against 7.839 ms, H200, 43
    layers) and the MoE's shared expert's GEMVs at half a wave (5.864 against 5.863 ms, H100;
    2026-12-07 (ac)). The
    top-k's write-out placed from counts
    left before its second grid barrier, one barrier fewer, was a candidate too: 5.942 against
    5.918 ms, H100, 30 layers, 2026-12-07 (aa), dropped. HC pre's mix and u in one launch (the last
    block to finish making u) was a candidate too, 8.30 against 7.94 ms, and was dropped; so were
    the top-k's small threshold bin ranked on a list instead of a third digit pass, the router's
    weights into L2 with out_a's and the next layer's idx_q_b with its q_a (+0.1%, +0.2%, 0.0%,
    H100, 2026-12-06 (r)); the routing in the router GEMV's last block and q_a with its norm and
    q_b's limbs in one launch: 7.134 / 7.207 against 7.023 ms, H100, 2026-12-06; and q's norm and
    RoPE in HCA's tensor-core attention and that attention at 8 tiles a split: 6.982 / 7.033 against
    6.954 ms (o); the first again with the two streams apart, 8.988 against 8.983 ms, and out_b's x
    limbs made by out_a's GEMV, 9.510 against 9.320 ms (H200, 43 layers, 2026-12-06 (p)); out_b's
    weights into L2 too, 6.826 against 6.681 ms, H100 (p); q_b's and idx_q_b's from the attention
    sublayer's start, and the next layer's q_b beside the MoE, 6.785 / 6.686 against 6.573 ms, H100
    (q)."""
    return {"as landed": {}, "one stream": dict(branches=False),
            "q_a norm folded on every layer": dict(fold_q_a_norm=True),
            "q_a norm as its own launch": dict(fold_q_a_norm=False),
            "HC pre's u block as one block (before the Gram partials)": dict(hc_u_gram=False),
            "the MoE's combine as its own launch": dict(moe_parts=False),
            "HC pre's u block of 512 threads": dict(hc_u_gram=False, hc_u_threads=512,
                                                    hc_u_prefetch=False),
            "x limbs a thread a chunk": dict(limbs_by_words=False),
            "the decode GEMVs' grids at a full wave (before)": dict(gemv_waves=1.0),
            "the decode GEMVs' grids at 0.75 of a wave": dict(gemv_waves=0.75),
            "the side streams' small GEMVs at the main stream's share (before)": dict(
                side_gemv_waves=None),
            "the side streams' small GEMVs at 0.125 of a wave": dict(side_gemv_waves=0.125),
            "the side streams' small GEMVs at 0.5 of a wave": dict(side_gemv_waves=0.5),
            "the CSA layers' q_b beside the indexer at 0.5 of a wave": dict(side_q_b_waves=0.5),
            "the CSA layers' q_b beside the indexer at 0.25 of a wave": dict(
                side_q_b_waves=0.25),
            "indexer scores a warp per 16 heads (top-k counting its first digit)": dict(
                indexer_one_warp=False),
            "the top-k counting its first digit": dict(scorer_counts_first_digit=False),
            "out_a's limbs as their own launch": dict(limbs_in_combine=False),
            "the indexer query's Hadamard a warp a vector": dict(hadamard_warp=True),
            "the routed gate+up on dp4a (before imma)": dict(imma_gate_up=False),
            "the routed gate+up's imma blocks of one tile (before SM-wide)": dict(
                imma_gate_up=True),
            "the routed down on int8 tensor cores too (imma)": dict(imma_down=True),
            "HC pre's u block loading the partials first (before)": dict(
                hc_u_gram=False, hc_u_prefetch=False),
            "HC post + mix waiting on memory three times (before)": dict(
                hc_u_gram=False, hc_mix_prefetch=False),
            "both HC kernels as before their loads first": dict(
                hc_u_gram=False, hc_u_prefetch=False, hc_mix_prefetch=False),
            "the split attention two heads a warp, 16-slot tiles (before)": dict(
                attn_head_warps=False),
            "the split attention's tile in float32 (before bf16)": dict(attn_bf16_tile=False),
            "the split attention two heads a warp, each tile loaded after the last": dict(
                attn_head_warps=False, attn_prefetch=False),
            "the split attention two heads a warp, 4 tiles a split": dict(
                attn_head_warps=False, attn_split_tiles=4),
            "the split attention two heads a warp, 1 tile a split": dict(
                attn_head_warps=False, attn_split_tiles=1),
            "HCA's attention with q and its partials unstaged, CSA's partials too (before)": dict(
                attn_staged=False, attn_head_warps=False),
            "HCA's attention at 4 tiles a split (before)": dict(attn_mma_tiles=4),
            "HC post + comb on the side stream (before)": dict(post_own_stream=False),
            "the compressor after the kv entry (before)": dict(compressor_own_stream=False),
            "both on the side stream (before)": dict(post_own_stream=False,
                                                     compressor_own_stream=False),
            "the q_a norm as a launch, the indexer's weights after its keys (before)": dict(
                q_a_norm_in_readers=False),
            "the three streams as before": dict(post_own_stream=False,
                                                compressor_own_stream=False,
                                                q_a_norm_in_readers=False),
            "no L2 prefetch of out_a's weights (before)": dict(l2_prefetch=()),
            "out_a's weights into L2 by 16 blocks": dict(l2_prefetch_blocks=16),
            "out_a's weights into L2 by 4 blocks": dict(l2_prefetch_blocks=4),
            "no L2 prefetch of the next layer's q_a (before)": dict(l2_prefetch_next=()),
            "the combine a thread a dim (before)": dict(attn_combine_groups=0),
            **{f"the combine spread over {g} groups": dict(attn_combine_groups=g)
               for g in (2, 8)},
            "the indexer query as a GEMV, then hadamard_fp4 (before)": dict(
                idx_query_one_launch=False),
            "the routed gate+up SM-wide, 4 tiles a block (candidate)": dict(
                imma_gate_up="sm"),
            "the routed gate+up's super-blocks summed as integers (candidate)": dict(
                imma_gate_up="sm3_int_sums"),
            "the routed gate+up's super-blocks summed as integers, wide tables (candidate)": dict(
                imma_gate_up="sm3_int_wide"),
            "the routed gate+up's super-blocks summed as integers, wide tables, 4 tiles a block "
            "(candidate)": dict(imma_gate_up="sm_int_wide"),
            "the routed down reading by flat offsets (candidate)": dict(down_flat_loads=True),
            "the indexer scorer staging q (before q's fragments from the query's launch)": dict(
                scorer_q_fragments=False)}


def decode_variant_names(texts) -> list:
    """The names of _decode_variants containing any of ``texts`` (case-insensitive), after
    "as landed" (bench --decode-ab-only)."""
    wanted = [t.lower() for t in texts]
    return ["as landed"] + [n for n in _decode_variants()
                            if n != "as landed" and any(t in n.lower() for t in wanted)]


def without_row(pattern: str) -> str:
    """The --decode-without row of a kernel-name pattern."""
    return f"without /{pattern}/ (timing only)"


def check_without(pattern: str) -> None:
    """InputError unless ``pattern`` is a regular expression the step can be timed without:
    the indexer scorer counts the top-k's first digit into the top-k's workspace, so a pattern
    leaving out the scorer must leave out the top-k too (the top-k would pick from counts of
    nothing, and write its picks past its slots)."""
    import re

    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise InputError(f"--decode-without {pattern!r}: not a regular expression ({e})")
    if rx.search("_indexer_scores_warp") and not rx.search("_topk_radix_select"):
        raise InputError(f"--decode-without {pattern!r}: leaves out the indexer scorer but not "
                         "the top-k, which reads the scorer's counts: add |topk")


def time_decode_variants(eng, p0: int, steps: int, rounds: int = 2, names=None,
                         without=()) -> dict:
    """The decode steps at positions p0 .. p0+steps-1 again under each variant of
    _decode_variants (``names``: a subset), in turn ``rounds`` times, in one process. Each
    variant's step is captured anew (an eager step, then the capture, at p0 and p0 + 1) and
    then replayed from p0 again, so every variant does the same positions' work. ``without``:
    kernel-name patterns (leave_out.py), each a row of the step as landed with those kernels'
    launches left out (timing only: what they cost the step; ``left_out``: the launches a step
    left out, by kernel). -> {variant: {"best_ms", "median_ms"[, "left_out"]}}, GPU ms a step
    (CUDA events)."""
    variants = _decode_variants()
    names = list(variants) if names is None else list(names)
    patterns = {without_row(p): p for p in without}
    names += [n for n in patterns if n not in names]
    s = eng.stream
    left = {}

    def run(name):
        with eng.settings(**variants.get(name, {})), leave_out.leaving_out(
                patterns.get(name)) as counts:
            eng.set_position(p0)
            eng.step()  # eager (compiles what only this variant launches)
            left[name] = dict(counts)  # (one step's; the capture's are counted after it)
            if not device.SIMULATOR:
                eng.step()  # captured, replayed once
            eng.set_position(p0)
            ms = _timed(lambda: [eng.step() for _ in range(steps)], s) / steps
        if name in patterns:  # a top-k left out leaves the scorer's counts in its workspace
            work = default_topk_workspace(s)
            sk.fill_words(work.view(np.uint32).reshape(1, work.size), 0, s)
        return ms

    times = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            times[n].append(run(n))
    return {n: dict(best_ms=min(v), median_ms=float(np.median(v)),
                    **({"left_out": left[n]} if n in patterns else {}))
            for n, v in times.items()}


# the launchers a prefill chunk calls, by module (prefill's imports; hmma.py's GEMM and x
# preparations, which prefill calls through the module)
PREFILL_PROFILED = ("hc_pre", "hc_post", "rmsnorm", "rmsnorm_rope", "attention_prefill",
                    "store_chunk_rows", "kv_pack", "hadamard_fp4", "compressor_chunk",
                    "decode_keys", "indexer_scores_chunk", "topk_chunk", "route_chunk",
                    "expert_order", "swiglu_fused", "combine_chunk", "broadcast_rows", "embed",
                    "gemv", "gemm_mma")
HMMA_PROFILED = ("gemm_hmma_prepared", "prepare_x", "prepare_x_swiglu",
                 "prepare_x_group_major", "prepare_x_token_major")
_GEMMS = ("gemv", "gemm_mma", "gemm_hmma_prepared")  # (out, weight, ...): timed per weight


def profile_chunk(pf, p0: int, T: int) -> dict:
    """GPU milliseconds per launcher (GEMMs per weight) in one prefill chunk at position p0:
    every launch is synchronised and timed from the host. A chunk's launches take 0.1-10 ms
    each, so the ~20 µs of a launch and sync hardly count (unlike a decode step's)."""
    from collections import Counter

    from ..kernels import hmma
    from . import prefill

    names = _weight_names(pf.eng)
    ms = Counter()
    saved = {(m, n): getattr(m, n) for m, ns in ((prefill, PREFILL_PROFILED),
                                                   (hmma, HMMA_PROFILED)) for n in ns}
    s = pf.eng.stream

    def timed(n, fn):
        def call(*a, **k):
            s.synchronize()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            s.synchronize()
            label = f"gemm {names.get(id(a[1]), '?')}" if n in _GEMMS else n
            ms[label] += (time.perf_counter() - t0) * 1e3
            return r
        return call
    try:
        for (m, n), fn in saved.items():
            setattr(m, n, timed(n, fn))
        s.synchronize()
        t0 = time.perf_counter()
        with pf.one_stream():
            pf.chunk(p0, T)
        s.synchronize()
        total = (time.perf_counter() - t0) * 1e3
    finally:
        for (m, n), fn in saved.items():
            setattr(m, n, fn)
    return dict(chunk_ms=total, by_launcher=dict(ms.most_common()))


def ncu_chunk(pf, p0: int, T: int) -> None:
    """One prefill chunk at position p0 again (the same tokens: the caches end as they were),
    launched on one stream between cudaProfilerStart and Stop, for Nsight Compute: ``ncu
    --profile-from-start off --metrics gpu__time_duration.sum ... pocketfm bench --prefill N
    --ncu-chunk`` then times every kernel of one chunk alone. The simulator has no profiler:
    the chunk just runs."""
    s = pf.eng.stream
    s.synchronize()
    try:
        if not device.SIMULATOR:
            cuda.profile_start()
        with pf.one_stream():
            pf.chunk(p0, T)
        s.synchronize()
    finally:
        if not device.SIMULATOR:
            cuda.profile_stop()


def _weight_names(eng) -> dict:
    """id(QWeight) -> its DeviceLayer attribute name (grouped out_a: its per-group views)."""
    names = {id(eng.w.output): "output"}
    for L in eng.w.layers:
        for attr, v in vars(L).items():
            if hasattr(v, "planes"):
                names[id(v)] = attr
    return names


def lookahead_like_set(n: int, page: int, kmax: int, tail: int, rng, keep=None,
                       churn: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(resident[n] bool, older pages): the shape of a lookahead set (flashmemory.md §5.1) —
    the recency tail's pages plus random older pages, ``kmax`` pages in all. With ``keep``
    (the older pages of the previous cycle) all but a ``churn`` share of them stay: the next
    window's set, as consecutive cycles overlap."""
    n_pages = -(-n // page)
    tail_pages = np.arange(max(0, n - tail) // page, n_pages)
    older = np.setdiff1d(np.arange(n_pages), tail_pages)
    want = max(0, min(kmax - len(tail_pages), len(older)))
    if keep is None:
        pages = rng.choice(older, want, replace=False)
    else:
        stay = rng.choice(keep, int(round(len(keep) * (1 - churn))), replace=False)
        fresh = rng.choice(np.setdiff1d(older, keep), want - len(stay), replace=False)
        pages = np.concatenate([stay, fresh])
    res = np.zeros(n_pages, bool)
    res[tail_pages] = True
    res[pages] = True
    return np.repeat(res, page)[:n], np.sort(pages)


def bench_kv_swap(eng: DecodeEngine, ctx: int, tokens: int, interval: int, churn: float,
                  seed: int = 0, lag: int = 0) -> dict:
    """Decode with the KV swapped, after a ``fill_caches``: a lookahead-shaped set (flash's
    geometry: KMAX 96 pages of 64 chunks, the 2048-chunk tail) committed every ``interval``
    steps, ``churn`` of its older pages new each cycle, in force ``lag`` replays after it is
    staged (engine/memory.py: the copies overlap those replays). Times the first commit (every
    chunk a miss), the gather kernel alone (swap-in GB/s), the step graph, and the whole loop
    with its cycles (the tok/s a run would see)."""
    from ..kernels.kvgather import gather_to_slots
    from ..memory import MemoryIndexer, RetrieverGeometry, SelectionConfig
    from ..model import Forward

    cfg, s, sw = eng.cfg, eng.stream, eng.swap
    g = RetrieverGeometry.for_model(cfg)
    fw = Forward(cfg, None)
    mem = MemoryIndexer(cfg, SelectionConfig(mode="recency", interval=interval), None,
                        fw.freq_compressed, fw.hadamard)
    eng.attach_memory(mem)
    eng.mem.reset(ctx)
    rng = np.random.default_rng(seed + 7)
    n = ctx // 4
    active, pages = lookahead_like_set(n, g.page_size, g.kmax, g.recency_tail, rng)
    s.synchronize()
    t0 = time.perf_counter()
    eng.mem.commit(active, n, ctx)
    s.synchronize()
    first_commit_ms = (time.perf_counter() - t0) * 1e3
    chunks, slots = sw.table.staged()
    d_chunks, d_slots = cuda.to_device(chunks, stream=s), cuda.to_device(slots, stream=s)
    gather_ms = _timed(lambda: gather_to_slots(sw.staging, sw.pool_dev, d_chunks, d_slots, s), s)
    moved = len(chunks) * len(sw.layers) * sw.B
    steps = 0  # decode steps run since the fill: the context is ctx + steps tokens

    def stage():
        """A boundary: the next set staged on the cycle stream (host ms, resident chunks)."""
        nonlocal pages
        n = min((ctx + steps) // 4, sw.N)  # chunks formed so far
        active, pages = lookahead_like_set(n, g.page_size, g.kmax, g.recency_tail, rng,
                                           keep=pages, churn=churn)
        c0 = time.perf_counter()
        eng.mem.mark_boundary()
        eng.mem.stage(active, n)
        return (time.perf_counter() - c0) * 1e3, int(active.sum())

    eng.step()  # eager: the staged step's kernels compile
    s.synchronize()
    eng.step()  # captured, replayed once
    k = max(1, interval - 2)  # the rest of the first window: the graph alone, by events
    step_ms = _timed(lambda: [eng.step() for _ in range(k)], s) / k
    steps = 2 + k
    cycle_ms, done = [], 0
    s.synchronize()
    t0 = time.perf_counter()
    def switch() -> float:
        c0 = time.perf_counter()
        eng.mem.switch(ctx + steps)
        return (time.perf_counter() - c0) * 1e3

    while done < tokens:  # windows of ``interval`` replays; a set staged at each boundary
        ms, resident = stage()  # in force after ``lag`` more replays, as in a run
        window = min(interval, tokens - done)
        for i in range(window):
            if i == lag:
                ms += switch()
            eng.step()
            steps, done = steps + 1, done + 1
        if window <= lag:  # a short last window: the set still takes effect
            ms += switch()
        cycle_ms.append(ms)
    s.synchronize()
    loop_s = time.perf_counter() - t0
    st = sw.stats()
    return dict(kv_swap=st, swap_first_commit_ms=first_commit_ms,
                swap_in_gbs=moved / gather_ms / 1e6, swap_in_rows=int(len(chunks)),
                swap_in_ms=gather_ms, swap_step_ms=step_ms, swap_cycle_host_ms=cycle_ms,
                swap_decode_tok_s=tokens / loop_s, swap_interval=interval, swap_churn=churn,
                swap_resident_chunks=resident, swap_pinned_bytes=sw.pinned_bytes)


def run_bench(cfg: ModelConfig, ctx: int, tokens: int, quant: str = "ds4-q2", seed: int = 0,
              progress=None, profile: bool = False, prefill: int = 0,
              prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_swap: int = 0, interval: int = 64,
              churn: float = 0.1, lag: int | None = None, ncu: bool | str = False,
              ncu_prefill: bool = False, prefill_ab: bool = False,
              decode_ab: bool | list = False, decode_without=()) -> dict:
    """Build the engine for ``cfg`` on the GPU, fill ``ctx`` positions, prefill ``prefill``
    more tokens in chunks (timed), then time ``tokens`` decode steps. ``kv_swap`` K > 0: with
    the KV swapped through K staging slots (``bench_kv_swap``), each set in force ``lag``
    replays after its boundary (None: as ``run --kv-swap``). ``ncu``: then one more step for
    Nsight Compute (``ncu_step``; ``"graph"``: with the side streams; not with kv_swap);
    ``ncu_prefill``: the last prefill chunk again for it (``ncu_chunk``); ``prefill_ab``: the
    last prefill chunk again under each of time_prefill_variants' variants (``prefill_ab`` in
    the result); ``decode_ab``: the timed decode steps again under each of
    time_decode_variants' variants (``decode_ab``; a list: those named), and without the
    launches of the kernels each pattern of ``decode_without`` names (rows of ``decode_ab``)."""
    free0, total = cuda.current_context().get_memory_info()
    t0 = time.perf_counter()
    stream = cuda.stream()
    swap = None
    if kv_swap:
        from ..kvswap.config import SwapPlanConfig, decode_region, overlap_lag
        from ..memory.checkpoint import csa_layers, default_clids

        lag = overlap_lag(interval) if lag is None else lag
        csa = csa_layers(cfg)  # a lookahead run's target layers keep their keys on the GPU
        targets = {csa[c] for c in default_clids(cfg)}
        swap = SwapPlanConfig(True, kv_swap, cfg.index_topk, decode_region(interval, lag),
                              cap_mib=1 << 30, lag=lag,
                              key_layers=tuple(i for i in csa if i not in targets))
    eng = DecodeEngine(cfg, SyntheticSource(cfg, quant, seed, stream),
                       ctx + prefill + tokens + 3 + int(bool(ncu)) + (interval if kv_swap else 0),
                       stream=stream, progress=progress, swap=swap)
    build_s = time.perf_counter() - t0
    fill_caches(eng, ctx, seed)
    pre = time_prefill(eng, ctx, prefill, prefill_chunk, seed) if prefill else {}
    last_T = min(prefill_chunk, prefill)  # the timed prefill's last chunk: its start, length
    last = (ctx + prefill - last_T, last_T)
    if prefill and prefill_ab:
        pre["prefill_ab"] = time_prefill_variants(eng.prefill(prefill_chunk), *last)
    ctx += prefill
    if kv_swap:
        r = bench_kv_swap(eng, ctx, tokens, interval, churn, seed, lag)
        free1, _ = cuda.current_context().get_memory_info()
        used = None if device.SIMULATOR else int(free0 - free1)
        nb = bytes_per_token(eng, ctx)
        return dict(**r, **pre, preset_layers=cfg.n_layers, ctx=ctx, tokens=tokens, quant=quant,
                    decode_tok_s=r["swap_decode_tok_s"], step_ms=r["swap_step_ms"],
                    bytes_per_token=nb, achieved_gbs=nb["total"] / r["swap_step_ms"] / 1e6,
                    gpu_bytes=dict(weights=eng.w.nbytes, kv_caches=eng.cache_bytes,
                                   workspace_and_other=used and used - eng.w.nbytes
                                   - eng.cache_bytes, total=used),
                    build_s=build_s, kernel_cache=_kernel_cache())
    t0 = time.perf_counter()
    eng.step()  # eager: compiles every kernel, allocates the lazy scratch
    eng.stream.synchronize()
    first_s = time.perf_counter() - t0
    if not device.SIMULATOR:  # (the simulator launches every step eagerly: nothing to capture)
        eng.step()  # captures the graph and replays it once
    p0 = ctx + 1 + int(not device.SIMULATOR)  # the timed steps' first position
    step_ms = _timed(lambda: [eng.step() for _ in range(tokens)], stream) / tokens
    extra = {}
    free1, _ = cuda.current_context().get_memory_info()  # (before the A/B's graphs and buffers)
    if decode_ab or decode_without:
        names = decode_ab if isinstance(decode_ab, list) else None if decode_ab else ["as landed"]
        extra["decode_ab"] = time_decode_variants(eng, p0, tokens, names=names,
                                                  without=decode_without)
    nb = bytes_per_token(eng, ctx)
    used = None if device.SIMULATOR else int(free0 - free1)  # (the simulator has no memory)
    if profile and not device.SIMULATOR:
        prof = profile_step(eng)
        extra.update(profile_ms=prof, profile_sum_ms=sum(prof.values()))
        if prefill:
            extra["prefill_profile"] = profile_chunk(eng.prefill(prefill_chunk), *last)
    if ncu:
        ncu_step(eng, graph=ncu == "graph")
    if ncu_prefill and prefill:
        ncu_chunk(eng.prefill(prefill_chunk), *last)
    return dict(
        **extra, **pre, preset_layers=cfg.n_layers, ctx=ctx, tokens=tokens, quant=quant,
        decode_tok_s=1e3 / step_ms, step_ms=step_ms,
        bytes_per_token=nb, achieved_gbs=nb["total"] / step_ms / 1e6,
        gpu_bytes=dict(weights=eng.w.nbytes, kv_caches=eng.cache_bytes,
                       workspace_and_other=used and used - eng.w.nbytes - eng.cache_bytes,
                       total=used),
        build_s=build_s, first_step_s=first_s, kernel_cache=_kernel_cache())


def _kernel_cache() -> str | None:
    """Where this process's compiled kernels are kept (kcache.py; None: off, or the simulator,
    which compiles nothing): a first chunk or step of seconds, not a minute, was loaded."""
    from ..kernels import kcache

    return None if device.SIMULATOR else kcache.directory()
