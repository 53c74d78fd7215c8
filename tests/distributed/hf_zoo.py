"""Sweep every model type the installed transformers knows for one head (the causal-LM
head by default), at tp 2 (or 3, 4), against one process.

A tool for new releases (``make zoo``, docs/compat.md), not part of ``make test``:
each model type of the head's auto mapping (:data:`HEADS`: causal LM, masked LM,
sequence-to-sequence LM, sequence or token classification) has its config class
built with its defaults shrunk to tiny sizes
(the fields in :data:`SHRINK` it has), in float64, eval mode, eager attention and
experts; a type whose tiny
config cannot be built, is still over :data:`MAX_PARAMETERS` or whose unsharded
forward or backward fails is skipped (reported as such). Every other one is wrapped
(``plan=None``) on two Gloo ranks (``--tp N``: N) and compared: logits, then every gradient of
``logits.square().mean()`` (a sequence-to-sequence model is given ``decoder_input_ids``
too; ``--lora``: PEFT LoRA on every Linear of both, the adapters' gradients compared;
``--option sequence_parallel`` / ``loss_parallel``: wrapped with that flag, the latter
comparing the loss of ``labels=``; ``--option train``: both in training mode, every
dropout probability at 0; ``--option checkpointing``: the same with HF activation
checkpointing on both, enabled on the wrapped side through the wrapper after the wrap,
as HF Trainer does; ``--option compile``: both models under ``torch.compile`` with
the ``aot_eager`` backend, which traces forward and backward as inductor does but
runs eager kernels; ``--option memory``: wrapped with ``plan="auto-memory"``, the
leanest candidate with every layer it can split split: at these tiny sizes the default
cost choice keeps many splits whole (a latent attention's heads, lone layers) that a
real model's size would take).
Each line of the output is one type's verdict:

* ``ok``: exact (share of parameters on rank 0, layers split);
* ``MISMATCH``: logits or gradients differ beyond float32 rounding (by more than
  1e-5 of the tensor's largest value, :func:`agree`: some models compute norms,
  routers or logits in float32 whatever their dtype) -- the silent kind of bug
  this sweep exists to find; ``GEN-MISMATCH``: four greedy tokens generated
  with the cache differ (``gen-error``: the wrapped generate raised where the
  unwrapped one ran; compared without options and with those of :data:`GENERATING`);
* ``refused`` / ``fwd-error`` / ``crash``: the wrap, the forward or the backward raised
  (read the message);
* ``skip``: not a verdict on torchtp.

    python tests/distributed/hf_zoo.py                 # every type, 15 per launch
    python tests/distributed/hf_zoo.py llama4_text     # some types
    python tests/distributed/hf_zoo.py --tp 3          # at tp 3 (uneven shares)
    python tests/distributed/hf_zoo.py --head masked-lm   # every masked-LM type
    python tests/distributed/hf_zoo.py --lora          # with LoRA adapters on every Linear
    python tests/distributed/hf_zoo.py --option sequence_parallel
    python tests/distributed/hf_zoo.py --option checkpointing   # training, recomputed layers
    python tests/distributed/hf_zoo.py --option compile llama gpt2   # compiled (slow)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed.harness import run_ranks

SHRINK = {"vocab_size": 96, "hidden_size": 32, "d_model": 32, "n_embd": 32,
          "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "num_hidden_layers": 2,
          "n_layer": 2, "num_layers": 2, "num_attention_heads": 4, "n_head": 4, "num_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_local_experts": 4,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
          "shared_expert_intermediate_size": 24, "pad_token_id": 0, "bos_token_id": 1,
          "eos_token_id": 2, "max_position_embeddings": 128, "n_positions": 128,
          "layer_types": None, "sliding_window": 16, "first_k_dense_replace": 0,
          "num_nextn_predict_layers": 0, "decoder_start_token_id": 1,
          "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
          "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
          "decoder_ffn_dim": 64, "d_ff": 64, "d_kv": 8, "embedding_size": 32,
          "dim": 32, "hidden_dim": 64, "n_layers": 2, "n_heads": 4, "emb_dim": 32,
          "d_inner": 64, "entity_vocab_size": 96, "entity_emb_size": 32,
          "shape_vocab_size": 96, "pronunciation_vocab_size": 96,
          # multi-head latent attention (DeepSeek-V2/V3 and kin) and its group-limited routing
          "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
          "v_head_dim": 8, "n_group": 1, "topk_group": 1}
MAX_PARAMETERS = 3_000_000  # after shrinking; larger means a size field SHRINK misses
BATCH = 15  # types per launch
# --head: (auto class, its mapping of model types, whether greedy generation is compared)
HEADS = {"causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", True),
         "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", False),
         "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", True),
         "seq-cls": ("AutoModelForSequenceClassification",
                     "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", False),
         "token-cls": ("AutoModelForTokenClassification",
                       "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", False)}


def auto_class(head: str) -> Any:
    """The transformers auto class of ``head``."""
    import transformers

    return getattr(transformers, HEADS[head][0])


def build(model_type: str, head: str = "causal-lm", train: bool = False) -> torch.nn.Module:
    """A tiny float64 ``model_type`` model with ``head``, weights from seed 0, eager
    attention; in eval mode, or ``train``: in training mode with every dropout at 0."""
    from accelerate import init_empty_weights
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    auto = auto_class(head)

    config_class = CONFIG_MAPPING[model_type]
    shrink = {k: v for k, v in SHRINK.items() if k in config_class().to_dict()}
    if "kv_lora_rank" in shrink:  # a latent attention has a KV head per query head
        shrink["num_key_value_heads"] = SHRINK["num_attention_heads"]
    try:
        config = config_class(**shrink)
    except Exception as err:  # a model that needs its own layer_types list, or MHA
        shrink.pop("layer_types", None)
        if "num_key_value_heads" in str(err):
            shrink["num_key_value_heads"] = SHRINK["num_attention_heads"]
        config = config_class(**shrink)
    _with_full_attention(config, config_class)
    config._attn_implementation = "eager"
    if train:
        for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
            _no_dropout(cfg, cfg.to_dict())
    if hasattr(config, "_experts_implementation"):  # grouped_mm has no float64 kernel
        config._experts_implementation = "eager"
    with init_empty_weights():
        count = sum(p.numel() for p in auto.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{count} parameters after shrinking")
    torch.manual_seed(0)
    model = auto.from_config(config).double()
    if not train:
        return model.eval()
    for module in model.modules():
        _no_dropout(module, vars(module))
    return model.train()


def _with_full_attention(config: Any, config_class: Any) -> None:
    """A model whose shrunk layers hold none of the full-attention layers its default
    has (hybrids with linear attention three layers in four, as Qwen3-Next, Qwen3.5 and
    OLMo-hybrid; sliding-window, chunked or convolution layers, as Gemma 3, Llama 4 and
    LFM3) gets full attention in its last layer, so that both kinds are checked (and a
    hybrid's cache can say its length)."""
    kinds = getattr(config, "layer_types", None)
    default = getattr(config_class(), "layer_types", None) or []
    if kinds and "full_attention" in default and "full_attention" not in kinds:
        config.layer_types = [*kinds[:-1], "full_attention"]


def _no_dropout(owner: object, fields: dict[str, Any]) -> None:
    """Every dropout probability of ``owner`` (a config or a module) set to 0: a float
    field named like one, or an ``nn.Dropout``'s ``p``, so that training mode is exact."""
    for key, value in fields.items():
        if isinstance(value, float) and value > 0 and ("dropout" in key or "pdrop" in key
                                                       or (key == "p" and "Dropout" in
                                                           type(owner).__name__)):
            setattr(owner, key, 0.0)


def inputs(model: torch.nn.Module, head: str) -> dict[str, torch.Tensor]:
    """Token ids the same on every rank (pad, bos and eos ids avoided); a
    sequence-to-sequence model also gets the first six as ``decoder_input_ids``."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, min(90, vocab - 1), (2, 10), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "decoder_input_ids": ids[:, :6]} if head == "seq2seq" \
        else {"input_ids": ids}


def causal_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss (tokens < n predict n, the mean) in the logits' dtype:
    transformers computes it in float32, which would hide float64 differences."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             labels[:, 1:].flatten())


def adapted(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with PEFT LoRA on every Linear (``"all-linear"``), A and B both random
    (``init_lora_weights=False``: every adapter changes the logits), drawn from seed 5."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                            init_lora_weights=False))


MODES = ("train", "checkpointing", "compile", "memory")  # options that are not wrapper flags
GENERATING = {"memory", "sequence_parallel"}  # options whose runs also compare generation


def checkpointed(model: Any) -> None:
    """HF activation checkpointing on ``model``'s layers, transformers' default
    (``activation_checkpointing_enable``, ``gradient_checkpointing_enable`` before 5.24)."""
    enable = getattr(model, "activation_checkpointing_enable", None) \
        or model.gradient_checkpointing_enable
    enable()


def compiled(model: Any) -> Any:
    """``model`` under ``torch.compile`` with the ``aot_eager`` backend (traces forward and
    backward as inductor does, runs eager kernels). Both sides are compiled, so a model
    torch.compile itself computes differently (DeepSeek-V4's compressor gets no gradient,
    compiled, unwrapped too) is not reported as torchtp's."""
    return torch.compile(model, backend="aot_eager")


def verdict(model_type: str, head: str = "causal-lm", lora: bool = False,
            options: tuple[str, ...] = ()) -> tuple[str, str]:
    """``(kind, detail)`` for one type on this rank (see the module docstring); ``lora``:
    with :func:`adapted` on both sides, the adapters' gradients compared; ``options``:
    wrapper flags set to ``True`` (``loss_parallel``: the loss of ``labels=`` compared,
    and its gradients), ``train``: both models in training mode, dropout at 0, or
    ``checkpointing``: the same with :func:`checkpointed` layers, ``compile``: both
    sides :func:`compiled`, or ``memory``: wrapped with ``plan="auto-memory"``."""
    import torchtp

    loss, recompute = "loss_parallel" in options, "checkpointing" in options
    train = recompute or "train" in options
    flags: dict[str, Any] = dict.fromkeys((o for o in options if o not in MODES), True)
    if "memory" in options:  # every split the candidates allow, not the tiny model's fastest
        flags["plan"] = "auto-memory"
    try:
        ref = build(model_type, head, train)
        ref = adapted(ref) if lora else ref
        if recompute:
            checkpointed(ref)
        kwargs = inputs(ref, head)
        run = compiled(ref) if "compile" in options else ref
        logits = run(**kwargs).logits
        want = causal_loss(logits, kwargs["input_ids"]) if loss else logits
        # The unsharded backward here: where it fails (RWKV's in-place update), the model
        # or torch.compile fails unwrapped too, which is no verdict on torchtp.
        (want if loss else want.square().mean()).backward()
    except Exception as err:
        return "skip", f"{type(err).__name__}: {str(err)[:150]}"
    try:
        wrapped = torchtp.DistributedModelWrapper(build(model_type, head, train), **flags)
        mine = adapted(wrapped.base_model) if lora else wrapped.base_model
        if recompute:
            checkpointed(wrapped)
    except Exception as err:
        return "refused", f"{type(err).__name__}: {str(err)[:300]}"
    try:
        model = mine if lora else wrapped
        model = compiled(model) if "compile" in options else model
        got = model(**kwargs, labels=kwargs["input_ids"]).loss if loss else \
            model(**kwargs).logits
    except Exception as err:
        return "fwd-error", f"{type(err).__name__}: {str(err)[:300]}"
    same = agree(got, want)
    bad = [] if same else ["loss" if loss else "logits"]
    (got if loss else got.square().mean()).backward()
    bad += different_gradients(ref, mine)
    if bad:
        return "MISMATCH", ", ".join(bad[:5])
    # Options that keep eval-mode forwards and full logits: generation compared too
    kind, generated = generation(ref, wrapped, kwargs["input_ids"]) \
        if HEADS[head][2] and not lora and set(options) <= GENERATING \
        else ("ok", "no generation compared")
    if kind != "ok":
        return kind, generated
    share = sum(p.numel() for p in mine.parameters()) / sum(p.numel() for p in ref.parameters())
    return "ok", (f"{share:.2f} of the parameters, {len(wrapped.parallelized_layers)} layers "
                  f"split, {generated}")


def agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within float32 rounding of the tensor's scale: every element within 1e-5 of
    ``want``'s largest magnitude (a wrong slice or a missing sum is off by the scale
    itself) plus 1e-8 (a gradient that is zero in exact arithmetic, as a key bias's,
    is rounding noise on both sides), NaN and infinities in the same places. Element-wise tolerances
    flag float32 rounding in small elements of models that compute in float32 (Beam's
    logits, FlexOlmo's norms)."""
    finite = want.isfinite()  # NaN and infinities must sit in the same places
    if got.shape != want.shape or not torch.equal(finite, got.isfinite()) \
            or not torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num()):
        return False
    real = finite
    if not real.any():
        return True
    scale = want[real].abs().max()
    return bool((got[real] - want[real]).abs().max() <= 1e-5 * scale + 1e-8)


