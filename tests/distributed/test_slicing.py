"""The tensor slicing module: the document's examples, strategies, reductions, errors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from torchtp import shard
from torchtp.slicing import (
    ReduceOperation,
    SlicingConfig,
    SlicingStrategy,
    TensorSlicingModule,
    UnknownPartitionError,
    gather,
    plan,
    slice_tensor,
    split_offsets,
)


def _run(coro):
    return asyncio.run(coro)


def test_quick_start_example():
    async def main():
        config = SlicingConfig(num_devices=4, default_strategy=SlicingStrategy.ROW,
                               balance_workload=True)
        module = TensorSlicingModule(config)
        await module.initialize()
        tensor = np.random.default_rng(0).standard_normal((1000, 512)).astype(np.float32)
        partition = await module.slice_tensor(tensor, strategy=SlicingStrategy.ROW,
                                              num_slices=4)
        shapes = [module.get_slice(partition.partition_id, i).shape
                  for i, _ in enumerate(partition.slices)]
        rebuilt = await module.gather_partition(partition.partition_id,
                                                reduce_op=ReduceOperation.CONCAT)
        metrics = module.get_metrics()
        await module.shutdown()
        return tensor, shapes, rebuilt, metrics

    tensor, shapes, rebuilt, metrics = _run(main())
    assert shapes == [(250, 512)] * 4
    assert np.array_equal(rebuilt, tensor) and rebuilt.dtype == np.float32
    assert set(metrics) == {"total_slices_created", "total_bytes_sliced",
                            "total_gather_operations", "avg_slice_time_ms",
                            "avg_gather_time_ms", "active_partitions", "num_devices"}
    assert metrics["total_slices_created"] == 4
    assert metrics["total_bytes_sliced"] == tensor.nbytes
    assert metrics["total_gather_operations"] == 1
    assert metrics["active_partitions"] == 1 and metrics["num_devices"] == 4


def test_model_parallelism_example_column_slices():
    async def main():
        module = TensorSlicingModule(SlicingConfig(num_devices=4))
        await module.initialize()
        weights = np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32)
        part = await module.slice_tensor(weights, strategy=SlicingStrategy.COLUMN, num_slices=4)
        return weights, [module.get_slice(part.partition_id, i) for i in range(4)], part

    weights, slices, part = _run(main())
    for gpu in range(4):
        assert np.array_equal(slices[gpu], weights[:, gpu * 1024:(gpu + 1) * 1024])
        assert part.slices[gpu].device == gpu


def test_overlap_example_halo_exchange():
    async def main():
        config = SlicingConfig(num_devices=4, enable_overlap=True, overlap_size=2)
        module = TensorSlicingModule(config)
        await module.initialize()
        tensor = torch.arange(40.0).reshape(20, 2)
        part = await module.slice_tensor(tensor, strategy=SlicingStrategy.ROW, overlap=2)
        default = await module.slice_tensor(tensor, strategy=SlicingStrategy.ROW)
        return tensor, part, default, await module.gather_partition(part.partition_id)

    tensor, part, default, rebuilt = _run(main())
    # 20 rows, 4 slices of 5; 2-row halos, clipped at the tensor's edges.
    assert [(s.start[0], s.stop[0]) for s in part.slices] == [(0, 7), (3, 12), (8, 17),
                                                              (13, 20)]
    assert torch.equal(part.data[1], tensor[3:12])
    assert default.overlap == 2  # config.enable_overlap makes overlap_size the default
    assert torch.equal(rebuilt, tensor)


def test_strategies_and_balancing():
    x = torch.arange(10 * 7).reshape(10, 7)
    assert [s.shape for s in slice_tensor(x, "row", 4).slices] == [(3, 7), (3, 7), (2, 7),
                                                                   (2, 7)]
    # balance_workload=False cuts like torch.chunk / DTensor Shard.
    unbalanced = slice_tensor(x, SlicingStrategy.ROW, 4, balance=False)
    assert [s.shape[0] for s in unbalanced.slices] == [t.shape[0] for t in x.chunk(4)]
    assert [s.shape for s in slice_tensor(x, SlicingStrategy.COLUMN, 3).slices] == [
        (10, 3), (10, 2), (10, 2)]
    block = slice_tensor(x, SlicingStrategy.BLOCK, 6)
    assert block.grid_shape == (2, 3)
    assert block.slices[4].core_region == (slice(5, 10), slice(3, 5))
    batch = slice_tensor(torch.zeros(2, 8, 3), SlicingStrategy.BATCH, 2, batch_axis=1)
    assert [s.shape for s in batch.slices] == [(2, 4, 3), (2, 4, 3)]
    custom = slice_tensor(x, SlicingStrategy.CUSTOM, split_points=[1, 6], axis=1)
    assert [s.shape for s in custom.slices] == [(10, 1), (10, 5), (10, 1)]
    for part in (block, batch, custom, unbalanced):
        original = x if part is not batch else torch.zeros(2, 8, 3)
        assert torch.equal(gather(part), original)


def test_slices_are_the_sharding_cores_pieces():
    x = torch.arange(11 * 6).reshape(11, 6)
    part = slice_tensor(x, SlicingStrategy.BLOCK, 4, overlap=1)
    for i, spec in enumerate(part.slices):
        assert torch.equal(shard.shard(x, part.sharding, part.grid_shape, i),
                           part.data[i][spec.core_in_slice])


def test_reductions_numpy_and_torch_any_dtype():
    ints = np.arange(24, dtype=np.int16).reshape(4, 6)
    part = slice_tensor(ints, SlicingStrategy.ROW, 2)
    halves = ints[:2], ints[2:]
    assert np.array_equal(gather(part, "sum"), halves[0] + halves[1])
    assert np.array_equal(gather(part, ReduceOperation.MAX), np.maximum(*halves))
    assert np.array_equal(gather(part, ReduceOperation.MIN), np.minimum(*halves))
    assert np.allclose(gather(part, ReduceOperation.MEAN), (halves[0] + halves[1]) / 2)
    t = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    tp = slice_tensor(t, SlicingStrategy.COLUMN, 3)
    cols = t[:, 0:2], t[:, 2:4], t[:, 4:6]
    assert torch.equal(gather(tp, "max"), cols[2])
    assert torch.equal(gather(tp, "mean"), (sum(cols) / 3).double())
    for dtype in (torch.bool, torch.bfloat16, torch.complex64, torch.uint8):
        y = torch.ones(5, 3, dtype=dtype)
        assert torch.equal(gather(slice_tensor(y, "row", 2, overlap=1)), y)
    strings = np.array([["a", "b"], ["c", "d"], ["e", "f"]])
    assert np.array_equal(gather(slice_tensor(strings, "row", 2)), strings)


def test_slices_are_copies():
    x = torch.zeros(4, 2)
    part = slice_tensor(x, "row", 2)
    part.data[0].fill_(1)
    assert not x.any()


def test_update_slice_then_reduce():
    async def main():
        module = TensorSlicingModule(SlicingConfig(num_devices=2))
        await module.initialize()
        part = await module.slice_tensor(torch.zeros(4, 2), num_slices=2)
        module.update_slice(part.partition_id, 0, torch.ones(2, 2))
        module.update_slice(part.partition_id, 1, torch.full((2, 2), 2.0))
        return await module.gather_partition(part.partition_id, ReduceOperation.SUM)

    assert torch.equal(_run(main()), torch.full((2, 2), 3.0))


def test_concat_after_update_slice_with_another_dtype_keeps_every_value():
    part = slice_tensor(torch.arange(8.0).reshape(4, 2) + 0.5, "row", 2)
    part.data[0] = torch.tensor([[1, 2], [3, 4]])  # int64, as update_slice may leave it
    out = gather(part, ReduceOperation.CONCAT)
    assert out.dtype == torch.float32  # promoted, as torch.cat does
    assert out.tolist() == [[1, 2], [3, 4], [4.5, 5.5], [6.5, 7.5]]
    numpy_part = slice_tensor(np.arange(4.0).reshape(2, 2) + 0.5, "row", 2)
    numpy_part.data[0] = np.array([[1, 2]])
    assert gather(numpy_part, ReduceOperation.CONCAT).tolist() == [[1, 2], [2.5, 3.5]]


def test_split_offsets():
    assert split_offsets(10, 4) == [0, 3, 6, 8, 10]
    assert split_offsets(10, 4, balance=False) == [0, 3, 6, 9, 10]
    assert split_offsets(5, 4, balance=False) == [0, 2, 4, 5, 5]


def test_errors():
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"unknown slicing strategy 'diagonal'; use one of ROW"):
        slice_tensor(x, "diagonal", 2)
    with pytest.raises(ValueError, match=r"num_slices=0 must be an int >= 1"):
        slice_tensor(x, "row", 0)
    with pytest.raises(ValueError, match=r"cannot cut dim 0 of size 4 into 5 non-empty slices"):
        slice_tensor(x, "row", 5)
    with pytest.raises(ValueError, match=r"strategy COLUMN splits dim 1, but the tensor has 1"):
        slice_tensor(torch.zeros(4), "column", 2)
    with pytest.raises(ValueError, match=r"CUSTOM slicing needs split_points"):
        slice_tensor(x, "custom")
    with pytest.raises(ValueError, match=r"split_points=\[3, 2\] must be strictly increasing"):
        slice_tensor(x, "custom", split_points=[3, 2])
    with pytest.raises(ValueError, match=r"BLOCK grid=\(2, 2\) holds 4 slices, not num_slices=6"):
        plan((4, 6), "block", 6, grid=(2, 2))
    with pytest.raises(ValueError, match=r"overlap=-1 must be an int >= 0"):
        slice_tensor(x, "row", 2, overlap=-1)
    with pytest.raises(TypeError, match=r"needs a numpy.ndarray or torch.Tensor, got list"):
        slice_tensor([[1, 2]], "row", 1)
    with pytest.raises(ValueError, match=r"SUM needs slices of one shape"):
        gather(slice_tensor(torch.zeros(5, 2), "row", 2), "sum")
    with pytest.raises(ValueError, match=r"unknown reduce_op 'median'"):
        gather(slice_tensor(x, "row", 2), "median")
    with pytest.raises(ValueError, match=r"SlicingConfig.num_devices=0 must be an int >= 1"):
        SlicingConfig(num_devices=0)


def test_module_errors():
    async def main():
        module = TensorSlicingModule()
        with pytest.raises(RuntimeError, match=r"not initialized; `await module.initialize\(\)"):
            await module.slice_tensor(torch.zeros(2))
        await module.initialize()
        part = await module.slice_tensor(torch.zeros(4, 2), num_slices=2)
        with pytest.raises(UnknownPartitionError, match=r"unknown partition id 'nope'; known: "
                                                        r"\['partition-0'\]"):
            await module.gather_partition("nope")
        with pytest.raises(UnknownPartitionError, match=r"has slices 0..1, not 2"):
            module.get_slice(part.partition_id, 2)
        module.release_partition(part.partition_id)
        assert module.get_metrics()["active_partitions"] == 0

    _run(main())
