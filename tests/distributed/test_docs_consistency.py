"""What the docs state about the code, checked against the code where that is checkable.

* Every signature the docs quote (``name(arg, key=default)`` in a heading, a
  table cell or a plain code block) names a real torchtp callable, its
  parameters exist, and each quoted default equals ``inspect.signature``'s.
* Every repository file the docs, README and source strings cite exists.
* Behaviour the API reference states in words: ``backend="nccl"`` without CUDA.

Python examples in the docs are run by ``test_docs_examples.py``.
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import torchtp
import torchtp.comm.regions
import torchtp.comm.runtime
import torchtp.shard
import torchtp.signal
import torchtp.slicing

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAMESPACES = [torchtp, torchtp.comm.regions, torchtp.shard, torchtp.signal, torchtp.slicing]
# Where the docs state a signature (not an example call): a heading, a table's
# first cell, or a plain (language-less) code block holding only the signature.
_CALL = r"(?P<name>[A-Za-z_][\w.]*)\((?P<args>[^()`]*(?:\([^()`]*\)[^()`]*)*)\)(?: -> [^`\n]*)?"
SIGNATURE = re.compile(rf"^#+ `{_CALL}`$|^\| `{_CALL.replace('?P<', '?P<t_')}` \||"
                       rf"^```\n{_CALL.replace('?P<', '?P<b_')}\n```$", re.M)
_MISSING = object()


def _resolve(name: str, page: Path) -> Any:
    """The torchtp callable ``name`` refers to on ``page``, or ``None`` (not torchtp's)."""
    if name.startswith("torch."):
        return None  # torch's own API (torch.compile), not torchtp's
    parts = name.removeprefix("torchtp.").split(".")
    own = getattr(torchtp, page.stem, None)  # shard.md documents torchtp.shard first
    for space in ([own] if own in NAMESPACES else []) + NAMESPACES:
        obj: Any = space
        for part in parts:
            obj = getattr(obj, part, _MISSING)
            if obj is _MISSING:
                break
        if obj is not _MISSING and callable(obj):
            return obj
    return None


def _split_args(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def documented_signatures() -> list[tuple[Path, str, str, str]]:
    """(page, page:line, name, args) for every quoted call signature of a torchtp callable."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in SIGNATURE.finditer(text):
            groups = {k.removeprefix("t_").removeprefix("b_"): v for k, v in m.groupdict().items()
                      if v is not None}
            if _resolve(groups["name"], page) is None:
                continue
            line = text.count("\n", 0, m.start()) + 1
            found.append((page, f"{page.relative_to(ROOT)}:{line}", groups["name"], groups["args"]))
    return found


def test_documented_defaults_match_the_code() -> None:
    sigs = documented_signatures()
    assert len(sigs) >= 10, sigs  # the scan finds the API reference's signatures
    problems = []
    for page, where, name, args in sigs:
        target = _resolve(name, page)
        params = inspect.signature(target).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for arg in _split_args(args):
            key, eq, value = arg.partition("=")
            key = key.strip().lstrip("*")
            if not eq or (key not in params and takes_kwargs):
                continue  # positional names in the docs may be shorthand (`t` for `tensor`)
            if key not in params:
                problems.append(f"{where}: {name} has no parameter {key!r} (has {list(params)})")
                continue
            try:
                stated = ast.literal_eval(value.strip())
            except ValueError:
                continue  # a symbolic default such as `Replicate()`: not a literal to compare
            actual = params[key].default
            if actual is inspect.Parameter.empty or actual != stated:
                problems.append(f"{where}: {name}({key}={value.strip()}) but the code's default "
                                f"is {actual!r}")
    assert not problems, "\n".join(problems)


def test_default_scan_catches_a_wrong_default() -> None:
    params = inspect.signature(torchtp.init_tensor_parallel).parameters
    assert params["backend"].default is None
    stated = ast.literal_eval("'gloo'")
    assert stated != params["backend"].default  # what the check above compares


CITED = re.compile(r"(?<![\w/.-])((?:docs|benchmarks|src|tests|launch|\.ci)/[\w./-]+"
                   r"\.(?:md|py|yaml|yml|json|txt)|[A-Z][A-Z_]+\.md)\b")


def _cited_files() -> list[tuple[str, str]]:
    sources = [*PAGES, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "src").rglob("*.py")),
               *sorted((ROOT / "benchmarks").glob("*.py"))]
    return [(f"{path.relative_to(ROOT)}", m.group(1)) for path in sources
            for m in CITED.finditer(path.read_text())]


def test_cited_repository_files_exist() -> None:
    cited = _cited_files()
    assert any(name == "benchmarks/costmodel_validate.py" for _, name in cited)
    missing = sorted({f"{where} cites {name}" for where, name in cited
                      if not ((ROOT / name).exists() or (ROOT / "docs" / name).exists())})
    assert not missing, missing


def test_nccl_without_cuda_falls_back_to_gloo_as_documented(monkeypatch, caplog) -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    assert '`"nccl"` without CUDA falls back to `"gloo"`' in api
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="torchtp"):
        assert torchtp.comm.runtime._pick_backend("nccl") == "gloo"
    assert "CUDA is not available: using 'gloo'" in caplog.text
    with pytest.raises(ValueError, match="unknown backend 'ncc'"):
        torchtp.comm.runtime._pick_backend("ncc")


# `name>=1.2` written in prose or a table: the bounds pyproject.toml declares.
DECLARED = re.compile(r"`(?P<name>[A-Za-z][\w.-]*)>=(?P<version>\d[\w.]*)`")


def _declared_bounds() -> dict[str, str]:
    """Each requirement's lower bound in pyproject.toml's ``"name>=X..."`` strings
    (a regex, not tomllib: the package supports Python 3.10)."""
    project = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[0]
    return {m.group(1).lower(): m.group(2)
            for m in re.finditer(r'"([A-Za-z][\w.-]*)>=(\d[\w.]*)', project)}


def _stated_bounds(text: str) -> list[tuple[str, str]]:
    return [(m.group("name").lower(), m.group("version")) for m in DECLARED.finditer(text)]


def test_stated_version_bounds_match_pyproject() -> None:
    """README/compat.md quote `torch>=X` etc.: X must be what pyproject.toml declares."""
    declared = _declared_bounds()
    assert declared["torch"] and declared["transformers"]
    wrong = [f"{page.name} says {name}>={version}, pyproject.toml declares {name}>={declared[name]}"
             for page in (ROOT / "README.md", ROOT / "docs" / "compat.md")
             for name, version in _stated_bounds(page.read_text())
             if name in declared and declared[name] != version]
    assert not wrong, wrong
    readme = (ROOT / "README.md").read_text()
    assert any(name == "torch" for name, _ in _stated_bounds(readme)), "README names no torch bound"


def test_version_drift_check_catches_a_stale_bound() -> None:
    declared = _declared_bounds()
    stale = "The only hard dependency is `torch>=2.4`."
    assert [(n, v) for n, v in _stated_bounds(stale) if declared[n] != v] == [("torch", "2.4")]


def test_readme_install_line_installs_what_make_installs() -> None:
    extras = re.search(r'-e "\.\[(?P<extras>[^\]]+)\]"', (ROOT / "Makefile").read_text())
    assert extras is not None
    assert f'-e ".[{extras.group("extras")}]"' in (ROOT / "README.md").read_text()


# The dependencies a user installs (the hard one and the framework extras): the
# README must state each one's lower bound, equal to pyproject.toml's.
USER_DEPENDENCIES = ("torch", "transformers", "accelerate", "peft", "lightning")


def readme_bound_problems(readme: str, declared: dict[str, str]) -> list[str]:
    """Each user-facing dependency the README states no bound for, or a different one."""
    stated: dict[str, set[str]] = {}
    for name, version in _stated_bounds(readme):
        stated.setdefault(name, set()).add(version)
    problems = []
    for name in USER_DEPENDENCIES:
        if name not in stated:
            problems.append(f"README states no `{name}>=` bound (pyproject.toml: {name}>={declared[name]})")
        elif stated[name] != {declared[name]}:
            problems.append(f"README states {name}>={sorted(stated[name])}, pyproject.toml declares "
                            f"{name}>={declared[name]}")
    return problems


def test_readme_states_every_dependency_bound_as_pyproject_declares() -> None:
    declared = _declared_bounds()
    assert set(USER_DEPENDENCIES) <= set(declared), sorted(declared)
    assert not readme_bound_problems((ROOT / "README.md").read_text(), declared)
    wrong = [f"{page.name} says {name}>={version}, pyproject.toml declares {name}>={declared[name]}"
             for page in PAGES if page.name != "decisions.md"  # history quotes the old bounds
             for name, version in _stated_bounds(page.read_text())
             if name in declared and declared[name] != version]
    assert not wrong, wrong


def test_readme_bound_check_catches_a_missing_or_stale_bound() -> None:
    declared = _declared_bounds()
    readme = (ROOT / "README.md").read_text()
    assert readme_bound_problems(readme.replace("`peft>=", "`peft=="), declared) == [
        f"README states no `peft>=` bound (pyproject.toml: peft>={declared['peft']})"]
    stale = readme.replace(f"`lightning>={declared['lightning']}`", "`lightning>=2.0`")
    assert readme_bound_problems(stale, declared) == [
        f"README states lightning>=['2.0'], pyproject.toml declares lightning>={declared['lightning']}"]


def _ci_command() -> str:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")][-1]


def test_readme_test_command_is_what_ci_runs() -> None:
    stated = re.search(r"`([^`]+)` is the test command", (ROOT / "README.md").read_text())
    assert stated is not None, "README names no test command"
    assert stated.group(1) == _ci_command(), (stated.group(1), _ci_command())
    target = stated.group(1).removeprefix("make ")
    assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M)


def test_license_is_an_spdx_string_with_its_files_and_a_backend_that_reads_it() -> None:
    """setuptools deprecates the table form of ``project.license`` (removed 2027-02-18);
    PEP 639's SPDX string and ``license-files`` need setuptools >= 77."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert isinstance(project["license"], str) and re.fullmatch(r"[\w.-]+( (AND|OR) [\w.-]+)*",
                                                                project["license"])
    assert project["license-files"] and all((ROOT / f).is_file() for f in project["license-files"])
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))
    setuptools = [r for r in pyproject["build-system"]["requires"] if r.startswith("setuptools")]
    bound = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools[0])
    assert bound is not None and int(bound.group(1)) >= 77, setuptools


def test_the_compat_smoke_names_tests_that_exist() -> None:
    """``make test`` ends with the compat smoke run, which names single tests by id: a test
    renamed or newly parametrized would fail CI only there, after the whole suite."""
    import subprocess
    import sys

    makefile = (ROOT / "Makefile").read_text()
    block = re.search(r"^COMPAT_SMOKE \?= (.*?)\n\n", makefile, re.S | re.M)
    assert block is not None
    plans = re.search(r"^HF_PLANS := (\S+)", makefile, re.M)
    assert plans is not None
    ids = [t.strip('"').replace("$(HF_PLANS)", plans.group(1))
           for t in block.group(1).replace("\\\n", " ").split()]
    assert len(ids) > 3
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *ids], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
