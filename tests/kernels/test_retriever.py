"""Memory Indexer scorer kernels vs memory/scorer.py (simulator in CI; a GPU with CUDASIM=0).

The query path rounds q to bf16 twice. The GEMVs sum in another order than NumPy, so a q element
within a few float32 ulps of a bf16 rounding boundary can round the other way on the device: the
query checks allow rare one-ulp flips, and rope_bf16 itself is compared on identical inputs.
"""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm.kernels import gemv, retriever as rt
from pocketfm.kernels.device import SIMULATOR
from pocketfm.kernels.indexer import random_packed_keys
from pocketfm.kernels.kvpack import unpack_index_key_ref
from pocketfm.memory.checkpoint import Retriever, RetrieverGeometry, RetrieverLayer
from pocketfm.memory.scorer import retriever_logits_keys_ref, retriever_query_ref
from pocketfm.numerics import hadamard_matrix, rope_frequencies, rope_tables

D, RANK = 64, 32


@pytest.fixture(autouse=True, scope="module")
def rows_gemv_in_simulator():
    """Thread-per-row GEMVs in the simulator (as the engine's simulator runs; the decode
    kernels have their own tests); the previous setting restored after this module."""
    prev = gemv._STATE.get("sim_rows", False)
    gemv.simulator_prefers_rows(True)
    yield
    gemv.simulator_prefers_rows(prev)


def random_layer(rng, H, DI, layer=0):
    def rand(*shape, fan_in=1):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    return RetrieverLayer(layer, layer, rand(RANK, D, fan_in=D), 1 + 0.2 * rand(RANK),
                          rand(H * DI, RANK, fan_in=RANK), rand(H, D, fan_in=D))


def tables(R, pos):
    return rope_tables(rope_frequencies(R, 160000.0, 16.0, 65536), [pos], np.float32)


def check_query(q, ref, bf16):
    """q, ref [H, DI]. Undo the (self-inverse) Hadamard, then: every element within 1e-4 of the
    head's scale, except (bf16 only) < 1% that differ by a flipped bf16 rounding — at most one
    bf16 ulp (2^-7 relative) before RoPE and one after, so < 2^-6 of the head's largest value."""
    Hm = hadamard_matrix(q.shape[1])
    d = np.abs(q.astype(np.float64) @ Hm - ref.astype(np.float64) @ Hm)
    scale = np.abs(ref.astype(np.float64) @ Hm).max(axis=1, keepdims=True)
    off = d > 1e-4 * scale
    if not bf16:
        assert not off.any() and rel_err(q, ref) <= 1e-4
        return
    assert off.mean() < 0.01 and np.all(d <= 2.0 ** -6 * scale)


@pytest.mark.parametrize("H, DI, R, bf16", [(16, 64, 32, False), (16, 64, 32, True),
                                            (16, 128, 64, True)])
def test_retriever_query(H, DI, R, bf16):
    rng = fresh_rng()
    host = random_layer(rng, H, DI)
    x = rng.standard_normal(D).astype(np.float32)
    cos, sin = tables(R, int(rng.integers(0, 1 << 20)))
    q_ref, w_ref = np.empty((H, DI), np.float32), np.empty(H, np.float32)
    retriever_query_ref(q_ref, w_ref, x, host, cos, sin, hadamard_matrix(DI), bf16)
    layer = rt.DeviceRetrieverLayer.from_host(host)
    q, w = poisoned((H, DI)), poisoned(H)
    rt.retriever_query(q, w, cuda.to_device(x), layer, cuda.to_device(cos), cuda.to_device(sin),
                       hadamard_matrix(DI), bf16, threads=THREADS)
    check_query(q.copy_to_host(), q_ref, bf16)
    assert rel_err(w.copy_to_host(), w_ref) <= 1e-5


@pytest.mark.parametrize("bf16", [False, True])
def test_rope_bf16_same_inputs(bf16):
    """The new kernel alone, in place, on identical inputs: exactly the reference in the
    simulator (same float32 operations); on a GPU an FMA may move a value by an ulp."""
    rng = fresh_rng()
    T, H, n, R = 2, 3, 64, 32
    x = rng.standard_normal((T, H, n)).astype(np.float32)
    cos, sin = rope_tables(rope_frequencies(R, 10000.0), rng.integers(0, 1 << 20, T), np.float32)
    ref = np.empty_like(x)
    rt.rope_bf16_ref(ref, x, cos, sin, bf16)
    xd = cuda.to_device(x)
    rt.rope_bf16(xd, xd, cuda.to_device(cos), cuda.to_device(sin), bf16, threads=THREADS)
    got = xd.copy_to_host()
    if SIMULATOR:
        assert np.array_equal(got, ref)
    else:
        assert np.all(np.abs(got - ref) <= 2.0 ** -7 * np.abs(ref) + 1e-6)


def fp4_keys(rng, N, DI):
    """(packed [N, bytes] uint8, the same keys as float32 [N, DI]), on the FP4 grid."""
    packed = random_packed_keys(rng, N, DI)
    keys = np.empty((N, DI), np.float32)
    unpack_index_key_ref(keys, packed)
    return packed, keys


