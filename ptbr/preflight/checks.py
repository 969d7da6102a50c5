"""The preflight checks: each returns Check objects (pass, warn or fail, a value, a one-line
message and a fix) and never raises for what it finds; a problem is a `fail`, not a crash."""

from __future__ import annotations

import math
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ptbr.config import DEFAULT_VOCAB_SIZE, FinetuneConfig, PretrainConfig, get_preset
from ptbr.errors import PtbrError
from ptbr.files import probe_writable, unwritable_fix
from ptbr.memory import GIB, Architecture, chunked_loss_from, experts_of, loss_compiled_with_forward
from ptbr.outputs import folder_refusal, input_refusal
from ptbr.preflight.hardware import Hardware
from ptbr.preflight.recommend import requested_processes
from ptbr.versions import package_versions

PASS, WARN, FAIL = "pass", "warn", "fail"
# a fine-tuning base hosted on Kaggle, as `ptbr kaggle bundle --base` takes it
KAGGLE_BASE = "--base kaggle:OWNER/MODEL/FRAMEWORK/VARIATION"


@dataclass
class Check:
    name: str  # "area.what", e.g. "data.train", "packages.torch"
    status: str  # pass | warn | fail
    value: Any  # what was found (JSON-serialisable)
    message: str  # one line
    fix: str | None = None  # what to do about a warn or fail

    def as_dict(self) -> dict:
        return asdict(self)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------


def check_hardware(hw: Hardware, device: str, here: bool = True) -> list[Check]:
    """`here` False: `hw` is another machine's, planned for (this one's Python is not its)."""
    python = f", Python {platform.python_version()}" if here else ""
    checks = [Check("hardware.os", PASS, hw.os, f"{hw.os}{python}, {hw.cpu_cores} CPU core{'s' if hw.cpu_cores != 1 else ''}")]
    if not hw.ram_total:
        checks.append(Check("hardware.ram", WARN, None, "RAM could not be read", "install psutil"))
    else:
        low = hw.ram_available < 4 * GIB
        more = ("raise the container's memory limit (e.g. docker run --memory 16g)" if hw.ram_limit else
                "close other programs")
        checks.append(Check("hardware.ram", WARN if low else PASS,
                            {"total": hw.ram_total, "available": hw.ram_available},
                            f"{hw.ram_name} {gib(hw.ram_available)} available of {gib(hw.ram_total)}",
                            f"{more}: loading data and checkpoints needs RAM too" if low else None))
    for index, gpu in enumerate(hw.gpus):
        precision = "bf16" if gpu.real_bf16 else "fp16 + GradScaler (no native bf16)"
        checks.append(Check(f"hardware.gpu{index}", PASS, asdict(gpu),
                            f"{gpu.name}: {gib(gpu.memory_free)} free of {gib(gpu.memory_total)}, compute "
                            f"{gpu.compute_capability}, driver {gpu.driver or 'unknown'}; trains in {precision}"))
    if hw.gpus and hw.torch_cuda is None:
        checks.append(Check("hardware.torch_cuda", FAIL, None, "a GPU is present but torch is a CPU-only build",
                            "install a CUDA build of torch (see the README's install section)"))
    if hw.apple_silicon:
        limit = f", Metal working set {gib(hw.metal_working_set)}" if hw.metal_working_set else ""
        checks.append(Check("hardware.apple", PASS, {"unified_memory": hw.unified_memory,
                                                     "metal_working_set": hw.metal_working_set},
                            f"Apple Silicon, {gib(hw.unified_memory or hw.ram_total)} unified memory{limit}"))
    if device == "cuda" and not hw.gpus:
        checks.append(Check("hardware.accelerator", FAIL, None, "--device cuda but no CUDA GPU found",
                            "use --device auto or cpu, or run where a GPU is"))
    elif device == "mps" and not hw.apple_silicon:
        checks.append(Check("hardware.accelerator", FAIL, None, "--device mps is Apple Silicon's GPU, and this machine "
                            "is not a Mac with one", "use --device auto" + (" or cuda" if hw.gpus else " or cpu")))
    elif not hw.gpus and not hw.apple_silicon:
        checks.append(Check("hardware.accelerator", WARN, None, "no GPU: training runs on the CPU (slow but works)",
                            "use a GPU (e.g. Kaggle's T4s) for anything larger than the tiny preset"))
    for note in hw.notes:
        checks.append(Check("hardware.probe", WARN, note, note, "see the message; the other checks still ran"))
    return checks


