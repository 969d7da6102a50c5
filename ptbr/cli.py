"""The `ptbr` command line: argument parsing only; each command's module is imported when it runs.

Library errors (PtbrError) become one line `error: WHAT (WHERE); fix: HOW` and the error's exit
code; `--debug` or PTBR_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ptbr import __version__
from ptbr.config import FinetuneConfig, PretrainConfig
from ptbr.errors import EXIT_CODES
from ptbr.flags import add_preflight_flags, add_settings_flags

EPILOG = "exit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())

# command -> (module:function, one-line help); modules load only when their command runs
COMMANDS = {
    "prepare": ("ptbr.commands.prepare:main", "tokenize .txt/.jsonl text into train.bin/val.bin (+ tokenizer)"),
    "info": ("ptbr.commands.info:main", "describe a dataset, or a model preset with its memory estimate"),
    "train": ("ptbr.commands.train:main", "pretrain a model from scratch"),
    "test-gpu": ("ptbr.commands.test_gpu:main", "probe the accelerator with one real training step"),
    "generate": ("ptbr.commands.generate:main", "sample text from a trained model"),
    "smoke": ("ptbr.commands.smoke:main", "one tiny training step, save and reload: is this install sound?"),
    "finetune": ("ptbr.commands.finetune:main", "LoRA/QLoRA fine-tuning of a Hugging Face model on chat/instruction JSONL"),
    "validate-data": ("ptbr.commands.validate_data:main", "check chat/instruction JSONL, every problem with its line"),
    "merge": ("ptbr.commands.merge:main", "merge a LoRA adapter into its base: a full model that loads without peft"),
    "preflight": ("ptbr.commands.preflight:main", "check hardware, packages, data, model and disk; recommend a config that fits"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ptbr", description="Train Portuguese (PT-BR) language models reproducibly.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ptbr {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also PTBR_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("prepare", help=COMMANDS["prepare"][1], description=COMMANDS["prepare"][1])
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="FILE_OR_DIR",
                   help=".txt files (blank-line separated documents), .jsonl files with a \"text\" field, or directories")
    p.add_argument("--output", required=True, help="dataset directory to write")
    p.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary size (default: 32000)")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share of tokens for val.bin (default: 0.005)")
    p.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one")

    p = sub.add_parser("info", help=COMMANDS["info"][1], description=COMMANDS["info"][1])
    p.add_argument("--data", help="dataset directory")
    p.add_argument("--tokenizer", help="tokenizer.json (for datasets without meta.json)")
    p.add_argument("--model-size", help="a preset: tiny, 85m, 400m, 800m")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary for --model-size (default: 32000)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("train", help=COMMANDS["train"][1], description=COMMANDS["train"][1])
    add_settings_flags(p, PretrainConfig)

    p = sub.add_parser("test-gpu", help=COMMANDS["test-gpu"][1], description=COMMANDS["test-gpu"][1])
    p.add_argument("--model-size", default="400m")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "fp16", "bf16"])

    p = sub.add_parser("generate", help=COMMANDS["generate"][1], description=COMMANDS["generate"][1])
    p.add_argument("prompt", help='text to continue, e.g. "Era uma vez"')
    p.add_argument("--model", required=True, help="a model directory (OUTPUT/final) or a base model")
    p.add_argument("--adapter", help="a LoRA adapter directory (OUTPUT/adapters) to apply to --model")
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=100, dest="max_new_tokens")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])

    p = sub.add_parser("smoke", help=COMMANDS["smoke"][1], description=COMMANDS["smoke"][1])
    p.add_argument("--output", help="keep the smoke run here (default: a temporary directory)")

    p = sub.add_parser("finetune", help=COMMANDS["finetune"][1], description=COMMANDS["finetune"][1])
    add_settings_flags(p, FinetuneConfig)

    p = sub.add_parser("validate-data", help=COMMANDS["validate-data"][1], description=COMMANDS["validate-data"][1])
    p.add_argument("files", nargs="+", metavar="FILE_OR_DIR",
                   help="JSONL files; a directory stands for its train.jsonl and valid.jsonl")
    p.add_argument("--base", help="a model directory: also check token lengths and the chat template")
    p.add_argument("--max-seq-len", type=int, help="length to check against (default: finetune's max_seq_len)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the base tokenizer's own code to run")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("merge", help=COMMANDS["merge"][1], description=COMMANDS["merge"][1])
    p.add_argument("--base", required=True, help="the base model directory the adapter was trained on")
    p.add_argument("--adapter", required=True, help="the adapter directory (OUTPUT/adapters)")
    p.add_argument("--output", required=True, help="directory to write the merged model to")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="dtype of the merged weights (default: auto, the base's own)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the base model's own code to run")

    p = sub.add_parser("preflight", help=COMMANDS["preflight"][1], description=COMMANDS["preflight"][1])
    add_preflight_flags(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("PTBR_DEBUG") == "1"
    from ptbr.errors import PtbrError, error_line
    from ptbr.log import setup_console

    setup_console()
    target, _ = COMMANDS[args.command]
    module_name, function = target.split(":")
    try:
        return int(getattr(importlib.import_module(module_name), function)(args) or 0)
    except PtbrError as exc:
        if debug:
            raise
        print(exc.one_line(), file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line + a crash report
        if debug:
            raise
        from ptbr.crash import write_crash_report

        report = write_crash_report(args, exc)
        print(error_line(exc, str(report) if report else None), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
