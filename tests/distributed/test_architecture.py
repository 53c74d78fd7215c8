"""The package's import structure: no import circles, ``plans/`` independent of ``hf/``.

What counts as an import edge ``a -> b`` (``a`` and ``b`` modules of
``src/distributed``, a package standing for its ``__init__.py``):

* every relative ``from .x import y`` / ``from .. import x`` anywhere in ``a``:
  at module level, inside a function, under ``if TYPE_CHECKING:``. A lazy
  import placed in a function to dodge a circle is still a circle in the
  design (the two modules cannot be understood or moved one without the
  other), and a type-only import is still a dependency of the code's meaning;
* every absolute import of ``torchtp.x``, and every literal module name given
  to ``importlib.import_module`` (relative names resolved against ``a``'s
  package), except the one plug-in loader in ``plans/sources.py``
  (:data:`PLUGIN_LOADER`): ``plans`` loads the HuggingFace plug-in by name the
  first time it plans a model that may be one. That is the plug-in pattern,
  not a dependency: ``hf`` depends on ``plans`` (it registers its family with
  ``plans.sources``); ``plans`` depends only on the registry it owns, and
  works, tested, without ``hf`` (test (c) below).

Not counted: the implicit import of a module's parent packages (importing
``plans.sources`` runs ``plans/__init__.py`` first). A package's
``__init__`` imports its own modules by design, so counting that would make
every package a circle and the test could say nothing.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "distributed"
ROOT = "torchtp"
# The one allowed link from plans/ to hf/: (file, the module name it loads).
PLUGIN_LOADER = ("plans/sources.py", "..hf")
_HF_NAME = re.compile(r"^(\.+hf|torchtp\.hf|src\.distributed\.hf)(\.|$)")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name (``""`` for the root package) -> (path, is a package)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _resolve(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    """The absolute dotted name (without ``torchtp.``) of a relative import in ``module``."""
    base = module.split(".") if module else []
    if not is_pkg:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *(name.split(".") if name else [])])


def _target(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The module of ``name`` (a module, or a name inside one), if it is torchtp's."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name if name in modules else None


def _literal_imports(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    """``importlib.import_module("<literal>", ...)`` calls, with the literal."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                out.append((node.args[0].value, node))
    return out