# --------------------------------------------------------------------------------------------
# Python and packages
# --------------------------------------------------------------------------------------------

# package -> minimum version (pyproject.toml's); which paths need it is decided in needed_packages()
MINIMUM = {"torch": "2.4", "transformers": "4.46", "tokenizers": "0.20", "accelerate": "1.0", "safetensors": "0.4",
           "numpy": "1.26", "peft": "0.13", "bitsandbytes": "0.45", "mlx": "0.20", "mlx-lm": "0.20"}


def check_compile_request(settings, target: str, hardware: Hardware, arch: Architecture | None = None,
                          planned: PretrainConfig | None = None, probe: bool = True) -> list[Check]:
    """`ptbr train --compile`: what train would refuse here (no compiler, MPS or MLX, several
    processes), as a failed check; nothing when --compile is not asked for. On a CUDA target, also
    whether its steps will replay as CUDA graphs, as train's start-up line says: for `planned`, the
    settings the run will take (the requested ones with `auto`'s precision resolved; default
    `settings`), and the model `arch` (None, or precision auto: the rule, not the answer).
    `probe` False: planned for another machine, whose compilers and GPU this one cannot see (the
    number of processes is still checked)."""
    if not getattr(settings, "compile", False):
        return []
    if target == "mlx":
        return [Check("settings.compile", FAIL, False, "--compile is a torch backend option (the MLX backend always "
                      "compiles its step)", "leave --compile out, or use --backend torch")]
    if target == "cuda" and not hardware.gpus:
        return []  # hardware.accelerator fails: there is no GPU to check torch.compile against
    import torch

    from ptbr.backends.torch.compiled import (
        EAGER_LOSS_REFUSAL,
        GRAPHS_REPLAY,
        accumulation_refusal,
        check_compile,
        cuda_graphs_refusal,
    )

    try:
        check_compile(torch.device(target) if probe else None, requested_processes(hardware, target, settings))
    except PtbrError as exc:
        return [Check("settings.compile", FAIL, False, exc.what, exc.fix)]
    message = ("--compile: torch.compile can run here (the first step compiles for tens of seconds)" if probe else
               "--compile: one process (its compiler and GPU are checked where it runs)")
    if target == "cuda" and getattr(settings, "cuda_graphs", False):  # what --cuda-graphs will do (train's line)
        planned = planned or settings
        refused = cuda_graphs_refusal(target, planned.gradient_checkpointing)
        if refused is None and planned.grad_accum > 1:
            refused = accumulation_refusal(planned.grad_accum)
        known = arch is not None and planned.precision != "auto"
        if refused is None and known:
            tokens = planned.batch_size * planned.seq_len
            chunked_from = (chunked_loss_from(arch.hidden_size, planned.precision)
                            if planned.chunked_loss and not arch.changes_logits else None)
            if not loss_compiled_with_forward(tokens, arch.vocab_size, chunked_from, planned.precision, target):
                refused = EAGER_LOSS_REFUSAL
        if refused:
            message += f"; CUDA graphs: {refused}"
        elif known:
            message += f"; {GRAPHS_REPLAY}"
        else:
            message += ("; steps whose loss is compiled with the forward pass replay as CUDA graphs (--no-cuda-graphs: "
                        "without)")
    return [Check("settings.compile", PASS, True, message)]


def check_mlx_backend(apple_silicon: bool = True) -> list[Check]:
    """On Apple Silicon the plan is for the MLX backend (`--backend mlx`, auto's choice there; and
    anywhere --backend mlx asks for it): say whether this environment can run it."""
    from importlib.util import find_spec

    if find_spec("mlx") is not None and find_spec("mlx_lm") is not None:
        where = "the Metal GPU" if apple_silicon else "the CPU (mlx[cpu]: slow, for testing)"
        return [Check("backend.mlx", PASS, True, f"runs on MLX (--backend mlx): {where}, MLX's 4-bit base for "
                      "--quant 4bit, LoRA adapters in mlx-lm's format")]
    return [Check("backend.mlx", WARN, False, "the plan is for the MLX backend, and mlx or mlx-lm is not installed: "
                  "ptbr would run on torch (MPS), where bitsandbytes' 4/8-bit does not",
                  "pip install 'ptbr[mlx]'")]


def needed_packages(mode: str, target: str, quant: str | None) -> list[str]:
    if target == "mlx":
        return ["mlx", "mlx-lm", "transformers", "tokenizers", "numpy"]
    needed = ["torch", "transformers", "tokenizers", "accelerate", "safetensors", "numpy"]
    if mode == "finetune":
        needed.append("peft")
        if quant:
            needed.append("bitsandbytes")
    return needed


