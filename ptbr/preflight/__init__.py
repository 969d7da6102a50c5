"""Preflight: check everything a run needs before it starts, predict its memory, and write a config
that fits this machine (DIR/preflight_report.json, DIR/recommended_config.json).

    hardware facts (probed, or injected by tests) -> checks -> recommendation -> report files
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

from ptbr.config import DEFAULT_VOCAB_SIZE, LoopSettings, get_preset
from ptbr.files import write_text
from ptbr.finetune.base import max_positions as base_positions
from ptbr.memory import GIB, Architecture, quant_name
from ptbr.preflight.checks import (
    FAIL,
    PASS,
    WARN,
    Check,
    check_compile_request,
    check_finetune_data,
    check_hardware,
    check_kaggle,
    check_mlx_backend,
    check_output,
    check_output_of_its_own,
    check_packages,
    check_preset,
    check_pretrain_data,
    checkpoint_plan,
    load_base_tokenizer,
    load_test,
    mixture_of_experts,
    read_base_config,
)
from ptbr.preflight.hardware import GPU, Hardware, probe_hardware
from ptbr.preflight.recommend import Recommendation, choose_target, mode_of, recommend, seq_key

__all__ = ["GPU", "Check", "Hardware", "PreflightResult", "Recommendation", "probe_hardware", "recommend",
           "run_preflight"]

REPORT_FILE = "preflight_report.json"
CONFIG_FILE = "recommended_config.json"


@dataclass
class PreflightResult:
    mode: str
    checks: list[Check]
    hardware: Hardware
    recommendation: Recommendation | None
    report_path: Path | None = None
    config_path: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def summary(self) -> dict[str, int]:
        return {s: sum(1 for c in self.checks if c.status == s) for s in (PASS, WARN, FAIL)}


def run_preflight(settings: LoopSettings, hardware: Hardware | None = None, load_weights: bool = False,
                  versions: dict | None = None, write: bool = True, given: set[str] | None = None,
                  elsewhere: bool = False) -> PreflightResult:
    """Every check for a run with these settings (PretrainConfig: `ptbr train`, FinetuneConfig:
    `ptbr finetune`); writes the two files into settings.output when `write`.
    `given`: the settings the user set, kept in recommended_config.json (None: all of them).
    `elsewhere`: the run is planned for `hardware`, another machine than this one (--for kaggle):
    what only this machine could tell (its packages, its compiler, a session's output folder) is
    left out."""
    mode = mode_of(settings)
    hardware = hardware or probe_hardware()
    target = choose_target(hardware, mode, settings.device, settings.backend)
    checks = check_hardware(hardware, settings.device, here=not elsewhere)
    arch, max_positions, examples, longest, sizes = None, None, None, None, {}

    if mode == "pretrain":
        data_checks, dataset = check_pretrain_data(settings)
        vocab = dataset.vocab_size if dataset is not None else None
        checks += data_checks + check_preset(settings, vocab)
        preset = get_preset(settings.model_size)
        arch = Architecture.from_preset(preset, vocab or DEFAULT_VOCAB_SIZE)
        max_positions = preset.max_position_embeddings
        quant = None
    else:
        quant = quant_name(settings.quant, target)
        model_checks, base_config = read_base_config(settings, elsewhere)
        tokenizer_checks, tokenizer = load_base_tokenizer(settings, base_config, elsewhere) if base_config else ([], None)
        max_positions = base_positions(base_config)
        data_checks, summary = check_finetune_data(settings, tokenizer, max_positions)
        checks += model_checks + tokenizer_checks + data_checks
        examples, longest = summary.get("examples") or None, summary.get("longest") or None
        moe = mixture_of_experts(base_config) if base_config else None
        if moe:
            checks.append(moe)
            if load_weights and tokenizer is not None:
                checks.append(load_test(settings))
        elif base_config:
            try:
                arch = Architecture.from_hf_config(base_config)
            except (KeyError, TypeError, ValueError) as exc:
                checks.append(Check("model.architecture", FAIL, str(exc), "the memory model cannot read this "
                                    f"config.json ({type(exc).__name__}: {exc})", "use a Llama/Mistral/Qwen-style "
                                    "decoder"))
            if load_weights and tokenizer is not None:
                checks.append(load_test(settings))

    if not elsewhere:
        checks += check_packages(mode, target, quant, versions)
    if target == "mlx":
        checks += check_mlx_backend(hardware.apple_silicon)

    recommendation = None
    # --device cuda without a GPU, or mps off Apple Silicon (hardware.accelerator fails): no such
    # memory to plan into, and a plan into the RAM would read as one for that device
    absent = (target == "cuda" and not hardware.gpus) or (target == "mps" and not hardware.apple_silicon)
    needed, one = None, None  # the model could not be read: the checkpoints' size is unknown
    if arch is not None:
        planned = settings  # without the device, the checkpoints are still the requested run's
        if not absent:
            processes_given = (given is None or "num_processes" in given) and settings.num_processes != "auto"
            recommendation = recommend(hardware, settings, arch, max_positions=max_positions, examples=examples,
                                       longest=longest, processes_given=processes_given)
            checks += _memory_checks(recommendation, settings,
                                     limited=hardware.ram_limit is not None and recommendation.target in ("cpu", "mlx"))
            planned = recommendation.settings
        trainable = arch.parameters if mode == "pretrain" else arch.lora_parameters(settings.lora_r)
        needed, one = checkpoint_plan(planned, arch.parameters, trainable, examples)
        sizes = {"parameters": arch.parameters, "trainable": trainable}
    # train takes the flags as given (its batch, accumulation, checkpointing), with `auto`'s precision
    # as the plan resolved it
    compiled_run = (dataclasses.replace(settings, precision=recommendation.settings.precision)
                    if recommendation is not None else settings)
    checks += check_compile_request(settings, target, hardware, arch, compiled_run, probe=not elsewhere)
    checks += check_output_of_its_own(settings) + check_output(settings.output, needed, one, hardware.in_kaggle,
                                                               here=not elsewhere)
    if not elsewhere:  # (a kernel's own run: its output folder, its GPUs as Kaggle gave them)
        checks += check_kaggle(hardware, settings.output)

    result = PreflightResult(mode, checks, hardware, recommendation, extra=sizes)
    # nothing goes into an --output the run would refuse (a dataset's, a model's, its data's folder)
    if write and not any(c.name == "disk.output" for c in result.failed):
        _write(result, settings, given, planned_for="kaggle" if elsewhere else None)
    return result


def _memory_checks(rec: Recommendation, settings: LoopSettings, limited: bool = False) -> list[Check]:
    """`limited`: the memory planned into is a container's memory limit (RAM, not a GPU's)."""
    key = seq_key(mode_of(settings))
    asked = rec.requested_estimate
    checks = []
    if settings.precision not in ("auto", rec.settings.precision):  # the plan replaced it: the run refuses it
        why = next((r for r in rec.reasons if r.startswith(f"precision {rec.settings.precision} instead of")), "")
        checks.append(Check("settings.precision", FAIL, settings.precision,
                            f"--precision {settings.precision} cannot run here ({why.split(': ', 1)[-1]}): the run "
                            "would stop with exit 5", f"use --precision {rec.settings.precision} or auto"))
    value = {"target": rec.target, "budget": rec.budget, "predicted_peak": asked.total, "phase": asked.peak_phase}
    requested = (f"batch_size {settings.batch_size} x {rec.planned_seq} tokens"
                 f"{', gradient checkpointing' if settings.gradient_checkpointing else ''}")
    if rec.requested_fits:
        checks.append(Check("memory.requested", PASS, value, f"{requested}: predicted peak {asked.total / GIB:.2f} GiB "
                            f"of {rec.budget / GIB:.2f} GiB usable on {rec.target}"))
    else:
        checks.append(Check("memory.requested", WARN if rec.fits else FAIL, value,
                            f"{requested}: predicted peak {asked.total / GIB:.2f} GiB, more than the "
                            f"{rec.budget / GIB:.2f} GiB usable on {rec.target}",
                            "train with the recommended config (same effective batch)" if rec.fits else
                            "nothing smaller fits either: see memory.recommended"))
    chosen = rec.estimate
    s = rec.settings
    value = {"settings": {k: getattr(s, k) for k in ("batch_size", "grad_accum", key, "precision",
                                                     "gradient_checkpointing")},
             "predicted_peak": chosen.total, "phase": chosen.peak_phase, "estimate": chosen.as_dict()}
    if rec.fits:
        checks.append(Check("memory.recommended", PASS, value,
                            f"recommended batch_size {s.batch_size} x grad_accum {s.grad_accum}, {key} {getattr(s, key)}, "
                            f"{s.precision}, gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}: "
                            f"predicted peak {chosen.total / GIB:.2f} GiB"))
    else:
        more = ("a higher container memory limit (e.g. docker run --memory 16g)" if limited else
                "a machine with more memory")
        fix = (f"use a smaller preset, or {more}" if key == "seq_len" else
               f"use --quant 4bit, fewer --target-modules (e.g. q_proj,v_proj), a smaller base, or {more}")
        checks.append(Check("memory.recommended", FAIL, value, rec.why_not, fix))
    return checks


def _write(result: PreflightResult, settings: LoopSettings, given: set[str] | None,
           planned_for: str | None = None) -> None:
    directory = Path(settings.output)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # disk.writable already failed
    from ptbr import __version__

    rec = result.recommendation
    # a config only for a run that can start: with a failed check it would only lead into that failure
    config_path = directory / CONFIG_FILE if rec is not None and rec.fits and not result.failed else None
    report = {
        "ptbr": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": result.mode,
        "ok": not result.failed,
        "summary": result.summary(),
        "hardware": result.hardware.as_dict(),
        "requested": dataclasses.asdict(settings),
        "checks": [c.as_dict() for c in result.checks],
        "memory": None if rec is None else {
            "target": rec.target, "budget": rec.budget, "fits": rec.fits,
            "requested": rec.requested_estimate.as_dict() | {"phase": rec.requested_estimate.peak_phase},
            "recommended": rec.estimate.as_dict() | {"phase": rec.estimate.peak_phase},
        } | result.extra,
        "recommended_config": str(config_path) if config_path else None,
    }
    # the report first: a recommended config is never left without the report that explains it
    _write_json(directory / REPORT_FILE, report)
    result.report_path = directory / REPORT_FILE
    if config_path is not None:
        # what it was planned for, where that is not this machine (the Kaggle bundle reads it)
        _write_json(config_path, rec.config_file(given) | ({"planned_for": planned_for} if planned_for else {}))
        result.config_path = config_path


def _write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, default=_plain) + "\n", path.name)


def _plain(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return str(value)
