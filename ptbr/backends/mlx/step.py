"""The MLX training step: ptbr's loss over the micro-batches of one optimizer step, clipping,
AdamW as torch computes it, evaluation, and the state a checkpoint holds (safetensors and JSON).

Compiled functions take the model and MLX's random generator as their state (as mlx-lm's trainer
does; the AdamW update is compiled too, ptbr/backends/mlx/optimizer.py), and every step ends with
`mx.eval` on the loss, the weights and the optimizer state: a lazy graph that is never evaluated
grows until the process stalls. Batches are
padded to a few shapes (lengths 32, 48, 64, 96, 128, 192, ...: ptbr.memory.mlx_bucket_length; rows
to the micro-batch size), because each new shape is a new compilation, and on Metal one per distinct length exhausted the GPU's
buffers (mlx issue #4464).
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import numpy as np

from ptbr.data.batch import IGNORE_INDEX, Batch, StepResult, input_count, target_count
from ptbr.memory import mlx_bucket_length as bucket_length

WEIGHTS_FILE = {"model": "model.safetensors", "adapter": "adapters.safetensors"}
CONFIG_FILE = {"model": "config.json", "adapter": "adapter_config.json"}
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.json"


def pad_batch(batch: Batch, rows: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and labels padded on the right to a bucket's shape. Padded positions come after
    every real token of their row, so a causal model computes the real ones as without them, and
    their labels are IGNORE_INDEX; padded rows are all IGNORE_INDEX."""
    ids = np.asarray(batch["input_ids"])
    labels = np.asarray(batch["labels"])
    count, length = ids.shape
    shape = (max(rows, count), bucket_length(length, longest))
    padded_ids = np.zeros(shape, dtype=np.int32)  # (B, T); token 0 exists in every vocabulary
    padded_labels = np.full(shape, IGNORE_INDEX, dtype=np.int32)  # (B, T)
    padded_ids[:count, :length] = ids
    padded_labels[:count, :length] = labels
    return padded_ids, padded_labels


def cross_entropy_sum(logits, labels):
    """Summed cross-entropy over the target tokens (labels != IGNORE_INDEX), in fp32."""
    import mlx.core as mx

    logits = logits.astype(mx.float32)  # (B, T, vocab)
    mask = labels != IGNORE_INDEX  # (B, T)
    targets = mx.where(mask, labels, 0)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)  # (B, T)
    losses = mx.logsumexp(logits, axis=-1) - picked
    return mx.where(mask, losses, 0.0).sum()


def build_optimizer(model, settings):
    """AdamW as torch.optim.AdamW computes it, with no weight decay on norms and biases (1-D
    parameters), as the torch backend groups them (ptbr/backends/mlx/optimizer.py)."""
    from mlx.utils import tree_flatten

    from ptbr.backends.mlx.optimizer import AdamW

    return AdamW(dict(tree_flatten(model.trainable_parameters())), settings.learning_rate,
                 (settings.beta1, settings.beta2), eps=1e-8, weight_decay=settings.weight_decay)


