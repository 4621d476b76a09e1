"""The CUDA decode engine equals the NumPy forward (run in Numba's CUDA simulator in CI).

A simulated step of the tiny model takes ~6 s (every GPU thread runs as Python; 13 s under
numba's own block scheduler, see kernels/sim_blocks.py), so these tests use few tokens on a
geometry shrunk to show every cache path within them: window 4 (the ring wraps), CSA ratio 4
with top-1 selection (two entries compete by token 8), HCA ratio 8 (an entry at token 8),
hash-routed and biased MoE layers.
"""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from pocketfm.cli import main
from pocketfm.generate import load
from pocketfm.kernels.device import SIMULATOR
from pocketfm.model import Forward

PROMPT = [1, 72, 305, 17, 409, 88, 3, 250, 111]  # 9 tokens: 2 CSA entries, 1 HCA entry
GENERATED = 2


def test_decode_engine_matches_numpy_forward(micro_path):
    gpu = load(micro_path, device="cuda")
    cfg = gpu.config
    eng = gpu.engine(len(PROMPT) + GENERATED)
    eng.start(PROMPT)
    fw = Forward(cfg, gpu.weights)  # float32, packed kv storage: the engine's numerics
    state = fw.new_state(len(PROMPT) + GENERATED)
    tokens = list(PROMPT)
    for p in range(len(PROMPT) + GENERATED - 1):
        eng.step()
        got = eng.read_logits()
        ref = fw.forward([tokens[p]], state)[0]
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel <= 1e-4, f"position {p}: rel-L2 {rel:.2e}"
        if p >= len(PROMPT) - 1:
            tokens.append(int(np.argmax(ref)))
    # the engine wrote its own greedy picks after the prompt, on the device
    assert eng.read_ids(len(PROMPT), len(tokens)).tolist() == tokens[len(PROMPT):]
    assert eng.read_ids(0, len(PROMPT)).tolist() == PROMPT


def test_post_and_compressor_on_streams_of_their_own_step_as_on_the_side_stream(micro_path):
    """HC pre's post + comb on a stream of their own and the compressor on a branch of its own
    (concurrency itself is a GPU test): the same logits at a CSA + HCA entry position (4, 8:
    the compressors emit) as both on the side stream, step after step."""
    logits = _micro_prompt_logits(micro_path, {
        "side": dict(post_own_stream=False, compressor_own_stream=False),
        "own": dict(post_own_stream=True, compressor_own_stream=True)})
    assert np.array_equal(logits["side"], logits["own"])


def _micro_prompt_logits(micro_path, variants: dict) -> dict:
    """The micro model's logits at every prompt position, one engine stepping the prompt anew
    under each DecodeEngine.settings variant: {name: array [positions, vocab]}."""
    eng = load(micro_path, device="cuda").engine(len(PROMPT))
    logits = {}
    for name, values in variants.items():
        with eng.settings(**values):
            eng.start(PROMPT)
            rows = []
            for _ in range(len(PROMPT)):
                eng.step()
                rows.append(eng.read_logits())
            logits[name] = np.array(rows)
    return logits


EVERY_L2_PREFETCH = dict(l2_prefetch=("out_a", "out_b", "router"),
                         l2_prefetch_next=("q_a", "q_b", "idx_q_b"))


def test_the_l2_prefetch_steps_as_without_it(micro_path):
    """Weights requested into L2 on a side stream (cache hints: the output projections' beside
    the attention, the next layer's query weights beside the MoE, each branch joined at its
    sublayer's end): the same logits step after step (their concurrency is a GPU test:
    below)."""
    logits = _micro_prompt_logits(micro_path, {"none": dict(l2_prefetch=()),
                                               "every": EVERY_L2_PREFETCH})
    assert np.array_equal(logits["none"], logits["every"])


def test_chunked_prefill_then_decode_matches_numpy_forward(micro_path):
    """Chunks of 5 then 3 tokens (the second shorter than the buffers), then decode: the first
    chunk leaves a wrapped ring, a CSA entry and half-filled compressor states to the second,
    which emits the second CSA entry and the HCA entry mid-chunk and selects among them per
    token. The decode steps after it see exactly NumPy's caches."""
    gpu = load(micro_path, device="cuda")
    n = len(PROMPT)
    eng = gpu.engine(n + GENERATED)
    eng.start(PROMPT)
    seen = []
    eng.prefill(5).ingest(n - 1, lambda done, total, s: seen.append((done, total)))
    assert seen == [(5, n - 1), (n - 1, n - 1)]
    fw = Forward(gpu.config, gpu.weights)
    state = fw.new_state(n + GENERATED)
    ref = fw.forward(PROMPT, state)[-1]
    tokens = []
    for step in range(GENERATED):
        eng.step()
        got = eng.read_logits()
        if step:
            ref = fw.forward([tokens[-1]], state)[0]
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel <= 1e-4, f"decode step {step} after the prefill: rel-L2 {rel:.2e}"
        tokens.append(int(np.argmax(ref)))
    assert eng.read_ids(n, n + GENERATED).tolist() == tokens


