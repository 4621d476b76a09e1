"""The decode step's bookkeeping kernels against their NumPy twins (engine/step_kernels.py)."""
import numpy as np
import pytest
from numba import cuda

from .kernel_testing import fresh_rng
from pocketfm.engine import step_kernels as sk


def test_begin_and_end_step_walk_a_prompt_then_generate():
    rng = fresh_rng()
    cap, n_prompt, W, ratios = 12, 5, 4, np.array([4, 8], np.int32)
    ids = np.zeros(cap + 1, np.int32)
    ids[:n_prompt] = rng.integers(0, 100, n_prompt)
    uniforms = rng.random(cap).astype(np.float32)
    meta = np.zeros(sk.META_RATIOS + 2, np.int32)
    meta[sk.META_PROMPT] = n_prompt
    d_meta, d_ids = cuda.to_device(meta), cuda.to_device(ids)
    d_uni, d_ratios = cuda.to_device(uniforms), cuda.to_device(ratios)
    d_tok, d_u, d_next = (cuda.to_device(np.zeros(1, t)) for t in (np.int32, np.float32, np.int32))
    tok, u = np.zeros(1, np.int32), np.zeros(1, np.float32)
    for p in range(cap):
        sk.begin_step(d_meta, d_ids, d_tok, d_u, d_uni, d_ratios, W)
        sk.begin_step_ref(meta, ids, tok, u, uniforms, ratios, W)
        assert np.array_equal(d_meta.copy_to_host(), meta)
        assert d_tok.copy_to_host()[0] == tok[0] == ids[p]
        assert d_u.copy_to_host()[0] == u[0]
        nxt = np.array([rng.integers(100, 200)], np.int32)
        d_next.copy_to_device(nxt)
        sk.end_step(d_meta, d_ids, d_next)
        sk.end_step_ref(meta, ids, nxt)
        assert np.array_equal(d_ids.copy_to_host(), ids)
        assert np.array_equal(d_meta.copy_to_host(), meta)
    assert meta[sk.META_POS] == cap and np.all(ids[n_prompt:] >= 100)  # prompt kept, rest sampled
    assert meta[sk.META_WINDOW] == W and list(meta[sk.META_RATIOS:]) == [cap // 4, cap // 8]


def test_store_row_writes_the_ring_slot_of_pos():
    rng = fresh_rng()
    ring = rng.integers(0, 256, (5, 40), dtype=np.uint8)
    row = rng.integers(0, 256, (1, 40), dtype=np.uint8)
    for pos in (3, 7, 10):
        meta = np.array([pos, 0, 0], np.int32)
        d_ring = cuda.to_device(ring)
        sk.store_row(d_ring, cuda.to_device(row), cuda.to_device(meta))
        sk.store_row_ref(ring, row, meta)
        assert np.array_equal(d_ring.copy_to_host(), ring)
        assert np.array_equal(ring[pos % 5], row[0])


@pytest.mark.parametrize("rows", [1, 3])
def test_scale(rows):
    x = fresh_rng().standard_normal((rows, 150)).astype(np.float32)
    d = cuda.to_device(x)
    sk.scale(d, 0.125)
    sk.scale_ref(x, 0.125)
    assert np.array_equal(d.copy_to_host(), x)


def test_swap_leading_axes():
    x = fresh_rng().standard_normal((3, 5, 7)).astype(np.float32)
    out = cuda.to_device(np.full((5, 3, 7), np.nan, np.float32))
    sk.swap_leading(out, cuda.to_device(x))
    ref = np.empty((5, 3, 7), np.float32)
    sk.swap_leading_ref(ref, x)
    assert np.array_equal(out.copy_to_host(), ref)
    assert np.array_equal(ref[4, 2], x[2, 4])


def test_fill_words_resets_packed_and_float_caches():
    from pocketfm.engine.decode import NEG_INF_BITS

    rng = fresh_rng()
    packed = cuda.to_device(rng.integers(0, 256, (5, 584), dtype=np.uint8))
    sk.fill_words(packed.view(np.uint32), 0)
    assert not packed.copy_to_host().any()
    scores = cuda.to_device(rng.standard_normal((3, 7)).astype(np.float32))
    sk.fill_words(scores.view(np.uint32), NEG_INF_BITS)
    assert np.all(scores.copy_to_host() == -np.inf)
    ref = np.ones((2, 3), np.uint32)
    sk.fill_words_ref(ref, 7)
    assert np.all(ref == 7)


def test_resident_mask_and_drop():
    """Level 2 inside Level 1: committed non-resident chunks get -inf scores and leave the top-k;
    chunks past the commit (formed since) stay selectable."""
    rng = fresh_rng()
    N, n_commit = 50, np.array([37], np.int32)
    scores = rng.standard_normal(N).astype(np.float32)
    resident = (rng.random(N) < 0.4).astype(np.uint8)
    d = cuda.to_device(scores)
    sk.mask_nonresident(d, cuda.to_device(resident), cuda.to_device(n_commit))
    sk.mask_nonresident_ref(scores, resident, n_commit)
    got = d.copy_to_host()
    assert np.array_equal(got, scores)
    assert np.isneginf(got[:37][resident[:37] == 0]).all() and np.isfinite(got[37:]).all()
    sel = rng.integers(-1, N, 16).astype(np.int32)
    ds = cuda.to_device(sel)
    sk.drop_nonresident(ds, cuda.to_device(resident), cuda.to_device(n_commit))
    sk.drop_nonresident_ref(sel, resident, n_commit)
    assert np.array_equal(ds.copy_to_host(), sel)
    kept = sel[sel >= 0]
    assert np.all((kept >= 37) | (resident[np.minimum(kept, N - 1)] == 1))


def test_sort_selected_rows():
    """Top-k picks in a repeatable order: ascending, -1 pads last (k not a power of two too)."""
    rng = fresh_rng()
    for T, k in ((3, 37), (2, 64), (1, 1), (1, 300)):  # 300: more pairs than threads
        sel = np.stack([rng.permutation(1000)[:k] for _ in range(T)]).astype(np.int32)
        sel[rng.random((T, k)) < 0.3] = -1
        d = cuda.to_device(sel)
        sk.sort_selected(d)
        sk.sort_selected_ref(sel)
        got = d.copy_to_host()
        assert np.array_equal(got, sel)
        for row in got:
            valid = row[row >= 0]
            assert np.all(np.diff(valid) > 0) and np.all(row[len(valid):] == -1)


def test_global_set_replaces_the_native_choice_after_the_prompt():
    meta = np.zeros(sk.META_RATIOS + 1, np.int32)
    meta[sk.META_PROMPT] = 9
    flag = cuda.to_device(np.zeros(1, np.int32))
    native, glob = np.arange(6, dtype=np.int32), np.array([7, 3, -1, 8, 1, 0], np.int32)
    for pos, want in ((8, 0), (9, 1), (12, 1)):  # the prompt's last token, then decode steps
        meta[sk.META_POS] = pos
        sk.flag_after_prompt(flag, cuda.to_device(meta))
        ref = np.zeros(1, np.int32)
        sk.flag_after_prompt_ref(ref, meta)
        assert flag.copy_to_host()[0] == ref[0] == want
        d = cuda.to_device(native)
        sk.copy_if_flag(d, cuda.to_device(glob), flag)
        r = native.copy()
        sk.copy_if_flag_ref(r, glob, ref)
        assert np.array_equal(d.copy_to_host(), r)
        assert np.array_equal(r, glob if want else native)


def test_remap_rows_turns_chunk_ids_into_staging_slots():
    rng = fresh_rng()
    n, k = 50, 16
    lut = np.full(n, -1, np.int32)
    staged = rng.choice(n, 20, replace=False)
    lut[staged] = rng.permutation(32)[:20]
    sel = np.concatenate([rng.choice(staged, 10, replace=False),
                          [-1, -1, n + 3], rng.choice(n, 3)]).astype(np.int32)
    out = cuda.to_device(np.full(k, 99, np.int32))
    sk.remap_rows(out, cuda.to_device(sel), cuda.to_device(lut))
    got = out.copy_to_host()
    ok = (sel >= 0) & (sel < n)
    assert np.array_equal(got[ok], lut[sel[ok]]) and (got[~ok] == -1).all()
    ref = np.full(k, 99, np.int32)
    sk.remap_rows_ref(ref, sel, lut)
    assert np.array_equal(ref, got)


def test_scores_by_chunk_puts_slot_scores_back_in_chunk_order():
    rng = fresh_rng()
    n_cap, S, n = 40, 12, 33
    lut = np.full(n_cap, -1, np.int32)
    staged = rng.choice(n, 10, replace=False)
    lut[staged] = rng.permutation(S)[:10]
    slot_scores = rng.normal(size=S).astype(np.float32)
    want = np.full(n_cap, 5.0, np.float32)
    sk.scores_by_chunk_ref(want, slot_scores, lut, np.array([n], np.int32))
    d = cuda.to_device(np.full(n_cap, 5.0, np.float32))
    sk.scores_by_chunk(d, cuda.to_device(slot_scores), cuda.to_device(lut),
                       cuda.to_device(np.array([n], np.int32)))
    got = d.copy_to_host()
    assert np.array_equal(got, want)
    assert np.array_equal(got[staged], slot_scores[lut[staged]])
    assert np.isneginf(np.delete(got[:n], staged)).all() and (got[n:] == 5.0).all()
