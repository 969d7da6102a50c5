"""`ptbr prepare`."""

from ptbr.data.prepare import prepare


def main(args) -> int:
    prepare(args.input, args.output, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
            tokenizer_path=args.tokenizer)
    return 0
