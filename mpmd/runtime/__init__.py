"""The runtime: what the controller does with live actors once a step is compiled.

  mesh.py          `RemoteMesh` — the actors this controller drives: connections, buffers, executables, steps
  actor_handle.py  `mesh.actor(i)` — one actor addressed directly (the embedding API)
  array.py         `RemoteArray` and `fetch` — handles to arrays that stay on actors
  controller.py    the asyncio loop thread, one connection per actor, the watchdog (dead or silent actors)
  aio.py           the awaitable API's plumbing: awaiting all this from the caller's own event loop
  buffers.py       fetching, waiting for and freeing buffers (batched frees in dispatch order)
  executables.py   lowering once, shipping executables and Programs to actors once
  sharding.py      layouts of arrays over each actor's own device mesh (SPMD inside an actor)
  wiring.py        which data-plane route each pair of actors uses, and wiring it
  checkpoint.py    `save` / `restore` / `load` of state held on actors (orbax-checkpoint on each actor), verified
  checkpoint_format.py             the on-disk layout and its manifest (digests of every array and file)
  checkpoint_placement.py          where each restored array goes on a mesh other than the one that saved it
  recovery.py      `Recovery` — surviving a lost actor: step log, host snapshots, replacement, replay
  arguments.py     checks of counts and durations the launchers, RemoteMesh and Recovery share
  launch/          starting daemons: local subprocesses, Ray actors, a rendezvous (SLURM, Kubernetes)

The runtime imports the compiler's value conversions (`mpmd.compiler.avals`; recovery also re-exports a plan's
executables with `mpmd.compiler.plan.iter_lowered`), observation (`mpmd.observe`)
and the wire (`transport`); nothing here imports the user's surface (`mpmd.api`, `mpmd.step`).
"""
