"""`ptbr kaggle push|status|output`: a bundle to Kaggle and its kernel's outputs back, through the
Kaggle API client. Every answer is checked: the client itself reports several server-side failures
only in a response field, and leaves out a file whose upload failed while still creating the
dataset, so push counts what arrived."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from ptbr.errors import ConfigError, KaggleError, OutputError
from ptbr.files import file_sha256, is_litter, read_json, write_directory, write_json
from ptbr.kaggle.client import KaggleUnavailable, call, connect, username
from ptbr.kaggle.layout import (
    BASE,
    BUNDLE_MARKER,
    DATA,
    DATASET_METADATA,
    KERNEL_FILE,
    KERNEL_METADATA,
    POLL_SECONDS,
    RUN_DIR,
    RUN_MARKER,
    SETTINGS_FILE,
    WHEELS,
    Bundle,
    read_bundle,
    resolved_path,
)
from ptbr.log import log


@dataclass(frozen=True)
class Waiting:
    """How long push, status and output wait on Kaggle, and how often they ask."""

    poll_s: float = POLL_SECONDS
    dataset_timeout_s: float = 3600.0  # a large dataset takes Kaggle a while to process
    request_timeout_s: float = 120.0  # one API request (uploads and output downloads are timed apart)
    # failures on Kaggle's side (HTTP 5xx, 429, no answer) in a row that a wait rides out, asking again
    retries: int = 10


# A kernel in these states has not finished.
UNFINISHED = ("queued", "running", "new_script", "cancel_requested")


def push(path: str, kernel_only: bool = False, waiting: Waiting = Waiting()) -> str:
    """The dataset (created, or a new version of it), checked file by file once Kaggle has it, then
    the kernel. --kernel-only: the kernel alone, once the dataset on Kaggle is checked to be the
    bundle (its marker byte for byte). Returns the kernel's URL."""
    bundle = read_bundle(path)
    # what is uploaded must be what the marker (and the kernel, which holds the marker's sha256) says;
    # --kernel-only uploads no file of the dataset (whose data may have been moved away meanwhile)
    check_the_kernel_script(bundle)
    if not kernel_only:
        check_local_files(bundle)
    api = connect(waiting.request_timeout_s)
    owner = bundle.dataset_id.split("/")[0]
    if username(api) and username(api) != owner:
        raise ConfigError(f"the bundle is for the Kaggle user {owner}, but the credentials are {username(api)}'s",
                          str(bundle.path), f"make the bundle again with --owner {username(api)}, or use "
                          f"{owner}'s credentials")
    # before anything is uploaded: the kernel and the dataset of that id on Kaggle, if any, must be
    # this bundle's (a new version would take them over), and a running version refuses the push
    previous = check_existing_kernel(api, bundle, kernel_only)
    exists = call(api, f"ask about the dataset {bundle.dataset_id}", api.dataset_status, bundle.dataset_id,
                  absent_ok=True) is not None
    if exists:
        check_existing_dataset(api, bundle)
    if kernel_only:
        if not exists:
            raise KaggleError(f"the dataset {bundle.dataset_id} is not on Kaggle: --kernel-only pushes the kernel "
                              "alone, against a dataset pushed before", str(bundle.path),
                              f"push the dataset and the kernel: ptbr kaggle push {bundle.path} (without "
                              "--kernel-only)")
        log(f"dataset {bundle.dataset_id}: not uploaded again (--kernel-only)")
        if previous is not None and bundle.kernel_id not in bundle.kernel_metadata.get("kernel_sources", []):
            log(f"warning: the bundle was made without --resume-from-previous: this version of {bundle.kernel_id} "
                "starts the run over from step 0, without the previous version's checkpoints; to continue that "
                "run, make the bundle again with --resume-from-previous and push it (the dataset too)")
    else:
        upload_dataset(api, bundle, exists)
        wait_until_ready(api, bundle.dataset_id, waiting)
    check_dataset_files(api, bundle)
    if kernel_only:
        check_dataset_marker(api, bundle)
    try:
        return push_kernel(api, bundle)
    except KaggleError as exc:
        if not kernel_only:  # pushing the whole bundle again would upload the dataset again
            exc.fix = (f"{exc.fix}; the dataset is up: `ptbr kaggle push {bundle.path} --kernel-only` pushes the "
                       "kernel alone")
        raise


