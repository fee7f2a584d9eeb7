"""Reading and writing safetensors files directly (no torch): numpy arrays in, out."""
from __future__ import annotations

import json
import mmap
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_header(path: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {len(head)} bytes: empty or cut short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        blob = f.read(n)
        if len(blob) < n:
            raise ValueError(f"{path}: the header needs {8 + n} bytes but the file has only {8 + len(blob)} "
                             f"bytes (the file is cut short)")
        try:
            header = json.loads(blob)
        except ValueError as e:
            raise ValueError(f"{path}: not a safetensors file (its header is not valid JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= set(info)):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r} (expected "
                             f"dtype, shape and data_offsets)")
    return header


def load(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy arrays backed by a read-only memory map."""
    header = read_header(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + n else None
    out = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if end - begin != count * np.dtype(dtype).itemsize:
            raise ValueError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape}")
        start = 8 + n + begin  # data follows the 8-byte length and the header
        if start + end - begin > size:  # a download or copy that stopped early
            raise ValueError(f"{path}: tensor {name!r} needs {end - begin} bytes at offset {start} but the "
                             f"file has only {size} bytes (the file is cut short)")
        arr = np.frombuffer(mm, dtype=dtype, count=count, offset=start) if count else np.zeros(0, dtype)
        out[name] = arr.reshape(shape)
    return out


def save(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes numpy arrays (float32/16, bfloat16, ints, bool) as one safetensors file."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r}: dtype {a.dtype} cannot be saved")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
