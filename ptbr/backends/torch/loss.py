"""The training loss of the torch backend, with the vocabulary's logits made a chunk of tokens at a
time (--chunked-loss, the default; under --compile the decoder is compiled and this loss runs eager,
except on a CUDA GPU in 16 bits, where the whole logits' loss compiled is faster: see
ptbr.memory.compiled_whole_logits).

The plain way computes the (tokens x vocab) logits whole, upcasts them to fp32 and hands them to
F.cross_entropy; at a 32k vocabulary that is 128 KiB per token, and three such fp32 tensors are
alive when the backward pass starts (for 85m at batch 8 x 1024: 3,000 MiB, against 0.94 GiB for
its weights and AdamW state). The chunked way takes the
final hidden states instead, and for each chunk of tokens computes the logits, the summed loss and,
right away, the loss's gradients with respect to the hidden states and the output layer's weight
(softmax minus the one-hot target, times the weight or the hidden states). Only one chunk's logits
exist at a time; what the backward pass gets is the two gradients, scaled by its incoming gradient.
The matrix multiplies are the same three as the plain way's (forward, and the two of its backward),
in the same precision (autocast's 16-bit type, or fp32), so nothing is recomputed. Each chunk's
logits are one fp32 buffer worked on in place: log-softmax, then exp, then minus one at the
targets (two passes over it; F.cross_entropy and its backward write three new tensors of the whole
logits' size: the log-softmax, the gradient of its output and the gradient of the logits). On a
CPU the step is as fast or faster, because the logits stay in cache (README, "Performance"); logits
that fit one chunk are one chunk, which is still faster than F.cross_entropy there (`tiny` at a
2,048-token vocabulary), where the micro-batch has enough tokens for the chunked loss to save
memory (ptbr.memory.chunked_loss_from; fewer take the whole logits). Chunks of 32 MiB (262 tokens
at a 32k vocabulary) made an H200's steps about 20% slower than the whole logits (many small
kernels, and the fp32 (vocab x hidden) weight gradient added up once per chunk), so CUDA takes
256 MiB chunks; with the in-place passes they are faster than the whole logits on an H100 (the
loss alone at 85m's 16 x 1024 tokens: 10.8 against 11.7 ms; a whole step 1.00x). Where that weight
gradient is summed from 16-bit products, a chunk holds at least twice the hidden size in tokens
(ptbr.memory.chunk_tokens).

The output layer still runs inside the model's forward pass (through DDP's or FSDP's wrapper, which
need it to), only it returns nothing while `hidden_states_of` holds it: it records its input and its
weight (under FSDP, the gathered weight) for the loss.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.autograd.function import once_differentiable

from ptbr.data.batch import IGNORE_INDEX
from ptbr.memory import IN_PLACE_DEVICES, chunk_tokens, chunked_loss_from, gradient_summed_hidden


def chunkable_head(model, autocast=nullcontext) -> tuple[torch.nn.Linear | None, str | None]:
    """(the model's output layer, None) if the chunked loss can compute with it, else (None, why).

    It must be a plain Linear without a bias (trained, as in pretraining, or frozen) and without
    accelerate's hooks (offloading moves its weight in its forward, which the swap skips): a
    LoRA-adapted, quantized or offloaded lm_head keeps the plain loss. And the model's logits must
    be that layer's output, unchanged: the chunked loss computes them as hidden @ weight.T, so
    anything a model does after it (Gemma-2's final_logit_softcapping, Cohere's logit_scale,
    Granite's logits_scaling, ...) would be left out of the loss. That is checked by running the
    model once on 4 tokens (no gradients, evaluation mode: no dropout mask drawn) under `autocast`,
    the run's precision, rather than by a list of model types that would always lag transformers."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.bias is not None or hasattr(head, "_hf_hook"):
        return None, "only a plain Linear output layer without a bias or offloading is chunked"
    if not _logits_are_the_output_layers(model, head, autocast):
        return None, ("its logits are not its output layer's output: the model changes them after it, "
                      "e.g. soft-capped or scaled")
    return head, None


def _logits_are_the_output_layers(model, head, autocast) -> bool:
    made: list = []
    handle = head.register_forward_hook(lambda module, args, output: made.append(output))
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            ids = torch.arange(4, device=head.weight.device).unsqueeze(0) % head.out_features
            logits = model(input_ids=ids).logits
    finally:
        handle.remove()
        model.train(training)
    return (len(made) == 1 and made[0].shape == logits.shape
            and torch.equal(made[0].float(), logits.float()))


@contextmanager
def hidden_states_of(head):
    """Within the block, calling `head` records its input and weight in the yielded dict and
    returns an empty tensor instead of the logits.

    What this relies on: DDP (built without find_unused_parameters) waits for every parameter's
    gradient hook, which fires when the loss's backward hands the weight its gradient; FSDP2 keeps
    the root unit's weight gathered from its forward through the backward pass, and reduces the
    gradients of a unit whose output took no part in the graph in its final backward callback
    (tests/test_parallel.py trains both against one process)."""
    seen: dict = {}

    def record(hidden):
        seen["hidden"], seen["weight"] = hidden, head.weight
        return hidden.new_empty(hidden.shape[:-1] + (0,))

    previous = head.__dict__.get("forward")  # an instance's own forward (accelerate's hooks set one)
    head.forward = record
    try:
        yield seen
    finally:
        if previous is None:
            del head.forward  # the class's forward again
        else:
            head.forward = previous


def chunk_size(weight, dtype, device_type: str) -> int:
    """Tokens per chunk for the output layer `weight` (vocab, hidden) computing in `dtype` on
    `device_type` (ptbr.memory.chunk_tokens: larger where a trained layer's gradient is summed
    from 16-bit products)."""
    vocab, hidden = weight.shape
    return chunk_tokens(vocab, device_type, gradient_summed_hidden(hidden, _precision(dtype), weight.requires_grad))


def fewest_chunked_tokens(weight, dtype) -> int:
    """The fewest tokens of a micro-batch that the chunked loss takes for the output layer `weight`
    (ptbr.memory.chunked_loss_from); fewer go through F.cross_entropy whole."""
    return chunked_loss_from(weight.shape[1], _precision(dtype), weight.requires_grad)


def _precision(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def chunked_cross_entropy(hidden, weight, labels, dtype=None, chunk=None):
    """Summed cross-entropy of `labels` (N; IGNORE_INDEX for none) under the logits
    hidden (N, H) @ weight.T (V, H), computed in `dtype` (default: the weight's), the logits upcast to
    fp32 as F.cross_entropy's caller does; `chunk` tokens at a time (default: chunk_size's, which
    the training step computes once and hands in)."""
    dtype = dtype or weight.dtype
    chunk = chunk or chunk_size(weight, dtype, hidden.device.type)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, dtype, chunk,
                                            torch.is_grad_enabled() and hidden.requires_grad,
                                            torch.is_grad_enabled() and weight.requires_grad)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Its backward scales the gradients made in the forward pass in place: one backward pass per
    forward (a second, with retain_graph, fails loudly on the tensors' version counters).

    Per chunk, the (chunk x vocab) fp32 logits are one buffer worked on in place: log-softmax (the
    kernel F.cross_entropy runs, one read of each row in cache), the targets' log-probabilities
    gathered, exp (the softmax), minus one at each target: the gradient of the logits. Ignored
    tokens are masked on the (chunk x hidden) side, in their hidden states' gradient and in the
    hidden states that make the weight's, not by another pass over the logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, dtype, chunk, grad_hidden, grad_weight):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if grad_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
        w = weight.to(dtype)
        in_place = hidden.device.type in IN_PLACE_DEVICES
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk].to(dtype)
            target = labels[start:start + chunk]
            counted = (target != IGNORE_INDEX)[:, None]
            target = torch.where(counted, target[:, None], 0)
            logits = (h @ w.T).float()
            log_probs = torch.log_softmax(logits, dim=-1, out=logits if in_place else None)
            total -= torch.where(counted, log_probs.gather(1, target), 0).sum()
            if d_hidden is None and d_weight is None:
                continue
            # d(loss)/d(logits) = softmax - one_hot(target), in place (ignored tokens masked below)
            d_logits = log_probs.exp_()
            d_logits.scatter_add_(1, target, torch.full(target.shape, -1.0, dtype=d_logits.dtype, device=target.device))
            del logits, log_probs
            d_logits = d_logits.to(dtype)
            if d_hidden is not None:
                torch.mul(d_logits @ w, counted, out=d_hidden[start:start + chunk])
            if d_weight is not None:
                if dtype == torch.float32:
                    d_weight.addmm_(d_logits.T, h * counted)
                else:
                    d_weight.add_(d_logits.T @ (h * counted))
            del d_logits  # before the next chunk's logits are made
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        d_hidden, d_weight = ctx.saved_tensors
        if d_hidden is not None:
            d_hidden = d_hidden.mul_(grad_total).to(ctx.dtypes[0])
        if d_weight is not None:
            d_weight = d_weight.mul_(grad_total).to(ctx.dtypes[1])
        return d_hidden, d_weight, None, None, None, None, None
