"""The KV-swap run configuration: CLI flags and the seed's environment variables, read in one place.

The earlier engine (PocketLLM, see ../shared/reference/pocketllm_kv_swap.md) was configured only
through ``POCKETLLM_GGUF_*`` variables. pocketfm accepts the same names so that its scripts keep
working, with the same fail-fast checks and messages, but nothing is silently ignored: a name it
does not implement, or a value it cannot honour, is a one-line error. A flag given on the command
line wins over the variable; the variable wins over the default.

    variable (POCKETLLM_GGUF_…)          flag                          meaning here
    KV_SWAP                              --kv-swap                     stage chunks from the cold pool
    KV_SWAP_GPU_CHUNKS                   --gpu-chunks K                GPU staging slots (shared by all CSA layers)
    KV_SWAP_PINNED_MIB                   --pinned-mib M                cap on the pinned host pool
    KV_SWAP_SYNC                         --kv-swap-sync                no overlap: each cycle's copies run
                                                                       at its boundary, then a host sync
    KV_SWAP_VALIDATE                     --kv-swap-validate            byte-compare staged slots with the pool
    KV_SWAP_TEST_ALLOW_TOPK_REDUCTION    --kv-swap-test-allow-topk-reduction
    FLASHMEMORY_PLUGIN / _CKPT           --memory-indexer CKPT
    FLASHMEMORY_RUNTIME_SCORING=1        --selection global-topk       (the seed's mode)
    FLASHMEMORY_ENSEMBLE                 --ensemble
    MEM_PROFILE                          (0 to silence)                the gguf_kv_swap / _kv_cache / _mem
                                                                       / _kv_swap_stats lines on stderr
    SPARSE_COMPRESSOR, SPARSE_INDEXER    (always on: part of DeepSeek-V4's attention; 0 is refused)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from ..errors import InputError

PREFIX = "POCKETLLM_GGUF_"
OLD_PREFIX = "DSV4_GGUF_"  # the seed's earlier names; it had no aliases, we say so instead
DEFAULT_PINNED_MIB = 16384  # the seed's default cap
KNOWN = ("KV_SWAP", "KV_SWAP_GPU_CHUNKS", "KV_SWAP_PINNED_MIB", "KV_SWAP_SYNC",
         "KV_SWAP_VALIDATE", "KV_SWAP_TEST_ALLOW_TOPK_REDUCTION", "FLASHMEMORY_PLUGIN",
         "FLASHMEMORY_CKPT", "FLASHMEMORY_METADATA_ONLY", "FLASHMEMORY_LOAD_DEVICE",
         "FLASHMEMORY_MOCK_SCORER_SMOKE", "FLASHMEMORY_RUNTIME_SCORING", "FLASHMEMORY_ENSEMBLE",
         "FLASHMEMORY_SRC_LAYER", "SPARSE_COMPRESSOR", "SPARSE_INDEXER", "MEM_PROFILE")
FLAGS = ("kv_swap", "gpu_chunks", "pinned_mib", "sync", "validate", "allow_topk_reduction",
         "mem_profile")


@dataclass(frozen=True)
class SwapConfig:
    """What the engine is asked to do with the compressed KV of the CSA layers."""

    kv_swap: bool = False
    gpu_chunks: int | None = None  # None: the selection's own need (see ``staging_slots``)
    pinned_mib: int = DEFAULT_PINNED_MIB
    sync: bool = False
    validate: bool = False
    allow_topk_reduction: bool = False
    mem_profile: bool = True


@dataclass(frozen=True)
class MemoryEnv:
    """The FLASHMEMORY_* variables, as the run's Memory-Indexer options (None: not given)."""

    checkpoint: str | None = None
    selection: str | None = None
    ensemble: str | None = None


def _flag01(env, name: str, default: bool) -> bool:
    v = env.get(PREFIX + name)
    if v is None or v == "":
        return default
    if v not in ("0", "1"):
        raise InputError(f"{PREFIX}{name} must be 0 or 1 (got {v!r})")
    return v == "1"


def _int(env, name: str, lo: int, what: str) -> int | None:
    v = env.get(PREFIX + name)
    if v is None or v == "":
        return None
    try:
        n = int(v)
    except ValueError:
        raise InputError(f"{PREFIX}{name} must be an integer {what} (got {v!r})") from None
    if n < lo:
        raise InputError(f"{PREFIX}{name} must be {what} (got {n})")
    return n


