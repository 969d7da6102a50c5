"""Typed exceptions raised by the library, and the one table of exit codes; only the CLI turns an
exception into a line on stderr and its exit code."""

from __future__ import annotations

# The exit codes, in the order the README's table lists them. Each error class below names its
# code; tests check this table, the classes and the README against each other.
EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "unexpected crash (a bug in ptbr): crash_report.txt in the output directory holds the details",
    2: "bad settings: flags, config file, values, or settings that differ from the checkpoint being resumed",
    3: "bad data: missing, empty, malformed or inconsistent data, or nothing usable in it",
    4: "a model, tokenizer, adapter or checkpoint is missing, corrupt or cannot be loaded",
    5: "device or precision not available",
    6: "output directory: cannot be created or written, in use by another run, or the disk filled up",
    7: "training diverged: loss or gradients non-finite for several steps in a row",
    8: "hang: no progress within --hang-timeout (see hang_report.txt)",
    9: "`ptbr smoke` failed",
    10: "`ptbr preflight` found a failed check (see preflight_report.json)",
    11: "Kaggle: a request to Kaggle failed or was refused, an upload did not arrive, the kernel failed, or a "
        "bundle's wheels could not be downloaded",
    130: "stopped by SIGTERM/SIGINT: a run that had started training saved a checkpoint first (run the same "
         "command to resume); anything else stopped without saving",
    137: "a rank of a --num-processes run was killed by SIGKILL (often the out-of-memory killer); by another "
         "signal N: 128 + N",
    141: "the reader of ptbr's output went away (e.g. `ptbr info | head -1`)",
}


class PtbrError(Exception):
    """A problem the user can fix. Rendered by the CLI as `error: WHAT (WHERE); fix: HOW`."""

    exit_code = 1

    def __init__(self, what: str, where: str | None = None, fix: str | None = None,
                 problems: list[str] | None = None):
        super().__init__(what)
        self.what = what
        self.where = where
        self.fix = fix
        self.problems = list(problems) if problems else [what]  # each problem, when several were found

    def __reduce__(self):
        # every field survives pickling (a data-parallel run passes errors from rank 0 to the others)
        return (self.__class__, (self.what, self.where, self.fix, self.problems))

    def rename_path(self, old: str, new: str) -> None:
        """Say `new` wherever the message says the path `old` (a temporary copy the user never
        named: the user's own file is named instead)."""
        self.what, self.where, self.fix = (part.replace(old, new) if part else part
                                           for part in (self.what, self.where, self.fix))
        self.problems = [problem.replace(old, new) for problem in self.problems]
        self.args = (self.what,)

    def one_line(self) -> str:
        text = f"error: {self.what}"
        if self.where:
            text += f" ({self.where})"
        if self.fix:
            text += f"; fix: {self.fix}"
        return " ".join(text.split())  # one line, whatever the parts held


class ConfigError(PtbrError):
    """Invalid settings: flags, config file keys or values, or a resume with different settings."""

    exit_code = 2


class DataError(PtbrError):
    """The dataset is missing, malformed, inconsistent with the tokenizer, or holds nothing usable."""

    exit_code = 3


class ModelError(PtbrError):
    """A model, tokenizer, adapter or checkpoint is missing, corrupt or cannot be loaded."""

    exit_code = 4


class DeviceError(PtbrError):
    """The requested device or precision is not available, or memory ran out."""

    exit_code = 5


class OutputError(PtbrError):
    """The output directory cannot be created or written, is in use by another run, or the disk
    filled up while writing."""

    exit_code = 6


class TrainingDiverged(PtbrError):
    """The loss or the gradients stayed non-finite."""

    exit_code = 7


class HangDetected(PtbrError):
    """No progress within the hang timeout (the watchdog exits with this code itself)."""

    exit_code = 8


class SmokeFailed(PtbrError):
    """`ptbr smoke` found a problem."""

    exit_code = 9


class PreflightFailed(PtbrError):
    """`ptbr preflight` found at least one failed check (details in preflight_report.json)."""

    exit_code = 10


class KaggleError(PtbrError):
    """Kaggle's side of `ptbr kaggle`: the API refused or failed a request, files sent did not all
    arrive, the kernel ended in error, or pip could not download a bundle's wheels. (Missing or
    refused credentials are bad settings, exit 2: the fix is on this machine.)"""

    exit_code = 11


class Interrupted(PtbrError):
    """SIGTERM/SIGINT: a checkpoint was saved at the step boundary; running again resumes."""

    exit_code = 130


def signal_of(interrupt: KeyboardInterrupt) -> str:
    """The signal that stopped a command: Ctrl-C's KeyboardInterrupt carries nothing, the CLI's
    SIGTERM handler raises one that carries its name."""
    return interrupt.args[0] if interrupt.args else "SIGINT"


def interrupted(exc: KeyboardInterrupt, command: str) -> Interrupted:
    """A stop by SIGINT/SIGTERM outside a run's graceful stop, as the CLI says it (and a run's log)."""
    resumes = command in ("train", "finetune")
    return Interrupted(f"stopped by {signal_of(exc)}", f"ptbr {command}".strip(),
                       "run the same command again (a training run resumes from its last checkpoint, where it saved "
                       "one)" if resumes else "run the same command again")


def interrupted_before_the_command(exc: KeyboardInterrupt, argv: list[str]) -> Interrupted:
    """A stop while the CLI still loads or parses `argv`: the command is its first word that is not
    a flag (ptbr's own flags before it, --debug and --version, take no value)."""
    return interrupted(exc, next((word for word in argv if not word.startswith("-")), ""))


def error_line(exc: BaseException, crash_report: str | None = None, traceback_shown: bool = False) -> str:
    """The one line the CLI prints for an exception (and a run writes to train.log). An unexpected
    one points to its crash report where a run wrote one, else to its traceback (shown above with
    --debug)."""
    if isinstance(exc, PtbrError):
        return exc.one_line()
    if isinstance(exc, KeyboardInterrupt):
        return f"error: stopped by {signal_of(exc)}"
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if crash_report:
        where, evidence = f"details in {crash_report}", "that file"
    elif traceback_shown:
        where, evidence = "traceback above", "the traceback above"
    else:
        where, evidence = "rerun with --debug for the traceback", "that traceback"
    return (f"error: unexpected {type(exc).__name__}: {message} ({where}); "
            f"fix: this is a bug in ptbr, please report it with {evidence}")


def collect(problems: list[str], error_type: type[PtbrError], where: str | None, fix: str) -> None:
    """Raise one error listing every problem found, so users fix them all in one go."""
    if problems:
        what = problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + "; ".join(problems)
        raise error_type(what, where, fix, problems)
