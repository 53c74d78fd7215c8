"""Loss-parallel cross-entropy: the loss of vocab-split logits, never gathering them.

Each rank holds the logits of its slice of the vocabulary, ``(..., V_r)``
(the output of a weight-rows-split LM head, "colwise" without gather). The
loss needs three per-token numbers that span the whole vocabulary: the row
maximum (for a stable exponent), the sum of exponentials and the target logit
(plus, with label smoothing, the sum of all logits). Each rank computes them
over its slice and two small all-reduces of ``(N,)``-sized vectors combine
them: one MAX (the maximum, which also carries every rank's vocabulary size),
one SUM (sum-exp, target logit and the smoothing term stacked). The full
``(N, V)`` logits never exist on any rank, and the backward needs no
communication at all.
"""

from __future__ import annotations

import torch

from ..comm import ops as _comm
from ..comm.runtime import ProcessGroup, group_rank, group_size, resolve_group

REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-split logits.

    forward: ``(N, V_r)`` local logits, ``(N,)`` labels -> ``(N,)`` fp32 loss,
    identical on every rank (0 for ignored tokens); one all-reduce MAX and one
    all-reduce SUM of ``(N,)``-sized vectors. backward: no communication; the
    local logit gradient is ``(softmax - (1-eps) * onehot(target) - eps / V) * grad``
    (rows of ignored tokens are 0). The softmax of the local slice is the only
    saved tensor (the same memory ``F.cross_entropy`` keeps).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                smoothing: float, group: ProcessGroup | None) -> torch.Tensor:
        # (N, V_r) in fp32 at least (fp64 stays); may be `logits` itself: never written to.
        x = logits if logits.dtype == torch.float64 else logits.float()
        n, v_local = x.shape
        size, rank = group_size(group), group_rank(group)
        # (N + tp,): row maxima, then this rank's vocabulary size in its own slot,
        # so the MAX all-reduce also tells every rank where its slice starts.
        stats = torch.zeros(n + size, dtype=x.dtype, device=x.device)
        stats[:n] = x.amax(dim=-1) if v_local else float("-inf")
        stats[n + rank] = v_local
        if size > 1:
            _comm.all_reduce_(stats, group, op="max")
        row_max = stats[:n]  # (N,)
        sizes = stats[n:].long().tolist()
        vocab, start = sum(sizes), sum(sizes[:rank])
        _check_labels(labels, ignore_index, vocab)

        valid = labels != ignore_index  # (N,)
        owned = valid & (labels >= start) & (labels < start + v_local)
        local_idx = torch.where(owned, labels - start, 0).unsqueeze(1)  # (N, 1)
        target = x.gather(1, local_idx).squeeze(1) if v_local else torch.zeros_like(row_max)
        probs = (x - row_max.unsqueeze(1)).exp_()  # (N, V_r), fresh
        parts = [probs.sum(dim=-1), torch.where(owned, target, 0.0)]
        if smoothing:
            parts.append(x.sum(dim=-1))
        sums = torch.stack(parts)  # (2 or 3, N): sum-exp, target logit[, logit sum]
        if size > 1:
            _comm.all_reduce_(sums, group)
        lse = sums[0].log() + row_max  # (N,) log-sum-exp over the full vocabulary
        loss = lse - sums[1]
        if smoothing:
            # Mean over all V classes of -log p: lse - (sum of logits) / V.
            loss = (1.0 - smoothing) * loss + smoothing * (lse - sums[2] / vocab)
        loss = torch.where(valid, loss, 0.0)

        probs.div_(sums[0].unsqueeze(1))  # softmax over the full vocabulary, local slice
        ctx.save_for_backward(probs, local_idx, owned, valid)
        ctx.smoothing, ctx.vocab, ctx.dtype = smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # The gradient depends on the logits through the saved softmax, which is
            # not differentiated here: a second-order gradient would silently lack it.
            raise RuntimeError("vocab_parallel_cross_entropy: backward with create_graph=True "
                               "(double backward, e.g. a gradient penalty) is not supported")
        probs, local_idx, owned, valid = ctx.saved_tensors
        # probs is ours: reuse it for the gradient. A second backward through the
        # same graph sees its version change and autograd raises instead of reusing it.
        out = probs
        if out.shape[1]:
            hit = (owned.to(out.dtype) * (ctx.smoothing - 1.0)).unsqueeze(1)  # (N, 1)
            out.scatter_add_(1, local_idx, hit)
        if ctx.smoothing:
            out.sub_(ctx.smoothing / ctx.vocab)
        out.mul_(torch.where(valid, grad, 0.0).unsqueeze(1))
        return out.to(ctx.dtype), None, None, None, None


