"""The user-facing model object: load a GGUF, compute logits, generate text with timings.

``pocketfm.load(path)`` returns a ``Model``; ``Model.generate`` runs a chunked prefill over the
prompt, then decodes one token per forward call, sampling greedily (temperature 0) or with
temperature + top-p from a seeded generator, and reports prefill and decode tokens per second.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .errors import InputError
from .model import Forward, RunState
from .plan import DEFAULT_PREFILL_CHUNK
from .tokenizer import Tokenizer
from .weights import load_gguf

DEVICES = ("cpu", "cuda")


def resolve_device(device: str | None) -> str:
    """``None``/"auto": cuda when a CUDA GPU is present, else cpu. "cuda" without a GPU (and
    outside Numba's CUDA simulator) is a clear error."""
    if device == "cpu":
        return "cpu"
    if device not in (None, "auto", "cuda"):
        raise InputError(f"--device {device!r}: expected one of auto, {', '.join(DEVICES)}")
    from numba import cuda

    from .kernels.device import SIMULATOR
    present = SIMULATOR or cuda.is_available()
    if device == "cuda" and not present:
        raise InputError("--device cuda: no CUDA GPU found (numba.cuda.is_available() is "
                         "false); use --device cpu")
    return "cuda" if present and (device == "cuda" or not SIMULATOR) else "cpu"


def sample_top_p_ref(out_id, logits, temperature: float, top_p: float, u) -> int:
    """Temperature + nucleus sampling with a caller-drawn uniform ``u`` — THE definition, shared
    by the CPU path and the GPU kernel (``kernels.embed_sample.sample_top_p``), so both draw the
    same id from the same u. ``u``: a float in [0, 1) or a 1-element array; ``out_id``: a
    1-element int array or None. Returns the id.

    1. p = softmax(logits / temperature) in float64;
    2. keep every token with p >= tau, tau the largest threshold that keeps mass >= top_p (the
       smallest high-probability set; ties at tau all kept; top_p >= 1 keeps everything);
    3. the first kept id, in ascending id order, whose cumulative renormalised mass exceeds u.
    """
    lg = np.asarray(logits, np.float64).reshape(-1)
    p = np.exp((lg - lg.max()) / temperature)
    p /= p.sum()
    keep = np.ones(len(p), bool)
    if top_p < 1.0:
        ps = np.sort(p)[::-1]
        k = min(int(np.searchsorted(np.cumsum(ps), top_p)), len(ps) - 1)  # first cum >= top_p
        keep = p >= ps[k]
    c = np.cumsum(np.where(keep, p, 0.0))
    uu = float(np.asarray(u, np.float64).reshape(-1)[0])
    i = int(np.searchsorted(c, uu * c[-1], side="right"))  # first cumulative mass > u * S
    if i >= len(p):
        i = int(np.flatnonzero(keep)[-1])
    if out_id is not None:
        out_id[0] = i
    return i


def sample_next(logits: np.ndarray, temperature: float, top_p: float,
                rng: np.random.Generator) -> int:
    """Argmax at temperature 0 (ties to the lowest id); otherwise one draw of u from ``rng``."""
    if temperature <= 0.0:
        return int(np.argmax(logits))
    return sample_top_p_ref(None, logits, temperature, top_p, draw_uniform(rng))


def draw_uniform(rng: np.random.Generator, n: int | None = None):
    """The sampling uniform(s) as float32 — the GPU keeps them in float32, so both backends
    sample with the very same u (n at once equals n single draws)."""
    return rng.random(n).astype(np.float32) if n else np.float32(rng.random())


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids
    text: str
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int  # forward calls after the prefill
    stop_reason: str  # "eos", "max_tokens" or "ctx"
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.tokens),
            "prefill_tok_s": round(self.prefill_tok_s, 3),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "stop_reason": self.stop_reason, **self.extra,
        }


