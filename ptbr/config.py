"""Settings dataclasses and model presets as plain data: the one place every default lives.

No torch import here: `ptbr --help`, `ptbr info` and preflight stay fast.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ptbr.errors import ConfigError, collect


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A settings field: its docstring becomes the `--help` text of the matching flag."""
    return field(default=default, metadata={"help": help, "choices": choices})


# --------------------------------------------------------------------------------------------
# Model presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, SDPA attention), as plain numbers."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    learning_rate: float  # the default peak learning rate for pretraining this size
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def param_count(self, vocab_size: int) -> int:
        """Exact parameter count of the `LlamaForCausalLM` this preset builds."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = 2 * h * h + 2 * h * kv  # q, o: (h, h); k, v: (h, kv)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        per_layer = attention + mlp + 2 * h  # + two RMSNorm weights
        embeddings = vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # + final norm


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # tests and smoke: ~1.1M parameters with the bundled 2,048-token tokenizer
        ModelPreset("tiny", 128, 4, 4, 4, 352, 512, learning_rate=3e-3),
        ModelPreset("85m", 640, 14, 10, 5, 1728, 2048, learning_rate=6e-4),  # 84.2M at a 32k vocab
        ModelPreset("400m", 1024, 28, 16, 16, 2816, 2048, learning_rate=3e-4),  # 392.5M at a 32k vocab
        ModelPreset("800m", 1536, 26, 24, 24, 4096, 2048, learning_rate=2.5e-4),  # 785.3M at a 32k vocab
    )
}


def get_preset(name: str) -> ModelPreset:
    """Look a preset up by name; an unknown name lists the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model size {name!r}",
            "--model-size",
            f"use one of: {', '.join(PRESETS)}",
        ) from None


# --------------------------------------------------------------------------------------------
# Run settings
# --------------------------------------------------------------------------------------------

# The vocabulary `ptbr prepare` trains by default, and the one a preset is sized at without a dataset.
DEFAULT_VOCAB_SIZE = 32000
DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
BACKENDS = ("auto", "torch", "mlx")


def settings_fix(cls: type) -> str:
    """The fix of a settings error: the command whose --help lists these settings (a Kaggle bundle's
    or preflight's settings are `ptbr train`'s or `ptbr finetune`'s)."""
    command = getattr(cls, "command", None)
    where = f"`ptbr {command} --help`" if command else "--help"
    return f"correct those values ({where} lists every setting and its default)"


# torch, numpy and mlx all take seeds below this
MAX_SEED = 2**63


def default_warmup(max_steps: int) -> int:
    """5% of the run, at least 1 step, at most 1,000."""
    return min(1000, max(1, round(0.05 * max_steps)))


