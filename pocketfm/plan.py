"""``pocketfm plan``: the GPU and pinned host memory a CUDA run takes, before running it.

Every number comes from the code that allocates, not from a formula kept beside it:

- KV caches, the decode step's and the chunked prefill's buffers: engine/layout.py's specs, the
  lists LayerCache, DecodeEngine and ChunkPrefill allocate from;
- weights: DeviceWeights' own upload walk over a ``SizeSource`` (engine/device_weights.py): the
  tensors it uploads, in their packed device layout, with nothing read, drawn or uploaded;
- the Memory Indexer: what DeviceRetrieverLayer.from_host uploads per layer, from the
  checkpoint's tensor shapes (memory-mapped).

Not counted: the CUDA context, the kernel launchers' own scratch allocated on first use (attention
split partials, GEMM split-K partials, top-k / argmax / sampling workspaces: MiBs), the Memory
Indexer's context-sized workspace (resident mask, logits: ~13 B per chunk) and the KV swap table
(4 B per chunk).
"""
from __future__ import annotations

import json

import click

from .config import ModelConfig
from .engine.layout import COMPONENTS, cache_layout, prefill_buffer_bytes, step_buffer_bytes
from .errors import InputError

# prompt tokens per prefill chunk (engine/prefill.py's default too). H200, V4-Flash: 2,048
# ran 7% faster than 1,024 at 256K and 9% at 64K, in 1.65 GB of buffers at 256K (0.96 GB at
# 1,024); 4,096 would take 3.0 GB, over the 2 GB workspace budget (BENCHMARKS.md,
# 2026-12-04 (a))
DEFAULT_PREFILL_CHUNK = 2048
KV_COMPONENTS = ("window", "c4_kv_resident", "c4_kv_staged", "c128_kv", "indexer_keys",
                 "indexer_keys_staged", "compressor_state", "swap_table")
PAPER_COMPONENTS = ("c4_kv_resident", "c4_kv_staged", "indexer_keys",  # FlashMemory's metric
                    "indexer_keys_staged")
ROWS = ("weights", *COMPONENTS, "step_workspace", "prefill_workspace", "retriever")
MIB = 1 << 20


def weight_bytes(cfg: ModelConfig, weights=None, quant: str = "ds4-q2") -> int:
    """GPU bytes of the model weights: DeviceWeights walked over a SizeSource, i.e. the tensors
    the upload makes, in their packed device layout (not the GGUF bytes). ``weights``: a loaded
    GGUF's ``Weights`` (its tensor table); None: the tensor table make-model gives ``cfg`` in
    the mix ``quant`` (``--preset``; what ``pocketfm bench`` builds), no data generated."""
    from .engine.device_weights import DeviceWeights, SizeSource

    src = SizeSource.of_weights(weights) if weights is not None else SizeSource.of_specs(cfg,
                                                                                         quant)
    return DeviceWeights(cfg, src).nbytes


def retriever_bytes(path: str, cfg: ModelConfig) -> int:
    """GPU bytes of a Memory Indexer checkpoint's layers as the engine uploads them (float32
    weights plus two scratch rows per layer); the file is checked against the model."""
    from .kernels.retriever import DeviceRetrieverLayer
    from .memory.checkpoint import load_retriever

    return sum(DeviceRetrieverLayer.planned_bytes(r) for r in load_retriever(path, cfg).layers)


def default_swap(cfg: ModelConfig, retriever_path: str | None = None, interval: int = 64,
                 lag: int | None = None) -> tuple[int, tuple[int, ...]]:
    """(staging slots, swapped-key layers) of a default lookahead run with KV swap: room for
    two sets of KMAX pages x page chunks (the running window's and the next, so that swap-ins
    overlap the decode; one with ``lag`` 0) plus a decode region, at least index_topk (the
    seed's guard); and every CSA layer's keys but the retriever targets' (the checkpoint's
    layers, or the default l10/l12/l20 placement) — what ``run --kv-swap`` does
    (kvswap/config.py). ``lag`` None: the overlapped default."""
    from .kvswap.config import decode_region, default_slots, overlap_lag
    from .memory.checkpoint import RetrieverGeometry, csa_layers, default_clids

    g = RetrieverGeometry.for_model(cfg)
    csa = csa_layers(cfg)
    if retriever_path is not None:
        from .memory.checkpoint import load_retriever

        targets = {r.layer for r in load_retriever(retriever_path, cfg).layers}
    else:
        targets = {csa[c] for c in default_clids(cfg)}
    lag = overlap_lag(interval) if lag is None else lag
    slots = max(default_slots(g.kmax * g.page_size, decode_region(interval, lag), lag > 0),
                cfg.index_topk)
    return slots, tuple(i for i in csa if i not in targets)


