"""HuggingFace task heads (sequence classification, extractive QA) at tp 2."""

from __future__ import annotations

from ._hf_checks import TASK_HEADS, check_task_heads


def test_task_heads_match_one_process(ranks):
    # Reward models and classifiers: the decoder or encoder split by its plan, the small
    # head replicated; outputs and every gradient against one process, in float64.
    split = ranks(check_task_heads, 2, list(TASK_HEADS), timeout=300)[0]
    # Llama: 7 projections per layer, 2 layers; BERT's built-in plan: 6 per layer
    assert split == {"llama-seq-cls": 14, "llama-qa": 14, "bert-seq-cls": 12}
