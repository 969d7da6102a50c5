"""The base model of a fine-tuning run as files: where it is, whether it is complete, its tokenizer.

Backend-neutral (transformers' tokenizers need no torch): the torch and MLX backends both load the
weights themselves, from a directory this module has checked. ptbr never downloads unless asked
(--download): a path that does not exist is an error at once, not a minute of hub retries. With
--download the Hub is asked once, quickly, before anything loads: an id it does not know, or a Hub
it cannot reach, is an error at once too (a copy in the local cache is used where the Hub cannot be
reached); transformers alone would retry every file for about a minute first.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ptbr.errors import ModelError
from ptbr.files import first_line, read_json, unreadable, unreadable_fix
from ptbr.log import log

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
# config.json entries that must be positive integers wherever they appear
SIZE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings")
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # "gpt2" or "mistralai/Mistral-7B-v0.1"
ORG_AND_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")  # what a mistyped path is taken for only if it has a slash
HUB_TIMEOUT = 15.0  # seconds for the Hub's one answer about a model id (--download)
HUB_STATES: dict[str, str] = {}  # hub_state's answers, by id, for this process


def is_local(base: str) -> bool:
    return Path(base).expanduser().exists()


def adapter_base(adapter: Path) -> str | None:
    """The base an adapter directory names (ptbr_adapter.json, else PEFT's adapter_config.json)."""
    for name, key in (("ptbr_adapter.json", "base"), ("adapter_config.json", "base_model_name_or_path")):
        try:
            value = json.loads((adapter / name).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str) and value:
            return value
    return None


def check_base(base: str, download: bool = False, what: str = "base model", weights: bool = True) -> None:
    """A local base must be a directory with config.json and weights (`weights` False: config.json
    is enough, as for a plan made for another machine). Anything else is an error, unless `download`
    allows a Hugging Face Hub id."""
    path = Path(base).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"the {what} must be a directory, not a file", base,
                             "give a Hugging Face model directory (config.json, *.safetensors, tokenizer files)")
        # (transformers saves weights 0600: another user's, or a host user's in a container, cannot be read)
        blocked = unreadable([path]) or unreadable(p for p in path.iterdir() if p.is_file() and loaded(p))
        if blocked:
            names = ", ".join(p.name for p in blocked[:4]) + (", ..." if len(blocked) > 4 else "")
            raise ModelError(f"cannot read the {what}'s {'folder' if blocked == [path] else names}: permission denied",
                             base, unreadable_fix())
        if not (path / "config.json").is_file():
            fix = "give a Hugging Face model directory (config.json, *.safetensors, tokenizer files)"
            if (path / "adapters" / "adapter_config.json").is_file():  # a fine-tuning run without --merge
                named = adapter_base(path / "adapters")
                fix = (f"this is a fine-tuning run's directory: give its base and its adapter (--model "
                       f"{named or 'BASE'} --adapter {path / 'adapters'} for generate; --base and --adapter for "
                       "merge)")
            if (path / "run_config.json").is_file() and not (path / "adapters").is_dir():
                # a run stopped before its end: final/ (adapters/ without validation) comes at the last step
                command = (read_json(path / "run_config.json") or {}).get("command")
                fix = (f"this is a fine-tuning run's directory without its adapter yet (adapters/ is written at "
                       f"its last step when it has no validation set): run the same `ptbr finetune` command again "
                       f"to finish it, then give --model BASE --adapter {path / 'adapters'}" if command == "finetune"
                       else f"this is a pretraining run's directory without its final model yet (final/ is written "
                       f"at its last step): run the same `ptbr train` command again to finish it, then give "
                       f"{path / 'final'}")
            for inside in ("final", "merged"):  # a run's directory: its model is inside
                if (path / inside / "config.json").is_file():
                    fix = f"this is a run's directory: give its model, {path / inside}"
            if (path / "adapter_config.json").is_file():  # the adapters/ of a fine-tuning run
                named = adapter_base(path)
                fix = (f"this is a LoRA adapter: give its base model, and the adapter apart (--model "
                       f"{named or 'BASE'} --adapter {base} for generate; --base and --adapter for merge)")
            raise ModelError(f"no config.json in the {what} directory", base, fix)
        if weights and not has_weights(path):
            raise ModelError(f"no weights (*.safetensors or pytorch_model*.bin) in the {what} directory", base,
                             "download the complete model, weights included")
        return
    if download and HUB_ID.match(base):
        hub_state(base, what, weights)
        return
    fix = "give an existing local model directory"
    if ORG_AND_NAME.match(base):
        fix += f", or add --download to fetch {base} from the Hugging Face Hub"
    raise ModelError(f"{what} directory not found", base, fix)


