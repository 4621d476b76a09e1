"""`pocketfm plan`: its numbers are the allocation's (the caches, step and prefill buffers, weights
and retriever of real engines in the simulator), V4-Flash at 1M with and without KV swap, bad input.
No decode step runs here."""
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from pocketfm.cli import main
from pocketfm.engine import layout
from pocketfm.engine.layout import cache_layout, prefill_buffer_bytes, step_buffer_bytes
from pocketfm.plan import default_swap, plan_memory, retriever_bytes, weight_bytes
from pocketfm.presets import flash, tiny

CAP = 512


def cli(*args):
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stdout, res.stderr


def legacy_layer_shapes(cfg, i, capacity):
    """What LayerCache.__init__ allocated before it read layout.py (the reference for the specs)."""
    kvb = layout.kv_entry_bytes(cfg.head_dim, cfg.rope_dim)
    out = {"window": ((cfg.window, kvb), np.uint8)}
    r = cfg.ratio(i)
    if r:
        rows, width = (2 * r if cfg.is_csa(i) else r), cfg.coff(i) * cfg.head_dim
        out["comp"] = ((max(1, capacity // r), kvb), np.uint8)
        out["state_kv"] = out["state_score"] = ((rows, width), np.float32)
    if cfg.is_csa(i):
        DI = cfg.index_dim
        out["index_keys"] = ((max(1, capacity // r), layout.index_key_bytes(DI)), np.uint8)
        out["index_kv"] = out["index_score"] = ((2 * r, 2 * DI), np.float32)
    return out


def component_of(cfg, i, name):
    if name in ("state_kv", "state_score", "index_kv", "index_score"):
        return "compressor_state"
    if name == "comp":
        return "c4_kv_resident" if cfg.is_csa(i) else "c128_kv"
    return {"window": "window", "index_keys": "indexer_keys"}[name]


def test_sizes_are_the_kernels_and_the_step_kernels():
    from pocketfm.engine import step_kernels as sk
    from pocketfm.kernels import kvpack

    assert kvpack.kv_entry_bytes(512, 64) == 584 and kvpack.index_key_bytes(128) == 68
    assert layout.META_RATIOS == sk.META_RATIOS


@pytest.mark.parametrize("gpu_chunks", [None, 16])
def test_layer_caches_equal_the_plan(gpu_chunks):
    """Every layer's LayerCache of tiny at 512 tokens: the arrays of the old allocation (comp
    absent on CSA layers with swap), and their bytes per component are the plan's."""
    from numba import cuda

    from pocketfm.engine.decode import LayerCache

    cfg, s = tiny(), cuda.stream()
    specs = cache_layout(cfg, CAP, gpu_chunks)
    got, by_comp = {}, {}
    for i in range(cfg.n_layers):
        c = LayerCache(cfg, i, CAP, s, gpu_chunks=gpu_chunks)
        want = legacy_layer_shapes(cfg, i, CAP)
        if gpu_chunks is not None and cfg.is_csa(i):
            del want["comp"]
        arrays = {n: a for n, a in vars(c).items() if hasattr(a, "nbytes")}
        assert {n: (a.shape, a.dtype) for n, a in arrays.items()} == want, i
        assert c.ratio == cfg.ratio(i)
        for n, a in arrays.items():
            got[i, n] = a.shape
            k = component_of(cfg, i, n)
            by_comp[k] = by_comp.get(k, 0) + int(a.nbytes)
        assert c.nbytes == sum(int(a.nbytes) for a in arrays.values())
    assert got == {(sp.layer, sp.name): sp.shape for sp in specs if sp.layer >= 0}
    plan = plan_memory(cfg, CAP, gpu_chunks)["components"]
    for k in layout.COMPONENTS:
        assert plan[k]["gpu_bytes"] == by_comp.get(k, 0) + sum(
            sp.nbytes for sp in specs if sp.layer < 0 and sp.component == k and sp.where == "gpu")
    n_csa = sum(cfg.is_csa(i) for i in range(cfg.n_layers))
    kvb = layout.kv_entry_bytes(cfg.head_dim, cfg.rope_dim)
    if gpu_chunks is None:
        assert plan["c4_kv_pool"]["pinned_bytes"] == plan["c4_kv_staged"]["gpu_bytes"] == 0
    else:
        assert plan["c4_kv_resident"]["gpu_bytes"] == 0
        assert plan["c4_kv_staged"]["gpu_bytes"] == n_csa * gpu_chunks * kvb
        assert plan["c4_kv_pool"]["pinned_bytes"] == n_csa * (CAP // 4) * kvb


def test_engine_buffers_and_weights_equal_the_plan(tiny_q2_path):
    """A real DecodeEngine of tiny (ds4-q2 file) at 512 tokens: step buffers (every named one
    at its spec's shape), KV caches, uploaded weights and the prefill's buffers are the plan's;
    the --preset walk over make-model's table gives the file's bytes."""
    from pocketfm.engine.decode import DecodeEngine
    from pocketfm.weights import load_gguf

    f = load_gguf(tiny_q2_path)
    cfg = f.config
    eng = DecodeEngine(cfg, f.weights, CAP)
    assert eng.step_bytes == step_buffer_bytes(cfg, CAP)
    for sp in layout.step_buffer_specs(cfg, CAP):
        name, *part = sp.name.split(".")
        if name == "moe":
            a = getattr(eng.moe, part[0])
        elif name in ("X", "idx_in"):
            a = getattr(eng, name)[int(part[0])]
        elif name == "comp_in":
            a = eng.comp_in[int(part[0])][int(part[1])]
        else:
            a = getattr(eng, name)
        assert (a.shape, a.dtype) == (sp.shape, sp.dtype), sp.name
    plan = plan_memory(cfg, CAP, weights=f.weights, prefill_chunk=8)
    assert eng.cache_bytes == plan["gpu_kv_bytes"]
    assert eng.w.nbytes == plan["components"]["weights"]["gpu_bytes"] == weight_bytes(cfg)
    assert eng.prefill(8).nbytes == plan["components"]["prefill_workspace"]["gpu_bytes"]
    assert eng.prefill(8).nbytes == prefill_buffer_bytes(cfg, CAP, 8)


def test_swap_engine_equals_the_plan(tiny_q2_path):
    """With KV swap (16 slots, layer 3's indexer keys swapped, layer 1's kept: a retriever
    target): every array EngineSwap allocates is the plan's, GPU and pinned."""
    from pocketfm.engine.decode import DecodeEngine
    from pocketfm.kvswap.config import SwapPlanConfig
    from pocketfm.weights import load_gguf

    f = load_gguf(tiny_q2_path)
    cfg = f.config
    assert [i for i in range(cfg.n_layers) if cfg.is_csa(i)] == [1, 3]
    swap = SwapPlanConfig(True, 16, cfg.index_topk, 3, cap_mib=1024, key_layers=(3,))
    eng = DecodeEngine(cfg, f.weights, CAP, swap=swap)
    plan = plan_memory(cfg, CAP, 16, weights=f.weights, key_layers=(3,))
    for sp in layout.swap_specs(cfg, CAP, 16, (3,)):
        a = getattr(eng.swap, sp.name)
        assert (a.shape, a.dtype) == (sp.shape, sp.dtype), sp.name
    assert eng.caches[1].index_keys is not None and eng.caches[3].index_keys is None
    assert eng.cache_bytes == plan["gpu_kv_bytes"]
    assert eng.swap.pinned_bytes == plan["pinned_bytes"] == int(
        eng.swap.pool.nbytes + eng.swap.key_pool.nbytes + eng.swap.lut_host.nbytes
        + eng.swap.idx_host.nbytes)


def test_packed_matrix_bytes_scale_with_rows():
    """The weight walk prices a matrix as rows x one packed row: true of every type's planes."""
    from pocketfm.engine.device_weights import packed_row_bytes
    from pocketfm.kernels.gemv import pack_weight
    from pocketfm.quants import GGMLType, random_blocks

    rng = np.random.default_rng(0)
    for t in ("F32", "F16", "BF16", "Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "MXFP4"):
        qtype = GGMLType[t]
        raw = random_blocks(qtype, (2, 3, 256), rng, 0.02)
        assert pack_weight(raw, qtype, 3, 256).nbytes == 6 * packed_row_bytes(qtype, 256), t


def test_retriever_bytes_are_the_upload(tmp_path, tiny_q2_path):
    from pocketfm.kernels.retriever import DeviceRetrieverLayer
    from pocketfm.memory import make_retriever, save_retriever
    from pocketfm.weights import load_gguf

    f = load_gguf(tiny_q2_path)
    path = str(tmp_path / "ret.safetensors")
    ret = make_retriever(f.config, f.weights, "native", seed=1)
    save_retriever(path, ret)
    want = sum(DeviceRetrieverLayer.from_host(r).nbytes for r in ret.layers)
    assert retriever_bytes(path, f.config) == want > 0
    code, out, err = cli("plan", "--model", tiny_q2_path, "--ctx", "512", "--memory-indexer",
                         path, "--json")
    assert code == 0, err
    assert json.loads(out)["components"]["retriever"]["gpu_bytes"] == want


def test_flash_at_1m_with_and_without_swap():
    cfg = flash()
    n_csa = sum(cfg.is_csa(i) for i in range(cfg.n_layers))
    N = 1048576 // 4
    pool = n_csa * N * 584
    assert n_csa == 21 and pool == 21 * 262144 * 584
    slots, key_layers = default_swap(cfg)
    # two sets of KMAX 96 pages (the running window's, the next) + the region of 64 + 2 steps
    assert slots == 2 * 96 * 64 + 18 and len(key_layers) == n_csa - 3  # 3 retriever targets
    assert default_swap(cfg, lag=0)[0] == 96 * 64 + 17  # no overlap: one set
    code, out, err = cli("plan", "--preset", "flash", "--ctx", "1048576", "--kv-swap", "--json")
    assert code == 0, err
    p = json.loads(out)
    for key in ("gpu_kv_bytes", "pinned_bytes", "gpu_total_bytes", "components", "ctx",
                "kv_swap", "gpu_chunks", "paper_metric_bytes"):
        assert key in p, key
    c = p["components"]
    assert p["ctx"] == 1048576 and p["kv_swap"] is True and p["gpu_chunks"] == slots
    key_pool = (n_csa - 3) * N * 68
    assert c["c4_kv_pool"]["pinned_bytes"] == pool
    assert c["indexer_keys_pool"]["pinned_bytes"] == key_pool
    uploads = c["swap_table"]["pinned_bytes"]  # the LUT's and the copy lists' sources
    assert uploads == N * 4 + 4 * 2 * slots * 4
    assert p["pinned_bytes"] == pool + key_pool + uploads < 3.6e9  # the bound
    assert c["c4_kv_staged"]["gpu_bytes"] == n_csa * slots * 584
    assert c["indexer_keys_staged"]["gpu_bytes"] == (n_csa - 3) * slots * 68
    assert c["c4_kv_resident"]["gpu_bytes"] == 0
    keys = 3 * N * 68  # the retriever targets' FP4 indexer keys stay on the GPU
    assert c["indexer_keys"]["gpu_bytes"] == keys
    assert p["paper_metric_bytes"] == n_csa * slots * 584 + keys + (n_csa - 3) * slots * 68
    assert p["paper_metric_bytes"] <= 0.34e9 and p["gpu_kv_bytes"] <= 0.5e9  # the targets
    assert p["gpu_kv_bytes"] == sum(c[k]["gpu_bytes"] for k in (
        "window", "c4_kv_staged", "c128_kv", "indexer_keys", "indexer_keys_staged",
        "compressor_state", "swap_table"))
    assert p["gpu_total_bytes"] == sum(v["gpu_bytes"] for v in c.values())
    explicit = json.loads(cli("plan", "--preset", "flash", "--ctx", "1048576", "--kv-swap",
                              "--gpu-chunks", str(slots), "--json")[1])
    assert explicit == p
    code, out, err = cli("plan", "--preset", "flash", "--ctx", "1048576", "--json")
    q = json.loads(out)
    assert q["kv_swap"] is False and q["gpu_chunks"] is None and q["pinned_bytes"] == 0
    assert q["components"]["c4_kv_resident"]["gpu_bytes"] == pool
    assert q["paper_metric_bytes"] == pool + n_csa * N * 68
    # the table: MiB with one decimal
    code, out, _ = cli("plan", "--preset", "flash", "--ctx", "1048576", "--kv-swap")
    assert code == 0 and f"{pool / 2**20:.1f}" in out and "c4_kv_pool" in out


def test_weights_of_flash_match_the_file_size_of_its_mix():
    """ds4-q2 V4-Flash: the packed device planes of every uploaded matrix hold the GGUF bytes
    (Q8_0 / Q2_K / IQ2_XXS / F16 planes are byte for byte), embeddings and vectors aside."""
    from pocketfm.synthetic import file_bytes

    cfg = flash()
    got, gguf = weight_bytes(cfg), file_bytes(cfg, "ds4-q2")
    assert math.isclose(got, gguf, rel_tol=0.01), (got, gguf)


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_bad_input(tmp_path):
    code, _, err = cli("plan", "--model", str(tmp_path / "nope.gguf"), "--ctx", "4096")
    assert_one_line_error(code, err, "nope.gguf", "no such file")
    code, _, err = cli("plan", "--preset", "flash", "--ctx", "4096", "--gpu-chunks", "512")
    assert_one_line_error(code, err, "--gpu-chunks", "--kv-swap")
    code, _, err = cli("plan", "--ctx", "4096")
    assert_one_line_error(code, err, "--model", "--preset")
    code, _, err = cli("plan", "--preset", "tiny", "--ctx", "5000")
    assert_one_line_error(code, err, "--ctx 5000")
    code, _, err = cli("plan", "--preset", "tiny")
    assert_one_line_error(code, err, "--ctx")
    code, _, err = cli("plan", "--model", str(tmp_path / "x.gguf"), "--ctx", "64",
                       "--layers", "2")
    assert_one_line_error(code, err, "--layers 2", "--preset")
    code, _, err = cli("plan", "--preset", "tiny", "--ctx", "64", "--layers", "6")
    assert_one_line_error(code, err, "--layers 6", "1 to 5")


def test_first_layers_of_flash_fit_an_80gb_card():
    """bench --layers 30's geometry: its planned GPU bytes at 256K fit an H100's 79.6 GiB,
    the full model's do not; the weights scale with the layers kept."""
    full = json.loads(cli("plan", "--preset", "flash", "--ctx", "262144", "--json")[1])
    code, out, err = cli("plan", "--preset", "flash", "--ctx", "262144", "--layers", "30",
                         "--json")
    assert code == 0, err
    cut = json.loads(out)
    assert cut["model"] == "flash (first 30 layers)"
    assert full["gpu_total_bytes"] > 79.6 * 2**30 > cut["gpu_total_bytes"]
    w_full, w_cut = (p["components"]["weights"]["gpu_bytes"] for p in (full, cut))
    assert 0.6 < w_cut / w_full < 30 / 43 + 0.02
