"""FSDP2 (``fully_shard`` over the DP mesh) around torchtp models, against one process."""

from __future__ import annotations

from . import _fsdp_checks as checks


def test_fsdp2_with_grad_synced_parameters_matches_one_process(ranks):
    got = ranks(checks.synced_grads, 4, timeout=300)
    assert all(g == got[0] for g in got)  # every rank clipped by the same norms
    assert len(got[0]) == len(checks.CASES)
