"""Developer and CI sessions: `nox -s tests`, `nox -s smoke`, `nox -s lint` (see README)."""

from __future__ import annotations

import sys

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# Every CPU install pins torch exactly: any other version (or none) pulls gigabytes of CUDA wheels.
TORCH_CPU = "torch==2.13.0"
# MLX runs on Linux as mlx[cpu], so the Apple Silicon path is tested for real everywhere.
MLX_LINUX = ["mlx[cpu]>=0.20", "mlx-lm>=0.20"] if sys.platform.startswith("linux") else []


def install_ptbr(session: nox.Session, extras: str) -> None:
    session.install(TORCH_CPU)
    session.install("-e", f".[{extras}]", TORCH_CPU)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite (tiny models, real CLI, real QLoRA on CPU, real container build)."""
    install_ptbr(session, "finetune,kaggle,dev")
    if MLX_LINUX:
        session.install(*MLX_LINUX, TORCH_CPU)
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, the tests and this file."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "ptbr", "tests", "noxfile.py", *session.posargs)


@nox.session
def smoke(session: nox.Session) -> None:
    """A fresh environment, then `ptbr smoke`: one step of `tiny` on the bundled sample."""
    install_ptbr(session, "dev")
    session.run("ptbr", "smoke", *session.posargs)


@nox.session
def preflight(session: nox.Session) -> None:
    """A fresh environment, then `ptbr preflight --mode pretrain` on the bundled sample.

    Exits 10 if a check fails; `-- FLAGS` plans another run, e.g. `-- --model-size 85m --seq-len 1024`."""
    install_ptbr(session, "dev")
    session.run("ptbr", "preflight", "--mode", "pretrain", "--output", "runs/preflight", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """The memory model's predicted peaks against measured ones (the README's accuracy tables):
    pretraining, then LoRA/QLoRA.

    The CPU grids take about 15 minutes on 2 cores; on a GPU machine with a CUDA torch, `-- --device cuda`."""
    install_ptbr(session, "finetune,dev")
    session.run("python", "benchmarks/memory_accuracy.py", "--markdown", *session.posargs)
    session.run("python", "benchmarks/lora_memory_accuracy.py", "--markdown", *session.posargs)


# --- container images (docker/build.py holds the logic; see docker/README.md) -------------------


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Build ptbr-cpu from this checkout (`-- cuda`: ptbr-cuda; `-- --no-cache`: from scratch)."""
    session.run("python", "docker/build.py", "build", *session.posargs)


@nox.session(default=False)
def image_smoke(session: nox.Session) -> None:
    """`ptbr smoke` inside the image that `nox -s build` made (`-- cuda` for ptbr-cuda)."""
    session.run("python", "docker/build.py", "smoke", *session.posargs)


@nox.session(default=False)
def locks(session: nox.Session) -> None:
    """Regenerate the hash-locked requirements in locks/ from pyproject.toml (uv pip compile)."""
    session.install("uv==0.13.9")
    session.run("python", "docker/build.py", "locks", *session.posargs)
