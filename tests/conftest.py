"""Shared fixtures: tiny corpora and datasets made on the fly; global state reset around each test."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A test suite started in the background of a non-interactive shell (`nox -s tests &`) inherits SIGINT
# ignored, and so would every `ptbr` the tests start and then stop with SIGINT, as Ctrl-C does (an
# ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt): they
# would train on until their timeout. With Python's own handler here, they start with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `nox -s tests` spreads the files over pytest-xdist workers (--dist loadfile), each file whole on
# one worker, in the order collected: the longest go first, so that none of them is left running
# alone at the end (the longest on a 2-core machine, 2026-12-07: 330, 260, 230, 160, 140 and 100 s of
# a 33-minute suite). The rest keep their order.
LONGEST_FILES = ("test_parallel.py", "test_robustness.py", "test_image.py", "test_benchmarks.py",
                 "test_kaggle.py", "test_disk_full.py")


def pytest_collection_modifyitems(config, items):
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


PT_TEXT = [
    "O sol nasceu devagar sobre a serra, e a cidade acordou com cheiro de café e pão quente.",
    "Na feira de sábado, dona Lúcia vendia mangas, goiabas e queijo fresco para os vizinhos.",
    "O time jogou bem no segundo tempo e virou a partida com dois gols de cabeça.",
    "A chuva de verão caiu forte à tarde, lavou as calçadas e refrescou o bairro inteiro.",
    "Meu avô contava histórias do tempo em que o trem ainda passava pela estação da vila.",
    "As crianças correram até a praia para ver as jangadas voltando com a pesca do dia.",
]


@pytest.fixture(autouse=True)
def _reset_global_state(monkeypatch):
    """Each test starts without ptbr log handlers left by another, without PTBR_DEBUG, and without
    the Hub's answers another test had (ptbr.finetune.base.HUB_STATES); a test that runs cli.command()
    leaves no exit hook that would ignore stop signals in pytest's own teardown."""
    import atexit

    from ptbr import cli
    from ptbr.finetune import base

    monkeypatch.delenv("PTBR_DEBUG", raising=False)
    monkeypatch.setattr(base, "HUB_STATES", {})
    monkeypatch.setattr(cli, "_OUTCOME_KEPT", False)
    logger = logging.getLogger("ptbr")
    before = list(logger.handlers)
    yield
    atexit.unregister(cli._ignore_stop_signals)
    for handler in list(logger.handlers):
        if handler not in before:
            logger.removeHandler(handler)
            handler.close()


@pytest.fixture(autouse=True)
def _no_container_memory_limit(monkeypatch, tmp_path_factory):
    """In-process runs see the machine's RAM as psutil reports it (tests fake it there), not the
    memory limit of a container CI may run in (ptbr/ram.py reads it from the cgroup file system;
    tests/test_ram.py gives it its own)."""
    from ptbr import ram

    nowhere = tmp_path_factory.getbasetemp() / "no-cgroup"
    monkeypatch.setattr(ram, "CGROUP_ROOT", nowhere)
    monkeypatch.setattr(ram, "PROC_CGROUP", nowhere / "cgroup")


MISTRAL_TOKENIZER = Path("mistral_common") / "data" / "tokenizer.model.v1"


