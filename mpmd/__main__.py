"""`python -m mpmd ...`: the `mpmd` command (as `python -m mpmd.cli`), for an environment whose scripts are not on PATH."""

import sys

from mpmd.cli import main

sys.exit(main())
