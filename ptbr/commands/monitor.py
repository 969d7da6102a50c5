"""`ptbr monitor OUTPUT`: where a run stands, from a second terminal or a log window, read-only."""

from __future__ import annotations

import math
import sys
import time

from ptbr.errors import ConfigError
from ptbr.monitor import ENDED, assess, read_run, screen

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def main(args) -> int:
    for name in ("refresh", "stall_after"):
        value = getattr(args, name)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {value}",
                              "ptbr monitor", "give a positive number of seconds")
    redraw = sys.stdout.isatty() and not args.once
    try:
        while True:
            run = read_run(args.run_dir)
            status = assess(run, stall_after=args.stall_after)
            lines = screen(run, status)
            if redraw:
                sys.stdout.write(CLEAR)
            print("\n".join(lines), flush=True)
            if args.once or status.state in ENDED:
                return 0
            if not redraw:
                print(flush=True)  # a blank line between two screens in a log window
            time.sleep(args.refresh)
    except KeyboardInterrupt:  # Ctrl-C is how a watcher stops watching, not an error
        return 0
