"""`ptbr prepare`, the .bin layouts (ptbr and older), `ptbr info --data`, batch validation."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ptbr.cli import main
from ptbr.data import SAMPLE_DIR
from ptbr.data.prepare import prepare, token_dtype
from ptbr.data.tokenizer import load_tokenizer
from ptbr.data.tokens import RandomWindows, open_dataset
from ptbr.errors import DataError
from ptbr.files import file_sha256


def test_prepare_writes_bins_tokenizer_and_meta(dataset_dir, corpus_dir):
    meta = json.loads((dataset_dir / "meta.json").read_text())
    tokenizer = load_tokenizer(dataset_dir / "tokenizer.json")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tokenizer.get_vocab_size() == 400
    assert meta["tokenizer_sha256"] == file_sha256(dataset_dir / "tokenizer.json")
    train = np.fromfile(dataset_dir / "train.bin", dtype="<u2")
    val = np.fromfile(dataset_dir / "val.bin", dtype="<u2")
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    # 60 paragraphs + 30 jsonl lines, each ended by one eos
    assert meta["train_documents"] + meta["val_documents"] == 90
    assert int((train == meta["eos_id"]).sum()) + int((val == meta["eos_id"]).sum()) == 90
    assert 0.05 < meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) < 0.15
    # the documents decode back to the text, in order
    first = train[: int(np.argmax(train == meta["eos_id"]))]
    assert tokenizer.decode(first.tolist()) == "O sol nasceu devagar sobre a serra, e a cidade acordou com cheiro de café e pão quente. Parágrafo 0."


def test_utf16_without_a_byte_order_mark_is_not_taken_for_text(tmp_path, capsys):
    """UTF-16-LE of ASCII text is valid UTF-8, a NUL after every character: it was tokenized as such."""
    text = tmp_path / "utf16.txt"
    text.write_bytes("Bom dia, mundo.\n\nOutro documento, ação.\n".encode("utf-16-le"))
    assert main(["prepare", "--input", str(text), "--output", str(tmp_path / "out"), "--vocab-size", "300"]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: file is UTF-16LE without a byte-order mark (a NUL byte beside most characters), not UTF-8 ({text}); "
        f"fix: convert it to UTF-8 (e.g. iconv -f UTF-16LE -t UTF-8 {text} > {tmp_path / 'utf16.utf8.txt'}, then give "
        "that file)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("encoding, named", [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16BE"), ("utf-32", "UTF-32"),
                                             ("utf-32-be", "UTF-32")])
def test_utf16_and_utf32_are_named_by_their_byte_order_mark(tmp_path, encoding, named):
    """A byte-order mark tells UTF-16 and UTF-32 apart: "not valid UTF-8 (line 1, byte 0)" said nothing of
    which, nor how to convert it."""
    from ptbr.data.corpus import iter_documents

    text = tmp_path / "texto.jsonl"
    data = '{"text": "Bom dia, ação."}\n'
    mark = {"utf-16-be": b"\xfe\xff", "utf-32-be": b"\x00\x00\xfe\xff"}.get(encoding, b"")  # (Python writes none)
    text.write_bytes(mark + data.encode(encoding))
    with pytest.raises(DataError) as info:
        list(iter_documents(text))
    source = "UTF-32" if named == "UTF-32" else "UTF-16"
    assert info.value.one_line() == (
        f"error: file is {source} (byte-order mark), not UTF-8 ({text}); fix: convert it to UTF-8 (e.g. iconv -f "
        f"{source} -t UTF-8 {text} > {tmp_path / 'texto.utf8.jsonl'}, then give that file)")


def test_a_nul_in_utf8_text_is_located_and_refused_in_both_formats(tmp_path):
    """A stray NUL in UTF-8 text was "UTF-16 without a byte-order mark", whose iconv fix garbles a
    UTF-8 file; in a .jsonl, "\\u0000" went into train.bin."""
    from ptbr.data.corpus import iter_documents

    text = tmp_path / "texto.txt"
    text.write_bytes("Primeira linha, ação.\n\nSegunda\x00 linha.\n".encode())
    with pytest.raises(DataError) as info:
        list(iter_documents(text))
    assert info.value.one_line() == (
        f"error: file holds a NUL character (line 3, byte 32 of the file), which no text holds: the file is refused, "
        f"not cleaned ({text}); fix: remove the NUL characters (e.g. tr -d '\\000' < {text} > "
        f"{tmp_path / 'texto.clean.txt'}, then give that file)")
    lines = tmp_path / "texto.jsonl"
    lines.write_text('{"text": "ok"}\n{"text": "a\\u0000b"}\n')
    with pytest.raises(DataError) as info:
        list(iter_documents(lines))
    assert info.value.one_line() == (
        f'error: "text" holds a NUL character (\\u0000), which no text holds: the line is refused, not cleaned '
        f"({lines}:2); fix: remove the \\u0000 from that line")


def test_a_directory_is_searched_without_its_hidden_files_and_folders(tmp_path):
    from ptbr.data.corpus import find_corpus_files

    for name in ("a.txt", "sub/b.jsonl", ".git/c.txt", ".hidden.txt", "sub/.cache/d.txt", "sub/e.md"):
        (tmp_path / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / name).write_text("texto\n")
    corpus = tmp_path / "corpus"
    assert find_corpus_files([str(corpus)]) == [corpus / "a.txt", corpus / "sub" / "b.jsonl"]
    assert find_corpus_files([str(corpus / ".hidden.txt")]) == [corpus / ".hidden.txt"]  # named: read


def test_a_file_named_twice_is_read_once(tmp_path, dataset_dir, corpus_dir, capsys):
    """Named directly and inside its directory: its documents would be counted twice (and could
    land in train.bin and val.bin both)."""
    twice = tmp_path / "twice"
    prepare([str(corpus_dir), str(corpus_dir / "contos.txt"), str(corpus_dir)], twice, vocab_size=400,
            val_fraction=0.1, show_progress=False)
    assert "warning: --input names 2 file(s) more than once" in capsys.readouterr().err
    assert (twice / "train.bin").read_bytes() == (dataset_dir / "train.bin").read_bytes()


def test_datasets_and_runs_keep_to_their_own_directories(tmp_path, dataset_dir, corpus_dir, capsys):
    """A run into a dataset's directory would write checkpoints among the data (and starting over
    would move files there); a dataset into a run's directory, the same the other way round."""
    assert main(["train", "--output", str(dataset_dir), "--model-size", "tiny", "--max-steps", "1",
                 "--device", "cpu"]) == 6  # the bundled sample as --data, another dataset as --output
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: the output directory holds a dataset (train.bin), not a run ({dataset_dir}); fix: give the run a "
        "directory of its own with --output (e.g. runs/NAME); a dataset is what --data names")
    assert main(["train", "--data", str(dataset_dir), "--output", str(dataset_dir), "--model-size", "tiny",
                 "--max-steps", "1", "--device", "cpu"]) == 6
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --output is the directory of --data {dataset_dir} ({dataset_dir}); fix: give the run a directory "
        "of its own with --output (e.g. runs/NAME)")
    assert sorted(p.name for p in dataset_dir.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    # a folder inside the dataset, or inside the bundled sample (the installed package) that a run without --data uses
    assert main(["train", "--data", str(dataset_dir), "--output", str(dataset_dir / "run"), "--model-size", "tiny",
                 "--max-steps", "1", "--device", "cpu"]) == 6
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --output is inside the directory of --data {dataset_dir} ({dataset_dir / 'run'}); fix: give the run "
        "a directory of its own with --output (e.g. runs/NAME)")
    from ptbr.data import SAMPLE_DIR

    assert main(["train", "--output", str(SAMPLE_DIR / "run"), "--model-size", "tiny", "--max-steps", "1",
                 "--device", "cpu"]) == 6
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --output is inside ptbr's bundled sample dataset, in the installed package ({SAMPLE_DIR / 'run'}); "
        "fix: give the run a directory of its own with --output (e.g. runs/NAME)")
    assert not (dataset_dir / "run").exists() and not (SAMPLE_DIR / "run").exists()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert main(["prepare", "--input", str(corpus_dir), "--output", str(run), "--vocab-size", "400"]) == 6
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: the output directory holds a training run (checkpoints), not a dataset ({run}); fix: give the "
        "dataset a directory of its own with --output (e.g. data/NAME)")
    assert [p.name for p in run.iterdir()] == ["checkpoints"]
    (run / "run_config.json").write_text("{}")  # a folder inside another run (its checkpoints/, plots/)
    assert main(["train", "--output", str(run / "checkpoints"), "--model-size", "tiny", "--max-steps", "1"]) == 6
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: the output directory is inside the run {run.resolve()}, among its files ({run / 'checkpoints'}); "
        "fix: give the run a directory of its own with --output (e.g. runs/NAME)")
    assert [p.name for p in (run / "checkpoints").iterdir()] == []
    corpus = sorted(p.name for p in corpus_dir.iterdir())  # the corpus's own folder, as a folder or a file's
    for given in (corpus_dir, next(corpus_dir.glob("*.txt"))):
        assert main(["prepare", "--input", str(given), "--output", str(corpus_dir), "--vocab-size", "400"]) == 6
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: the output directory is the folder of --input {given}: the dataset would be written among the "
            f"corpus files ({corpus_dir}); fix: give the dataset a directory of its own with --output (e.g. data/NAME)")
    assert sorted(p.name for p in corpus_dir.iterdir()) == corpus


