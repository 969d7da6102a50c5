"""`ptbr kaggle bundle`: everything a Kaggle kernel needs to train with the internet off, in two
folders that `ptbr kaggle push` uploads.

BUNDLE/dataset/ (the private dataset OWNER/SLUG):
  wheels/              the ptbr wheel built from this checkout and, from locks/kaggle.txt (the CUDA
                       image's versions), every dependency it needs for Kaggle's Python, checked
                       against the lock's hashes; torch and what only torch needs are left out
                       (Kaggle's image has a CUDA build). On Kaggle pip installs only what the image
                       lacks or has in a version ptbr does not accept.
  data/                pretraining: the prepared dataset (train.bin, val.bin, meta.json,
                       tokenizer.json); fine-tuning: train.jsonl and valid.jsonl. None: the PT-BR
                       sample inside ptbr.
  base/                fine-tuning with a local --base: the model's files. A model hosted on Kaggle
                       (--base kaggle:OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION]) is attached instead.
  train-config.json    the run's settings (--config FILE, with paths left to the kernel, and
                       num_processes auto, keep_last 2 where the file says nothing).
  ptbr-bundle.json     the marker the kernel finds the bundle by: mode, versions, and every file
                       with its size and sha256.
  dataset-metadata.json
BUNDLE/kernel/ (the kernel OWNER/SLUG): ptbr_kernel.py (kaggle/kernel.py) and kernel-metadata.json
(a T4 GPU, internet off, the dataset attached; with --resume-from-previous the kernel's own
previous output; the Kaggle model for a kaggle: base).

No credential is read here: a bundle holds none.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ptbr.config import MODES, build_settings, read_config_file, settings_fields
from ptbr.errors import ConfigError, DataError, KaggleError, ModelError, OutputError, collect
from ptbr.files import file_sha256, is_litter, write_directory, write_json, write_text
from ptbr.kaggle.checkout import checkout_root, load_build_script
from ptbr.kaggle.layout import (
    BASE,
    BUNDLE_MARKER,
    DATA,
    DATASET,
    DATASET_METADATA,
    KAGGLE_MODEL,
    KAGGLE_RUN_DEFAULTS,
    KERNEL,
    KERNEL_FILE,
    KERNEL_METADATA,
    SETTINGS_FILE,
    WHEELS,
    is_bundle,
    kernel_title,
    resolved_path,
)
from ptbr.kaggle.settings import BundleSettings
from ptbr.log import log, shout

# Settings that name files on this machine, and resume: the kernel passes its own (--data, --base,
# --output, --resume auto).
LOCAL_PATHS = ("data", "valid", "tokenizer", "base", "output", "resume")
# What Kaggle's kernels can use: CUDA (or the CPU), through torch.
KAGGLE_DEVICES = ("auto", "cuda", "cpu")
KAGGLE_BACKENDS = ("auto", "torch")
KAGGLE_GPUS = 2  # the T4 x 2 machine the kernel asks for
# Never bundled: Kaggle's image ships a CUDA build of torch, with the libraries only it needs.
LEFT_TO_KAGGLE = "torch"
# The platform pyproject's markers are read for: Kaggle's machines.
KAGGLE_MARKERS = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "os_name": "posix", "implementation_name": "cpython"}


@dataclass(frozen=True)
class Plan:
    """What goes into the dataset besides the wheels, resolved and checked before anything is written."""

    settings: dict  # train-config.json
    files: dict[str, Path]  # path inside the dataset -> the file to copy
    base: dict | None  # {"folder": "base"} or {"kaggle": "OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION]"}


def make_bundle(settings: BundleSettings) -> Path:
    """Write the bundle at settings.output (replacing a previous bundle there, never anything else)."""
    collect(settings.problems(), ConfigError, "ptbr kaggle bundle", "see `ptbr kaggle bundle --help`")
    output = resolved_path(settings.output, "--output")
    if output.exists() and not is_bundle(output) and (not output.is_dir() or
                                                     any(not is_litter(p) for p in output.iterdir())):
        raise OutputError("the output exists and is not a bundle: it would be replaced", str(output),
                          "give a new folder (or a previous bundle's) with --output")
    others = not_of_the_bundle(output) if output.exists() and is_bundle(output) else []
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise OutputError(f"the previous bundle there holds files it did not write ({shown}): the new bundle "
                          "would replace them", str(output), "move them out of the folder, or give another --output")
    plan = plan_contents(settings)
    root = checkout_root()
    build = load_build_script(root)
    with tempfile.TemporaryDirectory(prefix="ptbr-kaggle-") as tmp:
        wheels, requirements = wheelhouse(build, settings, Path(tmp))

        def fill(folder: Path) -> None:
            fill_dataset(folder / DATASET, settings, plan, wheels, requirements)
            fill_kernel(folder / KERNEL, root, settings, plan, file_sha256(folder / DATASET / BUNDLE_MARKER))

        write_directory(output, fill, "the Kaggle bundle")
    size = sum(path.stat().st_size for path in (output / DATASET).rglob("*") if path.is_file())
    log(f"bundle {settings.id} ({settings.mode}) written to {output}: {size / 1e6:.1f} MB to upload")
    log(f"next: ptbr kaggle push {output}")
    return output


def not_of_the_bundle(output: Path) -> list[str]:
    """Files in a previous bundle's folder that it did not write (a user's notes, a run fetched
    into it): its marker lists every file of the dataset, the kernel folder holds two."""
    try:
        listed = json.loads((output / DATASET / BUNDLE_MARKER).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        listed = {}
    written = {f"{DATASET}/{name}" for name in listed} | {
        f"{DATASET}/{BUNDLE_MARKER}", f"{DATASET}/{DATASET_METADATA}", f"{KERNEL}/{KERNEL_METADATA}",
        f"{KERNEL}/{KERNEL_FILE}"}
    found = (path.relative_to(output).as_posix() for path in output.rglob("*")
             if (path.is_file() or path.is_symlink()) and not is_litter(path))
    return sorted(name for name in found if name not in written)


# --- what goes in ------------------------------------------------------------------------------------


def plan_contents(settings: BundleSettings) -> Plan:
    """The run's settings, data and base, each checked as the run will check it; every problem of the
    settings at once (exit 2), then the data (3) and the base (4)."""
    cls = MODES[settings.mode]
    file_values = read_config_file(settings.config) if settings.config else {}
    file_values = {str(key).replace("-", "_"): value for key, value in file_values.items()}
    # (a key the run does not know, a path or not, is left in: the check below names it)
    names = {f.name for f, _ in settings_fields(cls)}
    values = {key: value for key, value in file_values.items() if key not in LOCAL_PATHS or key not in names}
    for key, value in KAGGLE_RUN_DEFAULTS.items():
        values.setdefault(key, value)
    # A fine-tuning run needs a base and data; the kernel gives them, so stand-ins make the check pass.
    stand_ins = {"base": "kaggle", "data": "kaggle"} if settings.mode == "finetune" else {}
    checked = build_settings(cls, values, stand_ins, source=settings.config or "ptbr kaggle bundle")
    problems = []
    if getattr(checked, "download", False):
        problems.append("download is true, but a Kaggle kernel runs with the internet off: bundle a local --base "
                        "or attach a Kaggle model (--base kaggle:OWNER/MODEL/FRAMEWORK/VARIATION)")
    if checked.device not in KAGGLE_DEVICES:
        problems.append(f"device {checked.device!r} is not on Kaggle (use {', '.join(KAGGLE_DEVICES)})")
    if checked.backend not in KAGGLE_BACKENDS:
        problems.append(f"backend {checked.backend!r} is not on Kaggle (use {', '.join(KAGGLE_BACKENDS)})")
    # the kernel asks for Kaggle's T4 x 2 (kernel-metadata.json): what those GPUs cannot run would
    # fail only there, after the session started
    planned_elsewhere = ("; a recommended_config.json holds what preflight planned for the machine it ran on"
                         if "reasons" in file_values and file_values.get("planned_for") != "kaggle" else "")
    if checked.precision == "bf16":
        problems.append("precision 'bf16' is not on Kaggle's T4s (no native bf16): set precision to auto (fp16 "
                        f"with a loss scaler there), fp16 or fp32{planned_elsewhere}")
    if str(checked.num_processes).isdigit() and int(checked.num_processes) > KAGGLE_GPUS:
        problems.append(f"num_processes {checked.num_processes} is more than Kaggle's {KAGGLE_GPUS} GPUs: give "
                        f"auto (one per GPU), or {KAGGLE_GPUS} or fewer")
    processes = (KAGGLE_GPUS if checked.device != "cpu" else 1) if checked.num_processes == "auto" else \
        int(checked.num_processes)
    if getattr(checked, "auto_fit", False) and processes > 1:
        auto = " (auto: one per T4)" if checked.num_processes == "auto" else ""
        problems.append(f"auto_fit runs in one process, and num_processes {checked.num_processes}{auto} starts "
                        f"{processes} on Kaggle: set auto_fit false and a batch that fits (`ptbr preflight --for "
                        "kaggle` plans one), or num_processes 1")
    data = settings.data or file_values.get("data")
    if settings.mode == "finetune" and not data:
        problems.append("fine-tuning needs --data (train.jsonl, or a directory with train.jsonl and valid.jsonl)")
    base = settings.base or file_values.get("base")
    if settings.mode == "finetune" and not base:
        problems.append("fine-tuning needs --base: a local model directory, or kaggle:OWNER/MODEL/FRAMEWORK/VARIATION")
    collect(problems, ConfigError, settings.config or "ptbr kaggle bundle", "see `ptbr kaggle bundle --help`")
    for note in underused_t4s(checked, settings.config):
        shout(f"note: {note}{planned_elsewhere}")

    files: dict[str, Path] = {}
    if settings.mode == "pretrain" and data:
        files.update(pretrain_data(data, file_values.get("tokenizer")))
    elif settings.mode == "finetune":
        files.update(finetune_data(data, file_values.get("valid")))
    base_source = None
    if settings.mode == "finetune":
        base_source, base_files = base_model(str(base))
        files.update(base_files)
    return Plan(values, files, base_source)


def underused_t4s(checked, source: str | None) -> list[str]:
    """What the run's settings leave of Kaggle's two T4s that a user may not mean (said, not refused:
    one process is what --compile needs, fp32 can be a choice)."""
    notes, where = [], f" ({source})" if source else ""
    processes = str(checked.num_processes)
    if processes.isdigit() and int(processes) < KAGGLE_GPUS and checked.device != "cpu":
        notes.append(f"num_processes {processes}{where}: the kernel trains on {processes} of Kaggle's "
                     f"{KAGGLE_GPUS} T4s (auto: on both)")
    if checked.precision == "fp32" and checked.device != "cpu":
        notes.append(f"precision fp32{where}: the T4s multiply fp16 on their tensor cores, fp32 without them "
                     "(auto: fp16 with a loss scaler)")
    return notes


def pretrain_data(data: str, tokenizer: str | None) -> dict[str, Path]:
    """The dataset's files as `ptbr train` reads them (checked the same way); its tokenizer lands
    in data/tokenizer.json, where the kernel's `--data` finds it."""
    from ptbr.data.tokens import holds_finetuning_data, open_dataset

    if holds_finetuning_data(data):
        raise DataError("no train.bin in the data directory: it holds fine-tuning data (train.jsonl)", data,
                        "bundle a fine-tuning run with --mode finetune --base BASE, or give a dataset `ptbr prepare` "
                        "wrote")
    dataset = open_dataset(data, tokenizer)
    files = {f"{DATA}/train.bin": dataset.train_path, f"{DATA}/tokenizer.json": dataset.tokenizer_path}
    for name in ("val.bin", "meta.json"):
        if (dataset.directory / name).is_file():
            files[f"{DATA}/{name}"] = dataset.directory / name
    return files


