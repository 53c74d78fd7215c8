"""Hand-written MoEs (a router Linear and an ``nn.ModuleList`` of expert MLPs), run per rank.

Three ways people write the combine:

* ``inline``: the model sums the weighted expert outputs itself and feeds the
  sum to its next Linear (the reduction goes to that Linear's input);
* ``block``: an MoE module returns the routed experts plus a shared expert,
  and the block adds it to a residual (the reduction goes to the module's
  output, before the residual);
* ``aux``: the same module also returns the router logits for an auxiliary
  loss, so the router's gradient is not only partial: each expert keeps its
  own all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import torchtp

from ._hf_checks import expected_local

TOL = {"rtol": 1e-9, "atol": 1e-11}  # float64: reordered sums of 16-32 terms only


class _Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))  # (n, H)


def _combine(flat: torch.Tensor, logits: torch.Tensor, experts: nn.ModuleList, k: int
             ) -> torch.Tensor:
    """The weighted sum of each token's top-``k`` experts: ``(N, H)``."""
    weights, index = logits.softmax(-1).topk(k, -1)  # (N, k)
    out = torch.zeros_like(flat)
    for e, expert in enumerate(experts):
        token, slot = (index == e).nonzero(as_tuple=True)
        if token.numel():  # the same on every rank: routing is replicated
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
    return out


