"""The ``pocketfm`` command line: run, inspect, bench, make-model, make-retriever.

Bad input of any kind (flag, file, tensor, metadata key, prompt) ends with one line on stderr,
``error: …``, and exit status 2 — no traceback (see errors.py).
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter

import click

from .errors import InputError
from .plan import DEFAULT_PREFILL_CHUNK, plan_command

EMBEDDED_PRESET, EMBEDDED_QUANT, EMBEDDED_SEED = "tiny", "ds4-q2", 0
MEMORY_MODES = ("lookahead", "global-topk", "full", "recency", "random")  # memory/selection.py


class OneLineErrors(click.Group):
    """A click group whose usage errors and InputErrors print one line and exit 2."""

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
            sys.exit(rv if isinstance(rv, int) else 0)
        except click.exceptions.Exit as e:  # --help and friends
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        except click.ClickException as e:
            click.echo(f"error: {_usage_line(e)}", err=True)
            sys.exit(2)
        except InputError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except BrokenPipeError:  # `pocketfm run | head`
            sys.exit(0)


def _usage_line(e: click.ClickException) -> str:
    msg = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    return f"{ctx.command_path}: {msg}" if ctx is not None else msg


def embedded_model_path() -> str:
    """The embedded tiny model, built deterministically into the user cache on first use.

    The file is a pure function of (preset, quant mix, seed, pocketfm version), so a rebuilt file
    is identical; it is written atomically, so a concurrent first use cannot see half a file.
    """
    from . import __version__
    from .presets import preset
    from .synthetic import write_model

    cache = os.environ.get("POCKETFM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pocketfm")
    path = os.path.join(cache, f"{EMBEDDED_PRESET}-{EMBEDDED_QUANT}-s{EMBEDDED_SEED}-"
                               f"v{__version__}.gguf")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        write_model(preset(EMBEDDED_PRESET), path, quant=EMBEDDED_QUANT, seed=EMBEDDED_SEED,
                    name="pocketfm-embedded-tiny")
    return path


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """pocketfm — a minimalist long-context inference engine for DeepSeek-V4 GGUF models.

    \b
    Start here:
      pocketfm run --prompt "Hello"          # embedded tiny model (CPU works)
      pocketfm run --model FILE.gguf --ctx 4096 --prompt-file notes.txt
      pocketfm run --model FILE.gguf --device cuda --ctx 65536 --prompt-file notes.txt
      pocketfm inspect FILE.gguf             # metadata, tensor table, bytes by type
      pocketfm make-model --preset tiny --quant ds4-q2 -o tiny.gguf
      pocketfm make-retriever -o ret.safetensors   # a Memory Indexer checkpoint
      pocketfm run --memory-indexer ret.safetensors --prompt-file long.txt --stats
      pocketfm bench --preset flash --ctx 262144   # GPU decode speed, no file needed
      pocketfm plan --preset flash --ctx 1048576 --kv-swap   # GPU / pinned memory, no GPU
    """


@main.command()
@click.option("--model", "model_path", type=str, default=None,
              help="deepseek4 GGUF file (default: the embedded tiny model).")
@click.option("--prompt", type=str, default=None, help="Prompt text.")
@click.option("--prompt-file", type=str, default=None, help="Read the prompt from a UTF-8 file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the DeepSeek-V4 chat format.")
@click.option("--max-tokens", type=click.IntRange(min=0), default=64, show_default=True,
              help="Tokens to generate.")
@click.option("--ctx", type=click.IntRange(min=1), default=None,
              help="Context capacity in tokens (prompt + generated); default: just enough.")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0,
              show_default=True, help="Nucleus sampling mass (with --temperature > 0).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True,
              help="auto = cuda when a CUDA GPU is present, else cpu. cuda runs each token as "
                   "one captured CUDA graph over packed device caches (needs QAT on).")
@click.option("--no-qat", is_flag=True,
              help="Switch off the model's FP8/FP4 round-trips (for fidelity checks).")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=DEFAULT_PREFILL_CHUNK,
              show_default=True,
              help="Prompt tokens per prefill chunk (cuda: batched GEMMs, the compressors and "
                   "the indexer over the chunk; its buffers grow with it).")
@click.option("--json", "as_json", is_flag=True,
              help="End with one JSON object (tokens, prompt_tokens, prefill_tok_s, ...).")
@click.option("--memory-indexer", "retriever_path", type=str, default=None,
              help="FlashMemory retriever checkpoint (safetensors: the official file or one "
                   "from make-retriever); selects which compressed entries stay resident.")
@click.option("--selection", type=click.Choice(MEMORY_MODES), default=None,
              help="Resident-set policy (default: lookahead with --memory-indexer, else "
                   "none): lookahead = retriever every --interval steps, threshold + recency "
                   "tail + pages, native top-k inside; global-topk = the seed's per-step "
                   "ensemble top-k replacing the native choice; full / recency / random = "
                   "baselines.")
@click.option("--ensemble", type=click.Choice(["max", "mean", "or"]), default=None,
              help="How the retriever layers' scores combine [default: max].")
@click.option("--threshold", type=float, default=0.5, show_default=True,
              help="Keep chunks whose ensemble score is strictly above this.")
@click.option("--keep-topk", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep the K best chunks instead of thresholding (0 = threshold).")
@click.option("--interval", type=click.IntRange(min=1), default=64, show_default=True,
              help="Decode steps between retriever cycles.")
@click.option("--kmax", type=click.IntRange(min=0), default=None,
              help="Resident pages at most (0 = chunk granularity, no pages; default: the "
                   "checkpoint's, 96 for V4-Flash).")
@click.option("--kmax-ratio", type=float, default=0.0,
              help="KMAX as this fraction of the context's pages (overrides --kmax).")
@click.option("--recency-tail", type=click.IntRange(min=0), default=None,
              help="Newest chunks always resident (default: the checkpoint's, 2048 for "
                   "V4-Flash).")
@click.option("--sink", type=click.IntRange(min=0), default=0, show_default=True,
              help="Oldest chunks always resident.")
@click.option("--random-ratio", type=float, default=0.10, show_default=True,
              help="--selection random: share of older chunks resampled each cycle.")
@click.option("--commit-lag", type=click.IntRange(min=0), default=None,
              help="Decode steps from a cycle's boundary to its set taking effect (the "
                   "scoring, selection and swap-ins overlap them) [default: 0; with --kv-swap "
                   "2, or 0 with --kv-swap-sync].")
@click.option("--stats", is_flag=True, help="Print one line per retriever cycle on stderr.")
@click.option("--kv-swap", is_flag=True, default=None,
              help="Keep the CSA layers' compressed KV in a pinned host pool and only the "
                   "selected chunks in GPU staging slots (needs --device cuda and a selection; "
                   "env POCKETLLM_GGUF_KV_SWAP).")
@click.option("--gpu-chunks", type=click.IntRange(min=1), default=None,
              help="GPU staging slots, shared by all CSA layers [default: twice the "
                   "selection's set (the running window's and the next, so swap-ins overlap "
                   "the decode; once with --kv-swap-sync) plus a decode region, at least "
                   "index_topk].")
@click.option("--pinned-mib", type=click.IntRange(min=1), default=None,
              help="Cap on the pinned host pool, MiB [default: 16384].")
@click.option("--kv-swap-validate", "kv_swap_validate", is_flag=True, default=None,
              help="After each swap-in, compare every staged slot byte for byte with the pool.")
@click.option("--kv-swap-sync", "kv_swap_sync", is_flag=True, default=None,
              help="No overlap: each cycle's copies run at its boundary and the host waits "
                   "for them (debugging); commit lag 0.")
@click.option("--kv-swap-test-allow-topk-reduction", "allow_topk_reduction", is_flag=True,
              default=None, help="Allow --gpu-chunks below index_topk (lowers the native "
                                 "top-k to the slot count; small-context tests only).")
@click.option("--recall-diagnostic", is_flag=True,
              help="Also measure how much of the native full-history top-k lies in the "
                   "resident set (native_topk_recall in --json).")
def run(model_path, prompt, prompt_file, chat, max_tokens, ctx, temperature, top_p, seed,
        device, no_qat, prefill_chunk, as_json, retriever_path, selection, ensemble, threshold,
        keep_topk, interval, kmax, kmax_ratio, recency_tail, sink, random_ratio, commit_lag,
        stats, kv_swap, gpu_chunks, pinned_mib, kv_swap_validate, kv_swap_sync, allow_topk_reduction,
        recall_diagnostic):
    """Generate text: stream it, then print prompt/generated counts and tok/s.

    With --memory-indexer (or a --selection baseline) the FlashMemory Memory Indexer decides
    which compressed entries the native indexer may pick from; --json then adds
    resident_fraction and the per-cycle stats (memory_cycles). With --kv-swap the compressed
    KV lives in pinned host memory and the selected chunks are swapped into GPU slots; the
    gguf_kv_swap lines go to stderr and --json adds kv_swap (hits, misses, stores, ...).
    The seed's POCKETLLM_GGUF_* variables are read too (flags win). With --device cuda the
    kernels compile at their first launch (a minute or two on V4-Flash) and are kept on disk
    for the next run (~/.cache/pocketfm/kernels; POCKETFM_KERNEL_CACHE=DIR elsewhere, =off
    not at all).
    """
    from .generate import load
    from .kvswap.config import swap_config

    swap_cfg, mem_env = swap_config(dict(
        kv_swap=kv_swap, gpu_chunks=gpu_chunks, pinned_mib=pinned_mib,
        validate=kv_swap_validate, sync=kv_swap_sync, allow_topk_reduction=allow_topk_reduction))
    retriever_path = retriever_path or mem_env.checkpoint
    selection = selection or mem_env.selection
    ensemble = ensemble or mem_env.ensemble or "max"

    if prompt is not None and prompt_file is not None:
        raise InputError("--prompt and --prompt-file: give one, not both")
    if prompt_file is not None:
        prompt = _read_prompt_file(prompt_file)
    if prompt is None:
        prompt = "The quick brown fox"
    model = load(model_path or embedded_model_path(), device=device, qat=not no_qat)
    if ctx is not None and ctx > model.config.ctx_train:
        raise InputError(f"--ctx {ctx}: exceeds the model's context_length "
                         f"{model.config.ctx_train}")
    stream = model.tokenizer.decode_stream()

    def emit(tok):
        if tok == model.tokenizer.eos_id:
            return
        piece = stream.push(tok)
        if piece:
            click.echo(piece, nl=False)
            sys.stdout.flush()

    def progress(done, total, what):  # the GPU weight upload, on stderr
        click.echo(f"\rloading weights to the GPU: {done}/{total} ({what})" + " " * 8,
                   nl=done == total, err=True)

    def prefilled(done, total, seconds):  # prompt ingestion, on stderr, when it takes a while
        if total > prefill_chunk:
            click.echo(f"\rprefill: {done}/{total} tokens, {done / max(seconds, 1e-9):.0f} tok/s"
                       + " " * 8, nl=done >= total, err=True)

    memory = None
    if retriever_path is not None or selection is not None:
        from .memory import SelectionConfig
        from .memory.runtime import format_cycle

        sel = SelectionConfig(
            mode=selection or "lookahead", ensemble=ensemble, threshold=threshold,
            topk=keep_topk, interval=interval, recency_tail=recency_tail, sink=sink, kmax=kmax,
            kmax_ratio=kmax_ratio, random_ratio=random_ratio, recall_diagnostic=recall_diagnostic,
            commit_lag=commit_lag)
        memory = model.memory_indexer(sel, retriever_path)
        if stats:
            memory.on_cycle = lambda c: click.echo("\n" + format_cycle(c), err=True)
    elif commit_lag is not None:
        raise InputError("--commit-lag: only meaningful with a selection (--memory-indexer or "
                         "--selection)")
    res = model.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                         seed=seed, ctx=ctx, chat=chat, prefill_chunk=prefill_chunk,
                         on_token=emit, progress=progress, on_prefill=prefilled,
                         memory=memory, kv_swap=swap_cfg,
                         log=lambda line: click.echo(line, err=True))
    click.echo(stream.flush())  # any held-back partial UTF-8, then the newline
    if as_json:
        res.extra.update(device=model.device, model=model.path, text=res.text)
        click.echo(json.dumps(res.summary()))
    else:
        click.echo(f"[{res.prompt_tokens} prompt tokens, {len(res.tokens)} generated "
                   f"({res.stop_reason}); prefill {res.prefill_tok_s:.1f} tok/s, "
                   f"decode {res.decode_tok_s:.1f} tok/s, device {model.device}]")
        if memory is not None:
            m = memory.summary()
            click.echo(f"[memory: {m['selection']}, {len(m['memory_cycles'])} cycles, "
                       f"resident fraction {m['resident_fraction']:.3f}"
                       + (f", native top-k recall {m['native_topk_recall']:.3f}"
                          if "native_topk_recall" in m else "") + "]")


def _read_prompt_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"--prompt-file {path}: cannot read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--prompt-file {path}: not UTF-8 (byte {e.start})") from None


@main.command()
@click.argument("path", type=str)
@click.option("--all-keys", is_flag=True, help="Print long arrays in full.")
def inspect(path, all_keys):
    """Print a GGUF's metadata, tensor table and bytes by type, and check it as deepseek4."""
    from .quants import type_name
    from .weights import load_gguf

    f = load_gguf(path)  # validates the whole table first: a bad file gives one error line
    click.echo(f"file: {path} ({f.file_bytes / 2**20:.1f} MiB)")
    click.echo("metadata:")
    for key, value in f.meta.items():
        if isinstance(value, list) and len(value) > 16 and not all_keys:
            value = f"[{len(value)} items]"
        click.echo(f"  {key} = {value}")
    click.echo(f"tensors ({len(f.tensors)} used):")
    by_type = Counter()
    for t in f.tensors:
        by_type[type_name(t.qtype)] += t.nbytes
        click.echo(f"  {t.name:<40} {type_name(t.qtype):<8} ne={list(t.ne)} {t.nbytes} B")
    click.echo("bytes by type:")
    for name, n in by_type.most_common():
        click.echo(f"  {name:<8} {n / 2**20:10.2f} MiB")
    if f.weights.extra:
        mtp = [n for n in f.weights.extra if n.startswith("mtp.") or ".nextn." in n]
        click.echo(f"ignored tensors: {len(f.weights.extra)} ({len(mtp)} MTP; pocketfm does not "
                   "use the optional MTP block)")
    cfg = f.config
    click.echo(f"model: {cfg.n_layers} layers, hidden {cfg.dim}, {cfg.n_params() / 1e9:.3f} B "
               f"params, ratios {list(cfg.compress_ratios)}")


