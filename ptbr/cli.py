"""The `ptbr` command line: argument parsing only; each command's module is imported when it runs.

Library errors (PtbrError) become one line `error: WHAT (WHERE); fix: HOW` and the error's exit
code; `--debug` (before or after the command) or PTBR_DEBUG=1 also shows the traceback, and the
third-party warnings that are otherwise filtered. Output piped into a reader that stops early
(`ptbr info ... | head -1`) ends quietly with exit 141, as git and ls do.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
import traceback
import warnings

from ptbr import __version__
from ptbr.config import (
    BACKENDS,
    DEFAULT_VOCAB_SIZE,
    DEVICES,
    MODES,
    PRESETS,
    FinetuneConfig,
    PretrainConfig,
)
from ptbr.errors import EXIT_CODES
from ptbr.flags import add_preflight_flags, add_settings_flags, setting_default
from ptbr.kaggle.layout import POLL_SECONDS
from ptbr.kaggle.settings import BundleSettings

EPILOG = "exit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
# 128 + SIGPIPE: the status a shell shows for git or ls when `| head` stops reading
EXIT_BROKEN_PIPE = 141
BACKEND_HELP = ("torch, or mlx (Apple Silicon, also mlx[cpu] on Linux); auto picks mlx on Apple Silicon when mlx "
                "is installed, torch elsewhere (default: auto)")
DEBUG_HELP = "show tracebacks and third-party warnings (also PTBR_DEBUG=1); before or after the command"

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
    "export-adapter": ("ptbr.commands.export_adapter:main",
                       "convert a LoRA adapter between PEFT's format (torch) and mlx-lm's (MLX)"),
    "preflight": ("ptbr.commands.preflight:main", "check hardware, packages, data, model and disk; recommend a config that fits"),
    "monitor": ("ptbr.commands.monitor:main", "watch a run from another terminal: progress, loss, memory, stalls (read-only)"),
    "report": ("ptbr.commands.report:main", "plots and report.md of a run, or several runs overlaid (needs matplotlib)"),
    "kaggle": ("ptbr.commands.kaggle:main", "train on Kaggle's free GPUs: bundle a run, push it, follow it, fetch its outputs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ptbr", description="Train Portuguese (PT-BR) language models reproducibly.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ptbr {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # every command also takes --debug; SUPPRESS keeps a `ptbr --debug COMMAND` from being reset to False
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)

    def command(name: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=COMMANDS[name][1], description=COMMANDS[name][1], parents=[common])

    presets = ", ".join(PRESETS)
    p = command("prepare")
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="FILE_OR_DIR",
                   help=".txt files (blank-line separated documents), .jsonl files with a \"text\" field, or directories")
    p.add_argument("--output", required=True, help="dataset directory to write")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"BPE vocabulary size (default: {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share of tokens for val.bin (default: 0.005)")
    p.add_argument("--tokenizer", help="reuse this tokenizer.json instead of training one")

    p = command("info")
    p.add_argument("--data", help="dataset directory (its vocabulary is the one --model-size is estimated at)")
    p.add_argument("--tokenizer", help="tokenizer.json (for datasets without meta.json)")
    p.add_argument("--model-size", help=f"a preset to describe with its memory estimate: {presets}")
    p.add_argument("--vocab-size", type=int,
                   help=f"vocabulary for --model-size (default: the dataset's with --data, else {DEFAULT_VOCAB_SIZE})")
    for name, text in (("seq_len", "tokens per sequence"), ("batch_size", "sequences per micro-batch"),
                       ("grad_accum", "micro-batches per optimizer step")):
        default = setting_default(PretrainConfig, name)  # info plans a `ptbr train` run
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                       help=f"{text}, as `ptbr train` (default: {default})")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="estimate with activations recomputed in the backward pass")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("train")
    add_settings_flags(p, PretrainConfig)

    p = command("test-gpu")
    p.add_argument("--model-size", default="400m", help=f"the preset to run one step of: {presets} (default: 400m)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences in the step (default: 1)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"vocabulary of the model (default: {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto picks cuda, then mps, then cpu (default: auto)")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "fp16", "bf16"),
                   help="auto: bf16 where the GPU really has it, fp16 on T4-class GPUs, fp32 on CPU (default: auto)")

    p = command("generate")
    p.add_argument("prompt", help='a question for a chat model, or text to continue, e.g. "Era uma vez" '
                                  '(one that starts with "-" goes after "--": ptbr generate --model M -- "-texto")')
    p.add_argument("--model", required=True, help="a model directory (OUTPUT/final, a merged model) or a base model")
    p.add_argument("--adapter", help="a LoRA adapter directory (OUTPUT/adapters) to apply to --model")
    p.add_argument("--download", action="store_true", help="allow --model to be a Hugging Face Hub id (needs network)")
    p.add_argument("--raw", action="store_true",
                   help="continue the prompt as plain text, even where the model was trained on conversations "
                        "(default: the chat template for a model trained on chat data, or whose tokenizer has one)")
    p.add_argument("--max-new-tokens", "--max-tokens", type=int, default=100, dest="max_new_tokens",
                   help="tokens to generate at most (default: 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help=BACKEND_HELP)
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto picks cuda, then mps, then cpu; with --backend mlx the Metal GPU, or cpu (default: auto)")

    p = command("smoke")
    p.add_argument("--output", help="keep the smoke run here (default: a temporary directory, removed at the end)")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help=BACKEND_HELP)

    p = command("finetune")
    add_settings_flags(p, FinetuneConfig)

    p = command("validate-data")
    p.add_argument("files", nargs="+", metavar="FILE_OR_DIR",
                   help="JSONL files; a directory stands for its train.jsonl and valid.jsonl")
    p.add_argument("--valid", metavar="FILE", help="a validation file, checked as `ptbr finetune --data FILE --valid "
                   "FILE` checks it: with the one training file given, in its format")
    p.add_argument("--base", help="a model directory: also check token lengths and the chat template")
    p.add_argument("--max-seq-len", type=int, help="length to check against (default: finetune's, "
                   f"{setting_default(FinetuneConfig, 'max_seq_len')})")
    p.add_argument("--drop-long", action="store_true",
                   help="check as `ptbr finetune --drop-long` runs: longer examples dropped, not truncated")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the base tokenizer's own code to run")
    p.add_argument("--download", action="store_true", help="allow --base to be a Hugging Face Hub id (needs network)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("merge")
    p.add_argument("--base", required=True, help="the base model directory the adapter was trained on")
    p.add_argument("--adapter", required=True, help="the adapter directory (OUTPUT/adapters)")
    p.add_argument("--output", required=True, help="directory to write the merged model to")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="dtype of the merged weights (default: auto, the base's own)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the base model's own code to run")
    p.add_argument("--download", action="store_true", help="allow --base to be a Hugging Face Hub id (needs network)")

    p = command("export-adapter")
    p.add_argument("adapter", help="the adapter directory (OUTPUT/adapters), in either format")
    p.add_argument("--to", required=True, choices=("peft", "mlx"),
                   help="peft: adapter_model.safetensors for PEFT and the torch backend; mlx: adapters.safetensors "
                        "for mlx-lm and the MLX backend")
    p.add_argument("--output", required=True, help="directory to write the converted adapter to")
    p.add_argument("--base", help="the base model it was trained on, recorded in the converted adapter "
                                  "(default: the one the adapter records)")

    p = command("preflight")
    add_preflight_flags(p)

    p = command("monitor")
    p.add_argument("run_dir", metavar="OUTPUT", help="the run directory (the --output of train or finetune)")
    p.add_argument("--refresh", type=float, default=5, metavar="SECONDS",
                   help="seconds between two screens; it stops when the run has ended (default: 5)")
    p.add_argument("--once", action="store_true", help="print the run's state once and exit")
    p.add_argument("--stall-after", type=float, metavar="SECONDS",
                   help="seconds without a new metrics row, log line or checkpoint file before a live run is "
                        "called stalled (default: the largest of 5x the median step time, 2x the longest step "
                        "and 60 s)")

    p = command("report")
    p.add_argument("runs", nargs="+", metavar="OUTPUT", help="a run directory; several: their curves overlaid")
    p.add_argument("--output", help="where to write report.md and plots/ (default: the run directory; "
                                    "required for several runs)")

    add_kaggle_actions(command("kaggle"), common)
    return parser


def add_kaggle_actions(parser: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    """`ptbr kaggle bundle|push|status|output` (the kaggle package is imported only when one runs)."""
    actions = parser.add_subparsers(dest="kaggle_action", metavar="ACTION", required=True)

    def action(name: str, text: str) -> argparse.ArgumentParser:
        return actions.add_parser(name, help=text, description=text, parents=[common])

    def default(name: str):
        return setting_default(BundleSettings, name)

    p = action("bundle", "write a bundle: a dataset (ptbr, its wheels, data, settings) and a GPU kernel, internet off")
    p.add_argument("--output", required=True, metavar="BUNDLE", help="folder to write (a previous bundle there is replaced)")
    p.add_argument("--owner", required=True, help="your Kaggle username: the dataset and the kernel are OWNER/SLUG")
    p.add_argument("--slug", required=True, help="id of the dataset and the kernel: 6-50 lowercase letters, digits, hyphens")
    p.add_argument("--mode", choices=tuple(MODES), default=default("mode"),
                   help=f"pretrain (ptbr train) or finetune (ptbr finetune) (default: {default('mode')})")
    p.add_argument("--data", help="pretrain: a dataset directory from `ptbr prepare` (without one, the PT-BR sample in "
                   "ptbr); finetune: train.jsonl, or a directory with train.jsonl and valid.jsonl")
    p.add_argument("--config", help="the run's settings, as `ptbr train/finetune --config` takes them (JSON or YAML); "
                   "its data and base paths count unless --data or --base is given")
    p.add_argument("--base", help="finetune: a local model directory (uploaded with the bundle), or "
                   "kaggle:OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION], a model hosted on Kaggle (attached)")
    p.add_argument("--title", help="title of the dataset and the kernel, 6-50 characters (default: the slug)")
    p.add_argument("--python-version", default=default("python_version"),
                   help=f"the Python of Kaggle's image, which the wheels are for (default: {default('python_version')})")
    p.add_argument("--resume-from-previous", action="store_true",
                   help="attach the kernel's previous output: the run continues from its newest checkpoint")
    p.add_argument("--stop-after-hours", type=float, default=default("stop_after_hours"),
                   help="the kernel stops training (a checkpoint saved) this long after it starts, before Kaggle "
                   f"ends a GPU session at 12 h (default: {default('stop_after_hours')})")
    p.add_argument("--env", action="append", metavar="NAME=VALUE",
                   help="an environment variable for ptbr's processes in the kernel, repeatable: e.g. "
                   "NCCL_P2P_DISABLE=1 where two T4s hang at their first collective (no credentials)")

    p = action("push", "upload the bundle's dataset (new, or a new version), check every file arrived, push the kernel")
    p.add_argument("bundle", metavar="BUNDLE", help="the folder `ptbr kaggle bundle` wrote")
    p.add_argument("--kernel-only", action="store_true",
                   help="push the kernel alone; the dataset on Kaggle must already hold this bundle (it is checked)")
    p.add_argument("--poll-seconds", type=float, default=POLL_SECONDS,
                   help=f"how often to ask whether the dataset is ready (default: {POLL_SECONDS:g})")

    p = action("status", "the kernel's state: queued, running, complete, error (exit 11), cancelled (exit 11)")
    p.add_argument("bundle", metavar="BUNDLE", help="the folder `ptbr kaggle bundle` wrote")
    p.add_argument("--wait", action="store_true", help="ask again until the kernel has ended")
    p.add_argument("--poll-seconds", type=float, default=POLL_SECONDS, help=f"how often to ask with --wait (default: {POLL_SECONDS:g})")

    p = action("output", "download the kernel's outputs: the run directory, preflight report, the log")
    p.add_argument("bundle", metavar="BUNDLE", help="the folder `ptbr kaggle bundle` wrote")
    p.add_argument("--path", required=True, help="folder to download into (a previous download there is replaced)")
    p.add_argument("--pattern", help="only outputs whose path matches this regular expression, e.g. 'run/final/' "
                   "(and the few small files the summary reads)")


def main(argv: list[str] | None = None) -> int:
    """Run `ptbr ARGV`; returns the exit code."""
    try:
        try:
            code = _run(argv)
        finally:
            # flushed here rather than at interpreter exit, where a reader that has gone would be an
            # 'Exception ignored ... BrokenPipeError' message and exit 120
            sys.stdout.flush()
    except BrokenPipeError:
        _discard(sys.stdout)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt as exc:  # before the command started (its own stops are its own): still one line, 130
        from ptbr.errors import Interrupted, interrupted_before_the_command

        _say(interrupted_before_the_command(exc, list(argv) if argv is not None else sys.argv[1:]).one_line())
        return Interrupted.exit_code
    return code


# True once command() runs: main() is then the process's command, not a call from Python
_AS_COMMAND = False


def command() -> int:
    """What the `ptbr` command and `python -m ptbr` run: main() on the command line, after which a
    failed rank of a data-parallel run ends at once with its code (ptbr/backends/torch/distributed.py
    exit_a_failed_rank). main() itself always returns, for callers from Python; command() is the
    process's entry point, and leaves SIGINT/SIGTERM ending the process at once (_keep_the_outcome)."""
    global _AS_COMMAND
    _AS_COMMAND = True
    # registered before any library is imported, so that it runs after all of their exit hooks
    # (they run last-registered first): see _keep_the_outcome
    atexit.unregister(_ignore_stop_signals)
    atexit.register(_ignore_stop_signals)
    try:
        code = main()
    finally:
        _AS_COMMAND = False  # (a caller from Python, a test, may call main() next)
    _forget_caught_interrupts()
    _keep_the_outcome(code)
    _leave_native_threads(code)
    _spare_the_exit_collections()
    if code:
        from ptbr.commands import end_a_failed_rank

        end_a_failed_rank(code)
    return code


