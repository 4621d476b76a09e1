"""MoE sublayer kernels (spec §4.11) vs their NumPy references, in the simulator or on a GPU."""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm.kernels import moe
from pocketfm.kernels.device import SideStream
from pocketfm.kernels.gemv import pack_weight
from pocketfm.quants import GGMLType, random_blocks


# ---- routing ---------------------------------------------------------------------------------
def _route_inputs(rng, T, E, k, V=40, bias_scale=0.1):
    logits = rng.normal(0.0, 2.0, (T, E)).astype(np.float32)
    bias = (rng.normal(0.0, bias_scale, E)).astype(np.float32)
    tid2eid = np.stack([rng.choice(E, k, replace=False) for _ in range(V)]).astype(np.int32)
    tokens = rng.integers(0, V, T).astype(np.int32)
    return logits, bias, tid2eid, tokens


def _route_chunk_both(logits, bias, tid2eid, tokens, use_hash, scale, normalise, k, naive):
    """(kernel ids, kernel weights, ref ids, ref weights) for one route_chunk call."""
    T = logits.shape[0]
    d_ids = cuda.to_device(np.full((T, k), -7, np.int32))
    d_w = poisoned((T, k))
    moe.route_chunk(d_ids, d_w, cuda.to_device(logits), cuda.to_device(bias),
                    cuda.to_device(tid2eid), cuda.to_device(tokens), use_hash, scale, normalise,
                    threads=THREADS, naive=naive)
    r_ids, r_w = np.empty((T, k), np.int32), np.empty((T, k), np.float64)
    moe.route_chunk_ref(r_ids, r_w, logits.astype(np.float64), bias.astype(np.float64),
                        tid2eid, tokens, use_hash, scale, normalise)
    return d_ids.copy_to_host(), d_w.copy_to_host(), r_ids, r_w


@pytest.mark.parametrize("E,k", [(16, 2), (33, 6), (64, 6), (256, 6)])
@pytest.mark.parametrize("normalise", [1, 0])
def test_route_decode_matches_ref(E, k, normalise):
    rng = fresh_rng()
    logits, bias, tid2eid, token = _route_inputs(rng, 1, E, k)
    d_ids, d_w = cuda.to_device(np.full(k, -7, np.int32)), poisoned(k)
    moe.route(d_ids, d_w, cuda.to_device(logits[0]), cuda.to_device(bias),
              cuda.to_device(tid2eid), cuda.to_device(token), 0, 1.5, normalise, threads=THREADS)
    r_ids, r_w = np.empty(k, np.int32), np.empty(k, np.float64)
    moe.route_ref(r_ids, r_w, logits[0].astype(np.float64), bias.astype(np.float64), tid2eid,
                  token, 0, 1.5, normalise)
    assert np.array_equal(d_ids.copy_to_host(), r_ids)  # same experts, same order
    assert rel_err(d_w.copy_to_host(), r_w) <= 1e-6


@pytest.mark.parametrize("naive", [False, True])
def test_route_bias_steers_selection_only(naive):
    rng = fresh_rng()
    T, E, k = 2, 32, 4
    logits, _, tid2eid, tokens = _route_inputs(rng, T, E, k)
    s = np.sqrt(np.logaddexp(0.0, logits.astype(np.float64)))
    # lift the two lowest-scoring experts of token 0 above everyone: they must be picked, and
    # their (small, unbiased) scores must be what the weights are made of
    bias = np.zeros(E, np.float32)
    low = np.argsort(s[0])[:2]
    bias[low] = 100.0
    ids, w, r_ids, r_w = _route_chunk_both(logits, bias, tid2eid, tokens, 0, 1.5, 1, k, naive)
    unbiased_top = set(np.argsort(-s[0], kind="stable")[:k])
    assert set(r_ids[0]) != unbiased_top and set(low) <= set(r_ids[0])
    assert np.array_equal(ids, r_ids)
    assert rel_err(w, r_w) <= 1e-6


@pytest.mark.parametrize("naive", [False, True])
def test_route_top_k_all_in_one_group(naive):
    """The fast kernel ranks within groups of 32 first: a whole top-k from one group (and a
    short last group with fewer than k experts) must still come out exact."""
    rng = fresh_rng()
    T, E, k = 1, 70, 6
    logits, _, tid2eid, tokens = _route_inputs(rng, T, E, k)
    bias = np.zeros(E, np.float32)
    bias[40:40 + k + 1] = 50.0  # k + 1 boosted experts, all in group 1
    ids, w, r_ids, r_w = _route_chunk_both(logits, bias, tid2eid, tokens, 0, 1.5, 1, k, naive)
    assert set(r_ids[0]) <= set(range(40, 40 + k + 1))
    assert np.array_equal(ids, r_ids)
    assert rel_err(w, r_w) <= 1e-6


