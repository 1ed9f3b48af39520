"""What a RemoteMesh holds outside Python's heap — the daemons it started, its controller loop thread, its ZeroMQ
context and connections, its private directory — and their release, once: by `RemoteMesh.close`, or when a mesh
dropped without closing is collected (`release_dropped`, a weakref.finalize that holds this and never the mesh).

A notebook cell run again (`mesh = mpmd.RemoteMesh.local(2)`) dropped the previous mesh: it was collected, but its
daemons (~200 MB each), loop thread and sockets stayed until the interpreter exited (a probe). As an unclosed file
does, a dropped mesh now releases them when collected, with a ResourceWarning saying to close it."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import shutil
import threading
import time
import warnings
from typing import Any

log = logging.getLogger(__name__)


class Held:
    """The mesh's outside resources. `processes` and `conns` are the mesh's own lists (replaced in place);
    `tmpdir` is set by the launcher once the mesh is made."""

    def __init__(self, processes: list[Any], io: Any, ctx: Any, conns: list[Any], watchdog: Any) -> None:
        self.processes = processes
        self.io = io
        self.ctx = ctx
        self.conns = conns
        self.watchdog = watchdog
        self.tmpdir: str | None = None
        self._lock = threading.Lock()
        self._released = False
        self._pid = os.getpid()

    def say_goodbye(self) -> None:
        """Tell the daemons this mesh is gone, as `close` does: those it owns shut down (a rendezvous or attached
        daemon has no process here to stop), the others forget its session. Bounded; a dead one is skipped."""
        if self._released or os.getpid() != self._pid:
            return
        op = "shutdown" if self.processes else "bye"

        async def goodbyes() -> None:
            await asyncio.gather(*(c.request(op) for c in self.conns if not c.dead), return_exceptions=True)

        try:
            self.io.run(goodbyes(), timeout=5)
        except Exception:
            pass

    def release(self) -> None:
        """Stop the daemons this mesh started, remove its directory, stop its loop and sockets (once; not in a
        forked child, whose copy of the mesh is its parent's)."""
        with self._lock:
            if self._released or os.getpid() != self._pid:
                return
            self._released = True
        try:
            for p in list(self.processes):
                p.stop()
        finally:
            if self.tmpdir:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.io.call_soon(self.watchdog.stop)
            for c in list(self.conns):
                self.io.call_soon(c.close)
            time.sleep(0.01)
            self.io.stop()
            self.ctx.destroy(linger=0)


def release_dropped(held: Held, what: str) -> None:
    """(weakref.finalize of a mesh, never closed, now collected.) Hand what it held to the reaper thread: the
    collection may run on any thread, the mesh's own loop thread included (which cannot stop itself), and while it
    holds a lock the release, or even starting a thread, would wait for; a SimpleQueue's put is safe there.
    (Nothing in a forked child: its copy is its parent's.)"""
    if os.getpid() != held._pid:
        return
    warnings.warn(f"{what} was dropped without close(): what it holds is released now (the daemons it started are "
                  "stopped); close a mesh when done (mesh.close(), or `with mpmd.RemoteMesh.local(...) as mesh:`)",
                  ResourceWarning, stacklevel=1)
    _DROPPED.put(held)  # (the reaper runs from the first mesh's making on: `start_reaper`)


_DROPPED: queue.SimpleQueue[Held] = queue.SimpleQueue()
_REAPER: list[threading.Thread] = []
_REAPER_LOCK = threading.Lock()


def start_reaper() -> None:
    """Start the thread that releases dropped meshes, once: by every mesh as it is made (outside any collection; a
    finalizer only hands to it)."""
    with _REAPER_LOCK:
        if _REAPER and _REAPER[0].is_alive():
            return
        try:
            t = threading.Thread(target=_reap, name="mpmd-release-dropped-meshes", daemon=True)
            t.start()
            _REAPER[:] = [t]
        except RuntimeError:  # (at interpreter shutdown: the daemons see their parent go)
            pass


def _reap() -> None:
    while True:
        held = _DROPPED.get()
        log.warning("a RemoteMesh was dropped without close(): releasing what it held (its loop, its sockets, the daemons "
                    "it started)")
        try:
            held.say_goodbye()
            held.release()
        except Exception:
            log.debug("releasing a dropped mesh's resources failed", exc_info=True)
