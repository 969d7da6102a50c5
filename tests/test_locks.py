"""The hash-locked requirement files in locks/ agree with pyproject.toml (regenerate: `nox -s locks`)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import platform
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "regenerate the locks with `nox -s locks`"


def load_build_script():
    spec = importlib.util.spec_from_file_location("ptbr_docker_build", ROOT / "docker" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


BUILD = load_build_script()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


class Entry(NamedTuple):
    version: str
    hashes: list[str]
    via: list[str]  # uv's `# via` annotations: what asked for this pin


def parse_lock(path: Path) -> dict[str, Entry]:
    """{canonical name: Entry} from a `uv pip compile --generate-hashes` file."""
    entries: dict[str, Entry] = {}
    current = None
    for line in path.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)", line)
        if pin:
            current = canonicalize_name(pin.group(1))
            entries[current] = Entry(pin.group(2), [], [])
        elif current and (digest := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            entries[current].hashes.append(digest.group(1))
        elif current and (via := re.match(r"^\s+#\s+(?:via\s+)?(\S.*)$", line)):
            if via.group(1) != "via":
                entries[current].via.append(via.group(1).strip())
        elif line and not line.startswith(" "):
            current = None
    return entries


def applies(requirement: Requirement, markers: dict[str, str]) -> bool:
    environment = {"python_version": BUILD.IMAGE_PYTHON, "python_full_version": f"{BUILD.IMAGE_PYTHON}.0",
                   **markers, "extra": ""}
    return requirement.marker is None or requirement.marker.evaluate(environment)


def required(lock) -> list[Requirement]:
    """pyproject.toml's requirements that apply to this lock's platform and extras."""
    lines = list(PYPROJECT["dependencies"])
    for extra in lock.extras:
        lines += PYPROJECT["optional-dependencies"][extra]
    return [requirement for requirement in map(Requirement, lines) if applies(requirement, lock.markers)]


@pytest.fixture(params=sorted(BUILD.LOCKS), ids=lambda name: f"locks/{name}.txt")
def lock(request):
    lock = BUILD.LOCKS[request.param]
    if not lock.path.exists():
        pytest.fail(f"{lock.path.relative_to(ROOT)} is missing: {REGENERATE}")
    return lock


def out_of_range(entries: dict[str, Entry], requirements: list[Requirement]) -> list[str]:
    problems = []
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name not in entries:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(Version(entries[name].version), prereleases=True):
            problems.append(f"{requirement}: the lock pins {entries[name].version}")
    return problems


# --- each lock against pyproject.toml -----------------------------------------------------------


def test_every_pin_is_exact_and_hashed(lock):
    entries = parse_lock(lock.path)
    assert len(entries) > 10
    unhashed = sorted(name for name, entry in entries.items() if not entry.hashes)
    assert not unhashed, f"{lock.path.name}: pins without --hash: {unhashed}"
    text = lock.path.read_text()
    assert "nox -s locks" in text, "the header names the command that regenerates it"
    assert not re.search(r"/tmp/|/opt/wheels|https?://[^/\s]*@", text), "no local paths or credentials"


def test_every_pyproject_dependency_is_pinned_within_its_range(lock):
    """Core and the lock's extras, plus what docker/build.py adds (torch's build, MLX's CPU build)."""
    wanted = required(lock) + [Requirement(line) for line in (lock.torch, *lock.extra_requirements)]
    problems = out_of_range(parse_lock(lock.path), wanted)
    assert not problems, f"{lock.path.name} is out of date with pyproject.toml ({REGENERATE}):\n" + "\n".join(problems)


def test_the_lock_asks_for_exactly_what_pyproject_asks_for(lock):
    """A dependency removed from pyproject.toml (or moved out of an extra) leaves a lock that still
    pins it as ptbr's: the lock's record of its direct dependencies must match pyproject's."""
    recorded = {name for name, entry in parse_lock(lock.path).items() if "ptbr (pyproject.toml)" in entry.via}
    wanted = {canonicalize_name(requirement.name) for requirement in required(lock)}
    assert recorded == wanted, (
        f"{lock.path.name} is out of date with pyproject.toml ({REGENERATE}): "
        f"only in the lock {sorted(recorded - wanted)}, only in pyproject {sorted(wanted - recorded)}")


