"""Synthetic DeepSeek-V4 GGUF files: random weights at sane scales, a real tokenizer, every key.

``write_model(cfg, path, quant)`` writes a file that ``load_gguf`` (and llama.cpp's deepseek4
loader) reads like a converted checkpoint: the metadata keys of spec §7.1 (the fixture's
``model.keys.json``), the tensor table of ``weights.tensor_specs`` in its order, types from one of
the mixes of ``QUANT_MIXES`` (spec §7.2/§7.3), and a byte-level BPE vocabulary trained on a small
built-in corpus. The weights are random but drawn the way DeepSeek's golden fixture drew them
(``fixtures/official-tiny/config.json`` "init"), so activations stay finite and varied over long
sequences with the QAT round-trips on: the files are for testing the engine, not for reading.

Letters: D hidden, E experts, F expert width, HC hyper-connection streams, V vocab.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable

import numpy as np
from gguf import GGUFValueType, GGUFWriter, LlamaFileType

from . import quants
from .config import ARCH, GATING_SQRTSOFTPLUS, ModelConfig
from .errors import InputError
from .quants import GGMLType
from .tokenizer import DEFAULT_SPECIALS, build_byte_bpe_vocab
from .weights import TensorSpec, tensor_specs

QUANT_MIXES = ("f32", "q8_0", "ds4-q2")
SPECIALS = list(DEFAULT_SPECIALS)  # BOS, EOS, <｜User｜>, <｜Assistant｜>, <think>, </think>
MAX_BYTES = 8 << 30  # write_model refuses bigger files (flash would be ~80 GiB)

# ---------------------------------------------------------------------------------------------
# Type mixes
# ---------------------------------------------------------------------------------------------

_MATRIX_ROLES = ("embed", "output", "hc", "attn", "compressor", "indexer", "router", "shared",
                 "expert_gate_up", "expert_down")

# role -> wanted type. norm/vector are always F32 and tid2eid always I32 (weights.py checks both).
_MIXES = {
    "f32": dict.fromkeys(_MATRIX_ROLES, GGMLType.F32),
    "q8_0": dict.fromkeys(_MATRIX_ROLES, GGMLType.Q8_0),
    # antirez/ds4's 2-bit file (spec §7.2): small-but-sensitive matrices in F16, attention and
    # shared expert Q8_0, the routed experts (90% of the bytes) at ~2 bits.
    "ds4-q2": {**dict.fromkeys(("hc", "compressor", "indexer", "router", "embed"), GGMLType.F16),
               **dict.fromkeys(("attn", "shared", "output"), GGMLType.Q8_0),
               "expert_gate_up": GGMLType.IQ2_XXS, "expert_down": GGMLType.Q2_K},
}
_FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "q8_0": LlamaFileType.MOSTLY_Q8_0,
               "ds4-q2": LlamaFileType.MOSTLY_IQ2_XXS}  # general.file_type: the recipe's label


def _check_quant(quant: str) -> None:
    if quant not in QUANT_MIXES:
        raise InputError(f"--quant {quant!r}: expected one of {', '.join(QUANT_MIXES)}")


def tensor_type(spec: TensorSpec, quant: str) -> int:
    """The GGML type ``spec`` gets in the mix ``quant``.

    A block type whose block does not divide the row length ne[0] cannot store the tensor
    (IQ2_XXS and Q2_K need multiples of 256; tiny's hidden size is 64). Such a tensor falls back
    to a 32-element block type, and failing that to F16, as llama.cpp's quantizer does
    (``llama_tensor_get_type``, "using fallback quantization"). llama.cpp picks IQ4_NL for the
    2-bit types; pocketfm reads no IQ4_NL, so the 32-element type here is Q8_0. Small presets
    thus load and run, at a heavier mix than asked.
    """
    _check_quant(quant)
    if spec.role == "tid2eid":
        return GGMLType.I32
    if spec.role in ("norm", "vector"):
        return GGMLType.F32
    for qtype in (_MIXES[quant][spec.role], GGMLType.Q8_0, GGMLType.F16):
        if spec.ne[0] % quants.BLOCK_SIZES[qtype][0] == 0:
            return qtype
    raise AssertionError("unreachable: F16 stores any row length")


def tensor_bytes(spec: TensorSpec, qtype: int) -> int:
    return quants.row_bytes(qtype, spec.ne[0]) * math.prod(spec.ne[1:])


def file_bytes(cfg: ModelConfig, quant: str) -> int:
    """Tensor bytes of ``cfg`` written as ``quant`` (metadata and padding excluded)."""
    return sum(tensor_bytes(s, tensor_type(s, quant)) for s in tensor_specs(cfg))


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# A few KB of English prose, Python and Chinese, so the learned merges cover words, code
# indentation and CJK runs the way a real vocabulary does (at a much smaller size).
CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads tokens one at a time and predicts the
next one; the longer the context, the more it has to remember. Memory is the hard part: at a
million tokens the key-value cache no longer fits on one accelerator, so the engine keeps most of
it on the host and brings back only what the attention will read. This is a test of the tokenizer.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness. In the beginning the Universe was created. This has made a lot of people very angry
and been widely regarded as a bad move. Call me Ishmael. Some years ago, never mind how long
precisely, having little or no money in my purse, I thought I would sail about a little and see
the watery part of the world. What is the answer? The answer is 42, and the question is unknown.
User: Can you explain how attention works? Assistant: Each query scores every key, the scores go
through a softmax, and the output is the weighted sum of the values. Sparse attention keeps only
the top-k keys, which is what makes very long contexts affordable.

def rmsnorm(x, weight, eps=1e-6):
    \"\"\"Scale x to unit root-mean-square, then by weight.\"\"\"
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


class Cache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = {}

    def get(self, key, default=None):
        if key in self.items:
            return self.items[key]
        return default

    def put(self, key, value):
        if len(self.items) >= self.capacity:
            self.items.pop(next(iter(self.items)))
        self.items[key] = value


for i in range(10):
    print(f"step {i}: loss = {1.0 / (i + 1):.4f}")


def softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) for v in x]
    total = sum(e)
    return [v / total for v in e]


if __name__ == "__main__":
    import sys
    with open(sys.argv[1], encoding="utf-8") as f:
        words = f.read().split()
    counts = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    for word, n in sorted(counts.items(), key=lambda kv: -kv[1])[:20]:
        print(f"{n:6d} {word}")

Numbers and dates appear in text too: 3.14159, 2.71828, 1,000,000 tokens, 128 experts, 2024-05-06.
The server returned {"status": "ok", "tokens": 512, "elapsed_ms": 87.5} after the second retry.
Long documents are split into chunks; each chunk is summarized, and the summaries are merged into
one answer. The reader should check the summary against the source before trusting any number in
it. When the weather is good we walk along the river, and when it rains we read books at home.

人工智能是计算机科学的一个分支，它企图了解智能的实质，
并生产出一种新的能以人类智能相似的方式做出反应的智能机器。
语言模型根据上下文预测下一个词。上下文越长，模型需要记住的信息就越多。
今天天气很好，我们去公园散步吧。你好，世界！请问你能帮我写一段代码吗？
当然可以，这是一个简单的例子。长文本推理需要高效的注意力机制和内存管理。
深度学习模型通过大量数据进行训练，学习语言的规律和知识。中文、英文和代码都是常见的训练数据。
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] }}"
    "<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)


@functools.lru_cache(maxsize=8)
def _vocab(n_vocab: int) -> tuple[tuple, tuple, tuple]:
    return tuple(tuple(x) for x in build_byte_bpe_vocab(n_vocab, CORPUS, SPECIALS))


def default_vocab(n_vocab: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types) of exactly ``n_vocab`` entries: the specials (BOS id 0,
    EOS id 1), 256 byte tokens, BPE merges learned from ``CORPUS``, then "<unusedK>" tokens
    once the corpus has no pairs left (vocabularies past ~1500 entries)."""
    tokens, merges, types = _vocab(n_vocab)
    return list(tokens), list(merges), list(types)


def tokenizer_fields(n_vocab: int) -> dict:
    """The ``tokenizer.*`` metadata keys of a synthetic file (DeepSeek's gpt2/joyai-llm BPE)."""
    tokens, merges, types = default_vocab(n_vocab)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "joyai-llm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        # gguf-py cannot write an empty array (spec §8b.14); a trained vocab always has merges.
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index(SPECIALS[0]),
        "tokenizer.ggml.eos_token_id": tokens.index(SPECIALS[1]),
        "tokenizer.ggml.add_bos_token": True,  # as DeepSeek's tokenizer_config.json
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

def synthetic_metadata(cfg: ModelConfig, tokenizer_fields: dict, name: str,
                       quant: str = "f32") -> dict:
    """GGUF key -> value of a synthetic file, in file order (spec §7.1, the fixture's keys).

    ``ModelConfig.from_metadata`` of the result equals ``stored_config(cfg)``: Python ints are
    written u32 and floats f32, as llama.cpp's loader requires, so 1e-6 comes back as the
    float32 nearest to it.
    """
    _check_quant(quant)
    n_blocks = cfg.n_layers + cfg.n_nextn  # llama.cpp counts the MTP block(s) in block_count
    pad = [0] * cfg.n_nextn  # MTP entries of the per-layer arrays (window-only, V4's layout)
    a = "attention."
    keys = {
        "block_count": n_blocks, "context_length": cfg.ctx_train,
        "embedding_length": cfg.dim, "vocab_size": cfg.vocab,
        a + "head_count": cfg.n_heads, a + "head_count_kv": 1,
        a + "key_length": cfg.head_dim, a + "value_length": cfg.head_dim,
        "rope.dimension_count": cfg.rope_dim,
        a + "q_lora_rank": cfg.q_rank, a + "output_lora_rank": cfg.o_rank,
        a + "output_group_count": cfg.o_groups, a + "sliding_window": cfg.window,
        a + "compress_ratios": [int(r) for r in cfg.compress_ratios] + pad,
        a + "compress_rope_freq_base": float(cfg.compress_rope_base),
        a + "indexer.head_count": cfg.index_heads, a + "indexer.key_length": cfg.index_dim,
        a + "indexer.top_k": cfg.index_topk,
        a + "layer_norm_rms_epsilon": float(cfg.rms_eps),
        "rope.freq_base": float(cfg.rope_base), "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(cfg.yarn_factor),
        "rope.scaling.original_context_length": cfg.yarn_orig_ctx,
        "rope.scaling.yarn_beta_fast": float(cfg.yarn_beta_fast),
        "rope.scaling.yarn_beta_slow": float(cfg.yarn_beta_slow),
        "expert_count": cfg.n_experts, "expert_used_count": cfg.n_experts_used,
        "expert_shared_count": cfg.n_shared_experts,
        "expert_feed_forward_length": cfg.moe_dim,
        "expert_weights_scale": float(cfg.routed_scale),
        "expert_weights_norm": bool(cfg.norm_topk),
        "expert_gating_func": GATING_SQRTSOFTPLUS,
        "hash_layer_count": cfg.n_hash_layers,
        "swiglu_clamp_exp": [float(c) for c in cfg.swiglu_clamp] + [10.0] * cfg.n_nextn,
        "swiglu_clamp_shexp": [float(c) for c in cfg.swiglu_clamp_shared] + [10.0] * cfg.n_nextn,
        "hyper_connection.count": cfg.hc_mult,
        "hyper_connection.sinkhorn_iterations": cfg.hc_iters,
        "hyper_connection.epsilon": float(cfg.hc_eps),
        "nextn_predict_layers": cfg.n_nextn,
    }
    meta = {"general.architecture": ARCH, "general.name": name,
            "general.file_type": int(_FILE_TYPES[quant])}
    if quant != "f32":
        meta["general.quantization_version"] = 2  # ggml's block layouts, as llama.cpp writes
    meta.update({f"{ARCH}.{k}": v for k, v in keys.items()})
    meta.update(tokenizer_fields)
    return meta


def stored_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as a GGUF stores it: every float field rounded to float32 (the key type)."""
    def f32(v):
        if isinstance(v, float):
            return float(np.float32(v))
        if isinstance(v, tuple):
            return tuple(f32(x) for x in v)
        return v

    return dataclasses.replace(cfg, **{f.name: f32(getattr(cfg, f.name))
                                       for f in dataclasses.fields(cfg)})


def _gguf_type(key: str, value) -> tuple[GGUFValueType, GGUFValueType | None]:
    """(type, array item type) the fixture uses: ints u32, floats f32, int arrays i32."""
    scalar = {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32,
              float: GGUFValueType.FLOAT32, str: GGUFValueType.STRING}
    if isinstance(value, list):
        if not value:
            raise InputError(f"metadata key {key}: gguf-py cannot write an empty array")
        item = scalar[type(value[0])]
        return GGUFValueType.ARRAY, GGUFValueType.INT32 if item == GGUFValueType.UINT32 else item
    return scalar[type(value)], None


# ---------------------------------------------------------------------------------------------
# Weights: the init recipe of DeepSeek's golden fixture
# ---------------------------------------------------------------------------------------------

def _linear_mult(name: str) -> float:
    """Scale on N(0,1)/sqrt(fan_in) (the fixture's recipe). Expert gate/up at 4 put the
    pre-activations at std ~4, so the SwiGLU clamp at 10 fires on ~1% of them (a path worth
    exercising); the fan-in scaling makes that independent of the model's size. Down at 0.5 and
    the head at 2 give logits of std ~2: a next-token distribution neither flat nor one-hot.
    Measured (tiny and small, QAT on): the FFN adds rms ~8 per block and attention ~0.35, the HC
    streams grow to rms ~30 over small's 23 blocks, and every sublayer input is re-normalised."""
    if name.endswith(("_exps.weight", "_shexp.weight")):
        return 0.5 if "ffn_down_" in name else 4.0
    return 2.0 if name == "output.weight" else 1.0


def _init_std(spec: TensorSpec) -> float | None:
    """Std of a zero-mean normal init, or None for the tensors that are not drawn that way."""
    name = spec.name
    if spec.role in ("norm", "tid2eid") or name.endswith(("_scale.weight", "_base.weight")):
        return None
    if spec.role == "embed" or name.endswith(("_ape.weight", "attn_sinks.weight")):
        return 1.0  # embedding, compressor position biases, sink logits: N(0,1)
    if name.endswith("exp_probs_b.bias"):
        return 0.3  # non-zero on purpose: the bias steers selection, never the weights
    # hc_*_fn: fan_in is HC·D, the flattened streams; everything else is a linear layer
    return _linear_mult(name) / math.sqrt(spec.ne[0])


def _draw(spec: TensorSpec, qtype: int, rng: np.random.Generator, n_experts: int
          ) -> np.ndarray:
    """One tensor's data in numpy order ([..., ne[0]] elements, or [..., row_bytes] bytes)."""
    shape = tuple(reversed(spec.ne))
    std = _init_std(spec)
    if std is not None:
        # F32/F16/Q8_0 draw N(0, std) and convert, so an f32 and a q8_0 file hold the same model
        # up to rounding; 2-bit types draw random codes at that std (quants.random_blocks).
        return quants.random_blocks(qtype, shape, rng, std)
    if spec.role == "tid2eid":
        # per token id the first k entries of a random permutation of the experts: [V, k] I32.
        # The argsort of iid uniforms is a uniform permutation per row, drawn in one call.
        n_vocab, k = shape
        return np.argsort(rng.random((n_vocab, n_experts)), axis=1)[:, :k].astype(np.int32)
    if spec.role == "norm":
        x = 1.0 + 0.1 * rng.standard_normal(shape)  # not ones: a missing norm weight shows
    elif spec.name.endswith("_base.weight"):
        x = rng.standard_normal(shape)  # HC base logits
    else:
        x = rng.uniform(0.2, 1.0, shape)  # HC scales
    return np.ascontiguousarray(x, dtype=np.float32)


def tensor_data(cfg: ModelConfig, index: int, spec: TensorSpec, qtype: int,
                seed: int) -> np.ndarray:
    """Data of tensor ``index`` of ``tensor_specs(cfg)``. Its generator is seeded with (seed,
    index) so that each tensor's values depend on nothing else: changing one tensor's type or
    the mix leaves every other tensor's values as they were."""
    rng = np.random.Generator(np.random.PCG64([seed, index]))
    return _draw(spec, qtype, rng, cfg.n_experts)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def write_model(cfg: ModelConfig, path: str, quant: str = "f32", seed: int = 0,
                name: str = "pocketfm-synthetic",
                progress: Callable[[int, int, str], None] | None = None,
                max_bytes: int = MAX_BYTES) -> None:
    """Write ``cfg`` with deterministic random weights to ``path`` as a deepseek4 GGUF.

    Same arguments, same bytes. The file appears whole or not at all: it is written to
    ``path + ".tmp"``, renamed over ``path`` when complete, and the temporary is removed on any
    error. Tensors are drawn and written one at a time (only one is in memory), so the ``small``
    preset needs a few hundred MB, not the whole model. ``progress(done, total, name)`` is
    called after each tensor. Files over ``max_bytes`` are refused (the flash geometry would be
    ~80 GiB of random numbers).
    """
    _check_quant(quant)
    path = os.fspath(path)
    cfg.validate("config")
    if cfg.n_nextn:
        raise InputError(f"config: n_nextn={cfg.n_nextn}; synthetic files carry no MTP block")
    specs = tensor_specs(cfg)
    types = [tensor_type(s, quant) for s in specs]
    total = sum(tensor_bytes(s, t) for s, t in zip(specs, types))
    if total > max_bytes:
        raise InputError(f"a {quant} file of this config would hold {total / 2**30:.1f} GiB of "
                         f"tensors, over the {max_bytes / 2**30:.1f} GiB limit of synthetic "
                         "models; use a smaller preset")
    meta = synthetic_metadata(cfg, tokenizer_fields(cfg.vocab), name, quant)

    tmp = path + ".tmp"
    writer = GGUFWriter(tmp, ARCH)  # adds general.architecture itself
    try:
        for key, value in meta.items():
            if key != "general.architecture":
                writer.add_key_value(key, value, *_gguf_type(key, value))
        # The header lists every tensor (name, ne, type, offset) before any data, so the
        # infos go first, as byte shapes: gguf-py turns [..., row_bytes] back into ne.
        for spec, qtype in zip(specs, types):
            n_bytes = quants.row_bytes(qtype, spec.ne[0])
            writer.add_tensor_info(spec.name, (*reversed(spec.ne[1:]), n_bytes), np.uint8,
                                   tensor_bytes(spec, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, (spec, qtype) in enumerate(zip(specs, types)):
            data = tensor_data(cfg, i, spec, qtype, seed)
            writer.write_tensor_data(np.ascontiguousarray(data).view(np.uint8))
            if progress is not None:
                progress(i + 1, len(specs), spec.name)
        writer.close()
        os.replace(tmp, path)
    except BaseException as exc:  # Ctrl-C too: never leave a half-written file behind
        writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(exc, OSError):
            raise InputError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
