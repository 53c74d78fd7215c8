"""The four ways to run the benchmark Llama tensor-parallel, built identically per rank.

Each builder takes a ``device`` and ``dtype`` (default: CPU, float32); every
variant is built on the CPU from the same seed and then moved, so the weights
agree across variants and ranks.
"""

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


def _placed(model: nn.Module, device: str, dtype: torch.dtype) -> nn.Module:
    return model.to(device=device, dtype=dtype)


def floor_model(rank: int, world: int, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Weights sliced in place; one ``dist.all_reduce`` per row-parallel output (inference only)."""
    model = _placed(build_llama(), device, dtype)
    for name, mod in list(model.named_modules()):
        style = next((s for p, s in HF_PLAN.items() if fnmatch.fnmatchcase(name, p)), None)
        if style == "colwise":
            n = mod.out_features // world
            mod.weight = nn.Parameter(mod.weight.detach()[rank * n:(rank + 1) * n].contiguous())
        elif style == "rowwise":
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _FloorRowwise(mod, rank, world))
    return model


def torchtp_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """torchtp's wrapper with the HF-style plan."""
    import torchtp

    return torchtp.DistributedModelWrapper(_placed(build_llama(), device, dtype), plan=HF_PLAN)


def dtensor_model(world: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """PyTorch ``parallelize_module`` with ColwiseParallel/RowwiseParallel on a mesh of ``device``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(torch.device(device).type, (world,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(_placed(build_llama(), device, dtype), mesh,
                              {p: styles[s]() for p, s in HF_PLAN.items()})


def hf_model(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' own TP: ``from_pretrained(tp_plan="auto")`` (raises if unsupported)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()


def build_all(rank: int, world: int, hf_path: str, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """Every variant that builds here, and why the others did not."""
    builders: dict[str, Any] = {
        "floor": lambda: floor_model(rank, world, device, dtype),
        "torchtp": lambda: torchtp_model(device, dtype),
        "dtensor": lambda: dtensor_model(world, device, dtype),
        "hf_tp_plan_auto": lambda: hf_model(hf_path, dtype)}
    models, failures = {}, {}
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < world:
        # transformers binds rank r to cuda:r; here the ranks share one GPU
        del builders["hf_tp_plan_auto"]
        failures["hf_tp_plan_auto"] = f"not run: {world} ranks share {torch.cuda.device_count()} GPU(s)"
    for name, build in builders.items():
        try:
            models[name] = build().eval()
        except Exception as err:  # report the peer's failure instead of aborting the run
            failures[name] = f"{type(err).__name__}: {err}"
        dist.barrier()
    return models, failures
