"""The Memory Indexer on the NumPy path: scorer invariants, selection rules, cadence, checkpoints,
and generation with each selection mode (flashmemory.md §15)."""
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from pocketfm import ops
from pocketfm.cli import main
from pocketfm.errors import InputError
from pocketfm.generate import load
from pocketfm.kernels.kvpack import index_key_bytes, pack_index_key_ref, unpack_index_key_ref
from pocketfm.memory import (MemoryIndexer, SelectionConfig, load_retriever, make_retriever,
                             save_retriever)
from pocketfm.memory.checkpoint import RetrieverGeometry, csa_layers, default_clids
from pocketfm.memory.safetensors_io import read_safetensors, write_safetensors
from pocketfm.memory.scorer import (retriever_logits_keys_ref, retriever_logits_ref,
                                    retriever_query_ref, split_key_scale)
from pocketfm.memory.selection import edge_chunks, ensemble_keep, select_chunks, select_pages
from pocketfm.numerics import fp4_roundtrip, hadamard_matrix, rope_tables
from pocketfm.presets import flash, small, tiny


@pytest.fixture(scope="module")
def model(tiny_q2_path):
    return load(tiny_q2_path, device="cpu")


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ret") / "tiny-ret.safetensors")
    save_retriever(path, make_retriever(model.config, model.weights, "native", seed=3))
    return path


def prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


# ---- scorer invariants ------------------------------------------------------------------------
def test_hadamard_orthonormal():
    H = hadamard_matrix(128)
    np.testing.assert_allclose(H @ H.T, np.eye(128), atol=1e-12)
    x = np.random.default_rng(0).standard_normal((3, 128))
    np.testing.assert_allclose((x @ H) @ H, x, atol=1e-12)


def _scorer_inputs(H, DI, N):
    """Fresh q [H, DI], signed w [H] and FP4-exact keys [N, DI] of very different sizes."""
    rng = np.random.default_rng()
    q, w = rng.standard_normal((H, DI)), rng.standard_normal(H)
    mags = np.exp2(rng.integers(-6, 4, (N, 1)))
    keys = fp4_roundtrip((rng.standard_normal((N, DI)) * mags).astype(np.float32))
    return q.astype(np.float32), w.astype(np.float32), keys


def test_scale_factors_out_after_the_head_sum():
    H, DI, N = 16, 128, 50
    q, w, keys = _scorer_inputs(H, DI, N)
    packed = np.empty((N, index_key_bytes(DI)), np.uint8)
    pack_index_key_ref(packed, keys)
    back = np.empty_like(keys)
    unpack_index_key_ref(back, packed)
    np.testing.assert_array_equal(back, keys)  # the packed store is exact for FP4 keys
    unit, scale = split_key_scale(keys)
    np.testing.assert_array_equal(unit * scale[:, None], keys)
    assert np.all(np.log2(scale) == np.round(np.log2(scale))) and np.all(np.abs(unit) <= 1)
    z = np.empty(N, np.float32)
    retriever_logits_ref(z, q, w, unit, scale)
    direct = np.maximum(keys.astype(np.float64) @ q.T.astype(np.float64), 0) @ w
    np.testing.assert_allclose(z, direct, rtol=1e-5, atol=1e-5 * np.abs(direct).max())
    z2 = np.empty(N, np.float32)
    ops.indexer_scores(z2[None], q[None], w[None], keys)
    np.testing.assert_allclose(z, z2, rtol=1e-5, atol=1e-5 * np.abs(direct).max())


