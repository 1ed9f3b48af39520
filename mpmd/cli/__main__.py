"""`python -m mpmd.cli ...`: the `mpmd` command, for an environment whose scripts are not on PATH."""

import sys

from mpmd.cli import main

sys.exit(main())