def different_gradients(ref: torch.nn.Module, mine: torch.nn.Module) -> list[str]:
    """Parameters of ``mine`` whose gradient is not this rank's part of ``ref``'s."""
    import torchtp

    full = dict(ref.named_parameters())
    bad = []
    for name, p in mine.named_parameters():
        if name not in full:
            bad.append(f"{name} (on this side only)")
            continue
        grad = full[name].grad
        if grad is None and p.grad is None:
            continue
        if grad is None or p.grad is None:
            bad.append(f"{name} (a gradient on one side only)")
            continue
        module = mine.get_submodule(name.rpartition(".")[0])
        layout = torchtp.layouts_of(module).get(name.rpartition(".")[2])
        grad = grad if layout is None else layout.take(grad)
        if p.grad.shape != grad.shape or not agree(p.grad, grad):
            bad.append(name)
    return bad


def generation(ref: torch.nn.Module, wrapped: Any, ids: torch.Tensor) -> tuple[str, str]:
    """Greedy generation with the cache, 4 tokens, against one process's (float64: no
    argmax flips): ``("ok", what ran)`` when equal or when the unwrapped model cannot
    generate, else the verdict."""
    with torch.no_grad():
        try:
            want = ref.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False)
        except Exception as err:  # a model (or config) generate does not serve: not torchtp's
            return "ok", f"no generate ({type(err).__name__} unwrapped)"
        try:
            got = wrapped.generate(input_ids=ids[:1], max_new_tokens=4, do_sample=False)
        except Exception as err:
            return "gen-error", f"{type(err).__name__}: {str(err)[:300]}"
    if not torch.equal(got, want):
        return "GEN-MISMATCH", f"{got.tolist()} != {want.tolist()}"
    return "ok", "generate equal"