@main.command()
@click.option("--preset", "preset_name", type=click.Choice(["tiny", "small", "flash"]),
              default="flash", show_default=True, help="Model geometry (no file needed).")
@click.option("--ctx", type=click.IntRange(min=1), default=262144, show_default=True,
              help="Context the decode runs at (the caches are filled synthetically).")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Decode steps timed.")
@click.option("--quant", type=click.Choice(["f32", "q8_0", "ds4-q2"]), default="ds4-q2",
              show_default=True, help="Tensor type mix of the synthetic weights.")
@click.option("--seed", type=int, default=0, show_default=True, help="Weight seed.")
@click.option("--profile", is_flag=True,
              help="Also time one step call by call (GPU ms per launcher, GEMVs per weight), "
                   "and with --prefill one chunk launch by launch.")
@click.option("--ncu-step", is_flag=True,
              help="Then run one more step eagerly on one stream between cudaProfilerStart and "
                   "Stop: under `ncu --profile-from-start off` a per-kernel profile of one step.")
@click.option("--ncu-graph", is_flag=True,
              help="As --ncu-step, with the captured graph's own kernels and side streams (ncu "
                   "still runs each kernel alone): the step's main-stream kernels in order, "
                   "whose times add up to the replayed step (BENCHMARKS.md 2026-12-06 (m)).")
