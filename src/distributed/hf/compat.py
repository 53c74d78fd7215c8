"""Every use of a private or undocumented transformers (and peft) name, in one place.

transformers reorganises attention modules and model internals between
releases; code elsewhere in torchtp calls these functions, so such a change
breaks one function here (and ``make compat`` says which).
``tests/distributed/test_compat_fence.py`` fails when a transformers private
name is used outside this module and ``core/torch_compat.py``.

Each entry names the transformers releases it was checked against (``make
compat`` runs them); ``CHECKED_TRANSFORMERS`` is that list.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CHECKED_TRANSFORMERS = ("5.3.0", "5.23.0", "5.24.0", "5.25.0")
CHECKED_PEFT = ("0.21.2", "0.22.0")
CHECKED_ACCELERATE = ("1.15.0", "1.16.0")
# The oldest release torchtp supports (pyproject's lower bound, run by ``make
# compat``). Older releases ship tp plans torchtp would follow into wrong
# gradients: before 5.3 Qwen3's plan leaves the per-head ``q_norm``/``k_norm``
# without a gradient all-reduce.
MIN_TRANSFORMERS = "5.3.0"


def require_supported_transformers(transformers: Any) -> None:
    """Raise unless the loaded ``transformers`` is at least :data:`MIN_TRANSFORMERS`.

    Checked: transformers 5.3.0, 5.23.0, 5.24.0.

    Raises:
        RuntimeError: an older transformers; the message names both versions and the fix.
    """
    from packaging.version import Version

    found = str(transformers.__version__)
    if Version(found) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(
            f"torchtp needs transformers>={MIN_TRANSFORMERS} to parallelize a HuggingFace model, "
            f"found {found}: older releases ship tp plans that give wrong gradients under "
            f"tensor parallelism (e.g. Qwen3's per-head norms); pip install "
            f"'transformers>={MIN_TRANSFORMERS}'")


# The release from which transformers allocates a Mamba-style mixer's conv and SSM
# states from the first states it stores. Before it (5.3, 5.4) MambaCache,
# Mamba2Cache, HybridMambaAttentionDynamicCache and their kin allocate them at the
# full width from the config, and Jamba's and Mamba's forwards read them back: a
# split mixer's states do not fit. 5.4's modeling files still define these caches and
# 5.5's no longer do (read in the released wheels); 5.3 is run by make compat.
LAZY_STATE_CACHES = "5.5.0"


def preallocated_state_cache(module: nn.Module) -> str | None:
    """Why ``module`` (a transformers Mamba-style mixer) cannot run split here, or ``None``.

    Checked: transformers 5.3.0 (preallocated), 5.24.0, 5.25.0 (lazy).
    """
    if not type(module).__module__.startswith("transformers."):
        return None
    import transformers
    from packaging.version import Version

    found = str(transformers.__version__)
    if Version(found) >= Version(LAZY_STATE_CACHES):
        return None
    return (f"transformers {found} allocates the cache's conv and SSM states at the full "
            f"width from the config (before {LAZY_STATE_CACHES}), so a split mixer's states "
            f"would not fit; pip install 'transformers>={LAZY_STATE_CACHES}' to split it")


def dummy_inputs(model: nn.Module) -> dict[str, Any] | None:
    """``PreTrainedModel.dummy_inputs`` (undocumented): tiny inputs the model accepts, or ``None``.

    Checked: transformers 5.3.0, 5.23.0, 5.24.0 (a property returning ``{"input_ids": ...}``).
    """
    dummy = getattr(model, "dummy_inputs", None)
    return dummy if isinstance(dummy, dict) else None


def speech_inputs(model: nn.Module) -> dict[str, Any] | None:
    """Probe inputs for a speech encoder-decoder fed log-mel features (Whisper), or ``None``.

    ``dummy_inputs`` gives such a model token ids only, which its encoder cannot
    take: one clip of ``num_mel_bins`` x ``2 * max_source_positions`` frames (the
    length Whisper's encoder requires: its second convolution has stride 2),
    seeded, in the model's dtype, and two decoder start tokens.

    Checked: transformers 5.3.0, 5.24.0, 5.25.0 (Whisper).
    """
    config = getattr(model, "config", None)
    mels = getattr(config, "num_mel_bins", None)
    positions = getattr(config, "max_source_positions", None)
    if getattr(model, "main_input_name", None) != "input_features" \
            or not isinstance(mels, int) or not isinstance(positions, int):
        return None
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    start = getattr(config, "decoder_start_token_id", None)
    features = torch.randn(1, mels, 2 * positions, generator=torch.Generator().manual_seed(0))
    return {"input_features": features.to(dtype),
            "decoder_input_ids": torch.full((1, 2), start if isinstance(start, int) else 0)}


def transformers_tp_size(model: nn.Module) -> int:
    """Over how many ranks transformers' own tensor parallelism split ``model``
    (``from_pretrained(..., tp_plan=...)``); 1 when it did not.

    Checked: transformers 5.3.0, 5.24.0, 5.25.0 (``from_pretrained`` sets the instance's
    ``_tp_size``; 5.3 leaves plain local shards, 5.24 and 5.25 DTensors).
    """
    size = vars(model).get("_tp_size")
    return size if isinstance(size, int) else 1


def instance_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The TP plan transformers assembled on the instance, completed as 5.24 ships it, or ``None``.

    ``model.tp_plan`` (``model._tp_plan`` where the property is missing) holds
    the base model's ``config.base_model_tp_plan`` with full module names.
    Older releases leave parts out that 5.24 includes, so the plan is
    completed the same way on every supported version: the class's own
    entries (``{"lm_head": "colwise_gather_output"}``; missing up to 5.10),
    the base model's ``embed_tokens`` as ``"embedding_rowwise"`` when it is an
    ``nn.Embedding`` the plan does not name (added by transformers from 5.21),
    the entries of :data:`ADDED_IN_5_24`, and the experts entries 5.25 moved to the
    EP plan (:data:`EXPERTS_SPLIT`, which also names three types new in 5.25, and
    GPT-OSS, whose experts no transformers release splits by features). A model
    whose TP plan is empty has a plan only when its experts entries complete it
    (GPT-OSS on 5.3, whose EP plan names its experts ``"moe_tp_experts"``).
    Checked: transformers 5.3.0, 5.23.0, 5.24.0, 5.25.0.
    """
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict):
        plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict):
        return None
    base = getattr(model, "base_model", model)
    lead = "" if base is model else f"{model.base_model_prefix}."
    extra: dict[str, str] = {}
    if isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        extra[f"{lead}embed_tokens"] = "embedding_rowwise"
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", None))
    for name, style in ADDED_IN_5_24.get(model_type, {}).items():
        extra[lead + name] = style
    experts = {lead + name: "moe_tp_experts"  # 5.24's entry for the same module
               for name, style in (getattr(config, "base_model_ep_plan", None) or {}).items()
               if model_type in EXPERTS_SPLIT and style in ("ep_dispatch_experts",
                                                            "moe_tp_experts")}
    if not plan and not experts:
        return None
    return {**class_tp_plan(type(model)), **extra, **experts, **plan}