@pytest.mark.parametrize("naive", [False, True])
def test_route_hash_layers_read_tid2eid(naive):
    rng = fresh_rng()
    T, E, k = 3, 16, 6
    logits, bias, tid2eid, tokens = _route_inputs(rng, T, E, k, bias_scale=50.0)
    ids, w, r_ids, r_w = _route_chunk_both(logits, bias, tid2eid, tokens, 1, 2.5, 1, k, naive)
    assert np.array_equal(ids, tid2eid[tokens]) and np.array_equal(ids, r_ids)
    assert rel_err(w, r_w) <= 1e-6


@pytest.mark.parametrize("naive", [False, True])
def test_route_ties_go_to_the_lowest_index(naive):
    rng = fresh_rng()
    T, E, k = 2, 48, 6
    # few distinct logits and bias values: many exact ties in s + bias
    logits = rng.choice(np.float32([-1.0, 0.5, 2.0]), (T, E))
    bias = rng.choice(np.float32([0.0, 0.25]), E)
    _, _, tid2eid, tokens = _route_inputs(rng, T, E, k)
    ids, w, r_ids, r_w = _route_chunk_both(logits, bias, tid2eid, tokens, 0, 1.0, 1, k, naive)
    assert np.array_equal(ids, r_ids)
    assert rel_err(w, r_w) <= 1e-6


@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("normalise", [1, 0])
def test_route_chunk_matches_ref(naive, normalise):
    rng = fresh_rng()
    T, E, k = 4, 32, 3
    logits, bias, tid2eid, tokens = _route_inputs(rng, T, E, k)
    logits[1, 5] = 40.0  # above the softplus cut-over
    logits[2, 7] = -40.0
    ids, w, r_ids, r_w = _route_chunk_both(logits, bias, tid2eid, tokens, 0, 1.5, normalise, k,
                                           naive)
    assert np.array_equal(ids, r_ids)
    assert rel_err(w, r_w) <= 1e-6


# ---- SwiGLU, combine, broadcast ----------------------------------------------------------------
@pytest.mark.parametrize("clamp", [10.0, 0.0])
def test_swiglu_matches_ref(clamp):
    rng = fresh_rng()
    k, F = 3, 40
    gate = (rng.normal(0.0, 8.0, (k, F))).astype(np.float32)  # wide: the clamp bites
    up = (rng.normal(0.0, 8.0, (k, F))).astype(np.float32)
    gate[0, :3] = [-200.0, 200.0, 0.0]  # silu's tails
    w = rng.uniform(0.1, 1.0, k).astype(np.float32)
    out = poisoned((k, F))
    moe.swiglu(out, cuda.to_device(gate), cuda.to_device(up), cuda.to_device(w), clamp,
               threads=THREADS)
    ref = np.empty((k, F))
    moe.swiglu_ref(ref, gate.astype(np.float64), up.astype(np.float64), w.astype(np.float64),
                   clamp)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_swiglu_fused_matches_ref():
    rng = fresh_rng()
    k, F = 2, 24
    gu = (rng.normal(0.0, 8.0, (k, 2 * F))).astype(np.float32)
    w = rng.uniform(0.1, 1.0, k).astype(np.float32)
    out = poisoned((k, F))
    moe.swiglu_fused(out, cuda.to_device(gu), cuda.to_device(w), 10.0, threads=THREADS)
    ref = np.empty((k, F))
    moe.swiglu_fused_ref(ref, gu.astype(np.float64), w.astype(np.float64), 10.0)
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_combine_matches_ref():
    rng = fresh_rng()
    k, D = 3, 48
    down = rng.normal(size=(k, D)).astype(np.float32)
    sh = rng.normal(size=D).astype(np.float32)
    out = poisoned(D)
    moe.combine(out, cuda.to_device(down), cuda.to_device(sh), threads=THREADS)
    ref = np.empty(D)
    moe.combine_ref(ref, down.astype(np.float64), sh.astype(np.float64))
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


def test_combine_chunk_matches_ref():
    rng = fresh_rng()
    T, k, D = 3, 2, 24
    down = rng.normal(size=(T, k, D)).astype(np.float32)
    sh = rng.normal(size=(T, D)).astype(np.float32)
    out = poisoned((T, D))
    moe.combine_chunk(out, cuda.to_device(down), cuda.to_device(sh), threads=THREADS)
    ref = np.empty((T, D))
    moe.combine_chunk_ref(ref, down.astype(np.float64), sh.astype(np.float64))
    assert rel_err(out.copy_to_host(), ref) <= 1e-4


