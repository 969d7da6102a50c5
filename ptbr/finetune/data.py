"""Chat/instruction JSONL: every line checked (problems collected with line numbers), then encoded
into token ids with a mask of the tokens the loss covers.

Three formats, one per file:
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
      rendered with the tokenizer's chat template (DEFAULT_CHAT_TEMPLATE when it has none);
      the loss covers the assistant turns only, their end-of-turn token included.
  {"prompt": "...", "completion": "..."}
      prompt, then completion + EOS; the loss covers the completion and the EOS.
  {"text": "..."}
      text + EOS; the loss covers every token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ptbr.data.batch import IGNORE_INDEX
from ptbr.data.corpus import json_problem
from ptbr.errors import DataError
from ptbr.log import log

ROLES = ("system", "user", "assistant")
SCHEMAS = ("messages", "prompt_completion", "text")

# Used when the base tokenizer has no chat template; saved with the adapter, so that generation
# renders prompts exactly as training did. A conversation becomes
#   {bos}<|system|>\n{system}\n<|user|>\n{question}\n<|assistant|>\n{answer}{eos}<|user|>\n...
# ({bos} only if the tokenizer has one); the loss covers "{answer}{eos}".
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}{{ eos_token }}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# How many problems a DataError's one line lists before pointing to `ptbr validate-data`.
PROBLEMS_IN_ERROR = 10
EMPTY_FILE_FIX = ('give a file with one example per line, e.g. {"prompt": "...", "completion": "..."} '
                  "(see README, Data formats)")
LINES_IN_WARNING = 10


@dataclass
class Record:
    line: int  # 1-based line number in the file
    schema: str
    value: dict


@dataclass
class Example:
    """One encoded example: ids (L,) and targets (L,), True where the token is one the model learns
    to predict. The first token is never predicted (nothing precedes it)."""

    line: int
    ids: np.ndarray
    targets: np.ndarray

    def inputs_and_labels(self) -> tuple[np.ndarray, np.ndarray]:
        """Aligned like pretraining's windows: labels[t] is the target of position t."""
        return self.ids[:-1], np.where(self.targets[1:], self.ids[1:], IGNORE_INDEX)


@dataclass
class JsonlReport:
    """What checking one JSONL file found. Examples are encoded only when a tokenizer was given."""

    path: Path
    schema: str | None = None
    records: list[Record] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)
    longest: int = 0  # tokens of the longest example before truncation
    too_long: int = 0  # examples longer than max_seq_len
    rejected: int = 0  # valid lines the chat template cannot render
    # problems which no edit of a line fixes (fix_of): nothing left within max_seq_len, examples
    # beyond the base's positions (how many it has), a validation file in another format than the
    # training file's (that format)
    nothing_left: bool = False
    beyond_positions: int | None = None
    training_format: str | None = None
    # a problem of the whole file (unreadable, empty, a JSON array): its fix, not "fix the lines"
    file_fix: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------------------------


def check_record(value) -> tuple[str | None, list[str]]:
    """The record's schema and every problem with it."""
    if not isinstance(value, dict):
        return None, [f"expected a JSON object, got {type(value).__name__}"]
    kinds = [kind for kind, keys in (("messages", ("messages",)), ("prompt/completion", ("prompt", "completion")),
                                      ("text", ("text",))) if any(k in value for k in keys)]
    if len(kinds) > 1:
        return None, [f"holds the keys of several formats ({' and '.join(kinds)}); use one format per line"]
    if "messages" in value:
        return "messages", _check_messages(value["messages"])
    if "prompt" in value or "completion" in value:
        return "prompt_completion", [p for key in ("prompt", "completion") for p in _check_text(value, key)]
    if "text" in value:
        return "text", _check_text(value, "text")
    keys = ", ".join(sorted(value)) or "none"
    return None, [f"unknown schema (keys: {keys}); expected \"messages\", \"prompt\" + \"completion\", or \"text\""]


