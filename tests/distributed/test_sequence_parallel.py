"""Sequence parallelism (with loss parallelism and checkpointing) vs the unsharded model."""

from __future__ import annotations

import re

import pytest
import torch

from torchtp.comm.sequence_parallel import pad_sequence, shard_length

from ._moe_checks import check_moe
from ._sp_checks import (
    check_linear_on_gathered,
    check_sequence_parallel_suite,
    check_whole_blocks,
    dp2_tp2_ddp,
    exit_settles,
)
from .test_moe import _sentinel


def test_padding_rule():
    assert [shard_length(t, 4) for t in (1, 4, 9, 12)] == [1, 1, 3, 3]
    x = torch.ones(2, 9, 3)
    padded = pad_sequence(x, 1, 4)  # (2, 12, 3): zero rows at the end
    assert padded.shape == (2, 12, 3)
    assert torch.equal(padded[:, :9], x) and not padded[:, 9:].any()
    assert pad_sequence(x, 1, 3) is x


def test_sequence_parallel_tp2_and_errors(ranks):
    # 9 tokens do not divide by 2: the last shard carries one padding row.
    cases = [("llama", 9, False, False), ("qwen3", 9, False, False),
             ("gpt2", 9, True, False), ("mistral", 9, True, True)]
    results = ranks(check_sequence_parallel_suite, 2, cases, True, timeout=300, gloo_timeout=60)
    got = results[0]
    # Per layer: an all-gather into attention and MLP, a reduce-scatter out of each;
    # + the final norm's all-gather (the small LM head, vocabulary 128, is kept whole
    # by cost: no all-gather of its logits). The input check rides the first all-gather.
    assert got["llama seq=9 lp=False ckpt=False"]["forward"] == {
        "all_gather": 5, "reduce_scatter": 4}
    # GPT-2: its vocabulary-split embedding's all-reduce; loss parallel: two more.
    assert got["gpt2 seq=9 lp=True ckpt=False"]["forward"] == {
        "all_reduce": 3, "all_gather": 5, "reduce_scatter": 4}
    assert got["mistral seq=9 lp=True ckpt=True"]["grads_checked"] == 21
    # Backward, per layer: a reduce-scatter out of each gather, an all-gather for each
    # reduce-scatter and one re-gather per block for the weight gradients (2 layers),
    # + the first scatter's all-gather; the 5 norms' weight gradients are summed
    # (all-reduce each); the LM head, kept whole, needs none for its input gradient.
    assert got["llama seq=9 lp=False ckpt=False"]["backward"] == {
        "all_reduce": 5, "all_gather": 9, "reduce_scatter": 4}
    # Saved for backward: none of the gathered (B, T, d) sequences (2 per layer
    # without the re-gather); the blocks keep their (B, S, d) shards.
    for case in ("llama seq=9 lp=False ckpt=False", "gpt2 seq=9 lp=True ckpt=False"):
        assert got[case]["saved full sequences"] == 0, case
    assert got["generated"] == 5
    for res in results:  # the same error on every rank
        errors = res["errors"]
        assert "OPTForCausalLM (model_type='opt') is not supported" in errors["arch"]
        assert errors["outside norms"].startswith(
            "ValueError: plan style 'sequence_parallel' for module 'model.layers.0.mlp': in "
            "LlamaForCausalLM only the decoder's norms run on sequence shards")
        assert "'model.layers.0.mlp.up_proj' is replicated, but every projection" in \
            errors["replicated projection"]
        assert errors["style turns it on"] is True
        assert "output_hidden_states=True is not supported" in errors["hidden states"]
        assert re.search(r"decoder layer 1 of LlamaForCausalLM does not match torchtp's "
                         r"sequence-parallel layout for model_type='llama': it holds \['adapter', "
                         r"'input_layernorm', 'mlp', 'post_attention_layernorm', 'self_attn'\]",
                         errors["extra module"]), errors["extra module"]
        assert re.search(r"LlamaRMSNorm returned 2 positions where this rank's sequence shard has "
                         r"1 \(2 tokens over tp=2\)", errors["bypassed reduce-scatter"])


def test_sequence_parallel_on_more_decoder_layouts(ranks):
    # Norms before and after each block (Gemma 2), after only (OLMo 2), one norm feeding
    # attention and MLP side by side (Cohere, with checkpointing), fused q/k/v and
    # gate/up projections (Phi-3), hybrids whose linear-attention layers read their
    # length from the layer's position ids: Qwen3-Next (its gated delta-net on shards'
    # gather, MoE run whole, checkpointing) and Qwen3.5 (its plan gathers every
    # projection of the delta-net, which therefore runs whole), OLMo-hybrid (other norms
    # in each kind of layer), GPT-NeoX (attention and MLP on the same residual, each
    # with its norm; its late-reduce candidate discarded): loss, logits, every gradient
    # and SGD steps; Gemma 2's greedy generation (sliding-window cache, soft-capped
    # logits).
    cases = [("gemma2", 9, False, False), ("olmo2", 9, True, False), ("cohere", 9, False, True),
             ("phi3", 9, False, False), ("qwen3_next", 9, False, True),
             ("qwen3_5_text", 9, True, False), ("olmo_hybrid", 9, False, False),
             ("gpt_neox", 9, True, False)]
    got = ranks(check_sequence_parallel_suite, 2, cases, False, "gemma2", timeout=300,
                gloo_timeout=60)[0]
    assert all(got[f"{a} seq={n} lp={lp} ckpt={c}"]["grads_checked"] > 0
               for a, n, lp, c in cases)
    assert got["gemma2 seq=9 lp=False ckpt=False"]["run whole"] == []
    assert [re.sub(r": the sequence.*", "", line) for line in
            got["qwen3_next seq=9 lp=False ckpt=True"]["run whole"]] == [
        "note: sequence parallelism: MoE experts blocks run whole (2, e.g. 'model.layers.0.mlp')"]
    assert [re.sub(r": the sequence.*", "", line) for line in
            got["qwen3_5_text seq=9 lp=True ckpt=False"]["run whole"]] == [
        "note: sequence parallelism: linear attention blocks run whole (1, e.g. "
        "'model.layers.0.linear_attn')"]
    assert got["generated"] == 5


