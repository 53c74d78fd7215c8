"""Every HF architecture the suite knows at tp 3, where nothing divides: logits, grads,
an SGD step and generation against the unsharded model.

Slow (one 3-rank launch over about 30 models): run by ``make test-all`` and by
``make compat`` on the newest releases (docs/compat.md), where a new transformers
release that changes a model's plan or layout shows up first.
"""

from __future__ import annotations

import pytest

from ._hf_checks import check_archs
from .test_hf_models import ARCHS
from .test_hf_more_archs import SOURCES


@pytest.mark.slow
def test_every_architecture_at_tp3(ranks):
    archs = [*ARCHS, *SOURCES]
    results = ranks(check_archs, 3, archs, 1, timeout=900, gloo_timeout=120)
    for arch in archs:
        got = results[0][arch]
        assert got["layers"] > 0, arch
        assert got["collectives"] == got["planned"], arch
