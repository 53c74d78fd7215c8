"""One public surface, documented in one table (docs/api.md "Public names").

* Every name in the ``__all__`` of ``torchtp`` and of each subpackage is listed
  in the table once, under the packages that export it, and the table lists
  nothing that is not exported. A name exported by two packages must be one of
  the explicitly listed exceptions: the guide module's re-exports, or the seed
  documents' own names (different objects).
* The aliases that only repeated another name (issue 36) are gone: asking for
  one raises ``AttributeError``, and the table lists none.
* The reference guide's names import from ``src.distributed.tensor_parallel``
  with warnings turned into errors.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import torchtp

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
GUIDE_MODULE = "torchtp.tensor_parallel"
# The names the reference guide (seed 002) imports from src.distributed.tensor_parallel
# or calls unqualified in its "Utilities" section.
GUIDE_NAMES = ("RowParallelLinear", "ColumnParallelLinear", "DistributedModelWrapper",
               "init_tensor_parallel", "get_tensor_parallel_config", "all_reduce_sum",
               "broadcast_tensor", "synchronize_across_ranks")
# The seed documents' cores keep their documents' names; these collide with
# torchtp's (or each other's) and are different functions.
SEED_NAME_COLLISIONS = {
    "all_gather": {"torchtp", "torchtp.shard"},
    "reduce_scatter": {"torchtp", "torchtp.shard"},
    "gather": {"torchtp.shard", "torchtp.slicing"},
}
# The spellings removed by issue 36 (each repeated another name): (module, old name).
REMOVED_NAMES = [
    ("torchtp", "reduce_from_tensor_parallel_region"),
    ("torchtp", "gather_from_tensor_parallel_region"),
    ("torchtp", "reduce_scatter_to_tensor_parallel_region"),
    ("torchtp.plans", "Rules"),
    ("torchtp.plans", "PlanArg"),
    ("torchtp.plans", "LayerPlan"),
]
CONFIG_ALIASES = ["tp_size", "tp_rank", "tp_group"]


def _packages() -> list[str]:
    subpackages = sorted(f"torchtp.{m.name}" for m in pkgutil.iter_modules(torchtp.__path__) if m.ispkg)
    return ["torchtp", *subpackages, GUIDE_MODULE]


def exports() -> dict[str, set[str]]:
    """``{name: {packages whose __all__ lists it}}``."""
    out: dict[str, set[str]] = {}
    for package in _packages():
        for name in getattr(importlib.import_module(package), "__all__", ()):
            out.setdefault(name, set()).add(package)
    return out


def documented(text: str) -> tuple[list[tuple[str, set[str]]], str]:
    """The public-names table's rows ``(name, {packages})`` and its descriptions, joined."""
    section = text.split("## Public names", 1)[1].split("\n## ", 1)[0]
    rows, described = [], []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        rows.append((cells[0].strip("`"), set(re.findall(r"`(torchtp[\w.]*)`", cells[1]))))
        described.append(cells[2])
    return rows, "\n".join(described)


def surface_problems(exported: dict[str, set[str]], rows: list[tuple[str, set[str]]]) -> list[str]:
    """What is wrong between the exports and the table (empty: they agree)."""
    problems = []
    for name, packages in sorted(exported.items()):
        owners = packages - {GUIDE_MODULE}
        if GUIDE_MODULE in packages and "torchtp" not in packages:
            problems.append(f"{name}: {GUIDE_MODULE} may only re-export torchtp's names, "
                            f"not {sorted(owners)}'s")
        elif len(owners) > 1 and SEED_NAME_COLLISIONS.get(name) != owners:
            problems.append(f"{name} is exported by {sorted(owners)}: export it from one place")
    listed: dict[tuple[str, str], int] = {}
    for name, packages in rows:
        for package in packages:
            listed[(name, package)] = listed.get((name, package), 0) + 1
    actual = {(name, package) for name, packages in exported.items() for package in packages}
    problems += [f"{p}.{n} is exported but not in docs/api.md's table"
                 for n, p in sorted(actual - set(listed))]
    problems += [f"docs/api.md lists {p}.{n}, which is not exported" for n, p in sorted(set(listed) - actual)]
    problems += [f"docs/api.md lists {p}.{n} {k} times" for (n, p), k in sorted(listed.items()) if k > 1]
    return problems


