"""The optimizer-step check: replicated parameters agreed across TP ranks before each step."""

from __future__ import annotations

import pytest

from torchtp import step_check

from . import _step_checks as checks


def test_rank_local_changes_raise_on_every_rank_and_torchtp_clip_stays_exact(ranks):
    got = ranks(checks.cases, 2)
    assert got[0] == got[1]  # every rank raised the same error
    out = got[0]
    assert "optimizer step 1:" in out["edit_first"] and "optimizer step 4:" in out["edit_step_n"]
    assert out["torchtp_clip_err"][0] < 1e-6  # float32 rounding of a 3-step SGD run
    # plain optimizer: no collective; torchtp's: one all-reduce; TP_STEP_CHECK=0: none
    assert out["untouched"] == [0, {"all_reduce:step_check": 1}, 0]


def test_step_check_period_from_env(monkeypatch):
    monkeypatch.delenv(step_check.ENV, raising=False)
    assert step_check.period_from_env() == 10
    monkeypatch.setenv(step_check.ENV, "0")
    assert step_check.period_from_env() == 0
    monkeypatch.setenv(step_check.ENV, "often")
    with pytest.raises(ValueError, match=r"TP_STEP_CHECK='often' must be an integer >= 0"):
        step_check.period_from_env()
