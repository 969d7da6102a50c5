"""Chat/instruction JSONL: checking every line, encoding with loss masks, and the batch source."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ptbr.finetune.batches import ChatBatches, collate, fixed_batches
from ptbr.finetune.data import (
    DEFAULT_CHAT_TEMPLATE,
    encode_prompt,
    fix_of,
    inspect_jsonl,
    use_default_chat_template,
)

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "Você responde sobre futebol."},
    {"role": "user", "content": "Qual foi a melhor classificação do Farense?"},
    {"role": "assistant", "content": "O quinto lugar, em 1994-95."},
    {"role": "user", "content": "E onde joga?"},
    {"role": "assistant", "content": "No Estádio de São Luís, em Faro."},
]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer trained on the fly, as transformers sees it; bos = eos, as
    `ptbr prepare` writes them."""
    from transformers import PreTrainedTokenizerFast

    from ptbr.data.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    texts = [m["content"] for m in CONVERSATION] * 3 + ["<|user|>\n<|assistant|>\n<|system|>\n"] * 3
    tok = train_tokenizer(texts, vocab_size=320, min_frequency=1)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return fast


@pytest.fixture
def tokenizer_default(tokenizer):
    tokenizer.chat_template = None
    assert use_default_chat_template(tokenizer)
    return tokenizer


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return str(path)


def targets_and_context(tokenizer, example) -> tuple[str, str]:
    """The text the loss covers, and the rest (the first token is always context: nothing predicts it)."""
    inputs, labels = example.inputs_and_labels()
    assert len(inputs) == len(labels) == len(example.ids) - 1
    assert np.array_equal(inputs, example.ids[:-1])
    context = np.concatenate([example.ids[:1], example.ids[1:][labels == -100]])
    return tokenizer.decode(labels[labels != -100]), tokenizer.decode(context)


def test_default_template_renders_as_documented(tokenizer_default):
    text = tokenizer_default.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert text == ("<|endoftext|><|system|>\nVocê responde sobre futebol.\n"
                    "<|user|>\nQual foi a melhor classificação do Farense?\n"
                    "<|assistant|>\nO quinto lugar, em 1994-95.<|endoftext|>")
    prompt = tokenizer_default.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nQual foi a melhor classificação do Farense?\n<|assistant|>\n")
    assert tokenizer_default.chat_template == DEFAULT_CHAT_TEMPLATE


