"""QAT round-trips and cache packers vs numerics.py / kvpack.py, bit for bit (simulator or GPU)."""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm.kernels import kvpack as kp
from pocketfm.kernels import qat
from pocketfm.numerics import fp4_roundtrip, hadamard_matrix
from pocketfm.quants import float32_to_bf16


def kv_inputs(rng, T, K, R):
    """Rows at very different scales, plus the corner cases of the FP8 recipe: exact e4m3 ties
    (midpoints between grid values under a known scale), an all-zero row, a row below the 1e-4
    amax floor, a block whose max sits on 448·2**k, and float32 subnormals in the rope dims."""
    x = (rng.normal(size=(T, K)) * np.exp(rng.normal(size=(T, 1)) * 3)).astype(np.float32)
    grid = kp.E4M3_VALUES[:126].astype(np.float64)  # 0 .. 448, increasing
    mids = (grid[:-1] + grid[1:]) / 2  # every midpoint below 448 is exact in float32
    s = 2.0 ** rng.integers(-20, 20)
    x[0, :64] = rng.choice(mids, 64) * s * rng.choice([-1, 1], 64)
    x[0, 0] = 300.0 * s  # pins the block scale to s: 300 / 448 lies in (1/2, 1)
    x[1] = 0.0
    x[2, :K - R] *= 1e-6 / np.abs(x[2, :K - R]).max()
    x[3, 64:128] = rng.normal(size=64)
    x[3, 64 + int(rng.integers(64))] = 448.0 * 2.0 ** rng.integers(-10, 10)
    x[4, K - R:] = rng.normal(size=R) * 1e-40
    return x


@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("K,R", [(192, 64), (128, 64)])
def test_kv_roundtrip_bit_exact(naive, K, R):
    x = kv_inputs(fresh_rng(), 6, K, R)
    out = poisoned(x.shape)
    qat.kv_roundtrip(out, cuda.to_device(x), R, threads=THREADS, naive=naive)
    ref = np.empty_like(x)
    qat.kv_roundtrip_ref(ref, x, R)
    assert np.array_equal(out.copy_to_host(), ref)


def test_kv_roundtrip_in_place():
    x = kv_inputs(fresh_rng(), 5, 128, 64)
    d = cuda.to_device(x)
    qat.kv_roundtrip(d, d, 64, threads=THREADS)
    ref = np.empty_like(x)
    qat.kv_roundtrip_ref(ref, x, 64)
    assert np.array_equal(d.copy_to_host(), ref)


@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("K,R", [(192, 64), (128, 64)])
def test_kv_pack_equals_pack_of_roundtrip(naive, K, R):
    x = kv_inputs(fresh_rng(), 6, K, R)
    nbytes = kp.kv_entry_bytes(K, R)
    out = cuda.to_device(np.full((6, nbytes), 0xAB, np.uint8))  # poison: every byte rewritten
    values = poisoned(x.shape)  # the fused form also returns the round-tripped values
    qat.kv_pack(out, cuda.to_device(x), R, out_values=values, threads=THREADS, naive=naive)
    ref = np.empty((6, nbytes), np.uint8)
    qat.kv_pack_ref(ref, x, R)
    assert np.array_equal(out.copy_to_host(), ref)
    ref_values = np.empty_like(x)
    qat.kv_roundtrip_ref(ref_values, x, R)
    assert np.array_equal(values.copy_to_host(), ref_values)


def test_kv_unpack_inverts_pack():
    rng = fresh_rng()
    K, R = 192, 64
    packed = np.empty((5, kp.kv_entry_bytes(K, R)), np.uint8)
    qat.kv_pack_ref(packed, kv_inputs(rng, 5, K, R), R)
    out = poisoned((5, K))
    qat.kv_unpack(out, cuda.to_device(packed), R, threads=THREADS)
    ref = np.empty((5, K), np.float32)
    qat.kv_unpack_ref(ref, packed, R)
    assert np.array_equal(out.copy_to_host(), ref)


@cuda.jit
def _codecs(out_bf16, x, out_e4m3, grid):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out_bf16[i] = qat.bf16_bits(x[i])
    if i < grid.shape[0]:
        out_e4m3[i] = qat.e4m3_code(grid[i])


def test_scalar_encoders_match_numpy():
    """bf16 rounding (ties, carries, subnormals, ±0, inf) and every e4m3 code, both signs."""
    rng = fresh_rng()
    u = rng.integers(0, 2 ** 32, 96, dtype=np.uint64).astype(np.uint32)
    u[:16] = (u[:16] & 0xFFFF0000) | 0x8000  # exact bf16 ties
    u[16:24] &= 0x807FFFFF  # float32 subnormals
    u[24:28] = [0, 0x80000000, 0x7F800000, 0x7F7FFFFF]  # ±0, inf, max (rounds to inf)
    u[28:32] = (u[28:32] & 0x80FFFFFF) | 0x00FF8000  # mantissa carries into the exponent
    u[~np.isfinite(u.view(np.float32)) & (u != 0x7F800000)] = 1  # NaN payloads are not specified
    x = u.view(np.float32)
    codes = np.array([c for c in range(256) if c not in (0x7F, 0xFF, 0x80)])
    grid = kp.E4M3_VALUES[codes]
    ob, oe = cuda.device_array(96, np.int32), cuda.device_array(len(codes), np.int32)
    _codecs[8, 32](ob, cuda.to_device(x), oe, cuda.to_device(grid))
    assert np.array_equal(ob.copy_to_host(), float32_to_bf16(x).astype(np.int32))
    assert np.array_equal(oe.copy_to_host(), codes)


