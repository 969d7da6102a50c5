"""`ptbr prepare`: raw .txt/.jsonl -> tokenizer.json, train.bin, val.bin, meta.json (streaming)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from ptbr.config import DEFAULT_VOCAB_SIZE
from ptbr.data import corpus
from ptbr.data.corpus import find_corpus_files, iter_documents, iter_texts
from ptbr.data.tokenizer import PAD_TOKEN, eos_id, load_tokenizer, train_tokenizer
from ptbr.data.tokens import INCOMPLETE_MARKER, dataset_files_in
from ptbr.errors import ConfigError, DataError, OutputError, collect
from ptbr.files import (
    aside,
    file_sha256,
    first_missing,
    fsync,
    read_json,
    remove_empty_folders,
    remove_leftovers,
    unwritable_fix,
    writing,
)
from ptbr.lock import LOCK_FILE, RunLock
from ptbr.outputs import enclosing_run, model_files_in

META_FORMAT = "ptbr-tokens"
DOCS_PER_BATCH = 256
# how much of a long document's previous piece its next piece is encoded after (see _encode)
CONTEXT_CHARS = 64
DATASET_FILES = ("tokenizer.json", "train.bin", "val.bin", "meta.json")
# what only a training run's directory holds (ptbr/runs/common.py RUN_FILES): a dataset never goes there
RUN_MARKERS = ("run_config.json", "checkpoints", "training_summary.json")
# Far beyond any real vocabulary (the largest are ~260k), and what uint32 ids and RAM allow.
MAX_VOCAB_SIZE = 1 << 20
# A trained vocabulary below this share of --vocab-size is reported (the corpus ran out of merges).
FULL_VOCAB_SHARE = 0.9


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (< 65,536), else uint32; always little-endian."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def prepare(inputs: list[str], output: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, val_fraction: float = 0.005,
            tokenizer_path: str | None = None, show_progress: bool | None = None) -> dict:
    """Tokenize a corpus into a dataset directory and return its meta.json contents.

    Everything is written to a staging directory inside `output` first and moved into place at
    the end, meta.json last, with INCOMPLETE_MARKER present while the files are swapped: a crash or
    a full disk never leaves token files that look like a complete dataset."""
    problems = []
    if tokenizer_path and vocab_size != DEFAULT_VOCAB_SIZE:
        _log(f"warning: --vocab-size {vocab_size} is not used with --tokenizer: the dataset has that tokenizer's "
             "vocabulary")
    elif not isinstance(vocab_size, int) or not 300 <= vocab_size <= MAX_VOCAB_SIZE:
        problems.append(f"--vocab-size must be within [300, {MAX_VOCAB_SIZE:,}] (256 bytes + merges), got {vocab_size}")
    if not inputs or any(not str(item).strip() for item in inputs):
        problems.append("--input must name files or directories, got an empty path")
    if not str(output).strip():
        problems.append("--output must be a directory path, got an empty one")
    if not isinstance(val_fraction, float | int) or not 0 <= val_fraction < 1:
        problems.append(f"--val-fraction must be within [0, 1), got {val_fraction}")
    collect(problems, ConfigError, "ptbr prepare", "correct the values (see `ptbr prepare --help`)")
    files = find_corpus_files(inputs)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    output = Path(output)
    _refuse_what_is_not_a_datasets(output)
    for item in inputs:  # the corpus's own folder: the dataset's files would mix with the text files
        source = Path(item).expanduser()
        if source.exists() and (source if source.is_dir() else source.parent).resolve() == output.resolve():
            raise OutputError(f"the output directory is the folder of --input {item}: the dataset would be written "
                              "among the corpus files", str(output),
                              "give the dataset a directory of its own with --output (e.g. data/NAME)")
    made = first_missing(output)  # the topmost folder this command creates (None: it exists)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the output directory: {exc.strerror or exc}", str(output),
                          unwritable_fix(exc)) from exc
    stage = aside(output / "prepare", "tmp")
    lock, finished = None, False
    try:
        lock = RunLock(output).acquire()  # a second prepare into it at once is refused
        remove_leftovers(output)
        if (output / "meta.json").is_file():
            _log(f"replacing the dataset in {output} (its files stay as they are until the new one is complete)")
        with writing("the dataset", output):
            stage.mkdir()
            meta = _write_dataset(files, stage, tokenizer, tokenizer_path, vocab_size, val_fraction, show_progress)
            _swap_in(stage, output)
        finished = True
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if lock is not None:  # a dataset keeps no lock file (one that waits for it is told it went)
            (output / LOCK_FILE).unlink(missing_ok=True)
            lock.release()
            if not finished and made is not None:  # a failed or stopped first prepare leaves no folder behind
                remove_empty_folders(output, made)
    _log(f"wrote {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens ({meta['dtype']}, vocab "
         f"{meta['vocab_size']:,}) to {output}")
    return meta


def _refuse_what_is_not_a_datasets(output: Path) -> None:
    """A dataset replaces tokenizer.json in its --output: never a file, a training run or a folder
    inside one, a model's folder (a run's final/, a base, an adapter), nor a tokenizer's own."""
    fix = "give the dataset a directory of its own with --output (e.g. data/NAME)"
    run = [name for name in RUN_MARKERS if (output / name).exists()]
    if run:
        raise OutputError(f"the output directory holds a training run ({run[0]}), not a dataset", str(output), fix)
    if output.exists() and not output.is_dir():
        raise OutputError("the output path is a file, not a directory", str(output), fix)
    outer = enclosing_run(output)
    if outer is not None:
        raise OutputError(f"the output directory is inside the training run {outer}, among its files", str(output),
                          fix)
    model = model_files_in(output) + [name for name in ("config.json", "adapter_config.json")
                                      if _model_config(output / name)]
    if model:
        raise OutputError(f"the output directory holds a model ({model[0]}), not a dataset: its tokenizer.json would "
                          "be replaced", str(output), fix)
    if (output / "tokenizer.json").exists() and not (output / "meta.json").exists() \
            and not dataset_files_in(output):  # (a first prepare cut mid-swap left its marker: a dataset)
        raise OutputError("the output directory holds a tokenizer.json of its own, not a dataset's: it would be "
                          "replaced", str(output), f"{fix}; a tokenizer to reuse is what --tokenizer names")


