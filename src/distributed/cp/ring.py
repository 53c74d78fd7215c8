"""Ring attention: key/value blocks passed around the cp ranks, merged by log-sum-exp.

Each rank keeps its own queries. The keys and values of one rank's tokens
(a *block*) travel around the ring of cp ranks: at step ``s`` rank ``r``
holds rank ``(r - s) % cp``'s block, attends to it with its queries and
merges the partial result into its running output by the log-sum-exp
(the online softmax), then passes the block on (:func:`~torchtp.comm.ops.ring_shift`).
After ``cp`` steps every query has seen every key, exactly as one softmax
over them all. A rank holds at most two blocks (the one it works on and the
one arriving), never the whole sequence's keys and values, which is what
ring attention is for at long context; it works for any head count, so
also when ``cp`` exceeds the KV heads.

The backward is written out (flash-attention style), so nothing of the
other ranks' blocks is saved: from the output ``O`` and the final
log-sum-exp ``L`` each block's probabilities are recomputed as
``P = exp(S - L)``, and ``dS = P * (dP - rowsum(dO * O))``. The blocks
travel the ring again, each carrying the gradient of its keys and values,
to which every rank adds its queries' share as it passes; one last shift
returns each block's gradient to its owner.

=====================  ====================================================
forward                ``cp - 1`` shifts of a stacked K/V block
backward               ``cp - 1`` shifts of the block and its gradient, 1 of
                       the gradient alone
=====================  ====================================================

Within a step only the pairs of query and key *runs* (consecutive sequence
indices, :func:`~torchtp.cp.layout.runs`) that the causal or window rule can
allow are computed, as :func:`~torchtp.cp.attention._by_runs` does. The
scores of one pair of runs are materialized (in at least float32, as
transformers' eager attention).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..comm import ops as _comm
from ..comm.group_ref import GroupRef
from ..comm.runtime import ProcessGroup, group_rank, group_size
from .layout import SequenceLayout, runs
from .masks import MaskRule, SequenceMeta, allowed


@dataclass(frozen=True)
class _Pair:
    """A run of this rank's queries against a run of a block's keys."""

    q: slice  # along this rank's local queries
    k: slice  # along the block's local keys
    q_pos: torch.Tensor  # (nq,) sequence indices
    k_pos: torch.Tensor  # (nk,)


def _pairs(q_idx: torch.Tensor, k_idx: torch.Tensor, rule: MaskRule) -> Iterator[_Pair]:
    """The pairs of runs of ``q_idx`` and ``k_idx`` whose rule can allow a query-key pair."""
    q_runs, k_runs = runs(q_idx), runs(k_idx)
    qa = 0
    for q_first, nq in q_runs:
        ka = 0
        for k_first, nk in k_runs:
            after = rule.causal and k_first > q_first + nq - 1  # every key after every query
            before = (rule.causal and rule.window is not None
                      and k_first + nk - 1 <= q_first - rule.window)  # all out of the window
            if not (after or before):
                yield _Pair(slice(qa, qa + nq), slice(ka, ka + nk),
                            torch.arange(q_first, q_first + nq, device=q_idx.device),
                            torch.arange(k_first, k_first + nk, device=q_idx.device))
            ka += nk
        qa += nq


def _scores(q: torch.Tensor, k: torch.Tensor, pair: _Pair, meta: SequenceMeta,
            rule: MaskRule, scale: float) -> torch.Tensor:
    """``(B, Hq, nq, nk)`` scaled scores of one pair, ``-inf`` where the mask forbids.

    ``q`` and ``k`` in the working dtype, so the forward and the backward's
    recomputation get the same scores to the last bit.
    """
    s = (q[:, :, pair.q] @ k[:, :, pair.k].transpose(-1, -2)) * scale
    return s.masked_fill(~allowed(meta, rule, pair.q_pos, pair.k_pos), float("-inf"))


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    """KV heads repeated to the query heads (GQA): ``(B, Hkv, T, D) -> (B, Hkv*rep, T, D)``."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(x: torch.Tensor, rep: int) -> torch.Tensor:
    """The inverse of :func:`_repeat` for gradients: sum each KV head's query heads."""
    return x if rep == 1 else x.unflatten(1, (-1, rep)).sum(2)


