"""A wider set of HF architectures at tp=4 (KV-head replication, fused and Conv1D layouts,
encoder-decoders, models without any plan, planned automatically by dataflow): logits,
grads, an SGD step, generation."""

from __future__ import annotations

from ._hf_checks import check_archs

# Which plan source each architecture ends up with in transformers 5.23.
SOURCES = {
    "gemma2": "HF plan", "starcoder2": "HF plan", "olmo": "HF plan", "olmo2": "HF plan",
    "granite": "HF plan", "cohere": "HF plan", "phi": "HF plan", "mistral-mqa": "HF plan",
    "llama-bias": "HF plan", "falcon": "torchtp built-in", "falcon-new": "torchtp built-in",
    "gptj": "torchtp built-in", "roberta": "torchtp built-in", "electra": "torchtp built-in",
    "stablelm": "auto", "codegen": "auto", "bloom": "auto", "mpt": "auto", "distilbert": "auto",
    "t5": "auto", "bart": "auto",
}


def test_more_architectures_at_tp4(ranks):
    results = ranks(check_archs, 4, list(SOURCES), 1, timeout=600, gloo_timeout=120)
    for arch, source in SOURCES.items():
        got = results[0][arch]
        assert got["source"].startswith(source), (arch, got["source"])
        assert got["collectives"] == got["planned"], arch
        assert got["layers"] > 0, arch
