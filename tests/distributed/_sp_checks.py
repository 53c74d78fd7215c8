"""Rank-side checks: loss parallelism and sequence parallelism vs the unsharded HF model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import torchtp
from torchtp.comm import sequence_parallel as sp_module

from ._hf_checks import LOGITS, compare_params
from ._hf_models import VOCAB, build

# Losses are means of ~20 fp32 terms computed in a different order: 1e-6 relative.
LOSS = {"rtol": 1e-5, "atol": 1e-6}


def batch(seq: int, seed: int = 1, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Two sequences of ``seq`` tokens; the labels ignore a few positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, 2] = labels[1, -3] = -100
    return {"input_ids": ids, "labels": labels}


def _build(arch: str, checkpointing: bool) -> nn.Module:
    # No dropout: training-mode runs must be deterministic to compare exactly.
    model = build(arch, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if arch == "gpt2" \
        else build(arch)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    return model


def check_training(rank: int, world_size: int, arch: str, seq: int, loss_parallel: bool,
                   sequence_parallel: bool, checkpointing: bool = False,
                   steps: int = 2) -> dict:
    """Loss, logits, every gradient and SGD steps equal the unsharded model's."""
    ref = _build(arch, checkpointing)
    wrapped = torchtp.DistributedModelWrapper(
        _build(arch, checkpointing), loss_parallel=loss_parallel,
        sequence_parallel=sequence_parallel)
    data = batch(seq, vocab=ref.config.vocab_size)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    result: dict = {}
    for step in range(steps):
        opt_ref.zero_grad()
        opt.zero_grad()
        want = ref(**data)
        with torchtp.count_collectives() as fwd:
            got = wrapped(**data)
        # The gathered inputs died with the forward, so their entries (holding shards) too.
        assert not sp_module._GATHERED
        torch.testing.assert_close(got.loss, want.loss, **LOSS)
        full = want.logits.detach()
        if loss_parallel:  # this rank's vocabulary rows of the logits
            head = wrapped.get_output_embeddings()
            (start, n), = head.tp_layouts["weight"].segments
            full = full[..., start:start + n]
        torch.testing.assert_close(got.logits, full, **LOGITS)
        want.loss.backward()
        with torchtp.count_collectives() as bwd:
            got.loss.backward()
        result["grads_checked"] = compare_params(wrapped, ref, grads=True)
        opt_ref.step()
        opt.step()
        compare_params(wrapped, ref, grads=False)
        if step == 0:
            result["forward"], result["backward"] = dict(fwd.counts), dict(bwd.counts)
    if sequence_parallel and not checkpointing:
        result["saved full sequences"] = saved_full_sequences(wrapped, data)
    result["run whole"] = [line.strip() for line in wrapped.describe_plan().splitlines()
                           if "run whole" in line]
    return result


def saved_full_sequences(model: nn.Module, data: dict[str, torch.Tensor]) -> int:
    """Distinct all-gathered block inputs autograd saves in one forward.

    There should be none: the projections fed a gathered ``(B, T, d)`` input
    save its ``(B, S, d)`` shard and re-gather it in the backward.
    """
    inputs: list[torch.Tensor] = []  # held, so that no later tensor reuses their memory
    saved: set[int] = set()

    def note_input(layer: nn.Module, args: tuple) -> None:
        inputs.append(args[0])

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    hooks = [m.register_forward_pre_hook(note_input) for m in model.modules()
             if getattr(m, "sequence_dim", None) is not None
             and isinstance(m, torchtp.RowParallelLinear)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**data).loss.backward()
    for hook in hooks:
        hook.remove()
    gathered = {t.untyped_storage().data_ptr() for t in inputs}
    assert gathered, "no projection got a gathered input"
    return len(gathered & saved)


