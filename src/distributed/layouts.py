"""How a rank's local parameter maps onto the full (checkpoint) tensor.

A :class:`ParamLayout` is attached to every parameter of a sharded module
(``module.tp_layouts[name]``). Loading reads only ``segments`` of the
checkpoint tensor, saving writes them back, and resharding recomputes them
for another tp size. Segments cover packed projections (one range per fused
part) and replicated KV heads (several ranks hold the same range).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's placement on this rank.

    Attributes:
        full_shape: Shape of the full tensor as stored in the checkpoint.
        dim: Checkpoint dimension that is split, or ``None`` when replicated.
        segments: ``(start, length)`` ranges along ``dim`` that this rank holds,
            concatenated in order.
        transposed: The local tensor is the transpose of the checkpoint slice
            (GPT-2's Conv1D stores ``(in, out)``; torchtp keeps ``(out, in)``).
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    segments: tuple[tuple[int, int], ...] = ()
    transposed: bool = False

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's tensor (in torchtp's orientation)."""
        shape = list(self.full_shape)
        if self.dim is not None:
            shape[self.dim] = sum(n for _, n in self.segments)
        return tuple(reversed(shape)) if self.transposed else tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the full one (a fresh contiguous copy)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        if self.dim is None:
            local = full.detach()
        else:
            parts = [full.detach().narrow(self.dim, s, n) for s, n in self.segments]
            local = parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)
        if self.transposed:
            local = local.t()
        return local.clone(memory_format=torch.contiguous_format)


def replicated(shape: torch.Size | tuple[int, ...], transposed: bool = False) -> ParamLayout:
    """Layout of a parameter every rank holds whole."""
    full = tuple(reversed(shape)) if transposed else tuple(shape)
    return ParamLayout(full, transposed=transposed)


def even_chunks(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of ``parts`` equal chunks of ``size``."""
    n = size // parts
    return index * n, n


def uneven_chunks(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when sizes may differ by at most one."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)
