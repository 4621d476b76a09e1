"""Sink attention over packed KV entries vs ops.sink_attention (simulator in CI; a GPU too)."""
import math

import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm.kernels import attention as at
from pocketfm.kernels import kvpack
from pocketfm.kernels.device import SIMULATOR

K, R = 128, 64  # generic-size check of the V4 layout (512 / 64): 200-byte entries
W, S, NCAP = 16, 8, 40


def decode_inputs(rng, H):
    q = rng.normal(size=(H, K)).astype(np.float32)
    win = at.random_packed_kv(rng, W, K, R)
    comp = at.random_packed_kv(rng, NCAP, K, R)
    sinks = rng.normal(size=H).astype(np.float32)
    return q, win, comp, sinks


def run_decode(q, win, nw, comp, sel, nc, hca, sinks, naive=False, **how):
    H = q.shape[0]
    scale = 1 / math.sqrt(K)
    arrs = [np.array([nw], np.int32), sel.astype(np.int32), np.array([nc], np.int32)]
    ref = np.empty((H, K))
    at.attention_decode_ref(ref, q.astype(np.float64), win, arrs[0], comp, arrs[1], arrs[2],
                            hca, sinks.astype(np.float64), scale)
    out = poisoned((H, K))
    d = [cuda.to_device(a) for a in (q, win, arrs[0], comp, arrs[1], arrs[2], sinks)]
    threads = how.pop("threads", THREADS)
    at.attention_decode(out, d[0], d[1], d[2], d[3], d[4], d[5], hca, d[6], scale,
                        threads=threads, naive=naive, **how)
    return out.copy_to_host(), ref


def test_rope_dim_follows_from_the_entry_width():
    assert at.rope_dim_of(512, 584) == 64 and at.rope_dim_of(128, 200) == 64
    assert at.rope_dim_of(144, kvpack.kv_entry_bytes(144, 16)) == 16
    assert kvpack.kv_entry_bytes(K, R) == 200


@pytest.mark.parametrize("naive", [True, False])
@pytest.mark.parametrize("H,nw", [(4, 16), (3, 11)])
def test_attention_decode_csa(naive, H, nw):
    """Window partly filled (nw < W) or full; the selection has holes (-1) and repeats none."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, H)
    sel = rng.choice(30, S, replace=False)
    sel[rng.integers(0, S, size=2)] = -1
    out, ref = run_decode(q, win, nw, comp, sel, 30, 0, sinks, naive)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("naive", [True, False])
def test_attention_decode_hca(naive):
    """HCA: every compressed entry below n_comp_visible; sel is ignored."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, 4)
    sel = np.full(S, 123456, np.int32)  # garbage: must not be read
    out, ref = run_decode(q, win, W, comp, sel, 37, 1, sinks, naive)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("hca,tiles", [(0, 1), (1, 2), (1, 4)])
