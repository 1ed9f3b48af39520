"""Who waits for which dispatched step (a step's done future). A cancelled await of a step's outputs aborts the
step (`aio.abort_unfinished`) only when nobody else waits for it; this module counts the waits.

A wait counts on the steps making what it waits for and, through them, on every unfinished step they read from:
a task awaiting step 2's loss keeps step 1, whose outputs step 2 reads, from being aborted by another task's
cancelled await of step 1 (it failed step 2 under the first task; a probe). Sync waits — `mpmd.fetch`,
`block_until_ready`, `to_numpy` in a thread beside the event loop — count as awaits do (a thread blocked in a fetch
lost its step to a coroutine's timeout; a probe). Futures only: this module knows nothing of arrays or steps."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

_LOCK = threading.Lock()


def note_upstream(done: Any, producers: Iterable[Any]) -> None:
    """`done` (a dispatched step's future) reads outputs of the steps whose futures are `producers`. The link is
    dropped once `done` ends (a chain of finished steps is not kept alive by it)."""
    done.mpmd_upstream = [p for p in producers if p is not None and not p.done()]
    done.add_done_callback(lambda f: setattr(f, "mpmd_upstream", ()))


def _with_upstream(readies: Iterable[Any]) -> list[Any]:
    """`readies` and every unfinished future they read from, each once."""
    seen: dict[int, Any] = {}
    todo = list(readies)
    while todo:
        r = todo.pop()
        if id(r) in seen:
            continue
        seen[id(r)] = r
        todo.extend(p for p in getattr(r, "mpmd_upstream", ()) if not p.done())
    return list(seen.values())


@contextlib.contextmanager
def waiting_for(readies: Iterable[Any]) -> Iterator[None]:
    """Count this wait (an await, or a thread's blocking fetch) on the futures `readies` and those they read from,
    while the block runs."""
    with _LOCK:
        counted = _with_upstream(r for r in readies if r is not None)
        for r in counted:
            r.mpmd_waiters = getattr(r, "mpmd_waiters", 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            for r in counted:
                r.mpmd_waiters -= 1


def waiters(ready: Any) -> int:
    """How many waits count on `ready` now."""
    return getattr(ready, "mpmd_waiters", 0)
