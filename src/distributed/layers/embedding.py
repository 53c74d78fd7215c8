"""Parallel embeddings (the weight is ``(num_embeddings, embedding_dim)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._comm import _compiling
from ..regions import (
    gather_from_tensor_parallel_region,
    rank_local_error,
    reduce_from_tensor_parallel_region,
)
from ..runtime import ProcessGroup
from ._base import require_group


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


class VocabParallelEmbedding(nn.Module):
    """An embedding whose weight *rows* (the vocabulary) are split across ranks.

    Rank ``r`` holds rows ``[vocab_start, vocab_end)`` (sizes may differ by one).
    Each rank looks up the ids it owns, writes zeros for the others, and one
    all-reduce sums the partial lookups. forward: ``(...)`` ids -> ``(..., dim)``
    replicated; backward: each rank's rows get exactly their tokens' gradient.
    HF calls this ``embedding_rowwise``; Megatron ``VocabParallelEmbedding``.

    Args:
        weight: This rank's rows, ``(vocab_end - vocab_start, embedding_dim)``.
        num_embeddings: Full vocabulary size.
        vocab_start: First vocabulary id held here.
        padding_idx: The full model's padding id, or ``None``.
        world_size: Number of ranks the vocabulary is split over.
        group: The TP group (``None`` only when ``world_size`` is 1).
    """

    def __init__(self, weight: torch.Tensor, num_embeddings: int, vocab_start: int,
                 padding_idx: int | None, world_size: int, group: ProcessGroup | None,
                 requires_grad: bool = True) -> None:
        super().__init__()
        self.world_size = world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = weight.shape[1]
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.padding_idx = padding_idx
        self.group = group
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        self._local_padding_idx = local_pad

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ``ids`` (any shape) -> ``(*ids.shape, embedding_dim)`` on every rank.

        Raises:
            IndexError: an id is outside ``[0, num_embeddings)`` (on every rank).
        """
        check_ids("VocabParallelEmbedding", ids, self.num_embeddings, self.world_size,
                  self.group)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)  # (..., dim) partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.world_size == 1:
            return out
        group = require_group("VocabParallelEmbedding", self.group, self.world_size)
        return reduce_from_tensor_parallel_region(out, group, inplace=True)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"split=weight rows (vocab ids {self.vocab_start}..{self.vocab_end - 1} here)")


class FeatureParallelEmbedding(nn.Module):
    """An embedding whose weight *columns* (``embedding_dim``) are split across ranks.

    Each rank looks up its slice of every vector and one all-gather joins the
    slices. forward: ids -> ``(..., embedding_dim)`` replicated; backward: each
    rank keeps its slice of the gradient. HF calls this ``embedding_colwise``.

    Args:
        weight: This rank's columns, ``(num_embeddings, embedding_dim / tp)``.
        padding_idx: Padding id, or ``None``.
        world_size: Number of ranks the columns are split over.
        group: The TP group (``None`` only when ``world_size`` is 1).
    """

    def __init__(self, weight: torch.Tensor, padding_idx: int | None, world_size: int,
                 group: ProcessGroup | None, requires_grad: bool = True) -> None:
        super().__init__()
        self.world_size = world_size
        self.num_embeddings = weight.shape[0]
        self.padding_idx = padding_idx
        self.group = group
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ``ids`` -> ``(*ids.shape, embedding_dim)`` on every rank."""
        local = F.embedding(ids, self.weight, self.padding_idx)  # (..., dim/tp)
        if self.world_size == 1:
            return local
        group = require_group("FeatureParallelEmbedding", self.group, self.world_size)
        return gather_from_tensor_parallel_region(local, group, -1)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, split=weight columns "
                f"(embedding_dim {self.weight.shape[1]} per rank)")


def shard_vocab_in_place(emb: nn.Embedding, weight: torch.Tensor, vocab_start: int,
                         world_size: int, group: ProcessGroup | None) -> nn.Embedding:
    """Vocab-split an ``nn.Embedding`` *subclass* without replacing it.

    Used when the subclass adds work in its forward (Gemma scales the lookup):
    the module keeps its forward, a pre-hook maps ids to local rows, and a hook
    zeroes the rows this rank does not own and all-reduces the partial
    outputs. Exact when that extra work commutes with the split, which the
    style checks first (see :mod:`torchtp.plans.fidelity`).
    """
    vocab_end = vocab_start + weight.shape[0]
    pad = emb.padding_idx
    emb.padding_idx = pad - vocab_start if pad is not None and vocab_start <= pad < vocab_end \
        else None
    emb.weight = nn.Parameter(weight, requires_grad=emb.weight.requires_grad)
    emb.num_embeddings_local = weight.shape[0]  # type: ignore[assignment]
    outside_ids: list[torch.Tensor] = []

    def to_local_ids(_mod: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        check_ids(type(emb).__name__, ids, emb.num_embeddings, world_size, group)
        outside = (ids < vocab_start) | (ids >= vocab_end)
        outside_ids.append(outside)
        return ((ids - vocab_start).masked_fill(outside, 0), *args[1:])

    def sum_partials(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(outside_ids.pop().unsqueeze(-1), 0.0)  # (..., dim) partial
        if world_size == 1:
            return out
        return reduce_from_tensor_parallel_region(
            out, require_group(type(emb).__name__, group, world_size), inplace=True)

    emb.register_forward_pre_hook(to_local_ids)
    emb.register_forward_hook(sum_partials)
    return emb
