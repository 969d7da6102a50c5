"""`ptbr info`: a dataset's facts and problems, or a preset's architecture and memory estimate."""

from __future__ import annotations

import json

from ptbr.commands import check_preset_request
from ptbr.config import DEFAULT_VOCAB_SIZE
from ptbr.errors import ConfigError, DataError

PRECISIONS = ("fp32", "bf16", "fp16")  # torch; the MLX backend's estimate is shown as mlx-bf16
# the torch rows are planned for a CUDA GPU: its loss chunk, and repeated key/value heads in fp32/fp16
DEVICE = "cuda"


def model_info(model_size: str, vocab_size: int, seq_len: int, batch_size: int, grad_accum: int,
               gradient_checkpointing: bool = False) -> dict:
    from ptbr.config import PretrainConfig, get_preset
    from ptbr.flags import setting_default
    from ptbr.memory import GIB, Architecture, estimate_mlx_memory, estimate_training_memory

    preset = get_preset(model_size)
    arch = Architecture.from_preset(preset, vocab_size)
    chunked = setting_default(PretrainConfig, "chunked_loss")  # as `ptbr train` runs by default
    estimates = {p: estimate_training_memory(arch, batch_size, seq_len, p, gradient_checkpointing,
                                             chunked_loss=chunked, grad_accum=grad_accum, device=DEVICE).as_dict()
                 for p in PRECISIONS}
    # --backend mlx (Apple Silicon): bf16 on Metal, fp32 master weights
    estimates["mlx-bf16"] = estimate_mlx_memory(arch, batch_size, seq_len, "bf16", grad_accum=grad_accum,
                                                gradient_checkpointing=gradient_checkpointing).as_dict()
    return {
        "model_size": preset.name,
        "architecture": "Llama (RMSNorm, RoPE, SwiGLU, SDPA attention)",
        "hidden_size": preset.hidden_size, "num_layers": preset.num_layers, "num_heads": preset.num_heads,
        "num_kv_heads": preset.num_kv_heads, "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "tie_word_embeddings": preset.tie_word_embeddings, "vocab_size": vocab_size,
        "parameters": arch.parameters,
        "default_learning_rate": preset.learning_rate,
        "batch": {"batch_size": batch_size, "grad_accum": grad_accum, "seq_len": seq_len,
                  "tokens_per_step": batch_size * grad_accum * seq_len,
                  "gradient_checkpointing": gradient_checkpointing},
        "memory_bytes": estimates,
        "device": DEVICE,  # the torch rows'; mlx-bf16 is Apple's
        "memory_gib": {p: round(e["total"] / GIB, 2) for p, e in estimates.items()},
    }


def main(args) -> int:
    if not args.data and not args.model_size:
        raise ConfigError("nothing to describe", "ptbr info", "give --data DIR or --model-size NAME")
    report = {}
    if args.data:
        from ptbr.data.tokens import describe, open_dataset, val_too_short

        report["data"] = describe(open_dataset(args.data, args.tokenizer))
        # at the --seq-len given (train's default otherwise), as `ptbr train` would read it
        short = val_too_short(report["data"]["val_tokens"], args.seq_len)
        if short:
            report["data"]["warnings"].append(f"{short}: training at --seq-len {args.seq_len} will not evaluate")
    if args.model_size:
        vocab_size = args.vocab_size
        if vocab_size is None:  # the model a run on this dataset builds has the dataset's vocabulary
            vocab_size = report["data"]["vocab_size"] if "data" in report else DEFAULT_VOCAB_SIZE
        check_preset_request("info", args.model_size, args.seq_len, batch_size=args.batch_size,
                             grad_accum=args.grad_accum, vocab_size=vocab_size)
        report["model"] = model_info(args.model_size, vocab_size, args.seq_len, args.batch_size,
                                     args.grad_accum, args.gradient_checkpointing)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text(report)
    problems = report.get("data", {}).get("problems", [])
    if problems:
        raise DataError("; ".join(problems), args.data, "re-run `ptbr prepare` with the right tokenizer")
    return 0


def _print_text(report: dict) -> None:
    if "data" in report:
        d = report["data"]
        print(f"dataset    {d['directory']} ({d['layout']})")
        print(f"tokenizer  {d['tokenizer']} (vocab {d['vocab_size']:,}, eos id {d['eos_id']})")
        print(f"dtype      {d['dtype']}")
        for split in ("train", "val"):
            if d.get(f"{split}_tokens"):
                print(f"{split:<10} {d[f'{split}_tokens']:,} tokens, {d[f'{split}_bytes']:,} bytes, "
                      f"max id {d[f'{split}_max_id']:,}")
            else:
                print(f"{split:<10} (none)")
        for warning in d["warnings"]:
            print(f"warning    {warning}")
        for problem in d["problems"]:
            print(f"PROBLEM    {problem}")
    if "model" in report:
        m = report["model"]
        print(f"model      {m['model_size']}: {m['architecture']}")
        print(f"           hidden {m['hidden_size']}, layers {m['num_layers']}, heads {m['num_heads']} "
              f"(kv {m['num_kv_heads']}), mlp {m['intermediate_size']}, max positions {m['max_position_embeddings']}")
        print(f"parameters {m['parameters']:,} at vocab {m['vocab_size']:,}")
        b = m["batch"]
        print(f"batch      {b['batch_size']} x grad_accum {b['grad_accum']} x seq_len {b['seq_len']} "
              f"= {b['tokens_per_step']:,} tokens/step" + (" (gradient checkpointing)" if b["gradient_checkpointing"] else ""))
        print("memory     precision  weights  grads  optimizer  activations    loss  peak (GiB)")
        for precision, e in m["memory_bytes"].items():
            g = {k: v / 1024**3 for k, v in e.items() if k != "precision"}
            print(f"           {precision:<9}  {g['weights']:7.2f}  {g['gradients']:5.2f}  {g['optimizer']:9.2f}  "
                  f"{g['activations']:11.2f}  {g['logits']:6.2f}  {g['total']:5.2f}")
        print("           torch rows as on a CUDA GPU (fp16: one without bf16, e.g. a T4); loss: its tensors over the "
              "vocabulary, a chunk of 256 MiB of logits at a time (ptbr train's default; 32 MiB chunks on CPU; 16-bit "
              "micro-batches of fewer tokens than the hidden size: the whole logits)")
