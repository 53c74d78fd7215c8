"""Rank functions: a pipeline stage built on meta that reads only its own tensors."""

from __future__ import annotations

from typing import Any

import torch

from torchtp.pipeline import PipelineSchedule

from ._pipeline_checks import TOL, batch, build_llama, reference_loss


def check_stage_from_pretrained(rank: int, world_size: int, path: str) -> list[Any]:
    """``init_parallel(pp=2, tp=2)``; each rank loads its stage (tensor-parallel over its TP
    group) from the tied tiny Llama saved at ``path``: the tensors read (recorded at the
    loader's one read per tensor), every parameter equal to this rank's cut of the saved
    model, and one 1F1B step's loss and gradients equal to one process's."""
    import torchtp
    from torchtp.checkpoint import load as loader
    from torchtp.pipeline import stage_from_pretrained

    from ._hf_checks import expected_local

    cfg = torchtp.init_parallel(pp=2, tp=2)
    read: list[str] = []
    real = loader.read_layout

    def recorded(source: Any, name: str, layout: Any) -> torch.Tensor:
        read.append(name)
        return real(source, name, layout)

    loader.read_layout = recorded
    try:
        stage = stage_from_pretrained(path, cfg.pp_rank, cfg.pp_size)
    finally:
        loader.read_layout = real
    ref = build_llama(tied=True)
    want = dict(ref.named_parameters(remove_duplicate=False))  # tied: both names

    def local(name: str, full: torch.Tensor) -> torch.Tensor:
        module = stage.model.get_submodule(name.rpartition(".")[0])
        return expected_local(module, name.rpartition(".")[2], full)

    for name, p in stage.model.named_parameters():
        assert p.dtype == torch.float64 and not p.is_meta, name
        torch.testing.assert_close(p, local(name, want[name].detach()), rtol=0, atol=0, msg=name)
    loss = PipelineSchedule(stage, 2).step(*batch(0))
    ref_loss = reference_loss(ref, *batch(0))
    ref_loss.backward()
    if loss is not None:
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    for name, p in stage.model.named_parameters():
        torch.testing.assert_close(p.grad, local(name, want[name].grad), **TOL, msg=name)
    return sorted(set(read))