# --- before anything is sent ---------------------------------------------------------------------------


def check_the_kernel_script(bundle: Bundle) -> None:
    """The kernel refuses a dataset whose marker is not the one it was made with (its BUNDLE_SHA256
    line): a marker rewritten since, or a kernel folder of another bundle, would fail only on Kaggle."""
    try:
        script = (bundle.kernel / KERNEL_FILE).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the kernel script: {exc}", str(bundle.kernel / KERNEL_FILE),
                          "make the bundle again") from exc
    marker_sha256 = file_sha256(bundle.dataset / BUNDLE_MARKER)
    if f'\nBUNDLE_SHA256 = "{marker_sha256}"\n' not in script:
        raise ConfigError(f"the kernel script was not made with this bundle's {BUNDLE_MARKER} (its sha256 differs): "
                          "the kernel would refuse the dataset on Kaggle", str(bundle.path),
                          "make the bundle again (`ptbr kaggle bundle` with the same --output)")


def check_local_files(bundle: Bundle) -> None:
    """Every file of BUNDLE/dataset as its marker lists it (size and sha256), and no other: a
    settings file edited or a data file deleted since the bundle was made would otherwise be
    uploaded and fail only on Kaggle (a file sent that the marker does not list would be published
    with the dataset)."""
    listed = bundle.info.get("files")
    if not isinstance(listed, dict):
        raise ConfigError(f"{BUNDLE_MARKER} lists no files", str(bundle.dataset / BUNDLE_MARKER),
                          "make the bundle again")
    problems = []
    for name, expected in sorted(listed.items()):
        path = bundle.dataset / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != expected.get("bytes"):
            problems.append(f"{name} has {path.stat().st_size} bytes, not {expected.get('bytes')}")
        elif file_sha256(path) != expected.get("sha256"):
            problems.append(f"{name} has changed (its sha256 differs)")
    known = set(listed) | {BUNDLE_MARKER, DATASET_METADATA}
    extra = sorted(p.relative_to(bundle.dataset).as_posix() for p in bundle.dataset.rglob("*")
                   if (p.is_file() or p.is_symlink()) and p.relative_to(bundle.dataset).as_posix() not in known
                   and not is_litter(p))  # (a Finder .DS_Store goes up unused: the kernel reads only what is listed)
    problems += [f"{name} is not one of the bundle's files" for name in extra]
    if problems:
        shown = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        raise ConfigError(f"the bundle's files no longer match its {BUNDLE_MARKER}: {shown}", str(bundle.dataset),
                          "make the bundle again (`ptbr kaggle bundle` with the same --output; settings go in "
                          "its --config, not in the bundle)")


# a ptbr kernel's log lines start so (kaggle/kernel.py's PREFIX): its source holds it
KERNEL_SIGNATURE = "[ptbr-kernel]"