@pytest.mark.parametrize("template", ["default", "chatml"])
def test_only_assistant_tokens_are_targets(tmp_path, tokenizer, template):
    tokenizer.chat_template = CHATML if template == "chatml" else DEFAULT_CHAT_TEMPLATE
    end = "<|im_end|>\n" if template == "chatml" else "<|endoftext|>"
    report = inspect_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"messages": CONVERSATION}]), tokenizer, 1024)
    assert report.ok and len(report.examples) == 1
    example = report.examples[0]
    target, context = targets_and_context(tokenizer, example)
    # both answers, each with its end-of-turn token, and nothing else
    assert target == f"O quinto lugar, em 1994-95.{end}No Estádio de São Luís, em Faro.{end}"
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert message["content"] in context
    # the whole sequence decodes to the template's rendering: nothing lost at the pieces' seams
    assert tokenizer.decode(example.ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # at generation time the prompt is exactly the tokens that precede the answer in training
    single = inspect_jsonl(write_jsonl(tmp_path / "u.jsonl", [{"messages": CONVERSATION[1:3]}]), tokenizer, 1024)
    ids, targets = single.examples[0].ids, single.examples[0].targets
    assert encode_prompt(tokenizer, CONVERSATION[1]["content"], "messages") == ids[:int(np.argmax(targets))].tolist()


def test_prompt_completion_and_text_masks(tmp_path, tokenizer_default):
    tok = tokenizer_default
    pc = inspect_jsonl(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Pergunta: quem?", "completion": " O Farense."}]),
                       tok, 1024)
    target, context = targets_and_context(tok, pc.examples[0])
    assert target == " O Farense.<|endoftext|>"
    assert context == "Pergunta: quem?"
    text = inspect_jsonl(write_jsonl(tmp_path / "x.jsonl", [{"text": "O Farense joga em Faro."}]), tok, 1024)
    target, context = targets_and_context(tok, text.examples[0])
    assert context + target == "O Farense joga em Faro.<|endoftext|>"
    assert len(text.examples[0].ids) - 1 == int((text.examples[0].inputs_and_labels()[1] != -100).sum())
    assert pc.schema == "prompt_completion" and text.schema == "text"


def test_a_tokenizer_that_ends_texts_with_eos_itself_gets_one_eos(tmp_path, tokenizer_default):
    """Tokenizers with add_eos_token (a post-processor that appends EOS): a text example and a
    completion end with that one EOS, not two."""
    from tokenizers.processors import TemplateProcessing

    tok = tokenizer_default
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", tok.eos_token_id)])
    assert tok("Faro.")["input_ids"][-1] == tok.eos_token_id
    text = inspect_jsonl(write_jsonl(tmp_path / "x.jsonl", [{"text": "O Farense joga em Faro."}]), tok, 1024)
    assert tok.decode(text.examples[0].ids) == "O Farense joga em Faro.<|endoftext|>"
    pc = inspect_jsonl(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Quem?", "completion": " O Farense."}]), tok, 1024)
    assert targets_and_context(tok, pc.examples[0])[0] == " O Farense.<|endoftext|>"


def test_every_problem_is_reported_with_its_line(tmp_path):
    good = {"messages": CONVERSATION[1:3]}
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(good),  # 1 ok
        '{"messages": [}',  # 2 invalid JSON
        json.dumps({"question": "x", "answer": "y"}),  # 3 unknown schema
        json.dumps({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "a"}]}),  # 4
        json.dumps({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}),  # 5
        json.dumps({"prompt": "p"}),  # 6 no completion
        json.dumps({"text": "um texto"}),  # 7 another format in the same file
        "",  # 8 blank: allowed
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}),  # 9
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(path, "ab") as f:
        f.write(b'{"text": "caf\xe9"}\n')  # 10: Latin-1, not UTF-8
    report = inspect_jsonl(path)
    lines_with_problems = sorted({int(p.split(":")[0].split()[1]) for p in report.problems})
    assert lines_with_problems == [2, 3, 4, 5, 6, 7, 9, 10], report.problems
    text = "\n".join(report.problems)
    for expected in ("line 2: invalid JSON", "line 3: unknown schema", "line 4: message 1 (user) has empty content",
                     "line 5: message 1: role 'assistant' where 'user' was expected",
                     "line 5: the conversation ends with 'user'", "line 6: missing \"completion\"",
                     "line 7: a 'text' example in a file of 'messages' examples", "line 9: message 2 has role 'bot'",
                     "line 10: not valid UTF-8"):
        assert expected in text, expected
    assert len(report.records) == 1

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    assert inspect_jsonl(empty).problems == ["the file is empty"]
    # a JSON array (a .json export): one problem that says so, not "invalid JSON" on every line
    array = tmp_path / "array.jsonl"
    array.write_text(json.dumps([good, good], indent=2), encoding="utf-8")
    assert inspect_jsonl(array).problems == ["the file is one JSON array, not JSON Lines: put each example on a line "
                                             f"of its own (e.g. jq -c '.[]' {array} > {tmp_path / 'array.lines.jsonl'}, "
                                             "then give that file)"]
    array.write_text('[{"text": "um"},\n{"text": "dois"\n', encoding="utf-8")  # not an array after all: line by line
    assert [p.split(":")[0] for p in inspect_jsonl(array).problems] == ["line 1", "line 2"]


