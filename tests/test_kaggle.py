"""`ptbr kaggle`: bundles checked against the lock and the Kaggle client's own rules; push, status
and output through the real `kaggle` client against a local fake Kaggle (tests/kaggle_fake.py),
a dropped upload included; and the kernel script run here as Kaggle runs it: a fresh virtual
environment with only torch, the bundle under $KAGGLE_ROOT/input, no package index, a session
ended by SIGTERM, and the next version resuming from the first one's output."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import tests.test_finetune as finetune_tests
from ptbr.cli import main
from ptbr.data import SAMPLE_DIR
from ptbr.errors import KaggleError
from ptbr.kaggle import layout, remote
from ptbr.kaggle.client import connect
from tests import kaggle_fake
from tests.kaggle_fake import KEY, TOKEN, USERNAME, FakeKaggle

ROOT = Path(__file__).resolve().parents[1]
LOCAL_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
SLUG = "ptbr-tiny-run"
KERNEL_ID = f"{USERNAME}/{SLUG}"
# A run short enough for a shared CPU, long enough to be stopped halfway: a checkpoint every step.
# Two processes: the kernel trains through ptbr's data-parallel launcher, as on Kaggle's two T4s
# (there `num_processes: auto`, the bundle's default, counts the GPUs; here gloo on the CPU).
TINY = {"model_size": "tiny", "max_steps": 24, "batch_size": 1, "seq_len": 16, "save_every": 1, "eval_every": 0,
        "eval_batches": 1, "log_every": 1, "num_processes": "2", "device": "cpu"}  # no GPU here: said so
toy = finetune_tests.toy


def load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


KERNEL = load_script(ROOT / "kaggle" / "kernel.py", "ptbr_kaggle_kernel")
BUILD = load_script(ROOT / "docker" / "build.py", "ptbr_build_for_kaggle")


def last_error(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def ptbr(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m ptbr ARGS` in a process of its own, from the checkout."""
    return subprocess.run([sys.executable, "-m", "ptbr", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def files_of(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def holds(folder: Path, secret: str) -> list[str]:
    return [name for name, path in files_of(folder).items() if secret.encode() in path.read_bytes()]


# --- bundles -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    """A pretraining bundle for this machine's Python (the kernel runs here), resuming across versions."""
    folder = tmp_path_factory.mktemp("tiny-bundle")
    config = folder / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = folder / "bundle"
    with pytest.MonkeyPatch.context() as patch:  # credentials where Kaggle's client would find them: none is read
        patch.setenv("KAGGLE_USERNAME", USERNAME)
        patch.setenv("KAGGLE_KEY", KEY)
        assert main(["kaggle", "bundle", "--output", str(out), "--owner", USERNAME, "--slug", SLUG, "--data",
                     str(SAMPLE_DIR), "--config", str(config), "--python-version", LOCAL_PYTHON,
                     "--resume-from-previous", "--env", "NCCL_P2P_DISABLE=1"]) == 0
    return out


def test_the_kernel_script_ptbr_and_the_build_script_agree():
    for name in ("BUNDLE_MARKER", "RUN_MARKER", "RUN_DIR"):
        assert getattr(KERNEL, name) == getattr(layout, name), name
    assert BUILD.KAGGLE_PYTHON == layout.KAGGLE_PYTHON == BUILD.LOCKS["kaggle"].python
    assert (ROOT / "kaggle" / "kernel.py").read_text().count('BUNDLE_ID = ""\n') == 1
    assert (ROOT / "kaggle" / "kernel.py").read_text().count('BUNDLE_SHA256 = ""\n') == 1
    assert (ROOT / "kaggle" / "kernel.py").read_text().count("\nEXPECT_PREVIOUS = False\n") == 1  # ptbr kaggle push sets it


@pytest.mark.slow  # a bundle (wheels from the cache or the index) or a new virtual environment
def test_a_pretraining_bundle_holds_the_locked_wheels_without_torch_and_no_local_paths(tiny_bundle):
    dataset, kernel = tiny_bundle / layout.DATASET, tiny_bundle / layout.KERNEL
    info = json.loads((dataset / layout.BUNDLE_MARKER).read_text())
    entries = BUILD.lock_entries(BUILD.LOCKS["kaggle"].path)
    wheels = {BUILD.canonical(w.name.split("-")[0]): w for w in (dataset / layout.WHEELS).glob("*.whl")}
    # ptbr's requirements and what they need, at the lock's versions and hashes
    assert {"ptbr", "transformers", "tokenizers", "safetensors", "accelerate", "numpy", "huggingface-hub",
            "pyyaml", "psutil", "tqdm"} <= set(wheels)
    for name, wheel in wheels.items():
        if name != "ptbr":
            assert wheel.name.split("-")[1] == entries[name].version, wheel.name
            assert BUILD.sha256(wheel) in entries[name].hashes, wheel.name
    # Kaggle's image brings torch and what only torch needs; fine-tuning's extra is not asked for
    assert not {"torch", "triton", "sympy", "networkx", "jinja2", "peft", "bitsandbytes"} & set(wheels)
    assert not [name for name in wheels if name.startswith(("nvidia", "cuda"))]
    assert info["requirement"] == "ptbr" and info["python"] == LOCAL_PYTHON and info["mode"] == "pretrain"
    assert info["env"] == {"NCCL_P2P_DISABLE": "1"} and info["stop_after_s"] == 11.5 * 3600
    # every file listed with its size and sha256
    listed = {name: path for name, path in files_of(dataset).items()
              if name not in (layout.BUNDLE_MARKER, layout.DATASET_METADATA)}
    assert set(info["files"]) == set(listed)
    for name, path in listed.items():
        assert info["files"][name] == {"bytes": path.stat().st_size, "sha256": BUILD.sha256(path)}
    for name in ("train.bin", "val.bin", "meta.json", "tokenizer.json"):
        assert (dataset / "data" / name).read_bytes() == (SAMPLE_DIR / name).read_bytes()
    # the run's settings, with Kaggle's defaults where the config says nothing, and no path of this machine
    settings = json.loads((dataset / layout.SETTINGS_FILE).read_text())
    assert settings == {**TINY, "keep_last": 2}, "the config's own num_processes is kept"
    script = (kernel / layout.KERNEL_FILE).read_text()
    marker_sha = BUILD.sha256(dataset / layout.BUNDLE_MARKER)
    filled = {f'BUNDLE_ID = "{KERNEL_ID}"\n': 'BUNDLE_ID = ""\n', f'BUNDLE_SHA256 = "{marker_sha}"\n': 'BUNDLE_SHA256 = ""\n'}
    for line, placeholder in filled.items():
        assert line in script
        script = script.replace(line, placeholder)
    assert script == (ROOT / "kaggle" / "kernel.py").read_text()
    metadata = json.loads((kernel / layout.KERNEL_METADATA).read_text())
    assert metadata["enable_internet"] is False and metadata["enable_gpu"] is True
    assert metadata["machine_shape"] == "NvidiaTeslaT4" and metadata["is_private"] is True
    assert metadata["dataset_sources"] == [KERNEL_ID] and metadata["kernel_sources"] == [KERNEL_ID]
    assert metadata["model_sources"] == [] and metadata["code_file"] == layout.KERNEL_FILE
    assert holds(tiny_bundle, KEY) == [], "made with credentials in the environment: none in the bundle"


@pytest.fixture(scope="module")
def kaggle_client(tmp_path_factory):
    """The kaggle package's KaggleApi, imported with no credentials and a home of its own (it
    authenticates and creates its config folder at import time)."""
    home = tmp_path_factory.mktemp("kaggle-home")
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("KAGGLE_")]:
            patch.delenv(name)
        patch.setenv("HOME", str(home))
        patch.setenv("KAGGLE_CONFIG_DIR", str(home / ".kaggle"))
        with contextlib.redirect_stdout(io.StringIO()):
            from kaggle.api.kaggle_api_extended import KaggleApi
            from slugify import slugify
        return KaggleApi(), slugify


def check_with_the_client(bundle: Path, kaggle_client) -> None:
    """The client's own checks of dataset and kernel metadata (those it runs before any request)."""
    api, slugify = kaggle_client
    dataset = json.loads(Path(api.get_dataset_metadata_file(str(bundle / layout.DATASET))).read_text())
    api.validate_dataset_string(dataset["id"])
    owner, slug = dataset["id"].split("/")
    api._validate_slug_syntax(slug)
    api._validate_slug_syntax(owner, allow_underscore=True)
    assert 6 <= len(slug) <= 50 and 6 <= len(dataset["title"]) <= 50 and len(dataset["licenses"]) == 1
    assert 20 <= len(dataset["subtitle"]) <= 80 and "INSERT_" not in json.dumps(dataset)
    kernel = json.loads((bundle / layout.KERNEL / layout.KERNEL_METADATA).read_text())
    assert api.parse_kernel_string(kernel["id"])[2] is None  # no version in the id
    assert len(kernel["title"]) >= 5 and slugify(kernel["title"]) == kernel["id"].split("/")[1]
    assert (bundle / layout.KERNEL / kernel["code_file"]).is_file()
    assert kernel["language"] in api.valid_push_language_types and kernel["kernel_type"] in api.valid_push_kernel_types
    for source in kernel["dataset_sources"]:
        api.validate_dataset_string(source)
    for source in kernel["kernel_sources"]:
        api.validate_kernel_string(source)
    for source in kernel["model_sources"]:
        api.validate_model_instance_version_string(source)
    # the client defaults an absent enable_internet to True: it must be there, and false
    assert api.get_bool(kernel, "enable_internet", True) is False and api.get_bool(kernel, "enable_gpu", False)


@pytest.mark.slow  # a bundle (wheels from the cache or the index) or a new virtual environment
def test_the_metadata_passes_the_clients_own_checks(tiny_bundle, kaggle_client):
    check_with_the_client(tiny_bundle, kaggle_client)


@pytest.mark.slow
def test_a_finetuning_bundle_for_kaggles_python_takes_the_right_bitsandbytes(tmp_path, toy, kaggle_client):
    """Python 3.12 wheels for Kaggle; bitsandbytes from the lock (0.50, manylinux_2_24), not the pure
    Python 0.42 that a manylinux2014-only download silently picks; a Kaggle-hosted base attached."""
    out = tmp_path / "bundle"
    assert main(["kaggle", "bundle", "--output", str(out), "--owner", USERNAME, "--slug", "ptbr-farense-qlora",
                 "--mode", "finetune", "--data", str(toy.data), "--title", "PTBR Farense QLoRA",
                 "--base", "kaggle:mistral-ai/mistral/transformers/7b-v0.1/1"]) == 0
    check_with_the_client(out, kaggle_client)
    wheels = {w.name for w in (out / "dataset" / "wheels").glob("*.whl")}
    pins = BUILD.lock_pins(BUILD.LOCKS["kaggle"].path)
    (bitsandbytes,) = [w for w in wheels if w.startswith("bitsandbytes-")]
    assert bitsandbytes.split("-")[1] == pins["bitsandbytes"] == "0.50.2" and "manylinux_2_24_x86_64" in bitsandbytes
    assert any(w.startswith(f"peft-{pins['peft']}-") for w in wheels)
    assert any(w.startswith("numpy-") and "-cp312-" in w for w in wheels)
    info = json.loads((out / "dataset" / layout.BUNDLE_MARKER).read_text())
    assert info["requirement"] == "ptbr[finetune]" and info["python"] == "3.12"
    assert info["base"] == {"kaggle": "mistral-ai/mistral/transformers/7b-v0.1/1"}
    assert sorted(f for f in info["files"] if f.startswith("data/")) == ["data/train.jsonl", "data/valid.jsonl"]
    # no --config: Kaggle's defaults, one process per GPU (both T4s) and two checkpoints kept
    settings = json.loads((out / "dataset" / layout.SETTINGS_FILE).read_text())
    assert settings == {"num_processes": "auto", "keep_last": 2}
    metadata = json.loads((out / "kernel" / layout.KERNEL_METADATA).read_text())
    assert metadata["title"] == "PTBR Farense QLoRA" and metadata["id"] == f"{USERNAME}/ptbr-farense-qlora"
    assert metadata["model_sources"] == ["mistral-ai/mistral/transformers/7b-v0.1/1"]
    assert metadata["kernel_sources"] == []

    # a local base goes into the bundle, file by file
    local = tmp_path / "local"
    assert main(["kaggle", "bundle", "--output", str(local), "--owner", USERNAME, "--slug", "ptbr-farense-local",
                 "--mode", "finetune", "--data", str(toy.data), "--base", str(toy.base)]) == 0
    for name, path in files_of(toy.base).items():
        assert (local / "dataset" / "base" / name).read_bytes() == path.read_bytes()
    info = json.loads((local / "dataset" / layout.BUNDLE_MARKER).read_text())
    assert info["base"] == {"folder": "base"}
    assert json.loads((local / "kernel" / layout.KERNEL_METADATA).read_text())["model_sources"] == []


def test_bundle_refuses_what_kaggle_would_refuse_before_downloading_anything(tmp_path, capsys, toy):
    def refused(args: list[str], code: int) -> str:
        assert main(["kaggle", "bundle", "--output", str(tmp_path / "b"), *args]) == code
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "b").exists()
        return err

    err = refused(["--owner", "Ptbr Tester", "--slug", "tiny", "--title", "abc", "--env", "KAGGLE_KEY=x",
                   "--env", "HF_TOKEN=y", "--env", "nonsense", "--stop-after-hours", "13", "--python-version", "3.9",
                   "--env", "NCCL_P2P_DISABLE=1", "--env", "NCCL_P2P_DISABLE=0"], 2)
    assert "--python-version 3.9: ptbr needs Python 3.10 or newer" in err
    assert "--env NCCL_P2P_DISABLE is given 2 times: give it once" in err
    assert "9 problems" in err and "--owner" in err and "--slug 'tiny'" in err and "--title 'abc'" in err
    assert "--env KAGGLE_KEY: a bundle holds no credentials" in err and "--env HF_TOKEN" in err
    assert "--env 'nonsense' is not NAME=VALUE" in err and "--stop-after-hours must be within (0, 12]" in err
    config = tmp_path / "run.yaml"
    config.write_text("device: mps\nbackend: mlx\nbatch_size: 0\nbase: models/x\n")
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--config", str(config)], 2)
    assert "batch_size" in err and "unknown key 'base'" in err  # as `ptbr train --config` says
    config.write_text("device: mps\nbackend: mlx\n")
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--config", str(config)], 2)
    assert "device 'mps' is not on Kaggle" in err and "backend 'mlx' is not on Kaggle" in err
    config.write_text("precision: bf16\nnum_processes: '4'\n")  # what Kaggle's two T4s cannot run
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--config", str(config)], 2)
    assert "precision 'bf16' is not on Kaggle's T4s" in err and "num_processes 4 is more than Kaggle's 2 GPUs" in err
    assert "preflight planned" not in err
    # preflight's recommended_config.json from a machine with native bf16 (its plan, not Kaggle's)
    planned = tmp_path / "recommended_config.json"
    planned.write_text(json.dumps({"precision": "bf16", "num_processes": "1", "reasons": ["precision bf16: ..."]}))
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--config", str(planned)], 2)
    assert ("precision 'bf16' is not on Kaggle's T4s (no native bf16): set precision to auto (fp16 with a loss scaler "
            "there), fp16 or fp32; a recommended_config.json holds what preflight planned for the machine it ran on") in err
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--mode", "finetune", "--data", str(toy.data)], 2)
    assert "fine-tuning needs --base" in err
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--mode", "finetune", "--data", str(toy.data),
                   "--base", "mistralai/Mistral-7B-v0.1"], 4)
    assert "no internet" in err and "kaggle:OWNER/MODEL/FRAMEWORK/VARIATION" in err
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--mode", "finetune", "--data", str(toy.data),
                   "--base", "kaggle:mistral-ai/mistral"], 4)
    assert "error: not a Kaggle model reference: it needs four parts after kaggle: (kaggle:mistral-ai/mistral)" in err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--mode", "finetune", "--data", str(broken),
                   "--base", "kaggle:o/m/transformers/v"], 3)
    assert "line 2" in err
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--data", str(tmp_path / "missing")], 3)
    assert "data directory not found" in err
    err = refused(["--owner", USERNAME, "--slug", SLUG, "--data", str(toy.data)], 3)  # pretraining, chat data
    assert "fix: bundle a fine-tuning run with --mode finetune --base BASE" in err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    assert main(["kaggle", "bundle", "--output", str(tmp_path / "b"), "--owner", USERNAME, "--slug", SLUG]) == 6
    assert "is not a bundle" in capsys.readouterr().err and (tmp_path / "b" / "notes.txt").read_text() == "mine"


