"""Token datasets on disk (train.bin/val.bin memmaps) and the batches sampled from them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ptbr.data.batch import Batch, windows_to_batch
from ptbr.data.tokenizer import eos_id, load_tokenizer
from ptbr.errors import DataError
from ptbr.files import file_sha256, unreadable, unreadable_fix

# The token files' element types (little-endian), as meta.json names them.
TOKEN_DTYPES = ("uint16", "uint32")
# Present while `ptbr prepare` swaps a dataset's files in (ptbr/data/prepare.py).
INCOMPLETE_MARKER = ".prepare-incomplete"
# Tokens scanned for the max id when a dataset has no meta.json; every batch is checked anyway.
QUICK_SCAN_TOKENS = 1 << 22


@dataclass
class TokenDataset:
    """A dataset directory: train.bin (+ val.bin), its tokenizer and what meta.json says."""

    directory: Path
    tokenizer_path: Path
    dtype: np.dtype
    vocab_size: int
    eos_id: int
    meta: dict | None
    train: np.memmap
    val: np.memmap | None
    warnings: list[str] = field(default_factory=list)

    @property
    def train_path(self) -> Path:
        return self.directory / "train.bin"

    @property
    def val_path(self) -> Path:
        return self.directory / "val.bin"

    def fingerprint(self) -> str:
        """What identifies train.bin for resuming: its size and the sha256 of three 1 MiB samples
        of it (start, middle, end), so that even a corpus of many GB is identified in milliseconds."""
        size = self.train_path.stat().st_size
        digest = hashlib.sha256(str(size).encode())
        block = 1 << 20
        with open(self.train_path, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - block // 2), max(0, size - block)}):
                f.seek(offset)
                digest.update(f.read(block))
        return digest.hexdigest()[:16]

    def max_token_id(self, split: str = "train", chunk: int = 1 << 24) -> int:
        tokens = self.train if split == "train" else self.val
        if tokens is None or len(tokens) == 0:
            return -1
        return int(max(tokens[i:i + chunk].max() for i in range(0, len(tokens), chunk)))


def dataset_files_in(directory: str | Path) -> list[str]:
    """The files that make `directory` a `ptbr prepare` dataset (finished or not): none for others."""
    return [name for name in ("train.bin", INCOMPLETE_MARKER) if (Path(directory) / name).exists()]


def holds_finetuning_data(directory: str | Path) -> bool:
    """A directory of fine-tuning data (train.jsonl) given where a pretraining dataset goes."""
    directory = Path(directory)
    return (directory / "train.jsonl").is_file() and not (directory / "train.bin").exists()


def refuse_unreadable(where: Path, paths: list[Path]) -> None:
    """A dataset's files this process may not read (a container's user, another user's 0600 files):
    one line naming them, not a crash on the first one opened."""
    blocked = unreadable([where]) or unreadable(paths)  # (a folder it cannot enter: the folder alone)
    if blocked:
        names = ", ".join(str(p) if p == where or where not in p.parents else p.name for p in blocked)
        raise DataError(f"cannot read {names}: permission denied", str(where), unreadable_fix())


def open_dataset(directory: str | Path, tokenizer: str | Path | None = None) -> TokenDataset:
    """Open and check a dataset directory, in the ptbr layout (meta.json) or the older one
    (raw uint16 train.bin and a tokenizer.json given with --tokenizer). All problems in one error."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "not found"
        fix = "give the directory written by `ptbr prepare` (train.bin, val.bin, meta.json)"
        if directory.is_file() and directory.suffix == ".bin":
            fix = f"give the directory that holds it: --data {directory.parent}"
        elif directory.is_file() and directory.suffix == ".jsonl":
            fix = ("a .jsonl is fine-tuning data (`ptbr finetune --data`); to pretrain on its texts, run "
                   f"`ptbr prepare --input {directory} --output DIR` first")
        raise DataError(f"data directory {what}: {directory}", "--data", fix)
    refuse_unreadable(directory, [*(directory / name for name in ("train.bin", "val.bin", "meta.json", "tokenizer.json")),
                                  *([Path(tokenizer)] if tokenizer else [])])
    if (directory / INCOMPLETE_MARKER).exists():
        raise DataError("a `ptbr prepare` into this directory did not finish: its files are incomplete", str(directory),
                        "run the same `ptbr prepare` again")
    train_path = directory / "train.bin"
    if not train_path.is_file():
        fix = "run `ptbr prepare --input TEXTS --output DIR` first"
        if holds_finetuning_data(directory):
            fix = ("this is fine-tuning data (train.jsonl): `ptbr finetune --data` and `ptbr validate-data` take it; "
                   "to pretrain on it, run `ptbr prepare --input TEXTS --output DIR` first")
        raise DataError("no train.bin in the data directory", str(directory), fix)
    meta = _read_meta(directory)
    tokenizer_path = Path(tokenizer) if tokenizer else directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        if tokenizer:
            what = "is a directory, not a tokenizer.json" if tokenizer_path.is_dir() else "not found"
            raise DataError(f"tokenizer {what}: {tokenizer_path}", "--tokenizer", "give an existing tokenizer.json")
        raise DataError(f"no tokenizer.json file in the data directory: {tokenizer_path}", str(directory),
                        "give --tokenizer FILE (datasets in the older layout have no tokenizer.json)")
    tok = load_tokenizer(tokenizer_path)
    vocab_size = tok.get_vocab_size()
    problems: list[str] = []
    warnings: list[str] = []
    if meta is not None:
        dtype = np.dtype(meta.get("dtype", "uint16")).newbyteorder("<")  # one of TOKEN_DTYPES (_read_meta)
        if meta.get("vocab_size") != vocab_size:
            problems.append(f"meta.json says vocab_size {meta.get('vocab_size')} but the tokenizer has {vocab_size}")
        sha = meta.get("tokenizer_sha256")
        if sha and sha != file_sha256(tokenizer_path):
            problems.append(f"meta.json was written with a different tokenizer than {tokenizer_path} (sha256 differs)")
    else:
        dtype = np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")
        warnings.append(f"no meta.json: older layout, assuming {dtype.name} tokens for a {vocab_size}-token vocab")

    def load(path: Path) -> np.memmap | None:
        if not path.is_file():
            return None
        size = path.stat().st_size
        if size % dtype.itemsize:
            problems.append(f"{path.name} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype.name} tokens): "
                            "the file is truncated or not a token file")
            return None
        if size == 0:
            problems.append(f"{path.name} is empty")
            return None
        return np.memmap(path, dtype=dtype, mode="r")

    train = load(train_path)
    val = load(directory / "val.bin")
    for split, tokens in (("train", train), ("val", val)):  # cut short (or grown) since `ptbr prepare`
        said = meta.get(f"{split}_tokens") if meta is not None else None
        if said is not None and tokens is not None and said != len(tokens):
            problems.append(f"meta.json says {said} {split} tokens but {split}.bin holds {len(tokens)}")
    if meta is None and train is not None:
        head = np.asarray(train[:QUICK_SCAN_TOKENS])
        if int(head.max()) >= vocab_size:
            offset = int(np.argmax(head >= vocab_size))
            problems.append(f"train.bin holds token id {int(head[offset])} >= vocab size {vocab_size} at token "
                            f"offset {offset}: wrong tokenizer or wrong dtype")
    if problems:
        tokenizer_said = any("tokenizer" in problem or "token id" in problem for problem in problems)
        raise DataError("; ".join(problems), str(directory),
                        "re-run `ptbr prepare`" + (", or pass the tokenizer the data was made with" if tokenizer_said
                                                  else " (the files are cut short or changed since)"))
    return TokenDataset(directory, tokenizer_path, dtype, vocab_size, eos_id(tok, tokenizer_path), meta, train, val, warnings)


