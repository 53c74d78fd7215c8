"""Mixture of experts: every expert split, or whole experts per rank (issue 22, first part).

HF MoE models (transformers' 3-D expert parameters) at tp 2 against one
process, in float64: logits, the loss with the router's auxiliary loss, every
top-k choice and every gradient, the router's included. ``make compat`` runs
this file on the oldest supported transformers too, where some models' plans
keep their experts whole and whole experts per rank are refused.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from torch import nn

import torchtp

from ._moe_checks import (
    ARCHS,
    ROUTER_TOL,
    build_moe,
    check_checkpoints,
    check_dp_tp,
    check_generate,
    check_grouped_mm,
    check_grouped_mm_uneven,
    check_hub_kernels,
    check_hub_layout,
    check_moe,
    check_resume,
    check_route_mismatch,
)
from ._moe_checks import _batch as _moe_batch


def _planned(arch: str) -> bool:
    """Whether the model's own HF plan splits its experts (5.3.0: Mixtral and Qwen3-MoE only;
    from 5.25 the entry is torchtp's completion of the plan, as 5.24 shipped it)."""
    from torchtp.hf.plan_source import hf_plan

    return "moe_tp_experts" in (hf_plan(build_moe(arch)) or {}).values()


def _sentinel() -> bool:
    """Whether this transformers' experts forward skips other ranks' routes (5.24: yes)."""
    from torchtp.hf.compat import experts_flags

    flags = experts_flags(build_moe("mixtral").model.layers[0].mlp.experts)
    return flags is not None and flags["sentinel"]


def test_experts_split_inside_match_one_process(ranks):
    # GPT-OSS: (E, H, 2I) weights, gate/up interleaved, a bias inside every expert: the
    # gate/up bias keeps its weight's features, the down bias is added by rank 0 only (its
    # gradient, compared on every rank, is then whole everywhere). Its own plan names no
    # experts: torchtp splits them (hf/compat.EXPERTS_SPLIT) and its attention by heads.
    results = ranks(check_moe, 2, [*ARCHS, "gpt_oss"], timeout=300)
    for rank, res in enumerate(results):
        gpt = res.pop("gpt_oss")
        assert gpt["local"] == (4, 32, 24), (rank, gpt["local"])  # (E, H, 2I/2)
        assert re.search(r"model\.layers\.\*\.mlp\.experts +moe_tp_experts", gpt["describe"])
        assert re.search(r"self_attn \(x2\) +local_params +4 -> 2", gpt["describe"])
        assert "the down_proj bias stays whole and is added by the first rank" in gpt["describe"]
    for arch, res in results[0].items():
        assert res["experts"].startswith("Parallel") == _planned(arch), arch
        if not _planned(arch):  # kept whole by the model's own plan: exact all the same
            continue
        config = build_moe(arch).config
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        assert res["local"] == (4, inter, 32), arch  # (E, 2I/2, H): half of every expert
        assert len(res["router_grads"]) == 2, arch  # one router per layer, gradient checked
        assert "one all-reduce per MoE layer" in res["describe"], arch
        # The experts' rule (5.24 also names their parameters, planned by it)
        assert re.search(r"model\.layers\.\*\.mlp\.experts +moe_tp_experts", res["describe"])


def test_whole_experts_on_each_rank_match_one_process(ranks):
    if not _sentinel():  # an older transformers: refused at wrap time, naming the fix
        with pytest.raises(ValueError, match=r"no expert-parallel sentinel.*upgrade transformers"):
            torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=2, rank=0,
                                            expert_parallel=True)
        return
    # expert_parallel=True: E/tp whole experts per rank (3 experts: 2 and 1, uneven).
    # GPT-OSS: biases inside every expert, its HF tp plan leaves the experts unplanned.
    archs = [a for a in ARCHS if _planned(a)] + ["gpt_oss", "mixtral-e3", "mixtral-starved"]
    results = ranks(check_moe, 2, archs, True, timeout=300)
    # Starved: rank 1's experts (2 and 3) received no token: zero gradients, not None.
    assert results[1]["mixtral-starved"]["expert_grad_norm"] == 0.0
    assert results[0]["mixtral-starved"]["expert_grad_norm"] > 0.0
    for arch, res in results[0].items():
        assert res["experts"].startswith("Parallel"), arch
        experts = 2 if arch == "mixtral-e3" else 4 // 2
        assert res["local"][0] == experts and len(res["router_grads"]) == 2, arch
        assert "HF's 'all_reduce' expert parallelism" in res["describe"], arch
    assert results[1]["mixtral-e3"]["local"][0] == 1  # rank 1 holds the third expert
    # GPT-OSS's attention split by heads, its sinks cut with them (decision 169; its own
    # plan splits only the embedding and LM head): every gradient above compared.
    assert re.search(r"model\.layers\.\*\.self_attn \(x2\) +local_params +4 -> 2",
                     results[0]["gpt_oss"]["describe"]), results[0]["gpt_oss"]["describe"]


