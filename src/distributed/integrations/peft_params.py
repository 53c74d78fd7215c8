"""PEFT LoRA on split parameters (``target_parameters``, PEFT's ``ParamWrapper``).

transformers v5 keeps a layer's experts in 3-D parameters (``gate_up_proj``
``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``; ``(E, in, out)`` when the
module ``is_transposed``), and PEFT adapts them as parameters: one ``A``
``(r*E, in)`` and one ``B`` ``(out, r*E)`` per parameter (expert ``e`` owns
``A``'s rows ``e*r .. e*r+r`` and ``B``'s columns ``k*E + e``), the delta
``B_e A_e`` added to the weight for the forward. ``"all-linear"`` on an MoE
model makes these targets (and, for some types, a router Linear's ``weight``:
the 2-D case, ``E = 1``, ``A`` ``(r, in)``, ``B`` ``(out, r)``). On experts
torchtp split (``ep/experts.py``) and on the weight of a torchtp Linear, each
rank keeps the adapter slices that match its part of the weight:

=============================================  ========================  ========================
weight split                                   A ``(r*E, in)``           B ``(out, r*E)``
=============================================  ========================  ========================
its ``out`` rows (``gate_up_proj``, colwise)   replicated, gradient      the weight's ``out``
                                               summed over the group     segments (dim 0)
its ``in`` columns (``down_proj``, rowwise)    the weight's ``in``       replicated, gradient
                                               segments (dim 1)          summed over the group
whole experts (expert parallelism)             the rank's experts' rows  their columns
=============================================  ========================  ========================

A replicated factor's gradient is a partial sum on each rank (each rank's delta
rows or columns read all of it), so it is summed after backward; the delta of
this rank's slices is this rank's slice of the full delta, so the weight the
module's forward reads (and ``merge``) is the unsharded one's slice. PEFT draws
the full-size ``A`` and ``B`` first, as for the unsharded parameter (same
random draws), then each rank keeps its slices: an unsharded LoRA model built
under the same seed is the reference, and a saved adapter is gathered whole.
Parameters torchtp did not split, and parameters of other modules, keep PEFT's
own ``ParamWrapper`` behaviour.
"""

from __future__ import annotations

import functools
from typing import Any

from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from ..core.layouts import ParamLayout, Segments, shard_sizes
from ..ep.experts import ParallelExperts
from ..layers import ColumnParallelLinear, RowParallelLinear, grad_sync
from ..layers.grad_sync import GradSync
from ..layers.owned import layouts_of
from .adapter_slices import check_supported, keep_slice

PARALLEL_LINEARS = (RowParallelLinear, ColumnParallelLinear)


def split_layout(layer: Any) -> ParamLayout | None:
    """The layout of the split parameter a PEFT ``ParamWrapper`` adapts; None when torchtp
    did not split it (see :func:`param_layout`)."""
    return param_layout(layer.get_base_layer(), layer.parameter_name)


def param_layout(base: nn.Module, name: str | None) -> ParamLayout | None:
    """The layout of ``base.<name>`` when the hooks below shard LoRA on it: a split 3-D
    parameter of torchtp's experts module, or a torchtp Linear's split ``weight`` (kept
    ``(out, in)``, not a transposed Conv1D's); None otherwise."""
    if name is None:
        return None
    layout = layouts_of(base).get(name)
    if layout is None or layout.dim is None:
        return None
    if isinstance(base, ParallelExperts) and len(layout.full_shape) == 3:
        return layout
    if isinstance(base, PARALLEL_LINEARS) and name == "weight" and not layout.transposed:
        return layout
    return None


def split_group(base: Any) -> Any:
    """The TP group ``base``'s parameters are split over."""
    return base.tp_group if isinstance(base, ParallelExperts) else base.group


def _full_sizes(original: Any) -> Any:
    @functools.wraps(original)
    def get_in_out_features(self: Any, module: nn.Module) -> Any:
        found = original(self, module)  # from this rank's shape; sets num_experts
        layout = split_layout(self)
        if layout is None:
            return found
        if len(layout.full_shape) == 2:  # a Linear's (out, in): PEFT's (in, out)
            return layout.full_shape[1], layout.full_shape[0]
        experts, first, second = layout.full_shape  # PEFT's order (E, in, out), swapped later
        self.num_experts = experts
        return first, second
    get_in_out_features._torchtp = True  # type: ignore[attr-defined]
    return get_in_out_features


