"""The compiler: a traced training step (a jaxpr) -> stages -> tasks -> one Program per actor. Pure functions
over data, no I/O; the runtime ships what they make.

  inline.py     inline nested jit/pjit calls so the pipeline markers become visible
  eqns.py       small helpers over jaxpr equations (reads, writes, avals)
  body.py       the loop body: split at the markers into forward and backward stage pieces
  stages.py     stages by dataflow (skip connections, shared weights, parameterless stages)
  grouping.py   balance=: marker segments merged into the schedule's stages (XLA cost analysis per segment)
  placement.py  which actor owns each parameter, gradient and optimizer leaf
  units.py      executable units (one task's jaxpr, closed over what it reads)
  programs.py   per-actor instruction lists (Run/Send/Recv/Delete) from a schedule's table
  plan.py       `plan_step`: the passes in order, from a traced step to a `StepPlan`
  program.py    the Program IR as the compiler builds it (over `transport.program`'s one codec)
  lowering.py   StableHLO export of a unit for an actor's platform
  avals.py      values on the wire: typed PRNG keys as key data, host values, dtype names

The compiler reads the schedules (`mpmd.schedules`) and never the runtime.
"""
