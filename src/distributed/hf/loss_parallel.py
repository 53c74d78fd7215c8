"""``loss_parallel=True`` for HuggingFace causal LMs: the loss from vocab-split logits.

Before the swap, :func:`plan_loss_parallel` makes the LM head a weight-rows
(vocabulary) split with a gathered output (``colwise_gather_output``), and
vocab-splits its tied input embedding too. After the swap,
:func:`install_loss_parallel` replaces the model's ``loss_function`` (the
hook every HF causal LM calls as ``self.loss_function(logits, labels,
vocab_size, **kwargs)``) with the same shift/flatten/``num_items_in_batch``
logic as transformers' ``ForCausalLMLoss`` around
:func:`~torchtp.vocab_parallel_cross_entropy`, and decides per call:

* called with ``labels=``: the head's output stays split, ``outputs.logits``
  is this rank's vocabulary slice ``(B, T, V_r)`` and ``outputs.loss`` is the
  full model's loss;
* called without labels (``generate()``, evaluation): the head gathers, so
  ``outputs.logits`` is the full ``(B, T, V)`` as without loss parallelism.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.regions import gather_from_tensor_parallel_region
from ..layers import RowParallelLinear
from ..layers.loss import vocab_parallel_cross_entropy
from ..plans import ResolvedPlan, ShardContext
from ..plans.registry import STYLES
from ..plans.styles import Colwise
from ..plans.styles_embedding import EmbeddingRowwise
from .detect import is_hf_model

WHO = "DistributedModelWrapper(loss_parallel=True)"


def _name_of(model: nn.Module, module: nn.Module) -> str:
    for name, mod in model.named_modules():
        if mod is module:
            return name
    raise ValueError(f"{WHO}: {type(module).__name__} is not a submodule of the model")


def _set(plan: ResolvedPlan, name: str, style_name: str) -> None:
    plan.assignments[name] = STYLES[style_name]
    plan.rules[name] = style_name
    plan.matches[name] = [name]
    plan.why[name] = "loss_parallel=True: the vocabulary stays split"


def plan_loss_parallel(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext) -> None:
    """Split the LM head's weight rows (vocabulary), and a tied input embedding's rows.

    Raises:
        ValueError: not a HuggingFace model with a Linear LM head and an HF
            causal-LM loss, or the head's per-rank vocabulary slices are not
            contiguous in rank order.
    """
    head = _require_causal_lm(model)
    head_name = _name_of(model, head)
    style = plan.assignments.get(head_name)
    if not (type(style) is Colwise and style.gather_output):
        _set(plan, head_name, "colwise_gather_output")
    emb = model.get_input_embeddings()  # type: ignore[operator]
    if isinstance(emb, nn.Module) and getattr(emb, "weight", None) is head.weight:
        emb_name = _name_of(model, emb)
        if not isinstance(plan.assignments.get(emb_name), EmbeddingRowwise):
            _set(plan, emb_name, "embedding_rowwise")
    _check_rank_order(head, head_name, plan.assignments[head_name], ctx)
    plan.notes.append(f"'{head_name}': loss_parallel=True keeps its vocabulary split (weight "
                      "rows) when called with labels=; the loss is vocab-parallel")


def _require_causal_lm(model: nn.Module) -> nn.Linear:
    if not is_hf_model(model):
        raise ValueError(
            f"{WHO} needs a HuggingFace causal LM (got {type(model).__name__}); for other "
            "models, split the output layer's weight rows ('colwise') and call "
            "torchtp.vocab_parallel_cross_entropy on its output")
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{WHO}: {type(model).__name__} has no nn.Linear output embedding "
                         f"(LM head), got {type(head).__name__}")
    if model.loss_function is not ForCausalLMLoss:
        raise ValueError(
            f"{WHO}: {type(model).__name__}'s loss is not transformers' ForCausalLMLoss "
            f"(loss_type={getattr(model, 'loss_type', None)!r}); only causal-LM losses are "
            "computed vocab-parallel. Wrap it without loss_parallel")
    if not _forward_calls_loss_function(type(model)):
        raise ValueError(
            f"{WHO}: {type(model).__name__}.forward computes its loss itself (inline or in a "
            "submodule), not through self.loss_function, so with the LM head's vocabulary "
            "split it would see this rank's slice only. Wrap it "
            "without loss_parallel, or compute the loss with "
            "torchtp.vocab_parallel_cross_entropy on the split logits")
    return head


def _forward_calls_loss_function(cls: type) -> bool:
    """Whether a ``forward`` of ``cls`` or of a class it derives from names
    ``loss_function`` (BART's, Marian's, Pegasus's, XLM's, XLNet's, Whisper's and
    TrOCR's causal-LM classes compute a ``CrossEntropyLoss`` inline instead, in
    transformers 5.3-5.25). Without source to read, ``True``: the check after the
    forward still refuses a loss computed elsewhere."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        try:
            if "loss_function" in inspect.getsource(forward):
                return True
        except (OSError, TypeError):
            return True
    return False