def _sliced(original: Any) -> Any:
    @functools.wraps(original)
    def update_layer(self: Any, adapter_name: str, r: int, lora_alpha: int, config: Any,
                     **kwargs: Any) -> None:
        layout = split_layout(self)
        if layout is None:
            return original(self, adapter_name, r, lora_alpha=lora_alpha, config=config,
                            **kwargs)
        if layout.second is not None:
            raise ValueError(
                f"PEFT LoRA on '{self.parameter_name}' of {type(self.get_base_layer()).__name__}"
                f" (experts and features both split: {list(layout.full_shape)} -> "
                f"{list(layout.local_shape)} on this rank) is not supported; split the "
                "experts one way only (expert_parallel over all the TP ranks, or features "
                "only)")
        _refuse_single_transposed(self, layout)
        check_supported(self, config)
        if len(layout.full_shape) == 3:
            self.num_experts = layout.full_shape[0]  # full-size factors: the unsharded draws
        original(self, adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        _shard(self, adapter_name, layout)
        return None
    update_layer._torchtp = True  # type: ignore[attr-defined]
    return update_layer


def _refuse_single_transposed(layer: Any, layout: ParamLayout) -> None:
    """Whole experts stored ``(E, in, out)`` with one expert on some rank: PEFT takes such
    a parameter for a plain ``(out, in)`` weight (its ``num_experts == 1`` path) and
    builds the delta transposed. Decided from every rank's expert count (whole experts
    are split over the TP group, ``ep/styles.py``), so every rank raises alike."""
    base: Any = layer.get_base_layer()
    if len(layout.full_shape) != 3 or layout.dim != 0 or not getattr(base, "is_transposed",
                                                                      False):
        return
    counts = shard_sizes(layout.full_shape[0], base.tp_world_size)  # whole experts: over TP
    if 1 in counts and layout.full_shape[0] > 1:
        raise ValueError(
            f"PEFT LoRA on '{layer.parameter_name}' of {type(base).__name__} with whole "
            f"experts ({layout.full_shape[0]} experts over {len(counts)} ranks: {counts}) is not "
            "supported while a rank holds a single expert of this (experts, in, out) "
            "parameter: PEFT would build that rank's delta transposed; give every rank two "
            "or more experts (at most half as many ranks as experts), or split the "
            "experts' features (expert_parallel=False)")


def _shard(layer: Any, adapter: str, layout: ParamLayout) -> None:
    """Replace ``adapter``'s full ``A`` and ``B`` by this rank's slices."""
    a: Any = layer.lora_A[adapter]  # (r*E, in)
    b: Any = layer.lora_B[adapter]  # (out, r*E)
    base: Any = layer.get_base_layer()
    group = split_group(base)
    # The weight's out dimension: a Linear's (out, in) dim 0, experts' (E, out, in) dim 1
    # or (E, in, out) dim 2
    out_dim = 0 if len(layout.full_shape) == 2 else \
        2 if getattr(base, "is_transposed", False) else 1
    r = layer.r[adapter]
    if layout.dim == 0 and out_dim != 0:  # whole experts: their rows of A, their columns of B
        keep_slice(a, ParamLayout(tuple(a.weight.shape), 0, _scaled(layout.segments, r)))
        keep_slice(b, ParamLayout(tuple(b.weight.shape), 1,
                                  _strided(layout.segments, r, layout.full_shape[0])))
        layer.num_experts = sum(n for _, n in layout.segments)  # PEFT reshapes by it
    elif layout.dim == out_dim:  # B: the weight's out segments; A read by every row
        keep_slice(b, ParamLayout(tuple(b.weight.shape), 0, layout.segments))
        grad_sync.mark(a, "weight", (GradSync(group),))
        syncs = getattr(base, "tp_grad_sync", {}).get(layer.parameter_name)
        if syncs:  # replicated KV-head rows: their gradient is summed like the weight's
            grad_sync.mark(b, "weight", syncs)
    else:  # A: the weight's in segments; B reads every rank's partial A x
        keep_slice(a, ParamLayout(tuple(a.weight.shape), 1, layout.segments))
        grad_sync.mark(b, "weight", (GradSync(group),))
    grad_sync.install(layer)


def _scaled(segments: Segments, r: int) -> Segments:
    """Expert segments as rows of ``A`` ``(r*E, in)``: expert ``e`` owns rows ``e*r..e*r+r``."""
    return tuple((start * r, length * r) for start, length in segments)


def _strided(segments: Segments, r: int, experts: int) -> Segments:
    """Expert segments as columns of ``B`` ``(out, r*E)``: column ``k*E + e`` is expert ``e``'s
    ``k``-th, so each of the ``r`` blocks holds the experts' range (in PEFT's order)."""
    return tuple((k * experts + start, length) for k in range(r) for start, length in segments)


def install() -> None:
    """Teach PEFT's ``ParamWrapper`` torchtp's split parameters (idempotent; called by
    ``integrations/peft.py``'s ``install``).

    Two hooks on the class, not a subclass (PEFT finds its parameter wrappers by
    class name): ``_get_in_out_features`` gives a split parameter's full sizes,
    and ``update_layer`` keeps this rank's slices of the adapter it built. On any
    other parameter both do what PEFT does.
    """
    for name, hook in (("_get_in_out_features", _full_sizes), ("update_layer", _sliced)):
        original = getattr(ParamWrapper, name)
        if not getattr(original, "_torchtp", False):
            setattr(ParamWrapper, name, hook(original))