def test_settings_that_leave_a_t4_idle_are_said_before_bundling(tmp_path, caplog, capsys):
    """A config that trains on one of Kaggle's two T4s, or in fp32 (a preflight plan from a machine
    without a GPU holds both), is bundled as asked, with a note for each; auto says nothing."""
    from ptbr.kaggle.bundle import plan_contents
    from ptbr.kaggle.settings import BundleSettings

    def said() -> str:  # ptbr's console (its handler set up) or, where a handler was left, the log records
        text = caplog.text + capsys.readouterr().err
        caplog.clear()
        return text

    planned = tmp_path / "recommended_config.json"
    planned.write_text(json.dumps({"precision": "fp32", "num_processes": "1", "reasons": ["no GPU: ..."]}))
    plan = plan_contents(BundleSettings(str(tmp_path / "b"), USERNAME, SLUG, config=str(planned)))
    assert plan.settings["num_processes"] == "1" and plan.settings["precision"] == "fp32"
    err = said()
    assert (f"note: num_processes 1 ({planned}): the kernel trains on 1 of Kaggle's 2 T4s (auto: on both); a "
            "recommended_config.json holds what preflight planned for the machine it ran on") in err
    assert f"note: precision fp32 ({planned}): the T4s multiply fp16 on their tensor cores" in err
    plan_contents(BundleSettings(str(tmp_path / "b"), USERNAME, SLUG))
    assert "note:" not in said()
    # a plan made for Kaggle (preflight --for kaggle) in fp32 as asked: the note, not the "another machine" clause
    planned.write_text(json.dumps({"precision": "fp32", "reasons": ["..."], "planned_for": "kaggle"}))
    plan_contents(BundleSettings(str(tmp_path / "b"), USERNAME, SLUG, config=str(planned)))
    err = said()
    assert "note: precision fp32" in err and "preflight planned" not in err


def test_a_previous_bundle_holding_files_of_yours_is_not_replaced(tiny_bundle, tmp_path, capsys):
    """A bundle is replaced whole: notes put in its folder, or a run fetched into it, would go too."""
    from ptbr.kaggle.bundle import not_of_the_bundle

    assert not_of_the_bundle(tiny_bundle) == []
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    (copy / "NOTES.txt").write_text("mine")
    (copy / "out" / "run").mkdir(parents=True)
    (copy / "out" / "run" / "model.safetensors").write_bytes(b"weights")
    (copy / "dataset" / "my-readme.md").write_text("mine")
    assert main(["kaggle", "bundle", "--output", str(copy), "--owner", USERNAME, "--slug", SLUG]) == 6
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: the previous bundle there holds files it did not write (NOTES.txt, dataset/my-readme.md, "
        f"out/run/model.safetensors): the new bundle would replace them ({copy}); fix: move them out of the "
        "folder, or give another --output")
    assert (copy / "NOTES.txt").read_text() == "mine" and (copy / "out" / "run" / "model.safetensors").is_file()
    # nor does fetching a kernel's outputs replace a folder of other files (refused before connecting)
    assert main(["kaggle", "output", str(tiny_bundle), "--path", str(copy)]) == 6
    assert "the download folder holds something other than a previous download" in capsys.readouterr().err


# --- push, status and output through the real client -------------------------------------------------------


@pytest.fixture
def fake(tmp_path):
    with FakeKaggle() as server:
        server.home, server.tmp = tmp_path / "home", tmp_path / "tmp"
        server.home.mkdir()
        server.tmp.mkdir()
        yield server


def kaggle(fake: FakeKaggle, *args: str, credentials: str = "key") -> subprocess.CompletedProcess:
    """`ptbr kaggle ARGS` against the fake, with the client's state (HOME, TMPDIR) the test's own."""
    env = fake.env(str(fake.home), str(fake.tmp), credentials)
    run = ptbr("kaggle", *args, env=env)
    for secret in (KEY, TOKEN):
        assert secret not in run.stdout + run.stderr, "a credential was printed"
    return run


def uploaded_marker(fake: FakeKaggle, dataset: str) -> bytes:
    return fake.datasets[dataset].versions[-1][layout.BUNDLE_MARKER]


@pytest.mark.slow
def test_push_creates_the_dataset_waits_checks_every_file_then_pushes_the_kernel(fake, tiny_bundle):
    run = kaggle(fake, "push", str(tiny_bundle), "--poll-seconds", "0.01")
    assert run.returncode == 0, run.stderr
    files = len(json.loads((tiny_bundle / "dataset" / layout.BUNDLE_MARKER).read_text())["files"]) + 1
    assert f"all {files} files arrived" in run.stderr and "no previous version yet" in run.stderr
    assert f"creating it, private ({files} files, " in run.stderr  # the same count (it said one fewer)
    assert fake.private is True and uploaded_marker(fake, KERNEL_ID) == (
        tiny_bundle / "dataset" / layout.BUNDLE_MARKER).read_bytes()
    calls = [call.split("/")[1] for call in fake.calls]
    create = calls.index("CreateDataset")
    # asked whether the kernel and the dataset exist (404: what is there of that id is not taken over),
    # then one upload per file and per folder (a .zip)
    assert calls[:2] == ["GetKernelSessionStatus", "GetDatasetStatus"], calls
    assert set(calls[2:create]) == {"GetDatasetStatus", "StartBlobUpload"}, calls  # the client asks too
    assert calls[:create].count("StartBlobUpload") == len(list((tiny_bundle / "dataset").iterdir())) - 1
    assert calls[create + 1:create + 4] == ["GetDatasetStatus"] * 3  # not yet persisted, blobs received, ready
    assert calls.index("ListDatasetFiles") < calls.index("SaveKernel") and calls[-1] == "SaveKernel"
    (pushed,) = fake.kernels[KERNEL_ID].pushes
    assert pushed["enableGpu"] is True and pushed["enableInternet"] is False
    assert pushed["machineShape"] == "NvidiaTeslaT4" and pushed["datasetDataSources"] == [KERNEL_ID]
    assert not pushed.get("kernelDataSources"), "the first version has no output of its own to attach"
    assert pushed["text"] == (tiny_bundle / "kernel" / layout.KERNEL_FILE).read_text()
    # credentials are in no bundle, and in no upload
    assert holds(tiny_bundle, KEY) == []
    assert not [n for n, c in fake.datasets[KERNEL_ID].versions[-1].items() if KEY.encode() in c]

    # the next push: a new version of the dataset; the kernel's previous output is attached
    fake.calls.clear()
    run = kaggle(fake, "push", str(tiny_bundle), "--poll-seconds", "0.01")
    assert run.returncode == 0, run.stderr
    methods = [call.split("/")[1] for call in fake.calls]
    assert "CreateDatasetVersion" in methods and "CreateDataset" not in methods
    assert len(fake.datasets[KERNEL_ID].versions) == 2
    assert fake.kernels[KERNEL_ID].pushes[-1]["kernelDataSources"] == [KERNEL_ID]
    assert "version 2 pushed" in run.stderr
    # the script sent says the output is attached: finding no run there fails the kernel
    bundled = (tiny_bundle / "kernel" / layout.KERNEL_FILE).read_text()
    assert fake.kernels[KERNEL_ID].pushes[-1]["text"] == bundled.replace("\nEXPECT_PREVIOUS = False\n",
                                                                         "\nEXPECT_PREVIOUS = True\n")

    # a version still running has no output to resume from yet
    fake.kernels[KERNEL_ID].statuses = ["RUNNING"]
    run = kaggle(fake, "push", str(tiny_bundle), "--kernel-only")
    assert run.returncode == 11 and len(fake.kernels[KERNEL_ID].pushes) == 2
    assert last_error(run.stderr).startswith(f"error: the kernel {KERNEL_ID} is still running")
    # ... and a whole push says so before it uploads anything (it uploaded the dataset, then refused)
    fake.calls.clear()
    run = kaggle(fake, "push", str(tiny_bundle), "--poll-seconds", "0.01")
    assert run.returncode == 11 and len(fake.datasets[KERNEL_ID].versions) == 2
    assert not {"StartBlobUpload", "CreateDatasetVersion", "SaveKernel"} & {c.split("/")[1] for c in fake.calls}
    assert last_error(run.stderr) == (
        f"error: the kernel {KERNEL_ID} is still running: its output is not there to resume from, and nothing was "
        f"uploaded ({KERNEL_ID}); fix: wait until it ends (`ptbr kaggle status {tiny_bundle} --wait`), then push "
        "again (--kernel-only to start the next session without uploading the dataset again, when the bundle has "
        "not changed)")