def check_existing_kernel(api, bundle: Bundle, kernel_only: bool) -> str | None:
    """A kernel of the bundle's id on Kaggle must be a ptbr kernel, and, where the bundle resumes
    from its previous output, not still running: checked before the dataset is uploaded. Returns
    its state (None: Kaggle has no version of it)."""
    kernel = bundle.kernel_id
    state = kernel_state(api, kernel)
    if state is None:
        return None
    from kaggle.api.kaggle_api_extended import ApiGetKernelRequest

    request = ApiGetKernelRequest()
    request.user_name, request.kernel_slug = kernel.split("/")
    with api.build_kaggle_client() as client:
        response = call(api, f"look at the kernel {kernel}", client.kernels.kernels_api_client.get_kernel, request)
    source = getattr(getattr(response, "blob", None), "source", None) or ""
    if KERNEL_SIGNATURE not in source:
        raise OutputError(f"Kaggle already has a kernel {kernel} that is not a ptbr kernel: pushing would replace "
                          "its code with a new version", f"https://www.kaggle.com/code/{kernel}",
                          "make the bundle again with another --slug")
    if state in UNFINISHED and kernel in bundle.kernel_metadata.get("kernel_sources", []):
        again = ("then push again" if kernel_only else
                 "then push again (--kernel-only to start the next session without uploading the dataset again, "
                 "when the bundle has not changed)")
        raise KaggleError(f"the kernel {kernel} is still {state}: its output is not there to resume from, and "
                          "nothing was uploaded", kernel,
                          f"wait until it ends (`ptbr kaggle status {bundle.path} --wait`), {again}")
    return state


# what a bundle's dataset holds (kept as folders, or as the archives they were sent as)
BUNDLE_FOLDERS = (WHEELS, DATA, BASE)


def check_existing_dataset(api, bundle: Bundle) -> None:
    """A dataset of the bundle's id on Kaggle must be a ptbr bundle (its newest version lists
    ptbr-bundle.json): a new version of anyone else's dataset would replace its files, and publish
    the bundle's in a public one. A dataset an earlier push left without its marker (that file's
    upload failed) holds only a bundle's files, its settings among them."""
    listed = listed_files(api, bundle.dataset_id)
    names = {PurePosixPath(name).name for name in listed}
    if BUNDLE_MARKER in names or not listed:
        return
    tops = {name.split("/")[0] for name in listed}
    ours = {BUNDLE_MARKER, SETTINGS_FILE, *BUNDLE_FOLDERS, *(f"{folder}.zip" for folder in BUNDLE_FOLDERS)}
    if SETTINGS_FILE in listed and tops <= ours:
        return
    shown = ", ".join(sorted(listed)[:4]) + (", ..." if len(listed) > 4 else "")
    raise OutputError(f"Kaggle already has a dataset {bundle.dataset_id} that is not a ptbr bundle (no "
                      f"{BUNDLE_MARKER}; it holds {shown}): a new version would replace its files with the "
                      "bundle's", f"https://www.kaggle.com/datasets/{bundle.dataset_id}",
                      "make the bundle again with another --slug")


# --- the dataset -------------------------------------------------------------------------------------


def upload_dataset(api, bundle: Bundle, exists: bool) -> None:
    dataset = bundle.dataset_id
    files = bundle.info["files"]  # (every file but the marker that lists them)
    count = len(files) + 1
    size = sum(f["bytes"] for f in files.values()) + (bundle.dataset / BUNDLE_MARKER).stat().st_size
    quiet = not sys.stdout.isatty()  # the client's progress bars, on a terminal only
    # dir_mode "zip": the client skips subfolders otherwise; each (wheels/, data/, base/) goes up as an
    # archive that Kaggle unpacks, and the kernel unpacks one itself if Kaggle has not.
    if exists:
        log(f"dataset {dataset}: uploading a new version ({count} files, {size / 1e6:.1f} MB)")
        notes = f"ptbr {bundle.info['ptbr_version']} bundle, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        response = call(api, f"upload a new version of the dataset {dataset}", api.dataset_create_version,
                        str(bundle.dataset), notes, quiet=quiet, dir_mode="zip")
    else:
        log(f"dataset {dataset}: creating it, private ({count} files, {size / 1e6:.1f} MB)")
        response = call(api, f"create the dataset {dataset}", api.dataset_create_new, str(bundle.dataset),
                        public=False, quiet=quiet, dir_mode="zip")
    if response is None or (response.status or "").lower() != "ok" or response.error:
        reason = (response.error or response.status) if response is not None else "no answer"
        raise KaggleError(f"Kaggle refused the dataset {dataset}: {reason}", str(bundle.dataset),
                          "fix what Kaggle names (a title or slug in use by another dataset: bundle again with "
                          "another --slug or --title)")


