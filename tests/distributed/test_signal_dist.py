"""Signals on 4 Gloo processes: the document's data/model-parallel examples."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torchtp import shard, signal

YAML = """\
data_parallel:
  shard:
    axis: 0
    workers: [0, 1, 2, 3]
model_parallel:
  shard:
    axis: 1
    workers: [0, 1]
stage_1:
  shard:
    axis: 0
    workers: [0, 1]
  backward: stage_1_backward
stage_1_backward:
  shard:
    axis: 0
    workers: [2, 3]
forward_pass:
  shard:
    axis: 0
    workers: [0, 1, 2, 3]
  backward: backward_pass
backward_pass:
  shard:
    axis: 0
    workers: [0, 1, 2, 3]
too_wide:
  shard:
    workers: [0, 1, 2, 3, 4, 5]
"""


def _signals(rank: int, world_size: int, path: str) -> dict[str, Any]:
    signal.load_config(path)
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    with signal.context("data_parallel"):
        batch = signal.randn(128, 784)
        a = signal.randn(128, 64)
        b = signal.randn(64, 32, sharded=False)  # the document's replicated B
        with CommDebugMode() as mode:
            c = shard.matmul(a, b)
        out["embarrassing_comms"] = mode.get_total_counts()
        out["c_local"] = tuple(c.to_local().shape)
        both = signal.randn(64, 32)  # sharded too: the all-gather pattern
        with CommDebugMode() as mode:
            d = shard.matmul(a, both)
        out["all_gather_comms"] = mode.get_total_counts()
        out["d_ok"] = torch.allclose(d.full_tensor(), a.full_tensor() @ both.full_tensor(),
                                     atol=1e-4)
        # The document's code as written: a plain B (and w) act as replicated in a scope.
        plain_b = torch.randn(64, 32)
        with CommDebugMode() as mode:
            c_plain = a @ plain_b
        out["plain_comms"] = mode.get_total_counts()
        out["plain_ok"] = (isinstance(c_plain, DTensor) and c_plain.placements == (Shard(0),)
                           and torch.allclose(c_plain.full_tensor(), a.full_tensor() @ plain_b,
                                              atol=1e-4))
        x = signal.randn(128, 64)
        total = x.sum()  # DTensor's own reduction: a partial sum, all-reduced on read
        out["plain_sum_ok"] = torch.allclose(total.full_tensor(), x.full_tensor().sum(), atol=1e-3)
        out["sum_ok"] = torch.allclose(shard.sharded_sum(x).to_local(), x.full_tensor().sum(),
                                       atol=1e-3)
        out["mean_ok"] = torch.allclose(shard.sharded_mean(x).to_local(),
                                        x.full_tensor().mean(), atol=1e-5)
    try:
        a @ torch.randn(64, 32)  # outside the scope: mixing is refused again
        out["mixed_refused"] = False
    except RuntimeError as err:
        out["mixed_refused"] = "mixed torch.Tensor and DTensor" in str(err)
    out["batch_local"] = tuple(batch.to_local().shape)
    out["batch_is_dtensor"] = isinstance(batch, DTensor)
    torch.manual_seed(0)
    out["same_as_torch"] = torch.equal(batch.full_tensor(), torch.randn(128, 784))
    with signal.context("model_parallel"):
        weight = signal.randn(1024, 512)
        ones = signal.ones(4, 6)
    out["weight_local"] = tuple(weight.to_local().shape)
    out["weight_placement"] = str(weight.placements)
    out["ones_local"] = tuple(ones.to_local().shape)
    out["outside_plain"] = type(signal.zeros(3)) is torch.Tensor
    src = torch.arange(12.0).reshape(4, 3) * (1 if rank == 0 else -1)  # first worker wins
    copied = signal.tensor(src, name="data_parallel")
    out["copy_shard"] = copied.to_local().tolist()
    # Workers listed in reverse are the same set: the shards still follow rank order
    signal.register_config("reversed", signal.SignalConfig(
        shard=signal.ShardConfig(axis=0, workers=[3, 2, 1, 0])))
    torch.manual_seed(0)
    with signal.context("reversed"):
        drawn = signal.randn(8, 2)
    torch.manual_seed(0)
    out["reversed_workers_exact"] = torch.equal(drawn.full_tensor(), torch.randn(8, 2))
    backwards = shard.Grid((4,), ranks=[3, 2, 1, 0], name="backwards")  # collective
    out["backwards_grid"] = _error(
        lambda: shard.distribute(torch.zeros(4, 2), shard.Sharding([[0]]), backwards),
        ValueError, r"its ranks decrease along axis 0, so DTensor collectives")
    out["errors"] = [_error(lambda: signal.enter("stage_1"), NotImplementedError,
                            r"workers \[0, 1\] but its backward signal 'stage_1_backward' uses "
                            r"workers \[2, 3\]"),
                     _error(lambda: signal.enter("too_wide"), ValueError,
                            r"signal 'too_wide' \(.*config.yaml: too_wide.shard.workers\): "
                            r"workers \[4, 5\] are outside the world of 4 rank\(s\)")]
    out.update(_training_step())
    return out


def _training_step() -> dict[str, Any]:
    # The document's complete example, scaled down: forward under forward_pass
    # (backward_pass has the same workers, so gradients flow on those ranks).
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 2)
    reference = torch.nn.Linear(8, 2)
    reference.load_state_dict(model.state_dict())
    inputs, targets = torch.randn(16, 8), torch.randn(16, 2)
    with signal.context("forward_pass"):
        par = signal.parallelize(model)
        x = signal.tensor(inputs)
        y = signal.tensor(targets)
        loss = shard.sharded_mean((par(x) - y) ** 2)
    loss.full_tensor().backward()
    ref_loss = ((reference(inputs) - targets) ** 2).mean()
    ref_loss.backward()
    grad = par.weight.grad
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return {"loss_ok": torch.allclose(loss.full_tensor(), ref_loss, atol=1e-5),
            "grad_ok": torch.allclose(grad, reference.weight.grad, atol=1e-5),
            "out_placement": str(par(x).placements)}


def _error(fn: Any, exc: type[BaseException], pattern: str) -> bool:
    try:
        fn()
    except exc as err:
        return bool(re.search(pattern, str(err))) or str(err)  # type: ignore[return-value]
    return False


def test_signals_across_four_processes(ranks, tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(YAML)
    results = ranks(_signals, 4, str(path), timeout=120, gloo_timeout=60)
    for rank, r in enumerate(results):
        assert r["batch_is_dtensor"] and r["batch_local"] == (32, 784)
        assert r["same_as_torch"]
        assert r["embarrassing_comms"] == 0 and r["c_local"] == (32, 32)
        assert r["all_gather_comms"] == 1 and r["d_ok"]
        assert r["sum_ok"] and r["mean_ok"]
        assert r["plain_ok"] and r["plain_comms"] == 0 and r["plain_sum_ok"]
        assert r["mixed_refused"]
        # model_parallel: workers [0, 1], axis 1: 512 features -> 256 per worker.
        assert r["weight_local"] == ((1024, 256) if rank < 2 else (0,))
        assert r["weight_placement"] == str((Shard(1),))
        assert r["ones_local"] == ((4, 3) if rank < 2 else (0,))
        assert r["outside_plain"]
        assert r["copy_shard"] == (torch.arange(12.0).reshape(4, 3)[rank:rank + 1]).tolist()
        assert r["reversed_workers_exact"] and r["backwards_grid"]
        assert r["errors"] == [True, True]
        assert r["loss_ok"] and r["grad_ok"]
        assert r["out_placement"] == str((Shard(0),))
