"""Bad input: clear errors on every rank, raised before any collective, no hang."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import torchtp
from torchtp import ColumnParallelLinear, DistributedModelWrapper, RowParallelLinear

from ._models import mlp

VALID_48 = r"valid world sizes: \[1, 2, 3, 4, 6, 8, 12, 16, 24, 48\]"


def test_more_ranks_than_out_features_names_layer_dim_value_size_and_valid_sizes():
    with pytest.raises(ValueError, match=(
            r"RowParallelLinear\(in_features=8, out_features=3\): out_features=3 cannot give "
            r"each of world_size=4 ranks at least one weight row; valid world sizes: "
            r"\[1, 2, 3\]$")):
        RowParallelLinear(8, 3, world_size=4, rank=0)


def test_more_ranks_than_in_features():
    with pytest.raises(ValueError, match=(
            r"ColumnParallelLinear\(in_features=2, out_features=8\): in_features=2 cannot give "
            r"each of world_size=4 ranks at least one weight column; valid world sizes: "
            r"\[1, 2\]$")):
        ColumnParallelLinear(2, 8, world_size=4, rank=0)


def test_rank_outside_world():
    with pytest.raises(ValueError, match=r"rank=4 is outside 0..3 for world_size=4"):
        RowParallelLinear(8, 8, world_size=4, rank=4)


def test_no_process_group_is_a_clear_runtime_error():
    col = ColumnParallelLinear(8, 8, world_size=2, rank=0)
    with pytest.raises(torchtp.MissingProcessGroupError,
                       match=r"world_size=2 ranks, but no process group.*torchrun --nproc-per-node 2"):
        col(torch.randn(3, 4))
    row = RowParallelLinear(8, 8, world_size=2, rank=0)
    with pytest.raises(torchtp.MissingProcessGroupError,
                       match=r"input gradient needs an all-reduce across world_size=2"):
        row(torch.randn(3, 8, requires_grad=True))
    gathered = RowParallelLinear(8, 8, world_size=2, rank=0, gather_output=True)
    with pytest.raises(RuntimeError, match="no process group is running"):
        gathered(torch.randn(3, 8))


def test_wrong_input_width_world_size_one():
    layer = ColumnParallelLinear(8, 4)
    with pytest.raises(ValueError, match=r"input last dimension must be 8, got 5 \(input shape \(2, 5\)\)"):
        layer(torch.randn(2, 5))


def test_wrapping_twice_raises():
    wrapped = DistributedModelWrapper(mlp(), world_size=2, rank=0)
    with pytest.raises(ValueError, match="already a DistributedModelWrapper"):
        DistributedModelWrapper(wrapped, world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"already tensor-parallel: '0' is a RowParallelLinear"):
        DistributedModelWrapper(wrapped.base_model, world_size=2, rank=0)


def test_unknown_style_lists_valid_ones():
    with pytest.raises(ValueError, match=(
            r"unknown plan style 'columnwise' for '0'; valid styles: colwise, "
            r"colwise_gather_output, colwise_rep, embedding_colwise, embedding_rowwise, "
            r"ep_dispatch_experts, keep_full_weight, local_params, mla_kv_a_proj, moe_tp_experts, "
            r"packed_colwise, "
            r"partial_grad_output, reduce_input, reduce_output, reduce_residual, replicate, "
            r"replicated_with_grad_allreduce, "
            r"rowwise, rowwise_partial, rowwise_rep, rowwise_split_input, sequence_parallel, "
            r"ssm_heads, unit_colwise, unit_rowwise$")):
        DistributedModelWrapper(mlp(), world_size=2, rank=0, plan={"0": "columnwise"})


def test_plan_style_on_a_non_linear_module():
    with pytest.raises(TypeError, match=(
            r"style 'colwise' for module '1' needs an nn.Linear \(or a transformers Conv1D\), "
            r"got ReLU")):
        DistributedModelWrapper(mlp(), world_size=2, rank=0, plan={"1": "colwise"})


def test_explicit_plan_with_more_ranks_than_rows():
    model = nn.Sequential(nn.Linear(16, 3), nn.ReLU(), nn.Linear(3, 16))
    with pytest.raises(ValueError, match=(
            r"Sequential: module '0' \(style 'colwise'\): out_features \(weight rows\)=3 "
            r"cannot give each of world_size=4 ranks at least one; valid world sizes for this "
            r"model: \[1, 2, 3\]; or mark the module 'replicate' in the plan")):
        DistributedModelWrapper(model, world_size=4, rank=0, plan={"0": "colwise"})


def _layer_errors(rank: int, world_size: int) -> float:
    col = ColumnParallelLinear(48, 8)
    with pytest.raises(ValueError, match=(
            rf"on rank {rank} of world_size={world_size}: input last dimension must be "
            rf"{48 // world_size}, got 48")):
        col(torch.randn(2, 48))  # the full input passed to a layer expecting its slice
    with pytest.raises(ValueError, match=(
            rf"world_size=4 does not match the process group size {world_size}.*"
            "world_size must match across all ranks")):
        RowParallelLinear(8, 8, world_size=4)
    with pytest.raises(ValueError, match=r"out_features=1 .* valid world sizes: \[1\]"):
        RowParallelLinear(8, 1)
    # The errors above were raised before any collective: ranks are still in step.
    return torchtp.all_reduce_sum(torch.ones(1)).item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_errors_are_raised_before_communicating(ranks, world_size):
    assert ranks(_layer_errors, world_size) == [float(world_size)] * world_size


def _wrapper_mismatch(rank: int, world_size: int, case: str) -> str:
    plan = {"0": "colwise", "2": "rowwise"}
    if case == "plan" and rank == 1:
        plan = {"0": "colwise_gather_output"}
    kwargs = {"world_size": 4} if case == "world_size" and rank == 1 else {}
    bad_model = case == "shape" and rank == 1
    model = mlp(ffn=32 if bad_model else 64)
    try:
        DistributedModelWrapper(model, plan=plan, **kwargs)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("case,pattern", [
    ("plan", r"RankMismatchError: DistributedModelWrapper: plan must match across all ranks: "
             r"rank 0: \{'0': 'colwise', '2': 'rowwise'\}, rank 1: \{'0': 'colwise_gather_output'\}"),
    ("world_size", r"ValueError: .*world_size=4 does not match the process group size 2"),
    ("shape", r"RankMismatchError: .*layer '0' must match across all ranks: "
              r"rank 0: \('colwise', \(64, 16\)\), rank 1: \('colwise', \(32, 16\)\)"),
])
def test_wrapper_disagreement_raises_on_every_rank(ranks, case, pattern):
    messages = ranks(_wrapper_mismatch, 2, case, timeout=60)
    for msg in messages:
        assert re.search(pattern, msg), msg


def _one_rank_raises_before_forward(rank: int, world_size: int) -> None:
    wrapped = DistributedModelWrapper(mlp())
    if rank == 1:
        raise RuntimeError("rank 1 failed while preparing its batch")
    wrapped(torch.randn(2, 16))  # rank 0 waits in the all-reduce for rank 1


def test_one_rank_raising_before_a_collective_does_not_hang(ranks):
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed at.*preparing its batch"):
        ranks(_one_rank_raises_before_forward, 2, timeout=60, gloo_timeout=5)


def test_unpicklable_module_types_are_not_needed_for_errors():
    # Validation errors carry only strings across ranks, so any model works.
    # (16 wide: at 4 the automatic plan's cost guard keeps such a pair whole.)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model.anything = lambda x: x
    assert DistributedModelWrapper(model, world_size=2, rank=0).parallelized_layers == ["0", "2"]


def _plan_file_on_rank_0_only(rank: int, world_size: int, directory: str) -> str:
    # Multi-node launches often have a file on one node only: the rank that cannot
    # read it must not leave the others waiting in the wrapper's agreement.
    path = f"{directory}/plan_rank{rank}.json"
    if rank == 0:
        with open(path, "w") as f:
            f.write('{"0": "colwise", "2": "rowwise"}')
    try:
        DistributedModelWrapper(mlp(), plan=path)
    except (OSError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_plan_file_missing_on_one_rank_raises_on_every_rank(ranks, tmp_path):
    messages = ranks(_plan_file_on_rank_0_only, 2, str(tmp_path), timeout=60, gloo_timeout=5)
    assert re.search(r"FileNotFoundError: DistributedModelWrapper failed on rank 1 .*"
                     r"plan file .*plan_rank1.json does not exist", messages[0]), messages[0]
    assert re.match(r"FileNotFoundError: plan file .*plan_rank1.json does not exist",
                    messages[1]), messages[1]


def _local_exception_class(rank: int, world_size: int) -> str:
    class PluginError(ValueError):  # defined in a function: it cannot be pickled
        pass

    def broken(*args: object) -> None:
        raise PluginError("a plan plugin failed on rank 1")

    plan = {"0": torchtp.plans.Colwise(), "2": torchtp.plans.Rowwise()}
    if rank == 1:
        plan["0"].plan = broken  # fails during planning, on this rank only
    try:
        DistributedModelWrapper(mlp(), plan=plan)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_rank_local_error_of_an_unpicklable_class_still_raises_everywhere(ranks):
    got = ranks(_local_exception_class, 2, timeout=60)
    assert got[1] == "PluginError: a plan plugin failed on rank 1"
    assert got[0].startswith("RuntimeError: DistributedModelWrapper failed on rank 1")