@pytest.mark.slow
def test_a_dropped_upload_is_detected_and_the_kernel_not_pushed(fake, tiny_bundle):
    """The client leaves out a file whose PUT fails and still reports the dataset created."""
    fake.fail_uploads = {"data.zip"}
    run = kaggle(fake, "push", str(tiny_bundle), "--poll-seconds", "0.01")
    assert run.returncode == 11
    error = last_error(run.stderr)
    files = len(json.loads((tiny_bundle / "dataset" / layout.BUNDLE_MARKER).read_text())["files"]) + 1
    assert error.startswith(f"error: the dataset {KERNEL_ID} on Kaggle is not the bundle: 4 of {files} files did "
                            "not arrive: data/meta.json, data/tokenizer.json, data/train.bin, data/val.bin")
    assert "push again" in error and "CreateDataset" in " ".join(fake.calls)
    assert KERNEL_ID not in fake.kernels


@pytest.mark.slow
def test_kaggles_refusals_are_one_line_errors(fake, tiny_bundle, tmp_path):
    fake.create_status = 'The requested title "ptbr-tiny-run" is already in use by a dataset.'
    run = kaggle(fake, "push", str(tiny_bundle), "--poll-seconds", "0.01")
    assert run.returncode == 11
    assert last_error(run.stderr).startswith(f"error: Kaggle refused the dataset {KERNEL_ID}: The requested title")
    fake.create_status = None
    fake.save_kernel_error = "Notebook is too large"
    run = kaggle(fake, "push", str(tiny_bundle), "--poll-seconds", "0.01")
    assert run.returncode == 11
    assert last_error(run.stderr).startswith(f"error: Kaggle refused the kernel {KERNEL_ID}: Notebook is too large")
    # a bundle made for another account is refused before anything is sent
    other = tmp_path / "other"
    shutil.copytree(tiny_bundle, other)
    metadata = json.loads((other / "dataset" / layout.DATASET_METADATA).read_text())
    (other / "dataset" / layout.DATASET_METADATA).write_text(json.dumps({**metadata, "id": "someone-else/" + SLUG}))
    fake.calls.clear()
    run = kaggle(fake, "push", str(other))
    assert run.returncode == 2 and fake.calls == []
    assert last_error(run.stderr).startswith(f"error: the bundle is for the Kaggle user someone-else, but the "
                                             f"credentials are {USERNAME}'s")


@pytest.mark.slow
def test_push_takes_over_no_dataset_or_kernel_of_that_id_that_is_not_a_ptbr_bundle(fake, tiny_bundle):
    """A dataset of the same slug that is not a bundle (no ptbr-bundle.json) would get the bundle as
    its new version, published with it if it is public; a kernel that is not ptbr's would get its
    code replaced. Both are refused before anything is uploaded."""
    fake.datasets[KERNEL_ID] = kaggle_fake.Dataset([{"scores.csv": b"a,b\n1,2\n"}])
    for extra in ((), ("--kernel-only",)):
        fake.calls.clear()
        run = kaggle(fake, "push", str(tiny_bundle), *extra)
        assert run.returncode == 6, run.stderr
        assert last_error(run.stderr) == (
            f"error: Kaggle already has a dataset {KERNEL_ID} that is not a ptbr bundle (no {layout.BUNDLE_MARKER}; "
            "it holds scores.csv): a new version would replace its files with the bundle's "
            f"(https://www.kaggle.com/datasets/{KERNEL_ID}); fix: make the bundle again with another --slug")
        assert not {"StartBlobUpload", "CreateDatasetVersion", "SaveKernel"} & {c.split("/")[1] for c in fake.calls}
    assert len(fake.datasets[KERNEL_ID].versions) == 1
    # a kernel of that id with other code
    del fake.datasets[KERNEL_ID]
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(source="import pandas\nprint('my notebook')\n")
    fake.calls.clear()
    run = kaggle(fake, "push", str(tiny_bundle))
    assert run.returncode == 6
    assert last_error(run.stderr) == (
        f"error: Kaggle already has a kernel {KERNEL_ID} that is not a ptbr kernel: pushing would replace its code "
        f"with a new version (https://www.kaggle.com/code/{KERNEL_ID}); fix: make the bundle again with another "
        "--slug")
    assert KERNEL_ID not in fake.datasets and not fake.kernels[KERNEL_ID].pushes
    assert "StartBlobUpload" not in " ".join(fake.calls)
    # a dataset an earlier push left without its marker (that upload failed) is the bundle's: pushed again
    del fake.kernels[KERNEL_ID]
    fake.datasets[KERNEL_ID] = kaggle_fake.Dataset([{layout.SETTINGS_FILE: b"{}", "wheels.zip": zip_of({"a.whl": b"x"})}])
    run = kaggle(fake, "push", str(tiny_bundle), "--poll-seconds", "0.01")
    assert run.returncode == 0, run.stderr
    assert len(fake.datasets[KERNEL_ID].versions) == 2 and "uploading a new version" in run.stderr


def zip_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return buffer.getvalue()


@pytest.mark.slow
def test_push_refuses_a_bundle_whose_files_no_longer_match_its_marker(fake, tiny_bundle, tmp_path):
    """An edited train-config.json, a deleted data file or a file added to BUNDLE/dataset would be
    uploaded and fail only on Kaggle (or be called a failed upload): checked before connecting."""
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, copy)
    settings = copy / "dataset" / layout.SETTINGS_FILE
    settings.write_text(settings.read_text().replace('"max_steps": 24', '"max_steps": 25'))
    (copy / "dataset" / "data" / "val.bin").unlink()
    (copy / "dataset" / "notes.txt").write_text("mine")
    for litter in ("dataset/.DS_Store", "dataset/data/.DS_Store", "dataset/._notes.txt"):  # a Finder's, unused
        (copy / litter).write_bytes(b"\0")
    run = kaggle(fake, "push", str(copy))
    assert run.returncode == 2 and fake.calls == []
    assert last_error(run.stderr) == (
        f"error: the bundle's files no longer match its {layout.BUNDLE_MARKER}: data/val.bin is missing; "
        f"train-config.json has changed (its sha256 differs); notes.txt is not one of the bundle's files "
        f"({copy / 'dataset'}); fix: make the bundle again (`ptbr kaggle bundle` with the same --output; settings "
        "go in its --config, not in the bundle)")
    # --kernel-only uploads none of them (the data may have been moved away since the dataset went up)
    populate(fake, tiny_bundle)
    run = kaggle(fake, "push", str(copy), "--kernel-only")
    assert run.returncode == 0, run.stderr
    # the marker itself rewritten: the kernel, which holds its sha256, would refuse the dataset
    marker = copy / "dataset" / layout.BUNDLE_MARKER
    marker.write_text(marker.read_text() + "\n")
    fake.calls.clear()
    run = kaggle(fake, "push", str(copy), "--kernel-only")
    assert run.returncode == 2 and fake.calls == []
    assert last_error(run.stderr).startswith(f"error: the kernel script was not made with this bundle's "
                                             f"{layout.BUNDLE_MARKER} (its sha256 differs)")


@pytest.mark.slow
def test_kaggles_own_failures_and_a_kernel_only_push_of_no_dataset_say_what_to_do(fake, tiny_bundle):
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING"])
    fake.fail_methods = {"GetKernelSessionStatus": 503}
    run = kaggle(fake, "status", str(tiny_bundle))
    assert run.returncode == 11
    assert last_error(run.stderr) == (
        f"error: cannot ask about the kernel {KERNEL_ID}: Kaggle answered HTTP 503: Service Unavailable (Kaggle API); "
        "fix: the failure is on Kaggle's side: run the command again in a few minutes (see "
        "https://status.kaggle.com if it lasts)")
    # --kernel-only before the dataset was ever pushed
    fake.fail_methods = {}
    del fake.kernels[KERNEL_ID]
    run = kaggle(fake, "push", str(tiny_bundle), "--kernel-only")
    assert run.returncode == 11 and KERNEL_ID not in fake.kernels
    assert last_error(run.stderr) == (
        f"error: the dataset {KERNEL_ID} is not on Kaggle: --kernel-only pushes the kernel alone, against a dataset "
        f"pushed before ({tiny_bundle}); fix: push the dataset and the kernel: ptbr kaggle push {tiny_bundle} "
        "(without --kernel-only)")


def populate(fake: FakeKaggle, bundle: Path) -> None:
    """The bundle's dataset on the fake Kaggle, as a push leaves it."""
    dataset = bundle / "dataset"
    content = {}
    for top in sorted(dataset.iterdir()):
        if top.is_dir():
            buffer = io.BytesIO()
            with zipfile.ZipFile(buffer, "w") as archive:
                for name, path in files_of(top).items():
                    archive.write(path, name)
            content[f"{top.name}.zip"] = buffer.getvalue()
        elif top.name != layout.DATASET_METADATA:
            content[top.name] = top.read_bytes()
    info = json.loads((dataset / layout.BUNDLE_MARKER).read_text())
    fake.datasets[info["id"]] = kaggle_fake.Dataset([content])


@pytest.mark.slow
def test_push_kernel_only_checks_the_dataset_and_attaches_the_newest_model_version(fake, tmp_path, toy):
    out = tmp_path / "bundle"
    assert main(["kaggle", "bundle", "--output", str(out), "--owner", USERNAME, "--slug", "ptbr-farense-qlora",
                 "--mode", "finetune", "--data", str(toy.data), "--python-version", LOCAL_PYTHON,
                 "--base", "kaggle:mistral-ai/mistral/transformers/7b-v0.1"]) == 0
    fake.models["mistral-ai/mistral/transformers/7b-v0.1"] = 3
    populate(fake, out)
    run = kaggle(fake, "push", str(out), "--kernel-only")
    assert run.returncode == 0, run.stderr
    assert "attaching its newest version, 3" in run.stderr and "CreateDataset" not in " ".join(fake.calls)
    (pushed,) = fake.kernels[f"{USERNAME}/ptbr-farense-qlora"].pushes
    assert pushed["modelDataSources"] == ["mistral-ai/mistral/transformers/7b-v0.1/3"]
    assert json.loads((out / "kernel" / layout.KERNEL_METADATA).read_text())["model_sources"] == [
        "mistral-ai/mistral/transformers/7b-v0.1/3"], "the bundle records the version pushed"
    # a dataset on Kaggle that is not this bundle is not pushed against
    fake.datasets[f"{USERNAME}/ptbr-farense-qlora"].versions[-1].pop("wheels.zip")
    run = kaggle(fake, "push", str(out), "--kernel-only")
    assert run.returncode == 11 and "files did not arrive: wheels/" in last_error(run.stderr)


