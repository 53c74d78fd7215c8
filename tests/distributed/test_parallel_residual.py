"""Parallel-residual layers reduce both branches once (``reduce_residual``), exactly."""

from __future__ import annotations

import pytest
import torch

from ._parallel_residual import check_parallel_residual

PARTS = ["layers.0.attention.wo", "layers.0.feed_forward.w2",
         "layers.1.attention.wo", "layers.1.feed_forward.w2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each kind at tp 2, and the plain one at tp 3 (two of the 6 heads per rank); every run
    checks outputs, gradients and two SGD steps."""
    from .harness import run_ranks

    cases = [("parallel", 2), ("dropout", 2), ("scaled", 2), ("gated", 2),
             ("residual_dropout", 2), ("parallel", 3)]
    return {(kind, tp): run_ranks(check_parallel_residual, tp, kind, timeout=180,
                                  tmp_path=tmp_path_factory.mktemp(f"{kind}{tp}"))
            for kind, tp in cases}


@pytest.mark.parametrize("tp", [2, 3])
def test_one_all_reduce_per_parallel_residual_layer(runs, tp):
    out = runs[("parallel", tp)][0]
    assert {out["styles"][n] for n in PARTS} == {"rowwise_partial"}
    assert out["styles"]["layers.0"] == out["styles"]["layers.1"] == "reduce_residual"
    assert "less its input (the residual)" in out["why"]["layers.0"]
    for fwd in out["counts"]:
        assert fwd == {"all_reduce": 2}, fwd  # one per layer; embedding and head kept whole


def test_dropout_on_the_partial_sums_is_exact(runs):
    out = runs[("dropout", 2)][0]  # the checks compared outputs and gradients with dropout on
    assert out["styles"]["layers.0"] == "reduce_residual"


@pytest.mark.parametrize("kind, why", [
    # 0.5 * x + branches: summing out - x over the ranks would count -0.5 * x tp times.
    ("scaled", "MulBackward0 lies between its input and its output"),
    # sigmoid(x) * branches: exact forward, but x's gradient would keep sigmoid'(x) * part.
    ("gated", "its input is read 2 times on the way to its output"),
    # dropout(x) + branches: a plain residual in eval mode, not in training mode.
    ("residual_dropout", "lies between its input and its output (the residual must only be "
                         "added to) (in training mode)"),
])
def test_a_layer_whose_output_less_input_depends_on_the_input_keeps_both_all_reduces(
        runs, kind, why):
    out = runs[(kind, 2)][0]  # the checks compared outputs and gradients: still exact
    assert "layers.0" not in out["styles"]
    assert {out["styles"][n] for n in PARTS} == {"rowwise"}
    assert any("keep one all-reduce each" in n and "'layers.0'" in n and why in n
               for n in out["notes"]), out["notes"]
    for fwd in out["counts"]:
        assert fwd == {"all_reduce": 4}, fwd


def test_sequence_parallelism_refuses_a_partial_output_projection():
    # Planning only (world_size=2, rank=0, no group): refused before any weight changes.
    import torchtp

    from ._hf_models import build

    plan = {f"model.layers.*.{n}": style for n, style in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
        ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise_partial"),
        ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"))}
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj' is 'rowwise_partial' "
                                         r".* no sequence-parallel form; pass plan="):
        torchtp.DistributedModelWrapper(build("llama"), world_size=2, rank=0, plan=plan,
                                        sequence_parallel=True)


def test_a_half_precision_residual_layer_keeps_one_all_reduce_per_branch():
    # In bfloat16 each rank's x + part rounds the residual: tp roundings instead of one.
    import torchtp

    from ._parallel_residual import ParallelNet

    torch.manual_seed(0)
    wrapped = torchtp.DistributedModelWrapper(ParallelNet().to(torch.bfloat16), world_size=2,
                                              rank=0)
    plan = wrapped.resolved_plan
    assert "layers.0" not in plan.assignments
    assert plan.collectives() == {"all_reduce": 4}
    assert any("once at 'layers.0' is not done in bfloat16" in n and "2 roundings" in n
               for n in plan.notes), plan.notes


@pytest.mark.parametrize("layer, why", [
    (lambda x, p: x + p, None),
    (lambda x, p: (x + p) + p, None),
    (lambda x, p: x + x + p, "its input is read 2 times"),
    (lambda x, p: x + torch.sigmoid(x) * p, "its input is read 2 times"),
    (lambda x, p: 0.5 * x + p, "MulBackward0 lies between its input and its output"),
    (lambda x, p: torch.add(x, p, alpha=2), "AddBackward0 lies between"),
])
def test_the_residual_path_rule(layer, why):
    # out - x must not depend on x: read once, by a plain addition, only additions after it.
    from torchtp.plans.residual_path import path_problem

    x, p = (torch.randn(3, requires_grad=True) * 1 for _ in range(2))  # non-leaf nodes
    problem = path_problem(layer(x, p).grad_fn, x.grad_fn, {id(p.grad_fn)})
    assert problem is None if why is None else why in problem, problem


def test_reduce_residual_on_a_module_without_a_tensor_output_raises_on_every_rank(ranks):
    from ._parallel_residual import check_reduce_residual_needs_a_tensor

    for msg in ranks(check_reduce_residual_needs_a_tensor, 2):
        assert msg.startswith("module '0' (style 'reduce_residual', world_size=2) needs a tensor "
                              "input"), msg
        assert "got dict. Plan its output projections 'rowwise'" in msg, msg


def test_fused_layers_save_and_resume_exactly_at_uneven_tp(ranks, tmp_path):
    from ._parallel_residual import check_fused_checkpoints

    for fused in ranks(check_fused_checkpoints, 3, str(tmp_path), timeout=240):
        assert fused == ["gpt_neox.layers.0", "gpt_neox.layers.1"]
