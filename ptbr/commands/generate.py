"""`ptbr generate`: sample a continuation from a trained model (optionally with a LoRA adapter), on
torch (transformers, PEFT adapters) or MLX (mlx-lm, mlx-lm adapters). An adapter in the other
backend's format is converted on the fly (ptbr/finetune/export.py)."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

from ptbr.commands import quiet_transformers
from ptbr.config import MAX_SEED
from ptbr.errors import ConfigError, ModelError, collect
from ptbr.files import read_json
from ptbr.finetune.adapter import ADAPTER_META, check_adapter, read_adapter_meta
from ptbr.finetune.base import (
    adapter_base,
    check_base,
    files_only,
    load_error,
    max_positions,
    model_files_only,
    read_config,
)
from ptbr.finetune.export import adapter_as, adapter_format
from ptbr.log import log

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def adapter_files(adapter: str | None) -> Path | None:
    """Where the adapter's tokenizer and ptbr_adapter.json are: the adapter directory itself, or, for
    a checkpoint of a run (OUTPUT/checkpoints/step_N, which holds only weights), OUTPUT/adapters."""
    if adapter is None:
        return None
    path = Path(adapter)
    if not (path / ADAPTER_META).is_file() and path.parent.name == "checkpoints":
        beside = path.parent.parent / "adapters"
        if (beside / ADAPTER_META).is_file():
            return beside
    return path


def check_adapter_use(model_dir: str, adapter: str | None) -> None:
    """An adapter directory that can be applied to `model_dir` (either backend's format)."""
    if not adapter:
        return
    check_adapter(adapter)
    adapter_format(adapter)
    trained_on = adapter_base(Path(adapter_files(adapter)))
    on_this_model = trained_on is not None and Path(trained_on).expanduser().resolve() == Path(model_dir).resolve()
    if (Path(model_dir) / ADAPTER_META).is_file() and not on_this_model:  # (fine-tuned from a merge: its own base)
        raise ConfigError("the model already has an adapter merged in (it holds ptbr_adapter.json): applying "
                          "one again would count it twice", adapter,
                          "give the merged model alone, or the base model with --adapter")


def load_tokenizer(model_dir: str, adapter: str | None, download: bool = False):
    """The tokenizer an adapter was trained with (ptbr saves it with the adapter, chat template
    included), else the model's."""
    from transformers import AutoTokenizer

    files = adapter_files(adapter)
    tokenizer_dir = files if files and (files / "tokenizer_config.json").is_file() else model_dir
    if not any((Path(tokenizer_dir) / name).is_file() for name in TOKENIZER_FILES) and Path(tokenizer_dir).exists():
        raise ModelError("no tokenizer in the model directory (a checkpoint holds only weights)", str(tokenizer_dir),
                         "give OUTPUT/final, a merged model, or a base model with its tokenizer files")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir),
                                             local_files_only=files_only(str(tokenizer_dir), download))
    except Exception as exc:  # noqa: BLE001 - OSError, ValueError...: all mean "cannot load"
        raise load_error("tokenizer", str(tokenizer_dir), exc) from exc


def load_for_generation(model_dir: str, adapter: str | None, device, download: bool = False):
    """torch: the tokenizer and the model (with the adapter, converted to PEFT's format if it is
    mlx-lm's) on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    from ptbr.backends.torch.lora import refuse_mlx_quantized

    check_base(model_dir, download, what="model")
    read_config(model_dir)  # a damaged config.json is named as such, not as "cannot load the tokenizer"
    refuse_mlx_quantized(model_dir, "model", "generate with --backend mlx, or give the unquantized model")
    check_adapter_use(model_dir, adapter)
    tokenizer = load_tokenizer(model_dir, adapter, download)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **model_files_only(model_dir, download))
    except Exception as exc:  # noqa: BLE001 - OSError, SafetensorError, ValueError...: all mean "cannot load"
        raise load_error("model", model_dir, exc) from exc
    if adapter:
        from ptbr.finetune.merge import apply_adapter

        with ExitStack() as stack:  # PEFT copies the weights in: a converted adapter's directory may go
            model = apply_adapter(model, Path(adapter_as(adapter, "peft", stack)))
    if device.type == "cuda":  # decoding in fp32, or fp16 on a T4: not through SDPA's math kernel
        from ptbr.backends.torch.attention import keep_sdpa_off_the_math_kernel

        keep_sdpa_off_the_math_kernel()
    return tokenizer, model.to(device).eval()


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt as token ids: a user message in the chat template exactly as fine-tuning rendered
    its examples, or plain text to continue, as fine-tuning encoded a prompt (what the tokenizer
    puts before a text, not the EOS one set to add it would put after)."""
    from ptbr.finetune.data import encode_prompt

    return list(encode_prompt(tokenizer, prompt, "messages" if chat else None))