# Base-model plan entries transformers 5.24 ships and older releases lack.
ADDED_IN_5_24 = {"gpt_neox": {"embed_in": "embedding_rowwise"}}
# Model types whose experts are split by features ("<experts>": "moe_tp_experts"):
# those transformers 5.24's TP plan splits, three types new in 5.25, and GPT-OSS (its
# biases: ep/styles.py). 5.25 dropped those entries (the experts are named in
# ``base_model_ep_plan`` only, as "ep_dispatch_experts"), which would leave every expert
# whole on every rank; the entry comes back from the EP plan. Types no test has split
# are not listed, so they stay whole.
EXPERTS_SPLIT = frozenset({
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe",
    "deepseek_ocr2_text", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4",
    "diffusion_gemma_text", "dots1", "dots3_note_text", "dots3_note_vision_encoder",
    "ernie4_5_moe", "ernie4_5_vl_moe_text", "exaone_moe", "flex_olmo", "flint", "gemma4_text",
    "glm4_moe", "glm4_moe_lite", "glm4v_moe_text", "glm5_next_text", "glm_moe_dsa", "gpt_oss",
    "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe",
    "hy_v3", "hy_v4", "hy_v4_vl_text", "inkling2_loop_text", "inkling2_text", "inkling_text",
    "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "llama4_text",
    "longcat_flash", "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text",
    "mistral4", "mistral_large4_text", "mixtral", "nemotron_h", "olmoe", "phimoe", "qwen2_moe",
    "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen3_omni_moe_talker_text",
    "qwen3_omni_moe_text", "qwen3_vl_moe_text", "qwen4_exp_text", "sarvam_mla", "sarvam_moe",
    "solar_open", "step3p5", "unlimited_ocr_text",
    # New in 5.25, the same fused experts (3D gate_up_proj/down_proj, no biases), checked
    # exact split at tp 2 (test_moe_models_new_in_5_25_match_one_process)
    "kolibri1_1", "minicpm5_moe", "param2moe"})