def test_prepare_never_replaces_a_models_or_a_tokenizers_files(tmp_path, corpus_dir, capsys):
    """prepare replaces tokenizer.json in its --output: into a model's folder (a base, a run's final/,
    an adapter) or one inside a run it silently swapped the tokenizer a model was trained with, and
    `ptbr generate` printed nonsense with exit 0."""
    fix = "fix: give the dataset a directory of its own with --output (e.g. data/NAME)"
    base, adapter, tokenizer, run = (tmp_path / name for name in ("base", "adapter", "tok", "run"))
    for folder, files in ((base, ("config.json", "tokenizer.json")), (adapter, ("adapter_config.json",)),
                          (tokenizer, ("tokenizer.json",)), (run / "final", ("config.json", "tokenizer.json"))):
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text(json.dumps({"config.json": {"model_type": "llama"},
                                                   "adapter_config.json": {"peft_type": "LORA"}}.get(name, {})))
    (run / "run_config.json").write_text("{}")
    (run / "plots").mkdir()
    expected = {
        base: "the output directory holds a model (config.json), not a dataset: its tokenizer.json would be replaced",
        adapter: "the output directory holds a model (adapter_config.json), not a dataset: its tokenizer.json would "
                 "be replaced",
        tokenizer: "the output directory holds a tokenizer.json of its own, not a dataset's: it would be replaced",
        run / "final": f"the output directory is inside the training run {run.resolve()}, among its files",
        run / "plots": f"the output directory is inside the training run {run.resolve()}, among its files",
        run / "plots" / "new": f"the output directory is inside the training run {run.resolve()}, among its files",
    }
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for output, why in expected.items():
        assert main(["prepare", "--input", str(corpus_dir), "--output", str(output), "--vocab-size", "400"]) == 6
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"error: {why} ({output}); {fix}"), line
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (run / "plots" / "new").exists() and not list(run.rglob(".ptbr.lock"))
    # a config.json that is no model's (the user's --config file kept beside the data) is no refusal
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"max_steps": 2}')
    assert main(["prepare", "--input", str(corpus_dir), "--output", str(mine), "--vocab-size", "400"]) == 0
    assert (mine / "config.json").read_text() == '{"max_steps": 2}' and (mine / "train.bin").is_file()


