"""Developer and CI sessions: `nox -s tests`, `nox -s smoke`, `nox -s lint` (see README).

Every session that installs Python packages installs them from a hash-locked file in locks/
(`pip install --require-hashes -r locks/X.txt`), then ptbr from this checkout without its
dependencies, so that a new upstream release changes nothing until `nox -s locks` is run and the
result committed. tests/test_locks.py checks that the locks agree with pyproject.toml and that
every session here installs from them.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import sys
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True
# A session whose Python cannot be found fails instead of being skipped with a warning.
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).resolve().parent


def load_build_script():
    """docker/build.py, which makes the locks and knows what they were made for."""
    spec = importlib.util.spec_from_file_location("ptbr_build_for_nox", ROOT / "docker" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


BUILD = load_build_script()
# The locks are resolved for CPython 3.11: the CPU torch wheel they pin by hash exists for that
# Python only. nox finds a python3.11 on PATH (or downloads one where nox has its [pbs] extra).
LOCK_PYTHON = BUILD.IMAGE_PYTHON
# Which lock each kind of session installs, per platform. cpu.txt is exactly what the ptbr-cpu
# image ships (core + finetune); ci.txt adds the kaggle and dev extras and MLX's CPU build, so the
# MLX path is tested for real on Linux too. On Apple Silicon macos.txt holds all of it.
LOCKS_BY_PLATFORM = {
    ("Linux", "x86_64"): {"tests": "ci", "run": "cpu", "cuda": "cuda", "kaggle": "ci"},
    ("Darwin", "arm64"): {"tests": "macos", "run": "macos", "kaggle": "macos"},
}
# Files the tests read from a wheel, installed by hash without its dependencies into a folder of
# its own (never site-packages: where transformers finds mistral-common installed it loads Mistral
# tokenizers through it): Mistral-7B's SentencePiece model from mistral-common (see the file).
# The tests find the folder through PTBR_TEST_DATA.
TEST_DATA = ROOT / "locks" / "test-data.txt"
TEST_DATA_DIR = ROOT / ".cache" / "test-data"  # git-ignored, kept between runs
# Installer tooling that a virtual environment starts with; a lock need not name it.
SEEDED = {"pip", "setuptools", "wheel"}


def lock_for(session: nox.Session, purpose: str, system: str | None = None,
             machine: str | None = None) -> Path:
    """The lock file that `purpose` ("tests", "run", "cuda" or "kaggle") installs on this platform (or the
    one named); elsewhere the session stops and says how to install without a lock."""
    system, machine = system or platform.system(), machine or platform.machine()
    name = LOCKS_BY_PLATFORM.get((system, machine), {}).get(purpose)
    if name is None:
        covered = " and ".join(f"{s} {m}" for (s, m), by in LOCKS_BY_PLATFORM.items() if purpose in by)
        extras = {"tests": "finetune,kaggle,report,tensorboard,dev", "kaggle": "kaggle"}.get(purpose, "finetune,report")
        session.error(
            f"locks/ holds no lock for {system} {machine} (this session's covers {covered}). "
            f"Install unlocked in an environment of your own instead: "
            f"pip install -e '.[{extras}]'" + (
                f" (after torch's CPU build where there is no GPU: pip install torch=={BUILD.TORCH_VERSION} "
                f"--index-url {BUILD.TORCH_CPU_INDEX})" if system == "Linux" else ""))
    return ROOT / "locks" / f"{name}.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_name(line: str) -> str | None:
    """The package a lock file's line pins (`name==version` or `name[extra]==version`), if any."""
    match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==", line)
    return canonical(match.group(1)) if match else None


def lock_entries(lock: Path, names: set[str]) -> str:
    """The entries (pin and hashes) of `names` in a lock file, as a requirements file's text."""
    kept, keep = [], False
    for line in lock.read_text().splitlines():
        if line[:1].strip():  # an entry starts at column 0; its hashes and comments are indented
            keep = pinned_name(line) in names
        if keep:
            kept.append(line)
    return "\n".join(kept) + "\n"


def torch_index(lock: Path) -> list[str]:
    """PyPI has no CPU build of torch: a lock that pins one gets PyTorch's CPU index, unless pip is
    configured with a folder holding that wheel (as on ptbr's machines, which cannot reach the
    index). The lock's hash decides which file is accepted either way."""
    if "+cpu" not in BUILD.LOCKS[lock.stem].torch or BUILD.local_torch_cpu_dirs():
        return []
    return ["--extra-index-url", BUILD.TORCH_CPU_INDEX]


# What the MLX path needs no part of: the torch backend's libraries.
TORCH_ONLY = {"torch", "peft", "bitsandbytes", "accelerate"}
# Where the MLX path starts: ptbr's own dependencies but torch's, and MLX with mlx-lm.
MLX_ROOTS = {"transformers", "tokenizers", "safetensors", "numpy", "psutil", "pyyaml", "tqdm", "mlx", "mlx-lm"}