def test_a_whole_file_problem_gets_its_own_fix_not_fix_the_lines(tmp_path):
    """An empty file or a JSON array has no line to fix: the fix says what to give instead; a file
    with both kinds of problem (a bad validation file, a bad training file) gets both fixes."""
    empty, array, bad = tmp_path / "empty.jsonl", tmp_path / "array.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("", encoding="utf-8")
    array.write_text('[{"text": "um"}]', encoding="utf-8")
    bad.write_text('{"text": "um"}\n{"text": \n', encoding="utf-8")
    reports = {p.name: inspect_jsonl(p) for p in (empty, array, bad, tmp_path / "missing.jsonl")}
    assert fix_of([reports["empty.jsonl"]], "fix the lines") == (
        'give a file with one example per line, e.g. {"prompt": "...", "completion": "..."} (see README, Data formats)')
    assert fix_of([reports["array.jsonl"]], "fix the lines") == "convert array.jsonl to JSON Lines, one example per line"
    assert fix_of([reports["missing.jsonl"]], "fix the lines") == (
        f"give a readable JSONL file (check {tmp_path / 'missing.jsonl'}'s path and permissions)")
    assert fix_of([reports["bad.jsonl"]], "fix the lines") == "fix the lines"
    assert fix_of([reports["bad.jsonl"], reports["array.jsonl"]], "fix the lines") == (
        "convert array.jsonl to JSON Lines, one example per line; fix the lines")


def test_lines_ended_by_a_carriage_return_alone_are_lines(tmp_path):
    """Classic Mac OS line endings (\r only) are read as lines, as `ptbr prepare` reads them; \r\n
    as well. Before, the whole file was one line of invalid JSON."""
    for ending in ("\r", "\r\n", "\n"):
        path = tmp_path / "cr.jsonl"
        path.write_bytes(ending.join(['{"text": "olá"}', '{"text": "bom dia"}', ""]).encode())
        report = inspect_jsonl(path)
        assert report.problems == [] and [r.value["text"] for r in report.records] == ["olá", "bom dia"], ending
        assert [r.line for r in report.records] == [1, 2]


