"""Rank functions: a tiny HF Llama trained as pipeline stages against one process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtp.pipeline import PipelineSchedule, decoder_stage

VOCAB = 64
TOL = {"rtol": 1e-10, "atol": 1e-12}  # float64: the same sums, only in other processes


def build_llama(layers: int = 4, tied: bool = False) -> nn.Module:
    """A tiny random Llama in float64 (same seed: the same weights on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).double()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 8)`` token ids and labels with padding spread unevenly over the rows."""
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, 5:] = -100  # row 0: 4 counted tokens, row 1: 7, row 2: 1, row 3: 7
    labels[2, 2:] = -100
    return ids, labels


def reference_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One process: the causal-LM loss as HF defines it (labels shifted by one, token mean
    over the batch), in float64 (HF's own ``.loss`` upcasts to float32 only)."""
    logits = model(input_ids=ids).logits[:, :-1]  # (B, T-1, V)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                       ignore_index=-100)


def check_pipeline(rank: int, world_size: int, schedule: str, layers: int,
                   microbatches: int, steps: int = 2, tied: bool = False) -> list[Any]:
    """``steps`` AdamW steps as ``world_size`` stages; every loss (last stage), every
    gradient and every parameter after the steps equal to one process's. ``tied``: the
    first stage's embedding and the last stage's LM head are both the tied weight."""
    ref, model = build_llama(layers, tied), build_llama(layers, tied)
    stage = decoder_stage(model, rank, world_size)
    pipe = PipelineSchedule(stage, microbatches, schedule)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    want = dict(ref.named_parameters())
    if tied:  # the last stage's copy is the reference's one tied weight
        want["lm_head.weight"] = ref.get_input_embeddings().weight
    ids, labels = batch(9)
    evaluated = pipe.evaluate(ids, labels)  # forward only: a loss, no gradients
    assert all(p.grad is None for p in stage.parameters())
    if evaluated is not None:
        with torch.no_grad():
            torch.testing.assert_close(evaluated, reference_loss(ref, ids, labels), **TOL)
    losses = []
    for step in range(steps):
        loss = _step_like_one_process(pipe, ref, *batch(step))
        if loss is not None:
            losses.append(loss)
        for name, p in stage.model.named_parameters():
            torch.testing.assert_close(p.grad, want[name].grad, **TOL, msg=name)
        if step == steps - 1:  # clipped once, at the end (its factor is checked there)
            _clip_like_one_process(pipe, ref, stage, None, lambda name, full: full)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p, want[name], **TOL, msg=name)
    if tied:  # the two copies of the tied weight are bit-identical after the steps
        import torch.distributed as dist

        mine = stage.tied_weight()
        copies: list[Any] = [None] * world_size
        dist.all_gather_object(copies, None if mine is None else mine.detach())
        assert torch.equal(copies[0], copies[-1])
    return [list(stage.layers), losses, sum(1 for _ in stage.parameters()), pipe.describe()]


def _step_like_one_process(pipe: PipelineSchedule, ref: nn.Module, ids: torch.Tensor,
                           labels: torch.Tensor) -> float | None:
    """One pipeline step and one unsplit backward on the batch; the last stage's loss checked
    against the unsplit one and returned (``None`` on the other stages)."""
    loss = pipe.step(ids, labels)
    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    if not pipe.stage.is_last:
        return None
    assert loss is not None
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    return float(loss.detach())


def check_bad_microbatches(rank: int, world_size: int) -> str:
    """A batch of 3 rows over 2 microbatches: refused on every stage before any send."""
    stage = decoder_stage(build_llama(), rank, world_size)
    pipe = PipelineSchedule(stage, 2, "gpipe")
    ids, labels = batch(0)
    try:
        pipe.step(ids[:3], labels[:3])
    except ValueError as err:
        return str(err)
    raise AssertionError("an uneven batch was not refused")