@pytest.mark.parametrize("H, N, n, own_work", [(16, 40, 40, False), (128, 40, 29, False),
                                               (128, 40, 29, True)])
def test_retriever_logits(H, N, n, own_work):
    """Packed FP4 keys vs the spec on the float keys; 128 heads run as two 64-head groups (in
    the module's workspace, or the caller's)."""
    rng = fresh_rng()
    DI = 128
    packed, keys = fp4_keys(rng, N, DI)
    q = rng.standard_normal((H, DI)).astype(np.float32)
    w = (rng.standard_normal(H) / 128).astype(np.float32)
    ref = np.empty(n)
    retriever_logits_keys_ref(ref, q.astype(np.float64), w.astype(np.float64), keys[:n])
    out = poisoned(N)
    rt.retriever_logits(out, cuda.to_device(q), cuda.to_device(w), cuda.to_device(packed),
                        cuda.to_device(np.array([n], np.int32)), threads=THREADS,
                        work=rt.logits_workspace(H, N) if own_work else None)
    got = out.copy_to_host()
    assert rel_err(got[:n], ref) <= 1e-4
    assert np.all(np.isneginf(got[n:]))


def test_retriever_scorer_score():
    """Two layers end to end vs retriever_query_ref + retriever_logits_keys_ref; the position
    is past max_position, so it is clamped. bf16 off keeps the comparison at 1e-4 (the bf16
    path and the fast Hadamard are test_retriever_query's)."""
    rng = fresh_rng()
    L, H, DI, R, N, n = 2, 16, 128, 64, 40, 33
    hosts = [random_layer(rng, H, DI, layer=2 * i + 2) for i in range(L)]
    geo = RetrieverGeometry(max_position=1000)
    freq = rope_frequencies(R, 160000.0, 16.0, 65536)
    xs = rng.standard_normal((L, D)).astype(np.float32)
    packed = [fp4_keys(rng, N, DI) for _ in range(L)]
    scorer = rt.RetrieverScorer(Retriever(hosts, geo), freq, bf16_rope=False, threads=THREADS,
                                naive=SIMULATOR)  # serial norm / Hadamard: fast to simulate
    z = poisoned((L, N))
    keys = [cuda.to_device(p) for p, _ in packed]
    scorer.score(z, cuda.to_device(xs), 5000, keys, n)
    got = z.copy_to_host()
    # the graph form: position and count read on the device give the very same logits
    z2 = poisoned((L, N))
    scorer.score_in_graph(z2, cuda.to_device(xs), cuda.to_device(np.array([5000], np.int32)),
                          cuda.to_device(np.array([n], np.int32)), keys)
    assert np.array_equal(z2.copy_to_host(), got)
    cos, sin = rope_tables(freq, [geo.max_position - 1], np.float32)
    for i, host in enumerate(hosts):
        q, w, ref = np.empty((H, DI), np.float32), np.empty(H, np.float32), np.empty(n)
        retriever_query_ref(q, w, xs[i], host, cos, sin, hadamard_matrix(DI), False)
        retriever_logits_keys_ref(ref, q.astype(np.float64), w.astype(np.float64),
                                  packed[i][1][:n])
        assert rel_err(got[i, :n], ref) <= 1e-4
        assert np.all(np.isneginf(got[i, n:]))


def test_bench_cases_construct_and_run():
    """bench_cases at tiny shapes: every case launches, and the logits check passes."""
    cases = rt.bench_cases(0, D=32, H=16, DI=32, rank=16, R=16, N=24, L=1)
    assert [c.family for c in cases] == ["retriever"] * 3
    for c in cases[:2]:  # query then logits: the check reads the logits case's q, w and z
        c.launch()
    assert cases[1].check() <= 1e-4
    cases[2].launch()


def test_rope_table_from_device_position():
    freq = rope_frequencies(64, 160000.0, 16.0, 65536)
    for pos in (0, 12345, 10 ** 7):  # the last one clamped
        cos, sin = poisoned((1, 32)), poisoned((1, 32))
        rt.rope_table(cos, sin, cuda.to_device(np.array([pos], np.int32)), cuda.to_device(freq),
                      1 << 20)
        rc, rs = np.empty((1, 32), np.float32), np.empty((1, 32), np.float32)
        rt.rope_table_ref(rc, rs, [pos], freq, 1 << 20)
        np.testing.assert_allclose(cos.copy_to_host(), rc, atol=2e-7)
        np.testing.assert_allclose(sin.copy_to_host(), rs, atol=2e-7)


@pytest.mark.parametrize("how", [rt.ENSEMBLE_MAX, rt.ENSEMBLE_MEAN])
def test_ensemble(how):
    rng = fresh_rng()
    L, N, n = 3, 70, 61
    z = (rng.standard_normal((L, N + 5)) * 4).astype(np.float32)
    e = poisoned(N)
    rt.ensemble(e, cuda.to_device(z), cuda.to_device(np.array([n], np.int32)), how)
    ref = np.empty(N, np.float32)
    rt.ensemble_ref(ref, z, [n], how)
    got = e.copy_to_host()
    np.testing.assert_allclose(got[:n], ref[:n], rtol=1e-6)
    assert np.all(np.isneginf(got[n:]))
