"""The optimizer-step check: replicated parameters agreed across TP ranks before each step."""

from __future__ import annotations

import pytest
import torch

from torchtp.guards import step_check

from . import _step_checks as checks


def test_rank_local_changes_raise_on_every_rank_and_torchtp_clip_stays_exact(ranks):
    got = ranks(checks.cases, 2)
    assert got[0] == got[1]  # every rank raised the same error
    out = got[0]
    assert "optimizer step 1:" in out["edit_first"] and "optimizer step 4:" in out["edit_step_n"]
    assert out["torchtp_clip_err"][0] < 1e-6  # float32 rounding of a 3-step SGD run
    # One overflow on one rank: torchtp's GradScaler skips and scales as one process
    got_scales, want_scales = out["grad_scalers"]["scales"]
    assert got_scales == want_scales and got_scales[0] < 2.0**10  # skipped, scale backed off
    assert out["grad_scalers"]["err"] < 1e-6  # float32 rounding of the two SGD steps taken
    # torch's, accelerate's and Lightning's clips, routed: torchtp's clip, bit for bit
    assert out["framework_clips"] == [0.0, 0.0, 0.0]
    # LoRA A of a weight-rows-split layer and B of a weight-columns-split one are replicated
    assert out["peft"][0] == ["0.lora_A.default.weight", "3.lora_B.default.weight",
                              "5.0.lora_A.default.weight"]
    # plain optimizer: no collective; torchtp's: one all-reduce; TP_STEP_CHECK=0: none
    assert out["untouched"] == [0, {"all_reduce:step_check": 1}, 0]
    # a NaN on one rank only: in a gradient, and in a weight between weight checks
    assert "optimizer step 1:" in out["nan"][0]
    assert "optimizer step 3:" in out["nan"][1]


def test_step_check_period_from_env(monkeypatch):
    monkeypatch.delenv(step_check.ENV, raising=False)
    assert step_check.period_from_env() == 10
    monkeypatch.setenv(step_check.ENV, "0")
    assert step_check.period_from_env() == 0
    monkeypatch.setenv(step_check.ENV, "often")
    with pytest.raises(ValueError, match=r"TP_STEP_CHECK='often' must be an integer >= 0"):
        step_check.period_from_env()


def _digest(t: torch.Tensor) -> torch.Tensor:
    plan = step_check._Plan(10, ["t"], [t], None)
    return step_check.digest(plan, [t])


def test_digest_is_deterministic_and_sees_scaling_one_element_and_permutations():
    torch.manual_seed(0)
    t = torch.randn(100, 300)  # larger than the sample: the norm covers every element
    assert torch.equal(_digest(t), _digest(t.clone()))
    one = t.clone()
    one[5, 5] *= 1.01  # one element (|x| ~ 1) off by 1%, not in the strided sample (stride 468)
    swapped = t.clone().reshape(-1)
    swapped[[0, 468]] = swapped[[468, 0]]  # two sampled elements exchanged
    swapped = swapped.reshape(100, 300)
    for other in (t * 1.001, one, swapped, -t):
        assert not torch.equal(_digest(t), _digest(other))
    assert _digest(None)[0] == -1 and _digest(torch.empty(0))[0] == 0  # type: ignore[arg-type]
