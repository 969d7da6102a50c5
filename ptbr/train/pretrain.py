"""`ptbr train`: resolve settings -> build data, model, optimizer -> fit() -> final/."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ptbr.config import PretrainConfig, get_preset
from ptbr.data import SAMPLE_DIR
from ptbr.data.tokens import PretrainBatches, eval_windows, open_dataset
from ptbr.errors import DataError
from ptbr.log import log
from ptbr.train.atomic import write_directory
from ptbr.train.loop import LoopState, fit
from ptbr.train.metrics import loss_summary
from ptbr.train.run_dir import open_run, resume_point, write_json
from ptbr.train.watchdog import Watchdog
from ptbr.versions import package_versions


def run_pretrain(settings: PretrainConfig) -> dict:
    """Pretrain a preset from scratch; returns training_summary.json's contents."""
    with open_run(settings.output) as run_dir, \
            Watchdog(run_dir, settings.hang_timeout, settings.hang_action) as watchdog:
        if settings.auto_fit:  # an out-of-memory mid-run: smaller micro-batch, from the last checkpoint
            from ptbr.train.autofit import resume_smaller_on_oom

            return resume_smaller_on_oom(lambda s: _run(s, run_dir, watchdog), settings, run_dir)
        return _run(settings, run_dir, watchdog)


def build_backend(settings: PretrainConfig, dataset, preset, placement):
    """The model and its optimizer as a training-step backend (--auto-fit's dry runs build it too)."""
    from ptbr.model import build_model
    from ptbr.train.step import TorchStep, build_optimizer

    pad_id = dataset.meta.get("pad_id") if dataset.meta else None
    model = build_model(preset, dataset.vocab_size, dataset.eos_id, settings.seed, pad_id).to(placement.device)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return TorchStep(model, build_optimizer(model, settings, placement.device), placement, settings.max_grad_norm)


def _run(settings: PretrainConfig, run_dir: Path, watchdog: Watchdog) -> dict:
    import torch

    from ptbr.data.tokenizer import save_for_transformers
    from ptbr.model import count_parameters
    from ptbr.train.device import resolve_device, resolve_precision

    data_dir = settings.data or SAMPLE_DIR
    if settings.data is None:
        log(f"no --data given: training on the bundled PT-BR sample ({SAMPLE_DIR})")
    dataset = open_dataset(data_dir, settings.tokenizer)
    for warning in dataset.warnings:
        log(f"warning: {warning}")
    preset = get_preset(settings.model_size)
    if len(dataset.train) < settings.seq_len + 1:
        raise DataError(f"train.bin holds {len(dataset.train)} tokens, fewer than seq_len + 1 = {settings.seq_len + 1}",
                          str(dataset.train_path), "lower --seq-len or add data")
    placement = resolve_precision(resolve_device(settings.device), settings.precision)
    log(f"device {placement.device}, precision {placement.precision} ({placement.reason})")
    watchdog.device = placement.device

    if settings.auto_fit:
        from ptbr.train.autofit import auto_fit_pretrain

        settings = auto_fit_pretrain(settings, dataset, preset, placement, build_backend)
    backend = build_backend(settings, dataset, preset, placement)
    model = backend.model
    n_params = count_parameters(model)
    log(f"model {preset.name}: {n_params:,} parameters, vocab {dataset.vocab_size}, seq_len {settings.seq_len}")

    checkpoint, saved = resume_point(run_dir, settings.resume)
    state = LoopState.start(backend, checkpoint, saved)

    write_json(run_dir / "run_config.json", {
        "command": "train",
        "settings": dataclasses.asdict(settings),
        "data": str(data_dir),
        "tokenizer": str(dataset.tokenizer_path),
        "model": dataclasses.asdict(preset) | {"vocab_size": dataset.vocab_size, "parameters": n_params},
        "device": str(placement.device),
        "precision": placement.precision,
        "tokens_per_step": settings.batch_size * settings.grad_accum * settings.seq_len,
        "versions": package_versions(),
        "resumed_from": str(checkpoint) if checkpoint else None,
    })

    source = PretrainBatches(dataset, settings.batch_size, settings.grad_accum, settings.seq_len, settings.seed)
    eval_batches = None
    if dataset.val is not None:
        from ptbr.train.step import windows_to_batch

        windows = eval_windows(dataset.val, dataset.val_path, settings.batch_size, settings.seq_len,
                               dataset.vocab_size, settings.eval_batches)
        eval_batches = [windows_to_batch(w) for w in windows] or None
    if eval_batches is None:
        log("warning: no usable val.bin: training without evaluation")

    started = time.monotonic()
    state = fit(backend, source, eval_batches, settings, run_dir, state, watchdog=watchdog)
    watchdog.beat("writing final/")

    def fill(directory: Path) -> None:
        model.save_pretrained(str(directory), safe_serialization=True)
        save_for_transformers(dataset.tokenizer_path, directory)

    final = write_directory(run_dir / "final", fill, "the final model")
    summary = {
        "steps": state.step,
        "tokens_seen": state.tokens_seen,
        **loss_summary(run_dir),
        "best_val_loss": state.best_val_loss,
        "best_step": state.best_step,
        "skipped_steps": state.skipped_steps,
        "elapsed_s": round(state.elapsed_s, 3),
        "this_session_s": round(time.monotonic() - started, 3),
        "parameters": n_params,
        "final_model": str(final),
        "torch": torch.__version__,
    }
    write_json(run_dir / "training_summary.json", summary)
    log(f"done: {state.step} steps, final loss {summary['final_loss']}, model in {final}")
    return summary
