"""Hyper-connection kernels vs pocketfm.ops (simulator in CI, real GPU on the H200)."""
import numpy as np
import pytest
from numba import cuda

from pocketfm.kernels import hc

from .kernel_testing import THREADS, fresh_rng, poisoned, rel_err


def _inputs(rng, T, HC, D, M, n_scale):
    X = rng.standard_normal((T, HC, D)).astype(np.float32)
    fn = (rng.standard_normal((M, HC * D)) * 0.1).astype(np.float32)
    base = rng.standard_normal(M).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, n_scale).astype(np.float32)
    return X, fn, base, scale


def _post_inputs(rng, T, HC, D):
    """(f, post, comb): a sublayer's output and the HC post's coefficients."""
    f = rng.standard_normal((T, D)).astype(np.float32)
    post = rng.uniform(0, 2, (T, HC)).astype(np.float32)
    comb = rng.uniform(0, 1, (T, HC, HC)).astype(np.float32)
    return f, post, comb


def _f64(*arrays):
    return [a.astype(np.float64) for a in arrays]


@pytest.mark.parametrize("naive,HC", [(False, 4), (True, 4), (False, 3)])
def test_hc_pre(naive, HC):
    rng = fresh_rng()
    T, D, M = 2, 64, (2 + HC) * HC
    X, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, *_f64(X, fn, base, scale), 1e-6, 1e-6, 20)
    u, post, comb = poisoned((T, D)), poisoned((T, HC)), poisoned((T, HC, HC))
    hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
              threads=THREADS, naive=naive)
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4
    assert rel_err(post.copy_to_host(), ref_post) <= 1e-4
    assert rel_err(comb.copy_to_host(), ref_comb) <= 1e-4


@pytest.mark.parametrize("HC", [4, 3])
def test_hc_pre_with_side_stream(HC):
    """Decode with a side stream: u from _hc_pre_finish_u, post and comb from
    _hc_pre_finish_post (the partials in a workspace, not in out_u); D = 256 so that the split
    path runs."""
    from pocketfm.kernels import device

    rng = fresh_rng()
    T, D, M = 2, 256, (2 + HC) * HC
    X, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, *_f64(X, fn, base, scale), 1e-6, 1e-6, 20)
    u, post, comb = poisoned((T, D)), poisoned((T, HC)), poisoned((T, HC, HC))
    side = device.SideStream()
    hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
              threads=THREADS, side=side)
    side.join(0)
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4
    assert rel_err(post.copy_to_host(), ref_post) <= 1e-4
    assert rel_err(comb.copy_to_host(), ref_comb) <= 1e-4


@pytest.mark.parametrize("path,D", [("side", 256), ("side", 4 * THREADS), ("side", 4 * THREADS - 8),
                                    ("split", 256), ("naive", 256), ("mix", 256)])
def test_hc_pre_with_the_input_norm(path, D):
    """``norm=``: u's RMSNorm with the sublayer's weight too (fused into the u block on the
    side-stream path, a launch after it on the others); u itself is still written. On the side
    path D <= 4 x the block's threads takes the norm from u in registers (_collapse_norm), a
    wider D reads u back."""
    from pocketfm.kernels import device
    from pocketfm.kernels.norm_rope import rmsnorm_ref

    rng = fresh_rng()
    HC, T = 4, 2
    M = (2 + HC) * HC
    X, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    w = rng.standard_normal(D).astype(np.float32)
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, *_f64(X, fn, base, scale), 1e-6, 1e-6, 20)
    ref_n = np.empty((T, D))
    rmsnorm_ref(ref_n, ref_u, w, 1e-6, True)
    u, post, comb, un = poisoned((T, D)), poisoned((T, HC)), poisoned((T, HC, HC)), poisoned((T, D))
    side = device.SideStream() if path == "side" else None
    mix = poisoned(hc.hc_mix_shape(T, HC)) if path == "mix" else None
    how = dict(side=side, naive=path == "naive", mix=mix)
    hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
              threads=THREADS, norm=(un, cuda.to_device(w)), **how)
    if side is not None:
        side.join(0)
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4
    assert rel_err(un.copy_to_host(), ref_n) <= 1e-4
    assert rel_err(comb.copy_to_host(), ref_comb) <= 1e-4


