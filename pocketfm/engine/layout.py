"""Every array the GPU engine allocates for its state, as data: the planner's numbers are the
allocator's.

``LayerCache`` (decode.py) allocates each layer's cache from ``layer_specs``,
``DecodeEngine._alloc_step_buffers`` its step buffers from ``step_buffer_specs`` and
``ChunkPrefill`` its chunk buffers from ``prefill_buffer_specs``; ``pocketfm plan`` (plan.py)
adds the same specs up without allocating anything. Pure NumPy (no numba), so planning is cheap.

Cache of layer i, N = max(1, capacity // r) entries (spec §6.1; packed formats §6.3)::

    window       uint8 [W, 584]        every layer: the raw kv ring
    comp         uint8 [N, 584]        compressed entries: "c4" on CSA layers (r = 4), "c128" on
                                       HCA layers (V4: r = 128; tiny: 8)
    state_kv     f32   [rows, coff·K]  compressor state, rows = 2r (CSA: overlapping) or r
    state_score  f32   [rows, coff·K]
    index_keys   uint8 [N, 68]         CSA: the indexer's FP4 keys
    index_kv     f32   [2r, 2·DI]      CSA: the indexer compressor's state
    index_score  f32   [2r, 2·DI]

With KV swap (``gpu_chunks`` = S staging slots) the CSA layers' ``comp`` is not a per-layer array:
the full history goes to a pinned host pool and the selected chunks to GPU staging, one slot
mapping for all CSA layers (engine/kvswap.py)::

    staging      uint8 [n_csa, S, 584]   GPU
    pool         uint8 [n_csa, N4, 584]  pinned host, N4 = max(1, capacity // 4)

(The CSA indexer keys stay whole on the GPU: the native indexer scores every key each step.)
Letters: W window, K head dim, R rope dims, DI index dim, HI index heads, r ratio, T chunk
tokens, S staging slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig

COMPONENTS = ("window", "c4_kv_resident", "c4_kv_staged", "c4_kv_pool", "c128_kv",
              "compressor_state", "indexer_keys", "indexer_keys_staged", "indexer_keys_pool",
              "swap_table")
# the decode step's meta array: pos, n_prompt, n_window, then one count per ratio
# (step_kernels.META_RATIOS; tests/test_plan.py checks they agree)
META_RATIOS = 3
SCORES_FLOATS = 64 << 20  # prefill's indexer scores workspace: 256 MiB (see ChunkPrefill)


@dataclass(frozen=True)
class ArraySpec:
    """One allocation: what it is for, where it lives, and its shape."""

    component: str  # COMPONENTS, or "step_workspace" / "prefill_workspace"
    layer: int  # model layer, or -1 for engine-wide arrays
    name: str  # the attribute the allocating code stores it as
    shape: tuple[int, ...]
    dtype: np.dtype
    where: str  # "gpu" or "pinned" (host memory the GPU reads)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


# ---- packed entry sizes (spec §6.3; the byte layouts are in kernels/kvpack.py) ----------------
def kv_entry_bytes(head_dim: int, rope_dim: int) -> int:
    """A window / compressed kv entry: FP8 nope dims, bf16 rope dims, a scale byte per 64 dims,
    padded to 8 bytes (V4: 512, 64 -> 584)."""
    nope = head_dim - rope_dim
    return -(-(nope + 2 * rope_dim + nope // 64) // 8) * 8


def index_key_bytes(index_dim: int) -> int:
    """An FP4 indexer key: nibbles plus a scale byte per 32 dims, padded to 4 (V4: 128 -> 68)."""
    return -(-(index_dim // 2 + index_dim // 32) // 4) * 4


# ---- the prefill MoE's expert tiles (kernels/mma.py: expert_order, gemm_mma) --------------------
EXPERT_TILE = 32  # rows of one expert per tile (mma's narrow codes kernel: 32 tokens)


def expert_tiles_capacity(rows: int, n_experts: int, tile: int = EXPERT_TILE) -> int:
    """Columns expert_order's tiles of ``tile`` rows need for ``rows`` rows: sum over experts
    of ceil(count / tile) <= rows / tile + (experts with rows)."""
    return -(-rows // tile) + min(n_experts, rows)


# ---- the KV caches ------------------------------------------------------------------------------
def f16_x_rows(rows: int) -> int:
    """Rows hmma.py allocates its x for: a power of two, at least 64, so that a prompt's chunks
    (the last one shorter) share one allocation."""
    return 1 << max(6, (rows - 1).bit_length())


def f16_x_floats(rows: int, K: int) -> int:
    """float32 words of hmma.py's x for ``rows`` rows of K columns: two float16 limbs, a sum per
    16 columns and a scale per row, for f16_x_rows(rows) rows."""
    cap = f16_x_rows(rows)
    return cap * (K + K // 16 + 1)


def prefill_f16_x_floats(cfg: ModelConfig, chunk: int) -> int:
    """The largest hmma.py x of a chunk's GEMMs (float32 words): the grouped output projection's
    G·T rows, the routed experts' T·k rows of the down, or T rows of the widest input."""
    T, G = int(chunk), cfg.o_groups
    dense_k = max(cfg.dim, cfg.q_rank, G * cfg.o_rank, cfg.moe_dim)
    return max(f16_x_floats(G * T, cfg.n_heads // G * cfg.head_dim),
               f16_x_floats(T * cfg.n_experts_used, cfg.moe_dim), f16_x_floats(T, dense_k))


def layer_specs(cfg: ModelConfig, i: int, capacity: int, swap: bool = False,
                swap_keys: bool = False) -> list[ArraySpec]:
    """The GPU arrays of layer i's LayerCache (``swap``: without the CSA layers' ``comp``;
    ``swap_keys``: without its indexer keys either — they live in the swap's key pool)."""
    K, r, csa = cfg.head_dim, cfg.ratio(i), cfg.is_csa(i)
    kvb = kv_entry_bytes(K, cfg.rope_dim)
    u8, f32 = np.dtype(np.uint8), np.dtype(np.float32)

    def a(component, name, shape, dtype):
        return ArraySpec(component, i, name, tuple(shape), dtype, "gpu")
    specs = [a("window", "window", (cfg.window, kvb), u8)]
    if r:
        n = max(1, capacity // r)
        if not (csa and swap):
            specs.append(a("c4_kv_resident" if csa else "c128_kv", "comp", (n, kvb), u8))
        rows, width = (2 * r if csa else r), cfg.coff(i) * K
        specs += [a("compressor_state", "state_kv", (rows, width), f32),
                  a("compressor_state", "state_score", (rows, width), f32)]
    if csa:
        DI = cfg.index_dim
        if not (swap and swap_keys):
            specs.append(a("indexer_keys", "index_keys",
                           (max(1, capacity // r), index_key_bytes(DI)), u8))
        specs += [a("compressor_state", "index_kv", (2 * r, 2 * DI), f32),
                  a("compressor_state", "index_score", (2 * r, 2 * DI), f32)]
    return specs


def cache_layout(cfg: ModelConfig, capacity: int, gpu_chunks: int | None = None,
                 key_layers=()) -> list[ArraySpec]:
    """Every KV-cache array of an engine for ``capacity`` tokens: each layer's LayerCache, and
    with KV swap (``gpu_chunks`` staging slots; ``key_layers`` the CSA layers whose indexer
    keys are swapped too) the engine-wide arrays of ``swap_specs``."""
    swap = gpu_chunks is not None
    keys = set(key_layers) if swap else set()
    specs = [s for i in range(cfg.n_layers)
             for s in layer_specs(cfg, i, capacity, swap, i in keys)]
    if swap:
        specs += swap_specs(cfg, capacity, gpu_chunks, key_layers)
    return specs


COPY_KINDS = ("store", "early", "late", "lag")  # a swap cycle's copy lists (engine/kvswap.py)


def swap_specs(cfg: ModelConfig, capacity: int, gpu_chunks: int, key_layers=()
               ) -> list[ArraySpec]:
    """The KV swap's own arrays (engine/kvswap.py allocates exactly these, by name): the pinned
    pools of every CSA layer's entries and of ``key_layers``' indexer keys, their GPU staging
    (``gpu_chunks`` slots), the slot LUT, the next cycle's LUT and its pinned source, the
    pinned and device (chunk, slot) lists of a cycle's copies (a row per COPY_KINDS) and the
    step's slot-indexed scratch."""
    n_csa = sum(cfg.is_csa(i) for i in range(cfg.n_layers))
    N, S, L = max(1, capacity // 4), gpu_chunks, n_csa
    kvb = kv_entry_bytes(cfg.head_dim, cfg.rope_dim)
    u8, i32, f32 = np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.float32)

    def a(component, name, shape, dtype, where="gpu"):
        return ArraySpec(component, -1, name, tuple(shape), dtype, where)
    specs = [a("c4_kv_staged", "staging", (L, S, kvb), u8),
             a("c4_kv_pool", "pool", (L, N, kvb), u8, "pinned"),
             a("swap_table", "lut", (N,), i32), a("swap_table", "sel_slots", (cfg.index_topk,), i32),
             a("swap_table", "lut_next", (N,), i32), a("swap_table", "lut_host", (N,), i32, "pinned"),
             a("swap_table", "idx_dev", (len(COPY_KINDS), 2 * S), i32),
             a("swap_table", "idx_host", (len(COPY_KINDS), 2 * S), i32, "pinned")]
    if key_layers:
        kb = index_key_bytes(cfg.index_dim)
        specs += [a("indexer_keys_staged", "key_staging", (len(key_layers), S, kb), u8),
                  a("indexer_keys_pool", "key_pool", (len(key_layers), N, kb), u8, "pinned"),
                  a("swap_table", "slot_scores", (S,), f32), a("swap_table", "n_slots", (1,), i32)]
    return specs


# ---- workspaces ---------------------------------------------------------------------------------
def compressed_ratios(cfg: ModelConfig) -> list[int]:
    """The distinct compression ratios, ascending (one meta count each)."""
    return sorted({cfg.ratio(i) for i in range(cfg.n_layers)} - {0})


def compressor_widths(cfg: ModelConfig) -> list[int]:
    """The distinct compressor input widths coff·K (one pair of input buffers each)."""
    return sorted({cfg.coff(i) * cfg.head_dim for i in range(cfg.n_layers) if cfg.ratio(i)})


class _Specs(list):
    """Engine-wide GPU arrays of one component, appended as ``add(name, *shape, dtype=f32)``."""

    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def add(self, name: str, *shape: int, dtype=np.float32) -> None:
        self.append(ArraySpec(self.component, -1, name, tuple(int(x) for x in shape),
                              np.dtype(dtype), "gpu"))


def moe_scratch_specs(cfg: ModelConfig) -> list[ArraySpec]:
    """kernels/moe.py MoEScratch's arrays (it allocates them itself; DecodeEngine checks that
    their bytes equal these): k routed rows, then row k for the shared expert."""
    D, F, E, k = cfg.dim, cfg.moe_dim, cfg.n_experts, cfg.n_experts_used
    s = _Specs("step_workspace")
    s.add("moe.logits", 1, E)
    s.add("moe.ids", 1, k, dtype=np.int32)
    s.add("moe.w_ext", k + 1)
    s.add("moe.x_rep", k, D)
    for n in ("gate", "up"):
        s.add(f"moe.{n}", k + 1, F)
    s.add("moe.gate_up", k + 1, 2 * F)
    s.add("moe.h", k + 1, F)
    s.add("moe.down", k + 1, D)
    s.add("moe.zero", 1, D)
    return list(s)


def step_buffer_specs(cfg: ModelConfig, capacity: int) -> list[ArraySpec]:
    """The decode step's buffers (DecodeEngine._alloc_step_buffers allocates the non-``moe.``
    ones from this list, by name), then MoEScratch's. A pair is ``name.0`` / ``name.1``."""
    D, HC, H, K = cfg.dim, cfg.hc_mult, cfg.n_heads, cfg.head_dim
    HI, DI = cfg.index_heads, cfg.index_dim
    s = _Specs("step_workspace")
    i32, u8 = np.int32, np.uint8
    ratios = compressed_ratios(cfg)
    s.add("meta", META_RATIOS + max(1, len(ratios)), dtype=i32)
    s.add("ids", capacity + 1, dtype=i32)
    s.add("ratio_arr", max(1, len(ratios)), dtype=i32)
    s.add("uniforms", max(1, capacity))
    s.add("token", 1, dtype=i32)
    s.add("next_token", 1, dtype=i32)
    s.add("u", 1)
    s.add("e", 1, D)
    for j in (0, 1):  # HC streams, ping-pong between sublayers
        s.add(f"X.{j}", 1, HC, D)
    s.add("u_in", 1, D)
    s.add("u_norm", 1, D)
    s.add("post", 1, HC)
    s.add("comb", 1, HC, HC)
    s.add("cq", 1, cfg.q_rank)
    s.add("cq_norm", 1, cfg.q_rank)
    s.add("q", 1, H, K)
    s.add("kv", 1, K)
    s.add("kv_row", 1, kv_entry_bytes(K, cfg.rope_dim), dtype=u8)
    for w in compressor_widths(cfg):
        for j in (0, 1):
            s.add(f"comp_in.{w}.{j}", 1, w)
    for j in (0, 1):
        s.add(f"idx_in.{j}", 1, 2 * DI)
    s.add("qi", 1, HI, DI)
    s.add("qi_rot", 1, HI, DI)
    s.add("idx_w", 1, HI)
    s.add("scores", max(1, capacity // 4))
    s.add("sel", cfg.index_topk, dtype=i32)
    s.add("no_sel", 1, dtype=i32)
    s.add("no_comp", 1, kv_entry_bytes(K, cfg.rope_dim), dtype=u8)
    s.add("zero_count", 1, dtype=i32)
    s.add("ones", max(K, D))  # the weightless norm's weight
    s.add("o", 1, H, K)
    s.add("y", cfg.o_groups, cfg.o_rank)
    s.add("f", 1, D)
    s.add("head_u", 1, D)
    s.add("head_norm", 1, D)
    s.add("logits", 1, cfg.vocab)
    return list(s) + moe_scratch_specs(cfg)


# kernels/hc.py's chunk mix: HC_MIX_TOKENS tokens a block, and blocks enough to fill the H200
# once (132 SMs x 3 blocks at its 168 registers) by slicing the columns
HC_MIX_TOKENS, HC_MIX_BLOCKS = 16, 384


def hc_mix_shape(T: int, hc: int) -> tuple[int, int, int]:
    """hc_pre's ``mix`` workspace for a chunk of T tokens (kernels/hc.py's _hc_mix_chunk):
    [column slices, T, (2 + hc)·hc mix rows + the sum of squares] of partial sums."""
    groups = -(-T // HC_MIX_TOKENS)
    return max(1, min(16, HC_MIX_BLOCKS // groups)), T, (2 + hc) * hc + 1


def prefill_buffer_specs(cfg: ModelConfig, capacity: int, chunk: int) -> list[ArraySpec]:
    """ChunkPrefill's buffers for chunks of up to ``chunk`` tokens (allocated from this list by
    name, on the first prefill; a shorter chunk takes views [:T])."""
    T = int(chunk)
    D, HC, K = cfg.dim, cfg.hc_mult, cfg.head_dim
    HI, DI, k = cfg.index_heads, cfg.index_dim, cfg.n_experts_used
    s = _Specs("prefill_workspace")
    i32 = np.int32
    ratios = compressed_ratios(cfg)
    s.add("table", 1 + (1 + len(ratios)) * T, dtype=i32)  # p0, pos[T], visible counts per ratio
    s.add("e", T, D)
    for j in (0, 1):
        s.add(f"X.{j}", T, HC, D)
    s.add("u_in", T, D)
    s.add("u", T, D)
    s.add("post", T, HC)
    s.add("comb", T, HC, HC)
    # HC pre's mix, one GEMM per chunk (for every chunk up to T: more slices when shorter)
    s.add("hc_mix", max(math.prod(hc_mix_shape(t, HC)) for t in range(1, T + 1)))
    s.add("cq", T, cfg.q_rank)
    shared = prefill_shared_buffers(cfg, capacity, T)
    for name, views in shared.items():  # arrays whose lifetimes in a layer do not overlap
        s.add(name, max(int(np.prod(shape)) for shape in views.values()))
    s.add("kv", T, K)
    s.add("kv_rows", T, kv_entry_bytes(K, cfg.rope_dim), dtype=np.uint8)
    for w in compressor_widths(cfg):
        for j in (0, 1):
            s.add(f"comp_in.{w}.{j}", T, w)
    for r in ratios:
        s.add(f"comp_scratch.{r}", T // r + 1, K)  # entries a chunk can complete
    for j in (0, 1):
        s.add(f"idx_in.{j}", T, 2 * DI)
    s.add("idx_scratch", T // 4 + 1, DI)
    s.add("idx_w", T, HI)
    s.add("sel", T, cfg.index_topk, dtype=i32)
    s.add("no_sel", T, 1, dtype=i32)
    s.add("zeros_T", T, dtype=i32)
    s.add("ones_T", T)
    s.add("f", T, D)
    s.add("router", T, cfg.n_experts)
    s.add("route_w", T, k)
    s.add("route_ids", T, k, dtype=i32)
    s.add("route_order", T * k, dtype=i32)  # the (token, expert) rows grouped by expert
    # ... and cut into tiles of one expert each (mma.expert_order's tiles, always whole: a
    # shorter chunk needs fewer, and the spare ones are empty)
    s.add("route_tiles", 2, expert_tiles_capacity(T * k, cfg.n_experts), dtype=i32)
    # ... and into tiles of 64 rows, for hmma.py's 64-token build of the routed GEMMs (an A/B)
    s.add("route_tiles64", 2, expert_tiles_capacity(T * k, cfg.n_experts, 64), dtype=i32)
    # hmma.py's x (float16 limbs) for every GEMM of the chunk, carved per launch (the launches
    # run in order on the prefill's stream, so one workspace serves them all)
    s.add("f16_x", prefill_f16_x_floats(cfg, T))
    s.add("sh_down", T, D)  # (zero-filled once: the sum's shared part without a shared expert)
    return list(s)


def prefill_scores_floats(capacity: int, chunk: int) -> int:
    """Floats of the prefill's indexer scores, [rows, visible keys] per scoring pass; bounded,
    so a long context scores a chunk's tokens in several passes rather than hold T x ctx/4."""
    return min(int(chunk) * max(1, capacity // 4), SCORES_FLOATS)


def prefill_shared_buffers(cfg: ModelConfig, capacity: int, chunk: int) -> dict:
    """{buffer: {array: shape}}: chunk arrays that take turns in one float32 buffer (each a
    view of its first elements), since in a layer each is dead before the next is written
    (the prefill's launches run in order on one stream). In a layer's order:

    - q until the attention reads it; o_groups (o regrouped for the output projection) until
      that GEMM; y (its output, token-major) until out_b; then in the MoE gate_up until the
      SwiGLU (or hmma's preparation of the down's x) has read it; then down.
    - idx_keys (the indexer's keys decoded for the chunk tiles kernel, uint32 bf16 pairs)
      until the last scoring pass; o until it is regrouped; x_rep (the MoE's input per
      routed row) until the gate|up GEMM; then h (the SwiGLU's output, read by the down
      GEMM); then the shared expert's gate_up (on hmma.py's path, which writes no x_rep or
      h, before the routed GEMMs: it reads the same prepared x).
    - the indexer's qi until its Hadamard; its scores until the top-k; attn_keys (the
      compressed rows and the window's keys decoded for the attention, uint32 bf16 pairs)
      until the attention has read them; y_groups (out_a's output, group-major) until it is
      put in token order.
    - the indexer's rotated qi_rot until the last scoring pass; the shared expert's h.

    On V4-Flash at 256K the workspace is 0.96 GB at T = 1,024 and 1.65 GB at T = 2,048
    (1.57 and 2.87 GB with an array each)."""
    T, H, K, G = int(chunk), cfg.n_heads, cfg.head_dim, cfg.o_groups
    Tk, D, F = T * cfg.n_experts_used, cfg.dim, cfg.moe_dim
    HI, DI, R = cfg.index_heads, cfg.index_dim, cfg.o_rank
    from ..kernels.attention_prefill import key_rows
    from ..kernels.indexer_mma import key_ws_rows
    ratios = compressed_ratios(cfg)  # (every layer's compressed rows fit the smallest ratio's)
    attn_keys_rows = key_rows(max(1, capacity // min(ratios, default=capacity)), cfg.window, T)
    return {"q|o_groups|y|gate_up|down": {"q": (T, H, K), "o_groups": (G, T, H // G * K),
                                          "y": (T, G, R), "gate_up": (Tk, 2 * F),
                                          "down": (Tk, D)},
            "o|idx_keys|x_rep|h|sh_gate_up": {"o": (T, H, K),
                                              "idx_keys": (key_ws_rows(capacity // 4), DI // 2),
                                              "x_rep": (Tk, D), "h": (Tk, F),
                                              "sh_gate_up": (T, 2 * F)},
            "qi|scores|attn_keys|y_groups": {"qi": (T, HI, DI),
                                             "scores": (prefill_scores_floats(capacity, T),),
                                             "attn_keys": (attn_keys_rows, K // 2),
                                             "y_groups": (G, T, R)},
            "qi_rot|sh_h": {"qi_rot": (T, HI, DI), "sh_h": (T, F)}}


def total_bytes(specs: list[ArraySpec]) -> int:
    return sum(s.nbytes for s in specs)


def step_buffer_bytes(cfg: ModelConfig, capacity: int) -> int:
    """Bytes of the decode step's buffers (DecodeEngine checks its allocation against this)."""
    return total_bytes(step_buffer_specs(cfg, capacity))


def prefill_buffer_bytes(cfg: ModelConfig, capacity: int, chunk: int) -> int:
    """Bytes of the chunked prefill's buffers (ChunkPrefill.nbytes)."""
    return total_bytes(prefill_buffer_specs(cfg, capacity, chunk))
