"""Context parallelism (docs/context_parallel.md): exact against one process, or refused.

Ranks run real Gloo processes (tests/distributed/harness.py); the rank
functions and the references they are compared with are in _cp_checks.py.
"""

from __future__ import annotations

import pytest

from . import _cp_checks as checks


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_attention_is_exact_at_every_cp_size(ranks, cp):
    got = ranks(checks.attention_matches, cp, timeout=300)
    counts = {(case, algo): c for case, algo, c in got[0]}
    for (case, algo), c in counts.items():
        if algo == "allgather":  # KV stacked: one all-gather forward, and in the backward
            # one more (the attention is recomputed, not saved) and one reduce-scatter
            assert c == {"all_gather": 2, "reduce_scatter": 1}, (case, c)
        elif algo == "ring":  # cp - 1 shifts of the KV block forward; backward cp - 1 of the
            # block with its gradient and one of the gradient home
            assert c == {"all_to_all": 2 * cp - 1}, (case, c)
        else:  # q, stacked KV and the output, and the LSE asked for, each way
            assert c == {"all_to_all": 8}, (case, c)


HF_CASES = [("llama", "plain", "allgather"), ("llama", "padded", "ulysses"),
            ("llama", "packed", "allgather"), ("llama", "left", "allgather"),
            ("llama", "holes", "ulysses"), ("llama", "packed-masked", "allgather"),
            ("llama-gc", "padded+items", "allgather"), ("mistral", "packed", "auto"),
            ("qwen3", "padded", "auto"), ("gpt2", "plain", "ulysses"),
            ("gpt_oss", "plain", "auto"), ("qwen3_moe", "packed", "ulysses"),
            ("mistral", "padded", "ring"), ("gpt_oss", "plain", "ring")]


def test_hf_models_match_one_process_at_cp2(ranks):
    got = ranks(checks.hf_matches, 2, HF_CASES, timeout=600)
    assert set(got[0]) == {"/".join(c) for c in HF_CASES}


REFUSALS = {
    "different batches": ("RankMismatchError", r"ContextParallel forward \(every cp rank must "
                          r"get the same full batch\).*input_ids"),
    "inputs_embeds": ("ValueError", r"\['inputs_embeds'\] are not supported under context "
                      r"parallelism"),
    "return_dict": ("ValueError", r"return_dict=False: the loss over the whole batch is set on "
                    r"the model's output object"),
    "logits_to_keep": ("ValueError", r"\['logits_to_keep'\] are not supported under context "
                       r"parallelism"),
    "shift_labels": ("ValueError", r"\['shift_labels'\] are not supported"),
    "router logits per call": ("ValueError", r"output_router_logits=True: the router's auxiliary "
                               r"loss would be computed over this rank's tokens only"),
    "router logits set after": ("ValueError", r"output_router_logits=True: the router's "
                                r"auxiliary loss would be computed over this rank's tokens"),
    "packed gpt_oss": ("ValueError", r"position ids that restart \(packed documents\) with "
                       r"model_type='gpt_oss', whose transformers mask ignores packing"),
    "generate": ("NotImplementedError", r"decoding under context parallelism is not supported"),
    "model called directly": ("ValueError", r"LlamaAttention \(layer 0\): the model's attention "
                              r"is torchtp's context-parallel attention, but it was called "
                              r"outside ContextParallel's forward"),
    "ulysses heads": ("ValueError", r"Ulysses splits the 8 query heads \(per TP rank\) over "
                      r"cp=3 ranks, which does not divide; valid cp sizes for Ulysses: "
                      r"\[1, 2, 4, 8\]; or use algorithm='allgather'"),
    "unknown algorithm": ("ValueError", r"unknown context-parallel algorithm 'zigzag'"),
    "unsupported family": ("ValueError", r"model_type='gemma' may use a mask rule torchtp does "
                           r"not reproduce"),
    "dropout": ("ValueError", r"GPT2Attention \(layer 0\): attention dropout 0.1 is not "
                r"reproduced"),
}


def test_lora_added_after_the_wrap_is_summed_over_cp(ranks):
    # Its adapters' gradients covered each rank's tokens only (equal loss), silently.
    assert ranks(checks.lora_after_wrap, 2, timeout=300) == [2 * 2 * 2] * 2  # layers x q,v x A,B


@pytest.mark.parametrize("cp", [3])
def test_bad_input_raises_the_same_error_on_every_rank(ranks, cp):
    import re

    got = ranks(checks.refusals, cp, timeout=300)
    for name, (kind, pattern) in REFUSALS.items():
        for rank, seen in enumerate(got):
            assert seen[name][0] == kind and re.search(pattern, seen[name][1]), (name, rank, seen[name])
            assert seen[name][2] < 10.0, (name, rank, seen[name])  # raised, not timed out
    assert len({g["after"] for g in got}) == 1  # the group still works, the same loss everywhere


