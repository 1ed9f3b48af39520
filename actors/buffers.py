"""Buffer table: buffer id -> jax.Array, or a future for a buffer still being produced or received."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


class UnknownBufferError(KeyError):
    """A request named a buffer id this actor does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown buffer"


def _find_collector() -> Any:
    try:
        from jax._src.lib import _jax

        return _jax.collect_garbage
    except (ImportError, AttributeError):
        return lambda: None  # older/newer JAX: its next dispatch collects instead


_collect = None


def release_host_memory() -> None:
    """Make JAX drop, now, its references to host memory that freed arrays aliased.

    JAX defers those Python decrefs to its next dispatch; a received array aliases a shared-memory segment
    that the sender may reuse only after the last reference is gone, so the actor runs this after freeing."""
    global _collect
    if _collect is None:
        _collect = _find_collector()
    _collect()


def nbytes(value: Any) -> int:
    return int(getattr(value, "nbytes", 0))


class BufferTable:
    """Holds arrays by id. Readers of a pending entry wait; a failed producer fails its readers.

    A step's own table (`remember_failures`) also keeps why an entry failed, for readers that come after the
    failure (a Run reaching a buffer whose receive already timed out). The session's table does not: a failure
    holds a traceback, and with it whatever its frames held, for as long as the entry would be kept.

    Deleting an entry that is still pending forgets its name at once (later lookups fail) but keeps its
    waiters: a step that took it as an input before the delete arrived still gets the value, and the value
    is dropped as soon as it comes."""

    def __init__(self, name: str = "actor", remember_failures: bool = False) -> None:
        self._name = name
        self._remember = remember_failures  # a step's own table (dropped with the step): late readers get the reason
        self._entries: dict[int, Any] = {}
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._orphans: dict[int, asyncio.Future[Any]] = {}  # deleted while pending: resolved, never stored
        self._failed: dict[int, BaseException] = {}  # failed while pending: a later reader gets the reason, not "unknown"
        self._sizes: dict[int, int] = {}  # bytes of each entry (a jax.Array's .nbytes costs microseconds)
        self._bytes = 0
        self.peak_bytes = 0  # the most bytes held at once

    def put(self, buf: int, value: Any, size: int | None = None) -> None:
        """Store `value` as `buf` (`size`: its bytes, when the caller knows them already)."""
        self._failed.pop(buf, None)
        orphan = self._orphans.pop(buf, None)
        if orphan is not None:
            if not orphan.done():
                orphan.set_result(value)
            return
        size = nbytes(value) if size is None else size
        self._bytes += size - self._sizes.get(buf, 0)
        self._sizes[buf] = size
        if self._bytes > self.peak_bytes:
            self.peak_bytes = self._bytes
        self._entries[buf] = value
        fut = self._pending.pop(buf, None)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def reserve(self, buf: int) -> None:
        """Mark `buf` as coming: `get` waits for `put` (or `fail`) instead of raising."""
        if self._entries.pop(buf, None) is not None:
            self._bytes -= self._sizes.pop(buf, 0)
        self._failed.pop(buf, None)
        if buf not in self._pending:
            self._pending[buf] = asyncio.get_running_loop().create_future()

    def fail(self, buf: int, exc: BaseException) -> None:
        """`buf` will not come: its waiters, and whoever asks for it later (until it is deleted), get `exc`."""
        fut = self._pending.pop(buf, None)
        if fut is not None:
            if self._remember:
                self._failed[buf] = exc
        else:
            fut = self._orphans.pop(buf, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: readers may never come

    async def produce(self, bufs: Sequence[int], values: Awaitable[Sequence[Any]],
                      error: Callable[[BaseException], BaseException] = lambda e: e) -> Sequence[Any]:
        """Await the `values` of the reserved `bufs` and store them; returns them. If that raises, every buf
        fails with `error(exception)` (its readers get that), and the exception goes on."""
        try:
            got = await values
        except BaseException as e:
            for b in bufs:
                self.fail(b, error(e))
            raise
        for b, v in zip(bufs, got):
            self.put(b, v)
        return got

    def has_value(self, buf: int) -> bool:
        return buf in self._entries

    def has(self, buf: int) -> bool:
        return buf in self._entries or buf in self._pending

    def get_now(self, buf: int) -> Any:
        try:
            return self._entries[buf]
        except KeyError:
            raise UnknownBufferError(self._unknown(buf)) from None

    def ref(self, buf: int) -> Any:
        """The value now if present, else the pending future: taken synchronously, awaited later."""
        if buf in self._entries:
            return self._entries[buf]
        fut = self._pending.get(buf)
        if fut is None:
            if buf in self._failed:
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(self._failed[buf])
                fut.exception()  # retrieved: the caller awaits it, or drops it quietly
                return fut
            raise UnknownBufferError(self._unknown(buf))
        return fut

    def all_now(self, bufs: Any) -> list[Any] | None:
        """The values of `bufs` if every one is here now (no awaiting), else None."""
        entries = self._entries
        try:
            return [entries[b] for b in bufs]
        except KeyError:
            return None

    async def get(self, buf: int) -> Any:
        got = self.ref(buf)
        return await asyncio.shield(got) if isinstance(got, asyncio.Future) else got

    def delete(self, bufs: list[int]) -> int:
        n = 0
        for b in bufs:
            old = self._entries.pop(b, None)
            if old is not None:
                self._bytes -= self._sizes.pop(b, 0)
            fut = self._pending.pop(b, None)
            if fut is not None:
                self._orphans[b] = fut
            failed = self._failed.pop(b, None)
            n += (old is not None) + (fut is not None) + (failed is not None)
        if n:
            release_host_memory()
        return n

    def _unknown(self, buf: int) -> str:
        return f"{self._name} holds no buffer {buf} ({len(self._entries)} buffers held); was it deleted or never put?"

    def clear(self) -> None:
        """Drop everything; entries still coming are cancelled (their producers are gone)."""
        waiting = [*self._pending.values(), *self._orphans.values()]
        self._pending, self._orphans, self._failed = {}, {}, {}
        self.delete(list(self._entries))
        for fut in waiting:
            if not fut.done():
                fut.cancel()

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[Any]:
        """The values held now (not those still coming)."""
        return list(self._entries.values())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def size_of(self, buf: int) -> int:
        """The bytes `buf` holds now (0: none, or not yet computed)."""
        return self._sizes.get(buf, 0)
