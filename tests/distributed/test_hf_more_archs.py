"""A wider set of HF architectures at tp=4 (KV-head replication, fused and Conv1D layouts,
encoder-decoders, models without any plan, planned automatically by dataflow): logits,
grads, an SGD step, generation."""

from __future__ import annotations

from ._hf_checks import check_archs
from ._hf_models import build

# Which plan source each architecture ends up with (chosen by cost) when transformers
# ships no plan for it (as 5.23 does for all but the 'HF plan' ones); see expected_source.
SOURCES = {
    "gemma2": "HF plan", "starcoder2": "HF plan", "olmo": "HF plan", "olmo2": "HF plan",
    "granite": "HF plan", "cohere": "HF plan", "phi": "HF plan", "mistral-mqa": "HF plan",
    # Falcon: the automatic plan splits its fused query_key_value by whole heads (stacked
    # q|k|v) or whole KV groups (the new architecture); the built-in plan gathers it.
    "llama-bias": "HF plan", "falcon": "auto", "falcon-new": "auto",
    "gptj": "torchtp built-in", "roberta": "torchtp built-in", "electra": "torchtp built-in",
    "stablelm": "auto", "codegen": "auto", "bloom": "auto", "mpt": "auto", "distilbert": "auto",
    "t5": "auto", "bart": "auto",
}


def test_more_architectures_at_tp4(ranks):
    results = ranks(check_archs, 4, list(SOURCES), 1, timeout=600, gloo_timeout=120)
    for arch, source in SOURCES.items():
        got = results[0][arch]
        assert got["source"].startswith(expected_source(arch, source)), (arch, got["source"])
        assert got["collectives"] == got["planned"], arch
        assert got["layers"] > 0, arch


def expected_source(arch: str, without_hf_plan: str) -> str:
    """The model's own HF plan comes first once transformers ships one (CodeGen from 5.24)."""
    config = build(arch).config
    return "HF plan" if getattr(config, "base_model_tp_plan", None) else without_hf_plan