@pytest.mark.slow
def test_credentials_missing_or_refused_are_one_line_naming_where_kaggle_looks(fake, tiny_bundle):
    run = kaggle(fake, "status", str(tiny_bundle), credentials="none")
    assert run.returncode == 2 and run.stdout == ""  # not the client's help text
    error = last_error(run.stderr)
    assert error.startswith("error: no Kaggle credentials found (Kaggle looks in KAGGLE_API_TOKEN")
    assert "~/.kaggle/access_token" in error and "kaggle.json" in error and "KAGGLE_USERNAME" in error
    assert "https://www.kaggle.com/settings/api" in error and fake.calls == []
    # a kaggle.json the client cannot use was "no credentials found", which sent users to make new ones
    config = fake.home / ".kaggle"
    config.mkdir(exist_ok=True)
    for text, why in (('{"username": "ana", "key": ', "not valid JSON ("),
                      ('{"username": "ana"}', 'it needs "username" and "key"')):
        (config / "kaggle.json").write_text(text)
        (config / "kaggle.json").chmod(0o600)
        run = kaggle(fake, "status", str(tiny_bundle), credentials="none")
        assert run.returncode == 2
        assert last_error(run.stderr).startswith(f"error: {config / 'kaggle.json'} is not usable: {why}"), run.stderr
    (config / "kaggle.json").unlink()
    run = kaggle(fake, "status", str(tiny_bundle), credentials="key:wrong-key")
    assert run.returncode == 2
    assert last_error(run.stderr).startswith("error: Kaggle refused the credentials from KAGGLE_USERNAME and "
                                             "KAGGLE_KEY (HTTP 401)")
    run = kaggle(fake, "status", str(tiny_bundle), credentials="token:not-a-valid-token")
    assert run.returncode == 2
    assert last_error(run.stderr).startswith("error: Kaggle did not accept the token in KAGGLE_API_TOKEN")
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING"])
    run = kaggle(fake, "status", str(tiny_bundle), credentials="token")
    assert run.returncode == 0 and run.stdout == f"{KERNEL_ID}: running\n"
    # a kaggle.json that others can read: the client's warning, once (the client reads the file twice)
    (config / "kaggle.json").write_text(json.dumps({"username": USERNAME, "key": KEY}))
    (config / "kaggle.json").chmod(0o644)
    run = kaggle(fake, "status", str(tiny_bundle), credentials="none")
    assert run.returncode == 0 and run.stderr.count("Warning: Your Kaggle API key is readable by other users") == 1


@pytest.mark.slow
def test_status_follows_the_kernel_and_a_failed_kernel_is_an_error(fake, tiny_bundle):
    run = kaggle(fake, "status", str(tiny_bundle))
    assert run.returncode == 11 and last_error(run.stderr).startswith(f"error: Kaggle has no kernel {KERNEL_ID}")
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["QUEUED", "RUNNING", "RUNNING", "COMPLETE"])
    run = kaggle(fake, "status", str(tiny_bundle), "--wait", "--poll-seconds", "0.01")
    assert run.returncode == 0 and run.stdout.splitlines() == [f"{KERNEL_ID}: {s}" for s in ("queued", "running",
                                                                                               "complete")]
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["ERROR"], failure_message="Your notebook tried to "
                                                 "allocate more memory than is available.")
    run = kaggle(fake, "status", str(tiny_bundle))
    assert run.returncode == 11 and run.stdout == f"{KERNEL_ID}: error\n"
    assert last_error(run.stderr).startswith(f"error: the kernel {KERNEL_ID} failed: Your notebook tried to allocate")
    assert "fetches its log" in last_error(run.stderr)
    run = kaggle(fake, "status", str(tiny_bundle.parent / "nothing"))
    assert run.returncode == 2 and "not a ptbr Kaggle bundle" in last_error(run.stderr)


@pytest.mark.slow
def test_output_downloads_every_file_and_the_log_or_nothing(fake, tiny_bundle, tmp_path):
    record = {"bundle": KERNEL_ID, "stages": {"environment": "ok", "train": "ok"}, "exit_code": 0}
    outputs = {layout.RUN_MARKER: json.dumps(record).encode(), "run/train.log": b"step 1/24 | loss 7.6\n",
               "run/preflight_report.json": json.dumps({"checks": [{"status": "pass"}, {"status": "warn"}]}).encode(),
               "run/checkpoints/step_000001/model.safetensors": bytes(range(256)) * 40}
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(outputs=outputs, log="[ptbr-kernel] environment: ...\n")
    target = tmp_path / "outputs"
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(target))
    assert run.returncode == 0, run.stderr
    downloaded = {name: path.read_bytes() for name, path in files_of(target).items()}
    assert json.loads(downloaded.pop(remote.DOWNLOADED)) == {"kernel": KERNEL_ID,
                                                             "files": sorted([*outputs, f"{SLUG}.log"])}
    assert downloaded == {**outputs, f"{SLUG}.log": b"[ptbr-kernel] environment: ...\n"}
    assert "kernel: environment ok, train ok; exit code 0" in run.stdout and "preflight: 1 pass, 1 warn" in run.stdout
    # --pattern: what matches, and what the summary reads (it said the finished kernel had not started)
    picked = tmp_path / "picked"
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(picked), "--pattern", "run/checkpoints/")
    assert run.returncode == 0, run.stderr
    assert sorted(files_of(picked)) == sorted([layout.RUN_MARKER, "run/preflight_report.json", remote.DOWNLOADED,
                                               "run/checkpoints/step_000001/model.safetensors", f"{SLUG}.log"])
    assert "kernel: environment ok, train ok; exit code 0" in run.stdout
    # again: the previous download is replaced whole; a file Kaggle cannot serve leaves it as it was
    fake.missing_outputs = {"run/train.log"}
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(target))
    assert run.returncode == 11 and "run/train.log" in last_error(run.stderr) and "404" in last_error(run.stderr)
    assert (target / "run" / "train.log").read_bytes() == outputs["run/train.log"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(mine))
    assert run.returncode == 6 and (mine / "notes.txt").read_text() == "keep"  # an output directory that is not ours


@pytest.mark.slow
def test_output_replaces_a_previous_download_only_when_it_holds_nothing_else(fake, tiny_bundle, tmp_path):
    """A download folder is replaced whole: files of yours put there since (notes, a run's file under
    run/) are named and the download refused; a download from before ptbr recorded what it wrote
    there may hold the kernel output's own names only."""
    outputs = {layout.RUN_MARKER: b"{}", "run/train.log": b"step 1/24 | loss 7.6\n"}
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(outputs=outputs, log="log\n")
    target = tmp_path / "outputs"
    assert kaggle(fake, "output", str(tiny_bundle), "--path", str(target)).returncode == 0
    (target / "NOTES.md").write_text("mine")
    (target / "run" / "eval.txt").write_text("mine too")
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(target))
    assert run.returncode == 6
    assert last_error(run.stderr) == (
        "error: the download folder holds something other than a previous download of this kernel's outputs "
        f"(NOTES.md, run/eval.txt): it would be replaced ({target}); fix: move those files out of the folder, or "
        "give a new or empty folder with --path")
    assert (target / "NOTES.md").read_text() == "mine" and (target / "run" / "eval.txt").read_text() == "mine too"
    (target / "NOTES.md").unlink()
    (target / "run" / "eval.txt").unlink()
    (target / "run" / ".DS_Store").write_bytes(b"\0")  # a Finder's: replaced with the rest
    fake.kernels[KERNEL_ID].outputs["run/metrics.jsonl"] = b"{}\n"
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(target))
    assert run.returncode == 0, run.stderr
    assert (target / "run" / "metrics.jsonl").read_bytes() == b"{}\n"
    # a download from before the record: the kernel's own names are replaced, anything else refused
    (target / remote.DOWNLOADED).unlink()
    (target / "run" / "checkpoints").mkdir()
    (target / "run" / "checkpoints" / "old.bin").write_bytes(b"x")
    assert kaggle(fake, "output", str(tiny_bundle), "--path", str(target)).returncode == 0
    assert not (target / "run" / "checkpoints").exists() and (target / remote.DOWNLOADED).is_file()
    (target / remote.DOWNLOADED).unlink()
    (target / "mine.txt").write_text("mine")
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(target))
    assert run.returncode == 6 and "(mine.txt)" in last_error(run.stderr)
    assert (target / "mine.txt").read_text() == "mine"
    # a path that is not the folder's plain name (it once crashed on `.`, which has none) is resolved
    run = kaggle(fake, "output", str(tiny_bundle), "--path", str(tmp_path / "elsewhere" / ".." / "fetched"))
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "fetched" / "run" / "train.log").is_file() and not (tmp_path / "elsewhere").exists()


