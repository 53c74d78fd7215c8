"""Lightning with torchtp, against the same loop in one process (real Gloo processes).

``ModelParallelStrategy`` with ``torchtp.integrations.lightning.parallelize``
in Fabric (``parallelize_fn``) and in ``lightning.Trainer`` (called from
``configure_model``) trains exactly like one process; ``strategy="ddp"``
around a torchtp model raises in both.
"""

from __future__ import annotations

import pytest
import torch

import torchtp

from ._hf_checks import inputs, loss_of
from ._hf_models import build

# fp32; AdamW amplifies reassociation noise where gradients are near eps (see
# test_integrations_transformers): 1% of one step at lr 5e-3 after 3 steps.
CLOSE = {"rtol": 1e-4, "atol": 5e-5}
STEPS = 3
LR = 5e-3
MAX_NORM = 0.5  # below the tiny Llama's gradient norm: every step is clipped


def _one_process(max_norm: float | None = None) -> torch.Tensor:
    model = build("llama").train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        loss_of(model, inputs("llama")).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return model.eval()(**inputs("llama")).logits.detach()


def _fabric_run(world_size: int, tp: int, max_norm: float | None = None) -> torch.Tensor:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from torchtp.integrations.lightning import parallelize

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, tensor_parallel_size=tp,
                                     data_parallel_size=world_size // tp)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup(build("llama").train())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    for _ in range(STEPS):
        fabric.backward(loss_of(model, inputs("llama")))
        if max_norm is not None:  # Fabric's own clipping, made TP-aware by parallelize
            fabric.clip_gradients(model, opt, max_norm=max_norm)
        opt.step()
        opt.zero_grad()
    # Lightning's checkpoints would name each rank's shard as the whole tensor: refused
    for call in (lambda: fabric.save("unused", {"model": model, "optimizer": opt}),
                 lambda: fabric.load("unused", {"model": model})):
        with pytest.raises(ValueError, match=r"Lightning's ModelParallelStrategy\.(save|load)"
                           r"_checkpoint on a model split by torchtp: .*save_training_state"):
            call()
    return model.eval()(**inputs("llama")).logits.detach()


def _trainer_run(world_size: int) -> torch.Tensor:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from torchtp.integrations.lightning import parallelize

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build("llama").train()

        def configure_model(self) -> None:
            parallelize(self, self.device_mesh)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return loss_of(self.model, {"input_ids": batch})

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    lit = Lit()
    batches = [inputs("llama")["input_ids"]] * STEPS  # every rank: the same batches
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=STEPS,
                        strategy=ModelParallelStrategy(tensor_parallel_size=world_size,
                                                       data_parallel_size=1),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(lit, torch.utils.data.DataLoader(batches, batch_size=None))
    with pytest.raises(ValueError, match=r"ModelParallelStrategy\.save_checkpoint on a model "
                       r"split by torchtp: .*enable_checkpointing=False"):
        trainer.save_checkpoint("unused.ckpt")
    return lit.model.eval()(**inputs("llama")).logits.detach()


def _ddp_refused() -> int:
    import lightning as L
    from lightning.fabric import Fabric

    wrapped = torchtp.DistributedModelWrapper(build("llama").train())
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    with pytest.raises(ValueError, match=r"Lightning's DDP strategy .*tp=2.*ModelParallelStrategy"):
        fabric.setup(wrapped)

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = wrapped.base_model

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"Lightning's DDP strategy .*tp=2"):
        trainer.strategy.connect(Lit())
        trainer.strategy._setup_model(trainer.strategy.model)
    return 2


def _lightning_suite(rank: int, world_size: int) -> list:
    return [_fabric_run(world_size, world_size, MAX_NORM), _trainer_run(world_size),
            _ddp_refused()]


def test_lightning_model_parallel_matches_one_process_and_ddp_refuses(ranks):
    want, clipped = _one_process(), _one_process(MAX_NORM)
    for fabric, trainer, refused in ranks(_lightning_suite, 2, timeout=400):
        torch.testing.assert_close(fabric, clipped, **CLOSE)
        torch.testing.assert_close(trainer, want, **CLOSE)
        assert refused == 2


def _fabric_tp_dp(rank: int, world_size: int) -> torch.Tensor:
    return _fabric_run(world_size, 2)


@pytest.mark.slow
def test_fabric_tp2_dp2_with_fsdp2(ranks):
    # Every DP rank feeds the same batch here, so dp 2 must equal one process too.
    want = _one_process()
    for got in ranks(_fabric_tp_dp, 4, timeout=500):
        torch.testing.assert_close(got, want, **CLOSE)