def check_packages(mode: str, target: str, quant: str | None, versions: dict[str, str | None] | None = None) -> list[Check]:
    """`versions` (name -> version or None) can be injected; by default the installed ones."""
    from packaging.version import InvalidVersion, Version

    checks = []
    python_ok = sys.version_info >= (3, 10)
    checks.append(Check("packages.python", PASS if python_ok else FAIL, platform.python_version(),
                        f"Python {platform.python_version()}", None if python_ok else "use Python 3.10 or newer"))
    versions = versions if versions is not None else package_versions(MINIMUM)
    needed = needed_packages(mode, target, quant)
    for name, minimum in MINIMUM.items():
        found = versions.get(name)
        required = name in needed
        if found is None:
            if required:
                checks.append(Check(f"packages.{name}", FAIL, None, f"{name} is not installed (needed for {mode} on {target})",
                                    f"pip install '{name}>={minimum}'" + (" (or pip install 'ptbr[finetune]')"
                                                                         if name in ("peft", "bitsandbytes") else "")))
            continue
        try:
            old = Version(found) < Version(minimum)
        except InvalidVersion:
            old = False
        if old and required:
            checks.append(Check(f"packages.{name}", FAIL, found, f"{name} {found} is older than {minimum}",
                                f"pip install -U '{name}>={minimum}'"))
        else:
            checks.append(Check(f"packages.{name}", PASS, found,
                                f"{name} {found}" + ("" if required else " (not needed for this run)")))
    return checks


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def check_pretrain_data(settings: PretrainConfig) -> tuple[list[Check], Any]:
    """The token dataset: opens, formats, token counts, max id < vocab. Returns (checks, dataset)."""
    from ptbr.data import SAMPLE_DIR
    from ptbr.data.tokens import describe, open_dataset

    directory = settings.data or SAMPLE_DIR
    try:
        dataset = open_dataset(directory, settings.tokenizer)
        info = describe(dataset)
    except PtbrError as exc:
        return [Check("data.dataset", FAIL, str(directory), exc.what, exc.fix)], None
    except Exception as exc:  # noqa: BLE001 - an unreadable dataset is a failed check, not a crash
        return [Check("data.dataset", FAIL, str(directory), f"cannot read the dataset: {type(exc).__name__}: {exc}",
                      "re-run `ptbr prepare`")], None
    checks = [Check("data.dataset", PASS, info, f"{directory} ({info['layout']}), vocab {info['vocab_size']:,}, "
                    f"{info['dtype']} tokens" + (" (the bundled sample)" if not settings.data else ""))]
    for problem in info["problems"]:
        checks.append(Check("data.token_ids", FAIL, problem, problem,
                            "re-run `ptbr prepare`, or pass the tokenizer the data was made with"))
    for warning in info["warnings"]:
        checks.append(Check("data.warning", WARN, warning, warning, "see the message"))
    seq = settings.seq_len
    train = info["train_tokens"]
    if train < seq + 1:
        checks.append(Check("data.train", FAIL, train, f"train.bin holds {train:,} tokens, fewer than seq_len + 1 = {seq + 1}",
                            "lower --seq-len or add data"))
    else:
        per_step = settings.batch_size * settings.grad_accum * seq
        passes = per_step * settings.max_steps / train
        many = passes > 100
        checks.append(Check("data.train", WARN if many else PASS, {"tokens": train, "max_id": info.get("train_max_id"),
                                                                    "passes": round(passes, 2)},
                            f"train.bin {train:,} tokens (max id {info.get('train_max_id'):,}); the run reads "
                            f"{per_step:,} tokens a step, {passes:.1f} passes over the data",
                            "add data or lower --max-steps: so many passes memorise the data" if many else None))
    if info["val_tokens"]:
        checks.append(Check("data.val", PASS, info["val_tokens"], f"val.bin {info['val_tokens']:,} tokens"))
    return checks, dataset


