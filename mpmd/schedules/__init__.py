"""Schedules: which task (stage, microbatch, F/B/I/W) each actor runs when, checked and simulated before launch.

  builtin.py     the `Schedule` base class, the built-in tables (GPipe, 1F1B, interleaved, zero-bubble,
                 ZB-V, DualPipeV) and `Custom` for a table written by hand
  validation.py  proofs that a table (or a step's compiled Programs) is complete and deadlock-free, and the
                 table's text form for errors
  simulator.py   step time, bubble and peak memory of a schedule or of compiled Programs under given costs
  draw.py        timeline pictures (SVG, or PNG through matplotlib)
  balance.py     balance=: group marker segments into stages (the grouping with the shortest simulated step)
  override.py    use_schedule(s): replace the schedule a step names while it is traced (tune, with_schedule)

Nothing here imports the compiler or the runtime: a schedule is data, and every tool reads the same data.
`mpmd.schedules.X` keeps naming every schedule, `Task`, `backward`, `one_f_one_b`, `validate`,
`check_programs` and `format_table`, as before the schedules became a package.
"""

from mpmd.schedules import builtin
from mpmd.schedules.builtin import *  # noqa: F403 -- builtin's __all__ is this package's public list

__all__ = builtin.__all__
