"""A small safetensors reader/writer over numpy memmaps.

Reading maps the file and returns views, so loading streams tensor by tensor without holding a
whole shard; bf16 comes back as ml_dtypes.bfloat16. Every structural problem (bad header, offsets
past the end of a truncated file, unknown dtype) raises CheckpointError naming the file and tensor.
"""
from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file and tensor."""


DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated or corrupt: header claims {n} bytes, file has {size}")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self.data_start = 8 + n
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if info["dtype"] not in DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            if self.data_start + end > size:
                raise CheckpointError(f"{path}: truncated: tensor {name} ends at byte {self.data_start + end} "
                                      f"but the file has {size} bytes (re-download this shard)")
            want = math.prod(info["shape"]) * np.dtype(DTYPES[info["dtype"]]).itemsize
            if end - begin != want:
                raise CheckpointError(f"{path}: tensor {name} spans {end - begin} bytes, its shape "
                                      f"{info['shape']} x {info['dtype']} needs {want}")
        self._mm = None

    def keys(self):
        return list(self.header)

    def shape(self, name):
        return tuple(self.header[name]["shape"])

    def dtype(self, name):
        return np.dtype(DTYPES[self.header[name]["dtype"]])

    def get(self, name) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, np.uint8, "r")
        info = self.header[name]
        begin, end = info["data_offsets"]
        raw = self._mm[self.data_start + begin:self.data_start + end]
        return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])

    def close(self):
        self._mm = None


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None):
    """Write numpy arrays (bf16 via ml_dtypes) as one safetensors file."""
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        b = arr.tobytes()
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
