"""RemoteMesh: the actors a controller drives, started locally or attached to, and per-actor handles.

    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        x = mesh.actor(0).put(np.ones(4, np.float32))
        y = mesh.actor(0).run(jax.jit(lambda a: a * 2), x)
        print(y.to_numpy())
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import zmq.asyncio

from mpmd.array import RemoteArray
from mpmd.controller import ActorConnection, EventLoopThread, Watchdog
from mpmd.errors import ActorStartError, MpmdError
from mpmd.lowering import aval_of, host_array, serialize_flat
from mpmd.wiring import TRANSPORTS, choose_routes, peer_specs
from transport.protocol import dtype_from_name

log = logging.getLogger(__name__)
_LIVE_MESHES: weakref.WeakSet[RemoteMesh] = weakref.WeakSet()


class LocalProcess:
    """An `mpmd-actor` subprocess on this machine, with its stderr kept in a file for error messages."""

    def __init__(self, actor_id: int, devices: int, p2p: bool, cache_dir: str | None, address: str, log_level: str,
                 ipc_dir: str | None = None, platform: str = "cpu"):
        self.actor_id = actor_id
        self.stderr = tempfile.NamedTemporaryFile(prefix=f"mpmd-actor{actor_id}-", suffix=".log", delete=False)
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, "-m", "actors.daemon", "--listen", address, "--actor-id", str(actor_id),
               "--p2p", "tcp" if p2p else "none", "--parent-pid", str(os.getpid()), "--log-level", log_level]
        if platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            cmd += ["--cpu-devices", str(devices)]
        else:  # actor i owns GPUs [i * devices, (i + 1) * devices)
            env.pop("JAX_PLATFORMS", None)
            cmd += ["--devices", ",".join(str(actor_id * devices + k) for k in range(devices))]
        if ipc_dir:
            cmd += ["--ipc-dir", ipc_dir]
        if cache_dir:
            cmd += ["--cache-dir", cache_dir]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            with open(self.stderr.name, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait_ready(self, deadline: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                break
            if sel.select(timeout=min(left, 0.2)):
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                line += chunk
        sel.close()
        text = line.decode(errors="replace").strip()
        if not text.startswith("MPMD_ACTOR_READY"):
            why = f"exited with code {self.proc.returncode}" if self.proc.poll() is not None else "did not report ready in time"
            raise ActorStartError(f"local actor {self.actor_id} {why}. Its stderr:\n{self.stderr_tail()}")
        return text.split()[1]

    def dead_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        return f"its process exited with code {code}; stderr tail:\n{self.stderr_tail(800)}"

    def stacks(self) -> str:
        """Ask the daemon to dump every thread's stack (SIGUSR1, see actors/daemon.py) and return it."""
        try:
            start = os.path.getsize(self.stderr.name)
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(0.3)
            with open(self.stderr.name, errors="replace") as f:
                before = f.read(start)[-1500:]
                return f.read()[-6000:] + (f"\nits log before that:\n{before}" if before.strip() else "")
        except OSError as e:
            return f"(could not dump its stacks: {e})"

    def stop(self, timeout: float = 3.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self.stderr.close()
        try:
            os.unlink(self.stderr.name)
        except OSError:
            pass


class RemoteMesh:
    """A set of actors (each an `mpmd-actor` daemon with its own devices) driven by this controller."""

    def __init__(self, addresses: Sequence[str], processes: Sequence[LocalProcess] = (), *,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 10.0, transport: str = "auto",
                 transfer_timeout: float = 300.0, overlap: bool = True) -> None:
        """Drive the actors at `addresses`. `transport` picks the data plane (see `mpmd.wiring`: "auto", "tcp",
        "shm", "nccl", "none"); a receive that waits `transfer_timeout` seconds fails the step; `overlap=False`
        makes actors wait for each send where it stands (to measure what overlap buys)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; choose one of {TRANSPORTS}")
        if transfer_timeout <= 0:
            raise ValueError(f"transfer_timeout must be positive, got {transfer_timeout}")
        self.addresses = list(addresses)
        self.transport = transport
        self.overlap = overlap
        self.routes: dict[tuple[int, int], str] = {}
        self._processes = list(processes)
        self._io = EventLoopThread()
        self._ctx = zmq.asyncio.Context()
        procs = {p.actor_id: p for p in self._processes}
        self._conns = [ActorConnection(i, a, self._ctx, procs[i].dead_reason if i in procs else None,
                                       procs[i].stacks if i in procs else None) for i, a in enumerate(addresses)]
        self._watchdog = Watchdog(self._conns, heartbeat_interval, heartbeat_timeout)
        self._io.call_soon(self._watchdog.start)
        self._ids = itertools.count(1)
        self._garbage: list[tuple[int, int]] = []
        self._garbage_lock = threading.Lock()
        self._lowered: dict[Any, tuple[bytes, Any]] = {}
        self._compiled: list[dict[bytes, str]] = [{} for _ in addresses]
        self.closed = False
        self._tmpdir: str | None = None
        _LIVE_MESHES.add(self)
        self.actors = [ActorHandle(self, i) for i in range(len(addresses))]
        try:
            self.infos = self.run(self._gather(self._all("info")))
            if transport != "none" and len(self.actors) > 1:
                self._wire(transfer_timeout)
        except BaseException:
            self.close()
            raise

    def _wire(self, transfer_timeout: float) -> None:
        endpoints = [info.header["p2p"] for info in self.infos]
        self.routes = choose_routes(self.transport, endpoints)
        ids: dict[tuple[int, int], list[int]] = {}
        senders = sorted({i for (i, _), r in self.routes.items() if r == "nccl"})
        if senders:
            outs = {i: sorted(j for (a, j), r in self.routes.items() if a == i and r == "nccl") for i in senders}
            replies = self.run(self._gather([self._conns[i].request("nccl_ids", {"count": len(outs[i])}) for i in senders]))
            for i, msg in zip(senders, replies):
                ids.update({(i, j): uid for j, uid in zip(outs[i], msg.header["ids"])})
        specs = peer_specs(self.routes, endpoints, ids)
        self.run(self._gather([c.request("connect_peers", {"peers": specs[i], "timeout": transfer_timeout})
                               for i, c in enumerate(self._conns)]))

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def local(cls, num_actors: int = 2, devices_per_actor: int = 1, *, transport: str = "auto", cache_dir: str | None = None,
              address: str = "ipc", platform: str = "cpu", startup_timeout: float = 120.0, log_level: str = "WARNING",
              **kwargs: Any) -> RemoteMesh:
        """Spawn `num_actors` daemons on this machine, each with `devices_per_actor` CPU devices (or, with
        `platform="gpu"`, that many GPUs each: actor i gets GPUs i*d .. i*d+d-1).

        `address="ipc"` talks over Unix sockets, `"tcp"` over loopback. `transport` picks the data plane
        ("auto": NCCL between GPU actors, shared memory between CPU actors). The daemons exit when the mesh is
        closed, when the `with` block ends, at interpreter exit, or when this process dies.
        """
        if num_actors < 1 or devices_per_actor < 1:
            raise ValueError(f"num_actors and devices_per_actor must be >= 1, got {num_actors} and {devices_per_actor}")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; choose one of {TRANSPORTS}")
        if transport == "nccl" and platform == "cpu":
            raise ValueError("transport='nccl' needs GPU actors: pass platform='gpu' (local actors run on CPU by default)")
        if platform not in ("cpu", "gpu"):
            raise ValueError(f"platform must be 'cpu' or 'gpu', got {platform!r}")
        tmp = tempfile.mkdtemp(prefix="mpmd-")
        addrs = [f"ipc://{tmp}/actor{i}.sock" if address == "ipc" else "tcp://127.0.0.1:0" for i in range(num_actors)]
        procs = [LocalProcess(i, devices_per_actor, transport != "none", cache_dir, a, log_level, tmp, platform)
                 for i, a in enumerate(addrs)]
        try:
            deadline = time.monotonic() + startup_timeout
            endpoints = [p.wait_ready(deadline) for p in procs]
            mesh = cls(endpoints, procs, transport=transport, **kwargs)
            mesh._tmpdir = tmp
            return mesh
        except BaseException:
            for p in procs:
                p.stop()
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def connect(cls, addresses: Sequence[str], **kwargs: Any) -> RemoteMesh:
        """Attach to daemons started elsewhere (`mpmd-actor --listen tcp://0.0.0.0:5555 --actor-id i` on each node)."""
        return cls(addresses, **kwargs)

    def __enter__(self) -> RemoteMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.actors)

    def actor(self, i: int) -> ActorHandle:
        if not 0 <= i < len(self.actors):
            raise IndexError(f"actor index {i} out of range: this mesh has {len(self.actors)} actors")
        return self.actors[i]

    @property
    def platform(self) -> str:
        return self.infos[0].header["platform"]

    def close(self) -> None:
        """Shut the actors down (if this mesh started them) and stop the controller loop."""
        if self.closed:
            return
        self.closed = True
        if self._processes:
            try:
                self._io.run(self._gather(self._all("shutdown")), timeout=5)
            except Exception:
                pass
        for p in self._processes:
            p.stop()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._io.call_soon(self._watchdog.stop)
        for c in self._conns:
            self._io.call_soon(c.close)
        time.sleep(0.01)
        self._io.stop()
        self._ctx.destroy(linger=0)

    # ---- async plumbing --------------------------------------------------------------------------
    def run(self, coro: Any, timeout: float | None = None) -> Any:
        if self.closed:
            coro.close()
            raise MpmdError("this RemoteMesh is closed")
        return self._io.run(coro, timeout)

    def conn(self, i: int) -> ActorConnection:
        return self._conns[i]

    def _all(self, op: str, fields: dict[str, Any] | None = None) -> list[Any]:
        return [c.request(op, fields) for c in self._conns]

    @staticmethod
    async def _gather(coros: list[Any]) -> list[Any]:
        import asyncio

        return list(await asyncio.gather(*coros))

    def new_buffer_id(self) -> int:
        return next(self._ids)

    def _get(self, actor: int, buf: int) -> np.ndarray:
        msg = self.run(self._conns[actor].request("get", {"buf": buf}))
        return msg.arrays[0]  # a read-only view that keeps the received frame alive: no copy

    def _delete_now(self, buffers: dict[int, int]) -> None:
        self.run(self._gather([self._conns[a].request("delete", {"bufs": [b]}) for a, b in buffers.items()]))

    def _release(self, buffers: dict[int, int]) -> None:
        if self.closed:
            return
        with self._garbage_lock:
            first = not self._garbage
            self._garbage.extend(buffers.items())
        if first:
            self._io.call_soon(self._flush_garbage)

    def _flush_garbage(self) -> None:
        import asyncio

        with self._garbage_lock:
            garbage, self._garbage = self._garbage, []
        by_actor: dict[int, list[int]] = defaultdict(list)
        for a, b in garbage:
            by_actor[a].append(b)
        for a, bufs in by_actor.items():
            if not self._conns[a].dead:
                asyncio.get_running_loop().create_task(self._quiet(self._conns[a].request("delete", {"bufs": bufs})))

    @staticmethod
    async def _quiet(coro: Any) -> None:
        try:
            await coro
        except Exception:
            pass

    # ---- executables -----------------------------------------------------------------------------
    async def ensure_compiled(self, actor: int, blob: bytes) -> str:
        """Ship `blob` to `actor` unless it has it; returns the actor's executable key."""
        known = self._compiled[actor].get(blob)
        if known is None:
            msg = await self._conns[actor].request("compile", arrays=[np.frombuffer(blob, np.uint8)])
            known = self._compiled[actor][blob] = msg.header["exe"]
        return known

    def lower(self, fn: Callable[..., Any], args: Sequence[Any], platform: str) -> tuple[bytes, Any]:
        """Export `fn` for these argument shapes once; returns (blob, output treedef)."""
        leaves, treedef = jax.tree.flatten(args)
        avals = tuple(aval_of(x) for x in leaves)
        key = (fn, treedef, avals, platform)
        hit = self._lowered.get(key)
        if hit is None:
            out_tree_box: list[Any] = []

            def flat(*xs: Any) -> tuple[Any, ...]:
                out = fn(*jax.tree.unflatten(treedef, xs))
                out_leaves, out_tree = jax.tree.flatten(out)
                out_tree_box.append(out_tree)
                return tuple(out_leaves)

            blob = serialize_flat(flat, avals, platform)
            hit = self._lowered[key] = (blob, out_tree_box[0])
        return hit


class ActorHandle:
    """One actor of a mesh: place arrays on it, run jitted functions there, ask its state."""

    def __init__(self, mesh: RemoteMesh, index: int) -> None:
        self.mesh = mesh
        self.index = index

    def __repr__(self) -> str:
        return f"ActorHandle({self.index}, {self.mesh.addresses[self.index]})"

    def put(self, x: Any) -> RemoteArray:
        """Copy a host array (numpy or jax) to this actor."""
        arr = np.asarray(x)
        buf = self.mesh.new_buffer_id()
        self.mesh.run(self.mesh.conn(self.index).request("put", {"buf": buf}, [arr]))
        return RemoteArray(self.mesh, {self.index: buf}, arr.shape, arr.dtype)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` (e.g. a `jax.jit` function) on this actor. Arguments are RemoteArrays on this actor or
        host arrays (copied here first); returns the output pytree as RemoteArrays. `fn` is lowered once per
        argument signature and compiled once per actor."""
        return self.mesh.run(self.run_async(fn, *args))

    async def run_async(self, fn: Callable[..., Any], *args: Any) -> Any:
        mesh, conn = self.mesh, self.mesh.conn(self.index)
        leaves, treedef = jax.tree.flatten(args, is_leaf=lambda x: isinstance(x, RemoteArray))
        leaves = [x if isinstance(x, RemoteArray) else host_array(x) for x in leaves]
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, RemoteArray) else aval_of(x) for x in leaves]
        blob, out_tree = mesh.lower(fn, jax.tree.unflatten(treedef, specs), mesh.infos[self.index].header["platform"])
        exe = await mesh.ensure_compiled(self.index, blob)
        in_bufs = []
        for x in leaves:
            if isinstance(x, RemoteArray):
                if self.index not in x.buffers:
                    raise ValueError(f"argument {x!r} lives on actors {x.actors}, not on actor {self.index}; "
                                     "copy it with mesh.actor(i).put(x.to_numpy()) first")
                in_bufs.append(x.buffers[self.index])
            else:
                buf = mesh.new_buffer_id()
                await conn.request("put", {"buf": buf}, [np.asarray(x)])
                in_bufs.append(buf)
        out_bufs = [mesh.new_buffer_id() for _ in range(out_tree.num_leaves)]
        try:
            msg = await conn.request("run", {"exe": exe, "inputs": in_bufs, "outputs": out_bufs})
        finally:
            temps = [b for x, b in zip(leaves, in_bufs) if not isinstance(x, RemoteArray)]
            if temps:
                await conn.request("delete", {"bufs": temps})
        outs = [RemoteArray(mesh, {self.index: b}, m["shape"], dtype_from_name(m["dtype"])) for b, m in zip(out_bufs, msg.header["outputs"])]
        return jax.tree.unflatten(out_tree, outs)

    def ping(self) -> float:
        """Round-trip time of a ping, in seconds."""
        t = time.perf_counter()
        self.mesh.run(self.mesh.conn(self.index).request("ping"))
        return time.perf_counter() - t

    def info(self) -> dict[str, Any]:
        return dict(self.mesh.run(self.mesh.conn(self.index).request("info")).header)

    def stats(self) -> dict[str, Any]:
        """Buffers held (count and bytes), executables cached, compiles and cache hits, requests served."""
        h = dict(self.mesh.run(self.mesh.conn(self.index).request("stats")).header)
        for k in ("op", "id", "ok", "v"):
            h.pop(k, None)
        return h


@atexit.register
def _close_all() -> None:
    for mesh in list(_LIVE_MESHES):
        try:
            mesh.close()
        except Exception:
            pass
