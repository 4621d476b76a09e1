"""GGML tensor types and their NumPy dequantisers: the spec the CUDA kernels are tested against.

Every block type is one named record (``Q8_0Block``, ``Q2_KBlock``, ...) whose fields are peeled
off the raw bytes in on-disk order, with the byte layout in the class comment
(deepseek_v4.md §7.4). ``Record.from_bytes`` and ``Record.to_bytes`` are exact inverses, and
``Record.dequantize`` is the reference math, vectorised over all blocks. Each one equals
``gguf.quants.dequantize`` bit for bit (tests/test_quants.py): the float32 operations are done in
the same order as in gguf-py / ggml, so a kernel that copies the order copies the bits.

Letters: B blocks; a tensor row holds ``row_elems`` elements in ``row_bytes`` bytes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from pocketfm.errors import InputError

QK_K = 256  # elements in a "K" / "IQ" super-block

# --- tables ------------------------------------------------------------------------------------

# IQ2_XXS codebook: 256 grid points of 8 magnitudes, each from {8, 25, 43}. gguf-py ships it packed
# two bits per magnitude (ggml-common.h `iq2xxs_grid` holds the same values as bytes of a uint64).
gguf.quants.IQ2_XXS.init_grid()
IQ2XXS_GRID = gguf.quants.IQ2_XXS.grid.reshape(256, 8).astype(np.float32)  # [256, 8]

# ksigns_iq2xs: 7 stored sign bits plus an 8th implied by even parity (an even count of minus
# signs), so index i maps to i | parity(i) << 7. Derived rather than copied; tests check it.
_IDX7 = np.arange(128, dtype=np.uint8)
_PARITY7 = np.unpackbits(_IDX7[:, None], axis=1).sum(axis=1).astype(np.uint8) & 1
KSIGNS_IQ2XS = _IDX7 | (_PARITY7 << 7)  # [128] uint8

# kvalues_mxfp4: e2m1 code -> value, DOUBLED so the table is integer; the scale is halved to
# match (see MXFP4Block). Bit 3 is the sign; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

_SHIFT_2BIT = np.array([0, 2, 4, 6], np.uint8)  # four 2-bit codes per byte
_SHIFT_4BIT = np.array([0, 4], np.uint8)        # low nibble first, then high nibble
_SHIFT_SIGN = np.array([0, 7, 14, 21], np.uint32)  # four 7-bit sign indices in an IQ2 word
_BITS_8 = np.arange(8, dtype=np.uint8)


# --- byte helpers ------------------------------------------------------------------------------

def _peel(blocks: np.ndarray, *widths: int) -> list[np.ndarray]:
    """Split uint8 blocks [B, bytes] into consecutive column ranges, in on-disk order."""
    assert sum(widths) == blocks.shape[-1], (widths, blocks.shape)
    return np.split(blocks, np.cumsum(widths)[:-1], axis=-1)


def _as_bytes(x: np.ndarray, n_blocks: int) -> np.ndarray:
    """Any little-endian field array [B, ...] -> its bytes as uint8 [B, k]."""
    return np.ascontiguousarray(x).view(np.uint8).reshape(n_blocks, -1)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes [B, 2] -> an IEEE half [B, 1] (kept as f16; widening happens in dequantize)."""
    return b.view("<f2")


# --- block records -----------------------------------------------------------------------------

class Q8_0Block(NamedTuple):
    """Q8_0: 32 elements in 34 bytes; x = d * q.

    bytes 0..1   d  f16       block scale (amax / 127 when quantised)
    bytes 2..33  q  int8[32]  element e is q[e]
    """
    d: np.ndarray  # [B, 1] f16
    q: np.ndarray  # [B, 32] int8
    ELEMS, BYTES = 32, 34

    @classmethod
    def from_bytes(cls, blocks: np.ndarray) -> Q8_0Block:
        d, q = _peel(blocks, 2, 32)
        return cls(_f16(d), q.view(np.int8))

    def to_bytes(self) -> np.ndarray:
        n = len(self.d)
        return np.concatenate([_as_bytes(self.d, n), _as_bytes(self.q, n)], axis=1)

    def dequantize(self) -> np.ndarray:  # [B, 32] f32
        return self.q.astype(np.float32) * self.d.astype(np.float32)


