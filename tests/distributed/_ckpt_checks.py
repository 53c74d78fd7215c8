"""Rank-side checks for sharded checkpoint loading and saving."""

from __future__ import annotations

import os
import time

import pytest
import torch

import torchtp
from torchtp.plans.tying import tied_groups

from ._hf_checks import LOGITS, compare_params, expected_local, inputs, loss_of
from ._hf_models import build

ARCHS = ["llama", "gpt2", "phi3", "qwen3", "llama-tied"]


def assert_exact(wrapped: torch.nn.Module, ref: torch.nn.Module) -> int:
    """Every local parameter equals its slice of the independently built reference, bit for bit."""
    full = dict(ref.named_parameters())
    n = 0
    for name, p in wrapped.base_model.named_parameters():
        module = wrapped.base_model.get_submodule(name.rpartition(".")[0])
        want = expected_local(module, name.rpartition(".")[2], full[name].detach())
        assert torch.equal(p.detach(), want), f"{name} differs from the reference slice"
        n += 1
    return n


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"{name} differs after the round trip"


def check_arch(arch: str, hf_dir: str, sharded_in: str | None, out: str) -> dict:
    ref = build(arch)
    w = torchtp.DistributedModelWrapper.from_pretrained(hf_dir, progress=False)
    result = {"params": assert_exact(w, ref), "source": w.resolved_plan.source}
    for name, buf in ref.named_buffers():  # rotary inv_freq etc. (non-persistent)
        mine = w.base_model.get_buffer(name)
        # One cut with its projection's rows (Falcon-H1's mup_vector) is checked by the logits.
        assert mine.shape != buf.shape or torch.equal(mine, buf), name
    batch = inputs(arch)
    torch.testing.assert_close(w(**batch).logits, ref(**batch).logits, **LOGITS)
    assert [sorted(g) for g in tied_groups(w.base_model)] == [sorted(g) for g in tied_groups(ref)]
    if sharded_in is not None:  # saved at another tp: resharded while loading
        assert_exact(torchtp.DistributedModelWrapper.from_pretrained(sharded_in, progress=False), ref)
    w.save_sharded(os.path.join(out, "sharded", arch))
    again = torchtp.DistributedModelWrapper.from_pretrained(os.path.join(out, "sharded", arch),
                                                            progress=False)
    assert_same(again, w)
    w.save_pretrained(os.path.join(out, "hf", arch), max_shard_size="40KB")
    if arch == "llama":  # gradient hooks re-installed on the loaded parameters
        for model in (ref, w):
            loss_of(model, batch).backward()
        result["grads"] = compare_params(w, ref, grads=True)
        result["hooks_missing"] = torchtp.layers.grad_sync.install(w.base_model)
    return result


def check_archs(rank: int, world_size: int, dirs: dict[str, str], sharded: dict[str, str] | None,
                out: str) -> dict:
    return {arch: check_arch(arch, dirs[arch], sharded and sharded[arch], out) for arch in dirs}


def check_errors(rank: int, world_size: int, cases: dict[str, str], good: str, out: str) -> dict:
    load = torchtp.DistributedModelWrapper.from_pretrained
    messages = {}
    expect = {
        "missing_tensor": "not in its safetensors files: \\['model.norm.weight'\\]",
        "shape": "expects \\[96, 64\\]",
        "truncated": "truncated or corrupt",
        "corrupt": "corrupt or truncated",
        "missing_index": "not in model.safetensors.index.json",
        "other_model": "metadata describes another model",
        "mixed_files": "come from different saves",
        "tp_blocked": "saved at tp=1 and cannot be loaded at the current tp=2",
        "no_config": "has no config.json",
    }
    for case, pattern in expect.items():
        with pytest.raises(ValueError, match=pattern) as info:
            load(cases[case], progress=False)
        messages[case] = str(info.value)
    w = load(good, progress=False)
    with pytest.raises(ValueError, match="not an existing directory") as info:
        w.save_sharded(os.path.join(good, "config.json", "sub"))
    messages["unwritable"] = str(info.value)
    keep = os.path.join(out, "keep")
    w.save_sharded(keep)
    before = sorted(os.listdir(keep))
    if rank == 1:  # one rank fails mid-save: nobody publishes, the old checkpoint stays
        mlp = w.base_model.model.layers[0].mlp.down_proj
        mlp._parameters["weight"] = torch.nn.Parameter(mlp.weight.detach().to(torch.complex64))
    with pytest.raises(ValueError, match="cannot be stored in safetensors"):
        w.save_sharded(keep)
    assert sorted(os.listdir(keep)) == before
    assert not os.path.exists(keep + ".tmp-torchtp")
    assert_exact(load(keep, progress=False), build("llama"))
    if rank == 0:  # only rank 0 saves (transformers #36434): raise, do not hang
        with pytest.raises(RuntimeError, match="every rank of the tensor-parallel group"):
            w.save_sharded(os.path.join(out, "lonely"), timeout=3)
        assert not os.path.exists(os.path.join(out, "lonely"))
    else:
        time.sleep(5)
    return messages
