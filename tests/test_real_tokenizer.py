"""ptbr with a real-world tokenizer: Mistral-7B's SentencePiece model (32,000 tokens, byte fallback,
`▁` word starts), from mistral-common's wheel (locks/test-data.txt). A SentencePiece tokenizer gives a
text tokenized alone a word start, i.e. a space: every piece ptbr tokenizes apart (a completion, a
chat answer, a piece of a long document) must read exactly as in the whole text."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ptbr.commands.generate import cut_at, decode_new, prompt_ids, stop_ids, stop_text
from ptbr.finetune.data import (
    DEFAULT_CHAT_TEMPLATE,
    Record,
    _answers_piece_after_piece,
    encode_record,
    inspect_jsonl,
)

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# prompt, completion: boundaries after a newline, a space, a colon, mid-word; accents, emoji, CJK, tabs
PROMPTS_AND_COMPLETIONS = [
    ("Qual é a capital de Portugal?", " Lisboa."),
    ("Pergunta: Qual é a capital?\nResposta:\n", "Lisboa."),
    ("Pergunta: Qual é a capital?\nResposta:", "Lisboa."),
    ("Traduza: maçã", "\nApple"),
    ("Diga olá", "Olá! 😀 Tudo bem? ação, pão, avó, café, você, à, útil, índio"),
    ("Escreva", "  dois espaços\tum tab"),
    ("日本語", "日本"),
    ("Complete: infor", "mação"),
]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, mistral_tokenizer_model):
    """A folder AutoTokenizer loads as Mistral-7B's tokenizer (converted to a fast one)."""
    folder = tmp_path_factory.mktemp("mistral-tokenizer")
    shutil.copyfile(mistral_tokenizer_model, folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False}))
    return folder


@pytest.fixture
def mistral(mistral_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(mistral_dir)


def test_the_tokenizer_is_mistrals(mistral):
    assert len(mistral) == 32000 and (mistral.bos_token_id, mistral.eos_token_id) == (1, 2)
    assert mistral.convert_ids_to_tokens(mistral("ação", add_special_tokens=False)["input_ids"]) == ["▁a", "ção"]


@pytest.mark.parametrize("prompt, completion", PROMPTS_AND_COMPLETIONS)
def test_a_completion_trains_exactly_its_text_after_the_prompt(mistral, prompt, completion):
    """Tokenized alone, "Lisboa." after "Resposta:\\n" became "▁Lisboa": the model learned a space
    the data does not have (and "infor" + "mação" became "infor mação")."""
    ids, targets = encode_record(mistral, Record(1, "prompt_completion", {"prompt": prompt, "completion": completion}))
    assert ids[0] == mistral.bos_token_id and ids[-1] == mistral.eos_token_id and ids.count(mistral.eos_token_id) == 1
    assert mistral.decode(ids, skip_special_tokens=True) == prompt + completion
    assert ids[:-1] == mistral(prompt + completion)["input_ids"], "the ids of the whole text"
    first = targets.index(True)
    assert not any(targets[:first]) and all(targets[first:])
    # where the prompt ends at a token boundary, its ids are those generate feeds the model
    generated_prompt = prompt_ids(mistral, prompt, chat=False)
    if prompt != "Complete: infor":
        assert ids[:first] == generated_prompt
        assert decode_new(mistral, generated_prompt, ids[first:-1]) == completion
    else:  # "infor" + "mação" is one token "▁inform": it goes to the completion
        assert mistral.convert_ids_to_tokens(ids[first:-1]) == ["▁inform", "ação"]


def test_a_tokenizer_that_adds_eos_itself(mistral_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "eos"
    shutil.copytree(mistral_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_eos_token": True}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for prompt, completion in PROMPTS_AND_COMPLETIONS[:3]:
        ids, targets = encode_record(tokenizer, Record(1, "prompt_completion",
                                                       {"prompt": prompt, "completion": completion}))
        assert ids == tokenizer(prompt + completion)["input_ids"] and ids.count(2) == 1 and ids[-1] == 2
        first = targets.index(True)
        assert not any(targets[:first]) and all(targets[first:])
        assert ids[:first] == prompt_ids(tokenizer, prompt, chat=False)  # no EOS between prompt and completion
        assert decode_new(tokenizer, ids[:first], ids[first:-1]) == completion


@pytest.mark.parametrize("template", ["default", "mistral-inst"])
def test_a_chat_example_is_the_whole_rendered_conversation_and_its_answers_read_exactly(mistral, template):
    """Each piece tokenized alone gave every answer and every turn after one a `▁` (a space) the
    template does not write."""
    mistral.chat_template = DEFAULT_CHAT_TEMPLATE if template == "default" else (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "Qual é a capital de Portugal?"},
                {"role": "assistant", "content": "Lisboa, ação e pão 😀."},
                {"role": "user", "content": "E do Brasil?"},
                {"role": "assistant", "content": "Brasília.\nÉ a capital."}]
    ids, targets = encode_record(mistral, Record(1, "messages", {"messages": messages}))
    rendered = mistral.apply_chat_template(messages, tokenize=False)
    assert ids == mistral(rendered, add_special_tokens=False)["input_ids"]
    answers, current = [], []
    for token, target in zip(ids, targets, strict=True):
        if target:
            current.append(token)
        elif current:
            answers.append(current)
            current = []
    answers.append(current)
    assert [mistral.decode(a) for a in answers] == ["Lisboa, ação e pão 😀.</s>", "Brasília.\nÉ a capital.</s>"]
    first = targets.index(True)
    assert ids[:first] == prompt_ids(mistral, messages[0]["content"], chat=True)
    # the fast tokenizer's offsets and the slow path (piece after piece) find the same tokens
    full = mistral.apply_chat_template(messages, tokenize=False)
    spans = []
    for index in (1, 3):
        before = mistral.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        spans.append((len(before), len(mistral.apply_chat_template(messages[:index + 1], tokenize=False))))
    assert _answers_piece_after_piece(mistral, full, spans) == (ids, targets)


def test_a_template_whose_end_of_turn_is_not_a_token_is_warned_of_and_generation_stops_at_its_text(mistral, tmp_path):
    """ChatML on Mistral's tokenizer (no <|im_end|> token, no EOS in the template): the model learns
    no token to stop at; fine-tuning says so, and generate stops at the text."""
    mistral.chat_template = CHATML
    path = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "Oi"}, {"role": "assistant", "content": "Olá, ação!"}]}
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    report = inspect_jsonl(path, mistral)
    assert report.ok and len(report.examples) == 2
    (warning,) = report.warnings
    assert warning.startswith("2 of 2 chat examples hold an answer that ends without a special token (lines 1, 2): "
                              "the chat template ends a turn with '<|im_end|>', which this tokenizer writes as "
                              "ordinary text")
    assert stop_text(mistral, chat=True) == "<|im_end|>" and stop_ids(mistral, None, chat=True) == {2}
    assert cut_at("Olá, ação!<|im_end|>\n<|im_start|>user", "<|im_end|>") == "Olá, ação!"
    # a template that writes nothing after an answer: nothing to stop at, said so (no "ends a turn with ''")
    mistral.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    (warning,) = inspect_jsonl(path, mistral).warnings
    assert "the chat template writes no end-of-turn marker and no EOS after an answer" in warning
    assert stop_text(mistral, chat=True) is None
    mistral.chat_template = DEFAULT_CHAT_TEMPLATE  # its turns end with EOS: nothing to warn of or cut
    assert inspect_jsonl(path, mistral).warnings == [] and stop_text(mistral, chat=True) is None
    assert stop_text(mistral, chat=False) is None


