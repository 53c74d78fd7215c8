"""Trainer runs shared by the integration tests: the same data, arguments and model everywhere."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ._hf_models import VOCAB, build

SAMPLES, SEQ = 16, 8


def dataset(seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (SAMPLES, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def arguments(output_dir: str, batch: int, **overrides: Any) -> Any:
    """Default TrainingArguments (AdamW, max_grad_norm=1.0) plus accumulation and evaluation."""
    from transformers import TrainingArguments

    kw: dict[str, Any] = {
        "output_dir": output_dir, "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": batch, "gradient_accumulation_steps": 2, "max_steps": 4,
        "learning_rate": 5e-3, "logging_steps": 1, "eval_strategy": "steps", "eval_steps": 2,
        "save_strategy": "no", "report_to": [], "use_cpu": True, "seed": 0,
        "dataloader_num_workers": 0, "disable_tqdm": True}
    kw.update(overrides)
    return TrainingArguments(**kw)


def history(trainer: Any) -> list[dict[str, float]]:
    keep = ("loss", "grad_norm", "eval_loss")
    return [{k: float(v) for k, v in entry.items() if k in keep}
            for entry in trainer.state.log_history if any(k in entry for k in keep)]


def reference_run(output_dir: str, batch: int, **overrides: Any) -> tuple[list, dict]:
    """One-process transformers.Trainer on the global batch: (history, final weights)."""
    from transformers import Trainer

    model = build("llama").train()
    trainer = Trainer(model=model, args=arguments(output_dir, batch, **overrides),
                      train_dataset=dataset(1), eval_dataset=dataset(2))
    trainer.train()
    return history(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_weights(directory: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoints(output_dir: str) -> list[str]:
    return sorted(d for d in os.listdir(output_dir) if d.startswith("checkpoint-"))
