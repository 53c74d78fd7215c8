"""One split rule, one cut, one reduction enum across the TP core and the seed-document cores.

* Split rule: :func:`torchtp.core.layouts.shard_range` is the only function that
  computes which part of a dimension a rank holds (``core/layouts.py``). ``shard.Sharding.offsets``
  (the shard dialect's even split), ``slicing.split_offsets`` (the slicing
  document's ``balance_workload`` on/off) and the sequence shards call it with
  the rule their documents specify (``"balanced"`` or ``"ceil"``).
* Reductions: ``comm.reductions.Reduction`` is the one enum; slicing's
  ``ReduceOperation`` spells its members (``MEAN`` is ``AVERAGE``) and
  ``comm.reductions.torch_op`` is the one map to a ``torch.distributed`` op.

The source scan (:func:`split_rule_sites`) is a heuristic, justified as
follows. Every split rule in torchtp's history (layouts' balanced rule,
``Sharding.offsets``, ``split_offsets``, the sequence shard length) was
written with one of two integer idioms on a size and a rank count: ``divmod``
(balanced: quotient plus remainder) or the negated floor division
``-(-n // parts)`` (ceil). Flagging those idioms when an operand names a rank
count or a size (``world``, ``part``, ``tp``, ``shard``, ``size``) catches a
reintroduced rule of either kind, while index arithmetic on other names
(``divmod(slot, count)`` in the step check's sampler) stays legal.
``core/layouts.py`` is the one file allowed to hold them.
"""

from __future__ import annotations

import ast
import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchtp.comm import ops as _comm
from torchtp.comm import reductions
from torchtp.comm.reductions import TORCH_OPS, Reduction, torch_op
from torchtp.comm.sequence_parallel import shard_length
from torchtp.core import layouts
from torchtp.core.layouts import shard_offsets, shard_range, shard_sizes
from torchtp.shard import Sharding, ops_gather, ops_rooted, shard_bounds
from torchtp.slicing import ReduceOperation, gather, slice_tensor, split_offsets
from torchtp.slicing.types import Concat, reduction_of

SRC = Path(layouts.__file__).resolve().parents[1]
SPLIT_NAMES = ("world", "part", "tp", "shard", "size")


def _names(node: ast.AST) -> str:
    return ast.unparse(node).lower()


def _is_split_operand(node: ast.AST) -> bool:
    return any(name in _names(node) for name in SPLIT_NAMES)