@pytest.mark.parametrize("HC,prefetch", [(4, False), (4, True), (3, False)])
def test_the_u_blocks_norm_has_norm_rows_bits(HC, prefetch):
    """The side path's u block takes the norm from u in registers (_collapse_norm; with
    ``u_prefetch`` at HC = 4 the decode engine's _hc_pre_finish_u4, its loads issued before
    the partials): the same bits as an RMSNorm launch over the u it wrote, and u within 1e-4
    of the reference."""
    from pocketfm.kernels import device
    from pocketfm.kernels.norm_rope import rmsnorm

    rng = fresh_rng()
    T, D = 2, 4 * THREADS - 8
    M = (2 + HC) * HC
    X, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    w = cuda.to_device(rng.standard_normal(D).astype(np.float32))
    u, post, comb, un = poisoned((T, D)), poisoned((T, HC)), poisoned((T, HC, HC)), poisoned((T, D))
    side = device.SideStream()
    hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
              threads=THREADS, norm=(un, w), side=side, u_prefetch=prefetch)
    side.join(0)
    again = poisoned((T, D))
    rmsnorm(again, u, w, 1e-6, True, threads=THREADS)
    assert np.array_equal(un.copy_to_host(), again.copy_to_host())
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, *_f64(X, fn, base, scale), 1e-6, 1e-6, 20)
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4


@pytest.mark.parametrize("path", ["side", "split", "naive", "mix"])
def test_hc_pre_after_the_previous_post(path):
    """``post_from``: X is first made as the previous sublayer's hc_post (on the side-stream
    path inside the mix launch, _hc_post_mix_split; else an hc_post launch before), with
    post / comb read and then rewritten in the same buffers, as the decode engine runs it."""
    from pocketfm.kernels import device

    rng = fresh_rng()
    HC, T, D = 4, 2, 256
    M = (2 + HC) * HC
    Xp, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    f, post0, comb0 = _post_inputs(rng, T, HC, D)
    ref_X = np.empty((T, HC, D))
    hc.hc_post_ref(ref_X, *_f64(f, Xp, post0, comb0))
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, ref_X, *_f64(fn, base, scale), 1e-6, 1e-6, 20)
    X, u = poisoned((T, HC, D)), poisoned((T, D))
    post, comb = cuda.to_device(post0), cuda.to_device(comb0)
    side = device.SideStream() if path == "side" else None
    mix = poisoned(hc.hc_mix_shape(T, HC)) if path == "mix" else None
    how = dict(side=side, naive=path == "naive", mix=mix)
    hc.hc_pre(u, post, comb, X, *map(cuda.to_device, (fn, base, scale)), 1e-6, 1e-6, 20,
              threads=THREADS, post_from=(cuda.to_device(f), cuda.to_device(Xp), post, comb),
              **how)
    if side is not None:
        side.join(0)
    assert rel_err(X.copy_to_host(), ref_X) <= 1e-4
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4
    assert rel_err(post.copy_to_host(), ref_post) <= 1e-4
    assert rel_err(comb.copy_to_host(), ref_comb) <= 1e-4


def test_post_mix_with_its_loads_first_has_the_same_bits():
    """``mix_prefetch``: the decode engine's _hc_post_mix_split4 (every load issued before the
    post coefficients' barrier) writes the same X and the same mix partials, bit for bit, as
    _hc_post_mix_split, at the decode's own block (800 threads: a warp a mix row); the
    partials buffer is compared whole, so u, post and comb follow."""
    from pocketfm.kernels import device

    rng = fresh_rng()
    HC, T, D = 4, 1, 256
    M = (2 + HC) * HC
    Xp, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    f, post0, comb0 = _post_inputs(rng, T, HC, D)
    out = {}
    for prefetch in (False, True):
        X, part = poisoned((T, HC, D)), poisoned((T, D))
        splits = hc._mix(part, X, cuda.to_device(fn), M, 0, None,
                         (cuda.to_device(f), cuda.to_device(Xp), cuda.to_device(post0),
                          cuda.to_device(comb0)), prefetch)
        out[prefetch] = X.copy_to_host(), part.copy_to_host()[:, :(M + 1) * splits]
    ref_X = np.empty((T, HC, D))
    hc.hc_post_ref(ref_X, *_f64(f, Xp, post0, comb0))
    assert rel_err(out[True][0], ref_X) <= 1e-5
    assert np.array_equal(out[True][0], out[False][0])
    assert np.array_equal(out[True][1], out[False][1])


@pytest.mark.parametrize("T,D,after_post", [(2, 96, None), (1, 544, "whole"), (2, 64, 7),
                                             (1, 64, 8)])
