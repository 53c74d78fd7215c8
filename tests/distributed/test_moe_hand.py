"""Hand-written MoEs through the automatic plan: exact, and one all-reduce per MoE layer."""

from __future__ import annotations

import re

import pytest

from ._hand_moe import check_hand_moe, check_hand_moe_ep

EXPERTS = [f"experts.{e}.down" for e in range(4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every kind at tp 2 (one 2-process run per kind, shared by the tests below); each run
    checks outputs, every gradient and two SGD steps against one process."""
    from .harness import run_ranks

    return {kind: run_ranks(check_hand_moe, 2, kind, tmp_path=tmp_path_factory.mktemp(kind),
                            timeout=180)
            for kind in ("inline", "block", "aux", "kept", "attached", "sparse")}


def test_inline_combine_is_reduced_once_at_the_next_linears_input(runs):
    out = runs["inline"][0]
    assert {out["styles"][n] for n in EXPERTS} == {"rowwise_partial"}
    assert out["styles"]["out"] == "reduce_input"
    assert out["styles"]["router"] == "partial_grad_output"
    assert "one all-reduce instead of 4" in out["why"]["out"]
    for fwd, _ in out["counts"]:
        assert fwd.get("all_reduce") == 1, fwd  # one for the whole MoE, not one per expert


def test_moe_module_with_a_shared_expert_is_reduced_once_at_its_output(runs):
    out = runs["block"][0]
    assert {out["styles"][f"moe.{n}"] for n in [*EXPERTS, "shared.down"]} == {"rowwise_partial"}
    assert out["styles"]["moe"] == "reduce_output"
    assert out["styles"]["moe.router"] == "partial_grad_output"
    assert "one all-reduce instead of 5" in out["why"]["moe"]
    for fwd, bwd in out["counts"]:
        assert fwd.get("all_reduce") == 1, fwd
        # Backward: the router's output gradient (one), each expert's input gradient
        # from its row-split up projection (the routed experts that got tokens, up to
        # 4, and the shared one), and 'out''s (split out_features, gathered).
        assert 4 <= bwd.get("all_reduce", 0) <= 7, bwd


def test_router_logits_read_by_an_aux_loss_keep_one_all_reduce_per_expert(runs):
    # Summing the router's gradient over the ranks would also sum the aux loss's
    # full gradient tp times: refused, noted, and still exact (the checks ran).
    out = runs["aux"][0]
    assert {out["styles"][f"moe.{n}"] for n in EXPERTS} == {"rowwise"}
    assert "moe" not in out["styles"]
    assert any("keep one all-reduce each" in n and "auxiliary loss" in n for n in out["notes"])
    for fwd, _ in out["counts"]:
        assert fwd.get("all_reduce", 0) >= 3, fwd


def test_lora_on_experts_left_as_partial_sums_matches_unsharded_lora(ranks):
    from ._hand_moe import check_lora_on_partial

    for partial in ranks(check_lora_on_partial, 2):
        assert partial == sorted([f"moe.{n}" for n in EXPERTS] + ["moe.shared.down"]), partial


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_places_each_expert_whole_on_one_rank(ranks, world_size):
    # 4 experts in a ModuleList: 2 per rank at ep 2, 1 at ep 4; the shared expert
    # (not in a list) stays split by features; one all-reduce per MoE layer.
    outs = ranks(check_hand_moe_ep, world_size, "block", timeout=240)
    per_rank = 4 // world_size
    held = [out["held"] for out in outs]
    assert held == [[f"moe.experts.{r * per_rank + i}" for i in range(per_rank)]
                    for r in range(world_size)]
    styles = outs[0]["styles"]
    assert styles["moe.experts.0.up"] == "ep_expert_rows"
    assert styles["moe.experts.3.down"] == "ep_expert_columns"
    assert styles["moe.shared.down"] == "rowwise_partial"
    for out in outs:
        for fwd in out["counts"]:
            assert fwd.get("all_reduce") == 1, fwd


def test_expert_parallel_on_an_inline_moe(ranks):
    outs = ranks(check_hand_moe_ep, 2, "inline", timeout=180)
    assert [o["held"] for o in outs] == [["experts.0", "experts.1"], ["experts.2", "experts.3"]]


def test_whole_experts_save_sharded_and_consolidate_bit_for_bit(ranks, tmp_path):
    from ._hand_moe import check_hand_moe_ep_checkpoint

    names = ranks(check_hand_moe_ep_checkpoint, 2, str(tmp_path), timeout=180)[0]
    assert "moe.experts.3.down.weight" in names


def test_experts_over_two_blocks_of_two_ranks(ranks):
    # expert_parallel=2 at 4 ranks: experts 0-1 on ranks 0-1, 2-3 on ranks 2-3, each
    # split by features inside its block (ep 2 x tp 2).
    outs = ranks(check_hand_moe_ep, 4, "block", 2, timeout=240)
    assert [o["held"] for o in outs] == [["moe.experts.0", "moe.experts.1"]] * 2 + \
        [["moe.experts.2", "moe.experts.3"]] * 2
    assert outs[0]["styles"]["moe.experts.0.up"] == "ep_expert_rows"
    assert outs[0]["styles"]["moe.experts.0.down"] == "ep_expert_columns"
    for out in outs:
        for fwd in out["counts"]:
            assert fwd.get("all_reduce") == 1, fwd


def test_expert_parallel_that_does_not_divide_the_group_is_refused():
    import torchtp

    from ._hand_moe import HandMoEBlock

    with pytest.raises(ValueError, match=r"expert_parallel=3, expert_dispatch='auto': a "
                       r"hand-written MoE \(HandMoEBlock\) shares its experts out over blocks "
                       r"of the TP group \(world_size=4\).*expert_parallel=True or one of "
                       r"\[1, 2, 4\]"):
        torchtp.DistributedModelWrapper(HandMoEBlock(), world_size=4, rank=0,
                                        expert_parallel=3)


@pytest.mark.parametrize("ep", [False, True])
def test_a_router_that_differs_on_one_rank_raises_on_every_rank(ranks, ep):
    # Every all-reduce keeps its shape, so nothing else would fail: a hash of each
    # token's ranking of the experts rides the MoE's one all-reduce.
    from ._hand_moe import check_hand_route_mismatch

    for msg, seconds in ranks(check_hand_route_mismatch, 2, ep):
        assert "'moe.router' (style 'partial_grad_output'): the tensor-parallel ranks ranked " \
               "the experts differently (world_size=2)" in msg
        assert seconds < 30, seconds


@pytest.mark.parametrize("ep", [False, True])
def test_compiled_hand_written_moe_matches_one_process(ranks, ep):
    from ._hand_moe import check_hand_moe_compiled

    assert ranks(check_hand_moe_compiled, 2, ep, timeout=300) == [2, 2]


@pytest.mark.parametrize("kind", ["kept", "attached"])
def test_an_aux_loss_the_graph_does_not_show_keeps_one_all_reduce_per_expert(runs, kind):
    # fairseq keeps the balancing loss on the module (self.l_aux), DeepSeek attaches it to
    # the output with a custom function: summing the router's gradient would count the
    # aux loss's full gradient once per rank. The training-mode gradient probe sees both.
    out = runs[kind][0]
    assert "moe" not in out["styles"] and out["styles"]["moe.experts.0.down"] == "rowwise"
    assert any("also reaches the loss other than through the weighted sum" in n
               for n in out["notes"])


def test_experts_the_probe_never_reached_keep_one_all_reduce_each(runs):
    # 16 experts, top-1, 8 probe tokens: uncalled experts stay replicated, and summing the
    # others once would count a replicated expert's full output once per rank.
    out = runs["sparse"][0]
    assert "moe" not in out["styles"]
    assert any("the probe forward did not call" in n for n in out["notes"])


def test_a_router_called_on_one_rank_only_changes_nothing(ranks):
    from ._hand_moe import check_router_called_on_one_rank

    assert ranks(check_router_called_on_one_rank, 2) == [True, True]


def test_lora_beside_a_reduction_hook_is_refused_on_every_rank(ranks):
    from ._hand_moe import check_lora_on_router_refused

    messages = ranks(check_lora_on_router_refused, 2)
    assert messages[0] == messages[1] and len(messages[0]) == 4
    router, wrapped_router, out, wrapped_out = messages[0]
    # Named as PEFT names them (under base_model.model. in the PeftModel)
    for msg in (router, wrapped_router):
        assert re.match(r"LoRA adapters on a 'partial_grad_output' layer '(base_model\.model\.)?"
                        r"moe\.router' \(Linear\), a hand-written MoE's router or a Mamba "
                        r"mixer's x_proj, .* leave it out of target_modules", msg), msg
    for msg in (out, wrapped_out):
        assert re.match(r"LoRA adapters on a 'reduce_input' layer '(base_model\.model\.)?out' "
                        r"\(Linear\), whose input is a partial sum .* the branch would read "
                        r"this rank's part", msg), msg


def test_a_layout_holding_nothing_reads_an_empty_tensor(tmp_path):
    # An expert that lives on another rank: from_pretrained reads a (0, in) tensor for it.
    import torch
    from safetensors.torch import save_file

    from torchtp.checkpoint.sources import HFSource, read_layout
    from torchtp.core.layouts import ParamLayout

    save_file({"w": torch.arange(12.0).reshape(4, 3)}, str(tmp_path / "model.safetensors"))
    got = read_layout(HFSource(str(tmp_path)), "w", ParamLayout((4, 3), 0, ()))
    assert got.shape == (0, 3) and got.dtype == torch.float32
