"""Replace the schedule a step hard-codes, without touching its code: `use_schedule(s)` around tracing.

A training step usually names its schedule inside (`accumulate_grads(..., schedule=mpmd.OneFOneB(2))`).
To try other schedules on the same step (`mpmd.tune`, `step.profile_costs`, `step.with_schedule(s)`),
`accumulate_grads` reads the schedule set here first: while `use_schedule(s)` is active, every
`accumulate_grads` traced in this thread (or asyncio task) uses `s` instead of the one it was given.

    with use_schedule(mpmd.ZeroBubbleH1(4, balance="auto")):
        jaxpr = jax.make_jaxpr(step)(params, opt_state, batch)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_OVERRIDE: contextvars.ContextVar[Any] = contextvars.ContextVar("mpmd_schedule_override", default=None)
_TRACED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("mpmd_loops_traced", default=None)


@contextlib.contextmanager
def use_schedule(schedule: Any) -> Iterator[None]:
    """While active, `accumulate_grads` uses `schedule` whatever schedule it is given (None: no override)."""
    token = _OVERRIDE.set(schedule)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def schedule_override() -> Any:
    """The schedule set by the innermost active `use_schedule`, or None."""
    return _OVERRIDE.get()


@contextlib.contextmanager
def noting_loops() -> Iterator[list[Any]]:
    """While active, the schedule of every `accumulate_grads` traced in this thread (or asyncio task) is appended
    to the list it yields: a traced step whose jaxpr holds a loop this list lacks came from a cache of traces
    (jax.jit's), made under whatever schedule was in force then."""
    seen: list[Any] = []
    token = _TRACED.set(seen)
    try:
        yield seen
    finally:
        _TRACED.reset(token)


def note_loop(schedule: Any) -> None:
    """Called by `accumulate_grads` as it traces: see `noting_loops`."""
    seen = _TRACED.get()
    if seen is not None:
        seen.append(schedule)