class MlxStep:
    """One optimizer step of an MLX model: accumulate, clip, update; plus eval and state I/O.

    kind: "model" (pretraining: every weight trains) or "adapter" (LoRA: only the adapter does).
    compute_dtype: what the trainable weights are cast to for the forward pass (bf16/fp16
    pretraining keeps fp32 master weights, as torch's autocast does); None computes them as stored.
    config: what makes a checkpoint load on its own, written beside the weights (config.json of
    the model, or adapter_config.json of the adapter).
    """

    def __init__(self, model, optimizer, precision: str, max_grad_norm: float, rows: int, longest: int,
                 kind: str, config: dict, compute_dtype=None):
        import mlx.core as mx

        self.model = model
        self.optimizer = optimizer
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.rows = rows
        self.longest = longest
        self.kind = kind
        self.config = config
        self.compute_dtype = compute_dtype
        self._compile()
        # mem_bytes is this step's peak: not that of --auto-fit's throwaway tries, or of an
        # earlier run in the same process
        mx.reset_peak_memory()

    def _forward_loss(self, params, input_ids, labels):
        """The summed loss with the trainable weights `params` (cast to the compute dtype)."""
        import mlx.core as mx
        from mlx.utils import tree_map

        if self.compute_dtype is not None:
            params = tree_map(lambda p: p.astype(self.compute_dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                              params)
        self.model.update(params)
        return cross_entropy_sum(self.model(input_ids), labels)

    def _compile(self) -> None:
        import mlx.core as mx
        from mlx.utils import tree_map, tree_reduce

        model = self.model
        state = [model.state, mx.random.state]

        def weighted(params, input_ids, labels, weight):
            loss_sum = self._forward_loss(params, input_ids, labels)
            return loss_sum * weight, loss_sum

        value_and_grad = mx.value_and_grad(weighted)

        def gradients(input_ids, labels, weight):
            params = model.trainable_parameters()
            (_, loss_sum), grads = value_and_grad(params, input_ids, labels, weight)
            model.update(params)  # the stored weights back (the forward pass set their casts)
            return loss_sum, grads

        @partial(mx.compile, inputs=state, outputs=state)
        def first(input_ids, labels, weight):
            return gradients(input_ids, labels, weight)

        @partial(mx.compile, inputs=state, outputs=state)
        def accumulate(input_ids, labels, weight, accumulated):
            loss_sum, grads = gradients(input_ids, labels, weight)
            return loss_sum, tree_map(lambda a, g: a + g, accumulated, grads)

        @mx.compile
        def norm(grads):
            return mx.sqrt(tree_reduce(lambda total, g: total + g.astype(mx.float32).square().sum(), grads,
                                       mx.array(0.0, mx.float32)))

        @partial(mx.compile, inputs=state, outputs=state)
        def evaluate(input_ids, labels):
            params = model.trainable_parameters()
            loss_sum = self._forward_loss(params, input_ids, labels)
            model.update(params)
            return loss_sum

        self._first, self._accumulate, self._norm, self._evaluate = first, accumulate, norm, evaluate

    def _arrays(self, batch: Batch):
        import mlx.core as mx

        ids, labels = pad_batch(batch, self.rows, self.longest)
        return mx.array(ids), mx.array(labels)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        """Gradient accumulation over `micro_batches`: the loss is the mean over every target token
        of the step (each micro-batch's gradient weighted by its share of the step's targets), so
        a short last step of an epoch counts with its own size, as in the torch backend."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        targets = sum(target_count(b) for b in micro_batches)
        inputs = input_count(micro_batches)
        if targets == 0:
            return StepResult(float("nan"), float("nan"), 0, inputs, True)
        self.model.train()
        weight = mx.array(1.0 / targets, mx.float32)
        total, grads = mx.array(0.0, mx.float32), None
        for batch in micro_batches:
            input_ids, labels = self._arrays(batch)
            if grads is None:
                loss_sum, grads = self._first(input_ids, labels, weight)
            else:
                loss_sum, grads = self._accumulate(input_ids, labels, weight, grads)
            total = total + loss_sum
            mx.eval(total, grads, mx.random.state)  # one micro-batch's graph in memory at a time
        grad_norm = self._norm(grads)
        mx.eval(grad_norm)
        loss, grad_norm = total.item() / targets, grad_norm.item()
        skipped = not math.isfinite(loss) or not math.isfinite(grad_norm)
        if not skipped:
            clip = 1.0
            if self.max_grad_norm > 0:
                clip = min(self.max_grad_norm / (grad_norm + 1e-6), 1.0)  # torch's clip_grad_norm_
            flat = dict(tree_flatten(grads))
            del grads  # the optimizer frees each layer's gradients once that layer is updated
            self.optimizer.update(self.model, flat, lr, clip)
        else:
            del grads
        mx.eval(self.model.trainable_parameters(), self.optimizer.arrays(), mx.random.state)
        return StepResult(loss, grad_norm, targets, inputs, skipped)

    def eval_loss(self, batches: list[Batch]) -> float:
        """Mean loss per target token over a fixed set of batches."""
        import mlx.core as mx

        self.model.eval()
        total, count = 0.0, 0
        for batch in batches:
            loss_sum = self._evaluate(*self._arrays(batch))
            mx.eval(loss_sum)
            total += loss_sum.item()
            count += target_count(batch)
        self.model.train()
        return total / count if count else float("nan")

    # ---- state ------------------------------------------------------------------------------

    def trainable_weights(self) -> dict:
        from mlx.utils import tree_flatten

        return dict(tree_flatten(self.model.trainable_parameters()))

    def save_state(self, directory: Path) -> None:
        """The trainable weights (a Hugging Face model.safetensors, or mlx-lm's adapters.safetensors),
        AdamW's state, MLX's random key, and the config that makes the checkpoint load on its own."""
        import mlx.core as mx

        weights_format = "pt" if self.kind == "model" else "mlx"
        mx.save_safetensors(str(directory / WEIGHTS_FILE[self.kind]), self.trainable_weights(),
                            metadata={"format": weights_format})
        mx.save_safetensors(str(directory / OPTIMIZER_FILE), self.optimizer.state(), metadata={"format": "mlx"})
        key = [int(v) for v in np.array(mx.random.state[0]).tolist()]
        (directory / RNG_FILE).write_text(json.dumps({"mlx_random_key": key}) + "\n", encoding="utf-8")
        (directory / CONFIG_FILE[self.kind]).write_text(json.dumps(self.config, indent=2) + "\n", encoding="utf-8")

    def load_state(self, directory: Path) -> None:
        import mlx.core as mx

        weights = mx.load(str(directory / WEIGHTS_FILE[self.kind]))
        expected = self.trainable_weights()
        problems = [name for name in expected if name not in weights or weights[name].shape != expected[name].shape]
        if problems or len(weights) != len(expected):
            raise ValueError(f"the checkpoint's weights do not match this model ({', '.join(problems[:3]) or 'extra'})")
        self.model.load_weights(list(weights.items()), strict=False)
        self.optimizer.load(mx.load(str(directory / OPTIMIZER_FILE)))
        high, low = json.loads((directory / RNG_FILE).read_text(encoding="utf-8"))["mlx_random_key"]
        mx.random.seed((high << 32) | low)
        mx.eval(self.model.parameters(), self.optimizer.arrays(), mx.random.state)

    def memory_bytes(self) -> int:
        from ptbr.backends.mlx.device import peak_memory

        return peak_memory()
