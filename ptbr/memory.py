"""The memory model: the predicted peak of a training step, per precision and quantization (no torch).

What lives on the device during a step of a Llama-style decoder, in bytes:

- weights: fp32 master weights for full training (4 B/param); for LoRA/QLoRA the frozen base in
  16 bits, NF4 (bitsandbytes: 0.5 B/param + block constants) or MLX 4-bit, plus fp32 adapters.
- gradients and AdamW state: 4 + 8 B per trainable parameter (fp32).
- activations: what autograd saves for the backward pass, counted tensor by tensor from the
  Hugging Face Llama code (see `_layer_inventory`); with gradient checkpointing only each layer's
  input is kept and one layer at a time is recomputed.
- autocast weight copies: under fp16/bf16 autocast every Linear weight gets a 16-bit copy (2 B/param),
  cached until the forward pass ends and, without gradient checkpointing, held by the backward pass.
- logits: the loss upcasts the (B, T, vocab) logits to fp32; at the start of the backward pass the
  log-softmax output, its gradient and the logits' gradient are alive together (3 x 4 B).
  The chunked loss (--chunked-loss, the default) holds instead the final hidden
  states, their gradient, the output layer's gradient (pretraining: fine-tuning's is frozen) and one
  chunk's logits (32 MiB in fp32): in that field, and in the moment where the loss's forward peaks.

The peak is not the sum of those: activations are freed layer by layer while gradients are made.
It is the largest of three moments of a steady-state step (AdamW state already allocated):
  end of forward     = weights + optimizer + activations + all weight copies + the logits
  start of backward  = weights + optimizer + activations + the copies still held + fp32 loss tensors
                       (or, where more, the output layer's backward: the logits' gradient and the
                       layer's fresh weight gradient)
  end of backward    = weights + optimizer + gradients + one layer's working set (or the
                       embedding's fresh gradient)
With gradient accumulation the first two also hold the gradients of the step's earlier
micro-batches, and at the end of backward a later micro-batch's fresh embedding gradient comes on
top of every kept one (torch; MLX's estimate, which counts the gradients in each of its moments,
adds the accumulated ones to its backward moment).
On CPU this matches the allocated peak of real steps within 1% (tests/test_memory.py); the
resident-memory and GPU comparison is benchmarks/memory_accuracy.py (the table is in the README).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from ptbr.config import ModelPreset, lora_dropout_impl

GIB = 1024**3
MIB = 1024**2
CHUNK_BYTES = 32 * MIB  # the chunked loss's fp32 logits per chunk (ptbr/backends/torch/loss.py uses this)
# on a CUDA GPU: 32 MiB chunks (262 tokens at a 32k vocabulary) left the GPU idle between many small
# kernels and added the output layer's fp32 gradient up once per chunk (85m, 16 x 1024 tokens on an
# H200: steps about 20% slower than with the whole logits); 256 MiB makes 8 chunks of that batch. With
# each chunk worked on in place (an H100): the loss alone 10.8 ms against the whole logits' 11.7, a
# step as fast as --no-chunked-loss's; 1 GiB chunks were 9.6 ms, for 1.1 GiB more (~1.7% of that step)
CUDA_CHUNK_BYTES = 256 * MIB
# Where the output layer is trained in 16 bits, each chunk adds its 16-bit (vocab x hidden) product to
# the layer's fp32 gradient: a chunk of few tokens then spends longer writing and adding that product
# than multiplying (bf16 on an Intel Xeon with AMX, 4,096 tokens at a 32k vocabulary: 262-token chunks
# made the loss 1.2-1.45x slower than the whole logits, chunks of 2 x hidden tokens 1.15x faster), so
# a chunk there holds at least this many times the hidden size in tokens. In fp32 the chunk size made
# no difference (torch adds an fp32 product in place), and a frozen output layer has no gradient.
CHUNK_TOKENS_PER_HIDDEN = 2
# Devices whose log-softmax kernel reads a row whole before writing it, so that the chunked loss
# computes it in place (its output aliasing its input): CPU and CUDA, read in torch's kernels. Elsewhere
# (Apple's MPS) it writes a second chunk-sized buffer.
IN_PLACE_DEVICES = ("cpu", "cuda")

# `ptbr train --compile` on these devices compiles the loss with the forward pass over the whole
# logits (16-bit), in place of the chunked loss running eager on the compiled decoder's hidden
# states, for micro-batches whose 16-bit logits take at most COMPILED_WHOLE_LOGITS_BYTES: inductor
# fuses the log-softmax, its backward and the upcast into the output layer's kernels and never
# makes the fp32 logits. Measured on an H100, 85m in bf16 at 16 x 1024 tokens and a 32k vocabulary:
# steps of 0.040 s against 0.051-0.053 s (the Trainer with torch_compile=True: 0.045 s), at a peak
# of 7.7 GB against 7.2 GB (eager, chunked: 9.8 GB). On a CPU the chunked loss is the faster one
# under --compile (tiny: 1.3x at a 32k vocabulary in fp32, 1.09x in bf16 at 2,048), so it stays.
COMPILED_WHOLE_DEVICES = ("cuda",)
COMPILED_WHOLE_LOGITS_BYTES = GIB


# Bytes per parameter of a quantized Linear weight, constants included.
#   nf4: bitsandbytes 4-bit (ptbr's --quant 4bit), block 64, double quantization: a uint8 absmax
#        per block and one fp32 per 256 blocks.
#   int8: bitsandbytes LLM.int8 (--quant 8bit), one fp32 scale per output row (~1/in B, not counted).
#   mlx4: MLX 4-bit affine, group 64, a 16-bit scale and bias per group.
QUANT_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0, "mlx4": 0.5 + 4 / 64}

# What a training process holds besides the model's tensors. CUDA: nothing here, because
# preflight reads the free GPU memory from a process that already holds a CUDA context, as the
# training process will. CPU and Apple: the interpreter with torch and transformers imported and
# their kernels loaded, measured at about 400 MiB (the baseline of benchmarks/memory_accuracy.py),
# rounded up.
RUNTIME_BYTES = {"cuda": 0, "cpu": 512 * MIB, "mps": 512 * MIB, "mlx": 512 * MIB}
# The share of free memory a run is planned into (preflight's plans, --auto-fit's sizes): on a GPU
# the allocator's own caching and fragmentation; on a CPU resident memory runs 11-24% above the
# tensors the model counts for the 85m and 400m presets (glibc keeps freed blocks; README, "How
# good is the memory model?"), up to 72% above for the tiny preset with checkpointing, whose
# activations are a few hundred MiB. Loading a quantized base at full precision first is not
# counted (the README tells CPU fine-tuning to plan for its largest shard on top)
USABLE_FRACTION = {"cuda": 0.9, "mps": 0.9, "mlx": 0.9, "cpu": 0.8}


# config.json keys of models whose logits are more than the output layer's output (Gemma-2/3's
# soft-capping, Cohere's scale, Granite's divisor, Falcon-H1's multiplier), for plans made from the
# config alone; the run checks the model itself
LOGIT_CHANGING_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
# config.json keys of a mixture-of-experts decoder (Mixtral, Qwen-MoE/OLMoE, DeepSeek): the memory
# model counts dense decoders, and would take the experts' weights for one MLP's
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def experts_of(config: dict) -> tuple[str, int] | None:
    """(key, count) where `config` is a mixture of experts, else None."""
    return next(((key, config[key]) for key in MOE_KEYS if isinstance(config.get(key), int) and config[key] > 1),
                None)


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
    tie_word_embeddings: bool = True
    head_dim: int | None = None  # None: hidden_size // num_heads
    # the model changes its logits after the output layer (soft-caps or scales them): the run keeps
    # the whole logits there (ptbr/backends/torch/loss.py chunkable_head checks the model itself)
    changes_logits: bool = False

    @classmethod
    def from_preset(cls, preset: ModelPreset, vocab_size: int) -> Architecture:
        return cls(preset.hidden_size, preset.num_layers, preset.num_heads, preset.num_kv_heads,
                   preset.intermediate_size, vocab_size, preset.param_count(vocab_size),
                   preset.tie_word_embeddings)

    @classmethod
    def from_hf_config(cls, config: dict) -> Architecture:
        """From a Llama/Mistral/Qwen-style config.json (read as JSON: no weights, no torch).
        ValueError for a mixture of experts, which this model does not count."""
        found = experts_of(config)
        if found:
            raise ValueError(f"a mixture-of-experts decoder ({found[0]} {found[1]}): the memory model counts dense ones")
        h = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or h // heads)
        layers = int(config["num_hidden_layers"])
        inter = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
        tied = bool(config.get("tie_word_embeddings", False))
        per_layer = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter + 2 * h
        params = layers * per_layer + vocab * h * (1 if tied else 2) + h
        changes = any(config.get(key) not in (None, 1, 1.0) for key in LOGIT_CHANGING_KEYS)
        return cls(h, layers, heads, kv_heads, inter, vocab, params, tied, head_dim, changes)

    @property
    def attention_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    def layer_linear_parameters(self) -> int:
        """The Linear weights of one decoder layer: q, k, v, o and the three MLP projections."""
        h, a, kv, i = self.hidden_size, self.attention_dim, self.kv_dim, self.intermediate_size
        return 2 * h * a + 2 * h * kv + 3 * h * i

    @property
    def linear_parameters(self) -> int:
        """Every decoder Linear weight (what QLoRA quantizes); the lm_head is not among them."""
        return self.num_layers * self.layer_linear_parameters()

    @property
    def lm_head_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")) -> int:
        """LoRA A and B matrices, rank * (in + out) per adapted Linear of every layer."""
        h, a, kv, i = self.hidden_size, self.attention_dim, self.kv_dim, self.intermediate_size
        shapes = {"q": (h, a), "k": (h, kv), "v": (h, kv), "o": (a, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
        return self.num_layers * sum(rank * sum(shapes[t]) for t in targets)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per component, and at the three candidate peaks of a steady-state step."""

    precision: str
    weights: int  # master weights (full training) or the frozen, possibly quantized base + adapters
    gradients: int
    optimizer: int
    activations: int  # saved for the backward pass at the end of the forward pass
    logits: int  # the loss's fp32 tensors at the start of the backward pass
    overhead: int  # runtime outside the model's tensors (given by the caller: context, interpreter)
    weight_copies: int  # 16-bit autocast copies of the Linear weights at the end of the forward pass
    forward_end: int  # peak candidates, overhead included (see the module doc)
    backward_start: int
    backward_end: int
    quant: str | None = None

    @property
    def total(self) -> int:
        """The predicted peak."""
        return max(self.forward_end, self.backward_start, self.backward_end)

    @property
    def peak_phase(self) -> str:
        phases = {"forward_end": self.forward_end, "backward_start": self.backward_start,
                  "backward_end": self.backward_end}
        return max(phases, key=phases.get)

    def as_dict(self) -> dict:
        """Numbers only (besides precision and quant): `ptbr info` divides every value."""
        data = asdict(self)
        quant = data.pop("quant")
        return data | {"total": self.total} | ({"quant": quant} if quant else {})