def check_pipeline_tp(rank: int, world_size: int) -> list[Any]:
    """pp 2 x tp 2 on a user-built ``DeviceMesh(("pp", "tp"))``: each stage tensor-parallel
    (``DistributedModelWrapper`` over the stage's TP group), 1F1B over the ``pp`` groups;
    the loss, every gradient (this rank's cut) and the parameters after an AdamW step equal
    to one process's."""
    from torch.distributed.device_mesh import init_device_mesh

    import torchtp

    from ._hf_checks import expected_local

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "tp"))
    ref, model = build_llama(), build_llama()
    stage = decoder_stage(model, mesh.get_local_rank("pp"), 2)
    torchtp.DistributedModelWrapper(stage.model, group=mesh.get_group("tp"))
    pipe = PipelineSchedule(stage, 4, "1f1b", group=mesh.get_group("pp"))
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _step_like_one_process(pipe, ref, *batch(0))
    want = dict(ref.named_parameters())

    def local(name: str, full: torch.Tensor) -> torch.Tensor:
        module = stage.model.get_submodule(name.rpartition(".")[0])
        return expected_local(module, name.rpartition(".")[2], full)

    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p.grad, local(name, want[name].grad), **TOL, msg=name)
    _clip_like_one_process(pipe, ref, stage, mesh.get_group("tp"), local)
    opt.step()
    ref_opt.step()
    for name, p in stage.model.named_parameters():  # clipped: float64 factors (above)
        torch.testing.assert_close(p, local(name, want[name].detach()), **TOL, msg=name)
    split = [n for n, p in stage.model.named_parameters()
             if tuple(p.shape) != tuple(want[n].shape)]
    return [list(stage.layers), split, _moe_stage_like_one_process(mesh),
            _sequence_parallel_like_one_process(mesh)]


def _moe_stage_like_one_process(mesh: Any) -> float | None:
    """An MoE (experts' features over the stage's TP group), pp 2 x tp 2, 1F1B: the loss and
    every gradient equal one process's, without and with sequence parallelism inside the
    stages (its MoE blocks run whole). The first step infers the shapes it sends from
    zeros, not uninitialized memory, so both TP ranks of a stage route alike. Returns the
    first run's loss."""
    import torchtp

    from ._hf_checks import expected_local
    from ._moe_checks import build_moe

    losses = []
    for sequence_parallel in (False, True):
        ref, model = (build_moe("qwen3_moe", vocab_size=VOCAB,
                                output_router_logits=False).train() for _ in range(2))
        stage = decoder_stage(model, mesh.get_local_rank("pp"), 2)
        torchtp.DistributedModelWrapper(stage.model, group=mesh.get_group("tp"),
                                        sequence_parallel=sequence_parallel)
        pipe = PipelineSchedule(stage, 4, "1f1b", group=mesh.get_group("pp"))
        losses.append(_step_like_one_process(pipe, ref, *batch(0)))
        want = dict(ref.named_parameters())
        for name, p in stage.model.named_parameters():
            module = stage.model.get_submodule(name.rpartition(".")[0])
            expected = expected_local(module, name.rpartition(".")[2], want[name].grad)
            torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-11,
                                       msg=f"sequence_parallel={sequence_parallel}: {name}")
    return losses[0]


def _sequence_parallel_like_one_process(mesh: Any) -> dict[str, dict[str, int]]:
    """Sequence parallelism inside each stage (pp 2 x tp 2, 1F1B, 7 tokens: a padded shard)
    of a Llama and of a GPT-2 (blocks in ``h``, tied embeddings): the loss and every
    gradient equal one process's. Returns each step's
    collectives on this rank (the stage's own shards: reduce-scatters out of its blocks)."""
    import torchtp

    from ._hf_checks import expected_local
    from ._pipeline_block_checks import build_arch

    counts = {}
    for arch, build in (("llama", build_llama), ("gpt2", lambda: build_arch("gpt2"))):
        ref = build()
        stage = decoder_stage(build(), mesh.get_local_rank("pp"), 2)
        torchtp.DistributedModelWrapper(stage.model, group=mesh.get_group("tp"),
                                        sequence_parallel=True)
        pipe = PipelineSchedule(stage, 4, "1f1b", group=mesh.get_group("pp"))
        ids, labels = (t[:, :7] for t in batch(1))
        with torchtp.count_collectives() as counted:
            _step_like_one_process(pipe, ref, ids, labels)
        want = dict(ref.named_parameters(remove_duplicate=False))
        for name, p in stage.model.named_parameters():
            module = stage.model.get_submodule(name.rpartition(".")[0])
            expected = expected_local(module, name.rpartition(".")[2], want[name].grad)
            torch.testing.assert_close(p.grad, expected, **TOL, msg=f"{arch}: {name}")
        counts[arch] = dict(counted.counts)
    return counts


