"""`ptbr validate-data`: check chat/instruction JSONL files and report every problem with its line
number; exit code 0 only when every file is clean (warnings, such as long examples, are allowed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ptbr.config import FinetuneConfig
from ptbr.errors import DataError


def jsonl_files(paths: list[str]) -> list[Path]:
    """Files as given; a directory stands for its train.jsonl and valid.jsonl (as --data DIR does)."""
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += [path / n for n in ("train.jsonl", "valid.jsonl") if (path / n).is_file()] or [path / "train.jsonl"]
        else:
            found.append(path)
    return found


def main(args) -> int:
    from ptbr.finetune.data import inspect_jsonl

    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        max_seq_len = {f.name: f.default for f in dataclasses.fields(FinetuneConfig)}["max_seq_len"]
    tokenizer = None
    if args.base:
        from ptbr.commands import quiet_transformers
        from ptbr.finetune.base import load_tokenizer

        quiet_transformers()
        tokenizer = load_tokenizer(args.base, args.trust_remote_code)
    reports = [inspect_jsonl(path, tokenizer, max_seq_len) for path in jsonl_files(args.files)]
    if args.json:
        print(json.dumps([{"file": str(r.path), "format": r.schema, "examples": len(r.records),
                           "longest_tokens": r.longest if tokenizer else None, "too_long": r.too_long,
                           "problems": r.problems, "warnings": r.warnings} for r in reports], indent=2))
    else:
        for report in reports:
            described = f"{len(report.records)} valid examples ({report.schema or 'no known format'})"
            if tokenizer is not None and report.longest:
                described += f", longest {report.longest:,} tokens (max_seq_len {max_seq_len:,})"
            print(f"{report.path}: {described}")
            for problem in report.problems:
                print(f"  {problem}")
            for warning in report.warnings:
                print(f"  warning: {warning}")
            if report.ok:
                print("  ok")
        if tokenizer is None:
            print("(give --base MODEL_DIR to also check token lengths and the chat template)")
    problems = sum(len(r.problems) for r in reports)
    if problems:
        failed = [str(r.path) for r in reports if not r.ok]
        raise DataError(f"{problems} problem{'s' if problems > 1 else ''} found", ", ".join(failed),
                        "fix the lines listed above")
    return 0
