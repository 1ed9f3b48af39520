"""Seeing what a run did: real-run traces, profiles and placement reports.

  trace.py    `mesh.trace()`: every actor's instructions on the controller's clock — per-actor breakdown
              (compute, waiting for data, overhead, idle), Perfetto export, costs fitted for the simulator
  profile.py  `mesh.profile(logdir)`: a `jax.profiler` trace in every actor, gathered as one TensorBoard run
  report.py   `step.placement(...)`: where every parameter, gradient and optimizer leaf lives, what crosses
  segments.py `step.profile_costs(...)`: every marker segment's F/B/I/W time measured on the actors
  replay.py   `replay_trace(trace, programs)`: a traced step replayed with its own times (the simulators' check)

Observation reads the mesh through the few methods it is handed and never imports the runtime; it may read
the schedules' simulator (fitting costs, pictures of measured timelines).
"""