class Q2_KBlock(NamedTuple):
    """Q2_K: 256 elements in 84 bytes: 16 sub-blocks of 16, 2-bit codes, 4-bit scale and min each.

    bytes  0..15  scales[16]  sub-block e // 16: low nibble = scale, high nibble = min
    bytes 16..79  qs[64]      byte 32h + l holds element 128h + 32j + l in bits 2j..2j+1
    bytes 80..81  d    f16    multiplies the 4-bit scales
    bytes 82..83  dmin f16    multiplies the 4-bit mins
    x = d * (scale & 15) * q - dmin * (scale >> 4)
    """
    scales: np.ndarray  # [B, 16] uint8
    qs: np.ndarray      # [B, 64] uint8
    d: np.ndarray       # [B, 1] f16
    dmin: np.ndarray    # [B, 1] f16
    ELEMS, BYTES = QK_K, 84

    @classmethod
    def from_bytes(cls, blocks: np.ndarray) -> Q2_KBlock:
        scales, qs, d, dmin = _peel(blocks, 16, 64, 2, 2)
        return cls(scales, qs, _f16(d), _f16(dmin))

    def to_bytes(self) -> np.ndarray:
        n = len(self.d)
        return np.concatenate([_as_bytes(f, n) for f in self], axis=1)

    def codes(self) -> np.ndarray:
        """The 2-bit codes in element order, [B, 16 sub-blocks, 16]."""
        n = len(self.d)
        # [B, h, 1, l] >> [j] -> [B, h, j, l]: element 128h + 32j + l
        q = (self.qs.reshape(n, 2, 1, 32) >> _SHIFT_2BIT.reshape(1, 1, 4, 1)) & np.uint8(3)
        return q.reshape(n, 16, 16)

    def dequantize(self) -> np.ndarray:  # [B, 256] f32
        n = len(self.d)
        # Scale and min are applied as two products, (d*sc)*q - (dmin*mn), as ggml does.
        dl = (self.d.astype(np.float32) * (self.scales & 15).astype(np.float32)).reshape(n, 16, 1)
        ml = (self.dmin.astype(np.float32) * (self.scales >> 4).astype(np.float32))
        y = dl * self.codes().astype(np.float32) - ml.reshape(n, 16, 1)
        return y.reshape(n, QK_K)


