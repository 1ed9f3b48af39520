"""The exceptions mpmd raises. Every error a user can cause says what was passed, what was expected, and
what to do."""

from __future__ import annotations

import os
import sys


class MpmdError(Exception):
    """Base class of all mpmd errors."""


class RemoteError(MpmdError):
    """A request failed on an actor. Carries the actor id, the remote exception type and traceback."""

    def __init__(self, actor_id: int | None, remote_type: str, message: str, remote_traceback: str = "", task: str | None = None,
                 during: str | None = None):
        self.actor_id = actor_id
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        self.task = task
        self.during = during
        where = f"actor {actor_id}" + (f", task {task}" if task else "") + (f", during {during}" if during else "")
        text = f"{remote_type} on {where}: {message}"
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)


class ActorDiedError(MpmdError):
    """An actor stopped answering (process exited, or no heartbeat within the timeout)."""

    def __init__(self, actor_id: int, why: str, during: str | None = None):
        self.actor_id = actor_id
        self.why = why
        self.during = during
        super().__init__(self._message())

    def _message(self) -> str:
        return f"actor {self.actor_id} died or stopped answering{' during ' + self.during if self.during else ''}: {self.why}"

    def add_line(self, text: str) -> None:
        """Say one more thing about this loss (in place: the error may already be in several waiters' hands)."""
        self.why += f"\n{text}"
        self.args = (self._message(),)


class ActorStartError(MpmdError):
    """A local actor daemon did not start."""

    killed: bool = False  # its process was killed by a signal as it started (a recovery counts it as one more lost actor)
    timed_out: bool = False  # it was still starting when its time ran out (a recovery names its spawn_timeout)


class RendezvousError(ActorStartError):
    """Daemons started by a cluster's scheduler did not all arrive at their rendezvous in time, or arrived in a
    way the controller cannot use (an actor id claimed twice, counts that disagree, keys on some only)."""


class IncompatibleActorError(ActorStartError):
    """A daemon runs another JAX version, platform or protocol than the controller (or than the other actors)."""


class PipelineError(MpmdError):
    """The traced function or the schedule cannot be turned into a pipeline (raised before dispatch)."""


class ScheduleError(PipelineError):
    """A schedule is inconsistent (missing or duplicated tasks, an order that would deadlock)."""


class CheckpointError(MpmdError):
    """A checkpoint cannot be saved or restored as asked: it is missing, incomplete, damaged or edited (a digest,
    file or field disagrees with its verified manifest), or it does not fit the tree or mesh it is restored into.
    Carries `checkpoint` (its directory), `actor` (the actor that found the problem, or None), `file` (the file
    at fault, relative to the checkpoint, or None) and `leaf` (the tree path of the array at fault, or None)."""

    def __init__(self, message: str, *, checkpoint: str | None = None, actor: int | None = None, file: str | None = None,
                 leaf: str | None = None) -> None:
        self.checkpoint, self.actor, self.file, self.leaf = checkpoint, actor, file, leaf
        super().__init__(message)


def callers_level() -> int:
    """The `warnings.warn` stacklevel, for the function that calls this one, of the first frame outside mpmd: a
    warning then names the user's line, however deep in mpmd it was raised (in this thread: one raised in a worker
    thread — `restore_async`, a compile started by `call_async` — names the thread's frame)."""
    frame, level = sys._getframe(2), 2
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