def plan_memory(cfg: ModelConfig, ctx: int, gpu_chunks: int | None = None,
                prefill_chunk: int = DEFAULT_PREFILL_CHUNK, weights=None, quant: str = "ds4-q2",
                retriever_path: str | None = None, key_layers=()) -> dict:
    """The memory of a CUDA run at context ``ctx`` (the engine's capacity), by component; KV
    swap when ``gpu_chunks`` is given (``key_layers``: the CSA layers whose indexer keys are
    swapped too). Bytes, exact; the keys of ``pocketfm plan --json``."""
    comps = {name: {"gpu_bytes": 0, "pinned_bytes": 0} for name in ROWS}

    def add(name, where, nbytes):
        comps[name]["gpu_bytes" if where == "gpu" else "pinned_bytes"] += int(nbytes)
    add("weights", "gpu", weight_bytes(cfg, weights, quant))
    for spec in cache_layout(cfg, ctx, gpu_chunks, key_layers):
        add(spec.component, spec.where, spec.nbytes)
    add("step_workspace", "gpu", step_buffer_bytes(cfg, ctx))
    add("prefill_workspace", "gpu", prefill_buffer_bytes(cfg, ctx, prefill_chunk))
    if retriever_path is not None:
        add("retriever", "gpu", retriever_bytes(retriever_path, cfg))
    gpu = {name: c["gpu_bytes"] for name, c in comps.items()}
    return dict(
        ctx=ctx, kv_swap=gpu_chunks is not None, gpu_chunks=gpu_chunks,
        prefill_chunk=prefill_chunk,
        gpu_kv_bytes=sum(gpu[n] for n in KV_COMPONENTS),
        paper_metric_bytes=sum(gpu[n] for n in PAPER_COMPONENTS),
        pinned_bytes=sum(c["pinned_bytes"] for c in comps.values()),
        gpu_total_bytes=sum(gpu.values()),
        components=comps)


def format_plan(plan: dict, model: str) -> str:
    """The table ``pocketfm plan`` prints (MiB, one decimal)."""
    swap = f"KV swap, {plan['gpu_chunks']:,} staging slots" if plan["kv_swap"] else "no KV swap"
    lines = [f"{model} at ctx {plan['ctx']:,} ({swap}, prefill chunk {plan['prefill_chunk']}):",
             f"  {'component':<22}{'GPU MiB':>12}{'pinned MiB':>12}"]

    def row(name, gpu, pinned):
        lines.append(f"  {name:<22}{gpu / MIB:>12.1f}{pinned / MIB:>12.1f}")
    for name, c in plan["components"].items():
        if c["gpu_bytes"] or c["pinned_bytes"]:
            row(name, c["gpu_bytes"], c["pinned_bytes"])
    row("KV caches (GPU)", plan["gpu_kv_bytes"], 0)
    row("total", plan["gpu_total_bytes"], plan["pinned_bytes"])
    lines.append(f"  paper metric (C4 KV + C4 indexer keys on the GPU): "
                 f"{plan['paper_metric_bytes'] / MIB:.1f} MiB")
    return "\n".join(lines)


@click.command("plan")
@click.option("--model", "model_path", type=str, default=None, help="deepseek4 GGUF file.")
@click.option("--preset", "preset_name", type=click.Choice(["tiny", "small", "flash"]),
              default=None, help="Model geometry instead of a file (weights: the ds4-q2 mix).")
@click.option("--ctx", type=click.IntRange(min=1), required=True,
              help="Context capacity in tokens (as run --ctx).")
@click.option("--kv-swap", is_flag=True,
              help="The CSA layers' compressed KV in pinned host memory, the selected chunks "
                   "in GPU staging slots.")
@click.option("--gpu-chunks", type=click.IntRange(min=1), default=None,
              help="Staging slots with --kv-swap [default: as run --kv-swap with lookahead: "
                   "2 x KMAX pages x page chunks + a decode region].")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=DEFAULT_PREFILL_CHUNK,
              show_default=True, help="Prompt tokens per prefill chunk (as run).")
@click.option("--memory-indexer", "retriever_path", type=str, default=None,
              help="FlashMemory retriever checkpoint: add its GPU weights.")
@click.option("--layers", type=int, default=None,
              help="With --preset: only its first N layers (as bench --layers; what fits a "
                   "smaller card).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (exact bytes).")
def plan_command(model_path, preset_name, ctx, kv_swap, gpu_chunks, prefill_chunk,
                 retriever_path, layers, as_json):
    """GPU and pinned host memory of a CUDA run, by component, without a GPU or loading data.

    The numbers come from the lists the engine allocates from (KV caches, step and prefill
    buffers) and from the weight upload walked without data: plan == allocation.
    """
    if (model_path is None) == (preset_name is None):
        raise InputError("plan: give --model FILE or --preset NAME (one of them)")
    if layers is not None and preset_name is None:
        raise InputError(f"--layers {layers}: only with --preset (a file's layers are its own)")
    if gpu_chunks is not None and not kv_swap:
        raise InputError(f"--gpu-chunks {gpu_chunks}: staging slots need --kv-swap")
    weights = None
    if model_path is not None:
        from .weights import load_gguf

        f = load_gguf(model_path)  # the tensor table only: data stays memory-mapped
        cfg, weights, name = f.config, f.weights, model_path
    else:
        from .presets import first_layers, preset

        cfg, name = preset(preset_name), preset_name
        if layers is not None:
            cfg = first_layers(cfg, layers)
            name = f"{preset_name} (first {layers} layers)"
    if ctx > cfg.ctx_train:
        raise InputError(f"--ctx {ctx}: exceeds the model's context_length {cfg.ctx_train}")
    key_layers = ()
    if kv_swap:
        slots, key_layers = default_swap(cfg, retriever_path)
        gpu_chunks = gpu_chunks or slots
    plan = plan_memory(cfg, ctx, gpu_chunks, prefill_chunk, weights,
                       retriever_path=retriever_path, key_layers=key_layers)
    if as_json:
        click.echo(json.dumps(dict(model=name, **plan)))
    else:
        click.echo(format_plan(plan, name))

