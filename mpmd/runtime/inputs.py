"""A step's large host arguments, handed to actors on this host through shared memory.

Sent inline, a host batch is encrypted by the controller's ZeroMQ I/O thread into every step request (about
5 ms for 4 MiB under CURVE) and decrypted by the actor's, work that lands on the pipeline's critical path.
For an actor on the controller's own host, `InputStager` writes every host argument of at least
`SHM_INPUT_MIN_BYTES` into a shared-memory segment made for that actor alone (mode 600, named with a prefix
the actor was told once over the authenticated control plane) in the calling thread — while the previous
step still runs — and the request carries only a small notice per argument (see actors/inputs.py for what
the actor checks). A segment is written again only after the request that read it has been answered; each
actor has up to `MAX_SEGMENTS` of them (fewer for batches so big that they would pass `POOL_BYTES`, but at
least `MIN_SEGMENTS`), so a training loop that dispatches several steps ahead, as JAX users do, stages each
one. When all are still in use (the caller is further ahead still), a step call waits for a reply to free
one (up to `STAGE_WAIT`; `call_async` does not wait, being on the caller's loop) and only then sends the
arguments inline: each inline batch is encrypted by the controller's ZeroMQ thread and decrypted by the
actor, on the cores the pipeline computes on (a loop of 20 steps dispatched back to back sent 12 of them
inline and cost the controller's I/O thread 3.3 ms per step; with 3 segments, 2 of every 5 batches of
benchmarks/efficiency had gone inline).

The other way, a large value fetched from an actor on this host (`output_lease`, `OutputLease.read`): the `get`
request names a segment of the actor's prefix for each value, the actor copies the value in (actors/inputs.py), and
it is copied out here (through ZeroMQ's CURVE a 64 MiB get ran at 0.14-0.21 GiB/s, a quarter of a put). The segments
are this stager's, kept per actor for the next gets (up to OUTPUT_SEGMENTS per actor and OUTPUT_POOL_BYTES for the
mesh; one idle for OUTPUT_IDLE seconds is dropped by a later get; a get that finds none free names a fresh one,
which the actor makes): a fresh 64 MiB segment costs ~42 ms of tmpfs pages, the copies
in and out ~6 and ~14. A pooled segment is named once — the actor maps it at its first get and keeps the mapping, and
its name is unlinked after that get — and goes back to the pool only when its get's reply came (a get cancelled or
failed on the way drops it: the actor's thread may still write into it), which the next get tells the actor
(``forget``).
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpmd.errors import MpmdError
from mpmd.runtime.launch.local import host_memory
from transport.p2p import shm
from transport.p2p.base import host_id
from transport.protocol import ProtocolError, array_spec, dtype_name

log = logging.getLogger(__name__)

SHM_INPUT_MIN_BYTES = 64 << 10  # smaller arguments go inline: a notice and a mapping cost more than their bytes
MAX_SEGMENTS = 8  # per actor: the step running, the ones queued behind it, the one being written
MIN_SEGMENTS = 3  # per actor whatever their size: the step running, the next one queued, the one being written
POOL_BYTES = 1 << 30  # per actor: beyond MIN_SEGMENTS, no new segment past this many bytes in all
NO_ROOM_RETRY = 10.0  # seconds after /dev/shm had no room for a segment before another is tried (meanwhile inline)
STAGE_WAIT = 60.0  # seconds a step call waits for a segment to be freed before its arguments go inline
ONCE_IN_FLIGHT = 16  # one-shot segments (puts) per actor in flight before more go inline (an actor maps at most 64)
ALIGN = 64  # each argument starts 64-byte aligned, as JAX likes host memory
OUTPUT_SEGMENTS = 8  # pooled get segments per actor (a get that finds none free names a fresh one)
OUTPUT_POOL_BYTES = 512 << 20  # their bytes at most, all actors of the mesh together (memory of /dev/shm, held)
_WHOLE = re.compile(r"[0-9a-f]{8,32}-")  # the random part an actor adds to an announced prefix (actors/inputs.py)
OUTPUT_IDLE = 60.0  # seconds a pooled get segment may sit unused before a later get drops it


@dataclass
class Segment:
    name: str
    size: int
    mm: mmap.mmap
    busy: bool = False
    ino: int = 0  # its file's inode, in each notice: the actor maps only the file this controller made
    used: float = 0.0  # when a get last took it (pooled get segments)


class ReusedSegments:
    """Segments of one direction kept for the next transfers of a mesh's local actors (big gets and puts): a fresh
    64 MiB segment costs ~42 ms of tmpfs pages, a copy into a warm one ~6. Up to OUTPUT_SEGMENTS per actor and
    OUTPUT_POOL_BYTES in all (memory of /dev/shm, held: no timer lets them go, a later take drops those idle for
    OUTPUT_IDLE seconds, the mesh's close all). A dropped one's name is kept for the actor (`told`), which unmaps it
    when its next request of that direction says so (until then its mapping holds the memory). Used with the
    stager's lock held."""

    def __init__(self) -> None:
        self.pools: dict[int, list[Segment]] = {}
        self.told: dict[int, list[str]] = {}  # actor -> names dropped here, to tell it
        self.failed_until = 0.0  # (monotonic) no segment is made before then: /dev/shm had no room for one

    def take(self, actor: int, nbytes: int, name: Callable[[], str], no_room: bool) -> Segment | None:
        """A free segment of `actor`'s of at least `nbytes` (made now, named `name()`, if there is room and /dev/shm
        had lately: `no_room` False, and none of this pool failed for NO_ROOM_RETRY seconds), marked busy; None: none."""
        now = time.monotonic()
        for a, segs in self.pools.items():  # (idle ones go: a burst of transfers does not hold /dev/shm for good)
            for seg in [s for s in segs if not s.busy and now - s.used > OUTPUT_IDLE]:
                self.drop(a, seg)
        pool = self.pools.setdefault(actor, [])
        fit = min((s for s in pool if not s.busy and s.size >= nbytes), key=lambda s: s.size, default=None)
        if fit is None:
            size = shm.size_class(nbytes)
            held = sum(s.size for segs in self.pools.values() for s in segs)
            if len(pool) >= OUTPUT_SEGMENTS or held + size > OUTPUT_POOL_BYTES or no_room or self.failed_until > now:
                return None
            made = name()
            try:
                mm, ino = shm.create_segment(made, size)
            except OSError:  # (no room in /dev/shm: this transfer goes through a fresh segment, or inline; none is tried
                self.failed_until = now + NO_ROOM_RETRY  # again for a while, or each big transfer paid a failed one)
                return None
            fit = Segment(made, size, mm, ino=ino)
            pool.append(fit)
        fit.busy, fit.used = True, now
        return fit

    def release(self, actor: int, seg: Segment, answered: bool) -> None:
        """The transfer through `seg` is over: back to the pool when its reply came (the actor is done with it), else
        dropped — a cancelled transfer's actor thread may still be copying."""
        if answered and seg in self.pools.get(actor, []):
            seg.busy = False
        else:
            self.drop(actor, seg)

    def drop(self, actor: int, seg: Segment) -> None:
        pool = self.pools.get(actor, [])
        if seg in pool:
            pool.remove(seg)
            self.told.setdefault(actor, []).append(seg.name)
        _close(seg)

    def reset(self, actor: int) -> None:
        """A new daemon for `actor` (a reconnect): it maps none of them."""
        for seg in self.pools.pop(actor, []):  # (one a transfer holds now is dropped by its release)
            _close(seg)
        self.told.pop(actor, None)

    def close(self) -> None:
        _close_all(self.pools)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class InputStager:
    """The input segments of one mesh's actors (see the module docstring). `stage` runs in the caller's thread,
    a lease's release on the controller loop; a lock keeps the pools consistent between them."""

    def __init__(self, mesh: Any, min_bytes: int = SHM_INPUT_MIN_BYTES, max_segments: int = MAX_SEGMENTS,
                 pool_bytes: int = POOL_BYTES) -> None:
        self._mesh = weakref.ref(mesh)  # (the mesh keys the stager in a weak map: no strong reference back)
        self.min_bytes = min_bytes
        self.max_segments = max_segments
        self.pool_bytes = pool_bytes
        self._base = f"/mpmd-in-{os.getpid():x}-{secrets.token_hex(4)}-"
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified when a reply releases a segment
        self._announcing = threading.Lock()  # held while a prefix is announced to an actor (a request: never under _lock)
        self._pools: dict[int, list[Segment]] = {}
        self._retired: dict[int, list[str]] = {}  # actor -> segments closed here that it may still have mapped
        self._prefixes: dict[int, str] = {}  # actor -> its whole prefix (the announced one and the actor's random part)
        self._told: dict[int, Any] = {}  # actor -> the connection its prefix was announced on (a reconnect asks again)
        self._local: dict[int, bool] = {}
        self.staged = 0  # arguments written to shared memory
        self.fallbacks = 0  # steps whose arguments went inline because every segment was still in use
        self.waits = 0  # steps whose caller waited for a segment to be freed
        self.shm_failures = 0  # segments /dev/shm had no room for (their steps went inline)
        self._no_room_until: dict[int, float] = {}  # actor -> until when no new segment is tried (/dev/shm was full)
        self._once: dict[int, int] = {}  # actor -> one-shot segments (puts) in flight
        self._once_bytes = 0  # their bytes, every actor's: each actor's copy of one is still to be made
        self.gets = ReusedSegments()  # what the actors write big gets' values into (see the module docstring)
        self.puts = ReusedSegments()  # what big puts are written into for them
        weakref.finalize(self, _close_all, self._pools, os.getpid())
        weakref.finalize(self, _close_all, self.gets.pools, os.getpid())
        weakref.finalize(self, _close_all, self.puts.pools, os.getpid())

    @property
    def mesh(self) -> Any:
        mesh = self._mesh()
        if mesh is None:
            raise RuntimeError("the mesh of these input segments is gone")
        return mesh

    def prefix(self, actor: int) -> str:
        """The prefix of `actor`'s segment names: the one announced to it and the random part it added (before that
        answer: the part announced)."""
        return self._prefixes.get(actor) or f"{self._base}{actor}-"

    def wants(self, actor: int, nbytes: int) -> bool:
        """Should an argument of `nbytes` for `actor` go through shared memory?"""
        return nbytes >= self.min_bytes and self._is_local(actor)

    def _is_local(self, actor: int) -> bool:
        conn = self.mesh.conn(actor)
        if self._told.get(actor) is conn:
            return self._local[actor]
        with self._announcing:  # (two threads' first steps at once: announced once, else the second unlinked the first's segment)
            if self._told.get(actor) is conn:
                return self._local[actor]
            return self._announce(actor, conn)

    def _announce(self, actor: int, conn: Any) -> bool:
        local = shm.available() and self._same_host(actor)
        if local:
            announced = f"{self._base}{actor}-"
            try:  # (a daemon without the op, or without shared memory, keeps getting its arguments inline)
                whole = self.mesh.run(conn.request("input_shm", {"prefix": announced})).header.get("prefix")
                if not (isinstance(whole, str) and whole.startswith(announced) and _WHOLE.fullmatch(whole[len(announced):])):
                    raise ProtocolError(f"its 'input_shm' reply names the prefix {whole!r:.100}, not {announced!r} and a random part")
            except Exception as e:
                log.warning("actor %d takes no shared-memory inputs (%s); its arguments go inline", actor, e)
                local = False
            else:
                self._prefixes[actor] = whole
        with self._lock:  # a new daemon behind a reconnect has none of the old segments mapped: start afresh
            for seg in self._pools.pop(actor, []):
                _close(seg)
            self._retired.pop(actor, None)
            self.gets.reset(actor)
            self.puts.reset(actor)
        self._told[actor], self._local[actor] = conn, local
        return local

    def _same_host(self, actor: int) -> bool:
        info = self.mesh.infos[actor].header
        p2p = info.get("p2p")
        if isinstance(p2p, dict) and p2p.get("host") is not None:
            return p2p["host"] == host_id()
        return any(p.actor_id == actor for p in getattr(self.mesh, "processes", ()))

    def output_lease(self, actor: int, sizes: list[int], announce: bool = True) -> OutputLease | None:
        """The segments a `get` from `actor` of values of `sizes` bytes has them written into (None for a value
        under the threshold: in the reply); None when it does not share this host (or, without `announce`, has not
        been told the prefix yet). Release it once the get is over (`OutputLease.release`)."""
        if not announce and self._told.get(actor) is not self.mesh.conn(actor):
            return None
        if not self._is_local(actor):
            return None
        lease = OutputLease(self, actor)
        with self._lock:
            lease.forget = self.gets.told.pop(actor, [])
            for n in sizes:
                seg = self.gets.take(actor, n, lambda: self._name(actor), self._no_room_for(actor)) if n >= self.min_bytes else None
                if seg is not None:
                    lease.segments[seg.name] = seg
                lease.names.append(None if n < self.min_bytes else seg.name if seg is not None
                                   else self._name(actor))  # (a fresh one the actor makes)
                lease.pooled.append(seg.ino if seg is not None else 0)
        return lease

    def _current(self, actor: int, names: list[str]) -> list[str]:
        """Those of `names` under `actor`'s prefix now (a reconnect gives it another random part)."""
        prefix = self.prefix(actor)
        return [n for n in names if n.startswith(prefix)]

    def _name(self, actor: int) -> str:
        """A segment name of `actor`'s prefix never given before (next() holds the GIL: each name once)."""
        return f"{self.prefix(actor)}{next(self._names)}"

    def stage(self, actor: int, arrays: list[np.ndarray], layouts: list[Any],
              wait: float = 0.0) -> tuple[list[dict[str, Any]], Callable[[], None]] | None:
        """Write `arrays` into one free segment of `actor`'s; the request's notices and the release to call once
        its reply has come. When every segment is in use, wait up to `wait` seconds for a reply to free one
        (a caller that many steps ahead gains nothing by going further: backpressure, as a bounded prefetch
        queue gives), then None (send them inline)."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += _aligned(a.nbytes)
        seg = self._acquire(actor, total)
        if seg is None and wait > 0 and not self._no_room_for(actor):  # (no room in /dev/shm: waiting frees none)
            deadline = time.monotonic() + wait
            with self._freed:
                while seg is None and deadline > time.monotonic():
                    self._freed.wait(min(1.0, deadline - time.monotonic()))
                    seg = self._take(actor, total)
                if seg is not None:
                    self.waits += 1
        if seg is None:
            self.fallbacks += 1
            return None
        notices = [_write(seg, a, off, lay) for a, off, lay in zip(arrays, offsets, layouts)]
        self.staged += len(arrays)
        with self._lock:
            retired = self._retired.pop(actor, [])
        if retired:
            notices[0]["retire"] = retired  # closed here: the actor unmaps them (its mappings stay bounded)

        def release() -> None:
            with self._freed:
                seg.busy = False
                self._freed.notify_all()

        return notices, release

    def stage_once(self, actor: int, array: np.ndarray) -> tuple[dict[str, Any], Callable[[bool], None]] | None:
        """A segment for one array (a put), written, and the notice to send; call `done(answered)` when the request
        is over. One of the reused put segments (`puts`: the actor keeps its mapping, and unmaps one dropped here when a
        later notice's ``retire`` names it; not the step arguments' pool, whose segments a big put kept, twice its size,
        for the mesh's life: a review), else one of its own, gone at `done` (the actor unmaps it after copying the
        array out: ``once``). None (send it inline): ONCE_IN_FLIGHT of the actor's are in flight already, or /dev/shm
        has no room for it. An MpmdError when the host has not the memory for the segment and the actor's copy of it
        at once (the put went ahead, a 16 GiB one into a 24 GiB machine's /dev/shm, on its way to the OOM killer; a
        probe)."""
        memory = host_memory()
        free = memory.get("MemAvailable") if memory else None
        if free is not None and 2 * array.nbytes + self._once_bytes > free:  # (+ the actor copies of the puts in flight:
            # a put to several actors of this host writes a segment for each before any copies it)
            raise MpmdError(f"put: an array of {array.nbytes / 2**20:.1f} MiB ({array.dtype}{list(array.shape)}) for actor {actor}, "
                            f"which shares this host, needs about twice that in memory at once (the shared-memory copy it "
                            f"travels in and the actor's own), and this host has {free / 2**20:.1f} MiB available: put it in "
                            "parts (split along an axis), or shard it over the actor's devices (put(x, spec)), or free memory")
        with self._lock:
            if self._once.get(actor, 0) >= ONCE_IN_FLIGHT:
                return None
            self._once[actor] = self._once.get(actor, 0) + 1
            self._once_bytes += array.nbytes
            reused = self.puts.take(actor, array.nbytes, lambda: self._name(actor), self._no_room_for(actor))
            retire = self.puts.told.pop(actor, [])
        if reused is not None:
            once = threading.Lock()

            def release(answered: bool = False) -> None:
                if once.acquire(blocking=False):  # (once: from the reply, or when the request is dropped unsent)
                    with self._lock:
                        self.puts.release(actor, reused, answered)
                        if not answered and retire:  # (they may not have reached the actor: told again, those of the
                            # prefix it has now: a reconnect meanwhile gave another, and the actor refused every put
                            # that listed an old one; a review)
                            self.puts.told.setdefault(actor, [])[:0] = self._current(actor, retire)
                    self._once_done(actor, array.nbytes)

            try:
                notice = _write(reused, array, 0)
            except BaseException:
                release(False)
                raise
            if retire:
                notice["retire"] = retire  # (dropped here: the actor unmaps them)
            return notice, release
        if retire:
            with self._lock:  # (told with the next put that has a notice of its own to carry them)
                self.puts.told.setdefault(actor, [])[:0] = self._current(actor, retire)
        name = self._name(actor)
        try:
            mm, ino = shm.create_segment(name, _aligned(max(array.nbytes, 1)))
        except OSError:  # (no room: this put goes inline; the step arguments' pool is not marked full for it)
            self._once_done(actor, array.nbytes)
            return None
        seg = Segment(name, len(mm), mm, ino=ino)
        notice = {**_write(seg, array, 0), "once": True}
        done_once = threading.Lock()

        def done(answered: bool = False) -> None:
            if done_once.acquire(blocking=False):  # (once: from the reply, or when the request is dropped unsent)
                _close(seg)
                self._once_done(actor, array.nbytes)

        return notice, done

    def _once_done(self, actor: int, nbytes: int) -> None:
        with self._lock:
            self._once[actor] -= 1
            self._once_bytes -= nbytes

    def _acquire(self, actor: int, nbytes: int) -> Segment | None:
        with self._lock:
            return self._take(actor, nbytes)

    def _take(self, actor: int, nbytes: int) -> Segment | None:
        """`_acquire` with the lock held."""
        pool = self._pools.setdefault(actor, [])
        free = [s for s in pool if not s.busy]
        fit = min((s for s in free if s.size >= nbytes), key=lambda s: s.size, default=None)
        if fit is None:
            size = shm.size_class(nbytes)

            def full(segs: list[Segment]) -> bool:  # no room beside `segs` for one of `size` (MIN_SEGMENTS always fit)
                return len(segs) >= self.max_segments or (
                    len(segs) >= MIN_SEGMENTS and sum(s.size for s in segs) + size > self.pool_bytes)

            if full([s for s in pool if s.busy]):  # (every free one is too small for this)
                return None  # no room even with every free segment closed: keep them, go inline
            while full(pool):  # make room by closing free segments, the biggest first
                old = max((s for s in pool if not s.busy), key=lambda s: s.size)
                pool.remove(old)
                _close(old)
                self._retired.setdefault(actor, []).append(old.name)  # the actor unmaps it (next notice)
            if self._no_room_for(actor):
                return None
            name = f"{self.prefix(actor)}{next(self._names)}"
            fit = Segment(name, size, None)  # type: ignore[arg-type]
            try:
                fit.mm, fit.ino = shm.create_segment(name, fit.size)
            except OSError as e:  # /dev/shm full or too small (a container's 64 MiB): these inputs go inline
                self._no_room(actor, size, e)
                return None
            pool.append(fit)
        fit.busy = True
        return fit

    def _no_room_for(self, actor: int) -> bool:
        """Whether /dev/shm lately had no room for one of `actor`'s segments (asked again after `NO_ROOM_RETRY` s)."""
        return self._no_room_until.get(actor, 0.0) > time.monotonic()

    def _no_room(self, actor: int, size: int, error: OSError) -> None:
        self._no_room_until[actor] = time.monotonic() + NO_ROOM_RETRY
        if not self.shm_failures:
            full = error.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
            log.warning("%s for a %d-byte input segment of actor %d (%s): step inputs go inline in the request instead, "
                        "which is slower%s", "no room in shared memory (/dev/shm)" if full else "no shared-memory segment could be made",
                        size, actor, error, "; give /dev/shm more room (e.g. docker run --shm-size=1g)" if full else "")
        self.shm_failures += 1

    def close(self) -> None:
        with self._lock:
            _close_all(self._pools)
            self._pools.clear()
            self.gets.close()
            self.puts.close()
        # Any other segment of this mesh's prefix is dead with it: one an actor made for a get that was cancelled,
        # or whose daemon was killed before it could unlink what was never read.
        if os.path.isdir("/dev/shm"):
            for name in os.listdir("/dev/shm"):
                if name.startswith(self._base[1:]):
                    shm.unlink("/" + name)


class OutputLease:
    """The segments of one `get` (see `InputStager.output_lease`): `names` (one per value, None: in the reply) and
    `pooled` go in the request, with `forget`; `read` copies out one value the actor wrote, `release` ends it."""

    def __init__(self, stager: InputStager, actor: int) -> None:
        self.stager, self.actor = stager, actor
        self.names: list[str | None] = []
        self.pooled: list[int] = []  # per name: the inode of the reused segment it names (0: a fresh one the actor makes)
        self.segments: dict[str, Segment] = {}  # the pooled ones, by name
        self.forget: list[str] = []
        self._stale: set[str] = set()  # pooled ones the actor did not write (it made a segment of its own instead)
        self._released = False

    def fields(self) -> dict[str, Any]:
        """The get request's fields for these segments."""
        fields: dict[str, Any] = {"into": self.names}
        if self.segments:
            fields["pooled"] = self.pooled
        if self.forget:
            fields["forget"] = self.forget
        return fields

    def read(self, notice: Any, name: str) -> np.ndarray:
        """The value the actor wrote into segment `name` (per its reply's `notice`), copied out."""
        seg = self.segments.get(name)
        if seg is None or not isinstance(notice, dict) or notice.get("ino") != seg.ino:
            if seg is not None:  # (its mapping there was gone, and with it the name: the actor made a new one)
                self._stale.add(name)
            return read_output(self.actor, notice, name)
        try:
            dtype, shape, nbytes = _notice_spec(notice, name)
            if nbytes > seg.size:
                raise ValueError(f"{dtype.name}{list(shape)} is {nbytes} bytes, more than the segment holds ({seg.size})")
        except (ValueError, ProtocolError, TypeError, KeyError) as e:
            self._stale.add(name)
            raise MpmdError(f"actor {self.actor}'s reply to a fetch pointed at shared memory that cannot be read: {e}") from None
        out = np.empty(shape, dtype)
        np.copyto(out.reshape(-1).view(np.uint8), np.frombuffer(seg.mm, np.uint8, nbytes))
        return out

    def release(self, answered: bool) -> None:
        """The get is over: its pooled segments go back to the pool when its reply came (`answered`: the actor wrote
        what it would), else they are dropped — a cancelled get's thread may still be writing into them — and the
        names it was to tell the actor to forget are kept for the next get. Once; later calls do nothing."""
        with self.stager._lock:
            if self._released:
                return
            self._released = True
            for name, seg in self.segments.items():
                self.stager.gets.release(self.actor, seg, answered and name not in self._stale)
            if not answered and self.forget:  # (it may not have reached the actor: unmapping twice is harmless)
                self.stager.gets.told.setdefault(self.actor, [])[:0] = self.forget


def _notice_spec(notice: Any, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, nbytes) of the value a `get` reply's `notice` says segment `name` holds; a ValueError (or the
    array spec's own error) when the notice names another segment or its size is not its dtype and shape's."""
    if not isinstance(notice, dict) or notice.get("name") != name:
        raise ValueError(f"its notice names {notice.get('name') if isinstance(notice, dict) else notice!r:.80}, not {name!r}")
    dtype, shape, nbytes = array_spec({"dtype": notice.get("dtype"), "shape": notice.get("shape")})
    if notice.get("nbytes") != nbytes or nbytes == 0:
        raise ValueError(f"{dtype.name}{list(shape)} is {nbytes} bytes but the notice says {notice.get('nbytes')!r:.40}")
    return dtype, shape, nbytes


def read_output(actor: int, notice: Any, name: str) -> np.ndarray:
    """The value actor `actor` wrote into segment `name` for a `get`, per its reply's `notice`: a copy in this
    process's memory (read in place, a fetched value kept /dev/shm's memory, which bounds every shared-memory path,
    as long as the caller kept it); the segment is gone afterwards."""
    try:
        dtype, shape, nbytes = _notice_spec(notice, name)
        fd = shm._posixshmem.shm_open(name, os.O_RDONLY | shm.OPEN_FLAGS, 0)
        try:
            st = os.fstat(fd)
            kind = shm.not_a_segment(st)
            why = f"is {kind}, not a shared-memory segment" if kind else shm.refusal(
                st, notice.get("ino") if isinstance(notice.get("ino"), int) else -1, f"actor {actor}")
            if why:
                raise ValueError(f"{name} {why}")
            if st.st_size < nbytes:
                raise ValueError(f"{name} holds {st.st_size} bytes, fewer than the {nbytes} of {dtype.name}{list(shape)}")
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    except (OSError, ValueError, ProtocolError, TypeError, KeyError) as e:
        raise MpmdError(f"actor {actor}'s reply to a fetch pointed at shared memory that cannot be read: {e}") from None
    finally:
        shm.unlink(name)
    try:
        out = np.empty(shape, dtype)
        np.copyto(out.reshape(-1).view(np.uint8), np.frombuffer(mm, np.uint8, nbytes))
        return out
    finally:
        mm.close()


def _write(seg: Segment, array: np.ndarray, offset: int, layout: Any = None) -> dict[str, Any]:
    """Copy `array` into `seg` at `offset`; the notice that tells the actor where it lies."""
    np.copyto(np.frombuffer(seg.mm, np.uint8, array.nbytes, offset), np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    notice = {"name": seg.name, "offset": offset, "nbytes": int(array.nbytes), "dtype": dtype_name(array.dtype),
              "shape": list(array.shape), "ino": seg.ino}
    if layout is not None:
        notice["layout"] = layout
    return notice


def _close(seg: Segment) -> None:
    shm.unlink(seg.name)  # (the actor unlinks it when it maps it; one never read is removed here)
    try:
        seg.mm.close()
    except BufferError:
        pass


def _close_all(pools: dict[int, list[Segment]], pid: int | None = None) -> None:
    if pid is not None and os.getpid() != pid:  # (a forked child's exit: the segments are its parent's, in use)
        return
    for pool in pools.values():
        for seg in pool:
            _close(seg)
    pools.clear()


_STAGERS: weakref.WeakKeyDictionary[Any, InputStager] = weakref.WeakKeyDictionary()
_STAGERS_LOCK = threading.Lock()


def close_stager(mesh: Any) -> None:
    """Unlink `mesh`'s input segments now (its close: a segment no actor read would wait for the mesh's collection)."""
    with _STAGERS_LOCK:
        stager = _STAGERS.pop(mesh, None)
    if stager is not None:
        stager.close()


def input_stager(mesh: Any) -> InputStager:
    """The one stager of `mesh` (made on first use; its segments go with the mesh)."""
    with _STAGERS_LOCK:
        stager = _STAGERS.get(mesh)
        if stager is None:
            stager = _STAGERS[mesh] = InputStager(mesh)
        return stager


__all__ = ["SHM_INPUT_MIN_BYTES", "InputStager", "OutputLease", "close_stager", "input_stager", "read_output"]