def run_json(*args):
    res = CliRunner().invoke(main, ["run", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not SIMULATOR, reason="CPU-vs-simulator check (on a GPU: bin/gpu-check)")
def test_cli_cuda_equals_cpu_when_sampling():
    """`pocketfm run --device cuda` (simulated) gives the CPU's tokens, with top-p sampling: the
    same uniforms feed the reference sampler and the GPU kernel."""
    args = ["--prompt", "Hi", "--max-tokens", "2", "--temperature", "0.8", "--top-p", "0.9",
            "--seed", "3"]
    cpu = run_json(*args, "--device", "cpu")
    gpu = run_json(*args, "--device", "cuda")
    assert gpu["device"] == "cuda" and cpu["device"] == "cpu"
    assert gpu["tokens"] == cpu["tokens"] and len(gpu["tokens"]) == 2


@pytest.mark.parametrize("mode", ["lookahead", "global-topk"])
def test_engine_with_memory_indexer_matches_numpy(micro_path, tmp_path, mode):
    """The Memory Indexer on the engine gives NumPy's tokens and NumPy's cycles.

    lookahead (a cycle every step, one resident page of one chunk: eviction from the second
    chunk on): the GPU scorer over the packed keys, the host selection, the set uploaded between
    replays and the native top-k masked to it inside the step. global-topk: scorer, ensemble
    and top-k inside the step, replacing the native choice from the next step on."""
    from pocketfm.memory import SelectionConfig, make_retriever, save_retriever

    ckpt = str(tmp_path / "micro-ret.safetensors")
    cpu = load(micro_path, device="cpu")
    save_retriever(ckpt, make_retriever(cpu.config, cpu.weights, "native", seed=2))
    sel = SelectionConfig(mode=mode, interval=1, page_size=1, recency_tail=0, kmax=1)
    gpu = load(micro_path, device="cuda")
    runs = []
    for m in (cpu, gpu):
        runs.append(m.generate(PROMPT, max_tokens=4, stop_at_eos=False,
                               memory=m.memory_indexer(sel, ckpt)))
    ref, got = runs
    assert got.tokens == ref.tokens
    rc, gc = ref.extra["memory_cycles"], got.extra["memory_cycles"]
    assert [c["step"] for c in gc] == [0, 1, 2] and len(rc) == 3
    for a, b in zip(rc, gc):
        assert (a["chunks"], a["resident"]) == (b["chunks"], b["resident"])
        if mode == "lookahead":  # (scores ~0.5-0.65; on the H200 the engine's float32, FMAs
            # contracted, ends 1.04e-4 from NumPy's on one cycle: within the logits' 1e-4 rel.)
            assert a["kept"] == b["kept"] and abs(a["score_mean"] - b["score_mean"]) <= 3e-4
    assert got.extra["resident_fraction"] == ref.extra["resident_fraction"] < 1.0


def _flash_4_layer_logits(variants: dict, layers: int = 4, graph: bool = False) -> dict:
    """The flash geometry's first 4 layers (window-only, CSA: q_b on its side stream, HCA;
    synthetic weights in the ds4 type mix, caches filled to 4,096: 1,024 indexer keys, more
    than the top-k's 512): one eager step's logits under each DecodeEngine.settings variant
    (``layers``: the first 1 .. 4 of those only; ``graph``: then the step captured and
    replayed at the same position too, the logits of both: {name: (eager, replayed)})."""
    from pocketfm.engine.bench import fill_caches
    from pocketfm.engine.decode import DecodeEngine
    from pocketfm.engine.synthetic_weights import SyntheticSource
    from pocketfm.kernels.gemv import takes_limbs
    from pocketfm.presets import first_layers, preset
    from numba import cuda

    cfg = first_layers(preset("flash"), layers)
    s = cuda.stream()
    eng = DecodeEngine(cfg, SyntheticSource(cfg, "ds4-q2", 0, s), 4100, stream=s)
    assert takes_limbs(eng.w.layers[0].q_b, norm=True)
    fill_caches(eng, 4096)
    logits = {}
    for name, values in variants.items():
        with eng.settings(**values):
            eng.set_position(4096)
            eng.step(graph=False)
            logits[name] = eng.read_logits()
            if graph:
                for _ in range(2):  # the graph's eager warm-up, then its capture and replay:
                    eng.set_position(4096)  # every step at the same position
                    eng.step()
                logits[name] = (logits[name], eng.read_logits())
    return logits


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (q_b takes dp4a only there)")
def test_the_q_a_norm_folded_into_q_b_limbs_changes_no_logit():
    """One step with the q_a norm inside q_b's limbs launch (on every layer, then off the CSA
    layers), the same step with the norm as its own launch (only the norm's summation order
    differs)."""
    logits = _flash_4_layer_logits({fold: dict(fold_q_a_norm=fold)
                                    for fold in (True, "non-csa", False)})
    for fold in (True, "non-csa"):
        assert _rel(logits[fold], logits[False]) <= 1e-4, fold


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the tensor-core scorers)")
def test_the_indexer_and_combine_candidates_change_no_logit():
    """The indexer's scores by one warp holding every head, then with the top-k's first digit
    counted by it, against the 16-heads-a-warp scorer (the scores' summation order differs; the
    picks' ranks may swap only between near-equal keys); out_a's limbs made by the attention's
    combine against their own launch: the same words, so the same logits, bit for bit; the
    indexer query's Hadamard a warp a vector. Each setting named, so the defaults don't matter."""
    base = dict(indexer_one_warp=False, scorer_counts_first_digit=False, limbs_in_combine=False,
                hadamard_warp=None)
    logits = _flash_4_layer_logits({
        "16 heads a warp": base,
        "one warp": dict(base, indexer_one_warp=True),
        "first digit": dict(base, indexer_one_warp=True, scorer_counts_first_digit=True),
        "combine limbs": dict(base, limbs_in_combine=True),
        "Hadamard a warp a vector": dict(base, hadamard_warp=True)})
    assert np.array_equal(logits["one warp"], logits["first digit"])  # same scores and picks
    assert _rel(logits["one warp"], logits["16 heads a warp"]) <= 1e-4
    assert np.array_equal(logits["combine limbs"], logits["16 heads a warp"])
    assert _rel(logits["Hadamard a warp a vector"], logits["16 heads a warp"]) <= 1e-4


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the engine's HC blocks)")
def test_the_hc_kernels_with_their_loads_first_change_the_logits_by_rounding_only():
    """HC pre's u block and HC post + mix with their loads issued first (hc_u_prefetch,
    hc_mix_prefetch, the engine's one-block path): the same arithmetic as the kernels before
    them. The u block gives the same logits bit for bit; post + mix the same bits in the
    simulator (tests/kernels/test_hc.py) but not on the GPU (H100, 2026-12-06: logits ~1e-5
    apart after 4 layers; the compiler fuses the post's multiply-adds its own way in each
    kernel, a likely cause, not checked), so a rounding bound as for imma below."""
    off = dict(hc_u_gram=False)
    logits = _flash_4_layer_logits({
        "landed": dict(off, hc_u_prefetch=False, hc_mix_prefetch=False),
        "u block": dict(off, hc_u_prefetch=True, hc_mix_prefetch=False),
        "post + mix": dict(off, hc_u_prefetch=False, hc_mix_prefetch=True),
        "both": dict(off, hc_u_prefetch=True, hc_mix_prefetch=True)})
    assert np.array_equal(logits["u block"], logits["landed"])
    for name in ("post + mix", "both"):
        assert _rel(logits[name], logits["landed"]) <= 5e-3, name


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the engine's HC blocks)")
@pytest.mark.parametrize("layers, bound", [(1, 1e-4), (4, 5e-3)])
def test_the_spread_u_block_changes_the_logits_by_rounding_only(layers, bound):
    """HC pre's u and norm over D / 512 blocks, the norm's sum of squares from the streams'
    Gram partials (hc_u_gram, the engine's default): other float sums than the one block's
    (the mix blocks take other columns, the norm another formula), so the logits agree to
    rounding, amplified over 4 layers by the routing and top-k picks as for imma below (H100,
    2026-12-06: 1.6e-3 after 4 layers). The MoE's output left in parts for the next layer's
    Gram mix to add (moe_parts; 4 layers: on the first 3) is added there in combine's order:
    the same logits bit for bit."""
    logits = _flash_4_layer_logits({"gram": dict(hc_u_gram=True),
                                    "one block": dict(hc_u_gram=False),
                                    "combine launch": dict(hc_u_gram=True, moe_parts=False)},
                                   layers)
    assert 0 < _rel(logits["gram"], logits["one block"]) <= bound
    assert np.array_equal(logits["gram"], logits["combine launch"])


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the split attention)")
def test_the_split_attention_prefetching_its_next_tile_changes_no_logit():
    """The CUDA-core split attention (CSA, window-only layers) loading its next tile's words
    while it scores this one, against loading each tile after the last: the same values into
    the same arithmetic, so the same logits bit for bit; and at 1 tile a split (more splits:
    other sums in the combine) to rounding."""
    two = dict(attn_head_warps=False)  # (the kernel of two heads a warp)
    logits = _flash_4_layer_logits({"prefetch": dict(attn_prefetch=True, **two),
                                    "no prefetch": dict(attn_prefetch=False, **two),
                                    "1 tile": dict(attn_prefetch=True, attn_split_tiles=1, **two)})
    assert np.array_equal(logits["prefetch"], logits["no prefetch"])
    assert _rel(logits["1 tile"], logits["prefetch"]) <= 5e-3


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the tensor-core attention)")
def test_the_staged_attention_changes_no_logit():
    """HCA's tensor-core attention with q and its partials moved through shared memory, and the
    CUDA-core split kernel's partials, against straight between registers and memory: the
    same values into the same arithmetic, so the same logits bit for bit; at 4 tiles a split
    (other splits, other sums in the combine) to rounding."""
    two = dict(attn_head_warps=False)  # (CSA's kernel with partials it may stage)
    logits = _flash_4_layer_logits({"staged": dict(attn_staged=True, **two),
                                    "unstaged": dict(attn_staged=False, **two),
                                    "4 tiles": dict(attn_mma_tiles=4, **two)})
    assert np.array_equal(logits["staged"], logits["unstaged"])
    assert 0 < _rel(logits["4 tiles"], logits["staged"]) <= 5e-3


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the attention's combine)")
def test_the_spread_combine_changes_the_logits_by_rounding_only():
    """The attention's combine with the splits spread over 2 / 4 / 8 groups of threads
    (attn_combine_groups) against a thread a dim: the same weights, the partials added in
    another order (a group's splits, then the groups), so the logits agree to rounding."""
    logits = _flash_4_layer_logits({"thread a dim": dict(attn_combine_groups=0),
                                    **{g: dict(attn_combine_groups=g) for g in (2, 4, 8)}})
    for g in (2, 4, 8):
        assert 0 < _rel(logits[g], logits["thread a dim"]) <= 5e-3, g


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the indexer's query)")
def test_the_indexer_query_in_one_launch_changes_no_logit():
    """The indexer query's GEMV, RoPE, Hadamard and FP4 in one launch (idx_query_one_launch)
    against gemv then hadamard_fp4: the same sums in the same order, so the same logits bit
    for bit, on the CSA layer whether its q_a norm is made by the GEMV or by a launch."""
    logits = _flash_4_layer_logits({
        "two": dict(idx_query_one_launch=False), "one": dict(idx_query_one_launch=True),
        "two, norm launch": dict(idx_query_one_launch=False, q_a_norm_in_readers=False),
        "one, norm launch": dict(idx_query_one_launch=True, q_a_norm_in_readers=False)})
    assert np.array_equal(logits["one"], logits["two"])
    assert np.array_equal(logits["one, norm launch"], logits["two, norm launch"])


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (concurrent branches)")
def test_post_and_compressor_on_streams_of_their_own_change_no_logit():
    """HC pre's post + comb on a stream of their own, the compressor on a branch of its own,
    against both on the side stream: the same launches on other streams, joined before their
    readers, so the same logits bit for bit, eager and replayed from the captured graph (where
    the branches run at once)."""
    variants = {"side": dict(post_own_stream=False, compressor_own_stream=False),
                "post": dict(post_own_stream=True, compressor_own_stream=False),
                "both": dict(post_own_stream=True, compressor_own_stream=True)}
    logits = _flash_4_layer_logits(variants, graph=True)
    for name in ("post", "both"):
        for how in (0, 1):  # eager, replayed
            assert np.array_equal(logits[name][how], logits["side"][how]), (name, how)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (a concurrent branch)")