CLIP = 0.05  # below the tiny Llama's gradient norm: the clip scales every gradient


def _clip_like_one_process(pipe: PipelineSchedule, ref: nn.Module, stage: Any, tp_group: Any,
                           local: Any) -> None:
    """The pipeline's clip (every stage, every TP rank) against torch's on the unsplit model:
    the same total norm, and every clipped gradient."""
    total = pipe.clip_grad_norm_(CLIP, tp_group=tp_group)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    assert float(want) > CLIP
    torch.testing.assert_close(total, want, **TOL)  # both float64
    params = dict(ref.named_parameters(remove_duplicate=False))  # tied: both names
    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p.grad, local(name, params[name].grad), **TOL, msg=name)


def check_stage_raises(rank: int, world_size: int) -> tuple[str, float]:
    """The last stage raises in its second microbatch's forward (as an out-of-memory error
    would) in the middle of a 1F1B step: how each stage ends."""
    import time

    stage = decoder_stage(build_llama(), rank, world_size)
    pipe = PipelineSchedule(stage, 4, "1f1b")
    calls = []

    def fail_second(*_: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated out of memory in microbatch 1")

    if stage.is_last:
        stage.model.get_decoder().norm.register_forward_pre_hook(fail_second)
    start = time.monotonic()
    try:
        pipe.step(*batch(0))
    except Exception as err:  # every stage must end, promptly
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return "finished", time.monotonic() - start


def check_bad_batch_values(rank: int, world_size: int) -> list[str]:
    """Labels and token ids outside the vocabulary: refused on every stage before any send
    (only the last stage reads labels, only the first token ids)."""
    stage = decoder_stage(build_llama(), rank, world_size)
    pipe = PipelineSchedule(stage, 4, "1f1b")
    messages = []
    for which in ("labels", "input_ids"):
        ids, labels = batch(0)
        (labels if which == "labels" else ids)[1, 3] = VOCAB + 7
        try:
            pipe.step(ids, labels)
        except ValueError as err:
            messages.append(str(err))
    return messages


def check_accumulation(rank: int, world_size: int) -> float:
    """Two steps of 2 rows (2 microbatches each), normalised over both, give one process's
    gradients for the whole 4-row batch; the summed losses its loss."""
    ref, model = build_llama(), build_llama()
    stage = decoder_stage(model, rank, world_size)
    pipe = PipelineSchedule(stage, 2, "1f1b")
    ids, labels = batch(0)
    counted = int((labels[:, 1:] != -100).sum())
    losses = [pipe.step(ids[rows], labels[rows], counted=counted)
              for rows in (slice(0, 2), slice(2, 4))]
    ref_loss = reference_loss(ref, ids, labels)
    ref_loss.backward()
    want = dict(ref.named_parameters())
    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, **TOL, msg=name)
    if stage.is_last:
        total = losses[0] + losses[1]  # type: ignore[operator]
        torch.testing.assert_close(total, ref_loss.detach(), **TOL)
        return float(total.detach())
    return 0.0


def check_different_batches(rank: int, world_size: int) -> str:
    """Each stage given another batch (a data loader sharded over the pipeline ranks):
    refused on every stage, before any send."""
    from torchtp import RankMismatchError

    stage = decoder_stage(build_llama(), rank, world_size)
    pipe = PipelineSchedule(stage, 4, "gpipe")
    try:
        pipe.step(*batch(rank))
    except RankMismatchError as err:
        return str(err)
    raise AssertionError("different batches on the stages were accepted")