Answer = TypeVar("Answer")


def patiently(ask: Callable[[], Answer], waiting: Waiting) -> Answer:
    """ask(), asked again after a failure on Kaggle's side (HTTP 5xx, 429, no answer), each said on
    stderr, up to waiting.retries in a row: a wait of hours does not end on one bad answer."""
    failures = 0
    while True:
        try:
            return ask()
        except KaggleUnavailable as exc:
            failures += 1
            if failures > waiting.retries:
                raise KaggleUnavailable(f"{exc.what} ({failures} times in a row, {waiting.poll_s:g} s apart)",
                                        exc.where, exc.fix) from exc
            log(f"warning: {exc.what}; asking again in {waiting.poll_s:g} s ({failures} of {waiting.retries} "
                "failures in a row allowed while waiting)")
            time.sleep(waiting.poll_s)


def wait_until_ready(api, dataset: str, waiting: Waiting) -> None:
    deadline = time.monotonic() + waiting.dataset_timeout_s
    while True:
        status = str(patiently(lambda: call(api, f"ask about the dataset {dataset}", api.dataset_status, dataset),
                               waiting)).lower()
        if status == "ready":
            log(f"dataset {dataset}: ready")
            return
        if status in ("failed", "deleted"):
            raise KaggleError(f"Kaggle could not process the dataset {dataset} (status {status})", dataset,
                              "push again; if it fails again, look at the dataset's page on Kaggle")
        if time.monotonic() > deadline:
            raise KaggleError(f"the dataset {dataset} is still {status} after {waiting.dataset_timeout_s / 60:.0f} "
                              "minutes", dataset, "wait, then push the kernel alone: ptbr kaggle push BUNDLE "
                              "--kernel-only")
        log(f"dataset {dataset}: {status}, waiting")
        time.sleep(waiting.poll_s)


def listed_files(api, dataset: str) -> dict[str, int]:
    """{name: bytes} of every file of the dataset's newest version, as Kaggle lists them."""
    found: dict[str, int] = {}
    token = None
    while True:
        response = call(api, f"list the files of the dataset {dataset}", api.dataset_list_files, dataset,
                        page_token=token, page_size=200)
        if response.error_message:
            raise KaggleError(f"cannot list the files of the dataset {dataset}: {response.error_message}", dataset,
                              "run the command again")
        for item in response.files or []:
            found[item.name] = item.total_bytes
        token = response.next_page_token
        if not token:
            return found


def check_dataset_files(api, bundle: Bundle) -> None:
    """Every file of the bundle must be in the dataset with its size. A folder may be listed file by
    file (as Kaggle unpacks an archive), by file names alone, or as the archive it was sent as."""
    listed = listed_files(api, bundle.dataset_id)
    by_name: dict[str, list[int]] = {}
    for name, size in listed.items():
        by_name.setdefault(PurePosixPath(name).name, []).append(size)
    expected = {**{name: f["bytes"] for name, f in bundle.info["files"].items()},
                BUNDLE_MARKER: (bundle.dataset / BUNDLE_MARKER).stat().st_size}
    missing, wrong = [], []
    for name, size in sorted(expected.items()):
        top = name.split("/")[0]
        if name in listed:
            sizes = [listed[name]]
        elif "/" in name and f"{top}.zip" in listed:
            continue  # the folder is kept as the archive it was sent as (the kernel unpacks it)
        else:
            sizes = by_name.get(PurePosixPath(name).name, [])
        if not sizes:
            missing.append(name)
        elif size not in sizes and not any(s in (0, None) for s in sizes):  # 0: Kaggle gave no size
            wrong.append(f"{name} ({sizes[0]} bytes, not {size})")
    if missing or wrong:
        problems = ([f"{len(missing)} of {len(expected)} files did not arrive: {', '.join(missing[:5])}"
                     f"{' ...' if len(missing) > 5 else ''}"] if missing else []) + \
                   ([f"sizes differ: {', '.join(wrong[:5])}"] if wrong else [])
        raise KaggleError(f"the dataset {bundle.dataset_id} on Kaggle is not the bundle: {'; '.join(problems)}",
                          str(bundle.dataset), "push again (`ptbr kaggle push BUNDLE`): the client leaves out a "
                          "file whose upload failed without failing itself")
    log(f"dataset {bundle.dataset_id}: all {len(expected)} files arrived")


