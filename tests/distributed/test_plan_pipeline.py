"""The planning pipeline: one resolve_plan, one style contract, no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import torchtp
from torchtp.plans import Colwise, ShardContext, resolve_plan
from torchtp.plans.styles import LayerPlan

from ._hf_models import build

SRC = Path(__file__).resolve().parents[2] / "src" / "distributed"


def test_head_upgrades_are_visible_in_describe_plan():
    # HF's plan says "colwise" for q/k/v; the pipeline splits whole (KV) heads
    # and says so for every projection, with the collectives per forward.
    llama = torchtp.DistributedModelWrapper(build("llama"), world_size=2, rank=0)
    text = llama.describe_plan()
    k_row = next(line for line in text.splitlines()
                 if line.strip().startswith("model.layers.*.self_attn.k_proj (x2)"))
    assert "16x64 -> 8x64" in k_row
    assert "whole heads of attention 'model.layers.*.self_attn' (8 heads, 2 KV heads" in k_row
    assert "2 num_key_value_heads (key/value heads)" in k_row
    # Its lm_head and embed_tokens rules are overruled by cost (vocabulary 128: kept whole).
    assert "collectives per forward: 4 x all_reduce" in text
    assert llama.resolved_plan.collectives() == {"all_reduce": 4}


def test_each_style_plans_its_module_once_then_applies_that_plan():
    torch.manual_seed(0)
    linear = nn.Linear(8, 6)
    ctx = ShardContext(world_size=2, rank=1, group=None)
    layer = Colwise().plan(linear, "fc", ctx)
    assert isinstance(layer, LayerPlan)
    assert (layer.style, layer.full, layer.local) == ("colwise", (6, 8), (3, 8))
    assert layer.layouts["weight"].segments == ((3, 3),)
    swapped = Colwise().apply(linear, layer, ctx)
    torch.testing.assert_close(swapped.weight, linear.weight[3:])  # rank 1's rows, exact copy
    torch.testing.assert_close(swapped.bias, linear.bias[3:])
    at_four = Colwise().plan(linear, "fc", ShardContext(4, 3, None))  # 6 rows: 2/2/1/1
    assert at_four.fits(4) and at_four.local == (1, 8)
    at_seven = Colwise().plan(linear, "fc", ShardContext(7, 0, None))
    assert not at_seven.fits(7) and at_seven.layouts == {} and at_seven.local == ()


def test_resolve_plan_collects_problems_when_not_strict():
    model = nn.Sequential(nn.ReLU(), nn.Linear(8, 6))
    ctx = ShardContext(4, 0, None)
    plan = {"0": "colwise", "1": "colwise"}
    with pytest.raises(TypeError, match=r"plan style 'colwise' for module '0' needs an nn.Linear"):
        resolve_plan(model, plan, ctx)
    lenient = resolve_plan(model, plan, ctx, strict=False)
    assert [type(e) for e in lenient.problems] == [TypeError]
    assert lenient.valid_world_sizes == [1, 2, 3, 4, 5, 6]  # out_features=6 of module '1'


def _imports(path: Path) -> set[str]:
    """Names of torchtp modules ``path`` imports at module level (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(SRC).parent.parts
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            found.add(".".join((*base, node.module or "")).strip("."))
    return found


def test_checkpoint_loading_does_not_import_the_wrapper():
    # The wrapper imports checkpoint.load; the reverse would be an import circle.
    for path in (SRC / "checkpoint").glob("*.py"):
        assert "wrap.wrapper" not in _imports(path), path.name
        assert "from ..wrap" not in path.read_text(), path.name
    assert "checkpoint.load" in _imports(SRC / "wrap/wrapper.py")
