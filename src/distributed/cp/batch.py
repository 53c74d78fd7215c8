"""Cut a full batch into this rank's share of every sequence, and put outputs back.

Every context-parallel rank receives the same full batch (as with one
process) and keeps its ``T/cp`` tokens of each row. What a token needs from
the rest of the sequence is computed here, on every rank, before the cut:

* its **global position id** (``position_ids`` given, else ``0..T-1`` as
  transformers' forward uses), so rotary and learned position embeddings
  see the global positions;
* its **label shifted globally** (the label of token ``t`` is token
  ``t+1``'s), so no label is lost at a shard boundary; the loss then needs no
  shift (:mod:`torchtp.cp.loss`);
* the **documents** of packed rows (a new document wherever the position
  ids do not go up by one, as transformers detects packed sequences, and as
  it does only without an attention mask) and the **padding** of the
  attention mask (:class:`~torchtp.cp.masks.SequenceMeta`).

A length that does not split is padded at the right to the next multiple
(pad tokens: attention mask 0, label -100, a document of their own), so any
length runs; :func:`unshard_sequence` drops the padding again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..comm.regions import gather_from_tensor_parallel_region
from ..comm.runtime import ProcessGroup, group_rank, group_size
from .layout import SequenceLayout
from .masks import SequenceMeta

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LocalBatch:
    """This rank's share of a batch, and what every rank knows of the whole.

    Attributes:
        input_ids: ``(B, T/cp)`` this rank's tokens.
        position_ids: ``(B, T/cp)`` their global position ids.
        labels: ``(B, T/cp)`` their globally shifted labels, or ``None``.
        tokens: Labelled tokens in the whole batch (the loss's divisor), or 0.
        layout: Which tokens each rank holds.
        meta: Documents and padding of the full batch.
        length: The batch's length before padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    tokens: int
    layout: SequenceLayout
    meta: SequenceMeta
    length: int


def _pad(x: torch.Tensor, extra: int, value: int) -> torch.Tensor:
    return F.pad(x, (0, extra), value=value) if extra else x


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` document ids: a new document wherever a position id is not the last + 1."""
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).long()
    return starts.cumsum(dim=1)


def shard_batch(input_ids: torch.Tensor, group: ProcessGroup | None, *,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                balanced: bool = True, ignore_index: int = IGNORE_INDEX) -> LocalBatch:
    """This rank's share of a full ``(B, T)`` batch (no communication).

    Args:
        input_ids: ``(B, T)`` token ids, the same full batch on every cp rank.
        group: The context-parallel group.
        attention_mask: ``(B, T)`` 1 for tokens, 0 for padding; ``None``: all tokens.
        position_ids: ``(B, T)`` or ``(1, T)``; ``None``: ``0..T-1``. Without an
            attention mask, ids that restart mark packed documents (each attends
            only to itself); with one, transformers ignores packing, and so does this.
        labels: ``(B, T)`` unshifted labels as for the model (``ignore_index``:
            ignored), or ``None``.
        balanced: Head/tail split (equal causal work per rank), else contiguous.
        ignore_index: The label of tokens the loss skips (also given to padding).
    """
    cp, rank = group_size(group), group_rank(group)
    b, t = input_ids.shape
    dev = input_ids.device
    layout = SequenceLayout(t + (-t) % (2 * cp if balanced else cp), cp, balanced)
    extra = layout.length - t
    if position_ids is None:
        position_ids = torch.arange(t, device=dev)[None]
    position_ids = position_ids.expand(b, t)
    valid = torch.ones(b, t, dtype=torch.bool, device=dev) if attention_mask is None \
        else attention_mask.to(dev).bool()
    docs = documents(position_ids) if attention_mask is None \
        else torch.zeros_like(position_ids, dtype=torch.long)
    # Pad tokens repeat the row's last position id: any id would do (nothing sees them),
    # and this one stays inside a learned position table (GPT-2's n_positions).
    positions = torch.cat([position_ids, position_ids[:, -1:].expand(b, extra)], dim=1) \
        if extra else position_ids
    meta = SequenceMeta(documents=_pad(docs, extra, -1), keys_valid=_pad(valid, extra, 0).bool())
    mine = layout.indices(rank).to(dev)
    shifted, tokens = None, 0
    if labels is not None:
        # Token t's label is labels[t+1]: shifted over the full row, then cut.
        shifted = _pad(F.pad(labels[:, 1:], (0, 1), value=ignore_index), extra, ignore_index)
        tokens = int((shifted != ignore_index).sum())
        shifted = shifted[:, mine]
    return LocalBatch(input_ids=_pad(input_ids, extra, 0)[:, mine],
                      position_ids=positions[:, mine], labels=shifted, tokens=tokens,
                      layout=layout, meta=meta, length=t)


def shard_sequence(x: torch.Tensor, layout: SequenceLayout, rank: int,
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of a full tensor ``x`` (sequence along ``dim``, already padded).

    Raises:
        ValueError: ``x``'s length is not the layout's.
    """
    if x.shape[dim] != layout.length:
        raise ValueError(f"shard_sequence: a tensor of {x.shape[dim]} tokens along dim {dim}, but the "
                         f"layout is of {layout.length}; pad it to the layout's length first")
    return x.index_select(dim, layout.indices(rank).to(x.device))


def unshard_sequence(x: torch.Tensor, batch: LocalBatch, group: ProcessGroup | None,
            dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor from every rank's share, in sequence order, padding dropped.

    forward: all-gather along ``dim`` (equal shares); backward: each rank keeps
    the gradient of its own share. Exact round trip:
    ``unshard_sequence(shard_sequence(x))`` is ``x``.

    Args:
        x: This rank's share, e.g. ``(B, T/cp, V)`` logits.
        batch: The :class:`LocalBatch` the share came from.
        group: The context-parallel group.
        dim: The sequence dimension.
    """
    full = gather_from_tensor_parallel_region(x, group, dim)  # (B, T, ...) in layout order
    inverse = batch.layout.inverse.to(x.device)
    return full.index_select(dim, inverse).narrow(dim, 0, batch.length)