def test_prepare_keeps_a_users_dot_files_and_leaves_no_lock(tmp_path, corpus_dir):
    """Only ptbr's own leftovers (.tmp-NAME.ptbr-PID, .old-NAME.ptbr-PID) are removed from an --output that
    already exists: a user's .tmp-notes.txt and .old-photos/ went with them."""
    out = tmp_path / "mine"
    (out / ".old-photos").mkdir(parents=True)
    (out / ".old-photos" / "a.jpg").write_text("p")
    (out / ".tmp-notes.txt").write_text("precious")
    (out / ".tmp-prepare.ptbr-999999").mkdir()  # a prepare cut short
    (out / ".old-meta.json.ptbr-12").write_text("{}")
    (out / ".old-corpus-2023").mkdir()  # the user's, though it looks like an older ptbr's name
    (out / ".tmp-draft-1").write_text("mine")
    (out / ".tmp-prepare-4242").mkdir()  # an older ptbr's, of a name it wrote: cleared too
    prepare([str(corpus_dir)], out, vocab_size=400, val_fraction=0.1, show_progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".old-corpus-2023", ".old-photos", ".tmp-draft-1",
                                                      ".tmp-notes.txt", "meta.json", "tokenizer.json", "train.bin",
                                                      "val.bin"]
    assert (out / ".tmp-notes.txt").read_text() == "precious"


def test_a_second_prepare_into_the_same_output_at_once_is_refused(tmp_path, corpus_dir, dataset_dir, capsys):
    """Two at once: the second deleted the first one's staging folder (exit 1 with a crash report
    inside the dataset), and two swaps could have mixed their files."""
    from ptbr.lock import RunLock

    with RunLock(dataset_dir):  # a prepare, or a run, at work in it
        before = {p.name: p.read_bytes() for p in dataset_dir.iterdir()}
        assert main(["prepare", "--input", str(corpus_dir), "--output", str(dataset_dir), "--vocab-size", "400"]) == 6
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
            f"error: another ptbr run (PID {os.getpid()} on ")
        assert {p.name: p.read_bytes() for p in dataset_dir.iterdir()} == before


