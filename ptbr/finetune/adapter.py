"""OUTPUT/adapters: the best LoRA adapter in its library's format (PEFT for torch, mlx-lm for MLX),
with the tokenizer it was trained with (chat template included) and ptbr_adapter.json (data
format, step, val_loss)."""

from __future__ import annotations

import json
from pathlib import Path

from ptbr.files import write_directory

ADAPTER_META = "ptbr_adapter.json"


def save_adapter(backend, adapted, tokenizer, directory: Path, meta: dict) -> None:
    """Write the adapter aside, then swap it in: a crash or a full disk leaves the previous one."""

    def fill(tmp: Path) -> None:
        backend.write_adapter(adapted, tmp)
        tokenizer.save_pretrained(str(tmp))
        (tmp / ADAPTER_META).write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")

    write_directory(directory, fill, "the adapter")


def read_adapter_meta(directory: str | Path) -> dict:
    """ptbr_adapter.json of an adapter directory; {} for adapters ptbr did not write."""
    try:
        meta = json.loads((Path(directory) / ADAPTER_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}
