"""`ptbr finetune`: settings -> the base's tokenizer -> checked and encoded data -> resume check ->
base + LoRA (from the backend) -> fit() -> OUTPUT/adapters (best by val_loss),
training_summary.json, and OUTPUT/merged with --merge."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ptbr.backends import create_backend
from ptbr.config import FinetuneConfig
from ptbr.errors import DataError
from ptbr.finetune.adapter import save_adapter
from ptbr.finetune.base import (
    check_tokenizer_fits,
    fingerprint,
    load_tokenizer,
    local_path,
    max_positions,
    read_config,
    weights_sample,
)
from ptbr.finetune.batches import ChatBatches, collate, fixed_batches
from ptbr.finetune.data import JsonlReport, data_paths, fix_of, inspect_pair, problems_summary
from ptbr.log import log
from ptbr.memory import Architecture, padded_length
from ptbr.runs.common import (
    Resume,
    closing_world,
    describe_placement,
    effective_batch,
    find_resume,
    finish,
    open_run,
    out_of_memory_is_an_error,
    plan_host_memory,
    predicted_peak_bytes,
    refuse_auto_fit_in_parallel,
    start_state,
    warn_if_warmup_outlasts_the_run,
    write_run_config,
)
from ptbr.train.autofit import auto_fit, ram_guard, resume_smaller_on_oom
from ptbr.train.loop import Callbacks, LoopState, fit
from ptbr.train.schedule import Schedule
from ptbr.train.watchdog import Watchdog


@dataclass
class FinetuneResult:
    summary: dict  # training_summary.json
    adapted: object  # the backend's base + adapter as it stands after the last step
    tokenizer: object
    source: ChatBatches  # the training batches (cycle(step) gives any step's micro-batches)
    eval_batches: list[dict] | None
    settings: FinetuneConfig  # with max_steps and warmup_steps resolved

    @property
    def model(self):
        """The trained model (for torch, a peft.PeftModel)."""
        return self.adapted.model


def run_finetune(settings: FinetuneConfig) -> FinetuneResult:
    backend = create_backend(settings.backend, settings.device, settings.precision)
    refuse_auto_fit_in_parallel(settings, backend.world)
    with closing_world(backend.world), open_run(settings, backend.world) as run_dir:
        with Watchdog(run_dir, settings.hang_timeout, settings.hang_action, backend.memory_report,
                      backend.world.rank, backend.world.size) as watchdog:
            loaded = _load(settings, backend, run_dir)
            if settings.auto_fit:  # an out-of-memory mid-run: smaller micro-batch, from the last checkpoint
                result = resume_smaller_on_oom(backend, lambda s: _train(s, backend, loaded, run_dir, watchdog),
                                               settings, run_dir)
            else:
                with out_of_memory_is_an_error(backend):
                    result = _train(settings, backend, loaded, run_dir, watchdog)
        if settings.merge:
            # outside the watchdog: loading and merging a 7B base on the CPU takes minutes
            # without a step to report
            result.summary = backend.world.decide(lambda: _merge(settings, run_dir, result.summary))
    return result


def _merge(settings: FinetuneConfig, run_dir: Path, summary: dict) -> dict:
    from ptbr.files import write_json
    from ptbr.finetune.merge import merge_adapter

    merged = merge_adapter(settings.base, run_dir / "adapters", run_dir / "merged",
                           trust_remote_code=settings.trust_remote_code, download=settings.download)
    summary = summary | {"merged": str(merged)}
    write_json(run_dir / "training_summary.json", summary)
    return summary


def load_data(settings: FinetuneConfig, tokenizer,
              positions: int | None = None) -> tuple[JsonlReport, JsonlReport | None]:
    """Check and encode train (and valid); every problem of both files in one DataError."""
    train_path, valid_path = data_paths(settings.data, settings.valid)
    reports = inspect_pair(train_path, valid_path, tokenizer, settings.max_seq_len, settings.drop_long, positions)
    for report in reports:
        for warning in report.warnings:
            log(f"warning: {report.path.name}: {warning}")
    failed = [r for r in reports if not r.ok]
    if failed:
        raise DataError("; ".join(problems_summary(r) for r in failed), ", ".join(str(r.path) for r in failed),
                        fix_of(failed, "fix those lines (`ptbr validate-data FILE.jsonl` lists every problem)"))
    return reports[0], (reports[1] if len(reports) > 1 else None)


def identity(settings: FinetuneConfig, train: JsonlReport, backend) -> dict:
    """What a checkpoint must share with this run to be resumed by it. The training data is
    identified by its encoded examples (tokenizer, chat template and length policy included)."""
    digest = hashlib.sha256()
    for example in train.examples:
        digest.update(example.ids.tobytes())
        digest.update(example.targets.tobytes())
    # the base by its files, not its path: a base found elsewhere (Kaggle mounts inputs where its
    # layout of the day puts them, a copy on another disk) is the same base
    return {"mode": "finetune", "backend": backend.name, "base_files": fingerprint(settings.base),
            "base_weights": weights_sample(settings.base), "quant": settings.quant, "lora_r": settings.lora_r,
            "lora_alpha": settings.lora_alpha, "lora_dropout": settings.lora_dropout,
            "target_modules": settings.target_modules,
            "train_examples": len(train.examples), "train_data": digest.hexdigest()[:16],
            "seed": settings.seed, "effective_batch": effective_batch(settings, backend.world),
            **({"group_by_length": True} if settings.group_by_length else {})}  # absent: older checkpoints' order


def steps_per_epoch(examples: int, effective_batch: int) -> int:
    """ceil(ceil(examples / batch_size) / grad_accum) = ceil(examples / effective batch)."""
    return math.ceil(examples / effective_batch)


@dataclass
class Loaded:
    """What a run loads once, and a retry after an out-of-memory reuses."""

    tokenizer: object
    pad_id: int
    train: JsonlReport
    valid: JsonlReport | None
    adapted: object  # the backend's base + LoRA
    identity: dict
    resume: tuple[str, Resume]  # --resume as given, and where it led


def _load(settings: FinetuneConfig, backend, run_dir: Path) -> Loaded:
    """Tokenizer, checked data and the resume check, then the base + LoRA (last: a 7B base takes
    minutes, and everything that can fail on the settings fails before it)."""
    tokenizer = load_tokenizer(settings.base, settings.trust_remote_code, settings.download)
    config = read_config(settings.base)  # None for a hub id: the loaded model is checked below
    check_tokenizer_fits(settings.base, tokenizer, config)
    width = (config or {}).get("hidden_size")
    if isinstance(width, int) and settings.lora_r > width:
        log(f"warning: --lora-r {settings.lora_r} exceeds the base's hidden size {width}: a rank above a layer's "
            "width adds parameters, not capacity")
    train, valid = load_data(settings, tokenizer, max_positions(config))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    run_identity = identity(settings, train, backend)
    resolved = settings.resolve_steps(steps_per_epoch(len(train.examples), effective_batch(settings, backend.world)))
    resume = find_resume(run_dir, resolved, run_identity, backend.world)
    log(f"{describe_placement(backend, settings)}; base weights {settings.quant}")
    warn_if_warmup_outlasts_the_run(resolved)
    adapted = backend.load_adapted(settings)
    if config is None:  # a downloaded base: the same checks, now that its config is known
        check_tokenizer_fits(settings.base, tokenizer, adapted.config)
        load_data(settings, tokenizer, adapted.max_positions)
    return Loaded(tokenizer, pad_id, train, valid, adapted, run_identity, (settings.resume, resume))


class KeepBestAdapter(Callbacks):
    """on_eval: whenever the validation loss is the best so far, write the adapter to OUTPUT/adapters."""

    def __init__(self, backend, adapted, tokenizer, directory: Path, meta: dict):
        self.backend, self.adapted, self.tokenizer, self.directory, self.meta = (
            backend, adapted, tokenizer, directory, meta)

    def on_eval(self, state: LoopState, val_loss: float, is_best: bool) -> None:
        if is_best:
            self.save(state.step, val_loss)
            log(f"best val_loss so far: adapter of step {state.step} saved to {self.directory}")

    def save(self, step: int, val_loss: float | None) -> None:
        save_adapter(self.backend, self.adapted, self.tokenizer, self.directory,
                     self.meta | {"step": step, "val_loss": val_loss})


def _train(settings: FinetuneConfig, backend, loaded: Loaded, run_dir: Path, watchdog: Watchdog) -> FinetuneResult:
    tokenizer, pad_id, train, valid, adapted = loaded.tokenizer, loaded.pad_id, loaded.train, loaded.valid, loaded.adapted
    adapted.reset()  # a retry after an out-of-memory starts from the seeded adapter (or its checkpoint)
    if settings.auto_fit:
        settings = _auto_fit(settings, backend, adapted, train.examples, pad_id)
    world = backend.world
    source = ChatBatches(train.examples, settings.batch_size, settings.grad_accum, settings.seed, pad_id, world.rank,
                         world.size, group_by_length=settings.group_by_length)
    settings = settings.resolve_steps(source.steps_per_epoch)
    log(f"{len(train.examples)} training examples ({train.schema}), {source.steps_per_epoch} steps per epoch "
        f"(batch {settings.batch_size} x grad_accum {settings.grad_accum}"
        f"{f' x {world.size} processes' if world.size > 1 else ''}"
        f"{', grouped by length' if settings.group_by_length else ''}): {settings.max_steps} steps = "
        f"{settings.max_steps / source.steps_per_epoch:.2f} epochs, warmup {settings.warmup_steps}")
    given, resume = loaded.resume
    if settings.resume != given:  # a retry after an out-of-memory, from the checkpoint this run wrote
        resume = find_resume(run_dir, settings, loaded.identity, world)
    eval_batches, planned = None, None
    if valid is not None:
        # the validation examples the run's first checkpoint recorded, for its whole life
        # (--eval-batches K takes K global batches: a resume at another micro-batch or process
        # count would otherwise evaluate another set than its best val_loss was measured on)
        recorded = ((resume.state or {}).get("run") or {}).get("eval_examples")
        default = (len(valid.examples) if settings.eval_batches is None
                   else min(len(valid.examples), settings.eval_batches * settings.batch_size * world.size))
        planned = recorded if isinstance(recorded, int) and 0 < recorded <= len(valid.examples) else default
        # global batches (every rank's rows): the same evaluation at any number of processes
        eval_batches = fixed_batches(valid.examples[:planned], settings.batch_size * world.size, pad_id)
        log(f"validation: {planned} of {len(valid.examples)} examples ({len(eval_batches)} "
            f"batch{'es' if len(eval_batches) != 1 else ''}), "
            f"every {settings.eval_every or settings.max_steps} steps"
            + (f" (as the run started; --eval-batches gives {default} now)" if planned != default else ""))
    else:
        log("no validation set: adapters/ will hold the adapter of the last step")
    longest = max(len(e.ids) for e in train.examples) - 1  # tokens in a row of the worst micro-batch
    peak = _predicted_peak(settings, backend, adapted, longest)
    if peak is not None:
        plan_host_memory(peak, backend, settings)
    step = backend.finetune_step(adapted, settings)
    loss = backend.describe_loss(step, settings.batch_size * longest)
    if loss:
        log(loss)
    # LoRA dropout draws from the library's global generator: seed it once, here at the start of
    # the run; every checkpoint saves its state and a resumed run restores it (start_state).
    backend.seed(settings.seed)
    state = start_state(step, resume)

    write_run_config(run_dir, "finetune", settings, backend, resume, {
        "train": str(train.path), "valid": str(valid.path) if valid else None,
        "format": train.schema, "train_examples": len(train.examples),
        "valid_examples": len(valid.examples) if valid else 0,
        "steps_per_epoch": source.steps_per_epoch,
        "target_modules": adapted.target_modules,
        "trainable_parameters": adapted.trainable_parameters, "total_parameters": adapted.total_parameters,
        "predicted_peak_bytes": peak,
    })

    adapters = run_dir / "adapters"
    keeper = KeepBestAdapter(backend, adapted, tokenizer, adapters, {
        "base": local_path(settings.base), "format": train.schema, "quant": settings.quant,
        "max_seq_len": settings.max_seq_len, "target_modules": adapted.target_modules, "backend": backend.name,
    })
    started = time.monotonic()
    schedule = resume.schedule or Schedule.from_settings(settings)
    state = fit(step, source, eval_batches, settings, run_dir, state, schedule,
                {"run": {"identity": loaded.identity, "eval_examples": planned}},
                keeper, watchdog=watchdog, world=world)
    watchdog.beat("writing the adapter and the summary")
    def write_results() -> dict:
        if eval_batches is None:
            keeper.save(state.step, None)
        return finish(run_dir, state, started, {
            "epochs": round(state.step / source.steps_per_epoch, 3),
            "train_examples": len(train.examples),
            "valid_examples": len(valid.examples) if valid else 0,
            "trainable_parameters": adapted.trainable_parameters,
            "total_parameters": adapted.total_parameters,
            "target_modules": adapted.target_modules,
            "quant": settings.quant,
            "adapters": str(adapters),
            "adapter_step": state.best_step if eval_batches else state.step,
            "merged": None,  # set by run_finetune after --merge
            "backend": backend.name,
        }, f"adapter in {adapters}")

    summary = world.decide(write_results)
    return FinetuneResult(summary, adapted, tokenizer, source, eval_batches, settings)


def _predicted_peak(settings: FinetuneConfig, backend, adapted, longest: int) -> int | None:
    """The memory model's peak at the run's worst micro-batch (batch_size rows of the longest
    example's `longest` tokens), or None for an architecture it does not know."""
    try:
        arch = Architecture.from_hf_config(adapted.config)
    except (KeyError, TypeError, ValueError):
        return None
    return predicted_peak_bytes(settings, arch, backend, settings.batch_size,
                                padded_length(backend.name, longest, settings.max_seq_len))


def _auto_fit(settings: FinetuneConfig, backend, adapted, examples: list, pad_id: int) -> FinetuneConfig:
    """--auto-fit: the dry run pads its micro-batch to the longest examples, as the worst
    micro-batch of the run will be. The base is loaded once; each try starts the adapter from its
    seeded initialisation with a fresh optimizer, and the run starts from there too."""
    longest_first = sorted(examples, key=lambda e: len(e.ids), reverse=True)

    def make_step(batch_size: int):
        adapted.reset()
        return backend.finetune_step(adapted, settings)

    def longest_batch(batch_size: int) -> dict:
        return collate(longest_first[:batch_size], pad_id)

    too_big = None
    if backend.device == "cpu":
        target = "mlx" if backend.name == "mlx" else "cpu"  # the memory model of the backend that runs
        length = padded_length(target, len(longest_first[0].ids) - 1, settings.max_seq_len)
        too_big = _lora_ram_guard(adapted, settings, length, backend.precision, target)
    try:
        choice = auto_fit(backend, make_step, longest_batch, settings.batch_size, settings.grad_accum, too_big)
    finally:
        adapted.reset()
    return dataclasses.replace(settings, batch_size=choice.batch_size, grad_accum=choice.grad_accum)


def _lora_ram_guard(adapted, settings: FinetuneConfig, seq_len: int, precision: str, target: str = "cpu"):
    """On CPU, where the base is already loaded: only what a step adds must fit in the free RAM."""
    from ptbr.memory import Architecture, estimate_run

    try:
        arch = Architecture.from_hf_config(adapted.config)
    except (KeyError, TypeError, ValueError):
        log("auto-fit: the memory model does not know this architecture; every size is tried for real")
        return None

    def step_bytes(batch_size: int) -> int:
        predicted = estimate_run(settings, arch, target, batch_size, seq_len, precision,
                                 settings.gradient_checkpointing,
                                 grad_accum=settings.batch_size * settings.grad_accum // batch_size)
        return predicted.total - predicted.weights - predicted.overhead  # those are in RAM already

    return ram_guard(step_bytes)