def test_long_examples_are_truncated_or_dropped_with_a_count(tmp_path, tokenizer_default):
    rows = [{"prompt": "Qual? " * n, "completion": " Sim."} for n in (1, 2, 40, 60)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    truncated = inspect_jsonl(path, tokenizer_default, max_seq_len=30)
    assert len(truncated.examples) == 2  # the two long prompts keep no completion token: dropped, and said so
    assert truncated.too_long == 2
    assert "2 of 4 examples are longer than max_seq_len 30" in truncated.warnings[0]
    assert "lines 3, 4" in truncated.warnings[0] and "truncated" in truncated.warnings[0]
    assert "2 truncated examples kept no target token" in truncated.warnings[1]
    answers = inspect_jsonl(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Q", "completion": " sim" * 40}]),
                            tokenizer_default, max_seq_len=12)
    assert len(answers.examples[0].ids) == 12 and answers.examples[0].targets[-1]  # truncated, kept
    dropped = inspect_jsonl(path, tokenizer_default, max_seq_len=30, drop_long=True)
    assert len(dropped.examples) == 2 and "dropped (--drop-long)" in dropped.warnings[0]


def examples_of(lengths):
    from ptbr.finetune.data import Example

    return [Example(i + 1, np.arange(1, n + 1, dtype=np.int64), np.ones(n, dtype=bool)) for i, n in enumerate(lengths)]


def test_batches_cover_each_epoch_once_and_keep_the_remainder():
    # 11 examples, ids offset by 100 * example so that every row tells which example it is
    from ptbr.finetune.data import Example

    examples = [Example(i + 1, 100 * i + np.arange(3 + i % 5), np.ones(3 + i % 5, dtype=bool)) for i in range(11)]
    source = ChatBatches(examples, batch_size=2, grad_accum=4, seed=7, pad_id=0)
    # ceil(11 / 2) = 6 micro-batches, ceil(6 / 4) = 2 steps: 4 micro-batches, then the remaining 2
    assert (source.micro_batches_per_epoch, source.steps_per_epoch) == (6, 2)
    for epoch in range(3):
        steps = [source.cycle(epoch * 2 + k) for k in range(2)]
        assert [len(s) for s in steps] == [4, 2]
        assert len(steps[1][-1]["input_ids"]) == 1  # the short last micro-batch is applied, not dropped
        rows = [(int(b["input_ids"][i, 0]) // 100, int(b["attention_mask"][i].sum()))
                for s in steps for b in s for i in range(len(b["input_ids"]))]
        assert sorted(rows) == [(i, 2 + i % 5) for i in range(11)]  # every example exactly once, unpadded length
    # a pure function of (seed, step): a fresh source gives the same batches; the next epoch another order
    again = ChatBatches(examples, batch_size=2, grad_accum=4, seed=7, pad_id=0)
    for a, b in zip(source.cycle(2), again.cycle(2), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(source.order(0), source.order(1))


def test_group_by_length_pads_less_covers_each_epoch_once_and_keeps_splits_alike(monkeypatch):
    """--group-by-length: windows of GROUP_WINDOW steps' examples (3 here) sorted by length and cut
    into steps in a random order; every example once per epoch, the short last step last, fewer
    pad tokens than random batches, the same steps for another split of the effective batch, and
    another order each epoch."""
    from ptbr.finetune import batches

    monkeypatch.setattr(batches, "GROUP_WINDOW", 3)
    lengths = [int(n) for n in np.random.default_rng(0).integers(5, 200, size=50)]
    examples = examples_of(lengths)

    def padded(source, epoch):  # pad tokens over the epoch's micro-batches
        steps = [source.cycle(epoch * source.steps_per_epoch + k) for k in range(source.steps_per_epoch)]
        return sum(int((1 - b["attention_mask"]).sum()) for step in steps for b in step)

    grouped = ChatBatches(examples, batch_size=2, grad_accum=2, seed=7, pad_id=0, group_by_length=True)
    plain = ChatBatches(examples, batch_size=2, grad_accum=2, seed=7, pad_id=0)
    assert grouped.steps_per_epoch == plain.steps_per_epoch == 13  # 50 examples, 4 a step
    for epoch in range(2):
        order = grouped.order(epoch)
        assert sorted(order.tolist()) == list(range(50))
        assert padded(grouped, epoch) < padded(plain, epoch) / 2  # 639 against 1,789 in epoch 0
        shuffled = plain.order(epoch)  # each window holds the same examples as the shuffled order's
        for start in range(0, 50, 12):
            assert sorted(order[start:start + 12].tolist()) == sorted(shuffled[start:start + 12].tolist())
            steps = [order[i:i + 4] for i in range(start, min(start + 12, 48), 4)]
            for a in steps:  # a step's examples are consecutive in the window's length order
                window = sorted(shuffled[start:start + 12].tolist(), key=lambda i: -lengths[i])
                ranks = sorted(window.index(int(i)) for i in a)
                assert ranks == list(range(ranks[0], ranks[0] + 4))
        assert len(set(order[48:].tolist())) == 2  # the short last step, last
    assert not np.array_equal(grouped.order(0), grouped.order(1))
    split = ChatBatches(examples, batch_size=4, grad_accum=1, seed=7, pad_id=0, group_by_length=True)
    assert np.array_equal(split.order(0), grouped.order(0))  # 4 x 1 after 2 x 2: the same steps
    # two processes of 1 x 2 each: their slices of every step make the one process's step
    ranks = [ChatBatches(examples, batch_size=1, grad_accum=2, seed=7, pad_id=0, rank=r, world=2,
                         group_by_length=True) for r in range(2)]
    for step in range(grouped.steps_per_epoch + 2):
        together = sorted(e.line for micro in grouped.step_examples(step) for e in micro)
        assert sorted(e.line for r in ranks for micro in r.step_examples(step) for e in micro) == together


def test_collate_pads_right_and_ignores_padding():
    batch = collate(examples_of([4, 2]), pad_id=9)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [1, 9, 9]]
    assert batch["labels"].tolist() == [[2, 3, 4], [2, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert [len(b["input_ids"]) for b in fixed_batches(examples_of([2] * 5), 2, 0)] == [2, 2, 1]


def test_validate_data_cli(tmp_path, capsys):
    from ptbr.cli import main

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATION}, "{oops", {"text": ""}])
    assert main(["validate-data", bad]) == 3
    out, err = capsys.readouterr()
    assert "line 2: invalid JSON" in out and "line 3: \"text\" is empty" in out
    assert err.startswith("error: 3 problems found")  # line 3 is also a text example among messages

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"messages": CONVERSATION}] * 3)
    write_jsonl(data / "valid.jsonl", [{"messages": CONVERSATION[1:3]}])
    assert main(["validate-data", str(data)]) == 0
    out, _ = capsys.readouterr()
    assert "train.jsonl: 3 valid examples (messages)" in out and "valid.jsonl: 1 valid example (messages)" in out

    write_jsonl(data / "valid.jsonl", [{"prompt": "Qual?", "completion": " Sim."}])  # another format than train's
    assert main(["validate-data", str(data)]) == 3
    out, err = capsys.readouterr()
    assert "it holds 'prompt_completion' examples but the training file holds 'messages'" in out
    assert err.rstrip().endswith("fix: give a validation file of 'messages' examples, as the training file holds "
                                 "(or convert valid.jsonl to that format)"), err  # no line of it is wrong

    # the two files named apart: each is a data set of its own (exit 0), and the note says how to
    # check them as `finetune --data TRAIN --valid VALID` does (its verdict: exit 3)
    train, valid = str(data / "train.jsonl"), str(data / "valid.jsonl")
    assert main(["validate-data", train, valid]) == 0
    assert "note: these files hold different formats (messages, prompt_completion)" in capsys.readouterr().out
    assert main(["validate-data", train, valid, "--json"]) == 0  # the note on stderr, the JSON alone on stdout
    out, err = capsys.readouterr()
    assert [r["format"] for r in json.loads(out)] == ["messages", "prompt_completion"]
    assert err.startswith("note: these files hold different formats (messages, prompt_completion)")
    assert main(["validate-data", train, "--valid", valid]) == 3
    assert "it holds 'prompt_completion' examples but the training file holds 'messages'" in capsys.readouterr().out
    assert main(["validate-data", train, train, "--valid", valid]) == 2
    assert "--valid goes with one training file or directory, and 2 were given" in capsys.readouterr().err


