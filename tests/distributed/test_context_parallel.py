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
        if algo == "allgather":  # KV stacked: one all-gather forward, one reduce-scatter back
            assert c == {"all_gather": 1, "reduce_scatter": 1}, (case, c)
        else:  # q, stacked KV and the output, and the LSE asked for, each way
            assert c == {"all_to_all": 8}, (case, c)


HF_CASES = [("llama", "plain", "allgather"), ("llama", "padded", "ulysses"),
            ("llama", "packed", "allgather"), ("mistral", "plain", "auto"),
            ("qwen3", "padded", "auto"), ("gpt2", "plain", "ulysses"),
            ("gpt_oss", "plain", "auto"), ("qwen3_moe", "packed", "ulysses")]


def test_hf_models_match_one_process_at_cp2(ranks):
    got = ranks(checks.hf_matches, 2, HF_CASES, timeout=600)
    assert set(got[0]) == {"/".join(c) for c in HF_CASES}
