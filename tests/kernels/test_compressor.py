"""Compressor kernels vs the model's own compressor (Forward._compress + _emit_kv/_emit_index_key).

Sizes are tiny (kv d = 128 with R = 64, indexer d = 64) but keep every structural case: CSA
overlap lanes (r = 4, 2r state rows), HCA (r = 8), a chunk that starts inside a block, several
emissions, and a state carried over from earlier tokens.
"""
import numpy as np
import pytest
from numba import cuda

from kernels.kernel_testing import THREADS, fresh_rng, poisoned, rel_err
from pocketfm import ops
from pocketfm.kernels import compressor as cp
from pocketfm.kernels.kvpack import (index_key_bytes, kv_entry_bytes, pack_index_key_ref,
                                     pack_kv_ref)
from pocketfm.numerics import fp4_roundtrip, rope_frequencies

CASES = {  # ratio, overlap, d, R, (QAT mode, plain mode)
    "csa_kv": (4, True, 128, 64, (cp.MODE_KV_FP8, cp.MODE_KV)),
    "hca_kv": (8, False, 128, 64, (cp.MODE_KV_FP8, cp.MODE_KV)),
    "csa_index": (4, True, 64, 64, (cp.MODE_INDEX_FP4, cp.MODE_INDEX)),
}
EPS = 1e-6