def test_the_l2_prefetch_changes_no_logit():
    """out_a's weights requested into L2 on a side stream beside the attention (and every
    candidate site: EVERY_L2_PREFETCH): cache hints, so the same logits bit for bit, eager and
    replayed from the graph."""
    logits = _flash_4_layer_logits({"none": dict(l2_prefetch=()),
                                    "out_a": dict(l2_prefetch=("out_a",)),
                                    "every": EVERY_L2_PREFETCH}, graph=True)
    for name in ("out_a", "every"):
        for how in (0, 1):  # eager, replayed
            assert np.array_equal(logits[name][how], logits["none"][how]), (name, how)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (gemv(norm=))")
def test_the_q_a_norm_in_its_readers_changes_the_logits_by_rounding_only():
    """The CSA layer's q_a norm made by the idx_q_b GEMV and by q_b's limbs (the indexer's
    weights on a branch of their own): the same norm summed in another order, so the logits
    agree to rounding, amplified by the next layers' picks (H100, 2026-12-06, without the
    weights' branch: within 5e-3, the test of its first form)."""
    logits = _flash_4_layer_logits({"launch": dict(q_a_norm_in_readers=False),
                                    "readers": dict(q_a_norm_in_readers=True)})
    assert _rel(logits["readers"], logits["launch"]) <= 5e-3


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the int8 tensor cores)")
@pytest.mark.parametrize("layers, bound", [(1, 1e-4), (4, 5e-3)])
def test_the_routed_gate_up_on_imma_changes_the_logits_by_its_rounding_only(layers, bound):
    """The routed experts' gate+up on imma.py's kernel, then also their down on imma_q2_k.py's,
    against the dp4a GEMVs: all round x to 15 bits (per 32 / 256 and per 64 columns), so the
    logits agree to that rounding, not bit for bit. One layer: rounding (H100, 2026-12-06:
    rel 2.3e-5, 3.0e-5); four: the next layers' routing and top-k picks amplify it (1.0e-3,
    1.9e-3), so a bound that catches a wrong sum, not the rounding."""
    logits = _flash_4_layer_logits({"dp4a": dict(imma_gate_up=False, imma_down=False),
                                    "gate+up": dict(imma_gate_up=True, imma_down=False),
                                    "and down": dict(imma_gate_up=True, imma_down=True)},
                                   layers)
    for on in ("gate+up", "and down"):
        assert _rel(logits[on], logits["dp4a"]) <= bound, on
    assert len({logits[k].tobytes() for k in logits}) == 3  # (each ran)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the int8 tensor cores)")
