"""Cost of checking every forward's inputs across TP ranks (torchtp.guards.input_check).

Two Gloo processes on this machine (tp 2), a Llama at small batches, eval
(``torch.no_grad()``) and training-mode forwards with gradients. Each
repetition times one forward with the check off, then one with it on (the
order alternates), so machine load hits both alike; the table gives rank 0's
medians and the median of the paired on/off ratios. On a loaded machine that
end-to-end number is noisier than the cost itself, so the last column times
the check's own work alone (hashing the inputs, riding on the first
all-reduce's buffer, the verdict) as a share of the forward. For comparison, the last rows time what the
check would cost as a collective of its own: one all-reduce of its 64 values.

    python benchmarks/input_check.py                # table (about 1-2 min on 2 cores)
    python benchmarks/input_check.py --reps 50      # fewer repetitions
    python benchmarks/input_check.py --case 0 --reps 400  # one case, many pairs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import build_llama

# (name, config overrides, batch, tokens)
CASES: list[tuple[str, dict[str, Any], int, int]] = [
    ("tiny llama (hidden 64, 2 layers), 1x16", {"hidden_size": 64, "num_hidden_layers": 2,
                                                "intermediate_size": 128}, 1, 16),
    ("tiny llama (hidden 64, 2 layers), 2x32", {"hidden_size": 64, "num_hidden_layers": 2,
                                                "intermediate_size": 128}, 2, 32),
    ("small llama (hidden 512, 4 layers), 1x16", {}, 1, 16),
    ("small llama (hidden 512, 4 layers), 2x32", {}, 2, 32),
]


def _time(model: torch.nn.Module, ids: torch.Tensor, grad: bool) -> float:
    start = time.perf_counter()
    if grad:
        model(input_ids=ids)
    else:
        with torch.no_grad():
            model(input_ids=ids)
    return time.perf_counter() - start


def _check_work_ms(ids: torch.Tensor, hidden: int, reps: int) -> float:
    """Median ms of the check's own work in one forward, timed alone (robust under load):
    hashing the inputs, appending 64 values to the first all-reduce's buffer
    ``(batch * tokens * hidden,)`` and copying it back, and the verdict."""
    from torchtp.guards import input_check

    act = torch.randn(ids.numel() * hidden)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        values, _device = input_check._encoded((), {"input_ids": ids}, None)
        buf = torch.cat([act, torch.tensor(values, dtype=act.dtype)])
        act.copy_(buf[:act.numel()])
        sums = buf[act.numel():].tolist()
        all(s in (0.0, 2) for s in sums)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _rank(rank: int, world: int, store: str, reps: int, out: str, only: list[int]) -> None:
    import torchtp
    from torchtp.comm import ops as _comm
    from torchtp.core import log as _logging

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = []
    for name, overrides, batch, tokens in [c for i, c in enumerate(CASES) if i in only]:
        model = torchtp.DistributedModelWrapper(build_llama(**overrides))
        hidden = model.config.hidden_size
        ids = torch.randint(0, 2048, (batch, tokens), generator=torch.Generator().manual_seed(1))
        n = reps if hidden < 512 else max(10, reps // 4)
        for grad in (False, True):
            model.train(grad)
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(n + 3):
                for on in ((False, True) if i % 2 else (True, False)):
                    _logging.CHECK_INPUTS = on
                    t = _time(model, ids, grad)
                    if i >= 3:  # warm-up
                        times[on].append(t)
            off, on_ = (statistics.median(times[k]) * 1e3 for k in (False, True))
            paired = statistics.median(a / b for a, b in zip(times[True], times[False],
                                                             strict=True))
            work = _check_work_ms(ids, hidden, 200)
            rows.append(f"| {name} | {'train' if grad else 'eval'} | {off:.3f} | {on_:.3f} | "
                        f"{100 * (paired - 1):+.2f}% | {work * 1e3:.0f} us = "
                        f"{100 * work / off:.2f}% |")
    _logging.CHECK_INPUTS = True
    values = torch.zeros(64, dtype=torch.float64)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        _comm.all_reduce_(values, None)
        samples.append(time.perf_counter() - start)
    separate = statistics.median(samples) * 1e3
    if rank == 0:
        Path(out).write_text("\n".join(rows) + f"\n\nseparate all-reduce of the 64 values "
                             f"(what riding on the model's all-reduce saves): {separate:.3f} ms\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--case", type=int, action="append",
                        help="only this case (index into CASES; repeatable)")
    args = parser.parse_args()
    only = args.case if args.case else list(range(len(CASES)))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "table.md")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.reps, out, only), nprocs=2)
        print("| case | mode | check off ms | check on ms | end-to-end cost (median of "
              "paired ratios) | check's own work, timed alone (% of the forward) |\n"
              "|---|---|---|---|---|---|")
        print(Path(out).read_text())


if __name__ == "__main__":
    main()
