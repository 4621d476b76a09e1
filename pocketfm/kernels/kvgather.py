"""KV swap: packed entries between the host cold pool and GPU staging slots, all layers at once.

Dimension letters: L layers (the CSA layers, 21 in V4-Flash), N pool rows (chunks), S staging
slots, M rows moved this cycle, W 32-bit words per entry, B bytes per entry (B = 4 W).

The host pool is a ``cuda.mapped_array`` (pinned and mapped into the device address space), so
a kernel reads and writes it directly over PCIe. Every move is the one formula::

    dst[l, dst_rows[m]] = src[l, src_rows[m]]     for l < L, m < M (a row index < 0 skips m)

- swap-in, ``gather_to_slots``: staging[l, slots[m]] = pool[l, chunks[m]];
- store,   ``store_to_pool``:   pool[l, chunks[m]]   = staging[l, slots[m]].

Why one kernel per direction per cycle: one numba copy costs ~165 µs of Python and driver
time, so 21 layers x 512 chunks as separate copies would take ~1.8 s; one gather kernel
reading the mapped pool moves 4096 chunks in ~0.18 ms (gpu_notes.md §8.2, §8.3).

Entries are moved as uint32 words: 584-byte KV entries and 68-byte indexer keys are both
multiples of 4 bytes, but not of 16 (584 = 36.5 x 16) or, for the keys, of 8, so wider vector
loads would be misaligned on every other row. Instead each thread keeps WORDS_PER_THREAD
independent loads in flight, which is what hides PCIe latency.

``validate_staged`` is the host-side check of a swap: the staged rows equal the pool's, byte
for byte, or it names the first layer / chunk / slot / byte that differs.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, uint32

from . import device
from .bench import BenchCase
from .device import cdiv

WORDS_PER_THREAD = 4  # loads in flight per thread before any store (latency over PCIe)
MAX_BLOCKS_PER_LAYER = 4096  # grid cap along x; the kernel grid-strides past it


# ---- NumPy references ---------------------------------------------------------------------------
def copy_rows_ref(dst, dst_rows, src, src_rows) -> None:
    """dst[l, dst_rows[m]] = src[l, src_rows[m]] for every layer l and m; m is skipped where
    either row index is < 0 (padding). dst [L, Nd, W], src [L, Ns, W] (any one dtype; the
    kernel's are uint32 words), rows int32 [M]. An index >= Nd or >= Ns raises IndexError."""
    dst_rows, src_rows = np.asarray(dst_rows), np.asarray(src_rows)
    keep = (dst_rows >= 0) & (src_rows >= 0)
    dst[:, dst_rows[keep]] = src[:, src_rows[keep]]


def validate_staged(staged_bytes, pool, chunks, slots, layer_names=None) -> int:
    """Check a swap on the host: staged_bytes[l, slots[m]] == pool[l, chunks[m]] byte for byte.

    staged_bytes [L, S, B] uint8 (a host copy of the staging), pool [L, N, B] uint8 (uint32 words
    are viewed as bytes), chunks / slots int [M] (m skipped where either is < 0). On a mismatch
    raises RuntimeError naming the first one: lowest layer, then lowest chunk, with its slot and
    the first differing byte offset; ``layer_names[l]`` names the layer when given. Returns the
    number of rows compared (L times the unpadded M)."""
    staged, pool = _as_bytes(np.asarray(staged_bytes)), _as_bytes(np.asarray(pool))
    if staged.ndim != 3 or pool.ndim != 3 or staged.shape[::2] != pool.shape[::2]:
        raise ValueError(f"validate_staged: staged {staged.shape} and pool {pool.shape} must be "
                         "[L, S, B] and [L, N, B] with the same L and B")
    chunks, slots = np.asarray(chunks).ravel(), np.asarray(slots).ravel()
    if chunks.shape != slots.shape:
        raise ValueError(f"validate_staged: chunks {chunks.shape} and slots {slots.shape} differ")
    keep = (chunks >= 0) & (slots >= 0)
    chunks, slots = chunks[keep], slots[keep]
    order = np.argsort(chunks, kind="stable")  # so the first bad row is the lowest chunk
    chunks, slots = chunks[order], slots[order]
    for l in range(staged.shape[0]):  # one layer at a time: [M, B] temporaries, not [L, M, B]
        diff = staged[l, slots] != pool[l, chunks]  # [M, B]
        bad = diff.any(axis=1)
        if bad.any():
            m = int(np.argmax(bad))
            layer = layer_names[l] if layer_names is not None else l
            raise RuntimeError(
                f"KV swap validate: staged bytes differ from the host pool: layer={layer} "
                f"chunk={int(chunks[m])} slot={int(slots[m])} byte={int(np.argmax(diff[m]))}")
    return staged.shape[0] * len(chunks)


def _as_bytes(a):
    return a if a.dtype == np.uint8 else np.ascontiguousarray(a).view(np.uint8)


# ---- kernel -------------------------------------------------------------------------------------
@device.kernel
def _copy_rows(dst, dst_rows, src, src_rows):
    """Grid (x, L): layer blockIdx.y; along x the layer's M rows x W words flattened, so
    consecutive threads copy consecutive words of a row (coalesced on both sides, and a row
    boundary just continues into the next row). Each block step covers a tile of
    WORDS_PER_THREAD * blockDim words: all of a thread's loads are issued before its stores.
    Row indices outside [0, N) are skipped like the -1 padding (no stray writes)."""
    l = cuda.blockIdx.y
    W = int32(dst.shape[2])
    n = int32(dst_rows.shape[0]) * W  # M * W < 2**31 (the launcher checks)
    nd, ns = dst.shape[1], src.shape[1]
    nt, t = int32(cuda.blockDim.x), int32(cuda.threadIdx.x)
    tile = nt * WORDS_PER_THREAD
    buf = cuda.local.array(WORDS_PER_THREAD, uint32)
    drow = cuda.local.array(WORDS_PER_THREAD, int32)  # destination row, -1: nothing to store
    word = cuda.local.array(WORDS_PER_THREAD, int32)
    for base in range(int32(cuda.blockIdx.x) * tile, n, int32(cuda.gridDim.x) * tile):
        for k in range(WORDS_PER_THREAD):
            i = base + k * nt + t
            drow[k] = -1
            if i < n:
                m = i // W
                d, s = dst_rows[m], src_rows[m]
                if d >= 0 and d < nd and s >= 0 and s < ns:
                    w = i - m * W
                    buf[k] = src[l, s, w]
                    drow[k], word[k] = d, w
        for k in range(WORDS_PER_THREAD):
            if drow[k] >= 0:
                dst[l, drow[k], word[k]] = buf[k]


# ---- launchers ----------------------------------------------------------------------------------
def mapped_device_view(pool, r: int | None = None):
    """A device array over a ``cuda.mapped_array`` (all of it, or its leading index r). Numba's
    MappedNDArray is a NumPy array to Python (its slices and dtype views lose the mapping), so
    device views are built on the mapping's pointer; kernels then read and write the host
    memory over PCIe. Device (and simulator) arrays come back as they are."""
    if device.SIMULATOR or not isinstance(pool, np.ndarray) or not hasattr(pool, "gpu_data"):
        return pool if r is None else pool[r]
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    if not pool.flags.c_contiguous:
        raise ValueError("mapped_device_view: the mapped array must be C-contiguous")
    if r is None:
        return DeviceNDArray(pool.shape, pool.strides, pool.dtype, gpu_data=pool.gpu_data)
    row = pool.strides[0]
    return DeviceNDArray(pool.shape[1:], pool.strides[1:], pool.dtype,
                         gpu_data=pool.gpu_data.view(r * row, (r + 1) * row))


def _words(a, what):
    """a [L, N, B] uint8 or [L, N, W] uint32 (device or mapped) as uint32 words [L, N, W]."""
    if len(a.shape) != 3:
        raise ValueError(f"copy_rows: {what} of shape {tuple(a.shape)}, want [L, N, W] words "
                         "or [L, N, bytes]")
    a = mapped_device_view(a)
    if a.dtype == np.uint32:
        return a
    if a.dtype != np.uint8:
        raise ValueError(f"copy_rows: {what} is {a.dtype}, want uint8 or uint32")
    if a.shape[2] % 4:
        raise ValueError(f"copy_rows: {what} of shape {tuple(a.shape)}: the last dim "
                         f"({a.shape[2]} bytes) must be a multiple of 4")
    return a.view(np.uint32)


def copy_rows(dst, dst_rows, src, src_rows, stream=0, threads=None) -> None:
    """Launcher: dst[l, dst_rows[m]] = src[l, src_rows[m]] in one launch (see copy_rows_ref).

    dst [L, Nd, W] / src [L, Ns, W] uint32, or [L, N, 4 W] uint8 (viewed as words); device
    arrays or ``cuda.mapped_array`` host arrays (read or written over PCIe); dst_rows and
    src_rows int32 [M] device arrays (-1: padding). M == 0 launches nothing."""
    dw, sw = _words(dst, "dst"), _words(src, "src")
    if dw.shape[0] != sw.shape[0] or dw.shape[2] != sw.shape[2]:
        raise ValueError(f"copy_rows: dst {tuple(dst.shape)} and src {tuple(src.shape)} must "
                         "have the same layers and entry size")
    if len(dst_rows.shape) != 1 or dst_rows.shape != src_rows.shape:
        raise ValueError(f"copy_rows: dst_rows {tuple(dst_rows.shape)} and src_rows "
                         f"{tuple(src_rows.shape)} must be 1-D of one length")
    if dst_rows.dtype != np.int32 or src_rows.dtype != np.int32:
        raise ValueError(f"copy_rows: rows are {dst_rows.dtype} / {src_rows.dtype}, want int32")
    L, _, W = dw.shape
    M = dst_rows.shape[0]
    if M == 0 or L == 0 or W == 0:
        return
    if M * W >= 2 ** 31:
        raise ValueError(f"copy_rows: {M} rows x {W} words overflow the kernel's int32 index")
    nt = threads or 256
    bx = min(cdiv(M * W, nt * WORDS_PER_THREAD), MAX_BLOCKS_PER_LAYER)
    _copy_rows[(bx, L), nt, stream](dw, dst_rows, sw, src_rows)


def gather_to_slots(staging, pool, chunks, slots, stream=0) -> None:
    """Swap-in: staging[l, slots[m]] = pool[l, chunks[m]] (pool: the mapped host pool
    [L, N, B], staging: device [L, S, B]; chunks, slots int32 [M])."""
    copy_rows(staging, slots, pool, chunks, stream)


def store_to_pool(pool, staging, chunks, slots, stream=0) -> None:
    """Store: pool[l, chunks[m]] = staging[l, slots[m]] (the reverse of gather_to_slots)."""
    copy_rows(pool, chunks, staging, slots, stream)


PTX_SIGNATURES = [
    (_copy_rows, "void(uint32[:, :, ::1], int32[::1], uint32[:, :, ::1], int32[::1])"),
]


# ---- benchmark ----------------------------------------------------------------------------------
def bench_cases(stream, L=21, B=584, N=262144, S=4096, Ms=(512, 4096)):
    """V4-Flash: 21 CSA layers of 584-byte entries, a mapped pool of N = 262144 chunks per layer
    (3.2 GB pinned), a device staging of S slots; swap-in of M = 512 and 4096 rows, and a store
    of the largest M. bytes counts each entry read once and written once (PCIe carries half);
    ``check`` runs validate_staged on the result (0.0, or it raises)."""
    rng = np.random.default_rng(0)
    pool = cuda.mapped_array((L, N, B), np.uint8, stream=stream)  # contents: whatever was there
    staging = device.device_empty((L, S, B), np.uint8, stream)
    cases = []
    for M in Ms:
        chunks = np.sort(rng.choice(N, M, replace=False)).astype(np.int32)
        slots = rng.permutation(S)[:M].astype(np.int32)
        dc, ds = device.to_device(chunks, stream), device.to_device(slots, stream)
        nbytes = 2 * L * M * B + 2 * M * 4

        def check(c=chunks, s=slots):
            cuda.synchronize()  # the launches ran on ``stream`` (may be 0)
            host = pool if isinstance(pool, np.ndarray) else pool.copy_to_host()  # simulator
            validate_staged(staging.copy_to_host(stream=stream), host, c, s)
            return 0.0

        cases.append(BenchCase("kvgather", f"gather_to_slots L={L} M={M} B={B} (mapped pool)",
                               lambda c=dc, s=ds: gather_to_slots(staging, pool, c, s, stream),
                               bytes=nbytes, check=check, extra=dict(pcie_bytes=L * M * B)))
        if M == max(Ms):
            cases.append(BenchCase("kvgather", f"store_to_pool L={L} M={M} B={B} (mapped pool)",
                                   lambda c=dc, s=ds: store_to_pool(pool, staging, c, s, stream),
                                   bytes=nbytes, check=check, extra=dict(pcie_bytes=L * M * B)))
    return cases