def _read_meta(directory: Path) -> dict | None:
    path = directory / "meta.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"meta.json is not valid JSON: {exc}", str(path), "re-run `ptbr prepare`") from exc
    if not isinstance(meta, dict):
        raise DataError("meta.json must hold an object", str(path), "re-run `ptbr prepare`")
    problems = []
    if meta.get("dtype", "uint16") not in TOKEN_DTYPES:
        problems.append(f"dtype must be one of {', '.join(TOKEN_DTYPES)}, got {meta.get('dtype')!r}")
    for key in ("vocab_size", "train_tokens", "val_tokens", "eos_id"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            problems.append(f"{key} must be a whole number, got {value!r}")
    if meta.get("tokenizer_sha256") is not None and not isinstance(meta["tokenizer_sha256"], str):
        problems.append(f"tokenizer_sha256 must be a string, got {meta['tokenizer_sha256']!r}")
    if problems:
        raise DataError("meta.json is malformed: " + "; ".join(problems), str(path), "re-run `ptbr prepare`")
    return meta


def val_too_short(val_tokens: int, seq_len: int) -> str | None:
    """Why a val.bin of `val_tokens` tokens gives no evaluation window at seq_len (None: it does,
    or there is none)."""
    if 0 < val_tokens < seq_len + 1:
        return f"val.bin holds {val_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}"
    return None


def describe(dataset: TokenDataset) -> dict:
    """What `ptbr info --data` prints: sizes, dtype, vocab, max id, problems."""
    info = {
        "directory": str(dataset.directory),
        "layout": "ptbr (meta.json)" if dataset.meta else "older (no meta.json)",
        "tokenizer": str(dataset.tokenizer_path),
        "dtype": dataset.dtype.name,
        "vocab_size": dataset.vocab_size,
        "eos_id": dataset.eos_id,
        "problems": [],
        "warnings": list(dataset.warnings),
    }
    for split, tokens, path in (("train", dataset.train, dataset.train_path), ("val", dataset.val, dataset.val_path)):
        if tokens is None:
            info[f"{split}_tokens"] = 0
            continue
        top = dataset.max_token_id(split)
        info[f"{split}_tokens"] = len(tokens)
        info[f"{split}_bytes"] = path.stat().st_size
        info[f"{split}_max_id"] = top
        if top >= dataset.vocab_size:
            info["problems"].append(f"{split}.bin holds id {top} >= vocab size {dataset.vocab_size}")
    if dataset.val is None:
        info["warnings"].append("no val.bin: training will not evaluate")
    return info


class RandomWindows:
    """Training batches: random windows of seq_len + 1 tokens, read from the memmap.

    Batch k is a pure function of (seed, k), so the sampler's whole state is one integer and a
    resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(self, tokens: np.memmap, path: Path, batch_size: int, seq_len: int, vocab_size: int, seed: int):
        if len(tokens) < seq_len + 1:
            raise DataError(f"{path.name} holds {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}",
                            str(path), "lower --seq-len or add data")
        self.tokens, self.path = tokens, path
        self.batch_size, self.seq_len, self.vocab_size, self.seed = batch_size, seq_len, vocab_size, seed

    def starts(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def batch(self, index: int) -> np.ndarray:
        """(batch_size, seq_len + 1) int64 token windows, checked."""
        return read_windows(self.tokens, self.path, self.starts(index), self.seq_len, self.vocab_size)


def eval_windows(tokens: np.memmap, path: Path, batch_size: int, seq_len: int, vocab_size: int,
                 max_batches: int, windows: int | None = None) -> list[np.ndarray]:
    """A fixed set of validation windows, evenly spaced, the same at every evaluation: `windows` of
    them (default max_batches * batch_size), at most one per seq_len tokens, in batches of batch_size."""
    span = len(tokens) - seq_len
    if span <= 0:
        return []
    count = min(windows if windows is not None else max_batches * batch_size, max(1, span // seq_len))
    starts = np.linspace(0, span - 1, num=count).astype(np.int64)
    return [read_windows(tokens, path, starts[i:i + batch_size], seq_len, vocab_size)
            for i in range(0, count, batch_size)]


def read_windows(tokens: np.memmap, path: Path, starts: np.ndarray, seq_len: int, vocab_size: int) -> np.ndarray:
    if len(starts) == 0:
        raise DataError("empty batch", str(path), "check --batch-size and the data")
    windows = np.stack([np.asarray(tokens[s:s + seq_len + 1]) for s in starts]).astype(np.int64)
    if windows.shape[1] != seq_len + 1:
        raise DataError(f"batch of wrong length {windows.shape[1]} (expected {seq_len + 1})", str(path),
                        "the token file is shorter than expected; re-run `ptbr prepare`")
    bad = np.argwhere(windows >= vocab_size)
    if len(bad):
        row, col = bad[0]
        offset = int(starts[row]) + int(col)
        raise DataError(f"token id {int(windows[row, col])} >= vocab size {vocab_size}",
                        f"{path} at token offset {offset} (byte {offset * tokens.dtype.itemsize})",
                        "the data was made with another tokenizer; re-run `ptbr prepare` or pass the right --tokenizer")
    return windows


class PretrainBatches:
    """The micro-batches of each optimizer step: batch_size * grad_accum * world windows drawn
    together for that step, then split. A batch of 8 x grad_accum 1 and 2 x grad_accum 4 therefore
    see the same sequences, and the step's batches are a pure function of (seed, step).

    In a data-parallel run of `world` processes, each global micro-batch of batch_size * world
    windows is cut into one slice per rank: 2 processes x batch 2 train on exactly the windows of
    1 process x batch 4."""

    def __init__(self, dataset: TokenDataset, batch_size: int, grad_accum: int, seq_len: int, seed: int,
                 rank: int = 0, world: int = 1):
        self.batch_size, self.grad_accum, self.rank, self.world = batch_size, grad_accum, rank, world
        self.windows = RandomWindows(dataset.train, dataset.train_path, batch_size * grad_accum * world, seq_len,
                                     dataset.vocab_size, seed)

    def describe(self, step: int) -> str:
        """Where step `step`'s windows come from, for diagnostics."""
        starts = self.windows.starts(step)
        shown = ", ".join(str(int(s)) for s in starts[:4]) + (", ..." if len(starts) > 4 else "")
        return f"{self.windows.path} at token offsets [{shown}] (seq_len {self.windows.seq_len})"

    def cycle(self, step: int) -> list[Batch]:
        windows = self.windows.batch(step)  # (batch_size * grad_accum * world, seq_len + 1)
        micro = self.batch_size * self.world  # one global micro-batch; this rank's slice of each
        first = self.rank * self.batch_size
        return [windows_to_batch(windows[i + first:i + first + self.batch_size])
                for i in range(0, len(windows), micro)]