class Model:
    """A loaded DeepSeek-V4 GGUF: config, tokenizer, weights and a forward pass."""

    def __init__(self, path: str, device: str | None = None, qat: bool = True,
                 dtype=np.float32):
        self.device = resolve_device(device)
        if self.device == "cuda" and not qat and device in (None, "auto"):
            self.device = "cpu"  # auto: --no-qat runs where it can
        if self.device == "cuda" and not qat:
            raise InputError("--no-qat: the CUDA backend stores the packed FP8/FP4 caches, which "
                             "need QAT on; run --no-qat with --device cpu")
        self.file = load_gguf(path)
        self.path, self.config, self.weights = path, self.file.config, self.file.weights
        self.tokenizer = Tokenizer.from_metadata(self.file.meta)
        self.forward = Forward(self.config, self.weights, qat=qat, dtype=dtype)
        self._engine = None
        self._engine_swap = None

    def engine(self, capacity: int, progress=None, swap=None):
        """The CUDA decode engine (weights uploaded on first use) for ``capacity`` tokens;
        ``swap`` a kvswap.config.SwapPlanConfig (KV swap on when ``swap.enabled``)."""
        from .engine.decode import DecodeEngine
        from .kvswap.config import with_topk

        want = swap if swap is not None and swap.enabled else None
        if (self._engine is None or self._engine.capacity < capacity
                or self._engine_swap != want):
            self._engine = None  # free the old caches first
            cfg = with_topk(self.config, want) if want is not None else self.config
            self._engine = DecodeEngine(cfg, self.weights, capacity, progress=progress,
                                        swap=want)
            self._engine_swap = want
        return self._engine

    def new_state(self, capacity: int) -> RunState:
        return self.forward.new_state(capacity)

    def logits(self, tokens, chunk: int | None = None) -> np.ndarray:
        """Teacher-forced logits [T, vocab] of every position, from position 0 and a fresh state."""
        tokens = self._check_ids(tokens)
        if self.device == "cuda":  # one step per token, logits read back after each
            eng = self.engine(len(tokens))
            eng.start(list(tokens))
            out = []
            for _ in tokens:
                eng.step(graph=False)
                out.append(eng.read_logits())
            return np.stack(out)
        state = self.new_state(len(tokens))
        chunk = chunk or len(tokens)
        parts = [self.forward.forward(tokens[i:i + chunk], state)
                 for i in range(0, len(tokens), chunk)]
        return np.concatenate(parts)

    def encode_prompt(self, prompt, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a prompt: ids pass through; text gets BOS (unless the GGUF's
        ``tokenizer.ggml.add_bos_token`` is false) or the chat format."""
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.chat(prompt, system=system)
            bos = bool(self.file.meta.get("tokenizer.ggml.add_bos_token", True))
            return self.tokenizer.encode(prompt, bos=bos)
        return list(self._check_ids(prompt))

    def generate(self, prompt, max_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, ctx: int | None = None, chat: bool = False,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, stop_at_eos: bool = True,
                 on_token=None, progress=None, on_prefill=None,
                 memory=None, kv_swap=None, log=None) -> GenerationResult:
        """Prefill ``prompt`` in chunks, then decode up to ``max_tokens`` tokens.

        ``ctx`` is the run's context capacity (prompt + generated); by default the prompt plus
        ``max_tokens``, capped by the model's trained context. ``on_token(id)`` streams ids;
        ``progress(done, total, what)`` reports the GPU weight upload (device cuda);
        ``on_prefill(done, total, seconds)`` reports prompt tokens ingested, per chunk.
        ``memory``: a ``MemoryIndexer`` (see ``memory_indexer``) selecting the resident
        compressed entries; its statistics join the result's summary. ``kv_swap``: a
        kvswap.config.SwapConfig (device cuda; the selection decides what is staged), its
        ``gguf_kv_swap`` lines go to ``log(line)`` and its counters to the summary's kv_swap.
        """
        ids = self.encode_prompt(prompt, chat=chat)
        if not ids:
            raise InputError("prompt: empty prompt (expected at least one token)")
        ctx = ctx or min(len(ids) + max_tokens, self.config.ctx_train)
        if len(ids) > ctx:
            raise InputError(f"prompt: {len(ids)} tokens is longer than --ctx {ctx}")
        rng = np.random.default_rng(seed)
        swap = self._plan_swap(kv_swap, ctx, memory, log)
        if memory is not None:  # the KV swap's overlap may delay each set (memory/runtime.py)
            memory.lag = swap.lag if swap is not None else memory.sel.commit_lag or 0
        if self.device == "cuda":
            eng = self.engine(ctx, progress, swap)
            if swap is not None and log is not None and kv_swap.mem_profile:
                from .engine.kvswap import memory_lines

                for line in memory_lines(eng, ctx):
                    log(line)
            r = eng.generate(ids, max_tokens, temperature, top_p,
                             draw_uniform(rng, max_tokens) if temperature > 0 else None,
                             self.tokenizer.eos_id if stop_at_eos else None, on_token,
                             prefill_chunk=prefill_chunk, on_prefill=on_prefill,
                             memory=memory)
            out, stop = r["tokens"], r["stop"]
            text_ids = out[:-1] if stop == "eos" else out
            res = GenerationResult(out, self.tokenizer.decode(text_ids), len(ids),
                                   r["prefill_s"], r["decode_s"], r["decode_steps"], stop)
            if memory is not None:
                res.extra.update(memory.summary())
            if "kv_swap" in r:
                res.extra["kv_swap"] = r["kv_swap"]
                if log is not None and kv_swap.mem_profile:
                    from .engine.kvswap import stats_line

                    log(stats_line(r["kv_swap"]))
            return res
        state = self.new_state(ctx)
        if memory is not None:
            memory.start(len(ids), ctx)
        self.forward.memory = memory
        try:
            res = self._generate_cpu(ids, state, max_tokens, temperature, top_p, rng, ctx,
                                     prefill_chunk, stop_at_eos, on_token, on_prefill)
        finally:
            self.forward.memory = None
        if memory is not None:
            res.extra.update(memory.summary())
        return res

    def _plan_swap(self, kv_swap, ctx: int, memory, log):
        """The checked KV-swap plan of a run (None: not requested), logged the seed's way."""
        if kv_swap is None or not kv_swap.kv_swap:
            return None
        from .kvswap.config import plan_swap, swap_line
        from .engine.kvswap import MIB, checked_pinned_bytes

        if self.device != "cuda":
            raise InputError("--kv-swap: stages the selected chunks in GPU memory; it needs "
                             "--device cuda")
        plan = plan_swap(kv_swap, self.config, ctx, memory)
        pinned = 0  # checked before anything is allocated
        if plan.enabled:
            pinned = checked_pinned_bytes(self.config, ctx, plan.gpu_chunks, plan.key_layers,
                                          kv_swap.pinned_mib)
        if log is not None and kv_swap.mem_profile:
            log(swap_line(kv_swap, plan, pinned / MIB))
        return plan

    def memory_indexer(self, selection, checkpoint: str | None = None):
        """A ``MemoryIndexer`` for this model: ``selection`` a ``memory.SelectionConfig``,
        ``checkpoint`` a retriever safetensors file (needed by lookahead and global-topk)."""
        from .memory import MemoryIndexer, load_retriever

        ret = load_retriever(checkpoint, self.config) if checkpoint else None
        return MemoryIndexer(self.config, selection, ret, self.forward.freq_compressed,
                             self.forward.hadamard)

    def _generate_cpu(self, ids, state, max_tokens, temperature, top_p, rng, ctx,
                      prefill_chunk, stop_at_eos, on_token, on_prefill) -> GenerationResult:
        t0 = time.perf_counter()
        for i in range(0, len(ids), prefill_chunk):
            logits = self.forward.forward(ids[i:i + prefill_chunk], state, all_logits=False)
            if on_prefill:
                on_prefill(state.pos, len(ids), time.perf_counter() - t0)
        prefill_s = time.perf_counter() - t0
        out, stop, steps, t1 = [], "max_tokens", 0, time.perf_counter()
        while len(out) < max_tokens:
            tok = sample_next(logits[-1], temperature, top_p, rng)
            out.append(tok)
            if on_token:
                on_token(tok)
            if stop_at_eos and tok == self.tokenizer.eos_id:
                stop = "eos"
                break
            if len(out) == max_tokens:
                break
            if state.pos >= ctx:
                stop = "ctx"
                break
            logits = self.forward.forward([tok], state, all_logits=False)
            steps += 1
        decode_s = time.perf_counter() - t1
        text_ids = out[:-1] if stop == "eos" else out  # the end-of-sequence mark is not text
        return GenerationResult(out, self.tokenizer.decode(text_ids), len(ids), prefill_s,
                                decode_s, steps, stop)

    def _check_ids(self, tokens) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.config.vocab)]
        if bad.size:
            raise InputError(f"tokens: id {int(bad[0])} out of range, expected 0..{self.config.vocab - 1}")
        return ids


def load(path: str, device: str | None = None, qat: bool = True, dtype=np.float32) -> Model:
    """Load a deepseek4 GGUF. ``qat=False`` switches off the FP8/FP4 round-trips (spec §8b.1)."""
    return Model(path, device=device, qat=qat, dtype=dtype)
