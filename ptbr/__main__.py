"""`python -m ptbr` runs the same CLI as the `ptbr` console script."""

from ptbr.cli import command

raise SystemExit(command())
