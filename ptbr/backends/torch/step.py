"""The torch training step: forward, loss, backward over the micro-batches of one optimizer step,
clipping, the update (with GradScaler in fp16), evaluation, and the state a checkpoint holds."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from ptbr.backends.world import SingleProcess
from ptbr.data.batch import IGNORE_INDEX, Batch, StepResult, input_count, target_count


class TorchStep:
    """One optimizer step of a torch model: accumulate, clip, update; plus eval and state I/O.

    In a data-parallel run every rank calls each method at the same moment. A rank's micro-batches
    are its slices of the global step's (see ptbr/data/tokens.py PretrainBatches); the loss of the
    step is the mean over every target token of every rank, and the gradients are averaged by DDP
    (or reduced by FSDP) with that weighting, so the update equals the single-process one.
    """

    def __init__(self, model, optimizer, placement, max_grad_norm: float, world=None, parallel=None,
                 sharded: bool = False, compile: bool = False, *, chunked_loss: bool, right_padded: bool = False,
                 cuda_graphs: bool = False, gradient_checkpointing: bool = False):
        import torch

        self.model = model  # the module itself: evaluation and saving go through it
        self.parallel = parallel  # DDP wrapper (None: one process, or FSDP which shards `model` in place)
        self.sharded = sharded  # FSDP: every rank holds a shard; whole states are gathered to save
        self.optimizer = optimizer
        self.placement = placement
        self.precision = placement.precision
        self.max_grad_norm = max_grad_norm
        self.world = world or SingleProcess()
        if placement.device.type == "cuda":  # fp32, or fp16 before Ampere: no silent math-kernel attention
            from ptbr.backends.torch.attention import keep_sdpa_off_the_math_kernel

            keep_sdpa_off_the_math_kernel()
        elif placement.device.type == "cpu":  # bf16: attention's backward by the fp32 flash kernel (2x faster)
            from ptbr.backends.torch.attention import backpropagate_cpu_bf16_attention_in_fp32

            backpropagate_cpu_bf16_attention_in_fp32()
        fp16 = placement.precision == "fp16"
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(placement.device.type, enabled=fp16)
        else:
            self.scaler = torch.amp.GradScaler(placement.device.type, enabled=fp16)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.exported: dict | None = None  # FSDP: the whole weights of the last checkpoint (main rank)
        # FSDP: whether `exported` holds the current weights, known alike on every rank (saving and
        # gathering are collectives: a rank deciding alone would leave the others waiting)
        self.gathered = False
        # --chunked-loss: the loss fused with the output layer, a chunk of tokens' logits at a time
        # (ptbr/backends/torch/loss.py), for micro-batches of at least `_chunked_from` tokens (one
        # chunk where their logits fit one); head None: the whole logits, always
        self.chunked_loss = chunked_loss
        self.head, self.whole_logits_why = None, None
        # its tokens per chunk (loss.chunk_size, as the loss takes them) and the fewest tokens it
        # takes (loss.fewest_chunked_tokens): fixed for the run
        self._loss_chunk = self._chunked_from = None
        if chunked_loss:
            from ptbr.backends.torch.loss import chunk_size, chunkable_head, fewest_chunked_tokens

            self.head, self.whole_logits_why = chunkable_head(model, placement.autocast)
            if self.head is not None:
                dtype = placement.autocast_dtype or self.head.weight.dtype
                self._loss_chunk = chunk_size(self.head.weight, dtype, placement.device.type)
                self._chunked_from = fewest_chunked_tokens(self.head.weight, dtype)
            if sharded:  # its probe's forward pass left FSDP's root unit gathered (loading a state then fails)
                model.reshard()
        # fine-tuning's right-padded batches go without their attention mask where the model is a
        # causal decoder (ptbr/backends/torch/padding.py): less memory, SDPA's causal kernel
        self.keeps_padding_mask, self.padding_mask_why = True, None
        if right_padded:
            from ptbr.backends.torch.padding import padding_mask_needed

            self.padding_mask_why = padding_mask_needed(model, placement.autocast,
                                                        half=placement.precision in ("fp16", "bf16"))
            self.keeps_padding_mask = self.padding_mask_why is not None
        # every module in training mode, once: a base from from_pretrained comes in evaluation mode
        # under a PEFT wrapper (or DDP's) that says training, and gradient checkpointing and dropout
        # follow each module's own flag; train_step then only undoes evaluation's eval()
        (parallel or model).train()
        # --compile: training steps run the decoder compiled (the chunked loss eager), or the forward
        # pass and the whole logits' loss compiled together; evaluation stays eager (no_grad would be
        # a second compile, for a few batches)
        self._train_loss, self._kernels = self._loss_sum, nullcontext
        self.compiled = compile
        # --cuda-graphs (under --compile on a CUDA GPU): a step of one micro-batch whose loss is
        # compiled with the forward pass replays it as CUDA graphs; why not, where it cannot
        self._graphed_whole, self.cuda_graphs_why_not = None, None
        if compile:
            from ptbr.backends.torch.compiled import (
                compile_loss,
                cuda_graphs_refusal,
                deterministic_kernels,
            )

            self._kernels = deterministic_kernels
            self._compiled_whole = compile_loss(self._whole_loss_sum)
            self._compiled_hidden = compile_loss(self._decoder_hidden_states) if self.head is not None else None
            self._train_loss = self._compiled_loss_sum
            if cuda_graphs:
                self.cuda_graphs_why_not = cuda_graphs_refusal(placement.device.type, gradient_checkpointing)
                if self.cuda_graphs_why_not is None:  # compiled at its first call, never if no step takes it
                    self._graphed_whole = compile_loss(self._whole_loss_sum, cuda_graphs=True)

    def _to_device(self, batch: Batch) -> dict:
        """On a GPU the copy is queued from pinned memory, so that it runs while the GPU computes."""
        import torch

        pin = self.placement.device.type == "cuda"
        tensors = {k: torch.as_tensor(v, dtype=torch.long) for k, v in batch.items()
                   if k != "attention_mask" or self.keeps_padding_mask}
        return {k: (t.pin_memory() if pin else t).to(self.placement.device, non_blocking=True)
                for k, t in tensors.items()}

    def loss_chunk(self) -> int | None:
        """Tokens per chunk of the chunked loss (None: the whole logits, always)."""
        return self._loss_chunk

    def chunked_from(self) -> int | None:
        """The fewest tokens of a micro-batch that the chunked loss takes (None: the whole logits,
        always)."""
        return self._chunked_from

    def _chunks(self, batch: dict) -> bool:
        return self.head is not None and batch["labels"].numel() >= self._chunked_from

    def compiles_whole_logits(self, tokens: int) -> bool:
        """--compile: whether a micro-batch of `tokens` tokens that the chunked loss would take
        has its loss compiled with the forward pass over the whole 16-bit logits instead
        (ptbr.memory.compiled_whole_logits: on a CUDA GPU, where they are small enough)."""
        from ptbr.memory import compiled_whole_logits

        return (self.compiled and self.head is not None
                and compiled_whole_logits(tokens, self.head.out_features, self.precision, self.placement.device.type))

    def _loss_sum(self, module, batch: dict):
        """Summed cross-entropy over the target tokens of one micro-batch (eager)."""
        if not self._chunks(batch):
            return self._whole_loss_sum(module, batch)
        from ptbr.backends.torch.loss import hidden_states_of

        with hidden_states_of(self.head) as seen, self.placement.autocast():
            module(**_inputs(batch))
        return self._chunked_loss_sum(seen["hidden"], seen["weight"], batch)

    def _whole_loss_sum(self, module, batch: dict):
        import torch.nn.functional as F

        with self.placement.autocast():
            logits = module(**_inputs(batch)).logits  # (B, T, vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def _chunked_loss_sum(self, hidden, weight, batch: dict):
        from ptbr.backends.torch.loss import chunked_cross_entropy

        return chunked_cross_entropy(hidden.flatten(0, 1), weight, batch["labels"].flatten(),
                                     self.placement.autocast_dtype, self._loss_chunk)

    def _decoder_hidden_states(self, module, batch: dict):
        """The final hidden states, from the model's decoder alone (what --compile compiles for the
        chunked loss: one process, so `module` is the model itself, not a DDP or FSDP wrapper)."""
        with self.placement.autocast():
            return module.get_decoder()(**_inputs(batch)).last_hidden_state

    def _compiled_loss_sum(self, module, batch: dict, graphs: bool = False):
        """--compile: the decoder compiled and the chunked loss eager, or the forward pass and the
        whole logits' loss compiled together (on a CUDA GPU also for micro-batches that the chunked
        loss would take, where their 16-bit logits are small enough: faster there). `graphs`: the
        latter replayed as CUDA graphs (a step of this one micro-batch, where they can run)."""
        if not self._compiles_whole(batch["labels"].numel()):
            return self._chunked_loss_sum(self._compiled_hidden(module, batch), self.head.weight, batch)
        if graphs and self._graphed_whole is not None:
            import torch

            # a new step: the previous replay's outputs (its loss, its gradients) are used and let go
            torch.compiler.cudagraph_mark_step_begin()
            return self._graphed_whole(module, batch)
        return self._compiled_whole(module, batch)

    def _compiles_whole(self, tokens: int) -> bool:
        """--compile: whether a micro-batch of `tokens` tokens has its loss compiled with the forward
        pass (else the decoder alone is compiled, and the chunked loss runs eager on it)."""
        from ptbr.memory import loss_compiled_with_forward

        if self.head is None:
            return True
        return loss_compiled_with_forward(tokens, self.head.out_features, self._chunked_from, self.precision,
                                          self.placement.device.type)

    def graphs_step(self, micro_batches: int, tokens: int) -> bool:
        """Whether a step of `micro_batches` micro-batches of `tokens` tokens replays as CUDA graphs:
        one whose loss is compiled with the forward pass, where they can run (several: the second
        replay would overwrite the first one's gradients, which live in the graphs' memory until the
        update; the chunked loss runs eager on the compiled decoder, not measured under them)."""
        return self._graphed_whole is not None and micro_batches == 1 and self._compiles_whole(tokens)

    def cuda_graphs_line(self, micro_batches: int, tokens: int) -> str | None:
        """What --cuda-graphs does for steps of `micro_batches` micro-batches of `tokens` tokens, in
        words (None: nothing to say, off or not on a CUDA GPU)."""
        if self.graphs_step(micro_batches, tokens):
            from ptbr.backends.torch.compiled import GRAPHS_REPLAY

            return GRAPHS_REPLAY
        if self.cuda_graphs_why_not and self.placement.device.type == "cuda":
            return f"CUDA graphs: {self.cuda_graphs_why_not}"
        if self._graphed_whole is None:
            return None
        if not self._compiles_whole(tokens):
            from ptbr.backends.torch.compiled import EAGER_LOSS_REFUSAL

            return f"CUDA graphs: {EAGER_LOSS_REFUSAL}"
        from ptbr.backends.torch.compiled import accumulation_refusal

        return f"CUDA graphs: {accumulation_refusal(micro_batches)}"

    def _sync_gradients(self, sync: bool):
        """DDP and FSDP reduce gradients across ranks on the last micro-batch of a step only."""
        if self.parallel is not None:
            return nullcontext() if sync else self.parallel.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(sync)
        return nullcontext()

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepResult:
        """Gradient accumulation over `micro_batches`: the loss is the mean over every target token
        of the step (of every rank), so micro-batches are averaged (weighted by their tokens) and a
        short last cycle of an epoch is applied with its own size, never dropped."""
        import torch

        module = self.parallel or self.model
        if not self.model.training:  # set in __init__; transformers' train() walks every module, not each step
            module.train()
        targets, inputs = target_count_of(micro_batches), input_count(micro_batches)
        if self.world.size > 1:
            targets, inputs = (int(v) for v in self.world.sum([targets, inputs]))
        if targets == 0:
            return StepResult(float("nan"), float("nan"), 0, inputs, True)
        # DDP and FSDP average the ranks' gradients: each rank's sum over its tokens, times the
        # world size, divided by the step's tokens, averages to the single-process gradient
        total = torch.zeros((), device=self.placement.device)
        # every micro-batch's copy queued up front: on a GPU they travel while the first computes
        on_device = [self._to_device(batch) for batch in micro_batches]
        graphs = self.graphs_step(len(on_device), on_device[0]["labels"].numel())
        for index, batch in enumerate(on_device):
            with self._sync_gradients(index == len(micro_batches) - 1), self._kernels():
                loss_sum = (self._compiled_loss_sum(module, batch, graphs=True) if graphs
                            else self._train_loss(module, batch))
                self.scaler.scale(loss_sum * self.world.size / targets).backward()
            total += loss_sum.detach()
        self.scaler.unscale_(self.optimizer)
        clip = self.max_grad_norm if self.max_grad_norm > 0 else math.inf
        norm = _full(torch.nn.utils.clip_grad_norm_(self.params, clip))
        # the step's one wait for the device: the loss and the norm come back together
        loss_sum, grad_norm = torch.stack([total, norm.to(total.dtype)]).tolist()
        if self.world.size > 1:
            loss_sum = self.world.sum([loss_sum])[0]
        loss = loss_sum / targets
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
        # set_to_none: under CUDA graphs the gradients live in the graphs' memory, which the next
        # step's replay overwrites; they must be let go here, not zeroed in place
        self.optimizer.zero_grad(set_to_none=True)
        self.gathered = False
        return StepResult(loss, grad_norm, targets, inputs, skipped)

    def eval_loss(self, batches: list[Batch]) -> float:
        """Mean loss per target token over a fixed set of batches. In a data-parallel run each
        batch is the global one and each rank evaluates its slice of its rows."""
        import torch

        mine = [rank_slice(batch, self.world.rank, self.world.size) for batch in batches]
        self.model.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for batch in mine:
                    total += self._loss_sum(self.model, self._to_device(batch)).item()
                    count += target_count(batch)
        finally:
            self.model.train()
        if self.sharded:
            # FSDP keeps the root's gathered weights after a forward pass until the next backward:
            # shard them again, or saving and the optimizer would meet other parameter objects
            self.model.reshard()
        if self.world.size > 1:
            total, count = self.world.sum([total, count])
        return total / count if count else float("nan")

    # ---- state ------------------------------------------------------------------------------

    def save_state(self, directory: Path | None) -> None:
        """Model (safetensors, via save_pretrained: full weights or a PEFT adapter), optimizer
        (keyed by parameter name, so that one, several or sharded processes can load it), scaler
        and the RNG state of every rank. In a data-parallel run every rank calls it (the states
        are gathered), and only the main rank, given a directory, writes."""
        import torch
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True, cpu_offload=self.sharded)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=whole)  # collective under FSDP
        weights = whole_weights(self.model, options=whole) if self.sharded else None
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        if self.world.size > 1:
            rng["torch_by_rank"] = [state.cpu() for state in self.world.gather(rng["torch"])]
            if self.placement.device.type == "cuda":  # each rank's GPU draws its own dropout masks
                own = torch.cuda.get_rng_state(self.placement.device)
                rng["cuda_by_rank"] = [state.cpu() for state in self.world.gather(own)]
        self.gathered = True
        if directory is None:
            return
        self.exported = weights
        # save_pretrained consumes the dict it is given: a copy, so that final/ can use the weights
        self.model.save_pretrained(str(directory), safe_serialization=True,
                                   state_dict=dict(weights) if weights is not None else None)
        torch.save(optimizer, directory / "optimizer.pt")
        torch.save(self.scaler.state_dict(), directory / "scaler.pt")
        torch.save(rng, directory / "rng.pt")

    def load_state(self, directory: Path) -> None:
        import torch
        from safetensors.torch import load_file, load_model
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True)
        adapter = directory / "adapter_model.safetensors"
        if adapter.is_file():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(str(adapter), device=str(self.placement.device)))
        elif self.sharded:
            set_model_state_dict(self.model, load_file(str(directory / "model.safetensors")), options=whole)
        else:
            load_model(self.model, str(directory / "model.safetensors"), device=str(self.placement.device))
        # sharded: the whole AdamW state stays in host memory, and each rank's GPU gets its shard only
        where = "cpu" if self.sharded else self.placement.device
        optimizer = torch.load(directory / "optimizer.pt", weights_only=True, map_location=where)
        if isinstance(optimizer["param_groups"][0]["params"][0], int):
            self.optimizer.load_state_dict(optimizer)  # saved by an earlier ptbr, in torch's own numbering
        else:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=whole)
        self.scaler.load_state_dict(torch.load(directory / "scaler.pt", weights_only=True))
        rng = torch.load(directory / "rng.pt", weights_only=True)
        by_rank = rng.get("torch_by_rank") or [rng["torch"]]
        if len(by_rank) == self.world.size:
            torch.set_rng_state(by_rank[self.world.rank])
        else:
            # written by another number of processes: each rank's stream (LoRA dropout) restarts
            # from the checkpoint's first one, offset by the rank, so that ranks still differ
            torch.set_rng_state(by_rank[0])
            torch.manual_seed(int(torch.randint(0, 2**62, ())) + self.world.rank)
        if self.placement.device.type == "cpu":
            from ptbr.backends.torch.allocator import give_back_freed_memory

            give_back_freed_memory()  # the files' buffers, freed into a heap that ptbr keeps from trimming
        if "cuda" in rng and torch.cuda.is_available() and self.world.size == 1:
            torch.cuda.set_rng_state_all(rng["cuda"])
        cuda_by_rank = rng.get("cuda_by_rank")
        if cuda_by_rank and len(cuda_by_rank) == self.world.size > 1 and self.placement.device.type == "cuda":
            torch.cuda.set_rng_state(cuda_by_rank[self.world.rank], self.placement.device)

    def gather_whole(self) -> None:
        """FSDP, on every rank: the whole current weights to the main rank (`exported`) for final/,
        unless the last checkpoint gathered them already; a no-op in one process and with DDP."""
        if not self.sharded or self.gathered:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        weights = whole_weights(self.model, StateDictOptions(full_state_dict=True, cpu_offload=True))
        self.exported = weights if self.world.is_main else None
        self.gathered = True

    def memory_bytes(self) -> int:
        from ptbr.backends.torch.device import peak_memory

        return peak_memory(self.placement.device)


def _inputs(batch: dict) -> dict:
    """The model's inputs of a batch on the device: everything but the labels, and no KV cache
    (transformers builds one per forward pass unless told not to; training never reads it, and
    where attention repeats the key/value heads it would hold a second copy of them)."""
    return {k: v for k, v in batch.items() if k != "labels"} | {"use_cache": False}


def whole_weights(model, options) -> dict:
    """FSDP: the whole state dict, gathered (a collective: every rank calls it; the main rank gets
    the tensors). Tied output weights are the input embeddings: saved once, as transformers does."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=options)
    if getattr(model.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    return weights


def target_count_of(batches: list[Batch]) -> int:
    return sum(target_count(b) for b in batches)


def rank_slice(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's rows of a global batch. A rank left without rows evaluates one row whose loss
    covers nothing: every rank runs as many forward passes (FSDP gathers weights in each)."""
    if world == 1:
        return batch
    rows = -(-len(batch["input_ids"]) // world)
    mine = {k: np.asarray(v)[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
    if len(mine["input_ids"]) == 0:
        first = {k: np.asarray(v)[:1] for k, v in batch.items()}
        return dict(first, labels=np.full_like(first["labels"], IGNORE_INDEX))
    return mine


def _full(value):
    """A norm computed over sharded (FSDP) parameters is a DTensor: its full value."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def build_optimizer(model, settings, device, fused: bool = True):
    """AdamW, fused where the device supports it (not over FSDP's sharded parameters); no weight
    decay on norms and biases."""
    import torch

    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": settings.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": settings.learning_rate, "betas": (settings.beta1, settings.beta2), "eps": 1e-8}
    if fused and device.type in ("cuda", "cpu"):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(groups, **kwargs)
