"""The memory model: predicted peak training memory for a config, per precision (no torch import).

peak = weights + gradients + optimizer state + activations + logits (+ a fixed runtime overhead).
Mixed precision (fp16/bf16 autocast) keeps fp32 master weights, fp32 gradients and fp32 AdamW
state; autocast casts weights on the fly and stores most activations in 16 bits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ptbr.config import ModelPreset

GIB = 1024**3


@dataclass(frozen=True)
class Architecture:
    """What the memory model needs to know of a decoder."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    parameters: int

    @classmethod
    def from_preset(cls, preset: ModelPreset, vocab_size: int) -> Architecture:
        return cls(preset.hidden_size, preset.num_layers, preset.num_heads, preset.num_kv_heads,
                   preset.intermediate_size, vocab_size, preset.param_count(vocab_size))


@dataclass(frozen=True)
class MemoryEstimate:
    precision: str
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.overhead

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total}


def activation_bytes_per_token_layer(arch: Architecture, precision: str) -> int:
    """Bytes one decoder layer keeps for the backward pass, per token.

    Counted from what a Llama layer saves: two RMSNorm inputs and outputs (fp32 in HF's RMSNorm),
    the q/k/v projections, RoPE outputs, the attention output, and four intermediate-sized MLP
    tensors (gate, silu(gate), up, their product).
    """
    h, i = arch.hidden_size, arch.intermediate_size
    kv = arch.num_kv_heads * (h // arch.num_heads)
    act = 4 if precision == "fp32" else 2
    norms = 4 * 4 * h  # inputs and fp32 outputs of the two RMSNorms
    attention = act * (h + h + 2 * kv + h + 2 * kv + h)  # normed input, q, k, v, rope(q, k), output
    mlp = act * (h + 4 * i)  # normed input, gate, silu(gate), up, product
    return norms + attention + mlp


def estimate_training_memory(arch: Architecture, batch_size: int, seq_len: int, precision: str = "fp32",
                             gradient_checkpointing: bool = False, overhead: int = 0) -> MemoryEstimate:
    """Predicted peak bytes for one training step (forward + backward + AdamW)."""
    params = arch.parameters
    tokens = batch_size * seq_len
    weights = 4 * params  # fp32 master weights
    if precision in ("fp16", "bf16"):
        weights += 2 * params  # autocast's 16-bit copies of the weights, live during the step
    gradients = 4 * params
    optimizer = 8 * params  # AdamW exp_avg + exp_avg_sq
    per_layer = activation_bytes_per_token_layer(arch, precision) * tokens
    if gradient_checkpointing:
        # each layer keeps only its input; one layer's activations live again during recompute
        activations = arch.num_layers * 4 * arch.hidden_size * tokens + per_layer
    else:
        activations = arch.num_layers * per_layer
    logit_bytes = 4 if precision == "fp32" else 2
    # logits (model dtype), their fp32 upcast for the loss, and the gradient of that upcast
    logits = tokens * arch.vocab_size * (logit_bytes + 4 + 4)
    return MemoryEstimate(precision, weights, gradients, optimizer, activations, logits, overhead)
