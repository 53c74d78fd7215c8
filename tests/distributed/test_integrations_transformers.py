"""HF Trainer on a torchtp model under real Gloo processes, against a one-process Trainer.

``TensorParallelTrainer`` at dp 2 x tp 2 (and at tp 2 with sequence and loss
parallelism): logged losses, grad norms and eval
losses, the trained weights (``save_model()`` read back by plain
``from_pretrained``) and a resumed run. Plain ``Trainer`` and accelerate's
``prepare`` refuse a tensor-parallel model at the first step.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

import torchtp

from ._hf_models import build
from ._trainer_runs import (
    arguments,
    checkpoints,
    dataset,
    final_weights,
    history,
    reference_run,
)

# fp32 on CPU; the sharded run reassociates sums (TP partial products, DP
# gradient average) so AdamW updates differ by ~1e-7 relative; after 4 steps
# weights and losses agree to ~1e-6. A wrong batch split or clip factor is O(1e-3+).
CLOSE = {"rtol": 1e-4, "atol": 1e-5}
# Trained weights: AdamW's update m / (sqrt(v) + eps) amplifies that noise in
# coordinates whose gradient is near eps (observed 1.2e-5 after 4 steps at
# lr 5e-3); 5e-5 is 1% of one step, while a wrong batch or clip factor moves
# weights by a whole step (~lr) or more.
WEIGHTS = {"rtol": 1e-4, "atol": 5e-5}
GLOBAL_BATCH = 4  # the one-process reference's batch; split over the DP ranks


def _tp_trainer(rank: int, world_size: int, out: str, tp_size: int | None = 2,
                options: dict[str, bool] | None = None) -> list:
    from torchtp.integrations.transformers import TensorParallelTrainer

    torchtp.init_tensor_parallel(tp_size=tp_size)
    per_device = GLOBAL_BATCH // (world_size // (tp_size or world_size))  # over DP ranks only
    wrapped = torchtp.DistributedModelWrapper(build("llama").train(), **(options or {}))
    trainer = TensorParallelTrainer(
        model=wrapped, train_dataset=dataset(1), eval_dataset=dataset(2),
        args=arguments(out, per_device, save_strategy="steps", save_steps=2))
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    # Resume from the step-2 checkpoint: sharded optimizer, scheduler and RNG state.
    resumed = TensorParallelTrainer(
        model=torchtp.DistributedModelWrapper(build("llama").train(), **(options or {})),
        train_dataset=dataset(1), eval_dataset=dataset(2),
        args=arguments(out + "-resumed", per_device))
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed.save_model(os.path.join(out, "resumed"))
    return [history(trainer), history(resumed), checkpoints(out)]


def _check_against_reference(ranks, tmp_path, world_size: int, tp_size: int | None,
                             options: dict[str, bool] | None = None) -> None:
    want_history, want_weights = reference_run(str(tmp_path / "ref"), GLOBAL_BATCH)
    results = ranks(_tp_trainer, world_size, str(tmp_path / "tp"), tp_size, options,
                    timeout=500)
    for got, resumed, saved in results:
        assert saved == ["checkpoint-2", "checkpoint-4"]
        assert [sorted(e) for e in got] == [sorted(e) for e in want_history]
        for mine, ref in zip(got, want_history, strict=True):
            for key in mine:
                torch.testing.assert_close(mine[key], ref[key], **CLOSE, msg=key)
        # The resumed run logs the steps after the checkpoint exactly as the full run.
        tail = [e for e in want_history[len(want_history) - len(resumed):]]
        for mine, ref in zip(resumed, tail, strict=True):
            for key in mine:
                torch.testing.assert_close(mine[key], ref[key], **CLOSE, msg=key)
    for name in ("final", "resumed"):
        got_weights = final_weights(str(tmp_path / "tp" / name))
        for key, ref in want_weights.items():
            torch.testing.assert_close(got_weights[key], ref, **WEIGHTS, msg=f"{name}: {key}")


def _trainer_supported() -> bool:
    import transformers
    from packaging.version import Version

    from torchtp.hf import compat

    return Version(transformers.__version__) >= Version(compat.TRAINER_MIN_TRANSFORMERS)


def test_tensor_parallel_trainer_refuses_a_transformers_without_its_hooks():
    # Run by make compat on transformers 5.3.0 (refused) and 5.23.0 (complete).
    import transformers

    from torchtp.hf import compat
    from torchtp.integrations.transformers import TensorParallelTrainer

    if _trainer_supported():
        assert compat.missing_trainer_hooks(transformers.Trainer) == []
        return
    assert compat.missing_trainer_hooks(transformers.Trainer)
    with pytest.raises(RuntimeError, match=r"TensorParallelTrainer needs transformers>=5\.19\.0: "
                       r"the installed .*pip install 'transformers>=5\.19\.0'"):
        TensorParallelTrainer(model=None)


@pytest.mark.skipif(not _trainer_supported(), reason="TensorParallelTrainer needs transformers>=5.19 "
                    "(its refusal is test_tensor_parallel_trainer_refuses_a_transformers_...)")
def test_tensor_parallel_trainer_dp2_tp2_matches_one_process(ranks, tmp_path):
    _check_against_reference(ranks, tmp_path, 4, 2)


@pytest.mark.slow
def test_tensor_parallel_trainer_tp_only_matches_one_process(ranks, tmp_path):
    # With sequence and loss parallelism: 8 tokens in shards of 4, the loss from each
    # rank's vocabulary slice, the checkpoint saved and resumed, the weights consolidated.
    _check_against_reference(ranks, tmp_path, 2, None,
                             {"sequence_parallel": True, "loss_parallel": True})


def _metrics(prediction: Any) -> dict[str, float]:
    """What a metric sees: rows (a count would double with duplicates), the vocabulary
    width, the predicted ids' sum and the logits' sum (float64)."""
    logits = np.asarray(prediction.predictions, dtype=np.float64)  # (N, T, V)
    return {"rows": float(logits.shape[0]), "width": float(logits.shape[-1]),
            "argmax_sum": float(logits.argmax(-1).sum()), "logit_sum": float(logits.sum())}


def _evaluations(rank: int, world_size: int, out: str) -> list[dict[str, float]]:
    """The first evaluate() of TensorParallelTrainer (7 samples in batches of 4: a padded last
    batch), with and without loss parallelism, and one process's Trainer."""
    from transformers import Trainer

    from torchtp.integrations.transformers import TensorParallelTrainer

    seven = dataset(2)[:7]
    got = []
    for options in ({}, {"loss_parallel": True}):
        wrapped = torchtp.DistributedModelWrapper(build("llama"), **options)
        trainer = TensorParallelTrainer(model=wrapped, args=arguments(out, 4), eval_dataset=seven,
                                        compute_metrics=_metrics)
        got.append(trainer.evaluate())
    want = Trainer(model=build("llama"), args=arguments(out, 4), eval_dataset=seven,
                   compute_metrics=_metrics).evaluate()
    keys = ("eval_loss", "eval_rows", "eval_width", "eval_argmax_sum", "eval_logit_sum")
    return [{k: float(r[k]) for k in keys} for r in (*got, want)]


