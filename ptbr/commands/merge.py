"""`ptbr merge`: write the base model with a LoRA adapter merged in, loadable without peft."""

from ptbr.commands import quiet_transformers


def main(args) -> int:
    quiet_transformers()
    from ptbr.finetune.merge import merge_adapter

    output = merge_adapter(args.base, args.adapter, args.output, args.dtype, args.trust_remote_code, args.download)
    print(f"merged model written to {output}")
    return 0
