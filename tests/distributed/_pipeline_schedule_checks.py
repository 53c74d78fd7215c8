"""Rank functions: several stages per rank (interleaved and V-shaped schedules) and
pp x dp x tp on ``init_parallel``'s mesh, against one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchtp.pipeline import PipelineSchedule, decoder_stages, stage_ids

from ._pipeline_checks import TOL, batch, build_llama, reference_loss

CLIP = 0.05  # below the tiny Llama's gradient norm: the clip scales every gradient


def check_schedules(rank: int, world_size: int, schedules: list[str], tied: bool,
                    microbatches: int = 4) -> list[Any]:
    """For each schedule, an 8-layer Llama: one stage per rank for GPipe and 1F1B, else two
    (``2 * world_size`` stages); 4 microbatches with uneven padding; one step: the loss,
    every gradient, the clipped total norm and gradients equal to one process's; returns
    the stages each rank held. ``microbatches=8``: 8 rows (two batches; the V-shaped
    schedules need a microbatch per stage)."""
    held = []
    for schedule in schedules:
        per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
        ref = build_llama(8, tied)
        ids = stage_ids(schedule, rank, world_size, per_rank)
        stages = decoder_stages(build_llama(8, tied), ids, world_size * per_rank)
        pipe = PipelineSchedule(stages, microbatches, schedule)
        inputs, labels = batch(0) if microbatches == 4 else \
            tuple(torch.cat(pair) for pair in zip(batch(0), batch(1), strict=True))
        loss = pipe.step(inputs, labels)
        ref_loss = reference_loss(ref, inputs, labels)
        ref_loss.backward()
        assert (loss is not None) == pipe.holds_last, schedule
        if loss is not None:
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=schedule)
        want = dict(ref.named_parameters(remove_duplicate=False))  # tied: both names
        for stage in stages:
            for name, p in stage.model.named_parameters():
                torch.testing.assert_close(p.grad, want[name].grad, **TOL,
                                           msg=f"{schedule}: {name}")
        total = pipe.clip_grad_norm_(CLIP)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        torch.testing.assert_close(total, ref_total, **TOL, msg=schedule)  # both float64
        for stage in stages:
            for name, p in stage.model.named_parameters():
                torch.testing.assert_close(p.grad, want[name].grad, **TOL,
                                           msg=f"{schedule}, clipped: {name}")
        held.append(ids)
    return held


def check_pp_dp_tp(rank: int, world_size: int) -> list[Any]:
    """``init_parallel(pp=2, dp=2, tp=2)``: each stage TP-wrapped over ``cfg.group``, then
    in DDP over ``cfg.dp_group`` or ``fully_shard`` over ``cfg.mesh["dp"]``, each replica
    given its half of the batch; 1F1B over the default pipeline group; tied embeddings. Two
    AdamW steps (the second clipped): the global loss, every gradient (this rank's cut) and
    the parameters equal to one process on the whole batch, the tied copies bit-identical."""
    import torchtp

    cfg = torchtp.init_parallel(pp=2, dp=2, tp=2)
    layout = [dist.get_process_group_ranks(g) for g in (cfg.pp_group, cfg.dp_group, cfg.group)]
    losses = {kind: _train_replicated(cfg, kind) for kind in ("ddp", "fsdp2")}
    return [layout, losses, _streams(cfg)]


def _train_replicated(cfg: Any, kind: str) -> list[float]:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import torchtp
    from torchtp.pipeline import decoder_stage

    from ._hf_checks import expected_local

    ref, model = build_llama(tied=True), build_llama(tied=True)
    stage = decoder_stage(model, cfg.pp_rank, cfg.pp_size)
    torchtp.DistributedModelWrapper(stage.model)  # in place, over cfg.group (tp)
    if kind == "ddp":
        pipe = PipelineSchedule(DistributedDataParallel(
            stage, process_group=cfg.dp_group, find_unused_parameters=True), 2)
    else:
        pipe = PipelineSchedule(fully_shard(stage, mesh=cfg.mesh["dp"]), 2)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = dict(ref.named_parameters(remove_duplicate=False))  # tied: both names

    def check(name: str, mine: torch.Tensor, full: torch.Tensor, **tol: float) -> None:
        module = stage.model.get_submodule(name.rpartition(".")[0])
        mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine  # FSDP2: dp shards
        expected = expected_local(module, name.rpartition(".")[2], full)
        torch.testing.assert_close(mine, expected, **tol, msg=f"{kind}: {name}")

    losses = []
    for step in range(2):
        ids, labels = batch(step)
        rows = slice(2 * cfg.dp_rank, 2 * cfg.dp_rank + 2)  # this replica's half
        loss = pipe.step(ids[rows], labels[rows])
        ref_loss = reference_loss(ref, ids, labels)
        ref_loss.backward()
        if loss is not None:  # the global batch's loss, on every replica
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
            losses.append(float(loss))
        for name, p in stage.model.named_parameters():
            check(name, p.grad, want[name].grad, **TOL)
        if step == 1:
            total = pipe.clip_grad_norm_(CLIP)
            ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            torch.testing.assert_close(total, ref_total, **TOL)  # both float64
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in stage.model.named_parameters():  # clipped: float64 factors (above)
        check(name, p.detach(), want[name].detach(), **TOL)
    mine = stage.tied_weight()  # the two copies (this TP rank's rows, this dp shard) agree
    local = mine.detach().to_local() if hasattr(mine, "to_local") else mine.detach()
    copies: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(copies, (cfg.pp_rank, cfg.rank, cfg.dp_rank, local))
    for pp, tp, dp, t in copies:
        if pp == 1 and (tp, dp) == (cfg.rank, cfg.dp_rank) and cfg.pp_rank == 0:
            assert torch.equal(t, local), f"{kind}: the tied copies differ"
    return losses


def _streams(cfg: Any) -> list[float]:
    """After ``torchtp.manual_seed(7)``, one draw from the shared stream and one from the
    local stream the first split region would start on this rank."""
    import torchtp
    from torchtp.layers import rng

    torchtp.manual_seed(7)
    saved, shared = rng.get_state(), rng.TRACKER.shared
    assert shared is not None
    rng.set_state(shared)
    draws = [float(torch.rand(()))]
    rng.set_state(shared)
    rng.to_local(rng.Tracker(), 0)  # what a RowParallelLinear whose output stays split does
    draws.append(float(torch.rand(())))
    rng.set_state(saved)
    return draws


def check_ddp_refused(rank: int, world_size: int) -> str:
    """A stage in DDP with the defaults (pp 1 x dp 2: the verdict needs no pipeline peer):
    refused on every rank when the schedule is built."""
    from torch.nn.parallel import DistributedDataParallel

    import torchtp
    from torchtp.pipeline import decoder_stage

    cfg = torchtp.init_parallel(dp=2, tp=1)
    stage = decoder_stage(build_llama(), 0, 1)
    try:
        PipelineSchedule(DistributedDataParallel(stage, process_group=cfg.dp_group), 2)
    except ValueError as err:
        return str(err)
    raise AssertionError("DDP without find_unused_parameters=True was accepted")


def stage_masks(rank: int, world_size: int, seeded_rank: int = -1) -> list[bool]:
    """pp 2 x tp 2, every rank seeded alike and no ``torchtp.manual_seed`` (but on
    ``seeded_rank``, whose streams are then started before the wrap): a wrapped MLP
    stage's training forward, then a dropout on its (replicated) output; the mask."""
    from torch import nn

    import torchtp

    from ._models import mlp

    torchtp.init_parallel(pp=2, tp=2)
    torch.manual_seed(0)  # what most scripts do on every rank
    if rank == seeded_rank:
        torchtp.manual_seed(0)
    model = nn.Sequential(*mlp(), nn.Dropout(0.5))
    wrapped = torchtp.DistributedModelWrapper(model)
    wrapped.train()
    out = wrapped(torch.ones(4, 16))  # (4, 16), replicated: the shared stream's mask
    return (out == 0).flatten().tolist()
