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
    """Every .txt/.jsonl file named or found (recursively, sorted, hidden ones left out) under the
    given inputs."""
    files: list[Path] = []
    problems = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            # hidden files and folders (.git/, an editor's backups) are not the corpus
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
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
    except UnicodeDecodeError:
        line, byte = _first_invalid_utf8(path)
        raise DataError(f"file is not valid UTF-8 (line {line}, byte {byte:,} of the file)", str(path),
                        "convert it to UTF-8") from None


def _first_invalid_utf8(path: Path) -> tuple[int, int]:
    """Line number and byte offset (from 0) of the first byte that is not UTF-8. Text-mode reading
    decodes in blocks, so its error's offset is within a block, not the file."""
    offset, number = 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return number, offset + exc.start
            offset += len(raw)
    return number, offset  # not reached where the file holds an invalid byte


def _iter_txt(path: Path) -> Iterator[tuple[str, bool]]:
    """Blank-line separated documents; one longer than MAX_CHUNK_CHARS is handed on in pieces, the
    last of which ends it (an empty one where the document ended right after a full piece)."""
    lines: list[str] = []
    size = 0
    unfinished = False  # a piece of a document went out, and its end has not
    continued = False  # the previous read stopped inside a line (a line longer than a piece)
    with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not text
        # at most a piece at a time: a file that is one huge line (no newlines) is not read whole
        for line in iter(lambda: f.readline(MAX_CHUNK_CHARS), ""):
            if "\x00" in line:  # valid UTF-8, but no text holds it: UTF-16 without its byte-order mark
                raise DataError("file holds NUL characters: UTF-16 text without a byte-order mark, or not text",
                                str(path), "convert it to UTF-8 (e.g. iconv -f UTF-16LE -t UTF-8)")
            whole = line.endswith("\n") or len(line) < MAX_CHUNK_CHARS  # the line's end (or the file's)
            blank = not continued and whole and not line.strip()
            continued = not whole
            if blank:
                if lines or unfinished:
                    yield "".join(lines).rstrip("\n"), True
                    lines, size, unfinished = [], 0, False
                continue
            lines.append(line)
            size += len(line)
            if size >= MAX_CHUNK_CHARS:
                # the newline that ends the piece goes with the next one: where the document ends
                # here, it is cut as the end of every document is
                piece = "".join(lines)
                body = piece.rstrip("\n")
                yield body, False
                carry = piece[len(body):]
                lines, size, unfinished = [carry] if carry else [], len(carry), True
    if lines or unfinished:
        yield "".join(lines).rstrip("\n"), True


def _iter_jsonl(path: Path) -> Iterator[tuple[str, bool]]:
    with open(path, encoding="utf-8-sig") as f:
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