def _split_idiom(node: ast.AST) -> bool:
    """``divmod(a, b)`` or ``-(-a // b)`` with a size or rank-count operand."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "divmod" and len(node.args) == 2:
        return any(_is_split_operand(a) for a in node.args)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
            and isinstance(node.operand, ast.BinOp) and isinstance(node.operand.op, ast.FloorDiv) \
            and isinstance(node.operand.left, ast.UnaryOp) \
            and isinstance(node.operand.left.op, ast.USub):
        return _is_split_operand(node.operand.left.operand) or _is_split_operand(
            node.operand.right)
    return False


def split_rule_sites(source: str, filename: str) -> list[str]:
    """``file:line function`` of every function in ``source`` that computes a split itself."""
    found = []
    for fn in ast.walk(ast.parse(source, filename)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"{filename}:{node.lineno} {fn.name}" for node in ast.walk(fn)
                      if _split_idiom(node)]
    return sorted(set(found))


def test_no_split_rule_outside_layouts():
    sites = []
    for path in sorted(SRC.rglob("*.py")):
        if path == Path(layouts.__file__).resolve():
            continue
        sites += split_rule_sites(path.read_text(), str(path.relative_to(SRC)))
    assert sites == [], ("these functions compute a shard's share themselves; call "
                         f"torchtp.core.layouts.shard_range (with rule=) instead: {sites}")


def test_the_scan_finds_a_reintroduced_split_rule():
    # Mutation check: the two implementations this issue removed, pasted back.
    balanced = ("def split_offsets(size, parts):\n"
                "    q, r = divmod(size, parts)\n"
                "    return [q + (i < r) for i in range(parts)]\n")
    ceil = "def shard_length(length, world_size):\n    return -(-length // world_size)\n"
    assert split_rule_sites(balanced, "m.py") == ["m.py:2 split_offsets"]
    assert split_rule_sites(ceil, "m.py") == ["m.py:2 shard_length"]
    # Index arithmetic on other names is not a split rule, and layouts.py itself is one.
    assert split_rule_sites("def f(slot, count):\n    return divmod(slot, count)\n", "m.py") == []
    assert split_rule_sites(Path(layouts.__file__).read_text(), "layouts.py") != []


def test_shard_range_rules_match_torch_oracles():
    for n in range(41):
        for parts in range(1, 9):
            balanced = [len(c) for c in torch.arange(n).tensor_split(parts)]
            chunked = [len(c) for c in torch.arange(n).chunk(parts)] if n else []
            chunked += [0] * (parts - len(chunked))
            assert shard_sizes(n, parts) == balanced, (n, parts)
            assert shard_sizes(n, parts, "ceil") == chunked, (n, parts)
            for rule in ("balanced", "ceil"):
                offs = shard_offsets(n, parts, rule)
                assert offs == [0, *[sum(shard_sizes(n, parts, rule)[:i + 1])
                                     for i in range(parts)]]
                assert [shard_range(n, parts, i, 3, rule) for i in range(parts)] == [
                    (3 * a, 3 * (b - a)) for a, b in itertools.pairwise(offs)]
    with pytest.raises(ValueError, match=r"split rule='chunk' is not supported"):
        shard_range(4, 2, 0, rule="chunk")  # type: ignore[arg-type]


def test_seed_spellings_agree_with_shard_range():
    for n in range(41):
        for parts in range(1, 9):
            # slicing: balance_workload=True is the balanced rule, False the ceil rule.
            assert split_offsets(n, parts) == shard_offsets(n, parts)
            assert split_offsets(n, parts, balance=False) == shard_offsets(n, parts, "ceil")
            # sequence parallel: every rank holds ceil(n / parts) tokens (padded).
            assert shard_length(n, parts) == math.ceil(n / parts)
            # shard dialect: without sharded_dims_offsets a dim must split evenly.
            sharding = Sharding([[0]])
            if n % parts:
                with pytest.raises(ValueError, match=r"does not split evenly"):
                    sharding.offsets(0, n, (parts,))
                continue
            assert sharding.offsets(0, n, (parts,)) == shard_offsets(n, parts)
            for i in range(parts):
                start, length = shard_range(n, parts, i)
                assert shard_bounds((n,), sharding, i, (parts,)) == [(start, start + length)]


def test_one_reduction_enum():
    assert ReduceOperation.MEAN is Reduction.AVERAGE
    for name in ("SUM", "MAX", "MIN"):
        assert getattr(ReduceOperation, name) is Reduction[name]
    assert reduction_of(ReduceOperation.CONCAT) is None
    assert isinstance(ReduceOperation.CONCAT, Concat) and not isinstance(ReduceOperation.CONCAT,
                                                                         Reduction)
    assert ReduceOperation.parse("mean") is Reduction.AVERAGE
    assert ReduceOperation.parse(Reduction.AVERAGE) is Reduction.AVERAGE
    with pytest.raises(ValueError, match=r"unknown reduce_op 'average'; use one of CONCAT, SUM, "
                                         r"MEAN, MAX, MIN"):
        ReduceOperation.parse("average")  # the seed's string is "mean"
    with pytest.raises(ValueError, match=r"unknown reduce_op"):
        ReduceOperation.parse(Reduction.PRODUCT)  # not a slicing gather
    with pytest.raises(ValueError, match=r"MEAN needs slices of one shape"):
        gather(slice_tensor(torch.zeros(5, 2), "row", 2), ReduceOperation.MEAN)


def test_each_reduction_maps_to_one_torch_op_everywhere():
    expected = {Reduction.SUM: dist.ReduceOp.SUM, Reduction.MAX: dist.ReduceOp.MAX,
                Reduction.MIN: dist.ReduceOp.MIN, Reduction.PRODUCT: dist.ReduceOp.PRODUCT,
                Reduction.AVERAGE: dist.ReduceOp.SUM}  # average sums; callers divide
    for red, op in expected.items():
        assert torch_op(red) == op and torch_op(red.value) == op and TORCH_OPS[red] == op
    assert torch_op(ReduceOperation.MEAN) == dist.ReduceOp.SUM
    with pytest.raises(ValueError, match=r"reduction='mean' is not supported"):
        torch_op("mean")
    # The TP collectives and the shard dialect use that one function.
    for module in (_comm, ops_gather, ops_rooted):
        assert module.torch_op is reductions.torch_op, module.__name__


def test_no_torch_reduce_op_chosen_outside_reductions():
    """Only comm/reductions.py names ``ReduceOp`` members; everything else asks ``torch_op``.

    ``integrations/transformers.py`` averages DP gradients with torch's own
    ``ReduceOp.AVG`` (a DDP-style average, not a torchtp ``Reduction``).
    """
    allowed = {"comm/reductions.py", "integrations/transformers.py"}
    sites = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "ReduceOp":
                sites.append(f"{rel}:{node.lineno}")
    assert sites == [], f"map reductions through torchtp.comm.reductions.torch_op: {sites}"
