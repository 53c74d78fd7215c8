"""The four ways to run the benchmark Llama tensor-parallel, built identically per rank."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _llama import HF_PLAN, build_llama


class _FloorRowwise(nn.Module):
    """Hand-written floor for a weight-column split: local matmul, one in-place all-reduce."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        n = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].contiguous())
        self.bias = linear.bias  # Llama has none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (B, T, out), partial sum
        dist.all_reduce(y)
        return y


def floor_model(rank: int, world: int) -> nn.Module:
    """Weights sliced in place; one ``dist.all_reduce`` per row-parallel output (inference only)."""
    model = build_llama()
    for name, mod in list(model.named_modules()):
        style = next((s for p, s in HF_PLAN.items() if fnmatch.fnmatchcase(name, p)), None)
        if style == "colwise":
            n = mod.out_features // world
            mod.weight = nn.Parameter(mod.weight.detach()[rank * n:(rank + 1) * n].contiguous())
        elif style == "rowwise":
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _FloorRowwise(mod, rank, world))
    return model


def torchtp_model() -> nn.Module:
    """torchtp's wrapper with the HF-style plan."""
    import torchtp

    return torchtp.DistributedModelWrapper(build_llama(), plan=HF_PLAN)


def dtensor_model(world: int) -> nn.Module:
    """PyTorch ``parallelize_module`` with ColwiseParallel/RowwiseParallel on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(build_llama(), mesh, {p: styles[s]() for p, s in HF_PLAN.items()})


def hf_model(path: str) -> nn.Module:
    """transformers' own TP: ``from_pretrained(tp_plan="auto")`` (raises if unsupported)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()


def build_all(rank: int, world: int, hf_path: str) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """Every variant that builds here, and why the others did not."""
    builders: dict[str, Any] = {
        "floor": lambda: floor_model(rank, world), "torchtp": torchtp_model,
        "dtensor": lambda: dtensor_model(world), "hf_tp_plan_auto": lambda: hf_model(hf_path)}
    models, failures = {}, {}
    for name, build in builders.items():
        try:
            models[name] = build().eval()
        except Exception as err:  # report the peer's failure instead of aborting the run
            failures[name] = f"{type(err).__name__}: {err}"
        dist.barrier()
    return models, failures
