"""Rank functions: checkpoints of pipeline jobs (DCP resume, another layout, HF export)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchtp.pipeline import PipelineSchedule, decoder_stage

from ._pipeline_checks import TOL, batch, build_llama, reference_loss

STATE = ("exp_avg", "exp_avg_sq", "step")  # AdamW's per-parameter state
EXTRA = {"epoch": 3, "note": "pipeline"}


def perturbed(tied: bool) -> nn.Module:
    """The tiny Llama with other weights: what a load has to overwrite."""
    model = build_llama(tied=tied)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5).add_(0.1)
    return model


def train(pipe: PipelineSchedule, opt: torch.optim.Optimizer, steps: range,
          rows: slice = slice(None)) -> list[float]:
    """AdamW steps on ``batch(step)`` (this replica's ``rows`` of it); the global losses
    (on the last stage, else none)."""
    losses = []
    for step in steps:
        ids, labels = batch(step)
        loss = pipe.step(ids[rows], labels[rows])
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss.detach()))
    return losses


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """The TP-local tensor: FSDP2's shards all-gathered over DP (collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """Every parameter of the whole job and its AdamW state, as full tensors: each rank's
    cut placed where its layout says (collective over the world)."""
    import torchtp
    from torchtp.core.layouts import place

    mine = {}
    for name, p in model.named_parameters():
        module, _, attr = name.rpartition(".")
        layout = torchtp.layouts_of(model.get_submodule(module)).get(attr)
        pieces = [tp_local(t) for t in (p.detach(), *(opt.state[p][k] for k in STATE[:2]))]
        mine[name] = (None if layout is None else layout.record(),
                      tuple(p.shape) if layout is None else layout.full_shape,
                      [t.clone() for t in pieces], opt.state[p]["step"].clone())
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, list[torch.Tensor]] = {}
    for held in everyone:
        for name, (record, shape, pieces, step) in held.items():
            out = full.setdefault(name, [torch.empty(shape, dtype=pieces[0].dtype)
                                         for _ in pieces] + [step])
            for target, piece in zip(out[:3], pieces, strict=True):  # replicas: the same again
                place(target, piece, *(record or (None, [], None)))
    return full


def assert_equal_to(model: nn.Module, opt: torch.optim.Optimizer | None,
                    want: dict[str, list[torch.Tensor]], tol: dict[str, float] | None = None
                    ) -> int:
    """Every parameter of ``model`` (and its AdamW state) equal to this rank's cut of
    ``want``'s full tensors: bit for bit, or within ``tol``; the count."""
    from ._hf_checks import expected_local

    for name, p in model.named_parameters():
        module, _, attr = name.rpartition(".")
        cut = [expected_local(model.get_submodule(module), attr, t) for t in want[name][:3]]
        mine = [tp_local(t) for t in [p.detach()] + ([] if opt is None else
                                                  [opt.state[p][k] for k in STATE[:2]])]
        for k, got, expected in zip(("param", *STATE), mine, cut[:len(mine)], strict=False):
            if tol is None:
                assert torch.equal(got, expected), (name, k)
            else:
                torch.testing.assert_close(got, expected, **tol, msg=f"{name} {k}")
        if opt is not None:
            assert torch.equal(opt.state[p]["step"], want[name][3]), name
    return sum(1 for _ in model.named_parameters())


def check_pp_tp(rank: int, world_size: int, tmp: str) -> list[Any]:
    """pp 2 x tp 2 (``init_parallel``), tied embeddings, 1F1B: two AdamW steps, save
    (DCP: model, optimizer, step; and the HF directory), two more. The HF directory read
    back by ``stage_from_pretrained`` holds the saved parameters bit for bit. A fresh job
    loads and takes the same two steps bit for bit; a whole model at pp 1 x tp 2 loads
    every parameter and AdamW state bit for bit and its two steps match the pipeline's."""
    import torchtp
    from torchtp.checkpoint import save_pretrained
    from torchtp.checkpoint.dcp import load_training_state, save_training_state

    cfg = torchtp.init_parallel(pp=2, tp=2)

    def job(model: nn.Module) -> tuple[Any, PipelineSchedule, torch.optim.Optimizer]:
        stage = decoder_stage(model, cfg.pp_rank, cfg.pp_size)
        torchtp.DistributedModelWrapper(stage.model)  # in place, over cfg.group
        return stage, PipelineSchedule(stage, 4, "1f1b"), \
            torch.optim.AdamW(stage.parameters(), lr=1e-2)

    stage, pipe, opt = job(build_llama(tied=True))
    train(pipe, opt, range(2))
    # A stage's own norm would clip each stage by another factor: torchtp's clip and torch's
    # (routed: the stage is tensor-parallel) refuse, naming the pipeline's
    for clip in (torchtp.clip_grad_norm_, torch.nn.utils.clip_grad_norm_):
        with pytest.raises(ValueError, match=r"in a pipeline-parallel job \(pp=2\): this rank "
                           r"holds stage [01] only.*use PipelineSchedule\.clip_grad_norm_"):
            clip(stage.parameters(), 1.0)
    saved = full_state(stage.model, opt)
    save_training_state(f"{tmp}/dcp", stage, opt, step=2, extra=EXTRA)
    save_pretrained(stage, f"{tmp}/hf")
    uninterrupted = train(pipe, opt, range(2, 4))
    final = full_state(stage.model, opt)

    from torchtp.pipeline import stage_from_pretrained

    exported = stage_from_pretrained(f"{tmp}/hf", cfg.pp_rank, cfg.pp_size)  # the HF export
    assert_equal_to(exported.model, None, saved)

    fresh, fresh_pipe, fresh_opt = job(perturbed(tied=True))
    assert load_training_state(f"{tmp}/dcp", fresh, fresh_opt) == (2, EXTRA)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    compared = assert_equal_to(fresh.model, fresh_opt, saved)
    if cfg.pp_rank == 1:  # the tied LM head was loaded from the embedding's entry
        assert torch.equal(saved["lm_head.weight"][0], saved["model.embed_tokens.weight"][0])
    assert train(fresh_pipe, fresh_opt, range(2, 4)) == uninterrupted  # bit for bit
    assert_equal_to(fresh.model, fresh_opt, final)

    # pp 1 x tp 2: each TP group ({0, 1} and {2, 3}) holds the whole model.
    whole = torchtp.DistributedModelWrapper(perturbed(tied=True))
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-3)
    assert load_training_state(f"{tmp}/dcp", whole, whole_opt) == (2, EXTRA)
    whole_count = assert_equal_to(whole.base_model, whole_opt, saved)
    for step in range(2, 4):
        reference_loss(whole, *batch(step)).backward()
        whole_opt.step()
        whole_opt.zero_grad()
    # Other sums in another order (no pipeline, attention split): float64 rounding only.
    assert_equal_to(whole.base_model, whole_opt, final, TOL)
    return [cfg.pp_rank, compared, whole_count, uninterrupted]