def read_env(env=None) -> tuple[dict, MemoryEnv]:
    """The seed's variables present in ``env`` (default os.environ), checked: (swap flag values
    that were set, FLASHMEMORY options). Unknown or unsupported names are errors."""
    env = os.environ if env is None else env
    for key in env:
        if key.startswith(OLD_PREFIX):
            raise InputError(f"{key}: the DSV4_GGUF_* names were renamed to {PREFIX}* (set "
                             f"{PREFIX}{key[len(OLD_PREFIX):]} instead)")
        if key.startswith(PREFIX) and key[len(PREFIX):] not in KNOWN:
            raise InputError(f"{key}: not a variable pocketfm reads (known: "
                             f"{', '.join(PREFIX + k for k in KNOWN)})")
    for name in ("SPARSE_COMPRESSOR", "SPARSE_INDEXER"):
        if not _flag01(env, name, True):
            if _flag01(env, "KV_SWAP", False) and name == "SPARSE_COMPRESSOR":
                raise InputError(f"{PREFIX}KV_SWAP requires {PREFIX}SPARSE_COMPRESSOR=1")
            raise InputError(f"{PREFIX}{name}=0: pocketfm always runs the "
                             f"{'compressors' if 'COMP' in name else 'lightning indexer'} (part "
                             "of DeepSeek-V4's attention); unset it or set 1")
    got = {}
    for name, key in (("KV_SWAP", "kv_swap"), ("KV_SWAP_SYNC", "sync"),
                      ("KV_SWAP_VALIDATE", "validate"),
                      ("KV_SWAP_TEST_ALLOW_TOPK_REDUCTION", "allow_topk_reduction"),
                      ("MEM_PROFILE", "mem_profile")):
        if env.get(PREFIX + name, "") != "":
            got[key] = _flag01(env, name, False)
    chunks = _int(env, "KV_SWAP_GPU_CHUNKS", 0, ">= 0")
    if chunks is not None:
        got["gpu_chunks"] = chunks or None  # the seed: 0 -> the default
    mib = _int(env, "KV_SWAP_PINNED_MIB", 1, "> 0")
    if mib is not None:
        got["pinned_mib"] = mib
    return got, _memory_env(env)


def _memory_env(env) -> MemoryEnv:
    plugin = _flag01(env, "FLASHMEMORY_PLUGIN", False)
    ckpt = env.get(PREFIX + "FLASHMEMORY_CKPT") or None
    if plugin and ckpt is None:
        raise InputError(f"{PREFIX}FLASHMEMORY_PLUGIN requires {PREFIX}FLASHMEMORY_CKPT="
                         "/path/flashmemory_ds_v4.safetensors")
    scoring = _flag01(env, "FLASHMEMORY_RUNTIME_SCORING", False)
    metadata_only = _flag01(env, "FLASHMEMORY_METADATA_ONLY", not scoring)
    load_device = _flag01(env, "FLASHMEMORY_LOAD_DEVICE", scoring)
    if scoring and not load_device:
        raise InputError(f"{PREFIX}FLASHMEMORY_RUNTIME_SCORING requires "
                         f"{PREFIX}FLASHMEMORY_LOAD_DEVICE=1")
    if not metadata_only and not scoring:
        raise InputError("FlashMemory retriever runtime scoring requires "
                         f"{PREFIX}FLASHMEMORY_RUNTIME_SCORING=1; otherwise keep "
                         f"{PREFIX}FLASHMEMORY_METADATA_ONLY=1")
    if _flag01(env, "FLASHMEMORY_MOCK_SCORER_SMOKE", False):
        raise InputError(f"{PREFIX}FLASHMEMORY_MOCK_SCORER_SMOKE=1: not supported (pocketfm "
                         "runs the real scorer: --memory-indexer CKPT)")
    src = env.get(PREFIX + "FLASHMEMORY_SRC_LAYER", "")
    if src not in ("", "-1"):
        raise InputError(f"{PREFIX}FLASHMEMORY_SRC_LAYER={src}: pocketfm scores each retriever "
                         "layer's own indexer keys (the FlashMemory design); unset it or -1")
    ens = env.get(PREFIX + "FLASHMEMORY_ENSEMBLE") or None
    if ens is not None and ens not in ("max", "mean"):
        raise InputError(f"{PREFIX}FLASHMEMORY_ENSEMBLE must be 'max' or 'mean' (got {ens!r})")
    if scoring and ckpt is None:
        raise InputError(f"{PREFIX}FLASHMEMORY_RUNTIME_SCORING requires {PREFIX}FLASHMEMORY_CKPT")
    # plugin without scoring = the seed's metadata check: load and check the checkpoint, score
    # nothing. pocketfm loads a checkpoint only to use it, so that case selects nothing.
    return MemoryEnv(checkpoint=ckpt if scoring else None,
                     selection="global-topk" if scoring else None, ensemble=ens)