def kv_heads_repeated(arch: Architecture, precision: str, device: str) -> bool:
    """Whether attention gets its key/value heads repeated, each layer then saving K and V at the
    query heads' width (grouped-query attention only), on a CUDA GPU where flash attention cannot
    run (ptbr/backends/torch/attention.py): fp32, and fp16, which ptbr picks on GPUs without bf16
    (before Ampere: no flash attention either; an fp16 asked for on a newer GPU, where flash runs,
    is counted the same: 2-3% over). Not counted: micro-batches that carry an attention mask, on
    any device (fine-tuning's padded micro-batches of an 8-bit base, which keeps the mask;
    sliding-window models past their window), for which transformers repeats them too."""
    return device == "cuda" and precision in ("fp32", "fp16") and arch.kv_dim < arch.attention_dim


def _layer_inventory(arch: Architecture, precision: str, repeated_kv: bool = False) -> int:
    """Bytes one decoder layer of full training saves for the backward pass, per token.

    Counted tensor by tensor from transformers' LlamaDecoderLayer with SDPA attention, and
    checked against the tensors autograd really saves (tests/test_memory.py):
      fp32: the layer input, each RMSNorm's normalized input and output, RoPE'd q and k, v, the
        attention output (+ its fp32 log-sum-exp per head), the residual after attention, four
        intermediate-sized MLP tensors (gate, silu(gate), up, their product), two rsqrt per token.
      fp16/bf16 autocast: the residual stream and the RMSNorms stay fp32 (the embedding output is
        fp32 and `residual + out` promotes); autocast casts the norm output once per consuming
        Linear (3 copies before q/k/v, 2 before gate/up), all else 16-bit.
    repeated_kv: K and V saved at the query heads' width (kv_heads_repeated).
    """
    h, a, i, heads = arch.hidden_size, arch.attention_dim, arch.intermediate_size, arch.num_heads
    kv = a if repeated_kv else arch.kv_dim
    small = 4 * heads + 2 * 4  # fp32 log-sum-exp per head (flash / memory-efficient SDPA), two rsqrt
    if precision == "fp32":
        return 4 * (h + 2 * h + a + 2 * kv + a + h + 2 * h + 4 * i) + small
    fp32_part = 4 * (h + h + h + h)  # input, norm1 normalized, residual, norm2 normalized
    casts = 2 * (3 * h + 2 * h)  # norm1 output cast for q, k, v; norm2 output cast for gate, up
    return fp32_part + casts + 2 * (a + 2 * kv + a + 4 * i) + small


