"""The wrapper's ``loss_parallel`` and ``sequence_parallel`` options: plan edits, then hooks.

Both are HuggingFace features (``torchtp.hf.loss_parallel``,
``torchtp.sp.hf_plan``), imported when an option is on, so a wrap
without them (any plain ``nn.Module``) loads nothing from ``torchtp.hf``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..ep.dispatch import DISPATCH, Dispatch
from ..ep.styles import ExpertsEP, ExpertsTP, check_expert_parallel
from ..ep.whole_experts import place_experts
from ..layers import grad_sync
from ..plans import ResolvedPlan, ShardContext
from ..plans.registry import get_style
from ..plans.sources import experts_layout
from ..plans.styles import ParallelStyle
from ..sp.style import SequenceParallel

if TYPE_CHECKING:
    from ..sp.hf_plan import SequencePlan


class Options:
    """Edits the resolved plan before it is checked, installs hooks after the swap.

    Args:
        loss_parallel: Compute HF causal-LM losses from vocab-split logits.
        sequence_parallel: Run norms/dropout/residuals on sequence shards (also
            on when the plan assigns the ``"sequence_parallel"`` style).
        expert_parallel: Place whole experts on the ranks instead of splitting
            every expert's features (``moe_tp_experts`` -> ``ep_dispatch_experts``);
            an int ``k``: experts over ``k`` ranks, each expert's features over
            ``tp/k`` (``ExpertsEP(ep=k)``).
        expert_dispatch: How tokens reach whole experts (``"auto"``,
            ``"all_reduce"``, ``"all_to_all"``; see ``ExpertsEP``).
        experts_required: A model without experts is an error (the caller asked
            for ``expert_parallel``); ``False`` when it came from the mesh
            (``init_parallel(ep=...)``), which dense models ignore.
    """

    def __init__(self, loss_parallel: bool, sequence_parallel: bool,
                 expert_parallel: bool | int = False, expert_dispatch: Dispatch = "auto",
                 experts_required: bool = True) -> None:
        if expert_dispatch not in DISPATCH:
            raise ValueError(f"expert_dispatch={expert_dispatch!r} is not a dispatch path; "
                             f"valid: {list(DISPATCH)}")
        self.loss_parallel = loss_parallel
        self.sequence_parallel = sequence_parallel
        self.expert_parallel = expert_parallel
        self.expert_dispatch = expert_dispatch
        self.experts_required = experts_required
        self.sequence: SequencePlan | None = None

    def adjust(self, model: nn.Module, plan: ResolvedPlan, ctx: ShardContext) -> None:
        """Before the checks: place whole experts; vocab-split the LM head; mark the norms
        sequence-parallel."""
        if self.expert_parallel is not False:
            place_whole_experts(model, plan, self.expert_parallel, self.expert_dispatch,
                                ctx.world_size, self.experts_required)
        elif self.expert_dispatch != "auto":
            raise ValueError(f"expert_dispatch={self.expert_dispatch!r} chooses how tokens reach "
                             "whole experts, but expert_parallel is off (every expert's "
                             "features are split, one all-reduce); add expert_parallel=True")
        if self.loss_parallel:
            from ..hf.loss_parallel import plan_loss_parallel

            plan_loss_parallel(model, plan, ctx)
        if self.sequence_parallel or any(isinstance(s, SequenceParallel)
                                         for s in plan.assignments.values()):
            from ..sp.hf_plan import plan_sequence_parallel

            self.sequence = plan_sequence_parallel(model, plan, ctx)

    def install(self, model: nn.Module, ctx: ShardContext) -> None:
        """After the swap: the loss switch and the sequence shard/gather hooks."""
        if self.loss_parallel:
            from ..hf.loss_parallel import install_loss_parallel

            install_loss_parallel(model)
        if self.sequence is not None:
            from ..sp.hf_plan import install_sequence_parallel

            install_sequence_parallel(model, self.sequence, ctx)
            grad_sync.install(model)


def place_whole_experts(model: nn.Module, plan: ResolvedPlan, ep: bool | int = True,
                        dispatch: Dispatch = "auto", world_size: int = 1,
                        required: bool = True) -> None:
    """Give every experts module ``ep_dispatch_experts``, saying why.

    Experts the plan splits inside (``moe_tp_experts``) or leaves unplanned
    (a user plan that names none) get whole experts per rank; an experts
    module the plan assigns anything else (``replicate``) keeps it. ``ep=k``
    (an int) places them over ``k`` ranks with each expert's features split over
    ``tp/k`` (:class:`~torchtp.ep.styles.ExpertsEP`); ``k = 1`` is the
    plain feature split (``moe_tp_experts``). ``dispatch`` is ``ExpertsEP``'s.

    A model without such modules gets its hand-written experts placed instead
    (an ``nn.ModuleList`` of expert MLPs the automatic plan sums once, over
    ``world_size``'s TP group, :mod:`torchtp.ep.whole_experts`).

    Raises:
        ValueError: ``ep`` is neither a bool nor a positive int, or the model
            has no experts module, so the option would do nothing.
    """
    style = _experts_style(ep, dispatch)
    found = [name for name, module in model.named_modules()
             if name and experts_layout(module) is not None]
    moved = [name for name in found if name not in plan.assignments
             or isinstance(plan.assignments[name], ExpertsTP)]
    if not found:
        _place_hand_written(model, plan, ep, dispatch, world_size, required)
        return
    why = "expert_parallel=True: whole experts" if ep is True else \
        f"expert_parallel={ep}: experts over {ep} ranks, features over tp/{ep}"
    for name in moved:
        plan.assignments[name] = style
        before = plan.why.get(name)
        plan.why[name] = f"{before}; {why}" if before else why


def _experts_style(ep: bool | int, dispatch: Dispatch) -> ParallelStyle:
    """The experts style ``expert_parallel=ep`` asks for (True: whole experts per rank)."""
    check_expert_parallel(ep)
    if ep is True:
        return get_style("ep_dispatch_experts") if dispatch == "auto" else ExpertsEP(None, dispatch)
    if ep == 1 and dispatch == "all_to_all":
        raise ValueError("expert_dispatch='all_to_all' needs whole experts per rank, but "
                         "expert_parallel=1 splits every expert's features; use "
                         "expert_parallel=True")
    return ExpertsTP() if ep == 1 else ExpertsEP(ep, dispatch)


def _place_hand_written(model: nn.Module, plan: ResolvedPlan, ep: bool | int,
                        dispatch: Dispatch, world_size: int, required: bool = True) -> None:
    """Experts over ``ep`` blocks of the TP group for a hand-written MoE the automatic plan
    sums once (:mod:`torchtp.ep.whole_experts`).

    Raises:
        ValueError: the model has no such experts, ``ep`` does not divide the TP
            size, or all-to-all dispatch is asked for (the one all-reduce only).
    """
    k = world_size if ep is True else int(ep)
    valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if dispatch == "all_to_all" or world_size % k:
        raise ValueError(f"expert_parallel={ep!r}, expert_dispatch={dispatch!r}: a hand-written "
                         f"MoE ({type(model).__name__}) shares its experts out over blocks of "
                         f"the TP group (world_size={world_size}) and sums them with one "
                         f"all-reduce; use expert_dispatch='auto' or 'all_reduce' and "
                         f"expert_parallel=True or one of {valid}")
    lists = place_experts(model, plan, k)
    if not lists and not required:  # init_parallel(ep=...) on a model without experts
        plan.notes.append(f"init_parallel(ep={k}): no experts placed (no transformers experts "
                          "module, and no hand-written experts the automatic plan sums once; "
                          "the other notes say why, if it has some)")
        return
    if not lists:
        raise ValueError(f"expert_parallel={ep!r}, but the model has no transformers experts "
                         f"module and no hand-written experts that the automatic plan sums once "
                         f"(an nn.ModuleList of expert MLPs; {type(model).__name__}, plan source: "
                         f"{plan.source}); drop the option")
    per = world_size // k
    for parent, experts in lists.items():
        for expert in experts:
            for name in plan.assignments:
                if name.startswith(f"{expert}."):
                    plan.why[name] = (f"expert_parallel={ep!r}: '{parent}' holds {len(experts)} "
                                      f"experts over {k} blocks of {per} rank(s) (shard_range), "
                                      "each expert split by features inside its block and "
                                      "absent elsewhere; summed once")
