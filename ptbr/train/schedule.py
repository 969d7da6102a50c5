"""The learning-rate schedule: linear warmup, then cosine decay to a floor; a pure function of the step."""

from __future__ import annotations

import math


def lr_at(step: int, peak_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    min_lr = peak_lr * min_lr_ratio
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)