def swap_config(flags: dict, env=None) -> tuple[SwapConfig, MemoryEnv]:
    """The run's swap configuration: ``flags`` (name -> value, None = not given on the command
    line) over the environment over the defaults."""
    got, mem = read_env(env)
    for k, v in flags.items():
        if k not in FLAGS:
            raise ValueError(f"swap_config: unknown flag {k}")
        if v is not None and v is not False:
            got[k] = v
    cfg = SwapConfig(**got)
    if cfg.gpu_chunks is not None and cfg.gpu_chunks < 1:
        raise InputError(f"--gpu-chunks {cfg.gpu_chunks}: expected >= 1")
    if cfg.pinned_mib < 1:
        raise InputError(f"--pinned-mib {cfg.pinned_mib}: must be > 0")
    if not cfg.kv_swap:
        for name, default in (("gpu_chunks", None), ("validate", False), ("sync", False),
                              ("allow_topk_reduction", False)):
            if getattr(cfg, name) != default and flags.get(name) not in (None, False):
                raise InputError(f"--{name.replace('_', '-')}: only meaningful with --kv-swap")
    return cfg, mem


# ---- the plan of one run: slots, guards, auto-disable ---------------------------------------------
@dataclass(frozen=True)
class SwapPlanConfig:
    """The decisions for one run: ``enabled`` and, when not, ``reason`` (logged)."""

    enabled: bool
    gpu_chunks: int
    index_topk: int
    region: int  # decode-region chunks reserved per window
    reason: str = ""
    cap_mib: int = DEFAULT_PINNED_MIB
    validate: bool = False
    sync: bool = False
    key_layers: tuple[int, ...] = ()  # CSA layers whose indexer keys are swapped too
    lag: int = 0  # decode steps between a boundary and its set taking effect (overlap window)


OVERLAP_LAG = 2  # default commit lag with KV swap (not --kv-swap-sync): the steps whose decode
# hides a cycle's scoring read-back, selection, stores and swap-ins (flashmemory.md §6: "with
# asynchronous recall a set can become effective a few steps later still")


def overlap_lag(interval: int) -> int:
    """The default commit lag of an overlapped swap: OVERLAP_LAG, less than the interval."""
    return min(OVERLAP_LAG, interval - 1)


def commit_lag(sel, cfg: SwapConfig) -> int:
    """The run's commit lag: ``--commit-lag`` when given; else, with an overlapped KV swap,
    OVERLAP_LAG (less than the interval); else 0 (the set takes effect at the next step)."""
    if sel.commit_lag is not None:
        return sel.commit_lag
    if cfg.kv_swap and not cfg.sync:
        return overlap_lag(sel.interval)
    return 0


def decode_region(interval: int, lag: int = 0) -> int:
    """Chunks formed between a boundary and the end of the window its set serves: the
    ``lag`` steps before the set takes effect and the ``interval`` steps it is in force (4
    tokens each), plus one for a window that starts mid-chunk."""
    return math.ceil((interval + lag) / 4) + 1


def default_slots(need: int, region: int, overlap: bool) -> int:
    """Staging slots for a set of up to ``need`` chunks and a decode region: with overlap,
    room for the set of the running window beside the next one's, so that every miss can be
    copied while the window still runs (kvswap/table.py, ``miss_late``)."""
    return (2 * need if overlap else need) + region


