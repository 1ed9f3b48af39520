"""ZeroMQ control plane: controller DEALER <-> actor ROUTER request/reply over asyncio.

One `ControlClient` per actor. Requests are tagged with an integer id, so many can be in flight at once
and replies may come back in any order. A reader task routes each reply to its future. `last_heard`
records the time of the last message from the actor (any reply, including pongs), which the controller's
watchdog uses to tell a busy actor from a dead one.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from transport.protocol import Message, ProtocolError, decode, encode

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024**3


class ConnectionLost(ConnectionError):
    """The control connection was closed while a request was waiting for its reply."""


def bind_router(ctx: zmq.Context, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[zmq.Socket, str]:
    """Bind a ROUTER that errors (instead of silently dropping) on unroutable replies.

    ``tcp://host:0`` binds a free port. Returns the socket and the endpoint actually bound.
    Messages over `max_message_bytes` make ZeroMQ drop the sender's connection; the daemon stays up.
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    sock.bind(address)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class ControlClient:
    """Asynchronous request/reply client for one actor (a DEALER socket)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        self.address = address
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.last_heard = time.monotonic()
        self.requests_sent = 0
        self.closed = False

    def start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def _read_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            self.last_heard = time.monotonic()
            try:
                msg = decode(frames)
            except ProtocolError:
                continue  # a reply we cannot read has no future we could name; the request times out
            fut = self._pending.pop(msg.header.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def submit(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> asyncio.Future[Message]:
        """Send one request now (on the loop thread; requests leave in the order they are submitted) and
        return the future of its reply (an "error" reply is a result, not an exception)."""
        if self.closed:
            raise ConnectionLost(f"connection to {self.address} is closed")
        self.start()
        req_id = next(self._ids)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        fut.add_done_callback(lambda _: self._pending.pop(req_id, None))
        header = {"op": op, "id": req_id, **(fields or {})}
        try:
            self._sock.send_multipart(encode(header, arrays), copy=False)  # no high-water mark: queued at once, in order
        except BaseException:
            self._pending.pop(req_id, None)
            raise
        self.requests_sent += 1
        return fut

    async def request(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> Message:
        """Send one request and wait for its reply (an "error" reply is returned, not raised)."""
        return await self.submit(op, fields, arrays)

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every waiting request with `exc` (used when the actor is found dead)."""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()

    def close(self) -> None:
        self.closed = True
        self.fail_pending(ConnectionLost(f"connection to {self.address} closed"))
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)
