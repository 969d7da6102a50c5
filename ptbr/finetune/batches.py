"""Batches of encoded examples: the training BatchSource (epochs of shuffled examples) and the
fixed validation batches."""

from __future__ import annotations

import math

import numpy as np

from ptbr.data.batch import IGNORE_INDEX, Batch
from ptbr.finetune.data import Example

GROUP_WINDOW = 50  # --group-by-length: steps whose examples are sorted by length together (as transformers')


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Right-pad to the longest example of this micro-batch: pad ids, attention_mask 0, labels -100."""
    length = max(len(e.ids) for e in examples) - 1
    input_ids = np.full((len(examples), length), pad_id, dtype=np.int64)  # (B, T)
    labels = np.full((len(examples), length), IGNORE_INDEX, dtype=np.int64)  # (B, T)
    attention_mask = np.zeros((len(examples), length), dtype=np.int64)  # (B, T)
    for row, example in enumerate(examples):
        inputs, targets = example.inputs_and_labels()
        input_ids[row, :len(inputs)] = inputs
        labels[row, :len(inputs)] = targets
        attention_mask[row, :len(inputs)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


class ChatBatches:
    """The training BatchSource of a fine-tuning run.

    Each epoch visits every example once, in an order drawn from (seed, epoch); micro-batches of
    batch_size follow that order, and a step takes grad_accum of them. The last step of an epoch
    takes what remains (fewer micro-batches, the last one possibly short): nothing is dropped.
    cycle(step) is a pure function of (seed, step), so a resumed run sees the same batches.

    In a data-parallel run of `world` processes, a global micro-batch holds batch_size * world
    examples and each rank takes its slice; a rank left without examples at the end of an epoch
    runs a micro-batch whose loss covers nothing, so that every rank takes part in every step.

    group_by_length (--group-by-length): the epoch's shuffled order is cut into windows of
    GROUP_WINDOW steps' examples; each window is sorted by length (longest first), cut into steps
    and its steps put in a random order. A micro-batch then pads to a length close to its other
    examples' (like transformers' LengthGroupedSampler, which sorts windows of up to 50 batches but
    keeps them longest first). It depends on the effective batch only, so a run resumed with
    another split of it sees the same steps.
    """

    def __init__(self, examples: list[Example], batch_size: int, grad_accum: int, seed: int, pad_id: int,
                 rank: int = 0, world: int = 1, group_by_length: bool = False):
        if not examples:
            raise ValueError("ChatBatches needs at least one example")
        self.examples, self.batch_size, self.grad_accum = examples, batch_size, grad_accum
        self.seed, self.pad_id, self.rank, self.world = seed, pad_id, rank, world
        self.group_by_length = group_by_length
        self.lengths = np.array([len(e.ids) for e in examples]) if group_by_length else None
        self._order: tuple[int, np.ndarray] | None = None  # the last epoch's, computed once
        self.micro_batches_per_epoch = math.ceil(len(examples) / (batch_size * world))
        self.steps_per_epoch = math.ceil(self.micro_batches_per_epoch / grad_accum)

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self._ordered(epoch))
        return self._order[1]

    def _ordered(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.examples))
        if not self.group_by_length:
            return order
        step = self.batch_size * self.grad_accum * self.world  # examples per optimizer step
        grouped = []
        for start in range(0, len(order), GROUP_WINDOW * step):
            window = order[start:start + GROUP_WINDOW * step]
            window = window[np.argsort(-self.lengths[window], kind="stable")]  # longest first
            steps = [window[i:i + step] for i in range(0, len(window), step)]
            # the window's steps in a random order; a short last step of the epoch stays last
            full = [s for s in steps if len(s) == step]
            grouped += [full[i] for i in rng.permutation(len(full))] + [s for s in steps if len(s) < step]
        return np.concatenate(grouped)

    def step_examples(self, step: int) -> list[list[Example]]:
        """This rank's examples in each micro-batch of optimizer step `step` (possibly none)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self.order(epoch)
        first = index * self.grad_accum
        last = min(first + self.grad_accum, self.micro_batches_per_epoch)
        micro = self.batch_size * self.world
        start = self.rank * self.batch_size
        return [[self.examples[i] for i in order[m * micro + start:m * micro + start + self.batch_size]]
                for m in range(first, last)]

    def cycle(self, step: int) -> list[Batch]:
        return [collate(examples, self.pad_id) if examples else nothing_to_learn(self.examples[0], self.pad_id)
                for examples in self.step_examples(step)]

    def describe(self, step: int) -> str:
        lines = sorted(e.line for micro in self.step_examples(step) for e in micro)
        shown = ", ".join(str(n) for n in lines[:8]) + (", ..." if len(lines) > 8 else "")
        return f"training examples at lines [{shown}]"


def nothing_to_learn(example: Example, pad_id: int) -> Batch:
    """A one-example micro-batch whose loss covers no token."""
    batch = collate([example], pad_id)
    batch["labels"][:] = IGNORE_INDEX
    return batch


def fixed_batches(examples: list[Example], batch_size: int, pad_id: int) -> list[Batch]:
    """Validation: the examples in file order, in batches of batch_size; the same at every evaluation."""
    return [collate(examples[i:i + batch_size], pad_id) for i in range(0, len(examples), batch_size)]
