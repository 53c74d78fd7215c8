"""Rank functions for test_fsdp.py: FSDP2 over the DP mesh around every kind of torchtp model.

Models whose replicated parameters get a partial gradient on each TP rank
(KV heads replicated because tp > num_key_value_heads, Qwen3's per-head
norms, sequence-parallel norms, LoRA adapters) train under FSDP2 exactly like
one process on the global batch. Every rank trains the unsharded reference
itself (same seeds), so the reference never comes from the shard under test.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

import torchtp

from ._hf_models import build
from ._training_checks import STEPS, TOL, _batch, _global_loss, _train

# Trained logits: TOL's reasoning, plus Qwen3's per-head RMSNorms on q and k whose
# rsqrt rounding the 3 Adam steps amplify (seen: 2.5e-5 absolute on a logit near 0;
# a missing gradient sum is off by ~0.1 already in the first norm).
LOGITS_TOL = {"rtol": 2e-4, "atol": 5e-5}


class Case(NamedTuple):
    arch: str
    overrides: dict[str, Any]
    options: dict[str, bool]  # DistributedModelWrapper options
    lora: tuple[str, ...] = ()  # LoRA target modules (only the adapters train)
    checkpointing: bool = False  # HF gradient checkpointing (recomputes each layer)
    double: bool = False  # float64: a router's top-k may not flip on reassociation

    @property
    def key(self) -> str:
        return f"{self.arch}{sorted(self.options)}{list(self.lora)}{self.checkpointing}"


KV1 = {"num_key_value_heads": 1}  # one KV head: replicated on both TP ranks at tp 2
CASES = (
    Case("llama", KV1, {}),
    Case("qwen3", {}, {}),  # per-head q_norm/k_norm
    Case("llama", KV1, {"sequence_parallel": True}),
    Case("qwen3", {}, {"sequence_parallel": True, "loss_parallel": True}, checkpointing=True),
    # A hybrid with sequence parallelism: its delta-net split by heads, its MoE blocks
    # run whole (router and shared expert replicated, complete gradients on every rank).
    Case("qwen3_next", {"_experts_implementation": "eager"}, {"sequence_parallel": True},
         double=True),  # grouped_mm takes no float64
    Case("llama", KV1, {}, ("k_proj", "o_proj")),  # adapters of replicated KV rows, split input
    # Parallel residual: both branches' partial sums reduced once per layer (reduce_residual),
    # plain and with LoRA on the two partial output projections.
    Case("gpt_neox", {}, {}),
    Case("gpt_neox", {}, {}, ("dense", "dense_4h_to_h")),
)


def _fsdp(wrapped: nn.Module, cfg: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in wrapped.base_model.base_model.layers:  # the decoder's (Llama, GPT-NeoX)
        fully_shard(layer, mesh=cfg.mesh["dp"])
    return fully_shard(wrapped, mesh=cfg.mesh["dp"])


def _build(case: Case) -> nn.Module:
    model = build(case.arch, seed=0, **case.overrides).train()
    if case.double:
        model.double()
    if case.checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _with_lora(model: nn.Module, targets: tuple[str, ...]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    if not targets:
        return model
    torch.manual_seed(5)  # the same adapters on both sides; B != 0 so they matter
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets),
                                            init_lora_weights="gaussian"))


def _trainable(model: nn.Module) -> Any:
    return lambda: [p for p in model.parameters() if p.requires_grad]


def synced_grads(rank: int, world_size: int) -> dict[str, Any]:
    """dp 2 x tp 2, FSDP2 on mesh['dp'] for every case: norms, global losses, trained logits."""
    cfg = torchtp.init_tensor_parallel(tp_size=2)
    ids = _batch(4, 7)  # 7 tokens: sequence shards of 4 and 3
    mine = ids[cfg.dp_rank * 2:(cfg.dp_rank + 1) * 2]  # this DP rank's slice
    out: dict[str, Any] = {}
    for case in CASES:
        ref = _with_lora(_build(case), case.lora)
        ref_losses, ref_norms = _train(ref, ids, torch.nn.utils.clip_grad_norm_, _trainable(ref))
        wrapped = torchtp.DistributedModelWrapper(_build(case), **case.options)
        _with_lora(wrapped.base_model, case.lora)
        # Replicated KV heads or per-head norms (GPT-NeoX at tp 2 has neither).
        assert case.arch == "gpt_neox" or any(getattr(m, "tp_grad_sync", None)
                                              for m in wrapped.modules())
        model = _fsdp(wrapped, cfg)
        calls = [0]
        assert case.arch != "gpt_neox" or any(
            s.name == "reduce_residual" for s in wrapped.resolved_plan.assignments.values())
        wrapped.base_model.base_model.layers[0].mlp.register_forward_pre_hook(
            lambda *_, c=calls: c.__setitem__(0, c[0] + 1))
        losses, norms = _train(model, mine, torchtp.clip_grad_norm_, _trainable(model))
        assert calls[0] == STEPS * (2 if case.checkpointing else 1)  # recomputed in backward

        def msg(m: str, key: str = case.key) -> str:
            return f"{key}: {m}"

        torch.testing.assert_close(norms, ref_norms, **TOL, msg=msg)
        torch.testing.assert_close(_global_loss(losses, cfg.dp_group), ref_losses, **TOL, msg=msg)
        with torch.no_grad():
            want = ref(input_ids=ids, labels=ids)
            if case.options.get("loss_parallel"):  # the logits are this rank's vocab shard
                got = model(input_ids=ids, labels=ids).loss
                torch.testing.assert_close(got, want.loss, **LOGITS_TOL, msg=msg)
            else:
                got = model(input_ids=ids).logits
                torch.testing.assert_close(got, want.logits, **LOGITS_TOL, msg=msg)
        out[case.key] = norms
    return out


def _steps(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, n: int
           ) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torchtp.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def resume(cfg: Any, tmp: str) -> dict[str, Any]:
    """dp 2 x tp 2 FSDP2: save after 2 AdamW steps, resume in a fresh FSDP2 model (same
    losses, bit for bit) and in plain tp 2 and tp 1 models on the global batch (the same
    global losses)."""
    from torchtp.checkpoint.dcp import load_training_state, save_training_state

    ids = _batch(4, 8)
    mine = ids[cfg.dp_rank * 2:(cfg.dp_rank + 1) * 2]

    def fsdp_llama(seed: int) -> nn.Module:
        # One KV head: k/v_proj are saved gathered, the other splits as Shard(dim) DTensors.
        return _fsdp(torchtp.DistributedModelWrapper(build("llama", seed=seed, **KV1).train()),
                     cfg)

    model = fsdp_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, mine, 2)
    save_training_state(tmp, model, opt, step=2, extra={"note": "x"})
    uninterrupted = _steps(model, opt, mine, 2)
    fresh = fsdp_llama(5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    loaded = load_training_state(tmp, fresh, fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    resumed = _steps(fresh, fresh_opt, mine, 2)
    # FSDP2 -> no FSDP2 at the same tp: every TP group loads the whole tp 2 state.
    plain = torchtp.DistributedModelWrapper(build("llama", seed=5, **KV1).train())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    assert load_training_state(tmp, plain, plain_opt)[0] == 2
    want = _global_loss(uninterrupted, cfg.dp_group)
    torch.testing.assert_close(_steps(plain, plain_opt, ids, 2), want, **TOL)
    # FSDP2 at tp 2 -> tp 1: every rank loads the whole model into its own 1-rank group.
    single, _ = torch.distributed.new_subgroups_by_enumeration([[0], [1], [2], [3]])
    one = torchtp.DistributedModelWrapper(build("llama", seed=5, **KV1).train(), group=single)
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3)
    assert load_training_state(tmp, one, one_opt)[0] == 2
    torch.testing.assert_close(_steps(one, one_opt, ids, 2), want, **TOL)
    return {"loaded": loaded, "uninterrupted": uninterrupted, "resumed": resumed}


def fsdp_suite(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Both checks in one set of 4 processes (they are expensive on a small machine)."""
    out = synced_grads(rank, world_size)
    out["resume"] = resume(torchtp.get_tensor_parallel_config(), tmp)
    return out


def compiled(rank: int, world_size: int) -> list[float]:
    """torch.compile around the FSDP2 model from its first call: the sum hooks still reach
    FSDP2's unsharded parameters (one graph break per owning module, first trace only)."""
    cfg = torchtp.init_tensor_parallel(tp_size=2)
    ids = _batch(4, 8)
    mine = ids[cfg.dp_rank * 2:(cfg.dp_rank + 1) * 2]
    ref = build("llama", seed=0, **KV1).train()
    ref_losses, ref_norms = _train(ref, ids, torch.nn.utils.clip_grad_norm_, ref.parameters)
    model = _fsdp(torchtp.DistributedModelWrapper(build("llama", seed=0, **KV1).train()), cfg)
    losses, norms = _train(torch.compile(model, backend="aot_eager"), mine,
                           torchtp.clip_grad_norm_, model.parameters)
    torch.testing.assert_close(norms, ref_norms, **TOL)
    torch.testing.assert_close(_global_loss(losses, cfg.dp_group), ref_losses, **TOL)
    return norms
