"""ptbr's Kaggle kernel: `ptbr kaggle bundle` copies this file to BUNDLE/kernel/ptbr_kernel.py and
`ptbr kaggle push` sends it as the kernel's code. It runs in Kaggle's image with the internet off,
standard library only (nothing of ptbr is installed when it starts).

Every line it prints starts with `[ptbr-kernel]`; each stage says what it did, and a failed stage
ends the kernel with `[ptbr-kernel] FAILED at stage NAME: WHY` and a non-zero exit, so a failed
kernel's log names the stage:

  environment  Python, platform, glibc, GPUs (nvidia-smi -L), Kaggle's run type.
  resume       a previous version of this kernel whose output is attached (kernel_sources) left
               its run under /kaggle/input, read-only: its files are copied to /kaggle/working/run,
               where `--resume auto` continues from its newest intact checkpoint. First, before
               any stage that can fail: a version that fails later still leaves the run in its
               output (with ptbr-kaggle-run.json), so the next version resumes from it. The copy
               goes to a folder beside run/ that becomes run/ (one rename) once complete: run/ is
               the whole run or absent, never part of it.
  bundle       the bundle dataset, found by its marker file ptbr-bundle.json anywhere under
               /kaggle/input (older sessions mount a dataset at /kaggle/input/SLUG, newer ones at
               /kaggle/input/datasets/OWNER/SLUG); every file's size checked, every wheel's sha256.
  install      pip install --no-index --find-links BUNDLE/wheels ptbr: pip keeps what the image
               already has in a version ptbr accepts (torch included) and installs the rest from
               the bundle's wheels.
  preflight    ptbr preflight with the run's settings: preflight_report.json in the run directory.
               ptbr runs offline (HF_HUB_OFFLINE=1), with the bundle's --env variables.
  train        ptbr train or ptbr finetune into /kaggle/working/run (both T4s: the settings say
               num_processes auto). SIGTERM/SIGINT are passed on once: ptbr saves a checkpoint at
               the next step boundary and exits 130. Before Kaggle's 12-hour limit the kernel asks
               for that itself (the bundle's stop_after_s), so the checkpoint is not raced by the
               end of the session.
  outputs      /kaggle/working/ptbr-kaggle-run.json: what ran and how it ended (the next version
               finds the run by this file). Written as soon as the resume stage is done, and at the
               end whatever happened: a SIGTERM/SIGINT at any other stage stops the kernel (exit 130)
               with the record written. Stopped (or failed) before its resume stage was done, a
               version leaves no run/ and a record the next version does not resume from: the run is
               still in the output of the version before.

Every path is rooted at $KAGGLE_ROOT (default /kaggle), so the tests run this file on any machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

# OWNER/SLUG of the bundle this kernel runs; `ptbr kaggle bundle` writes it on this line. Empty:
# whichever single bundle is attached.
BUNDLE_ID = ""
# the sha256 of that bundle's ptbr-bundle.json (which lists every file's sha256): another version of
# the dataset (still processing on Kaggle, or an older one) is refused. Empty: not checked.
BUNDLE_SHA256 = ""
# True in the copy `ptbr kaggle push` sends when it attached the previous version's output: finding
# none to resume from is then an error, not a new run (Kaggle did not mount it, or it held none)
EXPECT_PREVIOUS = False

# These names are ptbr's (ptbr/kaggle/layout.py); tests/test_kaggle.py keeps the two in step.
BUNDLE_MARKER = "ptbr-bundle.json"
RUN_MARKER = "ptbr-kaggle-run.json"
RUN_DIR = "run"
HASHED_UP_TO = 64 << 20  # files checked by sha256 besides the wheels (settings, tokenizer; not GBs of data)
# How deep under /kaggle/input a marker may lie: SLUG/marker, datasets/OWNER/SLUG/marker, and a
# level or two more for layouts Kaggle may adopt.
SEARCH_DEPTH = 5
# What a previous run left that a new session must not take over.
NOT_CARRIED = ("previous", ".ptbr.lock")
EXIT_INTERRUPTED = 130  # ptbr's exit code after saving a checkpoint on SIGTERM/SIGINT
PREFIX = "[ptbr-kernel]"


def log(message: str) -> None:
    print(f"{PREFIX} {message}", flush=True)


class StageFailed(Exception):
    """A stage could not do its part; the message says why and what to do."""


class Stopped(Exception):
    """SIGTERM/SIGINT outside training (which passes them on to ptbr): the kernel stops where it is,
    and its run marker is still written."""


def stop(signum: int, _frame=None) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # stopping: a second signal must not cut the stop short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


def main() -> int:
    root = Path(os.environ.get("KAGGLE_ROOT", "/kaggle"))
    inputs, working = root / "input", root / "working"
    started = time.monotonic()
    record: dict = {"bundle": BUNDLE_ID or None, "stages": {}, "started": _now()}
    stage = "environment"
    code = 1
    run_dir = working / RUN_DIR
    # Kaggle ends a session with a signal: at any stage the record is still written (`finally` below),
    # saying how far this version got (before its resume stage was done: no run for the next version)
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        log(f"{stage}: {describe_environment()}")
        record["stages"][stage] = "ok"

        # before any stage that can fail: whatever happens next, this version's output holds the run
        stage = "resume"
        record["resumed_from"] = restore_previous_run(inputs, BUNDLE_ID, run_dir, working)
        record["had_run"] = holds_something(run_dir)  # False: nothing for the next version to lose
        record["stages"][stage] = "ok"
        write_record(working, record)  # a session killed outright (SIGKILL) still leaves the run findable

        stage = "bundle"
        bundle, info = find_bundle(inputs, BUNDLE_ID)
        record["bundle"] = info["id"]
        if BUNDLE_SHA256 and sha256(bundle / BUNDLE_MARKER) != BUNDLE_SHA256:
            raise StageFailed(f"the bundle attached at {bundle} is another version of {info['id']} than the one this "
                              "kernel was made with: Kaggle may still be processing the dataset's new version, or "
                              "only the kernel was pushed; run `ptbr kaggle push BUNDLE` (the dataset too), and "
                              "`ptbr kaggle status` until it runs")
        folders = check_bundle(bundle, info, Path(tempfile.gettempdir()) / "ptbr-bundle")
        log(f"{stage}: {info['id']} at {bundle} (ptbr {info['ptbr_version']}, {info['mode']}, "
            f"{len(info['files'])} files checked)")
        record["stages"][stage] = "ok"

        stage = "install"
        install(folders["wheels"], info)
        record["stages"][stage] = "ok"

        stage = "preflight"
        require_a_gpu(bundle / info["settings"])
        base = find_base(inputs, info, folders, exclude=bundle)
        paths = run_paths(bundle, info, folders, base, run_dir)
        env = ptbr_environment(info)
        if info.get("env"):
            log(f"{stage}: ptbr runs with {' '.join(f'{k}={v}' for k, v in info['env'].items())} (the bundle's --env)")
        preflight = run_ptbr(stage, ["preflight", "--mode", info["mode"], *paths], env)
        if preflight != 0:
            code = preflight  # 10: a check failed
            raise StageFailed(f"ptbr preflight exited with {preflight} (see {run_dir / 'preflight_report.json'} "
                              "and the lines above); fix the settings and bundle again")
        record["stages"][stage] = "ok"

        stage = "train"
        command = "train" if info["mode"] == "pretrain" else "finetune"
        budget = float(info["stop_after_s"]) - (time.monotonic() - started)
        saved_before = newest_checkpoint_step(run_dir)
        record["stages"][stage] = "running"
        write_record(working, record)  # a session killed outright (12 h, out of RAM) still leaves its marker
        code, stopped_by_budget = train(stage, [sys.executable, "-m", "ptbr", command, *paths, "--resume", "auto"],
                                        env, budget)
        record["train_exit_code"] = code
        saved = newest_checkpoint_step(run_dir)
        if code == EXIT_INTERRUPTED and stopped_by_budget and (saved is None or saved == saved_before):
            raise StageFailed(f"ptbr stopped for the time budget but wrote no new checkpoint (newest: step {saved}): "
                              "this session's steps are lost; lower --stop-after-hours to leave more time to save")
        if code == 0:
            log(f"{stage}: done; the run is in {run_dir}")
            record["stages"][stage] = "ok"
        elif code == EXIT_INTERRUPTED:
            record["stages"][stage] = "stopped"
            if stopped_by_budget:  # a clean end: the output is kept, and the next version resumes from it
                code = 0
            why = "before Kaggle's session limit" if stopped_by_budget else "by a signal (the session ended?)"
            log(f"{stage}: stopped {why}, with a checkpoint in {run_dir / 'checkpoints'}; to continue: ptbr kaggle "
                "push BUNDLE --kernel-only (a bundle made with --resume-from-previous)")
        else:
            raise StageFailed(f"ptbr {command} exited with {code} (its error line is above and in "
                              f"{run_dir / 'train.log'})")
    except Stopped as stopped:
        record["stages"][stage] = "stopped"
        record["failure"] = f"stopped by {stopped} at stage {stage}"
        if stage == "resume" and holds_something(run_dir):  # put in place whole (one rename) before the stop
            record["stages"][stage], record["had_run"] = "ok", True
        if record["stages"].get("resume") != "ok":
            where = ("before the resume stage had copied the previous version's run whole: the next version does "
                     f"not resume from this output ({RUN_MARKER} says so); the run is still in the output of the "
                     "version before, if there was one")
        elif holds_something(run_dir):
            where = f"the run is in {run_dir}, for the next version to resume from"
        else:
            where = f"{run_dir} holds no run: this version had none to resume"
        log(f"stopped by {stopped} at stage {stage} (the session ended?); {where}")
        code = EXIT_INTERRUPTED
    except StageFailed as failure:
        record["stages"][stage] = "failed"
        record["failure"] = str(failure)
        log(f"FAILED at stage {stage}: {failure}")
        code = code if code not in (0, EXIT_INTERRUPTED) else 1
    except Exception as exc:  # noqa: BLE001 - a kernel's log must name the stage whatever went wrong
        record["stages"][stage] = "failed"
        record["failure"] = f"{type(exc).__name__}: {exc}"
        log(f"FAILED at stage {stage}: unexpected {type(exc).__name__}: {exc}")
        code = 1
    finally:
        for sig in handlers:  # a signal now must not cut the record short
            signal.signal(sig, signal.SIG_IGN)
        record.update(exit_code=code, ended=_now(), hours=round((time.monotonic() - started) / 3600, 3))
        write_record(working, record)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --- environment ---------------------------------------------------------------------------------


def describe_environment() -> str:
    glibc = " ".join(platform.libc_ver()) or "unknown"
    parts = [f"Python {platform.python_version()} ({sys.executable})", f"{platform.system()} {platform.machine()}",
             f"libc {glibc}", f"run type {os.environ.get('KAGGLE_KERNEL_RUN_TYPE', 'not on Kaggle')}"]
    gpus = visible_gpus()
    parts.append(f"GPUs: {'; '.join(gpus) if gpus else 'none found'}")
    return ", ".join(parts)


def visible_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (none without the tool)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.startswith("GPU ")]


def require_a_gpu(settings_file: Path) -> None:
    """A run on Kaggle is for its GPUs: with none visible (the accelerator left off in the kernel's
    settings), `device: auto` would train on the CPU for the whole session and end "complete". Only
    a bundle whose settings say `device: cpu` runs there."""
    try:
        device = json.loads(settings_file.read_text(encoding="utf-8")).get("device", "auto")
    except (OSError, ValueError, AttributeError):
        device = "auto"
    if device != "cpu" and not visible_gpus():
        raise StageFailed("no GPU is visible to this session: turn on the GPU accelerator (GPU T4 x2) in the "
                          "kernel's settings and run it again (a bundle whose settings say device: cpu runs on the "
                          "CPU)")


# --- bundle ----------------------------------------------------------------------------------------


def find_markers(top: Path, name: str, depth: int = SEARCH_DEPTH) -> list[Path]:
    """Every file called `name` at most `depth` folders below `top` (not following links out)."""
    found = []
    if not top.is_dir():
        return found
    for folder, subfolders, files in os.walk(top):
        level = len(Path(folder).relative_to(top).parts)
        if name in files:
            found.append(Path(folder) / name)
        if level >= depth:
            subfolders.clear()
        subfolders.sort()
    return found


def find_bundle(inputs: Path, wanted: str) -> tuple[Path, dict]:
    candidates = []
    for marker in find_markers(inputs, BUNDLE_MARKER):
        try:
            info = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log(f"bundle: skipping unreadable {marker}: {exc}")
            continue
        if not wanted or info.get("id") == wanted:
            candidates.append((marker.parent, info))
    if not candidates:
        what = f"bundle {wanted}" if wanted else "ptbr bundle"
        raise StageFailed(f"no {what} ({BUNDLE_MARKER}) under {inputs}: is the dataset attached "
                          "(dataset_sources in kernel-metadata.json) and finished processing?")
    if len(candidates) > 1:
        places = ", ".join(str(folder) for folder, _ in candidates)
        if wanted:
            log(f"bundle: {wanted} is attached more than once ({places}); using the first")
        else:
            raise StageFailed(f"several ptbr bundles attached ({places}); attach one")
    return candidates[0]


def check_bundle(bundle: Path, info: dict, scratch: Path) -> dict[str, Path]:
    """The bundle's folders (wheels, data, base), each as Kaggle mounted it or, where Kaggle kept a
    folder as its .zip archive, unpacked into `scratch`; every listed file is checked."""
    folders: dict[str, Path] = {}
    for name in info["folders"]:
        folder = bundle / name
        if not folder.is_dir() and (bundle / f"{name}.zip").is_file():
            folder = scratch / name
            log(f"bundle: {name}/ arrived as {name}.zip: unpacking it to {folder}")
            shutil.rmtree(folder, ignore_errors=True)
            with zipfile.ZipFile(bundle / f"{name}.zip") as archive:
                archive.extractall(folder)
        folders[name] = folder
    problems = []
    for relative, expected in sorted(info["files"].items()):
        top, _, rest = relative.partition("/")
        path = folders[top] / rest if rest and top in folders else bundle / relative
        if not path.is_file():
            problems.append(f"{relative} is missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"{relative} has {path.stat().st_size} bytes, not {expected['bytes']}")
        elif (relative.endswith(".whl") or expected["bytes"] <= HASHED_UP_TO) and sha256(path) != expected["sha256"]:
            problems.append(f"{relative} does not match its sha256")
    if problems:
        raise StageFailed(f"the bundle at {bundle} is incomplete: {'; '.join(problems[:5])}"
                          f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}; "
                          "push the bundle again (ptbr kaggle push checks what arrived)")
    return folders


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# --- install ---------------------------------------------------------------------------------------


def install(wheels: Path, info: dict) -> None:
    """pip from the bundle's wheels only. --isolated: no pip configuration or PIP_* variable of the
    image can point pip at an index (there is no network) or change what it installs. --no-compile:
    Python compiles the modules a run imports when it imports them, a fraction of transformers'."""
    requirement = f"{info['requirement']}=={info['ptbr_version']}"
    command = [sys.executable, "-m", "pip", "--isolated", "install", "--no-index", "--find-links", str(wheels),
               "--no-compile", "--disable-pip-version-check", "--no-input", "--progress-bar", "off", requirement]
    log(f"install: {' '.join(command)}")
    code = subprocess.run(command).returncode
    if code != 0:
        raise StageFailed(f"pip exited with {code}: a dependency is missing from the bundle or does not fit "
                          f"this image (Python {platform.python_version()}; the bundle was made for Python "
                          f"{info['python']}): bundle again with --python-version {sys.version_info[0]}."
                          f"{sys.version_info[1]}")
    listed = subprocess.run([sys.executable, "-m", "pip", "--isolated", "list", "--format=freeze",
                             "--disable-pip-version-check"], capture_output=True, text=True)
    wanted = {canonical(name) for name in info.get("log_versions", [])}
    versions = [line for line in listed.stdout.split() if canonical(line.split("==")[0]) in wanted]
    log(f"install: done; {', '.join(versions)}")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- resume ------------------------------------------------------------------------------------------


