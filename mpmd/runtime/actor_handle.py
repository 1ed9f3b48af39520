"""One actor of a mesh, addressed directly: put arrays on it, run jitted functions there, ask its state
(the embedding API: `mesh.actor(i)`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpmd.compiler.avals import host_value
from mpmd.compiler.lowering import tracing_mesh
from mpmd.errors import ActorDiedError, MpmdError
from mpmd.runtime.aio import as_caller, callers_config, off_loop, start_in_worker
from mpmd.runtime.array import RemoteArray
from mpmd.runtime.buffers import gather
from mpmd.runtime.controller import close_if_unstarted
from mpmd.runtime.sharding import remote_sharding

log = logging.getLogger(__name__)


class ActorHandle:
    """One actor of a mesh (`mesh.actor(i)`; `mesh` is its `RemoteMesh`): place arrays on it, run jitted functions there,
    ask its state."""

    def __init__(self, mesh: Any, index: int) -> None:
        self.mesh = mesh
        self.index = index

    def __repr__(self) -> str:
        return f"ActorHandle({self.index}, {self.mesh.addresses[self.index]})"

    def put(self, x: Any, spec: Any = None) -> RemoteArray:
        """Copy a host array (numpy, jax, or a typed PRNG key array) to this actor; with `spec` (a
        PartitionSpec over the actor mesh) each of its devices gets only its shard. On a mesh made with
        recover=..., a lost actor is replaced and the copy made again."""
        return self._again_if_recovered(lambda: self.mesh.put_replicated(x, [self.index], spec), [])

    async def put_async(self, x: Any, spec: Any = None) -> RemoteArray:
        """Awaitable twin of `put`, for the caller's own event loop: ``x = await mesh.actor(0).put_async(a)``."""
        return await self._again_if_recovered_async(lambda: self.mesh.put_replicated_async(x, [self.index], spec), [])

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` (e.g. a `jax.jit` function) on this actor. Arguments are RemoteArrays on this actor or
        host arrays (copied here first); returns the output pytree as RemoteArrays. `fn` is lowered once per
        argument signature and compiled once per actor. On a mesh made with recover=..., a lost actor is
        replaced (the steps that made the arguments run again) and `fn` runs again, once."""
        _check_callable(fn)
        # Lowered in a worker thread as run_async does: the exported blob carries the lowering thread's stack as
        # source locations, and the actors cache by its hash, so the same function must lower the same from anywhere.
        lowered = start_in_worker(self._lower, fn, args, _callers_context()).result()
        return self._again_if_recovered(lambda: self.mesh.run(self._run_lowered(*lowered, self._staged(lowered[0]))),
                                        lowered[0])

    async def run_async(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Awaitable twin of `run`, for the caller's own event loop: `fn` is lowered in a worker thread and the
        actor's compile and run are awaited without blocking the loop.

            y = await mesh.actor(0).run_async(jax.jit(f), x)
        """
        _check_callable(fn)
        context = _callers_context()
        lowered = await off_loop(functools.partial(self._lower, fn, args, context))

        def staged() -> list[Any]:
            with as_caller(context[0]):
                return self._staged(lowered[0])

        async def attempt() -> Any:
            return await self.mesh.arun(self._run_lowered(*lowered, await off_loop(staged)))

        return await self._again_if_recovered_async(attempt, lowered[0])

    def _staged(self, leaves: list[Any]) -> list[Any]:
        """Each host argument's put to this actor, made here, off the controller loop, as `put` makes it (a big one
        through shared memory: inline, a 20 MiB argument over the daemon's --max-message-mb was refused where `put`
        of it worked); None for a RemoteArray."""
        if self.mesh.closed:  # (as mesh.run says it; staged first, the puts said "never awaited"; a probe)
            raise MpmdError("this RemoteMesh is closed")
        return [None if isinstance(x, RemoteArray) else self.mesh.put_requests(host_value(x), [self.index], None) for x in leaves]

    def _request(self, op: str, fields: dict[str, Any] | None = None) -> Any:
        """One request to this actor's daemon, its reply; on a mesh made with recover=..., to the replacement of a
        lost one (as `put` and `run`: info() and stats() raised and advised mesh.reconnect; a probe)."""
        return self._again_if_recovered(lambda: self.mesh.run(self.mesh.conn(self.index).request(op, fields)), [])

    async def _request_async(self, op: str, fields: dict[str, Any] | None = None) -> Any:
        """Awaitable twin of `_request`."""
        return await self._again_if_recovered_async(lambda: self.mesh.arun(self.mesh.conn(self.index).request(op, fields)), [])

    def _again_if_recovered(self, call: Callable[[], Any], leaves: list[Any]) -> Any:
        """`call()`, and once more if it met a lost actor and the mesh recovered (`_recovered`)."""
        try:
            return call()
        except ActorDiedError as e:
            if not self._recovered(e, leaves):
                raise
        return call()

    async def _again_if_recovered_async(self, call: Callable[[], Any], leaves: list[Any]) -> Any:
        """Awaitable twin of `_again_if_recovered` (`call()` makes the awaitable; the recovery is waited for in a
        worker thread)."""
        try:
            return await call()
        except ActorDiedError as e:
            if not await off_loop(functools.partial(self._recovered, e, leaves)):
                raise
        return await call()

    def _recovered(self, error: ActorDiedError, leaves: list[Any]) -> bool:
        """From a user thread: whether the mesh (made with recover=...) recovered from the loss behind `error`
        and the steps that make the RemoteArrays among `leaves` ended, so that the call may be made again."""
        recovery = getattr(self.mesh, "recovery", None)
        if recovery is None:
            return False
        arrays = [x for x in leaves if isinstance(x, RemoteArray)]
        if any(x._ready is None and error.actor_id in x.actors for x in arrays):
            return False  # an argument put on the lost actor (no step makes it again): its data is gone, say so
        readies = list({id(x._ready): x._ready for x in arrays if x._ready is not None}.values())
        if not all(recovery.settle(error, ready) for ready in readies or [None]):
            return False
        if any(x.is_deleted() for x in arrays):
            return False
        log.warning("mesh.actor(%d): actor %s was lost; the mesh recovered, calling again", self.index, error.actor_id)
        return True

    def _lower(self, fn: Callable[..., Any], args: tuple[Any, ...], context: tuple[dict[str, Any], Any]) -> tuple[list[Any], bytes, Any]:
        """Check the arguments and lower `fn` for them (here, once per signature), in a worker thread under the
        caller's `context` (`_callers_context`): (argument leaves, blob, what `Executables.lower` says of the outputs)."""
        config, (caller, callers_mesh) = context
        with as_caller(config):
            return self._lower_here(fn, args, caller, callers_mesh)

    def _lower_here(self, fn: Callable[..., Any], args: tuple[Any, ...], caller: Any, callers_mesh: Any) -> tuple[list[Any], bytes, Any]:
        mesh = self.mesh
        leaves, treedef = jax.tree.flatten(args, is_leaf=lambda x: isinstance(x, RemoteArray))
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
            args, is_leaf=lambda x: isinstance(x, RemoteArray))[0]]
        specs = []
        for x, path in zip(leaves, paths):
            if isinstance(x, RemoteArray):
                mesh.check_owned(x, f"argument args{path}")
                if self.index not in x.buffers:
                    raise MpmdError(f"argument args{path} ({x!r}) lives on actors {x.actors}, not on actor {self.index}; "
                                    f"copy it with mesh.actor({self.index}).put(mpmd.fetch(x)) first")
                specs.append(jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type))
            else:
                # (weakly typed as under jax.jit: a Python number, or a jax Array made from one; numpy values are not)
                weak = type(x) in (int, float, complex) or bool(isinstance(x, jax.Array) and getattr(x, "weak_type", False))
                try:
                    specs.append(jax.ShapeDtypeStruct(np.shape(x), host_value(x).dtype, weak_type=weak))
                except (TypeError, ValueError) as e:
                    raise MpmdError(f"argument args{path} is a {type(x).__name__}, not an array: {e}") from None
        blob, out = mesh.executables.lower(fn, jax.tree.unflatten(treedef, specs), mesh.infos[self.index].header["platform"],
                                           tracing_mesh(mesh.actor_mesh, caller, getattr(mesh, "platform", None)),
                                           mesh.actor_mesh, callers_mesh)
        return leaves, blob, out

    async def _run_lowered(self, leaves: list[Any], blob: bytes, out: Any, staged: list[Any]) -> Any:
        """On the controller loop: have the actor compile `blob` (once), copy host arguments there (their puts,
        `staged`), run it."""
        mesh, conn = self.mesh, self.mesh.conn(self.index)
        out_tree, out_avals, jit_layouts = out
        out_layouts: list[Any] = [None] * len(out_avals)
        in_bufs = []
        temps = []
        holder = None
        try:
            if mesh.actor_mesh is None:
                exe, holder = await mesh.executables.for_run(self.index, blob)
            else:  # compiled for the layouts its arguments have (host arguments: replicated), as jax.jit would
                in_layouts = tuple(x.sharding.layout if isinstance(x, RemoteArray) and x.sharding is not None else () for x in leaves)
                (exe, out_layouts), holder = await mesh.executables.for_run(self.index, blob, in_layouts, jit_layouts)
            for x, put in zip(leaves, staged):
                if put is None:
                    in_bufs.append(x.buffers[self.index])
                else:
                    requests, made = put
                    temp = made()
                    temps.append(temp)
                    await gather(requests)
                    in_bufs.append(temp.buffers[self.index])
            out_bufs = [mesh.new_buffer_id() for _ in out_avals]
            try:
                await conn.request("run", {"exe": exe, "inputs": in_bufs, "outputs": out_bufs})
            except BaseException:  # (cancelled after the request went, its outputs were left for good; a probe)
                for b in out_bufs:
                    mesh.release_buffers({self.index: b})
                raise
        finally:
            for put in staged:  # (those never started: closed, their shared-memory segments go)
                for request in put[0] if put is not None else ():
                    close_if_unstarted(request)
            for temp in temps:  # (batched, behind the run: no await here, which a cancelled caller may not get to)
                mesh._let_go(temp)
            if holder is not None:
                mesh.executables.done_running(holder)
        outs = [RemoteArray(mesh, {self.index: b}, a.shape, a.dtype, remote_sharding(lay, mesh.actor_mesh),
                            weak_type=getattr(a, "weak_type", False))
                for b, a, lay in zip(out_bufs, out_avals, out_layouts)]
        return jax.tree.unflatten(out_tree, outs)

    def hlo(self, exe_key: str) -> str:
        """The optimized HLO text XLA compiled for one of this actor's executables (collectives, fusions):
        `step.compile(...).loaded[actor].executables` lists its Program's executable keys."""
        return self._request("hlo", {"exe": exe_key}).header["text"]

    def ping(self) -> float:
        """Round-trip time of a ping, in seconds."""
        def timed() -> float:  # (a recovered mesh's replacement is pinged, and timed, afresh)
            t = time.perf_counter()
            self.mesh.run(self.mesh.conn(self.index).request("ping"))
            return time.perf_counter() - t

        return self._again_if_recovered(timed, [])

    def info(self) -> dict[str, Any]:
        """What the daemon says of itself: pid, platform, devices, versions, bounds."""
        return dict(self._request("info").header)

    def stats(self) -> dict[str, Any]:
        """Buffers held (count and bytes), executables cached, compiles and cache hits, requests served."""
        return _stats(self._request("stats").header)

    async def stats_async(self) -> dict[str, Any]:
        """Awaitable twin of `stats`."""
        return _stats((await self._request_async("stats")).header)

    async def info_async(self) -> dict[str, Any]:
        """Awaitable twin of `info`."""
        return dict((await self._request_async("info")).header)


def _stats(header: Any) -> dict[str, Any]:
    h = dict(header)
    for k in ("op", "id", "ok", "v"):
        h.pop(k, None)
    return h


def _callers_context() -> tuple[dict[str, Any], Any]:
    """What of the calling thread's JAX configuration `fn` is lowered under in a worker thread (both are
    thread-local): the options it set (`callers_config`: under `jax.enable_x64(True)` a float64 result came back
    float32), and the mesh the caller set (`jax.set_mesh`: its axes resolve a bare PartitionSpec as under jax.jit;
    a probe): (options, (abstract mesh, concrete mesh or None))."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    return callers_config(), (jax.sharding.get_abstract_mesh(), get_mesh() if get_mesh else None)


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"actor.run(fn, *args): fn must be the function to run on the actor (e.g. jax.jit(f)), got "
                        f"{type(fn).__name__} {fn!r:.60}; the arguments come after it")