def test_the_spread_u_block_from_the_gram_partials(T, D, after_post):
    """``u_gram``: the split mix also leaves the streams' Gram partials (_hc_mix_gram4) and u
    with its input norm comes from D / 512 blocks (_hc_pre_u_gram4), the norm's sum of squares
    as pre^T G pre: u, the norm, post and comb within 1e-4 of the reference, with and without
    the previous sublayer's post made in the mix (D = 544: two u blocks, the second short),
    its f whole or in 7 / 8 parts (the MoE's 6 routed rows and the shared one: the mix adds
    them, the shared row first, as moe.combine does)."""
    from pocketfm.kernels import device

    rng = fresh_rng()
    HC = 4
    M = (2 + HC) * HC
    X0, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    w = rng.standard_normal(D).astype(np.float32)
    post_from = None
    if after_post:
        f, post0, comb0 = _post_inputs(rng, T, HC, D)
        fd = f
        if after_post != "whole":  # in parts: the routed rows, then the shared one
            fd = rng.standard_normal((T, after_post, D)).astype(np.float32)
            f = fd[:, -1].copy()
            for j in range(after_post - 1):
                f += fd[:, j]
        ref_X = np.empty((T, HC, D))
        hc.hc_post_ref(ref_X, *_f64(f, X0, post0, comb0))
        X, post, comb = poisoned((T, HC, D)), cuda.to_device(post0), cuda.to_device(comb0)
        post_from = (cuda.to_device(fd), cuda.to_device(X0), post, comb)
    else:
        ref_X, X = X0.astype(np.float64), cuda.to_device(X0)
        post, comb = poisoned((T, HC)), poisoned((T, HC, HC))
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, ref_X, *_f64(fn, base, scale), 1e-6, 1e-6, 20)
    ref_n = ref_u / np.sqrt((ref_u ** 2).mean(1, keepdims=True) + 1e-6) * w
    u, un = poisoned((T, D)), poisoned((T, D))
    side = device.SideStream()
    hc.hc_pre(u, post, comb, X, *map(cuda.to_device, (fn, base, scale)), 1e-6, 1e-6, 20,
              side=side, norm=(un, cuda.to_device(w)), post_from=post_from, u_gram=True)
    side.join(0)
    assert rel_err(X.copy_to_host(), ref_X) <= 1e-5
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4
    assert rel_err(un.copy_to_host(), ref_n) <= 1e-4
    assert rel_err(post.copy_to_host(), ref_post) <= 1e-4
    assert rel_err(comb.copy_to_host(), ref_comb) <= 1e-4


def test_hc_pre_refuses_f_in_parts_off_the_gram_path():
    rng = fresh_rng()
    T, HC, D = 1, 4, 64
    X, fn, base, scale = _inputs(rng, T, HC, D, (2 + HC) * HC, 3)
    f, post, comb = map(cuda.to_device, _post_inputs(rng, T, HC, D))
    u, un = poisoned((T, D)), poisoned((T, D))
    with pytest.raises(ValueError, match="in parts"):
        hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
                  norm=(un, cuda.to_device(np.ones(D, np.float32))),
                  post_from=(poisoned((T, 7, D)), cuda.to_device(X), post, comb))
    from pocketfm.kernels import device  # more parts than the mix adds: refused, not dropped

    with pytest.raises(ValueError, match=f"9 parts, at most {hc.MAX_PARTS}"):
        hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
                  norm=(un, cuda.to_device(np.ones(D, np.float32))), side=device.SideStream(),
                  u_gram=True, post_from=(poisoned((T, 9, D)), cuda.to_device(X), post, comb))