def finetune_data(data: str, valid: str | None) -> dict[str, Path]:
    """train.jsonl and valid.jsonl, with every line checked as `ptbr validate-data` checks it (token
    lengths are checked on Kaggle by preflight, against the base)."""
    from ptbr.finetune.data import data_paths, fix_of, inspect_pair, problems_summary

    train_path, valid_path = data_paths(data, valid)
    failed = [report for report in inspect_pair(train_path, valid_path) if report.problems]
    if failed:
        raise DataError("; ".join(problems_summary(report) for report in failed), data,
                        fix_of(failed, "fix those lines (`ptbr validate-data FILE.jsonl` lists every problem)"))
    files = {f"{DATA}/train.jsonl": train_path}
    if valid_path is not None:
        files[f"{DATA}/valid.jsonl"] = valid_path
    return files


def base_model(base: str) -> tuple[dict, dict[str, Path]]:
    """A Kaggle-hosted model is attached, not uploaded; a local one is copied into base/."""
    from ptbr.finetune.base import check_base

    hosted = KAGGLE_MODEL.match(base)
    if hosted:
        return {"kaggle": "/".join(part for part in hosted.groups() if part)}, {}
    if base.startswith("kaggle:"):
        raise ModelError("not a Kaggle model reference: it needs four parts after kaggle:", base,
                         "give kaggle:OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION], as the model's page on Kaggle "
                         "names it")
    if not Path(base).expanduser().exists():
        raise ModelError("base model directory not found (a Kaggle kernel has no internet: a Hugging Face Hub id "
                         "cannot be downloaded there)", base,
                         "give a local model directory, or a model hosted on Kaggle as "
                         "kaggle:OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION]")
    check_base(base)
    folder = Path(base).expanduser()
    files = {f"{BASE}/{path.relative_to(folder).as_posix()}": path for path in sorted(folder.rglob("*"))
             if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)}
    return {"folder": BASE}, files