def test_the_sm_wide_routed_gate_up_changes_no_logit():
    """imma_iq2_xxs's SM-wide builds (3 or 4 tiles a block sharing one table copy a lane, the
    tables and rows in dynamic shared memory) make the same codes and sum them in the same
    order as the default build: the same logits bit for bit, eager and replayed."""
    logits = _flash_4_layer_logits({"default": dict(imma_gate_up=True),
                                    "sm": dict(imma_gate_up="sm"),
                                    "sm3": dict(imma_gate_up="sm3"),  # (the engine's)
                                    "sm3_alu": dict(imma_gate_up="sm3_alu_signs")}, graph=True)
    for name in ("sm", "sm3", "sm3_alu"):
        for how in (0, 1):  # eager, replayed
            assert np.array_equal(logits[name][how], logits["default"][how]), (name, how)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the int8 tensor cores)")
def test_the_routed_gate_up_summed_as_integers_changes_the_logits_by_rounding_only():
    """imma_iq2_xxs's sm3_int_sums (x scaled per 256 columns, a super-block's groups summed as
    integers; sm3_int_wide / sm_int_wide the same with its tables wide, 3 / 4 tiles a block)
    against sm3: x rounds to 15 bits of a wider max, so one layer's logits agree to that
    rounding (the imma test's 1e-4 against dp4a), not bit for bit; eager = replayed."""
    logits = _flash_4_layer_logits({"sm3": dict(imma_gate_up="sm3"),
                                    "int": dict(imma_gate_up="sm3_int_sums"),
                                    "wide": dict(imma_gate_up="sm3_int_wide"),
                                    "wide4": dict(imma_gate_up="sm_int_wide")}, 1, graph=True)
    assert _rel(logits["int"][0], logits["sm3"][0]) <= 1e-4
    assert not np.array_equal(logits["int"][0], logits["sm3"][0])  # (it ran)
    assert np.array_equal(logits["int"][0], logits["int"][1])
    for how in (0, 1):  # the wide tables: the same codes and sums, bit for bit
        for name in ("wide", "wide4"):
            assert np.array_equal(logits[name][how], logits["int"][how]), (name, how)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the routed down's kernel)")
