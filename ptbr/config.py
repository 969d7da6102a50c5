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
from typing import Any

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
        ModelPreset("800m", 1536, 26, 24, 24, 4096, 2048, learning_rate=2.5e-4),  # 785.4M at a 32k vocab
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

DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")


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
    save_every: int = setting(500, "Save a checkpoint every N steps (and always at the end).")
    eval_every: int = setting(250, "Evaluate on the validation set every N steps (0: only at the end).")
    eval_batches: int = setting(20, "Fixed number of validation batches per evaluation.")
    log_every: int = setting(10, "Print a plain log line every N steps when not on a terminal.")
    seed: int = setting(1337, "Seed for model initialisation and batch sampling (0 is a valid seed).")
    device: str = setting("auto", "Where to train: auto picks cuda, then mps, then cpu.", DEVICES)
    precision: str = setting(
        "auto", "auto: bf16 where the GPU really has it, fp16 + GradScaler on T4-class GPUs, fp32 on CPU.", PRECISIONS
    )
    resume: str = setting("auto", "auto: continue from the newest complete checkpoint; never; or a checkpoint PATH.")
    gradient_checkpointing: bool = setting(False, "Recompute activations in the backward pass to save memory.")

    def __post_init__(self) -> None:
        if self.warmup_steps is None and isinstance(self.max_steps, int):
            self.warmup_steps = min(1000, max(1, round(0.05 * self.max_steps)))
        if self.learning_rate is None:
            self.learning_rate = self.default_learning_rate()
        collect(self.problems(), ConfigError, "settings", "correct the values above (see --help)")

    def default_learning_rate(self) -> float:
        return 2e-4

    def problems(self) -> list[str]:
        """Every invalid value, so that one run reports them all."""
        found = []
        for name in ("batch_size", "grad_accum", "max_steps", "eval_batches", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                found.append(f"{name} must be a positive integer, got {value!r}")
        for name in ("save_every", "eval_every", "warmup_steps"):
            value = getattr(self, name)
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
        if not isinstance(self.seed, int) or self.seed < 0:
            found.append(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.device not in DEVICES:
            found.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            found.append(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not self.resume:
            found.append("resume must be auto, never or a checkpoint path")
        return found


@dataclass
class PretrainConfig(LoopSettings):
    """`ptbr train`: pretrain a preset from scratch on a tokenized dataset."""

    data: str | None = setting(None, "Dataset directory with train.bin (and val.bin); none: the bundled PT-BR sample.")
    tokenizer: str | None = setting(None, "tokenizer.json (needed for datasets without meta.json).")
    model_size: str = setting("tiny", "Model preset: tiny, 85m, 400m or 800m.")
    seq_len: int = setting(256, "Tokens per training sequence.")

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


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------------------------
# Loading settings from a file and flags
# --------------------------------------------------------------------------------------------

# Keys a recommended_config.json may carry for people, not for the loop.
INFORMATIONAL_KEYS = ("reasons", "_comment")


def settings_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """The settings of `cls` with their resolved types, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _base_type(annotation: Any) -> type:
    """`int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _coerce(name: str, value: Any, annotation: Any, problems: list[str]) -> Any:
    if value is None:
        return None
    kind = _base_type(annotation)
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
    problems.append(f"{name} must be of type {kind.__name__}, got {value!r}")
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML settings file (keys in snake_case)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", "--config", "give the path of an existing JSON or YAML file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot parse config file: {first_line}", str(path), "fix the JSON/YAML syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError("config file must hold a mapping of settings", str(path), "write key: value pairs")
    return data


def build_settings(cls: type, file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                   source: str = "config file") -> Any:
    """Settings from defaults < config file < flags. Unknown keys and wrong types are one error."""
    known = {f.name: hint for f, hint in settings_fields(cls)}
    merged: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in (file_values or {}).items():
        if key in INFORMATIONAL_KEYS:
            continue
        name = key.replace("-", "_")
        if name not in known:
            problems.append(f"unknown key {key!r}")
            continue
        merged[name] = value
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None or k in merged})
    values = {name: _coerce(name, value, known[name], problems) for name, value in merged.items()}
    unknown = [p for p in problems if p.startswith("unknown key")]
    if unknown:
        valid = ", ".join(sorted(known))
        collect(problems, ConfigError, source, f"remove or rename the unknown keys; valid keys: {valid}")
    collect(problems, ConfigError, source, "correct the values above")
    return cls(**values)


def settings_to_dict(settings: Any) -> dict[str, Any]:
    return dataclasses.asdict(settings)