def check_generate(rank: int, world_size: int, arch: str, loss_parallel: bool,
                   sequence_parallel: bool) -> int:
    """Greedy generation (logits gathered, cache, 1-token steps) equals the unsharded model's."""
    ref = build(arch)
    wrapped = torchtp.DistributedModelWrapper(build(arch), loss_parallel=loss_parallel,
                                              sequence_parallel=sequence_parallel)
    prompt = batch(5)["input_ids"][:1]
    want = ref.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = wrapped.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want), f"{arch}: generated {got.tolist()} != {want.tolist()}"
    logits = wrapped(input_ids=prompt).logits  # no labels: the full vocabulary
    torch.testing.assert_close(logits, ref(input_ids=prompt).logits, **LOGITS)
    return got.shape[1] - prompt.shape[1]


def check_num_items(rank: int, world_size: int) -> None:
    """Trainer's ``num_items_in_batch`` (sum, then divide) is honoured as HF does."""
    ref = build("llama")
    wrapped = torchtp.DistributedModelWrapper(build("llama"), loss_parallel=True)
    data = batch(9)
    count = torch.tensor(13)
    torch.testing.assert_close(wrapped(**data, num_items_in_batch=count).loss,
                               ref(**data, num_items_in_batch=count).loss, **LOSS)


def cross_entropy_cases(rank: int, world_size: int, vocab: int) -> dict:
    """vocab_parallel_cross_entropy on this rank's balanced slice vs F.cross_entropy."""
    from torchtp.core.layouts import shard_range

    start, n = shard_range(vocab, world_size, rank)
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, vocab, generator=gen) * 3  # (B, T, V), same on every rank
    labels = torch.randint(0, vocab, (3, 5), generator=gen)
    labels[0, :2] = labels[2, 4] = -100
    labels[1, 0] = vocab - 1  # owned by the last rank (the smaller slice)
    counts = {}
    for dtype in (torch.float32, torch.bfloat16):
        # bf16 logits: both sides compute in fp32 from the same bf16 values; the
        # gradient is rounded to bf16 once, so bf16's resolution (8e-3) bounds it.
        tol = LOSS if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
        for smoothing in (0.0, 0.1, 1.0):
            for reduction in ("mean", "sum", "none"):
                ref = full.to(dtype).clone().requires_grad_()
                want = nn.functional.cross_entropy(
                    ref.float().flatten(0, 1), labels.flatten(), label_smoothing=smoothing,
                    reduction=reduction)
                (want.sum() * 1.5).backward()
                local = full.to(dtype)[..., start:start + n].clone().requires_grad_()
                with torchtp.count_collectives() as c:
                    got = torchtp.vocab_parallel_cross_entropy(
                        local, labels, label_smoothing=smoothing, reduction=reduction)
                (got.sum() * 1.5).backward()
                want = want.view(labels.shape) if reduction == "none" else want
                torch.testing.assert_close(got, want, **tol)
                torch.testing.assert_close(local.grad, ref.grad[..., start:start + n], **tol)
                counts = {"ops": dict(c.counts), "largest": max(
                    torch.Size(r.shape).numel() for r in c.records)}
    custom = torchtp.vocab_parallel_cross_entropy(
        full[..., start:start + n], torch.where(labels == -100, 7, labels), ignore_index=7)
    torch.testing.assert_close(custom, nn.functional.cross_entropy(
        full.flatten(0, 1), torch.where(labels == -100, 7, labels).flatten(), ignore_index=7))
    all_ignored = torchtp.vocab_parallel_cross_entropy(
        full[..., start:start + n], torch.full((3, 5), -100))
    bad = labels.clone()
    bad[2, 1] = vocab
    try:
        torchtp.vocab_parallel_cross_entropy(full[..., start:start + n], bad)
    except ValueError as err:
        counts["error"] = str(err)
    counts["all_ignored_nan"] = bool(all_ignored.isnan())
    # A vocabulary of 2 over 3 ranks: the last holds no column (float64: exact)
    two_start, two_n = shard_range(2, world_size, rank)
    two = full[..., :2].double().clone().requires_grad_()
    nn.functional.cross_entropy(two.flatten(0, 1), labels.clamp(-100, 1).flatten()).backward()
    mine = full[..., :2].double()[..., two_start:two_start + two_n].clone().requires_grad_()
    loss = torchtp.vocab_parallel_cross_entropy(mine, labels.clamp(-100, 1))
    loss.backward()
    assert mine.grad is not None and two.grad is not None
    counts["empty_slice_ok"] = bool(
        torch.allclose(loss, nn.functional.cross_entropy(
            full[..., :2].double().flatten(0, 1), labels.clamp(-100, 1).flatten()),
            rtol=1e-12, atol=0)
        and torch.allclose(mine.grad, two.grad[..., two_start:two_start + two_n], rtol=1e-12,
                           atol=1e-15))
    counts["empty_slice_width"] = two_n
    return counts


