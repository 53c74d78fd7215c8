"""DistributedModelWrapper: swap a model's Linear layers for parallel ones."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoint import shard_identity
from ..checkpoint.load import from_pretrained
from ..checkpoint.param_count import parameter_summary
from ..checkpoint.save_pretrained import save_pretrained
from ..checkpoint.save_sharded import save_sharded
from ..checkpoint.st_writer import parse_size
from ..comm import overlap as overlap_switch
from ..comm.group_ref import WeakGroup
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config, resolve_group
from ..core import torch_compat as _torch_compat
from ..core.torch_compat import registered_child
from ..ep.dispatch import Dispatch
from ..guards import checks, forward_door, forward_guard, input_check, step_check
from ..layers.ddp_guard import check_fsdp_if_new
from ..layers.parallel_linear import ParallelLinear
from ..plans import ResolvedPlan, ShardContext
from ..plans.resolve import AUTO, PlanArg
from ..training.options import Options
from . import frameworks
from . import tp as tp_step


class DistributedModelWrapper(nn.Module):
    """Make a model tensor-parallel in place and forward calls to it unchanged.

    Every rank builds the same model (same seed or same checkpoint) and wraps
    it; each rank then keeps only its shard of every split layer. Outputs and
    gradients equal the unsharded model's on every rank. At tp 1 the model is
    kept as it is (no module swapped, no hook); a plan or option passed here
    is checked now, torchtp's own plan resolved only when asked for
    (:attr:`resolved_plan`, :meth:`describe_plan`, saves).

    Args:
        model: The model to parallelize; modified in place.
        world_size: Ranks to split over; ``None`` uses the process group's size.
        rank: This rank; ``None`` uses the process group's rank.
        plan: ``{fnmatch pattern: style}`` in PyTorch/HF vocabulary
            (``"colwise"`` splits out_features, ``"rowwise"`` splits in_features,
            ``"colwise_gather_output"``, ``"rowwise_split_input"``,
            ``"packed_colwise"``, ``"embedding_rowwise"``, ``"replicate"``...),
            a path to a YAML/JSON file holding one, or ``None`` (``"auto"``):
            chosen by cost among the model's own HF plan, torchtp's built-in
            plan for its architecture and (any model) the automatic plan that
            pairs Linears by dataflow and splits attention by whole heads; a
            layer split on its own (a head, an embedding) stays split only
            where the memory it saves pays for its collectives. The fastest
            candidate that fits wins; ``describe_plan()`` lists them (see
            docs/performance.md, "How the plan is chosen"). ``"auto-memory"``:
            the candidate with the least memory per rank, every split kept (more
            communication). An explicit plan always wins.
        group: Process group; ``None`` for the default TP group.
        example_inputs: Inputs for one small probe forward of the automatic
            plan (positional args as a tuple, or keyword args as a dict);
            ``None`` derives them from the model's first layer.
        loss_parallel: HF causal LMs: keep the LM head's vocabulary split (weight
            rows) and compute ``outputs.loss`` from the split logits
            (:func:`~torchtp.vocab_parallel_cross_entropy`) when called with
            ``labels=``; ``outputs.logits`` is then this rank's vocabulary slice
            ``(B, T, V_r)``. Without labels (``generate()``) logits are full.
            See docs/sequence_parallel.md.
        sequence_parallel: HF decoders (``torchtp.sp.hf_plan.LAYOUTS``): norms, dropout and
            residual adds run on sequence shards; an all-gather enters each
            attention/MLP block and a reduce-scatter leaves it (instead of an
            all-reduce). Also turned on by a ``"sequence_parallel"`` style in
            the plan. See docs/sequence_parallel.md.
        verify_plan: ``False`` skips the probe that confirms, before any weight
            is cut, that every whole-head attention split computes what the
            unsharded module computes (see docs/concepts.md); a plan it refuses
            then runs as written, and its exactness is the caller's responsibility.
        expert_parallel: Mixture-of-experts models: ``True`` places whole experts
            on the ranks (``E/tp`` each; every rank sees every token, one
            all-reduce per MoE layer) instead of splitting every expert's
            features; an int ``k`` dividing the tp size places the experts over
            ``k`` ranks and splits each expert's features over the ``tp/k`` ranks
            that share them (expert parallel x TP inside the experts, the same
            one all-reduce). ``None`` (default): ``init_parallel(ep=k)``'s ``k``
            when the model is split over that mesh's TP group (``True`` when
            ``k`` is the whole group), applied only if the model has experts;
            otherwise ``False``. See docs/moe.md.
        expert_dispatch: With whole experts per rank (``expert_parallel=True``):
            ``"all_to_all"`` has each rank route a slice of the tokens to the
            experts' ranks and back, ``"all_reduce"`` has every rank run its
            experts on every token routed to them; ``"auto"`` picks per call
            by the cost model (``torchtp.costmodel.expert_dispatch_times``).
        overlap: Overlap communication with computation in every split Linear
            (docs/performance.md): the backward of the weight-rows-split
            projections all-reduces the input gradient while it computes the
            weight gradient, and under sequence parallelism the block input's
            all-gather and output's reduce-scatter run in pieces beside the
            projections' products. ``True``/``False`` forces both on/off;
            ``None`` (default) follows the ``TP_OVERLAP`` environment variable,
            else the measured default per device (``torchtp.comm.overlap.AUTO``).
            Outputs and gradients are the same either way.
        max_memory_per_rank: The most parameter bytes each rank may hold (an
            int, or a size such as ``"2GiB"``, ``"500MB"``): with no explicit
            plan, the fastest candidate that fits, splitting more layers that
            would otherwise stay whole; an explicit plan that does not fit
            raises. ``None`` (default): the fastest plan within 5% of the
            leanest candidate's memory. Gradients and optimizer state scale
            with the parameters (x2 to x4 more in training).

    Attributes:
        base_model: The parallelized model.
        world_size: Number of ranks.
        rank: This rank.
        parallelized_layers: Names of the swapped layers, in module order (none at tp 1).
        resolved_plan: The :class:`~torchtp.plans.ResolvedPlan` that was applied
            (at tp 1: the plan at tp 1, resolved on first use).
        valid_world_sizes: Every tp size (up to 64) this model and plan accept.

    Raises:
        ValueError: a layer cannot be split as planned, the plan names an
            unknown style, the model is already wrapped, or ``world_size``
            contradicts the process group. Raised on every rank.
        RankMismatchError: ranks disagree on world size, plan or layer shapes.
    """

    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # the TP group, held weakly (comm.group_ref)

    def __init__(
        self, model: nn.Module, world_size: int | None = None, rank: int | None = None,
        plan: PlanArg = None, group: ProcessGroup | None = None,
        example_inputs: object = None, *,
        loss_parallel: bool = False, sequence_parallel: bool = False, verify_plan: bool = True,
        expert_parallel: bool | int | None = None, expert_dispatch: Dispatch = "auto",
        overlap: bool | None = None,
        max_memory_per_rank: int | str | None = None,
    ) -> None:
        super().__init__()
        group = resolve_group(group)
        error: BaseException | None = None
        ctx, resolved, fingerprint = None, None, {"world_size": world_size}
        steps = frameworks.STEPS  # PEFT adapters, framework guards (torchtp.integrations)
        detached: Any = None
        expert_parallel, required = _experts_option(expert_parallel, group)
        flags = (loss_parallel, sequence_parallel, expert_parallel, expert_dispatch)
        try:
            checks.refuse_wrapped(model, DistributedModelWrapper)
            budget = memory_budget(max_memory_per_rank)
            ctx = tp_step.place(model, world_size, rank, group)
            if ctx.world_size == 1:  # nothing to split: the model runs whole (decision 106)
                self._keep_whole(model, ctx, (plan, flags, example_inputs, verify_plan, budget))
                return
            options = Options(*flags, experts_required=required)
            detached = steps.set_aside(model)  # LoRA layers: planned on their base layers
            resolved = tp_step.resolve(model, plan, ctx, options, example_inputs, verify_plan,
                                       budget)
            period = {f"{step_check.ENV} (optimizer-step check period)":
                      step_check.period_from_env(),
                      f"overlap (overlap= or {overlap_switch.ENV})":
                      overlap_switch.describe(overlap)} if ctx.world_size > 1 else {}
            fingerprint = checks.before_slicing(model, resolved, ctx, flags, period)
        except Exception as err:
            # Any rank-local error (e.g. a plan file missing on one node), not only
            # validation errors, must reach the agreement, or the other ranks hang in it.
            error = err
        try:
            # Every rank reaches this point, so a rank-local error raises everywhere.
            checks.agree(error, fingerprint, ctx, group)
            assert ctx is not None and resolved is not None
            self.base_model = model
            self.world_size, self.rank, self.group = ctx.world_size, ctx.rank, ctx.group
            self.__dict__["_resolved"] = resolved
            self.__dict__["_fsdp_slot"] = None  # see __call__
            # What the ranks agreed on, weights' digests included: saved shards record a
            # digest of it (shard_identity.origin), computed when a state dict is taken.
            self.__dict__["_wrap_fingerprint"] = fingerprint
            self.parallelized_layers = tp_step.apply(model, resolved, ctx, options)
            set_overlap(model, overlap)
            self.loss_parallel = loss_parallel
            self.sequence_parallel = options.sequence is not None
            steps.after_wrap(self)  # HF model methods; accelerate's and Lightning's DDP
            forward_door.install(model, ctx, self.parallelized_layers)
            self.train(model.training)
        finally:
            steps.put_back(detached)  # around the parallel base layers (or restored on error)

    def _keep_whole(self, model: nn.Module, ctx: ShardContext, planning: tuple[Any, ...]) -> None:
        """tp 1: keep every module as it is; plan now only what the caller gave.

        One rank holds every weight whole, so no layer is swapped, no rank has
        anyone to agree with and no hook runs per call: the model computes
        exactly what it computed before wrapping. A plan, a plan file, an
        option or probe inputs the caller passed are resolved now, so a bad
        one raises here at any tp; torchtp's own plan (``plan=None``) is
        resolved on first use of :attr:`resolved_plan` (:meth:`describe_plan`,
        saves). Neither changes the model.
        """
        plan, flags, example_inputs, verify, budget = planning
        self.base_model = model
        self.world_size, self.rank, self.group = ctx.world_size, ctx.rank, ctx.group
        self.__dict__.update(_resolved=None, _planning=(ctx, plan, flags, verify, budget),
                             _wrap_fingerprint={"world_size": 1})
        self.parallelized_layers = []
        self.loss_parallel, self.sequence_parallel = flags[0], False
        self.training = model.training
        # an option other than the defaults
        asked = any(flags[:3]) or flags[3] != "auto" or budget is not None
        if (plan is not None and plan not in AUTO) or asked or example_inputs is not None:
            self._plan_whole(example_inputs)

    def _plan_whole(self, example_inputs: object = None) -> ResolvedPlan:
        """Resolve the plan at tp 1 as the wrap would, on the model's base layers (PEFT's
        adapters set aside meanwhile), without changing the model."""
        ctx, plan, flags, verify, budget = self.__dict__["_planning"]
        options = Options(*flags)
        steps = frameworks.STEPS
        detached = steps.set_aside(self.base_model)
        try:
            resolved = tp_step.resolve(self.base_model, plan, ctx, options, example_inputs,
                                       verify, budget)
        finally:
            steps.put_back(detached)
        self.__dict__["_resolved"] = resolved
        self.sequence_parallel = options.sequence is not None
        return resolved

    @property
    def resolved_plan(self) -> ResolvedPlan:
        """The plan that was applied (source, rules, per-module styles and why, notes).

        At tp 1 nothing is applied: this is the plan as resolved at tp 1.
        """
        resolved = self.__dict__.get("_resolved")
        return resolved if resolved is not None else self._plan_whole()

    @property
    def valid_world_sizes(self) -> list[int]:
        """Every tp size (up to 64) this model and plan accept."""
        return self.resolved_plan.valid_world_sizes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Before the module's hooks: FSDP2's pre-forward hook would replace the
        # sharded DTensor parameters that the composition check looks at.
        # One rank has no peers to mix up: nothing to check or switch at tp 1.
        if self.world_size > 1 and not torch.compiler.is_compiling():
            # FSDP2 over TP peers, checked when the first parameter object or a module
            # was replaced
            slot = self.__dict__["_fsdp_slot"]
            if slot is None or slot[0].get(slot[1]) is not slot[2] \
                    or slot[3] != _torch_compat.REPLACEMENTS:
                self.__dict__["_fsdp_slot"] = check_fsdp_if_new(self.base_model, self.group, slot)
        return super().__call__(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped model unchanged.

        An exception escaping it on some ranks only (or a backward through its
        outputs that raised) is reported to the group: if it leaves the ranks'
        collectives misaligned, every later collective raises
        :class:`~torchtp.InconsistentGroupError` naming the rank.
        """
        if torch.compiler.is_compiling():  # the forward door refuses compiled dropout
            return self.base_model(*args, **kwargs)
        try:
            return self.base_model(*args, **kwargs)
        except BaseException as err:  # the model's hooks report Exceptions (forward_guard)
            forward_guard.report_interrupted(self.group, err)
            raise

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = registered_child(self, "base_model")
            if base is None:
                raise
            return getattr(base, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shards, with the original model's parameter names.

        Its ``_metadata`` (kept by ``torch.save``) records this rank, the tp
        size, the layout and a model fingerprint, which :meth:`load_state_dict` checks.
        """
        return shard_identity.stamp(self.base_model.state_dict(*args, **kwargs), self)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Collective over the TP group: load this rank's shards (names as in :meth:`state_dict`).

        A full-size tensor (the unsharded model's, in its orientation) for a split
        parameter loads as this rank's slice of it.

        Raises:
            ValueError: on every rank, when a rank was given another rank's state dict
                (or one saved at another tp or plan), naming both ranks.
            RankMismatchError: on every rank, when the ranks' state dicts come from
                different models or saves (names the replicated parameter that differs).
            RuntimeError: not every rank called it within min(60 s, ``TP_TIMEOUT``).
        """
        return shard_identity.load(self, state_dict, strict, assign)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], plan: PlanArg = None, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None, model_class: type | None = None,
        group: ProcessGroup | None = None, progress: bool = True, verify_plan: bool = True,
        expert_parallel: bool | int | None = None, expert_dispatch: Dispatch = "auto",
        max_memory_per_rank: int | str | None = None, overlap: bool | None = None,
    ) -> DistributedModelWrapper:
        """Build the model on meta, wrap it, and read only this rank's shard of each tensor.

        Args:
            path: An HF model directory (``config.json`` + ``model.safetensors`` or
                sharded with ``model.safetensors.index.json``) or a torchtp
                sharded checkpoint saved at any tp (see :meth:`save_sharded`).
            plan: As for the constructor (same resolution order).
            dtype: Cast floating tensors to it; ``None`` keeps the checkpoint's dtypes.
            device: Where the tensors go (default: the rank's device from
                :func:`~torchtp.get_tensor_parallel_config`, CUDA under NCCL).
            model_class: Class to build from the config (default: the config's
                ``architectures``, else ``AutoModelForCausalLM``/``AutoModel``).
            group: Process group; ``None`` for the default TP group.
            progress: Show a progress bar on rank 0 (only on a TTY, after 1 s).
            verify_plan: As for the constructor (the probe runs on a one-layer
                CPU copy built from the config, since the model is on meta).
            expert_parallel: As for the constructor; a checkpoint saved with
                any split of the experts loads into any other.
            expert_dispatch: As for the constructor.
            max_memory_per_rank: As for the constructor.
            overlap: As for the constructor.

        Raises:
            ValueError: on every rank, for a missing/corrupt/truncated file, a
                missing tensor or index entry, a shape different from the
                config, metadata from another model, or a tp the model cannot
                split at (naming the saved tp, the current tp and the dimension).
        """
        group = resolve_group(group)
        return from_pretrained(lambda model: cls(model, plan=plan, group=group,
                                                 verify_plan=verify_plan,
                                                 expert_parallel=expert_parallel,
                                                 expert_dispatch=expert_dispatch,
                                                 max_memory_per_rank=max_memory_per_rank,
                                                 overlap=overlap),
                               path, plan, dtype, device, model_class, group, progress)

    def save_sharded(self, directory: str | os.PathLike[str], timeout: float | None = None) -> None:
        """Collective: every rank writes its shard, rank 0 the metadata (see docs/checkpoints.md).

        Raises:
            RuntimeError: not every rank called it within ``timeout`` seconds
                (default 60 s, or ``TP_TIMEOUT`` if shorter; at once when the
                missing ranks already exited).
            ValueError: the directory cannot be written (on every rank; the
                previous checkpoint there stays intact).
        """
        save_sharded(self, directory, timeout)

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                        timeout: float | None = None) -> None:
        """Collective: a consolidated HF directory, gathered one tensor at a time on rank 0.

        Raises:
            RuntimeError: not every rank called it within ``timeout`` seconds
                (default 60 s, or ``TP_TIMEOUT`` if shorter; at once when the
                missing ranks already exited).
            ValueError: the directory cannot be written (on every rank).
        """
        save_pretrained(self, directory, max_shard_size, timeout)

    def describe_plan(self) -> str:
        """The applied plan as text (rules, every module's final style and why, collectives,
        how the input check travels), then this rank's and the full model's parameter counts."""
        plan = self.resolved_plan
        lines = [plan.table(), parameter_summary(self.base_model)]
        if self.group is not None:  # a planning-only wrap (no group) runs no check
            lines.insert(1, input_check.describe(self.world_size, plan.collectives()))
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, rank={self.rank}, "
                f"parallelized_layers={len(self.parallelized_layers)}")


