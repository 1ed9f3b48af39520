"""Transparent recovery from a lost actor: snapshots of the state steps hand on, a log of the steps since, and
the replay that rebuilds them on a replacement daemon.

    mesh = mpmd.RemoteMesh.local(num_actors=2, recover=mpmd.Recovery(snapshot_every=10, max_failures=3))
    for batch in data:
        params, opt_state, losses = train_step(params, opt_state, batch)   # an actor killed here: the loop goes on

The design, simplest correct first:

* **Log.** Every call of a distributed step on the mesh is logged: its function, its host inputs (copied) and,
  for each RemoteArray input, a *value id* — a stable name for a value that survives rebinding. Each output
  RemoteArray gets a new value id.
* **Snapshot.** Every `snapshot_every` calls, the RemoteArray inputs of that call (the state steps hand on:
  parameters, optimizer state, anything else passed back in) are fetched to the controller's host memory by
  an asynchronous `get` (one request per actor, in the background: step inputs are never donated, so the
  get runs beside the pipeline and costs the copy of its bytes). The log is trimmed to the newest complete
  snapshot. (A copy into a peer actor's memory would save the controller's memory and bandwidth: not done.)
* **Recovery.** A step that fails because an actor is lost (`ActorDiedError`, or a step aborted by the
  recovery) waits for one recovery, run in its own thread while new dispatches wait: survivors abort their
  running steps; the launcher that started the lost daemon starts a replacement (`respawn(actor, timeout)`);
  the mesh reconnects to it (new session, data plane rewired) and every compiled step is shipped to it again
  (its executables come from the persistent compilation cache). Then *every* actor is rolled back to the
  snapshot (its values put back on their actors) and the logged steps are replayed in order under fresh step
  numbers: the result is bit-identical to a run without failure. Every live RemoteArray that named a logged
  value is rebound to the replayed buffers, so the call in flight returns normally.
* **What survives.** Values named in the log: the inputs of the snapshotted call, every other array live when
  the snapshot was taken (another chain of state: an eval call's snapshot still holds the optimizer state), the
  outputs of every logged call since, inputs no logged call made (`mpmd.restore` on the same mesh, `mesh.put`:
  fetched in the background when a logged call first reads them), and any array that lived only on surviving
  actors. An array that lived on the lost actor
  and was neither (e.g. put there by `mesh.actor(i).put` and never passed to a step since the snapshot) is
  gone: reading it, or passing it to a step, raises `MpmdError` ("holds no buffer"). A logged step that reads
  such an array is not replayed, nor are the steps that read what it made: each fails, saying so, and the
  recovery goes on with the rest (it is not given up).
* **Bounds.** A replacement that does not come up within `spawn_timeout`, more than `max_failures` lost actors
  in all, or a failure of the recovery itself ends it: the step raises the `ActorDiedError` it would have
  raised without recovery (naming the actor), and the mesh stops recovering.

Recoveries are logged on the ``mpmd.runtime.mesh`` logger (WARNING: which actor, how it died, seconds spent
detecting, starting, reloading, restoring and replaying, steps replayed) and counted in `mesh.recoveries`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from mpmd.compiler.avals import from_wire, is_key, key_impl, to_wire
from mpmd.compiler.plan import iter_lowered
from mpmd.errors import ActorDiedError, ActorStartError, MpmdError
from mpmd.runtime.aio import watch
from mpmd.runtime.arguments import check_count, check_seconds
from mpmd.runtime.array import RemoteArray
from mpmd.runtime.controller import EXITED_HINT, wait_settled

log = logging.getLogger("mpmd.runtime.mesh")  # recoveries are the mesh's news: its logger says them

# respawn(actor, timeout) -> (control address, process handle or None[, its public key when it made a new one]):
# the launcher's replacement daemon (launch.local.LocalMesh.respawn, launch.ray.RayLaunch.respawn)
Respawn = Callable[[int, float], tuple[Any, ...]]


@dataclass(frozen=True)
class Recovery:
    """How a mesh survives a lost actor (`RemoteMesh.local(..., recover=Recovery())`, also `.ray`,
    `.from_rendezvous`): every `snapshot_every` steps the state steps hand on is copied to the controller's
    host memory in the background, and an actor that dies is replaced by its launcher, the state restored and
    the steps since the snapshot replayed — bit-identical, the user's loop goes on.

    `max_failures`: lost actors the mesh recovers from in all; one more raises `ActorDiedError` as without
    recovery. `spawn_timeout`: seconds to wait for a replacement daemon before giving up the same way.
    `drain_timeout`: seconds the recovery waits for survivors to abandon the failed steps.

        mesh = mpmd.RemoteMesh.local(2, recover=mpmd.Recovery(snapshot_every=10, max_failures=3))
        ...
        print(mesh.recoveries)
    """

    snapshot_every: int = 10
    max_failures: int = 3
    spawn_timeout: float = 120.0
    drain_timeout: float = 10.0

    def __post_init__(self) -> None:
        check_count("Recovery(snapshot_every=...) (steps between snapshots)", self.snapshot_every)
        check_count("Recovery(max_failures=...) (lost actors to recover from)", self.max_failures, minimum=0)
        for name in ("spawn_timeout", "drain_timeout"):
            check_seconds(f"Recovery({name}=...)", getattr(self, name))


@dataclass(eq=False)  # (compared by identity: its fields hold weakrefs of arrays, whose == is refused)
class StepRecord:
    """One logged call: enough to dispatch it again."""

    index: int
    dist: Any  # the DistributedFunction
    treedef: Any
    leaves: list[tuple[Any, ...]]  # ("host", value) or ("remote", value id, weakref to the RemoteArray)
    outs: list[tuple[int, int, weakref.ref[RemoteArray]]] = field(default_factory=list)  # (flat position, value id, array)
    sent: list[Any] = field(default_factory=list)  # its run_program futures (loop side)
    generation: int = 0
    replayed: bool = False
    unreplayable: str | None = None  # why the last recovery could not replay it (an input gone with a lost actor)
    failed: bool = False  # it failed when it ran, of its own error (not a lost actor's): its replay may fail so again
    load_step: int | None = None  # the step number its actor-loaded leaves were loaded for (a replay loads them again)
    context: Any = None  # JAX's config context of the call (per thread: the replay, in the recovery's, uses the caller's)


@dataclass(eq=False)  # (compared by identity, as above)
class Snapshot:
    """The values of the RemoteArray inputs of log entry `index`, on the host once `done` holds."""

    index: int
    meta: dict[int, tuple[list[int], Any, Any, weakref.ref[RemoteArray]]]  # value id -> (actors, spec, dtype, array)
    values: dict[int, np.ndarray] = field(default_factory=dict)
    future: concurrent.futures.Future[Any] | None = None
    complete: bool = False
    others: dict[int, weakref.ref[RemoteArray]] = field(default_factory=dict)  # fetched into RecoveryManager._kept
    extra: set[int] = field(default_factory=set)  # in `meta` though not the call's inputs: the other arrays live then
    borrowed: dict[int, Snapshot] = field(default_factory=dict)  # value id -> the earlier pending snapshot fetching it
    settled: bool = False  # complete, or failed (its fetch, or an earlier snapshot it borrowed from)
    waiters: list[Callable[[], None]] = field(default_factory=list)  # later snapshots borrowing from it, to go on once it settles


def check_recovery(config: Any, optional: bool = True) -> None:
    """A TypeError unless `config` is a `mpmd.Recovery` (or None, when `optional`): launchers check it before
    anything starts."""
    if not isinstance(config, Recovery) and not (optional and config is None):
        raise TypeError(f"recover= takes a mpmd.Recovery(snapshot_every=..., max_failures=...), got {config!r:.80}")


def enable_recovery(mesh: Any, config: Recovery, respawn: Respawn) -> RecoveryManager:
    """Make `mesh` log its steps and recover from lost actors with `respawn`; returns the manager."""
    check_recovery(config, optional=False)
    mesh.recovery = RecoveryManager(mesh, config, respawn)
    return mesh.recovery


class RecoveryManager:
    """The log, the snapshots and the recovery of one mesh (see the module docstring)."""

    def __init__(self, mesh: Any, config: Recovery, respawn: Respawn) -> None:
        self.mesh = mesh
        self.config = config
        self.respawn = respawn
        self.count = 0  # recoveries done
        self.failures = 0  # lost actors so far
        self.gave_up: BaseException | None = None
        self.generation = 0
        self.log: list[StepRecord] = []
        self.snapshot: Snapshot | None = None  # the newest complete one
        self.pending: list[Snapshot] = []
        self._indices = itertools.count()
        self._vid_counter = itertools.count(1)
        self._refs: dict[int, weakref.ref[RemoteArray]] = {}  # value id -> its array (dead ones swept at snapshots)
        self._dispatch = threading.RLock()  # held by a dispatch and for all of a recovery
        self._state = threading.Lock()  # the log and snapshots; never held across a wait on the loop
        self._since_snapshot = 0
        self._recovery: concurrent.futures.Future[None] | None = None
        self._dists: weakref.WeakSet[Any] = weakref.WeakSet()  # every step logged: reloaded on a replacement
        self._kept: dict[int, tuple[np.ndarray, Any, Any]] = {}  # value id -> (host value, spec, dtype) of live arrays
        self._fetching: dict[int, Snapshot] = {}  # value id -> the pending snapshot fetching it into `_kept`
        self._externals: list[Snapshot] = []  # inputs of logged calls the log had not seen (put, restored), fetched
        self._lost: dict[int, list[int]] = {}  # value id -> the lost actors that held its only buffers (no copy left)
        self._unmade: dict[int, str] = {}  # value id -> why the step that makes it could not run again (a recovery's)
        self.last_report: dict[str, Any] = {}
        self.calls, self.call_seconds, self._last_dispatch = 0, 0.0, 0.0  # the bookkeeping's own cost (benchmarks)  # the last recovery's timings (benchmarks/recovery.py)

    # ---- logging steps -------------------------------------------------------------------------------
    def _vid(self, x: RemoteArray) -> int:
        """`x`'s value id (kept on the array itself: cheaper per call than a weak dictionary)."""
        vid = x._vid
        if not vid:
            vid = x._vid = next(self._vid_counter)
            self._refs[vid] = weakref.ref(x)
        return vid

    def _live(self) -> list[tuple[int, RemoteArray]]:
        """Every live array with a value id; forgets the dead ones."""
        out = []
        for vid, ref in list(self._refs.items()):
            x = ref()
            if x is None:
                self._refs.pop(vid, None)
                self._lost.pop(vid, None)
                self._unmade.pop(vid, None)
            else:
                out.append((vid, x))
        return out

    def compile(self, dist: Any, args: tuple[Any, ...]) -> Any:
        """`dist.compile_bound(args)`, recovering from an actor lost meanwhile and compiling again (an explicit
        `step.compile` before `restore(..., for_step=step)` raised ActorDiedError on a mesh that recovered; a probe)."""
        for attempt in itertools.count():
            try:
                with self._dispatch:
                    return dist.compile_bound(args)
            except ActorDiedError as e:
                if attempt > self.config.max_failures or not self.recover_now(e):
                    self._say_gave_up(e)
                    raise
        raise AssertionError("unreachable")

    def call(self, dist: Any, args: tuple[Any, ...], cancelled: threading.Event | None = None) -> Any:
        """Dispatch `dist(*args)`, logged (and snapshotted every `snapshot_every` calls). With `cancelled` (a
        `call_async` in a worker thread): compile first, and dispatch nothing (None) if it was set meanwhile —
        the caller stopped waiting, as a plain mesh's cancelled call dispatches nothing."""
        for attempt in itertools.count():
            try:
                # Room is waited for before the lock, not under it: the steps in flight that an actor's loss failed end
                # only once the recovery has run, and it needs the lock (a loop 512 steps ahead hung for good).
                self.mesh.wait_for_room()
                with self._dispatch:
                    if cancelled is not None:
                        dist.compile_bound(args)
                        if cancelled.is_set():
                            return None
                    if self.gave_up is not None:
                        return dist._call(args, self._note_gave_up, room=False)
                    t0 = time.perf_counter()
                    out = self._call_logged(dist, args)
                    self.calls += 1
                    self.call_seconds += time.perf_counter() - t0 - self._last_dispatch
                    return out
            except ActorDiedError as e:  # met while compiling or dispatching (outside the lock: recover, call again)
                if attempt > self.config.max_failures or not self.recover_now(e):
                    self._say_gave_up(e)
                    raise
        raise AssertionError("unreachable")

    def _call_logged(self, dist: Any, args: tuple[Any, ...]) -> Any:
        """Log the call, snapshot its RemoteArray inputs when one is due, dispatch it, name its outputs."""
        self._dists.add(dist)
        leaves, treedef = jax.tree.flatten(args, is_leaf=lambda x: isinstance(x, RemoteArray))
        rec = StepRecord(next(self._indices), dist, treedef, [], generation=self.generation, context=getattr(dist, "jax_context", lambda: None)())
        remote, unseen = {}, set()
        for x in leaves:
            if isinstance(x, RemoteArray):
                if not x.buffers or x.mesh is not self.mesh:  # lost with an actor (see the module docstring), deleted or
                    # donated, or another mesh's: raises — before it is logged (a refused foreign array stayed in the log,
                    # and every later snapshot asked this mesh's actors for its buffer id; a probe)
                    self.mesh.check_owned(x, f"an argument of {getattr(dist, '__name__', 'the step')}")
                if not x._vid:  # made outside the log: mesh.put, mpmd.restore, ...
                    unseen.add(id(x))
                vid = self._vid(x)
                remote[vid] = x
                rec.leaves.append(("remote", vid, self._refs[vid]))
            else:  # kept for replay: a copy, in case the caller reuses its buffer
                rec.leaves.append(("host", np.array(x, copy=True) if isinstance(x, np.ndarray) else x))
        snap = None
        if self.snapshot is None and not self.pending or self._since_snapshot + 1 >= self.config.snapshot_every:
            snap = self._start_snapshot(rec.index, remote)  # before the dispatch: it reads the inputs' buffers as they are
        elif unseen:  # no step made them: without their values, a replay of this call could not be
            self._keep_external(rec.index, {vid: x for vid, x in remote.items() if id(x) in unseen})
        t = time.perf_counter()
        out = dist._call(args, self._on_failure_of(rec), rec.sent, room=False)  # (room waited for in `call`)
        rec.load_step = dist._last_load
        self._last_dispatch = time.perf_counter() - t
        ins = {id(x) for x in remote.values()}
        out_leaves = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, RemoteArray))
        for j, y in enumerate(out_leaves):
            if isinstance(y, RemoteArray) and id(y) not in ins:
                vid = self._vid(y)
                rec.outs.append((j, vid, self._refs[vid]))
        with self._state:
            self.log.append(rec)
            self._since_snapshot = 0 if snap is not None else self._since_snapshot + 1
        return out

    def lost_with(self, x: RemoteArray) -> list[int] | None:
        """The lost actors `x` lived only on, when a recovery could not put it back (else None)."""
        return self._lost.get(x._vid) if x._vid else None

    def why_gone(self, x: RemoteArray) -> str | None:
        """Why `x`, which holds no buffer, has none, when a recovery could not put it back; else None."""
        actors = self.lost_with(x)
        if not actors:
            return None
        unmade = self._unmade.get(x._vid)
        if unmade:  # (an output of a step the replay could not run: said as the step's own error says it; a probe)
            return (f"{x!r} holds no buffer: the recovery could not run the step that makes it again ({unmade}); call that "
                    "step again with inputs from the host or from steps that ran")
        return (f"{x!r} holds no buffer: it lived only on lost actor(s) {actors} and was neither in the recovery's snapshot "
                "nor made by a step since (put there by mesh.actor(i).put, say). Pass its value again from the host")

    def note_lost(self, x: RemoteArray, actors: list[int]) -> str:
        """`x` lived only on the lost `actors` and no recovery put it back (it never reached a logged step): it
        holds no buffer from now on; why, as `why_gone` says it."""
        x.buffers = {}
        with self._state:
            self._lost[self._vid(x)] = actors
        return self.why_gone(x) or ""

    def _start_snapshot(self, index: int, arrays: dict[int, RemoteArray]) -> Snapshot:
        """Fetch `arrays` (the inputs of log entry `index`) to host memory in the background."""
        snap = Snapshot(index, {vid: (x.actors, x.sharding.spec if x.sharding is not None else None, x.dtype, weakref.ref(x))
                                for vid, x in arrays.items()})
        # Other live arrays of earlier steps (another chain of state, as an eval call's snapshot leaves the
        # optimizer state; losses kept for later): part of the snapshot, since a step logged after it may read
        # them once the caller has let them go. Values never change, so each is fetched once and kept while its
        # array lives (`_kept`): a later snapshot takes it from there.
        with self._state:
            # (not an array whose step failed or was aborted: a cancelled fetch_async aborts it and its actors free the
            # buffers it still names; a snapshot fetching one failed, every one after it too, and the log grew; a probe)
            live = [(vid, x) for vid, x in self._live() if vid not in arrays and x.buffers and not x._step_failed()]
            # (one an earlier snapshot still fetches is taken from it once it completes: a loop running ahead had 47
            # pending at once, each fetching the same kept losses again, 16-24 times each; a probe: +217 MB, steps 3x
            # slower over 4,000 kept losses)
            snap.borrowed = {vid: self._fetching[vid] for vid, _ in live if vid not in self._kept and vid in self._fetching}
            others = {vid: x for vid, x in live if vid not in self._kept and vid not in snap.borrowed}
            cached = {vid: x for vid, x in live if vid in self._kept}
            snap.values.update({vid: self._kept[vid][0] for vid in cached})
            self._fetching.update({vid: snap for vid in others})
        snap.meta.update({vid: (x.actors, x.sharding.spec if x.sharding is not None else None, x.dtype, weakref.ref(x))
                          for vid, x in live if vid in others or vid in cached or vid in snap.borrowed})
        snap.extra = set(others) | set(cached) | set(snap.borrowed)
        snap.others = {vid: weakref.ref(x) for vid, x in others.items()}
        snap.future = self._fetch({**arrays, **others})
        snap.future.add_done_callback(lambda f: self._snapshot_done(snap, f))
        with self._state:
            self.pending.append(snap)
        return snap

    def _fetch(self, arrays: dict[int, RemoteArray]) -> concurrent.futures.Future[dict[int, np.ndarray]]:
        """Get `arrays` to the host in the background (one request per actor): their values by value id."""
        per_actor: dict[int, list[tuple[int, int]]] = {}
        for vid, x in arrays.items():
            per_actor.setdefault(x.actor, []).append((vid, x.buffers[x.actor]))
        held = list(arrays.values())  # strong references until the gets are answered: no release overtakes them
        mesh = self.mesh

        def send() -> list[asyncio.Future[Any]]:
            # Sent by a plain callback on the controller loop, queued now: ahead of the step dispatched next and of
            # the free of the inputs it donates. (From a coroutine, a loop turn later, that free came first: with
            # donate_argnums no snapshot ever completed, the log grew for good and a recovery replayed every
            # step from the first; a probe.)
            sent = []
            for a, vb in per_actor.items():  # (each read as it is made: when the fetch ends before `gathered` runs —
                # the snapshot abandoned for a recovery — a survivor's get failing after the rollback was logged "Task
                # exception was never retrieved"; and a later actor's submit raising left the earlier ones unread)
                sent.append(asyncio.ensure_future(mesh.conn(a).submit("get", {"bufs": [b for _, b in vb]})))
                sent[-1].add_done_callback(_read_error)
            return sent

        async def gathered(sent: list[asyncio.Future[Any]]) -> dict[int, np.ndarray]:
            try:
                replies = await asyncio.gather(*sent)
            finally:
                held.clear()
            got = {}
            for vb, msg in zip(per_actor.values(), replies):
                got.update({vid: arr for (vid, _), arr in zip(vb, msg.arrays)})
            return got

        return mesh.dispatch(send, gathered)

    def adopt(self, arrays: list[RemoteArray]) -> None:
        """Arrays made outside the log that a step will read (what `mpmd.restore` made): their values fetched now,
        waited for, and kept as a logged call's unseen inputs are, so a replay can put them back even when an actor
        is lost before the first step that reads them has been snapshotted (that snapshot starts at the step's
        dispatch; the kill can come first). Kept until a snapshot of a later step completes."""
        arrays = [x for x in arrays if isinstance(x, RemoteArray) and x.buffers]
        if not arrays:
            return
        ext = self._keep_external(next(self._indices), {self._vid(x): x for x in arrays})
        ext.values, ext.complete = ext.future.result(), True  # (waited for: its callback may run after this wakes)

    def _keep_external(self, index: int, arrays: dict[int, RemoteArray]) -> Snapshot:
        """Inputs of log entry `index` that no logged step made: fetched in the background and kept while the
        log holds the entry, so that a replay can put them back where they were."""
        ext = Snapshot(index, {vid: (x.actors, x.sharding.spec if x.sharding is not None else None, x.dtype, weakref.ref(x))
                               for vid, x in arrays.items()})
        ext.future = self._fetch(arrays)

        def done(f: concurrent.futures.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                ext.values, ext.complete = f.result(), True

        ext.future.add_done_callback(done)
        with self._state:
            self._externals.append(ext)
        return ext

    def _snapshot_done(self, snap: Snapshot, f: concurrent.futures.Future[Any]) -> None:
        """`snap`'s fetch `f` ended: it completes (and may become the newest snapshot, trimming the log) once every
        earlier snapshot it took values from has settled, or fails; then the snapshots waiting on it go on."""
        with self._state:
            for vid in snap.others:
                if self._fetching.get(vid) is snap:
                    del self._fetching[vid]
            failed = f.cancelled() or f.exception() is not None
            if not failed:
                waiting = next((src for src in snap.borrowed.values() if not src.settled), None)
                if waiting is not None:  # (run when it settles, outside the lock: see below)
                    waiting.waiters.append(lambda: self._snapshot_done(snap, f))
                    return
                failed = not all(src.complete for src in snap.borrowed.values())
            if snap in self.pending:
                self.pending.remove(snap)
            if failed:
                error = None if f.cancelled() else f.exception()  # (a lost actor's is what the recovery then handles)
                quiet = error is None or isinstance(error, ActorDiedError) or self.mesh.closed  # (the earlier one said why)
                log.log(logging.DEBUG if quiet else logging.WARNING, "snapshot at step record %d failed: %s", snap.index,
                        error or ("an earlier snapshot it took values from failed" if not f.cancelled() else "cancelled"))
            else:
                snap.values.update(f.result())
                snap.values.update({vid: src.values[vid] for vid, src in snap.borrowed.items()})
                snap.complete = True
                for vid, ref in snap.others.items():
                    x = ref()
                    if x is not None:
                        self._kept[vid] = (snap.values[vid], x.sharding.spec if x.sharding is not None else None, x.dtype)
                        weakref.finalize(x, self._kept.pop, vid, None)
                if self.snapshot is None or snap.index > self.snapshot.index:
                    self.snapshot = snap
                    self.log = [r for r in self.log if r.index >= snap.index]
                    self._externals = [e for e in self._externals if e.index >= snap.index]
            snap.borrowed = {}  # (the earlier snapshots may go)
            snap.settled = True
            waiters, snap.waiters = snap.waiters, []
        for go_on in waiters:  # (not under the lock: each takes it)
            go_on()

    # ---- failures -------------------------------------------------------------------------------------
    def _on_failure_of(self, rec: StepRecord) -> Callable[[BaseException], Any]:
        async def on_failure(e: BaseException) -> bool:
            """On the loop: whether the failed step `rec` was recovered (then it ends normally)."""
            if rec.replayed:
                return True
            lost = isinstance(e, ActorDiedError) or rec.generation != self.generation or self._running()
            if not lost:
                rec.failed = True
            if self.gave_up is not None or not lost:
                self._say_gave_up(e)
                return False
            if self._running() or rec.generation == self.generation:
                try:
                    await watch(self._start_recovery(e))  # (not wrap_future: cancelling this await must not cancel the recovery)
                except Exception:
                    self._say_gave_up(e)
                    return False
            # (else a recovery came and went: this step was in its log, or older than its snapshot)
            if not rec.replayed and rec.unreplayable and hasattr(e, "add_line"):
                e.add_line(f"(the mesh recovered, but could not run this step again: {rec.unreplayable})")
            return rec.replayed  # every logged step dispatched before the recovery is replayed by it, unless it cannot be

        return on_failure

    async def _note_gave_up(self, e: BaseException) -> bool:
        """The failure hook of a step dispatched after the recovery gave up: its error says so."""
        self._say_gave_up(e)
        return False

    def _say_gave_up(self, e: BaseException) -> None:
        """A loss the mesh no longer recovers from says so, and why (else it reads as if no recovery was asked for)."""
        with _SAYING:  # (one error object may reach several threads: fail_pending hands it to every waiter)
            if self.gave_up is None or not isinstance(e, ActorDiedError) or "mpmd.Recovery gave up" in e.why:
                return
            if EXITED_HINT in e.why:  # (advice to make the mesh with the Recovery it has: no help now)
                e.why = e.why.replace("\n" + EXITED_HINT, "")
            e.add_line(f"(mpmd.Recovery gave up, so this mesh no longer recovers: {str(self.gave_up).splitlines()[0][:300]}; "
                       "make a new mesh, and mpmd.restore the last checkpoint onto it)")

    def _running(self) -> bool:
        return self._recovery is not None and not self._recovery.done()

    def _start_recovery(self, error: BaseException) -> concurrent.futures.Future[None]:
        """The recovery under way, or a new one (in its own thread: it waits on the loop)."""
        if self._running():
            assert self._recovery is not None
            return self._recovery
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._recovery = fut
        threading.Thread(target=self._recover, args=(error, fut), name="mpmd-recovery", daemon=True).start()
        return fut

    def settle(self, error: BaseException, ready: concurrent.futures.Future[Any] | None) -> bool:
        """From a user thread whose read of an array failed with `error`: recover if an actor was lost (or wait
        for the recovery under way), and for the step `ready` that makes the array; whether the mesh recovered
        (then the array may have been rebound: read it again)."""
        if self.gave_up is not None:
            self._say_gave_up(error)
            return False
        if isinstance(error, ActorDiedError):
            if not self.recover_now(error):
                return False
        elif self._running():
            try:
                self._recovery.result()  # type: ignore[union-attr]
            except Exception:
                return False
        if ready is not None:
            try:
                ready.result(timeout=self.config.spawn_timeout + 60)
            except Exception:
                return False
        return self.count > 0

    def recover_now(self, error: BaseException) -> bool:
        """From a user thread (a fetch that met a lost actor): recover, and say whether it worked."""
        if self.gave_up is not None or not isinstance(error, ActorDiedError):
            self._say_gave_up(error)
            return False
        if not self._running() and not self.mesh.conn(error.actor_id).dead and error.actor_id not in self._dead_processes():
            # Replaced already (the error came from before), or a daemon of no process here whose connection dropped:
            # gone for good, restarted without our session, or a blip. Its answer to a ping says which.
            if self._answers(error.actor_id):
                return True  # read again
        fut = self.mesh.run(self._start(error))
        try:
            fut.result()
        except Exception:
            self._say_gave_up(error)
            return False
        return True

    def _answers(self, i: int) -> bool:
        """Whether actor `i` answers a ping with this mesh's session open (a daemon that is gone is declared lost
        by the watchdog within heartbeat_timeout; one restarted without our session, at once)."""
        try:
            return self.mesh.run(self.mesh.conn(i).answers())
        except ActorDiedError:
            return False

    async def _start(self, error: BaseException) -> concurrent.futures.Future[None]:
        return self._start_recovery(error)

    def _recover(self, error: BaseException, fut: concurrent.futures.Future[None]) -> None:
        t0 = time.monotonic()
        try:
            with self._dispatch:
                self.generation += 1
                report = self._recover_locked(error, t0)
            self.count += 1
            log.warning("recovered from %s in %.1f s (%s)", report.pop("what"), time.monotonic() - t0,
                        ", ".join(f"{k} {v:.2f} s" if isinstance(v, float) else f"{k} {v}" for k, v in report.items()))
            _settle(fut, None)
        except BaseException as e:  # noqa: BLE001 - the failed steps raise their own ActorDiedError
            self.gave_up = e
            if self.mesh.closed:
                log.info("recovery from %s stopped: the mesh was closed", _what(error))
            else:
                log.error("recovery from %s failed after %.1f s; the mesh stops recovering: %s", _what(error),
                          time.monotonic() - t0, e, exc_info=not isinstance(e, GaveUp | ActorStartError))  # (its words say why)
            _settle(fut, e)

    def _recover_locked(self, error: BaseException, t0: float) -> dict[str, Any]:
        report: dict[str, Any] = {"what": _what(error)}
        lost = self._lost_actors(error)
        last: BaseException | None = None  # what broke the attempt before this one
        waiting: set[int] = set()  # lost actors the attempt before did not get to replace: counted once, not again
        replaced: set[int] = set()  # every actor lost in this recovery, whichever attempt: their buffers are gone
        stripped: dict[int, tuple[RemoteArray, list[int]]] = {}  # arrays an attempt took buffers on `replaced` from
        stuck = 0  # attempts in a row that failed with no actor lost beyond those being replaced
        attempts = 0
        while True:
            if self.mesh.closed:  # (closed by its user while this ran: nothing to recover for)
                raise MpmdError("the RemoteMesh was closed during the recovery") from last
            attempts += 1
            self.failures += len(set(lost) - waiting)
            waiting = set(lost)
            replaced |= waiting
            if self.failures > self.config.max_failures:
                raise GaveUp(f"{self.failures} lost actor{'s' * (self.failures != 1)} in all (actor{'s' * (len(lost) != 1)} {', '.join(map(str, lost))} "
                                f"this time), past Recovery(max_failures={self.config.max_failures})") from last
            try:
                report["steps replayed"] = self._attempt(lost, report, waiting, replaced, stripped)
            except ActorDiedError as e:  # another actor lost meanwhile: again, from the snapshot
                if self.mesh.closed:
                    raise MpmdError("the RemoteMesh was closed during the recovery") from e
                last = e
                lost = self._lost_actors(e)
                log.warning("actor(s) %s lost during the recovery (%s); recovering again", lost, _what(e))
                continue
            except _ReplacementDied as e:  # one more lost actor, as documented (not the end of the recovery)
                if self.mesh.closed:
                    raise MpmdError("the RemoteMesh was closed during the recovery") from e.error
                last = e.error
                waiting.discard(e.actor)
                lost = sorted({e.actor, *self._lost_actors(e.error)})
                log.warning("the replacement of actor %d was lost as it started (%s); recovering again", e.actor, str(e.error)[:200])
                continue
            except ActorStartError:
                raise  # a replacement that never came up (within spawn_timeout) ends the recovery, as documented
            except Exception as e:
                # A replacement that dies while it starts breaks the handshake or the wiring with errors of their own
                # (a reset connection reads as a refused key): when a process is gone, that is one more lost actor.
                if self.mesh.closed:
                    raise MpmdError("the RemoteMesh was closed during the recovery") from e
                dead = self._dead_processes(wait=1.0 if getattr(self.mesh, "processes", ()) else 0.0)
                if not dead:
                    raise
                last = e
                lost = sorted(dead | {i for i in range(len(self.mesh)) if self.mesh.conn(i).dead})
                # The same actors again, nothing new lost: their replacement itself fails (a respawn's OSError — its log
                # directory removed, no file descriptors or disk left). It was tried 594 times in 30 s, for good (a probe).
                stuck = stuck + 1 if set(lost) <= waiting else 0
                if stuck >= 3:
                    raise MpmdError(f"the recovery could not replace actor{'s' * (len(lost) != 1)} {', '.join(map(str, lost))}: "
                                    f"{_what(e)} ({stuck} attempts in a row)") from e
                log.warning("actor(s) %s lost during the recovery (%s); recovering again", lost, _what(e))
                continue
            if len(replaced) > 1:  # (two killed at once read as one, and one more "lost during the recovery"; a probe)
                report["actors replaced"] = sorted(replaced)
            if attempts > 1:  # (the phases above are the last attempt's; the total is the whole recovery's)
                report["attempts"] = attempts
            self.last_report = {**report, "started": t0, "total": time.monotonic() - t0}
            return report

    def _attempt(self, lost: list[int], report: dict[str, Any], waiting: set[int], replaced: set[int],
                 stripped: dict[int, tuple[RemoteArray, list[int]]]) -> int:
        """Replace the `lost` actors (each taken out of `waiting` once replaced), reload the steps there, roll back
        and replay, restoring what was on every actor in `replaced` (`stripped`: see `_restore_and_replay`); how many
        steps were replayed."""
        mesh = self.mesh
        t = time.monotonic()
        self._drain(lost)
        report["drain"] = time.monotonic() - t
        t = time.monotonic()
        steps = [(dist, sig, c) for dist in self._functions() for sig, c in list(dist._compiled.items())]
        # Export the steps' executables again while the replacement starts (the daemon's start is mostly waiting).
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpmd-recovery-lower") as pool:
            lowered = [pool.submit(lambda c=c: list(iter_lowered(c.plan, mesh.platform))) for _, _, c in steps]
            for i in lost:
                if self._rejoin(i):
                    waiting.discard(i)
                    continue
                try:
                    address, process, *key = self.respawn(i, self.config.spawn_timeout)
                except ActorStartError as e:
                    if e.killed:  # its process was killed as it started (not: never ready in time, or refused to start)
                        raise _ReplacementDied(i, e) from e
                    if e.timed_out:  # (the message named no setting: a probe)
                        said = ActorStartError(f"no replacement for actor {i} was ready within Recovery(spawn_timeout="
                                               f"{self.config.spawn_timeout:g}) seconds (raise it if its daemons start "
                                               f"slower): {e}")
                        said.timed_out = True
                        raise said from e
                    raise
                waiting.discard(i)  # a new actor from here: if it dies joining, that is one more lost actor
                mesh.replace_actor(i, address, process, key[0] if key else None)
            report["spawn"] = time.monotonic() - t
            t = time.monotonic()
            for (dist, sig, c), blobs in zip(steps, lowered):
                dist._lower_and_ship(c.plan, c.program_ids, sig[2], c.out_tree, blobs.result(), c.holder, sig)
                c.generation = mesh.generation  # loaded on the replacements: current again (see DistributedFunction._cached)
        report["reload"] = time.monotonic() - t
        return self._restore_and_replay(replaced, report, stripped)

    def _rejoin(self, i: int) -> bool:
        """Actor `i` was lost because its daemon answers without this mesh's session (it closed the session after
        --session-timeout, e.g. while this controller was suspended, or was restarted at its address): open a new
        session there instead of starting another daemon (a rendezvous supervisor would never start one for a
        daemon that is alive). Whether it worked."""
        if not self.mesh.conn(i).session_gone:
            return False
        try:
            self.mesh.replace_actor(i, self.mesh.addresses[i])  # (the same daemon: no new process, no new key)
        except Exception as e:  # noqa: BLE001 - then it is replaced like any lost actor
            log.warning("actor %d answered without this mesh's session but did not take a new one (%s); replacing it", i, e)
            return False
        return True

    def _lost_actors(self, error: BaseException) -> list[int]:
        mesh = self.mesh
        lost = {i for i in range(len(mesh)) if mesh.conn(i).dead}
        lost.update(self._dead_processes())
        if isinstance(error, ActorDiedError) and 0 <= error.actor_id < len(mesh):
            lost.add(error.actor_id)
        if not lost:
            raise MpmdError(f"no lost actor to replace ({error})")
        return sorted(lost)

    def _dead_processes(self, wait: float = 0.0) -> set[int]:
        """The actors whose process has exited (waiting up to `wait` seconds for one to show as exited)."""
        deadline = time.monotonic() + wait
        while True:
            dead = {p.actor_id for p in getattr(self.mesh, "processes", ()) if p.dead_reason() is not None}
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _functions(self) -> list[Any]:
        return list(self._dists)

    def _drain(self, lost: list[int]) -> None:
        """Survivors abandon every running step; wait (bounded) for the logged steps' requests to settle, and for
        snapshots under way."""
        mesh = self.mesh

        async def drain() -> None:
            survivors = [i for i in range(len(mesh)) if i not in lost and not mesh.conn(i).dead]
            await asyncio.gather(*(mesh.conn(i).request("abort") for i in survivors), return_exceptions=True)
            n = len(mesh)
            with self._state:  # (the lost actors' requests failed with their connection)
                futures = [f for r in self.log for k, f in enumerate(r.sent) if k % n not in lost and not f.done()]
            if futures:
                await asyncio.wait(futures, timeout=self.config.drain_timeout)
            # (a request still unanswered belongs to the old connection of a lost actor: closed at the reconnect)

        mesh.run(drain())
        with self._state:
            pending = [s.future for s in [*self.pending, *self._externals] if s.future is not None]
        wait_settled(pending, timeout=self.config.drain_timeout)

    def _restore_and_replay(self, replaced: set[int], report: dict[str, Any],
                            carried: dict[int, tuple[RemoteArray, list[int]]] | None = None) -> int:
        """Roll every actor back to the snapshot, put back the older live arrays that were on a `replaced` actor,
        and replay the logged steps since; how many were replayed. `carried`: the arrays an earlier attempt of this
        recovery stripped of their buffers on a replaced actor (kept across attempts: one that failed midway — a
        survivor lost while the snapshot went back — had left them with no buffer, and the next attempt took them
        for let go: every older output was lost, said to be "deleted"; a probe)."""
        mesh = self.mesh
        carried = {} if carried is None else carried
        with self._state:
            snap = self.snapshot
            if snap is None:  # the first is still being taken: replay all, with the inputs where they are (if they are)
                snap = Snapshot(self.log[0].index if self.log else 0, {}, complete=True)
            records = [r for r in self.log if r.index >= snap.index]
        # Every input of the replay still alive now stays alive until the replay reads it: one collected midway
        # (its last holder a pending snapshot the loss failed) freed its buffers after it was judged present.
        pinned = [leaf[2]() for r in records for leaf in r.leaves if leaf[0] == "remote"]  # noqa: F841
        t = time.monotonic()
        stripped: dict[int, tuple[RemoteArray, list[int]]] = {}
        for vid, x in self._live():  # buffers on a replaced actor are gone
            gone = [a for a in x.buffers if a in replaced]
            before = carried[vid][1] if vid in carried and carried[vid][0] is x else []
            if gone or before:
                stripped[vid] = (x, sorted({*before, *gone}))
                x.buffers = {a: b for a, b in x.buffers.items() if a not in replaced}
        carried.update(stripped)
        replayed_vids = {vid for r in records for _, vid, _ in r.outs}
        needed = {leaf[1] for r in records for leaf in r.leaves if leaf[0] == "remote"}
        # The call's inputs go back on every actor (all roll back); the other arrays live at the snapshot only
        # where needed: stripped of a buffer just now, or let go (or donated since: held, but with no buffer) and
        # read by a logged step. (A donated one was taken for held, and the steps reading it were not replayed.)
        def held(vid: int, x: RemoteArray | None) -> bool:
            return x is not None and (bool(x.buffers) or vid in stripped)

        restore = {vid: meta for vid, meta in snap.meta.items()
                   if vid not in snap.extra or vid in stripped or (not held(vid, meta[3]()) and vid in needed)}
        back = [vid for vid, (x, gone) in stripped.items()  # older live arrays that were on a replaced actor
                if vid not in snap.meta and vid not in replayed_vids and vid in self._kept]  # (else: lost, in no snapshot)
        with self._state:  # inputs from outside the log that a logged step reads, let go or on a replaced actor
            external = {vid: (e.values[vid], meta) for e in self._externals if e.complete for vid, meta in e.meta.items()
                        if vid in needed and vid not in restore and (not held(vid, meta[3]()) or vid in stripped)}
        puts = [(snap.values[vid], actors, spec, dtype) for vid, (actors, spec, dtype, _) in restore.items()]
        puts += [(self._kept[vid][0], stripped[vid][1], self._kept[vid][1], self._kept[vid][2]) for vid in back]
        puts += [(value, actors, spec, dtype) for value, (actors, spec, dtype, _) in external.values()]
        arrays = put_all(mesh, puts)  # every actor rolls back to the snapshot; the older arrays go back where they were
        values: dict[int, RemoteArray] = {}
        for (vid, (_, _, _, ref)), fresh in zip(restore.items(), arrays):
            values[vid] = self._rebind(ref() if held(vid, ref()) else None, fresh, vid)  # (a donated one stays deleted)
        for vid, fresh in zip(back, arrays[len(restore):]):
            x = stripped[vid][0]
            x.buffers.update(fresh.buffers)
            fresh.buffers = {}
        for (vid, (_, (_, _, _, ref))), fresh in zip(external.items(), arrays[len(restore) + len(back):]):
            values[vid] = self._rebind(ref() if held(vid, ref()) else None, fresh, vid)
        lost = {vid: sorted(gone) for vid, (x, gone) in stripped.items() if not x.buffers}  # (before the replay makes some)
        report["restore"] = time.monotonic() - t
        t = time.monotonic()
        dones, replayed = [], []
        unavailable: dict[int, str] = {}  # value id -> why no replay makes it (its step could not run again)
        unmade: dict[int, str] = {}  # value id of such a step's output -> why, as its step's error says it
        # The replay holds a value only until the last replayed step that reads it is dispatched (the user's own arrays
        # keep theirs): every replayed step's state was held to the end, one copy of it per step on the actors, and a
        # replay of 60 steps peaked at 3x an actor's memory (120: 5x; a larger state was OOM-killed: a probe).
        last_read = {leaf[1]: k for k, r in enumerate(records) for leaf in r.leaves if leaf[0] == "remote"}
        for k, rec in enumerate(records):
            leaves, why = [], None
            for leaf in rec.leaves:
                if leaf[0] == "host":
                    leaves.append(leaf[1])
                    continue
                _, vid, ref = leaf
                x = values.get(vid)
                x = ref() if x is None else x
                why = unavailable.get(vid)
                if why is None and (x is None or not x.buffers):
                    why = (f"one of its inputs lived only on lost actor(s) {lost.get(vid, sorted(replaced))} and is neither in "
                           "the snapshot nor made by a step since (put there by mesh.actor(i).put, say); pass it again")
                if why is not None:
                    break
                leaves.append(x)
            if why is not None:  # this step fails (its own error says why); the others are replayed, the mesh recovers
                rec.unreplayable = why
                unavailable.update({vid: f"it reads what step record {rec.index} made, which could not run again ({why})"
                                    for _, vid, _ in rec.outs})
                unmade.update({vid: f"step record {rec.index}: {why}" for _, vid, _ in rec.outs})
                continue
            replayed.append(rec)
            # (no wait for room: the failed steps counted in flight end only once this replay has rebound them)
            out = rec.dist._call(jax.tree.unflatten(rec.treedef, leaves), None, rec.sent, load_step=rec.load_step, room=False,
                                 context=rec.context, replay=True)
            dones.append(rec.dist._last[1])
            if len(dones) >= REPLAY_IN_FLIGHT:  # its own bound instead (a daemon serves 4,096 requests per connection)
                self._replayed_step_done(replayed[-REPLAY_IN_FLIGHT], dones[-REPLAY_IN_FLIGHT])
            out_leaves = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, RemoteArray))
            for j, vid, ref in rec.outs:
                values[vid] = self._rebind(ref(), out_leaves[j], vid)
            del leaves, out, out_leaves
            for vid in [vid for vid in values if last_read.get(vid, -1) <= k]:
                del values[vid]
        for rec, d in zip(replayed, dones):
            self._replayed_step_done(rec, d)  # an ActorDiedError here: recover again
        for rec in replayed:
            rec.replayed = True
        with self._state:  # what is still without a buffer now is lost for good (the replay rebound the rest)
            self._lost.update({vid: actors for vid, actors in lost.items() if not stripped[vid][0].buffers})
            self._unmade.update({vid: why for vid, why in unmade.items() if vid in self._lost})
        getattr(mesh, "recovered", lambda: None)()
        report["replay"] = time.monotonic() - t
        if len(replayed) < len(records):
            report["steps that could not run again"] = len(records) - len(replayed)
        return len(replayed)

    def _replayed_step_done(self, rec: StepRecord, done: concurrent.futures.Future[Any]) -> None:
        """Wait for a replayed step. A step that failed of its own error when it first ran (its loader raised on a bad
        record; an input that carried an error) and fails again in the replay is replayed all the same: its outputs
        carry that error, as the first run's did, and the recovery goes on (it gave up, the mesh lost for good, over
        a batch its loop had caught and skipped; a probe). Any other failure raises: a lost actor's (the recovery
        starts again), or one of a step that had succeeded (the replay cannot make what it made: the recovery fails
        loudly rather than leave the state broken)."""
        try:
            done.result()
        except ActorDiedError:
            raise
        except MpmdError as e:
            if not rec.failed:
                raise
            dead = sorted({i for i in range(len(self.mesh)) if self.mesh.conn(i).dead} | self._dead_processes())
            if dead:  # (an abort because a peer was lost: a loss, not the step's own failure)
                raise ActorDiedError(dead[0], str(e).splitlines()[0][:300]) from e
            log.info("replayed step record %d failed again, as when it ran (%s); its outputs carry that error",
                     rec.index, str(e).splitlines()[0][:200])

    def _rebind(self, user: RemoteArray | None, fresh: RemoteArray, vid: int) -> RemoteArray:
        """Point the user's array (if it still lives) at `fresh`'s buffers; returns the array that now holds them."""
        if user is None:
            fresh._vid = vid
            self._refs[vid] = weakref.ref(fresh)
            return fresh
        old, user.buffers, fresh.buffers = user.buffers, dict(fresh.buffers), {}
        user._host = None
        if fresh._ready is not None:  # (an aborted step's output, replayed: made by the replay now, not failed)
            if getattr(user._ready, "donating", False):  # (the replay's outputs are the donated state's only copy too)
                fresh._ready.donating = True
            user._ready = fresh._ready
        if old:
            self.mesh.release_buffers(old)
        return user


