"""In-order execution of an actor's Runs, and the per-instruction trace of a step.

On CPU, XLA runs computations dispatched back to back side by side, and they slow each other down (8
memory-bound stages at once ran 1.7x slower than one after another). A GPU queues them on a stream. Here
every executable takes and returns a scalar *order token*: each Run reads the token of the Run dispatched
before it, so XLA starts it the moment that one finishes — one after another like a stream, with no round
trip through Python between them, while the interpreter dispatches ahead as far as its inputs allow.

`StepTrace` records, when asked, what each instruction did and when (the actor's monotonic clock, ns): a
Run's wait for its inputs, its dispatch and its end (taken by a waiter thread that blocks on the Run's
token, in order), each transfer's start, end, peer and bytes. It costs nothing when off.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def ordered(fn: Callable[..., Sequence[Any]]) -> Callable[..., tuple]:
    """`fn(*args) -> outputs` as `(token, *args) -> (token + 1, *outputs)`: the token makes XLA run calls in
    the order they were dispatched (the token of a call is ready only when the whole call is done)."""

    def with_token(token: Any, *args: Any) -> tuple:
        return (token + jnp.ones((), token.dtype), *fn(*args))

    return with_token


TOKEN_AVAL = jax.ShapeDtypeStruct((), np.int32)


class Stream:
    """The order token of one actor: `call(executable, args)` runs it after everything dispatched before."""

    def __init__(self, device: Any, ordered_calls: bool) -> None:
        self.ordered = ordered_calls
        self.token = jax.device_put(np.int32(0), device) if ordered_calls else None

    def call(self, exe: Any, args: Sequence[Any]) -> tuple[Any, Sequence[Any]]:
        """Dispatch; returns (what marks this call done, its outputs)."""
        if not self.ordered:
            out = exe(*args)
            return out, out
        out = exe(self.token, *args)
        self.token = out[0]
        return out[0], out[1:]


def now() -> int:
    return time.monotonic_ns()


class StepTrace:
    """What one step did on one actor, instruction by instruction (times in ns on the actor's clock).

    events: ["run", label, waited_from, inputs_ready, dispatched, done]
            ["send", label, peer, nbytes, start, done, tag]
            ["recv", label, peer, nbytes, posted, arrived, tag]
    """

    def __init__(self, waiter: TraceWaiter) -> None:
        self.start = now()
        self.end = 0
        self.events: list[list[Any]] = []
        self._waiter = waiter
        self._pending = 0
        self._done = threading.Event()
        self._lock = threading.Lock()

    def run(self, label: str, waited_from: int, ready: int, dispatched: int, marker: Any) -> None:
        ev = ["run", label, waited_from, ready, dispatched, 0]
        self.events.append(ev)
        with self._lock:
            self._pending += 1
        self._waiter.submit(marker, ev, self)

    def finished_one(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._done.set()

    def transfer(self, kind: str, label: str, peer: int, nbytes: int, start: int, end: int, tag: int) -> None:
        self.events.append([kind, label, peer, nbytes, start, end, tag])

    def wait_runs(self, timeout: float = 60.0) -> None:
        """Block until every Run's end time is known (call off the event loop)."""
        with self._lock:
            if self._pending == 0:
                return
            self._done.clear()
        self._done.wait(timeout)

    def to_wire(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "events": self.events}


class TraceWaiter:
    """One thread that blocks on each traced Run's completion marker in dispatch order and stamps its end."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Any, list[Any], StepTrace]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="mpmd-trace-waiter", daemon=True)
        self._thread.start()

    def submit(self, marker: Any, ev: list[Any], trace: StepTrace) -> None:
        self._q.put((marker, ev, trace))

    def _loop(self) -> None:
        while True:
            marker, ev, trace = self._q.get()
            try:
                jax.block_until_ready(marker)
            except Exception:  # a failed computation still ends; its error reaches the step elsewhere
                pass
            ev[5] = now()
            trace.finished_one()
