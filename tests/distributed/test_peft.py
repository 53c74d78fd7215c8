"""PEFT LoRA under tensor parallelism, against unsharded LoRA built from the same seeds.

Every check runs on real Gloo processes with the real ``peft`` package:
forward and AdamW steps (only adapters train), ``target_modules="all-linear"``,
a consolidated adapter that plain PEFT loads onto the unsharded model, loading
that adapter onto a wrapped model, and wrapping a ``PeftModel`` (or its inner
model) through the base model's HF plan.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, TrainableTokensConfig, VeraConfig, get_peft_model

import torchtp
from torchtp.integrations.peft import TensorParallelLoraLinear

from ._hf_checks import compare_params, inputs, loss_of
from ._hf_models import build

# fp32; AdamW normalises each update, so reassociation differences in the
# sharded sums (~1e-7) can grow to ~1e-6 in adapter weights after a few steps
# and reach the logits through two layers; 1e-4 relative / 1e-5 absolute keeps
# margin while a wrong slice or a missing all-reduce is O(1e-2) or more.
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


def _lora(targets: object) -> LoraConfig:
    # "gaussian" draws A from N(0, 1/r) and B = 0 like the default, but with a
    # non-zero A the adapters change the logits after the first step.
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")


def _pair(arch: str, targets: object, **wrap: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unsharded LoRA model, LoRA on the wrapped model), same base and adapter seeds."""
    ref_base = build(arch)
    torch.manual_seed(5)
    ref = get_peft_model(ref_base, _lora(targets))
    wrapped = torchtp.DistributedModelWrapper(build(arch), **wrap)
    torch.manual_seed(5)
    return ref, get_peft_model(wrapped.base_model, _lora(targets))


def _train(arch: str, targets: object, steps: int,
           **wrap: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    ref, tp = _pair(arch, targets, **wrap)
    batch = inputs(arch)
    torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, **CLOSE)
    trainable = [n for n, p in tp.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (ref, tp)]
    for _ in range(steps):
        for model, opt in zip((ref, tp), opts, strict=True):
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, **CLOSE)
    return ref, tp