def _leave_native_threads(code: int) -> None:
    """A command stopped while a thread of ptbr's still runs native code (tokenizer training, in
    Rust): the interpreter's teardown would end that thread as it next asked for the GIL, inside
    Rust, and the process would abort (SIGABRT or SIGSEGV, now and then) after ptbr's own line. The
    process ends here instead, its output flushed, with the command's code."""
    import threading

    from ptbr.data.tokenizer import NATIVE_THREAD_PREFIX

    if any(t.is_alive() and t.name.startswith(NATIVE_THREAD_PREFIX) for t in threading.enumerate()):
        _exit_now(code)


def _spare_the_exit_collections() -> None:
    """The interpreter's exit runs the garbage collector over every object the command's libraries
    made (torch, transformers, sympy, torch._dynamo): about a second after a `ptbr train` on a 2-core
    CPU (1.26 s from its `done:` line to the shell's prompt; 0.31 s with this). Frozen, those objects
    are left out of the exit's collections; they are still freed as the modules holding them are
    torn down (their `__del__` runs, files close), and only what sits in reference cycles is left to
    the operating system, as at any exit."""
    import gc

    gc.freeze()


def _exit_now(code: int) -> None:
    """End the process now with `code`, its logs and standard streams flushed first."""
    for flush in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
        try:
            flush()
        except Exception:  # noqa: BLE001 - a reader gone, a closed stream, a flush re-entered: exiting all the same
            pass
    os._exit(code)


