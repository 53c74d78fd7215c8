"""PEFT LoRA on tensor-parallel layers: each adapter pair is sharded like its base layer.

Importing this module installs torchtp's layers into PEFT (:func:`install`;
``DistributedModelWrapper`` does it when PEFT is installed), so that the
usual calls work on a wrapped model:

- ``get_peft_model(wrapped.base_model, LoraConfig(target_modules=[...]))``
  and ``target_modules="all-linear"``: every LoRA layer whose base is a
  torchtp layer becomes a :class:`TensorParallelLoraLinear`, registered
  through PEFT's custom-module mechanism on the config.
- ``peft_model.save_pretrained(dir)`` on every rank writes one consolidated
  adapter that plain PEFT loads onto the unsharded model.
- ``PeftModel.from_pretrained(wrapped.base_model, dir)`` loads a full-size
  adapter: each rank keeps its slices.
- LoRA on split experts' 3-D parameters (``target_parameters``, which
  ``"all-linear"`` adds on transformers v5's MoE models) keeps each rank's
  slices too: ``peft_params.py`` (and a torchtp Linear's split ``weight``).
- LoRA beside a whole projection torchtp treats per rank (a latent attention's
  ``kv_a_proj_with_mqa``, a ``replicated_with_grad_allreduce`` Linear) is
  treated like its base: ``peft_shared.py``.

The sharding (``tp`` ranks, scale ``s``):

============================  ==========================  ==========================
base layer                    LoRA A                      LoRA B
============================  ==========================  ==========================
RowParallelLinear (colwise,   ``(r, in)`` replicated      ``(out/tp, r)``: the base's
out_features split)                                       weight rows
ColumnParallelLinear          ``(r, in/tp)``: the base's  ``(out, r)`` replicated
(rowwise, in_features split)  weight columns
============================  ==========================  ==========================
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import PeftModel, PeftType
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import ParamWrapper
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..checkpoint.atomic import enter
from ..checkpoint.hf_stream import gather_full
from ..checkpoint.placements import placements
from ..checkpoint.save_sharded import gather_layouts
from ..comm.regions import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    rank_local_error,
    scatter_to_tensor_parallel_region,
)
from ..comm.sequence_parallel import own_shard_grad
from ..core.layouts import ParamLayout
from ..guards.agreement import agree
from ..hf import compat
from ..layers import RowParallelLinear, grad_sync
from ..layers._base import require_group
from ..layers._shape import input_mismatch
from ..layers.grad_sync import GradSync
from ..layers.owned import layouts_of, split_group
from ..layers.rng import (
    TRACKER,
    in_split_region,
    split_region_begins,
    split_region_ends,
    streams_switch,
    whole_region_begins,
    whole_region_ends,
)
from . import peft_params
from .adapter_slices import check_supported, keep_slice
from .peft_params import PARALLEL_LINEARS
from .peft_shared import convert_shared, treated_per_rank


class TensorParallelLoraLinear(LoraLinear):
    """A PEFT LoRA layer around a torchtp layer, its A/B sharded like the base.

    Around a :class:`RowParallelLinear` (weight rows = ``out_features`` split):
    ``A`` ``(r, in)`` is replicated and ``B`` holds the base's rows
    ``(out/tp, r)``. forward: ``h = A x`` ``(..., r)`` passes
    ``copy_to_tensor_parallel_region`` (forward identity, backward all-reduce:
    each rank's ``B`` rows give a partial ``dh``), then ``y_local += s * B h``
    (all-gathered with the base output when it gathers).

    Around a :class:`ColumnParallelLinear` (weight columns = ``in_features``
    split): ``A`` holds the base's columns ``(r, in/tp)`` and ``B`` ``(out, r)``
    is replicated. forward: the base's partial product and
    ``s * B (A x_local)`` are summed by the base's one all-reduce (forward
    all-reduce, backward identity); ``B``'s gradient, a partial sum on each
    rank, is summed over the group after backward.

    PEFT initialises full-size ``A``/``B`` exactly as for an ``nn.Linear``
    (same random draws), then each rank keeps its slices, so an unsharded
    LoRA model built under the same seed is the reference.
    """

    def _get_in_out_features(self, module: Any) -> tuple[int, int]:
        # Full sizes: PEFT builds (and initialises) the full A and B first.
        return module.in_features, module.out_features

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any,
                     **kwargs: Any) -> None:
        """PEFT's ``update_layer``, then keep this rank's slices of the new adapter.

        Raises:
            ValueError: a LoRA variant (DoRA...), ``lora_bias`` or an
                initialisation that reads the base weight (PiSSA...).
        """
        check_supported(self, config)
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        self.fan_in_fan_out = False  # torchtp keeps local weights as (out, in), even for Conv1D
        shard_adapter(self, adapter_name)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base layer's output plus every active adapter's, sharded like the base."""
        base: Any = self.get_base_layer()
        active = [a for a in self.active_adapters if a in self.lora_A]
        if kwargs.get("adapter_names") is not None:
            raise ValueError(f"{self._name()}: per-sample adapter_names (mixed-batch LoRA) is not "
                             "supported under tensor parallelism; set one adapter with "
                             "set_adapter(...)")
        if self.disable_adapters or self.merged or not active or base.world_size == 1:
            return super().forward(x, *args, **kwargs)
        compat.peft_check_forward_args(self, x, *args, **kwargs)
        group = require_group(self._name, base.group, base.world_size)
        if isinstance(base, RowParallelLinear):
            return self._forward_rows(base, x, active, group)
        return self._forward_columns(base, x, active, group)

    def _forward_rows(self, base: Any, x: torch.Tensor, active: list[str],
                      group: Any) -> torch.Tensor:
        # x is the same on every rank and A is replicated: LoRA's input dropout must drop
        # the same features everywhere, so it draws from the shared stream, also after an
        # earlier layer opened a split region (q_proj before k_proj; layers/rng.py); on
        # a gathered sequence (sequence parallelism) from the stream every rank shares
        # there, as a block run whole does.
        streaming = base.training and (TRACKER.depth or base.streamed)
        local = streaming and in_split_region()
        if local:
            split_region_ends(base)
        gathered = streaming and base.sequence_dim is not None and whole_region_begins(
            base.stream_key)
        lora_x = x if base.sequence_dim is None else own_shard_grad(x, group, base.sequence_dim)
        dropped = [self.lora_dropout[name](compat.peft_cast_input_dtype(
            self, lora_x, self.lora_A[name].weight.dtype)) for name in active]
        if gathered:
            whole_region_ends()
        if local:
            split_region_begins(base)
        result = base(x)  # (..., out/tp), or (..., out) when the base gathers
        for name, xa in zip(active, dropped, strict=True):
            a: Any = self.lora_A[name]
            b: Any = self.lora_B[name]
            h = copy_to_tensor_parallel_region(a(xa), group)  # (..., r)
            delta = b(h) * self.scaling[name]  # (..., out/tp)
            if base.gather_output:
                # (..., out); shares may differ by one row when out_features does not divide
                delta = gather_from_tensor_parallel_region(delta, group, -1, base.out_features)
            result = result + delta.to(result.dtype)
        return result

    def _forward_columns(self, base: Any, x: torch.Tensor, active: list[str],
                         group: Any) -> torch.Tensor:
        # The base's forward, with the LoRA terms added to its partial sum: A reads this
        # rank's input columns, so B(A x) is a partial sum too. Reduced with the base's
        # (or, on a 'rowwise_partial' layer, later with the other partial layers').
        expected = base.expected_input_features
        if not x.dim() or x.shape[-1] != expected:
            # Other ranks may be fine and already waiting in the all-reduce: tell them.
            raise rank_local_error(group, input_mismatch(base, x, expected))  # type: ignore[arg-type]
        if not base.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, group, -1)  # (..., in/tp)
        switching = False
        if base.training and (TRACKER.depth or base.streamed):
            base.__dict__["streamed"] = switching = streams_switch()  # as the base's forward
        # x is this rank's shard: LoRA's input dropout draws from a local stream, so the
        # shards' masks are independent, as one mask over all features would be (a
        # scattered replicated input opens a region for it; a split input is in one).
        opened = switching and not base.input_is_parallel and not in_split_region()
        if opened:
            split_region_begins(base)
        dropped = [self.lora_dropout[name](compat.peft_cast_input_dtype(
            self, x, self.lora_A[name].weight.dtype)) for name in active]
        if switching and (base.input_is_parallel or opened):
            split_region_ends(base)  # as the base's forward: the split region ends here
        partial = F.linear(x, base.weight)  # (..., out), this rank's partial sum
        for name, xa in zip(active, dropped, strict=True):
            a: Any = self.lora_A[name]
            b: Any = self.lora_B[name]
            lora = b(a(xa)) * self.scaling[name]  # (..., out) partial
            partial = partial + lora.to(partial.dtype)
        return base.sum_partial(partial, group)

    def _name(self) -> str:
        base: Any = self.get_base_layer()
        return f"TensorParallelLoraLinear({base._name()})"

    def __repr__(self) -> str:
        return "torchtp." + super().__repr__()


