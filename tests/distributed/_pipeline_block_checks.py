"""Rank functions: ``nn.Sequential`` and a torchtitan-style chain of blocks as pipeline
stages (``block_stage``), against one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtp.pipeline import PipelineSchedule, block_stage

from ._pipeline_checks import TOL, VOCAB, batch

ROWS, FEATURES, CLASSES = 8, 16, 5


def build_sequential() -> nn.Sequential:
    """Six blocks (Linear + Tanh pairs and a head), float64, the same on every rank."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(5):
        blocks += [nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())]
    return nn.Sequential(*blocks, nn.Linear(FEATURES, CLASSES)).double()


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))  # (B, T, H)


class TitanLM(nn.Module):
    """A torchtitan-style LM: embeddings, a ModuleDict of blocks, norm, output head."""

    def __init__(self, layers: int = 4, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleDict({str(i): _Block(dim) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, H); hidden states on later stages
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))  # (B, T, V)


def _summed_ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="sum")


def check_block_stages(rank: int, world_size: int) -> list[Any]:
    """An ``nn.Sequential`` classifier (a user loss, a mean over rows) under GPipe and a
    torchtitan-style LM (the default causal-LM loss) under 1F1B: the loss and every
    gradient equal to one process's."""
    ref, seq = build_sequential(), build_sequential()
    stage = block_stage(seq, rank, world_size)
    x = torch.randn(ROWS, FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, CLASSES, (ROWS,), generator=torch.Generator().manual_seed(2))
    loss = PipelineSchedule(stage, 4, "gpipe", loss_fn=_summed_ce).step(x, y)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    _compare(stage, ref, loss, ref_loss)
    ref_lm, lm = TitanLM(), TitanLM()
    titan = block_stage(lm, rank, world_size, blocks="layers", first=["tok_embeddings"],
                        last=["norm", "output"])
    loss = PipelineSchedule(titan, 4, "1f1b").step(*batch(0))
    ids, labels = batch(0)
    ref_loss = F.cross_entropy(ref_lm(ids)[:, :-1].reshape(-1, VOCAB),  # as HF's: shifted
                               labels[:, 1:].reshape(-1), ignore_index=-100)
    ref_loss.backward()
    _compare(titan, ref_lm, loss, ref_loss)
    return [list(stage.layers), list(titan.layers),
            sorted(n for n, _ in titan.model.named_parameters())]


def _compare(stage: Any, ref: nn.Module, loss: torch.Tensor | None,
             ref_loss: torch.Tensor) -> None:
    if stage.is_last:
        assert loss is not None
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    want = dict(ref.named_parameters())
    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, **TOL, msg=name)
