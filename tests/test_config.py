"""Settings: defaults in one place, config files, flag overrides, validation, presets."""

from __future__ import annotations

import json

import pytest

from ptbr.cli import main
from ptbr.commands import settings_from_args
from ptbr.config import PRESETS, PretrainConfig, build_settings, get_preset
from ptbr.errors import ConfigError


def parse_train(argv):
    from ptbr.cli import build_parser

    return settings_from_args(PretrainConfig, build_parser().parse_args(["train", *argv]))


def test_defaults_come_from_the_dataclass_only():
    settings = parse_train([])
    assert settings == PretrainConfig()
    assert settings.learning_rate == PRESETS["tiny"].learning_rate
    assert settings.warmup_steps == 50  # 5% of the default 1000 steps


def test_config_file_then_flags_override(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("batch_size: 4\nseq_len: 128\nlearning_rate: 0.001\nseed: 0\n")
    settings = parse_train(["--config", str(config), "--seq-len", "64"])
    assert (settings.batch_size, settings.seq_len, settings.learning_rate) == (4, 64, 0.001)
    assert settings.seed == 0  # seed 0 is a seed, not "no seed"


def test_a_yaml_list_of_target_modules_is_the_flag_s_comma_separated_names():
    import yaml

    from ptbr.config import FinetuneConfig

    settings = build_settings(FinetuneConfig, yaml.safe_load("base: b\ndata: d\ntarget_modules: [q_proj, v_proj]\n"))
    assert settings.target_modules == "q_proj,v_proj"
    with pytest.raises(ConfigError, match=r"target_modules must be of type str, got \['q_proj', 3\]"):
        build_settings(FinetuneConfig, {"base": "b", "data": "d", "target_modules": ["q_proj", 3]})
    with pytest.raises(ConfigError, match=r"precision must be of type str, got \['bf16'\]"):  # a list only where it is one
        build_settings(PretrainConfig, {"precision": ["bf16"]})


def test_json_config_with_unknown_keys_is_one_error(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"batch_size": 2, "batchsize": 4, "lr": 1e-3}))
    with pytest.raises(ConfigError) as info:
        parse_train(["--config", str(config)])
    message = info.value.one_line()
    assert "unknown key 'batchsize'" in message and "unknown key 'lr'" in message
    assert "valid keys" in message


def test_every_invalid_value_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        build_settings(PretrainConfig, {"batch_size": 0, "grad_accum": -1, "max_steps": 0,
                                        "learning_rate": float("nan"), "model_size": "9b"})
    what = info.value.what
    assert what.startswith("5 problems")
    for fragment in ("batch_size", "grad_accum", "max_steps", "learning_rate", "unknown model size '9b'"):
        assert fragment in what


def test_seq_len_above_the_model_maximum():
    with pytest.raises(ConfigError, match="exceeds the tiny model's maximum of 512"):
        PretrainConfig(seq_len=1024)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ConfigError) as info:
        get_preset("7b")
    assert info.value.fix == "use one of: tiny, 85m, 400m, 800m"


def test_wrong_type_in_config(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"batch_size": "eight"}))
    with pytest.raises(ConfigError, match="batch_size must be of type int"):
        parse_train(["--config", str(config)])


def test_a_config_file_that_cannot_be_read_says_where_and_why(tmp_path):
    """YAML's errors name the line and column (JSON's message does already); a suffix other than
    .json/.yaml/.yml is named (a YAML file called .txt was parsed as JSON: "Expecting value");
    a directory is not "not found"."""
    cases = {"bad.yaml": ("batch_size: [1, 2\nlr: 3\n", "expected ',' or ']', but got ':' at line 2, column 3"),
             "indented.yaml": ("model_size: tiny\nmax_steps: 5\n  seq_len: 64\n",
                               "cannot parse config file: mapping values are not allowed here at line 3, column 10"),
             "run.txt": ("batch_size: 2\n", "a config file is .json, .yaml or .yml, not .txt"),
             "bad.json": ('{"batch_size": 2,}', "Expecting property name enclosed in double quotes: line 1 column 18"),
             # a key given twice: YAML and JSON keep the last silently (seq_len 64 ran)
             "twice.yaml": ("seq_len: 32\nbatch_size: 2\nseq_len: 64\n",
                            "cannot parse config file: the key 'seq_len' is given twice at line 3, column 1"),
             "twice.json": ('{"seq_len": 32, "seq_len": 64}', "cannot parse config file: the key 'seq_len' is given twice"),
             # max_steps left empty: said once, not also as a warmup of None the user never set
             "empty.yaml": ("max_steps:\n", "max_steps must be a positive integer, got None")}
    for name, (text, said) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=None) as info:
            parse_train(["--config", str(tmp_path / name)])
        assert said in info.value.what and "warmup" not in info.value.what, info.value.what
    with pytest.raises(ConfigError) as info:
        parse_train(["--config", str(tmp_path)])
    assert info.value.what == f"config file is a directory, not a file: {tmp_path}"
    # YAML's merge key is no key given twice: merged as yaml.safe_load merges it
    merged = tmp_path / "merged.yaml"
    merged.write_text("<<: {seq_len: 32, batch_size: 2}\nseq_len: 64\n")
    settings = parse_train(["--config", str(merged)])
    assert (settings.seq_len, settings.batch_size) == (64, 2)


@pytest.mark.parametrize("name,target", [("85m", 85e6), ("400m", 400e6), ("800m", 800e6)])
def test_preset_parameter_counts_within_ten_percent_at_32k(name, target):
    count = PRESETS[name].param_count(32000)
    assert abs(count - target) / target < 0.10


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_formula_matches_the_real_model(name):
    import torch

    from ptbr.backends.torch.models import count_parameters, llama_config

    config = llama_config(PRESETS[name], vocab_size=32000, eos_id=0)
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # no memory: just the shapes
        model = LlamaForCausalLM(config)
    assert count_parameters(model) == PRESETS[name].param_count(32000)


def test_tiny_is_under_two_million_parameters_with_the_sample_vocab():
    assert PRESETS["tiny"].param_count(2048) == 1_066_112


def test_cli_turns_a_bad_flag_into_one_line(capsys):
    code = main(["train", "--model-size", "7b", "--max-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: unknown model size '7b'")