def test_the_routed_down_reading_by_flat_offsets_changes_no_logit():
    """DecodeEngine.down_flat_loads: the routed Q2_K down's dp4a kernel reads the same words by
    uint32 flat offsets: the same logits bit for bit, eager and replayed."""
    _assert_setting_changes_no_logit("down_flat_loads")


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the one-launch query)")
def test_the_scorer_reading_q_fragments_changes_no_logit():
    """DecodeEngine.scorer_q_fragments: the query's launch writes q's bf16 pairs in the
    one-warp scorer's fragment order and the scorer loads them instead of staging q: the same
    A registers, so the same logits bit for bit, eager and replayed."""
    _assert_setting_changes_no_logit("scorer_q_fragments")


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the decode GEMVs)")
def test_the_decode_gemvs_grids_at_a_share_of_a_wave_change_no_logit():
    """DecodeEngine.gemv_waves (0.9 and 0.75 of a wave against a full one): each output row of
    the persistent GEMVs is one warp's sums whichever block takes it: the same logits bit for
    bit, eager and replayed."""
    for share in (0.9, 0.75):
        _assert_setting_changes_no_logit("gemv_waves", on=share, off=1.0)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the side streams' GEMVs)")
def test_the_side_streams_gemvs_at_a_share_of_a_wave_change_no_logit():
    """DecodeEngine.side_gemv_waves: the side streams' small GEMVs at a quarter of a wave (the
    default) against the main stream's share, and side_q_b_waves (the CSA layers' q_b beside
    the indexer at a quarter, a candidate), each output row still one warp's sums: the same
    logits bit for bit, eager and replayed."""
    _assert_setting_changes_no_logit("side_gemv_waves", on=0.25, off=None)
    _assert_setting_changes_no_logit("side_q_b_waves", on=0.25, off=None)


