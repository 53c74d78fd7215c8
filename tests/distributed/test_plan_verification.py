"""Every whole-head attention split is confirmed by the local probe before any weight is cut.

CodeGen packs ``qkv_proj``'s out_features (weight rows) in ``mp_num=4`` groups
that no plan style describes: a ``colwise`` split of it runs and is wrong. A
user plan saying so is refused on every rank; the same rules from a plan
source torchtp does not control (the model's HF plan) keep that attention
replicated and ``describe_plan()`` says why. Correct plans still split.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch import nn

import torchtp

from . import _handwritten
from ._hf_checks import LOGITS, inputs
from ._hf_models import build

PLAN = {"transformer.h.*.attn.qkv_proj": "colwise", "transformer.h.*.attn.out_proj": "rowwise"}
# As transformers 5.24's CodeGen ships it (5.23 has none): relative to the base model.
HF_PLAN = {"h.*.attn.qkv_proj": "colwise", "h.*.attn.out_proj": "rowwise",
           "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise"}
REFUSED = (r"plan \(argument\): attention 'transformer\.h\.0\.attn' \(CodeGenAttention, "
           r"num_attention_heads=8, num_key_value_heads=8, head_dim=8\) split by whole heads at "
           r"world_size={tp} via 'transformer\.h\.0\.attn\.qkv_proj' \(colwise: splits "
           r"out_features=192 \(weight rows\)\), 'transformer\.h\.0\.attn\.out_proj' \(rowwise: "
           r"splits in_features=64 \(weight columns\)\): .*does not reproduce each rank's "
           r"slice of its output projection's input.*mp_num=4 groups.*Fix: mark these modules 'replicate' in "
           r"the plan, or pass verify_plan=False")


def _codegen_with_hf_plan(seed: int = 0) -> nn.Module:
    model = build("codegen", seed)
    model.config.base_model_tp_plan = dict(HF_PLAN)
    return model


def _on_meta(arch: str) -> nn.Module:
    import transformers

    config = build(arch).config
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_user_plan_that_splits_codegen_heads_is_refused(tp):
    with pytest.raises(ValueError, match=REFUSED.format(tp=tp)):
        torchtp.DistributedModelWrapper(build("codegen"), world_size=tp, rank=tp - 1, plan=PLAN)


def test_low_precision_models_are_judged_by_their_dtype():
    # bf16 kernels may round per shape (a few ulps); a wrong layout still differs by O(1).
    with pytest.raises(ValueError, match=REFUSED.format(tp=2)):
        torchtp.DistributedModelWrapper(build("codegen").to(torch.bfloat16), world_size=2, rank=0,
                                        plan=PLAN)
    llama = torchtp.DistributedModelWrapper(build("llama").to(torch.bfloat16), world_size=2,
                                            rank=0)
    assert set(llama.resolved_plan.checks.values()) == {"confirmed"}


def test_meta_model_is_checked_on_a_one_layer_copy():
    # from_pretrained's path: no forward can run on meta weights.
    with pytest.raises(ValueError, match=REFUSED.format(tp=2)):
        torchtp.DistributedModelWrapper(_on_meta("codegen"), world_size=2, rank=0, plan=PLAN)
    llama = torchtp.DistributedModelWrapper(_on_meta("llama"), world_size=2, rank=0)
    assert llama.resolved_plan.checks == {f"model.layers.{i}.self_attn": "confirmed"
                                          for i in range(2)}


def test_hf_plan_that_splits_codegen_heads_keeps_attention_replicated():
    for tp in (2, 3, 4):
        wrapped = torchtp.DistributedModelWrapper(_codegen_with_hf_plan(), world_size=tp, rank=0)
        plan = wrapped.resolved_plan
        assert plan.source.startswith("HF plan")
        assert plan.assignments["transformer.h.1.attn.qkv_proj"].name == "replicate"
        assert plan.assignments["transformer.h.1.attn.out_proj"].name == "replicate"
        assert plan.assignments["transformer.h.1.mlp.fc_in"].name == "colwise"  # MLP still split
        assert plan.heads == {}
        assert set(plan.checks) == {"transformer.h.0.attn", "transformer.h.1.attn"}
        text = wrapped.describe_plan()
        assert re.search(r"transformer\.h\.\*\.attn\.qkv_proj \(x2\)\s+replicate\s+192x64 -> "
                         r"whole\s+kept replicated: attention 'transformer\.h\.\*\.attn' with its "
                         r"projections split by whole heads, the local probe does not reproduce "
                         r"each rank's slice", text), text
        assert "note: 'transformer.h.*.attn' kept replicated" in text


@pytest.mark.skipif(not hasattr(__import__("transformers"), "Gemma4UnifiedTextConfig"),
                    reason="Gemma 4 is new in transformers 5.24 (make test runs it)")
def test_a_layer_the_patterns_split_does_not_fit_leaves_its_heads_unconfirmed():
    # Gemma 4's full-attention layers have their own head_dim (per_layer_config): the
    # split run of the probe's pattern raised inside the wrap (RuntimeError: start (0) +
    # length (1024) exceeds dimension size (32)). Now no split of it is confirmed: the HF
    # plan's heads stay whole and the automatic plan, which pairs each layer itself, wins.
    from transformers import AutoModelForCausalLM, Gemma4UnifiedTextConfig

    torch.manual_seed(0)
    config = Gemma4UnifiedTextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16,
        max_position_embeddings=128)  # the last layer is full attention, head_dim 512
    wrapped = torchtp.DistributedModelWrapper(AutoModelForCausalLM.from_config(config),
                                              world_size=2, rank=0)
    assert wrapped.resolved_plan.source.startswith("auto")
    assert re.search(r"HF plan .* -> 2 head split\(s\) not confirmed by the probe",
                     wrapped.describe_plan())


def test_correct_plans_still_split_heads_and_say_so():
    for arch in ("llama", "qwen3", "gpt2", "bert"):  # HF plan, per-head norms, built-in plans
        wrapped = torchtp.DistributedModelWrapper(build(arch), world_size=4, rank=1)
        checks = wrapped.resolved_plan.checks
        assert len(checks) == 2 and set(checks.values()) == {"confirmed"}, (arch, checks)
        assert len(wrapped.resolved_plan.heads) == 2, arch
    assert "whole heads confirmed by the local probe" in wrapped.describe_plan()


def test_user_plan_that_cannot_be_probed_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"attention 'blocks\.0\.attn' \(TimmAttention.*could not "
                                         r"be verified: no example inputs could be derived.*Fix: "
                                         r"pass example_inputs=\(\.\.\.\)"):
        torchtp.DistributedModelWrapper(_handwritten.build("vit"), world_size=2, rank=0,
                                        plan=_handwritten.PLANS["vit"])
    vit = torchtp.DistributedModelWrapper(_handwritten.build("vit"), world_size=2, rank=0,
                                          plan=_handwritten.PLANS["vit"],
                                          example_inputs=_handwritten.example_inputs("vit"))
    assert set(vit.resolved_plan.checks.values()) == {"confirmed"}


def test_unverifiable_split_from_a_builtin_plan_stays_whole_with_its_sibling_output(
        monkeypatch):
    from torchtp.plans import verify

    @contextlib.contextmanager
    def no_probe(model: nn.Module, example_inputs: object):  # e.g. the probe forward raised
        yield None, None, "the probe forward failed (RuntimeError: boom)"

    monkeypatch.setattr(verify, "_probe_model", no_probe)
    monkeypatch.setattr(verify, "_CACHE", {})  # no verdict from an earlier wrap
    # plan="builtin": by default the automatic plan, confirmed by its own probe, would win.
    bert = torchtp.DistributedModelWrapper(build("bert"), world_size=2, rank=0, plan="builtin")
    styles = {n: s.name for n, s in bert.resolved_plan.assignments.items() if ".layer.0." in n}
    assert styles == {"bert.encoder.layer.0.attention.self.query": "replicate",
                      "bert.encoder.layer.0.attention.self.key": "replicate",
                      "bert.encoder.layer.0.attention.self.value": "replicate",
                      "bert.encoder.layer.0.attention.output.dense": "replicate",  # the sibling
                      "bert.encoder.layer.0.intermediate.dense": "colwise",
                      "bert.encoder.layer.0.output.dense": "rowwise"}
    assert bert.resolved_plan.checks["bert.encoder.layer.0.attention.self"] == (
        "kept replicated: could not be verified: the probe forward failed (RuntimeError: boom)")


def test_verdicts_are_part_of_the_fingerprint_the_ranks_agree_on():
    from torchtp.guards import checks
    from torchtp.plans import ShardContext

    wrapped = torchtp.DistributedModelWrapper(_codegen_with_hf_plan(), world_size=2, rank=1)
    ctx = ShardContext(2, 1, None, "CodeGenForCausalLM")
    prints = checks.before_slicing(wrapped.base_model, wrapped.resolved_plan, ctx, (), {})
    assert prints["attention checks"] == wrapped.resolved_plan.checks
    assert prints["attention checks"]["transformer.h.0.attn"].startswith("kept replicated")


def test_verdicts_from_a_one_layer_copy_are_cached(monkeypatch):
    from torchtp.plans import verify

    monkeypatch.setattr(verify, "_CACHE", {})
    first = torchtp.DistributedModelWrapper(build("llama"), world_size=2, rank=0)
    assert len(verify._CACHE) == 1
    monkeypatch.setattr(verify, "_probe_patterns", None)  # a second probe would raise
    again = torchtp.DistributedModelWrapper(_on_meta("llama"), world_size=2, rank=1)
    assert again.resolved_plan.checks == first.resolved_plan.checks
    assert set(again.resolved_plan.checks.values()) == {"confirmed"}


def test_opt_out_keeps_the_user_plan_and_says_it_was_not_verified():
    wrapped = torchtp.DistributedModelWrapper(build("codegen"), world_size=2, rank=0, plan=PLAN,
                                              verify_plan=False)
    plan = wrapped.resolved_plan
    assert plan.checks["transformer.h.0.attn"] == ("not verified (verify_plan=False): the "
                                                   "user's responsibility")
    assert any("is the user's responsibility" in n for n in plan.notes)
    assert "transformer.h.0.attn.qkv_proj" in wrapped.parallelized_layers


def _run_codegen(rank: int, world_size: int, path: str) -> dict:
    """HF plan: exact (attention replicated). User plan: refused, also from a checkpoint on
    meta. Opted out: wrong logits without an error, as the issue saw."""
    batch = inputs("codegen")
    ref = build("codegen")(**batch).logits
    hf = torchtp.DistributedModelWrapper(_codegen_with_hf_plan())
    torch.testing.assert_close(hf(**batch).logits, ref, **LOGITS)
    out: dict = {"checks": hf.resolved_plan.checks}
    for key, make in (("refused", lambda: torchtp.DistributedModelWrapper(build("codegen"),
                                                                          plan=PLAN)),
                      ("refused_loading", lambda: torchtp.DistributedModelWrapper.from_pretrained(
                          path, plan=PLAN, progress=False))):
        try:
            make()
        except ValueError as err:
            out[key] = str(err)
    loaded = torchtp.DistributedModelWrapper.from_pretrained(path, plan=PLAN, progress=False,
                                                             verify_plan=False)
    out["loaded_checks"] = loaded.resolved_plan.checks
    out["opt_out_error"] = (loaded(**batch).logits - ref).abs().max().item()
    return out


def test_codegen_across_ranks_exact_or_refused(ranks, tmp_path):
    path = str(tmp_path / "codegen")
    build("codegen").save_pretrained(path)
    for out in ranks(_run_codegen, 2, path, timeout=200):
        assert set(out["checks"].values()) == {out["checks"]["transformer.h.0.attn"]}
        assert out["checks"]["transformer.h.0.attn"].startswith("kept replicated")
        for key in ("refused", "refused_loading"):
            assert "attention 'transformer.h.0.attn' (CodeGenAttention" in out[key]
            assert "mp_num=4 groups" in out[key] and "verify_plan=False" in out[key]
        assert set(out["loaded_checks"].values()) == {"not verified (verify_plan=False): the "
                                                      "user's responsibility"}
        assert out["opt_out_error"] > 0.1  # what the check prevents: wrong logits, no error