def new_tokens_that_fit(max_positions: int | None, prompt_tokens: int, max_new_tokens: int) -> int:
    """--max-new-tokens, capped (and said) where the prompt and it would run past the model's
    positions; a prompt that fills them is refused: beyond them a model produces noise."""
    if not isinstance(max_positions, int) or max_positions <= 0 or prompt_tokens + max_new_tokens <= max_positions:
        return max_new_tokens
    if prompt_tokens >= max_positions:
        raise ConfigError(f"the prompt has {prompt_tokens:,} tokens; the model takes {max_positions:,} in all "
                          "(its positions, config.json's max_position_embeddings or n_positions), new ones included", "ptbr generate",
                          "give a shorter prompt")
    left = max_positions - prompt_tokens
    log(f"warning: --max-new-tokens {max_new_tokens:,} capped at {left:,}: the prompt's {prompt_tokens:,} tokens "
        f"and the new ones must fit the model's {max_positions:,} positions")
    return left


def stop_ids(tokenizer, configured, chat: bool) -> set[int]:
    """The tokens that end an answer: EOS, the model's generation_config.json eos_token_id(s)
    (Llama-3.1-Instruct lists three), and in chat the chat template's end of a turn (ChatML's
    <|im_end|>, Llama-3's <|eot_id|>): a model fine-tuned on such a template ends its answers with
    that token, never with EOS."""
    from ptbr.finetune.data import end_of_turn, special_ids

    stops = {tokenizer.eos_token_id} - {None}
    stops |= set(configured if isinstance(configured, list) else [configured] if isinstance(configured, int) else [])
    if chat:
        after = end_of_turn(tokenizer)
        ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
        if ids and ids[0] in special_ids(tokenizer):
            stops.add(ids[0])
    return stops


def stop_text(tokenizer, chat: bool) -> str | None:
    """In chat, the template's end of a turn where this tokenizer writes it as ordinary text (ChatML's
    <|im_end|> on a tokenizer without that token; fine-tuning warned of it): a model fine-tuned on it
    ends its answers with that text and no stop token, so generation stops at the text."""
    from ptbr.finetune.data import end_of_turn, special_ids

    after = end_of_turn(tokenizer).strip() if chat else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return after if ids and ids[0] not in special_ids(tokenizer) else None


def cut_at(text: str, stop: str | None) -> str:
    """The answer before the stop text, where it holds one."""
    return text.split(stop, 1)[0] if stop and stop in text else text


