"""Packed cache formats: lossless after the model's round-trips; device codecs equal the tables."""
import numpy as np
import pytest
from numba import cuda

from pocketfm.kernels import kvpack as kp
from pocketfm.numerics import fp4_roundtrip, fp8_roundtrip
from pocketfm.quants import bf16_to_float32, float32_to_bf16


def fp8_entries(rng, n, K, R):
    x = (rng.normal(size=(n, K)) * np.exp(rng.normal(size=(n, 1)) * 2)).astype(np.float32)
    x[:, :K - R] = fp8_roundtrip(x[:, :K - R], 64)
    x[0] = 0.0  # an all-zero entry packs too
    return x


@pytest.mark.parametrize("K,R", [(512, 64), (128, 64), (144, 16)])
def test_kv_pack_is_lossless_on_fp8_values(K, R):
    rng = np.random.default_rng()
    x = fp8_entries(rng, 33, K, R)
    p = np.empty((33, kp.kv_entry_bytes(K, R)), np.uint8)
    kp.pack_kv_ref(p, x, R)
    y = np.empty_like(x)
    kp.unpack_kv_ref(y, p, R)
    assert np.array_equal(y[:, :K - R], x[:, :K - R])  # FP8 part exact
    assert np.array_equal(y[:, K - R:], bf16_to_float32(float32_to_bf16(x[:, K - R:])))
    assert kp.kv_entry_bytes(512, 64) == 584 and p.shape[1] % 8 == 0


def test_kv_pack_refuses_values_off_the_grid():
    x = np.random.default_rng().normal(size=(2, 128)).astype(np.float32)
    with pytest.raises(ValueError, match="FP8 grid"):
        kp.pack_kv_ref(np.empty((2, kp.kv_entry_bytes(128, 64)), np.uint8), x, 64)


@pytest.mark.parametrize("DI", [128, 64, 32])
def test_index_key_pack_is_lossless_on_fp4_values(DI):
    rng = np.random.default_rng()
    x = fp4_roundtrip(rng.normal(size=(17, DI)).astype(np.float32) * 3, 32)
    x[1] = 0.0
    p = np.empty((17, kp.index_key_bytes(DI)), np.uint8)
    kp.pack_index_key_ref(p, x)
    y = np.empty_like(x)
    kp.unpack_index_key_ref(y, p)
    assert np.array_equal(y, x)
    assert kp.index_key_bytes(128) == 68


@cuda.jit
def _decode_all(out_e4m3, out_e2m1, out_ue8m0, bf16_in, out_bf16):
    i = cuda.grid(1)
    if i < 256:
        out_e4m3[i] = kp.e4m3_decode(i)
        out_ue8m0[i] = kp.ue8m0_decode(i) if i < 255 else 0.0
    if i < 16:
        out_e2m1[i] = kp.e2m1_decode(i)
    if i < bf16_in.shape[0]:
        u = int(bf16_in[i])
        out_bf16[i] = kp.bf16_decode(u & 255, u >> 8)


def test_device_codecs_match_tables():
    rng = np.random.default_rng()
    bf = float32_to_bf16((rng.normal(size=64) * 10.0 ** rng.integers(-30, 30, 64)).astype(np.float32))
    e4, e2, ue, ob = (cuda.device_array(n, np.float32) for n in (256, 16, 256, 64))
    _decode_all[8, 32](e4, e2, ue, cuda.to_device(bf), ob)
    ok = ~np.isnan(kp.E4M3_VALUES)
    assert np.array_equal(e4.copy_to_host()[ok], kp.E4M3_VALUES[ok])
    assert np.array_equal(e2.copy_to_host(), kp.FP4_VALUES)
    assert np.array_equal(ue.copy_to_host()[:255], np.ldexp(1.0, np.arange(255) - 127).astype(np.float32))
    assert np.array_equal(ob.copy_to_host(), bf16_to_float32(bf))
