#!/usr/bin/env python3
"""Build, run and lock ptbr's container images (ptbr-cpu, ptbr-cuda) from this checkout.

One place for the image logic that `nox -s build`, `nox -s image_smoke`, `nox -s locks` and
tests/test_image.py all call. Standard library only, so it runs from any Python >= 3.10.

    python docker/build.py build [cpu|cuda] [--no-cache]   # docker if an engine answers, else podman
    python docker/build.py smoke [cpu|cuda]                # `ptbr smoke` inside the built image
    python docker/build.py locks                           # regenerate locks/*.txt (needs uv)

See docker/README.md for what each step does and why.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
LOCK_DIR = ROOT / "locks"
# Wheelhouses, build contexts and the debootstrap rootfs live here (ignored by git).
CACHE = Path(os.environ.get("PTBR_BUILD_CACHE", ROOT / ".cache" / "docker"))

# The Dockerfile's default base, repeated here so that a podman build can try to pull it before
# falling back to a locally made base. Keep the two in step (tests/test_image.py checks).
REGISTRY_BASE = (
    "docker.io/library/python:3.11-slim-bookworm"
    "@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91"
)
LOCAL_BASE = "localhost/ptbr-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"

# Image layers are stamped with this time and .pyc files are hashed, not dated, so that two builds
# of one commit are bit-identical (docker/README.md, "Reproducible builds").
SOURCE_DATE_EPOCH = "0"
# Zip archives cannot hold dates before 1980, so the checkout's wheel is stamped 1980-01-01.
WHEEL_DATE_EPOCH = "315532800"

# Every image runs CPython 3.11 on glibc 2.36 (Debian bookworm), x86_64.
IMAGE_PYTHON = "3.11"
IMAGE_GLIBC_MINOR = 36
# Kaggle's image runs CPython 3.12 on Ubuntu (glibc 2.35 today); wheels up to manylinux_2_28 keep a
# margin for an older base image.
KAGGLE_PYTHON = "3.12"
KAGGLE_GLIBC_MINOR = 28

UV_VERSION = "0.13.9"
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# podman's defaults fail on ptbr's CI machines: crun cannot set up their cgroups (runc can), and
# podman's default ulimits are above what they allow. The same settings can instead go in a
# containers.conf named by CONTAINERS_CONF ([engine] runtime, [containers] default_ulimits).
PODMAN_RUN_FLAGS = [
    "--runtime", "runc",
    "--ulimit", "nofile=20000:20000",
    "--ulimit", "nproc=32768:32768",
]


@dataclass(frozen=True)
class Lock:
    """One hash-locked requirements file under locks/, resolved by `uv pip compile`."""

    name: str
    purpose: str
    extras: tuple[str, ...]
    torch: str
    python_platform: str
    # Requirements beyond pyproject.toml, e.g. MLX's CPU build that CI installs on Linux.
    extra_requirements: tuple[str, ...] = ()
    # Another lock whose pins this one must keep (CI tests exactly what the CPU image ships).
    constrained_by: str | None = None
    # Environment that pyproject.toml's markers are evaluated in (tests/test_locks.py uses it).
    markers: dict[str, str] = field(default_factory=dict)
    # The CPython version the lock is resolved for.
    python: str = IMAGE_PYTHON

    @property
    def path(self) -> Path:
        return LOCK_DIR / f"{self.name}.txt"


LINUX_X86_64 = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
DARWIN_ARM64 = {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"}

LOCKS = {
    lock.name: lock
    for lock in [
        Lock(
            name="cpu",
            purpose="the ptbr-cpu image (Linux x86_64, CPython 3.11, CPU build of torch)",
            extras=("finetune",),
            torch=f"torch=={TORCH_VERSION}+cpu",
            python_platform=f"x86_64-manylinux_2_{IMAGE_GLIBC_MINOR}",
            markers=LINUX_X86_64,
        ),
        Lock(
            name="cuda",
            purpose="the ptbr-cuda image (Linux x86_64, CPython 3.11, PyPI's CUDA build of torch)",
            extras=("finetune",),
            torch=f"torch=={TORCH_VERSION}",
            python_platform=f"x86_64-manylinux_2_{IMAGE_GLIBC_MINOR}",
            markers=LINUX_X86_64,
        ),
        Lock(
            name="ci",
            purpose="CI and development on Linux x86_64 (CPU torch, every extra, MLX's CPU build)",
            extras=("finetune", "kaggle", "dev", "report", "tensorboard"),
            torch=f"torch=={TORCH_VERSION}+cpu",
            python_platform=f"x86_64-manylinux_2_{IMAGE_GLIBC_MINOR}",
            extra_requirements=("mlx[cpu]>=0.20", "mlx-lm>=0.20"),
            constrained_by="cpu",
            markers=LINUX_X86_64,
        ),
        Lock(
            name="macos",
            purpose="Apple Silicon (macOS arm64: torch with MPS, MLX and mlx-lm)",
            extras=("finetune", "mlx", "kaggle", "dev", "torch", "report", "tensorboard"),
            torch=f"torch=={TORCH_VERSION}",
            python_platform="aarch64-apple-darwin",
            markers=DARWIN_ARM64,
        ),
        Lock(
            name="kaggle",
            purpose="Kaggle kernels (Linux x86_64, CPython 3.12): the versions the CUDA image ships; "
                    "a bundle leaves out torch and what only torch needs, which Kaggle's image has",
            extras=("finetune",),
            torch=f"torch=={TORCH_VERSION}",
            python_platform=f"x86_64-manylinux_2_{KAGGLE_GLIBC_MINOR}",
            constrained_by="cuda",
            markers=LINUX_X86_64,
            python=KAGGLE_PYTHON,
        ),
    ]
}
IMAGE_LOCKS = ("cpu", "cuda")


class BuildError(Exception):
    """A step of the image pipeline failed; the message says which and what to do."""


# --- small helpers ----------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[build.py] {message}", flush=True)


def run(cmd: list[str], echo: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` (printed first unless echo=False); a non-zero exit is a BuildError naming it."""
    if echo:
        log("$ " + " ".join(cmd))
    result = subprocess.run(cmd, **kwargs)
    if result.returncode != 0:
        raise BuildError(f"command failed with exit code {result.returncode}: {' '.join(cmd)}")
    return result


