"""Sharded checkpoints: load by slices, save sharded/consolidated, reshard across tp sizes.

One launch per tp size runs every architecture (launches cost seconds); the
references are built independently from the same seed, never from a shard.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import torchtp
from torchtp.checkpoint import consolidate, reshard
from torchtp.checkpoint.cli_commands import consolidate_main, reshard_main

from ._ckpt_checks import ARCHS, assert_exact, check_archs
from ._hf_models import build


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = str(root / arch)
        build(arch).save_pretrained(dirs[arch])
    return dirs


def _same_state(path: str, arch: str) -> None:
    """Plain transformers loads ``path``; every tensor equals the reference bit for bit."""
    got = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    want = build(arch).state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{arch}: {name}"


def test_load_save_reshard_across_tp_sizes(ranks, hf_dirs, tmp_path):
    out2, out4 = str(tmp_path / "tp2"), str(tmp_path / "tp4")
    res2 = ranks(check_archs, 2, hf_dirs, None, out2, timeout=300, gloo_timeout=60)
    sharded2 = {a: os.path.join(out2, "sharded", a) for a in ARCHS}
    res4 = ranks(check_archs, 4, hf_dirs, sharded2, out4, timeout=400, gloo_timeout=60)
    for res in (res2, res4):
        assert res[0]["llama"]["grads"] > 0 and res[0]["llama"]["hooks_missing"] == 0
    assert res4[0]["gpt2"]["source"] == "torchtp built-in plan for 'gpt2'"
    for arch in ARCHS:
        for out in (out2, out4):
            _same_state(os.path.join(out, "hf", arch), arch)  # consolidated by save_pretrained
        # tp=4 -> tp=1 in this process (no process group)
        one = torchtp.DistributedModelWrapper.from_pretrained(os.path.join(out4, "sharded", arch),
                                                              progress=False)
        assert_exact(one, build(arch))
    # save_pretrained sharded by size: several files and an index
    assert os.path.isfile(os.path.join(out4, "hf", "llama", "model.safetensors.index.json"))
    # Offline reshard 4 -> 2 writes the same rank files save_sharded wrote at tp=2.
    for arch in ("llama", "gpt2"):
        dst = str(tmp_path / f"r2-{arch}")
        reshard(os.path.join(out4, "sharded", arch), dst, 2)
        for r in range(2):
            name = f"rank-{r:05d}-of-00002.safetensors"
            got, want = load_file(os.path.join(dst, name)), load_file(os.path.join(sharded2[arch], name))
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), arch
        consolidate(dst, str(tmp_path / f"c-{arch}"))
        _same_state(str(tmp_path / f"c-{arch}"), arch)


def test_cli_reshard_and_consolidate(hf_dirs, tmp_path, capsys):
    src, r3, hf = hf_dirs["gpt2"], str(tmp_path / "r4"), str(tmp_path / "hf")
    assert reshard_main([src, r3, "--tp", "4"]) == 0
    assert consolidate_main([r3, hf, "--max-shard-size", "30KB"]) == 0
    _same_state(hf, "gpt2")
    assert reshard_main([src, str(tmp_path / "bad"), "--tp", "9"]) == 2  # 8 heads
    err = capsys.readouterr().err
    assert "torchtp reshard: error:" in err and "cannot be resharded to tp=9" in err
    assert "valid" in err
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "torchtp.checkpoint", "consolidate", r3,
                           str(tmp_path / "hf2")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    _same_state(str(tmp_path / "hf2"), "gpt2")
    assert not Path(str(tmp_path / "hf2") + ".tmp-torchtp").exists()