def _peft_suite(rank: int, world_size: int, tmp: str) -> dict:
    batch = inputs("llama")
    out: dict = {}
    # q/v targets: both out_features-split bases; three AdamW steps.
    ref, tp = _train("llama", ["q_proj", "v_proj"], steps=3)
    out["q_proj"] = type(tp.base_model.model.model.layers[0].self_attn.q_proj).__name__
    # "all-linear": o_proj/down_proj are in_features-split (A split, B replicated).
    _, every = _train("llama", "all-linear", steps=2)
    out["all_linear"] = sum(isinstance(m, TensorParallelLoraLinear) for m in every.modules())
    # Saving on every rank writes one consolidated adapter that plain PEFT loads.
    tp.save_pretrained(tmp)
    plain = PeftModel.from_pretrained(build("llama"), tmp)
    torch.testing.assert_close(plain(**batch).logits, ref(**batch).logits, **CLOSE)
    # The same files load onto a wrapped model: each rank keeps its slices.
    loaded = PeftModel.from_pretrained(torchtp.DistributedModelWrapper(build("llama")).base_model,
                                       tmp)
    torch.testing.assert_close(loaded(**batch).logits, ref(**batch).logits, **CLOSE)
    # Wrapping a PeftModel (and the HF model inside one) follows the HF plan.
    for inner in (False, True):
        peft_model = PeftModel.from_pretrained(build("llama"), tmp)
        target = peft_model.base_model.model if inner else peft_model
        wrapped = torchtp.DistributedModelWrapper(target)
        with torchtp.count_collectives() as counter:
            logits = wrapped(**batch).logits
        torch.testing.assert_close(logits, ref(**batch).logits, **CLOSE)
        out[f"wrapped_inner={inner}"] = (wrapped.resolved_plan.source.split(",")[0],
                                         dict(counter.counts))
    # GPT-NeoX's parallel residual: 'dense' and 'dense_4h_to_h' are partial sums reduced
    # once per layer (reduce_residual), their LoRA terms partial sums with them.
    _, neox = _train("gpt_neox", "all-linear", steps=2)
    out["neox_partial"] = sum(getattr(m, "partial_output", False) for m in neox.modules())
    # Uneven shares (vocab 97, hidden 70): LoRA on the gathered LM head too.
    _train("llama-uneven", ["q_proj", "lm_head"], steps=1)
    # Sequence parallelism: A beside a weight-rows-split base reads the gathered sequence
    # (its input gradient counted once by the gather's reduce-scatter, own_shard_grad);
    # the terms beside a weight-columns-split base join its reduce-scatter.
    _train("llama", "all-linear", steps=2, sequence_parallel=True)
    out["sp_dropout_agrees"] = _sp_lora_dropout_agrees()
    _saved_norms_match()
    _saved_split_copies_round_trip(f"{tmp}-saved-copies")
    # Options that cannot be sharded are refused by name.
    with pytest.raises(ValueError, match=r"LoRA variants .* not supported under tensor"):
        get_peft_model(torchtp.DistributedModelWrapper(build("llama")).base_model,
                       LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    # Other adapter methods refuse torchtp's layers as targets: "all-linear" would adapt
    # the replicated Linears only (none here), unlike the unsharded model.
    with pytest.raises(ValueError, match=r"target_modules='all-linear' with VERA on a "
                       r"tensor-parallel model: torchtp adapts LoRA only, so its 14 split "
                       r"layers \(e.g. 'model.layers.0.mlp.down_proj', weight rows or columns"):
        get_peft_model(torchtp.DistributedModelWrapper(build("llama")).base_model,
                       VeraConfig(r=4, target_modules="all-linear"))
    # Trainable tokens on a vocabulary-split embedding: PEFT looks the ids up in the local
    # shard (out of range, or silently other rows: init_weights=False gave logits off by
    # 0.68 with no error). On the whole embedding (kept by cost here) they are exact.
    split = torchtp.DistributedModelWrapper(build("llama"), plan="auto-memory").base_model
    with pytest.raises(ValueError, match=r"PEFT trainable tokens on VocabParallelEmbedding "
                       r"\(weight \[128, 64\] split along dim 0: \[64, 64\] on this rank\) "
                       r"are not supported .* modules_to_save=\['embed_tokens'\]"):
        get_peft_model(split, TrainableTokensConfig(target_modules=["embed_tokens"],
                                                    token_indices=[3, 5], init_weights=False))
    tokens = LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 16, 127])
    torch.manual_seed(5)
    ref = get_peft_model(build("llama"), tokens)
    torch.manual_seed(5)
    whole = get_peft_model(torchtp.DistributedModelWrapper(build("llama")).base_model, tokens)
    for model in (ref, whole):
        loss_of(model, batch).backward()
    delta = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"
    got, want = whole.get_parameter(delta).grad, ref.get_parameter(delta).grad
    assert got.abs().sum() > 0  # the batch holds some of these tokens
    torch.testing.assert_close(got, want, **CLOSE)
    return out


def _sp_lora_dropout_agrees() -> bool:
    """LoRA dropout on the gathered sequence, with a different RNG state on every rank: A is
    replicated, so every rank must drop the same features, or its gradient differs across
    ranks. A wrapped PeftModel called through the wrapper, and a PeftModel made after the
    wrap called itself (docs/integrations.md's way): the forward door's hooks switch the
    RNG streams either way."""
    def config() -> LoraConfig:
        torch.manual_seed(5)
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.5,
                          init_lora_weights=False)  # B random too: A's gradient is not zero

    through = torchtp.DistributedModelWrapper(get_peft_model(build("llama"), config()),
                                              sequence_parallel=True).train()
    direct = get_peft_model(torchtp.DistributedModelWrapper(
        build("llama"), sequence_parallel=True).base_model, config()).train()
    agree = []
    for model in (through, direct):
        torch.manual_seed(100 + dist.get_rank())
        loss_of(model, inputs("llama")).backward()
        grads = [m.lora_A["default"].weight.grad for m in model.modules()
                 if isinstance(m, TensorParallelLoraLinear)]
        first = [g.clone() for g in grads]
        for g in first:
            dist.broadcast(g, src=0)
        assert grads and all(g.abs().sum() > 0 for g in grads)
        agree.append(all(torch.equal(a, b) for a, b in zip(first, grads, strict=True)))
    return all(agree)


