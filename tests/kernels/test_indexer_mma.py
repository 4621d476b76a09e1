"""The tensor-core indexer scorer vs the NumPy reference (the MMA emulated per warp in the
simulator; the real mma.sync on a GPU with NUMBA_ENABLE_CUDASIM=0)."""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import fresh_rng, poisoned
from kernels.test_indexer import check_scores
from pocketfm.kernels import indexer as ix
from pocketfm.kernels import indexer_mma
from pocketfm.kernels.device import SIMULATOR
from pocketfm.numerics import fp4_roundtrip


def _inputs(rng, T, HI, DI, ncap, fp4_q):
    """Random packed keys; q either on the FP4 grid, as the model's (hadamard_fp4 output: the
    lo halves are zero, one MMA per tile), or any float32 (hi + lo, two MMAs)."""
    keys = ix.random_packed_keys(rng, ncap, DI)
    q = rng.normal(size=(T, HI, DI))
    q = (fp4_roundtrip(q, 32) if fp4_q else q).astype(np.float32)
    w = rng.normal(size=(T, HI)).astype(np.float32)
    return q, w, keys


def _check_decode(HI, DI, ncap, N, n, fp4_q):
    rng = fresh_rng()
    q, w, keys = _inputs(rng, 1, HI, DI, ncap, fp4_q)
    nv = np.array([n], np.int32)
    ref = np.empty((1, N))
    ix.indexer_scores_ref(ref[0], q[0].astype(np.float64), w[0].astype(np.float64), keys, nv)
    out = poisoned(N)
    ix.indexer_scores(out, cuda.to_device(q[0]), cuda.to_device(w[0]), cuda.to_device(keys),
                      cuda.to_device(nv), mma=True)
    check_scores(out.copy_to_host()[None], ref, [n])


@pytest.mark.parametrize("HI,DI,fp4_q", [(16, 128, True), (32, 128, False), (16, 64, False)])
def test_scores_decode(HI, DI, fp4_q):
    # ten 32-key steps over the simulator's blocks, the last one partly visible
    _check_decode(HI, DI, ncap=300, N=290, n=261, fp4_q=fp4_q)


def _check_chunk(q, w, keys, nv, N, **kernel):
    """The chunk form against the reference: scores below each token's count, -inf past it."""
    ref = np.empty((len(q), N))
    ix.indexer_scores_chunk_ref(ref, q.astype(np.float64), w.astype(np.float64), keys, nv)
    out = poisoned((len(q), N))
    ix.indexer_scores_chunk(out, cuda.to_device(q), cuda.to_device(w), cuda.to_device(keys),
                            cuda.to_device(nv), **kernel)
    check_scores(out.copy_to_host(), ref, np.minimum(nv, N))


def test_scores_chunk():
    rng = fresh_rng()
    T, HI, DI, ncap, N = 3, 16, 128, 200, 200
    q, w, keys = _inputs(rng, T, HI, DI, ncap, True)
    nv = np.array([5, 130, 200], np.int32)  # token 0: steps past its keys only fill -inf
    _check_chunk(q, w, keys, nv, N, mma=True)