def _keep_the_outcome(code: int) -> None:
    """The command has its result: a Ctrl-C or SIGTERM in the second the interpreter then takes to
    exit (torch's teardown) ended the process by that signal, -2 or -15 with no line, after a run
    had printed `done:`. From here either signal ends the process at once with the command's own
    exit code, its output flushed."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum, frame) -> None:
        _exit_now(code)

    global _OUTCOME_KEPT
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)
    _OUTCOME_KEPT = True


# True once a command's result is kept: Python's handlers (`leave`) end where the interpreter's
# teardown begins (it puts the defaults back, which end the process by the signal), yet modules are
# torn down after that (torch's: the second above). The last exit hook (command() registers it before
# any library registers its own) ignores the signals from then on, so that they leave the code alone;
# every exit hook before it can still be stopped, by `leave`. (Non-daemon threads are joined before
# the exit hooks run, so nothing can wait on them then.)
_OUTCOME_KEPT = False


def _ignore_stop_signals() -> None:
    import signal

    if _OUTCOME_KEPT:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _forget_caught_interrupts() -> None:
    """CPython remembers a KeyboardInterrupt that escaped code exec() or eval() ran from a string,
    and `python -m` then ends itself with SIGINT at exit whatever the program returned, even where
    the program caught it: dataclasses and namedtuple make their methods that way, so a Ctrl-C
    landing while torch's modules import (the first seconds of `ptbr train`) ended with the shell
    seeing death by SIGINT (-2) after ptbr's own line, not 130 (seen in CI). A string exec'd to the
    end clears that record; a KeyboardInterrupt ptbr did not catch never reaches here."""
    exec("pass", {})  # noqa: S102 - a constant string: clears the record (pythonrun.c run_eval_code_obj)


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a value of the wrong type, a choice not offered) in
    ptbr's one-line form, exit 2, like every other bad setting. A flag is spelled out whole:
    argparse would take `--chunked` for `--chunked-loss` or `--save` for `--save-every`, and a
    command that works by an abbreviation today breaks silently when a later flag shares it."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but a flag the command does not know is named with the command (argparse
        reports it from `ptbr` itself, whose --help does not list the command's flags)."""
        from ptbr.errors import ConfigError

        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            where = " ".join(filter(None, [self.prog, getattr(parsed, "command", None),
                                           getattr(parsed, "kaggle_action", None)]))
            raise ConfigError(f"unrecognized arguments: {' '.join(unknown)}", where, f"see `{where} --help`")
        return parsed

    def error(self, message: str):
        from ptbr.errors import ConfigError

        fix = f"see `{self.prog} --help`"
        if message.endswith("required: prompt"):  # argparse reads a prompt like "-texto" as an option
            fix = f'give the prompt; one that starts with "-" goes after --: {self.prog} --model M -- "-texto"'
        raise ConfigError(message, self.prog, fix)


