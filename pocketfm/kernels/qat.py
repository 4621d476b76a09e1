"""QAT round-trips and the cache packers on the GPU (spec §4.8, §6.3, §8b.3–4).

The round-trips are part of the model (pocketfm/numerics.py): e4m3 in blocks of 64 on the
non-rope dims of every kv entry, Hadamard-DI + e2m1 in blocks of 32 on indexer queries and keys.
The packers write round-tripped values into the cache formats of kvpack.py, losslessly.

Every kernel is bit-exact against numerics.py / kvpack.py. The recipe (no libdevice calls, so it
also holds in the simulator):
- a block scale is 2**ceil(log2(fl32(amax) · fl32(1/max))): one float32 multiply, then the
  ceiling read off frexp, exactly as numerics._pow2_ceil_scale does;
- values are divided by the scale in float64 (a power of two: exact), clamped, and rounded to
  the grid on that exact quotient with explicit ties-to-even;
- the packer's ue8m0 byte is the one kvpack recovers from the round-tripped block: the smallest
  k with amax <= max_code · 2**k, found through frexp (exact) instead of a rounded log2.
The Hadamard butterfly runs in float64 and rounds once to float32, so it is the exactly rounded
x @ hadamard_matrix(DI) up to ~1e-16; the FP4 step then sees a float32 vector, as in the model.

Letters: T rows (tokens or entries), K head dim, R rope dims, H heads, DI index dim, N keys.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32

from .. import ops
from ..numerics import fp4_roundtrip, hadamard_matrix
from . import device, norm_rope
from .bench import BenchCase
from .device import capture_graph, cdiv, device_fn, xor_shfl
from .kvpack import (bf16_decode, e2m1_decode, e4m3_decode, index_key_bytes, kv_entry_bytes,
                     pack_index_key_ref, pack_kv_ref, ue8m0_decode, unpack_kv_ref)

FP8_BLOCK, FP4_BLOCK = 64, 32
MAX_DI = 512  # longest vector a Hadamard kernel holds in shared / local memory (V4: 128)
MAX_DI_PARTS, MAX_DI_BLOCKS = MAX_DI // 8, MAX_DI // FP4_BLOCK  # shared sizes must be constants
MAX_THREADS = 1024
FP4_AMAX_MIN = 6.0 * 2.0 ** -126  # numerics.fp4_roundtrip's floor on the block max


# ---- NumPy references (the spec) ---------------------------------------------------------------
def kv_roundtrip_ref(out, x, rope_dim: int) -> None:
    """out[T, K] <- x[T, K]: FP8 round-trip on dims [0, K-R) in blocks of 64, rope dims copied."""
    ops.kv_roundtrip(out, x, rope_dim)


def kv_pack_ref(out, x, rope_dim: int) -> None:
    """out[T, bytes] uint8 <- x[T, K]: the round-trip, then kvpack's 584-B entry (K=512, R=64)."""
    rt = np.empty(x.shape, np.float32)
    ops.kv_roundtrip(rt, x.astype(np.float32), rope_dim)
    pack_kv_ref(out, rt, rope_dim)


def kv_unpack_ref(out, packed, rope_dim: int) -> None:
    """out[T, K] float32 <- packed[T, bytes] uint8."""
    unpack_kv_ref(out, packed, rope_dim)


def hadamard_fp4_ref(out, x, fp4: bool) -> None:
    """out[T, H, DI] <- x[T, H, DI] @ hadamard(DI), then (fp4) the e2m1 round-trip per 32."""
    y = x.astype(np.float64) @ hadamard_matrix(x.shape[-1])
    out[...] = fp4_roundtrip(y, FP4_BLOCK) if fp4 else y


def index_key_pack_ref(out, x) -> None:
    """out[N, bytes] uint8 <- x[N, DI] keys already on the FP4 grid (68 B for DI = 128)."""
    pack_index_key_ref(out, x)


# ---- scalar device helpers (float64 unless named otherwise) ------------------------------------
def scalar_fn(fn):
    """A device helper that touches no ``cuda.*``. In the simulator it stays a plain Python
    function: a simulated device call swaps module globals under a lock, which costs far more
    than these few float operations (same results either way)."""
    return fn if device.SIMULATOR else device_fn(fn)


