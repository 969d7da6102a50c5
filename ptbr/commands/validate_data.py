"""`ptbr validate-data`: check chat/instruction JSONL files and report every problem with its line
number; exit code 0 only when every file is clean (warnings, such as long examples, are allowed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ptbr.config import FinetuneConfig
from ptbr.errors import ConfigError, DataError
from ptbr.finetune.data import data_paths, fix_of
from ptbr.flags import setting_default


def data_sets(paths: list[str], valid: str | None = None) -> list[tuple[Path, Path | None]]:
    """What to check: a directory stands for its train.jsonl and valid.jsonl (as finetune's --data
    DIR does, checked as a pair); a file stands for itself, or with --valid for a training file
    and its validation file (finetune's --data FILE --valid FILE)."""
    for name in paths:
        if not Path(name).exists():
            raise DataError("not found", name, "give a .jsonl file, or a directory holding train.jsonl (and valid.jsonl)")
    if valid is not None:
        if len(paths) != 1:
            raise ConfigError(f"--valid goes with one training file or directory, and {len(paths)} were given",
                              "ptbr validate-data", "give one training file with its --valid file")
        return [data_paths(paths[0], valid)]
    return [data_paths(name, None) if Path(name).is_dir() else (Path(name), None) for name in paths]


def main(args) -> int:
    from ptbr.finetune.data import inspect_pair

    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        max_seq_len = setting_default(FinetuneConfig, "max_seq_len")
    elif max_seq_len <= 0:
        raise ConfigError(f"--max-seq-len must be a positive integer, got {max_seq_len}", "ptbr validate-data",
                          "give a length in tokens, e.g. --max-seq-len 1024")
    tokenizer, positions = None, None
    if args.base:
        from ptbr.commands import quiet_transformers
        from ptbr.finetune.base import (
            check_tokenizer_fits,
            load_tokenizer,
            max_positions,
            read_config,
        )

        quiet_transformers()
        tokenizer = load_tokenizer(args.base, args.trust_remote_code, args.download)
        config = read_config(args.base)
        check_tokenizer_fits(args.base, tokenizer, config)
        positions = max_positions(config)
    # the verdict `ptbr finetune` and preflight give: the same function decides
    reports = [r for train, valid in data_sets(args.files, args.valid)
               for r in inspect_pair(train, valid, tokenizer, max_seq_len, args.drop_long, positions)]
    # files named apart (a directory's pair is checked together already) in different formats
    apart = [r for r in reports if any(Path(name) == r.path for name in args.files)]
    formats = {r.schema for r in apart if r.schema}
    if len(formats) > 1 and args.valid is None and len(apart) > 1:
        note = (f"note: these files hold different formats ({', '.join(sorted(formats))}); `ptbr finetune` needs a "
                "validation file in its training file's format: check the two as a pair with "
                "`ptbr validate-data TRAIN.jsonl --valid VALID.jsonl`")
    else:
        note = None
    if args.json:
        if note:  # stdout holds the JSON only
            print(note, file=sys.stderr)
        print(json.dumps([{"file": str(r.path), "format": r.schema, "examples": len(r.records) - r.rejected,
                           "usable": len(r.examples) if tokenizer else None,
                           "longest_tokens": r.longest if tokenizer else None, "too_long": r.too_long,
                           "problems": r.problems, "warnings": r.warnings} for r in reports], indent=2))
    else:
        for report in reports:
            count = len(report.records) - report.rejected
            described = f"{count} valid example{'' if count == 1 else 's'} ({report.schema or 'no known format'})"
            if report.rejected:
                described += f", {report.rejected} the chat template rejects"
            if tokenizer is not None and report.records:
                described += f", {len(report.examples)} usable within max_seq_len {max_seq_len:,}" + (
                    f" (longest {report.longest:,} tokens)" if report.longest else "")
            print(f"{report.path}: {described}")
            for problem in report.problems:
                print(f"  {problem}")
            for warning in report.warnings:
                print(f"  warning: {warning}")
            if report.ok:
                print("  ok")
        if note:
            print(note)
        if tokenizer is None:
            print("(give --base MODEL_DIR to also check token lengths and the chat template"
                  + (": --max-seq-len counts its tokens, and was not checked)" if args.max_seq_len is not None else ")"))
    problems = sum(len(r.problems) for r in reports)
    if problems:
        failed = [str(r.path) for r in reports if not r.ok]
        raise DataError(f"{problems} problem{'s' if problems > 1 else ''} found", ", ".join(failed),
                        fix_of([r for r in reports if not r.ok], "fix the lines " + (
                            "the JSON on stdout lists" if args.json else "listed above")))
    return 0
