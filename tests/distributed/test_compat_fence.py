"""Private names of other libraries are used only in the compatibility modules (an allowlist).

An AST scan of ``src/distributed``: outside ``core/torch_compat.py`` and
``hf/compat.py`` (the fence) no code may read or write an attribute whose
name starts with one underscore unless torchtp itself defines that name,
import a private module of another library, or touch the undocumented
internals listed in ``INTERNALS``. On a name bound from another library
(``import torch.distributed as dist``, ``from torch import nn``), a private
attribute is flagged even where torchtp has a name alike. This is an
allowlist: a private name nobody listed fails, whichever library it is from.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
import transformers
from torch import nn

from torchtp.core import torch_compat as _torch_compat
from torchtp.hf import compat as hf_compat

SRC = Path(__file__).resolve().parents[2] / "src" / "distributed"
FENCE = {SRC / "core/torch_compat.py", SRC / "hf" / "compat.py"}
FOREIGN_ROOTS = {"torch", "transformers", "accelerate", "safetensors", "huggingface_hub", "peft",
                 "lightning", "pytorch_lightning", "numpy", "yaml", "tqdm"}
# Undocumented internals without a leading underscore.
INTERNALS = {"dummy_inputs", "num_key_value_groups", "next_functions", "metadata", "tp_plan"}
# Public API that starts with an underscore (``os._exit``, namedtuple's methods).
PUBLIC_UNDERSCORE = {"_exit", "_asdict", "_replace", "_fields", "_make"}
_PRIVATE = re.compile(r"^_[A-Za-z]\w*$")


def _is_private(name: str) -> bool:
    return bool(_PRIVATE.match(name)) and not name.endswith("__")


def _foreign_private_names() -> set[str]:
    """Private attribute names carried by the torch/transformers objects torchtp handles."""
    objects: list[object] = [
        nn.Module(), nn.Linear(2, 2), nn.Embedding(2, 2), nn.Parameter(torch.ones(1)), torch.ones(1),
        torch, torch.distributed, torch.autograd, torch.autograd.graph.Node,
        (torch.ones(1, requires_grad=True) * 2).grad_fn,
        transformers, transformers.PreTrainedModel, transformers.PretrainedConfig,
        transformers.AutoModel, transformers.AutoModelForCausalLM, transformers.AutoConfig,
    ]
    return {n for obj in objects for n in dir(obj) if _is_private(n)}


FOREIGN = _foreign_private_names()
# Private names of the objects torchtp rewrites: flagged even where torchtp has a name alike.
MODULE_PRIVATE = {n for obj in [nn.Module(), transformers.PreTrainedModel, transformers.PretrainedConfig,
                                transformers.AutoModelForCausalLM,
                                (torch.ones(1, requires_grad=True) * 2).grad_fn]
                  for n in dir(obj) if _is_private(n)} - {"_apply"}  # torchtp's wrapper._apply
# The ones torchtp has used, whichever version is installed.
MODULE_PRIVATE |= {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_tp_plan",
                   "_from_config", "_model_mapping"}


def _own_private_names(trees: list[ast.Module], files: list[Path]) -> set[str]:
    """Private names torchtp defines: modules, functions, classes, variables, own attributes."""
    own = {p.stem for p in files if _is_private(p.stem)}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                # Attributes set on our own objects, or tagged ``_torchtp*`` on foreign ones.
                base = node.value
                if (isinstance(base, ast.Name) and base.id in ("self", "cls")) or \
                        node.attr.startswith("_torchtp"):
                    own.add(node.attr)
            elif isinstance(node, ast.Call) and _call_name(node) == "__setattr__" and \
                    len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                own.add(str(node.args[1].value))  # object.__setattr__(self, "_x", ...)
    return {n for n in own if _is_private(n)}


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _foreign_aliases(tree: ast.Module) -> set[str]:
    """Names a module binds to another library's modules or objects (``dist``, ``nn``, ``F``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN_ROOTS:
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                node.module.split(".")[0] in FOREIGN_ROOTS:
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(source: str, own: set[str]) -> list[str]:
    """Uses of other libraries' private names or internals in ``source`` (one line each)."""
    found: list[str] = []
    tree = ast.parse(source)
    aliases = _foreign_aliases(tree)

    def bad(name: str) -> bool:
        return name in INTERNALS or name in MODULE_PRIVATE or (
            _is_private(name) and name not in own and name not in PUBLIC_UNDERSCORE)

    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and (bad(node.attr) or (
                _is_private(node.attr) and node.attr not in PUBLIC_UNDERSCORE
                and _root(node.value) in aliases)):
            found.append(f"{line}: attribute .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value in MODULE_PRIVATE:
            found.append(f"{line}: string {node.value!r}")
        elif isinstance(node, ast.Call) and _call_name(node) in ("getattr", "hasattr", "setattr",
                                                                   "delattr") and \
                len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str) and (bad(node.args[1].value) or (
                    _is_private(node.args[1].value) and _root(node.args[0]) in aliases
                    and not node.args[1].value.startswith("_torchtp"))):  # torchtp's own tag
            found.append(f"{line}: {_call_name(node)}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: torchtp's own modules
            paths = [module] if module else [a.name for a in node.names]
            for path in paths:
                parts = path.split(".")
                if parts[0] in FOREIGN_ROOTS and any(_is_private(p) for p in parts):
                    found.append(f"{line}: import {path}")
            if module.split(".")[0] in FOREIGN_ROOTS:
                found += [f"{line}: from {module} import {a.name}" for a in node.names
                          if _is_private(a.name)]
    return found


def _sources() -> tuple[list[Path], list[ast.Module]]:
    files = sorted(SRC.rglob("*.py"))
    return files, [ast.parse(p.read_text()) for p in files]


def test_no_private_torch_or_transformers_name_outside_the_compat_modules() -> None:
    files, trees = _sources()
    own = _own_private_names(trees, files)
    report = {str(p.relative_to(SRC)): v for p in files if p not in FENCE
              for v in [violations(p.read_text(), own)] if v}
    assert not report, ("private torch/transformers names used outside core/torch_compat.py and "
                        f"hf/compat.py; add a function there instead: {report}")


def test_the_scan_finds_each_kind_of_use() -> None:
    files, trees = _sources()
    own = _own_private_names(trees, files)
    # Each known kind of private use, as it appeared before the fence.
    for snippet in [
        "m._parameters['w'] = t",
        "for k, b in m._buffers.items(): pass",
        "x = m._non_persistent_buffers_set",
        "plan = getattr(model, '_tp_plan', None)",
        "cls._from_config(config)",
        "ok = type(c) in transformers.AutoModelForCausalLM._model_mapping",
        "base = self.__dict__['_modules']",
        "d = model.dummy_inputs",
        "module.num_key_value_groups = 2",
        "node.metadata.get('k')",
        "stack.extend(getattr(node, 'next_functions', ()))",
        "from torch.distributed._tensor import DTensor",
        "import torch._dynamo",
        "from torch.distributed.tensor.parallel.style import _prepare_input_fn",
        "y = torch._C._nn.linear(x, w)",
    ]:
        assert violations(snippet, own), snippet
    # torchtp's own private names and public torch API pass.
    for snippet in ["from ._comm import split", "health._hold(st, ())", "os._exit(1)",
                    "self._name()", "from torch.distributed.tensor import DTensor",
                    "m.register_buffer('b', t, persistent=False)"]:
        assert not violations(snippet, own), snippet
    # The fenced modules themselves would fail the scan anywhere else.
    for path in FENCE:
        assert violations(path.read_text(), own), path


def test_an_unlisted_private_name_of_any_library_fails() -> None:
    """Allowlist, not denylist: private names nobody sampled or listed are caught too."""
    files, trees = _sources()
    own = _own_private_names(trees, files)
    runtime = (SRC / "comm" / "runtime.py").read_text()
    probe = runtime.replace(
        "def tp_group() -> ProcessGroup | None:\n",
        "def tp_group() -> ProcessGroup | None:\n    dist.distributed_c10d._get_default_group()\n")
    assert probe != runtime
    assert violations(probe, own) == [f"{_line_of(probe, '_get_default_group')}: "
                                      "attribute ._get_default_group"]
    assert not violations(runtime, own)
    for snippet in ["acc._dataloaders.append(dl)", "getattr(dl, '_is_accelerate_prepared', False)",
                    "trainer._is_accelerate_prepared", "layer._cast_input_dtype(x, dtype)",
                    "torch._dynamo.config.x = 1", "from torch.distributed._tensor import X",
                    "getattr(m, '_tp_plan')", "model._modules",
                    "import torch.distributed as dist\ndist._apply = 1",
                    "import torch.distributed as dist\ngetattr(dist, '_apply')",
                    "from torch import nn\nsetattr(nn.Module, '_apply', f)"]:
        assert violations(snippet, own), snippet


def _fence_declared() -> set[str]:
    """Private names a fence module declares (string constants such as ``TRAINER_HOOKS``)."""
    return {node.value for path in FENCE for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and _is_private(node.value)}


def _foreign_bases(tree: ast.Module, node: ast.ClassDef) -> list[type]:
    """The classes of other libraries ``node`` subclasses (resolved by importing them)."""
    bound: dict[str, tuple[str, str | None]] = {}
    for imp in ast.walk(tree):
        if isinstance(imp, ast.Import):
            for a in imp.names:
                bound[a.asname or a.name.split(".")[0]] = (a.name if a.asname else
                                                         a.name.split(".")[0], None)
        elif isinstance(imp, ast.ImportFrom) and not imp.level and imp.module:
            for a in imp.names:
                bound[a.asname or a.name] = (imp.module, a.name)
    found = []
    for base in node.bases:
        chain = []
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in bound or \
                bound[base.id][0].split(".")[0] not in FOREIGN_ROOTS:
            continue
        module, attr = bound[base.id]
        obj: object = importlib.import_module(module)
        for part in ([attr] if attr else []) + chain:
            nxt = getattr(obj, part, None)
            if nxt is None and isinstance(obj, ModuleType):  # a submodule not yet imported
                nxt = importlib.import_module(f"{obj.__name__}.{part}")
            obj = nxt
        if isinstance(obj, type):
            found.append(obj)
    return found


def overrides(source: str, declared: set[str]) -> list[str]:
    """Private methods of other libraries' classes that ``source`` overrides undeclared.

    A subclass method named like its foreign base's private method depends on
    that internal as much as a call does: the fence must list it (next to the
    check that the installed version still has it).
    """
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = _foreign_bases(tree, node)
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    _is_private(item.name) and item.name not in declared and \
                    any(hasattr(b, item.name) for b in bases):
                found.append(f"{item.lineno}: {node.name}.{item.name} overrides a private method")
    return found


def test_overridden_private_methods_of_other_libraries_are_declared_in_the_fence() -> None:
    declared = _fence_declared()
    report = {str(p.relative_to(SRC)): v for p in sorted(SRC.rglob("*.py")) if p not in FENCE
              for v in [overrides(p.read_text(), declared)] if v}
    assert not report, f"declare these in hf/compat.py with the versions checked: {report}"
    probe = "from torch import nn\nclass M(nn.Module):\n    def _apply(self, fn): return fn\n"
    assert overrides(probe, declared) == ["3: M._apply overrides a private method"]
    assert not overrides(probe.replace("_apply", "_own_helper"), declared)
    assert hf_compat.missing_lora_layer_hooks(__import__("peft").tuners.lora.Linear) == []


def test_every_peft_module_that_expands_all_linear_is_hooked() -> None:
    # A module calling PEFT's "all-linear" expansion through its own name for it escapes a
    # hook on the defining module: there "all-linear" would leave torchtp's layers out, as
    # PEFT's MoE conversion for transformers v5 once did. A release adding one fails here.
    import peft

    root = Path(peft.__file__).parent
    holders = {".".join(("peft", *p.relative_to(root).with_suffix("").parts))
               for p in root.rglob("*.py") if hf_compat.PEFT_ALL_LINEAR in p.read_text()}
    assert holders == set(hf_compat.PEFT_ALL_LINEAR_MODULES), holders


def _line_of(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def test_every_compat_entry_names_the_versions_it_was_checked_against() -> None:
    for module, versions in [(_torch_compat, _torch_compat.CHECKED_TORCH),
                             (hf_compat, hf_compat.CHECKED_TRANSFORMERS)]:
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ != module.__name__ or name.startswith("_"):
                continue
            doc = inspect.getdoc(fn) or ""
            checked = re.search(r"Checked: (torch|transformers|peft|accelerate) ([^\n]+)", doc)
            assert checked, f"{module.__name__}.{name} does not say which versions it was checked against"
            listed = re.findall(r"\d+\.\d+\.\d+", checked.group(2))
            known = {"peft": hf_compat.CHECKED_PEFT,
                     "accelerate": hf_compat.CHECKED_ACCELERATE}.get(checked.group(1), versions)
            assert listed and set(listed) <= set(known), (name, listed, known)


def test_declared_lower_bounds_are_the_versions_make_compat_runs() -> None:
    root = SRC.parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    makefile = (root / "Makefile").read_text()
    old_tf = re.search(r"^COMPAT_OLD_TRANSFORMERS \?= (\S+)$", makefile, re.M)
    assert old_tf and old_tf.group(1) == hf_compat.MIN_TRANSFORMERS
    major_minor = ".".join(hf_compat.MIN_TRANSFORMERS.split(".")[:2])
    assert f'"transformers>={major_minor}"' in pyproject
    # The old venv reuses the main venv's torch: constraints.txt's pin is the oldest torch.
    torch_pin = re.search(r"^torch==(\S+)$", (root / "constraints.txt").read_text(), re.M)
    assert torch_pin and torch_pin.group(1) in _torch_compat.CHECKED_TORCH
    assert f'"torch>={".".join(torch_pin.group(1).split(".")[:2])}"' in pyproject


def test_older_transformers_is_refused_with_the_fix() -> None:
    from types import SimpleNamespace

    with pytest.raises(RuntimeError, match=r"needs transformers>=5\.3\.0 .* found 5\.2\.0: .*"
                                           r"pip install 'transformers>=5\.3\.0'"):
        hf_compat.require_supported_transformers(SimpleNamespace(__version__="5.2.0"))
    hf_compat.require_supported_transformers(SimpleNamespace(__version__="5.3.0"))
    hf_compat.require_supported_transformers(transformers)  # the installed one is supported


def test_every_compat_smoke_test_exists() -> None:
    # make test ends with the compat smoke run; a renamed test would fail it only there.
    root = SRC.parents[1]
    makefile = (root / "Makefile").read_text()
    block = makefile.split("COMPAT_SMOKE ?=", 1)[1].split("\n\n", 1)[0]
    hf_plans = re.search(r"^HF_PLANS := (\S+)$", makefile, re.M)
    assert hf_plans
    block = block.replace("$(HF_PLANS)", hf_plans.group(1))
    ids = [w.strip('"\\') for w in block.split() if w.strip('"\\').startswith("tests/")]
    assert len(ids) >= 5, ids
    for test_id in ids:
        path, _, name = test_id.partition("::")
        source = (root / path).read_text()
        if name:
            assert f"def {name.split('[')[0]}(" in source, f"{test_id} is not a test any more"