def hub_state(base: str, what: str = "base model", weights: bool = True) -> str:
    """"online" where the Hugging Face Hub knows the id `base` (and, for a gated model, lets this
    user read it), "cached" where the Hub cannot be reached (or HF_HUB_OFFLINE is set) but the local
    cache holds the model (its weights too, unless `weights` is False: a plan from its config);
    otherwise a ModelError at once. Asked once per process and id."""
    if base not in HUB_STATES:
        HUB_STATES[base] = _ask_hub(base, what, weights)
    return HUB_STATES[base]


def _ask_hub(base: str, what: str, weights: bool) -> str:
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    found = try_to_load_from_cache(base, "config.json")
    cached = isinstance(found, str) and (not weights or has_weights(Path(found).parent))
    # a config without weights: an interrupted download, or a plan's config alone
    partly = f" (the local cache holds {base} without its weights)" if isinstance(found, str) and not cached else ""
    if constants.HF_HUB_OFFLINE:
        if cached:
            return "cached"
        raise ModelError(f"the {what} is not in the local Hugging Face cache{partly}, and HF_HUB_OFFLINE is set",
                         base, "unset HF_HUB_OFFLINE to download it, or give a local model directory")
    login = "log in (`hf auth login`, or set HF_TOKEN)"
    try:
        info = HfApi().model_info(base, timeout=HUB_TIMEOUT)
        if getattr(info, "gated", False):  # its card is public; its files only for those who accepted its terms
            HfApi().auth_check(base)
    except GatedRepoError as exc:
        raise ModelError(f"{base} is a gated model: its files need its terms accepted", base,
                         f"accept them on https://huggingface.co/{base}, then {login}") from exc
    except RepositoryNotFoundError as exc:  # also a private model without a token
        raise ModelError(f"the Hugging Face Hub has no model {base} (or it is private and you are not logged in)",
                         base, f"check the id on https://huggingface.co (ORG/NAME), or {login} for a private model"
                         ) from exc
    except Exception as exc:  # noqa: BLE001 - no network, DNS, proxy, timeout, the Hub's own errors
        reason = first_line(exc)
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, HfHubHTTPError) and status in (401, 403):
            raise ModelError(f"the Hugging Face Hub refused this token for {base} (HTTP {status}): {reason}", base,
                             f"{login} again with a token that may read it") from exc
        if cached:
            log(f"warning: cannot reach the Hugging Face Hub ({reason}): using the copy of {base} in the local cache")
            return "cached"
        fix = ("wait and try again, or give a local model directory" if isinstance(exc, HfHubHTTPError) else
               "check the network (Kaggle: turn the notebook's internet on, or attach the model), or give a local "
               "model directory")
        raise ModelError(f"cannot reach the Hugging Face Hub: {reason}{partly}", base, fix) from exc
    return "online"


def files_only(base: str, download: bool) -> bool:
    """transformers' local_files_only for `base`: a local directory, a run without --download, and a
    Hub id that check_base found only in the cache load without asking the Hub."""
    return not download or is_local(base) or hub_state(base) == "cached"


def model_files_only(base: str, download: bool) -> dict:
    """from_pretrained's options for a model's files_only (transformers asks the Hub for an adapter
    config unless told apart)."""
    local = files_only(base, download)
    return {"local_files_only": local, "adapter_kwargs": {"local_files_only": local}}


# what loading a model's folder reads (weights, config, tokenizer, chat template, remote code): a note
# or a file manager's .DS_Store beside them that this user may not read is nothing to refuse over
LOADED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken", ".py")


def loaded(path: Path) -> bool:
    return not path.name.startswith(".") and (path.suffix in LOADED_SUFFIXES or path.match("pytorch_model*.bin"))