class GaveUp(MpmdError):
    """More actors were lost than Recovery(max_failures=...) allows: the recovery stops, by the user's setting."""


class _ReplacementDied(Exception):
    """The process started to replace actor `actor` exited before it was ready (`error` says how)."""

    def __init__(self, actor: int, error: BaseException) -> None:
        super().__init__(actor, error)
        self.actor, self.error = actor, error


PUTS_IN_FLIGHT = 1024
REPLAY_IN_FLIGHT = 512  # replayed steps dispatched and unfinished before the replay waits (the mesh's own limit)


def put_all(mesh: Any, items: list[tuple[np.ndarray, list[int], Any, Any]]) -> list[RemoteArray]:
    """Put many host values (wire form, as `get` returns them) on their actors at once: (value, actors,
    PartitionSpec or None, dtype) each; one RemoteArray each, like `mesh.put_replicated`."""
    from mpmd.runtime.sharding import as_layout, layout_wire, remote_sharding

    requests, out = [], []
    for value, actors, spec, dtype in items:
        wire = to_wire(from_wire(value, dtype))
        shape = wire.shape[: wire.ndim - (len(key_impl(dtype).key_shape) if is_key(dtype) else 0)]
        fields = {"layout": layout_wire(as_layout(spec))} if spec is not None else {}
        bufs = {a: mesh.new_buffer_id() for a in actors}
        requests += [(a, {"buf": b, **fields}, wire) for a, b in bufs.items()]
        layout = as_layout(spec) if spec is not None else (() if mesh.actor_mesh is not None else None)
        out.append(RemoteArray(mesh, bufs, shape, dtype, remote_sharding(layout, mesh.actor_mesh)))

    async def put() -> None:
        room = asyncio.Semaphore(PUTS_IN_FLIGHT)  # (a daemon refuses a connection's requests past its MAX_IN_FLIGHT)

        async def one(a: int, f: dict[str, Any], w: np.ndarray) -> None:
            async with room:
                await mesh.conn(a).request("put", f, [w])

        await asyncio.gather(*(one(a, f, w) for a, f, w in requests))

    mesh.run(put())
    return out


_SAYING = threading.Lock()


def _read_error(f: asyncio.Future[Any]) -> None:
    """Mark `f`'s error as read (its waiter, if any, still gets it)."""
    if not f.cancelled():
        f.exception()


def _what(error: BaseException) -> str:
    """One line for the recovery's log: what was lost and why (the first line of the reason, without the heading
    of the stderr tail that follows it: it ended '; stderr tail:', the tail left out; a probe)."""
    if isinstance(error, ActorDiedError):
        first = error.why.splitlines()[0] if error.why else "no reason given"
        return f"actor {error.actor_id} lost ({first.removesuffix('; stderr tail:')})"
    return f"a failed step ({str(error).splitlines()[0]})"


__all__ = ["Recovery", "RecoveryManager", "enable_recovery"]


def _settle(fut: concurrent.futures.Future[None], error: BaseException | None) -> None:
    """End the recovery's future with `error` (None: it worked), unless it was cancelled: a mesh closing cancels
    what its loop awaits, the recovery's future too, from another thread at any moment."""
    try:
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
