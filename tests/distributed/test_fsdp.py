"""FSDP2 (``fully_shard`` over the DP mesh) around torchtp models, against one process."""

from __future__ import annotations

import pytest

from . import _fsdp_checks as checks


def test_fsdp2_trains_exactly_and_resumes_from_dcp(ranks, tmp_path):
    """Grad-synced parameters, sequence and loss parallelism, LoRA; DCP save and resume."""
    got = ranks(checks.fsdp_suite, 4, str(tmp_path / "ckpt"), timeout=300)
    norms = [{k: v for k, v in g.items() if k != "resume"} for g in got]
    assert all(n == norms[0] for n in norms)  # every rank clipped by the same norms
    assert len(norms[0]) == len(checks.CASES)
    for g in got:
        assert g["resume"]["loaded"] == (2, {"note": "x"})
        assert g["resume"]["resumed"] == g["resume"]["uninterrupted"]  # bit for bit


@pytest.mark.slow
def test_compiled_fsdp2_model_with_grad_synced_parameters_matches_one_process(ranks):
    got = ranks(checks.compiled, 4, timeout=580)
    assert all(g == got[0] for g in got)
