"""``ContextParallel``: a HuggingFace causal LM whose sequences are split over ranks.

Every cp rank gets the same full batch, as one process would, and computes
on its ``T/cp`` tokens only (:func:`~torchtp.cp.batch.shard_batch`); the
attention layers see the whole sequence through
:mod:`torchtp.cp.attention`. The loss is the token mean over the whole batch
(:mod:`torchtp.cp.loss`) and parameter gradients are summed over cp
(:mod:`torchtp.cp.grads`), so outputs, loss, gradients and optimizer steps
equal one process's on the full batch.

Composes with tensor parallelism by wrapping the
:class:`~torchtp.DistributedModelWrapper` (its TP group is another mesh
dimension): ``ContextParallel(DistributedModelWrapper(model))``.

The safety door of a forward: before any collective the ranks agree (one
object all-gather over cp) that they got the same batch and that none of
them failed to cut it, so a bad batch raises the same error on every rank.
"""

from __future__ import annotations

import zlib
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..comm import ops as _comm
from ..comm.group_ref import WeakGroup
from ..comm.runtime import ProcessGroup, group_rank, group_size, resolve_group
from ..guards.agreement import agree
from ..guards.fingerprints import tensor_digest
from ..layers import rng
from . import grads as _grads
from .attention import check_algorithm
from .batch import LocalBatch, shard_batch, unshard_sequence
from .hf_attention import BATCH_KWARG, NO_PACKING, CPState, prepare
from .loss import token_mean_loss

WHO = "ContextParallel"
_TOKENS_KEY = zlib.crc32(b"context parallel")  # seeds the streams of a rank's tokens
_REFUSED = ("inputs_embeds", "past_key_values", "cache_position", "shift_labels")


