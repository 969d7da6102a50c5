"""`ptbr export-adapter`: a LoRA adapter converted between PEFT's format (torch) and mlx-lm's (MLX)."""

from __future__ import annotations


def main(args) -> int:
    from ptbr.finetune.export import export_adapter

    output, source = export_adapter(args.adapter, args.to, args.output, args.base)
    loads = {"peft": "PeftModel.from_pretrained(base, DIR) or `ptbr generate --backend torch --adapter DIR`",
             "mlx": "mlx_lm.load(BASE, adapter_path=DIR) or `ptbr generate --backend mlx --adapter DIR`"}[args.to]
    done = (f"adapter copied in {source}'s format (it was in it already" + (", its base set" if args.base else "")
            + ")" if source == args.to else f"adapter converted from {source} to {args.to}")
    print(f"{done} in {output}; it loads with {loads}")
    return 0