@pytest.mark.skipif(not hasattr(transformers, "Param2MoeConfig"),
                    reason="model types added by transformers 5.25 (make compat runs the newest)")
def test_moe_models_new_in_5_25_match_one_process(ranks):
    # Logits, loss, routes, every gradient, two AdamW steps (check_one), experts split inside
    # (5.25 names them in the EP plan only; hf/compat.EXPERTS_SPLIT restores the split) and
    # whole. Param2MoE's plan leaves its q_norm/k_norm plainly replicated inside the head
    # split: their gradients are summed all the same (compared here).
    archs = ["param2moe", "minicpm5_moe", "kolibri1_1"]
    for whole in (False, True):
        results = ranks(check_moe, 2, archs, whole, timeout=300)
        for arch in archs:
            assert results[0][arch]["checked"] > 20, (arch, whole)
            # gate_up_proj (experts, 2 x intermediate, hidden): 4 x 48 x 32 in one process
            assert results[0][arch]["local"] == ((2, 48, 32) if whole else (4, 24, 32)), arch
    text = results[0]["param2moe"]["describe"]
    assert "'model.layers.*.self_attn.q_norm' gets replicated_with_grad_allreduce" in text


def test_ranks_that_route_differently_raise_on_every_rank(ranks):
    for expert_parallel in [False, True] if _sentinel() else [False]:  # whole: see above
        _route_mismatch_raises(ranks, expert_parallel)


def test_a_hub_kernel_in_place_of_split_experts_is_refused(ranks):
    # kernels binds a hub kernel's forward to the module (transformers' use_kernels=True on
    # CUDA: GPT-OSS's MegaBlocksMoeMLP on 5.24), which would compute from the split experts
    # without their all-reduce: kernelized before the wrap, or after it (train()/eval()
    # re-kernelize), the next forward raises on every rank before any collective.
    got = ranks(check_hub_kernels, 2, timeout=120)
    assert [m for m, _ in got[0]] == [m for m, _ in got[1]]  # the same verdict on every rank
    for rank in got:
        for message, seconds in rank:
            assert re.search(
                r"^'model.layers.0.mlp' \(KernelGptOssMLP\) runs the hub kernel "
                r"'MegaBlocksMoeMLP' \(kernelized: .*computes from the parameters of "
                r"'model.layers.0.mlp.experts' itself.*use_kernels=False.*"
                r"plan=\{'model.layers.0.mlp.experts': 'replicate'\}$", message), message
            assert seconds < 5  # refused before the forward's first collective


def _route_mismatch_raises(ranks, expert_parallel: bool) -> None:
    got = ranks(check_route_mismatch, 2, expert_parallel, timeout=120)
    for message, seconds in got:
        assert re.search(r"'model.layers.0.mlp.experts' \(ParallelMixtralExperts\): the "
                         r"tensor-parallel ranks routed tokens to different experts", message)
        assert seconds < 30  # raised at that layer's own all-reduce, no timeout waited
    assert got[0][0] == got[1][0]


def test_generate_matches_one_process(ranks):
    # Greedy and seeded sampling, KV cache; whole experts where transformers allows them, also
    # through all-to-all dispatch (a decode step's one token: rank 1 routes none).
    tokens = ranks(check_generate, 2, [False, True, "all_to_all"] if _sentinel() else [False],
                   timeout=180)
    assert tokens[0] == tokens[1]


def test_three_ranks_split_unevenly_and_match_one_process(ranks):
    # tp 3: Qwen3-MoE's 24 expert features as 8/8/8 (gate_up (E, 2I/3, H) = (4, 16, 32)), its
    # 4 whole experts as 2/1/1. GPT-OSS's 24 features, interleaved gate/up pairs with their
    # biases, as 8/8/8 too ((E, H, 2I/3) = (4, 32, 16)), its down bias added by rank 0 only.
    # Gradients to float32 level: see ROUTER_TOL.
    for whole in [False, True] if _sentinel() else [False]:
        archs = ["qwen3_moe"] if whole else ["qwen3_moe", "gpt_oss"]
        results = ranks(check_moe, 3, archs, whole, ROUTER_TOL, timeout=300)
        local = [r["qwen3_moe"]["local"] for r in results]
        assert local == ([(2, 48, 32), (1, 48, 32), (1, 48, 32)] if whole
                         else [(4, 16, 32)] * 3), (whole, local)
        if not whole:
            assert [r["gpt_oss"]["local"] for r in results] == [(4, 32, 16)] * 3