def _saved_split_copies_round_trip(tmp: str) -> None:
    """PEFT's modules_to_save on split layers (q_proj: weight rows, o_proj: weight columns)
    added after the wrap: one AdamW step equals one process's; save_pretrained writes the
    trained copies whole (each rank's slice, gathered), which load onto the unsharded
    model and onto a wrapped one (each rank keeps its slice) with the trained logits."""
    def config() -> LoraConfig:
        torch.manual_seed(5)
        return LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"],
                          modules_to_save=["q_proj", "o_proj"])

    batch = inputs("llama")
    ref = get_peft_model(build("llama"), config())
    tp = get_peft_model(torchtp.DistributedModelWrapper(build("llama")).base_model, config())
    for model in (ref, tp):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        loss_of(model, batch).backward()
        opt.step()
    want = ref(**batch).logits
    torch.testing.assert_close(tp(**batch).logits, want, **CLOSE)
    tp.save_pretrained(tmp)  # rank 0 writes; every rank returns after its write
    plain = PeftModel.from_pretrained(build("llama"), tmp)
    torch.testing.assert_close(plain(**batch).logits, want, **CLOSE)
    wrapped = PeftModel.from_pretrained(torchtp.DistributedModelWrapper(build("llama")).base_model,
                                        tmp)
    torch.testing.assert_close(wrapped(**batch).logits, want, **CLOSE)


def _saved_norms_match() -> None:
    """PEFT's modules_to_save on the norms a sequence-parallel model runs on its shards
    (the final norm's gather hook included): after the wrap, every norm copy's gradient
    equals one process's; on a PeftModel wrapped with them, refused on every rank (the
    wrapper holds no parameters of its own, so none would be summed)."""
    def config() -> LoraConfig:
        torch.manual_seed(5)
        # Every norm (peft 0.21 matches "norm" as a suffix, 0.22 as a whole name)
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                          modules_to_save=["input_layernorm", "post_attention_layernorm", "norm"])

    batch = inputs("llama")
    ref = get_peft_model(build("llama"), config())
    tp = get_peft_model(torchtp.DistributedModelWrapper(build("llama"),
                                                        sequence_parallel=True).base_model,
                        config())
    for model in (ref, tp):
        loss_of(model, batch).backward()
    saved = {n: p.grad for n, p in tp.named_parameters() if "modules_to_save" in n}
    assert len(saved) == 5  # two per layer and the final norm
    want = dict(ref.named_parameters())
    for name, grad in saved.items():
        torch.testing.assert_close(grad, want[name].grad, **CLOSE, msg=name)
    with pytest.raises(ValueError, match=r"plan style 'sequence_parallel' for module "
                       r"'base_model\.model\.model\.layers\.0\.input_layernorm' "
                       r"\(ModulesToSaveWrapper\): .* holds none of its own, only submodules "
                       r"\['original_module', 'modules_to_save'\]"):
        torchtp.DistributedModelWrapper(get_peft_model(build("llama"), config()),
                                        sequence_parallel=True)


def test_lora_matches_unsharded_lora(ranks, tmp_path):
    hf_plan = "HF plan (config.base_model_tp_plan + _tp_plan)"
    # The plain model's (small embedding and LM head kept whole by cost): adapters add none.
    per_forward = {"all_reduce": 4}
    assert ranks(_peft_suite, 2, str(tmp_path / "adapter"), timeout=300) == [{
        "q_proj": "TensorParallelLoraLinear",
        "all_linear": 14,  # 7 projections x 2 layers, never the LM head
        "neox_partial": 4,  # 2 partial output projections x 2 layers, under LoRA
        "wrapped_inner=False": (hf_plan, per_forward),
        "wrapped_inner=True": (hf_plan, per_forward),
        "sp_dropout_agrees": True,
    }] * 2


def _more_archs(rank: int, world_size: int) -> bool:
    _train("gpt2", "all-linear", steps=2)  # Conv1D, packed q|k|v
    _train("llama", ["k_proj", "v_proj", "o_proj"], steps=2)  # at tp=4: replicated KV heads
    return True


@pytest.mark.slow
def test_lora_gpt2_and_replicated_kv_heads(ranks):
    assert ranks(_more_archs, 4, timeout=500) == [True] * 4


def test_peft_imported_after_the_wrap_adapts_torchtp_layers(ranks):
    from ._late_peft import peft_imported_after_the_wrap

    for seen in ranks(peft_imported_after_the_wrap, 2, timeout=300):
        assert seen[:2] == [False, False]  # nothing imported PEFT before the script did
        # explicit targets and "all-linear": every adapter's base is torchtp's layer
        assert seen[2] == ["ColumnParallelLinear", "RowParallelLinear"]
        assert seen[3] == ["ColumnParallelLinear", "RowParallelLinear"]


