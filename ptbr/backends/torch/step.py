"""The torch training step: forward, loss, backward over the micro-batches of one optimizer step,
clipping, the update (with GradScaler in fp16), evaluation, and the state a checkpoint holds."""

from __future__ import annotations

import math
from pathlib import Path

from ptbr.data.batch import IGNORE_INDEX, Batch, StepResult, input_count, target_count


class TorchStep:
    """One optimizer step of a torch model: accumulate, clip, update; plus eval and state I/O."""

    def __init__(self, model, optimizer, placement, max_grad_norm: float):
        import torch

        self.model = model
        self.optimizer = optimizer
        self.placement = placement
        self.precision = placement.precision
        self.max_grad_norm = max_grad_norm
        self.scaler = torch.amp.GradScaler(placement.device.type, enabled=placement.precision == "fp16")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def _to_device(self, batch: Batch) -> dict:
        import torch

        return {k: torch.as_tensor(v, dtype=torch.long).to(self.placement.device, non_blocking=True)
                for k, v in batch.items()}

    def _loss_sum(self, batch: dict):
        """Summed cross-entropy over the target tokens of one micro-batch."""
        import torch.nn.functional as F

        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with self.placement.autocast():
            logits = self.model(**inputs).logits  # (B, T, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        """Gradient accumulation over `micro_batches`: the loss is the mean over every target token
        of the step, so micro-batches are averaged (weighted by their tokens) and a short last cycle
        of an epoch is applied with its own size, never dropped."""
        import torch

        self.model.train()
        targets = sum(target_count(b) for b in micro_batches)
        inputs = input_count(micro_batches)
        if targets == 0:
            return StepResult(float("nan"), float("nan"), 0, inputs, True)
        total = torch.zeros((), device=self.placement.device)
        for batch in micro_batches:
            loss_sum = self._loss_sum(self._to_device(batch))
            self.scaler.scale(loss_sum / targets).backward()
            total += loss_sum.detach()
        loss = total.item() / targets
        self.scaler.unscale_(self.optimizer)
        clip = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        skipped = not math.isfinite(loss) or not math.isfinite(grad_norm)
        if self.scaler.is_enabled():
            # GradScaler skips an overflowing step itself and lowers its scale: that is routine
            # in fp16, not a divergence, unless the loss itself is not finite.
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = not math.isfinite(loss)
        elif not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, targets, inputs, skipped)

    def eval_loss(self, batches: list[Batch]) -> float:
        """Mean loss per target token over a fixed set of batches."""
        import torch

        self.model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in batches:
                total += self._loss_sum(self._to_device(batch)).item()
                count += target_count(batch)
        self.model.train()
        return total / count if count else float("nan")

    # ---- state ------------------------------------------------------------------------------

    def save_state(self, directory: Path) -> None:
        """Model (safetensors, via save_pretrained: full weights or a PEFT adapter), optimizer,
        scaler and RNG states."""
        import torch

        self.model.save_pretrained(str(directory), safe_serialization=True)
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        torch.save(self.scaler.state_dict(), directory / "scaler.pt")
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, directory / "rng.pt")

    def load_state(self, directory: Path) -> None:
        import torch
        from safetensors.torch import load_file, load_model

        adapter = directory / "adapter_model.safetensors"
        if adapter.is_file():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(str(adapter), device=str(self.placement.device)))
        else:
            load_model(self.model, str(directory / "model.safetensors"), device=str(self.placement.device))
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True,
                                                  map_location=self.placement.device))
        self.scaler.load_state_dict(torch.load(directory / "scaler.pt", weights_only=True))
        rng = torch.load(directory / "rng.pt", weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def memory_bytes(self) -> int:
        from ptbr.backends.torch.device import memory_in_use

        return memory_in_use(self.placement.device)


def build_optimizer(model, settings, device):
    """AdamW, fused where the device supports it; no weight decay on norms and biases."""
    import torch

    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": settings.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": settings.learning_rate, "betas": (settings.beta1, settings.beta2), "eps": 1e-8}
    if device.type in ("cuda", "cpu"):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(groups, **kwargs)
