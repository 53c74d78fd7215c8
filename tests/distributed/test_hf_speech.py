"""A HuggingFace speech encoder-decoder (Whisper) at tp 2, planned from its own probe inputs."""

from __future__ import annotations

from ._hf_checks import check_speech


def test_whisper_is_split_by_the_automatic_plan_and_matches_one_process(ranks):
    # Whisper reads log-mel features, not token ids: the probe now feeds it one seeded
    # clip (hf/compat.speech_inputs), so the automatic plan pairs its encoder and decoder
    # (self- and cross-attention, MLPs: 8 projections per layer, 2 + 2 layers) instead of
    # keeping every Linear replicated for want of a probe forward.
    got = ranks(check_speech, 2, timeout=300)[0]
    assert got["source"].startswith("auto")
    assert got["layers"] == 32
