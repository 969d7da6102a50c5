"""`ptbr export-adapter`: a LoRA adapter converted between PEFT's format (torch) and mlx-lm's (MLX)."""

from __future__ import annotations


def main(args) -> int:
    from ptbr.finetune.export import export_adapter

    output, source = export_adapter(args.adapter, args.to, args.output, args.base)
    loads = {"peft": "PeftModel.from_pretrained(base, DIR) or `ptbr generate --backend torch --adapter DIR`",
             "mlx": "mlx_lm.load(BASE, adapter_path=DIR) or `ptbr generate --backend mlx --adapter DIR`"}[args.to]
    print(f"adapter converted from {source} to {args.to} in {output}; it loads with {loads}")
    return 0