def check_dataset_marker(api, bundle: Bundle) -> None:
    """The dataset's ptbr-bundle.json on Kaggle must be this bundle's, byte for byte: the kernel
    holds its sha256 and refuses any other at its bundle stage, after the GPU session started. A
    bundle made again since its dataset was pushed can have the same files and sizes, not the same
    marker (Kaggle lists no file hashes: the marker, a few kilobytes, is downloaded)."""
    remote = hashlib.sha256(dataset_file(api, bundle.dataset_id, BUNDLE_MARKER)).hexdigest()
    local = file_sha256(bundle.dataset / BUNDLE_MARKER)
    if remote != local:
        raise KaggleError(f"the dataset {bundle.dataset_id} on Kaggle is another version of the bundle: its "
                          f"{BUNDLE_MARKER} is not this bundle's (sha256 {remote[:12]}..., not {local[:12]}...; "
                          "was the bundle made again since it was pushed?), and the kernel would refuse it",
                          str(bundle.path), f"push the dataset with the kernel: ptbr kaggle push {bundle.path} "
                          "(without --kernel-only)")
    log(f"dataset {bundle.dataset_id}: its {BUNDLE_MARKER} is this bundle's")


def dataset_file(api, dataset: str, name: str) -> bytes:
    """One file of the dataset's newest version, as Kaggle serves it (a file it sends zipped is
    unpacked)."""
    from kaggle.api.kaggle_api_extended import ApiDownloadDatasetRequest

    request = ApiDownloadDatasetRequest()
    request.owner_slug, request.dataset_slug = dataset.split("/")
    request.file_name = name
    what = f"download {name} of the dataset {dataset}"
    with api.build_kaggle_client() as client:
        response = call(api, what, client.datasets.dataset_api_client.download_dataset, request)
        content = call(api, what, lambda: response.content)
    if content[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(io.BytesIO(content)) as archive:
            names = archive.namelist()
            content = archive.read(name if name in names else names[0]) if names else b""
    return content


# --- the kernel ----------------------------------------------------------------------------------------


def push_kernel(api, bundle: Bundle) -> str:
    kernel = bundle.kernel_id
    metadata = dict(bundle.kernel_metadata)
    resolved = [resolve_model_version(api, source) for source in metadata.get("model_sources", [])]
    if resolved != metadata.get("model_sources", []):
        metadata["model_sources"] = resolved
        write_json(bundle.kernel / KERNEL_METADATA, metadata)  # the bundle records the version pushed
    if kernel in metadata.get("kernel_sources", []):
        state = kernel_state(api, kernel)
        if state is None:
            log(f"kernel {kernel}: no previous version yet, so none of its output to attach: this version starts "
                "the run")
            metadata["kernel_sources"] = [source for source in metadata["kernel_sources"] if source != kernel]
        elif state in UNFINISHED:
            raise KaggleError(f"the kernel {kernel} is still {state}: its output is not there to resume from",
                              kernel, "wait until it ends (`ptbr kaggle status BUNDLE --wait`), then push again")
        else:
            log(f"kernel {kernel}: the previous version ended {state}; its output is attached to resume from")
    script = (bundle.kernel / KERNEL_FILE).read_text(encoding="utf-8")
    if kernel in metadata.get("kernel_sources", []):  # attached: the kernel fails if it finds no run there
        script = script.replace("\nEXPECT_PREVIOUS = False\n", "\nEXPECT_PREVIOUS = True\n", 1)
    with tempfile.TemporaryDirectory(prefix="ptbr-kernel-") as folder:
        (Path(folder) / KERNEL_FILE).write_text(script, encoding="utf-8")
        (Path(folder) / KERNEL_METADATA).write_text(json.dumps(metadata, indent=2), encoding="utf-8")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # the client prints its own warnings
            response = call(api, f"push the kernel {kernel}", api.kernels_push, folder)
    for line in printed.getvalue().splitlines():
        if "title does not resolve" in line:
            log(f"warning: the kernel's title {metadata.get('title')!r} does not lead to its id {kernel} by Kaggle's "
                "rule: Kaggle may name the kernel after its title; make the bundle again with a --title whose "
                "letters and digits are the slug's")
        elif line.strip():
            log(f"kaggle client: {line.strip()}")
    problems = [response.error] if response.error else []
    for field in ("invalid_dataset_sources", "invalid_kernel_sources", "invalid_model_sources",
                  "invalid_competition_sources", "invalid_tags"):
        values = getattr(response, field, None)
        if values:
            problems.append(f"{field.removeprefix('invalid_').replace('_', ' ')} refused: {', '.join(values)}")
    if problems:
        raise KaggleError(f"Kaggle refused the kernel {kernel}: {'; '.join(problems)}", str(bundle.kernel),
                          "fix what Kaggle names, then push again")
    url = response.url or f"https://www.kaggle.com/code/{kernel}"
    log(f"kernel {kernel} version {response.version_number} pushed: {url}")
    log(f"follow it: ptbr kaggle status {bundle.path} --wait; then: ptbr kaggle output {bundle.path} --path DIR")
    return url


def resolve_model_version(api, source: str) -> str:
    """OWNER/MODEL/FRAMEWORK/VARIATION without a version: the newest, as Kaggle says now."""
    if source.count("/") == 4:
        return source
    instance = call(api, f"look up the Kaggle model {source}", api.model_instance_get, source)
    version = getattr(instance, "version_number", None)
    if not version:
        raise KaggleError(f"Kaggle lists no version of the model {source}", source,
                          "give the version: --base kaggle:OWNER/MODEL/FRAMEWORK/VARIATION/VERSION")
    log(f"model {source}: attaching its newest version, {version}")
    return f"{source}/{version}"


def kernel_state(api, kernel: str) -> str | None:
    """The kernel's state in lowercase (queued, running, complete, error, ...), or None when it has
    no version yet."""
    response = call(api, f"ask about the kernel {kernel}", api.kernels_status, kernel, absent_ok=True)
    if response is None:
        return None
    status = response.status
    return (getattr(status, "name", None) or str(status)).lower()


# --- following it -------------------------------------------------------------------------------------------


def status(path: str, wait: bool = False, waiting: Waiting = Waiting()) -> str:
    """Print the kernel's state (each change, with --wait, until it ends); a kernel that failed or was
    cancelled is a KaggleError."""
    bundle = read_bundle(path)
    api = connect(waiting.request_timeout_s)
    kernel = bundle.kernel_id
    shown = None

    def ask():
        return call(api, f"ask about the kernel {kernel}", api.kernels_status, kernel, absent_ok=True)

    while True:
        response = patiently(ask, waiting) if wait else ask()
        if response is None:
            raise KaggleError(f"Kaggle has no kernel {kernel}", str(bundle.path),
                              f"push it first: ptbr kaggle push {bundle.path}")
        state = (getattr(response.status, "name", None) or str(response.status)).lower()
        if state != shown:
            print(f"{kernel}: {state}", flush=True)
            shown = state
        if not wait or state not in UNFINISHED:
            break
        time.sleep(waiting.poll_s)
    if state == "error":
        reason = f": {response.failure_message}" if response.failure_message else ""
        raise KaggleError(f"the kernel {kernel} failed{reason}", f"https://www.kaggle.com/code/{kernel}",
                          f"ptbr kaggle output {bundle.path} --path DIR fetches its log, which names the failing stage")
    if state.startswith("cancel"):
        raise KaggleError(f"the kernel {kernel} was cancelled ({state})", f"https://www.kaggle.com/code/{kernel}",
                          f"push it again: ptbr kaggle push {bundle.path}")
    return state


def output(path: str, target: str, pattern: str | None = None, waiting: Waiting = Waiting()) -> Path:
    """The kernel's newest outputs and its log, downloaded into `target` as a whole (a previous
    download there is replaced, never by nothing; a folder holding anything it did not write is
    refused, the files named), with a record of what this download wrote (DOWNLOADED)."""
    if target == "":
        raise ConfigError("--path must be a folder, got an empty path", "ptbr kaggle output", "give a new folder")
    pattern_re = None
    if pattern:
        import re

        try:
            pattern_re = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"--pattern is not a regular expression: {exc}", pattern, "fix the pattern") from exc
    bundle = read_bundle(path)
    destination = resolved_path(target, "--path")
    log_name = f"{bundle.kernel_id.split('/')[1]}.log"
    if destination.exists() and not destination.is_dir():
        raise OutputError("the download folder is a file: it would be replaced", str(destination),
                          "give a new or empty folder with --path")
    others = not_downloaded(destination, log_name) if destination.is_dir() else []
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise OutputError(f"the download folder holds something other than a previous download of this kernel's "
                          f"outputs ({shown}): it would be replaced", str(destination),
                          "move those files out of the folder, or give a new or empty folder with --path")
    # the download is written beside the folder, then moved into its place
    writable = next(folder for folder in destination.parents if folder.exists())
    if not os.access(writable, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write in {writable}: the download is written there beside {destination.name}, "
                          "then moved into its place", str(destination),
                          f"give yourself write access to {writable}, or give a --path in a folder you can write")
    previous = destination.is_dir() and any(not is_litter(p) for p in destination.rglob("*"))
    api = connect(waiting.request_timeout_s)
    counted: list[int] = []

    def fill(folder: Path) -> None:
        count, listed = download_outputs(api, bundle.kernel_id, folder, log_name, pattern_re)
        if not listed:
            if previous:
                raise KaggleError(f"Kaggle lists no output files for the kernel {bundle.kernel_id}: the previous "
                                  f"download in {destination} is kept", bundle.kernel_id,
                                  "a version still queued or running has none yet: ask `ptbr kaggle status "
                                  f"{bundle.path}`, and fetch the outputs once it has ended")
            log(f"warning: Kaggle lists no output files for the kernel {bundle.kernel_id} (a version still queued or "
                f"running has none yet: ptbr kaggle status {bundle.path}); only its log is written")
        counted.append(count)
        written = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        write_json(folder / DOWNLOADED, {"kernel": bundle.kernel_id, "files": written})

    write_directory(destination, fill, "the kernel's outputs")
    log(f"kernel {bundle.kernel_id}: {counted[0]} output files and the log ({log_name}) in {destination}")
    summarize(destination)
    return destination