def memory_budget(value: int | str | None) -> int | None:
    """``max_memory_per_rank`` in bytes (``None``: no budget).

    Raises:
        ValueError: not a positive size (an int, or a number with a unit such as ``"2GiB"``).
    """
    if value is None:
        return None
    try:
        budget = parse_size(value) if isinstance(value, (int, str)) else -1
    except ValueError:
        budget = -1
    if isinstance(value, bool) or budget <= 0:
        raise ValueError(f"max_memory_per_rank={value!r} is not a size; give the most "
                         "parameter bytes per rank as a positive int or a number with a unit, "
                         "e.g. '2GiB', '500MB'")
    return budget


def _experts_option(asked: bool | int | None, group: ProcessGroup | None
                    ) -> tuple[bool | int, bool]:
    """The experts' split, and whether the model must have experts for it.

    As asked; else ``init_parallel(ep=k)``'s ``k`` for the mesh's TP group (a
    default that leaves models without experts alone); else ``False``.
    """
    if asked is not None:
        return asked, True
    cfg = get_tensor_parallel_config()
    if cfg.ep_size > 1 and group is cfg.group:
        return (True if cfg.ep_size == cfg.world_size else cfg.ep_size), False
    return False, True


def set_overlap(model: nn.Module, overlap: bool | None) -> None:
    """Set the ``overlap`` attribute of every split Linear of ``model`` (see :mod:`torchtp.comm.overlap`)."""
    for module in model.modules():
        if isinstance(module, ParallelLinear):
            module.overlap = overlap