def test_a_refused_first_prepare_leaves_none_of_the_folders_it_made(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    assert main(["prepare", "--input", str(bad), "--output", str(tmp_path / "nest" / "a" / "b"),
                 "--vocab-size", "300"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    (tmp_path / "kept").mkdir()  # the user's: stays, empty
    assert main(["prepare", "--input", str(bad), "--output", str(tmp_path / "kept" / "a"), "--vocab-size", "300"]) == 3
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["kept"] and not any((tmp_path / "kept").iterdir())

def test_reusing_a_tokenizer_gives_the_same_tokens(tmp_path, dataset_dir, corpus_dir, capsys):
    again = tmp_path / "again"
    prepare([str(corpus_dir)], again, val_fraction=0.1, tokenizer_path=str(dataset_dir / "tokenizer.json"),
            show_progress=False)
    assert (again / "train.bin").read_bytes() == (dataset_dir / "train.bin").read_bytes()
    assert "--vocab-size" not in capsys.readouterr().err
    prepare([str(corpus_dir)], again, vocab_size=50, val_fraction=0.1,  # below any trainable size: unused here
            tokenizer_path=str(dataset_dir / "tokenizer.json"), show_progress=False)
    assert ("warning: --vocab-size 50 is not used with --tokenizer: the dataset has that tokenizer's vocabulary"
            in capsys.readouterr().err)


def test_the_progress_bars_move_as_one_file_is_read(tmp_path, monkeypatch):
    """A corpus of one 200 MB file sat at 0% for 50 s, then jumped to 100%: the bar moved when a whole
    file was done. And nothing moved for the 70 s the tokenizer trained. Both bars now count the
    bytes of each block read (8 KiB), on a terminal only."""
    import ptbr.data.prepare as prepare_module

    bars = []

    class Bar:
        def __init__(self, total, show, what):
            self.what, self.total, self.updates, self.postfix, self.closed = what, total, [], None, False
            bars.append(self)

        def update(self, count):
            self.updates.append(count)

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def close(self):
            self.closed = True

    monkeypatch.setattr(prepare_module, "_progress", Bar)
    text = tmp_path / "um.txt"
    text.write_text("Um parágrafo de texto, com ação e pão.\n\n" * 30_000)  # 1.3 MB
    prepare([str(text)], tmp_path / "out", vocab_size=300, val_fraction=0.0)
    assert [(bar.what, bar.total, sum(bar.updates), bar.postfix, bar.closed) for bar in bars] == [
        ("training the tokenizer", 1_320_000, 1_320_000, "computing the merges", True),
        ("tokenizing", 1_320_000, 1_320_000, None, True)]
    assert all(len(bar.updates) > 1 for bar in bars)  # the bar moved while the one file was read
    monkeypatch.undo()
    assert prepare_module._progress(1, None, "tokenizing").disable  # (pytest's stderr is no terminal)


def test_token_dtype_switches_to_uint32_past_65535():
    assert token_dtype(65535) == np.dtype("<u2")
    assert token_dtype(65536) == np.dtype("<u4")


def test_long_documents_stream_in_pieces(tmp_path, monkeypatch):
    import ptbr.data.corpus as corpus

    monkeypatch.setattr(corpus, "MAX_CHUNK_CHARS", 100)
    text = tmp_path / "long.txt"
    text.write_text("\n".join(f"linha número {i} de um documento muito comprido" for i in range(50)) + "\n")
    pieces = list(corpus.iter_documents(text))
    assert len(pieces) > 10 and [end for _, end in pieces].count(True) == 1
    meta = prepare([str(text)], tmp_path / "out", vocab_size=300, val_fraction=0.0, show_progress=False)
    assert meta["train_documents"] == 1 and meta["val_tokens"] == 0
    # the pieces' tokens are the whole document's (each piece is encoded after the end of the one before)
    tokenizer = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    whole = tokenizer.encode(text.read_text().rstrip("\n"), add_special_tokens=False).ids + [meta["eos_id"]]
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype="<u2").tolist() == whole


def test_a_file_of_one_huge_line_is_read_a_piece_at_a_time(tmp_path, monkeypatch):
    """A text with no newlines at all (an export, a scrape): read in pieces, never whole; a run of
    spaces inside a long line is not a blank line that ends the document."""
    import ptbr.data.corpus as corpus

    monkeypatch.setattr(corpus, "MAX_CHUNK_CHARS", 20)
    text = tmp_path / "one-line.txt"
    text.write_text("a" * 25 + " " * 20 + "b" * 10 + "\n\n" + "c" * 45)
    # a piece ends before a space that follows a letter (or, without one, where it stands): the
    # spaces go with the next piece, which ends with the text that follows them
    assert list(corpus.iter_documents(text)) == [("a" * 20, False), ("a" * 5, False), (" " * 20 + "b" * 10, False),
                                                 ("", True), ("c" * 20, False), ("c" * 20, False), ("c" * 5, True)]


def test_a_document_that_ends_right_after_a_full_piece_still_ends(tmp_path, monkeypatch, capsys):
    """A document whose last line fills a piece exactly: its end (EOS) must not be lost, or the
    next document (also the next file's) is glued to it. Val takes no more pieces of a long
    document than its share."""
    import ptbr.data.corpus as corpus

    monkeypatch.setattr(corpus, "MAX_CHUNK_CHARS", 20)
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("aaaaaaaaa\nbbbbbbbbb\n\nsegundo doc\n\nccccccccc\nddddddddd\n")  # 2 x 10 characters
    second.write_text("terceiro doc\n")
    # the newline that ends a piece goes with the next one: a document's last newline is cut, as every one's is
    assert list(corpus.iter_documents(first)) == [("aaaaaaaaa\nbbbbbbbbb", False), ("", True),
                                                  ("segundo doc", True), ("ccccccccc\nddddddddd", False), ("", True)]
    meta = prepare([str(first), str(second)], tmp_path / "out", vocab_size=300, val_fraction=0.0, show_progress=False)
    assert meta["train_documents"] == 4
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype="<u2")
    tokenizer = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert int((tokens == meta["eos_id"]).sum()) == 4
    assert tokenizer.decode(tokens.tolist(), skip_special_tokens=False).split("<|endoftext|>") == [
        "aaaaaaaaa\nbbbbbbbbb", "segundo doc", "ccccccccc\nddddddddd", "terceiro doc", ""]
    assert "holds a document of more than 20 characters without a blank line" in capsys.readouterr().err


def test_val_is_a_sample_of_the_documents_not_of_the_short_ones(tmp_path):
    """Long and short documents in turn (chapters and their headings): val must hold both kinds as
    train does, not mostly headings; a document of a single line without blank lines around it
    never pulls a whole file into val."""
    lines = []
    for chapter in range(200):
        lines += [f"Capítulo {chapter}.", "", " ".join(["uma frase comprida do capítulo"] * 30), ""]
    corpus = tmp_path / "livro.txt"
    corpus.write_text("\n".join(lines))
    meta = prepare([str(corpus)], tmp_path / "out", vocab_size=300, val_fraction=0.1, show_progress=False)
    per_document = {split: meta[f"{split}_tokens"] / meta[f"{split}_documents"] for split in ("train", "val")}
    assert 0.8 < per_document["val"] / per_document["train"] < 1.25, (per_document, meta)
    assert 0.08 < meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) < 0.12


