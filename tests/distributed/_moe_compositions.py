"""Rank functions: MoE models inside the stacks users train with, against one process.

Each run builds the tiny random Mixtral of ``_moe_checks`` twice from the same
seed (float64, so no routing choice can flip) and compares the wrapped model,
driven by the stack, with the unwrapped one driven the same way: under
``torch.compile``, with PEFT LoRA adapters, and inside ``TensorParallelTrainer``
(with the router's auxiliary loss), Lightning Fabric and accelerate's loop. Each split of the experts is run:
features split inside (the default), whole experts through the all-reduce and
through all-to-all dispatch; ``splits`` runs the first that many of them
(older transformers releases refuse whole experts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import torchtp

from ._hf_checks import compare_params, expected_local
from ._moe_checks import TOL, _adamw_steps, _batch, build_moe

SPLITS: list[dict[str, Any]] = [
    {}, {"expert_parallel": True, "expert_dispatch": "all_reduce"},
    {"expert_parallel": True, "expert_dispatch": "all_to_all"}]


def with_sequence_parallel(splits: int) -> list[dict[str, Any]]:
    """The first ``splits`` splits, then the default split with sequence parallelism (the
    MoE block run whole on the gathered sequence)."""
    return [*SPLITS[:splits], {"sequence_parallel": True}]


def _grads_match(wrapped: torchtp.DistributedModelWrapper, ref: nn.Module) -> int:
    """Every gradient of the wrapped model equals this rank's cut of the reference's."""
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in wrapped.base_model.named_parameters():
        if p.grad is None and not p.requires_grad:
            continue
        module = wrapped.base_model.get_submodule(name.rpartition(".")[0])
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, expected_local(module, name.rpartition(".")[2],
                                                          ref_params[name].grad), **TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
        checked += 1
    return checked


def moe_compile(rank: int, world_size: int, splits: int) -> list[int]:
    """``torch.compile`` (aot_eager: traced forward and backward) of each split, of the
    default split with sequence parallelism (the MoE block runs whole: its gather, the
    padding of 11 tokens dropped, and its scatter traced), and of GPT-OSS's features
    split (its down bias read as zeros off rank 0): loss, logits and every gradient
    equal the unwrapped model run eagerly, twice (the second call runs the cached
    graphs)."""
    torch._dynamo.reset()
    batch = _batch()
    checked = []
    router = _router_logits_compile(batch)
    cases = [*(("mixtral", s) for s in SPLITS[:splits]),
             ("mixtral", {"sequence_parallel": True}), ("gpt_oss", {})]
    for arch, split in cases:
        ref = build_moe(arch, output_router_logits=router).train()
        wrapped = torchtp.DistributedModelWrapper(
            build_moe(arch, output_router_logits=router).train(), **split)
        compiled = torch.compile(wrapped, backend="aot_eager")
        for _ in range(2):
            ref.zero_grad(set_to_none=True)
            wrapped.zero_grad(set_to_none=True)
            got, want = compiled(**batch), ref(**batch)
            torch.testing.assert_close(got.logits, want.logits, **TOL)
            torch.testing.assert_close(got.loss, want.loss, **TOL)  # with the aux loss
            got.loss.backward()
            want.loss.backward()
            checked.append(_grads_match(wrapped, ref))
    return checked


def _router_logits_compile(batch: dict[str, torch.Tensor]) -> bool:
    """Whether this transformers release compiles Mixtral with ``output_router_logits``.

    5.3.0's router-logit capture does not survive dynamo: the unwrapped model
    itself fails (``IndexError`` in ``load_balancing_loss_func``), so there the
    compile check runs without the auxiliary loss.
    """
    torch._dynamo.reset()
    try:
        torch.compile(build_moe("mixtral").train(), backend="aot_eager")(**batch)
    except IndexError:
        return False
    finally:
        torch._dynamo.reset()
    return True


def moe_peft(rank: int, world_size: int, splits: int) -> list[list[float]]:
    """LoRA on the attention projections of each split, three AdamW steps on the
    adapters: the losses and the next logits equal the unwrapped LoRA model's."""
    from peft import LoraConfig, get_peft_model

    def lora() -> LoraConfig:
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          init_lora_weights="gaussian")

    batch = _batch()
    losses = []
    for split in SPLITS[:splits]:
        base = build_moe("mixtral").train()
        torch.manual_seed(5)  # the same adapters' initial values on both sides
        ref = get_peft_model(base, lora())
        wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral").train(), **split)
        torch.manual_seed(5)
        tp = get_peft_model(wrapped.base_model, lora())
        want, got = _adamw_losses(ref, batch), _adamw_losses(tp, batch)
        # AdamW normalises each update: float64 reassociation stays ~1e-12 after 3 steps.
        torch.testing.assert_close(got, want, **TOL)
        with torch.no_grad():
            torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, **TOL)
        losses.append(got)
    return losses


