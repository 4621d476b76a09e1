"""KV swap gather/store kernel against its NumPy reference, and the host-side swap validator."""
import numpy as np
import pytest
from numba import cuda

from .kernel_testing import THREADS, fresh_rng
from pocketfm.kernels import kvgather as kg


def host_pool(a):
    """A copy of ``a`` in a ``cuda.mapped_array`` (a FakeCUDAArray in the simulator), else in
    device memory when mapped arrays are not available."""
    try:
        m = cuda.mapped_array(a.shape, a.dtype)
    except Exception:
        return cuda.to_device(a)
    if isinstance(m, np.ndarray):  # a real MappedNDArray is a host numpy array too
        m[...] = a
    else:
        m.copy_to_device(a)
    return m


def to_host(a):
    """The contents of a device or mapped array, after the GPU is done writing it."""
    cuda.synchronize()
    if isinstance(a, np.ndarray):  # a real MappedNDArray: the host memory itself
        return np.array(a)
    return a.copy_to_host()


def random_rows(rng, M, Nd, Ns, pad=0.2):
    """Distinct destination rows (a scatter must not write one row twice), any source rows,
    about ``pad`` of the pairs padded with -1 on one side or the other."""
    dst = rng.permutation(Nd)[:M].astype(np.int32)
    src = rng.integers(0, Ns, M).astype(np.int32)
    dst[rng.random(M) < pad / 2] = -1
    src[rng.random(M) < pad / 2] = -1
    return dst, src


@pytest.mark.parametrize("L,W,M", [(1, 146, 9), (3, 17, 12), (3, 146, 5), (1, 17, 0)])
def test_copy_rows_matches_reference(L, W, M):
    rng = fresh_rng()
    Nd, Ns = 13, 20
    dst = rng.integers(0, 2 ** 32, (L, Nd, W), dtype=np.uint32)
    src = rng.integers(0, 2 ** 32, (L, Ns, W), dtype=np.uint32)
    dr, sr = random_rows(rng, M, Nd, Ns)
    d_dst = cuda.to_device(dst)
    kg.copy_rows(d_dst, cuda.to_device(dr), host_pool(src), cuda.to_device(sr), threads=THREADS)
    ref = dst.copy()
    kg.copy_rows_ref(ref, dr, src, sr)
    assert np.array_equal(d_dst.copy_to_host(), ref)
    keep = (dr >= 0) & (sr >= 0)
    assert np.array_equal(ref[:, dr[keep]], src[:, sr[keep]])
    untouched = np.setdiff1d(np.arange(Nd), dr[keep])
    assert np.array_equal(ref[:, untouched], dst[:, untouched])


@pytest.mark.parametrize("L,B", [(1, 584), (3, 68)])
def test_swap_in_and_store_with_uint8_entries(L, B):
    """Both directions on byte arrays: swap-in from the mapped pool to staging slots, then
    a store of changed staging rows back into other pool chunks."""
    rng = fresh_rng()
    N, S, M = 24, 10, 7
    pool = rng.integers(0, 256, (L, N, B), dtype=np.uint8)
    staging = rng.integers(0, 256, (L, S, B), dtype=np.uint8)
    chunks = rng.permutation(N)[:M].astype(np.int32)
    slots = rng.permutation(S)[:M].astype(np.int32)
    slots[2] = -1  # a padded pair
    d_pool, d_staging = host_pool(pool), cuda.to_device(staging)
    d_chunks, d_slots = cuda.to_device(chunks), cuda.to_device(slots)

    kg.gather_to_slots(d_staging, d_pool, d_chunks, d_slots)
    kg.copy_rows_ref(staging, slots, pool, chunks)
    got = d_staging.copy_to_host()
    assert np.array_equal(got, staging)
    assert kg.validate_staged(got, pool, chunks, slots) == L * (M - 1)

    staging = rng.integers(0, 256, (L, S, B), dtype=np.uint8)  # new contents, new chunks
    d_staging.copy_to_device(staging)
    chunks = rng.permutation(N)[:M].astype(np.int32)
    d_chunks.copy_to_device(chunks)
    kg.store_to_pool(d_pool, d_staging, d_chunks, d_slots)
    kg.copy_rows_ref(pool, chunks, staging, slots)
    assert np.array_equal(to_host(d_pool), pool)
    assert kg.validate_staged(staging, pool, chunks, slots) == L * (M - 1)