# --- the wheelhouse ---------------------------------------------------------------------------------------


def wheelhouse(build, settings: BundleSettings, scratch: Path) -> tuple[dict[str, Path], list[str]]:
    """{file name: wheel}: ptbr built from this checkout, and each dependency it needs on Kaggle at the
    version locks/kaggle.txt pins, downloaded (hash-checked) into the build cache for reuse; and the
    names of ptbr's own requirements (the versions the kernel logs)."""
    try:
        ptbr_wheel = build.build_wheel(scratch / "dist", echo=False)
    except build.BuildError as exc:
        raise KaggleError(f"cannot build the ptbr wheel from the checkout: {exc}", str(build.ROOT),
                          "run `pip wheel --no-deps .` there to see why") from exc
    lock = build.LOCKS["kaggle"].path
    entries = build.lock_entries(lock)
    requirements = wheel_requirements(ptbr_wheel, settings)
    needed = bundled_dependencies(entries, requirements, lock)
    pins = scratch / "kaggle-requirements.txt"
    pins.write_text("".join(entries[name].text for name in sorted(needed)))
    cache = build.CACHE / f"kaggle-cp{settings.python_version.replace('.', '')}"
    log(f"wheelhouse: {len(needed)} dependencies from {lock.name} for CPython {settings.python_version} "
        f"(manylinux_2_{build.KAGGLE_GLIBC_MINOR} x86_64), cached in {cache}")
    try:
        build.download_wheels(pins, cache, settings.python_version, build.KAGGLE_GLIBC_MINOR,
                             pip_options=("--quiet",), echo=False)  # pip's errors still print; its per-wheel
        # lines and its command (27 platform tags) would not help: a failure's message names the command
    except build.BuildError as exc:
        raise KaggleError(f"pip could not download the bundle's wheels: {exc}", str(pins),
                          "check the network to the package index; a pin without a wheel for this Python "
                          f"({settings.python_version}) needs `nox -s locks` or another --python-version") from exc
    wheels = {ptbr_wheel.name: ptbr_wheel}
    problems = []
    for name in sorted(needed):
        entry = entries[name]
        found = [w for w in cache.glob("*.whl") if build.canonical(w.name.split("-")[0]) == name
                 and w.name.split("-")[1] == entry.version]
        if len(found) != 1:
            problems.append(f"{name}=={entry.version}: {len(found)} wheels in {cache}")
        elif file_sha256(found[0]) not in entry.hashes:
            problems.append(f"{found[0].name} is not a file {lock.name} allows (sha256 differs)")
        else:
            wheels[found[0].name] = found[0]
    collect(problems, KaggleError, str(cache), f"empty {cache} and bundle again")
    return wheels, requirements


