"""A small safetensors reader/writer on NumPy, with bf16 (which NumPy has no dtype for).

File layout (huggingface/safetensors): u64 little-endian header size n, n bytes of JSON
``{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, then the tensor bytes, offsets relative to the end of the header.
The ``safetensors`` package's NumPy API reads F32/F16 files written here (tested) but cannot
hold bf16; the official FlashMemory checkpoint is F32, pocketfm also accepts BF16 and F16.

Every defect of a file is one InputError line naming the file (and tensor) and what was expected.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from ..errors import InputError
from ..quants import bf16_to_float32, float32_to_bf16

DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """{name: float32 array} and the ``__metadata__`` strings of a safetensors file.

    Tensors are memory-mapped; F16/BF16 are widened to float32 (the scorer runs in fp32).
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: not a safetensors file (shorter than its 8-byte "
                                 "header size)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise InputError(f"{path}: not a safetensors file (header size {n} bytes)")
            raw = f.read(n)
            f.seek(0, 2)
            size = f.tell()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) < n:
        raise InputError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
        assert isinstance(header, dict)
    except (UnicodeDecodeError, ValueError, AssertionError):
        raise InputError(f"{path}: safetensors header is not a JSON object") from None
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise InputError(f"{path}: __metadata__ is not a JSON object of strings")
    data = np.memmap(path, np.uint8, "r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        tensors[name] = _tensor(path, name, info, data)
    return tensors, {str(k): str(v) for k, v in meta.items()}


def _tensor(path, name, info, data) -> np.ndarray:
    try:
        dtype, shape, (b, e) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{path}: tensor {name}: header entry needs dtype, shape and "
                         "data_offsets") from None
    if dtype not in DTYPES:
        raise InputError(f"{path}: tensor {name}: unsupported dtype {dtype} (expected one of "
                         f"{', '.join(DTYPES)})")
    nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
    if not (0 <= b <= e <= len(data)) or e - b != nbytes:
        raise InputError(f"{path}: tensor {name}: data_offsets [{b}, {e}] do not hold "
                         f"{dtype}{shape} ({nbytes} bytes) inside the file's "
                         f"{len(data)} data bytes")
    x = data[b:e].view(DTYPES[dtype]).reshape(shape)
    if dtype == "BF16":
        return bf16_to_float32(x)
    return x.astype(np.float32) if dtype == "F16" else x


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str],
                      dtype: str = "F32") -> None:
    """Write float tensors as ``dtype`` (F32, F16 or BF16) in name order, atomically."""
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype}: expected one of {', '.join(DTYPES)}")
    header, blobs, offset = {"__metadata__": dict(metadata)}, [], 0
    for name in sorted(tensors):
        x = np.asarray(tensors[name], np.float32)
        b = (float32_to_bf16(x) if dtype == "BF16" else x.astype(DTYPES[dtype])).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)  # data starts 8-byte aligned, as the reference writer does
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(js)) + js)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise InputError(f"{path}: cannot write ({e.strerror})") from None
