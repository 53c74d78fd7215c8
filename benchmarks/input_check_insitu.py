"""Where a forward's time goes with the input check on and off, measured inside the forward.

Two Gloo processes (tp 2), the tiny Llama of benchmarks/input_check.py
(hidden 64, 2 layers, 1 x 16 tokens), eval. The check's steps
(``InputCheck.before``: hash the inputs; ``InputCheck.returned``: the
verdict), every ``all_reduce_`` and the riding all-reduce are timed in place
while 300 forwards run with the check off, then on, twice. End-to-end medians
of the same code swing by several percent between repetitions here; the
in-place times show what the check itself adds.

    .venv/bin/python benchmarks/input_check_insitu.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _llama import build_llama


def rank_fn(rank: int, world: int, store: str) -> None:
    warnings.filterwarnings("ignore")
    import torchtp
    from torchtp.comm import ops
    from torchtp.core import log as _logging
    from torchtp.guards import input_check
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tiny = build_llama(hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    model = torchtp.DistributedModelWrapper(tiny).eval()
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(1))
    acc: dict[str, list[float]] = {}
    def timed(name: str, fn: Any) -> Any:
        def w(*a: Any, **k: Any) -> Any:
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc.setdefault(name, []).append(time.perf_counter() - s)
        return w
    ops.all_reduce_ = timed("all_reduce_", ops.all_reduce_)
    ops._all_reduce_riding = timed("riding", ops._all_reduce_riding)
    input_check.InputCheck.before = timed("before", input_check.InputCheck.before)
    input_check.InputCheck.returned = timed("returned", input_check.InputCheck.returned)
    res: dict[tuple[int, bool], Any] = {}
    with torch.no_grad():
        for rep in range(2):
            for on in (False, True):
                _logging.CHECK_INPUTS = on
                acc.clear()
                ts = []
                for _ in range(300):
                    dist.barrier()
                    s = time.perf_counter()
                    model(input_ids=ids)
                    ts.append(time.perf_counter() - s)
                res[(rep, on)] = (statistics.median(ts) * 1e3,
                                  {k: (len(v), sum(v) / 300 * 1e6) for k, v in acc.items()})
    if rank == 0:
        for (rep, on), (ms, parts) in res.items():
            shown = ", ".join(f"{n} {us:.0f} us" for n, (_c, us) in parts.items())
            print(f"repetition {rep}, check {'on ' if on else 'off'}: {ms:.3f} ms per forward "
                  f"(per forward: {shown})", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_fn, args=(2, tempfile.mktemp()), nprocs=2)