def _check_labels(labels: torch.Tensor, ignore_index: int, vocab: int) -> None:
    # Labels are identical on every rank (TP convention), so every rank gives the same verdict.
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(
            f"vocab_parallel_cross_entropy: label {value} is outside the vocabulary 0..{vocab - 1} "
            f"(the sum of every rank's logits slice) and is not ignore_index={ignore_index}; "
            "fix the labels or pass the ignore_index they use")


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
    label_smoothing: float = 0.0, reduction: str = "mean", group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of logits whose vocabulary (last dim) is split across ranks.

    Rank ``r`` passes its slice of the vocabulary, in rank order (rank 0 holds
    the first ids); slices may differ in size (an uneven split). The result
    and the gradients of ``local_logits`` equal ``F.cross_entropy`` on the
    full logits, cut to this rank's slice, including ``ignore_index``, label
    smoothing over the full vocabulary and ``"mean"`` over non-ignored tokens.

    forward: two all-reduces of ``(N,)``-sized vectors (``N`` = tokens); the
    full logits are never gathered. backward: no communication. Computed in
    fp32 (like HF's loss; fp64 stays fp64); the gradient has the logits' dtype.

    Args:
        local_logits: This rank's logits, ``(..., V_r)``.
        labels: Class ids over the *full* vocabulary, ``(...)``; identical on every rank.
        ignore_index: Label value that contributes neither loss nor gradient.
        label_smoothing: As in ``F.cross_entropy``: ``0.0 <= label_smoothing <= 1.0``.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"``
            (shape of ``labels``).
        group: Process group the vocabulary is split over; ``None`` for the TP group.

    Returns:
        The loss (fp32, or fp64 for fp64 logits), the same on every rank.

    Raises:
        ValueError: shapes, reduction or smoothing are invalid, or a label is
            outside the full vocabulary (on every rank, before the second collective).
        TypeError: ``labels`` are not integer ids.
    """
    _check_args(local_logits, labels, label_smoothing, reduction)
    g = resolve_group(group)
    v_local = local_logits.shape[-1]
    flat = local_logits.reshape(labels.numel(), v_local)  # (N, V_r); V_r may be 0
    per_token = _VocabParallelCrossEntropy.apply(
        flat, labels.reshape(-1), ignore_index, float(label_smoothing), g)
    if reduction == "none":
        return per_token.view(labels.shape)
    if reduction == "sum":
        return per_token.sum()
    # 0 / 0 = nan when every token is ignored, as F.cross_entropy gives.
    return per_token.sum() / (labels != ignore_index).sum()


def _check_args(logits: torch.Tensor, labels: torch.Tensor, smoothing: float,
                reduction: str) -> None:
    who = "vocab_parallel_cross_entropy"
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"{who}: labels must be integer class ids, got dtype {labels.dtype} "
                        "(class probabilities are not supported)")
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"{who}: local_logits {tuple(logits.shape)} must be labels' shape "
                         f"{tuple(labels.shape)} plus one vocabulary dimension (the split one)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{who}: reduction={reduction!r}; use one of {REDUCTIONS}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"{who}: label_smoothing={smoothing} must be in [0, 1]")
