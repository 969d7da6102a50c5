"""`ptbr merge`: write the base model with a LoRA adapter merged in, loadable without peft."""

from ptbr.commands import quiet_transformers


def main(args) -> int:
    import shlex

    quiet_transformers()
    from ptbr.finetune.merge import merge_adapter

    output = merge_adapter(args.base, args.adapter, args.output, args.dtype, args.trust_remote_code, args.download)
    print(f"next: ptbr generate --model {shlex.quote(str(output))} \"Era uma vez\"")  # what was merged: the log line above
    return 0
