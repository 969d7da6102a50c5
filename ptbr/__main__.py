"""The process's entry point: the `ptbr` console script and `python -m ptbr` both run `run()`.

It imports the CLI itself, so that Ctrl-C while the CLI's own modules still load, in
the command's first half second, ends like one a moment later: one line and exit 130, no traceback.
"""

import sys


def run() -> int:
    """Import the CLI and run the command line; returns the exit code."""
    try:
        from ptbr.cli import command
    except KeyboardInterrupt as exc:
        from ptbr.errors import Interrupted, interrupted_before_the_command

        print(interrupted_before_the_command(exc, sys.argv[1:]).one_line(), file=sys.stderr, flush=True)
        # the CLI's modules build dataclasses, whose methods are exec()'d strings: CPython remembers an
        # interrupt that escaped one and would end `python -m ptbr` by SIGINT (-2) whatever it returns;
        # a string exec'd to the end clears that (as ptbr.cli._forget_caught_interrupts does)
        exec("pass", {})  # noqa: S102 - a constant string
        return Interrupted.exit_code
    return command()


if __name__ == "__main__":
    raise SystemExit(run())