@pytest.mark.parametrize("T, R", [(1, 3), (2, 6)])
def test_broadcast_rows_copies_x(T, R):
    x = fresh_rng().normal(size=(T, 40)).astype(np.float32)
    out = poisoned((R, 40))
    moe.broadcast_rows(out, cuda.to_device(x), threads=THREADS)
    ref = np.empty((R, 40), np.float32)
    moe.broadcast_rows_ref(ref, x)
    assert np.array_equal(out.copy_to_host(), ref)
    assert np.array_equal(ref[-1], x[-1]) and np.array_equal(ref[0], x[0])


# ---- the decode sublayer ---------------------------------------------------------------------
def _weights(rng, D, F, E, routed=(GGMLType.Q8_0, GGMLType.Q8_0), shared=GGMLType.Q8_0):
    """Host QWeights of a tiny MoE, ds4's type mix by default: F16 router, Q8_0 experts."""
    def w(qtype, experts, N, K, std):
        shape = (experts, N, K) if experts > 1 else (N, K)
        raw = random_blocks(qtype, shape, rng, std)
        if qtype == GGMLType.F32:
            raw = raw.view(np.float32)  # typed, as GGUFReader returns F32 tensors
        return pack_weight(raw, qtype, N, K)
    g, d = routed
    return dict(gate_inp=w(GGMLType.F16, 1, E, D, 0.3),
                gate_exps=w(g, E, F, D, 0.3), up_exps=w(g, E, F, D, 0.3),
                down_exps=w(d, E, D, F, 0.3),
                shared_gate=w(shared, 1, F, D, 0.3), shared_up=w(shared, 1, F, D, 0.3),
                shared_down=w(shared, 1, D, F, 0.3))


def _check_moe_layer(rng, host, D, F, E, k, steps, tol=1e-4):
    """Run moe_layer for each step dict (use_hash, clamps, shared on/off) on ONE scratch and one
    x / token buffer refilled per step, as a captured graph would, and compare with the ref.
    Returns the outputs, one per step."""
    V = 20
    bias = rng.normal(0, 0.1, E).astype(np.float32)
    tid2eid = np.stack([rng.choice(E, k, replace=False) for _ in range(V)]).astype(np.int32)
    dev = {n: w.to_device() for n, w in host.items()}
    fused = {n: moe.fuse_gate_up(host[n], host[n.replace("gate", "up")]).to_device()
             for n in ("gate_exps", "shared_gate")}
    scratch = moe.MoEScratch.allocate(D, F, E, k)
    d_bias, d_tid2eid = cuda.to_device(bias), cuda.to_device(tid2eid)
    d_x = cuda.to_device(np.zeros((1, D), np.float32))
    d_token = cuda.to_device(np.zeros(1, np.int32))
    outs = []
    for step in steps:
        x = rng.normal(size=(1, D)).astype(np.float32)
        token = rng.integers(0, V, 1).astype(np.int32)
        d_x.copy_to_device(x)
        d_token.copy_to_device(token)
        layer = dict(use_hash=step.get("use_hash", 0), clamp=step.get("clamp", 10.0),
                     clamp_shared=step.get("clamp_shared", 10.0), routed_scale=1.5)
        h, d = host, dev
        if step.get("no_shared"):
            drop = {n: None for n in ("shared_gate", "shared_up", "shared_down")}
            h, d = dict(host, **drop), dict(dev, **drop)
        if step.get("fused"):  # gate and up stacked into one weight (the ref keeps them apart)
            d = dict(d, gate_exps=fused["gate_exps"], up_exps=None)
            if d["shared_gate"] is not None:
                d.update(shared_gate=fused["shared_gate"], shared_up=None)
        parts = step.get("parts")  # no combine: the output left in scratch.parts
        out = None if parts else poisoned((1, D))
        side = SideStream() if step.get("side") else None
        side_x = SideStream() if step.get("side_x") else None
        moe.moe_layer(out, d_x, bias=d_bias, tid2eid=d_tid2eid, token=d_token, scratch=scratch,
                      threads=THREADS, side=side, side_x=side_x,
                      imma_gate_up=step.get("imma", False),
                      imma_down=step.get("imma_down", False), **d, **layer)
        cuda.synchronize()
        ref = np.empty((1, D))
        moe.moe_layer_ref(ref, x.astype(np.float64), bias=bias.astype(np.float64),
                          tid2eid=tid2eid, token=token, **h, **layer)
        if parts:  # summed in combine's order: the shared row, then the routed ones
            rows = scratch.parts.copy_to_host()[0]
            got = rows[k].copy()
            for j in range(k):
                got += rows[j]
            outs.append(got[None])
        else:
            outs.append(out.copy_to_host())
        assert rel_err(outs[-1], ref) <= tol, step
    return outs