def _segments(base: Any, dim: int) -> tuple[tuple[int, int], ...]:
    """The ranges of the base's split dimension (0: out rows, 1: in columns) this rank holds."""
    layout = layouts_of(base).get("weight")
    if layout is not None:
        return layout.segments
    local = base.weight.shape[dim]
    return ((base.rank * local, local),)


def shard_adapter(layer: TensorParallelLoraLinear, adapter: str) -> None:
    """Replace one adapter's full A/B by this rank's slices (and record their layouts)."""
    base: Any = layer.get_base_layer()
    a: Any = layer.lora_A[adapter]
    b: Any = layer.lora_B[adapter]
    if isinstance(base, RowParallelLinear):
        keep_slice(b, ParamLayout(tuple(b.weight.shape), 0, _segments(base, 0)))
        syncs = getattr(base, "tp_grad_sync", {}).get("weight")
        if syncs:  # replicated KV-head rows: their gradient is summed like the base's
            grad_sync.mark(b, "weight", syncs)
    else:
        keep_slice(a, ParamLayout(tuple(a.weight.shape), 1, _segments(base, 1)))
        grad_sync.mark(b, "weight", (GradSync(base.group),))
    grad_sync.install(layer)


def convert(layer: Any) -> TensorParallelLoraLinear:
    """Turn a PEFT ``lora.Linear`` whose base was just swapped for a torchtp layer
    into a :class:`TensorParallelLoraLinear`, keeping this rank's adapter slices.

    Raises:
        TypeError: the LoRA layer is not PEFT's plain ``lora.Linear``.
        ValueError: an adapter uses an option torchtp cannot shard.
    """
    if type(layer) is not LoraLinear:
        raise TypeError(f"LoRA layer {type(layer).__name__} around a tensor-parallel layer is not "
                        "supported; only PEFT's lora.Linear (plain LoRA) is sharded by torchtp")
    if any(layer.lora_bias.values()):
        raise ValueError("LoRA with lora_bias=True is not supported under tensor parallelism")
    if layer.lora_variant:
        raise ValueError("LoRA variants (DoRA, aLoRA, ...) are not supported under tensor "
                         "parallelism; use plain LoRA")
    if layer.merged:
        raise ValueError("the LoRA adapters are merged into the base weights; call "
                         "unmerge_adapter() before wrapping")
    # Same state, torchtp's forward: the adapters PEFT made stay as they are.
    layer.__class__ = TensorParallelLoraLinear
    layer.fan_in_fan_out = False  # the base's local weight is (out, in), even for Conv1D
    for adapter in list(layer.lora_A):
        shard_adapter(layer, adapter)  # type: ignore[arg-type]
    return layer  # type: ignore[return-value]


