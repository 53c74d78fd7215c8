"""Inputs for the automatic plan's probe forward of a HuggingFace model.

A HuggingFace model without a plan is planned like any other model
(:mod:`torchtp.plans.auto`): one probe forward records which projection feeds
which. Its inputs come from the model: ``model.dummy_inputs``, with token ids
kept below the vocabulary size, or, for a speech encoder-decoder that reads
log-mel features (Whisper), one seeded clip and decoder start tokens.

An encoder-decoder whose dummy inputs hold no ``decoder_*`` input and whose
forward takes ``decoder_input_ids`` gets the same ids as ``decoder_input_ids``.
Pegasus, M2M-100, ProphetNet, Switch Transformers, NLLB-MoE and SeamlessM4T do
not make them from ``input_ids`` themselves (only BART-style models shift
``input_ids`` right when neither ``labels`` nor ``decoder_input_ids`` is given):
without them their probe forward raises and every Linear would stay replicated.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .compat import dummy_inputs, speech_inputs


def probe_inputs(model: nn.Module) -> dict[str, Any] | None:
    """Keyword inputs for one small forward of ``model``, or ``None`` if it has none."""
    speech = speech_inputs(model)
    if speech is not None:
        return speech
    dummy = dummy_inputs(model)
    if dummy is None:
        return None
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    # transformers' dummy ids go up to 7; a tiny vocabulary may be smaller.
    out = {k: (v.clamp(0, vocab - 1) if k == "input_ids" and vocab else v)
           for k, v in dummy.items()}
    if getattr(config, "is_encoder_decoder", False) and "input_ids" in out \
            and not any(k.startswith("decoder_") for k in out) \
            and "decoder_input_ids" in inspect.signature(model.forward).parameters:
        out["decoder_input_ids"] = out["input_ids"]  # (B, T): decoder positions like the encoder's
    return out
