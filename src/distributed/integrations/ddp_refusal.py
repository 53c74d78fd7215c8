"""Refuse accelerate's and Lightning's DDP wrapping of a tensor-parallel model (never exact).

``Accelerator.prepare(model)`` under a multi-process launch wraps the model in
``DistributedDataParallel`` over every process and gives each process its own
slice of every batch: TP peers then train on different data, and its
``clip_grad_norm_`` sees only local shards. Both plain ``transformers.Trainer``
and accelerate scripts go through ``Accelerator.prepare_model``, so that is
where torchtp stops them, at the first ``prepare``/``train()``, on every
rank, with the supported way. Preparing for evaluation (no DDP) stays allowed.
Lightning's ``strategy="ddp"`` (Fabric ``setup_module``, Trainer
``_setup_model``) is refused the same way when Lightning is loaded.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ..layers import ColumnParallelLinear, RowParallelLinear


def tensor_parallel_size(model: nn.Module) -> int:
    """The largest TP world size among ``model``'s torchtp layers (1 if none)."""
    sizes = [m.world_size for m in model.modules()
             if isinstance(m, (RowParallelLinear, ColumnParallelLinear))]
    return max(sizes, default=1)


def refusal(tp: int) -> str:
    """The error message for a data-parallel framework wrapping a TP model."""
    return (f"accelerate's prepare() would wrap this tensor-parallel model (tp={tp}, layers "
            "split over ranks) in DistributedDataParallel over every process and give each "
            "process different batches, which is not exact under tensor parallelism. Use "
            "torchtp.integrations.transformers.TensorParallelTrainer instead of "
            "transformers.Trainer, or in a custom loop skip accelerator.prepare(model) and use "
            "torchtp.clip_grad_norm_ (DDP over cfg.dp_group for data parallelism); see "
            "docs/integrations.md")


def install() -> None:
    """Make ``Accelerator.prepare_model`` refuse torchtp models in a multi-process run."""
    from accelerate import Accelerator

    original = Accelerator.prepare_model
    if getattr(original, "_torchtp", False):
        return

    @functools.wraps(original)
    def prepare_model(self: Any, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        tp = tensor_parallel_size(model)
        if tp > 1 and self.num_processes > 1 and not evaluation_mode:
            raise ValueError(refusal(tp))
        return original(self, model, device_placement=device_placement,
                        evaluation_mode=evaluation_mode)

    prepare_model._torchtp = True  # type: ignore[attr-defined]
    Accelerator.prepare_model = prepare_model


def lightning_refusal(tp: int) -> str:
    """The error message for Lightning's DDP strategy around a TP model."""
    return (f"Lightning's DDP strategy would wrap this tensor-parallel model (tp={tp}, layers "
            "split over ranks) in DistributedDataParallel over every process and give each "
            "process different batches, which is not exact under tensor parallelism. Use "
            "strategy=ModelParallelStrategy(parallelize_fn=torchtp.integrations.lightning."
            "parallelize, tensor_parallel_size=..., data_parallel_size=...) on the unwrapped "
            "model; see docs/integrations.md")


def install_lightning() -> None:
    """Make Lightning's DDP strategies (Fabric and Trainer) refuse torchtp models."""
    from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies.ddp import DDPStrategy as TrainerDDP

    for owner, name in ((FabricDDP, "setup_module"), (TrainerDDP, "_setup_model")):
        original = getattr(owner, name)
        if getattr(original, "_torchtp", False):
            continue
        setattr(owner, name, _refusing(original))


def _refusing(original: Any) -> Any:
    @functools.wraps(original)
    def setup(self: Any, module: nn.Module) -> Any:
        tp = tensor_parallel_size(module)
        if tp > 1:
            raise ValueError(lightning_refusal(tp))
        return original(self, module)

    setup._torchtp = True  # type: ignore[attr-defined]
    return setup