def lock_requirers(lock: Path) -> dict[str, set[str]]:
    """{package: the packages pinned because it requires them}, from the lock's `# via` notes."""
    requires: dict[str, set[str]] = {}
    current = None
    for line in lock.read_text().splitlines():
        if line[:1].strip():
            current = pinned_name(line)
            continue
        note = re.match(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9][A-Za-z0-9._\[\]-]*)\s*$", line)
        if current and note and note.group(1) != "via":
            requires.setdefault(canonical(note.group(1).split("[")[0]), set()).add(current)
    return requires


def mlx_packages(lock: Path) -> set[str]:
    """The lock's packages that the MLX path imports: MLX_ROOTS and everything they require,
    without the torch backend's libraries (the set `nox -s mac` and tests/test_mlx_env.py install)."""
    requires, found, todo = lock_requirers(lock), set(), [canonical(root) for root in MLX_ROOTS]
    pinned = {pinned_name(line) for line in lock.read_text().splitlines()}
    while todo:
        name = todo.pop()
        if name in found or name in TORCH_ONLY or name not in pinned:
            continue
        found.add(name)
        todo.extend(requires.get(name, ()))
    return found


def install_locked(session: nox.Session, lock: Path) -> None:
    """Every dependency from the lock (hash-checked), then ptbr from this checkout without its
    dependencies; what the lock does not name is removed, so that a reused environment holds the
    lock and nothing else."""
    session.install("--require-hashes", "-r", str(lock), *torch_index(lock))
    # The build backend (setuptools) is in every lock: no unpinned build environment either.
    session.install("--no-deps", "--no-build-isolation", "-e", ".")
    listed = session.run_install("python", "-m", "pip", "list", "--format=freeze",
                                 "--exclude-editable", silent=True) or ""
    locked = {pinned_name(line) for line in lock.read_text().splitlines()} | SEEDED
    strays = [line.split("==")[0] for line in listed.split() if pinned_name(line) not in locked]
    if strays:
        session.run_install("python", "-m", "pip", "uninstall", "--yes", *strays)


@nox.session(python=LOCK_PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite (tiny models, real CLI, real QLoRA on CPU, real container build)."""
    install_locked(session, lock_for(session, "tests"))
    # (not session.create_tmp(): it points TMPDIR into .nox/, inside this repository, where the image
    # test's copy of the checkout then found this repository's git instead of its own)
    data = TEST_DATA_DIR
    session.install("--require-hashes", "--no-deps", "--upgrade", "--target", str(data), "-r", str(TEST_DATA))
    session.run("pytest", *test_workers(session.posargs), *session.posargs, env={"PTBR_TEST_DATA": str(data)})


def test_workers(posargs: list[str]) -> list[str]:
    """pytest-xdist's arguments: the test files spread over two workers or more (one per CPU core,
    up to 4), each file whole on one worker (its module fixtures, the container image's build among
    them, made once; tests/conftest.py hands out the longest files first). Most of the suite's time
    is spent starting and waiting for `ptbr` processes, which two workers overlap: on a 2-core CI
    machine the whole run took 33 minutes in one process. `nox -s tests -- -n 0` runs it in one."""
    if "no:xdist" in posargs or any(arg == "-n" or arg.startswith(("-n=", "--numprocesses")) for arg in posargs):
        return []
    return ["-n", str(max(2, min(4, os.cpu_count() or 2))), "--dist", "loadfile"]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, the tests, this file, the Kaggle kernel script, the benchmarks and the
    image build script (the version and hashes locks/ci.txt pins)."""
    requirements = Path(session.create_tmp()) / "ruff.txt"
    requirements.write_text(lock_entries(ROOT / "locks" / "ci.txt", {"ruff"}))
    session.install("--require-hashes", "--no-deps", "-r", str(requirements))
    session.run("ruff", "check", "ptbr", "tests", "noxfile.py", "kaggle", "benchmarks", "docker", *session.posargs)


@nox.session(python=LOCK_PYTHON)
def smoke(session: nox.Session) -> None:
    """A fresh environment, then `ptbr smoke`: one step of `tiny` on the bundled sample."""
    install_locked(session, lock_for(session, "run"))
    session.run("ptbr", "smoke", *session.posargs)


@nox.session(python=LOCK_PYTHON)
def preflight(session: nox.Session) -> None:
    """A fresh environment, then `ptbr preflight --mode pretrain` on the bundled sample.

    Exits 10 if a check fails; `-- FLAGS` plans another run, e.g. `-- --model-size 85m --seq-len 1024`."""
    install_locked(session, lock_for(session, "run"))
    session.run("ptbr", "preflight", "--mode", "pretrain", "--output", "runs/preflight", *session.posargs)


