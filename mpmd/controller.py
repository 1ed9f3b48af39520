"""The asyncio side of the controller: a loop in a background thread, one connection per actor, and a
watchdog that turns a dead or silent actor into `ActorDiedError` within seconds instead of a hang.

User-facing calls are synchronous: they submit a coroutine to the loop and wait for its result. Requests
to different actors run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np
import zmq.asyncio

from mpmd.errors import ActorDiedError, RemoteError
from transport.control import ConnectionLost, ControlClient
from transport.protocol import Message

log = logging.getLogger(__name__)
T = TypeVar("T")


class EventLoopThread:
    """An asyncio loop (uvloop when installed) running in a daemon thread."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mpmd-controller", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("mpmd's synchronous API cannot be called from its own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


class ActorConnection:
    """Requests to one actor; error replies become `RemoteError`, a lost actor `ActorDiedError`."""

    def __init__(self, actor_id: int, address: str, ctx: zmq.asyncio.Context, alive: Callable[[], str | None] | None,
                 stacks: Callable[[], str] | None = None, session: int = 0):
        self.actor_id = actor_id
        self.address = address
        self.session = session  # sent with every request: the actor keeps each controller's buffers apart
        self.client = ControlClient(ctx, address)
        self._alive = alive  # returns a reason string if the actor is known dead (local process exited)
        self._stacks = stacks  # returns what a live but silent local actor's threads are doing
        self._pinging = False
        self._suspect = False
        self.dead: str | None = None

    def submit(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> Coroutine[Any, Any, Message]:
        """Send a request now (call on the loop thread); await the result for the reply. Error replies become
        `RemoteError`, a lost actor `ActorDiedError`."""
        if self.dead:
            raise ActorDiedError(self.actor_id, self.dead)
        try:
            fut = self.client.submit(op, {"session": self.session, **(fields or {})}, arrays)
        except ConnectionLost as e:
            raise ActorDiedError(self.actor_id, str(e)) from None
        return self._finish(fut)

    async def _finish(self, fut: asyncio.Future[Message]) -> Message:
        try:
            msg = await fut
        except ActorDiedError:
            raise
        except ConnectionLost as e:
            raise ActorDiedError(self.actor_id, str(e)) from None
        if msg.op == "error":
            h = msg.header
            raise RemoteError(self.actor_id, h.get("error", "Error"), h.get("message", ""), h.get("traceback", ""), h.get("task"))
        return msg

    async def request(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> Message:
        return await self.submit(op, fields, arrays)

    def check(self, now: float, interval: float, timeout: float) -> None:
        """Called by the watchdog: ping a silent actor that owes replies; declare it dead past `timeout`."""
        if self.dead or self.client.pending == 0:
            return
        reason = self._alive() if self._alive else None
        silent = now - self.client.last_heard
        # Silent past the timeout on two watchdog ticks in a row: the reader gets a turn in between, so
        # replies that sat unread while this process was busy are not mistaken for silence.
        suspect, self._suspect = self._suspect, silent > timeout
        if reason is None and silent > timeout and suspect:
            reason = f"no reply or heartbeat for {silent:.1f} s (heartbeat_timeout={timeout} s) from {self.address}"
            if self._stacks is not None:
                reason += f"; its threads were at:\n{self._stacks()}"
        if reason is not None:
            self.dead = reason
            self.client.fail_pending(ActorDiedError(self.actor_id, reason))
        elif silent > interval and not self._pinging:
            self._pinging = True
            asyncio.get_running_loop().create_task(self._ping())

    async def _ping(self) -> None:
        try:
            await self.client.request("ping")
        except Exception:
            pass
        finally:
            self._pinging = False

    def close(self) -> None:
        self.client.close()


class Watchdog:
    def __init__(self, connections: list[ActorConnection], interval: float, timeout: float) -> None:
        self.connections = connections
        self.interval = interval
        self.timeout = timeout
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval / 2)
            now = time.monotonic()
            lag = now - last - self.interval / 2
            last = now
            if lag > self.interval:
                # This loop itself did not run for a while (the caller's thread held the GIL in a long
                # compile, or the machine was swapping): that time says nothing about the actors.
                for c in self.connections:
                    c.client.last_heard = min(now, c.client.last_heard + lag)
            for c in self.connections:
                c.check(now, self.interval, self.timeout)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
