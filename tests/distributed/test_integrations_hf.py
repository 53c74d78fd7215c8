"""HF conveniences on a wrapped model: consolidated save_pretrained, clear errors, global sizes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import torchtp

from ._hf_checks import LOGITS, inputs
from ._hf_models import build


def _conveniences(rank: int, world_size: int, directory: str) -> dict:
    # plan="auto-memory": the HF plan as written, vocabulary split (the resize guard's case).
    ref = build("llama")
    wrapped = torchtp.DistributedModelWrapper(build("llama"), plan="auto-memory")
    model = wrapped.base_model
    # HF's own save_pretrained on the wrapped model: consolidated and collective.
    model.save_pretrained(directory, is_main_process=rank == 0)
    reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    batch = inputs("llama")
    torch.testing.assert_close(reloaded(**batch).logits, ref(**batch).logits, **LOGITS)
    with pytest.raises(ValueError, match=r"state_dict.*this rank's shards.*wrapped\.save_pretrained"):
        model.save_pretrained(directory, state_dict=model.state_dict())
    with pytest.raises(ValueError, match=r"push_to_hub .*tp=2.*wrapped\.save_pretrained\(dir\)"):
        model.push_to_hub("me/model")
    with pytest.raises(ValueError, match=r"resize_token_embeddings after wrapping.*vocabulary.*"
                                         r"tp=2.*before DistributedModelWrapper"):
        model.resize_token_embeddings(200)
    summary = wrapped.describe_plan().splitlines()[-1]
    return {"full_in_summary": f"{ref.num_parameters():,} in the full model" in summary,
            "local_in_summary": f"{model.num_parameters():,} on this rank" in summary,
            "local_is_smaller": model.num_parameters() < ref.num_parameters()}


def test_hf_conveniences_on_wrapped_model(ranks, tmp_path):
    assert ranks(_conveniences, 2, str(tmp_path / "hf"), timeout=200) == [
        {"full_in_summary": True, "local_in_summary": True, "local_is_smaller": True}] * 2