def test_the_current_directory_is_no_bundle_or_download_folder(tmp_path, monkeypatch, capsys, tiny_bundle_stub):
    """Both are replaced whole (moved aside, the new one moved in): `--output .` or `--path .` crashed
    (`.` has no name to write beside), and would leave the shell in a removed folder."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for args in (["kaggle", "bundle", "--output", ".", "--owner", USERNAME, "--slug", SLUG],
                 ["kaggle", "bundle", "--output", "..", "--owner", USERNAME, "--slug", SLUG],
                 ["kaggle", "output", str(tiny_bundle_stub), "--path", "."]):
        assert main(args) == 6, args
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        flag = "--output" if args[1] == "bundle" else "--path"
        assert err.strip().startswith(f"error: {flag} is the current directory or holds it, and the folder is "
                                      "replaced whole: this shell would be left in a removed folder"), err
        assert f"fix: give a folder inside it, e.g. {flag} " in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stub", "work"] and not any(work.iterdir())


@pytest.fixture
def tiny_bundle_stub(tmp_path) -> Path:
    """What read_bundle needs of a bundle (no wheels, no data)."""
    stub = tmp_path / "stub"
    (stub / layout.DATASET).mkdir(parents=True)
    (stub / layout.KERNEL).mkdir()
    (stub / layout.DATASET / layout.BUNDLE_MARKER).write_text(json.dumps({"id": KERNEL_ID, "files": {}}))
    (stub / layout.DATASET / layout.DATASET_METADATA).write_text(json.dumps({"id": KERNEL_ID}))
    (stub / layout.KERNEL / layout.KERNEL_METADATA).write_text(json.dumps({"id": KERNEL_ID}))
    return stub


def test_env_refuses_credential_names_not_words_that_hold_token():
    from ptbr.kaggle.settings import BundleSettings

    def refused(name: str) -> bool:
        return any("a bundle holds no credentials" in p
                   for p in BundleSettings("out", USERNAME, SLUG, env=(f"{name}=x",)).problems())

    for name in ("TOKENIZERS_PARALLELISM", "NCCL_P2P_DISABLE", "PYTORCH_CUDA_ALLOC_CONF", "AUTHOR", "MONKEYPATCH"):
        assert not refused(name), name
    for name in ("HF_TOKEN", "TOKEN", "hf_token", "ACCESS_TOKEN", "HF_TOKEN_PATH", "API_KEY", "APIKEY",
                 "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "MYSECRET", "DB_PASSWORD", "KAGGLE_USERNAME",
                 "GOOGLE_APPLICATION_CREDENTIALS", "AUTH", "OAUTH_CLIENT", "AUTHORIZATION", "HTTP_AUTHORIZATION",
                 "MINIO_ACCESSKEYID", "SSH_PRIVATE_KEY"):
        assert refused(name), name


# --- in this process, against the fake ------------------------------------------------------------------------


@pytest.fixture
def here(fake, monkeypatch):
    """`ptbr kaggle` run in this process against the fake, with the environment a subprocess gets
    (kaggle() above); called again, it switches the credentials."""
    def use(credentials: str = "key") -> None:
        env = fake.env(str(fake.home), str(fake.tmp), credentials)
        for name in [n for n in os.environ if n not in env]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    use()
    with contextlib.redirect_stdout(io.StringIO()):  # the client authenticates when imported
        from kaggle.api.kaggle_api_extended import KaggleApi
    # what the client sets when it is imported, as it would be in a process of its own: the local
    # endpoint (KAGGLE_API_ENVIRONMENT=LOCALHOST) and the kaggle.json under this HOME
    monkeypatch.setattr(KaggleApi, "args", ["--local"])
    monkeypatch.setattr(KaggleApi, "config", str(fake.home / ".kaggle" / "kaggle.json"))
    return use


def small_bundle(folder: Path, slug: str = SLUG, resume: bool = True, title: str | None = None) -> Path:
    """A bundle written by `ptbr kaggle bundle`'s own functions, with a stand-in ptbr wheel and no
    data: nothing is built or downloaded."""
    from ptbr.kaggle.bundle import Plan, fill_dataset, fill_kernel
    from ptbr.kaggle.settings import BundleSettings

    settings = BundleSettings(str(folder), USERNAME, slug, resume_from_previous=resume, title=title)
    wheel = folder.parent / f"{folder.name}-ptbr-0.0.1-py3-none-any.whl"
    wheel.write_bytes(b"a stand-in wheel")
    plan = Plan({"model_size": "tiny"}, {}, None)
    fill_dataset(folder / layout.DATASET, settings, plan, {"ptbr-0.0.1-py3-none-any.whl": wheel}, [])
    marker_sha256 = BUILD.sha256(folder / layout.DATASET / layout.BUNDLE_MARKER)
    fill_kernel(folder / layout.KERNEL, ROOT, settings, plan, marker_sha256)
    return folder


def error_of(capsys) -> str:
    return last_error(capsys.readouterr().err)


def test_kernel_only_refuses_a_dataset_whose_marker_is_another_bundles(here, fake, tmp_path, capsys):
    """A bundle made again after its push can have the same files and sizes, and another marker: the
    kernel, which holds the marker's sha256, would fail at its bundle stage once the GPU session started."""
    bundle = small_bundle(tmp_path / "bundle")
    populate(fake, bundle)
    assert main(["kaggle", "push", str(bundle), "--kernel-only"]) == 0
    assert f"dataset {KERNEL_ID}: its {layout.BUNDLE_MARKER} is this bundle's" in capsys.readouterr().err
    marker = bundle / layout.DATASET / layout.BUNDLE_MARKER
    pushed = marker.read_text()
    remade = pushed.replace('"stop_after_s": 41400', '"stop_after_s": 41401')  # the same size, another sha256
    assert remade != pushed and len(remade) == len(pushed)
    marker.write_text(remade)
    old, new = (hashlib.sha256(text.encode()).hexdigest() for text in (pushed, remade))
    script = bundle / layout.KERNEL / layout.KERNEL_FILE
    script.write_text(script.read_text().replace(old, new))  # as `ptbr kaggle bundle` would write it
    fake.calls.clear()
    assert main(["kaggle", "push", str(bundle), "--kernel-only"]) == 11
    assert error_of(capsys) == (
        f"error: the dataset {KERNEL_ID} on Kaggle is another version of the bundle: its {layout.BUNDLE_MARKER} is "
        f"not this bundle's (sha256 {old[:12]}..., not {new[:12]}...; was the bundle made again since it was "
        f"pushed?), and the kernel would refuse it ({bundle}); fix: push the dataset with the kernel: ptbr kaggle "
        f"push {bundle} (without --kernel-only)")
    assert "SaveKernel" not in " ".join(fake.calls) and len(fake.kernels[KERNEL_ID].pushes) == 1


def test_kernel_only_says_when_the_bundle_does_not_resume(here, fake, tmp_path, capsys):
    """--kernel-only is the way to the next session; a bundle made without --resume-from-previous
    attaches no previous output, so that version starts the run over."""
    bundle = small_bundle(tmp_path / "bundle", resume=False)
    populate(fake, bundle)
    assert main(["kaggle", "push", str(bundle), "--kernel-only"]) == 0
    assert "warning: the bundle was made without" not in capsys.readouterr().err  # no previous version
    assert main(["kaggle", "push", str(bundle), "--kernel-only"]) == 0
    assert (f"warning: the bundle was made without --resume-from-previous: this version of {KERNEL_ID} starts "
            "the run over from step 0, without the previous version's checkpoints; to continue that run, make the "
            "bundle again with --resume-from-previous and push it (the dataset too)") in capsys.readouterr().err


def test_a_kernel_refused_after_the_dataset_went_up_is_pushed_alone(here, fake, tmp_path, capsys):
    bundle = small_bundle(tmp_path / "bundle")
    fake.save_kernel_error = "Notebook is too large"
    assert main(["kaggle", "push", str(bundle), "--poll-seconds", "0.01"]) == 11
    assert error_of(capsys) == (
        f"error: Kaggle refused the kernel {KERNEL_ID}: Notebook is too large ({bundle / layout.KERNEL}); fix: fix "
        f"what Kaggle names, then push again; the dataset is up: `ptbr kaggle push {bundle} --kernel-only` pushes "
        "the kernel alone")
    assert len(fake.datasets[KERNEL_ID].versions) == 1


def test_a_title_leads_to_the_slug_as_kaggles_client_computes_it(here, fake, tmp_path, capsys, monkeypatch):
    """The client's slugify (python-slugify) reads "2°" as "2deg": a title ptbr took for the slug's
    made the client print its own warning at push."""
    assert layout.kernel_title("Treino 2° ciclo", "treino-2-ciclo") == "treino-2-ciclo"
    assert layout.kernel_title("Treino 2° ciclo", "treino-2deg-ciclo") == "Treino 2° ciclo"
    assert layout.kernel_title("Ação Rápida 2", "acao-rapida-2") == "Ação Rápida 2"
    bundle = small_bundle(tmp_path / "bundle", slug="treino-2-ciclo", title="Treino 2° ciclo")
    assert main(["kaggle", "push", str(bundle), "--poll-seconds", "0.01"]) == 0
    out, err = capsys.readouterr()
    assert "does not resolve" not in out + err and "does not lead" not in err
    assert fake.kernels[f"{USERNAME}/treino-2-ciclo"].pushes[-1]["newTitle"] == "treino-2-ciclo"
    # a title that does not lead to the id (the kernel's metadata edited): ptbr's warning, not the client's line
    metadata = bundle / layout.KERNEL / layout.KERNEL_METADATA
    metadata.write_text(metadata.read_text().replace('"title": "treino-2-ciclo"', '"title": "Treino 2° ciclo"'))
    assert main(["kaggle", "push", str(bundle), "--kernel-only"]) == 0
    out, err = capsys.readouterr()
    assert "Your kernel title" not in out + err
    assert (f"warning: the kernel's title 'Treino 2° ciclo' does not lead to its id {USERNAME}/treino-2-ciclo by "
            "Kaggle's rule: Kaggle may name the kernel after its title; make the bundle again with a --title whose "
            "letters and digits are the slug's") in err
    # without python-slugify (the kaggle extra), only a title every rule agrees on is kept
    monkeypatch.setitem(sys.modules, "slugify", None)
    assert layout.kernel_title("Treino 2° ciclo", "treino-2-ciclo") == "treino-2-ciclo"
    assert layout.kernel_title("Ação Rápida 2", "acao-rapida-2") == "Ação Rápida 2"


def test_a_request_kaggle_never_answers_gives_up(here, fake, tiny_bundle_stub):
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING"])
    fake.hang = {"GetKernelSessionStatus"}
    with pytest.raises(KaggleError) as caught:
        remote.status(str(tiny_bundle_stub), waiting=remote.Waiting(request_timeout_s=0.2))
    assert caught.value.exit_code == 11 and caught.value.one_line() == (
        f"error: cannot ask about the kernel {KERNEL_ID}: Kaggle did not answer within 0.2 s (Kaggle API); fix: "
        "check the network (and https://status.kaggle.com), then run the command again")


def test_waiting_rides_out_kaggles_passing_failures(here, fake, tiny_bundle_stub, caplog):
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING", "RUNNING", "COMPLETE"])
    fake.failures = {"GetKernelSessionStatus": [502, 429]}
    waiting = remote.Waiting(poll_s=0.01, retries=2)
    assert remote.status(str(tiny_bundle_stub), wait=True, waiting=waiting) == "complete"
    assert (f"warning: cannot ask about the kernel {KERNEL_ID}: Kaggle answered HTTP 502: Service Unavailable; "
            "asking again in 0.01 s (1 of 2 failures in a row allowed while waiting)") in caplog.text
    assert "Kaggle answered HTTP 429: Too Many Requests; asking again in 0.01 s (2 of 2" in caplog.text
    # more failures in a row than allowed
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING"])
    fake.failures = {"GetKernelSessionStatus": [503, 503, 503]}
    with pytest.raises(KaggleError) as caught:
        remote.status(str(tiny_bundle_stub), wait=True, waiting=waiting)
    assert caught.value.one_line() == (
        f"error: cannot ask about the kernel {KERNEL_ID}: Kaggle answered HTTP 503: Service Unavailable (3 times in a "
        "row, 0.01 s apart) (Kaggle API); fix: the failure is on Kaggle's side: run the command again in a few "
        "minutes (see https://status.kaggle.com if it lasts)")
    # push's wait for the dataset alike
    fake.datasets[KERNEL_ID] = kaggle_fake.Dataset([{}], statuses=["BLOBS_RECEIVED"])
    fake.failures = {"GetDatasetStatus": [500]}
    remote.wait_until_ready(connect(1.0), KERNEL_ID, waiting)
    assert f"dataset {KERNEL_ID}: ready" in caplog.text


def test_kaggles_http_errors_name_the_status_and_what_to_do(here, fake, tiny_bundle_stub, capsys):
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING"])
    fake.fail_methods = {"GetKernelSessionStatus": 429}
    assert main(["kaggle", "status", str(tiny_bundle_stub)]) == 11
    assert error_of(capsys) == (
        f"error: cannot ask about the kernel {KERNEL_ID}: Kaggle answered HTTP 429: Too Many Requests (Kaggle API); "
        "fix: Kaggle is limiting the rate of requests: wait a few minutes, then run the command again")
    # the client replaces a 403 with a text of its own about benchmark leaderboards
    fake.fail_methods = {"GetKernelSessionStatus": 403}
    assert main(["kaggle", "status", str(tiny_bundle_stub)]) == 11
    assert error_of(capsys) == (
        f"error: cannot ask about the kernel {KERNEL_ID}: Kaggle answered HTTP 403: Permission denied (Kaggle API); "
        "fix: check the bundle's owner and slug, and that your account may do this")
    # Kaggle failing while the client checks a token is no network problem
    fake.fail_methods = {"IntrospectToken": 500}
    here("token")
    assert main(["kaggle", "status", str(tiny_bundle_stub)]) == 11
    assert error_of(capsys) == (
        "error: cannot check the credentials with Kaggle: Kaggle answered HTTP 500: Service Unavailable (Kaggle API); "
        "fix: the failure is on Kaggle's side: run the command again in a few minutes (see "
        "https://status.kaggle.com if it lasts)")


def test_a_refused_token_is_named_where_a_key_was_there_too(here, fake, tiny_bundle_stub, capsys, monkeypatch):
    """Kaggle did not take the token, so the client authenticated with the key, and still sent the
    token with every request."""
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING"])
    monkeypatch.setenv("KAGGLE_API_TOKEN", "KGAT_expired")
    assert main(["kaggle", "status", str(tiny_bundle_stub)]) == 2
    assert error_of(capsys) == (
        f"error: Kaggle refused the credentials from the token in KAGGLE_API_TOKEN (HTTP 401) while trying to ask "
        f"about the kernel {KERNEL_ID} (ptbr kaggle); fix: remove or replace KAGGLE_API_TOKEN: the client sends a "
        "token wherever it finds one, before kaggle.json or KAGGLE_KEY, even one Kaggle did not accept; to replace "
        "it, create an API token at https://www.kaggle.com/settings/api (\"Generate New Token\") and save it to "
        "~/.kaggle/access_token (chmod 600), or export KAGGLE_API_TOKEN=...")