def answers(cmd: list[str], timeout: float = 30) -> bool:
    """Whether a command runs and exits 0 within the timeout (used to probe engines/registries)."""
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def lock_pins(lock_file: Path) -> dict[str, str]:
    """{canonical name: version} for every `name==version` line of a lock file."""
    return {name: entry.version for name, entry in lock_entries(lock_file).items()}


@dataclass(frozen=True)
class LockEntry:
    """One pin of a lock file: its version, the sha256 of each file it may be, and what asked for it
    (uv's `# via` lines: package names, or `ptbr (pyproject.toml)`)."""

    version: str
    hashes: tuple[str, ...]
    via: tuple[str, ...]
    text: str  # the entry's lines, as a requirements file takes them


def lock_entries(lock_file: Path) -> dict[str, LockEntry]:
    """{canonical name: LockEntry} for every pin of a lock file."""
    entries: dict[str, LockEntry] = {}
    current: str | None = None
    version, hashes, via, lines = "", [], [], []

    def close() -> None:
        if current:
            entries[current] = LockEntry(version, tuple(hashes), tuple(via), "\n".join(lines) + "\n")

    for line in lock_file.read_text().splitlines():
        pin = PIN.match(line)
        if pin:
            close()
            current, version, hashes, via, lines = canonical(pin.group(1)), pin.group(2), [], [], [line]
        elif current and line.startswith(" "):
            lines.append(line)
            digest = re.search(r"--hash=sha256:([0-9a-f]{64})", line)
            asked = re.match(r"^\s+#\s+(?:via\s+)?(\S.*)$", line)
            if digest:
                hashes.append(digest.group(1))
            elif asked and asked.group(1) != "via":
                via.append(asked.group(1).strip())
        elif line.strip():
            close()
            current = None
    close()
    return entries


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if not match:
        raise BuildError("no version in pyproject.toml")
    return match.group(1)


