"""Rank-side checks: loss parallelism and sequence parallelism vs the unsharded HF model."""

from __future__ import annotations

import torch
from torch import nn

import torchtp

from ._hf_checks import LOGITS, compare_params
from ._hf_models import VOCAB, build

# Losses are means of ~20 fp32 terms computed in a different order: 1e-6 relative.
LOSS = {"rtol": 1e-5, "atol": 1e-6}


def batch(seq: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two sequences of ``seq`` tokens; the labels ignore a few positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, 2] = labels[1, -3] = -100
    return {"input_ids": ids, "labels": labels}


def _build(arch: str, checkpointing: bool) -> nn.Module:
    # No dropout: training-mode runs must be deterministic to compare exactly.
    model = build(arch, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if arch == "gpt2" \
        else build(arch)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    return model


def check_training(rank: int, world_size: int, arch: str, seq: int, loss_parallel: bool,
                   sequence_parallel: bool, checkpointing: bool = False,
                   steps: int = 2) -> dict:
    """Loss, logits, every gradient and SGD steps equal the unsharded model's."""
    ref = _build(arch, checkpointing)
    wrapped = torchtp.DistributedModelWrapper(
        _build(arch, checkpointing), loss_parallel=loss_parallel,
        sequence_parallel=sequence_parallel)
    data = batch(seq)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    result: dict = {}
    for step in range(steps):
        opt_ref.zero_grad()
        opt.zero_grad()
        want = ref(**data)
        with torchtp.count_collectives() as fwd:
            got = wrapped(**data)
        torch.testing.assert_close(got.loss, want.loss, **LOSS)
        full = want.logits.detach()
        if loss_parallel:  # this rank's vocabulary rows of the logits
            head = wrapped.get_output_embeddings()
            (start, n), = head.tp_layouts["weight"].segments
            full = full[..., start:start + n]
        torch.testing.assert_close(got.logits, full, **LOGITS)
        want.loss.backward()
        got.loss.backward()
        result["grads_checked"] = compare_params(wrapped, ref, grads=True)
        opt_ref.step()
        opt.step()
        compare_params(wrapped, ref, grads=False)
        if step == 0:
            result["forward"] = dict(fwd.counts)
    return result


def check_generate(rank: int, world_size: int, arch: str, loss_parallel: bool,
                   sequence_parallel: bool) -> int:
    """Greedy generation (logits gathered, cache, 1-token steps) equals the unsharded model's."""
    ref = build(arch)
    wrapped = torchtp.DistributedModelWrapper(build(arch), loss_parallel=loss_parallel,
                                              sequence_parallel=sequence_parallel)
    prompt = batch(5)["input_ids"][:1]
    want = ref.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = wrapped.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want), f"{arch}: generated {got.tolist()} != {want.tolist()}"
    logits = wrapped(input_ids=prompt).logits  # no labels: the full vocabulary
    torch.testing.assert_close(logits, ref(input_ids=prompt).logits, **LOGITS)
    return got.shape[1] - prompt.shape[1]