def _check_text(value: dict, key: str) -> list[str]:
    if key not in value:
        return [f"missing \"{key}\""]
    text = value[key]
    if not isinstance(text, str):
        return [f"\"{key}\" must be a string, got {type(text).__name__}"]
    if not text.strip():
        return [f"\"{key}\" is empty"]
    if not valid_unicode(text):
        return [f"\"{key}\" holds invalid Unicode (an unpaired surrogate escape such as \\ud800)"]
    return []


def valid_unicode(text: str) -> bool:
    """JSON can escape half a UTF-16 pair ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_messages(messages) -> list[str]:
    if not isinstance(messages, list) or not messages:
        return ["\"messages\" must be a non-empty list of {\"role\", \"content\"} objects"]
    found = []
    roles = []
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            found.append(f"message {number} is not an object")
            roles.append(None)
            continue
        role = message.get("role")
        if role not in ROLES:
            found.append(f"message {number} has role {role!r}; expected one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            found.append(f"message {number} ({role}) has no text \"content\"")
        elif not content.strip():
            found.append(f"message {number} ({role}) has empty content")
        elif not valid_unicode(content):
            found.append(f"message {number} ({role}) holds invalid Unicode (an unpaired surrogate escape such as "
                         "\\ud800)")
        roles.append(role)
    # an optional system message first, then user and assistant alternating, starting with user
    turn = 0
    for number, role in enumerate(roles, 1):
        if role == "system":
            if number > 1:
                found.append(f"message {number}: a system message may only come first")
            continue
        expected = "user" if turn % 2 == 0 else "assistant"
        turn += 1
        if role in ROLES and role != expected:
            found.append(f"message {number}: role {role!r} where {expected!r} was expected "
                         "(system first, then user and assistant alternating)")
    if roles[-1] != "assistant":
        found.append(f"the conversation ends with {roles[-1]!r}; the last message must be the assistant's answer")
    return found


def _json_array(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), list)
    except ValueError:  # (UnicodeDecodeError too): left to the line-by-line checks
        return False


def inspect_jsonl(path: str | Path, tokenizer=None, max_seq_len: int | None = None,
                  drop_long: bool = False) -> JsonlReport:
    """Check every line of a JSONL file; with a tokenizer also encode each example and apply the
    length policy (truncate, or drop with drop_long). Never raises for the file's content."""
    report = JsonlReport(Path(path))
    try:
        raw = report.path.read_bytes()
    except OSError as exc:
        report.problems.append(f"cannot read the file: {exc.strerror or exc}")
        report.file_fix = f"give a readable JSONL file (check {report.path}'s path and permissions)"
        return report
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as some Windows editors write
    if not raw.strip():
        report.problems.append("the file is empty")
        report.file_fix = EMPTY_FILE_FIX
        return report
    if raw.lstrip().startswith(b"[") and _json_array(raw):  # a .json export: every line would be "invalid JSON"
        lines = report.path.with_name(f"{report.path.stem}.lines.jsonl")  # (never the file itself: `>` empties it)
        report.problems.append("the file is one JSON array, not JSON Lines: put each example on a line of its own "
                               f"(e.g. jq -c '.[]' {report.path} > {lines}, then give that file)")
        report.file_fix = f"convert {report.path.name} to JSON Lines, one example per line"
        return report
    first_schema_line = None
    # Lines end in \n or \r\n (JSON ignores the \r); a file with only \r (classic Mac OS) ends them in \r.
    for number, line in enumerate(raw.split(b"\n" if b"\n" in raw else b"\r"), 1):
        if not line.strip():
            continue  # blank lines (a trailing newline, spacing) carry no example
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            report.problems.append(f"line {number}: not valid UTF-8 (byte {exc.start + 1}); save the file as UTF-8")
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            report.problems.append(f"line {number}: invalid JSON: {json_problem(exc)}")
            continue
        schema, issues = check_record(value)
        report.problems.extend(f"line {number}: {issue}" for issue in issues)
        if schema is None:
            continue
        if report.schema is None:
            report.schema, first_schema_line = schema, number
        elif schema != report.schema:
            report.problems.append(f"line {number}: a {schema!r} example in a file of {report.schema!r} examples "
                                   f"(line {first_schema_line}); use one format per file")
            continue
        if not issues:
            report.records.append(Record(number, schema, value))
    if not report.records and not report.problems:
        report.problems.append("no examples in the file")
        report.file_fix = EMPTY_FILE_FIX
    if tokenizer is not None:
        _encode_all(report, tokenizer, max_seq_len, drop_long)
    return report


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


