"""mpmd: MPMD pipeline-parallel training for JAX.

    mesh = mpmd.RemoteMesh.local(num_actors=2)            # or .connect([...]), .ray(4), .from_rendezvous(DIR, 4)

    @mpmd.distributed(mesh=mesh)
    def train_step(params, opt_state, batch):
        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=mpmd.OneFOneB(num_stages=2))
        ...

    params, opt_state, losses = await train_step.call_async(params, opt_state, batch)   # from a coroutine
    print(await mpmd.fetch_async(losses))

Public names (each has a docstring):
  RemoteMesh, ActorHandle, RemoteArray, fetch   the runtime: actors, handles, remote buffers, fetching them
  save, restore, load                         checkpoints of state held on actors (orbax-checkpoint, verified, any layout)
  fetch_async, ready_async, save_async, restore_async   awaitable twins, for the caller's own event loop (also
                                              RemoteMesh.local_async, step.call_async, actor(i).put_async / run_async)
  Recovery                                    RemoteMesh.local(..., recover=Recovery(snapshot_every=10)): survive a lost actor
  pipeline_yield, accumulate_grads, distributed   the pipeline API
  loaded_by_actors                            batch leaves each actor loads itself (a named loader function)
  GPipe, OneFOneB, Custom, Task               schedules
  EagerOneFOneB, InterleavedOneFOneB, ZeroBubbleH1, InterleavedZeroBubble, ZeroBubbleV, DualPipeV   more schedules
  Schedule, validate, check_programs          write your own schedule; prove a schedule or compiled Programs deadlock-free
  simulate, Costs, SimResult                  mpmd.simulate(schedule, m, costs): step time, bubble, memory, pictures
  tune, TuneResult, SegmentCosts              pick schedule, microbatches, stage grouping (balance=): predict, then verify
  MpmdError, RemoteError, ActorDiedError, PipelineError, ScheduleError, CheckpointError   errors
  ActorStartError, RendezvousError, IncompatibleActorError, ActorAuthError  errors of starting, finding or trusting daemons

Rooms (each package's docstring says more): api/primitives/step (this surface and the distributed step),
compiler/ (jaxpr -> Programs), schedules/ (tables, validation, simulator, pictures), runtime/ (mesh, arrays,
connections, checkpoints, launchers), observe/ (traces, profiles, reports), cli/ (the `mpmd` command).
"""

from types import ModuleType as _ModuleType

from mpmd import _aliases
from mpmd.api import accumulate_grads, distributed, pipeline_yield
from mpmd.errors import (
    ActorDiedError,
    ActorStartError,
    CheckpointError,
    IncompatibleActorError,
    MpmdError,
    PipelineError,
    RemoteError,
    RendezvousError,
    ScheduleError,
)
from mpmd.runtime.aio import fetch_async, ready_async
from mpmd.runtime.array import RemoteArray, fetch
from mpmd.runtime.checkpoint import load, restore, restore_async, save, save_async
from mpmd.runtime.controller import ActorAuthError
from mpmd.runtime.loader import loaded_by_actors
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
from mpmd.schedules.balance import SegmentCosts
from mpmd.schedules.simulator import Costs, SimResult, simulate
from mpmd.schedules.validation import check_programs, validate
from mpmd.tuning import TuneResult, tune

_aliases.install()  # old module paths (mpmd.simulator, mpmd.trace, ...) keep importing

# The public names are exactly the ones imported above (one list, not two to keep in step).
__all__ = sorted(name for name, value in globals().items() if not name.startswith("_") and not isinstance(value, _ModuleType))
