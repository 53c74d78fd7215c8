"""HuggingFace vision-language models at tp 2: images and text against one process."""

from __future__ import annotations

from ._vlm_checks import check_vlms


def test_vision_language_models_match_one_process(ranks):
    # Each model's HF plan splits its language model (4 attention and 3 MLP projections per
    # decoder layer, 2 layers); the vision tower stays replicated, every rank running it on
    # the same images, and its gradients come out whole through the language model's
    # input-gradient all-reduces. Compared in float64: logits, every gradient, one SGD step,
    # then greedy generation from the images. Then LoRA on every Linear of Qwen2-VL (split
    # language model layers: adapters sharded like them; the replicated vision tower's and
    # projector's: plain PEFT layers) against plain PEFT on one process.
    archs = ["llava", "gemma3", "qwen2_vl"]
    results = ranks(check_vlms, 2, archs, "qwen2_vl", timeout=300)
    for arch in archs:
        res = results[0][arch]
        assert res["split"] == 14, arch
        assert res["grads"] > 40, arch  # the vision tower's included
        assert 0.5 < res["share"] < 0.95, arch  # the language model's layers halved
    assert results[0]["lora"]["grads"] == results[1]["lora"]["grads"] > 40  # 24 LoRA pairs