def check_pp_dp(rank: int, world_size: int, tmp: str) -> list[Any]:
    """pp 2 x dp 2 without tensor parallelism (no wrapper), each stage ``fully_shard`` over
    ``dp``, untied: the same save, exact resume and HF directory (each replica its half of
    the batch); the checkpoint loads into a one-stage pipeline holding the whole model;
    optimizers set up differently per stage are refused on every rank before DCP starts."""
    from torch.distributed.fsdp import fully_shard

    import torchtp
    from torchtp.checkpoint import save_pretrained
    from torchtp.checkpoint.dcp import load_training_state, save_training_state

    cfg = torchtp.init_parallel(pp=2, dp=2)
    rows = slice(2 * cfg.dp_rank, 2 * cfg.dp_rank + 2)  # this replica's half of the batch

    def job(model: nn.Module) -> tuple[Any, PipelineSchedule, torch.optim.Optimizer]:
        stage = fully_shard(decoder_stage(model, cfg.pp_rank, cfg.pp_size), mesh=cfg.mesh["dp"])
        return stage, PipelineSchedule(stage, 2, "gpipe"), \
            torch.optim.AdamW(stage.parameters(), lr=1e-2)

    stage, pipe, opt = job(build_llama())
    train(pipe, opt, range(2), rows)
    saved = full_state(stage.model, opt)
    save_training_state(f"{tmp}/dcp", stage, opt, step=2)
    save_pretrained(stage, f"{tmp}/hf")
    uninterrupted = train(pipe, opt, range(2, 4), rows)

    fresh, fresh_pipe, fresh_opt = job(perturbed(tied=False))
    assert load_training_state(f"{tmp}/dcp", fresh, fresh_opt) == (2, {})
    assert_equal_to(fresh.model, fresh_opt, saved)
    assert train(fresh_pipe, fresh_opt, range(2, 4), rows) == uninterrupted  # bit for bit

    one = decoder_stage(perturbed(tied=False), 0, 1)  # pp 1: one stage, every layer
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3)
    assert load_training_state(f"{tmp}/dcp", one, one_opt) == (2, {})
    count = assert_equal_to(one.model, one_opt, saved)

    mixed = torch.optim.AdamW(stage.parameters(), lr=1e-2 * (1 + cfg.pp_rank))
    try:
        save_training_state(f"{tmp}/refused", stage, mixed, step=4)
    except ValueError as err:
        refusal = str(err)
    else:
        raise AssertionError("stages with different optimizer settings were saved")
    return [count, uninterrupted, refusal, os.path.exists(f"{tmp}/refused")]
