"""``torchtp estimate``: predicted prefill/decode time and speedup per tp size."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from ..costmodel import PRESETS, ModelDims, dims_from_config, get_hardware, read_config, sweep
from ._common import CliError, dump_json, int_list, positive_int, table

HELP = "predict compute/communication time and speedup over tp=1 (alpha-beta cost model)"
EXAMPLES = """examples:
  torchtp estimate --model ./Llama-3.2-1B --tp 1,2,4,8 --hardware h100-nvlink
  torchtp estimate --hidden 4096 --layers 32 --heads 32 --ffn 11008 --vocab 32000 \\
      --tp 2,4,8 --hardware a100-nvlink --batch 1 --seq 512
  torchtp estimate --model config.json --tp 2 --hardware cpu-gloo --json
"""


def register(sub: Any) -> None:
    """Add the ``estimate`` subcommand."""
    p = sub.add_parser("estimate", help=HELP, description=HELP, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory or config.json (instead of the sizes below)")
    for name, what in (("hidden", "hidden size"), ("layers", "decoder layers"),
                       ("heads", "attention heads"), ("kv-heads", "key/value heads (default: heads)"),
                       ("ffn", "MLP intermediate size (default: 4*hidden)"),
                       ("vocab", "vocabulary size (default: 32000)")):
        p.add_argument(f"--{name}", type=positive_int, help=what)
    p.add_argument("--tp", type=int_list, default=[1, 2, 4, 8],
                   help="tp sizes, comma-separated (default: 1,2,4,8)")
    p.add_argument("--hardware", default="h100-nvlink",
                   help=f"preset: {', '.join(PRESETS)} (default: h100-nvlink)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per step (default 1)")
    p.add_argument("--seq", type=positive_int, default=512,
                   help="prompt length for prefill and KV-cache length for decode (default 512)")
    p.add_argument("--dtype-bytes", type=positive_int, help="bytes per element (default: preset's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def model_dims(args: argparse.Namespace) -> ModelDims:
    """Dimensions from ``--model`` or from the size flags.

    Raises:
        CliError: neither given, or required sizes missing.
    """
    try:
        if args.model:
            return dims_from_config(read_config(args.model), source=args.model)
        missing = [f"--{n}" for n in ("hidden", "layers", "heads") if getattr(args, n) is None]
        if missing:
            raise CliError("give --model PATH, or the model sizes: missing " + ", ".join(missing))
        return ModelDims.make(hidden=args.hidden, layers=args.layers, heads=args.heads,
                              ffn=args.ffn, vocab=args.vocab or 32000, kv_heads=args.kv_heads)
    except ValueError as err:
        raise CliError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    """Print the estimate table."""
    try:
        hw = get_hardware(args.hardware)
    except ValueError as err:
        raise CliError(str(err)) from None
    dims = model_dims(args)
    tps = sorted(set(args.tp) | {1})
    rows = sweep(dims, hw, tps, batch=args.batch, seq=args.seq, dtype_bytes=args.dtype_bytes)
    if args.json:
        print(dump_json({"model": dims.as_dict(), "hardware": hw.as_dict(), "batch": args.batch,
                         "seq": args.seq, "estimates": [e.as_dict() for e in rows]}))
        return 0
    print(f"model: hidden={dims.hidden} layers={dims.layers} heads={dims.heads} "
          f"kv_heads={dims.kv_heads} ffn={dims.ffn} vocab={dims.vocab}")
    print(f"hardware: {hw.name}")
    print(textwrap.fill(f"source: {hw.source}", width=100, subsequent_indent="  "))
    print(f"batch={args.batch}, prefill of {args.seq} tokens, decode with {args.seq} cached tokens")
    print(table(["phase", "tp", "compute/layer ms", "comm/layer ms", "all-reduce KiB",
                 "total ms", "speedup", "tokens/s", "weights GiB/rank"],
                [[e.phase, e.tp, e.compute_per_layer * 1e3, e.comm_per_layer * 1e3,
                  e.allreduce_bytes / 1024, e.total * 1e3, e.speedup, e.tokens_per_s,
                  e.weight_bytes_per_rank / 2**30]
                 for e in rows]))
    print("speedup < 1 means tp makes this step slower than one device: communication and fixed "
          "overhead outweigh the split compute.")
    return 0
