"""Lightning's ``ModelParallelStrategy`` with torchtp on the tensor-parallel mesh dimension.

::

    strategy = ModelParallelStrategy(parallelize_fn=torchtp.integrations.lightning.parallelize,
                                     tensor_parallel_size=2, data_parallel_size=2)

Lightning builds a ``DeviceMesh`` named ``("data_parallel", "tensor_parallel")``
and calls ``parallelize(model, device_mesh)``: the HF model inside (or the
whole model) is wrapped by :class:`~torchtp.DistributedModelWrapper` over the
``tensor_parallel`` group, in place, then FSDP2 ``fully_shard`` shards every
decoder block and the root over ``data_parallel`` (when it has more than one
rank). ``Trainer(gradient_clip_val=...)`` clips by the whole model's norm
(:func:`torchtp.clip_grad_norm_`, installed as the module's
``configure_gradient_clipping``), and so does ``fabric.clip_gradients``:
``parallelize`` makes ``ModelParallelStrategy.clip_gradients_norm`` use
:func:`torchtp.clip_grad_norm_` for modules holding torchtp layers (torch's
clipping would see only this rank's shards).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ..hf.detect import is_hf_model
from ..layers import layouts_of
from ..wrap.wrapper import DistributedModelWrapper


def parallelize(model: nn.Module, device_mesh: Any, **options: Any) -> nn.Module:
    """Tensor-parallel on ``device_mesh["tensor_parallel"]``, FSDP2 on ``["data_parallel"]``.

    Args:
        model: A ``LightningModule`` (or any module) holding the model to split.
        device_mesh: Lightning's 2-D mesh ``("data_parallel", "tensor_parallel")``.
        **options: Keyword arguments for :class:`~torchtp.DistributedModelWrapper`
            (``plan``, ``expert_parallel``, ...); pass them with
            ``functools.partial(parallelize, expert_parallel=True)`` as Fabric's
            ``parallelize_fn``.

    Returns:
        ``model``, changed in place (Lightning requires the module back).

    Raises:
        ValueError: the mesh lacks a ``tensor_parallel`` dimension, or a plan problem
            (raised on every rank, as by ``DistributedModelWrapper``).
    """
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    if "tensor_parallel" not in names:
        raise ValueError(f"torchtp.integrations.lightning.parallelize needs Lightning's "
                         f"ModelParallelStrategy mesh with a 'tensor_parallel' dimension, "
                         f"got dims {names}")
    target = next((m for m in model.modules() if is_hf_model(m)), model)
    DistributedModelWrapper(target, group=device_mesh["tensor_parallel"].get_group(),
                            **options)  # in place
    _make_fabric_clipping_tp_aware()
    _refuse_lightning_checkpoints()
    if hasattr(model, "configure_gradient_clipping"):
        # Lightning's own clipping would measure only this rank's shards.
        setattr(model, "configure_gradient_clipping", functools.partial(_clip, model))  # noqa: B010
    if "data_parallel" in names and device_mesh["data_parallel"].size() > 1:
        _fully_shard(model, target, device_mesh["data_parallel"])
    return model


def _clip(model: nn.Module, optimizer: Any, gradient_clip_val: float | None = None,
          gradient_clip_algorithm: str | None = None) -> None:
    """``LightningModule.configure_gradient_clipping`` with the whole model's gradient norm."""
    if not gradient_clip_val:
        return
    if gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not supported "
                         "under tensor parallelism; use 'norm' (torchtp.clip_grad_norm_)")
    from ..training.clip import clip_grad_norm_

    clip_grad_norm_([p for p in model.parameters() if p.grad is not None], gradient_clip_val)


def _make_fabric_clipping_tp_aware() -> None:
    """``fabric.clip_gradients`` under ``ModelParallelStrategy``: the whole model's norm.

    Lightning's strategy calls ``torch.nn.utils.clip_grad_norm_``, which on a
    torchtp model sums only this rank's shards, so ranks would clip by
    different factors, silently. Modules without torchtp layers keep
    Lightning's own clipping. Installed once, on the class.
    """
    from lightning.fabric.strategies import ModelParallelStrategy

    original = ModelParallelStrategy.clip_gradients_norm
    if getattr(original, "torchtp_aware", False):
        return

    @functools.wraps(original)
    def clip_gradients_norm(self: Any, module: nn.Module, optimizer: Any, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> Any:
        if not any(layouts_of(m) for m in module.modules()):
            return original(self, module, optimizer, max_norm, norm_type, error_if_nonfinite)
        from ..training.clip import clip_grad_norm_

        self.precision.unscale_gradients(optimizer)
        params = [p for p in self.precision.main_params(optimizer) if p.grad is not None]
        return clip_grad_norm_(params, max_norm, norm_type=norm_type,
                               error_if_nonfinite=error_if_nonfinite)

    clip_gradients_norm.torchtp_aware = True  # type: ignore[attr-defined]
    ModelParallelStrategy.clip_gradients_norm = clip_gradients_norm  # type: ignore[method-assign]


def _refuse_lightning_checkpoints() -> None:
    """Fabric's and the Trainer's ``ModelParallelStrategy`` checkpoints refuse torchtp models.

    Their state dicts hold each rank's torchtp shard under the full tensor's name, as a
    plain tensor (or an FSDP2 DTensor over the data-parallel mesh only): a distributed
    checkpoint keeps one rank's shard per name and loads it into every tensor-parallel
    rank, a full one writes rank 0's shards. Raised on every rank (every rank holds the
    same model), before anything is written or read. Installed once, on the classes.
    """
    from lightning.fabric.strategies import ModelParallelStrategy as FabricStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy as TrainerStrategy

    for cls, modules in ((FabricStrategy, _state_modules), (TrainerStrategy, _strategy_model)):
        for name in ("save_checkpoint", "load_checkpoint"):
            original = getattr(cls, name)
            if not getattr(original, "torchtp_aware", False):
                setattr(cls, name, _refusing(original, modules))


def _state_modules(strategy: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The modules a Fabric save/load names: its ``state`` (a dict, or one module)."""
    state = kwargs.get("state", args[1] if len(args) > 1 else None)
    values = state.values() if isinstance(state, dict) else [state]
    return [v for v in values if isinstance(v, nn.Module)]


def _strategy_model(strategy: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The Trainer strategy's model, whose state its checkpoint holds."""
    return [m for m in (getattr(strategy, "model", None),) if isinstance(m, nn.Module)]


def _refusing(original: Any, modules: Any) -> Any:
    @functools.wraps(original)
    def refusing(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(layouts_of(m) for module in modules(self, args, kwargs)
               for m in module.modules()):
            raise ValueError(
                f"Lightning's ModelParallelStrategy.{original.__name__} on a model split by "
                "torchtp: its state dict names each rank's shard (weight rows or columns) as "
                "the full tensor, so the checkpoint would keep one tensor-parallel rank's "
                "shards and load them into every rank, silently; save and resume with "
                "torchtp.checkpoint.dcp.save_training_state / load_training_state (any tp), "
                "or the weights with the wrapped model's save_pretrained (docs/training.md); "
                "a lightning.Trainer needs enable_checkpointing=False for that")
        return original(self, *args, **kwargs)

    refusing.torchtp_aware = True  # type: ignore[attr-defined]
    return refusing


def _fully_shard(model: nn.Module, target: nn.Module, dp_mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    blocks = max((m for m in target.modules() if isinstance(m, nn.ModuleList)),
                 key=len, default=None)
    for block in blocks or []:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
