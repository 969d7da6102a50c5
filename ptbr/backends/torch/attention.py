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

On a CPU in bf16 (ptbr's pretraining default where the CPU multiplies bf16 natively) torch's flash
kernel computes attention's backward pass about twice as slowly as in fp32 (torch 2.13 on a 2-core
Xeon with AMX: `tiny`'s (8, 4, 256, 32) heads 13 ms against 5.2 ms a layer, `85m`'s (2, 10, 256, 64)
9.1 ms against 5.5 ms): a third of `tiny`'s bf16 step went there. There ptbr runs the bf16
kernel's forward pass (the same output, bit for bit) and keeps what it keeps (the memory model holds
unchanged), and runs the backward pass with the fp32 kernel on those bf16 tensors, upcast (exact):
the gradients come out closer to exact attention of those values, in the inputs' dtypes.
"""

from __future__ import annotations

import functools

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


def _flash_for_cpu_ops():
    """torch's CPU flash-attention kernels (forward, backward), or None where this torch has none."""
    import torch

    forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return None if forward is None or backward is None else (forward, backward)


@functools.cache  # made once, at the first call: torch imported late (`ptbr --help` stays light)
def _flash_attention_function():
    """An autograd Function: causal attention of (batch, heads, seq, head_dim) queries over keys and
    values with as many heads or fewer (grouped-query attention: the kernel takes the groups) by the
    CPU flash kernel, forward in `dtype` (16 bits) and backward in fp32 on the same 16-bit tensors."""
    import torch

    forward_op, backward_op = _flash_for_cpu_ops()

    class FlashAttentionFp32Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value, scale, dtype):
            query16, key16, value16 = query.to(dtype), key.to(dtype), value.to(dtype)  # autocast's casts
            with torch.autocast("cpu", enabled=False):
                out, logsumexp = forward_op(query16, key16, value16, 0.0, True, scale=scale)
            ctx.scale, ctx.dtypes = scale, (query.dtype, key.dtype, value.dtype)
            ctx.save_for_backward(query16, key16, value16, out, logsumexp)  # what the 16-bit kernel keeps
            return out

        @staticmethod
        def backward(ctx, grad_out):
            # the 16-bit values upcast exactly: the fp32 kernel recomputes the probabilities the
            # 16-bit forward pass computed (in fp32 too) from the same numbers
            query, key, value, out, logsumexp = ctx.saved_tensors
            with torch.autocast("cpu", enabled=False):
                grads = backward_op(grad_out.float(), query.float(), key.float(), value.float(), out.float(),
                                    logsumexp.float(), 0.0, True, scale=ctx.scale)
            return (*(g.to(d) for g, d in zip(grads, ctx.dtypes, strict=True)), None, None)

    return FlashAttentionFp32Backward


def flash_attention_fp32_backward(query, key, value, scale, dtype):
    """Causal attention on a CPU: forward in `dtype`, backward in fp32 (see the module's docstring)."""
    return _flash_attention_function().apply(query, key, value, scale, dtype)


def fp32_backward_applies(module, query, key, value, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether a call of transformers' SDPA attention is the case whose backward pass ptbr computes
    in fp32 on a CPU: bf16 (by autocast or by the tensors' own dtype), causal over the whole
    sequence (no mask, no cache, queries as long as keys; causal as transformers decides it: the
    call's is_causal, else the module's), no dropout (transformers applies a given rate whether or
    not the module is training), values as wide as keys (the flash kernel's), nothing else asked."""
    import torch

    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return (query.device.type == "cpu" and sdpa_dtype(key) == torch.bfloat16 and attention_mask is None
            and not dropout and is_causal and query.shape[2] > 1 and query.shape[2] == key.shape[2]
            and key.shape[-1] == value.shape[-1]
            and not any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap"))
            and not kwargs.get("output_attentions", False) and not torch.jit.is_tracing())


def backpropagate_cpu_bf16_attention_in_fp32() -> None:
    """Register (idempotent) a wrapper of transformers' "sdpa" attention that runs the CPU's bf16
    causal attention forward with the bf16 kernel and backward with the fp32 one (see the module's
    docstring); every other call, and a torch without the CPU flash kernels, keeps transformers'
    own function."""
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # transformers without an attention registry: left alone
        return
    original = AttentionInterface._global_mapping.get("sdpa")
    if original is None or getattr(original, "ptbr_wrapped", False) or _flash_for_cpu_ops() is None:
        return

    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling: float | None = None, **kwargs):
        if not fp32_backward_applies(module, query, key, value, attention_mask, dropout, kwargs):
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        import torch

        out = flash_attention_fp32_backward(query, key, value, scaling, torch.bfloat16)
        return out.transpose(1, 2).contiguous(), None

    sdpa_attention_forward.ptbr_wrapped = True
    sdpa_attention_forward.__wrapped__ = original
    AttentionInterface.register("sdpa", sdpa_attention_forward)
