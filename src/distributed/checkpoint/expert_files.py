"""Hub MoE checkpoints that keep every expert as its own tensors, read as 3-D parameters.

transformers (>= 5) holds a layer's experts in 3-D parameters
(``mlp.experts.gate_up_proj`` ``(E, 2I, H)``) but Mixtral, Qwen-MoE, OLMoE and
DeepSeek checkpoints on the Hub store ``experts.{e}.w1.weight`` ``(I, H)``...
per expert, sometimes under another module name (Mixtral's
``block_sparse_moe``). transformers declares how to merge them
(:func:`torchtp.hf.compat.expert_checkpoint_conversions`); :class:`MergedSource`
serves the merged names through the same ``read(name, dim, segments)`` as any
source, reading from the files only the experts and the rows or columns that
this rank's layout asks for, so ``from_pretrained`` never builds a full
expert tensor on a rank that holds a share of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .sources import HFSource, Segments, Source


@dataclass
class _Merge:
    """One 3-D parameter: ``parts[i][e]`` is source pattern ``i``'s tensor of expert ``e``.

    ``concat``: the per-expert dim along which the parts are concatenated
    (``None``: one part).
    """

    parts: list[list[str]]
    concat: int | None


class MergedSource(Source):
    """``inner`` with transformers' renamings applied and per-expert tensors merged."""

    def __init__(self, inner: Source, aliases: dict[str, str], merges: dict[str, _Merge]) -> None:
        self.inner, self.aliases, self.merges = inner, aliases, merges
        self.path, self.kind = inner.path, inner.kind

    def names(self) -> set[str]:
        return set(self.aliases) | set(self.merges)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.merges:
            return self.inner.shape(self.aliases[name])
        m = self.merges[name]
        one = list(self.inner.shape(m.parts[0][0]))
        if m.concat is not None:
            one[m.concat] = sum(self.inner.shape(p[0])[m.concat] for p in m.parts)
        return (len(m.parts[0]), *one)

    def dtype(self, name: str) -> torch.dtype:
        key = self.merges[name].parts[0][0] if name in self.merges else self.aliases[name]
        return self.inner.dtype(key)

    def read(self, name: str, dim: int | None = None, segments: Segments = ()) -> torch.Tensor:
        if name not in self.merges:
            return self.inner.read(self.aliases[name], dim, segments)
        m = self.merges[name]
        if dim is None or dim == 0:  # whole experts: those in the segments, or all
            chosen = [e for s, n in segments for e in range(s, s + n)] if dim == 0 \
                else range(len(m.parts[0]))
            return torch.stack([self._expert(m, e, None, ()) for e in chosen])  # (e, ...)
        return torch.stack([self._expert(m, e, dim - 1, segments)
                            for e in range(len(m.parts[0]))])

    def _expert(self, m: _Merge, e: int, dim: int | None, segments: Segments) -> torch.Tensor:
        """Expert ``e``'s tensor (or its ``segments`` along per-expert ``dim``)."""
        keys = [part[e] for part in m.parts]
        if m.concat is None:
            return self.inner.read(keys[0], dim, segments)
        if dim != m.concat:  # every part cut alike, then concatenated: (2I', H')
            return torch.cat([self.inner.read(k, dim, segments) for k in keys], m.concat)
        pieces = []  # segments of the concatenation [gate; up]: read from the part holding each
        sizes = [self.inner.shape(k)[dim] for k in keys]
        for start, length in segments:
            offset = 0
            for key, size in zip(keys, sizes, strict=True):
                lo, hi = max(start, offset), min(start + length, offset + size)
                if lo < hi:
                    pieces.append(self.inner.read(key, dim, ((lo - offset, hi - lo),)))
                offset += size
        return torch.cat(pieces, dim)


def merged_experts(source: Source, model: nn.Module) -> Source:
    """``source`` as ``model`` names its tensors, when it is an HF directory that needs it.

    Raises:
        ValueError: per-expert tensors that do not make whole 3-D parameters
            (an expert missing, or shapes that differ), naming the parameter.
    """
    if not isinstance(source, HFSource):
        return source
    from ..hf import compat  # here: wrapping a plain model imports nothing of torchtp.hf

    renames, merges, _ = compat.expert_checkpoint_conversions(model)
    # A pattern's "*" is the expert index; it ends the key (not "...weight_scale_inv").
    patterns = [(tuple(re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in sources),
                 target, concat) for sources, target, concat in merges]
    parts_of = {target: len(sources) for sources, target, _ in merges}
    aliases: dict[str, str] = {}
    found: dict[str, tuple[int | None, dict[int, dict[int, str]]]] = {}
    for key in sorted(source.names()):
        name = _renamed(key, renames)
        hit = _merge_target(name, patterns)
        if hit is None:
            aliases[name] = key
            continue
        target, concat, part, expert = hit
        found.setdefault(target, (concat, {}))[1].setdefault(part, {})[expert] = key
    if not found and all(a == k for a, k in aliases.items()):
        return source
    return MergedSource(source, aliases, {
        t: _whole(t, c, parts, source, parts_of[_target_of(t, parts_of)])
        for t, (c, parts) in found.items()})


def _target_of(merged: str, parts_of: dict[str, int]) -> str:
    """Which merge rule's target ``merged`` (a full parameter name) ends with."""
    return next(t for t in parts_of if merged.endswith(t))


def _renamed(key: str, renames: list[tuple[tuple[str, ...], str]]) -> str:
    for sources, target in renames:
        for pattern in sources:
            if re.search(pattern, key):
                key = re.sub(pattern, target, key)
                break
    return key


def _merge_target(name: str, patterns: list[tuple[tuple[re.Pattern[str], ...], str, int | None]]
                  ) -> tuple[str, int | None, int, int] | None:
    """``(merged name, concat dim, part index, expert)`` of a per-expert tensor, or ``None``."""
    for regexes, target, concat in patterns:
        for part, regex in enumerate(regexes):
            m = regex.search(name)
            if m is not None:
                merged = name[:m.start()] + target + name[m.end():]
                return merged, (None if concat is None else concat - 1), part, int(m.group(1))
    return None


def _whole(target: str, concat: int | None, parts: dict[int, dict[int, str]],
           source: Source, count: int) -> _Merge:
    """Check that each of the ``count`` parts has experts ``0..E-1`` of one shape; the merge."""
    experts = [sorted(parts.get(i, {})) for i in range(count)]
    want = list(range(len(experts[0]))) if experts and experts[0] else []
    shapes = {source.shape(k) for p in parts.values() for k in p.values()}
    if any(e != want for e in experts) or not want or len(shapes) != 1:
        raise ValueError(f"{source.kind} {source.path}: the per-expert tensors of '{target}' do "
                         f"not make one 3-D parameter (experts per part: "
                         f"{[len(e) for e in experts]}, shapes {sorted(shapes)}); the checkpoint "
                         "is incomplete or mixes models")
    return _Merge([[parts[i][e] for e in want] for i in range(count)], concat)
