"""Exit codes and exit times of many short tensor-parallel jobs, beside a plain-torch control.

Each run starts ``--tp`` fresh Python processes the way ``torchrun`` does
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment);
each process runs one short job and ends. A variant is ``work/start/error``:

* ``start``: ``torchtp`` calls ``torchtp.init_tensor_parallel()`` (or
  ``init_parallel(pp=2)``) and returns from the script, leaving the exit to
  torchtp; ``dist`` calls ``dist.init_process_group("gloo")`` itself and ends
  with ``dist.destroy_process_group()``, as HF Trainer, accelerate and
  Lightning do.
* ``error``: ``mismatch`` first feeds each rank a different batch in training
  mode and handles the ``RankMismatchError`` every rank raises.
* ``work``: ``forward`` wraps a 3-layer MLP, runs an eval forward and a
  training forward and backward, then the script's own ``all_gather_object``
  (issue 35's job); ``generate`` greedy-decodes 4 tokens with a tiny HF Llama;
  ``save`` writes a tiny Llama with ``save_pretrained``; ``pipeline`` runs one
  training step of a 2-stage ``PipelineSchedule`` and an optimizer step;
  ``moe`` runs a forward and backward of a tiny Qwen3-MoE; ``control`` is plain
  torch: the same kind of collectives on plain tensors (all-reduce, all-gather,
  ``all_gather_object``), the same handled exception, no torchtp (``start``
  ``torchtp`` there: the script starts the group and never destroys it);
  ``hfcontrol`` also imports transformers and generates with the tiny Llama
  unsharded on every rank, the control of the HF jobs.

A run passes when every process exits with 0. Torch's Gloo can abort a process
at exit ("terminate called without an active exception", exit code -6) when a
process group outlives ``destroy_process_group()`` into the interpreter's
shutdown (docs/decisions.md, decision 148); the SIGABRT column
counts those runs. A process's *exit time* is from the last line of its script
to the end of the process (the script prints ``time.time()`` there; the parent
notes when the process ended): what torchtp's exit handling costs. "slow" counts
processes whose exit took more than 1 s longer than the control's median (the
plain control of the same ``start``; for the HF jobs, ``hfcontrol``).

    .venv/bin/python benchmarks/exit_loop.py [--runs 250] [--variants all|forward|work|LIST]
        [--load N] [--jobs J] [--tp 2]

A variant may end in ``/dynamo`` (``hfcontrol/dist/none/dynamo``): its script
imports ``torch._dynamo`` before the group starts (decision 157: dynamo imports
``torch.distributed.nn.functional``, which, imported while a group exists, keeps
the group alive past its destroy; ``import torchtp`` imports that module alone).

``--load N`` starts N busy-loop processes beside the runs (a loaded node);
``--jobs J`` runs J launches at a time.

``--fail-rank R`` (with ``--variants forward/torchtp/none``) makes rank R fail
after four forwards instead (``--fail-how raise``: RuntimeError; ``input``: an
input of the wrong width, which torchtp's layer rejects on that rank only;
``exit``: ``sys.exit(1)``); the run then passes when rank R exits with 1 and the
other ranks report an error naming rank R, all within ``--deadline`` seconds.
"lag" is the time between the first and the last process exit of a run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

SCRIPT = r"""
import os, sys, time, torch
import torch.distributed as dist
from torch import nn

work, start, error = (os.environ[f"EXIT_LOOP_{k}"] for k in ("WORK", "START", "ERROR"))
fail_rank, how = int(os.environ["EXIT_LOOP_FAIL_RANK"]), os.environ["EXIT_LOOP_FAIL_HOW"]
if os.environ.get("EXIT_LOOP_PRELOAD") == "1":
    import torch._dynamo  # before the group: see docs/troubleshooting.md
if not work.endswith("control"):
    import torchtp
if start == "torchtp":
    torchtp.init_parallel(pp=2) if work == "pipeline" else torchtp.init_tensor_parallel()
