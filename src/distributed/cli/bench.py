"""``torchtp bench PATH --tp N``: prefill and decode latency, tokens/s, memory per rank."""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any

import torch

from ._common import (
    add_rank_options,
    dump_json,
    experts_of,
    human_bytes,
    positive_int,
    progress,
    table,
)
from ._launch import launch, pick_backend
from ._ranks import barrier, load_sharded, peak_device_bytes, peak_rss_bytes, random_tokens, say
from .plan import require_splittable

HELP = "measure prefill latency, decode latency per token, tokens/s and memory per rank"
EXAMPLES = """examples:
  torchtp bench ./tiny-llama --tp 2
  torchtp bench ./tiny-llama --tp 4 --batch 1 --seq 128 --new-tokens 32 --json
"""


def register(sub: Any) -> None:
    """Add the ``bench`` subcommand."""
    p = sub.add_parser("bench", help=HELP, description=HELP, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="HuggingFace model directory (weights, or config only: random weights)")
    p.add_argument("--tp", type=positive_int, required=True, help="number of rank processes")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--seq", type=positive_int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="decode steps (default 16)")
    p.add_argument("--reps", type=positive_int, default=5, help="timed prefills (default 5)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default 1)")
    add_rank_options(p)
    p.set_defaults(run=run)


def _timed(fn: Any) -> tuple[float, Any]:
    barrier()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _decode_step(model: Any, previous: Any) -> Any:
    """A call that feeds ``previous``'s greedy next token with its KV cache."""
    cache, token = previous.past_key_values, previous.logits[:, -1:].argmax(-1)  # token: (B, 1)
    return lambda: model(token, past_key_values=cache, use_cache=True)


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    say(rank, f"loading {args['path']} on {world} rank(s)")
    model, config = load_sharded(args["path"], args["dtype"], args["seed"], args["plan"],
                                    args["experts"])
    ids = random_tokens(config.vocab_size, args["batch"], args["seq"], args["seed"] + 1)
    prefill, decode = [], []
    with torch.inference_mode():
        model(ids)  # warm-up
        say(rank, f"timing {args['reps']} prefills of {args['batch']}x{args['seq']} tokens")
        for _ in range(args["reps"]):
            seconds, out = _timed(partial(model, ids, use_cache=True))
            prefill.append(seconds)
        say(rank, f"timing {args['new_tokens']} decode steps")
        for _ in range(args["new_tokens"]):
            step = _decode_step(model, out)
            seconds, out = _timed(step)
            decode.append(seconds)
    return {"rank": rank, "prefill_s": prefill, "decode_s": decode, "peak_rss_bytes": peak_rss_bytes(),
            "peak_device_bytes": peak_device_bytes()}


def summarize(per_rank: list[dict[str, Any]], batch: int, seq: int) -> dict[str, float]:
    """Medians over repetitions of the slowest rank's time per repetition."""
    prefill = statistics.median(max(ts) for ts in zip(*(r["prefill_s"] for r in per_rank), strict=True))
    decode = statistics.median(max(ts) for ts in zip(*(r["decode_s"] for r in per_rank), strict=True))
    return {"prefill_ms": prefill * 1e3, "prefill_tokens_per_s": batch * seq / prefill,
            "decode_ms_per_token": decode * 1e3, "decode_tokens_per_s": batch / decode}


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Launch the ranks and summarise (used by ``bench`` and ``demo``)."""
    from ._hf import load_config

    load_config(args.path)  # fail fast, before any process starts
    require_splittable(args.path, args.tp, args.dtype, args.plan, experts_of(args))
    backend = pick_backend(args.tp, args.backend)
    progress(f"bench: launching {args.tp} {backend} process(es), {args.threads} thread(s) each")
    per_rank = launch(_rank, args.tp, {**{k: getattr(args, k) for k in (
        "path", "dtype", "seed", "batch", "seq", "new_tokens", "reps", "plan")},
        "experts": experts_of(args)},
        backend=backend, threads=args.threads, timeout=args.timeout)
    return {"path": args.path, "tp": args.tp, "backend": backend, "batch": args.batch,
            "seq": args.seq, "threads_per_rank": args.threads,
            **summarize(per_rank, args.batch, args.seq),
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in per_rank],
            "peak_device_bytes_per_rank": [r["peak_device_bytes"] for r in per_rank]}


def render(report: dict[str, Any]) -> str:
    """Readable bench report."""
    return "\n".join([
        f"bench {report['path']}: tp={report['tp']} ({report['backend']}), batch={report['batch']}, "
        f"prompt={report['seq']} tokens, {report['threads_per_rank']} thread(s) per rank",
        table(["metric", "value"], [
            ["prefill latency (ms)", report["prefill_ms"]],
            ["prefill tokens/s", report["prefill_tokens_per_s"]],
            ["decode latency per token (ms)", report["decode_ms_per_token"]],
            ["decode tokens/s", report["decode_tokens_per_s"]],
            *[[f"peak RSS rank {i}", human_bytes(b)]
              for i, b in enumerate(report["peak_rss_bytes_per_rank"])],
            *[[f"peak device memory rank {i}", human_bytes(b)]
              for i, b in enumerate(report["peak_device_bytes_per_rank"]) if b]]),
        "(median over repetitions of the slowest rank; each rank's process times its own calls)"])


def run(args: argparse.Namespace) -> int:
    """Benchmark and print."""
    report = run_bench(args)
    print(dump_json(report) if args.json else render(report))
    return 0