def test_every_extra_is_locked_where_it_applies():
    """A new extra fails here until a lock holds it; CI's lock holds every extra that installs
    anything on Linux, and MLX (whose extra is for Apple Silicon) through its CPU build."""
    extras = PYPROJECT["optional-dependencies"]
    ci = BUILD.LOCKS["ci"]
    assert set(extras) <= {extra for lock in BUILD.LOCKS.values() for extra in lock.extras}
    for extra, lines in extras.items():
        if any(applies(Requirement(line), ci.markers) for line in lines):
            assert extra in ci.extras, f"locks/ci.txt lacks the `{extra}` extra (docker/build.py LOCKS)"
    mlx = [Requirement(re.sub(r";.*", "", line)) for line in extras["mlx"]]
    problems = out_of_range(parse_lock(ci.path), mlx)
    assert not problems, f"CI's MLX build is outside the mlx extra's range ({REGENERATE}): {problems}"


def test_the_build_backend_is_locked():
    """The sessions install the checkout with --no-build-isolation, using the lock's setuptools."""
    backend = [Requirement(line) for line in tomllib.loads((ROOT / "pyproject.toml").read_text())
               ["build-system"]["requires"] if Requirement(line).name == "setuptools"]
    assert backend, "pyproject.toml builds with setuptools"
    for lock in BUILD.LOCKS.values():
        assert not out_of_range(parse_lock(lock.path), backend), lock.path.name


def test_the_ptbr_wheel_is_built_by_this_pythons_setuptools_never_a_fetched_one(tmp_path, monkeypatch):
    """pip's build isolation would fetch the newest setuptools, unhashed, and its version is written
    into the wheel: the wheel (and the image) is built without it, by the locks' setuptools."""
    import subprocess
    import zipfile

    locked = BUILD.lock_entries(BUILD.LOCKS["cpu"].path)["setuptools"].version
    wheel = BUILD.build_wheel(tmp_path / "dist", echo=False, locked_backend=True)
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/WHEEL")]
        assert f"Generator: setuptools ({locked})" in archive.read(name).decode()
    bare = tmp_path / "bare"  # a Python without setuptools
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    monkeypatch.setattr(BUILD.sys, "executable", str(bare / "bin" / "python"))
    with pytest.raises(BUILD.BuildError, match=rf"has none: install the locks' setuptools=={re.escape(locked)}"):
        BUILD.build_wheel(tmp_path / "dist", echo=False)


def test_torch_is_the_pinned_build(lock):
    entries = parse_lock(lock.path)
    version = entries["torch"].version
    assert version == lock.torch.split("==")[1]
    assert Version(version).public == "2.13.0"
    cuda_runtime = {"nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13"}
    has_cuda = bool(cuda_runtime & entries.keys())
    if lock.name == "cuda":
        assert version == "2.13.0" and has_cuda, "the CUDA image takes PyPI's CUDA build of torch"
    if lock.name in ("cpu", "ci"):
        assert version == "2.13.0+cpu" and not has_cuda, "no CUDA wheels on CPU installs"


def test_finetune_and_mlx_extras_land_where_they_run():
    pins = {name: set(parse_lock(BUILD.LOCKS[name].path)) for name in BUILD.LOCKS}
    for name in ("cpu", "cuda", "ci"):
        assert {"peft", "bitsandbytes"} <= pins[name], name
    assert {"peft", "mlx", "mlx-lm"} <= pins["macos"]
    assert "bitsandbytes" not in pins["macos"], "bitsandbytes is Linux/Windows only"
    assert "mlx-cpu" in pins["ci"], "CI exercises the MLX path with MLX's CPU build"
    assert not {"mlx", "pytest", "kaggle"} & pins["cpu"], "the CPU image ships no dev or MLX tools"


def test_ci_keeps_the_cpu_image_pins():
    cpu = parse_lock(BUILD.LOCKS["cpu"].path)
    ci = parse_lock(BUILD.LOCKS["ci"].path)
    differing = {name: (entry.version, ci[name].version if name in ci else "missing")
                 for name, entry in cpu.items() if name not in ci or ci[name].version != entry.version}
    assert not differing, f"CI would test other versions than the CPU image ships: {differing}"