def git(*args: str) -> str | None:
    """git's answer about this checkout; None where there is no git, or ROOT is not a repository's
    top but a folder inside another's (a copy of the checkout under an ignored .nox/ or build
    folder: that repository's files are not this checkout's)."""
    try:
        top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT.resolve():
            return None
        result = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_revision() -> str:
    """The commit being built, with `-dirty` when the working tree has uncommitted changes."""
    revision = git("rev-parse", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=normal"):
        revision += "-dirty"
    return revision


def git_source() -> str:
    """The origin remote as a URL without credentials (none may end up in an image label)."""
    url = git("remote", "get-url", "origin") or ""
    url = re.sub(r"^(\w+://)[^/@]*@", r"\1", url)  # https://user:token@host/... -> https://host/...
    scp = re.match(r"^[\w.-]+@([\w.-]+):(.+)$", url)  # git@host:owner/repo.git
    if scp:
        url = f"https://{scp.group(1)}/{scp.group(2)}"
    return url.removesuffix(".git") or "unknown"


# --- lock files -------------------------------------------------------------------------------


@functools.cache
def local_torch_cpu_dirs() -> tuple[str, ...]:
    """Folders of wheels that pip is configured with (find-links) holding the CPU torch wheel.

    Where one exists the CPU locks, wheelhouses and nox sessions use it; elsewhere they use
    PyTorch's CPU index.
    """
    candidates = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True, text=True, timeout=60,
        ).stdout
        candidates += out.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    found = []
    for folder in dict.fromkeys(c.removeprefix("file://") for c in candidates):
        if list(Path(folder).glob(f"torch-{TORCH_VERSION}+cpu-*.whl")):
            found.append(folder)
    return tuple(found)


