"""Lightning-indexer scores on the tensor cores: out[j] = Σ_h w[h] · ReLU(q[h] · key_j).

Why: the register-tile scorer (indexer.py) runs the [HI, DI] x [DI, N] product on the CUDA
cores and is FMA-bound (H200: 52 µs per CSA layer at 65,536 keys, 138 µs at 262,144, ~33
TFLOP/s in prefill chunks). The keys are FP4 — e2m1 codes times a power-of-two scale per 32
dims — so every key value is exact in bf16, and ``mma.sync`` (mma.py's inline PTX) takes them
as they are. q is split as hi + lo, two bf16 values (mma.py's ``_split_pair``, |error| <=
2^-16 |q|); the model's q has been through the FP4 round-trip (hadamard_fp4), so lo is zero, and
a block that finds every lo zero skips those MMAs: one MMA per tile, exact products, float32
sums — the same numbers as the CUDA-core scorer up to the order of the sums.

Layout. A block is HI / 16 warps; warp w owns heads 16w .. 16w+15 (the A operand, kept in
registers for the whole launch: DI/16 k-steps x 4 registers, hi and lo), and every warp walks
the same keys, 8 per MMA (the B operand, decoded from the packed key straight into fragment
registers). Inside a k-step s (16 dims) lane c = lane % 4 holds dims 16s + 4c .. 16s + 4c + 3
of both operands — a permutation of the MMA's k index, which leaves the sum unchanged — so the
lane's B registers are the two bytes 8s + 2c, 8s + 2c + 1 of the key (one 32-bit word, a
256-entry byte -> bf16-pair table in shared memory) and its A registers four consecutive q
dims. A 32-dim scale block is two k-steps: their MMAs start from zero and the result is scaled
per key (column) and added to the float32 accumulator (the scale is a power of two: exact).

Epilogue of 8 keys: C holds heads (g, g + 8) x keys (2c, 2c + 1) per lane; ReLU, times w[head],
summed over the lane's two heads, then over g (xor shuffles 4, 8, 16), then over the warps in
warp order through shared memory. Letters: HI index heads, DI index dim, N keys, T tokens.

Chunk tiles (``indexer_scores_chunk_mma(q_fp4=True)``, the prefill's form). The per-token
blocks above decode every key once per warp for 16 heads, and their time is that decode, the
per-block scale epilogue and their latency (~50 TFLOP/s), not the MMAs. When q is on the FP4
grid (the model's q always is: hadamard_fp4 output) hi is exact and lo zero, so a block of 8
warps takes TB = 8 / (HI / 32) tokens: warp w owns token w // (HI / 32) and 32 of its heads.
The keys are decoded ONCE a chunk (``decode_keys``: bf16 with the 32-block's scale folded
into the exponent, exact; 256 bytes a key) instead of once a block, so a block step is a
copy: cp.async moves the next 64 keys' rows into shared memory while the MMAs run on this
step's (double-buffered, one barrier a step). Keys are the A operand (ldmatrix.x4 of a 16-key
m-tile's k-step, rows padded so its 8 rows fall on distinct banks), q the B operand (four
8-head n-tiles, DI / 2 registers held for the launch): each A fragment feeds 4 MMAs and the
8 k-steps accumulate in the MMAs' float32 C; a lane's C holds 2 keys x 2 heads of each
n-tile, so the ReLU-weighted head sum is 8 heads in registers and then 2 shuffles (over c),
and the two warps of a token meet in shared memory. Summation order differs from the
per-token kernel (float32 sums). H200 (2026-12-04, 1,016 tokens x 66,048 keys): 356 TFLOP/s,
4.3 instructions an MMA; the former in-block decode ran at 182 with 12 (the table decode and
the index arithmetic around 32 shared loads a step); BENCHMARKS 2026-12-04 (f).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from . import kvpack
from .device import SIMULATOR, cdiv, kernel, resident_blocks, xor_shfl
from .gemv import _bits_f32
from .lowbit_layout import _f32_bits
from .mma import (_cp_async16, _cp_async_commit, _cp_async_wait0, _ldsm_x4, _mma_bf16,
                  _split_pair)

GROUPS = 4  # 8-key MMA groups per block step (their key loads are issued together)
STEP_KEYS = 8 * GROUPS
MAX_WARPS = 8  # HI <= 128
XCH = 32 * MAX_WARPS * 6 if SIMULATOR else 1  # simulator MMA exchange (mma.py's emulation)
SHF = 32 * MAX_WARPS if SIMULATOR else 1  # simulator lane exchange
PART = MAX_WARPS * STEP_KEYS


def fits(HI: int, DI: int) -> bool:
    """Whether the tensor-core scorer takes this geometry (16-head warps, 32-dim FP4 blocks)."""
    return HI % 16 == 0 and 16 <= HI <= 16 * MAX_WARPS and DI % 32 == 0


@cuda.jit(device=True)
def _e2m1_bf16(nib):
    """bf16 bits of the e2m1 nibble's value (0, .5, 1, 1.5, 2, 3, 4, 6, signed by bit 3):
    codes m >= 2 are 2^(m/2 - 1) with m's low bit as the top mantissa bit."""
    m = nib & 7
    bits = ((126 + (m >> 1)) << 7) | ((m & 1) << 6)
    if m == 1:
        bits = 0x3F00  # 0.5
    if m == 0:
        bits = 0
    return bits | ((nib & 8) << 12)


