"""Cost of torchtp's DDP watch: torch's global module-registration hook.

After the first wrap with tp > 1, torchtp has torch call one hook on every
``parent.child = module`` in the process (``ddp_guard.install``). It compares
the attribute name with ``"module"`` and, only then, the parent's type with
``DistributedDataParallel``. This measures, in one process and without a
process group (the hook is installed directly):

* the hook itself, called directly: for any attribute name, and for the
  name ``"module"`` on a parent that is not a DDP (the type check too);
* one submodule assignment (``parent.child = module``), before and after;
* building a small Llama (``LlamaForCausalLM``, 2 layers: 32 registrations),
  before and after;
* the check of the forward pre-hook ``ddp_guard.guard`` puts on a wrapped
  model (is a DDP built before wrapping running it?), called directly from a
  forward: without DDP, and inside a one-process Gloo DDP's forward (after
  its first, parameter-walking check).

The fastest of 15 repetitions (the least disturbed by other processes on a
shared machine), on whatever machine runs it (say which).

    .venv/bin/python benchmarks/ddp_guard.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import nn

from torchtp.core import torch_compat as _torch_compat
from torchtp.layers import ddp_guard

REPEATS = 15


def _best_s(fn: Callable[[], object], calls: int) -> float:
    """The fastest of REPEATS timings of ``calls`` calls, per call, in seconds."""
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def _setattr_cost() -> float:
    parent, child = nn.Module(), nn.Linear(2, 2)

    def assign() -> None:
        parent.child = child

    return _best_s(assign, 20_000)


def _hook_cost(name: str) -> float:
    parent, child = nn.Module(), nn.Linear(2, 2)
    hook = _torch_compat.on_module_registration
    return _best_s(lambda: hook(parent, name, child), 100_000)


def _empty_call_cost() -> float:
    parent, child = nn.Module(), nn.Linear(2, 2)

    def nothing(_parent: nn.Module, _name: str, _child: nn.Module) -> None:
        return None

    return _best_s(lambda: nothing(parent, "child", child), 100_000)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)


def _llama_cost() -> float:
    return _best_s(_llama, 5)


def _registrations_per_llama() -> int:
    from torch.nn.modules.module import register_module_module_registration_hook

    seen: list[str] = []
    handle = register_module_module_registration_hook(lambda _p, name, _c: seen.append(name))
    try:
        _llama()
    finally:
        handle.remove()
    return len(seen)


class _Probe(nn.Module):
    """Times the pre-hook's check from inside a forward (so inside DDP's when wrapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.per_call_s = 0.0

    def forward(self, x: object) -> object:
        check = ddp_guard._check_active_ddp
        check(self.inner, ())  # the first check of this (DDP, model) pair walks parameters
        self.per_call_s = _best_s(lambda: check(self.inner, ()), 20_000)
        return self.inner(x)


def _forward_rows() -> list[str]:
    """The pre-hook's check per forward: no DDP running, and inside a 1-process Gloo DDP."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        x, rows = torch.randn(1, 8), []
        for label, probe in (("no DDP running", _Probe()), ("inside DDP's forward", None)):
            if probe is None:
                probe = _Probe()
                DDP(probe)(x)
            else:
                probe(x)
            rows.append(f"| the forward pre-hook, {label} | - | {probe.per_call_s * 1e9:.0f} ns "
                        f"| {probe.per_call_s * 1e9:.0f} ns |")
        return rows
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Print a markdown table: before the hook, after, and the difference."""
    before = (_setattr_cost(), _llama_cost())
    ddp_guard.install()
    after = (_setattr_cost(), _llama_cost())
    print("| what | without the hook | with the hook | added |")
    print("|---|---|---|---|")
    floor = _empty_call_cost()
    for name in ("child", "module"):
        cost = _hook_cost(name)
        print(f"| the hook, name {name!r} (an empty Python call: {floor * 1e9:.0f} ns) | - | "
              f"{cost * 1e9:.0f} ns | {cost * 1e9:.0f} ns |")
    print(f"| `parent.child = module` | {before[0] * 1e9:.0f} ns | {after[0] * 1e9:.0f} ns "
          f"| {(after[0] - before[0]) * 1e9:+.0f} ns |")
    print(f"| build a 2-layer Llama (measured; noisy on a shared machine) | "
          f"{before[1] * 1e3:.2f} ms | {after[1] * 1e3:.2f} ms "
          f"| {(after[1] - before[1]) / before[1] * 100:+.1f}% |")
    count, hook = _registrations_per_llama(), _hook_cost("child")
    print(f"| build a 2-layer Llama ({count} registrations x the hook) | "
          f"{before[1] * 1e3:.2f} ms | - | {count * hook * 1e6:.1f} us "
          f"({count * hook / before[1] * 100:.3f}%) |")
    for row in _forward_rows():
        print(row)


if __name__ == "__main__":
    main()
