"""The CLI around fine-tuning, on the tiny base of tests/test_finetune.py: `generate` formats a prompt
as the model was trained (adapter or merged), `--raw` continues plain text, and library noise a user
cannot act on stays out of stderr unless --debug."""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec

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


def test_a_merged_model_answers_as_its_adapter(toy, trained, tmp_path, generate, capsys):
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

    # the adapter merged in, applied again, would count twice; one fine-tuned from the merged model
    # (its recorded base) is that model's own (staged fine-tuning), and applies
    ask = ["generate", QUESTION, "--max-new-tokens", "2", "--device", "cpu", "--model", str(merged), "--adapter"]
    assert main([*ask, adapters]) == 2
    assert "the model already has an adapter merged in" in capsys.readouterr().err
    staged = tmp_path / "staged"
    shutil.copytree(adapters, staged)
    meta = json.loads((staged / "ptbr_adapter.json").read_text()) | {"base": str(merged)}
    (staged / "ptbr_adapter.json").write_text(json.dumps(meta))
    assert main([*ask, str(staged)]) == 0


def test_a_model_trained_on_prompt_completion_continues_the_prompt(toy, tmp_path, generate, capsys):
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
    # the base's tokenizer has no chat template, and this data needs none: none is said to be used,
    # and none is saved (plain transformers would take a merged folder with one for a chat model)
    assert "no chat template" not in capsys.readouterr().err
    assert not (merged / "chat_template.jinja").exists() and not (output / "adapters" / "chat_template.jinja").exists()
    assert json.loads((merged / "tokenizer_config.json").read_text()).get("chat_template") is None
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



def test_sampling_is_what_the_flags_say_not_the_model_s_generation_config(toy, tmp_path, capsys):
    """A base that ships a generation_config.json with a repetition penalty and an n-gram ban (as
    Qwen2.5's and Llama-3.1's ship top_p, a penalty): `--temperature 0` stays plain greedy, as on MLX."""
    shipped = tmp_path / "shipped"
    shutil.copytree(toy.base, shipped)
    (shipped / "generation_config.json").write_text(json.dumps({"repetition_penalty": 50.0, "no_repeat_ngram_size": 1}))

    def greedy(model) -> str:
        capsys.readouterr()
        assert main(["generate", "--model", str(model), "--raw", "Porto Porto Porto", "--temperature", "0",
                     "--max-new-tokens", "40", "--device", "cpu"]) == 0
        return capsys.readouterr().out

    plain = greedy(toy.base)
    assert len(plain.split()) > len(set(plain.split()))  # it repeats: a penalty or a ban would change it
    assert greedy(shipped) == plain


