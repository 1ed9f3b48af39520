"""The data-plane interface every transport implements, and helpers they share.

Transfers are matched by ``(peer, key)``: a key is a tuple of ints (the runtime uses
``(program, step, tag)``), so any number of transfers can be in flight between the same pair, in both
directions, and arrive in any order. A message that arrives before its receive is posted waits in a
mailbox; a receive posted first waits for its message.

What a receive yields is either a host array that the receiver may alias (nobody else writes that memory
while the array lives: a fresh aligned buffer, or a shared-memory region that is reused only after the
array is gone) or, on GPUs, a device array.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import os
import socket
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

ALIGNMENT = 64  # bytes; JAX aliases (does not copy) host arrays aligned like this
MAX_KEY_INTS = 16  # a transfer key's length: the runtime's are (session, program, step, tag[, shard]); a longer one is refused


class TransferError(RuntimeError):
    """A transfer failed: the peer is unknown or gone, or the data is not what the receiver expected."""


class NothingCame(TransferError):
    """A receive waited its whole limit and nothing came from the peer: usually an echo of the peer's trouble
    (its own name on the wire, so the controller can tell it from a cause)."""


@dataclass(frozen=True)
class ArrivalLimits:
    """How much one peer may leave in an actor's mailbox unclaimed (arrived before its receive was posted).
    A training step sends at most one step's activations ahead, far below these; past them, arrivals from
    that peer are refused (the sender is told) until the receiver claims or expires some."""

    max_entries: int = 10_000
    max_bytes: int = 32 << 30


class Mailbox:
    """Futures keyed by (source actor, key); whichever side comes first creates the entry.

    Arrivals nobody has asked for yet are counted per source against `ArrivalLimits`; a refused key is
    remembered (the last 4096), so a receive posted for it later fails at once instead of timing out."""

    REMEMBER_REFUSED = 4096

    def __init__(self, limits: ArrivalLimits | None = None) -> None:
        self.limits = limits or ArrivalLimits()
        self._slots: dict[tuple[int, Hashable], asyncio.Future[Any]] = {}
        self._unclaimed: dict[tuple[int, Hashable], int] = {}  # (src, key) -> bytes, for arrivals not yet taken
        self._count: Counter[int] = Counter()
        self._bytes: Counter[int] = Counter()
        self._refused: OrderedDict[tuple[int, Hashable], str] = OrderedDict()
        self._then: dict[tuple[int, Hashable], Callable[[asyncio.Future[Any]], None]] = {}  # `take_then` waiters

    def _slot(self, src: int, key: Hashable) -> asyncio.Future[Any]:
        fut = self._slots.get((src, key))
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._slots[(src, key)] = fut
        return fut

    def _claim(self, slot: tuple[int, Hashable]) -> None:
        nbytes = self._unclaimed.pop(slot, None)
        if nbytes is not None:
            self._count[slot[0]] -= 1
            self._bytes[slot[0]] -= nbytes

    def would_refuse(self, src: int, key: Hashable, nbytes: int) -> str | None:
        """Why an arrival of `nbytes` would be refused now (before its payload is copied anywhere), or None."""
        if (src, key) in self._slots:
            return None  # a receive waits for it (or it is a duplicate, which `deliver` says)
        if self._count[src] + 1 > self.limits.max_entries or self._bytes[src] + nbytes > self.limits.max_bytes:
            return (f"actor {src} already has {self._count[src]} arrivals ({self._bytes[src]} bytes) waiting unclaimed "
                    f"here (the limit is {self.limits.max_entries} arrivals, {self.limits.max_bytes} bytes)")
        return None

    def refuse(self, src: int, key: Hashable, reason: str) -> None:
        """Remember that (src, key) was refused, so a receive posted for it later fails at once."""
        self._refused[(src, key)] = reason
        while len(self._refused) > self.REMEMBER_REFUSED:
            self._refused.popitem(last=False)

    def deliver(self, src: int, key: Hashable, value: Any, nbytes: int = 0) -> str | None:
        """Hand `value` to its receive, or keep it until one is posted. Returns why it was refused (a peer
        over its `ArrivalLimits`, or a duplicate key), None when it was taken in."""
        slot = (src, key)
        fut = self._slots.get(slot)
        if fut is None:
            reason = self.would_refuse(src, key, nbytes)
            if reason is not None:
                self.refuse(src, key, reason)
                return reason
            fut = self._slot(src, key)
            self._unclaimed[slot] = nbytes
            self._count[src] += 1
            self._bytes[src] += nbytes
        if fut.done():
            return f"key {key} from actor {src} arrived twice"
        fut.set_result(value)
        self._wake(slot, fut)
        return None

    def _wake(self, slot: tuple[int, Hashable], fut: asyncio.Future[Any]) -> None:
        """Run a `take_then` waiter of `slot` now, in the arrival's own turn of the loop."""
        then = self._then.pop(slot, None)
        if then is not None:
            then(fut)

    def fail(self, src: int, key: Hashable, exc: BaseException) -> None:
        slot = (src, key)
        fut = self._slots.get(slot)
        if fut is None:
            if self._count[src] + 1 > self.limits.max_entries:
                return  # nobody asked for it and the peer is over its limit: nothing to fail
            fut = self._slot(src, key)
            self._unclaimed[slot] = 0
            self._count[src] += 1
        if not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved: a receive may never come
            self._wake(slot, fut)

    async def take(self, src: int, key: Hashable, timeout: float | None = None) -> Any:
        """The value of (src, key) once it arrives; TimeoutError after `timeout` seconds (a timer on the slot
        itself: no task per receive, as `asyncio.wait_for` would make)."""
        refused = self._refused.pop((src, key), None)
        if refused is not None:
            raise TransferError(f"the transfer {key} from actor {src} arrived before its receive and was refused: {refused}")
        fut = self._slot(src, key)
        timer = None
        if timeout is not None and not fut.done():
            timer = asyncio.get_running_loop().call_later(timeout, _time_out, fut)
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            if fut.done():
                self._slots.pop((src, key), None)
                self._claim((src, key))

    def take_then(self, src: int, key: Hashable, timeout: float | None, then: Callable[[asyncio.Future[Any]], None]) -> None:
        """`take` without a task: `then(slot)` runs as soon as the value (or an error, or after `timeout` a
        TimeoutError) is in — synchronously, in the turn of the loop that delivers it — or cancelled if the step
        is abandoned first (`drop`)."""
        slot = (src, key)
        refused = self._refused.pop(slot, None)
        if refused is not None:
            raise TransferError(f"the transfer {key} from actor {src} arrived before its receive and was refused: {refused}")
        fut = self._slot(src, key)
        if fut.done():  # it came first
            self._slots.pop(slot, None)
            self._claim(slot)
            then(fut)
            return
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(timeout, self._timed_out, slot, fut)

        def done(f: asyncio.Future[Any]) -> None:
            if timer is not None:
                timer.cancel()
            if self._slots.get(slot) is f:
                self._slots.pop(slot, None)
                self._claim(slot)
            then(f)

        self._then[slot] = done

    def _timed_out(self, slot: tuple[int, Hashable], fut: asyncio.Future[Any]) -> None:
        if not fut.done():
            fut.set_exception(TimeoutError())
            self._wake(slot, fut)

    def drop(self, predicate: Callable[[Hashable], bool]) -> int:
        """Forget arrived or awaited entries whose key matches (used to abandon an aborted step)."""
        doomed = [k for k in self._slots if predicate(k[1])]
        for k in doomed:
            fut = self._slots.pop(k)
            self._claim(k)
            if not fut.done():
                fut.cancel()
                self._wake(k, fut)
            elif not fut.cancelled():
                fut.exception()  # retrieved: no "exception never retrieved" noise
        for k in [k for k in self._refused if predicate(k[1])]:
            del self._refused[k]
        return len(doomed)

    def unclaimed(self) -> dict[int, tuple[int, int]]:
        """{source actor: (arrivals, bytes)} waiting for a receive."""
        return {src: (n, self._bytes[src]) for src, n in self._count.items() if n}

    def __len__(self) -> int:
        return len(self._slots)


