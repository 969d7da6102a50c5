"""`--precision auto`: one rule (ptbr/precision.py) for the run and for preflight's plan."""

from __future__ import annotations

import pytest

from ptbr.precision import auto_precision


@pytest.mark.parametrize("device, native, pretraining, expected", [
    ("cuda", True, True, "bf16"), ("cuda", True, False, "bf16"),
    ("cuda", False, True, "fp16"), ("cuda", False, False, "fp16"),  # T4-class: fp16 with GradScaler
    ("cpu", True, True, "bf16"),  # AVX512-BF16 or AMX, pretraining
    ("cpu", True, False, "fp32"),  # fine-tuning on a CPU stays fp32
    ("cpu", False, True, "fp32"), ("cpu", False, False, "fp32"),
    ("mps", False, True, "fp32"), ("mlx", False, False, "bf16"),
])
def test_auto_precision(device, native, pretraining, expected):
    assert auto_precision(device, native, pretraining) == expected


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("mode", ["pretrain", "finetune"])
def test_the_run_and_preflight_choose_the_same_on_a_cpu(monkeypatch, native, mode):
    import dataclasses

    import torch

    from ptbr.backends.torch import device as devices
    from ptbr.preflight.recommend import choose_precision
    from tests.test_preflight import MACHINES

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    run = devices.resolve_precision(torch.device("cpu"), "auto", pretraining=mode == "pretrain").precision
    hardware = dataclasses.replace(MACHINES["cpu24"], cpu_bf16=native)
    assert choose_precision(hardware, "cpu", "auto", [], mode) == run
