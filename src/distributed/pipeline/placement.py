"""Which of PyTorch's schedules a name means, and which stages each rank holds under it.

``torch.distributed.pipelining`` places stages in one of three ways:

* one stage per rank (GPipe, 1F1B): rank ``r`` holds stage ``r``;
* looped (Interleaved 1F1B, looped BFS, interleaved zero bubble): ``v`` stages
  per rank, rank ``r`` holding ``r, r + p, r + 2p, ...``;
* V-shaped (ZB-V, DualPipeV): two stages per rank, ``r`` and ``2p - 1 - r``,
  so the first and the last stage share rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule name's PyTorch class and how it places stages on ranks.

    Attributes:
        cls: PyTorch's schedule class.
        style: ``"single"``, ``"loop"`` or ``"v"`` (see the module docstring).
        min_microbatches_per_stage: ``1F1B`` needs at least one microbatch per
            stage in flight; the others check their own rules when built.
    """

    cls: type
    style: str
    min_microbatches_per_stage: int = 0


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(ScheduleGPipe, "single"),
    "1f1b": ScheduleKind(Schedule1F1B, "single", 1),
    "interleaved1f1b": ScheduleKind(ScheduleInterleaved1F1B, "loop"),
    "loopedbfs": ScheduleKind(ScheduleLoopedBFS, "loop"),
    "interleavedzb": ScheduleKind(ScheduleInterleavedZeroBubble, "loop"),
    "zbv": ScheduleKind(ScheduleZBVZeroBubble, "v"),
    "dualpipev": ScheduleKind(ScheduleDualPipeV, "v"),
}
"""Schedule names (case, ``_`` and ``-`` ignored; ``"zerobubble"`` may be spelled
``"zb"``, so PyTorch's class names without ``Schedule`` work too)."""


def schedule_kind(name: str) -> ScheduleKind:
    """The :class:`ScheduleKind` of ``name``.

    Raises:
        ValueError: an unknown name, listing the valid ones.
    """
    key = name.lower().replace("_", "").replace("-", "").replace("zerobubble", "zb")
    key = key.removeprefix("schedule")
    kind = SCHEDULES.get({"zbvzb": "zbv"}.get(key, key))  # PyTorch's ZBVZeroBubble
    if kind is None:
        raise ValueError(f"schedule={name!r} is not a pipeline schedule; valid: "
                         f"{sorted(SCHEDULES)}")
    return kind


def stage_ids(schedule: str, pp_rank: int, pp_size: int, per_rank: int = 1) -> list[int]:
    """The stages rank ``pp_rank`` of ``pp_size`` holds under ``schedule``.

    Args:
        schedule: A name of :data:`SCHEDULES`.
        pp_rank: This rank in the pipeline group.
        pp_size: Ranks in the pipeline group.
        per_rank: Stages per rank: 1 for GPipe and 1F1B, 2 for the V-shaped
            schedules, any positive number for the looped ones.

    Returns:
        Stage indices out of ``pp_size * per_rank`` stages, in order.

    Raises:
        ValueError: an unknown schedule, or a ``per_rank`` it cannot run.
    """
    kind = schedule_kind(schedule)
    need = {"single": 1, "v": 2}.get(kind.style)
    if per_rank < 1 or (need is not None and per_rank != need):
        wanted = need if need is not None else "1 or more"
        raise ValueError(f"per_rank={per_rank}: schedule {schedule!r} runs {wanted} stage(s) "
                         "per rank")
    if kind.style == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(per_rank)]