class ContextParallel(nn.Module):
    """Split every sequence of a HuggingFace causal LM over the context-parallel ranks.

    Args:
        model: A HuggingFace causal LM (family in
            :data:`torchtp.cp.hf_attention.SUPPORTED`), or a
            :class:`~torchtp.DistributedModelWrapper` around one.
        group: The context-parallel group; ``None``: the mesh's ``cp``
            dimension (``init_parallel(cp=...)``).
        algorithm: ``"auto"`` (fewer bytes moved), ``"allgather"``, ``"ulysses"``
            or ``"ring"`` (no rank holds the whole sequence's keys and values)
            (:mod:`torchtp.cp.attention`).
        balanced: Head/tail split of each sequence (equal causal work per
            rank); ``False``: contiguous chunks.
        check_batches: Check at each forward that every cp rank got the same
            batch (one small object all-gather); ``False`` skips it.
        recompute: Recompute each attention in the backward instead of saving
            the full sequence's keys, values and mask (default; a rank then saves
            ``1/cp`` of one process's attention activations); ``False`` saves them
            (one attention forward and, for all-gather, one collective less per layer).
        dp_group: The data-parallel group whose replicas' gradients DDP or FSDP2
            average; ``None``: ``init_parallel``'s ``dp`` group (none without one).
            With more than one replica the loss's divisor is the labelled tokens
            of the whole global batch over the replicas (one scalar all-reduce),
            so the average is one process's token mean however unevenly padding
            falls over the replicas.

    Raises:
        ValueError: an unsupported family, an unknown algorithm, or Ulysses
            with query heads that do not divide by cp (naming the valid sizes);
            the same verdict on every rank.
    """

    group: WeakGroup[ProcessGroup | None] = WeakGroup()
    dp_group: WeakGroup[ProcessGroup | None] = WeakGroup()

    def __init__(self, model: nn.Module, group: ProcessGroup | None = None,
                 algorithm: str = "auto", balanced: bool = True,
                 check_batches: bool = True, recompute: bool = True,
                 dp_group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = model
        self.group = group = resolve_group(group, dim="cp")
        self.dp_group = resolve_group(dp_group, dim="dp")
        self.balanced, self.check_batches = balanced, check_batches
        self.state = CPState(group=group, algorithm=algorithm, recompute=recompute)
        error: BaseException | None = None
        try:
            check_algorithm(algorithm, None, group_size(group), WHO)
            self.hf = prepare(model, self.state, WHO)
        except ValueError as exc:
            error = exc
        agree(WHO, error, {"algorithm": algorithm, "balanced": balanced, "recompute": recompute,
                           "weights": _weights_digest(model)}, group)
        self.__dict__["_summed"] = _grads.refresh(model, group, -1)
        self.family = getattr(getattr(self.hf, "config", None), "model_type", None)
        self.train(model.training)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        """The model's output for this rank's tokens; ``loss`` over the whole batch.

        Args:
            input_ids: ``(B, T)`` the full batch, the same on every cp rank.
            attention_mask: ``(B, T)`` 1 for tokens, 0 for padding.
            position_ids: ``(B, T)``; restarting ids mark packed documents.
            labels: ``(B, T)`` as for the model (unshifted, ``-100`` ignored).
            **kwargs: Passed to the model (not ``inputs_embeds``,
                ``past_key_values``, ``shift_labels``, ``logits_to_keep``);
                ``num_items_in_batch`` (HF Trainer's token count of the whole
                accumulation window) is the loss's divisor, as in transformers.

        Returns:
            The model's output with ``logits`` ``(B, T/cp, V)`` for this rank's
            tokens, ``loss`` the token mean over the full batch (the same on
            every rank) and ``cp_batch``, the :class:`LocalBatch` that
            :meth:`unshard` needs to put per-token outputs back in order.
        """
        group = self.group
        items = kwargs.pop("num_items_in_batch", None)
        batch, error = None, _refused(kwargs, self.hf)
        if error is None:
            try:
                batch = shard_batch(input_ids, group, attention_mask=attention_mask,
                                    position_ids=position_ids, labels=labels,
                                    balanced=self.balanced)
                error = self._unpackable(batch)
            except (ValueError, RuntimeError, IndexError) as exc:
                error = ValueError(f"{WHO}: the batch cannot be cut: {exc}")
        prints = {} if not self.check_batches else {
            n: tensor_digest(t) for n, t in (("input_ids", input_ids),
                                             ("attention_mask", attention_mask),
                                             ("position_ids", position_ids),
                                             ("labels", labels)) if t is not None}
        agree(f"{WHO} forward (every cp rank must get the same full batch)", error, prints, group)
        assert batch is not None
        # Parameters added since the wrap (PEFT adapters) are summed over cp too
        self.__dict__["_summed"] = _grads.refresh(self.module, group, self.__dict__["_summed"])
        # Dropout on this rank's tokens draws masks of their own (layers/rng.py); looked up
        # per training forward, from the model as it is (trained through its own train(),
        # adapters added since), beside this forward's object all-gather
        site = rng.dropout_site(self.module) if self.module.training else None
        with rng.own_tokens(_TOKENS_KEY, group_rank(group) + 1, site) if site is not None \
                else nullcontext():
            out = self.module(input_ids=batch.input_ids, position_ids=batch.position_ids,
                              use_cache=False, **{BATCH_KWARG: batch}, **kwargs)
        if labels is not None:
            divisor = self._divisor(batch) if items is None else items
            out["loss"] = token_mean_loss(out["logits"], batch, group, divisor)
        out.cp_batch = batch  # an attribute, not an output entry
        return out

    def _divisor(self, batch: LocalBatch) -> int | torch.Tensor:
        """The batch's labelled tokens; with replicas, the global batch's over their count
        (DDP and FSDP2 average the replicas' gradients: each counts its share times them)."""
        dp = self.dp_group
        if group_size(dp) == 1:
            return batch.tokens
        tokens = torch.tensor(batch.tokens, dtype=torch.float64, device=batch.input_ids.device)
        return _comm.all_reduce(tokens, dp) / group_size(dp)

    def _unpackable(self, batch: LocalBatch) -> ValueError | None:
        """Packed rows of a family whose own mask ignores packing (its one-process result
        would let documents see each other), or ``None``."""
        if self.family not in NO_PACKING or int(batch.meta.documents.max()) <= 1:
            return None
        return ValueError(f"{WHO}: position ids that restart (packed documents) with "
                          f"model_type={self.family!r}, whose transformers mask "
                          "ignores packing (one process would let the documents attend to "
                          "each other); pass an attention_mask, or one document per row")

    def unshard(self, x: torch.Tensor, batch: LocalBatch, dim: int = 1) -> torch.Tensor:
        """The full-sequence tensor of a per-token output, in sequence order, padding dropped.

        forward: all-gather over cp; backward: each rank keeps its tokens' gradient.

        Args:
            x: This rank's share, e.g. ``out.logits`` ``(B, T/cp, V)``.
            batch: The batch ``x`` came from: ``out.cp_batch`` of the same output
                (never the last forward's by default: it may be another batch).
            dim: The sequence dimension.
        """
        return unshard_sequence(x, batch, self.group, dim)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported under context parallelism: raises on every rank."""
        raise NotImplementedError(
            f"{WHO}.generate: decoding under context parallelism is not supported yet (each "
            "decode step adds one token, which does not split over cp ranks); generate with the "
            "model inside on one rank, or with tensor parallelism only")

    def describe(self) -> str:
        """The algorithm each attention shape uses and the split of the sequence."""
        chosen = ", ".join(f"{h} query / {k} KV heads: {a}"
                           for (h, k), a in self.state.chosen.items()) or "none yet (no forward)"
        split = "head/tail (balanced)" if self.balanced else "contiguous"
        return (f"context parallelism over {group_size(self.group)} ranks, {split} split; "
                f"attention: {chosen}")


def _refused(kwargs: dict[str, Any], hf: Any) -> ValueError | None:
    # Asked per call, or set on the config after the wrap (the wrap refused it then)
    if kwargs.get("output_router_logits", getattr(getattr(hf, "config", None),
                                                  "output_router_logits", False)):
        return ValueError(f"{WHO}: output_router_logits=True: the router's auxiliary loss would "
                          "be computed over this rank's tokens only and left out of the loss; "
                          "leave it False under context parallelism (docs/context_parallel.md)")
    if kwargs.get("return_dict") is False:
        return ValueError(f"{WHO}: return_dict=False: the loss over the whole batch is set on "
                          "the model's output object; leave return_dict at its default")
    given = [k for k in _REFUSED if kwargs.get(k) is not None]
    if kwargs.get("logits_to_keep") not in (None, 0):
        given.append("logits_to_keep")  # it would keep each rank's last tokens
    if given:
        return ValueError(f"{WHO}: {given} are not supported under context parallelism (the "
                          "sequence is split from input_ids; labels are shifted over the full "
                          "rows by torchtp; a cache or kept last logits are for decoding, which "
                          "is not supported yet)")
    return None


def _weights_digest(model: nn.Module) -> str:
    # Parameters are replicated over cp: the first and last ones' samples catch
    # ranks built from different seeds or checkpoints.
    params = list(model.parameters())
    return "" if not params else tensor_digest(params[0]) + tensor_digest(params[-1])
