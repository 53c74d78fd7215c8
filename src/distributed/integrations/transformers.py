"""``TensorParallelTrainer``: ``transformers.Trainer`` for a torchtp model, exact under torchrun.

What plain ``Trainer`` gets wrong on a tensor-parallel model, and what this
subclass does instead (the rest is ``Trainer`` unchanged):

- **Data**: every TP rank must see the same batches. Batches are split over
  the data-parallel ranks only (``cfg.dp_size`` from
  ``init_tensor_parallel(tp_size=k)``; one replica without a mesh).
- **No DDP over TP peers**: the model is not wrapped by accelerate (the
  path transformers uses for models it sharded itself); gradients are averaged
  over the DP group after each accumulation window (nothing to do at dp 1).
- **Clipping / logged grad_norm**: :func:`torchtp.clip_grad_norm_` /
  :func:`torchtp.grad_norm`, the norm of the whole model's gradient.
- **Saving**: ``save_model()`` writes a consolidated HF checkpoint (every rank
  takes part). Checkpoints (``save_strategy``) hold the consolidated weights,
  one optimizer file per TP rank (``optimizer.tp{r}-of-{tp}.pt``; AdamW's
  moments are sharded like their parameters), the scheduler and every rank's
  RNG state; ``resume_from_checkpoint`` reads back this rank's slices.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import recursively_apply
from safetensors import safe_open
from torch import nn
from transformers import Trainer

from ..checkpoint.placements import placements
from ..comm.runtime import get_tensor_parallel_config
from ..guards.agreement import agree
from ..hf import compat
from ..training import clip
from ..wrap.wrapper import DistributedModelWrapper
from .ddp_refusal import tensor_parallel_size

_SCHEDULER = "scheduler.pt"


class TensorParallelTrainer(Trainer):
    """Drop-in ``transformers.Trainer`` for a model wrapped by torchtp.

    Same constructor as ``Trainer``; ``model`` is the
    :class:`~torchtp.DistributedModelWrapper` or its ``base_model`` (also
    after ``get_peft_model``). Launch with torchrun; every rank runs the
    same script. With default ``TrainingArguments`` (AdamW,
    ``max_grad_norm=1.0``, gradient accumulation, evaluation) the losses, the
    logged ``grad_norm`` and the trained weights equal a one-process
    ``Trainer`` run on the global batch.

    Raises:
        RuntimeError: transformers older than 5.19 (its ``Trainer`` lacks the
            hooks this class overrides); the message names the fix.
        ValueError: the model is not tensor-parallel, the world is not
            ``tp x dp`` of the torchtp config, or ``load_best_model_at_end``
            is set (not supported).
    """

    def __init__(self, model: nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        if isinstance(model, DistributedModelWrapper):
            model = model.base_model  # the HF model: its forward signature, its save_pretrained
        missing = compat.missing_trainer_hooks(Trainer)
        if missing:  # an override that is never called would leave Trainer's wrong default
            import transformers

            raise RuntimeError(
                f"TensorParallelTrainer needs transformers>={compat.TRAINER_MIN_TRANSFORMERS}: "
                f"the installed {transformers.__version__}'s Trainer has no {missing}, so its "
                "own gradient averaging and clipping would run on the shards; pip install "
                f"'transformers>={compat.TRAINER_MIN_TRANSFORMERS}' (or train the wrapped model "
                "with a plain PyTorch loop, docs/training.md)")
        cfg = get_tensor_parallel_config()
        self._torchtp_tp = tensor_parallel_size(model) if model is not None else 1
        self._torchtp_dp = getattr(cfg, "dp_size", 1)
        self._torchtp_dp_rank = getattr(cfg, "dp_rank", 0)
        self._torchtp_dp_group = getattr(cfg, "dp_group", None)
        self._check_layout(cfg)
        super().__init__(model, *args, **kwargs)
        if self.args.load_best_model_at_end:
            raise ValueError("TensorParallelTrainer does not support load_best_model_at_end; "
                             "reload the best checkpoint directory with "
                             "DistributedModelWrapper.from_pretrained")
        # transformers' path for models it sharded itself: accelerate neither
        # wraps the model in DDP nor moves it, and every rank joins save_model().
        self.is_distributed_loading_by_transformers = True

    def _check_layout(self, cfg: Any) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self._torchtp_tp != cfg.world_size or self._torchtp_tp * self._torchtp_dp != world:
            raise ValueError(
                f"TensorParallelTrainer: the model's tensor-parallel size is {self._torchtp_tp}, the "
                f"torchtp config has tp={cfg.world_size} x dp={self._torchtp_dp} and the world has "
                f"{world} processes; wrap the model with DistributedModelWrapper after "
                "init_tensor_parallel(tp_size=...) so that world = tp x dp")

    def get_tp_size(self) -> int:
        """TP ranks share every batch; transformers divides token counts by this."""
        return self._torchtp_tp

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, with batches split over DP ranks and metrics gathered once."""
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        acc.prepare_data_loader = functools.partial(
            _prepare_data_loader, acc, self._torchtp_dp, self._torchtp_dp_rank)
        acc.gather_for_metrics = functools.partial(
            _gather_once_per_replica, acc, self._torchtp_tp)
        compat.set_trainer_metrics_gather(self, acc.gather_for_metrics)  # the first evaluation too

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        """``Trainer.prediction_step``, with a loss-parallel model's logits gathered whole:
        called with labels it returns this rank's vocabulary slice, which metrics cannot use."""
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only,
                                                       ignore_keys)
        switch = getattr(model, "tp_loss_parallel", None)
        if switch is not None and logits is not None:
            first = logits[0] if isinstance(logits, tuple) else logits  # (B, T, V_r)
            whole = switch.gather(first)  # (B, T, V)
            logits = (whole, *logits[1:]) if isinstance(logits, tuple) else whole
        return loss, logits, labels

    def _sync_replicated_trainable_parameters(self, model: nn.Module) -> None:
        # transformers broadcasts every plain parameter from rank 0 here (it would
        # overwrite the shards); torchtp ranks agree already, so only average over DP.
        if self._torchtp_dp_group is None:
            return
        for param in model.parameters():
            if param.requires_grad and not getattr(param, "_torchtp_dp_average", False):
                param.register_post_accumulate_grad_hook(self._average_over_dp)
                param._torchtp_dp_average = True  # type: ignore[attr-defined]

    def _average_over_dp(self, param: torch.Tensor) -> None:
        # Once per accumulation window, like DDP's averaging (same result).
        if self.accelerator.sync_gradients and param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=self._torchtp_dp_group)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        self.accelerator.unscale_gradients()
        return clip.clip_grad_norm_(list(model.parameters()), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return clip.grad_norm(list(model.parameters())) if grad_norm is None else grad_norm

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        error: BaseException | None = None
        try:
            optimizer: Any = self.optimizer
            scheduler: Any = self.lr_scheduler
            if self._torchtp_dp_rank == 0:  # DP replicas hold the same optimizer state
                torch.save(optimizer.state_dict(), _optimizer_file(output_dir, self))
            if self.args.should_save:
                torch.save(scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))
        except Exception as err:  # reported on every rank by agree()
            error = err
        agree("TensorParallelTrainer checkpoint", error, {}, None if not dist.is_initialized()
              else dist.group.WORLD)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = _optimizer_file(checkpoint, self)
        if not os.path.isfile(path):
            raise ValueError(f"resume_from_checkpoint={checkpoint!r}: {os.path.basename(path)} is "
                             f"missing; it was not saved by a TensorParallelTrainer at "
                             f"tp={self._torchtp_tp}")
        optimizer: Any = self.optimizer
        scheduler: Any = self.lr_scheduler
        optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, _SCHEDULER), map_location="cpu", weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        target: Any = model if model is not None else self.model
        load_slices(target, resume_from_checkpoint)


