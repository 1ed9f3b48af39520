"""`with mesh.profile(logdir):` — a `jax.profiler` trace on every actor, beside mpmd's own instruction trace.

Each actor traces its own process (XLA ops, host threads, transfers as JAX sees them) into a directory of its
own and, when the block ends, sends the files back; they are written here as one TensorBoard profile run with
one "host" per actor::

    logdir/plugins/profile/<run>/actor0.xplane.pb     # tensorboard --logdir logdir  (or xprof, or Perfetto)
    logdir/plugins/profile/<run>/actor1.xplane.pb
    logdir/mpmd_trace_<run>.json                      # mpmd's per-instruction trace (Perfetto / chrome://tracing)

Steps dispatched inside the block are waited for before the traces stop, so nothing of them is cut off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from mpmd.errors import MpmdError
from mpmd.observe.trace import Trace, entered_off_loop

log = logging.getLogger(__name__)


def _fresh_run(logdir: str, stamp: str) -> str:
    """A run name not yet used under `logdir`: the time, then _2, _3, ... (two profiles in one second wrote into the
    same run, the second over the first: a probe)."""
    run, k = stamp, 1
    while True:  # (reserved by making its directory: two profiles begun at once take two names)
        try:
            if not os.path.exists(os.path.join(logdir, f"mpmd_trace_{run}.json")):
                os.makedirs(os.path.join(logdir, "plugins", "profile", run))
                return run
        except FileExistsError:
            pass
        k += 1
        run = f"{stamp}_{k}"


class ProfileContext:
    """What `RemoteMesh.profile` returns; `.trace` is mpmd's instruction trace of the same steps, `.files` the
    profile files written (after the block). `mesh` is the `RemoteMesh` whose actors are profiled."""

    def __init__(self, mesh: Any, logdir: str | os.PathLike[str], run: str | None = None) -> None:
        self.mesh = mesh
        if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir).strip():  # ("" was the working directory)
            raise ValueError(f"mesh.profile: logdir must name a directory, got {logdir!r:.80}")
        self.logdir = os.path.abspath(os.path.expanduser(os.fspath(logdir)))
        self.run = run or ""  # (the default, a fresh name, is taken as the block starts)
        if run and (os.sep in self.run or self.run in (".", "..")):
            raise ValueError(f"run must be a plain directory name, got {self.run!r}")
        self.files: list[str] = []
        self._trace_ctx: Any = None
        self.trace: Trace | None = None

    def __enter__(self) -> ProfileContext:
        if getattr(self.mesh, "active_trace", None) is not None:  # (checked before any actor starts profiling)
            raise MpmdError("mesh.profile() records mpmd's trace too, and this mesh is inside a mesh.trace() block: use one "
                            "of them (the profile's own trace is `prof.trace`)")
        try:
            os.makedirs(self.logdir, exist_ok=True)
            if not self.run:
                self.run = _fresh_run(self.logdir, time.strftime("%Y_%m_%d_%H_%M_%S"))
        except OSError as e:  # (a file of that name: a bare FileExistsError; a probe)
            raise MpmdError(f"mesh.profile: cannot make the profile directory {self.logdir}: {e}") from None
        wait = getattr(self.mesh, "wait_steps_in_flight", None)  # (before the actors' profilers start: the steps
        if wait is not None:  # dispatched before the block are not the profile's; a review)
            from mpmd.runtime.controller import blocking

            with blocking("entering mesh.profile()"):
                wait()
        started: list[int] = []

        async def start(i: int) -> None:
            await self.mesh.conn(i).request("profile", {"action": "start"})
            started.append(i)

        try:
            self.mesh.run(_gather([start(i) for i in range(len(self.mesh.addresses))]))
            self._trace_ctx = self.mesh.trace()
            self.trace = self._trace_ctx.__enter__()
        except BaseException:
            self._stop(started, keep=False)  # (what it started stops: a later mesh.profile() starts cleanly)
            raise
        log.info("profiling %d actors into %s (run %s)", len(self.mesh.addresses), self.logdir, self.run)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._trace_ctx.__exit__(*exc)  # waits for the steps dispatched inside
        finally:
            self._stop(list(range(len(self.mesh.addresses))), keep=True)
        if self.trace is not None and self.trace.steps:
            path = os.path.join(self.logdir, f"mpmd_trace_{self.run}.json")
            self.trace.to_perfetto(path)
            self.files.append(path)

    async def __aenter__(self) -> ProfileContext:
        """`async with mesh.profile(dir):` — starting (after the steps in flight) in a worker thread, off the
        caller's event loop, as `async with mesh.trace()`; cancelled, what it started stops once it has."""
        return await entered_off_loop(self.__enter__, self._abandon)

    def _abandon(self) -> None:
        """Undo an entry whose caller is gone (its await cancelled): no trace left on, the profilers stopped, no files."""
        if self._trace_ctx is not None:
            self._trace_ctx._leave()
        self._stop(list(range(len(self.mesh.addresses))), keep=False)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.__exit__, *exc)

    def _stop(self, actors: list[int], keep: bool) -> None:
        run_dir = os.path.join(self.logdir, "plugins", "profile", self.run)

        async def stop(i: int) -> list[str]:
            msg = await self.mesh.conn(i).request("profile", {"action": "stop"})
            if not keep:
                return []
            written = []
            for name, data in zip(msg.header["files"], msg.arrays):
                base = os.path.basename(str(name))  # the actor's own file names; never a path from the wire
                if base.endswith(".xplane.pb"):
                    base = f"actor{i}.xplane.pb"
                elif base.endswith(".trace.json.gz"):
                    base = f"actor{i}.trace.json.gz"
                else:
                    base = f"actor{i}.{base}"
                path = os.path.join(run_dir, base)
                with open(path, "wb") as f:
                    f.write(data.tobytes())
                written.append(path)
            return written

        os.makedirs(run_dir, exist_ok=True)
        async def all_stops() -> list[Any]:
            return list(await asyncio.gather(*(stop(i) for i in actors), return_exceptions=True))

        results = self.mesh.run(all_stops()) if actors else []
        errors = [f"actor {i}: {r}" for i, r in zip(actors, results) if isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, list):
                self.files.extend(r)
        if errors and keep:
            raise MpmdError("stopping the profile failed on " + "; ".join(errors))


async def _gather(coros: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*coros))
