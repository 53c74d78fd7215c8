"""Count the torchtp files whose functions run during one wrap + one forward.

Issue 21's measure of how far a wrap travels through the package: functions
entered (``sys.setprofile``) in files under ``src/distributed/``, module-level
import code not counted. Run at world size 1 (no process group needed).

    python benchmarks/wrap_files.py            # MLP and tiny HF Llama
    python benchmarks/wrap_files.py --list     # also the files
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchtp

ROOT = str(Path(torchtp.__file__).resolve().parent)


def files_entered(run: Callable[[], Any]) -> list[str]:
    """Files under the package whose functions ``run`` entered (imports excluded)."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        path = os.path.realpath(code.co_filename)
        if path.startswith(ROOT) and code.co_name != "<module>":
            seen.add(os.path.relpath(path, ROOT))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def mlp_case() -> Callable[[], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                          nn.Linear(16, 8))
    x = torch.randn(2, 16)
    return lambda: torchtp.DistributedModelWrapper(model, world_size=1, rank=0)(x)


def llama_case() -> Callable[[], Any]:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    return lambda: torchtp.DistributedModelWrapper(model, world_size=1, rank=0)(input_ids=ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    print(f"{'case':<10} {'files':>5}")
    for name, case in [("mlp", mlp_case()), ("hf-llama", llama_case())]:
        files = files_entered(case)
        print(f"{name:<10} {len(files):>5}")
        if args.list:
            for f in files:
                print(f"    {f}")


if __name__ == "__main__":
    main()
