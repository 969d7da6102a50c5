"""Every file ptbr writes goes through here: whole directories and single files are written aside,
fsynced, then swapped in, and a full disk, a file-size limit or a quota is one OutputError (exit 6)
that says the previous version is intact, whichever library was writing (Python, torch.save,
safetensors, tokenizers, MLX).

Checkpoints, the final model, adapters, merged models, token datasets, metrics, reports, run
configs and summaries all use these functions, so a crash or a full disk at any moment leaves the
previous version of each, never a half-written one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ptbr.errors import OutputError
from ptbr.versions import image_variant

# Prefixes of what a write in progress puts beside its target; a crash can leave them behind.
# ptbr's own names for what it writes aside (tmp) or moves aside (old): `.tmp-NAME.ptbr-PID`, a
# name no file of the user's has, so that remove_leftovers never takes one (a `.old-corpus-2023/`)
_LEFTOVER = re.compile(r"\.(tmp|old)-(.+)\.ptbr-[0-9]+")
# what ptbr before 2026-11-27 wrote aside, `.tmp-NAME-PID`: only for the names it wrote (a crash's
# partial checkpoint of gigabytes would otherwise stay for good)
_OLDER_LEFTOVER = re.compile(r"\.(tmp|old)-(step_[0-9]+|final|adapters|merged|prepare|write-test|run_config\.json|"
                             r"training_summary\.json|metrics\.jsonl|metrics\.csv|report\.md|plots|meta\.json|"
                             r"tokenizer\.json|train\.bin|val\.bin)-[0-9]+")


def aside(path: Path, kind: str) -> Path:
    """The hidden name beside `path` under which this process writes it first (kind "tmp") or
    moves its previous version before removing it ("old")."""
    return Path(path).with_name(f".{kind}-{Path(path).name}.ptbr-{os.getpid()}")


def written_aside(name: str) -> str | None:
    """NAME, where `name` is what ptbr writes aside for NAME (`.tmp-NAME.ptbr-PID`), else None."""
    found = _LEFTOVER.fullmatch(name)
    return found.group(2) if found is not None and found.group(1) == "tmp" else None

OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# How libraries that hide the errno report the same thing: safetensors (Rust) keeps the OS text,
OUT_OF_SPACE_TEXT = re.compile(
    r"no space left|file too large|quota exceeded|os error (28|27|122)\b|StorageFull|FileTooLarge", re.IGNORECASE)
# while torch.save's C++ writer ("unexpected pos ...") and MLX's (mx.save_safetensors: "[write] Unable to write N
# bytes to file.", or "[save_safetensors] Failed to open file F" where a quota refuses a new file) only say that
# they could not write: a full disk where little space is left or a file size limit is set, and an I/O error, a
# quota or a file system gone read-only elsewhere. By the library that wrote, as the message names it.
WRITE_FAILED_TEXT = {
    "torch": re.compile(r"unexpected pos|PytorchStreamWriter failed", re.IGNORECASE),
    "MLX": re.compile(r"\[write\] Unable to write|\[save(_safetensors)?\] Failed to open", re.IGNORECASE),
}
LOW_SPACE = 256 * 1024 * 1024  # below this much free space, a write that failed for no said reason is a full disk


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and what caused it, in turn."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def out_of_space(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) says it is a full disk, a file-size limit or a quota."""
    return any(e.errno in OUT_OF_SPACE_ERRNOS if isinstance(e, OSError) else bool(OUT_OF_SPACE_TEXT.search(str(e)))
               for e in _chain(exc))


def _unexplained_write_failure(exc: BaseException) -> str | None:
    """The library ("torch", "MLX") whose writer failed without saying why, anywhere in the chain;
    None where no such failure is there."""
    for e in _chain(exc):
        if not isinstance(e, OSError):
            for library, text in WRITE_FAILED_TEXT.items():
                if text.search(str(e)):
                    return library
    return None


def _file_size_limited() -> bool:
    """Whether this process has a file size limit (ulimit -f), which a failed write may have hit."""
    import resource

    return resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY


