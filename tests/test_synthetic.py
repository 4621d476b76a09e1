"""Synthetic GGUF writer: files load, keys round-trip, types follow the mix, bytes are
deterministic, a failed write leaves nothing behind, and the random model runs sanely."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from pocketfm import presets, synthetic
from pocketfm.config import ModelConfig
from pocketfm.errors import InputError
from pocketfm.quants import GGMLType
from pocketfm.tokenizer import Tokenizer
from pocketfm.weights import load_gguf, tensor_specs

FIXTURE_KEYS = Path(__file__).parent / "fixtures" / "official-tiny" / "model.keys.json"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """quant -> path of the tiny preset written once per mix (seed 0)."""
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for quant in synthetic.QUANT_MIXES:
        out[quant] = str(d / f"tiny-{quant}.gguf")
        synthetic.write_model(presets.tiny(), out[quant], quant)
    return out


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _types(m) -> dict[str, int]:
    return {t.name: t.qtype for t in m.tensors}


# ---- metadata ----------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", synthetic.QUANT_MIXES)
def test_tiny_loads_and_config_round_trips(tiny_files, quant):
    m = load_gguf(tiny_files[quant])
    tiny = presets.tiny()
    assert ModelConfig.from_metadata(m.meta) == synthetic.stored_config(tiny)
    # Only the f32 keys' rounding (1e-6 -> 9.99999997e-07) separates it from the preset.
    for f in dataclasses.fields(tiny):
        a, b = getattr(m.config, f.name), getattr(tiny, f.name)
        assert np.allclose(a, b, rtol=1e-7, atol=0), f.name
    assert m.meta["general.architecture"] == "deepseek4"
    assert m.meta["general.name"] == "pocketfm-synthetic"


def test_metadata_has_every_fixture_key(tiny_files):
    meta = load_gguf(tiny_files["f32"]).meta
    fixture = json.loads(FIXTURE_KEYS.read_text())
    missing = [k["key"] for k in fixture["metadata"] if k["key"] not in meta]
    assert missing == []
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "joyai-llm"
    assert meta["deepseek4.expert_gating_func"] == 4
    assert len(meta["deepseek4.attention.compress_ratios"]) == presets.tiny().n_layers


def test_flash_metadata_round_trips_without_writing():
    flash = presets.flash()
    tok = synthetic.tokenizer_fields(300)  # the config does not read the tokenizer keys
    meta = synthetic.synthetic_metadata(flash, tok, "flash", "ds4-q2")
    assert ModelConfig.from_metadata(meta) == flash  # no float rounding without a file
    assert meta["general.file_type"] == 19  # MOSTLY_IQ2_XXS


def test_tokenizer_from_metadata(tiny_files):
    meta = load_gguf(tiny_files["q8_0"]).meta
    tok = Tokenizer.from_metadata(meta)
    assert tok.vocab_size == presets.tiny().vocab
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    text = "def put(self, key):\n    return 42  # 你好，世界"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned, not just bytes
    chat = tok.chat("hello")
    assert chat[0] == 0 and tok.tokens[chat[1]] == "<｜User｜>"
    assert "<｜User｜>" in meta["tokenizer.chat_template"]
    assert "<｜Assistant｜>" in meta["tokenizer.chat_template"]


@pytest.mark.parametrize("n", [262, 512, 4096])
def test_default_vocab_is_exactly_n(n):
    tokens, merges, types = synthetic.default_vocab(n)
    assert len(tokens) == len(types) == n and len(set(tokens)) == n
    assert tokens[:6] == synthetic.SPECIALS
    assert len(merges) == n - 262 or tokens[-1].startswith("<unused")


# ---- tensor types ------------------------------------------------------------------------------

@pytest.mark.parametrize("quant", synthetic.QUANT_MIXES)
def test_tensor_types_follow_the_mix(tiny_files, quant):
    m = load_gguf(tiny_files[quant])
    specs = tensor_specs(m.config)
    types = _types(m)
    assert [t.name for t in m.tensors] == [s.name for s in specs]  # file order = table order
    for s in specs:
        assert types[s.name] == synthetic.tensor_type(s, quant), s.name
    assert types["blk.0.ffn_gate_tid2eid.weight"] == GGMLType.I32
    assert types["blk.2.attn_norm.weight"] == GGMLType.F32
    assert types["blk.2.exp_probs_b.bias"] == GGMLType.F32
    want = {  # name -> type, per mix
        "f32": {"blk.1.attn_q_b.weight": GGMLType.F32, "blk.3.ffn_gate_exps.weight": GGMLType.F32},
        "q8_0": {"token_embd.weight": GGMLType.Q8_0, "blk.1.indexer.proj.weight": GGMLType.Q8_0,
                 "blk.3.ffn_down_exps.weight": GGMLType.Q8_0},
        # tiny's rows (64 and 32) are no whole IQ2_XXS / Q2_K block: experts fall back to Q8_0
        "ds4-q2": {"token_embd.weight": GGMLType.F16, "output.weight": GGMLType.Q8_0,
                   "output_hc_fn.weight": GGMLType.F16, "blk.1.attn_compressor_kv.weight":
                   GGMLType.F16, "blk.1.indexer.attn_q_b.weight": GGMLType.F16,
                   "blk.2.ffn_gate_inp.weight": GGMLType.F16, "blk.2.attn_kv.weight":
                   GGMLType.Q8_0, "blk.2.ffn_up_shexp.weight": GGMLType.Q8_0,
                   "blk.2.ffn_gate_exps.weight": GGMLType.Q8_0,
                   "blk.2.ffn_down_exps.weight": GGMLType.Q8_0},
    }[quant]
    for name, qtype in want.items():
        assert types[name] == qtype, name


def test_fallback_chain():
    spec = synthetic.TensorSpec("blk.0.ffn_down_exps.weight", (48, 64, 4), "expert_down")
    assert synthetic.tensor_type(spec, "ds4-q2") == GGMLType.F16  # 48: no Q2_K, no Q8_0 block
    with pytest.raises(InputError, match="quant"):
        synthetic.tensor_type(spec, "q4_k")


def test_small_like_config_gets_two_bit_experts(tmp_path):
    # small's geometry (hidden 1024, expert width 512: multiples of 256), cut to 2 layers
    cfg = presets.small().replace(
        n_layers=2, compress_ratios=(4, 128), n_hash_layers=1, n_experts=4, n_experts_used=2,
        vocab=512, swiglu_clamp=(10.0,) * 2, swiglu_clamp_shared=(10.0,) * 2)
    path = str(tmp_path / "small2.gguf")
    synthetic.write_model(cfg, path, "ds4-q2", seed=3)
    m = load_gguf(path)
    assert m.config == synthetic.stored_config(cfg)
    types = _types(m)
    for i in range(2):
        assert types[f"blk.{i}.ffn_gate_exps.weight"] == GGMLType.IQ2_XXS
        assert types[f"blk.{i}.ffn_up_exps.weight"] == GGMLType.IQ2_XXS
        assert types[f"blk.{i}.ffn_down_exps.weight"] == GGMLType.Q2_K
    # 2-bit codes drawn at the recipe's std: 4/sqrt(D) for gate/up, 0.5/sqrt(F) for down
    blk = m.weights.blocks[1]
    for t, std in ((blk.ffn_up_exps, 4 / np.sqrt(1024)), (blk.ffn_down_exps, 0.5 / np.sqrt(512))):
        x = t.expert(1)
        assert abs(x.mean()) < 0.05 * std and abs(x.std() / std - 1) < 0.1, t.name
    assert m.file_bytes == pytest.approx(synthetic.file_bytes(cfg, "ds4-q2"), rel=0.01)


# ---- values ------------------------------------------------------------------------------------

def test_same_seed_same_bytes_other_seed_other_bytes(tiny_files, tmp_path):
    again = str(tmp_path / "again.gguf")
    synthetic.write_model(presets.tiny(), again, "ds4-q2", seed=0)
    assert _sha(again) == _sha(tiny_files["ds4-q2"])
    other = str(tmp_path / "other.gguf")
    synthetic.write_model(presets.tiny(), other, "ds4-q2", seed=1)
    assert _sha(other) != _sha(again)


def test_values_do_not_depend_on_the_mix(tiny_files):
    # Per-tensor generators: a q8_0 file is the f32 model rounded, tensor by tensor.
    f32, q8 = load_gguf(tiny_files["f32"]).tensors, load_gguf(tiny_files["q8_0"]).tensors
    for a, b in zip(f32, q8):
        x, y = a.dense(), b.dense()
        if b.qtype == GGMLType.Q8_0:
            assert np.abs(x - y).max() <= np.abs(x).max() / 127, a.name
        else:
            assert np.array_equal(x, y), a.name


def test_init_recipe(tiny_files):
    w = load_gguf(tiny_files["f32"]).weights
    blk = w.blocks[1]
    assert w.token_embd.dense().std() == pytest.approx(1.0, rel=0.05)
    assert blk.attn_q_b.dense().std() == pytest.approx(1 / np.sqrt(32), rel=0.05)
    norm = blk.attn_norm.dense()
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15
    scale = blk.hc_attn_scale.dense()
    assert ((scale >= 0.2) & (scale <= 1.0)).all()
    tid2eid = np.asarray(w.blocks[0].ffn_gate_tid2eid.raw)  # [vocab, k]
    assert tid2eid.shape == (512, 2) and tid2eid.min() >= 0 and tid2eid.max() < 8
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()


def test_forward_is_sane_over_300_tokens(tiny_files):
    from pocketfm.model import Forward

    m = load_gguf(tiny_files["ds4-q2"])
    fw = Forward(m.config, m.weights, qat=True)
    tokens = np.random.default_rng(7).integers(0, m.config.vocab, 300)
    logits = fw.forward(tokens, fw.new_state(300))  # one chunk
    assert logits.shape == (300, m.config.vocab) and np.isfinite(logits).all()
    sd = logits.std(axis=1)
    assert 0.1 < sd.min() and sd.max() < 100, (sd.min(), sd.max())
    assert len(set(logits.argmax(axis=1).tolist())) > 30  # the prediction follows the input


# ---- failures ----------------------------------------------------------------------------------

def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    real, calls = synthetic.tensor_data, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 20:
            raise RuntimeError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(synthetic, "tensor_data", failing)
    fresh = tmp_path / "fresh.gguf"
    with pytest.raises(RuntimeError, match="disk full"):
        synthetic.write_model(presets.tiny(), str(fresh), "q8_0")
    assert os.listdir(tmp_path) == []
    # An existing file at the path survives a failed rewrite untouched.
    old = tmp_path / "old.gguf"
    old.write_bytes(b"previous model")
    calls.clear()
    with pytest.raises(RuntimeError):
        synthetic.write_model(presets.tiny(), str(old), "f32")
    assert old.read_bytes() == b"previous model" and os.listdir(tmp_path) == ["old.gguf"]


def test_refuses_huge_and_bad_requests(tmp_path):
    path = str(tmp_path / "flash.gguf")
    with pytest.raises(InputError, match="GiB"):
        synthetic.write_model(presets.flash(), path, "ds4-q2")
    with pytest.raises(InputError, match="--quant"):
        synthetic.write_model(presets.tiny(), path, "q3")
    assert os.listdir(tmp_path) == []
    # the estimate is antirez/ds4's 2-bit Flash file to the MiB (spec §7.2: 80.76 GiB)
    assert synthetic.file_bytes(presets.flash(), "ds4-q2") / 2**30 == pytest.approx(80.76, abs=0.01)
