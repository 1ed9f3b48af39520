"""RemoteMesh: the actors a controller drives — their connections, buffers, executables and steps — and the
ways to get one: daemons started here, attached to, placed by Ray, or found at a rendezvous.

    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        x = mesh.actor(0).put(np.ones(4, np.float32))
        y = mesh.actor(0).run(jax.jit(lambda a: a * 2), x)
        print(y.to_numpy())

    async with await mpmd.RemoteMesh.local_async(num_actors=2) as mesh:   # the same from a coroutine:
        x = await mesh.actor(0).put_async(np.ones(4, np.float32))         # the caller's loop runs on meanwhile
        y = await mesh.actor(0).run_async(jax.jit(lambda a: a * 2), x)
        print(await mpmd.fetch_async(y))

The mesh delegates: starting processes to `runtime.launch`, the event loop and connections to
`runtime.controller`, buffers to `runtime.buffers`, executables and Programs to `runtime.executables`, the
data plane's routes to `runtime.wiring`, one actor's embedding API to `runtime.actor_handle`, traces and
profiles to `mpmd.observe`.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import collections.abc
import concurrent.futures
import functools
import inspect
import logging
import numbers
import os
import re
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import zmq.asyncio

from mpmd.compiler.avals import is_key, key_impl, to_wire
from mpmd.errors import ActorDiedError, IncompatibleActorError, MpmdError, RemoteError
from mpmd.observe.profile import ProfileContext
from mpmd.observe.trace import Trace, TraceContext, measure_clock_offsets
from mpmd.runtime.actor_handle import ActorHandle
from mpmd.runtime.aio import off_loop
from mpmd.runtime.arguments import check_seconds
from mpmd.runtime.array import RemoteArray, fetch
from mpmd.runtime.buffers import BufferClient, gather
from mpmd.runtime.controller import (
    CLOSED_MEANWHILE,
    ActorConnection,
    EventLoopThread,
    Watchdog,
    blocking,
    close_unstarted,
    wait_settled,
)
from mpmd.runtime.executables import Executables
from mpmd.runtime.held import Held, release_dropped, start_reaper
from mpmd.runtime.inputs import close_stager
from mpmd.runtime.interrupts import install as redeliver_dropped_interrupts
from mpmd.runtime.launch.local import LocalOptions, LocalProcess, check_devices, start_local
from mpmd.runtime.loader import check_loader_names
from mpmd.runtime.recovery import Recovery, check_recovery, enable_recovery
from mpmd.runtime.sharding import ActorMesh, as_spec, layout_wire, remote_sharding
from mpmd.runtime.wiring import TRANSPORTS, wire_data_plane
from transport.auth import ClientKeys
from transport.protocol import IMPORTING_LOADER, ProtocolError

log = logging.getLogger(__name__)
_LIVE_MESHES: weakref.WeakSet[RemoteMesh] = weakref.WeakSet()
MAX_STEPS_IN_FLIGHT = 512  # steps dispatched and not finished before a caller waits (see RemoteMesh.wait_for_room)



def _refuse_inside_a_loader_import(what: str) -> None:
    """An actor daemon imports its loaders' modules at start (actors/daemon.py sets IMPORTING_LOADER
    meanwhile): a script that names itself as the loader module and starts a mesh when imported would have every
    actor start actors of its own, without end."""
    name = os.environ.get(IMPORTING_LOADER)
    if name:
        raise RuntimeError(f"{what} was called while an mpmd-actor imported the module of its loader {name!r}: that module "
                           "starts a mesh when imported, so each actor would start actors of its own. Put the script's code "
                           "under `if __name__ == '__main__':`, or the loader in a module of its own")


def _check_options(mesh_shape: Any, transfer_timeout: Any, heartbeat_interval: Any, heartbeat_timeout: Any) -> None:
    """RemoteMesh's own keyword arguments, checked (by every launcher before any daemon starts, and by RemoteMesh)."""
    if mesh_shape is not None and (isinstance(mesh_shape, (str, bytes, collections.abc.Mapping, collections.abc.Iterator))
                                   or not hasattr(mesh_shape, "__iter__") or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in mesh_shape)):  # (a generator was
        # used up by this check, and a dict read as its keys; a probe)
        raise ValueError(f"mesh_shape must be a sequence of positive ints, one per axis (e.g. (2, 2)), got {mesh_shape!r:.80}")
    for name, value in (("transfer_timeout", transfer_timeout), ("heartbeat_interval", heartbeat_interval),
                        ("heartbeat_timeout", heartbeat_timeout)):  # (heartbeat_timeout=inf waited for good on an
        check_seconds(name, value)  # address nothing listens on: a probe)
    if not 2 * heartbeat_interval < heartbeat_timeout:
        raise ValueError(f"heartbeat_timeout ({heartbeat_timeout}) must exceed twice heartbeat_interval ({heartbeat_interval}): "
                         "a busy actor answers a ping only every heartbeat_interval")


def _check_data_plane(transport: Any, overlap: Any) -> None:
    """`transport` one of TRANSPORTS, `overlap` a bool ("no" was taken for True: a probe)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {TRANSPORTS}")
    if not isinstance(overlap, (bool, np.bool_)):
        raise TypeError(f"overlap must be True or False, got {type(overlap).__name__} {overlap!r:.40}")


def _check_mesh_arguments(kwargs: dict[str, Any], devices_per_actor: Any) -> None:
    """A launcher's keyword arguments for RemoteMesh checked before any daemon starts (they take seconds), with
    `mesh_shape` / `axis_names` against `devices_per_actor`; what only the daemons can say is checked once they
    answer (`_device_mesh`)."""
    _check_options(kwargs.get("mesh_shape"), kwargs.get("transfer_timeout", 300.0), kwargs.get("heartbeat_interval", 1.0),
                   kwargs.get("heartbeat_timeout", 10.0))
    # (a rendezvous waited its whole timeout, and Ray started every daemon, before these were refused: a probe)
    check_recovery(kwargs.get("recover"))
    _check_data_plane(kwargs.get("transport", "auto"), kwargs.get("overlap", True))
    shape, names = kwargs.get("mesh_shape"), kwargs.get("axis_names")
    if names is not None and shape is None:
        raise ValueError("axis_names needs mesh_shape too (one size per name)")
    if shape is not None and not isinstance(shape, (str, bytes)) and hasattr(shape, "__iter__") and all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in shape):
        am = ActorMesh(tuple(int(d) for d in shape), tuple(names) if names is not None else tuple(f"axis{i}" for i in range(len(shape))))
        if isinstance(devices_per_actor, int) and am.size != devices_per_actor:
            raise ValueError(f"mesh_shape {am.shape} needs {am.size} devices per actor, but devices_per_actor is "
                             f"{devices_per_actor}; pass devices_per_actor={am.size}")


def is_daemon_address(a: Any) -> bool:
    """Whether `a` is an address a controller can connect to: tcp://HOST:PORT (HOST a name, an IPv4 address or
    a bracketed IPv6 one; PORT 1-65535) or ipc://PATH."""
    if not isinstance(a, str):
        return False
    tcp = re.match(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\s\[\]*]+):(\d{1,5})$", a)
    return bool(re.match(r"^ipc://\S+$", a) or tcp and 1 <= int(tcp.group(2)) <= 65535)

