"""Rank-side checks comparing a wrapped HF model with the unsharded one."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import torchtp

from ._hf_models import GENERATES, SEQ2SEQ, build, vocab_of

# Architectures also generating with transformers' StaticCache (GQA with split
# and, at tp=4 > 2 KV heads, replicated KV heads; per-head q/k norms).
STATIC_CACHE = ("llama", "qwen3")

# Logits: fp32, sharding only reorders additions; observed differences are
# ~3e-7 on these 2-layer models, so 1e-5 (torch's fp32 default atol) holds.
LOGITS = {"rtol": 1.3e-6, "atol": 1e-5}
# Gradients pass through softmax/attention backward twice per layer and reach
# magnitudes of 1e-3..1e0; reassociation differences stay below 1e-6 absolute,
# so atol 1e-5 / rtol 1e-4 has margin without hiding a wrong slice (those are O(1)).
GRADS = {"rtol": 1e-4, "atol": 1e-5}


def inputs(arch: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab_of(arch), (2, 9), generator=gen)
    if arch in SEQ2SEQ:
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**batch).logits  # (B, T, vocab) on every rank
    ids = batch.get("decoder_input_ids", batch["input_ids"])
    target = torch.roll(ids, -1, dims=1)
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def expected_local(module: nn.Module, pname: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full tensor, following the module's recorded layout."""
    layout = torchtp.layouts_of(module).get(pname)
    return full if layout is None else layout.take(full)


def compare_params(wrapped: nn.Module, ref: nn.Module, grads: bool,
                   tol: dict[str, float] | None = None, *, named: nn.Module | None = None,
                   unused_ok: bool = False) -> int:
    """Every parameter (or gradient) of ``wrapped`` equals this rank's part of ``ref``'s
    (within ``tol``, default GRADS); replicated ones are identical on every rank.

    ``named``: the module whose parameter names are ``ref``'s (a PEFT model around the
    wrapped one; default ``wrapped.base_model``). ``unused_ok``: a parameter the batch
    does not reach (CLIP's unused post-layernorm) may have no gradient, on both sides.
    """
    model = wrapped.base_model if named is None else named
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if grads and not p.requires_grad:  # frozen (Whisper's sinusoidal positions)
            continue
        module = model.get_submodule(name.rpartition(".")[0])
        full = ref_params[name].grad if grads else ref_params[name].detach()
        mine = p.grad if grads else p.detach()
        if unused_ok and full is None:
            assert mine is None, f"{name}: a gradient here only"
            continue
        assert mine is not None, f"{name} got no gradient"
        torch.testing.assert_close(mine, expected_local(module, name.rpartition(".")[2], full),
                                   **(tol or GRADS), msg=lambda m, n=name: f"{n}: {m}")
        if not torchtp.layouts_of(module):  # replicated: identical on every rank
            first = mine.detach().clone()
            dist.broadcast(first, src=0)
            assert torch.equal(first, mine), f"replicated {name} differs across ranks"
        checked += 1
    return checked


def strip_plans(model: nn.Module) -> nn.Module:
    """Hide every plan the model or torchtp knows, so the automatic plan runs.

    Only this model instance changes (no global registry is touched).
    """
    model.config.model_type = f"unplanned-{model.config.model_type}"  # no built-in plan
    model.config.base_model_tp_plan = None
    for module in (model, model.base_model):
        module._tp_plan = {}
    return model


def check_arch(rank: int, world_size: int, arch: str, steps: int, unplanned: bool = False,
               plan: object = None) -> dict:
    model = strip_plans(build(arch)) if unplanned else build(arch)
    ref, wrapped = build(arch), torchtp.DistributedModelWrapper(model, plan=plan)
    batch = inputs(arch)
    with torchtp.count_collectives() as fwd:
        logits = wrapped(**batch).logits
    torch.testing.assert_close(logits, ref(**batch).logits, **LOGITS)
    result = {"source": wrapped.resolved_plan.source, "collectives": dict(fwd.counts),
              "planned": wrapped.resolved_plan.collectives(),
              "layers": len(wrapped.parallelized_layers), "notes": wrapped.resolved_plan.notes}
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    for _ in range(steps):
        for model, optim in ((ref, opt_ref), (wrapped, opt)):
            optim.zero_grad()
            loss_of(model, batch).backward()
        result["grads_checked"] = compare_params(wrapped, ref, grads=True)
        opt_ref.step()
        opt.step()
        compare_params(wrapped, ref, grads=False)
    if arch in GENERATES:
        prompt = batch["input_ids"][:1, :5]
        want = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = wrapped.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want), f"{arch}: generated {got.tolist()} != {want.tolist()}"
        result["generated"] = got.shape[1] - prompt.shape[1]
        if arch in STATIC_CACHE:  # preallocated per-rank KV cache: local KV heads only
            got = wrapped.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                   cache_implementation="static")
            assert torch.equal(got, want), f"{arch} static cache: {got.tolist()} != {want.tolist()}"
            result["static_cache"] = True
    return result


