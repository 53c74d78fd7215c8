"""Write safetensors files one tensor at a time.

The safetensors header lists every tensor's dtype, shape and byte offsets
before any data. Those are known up front (full shapes come from the layouts,
dtypes from the parameters), so the header is written first and each tensor's
bytes are appended as soon as it is produced: at most one full tensor is in
memory, whatever the file size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
NAMES: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to be written: name, full shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length plus the JSON header for ``specs`` written in this order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in DTYPES:
            raise ValueError(f"tensor '{spec.name}': dtype {spec.dtype} cannot be stored in "
                             f"safetensors; supported: {sorted(str(d) for d in DTYPES)}")
        header[spec.name] = {"dtype": DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``t`` (contiguous, on CPU)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # numpy's stubs declare the buffer protocol only for Python >= 3.12.
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def write_file(path: str, specs: Sequence[TensorSpec],
               produce: Callable[[TensorSpec], torch.Tensor],
               metadata: dict[str, str] | None = None) -> None:
    """Write ``specs`` to ``path``, asking ``produce`` for each tensor in turn.

    Raises:
        ValueError: a produced tensor's shape or dtype differs from its spec.
    """
    with open(path, "wb") as f:
        f.write(header_bytes(specs, metadata))
        for spec in specs:
            t = produce(spec)
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise ValueError(f"tensor '{spec.name}': produced {tuple(t.shape)} {t.dtype}, "
                                 f"expected {spec.shape} {spec.dtype}")
            f.write(tensor_bytes(t))
            del t


def plan_shards(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Group ``specs`` in order into files of at most ``max_bytes`` (one tensor may exceed it)."""
    files: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if files[-1] and size + spec.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files


def hf_file_names(count: int) -> list[str]:
    """HF's names: ``model.safetensors`` alone, else ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(directory: str, files: list[list[TensorSpec]], names: list[str]) -> None:
    """Write ``model.safetensors.index.json`` mapping each tensor to its file."""
    weight_map = {spec.name: fname for fname, group in zip(names, files, strict=True)
                  for spec in group}
    total = sum(spec.nbytes for group in files for spec in group)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def parse_size(size: int | str) -> int:
    """``5_000_000`` or ``"5GB"``/``"500MB"``/``"10KB"`` -> bytes.

    Raises:
        ValueError: ``size`` is neither an int nor a number with a known unit.
    """
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    try:
        for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9),
                           ("MB", 10**6), ("KB", 10**3), ("B", 1)):
            if text.endswith(unit):
                return int(float(text[: -len(unit)]) * mult)
        return int(text)
    except ValueError:
        raise ValueError(f"max_shard_size={size!r} is not a size; give bytes (an int) or a "
                         "number with a unit, e.g. '5GB', '500MB', '10KiB'") from None