def test_every_export_is_in_the_table_once_and_nothing_is_exported_twice() -> None:
    exported = exports()
    rows, _ = documented(API.read_text())
    assert len(rows) >= 130, len(rows)  # the table was found and parsed
    assert not surface_problems(exported, rows)


def test_the_surface_check_catches_each_kind_of_drift() -> None:
    exported = exports()
    rows, _ = documented(API.read_text())
    twice = {**exported, "layouts_of": {"torchtp", "torchtp.layers"}}
    twice_rows = [*rows, ("layouts_of", {"torchtp.layers"})]
    assert surface_problems(twice, twice_rows) == [
        "layouts_of is exported by ['torchtp', 'torchtp.layers']: export it from one place"]
    missing = [row for row in rows if row[0] != "grad_norm"]
    assert surface_problems(exported, missing) == [
        "torchtp.grad_norm is exported but not in docs/api.md's table"]
    stale = [*rows, ("tp_group", {"torchtp"})]
    assert surface_problems(exported, stale) == ["docs/api.md lists torchtp.tp_group, which is not exported"]
    guide_extra = {**exported, "Grid": {"torchtp.shard", GUIDE_MODULE}}
    assert surface_problems(guide_extra, [*rows, ("Grid", {GUIDE_MODULE})])[0].startswith(
        f"Grid: {GUIDE_MODULE} may only re-export")


@pytest.mark.parametrize(("package", "old"), REMOVED_NAMES)
def test_removed_spellings_are_gone_and_undocumented(package: str, old: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match=f"has no attribute '{old}'"):
        getattr(module, old)
    _, described = documented(API.read_text())
    assert f"`{package}.{old}`" not in described


def test_the_kept_region_operators_compute_what_the_collectives_do() -> None:
    import torch

    x = torch.randn(2, 3)
    gather = torchtp.comm.regions.gather_from_tensor_parallel_region
    assert torch.equal(gather(x, None, -1), torchtp.all_gather(x))


@pytest.mark.parametrize("old", CONFIG_ALIASES)
def test_the_config_has_one_spelling_per_value(old: str) -> None:
    cfg = torchtp.TensorParallelConfig(world_size=4, rank=3, group=None)
    with pytest.raises(AttributeError, match=old):
        getattr(cfg, old)


def test_unknown_names_still_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'tp_size'"):
        torchtp.tp_size  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'SequencePlan'"):
        torchtp.plans.SequencePlan  # noqa: B018


def test_kept_spellings_raise_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for package in _packages():
            module = importlib.import_module(package)
            for name in getattr(module, "__all__", ()):
                getattr(module, name)
        cfg = torchtp.get_tensor_parallel_config()
        assert (cfg.world_size, cfg.rank, cfg.group) == (1, 0, None)


def test_guide_import_path_raises_no_warning() -> None:
    code = ("import warnings\n"
            "warnings.simplefilter('error')\n"
            f"from src.distributed.tensor_parallel import {', '.join(GUIDE_NAMES)}\n"
            "config = init_tensor_parallel(backend='gloo')\n"
            "import torch\n"
            "model = DistributedModelWrapper(torch.nn.Sequential(torch.nn.Linear(4, 8)), "
            "world_size=config.world_size, rank=config.rank)\n"
            "assert RowParallelLinear(4, 8)(torch.ones(2, 4)).shape == (2, 8)\n"
            "print(get_tensor_parallel_config().world_size, model.world_size, model.rank)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "0"]


def test_guide_module_reexports_the_guide_names() -> None:
    guide = importlib.import_module(GUIDE_MODULE)
    assert set(GUIDE_NAMES) <= set(guide.__all__)
    assert all(getattr(guide, name) is getattr(torchtp, name) for name in guide.__all__)
