"""init_tensor_parallel / get_tensor_parallel_config under torchrun-like environments."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchtp


def test_without_torchrun_env_returns_world_size_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = torchtp.init_tensor_parallel()
    assert (cfg.world_size, cfg.rank, cfg.local_rank, cfg.backend, cfg.group) == (1, 0, 0, None, None)
    assert cfg.device == torch.device("cpu")
    assert not dist.is_initialized()
    assert torchtp.get_tensor_parallel_config() == cfg


def test_inconsistent_env_is_rejected(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 and WORLD_SIZE=2 are inconsistent"):
        torchtp.init_tensor_parallel()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        torchtp.init_tensor_parallel()


def test_unknown_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"unknown backend 'mpl'; use 'nccl' \(GPUs\) or 'gloo' \(CPU\)"):
        torchtp.init_tensor_parallel(backend="mpl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_from_env(rank: int, world_size: int) -> tuple:
    cfg = torchtp.init_tensor_parallel(timeout=30)
    again = torchtp.init_tensor_parallel()  # idempotent
    assert again == cfg and torchtp.get_tensor_parallel_config() == cfg
    total = torchtp.all_reduce_sum(torch.tensor([float(rank)])).item()
    return cfg.world_size, cfg.rank, cfg.local_rank, cfg.backend, str(cfg.device), total


def test_reads_torchrun_env_and_is_idempotent(ranks):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    got = ranks(_init_from_env, 2, init="none", env=env)
    assert got == [(2, 0, 0, "gloo", "cpu", 1.0), (2, 1, 1, "gloo", "cpu", 1.0)]


def _adopt_user_group(rank: int, world_size: int) -> int:
    assert dist.is_initialized()  # started by the harness, not by torchtp
    cfg = torchtp.get_tensor_parallel_config()
    assert cfg.world_size == world_size and cfg.rank == rank and cfg.backend == "gloo"
    return torchtp.init_tensor_parallel().world_size


def test_adopts_a_process_group_the_user_started(ranks):
    assert ranks(_adopt_user_group, 3) == [3, 3, 3]


def test_guide_import_path_from_repo_root():
    root = Path(__file__).resolve().parents[2]
    code = ("from src.distributed.tensor_parallel import RowParallelLinear, "
            "ColumnParallelLinear, DistributedModelWrapper, init_tensor_parallel, "
            "get_tensor_parallel_config, all_reduce_sum, broadcast_tensor, "
            "synchronize_across_ranks\n"
            "print(RowParallelLinear(4, 8).weight.shape)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.Size([8, 4])"


def test_tensor_parallel_module_reexports_the_guide_names():
    from torchtp import tensor_parallel

    for name in ("RowParallelLinear", "ColumnParallelLinear", "DistributedModelWrapper",
                 "all_reduce_sum", "broadcast_tensor", "synchronize_across_ranks",
                 "init_tensor_parallel", "get_tensor_parallel_config", "all_gather",
                 "reduce_scatter"):
        assert getattr(tensor_parallel, name) is getattr(torchtp, name)


def test_every_subpackage_is_listed_in_pyproject():
    import tomllib

    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    src = root / "src" / "distributed"
    found = {"torchtp"} | {
        "torchtp." + ".".join(p.parent.relative_to(src).parts)
        for p in src.rglob("__init__.py") if p.parent != src
    }
    assert found == listed


def _nccl_on_cpu(rank: int, world_size: int) -> str:
    return torchtp.init_tensor_parallel(backend="nccl").backend


def test_guide_backend_nccl_falls_back_to_gloo_without_cuda(ranks):
    # The guide's Pattern 1 says init_tensor_parallel(backend="nccl").
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    assert ranks(_nccl_on_cpu, 2, init="none", env=env) == ["gloo", "gloo"]


@pytest.mark.parametrize("world, sizes, expected", [
    (8, {}, {"pp": 1, "dp": 1, "cp": 1, "tp": 8}),  # no size: the whole world is one TP group
    (8, {"tp": 2}, {"pp": 1, "dp": 4, "cp": 1, "tp": 2}),  # dp takes what tp leaves
    (8, {"dp": 2}, {"pp": 1, "dp": 2, "cp": 1, "tp": 4}),  # and tp what dp leaves
    (8, {"dp": 2, "tp": 4}, {"pp": 1, "dp": 2, "cp": 1, "tp": 4}),
    (8, {"pp": 2}, {"pp": 2, "dp": 1, "cp": 1, "tp": 4}),  # pp is never filled: tp takes the rest
    (8, {"pp": 2, "tp": 2}, {"pp": 2, "dp": 2, "cp": 1, "tp": 2}),
    (8, {"cp": 2}, {"pp": 1, "dp": 1, "cp": 2, "tp": 4}),  # cp is never filled either
])
def test_mesh_sizes_fill_the_world_with_one_dimension(world, sizes, expected):
    from torchtp.comm.mesh import MESH_DIMS, mesh_sizes

    got = mesh_sizes(world, sizes)
    assert got == expected and tuple(got) == MESH_DIMS


@pytest.mark.parametrize("sizes, match", [
    ({"tp": 3}, r"init_parallel: tp=3 must divide the world size 8; valid tp values: "
                r"\[1, 2, 4, 8\]"),
    ({"dp": 2, "tp": 2}, r"dp=2, tp=2: the product of the mesh sizes must equal the world "
                         r"size 8; leave one of \['tp', 'dp'\] out"),
    ({"ep": 2}, r"unknown mesh dimension\(s\) \['ep'\]; known: \['pp', 'dp', 'cp', 'tp'\]"),
    ({"pp": 3}, r"init_parallel: pp=3 must divide the world size 8; valid pp values"),
    ({"tp": 0}, r"tp=0 must divide the world size 8"),
])
def test_mesh_sizes_refuse_with_the_valid_values(sizes, match):
    from torchtp.comm.mesh import mesh_sizes

    with pytest.raises(ValueError, match=match):
        mesh_sizes(8, sizes)


def test_resolve_group_is_the_one_rule_for_no_group(monkeypatch):
    from torchtp.comm.runtime import resolve_group

    assert resolve_group() is None and resolve_group(dim="dp") is None  # one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(torchtp.MissingProcessGroupError, match=r"WORLD_SIZE=2 but "
                       r"torch.distributed is not initialized"):
        resolve_group(dim="dp")
    with pytest.raises(torchtp.MissingProcessGroupError, match=r"WORLD_SIZE=2"):
        torchtp.DistributedModelWrapper(torch.nn.Linear(4, 4))
