"""`ptbr generate`: sample a continuation from a trained model (optionally with a LoRA adapter), on
torch (transformers, PEFT adapters) or MLX (mlx-lm, mlx-lm adapters). An adapter in the other
backend's format is converted on the fly (ptbr/finetune/export.py)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from ptbr.commands import quiet_transformers
from ptbr.errors import ConfigError, ModelError
from ptbr.finetune.base import check_base


def load_tokenizer(model_dir: str, adapter: str | None, download: bool = False):
    """The tokenizer an adapter was trained with (ptbr saves it with the adapter, chat template
    included), else the model's."""
    from transformers import AutoTokenizer

    tokenizer_dir = adapter if adapter and (Path(adapter) / "tokenizer_config.json").is_file() else model_dir
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=not download)
    except OSError as exc:
        raise ModelError(f"cannot load the tokenizer: {str(exc).splitlines()[0]}", tokenizer_dir,
                         "give a local model directory (OUTPUT/final)") from exc


def load_for_generation(model_dir: str, adapter: str | None, device, download: bool = False):
    """torch: the tokenizer and the model (with a PEFT adapter) on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir, adapter, download)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=not download)
    except OSError as exc:
        raise ModelError(f"cannot load the model: {str(exc).splitlines()[0]}", model_dir,
                         "give a local model directory (OUTPUT/final)") from exc
    if adapter:
        from peft import PeftModel

        if not (Path(adapter) / "adapter_config.json").is_file():
            raise ModelError("no adapter_config.json in the adapter directory", adapter, "give OUTPUT/adapters")
        model = PeftModel.from_pretrained(model, adapter)
    return tokenizer, model.to(device).eval()


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt as token ids: a user message in the chat template exactly as fine-tuning rendered
    its examples, or plain text to continue."""
    if chat:
        from ptbr.finetune.data import encode_prompt

        return list(encode_prompt(tokenizer, prompt, "messages"))
    return list(tokenizer(prompt)["input_ids"])


def generate(tokenizer, model, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
             chat: bool = False) -> str:
    """torch: the continuation of `prompt`; with chat=True, the answer to `prompt` as a user message."""
    import torch

    ids = torch.tensor([prompt_ids(tokenizer, prompt, chat)], device=model.device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    sampling = temperature > 0
    options = {"do_sample": sampling, "max_new_tokens": max_new_tokens,
               "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id}
    if sampling:
        options.update(temperature=temperature, top_k=top_k)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        output = model.generate(**inputs, **options)
    return tokenizer.decode(output[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def is_chat_model(model_dir: str, adapter: str | None, tokenizer, raw: bool) -> bool:
    """Whether the prompt is a user message in the chat template (True) or text to continue.

    ptbr's record of the training data decides where there is one (an adapter's, or a merged
    model's, ptbr_adapter.json): fine-tuning saves a chat template with every tokenizer, including
    those of models trained on prompt/completion or plain text. Otherwise a tokenizer with a chat
    template means a chat model. --raw always continues the prompt as plain text."""
    if raw:
        return False
    from ptbr.finetune.adapter import read_adapter_meta

    meta = read_adapter_meta(adapter or model_dir)
    if "format" in meta:
        return meta["format"] == "messages"
    return bool(getattr(tokenizer, "chat_template", None))


def generate_mlx(args, adapter: str | None) -> tuple[str, bool]:
    from ptbr.backends.mlx import generate as mlx_generate
    from ptbr.backends.mlx.device import resolve_device
    from ptbr.backends.mlx.lora import local_model_dir

    resolve_device(args.device)
    model_dir = local_model_dir(args.model, args.download, "model")
    tokenizer = load_tokenizer(str(model_dir), adapter)
    chat = is_chat_model(str(model_dir), adapter, tokenizer, args.raw)
    model = mlx_generate.load_for_generation(model_dir, Path(adapter) if adapter else None)
    new = mlx_generate.generate(model, prompt_ids(tokenizer, args.prompt, chat), {tokenizer.eos_token_id},
                                args.max_new_tokens, args.temperature, args.top_k, args.seed)
    return tokenizer.decode(new, skip_special_tokens=True), chat


def main(args) -> int:
    if args.max_new_tokens <= 0 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens must be > 0, --temperature and --top-k >= 0", "ptbr generate",
                          "correct the values")
    quiet_transformers()
    from ptbr.backends import resolve_name
    from ptbr.finetune.export import adapter_as

    check_base(args.model, args.download, "model")
    backend = resolve_name(args.backend)
    with ExitStack() as stack:
        if backend == "mlx":
            text, chat = generate_mlx(args, args.adapter and adapter_as(args.adapter, "mlx", stack))
        else:
            from ptbr.backends.torch.device import resolve_device

            adapter = args.adapter and adapter_as(args.adapter, "peft", stack)
            tokenizer, model = load_for_generation(args.model, adapter, resolve_device(args.device), args.download)
            chat = is_chat_model(args.model, adapter, tokenizer, args.raw)
            text = generate(tokenizer, model, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                            args.seed, chat=chat)
    print(text.strip() if chat else args.prompt + text)
    return 0