def test_the_kaggle_json_named_is_the_one_the_client_reads(here, fake, tiny_bundle_stub, capsys, monkeypatch,
                                                            tmp_path):
    """With KAGGLE_CONFIG_DIR set the client reads that folder's kaggle.json alone (the class
    attribute `config`, computed when the client is imported, is set as it would be)."""
    from kaggle.api.kaggle_api_extended import KaggleApi

    here("none")
    (fake.home / ".kaggle").mkdir(exist_ok=True)
    (fake.home / ".kaggle" / "kaggle.json").write_text("{broken")
    config = tmp_path / "config" / "kaggle.json"
    config.parent.mkdir()
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(config.parent))
    monkeypatch.setattr(KaggleApi, "config", str(config))
    assert main(["kaggle", "status", str(tiny_bundle_stub)]) == 2
    assert error_of(capsys).startswith(
        "error: no Kaggle credentials found (Kaggle looks in KAGGLE_API_TOKEN (a token, or a file holding it), "
        f"~/.kaggle/access_token, {config} ($KAGGLE_CONFIG_DIR), KAGGLE_USERNAME and KAGGLE_KEY, or the login")
    # JSON that is not an object: the client fails on it with a TypeError of its own
    config.write_text("[1, 2]")
    config.chmod(0o600)
    assert main(["kaggle", "status", str(tiny_bundle_stub)]) == 2
    assert error_of(capsys).startswith(f'error: {config} is not usable: it needs "username" and "key" (ptbr kaggle); '
                                       'fix: write it as {"username": "YOUR_NAME", "key": "YOUR_KEY"}')


def test_poll_seconds_is_bounded(capsys, tiny_bundle_stub):
    assert main(["kaggle", "status", str(tiny_bundle_stub), "--wait", "--poll-seconds", "1e300"]) == 2
    assert error_of(capsys) == ("error: --poll-seconds must be > 0 and at most 86400 (a day), got 1e+300 (ptbr kaggle "
                                "status); fix: give a number of seconds")


def test_output_never_replaces_a_download_with_nothing(here, fake, tiny_bundle_stub, tmp_path, capsys):
    """A version still queued or running lists no outputs: the previous version's download stays."""
    outputs = {layout.RUN_MARKER: b"{}", "run/train.log": b"step 1/24 | loss 7.6\n"}
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(outputs=outputs, log="log\n")
    target = tmp_path / "outputs"
    assert main(["kaggle", "output", str(tiny_bundle_stub), "--path", str(target)]) == 0
    before = {name: path.read_bytes() for name, path in files_of(target).items()}
    fake.kernels[KERNEL_ID] = kaggle_fake.Kernel(statuses=["RUNNING"])
    capsys.readouterr()
    assert main(["kaggle", "output", str(tiny_bundle_stub), "--path", str(target)]) == 11
    assert error_of(capsys) == (
        f"error: Kaggle lists no output files for the kernel {KERNEL_ID}: the previous download in {target} is kept "
        f"({KERNEL_ID}); fix: a version still queued or running has none yet: ask `ptbr kaggle status "
        f"{tiny_bundle_stub}`, and fetch the outputs once it has ended")
    assert {name: path.read_bytes() for name, path in files_of(target).items()} == before
    # into a new folder: the log alone, said so
    assert main(["kaggle", "output", str(tiny_bundle_stub), "--path", str(tmp_path / "new")]) == 0
    assert (f"warning: Kaggle lists no output files for the kernel {KERNEL_ID} (a version still queued or running "
            f"has none yet: ptbr kaggle status {tiny_bundle_stub}); only its log is written") in capsys.readouterr().err


def test_output_names_the_folder_it_must_write_in(tiny_bundle_stub, tmp_path, capsys, monkeypatch):
    """The download is written beside --path, then moved in: a writable --path in a folder that is
    not writable fails there (root writes anywhere: os.access says what a user would meet)."""
    parent = tmp_path / "shared"
    (parent / "mine").mkdir(parents=True)
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != parent and access(path, mode))
    assert main(["kaggle", "output", str(tiny_bundle_stub), "--path", str(parent / "mine")]) == 6
    assert error_of(capsys) == (
        f"error: cannot write in {parent}: the download is written there beside mine, then moved into its place "
        f"({parent / 'mine'}); fix: give yourself write access to {parent}, or give a --path in a folder you can "
        "write")


def test_auto_fit_is_refused_for_two_t4s_at_bundle_time(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("auto_fit: true\n")
    assert main(["kaggle", "bundle", "--output", str(tmp_path / "b"), "--owner", USERNAME, "--slug", SLUG,
                 "--config", str(config)]) == 2
    assert error_of(capsys) == (
        "error: auto_fit runs in one process, and num_processes auto (auto: one per T4) starts 2 on Kaggle: set "
        "auto_fit false and a batch that fits (`ptbr preflight --for kaggle` plans one), or num_processes 1 "
        f"({config}); fix: see `ptbr kaggle bundle --help`")
    assert not (tmp_path / "b").exists()
    config.write_text("auto_fit: true\nnum_processes: '1'\n")  # one process: planned as asked (then wheels)
    from ptbr.kaggle.bundle import plan_contents
    from ptbr.kaggle.settings import BundleSettings

    assert plan_contents(BundleSettings(str(tmp_path / "b"), USERNAME, SLUG, config=str(config))).settings[
        "auto_fit"] is True


def test_a_kernel_stopped_before_training_leaves_the_run_for_the_next_version(tmp_path, monkeypatch):
    """Kaggle ends a session with SIGTERM, at any stage: one arriving before training (here while
    installing) ended the kernel without its record, and every later version, finding no
    ptbr-kaggle-run.json beside the run it copied, failed at its resume stage."""
    root = tmp_path / "first"
    (root / "input" / SLUG).mkdir(parents=True)
    info = {"id": KERNEL_ID, "ptbr_version": "0", "mode": "pretrain", "folders": ["wheels"], "files": {}}
    (root / "input" / SLUG / "wheels").mkdir()
    (root / "input" / SLUG / layout.BUNDLE_MARKER).write_text(json.dumps(info))
    attach(previous_output(tmp_path / "previous"), root / "input" / f"{SLUG}-output")
    working = root / "working"
    monkeypatch.setenv("KAGGLE_ROOT", str(root))
    monkeypatch.setattr(KERNEL, "BUNDLE_ID", KERNEL_ID)
    monkeypatch.setattr(KERNEL, "EXPECT_PREVIOUS", True)
    seen = {}

    def install(wheels, info) -> None:  # the session ends while pip runs
        seen["record"] = json.loads((working / layout.RUN_MARKER).read_text())  # there for a SIGKILL too
        assert callable(signal.getsignal(signal.SIGTERM)), "SIGTERM's default action: no record"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(KERNEL, "install", install)
    before = signal.getsignal(signal.SIGTERM)
    assert KERNEL.main() == 130
    unlock(root / "input")
    assert signal.getsignal(signal.SIGTERM) is before
    assert seen["record"]["stages"] == {"environment": "ok", "resume": "ok"} and seen["record"]["resumed_from"]
    record = json.loads((working / layout.RUN_MARKER).read_text())
    assert record["stages"] == {"environment": "ok", "resume": "ok", "bundle": "ok", "install": "stopped"}
    assert record["failure"] == "stopped by SIGTERM at stage install" and record["exit_code"] == 130
    # the next version, pushed expecting a run, finds this one's
    attach(working, tmp_path / "second" / "input" / f"{SLUG}-output")
    found = KERNEL.restore_previous_run(tmp_path / "second" / "input", KERNEL_ID, tmp_path / "second" / "run",
                                        tmp_path / "second")
    assert found == str(tmp_path / "second" / "input" / f"{SLUG}-output" / "run")
    unlock(tmp_path / "second" / "input")


def resuming_kernel(tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """A kernel (KAGGLE_ROOT tmp_path/first) that expects a previous version's output, which is
    attached: (that output, the kernel's root, its working folder)."""
    previous = previous_output(tmp_path / "previous")
    root = tmp_path / "first"
    attach(previous, root / "input" / f"{SLUG}-output")
    monkeypatch.setenv("KAGGLE_ROOT", str(root))
    monkeypatch.setattr(KERNEL, "BUNDLE_ID", KERNEL_ID)
    monkeypatch.setattr(KERNEL, "EXPECT_PREVIOUS", True)
    return previous, root, root / "working"


@pytest.mark.parametrize("stage", ["environment", "resume"])
def test_a_kernel_stopped_before_its_run_is_copied_whole_leaves_none_for_the_next_version(tmp_path, monkeypatch,
                                                                                          capsys, stage):
    """A SIGTERM while the resume stage copied the previous version's run left the record beside the
    part copied so far (a checkpoint's weights without its state): the next version took it for the
    run, `--resume auto` found no intact checkpoint and started from step 0, the earlier sessions
    lost without a word. The copy now becomes run/ only whole, and the record of a version stopped
    before its resume stage was done is no run to resume from: the next version resumes from the
    version before where that is attached too, and otherwise fails saying what to do."""
    previous, root, working = resuming_kernel(tmp_path, monkeypatch)
    copyfile, copied = shutil.copyfile, []

    def session_ends() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    def copy(source, target, *args, **kwargs):  # the session ends once the first file is copied
        copied.append(source)
        if len(copied) == 2:
            session_ends()
        return copyfile(source, target, *args, **kwargs)

    if stage == "environment":
        monkeypatch.setattr(KERNEL, "describe_environment", session_ends)
    monkeypatch.setattr(KERNEL.shutil, "copyfile", copy)
    capsys.readouterr()
    assert KERNEL.main() == 130
    monkeypatch.setattr(KERNEL.shutil, "copyfile", copyfile)
    unlock(root / "input")
    log = capsys.readouterr().out
    assert len(copied) == (2 if stage == "resume" else 0)
    assert [path.name for path in working.iterdir()] == [layout.RUN_MARKER]  # no part of the run, here or aside
    record = json.loads((working / layout.RUN_MARKER).read_text())
    assert record["stages"] == ({"environment": "ok", "resume": "stopped"} if stage == "resume" else
                                {"environment": "stopped"})
    assert record["failure"] == f"stopped by SIGTERM at stage {stage}" and "resumed_from" not in record
    assert (f"stopped by SIGTERM at stage {stage} (the session ended?); before the resume stage had copied the "
            "previous version's run whole: the next version does not resume from this output") in log
    assert "for the next version to resume from" not in log
    # the next version, attached only this output (Kaggle attaches the newest): fails, saying what to do
    second = tmp_path / "second"
    attach(working, second / "input" / f"{SLUG}-output")
    with pytest.raises(KERNEL.StageFailed, match=(
            f"holds no run to resume from: that version ended before its resume stage was done \\(stopped at "
            f"stage {stage}\\), so the run is still in the output of an earlier version .* attach that output")):
        KERNEL.restore_previous_run(second / "input", KERNEL_ID, second / "run", second)
    assert not (second / "run").exists()
    # with the version before attached too, it resumes from that one, whole
    attach(previous, second / "input" / f"{SLUG}-version-before")
    found = KERNEL.restore_previous_run(second / "input", KERNEL_ID, second / "run", second)
    unlock(second / "input")
    assert found == str(second / "input" / f"{SLUG}-version-before" / "run")
    whole = {name: path.read_bytes() for name, path in files_of(previous / "run").items()
             if not name.startswith("previous/")}
    assert {name: path.read_bytes() for name, path in files_of(second / "run").items()} == whole
    assert not (second / ".tmp-run").exists()


def test_a_kernel_stopped_once_its_run_is_copied_whole_leaves_it_for_the_next_version(tmp_path, monkeypatch,
                                                                                      capsys):
    """The copy is put in place by one rename: a stop right after it, still in the resume stage,
    leaves the whole run and a record the next version resumes from."""
    previous, root, working = resuming_kernel(tmp_path, monkeypatch)
    log = KERNEL.log

    def log_then_stop(message: str) -> None:  # the session ends as the resume stage says it copied the run
        log(message)
        if message.startswith("resume: copied"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)

    monkeypatch.setattr(KERNEL, "log", log_then_stop)
    capsys.readouterr()
    assert KERNEL.main() == 130
    monkeypatch.setattr(KERNEL, "log", log)
    unlock(root / "input")
    assert (f"stopped by SIGTERM at stage resume (the session ended?); the run is in {working / 'run'}, for the "
            "next version to resume from") in capsys.readouterr().out
    record = json.loads((working / layout.RUN_MARKER).read_text())
    assert record["stages"] == {"environment": "ok", "resume": "ok"}
    assert record["failure"] == "stopped by SIGTERM at stage resume"
    attach(working, tmp_path / "second" / "input" / f"{SLUG}-output")
    found = KERNEL.restore_previous_run(tmp_path / "second" / "input", KERNEL_ID, tmp_path / "second" / "run",
                                        tmp_path / "second")
    unlock(tmp_path / "second" / "input")
    assert found == str(tmp_path / "second" / "input" / f"{SLUG}-output" / "run")
    assert files_of(tmp_path / "second" / "run").keys() == files_of(previous / "run").keys() - {"previous/train.log"}



@pytest.mark.parametrize("how", ["failed", "stopped"])
def test_a_kernel_with_no_run_ended_before_training_lets_the_next_version_start_over(tmp_path, monkeypatch, capsys,
                                                                                     how):
    """A version with nothing to resume that failed or was stopped after its resume stage but before
    training (a bad wheel at install) left a record and no run/: every later version pushed to resume
    failed at its resume stage, though nothing was trained. Its record now says it had no run, and the
    next version starts over; one whose record says it had a run, or trained, still fails."""
    root = tmp_path / "first"
    (root / "input" / SLUG / "wheels").mkdir(parents=True)
    info = {"id": KERNEL_ID, "ptbr_version": "0", "mode": "pretrain", "folders": ["wheels"], "files": {}}
    (root / "input" / SLUG / layout.BUNDLE_MARKER).write_text(json.dumps(info))
    working = root / "working"
    monkeypatch.setenv("KAGGLE_ROOT", str(root))
    monkeypatch.setattr(KERNEL, "BUNDLE_ID", KERNEL_ID)

    def install(wheels, info) -> None:
        if how == "stopped":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        raise KERNEL.StageFailed("pip exited with 1")

    monkeypatch.setattr(KERNEL, "install", install)
    assert KERNEL.main() == (130 if how == "stopped" else 1)
    assert [path.name for path in working.iterdir()] == [layout.RUN_MARKER]
    record = json.loads((working / layout.RUN_MARKER).read_text())
    assert record["stages"]["install"] == how and record["had_run"] is False and record["resumed_from"] is None
    # the next version, pushed to resume from this output: starts over, saying why
    monkeypatch.setattr(KERNEL, "EXPECT_PREVIOUS", True)
    second = tmp_path / "second"
    attach(working, second / "input" / f"{SLUG}-output")
    capsys.readouterr()
    assert KERNEL.restore_previous_run(second / "input", KERNEL_ID, second / "run", second) is None
    assert (f"resume: the previous version ({second / 'input' / f'{SLUG}-output'}) ended at stage install ({how}) "
            "before any training: starting the run over") in capsys.readouterr().out
    assert not (second / "run").exists()
    unlock(second / "input")
    # a version that had a run, or trained, and left no run/: the run is lost, which is an error
    for n, changed in enumerate(({"had_run": True}, {"stages": {**record["stages"], "train": "running"}})):
        third = tmp_path / f"third-{n}"
        (third / "output").mkdir(parents=True)
        (third / "output" / layout.RUN_MARKER).write_text(json.dumps({**record, **changed}))
        with pytest.raises(KERNEL.StageFailed, match="no ptbr-kaggle-run.json of .* with its run/ is under"):
            KERNEL.restore_previous_run(third / "output", KERNEL_ID, third / "run", third)

# --- the kernel, run here ------------------------------------------------------------------------------------


def kernel_env(root: Path) -> dict[str, str]:
    """What a kernel sees: $KAGGLE_ROOT, no pip configuration and no PIP_* variable (no index); and
    credentials in its environment (a user's own setting), which must reach no log and no output."""
    keep = ("PATH", "LANG", "LC_ALL", "SYSTEMROOT")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(KAGGLE_ROOT=str(root), PIP_CONFIG_FILE=os.devnull, HOME=str(root / "home"), TMPDIR=str(root / "tmp"),
               KAGGLE_KERNEL_RUN_TYPE="Batch", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               KAGGLE_USERNAME=USERNAME, KAGGLE_KEY=KEY)
    (root / "home").mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(parents=True, exist_ok=True)
    (root / "working").mkdir(parents=True, exist_ok=True)
    return env


def run_kernel(python: Path, bundle: Path, root: Path, stop_when: str | None = None,
               script: Path | None = None) -> tuple[int, str]:
    """The bundle's kernel script (or `script`) as Kaggle runs it (cwd /kaggle/working); with
    `stop_when`, SIGTERM once a line holding it is printed, as Kaggle ending the session does."""
    env = kernel_env(root)
    script = script or bundle / "kernel" / layout.KERNEL_FILE
    process = subprocess.Popen([str(python), str(script)], cwd=root / "working",
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if stop_when and stop_when in line:
            process.send_signal(signal.SIGTERM)
            stop_when = None
    return process.wait(timeout=900), "".join(lines)


def make_venv(folder: Path, with_torch: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, capture_output=True)
    python = folder / "bin" / "python"
    if with_torch:
        torch = f"torch=={BUILD.TORCH_VERSION}+cpu"
        index = [] if BUILD.local_torch_cpu_dirs() else ["--extra-index-url", BUILD.TORCH_CPU_INDEX]
        # pip's configuration on this machine points at the local CPU wheel; the kernel's install does without it
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile",
                        "--disable-pip-version-check", torch, *index], check=True, capture_output=True)
    return python


@pytest.fixture(scope="module")
def torch_venv(tmp_path_factory) -> Path:
    return make_venv(tmp_path_factory.mktemp("kernel") / "venv", with_torch=True)


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """Python without torch: what the kernel installs into is thrown away with it."""
    return make_venv(tmp_path_factory.mktemp("bare") / "venv", with_torch=False)


def pushed_script(script: Path, folder: Path) -> Path:
    """The kernel script as `ptbr kaggle push` sends it when it attached the previous version's
    output: finding no run there fails the kernel."""
    text = script.read_text()
    assert text.count("\nEXPECT_PREVIOUS = False\n") == 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / layout.KERNEL_FILE).write_text(text.replace("\nEXPECT_PREVIOUS = False\n", "\nEXPECT_PREVIOUS = True\n"))
    return folder / layout.KERNEL_FILE


