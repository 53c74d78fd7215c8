"""HuggingFace glue: read a config, build the model, pick its TP plan.

The plan comes from the config's ``base_model_tp_plan`` (HF's own plan for
the architecture) restricted to the ``nn.Linear`` styles torchtp applies, with
the base-model prefix added (``layers.*.mlp.up_proj`` ->
``model.layers.*.mlp.up_proj``). ``lm_head`` stays replicated, so the forward
needs exactly the plan's all-reduces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..costmodel.dims import read_config
from ..errors import valid_sizes
from ._common import CliError

_LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise CliError("this command needs HuggingFace transformers: "
                       "pip install 'torchtp[hf]'") from None
    return transformers


def load_config(path: str | Path) -> Any:
    """A ``transformers`` config from a model directory or a ``config.json``.

    Raises:
        CliError: the path is missing, unreadable, or not a known model type.
    """
    try:
        data = read_config(path)
    except ValueError as err:
        raise CliError(str(err)) from None
    model_type = data.pop("model_type", None)
    if not model_type:
        raise CliError(f"{path}: config has no 'model_type'; is this a HuggingFace config.json?")
    tf = _transformers()
    try:
        return tf.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as err:
        raise CliError(f"{path}: transformers cannot build a {model_type!r} config: {err}") from None


def parse_dtype(name: str | None, config: Any = None) -> torch.dtype:
    """``--dtype`` (or the config's dtype, else float32) as a torch dtype.

    Raises:
        CliError: unknown dtype name.
    """
    if name is None:
        own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(own, torch.dtype):
            return own
        name = str(own) if own else "float32"
    name = name.replace("torch.", "")
    if name not in _DTYPES:
        raise CliError(f"unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def build_model(config: Any, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """A causal LM from ``config`` with random weights (``device='meta'`` allocates nothing)."""
    tf = _transformers()
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_pretrained(path: str | Path, dtype: torch.dtype) -> nn.Module:
    """The full model with its weights (every rank reads all of them for now)."""
    tf = _transformers()
    return tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def has_weights(path: str | Path) -> bool:
    """Whether ``path`` is a model directory with weight files (not just a config)."""
    p = Path(path)
    return p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


def hf_plan(config: Any, model: nn.Module) -> dict[str, str]:
    """torchtp plan for ``model``: the config's ``base_model_tp_plan`` with module prefixes.

    Raises:
        CliError: the architecture has no ``base_model_tp_plan``.
    """
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    plan = {}
    for pattern, style in base.items():
        if style in _LINEAR_STYLES:
            plan[f"{prefix}.{pattern}" if prefix and hasattr(model, prefix) else pattern] = style
    if not plan:
        raise CliError(f"model type {config.model_type!r} has no tensor-parallel plan "
                       "(config.base_model_tp_plan is empty); torchtp cannot split it yet")
    return plan


def head_blockers(config: Any, tp: int) -> list[str]:
    """Attention-head counts that ``tp`` does not divide (each with the valid sizes)."""
    found = []
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if value and value % tp:
            found.append(f"{name}={value} is not divisible by tp={tp} (each rank must hold whole "
                         f"heads); valid tp sizes for it: {valid_sizes(value)}")
    return found


def head_dims(config: Any) -> list[int]:
    """Head counts every tp size must divide."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return [v for v in (heads, kv) if v]