def check_finetune_data(settings: FinetuneConfig, tokenizer=None, positions: int | None = None
                        ) -> tuple[list[Check], dict]:
    """The JSONL files, with the verdict `ptbr finetune` and `validate-data` give (and encoded, with
    the length policy applied, when the base's tokenizer loaded). Returns (checks, {"examples", "longest"})."""
    from ptbr.finetune.data import data_paths, fix_of, inspect_pair, problems_summary

    try:
        train_path, valid_path = data_paths(settings.data, settings.valid)
    except PtbrError as exc:
        return [Check("data.train", FAIL, settings.data, exc.what, exc.fix)], {}
    checks, summary = [], {}
    reports = inspect_pair(train_path, valid_path, tokenizer, settings.max_seq_len, settings.drop_long, positions)
    for name, report in zip(("data.train", "data.valid"), reports + [None], strict=False):
        if report is None:
            checks.append(Check(name, WARN, None, "no validation file: no evaluation, adapters/ gets the last step's",
                                "give --valid FILE.jsonl, or put valid.jsonl next to train.jsonl"))
            continue
        path = report.path
        count = len(report.examples) if tokenizer is not None else len(report.records)
        value = {"path": str(path), "format": report.schema, "examples": count, "longest_tokens": report.longest or None,
                 "too_long": report.too_long, "problems": report.problems[:20], "warnings": report.warnings}
        if name == "data.train":
            summary = {"examples": count, "longest": report.longest}
        if report.problems:
            checks.append(Check(name, FAIL, value, problems_summary(report),
                                fix_of([report], f"fix those lines (`ptbr validate-data {path}` lists every problem)")))
            continue
        message = f"{path}: {count} {report.schema} examples"
        if tokenizer is not None:
            message += f", longest {report.longest} tokens"
        else:
            message += " (lengths unknown: the tokenizer did not load)"
        checks.append(Check(name, WARN if report.warnings else PASS, value,
                            message + (f"; {report.warnings[0]}" if report.warnings else ""),
                            "raise --max-seq-len if memory allows (see the recommendation)" if report.warnings else None))
    return checks, summary


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def check_preset(settings: PretrainConfig, vocab_size: int | None) -> list[Check]:
    preset = get_preset(settings.model_size)
    vocab = vocab_size or DEFAULT_VOCAB_SIZE
    return [Check("model.preset", PASS, {"model_size": preset.name, "parameters": preset.param_count(vocab),
                                         "vocab_size": vocab},
                  f"{preset.name}: {preset.param_count(vocab):,} parameters at vocab {vocab:,}, "
                  f"up to {preset.max_position_embeddings} positions")]


def mixture_of_experts(config: dict) -> Check | None:
    """A FAIL for a mixture-of-experts base: the memory model counts dense decoders, and would plan
    its experts' weights as one MLP's (a Mixtral-8x7B as a 7B)."""
    found = experts_of(config)
    if found is None:
        return None
    kind = (config.get("architectures") or [config.get("model_type", "?")])[0]
    return Check("model.architecture", FAIL, {found[0]: found[1]},
                 f"{kind} is a mixture-of-experts decoder ({found[0]} {found[1]}): the memory model counts dense "
                 "decoders, and would plan its experts' weights as one MLP's (several times too low)",
                 "no memory plan for it: size the run by hand (the weights at the --quant precision, plus "
                 "activations); --load-test checks that the base loads")


def read_base_config(settings: FinetuneConfig, elsewhere: bool = False) -> tuple[list[Check], dict | None]:
    """The base model's config.json, read as JSON (no weights, no network). `elsewhere` (a plan for
    Kaggle): the weights need not be here, and a model hosted on Kaggle, unreadable here, is named as such."""
    from ptbr.backends import resolve_name
    from ptbr.finetune.base import check_base, has_weights, read_config

    base = settings.base
    if elsewhere and base.startswith("kaggle:"):
        return [Check("model.base", FAIL, base, "a model hosted on Kaggle cannot be read from here, and the plan needs "
                      "its config.json", "plan with a local folder holding the same model's config.json and tokenizer "
                      "files (the weights can be left out with --for kaggle), then bundle with --base " + base)], None
    weightless = []
    try:
        check_base(base, settings.download, weights=not elsewhere)
        if elsewhere and Path(base).expanduser().is_dir() and not has_weights(Path(base).expanduser()):
            weightless = [Check("model.weights", WARN, base, f"no weights in {base}: planned from its config.json",
                                f"bundle with the model on Kaggle ({KAGGLE_BASE}), or with a folder holding the "
                                "weights too")]
        if resolve_name(settings.backend) == "torch":
            from ptbr.backends.torch.lora import refuse_prequantized

            refuse_prequantized(base)
    except PtbrError as exc:
        return [Check("model.base", FAIL, base, exc.what, exc.fix)], None
    directory = Path(base).expanduser()
    if not directory.is_dir():
        directory = _hub_cache_dir(base)
        if directory is None:
            return [Check("model.base", FAIL, base, f"{base} is neither a local directory nor in the Hugging Face cache",
                          "download it first (huggingface-cli download ...) and give its directory")], None
    path = directory / "config.json"
    try:
        config = read_config(str(directory))
    except PtbrError as exc:
        return [Check("model.config", FAIL, str(path), exc.what, exc.fix)], None
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in needed if k not in config]
    wrong = [k for k in needed if k in config and (not isinstance(config[k], int) or config[k] <= 0)]
    if missing or wrong:
        found = ([f"lacks {', '.join(missing)}"] if missing else []) + (
            [f"has non-positive or non-integer {', '.join(wrong)}"] if wrong else [])
        return [Check("model.config", FAIL, str(path), f"config.json {' and '.join(found)}",
                      "use a complete Llama/Mistral/Qwen-style decoder config")], None
    kind = (config.get("architectures") or [config.get("model_type", "?")])[0]
    return weightless + [Check("model.config", PASS, {k: config.get(k) for k in needed + ("num_key_value_heads", "model_type")},
                  f"{base}: {kind}, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
                  f"vocab {config['vocab_size']:,}")], config


