"""`ptbr train`: settings -> data -> resume check -> model and optimizer (from the backend) ->
fit() -> final/ and training_summary.json."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ptbr.backends import create_backend
from ptbr.config import PretrainConfig, get_preset
from ptbr.data import SAMPLE_DIR
from ptbr.data.batch import windows_to_batch
from ptbr.data.tokenizer import save_for_transformers
from ptbr.data.tokens import (
    PretrainBatches,
    RandomWindows,
    TokenDataset,
    eval_windows,
    open_dataset,
    val_too_short,
)
from ptbr.files import file_sha256, write_directory
from ptbr.log import log
from ptbr.memory import Architecture
from ptbr.runs.common import (
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
from ptbr.train.loop import fit
from ptbr.train.schedule import Schedule
from ptbr.train.watchdog import Watchdog


def run_pretrain(settings: PretrainConfig, report: bool = True) -> dict:
    """Pretrain a preset from scratch (or resume); returns training_summary.json's contents. `report`:
    write report.md and plots/ at the end (`ptbr smoke`, a check whose run is not kept, does not)."""
    # on a CPU that computes bf16 natively, --precision auto pretrains in bf16 autocast
    backend = create_backend(settings.backend, settings.device, settings.precision, pretraining=True)
    refuse_auto_fit_in_parallel(settings, backend.world)
    if settings.compile:  # a torch option: MLX refused it before the backend was made
        backend.check_compile()
    with closing_world(backend.world), open_run(settings, backend.world) as run_dir, \
            Watchdog(run_dir, settings.hang_timeout, settings.hang_action, backend.memory_report,
                     backend.world.rank, backend.world.size) as watchdog:
        if settings.auto_fit:  # an out-of-memory mid-run: smaller micro-batch, from the last checkpoint
            summary = resume_smaller_on_oom(backend, lambda s: _run(s, backend, run_dir, watchdog, report), settings,
                                            run_dir)
        else:
            with out_of_memory_is_an_error(backend):
                summary = _run(settings, backend, run_dir, watchdog, report)
    return summary


def identity(settings: PretrainConfig, dataset: TokenDataset, backend) -> dict:
    """What a checkpoint must share with this run to be resumed by it."""
    return {"mode": "pretrain", "backend": backend.name, "model_size": settings.model_size,
            "vocab_size": dataset.vocab_size, "tokenizer_sha256": file_sha256(dataset.tokenizer_path)[:16],
            "train_data": dataset.fingerprint(), "seq_len": settings.seq_len, "seed": settings.seed,
            "effective_batch": effective_batch(settings, backend.world)}


def _run(settings: PretrainConfig, backend, run_dir: Path, watchdog: Watchdog, report: bool) -> dict:
    data_dir = settings.data or SAMPLE_DIR
    if settings.data is None:
        log(f"no --data given: training on the bundled PT-BR sample ({SAMPLE_DIR})")
    dataset = open_dataset(data_dir, settings.tokenizer)
    for warning in dataset.warnings:
        log(f"warning: {warning}")
    preset = get_preset(settings.model_size)
    world = backend.world
    source = PretrainBatches(dataset, settings.batch_size, settings.grad_accum, settings.seq_len, settings.seed,
                             world.rank, world.size)
    run_identity = identity(settings, dataset, backend)
    resume = find_resume(run_dir, settings, run_identity, world)
    log(describe_placement(backend, settings))
    warn_if_warmup_outlasts_the_run(settings)
    if settings.fsdp and world.size == 1:
        log("warning: --fsdp shards the model over the processes of a data-parallel run; in one process it "
            "changes nothing (--num-processes N starts N)")

    if settings.auto_fit:
        settings = _auto_fit(settings, backend, dataset, preset)
        source = PretrainBatches(dataset, settings.batch_size, settings.grad_accum, settings.seq_len, settings.seed)
    pad_id = dataset.meta.get("pad_id") if dataset.meta else None
    peak = predicted_peak_bytes(settings, Architecture.from_preset(preset, dataset.vocab_size), backend,
                                settings.batch_size, settings.seq_len)
    plan_host_memory(peak, backend, settings)
    step = backend.pretrain_step(preset, dataset.vocab_size, dataset.eos_id, pad_id, settings)
    n_params = backend.parameter_count(step)
    log(f"model {preset.name}: {n_params:,} parameters, vocab {dataset.vocab_size}, seq_len {settings.seq_len}")
    loss = backend.describe_loss(step, settings.batch_size * settings.seq_len)
    if loss:
        log(loss)
    if settings.compile:
        described = backend.describe_compile(step, settings.grad_accum, settings.batch_size * settings.seq_len)
        if described:
            log(described)
    state = start_state(step, resume)

    write_run_config(run_dir, "train", settings, backend, resume, {
        "data": str(data_dir), "tokenizer": str(dataset.tokenizer_path),
        "model": dataclasses.asdict(preset) | {"vocab_size": dataset.vocab_size, "parameters": n_params},
        "tokens_per_step": effective_batch(settings, world) * settings.seq_len,
        "predicted_peak_bytes": peak,
    })

    eval_batches = None
    # the validation windows the run started with, for its whole life: a resume at another micro-batch
    # (the same effective batch), or --auto-fit's smaller one, would otherwise evaluate another set
    # than the one its best val_loss was measured on
    default = settings.eval_batches * settings.batch_size * world.size
    recorded = ((resume.state or {}).get("run") or {}).get("eval_windows")
    planned = recorded if isinstance(recorded, int) and recorded > 0 else default
    if dataset.val is not None:
        # global batches (every rank's rows): the same evaluation at any number of processes
        windows = eval_windows(dataset.val, dataset.val_path, settings.batch_size * world.size, settings.seq_len,
                               dataset.vocab_size, settings.eval_batches, planned)
        eval_batches = [windows_to_batch(w) for w in windows] or None
        if eval_batches:
            count = sum(len(w) for w in windows)
            log(f"evaluation: {count} window{'s' if count != 1 else ''} of val.bin ({count * settings.seq_len:,} target tokens of its "
                f"{len(dataset.val):,}), the same every time"
                + (f" (as the run started; --eval-batches x the global micro-batch is {default} now)"
                   if planned != default else ""))
    if eval_batches is None:
        why = (dataset.val is not None and val_too_short(len(dataset.val), settings.seq_len)) or "there is no val.bin"
        log(f"warning: no validation: {why} ({dataset.val_path}); training without evaluation "
            "(`ptbr prepare --val-fraction` sets its share of the tokens)")

    started = time.monotonic()
    schedule = resume.schedule or Schedule.from_settings(settings)
    state = fit(step, source, eval_batches, settings, run_dir, state, schedule,
                {"run": {"identity": run_identity, "eval_windows": planned}},
                watchdog=watchdog, world=world)
    watchdog.beat("writing final/")
    backend.gather_model(step)  # every rank (FSDP: a run resumed at --max-steps has trained no step here)

    def fill(directory: Path) -> None:
        backend.write_model(step, directory)
        save_for_transformers(dataset.tokenizer_path, directory)

    def write_results() -> dict:
        final = write_directory(run_dir / "final", fill, "the final model")
        return finish(run_dir, state, started, {"parameters": n_params, "final_model": str(final),
                                                 "backend": backend.name}, f"model in {final}", report)

    return world.decide(write_results)


def _auto_fit(settings: PretrainConfig, backend, dataset: TokenDataset, preset) -> PretrainConfig:
    """--auto-fit: every window is seq_len long, so any batch is the longest. Each try builds a
    throwaway model; returns the settings with the batch_size and grad_accum that fit."""

    def make_step(batch_size: int):
        # probes run eager: one compile per probed size would cost tens of seconds each, and the
        # compiled step keeps no more activations than the eager one (where it takes the whole
        # 16-bit logits on a GPU, ptbr.memory.compiled_whole_logits, it can hold more than the
        # eager chunked step of a small model: a first step that then runs out of memory is
        # halved again by resume_smaller_on_oom)
        pad_id = dataset.meta.get("pad_id") if dataset.meta else None
        probe = dataclasses.replace(settings, batch_size=batch_size, compile=False)
        return backend.pretrain_step(preset, dataset.vocab_size, dataset.eos_id, pad_id, probe)

    def longest_batch(batch_size: int) -> dict:
        windows = RandomWindows(dataset.train, dataset.train_path, batch_size, settings.seq_len, dataset.vocab_size,
                                settings.seed)
        return windows_to_batch(windows.batch(0))

    too_big = None
    if backend.device == "cpu":
        from ptbr.memory import Architecture, estimate_run

        arch = Architecture.from_preset(preset, dataset.vocab_size)
        target = "mlx" if backend.name == "mlx" else "cpu"

        def step_bytes(batch_size: int) -> int:
            predicted = estimate_run(settings, arch, target, batch_size, settings.seq_len, backend.precision,
                                     settings.gradient_checkpointing,
                                     grad_accum=settings.batch_size * settings.grad_accum // batch_size)
            return predicted.total - predicted.overhead  # the interpreter is in RAM already

        too_big = ram_guard(step_bytes)
    choice = auto_fit(backend, make_step, longest_batch, settings.batch_size, settings.grad_accum, too_big)
    return dataclasses.replace(settings, batch_size=choice.batch_size, grad_accum=choice.grad_accum)
