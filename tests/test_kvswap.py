"""KV swap: the run configuration (flags + the seed's variables), its guards, and the engine with
the compressed KV in a host pool and the selected chunks in GPU staging slots (simulator)."""

import pytest
from click.testing import CliRunner

from pocketfm.cli import main
from pocketfm.errors import InputError
from pocketfm.generate import load
from pocketfm.kvswap.config import (PREFIX, SwapConfig, decode_region, plan_swap, read_env,
                                    swap_config, swap_line)
from pocketfm.memory import MemoryIndexer, SelectionConfig
from pocketfm.model import Forward
from pocketfm.presets import tiny


def _memory(cfg, **sel):
    fw = Forward(cfg, None)
    return MemoryIndexer(cfg, SelectionConfig(**sel), None, fw.freq_compressed, fw.hadamard)


# ---- configuration -------------------------------------------------------------------------------
def test_env_is_read_and_flags_win():
    env = {PREFIX + "KV_SWAP": "1", PREFIX + "KV_SWAP_GPU_CHUNKS": "640",
           PREFIX + "KV_SWAP_PINNED_MIB": "2048", PREFIX + "KV_SWAP_VALIDATE": "1",
           PREFIX + "MEM_PROFILE": "0"}
    cfg, mem = swap_config(dict(gpu_chunks=None, pinned_mib=4096), env)
    assert cfg == SwapConfig(kv_swap=True, gpu_chunks=640, pinned_mib=4096, validate=True,
                             mem_profile=False)
    assert mem.checkpoint is None and mem.selection is None
    got, _ = read_env({PREFIX + "KV_SWAP_GPU_CHUNKS": "0"})  # the seed: 0 = the default
    assert got == {"gpu_chunks": None}
    _, mem = read_env({PREFIX + "FLASHMEMORY_PLUGIN": "1", PREFIX + "FLASHMEMORY_CKPT": "x.st",
                       PREFIX + "FLASHMEMORY_RUNTIME_SCORING": "1",
                       PREFIX + "FLASHMEMORY_ENSEMBLE": "mean"})
    assert (mem.checkpoint, mem.selection, mem.ensemble) == ("x.st", "global-topk", "mean")


@pytest.mark.parametrize("env, needle", [
    ({"KV_SWAP": "1", "SPARSE_COMPRESSOR": "0"}, "KV_SWAP requires POCKETLLM_GGUF_SPARSE_COMPRESSOR=1"),
    ({"SPARSE_INDEXER": "0"}, "always runs the lightning indexer"),
    ({"KV_SWAP_PINNED_MIB": "0"}, "KV_SWAP_PINNED_MIB must be > 0"),
    ({"KV_SWAP_GPU_CHUNKS": "-3"}, "KV_SWAP_GPU_CHUNKS must be >= 0"),
    ({"KV_SWAP_SYNC": "2"}, "KV_SWAP_SYNC must be 0 or 1"),
    ({"FLASHMEMORY_PLUGIN": "1"}, "FLASHMEMORY_PLUGIN requires POCKETLLM_GGUF_FLASHMEMORY_CKPT"),
    ({"FLASHMEMORY_ENSEMBLE": "sum"}, "FLASHMEMORY_ENSEMBLE must be 'max' or 'mean'"),
    ({"FLASHMEMORY_SRC_LAYER": "2"}, "own indexer keys"),
    ({"FLASHMEMORY_METADATA_ONLY": "0"}, "requires POCKETLLM_GGUF_FLASHMEMORY_RUNTIME_SCORING=1"),
    ({"KV_SWAP_SIZE": "1"}, "not a variable pocketfm reads"),
])
def test_bad_env_one_line(env, needle):
    with pytest.raises(InputError) as e:
        read_env({PREFIX + k: v for k, v in env.items()})
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InputError, match="renamed"):
        read_env({"DSV4_GGUF_KV_SWAP": "1"})


def _lookahead(kmax, tail=4, page=4, interval=8, topk=0):
    """What plan_swap reads of a lookahead MemoryIndexer (a real one needs a checkpoint)."""
    from types import SimpleNamespace

    sel = SelectionConfig(mode="lookahead", kmax=kmax, recency_tail=tail, interval=interval,
                          topk=topk)
    return SimpleNamespace(sel=sel, tail=tail, page=page, kmax_default=kmax)


