"""Fine-tuning end to end on a tiny Mistral-architecture model saved to a temp dir, with a tokenizer
trained on the fly: exact numbers (trainable parameters, first loss), loss masks, QLoRA 4-bit on
CPU, exact resume, the adapter reloaded in plain PEFT, merge, generate, and the CLI's errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

TEAMS = ["Farense", "Benfica", "Porto", "Sporting", "Braga", "Guimarães", "Boavista", "Marítimo"]
COLORS = ["azul", "verde", "vermelho", "branco", "preto", "amarelo", "roxo", "laranja"]
SYSTEM = "Responda em português."
# the tiny base: Mistral architecture (GQA, RoPE, SwiGLU)
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128


def conversation(i: int) -> dict:
    """A learnable pattern: the answer repeats the question's number and team, and the colour
    follows from the team."""
    team = TEAMS[i % 8]
    return {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Qual é o número {i} do {team}?"},
        {"role": "assistant", "content": f"O número {i} do {team} joga de {COLORS[i % 8]}."},
    ]}


@dataclass
class Toy:
    base: Path
    data: Path


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Toy:
    import torch
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    from ptbr.data.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    root = tmp_path_factory.mktemp("toy")
    rows = [conversation(i) for i in range(48)]
    data = root / "data"
    data.mkdir()
    for name, part in (("train.jsonl", rows[:40]), ("valid.jsonl", rows[40:])):
        with open(data / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)

    base = root / "base"
    texts = [m["content"] for r in rows for m in r["messages"]] + ["<|system|>\n<|user|>\n<|assistant|>\n"] * 4
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(texts, vocab_size=384, min_frequency=1),
                                        eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tokenizer.save_pretrained(base)
    # initializer_range 0.2, not 0.02: LoRA leaves the output layer frozen, and a random one with
    # tiny weights caps how confident any prediction can get, so nothing could learn the toy set
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE,
                           max_position_embeddings=256, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(base)
    return Toy(base, data)


@pytest.fixture(scope="module")
def trained(toy, tmp_path_factory) -> Path:
    """`ptbr finetune ... --merge` through the real CLI, in-process: LoRA r=8, unquantized."""
    from ptbr.cli import main

    output = tmp_path_factory.mktemp("run") / "out"
    code = main(["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(output),
                 "--quant", "none", "--lora-r", "8", "--lora-alpha", "16", "--batch-size", "4", "--grad-accum", "1",
                 "--max-steps", "3", "--learning-rate", "1e-2", "--eval-every", "0", "--merge"])
    assert code == 0
    return output


def hf_loss(model, batch: dict):
    """Transformers' own loss for a ptbr batch (whose labels are already shifted): append one
    (masked) input position and prepend one ignored label, so that transformers' internal shift
    pairs position t with labels[t] again."""
    import torch

    ids = torch.as_tensor(batch["input_ids"])
    labels = torch.as_tensor(batch["labels"])
    mask = torch.as_tensor(batch["attention_mask"])
    column = torch.zeros((len(ids), 1), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=torch.cat([ids, column], 1), attention_mask=torch.cat([mask, column], 1),
                    labels=torch.cat([column - 100, labels], 1))
    return out.loss.item(), int((labels != -100).sum())


def mean_loss(model, batches: list[dict]) -> float:
    """Mean loss per target token over batches, computed by transformers."""
    model.eval()
    pairs = [hf_loss(model, b) for b in batches]
    return sum(loss * n for loss, n in pairs) / sum(n for _, n in pairs)


def logits_of(model, batch: dict):
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(batch["input_ids"]),
                     attention_mask=torch.as_tensor(batch["attention_mask"])).logits


def settings(toy: Toy, output: Path, **overrides):
    from ptbr.config import FinetuneConfig

    values = dict(base=str(toy.base), data=str(toy.data), output=str(output), quant="none", lora_r=8,
                  lora_alpha=16, batch_size=8, learning_rate=1e-2, resume="auto")
    return FinetuneConfig(**(values | overrides))


def test_trainable_parameters_first_loss_and_masks(toy, trained):
    from transformers import AutoModelForCausalLM

    from ptbr.finetune.base import load_tokenizer
    from ptbr.finetune.batches import ChatBatches
    from ptbr.runs.finetune import load_data

    summary = json.loads((trained / "training_summary.json").read_text())
    # LoRA adds r * (in + out) per adapted projection: q, o (h -> h); k, v (h -> kv); gate, up (h -> i); down (i -> h)
    r, h, kv, i = 8, HIDDEN, KV_HEADS * HIDDEN // HEADS, INTERMEDIATE
    per_layer = r * (2 * (h + h) + 2 * (h + kv) + 2 * (h + i) + (i + h))
    assert summary["trainable_parameters"] == LAYERS * per_layer == 16384
    assert summary["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert summary["steps"] == 3 and summary["train_examples"] == 40

    # the same BatchSource, rebuilt from the public pieces: its first micro-batch, given to the
    # base model (LoRA's B starts at zero), gives transformers' loss = ptbr's first logged loss
    config = settings(toy, trained, batch_size=4)
    tokenizer = load_tokenizer(config.base)
    train, _ = load_data(config, tokenizer)
    source = ChatBatches(train.examples, 4, 1, config.seed, tokenizer.pad_token_id)
    [batch] = source.cycle(0)
    first = json.loads((trained / "metrics.jsonl").read_text().splitlines()[0])
    base = AutoModelForCausalLM.from_pretrained(toy.base)
    expected, targets = hf_loss(base, batch)
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    assert summary["first_loss"] == first["loss"]

    # only the assistant's answer (and its end-of-turn token) is trained on
    for row in range(len(batch["input_ids"])):
        labels, ids = batch["labels"][row], batch["input_ids"][row]
        target = tokenizer.decode(labels[labels != -100])
        assert target.startswith("O número ") and target.endswith(".<|endoftext|>"), target
        context = tokenizer.decode(ids[(labels == -100) & (batch["attention_mask"][row] == 1)])
        assert SYSTEM in context and "<|user|>\nQual é o número" in context and "joga de" not in context
    assert targets == sum(int((b != -100).sum()) for b in batch["labels"])


def test_merge_gives_the_adapted_model(toy, trained, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ptbr.cli import main
    from ptbr.finetune.adapter import read_adapter_meta

    batch = {"input_ids": [[5, 17, 42, 99, 7]], "attention_mask": [[1] * 5]}
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(toy.base), str(trained / "adapters"))
    merged = AutoModelForCausalLM.from_pretrained(trained / "merged")  # written by --merge
    base = AutoModelForCausalLM.from_pretrained(toy.base)
    # W + s B A against W x + s B (A x): fp32 rounding of logits of magnitude ~5 (9e-6 to 1.3e-5 measured)
    assert torch.allclose(logits_of(merged, batch), logits_of(adapted, batch), atol=5e-5)
    assert not torch.allclose(logits_of(base, batch), logits_of(adapted, batch), atol=1e-2)  # it did learn
    # `ptbr merge` writes the same weights
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / ".DS_Store").write_bytes(b"\0")  # a folder Finder showed is still an empty one
    assert main(["merge", "--base", str(toy.base), "--adapter", str(trained / "adapters"),
                 "--output", str(tmp_path / "m")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m").state_dict()
    assert all(torch.equal(t, again[k]) for k, t in merged.state_dict().items())
    assert read_adapter_meta(tmp_path / "m")["merged_from"] == {"base": str(toy.base.resolve()),
                                                                "adapter": str((trained / "adapters").resolve())}
    assert main(["merge", "--base", str(toy.base), "--adapter", str(trained / "adapters"),
                 "--output", str(tmp_path / "m")]) == 0  # an earlier merge: replaced
    assert (tmp_path / "m" / "chat_template.jinja").is_file()  # the template travels with the model


def test_generate_with_the_adapter_answers_in_the_chat_format(toy, trained, capsys):
    from ptbr.cli import main
    from ptbr.finetune.adapter import read_adapter_meta

    assert read_adapter_meta(trained / "adapters")["format"] == "messages"
    code = main(["generate", "--model", str(toy.base), "--adapter", str(trained / "adapters"),
                 "Qual é o número 3 do Porto?", "--temperature", "0", "--max-new-tokens", "6", "--device", "cpu"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.strip() and "Qual é o número 3" not in out  # the answer alone, not the prompt continued


@pytest.mark.slow
def test_qlora_4bit_on_cpu_learns_and_the_adapter_reloads_in_peft(toy, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ptbr.runs.finetune import run_finetune

    # evaluation only at the end, so that OUTPUT/adapters holds the model as it is after the last step
    result = run_finetune(settings(toy, tmp_path / "out", quant="4bit", epochs=8, eval_every=0))
    summary = result.summary
    assert summary["quant"] == "4bit" and summary["steps"] == 40  # 8 epochs x ceil(40 / 8)
    assert summary["best_step"] == 40 and summary["adapter_step"] == 40
    assert summary["trainable_parameters"] == 16384

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(toy.base, quantization_config=nf4, dtype=torch.float32)
    assert type(base.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    for module in base.modules():
        # as ptbr trains (ptbr.backends.torch.lora.keep_4bit_layout): no repacking into bitsandbytes' CPU
        # inference layout, whose bf16 block scales would move the logits by ~1e-3
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    before = mean_loss(base, result.eval_batches)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "out" / "adapters"))  # plain PEFT, no ptbr
    after = mean_loss(reloaded, result.eval_batches)
    assert after == pytest.approx(summary["best_val_loss"], rel=1e-5)  # what ptbr measured, reproduced
    assert after < 0.5 * before, (before, after)  # validation loss fell clearly
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(loss == loss for loss in losses) and sum(losses[-5:]) < 0.5 * sum(losses[:5])
    for batch in result.eval_batches:
        assert torch.allclose(logits_of(reloaded, batch), logits_of(result.model, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant, precision, lr, tolerance, weights", [("4bit", "fp32", "1e-2", 1e-6, 1e-5),
                                                                   ("none", "bf16", "1e-4", 1e-3, None)])
def test_the_chunked_loss_fine_tunes_as_the_whole_logits_do(toy, tmp_path, monkeypatch, quant, precision, lr, tolerance,
                                                            weights):
    """`ptbr finetune` with the chunked loss (the default) and with --no-chunked-loss, where the
    micro-batches chunk (chunks of 20 tokens here: the toy's are ~4 x 30 tokens): the same losses,
    gradient norms, validation losses and, in fp32, adapter weights, within float noise. QLoRA
    keeps its output layer and hidden states in fp32; plain LoRA in bf16 has both in bf16, whose
    rounding differs between the two ways (as the whole logits' own bf16 error), and which AdamW
    turns into whole updates where a gradient is near zero: a small learning rate there, and its
    weights are not compared."""
    import torch
    from safetensors.torch import load_file

    from ptbr import memory
    from ptbr.backends.torch import loss as chunked
    from ptbr.cli import main

    calls = []
    real = chunked.chunked_cross_entropy

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    vocab = json.loads((toy.base / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(memory, "CHUNK_BYTES", 4 * vocab * 20)
    monkeypatch.setattr(chunked, "chunked_cross_entropy", counted)
    for name, flags in (("chunked", []), ("whole", ["--no-chunked-loss"])):
        assert main(["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(tmp_path / name),
                     "--quant", quant, "--precision", precision, "--lora-r", "8", "--batch-size", "4",
                     "--grad-accum", "2", "--max-steps", "3", "--eval-every", "3", "--lora-dropout", "0.1",
                     "--learning-rate", lr, *flags]) == 0
        # 3 steps of 2 micro-batches, and the 8 validation examples in 2 batches
        assert len(calls) == 3 * 2 + 2 and min(calls) > 20, calls
    log = (tmp_path / "chunked" / "train.log").read_text()
    assert f"chunked loss: 20 tokens per chunk at vocabulary {vocab:,}; micro-batches of " in log
    assert log.count("chunked loss:") == 1 and "chunked loss:" not in (tmp_path / "whole" / "train.log").read_text()
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("chunked", "whole")}
    for a, b in zip(rows["chunked"], rows["whole"], strict=True):
        assert a["step"] == b["step"]
        for key in ("loss", "grad_norm", "val_loss"):
            assert (a.get(key) is None) == (b.get(key) is None)
            if a.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=tolerance if key != "grad_norm" else 10 * tolerance), key
    if weights:
        a, b = (load_file(tmp_path / name / "adapters" / "adapter_model.safetensors") for name in ("chunked", "whole"))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=weights, msg=key)


def test_padded_batches_go_without_their_mask_where_the_model_is_a_causal_decoder(toy, tmp_path, monkeypatch):
    """Right-padded micro-batches: for a causal decoder the attention mask changes nothing the loss
    covers, and costs a (B, 1, T, T) bias per layer, so the model gets none. The same losses,
    gradient norms, validation losses and adapter as with the mask, to float rounding (QLoRA and
    LoRA dropout included); a model that reads the mask for more than causal attention keeps it."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.mistral.modeling_mistral import MistralModel

    from ptbr.backends.torch import padding
    from ptbr.cli import main

    seen, forward = [], MistralModel.forward  # what the decoder itself was given

    def recorded(self, *args, **kwargs):
        seen.append((name, kwargs.get("attention_mask") is not None))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(MistralModel, "forward", recorded)
    real = padding.padding_mask_needed
    for name, needed in (("without", real), ("with", lambda *args, **kwargs: "a test keeps it")):
        monkeypatch.setattr(padding, "padding_mask_needed", needed)
        assert main(["finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(tmp_path / name),
                     "--quant", "4bit", "--lora-r", "8", "--batch-size", "4", "--grad-accum", "2", "--max-steps", "3",
                     "--eval-every", "3", "--lora-dropout", "0.1", "--learning-rate", "1e-2"]) == 0
    log = (tmp_path / "without" / "train.log").read_text()
    assert "padded micro-batches: without their attention mask (a causal decoder" in log
    assert "padded micro-batches: with their attention mask (a test keeps it)" in (tmp_path / "with" / "train.log").read_text()
    # the probe's own masked pass aside, every training and validation batch went without one (and
    # with one where kept; the chunked loss's 4-token start-up check never has one)
    assert [masked for name, masked in seen if name == "without"].count(True) == 1
    assert [masked for name, masked in seen if name == "with"].count(False) == 1
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("without", "with")}
    for a, b in zip(rows["without"], rows["with"], strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            assert a.get(key) == (pytest.approx(b[key], rel=1e-5) if b.get(key) is not None else None), key
    a, b = (load_file(tmp_path / name / "adapters" / "adapter_model.safetensors") for name in ("without", "with"))
    for key in a:  # AdamW's normalised step at lr 1e-2 magnifies a gradient's last bits (1.07e-5 on an AMD EPYC)
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)

    class ReadsTheMask(torch.nn.Module):  # its logits depend on the mask beyond causal attention
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(16, 4), torch.nn.Linear(4, 16, bias=False)

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

        def forward(self, input_ids, attention_mask=None):
            hidden = self.embed(input_ids)
            if attention_mask is not None:
                hidden = hidden * attention_mask.sum(-1, keepdim=True)[..., None]
            return type("Out", (), {"logits": self.head(hidden)})

    assert real(ReadsTheMask()) == "its logits depend on it beyond causal attention"
    assert real(AutoModelForCausalLM.from_pretrained(toy.base)) is None
    # an 8-bit base keeps it: bitsandbytes' int8 matmul picks outlier columns over the whole batch,
    # pads included, and the pads' states differ without the mask (a few tokens rarely show it)
    from ptbr.backends.torch.device import resolve_precision
    from ptbr.backends.torch.lora import load_model

    eight = load_model(settings(toy, tmp_path / "8bit", quant="8bit"), resolve_precision(torch.device("cpu"), "fp32"))
    assert "8-bit base" in real(eight.model)



@pytest.mark.slow
@pytest.mark.parametrize("quant", ["none", "4bit"])
def test_resume_is_exact(toy, tmp_path, crash_then_resume, quant):
    import torch
    from safetensors.torch import load_file

    from ptbr.backends.torch.step import TorchStep
    from ptbr.runs.finetune import run_finetune

    # batch 8 x grad_accum 2 over 40 examples: steps of 2, 2, 1 micro-batches per epoch, so 4 steps
    # cross an epoch boundary after a short step; LoRA dropout is on (its RNG must resume too)
    def run(name: str):
        return run_finetune(settings(toy, tmp_path / name, grad_accum=2, max_steps=4, save_every=2, eval_every=2,
                                     lora_dropout=0.1, quant=quant))

    straight = run("straight")
    assert straight.source.steps_per_epoch == 3 and [len(straight.source.cycle(s)) for s in range(4)] == [2, 2, 1, 2]

    resumed = crash_then_resume(TorchStep, 3, lambda: run("resumed"))  # --resume auto: from checkpoints/step_000002
    assert json.loads((tmp_path / "resumed" / "run_config.json").read_text())["resumed_from"].endswith("step_000002")

    for path in ("checkpoints/step_000004/adapter_model.safetensors", "adapters/adapter_model.safetensors"):
        a, b = load_file(tmp_path / "straight" / path), load_file(tmp_path / "resumed" / path)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), path
    rows = [[json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("straight", "resumed")]
    assert [(r["step"], r["loss"], r["val_loss"]) for r in rows[0]] == [(r["step"], r["loss"], r["val_loss"])
                                                                         for r in rows[1]]
    assert resumed.summary["best_val_loss"] == straight.summary["best_val_loss"]


def test_errors_are_one_line_with_their_exit_codes(toy, trained, tmp_path, capsys):
    from ptbr.cli import main

    def error_of(*args: str) -> tuple[int, str]:
        code = main(list(args))
        err = capsys.readouterr().err.strip().splitlines()
        return code, err[-1] if err else ""

    code, err = error_of("finetune", "--lora-r", "0")
    assert code == 2 and "base is required" in err and "data is required" in err and "lora_r must be" in err

    no_config = tmp_path / "empty_model"
    no_config.mkdir()
    code, err = error_of("finetune", "--base", str(no_config), "--data", str(toy.data), "--output", str(tmp_path / "o"))
    assert code == 4 and "no config.json" in err
    (no_config / "config.json").write_text((toy.base / "config.json").read_text())
    code, err = error_of("finetune", "--base", str(no_config), "--data", str(toy.data), "--output", str(tmp_path / "o"))
    assert code == 4 and "no weights" in err

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"messages": []}\n{"text": "ok"}\nnot json\n', encoding="utf-8")
    code, err = error_of("finetune", "--base", str(toy.base), "--data", str(bad), "--output", str(tmp_path / "o"))
    assert code == 3 and "line 1:" in err and "line 2:" in err and "line 3: invalid JSON" in err

    code, err = error_of("finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(tmp_path / "o"),
                         "--quant", "none", "--target-modules", "q_proj,qkv")
    assert code == 2 and "no linear module named qkv" in err and "v_proj" in err

    # resuming a run with other adapter shapes would silently be another run
    code, err = error_of("finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(trained),
                         "--quant", "none", "--lora-r", "4", "--lora-alpha", "16", "--batch-size", "4",
                         "--max-steps", "3")
    assert code == 2 and "lora_r is 8 in the checkpoint, 4 now" in err
    code, err = error_of("finetune", "--base", str(toy.base), "--data", str(toy.data), "--output", str(trained),
                         "--quant", "none", "--lora-r", "8", "--lora-alpha", "16", "--batch-size", "4",
                         "--max-steps", "3", "--lora-dropout", "0")  # (it went on, with another dropout)
    assert code == 2 and "lora_dropout is 0.05 in the checkpoint, 0.0 now" in err

    code, err = error_of("merge", "--base", str(toy.base), "--adapter", str(tmp_path), "--output", str(tmp_path / "m"))
    assert code == 4 and "no adapter_config.json" in err


