"""Right-padded fine-tuning batches go to the model without their attention mask, where the model
allows it.

A micro-batch of examples of different lengths is padded on the right (ptbr/finetune/batches.py).
In a causal decoder a token attends to itself and the tokens before it only, so pads, which come
after every real token of their row, change nothing the loss covers (their own labels are ignored):
the mask is redundant. Passing it costs. transformers turns it into a (B, 1, T, T) additive bias
that every layer keeps for its backward pass, and with grouped-query attention SDPA then gets the
keys and values repeated to every query head instead of its enable_gqa path; without a mask, SDPA
runs its causal kernel. Measured on CPU (Mistral-shaped, 4 layers, GQA 8/2, batch 4 x 512 with
rows of 200-512 tokens): 13-20% less peak memory, steps about 8% faster, the loss and gradients
equal to float rounding (2.9e-7 relative). mlx-lm's trainer and ptbr's MLX backend never pass one.

Whether a model is such a decoder is checked, not assumed from its type: one forward pass of two
rows, the second padded, with and without the mask, under the run's autocast. Where the real
tokens' logits differ (a model that reads the mask for more than causal attention), its batches
keep their mask. So do 8-bit bases: bitsandbytes' int8 matmul picks its outlier columns over the
whole flattened batch, pads included, and the pads' hidden states differ without the mask (they
attend to each other), so the real tokens' results can too (2e-5 to 2e-4 of the loss, gradients
3% apart, in a review's measurements); the probe's few tokens rarely show it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

# how far the real tokens' logits may differ, relative to the largest logit: masked and causal
# attention kernels round differently (fp32: ~1e-6; 16-bit compute: ~1e-2, and a 4-bit Linear
# rounds its input to its compute dtype, magnifying that), and a model that needs the mask differs
# by far more (its real tokens attend to the pads: 0.9 of the largest logit measured)
FP32_TOLERANCE = 1e-4
HALF_TOLERANCE = 5e-2


def padding_mask_needed(model, autocast=nullcontext, half: bool = False) -> str | None:
    """Why right-padded batches must keep their attention mask for `model`, or None where a causal
    decoder can do without (the pads come after everything the loss covers). `half`: the run
    computes in 16 bits (autocast, or a 4-bit base's compute dtype). Runs the model twice on 2 x 6
    tokens, without gradients, in evaluation mode (no dropout mask drawn)."""
    if any(type(module).__name__ == "Linear8bitLt" for module in model.modules()):
        return "an 8-bit base: bitsandbytes' int8 matmul takes its outlier columns over the whole batch, pads included"
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    ids = (torch.arange(12, device=device).reshape(2, 6) * 7 + 3) % embeddings.num_embeddings
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # the second row: 3 tokens, then 3 pads
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            masked = model(input_ids=ids, attention_mask=mask).logits.float()
            bare = model(input_ids=ids).logits.float()
    finally:
        model.train(training)
    real = mask.bool()
    masked, bare = masked[real], bare[real]
    tolerance = (HALF_TOLERANCE if half else FP32_TOLERANCE) * max(1.0, masked.abs().max().item())
    if not bool(torch.isfinite(bare).all()) or (masked - bare).abs().max().item() > tolerance:
        return "its logits depend on it beyond causal attention"
    return None
