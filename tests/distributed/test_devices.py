"""Device defaults follow the process group; a model the group cannot communicate is refused.

There is no GPU here: selection logic is tested on the CPU by pointing the
recorded config (or ``torch.cuda.is_available``) at CUDA, never by mocking a
collective. The NCCL runs themselves are the GPU checklist in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchtp
from torchtp import DistributedModelWrapper
from torchtp.comm import runtime
from torchtp.comm.devices import backend_devices, default_device
from torchtp.comm.runtime import TensorParallelConfig

from ._models import mlp


@pytest.fixture
def nccl_config(monkeypatch: pytest.MonkeyPatch) -> TensorParallelConfig:
    """The config init_tensor_parallel records for rank 0 under NCCL (no group started)."""
    config = TensorParallelConfig(backend="nccl", device=torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "_CONFIG", config)
    return config


def test_default_device_is_the_configs_and_an_explicit_device_wins(nccl_config):
    assert default_device() == torch.device("cuda", 0)
    assert default_device("cpu") == torch.device("cpu")
    assert default_device(torch.device("meta")) == torch.device("meta")


def test_default_device_is_the_cpu_without_a_group():
    assert default_device() == torch.device("cpu")


def test_layers_built_with_device_none_use_the_configs_device(nccl_config):
    # meta: an explicit device wins (and allocates nothing)
    layer = torchtp.ColumnParallelLinear(8, 4, device="meta")
    assert layer.weight.device.type == "meta"
    # device=None under the NCCL config: the layer asks for cuda:0, which this
    # CPU-only torch cannot allocate, so the error proves where it went.
    with pytest.raises((RuntimeError, AssertionError), match=r"(?i)cuda|nvidia"):
        torchtp.RowParallelLinear(8, 4)
    for embedding in (torchtp.VocabParallelEmbedding, torchtp.FeatureParallelEmbedding):
        assert embedding(10, 8, device="meta").weight.device.type == "meta"
        with pytest.raises((RuntimeError, AssertionError), match=r"(?i)cuda|nvidia"):
            embedding(10, 8)


def test_backend_devices():
    assert backend_devices("gloo") == {"cpu"}
    assert backend_devices("nccl") == {"cuda"}
    assert backend_devices("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert backend_devices("mpi") is None


@pytest.mark.parametrize(("asked", "cuda", "chosen"), [
    (None, True, "nccl"), (None, False, "gloo"), ("nccl", False, "gloo"),
    ("cpu:gloo,cuda:nccl", True, "cpu:gloo,cuda:nccl"), ("cpu:gloo,cuda:nccl", False, "gloo"),
])
def test_backend_choice(monkeypatch, asked, cuda, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert runtime._pick_backend(asked) == chosen


def _cpu_model_under_nccl(rank: int, world: int) -> str:
    """Rank 1 sees its group as NCCL (the selection logic under test), rank 0 as Gloo."""
    from torchtp.comm import devices

    if rank == 1:
        devices.group_backend = lambda group: "nccl"  # type: ignore[assignment]
        with torch.device("meta"):  # materialised later, on the rank's device: accepted
            assert devices.device_mismatch(nn.Linear(4, 4), dist.group.WORLD) is None
        assert devices.device_mismatch(nn.Linear(4, 4), dist.group.WORLD) is not None
    with pytest.raises(ValueError) as info:
        DistributedModelWrapper(mlp(hidden=16, ffn=32))
    return str(info.value)


def test_wrapping_cpu_parameters_under_nccl_raises_on_every_rank(ranks):
    msgs = ranks(_cpu_model_under_nccl, 2)
    assert "the model has parameters on cpu, but the tensor-parallel group's backend 'nccl' " \
           "communicates only cuda tensors; move the model first" in msgs[1]
    assert msgs[0].startswith("DistributedModelWrapper failed on rank 1"), msgs
    assert "model.to(" in msgs[0]