class RemoteMesh:
    """A set of actors (each an `mpmd-actor` daemon with its own devices) driven by this controller. Made by:

        RemoteMesh.local(num_actors)                 daemons started on this machine (ended with the mesh)
        RemoteMesh.connect(addresses, keys=...)      daemons started by hand on other nodes
        RemoteMesh.ray(num_actors)                   daemons Ray places (the `ray` extra)
        RemoteMesh.from_rendezvous(dir, num_actors)  daemons SLURM, Kubernetes or a script started, announcing themselves

    (each with an `_async` twin). Use it as ``with ... as mesh:`` or call `close()`: its daemons' buffers go then.
    `actor(i)` is one actor's handle (put, run, stats); `len(mesh)` the number of actors. The keyword arguments
    below tune every constructor: `heartbeat_timeout` (seconds of silence before an actor is declared lost),
    `transfer_timeout` (a receive's limit), `transport`, `overlap`, and `mesh_shape` / `axis_names` (each actor's
    device mesh for SPMD stages)."""

    def __init__(self, addresses: Sequence[str], processes: Sequence[LocalProcess] = (), *,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 10.0, transport: str = "auto",
                 transfer_timeout: float = 300.0, overlap: bool = True, keys: Any = None,
                 mesh_shape: Sequence[int] | None = None, axis_names: Sequence[str] | None = None) -> None:
        """Drive the actors at `addresses`. `transport` picks the data plane (see `mpmd.runtime.wiring`: "auto", "tcp",
        "shm", "nccl", "none"); a receive that waits `transfer_timeout` seconds fails the step; `overlap=False`
        makes actors wait for each send where it stands (to measure what overlap buys). `keys`: how this
        controller authenticates to the daemons (see `connect`); None for daemons without keys.

        `mesh_shape` / `axis_names`: the device mesh every actor builds over its own devices (SPMD inside each
        stage: e.g. (2, 2) named ("data", "model") on 4 devices per actor). Without them, actors with N > 1
        devices are a 1-D mesh of N named "data"; one device each needs no mesh."""
        _check_data_plane(transport, overlap)
        if not isinstance(addresses, (str, bytes)) and isinstance(addresses, collections.abc.Iterable):
            addresses = list(addresses)
        if isinstance(addresses, (str, bytes)) or not addresses:
            raise ValueError(f"RemoteMesh needs a list of daemon addresses like ['tcp://node0:5555', 'tcp://node1:5555'], got "
                             f"{addresses!r:.80}")
        for i, a in enumerate(addresses):
            if not is_daemon_address(a):
                raise ValueError(f"address {i} ({a!r:.80}) is not a daemon address: write tcp://HOST:PORT (a port 1-65535) or "
                                 "ipc:///path (what mpmd-actor printed when it started)")
        twice = sorted(a for a, k in collections.Counter(addresses).items() if k > 1)
        if twice:
            raise ValueError(f"addresses {twice} are listed more than once: each daemon is one actor, listed once")
        _check_options(mesh_shape, transfer_timeout, heartbeat_interval, heartbeat_timeout)
        redeliver_dropped_interrupts()  # (Ctrl-C landing in JAX's gc callback was dropped: the loop went on)
        self.addresses = list(addresses)
        self.transport = transport
        self.overlap = overlap
        self.routes: dict[tuple[int, int], str] = {}
        # This controller's session on every actor: buffer and program ids are ours alone, so neither another
        # mesh of this process nor another controller attached to the same daemons can touch them.
        self.session = secrets.randbits(62) | 1
        self.processes = list(processes)  # the daemons this mesh started (and stops at close)
        self._keys = ClientKeys.of(keys) if keys is not None else None
        self._transfer_timeout = float(transfer_timeout)  # (crosses the wire: msgpack refused a numpy scalar; a probe)
        self._io = EventLoopThread()
        self._in_flight: collections.deque[concurrent.futures.Future[Any]] = collections.deque()  # dispatched steps, oldest first
        self._ctx = zmq.asyncio.Context()
        self._conns = [self._connection(i, a) for i, a in enumerate(addresses)]
        self._watchdog = Watchdog(self._conns, heartbeat_interval, heartbeat_timeout)
        self._held = Held(self.processes, self._io, self._ctx, self._conns, self._watchdog)  # (released once: close, or
        # the mesh's collection when it was dropped unclosed; the finalizer holds them, never the mesh)
        self._finalizer = weakref.finalize(self, release_dropped, self._held, f"RemoteMesh({len(addresses)} actor"
                                           f"{'s' * (len(addresses) != 1)} at {addresses[0] if addresses else '-'})")
        self._finalizer.atexit = False  # (at exit the daemons see their parent go and clean up after themselves)
        start_reaper()
        self._io.call_soon(self._watchdog.start)
        self.buffers = BufferClient(self._conns, self._io, lambda: self.closed, self._output_lease)
        self.executables = Executables(self._conns)
        self.closed = False
        self._opened = False
        self._saves: set[concurrent.futures.Future[Any]] = set()  # mpmd.save calls still writing (close waits for them)
        self.active_trace: Trace | None = None
        self.trace_claimed: Any = None  # a mesh.trace() block entering (waiting for the steps in flight), if any
        self.actor_mesh: ActorMesh | None = None
        self._offsets: dict[int, int] = {}
        self.generation = 0  # counts daemons replaced under this mesh by reconnect (see DistributedFunction._cached)
        self.reconnects = 0  # counts every reconnect (a step lost before one is not raised again by the next call)
        self._replaced: dict[int, tuple[int, str]] = {}  # actor -> (first buffer id its new daemon may hold, when: reconnect)
        self._recovering: dict[int, tuple[int, str]] = {}  # the same for actors a recovery under way replaced
        self.recovery: Any = None  # a mpmd.runtime.recovery.RecoveryManager when made with recover=Recovery(...)
        _LIVE_MESHES.add(self)
        self.actors = [ActorHandle(self, i) for i in range(len(addresses))]
        try:
            # (opened before the hellos are answered: when one daemon never answers, the others did open this session,
            # and close must say goodbye to them; it was left open until --session-timeout, holding its key's claim
            # and keeping shutdown_on_close from stopping them: a probe)
            self._opened = True
            try:
                self.infos = self.run(gather(self._all("hello")))
            except ProtocolError as e:  # e.g. a daemon of another protocol version: its reply names the version
                raise IncompatibleActorError(f"{e}: install the same mpmd on every node and the controller") from None
            self._check_actors()
            self.actor_mesh = self._device_mesh(mesh_shape, axis_names)
            for c, info in zip(self._conns, self.infos):
                c.learn_limits(info.header)
            if transport != "none" and len(self.actors) > 1:
                self._wire()
        except BaseException:
            self.close()
            raise

    def _check_actors(self) -> None:
        """Each daemon is the actor its position names (the data plane routes by actor id) and runs this JAX."""
        from mpmd.runtime.launch.rendezvous import ActorFacts, check_compatible

        for i, info in enumerate(self.infos):
            _check_hello(self.addresses[i], info.header)
            self._check_id(i, info.header)
        # (a daemon that answered speaks this protocol; a peer that does not say its JAX is a test's stand-in)
        check_compatible([ActorFacts(i, self.addresses[i], info.header["jax_version"], str(info.header.get("platform", "")))
                          for i, info in enumerate(self.infos) if info.header.get("jax_version") is not None])

    def _check_id(self, i: int, header: dict[str, Any]) -> None:
        """The data plane routes by actor id: the daemon at position `i` must be actor `i` (unless nothing routes:
        one actor, or no data plane). None: a peer that does not say (a test's stand-in)."""
        got = header.get("actor_id")
        if got is not None and got != i and self.transport != "none" and len(self.addresses) > 1:
            raise IncompatibleActorError(
                f"the daemon at {self.addresses[i]} (position {i} of the address list) was started as actor {got!r}: list "
                f"the daemons in actor-id order, each id once (mpmd-actor --actor-id {i} for this position)")

    def _device_mesh(self, shape: Sequence[int] | None, names: Sequence[str] | None) -> ActorMesh | None:
        """Check every actor has the devices the mesh needs and have each build it (None: one device each)."""
        counts = [len(info.header.get("devices") or [None]) for info in self.infos]  # (a daemon that does not say: one)
        if shape is None and names is not None:
            raise ValueError("axis_names needs mesh_shape too (one size per name)")
        if shape is None:
            if set(counts) == {1}:
                return None
            if len(set(counts)) != 1:
                raise MpmdError(f"actors have different numbers of devices {counts}; give every actor as many, or pass mesh_shape")
            shape, names = (counts[0],), ("data",)
        am = ActorMesh(tuple(int(d) for d in shape), tuple(names) if names is not None else
                       tuple(f"axis{i}" for i in range(len(shape))))
        for i, n in enumerate(counts):
            if n != am.size:
                raise MpmdError(f"actor {i} ({self.addresses[i]}) has {n} devices but mesh_shape {am.shape} needs {am.size}; start "
                                f"it with {am.size} devices (RemoteMesh.local(devices_per_actor={am.size}), mpmd-actor --cpu-devices "
                                f"{am.size} or --devices) or use a mesh of {n} devices")
        self.run(gather(self._all("mesh", {"mesh": am.to_wire()})))
        return am

    def own_daemons(self, processes: Sequence[Any]) -> None:
        """Own `processes` from now on (their daemons stop as this mesh closes; their handles say how a lost one
        died): a launcher that attaches to daemons it did not start adopts them only once the mesh is made and
        checked, so that a failed attempt leaves them running for the next (see launch/rendezvous.py)."""
        for proc in processes:
            self.conn(proc.actor_id).describe(proc)
        self.processes.extend(processes)

    def _connection(self, i: int, address: str) -> ActorConnection:
        proc = next((p for p in self.processes if p.actor_id == i), None)
        return ActorConnection(i, address, self._ctx, proc.dead_reason if proc else None, proc.stacks if proc else None,
                               self.session, self._keys, getattr(proc, "comeback", None))

    def _wire(self) -> None:
        """Choose every pair's route and tell each actor its peers (see `runtime.wiring`)."""
        self.routes = self.run(wire_data_plane(self._conns, [info.header["p2p"] for info in self.infos], self.transport,
                                               self._transfer_timeout))

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def local(cls, num_actors: int = 2, devices_per_actor: int = 1, *, transport: str = "auto", cache_dir: str | bool = True,
              address: str = "ipc", platform: str = "cpu", startup_timeout: float = 120.0, log_level: str = "WARNING",
              cpus_per_actor: int | None = None, gpu_ids: Sequence[int] | None = None, loaders: Sequence[str] = (),
              recover: Recovery | None = None, request_timeout: float | None = None, **kwargs: Any) -> RemoteMesh:
        """Spawn `num_actors` daemons on this machine, each with `devices_per_actor` CPU devices (or, with
        `platform="gpu"`, that many GPUs each: actor i gets GPUs i*d .. i*d+d-1).

        `address="ipc"` talks over Unix sockets, `"tcp"` over loopback. `transport` picks the data plane
        ("auto": NCCL between GPU actors, shared memory between CPU actors). `cpus_per_actor=k` pins actor i
        to its own k cores and sizes XLA's thread pool to them (fair pipeline measurements; big CPU hosts).
        `gpu_ids` deals out those GPUs instead (``(0,)``: every actor shares GPU 0).
        `cache_dir` is the actors' persistent compilation cache (default: ~/.cache/mpmd/xla; False: none).
        `startup_timeout`: seconds each daemon has to say it is ready; `log_level`: the daemons' logging level.
        `loaders`: "module:function" data loaders the actors may call for the batch leaves they read
        (`mpmd.loaded_by_actors`; see mpmd/runtime/loader.py). `request_timeout`: seconds the daemons give any
        one request, a step included (mpmd-actor --request-timeout; None: its default of an hour): a loader or
        a Run that never returns fails its step after that long.
        The daemons exit when the mesh is closed, when the `with` block ends, at interpreter exit, or when this
        process dies. `recover=mpmd.Recovery(snapshot_every=k)`: a daemon that dies is replaced by a new local
        process and the lost steps are replayed (see `mpmd.Recovery`). Other keywords (`mesh_shape`, `axis_names`,
        `heartbeat_timeout`, `transfer_timeout`, ...) go to `RemoteMesh(...)`, which says what each does.
        """
        _refuse_inside_a_loader_import("RemoteMesh.local")
        _check_data_plane(transport, kwargs.get("overlap", True))
        if transport == "nccl" and platform == "cpu":
            raise ValueError("transport='nccl' needs GPU actors: pass platform='gpu' (local actors run on CPU by default)")
        params = inspect.signature(cls.__init__).parameters.values()
        passed_on = sorted(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                           and p.name not in ("self", "addresses", "processes", "transport", "keys"))
        unknown = sorted(set(kwargs) - set(passed_on))
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):  # (a subclass's **kwargs: its own to judge)  # (before the daemons start: a misspelt mesh_shap= was a TypeError from __init__ after 8 s; a probe)
            raise TypeError(f"RemoteMesh.local() got an unexpected keyword argument {unknown[0]!r}; besides its own it takes "
                            f"RemoteMesh's {', '.join(passed_on)}")
        _check_mesh_arguments({**kwargs, "recover": recover}, devices_per_actor)
        options = LocalOptions(devices_per_actor, platform, transport != "none", cache_dir, address, log_level, cpus_per_actor,
                               startup_timeout, gpu_ids=tuple(gpu_ids) if gpu_ids is not None else None,
                               loaders=check_loader_names(loaders), request_timeout=request_timeout)
        with blocking("RemoteMesh.local"):  # (the daemons start without the loop's help: it is only waited on)
            local = start_local(num_actors, options)  # with ephemeral keys: authenticated with no user action
        try:
            mesh = cls(local.endpoints, local.processes, transport=transport, keys=local.keys, **kwargs)
        except BaseException:
            local.cleanup()
            raise
        try:
            check_devices([info.header for info in mesh.infos], options)
        except BaseException:
            mesh.close()
            raise
        mesh._tmpdir = local.directory
        if recover is not None:
            try:
                enable_recovery(mesh, recover, local.respawn)
            except BaseException:
                mesh.close()
                raise
        return mesh

    @classmethod
    def connect(cls, addresses: Sequence[str], *, keys: Any = None, shutdown_on_close: bool = False, **kwargs: Any) -> RemoteMesh:
        """Attach to daemons started elsewhere, e.g. on each node::

            mpmd keys generate ~/.mpmd/keys        # once, then copy the directory to every node
            mpmd-actor --listen tcp://0.0.0.0:5555 --actor-id $i \\
                --server-key ~/.mpmd/keys/mpmd.key_secret --authorized-keys ~/.mpmd/keys

            mesh = RemoteMesh.connect(["tcp://node0:5555", "tcp://node1:5555"], keys="~/.mpmd/keys")

        `keys`: a key directory (or ``*.key_secret`` file) whose pair is both this controller's and the daemons'
        key, or a `transport.auth.ClientKeys` (the controller's pair and the daemons' public keys, for separate
        pairs). A wrong or missing key fails here with `ActorAuthError`, naming the actor. The daemons go on
        serving after `close` (each session ends; the next job connects again); with `shutdown_on_close` they are
        asked to exit (they do when this key owns their job, or is their --admin-key), as `kill -TERM` does."""
        if not isinstance(addresses, (str, bytes)) and isinstance(addresses, collections.abc.Iterable):
            addresses = list(addresses)  # (a generator of addresses: "has no len()" — a probe)
        if "recover" in kwargs:
            raise ValueError("recover= needs a launcher that can start a replacement daemon: RemoteMesh.local, .ray or "
                             ".from_rendezvous (a daemon restarted at the same address can be taken back with mesh.reconnect(i))")
        if shutdown_on_close:
            from mpmd.runtime.launch.rendezvous import AttachedDaemon

            owned = [AttachedDaemon(i, a) for i, a in enumerate(addresses)] if not isinstance(addresses, (str, bytes)) else []
            return cls(addresses, owned, keys=keys, **kwargs)
        return cls(addresses, keys=keys, **kwargs)

    @classmethod
    def ray(cls, num_actors: int, devices_per_actor: int = 1, resources_per_actor: dict[str, float] | None = None,
            placement_strategy: str = "SPREAD", *, platform: str = "auto", cpus_per_actor: float = 1, host: str | None = None,
            placement_timeout: float = 60.0, startup_timeout: float = 120.0, log_level: str = "WARNING",
            cache_dir: str | bool = True, runtime_env: dict[str, Any] | None = None, loaders: Sequence[str] = (),
            **kwargs: Any) -> RemoteMesh:
        """Start `num_actors` daemons as Ray places them (the `ray` extra; ``ray.init()`` first, or it is called)::

            ray.init(address="auto")
            mesh = mpmd.RemoteMesh.ray(num_actors=4, devices_per_actor=8)   # GPUs through Ray's num_gpus

        A placement group reserves one bundle per actor (``{"CPU": cpus_per_actor, "GPU": devices_per_actor}``,
        GPU only when `platform` is "gpu" — "auto": when the cluster has GPUs — updated with
        `resources_per_actor`) with `placement_strategy`; each bundle gets a Ray actor that runs one `mpmd-actor`
        daemon bound to its node's address (`host` overrides it). Keys are ephemeral; only public keys cross the
        network. A Ray actor that dies surfaces as `ActorDiedError`; closing the mesh kills the Ray actors and
        removes the placement group. `recover=mpmd.Recovery(...)`: a lost daemon is replaced by a new Ray actor in
        its bundle and the lost steps replayed (see `mpmd.Recovery`). `loaders`: "module:function" data loaders
        the daemons may call (as for `local`; importable where Ray runs them: `runtime_env`). Other keyword
        arguments go to `RemoteMesh`. See mpmd/runtime/launch/ray.py."""
        from mpmd.runtime.launch import ray as ray_launcher

        _refuse_inside_a_loader_import("RemoteMesh.ray")
        _check_mesh_arguments(kwargs, devices_per_actor)

        with blocking("RemoteMesh.ray"):
            return ray_launcher.connect(cls, num_actors, devices_per_actor, resources_per_actor, placement_strategy, platform=platform,
                                        cpus_per_actor=cpus_per_actor, host=host, placement_timeout=placement_timeout,
                                        startup_timeout=startup_timeout, log_level=log_level, cache_dir=cache_dir,
                                        runtime_env=runtime_env,
                                        daemon_flags=[f for fn in check_loader_names(loaders) for f in ("--allow-loader", fn)],
                                        **kwargs)

    @classmethod
    def from_rendezvous(cls, where: str | Any, num_actors: int, *, timeout: float = 300.0, keys: Any = None,
                        platform: str | None = None, shutdown_on_close: bool = True, **kwargs: Any) -> RemoteMesh:
        """Attach to the daemons that announce themselves at a rendezvous — started by SLURM, Kubernetes or a
        shell loop, with no address list::

            srun mpmd-actor --slurm --rendezvous $RDV --authorized-keys ~/.mpmd/keys &
            mesh = mpmd.RemoteMesh.from_rendezvous(RDV, num_actors=4, keys="~/.mpmd/keys", timeout=300)

        `where`: a directory every node sees (mode 700), or ``tcp://HOST:PORT``, served here while waiting (the
        daemons get ``--rendezvous tcp://<this host>:PORT``). Waits up to `timeout` seconds for actors 0 ..
        num_actors-1 (`RendezvousError` names the missing ones), refuses daemons of another JAX version or
        `platform` (`IncompatibleActorError`), and connects with `keys` (the pair the daemons'
        --authorized-keys admits) and each daemon's public key from its arrival. With `shutdown_on_close`
        the daemons exit when the mesh closes (so the srun step or the Job ends). `recover=mpmd.Recovery(...)`
        (directory rendezvous): a lost actor is replaced by the next daemon that announces itself under its id —
        restarted by the cluster's supervisor — and the lost steps replayed. Other keyword arguments go to
        `RemoteMesh`. See mpmd/runtime/launch/rendezvous.py."""
        from mpmd.runtime.launch import rendezvous

        _check_mesh_arguments(kwargs, None)
        with blocking("RemoteMesh.from_rendezvous"):
            return rendezvous.connect(cls, where, num_actors, timeout=timeout, keys=keys, platform=platform,
                                      shutdown_on_close=shutdown_on_close, **kwargs)

    # ---- awaitable twins (see mpmd.runtime.aio): the daemons start and stop in a worker thread ------------------
    @classmethod
    async def local_async(cls, *args: Any, **kwargs: Any) -> RemoteMesh:
        """Awaitable twin of `local` (same arguments): the caller's event loop runs on while the daemons start.
        If the await is cancelled, the mesh is closed as soon as it is up."""
        return await off_loop(functools.partial(cls.local, *args, **kwargs), abandoned=cls.close, own_thread=True)

    @classmethod
    async def connect_async(cls, addresses: Sequence[str], **kwargs: Any) -> RemoteMesh:
        """Awaitable twin of `connect` (same arguments)."""
        return await off_loop(functools.partial(cls.connect, addresses, **kwargs), abandoned=cls.close, own_thread=True)

    @classmethod
    async def ray_async(cls, num_actors: int, **kwargs: Any) -> RemoteMesh:
        """Awaitable twin of `ray` (same arguments): placing and starting the Ray actors does not hold the caller's
        event loop."""
        return await off_loop(functools.partial(cls.ray, num_actors, **kwargs), abandoned=cls.close, own_thread=True)

    @classmethod
    async def from_rendezvous_async(cls, where: str | Any, num_actors: int, **kwargs: Any) -> RemoteMesh:
        """Awaitable twin of `from_rendezvous` (same arguments): waiting for the daemons to arrive does not hold
        the caller's event loop."""
        return await off_loop(functools.partial(cls.from_rendezvous, where, num_actors, **kwargs), abandoned=cls.close, own_thread=True)

    async def aclose(self) -> None:
        """Awaitable twin of `close`. A cancelled await still closes the mesh (in the background)."""
        await off_loop(self.close, own_thread=True)

    async def __aenter__(self) -> RemoteMesh:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> RemoteMesh:
        if self.closed:  # (as `with` over a closed file refuses; it entered, and the first call inside said so)
            raise MpmdError("this RemoteMesh is closed: make a new one to use in a `with` block")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.actors)

    def _local_cpu_affinities(self) -> list[set[int]] | None:
        """Each actor's CPU affinity when this mesh started them all here, on the CPU; None otherwise (they run
        elsewhere, on another platform, or their affinities cannot be read)."""
        procs = [p for p in self.processes if getattr(p, "platform", None) == "cpu" and getattr(p, "proc", None) is not None]
        if not procs or len(procs) != len(self):
            return None
        try:
            return [set(os.sched_getaffinity(p.proc.pid)) for p in procs]
        except (OSError, AttributeError):  # gone, not ours to ask, or no affinities here (macOS)
            return None

    def shared_cores(self) -> int | None:
        """How many CPU cores this mesh's actors share when it started them all here, on the CPU, and they are
        more than the cores they may run on (4 actors on a 2-core laptop); None when each has cores of its own or
        they run elsewhere. What `mpmd.Costs(cores=...)` models."""
        each = self._local_cpu_affinities()
        if each is None:
            return None
        cores = set().union(*each)
        return len(cores) if len(cores) < len(each) else None

    def one_core_each(self) -> bool:
        """Whether this mesh started its actors here, on the CPU, each pinned to a single core no other actor
        runs on (`cpus_per_actor=1`): then an actor's event loop shares its core with its Runs alone, which
        `profile_costs` and `fit_costs(..., own_core=True)` model."""
        each = self._local_cpu_affinities()
        return each is not None and all(len(c) == 1 for c in each) and len(set().union(*each)) == len(each)

    def _check_index(self, where: str, i: Any) -> None:
        """A TypeError or IndexError unless `i` is an actor index of this mesh (0 .. len(mesh) - 1)."""
        if not isinstance(i, numbers.Integral) or isinstance(i, bool):
            raise TypeError(f"mesh.{where} takes an actor index, an int from 0 to {len(self.actors) - 1}; got {i!r:.40}")
        if not 0 <= i < len(self.actors):
            raise IndexError(f"actor index {i} out of range: this mesh has {len(self.actors)} actors")

    def actor(self, i: int) -> ActorHandle:
        """The handle of actor `i` (0 .. len(mesh) - 1)."""
        self._check_index("actor", i)
        return self.actors[i]

    @property
    def keys(self) -> ClientKeys | None:
        """How this controller authenticates to its actors (a local mesh's ephemeral keys): another controller
        of this process may attach to the same daemons with `RemoteMesh.connect(mesh.addresses, keys=mesh.keys)`."""
        return self._keys

    @property
    def platform(self) -> str:
        return self.infos[0].header["platform"]

    @property
    def recoveries(self) -> int:
        """How many recoveries this mesh has made (0 without `recover=`): two actors lost together, or one more lost
        during a recovery, make one recovery (`mesh.recovery.failures` counts the lost actors)."""
        return self.recovery.count if self.recovery is not None else 0

    def replace_actor(self, i: int, address: str, process: Any = None, server_key: bytes | None = None) -> dict[str, Any]:
        """Drive a new daemon as actor `i` (started by this mesh's launcher, at `address`, with its own public key
        `server_key` if it made one): a fresh session there, its device mesh, the data plane rewired. Returns its
        info (see `reconnect`)."""
        if process is not None:
            self.processes[:] = [process if p.actor_id == i else p for p in self.processes]  # (in place: `_held` holds it)
            if self.closed:  # closed while the replacement started: `close` stopped the processes it saw, not this one
                process.stop()
                raise MpmdError(f"the RemoteMesh was closed while a replacement for actor {i} started; it was stopped")
        if server_key is not None and self._keys is not None:
            servers = [self._keys.server_key(a) for a in range(len(self.actors))]
            servers[i] = server_key
            self._keys = ClientKeys(self._keys.client, tuple(servers))
        return self.reconnect(i, address, bound=max(60.0, self._watchdog.timeout))  # (a new daemon on a busy host)

    def reconnect(self, i: int, address: str | None = None, bound: float | None = None) -> dict[str, Any]:
        """Talk again to actor `i` after it was declared dead, once it is back: a stopped process resumed
        (``kill -CONT``), or a daemon restarted at the same address. Its running steps are aborted. The same
        daemon keeps this mesh's buffers and programs; a restarted one has none (this mesh opens a new session
        there and rewires the data plane; arrays that lived there are gone; distributed steps compile and load
        their Programs again at their next call). Returns the actor's info."""
        self._check_index("reconnect", i)  # (-1 took the last actor's connection and blamed its --actor-id; a probe)
        i = int(i)
        old = self._conns[i]
        new = self._connection(i, address or old.address)

        bound = self._watchdog.timeout if bound is None else bound

        async def back() -> Any:
            try:  # (bounded: a daemon that is not back would leave the caller waiting forever)
                async with asyncio.timeout(bound):
                    try:
                        msg = await new.request("info")  # (in this session: a daemon answers nothing but ping outside one)
                    except RemoteError as e:
                        if e.remote_type != "NoSession":
                            raise
                        return await new.request("hello"), True  # a new daemon: open the session there afresh
                    await new.request("abort")  # every step of this session still running there
                    return msg, False
            except TimeoutError:
                raise ActorDiedError(i, (
                    f"at {new.address}: mesh.reconnect({i}) got no answer within {bound:g} s, so it is not back. A stopped "
                    "process answers once resumed (kill -CONT); a dead daemon must be restarted at that address first"
                    + ("" if getattr(self, "recovery", None) is not None else " (one this mesh started and lost never comes "
                       "back by itself: make a new mesh, or pass recover=mpmd.Recovery() to the mesh)")), during="reconnect") from None

        opened = False
        try:
            info, fresh = self.run(back())
            opened = fresh
            _check_hello(new.address, info.header)
            self._check_id(i, info.header)
            if fresh and self.actor_mesh is not None:  # (before the swap: a daemon that cannot hold the device mesh
                # left actor i half rewired, and the next step advised a mesh_shape; a probe)
                self.run(new.request("mesh", {"mesh": self.actor_mesh.to_wire()}))
        except BaseException:
            if opened:  # the session opened there goes: it let this mesh's old connection to that address, which
                # reaches the new daemon, use the daemon refused here as actor i (a probe)
                try:
                    self.run(asyncio.wait_for(new.request("bye"), 5))
                except Exception as e:  # (said: the session stays open there until its --session-timeout)
                    log.warning("mesh.reconnect(%d): could not close this mesh's session on the daemon refused at %s (%s); "
                                "it stays open there until the daemon's --session-timeout", i, new.address, e)
            self._io.call_soon(new.close)
            raise
        mark = self.new_buffer_id()  # (before the swap: an id from here on may name a buffer on the new daemon)
        if address is not None:  # (only once it answered: a failed reconnect left the unreachable one named; a probe)
            self.addresses[i] = address
        self._conns[i] = new
        self.reconnects += 1
        self._io.call_soon(old.close)
        new.learn_limits(info.header)
        if fresh:
            # (a recovery puts them back: then it is only news)
            log.log(logging.INFO if getattr(self, "recovery", None) is not None else logging.WARNING,
                    "actor %d at %s is a new daemon (pid %s): its buffers and programs from before are gone%s", i, new.address,
                    info.header.get("pid"), "; the recovery puts them back" if getattr(self, "recovery", None) is not None else "")
            if self._io.on_loop_thread():  # (on the loop, where compiles and releases change the same tables; a review)
                self.executables.forget(i)
            else:
                self._io.call_soon(self.executables.forget, i)
            self.generation += 1  # distributed steps load their Programs again at their next call
            if getattr(self, "recovery", None) is None:
                self._replaced[i] = (mark, time.strftime("%H:%M:%S"))
            else:  # (a recovery puts the arrays it can back, rebinding them to buffers from `mark` on; once it has, what
                # still names an older buffer there — put on that actor, never passed to a step — is gone: `recovered`)
                self._recovering[i] = (mark, time.strftime("%H:%M:%S"))
            self.infos[i] = info
            if self.transport != "none" and len(self.actors) > 1:
                self._wire()
        return dict(info.header)

    def close(self) -> None:
        """Shut the actors down (if this mesh started them) and stop the controller loop."""
        if self.closed:
            return
        if os.getpid() != self._io.pid:  # a forked child's: the mesh, its daemons and its directory are the parent's
            return  # (its exit closed them: the parent's private directory was removed under it; a probe)
        try:
            self._wait_for_saves()  # (a Ctrl-C here still stops, unlinks and removes everything below)
        except BaseException:
            self.closed = True
            self._release_resources()
            raise
        self.closed = True
        try:
            if self._opened:  # local daemons are ours to stop; attached ones only forget this session
                self._held.say_goodbye()
        finally:  # (a Ctrl-C during the goodbyes still stops, unlinks and removes everything below)
            self._release_resources()

    def track_save(self, future: concurrent.futures.Future[Any]) -> None:
        """A save writing this mesh's arrays: `close` lets it commit first (as orbax's CheckpointManager.close does)."""
        self._saves.add(future)
        future.add_done_callback(self._saves.discard)

    def _wait_for_saves(self) -> None:
        saves = [f for f in list(self._saves) if not f.done()]
        if not saves or self._io.on_loop_thread():  # (the loop itself cannot wait for what it runs)
            return
        log.info("closing the mesh: waiting for %d save(s) still writing to commit", len(saves))
        wait_settled(saves)

    @property
    def _tmpdir(self) -> str | None:
        """The private directory of the daemons this mesh started (None: none), removed at close."""
        return self._held.tmpdir

    @_tmpdir.setter
    def _tmpdir(self, directory: str | None) -> None:  # (a launcher's, or a benchmark's own daemons')
        self._held.tmpdir = directory

    def _release_resources(self) -> None:
        self._finalizer.detach()
        try:
            self._held.release()
        finally:
            close_stager(self)

    # ---- the controller loop -----------------------------------------------------------------------
    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the controller loop and wait for its result."""
        if self.closed:
            close_unstarted(coro)
            raise MpmdError("this RemoteMesh is closed")
        try:
            return self._io.run(coro, timeout)
        except (ActorDiedError, concurrent.futures.CancelledError) as e:
            self.raise_if_closed_meanwhile(e)
            raise

    async def arun(self, coro: Any) -> Any:
        """Await a coroutine run on the controller loop, from the caller's own event loop (`run`'s twin)."""
        if self.closed:
            close_unstarted(coro)
            raise MpmdError("this RemoteMesh is closed")
        try:
            return await self._io.arun(coro)  # (a cancellation not the caller's own comes out as "closed" already)
        except ActorDiedError as e:
            self.raise_if_closed_meanwhile(e)
            raise

    def raise_if_closed_meanwhile(self, e: BaseException) -> None:
        """An actor that stopped, or a request the loop dropped, because this mesh was closed meanwhile (from another
        thread or task, e.g. `aclose` while a first call compiles) is the close's doing, not a lost actor."""
        if self.closed:
            raise MpmdError(CLOSED_MEANWHILE) from e

    def submit_coroutine(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run `coro` on the controller loop without waiting; a concurrent future of its result."""
        if self.closed:
            close_unstarted(coro)
            raise MpmdError("this RemoteMesh is closed")
        return self._io.submit(coro)

    def dispatch(self, send: Callable[[], Any], finish: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Call `send()` on the controller loop as soon as it gets there — it submits requests, in the order
        dispatches are called, ahead of any fetch or delete issued after this call — then run `finish(sent)`
        (a coroutine) there. Returns a concurrent future of `finish`'s result, without waiting."""
        if self.closed:
            raise MpmdError("this RemoteMesh is closed")
        done = self._io.dispatch(send, finish)
        self._in_flight.append(done)
        return done

    def _steps_in_flight(self) -> int:
        q = self._in_flight
        while q and q[0].done():  # (steps end in about the order they were sent: the oldest first)
            q.popleft()
        return len(q)

    def wait_for_room(self) -> None:
        """Block until fewer than MAX_STEPS_IN_FLIGHT steps are dispatched and unfinished (each holds a request on
        every actor, and an actor serves at most 4,096 per connection): a loop that only dispatches, as under
        jax.jit's asynchronous dispatch, waits here for the actors instead of flooding them (it failed at step
        ~4,100, and every later step with it). Not on the controller's loop (it must keep running)."""
        if self._io.on_loop_thread():
            return
        while self._steps_in_flight() >= MAX_STEPS_IN_FLIGHT and not self.closed:
            concurrent.futures.wait([self._in_flight[0]], timeout=0.25)  # (timed: Ctrl-C gets through)

    def wait_steps_in_flight(self) -> None:
        """Block until every step dispatched so far has ended (a failed one keeps its error for its outputs)."""
        if not self._io.on_loop_thread():
            concurrent.futures.wait(list(self._in_flight))

    async def wait_for_room_async(self) -> None:
        """`wait_for_room` for a caller's own event loop (`call_async`)."""
        while self._steps_in_flight() >= MAX_STEPS_IN_FLIGHT and not self.closed:
            await asyncio.wait([asyncio.wrap_future(self._in_flight[0])], timeout=0.25)

    def conn(self, i: int) -> ActorConnection:
        """The connection to actor `i` (requests: see transport/protocol.py)."""
        return self._conns[i]

    def _all(self, op: str, fields: dict[str, Any] | None = None) -> list[Any]:
        return [c.request(op, fields) for c in self._conns]

    # ---- tracing and profiling (mpmd.observe) ------------------------------------------------------
    def trace(self) -> TraceContext:
        """Record what every actor does in the steps dispatched inside the block (see mpmd.observe.trace):

            with mesh.trace() as t:
                step(params, opt_state, batch)
            print(t.summary()); t.to_perfetto("trace.json")
        """
        return TraceContext(self)

    def profile(self, logdir: str, run: str | None = None) -> ProfileContext:
        """Capture a `jax.profiler` trace on every actor while the block runs, next to mpmd's own trace::

            with mesh.profile("/tmp/prof"):
                step(params, opt_state, batch)
            # tensorboard --logdir /tmp/prof   (one host per actor; or xprof, or Perfetto)

        The actors' files come back here: ``logdir/plugins/profile/<run>/actor<i>.xplane.pb``, and mpmd's
        instruction trace of the same steps as ``logdir/mpmd_trace_<run>.json``. See mpmd/observe/profile.py."""
        return ProfileContext(self, logdir, run)

    def clock_offsets(self) -> dict[int, int]:
        """Per actor: its monotonic clock minus the controller's (ns), from the ping with the smallest round
        trip (estimated once per mesh; refreshed by `mesh.trace()`)."""
        return dict(self._offsets)

    def measure_clock_offsets(self, pings: int = 8) -> dict[int, int]:
        """Estimate `clock_offsets()` afresh (a few pings per actor)."""
        self._offsets = self.run(measure_clock_offsets(self._conns, pings))
        return dict(self._offsets)

    # ---- buffers (the interface RemoteArray uses) ---------------------------------------------------
    def new_buffer_id(self) -> int:
        return self.buffers.new_id()

    def get_buffer(self, actor: int, buf: int, nbytes: int = 0) -> np.ndarray:
        """One buffer's value (a read-only view of the received bytes); `nbytes`: its size, if known (a large one
        from an actor on this host comes through shared memory)."""
        return self.buffers.get(actor, buf, nbytes)

    def get_buffer_async(self, actor: int, buf: int, nbytes: int = 0) -> concurrent.futures.Future[np.ndarray]:
        """Start fetching one buffer; a concurrent future of its value (`nbytes` as `get_buffer`'s)."""
        return self.buffers.get_async(actor, buf, nbytes)

    def get_buffers(self, bufs: dict[int, list[int]], nbytes: dict[int, list[int]] | None = None) -> dict[int, list[np.ndarray]]:
        """Several buffers per actor, one request per actor, all actors at once; `nbytes`: their sizes, as `get_buffer`'s."""
        return self.buffers.get_many(bufs, nbytes)

    async def get_buffers_async(self, bufs: dict[int, list[int]], nbytes: dict[int, list[int]] | None = None) -> dict[int, list[np.ndarray]]:
        """`get_buffers`, awaited from the caller's event loop."""
        return await self.buffers.get_many_async(bufs, nbytes)

    def wait_buffers(self, bufs: dict[int, list[int]]) -> None:
        """Until the listed buffers are computed on their actors."""
        self.buffers.wait(bufs)

    async def wait_buffers_async(self, bufs: dict[int, list[int]]) -> None:
        """`wait_buffers`, awaited from the caller's event loop."""
        await self.buffers.wait_async(bufs)

    def delete_buffers(self, buffers: dict[int, int]) -> None:
        """Free one buffer per actor now (waits for the actors)."""
        self.buffers.delete_now(buffers)

    def recovered(self) -> None:
        """The recovery has put back and rebound what it could: arrays still naming a buffer of a daemon it replaced
        are gone from now on (`check_not_replaced`). (Not before: a read during the recovery waits for it.)"""
        self._replaced.update(self._recovering)
        self._recovering.clear()

    def unload_programs(self, ids: Sequence[int], holders: Sequence[int] = ()) -> None:
        """Drop the Programs `ids` from every actor, behind every step dispatched before (any thread; nothing once
        the mesh is closed): a step signature let go (see DistributedFunction). With them go the executables only
        the `holders` (`Executables.new_holder`) used."""
        if self.closed or not ids and not holders:
            return

        def send() -> list[asyncio.Future[Any]]:
            exes: dict[int, list[str]] = {}
            for h in holders:  # (here, on the loop: in order with the compiles that may hold them again)
                for a, keys in self.executables.release(h).items():
                    exes.setdefault(a, []).extend(keys)
            return [asyncio.ensure_future(c.submit("unload_programs", {"programs": list(ids), "executables": exes.get(a, [])}))
                    for a, c in enumerate(self._conns) if not c.dead and (ids or exes.get(a))]

        async def finish(sent: list[asyncio.Future[Any]]) -> None:
            for f in sent:
                try:
                    await f
                except Exception:  # noqa: BLE001 - an actor lost or replaced meanwhile holds none of them any more
                    pass

        try:
            self._io.dispatch(send, finish)
        except Exception:  # noqa: BLE001 - (closed meanwhile)
            pass

    def release_buffers(self, buffers: dict[int, int]) -> None:
        """Free buffers whose RemoteArray is gone, batched, behind every step dispatched before (any thread)."""
        self.buffers.release(buffers)

    def check_owned(self, x: RemoteArray, what: str) -> None:
        """Refuse a RemoteArray of another (or a closed) mesh: its buffer ids mean nothing here."""
        if x.mesh is self:
            if x.is_deleted():
                why = self.recovery.why_gone(x) if getattr(self, "recovery", None) is not None else None
                raise MpmdError(f"{what}: {why or x.deleted_why()}")
            self.check_not_replaced(x, what)
            return
        if x.mesh.closed:
            raise MpmdError(f"{what} is {x!r} of a closed mesh ({x.mesh!r}): its data went with that mesh's actors. "
                            "Fetch values you want to keep (mpmd.fetch(tree)) or save them (mpmd.save) before closing a "
                            "mesh, and pass the host values here")
        raise MpmdError(f"{what} is {x!r} of {x.mesh!r}, not of {self!r}: its buffers live in another session and cannot "
                        "be read here. Copy it into this mesh with mesh.adopt(x), or pass mpmd.fetch(x), a host value")

    def check_not_replaced(self, x: RemoteArray, what: str) -> None:
        """Refuse an array whose every copy lived on actors whose daemons `reconnect` found restarted (their buffers went
        with the old daemons); copies on such actors are dropped when another copy lives on."""
        if not self._replaced:  # (every step argument and fetch comes here: nothing to look at until a reconnect)
            return
        held = dict(x.buffers)  # (one read: other threads fetch or pass the same array)
        lost = {a for a, b in held.items() if a in self._replaced and b < self._replaced[a][0]}
        if not lost:
            return
        if len(lost) < len(held):
            x.buffers = {a: b for a, b in held.items() if a not in lost}  # (replaced whole, as a recovery rebinds)
            return
        a = min(lost)
        if getattr(self, "recovery", None) is not None:  # (as the recovery leaves what it could not put back)
            raise MpmdError(f"{what}: {self.recovery.note_lost(x, sorted(lost))}")
        raise MpmdError(f"{what} ({x!r}) lived on actor {a}, whose daemon was restarted (mesh.reconnect({a}) found a new one "
                        f"at {self._replaced[a][1]}): its data went with the old daemon. Pass the values again from the host "
                        "(kept with mpmd.fetch, or mpmd.restore from a checkpoint); recover=mpmd.Recovery() on the mesh puts "
                        "lost arrays back by itself")

    def adopt(self, tree: Any) -> Any:
        """Copy the RemoteArrays of other meshes in a pytree into this one (to the same actor indices, or actor 0
        when this mesh has fewer actors), through the controller; this mesh's own arrays and host values are
        kept as they are. Returns the new tree.

            eval_params = eval_mesh.adopt(params)   # params trained on another mesh
        """
        leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, RemoteArray))
        foreign = [i for i, x in enumerate(leaves) if isinstance(x, RemoteArray) and x.mesh is not self]
        values = fetch([leaves[i] for i in foreign])
        out = list(leaves)
        for i, v in zip(foreign, values):
            actors = [a if a < len(self) else 0 for a in leaves[i].actors]
            out[i] = self.put_replicated(v, sorted(set(actors)))
            out[i].weak_type = leaves[i].weak_type  # (a weak lr came back strong: bf16 params became f32; a probe)
        return jax.tree.unflatten(treedef, out)

    def put_replicated(self, value: Any, actors: Sequence[int], spec: Any = None) -> RemoteArray:
        """Copy a host value (numpy, jax or typed key array) to each of `actors`, of the dtype jax.device_put gives it, laid out
        as `spec` over each actor's devices (None: replicated); one RemoteArray."""
        send, made = self._put(value, actors, spec)
        x = made()
        try:
            self.run(send)
        except BaseException:  # (refused on one actor, or interrupted: what reached the others goes too)
            self._let_go(x)
            raise
        return x

    def _let_go(self, x: RemoteArray) -> None:
        """Free a put's buffers behind its requests, without waiting (a stalled actor must not hold the caller)."""
        buffers, x.buffers = x.buffers, {}
        for a, b in buffers.items():
            self.release_buffers({a: b})

    async def put_replicated_async(self, value: Any, actors: Sequence[int], spec: Any = None) -> RemoteArray:
        """`put_replicated`, awaited from the caller's event loop (a big array is copied into shared memory in a worker
        thread: in the caller's, a 1 GiB put held its loop 0.7 s; a probe)."""
        x64 = jax.config.jax_enable_x64  # (per thread: the caller's, in the worker too)

        def staged() -> Any:
            with jax.enable_x64(x64):
                return self._put(value, actors, spec)

        send, made = await off_loop(staged)
        x = made()
        try:
            await self.arun(send)
        except BaseException:  # (cancelled after its requests went: the buffers they made were left for good; a probe)
            self._let_go(x)
            raise
        return x

    def _put(self, value: Any, actors: Sequence[int], spec: Any) -> tuple[Any, Callable[[], RemoteArray]]:
        """The put requests (a coroutine to run on the loop) and how to make the RemoteArray once they are done."""
        puts, made = self.put_requests(value, actors, spec)
        return gather(puts), made

    def put_requests(self, value: Any, actors: Sequence[int], spec: Any) -> tuple[list[Any], Callable[[], RemoteArray]]:
        """`_put`'s requests one per actor (coroutines: one not to be sent is closed), and how to make the RemoteArray."""
        if not isinstance(value, jax.Array) and not is_key(getattr(value, "dtype", None)):
            host = np.asarray(value)  # as jax.device_put does: 64-bit numbers become 32-bit unless x64 is on
            if host.dtype.kind in "OUS":  # (a dict, None, a string: the wire's dtype list said it; not bfloat16's "V")
                raise MpmdError(f"put takes one array (or a number), got {type(value).__name__} {value!r:.60}; put a tree's "
                                "leaves one by one: jax.tree.map(mesh.actor(i).put, tree)")
            if host.dtype != object:
                # (in this machine's byte order first: canonicalize_dtype keeps '>f8' as it is, and a big-endian float64
                # stayed 64-bit with x64 off; a probe)
                want = jax.dtypes.canonicalize_dtype(host.dtype.newbyteorder("="))
                if isinstance(value, int) and not isinstance(value, bool) and not np.can_cast(np.min_scalar_type(value), want):
                    raise OverflowError(f"Python int {value} too large to convert to {want.name} (as jax.device_put says; "
                                        "jax.config.update('jax_enable_x64', True) for 64-bit numbers)")
                if host.dtype != want:
                    value = host.astype(want)
        wire = to_wire(value)
        dtype = getattr(value, "dtype", wire.dtype) if is_key(getattr(value, "dtype", None)) else wire.dtype
        shape = wire.shape[: wire.ndim - (len(key_impl(dtype).key_shape) if is_key(dtype) else 0)]
        fields: dict[str, Any] = {}
        if spec is not None and not isinstance(spec, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding, tuple)):
            raise MpmdError(f"put: spec must be a PartitionSpec (or a NamedSharding; None: replicated), got "
                            f"{type(spec).__name__} {spec!r:.40}")  # (a str was told to use actors of several devices)
        if spec is not None:
            if self.actor_mesh is None:
                raise MpmdError("a PartitionSpec needs actors with several devices: make the mesh with devices_per_actor=N "
                                "(and mesh_shape=..., axis_names=...)")
            self.actor_mesh.check_spec(spec, shape, "put")
            # (a NamedSharding over the actors' own mesh shape: its spec; in the one form a step's outputs have, size-1
            # axes dropped: put(x, spec=P('data', 'model')) on a (1, 2) mesh read P('data', 'model'); a probe)
            spec = self.actor_mesh.canonical(as_spec(spec))
            fields["layout"] = layout_wire(spec)
        bufs = {a: self.new_buffer_id() for a in actors}
        puts: list[Any] = []
        try:
            for a, b in bufs.items():
                puts.append(self._put_one(a, b, fields, wire))
        except BaseException:  # (e.g. the host has not the memory for the next actor's: the ones made are not sent)
            for p in puts:
                p.close()
            raise
        layout = spec if spec is not None else (() if self.actor_mesh is not None else None)
        return puts, lambda: RemoteArray(self, bufs, shape, dtype, remote_sharding(layout, self.actor_mesh))

    def _output_lease(self, actor: int, sizes: list[int], announce: bool = True) -> Any:
        """The shared-memory segments for a get's large values from `actor` (None: it is on another host; see inputs.py)."""
        from mpmd.runtime.inputs import input_stager

        return input_stager(self).output_lease(actor, sizes, announce)

    def _put_one(self, actor: int, buf: int, fields: dict[str, Any], wire: np.ndarray) -> Any:
        """The 'put' request of `wire` to `actor` (a coroutine): through one of its input segments when it shares
        this host and the array is big (written here, in the caller's thread: a copy in memory, where over the
        control socket a 1 GiB put took 7-13 s encrypted and held the connection), else inline."""
        from mpmd.runtime.inputs import input_stager

        stager = input_stager(self)
        shared = not self._io.on_loop_thread() and stager.wants(actor, wire.nbytes)  # (announcing a prefix waits on the loop)
        staged = stager.stage_once(actor, wire) if shared else None
        if staged is None:
            return self._conns[actor].request("put", {"buf": buf, **fields}, [wire])
        notice, done = staged

        async def put() -> Any:
            answered = False
            try:
                reply = await self._conns[actor].request("put", {"buf": buf, **fields, "shm": notice})
                answered = True  # (only a reply that it was put: an error reply may come while the copy still reads)
                return reply
            finally:
                done(answered)  # (a reused segment goes back to its pool once answered, else it is dropped)

        coro = put()
        weakref.finalize(coro, done)  # (a coroutine dropped unstarted — its await cancelled first — runs no finally)
        return coro

    # A mesh is its daemons and the controller loop that talks to them: a copy is the mesh itself (a shallow copy
    # shared the loop, and its close() shut the original's down: "Event loop is closed"; a probe), and it cannot be
    # pickled (its sockets, keys and loop stay in this process).
    def __copy__(self) -> RemoteMesh:
        return self

    def __deepcopy__(self, memo: Any) -> RemoteMesh:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(f"{self!r} is a connection to running daemons and cannot be pickled: in another process, connect "
                        "to the same daemons (RemoteMesh.connect) or start a mesh of its own")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"session {self.session:x}"
        return f"RemoteMesh({len(self.addresses)} actor{'s' * (len(self.addresses) != 1)} at {self.addresses[0]}{', ...' if len(self.addresses) > 1 else ''}; {state})"