def _lora_layer_inventory(arch: Architecture, compute: int, quantized: bool, rank: int, dropout_mask: int,
                          targets: tuple[str, ...], int8_device: str | None = None, repeated_kv: bool = False) -> int:
    """Bytes one decoder layer of a frozen base with LoRA adapters saves, per token.

    Counted from the tensors autograd saves (tests/test_memory.py checks it byte for byte): a
    frozen Linear keeps no input, so what stays is each RMSNorm's fp32 input and rsqrt, attention's
    RoPE'd q, k, v and output (+ log-sum-exp), the MLP's gate, silu(gate) and up (in the input's
    dtype behind a quantized Linear, fp32 after prepare_model_for_kbit_training; else the compute
    dtype), and what each adapter keeps: its A's input and its B's input (rank values).
      An adapter's A input: under autocast peft casts the Linear's input to fp32 and autocast casts
      it back, one 16-bit copy per adapter. In fp32 without dropout adapters share their input
      (q, k, v the first norm's output, gate and up the second's, o attention's output, saved
      already); with dropout each adapter keeps its own dropout output.
    Dropout also keeps a mask per adapted input: `dropout_mask` bytes per value (a bool with
    --lora-dropout-impl packed and with torch's on CUDA, torch's fp32 noise tensor on a CPU; peft
    drops out the fp32 input).
      int8_device (--quant 8bit, on that device): bitsandbytes' 8-bit matmul keeps its input for the
    backward pass (as a ctx attribute, which saved-tensor hooks do not see) whether or not the
    Linear has an adapter: both norms' fp32 outputs and the MLP product, where no adapter shares
    them already (o_proj's input is attention's output, counted). On a CPU its training matmul is
    a plain F.linear, which autocast runs in 16 bits (the MLP's tensors in the compute dtype); on
    CUDA its int8 kernel returns the fp32 input's dtype, as a 4-bit Linear does (not measured).
    Measured on CPU against the allocated peak (tests/test_memory.py).
    repeated_kv: K and V saved at the query heads' width (kv_heads_repeated).
    """
    h, a, i, heads = arch.hidden_size, arch.attention_dim, arch.intermediate_size, arch.num_heads
    kv = a if repeated_kv else arch.kv_dim
    inputs = {"q": h, "k": h, "v": h, "o": a, "gate": h, "up": h, "down": i}
    every = sum(inputs[t] for t in targets)  # one value per adapter and input feature
    if compute < 4 or dropout_mask:
        adapted_inputs = compute * every
    else:  # fp32, no dropout: the distinct tensors the adapters read (o's is attention's output)
        shared = (h if {"q", "k", "v"} & set(targets) else 0) + (h if {"gate", "up"} & set(targets) else 0)
        adapted_inputs = 4 * (shared + (i if "down" in targets else 0))
    norms = 2 * (4 * h + 4)  # fp32 input and rsqrt of both RMSNorms
    mlp_bytes = compute if not quantized or int8_device == "cpu" else 4
    mlp = mlp_bytes * 3 * i
    attention = compute * (a + 2 * kv + a) + 4 * heads
    lora = adapted_inputs + compute * rank * len(targets) + dropout_mask * every
    kept_by_int8 = 0
    if int8_device is not None:
        shared = compute == 4 and not dropout_mask  # fp32 adapters without dropout read these very tensors
        kept_by_int8 = ((0 if shared and {"q", "k", "v"} & set(targets) else 4 * h)
                        + (0 if shared and {"gate", "up"} & set(targets) else 4 * h)
                        + (0 if shared and "down" in targets else mlp_bytes * i))
    return norms + mlp + attention + lora + kept_by_int8


def _head_bytes_per_token(arch: Architecture, precision: str) -> int:
    """Saved outside the layers, per token: the token ids, the final RMSNorm, the lm_head input."""
    h = arch.hidden_size
    if precision == "fp32":
        return 8 + 4 * (h + h + h) + 4  # final norm input, normalized, output; rsqrt
    return 8 + 4 * (h + h) + 2 * h + 4  # final norm input, normalized; lm_head's cast of the output


