"""HuggingFace models: logits, gradients, SGD steps and greedy generation vs unsharded."""

from __future__ import annotations

import pytest

from ._hf_checks import check_archs

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2", "bert", "opt",
         "llama-tied", "gemma", "gpt_bigcode"]

# Collectives in one forward: 2 per decoder layer (after o_proj, after down_proj),
# + 1 all-reduce for the vocab-parallel embedding and 1 all-gather for lm_head
# when the model's HF plan shards them. Phi-3's HF plan gathers its fused
# projections instead (2 all-gathers per layer).
EXPECTED_COLLECTIVES = {
    "llama": {"all_reduce": 5, "all_gather": 1},
    "mistral": {"all_reduce": 5, "all_gather": 1},
    "qwen2": {"all_reduce": 5, "all_gather": 1},
    "qwen3": {"all_reduce": 5, "all_gather": 1},
    "phi3": {"all_reduce": 5, "all_gather": 5},
    "gpt_neox": {"all_reduce": 5, "all_gather": 1},
    "gpt2": {"all_reduce": 4},
    "bert": {"all_reduce": 4},
    "opt": {"all_reduce": 4},
    "llama-tied": {"all_reduce": 5, "all_gather": 1},
    "gemma": {"all_reduce": 5, "all_gather": 1},
    "gpt_bigcode": {"all_reduce": 4},
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_architectures_match_the_unsharded_model(ranks, world_size):
    # One launch per world size runs every architecture (launches cost seconds).
    results = ranks(check_archs, world_size, ARCHS, 2, timeout=400, gloo_timeout=60)
    for arch in ARCHS:
        got = results[0][arch]
        assert got["collectives"] == EXPECTED_COLLECTIVES[arch], arch
        assert got["layers"] > 0, arch
        if arch != "bert":
            assert got["generated"] == 6, arch
    assert results[0]["gpt2"]["source"] == "torchtp built-in plan for 'gpt2'"
    assert results[0]["llama"]["source"].startswith("HF plan")
