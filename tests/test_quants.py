"""pocketfm.quants: known-value blocks from the spec formulas (deepseek_v4.md §7.4), then bit-exact
agreement with gguf-py on fully random blocks, conversions, and the synthetic-weight generator."""
import struct

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from pocketfm import quants
from pocketfm.quants import GGMLType

BLOCK_TYPES = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS, GGMLType.MXFP4]
# where each block type keeps its f16 scales (byte offsets), or its ue8m0 exponent (MXFP4)
F16_OFFSETS = {GGMLType.Q8_0: [0], GGMLType.Q2_K: [80, 82], GGMLType.Q4_K: [0, 2],
               GGMLType.IQ2_XXS: [0], GGMLType.MXFP4: []}


def f16_bytes(x: float) -> list[int]:
    return list(struct.pack("<e", x))


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """Equal as float32 bit patterns: stricter than ==, and NaN == NaN."""
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def random_raw_blocks(qtype: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Fully random bytes [n_blocks, bytes], with finite f16 scales and MXFP4 exponents < 251."""
    nbytes = quants.BLOCK_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    for off in F16_OFFSETS[qtype]:
        h = rng.integers(0, 2**16, n_blocks, dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h)  # exponent all ones (inf/NaN) -> finite
        blocks[:, off:off + 2] = h.astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    if qtype == GGMLType.MXFP4:
        blocks[:, 0] = rng.integers(0, 251, n_blocks)  # 2^(250-127) * 6 is still finite
    return blocks


# --- tables and sizes ----------------------------------------------------------------------------

def test_block_sizes_match_ggml():
    for t, size in quants.BLOCK_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[GGMLType(t)] == size
    assert quants.SUPPORTED_TYPES == {0, 1, 30, 8, 10, 12, 16, 39, 26}


def test_tables_match_gguf():
    ksigns = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
    np.testing.assert_array_equal(quants.KSIGNS_IQ2XS, ksigns)
    gq.IQ2_XXS.init_grid()
    np.testing.assert_array_equal(quants.IQ2XXS_GRID, gq.IQ2_XXS.grid.reshape(256, 8))
    # ggml-common.h: iq2xxs_grid[0] = 0x0808080808080808, [1] = 0x080808080808082b
    assert quants.IQ2XXS_GRID[0].tolist() == [8] * 8
    assert quants.IQ2XXS_GRID[1].tolist() == [43] + [8] * 7


def test_type_name_and_row_bytes():
    assert quants.type_name(8) == "Q8_0" and quants.type_name(16) == "IQ2_XXS"
    assert quants.type_name(999) == "type 999"
    assert quants.row_bytes(GGMLType.Q8_0, 4096) == 4352
    assert quants.row_bytes(GGMLType.Q2_K, 2048) == 672
    assert quants.row_bytes(GGMLType.F16, 7) == 14
    with pytest.raises(ValueError, match="Q4_K"):
        quants.row_bytes(GGMLType.Q4_K, 4096 + 32)
    with pytest.raises(ValueError, match="MXFP4"):
        quants.row_bytes(GGMLType.MXFP4, 48)
    with pytest.raises(ValueError, match="not supported"):
        quants.row_bytes(GGMLType.Q6_K, 256)


# --- known values, from the formulas in the spec -------------------------------------------------

def test_q8_0_known_block():
    raw = np.array(f16_bytes(0.5) + [v & 255 for v in range(-16, 16)], np.uint8)
    x = quants.dequantize(raw[None], GGMLType.Q8_0)[0]
    assert x.tolist() == [0.5 * v for v in range(-16, 16)]


def test_q2_k_known_block():
    rng = np.random.default_rng(1)
    scales = rng.integers(0, 256, 16).tolist()
    qs = rng.integers(0, 256, 64).tolist()
    d, dmin = 0.25, 0.125
    raw = np.array(scales + qs + f16_bytes(d) + f16_bytes(dmin), np.uint8)
    x = quants.dequantize(raw[None], GGMLType.Q2_K)[0]
    for e in range(256):
        h, j, l = e // 128, e % 128 // 32, e % 32
        q = (qs[32 * h + l] >> (2 * j)) & 3
        s = scales[e // 16]
        assert x[e] == d * (s & 15) * q - dmin * (s >> 4), e
    # a literal one: element 0 is code bits 0..1 of qs[0], scaled by scales[0]
    assert x[0] == 0.25 * (scales[0] & 15) * (qs[0] & 3) - 0.125 * (scales[0] >> 4)


def test_q4_k_known_block():
    rng = np.random.default_rng(2)
    sc = [1, 20, 33, 63, 0, 17, 48, 62]  # values >= 16 exercise the split high bits
    mn = [5, 63, 16, 2, 40, 9, 31, 50]
    # pack per the layout: bytes 0..3 sc[0..3] | sc[4..7]>>4 <<6, bytes 4..7 the same for mn,
    # bytes 8..11 sc[4..7] & 15 | (mn[4..7] & 15) << 4
    packed = ([sc[b] | (sc[b + 4] >> 4) << 6 for b in range(4)]
              + [mn[b] | (mn[b + 4] >> 4) << 6 for b in range(4)]
              + [(sc[b + 4] & 15) | (mn[b + 4] & 15) << 4 for b in range(4)])
    qs = rng.integers(0, 256, 128).tolist()
    d, dmin = 0.5, 0.25
    raw = np.array(f16_bytes(d) + f16_bytes(dmin) + packed + qs, np.uint8)
    x = quants.dequantize(raw[None], GGMLType.Q4_K)[0]
    s = packed
    for e in range(256):
        b, p, l = e // 32, e // 64, e % 32
        nib = qs[32 * p + l] & 15 if b % 2 == 0 else qs[32 * p + l] >> 4
        if b < 4:
            scale, m = s[b] & 63, s[b + 4] & 63
        else:
            scale = (s[b + 4] & 15) + ((s[b - 4] >> 6) << 4)
            m = (s[b + 4] >> 4) + ((s[b] >> 6) << 4)
        assert (scale, m) == (sc[b], mn[b])
        assert x[e] == d * scale * nib - dmin * m, e
    got_sc, got_mn = quants.Q4_KBlock.unpack_scales(np.array([packed], np.uint8))
    assert got_sc[0].tolist() == sc and got_mn[0].tolist() == mn
    np.testing.assert_array_equal(quants.Q4_KBlock.pack_scales(got_sc, got_mn)[0], packed)


def test_iq2_xxs_known_block():
    grid = quants.IQ2XXS_GRID
    ksigns = [i | (bin(i).count("1") & 1) << 7 for i in range(128)]  # parity completes the byte
    rng = np.random.default_rng(3)
    d = 1.0
    idx = rng.integers(0, 256, (8, 4)).tolist()
    sign_idx = rng.integers(0, 128, (8, 4)).tolist()
    s = rng.integers(0, 16, 8).tolist()
    idx[0][0], sign_idx[0][0], s[0] = 0, 0, 0  # first 8 elements: grid row 0, no signs, s = 0
    idx[0][1], sign_idx[0][1] = 0, 1           # next 8: ksigns[1] = 0x81 -> elements 0, 7 negative
    raw = f16_bytes(d)
    for g in range(8):
        w = sum(sign_idx[g][i] << 7 * i for i in range(4)) | s[g] << 28
        raw += idx[g] + list(struct.pack("<I", w))
    x = quants.dequantize(np.array(raw, np.uint8)[None], GGMLType.IQ2_XXS)[0]
    for e in range(256):
        g, i, k = e // 32, e % 32 // 8, e % 8
        db = d * (0.5 + s[g]) / 4
        sign = -1 if ksigns[sign_idx[g][i]] >> k & 1 else 1
        assert x[e] == db * grid[idx[g][i]][k] * sign, e
    # d * 0.5 / 4 * 8 = 1
    assert x[:8].tolist() == [1.0] * 8
    assert x[8:16].tolist() == [-1.0] + [1.0] * 6 + [-1.0]


def test_mxfp4_known_block():
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # element i (< 16) in the low nibble of byte i, element i + 16 in the high nibble
    lo, hi = list(range(16)), list(range(15, -1, -1))
    for e, scale in [(127, 1.0), (130, 8.0), (120, 2.0**-7), (1, 2.0**-126), (0, 2.0**-127)]:
        raw = np.array([e] + [a | b << 4 for a, b in zip(lo, hi)], np.uint8)
        x = quants.dequantize(raw[None], GGMLType.MXFP4)[0]
        assert x.tolist() == [scale * e2m1[c] for c in lo + hi], e


# --- bit-exact against gguf-py on fully random blocks --------------------------------------------

@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype):
    rng = np.random.default_rng(100 + qtype)
    blocks_per_row = 16 if quants.BLOCK_SIZES[qtype][0] == 256 else 64
    blocks = random_raw_blocks(qtype, 96 * blocks_per_row, rng)  # >= 1536 blocks
    data = blocks.reshape(96, -1)  # [rows, row_bytes]
    ours = quants.dequantize(data, qtype)
    assert ours.shape == (96, blocks_per_row * quants.BLOCK_SIZES[qtype][0])
    assert_bits_equal(ours, gq.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_records_round_trip_and_slicing(qtype, monkeypatch):
    rng = np.random.default_rng(200 + qtype)
    elems, nbytes = quants.BLOCK_SIZES[qtype]
    blocks = random_raw_blocks(qtype, 24, rng)
    record = quants.BLOCK_RECORDS[qtype]
    np.testing.assert_array_equal(record.from_bytes(blocks).to_bytes(), blocks)
    # a 3-D tensor, decoded in slices of 5 blocks, equals the one-slice decode
    data = blocks.reshape(2, 3, 4 * nbytes)
    whole = quants.dequantize(data, qtype)
    monkeypatch.setattr(quants, "_DEQUANT_SLICE_BLOCKS", 5)
    assert whole.shape == (2, 3, 4 * elems)
    assert_bits_equal(quants.dequantize(data, qtype), whole)


def test_dequantize_rejects_bad_block_data():
    with pytest.raises(ValueError, match="uint8"):
        quants.dequantize(np.zeros((2, 34), np.float32), GGMLType.Q8_0)
    with pytest.raises(ValueError, match="34"):
        quants.dequantize(np.zeros((2, 35), np.uint8), GGMLType.Q8_0)
    with pytest.raises(ValueError, match="not supported"):
        quants.dequantize(np.zeros((2, 210), np.uint8), GGMLType.Q6_K)


# --- plain types and conversions -----------------------------------------------------------------

def test_plain_types_pass_through():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    np.testing.assert_array_equal(quants.dequantize(x, GGMLType.F32), x)
    np.testing.assert_array_equal(quants.dequantize(x.view(np.uint8), GGMLType.F32), x)
    h = x.astype(np.float16)
    assert_bits_equal(quants.dequantize(h, GGMLType.F16), h.astype(np.float32))
    assert_bits_equal(quants.dequantize(h.view(np.uint8), GGMLType.F16), h.astype(np.float32))
    i = rng.integers(-(2**31), 2**31, (3, 8), dtype=np.int32)
    got = quants.dequantize(i, GGMLType.I32)
    assert got.dtype == np.int32 and np.array_equal(got, i)
    b = quants.float32_to_bf16(x)
    want = gq.dequantize(b.view(np.uint8), GGMLType.BF16)
    assert_bits_equal(quants.dequantize(b.view(np.uint8), GGMLType.BF16), want)  # as GGUFReader
    assert_bits_equal(quants.dequantize(b, GGMLType.BF16), want)                 # as uint16


def test_bf16_round_to_nearest_even():
    cases = [  # (float32, bf16 bits); a list, since 0.0 and -0.0 are equal dict keys
        (1.0, 0x3F80), (-2.0, 0xC000),
        (1 + 2**-8, 0x3F80),           # tie: rounds down to the even mantissa
        (1 + 3 * 2**-8, 0x3F82),       # tie: rounds up to the even mantissa
        (1 + 2**-8 + 2**-20, 0x3F81),  # just above the tie
        (1 + 2**-8 - 2**-20, 0x3F80),  # just below the tie
        (float(np.finfo(np.float32).max), 0x7F80),  # rounds up to inf
        (float("inf"), 0x7F80), (float("-inf"), 0xFF80), (0.0, 0x0000), (-0.0, 0x8000),
    ]
    got = quants.float32_to_bf16(np.array([x for x, _ in cases], np.float32))
    assert [hex(v) for v in got] == [hex(b) for _, b in cases]
    nan = quants.float32_to_bf16(np.float32("nan"))
    assert np.isnan(quants.bf16_to_float32(nan)) and nan & 0x40  # stays a quiet NaN
    # and the same bits as gguf-py (= ggml_compute_fp32_to_bf16) on random floats
    rng = np.random.default_rng(5)
    x = rng.integers(0, 2**32, 20000, dtype=np.uint32).view(np.float32)
    np.testing.assert_array_equal(quants.float32_to_bf16(x).view(np.uint8), gq.quantize(x, 30))
    b = rng.integers(0, 2**16, 20000, dtype=np.uint16)
    b = b[~np.isnan(quants.bf16_to_float32(b))]
    np.testing.assert_array_equal(quants.float32_to_bf16(quants.bf16_to_float32(b)), b)


def test_quantize_q8_0_matches_gguf():
    rng = np.random.default_rng(6)
    x = (rng.normal(size=(64, 512)) * rng.uniform(1e-3, 10, (64, 1))).astype(np.float32)
    x[0, :32] = 0                                 # an all-zero block: d = 0, q = 0
    x[1, :32] = np.arange(32) - 15.5              # halves after scaling: round away from zero
    x[2, :32] = np.float32(127) * np.arange(-16, 16) / 16
    q = quants.quantize_q8_0(x)
    assert q.dtype == np.uint8 and q.shape == (64, 512 // 32 * 34)
    np.testing.assert_array_equal(q, gq.quantize(x, GGMLType.Q8_0))
    # error per element <= half a step, the step being the f16-rounded d
    y = quants.dequantize(q, GGMLType.Q8_0)
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    err = np.abs(y - x).reshape(-1, 32)
    assert (err <= 0.5 * d * (1 + 2**-10) + 128 * d * 2**-11).all()
    with pytest.raises(ValueError):
        quants.quantize_q8_0(np.zeros(48, np.float32))


# --- synthetic weights ---------------------------------------------------------------------------

RANDOM_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, *BLOCK_TYPES]


@pytest.mark.parametrize("qtype", RANDOM_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("std", [0.02, 1.0])
def test_random_blocks_statistics(qtype, std):
    shape = (4, 32, 512)
    raw = quants.random_blocks(qtype, shape, np.random.default_rng(7), std)
    assert raw.dtype == np.uint8 and raw.shape == (4, 32, quants.row_bytes(qtype, 512))
    x = quants.dequantize(raw, qtype)
    assert x.shape == shape and np.isfinite(x).all()
    assert abs(x.std() / std - 1) < 0.3
    assert abs(x.mean()) < 0.05 * std
    again = quants.random_blocks(qtype, shape, np.random.default_rng(7), std)
    np.testing.assert_array_equal(raw, again)
    other = quants.random_blocks(qtype, shape, np.random.default_rng(8), std)
    assert not np.array_equal(raw, other)


def test_random_blocks_writes_a_gguf_that_reads_back(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    tensors = {t: quants.random_blocks(t, (2, 256), np.random.default_rng(9), 0.1)
               for t in RANDOM_TYPES}
    for t, raw in tensors.items():
        writer.add_tensor(f"w.{t.name}", raw, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in gguf.GGUFReader(str(path)).tensors:
        t = GGMLType(tensor.tensor_type)
        assert tensor.shape.tolist() == [256, 2]  # ggml order: row length first
        want = quants.dequantize(tensors[t], t)
        np.testing.assert_array_equal(quants.dequantize(tensor.data, t), want)
