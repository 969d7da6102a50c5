"""Every command, driven off the happy path by a generated table: wrong values for every setting,
missing, empty, corrupt and truncated files, mismatched pairs. No case may exit 1 (a crash), print
a traceback, or exit 0 having done nothing: each ends with one `error:` line and the documented
exit code. The real CLI runs in-process (`ptbr.cli.main`), so hundreds of cases take seconds."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import tests.test_finetune as finetune_tests
from ptbr.cli import main
from ptbr.config import FinetuneConfig, PretrainConfig, settings_fields
from ptbr.errors import EXIT_CODES

toy = finetune_tests.toy
RANDOM = bytes(range(256)) * 8  # not UTF-8, not JSON, not a tokenizer, not safetensors

# --------------------------------------------------------------------------------------------
# Wrong values for every setting of train and finetune, generated from the settings dataclasses
# --------------------------------------------------------------------------------------------

# values that are wrong for a field of that kind; some fields add their own below
WRONG_BY_KIND = {int: ["abc", "1.5", ""], float: ["abc", "nan", ""], str: [""]}
WRONG_BY_NAME = {
    "batch_size": ["0", "-1"], "grad_accum": ["0", "-3"], "max_steps": ["0", "-5"], "learning_rate": ["0", "-1e-3",
    "inf"], "min_lr_ratio": ["-0.1", "1.5"], "warmup_steps": ["-1"], "weight_decay": ["-1", "inf"],
    "beta1": ["1", "-0.1"], "beta2": ["1.5"], "max_grad_norm": ["-1", "inf"], "save_every": ["-1"],
    "eval_every": ["-2"], "eval_batches": ["0"], "log_every": ["0"], "seed": ["-1", str(2**70)],
    "device": ["tpu"], "precision": ["fp8"], "backend": ["jax"], "keep_last": ["-1"], "hang_timeout": ["0", "-5"],
    "hang_action": ["ignore"], "model_size": ["7b"], "seq_len": ["0", "99999"], "lora_r": ["0", "-8"],
    "lora_alpha": ["0", "-1"], "lora_dropout": ["1", "-0.1"], "quant": ["3bit"], "max_seq_len": ["0"],
    "epochs": ["0"], "target_modules": [",", " "],
}


def wrong_values(cls: type) -> list[tuple[str, str]]:
    from ptbr.config import base_type

    cases = []
    for f, annotation in settings_fields(cls):
        kind = base_type(annotation)
        if kind is bool:
            continue
        values = WRONG_BY_KIND.get(kind, []) + WRONG_BY_NAME.get(f.name, [])
        cases += [(f.name, v) for v in values]
    return cases


@pytest.mark.parametrize("name, value", wrong_values(PretrainConfig))
def test_train_refuses_every_wrong_value(name, value, tmp_path, capsys):
    code = main(["train", "--output", str(tmp_path / "run"), f"--{name.replace('_', '-')}", value])
    assert_refused(capsys, code, 2)
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything ran


@pytest.mark.parametrize("name, value", wrong_values(FinetuneConfig))
def test_finetune_refuses_every_wrong_value(name, value, tmp_path, capsys):
    args = ["finetune", "--output", str(tmp_path / "run"), "--base", "b", "--data", "d"]
    code = main(args + [f"--{name.replace('_', '-')}", value])
    assert_refused(capsys, code, 2)


@pytest.mark.parametrize("field", ["batch_size", "learning_rate", "seed", "device", "output", "quant"])
@pytest.mark.parametrize("value", [None, [1, 2], {"a": 1}, "nonsense", -1])
def test_a_config_file_with_wrong_values_is_refused(field, value, tmp_path, capsys, monkeypatch):
    """A wrong value is exit 2. A value that is right (null: the default learning rate; any text or
    number: a path for output) gets as far as the base, which does not exist: exit 4."""
    config = tmp_path / "run.json"
    output = {"output": str(tmp_path / "run")} if field != "output" else {}
    config.write_text(json.dumps({field: value, "base": str(tmp_path / "b"), "data": "d"} | output))
    valid = (field, value) in (("learning_rate", None), ("output", "nonsense"), ("output", -1))
    monkeypatch.chdir(tmp_path)
    code = main(["finetune", "--config", str(config)])
    assert_refused(capsys, code, 4 if valid else 2)


# --------------------------------------------------------------------------------------------
# Broken files
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    args: list[str]
    code: int
    says: str  # a fragment of the one error line


def broken_copies(good: Path, tmp: Path, files: dict[str, list[str]]) -> dict[str, Path]:
    """For each file of `good` and each way of breaking it, a copy of `good` with that file broken."""
    made = {}
    for name, ways in files.items():
        for way in ways:
            copy = tmp / f"{good.name}-{name.replace('/', '_')}-{way}"
            shutil.copytree(good, copy)
            target = copy / name
            if way == "missing":
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            elif way == "empty":
                target.write_bytes(b"")
            elif way == "random":
                target.write_bytes(RANDOM)
            elif way == "truncated":
                target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 2) | 1])
            elif way == "list":
                target.write_text("[]")
            elif way == "wrong_types":
                data = json.loads(target.read_text())
                target.write_text(json.dumps({k: str(v) if isinstance(v, int | float) else [v] for k, v in data.items()}))
            made[f"{name}:{way}"] = copy
    return made


@pytest.fixture(scope="module")
def pretrain_inputs(tmp_path_factory):
    from ptbr.data.prepare import prepare
    from tests.conftest import PT_TEXT

    root = tmp_path_factory.mktemp("pretrain")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(f"{PT_TEXT[i % len(PT_TEXT)]} Parágrafo {i}." for i in range(80)), encoding="utf-8")
    data = root / "data"
    prepare([str(corpus)], data, vocab_size=400, val_fraction=0.1, show_progress=False)
    other = root / "other"
    prepare([str(corpus)], other, vocab_size=420, val_fraction=0.1, show_progress=False)
    run = root / "run"
    assert main(["train", "--data", str(data), "--output", str(run), "--model-size", "tiny", "--seq-len", "16",
                 "--batch-size", "2", "--max-steps", "2", "--save-every", "1", "--device", "cpu"]) == 0
    return root, data, other, run


def test_train_prepare_and_info_on_broken_data(pretrain_inputs, tmp_path, capsys):
    root, data, other, run = pretrain_inputs
    broken = broken_copies(data, tmp_path, {
        "train.bin": ["missing", "empty", "truncated", "random"],
        "meta.json": ["empty", "random", "list", "wrong_types"],
        "tokenizer.json": ["missing", "empty", "random", "truncated"],
    })
    (tmp_path / "a_file").write_text("x")
    checkpoint = run / "checkpoints" / "step_000002"
    bad_checkpoints = broken_copies(checkpoint, tmp_path, {
        "trainer_state.json": ["missing", "empty", "random", "list", "wrong_types"],
        "model.safetensors": ["missing", "truncated", "random"],
        "optimizer.pt": ["truncated", "random"],
    })
    train = ["train", "--model-size", "tiny", "--seq-len", "16", "--batch-size", "2", "--max-steps", "3",
             "--device", "cpu", "--output"]
    cases = [Case(train + [str(tmp_path / f"run-{key}"), "--data", str(path)], 3, "") for key, path in broken.items()]
    cases += [Case(["info", "--data", str(path)], 3, "") for path in broken.values()]
    cases += [
        Case(train + [str(tmp_path / "r1"), "--data", str(tmp_path / "nope")], 3, "data directory not found"),
        Case(train + [str(tmp_path / "r2"), "--data", str(tmp_path / "a_file")], 3, "is a file"),
        Case(train + [str(tmp_path / "r3"), "--data", str(data), "--tokenizer", str(other / "tokenizer.json")], 3,
             "different tokenizer"),
        Case(train + [str(tmp_path / "a_file" / "run"), "--data", str(data)], 6, "cannot create or write"),
        Case(["prepare", "--input", str(tmp_path / "nope.txt"), "--output", str(tmp_path / "p1")], 3, "not found"),
        Case(["prepare", "--input", str(data / "train.bin"), "--output", str(tmp_path / "p2")], 3, "neither"),
        Case(["prepare", "--input", str(root / "corpus.txt"), "--output", str(tmp_path / "a_file")], 6, ""),
        Case(["prepare", "--input", str(root / "corpus.txt"), "--output", str(tmp_path / "p3"), "--tokenizer",
              str(broken["tokenizer.json:random"] / "tokenizer.json")], 3, "tokenizer"),
        Case(["prepare", "--input", str(root / "corpus.txt"), "--output", str(tmp_path / "p4"), "--vocab-size",
              str(10**11)], 2, "--vocab-size"),
        Case(["prepare", "--input", "", "--output", str(tmp_path / "p5")], 2, "empty path"),
    ]
    # checkpoints: named with --resume, broken in every file
    for key, path in bad_checkpoints.items():
        out = tmp_path / f"resume-{key}"
        cases.append(Case(train + [str(out), "--data", str(data), "--resume", str(path)], 4, "checkpoint"))
    cases.append(Case(train + [str(tmp_path / "r4"), "--data", str(data), "--resume", str(data)], 4,
                      "not a checkpoint"))
    cases.append(Case(train + [str(tmp_path / "r5"), "--data", str(other), "--resume", str(checkpoint)], 2,
                      "; fix: rerun with the settings of the run it belongs to, or give --resume another checkpoint "
                      "(or --resume never to start over)"))  # named: another --output would not help
    for case in cases:
        assert_refused(capsys, main(case.args), case.code, case.says, case.args)


def test_finetune_validate_merge_and_generate_on_broken_inputs(toy, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    adapter_run = tmp_path / "ft"
    assert main(["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(adapter_run),
                 "--quant", "none", "--lora-r", "4", "--batch-size", "8", "--max-steps", "1"]) == 0
    adapter = adapter_run / "adapters"
    bases = broken_copies(toy.base, tmp_path, {
        "config.json": ["missing", "empty", "random", "list", "wrong_types"],
        "model.safetensors": ["missing", "truncated", "random"],
        "tokenizer.json": ["missing", "random"],
    })
    adapters = broken_copies(adapter, tmp_path, {
        "adapter_config.json": ["missing", "empty", "random", "list"],
        "adapter_model.safetensors": ["missing", "truncated", "random"],
    })
    jsonl = {"empty": "", "random": RANDOM.decode("latin-1"), "list": "[]\n", "schema": '{"question": "q"}\n',
             "surrogate": '{"text": "\\ud800 ol\\u00e1"}\n', "mixed": '{"text": "a", "messages": []}\n',
             "roles": '{"messages": [{"role": "assistant", "content": "x"}]}\n'}
    files = {}
    for name, text in jsonl.items():
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text(text, encoding="utf-8", errors="surrogateescape")
    only_valid = tmp_path / "only_valid"
    only_valid.mkdir()
    shutil.copy(toy.data / "valid.jsonl", only_valid)

    # export-adapter --base: a model of more, or fewer, layers than the adapter's base (its config.json is read)
    layers = json.loads((toy.base / "config.json").read_text())["num_hidden_layers"]
    other_bases = {}
    for count in (layers + 2, layers - 1):
        other_bases[count] = tmp_path / f"base-{count}-layers"
        other_bases[count].mkdir()
        config = json.loads((toy.base / "config.json").read_text()) | {"num_hidden_layers": count}
        (other_bases[count] / "config.json").write_text(json.dumps(config))
    finetune = ["finetune", "--quant", "none", "--max-steps", "1", "--output"]
    # another model (a base, a run's final/) and another run's adapters/: the same kinds of files as
    # a merge's or an export's, which merge and export-adapter replaced without a word
    other_model, other_adapters = tmp_path / "other-model", tmp_path / "other-run" / "adapters"
    shutil.copytree(toy.base, other_model)
    shutil.copytree(adapter, other_adapters)
    deeper = tmp_path / "deeper-base"  # the adapter's base with one layer more: PEFT only warned, and it merged
    shutil.copytree(toy.base, deeper, ignore=shutil.ignore_patterns("*.safetensors"))
    config = AutoConfig.from_pretrained(toy.base)
    config.num_hidden_layers += 1
    AutoModelForCausalLM.from_config(config).save_pretrained(deeper)
    shallower = tmp_path / "shallower-base"  # one layer fewer: PEFT left the adapter's last layer out, silently
    shutil.copytree(toy.base, shallower, ignore=shutil.ignore_patterns("*.safetensors"))
    config.num_hidden_layers -= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(shallower)
    (tmp_path / "m-run" / "merged").mkdir(parents=True)  # a run directory whose model is merged/
    shutil.copy(toy.base / "config.json", tmp_path / "m-run" / "merged")
    cases = [Case(finetune + [str(tmp_path / f"f-{key}"), "--base", str(path), "--data", str(toy.data)], 4, "")
             for key, path in bases.items() if not key.startswith("tokenizer")]
    cases += [Case(["validate-data", str(toy.data), "--base", str(path)], 4, "") for key, path in bases.items()
              if key.startswith(("config", "tokenizer"))]
    cases += [Case(finetune + [str(tmp_path / f"d-{key}"), "--base", str(toy.base), "--data", str(path)], 3, "")
              for key, path in [*files.items(), ("only_valid", only_valid)]]
    cases += [Case(["validate-data", str(path)], 3, "") for path in [*files.values(), only_valid]]
    cases += [Case(["validate-data", str(files["schema"]), "--json"], 3, "fix: fix the lines the JSON on stdout lists")]
    cases += [Case(["merge", "--base", str(toy.base), "--adapter", str(path), "--output", str(tmp_path / f"m-{k}")],
                   4, "adapter") for k, path in adapters.items()]
    cases += [
        Case(finetune + [str(tmp_path / "h"), "--base", "someone/some-model", "--data", str(toy.data)], 4,
             "--download"),
        Case(finetune + [str(tmp_path / "v"), "--base", str(toy.base), "--data", str(toy.data), "--valid",
                         str(tmp_path / "nope.jsonl")], 3, "validation file not found"),
        Case(finetune + [str(tmp_path / "v2"), "--base", str(toy.base), "--data", str(toy.data), "--valid",
                         str(tmp_path)], 3, f"validation file is a directory ({tmp_path})"),
        # the file at fault is named, not the training data
        Case(finetune + [str(tmp_path / "v3"), "--base", str(toy.base), "--data", str(toy.data / "train.jsonl"),
                         "--valid", str(files["empty"])], 3, f"empty.jsonl: 1 problem: the file is empty ({files['empty']})"),
        Case(["export-adapter", str(adapter / "adapter_model.safetensors"), "--to", "mlx", "--output",
              str(tmp_path / "x-file")], 4, "adapter directory is a file"),
        Case(["validate-data", str(toy.data), "--base", str(toy.base), "--max-seq-len", "-5"], 2, "max-seq-len"),
        Case(["info", "--data", str(toy.data)], 3, "fix: this is fine-tuning data (train.jsonl): `ptbr finetune "
             "--data` and `ptbr validate-data` take it"),
        Case(["validate-data", f"{tmp_path / 'nope'}/"], 3, f"error: not found ({tmp_path / 'nope'}/); fix: give a "
             ".jsonl file, or a directory holding train.jsonl (and valid.jsonl)"),
        Case(["merge", "--base", str(toy.base), "--adapter", str(adapter), "--output", str(adapter_run)], 6,
             "output"),
        Case(["merge", "--base", str(toy.base), "--adapter", str(adapter), "--output", str(toy.base)], 6, "output"),
        Case(["merge", "--base", str(toy.base), "--adapter", str(adapter), "--output", str(other_model)], 6,
             "--output holds a model that no merge wrote (no ptbr_adapter.json: a base, a run's final/, or a merge by "
             "an older ptbr, which a new merge does not replace: move it aside): the merge would replace it"),
        Case(["merge", "--base", str(deeper), "--adapter", str(adapter), "--output", str(tmp_path / "m-deeper")], 4,
             "the adapter does not fit this base model: it holds no weights for 14 LoRA tensors this base takes (e.g. "
             f"base_model.model.model.layers.{layers}."),
        Case(["generate", "Oi", "--model", str(deeper), "--adapter", str(adapter)], 4,
             "the adapter does not fit this base model"),
        # fewer layers: PEFT left the adapter's last layers out, silently (a merge wrote half an adapter)
        Case(["merge", "--base", str(shallower), "--adapter", str(adapter), "--output",
              str(tmp_path / "m-shallower")], 4, "the adapter does not fit this base model: the base has no module "
             f"for 14 of its LoRA tensors (e.g. base_model.model.model.layers.{layers - 1}."),
        Case(["generate", "Oi", "--model", str(shallower), "--adapter", str(adapter)], 4,
             "the base has no module for 14 of its LoRA tensors"),
        Case(["export-adapter", str(adapter), "--to", "peft", "--output", str(other_adapters)], 6,
             "--output holds an adapter that no export wrote (a run's adapters/): the export would replace it"),
        # a fine-tuning run's files would mix with its data's or its base's
        Case(finetune + [str(toy.data), "--base", str(toy.base), "--data", str(toy.data)], 6,
             f"--output is the directory of --data {toy.data}"),
        Case(finetune + [str(toy.base), "--base", str(toy.base), "--data", str(toy.data / "train.jsonl")], 6,
             f"--output is the directory of --base {toy.base}"),
        # export-adapter swaps its output in whole: never over a run, a base, a folder of other files
        # or the adapter itself (it replaced all of them, without a copy)
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(adapter_run / "checkpoints")], 6,
             f"--output is inside the run {adapter_run}, among its files: the export would mix with them"),
        # a folder inside a run: `ptbr report` then refused the run (plots/x), a re-run moved it to previous/
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(adapter_run / "plots" / "x")], 6,
             f"error: --output is inside the run {adapter_run}, among its files: the export would mix with them ("
             f"{adapter_run / 'plots' / 'x'}); fix: give a new directory for the converted adapter"),
        Case(["merge", "--base", str(toy.base), "--adapter", str(adapter), "--output",
              str(adapter_run / "checkpoints" / "new")], 6, f"error: --output is inside the run {adapter_run}, among "
             f"its files: the merge would mix with them ({adapter_run / 'checkpoints' / 'new'}); fix: give a new "
             f"directory for the merged model ({adapter_run / 'merged'} is the run's own place for it)"),
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(adapter_run)], 6,
             "--output is or holds the adapter: the export would replace it"),
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(toy.base)], 6,
             "--output already holds other files (model.safetensors)"),
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(toy.data)], 6,
             "--output already holds other files (train.jsonl, valid.jsonl)"),
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(adapter)], 6,
             "--output is or holds the adapter: the export would replace it"),
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(adapter_run / "adapters" / "mlx")], 6,
             "--output is or holds the adapter"),
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(tmp_path / "x-more"), "--base",
              str(other_bases[layers + 2])], 2, f"the adapter covers layers {list(range(layers))}, and mlx-lm adapts "
             f"only the last N layers of the {layers + 2} of {other_bases[layers + 2]}"),
        Case(["export-adapter", str(adapter), "--to", "mlx", "--output", str(tmp_path / "x-fewer"), "--base",
              str(other_bases[layers - 1])], 2, f"the adapter covers layers up to {layers - 1}, and the base "
             f"{other_bases[layers - 1]} has {layers - 1}: not the base it was trained on"),
        Case(["generate", "", "--model", str(toy.base)], 2, "prompt"),
        Case(["generate", "--model", str(toy.base), "-texto"], 2, 'one that starts with "-" goes after --'),
        Case(["generate", "Oi", "--model", str(toy.base), "--temperature", "nan"], 2, "temperature"),
        Case(["generate", "Oi", "--model", str(toy.base), "--seed", "-5"], 2, "seed"),
        Case(["generate", "Oi", "--model", str(bases["model.safetensors:random"])], 4, ""),
        # named as the model's config, not as "cannot load the tokenizer" (which read it first)
        Case(["generate", "Oi", "--model", str(bases["config.json:random"])], 4, "config.json is not valid JSON"),
        Case(["generate", "Oi", "--model", str(adapter_run / "checkpoints" / "step_000001")], 4, ""),
        Case(["generate", "Oi", "--model", str(tmp_path / "m-run")], 4,
             f"fix: this is a run's directory: give its model, {tmp_path / 'm-run' / 'merged'}"),
        Case(["generate", "Oi", "--model", str(adapter)], 4,
             f"fix: this is a LoRA adapter: give its base model, and the adapter apart (--model {toy.base} --adapter "
             f"{adapter} for generate"),
        Case(["generate", "Oi", "--model", str(toy.base), "--adapter", str(adapters["adapter_model.safetensors:random"])],
             4, ""),
    ]
    # an mlx-lm adapter of a wider model: converted to PEFT's format on the fly, refused, and the
    # message names the user's adapter directory, not the temporary converted copy
    cases += [Case(["merge", "--base", str(toy.base), "--adapter", str(wider_mlx_adapter(adapter, tmp_path)),
                    "--output", str(tmp_path / "m-wider")], 4, f"({tmp_path / 'wider-mlx'}); fix: give the base"),
              Case(["generate", "Oi", "--model", str(toy.base), "--adapter", str(tmp_path / "wider-mlx")], 4,
                   f"({tmp_path / 'wider-mlx'}); fix: give the base"),
              # the line names the tensor that does not fit (torch's first line only says "Error(s) in loading")
              Case(["merge", "--base", str(toy.base), "--adapter", str(tmp_path / "wider-mlx"), "--output",
                    str(tmp_path / "m-wider")], 4, "state_dict for PeftModelForCausalLM: size mismatch for base_model.")]
    for case in cases:
        assert_refused(capsys, main(case.args), case.code, case.says, case.args)


def wider_mlx_adapter(adapter: Path, tmp_path: Path) -> Path:
    """`adapter` in mlx-lm's format, with every A matrix twice as wide: an adapter of another base."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from ptbr.finetune.export import export_adapter

    wider = tmp_path / "wider-mlx"
    export_adapter(adapter, "mlx", wider)
    weights = load_file(str(wider / "adapters.safetensors"))
    save_file({name: np.concatenate([w, w]) if name.endswith("lora_a") else w for name, w in weights.items()},
              str(wider / "adapters.safetensors"), metadata={"format": "mlx"})
    return wider