def test_a_val_share_far_above_the_fraction_is_a_warning(tmp_path, capsys):
    """Whole documents go to val: of two paragraphs one is val, whatever the fraction asked; prepare
    says so (it said nothing, and the README promised a corpus too small gets no val.bin)."""
    corpus = tmp_path / "small.txt"
    corpus.write_text("Era uma vez um rei.\n\nE uma rainha também, muito sábia.\n")
    meta = prepare([str(corpus)], tmp_path / "out", vocab_size=300, val_fraction=0.005, show_progress=False)
    share = meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"])
    assert meta["val_documents"] == 1 and share > 0.3
    assert (f"warning: val.bin holds {share:.1%} of the tokens, --val-fraction asked 0.005: the corpus has too few "
            "documents (2) for that share") in capsys.readouterr().err
    prepare([str(corpus)], tmp_path / "none", vocab_size=300, val_fraction=0.0, show_progress=False)
    assert "warning: val.bin" not in capsys.readouterr().err


def test_text_that_spells_a_special_token_is_text(tmp_path):
    """A document that mentions "<|endoftext|>" or "<|pad|>" (web text about language models): its
    bytes, not a document boundary or padding in the middle of it."""
    text = tmp_path / "t.txt"
    text.write_text("O marcador <|endoftext|> separa documentos e <|pad|> preenche.\n\nOutro documento.\n\n" * 5)
    meta = prepare([str(text)], tmp_path / "out", vocab_size=300, val_fraction=0.0, show_progress=False)
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype="<u2")
    assert int((tokens == meta["eos_id"]).sum()) == meta["train_documents"] == 10
    assert int((tokens == meta["pad_id"]).sum()) == 0
    decoded = load_tokenizer(tmp_path / "out" / "tokenizer.json").decode(tokens.tolist(), skip_special_tokens=True)
    assert decoded.count("O marcador <|endoftext|> separa documentos e <|pad|> preenche.") == 5


def test_accents_typed_on_a_mac_are_the_same_tokens_and_a_bom_is_not_text(tmp_path):
    """NFD text (macOS: "não" as n, a, combining tilde, o) tokenizes as its NFC form; a UTF-8
    byte-order mark at the start of a file is not part of its first document."""
    import unicodedata

    nfc = "A canção não acabou, coração.\n\nÉ ação e emoção.\n\n"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(nfc * 20)
    (tmp_path / "in" / "b.txt").write_bytes(b"\xef\xbb\xbf" + unicodedata.normalize("NFD", nfc).encode() * 20)
    meta = prepare([str(tmp_path / "in")], tmp_path / "out", vocab_size=320, val_fraction=0.0, show_progress=False)
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype="<u2")
    half = len(tokens) // 2
    assert meta["train_documents"] == 80 and np.array_equal(tokens[:half], tokens[half:])


