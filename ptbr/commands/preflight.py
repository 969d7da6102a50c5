"""`ptbr preflight`: check hardware, packages, data, model and disk before a run; predict its memory;
write DIR/preflight_report.json and DIR/recommended_config.json. Exit 10 when a check fails."""

from __future__ import annotations

from ptbr.errors import PreflightFailed

MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}


def main(args) -> int:
    from ptbr.commands import quiet_transformers
    from ptbr.preflight import run_preflight
    from ptbr.preflight.settings import requested_settings

    settings, given = requested_settings(args.mode, args)
    args.output = settings.output  # for the crash report
    quiet_transformers()
    result = run_preflight(settings, load_weights=args.load_test, given=given)
    print_result(result)
    if result.failed:
        names = ", ".join(c.name for c in result.failed)
        raise PreflightFailed(f"{len(result.failed)} check(s) failed: {names}",
                              str(result.report_path or settings.output), "apply the fixes listed above, then run "
                              "preflight again")
    return 0


def print_result(result) -> None:
    counts = result.summary()
    print(f"preflight ({result.mode}): {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail")
    width = max(len(c.name) for c in result.checks)
    for check in result.checks:
        print(f"{MARK[check.status]}  {check.name:<{width}}  {check.message}")
        if check.fix and check.status != "pass":
            print(f"      {'':<{width}}  fix: {check.fix}")
    rec = result.recommendation
    if rec is not None:
        print("recommendation:")
        for reason in rec.reasons:
            print(f"  - {reason}")
    if result.report_path:
        print(f"report: {result.report_path}")
    if result.config_path:
        command = "train" if result.mode == "pretrain" else "finetune"
        print(f"recommended config: {result.config_path}")
        print(f"next: ptbr {command} --config {result.config_path}")
