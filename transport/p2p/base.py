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
import os
import socket
from collections.abc import Hashable
from typing import Any

import numpy as np

ALIGNMENT = 64  # bytes; JAX aliases (does not copy) host arrays aligned like this


class TransferError(RuntimeError):
    """A transfer failed: the peer is unknown or gone, or the data is not what the receiver expected."""


class Mailbox:
    """Futures keyed by (source actor, key); whichever side comes first creates the entry."""

    def __init__(self) -> None:
        self._slots: dict[tuple[int, Hashable], asyncio.Future[Any]] = {}

    def _slot(self, src: int, key: Hashable) -> asyncio.Future[Any]:
        fut = self._slots.get((src, key))
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._slots[(src, key)] = fut
        return fut

    def deliver(self, src: int, key: Hashable, value: Any) -> None:
        fut = self._slot(src, key)
        if not fut.done():
            fut.set_result(value)

    def fail(self, src: int, key: Hashable, exc: BaseException) -> None:
        fut = self._slot(src, key)
        if not fut.done():
            fut.set_exception(exc)

    async def take(self, src: int, key: Hashable) -> Any:
        fut = self._slot(src, key)
        try:
            return await fut
        finally:
            if fut.done():
                self._slots.pop((src, key), None)

    def drop(self, predicate) -> int:
        """Forget arrived or awaited entries whose key matches (used to abandon an aborted step)."""
        doomed = [k for k in self._slots if predicate(k[1])]
        for k in doomed:
            fut = self._slots.pop(k)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: no "exception never retrieved" noise
        return len(doomed)

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
    async def recv(self, peer: int, key: tuple[int, ...]) -> Any:
        """Wait for the array `peer` sent under `key`."""

    @abc.abstractmethod
    def abandon(self, predicate) -> int:
        """Drop pending receives and unclaimed arrivals whose key matches `predicate`."""

    @abc.abstractmethod
    def close(self) -> None: ...


def aligned_empty(nbytes: int) -> np.ndarray:
    """A fresh uint8 buffer whose start is ALIGNMENT-aligned (so JAX can alias it instead of copying)."""
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset : offset + nbytes]


async def host_view(value: Any) -> np.ndarray:
    """A C-contiguous numpy view of a host array or a CPU jax.Array (waiting, off the loop, until it is computed)."""
    ready = getattr(value, "is_ready", None)
    host = await asyncio.to_thread(np.asarray, value) if ready is not None and not ready() else np.asarray(value)
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
