"""`make demo`: a small Llama model, tensor-parallel over 2 Gloo CPU processes.

Run with ``torchrun --nproc-per-node 2 --standalone launch/demo.py``. Every rank
builds the same model from the same seed (random weights, made locally from a
``LlamaConfig``: nothing is downloaded), keeps an unsharded copy as the
reference, wraps the other copy with :class:`torchtp.DistributedModelWrapper`
(which finds the model's own HF plan) and compares logits, memory, collectives
and latency. Rank 0 prints the plan it used and the table. Exits non-zero when
the sharded output differs from the unsharded one by more than the tolerance.

``--model mlp`` runs the reference guide's MLP instead (4096 -> 16384 -> 4096,
scaled by 1/4 for a 2-core CPU machine; ``--full`` for the guide's sizes).
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
    parser.add_argument("--model", choices=("llama", "mlp"), default="llama",
                        help="a small random-weight Llama (default) or the guide's MLP")
    parser.add_argument("--full", action="store_true",
                        help="use the guide's 4096->16384->4096 sizes (slow on CPU)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7, help="timed forwards per model")
    return parser.parse_args()


def build_mlp(dims: tuple[int, int, int]) -> nn.Sequential:
    """The guide's MLP: Linear(d, h) -> ReLU -> Linear(h, d)."""
    d_in, hidden, d_out = dims
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def build_llama() -> tuple[nn.Module, str]:
    """A small Llama-architecture model (GQA: 8 query heads, 4 KV heads), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256)
    about = (f"Llama {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
             f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, "
             f"vocab {config.vocab_size} (random weights, built locally)")
    return LlamaForCausalLM(config), about


def build(args: argparse.Namespace) -> tuple[nn.Module, str, torch.Tensor]:
    """The reference model, a one-line description and an input (same on all ranks)."""
    torch.manual_seed(0)  # same seed on every rank: same full weights everywhere
    if args.model == "llama":
        model, about = build_llama()
        torch.manual_seed(1)
        return model, about, torch.randint(0, 4096, (args.batch, args.seq))  # (B, L) ids
    dims = GUIDE_DIMS if args.full else tuple(d // 4 for d in GUIDE_DIMS)
    scale = "guide's sizes" if args.full else "scaled 1/4 from the guide's 4096->16384->4096"
    about = f"MLP {'->'.join(map(str, dims))} ({scale})"
    model = build_mlp(dims)
    torch.manual_seed(1)
    return model, about, torch.randn(args.batch, args.seq, dims[0])  # (B, L, d_in)


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits for a HF model, the output for a plain one."""
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def median_latency_ms(
    sharded: nn.Module, unsharded: nn.Module, x: torch.Tensor, runs: int
) -> tuple[float, float]:
    """Median forward time of both models, interleaved so load affects both alike."""
    times: dict[str, list[float]] = {"sharded": [], "unsharded": []}
    with torch.no_grad():
        for model in (sharded, unsharded):  # warm-up
            forward(model, x)
        for _ in range(runs):
            for key, model in (("sharded", sharded), ("unsharded", unsharded)):
                # Start together so one rank's wait is not counted as the other's compute.
                torchtp.synchronize_across_ranks()
                start = time.perf_counter()
                forward(model, x)
                times[key].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["sharded"]), statistics.median(times["unsharded"])


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, in rank order (a tiny all-gather)."""
    mine = torch.tensor([values], dtype=torch.float64)  # (1, n)
    return torchtp.all_gather(mine, dim=0).tolist()  # (world, n)


def x_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.batch, args.seq) if args.model == "llama" else (args.batch, args.seq, -1)


def report(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def main() -> int:
    args = parse_args()
    cfg = torchtp.init_tensor_parallel()
    world, rank = cfg.world_size, cfg.rank
    reference, about, x = build(args)  # kept unsharded
    wrapper = torchtp.DistributedModelWrapper(copy.deepcopy(reference))
    reference.eval()
    wrapper.eval()

    with torch.no_grad(), torchtp.count_collectives() as counter:
        y = forward(wrapper, x)  # replicated on every rank
    with torch.no_grad():
        y_ref = forward(reference, x)
    max_diff = (y - y_ref).abs().max().item()
    t_sharded, t_unsharded = median_latency_ms(wrapper, reference, x, args.runs)

    stats = gather_floats([max_diff, param_bytes(wrapper), t_sharded, t_unsharded])
    worst = max(s[0] for s in stats)
    ok = worst <= TOLERANCE
    if rank == 0:
        print_table(args, about, world, wrapper, reference, counter, stats, worst, ok)
    torchtp.shutdown_tensor_parallel()  # barrier + destroy (also runs at exit)
    return 0 if ok else 1


def print_table(
    args: argparse.Namespace, about: str, world: int,
    wrapper: torchtp.DistributedModelWrapper, reference: nn.Module,
    counter: torchtp.CollectiveCounter, stats: list[list[float]], worst: float, ok: bool,
) -> None:
    full = param_bytes(reference)
    counts = ", ".join(f"{n} x {op}" for op, n in sorted(counter.counts.items())) or "none"
    print(f"torchtp demo: {about}, world_size={world}, "
          f"backend={torchtp.get_tensor_parallel_config().backend}, "
          f"input shape {tuple(x_shape(args))}, fp32")
    print("\nplan used (wrapper.describe_plan()):")
    print("\n".join("  " + line for line in wrapper.describe_plan().splitlines()))
    print(f"\nswapped layers: {len(wrapper.parallelized_layers)}")
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
