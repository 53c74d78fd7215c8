"""Checkpoint sources: an HF model directory or a torchtp sharded checkpoint.

Both answer the same questions (which tensors, their full shapes and dtypes)
and serve ``read(name, dim, segments)``: the concatenation of ``segments``
(``(start, length)`` ranges of the *full* tensor along ``dim``), in the
checkpoint's orientation, reading only those bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..core.layouts import ParamLayout, cut, held_shape, place
from .atomic import OLD_SUFFIX
from .fmt import METADATA_FILE, read_metadata
from .shard_identity import check_rank_file
from .st_reader import StFile

Segments = tuple[tuple[int, int], ...]


class Source:
    """Base: a named set of full tensors that can be read in ranges."""

    path: str
    kind: str

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, name: str, dim: int | None = None, segments: Segments = ()) -> torch.Tensor:
        """Full tensor ``name`` (``dim=None``) or its ``segments`` along ``dim``, concatenated."""
        raise NotImplementedError


def read_layout(source: Source, name: str, layout: ParamLayout) -> torch.Tensor:
    """This rank's part of tensor ``name`` as ``layout`` holds it (checkpoint orientation).

    A layout with a second cut (a range of experts) reads that range first, one
    contiguous run of the file, then cuts the segments from it in memory.
    """
    if layout.dim is not None and not layout.segments:  # holds none of it (an expert elsewhere)
        shape = held_shape(source.shape(name), layout.dim, (), layout.second)
        return torch.empty(shape, dtype=source.dtype(name))
    if layout.second is None:
        return source.read(name, layout.dim, layout.segments)
    dim2, start, length = layout.second
    block = source.read(name, dim2, ((start, length),))
    if layout.dim is None:
        return block
    return cut(block, layout.dim, layout.segments).clone(memory_format=torch.contiguous_format)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class HFSource(Source):
    """``config.json`` + ``model.safetensors`` or ``model.safetensors.index.json`` + files."""

    kind = "HF model directory"

    def __init__(self, path: str) -> None:
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            weight_map = _read_index(index)
            self.files = {f: StFile(os.path.join(path, f)) for f in sorted(set(weight_map.values()))}
            self.where = {}
            for name, fname in weight_map.items():
                if name not in self.files[fname].entries:
                    raise ValueError(f"{index} maps tensor '{name}' to {fname}, which does not "
                                     "contain it; the index does not match its files")
                self.where[name] = fname
        elif os.path.isfile(single):
            self.files = {"model.safetensors": StFile(single)}
            self.where = dict.fromkeys(self.files["model.safetensors"].entries, "model.safetensors")
        else:
            raise ValueError(f"{path} has neither model.safetensors nor "
                             "model.safetensors.index.json (nor torchtp's "
                             f"{METADATA_FILE}); save it with save_pretrained(safe_serialization=True)")

    def names(self) -> set[str]:
        return set(self.where)

    def _entry(self, name: str) -> tuple[StFile, tuple[int, ...], torch.dtype]:
        f = self.files[self.where[name]]
        e = f.entries[name]
        return f, e.shape, e.dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[2]

    def read(self, name: str, dim: int | None = None, segments: Segments = ()) -> torch.Tensor:
        f = self._entry(name)[0]
        if dim is None:
            return f.read(name)
        return _cat([f.read(name, {dim: seg}) for seg in segments], dim)


def _read_index(index: str) -> dict[str, str]:
    try:
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): "
                         f"{err}") from err
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


@dataclass(frozen=True)
class _Piece:
    start: int  # in full-tensor coordinates along the split dim
    length: int
    rank: int
    local_start: int  # in the rank file's tensor


class TorchTPSource(Source):
    """A torchtp sharded checkpoint: one safetensors file per rank plus metadata."""

    kind = "torchtp sharded checkpoint"

    def __init__(self, path: str) -> None:
        self.path = path
        self.meta = read_metadata(path)
        self.files = [StFile(os.path.join(path, f)) for f in self.meta["files"]]
        self.tensors: dict[str, dict] = self.meta["tensors"]
        for name, info in self.tensors.items():
            for shard in info["shards"]:
                self._check_shard(name, info, shard)
        # After the shapes: a file with the right shapes may still be another rank's or save's.
        for r, f in enumerate(self.files):
            check_rank_file(f.path, f.header, r, len(self.files), self.meta.get("model"))

    def _check_shard(self, name: str, info: dict, shard: dict) -> None:
        f = self.files[shard["rank"]]
        want = list(held_shape(info["shape"], info["dim"], shard["segments"],
                               shard.get("second")))
        got = f.entries.get(name)
        if got is None or list(got.shape) != want:
            raise ValueError(
                f"{f.path}: tensor '{name}' is {'missing' if got is None else list(got.shape)}, "
                f"but {METADATA_FILE} says rank {shard['rank']} holds {want}; the metadata and "
                "the rank files come from different saves")

    @property
    def tp_size(self) -> int:
        return int(self.meta["tp_size"])

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return self.files[self.tensors[name]["shards"][0]["rank"]].entries[name].dtype

    def read(self, name: str, dim: int | None = None, segments: Segments = ()) -> torch.Tensor:
        info = self.tensors[name]
        if any("second" in shard for shard in info["shards"]):
            full = self._assembled(name)
            return full if dim is None else cut(full, dim, segments).clone()
        if dim is None:
            segments, dim = ((0, info["shape"][0]),), 0
        return _cat([self._read_range(name, dim, s, n) for s, n in segments], dim)

    def _assembled(self, name: str) -> torch.Tensor:
        """The full tensor from blocks cut along two dimensions (experts x features):
        every rank file's block put in place."""
        info = self.tensors[name]
        full = torch.empty(info["shape"], dtype=self.dtype(name))
        covered = torch.zeros(info["shape"], dtype=torch.bool)
        for shard in info["shards"]:
            part = self.files[shard["rank"]].read(name, {})
            place(full, part, info["dim"], shard["segments"], shard.get("second"))
            place(covered, torch.ones(part.shape, dtype=torch.bool), info["dim"],
                  shard["segments"], shard.get("second"))
        if not bool(covered.all()):
            raise ValueError(f"{self.path}: the rank files hold only part of '{name}' "
                             f"({int(covered.sum())} of {covered.numel()} values); the "
                             "checkpoint is incomplete")
        return full

    def _read_range(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        info = self.tensors[name]
        sdim = info["dim"]
        first = info["shards"][0]["rank"]
        if sdim is None:
            return self.files[first].read(name, {dim: (start, length)})
        # Pieces of the saved split dim; when another dim is asked for, all of
        # the saved dim is assembled and each piece narrowed on the asked dim.
        want = (start, length) if dim == sdim else (0, info["shape"][sdim])
        extra = {} if dim == sdim else {dim: (start, length)}
        parts = [self.files[p.rank].read(name, {sdim: (p.local_start, p.length), **extra})
                 for p in self._cover(name, *want)]
        return _cat(parts, sdim)

    def _cover(self, name: str, start: int, length: int) -> list[_Piece]:
        """Pieces covering ``start..start+length`` once (replicated ranges read from one rank)."""
        pieces = []
        for shard in self.tensors[name]["shards"]:
            local = 0
            for s, n in shard["segments"]:
                lo, hi = max(s, start), min(s + n, start + length)
                if lo < hi:
                    pieces.append(_Piece(lo, hi - lo, shard["rank"], local + lo - s))
                local += n
        out, cur = [], start
        for p in sorted(pieces, key=lambda p: p.start):
            if p.start + p.length <= cur:
                continue
            if p.start > cur:
                break
            skip = cur - p.start
            out.append(_Piece(cur, p.length - skip, p.rank, p.local_start + skip))
            cur = p.start + p.length
        if cur < start + length:
            raise ValueError(f"{self.path}: no rank file holds rows {cur}..{start + length} of "
                             f"'{name}'; the checkpoint is incomplete")
        return out


def _survivor_hint(path: str) -> str:
    """Name the directory an interrupted save left behind, if there is one."""
    old = os.path.abspath(path) + OLD_SUFFIX
    if not os.path.isdir(old):
        return ""
    return (f"; a save was interrupted while replacing it: the previous complete checkpoint is "
            f"{old} (load it from there, or `mv {old} {os.path.abspath(path)}`; the next save to "
            "this path also puts it back first)")


def open_source(path: str | os.PathLike[str]) -> Source:
    """The checkpoint at ``path``: torchtp's format if its metadata file is there, else HF.

    Raises:
        ValueError: not a directory, or its files are missing, truncated or inconsistent.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path} is not a directory; pass an HF model directory "
                         "or a torchtp sharded checkpoint (saved with save_sharded)"
                         + _survivor_hint(path))
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return TorchTPSource(path)
    return HFSource(path)