class P2PTransport(abc.ABC):
    """One actor's endpoint of the data plane."""

    actor_id: int

    @abc.abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """What the controller needs to wire peers to this actor (addresses, host identity, capabilities)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def connect(self, peers: dict[int, dict[str, Any]]) -> None:
        """Open routes to `peers` ({actor id: {"address": ..., "route": ...}})."""

    @abc.abstractmethod
    async def send(self, peer: int, key: tuple[int, ...], value: Any, wait: bool = False) -> None:
        """Send `value` (a host or device array) to `peer`. With `wait`, return only once the bytes have left
        this actor; otherwise once the caller may drop its reference."""

    @abc.abstractmethod
    async def recv(self, peer: int, key: tuple[int, ...], timeout: float | None = None) -> Any:
        """Wait for the array `peer` sent under `key` (TimeoutError after `timeout` seconds)."""

    @abc.abstractmethod
    def abandon(self, predicate) -> int:
        """Drop pending receives and unclaimed arrivals whose key matches `predicate`."""

    def expire(self, prefix: tuple[int, ...]) -> int:
        """A step (keys starting with `prefix`) is over: drop what is left of it, and whatever arrives for it
        later. The default only drops what is there now."""
        n = len(prefix)
        return self.abandon(lambda k: tuple(k[:n]) == prefix)

    def revive(self, prefix: tuple[int, ...]) -> None:
        """Keys starting with `prefix` are live again (a session reopened under the id of one that ended: a
        controller's new session on a daemon that closed its old one). The default remembers nothing expired."""

    @abc.abstractmethod
    def close(self) -> None: ...


def aligned_copy(frame: Any, nbytes: int) -> np.ndarray:
    """A fresh ALIGNMENT-aligned uint8 copy of `frame` (exactly `nbytes` bytes: checked by the caller). Under 64 KiB into a bytearray
    (zero-filled, then copied into in C: 1-2 us for 1 KiB, where `aligned_empty` and a numpy copy cost 4-9 us);
    bigger ones into `aligned_empty` (which does not zero its memory first)."""
    if nbytes >= 1 << 16:
        buf = aligned_empty(nbytes)
        buf[:] = np.frombuffer(frame, np.uint8)
        return buf
    raw = bytearray(nbytes + ALIGNMENT)
    offset = (-ctypes.addressof(ctypes.c_char.from_buffer(raw))) % ALIGNMENT
    raw[offset : offset + nbytes] = frame
    return np.frombuffer(raw, np.uint8, nbytes, offset)


def aligned_empty(nbytes: int) -> np.ndarray:
    """A fresh uint8 buffer whose start is ALIGNMENT-aligned (so JAX can alias it instead of copying)."""
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset : offset + nbytes]


def _time_out(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def computed(value: Any) -> np.ndarray:
    """`np.asarray(value)` once `value` is computed, raising the error of its computation if that failed: numpy
    reads a CPU jax.Array through the buffer protocol, and on an array whose computation failed XLA's check
    aborts the whole process (`Check failed: buffer_.IsConcrete()`) where `block_until_ready` raises."""
    wait = getattr(value, "block_until_ready", None)
    if wait is not None:
        wait()
    return np.asarray(value)


async def host_view(value: Any) -> np.ndarray:
    """A C-contiguous numpy view of a host array or a CPU jax.Array (waiting, off the loop, until it is computed)."""
    ready = getattr(value, "is_ready", None)
    host = await asyncio.to_thread(computed, value) if ready is not None and not ready() else computed(value)
    return host if host.flags.c_contiguous else np.ascontiguousarray(host).reshape(host.shape)  # (keeps 0-d arrays 0-d)


def host_id() -> str:
    """Identifies the machine and its shared-memory namespace: actors with equal ids can use shared memory."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    try:
        parts.append(str(os.stat("/dev/shm").st_dev))  # containers on one host get separate /dev/shm mounts
    except OSError:
        pass
    return ":".join(parts)