def max_set_chunks(memory, capacity: int) -> int | None:
    """The most chunks a cycle of ``memory`` (a MemoryIndexer) can make resident, or None when
    its selection is unbounded (every chunk may stay)."""
    sel = memory.sel
    n = max(1, capacity // 4)
    if sel.mode == "recency":
        return min(n, memory.tail)
    if sel.mode == "random":
        return min(n, memory.tail + max(1, int(sel.random_ratio * n)))
    if sel.mode == "lookahead":
        ctx_pages = -(-n // memory.page)
        kmax = (math.ceil(sel.kmax_ratio * ctx_pages) if sel.kmax_ratio > 0
                else memory.kmax_default)
        if kmax > 0:
            return min(n, kmax * memory.page)
        if sel.topk > 0:
            return min(n, sel.topk + memory.tail + sel.sink)
    return None


def plan_swap(cfg: SwapConfig, model_cfg, capacity: int, memory) -> SwapPlanConfig:
    """Check the request against the model and the selection (the seed's guards) and size the
    staging. Raises InputError with the seed's messages where they apply."""
    k = model_cfg.index_topk
    n_chunks = max(1, capacity // 4)
    if not cfg.kv_swap:
        return SwapPlanConfig(False, 0, k, 0, "not_requested", cfg.pinned_mib)
    if k <= 0:
        raise InputError(f"{PREFIX}KV_SWAP requires a non-zero index_topk")
    if memory is None:
        raise InputError("--kv-swap needs a Memory Indexer selection (--memory-indexer CKPT, or "
                         "--selection recency|random): it decides which chunks are staged")
    mode = memory.sel.mode
    if mode in ("full", "global-topk"):
        raise InputError(f"--kv-swap with --selection {mode}: not supported — "
                         + ("every chunk stays resident, nothing to swap" if mode == "full" else
                            "it reselects every step inside the CUDA graph, the swap stages "
                            "once per cycle") + "; use lookahead, recency or random")
    lag = commit_lag(memory.sel, cfg)
    region = decode_region(memory.sel.interval, lag)
    need = max_set_chunks(memory, capacity)
    if need is None:
        raise InputError("--kv-swap: the lookahead selection is unbounded (--kmax 0 without "
                         "--keep-topk); give --kmax pages so the staging has a size")
    want = need + region
    slots = (cfg.gpu_chunks if cfg.gpu_chunks is not None
             else max(default_slots(need, region, not cfg.sync), k))
    if slots < k:
        if not cfg.allow_topk_reduction:
            raise InputError(f"{PREFIX}KV_SWAP_GPU_CHUNKS must be >= index_topk to avoid "
                             f"reducing retrieval coverage (--gpu-chunks {slots} < index_topk "
                             f"{k}); set {PREFIX}KV_SWAP_TEST_ALLOW_TOPK_REDUCTION=1 "
                             "(--kv-swap-test-allow-topk-reduction) only for small-context tests")
        k = slots  # the seed's override: the native top-k shrinks to what the slots hold
    if slots < want and slots < n_chunks:
        raise InputError(f"--gpu-chunks {slots}: the {mode} set holds up to {need} chunks plus "
                         f"a decode region of {region} (--interval {memory.sel.interval}); "
                         f"need >= {want}")
    # the retriever's target layers keep all their indexer keys on the GPU (its scorer reads
    # every chunk's key each cycle); every other CSA layer's keys are swapped with its entries
    csa = [i for i in range(model_cfg.n_layers) if model_cfg.is_csa(i)]
    keys = tuple(i for i in csa if i not in getattr(memory, "targets", {}))
    extra = dict(cap_mib=cfg.pinned_mib, validate=cfg.validate, sync=cfg.sync, key_layers=keys,
                 lag=lag)
    if n_chunks <= slots:  # everything fits on the GPU: swapping would only add copies
        extra["lag"] = memory.sel.commit_lag or 0  # nothing to overlap
        return SwapPlanConfig(False, slots, k, region,
                              "no_layer_with_compressed_cap_gt_gpu_chunks", **extra)
    return SwapPlanConfig(True, slots, k, region, **extra)


def with_topk(model_cfg, plan: SwapPlanConfig):
    """The model config the run uses: index_topk lowered by the test override, else as is."""
    if plan.index_topk != model_cfg.index_topk:
        return replace(model_cfg, index_topk=plan.index_topk)
    return model_cfg


def swap_line(cfg: SwapConfig, plan: SwapPlanConfig, pinned_mib: float) -> str:
    """The seed's ``gguf_kv_swap=`` line."""
    head = f"gguf_kv_swap={int(plan.enabled)}"
    if not plan.enabled and plan.reason and plan.reason != "not_requested":
        head += f" reason={plan.reason}"
    return (f"{head} requested={int(cfg.kv_swap)} gpu_chunks={plan.gpu_chunks} "
            f"pinned_mib={pinned_mib:.1f} cap_mib={cfg.pinned_mib} sync={int(cfg.sync)} "
            f"validate={int(cfg.validate)} test_allow_topk_reduction="
            f"{int(cfg.allow_topk_reduction)} commit_lag={plan.lag}")
