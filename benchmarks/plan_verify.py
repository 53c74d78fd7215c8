"""Wrap-time cost of verifying whole-head attention splits (issue 20).

Times ``DistributedModelWrapper(model, world_size=tp, rank=0)`` (no process
group: planning and slicing only) with the check on (default) and off
(``verify_plan=False``), best of ``--repeat`` (verdict cache cleared before
each, and once more with the cached verdict), for the benchmarks' small Llama
and a ~110M-parameter Llama config (hidden 768, 12 layers, 12 heads, vocab
32000), each with real CPU weights and on the meta device (the
``from_pretrained`` path); both are probed on a one-layer CPU copy.

    python benchmarks/plan_verify.py [--tp 2] [--repeat 3] [--threads 1]

The probe forwards are a few tokens long: on a loaded machine, more intra-op
threads than free cores make them slower, not faster; ``--threads`` says how
many were used (printed with the table).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchtp
from _llama import build_llama, llama_config
from torchtp.plans import verify as plans_verify

BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 32000}


def _wrap_seconds(make: Callable[[], nn.Module], tp: int, repeat: int, verify: bool,
                  cached: bool = False) -> float:
    best = float("inf")
    for _ in range(repeat):
        model = make()
        if not cached:
            plans_verify._CACHE.clear()  # the first wrap of this model in the process
        start = time.perf_counter()
        torchtp.DistributedModelWrapper(model, world_size=tp, rank=0, verify_plan=verify)
        best = min(best, time.perf_counter() - start)
    return best


def _on_meta(**overrides: object) -> nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config(**overrides)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases = {
        "small Llama (16M), CPU weights": lambda: build_llama(),
        "small Llama (16M), meta": lambda: _on_meta(),
        "Llama 110M, CPU weights": lambda: build_llama(**BASE),
        "Llama 110M, meta": lambda: _on_meta(**BASE),
    }
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"| model (tp {args.tp}) | wrap, verified (s) | wrap, verify_plan=False (s) | "
          "verification (s) | verification, cached verdict (s) |")
    print("|---|---|---|---|---|")
    for name, make in cases.items():
        on = _wrap_seconds(make, args.tp, args.repeat, True)
        off = _wrap_seconds(make, args.tp, args.repeat, False)
        again = _wrap_seconds(make, args.tp, args.repeat, True, cached=True)
        print(f"| {name} | {on:.3f} | {off:.3f} | {on - off:.3f} | {again - off:.3f} |")


if __name__ == "__main__":
    main()