@click.option("--ncu-chunk", is_flag=True,
              help="With --prefill: then run its last chunk again, on one stream, between "
                   "cudaProfilerStart and Stop (a per-kernel profile of one chunk under ncu).")
@click.option("--prefill-ab", is_flag=True,
              help="With --prefill: then time its last chunk again under variants that each "
                   "undo one landed change (one stream, each side-stream branch off, q's norm "
                   "and RoPE as launches) or try a candidate (the routed experts, the dense "
                   "Q8_0 GEMMs in 64-token tiles), in turn, twice: an A/B in one process.")
@click.option("--decode-ab", is_flag=True,
              help="Then time the decode steps again under variants that each undo one landed "
                   "change (one stream instead of the side-stream branches; HC pre's u block as "
                   "one block instead of 8; the MoE's combine as its own launch; the one u block "
                   "of 512 threads; it and HC post + mix without their loads first; x limbs a "
                   "thread a chunk; the q_a norm as its own launch; the indexer's scores a warp "
                   "per 16 heads; the top-k counting its first digit; out_a's limbs as their own "
                   "launch; the routed gate+up on dp4a instead of the int8 tensor cores; the "
                   "split attention's tile in float32 instead of bf16; the split attention two "
                   "heads a warp over 16-slot tiles instead of one head a warp over 32, and that "
                   "kernel without its next tile's prefetch, or at 4 or 1 tiles a split; HC "
                   "pre's post + comb and the compressor on the side stream; the CSA q_a norm as "
                   "its own launch, the indexer's weights after its keys; no L2 prefetch of "
                   "out_a's weights, or by 16 or 4 blocks; no L2 prefetch of the next layer's "
                   "q_a beside the MoE; HCA's tensor-core attention with q and its partials "
                   "unstaged (CSA's partials too), or at 4 tiles a split; the attention's "
                   "combine a thread a dim instead of its splits over 4 thread groups, or over 2 "
                   "or 8; the indexer query as its GEMV and then the Hadamard instead of one "
                   "launch; the indexer scorer staging q instead of reading the query's "
                   "fragments; the routed gate+up's imma blocks of one tile instead of the "
                   "SM-wide build; the decode GEMVs' grids at a full wave instead of 0.9 of one; "
                   "the side streams' small GEMVs at the main stream's share instead of a "
                   "quarter of a wave) or try a candidate (those grids at 0.75 of a wave; the "
                   "side streams' small GEMVs at 0.125 or 0.5 of a wave; the CSA layers' q_b "
                   "beside the indexer at 0.5 or 0.25 of a wave; the q_a norm folded on "
                   "every layer; the indexer query's Hadamard a warp a vector; the routed "
                   "gate+up's SM-wide build of 4 tiles a block, or its super-blocks summed as "
                   "integers (x scaled per 256 columns), its tables packed or wide; the routed "
                   "down reading by flat offsets, or on the int8 "
                   "tensor cores too), each step captured anew, in turn, twice: an A/B in one "
                   "process.")
