"""One reduction enum serves the collectives, the shard dialect and slicing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from torchtp import shard
from torchtp.comm import reductions
from torchtp.comm.reductions import TORCH_OPS, Reduction, reduce_stack
from torchtp.slicing import ReduceOperation
from torchtp.slicing.types import reduction_of


def test_shard_dialect_and_slicing_name_the_same_reductions():
    assert shard.Reduction is Reduction
    assert reduction_of(ReduceOperation.MEAN) is Reduction.AVERAGE
    assert reduction_of(ReduceOperation.MAX) is Reduction.MAX
    assert reduction_of(ReduceOperation.CONCAT) is None
    # Plain strings look the torch op up too (the collectives pass "sum").
    assert TORCH_OPS["sum"] == dist.ReduceOp.SUM
    assert TORCH_OPS[Reduction.AVERAGE] == dist.ReduceOp.SUM  # callers divide
    assert not hasattr(__import__("torchtp.comm.ops", fromlist=["x"]), "REDUCE_OPS")


def test_parse_names_every_reduction_on_a_bad_value():
    with pytest.raises(ValueError, match=r"reduction='mean' is not supported; use one of sum, max, "
                                         r"min, product, average"):
        Reduction.parse("mean")
    assert Reduction.parse("product") is Reduction.PRODUCT


@pytest.mark.parametrize("red", list(Reduction))
def test_reduce_stack_matches_numpy_and_torch(red: Reduction):
    values = [np.arange(6).reshape(2, 3) + i for i in range(3)]
    expected = {"sum": np.sum, "max": np.max, "min": np.min, "product": np.prod,
                "average": np.mean}[red.value](np.stack(values), axis=0)
    np.testing.assert_array_equal(reduce_stack(values, red), expected)
    got = reduce_stack([torch.from_numpy(v) for v in values], red)
    # Integer averages are computed in float64, exactly as NumPy does.
    torch.testing.assert_close(got, torch.from_numpy(np.asarray(expected)), check_dtype=False)
    assert reductions.Reduction is red.__class__