def class_tp_plan(cls: type) -> dict[str, str]:
    """The plan a model class adds on top of its base model's (``cls._tp_plan``), e.g. for ``lm_head``.

    Checked: transformers 5.3.0, 5.23.0, 5.24.0.
    """
    return dict(getattr(cls, "_tp_plan", None) or {})


def is_causal_lm_config(config: Any) -> bool:
    """Whether ``AutoModelForCausalLM`` has a class for ``config``'s type (its ``_model_mapping``).

    Checked: transformers 5.3.0, 5.23.0, 5.24.0.
    """
    import transformers

    return type(config) in transformers.AutoModelForCausalLM._model_mapping


def from_config(cls: Any, config: Any) -> Any:
    """``cls`` built from ``config`` with fresh weights.

    Auto classes have the public ``from_config``; model classes only the
    private ``_from_config`` (which also applies the attention implementation
    and dtype the config asks for); other classes are called directly.
    Checked: transformers 5.3.0, 5.23.0, 5.24.0.
    """
    if hasattr(cls, "from_config"):
        return cls.from_config(config)
    if hasattr(cls, "_from_config"):
        return cls._from_config(config)
    return cls(config)


# Config attributes holding the attention / experts implementation switch;
# ``PreTrainedModel.set_attn_implementation`` writes them on the shared config,
# so per-module config copies read them live. Checked: transformers 5.23.0, 5.24.0.
CONFIG_IMPLEMENTATION_ATTRS = ("_attn_implementation_internal", "_experts_implementation_internal")


def peft_register_custom_module(lora_config: Any, mapping: dict[type, type]) -> None:
    """Register ``{base layer class: LoRA layer class}`` on one ``LoraConfig``.

    PEFT's custom-module mechanism (``LoraConfig._register_custom_module``,
    experimental in PEFT 0.13-0.22): its dispatcher builds the given LoRA
    class for targets of the given base class. Checked: peft 0.21.2, 0.22.0.
    """
    lora_config._register_custom_module(mapping)


def peft_lora_dispatch_owner() -> tuple[Any, str]:
    """``(LoraModel, name)`` of the static method that builds a LoRA layer for a target.

    Checked: peft 0.21.2, 0.22.0.
    """
    from peft.tuners.lora import LoraModel

    return LoraModel, "_create_new_module"