def wheel_requirements(wheel: Path, settings: BundleSettings) -> list[str]:
    """The names of what the ptbr wheel requires on Kaggle: its core, and the finetune extra for
    fine-tuning (read from the wheel itself, as pip will read it there)."""
    import zipfile
    from email.parser import Parser  # here, not at the top: `ptbr --help` imports this module

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(metadata).decode("utf-8"))
    extras = ("", "finetune") if settings.mode == "finetune" else ("",)
    environment = {**KAGGLE_MARKERS, "python_version": settings.python_version,
                   "python_full_version": f"{settings.python_version}.0"}
    names = []
    for line in message.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or any(requirement.marker.evaluate({**environment, "extra": extra})
                                             for extra in extras):
            names.append(requirement.name)
    return names


def bundled_dependencies(entries: dict, requirements: list[str], lock: Path) -> set[str]:
    """Every locked package the requirements lead to, through the lock's `# via` records, except
    torch and what is there only for torch: Kaggle's image has them."""
    canonical = {re.sub(r"[-_.]+", "-", name).lower() for name in requirements}
    missing = sorted(canonical - set(entries))
    if missing:
        raise ConfigError(f"{lock.name} does not pin {', '.join(missing)}", str(lock),
                          "regenerate the locks with `nox -s locks`")
    asked_by: dict[str, set[str]] = {}
    for name, entry in entries.items():
        for parent in entry.via:
            asked_by.setdefault(re.sub(r"[-_.]+", "-", parent).lower(), set()).add(name)
    needed: set[str] = set()
    todo = [name for name in canonical if name != LEFT_TO_KAGGLE]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        todo += [child for child in asked_by.get(name, ()) if child != LEFT_TO_KAGGLE]
    return needed