def test_moe_and_latent_attention_blocks_run_whole(ranks):
    # Mixtral (routed experts), Qwen2-MoE (a gated shared expert beside them) and
    # DeepSeek-V3 (latent attention, shared experts, group-limited routing) in float64,
    # 11 tokens (a padded shard): routes, logits, loss with the router's auxiliary loss,
    # every gradient and two AdamW steps equal one process's; experts whole per rank too.
    got = ranks(check_moe, 2, ["mixtral", "qwen2_moe", "deepseek_v3"], False, None, "auto", True,
                timeout=300, gloo_timeout=60)[0]
    assert got["deepseek_v3"]["router_grads"] == ["model.layers.0.mlp.gate.weight",
                                                  "model.layers.1.mlp.gate.weight"]
    describe = got["deepseek_v3"]["describe"]
    assert "MoE experts blocks run whole (2, e.g. 'model.layers.0.mlp')" in describe
    assert "latent attention blocks run whole (2, e.g. 'model.layers.0.self_attn')" in describe
    if _sentinel():  # whole experts per rank (transformers 5.24+; test_moe pins the refusal)
        whole = ranks(check_moe, 2, ["qwen3_moe"], True, None, "all_to_all", True, timeout=300,
                      gloo_timeout=60)[0]
        assert whole["qwen3_moe"]["local"][0] == 2  # 2 of the 4 experts on each rank
    for res in ranks(check_whole_blocks, 2, timeout=300, gloo_timeout=60):
        assert res["noise changed the loss"] and res["recomputed equal"]
        assert res["router gradient equal on every rank"] and res["generated equal"]
        assert re.search(r"MixtralSparseMoeBlock \(run on the whole sequence of 11 tokens\) "
                         r"returned shape \(22, 32\), not \(batch, 11, \.\.\.\)",
                         res["flattened output"]), res["flattened output"]
        assert re.search(r"'model\.layers\.0\.mlp\.shared_expert\.down_proj' is "
                         r"'rowwise_partial' .* but 'model\.layers\.0\.mlp' runs on the whole "
                         r"sequence and must return complete sums", res["partial sum"]), \
            res["partial sum"]


def test_sequence_parallel_tp4(ranks):
    # tp 4, 9 tokens: shards of 3, the last rank holds padding only.
    got = ranks(check_sequence_parallel_suite, 4, [("llama", 9, True, False)],
                timeout=300, gloo_timeout=60)[0]
    assert got["llama seq=9 lp=True ckpt=False"]["grads_checked"] == 21
    assert got["generated"] == 5


@pytest.mark.slow
def test_sequence_parallel_tp4_more(ranks):
    cases = [("qwen2", 5, False, True), ("gpt2", 7, True, True), ("qwen3", 12, True, False)]
    got = ranks(check_sequence_parallel_suite, 4, cases, timeout=600, gloo_timeout=120)[0]
    assert got["qwen2 seq=5 lp=False ckpt=True"]["grads_checked"] > 0


@pytest.mark.slow
def test_dp2_tp2_ddp_with_sequence_and_loss_parallelism(ranks):
    norms = ranks(dp2_tp2_ddp, 4, timeout=300, gloo_timeout=60)
    assert all(n == norms[0] for n in norms)


def test_projections_save_the_shard_and_regather_once(ranks):
    # Three siblings (one with a frozen weight) on one gathered input: the forward's
    # gather, one re-gather in the backward for both trainable weights, and the input
    # gradient reduce-scattered once; CPU bf16 autocast; the edge cases below.
    got = ranks(check_linear_on_gathered, 2, timeout=120)
    assert got[0]["collectives"] == {"all_gather": 2, "reduce_scatter": 1}
    assert got[0]["autocast saved shards"] == ["torch.bfloat16"]
    assert got[0]["autocast re-gather"] == ["torch.bfloat16"]
    for res in got:
        assert res["changed shard"] is True  # falls back to F.linear
        assert res["held after a partial backward"] is False
        assert res["frozen weight saves the input"] is False


def test_exit_does_not_wait_for_collectives_the_backend_copied(ranks):
    # Gloo's reduce-scatter works on views of its input, never holding the tensor itself:
    # the exit waited its whole bound for a release that could not come (5 s, a warning).
    for released, seconds in ranks(exit_settles, 2, timeout=120):
        assert released and seconds < 1.0, (released, seconds)