def check_archs(rank: int, world_size: int, archs: list[str], steps: int,
                unplanned: bool = False, plan: object = None) -> dict[str, dict]:
    results = {}
    for arch in archs:
        try:
            results[arch] = check_arch(rank, world_size, arch, steps, unplanned, plan)
        except Exception as err:  # name what failed where: make compat runs new releases
            raise AssertionError(f"{arch} at tp {world_size} is wrong on {versions()}: {err}") from err
    return results


def versions() -> str:
    """The releases under test, e.g. ``transformers 5.24.0, torch 2.14.1``."""
    import transformers

    return f"transformers {transformers.__version__}, torch {torch.__version__}"


# Task heads on a decoder or encoder (reward models, classifiers, extractive QA):
# (model class, config class, config arguments beside the tiny sizes below).
TASK_HEADS = {
    "llama-seq-cls": ("LlamaForSequenceClassification", "LlamaConfig", {"num_key_value_heads": 2}),
    "llama-qa": ("LlamaForQuestionAnswering", "LlamaConfig", {"num_key_value_heads": 2}),
    "bert-seq-cls": ("BertForSequenceClassification", "BertConfig", {}),
}


def _task_head(arch: str) -> nn.Module:
    """A tiny ``arch`` of :data:`TASK_HEADS` in float64, eval mode (BERT's dropout off),
    3 labels, pad token 0."""
    import transformers as tf

    model_class, config_class, extra = TASK_HEADS[arch]
    torch.manual_seed(0)
    config = getattr(tf, config_class)(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, num_labels=3, **extra)
    return getattr(tf, model_class)(config).double().eval()


def check_task_heads(rank: int, world_size: int, archs: list[str]) -> dict[str, int]:
    """Per architecture, on a padded batch (sequence classification pools each row's last
    non-pad token): the head's outputs and every gradient equal one process's in float64
    (sharding only reorders additions: ~1e-16 relative). Returns the layers split."""
    ids = torch.randint(3, 90, (3, 10), generator=torch.Generator().manual_seed(1))
    ids[0, 7:], ids[2, 4:] = 0, 0  # right padding of different lengths
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    f64 = {"rtol": 1e-9, "atol": 1e-12}
    split = {}
    for arch in archs:
        ref, wrapped = _task_head(arch), torchtp.DistributedModelWrapper(_task_head(arch))
        want, got = ref(**batch), wrapped(**batch)
        keys = [k for k in ("logits", "start_logits", "end_logits") if k in want]
        for key in keys:  # (3, 3), or (3, 10) twice
            torch.testing.assert_close(got[key], want[key], **f64)
        for out in (want, got):
            sum(out[k].square().sum() for k in keys).backward()
        compare_params(wrapped, ref, grads=True, tol=f64)
        split[arch] = len(wrapped.parallelized_layers)
    return split


def _whisper() -> nn.Module:
    """A tiny float64 Whisper (8 mel bins, 16 encoder positions: 32 frames), eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.WhisperConfig(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)
    return tf.WhisperForConditionalGeneration(config).double().eval()


def check_speech(rank: int, world_size: int) -> dict[str, object]:
    """Whisper planned with no plan and no example inputs: logits and every gradient equal
    one process's in float64 (sharding only reorders additions: ~1e-16 relative)."""
    gen = torch.Generator().manual_seed(1)
    batch = {"input_features": torch.randn(3, 8, 32, generator=gen).double(),
             "decoder_input_ids": torch.randint(3, 90, (3, 6), generator=gen)}
    ref, wrapped = _whisper(), torchtp.DistributedModelWrapper(_whisper())
    want, got = ref(**batch).logits, wrapped(**batch).logits  # (3, 6, 96)
    f64 = {"rtol": 1e-9, "atol": 1e-12}
    torch.testing.assert_close(got, want, **f64)
    for out in (want, got):
        out.square().sum().backward()
    compare_params(wrapped, ref, grads=True, tol=f64)
    return {"source": wrapped.resolved_plan.source, "layers": len(wrapped.parallelized_layers)}
