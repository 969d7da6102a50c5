"""Grouped-query attention on a CUDA GPU where flash attention cannot run.

transformers' SDPA path (5.x) passes `enable_gqa=True` to torch's scaled_dot_product_attention
whenever a batch comes without an attention mask (pretraining always; fine-tuning's right-padded
batches too, see padding.py), so that the key/value heads are not repeated. Of torch's CUDA kernels
only flash attention (fp16/bf16 on compute capability 8.0 and newer) takes that flag: in fp32 on
any GPU, or in fp16 on a T4 (7.5, Kaggle's GPU), SDPA falls back to its math kernel without a word,
and every layer keeps its (batch x heads x seq x seq) attention matrix for the backward pass.
Measured on an H200 (README, "Performance"): the 85m preset (10 heads over 5 key/value heads) at
32 x 1024 tokens peaked at 53 GiB in fp32 against the 35 GiB then predicted, while bf16 (flash)
matched the prediction to 0.0%. transformers issue #48633 reports the same for T4s.

There ptbr makes transformers take its other path, the one it uses for masked batches: the
key/value heads repeated (a copy of K and V per layer), which torch's memory-efficient kernel
accepts in fp32 and on GPUs before Ampere. Flash-capable cases and every other device keep
transformers' own choice. The dtype that decides is the one SDPA computes in: under autocast
(ptbr's bf16 and fp16) the keys arrive in fp32 (RoPE's cos and sin take the fp32 residual stream's
dtype) and autocast casts them for SDPA. Older transformers (4.46 has no sdpa_attention module,
4.52 no such choice) always repeats the key/value heads, and is left alone.
"""

from __future__ import annotations

_CAPABILITY: dict[int, tuple[int, int]] = {}  # compute capability per CUDA device index


def flash_attention_possible(dtype, capability: tuple[int, int] | None) -> bool:
    """Whether torch's flash SDPA kernel can run attention in `dtype` on a CUDA GPU of this
    compute capability (None: unknown)."""
    import torch

    return dtype in (torch.float16, torch.bfloat16) and capability is not None and capability >= (8, 0)


def sdpa_dtype(key):
    """The dtype SDPA computes `key` in: autocast's where it is on for the key's device."""
    import torch

    kind = key.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else key.dtype


def keep_sdpa_off_the_math_kernel() -> None:
    """Wrap transformers' choice of `enable_gqa` (idempotent) so that, on a CUDA GPU where flash
    attention cannot run the batch's dtype, the key/value heads are repeated instead."""
    import torch

    try:
        from transformers.integrations import sdpa_attention
    except ImportError:  # older transformers: no such module, the heads are always repeated
        return
    original = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if original is None or getattr(original, "ptbr_wrapped", False):  # no such choice (older); or done
        return
    if torch.cuda.is_available():  # read once: the wrapper also runs while torch.compile traces
        _CAPABILITY.update({i: torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})

    def use_gqa_in_sdpa(attention_mask, key, *args, **kwargs):
        if key.device.type == "cuda" and not flash_attention_possible(sdpa_dtype(key),
                                                                       _CAPABILITY.get(key.device.index or 0)):
            return False
        return original(attention_mask, key, *args, **kwargs)

    use_gqa_in_sdpa.ptbr_wrapped = True
    use_gqa_in_sdpa.__wrapped__ = original
    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa
