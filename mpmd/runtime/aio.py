"""The awaitable API's plumbing: awaiting the runtime from the caller's own event loop without blocking it.

The controller's loop runs in a thread of its own (`runtime.controller.EventLoopThread`); a framework that
embeds mpmd runs another loop — the caller's. Every awaitable twin (`step.call_async`, `fetch_async`,
`ready_async`, `actor.put_async` / `run_async`, `save_async`, `RemoteMesh.local_async`, ...) keeps the caller's
loop free the same three ways:

* what talks to actors runs on the controller's loop, awaited across threads (`EventLoopThread.arun`);
* what computes here for long (tracing, planning and lowering a step, starting daemons, closing a mesh) runs
  in a worker thread (`off_loop`); Python cannot stop a running thread, so a cancelled await leaves it to
  finish and hands its result to a clean-up (a mesh started for nobody is closed);
* what the runtime already tracks as a concurrent future (a dispatched step) is awaited with `watch`, which
  never cancels it: another caller may wait for the same step.

Cancelling the await of a step's outputs (`fetch_async`, `ready_async`) while that step still runs aborts
it on its actors (see `DistributedFunction.call_async`): its buffers are freed and the mesh stays usable —
unless another task (or a thread's blocking fetch) waits for the same step's outputs at that moment, or for a
later step's that reads them: then the step goes on for it.

    async def main():
        async with await mpmd.RemoteMesh.local_async(num_actors=2) as mesh:
            step = mpmd.distributed(train_step, mesh=mesh)
            params, opt_state, losses = await step.call_async(params, opt_state, batch)
            print(await mpmd.fetch_async(losses))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np

from mpmd.compiler.avals import from_wire
from mpmd.errors import MpmdError
from mpmd.runtime.array import RemoteArray
from mpmd.runtime.controller import wait_settled
from mpmd.runtime.waiters import waiters, waiting_for

T = TypeVar("T")
# Threads for work that would hold the caller's loop: a few, so that steps of several meshes compile at once.
_WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="mpmd-worker")


async def watch(fut: concurrent.futures.Future[T]) -> T:
    """Await a concurrent future from the running loop. Unlike `asyncio.wrap_future`, cancelling the await
    leaves `fut` alone (a dispatched step goes on; other waiters still see its end)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    # (`fut` reaches the callbacks as their argument, never through their closures: a closure over it would make
    # a cycle — fut, its callback, fut — that kept its result, e.g. a restored tree's actor buffers, alive until
    # the garbage collector ran, after the caller had let it go.)
    def settle(done: concurrent.futures.Future[T]) -> None:
        if waiter.done():
            return
        if done.cancelled():
            waiter.cancel()
        elif done.exception() is not None:
            waiter.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            waiter.set_result(done.result())

    def copy(done: concurrent.futures.Future[T]) -> None:
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:  # the caller's loop is closed: nobody waits any more
            pass

    fut.add_done_callback(copy)
    return await waiter


def _own_thread(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """`fn()` in a new daemon thread; a concurrent future of its result."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever awaits it
            fut.set_exception(e)

    threading.Thread(target=run, name="mpmd-wait", daemon=True).start()
    return fut


try:
    from jax._src.config import config_ext as _config_ext
    from jax._src.config import config_states as _config_states
except ImportError:  # (a JAX without them: x64 at least reaches the worker)
    _config_ext = _config_states = None


def callers_config() -> dict[str, Any]:
    """The JAX options the calling thread set for itself (`with jax.enable_x64(True):`, `jax.default_matmul_precision`,
    `jax.numpy_rank_promotion`, ...: JAX keeps them per thread), for a worker thread that traces for it to set
    again (`as_caller`): a step compiled in a worker without them ran float32 where the caller asked float64, or
    promoted ranks the caller's code refused (probes)."""
    if _config_states is None:
        return {"jax_enable_x64": bool(jax.config.jax_enable_x64)}
    got = {}
    for name, state in _config_states.items():
        value = state.get_local()
        if value is not _config_ext.unset and name not in _NOT_CARRIED:
            got[name] = value
    return got


# Options whose value guards this thread against others: set again in a worker, jax.thread_guard(True) failed every
# lowering ("Nested thread guards in different threads are not supported": a review).
_NOT_CARRIED = frozenset({"jax_thread_guard"})


@contextlib.contextmanager
def as_caller(config: dict[str, Any]) -> Iterator[None]:
    """In this (worker) thread, the options `callers_config` read in the caller's."""
    with contextlib.ExitStack() as stack:
        for name, value in config.items():
            stack.enter_context(_config_states[name](value) if _config_states is not None else jax.enable_x64(value))
        yield


def start_in_worker(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """Start `fn(*args)` in one of the runtime's worker threads; a concurrent future of its result."""
    return _WORKERS.submit(fn, *args)


async def off_loop(fn: Callable[[], T], *, abandoned: Callable[[T], Any] | None = None, own_thread: bool = False) -> T:
    """`fn()` in a worker thread, awaited. If the await is cancelled the thread runs on (Python cannot stop
    it) and, when it ends, `abandoned(result)` disposes of what nobody will use. `own_thread`: a thread of its own,
    not one of the shared pool's (a wait of a minute, as a mesh's start: eight abandoned under a timeout held every
    worker, and a first call on another mesh waited for them; a probe)."""
    fut = _own_thread(fn) if own_thread else _WORKERS.submit(fn)
    try:
        return await watch(fut)
    except asyncio.CancelledError:
        if not fut.cancel() and abandoned is not None:
            fut.add_done_callback(lambda f: abandoned(f.result()) if f.exception() is None else None)
        raise


def abortable(fut: concurrent.futures.Future[Any], abort: Callable[[], concurrent.futures.Future[Any]]) -> None:
    """Say how to abort the work `fut` stands for (a dispatched step): `abort()` starts it and returns a
    future of its end. `abort_unfinished` calls it for whoever awaits the work and is cancelled."""
    fut.mpmd_abort = abort  # type: ignore[attr-defined]
    # Once the work is done there is nothing to abort: let go of `abort` (it holds the step function, which the
    # mesh's list of steps in flight would otherwise keep alive, its Programs loaded on the actors).
    fut.add_done_callback(lambda f: setattr(f, "mpmd_abort", _nothing_to_abort))


def _nothing_to_abort() -> concurrent.futures.Future[Any]:
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    done.set_result(None)
    return done


@contextlib.contextmanager
def awaiting(arrays: list[RemoteArray]) -> Iterator[None]:
    """Count this await among those of the steps that make `arrays` and of the unfinished steps they read from
    (`abort_unfinished` aborts a step only when the cancelled await was its only one: another task, or a thread's
    blocking fetch, may wait for the same step's outputs, or for a later step's that reads them; see `waiters`)."""
    with waiting_for({id(x._ready): x._ready for x in arrays if x._ready is not None}.values()):
        yield


async def abort_unfinished(arrays: list[RemoteArray]) -> None:
    """Abort every step that makes one of `arrays`, has not ended and that no other await waits for (this
    await of them, inside `awaiting`, was cancelled), and wait until the actors have let go of it. Steps that
    ended, that another task still awaits, or that were donated their inputs (`donating`), stay as they are."""
    aborts = {}
    for x in arrays:
        r = x._ready
        # (a step that was donated its inputs runs on: its outputs are now the only copy of that state, and the
        # caller holds them — a timeout on fetching a loss took the parameters and the optimizer state with it)
        if (r is not None and not r.done() and hasattr(r, "mpmd_abort") and waiters(r) <= 1
                and not getattr(r, "donating", False)):
            aborts[id(r)] = r.mpmd_abort
    if aborts:
        await asyncio.gather(*(watch(abort()) for abort in aborts.values()), return_exceptions=True)


def _remote_leaves(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, RemoteArray))


async def _step_error_first(arrays: list[RemoteArray]) -> None:
    """If a step making one of `arrays` failed, raise its error (clearer than an actor's note that a buffer
    never came)."""
    for x in arrays:
        if x._ready is not None:
            try:
                await asyncio.wait_for(watch(x._ready), 30)
            except Exception:
                x._raise_step_error()


async def _recovered(arrays: list[RemoteArray], error: BaseException) -> bool:
    """Whether the meshes of `arrays` made with recover=... recovered from the failure behind `error` (waiting
    for the steps that make the arrays, and for a recovery, in a worker thread), so that reading the arrays
    again may work: the awaitable form of `array._recovered`."""
    meshes = {id(x.mesh): x.mesh for x in arrays if getattr(x.mesh, "recovery", None) is not None}
    if not meshes:
        return False
    readies = list({id(x._ready): x._ready for x in arrays if x._ready is not None}.values())

    def settle() -> bool:
        wait_settled(readies)  # a step in flight ends recovered (normally) or failed
        recovered = False
        for m in meshes.values():  # (the error came from one of them; a read of the others fails again if it must)
            try:
                recovered = m.recovery.settle(error, None) or recovered
            except Exception:  # noqa: BLE001 - e.g. an actor id the error names that this mesh does not have
                pass
        return recovered

    return await off_loop(settle) and not any(x.is_deleted() for x in arrays)


async def fetch_async(tree: Any) -> Any:
    """Awaitable twin of `mpmd.fetch`: every RemoteArray of a pytree brought here (numpy arrays, jax key
    arrays for typed PRNG keys), one request per actor, all meshes at once, without blocking the caller's
    event loop. Cancelling it while a step making one of the arrays still runs aborts that step (not one that was
    donated its inputs: see `abort_unfinished`). On a mesh
    made with recover=..., a lost actor is recovered from and the arrays read again, as `mpmd.fetch` does.

        losses = await mpmd.fetch_async(losses)
    """
    arrays = [x for x in _remote_leaves(tree)[0] if isinstance(x, RemoteArray)]
    try:
        return await _fetch_async(tree)
    except MpmdError as e:
        for x in arrays:  # (a fetch begun by copy_to_host_async that failed is asked again)
            x.drop_failed_host()
        if not await _recovered(arrays, e):
            await _failed(arrays, e)
            raise
    try:
        return await _fetch_async(tree)  # (rebound by the recovery)
    except MpmdError as e:
        await _failed(arrays, e)
        raise


async def _failed(arrays: list[RemoteArray], e: MpmdError) -> None:
    """A fetch of `arrays` failed with `e`: mark them, and raise the error of a step that failed making one
    of them if there is one (clearer than an actor's note that a buffer never came)."""
    for x in arrays:
        x._failed_fetch(e)
    await _step_error_first(arrays)


async def _fetch_async(tree: Any) -> Any:
    leaves, treedef = _remote_leaves(tree)
    arrays = [x for x in leaves if isinstance(x, RemoteArray)]
    wanted: dict[Any, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # mesh -> actor -> leaf indices
    meshes: dict[int, Any] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, RemoteArray) and x._host is None:
            x._check_usable()
            meshes[id(x.mesh)] = x.mesh
            wanted[id(x.mesh)][x.actor].append(i)

    async def from_mesh(key: int) -> dict[int, np.ndarray]:
        per_actor = wanted[key]
        got = await meshes[key].get_buffers_async({a: [leaves[i].buffers[a] for i in idx] for a, idx in per_actor.items()},
                                                  {a: [leaves[i].nbytes for i in idx] for a, idx in per_actor.items()})
        return {i: v for a, idx in per_actor.items() for i, v in zip(idx, got[a])}

    async def started(i: int) -> dict[int, np.ndarray]:  # a fetch begun by copy_to_host_async
        return {i: await watch(leaves[i]._host)}

    with awaiting(arrays):
        try:
            for r in {id(x._ready): x._ready for x in arrays if getattr(x._ready, "host_calls", False)}.values():
                with contextlib.suppress(Exception):  # a step's callbacks print before any of its values is seen, as
                    await watch(r)  # fetch has them (it returned first: a probe); its error comes with the values
            parts = await asyncio.gather(*(from_mesh(k) for k in wanted),
                                         *(started(i) for i, x in enumerate(leaves) if isinstance(x, RemoteArray) and x._host is not None))
        except asyncio.CancelledError:
            await abort_unfinished(arrays)
            raise
    got = {i: v for part in parts for i, v in part.items()}
    out = [from_wire(got[i], x.dtype) if isinstance(x, RemoteArray) else x for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


async def ready_async(tree: Any) -> Any:
    """Awaitable twin of `block_until_ready`: wait until every RemoteArray of a pytree is computed on its
    actors (nothing is fetched) and return the tree; raises the error of a step that failed, naming actor and
    task. Cancelling it while a step making one of the arrays still runs aborts that step on its actors (not one
    that was donated its inputs: see `abort_unfinished`).

        params, opt_state, losses = await mpmd.ready_async(await step.call_async(params, opt_state, batch))

    On a mesh made with recover=..., a lost actor is recovered from, as `block_until_ready` does.
    """
    arrays = [x for x in _remote_leaves(tree)[0] if isinstance(x, RemoteArray)]
    try:
        return await _ready_async(tree, arrays)
    except MpmdError as e:
        if not await _recovered(arrays, e):
            raise
    return await _ready_async(tree, arrays)  # (rebound by the recovery)


async def _ready_async(tree: Any, arrays: list[RemoteArray]) -> Any:
    for x in arrays:
        x._check_usable()
    with awaiting(arrays):
        return await _wait_ready(tree, arrays)


async def _wait_ready(tree: Any, arrays: list[RemoteArray]) -> Any:
    try:
        for r in {id(x._ready): x._ready for x in arrays if x._ready is not None}.values():
            try:
                await watch(r)
            except Exception:
                for x in arrays:
                    if x._ready is r:
                        x._raise_step_error()
                raise
        by_mesh: dict[int, tuple[Any, dict[int, list[int]]]] = {}
        for x in arrays:
            _, bufs = by_mesh.setdefault(id(x.mesh), (x.mesh, defaultdict(list)))
            for a, b in x.buffers.items():
                bufs[a].append(b)
        await asyncio.gather(*(mesh.wait_buffers_async(dict(bufs)) for mesh, bufs in by_mesh.values()))
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not (task is not None and task.cancelling()):  # (not the caller's: the mesh's loop dropped the step)
            _raise_if_closed_meanwhile(arrays, None)
        await abort_unfinished(arrays)
        raise
    except Exception as e:
        _raise_if_closed_meanwhile(arrays, e)
        raise
    return tree


def _raise_if_closed_meanwhile(arrays: list[RemoteArray], e: BaseException | None) -> None:
    """A step whose actors stopped, or whose request the loop dropped, because its mesh was closed while it was
    awaited (`aclose` from another task) is the close's doing: said so, as fetch_async says it (it was an
    ActorDiedError 'exited with code 0', or a CancelledError of a task nobody cancelled: a probe)."""
    for x in arrays:
        if getattr(x.mesh, "closed", False):
            x.mesh.raise_if_closed_meanwhile(e)