# In a download folder: what the download wrote there (a later download replaces the folder whole,
# which it may do only where it holds nothing else).
DOWNLOADED = ".ptbr-kaggle-output.json"


def not_downloaded(folder: Path, log_name: str) -> list[str]:
    """The files in `folder` that no previous download wrote: those its DOWNLOADED record does not
    list or, in a download from before that record (it holds the run marker or the kernel's log),
    any but the kernel output's own names (the run marker, run/..., the log)."""
    found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if (p.is_file() or p.is_symlink()) and not is_litter(p))
    record = read_json(folder / DOWNLOADED)
    if record is not None and isinstance(record.get("files"), list):
        written = {str(name) for name in record["files"]} | {DOWNLOADED}
        return [name for name in found if name not in written]
    if not found or not ((folder / RUN_MARKER).is_file() or (folder / log_name).is_file()):
        return found  # empty, or not a download at all
    return [name for name in found if name not in (RUN_MARKER, log_name) and not name.startswith(f"{RUN_DIR}/")]


# what summarize() reads, a few kilobytes, fetched whatever --pattern says (without them the
# summary would call a finished run unfinished)
SUMMARIZED = (RUN_MARKER, f"{RUN_DIR}/preflight_report.json", f"{RUN_DIR}/training_summary.json")


