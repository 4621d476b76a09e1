"""`pocketfm bench`: bad input, and one simulated run of the tiny geometry (the GPU numbers are
in BENCHMARKS.md; here the command's plumbing: weights made on the device, cache fill, JSON)."""
import json

import pytest
from click.testing import CliRunner

from pocketfm.cli import main


def bench(*args):
    res = CliRunner().invoke(main, ["bench", *args])
    return res.exit_code, res.stdout, res.stderr


def test_bench_context_beyond_the_model():
    code, _, err = bench("--preset", "tiny", "--ctx", "5000")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --ctx 5000"), err


def test_bench_prefill_beyond_the_model():
    code, _, err = bench("--preset", "tiny", "--ctx", "4000", "--prefill", "100")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--prefill 100" in lines[0], err


def test_bench_tiny_in_the_simulator():
    """A 42-position fill, then 2 tokens through the chunked prefill (the second completes a
    CSA entry: position 43), then one decode step (and the --ncu-step one, eager on one
    stream, and the --ncu-chunk chunk again: no profiler in the simulator). A simulated
    prefill token costs seconds: 2, not 4."""
    code, out, err = bench("--preset", "tiny", "--ctx", "42", "--prefill", "2",
                           "--prefill-chunk", "2", "--tokens", "1", "--ncu-step", "--ncu-chunk",
                           "--json")
    assert code == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["ctx"] == 44 and r["decode_tok_s"] > 0
    assert r["kernel_cache"] is None  # (the simulator compiles nothing to keep)
    assert r["prefill_tokens"] == 2 and r["prefill_tok_s"] > 0 and r["prefill_chunk"] == 2
    chunks = r["prefill_chunks_s"]  # each chunk's time: one chunk, the whole prefill
    assert len(chunks) == 1 and 0 < chunks[0] <= r["prefill_s"]
    nb = r["bytes_per_token"]
    # tiny at ctx 44, 200-byte entries and 36-byte keys: 5 windows of 16 entries; 2 CSA layers
    # attending their top 8 of 11 entries after scoring all 11 keys; 1 HCA layer reading 5
    assert nb["kv_and_index"] == 200 * (5 * 16 + 2 * 8 + 5) + 2 * 11 * 36
    assert nb["total"] == nb["weights"] + nb["routed_experts"] + nb["kv_and_index"]
    assert r["gpu_bytes"]["weights"] > nb["weights"] > 0


def test_bench_ncu_graph_in_the_simulator():
    """--ncu-graph: the one more step with the engine's side streams (no profiler in the
    simulator: the step just runs); with --ncu-step too, a one-line error."""
    code, out, err = bench("--preset", "tiny", "--ctx", "42", "--tokens", "1", "--ncu-graph",
                           "--json")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["decode_tok_s"] > 0
    code, _, err = bench("--preset", "tiny", "--ctx", "42", "--ncu-step", "--ncu-graph")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--ncu-graph" in lines[0], err


def test_bench_kv_swap_in_the_simulator():
    """The swap bench's plumbing: a lookahead-shaped set of 24 pages (tiny: KMAX 24 pages of
    4 chunks) in 100 slots of 105 chunks, staged every 2 replays and in force 1 replay later."""
    code, out, err = bench("--preset", "tiny", "--ctx", "420", "--tokens", "3", "--kv-swap",
                           "--gpu-chunks", "100", "--interval", "2", "--json")
    assert code == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    st = r["kv_swap"]
    # (24 pages, the newest one partial: 93 chunks at first, 94 as the context grows)
    assert 90 < r["swap_in_rows"] <= 96 and 90 < r["swap_resident_chunks"] <= 96
    assert r["decode_tok_s"] > 0
    assert st["gpu_chunks"] == 100 and st["cycles"] == 3  # the first commit + 2 windows
    # the churned pages' 4 misses fit the 5 slots the first set left free: none waits
    assert st["misses"] == r["swap_in_rows"] + 4 and st["late_misses"] == 0


@pytest.mark.parametrize("flag", ["--ncu-chunk", "--prefill-ab"])
def test_bench_chunk_flags_need_a_prefill(flag):
    code, _, err = bench("--preset", "tiny", "--ctx", "42", flag)
    lines = err.strip().splitlines()
    assert code == 2 and lines == [f"error: {flag}: needs --prefill N (the chunk it times "
                                   "again)"], err