def _without_empty(lse: torch.Tensor) -> torch.Tensor:
    # A query with no key has lse -inf; 0 in its place keeps exp(-inf - 0) = 0, never NaN.
    return lse.masked_fill(torch.isneginf(lse), 0)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
             meta: SequenceMeta, rule: MaskRule, group: ProcessGroup | None, scale: float,
             sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, Hq, T/cp, D)`` and log-sum-exp ``(B, Hq, T/cp)`` (sinks included)."""
    cp, rank = group_size(group), group_rank(group)
    work = torch.promote_types(q.dtype, torch.float32)
    rep = q.shape[1] // k.shape[1]
    q_idx = layout.indices(rank).to(q.device)
    qw = q.to(work)
    acc = torch.zeros(q.shape, dtype=work, device=q.device)  # (B, Hq, T/cp, D)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)  # (B, Hq, T/cp)
    kv = torch.stack([k, v])  # (2, B, Hkv, T/cp, D): one message per step
    for step in range(cp):
        source = (rank - step) % cp
        k_rep, v_rep = _repeat(kv[0].to(work), rep), _repeat(kv[1].to(work), rep)
        for pair in _pairs(q_idx, layout.indices(source).to(q.device), rule):
            s = _scores(qw, k_rep, pair, meta, rule, scale)  # (B, Hq, nq, nk)
            empty = torch.isneginf(s).all(-1)  # (B, Hq, nq): no key of this block allowed
            blk = torch.logsumexp(s.masked_fill(empty[..., None], 0), -1).masked_fill(
                empty, float("-inf"))  # (B, Hq, nq)
            out = torch.exp(s - _without_empty(blk)[..., None]) @ v_rep[:, :, pair.k]
            both = torch.logaddexp(lse[:, :, pair.q], blk)
            keep = _without_empty(both)[..., None]
            acc[:, :, pair.q] = (acc[:, :, pair.q] * torch.exp(lse[:, :, pair.q, None] - keep)
                                 + out * torch.exp(blk[..., None] - keep))
            lse[:, :, pair.q] = both
        if step < cp - 1:
            kv = _comm.ring_shift(kv, group)
    if sinks is not None:  # one more softmax column per head, with no value
        both = torch.logaddexp(lse, sinks.to(work).view(1, -1, 1))
        acc = acc * torch.exp(lse - both)[..., None]
        lse = both
    return acc.to(q.dtype), lse


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, sinks: torch.Tensor | None, d_out: torch.Tensor,
              d_lse: torch.Tensor | None, layout: SequenceLayout, meta: SequenceMeta,
              rule: MaskRule, group: ProcessGroup | None, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dQ, dK, dV and d(sinks) of :func:`_forward` (each rank's share of d(sinks))."""
    cp, rank = group_size(group), group_rank(group)
    work = lse.dtype
    rep = q.shape[1] // k.shape[1]
    q_idx = layout.indices(rank).to(q.device)
    d_out, qw = d_out.to(work), q.to(work)
    # dS = P * (dP - D): D = rowsum(dO * O), less dL where the log-sum-exp has a gradient.
    rows = (d_out * out.to(work)).sum(-1)  # (B, Hq, T/cp)
    if d_lse is not None:
        rows = rows - d_lse.to(work)
    base = _without_empty(lse)[..., None]  # (B, Hq, T/cp, 1)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    # The block and its gradient travel together (in the gradient's dtype).
    zeros = torch.zeros((2, *k.shape), dtype=work, device=k.device)
    carried = torch.cat([torch.stack([k, v]).to(work), zeros])  # (4, B, Hkv, T/cp, D)
    for step in range(cp):
        source = (rank - step) % cp
        k_rep, v_rep = _repeat(carried[0], rep), _repeat(carried[1], rep)
        dk, dv = torch.zeros_like(k_rep), torch.zeros_like(v_rep)  # (B, Hq, T/cp, D)
        for pair in _pairs(q_idx, layout.indices(source).to(q.device), rule):
            p = torch.exp(_scores(qw, k_rep, pair, meta, rule, scale) - base[:, :, pair.q])
            g = d_out[:, :, pair.q]  # (B, Hq, nq, D)
            dv[:, :, pair.k] += p.transpose(-1, -2) @ g
            ds = p * (g @ v_rep[:, :, pair.k].transpose(-1, -2) - rows[:, :, pair.q, None])
            dq[:, :, pair.q] += (ds @ k_rep[:, :, pair.k]) * scale
            dk[:, :, pair.k] += (ds.transpose(-1, -2) @ qw[:, :, pair.q]) * scale
        carried[2] += _fold(dk, rep)
        carried[3] += _fold(dv, rep)
        if step < cp - 1:
            carried = _comm.ring_shift(carried, group)
    # The last block held is the next rank's: one more shift brings each rank its own.
    grads = carried[2:] if cp == 1 else _comm.ring_shift(carried[2:].contiguous(), group)
    d_sinks = None
    if sinks is not None:  # the sink column's probability times -(D - dL), summed per head
        p_sink = torch.exp(sinks.to(work).view(1, -1, 1) - lse)
        d_sinks = -(p_sink * rows).sum(dim=(0, 2)).to(sinks.dtype)
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), d_sinks


class _RingAttention(torch.autograd.Function):
    """forward: ``cp - 1`` ring shifts of K/V; backward: ``cp`` shifts (see the module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None, layout: SequenceLayout, meta: SequenceMeta,
                rule: MaskRule, group: ProcessGroup | None,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _forward(q, k, v, layout, meta, rule, group, scale, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.layout, ctx.meta, ctx.rule, ctx.scale = (GroupRef(group), layout, meta,
                                                                rule, scale)
        return out, lse

    @staticmethod
    @once_differentiable  # its collectives are not differentiable: no double backward
    def backward(ctx, d_out: torch.Tensor,
                 d_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, d_sinks = _backward(q, k, v, out, lse, sinks, d_out, d_lse, ctx.layout,
                                        ctx.meta, ctx.rule, ctx.group(), ctx.scale)
        return dq, dk, dv, d_sinks, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
                   meta: SequenceMeta, rule: MaskRule, group: ProcessGroup | None, scale: float,
                   sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries over every rank's keys, the blocks passed around the ring.

    Args:
        q: ``(B, Hq, T/cp, D)`` this rank's queries, in :meth:`SequenceLayout.indices` order.
        k: ``(B, Hkv, T/cp, D)`` its keys; ``Hq`` a multiple of ``Hkv``.
        v: ``(B, Hkv, T/cp, D)`` its values.
        layout: Which tokens each rank holds.
        meta: The full batch's documents and padding.
        rule: Causal and sliding-window rules of this layer.
        group: The context-parallel group.
        scale: The factor on ``q k^T``.
        sinks: ``(Hq,)`` attention-sink logits (GPT-OSS), or ``None``.

    Returns:
        ``(B, Hq, T/cp, D)`` output (a query with no key gets 0) and its
        ``(B, Hq, T/cp)`` log-sum-exp, sinks included.
    """
    needs = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sinks))
    if not needs:
        return _forward(q, k, v, layout, meta, rule, group, scale, sinks)
    return _RingAttention.apply(q, k, v, sinks, layout, meta, rule, group, scale)