def test_copy_rows_refuses_bad_shapes():
    d = cuda.to_device(np.zeros((2, 4, 8), np.uint8))
    rows = cuda.to_device(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"\(2, 4, 6\).*multiple of 4"):
        kg.copy_rows(d, rows, cuda.to_device(np.zeros((2, 4, 6), np.uint8)), rows)
    with pytest.raises(ValueError, match="same layers"):
        kg.copy_rows(d, rows, cuda.to_device(np.zeros((3, 4, 8), np.uint8)), rows)
    with pytest.raises(ValueError, match="same layers"):
        kg.copy_rows(d, rows, cuda.to_device(np.zeros((2, 4, 3), np.uint32)), rows)
    with pytest.raises(ValueError, match="one length"):
        kg.copy_rows(d, rows, d, cuda.to_device(np.zeros(4, np.int32)))
    with pytest.raises(ValueError, match="int32"):
        kg.copy_rows(d, rows, d, cuda.to_device(np.zeros(3, np.int64)))


def test_validate_staged_names_the_first_difference():
    rng = fresh_rng()
    L, N, S, B, M = 3, 30, 12, 68, 8
    pool = rng.integers(0, 256, (L, N, B), dtype=np.uint8)
    chunks = rng.permutation(N)[:M].astype(np.int32)
    slots = rng.permutation(S)[:M].astype(np.int32)
    staged = rng.integers(0, 256, (L, S, B), dtype=np.uint8)
    kg.copy_rows_ref(staged, slots, pool, chunks)
    assert kg.validate_staged(staged, pool, chunks, slots) == L * M

    order = np.argsort(chunks)
    lo, hi = order[0], order[-1]  # the lowest and the highest chunk moved
    bad = staged.copy()
    bad[2, slots[lo], 40] ^= 1  # layer 2, lowest chunk
    bad[1, slots[hi], 7] ^= 0x80  # layer 1, highest chunk: the lower layer is reported first
    bad[1, slots[hi], 50] ^= 0x10  # a later byte of the same row
    with pytest.raises(RuntimeError, match=(
            rf"^KV swap validate: staged bytes differ from the host pool: layer=1 "
            rf"chunk={chunks[hi]} slot={slots[hi]} byte=7$")):
        kg.validate_staged(bad, pool, chunks, slots)
    bad[1, slots[hi], 7] ^= 0x80
    bad[1, slots[lo], 3] ^= 4  # now two bad rows in layer 1: the lower chunk is reported
    with pytest.raises(RuntimeError, match=(
            rf"layer=blk\.5 chunk={chunks[lo]} slot={slots[lo]} byte=3$")):
        kg.validate_staged(bad, pool, chunks, slots,
                           layer_names=["blk.2", "blk.5", "blk.9"])
    chunks_pad = chunks.copy()
    chunks_pad[hi] = -1  # padding is not compared
    bad[1, slots[lo], 3] ^= 4
    bad[2, slots[lo], 40] ^= 1
    assert kg.validate_staged(bad, pool, chunks_pad, slots) == L * (M - 1)


def test_bench_cases_construct_and_run():
    """bench_cases at tiny shapes: every case launches and its validate check passes."""
    cases = kg.bench_cases(0, L=2, B=68, N=40, S=12, Ms=(3, 8))
    assert [c.family for c in cases] == ["kvgather"] * 3
    for c in cases:
        c.launch()
        assert c.check() == 0.0
