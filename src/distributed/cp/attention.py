"""Exact attention over a sequence split across context-parallel ranks.

Each rank holds ``T/cp`` tokens' queries, keys and values
(:class:`~torchtp.cp.layout.SequenceLayout`). Two ways to let every query see
every key it may, both exact (the same softmax over the same keys as one
process):

* ``"allgather"`` (Llama 3's choice): keys and values of every rank's tokens
  are all-gathered (one collective, KV stacked; backward: one reduce-scatter
  of their gradients) and each rank attends with its own queries. Works for
  any head count, including ``cp`` greater than the KV heads; moves
  ``2 * Hkv * T * D`` per rank, so it suits GQA/MQA.
* ``"ulysses"`` (DeepSpeed-Ulysses): all-to-alls turn the sequence split into
  a head split (queries; keys and values stacked), each rank attends with
  ``H/cp`` heads over the whole sequence, and one more all-to-all turns the
  output back (3 forward, 3 backward). Needs the query heads to divide by
  ``cp``; KV heads that do not are repeated to the query heads first. Moves
  ``(2 Hq + 2 Hkv) * T * D / cp`` per rank, so it suits MHA at larger ``cp``.
* ``"ring"`` (:mod:`torchtp.cp.ring`): each rank's keys and values passed
  around the ring, ``cp - 1`` shifts, the partial outputs merged by their
  log-sum-exp. The same bytes as all-gather in ``cp - 1`` steps instead of
  one, but a rank never holds more than two ranks' keys and values: the
  choice where the full sequence's keys and values do not fit.

:func:`choose` picks the one of all-gather and Ulysses that moves fewer bytes
(docs/context_parallel.md); ring, with all-gather's bytes and more steps, is
chosen by name.
The local attention is :func:`attend`: PyTorch's SDPA with the global mask,
or, for attention sinks or when the log-sum-exp is asked for, the same
softmax written out.

With ``recompute=True`` (the default) the part between this rank's inputs
and its output is recomputed in the backward instead of saved
(``torch.utils.checkpoint``): the gathered keys and values, the exchanged
heads and the mask are never held between forward and backward, so a rank
saves only its own ``q``, ``k``, ``v`` for attention: ``1/cp`` of one
process's, where SDPA alone would save the gathered keys and values and the
mask (both of the full sequence). The price is one more attention forward in
the backward (and, for ``"allgather"``, one more all-gather).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..comm.regions import exchange, gather_sum_grads
from ..comm.runtime import ProcessGroup, group_rank, group_size
from .layout import SequenceLayout, runs
from .masks import MaskRule, SequenceMeta, allowed
from .ring import ring_attention

Algorithm = Literal["allgather", "ulysses", "ring"]
ALGORITHMS: tuple[str, ...] = ("auto", "allgather", "ulysses", "ring")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, scale: float,
           sinks: torch.Tensor | None = None,
           with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of ``q`` over ``k``/``v`` where ``ok`` allows.

    Args:
        q: ``(B, Hq, Tq, D)``.
        k: ``(B, Hkv, Tk, D)``; ``Hq`` a multiple of ``Hkv`` (GQA).
        v: ``(B, Hkv, Tk, D)``.
        ok: ``(B, 1, Tq, Tk)`` bool, ``True`` where a query may see a key; a
            query with no key gets a 0 output (as PyTorch's SDPA gives it).
        scale: The factor on ``q k^T``.
        sinks: ``(Hq,)`` logits of per-head attention sinks (GPT-OSS): one more
            softmax column that takes probability but adds no value.
        with_lse: Also return the log-sum-exp of each query's scores.

    Returns:
        ``(B, Hq, Tq, D)`` output and ``(B, Hq, Tq)`` log-sum-exp (or ``None``).
    """
    if sinks is None and not with_lse:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1]), None
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # Softmax in at least float32, as transformers' eager attention does.
    work = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2)).to(work) * scale  # (B, Hq, Tq, Tk)
    scores = scores.masked_fill(~ok, float("-inf"))
    logits = scores
    if sinks is not None:
        sink = sinks.to(work).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sink], dim=-1)  # (B, Hq, Tq, Tk + 1)
    # A query with no key gets 0, as SDPA gives it: its row is summed as zeros (a
    # finite log-sum-exp, so no NaN in any gradient) and every exp(-inf - lse) is 0.
    empty = (logits == float("-inf")).all(dim=-1, keepdim=True)  # (B, Hq, Tq, 1)
    lse = torch.logsumexp(logits.masked_fill(empty, 0), dim=-1)  # (B, Hq, Tq)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return probs @ v, (lse.masked_fill(empty[..., 0], float("-inf")) if with_lse else None)


def choose(heads: int, kv_heads: int, cp: int) -> Algorithm:
    """The algorithm that moves fewer bytes per rank (``"allgather"`` on a tie).

    All-gather receives ``2 * kv_heads * (cp - 1) / cp`` of the full sequence's
    per-head bytes; Ulysses sends ``(2 * heads + 2 * kv') * (cp - 1) / cp``
    of a ``1/cp`` share, with ``kv'`` the KV heads it moves (repeated to
    ``heads`` when they do not divide by ``cp``). Ulysses needs ``heads``
    divisible by ``cp``.
    """
    if heads % cp:
        return "allgather"
    moved_kv = kv_heads if kv_heads % cp == 0 else heads
    return "ulysses" if (2 * heads + 2 * moved_kv) < 2 * kv_heads * cp else "allgather"


