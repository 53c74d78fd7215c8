"""``torchtp verify PATH --tp N``: sharded forward (and backward) vs the unsharded model."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn

from ..comm.ops import count_collectives
from ..layers import layouts_of
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
from ._ranks import load_model, load_sharded, peak_device_bytes, peak_rss_bytes, random_tokens, say
from .plan import require_splittable

# Default --tol by model dtype: float32 (a different summation order), float64 (rounding
# only), anything else (half types: one rounding of each partial sum)
DEFAULT_TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
HELP = "run the sharded model on N processes and compare with the unsharded model"
EXAMPLES = """examples:
  torchtp verify ./Llama-3.2-1B --tp 2
  torchtp verify ./tiny-llama --tp 4 --grad --tol 1e-4 --json
exit status: 0 when the max relative error is within --tol, 1 when above, 2 on bad input
"""


def register(sub: Any) -> None:
    """Add the ``verify`` subcommand."""
    p = sub.add_parser("verify", help=HELP, description=HELP, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="HuggingFace model directory (weights, or config only: random weights)")
    p.add_argument("--tp", type=positive_int, required=True, help="number of rank processes")
    p.add_argument("--grad", action="store_true", help="also compare a backward pass's gradients")
    p.add_argument("--batch", type=positive_int, default=2, help="batch size (default 2)")
    p.add_argument("--seq", type=positive_int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--tol", type=float, default=None,
                   help="max relative error allowed (default 1e-4 for float32, 1e-10 for "
                        "float64, 2e-2 otherwise)")
    add_rank_options(p)
    p.set_defaults(run=run)


def _shard_of(ref: torch.Tensor, module: nn.Module, pname: str) -> torch.Tensor:
    """The slice of a full reference gradient that this rank's parameter holds."""
    layout = layouts_of(module).get(pname)
    return ref if layout is None else layout.take(ref)


def _max_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max |want|)."""
    diff = (got.double() - want.double()).abs().max().item()
    return diff, diff / max(want.double().abs().max().item(), 1e-30)


def _grad_error(model: nn.Module, ref: nn.Module) -> tuple[float, float]:
    """The (abs, rel) error of the gradient with the largest relative error; infinite
    where one model has a gradient the other lacks."""
    # Every name of a tied parameter (the wrapped model's walk meets lm_head.weight too)
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    worst = (0.0, 0.0)
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            want = ref_grads.get(full)
            if p.grad is None and want is None:
                continue
            err = ((math.inf, math.inf) if p.grad is None or want is None
                   else _max_err(p.grad, _shard_of(want, mod, pname)))
            worst = max(worst, err, key=lambda e: e[1])
    return worst


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    say(rank, f"loading {args['path']} on {world} rank(s)")
    # The unsharded reference is loaded on its own; the shards are read separately.
    ref, config = load_model(args["path"], args["dtype"], args["seed"])
    ids = random_tokens(config.vocab_size, args["batch"], args["seq"], args["seed"] + 1)
    say(rank, "running the unsharded reference")
    with torch.set_grad_enabled(args["grad"]):
        want = ref(ids, labels=ids if args["grad"] else None)
    if args["grad"]:
        want.loss.backward()
    say(rank, f"loading this rank's shard (tp={world}) and running the sharded model")
    wrapped, _ = load_sharded(args["path"], args["dtype"], args["seed"], args["plan"],
                                    args["experts"])
    with torch.set_grad_enabled(args["grad"]), count_collectives() as counter:
        got = wrapped(ids, labels=ids if args["grad"] else None)
    result = {"rank": rank, "collectives_per_forward": dict(counter.counts),
              "logits_error": _max_err(got.logits, want.logits)}
    if args["grad"]:
        with count_collectives() as back:
            got.loss.backward()
        result["collectives_per_backward"] = dict(back.counts)
        result["grad_error"] = _grad_error(wrapped.base_model, ref)
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["peak_device_bytes"] = peak_device_bytes()
    return result


def run_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Launch the ranks and summarise (used by ``verify`` and ``demo``)."""
    from ._hf import load_config, parse_dtype

    config = load_config(args.path)  # fail fast, before any process starts
    dtype = parse_dtype(args.dtype, config)
    require_splittable(args.path, args.tp, args.dtype, args.plan, experts_of(args))
    tol = args.tol if args.tol is not None else DEFAULT_TOL.get(dtype, 2e-2)
    backend = pick_backend(args.tp, args.backend)
    progress(f"verify: launching {args.tp} {backend} process(es)")
    per_rank = launch(_rank, args.tp, {"path": args.path, "dtype": args.dtype, "grad": args.grad,
                                       "batch": args.batch, "seq": args.seq, "seed": args.seed,
                                       "plan": args.plan, "experts": experts_of(args)},
                      backend=backend, timeout=args.timeout)
    worst = max(max(r["logits_error"][1], r.get("grad_error", (0, 0))[1]) for r in per_rank)
    return {"path": args.path, "tp": args.tp, "backend": backend, "dtype": str(dtype),
            "tolerance": tol, "max_rel_error": worst, "passed": worst <= tol, "ranks": per_rank}


def render(report: dict[str, Any]) -> str:
    """Readable verify report."""
    rows = []
    for r in report["ranks"]:
        grad = r.get("grad_error")
        rows.append([r["rank"], r["logits_error"][0], r["logits_error"][1],
                     "-" if grad is None else f"{grad[0]:.3g}", "-" if grad is None else f"{grad[1]:.3g}",
                     ", ".join(f"{n} x {op}" for op, n in r["collectives_per_forward"].items()) or "none",
                     human_bytes(r["peak_rss_bytes"])])
    verdict = "PASS" if report["passed"] else "FAIL"
    return "\n".join([
        f"verify {report['path']}: tp={report['tp']} ({report['backend']}), dtype={report['dtype']}",
        table(["rank", "logits max abs", "logits max rel", "grad max abs", "grad max rel",
               "collectives/forward", "peak RSS"], rows),
        "(rel = max |sharded - unsharded| / max |unsharded|; peak RSS includes the unsharded "
        "reference copy every rank keeps for the comparison)",
        f"{verdict}: max relative error {report['max_rel_error']:.3g} "
        f"{'<=' if report['passed'] else '>'} tolerance {report['tolerance']:.3g}"])


def run(args: argparse.Namespace) -> int:
    """Verify; exit status 1 when the error is above tolerance."""
    report = run_verify(args)
    print(dump_json(report) if args.json else render(report))
    return 0 if report["passed"] else 1
