"""Embedding, argmax and top-p sampling kernels vs their references (exact: integer outputs)."""
import numpy as np
import pytest
from numba import cuda

from pocketfm.kernels import embed_sample as es
from pocketfm.quants import float32_to_bf16

from .kernel_testing import THREADS, fresh_rng, poisoned


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_embed(dtype):
    rng = fresh_rng()
    V, D, T = 50, 40, 3
    x = (rng.standard_normal((V, D)) * 3).astype(np.float32)
    x[0, :4] = [0.0, -0.0, 1e-40, -65504.0]  # zero, signed zero, a subnormal, a large value
    table = {"f32": x, "f16": x.astype(np.float16), "bf16": float32_to_bf16(x)}[dtype]
    tokens = np.array([0, *rng.integers(0, V, T - 1)], np.int32)
    ref = np.empty((T, D), np.float32)
    es.embed_ref(ref, table, tokens)
    out = poisoned((T, D))
    es.embed(out, cuda.to_device(table), cuda.to_device(tokens), threads=THREADS)
    assert np.array_equal(out.copy_to_host(), ref)


@pytest.mark.parametrize("naive", [False, True])
def test_argmax(naive):
    rng = fresh_rng()
    V = 300
    for case in range(3):
        logits = rng.standard_normal(V).astype(np.float32)
        if case == 1:  # a tie for the maximum: the lowest id wins
            j, k = sorted(rng.choice(V, 2, replace=False))
            logits[j] = logits[k] = logits.max() + 1
        if case == 2:
            logits[:] = -np.inf
        ref = np.zeros(1, np.int32)
        es.argmax_ref(ref, logits)
        out = cuda.to_device(np.full(1, -7, np.int32))
        es.argmax(out, cuda.to_device(logits), threads=THREADS, naive=naive)
        assert out.copy_to_host()[0] == ref[0]


def _sample_cases(rng, V, n=30):
    """(logits, temperature, top_p, u): spread, peaked, tied, and edge u / top_p values."""
    cases = []
    for i in range(n):
        logits = (rng.standard_normal(V) * rng.uniform(0.5, 4)).astype(np.float32)
        if i % 4 == 1:  # peaked: one token holds almost all the mass
            logits[rng.integers(V)] += 15
        if i % 4 == 2:  # coarse values: many ties, also at the threshold
            logits = np.round(logits * 2) / 2
        temperature = [1.0, 0.7, 1.6][i % 3]
        top_p = [1.0, 0.9, 0.5, 0.95, 0.0, rng.uniform(0.05, 1)][i % 6]
        u = [0.0, 0.999][i] if i < 2 else rng.uniform()
        cases.append((logits, temperature, top_p, np.float32(u)))
    return cases


# The split sampler's chunk is UNROLL * THREADS logits per block: this V runs 3 blocks, the last
# one partial (556 logits in the simulator, 2092 on a GPU).
SPLIT_V = 2 * es.UNROLL * THREADS + 44


def _check_sample(logits, temperature, top_p, u, naive):
    ref = es.sample_top_p_ref(None, logits, temperature, top_p, float(u))
    out = cuda.to_device(np.full(1, -7, np.int32))
    es.sample_top_p(out, cuda.to_device(logits), temperature, top_p,
                    cuda.to_device(np.array([u], np.float32)), threads=THREADS, naive=naive)
    assert out.copy_to_host()[0] == ref, (temperature, top_p, u, naive)


@pytest.mark.parametrize("naive,V,n", [(True, 300, 30), (False, SPLIT_V, 14)])
def test_sample_top_p_matches_reference(naive, V, n):
    """Both kernels on fresh random cases (the split one over several blocks; fewer cases: each
    costs 3-6 simulated launches)."""
    rng = fresh_rng()
    for logits, temperature, top_p, u in _sample_cases(rng, V, n):
        _check_sample(logits, temperature, top_p, u, naive)


def test_sample_top_p_split_edges():
    """The split kernels where blocks matter: the whole vocabulary tied (every block holds the
    threshold), the nucleus in the last, partial block only, masked (-inf) logits, tiny
    temperatures, u at both ends; the workspace is allocated once and reused."""
    rng = fresh_rng()
    V = SPLIT_V
    u_hi = np.float32(1 - 2.0 ** -24)  # the largest float32 below 1
    tail = np.full(V, -30.0, np.float32)  # all the mass in the last, partial block
    tail[-40:] = rng.standard_normal(40).astype(np.float32)
    masked = np.full(V, -np.inf, np.float32)
    masked[rng.choice(V, 25, replace=False)] = rng.standard_normal(25).astype(np.float32) * 2
    spread = (rng.standard_normal(V) * 3).astype(np.float32)
    cases = [(np.zeros(V, np.float32), 1.0, 0.5, np.float32(0.0)),
             (np.zeros(V, np.float32), 0.7, 0.9, np.float32(rng.uniform())),
             (tail, 1.0, 0.9, np.float32(rng.uniform())),
             (tail, 1.3, 1.0, u_hi),
             (masked, 0.8, 0.9, np.float32(rng.uniform())),
             (masked, 0.8, 1.0, u_hi),
             (spread, 0.01, 0.9, np.float32(rng.uniform())),
             (spread, 0.05, 1.0, np.float32(rng.uniform())),
             (spread, 1.0, 0.999, np.float32(0.0))]
    for logits, temperature, top_p, u in cases:
        _check_sample(logits, temperature, top_p, u, naive=False)
    work = dict(es._SAMPLE_WORK)
    _check_sample(spread, 1.0, 0.9, np.float32(0.5), naive=False)
    assert es._SAMPLE_WORK.keys() == work.keys()
    assert all(es._SAMPLE_WORK[k] is work[k] for k in work)


def test_sample_top_p_ref_semantics():
    """The reference on a hand-made distribution: the nucleus, ties at the threshold, and
    the ascending-id inverse CDF."""
    p = np.array([0.1, 0.4, 0.1, 0.3, 0.1])
    logits = np.log(p)
    # top_p 0.6: {1: 0.4, 3: 0.3} reaches 0.7 >= 0.6; renormalised cum in id order 4/7, 1
    assert es.sample_top_p_ref(None, logits, 1.0, 0.6, 0.5) == 1
    assert es.sample_top_p_ref(None, logits, 1.0, 0.6, 0.6) == 3
    # top_p 0.75 needs a 0.1 token: all three tied 0.1 tokens are kept (mass 1.0)
    out = np.zeros(1, np.int64)
    assert es.sample_top_p_ref(out, logits, 1.0, 0.75, 0.05) == 0 and out[0] == 0
    assert es.sample_top_p_ref(None, logits, 1.0, 0.75, 0.95) == 4
    # top_p 0 keeps only the most likely token; low temperature sharpens towards it
    assert es.sample_top_p_ref(None, logits, 1.0, 0.0, 0.99) == 1
    assert es.sample_top_p_ref(None, logits.astype(np.float32), 0.05, 1.0, 0.5) == 1