def _free_bytes(path: Path) -> int:
    """Free space on the disk of `path` (or of its nearest existing parent); large when unknown."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return 1 << 62


def write_error(exc: BaseException, what: str, where: Path | str, fix: str | None = None) -> OutputError | None:
    """The OutputError for a failed write of `what`, or None when `exc` is not about writing."""
    unexplained = _unexplained_write_failure(exc)
    # torch's or MLX's reasonless failure is a full disk (or the size limit) where that is the likely cause
    if out_of_space(exc) or (unexplained and (_free_bytes(Path(where)) < LOW_SPACE or _file_size_limited())):
        return OutputError(f"the disk filled up (or a file size limit or quota was hit) while writing {what}: "
                           f"{first_line(exc)}", str(where),
                           f"{fix or 'free space where the output goes'}; what was saved before is intact")
    if isinstance(exc, OSError):
        fix = {errno.EEXIST: "a file stands where a directory goes: remove it, or choose another output path",
               errno.ENOTDIR: "a file stands where a directory goes: remove it, or choose another output path",
               errno.EACCES: "check the permissions of the output directory",
               errno.EPERM: "check the permissions of the output directory",
               errno.EROFS: "the file system is read-only: choose another output path"}.get(
            exc.errno, "check the permissions and free space of the output directory")
        return OutputError(f"cannot write {what}: {exc.strerror or exc}", str(where), fix)
    if unexplained:  # torch's or MLX's writer, with space left and no size limit
        free = _free_bytes(Path(where)) / 1024**3
        return OutputError(f"cannot write {what}: {first_line(exc)} ({unexplained} gives no reason; {free:.1f} GiB are "
                           "free there)", str(where), "check the output's disk: a quota, an I/O error, or a file "
                           "system gone read-only; what was saved before is intact")
    return None


@contextmanager
def writing(what: str, where: Path | str, fix: str | None = None) -> Iterator[None]:
    """Turn a failed write inside the block into one OutputError; other errors pass through."""
    try:
        yield
    except OutputError:
        raise
    except Exception as exc:
        error = write_error(exc, what, where, fix)
        if error is None:
            raise
        raise error from exc


# the permissions a new file gets here (0644 under the usual umask 022), read once
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def usual_mode(path: Path) -> None:
    """Give a written file at least the permissions any new file gets here (an executable stays
    one). safetensors (0.8) writes its files through a private temporary file, 0600: a model or
    adapter that others on the machine (or the host's user, for a container's output) could not
    read, beside 0644 configs."""
    current = path.stat().st_mode & 0o777
    wanted = current | (0o666 & ~_UMASK)
    if wanted != current:
        path.chmod(wanted)


def write_directory(final: Path, fill: Callable[[Path], None], what: str, fix: str | None = None) -> Path:
    """Call fill(tmp) on an empty directory beside `final`, fsync it, then make it `final`.
    A failure at any point leaves the previous `final` in place."""
    final = Path(final)
    tmp, old = aside(final, "tmp"), aside(final, "old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(what, final, fix):
            tmp.mkdir(parents=True)
            fill(tmp)
            for path in sorted(tmp.rglob("*")):
                if path.is_file():
                    usual_mode(path)
                    fsync(path)
            fsync(tmp)
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            old.rename(final)  # the swap itself failed: put the previous version back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


def write_file(path: Path, fill: Callable[[Path], None], what: str, fix: str | None = None) -> Path:
    """Call fill(tmp) to write one file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    tmp = aside(path, "tmp")
    try:
        with writing(what, path, fix):
            fill(tmp)
            usual_mode(tmp)
            fsync(tmp)
            tmp.replace(path)
            fsync(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_bytes(path: Path, data: bytes, what: str, fix: str | None = None) -> Path:
    return write_file(path, lambda tmp: tmp.write_bytes(data), what, fix)


def write_text(path: Path, text: str, what: str, fix: str | None = None) -> Path:
    return write_bytes(path, text.encode("utf-8"), what, fix)


def write_json(path: Path, data: Any, what: str | None = None, fix: str | None = None) -> Path:
    """A JSON file, written atomically (values JSON does not know are written as strings)."""
    text = json.dumps(data, indent=2, default=str, ensure_ascii=False) + "\n"
    return write_text(path, text, what or Path(path).name, fix)


def read_json(path: Path) -> dict | None:
    """A JSON object from a file, or None where the file is missing, unreadable or holds something
    else: for what only informs (a note, a summary) and must never stop the caller."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def append_lines(path: Path, lines: list[str], what: str) -> None:
    """Append whole lines (a log-like file: a line cut by a crash is dropped by its reader)."""
    with writing(what, path), open(path, "a", encoding="utf-8", newline="") as f:
        f.write("".join(lines))


# What a file manager leaves in any folder it shows (Finder, Windows Explorer): never a user's work,
# so a folder holding only these counts as empty, and none of them as "other files" to refuse over
OS_LITTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})


def is_litter(path: str | Path) -> bool:
    """A file manager's own file (OS_LITTER, or macOS's `._NAME` beside a file on a foreign disk)."""
    name = Path(path).name
    return name in OS_LITTER or name.startswith("._")


def probe_writable(directory: Path) -> None:
    """Create `directory` if need be and write a file in it, or raise the OSError that stops it. The
    probe has this process's own name: every rank of a launch, or two runs starting at once, probe
    the same folder together."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = aside(directory / "write-test", "tmp")
    probe.write_text("ok")
    probe.unlink(missing_ok=True)  # a run holding the folder's lock may have cleared it as a leftover


