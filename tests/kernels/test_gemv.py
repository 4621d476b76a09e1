"""gemv family: packing is lossless, and every kernel equals the NumPy reference (float64).

Shapes are tiny and odd (rows and tokens that divide no tile, K tails in the tiled GEMM); ``method``
and ``split_k`` force each kernel and the split-K path, which real shapes reach on their own.
"""
import numpy as np
import pytest
from numba import cuda

from .kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm.kernels import gemv
from pocketfm.quants import GGMLType, dequantize, float32_to_bf16, random_blocks

TYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "bf16": GGMLType.BF16, "q8_0": GGMLType.Q8_0}


def _raw(name, shape, rng):
    """GGUF-style raw data: typed arrays for F32 / F16 (as GGUFReader returns them), bytes else."""
    raw = random_blocks(TYPES[name], shape, rng, std=0.05)
    if name == "f32":
        return raw.view(np.float32)
    if name == "f16":
        return raw.view(np.float16)
    return raw


def _case(name, E, N, K, T, with_ids, rng):
    raw = _raw(name, (E, N, K) if E > 1 else (N, K), rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    ids = rng.integers(0, E, T).astype(np.int32) if with_ids else None
    W = dequantize(raw, TYPES[name]).astype(np.float64).reshape(E, N, K)
    ref = np.stack([W[0 if ids is None else ids[t]] @ x[t] for t in range(T)])
    return gemv.pack_weight(raw, TYPES[name], N, K), x, ids, ref


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("E", [1, 3])
def test_pack_is_lossless_and_ref_matches_dequantize(name, E):
    rng = fresh_rng()
    N, K, T = 5, 64, 3
    w, x, ids, ref = _case(name, E, N, K, T, E > 1, rng)
    assert (w.qtype, w.rows, w.cols, w.experts) == (TYPES[name], N, K, E)
    raw_bytes = np.asarray(_raw(name, (E, N, K), rng)).view(np.uint8)
    # the planes hold exactly the GGUF bytes' information: same size, same dequantised values
    w2 = gemv.pack_weight(raw_bytes, TYPES[name], N, K)
    assert w2.nbytes == raw_bytes.nbytes
    assert np.array_equal(gemv._dense(w2), dequantize(raw_bytes, TYPES[name]).reshape(E, N, K))
    out = np.empty((T, N))
    gemv.gemv_ref(out, w, x, ids)
    assert rel_err(out, ref) <= 1e-12


def test_bf16_accepts_uint16_raw():
    rng = fresh_rng()
    vals = rng.standard_normal((4, 32)).astype(np.float32)
    w = gemv.pack_bf16(float32_to_bf16(vals), 4, 32)
    assert np.array_equal(gemv._dense(w)[0], dequantize(float32_to_bf16(vals), GGMLType.BF16))


# (method, E, N, K, T, ids, split_k): every kernel, expert-indexed or not, odd sizes
RUNS = [
    ("naive", 3, 6, 64, 2, True, None),
    ("rows", 3, 37, 64, 2, True, None),  # thread per row (simulator: 32 threads stride 37 rows)
    ("rows", 1, 9, 96, 3, False, None),
    ("decode", 1, 7, 256, 1, False, 2),  # split-K across 2 warps: the shared-memory sum
    ("decode", 1, 23, 128, 2, False, None),  # more row groups than blocks: grid-stride loop
    ("decode", 1, 11, 64, 4, False, None),
    ("decode", 3, 10, 128, 2, True, None),
    ("dp4a", 1, 7, 256, 1, False, 2),  # Q8_0 only: dp4a on int8 limbs of x
    ("dp4a", 3, 10, 128, 2, True, None),
    ("batched", 1, 70, 96, 37, False, None),  # two row tiles and two token tiles
    ("batched", 3, 19, 96, 7, True, None),
    ("batched", 1, 70, 160, 37, False, 3),  # K in 3 splits (the last one short), then summed
    ("batched", 3, 19, 128, 7, True, 2),
]


@pytest.mark.parametrize("name,method,E,N,K,T,with_ids,split_k",
                         [(n, *r) for r in RUNS for n in TYPES if r[0] != "dp4a" or n == "q8_0"])
def test_kernel_matches_reference(name, method, E, N, K, T, with_ids, split_k):
    if name != "q8_0" and method == "batched":
        K -= 24  # a K tail that is not a whole TK step (Q8_0 rows are whole 32-blocks)
    rng = fresh_rng()
    w, x, ids, ref = _case(name, E, N, K, T, with_ids, rng)
    out = poisoned((T, N))
    ids_d = None if ids is None else cuda.to_device(ids)
    launch = getattr(gemv, f"gemv_{name}")
    launch(out, w.to_device(), cuda.to_device(x), ids_d, threads=THREADS, method=method,
           split_k=split_k)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


@pytest.mark.parametrize("K", [256, 4096, 96])
def test_q8_0_limbs_with_the_norm_then_the_dp4a_kernel(K):
    """q8_0_limbs(norm=): x's RMSNorm (with its weight) written out and its limbs in one launch
    (four elements a thread), then gemv_q8_0(limbs=) runs the dp4a kernel alone on them: both
    against NumPy, and the limb words are exactly those q8_0_limbs makes of the normed x.
    K = 96: 24 threads, a warp not all busy; 4096: the largest K (1,024 threads)."""
    from pocketfm.kernels.norm_rope import rmsnorm_ref

    rng = fresh_rng()
    N = 9
    w, x, _, _ = _case("q8_0", 1, N, K, 1, False, rng)
    nw = rng.standard_normal(K).astype(np.float32)
    ref_n = np.empty((1, K))
    rmsnorm_ref(ref_n, x.astype(np.float64), nw.astype(np.float64), 1e-6, True)
    ref = np.empty((1, N))
    gemv.gemv_q8_0_ref(ref, w, ref_n)
    xn, out = poisoned((1, K)), poisoned((1, N))
    xl = gemv.q8_0_limbs(cuda.to_device(x), norm=(xn, cuda.to_device(nw), 1e-6),
                         name="test limbs")
    gemv.gemv_q8_0(out, w.to_device(), None, limbs=xl, threads=THREADS)
    assert rel_err(xn.copy_to_host(), ref_n) <= 1e-5
    assert rel_err(out.copy_to_host(), ref) <= 1e-4
    plain = gemv.q8_0_limbs(xn, name="test limbs, plain")
    assert np.array_equal(xl.copy_to_host(), plain.copy_to_host())


def test_dp4a_kernel_on_limbs_of_a_row_per_id():
    """gemv_q8_0(limbs=, ids): row t of the limbs is token t's x (attn_output_a: a group's
    rows of o against that group's weights), the dp4a kernel alone, against NumPy."""
    rng = fresh_rng()
    E, N, K, T = 3, 10, 128, 4
    w, x, ids, ref = _case("q8_0", E, N, K, T, True, rng)
    out = poisoned((T, N))
    xl = gemv.q8_0_limbs(cuda.to_device(x), name="test limbs, ids")
    gemv.gemv_q8_0(out, w.to_device(), None, cuda.to_device(ids), limbs=xl, threads=THREADS)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


@pytest.mark.parametrize("method,name", [("dp4a", "q8_0"), ("decode", "f16")])
def test_the_decode_grids_in_shares_of_a_wave_give_the_same_bits(method, name):
    """grid_waves(share): the persistent decode kernels' grids get share x a wave of blocks
    (the simulator's wave: 2 a grid row), and the grid-stride loop gives every row group a
    block all the same: the outputs of half a wave and of two waves are those of one, bit for
    bit, and the grid is what the share asks."""
    rng = fresh_rng()
    w, x, ids, ref = _case(name, 3, 37, 128, 2, True, rng)
    wd, xd, idd = w.to_device(), cuda.to_device(x), cuda.to_device(ids)
    outs, grids = {}, {}
    real_wave = gemv._wave
    for share in (1, 0.5, 2):
        out = poisoned((2, 37))

        def wave(*a):
            grids[share] = real_wave(*a)
            return grids[share]
        gemv._wave = wave
        try:
            with gemv.grid_waves(share):
                getattr(gemv, f"gemv_{name}")(out, wd, xd, idd, threads=THREADS, method=method)
        finally:
            gemv._wave = real_wave
        outs[share] = out.copy_to_host()
    assert grids == {1: 2, 0.5: 1, 2: 4}
    assert rel_err(outs[1], ref) <= 1e-4
    assert np.array_equal(outs[0.5], outs[1]) and np.array_equal(outs[2], outs[1])


def test_grid_waves_or_not_keeps_the_share_in_force_for_none():
    """grid_waves_or_not (the decode engine's side streams' share): None leaves the share in
    force, a number sets it inside, and both restore it after."""
    with gemv.grid_waves(0.5):
        with gemv.grid_waves_or_not(None):
            assert gemv._STATE["waves"] == 0.5
        with gemv.grid_waves_or_not(0.25):
            assert gemv._STATE["waves"] == 0.25
        assert gemv._STATE["waves"] == 0.5


@pytest.mark.parametrize("T,K", [(1, 4096), (2, 96), (3, 1024)])
def test_limbs_four_threads_a_chunk_are_the_serial_kernels_words(T, K):
    """_q8_0_x_limbs_words (the default) writes exactly the words of _q8_0_x_limbs (a thread a
    chunk): values over several magnitudes, an all-zero chunk (scale 0) included."""
    rng = fresh_rng()
    x = (rng.standard_normal((T, K)) * np.exp(rng.uniform(-8, 8, (T, K)))).astype(np.float32)
    x[0, 16:32] = 0
    xd = cuda.to_device(x)
    words = {}
    for name in ("serial", "words"):
        with gemv.limbs_kernel(name):
            words[name] = gemv.q8_0_limbs(xd, name=f"test limbs {name}").copy_to_host()
    assert np.array_equal(words["words"], words["serial"])
    assert words["words"][0, gemv.XLW + 12] == 0  # the zero chunk's scale


@pytest.mark.parametrize("name,K", [("f16", 1024), ("bf16", 200), ("f32", 1024)])
def test_the_decode_kernel_normalising_its_x(name, K, monkeypatch):
    """gemv(norm=(nw, eps)) = W · (rmsnorm(x) * nw) (float64), each warp normalising the x it
    holds: V4's idx_q_b shape of K (1024, the most one warp holds for F16 / F32) and a K
    with a partial last chunk; within rounding of an RMSNorm launch and then the GEMV."""
    from pocketfm.kernels.norm_rope import rmsnorm

    monkeypatch.setitem(gemv._STATE, "sim_rows", False)
    rng = fresh_rng()
    N = 9
    w, x, _, _ = _case(name, 1, N, K, 1, False, rng)
    nw = rng.uniform(0.5, 1.5, K).astype(np.float32)
    xn = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean() + 1e-6) * nw
    ref = gemv._dense(w)[0].astype(np.float64) @ xn[0]
    assert gemv.takes_norm(w)
    dw, dx, dn = w.to_device(), cuda.to_device(x), cuda.to_device(nw)
    out = poisoned((1, N))
    gemv.gemv(out, dw, dx, norm=(dn, 1e-6), threads=THREADS)
    got = out.copy_to_host()
    assert rel_err(got, ref[None]) <= 1e-5
    two = poisoned((1, N))
    normed = poisoned((1, K))
    rmsnorm(normed, dx, dn, 1e-6, True, threads=THREADS)
    gemv.gemv(two, dw, normed, threads=THREADS)
    assert rel_err(got, two.copy_to_host()) <= 1e-5