def test_two_head_groups_sum_to_the_full_logit():
    N = 30
    q, w, keys = _scorer_inputs(128, 128, N)
    full, a, b = (np.empty(N, np.float32) for _ in range(3))
    retriever_logits_keys_ref(full, q, w, keys)
    retriever_logits_keys_ref(a, q[:64], w[:64], keys)
    retriever_logits_keys_ref(b, q[64:], w[64:], keys)
    np.testing.assert_allclose(a + b, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_query_rope_identity_at_zero_and_position_clamp(model):
    cfg = model.config
    ret = make_retriever(cfg, None, "random", seed=1)
    r, DI = ret.layers[0], cfg.index_dim
    x = np.random.default_rng(2).standard_normal(cfg.dim).astype(np.float32)
    Hd = hadamard_matrix(DI).astype(np.float32)
    freq = model.forward.freq_compressed

    def query(p, bf16=False):
        q, w = np.empty((r.heads, DI), np.float32), np.empty(r.heads, np.float32)
        cos, sin = rope_tables(freq, np.array([p]), np.float32)
        retriever_query_ref(q, w, x, r, cos, sin, Hd, bf16)
        return q, w

    q0, w = query(0)
    a = r.wq_a @ x
    a = a / np.sqrt(np.mean(a * a) + 1e-6) * r.q_norm
    np.testing.assert_allclose(q0, (r.wq_b @ a).reshape(r.heads, DI) @ Hd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w, r.weights_proj @ x / math.sqrt(DI * r.heads), rtol=1e-6)
    assert math.isclose(1 / math.sqrt(128 * 128), 1 / 128)  # the official 1/128 weight scale
    mem = MemoryIndexer(cfg, SelectionConfig(), ret, freq, Hd)
    big = mem.max_position - 1
    assert not np.allclose(query(big)[0], query(big - 7)[0])


def test_native_init_reproduces_the_native_indexer(tiny_path):
    """Initialised from the model's indexer with its own heads and rank (and no bf16 or FP4
    rounding), the retriever's logits ARE the native indexer's scores: the same q path, RoPE
    convention, Hadamard and weight scale."""
    m = load(tiny_path, device="cpu", qat=False)
    cfg = m.config
    ret = make_retriever(cfg, m.weights, "native", heads=cfg.index_heads, rank=cfg.q_rank)
    seen = {}

    class Capture:
        def begin(self, pos0, T):
            self.pos = pos0 + T - 1

        def observe(self, layer, u):
            seen[("x", layer)] = u[-1].copy()

        def select(self, layer, scores, n_vis, chosen):
            seen[("s", layer)] = scores[-1].copy()
            return chosen

        def end(self, state):
            seen["pos"] = self.pos

    m.forward.memory = Capture()
    state = m.new_state(64)
    m.forward.forward(prompt(40), state)
    m.forward.memory = None
    Hd = hadamard_matrix(cfg.index_dim).astype(np.float32)
    cos, sin = rope_tables(m.forward.freq_compressed, np.array([seen["pos"]]), np.float32)
    for r in ret.layers:
        q, w = np.empty((r.heads, cfg.index_dim), np.float32), np.empty(r.heads, np.float32)
        retriever_query_ref(q, w, seen[("x", r.layer)], r, cos, sin, Hd, bf16_rope=False)
        n = 40 // 4
        z = np.empty(n, np.float32)
        retriever_logits_keys_ref(z, q, w, state.layers[r.layer].index_keys[:n])
        native = seen[("s", r.layer)][:n]
        np.testing.assert_allclose(z, native, rtol=1e-4, atol=1e-4 * np.abs(native).max())


# ---- selection rules --------------------------------------------------------------------------
def test_max_ensemble_threshold_is_some_logit_positive():
    rng = np.random.default_rng()
    z = rng.standard_normal((3, 400)) * 10.0 ** rng.integers(-40, 2, (3, 400))
    z[:, :3] = [[0.0, -0.0, -1e-30]] * 3
    z[:, 3] = [-1.0, 1e-30, -2.0]  # σ(1e-30) is exactly 0.5 in floating point: still kept
    for how in ("max", "or"):
        keep, e = ensemble_keep(z, how, 0.5)
        np.testing.assert_array_equal(keep, (z > 0).any(axis=0))
        assert keep[3] and e[3] == 0.5 and not keep[:3].any()
    keep, e = ensemble_keep(z, "mean", 0.5)
    np.testing.assert_array_equal(keep, e > 0.5)


def test_topk_mode_keeps_exactly_k():
    z = np.random.default_rng().standard_normal((3, 500))
    for K in (1, 17, 500):
        for how in ("max", "mean"):
            keep, _ = ensemble_keep(z, how, 0.5, topk=K)
            assert keep.sum() == K
    keep, _ = ensemble_keep(np.zeros((1, 10)), "max", 0.5, topk=3)  # ties: lowest ids
    assert list(np.flatnonzero(keep)) == [0, 1, 2]


def test_recency_tail_counts_chunks():
    recent, first = edge_chunks(100, 10, 3)
    assert list(np.flatnonzero(recent)) == list(range(90, 100))
    assert list(np.flatnonzero(first)) == [0, 1, 2]
    keep = np.zeros(100, bool)
    keep[40] = True
    assert list(np.flatnonzero(select_chunks(keep, 10, 3))) == [0, 1, 2, 40] + list(
        range(90, 100))


@pytest.mark.parametrize("n,tail,sink,kmax", [(1000, 130, 0, 5), (1000, 130, 70, 6),
                                              (990, 20, 0, 100), (300, 1000, 0, 2)])
def test_page_selection_forces_the_tail(n, tail, sink, kmax):
    page, rng = 64, np.random.default_rng()
    keep = rng.random(n) < 0.2
    keep[192:256] = True  # one dense page (page 3) must win its place
    resident, pages = select_pages(keep, page, kmax, tail, sink)
    n_pages = -(-n // page)
    K = min(kmax, n_pages)
    assert len(pages) == K and np.all(np.diff(pages) > 0)
    expect = sum(min(page, n - p * page) for p in pages)
    assert resident.sum() == expect  # whole pages, the last one possibly partial
    recent, first = edge_chunks(n, tail, sink)
    tail_pages = np.unique(np.flatnonzero(recent | first) // page)
    if len(tail_pages) <= K:
        assert resident[recent | first].all()
        if K > len(tail_pages):
            assert resident[192:256].all()
    else:  # a tail longer than KMAX keeps its newest pages
        assert list(pages) == list(range(n_pages - K, n_pages))


# ---- generation -------------------------------------------------------------------------------
def test_full_and_all_resident_selection_reproduce_plain_generation(model, ckpt):
    ids = prompt(300)
    plain = model.generate(ids, max_tokens=24, stop_at_eos=False)
    full = model.generate(ids, max_tokens=24, stop_at_eos=False,
                          memory=model.memory_indexer(SelectionConfig(mode="full")))
    assert full.tokens == plain.tokens and full.extra["resident_fraction"] == 1.0
    everything = SelectionConfig(threshold=0.999999, kmax=10_000, recency_tail=10_000,
                                 interval=4)
    mem = model.memory_indexer(everything, ckpt)
    res = model.generate(ids, max_tokens=24, stop_at_eos=False, memory=mem)
    assert res.tokens == plain.tokens
    assert len(res.extra["memory_cycles"]) == 6 and res.extra["resident_fraction"] == 1.0


class Watch(MemoryIndexer):
    """Checks every CSA layer's choice against the set in force at that step."""

    def select(self, layer, scores, n_vis, chosen):
        out = super().select(layer, scores, n_vis, chosen)
        res = self.resident(scores.shape[1])
        self.log.append((self.step, layer, None if res is None else res.copy(), out.copy()))
        return out


def _watch(model, ckpt, sel):
    mem = Watch(model.config, sel, load_retriever(ckpt, model.config),
                model.forward.freq_compressed, model.forward.hadamard)
    mem.log, mem.committed = [], {}
    mem.on_cycle = lambda c: mem.committed.setdefault(
        c["step"], None if mem.active is None else mem.active.copy())
    res = model.generate(prompt(700, 1), max_tokens=20, stop_at_eos=False, memory=mem)
    return mem, res


@pytest.mark.parametrize("lag", [0, 2])
def test_lookahead_cadence_commit_and_two_level(model, ckpt, lag):
    sel = SelectionConfig(interval=8, recall_diagnostic=True, commit_lag=lag)
    mem, res = _watch(model, ckpt, sel)
    cycles = res.extra["memory_cycles"]
    assert [c["step"] for c in cycles] == [0, 8, 16]
    assert [c.get("commit_step", c["step"]) for c in cycles] == [lag, 8 + lag, 16 + lag]
    assert [c["position"] for c in cycles] == [700, 708, 716]
    g = mem.retriever.geometry
    assert (mem.page, mem.tail, mem.kmax) == (g.page_size, g.recency_tail, g.kmax) == (4, 32, 24)
    for c in cycles:  # 175+ chunks, KMAX 24 pages of 4 (the newest one partial): eviction
        assert c["resident"] == 96 - (-c["chunks"] % 4) and c["pages"] == 24
    for step, layer, res_mask, chosen in mem.log:
        if step is None:
            continue  # the prompt: fully resident
        assert layer in csa_layers(model.config)
        if step <= lag:
            assert res_mask is None  # fully resident until the first boundary's set applies
            continue
        ids = chosen[chosen >= 0]
        assert len(ids) and res_mask[ids].all()  # Level 2 picks inside the resident set
        # n -> n+1: the set in force is the one of the last boundary b with b + lag BEFORE
        # this step (step 8 + lag still runs on step 0's set); chunks formed since b resident
        b = max(c for c in mem.committed if c + lag < step)
        committed = mem.committed[b]
        np.testing.assert_array_equal(res_mask[:len(committed)], committed)
        assert res_mask[len(committed):].all()
    fr = res.extra["resident_fraction"]
    assert 0.4 < fr < 1.0 and 0.0 <= res.extra["native_topk_recall"] <= 1.0


def test_global_topk_replaces_the_native_choice(model, ckpt):
    mem, res = _watch(model, ckpt, SelectionConfig(mode="global-topk"))
    K = model.config.index_topk
    cycles = res.extra["memory_cycles"]
    assert [c["step"] for c in cycles] == list(range(19)) and all(
        c["resident"] == K for c in cycles)
    per_step = {}
    for step, layer, res_mask, chosen in mem.log:
        if step is None or step == 0:
            continue
        ids = sorted(chosen[chosen >= 0].tolist())
        assert len(ids) == K and res_mask[ids].all() and res_mask.sum() == K
        per_step.setdefault(step, ids)
        assert ids == per_step[step]  # the same set in every CSA layer


@pytest.mark.parametrize("mode", ["recency", "random"])
def test_baselines_need_no_checkpoint(model, mode):
    mem = model.memory_indexer(SelectionConfig(mode=mode, interval=8))
    res = model.generate(prompt(700, 2), max_tokens=10, stop_at_eos=False, memory=mem)
    cyc = res.extra["memory_cycles"]
    assert [c["step"] for c in cyc] == [0, 8]
    tail = mem.tail
    if mode == "recency":
        assert cyc[0]["resident"] == tail
    else:
        assert cyc[0]["resident"] == tail + int(0.1 * cyc[0]["chunks"])


# ---- checkpoints ------------------------------------------------------------------------------
def test_default_layers_follow_the_official_proportions():
    assert default_clids(flash()) == [10, 12, 20]
    assert [csa_layers(flash())[c] for c in (10, 12, 20)] == [22, 26, 42]
    assert default_clids(small()) == [5, 6, 10]
    assert default_clids(tiny()) == [0, 1]
    assert RetrieverGeometry.for_model(flash()) == RetrieverGeometry()  # the deployment values


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
def test_checkpoint_round_trip(model, tmp_path, dtype):
    cfg = model.config
    ret = make_retriever(cfg, model.weights, "native", seed=5)
    again = make_retriever(cfg, model.weights, "native", seed=5)
    path = str(tmp_path / "r.safetensors")
    save_retriever(path, ret, dtype)
    back = load_retriever(path, cfg)
    assert back.layer_ids == ret.layer_ids == (1, 3) and back.geometry == ret.geometry
    for a, b, c in zip(ret.layers, back.layers, again.layers):
        np.testing.assert_array_equal(a.wq_b, c.wq_b)  # deterministic
        tol = {"F32": 0, "BF16": 2 ** -8, "F16": 2 ** -11}[dtype]
        np.testing.assert_allclose(b.wq_a, a.wq_a, rtol=tol, atol=1e-7 if tol else 0)
    r, blk = ret.layers[0], model.weights.blocks[1]
    np.testing.assert_array_equal(r.wq_a[:cfg.q_rank], blk.attn_q_a.dense())  # native init
    np.testing.assert_array_equal(r.weights_proj[:cfg.index_heads], blk.indexer_proj.dense())


def test_official_format_reads_with_the_safetensors_package(model, tmp_path):
    from safetensors.numpy import load_file

    path = str(tmp_path / "r.safetensors")
    ret = make_retriever(model.config, None, "random")
    save_retriever(path, ret)
    theirs = load_file(path)
    assert theirs["retrievers.l0.wq_b.weight"].shape == (32 * 64, 64)
    np.testing.assert_array_equal(theirs["retrievers.l1.q_norm_weight"], ret.layers[1].q_norm)
    tensors, _ = read_safetensors(path)  # no metadata: the deployment geometry
    write_safetensors(path, tensors, {})
    assert load_retriever(path, model.config).geometry == RetrieverGeometry()


def _bad(tmp_path, model, edit, meta=None):
    path = str(tmp_path / "bad.safetensors")
    tensors, m = read_safetensors(_good(tmp_path, model))
    tensors = {k: np.array(v) for k, v in tensors.items()}
    edit(tensors)
    write_safetensors(path, tensors, meta if meta is not None else m)
    return path


def _good(tmp_path, model):
    path = str(tmp_path / "good.safetensors")
    save_retriever(path, make_retriever(model.config, None, "random"))
    return path


@pytest.mark.parametrize("edit,needles", [
    (lambda t: t.pop("retrievers.l1.q_norm_weight"), ["missing tensor",
                                                       "retrievers.l1.q_norm_weight"]),
    (lambda t: t.update({"retrievers.l0.wq_a.weight": np.zeros((64, 65))}),
     ["retrievers.l0.wq_a.weight", "[64, 65]", "hidden size is 64"]),
    (lambda t: t.update({"retrievers.l0.wq_b.weight": np.zeros((100, 64))}),
     ["wq_b.weight", "head dim", "64"]),
    (lambda t: t.update({"retrievers.l0.weights_proj.weight": np.zeros((31, 64))}),
     ["weights_proj.weight", "[31, 64]", "[32, 64]"]),
    (lambda t: t.update({"retrievers.l7.wq_a.weight": np.zeros((4, 64))}),
     ["retrievers.l7", "CSA layer 7", "2 CSA layers"]),
    (lambda t: t.update({"retrievers.l0.q_norm.weight": np.zeros(64)}),
     ["retrievers.l0.q_norm.weight", "format"]),
])
def test_bad_checkpoint_one_line_error(tmp_path, model, edit, needles):
    path = _bad(tmp_path, model, edit)
    with pytest.raises(InputError) as e:
        load_retriever(path, model.config)
    msg = str(e.value)
    assert "\n" not in msg and path in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_bad_checkpoint_files(tmp_path, model):
    good = open(_good(tmp_path, model), "rb").read()
    cases = {"short": (good[:5], "shorter than"), "cut": (good[:40], "truncated"),
             "data": (good[:-100], "data_offsets"),
             "json": (good[:8] + b"{" * (len(good) - 8), "not a JSON")}
    for name, (data, needle) in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(data)
        with pytest.raises(InputError, match=needle):
            load_retriever(str(p), model.config)
    bad_dtype = good.replace(b'"F32"', b'"I64"', 1)
    (tmp_path / "i64.safetensors").write_bytes(bad_dtype)
    with pytest.raises(InputError, match="unsupported dtype I64"):
        load_retriever(str(tmp_path / "i64.safetensors"), model.config)
    other = _bad(tmp_path, model, lambda t: None, {"transformer_layers": "22,26"})
    with pytest.raises(InputError, match="transformer_layers=22,26"):
        load_retriever(other, model.config)


# ---- command line -----------------------------------------------------------------------------
def cli(*args):
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stdout, res.stderr


def test_make_retriever_then_run_with_it(tiny_q2_path, tmp_path):
    out = str(tmp_path / "ret.safetensors")
    code, stdout, err = cli("make-retriever", "--model", tiny_q2_path, "-o", out, "--seed", "4")
    assert code == 0, err
    assert "2 layers (transformer 1,3)" in stdout and "32 heads x 64" in stdout
    words = " ".join(f"w{i}" for i in range(260))
    code, stdout, err = cli("run", "--model", tiny_q2_path, "--prompt", words, "--device", "cpu",
                            "--memory-indexer", out, "--interval", "8", "--max-tokens", "12",
                            "--stats", "--json", "--recall-diagnostic")
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["selection"] == "lookahead" and 0 < summary["resident_fraction"] < 1
    assert len(summary["memory_cycles"]) == 2 and "native_topk_recall" in summary
    assert err.count("memory_cycle step=") == 2


@pytest.mark.parametrize("args,needles", [
    (["--selection", "lookahead"], ["--selection lookahead", "--memory-indexer"]),
    (["--memory-indexer", "/nonexistent/r.safetensors"], ["/nonexistent/r.safetensors",
                                                          "cannot read"]),
    (["--selection", "recency", "--threshold", "1.5"], ["--threshold 1.5"]),
    (["--selection", "random", "--random-ratio", "0"], ["--random-ratio"]),
    (["--selection", "recency", "--interval", "4", "--commit-lag", "4"],
     ["--commit-lag 4", "< --interval 4"]),
    (["--commit-lag", "1"], ["--commit-lag", "only meaningful with a selection"]),
    (["--selection", "global-topk", "--commit-lag", "1"], ["--commit-lag 1", "global-topk"]),
])
def test_run_memory_flags_bad_input(tiny_q2_path, args, needles):
    code, _, err = cli("run", "--model", tiny_q2_path, "--device", "cpu", "--max-tokens", "2",
                       *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err


def test_make_retriever_bad_input(tmp_path):
    code, _, err = cli("make-retriever", "--model", str(tmp_path / "none.gguf"), "-o",
                       str(tmp_path / "r.safetensors"))
    assert code == 2 and "none.gguf" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.safetensors").exists()