ATTENTION_ONLY = {f"model.layers.*.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")
                  } | {"model.layers.*.self_attn.o_proj": "rowwise"}


def moe_peft_all_linear(rank: int, world_size: int, splits: int, out: str) -> list[str]:
    """``target_modules="all-linear"`` on an MoE model: PEFT resolves it for transformers
    v5's fused experts in its own module, adding their 3-D parameters as targets. With the
    experts split each way (``splits`` of :data:`SPLITS`) and with them whole (only the
    attention split), the adapters of the attention (torchtp's layers), the router and the
    experts equal one process's: logits, every adapter gradient, the adapter
    ``save_pretrained`` writes (gathered whole), and the logits once it is loaded
    again (``PeftModel.from_pretrained``: each rank keeps its slices), and three AdamW
    steps. The same adapters made before the wrap are refused by it: returns the messages."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from torchtp.integrations.adapter_slices import AdapterSlice

    def lora() -> LoraConfig:
        torch.manual_seed(5)  # the same adapters' initial values on both sides
        return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                          init_lora_weights=False)

    batch = _batch()
    ref = get_peft_model(build_moe("mixtral"), lora())
    ref(**batch).loss.backward()
    full = dict(ref.named_parameters())
    trained = [n for n, p in full.items() if p.requires_grad]
    assert any(".experts.lora_A." in n for n in trained), trained
    ref.save_pretrained(f"{out}/ref{rank}")
    want = load_file(f"{out}/ref{rank}/adapter_model.safetensors")
    for i, kwargs in enumerate([*SPLITS[:splits], {"plan": ATTENTION_ONLY}]):
        wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"), **kwargs)
        tp = get_peft_model(wrapped.base_model, lora())
        sliced = any(".experts." in n and isinstance(m, AdapterSlice)
                     for n, m in tp.named_modules())
        assert sliced == ("plan" not in kwargs), kwargs  # the experts' adapters are sliced
        assert [n for n, p in tp.named_parameters() if p.requires_grad] == trained
        torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, **TOL)
        tp(**batch).loss.backward()
        compare_params(wrapped, ref, True, TOL, named=tp)  # every adapter's gradient
        tp.save_pretrained(f"{out}/{i}")  # every rank: gathered whole, written by rank 0
        if rank == 0:
            got = load_file(f"{out}/{i}/adapter_model.safetensors")
            assert sorted(got) == sorted(want)
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
        torch.distributed.barrier()  # rank 0 has written it
        loaded = PeftModel.from_pretrained(torchtp.DistributedModelWrapper(
            build_moe("mixtral"), **kwargs).base_model, f"{out}/{i}")  # each rank: its slices
        torch.testing.assert_close(loaded(**batch).logits, ref(**batch).logits, **TOL)
        _adamw_steps_match(wrapped, tp, get_peft_model(build_moe("mixtral"), lora()), batch)
    try:  # such adapters made before the wrap: refused at the wrap, on every rank
        torchtp.DistributedModelWrapper(get_peft_model(build_moe("mixtral"), lora()))
    except ValueError as err:
        return [str(err)]
    return []


def _adamw_steps_match(wrapped: torchtp.DistributedModelWrapper, tp: nn.Module,
                       ref: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Three AdamW steps on the adapters of ``tp`` (around ``wrapped``) and of ``ref`` (one
    process, the same adapters): the same losses, and every parameter after them this
    rank's cut of the reference's (the sliced factors, the replicated ones summed)."""
    ref.zero_grad(set_to_none=True)
    tp.zero_grad(set_to_none=True)
    want, got = _adamw_losses(ref, batch), _adamw_losses(tp, batch)
    torch.testing.assert_close(got, want, **TOL)  # as in moe_peft
    compare_params(wrapped, ref, False, TOL, named=tp)


