"""How HF plans are found, read from files, detected, checked and refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchtp

from ._hf_checks import check_arch, check_archs, strip_plans
from ._hf_models import build

# HF models without a plan go through the automatic plan hand-written models use.
# Per forward: one all-reduce per attention/MLP pair; these tiny heads and lone
# Linears (vocabulary 128, hidden 64) stay whole: splitting one alone saves 16 KiB
# per rank and costs an all-gather forward and an all-reduce backward (the cost
# model, torchtp.plans.choose; a hand-written Megatron plan gathers the lm_head).
UNPLANNED = {
    "llama": {"all_reduce": 4},
    "opt": {"all_reduce": 4},
    # Interleaved fused qkv (per-head [q k v]), told apart from stacked by the probe;
    # the parallel residual reduced once per layer (reduce_residual).
    "gpt_neox": {"all_reduce": 2},
    # q/k/v in attention.self, the output projection in a sibling module.
    "bert": {"all_reduce": 4},
    # Fused qkv, ALiBi biases narrowed to each rank's heads: interleaved (Bloom), stacked (MPT).
    "bloom": {"all_reduce": 4},
    "mpt": {"all_reduce": 4},
    # CodeGen's qkv reshape hard-codes 4 groups: the probe refuses its attention.
    "codegen": {"all_reduce": 2},
}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hf_models_without_a_plan_pair_by_dataflow_and_match_unsharded(ranks, world_size):
    # Every plan removed: logits, every gradient and an SGD step equal the
    # unsharded model's; collectives as a hand-written Megatron plan's.
    results = ranks(check_archs, world_size, list(UNPLANNED), 1, True, timeout=400,
                    gloo_timeout=120)
    for arch, want in UNPLANNED.items():
        got = results[0][arch]
        assert got["source"] == "auto: dataflow pairs (any model)", arch
        assert got["collectives"] == want, (arch, got["collectives"])
        assert got["planned"] == want, (arch, got["planned"])


def test_hf_models_without_a_plan_say_what_stays_replicated_and_why():
    # CodeGen ships a plan from transformers 5.24 (test_plan_verification covers it).
    codegen = torchtp.DistributedModelWrapper(strip_plans(build("codegen")), world_size=2, rank=0)
    text = codegen.describe_plan()
    assert "'transformer.h.0.attn' kept replicated: with ['transformer.h.0.attn.qkv_proj'] " \
           "split, the local probe does not reproduce this rank's slice" in text
    assert codegen.resolved_plan.rules["transformer.h.0.attn.qkv_proj"] == "replicate"
    mpt = torchtp.DistributedModelWrapper(build("mpt"), world_size=2, rank=1)
    assert mpt.resolved_plan.rules["transformer.blocks.0.attn.Wqkv"] == "packed_colwise"
    assert "whole heads of 'transformer.blocks.*.attn' (8 heads" in mpt.describe_plan()
    assert mpt.base_model.transformer.blocks[0].attn.n_heads == 4
    # Qwen3's q_norm/k_norm normalize each head over head_dim: heads split, norms
    # replicated with their gradients summed (exactness: test_head_boundaries at tp 3).
    qwen3 = torchtp.DistributedModelWrapper(strip_plans(build("qwen3")), world_size=2, rank=0)
    assert qwen3.resolved_plan.rules["model.layers.0.self_attn.q_norm"] == \
        "replicated_with_grad_allreduce"
    assert qwen3.resolved_plan.collectives() == {"all_reduce": 4}


def test_plan_sources_and_printing():
    llama = torchtp.DistributedModelWrapper(build("llama"), world_size=2, rank=0)
    text = llama.describe_plan()
    assert text.startswith("plan source: HF plan (config.base_model_tp_plan + _tp_plan)")
    row = next(line for line in text.splitlines() if line.startswith("model.layers.*.self_attn.k_proj"))
    assert row.split() == ["model.layers.*.self_attn.k_proj", "colwise", "2", "(e.g.",
                           "model.layers.0.self_attn.k_proj)"]
    # The HF plan's lm_head and embed_tokens rules (vocabulary 128) are overruled by cost.
    assert llama.resolved_plan.rules["lm_head"] == "replicate"
    assert "'lm_head' kept replicated: splitting it alone saves 16.0 KiB of parameters per " \
           "rank" in text
    assert llama.valid_world_sizes == list(range(1, 9))  # at least one of 8 query heads per rank
    gpt2 = torchtp.DistributedModelWrapper(build("gpt2"), world_size=2, rank=0)
    assert gpt2.resolved_plan.source == "torchtp built-in plan for 'gpt2'"
    assert "transformer.h.*.attn.c_attn" in gpt2.resolved_plan.rules


def test_builtin_phi3_plan_splits_packed_parts_instead_of_gathering(ranks):
    # HF's Phi-3 plan gathers qkv_proj and gate_up_proj (5 all-gathers for 2
    # layers); torchtp's built-in plan splits q|k|v and gate|up part by part.
    for got in ranks(check_arch, 4, "phi3", 1, False, "builtin", timeout=200):
        assert got["source"] == "torchtp built-in plan for 'phi3'"
        assert got["collectives"] == {"all_reduce": 5, "all_gather": 1}
    with pytest.raises(ValueError, match=r"no built-in plan for model_type='llama'; built-in "
                                         r"plans exist for \[.*'gpt2'.*'phi3'"):
        torchtp.DistributedModelWrapper(build("llama"), world_size=2, rank=0, plan="builtin")


def _yaml_plan(rank: int, world_size: int, path: str) -> dict:
    return check_arch(rank, world_size, "llama", 1, plan=path)


def test_plan_from_a_yaml_file(ranks, tmp_path):
    path = tmp_path / "tp_plan.yaml"
    path.write_text("model.layers.*.self_attn.q_proj: colwise\n"
                    "model.layers.*.self_attn.k_proj: colwise\n"
                    "model.layers.*.self_attn.v_proj: colwise\n"
                    "model.layers.*.self_attn.o_proj: rowwise\n"
                    "model.layers.*.mlp.gate_proj: colwise\n"
                    "model.layers.*.mlp.up_proj: colwise\n"
                    "model.layers.*.mlp.down_proj: rowwise\n")
    got = ranks(_yaml_plan, 2, str(path))[0]
    assert got["source"] == f"file {path}"
    assert got["collectives"] == {"all_reduce": 4}


def test_bad_plan_files(tmp_path):
    model = build("llama")
    with pytest.raises(FileNotFoundError, match=r"plan file .*missing\.yaml does not exist"):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0, plan=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model.layers.*.q_proj: [colwise\n")
    with pytest.raises(ValueError, match=r"plan file .*bad.yaml is not valid yaml"):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0, plan=bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model.layers.*.q_proj: 3\n")
    with pytest.raises(ValueError, match=r"wrong.yaml: entry 'model.layers.\*.q_proj': 3 must map"):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0, plan=wrong)


def test_more_ranks_than_heads_raise_at_wrap_time_with_valid_sizes():
    model = build("llama")
    with pytest.raises(ValueError, match=(
            r"LlamaForCausalLM: module 'model.layers.0.self_attn.q_proj' \(style 'colwise'\): "
            r"num_attention_heads \(query heads\)=8 cannot give each of world_size=9 ranks at "
            r"least one .*valid world sizes for this model: \[1, 2, 3, 4, 5, 6, 7, 8\]")):
        torchtp.DistributedModelWrapper(model, world_size=9, rank=0)
    # Nothing was touched: the model is still whole and usable.
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.parametrize("tp,rank,kv_rows,q_heads", [
    # 12 query heads in 3 KV groups of 4. tp 6: every KV head on 2 ranks, 2 query heads each.
    (6, 5, (16, 8), 2),
    # tp 4: ranks are shared out over the KV heads 2/1/1; KV head 0's 4 query heads split 2/2.
    (4, 1, (0, 8), 2),
    (4, 3, (16, 8), 4),
    # tp 2: whole KV groups, uneven (2 groups / 1 group).
    (2, 1, (16, 8), 4),
])
def test_kv_groups_stay_together_and_kv_heads_replicate_when_fewer(tp, rank, kv_rows, q_heads):
    sizes = {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 96,
             "intermediate_size": 192, "vocab_size": 192}
    ok = torchtp.DistributedModelWrapper(build("llama", **sizes), world_size=tp, rank=rank)
    attn = ok.base_model.model.layers[0].self_attn
    assert torchtp.layouts_of(attn.k_proj)["weight"].segments == (kv_rows,)  # head_dim 8
    kv_heads = kv_rows[1] // 8
    assert attn.q_proj.weight.shape == (q_heads * 8, 96)
    assert attn.o_proj.weight.shape == (96, q_heads * 8)  # o_proj columns follow the q heads
    assert attn.num_key_value_groups == q_heads // kv_heads
    assert attn.config.num_attention_heads == q_heads


def test_unknown_and_moe_styles_are_refused_not_replicated():
    import transformers as tf

    with pytest.raises(ValueError, match=r"unknown plan style 'colwize' for 'model.layers.\*.mlp"):
        torchtp.DistributedModelWrapper(build("llama"), world_size=2, rank=0,
                                        plan={"model.layers.*.mlp.up_proj": "colwize"})
    config = tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                              num_local_experts=4)
    # The experts styles are supported (test_moe.py); a style that only makes sense on an
    # expert parameter, given to the experts module, is refused, not replicated.
    with pytest.raises(ValueError, match=(
            r"plan style 'grouped_gemm' for module 'model.layers.0.mlp.experts' "
            r"\(MixtralExperts\) is not supported by torchtp: a bare expert parameter.*does not "
            r"silently replicate")):
        torchtp.DistributedModelWrapper(tf.MixtralForCausalLM(config), world_size=2, rank=0,
                                        plan={"model.layers.*.mlp.experts": "grouped_gemm"})


def _granite_swa() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tf.GraniteSWAConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2))


@pytest.mark.skipif(not hasattr(__import__("transformers"), "GraniteSWAConfig"),
                    reason="Granite-SWA is new in transformers 5.24 (make test runs it)")
def test_a_model_plan_with_a_style_torchtp_cannot_honour_gives_way_to_another_candidate():
    # A model plan naming 'all_reduce' (Inkling's): every wrap used to raise. The next
    # candidate wins, and the note says why. The same rules passed by the user are still
    # refused.
    model = _granite_swa()
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp": "all_reduce"}
    hf_rules = dict(model.tp_plan)
    wrapped = torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
    assert not wrapped.resolved_plan.source.startswith("HF plan")
    assert re.search(r"note: HF plan \(.*\) not used: plan style 'all_reduce' for module "
                     r"'model\.layers\.0\.mlp' \(GraniteSWAMLP\) is not supported "
                     r"by torchtp.*; .* chosen instead", wrapped.describe_plan())
    with pytest.raises(ValueError, match=r"plan style 'all_reduce' for module "
                       r"'model\.layers\.0\.mlp' \(GraniteSWAMLP\) is not supported"):
        torchtp.DistributedModelWrapper(_granite_swa(), world_size=2, rank=0, plan=hf_rules)


@pytest.mark.skipif(not hasattr(__import__("transformers"), "GraniteSWAConfig"),
                    reason="Granite-SWA is new in transformers 5.24 (make test runs it)")
def test_attention_sinks_are_cut_with_the_heads():
    # Granite-SWA's own plan: q/k/v/o by whole heads, 'self_attn.sinks': 'colwise' and
    # 'self_attn': 'local_params' (HF's bare parameter sharded with the heads). Refused
    # before 2026-12-07, then given way to the automatic plan, which kept the attention
    # whole for its sinks. Each rank keeps its heads' sinks: 2 of 4 at tp 2; at tp 3 ranks 0
    # and 1 share KV head 0 and hold one query head each, rank 2 holds KV head 1's two.
    for tp, held in ((2, [2, 2]), (3, [1, 1, 2])):
        plans = [torchtp.DistributedModelWrapper(_granite_swa(), world_size=tp, rank=r)
                 for r in range(tp)]
        assert all(p.resolved_plan.source.startswith("HF plan") for p in plans)
        text = plans[0].describe_plan()
        assert "rule 'model.layers.*.self_attn.sinks' (colwise) is planned by " \
               "'model.layers.*.self_attn' (local_params)" in text
        assert "matched no module" not in text
        layouts = [torchtp.layouts_of(p.base_model.model.layers[0].self_attn) for p in plans]
        assert [lay["sinks"].local_shape[0] for lay in layouts] == held, layouts


def test_tied_weights_split_two_ways_are_refused():
    model = build("llama-tied")
    plan = {"lm_head": "colwise_gather_output", "model.embed_tokens": "replicate"}
    with pytest.raises(ValueError, match=(
            r"LlamaForCausalLM: 'model.embed_tokens.weight' is tied to 'lm_head.weight' but the "
            r"plan splits them differently \('replicate' vs 'colwise_gather_output'\) at "
            r"world_size=2; give both the same split")):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0, plan=plan)


def test_tied_weights_stay_one_parameter():
    # plan="auto-memory": the HF plan's vocabulary splits, kept (the leanest candidate).
    wrapped = torchtp.DistributedModelWrapper(build("llama-tied"), world_size=2, rank=1,
                                              plan="auto-memory")
    model = wrapped.base_model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (64, 64)  # vocab 128 split over 2 ranks


def test_transformers_stays_optional(tmp_path):
    script = tmp_path / "no_hf.py"
    script.write_text(
        "import sys\n"
        "sys.modules['transformers'] = None  # import transformers now raises ImportError\n"
        "import torch, torchtp\n"
        "from torchtp.hf import require_transformers\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n"
        "print(torchtp.DistributedModelWrapper(m, world_size=2, rank=0).parallelized_layers)\n"
        "try:\n"
        "    require_transformers()\n"
        "except ImportError as err:\n"
        "    print(err)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "['0', '2']",
        "this needs HuggingFace transformers: pip install 'torchtp[hf]' "
        "(transformers, safetensors, accelerate)"]


def _checkpointed_grads(rank: int, world_size: int) -> int:
    from ._hf_checks import compare_params, inputs, loss_of

    ref, model = build("llama").train(), build("llama").train()
    ref.gradient_checkpointing_enable()
    wrapped = torchtp.DistributedModelWrapper(model)
    wrapped.base_model.gradient_checkpointing_enable()
    batch = inputs("llama")
    loss_of(ref, batch).backward()
    loss_of(wrapped, batch).backward()
    return compare_params(wrapped, ref, grads=True)


def test_gradient_checkpointing_recomputes_collectives_exactly(ranks):
    # Recomputation re-runs the forward all-reduces inside backward, in the same
    # order on every rank; gradients still equal the unsharded model's (KV heads
    # replicated at tp=4).
    assert ranks(_checkpointed_grads, 4, timeout=200) == [21] * 4


def test_t5_splits_attention_by_heads_with_its_relative_position_table():
    """Issue 36: T5 kept its attention replicated (0.71 of its parameters per rank at tp 2):
    the relative position table is indexed by head. It is kept whole on every rank (32 x
    heads values), each rank's attention narrows the bias to its own heads, and the table's
    gradient is summed over the group; exactness at tp 2, 3 and 4 is test_hf_more_archs'."""
    wrapped = torchtp.DistributedModelWrapper(build("t5"), world_size=2, rank=0)
    plan = wrapped.resolved_plan
    assert plan.source == "torchtp built-in plan for 't5'"
    assert set(plan.checks.values()) == {"confirmed"}  # every attention, cross-attention too
    table = "encoder.block.*.layer.0.SelfAttention.relative_attention_bias"
    assert plan.rules[table] == "replicated_with_grad_allreduce"
    local = sum(p.numel() for p in wrapped.parameters())
    full = sum(p.numel() for p in build("t5").parameters())
    assert local / full < 0.53  # was 0.71: the tied 128-token embedding stays whole