# --- writing it ---------------------------------------------------------------------------------------------


def fill_dataset(folder: Path, settings: BundleSettings, plan: Plan, wheels: dict[str, Path],
                 requirements: list[str]) -> None:
    (folder / WHEELS).mkdir(parents=True)
    for name, wheel in sorted(wheels.items()):
        shutil.copyfile(wheel, folder / WHEELS / name)
    for inside, source in plan.files.items():
        (folder / inside).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, folder / inside)
    write_json(folder / SETTINGS_FILE, plan.settings)
    files = {path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
             for path in sorted(folder.rglob("*")) if path.is_file()}
    ptbr_wheel = next(name for name in wheels if name.startswith("ptbr-"))
    info = {
        "format": 1,
        "id": settings.id,
        "mode": settings.mode,
        "ptbr_version": ptbr_wheel.split("-")[1],
        "requirement": "ptbr[finetune]" if settings.mode == "finetune" else "ptbr",
        "python": settings.python_version,
        "settings": SETTINGS_FILE,
        "folders": sorted({name.split("/")[0] for name in files if "/" in name}),
        "base": plan.base,
        "resume_from_previous": settings.resume_from_previous,
        "stop_after_s": round(settings.stop_after_hours * 3600),
        "env": settings.environment(),
        "log_versions": sorted({"ptbr", LEFT_TO_KAGGLE, *requirements}),
        "files": files,
    }
    write_json(folder / BUNDLE_MARKER, info)
    fields = {"owner": settings.owner, "slug": settings.slug, "title": settings.title or settings.slug}
    write_json(folder / DATASET_METADATA, render(template(DATASET_METADATA), fields))


def fill_kernel(folder: Path, root: Path, settings: BundleSettings, plan: Plan, marker_sha256: str) -> None:
    """The kernel script, told which bundle it runs: its id, and the sha256 of its marker (which
    lists every file's), so that it refuses another version of the dataset (one Kaggle has not
    finished processing, or an older one where only the kernel was pushed)."""
    folder.mkdir(parents=True)
    script = (root / "kaggle" / "kernel.py").read_text(encoding="utf-8")
    fills = {'BUNDLE_ID = ""\n': f"BUNDLE_ID = {json.dumps(settings.id)}\n",
             'BUNDLE_SHA256 = ""\n': f"BUNDLE_SHA256 = {json.dumps(marker_sha256)}\n"}
    for placeholder, line in fills.items():
        if script.count(placeholder) != 1:
            raise ConfigError(f"kaggle/kernel.py has no `{placeholder.strip()}` line to fill in", str(root / "kaggle"),
                              "restore kaggle/kernel.py from the repository")
        script = script.replace(placeholder, line)
    write_text(folder / KERNEL_FILE, script, KERNEL_FILE)
    title = settings.title or settings.slug
    fields = {"owner": settings.owner, "slug": settings.slug, "kernel_title": kernel_title(title, settings.slug)}
    metadata = render(template(KERNEL_METADATA), fields)
    metadata["code_file"] = KERNEL_FILE
    metadata["kernel_sources"] = [settings.id] if settings.resume_from_previous else []
    metadata["model_sources"] = [plan.base["kaggle"]] if plan.base and "kaggle" in plan.base else []
    write_json(folder / KERNEL_METADATA, metadata)


def template(name: str) -> dict:
    return json.loads((checkout_root() / "kaggle" / name).read_text(encoding="utf-8"))


def render(value, fields: dict[str, str]):
    """A template with {owner}, {slug}, ... filled in every string."""
    if isinstance(value, str):
        return value.format_map(fields)
    if isinstance(value, list):
        return [render(item, fields) for item in value]
    if isinstance(value, dict):
        return {key: render(item, fields) for key, item in value.items()}
    return value