def test_grouped_mm_experts_match_one_process(ranks):
    ranks(check_grouped_mm, 2, _sentinel(), timeout=120)


def test_grouped_mm_runs_uneven_feature_shares_at_tp3(ranks):
    # 32 float32 features at tp 3: blocks of 4 features (16 bytes, grouped_mm's row
    # alignment) as 12/12/8 instead of 11/11/10, which grouped_mm rejects; in bfloat16
    # (blocks of 8) as 16/8/8, run under grouped_mm and checked against one process too.
    shapes = ranks(check_grouped_mm_uneven, 3, timeout=180)
    assert shapes == [[(4, 32, 12), (4, 32, 16)], [(4, 32, 12), (4, 32, 8)],
                      [(4, 32, 8), (4, 32, 8)]], shapes


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_expert_shards_save_reload_and_consolidate(ranks, tmp_path, arch):
    # Reloaded at tp 2 from the sharded save: every shard bit for bit; float32 logits.
    # With the sentinel, also split experts -> whole experts per rank -> split experts.
    # GPT-OSS: the gate/up bias saved and reloaded with its features, the down bias whole.
    assert max(ranks(check_checkpoints, 2, str(tmp_path), _sentinel(), arch,
                     timeout=180)) < 1e-5
    ids = _moe_batch()["input_ids"]
    want = build_moe(arch).float()(input_ids=ids).logits
    one = torchtp.DistributedModelWrapper.from_pretrained(tmp_path / "sharded", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for got in (one(input_ids=ids).logits, hf(input_ids=ids).logits):  # tp 2 -> 1, HF
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 sums reordered


def test_training_state_resumes_with_the_experts_optimizer_state(ranks, tmp_path):
    ranks(check_resume, 2, str(tmp_path / "dcp"), False, [False, True] if _sentinel() else [False],
          timeout=180)


def test_data_parallel_over_split_experts_matches_one_process(ranks):
    # 4 processes: dp 2 x tp 2 with DDP and with FSDP2 around the tp-split experts.
    results = ranks(check_dp_tp, 4, timeout=300)
    assert all(r["ddp"] == results[0]["ddp"] for r in results)


def test_one_all_reduce_per_moe_layer():
    # Planning only (world_size=2, rank=0 without a group): the plan's collective count.
    wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=2, rank=0)
    plan = wrapped.resolved_plan.layers["model.layers.0.mlp.experts"]
    assert plan.collectives == ("all_reduce",)
    gate_up = plan.layouts["gate_up_proj"]
    # Mixtral concatenates [gate; up]: rank 0 keeps gate rows 0..23 and up rows 48..71.
    assert gate_up.dim == 1 and gate_up.segments == ((0, 24), (48, 24))
    assert plan.layouts["down_proj"].segments == ((0, 24),)


def test_experts_that_are_not_a_sum_of_partial_outputs_are_refused():
    model = build_moe("mixtral")
    model.model.layers[0].mlp.experts.has_post_expert_norm = True  # a norm after each expert
    with pytest.raises(ValueError, match=(
            r"plan style 'moe_tp_experts' for module 'model.layers.0.mlp.experts' "
            r"\(MixtralExperts\): has_post_expert_norm=True: a norm after each expert is not "
            r"linear in the partial outputs.*expert_parallel=True.*'replicate'")):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
    model = build_moe("mixtral")
    model.model.layers[0].mlp.experts.has_bias = True  # flags that do not match the module
    with pytest.raises(ValueError, match=(
            r"\(MixtralExperts\): has_bias=True, but 'gate_up_proj_bias' is None, not a tensor "
            r"of shape \(4, 96\).*set has_bias to match")):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0)
    model = build_moe("gpt_oss")
    model.model.layers[0].mlp.experts.has_bias = False  # biases its forward would still add
    with pytest.raises(ValueError, match=(
            r"\(GptOssExperts\): has_bias=False, but the module holds 'gate_up_proj_bias' of "
            r"shape \(4, 48\).*set has_bias to match")):
        torchtp.DistributedModelWrapper(model, world_size=2, rank=0)