def _check_rank_order(head: nn.Module, name: str, style: Any, ctx: ShardContext) -> None:
    """The loss finds each rank's slice by summing the sizes of lower ranks' slices."""
    expected = 0
    for rank in range(ctx.world_size):
        layer = style.plan(head, name, ShardContext(ctx.world_size, rank, None))
        layout = layer.layouts.get("weight")
        if layout is None:
            return  # the split does not fit this tp size: the constraint check says why
        if len(layout.segments) != 1 or layout.segments[0][0] != expected:
            raise ValueError(
                f"{WHO}: '{name}' gives rank {rank} the vocabulary rows {layout.segments}, "
                f"not one range starting at {expected}; loss parallelism needs contiguous "
                "slices in rank order")
        expected += layout.segments[0][1]


class _LossParallel:
    """Per-call switch between a split and a gathered head, and the replacement loss."""

    def __init__(self, model: nn.Module, head: RowParallelLinear) -> None:
        self.head = head
        self.model_name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.with_labels = False
        self.loss_called = False

    def before(self, _mod: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = self.signature.bind_partial(*args, **kwargs).arguments
        labels = bound.get("labels", bound.get("kwargs", {}).get("labels"))
        self.with_labels = labels is not None
        self.loss_called = False
        self.head.gather_output = not self.with_labels

    def after(self, _mod: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
        self.head.gather_output = True
        if self.with_labels and not self.loss_called:
            raise RuntimeError(
                f"{WHO}: {self.model_name}.forward was called with labels= but did not compute "
                "its loss through self.loss_function, so its loss would see this rank's "
                "vocabulary slice only; wrap this model without loss_parallel")
        return output

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole ``(..., V)`` logits from this rank's slice ``(..., V_r)`` (what a
        forward with labels returned); other tensors are returned as they are."""
        head = self.head
        if logits.shape[-1] != head.out_features_local or head.world_size == 1:
            return logits
        return gather_from_tensor_parallel_region(logits, head.group, -1, head.out_features)

    def causal_lm_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None, **_kwargs: Any,
    ) -> torch.Tensor:
        """transformers' ``ForCausalLMLoss`` on this rank's logits slice ``(B, T, V_r)``."""
        self.loss_called = True
        head = self.head
        if logits.shape[-1] != head.out_features_local or vocab_size != head.out_features:
            raise RuntimeError(
                f"{WHO}: the loss got logits with last dimension {logits.shape[-1]} and "
                f"vocab_size={vocab_size}, but the LM head holds {head.out_features_local} of "
                f"{head.out_features} vocabulary rows on rank {head.rank}")
        if shift_labels is None:
            # Shift so that tokens < n predict n (as transformers does).
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.reshape(-1).to(logits.device)  # (B*T,)
        local = logits.reshape(-1, logits.shape[-1])  # (B*T, V_r)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(local, shift_labels, ignore_index=ignore_index,
                                            reduction=reduction, group=head.group)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def install_loss_parallel(model: nn.Module) -> None:
    """After the swap: route the model's loss through the vocab-parallel cross-entropy."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, RowParallelLinear):
        raise ValueError(f"{WHO}: the LM head was not split by weight rows (it is a "
                         f"{type(head).__name__}); it must be 'colwise_gather_output'")
    switch = _LossParallel(model, head)
    model.loss_function = switch.causal_lm_loss  # type: ignore[assignment]
    model.register_forward_pre_hook(switch.before, with_kwargs=True)
    model.register_forward_hook(switch.after, with_kwargs=True)
    model.tp_loss_parallel = switch  # type: ignore[assignment]
