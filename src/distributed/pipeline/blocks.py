"""Pipeline stages of ``nn.Sequential`` and other models that are a chain of blocks.

A model qualifies when its forward is a chain: the input goes through some
first-stage modules (an embedding), a list of blocks in order, then some
last-stage modules (a norm, a head). Each stage keeps its share of the blocks;
everything else is replaced by :class:`~torchtp.pipeline.stage.Elsewhere`,
which hands its input on, so the model's own forward runs unchanged on every
stage and parameter names stay the unsplit model's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from .balance import param_balanced_split
from .stage import Elsewhere, Stage, stage_layers


class BlockStage(Stage):
    """One stage of a chain of blocks: forward is the model's own forward.

    forward: the first stage reads the model's input, the others the previous
    stage's output; the last stage returns the model's output.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def block_stage(model: nn.Module, stage: int, stages: int, blocks: str | None = None,
                first: Sequence[str] = (), last: Sequence[str] = (),
                split: Sequence[int] | str | None = None) -> BlockStage:
    """Turn ``model`` (in place) into pipeline stage ``stage`` of ``stages``.

    Args:
        model: An ``nn.Sequential`` (its children are the blocks), or a model
            whose forward chains ``first`` modules, the blocks, then ``last``
            modules (a torchtitan-style LM: ``first=["tok_embeddings"]``,
            ``blocks="layers"``, ``last=["norm", "output"]``).
        stage: This rank's stage.
        stages: Pipeline stages.
        blocks: Name of the ``nn.ModuleList`` / ``nn.ModuleDict`` /
            ``nn.Sequential`` holding the blocks; ``None``: ``model`` itself
            (an ``nn.Sequential``).
        first: Modules only the first stage runs (replaced elsewhere).
        last: Modules only the last stage runs (replaced elsewhere).
        split: Blocks per stage; ``None``: balanced blocks
            (:func:`~torchtp.pipeline.stage_layers`); ``"params"``: balanced
            parameters, ``first`` counted on the first stage and ``last`` on
            the last (:func:`~torchtp.pipeline.balance.param_balanced_split`).

    Raises:
        ValueError: ``blocks`` is not a list of modules, or a ``first``/``last``
            name is not a submodule, or the split is invalid.
    """
    container = model if blocks is None else getattr(model, blocks, None)
    if not isinstance(container, nn.ModuleList | nn.ModuleDict | nn.Sequential):
        raise ValueError(f"{type(model).__name__}: blocks={blocks!r} must name an nn.ModuleList, "
                         "nn.ModuleDict or nn.Sequential of the model (None: the model itself, "
                         "an nn.Sequential)")
    missing = [n for n in (*first, *last) if not isinstance(_get(model, n), nn.Module)]
    if missing:
        raise ValueError(f"{type(model).__name__}: first/last modules {missing} are not "
                         "submodules of the model")
    children = list(container.named_children())  # the blocks, in forward order
    keys = [key for key, _ in children]
    if split == "params":
        split = param_balanced_split(_params(model.get_submodule(n) for n in first),
                                     [_params([b]) for _, b in children],
                                     _params(model.get_submodule(n) for n in last), stages)
    elif isinstance(split, str):
        raise ValueError(f"split={split!r}: give blocks per stage, None (balanced blocks) or "
                         "'params' (balanced parameters)")
    mine = stage_layers(len(keys), stages, split)[stage]
    for i, key in enumerate(keys):
        if i not in mine:  # replaces the block in place: the order of the blocks is kept
            setattr(container, key, Elsewhere(i))
    for names, keep in ((first, stage == 0), (last, stage == stages - 1)):
        for name in names if not keep else ():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, Elsewhere(name))
    return BlockStage(model, stage, stages, mine)


def _params(modules: Iterable[nn.Module]) -> int:
    """Parameters of ``modules``, together."""
    return sum(p.numel() for m in modules for p in m.parameters())


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