def estimate_training_memory(arch: Architecture, batch_size: int, seq_len: int, precision: str = "fp32",
                             gradient_checkpointing: bool = False, overhead: int = 0, shards: int = 1,
                             chunked_loss: bool = False, grad_accum: int = 1, device: str = "cpu",
                             compiled: bool = False) -> MemoryEstimate:
    """Predicted peak bytes of full training (pretraining): fp32 weights, AdamW, autocast activations.
    `device` (a torch device type) sets the chunked loss's chunk size and whether attention saves
    repeated key/value heads (kv_heads_repeated).

    shards > 1: FSDP over that many processes (the per-process peak). The weights, gradients and
    AdamW state are divided among them; the root unit (embeddings, output layer, final norm) stays
    gathered during the step and two decoder layers are gathered at a time (one computing, one
    prefetched). A planning estimate: FSDP's peak has not been measured against a GPU yet.

    compiled: `ptbr train --compile`, whose compiled step keeps fewer activations than the eager one
    (inductor fuses the small kernels) and is planned as the eager step, an upper bound; where it
    takes the whole 16-bit logits in place of the chunked loss (compiled_whole_logits), as the
    eager chunked step plus those logits once. Measured: tiny in bf16 at a 32k vocabulary on CPU
    (the rule widened to it), 8 x 256 tokens 251 MB against 330 planned, 32 x 256 769 MB against
    912; 85m on an H100 (16 x 1024) 7.7 GB against 10.8."""
    if shards > 1:
        # FSDP2 accumulates unsharded gradients (no reduce-scatter until the last micro-batch)
        return _sharded(arch, estimate_training_memory(arch, batch_size, seq_len, precision, gradient_checkpointing,
                                                       overhead, chunked_loss=chunked_loss, grad_accum=grad_accum,
                                                       device=device, compiled=compiled),
                        shards, grad_accum)
    params = arch.parameters
    tokens = batch_size * seq_len
    mixed = precision in ("fp16", "bf16")
    per_layer = _layer_inventory(arch, precision, kv_heads_repeated(arch, precision, device)) * tokens
    head = _head_bytes_per_token(arch, precision) * tokens
    # autocast caches a 16-bit copy of each weight until the forward pass ends; without
    # checkpointing the backward pass still holds them, with it only the lm_head's is saved
    lm_head_copy = 2 * arch.lm_head_parameters if mixed else 0
    all_copies = arch.num_layers * 2 * arch.layer_linear_parameters() + lm_head_copy if mixed else 0
    if gradient_checkpointing:
        activations = arch.num_layers * 4 * arch.hidden_size * tokens + head  # each layer's fp32 input
        held_copies = lm_head_copy
    else:
        activations = arch.num_layers * per_layer + head
        held_copies = all_copies
    # one layer's backward: its saved (or recomputed) tensors, and two intermediate-sized
    # gradients alive at once in the MLP (measured: tests/test_memory.py)
    working = per_layer + 2 * (2 if mixed else 4) * arch.intermediate_size * tokens
    # Tied embeddings: the embedding's own gradient (vocab x hidden) exists before it is added to
    # the lm_head's. Measured: autograd adds it in place under autocast, but out of place in fp32,
    # which makes a third vocab x hidden buffer for a moment.
    embedding_grad = (4 if mixed else 8) * arch.lm_head_parameters if arch.tie_word_embeddings else 0
    logits = 3 * 4 * tokens * arch.vocab_size
    # a moment later the output layer's backward: in fp32 the logits' gradient, the gradient of the
    # layer's input and the layer's fresh weight gradient; in 16 bits the larger of its matmul (the
    # logits' 16-bit gradient, the weight's 16-bit gradient and a temporary of about that size that
    # torch's CPU matmul can make) and the weight gradient's fp32 upcast (the autocast copy freed by
    # then), planned as their bound. More than the loss's three tensors for micro-batches of fewer
    # tokens than about half the hidden size, and under accumulation on top of the kept gradients.
    output_backward = ((2 * tokens * arch.vocab_size + 4 * arch.lm_head_parameters + 2 * arch.hidden_size * tokens)
                       if mixed else 4 * (tokens * arch.vocab_size + arch.lm_head_parameters + arch.hidden_size * tokens))
    resident = 4 * params + 8 * params + overhead  # weights + AdamW state
    kept = 4 * params if grad_accum > 1 else 0  # the earlier micro-batches' gradients (see the module doc)
    forward_output = (2 if mixed else 4) * tokens * arch.vocab_size  # the logits
    if (chunked_loss and not arch.changes_logits
            and tokens >= chunked_loss_from(arch.hidden_size, precision)):
        # the output layer does not run in the forward pass (so autocast makes no copy of it, and
        # nothing saves its input); the loss then holds the final hidden states, their gradient
        # and the output layer's gradient, and works on one chunk of logits at a time
        activations -= (2 if mixed else 4) * arch.hidden_size * tokens  # the output layer's (cast) input
        all_copies -= lm_head_copy
        held_copies -= lm_head_copy
        forward_output = 4 * arch.hidden_size * tokens  # the final hidden states
        logits = _chunked_loss_bytes(arch, tokens, 2 if mixed else 4, device,
                                     gradient_summed_hidden(arch.hidden_size, precision))
        output_backward = 0  # its weight gradient was made in the forward pass, in `logits`
        # the output layer's gradient exists before the embedding's: that one is added in place
        embedding_grad = 4 * arch.lm_head_parameters if arch.tie_word_embeddings else 0
        if compiled and compiled_whole_logits(tokens, arch.vocab_size, precision, device):
            whole = 2 * tokens * arch.vocab_size  # the 16-bit logits, saved for the compiled backward
            logits += whole
            forward_output += whole
    if grad_accum > 1:
        # every gradient exists from the first micro-batch on, and the embedding's fresh (vocab x
        # hidden) gradient of a later one comes on top of them (tied: with the output layer's, which
        # waits for it to be added)
        embedding_grad += 4 * arch.lm_head_parameters
        if gradient_checkpointing:
            # and the first recomputed layer's backward runs while every kept gradient and every
            # layer's checkpointed input are alive (tied: the output layer's fresh gradient waiting too)
            working += (arch.num_layers * 4 * arch.hidden_size * tokens
                        + (4 * arch.lm_head_parameters if arch.tie_word_embeddings else 0))
    return MemoryEstimate(
        precision=precision, weights=4 * params, gradients=4 * params, optimizer=8 * params,
        activations=activations, logits=logits, overhead=overhead, weight_copies=all_copies,
        forward_end=resident + kept + activations + all_copies + forward_output,
        backward_start=resident + kept + activations + held_copies + max(logits, output_backward),
        backward_end=resident + 4 * params + max(working, embedding_grad),
    )


def compiled_whole_logits(tokens: int, vocab_size: int, precision: str, device: str) -> bool:
    """Whether `ptbr train --compile` computes the loss of a micro-batch of `tokens` tokens over
    the whole logits, compiled with the forward pass, even under --chunked-loss: on
    COMPILED_WHOLE_DEVICES in fp16/bf16 autocast, where the 16-bit logits take at most
    COMPILED_WHOLE_LOGITS_BYTES (fp32 keeps the chunked loss: its logits would be fp32)."""
    return (device in COMPILED_WHOLE_DEVICES and precision in ("fp16", "bf16")
            and 2 * tokens * vocab_size <= COMPILED_WHOLE_LOGITS_BYTES)


