"""Run a decoder LM's pipeline stages with PyTorch's schedules, loss as one process has it.

``torch.distributed.pipelining`` does the sends, receives and the order of
microbatch forwards and backwards. torchtp adds what makes the result the
unsplit model's:

* the loss is the token mean over the **whole batch**, over every
  data-parallel replica: each microbatch's summed cross-entropy (labels
  shifted as HuggingFace's causal-LM loss does, ``ignore_index`` skipped) is
  divided by the number of counted tokens in the global batch (times the
  replicas, whose gradients DDP and FSDP2 average), and the schedule does not
  rescale gradients, so padding spread unevenly over the microbatches or the
  replicas changes nothing;
* before the first send of every step, the stages agree (one small
  all-reduce over the pipeline group) that the batch's shapes are valid and
  that every stage was given the same batch, so a bad or mismatched batch
  raises everywhere instead of leaving a stage waiting in a receive;
* tied input/output embeddings (first and last stage) get their gradients
  summed, and the clip counts them once;
* with a context-parallel group (``init_parallel(pp=..., cp=...)``) each stage
  computes on its ``T/cp`` tokens of every sequence (:mod:`torchtp.cp.pipeline`):
  labels shifted over the full rows before the cut, the loss's divisor the
  whole batch's tokens, and gradients summed over cp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from ..comm import ops as _comm
from ..comm.group_ref import WeakGroup
from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config, group_size, resolve_group
from ..core import torch_compat as _torch_compat
from ..core.errors import RankMismatchError
from ..cp import grads as _cp_grads
from ..cp import pipeline as _cp_pipeline
from ..guards.agreement import agree
from ..guards.fingerprints import tensor_digest
from ..layers.owned import split_group
from ..training.clip import local_norm_share
from .placement import SCHEDULES, schedule_kind, stage_ids
from .stage import Stage

__all__ = ["SCHEDULES", "PipelineSchedule"]

WHO_CP = "PipelineSchedule step (every cp rank must get the same batch)"


class _WeakStage(PipelineStage):
    """torch's pipeline stage, holding its group weakly (:mod:`torchtp.comm.group_ref`): a
    schedule the script keeps must not keep the group alive past its destruction."""

    group: WeakGroup[ProcessGroup | None] = WeakGroup()


# Shape inference on zeros, not uninitialized memory, so a stage's tensor-parallel
# ranks compute alike (an MoE router's routes are checked across them).
_Stage = _torch_compat.zeroed_shape_inference(_WeakStage)


class PipelineSchedule:
    """One training step's forward and backward over every stage.

    Args:
        stages: This rank's stage (:func:`~torchtp.pipeline.decoder_stage`,
            :func:`~torchtp.pipeline.block_stage`) or, for the interleaved and
            V-shaped schedules, its stages in the order of
            :func:`~torchtp.pipeline.stage_ids`, each as it is or inside
            ``DistributedDataParallel`` / ``fully_shard`` over the
            data-parallel group.
        microbatches: Microbatches per step (the batch must divide into them;
            ``"1f1b"`` needs at least as many as stages).
        schedule: A name of :data:`~torchtp.pipeline.placement.SCHEDULES`.
        group: The pipeline's process group (its rank ``r`` holds the stages
            ``stage_ids(schedule, r, size, per_rank)``); ``None``: the ``pp``
            group of ``init_parallel``'s mesh (no group at ``pp=1``), else the
            whole world.
        ignore_index: Labels not counted in the loss.
        dp_group: The data-parallel group of the replicas whose gradients DDP or
            FSDP2 average; ``None``: ``init_parallel``'s ``dp`` group (none
            without one). With more than one replica every stage must be inside
            DDP over that group or ``fully_shard``: otherwise each replica would
            step on its own gradients.
        loss_fn: ``loss_fn(output, target)``: one microbatch's **summed** loss
            (``reduction="sum"``); the step's loss is its sum over the
            microbatches divided by the global batch's rows (a mean over the
            examples). ``None``: HuggingFace's causal-LM loss, a token mean
            (see :meth:`step`). Not with context parallelism (it would see
            this rank's tokens only).
        cp_group: The context-parallel group (pp x cp, docs/context_parallel.md);
            ``None``: ``init_parallel``'s ``cp`` group (none without one).

    Raises:
        ValueError: an unknown schedule, stages that do not fit the schedule
            and group, a microbatch count the schedule cannot run, or
            data-parallel replicas without DDP or FSDP2: the same error on
            every rank of the pipeline group (its ranks agree before anyone
            goes on).
    """

    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # the pipeline group, held weakly (comm.group_ref)
    dp_group: WeakGroup[ProcessGroup | None] = WeakGroup()
    cp_group: WeakGroup[ProcessGroup | None] = WeakGroup()
    _tied: WeakGroup[ProcessGroup | None] = WeakGroup()

    def __init__(self, stages: nn.Module | Sequence[nn.Module], microbatches: int,
                 schedule: str = "1f1b", group: ProcessGroup | None = None,
                 ignore_index: int = -100, dp_group: ProcessGroup | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 cp_group: ProcessGroup | None = None) -> None:
        given = [stages] if isinstance(stages, nn.Module) else list(stages)
        self.stages: list[Stage] = [_stage_of(m) for m in given]
        self.microbatches, self.ignore_index = microbatches, ignore_index
        self._user_loss = loss_fn
        self.group = _pipeline_group(group)
        self.dp_group = resolve_group(dp_group, "dp")
        self.cp_group = resolve_group(cp_group, "cp")
        error = _invalid(self.stages, given, microbatches, schedule, self.group, self.dp_group)
        if error is None and loss_fn is not None and group_size(self.cp_group) > 1:
            error = ValueError("loss_fn with context parallelism: it would see this rank's "
                               "tokens only; use the default causal-LM loss under pp x cp")
        agree("PipelineSchedule", error,
              {"schedule": schedule, "microbatches": microbatches,
               "stages": self.stages[0].stages if self.stages else None}, self.group)
        self._cp = None if group_size(self.cp_group) == 1 else \
            _cp_pipeline.prepare_stages(given, self.cp_group)
        self._given = given
        self._summed = [-1] * len(given)  # each stage's parameters summed over cp (counts)
        self._sum_over_cp()
        kind = schedule_kind(schedule)
        device = next(self.stages[0].parameters()).device
        self._pipes = [_Stage(m, s.stage, s.stages, device, group=self.group)
                       for m, s in zip(given, self.stages, strict=True)]
        pipes: Any = self._pipes[0] if kind.style == "single" else self._pipes
        self._schedule = kind.cls(pipes, n_microbatches=microbatches, loss_fn=self._loss,
                                  scale_grads=False)
        self._replicas = group_size(self.dp_group)
        self._counted = torch.ones(())
        self._tied = _tied_group(self.group, kind.style) if self.stages[0].tied else None

    @property
    def stage(self) -> Stage:
        """This rank's first (with one stage per rank: its only) stage."""
        return self.stages[0]

    @property
    def holds_first(self) -> bool:
        """This rank holds the first stage (it reads the token ids)."""
        return any(s.is_first for s in self.stages)

    @property
    def holds_last(self) -> bool:
        """This rank holds the last stage (it computes the loss)."""
        return any(s.is_last for s in self.stages)

    def describe(self) -> str:
        """Which blocks each stage holds and its parameter bytes, as a table.

        Collective over the pipeline group (one object gather); the same text
        on every rank. Bytes are this TP rank's (its shards), which every TP
        rank of a stage holds alike up to uneven splits.
        """
        mine = [_summary(s) for s in self.stages]
        rows = sorted(r for everyone in all_gather_object(mine, self.group, "describe()")
                      for r in everyone)
        lines = [f"pipeline: {len(rows)} stages, schedule {type(self._schedule).__name__}, "
                 f"{self.microbatches} microbatches",
                 "stage  rank  blocks      holds                      parameters        bytes"]
        for stage, rank, blocks, holds, count, nbytes in rows:
            lines.append(f"{stage:>5}  {rank:>4}  {blocks:<10}  {holds:<25}  {count:>10,}  "
                         f"{nbytes:>11,}")
        return "\n".join(lines)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor,
             counted: int | None = None) -> torch.Tensor | None:
        """Forward and backward of the batch; gradients accumulate in this rank's stages.

        Args:
            input_ids: ``(B, T)`` token ids, the same on every stage of a
                pipeline (the first reads them); with data parallelism each
                replica's own share of the global batch.
            labels: ``(B, T)``, alike (the last stage reads them); shifted by
                one inside, as HuggingFace's causal-LM loss does.
            counted: The tokens the loss is a mean over, over every replica;
                ``None``: this step's global batch's counted tokens. For
                gradient accumulation over several ``step`` calls before one
                optimizer step, pass the count of the whole accumulation window
                (every batch's labels on every replica, shifted, not
                ``ignore_index``): the summed gradients then equal one step over
                all those batches.

        Returns:
            On the rank holding the last stage the global batch's loss (token
            mean, as one process computes it; equal on every replica), ``None``
            on the others.

        Raises:
            ValueError: shapes that differ, a batch that does not split into
                the microbatches, or token ids or labels outside the vocabulary:
                on every stage, before the first send.
            RankMismatchError: the stages were given different batches.
        """
        return self._run(input_ids, labels, counted, train=True)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The batch's loss, forward only (PyTorch's ``eval`` of the schedule): no gradients.

        Takes and checks the batch as :meth:`step` does; the modules' own
        ``train()``/``eval()`` mode (dropout) is the caller's.

        Returns:
            On the rank holding the last stage the global batch's loss, as
            :meth:`step` returns it; ``None`` on the others.
        """
        return self._run(input_ids, labels, None, train=False)

    def _run(self, input_ids: torch.Tensor, labels: torch.Tensor, counted: int | None,
             train: bool) -> torch.Tensor | None:
        self._agree_on_batch(input_ids, labels)
        own = (labels[:, 1:] != self.ignore_index).sum() if self._user_loss is None \
            else torch.tensor(labels.shape[0])  # counted tokens (labels shifted by one), or rows
        if self._cp is not None:  # this rank's tokens, labels shifted over the full rows
            agree(WHO_CP, None, {"batch": tensor_digest(input_ids) + tensor_digest(labels)},
                  self.cp_group)
            local = _cp_pipeline.cut(input_ids, labels, self.cp_group, self._cp,
                                     self.ignore_index)
            input_ids, labels = local.input_ids, local.labels  # type: ignore[assignment]
            own = torch.tensor(local.tokens)
            self._sum_over_cp()
        try:
            return self._schedule_run(input_ids, labels, own, counted, train)
        finally:
            if self._cp is not None:
                self._cp.batch = None

    def _sum_over_cp(self) -> None:
        """Sum every stage parameter's gradient over cp, those added since (PEFT adapters)
        included: each rank's backward covers its own tokens only."""
        if self._cp is not None:
            self._summed = [_cp_grads.refresh(m, self.cp_group, known)
                            for m, known in zip(self._given, self._summed, strict=True)]

    def _schedule_run(self, input_ids: torch.Tensor, labels: torch.Tensor, own: torch.Tensor,
                      counted: int | None, train: bool) -> torch.Tensor | None:
        if counted is None and self._replicas > 1:
            own = _comm.all_reduce(own, self.dp_group)  # the global batch's tokens
        # DDP and FSDP2 average the replicas' gradients: each counts its share times replicas.
        self._counted = (own if counted is None else torch.tensor(counted)) / self._replicas
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": labels, "losses": losses} if self.holds_last else {}
        run = self._schedule.step if train else self._schedule.eval
        if self.holds_first:
            run(input_ids, **kwargs)
        else:
            run(**kwargs)
        if train:
            self._sum_tied()
        if not self.holds_last:
            return None
        loss = torch.stack(losses).sum() / self._replicas  # this replica's share
        if self._cp is not None:  # each cp rank summed its own tokens
            loss = _comm.all_reduce(loss.detach(), self.cp_group)
        return _comm.all_reduce(loss.detach(), self.dp_group) if self._replicas > 1 else loss

    def _agree_on_batch(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Every stage checks the batch's shapes and that all got the same batch, together."""
        error = self._batch_error(input_ids, labels)
        bad = error is not None
        if group_size(self.group) == 1:
            if error is not None:
                raise error
            return
        digest = tensor_digest(input_ids) + tensor_digest(labels)
        ride = _comm.ride_hash(self.group, digest.encode(), input_ids.device)
        flag = _comm.ride_next_collective(self.group, torch.tensor([int(bad)], dtype=torch.uint8),
                                          input_ids.device)
        refused = _comm.ride_result(self.group, flag)[0]
        same = _comm.ride_agrees(self.group, ride, group_size(self.group))
        if error is not None:
            raise error
        if refused:
            raise ValueError(f"{int(refused)} stage(s) of this pipeline refused their batch "
                             "(their error says why); every stage must be given the same "
                             "(batch, tokens) input_ids and labels")
        if not same:
            raise RankMismatchError(
                "the pipeline's stages were given different batches (input_ids or labels "
                "differ): the last stage's labels would not belong to the first stage's "
                "tokens; give every stage of a pipeline the same batch (with data "
                "parallelism: shard the data over the dp group, not over the pp group)")

    def _batch_error(self, input_ids: torch.Tensor, labels: torch.Tensor) -> ValueError | None:
        """Why the batch cannot run (shapes, or ids and labels outside the vocabulary), or
        ``None``: what would otherwise raise on one stage in the middle of the schedule."""
        if self._user_loss is not None:  # any shapes: the same rows, dividing into microbatches
            if not input_ids.dim() or not labels.dim() or input_ids.shape[0] != labels.shape[0] \
                    or input_ids.shape[0] % self.microbatches:
                return ValueError(f"inputs {tuple(input_ids.shape)} and targets "
                                  f"{tuple(labels.shape)}: give both with the same rows (dim 0), "
                                  f"a number that divides into microbatches={self.microbatches}")
            return None
        if input_ids.shape != labels.shape or input_ids.dim() != 2 \
                or input_ids.shape[0] % self.microbatches:
            return ValueError(f"input_ids {tuple(input_ids.shape)} and labels "
                              f"{tuple(labels.shape)}: give both as (batch, tokens) with a batch "
                              f"that divides into microbatches={self.microbatches}")
        vocab = self.stage.vocab_size or 0
        counted = labels[labels != self.ignore_index]
        for name, t in (("input_ids", input_ids), ("labels", counted)):
            outside = t[(t < 0) | (t >= vocab)] if vocab and t.numel() else t[:0]
            if outside.numel():
                return ValueError(f"{name} hold {outside.numel()} value(s) outside the "
                                  f"vocabulary [0, {vocab}) (e.g. {int(outside[0])})"
                                  + (f", other than ignore_index={self.ignore_index}"
                                     if name == "labels" else "")
                                  + ": every stage refuses the batch before the first send")
        return None

    def _sum_tied(self) -> None:
        """Tied embeddings: the first and last stage hold copies; both get the summed gradient."""
        copies = [w for s in self.stages if (w := s.tied_weight()) is not None]
        grads = [_local(w.grad) for w in copies if w.grad is not None]
        if not grads:
            return
        if len(grads) == 2:  # both copies on this rank (V-shaped schedules)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif self._tied is not None:
            _comm.all_reduce_(grads[0], self._tied)  # (V, H), or this TP rank's rows of it

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        tp_group: ProcessGroup | None = None) -> torch.Tensor:
        """Clip this rank's gradients by the whole model's norm, over every stage.

        Each stage's share of the norm is torchtp's (as in
        :func:`torchtp.grad_norm`: split parameters counted once over the
        stage's TP group ``tp_group``, ``None``: the group its torchtp layers
        are split over, if any; replicas and FSDP2 shards weighted by the
        ``dp`` size); the shares
        are summed over the TP group and the pipeline group, or over the world
        when ``init_parallel`` built a ``dp`` dimension, so every rank of
        every stage applies the factor ``torch.nn.utils.clip_grad_norm_``
        would apply to the unsplit model.

        Returns:
            The total norm before clipping (0-dim float64, equal on every rank).
        """
        params = [w for s in self.stages for w in s.parameters() if w.grad is not None]
        # A tied embedding is one weight: counted on the first stage, not again on the last.
        copy = next((s.tied_weight() for s in self.stages if s.is_last), None)
        order = float(norm_type)
        device = next(self.stages[0].parameters()).device
        tp = tp_group if tp_group is not None else _tp_group_of(self.stages)
        share, reduce_over = local_norm_share([w for w in params if w is not copy], norm_type,
                                              tp, device)
        share = share.double()  # one dtype on every stage, whatever each stage's gradients
        how = "max" if math.isinf(order) else "sum"
        if reduce_over is dist.group.WORLD:  # every stage's TP and DP ranks in one sum
            share = _comm.all_reduce(share, reduce_over, how)
        else:
            if group_size(reduce_over) > 1:
                share = _comm.all_reduce(share, reduce_over, how)
            if group_size(self.group) > 1:
                share = _comm.all_reduce(share, self.group, how)
        total = share if math.isinf(order) else share ** (1.0 / order)
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One microbatch's share of the batch's token-mean loss: ``(b, T, V)``, ``(b, T)``."""
        if self._user_loss is not None:  # summed over the microbatch; a mean over all rows
            return self._user_loss(logits, labels) / self._counted
        if self._cp is None:  # shifted by one, as HuggingFace's loss
            logits, labels = logits[:, :-1], labels[:, 1:]
        # else (b, T/cp, V): the labels were shifted over the full rows before the cut
        flat = logits.reshape(-1, logits.shape[-1])  # (b*T', V)
        # At least float32, as HuggingFace's loss upcasts half-precision logits.
        flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
        summed = F.cross_entropy(flat, labels.reshape(-1), ignore_index=self.ignore_index,
                                 reduction="sum")
        return summed / self._counted


def _summary(stage: Stage) -> tuple[int, int, str, str, int, int]:
    """``(stage, pipeline rank, blocks, what else it holds, parameters, bytes)``."""
    params = list(stage.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    blocks = f"{stage.layers.start}..{stage.layers.stop - 1}" if len(stage.layers) else "-"
    holds = ", ".join(w for w, on in (("input (embeddings)", stage.is_first),
                                      ("output (norm, head)", stage.is_last)) if on) or "-"
    if stage.tied:
        holds += " (tied copy)" if stage.is_first or stage.is_last else ""
    return (stage.stage, rank, blocks, holds, sum(p.numel() for p in params),
            sum(p.numel() * p.element_size() for p in params))


def _stage_of(module: nn.Module) -> Stage:
    """The :class:`Stage` of ``module``: itself (also after ``fully_shard``) or DDP's."""
    inner = getattr(module, "module", module)  # DistributedDataParallel(stage).module
    if not isinstance(inner, Stage):
        raise TypeError(f"PipelineSchedule takes pipeline stages (from decoder_stage, "
                        f"decoder_stages or block_stage), optionally inside DDP or fully_shard; "
                        f"got {type(module).__name__}")
    return inner