@dataclass
class LoopSettings:
    """Settings of the training loop shared by pretraining and fine-tuning."""

    output: str = setting("runs/ptbr", "Run directory: checkpoints, metrics, final model.")
    batch_size: int = setting(8, "Sequences per micro-batch.")
    grad_accum: int = setting(1, "Micro-batches per optimizer step (their loss is averaged).")
    max_steps: int = setting(1000, "Optimizer steps to train for.")
    learning_rate: float | None = setting(
        None, "Peak learning rate, reached after the warmup (default: the model preset's for train, 2e-4 for finetune).")
    min_lr_ratio: float = setting(0.1, "The cosine decay ends at learning_rate * min_lr_ratio.")
    warmup_steps: int | None = setting(None, "Steps of linear warmup to learning_rate (default: 5% of max_steps, at most 1000).")
    weight_decay: float = setting(0.1, "AdamW weight decay (not applied to norms and biases).")
    beta1: float = setting(0.9, "AdamW beta1.")
    beta2: float = setting(0.95, "AdamW beta2.")
    max_grad_norm: float = setting(1.0, "Gradient clipping norm (0 disables clipping).")
    save_every: int = setting(500, "Save a checkpoint every N steps, at the end and when stopped (0: only then).")
    eval_every: int = setting(250, "Evaluate on the validation set every N steps (0: only at the end).")
    eval_batches: int = setting(20, "Fixed number of validation batches per evaluation.")
    log_every: int = setting(10, "Print a plain log line every N steps when not on a terminal.")
    seed: int = setting(1337, "Seed for model initialisation and batch sampling (0 is a valid seed).")
    backend: str = setting("auto", "Array library: torch, or mlx (Apple Silicon, also mlx[cpu] on Linux); auto picks "
                           "mlx on Apple Silicon when mlx is installed, torch elsewhere.", BACKENDS)
    device: str = setting("auto", "Where to train: auto picks cuda, then mps, then cpu (with --backend mlx: the "
                          "Metal GPU, or cpu).", DEVICES)
    precision: str = setting(
        "auto", "auto: bf16 where the GPU really has it, fp16 + GradScaler on T4-class GPUs; on a CPU fp32, except "
        "pretraining on a CPU that computes bf16 natively (AVX512-BF16 or AMX): bf16 autocast.", PRECISIONS
    )
    resume: str = setting("auto", "auto: continue from the newest complete checkpoint; never; or a checkpoint PATH.")
    num_processes: str = setting(
        "1", "Data-parallel processes to start on this machine: a number, or auto (one per visible GPU, 1 without "
        "GPUs). Under torchrun or `accelerate launch` the launcher starts them instead.")
    fsdp: bool = setting(False, "Shard weights, gradients and AdamW state across the processes (FSDP) instead of "
                         "copying the model to each (DDP): for models whose training state does not fit one GPU.")
    gradient_checkpointing: bool = setting(False, "Recompute activations in the backward pass to save memory.")
    chunked_loss: bool = setting(
        True, "Compute the cross-entropy and its gradient together with the output layer, a chunk of tokens at a time "
        "(32 MiB of fp32 logits; 256 MiB on a CUDA GPU), so that the whole logits never exist: the same loss, with "
        "less memory and, on CPU, faster (torch backend). Where the output layer is trained in bf16/fp16, "
        "micro-batches of fewer tokens than its hidden size keep the whole logits, which take less memory there.")
    auto_fit: bool = setting(
        False, "Before training, run a real step on the longest batch and halve batch_size (doubling grad_accum) "
        "until it fits; an out-of-memory later resumes from the last checkpoint the same way.")
    keep_last: int = setting(0, "Keep only the newest N checkpoints (0 keeps all).")
    hang_timeout: float | None = setting(
        None, "Seconds without a completed step before the watchdog reports a hang (default: 30 min before the "
        "first step, then 20x the first step's time, at least 5 min).")
    hang_action: str = setting("exit", "On a hang: exit (write hang_report.txt, exit 8) or warn (report, keep waiting).",
                               ("exit", "warn"))
    tensorboard: bool = setting(False, "Also write the metrics as TensorBoard event files in OUTPUT/tensorboard "
                                "(needs the tensorboard extra: pip install 'ptbr[tensorboard]').")

    def __post_init__(self) -> None:
        if self.warmup_steps is None and isinstance(self.max_steps, int):
            self.warmup_steps = default_warmup(self.max_steps)
        if self.learning_rate is None:
            self.learning_rate = self.default_learning_rate()
        collect(self.problems(), ConfigError, "settings", settings_fix(type(self)))

    optional_paths: ClassVar[tuple[str, ...]] = ()  # path settings that may be left out, never given as ""

    def default_learning_rate(self) -> float:
        return 2e-4

    def problems(self) -> list[str]:
        """Every invalid value, so that one run reports them all."""
        found = []
        if not isinstance(self.output, str) or not self.output.strip():
            found.append(f"output must be a directory path, got {self.output!r}")
        for name in self.optional_paths:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                found.append(f"{name} must be a path or left out, got {value!r}")
        for name in ("batch_size", "grad_accum", "max_steps", "eval_batches", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                found.append(f"{name} must be a positive integer, got {value!r}")
        for name in ("save_every", "eval_every", "warmup_steps"):
            value = getattr(self, name)
            if name == "warmup_steps" and value is None:  # left to its default, of a max_steps reported above
                continue
            if not isinstance(value, int) or value < 0:
                found.append(f"{name} must be an integer >= 0, got {value!r}")
        if not _finite(self.learning_rate) or self.learning_rate <= 0:
            found.append(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        if not _finite(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            found.append(f"min_lr_ratio must be within [0, 1], got {self.min_lr_ratio!r}")
        if not _finite(self.max_grad_norm) or self.max_grad_norm < 0:
            found.append(f"max_grad_norm must be >= 0, got {self.max_grad_norm!r}")
        if not _finite(self.weight_decay) or self.weight_decay < 0:
            found.append(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not _finite(value) or not 0 <= value < 1:
                found.append(f"{name} must be within [0, 1), got {value!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            found.append(f"seed must be an integer within [0, 2**63), got {self.seed!r}")
        if self.backend not in BACKENDS:
            found.append(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.device not in DEVICES:
            found.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            found.append(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not self.resume:
            found.append("resume must be auto, never or a checkpoint path")
        if not (self.num_processes == "auto" or (isinstance(self.num_processes, str) and
                                                  self.num_processes.isdigit() and int(self.num_processes) >= 1)):
            found.append(f"num_processes must be a number >= 1 or auto, got {self.num_processes!r}")
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            found.append(f"keep_last must be an integer >= 0, got {self.keep_last!r}")
        if self.hang_timeout is not None and (not _finite(self.hang_timeout) or self.hang_timeout <= 0):
            found.append(f"hang_timeout must be a number of seconds > 0, got {self.hang_timeout!r}")
        if self.hang_action not in ("exit", "warn"):
            found.append(f"hang_action must be exit or warn, got {self.hang_action!r}")
        return found


@dataclass
class PretrainConfig(LoopSettings):
    """`ptbr train`: pretrain a preset from scratch on a tokenized dataset."""

    data: str | None = setting(None, "Dataset directory with train.bin (and val.bin); none: the bundled PT-BR sample.")
    tokenizer: str | None = setting(None, "tokenizer.json (needed for datasets without meta.json).")
    model_size: str = setting("tiny", "Model preset: tiny, 85m, 400m or 800m.")
    seq_len: int = setting(256, "Tokens per training sequence.")
    compile: bool = setting(
        False, "Compile the model's forward pass with torch.compile (with the loss where it takes the whole logits, "
        "as on a GPU in bf16/fp16 up to 1 GiB of them; torch backend, one process, CPU or CUDA; needs a C/C++ "
        "compiler): faster steps after a compile of tens of seconds at the first step.")
    cuda_graphs: bool = setting(
        True, "Under --compile on a CUDA GPU, replay each step's compiled forward and backward passes as CUDA graphs "
        "(torch.compile's reduce-overhead mode) where a step is one micro-batch (--grad-accum 1) whose loss is "
        "compiled with the forward pass, without --gradient-checkpointing: one launch instead of hundreds, for "
        "small models whose steps wait on kernel launches.")
    optional_paths: ClassVar[tuple[str, ...]] = ("data", "tokenizer")
    command: ClassVar[str] = "train"

    def default_learning_rate(self) -> float:
        return PRESETS[self.model_size].learning_rate if self.model_size in PRESETS else 3e-4

    def problems(self) -> list[str]:
        found = super().problems()
        if not isinstance(self.seq_len, int) or self.seq_len <= 0:
            found.append(f"seq_len must be a positive integer, got {self.seq_len!r}")
        if self.model_size not in PRESETS:
            found.append(f"unknown model size {self.model_size!r} (valid: {', '.join(PRESETS)})")
        elif isinstance(self.seq_len, int) and self.seq_len > PRESETS[self.model_size].max_position_embeddings:
            limit = PRESETS[self.model_size].max_position_embeddings
            found.append(f"seq_len {self.seq_len} exceeds the {self.model_size} model's maximum of {limit} positions")
        return found


QUANTS = ("4bit", "8bit", "none")
LORA_DROPOUT_IMPLS = ("auto", "packed", "torch")


def lora_dropout_impl(requested: str, device: str) -> str:
    """--lora-dropout-impl on a device (cpu, cuda, mps): auto is packed on a CPU, where torch's
    Bernoulli masks cost a quarter of a small model's LoRA step, and torch's own elsewhere (one
    fused kernel on a GPU)."""
    if requested != "auto":
        return requested
    return "packed" if device == "cpu" else "torch"


@dataclass
class FinetuneConfig(LoopSettings):
    """`ptbr finetune`: LoRA / QLoRA of a Hugging Face causal LM on chat or instruction JSONL."""

    # Redefined from LoopSettings: a fine-tuning run must never resume from a pretraining run's
    # checkpoints, and three settings wait for the data (None: see resolve_steps / the help).
    output: str = setting("runs/finetune", "Run directory: checkpoints, adapters (the best by val_loss), metrics.")
    max_steps: int | None = setting(None, "Optimizer steps to train for (default: epochs x steps per epoch).")
    eval_batches: int | None = setting(None, "Validation batches per evaluation (default: the whole validation set).")
    save_every: int = setting(100, "Save a checkpoint every N steps, at the end and when stopped (0: only then).")
    eval_every: int = setting(50, "Evaluate on the validation set every N steps (0: only at the end); the best adapter is kept.")
    base: str | None = setting(None, "Base model: a local Hugging Face directory (a Hugging Face Hub id with --download).")
    download: bool = setting(False, "Allow --base to be a Hugging Face Hub id, downloaded when not cached (needs "
                             "network); without it a --base that is not a local directory is an error.")
    data: str | None = setting(None, "train.jsonl, or a directory holding train.jsonl and valid.jsonl.")
    valid: str | None = setting(None, "Validation JSONL (default: valid.jsonl next to train.jsonl when --data is a directory).")
    quant: str = setting("4bit", "Base weights: 4bit (QLoRA: NF4, double quantization), 8bit or none.", QUANTS)
    lora_r: int = setting(16, "LoRA rank.")
    lora_alpha: float = setting(32, "LoRA alpha (the update is scaled by alpha / r).")
    lora_dropout: float = setting(0.05, "Dropout on the LoRA input.")
    lora_dropout_impl: str = setting(
        "auto", "How LoRA dropout draws its masks (torch backend): packed (four 16-bit random numbers per 64-bit "
        "draw, a bool mask: about 2x less time on CPU), torch (torch.nn.Dropout, as PEFT has it), or auto (packed on "
        "CPU, torch on GPUs).", LORA_DROPOUT_IMPLS)
    target_modules: str | None = setting(
        None, "Comma-separated module names to adapt, e.g. q_proj,v_proj (a list in a config file; default: every "
        "linear projection but lm_head).")
    max_seq_len: int = setting(1024, "Longest example in tokens; longer ones are truncated (with a warning) or dropped.")
    drop_long: bool = setting(False, "Drop examples longer than max_seq_len instead of truncating them.")
    group_by_length: bool = setting(False, "Batch examples of similar length together (fewer pad tokens; like "
                                    "transformers' group_by_length): within each window of 50 steps' examples, "
                                    "steps of similar lengths, in a random order.")
    epochs: int = setting(1, "Passes over the training examples (ignored when max_steps is given).")
    merge: bool = setting(False, "At the end, also write OUTPUT/merged: the base with the best adapter merged in.")
    optional_paths: ClassVar[tuple[str, ...]] = ("valid",)
    command: ClassVar[str] = "finetune"
    trust_remote_code: bool = setting(False, "Allow the base model's own Python code to run (only for models you trust).")

    def resolve_steps(self, steps_per_epoch: int) -> FinetuneConfig:
        """The one place max_steps is settled: an explicit value wins, else epochs x steps_per_epoch.
        The warmup default then follows from it (LoopSettings.__post_init__)."""
        max_steps = self.max_steps if self.max_steps is not None else self.epochs * steps_per_epoch
        return dataclasses.replace(self, max_steps=max_steps)

    def problems(self) -> list[str]:
        waiting = [name for name in ("max_steps", "warmup_steps", "eval_batches") if getattr(self, name) is None]
        found = [p for p in super().problems() if p.split(" ", 1)[0] not in waiting]
        for name in ("base", "data"):
            if not getattr(self, name):
                found.append(f"{name} is required (--{name})")
        if self.quant not in QUANTS:
            found.append(f"quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        for name in ("lora_r", "max_seq_len", "epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                found.append(f"{name} must be a positive integer, got {value!r}")
        if not _finite(self.lora_alpha) or self.lora_alpha <= 0:
            found.append(f"lora_alpha must be a finite number > 0, got {self.lora_alpha!r}")
        if not _finite(self.lora_dropout) or not 0 <= self.lora_dropout < 1:
            found.append(f"lora_dropout must be within [0, 1), got {self.lora_dropout!r}")
        if self.lora_dropout_impl not in LORA_DROPOUT_IMPLS:
            found.append(f"lora_dropout_impl must be one of {', '.join(LORA_DROPOUT_IMPLS)}, "
                         f"got {self.lora_dropout_impl!r}")
        if self.target_modules is not None and not [m for m in self.target_modules.split(",") if m.strip()]:
            found.append("target_modules must name at least one module, e.g. q_proj,v_proj")
        return found


MODES = {"pretrain": PretrainConfig, "finetune": FinetuneConfig}  # preflight's --mode -> the run's settings


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------------------------
# Loading settings from a file and flags
# --------------------------------------------------------------------------------------------

# Keys a recommended_config.json may carry for people, not for the loop.
INFORMATIONAL_KEYS = ("reasons", "_comment", "planned_for")  # preflight's, in its recommended_config.json


def settings_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """The settings of `cls` with their resolved types, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def base_type(annotation: Any) -> type:
    """`int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


# comma-separated settings that a config file may also give as a list (YAML's [q_proj, v_proj])
LIST_SETTINGS = ("target_modules",)


def _coerce(name: str, value: Any, annotation: Any, problems: list[str]) -> Any:
    if value is None:
        return None
    kind = base_type(annotation)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if name in LIST_SETTINGS and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return ",".join(value)  # a config file's list, as the flag's comma-separated names
    problems.append(f"{name} must be of type {kind.__name__}, got {value!r}")
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML settings file (keys in snake_case)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "not found"
        raise ConfigError(f"config file {what}: {path}", "--config", "give the path of an existing JSON or YAML file")
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"a config file is .json, .yaml or .yml, not {suffix or 'a file without a suffix'}",
                          str(path), "rename it to its format's suffix (the suffix chooses the parser)")
    try:
        text = path.read_text(encoding="utf-8")
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader
        else:
            data = json.loads(text, object_pairs_hook=_unique_keys)
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        mark = getattr(exc, "problem_mark", None)  # YAML's: where it stopped (JSON's message says it)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        said = first_line + (f": {problem}" if problem and problem != first_line else "")
        raise ConfigError(f"cannot parse config file: {said}{where}", str(path),
                          f"fix the {'YAML' if suffix != '.json' else 'JSON'} syntax there (the file must be UTF-8 "
                          "text)") from exc
    if not isinstance(data, dict):
        raise ConfigError("config file must hold a mapping of settings", str(path), "write key: value pairs")
    return data


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json keeps the last silently)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"the key {key!r} is given twice")
        found[key] = value
    return found


def _unique_key_loader():
    """YAML's SafeLoader, refusing a key given twice in one mapping: YAML keeps the last silently,
    and a config with `seq_len: 32` and, further down, `seq_len: 64` ran at 64."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged by SafeLoader itself
                continue
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def build_settings(cls: type, file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                   source: str = "config file") -> Any:
    """Settings from defaults < config file < flags. Unknown keys, wrong types and invalid values
    are all reported together, in one error."""
    known = {f.name: hint for f, hint in settings_fields(cls)}
    merged: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in (file_values or {}).items():
        if key in INFORMATIONAL_KEYS:
            continue
        name = str(key).replace("-", "_")
        if name not in known:
            problems.append(f"unknown key {key!r}")
            continue
        merged[name] = value
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None or k in merged})
    unknown = bool(problems)
    values = {}
    for name, value in merged.items():
        before = len(problems)
        coerced = _coerce(name, value, known[name], problems)
        if len(problems) == before:  # a value of the wrong type is reported once, not validated too
            values[name] = coerced
    settings = None
    try:
        settings = cls(**values)
    except ConfigError as exc:
        problems.extend(exc.problems)
    fix = settings_fix(cls)
    if unknown:
        fix = f"remove or rename the unknown keys (valid keys: {', '.join(sorted(known))})" + (
            f"; {fix}" if len(problems) > sum(p.startswith("unknown key") for p in problems) else "")
    collect(problems, ConfigError, source, fix)
    return settings


def settings_to_dict(settings: Any) -> dict[str, Any]:
    return dataclasses.asdict(settings)
