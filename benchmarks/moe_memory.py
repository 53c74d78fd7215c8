"""Peak memory per rank of an MoE training step, each variant in fresh processes.

The Mixtral of ``benchmarks/moe.py`` (hidden 256, 4 layers, 8 experts of 512
features, top-2), saved once with ``save_pretrained``. Each variant starts
``--world`` new Gloo processes (one thread each; peak RSS is per process and
never goes down, so variants cannot share one), loads the checkpoint as that
variant loads it, and runs three AdamW steps on a 4 x 64 batch:

* ``one process``: ``from_pretrained`` of transformers on rank 0 alone;
* ``experts split inside`` / ``whole experts`` / ``ep 2 x tp 2`` (``--world 4``):
  ``DistributedModelWrapper.from_pretrained(path, expert_parallel=...)``,
  which builds the model on meta and reads only this rank's shards.

Per rank: the peak resident memory (``ru_maxrss``) above the resident memory
after imports and the group's start (``<=``: the imports' own peak was higher,
so the step's peak is at most that), the training state this rank holds
(parameters, gradients, AdamW's two moments: 4 copies), and the rest of the
peak (activations, the allocator's slack, loading buffers). The target
(issue 22): peak <= 1.1 x (this rank's state) + activations, with the
activations taken as the one-process run's rest, since tensor parallelism
keeps every activation but the experts' intermediate ones whole.

    .venv/bin/python benchmarks/moe_memory.py [--world 2|4]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import _build  # the same model as the step-time benchmark
from torchtp.cli._launch import launch

MIB = 2**20
VARIANTS: dict[str, object] = {"one process": None, "experts split inside": False,
                               "whole experts": True, "ep 2 x tp 2": 2}


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _resident_bytes() -> int:
    """Resident memory now (the import's own peak may lie above it, so not ru_maxrss)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _rank(rank: int, world: int, saved: str, expert_parallel: object) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    base, import_peak = _resident_bytes(), _peak_bytes()
    if expert_parallel is None and rank != 0:
        return {"peak": 0, "state": 0, "known": True}
    model: Any
    if expert_parallel is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(saved).train()
    else:
        import torchtp

        model = torchtp.DistributedModelWrapper.from_pretrained(
            saved, expert_parallel=expert_parallel, progress=False).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of the state
    state = sum(4 * p.numel() * p.element_size() for p in model.parameters())
    # The step's peak is only known if it rose above the imports' own peak.
    return {"peak": _peak_bytes() - base, "state": state, "known": _peak_bytes() > import_peak}


def _table(results: dict[str, list[dict[str, Any]]], world: int) -> str:
    one = results["one process"][0]
    activations = one["peak"] - one["state"]
    lines = [f"{world} ranks; MiB; rank with the largest peak shown", "",
             "| variant | peak above start | state held (4 x params) | rest of the peak "
             "| 1.1 x state + one-process rest | peak / that |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, per_rank in results.items():
        row = max(per_rank, key=lambda r: r["peak"])
        bound = 1.1 * row["state"] + activations
        at_most = "" if row["known"] else "<= "
        lines.append(f"| {name} | {at_most}{row['peak'] / MIB:.1f} | {row['state'] / MIB:.1f} "
                     f"| {(row['peak'] - row['state']) / MIB:.1f} | {bound / MIB:.1f} "
                     f"| {row['peak'] / bound:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, choices=(2, 4))
    args = parser.parse_args()
    variants = {n: v for n, v in VARIANTS.items() if n != "ep 2 x tp 2" or args.world == 4}
    with tempfile.TemporaryDirectory(prefix="torchtp-moe-memory-") as saved:
        _build().save_pretrained(saved)
        results = {name: launch(_rank, args.world, saved, ep) for name, ep in variants.items()}
    print(_table(results, args.world))


if __name__ == "__main__":
    main()
