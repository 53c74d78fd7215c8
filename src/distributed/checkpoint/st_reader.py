"""Read byte ranges of tensors from one safetensors file.

The header is parsed and checked against the file size on open (a truncated
or corrupt file fails here, naming the file). A read copies the
requested ranges straight into the result with plain reads (strided slices
in bounded blocks), so resident memory holds the slice and nothing else:
pages touched through a memory mapping would stay counted in this process's
RSS (the file's bytes on top of the copy) for as long as it is mapped.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from .st_writer import NAMES

_INT_BY_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class StEntry:
    """Where one tensor lives in its file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class StFile:
    """One safetensors file, opened for sliced reads.

    Raises:
        ValueError: the file is missing, truncated, or its header is corrupt.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.header: dict[str, str] = {}  # the header's ``__metadata__`` (strings)
        self.entries = _parse(path, self.header)

    def read(self, name: str, ranges: dict[int, tuple[int, int]] | None = None) -> torch.Tensor:
        """Tensor ``name`` narrowed to ``ranges`` (``{dim: (start, length)}``), as a fresh copy."""
        entry = self.entries[name]
        ranges = ranges or {}
        for dim, (start, n) in ranges.items():
            if start < 0 or n < 0 or start + n > entry.shape[dim]:
                raise ValueError(f"{self.path}: tensor '{name}' of shape {entry.shape}: rows "
                                 f"{start}..{start + n} of dim {dim} are out of range")
        shape = tuple(ranges.get(d, (0, s))[1] for d, s in enumerate(entry.shape))
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=entry.dtype)
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        if len(ranges) <= 1:
            dim, (start, n) = next(iter(ranges.items()), (0, (0, entry.shape[0] if entry.shape else 1)))
            return self._read_rows(entry, dim, start, n, itemsize).view(entry.dtype).reshape(shape)
        raw = np.memmap(self.path, dtype=_INT_BY_SIZE[itemsize], mode="r", offset=entry.begin,
                        shape=entry.shape or (1,))
        try:
            index = tuple(slice(s, s + n) for s, n in
                          (ranges.get(d, (0, size)) for d, size in enumerate(entry.shape)))
            data = np.array(raw[index] if entry.shape else raw, copy=True, order="C")
        finally:
            del raw  # unmap now: only this slice stays resident
        return torch.from_numpy(data).view(entry.dtype).reshape(shape)


    def _read_rows(self, entry: StEntry, dim: int, start: int, n: int, itemsize: int) -> torch.Tensor:
        """Rows ``start..start+n`` of ``dim`` with plain reads into the result (no mapping).

        The tensor is seen as ``(outer, size[dim], inner)``; blocks of whole
        outer rows of at most ``_BLOCK`` bytes are read and their slice copied.
        """
        outer = math.prod(entry.shape[:dim])
        mid = entry.shape[dim] if entry.shape else 1
        inner = math.prod(entry.shape[dim + 1:]) * itemsize  # bytes per index along dim
        out = torch.empty(outer * n * inner, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            if outer == 1:
                f.seek(entry.begin + start * inner)
                _read_exact(f, out, self.path)
                return out
            rows = max(1, _BLOCK // (mid * inner))
            view = out.view(outer, n * inner)
            # One block buffer for the whole tensor: fresh 16 MB buffers per block
            # would be kept resident by the allocator and count in peak RSS.
            buffer = torch.empty(min(rows, outer) * mid * inner, dtype=torch.uint8)
            for first in range(0, outer, rows):
                count = min(rows, outer - first)
                block = buffer[: count * mid * inner]
                f.seek(entry.begin + first * mid * inner)
                _read_exact(f, block, self.path)
                view[first:first + count] = block.view(count, mid * inner)[
                    :, start * inner:(start + n) * inner]
        return out


_BLOCK = 16 * 2**20  # bytes read at once for a strided (non-leading-dim) slice


def _read_exact(f: io.BufferedReader, out: torch.Tensor, path: str) -> None:
    # numpy's stubs declare the buffer protocol only for Python >= 3.12.
    got = f.readinto(memoryview(out.numpy()))  # type: ignore[arg-type]
    if got != out.numel():
        raise ValueError(f"safetensors file {path} is truncated: read {got} of {out.numel()} "
                         "bytes; re-download or re-save it")


def _parse(path: str, metadata: dict[str, str]) -> dict[str, StEntry]:
    """The file's tensors; its ``__metadata__`` string entries go into ``metadata``."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except FileNotFoundError as err:
        raise ValueError(f"safetensors file {path} does not exist") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"safetensors file {path} is corrupt or truncated: {err}; re-download "
                         "or re-save it") from err
    base = 8 + n
    entries: dict[str, StEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            if isinstance(info, dict):
                metadata.update({str(k): str(v) for k, v in info.items()})
            continue
        try:
            dtype = NAMES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"safetensors file {path}: bad header entry for '{name}': {err}") from err
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected or base + end > size:
            raise ValueError(
                f"safetensors file {path} is truncated or corrupt: tensor '{name}' {list(shape)} "
                f"needs bytes {base + begin}..{base + end} but the file has {size} bytes; "
                "re-download or re-save it")
        entries[name] = StEntry(dtype, shape, base + begin, base + end)
    return entries
