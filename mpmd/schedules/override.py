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