def verdicts(rank: int, world_size: int, types: list[str], head: str, lora: bool,
             options: tuple[str, ...]) -> dict[str, Any]:
    """:func:`verdict` for each type, with the seconds it took."""
    out = {}
    for model_type in types:
        start = time.time()
        try:
            out[model_type] = (*verdict(model_type, head, lora, options),
                               round(time.time() - start, 1))
        except Exception as err:  # the wrapped side's backward (outside verdict's checks)
            out[model_type] = ("crash", f"{type(err).__name__}: {str(err)[:200]}", 0.0)
    return out


def main(types: list[str], tp: int = 2, head: str = "causal-lm", lora: bool = False,
         options: tuple[str, ...] = ()) -> None:
    from transformers.models.auto import modeling_auto

    types = types or sorted(getattr(modeling_auto, HEADS[head][1]))
    for i in range(0, len(types), BATCH):
        part = types[i:i + BATCH]
        with tempfile.TemporaryDirectory() as tmp:
            try:
                ranks = run_ranks(verdicts, tp, part, head, lora, options, tmp_path=Path(tmp), timeout=900,
                                  gloo_timeout=60)
                found = ranks[0]
                for t in part:  # every rank must reach the same verdict
                    others = [r[t] for r in ranks[1:] if r[t][0] != found[t][0]]
                    if others:
                        found[t] = ("RANKS-DIFFER", f"{found[t]} / {others[0]}", 0.0)
            except Exception as err:
                found = {t: ("launch-failed", str(err)[-300:], 0.0) for t in part}
        for t in part:
            print(json.dumps([t, *found[t]]), flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every one of the head)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--head", choices=sorted(HEADS), default="causal-lm")
    parser.add_argument("--lora", action="store_true",
                        help="PEFT LoRA on every Linear, on both sides (no generation)")
    parser.add_argument("--option", action="append", default=[],
                        choices=["sequence_parallel", "loss_parallel", *MODES],
                        help="a wrapper flag set to True, train: both in training mode "
                             "with dropout at 0, checkpointing: also with HF activation "
                             "checkpointing, compile: both sides compiled, or memory: "
                             "plan='auto-memory' "
                             "(repeatable; no generation)")
    opts = parser.parse_args()
    main(opts.types, opts.tp, opts.head, opts.lora, tuple(opts.option))