class Q4_KBlock(NamedTuple):
    """Q4_K: 256 elements in 144 bytes: 8 sub-blocks of 32, 4-bit codes, 6-bit scale and min each.

    bytes  0..1    d    f16     multiplies the 6-bit scales
    bytes  2..3    dmin f16     multiplies the 6-bit mins
    bytes  4..15   scales[12]   8 scales sc[b] and 8 mins mn[b], 6 bits each:
                     bytes 0..3   sc[0..3] in bits 0..5, sc[4..7] >> 4 in bits 6..7
                     bytes 4..7   mn[0..3] in bits 0..5, mn[4..7] >> 4 in bits 6..7
                     bytes 8..11  sc[4..7] & 15 in bits 0..3, mn[4..7] & 15 in bits 4..7
    bytes 16..143  qs[128]      byte 32p + l: element 64p + l (low nibble), 64p + 32 + l (high)
    x = d * sc[e // 32] * nibble - dmin * mn[e // 32]
    """
    d: np.ndarray       # [B, 1] f16
    dmin: np.ndarray    # [B, 1] f16
    scales: np.ndarray  # [B, 12] uint8, packed as above
    qs: np.ndarray      # [B, 128] uint8
    ELEMS, BYTES = QK_K, 144

    @classmethod
    def from_bytes(cls, blocks: np.ndarray) -> Q4_KBlock:
        d, dmin, scales, qs = _peel(blocks, 2, 2, 12, 128)
        return cls(_f16(d), _f16(dmin), scales, qs)

    def to_bytes(self) -> np.ndarray:
        n = len(self.d)
        return np.concatenate([_as_bytes(f, n) for f in self], axis=1)

    @staticmethod
    def unpack_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Packed scales [B, 12] -> six-bit (sc [B, 8], mn [B, 8]), as ggml get_scale_min_k4."""
        lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
        sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
        mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
        return sc, mn

    @staticmethod
    def pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
        """Inverse of ``unpack_scales``: six-bit sc, mn [B, 8] -> packed uint8 [B, 12]."""
        sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
        lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        mid = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
        hi = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
        return np.concatenate([lo, mid, hi], axis=1)

    def dequantize(self) -> np.ndarray:  # [B, 256] f32
        n = len(self.d)
        sc, mn = self.unpack_scales(self.scales)
        dl = (self.d.astype(np.float32) * sc.astype(np.float32)).reshape(n, 8, 1)
        ml = (self.dmin.astype(np.float32) * mn.astype(np.float32)).reshape(n, 8, 1)
        # [B, p, 1, l] >> [0, 4] -> [B, p, half, l]: sub-block 2p + half
        q = (self.qs.reshape(n, 4, 1, 32) >> _SHIFT_4BIT.reshape(1, 1, 2, 1)) & np.uint8(15)
        return (dl * q.reshape(n, 8, 32).astype(np.float32) - ml).reshape(n, QK_K)


class IQ2_XXSBlock(NamedTuple):
    """IQ2_XXS: 256 elements in 66 bytes, 2.06 bits per weight: 8 groups of 32 = 4 x 8 elements.

    bytes 0..1   d f16
    bytes 2..65  8 groups of 8 bytes, group g covering elements 32g .. 32g + 31:
                   bytes 0..3  grid[4]  one IQ2XXS_GRID row (8 magnitudes) per 8 elements
                   bytes 4..7  w uint32 bits 7i..7i+6: sign index of the i-th 8 (KSIGNS_IQ2XS)
                                        bits 28..31: 4-bit group scale s
    x = d * (0.5 + s) / 4 * IQ2XXS_GRID[grid[i]][k] * (-1 if bit k of the sign byte else +1)
    """
    d: np.ndarray     # [B, 1] f16
    grid: np.ndarray  # [B, 8, 4] uint8
    w: np.ndarray     # [B, 8] uint32
    ELEMS, BYTES = QK_K, 66

    @classmethod
    def from_bytes(cls, blocks: np.ndarray) -> IQ2_XXSBlock:
        d, groups = _peel(blocks, 2, 64)
        groups = groups.reshape(-1, 8, 8)
        return cls(_f16(d), groups[:, :, :4], groups[:, :, 4:].view("<u4")[:, :, 0])

    def to_bytes(self) -> np.ndarray:
        n = len(self.d)
        w = np.ascontiguousarray(self.w, dtype="<u4").view(np.uint8).reshape(n, 8, 4)
        groups = np.concatenate([self.grid, w], axis=2).reshape(n, 64)
        return np.concatenate([_as_bytes(self.d, n), groups], axis=1)

    def dequantize(self) -> np.ndarray:  # [B, 256] f32
        n = len(self.d)
        # ggml: db = d * (0.5f + (w >> 28)) * 0.25f, evaluated left to right in float32.
        s = (self.w >> 28).astype(np.float32)
        db = self.d.astype(np.float32) * (np.float32(0.5) + s) * np.float32(0.25)  # [B, 8]
        sign_idx = (self.w[:, :, None] >> _SHIFT_SIGN) & np.uint32(127)  # [B, 8, 4]
        neg = (KSIGNS_IQ2XS[sign_idx][..., None] >> _BITS_8) & np.uint8(1)  # [B, 8, 4, 8]
        sign = np.where(neg == 0, np.float32(1), np.float32(-1))
        mag = IQ2XXS_GRID[self.grid]  # [B, 8, 4, 8]
        return (db[:, :, None, None] * mag * sign).reshape(n, QK_K)


class MXFP4Block(NamedTuple):
    """MXFP4 (OCP microscaling): 32 elements in 17 bytes; x = 2^(e - 127) * e2m1(nibble).

    byte  0      e uint8   shared ue8m0 exponent (bias 127)
    bytes 1..16  qs[16]    byte i: element i in the low nibble, element i + 16 in the high nibble
    ggml keeps the e2m1 table doubled (KVALUES_MXFP4) and halves the scale to 2^(e - 128)
    (GGML_E8M0_TO_FP32_HALF); the product is the same, and so are the float32 bits.
    """
    e: np.ndarray   # [B, 1] uint8
    qs: np.ndarray  # [B, 16] uint8
    ELEMS, BYTES = 32, 17

    @classmethod
    def from_bytes(cls, blocks: np.ndarray) -> MXFP4Block:
        e, qs = _peel(blocks, 1, 16)
        return cls(e, qs)

    def to_bytes(self) -> np.ndarray:
        return np.concatenate([self.e, self.qs], axis=1).astype(np.uint8)

    @staticmethod
    def half_scale(e: np.ndarray) -> np.ndarray:
        """2^(e - 128) as float32 bits: exponent field e - 1, or a subnormal when e < 2."""
        e32 = e.astype(np.uint32)
        subnormal = np.uint32(0x00200000) << e32  # 2^21 * 2^-149 = 2^-128 for e = 0
        bits = np.where(e32 < 2, subnormal, (e32 - np.uint32(1)) << np.uint32(23))
        return bits.astype(np.uint32).view(np.float32)

    def dequantize(self) -> np.ndarray:  # [B, 32] f32
        n = len(self.e)
        codes = (self.qs.reshape(n, 1, 16) >> _SHIFT_4BIT.reshape(1, 2, 1)) & np.uint8(15)
        return self.half_scale(self.e) * KVALUES_MXFP4[codes.reshape(n, 32)].astype(np.float32)


# --- type table --------------------------------------------------------------------------------

BLOCK_RECORDS = {
    GGMLType.Q8_0: Q8_0Block,
    GGMLType.Q2_K: Q2_KBlock,
    GGMLType.Q4_K: Q4_KBlock,
    GGMLType.IQ2_XXS: IQ2_XXSBlock,
    GGMLType.MXFP4: MXFP4Block,
}
_PLAIN = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16,
          GGMLType.I32: np.int32}

# type id -> (elements per block, bytes per block); plain types are blocks of one element.
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    **{t: (1, np.dtype(dt).itemsize) for t, dt in _PLAIN.items()},
    **{t: (r.ELEMS, r.BYTES) for t, r in BLOCK_RECORDS.items()},
}
SUPPORTED_TYPES: frozenset[int] = frozenset(BLOCK_SIZES)

# Bound the temporaries of a block dequant (IQ2_XXS makes several [B, 256] arrays) by working
# through a big tensor in slices of this many blocks; the loop is over slices, not blocks.
_DEQUANT_SLICE_BLOCKS = 1 << 16


def type_name(qtype: int) -> str:
    """'Q8_0', 'IQ2_XXS', ... or 'type N' for an id gguf does not know."""
    try:
        return GGMLType(qtype).name
    except ValueError:
        return f"type {qtype}"


def _block_size(qtype: int) -> tuple[int, int]:
    if qtype not in BLOCK_SIZES:
        supported = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
        raise InputError(f"tensor type {type_name(qtype)} is not supported"
                         f" (supported: {supported})")
    return BLOCK_SIZES[qtype]


def row_bytes(qtype: int, n_elems: int) -> int:
    """Bytes taken by one row of ``n_elems`` elements of type ``qtype``."""
    elems, nbytes = _block_size(qtype)
    if n_elems % elems:
        raise InputError(f"a {type_name(qtype)} row of {n_elems} elements is not a whole number"
                         f" of {elems}-element blocks")
    return n_elems // elems * nbytes


# --- conversions -------------------------------------------------------------------------------

def float32_to_bf16(x) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN (ggml)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    # Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to the even result.
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    return np.where(is_nan, (u >> 16) | np.uint32(64), rounded).astype(np.uint16)


def bf16_to_float32(u16) -> np.ndarray:
    """bf16 bits (uint16) -> float32: bf16 is the top half of a float32."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] (n % 32 == 0) -> Q8_0 bytes uint8 [..., n // 32 * 34], bit-equal to ggml."""
    x = np.asarray(x, dtype=np.float32)
    n_bytes = row_bytes(GGMLType.Q8_0, x.shape[-1])
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    # ggml multiplies by 1/d rather than dividing by d; the two differ in the last bit sometimes.
    inv_d = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = blocks * inv_d
    # C roundf: half away from zero (np.rint would round halves to even).
    a = np.abs(v)
    q = np.copysign(np.floor(a) + (a - np.floor(a) >= 0.5), v)
    record = Q8_0Block(d.astype("<f2"), q.astype(np.int8))
    return record.to_bytes().reshape(*x.shape[:-1], n_bytes)


