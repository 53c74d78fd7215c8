"""`make demo`: the reference guide's MLP, tensor-parallel over 2 Gloo CPU processes.

Run with ``torchrun --nproc-per-node 2 --standalone launch/demo.py``. Every rank
builds the same model from the same seed, keeps an unsharded copy as the
reference, wraps the other copy with :class:`torchtp.DistributedModelWrapper`
and compares outputs, memory, collectives and latency. Rank 0 prints the table.
Exits non-zero when the sharded output differs from the unsharded one by more
than the tolerance.

The guide's MLP is 4096 -> 16384 -> 4096; on a 2-core CPU machine that takes
tens of seconds per forward, so by default the demo scales every dimension by
1/4 (1024 -> 4096 -> 1024). ``--full`` runs the guide's sizes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch import nn

import torchtp

GUIDE_DIMS = (4096, 16384, 4096)
TOLERANCE = 1e-4  # fp32: the sharded sum reorders additions, nothing more


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="use the guide's 4096->16384->4096 sizes (slow on CPU)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7, help="timed forwards per model")
    return parser.parse_args()


def build_mlp(dims: tuple[int, int, int]) -> nn.Sequential:
    """The guide's MLP: Linear(d, h) -> ReLU -> Linear(h, d)."""
    d_in, hidden, d_out = dims
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def median_latency_ms(
    sharded: nn.Module, unsharded: nn.Module, x: torch.Tensor, runs: int
) -> tuple[float, float]:
    """Median forward time of both models, interleaved so load affects both alike."""
    times: dict[str, list[float]] = {"sharded": [], "unsharded": []}
    with torch.no_grad():
        for model in (sharded, unsharded):  # warm-up
            model(x)
        for _ in range(runs):
            for key, model in (("sharded", sharded), ("unsharded", unsharded)):
                # Start together so one rank's wait is not counted as the other's compute.
                torchtp.synchronize_across_ranks()
                start = time.perf_counter()
                model(x)
                times[key].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["sharded"]), statistics.median(times["unsharded"])


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, in rank order (a tiny all-gather)."""
    mine = torch.tensor([values], dtype=torch.float64)  # (1, n)
    return torchtp.all_gather(mine, dim=0).tolist()  # (world, n)


def report(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main() -> int:
    args = parse_args()
    cfg = torchtp.init_tensor_parallel()
    world, rank = cfg.world_size, cfg.rank
    dims = GUIDE_DIMS if args.full else tuple(d // 4 for d in GUIDE_DIMS)

    torch.manual_seed(0)  # same seed on every rank: same full weights everywhere
    reference = build_mlp(dims)  # (d_in -> hidden -> d_out), kept unsharded
    model = copy.deepcopy(reference)
    wrapper = torchtp.DistributedModelWrapper(model)
    reference.eval()
    wrapper.eval()

    torch.manual_seed(1)
    x = torch.randn(args.batch, args.seq, dims[0])  # (B, L, d_in), same on all ranks

    with torch.no_grad(), torchtp.count_collectives() as counter:
        y = wrapper(x)  # (B, L, d_out), replicated after the pair's all-reduce
    with torch.no_grad():
        y_ref = reference(x)
    max_diff = (y - y_ref).abs().max().item()
    t_sharded, t_unsharded = median_latency_ms(wrapper, reference, x, args.runs)

    stats = gather_floats([max_diff, param_bytes(wrapper), t_sharded, t_unsharded])
    worst = max(s[0] for s in stats)
    ok = worst <= TOLERANCE
    if rank == 0:
        print_table(args, dims, world, wrapper, reference, counter, stats, worst, ok)
    torchtp.shutdown_tensor_parallel()  # barrier + destroy (also runs at exit)
    return 0 if ok else 1


def print_table(
    args: argparse.Namespace, dims: tuple[int, ...], world: int,
    wrapper: torchtp.DistributedModelWrapper, reference: nn.Module,
    counter: torchtp.CollectiveCounter, stats: list[list[float]], worst: float, ok: bool,
) -> None:
    full = param_bytes(reference)
    scale = "guide's sizes" if args.full else "scaled 1/4 from the guide's 4096->16384->4096"
    counts = ", ".join(f"{n} x {op}" for op, n in sorted(counter.counts.items())) or "none"
    print(f"torchtp demo: MLP {'->'.join(map(str, dims))} ({scale}), "
          f"world_size={world}, backend={torchtp.get_tensor_parallel_config().backend}, "
          f"input (B, L, d)=({args.batch}, {args.seq}, {dims[0]}), fp32")
    print("\nplan used (wrapper.describe_plan()):")
    print("\n".join("  " + line for line in wrapper.describe_plan().splitlines()))
    print(f"\nswapped layers: {wrapper.parallelized_layers}")
    print(f"collectives per forward: {counts} ({counter.bytes_moved() / 1e6:.2f} MB per rank)")
    print("\nper rank:")
    print(f"  {'rank':>4}  {'param MB':>9}  {'of unsharded':>12}  {'max |diff|':>10}  "
          f"{'fwd sharded ms':>14}  {'fwd unsharded ms':>16}  {'speedup':>7}")
    for r, (diff, nbytes, ts, tu) in enumerate(stats):
        print(f"  {r:>4}  {nbytes / 1e6:>9.2f}  {nbytes / full:>12.1%}  {diff:>10.2e}  "
              f"{ts:>14.2f}  {tu:>16.2f}  {tu / ts:>6.2f}x")
    print(f"  {'full':>4}  {full / 1e6:>9.2f}  {1:>12.1%}  (unsharded model, every rank)")
    print("\nsummary:")
    print(report([
        ("max |sharded - unsharded|", f"{worst:.2e} (tolerance {TOLERANCE:.0e}) "
                                      f"{'OK' if ok else 'FAILED'}"),
        ("latency", f"median of {args.runs} interleaved forwards per model; both ranks "
                    "compute the unsharded model at the same time, on the same cores"),
    ]))


if __name__ == "__main__":
    sys.exit(main())
