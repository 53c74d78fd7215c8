"""Hand-written MoEs through the automatic plan: exact, and one all-reduce per MoE layer."""

from __future__ import annotations

import pytest

from ._hand_moe import check_hand_moe

EXPERTS = [f"experts.{e}.down" for e in range(4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every kind at tp 2 (one 2-process run per kind, shared by the tests below)."""
    from .harness import run_ranks

    return {kind: run_ranks(check_hand_moe, 2, kind, tmp_path=tmp_path_factory.mktemp(kind),
                            timeout=180)
            for kind in ("inline", "block", "aux")}


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


def test_lora_on_an_expert_left_as_a_partial_sum_is_refused_on_every_rank(ranks):
    from ._hand_moe import check_lora_on_partial_refused

    for msg in ranks(check_lora_on_partial_refused, 2):
        assert "LoRA adapters on a 'rowwise_partial' layer" in msg
        assert "plan={...: 'rowwise'}" in msg