_NUMBER, _INT, _STR, _BOOL = ((int, float), "a number"), ((int,), "an int"), ((str,), "a str"), ((bool,), "a bool")
_HELLO_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {  # what a daemon's hello reply may hold (absent: None)
    "actor_id": _INT, "devices": ((list,), "a list"), "jax_version": _STR, "platform": _STR, "p2p": ((dict,), "a map"),
    "pid": _INT, "sessions": _INT, "request_timeout": _NUMBER, "compile_timeout": _NUMBER, "session_timeout": _NUMBER,
    "max_message_bytes": _INT,
    # its data plane's endpoint, which the wiring reads (p2p={"tcp": 5} failed deep in it)
    "p2p.tcp": _STR, "p2p.ipc": _STR, "p2p.host": _STR, "p2p.key": _STR, "p2p.shm_prefix": _STR, "p2p.link": _STR,
    "p2p.shm": _BOOL, "p2p.nccl": _BOOL, "p2p.pid": _INT, "p2p.gpu": _STR, "p2p.gpu_shared": _BOOL}


def _check_hello(address: str, header: dict[str, Any]) -> None:
    """An IncompatibleActorError unless every field a hello reply holds has its type (a stand-in that said
    devices=-3 ended in a TypeError deep in the mesh's making, a reply without p2p in a KeyError; a probe)."""
    header.setdefault("p2p", None)
    for field, (types, what) in _HELLO_FIELDS.items():
        outer, _, inner = field.partition(".")
        value = header.get(outer)
        if inner:
            value = value.get(inner) if isinstance(value, dict) else None  # (p2p checked first: a map or None)
        if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise IncompatibleActorError(f"the daemon at {address} answered hello with {field}={value!r:.60}, not {what}: is it an "
                                         "mpmd-actor of this version? install the same mpmd on every node and the controller")
    most = header.get("max_message_bytes")  # (a limit of 0 failed the other actors' wiring, blamed on them)
    if most is not None and most <= 0:
        raise IncompatibleActorError(f"the daemon at {address} answered hello with max_message_bytes={most!r:.60}, not a positive "
                                     "int: is it an mpmd-actor of this version?")


@atexit.register  # (after the program's other threads have ended, and after the exit hooks it registered later)
def _close_all() -> None:
    """Close every live mesh at exit (its saves still writing commit first, as at `close`)."""
    for mesh in list(_LIVE_MESHES):
        try:
            mesh.close()
        except Exception:
            pass