# ---- Hadamard + FP4 ---------------------------------------------------------------------------
# the launcher's three kernels; the warp one with 4 warps a block, so that blocks have warps
# past the last vector (which must not store)
FORMS = dict(naive=dict(naive=True, threads=THREADS), block=dict(warp=False, threads=THREADS),
             warp=dict(warp=True, threads=128))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T,H,DI", [(2, 3, 64), (1, 2, 128), (3, 1, 32), (1, 1, 512)])
def test_hadamard_fp4_matches_matrix_product(form, T, H, DI):
    rng = fresh_rng()
    x = (rng.normal(size=(T, H, DI)) * np.exp(rng.normal(size=(T, H, 1)) * 2)).astype(np.float32)
    dx = cuda.to_device(x)
    rot, q = poisoned(x.shape), poisoned(x.shape)
    qat.hadamard_fp4(rot, dx, False, **FORMS[form])
    qat.hadamard_fp4(q, dx, True, **FORMS[form])
    rot, q = rot.copy_to_host(), q.copy_to_host()
    ref = np.empty(x.shape)
    qat.hadamard_fp4_ref(ref, x, False)
    assert rel_err(rot, ref) <= 1e-6
    # the FP4 step is exactly numerics' round-trip of the rotated float32 vector ...
    assert np.array_equal(q, fp4_roundtrip(rot, 32))
    # ... and the fused op matches the float64 reference except for rare ties broken by the
    # last bit of the rotation (a flip moves one element by one FP4 step)
    qat.hadamard_fp4_ref(ref, x, True)
    flips = np.count_nonzero(q != ref.astype(np.float32))
    assert flips <= max(1, x.size // 1000)


@pytest.mark.parametrize("form", FORMS)
def test_hadamard_fp4_with_rope_first(form):
    """``rope=``: the decode's indexer query, RoPE'd on the way in = rope then the rotation."""
    from pocketfm.kernels import norm_rope
    from pocketfm.numerics import rope_frequencies

    rng = fresh_rng()
    T, H, DI, R = 2, 3, 64, 16
    x = rng.normal(size=(T, H, DI)).astype(np.float32)
    pos = rng.integers(0, 1 << 20, T).astype(np.int32)
    freqs = rope_frequencies(R, 160000.0, 16.0, 65536)
    roped = np.empty((T, H, DI))
    norm_rope.rope_ref(roped, x.astype(np.float64), pos, freqs, False)
    ref = np.empty((T, H, DI))
    qat.hadamard_fp4_ref(ref, roped, False)
    dx, rope = cuda.to_device(x), (cuda.to_device(pos), cuda.to_device(freqs))
    rot, q = poisoned(x.shape), poisoned(x.shape)
    qat.hadamard_fp4(rot, dx, False, **FORMS[form], rope=rope)
    qat.hadamard_fp4(q, dx, True, **FORMS[form], rope=rope)
    rot = rot.copy_to_host()
    assert rel_err(rot, ref) <= 1e-6
    assert np.array_equal(dx.copy_to_host(), x)  # x itself is not rotated
    flips = np.count_nonzero(q.copy_to_host() != fp4_roundtrip(rot, 32))
    assert flips <= max(1, x.size // 1000)


@pytest.mark.parametrize("form", FORMS)
def test_hadamard_fp4_ties_to_even(form):
    """DI = 64 makes 1/sqrt(DI) = 1/8 exact: choose the rotated vector y on FP4 ties, send
    x = y @ H (exact), and the kernel must see y exactly and round every tie to the even code."""
    rng = fresh_rng()
    DI = 64
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = rng.choice(ties, (2, 1, DI)) * rng.choice([-1.0, 1.0], (2, 1, DI))
    y[..., ::32] = 4.0  # block max 4·2**s pins every block scale to 2**s
    y *= 2.0 ** rng.integers(-4, 4)
    x = (y @ hadamard_matrix(DI)).astype(np.float32)
    assert np.array_equal(x.astype(np.float64) @ hadamard_matrix(DI), y)
    out = poisoned(x.shape)
    qat.hadamard_fp4(out, cuda.to_device(x), True, **FORMS[form])
    assert np.array_equal(out.copy_to_host(), fp4_roundtrip(y, 32).astype(np.float32))


@pytest.mark.parametrize("DI", [128, 64, 32])
def test_index_key_pack_bit_exact(DI):
    rng = fresh_rng()
    N = 5
    x = (rng.normal(size=(N, DI)) * np.exp(rng.normal(size=(N, 1)) * 3)).astype(np.float32)
    x = fp4_roundtrip(x @ hadamard_matrix(DI).astype(np.float32), 32)
    x[1] = 0.0
    x[2, :32] = 0.5 * 2.0 ** -100  # tiny scale, and blocks whose max is every FP4 magnitude
    mags = kp.FP4_VALUES[1:8]
    for b in range(DI // 32):  # each block's max a different FP4 magnitude: every recovery case
        top = mags[(b + int(rng.integers(7))) % 7]
        blk = rng.choice(np.append(mags[mags <= top], 0.0), 32) * rng.choice([-1, 1], 32)
        blk[int(rng.integers(32))] = top
        x[3, 32 * b:32 * b + 32] = blk * 2.0 ** rng.integers(-8, 8)
    nbytes = kp.index_key_bytes(DI)
    out = cuda.to_device(np.full((N, nbytes), 0xAB, np.uint8))
    qat.index_key_pack(out, cuda.to_device(x), threads=THREADS)
    ref = np.empty((N, nbytes), np.uint8)
    qat.index_key_pack_ref(ref, x)
    assert np.array_equal(out.copy_to_host(), ref)
