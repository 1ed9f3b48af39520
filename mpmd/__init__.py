"""mpmd: MPMD pipeline-parallel training for JAX.

    mesh = mpmd.RemoteMesh.local(num_actors=2)            # or .connect([...]), .ray(4), .from_rendezvous(DIR, 4)

    @mpmd.distributed(mesh=mesh)
    def train_step(params, opt_state, batch):
        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=mpmd.OneFOneB(num_stages=2))
        ...

Public names (each has a docstring):
  RemoteMesh, ActorHandle, RemoteArray, fetch the runtime: actors, handles, remote buffers, fetching them
  save, restore                               checkpoints of state held on actors (orbax-checkpoint)
  Recovery                                    RemoteMesh.local(..., recover=Recovery(snapshot_every=10)): survive a lost actor
  pipeline_yield, accumulate_grads, distributed   the pipeline API
  GPipe, OneFOneB, Custom, Task               schedules
  EagerOneFOneB, InterleavedOneFOneB, ZeroBubbleH1, InterleavedZeroBubble, ZeroBubbleV, DualPipeV   more schedules
  Schedule, validate, check_programs          write your own schedule; prove a schedule or compiled Programs deadlock-free
  simulate, Costs, SimResult                  mpmd.simulate(schedule, m, costs): step time, bubble, memory, pictures
  MpmdError, RemoteError, ActorDiedError, PipelineError, ScheduleError   errors
  ActorStartError, RendezvousError, IncompatibleActorError                 errors of starting or finding daemons

Rooms (each package's docstring says more): api/primitives/step (this surface and the distributed step),
compiler/ (jaxpr -> Programs), schedules/ (tables, validation, simulator, pictures), runtime/ (mesh, arrays,
connections, checkpoints, launchers), observe/ (traces, profiles, reports), cli/ (the `mpmd` command).
"""

from mpmd import _aliases
from mpmd.api import accumulate_grads, distributed, pipeline_yield
from mpmd.errors import (
    ActorDiedError,
    ActorStartError,
    IncompatibleActorError,
    MpmdError,
    PipelineError,
    RemoteError,
    RendezvousError,
    ScheduleError,
)
from mpmd.runtime.array import RemoteArray, fetch
from mpmd.runtime.checkpoint import restore, save
from mpmd.runtime.mesh import ActorHandle, RemoteMesh
from mpmd.runtime.recovery import Recovery
from mpmd.schedules import (
    Custom,
    DualPipeV,
    EagerOneFOneB,
    GPipe,
    InterleavedOneFOneB,
    InterleavedZeroBubble,
    OneFOneB,
    Schedule,
    Task,
    ZeroBubbleH1,
    ZeroBubbleV,
)
from mpmd.schedules.simulator import Costs, SimResult, simulate
from mpmd.schedules.validation import check_programs, validate

_aliases.install()  # old module paths (mpmd.simulator, mpmd.trace, ...) keep importing

__all__ = [
    "ActorDiedError",
    "ActorHandle",
    "ActorStartError",
    "Costs",
    "Custom",
    "DualPipeV",
    "EagerOneFOneB",
    "GPipe",
    "IncompatibleActorError",
    "InterleavedOneFOneB",
    "InterleavedZeroBubble",
    "MpmdError",
    "OneFOneB",
    "PipelineError",
    "Recovery",
    "RemoteArray",
    "RemoteError",
    "RemoteMesh",
    "RendezvousError",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Task",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "accumulate_grads",
    "check_programs",
    "distributed",
    "fetch",
    "pipeline_yield",
    "restore",
    "save",
    "simulate",
    "validate",
]