def test_guards_auto_disable_and_topk_override():
    cfg = tiny().replace(index_topk=32)
    mem = _lookahead(kmax=4)
    need = 4 * 4 + decode_region(8)  # --kv-swap-sync: no lag, one set + its decode region
    plan = plan_swap(SwapConfig(kv_swap=True, sync=True), cfg, 4096, mem)
    assert plan.enabled and plan.gpu_chunks == max(need, cfg.index_topk) and plan.region == 3
    assert plan.lag == 0
    # overlapped (the default): lag 2, a region for 8 + 2 steps, room for two sets
    over = plan_swap(SwapConfig(kv_swap=True), cfg, 4096, mem)
    assert (over.lag, over.region, over.gpu_chunks) == (2, 4, 2 * 16 + 4)
    assert "commit_lag=2" in swap_line(SwapConfig(kv_swap=True), over, 1.0)
    short = plan_swap(SwapConfig(kv_swap=True), cfg, 4096, _lookahead(kmax=4, interval=2))
    assert short.lag == 1  # less than the interval
    with pytest.raises(InputError, match="must be >= index_topk"):
        plan_swap(SwapConfig(kv_swap=True, gpu_chunks=20), cfg, 4096, mem)
    low = plan_swap(SwapConfig(kv_swap=True, gpu_chunks=need, allow_topk_reduction=True,
                               sync=True), cfg, 4096, mem)
    assert low.enabled and low.index_topk == need < cfg.index_topk  # the seed's override
    with pytest.raises(InputError, match=f"need >= {need}"):
        plan_swap(SwapConfig(kv_swap=True, gpu_chunks=need - 1, allow_topk_reduction=True,
                             sync=True), cfg, 4096, mem)
    # fewer slots than two sets still run: the misses that find no free slot wait (late)
    assert plan_swap(SwapConfig(kv_swap=True, gpu_chunks=need + 1, allow_topk_reduction=True),
                     cfg, 4096, mem).enabled
    off = plan_swap(SwapConfig(kv_swap=True, gpu_chunks=64), cfg, 256, mem)  # 64 chunks fit
    assert not off.enabled and off.reason == "no_layer_with_compressed_cap_gt_gpu_chunks"
    assert swap_line(SwapConfig(kv_swap=True), off, 0.0).startswith(
        "gguf_kv_swap=0 reason=no_layer_with_compressed_cap_gt_gpu_chunks requested=1")
    with pytest.raises(InputError, match="needs a Memory Indexer"):
        plan_swap(SwapConfig(kv_swap=True), cfg, 4096, None)
    with pytest.raises(InputError, match="not supported"):
        plan_swap(SwapConfig(kv_swap=True), cfg, 4096, _memory(cfg, mode="full"))
    with pytest.raises(InputError, match="unbounded"):
        plan_swap(SwapConfig(kv_swap=True), cfg, 4096, _lookahead(kmax=0))
    rec = plan_swap(SwapConfig(kv_swap=True, gpu_chunks=40), cfg, 4096,
                    _memory(cfg, mode="recency", recency_tail=30, interval=16))
    assert rec.enabled and rec.region == 6  # 30 + ceil((16 + 2) / 4) + 1 <= 40
    pinned = plan_swap(SwapConfig(kv_swap=True, gpu_chunks=40), cfg, 4096,
                       _memory(cfg, mode="recency", recency_tail=30, interval=16, commit_lag=0))
    assert pinned.lag == 0 and pinned.region == 5  # --commit-lag wins


@pytest.mark.parametrize("args, env, needle", [
    (["--kv-swap", "--selection", "recency", "--device", "cpu"], {}, "needs --device cuda"),
    (["--gpu-chunks", "64"], {}, "--gpu-chunks: only meaningful with --kv-swap"),
    (["--kv-swap", "--selection", "recency", "--device", "cpu"],
     {PREFIX + "KV_SWAP_PINNED_MIB": "0"}, "KV_SWAP_PINNED_MIB must be > 0"),
    (["--device", "cpu"], {PREFIX + "KV_SWAP_TYPO": "1"}, "not a variable pocketfm reads"),
])
def test_run_kv_swap_bad_input(tiny_q2_path, args, env, needle):
    r = CliRunner().invoke(main, ["run", "--model", tiny_q2_path, "--max-tokens", "1"] + args,
                           env=env)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith("error:") and needle in lines[-1], r.output


# ---- the engine ---------------------------------------------------------------------------------
PROMPT = [1, 72, 305, 17, 409, 88, 3, 250, 111]  # 9 tokens: 2 CSA entries


