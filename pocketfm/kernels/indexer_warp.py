"""The decode's indexer scores with one warp holding every head, and the top-k's first radix
digit counted on the way (indexer.indexer_scores(q_fp4=True, top_k=...); the engine's, with
DecodeEngine.indexer_one_warp / scorer_counts_first_digit: −1.8% a step, H100, BENCHMARKS
2026-12-05 (j)).

    indexer_scores_warp   out[N] = Σ_h w[h] · ReLU(q[h] · key_j), j < n_visible; -inf after

indexer_mma.py's decode kernel splits the heads over a block's warps (16 each): each key is
loaded and decoded once per warp, four times at V4's HI = 64, and every 32-key step ends in two
block barriers to sum the warps' partial scores (H100, 256K: 25.7 µs for 65,536 keys, ~5% of
what the tensor cores and the 4.5 MB of keys allow; BENCHMARKS 2026-12-05 (i)). The model's q
is on the FP4 grid (hadamard_fp4), so its bf16 hi half is exact and the lo MMAs never run: one
warp can hold every head's A fragments (HI/16 m-tiles x DI/16 k-steps x 4 registers, 128 at
64 x 128), decode each key once into B (indexer_mma's byte -> bf16-pair table and k order),
feed it to HI/16 MMAs, and sum the heads in registers and 3 xor shuffles, with no barrier after
q is staged. Letters as in indexer.py: HI heads, DI dims, N keys.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from . import kvpack
from .device import cdiv, empty_vector, kernel, resident_blocks, xor_shfl
from .gemv import _bits_f32
from .indexer_mma import SHF, XCH, _e2m1_bf16
from .lowbit_layout import _f32_bits
from .mma import _mma_bf16, _split_pair


# ---- the top-k's first digit, counted by the scorer ---------------------------------------------
FIRST_DIGIT_SHIFT = 21  # indexer.topk's first radix pass: the order key's top 11 bits
FIRST_DIGIT_BINS = 1 << (32 - FIRST_DIGIT_SHIFT)


def order_key(bits):
    """Order-preserving unsigned key (int64) of a float32's bits; -0.0 ranks as +0.0 (the
    top-k's order: indexer.py inlines this same function)."""
    u = int(bits)
    if u == 0x80000000:
        u = 0
    return (0xFFFFFFFF - u) if u >= 0x80000000 else (u + 0x80000000)


_order_key = cuda.jit(device=True, inline="always")(order_key)


# ---- the kernel -------------------------------------------------------------------------------
# The warps walk their own WARP_GROUPS x 8 keys a step, the next step's key words requested
# before this step's MMAs. q reaches the registers through shared memory in fragment order (a
# lane's word i at i·32 + lane: no bank conflicts), staged once a block.
# With ``hist`` (indexer.topk's workspace, k > 0 and more than k keys visible) the kernel also
# counts the top-k's first radix digit of every visible score, in shared memory and then into
# hist[0 : FIRST_DIGIT_BINS], so that topk(..., first_digit_counted=True) starts at its pick:
# one pass over the scores and one grid barrier fewer.
WARP_GROUPS = 2  # 8-key MMA groups a warp takes a step
WARP_A_REGS = 128  # A registers a lane may hold (q's fragments)
WARP_THREADS = 128  # a block: 4 warps (two blocks an SM at 250 registers: ptxas, sm_90)


