"""Cost of checking every forward's inputs across TP ranks (torchtp.guards.input_check).

Two Gloo processes on this machine (tp 2), each pinned to its own core where
the machine allows, one thread each; a Llama at small batches, eval
(``torch.no_grad()``) and training-mode forwards with gradients. Each round
runs three forwards in a shuffled order: check off, check on, and check off
again (an A/A control: the same code twice, so its ratio shows what noise
alone gives). A barrier precedes every forward.

Two clocks per forward, the larger over the two ranks:

* wall time (``perf_counter``): what a user waits. On 2 shared cores most of a
  forward is waiting for the other rank, and it scatters by several percent;
* the main thread's CPU time (``thread_time``): the work a forward does,
  waits excluded. The check is work on that thread (hashing, riding the first
  all-reduce, the verdict), so this clock shows its cost; the A/A control
  puts its noise well below 1%.

The table gives per-arm medians, the median of the paired ratios to "off" and
its 95% bootstrap interval, and the CPU difference as a share of the median
wall-clock forward (the check's work is on the main thread, on the forward's
critical path, so that share is what a user waits for it).

    python benchmarks/input_check.py                # all cases (about 2 min on 2 cores)
    python benchmarks/input_check.py --rounds 100   # fewer rounds
    python benchmarks/input_check.py --case 0 --rounds 800  # one case, many rounds
    python benchmarks/input_check.py --device cuda          # CUDA tensors (GPU checklist)

With ``--device cuda`` the model and the token ids live on the GPU, both ranks
share GPU 0 over ``"cpu:gloo,cuda:gloo"`` (NCCL refuses two ranks per GPU) and
every forward ends with a CUDA synchronize, inside both clocks: the CPU clock
then shows the host's work per forward (the check's hashing, its one host copy
of each input's sample, the bits' copy to the device, reading the sums).
"""

from __future__ import annotations

import argparse
import os
import random
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

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
# (name, config overrides, batch, tokens)
CASES: list[tuple[str, dict[str, Any], int, int]] = [
    ("tiny llama (hidden 64, 2 layers), 1x16", TINY, 1, 16),
    ("tiny llama (hidden 64, 2 layers), 2x32", TINY, 2, 32),
    ("small llama (hidden 512, 4 layers), 1x16", {}, 1, 16),
    ("small llama (hidden 512, 4 layers), 2x32", {}, 2, 32),
]
ARMS = ("off", "on", "off again")
WARMUP = 5


def _pin(rank: int) -> bool:
    """Give each rank its own core (fewer context switches inside a forward)."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return False
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    return True


def _forwards(model: torch.nn.Module, ids: torch.Tensor, grad: bool,
              rounds: int) -> torch.Tensor:
    """``(2, arms, rounds)``: wall and CPU seconds of each forward, this rank."""
    from torchtp.core import log as _logging

    times = torch.zeros(2, len(ARMS), rounds, dtype=torch.float64)
    order = list(range(len(ARMS)))
    shuffle = random.Random(0)  # the same order on both ranks
    with torch.set_grad_enabled(grad):
        for i in range(rounds + WARMUP):
            shuffle.shuffle(order)
            for arm in order:
                _logging.CHECK_INPUTS = ARMS[arm] == "on"
                dist.barrier()
                wall, cpu = time.perf_counter(), time.thread_time()
                model(input_ids=ids)
                if ids.is_cuda:  # the forward's kernels inside both clocks
                    torch.cuda.synchronize()
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                if i >= WARMUP:
                    times[:, arm, i - WARMUP] = torch.tensor([wall, cpu])
    _logging.CHECK_INPUTS = True
    return times


def _interval(ratios: torch.Tensor) -> tuple[float, float, float]:
    """Median of ``ratios`` and its 95% bootstrap interval, as percent above 1."""
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(ratios), (1000, len(ratios)), generator=gen)
    medians = ratios[picks].median(dim=1).values.sort().values
    return tuple(100 * (float(v) - 1) for v in (ratios.median(), medians[25], medians[974]))


def _rows(name: str, mode: str, times: torch.Tensor) -> list[str]:
    rows = []
    wall_off = float(times[0, 0].median())
    for clock, t in zip(("wall", "CPU"), times, strict=True):
        med = [float(t[a].median()) * 1e3 for a in range(len(ARMS))]
        on, lo, hi = _interval(t[1] / t[0])
        aa, aa_lo, aa_hi = _interval(t[2] / t[0])
        extra = float((t[1] - t[0]).median())
        # The check's work runs on the main thread, on the forward's critical path:
        # its CPU time is wall time a user waits, here as a share of the forward's.
        of_wall = f"{100 * extra / wall_off:+.2f}%" if clock == "CPU" else ""
        rows.append(f"| {name} | {mode} | {clock} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | "
                    f"{on:+.2f}% [{lo:+.2f}, {hi:+.2f}] ({extra * 1e6:+.0f} us) | "
                    f"{of_wall} | {aa:+.2f}% [{aa_lo:+.2f}, {aa_hi:+.2f}] |")
    return rows


def _rank(rank: int, world: int, store: str, rounds: int, out: str, only: list[int],
          device: str = "cpu") -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torchtp

    pinned = _pin(rank)
    torch.set_num_threads(1)
    backend = "gloo" if device == "cpu" else "cpu:gloo,cuda:gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    rows = [f"device: {where}; pinned to one core per rank: {pinned}; load average before: "
            f"{os.getloadavg()[0]:.2f}", ""]
    for name, overrides, batch, tokens in [c for i, c in enumerate(CASES) if i in only]:
        model = torchtp.DistributedModelWrapper(build_llama(**overrides).to(device))
        ids = torch.randint(0, 2048, (batch, tokens),
                            generator=torch.Generator().manual_seed(1)).to(device)
        n = rounds if overrides else max(20, rounds // 3)
        for grad in (False, True):
            model.train(grad)
            times = _forwards(model, ids, grad, n)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slower rank, per forward
            rows += _rows(f"{name}, {n} rounds", "train" if grad else "eval", times)
    rows.append(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if rank == 0:
        Path(out).write_text("\n".join(rows) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--case", type=int, action="append",
                        help="only this case (index into CASES; repeatable)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    only = args.case if args.case else list(range(len(CASES)))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "table.md")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), args.rounds, out, only,
                              args.device), nprocs=2)
        text = Path(out).read_text()
        head, table = text.split("\n\n", 1)
        print(head + "\n")
        print("| case | mode | clock | off ms | on ms | off again ms | on / off: median [95%] "
              "(median difference) | difference / wall-clock forward | "
              "A/A: off again / off [95%] |\n"
              "|---|---|---|---|---|---|---|---|---|")
        print(table)


if __name__ == "__main__":
    main()
