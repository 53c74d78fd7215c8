"""Per-rank helpers for ``verify`` and ``bench``: load, wrap, measure memory."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm.devices import default_device
from ..wrap.wrapper import DistributedModelWrapper
from ._hf import build_model, has_weights, load_config, load_pretrained, parse_dtype


def say(rank: int, message: str) -> None:
    """Progress line from rank 0 only (stderr)."""
    if rank == 0:
        from ._common import progress

        progress(message)


def load_model(path: str, dtype_name: str | None, seed: int) -> tuple[nn.Module, Any]:
    """The full model on this rank: the checkpoint if ``path`` has weights, else random.

    Random weights use ``seed``, so every rank builds the same model.
    """
    from ._hf import _transformers

    _transformers().utils.logging.disable_progress_bar()  # N ranks would print N bars
    config = load_config(path)
    dtype = parse_dtype(dtype_name, config)
    if has_weights(path):
        return load_pretrained(path, dtype).to(rank_device()), config
    torch.manual_seed(seed)
    return build_model(config, dtype).to(rank_device()), config


def rank_device() -> torch.device:
    """This rank's CUDA device under NCCL (the launcher set it), else the CPU."""
    return default_device()


def wrap(model: nn.Module, plan: str | None = None, **experts: Any) -> DistributedModelWrapper:
    """Shard ``model`` across the running process group (``plan``: None, "builtin" or a file;
    ``experts``: the wrapper's ``expert_parallel``/``expert_dispatch``)."""
    return DistributedModelWrapper(model, plan=plan, **experts)


def load_sharded(path: str, dtype_name: str | None, seed: int, plan: str | None = None,
                 experts: dict[str, Any] | None = None) -> tuple[DistributedModelWrapper, Any]:
    """This rank's shard of the model: read from the checkpoint if ``path`` has weights.

    With weights, :meth:`DistributedModelWrapper.from_pretrained` reads only this
    rank's slices (memory proportional to the shard). Without (a config alone),
    every rank builds the same random model from ``seed`` and wraps it.
    """
    if not has_weights(path):
        model, config = load_model(path, dtype_name, seed)
        return wrap(model, plan, **(experts or {})), config
    config = load_config(path)
    wrapped = DistributedModelWrapper.from_pretrained(
        path, plan=plan, dtype=parse_dtype(dtype_name, config), device=rank_device(),
        progress=False, **(experts or {}))
    return wrapped.eval(), config


def peak_rss_bytes() -> int:
    """Peak resident host memory of this process (``ru_maxrss``; KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_device_bytes() -> int:
    """Peak CUDA memory allocated by this rank (0 on CPU)."""
    return torch.cuda.max_memory_allocated() if rank_device().type == "cuda" else 0


def barrier() -> None:
    """Line up the ranks before a timed region (no-op for one process)."""
    if dist.is_initialized():
        dist.barrier()


def random_tokens(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The same ``(batch, seq)`` token ids on every rank, on this rank's device."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(rank_device())