def compile_lock(lock: Lock, uv: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp) / "pins.txt"
        pins.write_text("\n".join([lock.torch, *lock.extra_requirements]) + "\n")
        cmd = [
            uv, "pip", "compile", "pyproject.toml", str(pins),
            *[arg for extra in lock.extras for arg in ("--extra", extra)],
            "--generate-hashes",
            "--python-version", lock.python,
            "--python-platform", lock.python_platform,
            "--custom-compile-command", "nox -s locks",
            "--no-strip-extras",
            "--quiet",
            "-o", str(lock.path),
        ]
        if lock.constrained_by:
            cmd += ["--constraint", str(LOCKS[lock.constrained_by].path)]
        if lock.torch.endswith("+cpu"):
            local = local_torch_cpu_dirs()
            cmd += [a for d in local for a in ("--find-links", d)] if local else [
                "--index", TORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match"]
        env = dict(os.environ, UV_NO_CONFIG="1")
        if lock.python_platform.endswith("apple-darwin"):
            env["MACOSX_DEPLOYMENT_TARGET"] = "14.0"  # MLX's oldest supported macOS
        run(cmd, cwd=ROOT, env=env)
    # The pins file is a temporary path: name what it held instead, so the header reads true.
    pinned = ", ".join([lock.torch, *lock.extra_requirements])
    text = lock.path.read_text().replace(str(pins), f"docker/build.py ({pinned})")
    header = f"# ptbr lock for {lock.purpose}.\n# Regenerate all locks with `nox -s locks` (docker/build.py locks).\n"
    lock.path.write_text(header + text)


def cmd_locks(args: argparse.Namespace) -> None:
    uv = args.uv or shutil.which("uv")
    if not uv:
        raise BuildError(f"uv is needed: `pip install uv=={UV_VERSION}` or run `nox -s locks`")
    LOCK_DIR.mkdir(exist_ok=True)
    names = args.only or list(LOCKS)
    # A lock constrained by another is compiled after it.
    for name in sorted(names, key=lambda n: LOCKS[n].constrained_by is not None):
        started = time.monotonic()
        compile_lock(LOCKS[name], uv)
        log(f"locks/{name}.txt: {len(lock_pins(LOCKS[name].path))} pins "
            f"({time.monotonic() - started:.1f} s)")


# --- the build context: wheelhouse, the checkout's wheel, the lock -----------------------------


def context_dir(variant: str) -> Path:
    return CACHE / f"context-{variant}"


def fill_wheelhouse(variant: str) -> Path:
    """Download every locked wheel (hash-checked) on the host, for the image's platform.

    pip inside a build cannot verify TLS on these machines, so the build bind-mounts this folder
    instead of reaching the index; it never lands in a layer.
    """
    lock = LOCKS[variant].path
    wheels = context_dir(variant) / "wheels"
    extra = ["--extra-index-url", TORCH_CPU_INDEX] if variant == "cpu" and not local_torch_cpu_dirs() else []
    started = time.monotonic()
    download_wheels(lock, wheels, IMAGE_PYTHON, IMAGE_GLIBC_MINOR, extra)
    # Wheels of versions no longer locked would only bloat the context.
    pins = lock_pins(lock)
    for wheel in wheels.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        if pins.get(canonical(name)) != version:
            log(f"removing {wheel.name} (not in locks/{variant}.txt)")
            wheel.unlink()
    size = sum(w.stat().st_size for w in wheels.glob("*.whl"))
    log(f"wheelhouse: {len(pins)} wheels, {size / 1e6:.0f} MB ({time.monotonic() - started:.0f} s)")
    return wheels


def download_wheels(requirements: Path, wheels: Path, python: str, glibc_minor: int,
                    pip_options: list[str] | tuple[str, ...] = (), echo: bool = True) -> None:
    """`pip download` every pin of a hash-locked requirements file, as wheels only, for CPython
    `python` on Linux x86_64 with glibc 2.`glibc_minor`, into `wheels` (what is there already and
    matches a hash is kept).

    Every manylinux tag that glibc accepts is offered: with manylinux2014 alone pip silently takes an
    older release whose wheel carries that tag (bitsandbytes 0.42, pure Python, for 0.50 tagged
    manylinux_2_24), and --require-hashes with exact pins makes any such fallback an error.
    """
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(glibc_minor, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    abi = "cp" + python.replace(".", "")
    run([
        sys.executable, "-m", "pip", "download",
        "--disable-pip-version-check", "--progress-bar", "off",
        "--require-hashes", "--no-deps", "--only-binary=:all:",
        "--implementation", "cp", "--python-version", python,
        *[a for tag in (abi, "abi3", "none") for a in ("--abi", tag)],
        *[a for platform in platforms for a in ("--platform", platform)],
        "-r", str(requirements), "-d", str(wheels), *pip_options,
    ], echo=echo)


def checkout_files() -> list[Path]:
    """The files a wheel is built from: tracked or not ignored, package and metadata only."""
    listed = git("ls-files", "--cached", "--others", "--exclude-standard")
    if listed is not None:
        paths = [Path(p) for p in listed.splitlines()]
    else:
        paths = [p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file()]
    keep = []
    for path in paths:
        top = path.parts[0]
        if "__pycache__" in path.parts or not (ROOT / path).is_file():
            continue
        if top == "ptbr" or (len(path.parts) == 1 and re.match(
                r"^(pyproject\.toml|README.*|LICEN[CS]E.*|NOTICE.*|MANIFEST\.in|setup\.(py|cfg))$", top)):
            keep.append(path)
    return keep


def build_checkout_wheel(variant: str) -> Path:
    """The checkout as a wheel, in the image's build context."""
    return build_wheel(context_dir(variant) / "dist", locked_backend=True)


def build_wheel(dist: Path, echo: bool = True, locked_backend: bool = False) -> Path:
    """The checkout as a wheel in `dist` (emptied first), built from a copy so that no build/ or
    *.egg-info lands in it, with fixed timestamps (pip's command printed unless echo=False), by
    this Python's setuptools: never one that pip's build isolation would fetch (the newest, unhashed).
    locked_backend: that setuptools must be the locks' version (its name is in the wheel's WHEEL
    file, so another version gives another wheel, and another image)."""
    found = subprocess.run([sys.executable, "-c", "import setuptools; print(setuptools.__version__)"],
                           capture_output=True, text=True)
    have = found.stdout.strip() if found.returncode == 0 else None
    wanted = lock_entries(LOCKS["cpu"].path)["setuptools"].version
    major = int(re.match(r"\d+", have).group()) if have and re.match(r"\d+", have) else 0
    if have is None or major < 77 or (locked_backend and have != wanted):
        raise BuildError(f"the ptbr wheel is built with setuptools {wanted if locked_backend else '>= 77'} "
                         f"(no build isolation), and {sys.executable} has {have or 'none'}: install the "
                         f"locks' setuptools=={wanted} there (nox -s build does)")
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "src"
        for path in checkout_files():
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, source / path)
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "--quiet", "-w", str(dist), str(source)]
        run(cmd, echo=echo, env=dict(os.environ, SOURCE_DATE_EPOCH=WHEEL_DATE_EPOCH))
    (wheel,) = dist.glob("ptbr-*.whl")
    return wheel


