"""Models and hand-written plans for the plan-by-cost checks (issue 24), and the rank side.

* :class:`PatchViT` - timm's VisionTransformer with a Linear patch projection
  (4x4x3 pixels: 48 -> 64), a class token, two blocks, a 10-class head. The
  hand-written plan splits the blocks and keeps ``patch`` and ``head`` whole.
* Phi-3 (2 layers) - fused ``qkv_proj`` / ``gate_up_proj`` split part by part,
  the LM head split and gathered (what the issue names as the better plan).
* Falcon, new decoder architecture (2 layers, 8 heads in 4 KV groups, head
  untied) - ``query_key_value`` split by whole KV groups, the LM head gathered.

:func:`compare` wraps each model with no plan and with its hand-written plan,
checks outputs and every gradient against the unsharded model, and counts
collectives and their bytes per forward and per backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torchtp

from ._handwritten import TimmBlock
from ._hf_checks import GRADS, compare_params
from ._hf_models import VOCAB
from ._hf_models import build as build_hf


class PatchViT(nn.Module):
    """A ViT on 16 flattened 4x4 RGB patches: ``(B, 16, 48) -> (B, 10)``."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Linear(48, 64)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 64) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, 64) * 0.02)
        self.blocks = nn.Sequential(TimmBlock(64, 4), TimmBlock(64, 4))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x)  # (B, 16, 64)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])  # (B, classes): the class token


VIT_EXAMPLE = (torch.zeros(2, 16, 48),)
HAND = {
    "vit": {"blocks.*.attn.qkv": "packed_colwise", "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"},
    "phi3": {"model.layers.*.self_attn.qkv_proj": "packed_colwise",
             "model.layers.*.self_attn.o_proj": "rowwise",
             "model.layers.*.mlp.gate_up_proj": "packed_colwise",
             "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather_output"},
    "falcon": {"transformer.h.*.self_attention.query_key_value": "colwise",
               "transformer.h.*.self_attention.dense": "rowwise",
               "transformer.h.*.mlp.dense_h_to_4h": "colwise",
               "transformer.h.*.mlp.dense_4h_to_h": "rowwise", "lm_head": "colwise_gather_output"},
}
MODELS = tuple(HAND)


def build(kind: str, **overrides: object) -> nn.Module:
    """A fresh ``kind`` model under seed 0 (the same weights on every rank), fp32."""
    if kind == "vit":
        torch.manual_seed(0)
        return PatchViT(**overrides)  # type: ignore[arg-type]
    if kind == "falcon":
        return build_hf("falcon-new", tie_word_embeddings=False, **overrides)
    return build_hf(kind, **overrides)


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (the same on every rank)."""
    gen = torch.Generator().manual_seed(3)
    if kind == "vit":
        return torch.randn(2, 16, 48, generator=gen), torch.randint(0, 10, (2,), generator=gen)
    ids = torch.randint(3, VOCAB, (2, 9), generator=gen)
    return ids, torch.roll(ids, -1, dims=1)


def loss_of(kind: str, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
    x, target = data
    if kind == "vit":
        return F.cross_entropy(model(x), target)
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), target.flatten())


def wrap(kind: str, plan: object = None, **kw: Any) -> torchtp.DistributedModelWrapper:
    """``kind`` wrapped over the default group (the ViT with its probe inputs)."""
    example = VIT_EXAMPLE if kind == "vit" else None
    return torchtp.DistributedModelWrapper(build(kind), plan=plan, example_inputs=example, **kw)


def _traffic(counter: torchtp.comm.ops.CollectiveCounter) -> dict[str, int]:
    """Calls per op, and the bytes of the tensors handed to the collectives."""
    out: dict[str, int] = dict(counter.counts)
    out["bytes"] = sum(torch.Size(r.shape).numel() * r.dtype.itemsize for r in counter.records)
    return out


def _step(kind: str, model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]
          ) -> tuple[dict[str, int], dict[str, int]]:
    with torchtp.count_collectives() as fwd:
        loss = loss_of(kind, model, data)
    with torchtp.count_collectives() as bwd:
        loss.backward()
    return _traffic(fwd), _traffic(bwd)


def compare(rank: int, world_size: int, kinds: tuple[str, ...] = MODELS) -> dict[str, dict]:
    """Per model: torchtp's choice and the hand-written plan, each exact against one process."""
    out: dict[str, dict] = {}
    for kind in kinds:
        data = batch(kind)
        ref = build(kind)
        loss_of(kind, ref, data).backward()
        got: dict[str, Any] = {}
        for name, plan in (("torchtp", None), ("hand", HAND[kind])):
            model = wrap(kind, plan)
            fwd, bwd = _step(kind, model, data)
            compare_params(model, ref, grads=True)  # every gradient, this rank's part
            got[name] = {"forward": fwd, "backward": bwd, "source": model.resolved_plan.source,
                         "rules": dict(model.resolved_plan.rules)}
        with torch.no_grad():  # outputs once more, outside training: the same numbers
            want = loss_of(kind, ref, data)
            torch.testing.assert_close(loss_of(kind, wrap(kind), data), want, **GRADS)
        out[kind] = got
    return out