def check_loss_parallel_suite(rank: int, world_size: int) -> dict:
    """Llama (untied) and GPT-2 (tied, built-in plan) with loss_parallel, and errors."""
    out = {"llama": check_training(rank, world_size, "llama", 9, True, False),
           "gpt2": check_training(rank, world_size, "gpt2", 9, True, False, steps=1),
           # vocab 97, hidden 70, 10 heads / 2 KV heads: uneven vocabulary slices
           # under loss parallelism, with sequence parallelism on top.
           "llama-uneven": check_training(rank, world_size, "llama-uneven", 9, True, True,
                                          steps=1),
           "generated": check_generate(rank, world_size, "llama-tied", True, False)}
    check_num_items(rank, world_size)
    for arch in ("bert", "bart"):  # BART computes its loss inline, not via loss_function
        try:
            torchtp.DistributedModelWrapper(build(arch), loss_parallel=True)
        except ValueError as err:
            out[f"{arch} error"] = str(err)
    try:
        torchtp.DistributedModelWrapper(nn.Sequential(nn.Linear(8, 8)), loss_parallel=True)
    except ValueError as err:
        out["plain error"] = str(err)
    return out


def check_sequence_parallel_suite(rank: int, world_size: int,
                                  cases: list[tuple[str, int, bool, bool]],
                                  errors: bool = False, generating: str = "llama") -> dict:
    """``(arch, seq, loss_parallel, checkpointing)`` cases with sequence_parallel=True, and
    ``generating``'s greedy generation."""
    out: dict = {"errors": sequence_parallel_errors(rank, world_size)} if errors else {}
    for arch, seq, lp, ckpt in cases:
        out[f"{arch} seq={seq} lp={lp} ckpt={ckpt}"] = check_training(
            rank, world_size, arch, seq, lp, True, ckpt, steps=2 if not ckpt else 1)
    out["generated"] = check_generate(rank, world_size, generating, True, True)
    return out