def test_the_split_kernel_prefetching_the_next_tile_changes_nothing(hca, tiles):
    """The split kernel loading the next tile's words while it scores this one (64 threads:
    12 words a thread a tile) = the kernel loading each tile after the last = the kernel
    storing its partials straight, not through shared memory, bit for bit, and the reference
    within rounding: 1, 2 or 4 tiles a split, the last one cut short (37 visible compressed
    entries), a window partly filled, CSA holes; 3 heads (a head group cut short)."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, 3)
    sel = rng.choice(NCAP, S, replace=False)
    sel[rng.integers(0, S, size=2)] = -1
    assert at._split_kernel(K, R, 64)[0] is not at._split_kernel(K, R, 64, False)[0]
    assert at._split_kernel(K, R, 64)[0] is not at._split_kernel(K, R, 64, True, False)[0]
    got = {}
    for how in ((True, True), (False, True), (True, False)):
        got[how], ref = run_decode(q, win, 11, comp, sel, 37, hca, sinks, threads=64,
                                   split_tiles=tiles, prefetch=how[0], staged=how[1])
    assert np.array_equal(got[True, True], got[False, True])
    assert np.array_equal(got[True, True], got[True, False])
    assert rel_err(got[True, True], ref) <= 1e-4


@pytest.mark.parametrize("hca,tiles,threads", [(0, 1, 64), (1, 1, 64), (1, 2, 64), (0, 1, 32)])
def test_the_head_warp_kernel_equals_the_reference(hca, tiles, threads):
    """The split kernel with one head a warp over 32-slot tiles (head_warps) against float64
    and against the two-heads-a-warp kernel: 3 heads (at 64 threads the second block's
    second warp has none), a window partly filled, CSA holes, 37 visible compressed entries
    (HCA: 53 slots, the last tile cut short; 2 tiles a split run the next tile's prefetch)."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, 3)
    sel = rng.choice(NCAP, S, replace=False)
    sel[rng.integers(0, S, size=2)] = -1
    got, ref = run_decode(q, win, 11, comp, sel, 37, hca, sinks, threads=threads,
                          split_tiles=tiles, head_warps=True)
    two, _ = run_decode(q, win, 11, comp, sel, 37, hca, sinks, threads=64)
    assert rel_err(got, ref) <= 1e-4
    assert rel_err(got, two) <= 1e-5
    # the tile as bf16: the same values, and at K = 128 the same dims a lane: the same bits
    bf, _ = run_decode(q, win, 11, comp, sel, 37, hca, sinks, threads=threads,
                       split_tiles=tiles, head_warps=True, bf16_tile=True)
    assert np.array_equal(bf, got)


@pytest.mark.parametrize("tiles", [1, 2])
def test_the_head_warp_kernel_skips_a_tile_without_keys(tiles):
    """An empty window and the first 16 selected slots holes: the first 32-slot tile has no
    key. One tile a split: that split's partial is empty (max -inf, sum 0) and the combine
    weighs it 0; two: the block skips the tile and goes on to the next one."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, 3)
    sel = rng.choice(NCAP, 40, replace=False)
    sel[:16] = -1
    got, ref = run_decode(q, win, 0, comp, sel, 37, 0, sinks, threads=64, split_tiles=tiles,
                          head_warps=True)
    assert rel_err(got, ref) <= 1e-4
    bf, _ = run_decode(q, win, 0, comp, sel, 37, 0, sinks, threads=64, split_tiles=tiles,
                       head_warps=True, bf16_tile=True)
    assert np.array_equal(bf, got)


@pytest.mark.parametrize("bf16_tile", [False, True])
def test_the_head_warp_kernel_reads_each_fp8_block_s_scale(bf16_tile):
    """K = 256 (three 64-dim FP8 blocks, each its own scale; at K = 128 there is one) at 64
    threads (2 a key): a word's scale byte follows from its item; the bf16 tile's lanes hold
    8 consecutive dims (K a multiple of 256), its FP8 values and bf16 dims in their words."""
    rng = fresh_rng()
    H, K2, nc = 2, 256, 20
    q = rng.normal(size=(H, K2)).astype(np.float32)
    win = at.random_packed_kv(rng, W, K2, R)
    comp = at.random_packed_kv(rng, nc, K2, R)
    sinks = rng.normal(size=H).astype(np.float32)
    nw, ncv = np.array([W], np.int32), np.array([nc], np.int32)
    ref = np.empty((H, K2))
    at.attention_decode_ref(ref, q.astype(np.float64), win, nw, comp, np.zeros(1, np.int32),
                            ncv, 1, sinks.astype(np.float64), 1 / math.sqrt(K2))
    out = poisoned((H, K2))
    d = [cuda.to_device(a) for a in (q, win, nw, comp, np.zeros(1, np.int32), ncv, sinks)]
    at.attention_decode(out, *d[:6], 1, d[6], 1 / math.sqrt(K2), threads=64, head_warps=True,
                        bf16_tile=bf16_tile)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_the_head_warp_kernel_refuses_a_layout_it_has_not():
    with pytest.raises(ValueError, match="head-warp layout"):
        at._head_warp_kernel(K, R, 16)  # (not whole warps)


@pytest.mark.parametrize("groups", [0, 2, 8])
@pytest.mark.parametrize("P", [3, 20, 34, 64])
def test_the_combine_merges_the_split_partials_with_the_sink(P, groups):
    """The combine alone against the merge in float64: w_p = exp(m_p - M), out = Σ w_p acc_p
    / (Σ w_p l_p + exp(z - M)); one split empty (max -inf, sum 0); P below, at and past a
    16-load batch, up to MAX_SPLITS; K = 192 (the second block's threads past K write
    nothing). A thread a dim, or the splits spread over 2 or 8 groups of threads (P below,
    at and past a group's share)."""
    from pocketfm.kernels import device

    rng = fresh_rng()
    H, K = 3, 192
    part = np.zeros((P, H, K + 2), np.float32)
    part[:, :, :K] = rng.normal(size=(P, H, K))
    part[:, :, K] = rng.normal(size=(P, H)) * 3
    part[:, :, K + 1] = rng.uniform(0.5, 4.0, size=(P, H))
    part[P // 2, :, :K], part[P // 2, :, K], part[P // 2, :, K + 1] = 0.0, -np.inf, 0.0
    sinks = rng.normal(size=H).astype(np.float32)
    m = part[:, :, K].astype(np.float64)
    M = np.maximum(m.max(axis=0), sinks)
    w = np.exp(m - M)
    den = (w * part[:, :, K + 1]).sum(axis=0) + np.exp(sinks - M)
    ref = np.einsum("ph,phk->hk", w, part[:, :, :K].astype(np.float64)) / den[:, None]
    out = cuda.to_device(np.full((H, K), np.nan, np.float32))
    at._combine(out, cuda.to_device(part), cuda.to_device(sinks), device.empty_vector(np.int32),
                device.empty_vector(np.float64), None, 0, groups)
    assert rel_err(out.copy_to_host(), ref) <= 1e-6


def test_attention_decode_sink_dominates():
    """A huge sink takes almost all the mass: the output shrinks towards 0 like the reference."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, 4)
    sinks[:] = 30.0
    out, ref = run_decode(q, win, 5, comp, np.arange(S), 8, 0, sinks, False)
    assert rel_err(out, ref) <= 1e-4 and np.abs(ref).max() < 1e-6


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("H,nw,tiles", [(4, 11, 1), (20, 16, 2)])
def test_attention_decode_mma_csa(H, nw, tiles, staged):
    """The tensor-core decode (attention_prefill's kernel, decode form) vs float64: a window
    partly filled, selection holes; H = 20 takes two m-tiles (the second cut short: its
    missing heads' q rows are not copied, their partial rows not written); two tiles a split
    run the in-block pipeline across tiles; q and the partials through shared memory or
    not."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, H)
    sel = rng.choice(NCAP, S, replace=False)
    sel[rng.integers(0, S, size=2)] = -1
    out, ref = run_decode(q, win, nw, comp, sel, NCAP, 0, sinks, False, mma=True,
                          tiles_per_split=tiles, staged=staged)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("nc", [37, 5])
def test_attention_decode_mma_hca(nc, staged):
    """HCA on the tensor cores; with 5 visible entries the splits sized for the capacity (40)
    outnumber the tiles, so the last splits are empty (max -inf, sum 0: weight 0)."""
    rng = fresh_rng()
    q, win, comp, sinks = decode_inputs(rng, 4)
    sel = np.full(S, 123456, np.int32)  # garbage: must not be read
    out, ref = run_decode(q, win, W, comp, sel, nc, 1, sinks, False, mma=True, tiles_per_split=1,
                          staged=staged)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("how", [dict(naive=True), dict(naive=False), dict(mma=True),
                                 dict(naive=False, combine_groups=4)])
def test_attention_decode_rotates_the_output_back(how):
    """``out_rope``: the inverse RoPE inside the combine (the naive path: a launch after) =
    the reference's output through rope_ref(inverse), and within float32 rounding of the
    separate rope launch (the same products; the GPU compiler may contract them into FMAs
    differently in the two kernels: H200, 1 ulp)."""
    from pocketfm.kernels import norm_rope
    from pocketfm.numerics import rope_frequencies

    rng = fresh_rng()
    H = 3
    q, win, comp, sinks = decode_inputs(rng, H)
    sel = rng.choice(30, S, replace=False)
    pos = np.array([int(rng.integers(0, 1 << 20))], np.int32)
    freqs = rope_frequencies(R, 160000.0, 16.0, 65536)
    dpos, dfreqs = cuda.to_device(pos), cuda.to_device(freqs)
    how = dict(how, tiles_per_split=1) if how.get("mma") else how
    plain, ref = run_decode(q, win, 11, comp, sel, 30, 0, sinks, **how)
    rotated, _ = run_decode(q, win, 11, comp, sel, 30, 0, sinks, **how,
                            out_rope=(dpos, dfreqs))
    ref_rot = np.empty((1, H, K))
    norm_rope.rope_ref(ref_rot, ref.reshape(1, H, K), pos, freqs, True)
    assert rel_err(rotated, ref_rot[0]) <= 1e-4
    two = cuda.to_device(plain.reshape(1, H, K))
    norm_rope.rope(two, two, dpos, dfreqs, True, threads=THREADS)
    assert rel_err(rotated, two.copy_to_host()[0]) <= 1e-6


@pytest.mark.parametrize("how", [dict(naive=True), dict(naive=False), dict(mma=True),
                                 dict(mma=True, combine_groups=2)])
def test_attention_decode_makes_the_out_a_limbs(how):
    """``limbs``: the combine also writes the int8 limbs of its output viewed as [2, H·K/2]
    (attn_output_a's x), exactly the words q8_0_limbs makes of that output (naive: a limbs
    launch after), and its output is the same as without them, bit for bit."""
    from pocketfm.kernels import gemv
    from pocketfm.numerics import rope_frequencies

    rng = fresh_rng()
    H = 4
    q, win, comp, sinks = decode_inputs(rng, H)
    sel = rng.choice(30, S, replace=False)
    back = (cuda.to_device(np.array([77], np.int32)),
            cuda.to_device(rope_frequencies(R, 160000.0, 16.0, 65536)))
    how = dict(how, tiles_per_split=1) if how.get("mma") else how
    plain, _ = run_decode(q, win, 11, comp, sel, 30, 0, sinks, **how, out_rope=back)
    xl = cuda.to_device(np.full((2, H * K // 2 // 16 * gemv.XLW), -5, np.int32))
    out, ref = run_decode(q, win, 11, comp, sel, 30, 0, sinks, **how, out_rope=back, limbs=xl)
    assert np.array_equal(out, plain)
    want = gemv.q8_0_limbs(cuda.to_device(out.reshape(2, H * K // 2)), name="test limbs o")
    assert np.array_equal(xl.copy_to_host(), want.copy_to_host())


def test_attention_chunk():
    rng = fresh_rng()
    T, H, M = 3, 2, 30
    q = rng.normal(size=(T, H, K)).astype(np.float32)
    keys = at.random_packed_kv(rng, M, K, R)
    mask = (rng.random((T, M)) < 0.6).astype(np.uint8)
    mask[:, 0] = 1
    mask[1] = 0  # a query that sees no key: only the sink, output 0
    sinks = rng.normal(size=H).astype(np.float32)
    scale = 1 / math.sqrt(K)
    ref = np.empty((T, H, K))
    at.attention_chunk_ref(ref, q.astype(np.float64), keys, mask, sinks.astype(np.float64),
                           scale)
    assert np.all(ref[1] == 0)
    out = poisoned((T, H, K))
    at.attention_chunk(out, cuda.to_device(q), cuda.to_device(keys), cuda.to_device(mask),
                       cuda.to_device(sinks), scale, threads=THREADS)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


@pytest.mark.skipif(SIMULATOR, reason="V4 shapes: too slow for the simulator")
@pytest.mark.parametrize("mma", [False, True, "unstaged", "head warps", "bf16 tile"])
@pytest.mark.parametrize("hca", [0, 1])
def test_attention_decode_v4_shapes(hca, mma):
    rng = fresh_rng()
    H, K4, R4, W4 = 64, 512, 64, 128
    ncap = 1000
    q = (rng.normal(size=(H, K4)) / 8).astype(np.float32)
    win = at.random_packed_kv(rng, W4, K4, R4)
    comp = at.random_packed_kv(rng, ncap, K4, R4)
    sinks = rng.normal(size=H).astype(np.float32)
    sel = rng.choice(ncap, 512, replace=False).astype(np.int32)
    nw, nc = np.array([W4], np.int32), np.array([900], np.int32)
    ref = np.empty((H, K4))
    at.attention_decode_ref(ref, q.astype(np.float64), win, nw, comp, sel, nc, hca,
                            sinks.astype(np.float64), 1 / math.sqrt(K4))
    out = poisoned((H, K4))
    d = [cuda.to_device(a) for a in (q, win, nw, comp, sel, nc, sinks)]
    at.attention_decode(out, *d[:6], hca, d[6], 1 / math.sqrt(K4),
                        mma=mma in (True, "unstaged"), staged=mma != "unstaged",
                        head_warps=mma in ("head warps", "bf16 tile"), bf16_tile=mma == "bf16 tile")
    assert rel_err(out.copy_to_host(), ref) <= 1e-4
