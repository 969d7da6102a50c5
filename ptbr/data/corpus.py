"""Reading raw text corpora as a stream of documents: .txt (blank-line separated) and .jsonl."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from ptbr.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl")
# A document longer than this is handed on in pieces, so no single string outgrows memory.
MAX_CHUNK_CHARS = 1 << 20


def find_corpus_files(inputs: list[str]) -> list[Path]:
    """Every .txt/.jsonl file named or found (recursively, sorted) under the given inputs."""
    files: list[Path] = []
    problems = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                problems.append(f"no .txt or .jsonl files in directory {path}")
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in TEXT_SUFFIXES:
                problems.append(f"{path} is neither .txt nor .jsonl")
            else:
                files.append(path)
        else:
            problems.append(f"input not found: {path}")
    if problems:
        raise DataError("; ".join(problems), "--input", "give .txt files, .jsonl files with a \"text\" field, or directories of them")
    unique: dict[Path, list[Path]] = {}
    for path in files:
        unique.setdefault(path.resolve(), []).append(path)
    repeated = sum(len(named) > 1 for named in unique.values())
    if repeated:
        # named twice, or named and inside a directory also named: its documents would be counted
        # twice, and could land in both train.bin and val.bin
        print(f"warning: --input names {repeated} file(s) more than once (directly or inside a directory also "
              "given): each is read once", file=sys.stderr, flush=True)
    return [named[0] for named in unique.values()]


def iter_documents(path: Path) -> Iterator[tuple[str, bool]]:
    """Yield (text, ends_document) pieces of one file, reading it line by line.

    .txt: documents are separated by blank lines. .jsonl: one document per line, its "text" field.
    """
    try:
        if path.suffix.lower() == ".jsonl":
            yield from _iter_jsonl(path)
        else:
            yield from _iter_txt(path)
    except UnicodeDecodeError as exc:
        raise DataError(f"file is not valid UTF-8 (byte {exc.start})", str(path), "convert it to UTF-8") from exc


def _iter_txt(path: Path) -> Iterator[tuple[str, bool]]:
    lines: list[str] = []
    size = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                if lines:
                    yield "".join(lines).rstrip("\n"), True
                    lines, size = [], 0
                continue
            lines.append(line)
            size += len(line)
            if size >= MAX_CHUNK_CHARS:
                yield "".join(lines), False
                lines, size = [], 0
    if lines:
        yield "".join(lines).rstrip("\n"), True


def _iter_jsonl(path: Path) -> Iterator[tuple[str, bool]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"line is not valid JSON: {exc.msg}", f"{path}:{number}", "fix or remove that line") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError('line has no string "text" field', f"{path}:{number}",
                                'write one {"text": "..."} object per line')
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError('"text" holds invalid Unicode (an unpaired surrogate escape such as \\ud800)',
                                f"{path}:{number}", "fix or remove that line") from None
            if text.strip():
                yield text, True


def iter_texts(files: list[Path]) -> Iterator[str]:
    """Plain text pieces of every file, for tokenizer training."""
    for path in files:
        for text, _ in iter_documents(path):
            yield text