@nox.session(python=LOCK_PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """Speed side by side (benchmarks/speed.py, the README's performance table): ptbr against the
    Hugging Face Trainer, PEFT, a plain PyTorch loop and tokenizers, about 30 minutes on 2 CPU cores;
    on Apple Silicon also ptbr's MLX LoRA against mlx_lm.lora (benchmarks/mlx_lora_speed.py).

    `-- --memory`: the memory model's predicted peaks against measured ones instead (the README's
    accuracy tables: pretraining, then LoRA/QLoRA; about 15 minutes). On a GPU machine,
    `-- --device cuda` (the environment then installs locks/cuda.txt, PyPI's CUDA build of torch)."""
    cuda = "cuda" in session.posargs or "--device=cuda" in session.posargs
    install_locked(session, lock_for(session, "cuda" if cuda else "run"))
    posargs = [arg for arg in session.posargs if arg != "--memory"]
    on_mac = (platform.system(), platform.machine()) == ("Darwin", "arm64")  # MLX is in the run lock there
    if "--memory" not in session.posargs:
        if on_mac:
            session.run("python", "benchmarks/mlx_lora_speed.py", "--json", "benchmarks/results/mlx_lora_speed_metal.json")
        session.run("python", "benchmarks/speed.py", *posargs)
        return
    session.run("python", "benchmarks/memory_accuracy.py", "--markdown", *posargs)
    session.run("python", "benchmarks/lora_memory_accuracy.py", "--markdown", *posargs)
    if on_mac:
        session.run("python", "benchmarks/mlx_memory_accuracy.py", "--markdown")


@nox.session(python=LOCK_PYTHON, default=False)
def mac(session: nox.Session) -> None:
    """The native Mac environment (macOS on Apple Silicon): MLX and mlx-lm for Metal from the
    hash-locked locks/macos.txt, without torch (the MLX path needs none), then `ptbr preflight`
    and `ptbr smoke --backend mlx`. On any other platform it says so and fails."""
    system, machine = platform.system(), platform.machine()
    if (system, machine) != ("Darwin", "arm64"):
        session.error(f"nox -s mac is for macOS on Apple Silicon (Darwin arm64), and this is {system} {machine}: "
                      "MLX's Metal build exists only there. Elsewhere: nox -s tests (MLX's CPU build is in it)")
    lock = lock_for(session, "run")
    requirements = Path(session.create_tmp()) / "mlx.txt"
    requirements.write_text(lock_entries(lock, mlx_packages(lock) | {"setuptools", "wheel"}))
    session.install("--require-hashes", "--no-deps", "-r", str(requirements))
    session.install("--no-deps", "--no-build-isolation", "-e", ".")
    session.run("ptbr", "preflight", "--output", "runs/preflight-mac", *session.posargs)
    session.run("ptbr", "smoke", "--backend", "mlx")


@nox.session(python=LOCK_PYTHON, default=False)
def kaggle(session: nox.Session) -> None:
    """`ptbr kaggle ACTION` from this checkout, with the kaggle client the lock pins:
    `-- bundle --output BUNDLE --owner OWNER --slug SLUG [...]`, `-- push BUNDLE`,
    `-- status BUNDLE --wait`, `-- output BUNDLE --path DIR` (see the README's Kaggle section)."""
    install_locked(session, lock_for(session, "kaggle"))
    session.run("ptbr", "kaggle", *session.posargs)


# --- container images (docker/build.py holds the logic; see docker/README.md) -------------------
# build.py uses the standard library only; `build` installs the locks' setuptools, which builds the
# ptbr wheel that the image installs (the same setuptools everywhere: the same wheel, the same image).


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Build ptbr-cpu from this checkout (`-- cuda`: ptbr-cuda; `-- --no-cache`: from scratch)."""
    requirements = Path(session.create_tmp()) / "backend.txt"
    requirements.write_text(lock_entries(ROOT / "locks" / "cpu.txt", {"setuptools"}))
    session.install("--require-hashes", "--no-deps", "-r", str(requirements))
    session.run("python", "docker/build.py", "build", *session.posargs)


@nox.session(default=False)
def image_smoke(session: nox.Session) -> None:
    """`ptbr smoke` inside the image that `nox -s build` made (`-- cuda` for ptbr-cuda; it gets
    the GPU where one exists and runs on the CPU elsewhere)."""
    session.run("python", "docker/build.py", "smoke", *session.posargs)


@nox.session(default=False)
def locks(session: nox.Session) -> None:
    """Regenerate the hash-locked requirements in locks/ from pyproject.toml (uv pip compile).

    The one session that cannot install from a lock (it makes them): it pins uv exactly."""
    session.install(f"uv=={BUILD.UV_VERSION}")
    session.run("python", "docker/build.py", "locks", *session.posargs)


@nox.session(python=LOCK_PYTHON, default=False)
def mutants(session: nox.Session) -> None:
    """Mutation testing of the training core (tests/mutants.py): small deliberate bugs in the step,
    loop, checkpoint, schedule and batch code, one at a time on a temporary copy, each of which the
    tests must catch; prints the score and the survivors, writes runs/mutants/report.json.

    A periodic check, not CI. `-- --max 40 --seed 1` samples 40 generated mutants (plus the
    curated ones, always run); `-- --module ptbr/backends/torch/step.py` one module; `-- --jobs 4` in parallel."""
    install_locked(session, lock_for(session, "tests"))
    session.run("python", "tests/mutants.py", *session.posargs)