@pytest.mark.skipif(not _trainer_supported(), reason="TensorParallelTrainer needs transformers>=5.19")
def test_tensor_parallel_trainer_evaluates_as_one_process_from_the_first_call(ranks, tmp_path):
    for plain, loss_parallel, want in ranks(_evaluations, 2, str(tmp_path / "eval"), timeout=300):
        for got in (plain, loss_parallel):
            assert got["eval_rows"] == want["eval_rows"] == 7  # each sample once
            assert got["eval_width"] == want["eval_width"]  # the whole vocabulary
            assert got["eval_argmax_sum"] == want["eval_argmax_sum"]
            for key in ("eval_loss", "eval_logit_sum"):
                assert got[key] == pytest.approx(want[key], rel=CLOSE["rtol"], abs=CLOSE["atol"]), key


def _plain_trainer(rank: int, world_size: int, out: str) -> str:
    from transformers import Trainer

    wrapped = torchtp.DistributedModelWrapper(build("llama").train())
    errors = []
    for model in (wrapped, wrapped.base_model):
        trainer = Trainer(model=model, args=arguments(out, 2, eval_strategy="no"),
                          train_dataset=dataset(1))
        with pytest.raises(ValueError, match=r"TensorParallelTrainer instead of transformers\.Trainer"):
            trainer.train()
        errors.append("raised")
    from accelerate import Accelerator

    with pytest.raises(ValueError, match=r"accelerate's prepare\(\) .*tp=2"):
        Accelerator(cpu=True).prepare(wrapped)
    return "+".join(errors)


def test_plain_trainer_and_accelerate_refuse_tp_model(ranks, tmp_path):
    assert ranks(_plain_trainer, 2, str(tmp_path / "plain"), timeout=300) == ["raised+raised"] * 2
