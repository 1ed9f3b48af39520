"""mpmd: MPMD pipeline-parallel training for JAX."""

from mpmd.array import RemoteArray
from mpmd.errors import ActorDiedError, MpmdError, PipelineError, RemoteError, ScheduleError
from mpmd.mesh import ActorHandle, RemoteMesh

__all__ = ["ActorDiedError", "ActorHandle", "MpmdError", "PipelineError", "RemoteArray", "RemoteError", "RemoteMesh", "ScheduleError"]