def test_a_grouped_run_and_an_ungrouped_one_do_not_resume_each_other():
    """--group-by-length changes which examples each step takes: a checkpoint of one order is not
    resumed by a run of the other, and a run without it resumes checkpoints that never recorded it."""
    from ptbr.runs.common import identity_problems

    plain = {"mode": "finetune", "seed": 0, "effective_batch": 8}
    grouped = plain | {"group_by_length": True}
    assert identity_problems(plain, plain) == [] and identity_problems(grouped, grouped) == []
    assert identity_problems(plain, grouped) == ["group_by_length is False in the checkpoint, True now"]
    assert identity_problems(grouped, plain) == ["group_by_length is True in the checkpoint, False now"]


def test_a_special_tokens_text_inside_an_example_is_said_with_its_lines(tmp_path, tokenizer_default):
    """Written inside an example, a special token's text is encoded as the token itself (as
    Hugging Face's tokenizers, TRL and mlx-lm do: pre-formatted text keeps working), so an HTML
    `</s>` under Mistral's tokenizer ends the sequence mid-answer: a warning names the tokens and
    the lines, in every format."""
    eos = tokenizer_default.eos_token
    rows = [{"text": f"Antes {eos} depois"}, {"text": "limpo"}, {"text": "fim <|im_end|> e " + eos}]
    report = inspect_jsonl(write_jsonl(tmp_path / "t.jsonl", rows), tokenizer_default)
    assert report.warnings == [
        f"2 of 3 examples hold the text of the tokenizer's special tokens ('{eos}', '<|im_end|>'; lines 1, 3): each "
        "is encoded as that token itself, as Hugging Face's tokenizers do (an HTML </s> ends the sequence there); "
        "remove them where they are text, keep them where the examples were formatted with them on purpose"]
    first = report.examples[0].ids.tolist()
    assert first.count(tokenizer_default.eos_token_id) == 2  # its own, mid-text, and the one that ends it
    chat = [{"messages": [{"role": "user", "content": "Oi"}, {"role": "assistant", "content": f"Olá {eos}"}]},
            {"prompt": "P", "completion": "C"}]
    assert "lines 1):" in inspect_jsonl(write_jsonl(tmp_path / "c.jsonl", chat[:1]), tokenizer_default).warnings[0]
    clean = inspect_jsonl(write_jsonl(tmp_path / "p.jsonl", chat[1:] * 2), tokenizer_default)
    assert clean.warnings == [] and len(clean.examples) == 2
    assert "lines 1):" in inspect_jsonl(write_jsonl(tmp_path / "q.jsonl", [{"prompt": eos, "completion": "C"}]),
                                        tokenizer_default).warnings[0]