def test_invalid_utf8_is_located_in_the_file(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(("linha boa\n" * 20_000).encode() + b"caf\xe9\n")  # past the first block text mode decodes
    with pytest.raises(DataError) as info:
        prepare([str(bad)], tmp_path / "out", vocab_size=300, show_progress=False)
    assert "file is not valid UTF-8 (line 20001, byte 200,003 of the file)" in str(info.value)
    # Portuguese text that is not UTF-8 is most often Windows' Latin-1: the fix converts from it
    assert info.value.fix == (f"convert it to UTF-8 (e.g. iconv -f WINDOWS-1252 -t UTF-8 {bad} > "
                              f"{tmp_path / 'bad.utf8.txt'} if it is Windows or Latin-1 text, as `file -i` may "
                              "tell, then give that file)")


def test_prepare_says_it_replaces_a_dataset_and_leaves_no_empty_directory(tmp_path, corpus_dir, capsys):
    """Into an existing dataset: said (its files are replaced when the new one is complete). A first
    prepare that fails leaves no empty directory; an output that is a file is named as one."""
    out = tmp_path / "ds"
    prepare([str(corpus_dir)], out, vocab_size=300, show_progress=False)
    capsys.readouterr()
    prepare([str(corpus_dir)], out, vocab_size=300, show_progress=False)
    assert f"replacing the dataset in {out}" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError):
        prepare([str(empty)], tmp_path / "new", vocab_size=300, show_progress=False)
    assert not (tmp_path / "new").exists()
    assert main(["prepare", "--input", str(corpus_dir), "--output", str(empty)]) == 6
    assert "error: the output path is a file, not a directory" in capsys.readouterr().err


def test_a_file_given_as_the_data_directory_gets_the_fix_for_that_file(tmp_path, dataset_dir):
    with pytest.raises(DataError) as info:
        open_dataset(dataset_dir / "train.bin")
    assert info.value.fix == f"give the directory that holds it: --data {dataset_dir}"
    chat = tmp_path / "train.jsonl"
    chat.write_text('{"text": "oi"}\n')
    with pytest.raises(DataError) as info:
        open_dataset(chat)
    assert info.value.fix.startswith("a .jsonl is fine-tuning data (`ptbr finetune --data`)")


def test_bad_jsonl_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"texto": "sem campo"}\n')
    with pytest.raises(DataError) as info:
        prepare([str(bad)], tmp_path / "out", vocab_size=300, show_progress=False)
    assert info.value.where == f"{bad}:2"


def test_invalid_json_is_told_whole_with_its_column(tmp_path):
    """The line was parsed with its newline ("Invalid control character at", the string cut there) and
    json's message lost its position ("... at (file:6)"); validate-data said "starting at at column"."""
    from ptbr.data.corpus import iter_documents
    from ptbr.finetune.data import inspect_jsonl

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "cortado\n{"text": "a\tb"}\n')
    with pytest.raises(DataError) as info:
        list(iter_documents(bad))
    assert info.value.one_line() == (f"error: line is not valid JSON: Unterminated string starting at column 10 "
                                     f"({bad}:2); fix: fix or remove that line")
    bad.write_text('{"text": "ok"}\n{"text": "a\tb"}\n')
    with pytest.raises(DataError) as info:
        list(iter_documents(bad))
    assert info.value.what == "line is not valid JSON: Invalid control character at column 12"
    bad.write_text('{"prompt": "oi", "completion": "cortado\n{"prompt": "oi", "completion": "a\tb"}\n')
    assert inspect_jsonl(bad).problems == ["line 1: invalid JSON: Unterminated string starting at column 32",
                                           "line 2: invalid JSON: Invalid control character at column 34"]


def test_the_bundled_sample_is_what_prepare_makes_of_its_text(tmp_path):
    meta = prepare([str(SAMPLE_DIR / "sample_ptbr.txt")], tmp_path / "s", vocab_size=2048, val_fraction=0.1,
                   show_progress=False)
    assert (tmp_path / "s" / "tokenizer.json").read_bytes() == (SAMPLE_DIR / "tokenizer.json").read_bytes()
    assert (tmp_path / "s" / "train.bin").read_bytes() == (SAMPLE_DIR / "train.bin").read_bytes()
    assert (tmp_path / "s" / "val.bin").read_bytes() == (SAMPLE_DIR / "val.bin").read_bytes()
    assert meta["train_tokens"] == 12879 and meta["val_tokens"] == 1421