def test_prefill_variants_time_the_chunk_and_restore_the_settings(micro_path, monkeypatch):
    """`bench --prefill-ab`'s timing in the simulator (one variant, one round: a simulated
    chunk costs seconds): every variant names settings the prefill has, each variant's time
    comes back, and the prefill's settings are as they were after it."""
    from pocketfm.engine.bench import _prefill_variants, time_prefill_variants
    from pocketfm.engine.prefill import BRANCH_SITES
    from pocketfm.generate import load

    eng = load(micro_path, device="cuda").engine(8)
    eng.start([1, 72, 305, 17])
    pf = eng.prefill(2)
    variants = _prefill_variants()
    assert {k for v in variants.values() for k in v} <= set(vars(pf))
    r = time_prefill_variants(pf, 0, 2, rounds=1, names=["q norm + RoPE as launches"])
    assert list(r) == ["q norm + RoPE as launches"] and r[list(r)[0]]["best_s"] > 0
    assert pf.fold_q_norm_rope and pf.branches and pf.branch_sites == set(BRANCH_SITES)
    # the 64-token candidate is off unless POCKETFM_HMMA_T64=1 turns it on for a run
    assert pf.routed_tokens == pf.dense_tokens == 32
    assert variants["routed experts in 64-token tiles"] == dict(routed_tokens=64)
    assert variants["dense Q8_0 in 64-token tiles"] == dict(dense_tokens=64)
    monkeypatch.setenv("POCKETFM_HMMA_T64", "1")
    pf64 = eng.prefill(3)
    assert pf64.routed_tokens == pf64.dense_tokens == 64


def test_decode_variants_time_the_step_and_restore_the_settings(micro_path):
    """`bench --decode-ab`'s timing in the simulator (one variant, one round, one step):
    every variant names settings the engine has, each variant's time comes back, the engine's
    settings are as they were after it, and the next step is captured anew."""
    from pocketfm.engine.bench import _decode_variants, time_decode_variants
    from pocketfm.generate import load

    eng = load(micro_path, device="cuda").engine(8)
    eng.start([1, 72, 305, 17])
    variants = _decode_variants()
    assert {k for v in variants.values() for k in v} <= set(vars(eng))
    assert variants["one stream"] == dict(branches=False)
    r = time_decode_variants(eng, 0, 1, rounds=1, names=["one stream"])
    assert list(r) == ["one stream"] and r["one stream"]["best_ms"] > 0
    assert eng.branches and eng._graph is None


def test_decode_without_leaves_the_kernels_launches_out(micro_path):
    """`bench --decode-without REGEX` in the simulator: its row is the step as landed without
    the launches of the kernels the pattern names (counted, one step's), which leave their
    outputs as they were; the pattern holds only for its row, and a top-k left out leaves its
    workspace zeroed for the rows after it (the scorer counts into it)."""
    import numpy as np

    from pocketfm.engine.bench import time_decode_variants, without_row
    from pocketfm.generate import load
    from pocketfm.kernels import leave_out
    from pocketfm.kernels.indexer import default_topk_workspace

    eng = load(micro_path, device="cuda").engine(8)
    eng.start([1, 72, 305, 17])
    cfg, ids = eng.cfg, eng.moe.ids
    stale = np.arange(cfg.n_experts_used, dtype=np.int32)[::-1].reshape(ids.shape) + 1
    ids.copy_to_device(np.ascontiguousarray(stale))
    r = time_decode_variants(eng, 0, 1, rounds=1, names=[], without=["route_group_rank"])
    row = without_row("route_group_rank")
    assert list(r) == [row] and r[row]["best_ms"] > 0
    assert r[row]["left_out"] == {"_route_group_rank": cfg.n_layers}  # one a MoE sublayer
    assert np.array_equal(ids.copy_to_host(), stale)  # the routing never ran
    assert not leave_out._PATTERNS
    r = time_decode_variants(eng, 0, 1, rounds=1, names=["as landed"])
    assert "left_out" not in r["as landed"] and not np.array_equal(ids.copy_to_host(), stale)
    work = default_topk_workspace(eng.stream)
    work.copy_to_device(np.full(work.size, 3, np.int32))  # (as counts no top-k cleared)
    r = time_decode_variants(eng, 0, 1, rounds=1, names=[], without=["topk_radix"])
    csa = sum(cfg.is_csa(i) for i in range(cfg.n_layers))
    assert r[without_row("topk_radix")]["left_out"] == {"_topk_radix_select": csa} and csa
    assert not work.copy_to_host().any()


def test_decode_without_bad_patterns():
    """--decode-without: not a regular expression, or the scorer without the top-k that reads
    its counts: one line, exit 2, before any weights are made."""
    for pattern, says in (("(", "not a regular expression"),
                          ("scores_warp", "leaves out the indexer scorer but not the top-k")):
        code, _, err = bench("--preset", "tiny", "--ctx", "64", "--decode-without", pattern)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"error: --decode-without {pattern!r}: {says}"), err