# PEFT modules that call the function expanding target_modules="all-linear" through their
# own name for it (``from ..tuners_utils import _maybe_include_all_linear_layers``): every one
# must see torchtp's layers, or "all-linear" leaves them out without a word. The MoE config
# conversion for transformers v5 (Mixtral, Qwen2/3-MoE, OLMoE, ...) resolves LoRA's
# "all-linear" there; the other tuners are the adapter methods torchtp refuses.
_V5_ONLY = "peft.utils.transformers_weight_conversion"  # imports transformers v5 modules
PEFT_ALL_LINEAR_MODULES = ("peft.tuners.tuners_utils", _V5_ONLY, "peft.tuners.vera.model",
                           "peft.tuners.randlora.model", "peft.tuners.tinylora.model",
                           "peft.tuners.frod.model", "peft.tuners.pvera.model")
PEFT_ALL_LINEAR = "_maybe_include_all_linear_layers"


def peft_all_linear_owners() -> list[Any]:
    """Every module of :data:`PEFT_ALL_LINEAR_MODULES` that can be imported here (the MoE
    conversion is imported lazily by PEFT, and only with transformers v5: it imports
    transformers v5 modules, so with an older transformers PEFT never calls it), each
    holding :data:`PEFT_ALL_LINEAR`.

    Checked: peft 0.21.2, 0.22.0 (``tests/distributed/test_compat_fence.py`` scans the installed
    PEFT for modules holding the name that this list lacks).
    """
    owners = []
    for name in PEFT_ALL_LINEAR_MODULES:
        try:
            owners.append(importlib.import_module(name))
        except ImportError:
            if name != _V5_ONLY:
                raise
    return owners


def peft_trainable_tokens_owner() -> tuple[Any, str]:
    """``(TrainableTokensLayer, name)`` of the method that sets up trainable token rows
    on a base layer (``TrainableTokensConfig``, ``LoraConfig(trainable_token_indices=...)``
    and the LM head tied to the embedding).

    Checked: peft 0.21.2, 0.22.0.
    """
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    return TrainableTokensLayer, "update_layer"


# PEFT LoRA layer methods TensorParallelLoraLinear overrides and torchtp hooks on
# ParamWrapper (integrations/peft_params.py): the full (unsplit) sizes PEFT sizes A and B
# from. The latter also relies on ParamWrapper's factor layout (expert e: A's rows
# e*r..e*r+r, B's columns k*E + e; its num_experts reshapes them). Checked: peft 0.21.2, 0.22.0.
LORA_LAYER_HOOKS = ("_get_in_out_features",)


def missing_lora_layer_hooks(layer_cls: type) -> list[str]:
    """The :data:`LORA_LAYER_HOOKS` PEFT's LoRA ``Linear`` does not define (yet, or any more).

    Checked: peft 0.21.2, 0.22.0 (complete).
    """
    return [name for name in LORA_LAYER_HOOKS if not callable(getattr(layer_cls, name, None))]


def peft_check_forward_args(layer: Any, x: Any, *args: Any, **kwargs: Any) -> None:
    """Run a PEFT LoRA layer's own argument checks (adapter names, merged state).

    Checked: peft 0.21.2, 0.22.0 (``LoraLayer._check_forward_args``).
    """
    layer._check_forward_args(x, *args, **kwargs)


def peft_cast_input_dtype(layer: Any, x: Any, dtype: Any) -> Any:
    """``x`` cast to an adapter weight's dtype as PEFT's own LoRA forward does.

    Checked: peft 0.21.2, 0.22.0 (``LoraLayer._cast_input_dtype``, which honours
    ``autocast_adapter_dtype``).
    """
    return layer._cast_input_dtype(x, dtype)


def accelerate_prepared(data_loader: Any) -> bool:
    """Whether accelerate prepared ``data_loader`` already.

    Checked: accelerate 1.15.0, 1.16.0 (the ``_is_accelerate_prepared`` flag).
    """
    return bool(getattr(data_loader, "_is_accelerate_prepared", False))