def download_outputs(api, kernel: str, folder: Path, log_name: str, pattern) -> tuple[int, int]:
    """Each file Kaggle lists for the kernel's newest version (those `pattern` matches, and the
    SUMMARIZED ones), checked (an error page is not saved as an output, a name cannot leave
    `folder`), then its log. Returns how many files were downloaded, and how many Kaggle listed."""
    import requests
    from kaggle.api.kaggle_api_extended import ApiListKernelSessionOutputRequest

    owner, slug = kernel.split("/")
    count, listed, token, log_text = 0, 0, None, None
    while True:
        request = ApiListKernelSessionOutputRequest()
        request.user_name, request.kernel_slug, request.page_size = owner, slug, 100
        if token:
            request.page_token = token
        with api.build_kaggle_client() as client:
            response = call(api, f"list the outputs of the kernel {kernel}",
                            client.kernels.kernels_api_client.list_kernel_session_output, request)
        log_text = log_text if log_text is not None else response.log
        listed += len(response.files or [])
        for item in response.files or []:
            if pattern is not None and not pattern.search(item.file_name) and item.file_name not in SUMMARIZED:
                continue
            target = (folder / item.file_name).resolve()
            if not target.is_relative_to(folder.resolve()) or target == folder.resolve():
                raise KaggleError(f"Kaggle lists an output named {item.file_name!r}, outside the download folder",
                                  kernel, "download it from the kernel's page instead")
            target.parent.mkdir(parents=True, exist_ok=True)
            with call(api, f"download {item.file_name}", requests.get, item.url, stream=True, timeout=600) as answer:
                call(api, f"download {item.file_name}", answer.raise_for_status)
                with open(target, "wb") as out:
                    for block in answer.iter_content(1 << 20):
                        out.write(block)
            count += 1
        token = response.next_page_token
        if not token:
            break
    (folder / log_name).write_text(log_text or "", encoding="utf-8")
    return count, listed


