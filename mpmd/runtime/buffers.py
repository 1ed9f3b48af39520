"""What a controller does with buffers on its actors: fetch them, wait for them, free them.

`BufferClient` is the part of a `RemoteMesh` that `RemoteArray` uses (through the mesh's public `get_buffer`,
`get_buffers`, `wait_buffers`, `delete_buffers`, `release_buffers`). Frees of dropped arrays are batched per
actor within one loop turn and sent in order behind every step submitted before them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpmd.errors import ActorDiedError, MpmdError
from mpmd.runtime.controller import CLOSED_MEANWHILE, ActorConnection, EventLoopThread, close_unstarted
from transport.protocol import MAX_IDS


async def gather(coros: Sequence[Any]) -> list[Any]:
    """All of `coros` at once, their results in order."""
    return list(await asyncio.gather(*coros))


class BufferClient:
    """Buffer ids of one controller session, and the requests that read, wait for and free them."""

    def __init__(self, conns: list[ActorConnection], io: EventLoopThread, closed: Callable[[], bool]) -> None:
        self._conns = conns  # the mesh's list: a reconnect replaces an entry in place
        self._io = io
        self._closed = closed
        self._ids = itertools.count(1)
        self._garbage: list[tuple[int, int]] = []  # touched on the loop thread only

    def new_id(self) -> int:
        return next(self._ids)

    def _run(self, coro: Any) -> Any:
        if self._closed():
            close_unstarted(coro)
            raise MpmdError("this RemoteMesh is closed")
        try:
            return self._io.run(coro)
        except (ActorDiedError, concurrent.futures.CancelledError) as e:  # (the close's doing, not a lost actor; a probe
            if self._closed():  # saw a bare CancelledError, and "actor 0 died ... exited with code 0")
                raise MpmdError(CLOSED_MEANWHILE) from e
            raise

    def get(self, actor: int, buf: int) -> np.ndarray:
        """One buffer's value: a read-only view that keeps the received frame alive (no copy)."""
        return _read_only(self._run(self._conns[actor].request("get", {"buf": buf})).arrays[0])

    def get_async(self, actor: int, buf: int) -> concurrent.futures.Future[np.ndarray]:
        """Start fetching one buffer; a concurrent future of its numpy array."""

        async def get() -> np.ndarray:
            return _read_only((await self._conns[actor].request("get", {"buf": buf})).arrays[0])

        if self._closed():
            raise MpmdError("this RemoteMesh is closed")
        return self._io.submit(get())

    def _gets(self, bufs: dict[int, list[int]]) -> tuple[list[int], Any]:
        """The 'get' requests for `bufs`: one per actor, or one per MAX_IDS of them (a daemon's limit)."""
        parts = [(a, part) for a in sorted(bufs) for part in in_parts(bufs[a])]
        return [a for a, _ in parts], gather([self._conns[a].request("get", {"bufs": b}) for a, b in parts])

    @staticmethod
    def _joined(actors: list[int], replies: list[Any]) -> dict[int, list[np.ndarray]]:
        out: dict[int, list[np.ndarray]] = defaultdict(list)
        for a, r in zip(actors, replies):
            out[a].extend(_read_only(x) for x in r.arrays)
        return dict(out)

    def get_many(self, bufs: dict[int, list[int]]) -> dict[int, list[np.ndarray]]:
        """Several buffers per actor, one request per actor (per MAX_IDS), all actors at once."""
        actors, requests = self._gets(bufs)
        return self._joined(actors, self._run(requests))

    async def get_many_async(self, bufs: dict[int, list[int]]) -> dict[int, list[np.ndarray]]:
        """`get_many`, awaited from the caller's event loop (the requests run on the controller's)."""
        actors, requests = self._gets(bufs)
        return self._joined(actors, await self._arun(requests))

    def wait(self, bufs: dict[int, list[int]]) -> None:
        """Until every listed buffer is computed on its actor."""
        self._run(gather([self._conns[a].request("wait", {"bufs": p}) for a, b in bufs.items() for p in in_parts(b)]))

    async def wait_async(self, bufs: dict[int, list[int]]) -> None:
        """`wait`, awaited from the caller's event loop."""
        await self._arun(gather([self._conns[a].request("wait", {"bufs": p}) for a, b in bufs.items() for p in in_parts(b)]))

    async def _arun(self, coro: Any) -> Any:
        if self._closed():
            close_unstarted(coro)
            raise MpmdError("this RemoteMesh is closed")
        return await self._io.arun(coro)

    def delete_now(self, buffers: dict[int, int]) -> None:
        """Free one buffer per actor and wait for the actors to confirm."""
        self._run(gather([self._conns[a].request("delete", {"bufs": [b]}) for a, b in buffers.items()]))

    def release(self, buffers: dict[int, int]) -> None:
        """Free buffers whose RemoteArray is gone (from any thread). The release joins the loop's queue in call
        order, so it can never overtake a step dispatched earlier that still reads those buffers."""
        if not self._closed():
            self._io.call_soon(self._collect, buffers)

    def _collect(self, buffers: dict[int, int]) -> None:
        first = not self._garbage
        self._garbage.extend(buffers.items())
        if first:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        garbage, self._garbage = self._garbage, []
        by_actor: dict[int, list[int]] = defaultdict(list)
        for a, b in garbage:
            by_actor[a].append(b)
        for a, bufs in by_actor.items():
            if not self._conns[a].dead:
                try:  # sent now, in order behind everything submitted before
                    for part in in_parts(bufs):
                        asyncio.get_running_loop().create_task(_quiet(self._conns[a].submit("delete", {"bufs": part})))
                except MpmdError:
                    pass


def in_parts(ids: list[int]) -> list[list[int]]:
    """`ids` in lists of at most MAX_IDS, what one request may name (an empty list stays one empty part)."""
    return [ids[i:i + MAX_IDS] for i in range(0, max(len(ids), 1), MAX_IDS)]


async def _quiet(coro: Any) -> None:
    try:
        await coro
    except Exception:
        pass


def _read_only(a: np.ndarray) -> np.ndarray:
    """A fetched value as jax hands a jax.Array's out: read-only. An array caches what it fetched (`jax.device_get`
    starts it), so a writable one let a caller's `host /= 8` change every later fetch of it (a probe)."""
    a.flags.writeable = False
    return a