def parallel_linear_names(model: nn.Module) -> set[str]:
    """Names of torchtp Linear layers that ``"all-linear"`` should target."""
    skip: set[int] = set()
    output = getattr(model, "get_output_embeddings", lambda: None)()  # None: not an HF model
    if output is not None:
        skip.add(id(output))  # like PEFT: never the LM head
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            skip.update(id(m) for m in module.modules() if m is not module)
    return {name for name, m in model.named_modules()
            if isinstance(m, PARALLEL_LINEARS) and id(m) not in skip}


_SAVED = (".lora_A.", ".lora_B.", ".modules_to_save.")  # what PeftModel.save_pretrained writes


def _adapter_group(model: nn.Module) -> Any:
    """The TP group ``model``'s adapters are split over (its LoRA factors, or PEFT's
    ``modules_to_save`` copies of a split layer); None when every one is whole."""
    lora = next((g for g in map(_lora_group, model.modules()) if g is not None), None)
    return lora if lora is not None else split_group(
        m for n, m in model.named_modules() if ".modules_to_save." in f"{n}.")


def consolidated_adapter_state(model: nn.Module) -> tuple[dict[str, Any], Any]:
    """``model.state_dict()`` with every sharded adapter tensor gathered whole: LoRA's
    factors, and PEFT's ``modules_to_save`` copies of a split layer (in checkpoint
    orientation, as the unsharded model holds them; a split layer loads them back:
    ``layers.owned.accept_full_size``).

    Collective over the adapters' TP group. Full tensors land on group
    rank 0; the other ranks keep their slices (they do not write).

    Returns:
        ``(state_dict, group)``.
    """
    state = model.state_dict()
    group = _adapter_group(model)
    items = [p for p in placements(model) if p.layout.dim is not None
             and any(part in p.name for part in _SAVED)]
    layouts = gather_layouts(items, group)
    for p in items:
        full = gather_full(p, layouts, group)
        if full is not None:
            state[p.name] = full
    return state, group