def stage_context(variant: str) -> tuple[Path, Path]:
    context = context_dir(variant)
    fill_wheelhouse(variant)
    wheel = build_checkout_wheel(variant)
    locks = context / "locks"
    shutil.rmtree(locks, ignore_errors=True)
    locks.mkdir()
    shutil.copy2(LOCKS[variant].path, locks / f"{variant}.txt")
    return context, wheel


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- engines ----------------------------------------------------------------------------------


@dataclass
class Engine:
    """The program that builds and runs images: docker (with an engine) or podman."""

    tool: str
    store: Path | None = None

    @property
    def base_cmd(self) -> list[str]:
        if self.tool == "podman" and self.store:
            # Everything podman keeps, in folders of this store's own: images, volumes, and the
            # libpod state (a shared --tmpdir would let one store's `system reset` make the
            # other believe the machine rebooted). podman refuses a runroot longer than 50
            # characters, hence a short one named after the store.
            store = self.store.resolve()
            runroot = f"/tmp/ptbr-podman-{hashlib.sha256(str(store).encode()).hexdigest()[:12]}"
            return ["podman", "--root", str(store / "root"), "--runroot", runroot,
                    "--tmpdir", f"{runroot}/libpod", "--volumepath", str(store / "volumes"),
                    "--storage-driver", "overlay"]
        return [self.tool]

    def image_exists(self, image: str) -> bool:
        if self.tool == "podman":
            return answers([*self.base_cmd, "image", "exists", image])
        return answers([*self.base_cmd, "image", "inspect", image])

    def image_id(self, image: str) -> str:
        out = subprocess.run([*self.base_cmd, "image", "inspect", "--format", "{{.Id}}", image],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise BuildError(f"no image {image}: build it first (`nox -s build`)")
        return out.stdout.strip()

    def image_size(self, image: str) -> int:
        out = subprocess.run([*self.base_cmd, "image", "inspect", "--format", "{{.Size}}", image],
                             capture_output=True, text=True, check=True)
        return int(out.stdout.strip())


def pick_engine(tool: str, store: Path | None) -> Engine:
    if tool == "auto":
        if store is None and shutil.which("docker") and answers(["docker", "info"], timeout=20):
            tool = "docker"
        elif shutil.which("podman"):
            tool = "podman"
        else:
            raise BuildError("no Docker engine answers and podman is not installed: "
                             "`apt-get install podman buildah runc debootstrap`")
    if tool == "docker" and store is not None:
        raise BuildError("--store applies to podman only")
    return Engine(tool, store)


def image_name(variant: str) -> str:
    return f"ptbr-{variant}"


# --- base image -------------------------------------------------------------------------------


def make_rootfs_tar() -> Path:
    """A minimal Debian bookworm with Python 3.11, as a tar (cached: each debootstrap differs)."""
    base_dir = CACHE / "base"
    tar = base_dir / "bookworm-rootfs.tar"
    if tar.exists():
        log(f"reusing the cached base rootfs {tar}")
        return tar
    if not shutil.which("debootstrap"):
        raise BuildError("no registry answered and debootstrap is missing: "
                         "`apt-get install debootstrap`, or pass --base IMAGE")
    if os.geteuid() != 0:
        raise BuildError("making the base with debootstrap needs root; or pass --base IMAGE")
    base_dir.mkdir(parents=True, exist_ok=True)
    rootfs = base_dir / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    started = time.monotonic()
    run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
         "bookworm", str(rootfs), DEBIAN_MIRROR], stdout=subprocess.DEVNULL)
    for leftovers in ("var/cache/apt", "var/lib/apt/lists", "var/log"):
        for path in (rootfs / leftovers).glob("*"):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    partial = tar.with_suffix(".partial")
    run(["tar", "-C", str(rootfs), "--numeric-owner", "--sort=name", "--mtime=@0",
         "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*", "-cf", str(partial), "."])
    partial.rename(tar)
    shutil.rmtree(rootfs)
    log(f"base rootfs made in {time.monotonic() - started:.0f} s: {tar}")
    return tar


