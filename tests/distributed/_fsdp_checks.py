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
from ._training_checks import TOL, _batch, _global_loss, _train

# Trained logits: TOL's reasoning, plus Qwen3's per-head RMSNorms on q and k whose
# rsqrt rounding the 3 Adam steps amplify (seen: 2.5e-5 absolute on a logit near 0;
# a missing gradient sum is off by ~0.1 already in the first norm).
LOGITS_TOL = {"rtol": 2e-4, "atol": 5e-5}


class Case(NamedTuple):
    arch: str
    overrides: dict[str, Any]
    options: dict[str, bool]  # DistributedModelWrapper options
    lora: tuple[str, ...] = ()  # LoRA target modules (only the adapters train)

    @property
    def key(self) -> str:
        return f"{self.arch}{sorted(self.options)}{list(self.lora)}"


KV1 = {"num_key_value_heads": 1}  # one KV head: replicated on both TP ranks at tp 2
CASES = (
    Case("llama", KV1, {}),
    Case("qwen3", {}, {}),  # per-head q_norm/k_norm
    Case("llama", KV1, {"sequence_parallel": True}),
    Case("qwen3", {}, {"sequence_parallel": True, "loss_parallel": True}),
    Case("llama", KV1, {}, ("k_proj", "o_proj")),  # adapters of replicated KV rows, split input
)


def _fsdp(wrapped: nn.Module, cfg: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in wrapped.model.layers:
        fully_shard(layer, mesh=cfg.mesh["dp"])
    return fully_shard(wrapped, mesh=cfg.mesh["dp"])


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
        ref = _with_lora(build(case.arch, seed=0, **case.overrides).train(), case.lora)
        ref_losses, ref_norms = _train(ref, ids, torch.nn.utils.clip_grad_norm_, _trainable(ref))
        wrapped = torchtp.DistributedModelWrapper(build(case.arch, seed=0, **case.overrides)
                                                  .train(), **case.options)
        _with_lora(wrapped.base_model, case.lora)
        assert any(getattr(m, "tp_grad_sync", None) for m in wrapped.modules())
        model = _fsdp(wrapped, cfg)
        losses, norms = _train(model, mine, torchtp.clip_grad_norm_, _trainable(model))

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
