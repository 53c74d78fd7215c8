"""``torchtp demo``: make a small Llama locally, then plan, verify and bench it."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from . import bench, plan, verify
from ._common import CliError, positive_int, progress
from ._hf import _transformers

HELP = "build a small random-weight Llama locally and run plan + verify + bench on it"
EXAMPLES = """examples:
  torchtp demo                 # tp=2 on CPU processes (Gloo)
  torchtp demo --tp 4 --keep ./tiny-llama
"""


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser("demo", help=HELP, description=HELP, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--hidden", type=positive_int, default=256, help="hidden size (default 256)")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers (default 4)")
    p.add_argument("--keep", metavar="DIR", help="save the model here and keep it (default: a temp dir)")
    p.set_defaults(run=run)


def make_tiny_llama(directory: str | Path, hidden: int = 256, layers: int = 4, seed: int = 0) -> Path:
    """Save a random-weight Llama (8 heads, 4 KV heads, vocab 1024) to ``directory``."""
    import torch

    tf = _transformers()
    tf.utils.logging.disable_progress_bar()
    config = tf.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                            num_key_value_heads=4, intermediate_size=hidden * 11 // 4 // 8 * 8,
                            vocab_size=1024, max_position_embeddings=512)
    torch.manual_seed(seed)
    tf.LlamaForCausalLM(config).save_pretrained(str(directory))
    return Path(directory)


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)), flush=True)


def run(args: argparse.Namespace) -> int:
    """Build, plan, verify and bench; exit status 1 if verify fails."""
    if args.hidden % 8:
        raise CliError(f"--hidden={args.hidden} must be divisible by the demo's 8 attention heads")
    with tempfile.TemporaryDirectory(prefix="torchtp-demo-") as tmp:
        path = Path(args.keep or tmp)
        progress(f"demo: building a random-weight Llama (hidden={args.hidden}, "
                 f"layers={args.layers}) in {path}")
        make_tiny_llama(path, args.hidden, args.layers)
        _section(f"1/3 plan --tp {args.tp}: what gets split, memory per rank")
        report = plan.analyze(str(path), args.tp)
        print(plan.render(report))
        if report["blockers"]:
            return 1
        _section(f"2/3 verify --tp {args.tp} --grad: sharded vs unsharded, forward and backward")
        checked = verify.run_verify(argparse.Namespace(
            path=str(path), tp=args.tp, grad=True, batch=2, seq=16, dtype=None, tol=None, seed=0,
            backend="auto", timeout=600.0, plan=None))
        print(verify.render(checked))
        _section(f"3/3 bench --tp {args.tp}: latency and throughput")
        measured = bench.run_bench(argparse.Namespace(
            path=str(path), tp=args.tp, batch=1, seq=64, new_tokens=16, reps=5, threads=1,
            dtype=None, seed=0, backend="auto", timeout=600.0, plan=None))
        print(bench.render(measured))
        print(f"\nnext: `torchtp estimate --model {path if args.keep else '<model dir>'} --tp 1,2,4,8 "
              "--hardware h100-nvlink` predicts when tp pays off on real GPUs")
    return 0 if checked["passed"] else 1
