"""The CLI around fine-tuning, on the tiny base of tests/test_finetune.py: `generate` formats a prompt
as the model was trained (adapter or merged), `--raw` continues plain text, and library noise a user
cannot act on stays out of stderr unless --debug."""

from __future__ import annotations

import json
import shutil

import pytest

import tests.test_finetune as finetune_tests
from ptbr.cli import main
from tests.conftest import run_cli

# the module-scoped fixtures of tests/test_finetune.py: a tiny Mistral base and a run fine-tuned on
# its chat data (LoRA, 3 steps, --merge)
toy = finetune_tests.toy
trained = finetune_tests.trained

QUESTION = "Qual é o número 3 do Porto?"


@pytest.fixture
def generate(capsys):
    def run(*args: str) -> str:
        capsys.readouterr()
        code = main(["generate", *args, QUESTION, "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"])
        assert code == 0
        return capsys.readouterr().out

    return run


def test_a_merged_model_answers_as_its_adapter(toy, trained, tmp_path, generate):
    from ptbr.finetune.adapter import read_adapter_meta

    merged = tmp_path / "merged"
    adapters = str(trained / "adapters")
    assert main(["merge", "--base", str(toy.base), "--adapter", adapters, "--output", str(merged)]) == 0
    assert read_adapter_meta(merged)["format"] == "messages"  # `ptbr merge` keeps what it was trained on

    via_adapter = generate("--model", str(toy.base), "--adapter", adapters)
    assert via_adapter.strip() and QUESTION not in via_adapter  # an answer, not the question continued
    assert generate("--model", str(merged)) == via_adapter
    assert generate("--model", str(trained / "merged")) == via_adapter  # `ptbr finetune --merge` too

    # a model ptbr knows nothing about: its tokenizer's chat template says it is a chat model
    foreign = tmp_path / "foreign"
    shutil.copytree(merged, foreign)
    (foreign / "ptbr_adapter.json").unlink()
    assert generate("--model", str(foreign)) == via_adapter

    raw = generate("--model", str(merged), "--raw")
    assert raw.startswith(QUESTION) and raw != QUESTION + via_adapter


def test_a_model_trained_on_prompt_completion_continues_the_prompt(toy, tmp_path, generate):
    data = tmp_path / "data"
    data.mkdir()
    for name, numbers in (("train.jsonl", range(40)), ("valid.jsonl", range(40, 48))):
        rows = []
        for i in numbers:
            turns = finetune_tests.conversation(i)["messages"]
            rows.append({"prompt": turns[1]["content"], "completion": " " + turns[2]["content"]})
        (data / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    output = tmp_path / "run"
    assert main(["finetune", "--base", str(toy.base), "--data", str(data), "--output", str(output), "--quant", "none",
                 "--lora-r", "8", "--batch-size", "4", "--max-steps", "2", "--eval-every", "0", "--merge"]) == 0
    merged = output / "merged"
    # fine-tuning gave the tokenizer ptbr's default chat template, but the model never saw it
    assert (merged / "chat_template.jinja").is_file()
    text = generate("--model", str(merged))
    assert text.startswith(QUESTION)
    assert generate("--model", str(toy.base), "--adapter", str(output / "adapters")) == text


NOISE = ("Failed to load CPU gemm_4bit_forward", "FutureWarning", "is deprecated", "warnings.warn(")


def _has_avx512bf16() -> bool:
    """Where bitsandbytes looks for its optional CPU kernel, and says so when it is missing."""
    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16())


@pytest.mark.parametrize("debug", [False, True])
def test_library_noise_is_filtered_and_kept_with_debug(toy, tmp_path, debug):
    # --gradient-checkpointing and --merge: the two places transformers warns of a deprecation
    run = run_cli("finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(tmp_path / "run"),
                  "--quant", "none", "--lora-r", "8", "--batch-size", "4", "--max-steps", "1", "--eval-every", "0",
                  "--gradient-checkpointing", "--merge", *(["--debug"] if debug else []))
    assert run.returncode == 0, run.stderr
    assert "merged " in run.stderr  # ptbr's own lines stay
    shown = [noise for noise in NOISE if noise in run.stderr]
    if not debug:
        assert shown == [], run.stderr
    else:
        assert "FutureWarning" in shown and "is deprecated" in shown
        assert ("Failed to load CPU gemm_4bit_forward" in shown) is _has_avx512bf16()

