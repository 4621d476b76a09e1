"""Low-bit GEMV kernels (Q2_K, Q4_K, IQ2_XXS, MXFP4) against their NumPy references.

Packing is checked lossless (unpack gives the GGUF bytes back, and the reference equals
quants.dequantize(raw) @ x in float64); then every kernel runs on fresh random blocks at tiny
shapes: one or two super-blocks per row, odd row counts, 3 stacked experts picked by ids.
"""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm import quants
from pocketfm.kernels import gemv_lowbit as gl
from pocketfm.quants import GGMLType

TYPES = {"q2_k": GGMLType.Q2_K, "q4_k": GGMLType.Q4_K, "iq2_xxs": GGMLType.IQ2_XXS,
         "mxfp4": GGMLType.MXFP4}
UNPACK = {GGMLType.Q2_K: gl.unpack_q2_k, GGMLType.Q4_K: gl.unpack_q4_k,
          GGMLType.IQ2_XXS: gl.unpack_iq2_xxs, GGMLType.MXFP4: gl.unpack_mxfp4}
LAUNCH = {GGMLType.Q2_K: gl.gemv_q2_k, GGMLType.Q4_K: gl.gemv_q4_k,
          GGMLType.IQ2_XXS: gl.gemv_iq2_xxs, GGMLType.MXFP4: gl.gemv_mxfp4}