class _PerHeadMix(torch.nn.Module):
    """One Linear applied to every head of a split projection's output: with the heads
    split, each rank applies it to its own heads, so its gradient is summed over the ranks
    (``replicated_with_grad_allreduce``); a LoRA adapter on it must be summed too."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.mix, self.down = (torch.nn.Linear(16, 32), torch.nn.Linear(8, 8),
                                        torch.nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.up(x).unflatten(-1, (-1, 8))  # (B, 4 heads (2 per rank), 8)
        return self.down(torch.relu(self.mix(heads).flatten(-2)))


def _per_head_mix_lora(rank: int, world_size: int) -> int:
    """LoRA on ``_PerHeadMix.mix`` added after the wrap (two adapters, both active) and
    carried by a wrapped ``PeftModel``: outputs and adapter gradients equal one process's."""
    plan = {"up": "colwise", "down": "rowwise", "mix": "replicated_with_grad_allreduce"}

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return _PerHeadMix().double()

    def lora(seed: int) -> LoraConfig:
        torch.manual_seed(seed)
        return LoraConfig(r=2, target_modules=["mix"], init_lora_weights=False)

    def two(m: torch.nn.Module) -> torch.nn.Module:
        peft = get_peft_model(m, lora(5))
        peft.add_adapter("second", lora(6))
        peft.base_model.set_adapter(["default", "second"])
        return peft

    x = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    checked = 0
    for ref, tp in ((two(model()), two(torchtp.DistributedModelWrapper(model(), plan=plan)
                                       .base_model)),
                    (get_peft_model(model(), lora(5)), torchtp.DistributedModelWrapper(
                        get_peft_model(model(), lora(5)), plan=plan))):
        want, got = ref(x), tp(x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # float64
        want.square().sum().backward()
        got.square().sum().backward()
        peft = tp.base_model if isinstance(tp, torchtp.DistributedModelWrapper) else tp
        checked += compare_params(peft, ref, True, {"rtol": 1e-10, "atol": 1e-12}, named=peft)
    return checked


def test_lora_on_a_module_whose_gradient_is_summed_matches_one_process(ranks):
    # Its adapters' gradients were this rank's heads' part only, silently.
    assert ranks(_per_head_mix_lora, 2, timeout=120) == [2 * 2 + 2] * 2


def _lora_on_split_weights(rank: int, world_size: int, out: str) -> int:
    """LoRA on split Linears' weights as parameters (``target_parameters``, PEFT's
    ``ParamWrapper``): q_proj's rows and o_proj's columns split; logits, adapter
    gradients and the saved adapter (gathered whole) equal one process's (float64).
    Returns the gradients checked."""
    from safetensors.torch import load_file

    def lora() -> LoraConfig:
        torch.manual_seed(5)
        return LoraConfig(r=2, target_modules=[], init_lora_weights=False,
                          target_parameters=["self_attn.q_proj.weight", "self_attn.o_proj.weight"])

    ref = get_peft_model(build("llama").double(), lora())
    tp = get_peft_model(torchtp.DistributedModelWrapper(build("llama").double()).base_model, lora())
    batch = inputs("llama")
    torch.testing.assert_close(tp(**batch).logits, ref(**batch).logits, rtol=1e-10, atol=1e-12)
    loss_of(ref, batch).backward()
    loss_of(tp, batch).backward()
    compare_params(tp, ref, True, {"rtol": 1e-9, "atol": 1e-12}, named=tp)  # every adapter
    checked = sum(bool(torchtp.layouts_of(m)) for n, m in tp.named_modules()
                  if ".lora_" in n)  # this rank's slices of split factors
    ref.save_pretrained(f"{out}/ref{rank}")
    tp.save_pretrained(f"{out}/tp")  # every rank: gathered whole, written by rank 0
    if rank == 0:
        want = load_file(f"{out}/ref0/adapter_model.safetensors")
        got = load_file(f"{out}/tp/adapter_model.safetensors")
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    return checked


def test_lora_on_split_linear_weights_as_parameters_matches_one_process(ranks, tmp_path):
    # Refused before (PEFT sized the adapter from the shard); "all-linear" makes such
    # targets for some MoE types' routers (AFMoE under plan="auto-memory").
    assert ranks(_lora_on_split_weights, 2, str(tmp_path), timeout=120) == [2 * 2] * 2
