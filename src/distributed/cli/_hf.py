"""HuggingFace glue: read a config, build the model (meta or random), load a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..costmodel.dims import read_config
from ._common import CliError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float64": torch.float64, "fp64": torch.float64}


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
        # transformers' own reader: it decodes what its writer encodes (Mamba-2's
        # time_step_limit holds an infinity, stored as {"__float__": "Infinity"}).
        return tf.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CliError(f"{path}: transformers cannot build a {model_type!r} config: {err}") from None


def parse_dtype(name: str | None, config: Any = None) -> torch.dtype:
    """``--dtype`` (or the config's dtype, else float32) as a torch dtype.

    Raises:
        CliError: unknown dtype name.
    """
    if name is None:
        own = getattr(config, "dtype", None)
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
