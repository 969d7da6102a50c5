"""`python -m ptbr` runs the same CLI as the `ptbr` console script."""

from ptbr.cli import main

raise SystemExit(main())