def make_old_layout(tmp_path, dataset_dir):
    """The layout of the tool ptbr replaces: raw uint16 train.bin, no meta.json, tokenizer elsewhere."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "train.bin").write_bytes((dataset_dir / "train.bin").read_bytes())
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_bytes((dataset_dir / "tokenizer.json").read_bytes())
    return old, tokenizer


def test_older_layout_is_accepted_with_a_tokenizer(tmp_path, dataset_dir, capsys):
    old, tokenizer = make_old_layout(tmp_path, dataset_dir)
    dataset = open_dataset(old, tokenizer)
    assert dataset.dtype == np.dtype("<u2") and dataset.val is None and dataset.meta is None
    assert main(["info", "--data", str(old), "--tokenizer", str(tokenizer), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["data"]
    assert info["layout"] == "older (no meta.json)"
    assert info["train_tokens"] == len(np.fromfile(old / "train.bin", dtype="<u2"))
    assert info["train_max_id"] < 400


def test_older_layout_without_a_tokenizer_says_so(tmp_path, dataset_dir):
    old, _ = make_old_layout(tmp_path, dataset_dir)
    with pytest.raises(DataError, match="no tokenizer.json file in the data directory") as caught:
        open_dataset(old)
    assert "--tokenizer FILE" in caught.value.fix


def test_odd_byte_count_and_ids_beyond_vocab(tmp_path, dataset_dir):
    old, tokenizer = make_old_layout(tmp_path, dataset_dir)
    with open(old / "train.bin", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError, match="not a multiple of 2"):
        open_dataset(old, tokenizer)
    (old / "train.bin").write_bytes(np.array([5, 7, 60000, 9], dtype="<u2").tobytes())
    with pytest.raises(DataError, match="token id 60000 >= vocab size 400"):
        open_dataset(old, tokenizer)


def test_meta_that_disagrees_with_the_tokenizer(tmp_path, dataset_dir):
    meta = json.loads((dataset_dir / "meta.json").read_text())
    meta["tokenizer_sha256"] = "0" * 64
    (dataset_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="different tokenizer"):
        open_dataset(dataset_dir)


def test_every_batch_is_checked_and_a_bad_id_is_located(tmp_path):
    tokens = np.arange(100, dtype="<u2") % 50
    tokens[37] = 999
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    windows = RandomWindows(np.memmap(path, dtype="<u2", mode="r"), path, batch_size=50, seq_len=8,
                            vocab_size=50, seed=0)
    with pytest.raises(DataError) as info:
        windows.batch(0)
    assert "token id 999 >= vocab size 50" in info.value.what
    assert info.value.where == f"{path} at token offset 37 (byte 74)"


def test_batches_are_a_pure_function_of_seed_and_index(dataset_dir):
    dataset = open_dataset(dataset_dir)
    a = RandomWindows(dataset.train, dataset.train_path, 4, 16, dataset.vocab_size, seed=0)
    b = RandomWindows(dataset.train, dataset.train_path, 4, 16, dataset.vocab_size, seed=0)
    assert np.array_equal(a.batch(7), b.batch(7))
    assert not np.array_equal(a.batch(7), a.batch(8))
    assert a.batch(0).shape == (4, 17) and a.batch(0).dtype == np.int64


def test_info_on_the_bundled_sample(capsys):
    assert main(["info", "--data", str(SAMPLE_DIR)]) == 0
    out = capsys.readouterr().out
    assert "12,879 tokens, 25,758 bytes" in out and "max id 2,047" in out


def test_info_model_size(capsys):
    assert main(["info", "--model-size", "400m", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["parameters"] == 392_487_936
    memory = model["memory_bytes"]["fp32"]
    assert memory["weights"] == memory["gradients"] == 4 * 392_487_936
    assert memory["optimizer"] == 8 * 392_487_936
    assert memory["total"] > memory["weights"] + memory["gradients"] + memory["optimizer"]
    # the MLX row is the estimate the run records: under accumulation it holds the summed gradients too
    from ptbr.config import get_preset
    from ptbr.memory import Architecture, estimate_mlx_memory

    assert main(["info", "--model-size", "tiny", "--batch-size", "2", "--grad-accum", "2", "--seq-len", "128",
                 "--json"]) == 0
    mlx = json.loads(capsys.readouterr().out)["model"]["memory_bytes"]["mlx-bf16"]
    arch = Architecture.from_preset(get_preset("tiny"), 32000)
    assert mlx == estimate_mlx_memory(arch, 2, 128, "bf16", grad_accum=2).as_dict()
    assert mlx["total"] > estimate_mlx_memory(arch, 2, 128, "bf16").total  # (info said this)


def test_a_corpus_of_one_document_is_told_why_it_has_no_validation(tmp_path, capsys):
    """The first document always trains and the second goes to val.bin: only a corpus of one
    document gets none, and raising --val-fraction (what the warning said) cannot help it."""
    one = tmp_path / "one.txt"
    one.write_text("Um só documento, sem linhas em branco.\nOutra linha do mesmo.\n")
    meta = prepare([str(one)], tmp_path / "out", vocab_size=300, val_fraction=0.5, show_progress=False)
    assert (meta["train_documents"], meta["val_tokens"]) == (1, 0) and not (tmp_path / "out" / "val.bin").exists()
    assert ("warning: the corpus is one document, and the first one always trains: no val.bin written, training will "
            "not evaluate (separate its documents with blank lines, or add text)") in capsys.readouterr().err
    two = tmp_path / "two.txt"
    two.write_text("Primeiro documento.\n\nSegundo documento.\n")
    meta = prepare([str(two)], tmp_path / "out2", vocab_size=300, val_fraction=0.001, show_progress=False)
    assert (meta["train_documents"], meta["val_documents"]) == (1, 1)
    assert "one document" not in capsys.readouterr().err


def test_tokenizer_training_is_stopped_at_once_by_ctrl_c():
    """tokenizers computes its merges in Rust, which does not return to Python until done: a Ctrl-C
    during that phase waited for the whole training (13-16 s on a 42 MB corpus, minutes on more).
    The training runs in a thread of its own, and the main thread's wait is what the signal ends."""
    import _thread
    import threading
    import time

    from ptbr.data.tokenizer import _interruptible

    seen, release, stop = {}, threading.Event(), threading.Event()

    def work():  # stands for Rust's merge loop: blind to signals, in a thread that is not the main one
        seen["main"] = threading.current_thread() is threading.main_thread()
        release.wait(30)

    threading.Timer(0.3, _thread.interrupt_main).start()  # a SIGINT, as Ctrl-C delivers it
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _interruptible(work, stop)
    assert time.monotonic() - started < 5 and seen == {"main": False}
    assert stop.is_set()  # the reading of texts ends at its next one
    release.set()

    def fails():
        raise DataError("bad text", "corpus.txt", "fix it")

    with pytest.raises(DataError, match="bad text"):  # an error of the training (a bad file) is the caller's
        _interruptible(fails, threading.Event())