def test_a_tokenizer_that_adds_an_eos_puts_none_between_prompt_and_completion(tmp_path, tokenizer):
    """A tokenizer with add_eos_token (a Llama/Mistral option) ends every text it encodes with EOS:
    the prompt's went between the prompt and its completion in every training example."""
    import copy

    from tokenizers.processors import TemplateProcessing

    adds = copy.deepcopy(tokenizer)
    eos = adds.eos_token
    adds._tokenizer.post_processor = TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, adds.eos_token_id)])
    assert adds("Qual?")["input_ids"][-1] == adds.eos_token_id  # what it does to any text
    report = inspect_jsonl(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Qual?", "completion": " Sim."}]), adds)
    plain = inspect_jsonl(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "Qual?", "completion": " Sim."}]), tokenizer)
    assert report.examples[0].ids.tolist() == plain.examples[0].ids.tolist()
    assert report.examples[0].ids.tolist().count(adds.eos_token_id) == 1  # the completion's, at the end
    assert encode_prompt(adds, "Qual?", "prompt_completion") == encode_prompt(tokenizer, "Qual?", "prompt_completion")
    from ptbr.commands.generate import prompt_ids

    given = prompt_ids(adds, "Qual?", chat=False)  # what generate gives the model: as training encoded it
    assert given == report.examples[0].ids.tolist()[:len(given)] and adds.eos_token_id not in given
    ended = inspect_jsonl(write_jsonl(tmp_path / "e.jsonl", [{"prompt": f"Qual? {eos}", "completion": " Sim."}]),
                          adds)  # one the user wrote stays (and is warned of)
    assert ended.examples[0].ids.tolist().count(adds.eos_token_id) == 2


def test_a_validation_file_that_is_the_training_file_is_a_warning_everywhere(tmp_path, tokenizer_default):
    """`ptbr finetune` warned of it; validate-data and preflight (one verdict, inspect_pair) did not."""
    from ptbr.finetune.data import inspect_pair

    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"prompt": "Qual?", "completion": " Sim."}] * 2)
    train, valid = inspect_pair(path, tmp_path / "." / "train.jsonl", tokenizer_default)
    assert train.warnings == [] and valid.warnings == [
        "it is the training file: the validation loss will measure memorisation, and the best adapter is the one "
        "that fits the training data best"]
    other = tmp_path / "valid.jsonl"
    write_jsonl(other, [{"prompt": "Qual?", "completion": " Sim."}])
    assert inspect_pair(path, other, tokenizer_default)[1].warnings == []


def test_lines_the_chat_template_rejects_are_not_counted_valid(tmp_path, tokenizer):
    """A template that rejects every conversation: validate-data said '2 valid examples, 0 usable
    (longest 0 tokens)'."""
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{{ raise_exception('no system role') if messages[0]['role'] == 'system' else '' }}x"
    report = inspect_jsonl(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}] * 2
                                       + [{"messages": CONVERSATION[1:3]}]), strict)
    assert (report.rejected, len(report.examples)) == (2, 1)
    assert [p.split(":")[0] for p in report.problems] == ["line 1", "line 2"]