# --- dequantize --------------------------------------------------------------------------------

def dequantize(data: np.ndarray, qtype: int) -> np.ndarray:
    """Decode a tensor's raw data to float32 [..., row_elems] (I32 stays int32).

    ``data`` is what gguf.GGUFReader returns: a typed array for F32 / F16 / I32, uint8
    [..., row_bytes] for BF16 and the block types. Raw uint8 bytes are accepted for every type,
    and BF16 may also come as uint16 [..., n]. F32 and I32 come back without a copy if possible.
    """
    elems, nbytes = _block_size(qtype)
    data = np.asarray(data)
    if qtype in _PLAIN:
        if data.dtype == np.uint8:
            data = np.ascontiguousarray(data).view(np.dtype(_PLAIN[qtype]).newbyteorder("<"))
        if qtype == GGMLType.I32:
            return data.astype(np.int32, copy=False)
        if qtype == GGMLType.BF16:
            return bf16_to_float32(data)
        return data.astype(np.float32, copy=False)

    if data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] % nbytes:
        raise InputError(f"{type_name(qtype)} data must be uint8 [..., k * {nbytes}],"
                         f" got {data.dtype} {data.shape}")
    record = BLOCK_RECORDS[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1, nbytes)  # [B, nbytes]
    out = np.empty((len(blocks), elems), np.float32)  # [B, elems]
    for lo in range(0, len(blocks), _DEQUANT_SLICE_BLOCKS):
        hi = lo + _DEQUANT_SLICE_BLOCKS
        out[lo:hi] = record.from_bytes(blocks[lo:hi]).dequantize()
    return out.reshape(*data.shape[:-1], data.shape[-1] // nbytes * elems)


# --- synthetic weights -------------------------------------------------------------------------

def _f16_scale(x: np.ndarray) -> np.ndarray:
    """Positive float scales -> f16, refusing ones that over- or underflow a half."""
    h = x.astype("<f2")
    if not (np.isfinite(h).all() and (h > 0).all()):
        raise ValueError("requested std needs block scales outside the float16 range")
    return h


def random_blocks(qtype: int, shape: tuple[int, ...], rng: np.random.Generator,
                  std: float) -> np.ndarray:
    """Random raw data uint8 [..., row_bytes] for a tensor of numpy ``shape``, dequantising to
    values with mean ~0 and std ~``std``. Deterministic for a given ``rng`` state.

    Block types get uniformly random codes and per-block scales of 0.5x..1.5x a base chosen from
    the code statistics below; mins are tied to the scales so each sub-block is centred on 0.
    """
    shape = tuple(shape)
    n_bytes = row_bytes(qtype, shape[-1])
    elems = BLOCK_SIZES[qtype][0]
    n = math.prod(shape) // elems  # blocks (or elements for plain types)
    out_shape = (*shape[:-1], n_bytes)

    def jitter() -> np.ndarray:  # [n, 1] per-block scale factor; E[u^2] = 13/12
        return rng.uniform(0.5, 1.5, (n, 1))

    def codes(k: int) -> np.ndarray:
        return rng.integers(0, 256, (n, k), dtype=np.uint8)

    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0):
        x = rng.normal(0.0, std, shape).astype(np.float32)
        if qtype == GGMLType.Q8_0:
            return quantize_q8_0(x)
        raw = {GGMLType.F32: x, GGMLType.F16: x.astype("<f2"), GGMLType.BF16: float32_to_bf16(x)}
        return raw[qtype].view(np.uint8).reshape(out_shape)

    if qtype == GGMLType.Q2_K:
        # x = d*sc*(q - mn/sc) with q uniform on 0..3 (mean 1.5, var 1.25): mn = 1.5 sc, so sc is
        # even and <= 10; E[sc^2] = 44 over {2, 4, 6, 8, 10}. dmin = d keeps the mean exactly 0.
        sc = rng.choice(np.arange(2, 11, 2, dtype=np.uint8), (n, 16))
        d = _f16_scale(std / math.sqrt(1.25 * 44 * 13 / 12) * jitter())
        record = Q2_KBlock(sc | ((sc * 3 // 2) << 4), codes(64), d, d)
    elif qtype == GGMLType.Q4_K:
        # Nibbles uniform on 0..15 (mean 7.5, var 21.25): mn = 7.5 sc, sc in {2, 4, 6, 8} so
        # mn <= 60 fits six bits; E[sc^2] = 30.
        sc = rng.choice(np.arange(2, 9, 2, dtype=np.uint8), (n, 8))
        d = _f16_scale(std / math.sqrt(21.25 * 30 * 13 / 12) * jitter())
        record = Q4_KBlock(d, d, Q4_KBlock.pack_scales(sc, sc * 15 // 2), codes(128))
    elif qtype == GGMLType.IQ2_XXS:
        # Random w: signs are symmetric (the parity bit too), s uniform on 0..15 gives
        # E[(0.5 + s)^2] = 85.25, and the grid rows have a known mean square.
        grid_ms = float(np.mean(IQ2XXS_GRID.astype(np.float64) ** 2))
        d = _f16_scale(4 * std / math.sqrt(85.25 * grid_ms * 13 / 12) * jitter())
        w = rng.integers(0, 2**32, (n, 8), dtype=np.uint32)
        record = IQ2_XXSBlock(d, codes(32).reshape(n, 8, 4), w)
    elif qtype == GGMLType.MXFP4:
        # Codes uniform over the 16 e2m1 values have mean square 8.5625, so we need 2^(e-127) =
        # std / 2.93 = 2^t. A power of two can't hit that: mix 2^k and 2^(k+1), k = floor(t), with
        # the share p of 2^(k+1) that makes the mean square right: p*4 + (1 - p) = 4^(t - k).
        t = math.log2(std / math.sqrt(8.5625))
        k = math.floor(t)
        p = (4 ** (t - k) - 1) / 3
        e = 127 + k + (rng.random((n, 1)) < p)
        if not (0 <= e.min() and e.max() <= 250):
            raise ValueError(f"std {std} is out of the MXFP4 exponent range")
        record = MXFP4Block(e.astype(np.uint8), codes(16))
    else:
        raise InputError(f"random_blocks does not make {type_name(qtype)} data")
    return record.to_bytes().reshape(out_shape)
