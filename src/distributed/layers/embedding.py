"""Parallel embeddings (the weight is ``(num_embeddings, embedding_dim)``).

The vocabulary is split one way for every embedding class: the module keeps
its class's own forward (Gemma's scaled embedding, for instance) and gains
:class:`VocabSplit`'s forward around it, which maps ids to local rows, zeroes
the rows this rank does not own and sums the partial lookups. For a plain
``nn.Embedding`` that class is :class:`VocabParallelEmbedding`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.devices import default_device
from ..comm.group_ref import WeakGroup
from ..comm.ops import _compiling
from ..comm.regions import (
    gather_from_tensor_parallel_region,
    rank_local_error,
    reduce_from_tensor_parallel_region,
)
from ..comm.runtime import ProcessGroup
from ..core.layouts import split_layout
from ._base import check_splittable, require_group, resolve_placement
from .owned import ShardedModule


def check_ids(who: str, ids: torch.Tensor, num_embeddings: int, world_size: int,
              group: ProcessGroup | None) -> None:
    """Raise IndexError, like ``nn.Embedding``, for ids outside ``[0, num_embeddings)``.

    A vocab-split lookup would otherwise turn them into zero vectors on every
    rank. Costs one min/max over the ids; skipped inside ``torch.compile``
    (data-dependent), where an out-of-range id is not caught.
    """
    if _compiling() or ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo >= 0 and hi < num_embeddings:
        return
    bad = lo if lo < 0 else hi
    raise rank_local_error(group, IndexError(
        f"{who}: token id {bad} is out of range for num_embeddings={num_embeddings} (valid ids "
        f"are 0..{num_embeddings - 1}; this batch has ids {lo}..{hi}; vocabulary split over "
        f"world_size={world_size}); nn.Embedding raises IndexError too: check the tokenizer's "
        "vocabulary size against the model's"))


class VocabSplit(ShardedModule):
    """Mixin for an ``nn.Embedding`` (sub)class whose weight *rows* (the vocabulary) are split.

    Rank ``r`` holds rows ``[vocab_start, vocab_end)``, its balanced share of
    the vocabulary (shares differ by at most one row). Each rank looks up the
    ids it owns with the embedding class's own forward, writes zeros for the
    others, and one all-reduce sums the partial lookups.
    forward: ``(...)`` ids -> ``(..., dim)`` replicated; backward: identity
    (each rank's rows get exactly their tokens' gradient). Exact when the
    class's forward acts on each looked-up row alone (checked by the
    ``embedding_rowwise`` style, see :mod:`torchtp.plans.fidelity`).
    """

    weight: torch.Tensor
    padding_idx: int | None
    num_embeddings: int
    embedding_dim: int
    vocab_start: int
    vocab_end: int
    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # held weakly (comm.group_ref)
    world_size: int
    rank: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ``ids`` (any shape) -> ``(*ids.shape, embedding_dim)`` on every rank.

        Raises:
            IndexError: an id is outside ``[0, num_embeddings)`` (on every rank).
        """
        check_ids(type(self).__name__, ids, self.num_embeddings, self.world_size,
                  self.group)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = super().forward(local_ids)  # type: ignore[misc]  # (..., dim) partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.world_size == 1:
            return out
        group = require_group(type(self).__name__, self.group, self.world_size)
        return reduce_from_tensor_parallel_region(out, group, inplace=True)

    def _split_vocab(self, world_size: int | None, rank: int | None,
                     group: ProcessGroup | None) -> None:
        who = f"{type(self).__name__}(num_embeddings={self.num_embeddings})"
        self.group, self.world_size, self.rank = resolve_placement(who, world_size, rank, group)
        full = self.weight
        check_splittable(who, "num_embeddings", full.shape[0], self.world_size, "vocabulary row")
        layout = split_layout(tuple(full.shape), 0, self.world_size, self.rank)
        start, n = layout.segments[0]
        self.vocab_start, self.vocab_end = start, start + n
        pad = self.padding_idx
        self.padding_idx = pad - start if pad is not None and start <= pad < start + n else None
        self.weight = nn.Parameter(layout.take(full), requires_grad=full.requires_grad)
        self.tp_layouts = {"weight": layout}

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"split=weight rows (vocab ids {self.vocab_start}..{self.vocab_end - 1} on rank "
                f"{self.rank} of world_size={self.world_size})")