def accelerate_track_dataloader(acc: Any, data_loader: Any) -> None:
    """Register a data loader prepared outside ``Accelerator.prepare`` with ``acc``, as
    ``prepare_data_loader`` does, so ``acc.save_state``/``skip_first_batches`` see it.

    Checked: accelerate 1.15.0, 1.16.0 (``Accelerator._dataloaders``).
    """
    acc._dataloaders.append(data_loader)


# Trainer methods TensorParallelTrainer overrides (gradient clipping and the
# logged norm, DP-only gradient averaging, sharded optimizer checkpoints).
TRAINER_HOOKS = ("_clip_grad_norm", "_get_grad_norm", "_sync_replicated_trainable_parameters",
                 "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
                 "_load_from_checkpoint", "get_tp_size", "create_accelerator_and_postprocess")


# The first release whose Trainer has all of :data:`TRAINER_HOOKS` (5.19 added
# ``_sync_replicated_trainable_parameters`` and the path for models sharded
# before ``Trainer``); ``TensorParallelTrainer`` refuses older ones.
TRAINER_MIN_TRANSFORMERS = "5.19.0"


def set_trainer_metrics_gather(trainer: Any, gather: Callable[..., Any]) -> None:
    """Make ``gather`` the function ``Trainer``'s evaluation loop gathers losses, logits and
    labels with. ``Trainer`` copies ``accelerator.gather_for_metrics`` into
    ``gather_function`` when it builds the accelerator (and again at the end of each
    evaluation loop), so replacing the accelerator's alone misses the first evaluation.
    Checked: transformers 5.24.0, 5.25.0 (``Trainer.gather_function``).
    """
    trainer.gather_function = gather


def missing_trainer_hooks(trainer_cls: type) -> list[str]:
    """The :data:`TRAINER_HOOKS` ``transformers.Trainer`` does not define (yet, or any more).

    Checked: transformers 5.3.0 (lacks ``_sync_replicated_trainable_parameters``),
    5.18.0 (lacks it), 5.19.0, 5.23.0 and 5.24.0 (complete).
    """
    return [name for name in TRAINER_HOOKS if not callable(getattr(trainer_cls, name, None))]


def experts_flags(module: nn.Module) -> dict[str, bool] | None:
    """The layout flags of a transformers experts module (3-D expert weights), or ``None``.

    ``use_experts_implementation`` sets them on the instance; releases before
    a flag existed stored what its default says (checked: 5.3.0 has no
    ``is_concatenated`` or ``has_post_expert_norm`` and concatenates [gate; up]),
    except for the classes :data:`UNDECORATED_EXPERTS` describes (GPT-OSS's
    interleaved gate/up on 5.3.0).
    ``sentinel``: the experts implementations skip routes numbered
    ``num_experts`` when ``_is_expert_parallel`` is set (absent in 5.3.0, whose
    eager forward one-hot encodes ``num_experts`` classes only).

    Experts modules transformers does not decorate carry no flags; the ones in
    :data:`UNDECORATED_EXPERTS` are described by class.

    Checked: transformers 5.3.0, 5.24.0, 5.25.0.
    """
    weight = getattr(module, "gate_up_proj", getattr(module, "up_proj", None))
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 3
            and isinstance(getattr(module, "num_experts", None), int)):
        return None
    known = UNDECORATED_EXPERTS.get(type(module).__name__, {})
    return {"concatenated": bool(getattr(module, "is_concatenated",
                                         known.get("concatenated", True))),
            "transposed": bool(getattr(module, "is_transposed", known.get("transposed", False))),
            "has_bias": bool(getattr(module, "has_bias", False)),
            "has_gate": bool(getattr(module, "has_gate", True)),
            "post_norm": bool(getattr(module, "has_post_expert_norm", False)),
            "sentinel": hasattr(module, "_is_expert_parallel"),
            "routed": known.get("routed", True)}