def loss_compiled_with_forward(tokens: int, vocab_size: int, chunked_from: int | None, precision: str,
                               device: str) -> bool:
    """`ptbr train --compile`: whether a micro-batch of `tokens` tokens has its loss compiled with
    the forward pass, over the whole logits (else the decoder alone is compiled and the chunked
    loss runs eager on it, which CUDA graphs do not take). `chunked_from`: the fewest tokens that
    the chunked loss takes (chunked_loss_from), None where it takes none (--no-chunked-loss, an
    output layer it cannot take). The one rule for train's step and preflight's plan."""
    return chunked_from is None or tokens < chunked_from or compiled_whole_logits(tokens, vocab_size, precision, device)


def chunk_tokens(vocab_size: int, device: str = "cpu", summed_hidden: int = 0) -> int:
    """Tokens per chunk of the chunked loss (ptbr/backends/torch/loss.py) on `device` (a torch
    device type): 32 MiB of fp32 logits (the CPU's caches), 256 MiB on a CUDA GPU; and at least
    CHUNK_TOKENS_PER_HIDDEN x `summed_hidden`, the hidden size where the output layer's gradient
    is summed from 16-bit products (a trained output layer under fp16/bf16; else 0, see
    gradient_summed_hidden)."""
    by_bytes = max(1, (CUDA_CHUNK_BYTES if device == "cuda" else CHUNK_BYTES) // (4 * vocab_size))
    return max(by_bytes, CHUNK_TOKENS_PER_HIDDEN * summed_hidden)


def gradient_summed_hidden(hidden_size: int, precision: str, trained: bool = True) -> int:
    """chunk_tokens' `summed_hidden` for an output layer of `hidden_size` trained (`trained`) in
    `precision`: its hidden size where the layer's gradient is summed from 16-bit products, else 0."""
    return hidden_size if trained and precision in ("fp16", "bf16") else 0


def chunked_loss_from(hidden_size: int, precision: str, trained: bool = True) -> int:
    """The fewest tokens of a micro-batch that --chunked-loss takes (fewer go through F.cross_entropy
    whole); logits that fit one chunk are one chunk, faster than F.cross_entropy (no zero-filled
    gradient of the logits, no log-softmax backward). Every micro-batch where the output layer is
    frozen (LoRA) or trained in fp32: the whole logits make the same fp32 (vocab x hidden) gradient
    as the chunks do. Where it is trained in 16 bits, the chunked loss also makes that gradient's
    16-bit products and casts in the forward pass, while every activation is alive: for fewer
    tokens than the hidden size that outweighs the logits it saves (measured: `85m` in bf16, 256
    tokens at a 32k vocabulary, 7% more at the peak; predicted up to 1.8 GiB more at `800m` with a
    128k vocabulary), from about the hidden size on it is less (that is also where a chunk holds at
    least CHUNK_TOKENS_PER_HIDDEN x hidden tokens: every 16-bit micro-batch of more than one chunk
    has more)."""
    return gradient_summed_hidden(hidden_size, precision, trained) or 1


def _chunked_loss_bytes(arch: Architecture, tokens: int, compute: int, device: str, summed_hidden: int) -> int:
    """The chunked loss of full training at its peak (ptbr/backends/torch/loss.py): the final
    hidden states (fp32, after the final RMSNorm), their fp32 gradient and the output layer's fp32
    gradient, all made in the forward pass; in 16 bits the output layer's 16-bit copy; and one
    chunk's work: its logits (worked on in place, IN_PLACE_DEVICES; elsewhere with a second buffer
    for the log-softmax) and one (chunk x hidden) product or masked copy of the hidden states; in 16
    bits also its 16-bit hidden states and the largest of: the logits before and after their fp32
    upcast (or the fp32 gradient of the logits and its 16-bit cast); the 16-bit gradient of the
    logits, its transposed copy (CPU) and the weight's 16-bit gradient; that gradient's fp32 upcast
    as it is added (CPU). Under the 2 x hidden minimum chunk the first is the largest."""
    h, vocab = arch.hidden_size, arch.vocab_size
    chunk = min(chunk_tokens(vocab, device, summed_hidden), tokens)
    held = 4 * h * tokens + 4 * h * tokens + 4 * vocab * h
    second = 0 if device in IN_PLACE_DEVICES else 4 * chunk * vocab
    if compute == 4:
        return held + 4 * chunk * vocab + second + 4 * chunk * h
    work = max(6 * chunk * vocab, 4 * chunk * vocab + second, 4 * chunk * vocab + 2 * vocab * h + 2 * chunk * h,
               2 * chunk * vocab + 6 * vocab * h + 2 * chunk * h)
    return held + 2 * vocab * h + 2 * chunk * h + work


def _sharded(arch: Architecture, whole: MemoryEstimate, shards: int, grad_accum: int) -> MemoryEstimate:
    params = arch.parameters
    layer = arch.layer_linear_parameters() + 2 * arch.hidden_size
    root = params - arch.num_layers * layer
    gathered = 4 * (root + 2 * layer)
    saved = (4 + 8) * params - (4 + 8) * params // shards - gathered  # weights and AdamW: sharded, some gathered
    # one layer's gradient whole before its reduce-scatter; under accumulation every gradient stays
    # whole until the step's last micro-batch, so an earlier one's backward ends holding them all
    grads = 0 if grad_accum > 1 else 4 * params - 4 * params // shards - 4 * layer
    return dataclasses.replace(
        whole, weights=4 * params // shards, gradients=4 * params // shards, optimizer=8 * params // shards,
        forward_end=whole.forward_end - saved, backward_start=whole.backward_start - saved,
        backward_end=whole.backward_end - saved - grads)


def estimate_lora_memory(arch: Architecture, batch_size: int, seq_len: int, lora_rank: int,
                         quant: str | None = "nf4", precision: str = "bf16", gradient_checkpointing: bool = False,
                         lora_dropout: bool = True, overhead: int = 0,
                         targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down"),
                         device: str = "cuda", dropout_impl: str = "auto", grad_accum: int = 1,
                         chunked_loss: bool = False) -> MemoryEstimate:
    """Predicted peak bytes of LoRA (quant=None) or QLoRA (quant="nf4", "int8"; "mlx4" on MLX), as
    ptbr.backends.torch.lora builds it.

    Quantized: the decoder's Linear weights are packed; peft's prepare_model_for_kbit_training
    casts embeddings, lm_head and norms to fp32, so the residual stream is fp32 too. Not
    quantized: the base in the compute dtype. Adapters train in fp32 with AdamW. Derived from the
    tensors autograd saves on CPU, and checked against the allocated peak of real CPU steps
    (tests/test_memory.py); `device` sets the size of dropout's masks, the chunked loss's chunk
    and whether attention saves repeated key/value heads (kv_heads_repeated). Measured on an H200 too (the README's table: within 0.5% with the whole logits, up to
    6.4% over with the chunked loss). With gradient checkpointing the backward pass recomputes one layer
    at a time while every layer's checkpointed input is still alive (backward_end counts both).
    chunked_loss: the loss of ptbr/backends/torch/loss.py (see below); its estimate is an upper bound.
    """
    if quant is not None and quant not in QUANT_BYTES:
        raise ValueError(f"unknown quantization {quant!r} (known: None, {', '.join(QUANT_BYTES)})")
    tokens = batch_size * seq_len
    compute = 2 if precision in ("fp16", "bf16") else 4
    other = arch.parameters - arch.linear_parameters  # embeddings, lm_head, norms
    if quant is None:
        base = compute * arch.parameters
        residual = compute
    elif quant == "mlx4":
        base = round(QUANT_BYTES["mlx4"] * arch.parameters)  # MLX quantizes the embeddings too
        residual = compute
    else:
        base = round(QUANT_BYTES[quant] * arch.linear_parameters) + 4 * other
        residual = 4
    adapters = arch.lora_parameters(lora_rank, targets)
    # a bool per value (packed, or torch's on CUDA); torch's on a CPU keeps an fp32 noise tensor
    bool_mask = device == "cuda" or lora_dropout_impl(dropout_impl, device) == "packed"
    mask = (1 if bool_mask else 4) if lora_dropout else 0
    per_layer = _lora_layer_inventory(arch, compute, quant is not None, lora_rank, mask, targets,
                                      device if quant == "int8" else None,
                                      kv_heads_repeated(arch, precision, device)) * tokens
    head = (8 + 4 * arch.hidden_size + 4) * tokens  # ids, the final RMSNorm's fp32 input, rsqrt
    head += 2 * seq_len * arch.attention_dim // arch.num_heads * residual  # RoPE's cos and sin, shared by the layers
    if not gradient_checkpointing:
        # the embeddings are frozen, so nothing before the first adapter needs a gradient: the first
        # layer's RMSNorm saves nothing, nor does dropout in front of q, k and v (with checkpointing
        # peft makes the embedding output require a gradient, and the first layer is like the others)
        head -= (4 * arch.hidden_size + 4 + mask * arch.hidden_size * len({"q", "k", "v"} & set(targets))) * tokens
    # autocast's 16-bit copy of the fp32 lm_head, saved to pass gradients to its input
    lm_head_copy = compute * arch.lm_head_parameters if compute < residual else 0
    # and of every fp32 adapter matrix, cached until the forward pass ends and saved for the
    # backward pass (with checkpointing only the recomputed layer's are)
    adapter_copies = compute * adapters if compute < 4 else 0
    # a quantized Linear is dequantized for its matmul (to the input's dtype, then autocast's), one at a time
    dequantized = (residual + compute) * arch.hidden_size * max(arch.intermediate_size, arch.attention_dim) if quant else 0
    if gradient_checkpointing:
        activations = arch.num_layers * residual * arch.hidden_size * tokens + head
        # the recomputed layer's saved tensors, and three intermediate-sized tensors more at once
        # in its MLP (gradients, and a projection's output before the adapter's is added; measured)
        mlp_grad = 4 if quant is not None else compute
        working = per_layer + 3 * mlp_grad * arch.intermediate_size * tokens + dequantized + adapter_copies // arch.num_layers
        if quant is None and compute < 4:
            # peft's fp32 casts of a 16-bit input are real copies here (behind a quantized base the
            # stream is fp32 already): two intermediate-sized ones are alive at the peak (measured)
            working += 2 * 4 * arch.intermediate_size * tokens
        held_copies = lm_head_copy
    else:
        activations = arch.num_layers * per_layer + head
        working = per_layer + dequantized
        held_copies = lm_head_copy + adapter_copies
    logits = 3 * 4 * tokens * arch.vocab_size
    resident = base + 16 * adapters + overhead  # adapters: fp32 weights, gradients, AdamW state
    kept = 4 * adapters if grad_accum > 1 else 0  # the earlier micro-batches' gradients
    estimate = MemoryEstimate(
        precision=precision, weights=base + 4 * adapters, gradients=4 * adapters, optimizer=8 * adapters,
        activations=activations, logits=logits, overhead=overhead, weight_copies=lm_head_copy + adapter_copies,
        forward_end=(resident + kept + activations + lm_head_copy + adapter_copies + dequantized
                     + compute * tokens * arch.vocab_size),
        backward_start=resident + kept + activations + held_copies + logits,
        backward_end=resident + working + (kept + activations if gradient_checkpointing else 0),
        quant=quant,
    )
    if not (chunked_loss and not arch.changes_logits):
        return estimate
    # The chunked loss: the output layer does not run in the forward pass (autocast saves no copy
    # of it); the loss holds the final hidden states, their gradient and one chunk's work. With
    # the whole logits gone, the last decoder layer can be the peak: its forward and backward
    # passes make intermediate-sized tensors while every layer's activations are alive. Counted
    # as the recomputed layer's are with checkpointing (three intermediate-sized tensors, the
    # dequantized weight, peft's fp32 casts): an upper bound, measured 1-10% above the real peak
    # of a three-layer model (1-21% with checkpointing), 1-3% at eight layers (tests/test_memory.py).
    copies = held_copies - lm_head_copy
    if gradient_checkpointing:
        layer = working
    else:
        mlp_grad = 4 if quant is not None else compute
        layer = 3 * mlp_grad * arch.intermediate_size * tokens + dequantized
        if quant is None and compute < 4:
            layer += 2 * 4 * arch.intermediate_size * tokens
    loss = _lora_chunked_loss_bytes(arch, tokens, compute, residual, device)
    return dataclasses.replace(
        estimate, logits=loss, weight_copies=adapter_copies,
        forward_end=resident + kept + activations + copies + loss,
        backward_start=resident + kept + activations + copies + layer)


def _lora_chunked_loss_bytes(arch: Architecture, tokens: int, compute: int, hidden: int, device: str) -> int:
    """The chunked loss of a frozen output layer at its peak: the final hidden states (`hidden`
    bytes per value: fp32 behind a quantized base, else the compute dtype) and their fp32
    gradient; one chunk's work (fp32: its logits and one matmul output; 16 bits: the logits
    before and after their fp32 upcast and the gradient of the logits cast back), and where the
    output layer is fp32 under autocast (QLoRA) its 16-bit copy and the chunk's cast hidden states."""
    h, vocab = arch.hidden_size, arch.vocab_size
    chunk = min(chunk_tokens(vocab, device), tokens)
    held = hidden * h * tokens + 4 * h * tokens
    second = 0 if device in IN_PLACE_DEVICES else 4 * chunk * vocab  # the log-softmax's own buffer
    if compute == 4:
        return held + 4 * chunk * vocab + second + 4 * chunk * h
    casts = 2 * vocab * h + 2 * chunk * h if hidden == 4 else 0
    return held + casts + max(6 * chunk * vocab, 4 * chunk * vocab + second)


# --------------------------------------------------------------------------------------------
# A run's settings -> the model's arguments (what preflight and --auto-fit plan with)
# --------------------------------------------------------------------------------------------

# --quant -> the memory model's name for the base's weights; MLX quantizes with its own format
QUANT_NAMES = {"4bit": "nf4", "8bit": "int8", "none": None}
LORA_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}