def local_base(engine: Engine) -> str:
    """localhost/ptbr-base:bookworm, built from the cached rootfs tar with fixed timestamps, so the
    same tar gives the same base image ID in any store."""
    if engine.image_exists(LOCAL_BASE):
        return LOCAL_BASE
    tar = make_rootfs_tar()
    containerfile = tar.parent / "Containerfile"
    containerfile.write_text(
        "FROM scratch\n"
        f"ADD {tar.name} /\n"
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8\n"
        'CMD ["/bin/bash"]\n'
    )
    run([*engine.base_cmd, "build", "--isolation=chroot", "--timestamp", "0", "--quiet",
         "-f", str(containerfile), "-t", LOCAL_BASE, str(tar.parent)], stdout=subprocess.DEVNULL)
    return LOCAL_BASE


def resolve_base(engine: Engine, requested: str | None) -> str | None:
    """The base to build on: --base, else the Dockerfile's pinned image, else a local one.

    None means "the Dockerfile's default" (a docker engine pulls it itself).
    """
    if requested == "local":
        return local_base(engine)
    if requested:
        return requested
    if engine.tool == "docker":
        return None
    if engine.image_exists(REGISTRY_BASE):
        return REGISTRY_BASE
    log(f"pulling {REGISTRY_BASE}")
    if answers([*engine.base_cmd, "pull", "--quiet", REGISTRY_BASE], timeout=600):
        return REGISTRY_BASE
    log("no registry answered: making the base image locally (debootstrap)")
    return local_base(engine)


# --- build and run ----------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> None:
    started = time.monotonic()
    engine = pick_engine(args.tool, args.store)
    log(f"building ptbr-{args.variant} with {engine.tool}")
    base = resolve_base(engine, args.base)
    context, wheel = stage_context(args.variant)
    version = project_version()
    build_args = {
        "VARIANT": args.variant,
        "VERSION": version,
        "REVISION": args.revision or git_revision(),
        "SOURCE": args.source or git_source(),
        "PTBR_WHEEL": wheel.name,
        # Used in the RUN lines, so a changed wheel or lock invalidates the cached layer.
        "PTBR_WHEEL_SHA256": sha256(wheel),
        "LOCK_SHA256": sha256(LOCKS[args.variant].path),
        "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH,
    }
    if base:
        build_args["BASE_IMAGE"] = base
    name = image_name(args.variant)
    cmd = [*engine.base_cmd, "build", "-f", str(DOCKERFILE), "-t", name, "-t", f"{name}:{version}"]
    if engine.tool == "podman":
        cmd += ["--isolation=chroot", "--timestamp", "0"]
    if args.no_cache:
        cmd.append("--no-cache")
    for key, value in build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]

    env = dict(os.environ, DOCKER_BUILDKIT="1", SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH)
    run([*cmd, str(context)], env=env)
    image_id = engine.image_id(name)
    size = engine.image_size(name)
    log(f"built {name} in {time.monotonic() - started:.0f} s: {size / 1e9:.2f} GB, ID {image_id}")
    if args.iidfile:
        Path(args.iidfile).write_text(image_id + "\n")


# Where podman looks for CDI specs: the NVIDIA Container Toolkit writes the one that makes
# `--device nvidia.com/gpu=all` resolvable (`nvidia-ctk cdi generate`).
CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))


@dataclass(frozen=True)
class GpuProbe:
    """What this machine shows of an NVIDIA GPU, to decide whether `smoke cuda` asks for one."""

    # `nvidia-smi -L` lines, or the /dev/nvidiaN device nodes where nvidia-smi is not installed.
    gpus: tuple[str, ...]
    # CDI spec files that declare nvidia.com/gpu devices (podman needs one to hand a GPU over).
    cdi_specs: tuple[Path, ...]