def attach(source: Path, target: Path) -> None:
    """A copy of `source` at `target`, read-only as Kaggle mounts inputs."""
    shutil.copytree(source, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)


def unlock(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.mark.slow
def test_the_kernel_trains_stops_on_sigterm_and_the_next_version_resumes(torch_venv, tiny_bundle, tmp_path):
    # first version: the dataset where older sessions mount it, /kaggle/input/SLUG; the session ends mid-run
    first = tmp_path / "first"
    attach(tiny_bundle / "dataset", first / "input" / SLUG)
    code, log = run_kernel(torch_venv, tiny_bundle, first, stop_when="step 2/24")
    working = first / "working"
    assert code == 130, log
    for stage in ("environment", "bundle", "install", "resume", "preflight", "train"):
        assert f"[ptbr-kernel] {stage}: " in log, stage
    assert "--no-index --find-links" in log and "Requirement already satisfied: torch" in log
    assert "got SIGTERM: asking ptbr to save a checkpoint and stop" in log
    assert "preflight: ptbr runs with NCCL_P2P_DISABLE=1 (the bundle's --env)" in log
    assert "starting 2 data-parallel processes" in log, "ptbr's own launcher, as for two T4s"
    assert (working / "run" / "preflight_report.json").is_file()
    assert KEY not in log and holds(working, KEY) == []
    record = json.loads((working / layout.RUN_MARKER).read_text())
    assert record["stages"] == {"environment": "ok", "bundle": "ok", "install": "ok", "resume": "ok",
                                "preflight": "ok", "train": "stopped"} and record["train_exit_code"] == 130
    steps = sorted(int(p.name.split("_")[1]) for p in (working / "run" / "checkpoints").glob("step_*"))
    assert steps and steps[-1] < TINY["max_steps"], log
    assert len(steps) <= 2, "keep_last 2: the bundle's default for Kaggle's 20 GB"
    stopped_at = steps[-1]

    # a version that fails before training (here: its dataset not attached) still leaves the run in
    # its output, so the chain of versions goes on from it (its output once held only the run marker)
    pushed = pushed_script(tiny_bundle / "kernel" / layout.KERNEL_FILE, tmp_path / "pushed")
    failed = tmp_path / "failed"
    attach(working, failed / "input" / SLUG)
    code, log = run_kernel(torch_venv, tiny_bundle, failed, script=pushed)
    unlock(failed / "input")
    assert code == 1 and "FAILED at stage bundle: no bundle" in log, log
    assert json.loads((failed / "working" / layout.RUN_MARKER).read_text())["stages"] == {
        "environment": "ok", "resume": "ok", "bundle": "failed"}
    assert (failed / "working" / "run" / "checkpoints" / f"step_{stopped_at:06d}" / "trainer_state.json").is_file()

    # next version: the dataset where newer sessions mount it, and the failed version's output attached
    second = tmp_path / "second"
    attach(tiny_bundle / "dataset", second / "input" / "datasets" / USERNAME / SLUG)
    attach(failed / "working", second / "input" / SLUG)
    code, log = run_kernel(torch_venv, tiny_bundle, second, script=pushed)
    unlock(second / "input")
    assert code == 0, log
    run_dir = second / "working" / "run"
    assert "starting 2 data-parallel processes" in log
    assert f"resume: copied the previous version's run from {second / 'input' / SLUG / 'run'}" in log
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{stopped_at:06d}'} (step {stopped_at})" in log
    assert json.loads((run_dir / "training_summary.json").read_text())["steps"] == TINY["max_steps"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, TINY["max_steps"] + 1)), \
        "both sessions' steps, each once"
    assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "preflight_report.json").is_file()
    record = json.loads((second / "working" / layout.RUN_MARKER).read_text())
    assert record["resumed_from"] == str(second / "input" / SLUG / "run") and record["exit_code"] == 0
    assert KEY not in log and holds(second / "working", KEY) == []


