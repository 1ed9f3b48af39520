"""Batch leaves an actor loads itself: the controller names a loader function and a leaf, the actor calls it.

A `run_program` request may mark inputs -3 and carry ``loads: [{fn, name, shape, dtype, [layout], [step]}]``, one
per such input (`step`: the step to load, when not the request's own: a recovery's replay loads the data of the
step it replays). The actor calls only functions on its allow-list (``mpmd-actor --allow-loader module:function``,
repeatable; empty by default, so a daemon loads nothing unless its operator said so): it imports the module
by name (never unpickles), calls ``fn(step, name)`` on a thread of its own — while the step before still runs —
and checks that the result is an array of the announced dtype and shape. Any failure fails that step with an
error naming the function and the leaf; the daemon stays up. On CPU, JAX uses a 64-byte-aligned result in
place (no copy), so a loader must return a fresh array each call, not refill one it returned before.

Each call gets a thread of its own, not one of the event loop's shared worker threads: a loader that never
returns fails its step (the request's timeout names it) and keeps its thread, and with a shared pool a few
such calls would have held every worker that fetches, checkpoints and other loaders wait for. At most
`MAX_RUNNING` calls may be unfinished at once; past that a step's load is refused, naming them.

A session's steps load in a queue of their own (`Loaders.queue`): one call at a time, in the order the steps
came, and at most `AHEAD` steps' data loaded before their steps end; and one call at a time on the daemon, whatever
session it is for (`Loaders.turn`). Only the key that owns the daemon's job, or an operator, may ask for a call
(a guest key read the job's data), and a leaf name that could leave a directory ("../x") is refused. A loop that dispatches a hundred steps
ahead (as README's does) called the loader for all of them at once: a loader that is not thread-safe (one file
handle: seek, then read; a generator) gave wrong batches silently, 64 calls refused the next step, and a CPU-heavy
loader's threads starved the daemon's heartbeats; memory held every batch (a probe). A call whose step ended while it
ran (aborted) is waited for before the next begins, up to `ABANDONED_WAIT` seconds (past that it is taken for hung).
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from actors.request import RequestError
from transport.protocol import dtype_from_name, leaf_name_problem

MAX_LEAF_BYTES = 1 << 36
MAX_RUNNING = 64  # loader calls not yet returned (hung ones keep their threads)
AHEAD = 2  # steps of a session whose data is loaded and whose step has not ended: the one running and the next
ABANDONED_WAIT = 120.0  # seconds the queue waits for a call whose step ended meanwhile before it goes on without it


_NARROWED = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32),
             np.dtype(np.uint64): np.dtype(np.uint32), np.dtype(np.complex128): np.dtype(np.complex64)}


def _as_jit_takes(got: np.dtype, want: np.dtype) -> bool:
    """Whether a loader's `got` array is what jax.jit takes as `want` on a controller without x64: the same type in
    the other byte order (a big-endian .npy), or its 64-bit form (numpy's default, or jax.random's here: this
    daemon runs with x64 on, so a loader that uses jax makes 64-bit values)."""
    native = got.newbyteorder("=")
    return native == want or _NARROWED.get(native) == want


class Loaders:
    """The loader functions this daemon may call (`allowed`: "module:function" names), imported on first use."""

    def __init__(self, allowed: Sequence[str] = ()) -> None:
        self.allowed = frozenset(allowed)
        self._fns: dict[str, Callable[..., Any]] = {}
        self.calls = 0  # (also each running call's number)
        self.unfinished = 0  # calls started and not yet returned (hung ones included)
        self._lock = threading.Lock()
        # call number -> (whose: the session that asked), "fn(step, name)", when it started (monotonic)
        self.running: dict[int, tuple[Any, str, float]] = {}
        self.queues: dict[Any, _Queue] = {}  # per session: its steps' loads, in order (`queue`)
        self.turn = asyncio.Lock()  # one call at a time on this daemon, whichever session's queue it is from

    def check(self, spec: Any) -> tuple[str, str, np.dtype, list[int]]:
        """A `loads` entry's (fn, name, dtype, shape), checked; RequestError when malformed or not allowed."""
        if not isinstance(spec, dict):
            raise RequestError(f"a 'loads' entry must be a map, got {type(spec).__name__}")
        fn, name, shape = spec.get("fn"), spec.get("name"), spec.get("shape")
        if not isinstance(fn, str) or fn not in self.allowed:
            raise RequestError(f"loader {fn!r} is not allowed on this actor (allowed: {sorted(self.allowed) or 'none'}); start the "
                               "daemon with --allow-loader module:function (RemoteMesh.local(..., loaders=[...]))")
        if not isinstance(name, str) or len(name) > 1024:
            raise RequestError(f"loader {fn}: the leaf name must be a string, got {name!r:.80}")
        problem = leaf_name_problem(name)
        if problem:
            raise RequestError(f"loader {fn}: {problem}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise RequestError(f"loader {fn}: shape must be a list of non-negative ints, got {shape!r}")
        try:
            dtype = dtype_from_name(spec.get("dtype"))
        except ValueError as e:
            raise RequestError(f"loader {fn}: {e}") from None
        step = spec.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
            raise RequestError(f"loader {fn}: the step to load must be an int >= 0, got {step!r:.40}")
        if math.prod(shape) * dtype.itemsize > MAX_LEAF_BYTES:
            raise RequestError(f"loader {fn}: leaf {name} of {dtype.name}{shape} is larger than {MAX_LEAF_BYTES} bytes")
        return fn, name, dtype, shape

    def _function(self, fn: str) -> Callable[..., Any]:
        got = self._fns.get(fn)
        if got is None:
            module, _, attr = fn.partition(":")
            got = getattr(importlib.import_module(module), attr)
            if not callable(got):
                raise TypeError(f"loader {fn} is a {type(got).__name__}, not a function")
            self._fns[fn] = got
        return got

    def load(self, fn: str, name: str, dtype: np.dtype, shape: list[int], step: int, whose: Any = None) -> np.ndarray:
        """Call the loader for `name` at `step` (in a worker thread) and check what it returns."""
        with self._lock:
            self.calls += 1
            call = self.calls
            self.running[call] = (whose, f"{fn}({step}, {name!r})", time.monotonic())
        try:
            got = self._function(fn)(step, name)
            host = np.asarray(got)
        except BaseException as e:  # SystemExit too ("end of data" via sys.exit): it fails the step, not the daemon
            raise RuntimeError(f"loader {fn}({step}, {name!r}) failed: {type(e).__name__}: {e}") from e
        finally:
            with self._lock:
                self.running.pop(call, None)
        if host.dtype == object:  # (None, a dict, a ragged list: numpy's "|O object[]" said nothing; a probe)
            raise RuntimeError(f"loader {fn}({step}, {name!r}) returned a {type(got).__name__}, not an array; the step was "
                               f"traced with {dtype.name}{list(shape)}")
        if host.dtype != dtype and list(host.shape) == list(shape) and _as_jit_takes(host.dtype, dtype):
            host = host.astype(dtype)  # (the other byte order, or 64 bits where the step traced 32, as jax.jit takes them)
        if host.dtype != dtype or list(host.shape) != list(shape):
            raise RuntimeError(f"loader {fn}({step}, {name!r}) returned {host.dtype.str} {host.dtype.name}{list(host.shape)}; the "
                               f"step was traced with {dtype.name}{list(shape)}")
        return np.ascontiguousarray(host)

    def still_running(self, whose: Any = None, any_session: bool = False) -> str | None:
        """The loader calls of `whose` (a session; every session's with `any_session`) that have not returned,
        for an error that timed out waiting on them (None: none)."""
        now = time.monotonic()
        with self._lock:
            calls = sorted((c for c in self.running.values() if any_session or c[0] == whose), key=lambda c: c[2])
        if not calls:
            return None
        return ", ".join(f"{what} (running {now - t0:.1f} s)" for _, what, t0 in calls[:4]) + (" ..." if len(calls) > 4 else "")

    def start(self, spec: Any, step: int, place: Callable[[np.ndarray], Any], whose: Any = None) -> asyncio.Future[Any]:
        """Check `spec` now, then load it on a thread of its own and `place` it on the devices; the future of
        the value."""
        fn, name, dtype, shape = self.check(spec)
        with self._lock:  # (counted here, not when its thread starts the call: a burst of starts cannot pass the limit)
            unfinished = self.unfinished
            if unfinished < MAX_RUNNING:
                self.unfinished += 1
        if unfinished >= MAX_RUNNING:
            raise RequestError(f"loader {fn}: {unfinished} loader calls on this actor have not returned "
                               f"({self.still_running(any_session=True)}); a loader must return (or raise) for each step — "
                               "fix it, then restart the daemon to free their threads")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        fut.mpmd_loading = (f"{fn}({step}, {name!r})", time.monotonic())  # type: ignore[attr-defined]  # (for `unfinished`)

        def settle(value: Any, error: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)

        def work() -> None:
            value, error = None, None
            try:
                value = place(self.load(fn, name, dtype, shape, step, whose))
            except BaseException as e:  # load() turns the loader's own errors into RuntimeError; place's too
                error = e
            finally:
                with self._lock:
                    self.unfinished -= 1
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop closed (the daemon is stopping): no one waits
                pass

        threading.Thread(target=work, name=f"mpmd-loader-{fn}", daemon=True).start()
        return fut


class _Job:
    """One step's loads in its session's queue."""

    def __init__(self, leaves: list[tuple[Any, int, Callable[[np.ndarray], Any], asyncio.Future[Any]]], whose: Any,
                 ended: asyncio.Future[None]) -> None:
        self.leaves = leaves  # (spec, step, place, the future the step awaits)
        self.whose = whose
        self.ended = ended  # done once the step has ended (`end`)
        self.counted = False  # its data is loaded and its step has not ended: one of the queue's `open`


class _Queue:
    """A session's steps waiting for their data, in the order they came."""

    def __init__(self) -> None:
        self.jobs: collections.deque[_Job] = collections.deque()
        self.open = 0  # jobs loaded whose steps have not ended
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


def _read(f: asyncio.Future[Any]) -> None:
    if not f.cancelled():
        f.exception()


def queue(loaders: Loaders, specs: list[Any], steps: list[int], places: list[Callable[[np.ndarray], Any]],
          whose: Any = None) -> tuple[list[asyncio.Future[Any]], Callable[[], None]]:
    """One step's loads (`specs`, checked now: a RequestError when one is malformed or not allowed), queued behind
    the session's earlier steps' (see the module docstring): the futures the step awaits, one per spec, and `end`,
    to call once the step has ended (done, failed or aborted), which lets the queue go on."""
    for spec in specs:
        loaders.check(spec)
    loop = asyncio.get_running_loop()
    outers = []
    for spec, step in zip(specs, steps):
        f: asyncio.Future[Any] = loop.create_future()
        f.mpmd_loading = [f"{spec.get('fn')}({step}, {spec.get('name')!r})", time.monotonic(), "queued"]  # type: ignore[attr-defined]
        outers.append(f)
    job = _Job(list(zip(specs, steps, places, outers)), whose, loop.create_future())
    q = loaders.queues.setdefault(whose, _Queue())
    q.jobs.append(job)
    q.wake.set()
    if q.task is None:
        q.task = loop.create_task(_serve(loaders, q))

    def end() -> None:
        if job.ended.done():
            return
        job.ended.set_result(None)
        if job.counted:
            job.counted = False
            q.open -= 1
        for f in outers:  # (nobody awaits them any more)
            if not f.done():
                f.cancel()
        q.wake.set()

    return outers, end


async def _serve(loaders: Loaders, q: _Queue) -> None:
    """Load the queue's jobs one call at a time, in order, at most AHEAD steps ahead of the steps that end."""
    try:
        while q.jobs:
            job = q.jobs[0]
            if job.ended.done():  # its step ended (aborted, failed) before its turn
                q.jobs.popleft()
                continue
            if q.open >= AHEAD:
                q.wake.clear()
                await q.wake.wait()
                continue
            q.jobs.popleft()
            for spec, step, place, outer in job.leaves:
                async with loaders.turn:  # (each session's queue alone let a second controller's calls — an evaluation
                    # process of the same key — run beside the job's: a loader that is not thread-safe read wrong; a probe)
                    if job.ended.done():
                        break
                    outer.mpmd_loading[1:] = [time.monotonic(), "running"]  # type: ignore[attr-defined]
                    try:
                        inner = loaders.start(spec, step, place, job.whose)
                    except RequestError as e:
                        if not outer.done():
                            outer.set_exception(e)
                        continue
                    inner.add_done_callback(_read)
                    await asyncio.wait({inner, job.ended}, return_when=asyncio.FIRST_COMPLETED)
                    if not inner.done():  # its step ended while the call runs (aborted: a recovery's survivor): the queue
                        # goes on once the call returns — went on at once, the next steps' calls (the replay's) ran beside
                        # it, and a loader that is not thread-safe failed or read wrong (a probe) — or, if it has not
                        # returned within ABANDONED_WAIT, is taken for hung (it keeps its thread)
                        await asyncio.wait({inner}, timeout=ABANDONED_WAIT)
                        break
                if not outer.done():
                    outer.set_exception(inner.exception()) if inner.exception() is not None else outer.set_result(inner.result())
            if not job.ended.done():
                job.counted = True
                q.open += 1
    finally:
        q.task = None


def unfinished(futures: list[asyncio.Future[Any]], loaders: Loaders | None = None) -> str | None:
    """The loader calls among `futures` (one step's, from `queue` or `Loaders.start`) that have not returned, as
    `Loaders.still_running` says them (None: none); with `loaders`, what a queued one waited behind (the call that
    holds the daemon's turn may be another session's: a review found a job's timeout naming only its own call)."""
    now = time.monotonic()
    calls = [f.mpmd_loading for f in futures if not f.done() and hasattr(f, "mpmd_loading")]
    if not calls:
        return None
    said = ", ".join(f"{c[0]} ({c[2] if len(c) > 2 else 'running'} {now - c[1]:.1f} s)" for c in calls[:4]) + (
        " ..." if len(calls) > 4 else "")
    behind = loaders.still_running(any_session=True) if loaders is not None and any(
        len(c) > 2 and c[2] == "queued" for c in calls) else None
    return f"{said}, queued behind {behind}" if behind else said


__all__ = ["Loaders", "queue", "unfinished"]
