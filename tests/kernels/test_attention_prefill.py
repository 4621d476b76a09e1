"""Chunked-prefill attention over the packed caches vs its NumPy reference (simulator in CI)."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda

from pocketfm import ops
from pocketfm.kernels import attention_prefill as ap
from pocketfm.kernels import kvpack
from pocketfm.kernels.attention import random_packed_kv
from pocketfm.kernels.device import SIMULATOR
from pocketfm.model import Forward

from .kernel_testing import THREADS, fresh_rng, poisoned, rel_err

K, R = 128, 64  # the V4 entry layout at a generic size: 200-byte entries
NCAP = 40
# (pos0, T, W): chunk at the start, inside the first ring, after the ring wrapped, T > W
POSITIONS = [(0, 3, 4), (2, 3, 4), (9, 3, 4), (3, 6, 4), (21, 3, 16)]


def unpack(packed):
    x = np.empty((len(packed), K), np.float32)
    kvpack.unpack_kv_ref(x, packed, R)
    return x


def csa_sel(rng, T, S):
    """Per token a distinct set of rows (0..S of them), -1 elsewhere: padded at the end (as
    top-k pads) on even tokens, holes scattered on odd ones; token 0 picks none."""
    sel = np.full((T, S), -1, np.int32)
    for t in range(T):
        k = 0 if t == 0 else int(rng.integers(1, S + 1))
        sel[t, :k] = rng.choice(NCAP, k, replace=False)
        if t % 2:
            rng.shuffle(sel[t])
    return sel


def inputs(rng, pos0, T, W, H):
    return dict(q=rng.normal(size=(T, H, K)).astype(np.float32),
                win=random_packed_kv(rng, W, K, R), chunk=random_packed_kv(rng, T, K, R),
                comp=random_packed_kv(rng, NCAP, K, R), pos0=np.array([pos0], np.int32),
                sinks=rng.normal(size=H).astype(np.float32))


def nan_keys(ncap, w, t, k):
    """A decoded-keys workspace of NaN bf16 pairs (for ncap compressed rows, w window slots, a
    t-token chunk): rows the kernels may not use stay NaN."""
    return cuda.to_device(np.full((ap.key_rows(ncap, w, t), k // 2), 0x7FC07FC0, np.uint32))


def run(x, sel, nvis, hca, naive, threads=THREADS, mma=None, keys=False, q_norm_rope=None,
        **opts):
    """(kernel output, float64 reference) for inputs ``x`` and the selection / counts
    (``keys``: the compressed rows and the window decoded once into a workspace first;
    ``q_norm_rope``: (eps, pos, freqs) NumPy arrays, q normalised and rotated inside)."""
    T, H, _ = x["q"].shape
    scale = 1 / math.sqrt(K)
    ref = np.empty((T, H, K))
    ap.attention_prefill_ref(ref, x["q"].astype(np.float64), x["win"], x["chunk"], x["comp"],
                             sel, nvis, hca, x["pos0"], x["sinks"].astype(np.float64), scale,
                             q_norm_rope=q_norm_rope)
    d = {k: cuda.to_device(v) for k, v in dict(x, sel=sel, nvis=nvis).items()}
    fold = None if q_norm_rope is None else (q_norm_rope[0], *map(cuda.to_device,
                                                                  q_norm_rope[1:]))
    out = poisoned((T, H, K))
    ap.attention_prefill(out, d["q"], d["win"], d["chunk"], d["comp"], d["sel"], d["nvis"], hca,
                         d["pos0"], d["sinks"], scale, threads=threads, naive=naive, mma=mma,
                         keys=nan_keys(NCAP, len(x["win"]), T, K) if keys else None,
                         q_norm_rope=fold, **opts)
    return out.copy_to_host(), ref


# ---- the reference against independent constructions -----------------------------------------
@pytest.mark.parametrize("pos0,T,W", POSITIONS)
def test_ref_window_matches_the_model(pos0, T, W):
    """Window-only: the reference's keys and mask are the model's (Forward._window_keys, which
    also pushes the chunk into the ring exactly as store_chunk_rows_ref does)."""
    rng = fresh_rng()
    x = inputs(rng, pos0, T, W, 2)
    sel, nvis = np.full((T, 1), -1, np.int32), np.zeros(T, np.int32)
    ref = np.empty((T, 2, K))
    q = x["q"].astype(np.float64)
    ap.attention_prefill_ref(ref, q, x["win"], x["chunk"], x["comp"], sel, nvis, 0, x["pos0"],
                             x["sinks"], 0.1)
    fwd = SimpleNamespace(cfg=SimpleNamespace(window=W))
    st = SimpleNamespace(window=unpack(x["win"]))
    keys, mask = Forward._window_keys(fwd, st, unpack(x["chunk"]), pos0 + np.arange(T))
    want = np.empty_like(ref)
    ops.sink_attention(want, q, keys.astype(np.float64), mask, x["sinks"], 0.1)
    assert rel_err(ref, want) <= 1e-6
    ring = x["win"].copy()
    ap.store_chunk_rows_ref(ring, x["chunk"], x["pos0"])
    assert np.array_equal(unpack(ring), st.window)


@pytest.mark.parametrize("hca", [0, 1])
def test_ref_matches_per_token_key_lists(hca):
    """Each token's keys listed by position as the spec states them, one sink_attention each."""
    rng = fresh_rng()
    pos0, T, W, H = 6, 7, 4, 2
    x = inputs(rng, pos0, T, W, H)
    sel = csa_sel(rng, T, 5)
    nvis = np.minimum((pos0 + np.arange(T) + 1) // 2, NCAP).astype(np.int32)
    ref = np.empty((T, H, K))
    q = x["q"].astype(np.float64)
    ap.attention_prefill_ref(ref, q, x["win"], x["chunk"], x["comp"], sel, nvis, hca, x["pos0"],
                             x["sinks"], 0.1)
    win, chunk, comp = unpack(x["win"]), unpack(x["chunk"]), unpack(x["comp"])
    for t in range(T):
        p = pos0 + t
        keys = [win[kp % W] for kp in range(max(0, p - W + 1), pos0)]
        keys += [chunk[tt] for tt in range(T) if tt <= t and p - (pos0 + tt) < W]
        keys += [comp[j] for j in (range(nvis[t]) if hca else sel[t][sel[t] >= 0])]
        kv = np.stack(keys).astype(np.float64)
        want = np.empty((1, H, K))
        ops.sink_attention(want, q[t:t + 1], kv, np.ones((1, len(kv)), bool), x["sinks"],
                           0.1)
        assert rel_err(ref[t], want[0]) <= 1e-6


# ---- kernels vs the reference -----------------------------------------------------------------
KERNELS = {"naive": dict(naive=True), "tiles": dict(naive=False, mma=False),
           "mma": dict(naive=False, mma=True)}


def cases(positions, mma_positions):
    """(kernel, pos0, T, W): every position for the CUDA-core kernels, fewer for the tensor
    cores (each emulated MMA costs two block barriers in the simulator: ~5 s per tile)."""
    return ([(k, *p) for k in ("naive", "tiles") for p in positions]
            + [("mma", *p) for p in mma_positions])


@pytest.mark.parametrize("kernel,pos0,T,W", cases(POSITIONS, [(9, 3, 4)]))
def test_attention_prefill_csa(kernel, pos0, T, W):
    """CSA: -1 padding and holes; S = 24 > KC - W, so some tiles are all holes (skipped)."""
    rng = fresh_rng()
    x = inputs(rng, pos0, T, W, 4)
    sel = csa_sel(rng, T, 24 if W == 4 else 8)
    nvis = np.full(T, 123456, np.int32)  # garbage: CSA must not read it
    out, ref = run(x, sel, nvis, 0, **KERNELS[kernel])
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("kernel,pos0,T,W", cases([(0, 3, 4), (30, 6, 4)], [(0, 3, 4)]))
def test_attention_prefill_hca(kernel, pos0, T, W):
    """HCA: n_comp_visible grows along the chunk (from 0 at the start); sel is ignored."""
    rng = fresh_rng()
    x = inputs(rng, pos0, T, W, 4)
    nvis = np.minimum((pos0 + np.arange(T) + 1) // 2, NCAP).astype(np.int32)
    sel = np.full((T, 1), 123456, np.int32)  # garbage: must not be read
    out, ref = run(x, sel, nvis, 1, **KERNELS[kernel])
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("pos0,T,W", [(0, 2, 4), (32, 3, 4)])
def test_attention_prefill_hca_decoded_keys(pos0, T, W):
    """HCA on the tensor cores with the compressed rows and the window decoded once (``keys``,
    as the engine runs it): whole tiles of rows first, then the window's tile. pos0 = 32: 16
    visible rows, then 17, in one 32-key tile with masked rows (the workspace's rows past the
    count must be zeroed, not left NaN); pos0 = 0: tokens with no compressed row at all."""
    rng = fresh_rng()
    x = inputs(rng, pos0, T, W, 4)
    nvis = np.minimum((pos0 + np.arange(T) + 1) // 2, NCAP).astype(np.int32)
    sel = np.full((T, 1), 123456, np.int32)  # garbage: must not be read
    out, ref = run(x, sel, nvis, 1, False, mma=True, keys=True)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("pos0,T,W,S", [(9, 3, 4, 24), (21, 2, 16, 40)])
def test_attention_prefill_csa_decoded_keys(pos0, T, W, S):
    """CSA on the tensor cores with the compressed rows and the window decoded once (``keys``,
    as the engine runs it): each token's selected rows gathered by cp.async (holes and -1
    padding read a zero row), then its window; S = 40: two 32-key tiles of selected slots."""
    rng = fresh_rng()
    x = inputs(rng, pos0, T, W, 4)
    sel = csa_sel(rng, T, S)
    nvis = np.full(T, 123456, np.int32)  # garbage: every row of the pool decoded (clamped)
    out, ref = run(x, sel, nvis, 0, False, mma=True, keys=True)
    assert rel_err(out, ref) <= 1e-4


def test_attention_prefill_window_only_decoded_keys():
    """A window-only layer (S = 1 of -1, no compressed rows) through the same build."""
    rng = fresh_rng()
    pos0, T, W = 13, 2, 4
    x = inputs(rng, pos0, T, W, 3)
    out, ref = run(x, np.full((T, 1), -1, np.int32), np.zeros(T, np.int32), 0, False, mma=True,
                   keys=True)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("kernel,hca,far", [("naive", 0, False), ("tiles", 1, True),
                                            ("mma", 0, True), ("mma", 1, False),
                                            ("mma keys", 0, False), ("mma keys", 1, True),
                                            ("mma keys unfolded", 1, True)])
def test_attention_prefill_q_norm_rope(kernel, hca, far):
    """q as the q_b GEMM leaves it (rows far from unit RMS, a per-head offset): its per-head
    RMSNorm and RoPE and the output's inverse RoPE inside the tensor-core kernel (around the
    other forms, and around it with fold_q_norm_rope False), against the reference's three
    steps; ``far``: positions near 1M, where a float32 angle would be off. H = 5: a padded
    m-tile's rows (heads 5..15) must stay zero."""
    from pocketfm.numerics import rope_frequencies

    rng = fresh_rng()
    pos0, T, W = 9, 3, 4
    x = inputs(rng, pos0, T, W, 5)
    x["q"] = (x["q"] * 37 + rng.normal(size=(1, 5, 1)) * 20).astype(np.float32)
    pos = (pos0 + np.arange(T) + (1_000_000 if far else 0)).astype(np.int32)
    fold = (np.float32(1e-6), pos, rope_frequencies(R, 160000.0, 16.0, 65536))
    if hca:
        sel = np.full((T, 1), 123456, np.int32)
        nvis = np.minimum((pos0 + np.arange(T) + 1) // 2, NCAP).astype(np.int32)
    else:
        sel, nvis = csa_sel(rng, T, 24), np.full(T, 123456, np.int32)
    how = dict(KERNELS[kernel.split()[0]], keys="keys" in kernel,
               fold_q_norm_rope="unfolded" not in kernel)
    out, ref = run(x, sel, nvis, hca, **how, q_norm_rope=fold)
    assert rel_err(out, ref) <= 1e-4
    plain = np.empty_like(ref)  # (the fold matters: without it the output is another one)
    ap.attention_prefill_ref(plain, x["q"].astype(np.float64), x["win"], x["chunk"],
                             x["comp"], sel, nvis, hca, x["pos0"], x["sinks"], 1 / math.sqrt(K))
    assert rel_err(plain, ref) > 1e-2


@pytest.mark.parametrize("last,pos0,T,W", [(0, 0, 3, 4), (17, 2, 3, 4), (NCAP + 5, 9, 6, 4)])
def test_decode_rows(last, pos0, T, W):
    """HCA's rows decoded once, against the reference: rows below the last token's count
    (clamped to the pool), zeros up to the next ROW_TILE; then the window's keys by position
    (zeros before position 0, the ring's wrapped entries, the chunk's, zeros after); the rest
    of the workspace untouched."""
    rng = fresh_rng()
    x = inputs(rng, pos0, T, W, 1)
    nvis = np.array([0, last], np.int32)
    shape = (ap.key_rows(NCAP, W, T), K // 2)
    ref = np.full(shape, 0x7FC07FC0, np.uint32)
    ap.decode_rows_ref(ref, x["comp"], nvis, x["win"], x["chunk"], x["pos0"])
    keys = nan_keys(NCAP, W, T, K)
    ap.decode_rows(keys, cuda.to_device(x["comp"]), cuda.to_device(nvis),
                   cuda.to_device(x["win"]), cuda.to_device(x["chunk"]),
                   cuda.to_device(x["pos0"]))
    assert np.array_equal(keys.copy_to_host(), ref)

    def halves(rows, packed):  # the reference's rows are the unpacked entries' bf16 bits
        want = unpack(packed).view(np.uint32) >> np.uint32(16)
        return (np.array_equal(rows & np.uint32(0xFFFF), want[:, 0::2])
                and np.array_equal(rows >> np.uint32(16), want[:, 1::2]))
    n = min(last, NCAP)
    assert halves(ref[:n], x["comp"][:n])
    C = -(-NCAP // ap.ROW_TILE) * ap.ROW_TILE
    nz = -(-n // ap.ROW_TILE) * ap.ROW_TILE
    assert not ref[n:nz].any() and (ref[nz:C] == 0x7FC07FC0).all()
    assert not ref[C + W + T:C + W + T + ap.ROW_TILE].any()
    for r in range(W):  # row C + r: position pos0 - W + r
        p = pos0 - W + r
        assert halves(ref[C + r:C + r + 1], x["win"][[p % W]]) if p >= 0 else \
            not ref[C + r].any()
    assert halves(ref[C + W:C + W + T], x["chunk"])
    assert (ref[C + W + T + ap.ROW_TILE:] == 0x7FC07FC0).all()


def test_decode_rows_rejects_a_short_workspace():
    rng = fresh_rng()
    x = {n: cuda.to_device(v) for n, v in inputs(rng, 3, 2, 4, 1).items()}
    need = ap.key_rows(NCAP, 4, 2)
    short = cuda.to_device(np.zeros((need - 1, K // 2), np.uint32))
    with pytest.raises(ValueError, match=rf"keys \({need - 1}, 64\), need at least {need} rows"):
        ap.decode_rows(short, x["comp"], cuda.to_device(np.array([3], np.int32)), x["win"],
                       x["chunk"], x["pos0"])
    wide = cuda.to_device(np.zeros((need, K), np.uint32))  # K columns: no entry layout fits
    with pytest.raises(ValueError, match="no KV entry layout"):
        ap.decode_rows(wide, x["comp"], cuda.to_device(np.array([3], np.int32)), x["win"],
                       x["chunk"], x["pos0"])


@pytest.mark.parametrize("kernel", ["naive", "tiles"])
def test_attention_prefill_window_only(kernel):
    """Ratio-0 layers: S = 1, all -1; three heads (the fast path pads a head group)."""
    rng = fresh_rng()
    pos0, T, W = 13, 5, 4
    x = inputs(rng, pos0, T, W, 3)
    out, ref = run(x, np.full((T, 1), -1, np.int32), np.zeros(T, np.int32), 0,
                   **KERNELS[kernel])
    assert rel_err(out, ref) <= 1e-4


def test_attention_prefill_two_warps():
    """The fast path with two warps a block (shared tiles feed 4 heads) and a head group cut
    short (H = 6 over 2 groups of 4)."""
    rng = fresh_rng()
    x = inputs(rng, 5, 2, 4, 6)
    out, ref = run(x, csa_sel(rng, 2, 6), np.zeros(2, np.int32), 0, False, threads=2 * THREADS)
    assert rel_err(out, ref) <= 1e-4


def test_attention_prefill_mma_two_m_tiles():
    """The tensor-core kernel with two 16-head m-tiles a block (H > 16), the second cut
    short (H = 20); the other tests (H = 4) run one m-tile."""
    rng = fresh_rng()
    x = inputs(rng, 9, 2, 4, 20)
    out, ref = run(x, csa_sel(rng, 2, 12), np.zeros(2, np.int32), 0, False, mma=True)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("pos0,T,W", POSITIONS + [(7, 9, 4)])
def test_store_chunk_rows(pos0, T, W):
    rng = fresh_rng()
    win, chunk = random_packed_kv(rng, W, K, R), random_packed_kv(rng, T, K, R)
    ref = win.copy()
    ap.store_chunk_rows_ref(ref, chunk, np.array([pos0], np.int32))
    d = cuda.to_device(win)
    ap.store_chunk_rows(d, cuda.to_device(chunk), cuda.to_device(np.array([pos0], np.int32)),
                        threads=THREADS)
    assert np.array_equal(d.copy_to_host(), ref)


def test_two_chunks_equal_one():
    """Prefill in two chunks (the ring carried by store_chunk_rows) = one chunk from 0."""
    rng = fresh_rng()
    T1, T2, W, H = 5, 3, 4, 2
    x = inputs(rng, 0, T1 + T2, W, H)
    hca = 1
    nvis = np.minimum((np.arange(T1 + T2) + 1) // 2, NCAP).astype(np.int32)
    sel = np.full((T1 + T2, 1), -1, np.int32)
    whole = np.empty((T1 + T2, H, K))
    ap.attention_prefill_ref(whole, x["q"].astype(np.float64), x["win"], x["chunk"], x["comp"],
                             sel, nvis, hca, x["pos0"], x["sinks"].astype(np.float64),
                             1 / math.sqrt(K))
    ring = cuda.to_device(np.zeros_like(x["win"]))  # never read at pos0 = 0
    ap.store_chunk_rows(ring, cuda.to_device(x["chunk"][:T1]),
                        cuda.to_device(np.zeros(1, np.int32)), threads=THREADS)
    out = poisoned((T2, H, K))
    d = [cuda.to_device(np.ascontiguousarray(a)) for a in
         (x["q"][T1:], x["chunk"][T1:], x["comp"], sel[T1:], nvis[T1:],
          np.array([T1], np.int32), x["sinks"])]
    ap.attention_prefill(out, d[0], ring, d[1], d[2], d[3], d[4], hca, d[5], d[6],
                         1 / math.sqrt(K), threads=THREADS)
    assert rel_err(out.copy_to_host(), whole[T1:]) <= 1e-4


@pytest.mark.skipif(SIMULATOR, reason="V4 shapes: too slow for the simulator")
@pytest.mark.parametrize("hca,mma,keys", [(0, False, False), (0, True, False), (1, False, False),
                                          (1, True, False), (1, True, True)])
def test_attention_prefill_v4_shapes(hca, mma, keys):
    rng = fresh_rng()
    H, K4, R4, W4, S4, T, ncap = 64, 512, 64, 128, 512, 40, 1000
    pos0 = 3000
    x = dict(q=(rng.normal(size=(T, H, K4)) / 8).astype(np.float32),
             win=random_packed_kv(rng, W4, K4, R4), chunk=random_packed_kv(rng, T, K4, R4),
             comp=random_packed_kv(rng, ncap, K4, R4), pos0=np.array([pos0], np.int32),
             sinks=rng.normal(size=H).astype(np.float32))
    sel = np.stack([rng.choice(ncap, S4, replace=False) for _ in range(T)]).astype(np.int32)
    sel[:, 400:] = -1
    nvis = np.minimum((pos0 + np.arange(T) + 1) // 4, 900).astype(np.int32)
    ref = np.empty((T, H, K4))
    ap.attention_prefill_ref(ref, x["q"].astype(np.float64), x["win"], x["chunk"], x["comp"],
                             sel, nvis, hca, x["pos0"], x["sinks"].astype(np.float64),
                             1 / math.sqrt(K4))
    d = {k: cuda.to_device(v) for k, v in dict(x, sel=sel, nvis=nvis).items()}
    out = poisoned((T, H, K4))
    ap.attention_prefill(out, d["q"], d["win"], d["chunk"], d["comp"], d["sel"], d["nvis"], hca,
                         d["pos0"], d["sinks"], 1 / math.sqrt(K4), mma=mma,
                         keys=nan_keys(ncap, W4, T, K4) if keys else None)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_q_norm_rope_refuses_freqs_of_another_rope_width():
    """The tensor-core fold reads freqs[(d - NOPE) / 2]: a table for another R is refused."""
    rng = fresh_rng()
    x = inputs(rng, 9, 2, 4, 4)
    d = {k: cuda.to_device(v) for k, v in x.items()}
    sel, nvis = cuda.to_device(csa_sel(rng, 2, 8)), cuda.to_device(np.full(2, 9, np.int32))
    wrong = (1e-6, cuda.to_device(np.array([9, 10], np.int32)), cuda.to_device(np.ones(R)))
    with pytest.raises(ValueError, match="freqs"):
        ap.attention_prefill(poisoned((2, 4, K)), d["q"], d["win"], d["chunk"], d["comp"], sel,
                             nvis, 0, d["pos0"], d["sinks"], 0.1, mma=True, q_norm_rope=wrong)