class Setup:
    """Random inputs for T tokens after a prefix of P tokens already run through the model."""

    def __init__(self, case, T, rng):
        self.ratio, self.overlap, self.d, self.R, self.modes = CASES[case]
        r, d = self.ratio, self.d
        width, rows = (2 if self.overlap else 1) * d, (2 if self.overlap else 1) * r
        f32 = np.float32
        self.T, self.P = T, int(rng.integers(1, 2 * r))
        self.a = rng.normal(size=(T, width)).astype(f32)
        self.g = (rng.normal(size=(T, width)) * 2).astype(f32)
        self.ape = rng.normal(size=(r, width)).astype(f32)
        self.norm_w = (1 + 0.3 * rng.normal(size=d)).astype(f32)
        self.freqs = rope_frequencies(self.R, 160000.0, 16.0, 65536)  # compressed-layer YaRN
        self.N = (self.P + T) // r + 1
        self.kv, self.score = np.zeros((rows, width), f32), np.full((rows, width), -np.inf, f32)
        prefix_a = rng.normal(size=(self.P, width)).astype(f32)
        prefix_g = rng.normal(size=(self.P, width)).astype(f32)
        cp.compressor_chunk_ref(self.kv, self.score, prefix_a, prefix_g, self.ape, np.array([0]),
                                r, self.overlap, self.norm_w, self.freqs, EPS, self.modes[1],
                                np.zeros((self.N, d), f32))
        self.pos0 = np.array([self.P], np.int32)
        self.js = np.arange(self.P // r, (self.P + T) // r)  # entries the chunk emits

    def packed_bytes(self, mode):
        return kv_entry_bytes(self.d, self.R) if mode == cp.MODE_KV_FP8 else index_key_bytes(self.d)

    def args(self, mode):
        return (self.ratio, self.overlap, cuda.to_device(self.norm_w),
                cuda.to_device(self.freqs), EPS, mode)

    def run_chunk(self, mode, naive, packed=False, entries=True):
        """Kernel chunk from the prefix state -> (state kv, state score, entries, packed)."""
        kv, sc = cuda.to_device(self.kv), cuda.to_device(self.score)
        out = poisoned((self.N, self.d)) if entries else None
        outp = cuda.to_device(np.full((self.N, self.packed_bytes(mode)), 0xAB, np.uint8)) \
            if packed else None
        cp.compressor_chunk(kv, sc, cuda.to_device(self.a), cuda.to_device(self.g),
                            cuda.to_device(self.ape), cuda.to_device(self.pos0), *self.args(mode),
                            out, outp, threads=THREADS, naive=naive)
        return (kv.copy_to_host(), sc.copy_to_host(), out.copy_to_host() if entries else None,
                outp.copy_to_host() if packed else None)

    def run_steps(self, mode, packed=True, entries=True):
        kv, sc = cuda.to_device(self.kv), cuda.to_device(self.score)
        out = poisoned((self.N, self.d)) if entries else None
        outp = cuda.to_device(np.full((self.N, self.packed_bytes(mode)), 0xAB, np.uint8)) \
            if packed else None
        ape, pos = cuda.to_device(self.ape), cuda.to_device(self.pos0)
        args = self.args(mode)
        for t in range(self.T):
            pos.copy_to_device(self.pos0 + t)  # the step reads its position from the device
            cp.compressor_step(kv, sc, cuda.to_device(self.a[t]), cuda.to_device(self.g[t]), ape,
                               pos, *args, out, outp, threads=THREADS)
        return (kv.copy_to_host(), sc.copy_to_host(), out.copy_to_host() if entries else None,
                outp.copy_to_host() if packed else None)

    def run_model(self, mode, dtype):
        kv, sc = self.kv.astype(dtype), self.score.astype(dtype)
        out = np.full((self.N, self.d), np.nan, dtype)
        outp = np.full((self.N, self.packed_bytes(mode)), 0xAB, np.uint8) \
            if mode in (cp.MODE_KV_FP8, cp.MODE_INDEX_FP4) else None
        cp.compressor_chunk_ref(kv, sc, self.a.astype(dtype), self.g.astype(dtype),
                                self.ape.astype(dtype), self.pos0, self.ratio, self.overlap,
                                self.norm_w, self.freqs, EPS, mode, out, outp)
        return kv, sc, out, outp


@pytest.mark.parametrize("case", list(CASES))
def test_chunk_matches_model(case):
    """The parallel chunk kernels vs the model; the naive scan equals them (next test)."""
    s = Setup(case, 3 * CASES[case][0] + 1, fresh_rng())
    qat_mode, plain_mode = s.modes
    kv, sc, plain, _ = s.run_chunk(plain_mode, naive=False)
    m_kv, m_sc, _, _ = s.run_model(plain_mode, np.float32)
    assert np.array_equal(kv, m_kv) and np.array_equal(sc, m_sc)  # copies and one f32 add
    _, _, ref, _ = s.run_model(plain_mode, np.float64)
    assert rel_err(plain[s.js], ref[s.js]) <= 1e-5
    others = np.setdiff1d(np.arange(s.N), s.js)
    assert np.isnan(plain[others]).all()  # only the completed entries are written

    _, _, q, qp = s.run_chunk(qat_mode, naive=False, packed=True)
    # QAT on: exactly the model's round-trip of the kernel's own pre-QAT entries ...
    want = np.empty_like(plain[s.js])
    if qat_mode == cp.MODE_KV_FP8:
        ops.kv_roundtrip(want, plain[s.js], s.R)
    else:
        want = fp4_roundtrip(plain[s.js], 32)
    assert np.array_equal(q[s.js], want)
    # ... packed exactly as kvpack packs those entries (other rows untouched) ...
    rows = np.empty((len(s.js), qp.shape[1]), np.uint8)
    if qat_mode == cp.MODE_KV_FP8:
        pack_kv_ref(rows, q[s.js], s.R)
    else:
        pack_index_key_ref(rows, q[s.js])
    assert np.array_equal(qp[s.js], rows) and (qp[others] == 0xAB).all()
    # ... and the float64 model agrees except for rare rounding flips at a boundary
    _, _, ref_q, _ = s.run_model(qat_mode, np.float64)
    far = ~np.isclose(q[s.js], ref_q[s.js], rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(far) <= max(1, far.size // 1000)


@pytest.mark.parametrize("case", list(CASES))
def test_step_equals_chunk(case):
    """Decode steps and both chunk kernels: the same state, entries and bytes, bit for bit."""
    r = CASES[case][0]
    s = Setup(case, r + 3 if r > 4 else 2 * r + 2, fresh_rng())
    mode = s.modes[0]
    steps = s.run_steps(mode)
    gather = s.run_chunk(mode, naive=False, packed=True)
    for x, y in zip(steps, gather):
        np.testing.assert_array_equal(x, y)
    kv, sc, _, packed = s.run_chunk(mode, naive=True, packed=True, entries=False)
    for x, y in zip(steps[:2] + steps[3:], (kv, sc, packed)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("case", ["csa_kv", "csa_index"])
def test_step_rowmap_writes_the_staging_slot(case):
    """KV swap: with a rowmap the step writes entry j into row rowmap[j] (its GPU staging slot)
    — the same bytes the plain step writes into row j — and nothing for rowmap[j] = -1; the
    reference does the same."""
    rng = fresh_rng()
    r = CASES[case][0]
    s = Setup(case, 3 * r + 1, rng)
    mode = s.modes[0]
    _, _, plain, plain_p = s.run_steps(mode)
    slots = s.N + 3
    rowmap = rng.permutation(slots)[:s.N].astype(np.int32)
    rowmap[s.js[0]] = -1  # an entry without a slot is dropped
    kv, sc = cuda.to_device(s.kv), cuda.to_device(s.score)
    out = cuda.to_device(np.full((slots, s.d), 7.0, np.float32))
    outp = cuda.to_device(np.full((slots, s.packed_bytes(mode)), 0xAB, np.uint8))
    ref_kv, ref_sc = s.kv.copy(), s.score.copy()
    ref_out, ref_p = np.full((slots, s.d), 7.0, np.float32), \
        np.full((slots, s.packed_bytes(mode)), 0xAB, np.uint8)
    ape, pos, d_map = cuda.to_device(s.ape), cuda.to_device(s.pos0), cuda.to_device(rowmap)
    for t in range(s.T):
        pos.copy_to_device(s.pos0 + t)
        cp.compressor_step(kv, sc, cuda.to_device(s.a[t]), cuda.to_device(s.g[t]), ape, pos,
                           *s.args(mode), out, outp, threads=THREADS, rowmap=d_map)
        cp.compressor_step_ref(ref_kv, ref_sc, s.a[t], s.g[t], s.ape, s.pos0 + t, s.ratio,
                               s.overlap, s.norm_w, s.freqs, EPS, mode, ref_out, ref_p,
                               rowmap=rowmap)
    got, got_p = out.copy_to_host(), outp.copy_to_host()
    written = [j for j in s.js if rowmap[j] >= 0]
    assert written and np.array_equal(got[rowmap[written]], plain[written])
    assert np.array_equal(got_p[rowmap[written]], plain_p[written])
    untouched = np.setdiff1d(np.arange(slots), rowmap[written])
    assert (got[untouched] == 7.0).all() and (got_p[untouched] == 0xAB).all()
    np.testing.assert_array_equal(got_p, ref_p)
    np.testing.assert_array_equal(kv.copy_to_host(), ref_kv)