def _adamw_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[float]:
    """The losses of three AdamW steps on ``model``'s trainable parameters."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return _adamw_steps(model, opt, batch, 3)


def moe_peft_expert_parameters(rank: int, world_size: int, splits: int) -> list[str]:
    """PEFT's documented GPT-OSS LoRA (``target_parameters``: the experts' 3-D
    parameters, stored ``(E, in, out)``, with biases) on each split of the experts, and
    Mixtral's ``(E, out, in)`` ones with a single expert per rank: logits and every
    adapter gradient equal one process's. GPT-OSS with a single expert per rank is
    refused (PEFT would build its delta transposed), and so is LoRA on its split
    2-D ``gate_up_proj_bias``: returns the messages."""
    from peft import LoraConfig, get_peft_model

    def lora() -> LoraConfig:
        torch.manual_seed(5)
        return LoraConfig(r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
                          target_parameters=["mlp.experts.gate_up_proj",
                                             "mlp.experts.down_proj"])

    batch = _batch()
    whole = [dict(split) for split in SPLITS[1:splits]]  # whole experts, one per rank
    cases = [("gpt_oss", {}, split) for split in SPLITS[:splits]] \
        + [("mixtral", {"num_local_experts": 2}, split) for split in whole]
    for arch, config, split in cases:
        ref = get_peft_model(build_moe(arch, **config), lora())
        ref(**batch).loss.backward()
        wrapped = torchtp.DistributedModelWrapper(build_moe(arch, **config), **split)
        tp = get_peft_model(wrapped.base_model, lora())
        torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, **TOL)
        tp(**batch).loss.backward()
        trained = [n for n, p in ref.named_parameters() if p.requires_grad]
        assert [n for n, p in tp.named_parameters() if p.requires_grad] == trained
        compare_params(wrapped, ref, True, TOL, named=tp)  # every adapter's gradient
    refusals = []
    for split in whole:
        wrapped = torchtp.DistributedModelWrapper(build_moe("gpt_oss", num_local_experts=2),
                                                  **split)
        try:
            get_peft_model(wrapped.base_model, lora())
        except ValueError as err:
            refusals.append(str(err))
    wrapped = torchtp.DistributedModelWrapper(build_moe("gpt_oss"))
    try:  # a split 2-D parameter of the experts: PEFT takes it for an (out, in) weight
        get_peft_model(wrapped.base_model, LoraConfig(
            r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj_bias"]))
    except ValueError as err:
        refusals.append(str(err))
    return refusals


def moe_peft_two_adapters(rank: int, world_size: int, splits: int) -> int:
    """Two ``"all-linear"`` LoRA adapters (experts' parameters included) on each split:
    each alone, both active, and merged into the weights (``merge_and_unload``, then
    the wrapper's own forward) give one process's logits. Returns the cases checked."""
    from peft import LoraConfig, get_peft_model

    def lora(seed: int) -> LoraConfig:
        torch.manual_seed(seed)  # the same adapters' initial values on both sides
        return LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                          init_lora_weights=False)

    batch = _batch()

    def logits(model: nn.Module) -> dict[str, torch.Tensor]:
        peft = get_peft_model(model, lora(5))
        peft.add_adapter("second", lora(6))
        out = {"default": peft(**batch).logits}
        peft.set_adapter("second")
        out["second"] = peft(**batch).logits
        peft.base_model.set_adapter(["default", "second"])
        out["both"] = peft(**batch).logits
        out["merged"] = peft.merge_and_unload(adapter_names=["default", "second"])(
            **batch).logits
        return out

    checked = 0
    with torch.no_grad():
        want = logits(build_moe("mixtral"))
        for split in SPLITS[:splits]:
            wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"), **split)
            got = logits(wrapped.base_model)
            got["wrapper after merging"] = wrapped(**batch).logits
            for key, value in got.items():
                torch.testing.assert_close(value, want.get(key, want["merged"]), **TOL,
                                           msg=(split, key))
                checked += 1
    return checked


def moe_peft_latent_attention(rank: int, world_size: int) -> int:
    """LoRA on DeepSeek-V3 (multi-head latent attention, heads split; its whole
    ``kv_a_proj_with_mqa`` ends in a rope key every head reads), every projection of its
    attention adapted: after the wrap with a second adapter, both active; before the wrap
    (``DistributedModelWrapper(peft_model)``); and with a ``q_lora_rank`` as wide as that
    key (``q_a_proj``, ``q_b_proj``). Logits and every adapter gradient
    equal one process's; returns the rope key's adapter gradients checked."""
    from peft import LoraConfig, get_peft_model

    # Every projection of the attention (not "all-linear": on transformers 5.3 PEFT then
    # wraps DeepSeek-V3's router, whose forward reads e_score_correction_bias through it)
    attention = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]

    def lora(seed: int) -> LoraConfig:
        torch.manual_seed(seed)  # the same adapters' initial values on both sides
        return LoraConfig(r=2, lora_alpha=4, target_modules=attention, init_lora_weights=False)

    def after(model: nn.Module) -> nn.Module:
        peft = get_peft_model(model, lora(5))
        peft.add_adapter("second", lora(6))
        peft.base_model.set_adapter(["default", "second"])
        return peft

    def memory(model: nn.Module) -> nn.Module:  # every split: the q_a_proj path's heads too
        wrapped = torchtp.DistributedModelWrapper(model, plan="auto-memory")
        assert "mla_kv_a_proj" in wrapped.describe_plan()  # the rope key, not q_a_proj
        return after(wrapped.base_model)

    batch = _batch()
    checked = 0
    # q_lora_rank = kv_lora_rank + qk_rope_head_dim: q_a_proj has the rope key's width
    for config, make, wrap in (
            ({}, after, lambda m: after(torchtp.DistributedModelWrapper(m).base_model)),
            ({}, lambda m: get_peft_model(m, lora(5)),
             lambda m: torchtp.DistributedModelWrapper(
                 get_peft_model(m, lora(5))).base_model),
            ({"q_lora_rank": 24}, after, memory)):
        ref, tp = make(build_moe("deepseek_v3", **config)), wrap(build_moe("deepseek_v3",
                                                                           **config))
        torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, **TOL)
        ref(**batch).loss.backward()
        tp(**batch).loss.backward()
        compare_params(tp, ref, True, TOL, named=tp)  # every adapter's gradient
        checked += sum(".kv_a_proj_with_mqa.lora_" in n for n, p in tp.named_parameters()
                       if p.requires_grad)
    return checked


def moe_data(seed: int) -> list[dict[str, torch.Tensor]]:
    """16 samples of 8 token ids in the MoE models' vocabulary, labels = inputs."""
    ids = torch.randint(3, 96, (16, 8), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def moe_trainer_reference(out: str) -> list[dict[str, float]]:
    """The one-process ``transformers.Trainer`` run (call it outside any process group)."""
    from transformers import Trainer

    from ._trainer_runs import arguments, history

    ref = Trainer(model=build_moe("mixtral").train(), args=arguments(out, 4),
                  train_dataset=moe_data(1), eval_dataset=moe_data(2))
    ref.train()
    return history(ref)


def moe_trainer(rank: int, world_size: int, out: str,
                splits: int) -> list[list[dict[str, float]]]:
    """``TensorParallelTrainer`` at tp 2 for each split and with sequence parallelism
    (:func:`with_sequence_parallel`; compare with
    :func:`moe_trainer_reference`): logged losses (the router's auxiliary loss
    included), grad norms (max_grad_norm=1.0 clips) and eval losses."""
    from torchtp.integrations.transformers import TensorParallelTrainer

    from ._trainer_runs import arguments, history

    runs = []
    for i, split in enumerate(with_sequence_parallel(splits)):
        trainer = TensorParallelTrainer(
            model=torchtp.DistributedModelWrapper(build_moe("mixtral").train(), **split),
            args=arguments(f"{out}/tp{i}", 4), train_dataset=moe_data(1),
            eval_dataset=moe_data(2))
        trainer.train()
        runs.append(history(trainer))
    return runs


def moe_fabric(rank: int, world_size: int, splits: int) -> list[torch.Tensor]:
    """Lightning Fabric with ``ModelParallelStrategy`` and torchtp's ``parallelize`` (the
    split passed through), Fabric's TP-aware clipping on every step: the logits after
    three SGD steps (plain SGD: the update scales with the clip factor, which AdamW's
    normalised update would hide), for each split and with sequence parallelism (compare
    with :func:`moe_one_process`)."""
    import functools

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from torchtp.integrations.lightning import parallelize

    out = []
    for split in with_sequence_parallel(splits):
        strategy = ModelParallelStrategy(parallelize_fn=functools.partial(parallelize, **split),
                                         tensor_parallel_size=world_size, data_parallel_size=1)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        model = fabric.setup(build_moe("mixtral").train())
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
        for _ in range(3):
            fabric.backward(model(**_batch()).loss)
            fabric.clip_gradients(model, opt, max_norm=CLIP)
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out.append(model.eval()(**_batch()).logits)
    return out


def moe_accelerate(rank: int, world_size: int, splits: int) -> list[torch.Tensor]:
    """The accelerate loop docs/integrations.md documents (the model kept out of
    ``prepare``, the optimizer prepared, ``accelerator.backward``, torchtp's clipping, the
    same batches on every TP rank): the logits after three SGD steps, for each split and
    with sequence parallelism (compare with :func:`moe_one_process`)."""
    from accelerate import Accelerator

    out = []
    for split in with_sequence_parallel(splits):
        acc = Accelerator(cpu=True)
        model = torchtp.DistributedModelWrapper(build_moe("mixtral").train(), **split)
        opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=LR))
        for _ in range(3):
            acc.backward(model(**_batch()).loss)
            assert float(torchtp.clip_grad_norm_(model.parameters(), CLIP)) > CLIP
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out.append(model.eval()(**_batch()).logits)
    return out


CLIP = 0.5  # below the tiny Mixtral's gradient norm: every step is clipped
LR = 0.5


def moe_one_process() -> torch.Tensor:
    """:func:`moe_fabric`'s loop on the unwrapped model, torch's clipping."""
    model = build_moe("mixtral").train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(3):
        model(**_batch()).loss.backward()
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) > CLIP
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return model.eval()(**_batch()).logits
