"""Rank functions for the newer decoder families of issue 37 (split by heads, not replicated)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torchtp
from torchtp.plans.heads import ssm_geometry

from ._hf_checks import check_arch, compare_params
from ._hf_models import build


def parameter_share(wrapped: torch.nn.Module, full: int) -> float:
    """The largest rank's parameter count over the unsharded model's."""
    mine = torch.tensor([sum(p.numel() for p in wrapped.parameters())], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine) / full


def check_family(rank: int, world_size: int, archs: list[str]) -> dict[str, dict]:
    """Logits, every gradient, two SGD steps and greedy generation equal one process's
    (:func:`check_arch`), plus the plan's source, its head norms and the parameter share."""
    out = {}
    for arch in archs:
        result = check_arch(rank, world_size, arch, 2)
        full = sum(p.numel() for p in build(arch).parameters())
        wrapped = torchtp.DistributedModelWrapper(build(arch))
        result["share"] = parameter_share(wrapped, full)
        result["head_norms"] = sorted(n for n, s in wrapped.resolved_plan.assignments.items()
                                      if getattr(s, "name", "") == "head_norm")
        result["describe"] = wrapped.describe_plan()
        out[arch] = result
    return out


def check_other_norm_kept_whole(rank: int, world_size: int) -> dict[str, str]:
    """A LayerNorm over all heads (mean subtracted: not the RMS norm ``head_norm`` computes)
    fails the plan probe: its attention stays whole, with the reason, and the logits are exact."""
    def with_layernorm() -> torch.nn.Module:
        model = build("olmo2")
        for layer in model.model.layers:
            torch.manual_seed(1)
            norm = torch.nn.LayerNorm(64, eps=1e-6)
            torch.nn.init.normal_(norm.weight)
            layer.self_attn.q_norm = norm
        return model

    ref, wrapped = with_layernorm(), torchtp.DistributedModelWrapper(with_layernorm())
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(wrapped(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)  # float32, the MLP's all-reduce order
    styles = {n: getattr(s, "name", "") for n, s in wrapped.resolved_plan.assignments.items()}
    return {"q_proj": styles.get("model.layers.0.self_attn.q_proj", "replicate"),
            "q_norm": styles.get("model.layers.0.self_attn.q_norm", "replicate"),
            "describe": wrapped.describe_plan()}


def build_hybrid(arch: str) -> torch.nn.Module:
    """A tiny float32 Qwen3-Next (gated delta-net + MoE), Jamba (Mamba + attention + MoE)
    or Nemotron-H's MoE and attention layers (experts without a gate: ``up_proj`` only)
    with transformers' default experts kernel (grouped_mm) and 32 expert features."""
    import transformers as tf

    common = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    if arch == "qwen3_next":
        config = tf.Qwen3NextConfig(
            **common, head_dim=8, intermediate_size=48, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=32, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"])
    elif arch == "nemotron_h":
        sizes = {**common, "head_dim": 8, "intermediate_size": 48, "moe_intermediate_size": 32,
                 "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "moe_shared_expert_intermediate_size": 32}
        try:
            config = tf.NemotronHConfig(**sizes, layers_block_type=["moe", "full_attention"])
        except ValueError:  # transformers before 5.24 names it "attention"
            config = tf.NemotronHConfig(**sizes, layers_block_type=["moe", "attention"])
    else:
        config = tf.JambaConfig(**common, intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                                mamba_expand=2, attn_layer_period=2, attn_layer_offset=1,
                                expert_layer_period=2, expert_layer_offset=1,
                                use_mamba_kernels=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).float().train()


def check_hybrid(rank: int, world_size: int, archs: list[str]) -> dict[str, tuple[int, ...]]:
    """Logits, loss and every gradient equal one process's under grouped_mm; returns each
    model's local experts ``down_proj`` shape."""
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    out = {}
    for arch in archs:
        ref, wrapped = build_hybrid(arch), torchtp.DistributedModelWrapper(build_hybrid(arch))
        # transformers 5.25's NemotronH asks its cache for a length before any attention
        # layer holds one ('DummyLayer' has no get_seq_length), unwrapped too: no cache.
        kw = {"use_cache": False} if arch == "nemotron_h" else {}
        want, got = ref(input_ids=ids, labels=ids, **kw), wrapped(input_ids=ids, labels=ids, **kw)
        # float32: the MoE layer's all-reduce sums the ranks' partials in another order.
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
        want.loss.backward()
        got.loss.backward()
        # Gradients of O(1e-3..1) through two float32 layers: rtol 1e-4 (see GRADS).
        compare_params(wrapped, ref, grads=True, tol={"rtol": 1e-4, "atol": 1e-5})
        experts = next(m for n, m in wrapped.base_model.named_modules()
                       if n.endswith("experts") and hasattr(m, "down_proj"))
        out[arch] = tuple(experts.down_proj.shape)
    return out


def build_kin(arch: str) -> torch.nn.Module:
    """A tiny float64 OLMo-3, FlexOlmo or MiniMax-M2 (q/k norms over all heads; experts
    run eagerly: grouped_mm has no float64 kernel)."""
    import transformers as tf

    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
              "max_position_embeddings": 64}
    config = {"olmo3": lambda: tf.Olmo3Config(**common),
              "flex_olmo": lambda: tf.FlexOlmoConfig(**common, num_experts=4,
                                                     num_experts_per_tok=2, pad_token_id=0),
              "minimax_m2": lambda: tf.MiniMaxM2Config(**common, head_dim=8,
                                                       num_local_experts=4,
                                                       num_experts_per_tok=2)}[arch]()
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).double()


def check_kin(rank: int, world_size: int, archs: list[str]) -> dict[str, list[str]]:
    """Logits, loss and every gradient equal one process's; returns each plan's head norms."""
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    out = {}
    for arch in archs:
        ref, wrapped = build_kin(arch), torchtp.DistributedModelWrapper(build_kin(arch))
        want, got = ref(input_ids=ids, labels=ids), wrapped(input_ids=ids, labels=ids)
        # The norms compute in float32 whatever the model's dtype: float32-level agreement.
        tol = {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(got.logits, want.logits, **tol)
        want.loss.backward()
        got.loss.backward()
        compare_params(wrapped, ref, grads=True, tol=tol)
        out[arch] = sorted(n for n, s in wrapped.resolved_plan.assignments.items()
                           if getattr(s, "name", "") == "head_norm")
    return out


def check_mixers(rank: int, world_size: int, archs: list[str]) -> dict[str, dict]:
    """:func:`check_family` (logits, every gradient, two SGD steps, greedy generation with
    the conv/SSM cache) plus each mixer's probe verdict, the share of the mixers' parameters
    a rank holds, and the whole share with ``plan="auto-memory"``."""
    out = check_family(rank, world_size, archs)
    for arch in archs:
        wrapped = torchtp.DistributedModelWrapper(build(arch))
        plan = wrapped.resolved_plan
        full = dict(build(arch).named_modules())
        # the mixers themselves (their parts have no verdict), split or kept whole
        mixers = [n for n in plan.checks if ssm_geometry(full[n]) is not None]
        mine = dict(wrapped.base_model.named_modules())
        held = sum(p.numel() for n in mixers for p in mine[n].parameters())
        out[arch].update(
            verdicts={n: plan.checks.get(n) for n in mixers},
            mixer_share=held / sum(p.numel() for n in mixers for p in full[n].parameters()),
            memory_share=parameter_share(
                torchtp.DistributedModelWrapper(build(arch), plan="auto-memory"),
                sum(p.numel() for p in build(arch).parameters())))
    return out


def check_fused_kernel_keeps_mixers_whole(rank: int, world_size: int, stub: str) -> dict:
    """With a ``mamba_ssm`` package importable (an empty one on ``sys.path``), the mixers stay
    whole with the reason: transformers' fused training kernel would compute their norm and
    ``out_proj`` past the all-reduce. The logits are exact all the same."""
    import importlib
    import sys

    sys.path.insert(0, stub)
    importlib.invalidate_caches()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    ref, wrapped = build("mamba2"), torchtp.DistributedModelWrapper(build("mamba2"))
    torch.testing.assert_close(wrapped(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)  # float32, the embedding's all-reduce
    plan = wrapped.resolved_plan
    return {"styles": {n: s.name for n, s in plan.assignments.items() if ".mixer" in n},
            "checks": dict(plan.checks), "describe": wrapped.describe_plan()}


def check_lora_on_x_proj_refused(rank: int, world_size: int) -> str:
    """LoRA on a split Mamba mixer's x_proj (its output's gradient is summed by a hook a
    LoRA branch would bypass): refused."""
    from peft import LoraConfig, get_peft_model

    wrapped = torchtp.DistributedModelWrapper(build("mamba-uneven"))
    try:
        get_peft_model(wrapped.base_model, LoraConfig(r=2, target_modules=["x_proj"]))
    except ValueError as err:
        return str(err)
    raise AssertionError("LoRA on a split mixer's x_proj was built")
