"""Numerics that are part of the model: FP8/FP4 round-trips, Hadamard-128, RoPE/YaRN tables.

The round-trips reproduce DeepSeek-V4's quantisation-aware training (spec §4.8, §8b.3): they are
not an engine's storage choice but the model as trained, and they are on by default. Scales are
powers of two derived from float32 arithmetic exactly as the reference computes them, so a value
that sits on a rounding boundary lands where the reference puts it.
"""
from __future__ import annotations

import math

import numpy as np

FP8_MAX = 448.0  # largest finite e4m3fn value
FP4_MAX = 6.0  # largest e2m1 value
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # e2m1 magnitudes by code


def _pow2_ceil_scale(amax: np.ndarray, inv_max: float) -> np.ndarray:
    """``2 ** ceil(log2(amax * fl32(1/max)))`` with ceil(log2) read from the float32 exponent bits.

    frexp gives y = m · 2**e with m in [0.5, 1): log2 y is exactly e - 1 when m == 0.5 (a power of
    two) and lies in (e - 1, e) otherwise, so its ceiling is e - (m == 0.5).
    """
    y = amax.astype(np.float32) * np.float32(inv_max)
    m, e = np.frexp(y)
    return np.ldexp(np.float32(1.0), e - (m == 0.5)).astype(np.float64)


def _round_e4m3(v: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3fn value, ties to even; |v| <= 448 on entry."""
    a = np.abs(v)
    _, e = np.frexp(np.maximum(a, 2.0 ** -6))  # normal range starts at 2**-6 (E = 1)
    step = np.ldexp(1.0, e - 1 - 3)  # 3 mantissa bits; subnormals share the 2**-9 step
    return np.round(v / step) * step  # np.round rounds half to even


def _round_e2m1(v: np.ndarray) -> np.ndarray:
    """Round to the nearest e2m1 magnitude, ties to the even code; |v| <= 6 on entry."""
    a = np.abs(v)
    lo = np.clip(np.searchsorted(FP4_GRID, a, side="right") - 1, 0, 6)
    hi = lo + 1
    d_lo, d_hi = a - FP4_GRID[lo], FP4_GRID[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.sign(v) * FP4_GRID[np.where(pick_hi, hi, lo)]


def fp8_roundtrip(x: np.ndarray, block: int = 64) -> np.ndarray:
    """E4M3 round-trip over blocks of ``block`` along the last axis (which it must divide)."""
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), 1e-4)
    s = _pow2_ceil_scale(amax, 1.0 / FP8_MAX)
    q = _round_e4m3(np.clip(xb / s, -FP8_MAX, FP8_MAX))
    return (q * s).reshape(shp).astype(x.dtype)


def fp4_roundtrip(x: np.ndarray, block: int = 32) -> np.ndarray:
    """E2M1 round-trip over blocks of ``block`` along the last axis."""
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), FP4_MAX * 2.0 ** -126)
    s = _pow2_ceil_scale(amax, 1.0 / FP4_MAX)
    q = _round_e2m1(np.clip(xb / s, -FP4_MAX, FP4_MAX))
    return (q * s).reshape(shp).astype(x.dtype)


def hadamard_matrix(n: int) -> np.ndarray:
    """Orthonormal Sylvester Walsh–Hadamard matrix, H[i, j] = (-1)**popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return (1.0 - 2.0 * parity) / math.sqrt(n)


def rope_frequencies(rope_dim: int, base: float, yarn_factor: float = 1.0, orig_ctx: int = 0,
                     beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """Per-pair angular frequencies ω_i, i < rope_dim/2 (spec §4.5; YaRN is static, §8b.5).

    ``orig_ctx == 0`` means plain RoPE (window-only layers). Otherwise pairs below the YaRN ramp
    keep ``base**(-2i/R)``, pairs above it are divided by the factor, and the ramp interpolates.
    The magnitude factor is exactly 1 (no mscale).
    """
    i = np.arange(rope_dim // 2, dtype=np.float64)
    f = base ** (-2.0 * i / rope_dim)
    if orig_ctx <= 0 or yarn_factor == 1.0:
        return f

    def corr(n_rot):
        return rope_dim * math.log(orig_ctx / (2 * math.pi * n_rot)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    return f * (1.0 - ramp) + (f / yarn_factor) * ramp


def rope_tables(freqs: np.ndarray, positions: np.ndarray, dtype=np.float64):
    """cos/sin [T, R/2] of angle position·ω for the given absolute positions."""
    ang = np.asarray(positions, dtype=np.float64)[:, None] * freqs[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