def has_weights(directory: Path) -> bool:
    return any(any(directory.glob(pattern)) for pattern in WEIGHT_PATTERNS)


def local_path(base: str) -> str:
    """A local base by its absolute path (adapters record it so they load without ptbr); a hub id as is."""
    path = Path(base).expanduser()
    return str(path.resolve()) if path.exists() else base


def load_error(what: str, base: str, exc: Exception) -> ModelError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    fix = ("check that the directory holds a complete Hugging Face model" if is_local(base) else
           "check the hub id and your network (or give a local model directory)")
    return ModelError(f"cannot load the {what}: {reason}", base, fix)


def load_tokenizer(base: str, trust_remote_code: bool = False, download: bool = False, weights: bool = True):
    """The base's tokenizer (one without a chat template gets DEFAULT_CHAT_TEMPLATE where chat
    examples are encoded: ptbr.finetune.data). `weights`: as check_base's."""
    from transformers import AutoTokenizer

    check_base(base, download, weights=weights)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=trust_remote_code,
                                                  local_files_only=files_only(base, download))
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError, hub errors: all mean "cannot load"
        raise load_error("tokenizer", base, exc) from exc
    if tokenizer.eos_token_id is None:
        raise ModelError("the tokenizer has no end-of-sequence (eos) token", base,
                         "set eos_token in the base's tokenizer_config.json")
    return tokenizer


def read_config(base: str) -> dict | None:
    """The base's config.json as a dict (None for a hub id not on disk)."""
    path = Path(base).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"config.json is not valid JSON: {exc}", str(path),
                         "give a complete Hugging Face model directory") from exc
    if not isinstance(config, dict):
        raise ModelError("config.json does not hold an object", str(path), "give a complete Hugging Face model directory")
    text = config.get("text_config")  # multimodal wrappers keep the decoder's settings here
    config = text if isinstance(text, dict) else config
    wrong = [key for key in SIZE_KEYS if key in config and
             (not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] <= 0)]
    if wrong:
        raise ModelError(f"config.json has sizes that are not positive integers: "
                         f"{', '.join(f'{k}={config[k]!r}' for k in wrong)}", str(path),
                         "give a complete, unmodified Hugging Face model directory")
    return config


# config.json's names for how many positions a model has (GPT-2 and GPT-J: n_positions; n_ctx in old files)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")


def max_positions(config: dict | None) -> int | None:
    found = [(config or {}).get(key) for key in POSITION_KEYS]
    return next((n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0), None)


def check_tokenizer_fits(base: str, tokenizer, config: dict | None) -> None:
    """The tokenizer must not produce ids beyond the model's embeddings (a tokenizer of another
    model fails here, not as an index error in the first step)."""
    vocab = (config or {}).get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ModelError(f"the tokenizer has {len(tokenizer):,} tokens but the model's vocabulary (config.json "
                         f"vocab_size) has {vocab:,}: they do not belong together", base,
                         "use the tokenizer files that came with this model")


SAMPLE_BYTES = 1 << 20  # read from the start, the middle and the end of each weight file


def weights_sample(base: str) -> str | None:
    """What identifies a base's weights for resuming, beyond fingerprint(): a hash of 1 MiB from the
    start, the middle and the end of each weight file, so that a base retrained or re-saved in place
    with the same shapes (same names, same sizes) is another base. A copy elsewhere is the same
    base. None for a hub id."""
    path = Path(base).expanduser()
    if not path.is_dir():
        return None
    digest = hashlib.sha256()
    for pattern in WEIGHT_PATTERNS:
        for weights in sorted(path.glob(pattern)):
            size = weights.stat().st_size
            with open(weights, "rb") as f:
                for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                    f.seek(offset)
                    digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def fingerprint(base: str) -> str:
    """What identifies a base for resuming: its config.json and the names and sizes of its weight
    files (a hub id: the id itself). Cheap: the weights are not read."""
    path = Path(base).expanduser()
    if not path.is_dir():
        return f"hub:{base}"
    digest = hashlib.sha256()
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for pattern in WEIGHT_PATTERNS:
        for weights in sorted(path.glob(pattern)):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]