else:  # as Trainer, accelerate and Lightning do: the script starts and ends the group
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def llama():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
if work == "hfcontrol":  # the HF jobs' control: transformers imported and run, no torchtp
    llama().eval().generate(ids[:, :4], max_new_tokens=4, do_sample=False)
if work in ("control", "hfcontrol"):  # plain torch: the same kinds of collectives
    x = torch.randn(2, 32)
    if error == "mismatch":
        try:
            raise ValueError("a handled error")
        except ValueError:
            pass
    t = x.clone()
    dist.all_reduce(t)
    dist.all_gather(list(torch.empty(world, 2, 32).unbind(0)), x)
    dist.all_gather_object([None] * world, float(t.sum()))
elif work == "forward":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 32))
    tp = torchtp.DistributedModelWrapper(model)
    x = torch.randn(2, 32)
    if error == "mismatch":  # rank-dependent batch: every rank raises, the script goes on
        try:
            tp(x + rank)
            raise AssertionError("the input check did not raise")
        except torchtp.RankMismatchError:
            pass
    tp.eval()
    with torch.no_grad():
        for step in range(6 if fail_rank >= 0 else 1):
            # The fault comes at step 4: the others are inside their next collective.
            if rank == fail_rank and step == 4:
                if how == "input":
                    x = torch.randn(2, 31)  # wrong input on this rank only
                elif how == "raise":
                    raise RuntimeError("boom")
                else:
                    print("bad batch: exiting", file=sys.stderr)
                    sys.exit(1)  # no exception reaches sys.excepthook
            y = tp(x)
    tp.train()
    tp(x).sum().backward()
    dist.all_gather_object([None] * world, float(y.sum()))
elif work == "generate":
    tp = torchtp.DistributedModelWrapper(llama().eval())
    tp.generate(ids[:, :4], max_new_tokens=4, do_sample=False)
elif work == "save":
    tp = torchtp.DistributedModelWrapper(llama())
    tp.save_pretrained(os.environ["EXIT_LOOP_DIR"])
elif work == "pipeline":
    from torchtp.pipeline import PipelineSchedule, decoder_stage
    if start == "dist":
        torchtp.init_parallel(pp=2)  # adopts the script's group
    stage = decoder_stage(llama(), rank, world)
    pipe = PipelineSchedule(stage, 2, "1f1b")
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    pipe.step(ids, ids)
    opt.step()
elif work == "moe":
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      moe_intermediate_size=24, num_experts=4,
                                      num_experts_per_tok=2, intermediate_size=48)
    tp = torchtp.DistributedModelWrapper(transformers.Qwen3MoeForCausalLM(cfg).train())
    tp(input_ids=ids, labels=ids).loss.backward()
print("END", time.time(), flush=True)
if start == "dist":
    dist.destroy_process_group()
"""

WORKS = ("forward", "generate", "save", "pipeline", "moe")
FORWARD = ["forward/torchtp/none", "forward/torchtp/mismatch", "forward/dist/none",
           "forward/dist/mismatch"]
WORK = [f"{w}/{s}/none" for w in WORKS[1:] for s in ("dist", "torchtp")]
CONTROLS = ["control/dist/none", "control/dist/mismatch", "control/torchtp/none",
            "hfcontrol/dist/none"]
VARIANTS = {"forward": FORWARD, "work": WORK, "control": CONTROLS,
            "all": FORWARD + WORK + CONTROLS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    """One launch: each process's exit code (``None``: killed at the deadline), stderr's
    last line and exit time (s from its script's last line to its end; ``None``: unknown)."""

    codes: list[int | None]
    tails: list[str]
    exits: list[float | None]
    lag: float  # s between the first and the last process exit


@dataclass
class Tally:
    """A variant's runs."""

    outcomes: Counter[str] = field(default_factory=Counter)
    exits: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)  # 1-minute load average after each run


