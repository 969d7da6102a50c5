"""The learning-rate schedule is a pure function of the step."""

import math

import pytest

from ptbr.train.schedule import lr_at


def test_linear_warmup_then_cosine_to_ten_percent():
    lrs = [lr_at(step, 1e-3, 10, 110, 0.1) for step in range(110)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)  # warmup ends at the peak
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-4)
    assert lr_at(110, 1e-3, 10, 110, 0.1) == pytest.approx(1e-4)  # floor at 10%
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


def test_no_warmup():
    assert lr_at(0, 1.0, 0, 10, 0.0) == 1.0