@scalar_fn
def ceil_log2_f32(y):
    """ceil(log2 y) for a positive float32 y: frexp gives y = m·2**e, m in [0.5, 1), so the
    ceiling is e unless y is a power of two (m == 0.5)."""
    m, e = math.frexp(y)
    return int(e) - 1 if m == 0.5 else int(e)


@scalar_fn
def fp8_exp(amax):
    """Exponent of the e4m3 block scale for a block maximum (amax clamped >= 1e-4, §8b.3)."""
    return ceil_log2_f32(np.float32(max(amax, 1e-4)) * np.float32(1.0 / 448.0))


@scalar_fn
def fp4_exp(amax):
    """Exponent of the e2m1 block scale (amax clamped >= 6·2**-126)."""
    return ceil_log2_f32(np.float32(max(amax, FP4_AMAX_MIN)) * np.float32(1.0 / 6.0))


@scalar_fn
def round_half_even(w):
    """Nearest integer to 0 <= w < 2**31, ties to even (int() truncates; then fix up)."""
    k = int(w)
    f = w - k
    if f > 0.5 or (f == 0.5 and (k & 1) == 1):
        k += 1
    return k


@scalar_fn
def e4m3_round(v):
    """v (|v| <= 448) rounded to the e4m3fn grid, ties to even (numerics._round_e4m3)."""
    a = abs(v)
    _, e = math.frexp(max(a, 0.015625))  # below 2**-6 the subnormals share the 2**-9 step
    sh = int(e) - 4  # 3 mantissa bits: step = 2**(floor(log2 a) - 3) = 2**(e - 4)
    q = math.ldexp(float(round_half_even(math.ldexp(a, -sh))), sh)
    return -q if v < 0 else q


@scalar_fn
def fp8_value(v, e):
    """One element through the e4m3 round-trip with block scale 2**e."""
    w = min(max(math.ldexp(v, -e), -448.0), 448.0)
    return math.ldexp(e4m3_round(w), e)


@scalar_fn
def e4m3_code(w):
    """Byte code of a value on the e4m3fn grid; zero of either sign is 0x00 (as kvpack)."""
    a = abs(w)
    if a == 0.0:
        return 0
    if a < 0.015625:
        c = int(math.ldexp(a, 9))  # subnormal: a = m · 2**-9
    else:
        m, e = math.frexp(a)  # a = (2m) · 2**(e-1): biased exponent e + 6, mantissa 16m - 8
        c = ((int(e) + 6) << 3) | (int(m * 16.0) - 8)
    return c | 128 if w < 0 else c


E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between codes c and c+1 (0,.5,1,1.5,2,3,4,6)


@scalar_fn
def e2m1_code(a):
    """e2m1 magnitude code (0..7) nearest to 0 <= a <= 6; a tie goes to the even code."""
    c = 0
    while c < 7 and (a > E2M1_MIDS[c] or (a == E2M1_MIDS[c] and c % 2 == 1)):
        c += 1
    return c


@scalar_fn
def fp4_value(v, e):
    """One element through the e2m1 round-trip with block scale 2**e."""
    w = min(max(math.ldexp(v, -e), -6.0), 6.0)
    q = math.ldexp(e2m1_decode(e2m1_code(abs(w))), e)
    return -q if w < 0 else q


@scalar_fn
def fp4_code(v, k):
    """Nibble of an on-grid value v under the ue8m0 scale 2**k; zero never carries a sign."""
    w = min(max(math.ldexp(v, -k), -6.0), 6.0)
    c = e2m1_code(abs(w))
    return c | 8 if (w < 0 and c != 0) else c


@scalar_fn
def pack_exp(amax, frac, shift):
    """kvpack's recovered scale exponent: the smallest k with amax <= top · 2**k, where the
    largest code is top = frac · 2**shift (e4m3 448 = 0.875·2**9, e2m1 6 = 0.75·2**3); amax = 0
    gives -127, and k is clamped to ue8m0's [-127, 127]. With amax = m·2**e, m in [0.5, 1):
    amax/top = (m/frac)·2**(e-shift) and m/frac lies in (0.5, 4/3), so k = e - shift + (m > frac).
    """
    if amax == 0.0:
        return -127
    m, e = math.frexp(amax)
    k = int(e) - shift + (1 if m > frac else 0)
    return min(max(k, -127), 127)