def _assert_setting_changes_no_logit(setting: str, on=True, off=False) -> None:
    """The flash 4-layer logits with DecodeEngine ``setting`` on equal those with it off, bit
    for bit, eager and replayed."""
    logits = _flash_4_layer_logits({"off": {setting: off}, "on": {setting: on}},
                                   graph=True)
    for how in (0, 1):  # eager, replayed
        assert np.array_equal(logits["on"][how], logits["off"][how]), how


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the split attention)")
def test_the_bf16_attention_tile_changes_the_logits_by_rounding_only():
    """DecodeEngine.attn_bf16_tile: the head-warp attention's tile as bf16 holds the same
    values, but at K = 512 a lane holds 8 consecutive dims instead of 4 (one 128-bit load):
    the same products summed in another order, so the logits agree to rounding (1 layer:
    window-only; 4: amplified by the next layers' picks, as for the head-warp kernel)."""
    for layers, bound in ((1, 1e-5), (4, 5e-3)):
        logits = _flash_4_layer_logits({"f32": dict(attn_bf16_tile=False),
                                        "bf16": dict(attn_bf16_tile=True)}, layers)
        assert _rel(logits["bf16"], logits["f32"]) <= bound, layers
        assert not np.array_equal(logits["bf16"], logits["f32"])  # (each ran)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shapes: a GPU test (the split attention)")
@pytest.mark.parametrize("layers, bound", [(1, 1e-5), (4, 5e-3)])
def test_the_head_warp_attention_changes_the_logits_by_rounding_only(layers, bound):
    """DecodeEngine.attn_head_warps: the CSA and window-only layers' split attention with one
    head a warp over 32-slot tiles (each split's sum of exps a warp reduction, not a running
    sum): the same softmax in another order, so the logits agree to rounding (one layer:
    window-only), amplified over 4 layers by the next layers' picks as for imma above."""
    logits = _flash_4_layer_logits({"two heads": dict(attn_head_warps=False),
                                    "one head": dict(attn_head_warps=True)}, layers)
    assert _rel(logits["one head"], logits["two heads"]) <= bound
    assert not np.array_equal(logits["one head"], logits["two heads"])  # (each ran)
