"""`ptbr generate`: sample a continuation from a trained model (optionally with a LoRA adapter)."""

from __future__ import annotations

from pathlib import Path

from ptbr.commands import quiet_transformers
from ptbr.errors import ConfigError, ModelError


def load_for_generation(model_dir: str, adapter: str | None, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if path.exists() and not (path / "config.json").is_file():
        raise ModelError("no config.json in the model directory", str(path), "give OUTPUT/final or a Hugging Face model dir")
    # an adapter written by `ptbr finetune` carries the tokenizer it was trained with (chat template included)
    tokenizer_dir = adapter if adapter and (Path(adapter) / "tokenizer_config.json").is_file() else model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    except OSError as exc:
        raise ModelError(f"cannot load the model: {str(exc).splitlines()[0]}", model_dir,
                         "give a local model directory (OUTPUT/final)") from exc
    if adapter:
        from peft import PeftModel

        if not (Path(adapter) / "adapter_config.json").is_file():
            raise ModelError("no adapter_config.json in the adapter directory", adapter, "give OUTPUT/adapters")
        model = PeftModel.from_pretrained(model, adapter)
    return tokenizer, model.to(device).eval()


def generate(tokenizer, model, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
             chat: bool = False) -> str:
    """The continuation of `prompt`; with chat=True, the answer to `prompt` as a user message,
    rendered with the chat template exactly as fine-tuning rendered its examples."""
    import torch

    if chat:
        from ptbr.finetune.data import encode_prompt

        ids = torch.tensor([encode_prompt(tokenizer, prompt, "messages")], device=model.device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
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


def main(args) -> int:
    if args.max_new_tokens <= 0 or args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--max-new-tokens must be > 0, --temperature and --top-k >= 0", "ptbr generate",
                          "correct the values")
    quiet_transformers()
    from ptbr.backends.torch.device import resolve_device

    tokenizer, model = load_for_generation(args.model, args.adapter, resolve_device(args.device))
    chat = is_chat_model(args.model, args.adapter, tokenizer, args.raw)
    text = generate(tokenizer, model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                    chat=chat)
    print(text.strip() if chat else args.prompt + text)
    return 0