def _hub_cache_dir(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
        return Path(found).parent if isinstance(found, str) else None
    except Exception:  # noqa: BLE001
        return None


def load_base_tokenizer(settings: FinetuneConfig, config: dict | None = None,
                        elsewhere: bool = False) -> tuple[list[Check], Any]:
    from ptbr.finetune.base import check_tokenizer_fits, load_tokenizer

    try:
        tokenizer = load_tokenizer(settings.base, settings.trust_remote_code, settings.download, weights=not elsewhere)
        check_tokenizer_fits(settings.base, tokenizer, config)
    except PtbrError as exc:
        return [Check("model.tokenizer", FAIL, settings.base, exc.what, exc.fix)], None
    return [Check("model.tokenizer", PASS, len(tokenizer), f"the tokenizer loads ({len(tokenizer):,} tokens)")], tokenizer


def load_test(settings: FinetuneConfig) -> Check:
    """--load-test: load the base with its adapter exactly as `ptbr finetune` will, then free it."""
    from ptbr.backends import create_backend

    try:
        backend = create_backend(settings.backend, settings.device, settings.precision)
        adapted = backend.load_adapted(settings)
        footprint = adapted.weights_bytes
        del adapted
        backend.release_memory()
        # under torchrun the backend joined the launcher's process group (every rank runs this
        # check): closed again, or its threads (gloo's) race the process's exit
        backend.world.close()
        return Check("model.load_test", PASS, footprint, f"the weights load with the adapter ({gib(footprint)})")
    except PtbrError as exc:
        return Check("model.load_test", FAIL, settings.base, exc.what, exc.fix)
    except Exception as exc:  # noqa: BLE001 - a load failure of any kind is a failed check
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return Check("model.load_test", FAIL, settings.base, f"the weights do not load: {reason}",
                     "check the model files and the free memory")


# --------------------------------------------------------------------------------------------
# Disk and output directory
# --------------------------------------------------------------------------------------------


def checkpoint_bytes(mode: str, parameters: int, trainable: int) -> int:
    """One checkpoint: fp32 weights (or the adapter) plus AdamW's two fp32 moments."""
    if mode == "pretrain":
        return 4 * parameters + 8 * parameters
    return 4 * trainable + 8 * trainable


def check_output_of_its_own(settings: PretrainConfig | FinetuneConfig) -> list[Check]:
    """What the run would refuse as its --output (exit 6; ptbr/outputs.py): the directory of its
    --data, --valid or --base, a file, a folder that holds a dataset or a model."""
    refused = input_refusal(settings) or folder_refusal(settings.output)
    if refused is not None:
        return [Check("disk.output", FAIL, str(settings.output), f"{refused[0]}: the run would refuse it", refused[1])]
    saved = sorted(Path(settings.output).expanduser().glob("checkpoints/step_*/trainer_state.json"))
    if saved and settings.resume != "never":  # the run resumes it, and refuses settings other than its own: the plan may not apply
        newest = saved[-1].parent.name
        return [Check("disk.previous_run", WARN, str(settings.output),
                      f"{settings.output} holds a run (checkpoints up to {newest}): the run resumes it where its "
                      "settings match the checkpoint's, and refuses other settings (this plan's among them)",
                      "for a new run, give a new --output, or add --resume never (the old run's files move to "
                      "OUTPUT/previous/)")]
    return []


def check_output(output: str, needed: int | None, one_checkpoint: int | None, in_kaggle: bool,
                 here: bool = True) -> list[Check]:
    """Write permission, then free space against what the run's checkpoints will take (None: not
    known, the model's size could not be read). `here` False: the run is planned for another
    machine, whose disk this one cannot see (Kaggle's output limit is still checked)."""
    directory = Path(output)
    checks = []
    try:
        probe_writable(directory)
        checks.append(Check("disk.writable", PASS, str(directory), f"{directory} is writable"))
    except OSError as exc:
        checks.append(Check("disk.writable", FAIL, str(directory), f"cannot write to {directory}: {exc.strerror or exc}",
                            unwritable_fix(exc)))
        return checks
    free = shutil.disk_usage(directory).free
    value = {"free": free, "needed": needed, "one_checkpoint": one_checkpoint}
    if not here:
        if in_kaggle and needed is not None and needed > 19 * GIB:
            checks.append(kaggle_output_size(needed))
        return checks
    if needed is None or one_checkpoint is None:
        checks.append(Check("disk.space", PASS, value, f"{gib(free)} free (the checkpoints' size is unknown: the "
                            "model could not be read)"))
        return checks
    if free < one_checkpoint:
        checks.append(Check("disk.space", FAIL, value, f"{gib(free)} free in {directory}, one checkpoint takes "
                            f"{gib(one_checkpoint)}", "free disk space or choose another --output"))
    elif free < needed:
        checks.append(Check("disk.space", WARN, value, f"{gib(free)} free in {directory}; the run's checkpoints take "
                            f"{gib(needed)}", "use --keep-last N, raise --save-every, or free space"))
    else:
        checks.append(Check("disk.space", PASS, value, f"{gib(free)} free, the run's checkpoints take {gib(needed)}"))
    if in_kaggle and needed > 19 * GIB:
        checks.append(kaggle_output_size(needed))
    return checks


def kaggle_output_size(needed: int) -> Check:
    return Check("kaggle.output_size", WARN, needed, f"the run writes {gib(needed)}; Kaggle keeps about 20 GB of "
                 "/kaggle/working", "keep fewer checkpoints: a lower --keep-last (N keeps N + 1 for a moment, the "
                 "newest written before the oldest goes), or a larger --save-every")


def checkpoint_plan(settings: PretrainConfig | FinetuneConfig, parameters: int, trainable: int,
                    examples: int | None) -> tuple[int, int]:
    """(bytes all checkpoints and the final model take, bytes of one checkpoint)."""
    mode = "finetune" if isinstance(settings, FinetuneConfig) else "pretrain"
    one = checkpoint_bytes(mode, parameters, trainable)
    if mode == "pretrain":
        steps = settings.max_steps
    else:
        effective = settings.batch_size * settings.grad_accum
        steps = settings.max_steps or 0
        if examples:
            steps = min(steps or math.inf, -(-examples // effective) * settings.epochs)
    count = max(1, math.ceil(steps / max(1, settings.save_every))) if steps else 1
    if settings.keep_last:
        count = min(count, settings.keep_last + 1)  # the newest is written before the oldest goes
    final = 4 * parameters if mode == "pretrain" else 4 * trainable
    return count * one + final, one


# --------------------------------------------------------------------------------------------
# Kaggle
# --------------------------------------------------------------------------------------------


def check_kaggle(hw: Hardware, output: str) -> list[Check]:
    if not hw.in_kaggle:
        return []
    checks = []
    run_type = os.environ.get("KAGGLE_KERNEL_RUN_TYPE", "unknown")
    names = sorted({g.name for g in hw.gpus})
    checks.append(Check("kaggle.runtime", PASS if hw.gpus else WARN, {"run_type": run_type, "gpus": names},
                        f"Kaggle ({run_type}), GPUs: {', '.join(names) or 'none'}; sessions end after 12 h: the run "
                        "saves on SIGTERM and resumes from the previous version's output",
                        None if hw.gpus else "enable the GPU accelerator (machine_shape NvidiaTeslaT4)"))
    inside = Path(output).resolve().is_relative_to(Path("/kaggle/working"))
    checks.append(Check("kaggle.output", PASS if inside else WARN, output,
                        f"output {output} " + ("is under /kaggle/working (kept)" if inside else "is outside /kaggle/working: lost when the session ends"),
                        None if inside else "use an --output under /kaggle/working"))
    return checks