# Experts modules without (some of) ``use_experts_implementation``'s flags, by class name.
# Llama 4's: gate_up_proj (E, H, 2I) as [gate | up] and down_proj (E, I, H), its
# forward(x) takes every expert's rows (E * N, H), routed and scaled by the MoE block.
# GPT-OSS's interleaves gate/up pairs (its own _apply_gate reads [..., ::2]); 5.3.0
# decorates it without is_concatenated, whose default would say [gate; up].
# Checked: transformers 5.3.0, 5.24.0, 5.25.0.
UNDECORATED_EXPERTS = {"Llama4TextExperts": {"transposed": True, "routed": False},
                       "GptOssExperts": {"concatenated": False}}


def mark_expert_parallel(module: nn.Module) -> None:
    """Turn on transformers' expert-parallel masking of sentinel routes on ``module``.

    Checked: transformers 5.24.0 (5.3.0 has no sentinel: :func:`experts_flags` says so).
    """
    module.__dict__["_is_expert_parallel"] = True  # a plain attribute of the instance


def expert_parallel_forward(module: nn.Module, dtype: torch.dtype) -> Any:
    """The function to run ``module`` with now that it holds some ranks' whole experts only.

    transformers' experts kernels (``batched_mm``, ``grouped_mm``) skip routes
    numbered ``num_experts`` once ``_is_expert_parallel`` is set; the models' own
    eager forwards differ (Mixtral's one-hot has a sentinel class, GPT-OSS's
    does not). So while the module is configured to run eagerly (read at every
    call), it runs transformers' ``grouped_mm_experts_forward`` (the same
    products and sums, without copying weights per route), or
    ``batched_mm_experts_forward`` for dtypes ``grouped_mm`` has no kernel for
    (float64); ``None``: its configured kernel skips them itself.

    Checked: transformers 5.24.0.
    """
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in (None, "eager"):
        return None
    from transformers.integrations import moe

    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return moe.grouped_mm_experts_forward
    return moe.batched_mm_experts_forward


def expert_checkpoint_conversions(model: nn.Module) -> tuple[
        list[tuple[tuple[str, ...], str]], list[tuple[tuple[str, ...], str, int | None]],
        list[tuple[str, ...]]]:
    """transformers' declared renamings and per-expert merges for ``model``'s checkpoints.

    Hub MoE checkpoints keep each expert as its own tensors
    (``...experts.3.w1.weight``); transformers >= 5 merges them into 3-D
    parameters while loading, as ``get_model_conversion_mapping`` (also used by
    PEFT) declares. Returned:

    * renamings: ``(regex patterns, replacement)``, applied to every key in order;
    * merges: ``(source patterns, target, concat_dim)``: a pattern's ``*`` is the
      expert index; the experts are stacked on a new dim 0, and with
      ``concat_dim`` the sources (e.g. gate and up) are concatenated along that
      dim of the stacked tensor first;
    * others: source patterns of conversions torchtp does not read.

    Empty lists where the release has no such mapping.

    Checked: transformers 5.23.0, 5.24.0 (``WeightRenaming``, ``WeightConverter``
    with ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``, their
    ``_original_*_patterns``); 5.3.0 has none for these models.
    """
    try:
        from transformers import conversion_mapping
        from transformers import core_model_loading as cml
    except ImportError:
        return [], [], []
    get = getattr(conversion_mapping, "get_model_conversion_mapping", None)
    if get is None:
        return [], [], []
    renames, merges, others = [], [], []
    for c in get(model):
        sources = tuple(getattr(c, "_original_source_patterns", c.source_patterns))
        targets = tuple(getattr(c, "_original_target_patterns", c.target_patterns))
        ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(c, "operations", [])]
        if getattr(c, "scope_prefix", None):
            others.append(sources)
        elif type(c) is cml.WeightRenaming and len(targets) == 1:
            renames.append((sources, targets[0]))
        elif type(c) is cml.WeightConverter and len(targets) == 1 and ops in (
                [("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            merges.append((sources, targets[0], 1 if len(ops) == 2 else None))
        else:
            others.append(sources)
    return renames, merges, others