@click.option("--decode-ab-only", "decode_ab_only", multiple=True, metavar="TEXT",
              help="--decode-ab with only the variants whose names contain TEXT (any of them "
                   "when repeated; case-insensitive), beside the step as landed.")
@click.option("--decode-without", "decode_without", multiple=True, metavar="REGEX",
              help="Then time the decode steps again without the launches of the kernels whose "
                   "names match REGEX (as ncu shows them, e.g. _route_group_rank; one row each, "
                   "beside the step as landed): what those launches cost the step, the most that "
                   "fusing them away could save. Timing only: the outputs of those steps are "
                   "wrong.")
@click.option("--prefill", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also prefill this many random tokens after the --ctx fill, in chunks "
                   "(timed: prefill tok/s at that depth); decode then runs after them.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=DEFAULT_PREFILL_CHUNK,
              show_default=True,
              help="Tokens per prefill chunk.")
@click.option("--kv-swap", is_flag=True,
              help="Decode with the CSA KV in a pinned host pool and a lookahead-shaped set "
                   "(KMAX pages incl. the recency tail) staged in GPU slots, recommitted every "
                   "--interval steps with --churn of its older pages new.")
@click.option("--gpu-chunks", type=click.IntRange(min=1), default=None,
              help="Staging slots with --kv-swap [default: as run --kv-swap: 2 x KMAX pages x "
                   "page + decode region; 1 x with --commit-lag 0].")