@pytest.fixture(scope="session")
def mistral_tokenizer_model() -> Path:
    """Mistral-7B's SentencePiece model (32,000 tokens, byte fallback), from mistral-common's wheel,
    which `nox -s tests` installs into a folder of its own and names in PTBR_TEST_DATA
    (locks/test-data.txt says why it is kept out of site-packages)."""
    folder = os.environ.get("PTBR_TEST_DATA")
    model = Path(folder or ".") / MISTRAL_TOKENIZER
    if not folder or not model.is_file():
        pytest.fail(f"the real tokenizer is not at {model}: run the tests through `nox -s tests`, or "
                    "`pip install --no-deps --require-hashes --target DIR -r locks/test-data.txt` and set "
                    "PTBR_TEST_DATA=DIR")
    return model


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    """A small PT-BR corpus: a .txt with blank-line separated documents and a .jsonl."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    paragraphs = [f"{PT_TEXT[i % len(PT_TEXT)]} Parágrafo {i}." for i in range(60)]
    (folder / "contos.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    import json

    with open(folder / "noticias.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(PT_TEXT * 5):
            f.write(json.dumps({"text": f"{text} Notícia {i}.", "id": i}, ensure_ascii=False) + "\n")
    return folder


@pytest.fixture
def dataset_dir(tmp_path, corpus_dir) -> Path:
    from ptbr.data.prepare import prepare

    out = tmp_path / "dataset"
    prepare([str(corpus_dir)], out, vocab_size=400, val_fraction=0.1, show_progress=False)
    return out


@pytest.fixture
def oom_above(monkeypatch):
    """oom_above(limit, after_calls=0): TorchStep.train_step raises a CUDA-style out-of-memory for
    micro-batches of more than `limit` rows, once it has been called `after_calls` times. The
    step itself stays real. Returns the (rows, width) of every call's first micro-batch."""
    import numpy as np
    import torch

    from ptbr.backends.torch.step import TorchStep

    real = TorchStep.train_step
    sizes: list[tuple[int, int]] = []

    def install(limit: int, after_calls: int = 0) -> list[tuple[int, int]]:
        def step(self, micro_batches, lr):
            rows, width = np.asarray(micro_batches[0]["input_ids"]).shape
            sizes.append((rows, width))
            if len(sizes) > after_calls and rows > limit:
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
            return real(self, micro_batches, lr)

        monkeypatch.setattr(TorchStep, "train_step", step)
        return sizes

    return install


@pytest.fixture
def crash_then_resume(monkeypatch):
    """crash_then_resume(step_class, at, run): run() with step_class.train_step raising on its
    `at`-th call (a crash mid-run: the checkpoints written before it stay), then run() again with
    the real step, which resumes; returns that second run's result."""

    def crash(step_class, at: int, run):
        real = step_class.train_step
        calls = 0

        def step(self, micro_batches, lr):
            nonlocal calls
            calls += 1
            if calls == at:
                raise RuntimeError("simulated crash")
            return real(self, micro_batches, lr)

        with monkeypatch.context() as patch:
            patch.setattr(step_class, "train_step", step)
            with pytest.raises(RuntimeError, match="simulated crash"):
                run()
        return run()

    return crash


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None):
    """The real `ptbr` CLI in a subprocess (python -m ptbr)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ptbr", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def shown_size(value: float) -> str:
    """A byte count as ptbr's monitor and report show it: GiB (2 decimals) from 1 GiB up, else MiB
    (1 decimal). A run's process peak crosses 1 GiB on some machines and not others."""
    return f"{value / 1024**3:.2f} GiB" if value >= 1024**3 else f"{value / 1024**2:.1f} MiB"


@pytest.fixture(autouse=True)
def _open_file_limit_kept():
    """No test may lower the process's hard open-file limit: nothing can raise it again, and every
    later test's containers and subprocesses would inherit it (mlx-lm lowers it when imported; ptbr
    imports it through ptbr/backends/mlx/file_limit.py, and so must tests)."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    yield
    after = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert after == before, f"the hard open-file limit went from {before} to {after} during this test"


def nan_model(model_dir: Path) -> Path:
    """A tiny Llama with the sample's tokenizer and one NaN in its weights (a damaged file, a diverged
    run's model): what generate must refuse on either backend."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ptbr.data import SAMPLE_DIR
    from ptbr.data.tokenizer import save_for_transformers

    save_for_transformers(SAMPLE_DIR / "tokenizer.json", model_dir)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[0, 0] = float("nan")
    model.save_pretrained(model_dir)
    return model_dir