def test_the_local_torch_wheel_matches_its_hash():
    """Where pip is configured with a folder holding the CPU torch wheel (as on ptbr's machines), a
    hash-checked install takes that file: its sha256 must be one the CPU locks accept."""
    wheels = [wheel for folder in BUILD.local_torch_cpu_dirs()
              for wheel in Path(folder).glob(f"torch-{BUILD.TORCH_VERSION}+cpu-cp311-*.whl")]
    if not wheels:
        pytest.skip("pip has no local folder with the CPU torch wheel here")
    for name in ("cpu", "ci"):
        hashes = parse_lock(BUILD.LOCKS[name].path)["torch"].hashes
        for wheel in wheels:
            assert BUILD.sha256(wheel) in hashes, f"{wheel} is not the file locks/{name}.txt pins"


# --- the sessions install from the locks ---------------------------------------------------------


SESSION_NAMES = {"tests", "lint", "smoke", "preflight", "bench", "build", "image_smoke", "locks", "kaggle", "mac", "mutants"}


@pytest.fixture(scope="module")
def noxfile():
    """noxfile.py, loaded as nox loads it: its sessions land in nox's registry."""
    nox = pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("ptbr_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.sessions = nox.registry.get()
    return module


class SessionQuit(Exception):
    pass


class CommandList:
    """Takes a nox session's place to list the commands it would run; runs none of them."""

    def __init__(self, tmp: Path, posargs: list[str] | None = None):
        self.tmp, self.posargs = tmp, posargs or []
        self.installs: list[tuple[str, ...]] = []
        self.runs: list[tuple[str, ...]] = []

    def install(self, *args: str, **_) -> None:
        self.installs.append(args)

    def run(self, *args: str, **_) -> None:
        self.runs.append(args)

    def run_install(self, *args: str, **_) -> None:
        pass

    def create_tmp(self) -> str:
        return str(self.tmp)

    def error(self, message: str) -> None:
        raise SessionQuit(message)


def commands(noxfile, session: str, tmp_path: Path, posargs: list[str] | None = None) -> CommandList:
    listed = CommandList(tmp_path, posargs)
    noxfile.sessions[session].func(listed)
    return listed


def test_every_session_is_checked_here(noxfile):
    assert set(noxfile.sessions) == SESSION_NAMES, "a new session gets its install checked below"


@pytest.mark.parametrize("session, posargs", [("tests", []), ("smoke", []), ("preflight", []),
                                              ("bench", []), ("bench", ["--device", "cuda"]), ("kaggle", ["push"]),
                                              ("mutants", [])])
def test_sessions_install_the_lock_then_the_checkout_without_dependencies(noxfile, session, posargs, tmp_path):
    try:
        listed = commands(noxfile, session, tmp_path, posargs)
    except SessionQuit as quit:
        here = (platform.system(), platform.machine())
        assert "holds no lock" in str(quit) and (here not in noxfile.LOCKS_BY_PLATFORM or posargs)
        return
    installs = list(listed.installs)
    if session == "tests":  # the real tokenizer's wheel, by hash, without its dependencies, outside site-packages
        assert installs.pop() == ("--require-hashes", "--no-deps", "--upgrade", "--target", str(noxfile.TEST_DATA_DIR),
                                  "-r", str(noxfile.TEST_DATA))
    assert len(installs) == 2, f"the lock, then the checkout: {listed.installs}"
    lock_install, checkout_install = installs
    assert lock_install[:2] == ("--require-hashes", "-r")
    lock = Path(lock_install[2])
    assert lock.parent == ROOT / "locks" and lock.exists()
    cpu_torch_from_pytorch = "+cpu" in BUILD.LOCKS[lock.stem].torch and not BUILD.local_torch_cpu_dirs()
    assert lock_install[3:] == (("--extra-index-url", BUILD.TORCH_CPU_INDEX) if cpu_torch_from_pytorch else ())
    assert checkout_install == ("--no-deps", "--no-build-isolation", "-e", ".")
    assert noxfile.sessions[session].python == BUILD.IMAGE_PYTHON, "the Python the locks are resolved for"
    if (platform.system(), platform.machine()) == ("Linux", "x86_64"):
        expected = {"tests": "ci.txt", "kaggle": "ci.txt", "mutants": "ci.txt",
                    "bench": "cuda.txt" if posargs else "cpu.txt"}.get(session, "cpu.txt")
        assert lock.name == expected


def test_the_suite_spreads_its_files_over_workers_unless_told_otherwise(noxfile, tmp_path):
    import os

    workers = str(max(2, min(4, os.cpu_count() or 2)))
    assert commands(noxfile, "tests", tmp_path).runs == [("pytest", "-n", workers, "--dist", "loadfile")]
    assert commands(noxfile, "tests", tmp_path, ["tests/test_cli.py"]).runs == [
        ("pytest", "-n", workers, "--dist", "loadfile", "tests/test_cli.py")]
    for told in (["-n", "0"], ["-n=3"], ["--numprocesses", "1"], ["-p", "no:xdist"]):
        assert commands(noxfile, "tests", tmp_path, told).runs == [("pytest", *told)]
    assert "pytest-xdist" in parse_lock(BUILD.LOCKS["ci"].path)  # the workers come from the lock


def test_lint_installs_ruff_as_the_ci_lock_pins_it(noxfile, tmp_path):
    listed = commands(noxfile, "lint", tmp_path)
    ((*flags, requirements),) = listed.installs
    assert flags == ["--require-hashes", "--no-deps", "-r"]
    assert parse_lock(Path(requirements)) == {"ruff": parse_lock(BUILD.LOCKS["ci"].path)["ruff"]}


def test_image_sessions_install_only_the_locked_setuptools_and_locks_pins_its_uv(noxfile, tmp_path):
    """build.py needs the standard library only; `build` also installs the setuptools that builds the
    image's ptbr wheel, at the locks' version, by hash."""
    ((*flags, requirements),) = commands(noxfile, "build", tmp_path).installs
    assert flags == ["--require-hashes", "--no-deps", "-r"]
    assert parse_lock(Path(requirements)) == {"setuptools": parse_lock(BUILD.LOCKS["cpu"].path)["setuptools"]}
    assert commands(noxfile, "image_smoke", tmp_path).installs == []
    assert commands(noxfile, "locks", tmp_path).installs == [(f"uv=={BUILD.UV_VERSION}",)]


def test_each_platform_gets_its_lock_or_a_clear_refusal(noxfile, tmp_path):
    listed = CommandList(tmp_path)
    assert noxfile.lock_for(listed, "tests", "Linux", "x86_64").name == "ci.txt"
    assert noxfile.lock_for(listed, "run", "Linux", "x86_64").name == "cpu.txt"
    assert noxfile.lock_for(listed, "tests", "Darwin", "arm64").name == "macos.txt"
    for system, machine in [("Linux", "aarch64"), ("Darwin", "x86_64"), ("Windows", "AMD64")]:
        with pytest.raises(SessionQuit, match=f"no lock for {system} {machine}.*pip install"):
            noxfile.lock_for(listed, "tests", system, machine)
    with pytest.raises(SessionQuit, match="no lock for Darwin arm64"):
        noxfile.lock_for(listed, "cuda", "Darwin", "arm64")


# --- what the code imports is what CI installs ------------------------------------------------------


def imported_modules() -> dict[str, str]:
    """{top-level module: a file importing it} for every import in ptbr/, tests/ and benchmarks/."""
    found: dict[str, str] = {}
    for folder in ("ptbr", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_in_the_ci_lock():
    """A test or module that starts importing a package (hypothesis, say) fails here, with the
    fix, until pyproject.toml declares it and the locks pin it; the nox environment holds only
    the lock."""
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("locks/ci.txt is CI's lock for Linux x86_64")
    local = {"ptbr", "tests", "conftest"} | {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    distributions = importlib.metadata.packages_distributions()
    pinned = set(parse_lock(BUILD.LOCKS["ci"].path))
    missing = []
    for module, where in sorted(imported_modules().items()):
        if module in sys.stdlib_module_names or module in local or module == "__future__":
            continue
        providers = {canonicalize_name(d) for d in distributions.get(module, [])}
        if not providers & pinned:
            missing.append(f"{module} (imported in {where}; installed from {sorted(providers) or 'nothing'})")
    assert not missing, ("imported but not pinned in locks/ci.txt: add the package to pyproject.toml "
                         f"and {REGENERATE}:\n" + "\n".join(missing))


def test_the_test_data_is_pinned_by_hash_and_holds_the_real_tokenizer(noxfile, mistral_tokenizer_model):
    """locks/test-data.txt: exact pins with hashes; installed without dependencies into a folder of
    its own, never importable: transformers loads a Mistral model's tokenizer through mistral-common
    where it finds it installed (it then needs tiktoken, which nothing here pins)."""
    entries = parse_lock(noxfile.TEST_DATA)
    assert set(entries) == {"mistral-common"}
    for name, entry in entries.items():
        assert re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", entry.version) and entry.hashes, name
    assert importlib.util.find_spec("mistral_common") is None
    assert mistral_tokenizer_model.stat().st_size > 400_000