def restore_previous_run(inputs: Path, bundle_id: str, run_dir: Path, working: Path) -> str | None:
    """Copy the run a previous version of this kernel left (found by its RUN_MARKER under
    /kaggle/input, naming the bundle `bundle_id`; empty: any) into run_dir, which must be writable:
    /kaggle/input is read-only. Files are copied without their permission bits, which may be
    read-only there. It runs before the bundle is looked at, so that a version failing at any later
    stage still leaves the run in its output for the next one. The files go to a folder beside
    run_dir, renamed to run_dir once all are there: a version stopped while copying leaves no run_dir
    (and a record that says so, which the next version does not resume from)."""
    previous, cut_short, untrained = [], [], []
    for marker in find_markers(inputs, RUN_MARKER):
        try:
            record = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or bundle_id and record.get("bundle") != bundle_id:
            continue
        ended = ended_before_resuming(record)
        if ended:
            log(f"resume: not resuming from {marker.parent}: that version {ended}")
            cut_short.append((marker.parent, ended))
        elif (marker.parent / RUN_DIR).is_dir():
            previous.append(marker.parent / RUN_DIR)
        elif ended_before_training(record):
            untrained.append((marker.parent, ended_before_training(record)))
    if not previous:
        of = f" of {bundle_id}" if bundle_id else ""
        if EXPECT_PREVIOUS and cut_short:
            folder, ended = cut_short[0]
            raise StageFailed(f"the previous version's output attached at {folder} holds no run to resume from: "
                              f"that version {ended}, so the run is still in the output of an earlier version "
                              f"(the last one whose resume stage was done): attach that output (its {RUN_MARKER} "
                              f"and {RUN_DIR}/ are found anywhere under {inputs}) and push again, or bundle again "
                              "without --resume-from-previous to start the run over")
        if EXPECT_PREVIOUS and untrained:  # no run ever: nothing to lose by starting over
            folder, ended = untrained[0]
            log(f"resume: the previous version ({folder}) {ended} before any training: starting the run over")
            return None
        if EXPECT_PREVIOUS:
            raise StageFailed(f"the previous version's output was attached to resume from, but no {RUN_MARKER}"
                              f"{of} with its run/ is under {inputs}: Kaggle did not mount it, or that version "
                              "left none; look at its output (ptbr kaggle output), then push again")
        if cut_short:
            log("resume: no previous version's output attached holds a run to resume from: starting a new run")
        else:
            log("resume: no previous version's output is attached (the first version, a bundle made without "
                "--resume-from-previous, or the last version left none): starting a new run")
        return None
    source = previous[0]
    if holds_something(run_dir):
        log(f"resume: {run_dir} already holds a run: continuing it, not {source}")
        return None
    files = [p for p in sorted(source.rglob("*")) if p.is_file() and not _not_carried(p.relative_to(source))]
    size = sum(p.stat().st_size for p in files)
    free = shutil.disk_usage(working if working.exists() else working.parent).free
    if size > free:
        raise StageFailed(f"the previous run at {source} holds {size / 1e9:.1f} GB, more than the "
                          f"{free / 1e9:.1f} GB free in {working}: bundle with a smaller keep_last")
    copying = run_dir.with_name(f".tmp-{run_dir.name}")  # a .tmp- name: never carried on, nor taken for a run
    shutil.rmtree(copying, ignore_errors=True)  # a copy a killed session left
    try:
        for path in files:
            target = copying / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        copying.mkdir(parents=True, exist_ok=True)  # a run of no files is still one
        if run_dir.exists():
            run_dir.rmdir()  # empty (a run in it is continued above)
        os.replace(copying, run_dir)
    except BaseException:  # a stop (Stopped), a full disk: no part of the run is left to be taken for it
        shutil.rmtree(copying, ignore_errors=True)
        raise
    log(f"resume: copied the previous version's run from {source} to {run_dir} ({len(files)} files, "
        f"{size / 1e9:.2f} GB); training continues from its newest intact checkpoint")
    return str(source)