@click.option("--interval", type=click.IntRange(min=1), default=64, show_default=True,
              help="Decode steps per retrieval cycle (--kv-swap).")
@click.option("--churn", type=click.FloatRange(0.0, 1.0), default=0.1, show_default=True,
              help="Share of the set's older pages replaced per cycle (--kv-swap).")
@click.option("--commit-lag", type=click.IntRange(min=0), default=None,
              help="Replays between staging a set and its taking effect, overlapped with its "
                   "copies (--kv-swap) [default: as run --kv-swap, 2; 0: copies at the "
                   "boundary].")
@click.option("--layers", type=int, default=None,
              help="Only the preset's first N layers (each as in the full model): the flash "
                   "geometry on a card under its 87 GB of weights (--layers 30: ~61 GB). "
                   "tok/s then counts N layers' work, not the model's.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench(preset_name, ctx, tokens, quant, seed, profile, ncu_step, ncu_graph, ncu_chunk,
          prefill_ab, decode_ab, decode_ab_only, decode_without, prefill, prefill_chunk, kv_swap,
          gpu_chunks, interval, churn, commit_lag, layers, as_json):
    """Decode (and prefill) speed on the GPU at a model geometry and context, no model file.

    Weights are made on the GPU in the type mix of make-model; the context is a synthetic
    fill of the caches (valid random packed entries for --ctx positions), which leaves the
    decode work exactly that of a real run at that context. With --prefill N, N random
    tokens then go through the real chunked prefill. Prints decode (and prefill) tok/s,
    bytes read per token and achieved GB/s, and GPU memory by component. Kernels are
    launched with programmatic dependent launch on sm_90 GPUs; POCKETFM_PDL=0 turns it off.
    Compiled kernels are kept on disk for the next run (~/.cache/pocketfm/kernels;
    POCKETFM_KERNEL_CACHE=DIR elsewhere, =off not at all: then every kernel compiles again);
    --json's kernel_cache names the directory (null: off).
    """
    from .generate import resolve_device
    from .presets import first_layers, preset

    cfg = preset(preset_name)
    if layers is not None:
        cfg = first_layers(cfg, layers)
    if ncu_step and ncu_graph:
        raise InputError("--ncu-step / --ncu-graph: one of them (each profiles one more step)")
    ncu = "graph" if ncu_graph else ncu_step
    if ctx + prefill + tokens + 3 + int(bool(ncu)) > cfg.ctx_train:
        raise InputError(f"--ctx {ctx}: with --prefill {prefill} and --tokens {tokens} exceeds "
                         f"the {preset_name} context_length {cfg.ctx_train}")
    for flag, on in (("--ncu-chunk", ncu_chunk), ("--prefill-ab", prefill_ab)):
        if on and not prefill:
            raise InputError(f"{flag}: needs --prefill N (the chunk it times again)")
    if decode_ab_only:
        from .engine.bench import decode_variant_names

        decode_ab = decode_variant_names(decode_ab_only)
        if len(decode_ab) < 2:
            names = "; ".join(decode_variant_names([""])[1:])
            raise InputError(f"--decode-ab-only {' / '.join(decode_ab_only)}: no --decode-ab "
                             f"variant's name contains it; the names: {names}")
    if decode_without:
        from .engine.bench import check_without

        for pattern in decode_without:
            check_without(pattern)
    resolve_device("cuda")
    from .engine.bench import run_bench

    def progress(done, total, name):
        click.echo(f"\rbuilding weights on the GPU: {done}/{total} ({name})" + " " * 8,
                   nl=done == total, err=True)
    slots = 0
    if kv_swap:
        from .kvswap.config import overlap_lag
        from .plan import default_swap

        if commit_lag is None:
            commit_lag = overlap_lag(interval)
        if commit_lag >= interval:
            raise InputError(f"--commit-lag {commit_lag}: expected < --interval {interval}")
        slots = gpu_chunks or default_swap(cfg, interval=interval, lag=commit_lag)[0]
        if ctx // 4 <= slots:
            raise InputError(f"--kv-swap: --ctx {ctx} has {ctx // 4} chunks, not more than the "
                             f"{slots} staging slots: nothing to swap")
        if profile or ncu or ncu_chunk or decode_ab or decode_without:
            flag = ("--profile" if profile else "--ncu-step" if ncu_step else
                    "--ncu-graph" if ncu_graph else "--ncu-chunk" if ncu_chunk else
                    "--decode-ab" if decode_ab else "--decode-without")
            raise InputError(f"{flag}: not with --kv-swap (profile the step without it)")
    elif gpu_chunks is not None or commit_lag is not None:
        raise InputError(f"--{'gpu-chunks' if gpu_chunks is not None else 'commit-lag'}: only "
                         "meaningful with --kv-swap")
    r = run_bench(cfg, ctx, tokens, quant, seed, progress, profile, prefill, prefill_chunk,
                  slots, interval, churn, commit_lag, ncu=ncu, ncu_prefill=ncu_chunk,
                  prefill_ab=prefill_ab, decode_ab=decode_ab, decode_without=decode_without)
    if as_json:
        click.echo(json.dumps(dict(preset=preset_name, layers=cfg.n_layers, **r)))
        return
    gb = r["gpu_bytes"]
    name = preset_name if layers is None else f"{preset_name} (first {layers} layers)"
    if prefill:
        click.echo(f"{name}: prefill {prefill:,} tokens after ctx {ctx:,} in chunks of "
                   f"{prefill_chunk}: {r['prefill_tok_s']:.1f} tok/s ({r['prefill_s']:.2f} s)")
    if "prefill_ab" in r:
        click.echo("the last prefill chunk again, per variant (GPU s, best / median of 2):")
        for variant, t in r["prefill_ab"].items():
            click.echo(f"  {variant:<36} {t['best_s']:.4f} / {t['median_s']:.4f}")
    click.echo(f"{name} at ctx {r['ctx']:,}: decode {r['decode_tok_s']:.1f} tok/s "
               f"({r['step_ms']:.2f} ms/step), {r['bytes_per_token']['total'] / 1e9:.2f} GB "
               f"read/token, {r['achieved_gbs']:.0f} GB/s")
    if "decode_ab" in r:
        click.echo("decode A/B, ms a step (best / median of 2, each captured anew):")
        for variant, t in r["decode_ab"].items():
            left = t.get("left_out")
            left = "" if left is None else f" ({sum(left.values())} launches a step left out)"
            click.echo(f"  {variant:<36} {t['best_ms']:.3f} / {t['median_ms']:.3f}{left}")
    if kv_swap:
        st = r["kv_swap"]
        click.echo(f"kv swap: {st['gpu_chunks']} slots x {st['layers']} CSA layers, pinned pool "
                   f"{r['swap_pinned_bytes'] / 2**30:.2f} GiB; first commit "
                   f"{r['swap_first_commit_ms']:.1f} ms, swap-in {r['swap_in_gbs']:.1f} GB/s "
                   f"({r['swap_in_rows']} chunks in {r['swap_in_ms']:.2f} ms); step graph "
                   f"{r['swap_step_ms']:.2f} ms; cycles every {interval} steps (churn {churn}), "
                   f"each set in force {commit_lag} replays after its boundary")
        from .engine.kvswap import stats_line

        click.echo(stats_line(st))
    other = gb["workspace_and_other"]
    click.echo(f"GPU memory: weights {gb['weights'] / 2**30:.2f} GiB, KV caches "
               f"{gb['kv_caches'] / 2**30:.2f} GiB, workspace+other "
               + ("n/a (simulator)" if other is None else f"{other / 2**30:.2f} GiB"))
    if "profile_ms" in r:
        click.echo(f"one step, GPU time by launcher, each call timed alone as a graph "
                   f"({r['profile_sum_ms']:.2f} ms in all):")
        for name, ms in r["profile_ms"].items():
            click.echo(f"  {name:<28} {ms:8.3f} ms")
    if "prefill_profile" in r:
        pp = r["prefill_profile"]
        click.echo(f"one prefill chunk, each launch synchronised ({pp['chunk_ms']:.1f} ms):")
        for name, ms in pp["by_launcher"].items():
            click.echo(f"  {name:<28} {ms:8.2f} ms")


