"""Small plain-PyTorch models built identically on every rank."""

from __future__ import annotations

import torch
from torch import nn


def mlp(hidden: int = 16, ffn: int = 64, bias: bool = True, seed: int = 0,
        dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """The guide's Linear -> ReLU -> Linear MLP, scaled down."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(hidden, ffn, bias=bias, dtype=dtype), nn.ReLU(),
                         nn.Linear(ffn, hidden, bias=bias, dtype=dtype))


def deep_mlp(seed: int = 0, bias: bool = True) -> nn.Sequential:
    """Two pairs, a dropout inside a pair, a nested block and an unpaired head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32, bias=bias), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16, bias=bias),
        nn.LayerNorm(16),
        nn.Sequential(nn.Linear(16, 48, bias=bias), nn.SiLU(), nn.Linear(48, 16, bias=bias)),
        nn.Linear(16, 8, bias=bias),
    )


def gather_param(model: nn.Module, name: str, param: torch.Tensor, world_size: int) -> torch.Tensor:
    """The full tensor behind a (possibly sharded) parameter of a wrapped model."""
    import torchtp

    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name)
    with torch.no_grad():
        if isinstance(module, torchtp.RowParallelLinear) and world_size > 1:
            return torchtp.all_gather(param.detach(), dim=0)
        if isinstance(module, torchtp.ColumnParallelLinear) and pname == "weight" and world_size > 1:
            return torchtp.all_gather(param.detach(), dim=1)
    return param.detach()
