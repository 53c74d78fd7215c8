"""Nothing of torchtp's outlives the process group it used (issue 35).

A group torchtp still held after ``dist.destroy_process_group()`` lived until
the interpreter shut down, where Gloo's worker aborted the process in about a
third of short jobs ("terminate called without an active exception"). The
groups are checked right after the destroy, with no garbage collection in
between, after wraps, forwards, backwards, optimizer steps, ``generate``, a
save, an MoE forward and a pipeline step. ``benchmarks/exit_loop.py`` counts
the exits themselves.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ._lifetime_checks import SCENARIOS, check_groups_freed


def test_every_group_is_freed_at_destroy(ranks, tmp_path):
    names = list(SCENARIOS)
    for alive in ranks(check_groups_freed, 2, str(tmp_path), names, init="none", timeout=300):
        assert list(alive) == names
        for name, held in alive.items():
            assert not held, f"{name}: still alive after destroy_process_group:\n" + \
                "\n".join(held)


def _use_after_destroy(rank: int, world_size: int) -> list[str]:
    import torchtp

    torch.manual_seed(0)
    model = torchtp.DistributedModelWrapper(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    # The input needs a gradient: the backward all-reduces it over the (destroyed) group.
    out = model(torch.randn(2, 8, requires_grad=True))
    dist.destroy_process_group()
    said = []
    layer = model.base_model[0]
    for call in (lambda: model(torch.randn(2, 8)), lambda: out.sum().backward(),
                 lambda: layer(torch.randn(2, 8, requires_grad=True))):
        with pytest.raises(torchtp.GroupDestroyedError, match="destroyed") as err:
            call()
        said.append(str(err.value))
    return said


def test_a_model_used_after_its_group_was_destroyed_raises(ranks):
    for said in ranks(_use_after_destroy, 2):
        assert "DistributedModelWrapper's group" in said[0] and "wrap the model again" in said[0]
        assert "backward" in said[1]
        assert said[2].startswith("RowParallelLinear(")  # the layer, with its sizes
