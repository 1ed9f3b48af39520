"""What a controller does with buffers on its actors: fetch them, wait for them, free them.

`BufferClient` is the part of a `RemoteMesh` that `RemoteArray` uses (through the mesh's public `get_buffer`,
`get_buffers`, `wait_buffers`, `delete_buffers`, `release_buffers`). Frees of dropped arrays are batched per
actor within one loop turn and sent in order behind every step submitted before them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpmd.errors import ActorDiedError, MpmdError
from mpmd.runtime.controller import CLOSED_MEANWHILE, ActorConnection, EventLoopThread, close_unstarted
from transport.p2p import shm
from transport.protocol import MAX_IDS

log = logging.getLogger(__name__)


async def gather(coros: Sequence[Any]) -> list[Any]:
    """All of `coros` at once, their results in order."""
    return list(await asyncio.gather(*coros))


class BufferClient:
    """Buffer ids of one controller session, and the requests that read, wait for and free them."""

    def __init__(self, conns: list[ActorConnection], io: EventLoopThread, closed: Callable[[], bool],
                 out_lease: Callable[[int, list[int], bool], Any] | None = None) -> None:
        self._conns = conns  # the mesh's list: a reconnect replaces an entry in place
        self._io = io
        self._closed = closed
        # (actor, sizes, announce) -> the shared-memory segments of a get's large values (an OutputLease), None for an
        # actor on another host (mpmd/runtime/inputs.py: InputStager.output_lease)
        self._out_lease = out_lease
        self._no_shm: set[int] = set()  # actors whose segments could not be read (another user's daemon): inline
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

    def get(self, actor: int, buf: int, nbytes: int = 0) -> np.ndarray:
        """One buffer's value, read-only: a view that keeps the received frame alive (no copy), or the copy of what
        the actor wrote into shared memory (`nbytes`: its size, if known: a large value from an actor on this host
        comes so)."""
        return _read_only(self._run(self._get(actor, [buf], self._lease(actor, [nbytes])))[0])

    def _lease(self, actor: int, sizes: list[int], announce: bool = True) -> Any:
        """The shared-memory segments for the large values (by their `sizes`) of a get from `actor`, None when none
        goes so. Asked in the caller's thread: the first one announces the segments' prefix to the actor, a request
        of its own."""
        from mpmd.runtime.inputs import SHM_INPUT_MIN_BYTES

        if self._out_lease is None or actor in self._no_shm or not any(n >= SHM_INPUT_MIN_BYTES for n in sizes) or \
                self._io.on_loop_thread():
            return None
        return self._out_lease(actor, sizes, announce)

    def _get(self, actor: int, bufs: list[int], lease: Any) -> Any:
        """The coroutine of `_get_now`; its lease is released (as not answered) when the coroutine goes unstarted (a
        caller's await cancelled before the controller loop ran it: no finally of it runs)."""
        coro = self._get_now(actor, bufs, lease)
        if lease is not None:
            weakref.finalize(coro, lease.release, False)
        return coro

    async def _get_now(self, actor: int, bufs: list[int], lease: Any) -> list[np.ndarray]:
        """The values of `bufs` on `actor`, through the segments of `lease` (an OutputLease: one name per buffer, None:
        in the reply) when given."""
        fields: dict[str, Any] = {"bufs": bufs, **(lease.fields() if lease is not None else {})}
        answered = False
        try:
            reply = await self._conns[actor].request("get", fields)
            # (the actor's writing is over: it replies once its thread wrote; an error reply — a request that timed
            # out there, say — may come while that thread still writes: then the reused segments are dropped)
            answered = True
            notices = reply.header.get("shm") if lease is not None else None
            if notices is None:  # (all inline: small values, or a daemon that writes none)
                return list(reply.arrays)
            try:  # (copied out in a thread: a big one would hold every other reply on this loop)
                return await asyncio.to_thread(_values, actor, reply, notices, lease)
            except MpmdError as e:  # (another user's daemon on this host, say: its segments are not ours to read)
                if actor not in self._no_shm:
                    log.warning("%s; values from actor %d come in the reply from now on", e, actor)
                self._no_shm.add(actor)
                return list((await self._conns[actor].request("get", {"bufs": bufs})).arrays)
        finally:  # (a fresh one read is gone already; these are what a failure, or the actor's before it, left, and
            # the pooled ones' names, which the actor has mapped by now)
            if lease is not None:
                for name in lease.names:
                    if name is not None:
                        shm.unlink(name)
                lease.release(answered)

    def get_async(self, actor: int, buf: int, nbytes: int = 0) -> concurrent.futures.Future[np.ndarray]:
        """Start fetching one buffer; a concurrent future of its numpy array (`nbytes` as `get`'s, through shared
        memory only once the actor knows the segments' prefix: announcing it would wait for a reply here)."""
        if self._closed():
            raise MpmdError("this RemoteMesh is closed")
        inner = self._get(actor, [buf], self._lease(actor, [nbytes], announce=False))  # (made now: released if never run)

        async def get() -> np.ndarray:
            return _read_only((await inner)[0])

        return self._io.submit(get())

    def _gets(self, bufs: dict[int, list[int]], nbytes: dict[int, list[int]] | None = None,
              announce: bool = True) -> tuple[list[int], Any]:
        """The 'get' requests for `bufs`: one per actor, or one per MAX_IDS of them (a daemon's limit); `nbytes`:
        their sizes, if known (large values from actors on this host come through shared memory; `announce`: as
        `_lease`)."""
        parts = [(a, start, part) for a in sorted(bufs) for start, part in zip(itertools.count(0, MAX_IDS), in_parts(bufs[a]))]
        return [a for a, _, _ in parts], gather([
            self._get(a, b, self._lease(a, nbytes[a][start:start + len(b)], announce) if nbytes else None)
            for a, start, b in parts])

    @staticmethod
    def _joined(actors: list[int], replies: list[list[np.ndarray]]) -> dict[int, list[np.ndarray]]:
        out: dict[int, list[np.ndarray]] = defaultdict(list)
        for a, r in zip(actors, replies):
            out[a].extend(_read_only(x) for x in r)
        return dict(out)

    def get_many(self, bufs: dict[int, list[int]], nbytes: dict[int, list[int]] | None = None) -> dict[int, list[np.ndarray]]:
        """Several buffers per actor, one request per actor (per MAX_IDS), all actors at once; `nbytes`: their
        sizes, as `get`'s."""
        actors, requests = self._gets(bufs, nbytes)
        return self._joined(actors, self._run(requests))

    async def get_many_async(self, bufs: dict[int, list[int]], nbytes: dict[int, list[int]] | None = None) -> dict[int, list[np.ndarray]]:
        """`get_many`, awaited from the caller's event loop (the requests run on the controller's; through shared
        memory only once the actor knows the segments' prefix, as `get_async`)."""
        actors, requests = self._gets(bufs, nbytes, announce=False)
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


def _values(actor: int, reply: Any, notices: Any, lease: Any) -> list[np.ndarray]:
    """A get's values from its reply: inline frames, and those the actor wrote into the request's segments (its
    `notices`: one per buffer, None for an inline one; a buffer named twice is written once)."""
    names = lease.names
    given = {n for n in names if n is not None}
    if not isinstance(notices, list) or len(notices) != len(names) or len(reply.arrays) != sum(n is None for n in notices) \
            or any(n is not None and (not isinstance(n, dict) or not isinstance(n.get("name"), str) or n["name"] not in given)
                   for n in notices):
        raise MpmdError(f"actor {actor}'s reply to a fetch of {len(names)} values does not match it ({len(reply.arrays)} "
                        f"inline, segment notices {notices!r:.200})")
    frames, read = iter(reply.arrays), {}
    out = []
    for n in notices:
        if n is None:
            out.append(next(frames))
        else:
            if n["name"] not in read:
                read[n["name"]] = lease.read(n, n["name"])
            out.append(read[n["name"]])
    return out


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
