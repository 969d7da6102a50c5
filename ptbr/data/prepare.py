"""`ptbr prepare`: raw .txt/.jsonl -> tokenizer.json, train.bin, val.bin, meta.json (streaming)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from ptbr.data.corpus import find_corpus_files, iter_documents, iter_texts
from ptbr.data.tokenizer import PAD_TOKEN, eos_id, file_sha256, load_tokenizer, train_tokenizer
from ptbr.errors import ConfigError, OutputError

META_FORMAT = "ptbr-tokens"
DOCS_PER_BATCH = 256


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (< 65,536), else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def prepare(inputs: list[str], output: str | Path, vocab_size: int = 32000, val_fraction: float = 0.005,
            tokenizer_path: str | None = None, show_progress: bool | None = None) -> dict:
    """Tokenize a corpus into a dataset directory and return its meta.json contents."""
    problems = []
    if vocab_size < 300:
        problems.append(f"--vocab-size must be at least 300 (256 bytes + merges), got {vocab_size}")
    if not 0 <= val_fraction < 1:
        problems.append(f"--val-fraction must be within [0, 1), got {val_fraction}")
    if problems:
        raise ConfigError("; ".join(problems), "ptbr prepare", "correct the values")
    files = find_corpus_files(inputs)
    output = Path(output)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output directory: {exc.strerror}", str(output), "choose a writable path") from exc

    tokenizer_file = output / "tokenizer.json"
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
        if Path(tokenizer_path).resolve() != tokenizer_file.resolve():
            shutil.copyfile(tokenizer_path, tokenizer_file)
    else:
        _log(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {len(files)} file(s)")
        tokenizer = train_tokenizer(iter_texts(files), vocab_size)
        tokenizer.save(str(tokenizer_file))
    vocab = tokenizer.get_vocab_size()
    eos = eos_id(tokenizer)
    dtype = token_dtype(vocab)

    total_bytes = sum(f.stat().st_size for f in files)
    progress = _progress(total_bytes, show_progress)
    with _SplitWriter(output, dtype, val_fraction) as writer:
        texts: list[str] = []
        ends: list[bool] = []
        for path in files:
            for text, ends_document in iter_documents(path):
                texts.append(text)
                ends.append(ends_document)
                if len(texts) >= DOCS_PER_BATCH:
                    writer.write(tokenizer.encode_batch(texts, add_special_tokens=False), ends, eos)
                    texts, ends = [], []
            if texts:
                writer.write(tokenizer.encode_batch(texts, add_special_tokens=False), ends, eos)
                texts, ends = [], []
            progress.update(path.stat().st_size)
    progress.close()
    counts, documents = writer.tokens, writer.documents
    if not counts["val"] and val_fraction > 0:
        _log(f"warning: the corpus is too small for --val-fraction {val_fraction}: no val.bin written, "
             "training will not evaluate (raise --val-fraction or add text)")
    meta = {
        "format": META_FORMAT,
        "version": 1,
        "dtype": dtype.name,
        "byte_order": "little",
        "vocab_size": vocab,
        "eos_id": eos,
        "pad_id": tokenizer.token_to_id(PAD_TOKEN),
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "train_documents": documents["train"],
        "val_documents": documents["val"],
        "tokenizer_sha256": file_sha256(tokenizer_file),
        "sources": [str(f) for f in files],
    }
    (output / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    _log(f"wrote {counts['train']:,} train and {counts['val']:,} val tokens ({dtype.name}) to {output}")
    return meta


class _SplitWriter:
    """Streams tokenized documents into train.bin / val.bin (written as .tmp, renamed at the end).

    A document goes to val while val is short of its share of tokens (rounded to the nearest
    document); the pieces of a very long document all go where its first piece went.
    """

    def __init__(self, output: Path, dtype: np.dtype, val_fraction: float):
        self.output, self.dtype, self.val_fraction = output, dtype, val_fraction
        self.tokens = {"train": 0, "val": 0}
        self.documents = {"train": 0, "val": 0}
        self.open_split: str | None = None  # the split of a document whose pieces are still coming

    def __enter__(self):
        self.files = {split: open(self.output / f"{split}.bin.tmp", "wb") for split in ("train", "val")}
        return self

    def write(self, encodings, ends: list[bool], eos: int) -> None:
        for encoding, ends_document in zip(encodings, ends, strict=True):
            ids = encoding.ids + [eos] if ends_document else encoding.ids
            split = self.open_split or self._choose(len(ids))
            self.files[split].write(np.asarray(ids, dtype=self.dtype).tobytes())
            self.tokens[split] += len(ids)
            self.documents[split] += int(ends_document)
            self.open_split = None if ends_document else split

    def _choose(self, length: int) -> str:
        total = self.tokens["train"] + self.tokens["val"] + length
        return "val" if self.tokens["val"] + length / 2 < self.val_fraction * total else "train"

    def __exit__(self, exc_type, *exc) -> None:
        for f in self.files.values():
            f.close()
        if exc_type is not None:
            for split in self.files:
                (self.output / f"{split}.bin.tmp").unlink(missing_ok=True)
            return
        (self.output / "train.bin.tmp").replace(self.output / "train.bin")
        if self.tokens["val"]:
            (self.output / "val.bin.tmp").replace(self.output / "val.bin")
        else:
            (self.output / "val.bin.tmp").unlink()
            (self.output / "val.bin").unlink(missing_ok=True)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(total: int, show: bool | None):
    from tqdm import tqdm

    disable = not sys.stderr.isatty() if show is None else not show
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=disable)