def _tp_group_of(stages: list[Stage]) -> ProcessGroup | None:
    """The TP group the stages' torchtp layers are split over (the largest, past expert
    blocks), or ``None``: not tensor-parallel."""
    return split_group(m for s in stages for m in s.modules())


def _pipeline_group(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is not None or not dist.is_initialized():
        return group
    cfg = get_tensor_parallel_config()
    # init_parallel's mesh names the pipeline group (none at pp 1); without one, the world.
    return cfg.pp_group if cfg.mesh is not None else dist.group.WORLD


def _invalid(stages: list[Stage], given: list[nn.Module], microbatches: int,
             schedule: str, group: ProcessGroup | None,
             dp_group: ProcessGroup | None) -> ValueError | None:
    """Why these stages cannot run ``schedule`` on this rank of ``group``, or ``None``."""
    states = [getattr(m, "torchtp_cp", None) for g in given for m in g.modules()]
    if any(state is not None and not state.pipeline for state in states):
        # ContextParallel's forward (which a schedule does not call) would own its batch.
        return ValueError("a pipeline stage inside ContextParallel cannot run in a "
                          "PipelineSchedule: give PipelineSchedule the bare stage, and it "
                          "splits the sequences over init_parallel's cp group itself "
                          "(docs/context_parallel.md, pp x cp)")
    total = stages[0].stages if stages else 0
    try:
        kind = schedule_kind(schedule)
        need = max(1, kind.min_microbatches_per_stage * total)
        if microbatches < need:
            raise ValueError(f"microbatches={microbatches}: schedule {schedule!r} over "
                             f"{total} stages needs at least {need}")
        size, rank = group_size(group), dist.get_rank(group) if group is not None else 0
        want = stage_ids(schedule, rank, size, len(stages))
    except ValueError as err:
        return err
    have = [s.stage for s in stages]
    if have != want or any(s.stages != total for s in stages) or total != size * len(want):
        return ValueError(f"pipeline rank {rank} of {size} holds stages {have} of {total}; "
                          f"schedule {schedule!r} places stages {want} of "
                          f"{size * len(want)} here (stage_ids({schedule!r}, {rank}, {size}, "
                          f"{len(want)})): build them with decoder_stages(model, that list, "
                          f"{size * len(want)})")
    return _dp_misfit(given, dp_group)


_DDP_FIX = ("DistributedDataParallel(stage, process_group=cfg.dp_group, "
            "find_unused_parameters=True)")


def _dp_misfit(given: list[nn.Module], dp_group: ProcessGroup | None) -> ValueError | None:
    """Why the stages' gradients would not be averaged exactly over ``dp_group``, or ``None``.

    Measured with PyTorch's schedules (decision 126): DDP's default reducer
    fails an internal assert at the second step (its bucket rebuild counts
    every microbatch), and ``static_graph=True`` gives the last stage wrong
    gradients without an error; ``find_unused_parameters=True`` is exact.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    ddps = [m for m in given if isinstance(m, DistributedDataParallel)]
    if any(m.static_graph or not m.find_unused_parameters for m in ddps):
        return ValueError(f"a pipeline stage in DistributedDataParallel without "
                          f"find_unused_parameters=True (or with static_graph=True): PyTorch's "
                          f"reducer mis-counts the schedule's microbatch backwards (an internal "
                          f"assert at step 2, or wrong gradients on the last stage); build it as "
                          f"{_DDP_FIX}")
    if group_size(dp_group) > 1 and len(ddps) + sum(isinstance(m, FSDPModule) for m in given) \
            < len(given):
        return ValueError(f"{group_size(dp_group)} data-parallel replicas: put each stage in "
                          f"{_DDP_FIX} or fully_shard(stage, mesh=cfg.mesh['dp']) before "
                          "PipelineSchedule, so the replicas' gradients are averaged")
    return None


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The local tensor of a gradient (FSDP2's are DTensors sharded over ``dp``)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def _tied_group(pipe: ProcessGroup | None, style: str) -> ProcessGroup | None:
    """The group of the ranks holding the first and the last stage of ``pipe``.

    Collective over the world: every pipeline (one per TP rank, per
    data-parallel replica) has such a pair, and ``new_group`` must be called by
    every rank for every pair in one order, so the pairs are gathered first.
    Under V-shaped schedules both stages are on the pipeline's rank 0: no
    group (the copies are summed locally).
    """
    ranks = dist.get_process_group_ranks(pipe) if pipe is not None \
        else list(range(dist.get_world_size()))
    last = ranks[0] if style == "v" else ranks[-1]
    pairs = all_gather_object((ranks[0], last), None, "the tied embeddings' stage pairs")
    mine = None
    for pair in sorted({tuple(p) for p in pairs if p[0] != p[1]}):
        group = dist.new_group(list(pair))
        # A middle stage is no member of its pipeline's pair (new_group's sentinel): None
        if pair == (ranks[0], last) and isinstance(group, dist.ProcessGroup):
            mine = group
    return mine
