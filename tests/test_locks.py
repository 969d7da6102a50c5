"""The hash-locked requirement files in locks/ agree with pyproject.toml (regenerate: `nox -s locks`)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

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


def parse_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [sha256 hashes])} from a `uv pip compile --generate-hashes` file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+)", line)
        if pin:
            current = canonicalize_name(pin.group(1))
            entries[current] = (pin.group(2), [])
        elif current and (digest := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            entries[current][1].append(digest.group(1))
        elif line and not line.startswith(" "):
            current = None
    return entries


def required(lock) -> list[Requirement]:
    """pyproject.toml's requirements that apply to this lock's platform and extras."""
    environment = {"python_version": "3.11", "python_full_version": "3.11.0", **lock.markers}
    wanted = []
    lines = list(PYPROJECT["dependencies"])
    for extra in lock.extras:
        lines += PYPROJECT["optional-dependencies"][extra]
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
            wanted.append(requirement)
    return wanted


@pytest.fixture(params=sorted(BUILD.LOCKS), ids=lambda name: f"locks/{name}.txt")
def lock(request):
    lock = BUILD.LOCKS[request.param]
    if not lock.path.exists():
        pytest.fail(f"{lock.path.relative_to(ROOT)} is missing: {REGENERATE}")
    return lock


def test_every_pin_is_exact_and_hashed(lock):
    entries = parse_lock(lock.path)
    assert len(entries) > 10
    unhashed = sorted(name for name, (_, hashes) in entries.items() if not hashes)
    assert not unhashed, f"{lock.path.name}: pins without --hash: {unhashed}"
    text = lock.path.read_text()
    assert "nox -s locks" in text, "the header names the command that regenerates it"
    assert not re.search(r"/tmp/|/opt/wheels|https?://[^/\s]*@", text), "no local paths or credentials"


def test_every_pyproject_dependency_is_pinned_within_its_range(lock):
    entries = parse_lock(lock.path)
    problems = []
    for requirement in required(lock):
        name = canonicalize_name(requirement.name)
        if name not in entries:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(Version(entries[name][0]), prereleases=True):
            problems.append(f"{requirement}: the lock pins {entries[name][0]}")
    assert not problems, f"{lock.path.name} is out of date with pyproject.toml ({REGENERATE}):\n" + "\n".join(problems)


def test_torch_is_the_pinned_build(lock):
    version, hashes = parse_lock(lock.path)["torch"]
    assert version == lock.torch.split("==")[1]
    assert Version(version).public == "2.13.0"
    cuda_runtime = {"nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13"}
    has_cuda = bool(cuda_runtime & parse_lock(lock.path).keys())
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
    differing = {name: (version, ci.get(name, ("missing",))[0])
                 for name, (version, _) in cpu.items() if ci.get(name, ("missing",))[0] != version}
    assert not differing, f"CI would test other versions than the CPU image ships: {differing}"