def test_ctrl_c_during_a_real_tokenizer_training_is_exit_130_at_once(tmp_path):
    """The real thing: SIGINT while `ptbr prepare` trains its tokenizer on a 24 MB corpus ends it
    within seconds with exit 130 and its line, never by SIGABRT from the training thread that the
    interpreter's teardown would end inside Rust."""
    import random
    import signal
    import subprocess
    import sys
    import time

    words = [f"palavra{i}ção" for i in range(20000)]
    rng = random.Random(0)
    corpus = tmp_path / "big.txt"
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(40000):
            f.write(" ".join(rng.choices(words, k=50)) + "\n\n")
    process = subprocess.Popen([sys.executable, "-m", "ptbr", "prepare", "--input", str(corpus), "--output",
                                str(tmp_path / "out"), "--vocab-size", "8000"], stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if line.startswith("training a byte-level BPE tokenizer"):
            break
    time.sleep(0.5)
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    err = process.stderr.read()
    process.wait(timeout=60)
    assert process.returncode == 130, err[-2000:]
    assert time.monotonic() - sent < 5 and err.strip().splitlines()[-1].startswith(
        "error: stopped by SIGINT (ptbr prepare)")
    assert not (tmp_path / "out").exists()


def test_an_output_prepare_cannot_write_in_is_exit_6(tmp_path, corpus_dir, capsys, monkeypatch):
    """The lock is prepare's first write there: a PermissionError escaped it as a crash (exit 1)."""
    import ptbr.lock

    real = os.open

    def refused(path, flags, *args):
        if str(path).endswith(".ptbr.lock"):
            raise PermissionError(13, "Permission denied")
        return real(path, flags, *args)

    monkeypatch.setattr(ptbr.lock.os, "open", refused)
    out = tmp_path / "ro"
    out.mkdir()
    assert main(["prepare", "--input", str(corpus_dir), "--output", str(out), "--vocab-size", "400"]) == 6
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: cannot write in the output directory: Permission denied ({out}); fix: choose a path you can write to "
        "with --output")


def test_a_folder_of_sharded_bin_weights_is_a_model_s_not_a_run_s(tmp_path):
    from ptbr.outputs import folder_refusal

    (tmp_path / "pytorch_model-00001-of-00002.bin").write_bytes(b"")
    (tmp_path / "pytorch_model.bin.index.json").write_text("{}")
    assert folder_refusal(tmp_path)[0] == "the output directory holds a model (pytorch_model.bin.index.json), not a run"
    (tmp_path / "pytorch_model.bin.index.json").unlink()
    (tmp_path / "config.json").write_text('{"max_steps": 2}')  # a user's --config file kept there: a run's folder
    assert folder_refusal(tmp_path) is None
