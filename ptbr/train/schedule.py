"""The learning-rate schedule: linear warmup, then cosine decay to a floor; a pure function of the step.

Its shape is fixed when a run starts and recorded in every checkpoint, so a resumed run continues
on the same curve: a larger --max-steps on resume trains on at the floor past the planned end.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def lr_at(step: int, peak_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    min_lr = peak_lr * min_lr_ratio
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)


@dataclass(frozen=True)
class Schedule:
    peak_lr: float
    warmup_steps: int
    horizon: int  # the step the cosine reaches its floor: max_steps when the run started
    min_lr_ratio: float

    @classmethod
    def from_settings(cls, settings) -> Schedule:
        return cls(settings.learning_rate, settings.warmup_steps, settings.max_steps, settings.min_lr_ratio)

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        return cls(float(data["peak_lr"]), int(data["warmup_steps"]), int(data.get("horizon", data["max_steps"])),
                   float(data["min_lr_ratio"]))

    def lr(self, step: int) -> float:
        return lr_at(step, self.peak_lr, self.warmup_steps, self.horizon, self.min_lr_ratio)

    def as_dict(self) -> dict:
        return asdict(self)