def import_graph() -> dict[str, set[str]]:
    """Every torchtp module's imports of other torchtp modules (see the module docstring)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text())
        rel = path.relative_to(SRC).as_posix()
        found: set[str | None] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = _resolve(module, is_pkg, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    found.add(sub if sub in modules else _target(base, modules))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{ROOT}."):
                found.add(_target(node.module.removeprefix(f"{ROOT}."), modules))  # type: ignore[union-attr]
            elif isinstance(node, ast.Import):
                found |= {_target(a.name.removeprefix(f"{ROOT}."), modules) for a in node.names
                          if a.name.startswith(f"{ROOT}.")}
        for name, _ in _literal_imports(tree):
            if (rel, name) == PLUGIN_LOADER:
                continue
            if name.startswith("."):
                level = len(name) - len(name.lstrip("."))
                found.add(_target(_resolve(module, is_pkg, level, name.lstrip(".")), modules))
            elif name.startswith(f"{ROOT}."):
                found.add(_target(name.removeprefix(f"{ROOT}."), modules))
        graph[module] = {m for m in found if m is not None and m != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def _shown(circle: list[str], graph: dict[str, set[str]]) -> str:
    members = set(circle)
    return "; ".join(f"{m or ROOT} -> {sorted(graph[m] & members)}" for m in circle)


def test_no_import_circles():
    graph = import_graph()
    circles = import_circles(graph)
    assert not circles, "import circles (module -> the members of its circle it imports):\n" + \
        "\n".join(_shown(c, graph) for c in circles)


def test_every_relative_import_names_a_module():
    # An import of a module that moved would otherwise resolve to its package above.
    modules = _modules()
    missing = []
    for module, (path, is_pkg) in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = _resolve(module, is_pkg, node.level, node.module)
                if base not in modules:
                    missing.append(f"{path.relative_to(SRC)}:{node.lineno}: {base}")
    assert not missing, "relative imports of modules that do not exist:\n" + "\n".join(missing)


def test_the_circle_finder_finds_a_circle_and_its_members():
    # Mutation check of the test above: a circle of three and a self-contained module.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    real = import_graph()
    assert "plans.sources" in real["plans.resolve"]  # module level
    assert "layers.ddp_guard" in real["layers._base"]  # function level counts
    assert "sp.hf_plan" in real["training.options"]  # so does TYPE_CHECKING
    real["plans.sources"].add("plans.resolve")
    assert any({"plans.resolve", "plans.sources"} <= set(c) for c in import_circles(real))


def hf_imports_in_plans() -> list[str]:
    """Every place under ``plans/`` that imports or names a module of ``hf/``, but the loader."""
    found = []
    for path in sorted((SRC / "plans").rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.ImportFrom) and node.level:
                base = _resolve(module, path.name == "__init__.py", node.level, node.module)
                names = [base] if base else [a.name for a in node.names]
                if any(n == "hf" or n.startswith("hf.") for n in names):
                    found.append(f"{rel}:{line}: from {'.' * node.level}{node.module or ''} import")
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names]
                found += [f"{rel}:{line}: import {n}" for n in names if _HF_NAME.match(n)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    _HF_NAME.match(node.value) and (rel, node.value) != PLUGIN_LOADER:
                found.append(f"{rel}:{line}: module name {node.value!r}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_plans_import_nothing_from_hf():
    found = hf_imports_in_plans()
    assert not found, ("plans/ must not import hf/ (register through plans/sources.py "
                       "instead):\n" + "\n".join(found))


def test_the_plugin_loader_is_the_one_named_exception():
    path, name = PLUGIN_LOADER
    tree = ast.parse((SRC / path).read_text())
    names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert name in names, f"{path} no longer loads {name!r}: update PLUGIN_LOADER"
    loads = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
             and getattr(c.func, "attr", "") == "import_module"]
    assert len(loads) == 1, f"{path} must load the plug-in in exactly one place"


def test_the_scan_finds_each_kind_of_hf_import(tmp_path, monkeypatch):
    # Mutation check: each way plans/ could reach hf/ is reported.
    fake = tmp_path / "distributed"
    (fake / "plans").mkdir(parents=True)
    (fake / "hf").mkdir()
    (fake / "plans" / "__init__.py").write_text("")
    (fake / "hf" / "__init__.py").write_text("")
    (fake / "plans" / "a.py").write_text(
        "from ..hf.detect import is_hf_model\n"
        "def f():\n"
        "    from .. import hf\n"
        "    import importlib\n"
        "    importlib.import_module('..hf.builtin', __package__)\n"
        "    return importlib.import_module('torchtp.hf')\n")
    (fake / "plans" / "sources.py").write_text(
        "import importlib\nHF_PLUGIN = '..hf'\n"
        "def load():\n    importlib.import_module(HF_PLUGIN, __package__)\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    found = hf_imports_in_plans()
    assert [f.split(":", 2)[1] for f in found] == ["1", "3", "5", "6"], found
    assert all(f.startswith("plans/a.py") for f in found), found


_MLP_WRAP = """
import sys
import torch
import torchtp

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
wrapped = torchtp.DistributedModelWrapper(model, world_size=1, rank=0)
wrapped(torch.randn(2, 8))
print(sorted(m for m in sys.modules if m == "torchtp.hf" or m.startswith("torchtp.hf.")))
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("transformers", "peft")))
"""


def test_a_plain_model_loads_nothing_from_hf():
    """Wrap + forward of an nn.Sequential MLP imports no torchtp.hf module, nor transformers."""
    out = subprocess.run([sys.executable, "-c", _MLP_WRAP], capture_output=True, text=True,
                         timeout=120, cwd=SRC.parents[1])
    assert out.returncode == 0, out.stderr
    hf_modules, libraries = out.stdout.splitlines()[-2:]
    assert hf_modules == "[]", f"a plain MLP's wrap imported {hf_modules}"
    assert libraries == "[]", f"a plain MLP's wrap imported {libraries}"
