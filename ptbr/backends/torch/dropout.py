"""LoRA dropout whose mask is cheap to draw on a CPU (--lora-dropout-impl packed).

PEFT puts a torch.nn.Dropout in front of every adapter. On a CPU, torch draws that mask one
Bernoulli sample per value from its Mersenne Twister, and for a small model that is about a
quarter of a LoRA step (benchmarks/speed.py; the profile is in the README, "Performance").
PackedDropout draws 64 random bits per generator call and reads them as four 16-bit numbers, one
per value: a value is dropped when its number is among the lowest round(p * 65536) of the 65,536,
so the drop rate is p to within 1/131,072 (0.05 -> 0.0500031; any p > 0 drops at least 1/65,536), and the kept values are scaled by
the exact inverse of the keep rate, so the layer's expected output is its input, as nn.Dropout's.
The gradient is masked and scaled the same way. The bits come from torch's generator of the
input's device: a seeded run repeats exactly, and a checkpoint's RNG state resumes it exactly. The
mask is kept for the backward pass as bools (one byte per value; nn.Dropout keeps a float mask on
a CPU).
"""

from __future__ import annotations

import torch

LEVELS = 1 << 16  # one 16-bit number per value: four per 64-bit draw


def drop_levels(p: float) -> int:
    """How many of the 65,536 levels drop a value at rate p (at least one for any p > 0)."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout rate must be within [0, 1), got {p!r}")
    return max(1, round(p * LEVELS)) if p > 0 else 0


def keep_mask(shape: torch.Size, p: float, device) -> torch.Tensor:
    """Bools, True for kept values: each value's 16-bit random number is at or above the cut."""
    count = shape.numel()
    bits = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    bits.random_(-(2**63), None)  # every 64-bit pattern equally likely
    numbers = bits.view(torch.int16)[:count].view(shape)  # -32768 .. 32767, uniform
    return numbers >= -(LEVELS // 2) + drop_levels(p)


class _MaskAndScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        keep = keep_mask(x.shape, p, x.device)
        ctx.scale = LEVELS / (LEVELS - drop_levels(p))
        ctx.save_for_backward(keep)
        return x.mul(keep).mul_(ctx.scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None


class PackedDropout(torch.nn.Module):
    """nn.Dropout(p) with its mask drawn as above; the identity in eval mode and at p = 0."""

    def __init__(self, p: float):
        super().__init__()
        drop_levels(p)  # refuses a rate outside [0, 1)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return _MaskAndScale.apply(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def pack_lora_dropout(model) -> int:
    """Replace the torch.nn.Dropout in front of each of a PEFT model's LoRA adapters by a
    PackedDropout of the same rate; returns how many were replaced (PEFT uses nn.Identity at
    rate 0: nothing to replace then)."""
    replaced = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        for name, dropout in list(dropouts.items()):
            if type(dropout) is torch.nn.Dropout:
                dropouts[name] = PackedDropout(dropout.p)
                replaced += 1
    return replaced