@scalar_fn
def fp8_pack_exp(amax, e):
    """ue8m0 exponent of a block round-tripped with scale 2**e. Rounding is monotonic, so the
    round-tripped block maximum is the rounded maximum: no second reduction is needed."""
    return pack_exp(math.ldexp(e4m3_round(min(math.ldexp(amax, -e), 448.0)), e), 0.875, 9)


@scalar_fn
def fp4_pack_exp(amax, e):
    """ue8m0 exponent of a block round-tripped with e2m1 scale 2**e (see fp8_pack_exp)."""
    top = e2m1_decode(e2m1_code(min(math.ldexp(amax, -e), 6.0)))
    return pack_exp(math.ldexp(top, e), 0.75, 3)


@scalar_fn
def bf16_bits(x):
    """bf16 bits of a float32 value, round to nearest even (quants.float32_to_bf16), computed
    from the value (no bit casts in the simulator): 8 significant bits, carries included."""
    v = float(x)
    if v != v:
        return 0x7FC0
    s = 0x8000 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a == 0.0:
        return s
    if a == math.inf:
        return s | 0x7F80
    m, e = math.frexp(a)
    if int(e) <= -126:  # float32 subnormal: bf16 keeps units of 2**-133
        return s | round_half_even(math.ldexp(a, 133))
    return s | (((int(e) + 126) << 7) + round_half_even(m * 256.0) - 128)


