"""ZeroMQ control plane: controller DEALER <-> actor ROUTER request/reply over asyncio.

One `ControlClient` per actor. Requests are tagged with an integer id, so many can be in flight at once
and replies may come back in any order. A reader task routes each reply to its future. `last_heard`
records the time of the last message from the actor (any reply, including pongs); `silent` (how long the
actor has said nothing while it owed a reply) is what the controller's watchdog uses to tell a busy actor
from a dead one; `outstanding` says which requests wait and since when.

A big message holds the connection: ZeroMQ sends one connection's messages in order, so a heartbeat queued
behind a 1 GiB request (or its pong behind a 1 GiB reply) arrives only after it, seconds later on a busy
machine. So the bytes a request carries, and those of a reply the actor announces first (a ``coming``
message, sent before any reply of ``COMING_BYTES`` or more), are not silence for as long as they would take
at `LINE_FLOOR` (a live actor was declared dead during a 1.3 GiB put, and during a 0.9 GiB fetch).

With `keys` the client is a CURVE client (transport/auth.py). A monitor on the socket turns what ZeroMQ
otherwise retries in silence into errors: a refused handshake (wrong key, or one side without keys) fails
the waiting requests with `HandshakeFailed` at once, and a connection lost while requests wait fails them
with `ConnectionLost` (their replies can never come: a reconnected socket is a new peer to the actor).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from transport.auth import KeyPair, configure_client
from transport.protocol import (
    FRAME_MARGIN_BYTES,
    MAX_HEADER_BYTES,
    QUEUED_BEHIND_STEPS,
    Message,
    ProtocolError,
    decode,
    encode,
    message_id,
)

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024**3
LINE_FLOOR = 8 * 1024**2  # bytes per second a big message is granted on the control connection (encrypted, this
# 2-core VM moved ~300 MB/s idle, 125 MB/s loaded, and 16-21 MiB/s with the load average at 10-12: a 305 MiB fetch
# was declared dead at 32 MiB/s; the grant ends with the reply, so a low floor costs only while the bytes cross)
COMING_BYTES = 16 * 1024**2  # a reply this big is announced first ('coming')
COMING_LEAD = 0.05  # seconds the announcing daemon gives the notice to leave before it queues the reply itself


class ConnectionLost(ConnectionError):
    """The control connection was closed or lost while a request was waiting for its reply."""


class HandshakeFailed(ConnectionLost):
    """The actor and this client could not agree on who they are (CURVE keys, or keys on one side only)."""


class RequestTooBig(ProtocolError):
    """A request's header frame is over what the daemon takes in one frame: not sent (ZeroMQ there would drop the
    connection unseen, and the actor read as lost). `by_flag`: the daemon's --max-message-mb is the bound (a larger
    one would take it), not the protocol's fixed header limit."""

    def __init__(self, message: str, by_flag: bool) -> None:
        super().__init__(message)
        self.by_flag = by_flag