main.add_command(plan_command, "plan")


@main.command("make-model")
@click.option("--preset", "preset_name", type=click.Choice(["tiny", "small", "flash"]),
              required=True, help="Model geometry.")
@click.option("--quant", type=click.Choice(["f32", "q8_0", "ds4-q2"]), default="f32",
              show_default=True, help="Tensor type mix (ds4-q2 = the antirez/ds4 2-bit mix).")
@click.option("--seed", type=int, default=0, show_default=True, help="Weight seed.")
@click.option("-o", "--output", type=str, required=True, help="Output GGUF path.")
def make_model(preset_name, quant, seed, output):
    """Write a deepseek4 GGUF with deterministic random weights and a byte-level BPE vocab."""
    from .presets import preset
    from .synthetic import write_model

    cfg = preset(preset_name)
    write_model(cfg, output, quant=quant, seed=seed, name=f"pocketfm-{preset_name}")
    click.echo(f"wrote {output}: {preset_name} ({cfg.n_params() / 1e6:.2f} M params, {quant}, "
               f"{os.path.getsize(output) / 2**20:.2f} MiB)")


@main.command("make-retriever")
@click.option("--model", "model_path", type=str, default=None,
              help="deepseek4 GGUF file (default: the embedded tiny model).")
@click.option("-o", "--output", type=str, required=True, help="Output safetensors path.")
@click.option("--init", type=click.Choice(["native", "random"]), default="native",
              show_default=True,
              help="native = start from the model's own indexer weights (as the paper's "
                   "training does), the rest random; random = all random.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random part.")