def summarize(folder: Path) -> None:
    """What the kernel left, in a few lines: how it ended, the preflight verdict, the training summary
    (a file that is missing or unreadable is said to be, never a crash)."""
    record = read_json(folder / RUN_MARKER)
    if record is not None:
        stages = ", ".join(f"{name} {state}" for name, state in record.get("stages", {}).items())
        print(f"kernel: {stages}; exit code {record.get('exit_code')}"
              + (f"; failure: {record['failure']}" if record.get("failure") else ""))
    else:
        print(f"kernel: no {RUN_MARKER} (the kernel stopped before its outputs stage, or did not start); "
              "see the log")
    run_dir = folder / RUN_DIR
    preflight = run_dir / "preflight_report.json"
    report = read_json(preflight)
    if report is not None:
        counts = {}
        for check in report.get("checks", []) if isinstance(report.get("checks"), list) else []:
            status = check.get("status") if isinstance(check, dict) else None
            counts[status] = counts.get(status, 0) + 1
        print(f"preflight: {counts.get('pass', 0)} pass, {counts.get('warn', 0)} warn, {counts.get('fail', 0)} fail "
              f"({preflight})")
    summary = run_dir / "training_summary.json"
    if summary.is_file():
        print(f"training summary: {summary}")
    elif run_dir.is_dir():
        print(f"run directory: {run_dir} (no training_summary.json: the run has not finished)")
