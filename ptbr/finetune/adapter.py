"""OUTPUT/adapters: the best LoRA adapter in PEFT format, with the tokenizer it was trained with
(chat template included) and ptbr_adapter.json (data format, step, val_loss)."""

from __future__ import annotations

import json
from pathlib import Path

from ptbr.log import log
from ptbr.train.atomic import write_directory
from ptbr.train.loop import Callbacks, LoopState
from ptbr.train.run_dir import write_json

ADAPTER_META = "ptbr_adapter.json"


def save_adapter(model, tokenizer, directory: Path, meta: dict) -> None:
    """Write the adapter aside, then swap it in: a crash leaves the previous one."""

    def fill(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        write_json(tmp / ADAPTER_META, meta)

    write_directory(directory, fill, "the adapter")


def read_adapter_meta(directory: str | Path) -> dict:
    """ptbr_adapter.json of an adapter directory; {} for adapters ptbr did not write."""
    try:
        return json.loads((Path(directory) / ADAPTER_META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


class KeepBestAdapter(Callbacks):
    """on_eval: whenever the validation loss is the best so far, write the adapter to OUTPUT/adapters."""

    def __init__(self, directory: Path, model, tokenizer, meta: dict):
        self.directory, self.model, self.tokenizer, self.meta = directory, model, tokenizer, meta

    def on_eval(self, state: LoopState, val_loss: float, is_best: bool) -> None:
        if is_best:
            self.save(state.step, val_loss)
            log(f"best val_loss so far: adapter of step {state.step} saved to {self.directory}")

    def save(self, step: int, val_loss: float | None) -> None:
        save_adapter(self.model, self.tokenizer, self.directory, self.meta | {"step": step, "val_loss": val_loss})