def sequence_parallel_errors(rank: int, world_size: int) -> dict:
    """Each unsupported use raises on every rank with a message naming the fix."""
    out = {}
    attempts = {
        "arch": lambda: torchtp.DistributedModelWrapper(build("opt"), sequence_parallel=True),
        "outside norms": lambda: torchtp.DistributedModelWrapper(
            build("llama"), plan={"model.layers.*.mlp": "sequence_parallel"}),
        "replicated projection": lambda: torchtp.DistributedModelWrapper(
            build("llama"), sequence_parallel=True,
            plan={"model.layers.*.self_attn.[qkv]_proj": "colwise",
                  "model.layers.*.self_attn.o_proj": "rowwise",
                  "model.layers.*.mlp.down_proj": "rowwise",
                  "model.layers.*.mlp.gate_proj": "colwise"}),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except (TypeError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    extra = build("llama")
    extra.model.layers[1].adapter = nn.Linear(64, 64)  # a module the layout does not name
    try:
        torchtp.DistributedModelWrapper(extra, sequence_parallel=True)
    except ValueError as err:
        out["extra module"] = str(err)
    bypass = torchtp.DistributedModelWrapper(build("llama"), sequence_parallel=True)
    # A block output of full length T = 2 broadcasts into the (B, S = 1, d) residual: the
    # final norm gets 2 positions where this rank's shard has 1.
    bypass.base_model.model.layers[1].mlp.register_forward_hook(
        lambda _m, _a, y: y.expand(-1, 2, -1))
    try:
        bypass(input_ids=batch(9)["input_ids"][:, :2])
    except RuntimeError as err:
        out["bypassed reduce-scatter"] = str(err)
    plan = {**build("llama").tp_plan, "model.norm": "sequence_parallel"}
    wrapped = torchtp.DistributedModelWrapper(build("llama"), plan=plan)  # the style turns SP on
    out["style turns it on"] = wrapped.sequence_parallel
    try:
        wrapped(**batch(9), output_hidden_states=True)
    except ValueError as err:
        out["hidden states"] = str(err)
    return out


def dp2_tp2_ddp(rank: int, world_size: int) -> list[float]:
    """dp 2 x tp 2, DDP over the DP group: a Llama with sequence + loss parallelism, and
    Qwen3-Next in float64 with sequence parallelism (its MoE blocks run whole, its
    delta-net split by heads): as one process on the global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from . import _training_checks as training

    def built(arch: str) -> nn.Module:
        if arch == "llama":
            return build(arch, seed=0).train()
        # float64, so no top-k flips on reassociation (grouped_mm takes no float64)
        return build(arch, seed=0, _experts_implementation="eager").train().double()

    cfg = torchtp.init_tensor_parallel(tp_size=2)
    ids = training._batch()
    mine = ids[cfg.dp_rank * 2:(cfg.dp_rank + 1) * 2]  # this DP rank's slice
    norms: list[float] = []
    for arch, options in (("llama", {"loss_parallel": True}), ("qwen3_next", {})):
        ref = built(arch)
        ref_losses, ref_norms = training._train(ref, ids, torch.nn.utils.clip_grad_norm_,
                                                ref.parameters)
        wrapped = torchtp.DistributedModelWrapper(built(arch), sequence_parallel=True, **options)
        model = DDP(wrapped, process_group=cfg.dp_group)
        losses, got = training._train(model, mine, torchtp.clip_grad_norm_, model.parameters)
        torch.testing.assert_close(got, ref_norms, **training.TOL, msg=lambda m, a=arch: f"{a}: {m}")
        torch.testing.assert_close(training._global_loss(losses, cfg.dp_group), ref_losses,
                                   **training.TOL, msg=lambda m, a=arch: f"{a}: {m}")
        norms += got
    return norms


def _siblings(x_shard: torch.Tensor, weights: list[torch.Tensor],
              biases: list[torch.Tensor | None], length: int) -> torch.Tensor:
    """Three sibling projections on one gathered input, as q/k/v are fed."""
    from torchtp.comm.runtime import tp_group
    from torchtp.comm.sequence_parallel import gather_for_tensor_parallel
    from torchtp.layers.sequence_linear import linear_on_gathered

    full = gather_for_tensor_parallel(x_shard, tp_group(), 1, length)  # (B, T, d)
    outs = [linear_on_gathered(full, w, b) for w, b in zip(weights, biases, strict=True)]
    return torch.stack([(o.float() ** 2).sum() for o in outs]).sum()


def check_linear_on_gathered(rank: int, world_size: int) -> dict:
    """Sibling projections saving the sequence shard: gradients equal plain autograd's.

    The reference runs F.linear on the full sequence in this process, with
    the same seeded tensors (the weights stand for one rank's rows: the sum
    of every rank's input gradient is what the gather's backward returns).
    """
    from torchtp.comm.sequence_parallel import shard_length

    gen = torch.Generator().manual_seed(0)
    length, d = 7, 6  # 7 tokens over world_size ranks: the last shard is padded
    x = torch.randn(2, length, d, generator=gen)
    weights = [torch.randn(4, d, generator=gen, requires_grad=i != 1) for i in range(3)]
    biases: list[torch.Tensor | None] = [torch.randn(4, generator=gen, requires_grad=True),
                                         None, None]
    s = shard_length(length, world_size)
    shard = torch.nn.functional.pad(x, (0, 0, 0, s * world_size - length))[:, rank * s:][:, :s]
    shard = shard.clone().requires_grad_()
    ref_x = x.clone().requires_grad_()
    ref = sum((torch.nn.functional.linear(ref_x, w, b) ** 2).sum()
              for w, b in zip(weights, biases, strict=True))
    ref_grads = torch.autograd.grad(ref, [ref_x, weights[0], weights[2], biases[0]])
    out: dict = {}
    with torchtp.count_collectives() as counter:
        loss = _siblings(shard, weights, biases, length)
        grads = torch.autograd.grad(loss, [shard, weights[0], weights[2], biases[0]],
                                    retain_graph=True)
    out["collectives"] = dict(counter.counts)  # forward and backward
    # fp32, the same products in another order (the partial sums reduce-scattered): 1e-5.
    tol = {"rtol": 1e-5, "atol": 1e-5}
    want_shard = ref_grads[0] * world_size  # every rank's weights are the same here
    want_shard = torch.nn.functional.pad(want_shard, (0, 0, 0, s * world_size - length))
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(grads[0], want_shard[:, rank * s:][:, :s], **tol)
    for got, want in zip(grads[1:], ref_grads[1:], strict=True):
        torch.testing.assert_close(got, want, **tol)
    again = torch.autograd.grad(loss, [weights[0]])  # retain_graph: the re-gather runs again
    torch.testing.assert_close(again[0], grads[1], rtol=0, atol=0)
    saved: set[tuple[int, torch.dtype]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape == shard.shape:
            saved.add((t.untyped_storage().data_ptr(), t.dtype))
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_bf = sum((torch.nn.functional.linear(ref_x, w, b).float() ** 2).sum()
                     for w, b in zip(weights, biases, strict=True))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_bf = _siblings(shard, weights, biases, length)
    want_bf = torch.autograd.grad(ref_bf, [weights[0], biases[0]])
    with torchtp.count_collectives() as counter:
        got_bf = torch.autograd.grad(loss_bf, [weights[0], biases[0]])
    # Autocast: the siblings share one bf16 copy of the shard, re-gathered in bf16.
    out["autocast saved shards"] = sorted(str(dtype) for _, dtype in saved)
    out["autocast re-gather"] = [str(r.dtype) for r in counter.records if r.op == "all_gather"]
    for got, want in zip(got_bf, want_bf, strict=True):
        # bf16 products (8 mantissa bits) summed in another order: 2e-2 relative.
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    out.update(_gathered_edge_cases(shard, weights[0], length))
    return out


def _gathered_edge_cases(shard: torch.Tensor, weight: torch.Tensor, length: int) -> dict:
    """Each use that must not save the shard, or must let go of the re-gathered input."""
    from torch.utils.checkpoint import checkpoint

    from torchtp.comm.runtime import tp_group
    from torchtp.comm.sequence_parallel import gather_for_tensor_parallel, gathered_source
    from torchtp.layers.sequence_linear import linear_on_gathered

    def gather(x: torch.Tensor) -> torch.Tensor:
        return gather_for_tensor_parallel(x, tp_group(), 1, length)  # (B, T, d)

    def weight_grad(fn, full: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad((fn(full, weight, None) ** 2).sum(), [weight])[0]

    out: dict = {}
    # The shard changed in place after the gather: re-gathering it would give other
    # values than the forward used, so the projection saves what F.linear saves.
    h = shard * 1.0
    full = gather(h)
    h.mul_(3.0)
    out["changed shard"] = gathered_source(full) is None
    torch.testing.assert_close(weight_grad(linear_on_gathered, full),
                               weight_grad(torch.nn.functional.linear, full), rtol=0, atol=0)
    # A backward that runs one sibling only lets go of the re-gathered input at its end.
    full = gather(shard)
    regather = gathered_source(full).regather  # type: ignore[union-attr]
    other = torch.randn_like(weight).requires_grad_()
    loss = (linear_on_gathered(full, weight, None) ** 2).sum() \
        + (linear_on_gathered(full, other, None) ** 2).sum()
    torch.autograd.grad(loss, [weight], retain_graph=True)
    out["held after a partial backward"] = regather._full is not None
    # Non-reentrant checkpointing around one projection, with a later block's gather
    # before the backward: the recomputation finds the gathered input again (the
    # checkpoint keeps it) and saves the same tensors.
    full = gather(shard)
    y = checkpoint(linear_on_gathered, full, weight, None, use_reentrant=False)
    gather(shard)
    got = torch.autograd.grad((y ** 2).sum(), [weight])[0]
    torch.testing.assert_close(got, weight_grad(torch.nn.functional.linear, full.detach()),
                               rtol=1e-6, atol=1e-6)
    # A frozen weight saves neither the shard nor the full input.
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.untyped_storage().data_ptr()) or t, lambda t: t):
        full = gather(shard)
        linear_on_gathered(full, weight.detach(), None)
    out["frozen weight saves the input"] = bool(
        {shard.untyped_storage().data_ptr(), full.untyped_storage().data_ptr()} & set(saved))
    return out


def exit_settles(rank: int, world_size: int) -> tuple[bool, float]:
    """After sequence-parallel forwards (reduce-scatters, whose input Gloo splits into
    views of its own), the exit's wait for the backend to let go of every collective's
    tensors returns at once: ``(released in time, seconds)``."""
    import time

    from torchtp.comm import health

    wrapped = torchtp.DistributedModelWrapper(build("llama"), sequence_parallel=True)
    with torch.no_grad():
        wrapped(**batch(9))
    time.sleep(0.2)  # Gloo's worker lets go microseconds after a collective completes
    start = time.monotonic()
    released = health.settle(3.0, warn=False)
    return released, time.monotonic() - start


def check_whole_blocks(rank: int, world_size: int) -> dict:
    """Mixtral's router jitter (random noise on the MoE input in training) with sequence
    parallelism: the MoE block runs whole, so every rank must draw the same noise (else
    its copy of a token goes to other experts: torchtp's route check raises), and a layer
    recomputed under activation checkpointing must draw the forward's noise again. Then
    the two refusals of a block run whole."""
    from ._moe_checks import _batch, build_moe

    def run(jitter: float, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = build_moe("mixtral", router_jitter_noise=jitter).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        wrapped = torchtp.DistributedModelWrapper(model, sequence_parallel=True)
        torchtp.manual_seed(7)  # the same streams for both runs
        loss = wrapped(**_batch()).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in wrapped.base_model.named_parameters()}

    loss, grads = run(0.5, False)
    recomputed, regrads = run(0.5, True)
    plain, _ = run(0.0, False)
    router = grads["model.layers.0.mlp.gate.weight"].clone()
    dist.broadcast(router, src=0)
    out: dict = {"noise changed the loss": not torch.equal(loss, plain),
                 # The recomputation runs the same kernels on the same values: bit for bit.
                 "recomputed equal": torch.equal(loss, recomputed)
                 and all(torch.equal(grads[n], regrads[n]) for n in grads),
                 "router gradient equal on every rank": torch.equal(
                     router, grads["model.layers.0.mlp.gate.weight"])}
    flat = torchtp.DistributedModelWrapper(build_moe("mixtral"), sequence_parallel=True)
    # A block output that is not (batch, tokens, ...) cannot be cut into sequence shards.
    flat.base_model.model.layers[1].mlp.register_forward_hook(
        lambda _m, _a, y: y.reshape(-1, y.shape[-1]), prepend=True)
    try:
        flat(**_batch())
    except RuntimeError as err:
        out["flattened output"] = str(err)
    # Generation with the cache (decode steps of one token: a shard of padding on rank 1)
    # through MoE blocks and latent attention run whole, as one process generates.
    ref = build_moe("deepseek_v3")
    gen = torchtp.DistributedModelWrapper(build_moe("deepseek_v3"), sequence_parallel=True)
    prompt = _batch()["input_ids"][:1, :5]
    want = ref.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    out["generated equal"] = torch.equal(
        gen.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0), want)
    model = build_moe("qwen2_moe")
    partial = {**model.tp_plan, "model.layers.*.mlp.shared_expert.down_proj": "rowwise_partial"}
    try:
        torchtp.DistributedModelWrapper(model, sequence_parallel=True, plan=partial)
    except ValueError as err:
        out["partial sum"] = str(err)
    return out