def _optimizer_file(directory: str, trainer: TensorParallelTrainer) -> str:
    rank = get_tensor_parallel_config().rank
    return os.path.join(directory, f"optimizer.tp{rank}-of-{trainer._torchtp_tp}.pt")


def load_slices(model: nn.Module, directory: str) -> None:
    """Copy this rank's slice of every tensor from a consolidated safetensors directory.

    Raises:
        ValueError: a tensor of the model is missing from the checkpoint.
    """
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    handles = [safe_open(os.path.join(directory, f), framework="pt") for f in files]
    where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    with torch.no_grad():
        for p in placements(model):
            name = next((n for n in p.names if n in where), None)
            if name is None:
                raise ValueError(f"checkpoint {directory!r} has no tensor {p.name!r}")
            p.tensor.copy_(p.layout.take(where[name].get_tensor(name)))


def _prepare_data_loader(acc: Any, dp_size: int, dp_rank: int, data_loader: Any,
                         device_placement: bool | None = None,
                         slice_fn_for_dispatch: Any = None) -> Any:
    """``Accelerator.prepare_data_loader`` over the DP ranks only (TP peers get the same batches)."""
    if compat.accelerate_prepared(data_loader):
        return data_loader
    prepared = prepare_data_loader(
        data_loader, acc.device, num_processes=dp_size, process_index=dp_rank,
        split_batches=acc.split_batches,
        put_on_device=acc.device_placement if device_placement is None else device_placement,
        rng_types=acc.rng_types.copy(), dispatch_batches=False, even_batches=acc.even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=acc.use_seedable_sampler,
        data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
        use_stateful_dataloader=acc.use_stateful_dataloader)
    compat.accelerate_track_dataloader(acc, prepared)
    return prepared


def _gather_once_per_replica(acc: Any, tp: int, input_data: Any,
                             use_gather_object: bool = False) -> Any:
    """``gather_for_metrics`` counting each DP replica once (TP peers hold copies)."""
    if use_gather_object:
        raise ValueError("TensorParallelTrainer: gather_for_metrics(use_gather_object=True) is "
                         "not supported; return tensors from compute_metrics inputs")
    data = acc.gather(input_data)  # (world * n, ...), global rank order: TP peers adjacent

    def once(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        per_rank = t.reshape(-1, tp, t.shape[0] // (acc.num_processes), *t.shape[1:])
        return per_rank[:, 0].reshape(-1, *t.shape[1:])  # TP rank 0 of each replica

    data = recursively_apply(once, data)
    state = acc.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        data = recursively_apply(lambda t: t[: state.remainder], data)
    return data