def test_bare_expert_parameters_and_pointless_expert_parallel_are_refused():
    with pytest.raises(ValueError, match=r"'grouped_gemm'.*planned by its experts module"):
        torchtp.DistributedModelWrapper(
            build_moe("mixtral"), world_size=2, rank=0,
            plan={"model.layers.*.mlp.experts": "grouped_gemm"})
    with pytest.raises(ValueError, match=r"expert_parallel=True, but the model has no "
                       r"transformers experts module and no hand-written experts that the "
                       r"automatic plan sums once \(an nn.ModuleList of expert MLPs; Sequential"):
        torchtp.DistributedModelWrapper(nn.Sequential(nn.Linear(4, 4)), world_size=2, rank=0,
                                        expert_parallel=True)


def test_expert_parallel_plans_whole_experts():
    def wrap() -> nn.Module:
        return torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=2, rank=1,
                                               expert_parallel=True)

    if not _sentinel():  # an older transformers: refused at wrap time on every rank
        with pytest.raises(ValueError, match="no expert-parallel sentinel"):
            wrap()
        return
    wrapped = wrap()
    plan = wrapped.resolved_plan.layers["model.layers.0.mlp.experts"]
    assert plan.style == "ep_dispatch_experts" and plan.collectives == ("all_reduce",)
    assert {n: lay.segments for n, lay in plan.layouts.items()} == {
        "gate_up_proj": ((2, 2),), "down_proj": ((2, 2),)}  # experts 2 and 3 on rank 1
    assert "expert_parallel=True: whole experts" in wrapped.describe_plan()


def test_too_many_ranks_for_the_expert_features_name_the_valid_sizes():
    with pytest.raises(ValueError, match=r"intermediate_size \(features of every expert\)"):
        torchtp.DistributedModelWrapper(build_moe("mixtral", intermediate_size=2),
                                        world_size=4, rank=0)


def test_tp1_keeps_the_experts_whole():
    model = build_moe("mixtral")
    wrapped = torchtp.DistributedModelWrapper(model)
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"
    assert wrapped.resolved_plan.layers["model.layers.0.mlp.experts"].style == "moe_tp_experts"
    assert torch.equal(wrapped(input_ids=torch.tensor([[3, 4, 5]])).logits,
                       build_moe("mixtral")(input_ids=torch.tensor([[3, 4, 5]])).logits)


def test_experts_named_only_in_the_ep_plan_are_split_as_5_24_splits_them():
    # transformers 5.25 names a MoE's experts in base_model_ep_plan only (5.24 also in the
    # TP plan, as moe_tp_experts): the plan is completed as 5.24 ships it, or every rank
    # would hold every expert whole.
    from torchtp.hf.plan_source import hf_plan

    model = build_moe("mixtral")
    # The plans as 5.25 ships them (5.3 has no EP plan: given here as 5.24 and 5.25 name it)
    model.tp_plan = {k: v for k, v in model.tp_plan.items() if ".experts" not in k}
    model.config.base_model_ep_plan = {"layers.*.mlp.experts": "ep_dispatch_experts"}
    assert hf_plan(model)["model.layers.*.mlp.experts"] == "moe_tp_experts"
    wrapped = torchtp.DistributedModelWrapper(model)
    assert wrapped.resolved_plan.layers["model.layers.0.mlp.experts"].style == "moe_tp_experts"
    # GPT-OSS (biases inside every expert): no transformers release splits its experts;
    # torchtp does (ep/styles.py)
    assert hf_plan(build_moe("gpt_oss"))["model.layers.*.mlp.experts"] == "moe_tp_experts"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_hub_checkpoints_with_one_tensor_per_expert_load_into_every_split(ranks, tmp_path, arch):
    # transformers writes (and the Hub holds) experts.{e}.w1/w2/w3 (Mixtral, under
    # block_sparse_moe) or experts.{e}.gate_proj/up_proj/down_proj; torchtp reads only
    # this rank's experts and rows into the 3-D parameters. float32: sums reordered.
    splits = (False, True) if _sentinel() else (False,)
    out = ranks(check_hub_layout, 2, str(tmp_path / arch), arch, splits, timeout=180)[0]
    per_expert = {"mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                  "qwen3_moe": "model.layers.0.mlp.experts.0.gate_proj.weight"}[arch]
    assert per_expert in out["keys"]
    assert max(out["diffs"]) < 1e-5