def quant_name(quant: str, target: str) -> str | None:
    """The memory model's name for a fine-tuning base quantized per --quant on `target`."""
    name = QUANT_NAMES[quant]
    return "mlx4" if name and target == "mlx" else name


def lora_targets(target_modules: str | None) -> tuple[str, ...]:
    """The memory model's names for --target-modules (default: every projection)."""
    names = [n.strip() for n in (target_modules or "").split(",") if n.strip()]
    known = tuple(LORA_TARGETS[n] for n in names if n in LORA_TARGETS)
    return known or tuple(LORA_TARGETS.values())


def estimate_run(settings, arch: Architecture, target: str, batch_size: int, seq_len: int, precision: str,
                 checkpointing: bool, processes: int = 1, *, grad_accum: int) -> MemoryEstimate:
    """The predicted peak, per process, of a run with these settings (PretrainConfig or
    FinetuneConfig) on `target` (cuda | cpu | mps | mlx), the runtime outside the model's tensors
    included. `processes`: data-parallel processes (each holds everything, unless settings.fsdp
    shards the state among them). `grad_accum`: micro-batches per step at this batch_size (from
    the second on, the gradients of the earlier ones are kept)."""
    overhead = RUNTIME_BYTES.get(target, RUNTIME_BYTES["cpu"])
    if target == "mlx":
        lora = hasattr(settings, "lora_r")
        return estimate_mlx_memory(arch, batch_size, seq_len, precision, settings.lora_r if lora else None,
                                   MLX_QUANT_BITS[settings.quant] if lora else None, checkpointing,
                                   lora_dropout=lora and settings.lora_dropout > 0, overhead=overhead,
                                   targets=lora_targets(settings.target_modules) if lora else LORA_ALL,
                                   grad_accum=grad_accum)
    if not hasattr(settings, "lora_r"):
        shards = processes if settings.fsdp else 1
        return estimate_training_memory(arch, batch_size, seq_len, precision, checkpointing, overhead, shards,
                                        chunked_loss=settings.chunked_loss, grad_accum=grad_accum, device=target,
                                        compiled=getattr(settings, "compile", False))
    return estimate_lora_memory(arch, batch_size, seq_len, settings.lora_r, quant_name(settings.quant, target),
                                precision, checkpointing, lora_dropout=settings.lora_dropout > 0, overhead=overhead,
                                targets=lora_targets(settings.target_modules), device=target,
                                dropout_impl=settings.lora_dropout_impl, grad_accum=grad_accum,
                                chunked_loss=settings.chunked_loss)


