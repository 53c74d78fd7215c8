"""Rank bodies for activation checkpointing with dropout: recomputation replays the RNG streams.

One process draws the same dropout masks in a checkpointed segment's
recomputation as in its forward (torch restores the generator); a
tensor-parallel model must too, in its split regions (local streams) and
after them (the shared stream), or its gradients are those of other masks.
The reference here is the same sharded model without checkpointing, built
and seeded alike, so the masks, the logits and every gradient must agree.
Tolerance: HF runs a checkpointed model without its cache, which moves float32
results by rounding (1.2e-7 in the logits, 4e-9 in the gradients, measured);
one other dropout mask (p=0.3) moves them by O(0.1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchtp

from ._hf_models import VOCAB, build

Run = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _gpt2_run(gradient_checkpointing: dict[str, Any] | None, past_the_wrapper: bool = False,
              sequence_parallel: bool = False) -> Run:
    """GPT-2 with dropout everywhere, one training forward and backward at tp 2; called
    through the wrapper, or ``past_the_wrapper`` (``wrapped.base_model``, as
    TensorParallelTrainer does: every mask from the caller's generator)."""
    model = build("gpt2", resid_pdrop=0.3, attn_pdrop=0.3, embd_pdrop=0.3)
    if gradient_checkpointing is not None:  # one checkpoint per decoder layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing)
    wrapped = torchtp.DistributedModelWrapper(model.train(), sequence_parallel=sequence_parallel)
    torchtp.manual_seed(3)  # torch's generator too, the same on every rank
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = (wrapped.base_model if past_the_wrapper else wrapped)(input_ids=ids).logits
    logits.square().mean().backward()
    return logits.detach(), _grads(wrapped)


class _Pair(nn.Module):
    """A weight-row-split Linear, dropout on its split output, the weight-column-split Linear
    and a dropout on the replicated result; ``segment`` says what is checkpointed."""

    def __init__(self, segment: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.inner, self.outer = nn.Dropout(0.3), nn.Dropout(0.3)
        self.segment = segment

    def _tail(self, h: torch.Tensor) -> torch.Tensor:
        return self.outer(self.down(self.inner(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # (B, 32/tp): a split region begins
        if self.segment == "inside":  # starts and ends inside it (Megatron's core attention)
            return self.outer(self.down(checkpoint(self.inner, h, use_reentrant=False)))
        if self.segment == "leaving":  # starts inside it and leaves it
            return checkpoint(self._tail, h, use_reentrant=False)
        return self._tail(h)


def _pair_run(segment: str, lora: bool = False) -> Run:
    model: nn.Module = _Pair(segment)
    if lora:  # LoRA on the weight-column-split Linear: its LoRA forward leaves the region
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["down"], lora_dropout=0.3))
    plan = {"up": "colwise", "down": "rowwise"}
    if lora:
        plan = {f"base_model.model.{k}": v for k, v in plan.items()}
    wrapped = torchtp.DistributedModelWrapper(model.train(), plan=plan)
    torchtp.manual_seed(3)
    out = wrapped(torch.randn(4, 16, generator=torch.Generator().manual_seed(2)))
    out.square().mean().backward()
    return out.detach(), _grads(wrapped)


def _shard_masks_differ() -> bool:
    """GPT-2 at tp 2 with sequence parallelism: the residual dropouts run on sequence
    shards (4 of 8 tokens per rank), and the ranks' masks must differ, as the two halves
    of one mask over the sequence would (from one stream they were the same)."""
    model = build("gpt2", resid_pdrop=0.5, attn_pdrop=0.0, embd_pdrop=0.0)
    wrapped = torchtp.DistributedModelWrapper(model.train(), sequence_parallel=True)
    masks: list[torch.Tensor] = []
    for name, module in wrapped.named_modules():
        if name.endswith(("attn.resid_dropout", "mlp.dropout")):
            module.register_forward_hook(lambda _m, _i, out: masks.append(out == 0))
    wrapped(input_ids=torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1)))
    assert len(masks) == 4 and all(m.shape == (2, 4, 64) for m in masks), [m.shape for m in masks]
    gathered = [[torch.empty_like(m) for _ in range(2)] for m in masks]
    for everyone, m in zip(gathered, masks, strict=True):
        torch.distributed.all_gather(everyone, m.contiguous())
    return all(not torch.equal(*everyone) for everyone in gathered)


class _Checkpointed(nn.Module):
    """``inner`` run under a reentrant checkpoint: the segment is this one module, hooks
    included (the non-reentrant variant stops recomputing once the module's saved tensors
    are back, before its forward hooks, so nothing there needs replaying)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=True)


def _final_norm_checkpointed() -> None:
    """GPT-2 (dropout) at tp 2 with sequence parallelism, its final norm checkpointed
    alone: the segment starts on sequence shards and ends where they are gathered (the
    norm's output), which torchtp cannot replay; the backward must raise."""
    model = build("gpt2", attn_pdrop=0.3)
    wrapped = torchtp.DistributedModelWrapper(model.train(), sequence_parallel=True)
    base = wrapped.base_model.transformer
    base.ln_f = _Checkpointed(base.ln_f)  # the norm keeps its gather hook
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    wrapped(input_ids=ids).logits.sum().backward()


def _equal(a: Run, b: Run) -> bool:
    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        return torch.allclose(x, y, rtol=1e-5, atol=1e-6)

    return close(a[0], b[0]) and a[1].keys() == b[1].keys() and all(
        close(a[1][n], b[1][n]) for n in a[1])


def replayed_masks(rank: int, world_size: int) -> dict[str, Any]:
    """Checkpointed runs against the same runs without checkpointing; the refusals' messages."""
    torchtp.init_tensor_parallel()
    plain, past = _gpt2_run(None), _gpt2_run(None, past_the_wrapper=True)
    got: dict[str, Any] = {
        "gpt2 per layer": _equal(plain, _gpt2_run({"use_reentrant": False})),
        "gpt2 per layer, reentrant": _equal(plain, _gpt2_run({"use_reentrant": True})),
        "gpt2 past the wrapper": _equal(past, _gpt2_run({"use_reentrant": False}, True)),
        "segment inside a split region": _equal(_pair_run("none"), _pair_run("inside")),
        "gpt2 sequence parallel per layer": _equal(
            _gpt2_run(None, sequence_parallel=True),
            _gpt2_run({"use_reentrant": False}, sequence_parallel=True)),
        "sequence shards draw their own masks": _shard_masks_differ(),
    }
    for lora in (False, True):
        with pytest.raises(RuntimeError, match="starts inside the split region") as leaving:
            _pair_run("leaving", lora)
        got[f"leaving, lora={lora}"] = str(leaving.value)
    with pytest.raises(RuntimeError, match="starts on sequence shards") as shards:
        _final_norm_checkpointed()
    got["leaving the sequence shards"] = str(shards.value)
    # A checkpoint around the whole wrapped model: refused with dropout.
    wrapped = torchtp.DistributedModelWrapper(build("gpt2", attn_pdrop=0.3).train())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = checkpoint(lambda i: wrapped(input_ids=i).logits, ids, use_reentrant=False)
    with pytest.raises(RuntimeError, match="recomputes a whole tensor-parallel model") as whole:
        logits.sum().backward()
    got["whole"] = str(whole.value)
    return got