CONTROL_QUEUE = 10_000  # messages queued per connection on a daemon's control socket, each way
HANDSHAKE_MS = 10_000  # (ZeroMQ's default: 30 s, each a file descriptor a stranger holds for free)


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port``, an IPv6 host in brackets (``tcp://[::1]:0``), as ZeroMQ reads it."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def bind_failure(address: str, e: zmq.ZMQError) -> str:
    """ZeroMQ's reason a bind to `address` failed, with what it means where its words do not say: a host that does
    not resolve, or is no address of this machine, is 'No such device' to ZeroMQ (a probe); a port in use."""
    text = str(e)
    if e.errno == errno.EADDRINUSE:
        return f"{text} (another process listens there: choose another port, or port 0 for a free one)"
    if address.startswith("tcp://") and e.errno in (errno.ENODEV, errno.EADDRNOTAVAIL):
        host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        try:
            socket.getaddrinfo(host, None)
        except (OSError, UnicodeError):
            return f"{text}: the host {host!r} does not resolve (check the name, or give an IP address of this machine)"
        return (f"{text}: {host!r} is no address of this machine (bind one of its own addresses, or 0.0.0.0 for every "
                "interface)")
    return text


def allow_ipv6(sock: zmq.Socket, address: str) -> None:
    """Let `sock` bind or connect to `address` when it names an IPv6 host (``tcp://[::]:5555``): ZeroMQ sockets speak
    IPv4 only until told (a daemon told --listen tcp://[::]:0 stopped with "No such device"; a probe)."""
    if address.startswith("tcp://") and address[len("tcp://"):].startswith("["):
        sock.setsockopt(zmq.IPV6, 1)


def bind_router(ctx: zmq.Context, address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                configure: Callable[[zmq.Socket], None] | None = None) -> tuple[zmq.Socket, str]:
    """Bind a ROUTER that errors (instead of silently dropping) on unroutable replies.

    ``tcp://host:0`` binds a free port. Returns the socket and the endpoint actually bound.
    A frame over `max_message_bytes` makes ZeroMQ drop the sender's connection; the daemon stays up. (ZeroMQ bounds
    frames, not messages: the daemon refuses a request whose frames pass the limit together.)
    `configure` runs on the socket before it binds (e.g. `transport.auth.configure_server`).
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + FRAME_MARGIN_BYTES)  # (CURVE counts its overhead in)
    # Bounded per connection: a peer that sends faster than the daemon reads, or never reads its replies, is held
    # back (its sends block) or loses replies, while ROUTER's fair queueing keeps serving the other connections.
    # (The controller's own socket is unbounded, so its I/O thread always drains what a daemon sends it.)
    sock.setsockopt(zmq.SNDHWM, CONTROL_QUEUE)
    sock.setsockopt(zmq.RCVHWM, CONTROL_QUEUE)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)  # a connection that never completes its handshake is dropped
    if configure is not None:
        configure(sock)
    if address.startswith("tcp://") and address.endswith(":0"):
        address = address[:-2] + ":*"
    allow_ipv6(sock, address)
    sock.bind(address)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


@dataclass
class Outstanding:
    """A request waiting for its reply."""

    op: str
    fields: dict[str, Any]
    sent: float
    started: float = 0.0  # (QUEUED_BEHIND_STEPS) when the last step sent before it got its reply, once all such have

    def describe(self) -> str:
        what = {k: _brief(self.fields[k]) for k in ("program", "step", "exe", "buf", "bufs") if k in self.fields}
        return self.op + (f" ({', '.join(f'{k} {v}' for k, v in what.items())})" if what else "")


def _brief(value: Any) -> str:
    """A field of a request, short enough for an error message: an encoded Program or a long list of buffers was
    printed whole (a 4 MB ActorDiedError; a probe)."""
    if isinstance(value, dict):
        return f"{value['id']!r:.40}" if "id" in value else f"<{len(value)} fields>"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{', '.join(f'{v!r:.20}' for v in value[:4])}, ... {len(value)} in all]"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _handshake_failure(kind: int, with_keys: bool) -> str:
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the actor refused this client's key (it is not among the keys the actor admits)"
    # (what closes the connection at once, not an mpmd-actor at all, fails the handshake the same way: said too, a probe)
    if not with_keys:
        return ("the handshake failed: this client has no keys, and the actor wants them (it has a --server-key); or what "
                "listens there is not an mpmd-actor (it closed the connection)")
    return ("the handshake failed: the actor's public key is not the one given, or the actor has no keys at all "
            "(or its process went away during the handshake, or what listens there is not an mpmd-actor)")


class ControlClient:
    """Asynchronous request/reply client for one actor (a DEALER socket)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, keys: tuple[KeyPair, bytes] | None = None) -> None:
        self.address = address
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self.with_keys = keys is not None
        if keys is not None:
            configure_client(self._sock, *keys)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        allow_ipv6(self._sock, address)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self.outstanding: dict[int, Outstanding] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.last_heard = time.monotonic()
        self.waiting_since = self.last_heard  # when the actor last came to owe us a reply after owing none
        self._line: dict[int, float] = {}  # request id -> until when its big request or announced reply may hold the line
        self.requests_sent = 0
        self.last_sent = self.last_heard  # when the last request left
        self.closed = False
        self.connected = False
        self.ever_connected = False  # a handshake has succeeded on this connection once
        self.dropped_at: float | None = None  # when the connection dropped, until a handshake succeeds again
        self.handshake_error: str | None = None  # the last refused handshake, until one succeeds
        self.max_frame: int | None = None  # the most bytes one frame to the daemon may hold (its --max-message-mb), once known

    def start(self) -> None:
        if self._reader is None:
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read_loop())
            self._watcher = loop.create_task(self._watch_loop())

    @property
    def pending(self) -> int:
        return len(self._pending)

    def silent(self, now: float) -> float:
        """How long the actor has said nothing while it owed us a reply (an idle connection is not silent)."""
        return now - max(self.last_heard, self.waiting_since, max(self._line.values(), default=0.0))

    def _hold_line(self, req_id: int, nbytes: int) -> None:
        """`nbytes` of request `req_id` (or of its reply) are on the connection, behind the others held: the time they
        take at LINE_FLOOR is not silence, until the reply comes (or the request fails). Once per request."""
        if nbytes >= COMING_BYTES and req_id in self._pending and req_id not in self._line:
            self._line[req_id] = max([time.monotonic(), *self._line.values()]) + nbytes / LINE_FLOOR

    def poke(self) -> None:
        """Backstop against a lost wakeup: ZeroMQ signals its file descriptor edge-triggered, and asking for the
        socket's events makes pyzmq handle any that are waiting. Cheap; the watchdog calls it every tick."""
        if not self.closed:
            try:
                self._sock.get(zmq.EVENTS)
                self._monitor.get(zmq.EVENTS)
            except zmq.ZMQError:
                pass

    async def _read_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            self.last_heard, self.ever_connected = time.monotonic(), True
            try:
                msg = decode(frames)
            except Exception as e:  # fail the request the reply answers, if its header names it; else it times out
                rid = _reply_id(frames)
                fut = self._pending.pop(rid, None) if rid is not None else None
                if fut is not None and not fut.done():
                    fut.set_exception(ProtocolError(f"the reply from {self.address} could not be read: {e}"))
                continue
            if msg.op == "coming":  # a big reply follows: see the module docstring
                n = msg.header.get("nbytes")
                if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= DEFAULT_MAX_MESSAGE_BYTES:
                    self._hold_line(msg.header.get("id"), n)
                continue
            fut = self._pending.pop(msg.header.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _watch_loop(self) -> None:
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.ever_connected, self.handshake_error = True, True, None
                self.dropped_at = None
            elif kind == zmq.EVENT_DISCONNECTED:
                was, self.connected = self.connected, False
                if was:
                    self.dropped_at = time.monotonic()
                    self.fail_pending(ConnectionLost(f"the connection to {self.address} was lost (the actor's process "
                                                     "exited, or its host is unreachable)"))
            elif kind in _HANDSHAKE_FAILURES:
                self.handshake_error = f"{_handshake_failure(kind, self.with_keys)} (ZeroMQ {zmq.Event(kind).name})"
                self.fail_pending(HandshakeFailed(f"cannot talk to {self.address}: {self.handshake_error}"))

    def _step_settled(self, req_id: int) -> None:
        """Step request `req_id` got its reply: the queued requests sent after it that no unanswered step precedes
        now wait on nothing sent before them (`Outstanding.started`; a later step's end never moves an earlier
        request's start, so one that hangs is still seen: a review)."""
        now = time.monotonic()
        for rid, o in self.outstanding.items():  # (in the order sent; past the first unanswered step nothing moves)
            if rid > req_id and o.op in QUEUED_BEHIND_STEPS:
                o.started = max(o.started, now)
            if o.op == "run_program":
                break

    def submit(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> asyncio.Future[Message]:
        """Send one request now (on the loop thread; requests leave in the order they are submitted) and
        return the future of its reply (an "error" reply is a result, not an exception)."""
        if self.closed:
            raise ConnectionLost(f"connection to {self.address} is closed")
        self.start()
        req_id = next(self._ids)
        header = {"op": op, "id": req_id, **(fields or {})}
        frames = encode(header, arrays)
        most = MAX_HEADER_BYTES if self.max_frame is None else min(self.max_frame, MAX_HEADER_BYTES)
        if len(frames[0]) > most:  # (a Program of 100k instructions read as a dead actor; a probe)
            limit = "the protocol's 16 MiB header limit" if most == MAX_HEADER_BYTES else f"its --max-message-mb ({most // 2**20} MiB)"
            raise RequestTooBig(f"{op}: the request's header (its fields: {', '.join(sorted(fields or {}))[:200]}) encodes to "
                                f"{len(frames[0]) / 2**20:.2f} MiB, over what the daemon at {self.address} takes in one frame "
                                f"({limit})", by_flag=most < MAX_HEADER_BYTES)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        if not self._pending:
            self.waiting_since = time.monotonic()
        self._pending[req_id] = fut
        self.outstanding[req_id] = Outstanding(op, header, time.monotonic())

        def settled(_: Any) -> None:
            self._pending.pop(req_id, None)
            if self.outstanding.pop(req_id, None) is not None and op == "run_program":
                self._step_settled(req_id)
            self._line.pop(req_id, None)

        fut.add_done_callback(settled)
        try:
            self._sock.send_multipart(frames, copy=False)  # no high-water mark: queued at once, in order
        except BaseException:
            self._pending.pop(req_id, None)
            self.outstanding.pop(req_id, None)
            raise
        self._hold_line(req_id, sum(int(a.nbytes) for a in arrays))
        self.requests_sent += 1
        self.last_sent = time.monotonic()
        return fut

    async def request(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> Message:
        """Send one request and wait for its reply (an "error" reply is returned, not raised)."""
        return await self.submit(op, fields, arrays)

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every waiting request with `exc` (used when the actor is found dead); `exc.outstanding` says
        which requests those were."""
        if not hasattr(exc, "outstanding"):
            exc.outstanding = sorted(self.outstanding.values(), key=lambda o: o.sent)  # type: ignore[attr-defined]
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()

    def close(self) -> None:
        self.closed = True
        self.fail_pending(ConnectionLost(f"connection to {self.address} closed"))
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


def _reply_id(frames: Sequence[Any]) -> Any:
    """The request id a malformed reply carries in its header (also one of another protocol version), if the
    header itself can be read."""
    return message_id(frames) if frames else None
