"""Rank functions for test_step_check: the optimizer-step check of replicated state."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchtp
from torchtp.guards import step_check

from ._models import deep_mlp


def _batch(step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    return torch.randn(4, 16)


def _wrapped(period: str | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    if period is None:
        os.environ.pop("TP_STEP_CHECK", None)
    else:
        os.environ["TP_STEP_CHECK"] = period
    model = torchtp.DistributedModelWrapper(deep_mlp().eval())  # eval: no dropout draws
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(model: nn.Module, step: int) -> torch.Tensor:
    loss = model(_batch(step)).square().mean()
    loss.backward()
    return loss.detach()


def _raises(fn: Callable[[], Any], match: str) -> str:
    with pytest.raises(torchtp.RankMismatchError, match=match) as info:
        fn()
    return str(info.value)


# torch's own clip, as a reference bound before the first wrap holds it (the wrap routes the
# name torch.nn.utils.clip_grad_norm_, not a function object taken earlier)
def _torch_own_clip(parameters: Any, max_norm: float) -> torch.Tensor:
    routed = torch.nn.utils.clip_grad_norm_
    return getattr(routed, "__wrapped__", routed)(parameters, max_norm)


def _torch_clip(rank: int) -> str:
    """torch's own clip on the local shards: each rank clips by a different factor."""
    model, opt = _wrapped()
    _backward(model, 0)
    _torch_own_clip(model.parameters(), 1e-3)
    return _raises(opt.step, r"gradients of '3\.bias'.*a clip by the norm of each rank's own "
                             r"shards .*call torch\.nn\.utils\.clip_grad_norm_, which a wrap "
                             r"routes, or torchtp\.clip_grad_norm_")


def _framework_clips(rank: int) -> list[float]:
    """torch's, accelerate's and Lightning's clipping (what a self-wrapped model gets from
    ``Accelerator.clip_grad_norm_`` and ``Trainer(gradient_clip_val=...)``), routed by the
    wrap: every rank clips by the whole model's norm, and the step goes through. Returns
    each clip's largest gradient difference from torchtp's clip of the same gradients."""
    from accelerate import Accelerator
    from lightning.pytorch.plugins.precision import Precision

    def clipped(clip: Callable[[nn.Module, torch.optim.Optimizer], Any]) -> list[torch.Tensor]:
        model, opt = _wrapped()

        def closure() -> torch.Tensor:  # Lightning's automatic optimization: step(closure)
            opt.zero_grad()
            loss = _backward(model, 0)
            clip(model, opt)
            return loss

        opt.step(closure=closure)  # the step check runs after the closure
        return [p.grad.clone() for p in model.parameters()]

    want = clipped(lambda model, _: torchtp.clip_grad_norm_(model.parameters(), 1e-3))
    return [max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
            for got in (clipped(lambda model, _: torch.nn.utils.clip_grad_norm_(
                            model.parameters(), 1e-3)),
                        clipped(lambda model, _: Accelerator(cpu=True).clip_grad_norm_(
                            model.parameters(), 1e-3)),
                        clipped(lambda _, opt: Precision().clip_gradients(opt, 1e-3)))]


def _peft(rank: int) -> list[Any]:
    """LoRA on a wrapped model: its replicated adapters (A of a weight-rows-split layer, B of
    a weight-columns-split one) agree after a plain step, and torch's clip is caught."""
    from peft import LoraConfig, get_peft_model

    wrapped, _ = _wrapped()
    torch.manual_seed(1)
    lora = LoraConfig(r=2, target_modules=["0", "3"], init_lora_weights="gaussian")
    model = get_peft_model(wrapped.base_model, lora)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out: list[Any] = []
    for clip in (False, True):
        opt.zero_grad()
        _backward(model, 0)
        if clip:
            _torch_own_clip(model.parameters(), 1e-3)
            out.append(_raises(opt.step, r"gradients of '.*lora_.*call torch\.nn\.utils\."
                                         r"clip_grad_norm_, which a wrap routes"))
        else:
            opt.step()
            out.append(sorted(step_check._plans(opt)[0].names))
    return out


def _presence(rank: int) -> str:
    """A frozen parameter (no gradient anywhere) passes; a gradient dropped on one rank not."""
    model, opt = _wrapped()
    model.base_model[4].bias.requires_grad_(False)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    _backward(model, 1)
    if rank == 1:
        model.base_model[4].weight.grad = None
    return _raises(opt.step, r"gradient presence of '4\.weight'.*on some TP ranks only")


def _torchtp_clip_exact() -> list[float]:
    """torchtp's clip passes the check; weights stay equal to the unsharded run."""
    model, opt = _wrapped()
    ref = deep_mlp().eval()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        _backward(model, step)
        _backward(ref, step)
        torchtp.clip_grad_norm_(model, 0.05)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        ref_opt.step()
    with torch.no_grad():
        return [float((model(_batch(9)) - ref(_batch(9))).abs().max())]


def _edited_weight(rank: int, at_step: int) -> str:
    """Rank 1's replicated LayerNorm weight off by 1% just before optimizer step ``at_step``
    (after the backward, so only the weights differ): caught at that step."""
    model, opt = _wrapped("3")
    for step in range(at_step + 1):
        opt.zero_grad()
        _backward(model, step)
        if step < at_step:
            opt.step()
    if rank == 1:
        with torch.no_grad():
            model.base_model[4].weight.mul_(1.01)
    return _raises(opt.step, r"weights of '4\.weight' .*likely a wrong shard file or a rank-local edit")