def q_fragment_index(h, d, DI):
    """Where the bf16 pair of q[h, d], q[h, d + 1] (d even) sits among the A fragments a warp
    holds (word r of lane l at r·32 + l): register r = 4(mt·S + s) + v of lane (g, c) holds
    head 16 mt + g (+8 for odd v), dims 16 s + 4 c (+2 for v >= 2) and the next (S = DI / 16:
    the k-steps; the m16n8k16 A layout)."""
    mt, gl = h // 16, h % 16
    s, rem = d // 16, d % 16
    v = gl // 8 + 2 * ((rem % 4) // 2)
    return (4 * (mt * (DI // 16) + s) + v) * 32 + 4 * (gl % 8) + rem // 4


q_fragment_index_device = cuda.jit(device=True, inline="always")(q_fragment_index)


def q_fragments_ref(q: np.ndarray) -> np.ndarray:
    """uint32 [HI·DI/2]: q[HI, DI]'s bf16 pairs (round to nearest even; exact on the FP4 grid)
    in fragment order (q_fragment_index): what the scorer stages, made ahead (the query's
    kernel writes them: indexer_query(frag=))."""
    HI, DI = q.shape
    b = np.ascontiguousarray(q, np.float32).view(np.uint32).astype(np.uint64)
    hi = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)  # bf16 bits of each value
    out = np.empty(HI * DI // 2, np.uint32)
    for h in range(HI):
        for d in range(0, DI, 2):
            out[q_fragment_index(h, d, DI)] = hi[h, d] | (hi[h, d + 1] << np.uint32(16))
    return out


def fits_warp(HI: int, DI: int) -> bool:
    """Whether one warp can hold every head's q fragments (and a key row is whole 32-bit
    words: the kernel reads codes and scales as words)."""
    return (HI % 16 == 0 and DI % 32 == 0 and (HI // 16) * (DI // 16) * 4 <= WARP_A_REGS
            and kvpack.index_key_bytes(DI) % 4 == 0)


def _warp_scorer(HI: int, DI: int, groups: int, frag: bool = False):
    """The one-warp decode kernel for HI heads of DI dims, ``groups`` 8-key MMA groups a warp a
    step (closure constants: register arrays). ``frag``: q comes also as its A fragments
    (``qf``, q_fragments_ref's order, made by the query's kernel), loaded straight into the
    registers, 128 independent loads a lane; else q is staged through shared memory, a few
    words a round trip (Nsight, H100, in the step: 47% of this kernel's samples, 2026-12-07
    (x))."""
    MT, S, NB = HI // 16, DI // 16, DI // 32  # m-tiles, k-steps, scale blocks
    NA = 4 * MT * S  # A registers a lane
    NC = 4 * MT  # C registers a lane (per accumulator)
    QF = 32 * NA  # q's fragments, every lane's
    QS = 1 if frag else QF  # the staged copy's words (a literal for cuda.shared.array)
    SW = cdiv(NB, 4)  # scale words of a key
    SW0 = DI // 8  # the first of them: the scale bytes follow the DI/2 code bytes
    NK = groups * S  # key words a lane loads a step
    NS = groups * 2 * SW  # scale words a lane loads a step (its two C columns' keys)
    KPW = 8 * groups  # keys a warp a step

    @cuda.jit(device=True)
    def load(kw, sw, keys32, k0, n, g, c):
        """This lane's key words of keys k0 .. k0 + KPW - 1 (clamped to n - 1): for B, key
        k0 + 8·gi + g's words 2s + c/2 (the dims 16s + 4c .. +3 of k-step s in its half); for
        the scales, the keys of its C columns, k0 + 8·gi + 2c and + 1."""
        for gi in range(groups):
            j = min(k0 + 8 * gi + g, n - 1)
            for s in range(S):
                kw[gi * S + s] = uint32(keys32[j, 2 * s + (c >> 1)])
            ja = min(k0 + 8 * gi + 2 * c, n - 1)
            jb = min(ja + 1, n - 1)
            for i in range(SW):
                sw[2 * gi * SW + i] = uint32(keys32[ja, SW0 + i])
                sw[(2 * gi + 1) * SW + i] = uint32(keys32[jb, SW0 + i])

    def scores_warp(out, q, w, keys32, n_visible, hist, k, qf):
        # out [N], q [HI, DI] on the FP4 grid, w [HI], keys32 [Ncap, row words], n_visible [1];
        # hist int32 [>= FIRST_DIGIT_BINS] with k > 0: the top-k's first digit counted there
        # (only when more than k keys are visible: topk takes them all otherwise); qf uint32
        # [HI·DI/2], q's fragments (FRAG builds; else unread). Persistent grid over steps of
        # (warps x KPW) keys.
        N = out.shape[0]
        n = min(int(n_visible[0]), N, keys32.shape[0])
        count = k > 0 and n > k  # (grid-uniform)
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        lane, warp = tid & 31, tid >> 5
        g, c = lane >> 2, lane & 3
        step_keys = (nt >> 5) * KPW
        kw = cuda.local.array(NK, uint32)
        sw = cuda.local.array(NS, uint32)
        st0 = cuda.blockIdx.x
        if st0 * step_keys < n:  # the first keys requested before q is staged
            load(kw, sw, keys32, st0 * step_keys + warp * KPW, n, g, c)
        tab = cuda.shared.array(256, uint32)  # byte -> bf16 pair (low nibble in the low half)
        qs = cuda.shared.array(QS, uint32)  # q's A fragments, staged (not FRAG)
        ws = cuda.shared.array(HI, float32)
        hs = cuda.shared.array(FIRST_DIGIT_BINS, int32)  # this block's first-digit counts
        xch = cuda.shared.array(XCH, np.int64)
        shf = cuda.shared.array(SHF, float32)
        for i in range(tid, 256, nt):
            tab[i] = uint32(_e2m1_bf16(i & 15)) | (uint32(_e2m1_bf16(i >> 4)) << uint32(16))
        if count:
            for i in range(tid, FIRST_DIGIT_BINS, nt):
                hs[i] = 0
        qa = cuda.local.array(NA, uint32)
        if frag:
            for r in range(NA):
                qa[r] = qf[r * 32 + lane]
        else:
            for i in range(tid, QF, nt):
                # register r = 4(mt·S + s) + v of lane (gl, cl): head 16mt + gl (+8 for odd
                # v), dims 16s + 4cl (+2 for v >= 2) and the next (q_fragment_index)
                r, l = i >> 5, i & 31
                v, ms = r & 3, r >> 2
                h = 16 * (ms // S) + (l >> 2) + 8 * (v & 1)
                d = 16 * (ms % S) + 4 * (l & 3) + 2 * (v >> 1)
                qs[i] = _split_pair(q[h, d], q[h, d + 1])[0]  # exact: q is on the FP4 grid
        for i in range(tid, HI, nt):
            ws[i] = w[i]
        cuda.syncthreads()
        if not frag:
            for r in range(NA):
                qa[r] = qs[r * 32 + lane]
        zero = float32(0.0)
        half = uint32(16 * (c & 1))
        nkw = cuda.local.array(NK, uint32)
        nsw = cuda.local.array(NS, uint32)
        t = cuda.local.array(NC, float32)
        acc = cuda.local.array(NC, float32)
        for st in range(st0, (N + step_keys - 1) // step_keys, cuda.gridDim.x):
            kb = st * step_keys
            if kb >= n:  # past the visible keys (block-uniform): only the -inf fill
                for i in range(tid, step_keys, nt):
                    if kb + i < N:
                        out[kb + i] = -math.inf
                continue
            k0 = kb + warp * KPW
            nxt = kb + cuda.gridDim.x * step_keys
            if nxt < n:  # the next step's words, in flight during this step's MMAs
                load(nkw, nsw, keys32, nxt + warp * KPW, n, g, c)
            for gi in range(groups):
                for i in range(NC):
                    acc[i] = zero
                for b in range(NB):  # a 32-dim scale block: two k-steps, then the key's scale
                    for i in range(NC):
                        t[i] = zero
                    for s in range(2 * b, 2 * b + 2):
                        pair = (kw[gi * S + s] >> half) & uint32(0xFFFF)
                        b0 = tab[pair & uint32(0xFF)]
                        b1 = tab[pair >> uint32(8)]
                        for mt in range(MT):
                            a = 4 * (mt * S + s)
                            t[4 * mt], t[4 * mt + 1], t[4 * mt + 2], t[4 * mt + 3] = _mma_bf16(
                                qa[a], qa[a + 1], qa[a + 2], qa[a + 3], b0, b1, t[4 * mt],
                                t[4 * mt + 1], t[4 * mt + 2], t[4 * mt + 3], xch)
                    sh = uint32(8 * (b & 3))
                    sa = _bits_f32(int32((sw[2 * gi * SW + (b >> 2)] >> sh) & uint32(255)) << 23)
                    sb = _bits_f32(int32((sw[(2 * gi + 1) * SW + (b >> 2)] >> sh)
                                         & uint32(255)) << 23)
                    for mt in range(MT):  # C: (h0, key 2c) (h0, 2c+1) (h1, 2c) (h1, 2c+1)
                        acc[4 * mt] += t[4 * mt] * sa
                        acc[4 * mt + 1] += t[4 * mt + 1] * sb
                        acc[4 * mt + 2] += t[4 * mt + 2] * sa
                        acc[4 * mt + 3] += t[4 * mt + 3] * sb
                pa, pb = zero, zero  # the lane's 2·MT heads, ReLU-weighted, then over g
                for mt in range(MT):
                    w0, w1 = ws[16 * mt + g], ws[16 * mt + g + 8]
                    pa += w0 * max(acc[4 * mt], zero) + w1 * max(acc[4 * mt + 2], zero)
                    pb += w0 * max(acc[4 * mt + 1], zero) + w1 * max(acc[4 * mt + 3], zero)
                for off in (4, 8, 16):
                    pa += xor_shfl(pa, off, shf)
                    pb += xor_shfl(pb, off, shf)
                j = k0 + 8 * gi + 2 * c
                if g == 0 and j < N:
                    out[j] = pa if j < n else -math.inf
                if g == 0 and j + 1 < N:
                    out[j + 1] = pb if j + 1 < n else -math.inf
                if count and g == 0 and j < n:
                    cuda.atomic.add(hs, _order_key(_f32_bits(pa)) >> FIRST_DIGIT_SHIFT, 1)
                if count and g == 0 and j + 1 < n:
                    cuda.atomic.add(hs, _order_key(_f32_bits(pb)) >> FIRST_DIGIT_SHIFT, 1)
            for i in range(NK):
                kw[i] = nkw[i]
            for i in range(NS):
                sw[i] = nsw[i]
        if count:  # the block's counts into the top-k's workspace (its nonzero bins)
            cuda.syncthreads()
            for i in range(tid, FIRST_DIGIT_BINS, nt):
                if hs[i] > 0:
                    cuda.atomic.add(hist, i, hs[i])
    name = f"_indexer_scores_warp_hi{HI}_di{DI}_g{groups}" + ("_qfrag" if frag else "")
    scores_warp.__name__ = scores_warp.__qualname__ = name  # (the qualname: debug line info)
    return kernel(scores_warp)


_WARP_KERNELS: dict = {}


def _warp_kernel(HI: int, DI: int, groups: int = WARP_GROUPS, frag: bool = False):
    if (HI, DI, groups, frag) not in _WARP_KERNELS:
        _WARP_KERNELS[HI, DI, groups, frag] = _warp_scorer(HI, DI, groups, frag)
    return _WARP_KERNELS[HI, DI, groups, frag]


_NO_HIST = []  # a 1-element int32 stand-in for ``hist`` (made once)


def indexer_scores_warp(out, q, w, keys_packed, n_visible, stream=0,
                        threads: int = WARP_THREADS, groups: int = WARP_GROUPS,
                        first_digit=None, q_frag=None) -> None:
    """Decode form (as indexer_scores_mma) for q on the FP4 grid (hadamard_fp4's output), one
    warp holding every head: fits_warp(HI, DI) must hold. ``first_digit`` = (workspace, k):
    also count the top-k's first digit into that topk_workspace (see above). ``q_frag``: q's
    fragments as q_fragments_ref makes them (uint32 [HI·DI/2], indexer_query(frag=)), read
    instead of staging q. ``threads`` / ``groups``: the block and the 8-key groups a warp
    takes a step (benchmarks)."""
    HI, DI = q.shape
    assert fits_warp(HI, DI), (HI, DI)
    assert q_frag is None or q_frag.shape == (HI * DI // 2,), (q_frag.shape, HI, DI)
    kern = _warp_kernel(HI, DI, groups, q_frag is not None)
    if first_digit is None:
        if not _NO_HIST:
            _NO_HIST.append(cuda.to_device(np.zeros(1, np.int32)))
        first_digit = (_NO_HIST[0], 0)
    hist, k = first_digit
    args = (out, q, w, keys_packed.view(np.uint32), n_visible, hist, int(k),
            empty_vector(np.uint32) if q_frag is None else q_frag)
    step_keys = threads // 32 * 8 * groups
    grid = max(1, min(cdiv(out.shape[0], step_keys), resident_blocks(kern, args, threads)))
    kern[grid, threads, stream](*args)


# CI lane B compiles both at V4's geometry
PTX_SIGNATURES = [
    (_warp_kernel(64, 128, groups, frag), "void(float32[::1], float32[:, ::1], float32[::1], "
                                          "uint32[:, ::1], int32[::1], int32[::1], int64, "
                                          "uint32[::1])")
    for groups in (1, 2) for frag in (False, True)
]
