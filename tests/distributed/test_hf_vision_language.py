"""HuggingFace vision-language models at tp 2: images and text against one process."""

from __future__ import annotations

from ._vlm_checks import check_vlm_lora, check_vlms


def test_vision_language_models_match_one_process(ranks):
    # Each model's HF plan splits its language model (4 attention and 3 MLP projections per
    # decoder layer, 2 layers); the vision tower stays replicated, every rank running it on
    # the same images, and its gradients come out whole through the language model's
    # input-gradient all-reduces. Compared in float64: logits, every gradient, one SGD step,
    # then greedy generation from the images.
    archs = ["llava", "gemma3", "qwen2_vl"]
    results = ranks(check_vlms, 2, archs, timeout=300)
    for arch in archs:
        res = results[0][arch]
        assert res["split"] == 14, arch
        assert res["grads"] > 40, arch  # the vision tower's included
        assert 0.5 < res["share"] < 0.95, arch  # the language model's layers halved


def test_lora_on_every_linear_of_a_vision_language_model_matches_plain_peft(ranks):
    # Adapters on the split language model's layers (sharded like them) and on the
    # replicated vision tower's and projector's Linears (plain PEFT layers): the trained
    # adapters' gradients and one SGD step as plain PEFT's on one process.
    grads = ranks(check_vlm_lora, 2, "qwen2_vl", timeout=300)
    assert grads[0] == grads[1] > 40