def test_swap_equals_all_resident_with_validation(micro_path):
    """Greedy tokens with the KV swapped (3 staging slots for 8 chunks; a cycle every step,
    a one-chunk resident set: evictions, swap-ins and stores happen) equal the NumPy forward's
    with the same selection; VALIDATE compares every staged slot with the pool each cycle.
    (The engine without swap equals the NumPy forward too: test_engine.py.)"""
    sel = SelectionConfig(mode="random", interval=1, recency_tail=0, random_ratio=0.05, seed=3)
    cpu = load(micro_path, device="cpu")
    ref = cpu.generate(PROMPT, max_tokens=5, stop_at_eos=False, ctx=32,
                       memory=cpu.memory_indexer(sel))
    gpu = load(micro_path, device="cuda")
    lines = []
    got = gpu.generate(PROMPT, max_tokens=5, stop_at_eos=False, ctx=32,
                       memory=gpu.memory_indexer(sel), log=lines.append,
                       kv_swap=SwapConfig(kv_swap=True, gpu_chunks=3, validate=True))
    assert got.tokens == ref.tokens
    assert [c["resident"] for c in got.extra["memory_cycles"]] == \
        [c["resident"] for c in ref.extra["memory_cycles"]]
    st = got.extra["kv_swap"]
    assert lines[0].startswith("gguf_kv_swap=1 requested=1 gpu_chunks=3")
    assert lines[1].startswith("gguf_kv_cache max_capacity=32 sparse_layers=") and \
        "pinned_gib=" in lines[1]
    assert lines[-1].startswith("gguf_kv_swap_stats layers=") and "stores=" in lines[-1]
    assert st["cycles"] == 4 and st["misses"] > 0 and st["evictions"] > 0
    assert st["stores"] == 3 and st["validated_rows"] > 0  # 2 by the prompt, 1 from staging
    eng = gpu._engine
    assert eng.swap is not None and all(c.comp is None for i, c in enumerate(eng.caches)
                                        if gpu.config.is_csa(i))


def test_overlapped_swap_equals_the_cpu_with_the_same_commit_lag(micro_path):
    """The overlapped swap: each set staged beside the next step and in force one step after
    its boundary (commit lag 1, on the CPU too), 3 slots = one set + the decode region, so the
    misses go into slots the running window reads: they wait for the switch (late). The chunk
    formed by the direct step in the first lag is gathered into its reserved slot."""
    sel = SelectionConfig(mode="random", interval=2, recency_tail=0, random_ratio=0.05, seed=3,
                          commit_lag=1)  # (seed 3: chunk 1, then chunk 0: a miss each cycle)
    prompt = PROMPT + [5]  # 10 tokens: chunk 2 forms at step 1, inside the first lag
    cpu = load(micro_path, device="cpu")
    ref = cpu.generate(prompt, max_tokens=5, stop_at_eos=False, ctx=32,
                       memory=cpu.memory_indexer(sel))
    gpu = load(micro_path, device="cuda")
    got = gpu.generate(prompt, max_tokens=5, stop_at_eos=False, ctx=32,
                       memory=gpu.memory_indexer(sel),
                       kv_swap=SwapConfig(kv_swap=True, gpu_chunks=3, validate=True))
    assert got.tokens == ref.tokens
    cyc, ref_cyc = got.extra["memory_cycles"], ref.extra["memory_cycles"]
    assert [(c["step"], c["commit_step"], c["resident"]) for c in cyc] == \
        [(c["step"], c["commit_step"], c["resident"]) for c in ref_cyc] == \
        [(0, 1, 1), (2, 3, 1)]
    st = got.extra["kv_swap"]
    assert st["cycles"] == 2 and st["validated_rows"] > 0
    # the first cycle's miss is early (no staged window runs yet), the second one's is late
    assert (st["misses"], st["late_misses"]) == (2, 1)


def test_mem_line_is_the_seeds_format():
    from pocketfm.engine.kvswap import mem_line

    assert mem_line("after_kv_cache", 100 * 2**30, 140 * 2**30) == (
        "gguf_mem tag=after_kv_cache tp_rank=0 free_gib=100.00 total_gib=140.00 used_gib=40.00")


def test_pinned_cap_is_checked_before_allocation():
    from pocketfm.engine.kvswap import MIB, checked_pinned_bytes, pinned_pool_bytes

    cfg = tiny()
    need = pinned_pool_bytes(cfg, 1 << 20, 64, (3,))
    assert checked_pinned_bytes(cfg, 1 << 20, 64, (3,), need // MIB + 1) == need
    with pytest.raises(InputError, match=r"KV swap pinned cache exceeds cap: required_mib=\S+ "
                                         r"cap_mib=1 "):
        checked_pinned_bytes(cfg, 1 << 20, 64, (3,), 1)