def test_the_gram_mix_leaves_the_streams_gram_partials():
    """_hc_mix_gram4's partials summed over its blocks: the mix rows, the sum of squares and
    the 10 Gram entries of X[t] (diagonal first, then (0,1) (0,2) (0,3) (1,2) (1,3) (2,3))."""
    rng = fresh_rng()
    T, HC, D = 2, 4, 64
    M = (2 + HC) * HC
    X, fn, _, _ = _inputs(rng, T, HC, D, M, 3)
    splits = D // hc.GRAM_COLS
    part = poisoned((T, (M + 1 + hc.GRAM) * splits))
    hc._mix_gram(part, cuda.to_device(X), cuda.to_device(fn), 0)
    got = part.copy_to_host().reshape(T, M + 1 + hc.GRAM, splits).sum(2)
    x = X.astype(np.float64)
    pairs = [(0, 0), (1, 1), (2, 2), (3, 3), (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    want = np.concatenate([x.reshape(T, -1) @ fn.T.astype(np.float64),
                           (x ** 2).sum((1, 2))[:, None],
                           np.stack([(x[:, a] * x[:, b]).sum(1) for a, b in pairs], 1)], 1)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("T,HC,D", [(3, 4, 64), (21, 4, 40), (6, 3, 24)])
def test_hc_pre_chunk_mix(T, HC, D):
    """A prefill chunk: the mix as one GEMM over the tokens into the ``mix`` workspace (column
    slices' partials), then the per-token finish. T = 21: two token groups, the second's last
    warps past T; D = 40: slices of 64 columns, the last one short (160 columns); HC = 3: the
    15-row build."""
    rng = fresh_rng()
    M = (2 + HC) * HC
    X, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, *_f64(X, fn, base, scale), 1e-6, 1e-6, 20)
    u, post, comb = poisoned((T, D)), poisoned((T, HC)), poisoned((T, HC, HC))
    mix = poisoned(hc.hc_mix_shape(T, HC))
    hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
              threads=THREADS, mix=mix)
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4
    assert rel_err(post.copy_to_host(), ref_post) <= 1e-4
    assert rel_err(comb.copy_to_host(), ref_comb) <= 1e-4
    # the slices' partials: the mix rows and the sums of squares of flatten(X[t])
    flat = X.reshape(T, HC * D).astype(np.float64)
    want = np.concatenate([flat @ fn.T.astype(np.float64), (flat ** 2).sum(1)[:, None]], 1)
    assert rel_err(mix.copy_to_host().sum(0), want) <= 1e-5


def test_hc_pre_rejects_a_mix_workspace_of_another_shape():
    rng = fresh_rng()
    T, HC, D = 2, 4, 64
    X, fn, base, scale = _inputs(rng, T, HC, D, (2 + HC) * HC, 3)
    u, post, comb = poisoned((T, D)), poisoned((T, HC)), poisoned((T, HC, HC))
    with pytest.raises(ValueError, match="mix workspace"):
        hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 20,
                  mix=poisoned((T, (2 + HC) * HC)))


def test_hc_pre_tiny_hidden_falls_back():
    """D too small to park the partials in out_u: the launcher runs the naive kernel."""
    rng = fresh_rng()
    T, HC, D = 1, 2, 8
    M = (2 + HC) * HC
    X, fn, base, scale = _inputs(rng, T, HC, D, M, 3)
    ref_u, ref_post, ref_comb = np.empty((T, D)), np.empty((T, HC)), np.empty((T, HC, HC))
    hc.hc_pre_ref(ref_u, ref_post, ref_comb, *_f64(X, fn, base, scale), 1e-6, 1e-6, 3)
    u, post, comb = poisoned((T, D)), poisoned((T, HC)), poisoned((T, HC, HC))
    hc.hc_pre(u, post, comb, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, 3,
              threads=THREADS)
    assert rel_err(u.copy_to_host(), ref_u) <= 1e-4
    assert rel_err(comb.copy_to_host(), ref_comb) <= 1e-4


@pytest.mark.parametrize("naive", [False, True])
def test_hc_head(naive):
    rng = fresh_rng()
    T, HC, D = 2, 4, 64
    X, fn, base, scale = _inputs(rng, T, HC, D, HC, 1)
    ref = np.empty((T, D))
    hc.hc_head_ref(ref, *_f64(X, fn, base, scale), 1e-6, 1e-6)
    u = poisoned((T, D))
    hc.hc_head(u, *map(cuda.to_device, (X, fn, base, scale)), 1e-6, 1e-6, threads=THREADS,
               naive=naive)
    assert rel_err(u.copy_to_host(), ref) <= 1e-4


@pytest.mark.parametrize("naive,post_blocks", [(False, None), (True, None), (False, 2)])
def test_hc_post(naive, post_blocks, monkeypatch):
    """D = 40 not a multiple of the block; ``post_blocks`` 2: the prefill chunk's launch shape
    (POST_BLOCKS // T below D's blocks: a block a token, its threads striding over D)."""
    if post_blocks:
        monkeypatch.setattr(hc, "POST_BLOCKS", post_blocks)
    rng = fresh_rng()
    T, HC, D = 2, 4, 40
    f = rng.standard_normal((T, D)).astype(np.float32)
    X = rng.standard_normal((T, HC, D)).astype(np.float32)
    post = rng.uniform(0, 2, (T, HC)).astype(np.float32)
    comb = rng.uniform(0, 1, (T, HC, HC)).astype(np.float32)
    ref = np.empty((T, HC, D))
    hc.hc_post_ref(ref, *_f64(f, X, post, comb))
    out = poisoned((T, HC, D))
    hc.hc_post(out, *map(cuda.to_device, (f, X, post, comb)), threads=THREADS, naive=naive)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4