def test_a_sentencepiece_continuation_keeps_its_leading_space():
    """Llama's and Mistral's decoder (Metaspace) drops the space that starts a decoding: "▁um"
    decoded alone is "um", and `--raw` printed "Era uma vezum"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ptbr.commands.generate import decode_new

    vocab = {"<unk>": 0, "</s>": 1, "▁Era": 2, "▁uma": 3, "▁vez": 4, "▁um": 5, "▁menino": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    prompt = tokenizer("Era uma vez")["input_ids"]
    assert prompt == [2, 3, 4] and tokenizer.decode([5, 6]) == "um menino"  # what a decoding of the new tokens gives
    assert "Era uma vez" + decode_new(tokenizer, prompt, [5, 6, 1]) == "Era uma vez um menino"


def test_a_chat_model_stops_at_its_template_s_end_of_turn():
    """A base whose chat template ends turns with <|im_end|> (ChatML, e.g. Qwen2.5's) learns to end
    answers with it, never with EOS: generation stops there; with ptbr's default template, at EOS;
    and at every eos_token_id of the model's generation_config."""
    from ptbr.commands.generate import stop_ids
    from tests.test_chat_data import tokenizer as tokenizer_fixture

    tokenizer = tokenizer_fixture.__wrapped__()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert stop_ids(tokenizer, None, chat=True) == {tokenizer.eos_token_id, end}
    assert stop_ids(tokenizer, None, chat=False) == {tokenizer.eos_token_id}
    assert stop_ids(tokenizer, [7, 9], chat=False) == {tokenizer.eos_token_id, 7, 9}
    tokenizer.chat_template = None
    from ptbr.finetune.data import use_default_chat_template

    assert use_default_chat_template(tokenizer)
    assert stop_ids(tokenizer, None, chat=True) == {tokenizer.eos_token_id}


def test_a_fine_tuning_run_s_directory_given_as_the_model_says_how_to_use_it(toy, trained, tmp_path, capsys):
    """Without --merge a fine-tuning run holds adapters/ only: generate --model RUN names the base and
    the adapter to give instead (a pretraining run's directory names its final/)."""
    run = tmp_path / "ft"
    shutil.copytree(trained / "adapters", run / "adapters")
    assert main(["generate", "--model", str(run), "Oi"]) == 4
    assert capsys.readouterr().err.strip().endswith(
        f"fix: this is a fine-tuning run's directory: give its base and its adapter (--model {toy.base} --adapter "
        f"{run / 'adapters'} for generate; --base and --adapter for merge)")


def test_an_adapter_trained_on_a_quantized_base_is_said_to_be_applied_to_the_base_as_given(toy, trained, tmp_path,
                                                                                            capsys):
    adapter = tmp_path / "adapters"
    shutil.copytree(trained / "adapters", adapter)
    meta = json.loads((adapter / "ptbr_adapter.json").read_text())
    (adapter / "ptbr_adapter.json").write_text(json.dumps(meta | {"quant": "4bit"}))
    assert main(["generate", "--model", str(toy.base), "--adapter", str(adapter), "Oi", "--max-new-tokens", "2",
                 "--device", "cpu"]) == 0
    assert "note: the adapter was trained on the base quantized (4bit); it is applied to --model as given" \
        in capsys.readouterr().err


def test_a_model_in_mlx_s_quantized_format_is_named_as_such_on_torch(toy, trained, tmp_path, capsys):
    """mlx_lm.convert -q writes `quantization` (and a copy as `quantization_config`, without
    `quant_method`): transformers failed with "... has no `quant_method` attribute" and ptbr said to
    check that the directory holds a complete model. The weights are not read: the config decides."""
    quantized = tmp_path / "mlx-4bit"
    shutil.copytree(toy.base, quantized)
    config = json.loads((quantized / "config.json").read_text())
    mlx = {"group_size": 64, "bits": 4, "mode": "affine"}  # as mlx_lm.convert -q writes it (tests/test_mlx.py)
    (quantized / "config.json").write_text(json.dumps(config | {"quantization": mlx, "quantization_config": mlx}))
    format_line = (f"error: the {{}} is in MLX's quantized format (4-bit, made by mlx_lm.convert -q: config.json has "
                   f"`quantization`, no `quant_method`), which the torch backend cannot load ({quantized}); fix: ")

    def last_line(*args: str) -> str:
        assert main([*args, "--device", "cpu"] if args[0] != "merge" else list(args)) == 4
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert last_line("generate", "--backend", "torch", "--model", str(quantized), "Oi") == (
        format_line.format("model") + "generate with --backend mlx, or give the unquantized model")
    assert last_line("finetune", "--backend", "torch", "--base", str(quantized), "--data", str(toy.data), "--output",
                     str(tmp_path / "run"), "--quant", "none") == (
        format_line.format("base model") + "fine-tune it with --backend mlx, which trains on it as it is, or give "
        "the original (unquantized) model")
    assert last_line("merge", "--base", str(quantized), "--adapter", str(trained / "adapters"), "--output",
                     str(tmp_path / "merged")) == (
        format_line.format("base model") + "give the original (unquantized) model the adapter was trained on: a "
        "merge needs its full weights")
    # a model that transformers quantized (bitsandbytes: a quant_method) is not taken for MLX's
    from ptbr.backends.torch.lora import mlx_quantization

    assert mlx_quantization(config | {"quantization": mlx, "quantization_config": mlx}) == mlx
    assert mlx_quantization(config | {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}) \
        is None
    assert mlx_quantization(config) is None


def test_a_gpt2_style_base_is_fine_tuned_through_its_conv1d_projections(tmp_path, capsys):
    """GPT-2 (and the PT-BR models fine-tuned from it) make their projections with transformers'
    Conv1D, not nn.Linear: ptbr found nothing to adapt (exit 4). Its c_attn, c_proj and c_fc are
    adapted, the adapter says fan_in_fan_out (the weights are transposed) and reloads in PEFT, and
    the merged model gives the adapted logits."""
    import torch
    from peft import PeftModel
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        PreTrainedTokenizerFast,
    )

    from ptbr.data.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    rows = [finetune_tests.conversation(i) for i in range(12)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    texts = [m["content"] for r in rows for m in r["messages"]] + ["<|system|>\n<|user|>\n<|assistant|>\n"] * 4
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(texts, vocab_size=256, min_frequency=1),
                                        eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    base = tmp_path / "gpt2"
    tokenizer.save_pretrained(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                   eos_token_id=tokenizer.eos_token_id)).save_pretrained(base)
    out = tmp_path / "run"
    assert main(["finetune", "--base", str(base), "--data", str(data), "--output", str(out), "--quant", "none",
                 "--max-steps", "3", "--learning-rate", "1e-2", "--eval-every", "0", "--batch-size", "4",
                 "--merge"]) == 0
    config = json.loads((out / "adapters" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["c_attn", "c_fc", "c_proj"] and config["fan_in_fan_out"] is True
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out / "adapters")).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        a, m, p = adapted(input_ids=ids).logits, merged(input_ids=ids).logits, plain(input_ids=ids).logits
    assert torch.allclose(a, m, atol=5e-5) and not torch.allclose(a, p, atol=1e-3)  # merged as adapted; it learned
    if find_spec("mlx_lm") is not None:  # mlx-lm's GPT-2 reads n_ctx, which this config.json lacks: torch's job
        assert main(["finetune", "--base", str(base), "--data", str(data), "--output", str(tmp_path / "mlx"),
                     "--quant", "none", "--max-steps", "1", "--backend", "mlx"]) == 4
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.startswith("error: mlx-lm cannot build this base (gpt2) from its config.json: ")
        assert error.endswith("; fix: fine-tune it with --backend torch"), error
