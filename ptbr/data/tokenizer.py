"""Byte-level BPE tokenizers: training with `tokenizers`, loading with clear errors, hashing."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from ptbr.errors import DataError
from ptbr.files import unreadable, unreadable_fix

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
    """Train a byte-level BPE tokenizer (GPT-2 style: no unknown tokens, any UTF-8 text round-trips),
    normalising text to NFC first: "não" typed on macOS (NFD: a, then a combining tilde) is then
    the same tokens as everywhere else, not five rarer ones."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    import threading

    stop = threading.Event()

    def feed() -> Iterator[str]:
        for text in texts:
            if stop.is_set():  # stopped: the reading ends here, and the thread with it soon after
                return
            yield text

    _interruptible(lambda: tokenizer.train_from_iterator(feed(), trainer=trainer), stop)
    return tokenizer


# threads running native code that cannot be joined at will: the CLI ends the process without the
# interpreter's teardown while one lives (ptbr/cli.py command), where Python would end the thread
# inside Rust and abort (SIGABRT, "exception not rethrown")
NATIVE_THREAD_PREFIX = "ptbr-native-"


def _interruptible(work, stop) -> None:
    """Run `work` in a thread of its own while this one waits: tokenizers' training computes its
    merges in Rust, which never returns to Python until done, so a Ctrl-C or SIGTERM (raised in
    the main thread) waited for the whole training, minutes on a large corpus. The wait here is
    interrupted at once and sets `stop` (the reading of texts ends); the thread is a daemon."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"{NATIVE_THREAD_PREFIX}tokenizer-training", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
    except BaseException:
        stop.set()
        raise
    if "error" in outcome:
        raise outcome["error"]


def load_tokenizer(path: str | Path):
    """Load a tokenizer.json; a missing or corrupt file is a DataError naming it."""
    from tokenizers import Tokenizer

    path = Path(path)
    fix = "give a tokenizer.json (the one `ptbr prepare` wrote, or a Hugging Face model's)"
    if not path.is_file():
        if path.is_dir() and (path / "tokenizer.json").is_file():  # a model's or a dataset's folder
            fix = f"give the file in it: --tokenizer {path / 'tokenizer.json'}"
        what = "is a directory, not a tokenizer.json" if path.is_dir() else "not found"
        raise DataError(f"tokenizer {what}: {path}", "--tokenizer", fix)
    if unreadable([path]):
        raise DataError(f"cannot read the tokenizer: permission denied: {path}", "--tokenizer", unreadable_fix())
    with open(path, "rb") as f:
        first = f.read(1)
    if path.suffix == ".model" or (first and first not in b"{ \n\t\r\xef"):  # JSON starts with {, space or a BOM
        # SentencePiece's tokenizer.model (a protobuf): a format of its own, not a broken tokenizer.json
        raise DataError("not a tokenizer.json (a SentencePiece tokenizer.model or another format): --tokenizer takes "
                        "the tokenizers library's JSON", str(path),
                        "convert it: AutoTokenizer.from_pretrained(FOLDER).save_pretrained(OUT) writes OUT/tokenizer.json "
                        "(FOLDER holding tokenizer.model and its tokenizer_config.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
        reason = str(exc).splitlines()[0][:200]
        raise DataError(f"tokenizer.json is corrupt or not a tokenizer: {reason}", str(path),
                        "re-create it with `ptbr prepare` or copy the original file again") from exc


def eos_id(tokenizer, where: str | Path = "tokenizer.json") -> int:
    """The id that separates documents: <|endoftext|>, or the tokenizer's own </s>-like token."""
    for token in (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>"):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError("the tokenizer has no end-of-text token", str(where),
                    f"use a tokenizer with {EOS_TOKEN} (as `ptbr prepare` trains)")


def save_for_transformers(tokenizer_path: str | Path, directory: str | Path) -> None:
    """Write the tokenizer so that `AutoTokenizer.from_pretrained(directory)` loads it without ptbr."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = load_tokenizer(tokenizer_path)
    # `ptbr prepare` encodes without the tokenizer's post-processor: documents are their text's
    # tokens, each followed by EOS. A tokenizer.json that adds a BOS (Llama's, Mistral's <s>) would
    # start every prompt of the trained model with a token it never saw.
    tokenizer.post_processor = None
    eos = tokenizer.id_to_token(eos_id(tokenizer))
    pad = PAD_TOKEN if tokenizer.token_to_id(PAD_TOKEN) is not None else eos
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos, pad_token=pad)
    fast.save_pretrained(str(directory))
