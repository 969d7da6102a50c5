"""The batch vocabulary every backend and every data source share (numpy only, no torch or mlx).

A batch is a dict of numpy int64 arrays: input_ids (B, T), labels (B, T) already aligned with the
inputs (labels[:, t] is the token that should follow input_ids[:, t]; IGNORE_INDEX where no loss
is taken), and optionally attention_mask (B, T) for padded fine-tuning batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100

Batch = dict  # str -> np.ndarray, as described above


@dataclass
class StepResult:
    """What a backend's train_step reports for one optimizer step."""

    loss: float  # mean loss per target token over the whole optimizer step
    grad_norm: float  # before clipping
    target_tokens: int
    input_tokens: int
    skipped: bool  # the update was not applied (non-finite loss or gradients)


def windows_to_batch(windows: np.ndarray) -> Batch:
    """Pretraining: (B, T + 1) token windows -> inputs and next-token labels, shifted once here."""
    return {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}


def target_count(batch: Batch) -> int:
    return int((np.asarray(batch["labels"]) != IGNORE_INDEX).sum())


def input_count(batches: list[Batch]) -> int:
    return sum(int(np.asarray(b["input_ids"]).size) for b in batches)
