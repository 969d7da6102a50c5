"""Typed exceptions raised by the library; only the CLI turns them into exit codes."""

from __future__ import annotations


class PtbrError(Exception):
    """A problem the user can fix. Rendered by the CLI as `error: WHAT (WHERE); fix: HOW`."""

    exit_code = 1

    def __init__(self, what: str, where: str | None = None, fix: str | None = None):
        super().__init__(what)
        self.what = what
        self.where = where
        self.fix = fix

    def one_line(self) -> str:
        text = f"error: {self.what}"
        if self.where:
            text += f" ({self.where})"
        if self.fix:
            text += f"; fix: {self.fix}"
        return " ".join(text.split())  # one line, whatever the parts held


class ConfigError(PtbrError):
    """Invalid settings: flags, config file keys or values."""

    exit_code = 2


class DataError(PtbrError):
    """The dataset is missing, malformed or inconsistent with the tokenizer."""

    exit_code = 3


class ModelError(PtbrError):
    """A model, tokenizer or checkpoint cannot be built or loaded."""

    exit_code = 4


class DeviceError(PtbrError):
    """The requested device or precision is not available, or memory ran out."""

    exit_code = 5


class OutputError(PtbrError):
    """The output directory cannot be created, written, or is in use by another run."""

    exit_code = 6


class TrainingDiverged(PtbrError):
    """The loss or the gradients stayed non-finite."""

    exit_code = 7


class PreflightFailed(PtbrError):
    """`ptbr preflight` found at least one failed check (details in preflight_report.json)."""

    exit_code = 10


class SmokeFailed(PtbrError):
    """`ptbr smoke` found a problem."""

    exit_code = 9


def collect(problems: list[str], error_type: type[PtbrError], where: str | None, fix: str) -> None:
    """Raise one error listing every problem found, so users fix them all in one go."""
    if problems:
        what = problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + "; ".join(problems)
        raise error_type(what, where, fix)
