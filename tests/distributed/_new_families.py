"""Rank functions for the newer decoder families of issue 37 (split by heads, not replicated)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torchtp

from ._hf_checks import check_arch
from ._hf_models import build


def parameter_share(wrapped: torch.nn.Module, full: int) -> float:
    """The largest rank's parameter count over the unsharded model's."""
    mine = torch.tensor([sum(p.numel() for p in wrapped.parameters())], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine) / full


def check_family(rank: int, world_size: int, archs: list[str]) -> dict[str, dict]:
    """Logits, every gradient, two SGD steps and greedy generation equal one process's
    (:func:`check_arch`), plus the plan's source, its head norms and the parameter share."""
    out = {}
    for arch in archs:
        result = check_arch(rank, world_size, arch, 2)
        full = sum(p.numel() for p in build(arch).parameters())
        wrapped = torchtp.DistributedModelWrapper(build(arch))
        result["share"] = parameter_share(wrapped, full)
        result["head_norms"] = sorted(n for n, s in wrapped.resolved_plan.assignments.items()
                                      if getattr(s, "name", "") == "head_norm")
        result["describe"] = wrapped.describe_plan()
        out[arch] = result
    return out


def check_other_norm_kept_whole(rank: int, world_size: int) -> dict[str, str]:
    """A LayerNorm over all heads (mean subtracted: not the RMS norm ``head_norm`` computes)
    fails the plan probe: its attention stays whole, with the reason, and the logits are exact."""
    def with_layernorm() -> torch.nn.Module:
        model = build("olmo2")
        for layer in model.model.layers:
            torch.manual_seed(1)
            norm = torch.nn.LayerNorm(64, eps=1e-6)
            torch.nn.init.normal_(norm.weight)
            layer.self_attn.q_norm = norm
        return model

    ref, wrapped = with_layernorm(), torchtp.DistributedModelWrapper(with_layernorm())
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(wrapped(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)  # float32, the MLP's all-reduce order
    styles = {n: getattr(s, "name", "") for n, s in wrapped.resolved_plan.assignments.items()}
    return {"q_proj": styles.get("model.layers.0.self_attn.q_proj", "replicate"),
            "q_norm": styles.get("model.layers.0.self_attn.q_norm", "replicate"),
            "describe": wrapped.describe_plan()}
