"""HuggingFace models: logits, gradients, SGD steps and greedy generation vs unsharded."""

from __future__ import annotations

import pytest

from ._hf_checks import check_archs

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2", "bert", "opt",
         "llama-tied", "gemma", "gpt_bigcode"]

# Collectives in one forward with the leanest plan as written (plan="auto-memory": every
# split kept): 2 per decoder layer (after o_proj, after down_proj), + 1 all-reduce for the
# vocab-parallel embedding and 1 all-gather for lm_head when the model's HF plan shards
# them. Phi-3: HF's plan (gathering its fused projections, 2 all-gathers per layer) and
# torchtp's built-in part-wise split hold the same bytes; the faster built-in one wins.
EXPECTED_COLLECTIVES = {
    "llama": {"all_reduce": 5, "all_gather": 1},
    "mistral": {"all_reduce": 5, "all_gather": 1},
    "qwen2": {"all_reduce": 5, "all_gather": 1},
    "qwen3": {"all_reduce": 5, "all_gather": 1},
    "phi3": {"all_reduce": 5, "all_gather": 1},
    # The automatic plan wins (as lean): embedding and head split, the parallel residual
    # reduced once per layer (reduce_residual).
    "gpt_neox": {"all_reduce": 3, "all_gather": 1},
    "gpt2": {"all_reduce": 4},
    # The automatic plan also splits the MLM head's lone transform Linear: leaner than the
    # built-in plan, one all-gather more.
    "bert": {"all_reduce": 4, "all_gather": 1},
    "opt": {"all_reduce": 4},
    "llama-tied": {"all_reduce": 5, "all_gather": 1},
    "gemma": {"all_reduce": 5, "all_gather": 1},
    "gpt_bigcode": {"all_reduce": 4},
}
# With no plan, chosen by cost (torchtp.plans.choose): the vocabulary-128 embeddings
# and LM heads are kept whole (splitting one alone saves 16 KiB per rank for
# milliseconds of collectives), and Phi-3 gets torchtp's built-in part-wise split of
# qkv_proj / gate_up_proj instead of HF's gathers: 2 all-reduces per layer, nothing else.
# GPT-NeoX's parallel residual (x + attention(x) + mlp(x)) sums both branches' partial
# outputs once: 1 all-reduce per layer (torchtp.plans.late_reduce, reduce_residual).
CHOSEN = {arch: {"all_reduce": 2 if arch == "gpt_neox" else 4} for arch in EXPECTED_COLLECTIVES}


@pytest.mark.parametrize("world_size, plan", [(2, None), (4, "auto-memory")])
def test_architectures_match_the_unsharded_model(ranks, world_size, plan):
    # One launch per world size runs every architecture (launches cost seconds).
    results = ranks(check_archs, world_size, ARCHS, 2, False, plan, timeout=400,
                    gloo_timeout=60)
    expected = CHOSEN if plan is None else EXPECTED_COLLECTIVES
    for arch in ARCHS:
        got = results[0][arch]
        assert got["collectives"] == expected[arch], arch
        assert got["layers"] > 0, arch
        if arch != "bert":
            assert got["generated"] == 6, arch
    assert results[0]["gpt2"]["source"] == "torchtp built-in plan for 'gpt2'"
    assert results[0]["llama"]["source"].startswith("HF plan")
    assert results[0]["phi3"]["source"] == "torchtp built-in plan for 'phi3'"