def one_run(tp: int, fail_rank: int, how: str, deadline: float, start: str = "torchtp",
            error: str = "none", work: str = "forward", preload: bool = False) -> Run:
    """Launch ``tp`` rank processes of one job (see the module docstring) and wait for them.

    Control processes run the plain-torch ``start`` analogue: ``torchtp`` there means
    the script starts the group itself and never destroys it. ``preload``: the script
    imports ``torch._dynamo`` before the group starts (a variant ending in ``/dynamo``).
    """
    with tempfile.TemporaryDirectory(prefix="exit_loop-") as tmp:
        procs = launch(SCRIPT, tp, tmp, subprocess.PIPE, EXIT_LOOP_FAIL_RANK=str(fail_rank),
                       EXIT_LOOP_FAIL_HOW=how, EXIT_LOOP_START=start, EXIT_LOOP_ERROR=error,
                       EXIT_LOOP_WORK=work, EXIT_LOOP_PRELOAD="1" if preload else "0")
        return _collect(procs, deadline)


def launch(script: str, tp: int, tmp: str, stderr: int, **job: str) -> list[subprocess.Popen[str]]:
    """Start ``tp`` torchrun-style rank processes running ``script`` with the ``job`` variables.

    ``tmp`` holds what the job writes; ``EXIT_LOOP_PRELOAD`` (``"1"``) makes the script
    import ``torch._dynamo`` before the group starts.
    """
    # The control's analogue of a torchtp-started group: started by the script, never destroyed
    if job["EXIT_LOOP_WORK"].endswith("control") and job["EXIT_LOOP_START"] == "torchtp":
        job["EXIT_LOOP_START"] = "none"
    env_base = dict(os.environ, WORLD_SIZE=str(tp), LOCAL_WORLD_SIZE=str(tp),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                    OMP_NUM_THREADS="1", EXIT_LOOP_DIR=os.path.join(tmp, "saved"), **job)
    return [subprocess.Popen([sys.executable, "-c", script],
                             env=dict(env_base, RANK=str(r), LOCAL_RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=stderr, text=True)
            for r in range(tp)]


def _collect(procs: list[subprocess.Popen[str]], deadline: float) -> Run:
    """Wait for every process (killing what is left at ``deadline``), noting when each ended."""
    ended: dict[int, float] = {}
    out: dict[int, tuple[str, str]] = {}

    def watch(rank: int, p: subprocess.Popen[str]) -> None:
        try:
            out[rank] = p.communicate(timeout=deadline)
            ended[rank] = time.time()
        except subprocess.TimeoutExpired:
            p.kill()
            out[rank] = p.communicate()

    threads = [threading.Thread(target=watch, args=(r, p)) for r, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = [p.returncode if r in ended else None for r, p in enumerate(procs)]
    tails = [err.strip().splitlines()[-1] if err.strip() else "" for _o, err in
             (out[r] for r in range(len(procs)))]
    exits = [_exit_time(out[r][0], ended.get(r)) for r in range(len(procs))]
    lag = max(ended.values()) - min(ended.values()) if ended else deadline
    return Run(codes, tails, exits, lag)


def _exit_time(stdout: str, ended: float | None) -> float | None:
    marks = [line.split()[1] for line in stdout.splitlines() if line.startswith("END ")]
    return None if not marks or ended is None else ended - float(marks[-1])


def _busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes spinning on a core each, as other jobs on a busy node do."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _passed(run: Run, fail_rank: int) -> bool:
    if fail_rank < 0:
        return all(c == 0 for c in run.codes)
    others = [t for r, t in enumerate(run.tails) if r != fail_rank]
    return run.codes[fail_rank] == 1 and None not in run.codes \
        and all(f"rank {fail_rank}" in t for t in others)


def run_interleaved(args: argparse.Namespace, variants: list[str]) -> dict[str, Tally]:
    """``args.runs`` launches of each variant (``work/start/error``), ``args.jobs`` at a time.

    The variants take turns (run i of every variant before run i + 1 of any), so a control
    runs under the same load as the jobs it is compared with.
    """
    rows = {v: Tally() for v in variants}
    order = [(i, v) for i in range(args.runs) for v in variants]

    def start_job(item: tuple[int, str]) -> Run:
        work, start, error, *preload = item[1].split("/")
        return one_run(args.tp, args.fail_rank, args.fail_how, args.deadline, start, error, work,
                       preload == ["dynamo"])

    with ThreadPoolExecutor(args.jobs) as pool:
        for (i, variant), run in zip(order, pool.map(start_job, order), strict=True):
            _count(rows[variant], run, args.fail_rank, f"{variant} run {i}")
            if variant == variants[-1] and (i + 1) % 25 == 0:
                print(f"after {i + 1} rounds:", *table(rows, i + 1)[2:], sep="\n",
                      file=sys.stderr, flush=True)
    return rows


def _count(tally: Tally, run: Run, fail_rank: int, name: str) -> None:
    ok = _passed(run, fail_rank)
    tally.outcomes["pass" if ok else "fail"] += 1
    tally.outcomes["abort"] += any(c == -signal.SIGABRT for c in run.codes)
    tally.exits += [e for e in run.exits if e is not None]
    tally.lags.append(run.lag)
    tally.loads.append(os.getloadavg()[0])
    if not ok:
        print(f"{name}: exit codes {run.codes}; stderr tails: {run.tails}", flush=True)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def table(rows: dict[str, Tally], runs: int) -> list[str]:
    """The results as a markdown table; exit times against the control of the same start."""
    controls = {tuple(v.split("/")[:2]): statistics.median(t.exits) for v, t in rows.items()
                if v.split("/")[0].endswith("control") and t.exits}
    lines = ["| variant | runs | exited 0 | SIGABRT | other failures | exit s median / p99 / max "
             "| control's median exit s | slow (> control + 1 s) | load average (1 min) |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for variant, t in rows.items():
        work, start = variant.split("/")[:2]
        # The HF jobs against the control that imports and runs transformers too
        base = controls.get(("hfcontrol", "dist") if work in WORKS[1:] else ("control", start))
        against, slow = "-", "-"
        if base is not None and not work.endswith("control"):
            against, slow = f"{base:.2f}", str(sum(e > base + 1.0 for e in t.exits))
        lines.append(f"| {variant} | {runs} | {t.outcomes['pass']} | {t.outcomes['abort']} "
                     f"| {t.outcomes['fail'] - t.outcomes['abort']} "
                     f"| {_quantile(t.exits, 0.5):.2f} / {_quantile(t.exits, 0.99):.2f} / "
                     f"{max(t.exits, default=float('nan')):.2f} | {against} | {slow} "
                     f"| {statistics.mean(t.loads):.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=250, help="runs per variant")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--variants", default="all",
                    help="all, forward, work, control, or work/start/error (comma-separated)")
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-how", choices=["raise", "input", "exit"], default="raise")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="busy-loop processes running beside the launches")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--jobs", type=int, default=1, help="launches running at the same time")
    args = ap.parse_args()
    variants = [v for item in args.variants.split(",") for v in VARIANTS.get(item, [item])]
    loops = _busy_loops(args.load)

    def stop(*_: object) -> None:  # SIGTERM (timeout, kill): leave no busy loop behind
        for p in loops:
            p.kill()
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    began = time.time()
    try:
        rows = run_interleaved(args, variants)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(began))}-"
          f"{time.strftime('%H:%M UTC', time.gmtime())}, tp {args.tp}, busy loops beside: "
          f"{args.load}, launches at a time: {args.jobs}, load average at the end: "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print("\n".join(table(rows, args.runs)))


if __name__ == "__main__":
    main()