def unwritable_fix(exc: OSError | None = None) -> str:
    """The fix for an --output this process may not write. In ptbr's images ptbr runs as the image's
    user, and a folder mounted from the host belongs to a host user: another path would not help."""
    variant = image_variant()
    if variant and (exc is None or exc.errno in (errno.EACCES, errno.EPERM)):
        return (f"the ptbr-{variant} image runs as uid {os.getuid()}: on the host, give it the mounted folder "
                f"(chown {os.getuid()}:{os.getgid()} FOLDER), or run the container as yourself "
                '(--user "$(id -u):$(id -g)")')
    return "choose a path you can write to with --output"


def unreadable_fix() -> str:
    """The fix for input files (data, a model) this process may not read."""
    variant = image_variant()
    if variant:
        return (f"the ptbr-{variant} image runs as uid {os.getuid()}: on the host, make the files readable by it "
                '(chmod -R a+rX FOLDER), or run the container as yourself (--user "$(id -u):$(id -g)")')
    return "make them readable by this user (chmod a+r FILE, chmod a+rx FOLDER)"


def unreadable(paths) -> list[Path]:
    """Those of `paths` that exist and this process may not read (a folder: list and enter)."""
    found = []
    for path in map(Path, paths):
        try:
            if path.exists() and not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
                found.append(path)
        except PermissionError:  # its folder cannot be entered
            found.append(path)
    return found


def first_missing(path: Path) -> Path | None:
    """The topmost folder of `path` that does not exist yet, which creating `path` makes (None
    where `path` exists)."""
    path = Path(os.path.abspath(path))  # `..` taken as mkdir takes it
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def remove_empty_folders(path: Path, up_to: Path) -> None:
    """Remove `path` and its parents up to `up_to` (a first_missing), each where it is empty: what a
    refused command made on the way to its output goes with it; anything else in them stays."""
    path, up_to = Path(os.path.abspath(path)), Path(os.path.abspath(up_to))
    if path != up_to and up_to not in path.parents:  # not a folder it made: never touched
        return
    try:
        for folder in (path, *path.parents):
            folder.rmdir()  # OSError where something else is there: left as it is
            if folder == up_to:
                break
    except OSError:
        pass


def remove_leftovers(folder: Path) -> None:
    """Delete what writes cut short by a crash left in `folder` (call it holding its lock): only
    ptbr's own (`aside`: `.tmp-NAME.ptbr-PID`, `.old-NAME.ptbr-PID`); a user's `.tmp-notes.txt` or `.old-photos/`
    in the same folder stays."""
    if not folder.is_dir():
        return
    for leftover in folder.iterdir():
        if not (_LEFTOVER.fullmatch(leftover.name) or _OLDER_LEFTOVER.fullmatch(leftover.name)):
            continue
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def telling_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message in one line: its first line, and where that only announces a list
    ("Error(s) in loading state_dict for X:", "... contains incompatible tensors:") the list's first
    entry and how many more there are."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:
        line += f" {lines[1]}" + (f" (and {len(lines) - 2} more)" if len(lines) > 2 else "")
    return line[:limit]


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
