"""Text generation on MLX (mlx-lm's generate_step), with an mlx-lm adapter applied."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ptbr.backends.mlx.file_limit import load_mlx_lm
from ptbr.errors import ModelError
from ptbr.files import telling_line


def load_for_generation(model_dir: Path, adapter: Path | None):
    """The model of `model_dir` (a checked local directory) with the mlx-lm adapter in `adapter`."""
    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.utils import load_adapters, load_model

    from ptbr.backends.mlx.lora import rope_settings
    from ptbr.finetune.base import read_config

    try:
        model, _ = load_model(model_dir, model_config=rope_settings(read_config(str(model_dir)) or {}))
    except Exception as exc:  # noqa: BLE001 - unknown architecture, missing or mismatched weights
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"cannot load the model with mlx-lm: {reason}", str(model_dir),
                         "give a Hugging Face model directory with safetensors weights (OUTPUT/final)") from exc
    if adapter is not None:
        try:
            load_adapters(model, str(adapter))
        except Exception as exc:  # noqa: BLE001 - a shape or name mismatch: the adapter is for another base
            reason = telling_line(exc)  # mlx-lm's first line announces a list of tensors
            raise ModelError(f"the adapter does not fit this model: {reason}", str(adapter),
                             "give the --model the adapter was trained on") from exc
    model.eval()
    return model


def generate(model, prompt_ids: list[int], eos_ids: set[int], max_new_tokens: int, temperature: float, top_k: int,
             seed: int, until: Callable[[list[int]], bool] | None = None) -> tuple[list[int], bool]:
    """The new token ids after `prompt_ids`: greedy at temperature 0, else sampled among the top k;
    up to a token of `eos_ids`, or the first new tokens `until` says end the answer. And whether the
    model's output stayed finite: a model whose weights hold a NaN (a damaged file, a diverged run)
    gives NaN logits, from which greedy decoding picks a meaningless token and sampling noise; the
    tokens stop before the first such step, for the caller to refuse the model (as torch does)."""
    import mlx.core as mx
    load_mlx_lm()  # first: keeps the open-file limit (file_limit.py)
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(vocab, int) and top_k >= vocab:  # every token: no cut (as torch samples); mlx-lm refuses it
        top_k = 0
    sampler = make_sampler(temp=temperature, top_k=top_k if temperature > 0 else 0)
    finite = []  # per step, whether all its logits were finite

    def checked(logprobs):  # (1, vocab)
        # the token depends on the check, so evaluating the token (generate_step does, for each step
        # ahead of time) evaluates the check too: reading it afterwards costs no evaluation of its own.
        # A step that is not finite gives token 0, which is never shown.
        ok = mx.isfinite(logprobs).all()
        finite.append(ok)
        return mx.where(ok, sampler(logprobs), 0)

    tokens = []
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_new_tokens, sampler=checked)
    for step, (token, _) in enumerate(steps):
        if not finite[step].item():
            return tokens, False
        token = int(token)
        if token in eos_ids:
            break
        tokens.append(token)
        if until is not None and until(tokens):
            break
    return tokens, True
