"""Automatic plan for plain models: Linear -> elementwise -> Linear chains.

Inside every ``nn.Sequential`` a Linear followed (through elementwise modules
only) by a Linear whose input is its output becomes a ``colwise`` ->
``rowwise`` pair: the hidden activations stay sharded and one all-reduce per
pair restores the output. Any other Linear is split with its output gathered
(``colwise_gather_output``), or its input split (``rowwise_split_input``), or
kept whole when neither dimension divides.
"""

from __future__ import annotations

from torch import nn

from .resolved import Rules

# Modules that act on each element independently, so they commute with a
# split of the feature dimension. Dropout in training mode also does, but its
# mask then differs from the unsharded model's (see docs/concepts.md).
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU,
    nn.ELU, nn.SELU, nn.CELU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
    nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.Dropout, nn.AlphaDropout,
)


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of Linear modules whose weight is also registered elsewhere (tied).

    Duplicates are kept, so a module shared by two parents counts as tied too.
    """
    owners: dict[int, list[nn.Module]] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mod)
    return {id(m) for mods in owners.values() if len(mods) > 1 for m in mods}


def _pairs_in(seq: nn.Sequential, prefix: str, world_size: int,
              tied: set[int]) -> list[tuple[str, str]]:
    """(colwise name, rowwise name) pairs found in one Sequential; tied Linears never pair."""
    children = list(seq.named_children())
    pairs, i = [], 0
    while i < len(children):
        name, mod = children[i]
        j = i + 1
        while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
            j += 1
        nxt = children[j][1] if j < len(children) else None
        if (isinstance(mod, nn.Linear) and isinstance(nxt, nn.Linear)
                and id(mod) not in tied and id(nxt) not in tied
                and nxt.in_features == mod.out_features and mod.out_features % world_size == 0):
            pairs.append((prefix + name, prefix + children[j][0]))
            i = j + 1
        else:
            i += 1
    return pairs


def sequential_plan(model: nn.Module, world_size: int) -> Rules:
    """Build the automatic plan for a plain model at ``world_size``."""
    rules: dict[str, str] = {}
    plan = Rules("auto: nn.Sequential chains", rules)
    tied = _shared_weights(model)
    paired: dict[str, str] = {}
    for seq_name, mod in model.named_modules():
        if isinstance(mod, nn.Sequential):
            for a, b in _pairs_in(mod, f"{seq_name}." if seq_name else "", world_size, tied):
                paired[a], paired[b] = "colwise", "rowwise"
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if id(mod) in tied:
            style = "replicate"
            plan.notes.append(f"'{name}' kept replicated: its weight is shared with another module")
        elif name in paired:
            style = paired[name]
        elif mod.out_features % world_size == 0:
            style = "colwise_gather_output"
            plan.notes.append(f"'{name}' has no partner Linear: split out_features and gather "
                              "its output (one all-gather)")
        elif mod.in_features % world_size == 0:
            style = "rowwise_split_input"
            plan.notes.append(f"'{name}' has no partner Linear: split in_features and reduce "
                              "its output (one all-reduce)")
        else:
            style = "replicate"
            plan.notes.append(f"'{name}' kept replicated: neither out_features="
                              f"{mod.out_features} nor in_features={mod.in_features} is "
                              f"divisible by world_size={world_size}")
        rules[name] = style
    return plan
