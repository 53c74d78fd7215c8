"""A planned layout as a small file that ``init_parallel(layout=...)`` reads.

``torchtp plan MODEL --gpus N --out layout.json`` writes the layout the
planner chose (:mod:`torchtp.planner`); the launch reads the same file, so
the job runs exactly what was planned, and a job whose world or group does
not match it is refused with the difference named, on every rank, before
any group is laid out.

The file is JSON::

    {"torchtp_layout": 1, "world": 16, "pp": 2, "dp": 2, "cp": 1, "tp": 4, "ep": 1,
     "microbatches": 8, "schedule": "1f1b", "stages_per_rank": 1, "stage_layers": [],
     "sequence_parallel": false, "data_parallel": "fsdp", "model": "...",
     "predicted": {...}}

Only the sizes are read back by ``init_parallel``; the rest says what the
planner assumed (the schedule and microbatches for ``PipelineSchedule``,
its predictions) and is kept for the reader.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path
from typing import Any

VERSION = 1
SIZES = ("pp", "dp", "cp", "tp", "ep")


@dataclass(frozen=True)
class Layout:
    """How the ranks of one job are laid out, and how a step runs on them.

    Attributes:
        pp: Pipeline stages.
        dp: Data-parallel replicas.
        cp: Context-parallel ranks (the sequence split).
        tp: Tensor-parallel ranks.
        ep: Expert-parallel ranks (experts shared out over ``ep`` groups; in
            torchtp they are folded into the TP group, so ``ep`` divides ``tp``).
        microbatches: Microbatches per step (per data-parallel replica).
        schedule: Pipeline schedule (a :class:`torchtp.pipeline.PipelineSchedule` name).
        stages_per_rank: Pipeline stages each rank holds (``v`` of an interleaved
            schedule; 2 for ``dualpipev``).
        stage_layers: Decoder layers of each of the ``pp`` stages
            (``decoder_stage(split=...)``); empty: the balanced split.
        sequence_parallel: Norms and residuals on sequence shards inside TP.
        data_parallel: ``"ddp"`` (replicas), ``"zero1"`` (optimizer state
            sharded over ``dp``) or ``"fsdp"`` (parameters, gradients and
            optimizer state sharded over ``dp``, FSDP2).
        extra: What the planner predicted and assumed (not read back).
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    stage_layers: tuple[int, ...] = ()
    sequence_parallel: bool = False
    data_parallel: str = "fsdp"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def world(self) -> int:
        """Ranks the layout needs: ``pp * dp * cp * tp`` (``ep`` reuses them)."""
        return self.pp * self.dp * self.cp * self.tp

    def sizes(self) -> dict[str, int]:
        """The mesh sizes, ``init_parallel``'s arguments."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep}

    def short(self) -> str:
        """``"pp 2 x dp 4 x tp 8"``: the sizes above 1 (``"one rank"`` when none)."""
        parts = [f"{k} {v}" for k, v in self.sizes().items() if v > 1]
        return " x ".join(parts) or "one rank"

    def as_dict(self) -> dict[str, Any]:
        """The file's contents."""
        data = asdict(self)
        extra = data.pop("extra")
        return {"torchtp_layout": VERSION, "world": self.world, **data, **extra}


def write_layout(layout: Layout, path: str | Path) -> Path:
    """Write ``layout`` as JSON to ``path``; returns the path."""
    out = Path(path)
    out.write_text(json.dumps(layout.as_dict(), indent=2, sort_keys=False) + "\n")
    return out


def read_layout(source: str | Path | dict[str, Any] | Layout, who: str = "init_parallel") -> Layout:
    """A :class:`Layout` from a file written by :func:`write_layout` (or its dict).

    Raises:
        ValueError: the file is missing or not a torchtp layout, a size is not
            a positive int, or ``world`` disagrees with the sizes.
    """
    if isinstance(source, Layout):
        return source
    data = source if isinstance(source, dict) else _load(source, who)
    if data.get("torchtp_layout") != VERSION:
        raise ValueError(f"{who}: layout={_shown(source)} is not a torchtp layout file (no "
                         f"'torchtp_layout': {VERSION}); write one with `torchtp plan MODEL "
                         "--gpus N --out FILE`")
    sizes = {k: data.get(k, 1) for k in SIZES}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise ValueError(f"{who}: layout={_shown(source)}: sizes must be positive ints, got {bad}")
    world = prod(sizes[k] for k in ("pp", "dp", "cp", "tp"))
    if data.get("world", world) != world:
        raise ValueError(f"{who}: layout={_shown(source)} says world={data['world']} but its "
                         f"sizes multiply to {world} (pp x dp x cp x tp)")
    known = set(SIZES) | {"microbatches", "schedule", "stages_per_rank", "stage_layers",
                          "sequence_parallel", "data_parallel"}
    extra = {k: v for k, v in data.items() if k not in known | {"torchtp_layout", "world"}}
    rest = {k: data[k] for k in known - set(SIZES) if k in data}
    if "stage_layers" in rest:
        rest["stage_layers"] = tuple(rest["stage_layers"])
    return Layout(**sizes, **rest, extra=extra)


def _load(path: str | Path, who: str) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as err:
        raise ValueError(f"{who}: cannot read layout file {p}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{who}: layout file {p} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{who}: layout file {p} is not a JSON object")
    return data


def _shown(source: Any) -> str:
    return repr(str(source)) if not isinstance(source, dict) else "{...}"


def differences(layout: Layout, world: int, sizes: dict[str, int]) -> list[str]:
    """What differs between the planned ``layout`` and a job's ``world`` and mesh ``sizes``."""
    out = []
    if world != layout.world:
        out.append(f"the plan is for {layout.world} ranks ({layout.short()}), this job has {world}")
    for k in SIZES:
        if k in sizes and sizes[k] != getattr(layout, k):
            out.append(f"{k}: planned {getattr(layout, k)}, the job's group has {sizes[k]}")
    return out