def probe_gpu(dev: Path = Path("/dev"), cdi_dirs: tuple[Path, ...] = CDI_DIRS,
              nvidia_smi: str = "nvidia-smi") -> GpuProbe:
    gpus: list[str] = []
    if shutil.which(nvidia_smi):
        try:
            listed = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=60)
            if listed.returncode == 0:
                gpus = [line.strip() for line in listed.stdout.splitlines() if line.startswith("GPU ")]
        except (OSError, subprocess.TimeoutExpired):
            pass
    if not gpus:
        gpus = sorted(str(node) for node in dev.glob("nvidia[0-9]*"))
    specs = [spec for folder in cdi_dirs for spec in sorted(folder.glob("*"))
             if spec.suffix in (".yaml", ".yml", ".json") and spec.is_file()
             and re.search(r'kind"?\s*:\s*"?nvidia\.com/gpu\b', spec.read_text(errors="replace"))]
    return GpuProbe(tuple(gpus), tuple(specs))


def gpu_run_flags(tool: str, probe: GpuProbe) -> tuple[list[str], str]:
    """The `run` flags that give ptbr-cuda the GPU where one exists, and the line that says which.

    Asking for a GPU that is not there fails before ptbr starts (podman: "unresolvable CDI
    devices"), while ptbr-cuda runs on the CPU without one; so the request follows the probe.
    """
    if not probe.gpus:
        return [], "no GPU found: running ptbr-cuda's smoke on the CPU"
    found = f"GPU found ({probe.gpus[0]}{f' and {len(probe.gpus) - 1} more' if len(probe.gpus) > 1 else ''})"
    if tool == "docker":
        return ["--gpus", "all"], f"{found}: running ptbr-cuda's smoke on it (--gpus all)"
    if not probe.cdi_specs:
        raise BuildError(
            f"{found}, but podman has no CDI spec to hand it to the container: "
            "`sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml` (NVIDIA Container Toolkit)")
    return (["--device", "nvidia.com/gpu=all"],
            f"{found}: running ptbr-cuda's smoke on it (--device nvidia.com/gpu=all, {probe.cdi_specs[0]})")


def smoke_command(engine: Engine, variant: str, probe: GpuProbe | None = None) -> list[str]:
    """The `run` command of `ptbr smoke` inside the image; ptbr-cuda gets the GPU where the probe
    (this machine's, unless one is given) finds one."""
    cmd = [*engine.base_cmd, "run", "--rm", "--network", "none"]
    if engine.tool == "podman":
        cmd += PODMAN_RUN_FLAGS
    if variant == "cuda":
        flags, message = gpu_run_flags(engine.tool, probe or probe_gpu())
        log(message)
        cmd += flags
    return [*cmd, image_name(variant), "smoke"]


def cmd_smoke(args: argparse.Namespace) -> None:
    engine = pick_engine(args.tool, args.store)
    name = image_name(args.variant)
    engine.image_id(name)  # a clear error when the image was never built
    cmd = smoke_command(engine, args.variant)
    started = time.monotonic()
    run(cmd)
    log(f"`ptbr smoke` passed inside {name} ({time.monotonic() - started:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command_name", required=True)

    def engine_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("variant", nargs="?", choices=IMAGE_LOCKS, default="cpu",
                         help="which image: ptbr-cpu (default) or ptbr-cuda")
        sub.add_argument("--tool", choices=["auto", "docker", "podman"], default="auto",
                         help="docker when an engine answers, else podman (default: auto)")
        sub.add_argument("--store", type=Path,
                         help="podman storage folder of its own (keeps other images untouched)")

    build = commands.add_parser("build", help="build ptbr-cpu or ptbr-cuda from this checkout")
    engine_options(build)
    build.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    build.add_argument("--base", help="base image to build on ('local': debootstrap-made)")
    build.add_argument("--iidfile", help="write the image ID to this file")
    build.add_argument("--revision", help="revision label (default: git HEAD, -dirty if changed)")
    build.add_argument("--source", help="source label (default: the origin remote's URL)")
    build.set_defaults(func=cmd_build)

    smoke = commands.add_parser("smoke", help="run `ptbr smoke` inside the built image")
    engine_options(smoke)
    smoke.set_defaults(func=cmd_smoke)

    locks = commands.add_parser("locks", help="regenerate the hash-locked files in locks/")
    locks.add_argument("--uv", help="the uv executable (default: uv on PATH)")
    locks.add_argument("--only", nargs="+", choices=list(LOCKS), help="just these locks")
    locks.set_defaults(func=cmd_locks)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except BuildError as error:
        print(f"build.py: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