@click.option("--heads", type=click.IntRange(min=1), default=None,
              help="Retriever heads (default: 2x the model's indexer heads; 128 for V4-Flash).")
@click.option("--rank", type=click.IntRange(min=1), default=None,
              help="Query rank (default: 2x the model's q_lora_rank; 2048 for V4-Flash).")
@click.option("--dtype", type=click.Choice(["F32", "BF16", "F16"]), default="F32",
              show_default=True, help="Tensor type in the file.")
def make_retriever_cmd(model_path, output, init, seed, heads, rank, dtype):
    """Write a deterministic Memory Indexer checkpoint for a model (the official format).

    Layers: the model's CSA layers at the official l10/l12/l20 proportions (all of them when
    it has three or fewer); the selection geometry (page size, recency tail, KMAX) scaled to
    the model goes into the file's metadata. The weights are untrained: use it to run and test
    the whole path; the official trained file for V4-Flash is flashmemory_ds_v4.safetensors.
    """
    from .memory import make_retriever, save_retriever
    from .weights import load_gguf

    path = model_path or embedded_model_path()
    f = load_gguf(path)
    ret = make_retriever(f.config, f.weights, init=init, seed=seed, heads=heads, rank=rank)
    save_retriever(output, ret, dtype, init=init, seed=str(seed),
                   model=os.path.basename(path))
    r, g = ret.layers[0], ret.geometry
    click.echo(f"wrote {output}: {len(ret.layers)} layers (transformer "
               f"{','.join(str(x.layer) for x in ret.layers)}), {r.heads} heads x "
               f"{f.config.index_dim}, rank {r.rank}, {init} init, {dtype}; pages of "
               f"{g.page_size} chunks, recency tail {g.recency_tail} chunks, KMAX {g.kmax} pages "
               f"({os.path.getsize(output) / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