def _nan_on_one_rank(rank: int) -> list[str]:
    """A NaN in one rank's copy: of a replicated gradient (caught at that step), and of a
    replicated weight between weight checks (its gradients turn NaN there: caught at the
    next step). A maximum over NaN depends on the comparison order, so a NaN digest
    alone would slip through."""
    out = []
    model, opt = _wrapped()
    _backward(model, 0)
    if rank == 0:
        model.base_model[4].bias.grad[0] = float("nan")
    out.append(_raises(opt.step, r"gradients of '4\.bias' \(NaN or inf on some ranks only\)"))
    model, opt = _wrapped()
    for step in range(2):
        opt.zero_grad()
        _backward(model, step)
        opt.step()  # the first step checks the weights too (then every 10th)
    if rank == 0:
        with torch.no_grad():
            model.base_model[4].weight[0] = float("nan")  # the replicated LayerNorm
    opt.zero_grad()
    _backward(model, 2)
    out.append(_raises(opt.step, r"NaN or inf on some ranks only"))
    return out


def _untouched_and_off(rank: int) -> list[Any]:
    """A plain optimizer issues no collective; TP_STEP_CHECK=0 lets torch's clip through."""
    plain = nn.Linear(4, 4)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.randn(2, 4)).sum().backward()
    model, opt = _wrapped()
    _backward(model, 0)
    with torchtp.count_collectives() as plain_count:
        plain_opt.step()
    with torchtp.count_collectives() as tp_count:
        opt.step()
    off, off_opt = _wrapped("0")
    _backward(off, 0)
    torch.nn.utils.clip_grad_norm_(off.parameters(), 1e-3)
    with torchtp.count_collectives() as off_count:
        off_opt.step()
    os.environ.pop("TP_STEP_CHECK", None)
    return [plain_count.total, dict(tp_count.counts), off_count.total]


def _scaled_steps(model: nn.Module, scaler: torch.amp.GradScaler,
                  overflow: Callable[[nn.Module], None]) -> list[float]:
    """Three SGD steps through ``scaler``, ``overflow`` putting an inf in a gradient at the
    first; the scale after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(_batch(step)).square().mean()).backward()
        if step == 0:
            overflow(model)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _grad_scalers(rank: int) -> dict[str, Any]:
    """An overflow in one rank's shard only (TP rank 1's first row of 0.weight, its row 16 of
    32): torchtp's GradScaler skips that step on every rank and keeps one scale, as one
    process does with the overflow in its whole gradient. torch's skips on rank 1 only;
    the next collective meets rank 0's step check and says so. Run last: that error
    leaves rank 1 a step behind."""
    ref = deep_mlp().eval()

    def whole(model: nn.Module) -> None:
        model[0].weight.grad[16, 0] = float("inf")

    def shard(model: nn.Module) -> None:
        if rank == 1:
            model.base_model[0].weight.grad[0, 0] = float("inf")

    want = _scaled_steps(ref, torch.amp.GradScaler("cpu", init_scale=2.0**10), whole)
    model, _ = _wrapped()
    got = _scaled_steps(model, torchtp.GradScaler("cpu", init_scale=2.0**10), shard)
    with torch.no_grad():
        err = float((model(_batch(9)) - ref(_batch(9))).abs().max())
    plain, _ = _wrapped()
    message = _raises(lambda: _scaled_steps(plain, torch.amp.GradScaler("cpu", init_scale=2.0**10),
                                            shard),
                      r"an optimizer step ran on some ranks only: torch\.amp\.GradScaler skips "
                      r"optimizer\.step\(\) on a rank whose own shards' gradients are not finite; "
                      r"use torchtp\.GradScaler")
    # An optimizer of split parameters only has no replicated state to compare: its step
    # still joins a collective, so a step skipped on one rank is caught the same way
    torch.manual_seed(0)
    split = torchtp.DistributedModelWrapper(nn.Sequential(
        nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 16, bias=False)))
    only_split = _raises(lambda: _scaled_steps(
        split, torch.amp.GradScaler("cpu", init_scale=2.0**10), shard),
        r"an optimizer step ran on some ranks only: torch\.amp\.GradScaler skips")
    # From the ranks' signatures on: the head names each rank's own collective
    return {"scales": [got, want], "err": err, "torch_scaler": message[message.index("rank 0:"):],
            "only_split": only_split[only_split.index("rank 0:"):]}


def cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every case in one spawned run; each message must be the same on every rank."""
    return {
        "torch_clip": _torch_clip(rank),
        "framework_clips": _framework_clips(rank),
        "peft": _peft(rank),
        "presence": _presence(rank),
        "torchtp_clip_err": _torchtp_clip_exact(),
        "edit_first": _edited_weight(rank, 0),
        "edit_step_n": _edited_weight(rank, 3),
        "untouched": _untouched_and_off(rank),
        "nan": _nan_on_one_rank(rank),
        "grad_scalers": _grad_scalers(rank),
    }