def _model_config(path: Path) -> bool:
    """A Hugging Face model's or adapter's config (model_type, architectures, peft_type), not any
    config.json (a user's --config file kept there)."""
    data = read_json(path) or {}
    return any(key in data for key in ("model_type", "architectures", "peft_type"))


def _write_dataset(files: list[Path], stage: Path, tokenizer, tokenizer_path: str | None, vocab_size: int,
                   val_fraction: float, show_progress: bool | None) -> dict:
    tokenizer_file = stage / "tokenizer.json"
    total_bytes = sum(f.stat().st_size for f in files)  # what each progress bar counts up to
    if tokenizer is not None:
        shutil.copyfile(tokenizer_path, tokenizer_file)
    else:
        _log(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {len(files)} file(s)")
        # reading the text is most of the training's time; its merges are computed once all is read
        progress = _progress(total_bytes, show_progress, "training the tokenizer")
        counted = _Counted(iter_texts(files, progress.update),
                           lambda: progress.set_postfix_str("computing the merges", refresh=True))
        try:
            tokenizer = train_tokenizer(counted, vocab_size)
        finally:
            progress.close()
        if not counted.count:
            raise DataError("the inputs hold no text (empty files, blank lines or empty \"text\" fields only)",
                            ", ".join(str(f) for f in files[:3]) + (" ..." if len(files) > 3 else ""),
                            "give .txt files with text, or .jsonl files whose \"text\" fields are not empty")
        tokenizer.save(str(tokenizer_file))
        trained = tokenizer.get_vocab_size()
        if trained < FULL_VOCAB_SHARE * vocab_size:
            _log(f"warning: the trained vocabulary has {trained:,} tokens, far fewer than the {vocab_size:,} "
                 "asked: the corpus has no more pairs of tokens that occur twice (a larger corpus, or a smaller "
                 "--vocab-size, gives a full vocabulary)")
    vocab = tokenizer.get_vocab_size()
    eos = eos_id(tokenizer, tokenizer_path or "the trained tokenizer")
    # "<|endoftext|>" written in a text is text: as its bytes, not the document separator (nor the
    # padding token); set after tokenizer.json is written, so that it stays the tokenizer's default
    tokenizer.encode_special_tokens = True
    dtype = token_dtype(vocab)

    progress = _progress(total_bytes, show_progress, "tokenizing")
    with _SplitWriter(stage, dtype, val_fraction) as writer:
        texts: list[str] = []
        ends: list[bool] = []
        contexts: list[str] = []
        for path in files:
            long_document = False
            context = ""  # the end of the document's previous piece, where the document goes on
            for text, ends_document in iter_documents(path, progress.update):  # (by bytes as they are read)
                if not ends_document and not long_document and path.suffix.lower() == ".txt":
                    long_document = True
                    _log(f"warning: {path} holds a document of more than {corpus.MAX_CHUNK_CHARS:,} characters "
                         "without a blank line: blank lines separate the documents of a .txt (for one document "
                         "per line, write a .jsonl of {\"text\": ...} objects)")
                texts.append(text)
                ends.append(ends_document)
                contexts.append(context)
                context = "" if ends_document else text[-CONTEXT_CHARS:]
                if len(texts) >= DOCS_PER_BATCH:
                    writer.write(_encode(tokenizer, texts, contexts), ends, eos)
                    texts, ends, contexts = [], [], []
            if texts:
                writer.write(_encode(tokenizer, texts, contexts), ends, eos)
                texts, ends, contexts = [], [], []
    progress.close()
    counts, documents = writer.tokens, writer.documents
    if not counts["train"]:
        raise DataError("the inputs hold no text to tokenize", ", ".join(str(f) for f in files[:3]),
                        "give .txt files with text, or .jsonl files whose \"text\" fields are not empty")
    if not counts["val"] and val_fraction > 0:  # the first document always trains, the second goes to val
        _log("warning: the corpus is one document, and the first one always trains: no val.bin written, training "
             "will not evaluate (separate its documents with blank lines, or add text)")
    share = counts["val"] / (counts["train"] + counts["val"])
    if counts["val"] and share > 2 * val_fraction and share - val_fraction > 0.01:
        # whole documents go to val: with few of them, one can be far more than the share asked
        _log(f"warning: val.bin holds {share:.1%} of the tokens, --val-fraction asked {val_fraction:g}: the corpus "
             f"has too few documents ({documents['train'] + documents['val']:,}) for that share to be met by whole "
             "ones (add text, or split it into more documents with blank lines)")
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
    (stage / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for path in stage.iterdir():
        fsync(path)
    return meta


def _encode(tokenizer, texts: list[str], contexts: list[str]) -> list[list[int]]:
    """The ids of each text. A piece of a long document (see corpus.MAX_CHUNK_CHARS) is encoded after
    the end of the piece before it (`contexts`) and keeps only its own tokens: encoded alone, a
    SentencePiece tokenizer (Llama, Mistral) would start it with a word start (`▁`), a space the
    document does not have. (Pieces end where no token spans the cut, corpus._piece_end; where a
    text without spaces was cut and its two sides merge into one token, the piece is encoded alone.)"""
    joined = [context + text for context, text in zip(contexts, texts, strict=True)]
    # the same ids as encode_batch, without the character offsets it also computes (about a fifth
    # of its time: benchmarks/speed.py's data section)
    encoded = [e.ids for e in tokenizer.encode_batch_fast(joined, add_special_tokens=False)]
    for index, (context, text) in enumerate(zip(contexts, texts, strict=True)):
        if context:
            before = tokenizer.encode(context, add_special_tokens=False).ids
            ids = encoded[index]
            encoded[index] = ids[len(before):] if ids[:len(before)] == before else \
                tokenizer.encode(text, add_special_tokens=False).ids
    return encoded


def _swap_in(stage: Path, output: Path) -> None:
    """Move the staged dataset into `output`: the marker first, meta.json last, the marker removed."""
    marker = output / INCOMPLETE_MARKER
    marker.write_text("a `ptbr prepare` into this directory has not finished; run it again\n", encoding="utf-8")
    fsync(output)
    (output / "meta.json").unlink(missing_ok=True)
    for name in DATASET_FILES:
        if name == "meta.json":
            continue
        if (stage / name).exists():
            (stage / name).replace(output / name)
        else:
            (output / name).unlink(missing_ok=True)  # e.g. a val.bin of an earlier dataset
    (stage / "meta.json").replace(output / "meta.json")
    fsync(output)
    marker.unlink()
    fsync(output)


class _Counted:
    """An iterator of texts that counts the non-blank ones it hands on, and calls `at_end` after the last."""

    def __init__(self, texts, at_end=None):
        self.texts, self.count, self.at_end = texts, 0, at_end

    def __iter__(self):
        for text in self.texts:
            if text.strip():
                self.count += 1
            yield text
        if self.at_end is not None:
            self.at_end()


class _SplitWriter:
    """Streams tokenized documents into train.bin / val.bin of the staging directory.

    A document goes to val when, before it, val holds less than its share of the tokens so far:
    the choice never looks at the document itself, so val's documents are a sample of the corpus
    (a rule that weighed each document's length filled val with headings and one-line dialogue).
    The pieces of a very long document follow its first one, except that val takes no more pieces
    once it holds its share: the rest of that document trains (its val part ends with EOS).
    """

    def __init__(self, output: Path, dtype: np.dtype, val_fraction: float):
        self.output, self.dtype, self.val_fraction = output, dtype, val_fraction
        self.tokens = {"train": 0, "val": 0}
        self.documents = {"train": 0, "val": 0}
        self.open_split: str | None = None  # the split of a document whose pieces are still coming

    def __enter__(self):
        self.files = {split: open(self.output / f"{split}.bin", "wb") for split in ("train", "val")}
        return self

    def write(self, encodings: list[list[int]], ends: list[bool], eos: int) -> None:
        for encoding, ends_document in zip(encodings, ends, strict=True):
            ids = encoding + [eos] if ends_document else encoding
            split = self.open_split or self._choose()
            if self.open_split == "val" and not self._val_short():
                self._append("val", [eos], ends_document=True)  # val's part of the document ends here
                split = "train"
            self._append(split, ids, ends_document)
            self.open_split = None if ends_document else split

    def _append(self, split: str, ids: list[int], ends_document: bool) -> None:
        self.files[split].write(np.asarray(ids, dtype=self.dtype).tobytes())
        self.tokens[split] += len(ids)
        self.documents[split] += int(ends_document)

    def _val_short(self) -> bool:
        return self.tokens["val"] < self.val_fraction * (self.tokens["train"] + self.tokens["val"])

    def _choose(self) -> str:
        return "val" if self._val_short() else "train"

    def __exit__(self, *exc) -> None:
        for f in self.files.values():
            f.close()  # a full disk on the last buffered write raises here, inside writing()
        if not self.tokens["val"]:
            (self.output / "val.bin").unlink(missing_ok=True)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _progress(total: int, show: bool | None, what: str):
    """A bar of `total` bytes read, on a terminal (`show` None) or where `show` asks for one."""
    from tqdm import tqdm

    disable = not sys.stderr.isatty() if show is None else not show
    return tqdm(total=total, unit="B", unit_scale=True, desc=what, disable=disable)