class VocabParallelEmbedding(VocabSplit, nn.Embedding):
    """An ``nn.Embedding`` whose weight *rows* (the vocabulary) are split across ranks.

    Built like ``nn.Embedding``: under the same seed every rank draws the full
    table and keeps its rows, so the shards match ``nn.Embedding`` at any world
    size. HF calls this ``embedding_rowwise``; Megatron ``VocabParallelEmbedding``.
    See :class:`VocabSplit` for the forward.

    Args:
        num_embeddings: Full vocabulary size (at least ``world_size``; need not divide).
        embedding_dim: Size of each vector (not split).
        padding_idx: The full model's padding id, or ``None``.
        world_size: Ranks to split over; ``None`` uses the process group's size.
        rank: This rank; ``None`` uses the process group's rank.
        dtype: Parameter dtype.
        device: Parameter device.
        group: Process group; ``None`` for the default TP group.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 world_size: int | None = None, rank: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 group: ProcessGroup | None = None) -> None:
        nn.Embedding.__init__(self, num_embeddings, embedding_dim, padding_idx,
                              dtype=dtype, device=default_device(device))
        self._split_vocab(world_size, rank, group)

    @staticmethod
    def from_embedding(emb: nn.Embedding, world_size: int | None = None, rank: int | None = None,
                       group: ProcessGroup | None = None) -> nn.Embedding:
        """Split ``emb``'s vocabulary in place, keeping its class's forward.

        ``emb`` becomes an instance of ``VocabParallelEmbedding`` (a plain
        ``nn.Embedding``) or of a subclass of its own class with
        :class:`VocabSplit` in front (``VocabParallel<Class>``), holding only
        this rank's rows; parameter names stay the same.

        Raises:
            ValueError: fewer vocabulary rows than ranks.
        """
        emb.__class__ = vocab_split_class(type(emb))
        split = emb
        assert isinstance(split, VocabSplit)
        split._split_vocab(world_size, rank, group)
        return emb


_CLASSES: dict[type, type] = {nn.Embedding: VocabParallelEmbedding}


def vocab_split_class(cls: type[nn.Embedding]) -> type[nn.Embedding]:
    """The class of a vocabulary-split ``cls``: :class:`VocabSplit`'s forward around ``cls``'s."""
    if issubclass(cls, VocabSplit):
        return cls
    if cls not in _CLASSES:
        # As torch.nn.utils.parametrize does: a subclass created once per class.
        _CLASSES[cls] = type(f"VocabParallel{cls.__name__}", (VocabSplit, cls), {})
    return _CLASSES[cls]


class FeatureParallelEmbedding(ShardedModule, nn.Embedding):
    """An ``nn.Embedding`` whose weight *columns* (``embedding_dim``) are split across ranks.

    Each rank holds its balanced share of the columns, looks up its slice of
    every vector, and one all-gather joins the slices (uneven shares are padded
    to the largest, still one collective). forward: ids ->
    ``(..., embedding_dim)`` replicated; backward: each rank keeps its slice of
    the gradient. HF calls this ``embedding_colwise``.

    Args:
        num_embeddings: Vocabulary size (not split).
        embedding_dim: Full vector size (at least ``world_size``; need not divide).
        padding_idx: Padding id, or ``None``.
        world_size: Ranks to split over; ``None`` uses the process group's size.
        rank: This rank; ``None`` uses the process group's rank.
        dtype: Parameter dtype.
        device: Parameter device.
        group: Process group; ``None`` for the default TP group.
    """

    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # held weakly (comm.group_ref)
    world_size: int
    rank: int

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 world_size: int | None = None, rank: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 group: ProcessGroup | None = None) -> None:
        nn.Embedding.__init__(self, num_embeddings, embedding_dim, padding_idx,
                              dtype=dtype, device=default_device(device))
        self._split_features(world_size, rank, group)

    @staticmethod
    def from_embedding(emb: nn.Embedding, world_size: int | None = None, rank: int | None = None,
                       group: ProcessGroup | None = None) -> FeatureParallelEmbedding:
        """A new layer holding this rank's columns of a plain ``nn.Embedding``'s weight."""
        layer = FeatureParallelEmbedding.__new__(FeatureParallelEmbedding)
        nn.Module.__init__(layer)
        for attr in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(layer, attr, getattr(emb, attr))
        layer.weight = emb.weight
        layer._split_features(world_size, rank, group)
        return layer

    def _split_features(self, world_size: int | None, rank: int | None,
                        group: ProcessGroup | None) -> None:
        who = f"FeatureParallelEmbedding(embedding_dim={self.embedding_dim})"
        self.group, self.world_size, self.rank = resolve_placement(who, world_size, rank, group)
        full = self.weight
        check_splittable(who, "embedding_dim", full.shape[1], self.world_size, "weight column")
        layout = split_layout(tuple(full.shape), 1, self.world_size, self.rank)
        self.weight = nn.Parameter(layout.take(full), requires_grad=full.requires_grad)
        self.tp_layouts = {"weight": layout}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ``ids`` -> ``(*ids.shape, embedding_dim)`` on every rank."""
        local = F.embedding(ids, self.weight, self.padding_idx)  # (..., dim/tp)
        if self.world_size == 1:
            return local
        group = require_group("FeatureParallelEmbedding", self.group, self.world_size)
        return gather_from_tensor_parallel_region(local, group, -1, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"split=weight columns ({self.weight.shape[1]} on rank {self.rank} of "
                f"world_size={self.world_size})")