def test_decode_ab_only_keeps_the_variants_named():
    """--decode-ab-only TEXT: the step as landed and the variants whose names contain TEXT
    (any of several, case-insensitive); one that names none is refused with the names."""
    from pocketfm.engine.bench import decode_variant_names

    assert decode_variant_names(["SPREAD over 8", "query as a GEMV"]) == [
        "as landed", "the combine spread over 8 groups",
        "the indexer query as a GEMV, then hadamard_fp4 (before)"]
    code, _, err = bench("--preset", "tiny", "--ctx", "64", "--decode-ab-only", "no such row")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: --decode-ab-only no such row: no --decode-ab variant")
    assert "one stream" in lines[0]


def test_bench_profiling_is_refused_with_kv_swap():
    for flag in ("--profile", "--ncu-step", "--ncu-graph", "--ncu-chunk", "--decode-ab",
                 "--decode-without"):
        extra = ["scores_warp|topk"] if flag == "--decode-without" else []  # (a valid one)
        code, _, err = bench("--preset", "tiny", "--ctx", "420", "--kv-swap", "--gpu-chunks",
                             "100", flag, *extra)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag}:"), err


def test_bench_kv_swap_bad_input():
    code, _, err = bench("--preset", "tiny", "--ctx", "420", "--kv-swap", "--interval", "2",
                         "--commit-lag", "2")
    assert code == 2 and "--commit-lag 2: expected < --interval 2" in err, err
    code, _, err = bench("--preset", "tiny", "--ctx", "420", "--commit-lag", "1")
    assert code == 2 and "--commit-lag: only meaningful with --kv-swap" in err, err


def test_bench_layers_out_of_range():
    for n in ("0", "6"):
        code, _, err = bench("--preset", "tiny", "--ctx", "42", "--layers", n)
        lines = err.strip().splitlines()
        assert code == 2 and lines == [f"error: --layers {n}: expected 1 to 5 (the model's "
                                       "layers)"], err


def test_first_layers_keeps_each_layer_as_in_the_model():
    from pocketfm.presets import first_layers, preset

    full = preset("flash")
    cut = first_layers(full, 30)
    assert cut.n_layers == 30 and cut.compress_ratios == full.compress_ratios[:30]
    assert cut.n_hash_layers == full.n_hash_layers and cut.dim == full.dim
    assert cut.n_params() < 0.75 * full.n_params()
    assert first_layers(preset("tiny"), 1).n_hash_layers == 1


def test_bench_first_layers_in_the_simulator():
    """--layers 2 of tiny: a window-only layer and a CSA one, so the bytes read are theirs (at
    ctx 42, 10 compressed entries: all 10 keys scored, the top 8 attended)."""
    code, out, err = bench("--preset", "tiny", "--ctx", "42", "--tokens", "1", "--layers", "2",
                           "--json")
    assert code == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["layers"] == 2 and r["decode_tok_s"] > 0
    assert r["bytes_per_token"]["kv_and_index"] == 200 * (2 * 16 + 8) + 10 * 36


def test_profiled_launchers_exist():
    """`bench --profile` wraps these module attributes by name: a launcher renamed or no longer
    imported must fail here, not on the GPU (the prefill's list named "rope" after the fold
    into the attention had removed that import)."""
    from pocketfm.engine import bench as b, decode, prefill
    from pocketfm.kernels import hmma

    for module, names in ((decode, b.PROFILED), (prefill, b.PREFILL_PROFILED),
                          (hmma, b.HMMA_PROFILED)):
        missing = [n for n in names if not callable(getattr(module, n, None))]
        assert not missing, (module.__name__, missing)


def test_fill_caches_draws_distinct_index_keys(micro_path):
    """The bench's synthetic caches: a layer's indexer keys are (nearly) all distinct rows, as a
    real model's, not the weights' 256-row pool (whose repeats tie the top-k's scores 256 ways,
    a cost real keys do not have); the window and compressed rows are filled too."""
    from pocketfm.engine.bench import fill_caches
    from pocketfm.generate import load

    eng = load(micro_path, device="cuda").engine(4096)
    fill_caches(eng, 3000)
    layers = [i for i in range(len(eng.caches)) if eng.keys_of(i) is not None]
    assert layers
    for i in layers:
        keys = eng.keys_of(i).copy_to_host()
        assert keys.shape[0] > 512, keys.shape  # more rows than the weights' pool
        distinct = len({r.tobytes() for r in keys})
        assert distinct >= 0.6 * keys.shape[0], (i, distinct, keys.shape)  # hashed: ~63%+
        assert eng.caches[i].window.copy_to_host().any()
