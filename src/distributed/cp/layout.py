"""Which tokens of a sequence each context-parallel rank holds.

A sequence of ``T`` tokens is cut into ``2 * cp`` equal chunks; rank ``r``
holds chunks ``r`` and ``2*cp - 1 - r`` (the head/tail or "zigzag" split of
Megatron and Llama 3). Under a causal mask a query attends to the keys before
it, so the first chunks do little work and the last ones much: pairing chunk
``r`` with its mirror gives every rank the same number of unmasked
query-key pairs. ``balanced=False`` keeps the plain contiguous split (rank
``r`` holds ``[r*T/cp, (r+1)*T/cp)``) for non-causal attention, where every
split is balanced.

Everything here is index arithmetic on one process: every rank computes the
same layout from the same length, so it needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import torch


@dataclass(frozen=True)
class SequenceLayout:
    """The tokens of a ``length``-token sequence held by each of ``cp`` ranks.

    Attributes:
        length: Tokens in the full sequence (a multiple of :attr:`multiple`).
        cp: Context-parallel ranks.
        balanced: ``True``: the head/tail split (equal causal work per rank);
            ``False``: contiguous chunks.
    """

    length: int
    cp: int
    balanced: bool = True

    def __post_init__(self) -> None:
        check_length(self.length, self.cp, self.balanced, "SequenceLayout")

    @property
    def multiple(self) -> int:
        """What ``length`` must divide by: ``2 * cp`` balanced, else ``cp``."""
        return 2 * self.cp if self.balanced else self.cp

    @property
    def local(self) -> int:
        """Tokens per rank: ``length / cp``."""
        return self.length // self.cp

    def indices(self, rank: int) -> torch.Tensor:
        """Positions in the full sequence of rank ``rank``'s tokens, in the order it holds them."""
        return self.order[rank * self.local:(rank + 1) * self.local]

    @cached_property
    def order(self) -> torch.Tensor:
        """Every rank's :meth:`indices`, rank after rank: the order of an all-gather. ``(T,)``"""
        if not self.balanced:
            return torch.arange(self.length)
        chunk = self.length // (2 * self.cp)
        pieces = [torch.arange(c * chunk, (c + 1) * chunk)
                  for r in range(self.cp) for c in (r, 2 * self.cp - 1 - r)]
        return torch.cat(pieces)

    @cached_property
    def inverse(self) -> torch.Tensor:
        """Where each full-sequence position sits in :attr:`order`. ``(T,)``"""
        inv = torch.empty_like(self.order)
        inv[self.order] = torch.arange(self.length)
        return inv


def check_length(length: int, cp: int, balanced: bool, who: str) -> None:
    """Raise unless a ``length``-token sequence splits over ``cp`` ranks.

    Raises:
        ValueError: naming the multiple it must be and the nearest valid lengths.
    """
    multiple = 2 * cp if balanced else cp
    if length % multiple:
        low, high = length - length % multiple, length + multiple - length % multiple
        raise ValueError(
            f"{who}: a sequence of {length} tokens does not split over cp={cp} ranks: the "
            f"{'head/tail (balanced)' if balanced else 'contiguous'} split needs a multiple of "
            f"{multiple}; nearest valid lengths: {[n for n in (low, high) if n]}; pad the batch "
            "(shard_batch pads for you) or use another cp size")


def causal_pairs(layout: SequenceLayout) -> list[int]:
    """Unmasked query-key pairs each rank computes under a causal mask (its work)."""
    return [int((layout.indices(r) + 1).sum()) for r in range(layout.cp)]


def runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """``(first index, length)`` of each run of consecutive sequence indices, in order.

    A rank's head/tail share is two runs; the order of an all-gather ``2 * cp - 1``
    (the middle chunks are adjacent).
    """
    cuts = ((indices[1:] != indices[:-1] + 1).nonzero().flatten() + 1).tolist()
    bounds = [0, *cuts, indices.numel()]
    return [(int(indices[a]), b - a) for a, b in pairwise(bounds)]