def test_the_other_commands_refuse_wrong_values(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    cases = [
        Case(["info"], 2, "nothing to describe"),
        Case(["info", "--model-size", "7b"], 2, "7b"),
        Case(["info", "--model-size", "tiny", "--seq-len", "100000"], 2, "--seq-len"),
        Case(["info", "--model-size", "tiny", "--vocab-size", "0"], 2, "vocab"),
        Case(["info", "--data", str(tmp_path / "a_file")], 3, "is a file"),
        Case(["test-gpu", "--model-size", "tiny", "--batch-size", "0"], 2, "batch"),
        Case(["test-gpu", "--model-size", "tiny", "--vocab-size", "0"], 2, "vocab"),
        Case(["test-gpu", "--model-size", "tiny", "--seq-len", "4096"], 2, "--seq-len"),
        Case(["smoke", "--output", str(tmp_path / "a_file" / "x")], 9, "smoke failed"),
        Case(["preflight", "--mode", "pretrain", "--lora-r", "8", "--output", str(tmp_path / "p")], 2, "--lora-r"),
        Case(["preflight", "--data", str(tmp_path / "nope"), "--output", str(tmp_path / "p")], 10, "data.dataset"),
        # kaggle: every case is refused before the client is imported or the network is used
        Case(["kaggle"], 2, "ACTION"),
        Case(["kaggle", "bundle", "--output", "", "--owner", "ptbrtester", "--slug", "ptbr-run"], 2, "--output"),
        Case(["kaggle", "bundle", "--output", str(tmp_path / "b"), "--owner", "ptbrtester", "--slug", "ptbr-run",
              "--data", ""], 2, "--data must be a path"),
        Case(["kaggle", "bundle", "--output", str(tmp_path / "b"), "--owner", "ptbrtester", "--slug", "ptbr-run",
              "--stop-after-hours", "nan"], 2, "--stop-after-hours"),
        Case(["kaggle", "bundle", "--output", str(tmp_path / "b"), "--owner", "ptbrtester", "--slug", "ptbr-run",
              "--python-version", "3"], 2, "--python-version"),
        Case(["kaggle", "bundle", "--output", str(tmp_path / "a_file"), "--owner", "ptbrtester", "--slug", "ptbr-run"],
             6, "is not a bundle"),
        Case(["kaggle", "push", ""], 2, "BUNDLE must be a path"),
        Case(["kaggle", "push", str(tmp_path / "a_file")], 2, "not a ptbr Kaggle bundle"),
        Case(["kaggle", "status", str(tmp_path), "--poll-seconds", "nan"], 2, "--poll-seconds"),
        Case(["kaggle", "status", str(tmp_path), "--poll-seconds", "-1"], 2, "--poll-seconds"),
        Case(["kaggle", "output", str(tmp_path), "--path", ""], 2, "--path"),
        Case(["kaggle", "output", str(tmp_path), "--path", str(tmp_path / "o"), "--pattern", "["], 2, "--pattern"),
    ]
    for case in cases:
        assert_refused(capsys, main(case.args), case.code, case.says, case.args)


# --------------------------------------------------------------------------------------------


def assert_refused(capsys, code: int, expected: int, says: str = "", args=None) -> None:
    out, err = capsys.readouterr()
    where = f"{args}: exit {code}\n{err[-2000:]}"
    assert code == expected and code in EXIT_CODES, where
    assert code != 0 and code != 1, where
    assert "Traceback" not in out + err, where
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "; fix: " in lines[-1], where
    assert says in lines[-1], where
