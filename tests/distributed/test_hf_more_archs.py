"""A wider set of HF architectures at tp=4 (KV-head replication, fused and Conv1D layouts,
encoder-decoders, models without any plan, planned automatically by dataflow): logits,
grads, an SGD step, generation."""

from __future__ import annotations

import transformers

from torchtp.hf.builtin import HEAD_NORM_TYPES

from ._hf_checks import check_archs
from ._hf_models import build

# Which plan source each architecture ends up with (chosen by cost) when transformers
# ships no plan for it (as 5.23 does for all but the 'HF plan' ones); see expected_source.
SOURCES = {
    "gemma2": "HF plan", "starcoder2": "HF plan", "olmo": "HF plan", "olmo2": "torchtp built-in",
    "granite": "HF plan", "mistral-mqa": "HF plan", "llama-bias": "HF plan",
    "falcon": "auto", "falcon-new": "auto", "gptj": "auto", "cohere": "auto", "phi": "auto",
    "roberta": "torchtp built-in", "electra": "torchtp built-in",
    "stablelm": "auto", "codegen": "auto", "bloom": "auto", "mpt": "auto", "distilbert": "auto",
    "t5": "torchtp built-in", "bart": "auto", "pegasus": "auto", "llama4": "HF plan",
}
if hasattr(transformers, "GraniteSWAConfig"):  # new in 5.24 (make compat runs 5.3 too)
    SOURCES["granite_swa"] = "HF plan"
# Parallel-residual layers (x + attention(x) + mlp(x)): the automatic plan sums both
# branches' partial outputs once per layer (reduce_residual), which no HF or built-in
# plan does, so it wins whatever plan transformers ships. Falcon's fused
# query_key_value is split by whole heads (stacked q|k|v) or whole KV groups.
PARALLEL_RESIDUAL = {"falcon", "falcon-new", "gptj", "cohere", "phi"}


def test_more_architectures_at_tp4(ranks):
    results = ranks(check_archs, 4, list(SOURCES), 1, timeout=600, gloo_timeout=120)
    for arch, source in SOURCES.items():
        got = results[0][arch]
        assert got["source"].startswith(expected_source(arch, source)), (arch, got["source"])
        assert got["collectives"] == got["planned"], arch
        assert got["layers"] > 0, arch
        if arch in PARALLEL_RESIDUAL:  # one all-reduce per layer (2 layers), heads kept whole
            assert got["collectives"] == {"all_reduce": 2}, (arch, got["collectives"])


def expected_source(arch: str, without_hf_plan: str) -> str:
    """The model's own HF plan comes first once transformers ships one (CodeGen from 5.24),
    unless the automatic plan reduces a parallel-residual layer once or torchtp's built-in
    plan keeps the heads of q/k norms over all heads local (OLMo-2)."""
    config = build(arch).config
    if arch in PARALLEL_RESIDUAL or config.model_type in HEAD_NORM_TYPES:
        return without_hf_plan
    return "HF plan" if getattr(config, "base_model_tp_plan", None) else without_hf_plan