def check_algorithm(algorithm: str, heads: int | None, cp: int, who: str) -> None:
    """Raise unless ``algorithm`` is known and, for Ulysses, ``heads`` divide by ``cp``.

    ``heads=None`` checks the name only (before the model's heads are known).

    Raises:
        ValueError: naming the valid cp sizes and the other algorithm.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{who}: unknown context-parallel algorithm {algorithm!r}; "
                         f"use one of {list(ALGORITHMS)}")
    if algorithm == "ulysses" and heads is not None and heads % cp:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"{who}: Ulysses splits the {heads} query heads (per TP rank) over "
                         f"cp={cp} ranks, which does not divide; valid cp sizes for Ulysses: "
                         f"{valid}; or use algorithm='allgather', which takes any cp")


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      layout: SequenceLayout, meta: SequenceMeta, rule: MaskRule,
                      group: ProcessGroup | None, scale: float, algorithm: Algorithm,
                      sinks: torch.Tensor | None = None, with_lse: bool = False,
                      recompute: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of this rank's queries over the whole sequence's keys, exact.

    Args:
        q: ``(B, Hq, T/cp, D)`` this rank's queries, in :meth:`SequenceLayout.indices` order.
        k: ``(B, Hkv, T/cp, D)`` its keys.
        v: ``(B, Hkv, T/cp, D)`` its values.
        layout: Which tokens each rank holds.
        meta: The full batch's documents and padding.
        rule: Causal and sliding-window rules of this layer.
        group: The context-parallel group.
        scale: The factor on ``q k^T``.
        algorithm: ``"allgather"``, ``"ulysses"`` or ``"ring"`` (see the module docstring).
        sinks: ``(Hq,)`` attention-sink logits, or ``None``.
        with_lse: Also return the log-sum-exp, ``(B, Hq, T/cp)``.
        recompute: Recompute the attention in the backward instead of saving
            the full sequence's keys, values and mask (see the module docstring;
            ring attention always recomputes).

    Returns:
        ``(B, Hq, T/cp, D)`` output for this rank's queries, and the log-sum-exp or ``None``.
    """
    if algorithm == "ring":  # its backward recomputes by construction
        out, lse = ring_attention(q, k, v, layout, meta, rule, group, scale, sinks)
        return out, (lse if with_lse else None)
    ckpt = recompute and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if algorithm == "allgather":
        return _run(ckpt, _gathered, q, k, v, layout, meta, rule, group, scale, sinks, with_lse)
    return _ulysses(q, k, v, layout, meta, rule, group, scale, sinks, with_lse, ckpt)


def _run(ckpt: bool, fn: Any, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fn(*args)``, recomputed in the backward when ``ckpt`` (only ``args`` are saved)."""
    return checkpoint(fn, *args, use_reentrant=False) if ckpt else fn(*args)


def _gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
              meta: SequenceMeta, rule: MaskRule, group: ProcessGroup | None, scale: float,
              sinks: torch.Tensor | None,
              with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    kv = gather_sum_grads(torch.stack([k, v]), group, dim=3)  # (2, B, Hkv, T, D), layout order
    kv = kv.index_select(3, layout.inverse.to(q.device))  # sequence order
    return _by_runs(q, kv[0], kv[1], meta, rule, layout.indices(group_rank(group)), scale,
                    sinks, with_lse)


def _by_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SequenceMeta,
             rule: MaskRule, q_idx: torch.Tensor, scale: float, sinks: torch.Tensor | None,
             with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries at sequence indices ``q_idx`` over keys ``(B, H, T, D)`` in sequence order.

    Each run of consecutive queries attends only to the keys its rule can
    allow (causal: none after the run; a window: none before it), so a causal
    layer computes about the unmasked pairs, as one process's causal kernel
    does, instead of every query-key pair.
    """
    outs, lses, start = [], [], 0
    for first, n in runs(q_idx):
        lo = max(0, first - rule.window + 1) if rule.causal and rule.window else 0
        hi = first + n if rule.causal else k.shape[2]
        q_pos = torch.arange(first, first + n, device=q.device)
        ok = allowed(meta, rule, q_pos, torch.arange(lo, hi, device=q.device))
        out, lse = attend(q[:, :, start:start + n], k[:, :, lo:hi], v[:, :, lo:hi], ok, scale,
                          sinks, with_lse)
        outs.append(out)
        lses.append(lse)
        start += n
    lse_all = torch.cat(lses, dim=2) if with_lse else None  # type: ignore[arg-type]
    return torch.cat(outs, dim=2), lse_all


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
             meta: SequenceMeta, rule: MaskRule, group: ProcessGroup | None, scale: float,
             sinks: torch.Tensor | None, with_lse: bool,
             ckpt: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    cp, rank = group_size(group), group_rank(group)
    heads = q.shape[1]
    if k.shape[1] % cp:  # repeat KV heads to the query heads: exact, more bytes
        rep = heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q_all = exchange(q, group, split=1, join=2)  # (B, Hq/cp, T, D)
    kv = exchange(torch.stack([k, v]), group, split=2, join=3)  # (2, B, Hkv/cp, T, D)
    mine = None if sinks is None else sinks.narrow(0, rank * heads // cp, heads // cp)
    kv = kv.index_select(3, layout.inverse.to(q.device))  # sequence order
    out, lse = _run(ckpt, _by_runs, q_all, kv[0], kv[1], meta, rule, layout.order, scale, mine,
                    with_lse)
    out = exchange(out, group, split=2, join=1)  # (B, Hq, T/cp, D)
    if lse is not None:
        lse = exchange(lse, group, split=2, join=1)
    return out, lse