def test_moe_layer_matches_ref_q8_0():
    """ds4's types for the small matrices: F16 router, Q8_0 experts. Clamp 1 bites (the
    projections have std ~2.4); equal clamps take the single SwiGLU launch over k + 1 rows, and
    with a side stream the shared expert's own chain (concurrent on a GPU); without ``out``
    the output left in parts (no combine launch), summed here."""
    rng = fresh_rng()
    D, F, E, k = 64, 32, 8, 2
    _check_moe_layer(rng, _weights(rng, D, F, E), D, F, E, k,
                     [dict(clamp=1.0, clamp_shared=1.0),
                      dict(clamp=1.0, clamp_shared=1.0, fused=True, side=True),
                      dict(clamp=1.0, clamp_shared=1.0, fused=True, side=True, parts=True)])


def test_moe_layer_hash_two_steps_split_clamps_f32():
    """Hash routing, then biased routing with fused gate+up weights, on one scratch; a shared
    clamp unlike the routed one (two SwiGLU launches)."""
    rng = fresh_rng()
    D, F, E, k = 32, 32, 4, 2
    host = _weights(rng, D, F, E, routed=(GGMLType.F32, GGMLType.F32), shared=GGMLType.F32)
    _check_moe_layer(rng, host, D, F, E, k, [dict(use_hash=1, clamp=1.0, clamp_shared=0.5),
                                             dict(clamp=0.5, clamp_shared=1.0, fused=True)])


def test_moe_layer_lowbit_without_shared_expert_fusions_change_no_bit(monkeypatch):
    """V4-Flash's routed types: IQ2_XXS gate/up, Q2_K down (K must be a multiple of 256, so
    D = F = 256), gate and up fused. These take neither the x broadcast (the ids-GEMV reads one
    x row for every id) nor a SwiGLU launch (h made in the down GEMV's x preparation): the
    output matches the reference, and the unfused launch sequence bit for bit (same seed). No
    shared expert here: the simulated Q8_0 GEMVs at 256 x 256 would cost ~30 s, Q8_0 is
    covered above, and gemv_swiglu without ids in test_gemv_lowbit.py."""
    seed = int(fresh_rng().integers(2**32))
    D, F, E, k = 256, 256, 4, 2
    # the clamp bites; the second step prepares the routed x beside the router (side_x)
    steps = [dict(no_shared=True, fused=True, clamp=1.0),
             dict(no_shared=True, fused=True, clamp=1.0, side_x=True)]

    def run():
        rng = np.random.default_rng(seed)
        host = _weights(rng, D, F, E, routed=(GGMLType.IQ2_XXS, GGMLType.Q2_K))
        # the low-bit decode GEMVs quantise x to int16 per slot (not float32-exact: rel ~2e-5,
        # with rare tiny-shape outliers; see tests/kernels/test_gemv_lowbit.py::test_dp4a_slots)
        return _check_moe_layer(rng, host, D, F, E, k, steps, tol=5e-4)

    def launched(*args, **kwargs):
        raise AssertionError("a launch the low-bit path saves")
    with monkeypatch.context() as m:
        m.setattr(moe, "broadcast_rows", launched)
        m.setattr(moe, "_swiglu_launch", launched)
        fused = run()
    monkeypatch.setattr(moe, "shares_x_row", lambda w: False)
    monkeypatch.setattr(moe, "fuses_swiglu", lambda w, threads=None: False)
    unfused = run()
    assert all(np.array_equal(a, b) for a, b in zip(fused, unfused))


def _spy(monkeypatch, module, name) -> list:
    """module.name still runs, and each call's weight (its second argument) is listed."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)
    return calls


def test_moe_layer_routed_gate_up_on_imma(monkeypatch):
    """The fused IQ2_XXS gate/up on imma_iq2_xxs.py's int8 tensor-core kernel (D = 512: whole
    512-column stages), its x prepared beside the router (side_x) and in line, then also the
    Q2_K down on imma_q2_k's: the reference's output (their own x roundings; the kernels'
    bounds are checked in test_imma_iq2_xxs.py and test_imma_q2_k.py)."""
    ran = _spy(monkeypatch, moe.imma_iq2_xxs, "gemv_prepared")
    downs = _spy(monkeypatch, moe.imma_q2_k, "gemv_swiglu_imma")
    rng = fresh_rng()
    D, F, E, k = 512, 256, 4, 2
    host = _weights(rng, D, F, E, routed=(GGMLType.IQ2_XXS, GGMLType.Q2_K))
    steps = [dict(no_shared=True, fused=True, imma=True, side_x=True),
             dict(no_shared=True, fused=True, imma=True, clamp=1.0, imma_down=True)]
    _check_moe_layer(rng, host, D, F, E, k, steps, tol=5e-4)
    assert len(ran) == 2  # both steps ran the imma GEMV
    assert len(downs) == 1  # and the second the Q2_K down on imma_q2_k
