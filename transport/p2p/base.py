"""The data-plane interface every transport implements.

Transfers are matched by ``(peer, key)``: a key is a tuple of ints (the runtime uses
``(program, step, tag)``), so any number of transfers can be in flight between the same pair, in both
directions, and arrive in any order. A message that arrives before its receive is posted waits in a
mailbox; a receive posted first waits for its message.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Hashable

import numpy as np


class TransferError(RuntimeError):
    """A transfer failed: the peer is unknown or gone, or the data is not what the receiver expected."""


class Mailbox:
    """Futures keyed by (source actor, key); whichever side comes first creates the entry."""

    def __init__(self) -> None:
        self._slots: dict[tuple[int, Hashable], asyncio.Future[np.ndarray]] = {}

    def _slot(self, src: int, key: Hashable) -> asyncio.Future[np.ndarray]:
        fut = self._slots.get((src, key))
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._slots[(src, key)] = fut
        return fut

    def deliver(self, src: int, key: Hashable, array: np.ndarray) -> None:
        fut = self._slot(src, key)
        if not fut.done():
            fut.set_result(array)

    async def take(self, src: int, key: Hashable) -> np.ndarray:
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
        return len(doomed)

    def __len__(self) -> int:
        return len(self._slots)


class P2PTransport(abc.ABC):
    """One actor's endpoint of the data plane."""

    actor_id: int

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this actor (sent to the controller, which tells the peers)."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def connect(self, peers: dict[int, str]) -> None:
        """Open connections to `peers` ({actor id: address})."""

    @abc.abstractmethod
    async def send(self, peer: int, key: tuple[int, ...], array: np.ndarray) -> None:
        """Queue `array` for `peer`. Returns once the transport no longer needs the caller to wait."""

    @abc.abstractmethod
    async def recv(self, peer: int, key: tuple[int, ...]) -> np.ndarray:
        """Wait for the array `peer` sent under `key`."""

    @abc.abstractmethod
    def abandon(self, predicate) -> int:
        """Drop pending receives and unclaimed arrivals whose key matches `predicate`."""

    @abc.abstractmethod
    def close(self) -> None: ...
