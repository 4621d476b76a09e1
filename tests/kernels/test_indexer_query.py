"""The indexer's query in one launch vs its reference and vs the two launches it replaces
(simulator in CI; a GPU too)."""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned, rel_err
from pocketfm.kernels import gemv, indexer_query as iq
from pocketfm.kernels.device import SIMULATOR
from pocketfm.kernels.qat import hadamard_fp4
from pocketfm.numerics import rope_frequencies

H, DI = 3, 64


def _weight(rng, kind: str, K: int):
    raw = rng.normal(size=(H * DI, K)) * 0.1
    if kind == "f16":
        return gemv.pack_f16(raw.astype(np.float16), H * DI, K)
    if kind == "bf16":
        bits = (raw.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return gemv.pack_bf16(bits, H * DI, K)
    return gemv.pack_f32(raw.astype(np.float32), H * DI, K)


@pytest.mark.parametrize("kind,K,norm,rope,fp4", [
    ("f16", 320, True, True, True),  # the engine's form (V4: K = 1024, DI = 128)
    ("f16", 64, False, True, True),  # fewer chunks than lanes: lanes past the row hold x = 0
    ("bf16", 256, True, False, True),
    ("f32", 96, True, True, False)])
def test_indexer_query_is_the_gemv_then_hadamard_fp4(kind, K, norm, rope, fp4):
    """One launch = gemv(norm=) (or gemv) then hadamard_fp4 with the RoPE, bit for bit (the
    same sums in the same order), and the float64 reference within float32 rounding (where FP4
    rounds, an element may land on the neighbouring code: a loose bound there)."""
    rng = fresh_rng()
    w = _weight(rng, kind, K)
    xh = rng.normal(size=(1, K)).astype(np.float32)
    nwh = rng.uniform(0.5, 1.5, size=K).astype(np.float32)
    posh = np.array([int(rng.integers(0, 1 << 18))], np.int32)
    freqs = rope_frequencies(DI // 2, 160000.0, 16.0, 65536)
    wd, x, nw = w.to_device(), cuda.to_device(xh), cuda.to_device(nwh)
    r = (cuda.to_device(posh), cuda.to_device(freqs)) if rope else None
    nrm = (nw, 1e-6) if norm else None
    assert iq.fits(w, DI, threads=64)
    out = poisoned((1, H, DI))
    iq.indexer_query(out, wd, x, nrm, r, fp4, threads=64)
    q, two = poisoned((1, H, DI)), poisoned((1, H, DI))
    gemv.gemv(q.reshape(1, H * DI), wd, x, None, norm=nrm)
    hadamard_fp4(two, q, fp4, rope=r, warp=False)
    got = out.copy_to_host()
    assert np.array_equal(got, two.copy_to_host())
    ref = np.empty((1, H, DI))
    iq.indexer_query_ref(ref, w, xh, (nwh, 1e-6) if norm else None,
                         (posh, freqs) if rope else None, fp4)
    assert rel_err(got, ref) <= (5e-2 if fp4 else 1e-5)


def test_indexer_query_takes_float_weights_whose_rows_a_warp_holds():
    """fits: not Q8_0 (gemv's dp4a path), not a row longer than a warp holds, not a DI the
    warps' steps do not divide, not a DI the Hadamard does not take."""
    rng = fresh_rng()
    assert iq.fits(_weight(rng, "f16", 1024), DI, threads=64)
    assert not iq.fits(_weight(rng, "f16", 1032), DI, threads=64)  # K / 8 > 32 lanes x 4
    assert not iq.fits(_weight(rng, "f16", 64), 32, threads=1024)  # 32 warps x 2 rows > 32
    assert not iq.fits(_weight(rng, "f16", 64), 96, threads=64)  # not a power of two
    q8 = gemv.pack_q8_0(np.zeros(H * DI * 64 // 32 * 34, np.uint8), H * DI, 64)
    assert not iq.fits(q8, DI)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash shape: a GPU test")
def test_indexer_query_at_v4_shape():
    """V4-Flash's wq_b (8,192 x 1,024 F16), 256 and 512 threads: the two launches bit for bit."""
    rng = fresh_rng()
    Hv, DIv, K = 64, 128, 1024
    raw = (rng.normal(size=(Hv * DIv, K)) * 0.03).astype(np.float16)
    wd = gemv.pack_f16(raw, Hv * DIv, K).to_device()
    x = cuda.to_device(rng.normal(size=(1, K)).astype(np.float32))
    nw = cuda.to_device(rng.uniform(0.5, 1.5, size=K).astype(np.float32))
    r = (cuda.to_device(np.array([123_457], np.int32)),
         cuda.to_device(rope_frequencies(64, 160000.0, 16.0, 65536)))
    q, two = poisoned((1, Hv, DIv)), poisoned((1, Hv, DIv))
    gemv.gemv(q.reshape(1, Hv * DIv), wd, x, None, norm=(nw, 1e-6))
    hadamard_fp4(two, q, True, rope=r, warp=False)
    for nt in (256, 512):
        out = poisoned((1, Hv, DIv))
        iq.indexer_query(out, wd, x, (nw, 1e-6), r, True, threads=nt)
        assert np.array_equal(out.copy_to_host(), two.copy_to_host()), nt


def test_indexer_query_writes_the_scorers_fragments():
    """indexer_query(frag=) also writes q's bf16 pairs where the one-warp scorer's lanes hold
    them (indexer_warp.q_fragments_ref of its own output, bit for bit), and the same q."""
    from pocketfm.kernels import indexer_warp

    rng = fresh_rng()
    Hf, K = 16, 128
    raw = rng.normal(size=(Hf * DI, K)) * 0.1
    w = gemv.pack_f16(raw.astype(np.float16), Hf * DI, K).to_device()
    x = cuda.to_device(rng.normal(size=(1, K)).astype(np.float32))
    nw = cuda.to_device(rng.uniform(0.5, 1.5, size=K).astype(np.float32))
    r = (cuda.to_device(np.array([int(rng.integers(0, 1 << 18))], np.int32)),
         cuda.to_device(rope_frequencies(DI // 2, 160000.0, 16.0, 65536)))
    out, plain = poisoned((1, Hf, DI)), poisoned((1, Hf, DI))
    frag = cuda.to_device(np.full(Hf * DI // 2, 0xDEADBEEF, np.uint32))
    iq.indexer_query(out, w, x, (nw, 1e-6), r, True, threads=64, frag=frag)
    iq.indexer_query(plain, w, x, (nw, 1e-6), r, True, threads=64)
    got = out.copy_to_host()
    assert np.array_equal(got, plain.copy_to_host())
    assert np.array_equal(frag.copy_to_host(), indexer_warp.q_fragments_ref(got[0]))
