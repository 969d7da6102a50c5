"""What only a CUDA GPU shows: mixed precision, GradScaler, device memory. Skipped without one."""

from __future__ import annotations

import json

import pytest
import torch

from ptbr.cli import main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_auto_precision_picks_real_bf16_or_fp16_with_a_scaler(tmp_path):
    from ptbr.backends.torch.device import has_real_bf16, resolve_precision

    placement = resolve_precision(torch.device("cuda"), "auto")
    assert placement.precision == ("bf16" if has_real_bf16() else "fp16")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_training_learns_on_the_gpu(tmp_path, precision):
    from ptbr.backends.torch.device import has_real_bf16

    if precision == "bf16" and not has_real_bf16():
        pytest.skip("this GPU has no native bf16")
    out = tmp_path / "run"
    assert main(["train", "--output", str(out), "--model-size", "tiny", "--seq-len", "128", "--batch-size", "8",
                 "--max-steps", "60", "--device", "cuda", "--precision", precision]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(row["mem_bytes"] > 0 for row in rows)


def test_bf16_is_refused_where_only_emulated(tmp_path):
    from ptbr.backends.torch.device import has_real_bf16

    if has_real_bf16():
        pytest.skip("this GPU has native bf16")
    assert main(["train", "--output", str(tmp_path), "--device", "cuda", "--precision", "bf16",
                 "--max-steps", "1"]) == 5