def test_cp_composes_with_tp_sp_ddp_and_fsdp2(ranks):
    got = ranks(checks.cp_with_tp, 4, timeout=600)
    # cp groups stride over tp: ranks {0, 2} and {1, 3}
    assert [g["ranks"] for g in got] == [(0, 0, [0, 2]), (0, 1, [1, 3]), (1, 0, [0, 2]),
                                         (1, 1, [1, 3])]
    # Dropout on a rank's tokens draws its own masks (every rank seeded alike): tp peers
    # (ranks 0-1, 2-3) holding the same tokens draw the same ones, cp peers other ones;
    # sequence shards (sp) differ on every rank. A recomputation draws the forward's masks:
    # float64 gradients equal to rounding (1e-9; another mask moves them by O(0.1)).
    peers = [[i // 2 == j // 2 for j in range(4)] for i in range(4)]
    alone = [[i == j for j in range(4)] for i in range(4)]
    for g in got:
        assert g["masks"] == {"cp: embedding": peers, "cp: blocks": peers,
                              "cp x tp: embedding": peers, "cp x tp: blocks": peers,
                              "cp x tp, sp: embedding": peers, "cp x tp, sp: blocks": alone,
                              "cp, trained after: embedding": peers,
                              "cp, trained after: blocks": peers}
        assert all(err < checks.HF_TOL for err in g["replayed"].values()), g["replayed"]
    got = ranks(checks.dp_with_cp, 4, timeout=600)
    assert all(set(g) == {"ddp", "fsdp2"} for g in got)


def test_collectives_round_trip_compile_and_checkpoint(ranks, tmp_path):
    got = ranks(checks.counts_roundtrip_compile, 2, str(tmp_path / "saved"), timeout=600)
    for g in got:  # transformers' own attention again, every weight as saved
        assert g["checkpoint"][0] != "torchtp_cp" and g["checkpoint"][1], g["checkpoint"]
    params = 21  # a 2-layer tiny Llama: every parameter's gradient summed over cp once
    # allgather: per layer one all-gather of stacked K/V forward; backward one more to
    # recompute the attention, and one reduce-scatter; the loss's one all-reduce forward.
    fwd, bwd, _ = got[0]["allgather"]
    assert fwd == {"all_gather": 2, "all_reduce": 1}, fwd
    assert bwd == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": params}, bwd
    # ulysses: per layer q, stacked K/V and the output, each way.
    fwd, bwd, _ = got[0]["ulysses"]
    assert fwd == {"all_to_all": 6, "all_reduce": 1}, fwd
    assert bwd == {"all_to_all": 6, "all_reduce": params}, bwd
    # ring at cp 2: per layer one shift of the stacked K/V block forward; backward one
    # of the block with its gradient and one of the gradient home.
    fwd, bwd, _ = got[0]["ring"]
    assert fwd == {"all_to_all": 2, "all_reduce": 1}, fwd
    assert bwd == {"all_to_all": 4, "all_reduce": params}, bwd
    assert all(g["roundtrip"] for g in got)
    # Payload per rank, the formulas of docs/context_parallel.md (float64, B=2, 16 tokens
    # after padding 13 to 2*cp's multiple so T/cp = 8, head dim 8, 8 query / 2 KV heads,
    # 2 layers) plus the loss's one float64.
    b, t_local, d, hq, hkv, layers, elt = 2, 8, 8, 8, 2, 2, 8
    kv = 2 * b * hkv * t_local * d * elt
    q = out = b * hq * t_local * d * elt
    assert got[0]["allgather"][2] == layers * kv + elt
    assert got[0]["ulysses"][2] == layers * (q + kv + out) + elt
    assert got[0]["ring"][2] == layers * kv + elt  # cp - 1 = 1 block per layer at cp 2


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_head_tail_split_balances_causal_work(cp):
    from torchtp.cp import SequenceLayout, causal_pairs

    for length in (2 * cp, 64 * cp, 2 * cp * 37):
        work = causal_pairs(SequenceLayout(length, cp))
        assert max(work) / min(work) <= 1.05, (length, work)
        # every token held by exactly one rank
        held = sorted(i for r in range(cp) for i in SequenceLayout(length, cp).indices(r).tolist())
        assert held == list(range(length))
    plain = causal_pairs(SequenceLayout(64 * cp, cp, balanced=False))
    assert max(plain) / min(plain) > 2  # what the head/tail split is for


def test_lengths_that_do_not_split_name_the_valid_ones():
    from torchtp.cp.layout import check_length

    with pytest.raises(ValueError, match=r"a sequence of 13 tokens does not split over cp=2 "
                       r"ranks: the head/tail \(balanced\) split needs a multiple of 4; nearest "
                       r"valid lengths: \[12, 16\]"):
        check_length(13, 2, True, "ContextParallel")
    check_length(12, 3, False, "ContextParallel")


def test_pipeline_with_cp_matches_one_process(ranks):
    got = ranks(checks.pipeline_with_cp, 4, timeout=300)
    assert [g["last"] for g in got] == [False, False, True, True]  # pp is outermost
    for g in got:  # each stage holds one layer: per microbatch one all-gather of its K/V
        # forward, one again in the backward (recomputed) and one reduce-scatter
        assert g["attention"] == "torchtp_cp" and g["ignored"]
        assert g["lora"] < checks.HF_TOL, g  # LoRA injected after the schedule, summed over cp
        assert g["counts"]["all_gather"] == 4 and g["counts"]["reduce_scatter"] == 2, g
    for g in got:
        kind, message, seconds = g["refused"]
        assert kind == "ValueError" and "a pipeline stage inside ContextParallel cannot run" \
            in message, message
        assert seconds < 10.0


def test_router_jitter_is_a_random_site_like_dropout():
    # Mixtral's router noise draws in training: context parallelism gives each cp rank its own
    # stream for it (its tokens differ), and compiled training refuses it, as for dropout.
    from torchtp.layers.rng import dropout_site

    from ._moe_checks import build_moe

    assert dropout_site(build_moe("mixtral")) is None  # router_jitter_noise=0 by default
    site = dropout_site(build_moe("mixtral", router_jitter_noise=0.5))
    assert site == "model.layers.0.mlp.jitter_noise=0.5", site