class HandMoE(nn.Module):
    """The combine written inline; its sum feeds ``out``."""

    def __init__(self, hidden: int = 16, inter: int = 32, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, hidden), nn.Linear(hidden, 8)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(hidden, inter) for _ in range(experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.inp(x).reshape(-1, self.router.in_features)  # (N, H)
        out = _combine(flat, self.router(flat), self.experts, self.k)
        return self.out(out.reshape(*x.shape[:-1], -1))


class _AddAuxiliaryLoss(torch.autograd.Function):
    """DeepSeek's trick: ``x`` unchanged in forward, gradient 1 for ``loss`` in backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=grad.dtype)  # type: ignore[attr-defined]


class MoELayer(nn.Module):
    """Routed experts plus a shared expert. ``aux``: also return the router logits;
    ``"kept"``: keep a load-balancing loss on the module (fairseq's ``self.l_aux``);
    ``"attached"``: attach it to the output (DeepSeek's ``AddAuxiliaryLoss``)."""

    def __init__(self, hidden: int, inter: int, experts: int, k: int,
                 aux: bool | str) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(hidden, inter) for _ in range(experts))
        self.shared = _Expert(hidden, inter)
        self.k, self.aux = k, aux

    def forward(self, h: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        flat = h.reshape(-1, h.shape[-1])  # (N, H)
        logits = self.router(flat)  # (N, E)
        out = (_combine(flat, logits, self.experts, self.k) + self.shared(flat)).view_as(h)
        balance = logits.softmax(-1).mean(0).square().sum()  # a load-balancing-style term
        if self.aux == "kept":
            self.l_aux = balance
        elif self.aux == "attached":
            out = _AddAuxiliaryLoss.apply(out, balance)
        return (out, logits) if self.aux is True else out


class HandMoEBlock(nn.Module):
    """``h + moe(h)`` between two Linears; ``aux``: the loss also reads the router logits."""

    def __init__(self, hidden: int = 16, inter: int = 32, experts: int = 4, k: int = 2,
                 aux: bool | str = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, hidden), nn.Linear(hidden, 8)
        self.moe = MoELayer(hidden, inter, experts, k, aux)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # (B, T, H)
        moe = self.moe(h)
        if isinstance(moe, tuple):
            routed, logits = moe
            aux = logits.softmax(-1).mean(0).square().sum()  # a load-balancing-style term
            return self.out(h + routed) + aux
        return self.out(h + moe)


MODELS = {"inline": HandMoE, "block": HandMoEBlock,
          "aux": lambda: HandMoEBlock(aux=True),
          "kept": lambda: HandMoEBlock(aux="kept"),
          "attached": lambda: HandMoEBlock(aux="attached"),
          # 16 experts, top-1: the probe's 8 tokens leave some experts uncalled.
          "sparse": lambda: HandMoEBlock(experts=16, k=1)}


def _loss(model: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """The training loss: the outputs' squares, plus a loss a module kept (``l_aux``)."""
    kept = [m.l_aux for m in model.modules() if isinstance(getattr(m, "l_aux", None),
                                                           torch.Tensor)]
    return out.square().sum() + sum(kept, torch.zeros((), dtype=out.dtype))


def check_hand_moe(rank: int, world_size: int, kind: str) -> dict[str, object]:
    """The automatic plan on a hand-written MoE against one process, two SGD steps.

    Returns the plan's styles and reasons, and the forward's and backward's
    collective counts.
    """
    torch.manual_seed(0)
    ref = MODELS[kind]().double()
    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(MODELS[kind]().double())
    counts = _two_sgd_steps(wrapped, ref)
    plan = wrapped.resolved_plan
    return {"styles": {n: s.name for n, s in plan.assignments.items()}, "why": dict(plan.why),
            "notes": list(plan.notes), "counts": counts}


def _two_sgd_steps(wrapped: torchtp.DistributedModelWrapper, ref: nn.Module
                   ) -> list[tuple[dict[str, int], dict[str, int]]]:
    """Two SGD steps of both models on the same batch: outputs and every gradient compared
    each step; the forward's and the backward's collective counts."""
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    counts = []
    for _ in range(2):
        with torchtp.count_collectives() as fwd:
            got = wrapped(x)
        want = ref(x)
        torch.testing.assert_close(got, want, **TOL)
        with torchtp.count_collectives() as bwd:
            _loss(wrapped.base_model, got).backward()
        _loss(ref, want).backward()
        check_grads(wrapped, ref)
        counts.append((dict(fwd.counts), dict(bwd.counts)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return counts


def check_grads(wrapped: torchtp.DistributedModelWrapper, ref: nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in wrapped.base_model.named_parameters():
        module = wrapped.base_model.get_submodule(name.rpartition(".")[0])
        want = ref_params[name].grad
        if not p.numel():  # an expert another rank holds (expert_parallel): nothing here
            continue
        assert (p.grad is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(p.grad, expected_local(module, name.rpartition(".")[2],
                                                              want), **TOL, msg=name)


def check_lora_on_partial(rank: int, world_size: int) -> list[str]:
    """LoRA on every ``rowwise_partial`` expert (its terms are partial sums too) against
    unsharded LoRA from the same seeds: outputs after two AdamW steps of the adapters."""
    from peft import LoraConfig, get_peft_model

    def lora() -> LoraConfig:  # a non-zero B after the first step changes the outputs
        return LoraConfig(r=2, target_modules=["down"], init_lora_weights="gaussian")

    torch.manual_seed(0)
    ref_base = HandMoEBlock().double()
    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(HandMoEBlock().double())
    torch.manual_seed(5)
    ref = get_peft_model(ref_base, lora())
    torch.manual_seed(5)
    model = get_peft_model(wrapped.base_model, lora())
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (ref, model)]
    for _ in range(2):
        torch.testing.assert_close(model(x), ref(x), **TOL)
        for m, opt in zip((ref, model), opts, strict=True):
            _loss(m, m(x)).backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(model(x), ref(x), **TOL)
    return sorted(n for n, s in wrapped.resolved_plan.assignments.items()
                  if s.name == "rowwise_partial")


def check_hand_moe_ep(rank: int, world_size: int, kind: str,
                      ep: bool | int = True) -> dict[str, object]:
    """``expert_parallel=ep`` on a hand-written MoE: experts over blocks of ranks, against one
    process (outputs, every gradient, two SGD steps); the experts this rank holds."""
    torch.manual_seed(0)
    ref = MODELS[kind]().double()
    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(MODELS[kind]().double(), expert_parallel=ep)
    counts = [fwd for fwd, _ in _two_sgd_steps(wrapped, ref)]
    held = sorted({n.rsplit(".", 2)[0] for n, p in wrapped.base_model.named_parameters()
                   if "experts." in n and n.endswith("weight") and p.numel()})
    return {"held": held, "counts": counts,
            "styles": {n: s.name for n, s in wrapped.resolved_plan.assignments.items()}}


def check_hand_moe_ep_checkpoint(rank: int, world_size: int, out: str) -> list[str]:
    """``save_sharded`` of whole experts per rank, consolidated offline: every tensor equals
    the unwrapped model's, bit for bit (each expert written by the rank holding it)."""
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    from torchtp.checkpoint.offline import consolidate

    torch.manual_seed(0)
    ref = HandMoEBlock().double()
    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(HandMoEBlock().double(), expert_parallel=True)
    wrapped.save_sharded(os.path.join(out, "sharded"))
    dist.barrier()
    if rank != 0:
        return []
    consolidate(os.path.join(out, "sharded"), os.path.join(out, "whole"))
    saved = load_file(os.path.join(out, "whole", "model.safetensors"))
    want = ref.state_dict()
    assert sorted(saved) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(saved[name], tensor), name
    return sorted(saved)


def check_hand_route_mismatch(rank: int, world_size: int, ep: bool) -> tuple[str, float]:
    """Rank 1's router differs after wrapping: the forward raises on every rank, naming it."""
    import time

    from torchtp.core.errors import RankMismatchError

    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(HandMoEBlock().double(), expert_parallel=ep)
    if rank == 1:
        with torch.no_grad():
            wrapped.base_model.moe.router.weight.neg_()
    start = time.monotonic()
    try:
        with torch.no_grad():
            wrapped(torch.randn(2, 3, 8, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(1)))
    except RankMismatchError as err:
        return str(err), time.monotonic() - start
    raise AssertionError("different routes were not detected")


def check_hand_moe_compiled(rank: int, world_size: int, ep: bool) -> int:
    """``torch.compile`` (aot_eager: traced forward and backward) of a hand-written MoE
    whose experts are summed once, against the eager one-process model: two steps."""
    torch.manual_seed(0)
    ref = HandMoEBlock().double()
    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(HandMoEBlock().double(), expert_parallel=ep)
    compiled = torch.compile(wrapped, backend="aot_eager")
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        got, want = compiled(x), ref(x)
        torch.testing.assert_close(got, want, **TOL)
        got.square().sum().backward()
        want.square().sum().backward()
        check_grads(wrapped, ref)
        for p in [*wrapped.parameters(), *ref.parameters()]:
            p.grad = None
    return 2


def check_router_called_on_one_rank(rank: int, world_size: int) -> bool:
    """Rank 0 alone calls the router (logging routing statistics, say), then both run the
    model: the same collectives on every rank, and the outputs equal one process's."""
    torch.manual_seed(0)
    ref = HandMoEBlock().double()
    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(HandMoEBlock().double())
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if rank == 0:
        with torch.no_grad():
            wrapped.base_model.moe.router(torch.randn(4, 16, dtype=torch.float64))
    torch.testing.assert_close(wrapped(x), ref(x), **TOL)
    return True


def check_lora_on_router_refused(rank: int, world_size: int) -> list[str]:
    """LoRA beside a hook torchtp put on the base, which the LoRA branch would not pass:
    on the router (its output's gradient is summed over the group) and on the Linear that
    reads the inline MoE's partial sums (its input is all-reduced), each added after the
    wrap and carried by a wrapped ``PeftModel``. Every one refused; returns the messages
    (both silently wrong before: the branch's gradient, or its output, was this rank's)."""
    from peft import LoraConfig, get_peft_model

    out = []
    for model, target in ((HandMoEBlock, "router"), (HandMoE, "out")):
        torch.manual_seed(0)
        wrapped = torchtp.DistributedModelWrapper(model().double())
        out.append(_refusal(get_peft_model, wrapped.base_model,
                            LoraConfig(r=2, target_modules=[target])))
        out.append(_refusal(torchtp.DistributedModelWrapper, get_peft_model(
            model().double(), LoraConfig(r=2, target_modules=[target]))))
    return out


def _refusal(call: Any, *args: Any) -> str:
    """The message of the ValueError ``call(*args)`` raises (it must raise one)."""
    try:
        call(*args)
    except ValueError as err:
        return str(err)
    raise AssertionError("LoRA beside a reduction hook was built")
