"""Packed cache formats (spec §6.3) and the scalar codecs the kernels decode them with.

Compressed/window KV entry, for head dim K with R rope dims (V4: K = 512, R = 64 -> 584 B)::

    bytes [0, K-R)              FP8 e4m3fn codes of dims 0 .. K-R-1 (blocks of 64 share a scale)
    bytes [K-R, K-R+2R)         dims K-R .. K-1 (the RoPE part) as little-endian bf16
    bytes [K+R, K+R+nb)         nb = (K-R)/64 ue8m0 scale bytes, 2**(b-127)
    pad to a multiple of 8      (584 = 73 x 8: every entry 8-byte aligned)

This is lossless for an entry that went through the model's FP8 round-trip (power-of-two block
scales, values on the e4m3 grid); the rope dims are rounded to bf16. Indexer key, FP4, for
index dim DI (V4: 128 -> 68 B)::

    bytes [0, DI/2)             e2m1 nibbles: element 2i in the low nibble, 2i+1 in the high
    bytes [DI/2, DI/2 + DI/32)  ue8m0 scale byte per block of 32
    pad to a multiple of 4

lossless after the model's Hadamard + FP4 round-trip. With QAT off the values are not on these
grids, so that mode stores entries unpacked (float32).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ..engine.layout import index_key_bytes, kv_entry_bytes  # noqa: F401 (sizes of these formats)
from ..quants import bf16_to_float32, float32_to_bf16

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


# ---- NumPy references -------------------------------------------------------------------------
def _e4m3_table() -> np.ndarray:
    """Value of every e4m3fn byte (NaN for 0x7F/0xFF), per the spec's codec table (§4.8)."""
    b = np.arange(256)
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
    v = np.where(s == 1, -v, v)
    v[(e == 15) & (m == 7)] = np.nan
    return v.astype(np.float32)


E4M3_VALUES = _e4m3_table()
_E4M3_SORTED = np.argsort(np.nan_to_num(E4M3_VALUES, nan=np.inf), kind="stable")


def _encode_e4m3(q: np.ndarray) -> np.ndarray:
    """Byte codes of values already on the e4m3 grid (exact lookup; -0 maps to +0)."""
    vals = E4M3_VALUES[_E4M3_SORTED]
    pos = np.searchsorted(vals, q)
    codes = _E4M3_SORTED[np.clip(pos, 0, 253)]
    if not np.array_equal(E4M3_VALUES[codes], q.astype(np.float32)):
        raise ValueError("pack_kv: values are not on the FP8 grid (was QAT switched off?)")
    return codes.astype(np.uint8)


def pack_kv_ref(out: np.ndarray, x: np.ndarray, rope_dim: int) -> None:
    """out[N, bytes] uint8 <- x[N, K] float32 entries that went through the FP8 round-trip."""
    n, K = x.shape
    nope = K - rope_dim
    nb = nope // 64
    blocks = x[:, :nope].reshape(n, nb, 64).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    # the round-trip's scale is a power of two >= amax/448; recover the smallest such that fits
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0)), -127)
    exp = np.clip(exp, -127, 127).astype(np.int64)
    scale = np.ldexp(1.0, exp)[:, :, None]
    out[...] = 0
    out[:, :nope] = _encode_e4m3((blocks / scale).reshape(n, nope))
    out[:, nope:nope + 2 * rope_dim] = float32_to_bf16(x[:, nope:]).view(np.uint8)
    out[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nb] = (exp + 127).astype(np.uint8)


def unpack_kv_ref(out: np.ndarray, packed: np.ndarray, rope_dim: int) -> None:
    """out[N, K] float32 <- packed[N, bytes] uint8."""
    K = out.shape[1]
    nope = K - rope_dim
    nb = nope // 64
    vals = E4M3_VALUES[packed[:, :nope]].reshape(len(out), nb, 64)
    sb = packed[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nb].astype(np.int64)
    out[:, :nope] = (vals * np.ldexp(1.0, sb - 127)[:, :, None]).reshape(len(out), nope)
    rope = np.ascontiguousarray(packed[:, nope:nope + 2 * rope_dim]).view(np.uint16)
    out[:, nope:] = bf16_to_float32(rope)


def pack_index_key_ref(out: np.ndarray, x: np.ndarray) -> None:
    """out[N, bytes] uint8 <- x[N, DI] float32 keys that went through the FP4 round-trip."""
    n, DI = x.shape
    blocks = x.reshape(n, DI // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 6.0)), -127)
    exp = np.clip(exp, -127, 127).astype(np.int64)
    q = (blocks / np.ldexp(1.0, exp)[:, :, None]).reshape(n, DI)
    mag = np.searchsorted(FP4_VALUES[:8], np.abs(q))
    if not np.array_equal(FP4_VALUES[:8][np.clip(mag, 0, 7)], np.abs(q)):
        raise ValueError("pack_index_key: values are not on the FP4 grid (was QAT switched off?)")
    codes = (mag + 8 * (np.signbit(q) & (q != 0))).astype(np.uint8)
    out[...] = 0
    out[:, :DI // 2] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    out[:, DI // 2:DI // 2 + DI // 32] = (exp + 127).astype(np.uint8)


def unpack_index_key_ref(out: np.ndarray, packed: np.ndarray) -> None:
    """out[N, DI] float32 <- packed[N, bytes] uint8."""
    n, DI = out.shape
    nib = packed[:, :DI // 2]
    codes = np.empty((n, DI), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = nib & 15, nib >> 4
    sb = packed[:, DI // 2:DI // 2 + DI // 32].astype(np.int64)
    out[...] = (FP4_VALUES[codes].reshape(n, DI // 32, 32)
                * np.ldexp(1.0, sb - 127)[:, :, None]).reshape(n, DI)


# ---- device codecs (simulator-safe: explicit int casts, math.ldexp with int exponents) --------
@cuda.jit(device=True)
def e4m3_decode(b):
    """Float value of an e4m3fn byte (the NaN codes are never produced by the packer)."""
    b = int(b)
    e = (b >> 3) & 15
    m = b & 7
    if e == 0:
        v = math.ldexp(float(m), -9)  # (m/8) * 2**-6
    else:
        v = math.ldexp(float(8 + m), e - 10)  # (1 + m/8) * 2**(e-7)
    return -v if b & 128 else v


@cuda.jit(device=True)
def ue8m0_decode(b):
    """2 ** (b - 127) for a ue8m0 scale byte."""
    return math.ldexp(1.0, int(b) - 127)


@cuda.jit(device=True)
def bf16_decode(lo, hi):
    """Float value of a little-endian bf16 given as two bytes (no bf16 type in the simulator)."""
    u = (int(hi) << 8) | int(lo)
    e = (u >> 7) & 255
    m = u & 127
    if e == 0:
        v = math.ldexp(float(m), -133)  # subnormal: m * 2**-126 / 128
    elif e == 255:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(128 + m), e - 134)  # (1 + m/128) * 2**(e-127)
    return -v if u & 32768 else v


@cuda.jit(device=True)
def e2m1_decode(nibble):
    """Float value of an e2m1 nibble: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    c = int(nibble) & 7
    if c < 4:
        v = 0.5 * c
    elif c < 6:
        v = float(c - 2)  # 4 -> 2, 5 -> 3
    else:
        v = 4.0 if c == 6 else 6.0
    return -v if int(nibble) & 8 else v
