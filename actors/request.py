"""What every request handler reads a request with: `RequestError`, the checked field getters, and the
traceback text an error reply carries. It imports nothing of `actors`, so every room above it (the handlers,
the checkpoint and profiler halves, the daemon) can use it without an import circle."""

from __future__ import annotations

import traceback
from typing import Any

from transport.protocol import MAX_IDS, Message


class RequestError(ValueError):
    """A well-formed message whose fields are wrong (missing, wrong type, unknown program)."""


class NoSession(RequestError):
    """A request names a session this daemon does not have: never opened, closed (its controller said nothing
    for --session-timeout), or opened with an earlier daemon at this address (this one was restarted since).
    Its own name on the wire: a controller that had that session open takes the actor as lost."""


# How a step's failure on one actor relates to the others' (its own name on the wire, which the controller reads
# to say the cause rather than its echoes: mpmd/step.py `_cause`).
class StepAborted(RequestError):
    """The step was abandoned here because it failed elsewhere (the controller's abort, or a buffer it waited for
    was deleted): an echo of another actor's error, never the cause."""


class HeldByLoader(RequestError):
    """The step could not go on because this actor's own data loader had not returned (aborted or timed out while
    waiting for it): the cause the other actors' timeouts echo."""


class WaitedInVain(RequestError):
    """The request passed its bound waiting on something other than its own loader (a receive, another actor's
    step): usually an echo of trouble elsewhere."""


class StillComputing(WaitedInVain):
    """The request passed its bound while this actor was computing (a Run of its own, or one an earlier request cut
    off and XLA could not stop): the cause the other actors' timeouts echo, not an echo itself."""


def field(msg: Message, name: str, kind: type | tuple[type, ...]) -> Any:
    """`msg`'s header field `name`, checked to be a `kind` (a bool is not an int)."""
    try:
        value = msg.header[name]
    except KeyError:
        raise RequestError(f"'{msg.op}' request lacks field {name!r}") from None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise RequestError(f"'{msg.op}' field {name!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def int_list(msg: Message, name: str) -> list[int]:
    """`msg`'s header field `name`, checked to be a list of ints (buffer ids)."""
    values = field(msg, name, list)
    if len(values) > MAX_IDS:
        raise RequestError(f"'{msg.op}' field {name!r} names {len(values)} ids; at most {MAX_IDS} per request (send in parts)")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise RequestError(f"'{msg.op}' field {name!r} must be a list of ints")
    return values


def format_exception(e: BaseException) -> str:
    """`e` with its traceback, as the remote traceback of an error reply."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


__all__ = ["RequestError", "field", "format_exception", "int_list"]
