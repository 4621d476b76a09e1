"""Memory Indexer ("retriever") checkpoints: the official safetensors format, checked against a
model, and deterministic checkpoints made for any model (flashmemory.md §3, §8, §10.3).

Tensors per retriever layer L, where L is a CSA-layer index (``clid``: the L-th layer with
compression ratio 4; in V4-Flash transformer layer 2 + 2L, so l10, l12, l20 are layers 22, 26, 42):

    retrievers.l{L}.wq_a.weight          [rank, D]      query down-projection
    retrievers.l{L}.q_norm_weight        [rank]         RMSNorm gain (not ``q_norm.weight``)
    retrievers.l{L}.wq_b.weight          [H·DI, rank]   query up-projection, row h·DI + d
    retrievers.l{L}.weights_proj.weight  [H, D]         per-head weights, from x

H (heads) is derived from wq_b's rows; DI must be the model's indexer key length (128 in V4),
since the retriever scores that layer's own indexer keys. Official file: H = 128, rank = 2048.

The safetensors ``__metadata__`` of a pocketfm checkpoint records what the official file leaves
to its deployment scripts: the transformer layers, and the selection geometry scaled to the model
(page size, recency tail and KMAX in chunks/pages, max RoPE position). A file without it (the
official one) gets the deployment defaults below.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..errors import InputError
from .safetensors_io import read_safetensors, write_safetensors

FORMAT = "pocketfm-retriever"
OFFICIAL_CLIDS = (10, 12, 20)  # of V4-Flash's 21 CSA layers (0-based)
_NAME = re.compile(r"^retrievers\.l(\d+)\.(wq_a\.weight|wq_b\.weight|q_norm_weight|"
                   r"weights_proj\.weight)$")
_PARTS = ("wq_a.weight", "q_norm_weight", "wq_b.weight", "weights_proj.weight")


@dataclass(frozen=True)
class RetrieverGeometry:
    """Selection geometry in chunks (one chunk = one CSA entry = 4 tokens) and pages.

    Deployment defaults (flashmemory.md §5): 64-chunk pages, a recency tail of 2048 chunks,
    KMAX 96 pages (≈ 9.4 % of a 256K context), RoPE positions clamped below 1,048,576.
    """

    page_size: int = 64
    recency_tail: int = 2048
    kmax: int = 96
    max_position: int = 1 << 20

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> "RetrieverGeometry":
        """The deployment geometry scaled to the model by its indexer top-k (512 in V4-Flash):
        page = top-k/8 chunks (at least 4), tail = 4·top-k chunks, KMAX = 3× the tail's pages —
        the official proportions, so that ``tiny`` (top-k 8: pages of 4, tail 32, KMAX 24 pages)
        evicts within a few hundred tokens."""
        k = cfg.index_topk
        page = max(4, k // 8)
        tail = 4 * k
        return cls(page, tail, 3 * math.ceil(tail / page), max(cfg.ctx_train, 1 << 20))


@dataclass
class RetrieverLayer:
    """One trained query encoder, attached to transformer layer ``layer`` (CSA index ``clid``)."""

    clid: int
    layer: int
    wq_a: np.ndarray  # [rank, D]
    q_norm: np.ndarray  # [rank]
    wq_b: np.ndarray  # [H·DI, rank]
    weights_proj: np.ndarray  # [H, D]

    @property
    def heads(self) -> int:
        return self.weights_proj.shape[0]

    @property
    def rank(self) -> int:
        return self.wq_a.shape[0]


@dataclass
class Retriever:
    layers: list[RetrieverLayer]
    geometry: RetrieverGeometry
    path: str = ""

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(r.layer for r in self.layers)


def csa_layers(cfg: ModelConfig) -> list[int]:
    """Transformer layer of each CSA index: csa_layers(cfg)[clid]."""
    return [i for i in range(cfg.n_layers) if cfg.is_csa(i)]


def default_clids(cfg: ModelConfig) -> list[int]:
    """The official l10/l12/l20 placed proportionally (10/20, 12/20 and 20/20 of the way through
    the CSA layers); every CSA layer when the model has three or fewer."""
    n = len(csa_layers(cfg))
    if n <= 3:
        return list(range(n))
    ids = sorted({int(math.floor(f * (n - 1) + 0.5)) for f in (0.5, 0.6, 1.0)})
    return ids if len(ids) == 3 else [n - 3, n - 2, n - 1]


def load_retriever(path: str, cfg: ModelConfig) -> Retriever:
    """Read and check a checkpoint against the model: one InputError line per mismatch."""
    tensors, meta = read_safetensors(path)
    by_clid: dict[int, dict[str, np.ndarray]] = {}
    for name, x in tensors.items():
        m = _NAME.match(name)
        if m is None:
            raise InputError(f"{path}: tensor {name}: not in retrievers.l{{ID}}.{{"
                             f"{','.join(_PARTS)}}} format")
        by_clid.setdefault(int(m.group(1)), {})[m.group(2)] = x
    if not by_clid:
        raise InputError(f"{path}: no retrievers.l{{ID}}.* tensors")
    csa = csa_layers(cfg)
    layers = []
    for clid in sorted(by_clid):
        if clid >= len(csa):
            raise InputError(f"{path}: retrievers.l{clid}: CSA layer {clid}, but the model has "
                             f"{len(csa)} CSA layers (0..{len(csa) - 1})")
        layers.append(_check_layer(path, clid, csa[clid], by_clid[clid], cfg))
    _check_metadata_layers(path, meta, layers)
    return Retriever(layers, _geometry(path, meta), path)


def _check_layer(path, clid, layer, parts, cfg) -> RetrieverLayer:
    for p in _PARTS:
        if p not in parts:
            raise InputError(f"{path}: missing tensor retrievers.l{clid}.{p}")
    pre = f"{path}: tensor retrievers.l{clid}."
    wq_a, g, wq_b, wp = (parts[p] for p in _PARTS)
    D, DI = cfg.dim, cfg.index_dim
    if wq_a.ndim != 2 or wq_a.shape[1] != D:
        raise InputError(f"{pre}wq_a.weight: shape {list(wq_a.shape)}, expected [rank, {D}] "
                         f"(the model's hidden size is {D})")
    rank = wq_a.shape[0]
    if g.shape != (rank,):
        raise InputError(f"{pre}q_norm_weight: shape {list(g.shape)}, expected [{rank}]")
    if wq_b.ndim != 2 or wq_b.shape[1] != rank or wq_b.shape[0] % DI or not wq_b.shape[0]:
        raise InputError(f"{pre}wq_b.weight: shape {list(wq_b.shape)}, expected [heads·{DI}, "
                         f"{rank}] (head dim = the model's indexer key length {DI})")
    H = wq_b.shape[0] // DI
    if wp.shape != (H, D):
        raise InputError(f"{pre}weights_proj.weight: shape {list(wp.shape)}, expected "
                         f"[{H}, {D}] (heads from wq_b, the model's hidden size)")
    return RetrieverLayer(clid, layer, wq_a, g, wq_b, wp)


def _check_metadata_layers(path, meta, layers) -> None:
    want = meta.get("transformer_layers")
    if want is None:
        return
    got = ",".join(str(r.layer) for r in layers)
    if want.replace(" ", "") != got:
        raise InputError(f"{path}: metadata transformer_layers={want}, but its CSA layers "
                         f"{','.join(str(r.clid) for r in layers)} are transformer layers {got} "
                         "in this model (a checkpoint for another model?)")


def _geometry(path, meta) -> RetrieverGeometry:
    g = RetrieverGeometry()
    vals = {}
    for key in ("page_size", "recency_tail", "kmax", "max_position"):
        if key in meta:
            try:
                vals[key] = int(meta[key])
                assert vals[key] >= (0 if key == "kmax" else 1)
            except (ValueError, AssertionError):
                raise InputError(f"{path}: metadata {key}={meta[key]!r}: expected a positive "
                                 "integer") from None
    return RetrieverGeometry(**{**g.__dict__, **vals})


# ---- making a checkpoint ---------------------------------------------------------------------
def make_retriever(cfg: ModelConfig, weights=None, init: str = "native", seed: int = 0,
                   heads: int | None = None, rank: int | None = None) -> Retriever:
    """A deterministic retriever for any model (flashmemory.md §10.3 ``load_pretrained``).

    ``random``: every tensor kaiming-uniform (bound 1/√fan_in), gains 1. ``native``: the first
    ``q_rank`` rows of wq_a and gains are the model's attn_q_a / attn_q_a_norm (the native
    indexer shares attention's query latent), the first index_heads heads × q_rank columns of wq_b
    are indexer.attn_q_b, the first index_heads rows of weights_proj are indexer.proj; the rest
    random. Defaults: twice the native heads and rank (V4-Flash: 128 heads, rank 2048, as the
    official checkpoint).
    """
    if init not in ("random", "native"):
        raise InputError(f"--init {init!r}: expected random or native")
    if init == "native" and weights is None:
        raise InputError("--init native needs the model's weights")
    H = heads or 2 * cfg.index_heads
    R = rank or 2 * cfg.q_rank
    if init == "native" and (H < cfg.index_heads or R < cfg.q_rank):
        raise InputError(f"--init native: heads {H} and rank {R} must be at least the native "
                         f"{cfg.index_heads} and {cfg.q_rank}")
    D, DI = cfg.dim, cfg.index_dim
    csa, layers = csa_layers(cfg), []
    for clid in default_clids(cfg):
        rng = np.random.default_rng([seed, clid])
        wq_a = _kaiming(rng, R, D)
        g = np.ones(R, np.float32)
        wq_b = _kaiming(rng, H * DI, R)
        wp = _kaiming(rng, H, D)
        if init == "native":
            blk = weights.blocks[csa[clid]]
            q = cfg.q_rank
            wq_a[:q] = blk.attn_q_a.dense()
            g[:q] = blk.attn_q_a_norm.dense()
            HI = cfg.index_heads
            wq_b.reshape(H, DI, R)[:HI, :, :q] = blk.indexer_attn_q_b.dense().reshape(HI, DI, q)
            wp[:HI] = blk.indexer_proj.dense()
        layers.append(RetrieverLayer(clid, csa[clid], wq_a, g, wq_b, wp))
    return Retriever(layers, RetrieverGeometry.for_model(cfg))


def _kaiming(rng, rows: int, cols: int) -> np.ndarray:
    b = 1.0 / math.sqrt(cols)
    return rng.uniform(-b, b, (rows, cols)).astype(np.float32)


def save_retriever(path: str, ret: Retriever, dtype: str = "F32", **extra: str) -> None:
    """Write the official tensor names plus pocketfm's metadata (geometry, layers, ``extra``)."""
    tensors = {}
    for r in ret.layers:
        p = f"retrievers.l{r.clid}."
        tensors.update({p + "wq_a.weight": r.wq_a, p + "q_norm_weight": r.q_norm,
                        p + "wq_b.weight": r.wq_b, p + "weights_proj.weight": r.weights_proj})
    g = ret.geometry
    meta = {"format": FORMAT, "transformer_layers": ",".join(str(r.layer) for r in ret.layers),
            "page_size": str(g.page_size), "recency_tail": str(g.recency_tail),
            "kmax": str(g.kmax), "max_position": str(g.max_position), **extra}
    write_safetensors(path, tensors, meta, dtype)