class TemplateProblem(ValueError):
    """The chat template cannot render a conversation, or not in a way the turns can be found."""


def use_default_chat_template(tokenizer) -> bool:
    """Give a tokenizer without a chat template the documented default, saying so once; True if it
    was needed. Only chat examples and their prompts need one: prompt/completion and text data keep
    the tokenizer as it is (and its adapter folder gets no template that would call it a chat model)."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    log("the tokenizer has no chat template: chat examples use ptbr's default (see README, Fine-tuning)")
    return True


def encode_record(tokenizer, record: Record) -> tuple[list[int], list[bool]]:
    """Token ids of one example and, per token, whether the loss covers it."""
    value = record.value
    eos = tokenizer.eos_token_id
    if record.schema == "messages":
        return _encode_messages(tokenizer, value["messages"])
    if record.schema == "prompt_completion":
        # The completion is tokenized as the prompt's continuation, never alone: a SentencePiece
        # tokenizer (Llama, Mistral) starts a text tokenized alone with a word start (`▁`), a space
        # the completion does not have ("Resposta:\n" + "Lisboa" trained as "Resposta:\n Lisboa").
        prompt = _prompt_ids(tokenizer, value["prompt"])
        joint = _prompt_ids(tokenizer, value["prompt"] + value["completion"])
        kept = _shared_start(prompt, joint)
        completion = _ended(joint[kept:], eos)
        return joint[:kept] + completion, [False] * kept + [True] * len(completion)
    ids = _ended(_ids(tokenizer, value["text"], special=True), eos)
    return ids, [True] * len(ids)


def _shared_start(a: list[int], b: list[int]) -> int:
    """How many ids `a` and `b` start with in common: where a prompt ends at a token boundary, all of
    the prompt's; where its last token merges with the text after it (a prompt ending mid-word), the
    merged token goes to what follows."""
    kept = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        kept += 1
    return kept


def _ended(ids: list[int], eos: int) -> list[int]:
    """`ids` ending with one EOS: the tokenizer's own where it adds one (add_eos_token), else ours."""
    return ids if ids and ids[-1] == eos else ids + [eos]


def encode_prompt(tokenizer, prompt: str, schema: str | None) -> list[int]:
    """The ids a trained model should continue from, encoded as its training examples were."""
    if schema == "messages":
        use_default_chat_template(tokenizer)
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return _ids(tokenizer, text)
    return _prompt_ids(tokenizer, prompt)


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    # special=True adds what the tokenizer puts around a text by itself (e.g. Mistral's <s>)
    return list(tokenizer(text, add_special_tokens=special)["input_ids"]) if text else []


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the start of a sequence: with what the tokenizer puts before a text (a BOS), not
    the EOS one that adds an EOS too (add_eos_token) would put after it, where the completion goes."""
    ids = _ids(tokenizer, prompt, special=True)
    eos = tokenizer.eos_token_id
    if eos is not None and ids and ids[-1] == eos:
        plain = _ids(tokenizer, prompt)
        if len(ids) > len(plain) and ids[len(ids) - 1 - len(plain):-1] == plain:  # added after the text
            ids = ids[:-1]
    return ids


def _encode_messages(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Render with the chat template, find each assistant turn as the text between the prompt
    rendered up to it (with the generation prompt) and the conversation rendered through it, and
    tokenize the conversation piece after piece, each as the continuation of the text before it
    (never alone: a SentencePiece tokenizer would start each piece with a word-start `▁`, a space
    the template does not write). The ids are those of the whole rendered conversation; where a
    prompt ends at a token boundary (templates end it with a marker or a newline) its ids are
    exactly those the prompt alone gets at generation time."""
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    use_default_chat_template(tokenizer)

    def render(turns: list[dict], generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja raises its own errors (e.g. raise_exception)
            raise TemplateProblem(f"the chat template rejects this conversation: {str(exc).splitlines()[0]}") from exc

    full = render(messages, False)
    spans, done = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:index], True), render(messages[:index + 1], False)
        if not (full.startswith(through) and through.startswith(before) and len(before) >= done):
            raise TemplateProblem("the chat template renders earlier turns differently when later ones follow, "
                                  "so the assistant's tokens cannot be located; use prompt/completion instead")
        spans.append((len(before), len(through)))
        done = len(through)
    if getattr(tokenizer, "is_fast", False):
        return _answers_by_offsets(tokenizer, full, spans)
    return _answers_piece_after_piece(tokenizer, full, spans)


