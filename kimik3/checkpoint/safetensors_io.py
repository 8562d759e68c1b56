"""A small safetensors reader/writer over numpy memmaps.

`get` maps the file and returns a view; `read(name, box)` reads only a box of a tensor (the rows
and columns a process's devices own) with one positioned read per contiguous run of it, so that a
process of a multi-process load reads its share of the file and no more; bf16 comes back as
ml_dtypes.bfloat16. Every structural problem (bad header, offsets
past the end of a truncated file, unknown dtype) raises CheckpointError naming the file and tensor.
"""
from __future__ import annotations

import itertools
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
        self._fd = None

    def data_bytes(self) -> int:
        """The bytes of all its tensors (the file less its header)."""
        return sum(e - b for b, e in (info["data_offsets"] for info in self.header.values()))

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

    def read(self, name, box=None) -> np.ndarray:
        """The tensor's `box` (a tuple of step-1 slices, one per dimension; None: all of it) as a
        new array, read from the file run by run: the box's C-order runs are contiguous in the
        file, one per index of the dimensions before the last one it cuts."""
        info, dtype = self.header[name], DTYPES[self.header[name]["dtype"]]
        shape = tuple(info["shape"])
        ranges = [(0, n) if box is None else box[d].indices(n)[:2] for d, n in enumerate(shape)]
        out = np.empty([max(0, b - a) for a, b in ranges], dtype)
        if out.size == 0:
            return out
        cut = max((d for d, (a, b) in enumerate(ranges) if (a, b) != (0, shape[d])), default=0)
        strides = [math.prod(shape[d + 1:]) * out.itemsize for d in range(len(shape))]
        run = (ranges[cut][1] - ranges[cut][0]) * strides[cut] if shape else out.itemsize
        base = self.data_start + info["data_offsets"][0] + (ranges[cut][0] * strides[cut] if shape else 0)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        for i, index in enumerate(itertools.product(*(range(a, b) for a, b in ranges[:cut]))):
            self.read_at(base + sum(j * st for j, st in zip(index, strides)), buf[i * run:(i + 1) * run])
        return out

    def read_at(self, offset: int, buf: memoryview) -> None:
        """Fill `buf` with the file's bytes from `offset` (every tensor byte `read` takes comes
        through here)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path}: ends at byte {offset + done} while reading a tensor "
                                      "(truncated while loading?)")
            done += n

    def close(self):
        self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):  # a load that stopped at an error closes its files too
        if getattr(self, "_fd", None) is not None:
            self.close()


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