def _case(qtype, E, N, K, T, with_ids, bound=False):
    """Random raw blocks, their packed device weight, x, ids and the float64 reference (and, with
    ``bound``, the dp4a kernels' error bound per output, see test_dp4a_slots)."""
    rng = fresh_rng()
    raw = quants.random_blocks(qtype, (E, N, K), rng, std=0.05)
    w = gl.PACKERS[qtype](raw, N, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    ids = rng.integers(0, E, T).astype(np.int32) if with_ids else None
    ref = np.empty((T, N), np.float64)
    gl.REFS[qtype](ref, w, x, ids)
    dev = (w.to_device(), cuda.to_device(x), None if ids is None else cuda.to_device(ids), ref)
    if not bound:
        return dev
    W = np.abs(quants.dequantize(raw, qtype).astype(np.float64))[ids if with_ids else [0] * T]
    err = DP4A_X_STEP * np.abs(x).max(axis=1)[:, None] * W.sum(axis=2)  # [T, N]
    return dev + (err,)


@pytest.mark.parametrize("name", TYPES)
def test_pack_is_lossless_and_ref_is_dequantize(name):
    qtype = TYPES[name]
    rng = fresh_rng()
    E, N, K, T = 3, 5, 512, 4
    raw = quants.random_blocks(qtype, (E, N, K), rng, std=0.05)
    w = gl.PACKERS[qtype](raw, N, K)
    assert all(p.flags.c_contiguous and p.shape[:2] == (E, N) for p in w.planes)
    np.testing.assert_array_equal(UNPACK[qtype](w), raw)
    x = rng.standard_normal((T, K)).astype(np.float32)
    ids = rng.integers(0, E, T).astype(np.int32)
    out = np.empty((T, N), np.float64)
    gl.REFS[qtype](out, w, x, ids)
    W = quants.dequantize(raw, qtype).astype(np.float64)  # [E, N, K]
    expect = np.einsum("tnk,tk->tn", W[ids], x.astype(np.float64))
    np.testing.assert_allclose(out, expect, rtol=1e-12, atol=1e-12)
    # a 2-D weight (no expert dim) packs as one expert
    w1 = gl.PACKERS[qtype](raw[0], N, K)
    assert w1.experts == 1
    np.testing.assert_array_equal(UNPACK[qtype](w1)[0], raw[0])


@pytest.mark.parametrize("name", TYPES)
def test_block_per_row(name):
    qtype = TYPES[name]
    spec = gl.SPECS[qtype]
    N, K, T = 5, 512, 3
    w, x, ids, ref = _case(qtype, 3, N, K, T, True)
    out = poisoned((T, N))
    gl._launch(spec, out, w, x, ids, 0, THREADS, "naive")
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


# (N, K, T, ids): odd row counts, one and two super-blocks, with and without ids; the 64-column
# slot types run 4 or 8 slots a row, the 32-column ones 8 or 16. 33 rows over 3 tokens take two
# row blocks per token in the simulator, the second holding one row.
DECODE_SHAPES = [(33, 256, 3, True), (5, 512, 1, False)]


# The dp4a decode kernels quantise x to int16 per 16-byte slot (|q| <= 32000 of the slot's max),
# so each x element is off by at most half a step, max|x| / 64000: an output may be off by that
# times Σ|w| of its row — not float32-exact. At V4 shapes that is rel 2e-5 (H200), but on tiny
# random rows with cancellation the plain rel-L2 occasionally passes 1e-4 (seen: 1.5e-4, about
# 1 run in 25), so the test checks the kernel's own bound per output, plus rel-L2 <= 1e-3.
DP4A_X_STEP = 1.0 / 64000


@pytest.mark.parametrize("name", TYPES)
def test_dp4a_slots(name):
    qtype = TYPES[name]
    spec = gl.SPECS[qtype]
    for N, K, T, with_ids in DECODE_SHAPES:
        w, x, ids, ref, err = _case(qtype, 3, N, K, T, with_ids, bound=True)
        out = poisoned((T, N))
        gl._launch(spec, out, w, x, ids, 0, THREADS, "decode")
        got = out.copy_to_host()
        assert rel_err(got, ref) <= 1e-3, (N, K, T)
        assert np.all(np.abs(got - ref) <= err + 1e-6 * np.abs(ref) + 1e-7), (N, K, T)


@pytest.mark.parametrize("name", TYPES)
def test_shared_x_row_equals_its_copies(name):
    """With ids, x [1, K] serves every id (the MoE's routed gate/up at decode, no broadcast
    launch): the same bits as k copies of the row, whose path test_dp4a_slots checks against
    the reference. The dp4a kernel for every type; the naive one (slow here) for IQ2_XXS."""
    qtype = TYPES[name]
    spec = gl.SPECS[qtype]
    N, K, T = 9, 256, 3
    w, x1, _, _ = _case(qtype, 3, N, K, 1, False)
    ids = cuda.to_device(fresh_rng().integers(0, 3, T).astype(np.int32))
    x_rep = cuda.to_device(np.repeat(x1.copy_to_host(), T, axis=0))
    for how in ("decode", "naive") if qtype == GGMLType.IQ2_XXS else ("decode",):
        one, rep = poisoned((T, N)), poisoned((T, N))
        gl._launch(spec, one, w, x1, ids, 0, THREADS, how)
        gl._launch(spec, rep, w, x_rep, ids, 0, THREADS, how)
        assert np.array_equal(one.copy_to_host(), rep.copy_to_host()), how


@pytest.mark.parametrize("name", TYPES)
def test_gemv_swiglu_equals_swiglu_then_gemv(name):
    """The down projection with the SwiGLU made in its x preparation: the same bits as
    moe.swiglu_fused into h and then the decode GEMV (the two launches it replaces), with and
    without the clamp (gate/up wide enough that it bites, silu's tails included), with ids and
    without (one weight, as for the shared expert); and within the dp4a kernels' bound
    (test_dp4a_slots) of the float64 reference gemv_swiglu_ref."""
    from pocketfm.kernels import moe
    qtype = TYPES[name]
    spec = gl.SPECS[qtype]
    rng = fresh_rng()
    E, N, F, T = 3, 9, 256, 3
    raw = quants.random_blocks(qtype, (E, N, F), rng, std=0.05)
    host = gl.PACKERS[qtype](raw, N, F)
    w = host.to_device()
    gu = rng.normal(0.0, 8.0, (T, 2 * F)).astype(np.float32)
    gu[0, :3] = [-200.0, 200.0, 0.0]
    wts = rng.uniform(0.1, 1.0, T).astype(np.float32)
    ids = rng.integers(0, E, T).astype(np.int32)
    d_gu, d_wts, d_ids = cuda.to_device(gu), cuda.to_device(wts), cuda.to_device(ids)
    W = np.abs(quants.dequantize(raw, qtype).astype(np.float64))  # [E, N, F]
    for clamp, with_ids in ((10.0, True), (0.0, False)):
        fused, h, unfused = poisoned((T, N)), poisoned((T, F)), poisoned((T, N))
        i, d_i = (ids, d_ids) if with_ids else (np.zeros(T, np.int32), None)  # None: expert 0
        gl.gemv_swiglu(fused, w, d_gu, d_wts, clamp, d_i, threads=THREADS)
        moe.swiglu_fused(h, d_gu, d_wts, clamp, threads=THREADS)
        gl._launch(spec, unfused, w, h, d_i, 0, THREADS, "decode")
        got = fused.copy_to_host()
        assert np.array_equal(got, unfused.copy_to_host()), clamp
        ref = np.empty((T, N))
        gl.gemv_swiglu_ref(ref, host, gu.astype(np.float64), wts.astype(np.float64), clamp, i)
        err = DP4A_X_STEP * np.abs(h.copy_to_host()).max(axis=1)[:, None] * W[i].sum(axis=2)
        assert rel_err(got, ref) <= 1e-3, clamp
        assert np.all(np.abs(got - ref) <= err + 1e-6 * np.abs(ref) + 1e-7), clamp


def test_flat_offset_build_gives_the_same_bits():
    """gemv_lowbit.FLAT_DECODE's Q2_K build (quant words and scales read by uint32 flat
    offsets) reads the same words as the (e, n, j)-indexed kernel: the same outputs, bit for
    bit, with ids (three experts, rows of two super-blocks, an odd row count) and without."""
    rng = fresh_rng()
    E, N, F, T = 3, 9, 512, 3
    raw = quants.random_blocks(GGMLType.Q2_K, (E, N, F), rng, std=0.05)
    w = gl.PACKERS[GGMLType.Q2_K](raw, N, F).to_device()
    d_gu = cuda.to_device(rng.normal(0.0, 2.0, (T, 2 * F)).astype(np.float32))
    d_wts = cuda.to_device(rng.uniform(0.1, 1.0, T).astype(np.float32))
    for d_ids in (cuda.to_device(rng.integers(0, E, T).astype(np.int32)), None):
        base, flat = poisoned((T, N)), poisoned((T, N))
        gl.gemv_swiglu(base, w, d_gu, d_wts, 10.0, d_ids, threads=THREADS)
        gl.gemv_swiglu(flat, w, d_gu, d_wts, 10.0, d_ids, threads=THREADS, flat=True)
        assert np.array_equal(flat.copy_to_host(), base.copy_to_host())


@pytest.mark.parametrize("name", TYPES)
def test_smem_tiles(name):
    qtype = TYPES[name]
    spec = gl.SPECS[qtype]
    N, K, T = 33, 256, 8  # more tokens than a 4 x 4 tile covers in the simulator, odd rows
    w, x, _, ref = _case(qtype, 1, N, K, T, False)
    out = poisoned((T, N))
    gl._launch(spec, out, w, x, None, 0, THREADS, "gemm")
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_launcher_picks_by_tokens():
    """The public launchers: decode for a few tokens or ids, the GEMM for a batch."""
    qtype = GGMLType.IQ2_XXS
    for T, with_ids in ((1, False), (8, False)):
        w, x, ids, ref, err = _case(qtype, 1, 9, 256, T, with_ids, bound=True)
        out = poisoned((T, 9))
        LAUNCH[qtype](out, w, x, ids, threads=THREADS)
        got = out.copy_to_host()
        if T == 1:  # the dp4a decode kernel: its own error bound (see test_dp4a_slots)
            assert np.all(np.abs(got - ref) <= err + 1e-6 * np.abs(ref) + 1e-7)
        else:  # the float32 GEMM
            assert rel_err(got, ref) <= 1e-4


def test_decode_config_bounds():
    spec = gl.SPECS[GGMLType.IQ2_XXS]
    nt = gl.decode_threads(spec, 4096, 256)
    rows_per_block, grid = gl.decode_config(spec, 6, 2048, 4096, nt, resident=264)
    assert nt == 256 and rows_per_block % (nt // 64 * gl.R_ROWS) == 0
    assert grid[1] == 6 and grid[0] * 6 <= 264 and grid[0] * rows_per_block >= 2048
    assert gl.decode_threads(spec, 64 * 3, 256) is None  # 3 slots a row: not a power of 2
    assert gl.decode_threads(spec, 256, 256) // 4 <= 32  # at most a warp of lanes per slot