@pytest.mark.slow  # a bundle (wheels from the cache or the index) or a new virtual environment
def test_a_failed_kernel_names_its_stage(tmp_path, tiny_bundle, bare_venv):
    # nothing attached
    code, log = run_kernel(bare_venv, tiny_bundle, tmp_path / "empty")
    assert code == 1 and f"[ptbr-kernel] FAILED at stage bundle: no bundle {KERNEL_ID} (ptbr-bundle.json)" in log
    record = json.loads((tmp_path / "empty" / "working" / layout.RUN_MARKER).read_text())
    assert record["stages"] == {"environment": "ok", "resume": "ok", "bundle": "failed"} and record["exit_code"] == 1
    # a wheel that did not arrive whole
    root = tmp_path / "truncated"
    shutil.copytree(tiny_bundle / "dataset", root / "input" / SLUG)
    wheel = next((root / "input" / SLUG / "wheels").glob("transformers-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:1000])
    code, log = run_kernel(bare_venv, tiny_bundle, root)
    assert code == 1 and f"FAILED at stage bundle: the bundle at {root / 'input' / SLUG} is incomplete: " \
                         f"wheels/{wheel.name} has 1000 bytes" in log
    # another version of the dataset than the kernel's (still processing on Kaggle, or only the kernel
    # pushed): the same files, names and sizes, but one setting changed
    root = tmp_path / "other-version"
    shutil.copytree(tiny_bundle / "dataset", root / "input" / SLUG)
    settings = root / "input" / SLUG / "train-config.json"
    text = settings.read_text()
    settings.write_text(text.replace("1", "2", 1) if "1" in text else text.replace("0", "9", 1))
    marker = root / "input" / SLUG / layout.BUNDLE_MARKER
    info = json.loads(marker.read_text())
    info["files"]["train-config.json"]["sha256"] = hashlib.sha256(settings.read_bytes()).hexdigest()
    marker.write_text(json.dumps(info, indent=2) + "\n")  # a consistent bundle, only not this kernel's
    code, log = run_kernel(bare_venv, tiny_bundle, root)
    assert code == 1 and f"FAILED at stage bundle: the bundle attached at {root / 'input' / SLUG} is another " \
                         f"version of {KERNEL_ID} than the one this kernel was made with" in log
    # and a file changed but not its size, against the marker: the settings are checked by their sha256
    info["files"]["train-config.json"]["sha256"] = "0" * 64
    marker.write_text(json.dumps(info, indent=2) + "\n")
    with pytest.raises(KERNEL.StageFailed, match="train-config.json does not match its sha256"):
        KERNEL.check_bundle(root / "input" / SLUG, info, tmp_path / "scratch")


@pytest.mark.slow  # a bundle (wheels from the cache or the index) or a new virtual environment
def test_a_kernel_whose_install_fails_says_so(tmp_path, tiny_bundle, bare_venv):
    """Without torch (Kaggle's image has it; the bundle does not), pip cannot install ptbr offline."""
    root = tmp_path / "kaggle"
    shutil.copytree(tiny_bundle / "dataset", root / "input" / "datasets" / USERNAME / SLUG)
    previous = previous_output(tmp_path / "previous")  # a previous version's output, attached
    attach(previous, root / "input" / SLUG)
    code, log = run_kernel(bare_venv, tiny_bundle, root)
    unlock(root / "input")
    assert code == 1 and "[ptbr-kernel] FAILED at stage install: pip exited with 1" in log
    assert "torch" in log
    # the run was carried into this version's output first, for the next version to resume from
    carried = {name: path.read_bytes() for name, path in files_of(root / "working" / "run").items()}
    assert carried == {name: path.read_bytes() for name, path in files_of(previous / "run").items()
                       if not name.startswith("previous/")}
    record = json.loads((root / "working" / layout.RUN_MARKER).read_text())
    assert record["stages"] == {"environment": "ok", "resume": "ok", "bundle": "ok", "install": "failed"}
    assert record["bundle"] == KERNEL_ID and record["resumed_from"] == str(root / "input" / SLUG / "run")


def previous_output(folder: Path) -> Path:
    """What a previous version of the kernel left in /kaggle/working: its run marker and run/."""
    run = folder / "run"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "checkpoints" / "step_000003" / "trainer_state.json").write_text('{"step": 3}')
    (run / "checkpoints" / "step_000003" / "model.safetensors").write_bytes(bytes(range(256)))
    (run / "train.log").write_text("step 3/24 | loss 7.1\n")
    (run / "previous").mkdir()  # what a run keeps of an older one: not carried
    (run / "previous" / "train.log").write_text("older\n")
    (folder / layout.RUN_MARKER).write_text(json.dumps({"bundle": KERNEL_ID, "stages": {"train": "stopped"},
                                                        "exit_code": 0}))
    return folder


def test_a_version_that_fails_before_training_still_carries_the_run_forward(tmp_path):
    """The run of the previous version is copied into /kaggle/working before any stage that can
    fail: a version failing at its bundle stage leaves it in its output, and the next version (pushed
    expecting it: EXPECT_PREVIOUS) finds it there, however many versions failed in between."""
    script = (ROOT / "kaggle" / "kernel.py").read_text().replace('BUNDLE_ID = ""\n', f'BUNDLE_ID = "{KERNEL_ID}"\n')
    (tmp_path / "kernel.py").write_text(script)
    pushed = pushed_script(tmp_path / "kernel.py", tmp_path / "pushed")
    previous = previous_output(tmp_path / "previous")
    expected = {name: path.read_bytes() for name, path in files_of(previous / "run").items()
                if not name.startswith("previous/")}
    # a bundle with a file missing: the bundle stage fails
    broken = {"id": KERNEL_ID, "folders": [], "files": {"train-config.json": {"bytes": 2, "sha256": "0" * 64}}}
    for version in ("first", "second"):
        root = tmp_path / version
        (root / "input" / "datasets" / USERNAME / SLUG).mkdir(parents=True)
        (root / "input" / "datasets" / USERNAME / SLUG / layout.BUNDLE_MARKER).write_text(json.dumps(broken))
        attach(previous, root / "input" / f"{SLUG}-output")
        code, log = run_kernel(Path(sys.executable), tmp_path, root, script=pushed)
        unlock(root / "input")
        assert code == 1 and "[ptbr-kernel] FAILED at stage bundle: the bundle at" in log, log
        assert f"resume: copied the previous version's run from {root / 'input' / f'{SLUG}-output' / 'run'}" in log
        working = root / "working"
        assert {name: path.read_bytes() for name, path in files_of(working / "run").items()} == expected
        record = json.loads((working / layout.RUN_MARKER).read_text())
        assert record["stages"] == {"environment": "ok", "resume": "ok", "bundle": "failed"}
        assert record["bundle"] == KERNEL_ID and record["exit_code"] == 1
        previous = working  # the next version attaches this one's output


def test_the_kernel_finds_a_kaggle_model_by_its_path_not_one_layout(tmp_path):
    inputs = tmp_path / "input"
    for folder in ("mistral/transformers/7b-v0.1/1", "mistral/transformers/7b-v0.1/2", "other/transformers/x/1",
                   "ptbr-farense/base", "previous-kernel/run/final"):
        (inputs / folder).mkdir(parents=True)
        (inputs / folder / "config.json").write_text("{}")
    (inputs / "previous-kernel" / layout.RUN_MARKER).write_text("{}")
    info = {"base": {"kaggle": "mistral-ai/mistral/transformers/7b-v0.1/2"}}
    bundle = inputs / "ptbr-farense"
    assert KERNEL.find_base(inputs, info, {}, exclude=bundle) == inputs / "mistral/transformers/7b-v0.1/2"
    info = {"base": {"kaggle": "mistral-ai/mistral/transformers/7b-v0.1"}}
    assert KERNEL.find_base(inputs, info, {}, exclude=bundle) in (inputs / "mistral/transformers/7b-v0.1/1",
                                                                  inputs / "mistral/transformers/7b-v0.1/2")
    with pytest.raises(KERNEL.StageFailed, match="the Kaggle model o/gemma/transformers/2b is not under"):
        KERNEL.find_base(inputs, {"base": {"kaggle": "o/gemma/transformers/2b"}}, {}, exclude=bundle)
    # a folder kept as the .zip it was sent as is unpacked and checked
    dataset = tmp_path / "dataset"
    (dataset / "wheels").mkdir(parents=True)
    (dataset / "wheels" / "a-1-py3-none-any.whl").write_bytes(b"wheel")
    with zipfile.ZipFile(dataset / "data.zip", "w") as archive:
        archive.writestr("train.jsonl", "{}\n")
    info = {"folders": ["data", "wheels"], "files": {
        "wheels/a-1-py3-none-any.whl": {"bytes": 5, "sha256": KERNEL.sha256(dataset / "wheels" / "a-1-py3-none-any.whl")},
        "data/train.jsonl": {"bytes": 3, "sha256": hashlib.sha256(b"{}\n").hexdigest()}}}
    folders = KERNEL.check_bundle(dataset, info, tmp_path / "scratch")
    assert folders == {"data": tmp_path / "scratch" / "data", "wheels": dataset / "wheels"}


CHILD = """
import signal, sys, time
from pathlib import Path
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
Path(sys.argv[1]).write_text("ready")
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.5)  # a second SIGTERM would arrive meanwhile
sys.exit(130 if len(got) == 1 else 100 + len(got))
"""


def test_the_kernel_passes_one_sigterm_on_and_stops_training_when_its_time_is_up(tmp_path):
    """ptbr saves and exits 130 on the first SIGTERM and stops at once on a second: the kernel sends
    exactly one, for its time budget or for Kaggle's signals, however many arrive."""
    import threading
    import time

    ready = tmp_path / "ready"
    command = [sys.executable, "-c", CHILD, str(ready)]
    before = signal.getsignal(signal.SIGTERM)
    assert KERNEL.train("train", command, dict(os.environ), budget_s=0.5) == (130, True)

    ready.unlink()

    def kaggle_ends_the_session() -> None:
        while not ready.exists():
            time.sleep(0.01)
        for _ in range(3):  # the signal may reach the kernel more than once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)

    thread = threading.Thread(target=kaggle_ends_the_session)
    thread.start()
    assert KERNEL.train("train", command, dict(os.environ), budget_s=600) == (130, False)
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is before, "the kernel's handlers last as long as training"


def test_the_kernel_stops_ptbr_s_workers_not_the_launcher_that_would_kill_them(tmp_path):
    """Signalled, torch's launcher kills its workers 30 s after passing the signal on (Kaggle's torch
    cannot be told otherwise), before a large checkpoint is written: the kernel signals the workers
    (the launcher's `python -m ptbr` children) and lets the launcher wait for them."""
    import time

    sleeper = "import time; time.sleep(60)"
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"workers = [subprocess.Popen([sys.executable, '-c', {sleeper!r}, '-m', 'ptbr', 'train']) for _ in range(2)]\n"
        f"other = subprocess.Popen([sys.executable, '-c', {sleeper!r}])\n"
        "time.sleep(60)\n")], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(KERNEL.ptbr_workers(launcher.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = KERNEL.ptbr_workers(launcher.pid)
        assert len(workers) == 2 and launcher.pid not in workers
        assert KERNEL.ptbr_workers(os.getpid()) == []  # a single-process run: ptbr itself is signalled
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and all it started
        launcher.wait()


def test_a_kernel_without_a_gpu_fails_unless_its_settings_say_cpu(tmp_path):
    """The accelerator left off in the kernel's settings: `device: auto` would train on the CPU for
    the whole session and end "complete"."""
    auto, cpu = tmp_path / "auto.json", tmp_path / "cpu.json"
    auto.write_text(json.dumps({"model_size": "tiny"}))
    cpu.write_text(json.dumps({"model_size": "tiny", "device": "cpu"}))
    if KERNEL.visible_gpus():
        pytest.skip("this machine has a GPU")
    with pytest.raises(KERNEL.StageFailed, match="no GPU is visible to this session: turn on the GPU accelerator"):
        KERNEL.require_a_gpu(auto)
    KERNEL.require_a_gpu(cpu)


def test_a_kernel_told_to_resume_fails_when_no_previous_run_is_attached(tmp_path, monkeypatch):
    """`ptbr kaggle push` attached the previous version's output: a kernel that finds no run there
    fails, where it would quietly start the run over (and lose the sessions before)."""
    (tmp_path / "input").mkdir()
    assert KERNEL.restore_previous_run(tmp_path / "input", KERNEL_ID, tmp_path / "run", tmp_path) is None
    monkeypatch.setattr(KERNEL, "EXPECT_PREVIOUS", True)
    with pytest.raises(KERNEL.StageFailed, match="the previous version's output was attached to resume from"):
        KERNEL.restore_previous_run(tmp_path / "input", KERNEL_ID, tmp_path / "run", tmp_path)
    # an output holding only the run marker (what a version failing early used to leave) is no run
    (tmp_path / "input" / "old").mkdir()
    (tmp_path / "input" / "old" / layout.RUN_MARKER).write_text(json.dumps({"bundle": KERNEL_ID}))
    with pytest.raises(KERNEL.StageFailed, match=f"no {layout.RUN_MARKER} of {KERNEL_ID} with its run/"):
        KERNEL.restore_previous_run(tmp_path / "input", KERNEL_ID, tmp_path / "run", tmp_path)