def test_prepare_keeps_every_document_as_its_whole_tokenization_and_the_trained_model_gets_no_bos(
        mistral, tmp_path, monkeypatch):
    """A document longer than a piece was tokenized piece by piece, each piece gaining a `▁`; and the
    final model's tokenizer added Mistral's <s> to every prompt, a token prepare never wrote."""
    from transformers import AutoTokenizer

    from ptbr.data import corpus
    from ptbr.data.prepare import prepare
    from ptbr.data.tokenizer import save_for_transformers

    mistral.save_pretrained(tmp_path / "fast")
    monkeypatch.setattr(corpus, "MAX_CHUNK_CHARS", 200)
    lines = [f"Linha {n}: a ação e o pão de São João, café à tarde." for n in range(60)]
    documents = ["\n".join(lines), "Outro documento, curto.", "\n".join(lines[:7])]
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    prepare([str(tmp_path / "corpus.txt")], tmp_path / "data", tokenizer_path=str(tmp_path / "fast" / "tokenizer.json"),
            val_fraction=0.0)
    written = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16).tolist()
    expected = [i for d in documents for i in mistral(d, add_special_tokens=False)["input_ids"] + [2]]
    assert written == expected
    save_for_transformers(tmp_path / "data" / "tokenizer.json", tmp_path / "final")
    final = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert prompt_ids(final, "Era uma vez", chat=False) == mistral("Era uma vez", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("trained", [True, False], ids=["byte-level BPE", "Mistral"])
def test_a_line_longer_than_a_piece_is_the_tokens_of_the_whole_text(mistral, tmp_path, monkeypatch, trained):
    """A line longer than a piece was cut where the piece was full, mid-word: its two sides were
    tokenized apart (945,840 tokens for a 3.2M-character line, 945,836 for the whole). Pieces now end
    before a space that follows a word, where neither tokenizer has a token across the cut; spaces
    in runs, a tab, a newline after a full stop or after trailing spaces, accents, emoji and CJK."""
    import random

    from ptbr.data import corpus
    from ptbr.data.prepare import prepare
    from ptbr.data.tokenizer import load_tokenizer

    mistral.save_pretrained(tmp_path / "fast")
    monkeypatch.setattr(corpus, "MAX_CHUNK_CHARS", 100)
    words = ["ação", "pão,", "São", "João", "café.", "à", "tarde;", "informação", "\tdois", " espaços", "😀",
             "日本語", "12345", "(x)", "l'água", "—", "fim.\n", "linha  \n", "'s", "it's"]
    rng = random.Random(0)
    line = " ".join(rng.choice(words) for _ in range(1500))  # 8,019 characters, lines of up to 316
    documents = [line.rstrip("\n"), "Outro documento, curto."]  # (a document ends without its newlines)
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    pieces = [piece for piece, _ in corpus.iter_documents(tmp_path / "corpus.txt")]
    assert len(pieces) == 66 and "".join(pieces) == "".join(documents)
    tokenizer = None if trained else str(tmp_path / "fast" / "tokenizer.json")
    meta = prepare([str(tmp_path / "corpus.txt")], tmp_path / "data", vocab_size=600, tokenizer_path=tokenizer,
                   val_fraction=0.0, show_progress=False)
    written = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16).tolist()
    encoder = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    encoder.encode_special_tokens = True
    whole = [i for d in documents for i in encoder.encode(d, add_special_tokens=False).ids + [meta["eos_id"]]]
    assert written == whole
    if not trained:
        assert whole == [i for d in documents for i in mistral(d, add_special_tokens=False)["input_ids"] + [2]]