# ---- block-level helpers (every thread of the block calls them: they hold barriers) ------------
@scalar_fn
def butterfly_stage(h, n, s, q0, dq):
    """Pairs q = q0, q0+dq, ... < n/2 of the Walsh–Hadamard stage with stride s, in place."""
    for q in range(q0, n // 2, dq):
        i = (q // s) * 2 * s + q % s
        x0 = h[i]
        x1 = h[i + s]
        h[i] = x0 + x1
        h[i + s] = x0 - x1


@device_fn
def hadamard_shared(h, n):
    """Unnormalised Walsh–Hadamard transform of h[0:n] in place (float64 shared memory, n a power
    of two): the Sylvester butterfly with strides 1, 2, ..., n/2, one barrier per stage."""
    s = 1
    while s < n:
        butterfly_stage(h, n, s, cuda.threadIdx.x, cuda.blockDim.x)
        cuda.syncthreads()
        s *= 2


@device_fn
def group_absmax(vals, n, group, part, gmax):
    """gmax[g] = max |vals[g·group : (g+1)·group]| for g < n / group (group a multiple of 8).

    Two short passes instead of one thread per group: partial maxima of 8 into ``part``
    (n/8 slots), then ``group``/8 partials per group; both arrays float32 shared memory.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for u in range(tid, n // 8, nt):
        m = abs(vals[8 * u])
        for c in range(8 * u + 1, 8 * u + 8):
            m = max(m, abs(vals[c]))
        part[u] = m
    cuda.syncthreads()
    per = group // 8
    for gi in range(tid, n // group, nt):
        m = part[gi * per]
        for u in range(gi * per + 1, gi * per + per):
            m = max(m, part[u])
        gmax[gi] = m
    cuda.syncthreads()


# ---- kv_roundtrip / kv_pack: one pair of kernels writes the values, the bytes, or both ----------
# out_f [T, K] f32 is written for rows t < out_f.shape[0], out_p [T, bytes] uint8 likewise, so a
# zero-row array switches an output off (the window kv needs both: values for this step's
# attention, bytes for the ring).
@device.kernel
def _kv_fp8_serial(out_f, out_p, x, rope_dim):
    """Naive: one thread per (row, 64-block); unit nb of a row does the rope dims (copied, or
    bf16 bytes) and the pad."""
    T, K = x.shape
    nope = K - rope_dim
    nb = nope // FP8_BLOCK
    i = cuda.grid(1)
    if i >= T * (nb + 1):
        return
    t = i // (nb + 1)
    b = i - t * (nb + 1)
    wf = t < out_f.shape[0]
    wp = t < out_p.shape[0]
    if b == nb:
        for c in range(nope, K):
            if wp:
                bits = bf16_bits(x[t, c])
                out_p[t, 2 * c - nope] = bits & 255  # byte nope + 2·(c - nope), little-endian
                out_p[t, 2 * c - nope + 1] = bits >> 8
            if wf:
                out_f[t, c] = x[t, c]
        for o in range(K + rope_dim + nb, out_p.shape[1] if wp else 0):
            out_p[t, o] = 0
        return
    c0 = b * FP8_BLOCK
    amax = 0.0
    for c in range(c0, c0 + FP8_BLOCK):
        amax = max(amax, abs(float(x[t, c])))
    e = fp8_exp(amax)
    k = fp8_pack_exp(amax, e)
    for c in range(c0, c0 + FP8_BLOCK):
        q = fp8_value(float(x[t, c]), e)
        if wp:
            out_p[t, c] = e4m3_code(math.ldexp(q, -k))
        if wf:
            out_f[t, c] = q
    if wp:
        out_p[t, K + rope_dim + b] = k + 127


@device.kernel
def _kv_fp8_warp_blocks(out_f, out_p, x, rope_dim):
    """One warp per (row, 64-block): lanes hold elements c and c+32 (coalesced), the block max
    comes from warp_max; the warp of unit nb does the rope dims and the pad."""
    scratch = cuda.shared.array(MAX_THREADS, float32)  # warp_max's staging in the simulator
    T, K = x.shape
    nope = K - rope_dim
    nb = nope // FP8_BLOCK
    w = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // 32
    lane = cuda.threadIdx.x % 32
    t = w // (nb + 1)
    b = w - t * (nb + 1)
    live = t < T and b < nb
    c = b * FP8_BLOCK + lane
    v0 = float32(0.0)
    v1 = float32(0.0)
    if live:
        v0 = x[t, c]
        v1 = x[t, c + 32]
    amax = device.warp_max(max(abs(v0), abs(v1)), scratch)  # every lane calls: barriers in sim
    wf = t < out_f.shape[0]
    wp = t < out_p.shape[0]
    if live:
        e = fp8_exp(amax)
        q0 = fp8_value(float(v0), e)
        q1 = fp8_value(float(v1), e)
        if wf:
            out_f[t, c] = q0
            out_f[t, c + 32] = q1
        if wp:
            k = fp8_pack_exp(float(amax), e)
            out_p[t, c] = e4m3_code(math.ldexp(q0, -k))
            out_p[t, c + 32] = e4m3_code(math.ldexp(q1, -k))
            if lane == 0:
                out_p[t, K + rope_dim + b] = k + 127
    elif t < T and b == nb:
        for cc in range(nope + lane, K, 32):
            if wf:
                out_f[t, cc] = x[t, cc]
            if wp:
                bits = bf16_bits(x[t, cc])
                out_p[t, 2 * cc - nope] = bits & 255
                out_p[t, 2 * cc - nope + 1] = bits >> 8
        for o in range(K + rope_dim + nb + lane, out_p.shape[1] if wp else 0, 32):
            out_p[t, o] = 0


def _kv_fp8(out_f, out_p, x, rope_dim, stream, threads, naive) -> None:
    T, K = x.shape
    if (K - rope_dim) % FP8_BLOCK or not 0 <= rope_dim <= K:
        raise ValueError(f"kv: head dim {K} - rope dim {rope_dim} must be a multiple of 64")
    if out_p.shape[0] and out_p.shape[1] != kv_entry_bytes(K, rope_dim):
        raise ValueError(f"kv_pack: {out_p.shape[1]} B rows, want {kv_entry_bytes(K, rope_dim)}")
    units = T * ((K - rope_dim) // FP8_BLOCK + 1)
    if naive:
        nt = threads or 128
        _kv_fp8_serial[cdiv(units, nt), nt, stream](out_f, out_p, x, int32(rope_dim))
    else:
        nt = threads or 128
        if nt % 32:
            raise ValueError(f"kv: warp kernels need a multiple of 32 threads, got {nt}")
        _kv_fp8_warp_blocks[cdiv(units, nt // 32), nt, stream](out_f, out_p, x, int32(rope_dim))


def kv_roundtrip(out, x, rope_dim: int, stream=0, threads=None, naive: bool = False) -> None:
    """out[T, K] f32 <- x[T, K] f32 (may be the same array): FP8 e4m3 round-trip in blocks of 64
    on dims [0, K-R), rope dims copied. Bit-exact with numerics.fp8_roundtrip."""
    _kv_fp8(out, empty_rows(np.uint8), x, rope_dim, stream, threads, naive)


def kv_pack(out, x, rope_dim: int, out_values=None, stream=0, threads=None,
            naive: bool = False) -> None:
    """out[T, bytes] uint8 <- x[T, K] f32: the FP8 round-trip fused with kvpack's entry format
    (584 B for K=512, R=64), equal bytes to pack_kv_ref of the round-tripped x; the round-tripped
    values also go to ``out_values`` [T, K] f32 when given (one pass for both)."""
    _kv_fp8(empty_rows(np.float32) if out_values is None else out_values, out, x, rope_dim,
            stream, threads, naive)


@device.kernel
def _kv_unpack_elementwise(out, packed, rope_dim):
    """One thread per element: code × scale byte, or the bf16 pair of a rope dim."""
    T, K = out.shape
    nope = K - rope_dim
    i = cuda.grid(1)
    if i >= T * K:
        return
    t = i // K
    c = i - t * K
    if c < nope:
        out[t, c] = e4m3_decode(packed[t, c]) * ue8m0_decode(packed[t, K + rope_dim + c // 64])
    else:
        out[t, c] = bf16_decode(packed[t, 2 * c - nope], packed[t, 2 * c - nope + 1])


def kv_unpack(out, packed, rope_dim: int, stream=0, threads=None) -> None:
    """out[T, K] f32 <- packed[T, bytes] uint8 (tests and debugging; attention decodes in place)."""
    T, K = out.shape
    nt = threads or 256
    _kv_unpack_elementwise[cdiv(T * K, nt), nt, stream](out, packed, int32(rope_dim))


# ---- hadamard_fp4 ------------------------------------------------------------------------------
@device.kernel
def _hadamard_fp4_serial(out, x, fp4):
    """Naive: one thread per head vector, butterfly in a float64 local array."""
    T, H, DI = x.shape
    i = cuda.grid(1)
    if i >= T * H:
        return
    t = i // H
    hd = i - t * H
    h = cuda.local.array(MAX_DI, float64)
    for c in range(DI):
        h[c] = x[t, hd, c]
    s = 1
    while s < DI:
        butterfly_stage(h, DI, s, 0, 1)
        s *= 2
    inv = 1.0 / math.sqrt(float(DI))
    for c in range(DI):
        h[c] = np.float32(h[c] * inv)  # the rotated vector is float32, as in the model
    for c0 in range(0, DI, FP4_BLOCK):
        e = 0
        if fp4:
            amax = 0.0
            for c in range(c0, c0 + FP4_BLOCK):
                amax = max(amax, abs(h[c]))
            e = fp4_exp(amax)
        for c in range(c0, c0 + FP4_BLOCK):
            out[t, hd, c] = fp4_value(h[c], e) if fp4 else h[c]


@device_fn
def rotate_block_vector(out, t, hd, src, fp4, pos, freqs):
    """out[t, hd, :] <- the vector src[0:DI] (a float32 row in global or shared memory, DI =
    out.shape[2]) RoPE'd at pos[t] (forward, the last 2P dims, as norm_rope.rope: cos and sin
    of a float64 angle in float32; nothing with freqs [P] empty) on its way into a float64
    butterfly, rotated by the orthonormal Hadamard, then (fp4) the e2m1 round-trip per 32.
    The block's threads stride over the elements. Every thread of the block must call it."""
    h = cuda.shared.array(MAX_DI, float64)
    v = cuda.shared.array(MAX_DI, float32)
    part = cuda.shared.array(MAX_DI_PARTS, float32)
    gmax = cuda.shared.array(MAX_DI_BLOCKS, float32)
    DI = out.shape[2]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    nope = DI - 2 * freqs.shape[0]
    for c in range(tid, DI, nt):
        v0 = src[c]
        if c >= nope:  # (never, without freqs) pairs (nope + 2k, nope + 2k + 1): partner c ^ 1
            v0 = norm_rope.rope_element(v0, src[c ^ 1], pos[t], freqs[(c - nope) // 2],
                                        c % 2 == 0, False)
        h[c] = v0
    cuda.syncthreads()
    hadamard_shared(h, DI)
    inv = 1.0 / math.sqrt(float(DI))
    for c in range(tid, DI, nt):
        v[c] = h[c] * inv
    cuda.syncthreads()
    if fp4:
        group_absmax(v, DI, FP4_BLOCK, part, gmax)
        for c in range(tid, DI, nt):
            out[t, hd, c] = fp4_value(float(v[c]), fp4_exp(gmax[c // FP4_BLOCK]))
    else:
        for c in range(tid, DI, nt):
            out[t, hd, c] = v[c]


@device.kernel
def _hadamard_fp4_shared(out, x, fp4, pos, freqs):
    """One block per head vector: rotate_block_vector of x[t, hd] (the RoPE with freqs [P]
    not empty, a float64 butterfly with a barrier per stage, block maxima by group_absmax,
    threads striding over the DI elements)."""
    H = x.shape[1]
    t = cuda.blockIdx.x // H
    hd = cuda.blockIdx.x - t * H
    rotate_block_vector(out, t, hd, x[t, hd], fp4, pos, freqs)


_SHFL_SCRATCH = MAX_THREADS if device.SIMULATOR else 1  # xor_shfl's simulator exchange
WARP_FORM_VECTORS = 1024  # fewest head vectors for which the launcher takes the warp kernel


def _hadamard_fp4_warp_kernel(DI: int):
    """The warp kernel for head vectors of DI (a power of two, 32 <= DI <= MAX_DI): a lane's
    elements, the butterfly's stages and the shuffles are compile-time counts, so that every
    index into the lane's array is a constant and the array lives in registers (with DI a
    run-time value it went to local memory: 99 loads, 90 stores in the PTX)."""
    PER = DI // 32  # a lane's consecutive elements
    LOG_PER, LOG_DI = PER.bit_length() - 1, DI.bit_length() - 1
    LOG_BLOCK_LANES = (FP4_BLOCK // PER).bit_length() - 1  # a 32-block's lanes: 2^this

    def _hadamard_fp4_warp(out, x, fp4, pos, freqs):
        """One warp per head vector, no barrier: lane L holds the PER consecutive elements
        L·PER .. L·PER + PER - 1 in float64 (RoPE'd on the way in as _hadamard_fp4_shared
        does); the butterfly's strides below PER pair elements of one lane, the others pair
        lane L with lane L ^ (stride / PER) by a shuffle; a 32-block's maximum is a shuffle
        max over its lanes. A warp past the last vector computes the last one and does not
        store it (every thread reaches the simulator's exchange barriers)."""
        scr = cuda.shared.array(_SHFL_SCRATCH, float64)
        h = cuda.local.array(PER, float64)
        T, H, _ = x.shape
        lane = cuda.threadIdx.x % 32
        i = cuda.blockIdx.x * (cuda.blockDim.x // 32) + cuda.threadIdx.x // 32
        ii = min(i, T * H - 1)
        t = ii // H
        hd = ii - t * H
        c0 = lane * PER
        nope = DI - 2 * freqs.shape[0]
        for j in range(PER):
            c = c0 + j
            v0 = x[t, hd, c]
            if c >= nope:  # (never, without freqs) partner c ^ 1: the same lane when PER > 1
                v0 = norm_rope.rope_element(v0, x[t, hd, c ^ 1], pos[t],
                                            freqs[(c - nope) // 2], c % 2 == 0, False)
            h[j] = v0
        for st in range(LOG_PER):  # strides inside a lane: pairs (j, j + s), j without bit s
            s = 1 << st
            for j in range(PER):
                if (j & s) == 0:
                    a, b = h[j], h[j + s]
                    h[j] = a + b
                    h[j + s] = a - b
        for st in range(LOG_DI - LOG_PER):  # across lanes: the lane with bit m set holds
            m = 1 << st                     # the pair's second half
            upper = (lane & m) != 0
            for j in range(PER):
                o = xor_shfl(h[j], m, scr)
                h[j] = o - h[j] if upper else h[j] + o
        inv = 1.0 / math.sqrt(float(DI))
        amax = 0.0
        for j in range(PER):
            h[j] = float32(h[j] * inv)  # the rotated vector is float32, as in the model
            amax = max(amax, abs(h[j]))
        e = 0
        if fp4:
            for st in range(LOG_BLOCK_LANES):
                amax = max(amax, xor_shfl(amax, 1 << st, scr))
            e = fp4_exp(amax)
        if i < T * H:
            for j in range(PER):
                out[t, hd, c0 + j] = fp4_value(h[j], e) if fp4 else h[j]

    _hadamard_fp4_warp.__name__ = _hadamard_fp4_warp.__qualname__ = f"_hadamard_fp4_warp_{DI}"
    return device.kernel(_hadamard_fp4_warp)


_HADAMARD_FP4_WARP = {di: _hadamard_fp4_warp_kernel(di) for di in (32, 64, 128, 256, 512)}


def hadamard_fp4(out, x, fp4: bool, stream=0, threads=None, naive: bool = False,
                 rope=None, warp: bool | None = None) -> None:
    """out[T, H, DI] f32 <- x[T, H, DI] f32: orthonormal Hadamard per head vector, then (fp4)
    the e2m1 round-trip in blocks of 32 (spec §4.7; DI a power of two, 32 <= DI <= 512).
    ``rope`` (pos [T] int32, freqs [P] float64): x is RoPE'd first (forward) inside the same
    launch (the indexer's query; x itself is left as it is; naive: a rope launch into out,
    then the rotation in place). ``warp``: a warp a vector, else a block a vector; None takes
    the warp kernel for WARP_FORM_VECTORS vectors or more (on the H200 a 2,048-token chunk's
    131,072 queries in half the block kernel's time, while the decode's 64 ran faster a block
    each, BENCHMARKS 2026-12-05)."""
    T, H, DI = x.shape
    if DI < FP4_BLOCK or DI > MAX_DI or DI & (DI - 1):
        raise ValueError(f"hadamard_fp4: DI={DI} must be a power of two in [32, {MAX_DI}]")
    if naive:
        nt = threads or 64
        if rope is not None:
            norm_rope.rope(out, x, *rope, False, stream, naive=True)
            x = out  # (the serial kernel reads a vector whole before writing it)
        _hadamard_fp4_serial[cdiv(T * H, nt), nt, stream](out, x, int32(fp4))
        return
    pos, freqs = rope or (device.empty_vector(np.int32), device.empty_vector(np.float64))
    if warp is None:
        warp = T * H >= WARP_FORM_VECTORS
    if warp:
        nt = threads or 128
        assert nt % 32 == 0 and nt <= MAX_THREADS
        _HADAMARD_FP4_WARP[DI][cdiv(T * H, nt // 32), nt, stream](out, x, int32(fp4), pos,
                                                                    freqs)
    else:
        nt = threads or min(DI, 128)
        _hadamard_fp4_shared[T * H, nt, stream](out, x, int32(fp4), pos, freqs)


# ---- index_key_pack -----------------------------------------------------------------------------
@device.kernel
def _index_key_pack_serial(out, x):
    """One thread per (key, 32-block): recover the block's ue8m0 exponent, write 16 nibble
    bytes and the scale byte; block 0 also zeroes the pad."""
    N, DI = x.shape
    nb = DI // FP4_BLOCK
    i = cuda.grid(1)
    if i >= N * nb:
        return
    n = i // nb
    b = i - n * nb
    c0 = b * FP4_BLOCK
    amax = 0.0
    for c in range(c0, c0 + FP4_BLOCK):
        amax = max(amax, abs(float(x[n, c])))
    k = pack_exp(amax, 0.75, 3)
    for c in range(c0, c0 + FP4_BLOCK, 2):
        out[n, c // 2] = fp4_code(float(x[n, c]), k) | (fp4_code(float(x[n, c + 1]), k) << 4)
    out[n, DI // 2 + b] = k + 127
    if b == 0:
        for o in range(DI // 2 + nb, out.shape[1]):
            out[n, o] = 0


def index_key_pack(out, x, stream=0, threads=None) -> None:
    """out[N, bytes] uint8 <- x[N, DI] f32 keys on the FP4 grid (hadamard_fp4 output): kvpack's
    68-B key for DI = 128, equal bytes to pack_index_key_ref."""
    N, DI = x.shape
    if out.shape[1] != index_key_bytes(DI):
        raise ValueError(f"index_key_pack: {out.shape[1]} B rows, want {index_key_bytes(DI)}")
    nt = threads or 128
    _index_key_pack_serial[cdiv(N * (DI // FP4_BLOCK), nt), nt, stream](out, x)


# ---- launch helpers -----------------------------------------------------------------------------
_EMPTY = {}


def empty_rows(dtype):
    """A zero-row [0, 1] device array of ``dtype``, allocated once: passed for an output that is
    switched off (no allocation per call, none during graph capture)."""
    key = np.dtype(dtype)
    if key not in _EMPTY:
        _EMPTY[key] = cuda.device_array((0, 1), key)
    return _EMPTY[key]


# ---- CI lane B: every kernel with the exact argument types its launcher passes ---------------
_F2, _U2, _F3 = "float32[:, ::1]", "uint8[:, ::1]", "float32[:, :, ::1]"
PTX_SIGNATURES = [
    (_kv_fp8_serial, f"void({_F2}, {_U2}, {_F2}, int32)"),
    (_kv_fp8_warp_blocks, f"void({_F2}, {_U2}, {_F2}, int32)"),
    (_kv_unpack_elementwise, f"void({_F2}, {_U2}, int32)"),
    (_hadamard_fp4_serial, f"void({_F3}, {_F3}, int32)"),
    (_hadamard_fp4_shared, f"void({_F3}, {_F3}, int32, int32[::1], float64[::1])"),
    *((k, f"void({_F3}, {_F3}, int32, int32[::1], float64[::1])")
      for k in _HADAMARD_FP4_WARP.values()),
    (_index_key_pack_serial, f"void({_U2}, {_F2})"),
]


# ---- benchmarks (H200) ------------------------------------------------------------------------
GRAPH_REPS = 20  # launches per timed graph replay


def repeat_graph(launch, stream, n: int = GRAPH_REPS):
    """``n`` launches of ``launch`` as one CUDA graph: these kernels run for a few µs, far
    below one Python launch (20-120 µs with their arguments)."""
    return capture_graph([launch] * n, stream)


def bench_cases(stream) -> list[BenchCase]:
    """kv_pack for 1 and 512 entries (K=512, R=64), the kv round-trip for 512 entries, and the
    indexer query rotation hadamard_fp4 (with its RoPE) on [1, 64, 128] and [2048, 64, 128],
    by either fast kernel; each a graph of GRAPH_REPS launches
    (bytes and FLOPs counted for all of them)."""
    rng = np.random.default_rng(0)
    cases = []
    K, R, n = 512, 64, GRAPH_REPS

    def add(name, launch, nbytes, flops):
        cases.append(BenchCase("qat", f"{name} (x{n} graph)", repeat_graph(launch, stream),
                               bytes=n * nbytes, flops=n * flops, launches=n))

    for T in (1, 512):
        x = cuda.to_device(rng.normal(size=(T, K)).astype(np.float32), stream=stream)
        p = cuda.device_array((T, kv_entry_bytes(K, R)), np.uint8, stream=stream)
        add(f"kv_pack {T}x{K}", lambda p=p, x=x: kv_pack(p, x, R, stream=stream),
            T * (4 * K + kv_entry_bytes(K, R)), T * K * 4)
    x = cuda.to_device(rng.normal(size=(512, K)).astype(np.float32), stream=stream)
    add(f"kv_roundtrip 512x{K} in place", lambda: kv_roundtrip(x, x, R, stream=stream),
        512 * K * 8, 512 * K * 4)
    from ..numerics import rope_frequencies
    freqs = cuda.to_device(rope_frequencies(64, 160000.0, 16.0, 65536), stream=stream)
    for T in (1, 2048):  # the decode's indexer query, and a prefill chunk's (RoPE'd first)
        q = cuda.to_device(rng.normal(size=(T, 64, 128)).astype(np.float32), stream=stream)
        qo = cuda.device_array_like(q, stream=stream)
        pos = cuda.to_device(np.arange(262144, 262144 + T, dtype=np.int32), stream=stream)
        for warp in (False, True):
            add(f"hadamard_fp4 {T}x64x128 + rope, {'a warp' if warp else 'a block'} a vector",
                lambda q=q, qo=qo, pos=pos, w=warp: hadamard_fp4(qo, q, True, stream=stream,
                                                                 rope=(pos, freqs), warp=w),
                2 * 4 * T * 64 * 128, T * 64 * 128 * (7 + 4))
    return cases