def _report_native_crashes() -> None:
    """A crash in native code (a segfault or an abort in torch, gloo, a CUDA driver, bitsandbytes)
    ends the process before any Python handler runs, with one word from the shell. Python's
    faulthandler prints every thread's Python stack to stderr first, so the line it happened
    under is known (under a launcher, in that rank's log)."""
    import faulthandler

    if faulthandler.is_enabled():  # PYTHONFAULTHANDLER, -X faulthandler, pytest
        return
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor
        pass


def _stop_on_sigterm():
    """SIGTERM (`kill`, `timeout`, `docker stop`, Kaggle ending a session) stops a command as
    Ctrl-C does: one line and exit 130, where its default would end the process silently with 143.
    A training run replaces it with its graceful stop (a checkpoint first) once training starts."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    import signal

    raise KeyboardInterrupt(signal.Signals(signum).name)


def _run(argv: list[str] | None) -> int:
    from ptbr.errors import ConfigError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ConfigError as exc:
        print(exc.one_line(), file=sys.stderr, flush=True)
        return exc.exit_code
    if not args.command:
        parser.print_help(sys.stderr)  # no command: a usage error, not output
        return 2
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what --num-processes hands its workers
    _report_native_crashes()
    previous = _stop_on_sigterm()
    code = None
    try:
        code = _command(args)
        return code
    finally:
        if _AS_COMMAND and code is not None:
            # the process's own command has its result: from here a signal ends it with that code
            # (restoring SIGTERM's default first left a moment where it ended the process with 143)
            _keep_the_outcome(code)
        elif previous is not None:  # main() called from Python (tests, notebooks): theirs again
            import signal

            signal.signal(signal.SIGTERM, previous)


def _command(args) -> int:
    debug = args.debug or os.environ.get("PTBR_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    from ptbr.errors import PtbrError, error_line
    from ptbr.log import setup_console

    setup_console(logging.DEBUG if debug else logging.INFO)
    filter_third_party_noise(debug)
    target, _ = COMMANDS[args.command]
    module_name, function = target.split(":")
    try:
        return int(getattr(importlib.import_module(module_name), function)(args) or 0)
    except PtbrError as exc:
        if debug:
            traceback.print_exc()
        _say(exc.one_line())
        return exc.exit_code
    except BrokenPipeError:
        raise  # our reader has gone: not a crash (main ends quietly)
    except KeyboardInterrupt as exc:
        from ptbr.errors import Interrupted, interrupted

        _say(interrupted(exc, args.command).one_line())
        return Interrupted.exit_code
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line + a crash report
        if debug:
            traceback.print_exc()
        from ptbr.commands import stopped_by_another_rank

        stopped = stopped_by_another_rank(exc, args.command)
        if stopped is not None:  # not this rank's crash: the launcher names the rank that went first
            _say(stopped.one_line())
            return stopped.exit_code
        from ptbr.crash import write_crash_report

        report = write_crash_report(args, exc)
        _say(error_line(exc, str(report) if report else None, debug))
        return 1


def _say(line: str) -> None:
    """The error line on stderr. Where stderr's reader has gone (`ptbr train 2>&1 | head`), the
    line goes nowhere and the command keeps its own exit code (130 after a stop signal, say), not
    141: a script that resumes on 130 must see 130."""
    try:  # what stdout still buffers goes first: with both streams on one pipe, the line lands whole
        sys.stdout.flush()
    except BrokenPipeError:  # stdout's reader has gone: its buffer goes nowhere
        _discard(sys.stdout)
    except (OSError, ValueError):  # a closed stream
        pass
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:
        _discard(sys.stderr)


def filter_third_party_noise(debug: bool) -> None:
    """Hide what libraries print that a user cannot act on; --debug shows it.

    Deprecation notices are addressed to the code that calls a library (transformers and peft warn
    that `is_gradient_checkpointing` is deprecated at every fine-tuning run), and bitsandbytes logs
    at import time that an optional CPU kernel package (`kernels`) is not installed. Warnings of
    other kinds (UserWarning, RuntimeWarning) may matter for a run and stay, but one: under
    `--compile` ptbr runs torch's deterministic mode (for inductor's kernels), where torch says once
    a run on a GPU that cuDNN's (or flash, or memory-efficient) attention backward "defaults to a
    non-deterministic algorithm" and names a remedy (the mode without warn_only) that would make
    every op without a deterministic kernel an error; the README says what it means for a run.
    """
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("default" if debug else "ignore", category=category)
    warnings.filterwarnings("default" if debug else "ignore", category=UserWarning,
                            message=r"(cuDNN|Flash|Memory Efficient) [Aa]ttention defaults to a non-deterministic")
    logging.getLogger("bitsandbytes").setLevel(logging.NOTSET if debug else logging.ERROR)


def _discard(stream) -> None:
    """Point `stream` (stdout, stderr) at /dev/null: what is still buffered for a reader that has
    gone goes nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stream without a file descriptor (e.g. captured in-process)
        pass


if __name__ == "__main__":
    raise SystemExit(command())