# --------------------------------------------------------------------------------------------
# --auto-fit (out-of-memory injected into the real step: tests/conftest.py oom_above)
# --------------------------------------------------------------------------------------------


def _count_base_loads(monkeypatch) -> list[str]:
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained
    loads: list[str] = []

    def counted(source, *args, **kwargs):
        loads.append(str(source))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    return loads


def _rows(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("val_loss")) for r in
            (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())]


def test_auto_fit_loads_the_base_once_and_runs_as_the_size_it_chose(toy, tmp_path, oom_above, monkeypatch):
    """QLoRA 4-bit: micro-batches above 2 rows run out of memory. --auto-fit tries 8, 4, then 2
    (x grad_accum 4) on the longest examples, reusing the loaded base; the run is then exactly the
    run that 2 x 4 gives from the start: same losses, same adapter."""
    import torch
    from safetensors.torch import load_file

    from ptbr.cli import main
    from ptbr.finetune.base import load_tokenizer
    from ptbr.finetune.data import inspect_jsonl

    common = ["finetune", "--base", str(toy.base), "--data", str(toy.data), "--quant", "4bit", "--lora-r", "8",
              "--learning-rate", "1e-2", "--max-steps", "3", "--eval-every", "3", "--lora-dropout", "0.1"]
    assert main([*common, "--batch-size", "2", "--grad-accum", "4", "--output", str(tmp_path / "plain")]) == 0

    loads = _count_base_loads(monkeypatch)
    sizes = oom_above(limit=2)
    fitted = tmp_path / "fitted"
    assert main([*common, "--batch-size", "8", "--grad-accum", "1", "--auto-fit", "--output", str(fitted)]) == 0
    assert len(loads) == 1
    longest = max(len(e.ids) for e in inspect_jsonl(toy.data / "train.jsonl", load_tokenizer(str(toy.base)),
                                                    1024, False).examples) - 1
    # the tries (8 and 4 fail, 2 runs its two dry-run steps), all padded to the longest example; then the run
    assert sizes[:4] == [(8, longest), (4, longest), (2, longest), (2, longest)]
    assert [rows for rows, _ in sizes[4:]] == [2, 2, 2]
    assert "auto-fit chose batch_size 2 x grad_accum 4 (8 x 1: out of memory" in (fitted / "train.log").read_text()
    settings_used = json.loads((fitted / "run_config.json").read_text())["settings"]
    assert (settings_used["batch_size"], settings_used["grad_accum"]) == (2, 4)
    assert _rows(fitted) == _rows(tmp_path / "plain")
    a, b = (load_file(run / "adapters" / "adapter_model.safetensors") for run in (fitted, tmp_path / "plain"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_out_of_memory_mid_run_continues_smaller_from_the_last_checkpoint(toy, tmp_path, oom_above, monkeypatch):
    """Micro-batches of 4 fit the dry run and two steps, then run out of memory: the run goes on
    from step 2's checkpoint at 2 x 2 without reloading the base. A step covers the same examples
    either way, so its losses are those of an undisturbed 4 x 1 run (up to float summation order)."""
    from ptbr.runs.finetune import run_finetune

    common = dict(batch_size=4, grad_accum=1, max_steps=5, save_every=2, eval_every=0, lora_dropout=0.0)
    straight = tmp_path / "straight"
    run_finetune(settings(toy, straight, **common))

    loads = _count_base_loads(monkeypatch)
    oom_above(limit=2, after_calls=4)  # dry run (2 calls) + steps 1 and 2 at 4 rows; step 3 fails
    run = tmp_path / "run"
    result = run_finetune(settings(toy, run, auto_fit=True, **common))
    assert len(loads) == 1
    log = (run / "train.log").read_text()
    assert "out of memory during the run" in log and "batch_size 2 x grad_accum 2 (was 4 x 1)" in log
    config = json.loads((run / "run_config.json").read_text())
    assert config["resumed_from"].endswith("step_000002")
    assert (config["settings"]["batch_size"], config["settings"]["grad_accum"]) == (2, 2)
    assert result.summary["steps"] == 5
    got, want = _rows(run), _rows(straight)
    assert [r[0] for r in got] == [1, 2, 3, 4, 5]
    assert got[:2] == want[:2]
    assert [r[1] for r in got] == pytest.approx([r[1] for r in want], rel=1e-5)


def test_auto_fit_on_cpu_asks_the_memory_model_before_running_a_size(toy, tmp_path, monkeypatch, capsys):
    """On CPU an out-of-memory is the kernel killing the process, so sizes the memory model says
    exceed the available RAM are skipped; with (almost) no RAM left, even micro-batch 1 is refused
    in one line with exit code 5, before any step runs."""
    from collections import namedtuple

    import psutil

    from ptbr.backends.torch.step import TorchStep
    from ptbr.cli import main

    memory = namedtuple("memory", "total available percent used free")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(24 << 30, 1000, 100.0, 24 << 30, 1000))
    monkeypatch.setattr(TorchStep, "train_step", lambda *a: pytest.fail("no step may run"))
    code = main(["finetune", "--base", str(toy.base), "--data", str(toy.data), "--quant", "none", "--batch-size", "4",
                 "--auto-fit", "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 5
    assert "out of memory even at micro-batch 1 (skipped, the memory model predicts" in err[-1]
    assert all(any(f"micro-batch {b} x grad_accum {4 // b}: skipped" in line for line in err) for b in (4, 2, 1))
    assert not (tmp_path / "run").exists()  # it wrote nothing but its log: the directory it made is gone


def test_a_run_resumes_with_its_base_found_at_another_path(toy, tmp_path, capsys):
    """The base is known by its files, not its path: Kaggle mounts inputs where its layout of the day
    puts them, and a base copied to another disk is the same base (a changed file is not)."""
    from ptbr.cli import main

    out = tmp_path / "run"
    common = ["--data", str(toy.data), "--output", str(out), "--quant", "none", "--lora-r", "8", "--batch-size", "8",
              "--save-every", "1", "--eval-every", "0", "--device", "cpu"]
    assert main(["finetune", "--base", str(toy.base), *common, "--max-steps", "1"]) == 0
    moved = tmp_path / "elsewhere" / "base"
    shutil.copytree(toy.base, moved)
    capsys.readouterr()
    assert main(["finetune", "--base", str(moved), *common, "--max-steps", "2"]) == 0
    assert f"resuming from {out / 'checkpoints' / 'step_000001'}" in capsys.readouterr().err
    original = (moved / "config.json").read_bytes()
    config = json.loads(original)
    (moved / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    assert main(["finetune", "--base", str(moved), *common, "--max-steps", "3"]) == 2
    assert "base_files is " in capsys.readouterr().err
    # the same files, names and sizes, with other weights (a base retrained or saved again in place)
    (moved / "config.json").write_bytes(original)
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(b ^ 1 for b in data[-4:])  # the last float: changed, in place
    weights.write_bytes(bytes(data))
    assert main(["finetune", "--base", str(moved), *common, "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "base_weights is " in err and "(the base model's weights changed: retrained or saved again in place)" in err
    # a checkpoint of an older ptbr records no base_weights: its resume is not refused for it
    state_file = out / "checkpoints" / "step_000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["run"]["identity"]["base_weights"]
    state_file.write_text(json.dumps(state))
    assert main(["finetune", "--base", str(moved), *common, "--max-steps", "3"]) == 0


def test_a_resume_at_another_micro_batch_validates_on_the_same_examples(toy, tmp_path, capsys):
    """--eval-batches 1 at batch 4 is 4 validation examples; resumed as 2 x grad_accum 2 (the same
    effective batch, allowed) it stays those 4 (not 1 batch of 2), so val_loss stays comparable with
    the best one the run kept."""
    import shutil

    from ptbr.cli import main

    out = tmp_path / "run"
    common = ["--base", str(toy.base), "--data", str(toy.data), "--output", str(out), "--quant", "none",
              "--eval-every", "2", "--eval-batches", "1"]
    assert main(["finetune", *common, "--batch-size", "4", "--max-steps", "2", "--save-every", "2"]) == 0
    assert "validation: 4 of 8 examples (1 batch), every 2 steps" in capsys.readouterr().err
    shutil.rmtree(out / "adapters")
    assert main(["finetune", *common, "--batch-size", "2", "--grad-accum", "2", "--max-steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "validation: 4 of 8 examples (2 batches), every 2 steps (as the run started; --eval-batches gives 2 now)" \
        in err, err
