"""Reading raw text corpora as a stream of documents: .txt (blank-line separated) and .jsonl."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ptbr.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl")
# A document longer than this is handed on in pieces, so no single string outgrows memory.
MAX_CHUNK_CHARS = 1 << 20
# Where a piece of a long document ends: just before a space that follows a character that is not
# whitespace. No token spans that place: a byte-level BPE's pre-tokenizer (GPT-2's, Llama 3's) starts
# a new pre-token at such a space, and no SentencePiece token (Llama's, Mistral's) holds a `▁` after
# another character, so the pieces' tokens are the whole text's (tests/test_real_tokenizer.py).
_PIECE_END = re.compile(r"(?s).*\S(?= )")
# Byte-order marks, longest first (UTF-32-LE's begins with UTF-16-LE's): a file that starts with
# one is that encoding, not UTF-8 (UTF-8's own mark is skipped as text is read)
_BYTE_ORDER_MARKS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                     (b"\xfe\xff", "UTF-16"))
# The least a file is read in at a time (bytes).
READ_BLOCK = 64 * 1024
# How much of a file's start is looked at for UTF-16 written without its byte-order mark.
_HEAD_BYTES = 4096


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


def iter_documents(path: Path, on_read: Callable[[int], None] | None = None) -> Iterator[tuple[str, bool]]:
    """Yield (text, ends_document) pieces of one file, reading it line by line; `on_read` is given
    the number of bytes of each block read from the file (a progress bar's update).

    .txt: documents are separated by blank lines. .jsonl: one document per line, its "text" field.
    """
    _refuse_what_is_not_utf8(path)
    try:
        if path.suffix.lower() == ".jsonl":
            yield from _iter_jsonl(path, on_read)
        else:
            yield from _iter_txt(path, on_read)
    except UnicodeDecodeError:
        line, byte = _first_invalid_utf8(path)
        # Portuguese text that is not UTF-8 is most often Windows' Latin-1 (Windows-1252, ISO-8859-1's superset)
        raise DataError(f"file is not valid UTF-8 (line {line}, byte {byte:,} of the file)", str(path),
                        _conversion_fix(path, "WINDOWS-1252", " if it is Windows or Latin-1 text, as `file -i` "
                                        "may tell")) from None


def _conversion_fix(path: Path, encoding: str, where: str = "") -> str:
    converted = path.with_name(f"{path.stem}.utf8{path.suffix}")
    return f"convert it to UTF-8 (e.g. iconv -f {encoding} -t UTF-8 {path} > {converted}{where}, then give that file)"


def _refuse_what_is_not_utf8(path: Path) -> None:
    """UTF-16 or UTF-32 told by its byte-order mark, and UTF-16 without one: a NUL byte beside most
    characters (ASCII and Latin letters, UTF-16's first 256, have one), valid UTF-8 though no text."""
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
    for mark, encoding in _BYTE_ORDER_MARKS:
        if head.startswith(mark):
            raise DataError(f"file is {encoding} (byte-order mark), not UTF-8", str(path),
                            _conversion_fix(path, encoding))
    pairs = len(head) // 2
    even, odd = head[0:2 * pairs:2].count(0), head[1:2 * pairs:2].count(0)
    for nuls, others, encoding in ((odd, even, "UTF-16LE"), (even, odd, "UTF-16BE")):
        if pairs and nuls > pairs / 2 and others <= pairs / 10:
            raise DataError(f"file is {encoding} without a byte-order mark (a NUL byte beside most characters), not "
                            "UTF-8", str(path), _conversion_fix(path, encoding))


def _open_text(path: Path, on_read: Callable[[int], None] | None):
    """`path` opened as open(path, encoding="utf-8-sig") does (-sig: a byte-order mark is not text),
    with `on_read` told of every block read from the file."""
    raw = open(path, "rb", buffering=0)  # noqa: SIM115 - closed with the text file wrapped around it
    # blocks of the file system's size (large on network mounts such as Kaggle's /kaggle/input), at
    # least READ_BLOCK: fewer reads, and fewer progress updates
    block = max(os.fstat(raw.fileno()).st_blksize, READ_BLOCK)
    return io.TextIOWrapper(io.BufferedReader(_Counting(raw, on_read) if on_read else raw, buffer_size=block),
                            encoding="utf-8-sig")


class _Counting(io.RawIOBase):
    """A file read in binary, whose every block read is counted in bytes."""

    def __init__(self, raw, on_read: Callable[[int], None]):
        self.raw, self.on_read = raw, on_read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self.raw.readinto(buffer)
        if count:
            self.on_read(count)
        return count

    def close(self) -> None:
        self.raw.close()
        super().close()


def _first_nul(path: Path) -> tuple[int, int]:
    """Line number and byte offset (from 0) of the first NUL byte."""
    offset, number = 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if b"\x00" in raw:
                return number, offset + raw.index(0)
            offset += len(raw)
    return number, offset  # not reached where the file holds a NUL


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


def _iter_txt(path: Path, on_read: Callable[[int], None] | None) -> Iterator[tuple[str, bool]]:
    """Blank-line separated documents; one longer than MAX_CHUNK_CHARS is handed on in pieces
    (_piece_end says where each ends), the last of which ends it (an empty one where the document
    ended right after a full piece)."""
    lines: list[str] = []
    size = 0
    unfinished = False  # a piece of a document went out, and its end has not
    continued = False  # the previous read stopped inside a line (a line longer than a piece)
    with _open_text(path, on_read) as f:
        # at most a piece at a time: a file that is one huge line (no newlines) is not read whole
        for line in iter(lambda: f.readline(MAX_CHUNK_CHARS), ""):
            if "\x00" in line:  # valid UTF-8 (UTF-16 without its byte-order mark was told apart before)
                number, byte = _first_nul(path)
                raise DataError(f"file holds a NUL character (line {number}, byte {byte:,} of the file), which no text "
                                "holds: the file is refused, not cleaned", str(path),
                                f"remove the NUL characters (e.g. tr -d '\\000' < {path} > "
                                f"{path.with_name(path.stem + '.clean' + path.suffix)}, then give that file)")
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
                piece = "".join(lines)
                end = _piece_end(piece)
                yield piece[:end], False
                carry = piece[end:]  # (no place to end a piece in it: it waits for more text)
                lines, size, unfinished = [carry] if carry else [], len(carry), True
    if lines or unfinished:
        yield "".join(lines).rstrip("\n"), True


def _piece_end(piece: str) -> int:
    """Where a piece of a long document ends: before its last space that follows a character that
    is not whitespace (_PIECE_END), so that the pieces' tokens are the whole text's. Where it has
    none (a run of text without spaces), before its trailing whitespace: exact for byte-level BPE
    and SentencePiece where that is a newline after a letter; elsewhere, at its end, whose token
    may differ from the whole text's. The whitespace cut off goes with the next piece: where the
    document ends there, it is cut as the end of every document is."""
    found = _PIECE_END.match(piece)
    if found:
        return found.end()
    return len(piece.rstrip()) or len(piece)


def _iter_jsonl(path: Path, on_read: Callable[[int], None] | None) -> Iterator[tuple[str, bool]]:
    with _open_text(path, on_read) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\n"))  # (a newline inside an unfinished string: "Invalid control")
            except json.JSONDecodeError as exc:
                raise DataError(f"line is not valid JSON: {json_problem(exc)}", f"{path}:{number}",
                                "fix or remove that line") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError('line has no string "text" field', f"{path}:{number}",
                                'write one {"text": "..."} object per line')
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError('"text" holds invalid Unicode (an unpaired surrogate escape such as \\ud800)',
                                f"{path}:{number}", "fix or remove that line") from None
            if "\x00" in text:  # refused, as in a .txt
                raise DataError('"text" holds a NUL character (\\u0000), which no text holds: the line is refused, '
                                "not cleaned", f"{path}:{number}", "remove the \\u0000 from that line")
            if text.strip():
                yield text, True


def json_problem(exc: json.JSONDecodeError) -> str:
    """What is wrong with a line of JSON and at which column: "Unterminated string starting at
    column 43" (json's own messages that end in "at" expect the position after them)."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def iter_texts(files: list[Path], on_read: Callable[[int], None] | None = None) -> Iterator[str]:
    """Plain text pieces of every file, for tokenizer training (`on_read`: see iter_documents)."""
    for path in files:
        for text, _ in iter_documents(path, on_read):
            yield text