def decode_new(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text of the new tokens as it reads after the prompt's: decoded together and the prompt's
    text cut off, since a SentencePiece decoder (Llama, Mistral) drops the space that starts a
    decoding ("▁um" alone decodes to "um": "Era uma vezum")."""
    alone = tokenizer.decode(new, skip_special_tokens=True)
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    together = tokenizer.decode(list(prompt) + list(new), skip_special_tokens=True)
    return together[len(before):] if together.startswith(before) else alone


def generate(tokenizer, model, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
             chat: bool = False) -> str:
    """torch: the continuation of `prompt`; with chat=True, the answer to `prompt` as a user message.
    The sampling is what the flags say: the model's own generation_config.json (a repetition
    penalty, top_p) is not applied, as on MLX."""
    import torch
    from transformers import GenerationConfig

    prompt_list = prompt_ids(tokenizer, prompt, chat)
    ids = torch.tensor([prompt_list], device=model.device)
    max_new_tokens = new_tokens_that_fit(getattr(model.config, "max_position_embeddings", None), ids.shape[1],
                                         max_new_tokens)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    sampling = temperature > 0
    stops = stop_ids(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None), chat)
    stop = stop_text(tokenizer, chat)
    config = GenerationConfig(do_sample=sampling, max_new_tokens=max_new_tokens, eos_token_id=sorted(stops),
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                              else min(stops, default=None), stop_strings=[stop] if stop else None)
    if sampling:
        config.temperature, config.top_k = temperature, top_k
    # generate() fills what `config` leaves unset from the model's own generation config: a fresh one
    # in its place, so that nothing of the shipped file (a penalty, top_p, an n-gram ban) comes in
    model.generation_config = GenerationConfig()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        output = model.generate(**inputs, generation_config=config, logits_processor=[_finite_logits],
                                **({"tokenizer": tokenizer} if stop else {}))
    new = [int(t) for t in output[0][ids.shape[1]:] if int(t) not in stops]
    return cut_at(decode_new(tokenizer, prompt_list, new), stop)


def _finite_logits(input_ids, scores):
    """A model whose weights hold a NaN (a damaged file, a diverged run) gives NaN logits: sampling
    then failed inside torch ("probability tensor contains either inf, nan"), reported as a bug in
    ptbr, and greedy decoding picked token 0 and printed nothing. Refused at the first such token."""
    import torch

    if not bool(torch.isfinite(scores).all()):
        raise output_not_finite()
    return scores


def output_not_finite() -> ModelError:
    """The refusal of a model whose logits are NaN or infinite, the same on both backends."""
    return ModelError("the model's output is not finite (NaN or infinite logits): its weights are damaged, or the "
                      "run that made them diverged", "ptbr generate",
                      "use another checkpoint of the run (OUTPUT/checkpoints/step_*), or copy the model's files again")


def is_chat_model(model_dir: str, adapter: str | None, tokenizer, raw: bool) -> bool:
    """Whether the prompt is a user message in the chat template (True) or text to continue.

    ptbr's record of the training data decides where there is one (an adapter's, or a merged
    model's, ptbr_adapter.json): a base's own chat template is saved with its tokenizer whatever the
    data, also for models trained on prompt/completion or plain text. Otherwise a tokenizer with a
    chat template means a chat model. --raw always continues the prompt as plain text."""
    if raw:
        return False
    meta = read_adapter_meta(adapter_files(adapter) or model_dir)
    if "format" in meta:
        return meta["format"] == "messages"
    return bool(getattr(tokenizer, "chat_template", None))


def generate_mlx(args, stack: ExitStack) -> tuple[str, bool]:
    from ptbr.backends.mlx import generate as mlx_generate
    from ptbr.backends.mlx.device import resolve_device
    from ptbr.backends.mlx.lora import local_model_dir

    resolve_device(args.device)
    model_dir = str(local_model_dir(args.model, args.download, "model"))
    read_config(model_dir)  # a damaged config.json is named as such, not as "cannot load the tokenizer"
    check_adapter_use(model_dir, args.adapter)
    tokenizer = load_tokenizer(model_dir, args.adapter, args.download)
    chat = is_chat_model(model_dir, args.adapter, tokenizer, args.raw)
    weights = args.adapter and adapter_as(args.adapter, "mlx", stack)
    model = mlx_generate.load_for_generation(Path(model_dir), Path(weights) if weights else None)
    ids = prompt_ids(tokenizer, args.prompt, chat)
    max_new_tokens = new_tokens_that_fit(max_positions(read_config(model_dir)), len(ids),
                                         args.max_new_tokens)
    configured = _generation_config(Path(model_dir)).get("eos_token_id")
    stop = stop_text(tokenizer, chat)
    # the newest tokens only (the stop text's own and a few more): decoding all of them at each token
    # would grow with the answer
    tail = len(tokenizer(stop, add_special_tokens=False)["input_ids"]) + 4 if stop else 0
    new, finite = mlx_generate.generate(model, ids, stop_ids(tokenizer, configured, chat), max_new_tokens,
                                        args.temperature, args.top_k, args.seed,
                                        until=(lambda tokens: stop in tokenizer.decode(tokens[-tail:])) if stop
                                        else None)
    if not finite:
        raise output_not_finite()
    return cut_at(decode_new(tokenizer, ids, new), stop), chat


def _generation_config(model_dir: Path) -> dict:
    """The model directory's generation_config.json ({} where it is missing or unreadable)."""
    try:
        value = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def saved_quantized_as(model: str, quant: str) -> bool:
    """Whether `model` is saved quantized by `mlx_lm.convert -q` as MLX's --quant `quant` quantizes
    (ptbr's in-memory quantization is the same): the weights an MLX adapter of `quant` trained on,
    as they are, which MLX trains on without quantizing again."""
    quantization = (read_json(Path(model).expanduser() / "config.json") or {}).get("quantization")
    return isinstance(quantization, dict) and f"{quantization.get('bits')}bit" == quant


def main(args) -> int:
    problems = []
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes the terminal's encoding could not decode (kept as surrogates)
        problems.append(f"the prompt is not valid UTF-8 (character {exc.start + 1}); give it in UTF-8")
    if not args.prompt.strip():
        problems.append("the prompt is empty")
    if args.max_new_tokens <= 0:
        problems.append(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        problems.append(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        problems.append(f"--top-k must be >= 0, got {args.top_k}")
    if not 0 <= args.seed < MAX_SEED:
        problems.append(f"--seed must be within [0, 2**63), got {args.seed}")
    collect(problems, ConfigError, "ptbr generate", "correct the values (see `ptbr generate --help`)")
    quiet_transformers()
    from ptbr.backends import resolve_name

    meta = read_adapter_meta(adapter_files(args.adapter)) if args.adapter else {}
    trained_on = meta.get("quant")
    as_trained = meta.get("backend") == "mlx" and saved_quantized_as(args.model, trained_on)  # the very base
    if trained_on in ("4bit", "8bit") and not as_trained:
        log(f"note: the adapter was trained on the base quantized ({trained_on}); it is applied to --model as given, "
            "as `ptbr merge` does, so answers can differ a little from the model training measured")

    with ExitStack() as stack:
        if resolve_name(args.backend) == "mlx":
            text, chat = generate_mlx(args, stack)
        else:
            from ptbr.backends.torch.device import resolve_device

            tokenizer, model = load_for_generation(args.model, args.adapter, resolve_device(args.device),
                                                   args.download)
            chat = is_chat_model(args.model, args.adapter, tokenizer, args.raw)
            text = generate(tokenizer, model, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                            args.seed, chat=chat)
    print(text.strip() if chat else args.prompt + text)
    return 0