def _lora_group(module: nn.Module) -> Any:
    """The TP group a torchtp LoRA layer's adapters are split over; None for other modules."""
    if isinstance(module, TensorParallelLoraLinear):
        return module.get_base_layer().group
    if isinstance(module, ParamWrapper) and peft_params.split_layout(module) is not None:
        return peft_params.split_group(module.get_base_layer())
    return None


def _save_pretrained(original: Any) -> Any:
    @functools.wraps(original)
    def save_pretrained(self: Any, save_directory: str, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("state_dict") is not None or _adapter_group(self) is None:
            return original(self, save_directory, *args, **kwargs)
        # Over the world, like the agreement below: a save on some ranks only
        # raises on them within min(60 s, TP_TIMEOUT) instead of a Gloo timeout.
        enter("PeftModel.save_pretrained", dist.group.WORLD if dist.is_initialized() else None,
              None)
        state, group = consolidated_adapter_state(self)  # collective over the TP group
        main = kwargs.pop("is_main_process", True) and (
            not dist.is_initialized() or dist.get_rank() == 0)
        error: BaseException | None = None
        try:
            original(self, save_directory, *args, state_dict=state, is_main_process=main, **kwargs)
        except Exception as err:  # reported on every rank by agree()
            error = err
        # Over the world: data-parallel replicas wait for global rank 0's write too.
        agree("PeftModel.save_pretrained", error, {},
              dist.group.WORLD if dist.is_initialized() else group)
    save_pretrained._torchtp = True  # type: ignore[attr-defined]
    return save_pretrained


def _create_new_module(original: Any) -> Any:
    @functools.wraps(original)
    def create(lora_config: Any, adapter_name: str, target: nn.Module, **kwargs: Any) -> Any:
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        name = kwargs.get("parameter_name")
        if name is None:
            refuse_unseen_hooks(base, kwargs.get("target_name"))
        if peft_params.param_layout(base, name) is None:  # else: peft_params.py's hooks
            _refuse_split_parameter(base, name, kwargs.get("target_name"))
        if isinstance(base, PARALLEL_LINEARS):
            compat.peft_register_custom_module(
                lora_config, dict.fromkeys(PARALLEL_LINEARS, TensorParallelLoraLinear))
        new = original(lora_config, adapter_name, target, **kwargs)
        if name is None and not isinstance(base, PARALLEL_LINEARS) and treated_per_rank(base):
            return convert_shared(new)  # a latent attention's kv_a_proj_with_mqa...
        return new
    create._torchtp = True  # type: ignore[attr-defined]
    return staticmethod(create)


def refuse_unseen_hooks(base: nn.Module, where: str | None) -> None:
    """Refuse a LoRA layer around ``base`` when a hook torchtp put on ``base`` would not
    see the LoRA branch PEFT adds beside it, on every rank alike (the plan is).

    ``partial_grad_output`` (a hand-written MoE's router, a Mamba mixer's ``x_proj``):
    the base's output gradient is summed over the group by a hook on its output, so
    the branch's would be this rank's part. ``reduce_input`` (the Linear that reads a
    hand-written MoE's partial sums): the base's input is all-reduced by a pre-hook,
    so the branch would read this rank's partial input.

    Raises:
        ValueError: naming the module, its style and the fix.
    """
    who = f"'{where}' ({type(base).__name__})" if where else type(base).__name__
    if getattr(base, "tp_partial_grad_output", False):
        raise ValueError(f"LoRA adapters on a 'partial_grad_output' layer {who}, a hand-written "
                         "MoE's router or a Mamba mixer's x_proj, whose output meets partial "
                         "sums, are not supported: its output's gradient is summed over the TP "
                         "group by a hook the LoRA branch does not pass; leave it out of "
                         "target_modules (\"all-linear\" includes it: list the modules "
                         "instead)")
    if getattr(base, "tp_reduced_input", False):
        raise ValueError(f"LoRA adapters on a 'reduce_input' layer {who}, whose input is a "
                         "partial sum (a hand-written MoE's combined experts), are not "
                         "supported: torchtp all-reduces that input in a hook the LoRA branch "
                         "does not pass, so the branch would read this rank's part; leave it "
                         "out of target_modules (\"all-linear\" includes it: list the modules "
                         "instead)")


def _refuse_split_parameter(base: nn.Module, name: str | None, where: str | None) -> None:
    """LoRA on a parameter (``target_parameters``, PEFT's ``ParamWrapper``) that torchtp
    split, other than those ``integrations/peft_params.py`` shards: PEFT would size
    and draw the adapter from this rank's shard, so the ranks' adapters would be neither
    the unsharded one's slices nor one another's."""
    layout = layouts_of(base).get(name) if name is not None else None
    if layout is None or layout.dim is None:
        return
    group = getattr(base, "tp_group", None) or getattr(base, "group", None)
    size = f" of {dist.get_world_size(group)} ranks" if dist.is_initialized() else ""
    raise ValueError(
        f"PEFT LoRA on the parameter '{where or name}' of {type(base).__name__} (split over "
        f"the TP group{size} along dim {layout.dim}: {list(layout.full_shape)} -> "
        f"{list(layout.local_shape)} on this rank) is not supported: PEFT would build the "
        "adapter from this rank's shard, not from the whole parameter. Target the module "
        "through target_modules instead (torchtp shards LoRA on its Linears), and give "
        "target_parameters only parameters torchtp keeps whole, split experts' 3-D "
        "parameters or split Linear weights")


def _refuse_split_tokens(original: Any) -> Any:
    @functools.wraps(original)
    def update_layer(self: Any, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        base = self.get_base_layer()
        layouts = layouts_of(base)
        if layouts:
            # PEFT's forward looks the ids up in the merged weight itself
            # (F.embedding / F.linear): on a shard that is the wrong rows, or out of range.
            weight = layouts.get("weight")
            split = "" if weight is None or weight.dim is None else (
                f" (weight {list(weight.full_shape)} split along dim {weight.dim}: "
                f"{list(weight.local_shape)} on this rank)")
            raise ValueError(
                f"PEFT trainable tokens on {type(base).__name__}{split} are not supported "
                "under tensor parallelism: PEFT looks the tokens up in this rank's shard "
                "only. Train the whole layer with modules_to_save=['embed_tokens'] (exact "
                "on a split layer), or keep it whole with plan={'<its name>': 'replicate', "
                "...} when wrapping")
        return original(self, adapter_name, *args, **kwargs)
    update_layer._torchtp = True  # type: ignore[attr-defined]
    return update_layer


def _include_all_linear(original: Any) -> Any:
    @functools.wraps(original)
    def include(peft_config: Any, model: nn.Module) -> Any:
        target = getattr(peft_config, "target_modules", None)
        wanted = isinstance(target, str) and target.lower() == "all-linear"
        out = original(peft_config, model)
        if wanted:
            names = parallel_linear_names(model)
            if names and peft_config.peft_type != PeftType.LORA:
                # PEFT refuses torchtp's layers as targets of these methods: "all-linear"
                # would adapt the replicated Linears only, unlike the unsharded model.
                kind = getattr(peft_config.peft_type, "value", peft_config.peft_type)
                raise ValueError(
                    f"target_modules='all-linear' with {kind} on a "
                    f"tensor-parallel model: torchtp adapts LoRA only, so its {len(names)} "
                    f"split layers (e.g. '{min(names)}', weight rows or columns split over "
                    "the TP group) would be left out; use LoraConfig, or list replicated "
                    "modules in target_modules")
            out.target_modules = set(out.target_modules) | names
        return out
    include._torchtp = True  # type: ignore[attr-defined]
    return include


def install() -> None:
    """Teach PEFT torchtp's layers (idempotent).

    Called when torchtp meets PEFT in use: a wrap while PEFT is imported, a
    wrapped model holding LoRA layers, or the first forward after PEFT was
    imported (see ``integrations/adapter_hosts.py``); never on import.

    Four hooks: LoRA targets whose base is a torchtp layer register
    :class:`TensorParallelLoraLinear` on their ``LoraConfig`` (PEFT's
    custom-module mechanism), LoRA on split experts' parameters and split Linear
    weights keeps each rank's slices (``peft_params.install``: two more hooks, on PEFT's
    ``ParamWrapper``), and LoRA on another parameter torchtp split is refused;
    ``target_modules="all-linear"`` includes torchtp layers for LoRA, wherever
    PEFT expands it (the MoE config conversion too), and is refused for the
    other adapter methods on a model that has them; trainable tokens on a split
    layer are refused; ``PeftModel.save_pretrained`` gathers sharded adapters
    first.
    """
    missing = compat.missing_lora_layer_hooks(LoraLinear) + compat.missing_lora_layer_hooks(
        ParamWrapper)
    if missing:
        raise RuntimeError(
            f"torchtp's LoRA layers override {missing} of peft's LoRA Linear and "
            "ParamWrapper, which this peft does not define: install a checked peft "
            f"({', '.join(compat.CHECKED_PEFT)}), e.g. pip install 'peft=={compat.CHECKED_PEFT[-1]}'")
    owner, name = compat.peft_lora_dispatch_owner()
    if not getattr(getattr(owner, name), "_torchtp", False):
        setattr(owner, name, _create_new_module(getattr(owner, name)))
    for module in compat.peft_all_linear_owners():
        original = getattr(module, compat.PEFT_ALL_LINEAR)
        if not getattr(original, "_torchtp", False):
            setattr(module, compat.PEFT_ALL_LINEAR, _include_all_linear(original))
    owner, name = compat.peft_trainable_tokens_owner()
    if not getattr(getattr(owner, name), "_torchtp", False):
        setattr(owner, name, _refuse_split_tokens(getattr(owner, name)))
    peft_params.install()
    if not getattr(PeftModel.save_pretrained, "_torchtp", False):
        PeftModel.save_pretrained = _save_pretrained(PeftModel.save_pretrained)  # type: ignore[method-assign]