# --------------------------------------------------------------------------------------------
# MLX (ptbr/backends/mlx): its own estimate, measured against mx.get_peak_memory()
# --------------------------------------------------------------------------------------------

MLX_GROUP = 64  # MLX's affine quantization: a scale and a bias per group of 64 weights
MLX_QUANT_BITS = {"4bit": 4, "8bit": 8, "none": None}  # --quant on the MLX backend
LORA_ALL = ("q", "k", "v", "o", "gate", "up", "down")
# One decoder layer's backward pass holds this many times its saved activations on top of what
# every layer saved (its gradients and MLX's temporaries), measured on mlx[cpu]
# (benchmarks/mlx_memory_accuracy.py).
MLX_LAYER_WORKING = 2


MLX_SHORTEST_BUCKET = 32


def mlx_bucket_length(length: int, longest: int) -> int:
    """The length the MLX backend pads a micro-batch of `length` tokens to (ptbr/backends/mlx/step.py):
    the next of 32, 48, 64, 96, 128, 192, ... (a power of two, or 1.5 times one), capped at the
    run's longest sequence (a bucket of its own). Each new shape is a new compilation, so the
    buckets are few (15 up to 4,096 tokens), and a micro-batch computes at most a third more
    positions than it holds (powers of two alone: up to twice, a quarter more on average, which
    put ptbr 5% behind mlx-lm's multiples of 32). The memory model plans with these shapes."""
    padded = MLX_SHORTEST_BUCKET
    while padded < length:
        padded = padded * 3 // 2 if padded & (padded - 1) == 0 else padded * 4 // 3
    return max(length, min(padded, longest))


def padded_length(target: str, longest: int, cap: int) -> int:
    """The length a fine-tuning micro-batch whose longest example has `longest` tokens runs at on
    `target`: MLX pads it to a bucket (mlx_bucket_length); torch to the longest example."""
    return mlx_bucket_length(longest, cap) if target == "mlx" else longest


def mlx_quant_bytes(bits: int, compute: int) -> float:
    """Bytes per weight of MLX's affine quantization: the packed bits, and a scale and a bias per
    group of 64 in the compute dtype."""
    return bits / 8 + 2 * compute / MLX_GROUP