def _fp4_spread(rng, shape):
    """Values on the FP4 grid whose 32-dim blocks span 2^-40 .. 2^40 (the tiles kernel moves
    every key's scale into the bf16 exponents) and whose first block is all zero (scale byte
    0 in a packed key)."""
    x = rng.normal(size=shape) * np.ldexp(1.0, rng.integers(-40, 41, size=shape[:-1]
                                                            + (shape[-1] // 32, 1))
                                          ).repeat(32, axis=-1).reshape(shape)
    x[..., :32] = 0.0
    return fp4_roundtrip(x, 32).astype(np.float32)


@pytest.mark.parametrize("HI,DI,T", [(32, 32, 9), (64, 64, 5)])
def test_scores_chunk_tiles(HI, DI, T):
    # several tokens a block (8 a block at HI = 32, 4 at 64), the last block part-filled;
    # visible counts from none to past N, so steps end in every token at its own key
    rng = fresh_rng()
    ncap, N = 80, 75
    keys = np.empty((ncap, ix.kvpack.index_key_bytes(DI)), np.uint8)
    ix.kvpack.pack_index_key_ref(keys, _fp4_spread(rng, (ncap, DI)))
    q = _fp4_spread(rng, (T, HI, DI))
    w = rng.normal(size=(T, HI)).astype(np.float32)
    nv = rng.integers(1, N, size=T).astype(np.int32)
    nv[0], nv[-1] = 0, N + 5
    _check_chunk(q, w, keys, nv, N, mma=True, q_fp4=True)


def test_fits():
    assert indexer_mma.fits(64, 128) and indexer_mma.fits(16, 64)
    assert not indexer_mma.fits(8, 128)  # fewer heads than one MMA's 16 rows
    assert not indexer_mma.fits(64, 48)  # not whole 32-dim FP4 blocks
    assert indexer_mma.fits_tiles(64, 128) and indexer_mma.fits_tiles(256, 32)
    assert not indexer_mma.fits_tiles(16, 128)  # a warp takes 32 heads
    assert not indexer_mma.fits_tiles(64, 256)  # q's fragments would need 128 registers


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash size: GPU only")
@pytest.mark.parametrize("fp4_q", [True, False])
def test_scores_v4_size(fp4_q):
    _check_decode(64, 128, ncap=100_000, N=100_000, n=90_001, fp4_q=fp4_q)


@pytest.mark.skipif(SIMULATOR, reason="V4-Flash size: GPU only")
def test_scores_chunk_tiles_v4_size():
    rng = fresh_rng()
    T, HI, DI, N = 12, 64, 128, 70_000
    q, w, keys = _inputs(rng, T, HI, DI, N, True)
    nv = np.linspace(1, N, T).astype(np.int32)
    _check_chunk(q, w, keys, nv, N, q_fp4=True)


def test_decode_keys():
    # rows 0 .. n-1 decoded, zeros up to whole 64-key steps, the rest untouched; a block with
    # scale byte 0 reads as 2^-127 (subnormal bf16, as the reference)
    rng = fresh_rng()
    DI, ncap, n = 64, 150, 131
    keys = ix.random_packed_keys(rng, ncap, DI)
    keys[3, DI // 2] = 0
    rows = indexer_mma.key_ws_rows(n)
    assert rows == 192
    ws = cuda.to_device(np.full((rows + 5, DI // 2), 0xDEADBEEF, np.uint32))
    got = indexer_mma.decode_keys(ws, cuda.to_device(keys), n)
    assert got.n == n and got.rows.shape == (rows, DI // 2)
    ref = np.full((rows + 5, DI // 2), 0xDEADBEEF, np.uint32)
    indexer_mma.decode_keys_ref(ref, keys, n)
    np.testing.assert_array_equal(ws.copy_to_host(), ref)
    assert not ref[n:rows].any() and (ref[rows:] == 0xDEADBEEF).all()
    # the reference's pairs are the unpacked keys' values exactly
    vals = np.empty((n, DI), np.float32)
    ix.kvpack.unpack_index_key_ref(vals, keys[:n])
    lo = (ref[:n] << np.uint32(16)).view(np.float32)
    hi = (ref[:n] & np.uint32(0xFFFF0000)).view(np.float32)
    np.testing.assert_array_equal(lo, vals[:, 0::2])
    np.testing.assert_array_equal(hi, vals[:, 1::2])


def test_decode_keys_refuses_a_short_workspace():
    keys = cuda.to_device(ix.random_packed_keys(fresh_rng(), 70, 128))
    with pytest.raises(ValueError, match=r"^indexer key workspace: \(64, 64\) for 70 keys"):
        indexer_mma.decode_keys(cuda.device_array((64, 64), np.uint32), keys, 70)
    with pytest.raises(ValueError, match="expected at least"):  # keys of another DI
        indexer_mma.decode_keys(cuda.device_array((128, 32), np.uint32), keys, 70)


def test_scores_chunk_tiles_over_keys_decoded_once():
    # the prefill's use: keys decoded once for the last token's count, then scoring passes
    # over slices of the chunk's tokens; a token whose count passes the decoded keys scores
    # only those (the engine never asks: its counts end at the last token's)
    rng = fresh_rng()
    T, HI, DI, ncap, N = 6, 32, 32, 90, 70
    q, w, keys = _inputs(rng, T, HI, DI, ncap, True)
    nv = np.array([3, 40, 64, 65, 69, 70], np.int32)
    ws = cuda.device_array((indexer_mma.key_ws_rows(ncap), DI // 2), np.uint32)
    key_ws = indexer_mma.decode_keys(ws, cuda.to_device(keys), 66)
    out = poisoned((T, N))
    dq, dw, dk, dn = (cuda.to_device(a) for a in (q, w, keys, nv))
    for t0, t1 in ((0, 4), (4, 6)):
        ix.indexer_scores_chunk(out[t0:t1], dq[t0:t1], dw[t0:t1], dk, dn[t0:t1], mma=True,
                                q_fp4=True, key_ws=key_ws)
    ref = np.empty((T, N))
    ix.indexer_scores_chunk_ref(ref, q.astype(np.float64), w.astype(np.float64), keys[:66],
                                nv)
    check_scores(out.copy_to_host(), ref, np.minimum(nv, 66))