def _answers_by_offsets(tokenizer, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """A fast tokenizer: the conversation tokenized once; a token is a target where its characters
    reach into an answer's span (one that spans a prompt's end and an answer's start goes to the
    answer, as piece after piece does)."""
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    targets, span = [], 0  # tokens and spans both go left to right: one pass
    for start, end in encoded["offset_mapping"]:
        while span < len(spans) and spans[span][1] <= start:  # spans that end before this token starts
            span += 1
        targets.append(span < len(spans) and end > spans[span][0] and start < spans[span][1])
    return ids, targets


def _answers_piece_after_piece(tokenizer, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """A slow tokenizer (no offsets): the text up to each prompt's and each answer's end tokenized
    in turn; the tokens beyond what the text before it gave are that piece's."""
    ids: list[int] = []
    targets: list[bool] = []
    cuts = [cut for start, end in spans for cut in ((start, False), (end, True))] + [(len(full), False)]
    for cut, is_target in cuts:  # the text up to `cut` ends a prompt (False) or an answer (True)
        now = _ids(tokenizer, full[:cut])
        kept = _shared_start(ids, now)
        ids, targets = now, targets[:kept] + [is_target] * (len(now) - kept)
    return ids, targets


def _written_texts(record: Record) -> list[str]:
    value = record.value
    if record.schema == "messages":
        return [m["content"] for m in value["messages"]]
    if record.schema == "prompt_completion":
        return [value["prompt"], value["completion"]]
    return [value["text"]]


def _warn_of_written_special_tokens(report: JsonlReport, tokenizer) -> None:
    """A special token's text inside an example (Mistral's `<s>`/`</s>` are HTML's strikethrough
    tags) is encoded as the token itself, as Hugging Face's tokenizers, TRL and mlx-lm do: that is
    what lets text pre-formatted with `<s>[INST] ... [/INST] ...</s>` train as meant, and what makes
    a web page's `</s>` an end of sequence in the middle of an answer. Said, with the lines."""
    specials = [token for token in getattr(tokenizer, "all_special_tokens", []) or [] if token]
    found: dict[str, int] = {}
    lines = []
    for record in report.records:
        texts = _written_texts(record)
        here = [token for token in specials if any(token in text for text in texts)]
        if here:
            lines.append(record.line)
            for token in here:
                found[token] = found.get(token, 0) + 1
    if lines:
        report.warnings.append(
            f"{len(lines)} of {len(report.records)} examples hold the text of the tokenizer's special tokens "
            f"({', '.join(repr(t) for t in found)}; lines {_lines(lines)}): each is encoded as that token itself, "
            "as Hugging Face's tokenizers do (an HTML </s> ends the sequence there); remove them where they are "
            "text, keep them where the examples were formatted with them on purpose")


def end_of_turn(tokenizer) -> str:
    """The text the chat template writes after an assistant's answer ("</s>", ChatML's
    "<|im_end|>\n"); empty where the template writes nothing there or refuses the conversation."""
    marker = "\u2063ptbr\u2063"  # a text no template adds anything to
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                                  {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - jinja raises its own errors (e.g. raise_exception)
        return ""
    return rendered.split(marker, 1)[1] if marker in rendered else ""


def special_ids(tokenizer) -> set[int]:
    """The ids of the tokenizer's special tokens and of every token added to its vocabulary (ChatML's
    <|im_end|>, whether flagged special or not): one token a model can learn to end a turn with."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(getattr(tokenizer, "all_special_ids", []) or []) | set(added)


def _warn_of_answers_that_cannot_end(report: JsonlReport, tokenizer, endless: list[int]) -> None:
    """An answer whose tokens hold no special token (the template ends a turn with a marker this
    tokenizer writes as ordinary text, ChatML's <|im_end|> on a tokenizer without it, and adds no
    EOS) teaches a model no token to stop at: its answers would run to --max-new-tokens."""
    if endless:
        after = end_of_turn(tokenizer).strip()
        if not after:
            report.warnings.append(
                f"{len(endless)} of {len(report.records)} chat examples hold an answer that ends without a special "
                f"token (lines {_lines(endless)}): the chat template writes no end-of-turn marker and no EOS after an "
                f"answer, so the fine-tuned model learns no token to stop at and `ptbr generate` runs to "
                f"--max-new-tokens; give a chat template that ends a turn with the EOS token {tokenizer.eos_token!r}")
            return
        report.warnings.append(
            f"{len(endless)} of {len(report.records)} chat examples hold an answer that ends without a special token "
            f"(lines {_lines(endless)}): the chat template ends a turn with {after!r}, which this tokenizer writes as "
            f"ordinary text, and no EOS follows, so the fine-tuned model learns no token to stop at and its answers "
            f"run on (`ptbr generate` stops at the text {after!r} instead); add {after!r} to the base's tokenizer as a "
            f"special token, or give a chat template that ends a turn with the EOS token {tokenizer.eos_token!r}")


def _ends_every_answer(ids: list[int], targets: list[bool], specials: set[int]) -> bool:
    """Whether every answer (a run of target tokens) holds a special token (its end of turn)."""
    ended = True  # the answer being read holds one so far (none is being read: True)
    for token, target, before in zip(ids, targets, [False] + targets[:-1], strict=True):
        if target and not before:  # an answer starts
            if not ended:
                return False
            ended = False
        ended = ended or (target and token in specials)
    return ended


def _encode_all(report: JsonlReport, tokenizer, max_seq_len: int | None, drop_long: bool) -> None:
    _warn_of_written_special_tokens(report, tokenizer)
    long_lines, emptied_lines, endless = [], [], []
    specials = special_ids(tokenizer)
    for record in report.records:
        try:
            ids, targets = encode_record(tokenizer, record)
        except TemplateProblem as exc:
            report.problems.append(f"line {record.line}: {exc}")
            report.rejected += 1
            continue
        report.longest = max(report.longest, len(ids))
        if record.schema == "messages" and not _ends_every_answer(ids, targets, specials):
            endless.append(record.line)
        if max_seq_len is not None and len(ids) > max_seq_len:
            long_lines.append(record.line)
            if drop_long:
                continue
            ids, targets = ids[:max_seq_len], targets[:max_seq_len]
            if not any(targets[1:]):
                emptied_lines.append(record.line)
                continue
        report.examples.append(Example(record.line, np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool)))
    report.too_long = len(long_lines)
    _warn_of_answers_that_cannot_end(report, tokenizer, endless)
    if report.records and not report.examples and not report.problems:
        report.nothing_left = True
        report.problems.append(f"no example is left within max_seq_len {max_seq_len} (every one was dropped; "
                               "see the warnings)")
    if long_lines:
        action = ("dropped (--drop-long)" if drop_long else
                  f"truncated to {max_seq_len} tokens, their ends cut (--drop-long drops them instead)")
        report.warnings.append(
            f"{len(long_lines)} of {len(report.records)} examples are longer than max_seq_len {max_seq_len} "
            f"(longest: {report.longest} tokens; lines {_lines(long_lines)}): {action}")
    if emptied_lines:
        report.warnings.append(
            f"{len(emptied_lines)} truncated examples kept no target token within max_seq_len and were dropped "
            f"(lines {_lines(emptied_lines)}); raise --max-seq-len to train on them")


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:LINES_IN_WARNING])
    return shown + (f" and {len(numbers) - LINES_IN_WARNING} more" if len(numbers) > LINES_IN_WARNING else "")


def data_paths(data: str, valid: str | None) -> tuple[Path, Path | None]:
    """train.jsonl and the optional validation file from --data FILE|DIR and --valid."""
    path = Path(data)
    if path.is_dir():
        train = path / "train.jsonl"
        if not train.is_file():
            raise DataError("no train.jsonl in the data directory", data,
                            "put train.jsonl (and valid.jsonl) there, or give a .jsonl file")
        valid_path = Path(valid) if valid else (path / "valid.jsonl" if (path / "valid.jsonl").is_file() else None)
    elif path.is_file():
        train, valid_path = path, Path(valid) if valid else None
    else:
        raise DataError("training data not found", data,
                        "give train.jsonl, or a directory with train.jsonl and valid.jsonl")
    if valid_path is not None and not valid_path.is_file():
        raise DataError("validation file " + ("is a directory" if valid_path.is_dir() else "not found"),
                        str(valid_path), "give an existing --valid FILE.jsonl")
    return train, valid_path


def inspect_pair(train_path: Path, valid_path: Path | None, tokenizer=None, max_seq_len: int | None = None,
                 drop_long: bool = False, max_positions: int | None = None) -> list[JsonlReport]:
    """The one verdict on a fine-tuning data set, shared by `ptbr finetune`, `validate-data` and
    preflight: each file checked (and encoded with the length policy, given a tokenizer), the
    validation file in the training file's format, and (given the base's max_positions) no example
    longer than the model can take."""
    reports = [inspect_jsonl(p, tokenizer, max_seq_len, drop_long) for p in (train_path, valid_path) if p is not None]
    train = reports[0]
    if valid_path is not None and valid_path.resolve() == train_path.resolve():
        reports[1].warnings.append("it is the training file: the validation loss will measure memorisation, and the "
                                   "best adapter is the one that fits the training data best")
    for valid in reports[1:]:
        if train.schema and valid.schema and valid.schema != train.schema:
            valid.training_format = train.schema
            valid.problems.append(f"it holds {valid.schema!r} examples but the training file holds {train.schema!r}")
    if max_positions:
        for report in reports:
            long = [e.line for e in report.examples if len(e.ids) > max_positions]
            if long:
                report.beyond_positions = max_positions
                report.problems.append(
                    f"{len(long)} examples are longer than the base model's {max_positions} positions even after "
                    f"the length policy (lines {_lines(long)}): use --max-seq-len {max_positions} or less")
    return reports


def fix_of(reports: list[JsonlReport], lines_fix: str) -> str:
    """The fix for these files' problems: `lines_fix` for problems in lines, what to give
    --max-seq-len when a problem is about lengths, and the format a validation file needs when it
    holds another (which no edit of a line would fix)."""
    fixes = []
    if any(r.nothing_left for r in reports):
        fixes.append(f"raise --max-seq-len (the longest example has {max(r.longest for r in reports):,} tokens)")
    positions = [r.beyond_positions for r in reports if r.beyond_positions]
    if positions:
        fixes.append(f"give --max-seq-len {min(positions)} or less (the base model's positions)")
    formats = [r for r in reports if r.training_format]
    for r in formats:
        fixes.append(f"give a validation file of {r.training_format!r} examples, as the training file holds "
                     f"(or convert {r.path.name} to that format)")
    fixes += [r.file_fix for r in reports if r.file_fix]
    if any(len(r.problems) > r.nothing_left + (r.beyond_positions is not None) + (r.training_format is not None)
           + (r.file_fix is not None) for r in reports):
        fixes.append(lines_fix)
    return "; ".join(fixes) or lines_fix


def problems_summary(report: JsonlReport) -> str:
    """The problems of a file in one line, the first PROBLEMS_IN_ERROR of them listed."""
    listed = "; ".join(report.problems[:PROBLEMS_IN_ERROR])
    more = len(report.problems) - PROBLEMS_IN_ERROR
    count = "1 problem" if len(report.problems) == 1 else f"{len(report.problems)} problems"
    return f"{report.path.name}: {count}: {listed}" + (f"; and {more} more" if more > 0 else "")