def _mlx_layer_inventory(arch: Architecture, compute: int, seq_len: int) -> int:
    """Bytes one decoder layer of mlx-lm's Llama saves for the backward pass, per token: each
    RMSNorm's input and output (the norm's and the next projections' gradients need them), RoPE'd
    q, k and v, the attention output, the residual after attention, and four intermediate-sized
    MLP tensors (gate, up, silu(gate), their product), all in the compute dtype; and the attention
    probabilities (heads x seq_len per token, fp32): on the CPU MLX computes attention unfused."""
    h, a, kv, i, heads = arch.hidden_size, arch.attention_dim, arch.kv_dim, arch.intermediate_size, arch.num_heads
    return compute * (4 * h + 2 * a + 2 * kv + 4 * i) + 4 * heads * seq_len


def _mlx_adapter_inventory(arch: Architecture, compute: int, rank: int, dropout: bool,
                           targets: tuple[str, ...]) -> int:
    """What mlx-lm's LoRA layers of one decoder layer add, per token: each adapter's B input (rank
    values, fp32: the adapters are fp32); with dropout, each adapter's own dropped-out input; under
    bf16/fp16, each adapter's fp32 copy of its input (x @ lora_a promotes x to the adapter's fp32)."""
    inputs = {"q": arch.hidden_size, "k": arch.hidden_size, "v": arch.hidden_size, "o": arch.attention_dim,
              "gate": arch.hidden_size, "up": arch.hidden_size, "down": arch.intermediate_size}
    every = sum(inputs[t] for t in targets)
    return 4 * rank * len(targets) + (compute * every if dropout else 0) + (4 * every if compute < 4 else 0)


def estimate_mlx_memory(arch: Architecture, batch_size: int, seq_len: int, precision: str = "bf16",
                        lora_rank: int | None = None, quant_bits: int | None = None,
                        gradient_checkpointing: bool = False, lora_dropout: bool = False, overhead: int = 0,
                        targets: tuple[str, ...] = LORA_ALL, grad_accum: int = 1) -> MemoryEstimate:
    """Predicted peak of an MLX training step (ptbr.backends.mlx), as mx.get_peak_memory() reports it.

    Pretraining (lora_rank None): fp32 master weights, their fp32 gradients and AdamW state, and
    under bf16/fp16 a 16-bit cast of every weight for the forward and backward passes. LoRA: the
    frozen base in the compute dtype or MLX-quantized (quant_bits 4 or 8: every layer MLX quantizes,
    embeddings and output layer included), fp32 adapters with gradients and AdamW state.
    Two moments of a step can be the peak:
      backward   = weights + optimizer + gradients + every layer's saved activations (with
                   checkpointing: each layer's input) + one layer's backward working set + the
                   fp32 logits, their exponentials and their gradient (3 x 4 B per vocabulary entry;
                   in bf16/fp16 also the 16-bit logits and their 16-bit gradient: 16 B)
      update     = weights + optimizer + gradients + one group's new weights, AdamW state and
                   clipped gradients (MLX writes them to fresh buffers before the old ones are
                   freed; ptbr's AdamW updates one decoder layer, then the rest, at a time)
    With gradient accumulation a later micro-batch's backward makes its gradients while the
    accumulated ones are alive (4 B per trainable parameter more in the backward moment).
    (MemoryEstimate's fields: backward_start holds the backward moment, backward_end the update;
    forward_end is the forward pass's end, never the larger.) Within 8% of mx.get_peak_memory() on
    mlx[cpu] (benchmarks/mlx_memory_accuracy.py; tests/test_mlx_memory.py allows 10%); on Metal,
    where attention's forward pass is fused, not measured yet.
    """
    tokens = batch_size * seq_len
    compute = 2 if precision in ("fp16", "bf16") else 4
    lora = lora_rank is not None
    if lora:
        trainable = arch.lora_parameters(lora_rank, targets)
        if quant_bits:
            quantized = arch.linear_parameters + arch.vocab_size * arch.hidden_size * (
                1 if arch.tie_word_embeddings else 2)
            base = round(mlx_quant_bytes(quant_bits, compute) * quantized) + compute * (arch.parameters - quantized)
        else:
            base = compute * arch.parameters
        weights = base + 4 * trainable
        casts = 0
    else:
        trainable = arch.parameters
        weights = 4 * trainable
        casts = compute * trainable if compute < 4 else 0
    per_layer = _mlx_layer_inventory(arch, compute, seq_len)
    adapters = _mlx_adapter_inventory(arch, compute, lora_rank, lora_dropout, targets) if lora else 0
    if gradient_checkpointing:  # each layer's input; the layer being recomputed is in `working`
        activations = arch.num_layers * compute * arch.hidden_size * tokens
        working = (MLX_LAYER_WORKING * per_layer + adapters) * tokens
    else:
        activations = arch.num_layers * (per_layer + adapters) * tokens
        working = MLX_LAYER_WORKING * per_layer * tokens
    # fp32 logits, their exponentials and their gradient; in 16 bits also the logits as the output
    # layer made them and their gradient cast back for its backward pass (measured on mlx[cpu]:
    # 12.0 and 16.0 bytes per entry at vocabulary 32,000)
    logits = (3 * 4 + (2 * compute if compute < 4 else 0)) * tokens * arch.vocab_size
    resident = weights + 8 * trainable + 4 * trainable + overhead  # + AdamW state + gradients
    if lora:  # the adapters of one layer
        group = trainable // arch.num_layers
    else:  # a decoder layer, or the embeddings with the output layer and the final norm
        group = max(arch.layer_linear_parameters() + 2 * arch.hidden_size, arch.parameters - arch.num_layers * (
            arch.layer_linear_parameters() + 2 * arch.hidden_size))
    return MemoryEstimate(
        precision=precision, weights=weights, gradients=4 * trainable, optimizer=8 * trainable,
        activations=activations, logits=logits, overhead=overhead, weight_copies=casts,
        forward_end=resident + casts + activations + compute * tokens * arch.vocab_size,
        backward_start=resident + (4 * trainable if grad_accum > 1 else 0) + casts + activations + working + logits,
        backward_end=resident + 16 * group,  # its new weights, m and v, and its clipped gradients
        quant=f"mlx{quant_bits}" if quant_bits else None,
    )
