"""`ptbr finetune`: resolve settings -> check and encode the data -> base + LoRA -> fit() ->
OUTPUT/adapters (best by val_loss), training_summary.json, and OUTPUT/merged with --merge."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ptbr.config import FinetuneConfig
from ptbr.errors import ConfigError, DataError
from ptbr.finetune.adapter import KeepBestAdapter
from ptbr.finetune.batches import ChatBatches, fixed_batches
from ptbr.finetune.data import JsonlReport, inspect_jsonl, problems_summary
from ptbr.log import log
from ptbr.train.loop import LoopState, fit
from ptbr.train.metrics import loss_summary
from ptbr.train.run_dir import open_run, resume_point, write_json
from ptbr.train.watchdog import Watchdog
from ptbr.versions import package_versions

# Settings a resumed run must share with the run it continues, or its data position and adapter
# shapes would mean something else. (max_steps, epochs, eval/save cadence may change, and so may
# the split of the effective batch into batch_size x grad_accum: a step covers the same examples.)
RESUME_MUST_MATCH = ("base", "quant", "lora_r", "lora_alpha", "target_modules", "max_seq_len", "drop_long",
                     "effective_batch", "seed")


@dataclass
class FinetuneResult:
    summary: dict  # training_summary.json
    model: object  # the PeftModel as it stands after the last step
    tokenizer: object
    source: ChatBatches  # the training batches (cycle(step) gives any step's micro-batches)
    eval_batches: list[dict] | None
    settings: FinetuneConfig  # with max_steps and warmup_steps resolved


def run_finetune(settings: FinetuneConfig) -> FinetuneResult:
    with open_run(settings.output) as run_dir:
        with Watchdog(run_dir, settings.hang_timeout, settings.hang_action) as watchdog:
            loaded = _load(settings, run_dir, watchdog)
            if settings.auto_fit:  # an out-of-memory mid-run: smaller micro-batch, from the last checkpoint
                from ptbr.train.autofit import resume_smaller_on_oom

                result = resume_smaller_on_oom(lambda s: _train(s, loaded, run_dir, watchdog), settings, run_dir)
            else:
                result = _train(settings, loaded, run_dir, watchdog)
        if settings.merge:
            # outside the watchdog: loading and merging a 7B base on the CPU takes minutes
            # without a step to report
            from ptbr.finetune.merge import merge_adapter

            merged = merge_adapter(settings.base, run_dir / "adapters", run_dir / "merged",
                                   trust_remote_code=settings.trust_remote_code)
            result.summary["merged"] = str(merged)
            write_json(run_dir / "training_summary.json", result.summary)
        return result


def data_paths(data: str, valid: str | None) -> tuple[Path, Path | None]:
    """train.jsonl and the optional validation file from --data FILE|DIR and --valid."""
    path = Path(data)
    if path.is_dir():
        train = path / "train.jsonl"
        if not train.is_file():
            raise DataError("no train.jsonl in the data directory", data,
                            "put train.jsonl (and valid.jsonl) there, or give --data FILE.jsonl")
        valid_path = Path(valid) if valid else (path / "valid.jsonl" if (path / "valid.jsonl").is_file() else None)
    elif path.is_file():
        train, valid_path = path, Path(valid) if valid else None
    else:
        raise DataError("training data not found", data, "give train.jsonl, or a directory with train.jsonl and valid.jsonl")
    if valid_path is not None and not valid_path.is_file():
        raise DataError("validation file not found", str(valid_path), "give an existing --valid FILE.jsonl")
    return train, valid_path


def load_data(settings: FinetuneConfig, tokenizer) -> tuple[JsonlReport, JsonlReport | None]:
    """Check and encode train (and valid); every problem of both files in one DataError."""
    train_path, valid_path = data_paths(settings.data, settings.valid)
    reports = [inspect_jsonl(p, tokenizer, settings.max_seq_len, settings.drop_long)
               for p in (train_path, valid_path) if p is not None]
    train, valid = reports[0], (reports[1] if len(reports) > 1 else None)
    if valid is not None and train.schema and valid.schema and valid.schema != train.schema:
        valid.problems.append(f"it holds {valid.schema!r} examples but the training file holds {train.schema!r}")
    for report in reports:
        if report.ok and not report.examples:
            report.problems.append("no example is left after the length policy (see the warnings above)")
        for warning in report.warnings:
            log(f"warning: {report.path.name}: {warning}")
    failed = [r for r in reports if not r.ok]
    if failed:
        raise DataError("; ".join(problems_summary(r) for r in failed), str(settings.data),
                        "fix those lines (`ptbr validate-data FILE.jsonl` lists every problem)")
    return train, valid


def _check_resume(run_dir: Path, checkpoint: Path, settings: FinetuneConfig, train_examples: int) -> None:
    if not (checkpoint / "adapter_model.safetensors").is_file():
        raise ConfigError(f"{checkpoint} holds no LoRA adapter: it is not a fine-tuning checkpoint", "--resume",
                          "use a new --output for this run, or --resume never")
    try:
        previous = json.loads((run_dir / "run_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if previous.get("command") != "finetune":
        return
    before = previous.get("settings", {}) | {"train_examples": previous.get("train_examples")}
    now = dataclasses.asdict(settings) | {"train_examples": train_examples}
    for values in (before, now):
        values["effective_batch"] = values.get("batch_size", 0) * values.get("grad_accum", 0)
        # the same local base, whatever the working directory
        if values.get("base") and Path(values["base"]).expanduser().exists():
            values["base"] = str(Path(values["base"]).expanduser().resolve())
    changed = [f"{key} {before[key]!r} -> {now[key]!r}" for key in RESUME_MUST_MATCH + ("train_examples",)
               if key in before and before[key] != now[key]]
    if changed:
        raise ConfigError(f"cannot resume with different settings: {', '.join(changed)}", str(checkpoint),
                          "run with the settings of the first run, or start anew with --resume never or a new --output")


@dataclass
class Loaded:
    """What a run loads once, and a retry after an out-of-memory reuses."""

    placement: object
    tokenizer: object
    pad_id: int
    train: JsonlReport
    valid: JsonlReport | None
    adapted: object  # ptbr.finetune.model.AdaptedModel
    resume: tuple[str, Path | None, dict | None]  # --resume as given, and its checkpoint and state


def _load(settings: FinetuneConfig, run_dir: Path, watchdog: Watchdog) -> Loaded:
    """Device, tokenizer, checked data, then the base + LoRA (last: a 7B base takes minutes, and
    everything that can fail on the settings fails before it)."""
    from ptbr.finetune.model import load_model, load_tokenizer
    from ptbr.train.device import resolve_device, resolve_precision

    placement = resolve_precision(resolve_device(settings.device), settings.precision)
    log(f"device {placement.device}, precision {placement.precision} ({placement.reason}), base weights {settings.quant}")
    watchdog.device = placement.device
    tokenizer = load_tokenizer(settings.base, settings.trust_remote_code)
    train, valid = load_data(settings, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    checkpoint, saved = resume_point(run_dir, settings.resume)
    if checkpoint is not None:
        _check_resume(run_dir, checkpoint, settings, len(train.examples))
    adapted = load_model(settings, placement)
    positions = getattr(adapted.model.config, "max_position_embeddings", None)
    longest = max(len(e.ids) for e in train.examples + (valid.examples if valid else []))
    if positions and longest > positions:
        raise ConfigError(f"examples of up to {longest} tokens exceed the base model's {positions} positions",
                          "--max-seq-len", f"use --max-seq-len {positions} or less")
    return Loaded(placement, tokenizer, pad_id, train, valid, adapted, (settings.resume, checkpoint, saved))


def _train(settings: FinetuneConfig, loaded: Loaded, run_dir: Path, watchdog: Watchdog) -> FinetuneResult:
    import torch

    from ptbr.train.step import TorchStep, build_optimizer

    placement, tokenizer, pad_id, train, valid, adapted = (
        loaded.placement, loaded.tokenizer, loaded.pad_id, loaded.train, loaded.valid, loaded.adapted)
    adapted.reset()  # a retry after an out-of-memory starts from the seeded adapter (or its checkpoint)
    if settings.auto_fit:
        from ptbr.train.autofit import auto_fit_finetune

        settings = auto_fit_finetune(settings, adapted, train.examples, pad_id, placement)
    source = ChatBatches(train.examples, settings.batch_size, settings.grad_accum, settings.seed, pad_id)
    settings = settings.resolve_steps(source.steps_per_epoch)
    log(f"{len(train.examples)} training examples ({train.schema}), {source.steps_per_epoch} steps per epoch "
        f"(batch {settings.batch_size} x grad_accum {settings.grad_accum}): {settings.max_steps} steps = "
        f"{settings.max_steps / source.steps_per_epoch:.2f} epochs, warmup {settings.warmup_steps}")
    eval_batches = None
    if valid is not None:
        eval_batches = fixed_batches(valid.examples, settings.batch_size, pad_id, settings.eval_batches)
        used = sum(len(b["input_ids"]) for b in eval_batches)
        log(f"validation: {used} of {len(valid.examples)} examples ({len(eval_batches)} batches), "
            f"every {settings.eval_every or settings.max_steps} steps")
    else:
        log("no validation set: adapters/ will hold the adapter of the last step")

    if settings.resume == loaded.resume[0]:
        checkpoint, saved = loaded.resume[1:]  # found and checked by _load
    else:  # a retry after an out-of-memory, from the checkpoint this run wrote
        checkpoint, saved = resume_point(run_dir, settings.resume)
        if checkpoint is not None:
            _check_resume(run_dir, checkpoint, settings, len(train.examples))
    model = adapted.model
    backend = TorchStep(model, build_optimizer(model, settings, placement.device), placement, settings.max_grad_norm)
    # LoRA dropout draws from torch's global generator: seed it once, here at the start of the run;
    # every checkpoint saves its state and a resumed run restores it (load_state).
    torch.manual_seed(settings.seed)
    state = LoopState.start(backend, checkpoint, saved)

    write_json(run_dir / "run_config.json", {
        "command": "finetune",
        "settings": dataclasses.asdict(settings),
        "train": str(train.path), "valid": str(valid.path) if valid else None,
        "format": train.schema, "train_examples": len(train.examples),
        "valid_examples": len(valid.examples) if valid else 0,
        "steps_per_epoch": source.steps_per_epoch,
        "target_modules": adapted.target_modules,
        "trainable_parameters": adapted.trainable_parameters, "total_parameters": adapted.total_parameters,
        "device": str(placement.device), "precision": placement.precision,
        "versions": package_versions(),
        "resumed_from": str(checkpoint) if checkpoint else None,
    })

    adapters = run_dir / "adapters"
    keeper = KeepBestAdapter(adapters, model, tokenizer, {
        "base": settings.base, "format": train.schema, "quant": settings.quant,
        "max_seq_len": settings.max_seq_len, "target_modules": adapted.target_modules,
    })
    started = time.monotonic()
    state = fit(backend, source, eval_batches, settings, run_dir, state, keeper, watchdog=watchdog)
    watchdog.beat("writing the adapter and the summary")
    if eval_batches is None:
        keeper.save(state.step, None)

    summary = {
        "steps": state.step,
        "epochs": round(state.step / source.steps_per_epoch, 3),
        "tokens_seen": state.tokens_seen,
        **loss_summary(run_dir),
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "skipped_steps": state.skipped_steps,
        "elapsed_s": round(state.elapsed_s, 3),
        "this_session_s": round(time.monotonic() - started, 3),
        "train_examples": len(train.examples),
        "valid_examples": len(valid.examples) if valid else 0,
        "trainable_parameters": adapted.trainable_parameters,
        "total_parameters": adapted.total_parameters,
        "target_modules": adapted.target_modules,
        "quant": settings.quant,
        "adapters": str(adapters),
        "adapter_step": state.best_step if eval_batches else state.step,
        "merged": None,  # set by run_finetune after --merge
        "torch": torch.__version__,
    }
    write_json(run_dir / "training_summary.json", summary)
    log(f"done: {state.step} steps, final loss {summary['final_loss']}, best val_loss {state.best_val_loss} "
        f"(step {state.best_step}); adapter in {adapters}")
    return FinetuneResult(summary, model, tokenizer, source, eval_batches, settings)