@cuda.jit(device=True)
def _key_scale(keys8, j, col):
    """2^(e - 127) of scale byte ``col`` of key j, as float32 bits (e = 0 reads as 0)."""
    return _bits_f32(int32(keys8[j, col]) << 23)


def _scorer(DI: int):
    """The block routine for keys of DI dims (a closure constant: fixed register arrays)."""
    S = DI // 16  # k-steps
    NB = DI // 32  # scale blocks (two k-steps each)
    NQ = 4 * S  # A registers per lane, per half (hi / lo)
    NW = GROUPS * S  # key words per lane per block step

    @cuda.jit(device=True)
    def score(out, q, w, keys32, keys8, n):
        """out[N] for keys j < n (-inf from n on), q[HI, DI], w[HI]; persistent grid over
        STEP_KEYS-key steps. Every thread of the block must call it."""
        N = out.shape[0]
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        nwarps = nt >> 5
        tab = cuda.shared.array(256, uint32)  # byte -> bf16 pair (low nibble in the low half)
        part = cuda.shared.array(PART, float32)  # [warp, key] head-group partial scores
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        for i in range(tid, 256, nt):
            tab[i] = uint32(_e2m1_bf16(i & 15)) | (uint32(_e2m1_bf16(i >> 4)) << uint32(16))
        qhi = cuda.local.array(NQ, uint32)
        qlo = cuda.local.array(NQ, uint32)
        h0, h1 = 16 * warp + g, 16 * warp + g + 8
        any_lo = 0
        for s in range(S):
            d = 16 * s + 4 * c
            for r in range(2):  # registers (h0, d..d+1), (h1, d..d+1), (h0, d+2..), (h1, d+2..)
                hi, lo = _split_pair(q[h0, d + 2 * r], q[h0, d + 2 * r + 1])
                qhi[4 * s + 2 * r], qlo[4 * s + 2 * r] = hi, lo
                any_lo |= int32(lo != 0)
                hi, lo = _split_pair(q[h1, d + 2 * r], q[h1, d + 2 * r + 1])
                qhi[4 * s + 2 * r + 1], qlo[4 * s + 2 * r + 1] = hi, lo
                any_lo |= int32(lo != 0)
        w0, w1 = w[h0], w[h1]
        split = cuda.syncthreads_or(any_lo)  # also: the table is complete
        zero = float32(0.0)
        half = uint32(16 * (c & 1))
        wv = cuda.local.array(NW, uint32)
        for k0 in range(cuda.blockIdx.x * STEP_KEYS, N, cuda.gridDim.x * STEP_KEYS):
            if k0 >= n:  # past the visible keys (block-uniform): only the -inf fill
                for i in range(tid, STEP_KEYS, nt):
                    if k0 + i < N:
                        out[k0 + i] = -math.inf
                continue
            for gi in range(GROUPS):  # every key word this lane needs, loaded up front
                j = min(k0 + 8 * gi + g, n - 1)
                for s in range(S):
                    wv[gi * S + s] = uint32(keys32[j, 2 * s + (c >> 1)])
            for gi in range(GROUPS):
                ja = min(k0 + 8 * gi + 2 * c, n - 1)  # the keys of this lane's C columns
                jb = min(ja + 1, n - 1)
                a0, a1, a2, a3 = zero, zero, zero, zero
                for b in range(NB):
                    t0, t1, t2, t3 = zero, zero, zero, zero
                    for s in range(2 * b, 2 * b + 2):
                        pair = (wv[gi * S + s] >> half) & uint32(0xFFFF)
                        b0 = tab[pair & uint32(0xFF)]
                        b1 = tab[pair >> uint32(8)]
                        t0, t1, t2, t3 = _mma_bf16(qhi[4 * s], qhi[4 * s + 1], qhi[4 * s + 2],
                                                   qhi[4 * s + 3], b0, b1, t0, t1, t2, t3, xch)
                        if split:
                            t0, t1, t2, t3 = _mma_bf16(qlo[4 * s], qlo[4 * s + 1],
                                                       qlo[4 * s + 2], qlo[4 * s + 3], b0, b1,
                                                       t0, t1, t2, t3, xch)
                    sa = _key_scale(keys8, ja, DI // 2 + b)
                    sb = _key_scale(keys8, jb, DI // 2 + b)
                    a0 += t0 * sa
                    a1 += t1 * sb
                    a2 += t2 * sa
                    a3 += t3 * sb
                # C: (h0, key 2c) (h0, key 2c+1) (h1, key 2c) (h1, key 2c+1)
                pa = w0 * max(a0, zero) + w1 * max(a2, zero)
                pb = w0 * max(a1, zero) + w1 * max(a3, zero)
                for off in (4, 8, 16):
                    pa += xor_shfl(pa, off, shf)
                    pb += xor_shfl(pb, off, shf)
                if g == 0:
                    part[warp * STEP_KEYS + 8 * gi + 2 * c] = pa
                    part[warp * STEP_KEYS + 8 * gi + 2 * c + 1] = pb
            cuda.syncthreads()
            for i in range(tid, STEP_KEYS, nt):
                j = k0 + i
                if j < N:
                    sc = zero
                    for wi in range(nwarps):
                        sc += part[wi * STEP_KEYS + i]
                    out[j] = sc if j < n else -math.inf
            cuda.syncthreads()  # part is rewritten by the next step
    return score


_KERNELS: dict = {}


def _kernels(DI: int):
    """(decode kernel, chunk kernel) for keys of DI dims."""
    if DI not in _KERNELS:
        score = _scorer(DI)

        def decode(out, q, w, keys32, keys8, n_visible):
            # out [N], q [HI, DI], w [HI], n_visible [1]
            n = min(int(n_visible[0]), out.shape[0], keys8.shape[0])
            score(out, q, w, keys32, keys8, n)

        def chunk(out, q, w, keys32, keys8, n_visible):
            # out [T, N], q [T, HI, DI], w [T, HI], n_visible [T]; blockIdx.y = token
            t = cuda.blockIdx.y
            n = min(int(n_visible[t]), out.shape[1], keys8.shape[0])
            score(out[t], q[t], w[t], keys32, keys8, n)
        decode.__name__ = f"_indexer_scores_mma_di{DI}"
        chunk.__name__ = f"_indexer_scores_chunk_mma_di{DI}"
        _KERNELS[DI] = (kernel(decode), kernel(chunk))
    return _KERNELS[DI]


# ---- chunk tiles: several tokens a block over a once-decoded bf16 copy of the keys ------------
TILE_WARPS = 8
TILE_KEYS = 64  # keys per block step: 4 m-tiles of 16; one combined score a thread at HI = 64
TILE_REGS = 128  # two blocks of 8 warps an SM
PAD_WORDS = 4  # shared row padding: the 8 rows of an ldmatrix matrix on distinct banks


class DecodedKeys(NamedTuple):
    """The chunk tiles kernel's keys: ``rows`` [key_ws_rows(n), DI/2] uint32 bf16 pairs (dim
    2i in the low half), keys j < n decoded, zeros after (decode_keys)."""
    rows: object
    n: int


def fits_tiles(HI: int, DI: int) -> bool:
    """Whether the chunk tiles kernel takes this geometry (32-head warps, at most 8 a token;
    q's fragments, DI / 2 registers, held for the whole launch; a key row of DI / 8 16-byte
    pieces, a power of two, so the block's threads copy whole rows a pass)."""
    return HI % 32 == 0 and 32 <= HI <= 32 * TILE_WARPS and DI in (32, 64, 128)


def key_ws_rows(n: int) -> int:
    """Rows of the decoded keys for n keys: whole block steps (a step copies all its rows)."""
    return cdiv(max(int(n), 1), TILE_KEYS) * TILE_KEYS


def decode_keys_ref(ws, keys_packed, n: int) -> None:
    """ws[:key_ws_rows(n)] uint32 [rows, DI/2] <- the first n packed FP4 keys as bf16 pairs
    (exact: an e2m1 value times a power of two), zero rows from n on."""
    rows, DI = key_ws_rows(n), 2 * ws.shape[1]
    keys = np.zeros((rows, DI), np.float32)
    kvpack.unpack_index_key_ref(keys[:n], keys_packed[:n])
    bits = keys.view(np.uint32) >> np.uint32(16)
    ws[:rows] = bits[:, 0::2] | (bits[:, 1::2] << np.uint32(16))


@cuda.jit(device=True)
def _scaled_bf16(nib, scale):
    """bf16 bits of e2m1 ``nib`` times float32 ``scale`` (a power of two: exact)."""
    return _f32_bits(_bits_f32(int32(_e2m1_bf16(nib)) << 16) * scale) >> uint32(16)


@kernel
def _decode_keys(ws, keys8, n):
    """ws[r, i] = dims 2i, 2i+1 of key r (< n; zero after); the scale byte e of the dims'
    32-block is 2^(e - 127) (e = 0: 2^-127, a subnormal, as the reference)."""
    rows, RW = ws.shape
    for i in range(cuda.grid(1), rows * RW, cuda.gridsize(1)):
        r = i // RW
        d = i - r * RW
        word = uint32(0)
        if r < n:
            b = int32(keys8[r, d])
            e = int32(keys8[r, RW + d // 16])
            scale = _bits_f32(e << 23 if e > 0 else 0x00400000)
            word = _scaled_bf16(b & 15, scale) | (_scaled_bf16(b >> 4, scale) << uint32(16))
        ws[r, d] = word


def decode_keys(ws, keys_packed, n: int, stream=0) -> DecodedKeys:
    """decode_keys_ref on the GPU: the first n of keys_packed [Ncap, bytes] into the workspace
    ws [>= key_ws_rows(n), DI/2] uint32; returns the chunk tiles kernel's view of them."""
    n = max(0, min(int(n), keys_packed.shape[0]))
    rows, RW = key_ws_rows(n), ws.shape[1]
    if ws.shape[0] < rows or keys_packed.shape[1] != kvpack.index_key_bytes(2 * RW):
        raise ValueError(f"indexer key workspace: {tuple(ws.shape)} for {n} keys of "
                         f"{keys_packed.shape[1]} bytes, expected at least ({rows}, DI/2) "
                         f"for keys of index_key_bytes(DI)")
    view = ws[:rows]
    nt = 256
    _decode_keys[min(cdiv(rows * RW, nt), 4096), nt, stream](view, keys_packed, n)
    return DecodedKeys(view, n)


def _tile_scorer(HI: int, DI: int):
    """The chunk tiles kernel for HI heads of DI dims (closure constants: register arrays)."""
    S = DI // 16  # k-steps
    WPT = HI // 32  # warps a token
    TB = TILE_WARPS // WPT  # tokens a block
    NT = 32 * TILE_WARPS
    RW = DI // 2  # words of a decoded key
    LDW = RW + PAD_WORDS  # its shared row
    TILE = TILE_KEYS * LDW
    PPR = RW // 4  # 16-byte pieces of a row
    RAP = NT // PPR  # rows copied a pass of the block's threads
    NCP = TILE_KEYS // RAP  # passes a step
    NQ = 4 * S * 2  # B registers: 4 head n-tiles x S k-steps x 2
    PART = TILE_WARPS * TILE_KEYS
    NOUT = cdiv(TB * TILE_KEYS, NT)  # combined scores a thread a step
    TILE2, PART2 = 2 * TILE, 2 * PART  # double buffers

    @cuda.jit(device=True)
    def copy_step(tile, dst, ws, src):
        """cp.async a step's rows: this thread's pieces, from word src of ws to word dst of
        tile, then RAP rows further on, NCP times."""
        for u in range(NCP):
            _cp_async16(tile, dst + uint32(u * RAP * LDW), ws, src + uint32(u * RAP * RW))

    @cuda.jit(device=True)
    def combine(out, part, pbuf, ntok, t_base, k0, T, N, tid):
        """out[t, k0 + i] for the block's tokens: the warps' partial sums, -inf past n_t."""
        for u in range(NOUT):
            idx = uint32(tid + u * NT)
            tw = idx // uint32(TILE_KEYS)
            i = idx - tw * uint32(TILE_KEYS)
            t, j = t_base + int64(tw), k0 + int64(i)
            if tw < uint32(TB) and t < T and j < N:
                sc = float32(0.0)
                for hb in range(WPT):
                    sc += part[uint32(pbuf * PART) + (tw * uint32(WPT) + uint32(hb))
                               * uint32(TILE_KEYS) + i]
                out[t, j] = sc if j < ntok[tw] else -math.inf

    def chunk_tiles(out, q, w, ws, n_keys, n_visible):
        # out [T, N], q [T, HI, DI] (on the FP4 grid), w [T, HI], ws [rows, DI/2] (keys
        # j < n_keys decoded), n_visible [T]; blockIdx.y = group of TB tokens, blockIdx.x
        # strides over the key steps
        T, N = out.shape
        tid = cuda.threadIdx.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        tw, hb = warp // WPT, warp % WPT
        t_base = cuda.blockIdx.y * TB
        t = t_base + tw
        tile = cuda.shared.array(TILE2, uint32)
        part = cuda.shared.array(PART2, float32)
        ntok = cuda.shared.array(TILE_WARPS, int32)
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        n_blk = 0
        for k in range(TB):  # the block's largest visible count bounds its steps
            tk = t_base + k
            nk = min(int(n_visible[tk]), N, n_keys, ws.shape[0]) if tk < T else 0
            nk = max(nk, 0)
            n_blk = max(n_blk, nk)
            if tid == k:
                ntok[k] = nk
        # q as the B operand: head n-tile n = heads 32 hb + 8n + (0 .. 7), lane g's column;
        # k-step s: dims 16s + 2c, +1 (b0) and 16s + 2c + 8, +9 (b1). A token past T scores
        # zeros (its outputs are not written)
        qb = cuda.local.array(NQ, uint32)
        wv = cuda.local.array(8, float32)
        tq = min(t, T - 1)
        for n in range(4):
            h = 32 * hb + 8 * n + g
            for s in range(S):
                for r in range(2):
                    d = 16 * s + 2 * c + 8 * r
                    v0 = q[tq, h, d] if t < T else float32(0.0)
                    v1 = q[tq, h, d + 1] if t < T else float32(0.0)
                    qb[(n * S + s) * 2 + r] = _split_pair(v0, v1)[0]
            hw = 32 * hb + 8 * n + 2 * c  # the heads of this lane's C columns
            wv[2 * n] = w[tq, hw]
            wv[2 * n + 1] = w[tq, hw + 1]
        # keys as the A operand by ldmatrix.x4: lane 8m + r gives row r of matrix m, m = (rows
        # 0-7 | 8-15) x (dims 0-7 | 8-15) of the m-tile's k-step. Shared offsets are unsigned
        # (no negative-index code; ptxas folds the constant parts into the loads)
        ul = uint32(lane)
        lword = (((ul & uint32(7)) + uint32(8) * ((ul >> uint32(3)) & uint32(1))) * uint32(LDW)
                 + uint32(4) * (ul >> uint32(4)))
        utid = uint32(tid)
        cdst = (utid // uint32(PPR)) * uint32(LDW) + uint32(4) * (utid % uint32(PPR))
        csrc = (utid // uint32(PPR)) * uint32(RW) + uint32(4) * (utid % uint32(PPR))
        pcol = uint32(warp * TILE_KEYS) + uint32(g)
        acc = cuda.local.array(16, float32)
        zero = float32(0.0)
        stride = cuda.gridDim.x * TILE_KEYS
        k0 = cuda.blockIdx.x * TILE_KEYS
        if k0 < n_blk:
            copy_step(tile, cdst, ws, uint32(k0 * RW) + csrc)
        _cp_async_commit()
        step = 0
        while k0 < n_blk:  # block-uniform: the steps with visible keys
            buf = uint32(step & 1)
            _cp_async_wait0()  # this step's rows (copied by this thread) have landed
            cuda.syncthreads()  # ... and everyone's; every warp is done with the last step
            k1 = k0 + stride
            if k1 < n_blk:  # the next step's rows, in flight over this step's MMAs
                copy_step(tile, (buf ^ uint32(1)) * uint32(TILE) + cdst, ws,
                          uint32(k1 * RW) + csrc)
            _cp_async_commit()
            if step > 0:
                combine(out, part, buf ^ uint32(1), ntok, t_base, k0 - stride, T, N, tid)
            base = buf * uint32(TILE) + lword
            # the next (m-tile, k-step) fragment is loaded while this one is in the MMAs (the
            # last one's next: the first again, unused)
            a0, a1, a2, a3 = _ldsm_x4(tile, base, xch)
            for mt in range(4):  # a key m-tile at a time: 16 accumulators live
                for i in range(16):
                    acc[i] = zero
                mo = base + uint32(mt) * uint32(16 * LDW)
                for s in range(S):
                    if s + 1 < S:
                        nxt = mo + uint32(8 * (s + 1))
                    else:
                        nxt = base + (uint32(mt + 1) & uint32(3)) * uint32(16 * LDW)
                    n0, n1, n2, n3 = _ldsm_x4(tile, nxt, xch)
                    for n in range(4):
                        o, b = 4 * n, (n * S + s) * 2
                        acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = _mma_bf16(
                            a0, a1, a2, a3, qb[b], qb[b + 1],
                            acc[o], acc[o + 1], acc[o + 2], acc[o + 3], xch)
                    a0, a1, a2, a3 = n0, n1, n2, n3
                # C of head n-tile n: (key g, head 2c) (g, 2c+1) (g+8, 2c) (g+8, 2c+1)
                r0, r1 = zero, zero
                for n in range(4):
                    o = 4 * n
                    r0 = r0 + wv[2 * n] * max(acc[o], zero)
                    r0 = r0 + wv[2 * n + 1] * max(acc[o + 1], zero)
                    r1 = r1 + wv[2 * n] * max(acc[o + 2], zero)
                    r1 = r1 + wv[2 * n + 1] * max(acc[o + 3], zero)
                for off in (1, 2):  # the warp's 32 heads: over c
                    r0 += xor_shfl(r0, off, shf)
                    r1 += xor_shfl(r1, off, shf)
                if c == 0:
                    col = buf * uint32(PART) + pcol + uint32(16 * mt)
                    part[col] = r0
                    part[col + uint32(8)] = r1
            k0 = k1
            step += 1
        if step > 0:
            cuda.syncthreads()
            combine(out, part, uint32((step - 1) & 1), ntok, t_base, k0 - stride, T, N, tid)
        while k0 < N:  # past every token's visible keys: only the -inf fill
            for idx in range(tid, TB * TILE_KEYS, NT):
                tt, j = t_base + idx // TILE_KEYS, k0 + idx % TILE_KEYS
                if tt < T and j < N:
                    out[tt, j] = -math.inf
            k0 += stride

    chunk_tiles.__name__ = f"_indexer_scores_chunk_tiles_hi{HI}_di{DI}"
    return kernel(chunk_tiles, max_registers=TILE_REGS)


_TILE_KERNELS: dict = {}


def _tile_kernel(HI: int, DI: int):
    if (HI, DI) not in _TILE_KERNELS:
        _TILE_KERNELS[HI, DI] = _tile_scorer(HI, DI)
    return _TILE_KERNELS[HI, DI]


def indexer_scores_mma(out, q, w, keys_packed, n_visible, stream=0) -> None:
    """Decode form (indexer.indexer_scores' arguments): out[N] f32 <- q[HI, DI], w[HI],
    keys_packed[Ncap, bytes] uint8, n_visible[1] int32."""
    HI, DI = q.shape
    assert fits(HI, DI), (HI, DI)
    kern = _kernels(DI)[0]
    args = (out, q, w, keys_packed.view(np.uint32), keys_packed, n_visible)
    nt = 2 * HI
    grid = max(1, min(cdiv(out.shape[0], STEP_KEYS), resident_blocks(kern, args, nt)))
    kern[grid, nt, stream](*args)


def indexer_scores_chunk_mma(out, q, w, keys_packed, n_visible, stream=0,
                             q_fp4: bool = False, key_ws: DecodedKeys | None = None) -> None:
    """Chunk form: out[T, N] f32 <- q[T, HI, DI], w[T, HI], keys_packed, n_visible[T].
    ``q_fp4``: q is on the FP4 grid (exact in bf16), so the chunk tiles kernel may take it,
    reading ``key_ws`` (decode_keys of keys_packed; decoded here into a new array if None)."""
    T, HI, DI = q.shape
    if q_fp4 and fits_tiles(HI, DI):
        if key_ws is None:
            n = min(keys_packed.shape[0], out.shape[1])
            ws = cuda.device_array((key_ws_rows(n), DI // 2), np.uint32, stream=stream)
            key_ws = decode_keys(ws, keys_packed, n, stream)
        kern = _tile_kernel(HI, DI)
        args = (out, q, w, key_ws.rows, key_ws.n, n_visible)
        nt = 32 * TILE_WARPS
        groups = cdiv(T, TILE_WARPS // (HI // 32))
        resident = resident_blocks(kern, args, nt)
        per_group = max(1, min(cdiv(out.shape[1], TILE_KEYS), cdiv(resident, groups)))
        kern[(per_group, groups), nt, stream](*args)
        return
    assert fits(HI, DI), (HI, DI)
    kern = _kernels(DI)[1]
    args = (out, q, w, keys_packed.view(np.uint32), keys_packed, n_visible)
    nt = 2 * HI
    resident = resident_blocks(kern, args, nt)
    per_token = max(1, min(cdiv(out.shape[1], STEP_KEYS), cdiv(resident, T)))
    kern[(per_token, T), nt, stream](*args)


# CI lane B compiles both forms at V4's DI = 128
_SIG = "uint32[:, ::1], uint8[:, ::1]"
PTX_SIGNATURES = [
    (_kernels(128)[0], f"void(float32[::1], float32[:, ::1], float32[::1], {_SIG}, int32[::1])"),
    (_kernels(128)[1], f"void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], {_SIG}, "
                       "int32[::1])"),
    (_tile_kernel(64, 128), "void(float32[:, ::1], float32[:, :, ::1], float32[:, ::1], "
                            "uint32[:, ::1], int64, int32[::1])"),
    (_decode_keys, "void(uint32[:, ::1], uint8[:, ::1], int64)"),
]
