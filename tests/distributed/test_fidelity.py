"""Swaps never drop what a module subclass adds in its forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchtp


class LoraLinear(nn.Linear):
    """A Linear with a low-rank adapter added in forward (what PEFT does)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.lora = nn.Parameter(torch.ones(n_out, n_in) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora.t()


class SameMathLinear(nn.Linear):
    """Overrides forward but computes the plain linear map (like FalconLinear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


class Float32OutLinear(nn.Linear):
    """Computes the linear map in float32 whatever its inputs' dtype (transformers 5.25's
    Ergo lm_head and router)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight.float(), self.bias.float())


class ShiftedEmbedding(nn.Embedding):
    """Adds a constant after the lookup: partial lookups do not sum to it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + 1.0


class ScaledEmbedding(nn.Embedding):
    """Scales the lookup (Gemma): commutes with a vocabulary split."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 3.0


def test_linear_subclass_with_extra_forward_is_refused():
    # A plan that splits it is refused; the automatic plan keeps it whole, saying why, and
    # plans the rest (decision 172).
    model = nn.Sequential(LoraLinear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(ValueError, match=(
            r"module '0' \(LoraLinear\) overrides forward and does not compute a plain linear "
            r"map, so style 'colwise' would drop its extra behaviour")):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0,
                                        plan={"0": "colwise", "2": "rowwise"})
    auto = torchtp.DistributedModelWrapper(
        nn.Sequential(LoraLinear(8, 16), nn.ReLU(), nn.Linear(16, 8)), world_size=2, rank=0)
    assert auto.resolved_plan.rules["0"] == "replicate"
    assert "kept whole: module '0' (LoraLinear) overrides forward and does not compute a " \
           "plain linear map" in auto.describe_plan()


def test_linear_subclass_with_another_output_dtype_is_refused():
    # Not a dtype error from the comparison: the refusal, naming both dtypes.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Float32OutLinear(16, 8)).double()
    with pytest.raises(ValueError, match=(
            r"module '2' \(Float32OutLinear\) overrides forward and does not compute a plain "
            r"linear map \(its output is torch.float32 where the plain map's is torch.float64\), "
            r"so style 'rowwise' would drop its extra behaviour")):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0,
                                        plan={"0": "colwise", "2": "rowwise"})


def test_linear_subclass_with_plain_math_is_swapped():
    model = nn.Sequential(SameMathLinear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    wrapped = torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
    assert wrapped.parallelized_layers == ["0", "2"]


def test_embedding_subclass_that_does_not_commute_is_refused():
    model = nn.Sequential(ShiftedEmbedding(16, 8))
    with pytest.raises(ValueError, match=(
            r"'embedding_rowwise' for module '0' \(ShiftedEmbedding\): its forward adds work "
            r"that does not commute with splitting the vocabulary")):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0, plan={"0": "embedding_rowwise"})


def _scaled(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    ref = ScaledEmbedding(10, 4, padding_idx=7)  # 10 rows over 4 ranks: uneven 3/3/2/2
    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(nn.Sequential(ScaledEmbedding(10, 4, padding_idx=7)),
                                              plan={"0": "embedding_rowwise"})
    emb = wrapped.base_model[0]
    # Its own class's forward (the scale) runs inside the vocabulary split.
    assert isinstance(emb, ScaledEmbedding) and isinstance(emb, torchtp.layers.VocabSplit)
    assert type(emb).__name__ == "VocabParallelScaledEmbedding"
    ids = torch.tensor([[0, 3, 7, 9], [5, 5, 1, 2]])
    out = wrapped(ids)
    torch.testing.assert_close(out, ref(ids))
    out.square().sum().backward()
    ref(ids).square().sum().backward()
    layout = torchtp.layouts_of(emb)["weight"]
    torch.testing.assert_close(emb.weight.grad, layout.take(ref.weight.grad))
    return [wrapped.parallelized_layers, list(layout.segments)]


def test_embedding_subclass_that_commutes_is_split_in_place(ranks):
    # The module keeps its own forward (the scale) and is split in place (same object).
    got = ranks(_scaled, 4)
    assert [g[0] for g in got] == [["0"]] * 4
    assert [g[1] for g in got] == [[(0, 3)], [(3, 3)], [(6, 2)], [(8, 2)]]
