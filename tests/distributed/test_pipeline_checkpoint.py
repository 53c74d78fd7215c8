"""Checkpoints of pipeline jobs: DCP save and exact resume, load at another pp, HF export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ._pipeline_checks import TOL, batch, build_llama, reference_loss


def _one_process(tied: bool, steps: int = 2) -> torch.nn.Module:
    """The unsplit reference: ``steps`` AdamW steps on the batches the pipelines train on."""
    ref = build_llama(tied=tied)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        reference_loss(ref, *batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return ref


def _dcp_keys(directory: Path) -> set[str]:
    """The names a DCP checkpoint stores (``model.`` + parameter name, ``optim.state.``...)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def _assert_hf_equals_one_process(directory: Path, tied: bool) -> dict[str, str]:
    """Plain transformers loads the directory in one process: every tensor (float64, as
    saved) equals the one-process reference's after the same steps; the index's map."""
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(directory)
    ref = _one_process(tied)
    assert loaded.dtype == torch.float64
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    want = dict(ref.named_parameters())
    got = dict(loaded.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():  # pipeline vs one process: float64 sums in other orders
        torch.testing.assert_close(p, want[name], **TOL, msg=name)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return index["weight_map"]


def test_pp2_tp2_resumes_exactly_loads_at_pp1_tp2_and_exports_hf(ranks, tmp_path):
    from ._pipeline_ckpt_checks import check_pp_tp

    out = ranks(check_pp_tp, 4, str(tmp_path), timeout=300)
    assert [o[0] for o in out] == [0, 0, 1, 1]  # init_parallel: stage 0 on ranks 0, 1
    assert all(o[1] > 0 for o in out) and all(o[2] == 38 for o in out)  # tied: one weight
    assert out[2][3] == out[3][3] and len(out[2][3]) == 2  # the resumed losses, bit for bit
    # The unsplit model's names: the tied weight (and its AdamW state) once, the embedding's.
    keys = _dcp_keys(tmp_path / "dcp")
    assert {"model.model.embed_tokens.weight", "optim.state.model.embed_tokens.weight.exp_avg",
            "model.model.layers.3.mlp.up_proj.weight", "step"} <= keys
    assert not any("lm_head" in k for k in keys)
    weight_map = _assert_hf_equals_one_process(tmp_path / "hf", tied=True)
    # One file per stage; the tied head is left out, as transformers saves a tied weight.
    assert sorted(set(weight_map.values())) == ["model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"]
    assert "lm_head.weight" not in weight_map
    assert weight_map["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert weight_map["model.norm.weight"] == "model-00002-of-00002.safetensors"


def test_pp2_dp2_fsdp2_without_tp_resumes_exactly_and_loads_as_one_stage(ranks, tmp_path):
    from ._pipeline_ckpt_checks import check_pp_dp

    out = ranks(check_pp_dp, 4, str(tmp_path), timeout=300)
    assert [o[0] for o in out] == [39] * 4  # 4 layers x 9, embeddings, norm, head
    assert [len(o[1]) for o in out] == [0, 0, 2, 2]  # the losses, on the last stage
    for _, _, refusal, written in out:
        assert "save_training_state is one checkpoint of the whole job, but the ranks pass " \
               "different optimizer's param_groups (hyper-parameters)" in refusal
        assert not written
    weight_map = _assert_hf_equals_one_process(tmp_path / "hf", tied=False)
    assert weight_map["lm_head.weight"] == "model-00002-of-00002.safetensors"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_both_copies_of_a_tied_embedding_on_one_rank_save_once(tmp_path):
    # No process group: one process holds stages 0 and 1 (as rank 0 of a V-shaped
    # schedule holds the first and the last); the checkpoint is the unsplit model's.
    from transformers import LlamaForCausalLM

    import torchtp
    from torchtp.checkpoint import save_pretrained
    from torchtp.checkpoint.dcp import load_training_state, save_training_state
    from torchtp.pipeline import decoder_stages

    from ._pipeline_ckpt_checks import perturbed

    model = build_llama(tied=True)
    stages = decoder_stages(model, [0, 1], 2)
    save_training_state(tmp_path / "dcp", stages, step=5)
    save_pretrained(stages, tmp_path / "hf")
    assert not any("lm_head" in k for k in _dcp_keys(tmp_path / "dcp"))
    whole = torchtp.DistributedModelWrapper(perturbed(tied=True))  # tp 1: no process group
    assert load_training_state(tmp_path / "dcp", whole) == (5, {})
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for name, p in model.named_parameters():
        assert torch.equal(whole.base_model.get_parameter(name), p), name
        assert torch.equal(loaded.get_parameter(name), p), name
    again = decoder_stages(perturbed(tied=True), [0, 1], 2)
    assert load_training_state(tmp_path / "dcp", again, None) == (5, {})
    assert torch.equal(again[1].model.lm_head.weight, model.lm_head.weight)
    assert torch.equal(again[0].model.model.embed_tokens.weight, model.lm_head.weight)


def test_a_model_that_is_neither_wrapped_nor_a_stage_is_a_type_error(tmp_path):
    from torchtp.checkpoint.dcp import save_training_state

    with pytest.raises(TypeError, match=r"save_training_state needs the DistributedModelWrapper "
                                        r"\(or a DDP around it\), got LlamaForCausalLM: .* or in "
                                        r"a pipeline job pass this rank's stage\(s\)"):
        save_training_state(tmp_path, build_llama())


def test_the_wrapper_of_a_stage_is_refused_naming_the_stage(tmp_path):
    # The wrapper does not know the stage's tied copy: given it, the last stage would save
    # its copy of the tied weight under its own name, as a second tensor.
    import torchtp
    from torchtp.checkpoint.dcp import save_training_state
    from torchtp.pipeline import decoder_stage

    stage = decoder_stage(build_llama(tied=True), 1, 2)
    wrapped = torchtp.DistributedModelWrapper(stage.model)
    with pytest.raises(TypeError, match=r"save_training_state was given the wrapper of a "
                                        r"pipeline stage's model; pass the stage itself"):
        save_training_state(tmp_path, wrapped)