def test_takes_norm_where_one_warp_holds_the_row(monkeypatch):
    monkeypatch.setitem(gemv._STATE, "sim_rows", False)

    def q(cols, qtype=GGMLType.F16, E=1):
        return gemv.QWeight(qtype, 64, cols, E, ())
    assert gemv.takes_norm(q(1024)) and gemv.takes_norm(q(1024, GGMLType.F32))
    assert not gemv.takes_norm(q(2048))  # two warps a row: neither holds the whole x
    assert not gemv.takes_norm(q(1024, GGMLType.Q8_0))
    assert not gemv.takes_norm(q(1024), T=2)


def test_takes_limbs_only_for_the_dp4a_kernel(monkeypatch):
    """The decode folds its q_a norm into q_b's limbs only where q_b runs the dp4a kernel."""
    monkeypatch.setitem(gemv._STATE, "sim_rows", False)  # (an engine test may have set it)

    def q(rows, cols, qtype=GGMLType.Q8_0, E=1):
        return gemv.QWeight(qtype, rows, cols, E, ())
    big = gemv.DP4A_MIN_ELEMENTS // 1024
    assert gemv.takes_limbs(q(big, 1024))
    assert not gemv.takes_limbs(q(big // 2, 1024))  # under the dp4a size: the float kernel
    assert not gemv.takes_limbs(q(big, 1024, GGMLType.F16))
    assert not gemv.takes_limbs(q(big, 1024, E=8))  # expert-indexed
    assert gemv.takes_limbs(q(big // 8, 1024, E=8), grouped=True)  # attn_output_a's groups
    assert not gemv.takes_limbs(q(big // 16, 1024, E=8), grouped=True)
    assert gemv.takes_limbs(q(big, 1024), norm=True)  # V4-Flash's q_b: K = 1024
    assert gemv.takes_limbs(q(big // 8, 8192)) and not gemv.takes_limbs(q(big // 8, 8192), True)
    monkeypatch.setitem(gemv._STATE, "sim_rows", gemv.SIMULATOR)
    assert gemv.takes_limbs(q(big, 1024)) != gemv.SIMULATOR  # the simulated engine: rows


def test_dispatcher_picks_by_tokens_and_type():
    rng = fresh_rng()
    for T in (2, 5):  # decode kernel, then the tiled GEMM
        w, x, ids, ref = _case("q8_0", 1, 9, 64, T, False, rng)
        out = poisoned((T, 9))
        gemv.gemv(out, w.to_device(), cuda.to_device(x), threads=THREADS)
        assert rel_err(out.copy_to_host(), ref) <= 1e-4
    with pytest.raises(ValueError, match="no GEMV"):
        gemv._by_type(GGMLType.I32, "pack_{}")
