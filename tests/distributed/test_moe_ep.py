"""Expert parallel: ep x TP inside the experts, and all-to-all dispatch (issue 22).

At 4 ranks, ``expert_parallel=2`` places the experts over 2 ranks and splits
each expert's features over the 2 ranks that share them (ep 2 x tp 2, blocks
cut along two dimensions); ``expert_parallel=True`` is ep 4 (whole experts).
``expert_dispatch="all_to_all"`` sends each rank's slice of the tokens to the
experts' ranks and back instead of the all-reduce. Compared with one process
in float64 (routes first, so no top-k choice can flip): logits, the loss with
the router's auxiliary loss, every gradient, the whole model's gradient norm,
two AdamW steps; checkpoints move between the splits bit for bit. Needs
transformers' expert-parallel sentinel (5.24).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

import torchtp
from torchtp.checkpoint.fmt import METADATA_FILE
from torchtp.checkpoint.offline import consolidate, reshard
from torchtp.checkpoint.sources import TorchTPSource
from torchtp.core.layouts import ParamLayout
from torchtp.costmodel import expert_dispatch_times, get_hardware
from torchtp.ep.styles import ExpertsEP

from ._moe_checks import (
    ARCHS,
    ROUTER_TOL,
    build_moe,
    check_dp_tp,
    check_ep_checkpoints,
    check_moe,
    check_resume,
    check_route_mismatch,
)
from ._moe_checks import _batch as _moe_batch
from .test_moe import _sentinel

pytestmark = pytest.mark.skipif(not _sentinel(), reason="this transformers release has no "
                                "expert-parallel sentinel: whole experts are refused (test_moe "
                                "pins that refusal)")


def test_ep2_tp2_matches_one_process(ranks):
    # Every planned architecture, and the starved case: every token goes to experts 0 and 1,
    # held by ranks 0 and 1, so ranks 2 and 3 hold experts that receive no token.
    # Gradients to float32 level: four partial sums reach the float32 routers (ROUTER_TOL).
    # GPT-OSS: each block's down bias added by the block's first rank (ranks 0 and 2).
    results = ranks(check_moe, 4, [*ARCHS, "gpt_oss", "mixtral-starved"], 2, ROUTER_TOL,
                    timeout=420)
    for rank, res in enumerate(results):
        assert res.pop("gpt_oss")["local"] == (2, 32, 24), rank  # (E/2, H, 2I/2)
    for arch, res in results[0].items():
        config = build_moe(arch.removesuffix("-starved")).config
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        assert res["local"] == (2, inter, 32), arch  # (E/2, 2I/2, H): a block of the experts
        assert "4 experts over ep=2 ranks, 2 on this rank (0...1)" in res["describe"], arch
        assert len(res["router_grads"]) == 2, arch
    assert [r["mixtral-starved"]["expert_grad_norm"] == 0.0 for r in results] == \
        [False, False, True, True]


def test_ep4_whole_experts_match_one_process(ranks):
    # GPT-OSS: biases inside every expert, cut with them. Starved: ranks 2 and 3's
    # experts receive no token, and their optimizer states still match after two steps.
    results = ranks(check_moe, 4, ["mixtral", "gpt_oss", "mixtral-starved"], True, ROUTER_TOL,
                    timeout=300)
    assert [r["mixtral-starved"]["expert_grad_norm"] == 0.0 for r in results] == \
        [False, False, True, True]
    assert all(r["gpt_oss"]["local"][0] == 1 for r in results)  # one whole expert each


def test_all_to_all_dispatch_matches_one_process(ranks):
    # tp 2: every architecture (GPT-OSS's biases, 3 experts over 2 ranks, starved experts);
    # tp 4: one expert per rank, ranks 2 and 3 starved.
    archs = [*ARCHS, "gpt_oss", "mixtral-e3", "mixtral-starved"]
    two = ranks(check_moe, 2, archs, True, None, "all_to_all", timeout=300)
    assert two[1]["mixtral-starved"]["expert_grad_norm"] == 0.0
    assert "all-to-all dispatch: each rank routes its slice" in two[0]["mixtral"]["describe"]
    # Per MoE layer 2 all-gathers and 2 all-to-alls, no all-reduce (the 2 left: attention;
    # the small embedding and LM head are kept whole by cost).
    assert "4 x all_gather, 2 x all_reduce, 4 x all_to_all" in two[0]["mixtral"]["describe"]
    four = ranks(check_moe, 4, ["mixtral", "gpt_oss", "mixtral-starved"], True, ROUTER_TOL,
                 "all_to_all", timeout=300)
    assert [r["mixtral-starved"]["expert_grad_norm"] == 0.0 for r in four] == \
        [False, False, True, True]


def test_data_parallel_over_whole_experts_with_all_to_all_matches_one_process(ranks):
    # dp 2 x ep 2 (whole experts per TP rank, all-to-all dispatch), DDP and FSDP2 over dp.
    results = ranks(check_dp_tp, 4, True, "all_to_all", timeout=300)
    assert all(r["fsdp"] == results[0]["fsdp"] for r in results)


def test_dp2_ep2_tp2_matches_one_process(ranks):
    # 8 processes: dp 2 x (ep 2 x tp 2 inside each TP group of 4), DDP and FSDP2 over dp.
    results = ranks(check_dp_tp, 8, 2, "auto", 4, timeout=600)
    assert all(r["ddp"] == results[0]["ddp"] for r in results)


def test_all_to_all_ranks_that_route_differently_raise_before_dispatching(ranks):
    got = ranks(check_route_mismatch, 2, True, "all_to_all", timeout=120)
    for message, seconds in got:
        assert re.search(r"'model.layers.0.mlp.experts' \(ParallelMixtralExperts\): the "
                         r"tensor-parallel ranks routed tokens to different experts.*all-to-all "
                         r"dispatch cannot agree", message)
        assert seconds < 30  # the route-hash all-gather, before any all-to-all
    assert got[0][0] == got[1][0]


def test_auto_dispatch_picks_all_to_all_only_where_it_moves_less():
    hw = get_hardware("h100-nvlink")
    # 8 ranks, top-2, 32k tokens of 4096 bf16 values (a training batch): a quarter fewer
    # bytes outweighs 4 collectives' latency (at 8k tokens it does not yet).
    big = expert_dispatch_times(32768, 4096, 2, 8, 2, hw)
    assert big["all_to_all"] < big["all_reduce"]
    for tokens, k, n in [(1, 2, 8), (8192, 2, 4), (8192, 1, 2), (8192, 4, 8)]:  # decode, tp <= 2k
        times = expert_dispatch_times(tokens, 4096, k, n, 2, hw)
        assert times["all_to_all"] >= times["all_reduce"], (tokens, k, n)
    # At tp <= 2 the plan fixes the all-reduce ('auto' could never pick all-to-all there).
    wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=2, rank=0,
                                              expert_parallel=True)
    assert "HF's 'all_reduce' expert parallelism" in wrapped.describe_plan()
    wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=4, rank=0,
                                              expert_parallel=True)
    assert "dispatch chosen per call by the cost model" in wrapped.describe_plan()


def test_ep2_tp2_checkpoints_reload_at_ep4_tp4_and_one_process(ranks, tmp_path):
    # float32 logits: the reloads sum the same numbers in another order.
    assert max(ranks(check_ep_checkpoints, 4, str(tmp_path), timeout=300)) < 1e-5
    _two_cut_metadata(tmp_path)
    consolidate(tmp_path / "ep2tp2", tmp_path / "consolidated")
    ids = _moe_batch()["input_ids"]
    want = build_moe("mixtral").float()(input_ids=ids).logits
    one = torchtp.DistributedModelWrapper.from_pretrained(tmp_path / "ep2tp2", progress=False)
    for got in (one(input_ids=ids).logits,
                transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(
                    input_ids=ids).logits,
                transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "consolidated")(
                    input_ids=ids).logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Offline: resharded to tp 3 (every expert's 48 features as 16/16/16) and consolidated
    # again, every tensor is the one saved at ep 2 x tp 2, bit for bit.
    reshard(tmp_path / "ep2tp2", tmp_path / "tp3", tp=3)
    consolidate(tmp_path / "tp3", tmp_path / "tp3-consolidated")
    saved, again = (load_file(tmp_path / d / "model.safetensors")
                    for d in ("consolidated", "tp3-consolidated"))
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[k], again[k]) for k in saved)


def _two_cut_metadata(tmp_path) -> None:
    """The ep 2 x tp 2 save says it holds blocks; a block missing from it is named."""
    meta = json.loads((tmp_path / "ep2tp2" / METADATA_FILE).read_text())
    assert meta["format_version"] == 2  # older releases refuse it by version
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert meta["tensors"][name]["shards"][3] == {
        "rank": 3, "segments": [[24, 24], [72, 24]], "second": [0, 2, 2]}
    assert json.loads((tmp_path / "ep4" / METADATA_FILE).read_text())["format_version"] == 1
    # A metadata file that lists one block fewer: reading the tensor names what is missing.
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "ep2tp2", broken)
    del meta["tensors"][name]["shards"][3]
    (broken / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"the rank files hold only part of "
                       r"'model.layers.0.mlp.experts.gate_up_proj' \(9216 of 12288 values\); "
                       r"the checkpoint is incomplete"):
        TorchTPSource(str(broken)).read(name)


def test_layouts_refuse_a_second_cut_without_a_first_on_another_dim():
    with pytest.raises(ValueError, match=r"second cut \(0, 0, 2\) needs a first cut along "
                       r"another dimension \(dim=None\)"):
        ParamLayout((4, 6), None, (), second=(0, 0, 2))
    with pytest.raises(ValueError, match=r"dim=0"):
        ParamLayout((4, 6), 0, ((0, 2),), second=(0, 0, 2))


def test_ep2_tp2_training_state_resumes_at_ep2_tp2_and_ep4(ranks, tmp_path):
    ranks(check_resume, 4, str(tmp_path / "dcp"), 2, [2, True], timeout=300)


def test_ep2_tp2_plans_blocks_of_the_experts():
    # Planning only (rank 3 of 4, no group): experts 2..3, the second half of each's features.
    wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=4, rank=3,
                                              expert_parallel=2)
    plan = wrapped.resolved_plan.layers["model.layers.0.mlp.experts"]
    assert plan.style == "ep_dispatch_experts" and plan.collectives == ("all_reduce",)
    gate_up, down = plan.layouts["gate_up_proj"], plan.layouts["down_proj"]
    assert (gate_up.dim, gate_up.segments, gate_up.second) == (1, ((24, 24), (72, 24)), (0, 2, 2))
    assert (down.dim, down.segments, down.second) == (2, ((24, 24),), (0, 2, 2))
    assert gate_up.local_shape == (2, 48, 32) and down.local_shape == (2, 32, 24)
    assert "expert_parallel=2: experts over 2 ranks, features over tp/2" in \
        wrapped.describe_plan()
    # GPT-OSS's biases (decision 170), rank 1: experts 0..1, their second 12 of 24 features
    # (interleaved gate/up: rows 24..47 of the (E, 2I) bias); the down bias of experts 0..1
    # whole, added by rank 0, the first of the block, not here.
    gpt = torchtp.DistributedModelWrapper(build_moe("gpt_oss"), world_size=4, rank=1,
                                          expert_parallel=2)
    layouts = gpt.resolved_plan.layers["model.layers.0.mlp.experts"].layouts
    assert layouts["gate_up_proj_bias"].record() == (1, [[24, 24]], [0, 0, 2])
    assert layouts["down_proj_bias"].record() == (0, [[0, 2]], None)
    assert gpt.base_model.model.layers[0].mlp.experts.bias_first is False
    assert repr(ExpertsEP(2)) == "ExpertsEP(ep=2, dispatch='auto')"
    # Multiples of 2 only (ep 2 must divide tp), up to the other layers' limits.
    assert 3 not in wrapped.valid_world_sizes and {2, 4} <= set(wrapped.valid_world_sizes)
    assert all(t % 2 == 0 for t in wrapped.valid_world_sizes)
    # Alone (tp 1) a script written for expert_parallel=2 runs whole.
    alone = torchtp.DistributedModelWrapper(build_moe("mixtral"), expert_parallel=2)
    assert not alone.parallelized_layers


def test_expert_parallel_sizes_that_do_not_fit_name_the_valid_values():
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' \(style "
                       r"'ep_dispatch_experts'\): expert_parallel=3 does not divide the "
                       r"tensor-parallel size world_size=4 .* values at this size: \[1, 2, 4\]"):
        torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=4, rank=0,
                                        expert_parallel=3)
    # 3 experts over ep 4 at tp 8: no expert for rank 3's block; ep 1 or 2 would fit.
    with pytest.raises(ValueError, match=r"expert_parallel=4 at world_size=8 places "
                       r"num_experts=3 over 4 ranks .* valid expert_parallel values: \[1, 2\]"):
        torchtp.DistributedModelWrapper(build_moe("mixtral", num_local_experts=3),
                                        world_size=8, rank=0, expert_parallel=4)
    for bad in (0, "2", 2.0):
        with pytest.raises(ValueError, match=rf"expert_parallel={bad!r}: give True"):
            torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=4, rank=0,
                                            expert_parallel=bad)


def test_dispatch_choices_that_cannot_work_are_refused():
    def wrap(**kw):
        return torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=4, rank=0, **kw)

    for ep in (True, 1, False):  # checked first, whatever else is asked
        with pytest.raises(ValueError, match=r"expert_dispatch='ring' is not a dispatch path; "
                           r"valid: \['auto', 'all_reduce', 'all_to_all'\]"):
            wrap(expert_parallel=ep, expert_dispatch="ring")
    with pytest.raises(ValueError, match=r"expert_dispatch='all_to_all' chooses how tokens "
                       r"reach whole experts, but expert_parallel is off.*expert_parallel=True"):
        wrap(expert_dispatch="all_to_all")
    with pytest.raises(ValueError, match=r"expert_dispatch='all_to_all' needs whole experts per "
                       r"rank \(expert_parallel=True\), but expert_parallel=2 at world_size=4"):
        wrap(expert_parallel=2, expert_dispatch="all_to_all")


def test_expert_parallel_1_is_the_feature_split():
    wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"), world_size=2, rank=0,
                                              expert_parallel=1)
    assert wrapped.resolved_plan.layers["model.layers.0.mlp.experts"].style == "moe_tp_experts"


def test_init_parallel_ep_is_the_experts_default_split(ranks):
    from ._moe_checks import check_mesh_ep
    from .test_moe import _sentinel

    for out in ranks(check_mesh_ep, 4, _sentinel(), timeout=180):
        assert "init_parallel: ep=3 must divide tp=4" in out["bad"]
        assert "valid ep values: [1, 2, 4]" in out["bad"]
        assert out["ep_size"] == 2
        if "hf" in out:
            assert out["hf"] == ("ExpertsEP", 2)
        assert out["hand"] == "ep_expert_rows"
        assert out["dense"] == {"0": "colwise", "2": "rowwise"}
        assert out["notes"] == ["init_parallel(ep=2): no experts placed (no transformers "
                                "experts module, and no hand-written experts the automatic plan "
                                "sums once; the other notes say why, if it has some)"]