def ended_before_resuming(record: dict) -> str | None:
    """How the version that wrote `record` ended, where that was before its resume stage was done
    (stopped or failed at its environment or resume stage): its output holds no run whole to resume
    from. None for any other record (one written before the kernel had these stages included)."""
    stages = record.get("stages")
    if not isinstance(stages, dict) or "environment" not in stages or stages.get("resume") == "ok":
        return None
    where = next((name for name, state in stages.items() if state != "ok"), "resume")
    return f"ended before its resume stage was done ({stages.get(where, 'ended')} at stage {where})"


def ended_before_training(record: dict) -> str | None:
    """Where the version that wrote `record` ended, where it had no run to resume (`had_run` false)
    and ended before its train stage: its output holds no run/, and none was ever lost. None for any
    other record (one that had a run, or trained, and left no run/ lost it: that is an error)."""
    stages = record.get("stages")
    if (not isinstance(stages, dict) or record.get("had_run") is not False or stages.get("resume") != "ok"
            or "train" in stages):
        return None
    where = next((name for name, state in stages.items() if state != "ok"), None)
    return f"ended at stage {where} ({stages[where]})" if where else f"ended after stage {list(stages)[-1]}"


def holds_something(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def _not_carried(relative: Path) -> bool:
    return relative.parts[0] in NOT_CARRIED or any(part.startswith((".tmp-", ".old-")) for part in relative.parts)


# --- preflight and training --------------------------------------------------------------------------


def find_base(inputs: Path, info: dict, folders: dict[str, Path], exclude: Path) -> Path | None:
    """The base model of a fine-tuning run: the bundle's base/ folder, or the Kaggle model attached
    through model_sources, found by its config.json under /kaggle/input (its mount point has changed
    before: look for the model's path components rather than one layout). Neither the bundle
    (`exclude`) nor a previous run's output (final/ and merged/ hold a config.json) is taken for it."""
    base = info.get("base") or {}
    if "folder" in base:
        return folders[base["folder"]]
    if "kaggle" not in base:
        return None
    owner, model, framework, variation, *version = base["kaggle"].split("/")
    found = []
    for config in find_markers(inputs, "config.json", depth=SEARCH_DEPTH + 2):
        folder = config.parent
        if folder.is_relative_to(exclude) or any((parent / RUN_MARKER).is_file() for parent in folder.parents):
            continue
        parts = [part.lower() for part in folder.relative_to(inputs).parts]
        if model.lower() in parts and variation.lower() in parts:
            found.append(folder)
    if version:
        found = [folder for folder in found if version[0] in folder.relative_to(inputs).parts] or found
    if not found:
        raise StageFailed(f"the Kaggle model {base['kaggle']} is not under {inputs} (no config.json in a folder "
                          "named after it): is it in model_sources of kernel-metadata.json?")
    found.sort(key=lambda folder: len(folder.parts))
    if len(found) > 1:
        log(f"preflight: several folders match the model {base['kaggle']}: {', '.join(map(str, found))}; "
            f"using {found[0]}")
    return found[0]


def run_paths(bundle: Path, info: dict, folders: dict[str, Path], base: Path | None, run_dir: Path) -> list[str]:
    """The flags that say where things are on this machine; every other setting is in the bundle's
    settings file. Without a data folder, `ptbr train` takes the PT-BR sample inside ptbr."""
    paths = ["--config", str(bundle / info["settings"]), "--output", str(run_dir)]
    if "data" in folders:
        paths += ["--data", str(folders["data"])]
    if base is not None:
        paths += ["--base", str(base)]
    return paths


# The internet is off: ptbr loads only local files, and the libraries under it must not wait on the
# network (Hugging Face's hub would retry before failing).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def ptbr_environment(info: dict) -> dict[str, str]:
    """The environment of ptbr's processes: this one's, offline, and the bundle's --env settings."""
    return {**os.environ, **OFFLINE, **info.get("env", {})}


def run_ptbr(stage: str, args: list[str], env: dict[str, str]) -> int:
    command = [sys.executable, "-m", "ptbr", *args]
    log(f"{stage}: {' '.join(command)}")
    return subprocess.run(command, env=env).returncode


def train(stage: str, command: list[str], env: dict[str, str], budget_s: float) -> tuple[int, bool]:
    """Run the training command; a SIGTERM/SIGINT to this kernel, or the time budget running out, is
    passed on to it once. Returns its exit code and whether the budget stopped it."""
    log(f"{stage}: {' '.join(command)}")
    # A session of its own: a signal Kaggle sends to the whole process group reaches ptbr once,
    # through forward(), not twice (a second SIGINT would stop it without saving).
    child = subprocess.Popen(command, env=env, start_new_session=True)
    stop = threading.Event()
    by_budget = threading.Event()

    def forward(signum: int, _frame=None) -> None:
        if not stop.is_set():
            stop.set()
            log(f"{stage}: got {signal.Signals(signum).name}: asking ptbr to save a checkpoint and stop")
            for pid in ptbr_workers(child.pid) or [child.pid]:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def out_of_time() -> None:
        if not stop.is_set():
            by_budget.set()
            log(f"{stage}: {budget_s / 3600:.2f} h budget used: asking ptbr to save a checkpoint and stop before "
                "Kaggle ends the session")
            forward(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    timer = threading.Timer(max(budget_s, 0.0), out_of_time)
    timer.daemon = True
    timer.start()
    try:
        code = child.wait()
    finally:
        timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, by_budget.is_set()


# --- outputs -------------------------------------------------------------------------------------------


def ptbr_workers(launcher: int) -> list[int]:
    """The `python -m ptbr` processes that ptbr's launcher started (data parallelism), else none.
    The stop signal goes to them, not to the launcher: torch's launcher, signalled, signals its
    workers and kills them 30 s later (Kaggle's torch has no setting for that), which the last
    step and a large checkpoint outlast; the workers stop together, and the launcher then exits 130."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2:].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        if parent == launcher and b"-m" in command and b"ptbr" in command:
            found.append(int(entry.name))
    return sorted(found)


def newest_checkpoint_step(run_dir: Path) -> int | None:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")
             if p.name.split("_")[1].isdigit() and (p / "trainer_state.json").is_file()]
    return max(steps, default=None)


def write_record(working: Path, record: dict) -> None:
    """The run marker, replaced whole (a session cut while writing leaves the previous one)."""
    try:
        working.mkdir(parents=True, exist_ok=True)
        tmp = working / f".tmp-{RUN_MARKER}"
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, working / RUN_MARKER)
        ended = f"exit code {record['exit_code']}" if "exit_code" in record else "the kernel goes on"
        log(f"outputs: {working / RUN_MARKER}: {json.dumps(record['stages'])}, {ended}")
    except OSError as exc:
        log(f"outputs: cannot write {working / RUN_MARKER}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
