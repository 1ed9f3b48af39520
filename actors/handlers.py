"""The request API of one actor: `Actor.handle` serves one decoded request by calling the handler of its op,
one method per op (`save` and `restore` are in actors/checkpoint.py, `profile` in actors/profiler.py). A
handler checks the request's fields, works on the caller's `Session` (its buffers, programs and running
steps) and returns the reply's header and array frames; a wrong field raises `RequestError`, which the
daemon (actors/daemon.py) turns into an error reply. The wire form of every op is in transport/protocol.py.

`run_program` checks a step's arguments, reserves its buffers and hands the step to the Program interpreter
(actors/interpreter.py), which shares this actor's executable cache, stream and data-plane transfers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from actors import checkpoint, collector, profiler, spmd, stream
from actors.buffers import BufferTable
from actors.cache import ExecutableCache
from actors.inputs import OUTPUT_MIN_BYTES, InputSegments
from actors.interpreter import Interpreter
from actors.loader import Loaders, queue, unfinished
from actors.request import HeldByLoader, NoSession, RequestError, StepAborted, field, int_list
from actors.sandbox import BlobChecker
from actors.stream import StepTrace, Stream, now
from actors.transfers import Transfers
from transport.p2p import P2PTransport
from transport.p2p.base import computed
from transport.program import ProgramError, Recv, Run, Send, decode_instruction, decode_program
from transport.protocol import MAX_IDS, Message, aval_header

log = logging.getLogger(__name__)


def marked(inputs: list[int], marker: int, entries: Iterable[Any]) -> Iterator[tuple[int, Any]]:
    """(input slot, its entry) for every input marked `marker` (-2 shared memory, -3 loaded on the actor), paired
    in order with the request's entries for them (their number is checked before)."""
    return zip((i for i, b in enumerate(inputs) if b == marker), entries)


def is_ready(x: Any) -> bool:
    """A jax array computed already, or a host (numpy) array."""
    ready = getattr(x, "is_ready", None)
    return ready() if ready is not None else True


BIG_PROGRAM = 4096  # instructions (or constants) past which a Program is counted, decoded and placed in a thread beside the event loop
BIG_PROGRAM_WORDS = 1 << 16  # or ids named by its instructions (two instructions of 8 million ids stalled the loop 1.4 s)


def _program_words(instrs: Any) -> int:
    """Instructions and the ids they name: what a guest's loaded Programs are bounded by."""
    if not isinstance(instrs, list):
        return 0
    return sum(1 + sum(len(x) for x in i if isinstance(x, list)) for i in instrs if isinstance(i, list))


async def _beside_loop(big: bool, fn: Any, *args: Any) -> Any:
    """`fn(*args)`, in a thread when `big` (the loop answers other requests meanwhile), else here."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


async def _taken_now(ses: Session, bufs: list[int]) -> list[Any]:
    """The values of `bufs`, each taken as the request arrives (a pending one as its future), then awaited: taken one
    await at a time, a delete arriving meanwhile (the inputs a step donates, sent right behind it) pulled the later
    ones away, and a snapshot's get of a donating loop's state failed every time (a probe)."""
    refs = [ses.buffers.ref(b) for b in bufs]
    return [await asyncio.shield(r) if isinstance(r, asyncio.Future) else r for r in refs]


class Session:
    """What one controller owns on this actor: its buffers, its programs and its running steps. Ids of
    buffers and programs are the controller's own; two controllers' sessions never see each other's."""

    def __init__(self, session_id: int, actor_id: int, owner: str | None = None) -> None:
        self.id = session_id
        self.owner = owner  # the authenticated client (its key's name) that opened it; only it may use it
        self.buffers = BufferTable(f"actor {actor_id} (session {session_id:x})")
        self.programs: dict[int, dict[str, Any]] = {}
        self.running: dict[tuple[int, int], asyncio.Task[Any]] = {}
        self.executables: set[str] = set()  # the executables this session compiled: the only ones it may run
        self.last_step_peak_bytes = 0  # most bytes a step's own buffer table held at once (last finished step)
        self.inputs = InputSegments(actor_id)  # step arguments its controller hands over in shared memory
        self.last_seen = time.monotonic()  # when its controller last sent a request naming it (pings too)
        self.program_words: dict[int, int] = {}  # each loaded Program's instructions and buffer ids (a guest's are bounded)
        self.program_bytes: dict[int, int] = {}  # each loaded Program's constants (counted with the buffers)
        self.program_made: dict[int, int] = {}  # each loaded Program's Runs' output bytes (a guest's step needs room for them)
        self.program_exes: dict[int, set[str]] = {}  # the executables each loaded Program runs
        self.loading: dict[int, list[asyncio.Future[None]]] = {}  # Programs being decoded beside the loop, by id

    def close(self) -> None:
        for task in self.running.values():
            task.cancel()
        self.buffers.clear()
        self.programs.clear()
        self.program_words.clear()
        self.program_bytes.clear()
        self.program_made.clear()
        self.program_exes.clear()
        self.inputs.close()


SESSIONLESS = frozenset({"ping", "hello"})
# Ops that change what every session on this daemon shares (its data-plane wiring, its process, its profiler,
# its device mesh): only the key that owns the daemon's job, or an operator (--admin-key), may send them.
GOVERNING = frozenset({"connect_peers", "nccl_ids", "shutdown", "profile", "save", "restore"})
MAX_SESSIONS = 64  # sessions of keys other than the owner's and the operators' (they cannot be locked out)
MAX_SESSIONS_PER_KEY = 16
GUEST_PROGRAM_WORDS_PER_MB = 16_384  # instructions and buffer ids guests' loaded Programs may hold per MiB of their quota


class Ownership:
    """Who may change a daemon's shared resources. The owner is the key of the daemon's job: fixed at start
    (a local mesh's key), or else the key that opens the first session, until its last session closes.
    Operators (`--admin-key`) always may. Without authentication every client is the same identity."""

    def __init__(self, authenticated: bool, owners: frozenset[str] = frozenset(), admins: frozenset[str] = frozenset()) -> None:
        self.authenticated = authenticated
        self.fixed = owners
        self.admins = admins
        self.owner: str | None = None  # the first session's key, while it has a session here

    def governs(self, peer: str | None) -> bool:
        if not self.authenticated:
            return True
        return peer is not None and (peer in self.admins or peer in self.fixed or (not self.fixed and peer == self.owner))

    def describe(self) -> str:
        owner = ", ".join(sorted(self.fixed)) if self.fixed else (self.owner or "nobody yet")
        return f"owned by key {owner!r}" + (f"; operators {sorted(self.admins)}" if self.admins else "")


class Actor:
    """One actor's request API over its devices, executable cache and data plane (`p2p`; None: none).
    `checker` and `compile_timeout` bound what its cache compiles (see actors/cache.py)."""

    def __init__(self, actor_id: int, p2p: P2PTransport | None, transfer_timeout: float = 300.0,
                 checker: BlobChecker | None = None, compile_timeout: float = 600.0, loaders: list[str] | tuple[str, ...] = ()) -> None:
        self.actor_id = actor_id
        self.stop_when_idle = False  # a shutdown asked while other sessions were open: stop when the last one ends
        self.request_stop: Any = None  # how to stop the daemon (set by it)
        self.loaders = Loaders(loaders)  # the data-loader functions this daemon may call (--allow-loader)
        self.device = jax.devices()[0]
        # CPU computations run one after another through an order token (actors/stream.py); GPUs queue in order.
        ordered_calls = self.device.platform == "cpu"
        self.stream = Stream(self.device, ordered_calls)
        self.cache = ExecutableCache(self.device, checker, compile_timeout, ordered=ordered_calls)
        self.p2p = p2p
        self.transfers = Transfers(actor_id, self.device, self.cache, p2p, transfer_timeout)
        self.interpreter = Interpreter(self.stream, self.cache, self.transfers)
        self.sessions: dict[int, Session] = {}
        self.started = time.time()  # (named in the error for a session it does not have: a restart shows)
        self.ownership = Ownership(authenticated=False)  # the daemon sets the real one (its keys, --admin-key)
        self.requests = 0
        self.errors = 0
        self.limits: dict[str, Any] = {}  # the daemon's bounds (request and compile timeouts), reported by `info`
        self.guest_bytes = 4 << 30  # buffer bytes the sessions of keys that do not own the job may hold (--guest-memory-mb)
        self._guest_decodes = asyncio.Lock()  # guests' big Programs are decoded one at a time (see load_program)
        self.handlers = {
            "ping": self.ping,
            "info": self.info,
            "hello": self.hello,
            "bye": self.bye,
            "put": self.put,
            "get": self.get,
            "wait": self.wait,
            "delete": self.delete,
            "compile": self.compile,
            "run": self.run,
            "load_program": self.load_program,
            "unload_programs": self.unload_programs,
            "run_program": self.run_program,
            "input_shm": self.input_shm,
            "abort": self.abort,
            "connect_peers": self.connect_peers,
            "nccl_ids": self.nccl_ids,
            "stats": self.stats,
            "hlo": self.hlo,
            "mesh": self.mesh,
            "save": lambda ses, msg: checkpoint.save(self, ses, msg),
            "restore": lambda ses, msg: checkpoint.restore(self, ses, msg),
            "profile": lambda ses, msg: profiler.profile(self, ses, msg),
        }
        self.profile_state = profiler.ProfileState()

    # ---- simple requests -------------------------------------------------------------------------
    async def ping(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        return {"actor_id": self.actor_id, "time": time.time(), "clock": now(), "pid": os.getpid()}, []

    async def info(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        devs = jax.devices()
        return {
            "actor_id": self.actor_id,
            "pid": os.getpid(),
            "platform": devs[0].platform,
            "devices": [str(d) for d in devs],
            "jax_version": jax.__version__,
            "p2p": self.p2p.endpoint() if self.p2p else None,
            "sessions": len(self.sessions),
            "cpu_inline": stream.INLINE_CLIENT,  # (XLA's CPU client runs Runs in the caller: MPMD_CPU_INLINE=1)
            **self.limits,
        }, []

    def _refuse_unless_governing(self, op: str, peer: str | None) -> None:
        if not self.ownership.governs(peer):
            raise RequestError(f"'{op}' changes or reads what every session on actor {self.actor_id} shares (its data-plane "
                               f"wiring, its process, its profiler, its device mesh or its files: checkpoints), so only the key "
                               f"that owns the daemon's job "
                               f"or an operator may send it; this daemon is {self.ownership.describe()}, and the request came "
                               f"from key {peer!r}. Use daemons of your own, or ask their operator (mpmd-actor --admin-key)"
                               + ("; a second key's own buffers and single-actor runs need no wiring: "
                                  "RemoteMesh.connect(..., transport='none')" if op == "connect_peers" else "")
                               + self._owner_idle())

    def _owner_idle(self) -> str:
        """When the owning key's sessions are all silent (its controller killed, say): when they will close, freeing
        the daemon for another key ('' when the owner is fixed, or one of its sessions is live)."""
        owner = self.ownership.owner
        timeout = self.limits.get("session_timeout")
        if self.ownership.fixed or owner is None or not timeout:
            return ""
        now = time.monotonic()
        idle = [now - s.last_seen for s in self.sessions.values() if s.owner == owner]
        if not idle or min(idle) < min(10.0, timeout / 2):  # (a live controller pings when idle, every second or so)
            return ""
        return (f". The owner's controller has said nothing for {min(idle):.0f} s (killed?): its session closes after "
                f"{timeout:g} s of silence (mpmd-actor --session-timeout), {max(0.0, timeout - min(idle)):.0f} s from now, "
                "and then a controller of another key may take the daemon")

    def admits_transfer(self, key: tuple[int, ...]) -> str | None:
        """Why a data-plane arrival keyed `key` (session first) is not welcome here, or None."""
        ses = self.sessions.get(key[0]) if key else None
        if ses is None:
            return f"no open session {key[0] if key else None!r} on actor {self.actor_id}"
        if not self.ownership.governs(ses.owner):
            return f"session {key[0]:x} on actor {self.actor_id} is not the job that owns its data plane"
        return None

    def authorize_shutdown(self, msg: Message, peer: str | None) -> bool:
        """Raise unless `peer` may stop this daemon (in an open session of its own, as the owner or an operator).
        Whether to stop: not while other sessions are open (another job on the same daemons, say, started from
        the same rendezvous with the same key) — then only the asking session closes, as with 'bye' — unless an
        operator (--admin-key) asks."""
        ses = self._session_of(msg, peer)
        self._refuse_unless_governing("shutdown", peer)
        if len(self.sessions) > 1 and peer not in self.ownership.admins:
            log.warning("session %x asked this daemon to stop while %d other session(s) are open: that session closes, and "
                        "the daemon stops once the others have closed or expired", ses.id, len(self.sessions) - 1)
            self.stop_when_idle = True
            self._end(ses)
            return False
        return True

    async def hello(self, ses: Session | None, msg: Message, peer: str | None = None) -> tuple[dict, list]:
        """Open a session for a controller (its id is the controller's random choice); reply with `info`."""
        sid = field(msg, "session", int)
        if sid in self.sessions:
            raise RequestError(f"session {sid:x} is already open on actor {self.actor_id}; each controller picks a fresh id")
        own = sum(s.owner == peer for s in self.sessions.values())
        if own >= MAX_SESSIONS_PER_KEY:
            if not self.ownership.authenticated:  # (every client is one identity here: the sessions may not be the caller's)
                raise RequestError(
                    f"actor {self.actor_id} already serves {own} sessions, its limit, and was started without keys, so every "
                    "client that reaches its socket counts as one (other processes' sessions too): close a mesh, wait "
                    "for idle sessions to expire (mpmd-actor --session-timeout), or start the daemons with "
                    "--server-key and --authorized-keys so that each key gets its own sessions")
            raise RequestError(f"key {peer!r} already holds {own} sessions on actor {self.actor_id} (the limit per key); close "
                               "a mesh (mesh.close()) first")
        claims = self.ownership.authenticated and not self.ownership.fixed and self.ownership.owner is None
        if claims:
            self.ownership.owner = peer  # the first session's key owns the daemon's job until its last session closes
        try:
            shared = sum(not self.ownership.governs(s.owner) for s in self.sessions.values())
            if not self.ownership.governs(peer) and shared >= MAX_SESSIONS:
                raise RequestError(f"actor {self.actor_id} already serves {shared} sessions of keys that do not own it (the "
                                   "limit); close a mesh first")
            mesh = msg.header.get("mesh")
            if mesh is not None:
                self._set_mesh(mesh, peer)
        except BaseException:
            if claims:
                self.ownership.owner = None
            raise
        self.sessions[sid] = Session(sid, self.actor_id, peer)
        if self.p2p is not None:  # (the id of a session that ended here, reopened: its transfers count again)
            self.p2p.revive((sid,))
        return await self.info(None, msg)

    async def mesh(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """Build this actor's device mesh (or check it is the one already built)."""
        self._set_mesh(field(msg, "mesh", dict), ses.owner)
        return {"mesh": {"shape": list(self.cache.mesh.devices.shape), "axis_names": list(self.cache.mesh.axis_names)}}, []

    def _set_mesh(self, wire: Any, peer: str | None) -> None:
        """Build this actor's device mesh ({shape, axis_names}); every session must ask for the same one."""
        if not isinstance(wire, dict) or not isinstance(wire.get("shape"), list) or not isinstance(wire.get("axis_names"), list):
            raise RequestError("'hello' field 'mesh' must be {shape: [int], axis_names: [str]}")
        shape, names = wire["shape"], wire["axis_names"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape) or not all(isinstance(n, str) for n in names):
            raise RequestError(f"'hello' mesh shape must be positive ints and axis names strings, got {shape!r}, {names!r}")
        if len(shape) != len(names) or len(set(names)) != len(names):
            raise RequestError(f"'hello' mesh must name each axis once, one name per dimension, got shape {shape!r} and axis "
                               f"names {names!r}")
        have = self.cache.mesh
        if have is not None:
            if list(have.devices.shape) != shape or list(have.axis_names) != names:
                raise RequestError(f"actor {self.actor_id} already runs a device mesh {dict(zip(have.axis_names, have.devices.shape))} "
                                   f"for another session; it cannot also be {dict(zip(names, shape))}")
            return
        self._refuse_unless_governing("mesh", peer)  # building the daemon's one device mesh is the owner's choice
        try:
            self.cache.mesh = spmd.build_mesh(jax.devices(), shape, names)
        except ValueError as e:
            raise RequestError(f"actor {self.actor_id}: {e}") from None
        self.stream.on_mesh(self.cache.mesh)

    async def bye(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """Close the caller's session: its buffers, programs and running steps go."""
        assert ses is not None
        self._end(ses)
        return {"closed": ses.id}, []

    def steps_running(self, sid: Any) -> list[asyncio.Task[Any]]:
        """The steps of session `sid` running (or waiting for their turn) now: what a request arriving behind them
        may wait on (the daemon's request bound counts once they ended)."""
        ses = self.sessions.get(sid) if isinstance(sid, int) and not isinstance(sid, bool) else None
        return [t for t in ses.running.values() if not t.done()] if ses is not None else []

    def expire_sessions(self, timeout: float) -> list[tuple[int, str | None, float]]:
        """Close every session whose controller has sent nothing for `timeout` seconds (it keeps a live one open
        with pings); (id, key, idle seconds) of each closed."""
        now = time.monotonic()
        idle = [(ses, now - ses.last_seen) for ses in self.sessions.values()
                if now - ses.last_seen > timeout and not any(not t.done() for t in ses.running.values())]  # (not mid-step)
        for ses, _ in idle:
            ses.inputs.sweep()  # (its controller is gone: segments it wrote that were never read stay in /dev/shm)
            self._end(ses, settle=False)
        if idle:
            collector.settle()  # (once for them all: each settle walks every object the daemon holds)
        return [(ses.id, ses.owner, t) for ses, t in idle]

    def _end(self, ses: Session, settle: bool = True) -> None:
        self.sessions.pop(ses.id, None)
        ses.close()
        self._retire(ses.executables)  # (its executables no other session uses)
        if settle:
            collector.settle()  # what only this session used may sit in frozen cycles
        if self.ownership.owner == ses.owner and not any(s.owner == ses.owner for s in self.sessions.values()):
            self.ownership.owner = None  # its job is over: the next session's key owns the daemon
        if not self.sessions and self.stop_when_idle and self.request_stop is not None:  # (a shutdown put off, above)
            self.request_stop()
        if not self.sessions and self.cache.mesh is not None:  # the next job may build another device mesh
            self.cache.mesh = None  # (compiled executables are cached per mesh: one built again finds its own)
            self.stream.off_mesh()
        if self.profile_state.session == ses.id:
            profiler.stop_quietly(self)
        self.transfers.session_timeouts.pop(ses.id, None)
        if self.p2p is not None:
            self.p2p.expire((ses.id,))

    async def put(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """Store one array as `buf`: carried inline, or (field ``shm``) a notice of where a local controller wrote
        it in one of its input segments (see actors/inputs.py), copied out here, since the controller writes that
        segment again once this is answered."""
        buf = field(msg, "buf", int)
        notice = msg.header.get("shm")
        if notice is not None:
            if msg.arrays:
                raise RequestError(f"'put' carries {len(msg.arrays)} arrays and a shared-memory notice; send one or the other")
            ses.inputs.retire([notice])
            host = ses.inputs.read(notice)
        elif len(msg.arrays) != 1:
            raise RequestError(f"'put' carries {len(msg.arrays)} arrays, expected 1")
        else:
            host = msg.arrays[0]
        def within_quota() -> None:
            self._within_guest_quota(ses, more_bytes=int(host.nbytes) - ses.buffers.size_of(buf))  # (a put replaces)

        within_quota()
        layout = self._layout(msg.header.get("layout"))
        if notice is not None:  # copied (after the quota: a refused put copies nothing) in a worker thread: 1.2 GiB
            # took 14 s on a loaded machine, and the loop must answer heartbeats meanwhile (a probe)
            ses.buffers.reserve(buf)  # (a delete arriving during the copy, its put cancelled, drops it: it found nothing)
            try:
                value = await asyncio.to_thread(lambda: self._to_device(np.array(host), layout))
                within_quota()  # again, now that the loop ran meanwhile: a guest's puts copying at once each passed alone
            except BaseException as e:
                ses.buffers.fail(buf, e)
                raise
            finally:
                if notice.get("once") is True:  # a segment of this put alone: unmapped now (the mapping goes with the view)
                    ses.inputs.forget(notice.get("name"))
        else:
            value = self._to_device(host, layout)
        ses.buffers.put(buf, value)
        return {"nbytes": int(host.nbytes)}, []

    def _layout(self, wire: Any) -> Any:
        """A wire layout as a PartitionSpec (None: unsharded); layouts need this actor's device mesh."""
        if wire is None:
            return None
        if self.cache.mesh is None:
            raise RequestError(f"actor {self.actor_id} has no device mesh, so nothing can be laid out over its devices; make the "
                               "mesh with mesh_shape=... (and devices_per_actor=N)")
        try:
            return spmd.spec_from_wire(wire)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _to_device(self, host: np.ndarray, spec: Any = None) -> jax.Array:
        # The host array views a ZeroMQ frame or an input segment. On CPU, JAX (0.10) aliases 64-byte-aligned
        # host memory even with may_alias=False (the array keeps the frame alive); elsewhere it copies once
        # (each device only its shard).
        if self.cache.mesh is not None:
            return spmd.put(host, self.cache.mesh, spec, self.device)
        return spmd.to_device(host, self.device)

    def _consts_to_device(self, consts: dict[int, np.ndarray]) -> dict[int, jax.Array]:
        """A Program's constants on the device (`_to_device` of each; on one device, in one `device_put`)."""
        if self.cache.mesh is not None:
            return {b: self._to_device(a) for b, a in consts.items()}
        return dict(zip(consts, spmd.to_device_all(list(consts.values()), self.device)))

    async def hlo(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """The optimized HLO text of a compiled executable (what XLA made of it: collectives, fusions)."""
        return {"text": self._executable(ses, field(msg, "exe", str)).as_text()}, []

    def _executable(self, ses: Session, key: str) -> Any:
        """An executable this session compiled (another session's are not its to run, or to learn of)."""
        if key not in ses.executables:
            raise RequestError(f"no executable {key!r} in this session on actor {self.actor_id} ({len(ses.executables)} "
                               "compiled by it); send it with 'compile' first")
        return self.cache.get(key)

    async def get(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """One buffer (`buf`) or several (`bufs`), each as an array frame, once computed."""
        bufs = int_list(msg, "bufs") if "bufs" in msg.header else [field(msg, "buf", int)]
        distinct = list(dict.fromkeys(bufs))  # (an id named twice is copied to the host once)
        into = msg.header.get("into")  # a segment name per entry of bufs (see InputSegments.write_output)
        if into is not None and (not isinstance(into, list) or len(into) != len(bufs)):
            raise RequestError(f"'get' field 'into' must list one segment name (or nil) per buffer ({len(bufs)})")
        pooled = msg.header.get("pooled")  # per entry of into: the inode of a segment the controller made for reuse, or 0
        if pooled is not None and (into is None or not isinstance(pooled, list) or len(pooled) != len(into)
                                   or not all(type(p) is int and p >= 0 for p in pooled)):
            raise RequestError(f"'get' field 'pooled' must list one inode (an int, 0: none) per entry of 'into' ({len(bufs)})")
        forget = msg.header.get("forget")  # pooled segments the controller dropped: unmapped here
        if forget is not None and (not isinstance(forget, list) or len(forget) > MAX_IDS):
            raise RequestError(f"'get' field 'forget' must list at most {MAX_IDS} segment names")
        ses.inputs.forget_outputs(forget)
        if into is not None and not self.ownership.governs(ses.owner):
            into = None  # (a guest's values come in the reply: /dev/shm is not in its quota)
        values = await _taken_now(ses, distinct)

        def frames() -> tuple[dict, list[Any]]:
            host = dict(zip(distinct, (computed(v) for v in values)))
            if into is None:
                return {}, [host[b] for b in bufs]
            first: dict[int, dict | None] = {}  # buffer -> its notice (a buffer named twice is written once)
            try:
                for b, name, reuse in zip(bufs, into, pooled or [0] * len(into)):
                    if b not in first:
                        first[b] = ses.inputs.write_output(name, host[b], reuse)
            except BaseException:
                ses.inputs.unlink_outputs(n["name"] for n in first.values() if n is not None)
                raise
            notices = [first[b] for b in bufs]
            return {"shm": notices}, [host[b] for b, n in zip(bufs, notices) if n is None]

        if all(is_ready(v) for v in values) and (into is None or all(getattr(v, "nbytes", 0) < OUTPUT_MIN_BYTES for v in values)):
            return frames()  # (small: copied here, on the loop)
        work = asyncio.ensure_future(asyncio.to_thread(frames))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:  # (the thread goes on: what it writes for a reply that will not come goes then)
            def unlink_written(w: asyncio.Future[tuple[dict, list[Any]]]) -> None:
                if not w.cancelled() and w.exception() is None:
                    ses.inputs.unlink_outputs(n["name"] for n in w.result()[0].get("shm", []) if n is not None)

            work.add_done_callback(unlink_written)
            raise

    async def wait(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """Reply once the buffers `bufs` are computed (what `block_until_ready` asks)."""
        values = await _taken_now(ses, list(dict.fromkeys(int_list(msg, "bufs"))))
        if not all(is_ready(v) for v in values):
            await asyncio.to_thread(jax.block_until_ready, values)
        return {"ready": len(values)}, []

    async def delete(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        return {"deleted": ses.buffers.delete(int_list(msg, "bufs"))}, []

    async def compile(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        if len(msg.arrays) != 1:
            raise RequestError("'compile' carries the serialized executable as one uint8 frame")
        digest = msg.header.get("digest")
        if digest is not None and not isinstance(digest, str):
            raise RequestError("'compile' field 'digest' must be the blob's SHA-256 in hex")
        donate = int_list(msg, "donate") if "donate" in msg.header else []
        if any(d < 0 for d in donate) or len(set(donate)) != len(donate):  # (each was compiled as another executable)
            raise RequestError(f"'compile' field 'donate' must name distinct input positions (>= 0), got {donate[:16]}")
        donate.sort()  # ([1, 0] and [0, 1] are one executable: a review)
        in_layouts, out_layouts = msg.header.get("in_layouts"), msg.header.get("out_layouts")
        for name, lay in (("in_layouts", in_layouts), ("out_layouts", out_layouts)):
            if lay is not None and not isinstance(lay, list):
                raise RequestError(f"'compile' field {name!r} must be a list of layouts")
        if (in_layouts is not None or out_layouts is not None) and self.cache.mesh is None:
            raise RequestError(f"actor {self.actor_id} has no device mesh: layouts need a mesh (RemoteMesh(..., mesh_shape=...))")
        key, cached = await self.cache.compile(msg.arrays[0].data, digest, tuple(donate), in_layouts, out_layouts)
        cached = cached and key in ses.executables  # (whether another session compiled it is not this one's business)
        ses.executables.add(key)
        self.cache.claim(key)
        if self.sessions.get(ses.id) is not ses and not any(key in s.executables for s in self.sessions.values()):
            self.cache.retire([key])  # (its session ended while it compiled: nobody's, like the rest of that session's)
        reply: dict[str, Any] = {"exe": key, "cached": cached}
        if in_layouts is not None:
            reply["out_layouts"] = self.cache.out_layouts(key)
        if not cached:
            collector.freeze()  # the executable and what its loading made are kept: out of the collector's walks
        return reply, []

    async def run(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        inputs, outputs = int_list(msg, "inputs"), int_list(msg, "outputs")
        key = field(msg, "exe", str)
        exe = self._executable(ses, key)
        self._within_guest_quota(ses, more_bytes=self.cache.output_bytes(key))  # (room for its outputs first)
        if set(inputs) & set(outputs) or len(set(outputs)) != len(outputs):
            raise RequestError(f"'run': an output buffer id is also an input or given twice (inputs {inputs}, outputs {outputs})")
        leaves = getattr(getattr(exe, "in_tree", None), "num_leaves", None)
        takes = leaves - int(self.stream.ordered) if isinstance(leaves, int) else None  # (its order token first, where ordered)
        if takes is not None and len(inputs) != takes:  # (JAX's own pytree TypeError: a probe)
            raise RequestError(f"'run': executable {key[:16]} takes {takes} inputs, got {len(inputs)} buffer ids")
        refs = [ses.buffers.ref(b) for b in inputs]  # unknown ids fail here, before anything is reserved
        for b in outputs:
            ses.buffers.reserve(b)

        async def compute() -> list[Any]:
            args = [await asyncio.shield(r) if isinstance(r, asyncio.Future) else r for r in refs]
            _, results = await self.stream.call_awaited(exe, args, self.cache.goes_off_loop(key), self.cache.send_off_loop, key)
            if len(results) != len(outputs):
                raise RequestError(f"executable returns {len(results)} values but {len(outputs)} output ids were given")
            return results

        results = await ses.buffers.produce(outputs, compute())
        return {"outputs": [aval_header(r.shape, r.dtype) for r in results]}, []

    async def stats(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        assert ses is not None
        mine = {
            "buffers": len(ses.buffers),
            "bytes": ses.buffers.nbytes,
            "executables": len(ses.executables),
            "session_executables": len(ses.executables),  # (the owner's "executables" is the daemon's cache)
            "programs": len(ses.programs),
            "running": len(ses.running),
            "last_step_peak_bytes": ses.last_step_peak_bytes,
            "shm_inputs": ses.inputs.reads,
            "shm_outputs": ses.inputs.outputs,
            "shm_input_maps": len(ses.inputs.maps),
            "loader_calls": self.loaders.calls,
            "shm_input_bytes": ses.inputs.bytes,
            "device_bytes": spmd.per_device_bytes(ses.buffers.values(), self.cache.mesh, self.device),
            "p2p": None,
        }
        if self.ownership.governs(ses.owner):  # what the daemon does for every session: its owner's and operators' to see
            mine.update({"executables": len(self.cache), "unused_executables": len(self.cache.unused), "compiles": self.cache.compiles, "hits": self.cache.hits,
                         "requests": self.requests, "errors": self.errors, "sessions": len(self.sessions),
                         "p2p": self.p2p.stats() if self.p2p is not None else None})
        return mine, []

    async def connect_peers(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        if self.p2p is None:
            raise RequestError("this actor was started without a data plane (--p2p none)")
        peers = field(msg, "peers", dict)
        try:
            parsed = {int(k): dict(v) for k, v in peers.items()}
        except (TypeError, ValueError):
            raise RequestError("'connect_peers' field 'peers' must map actor ids to {address, route} maps") from None
        timeout = msg.header.get("timeout")
        if timeout is not None:
            if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
                raise RequestError(f"'connect_peers' field 'timeout' must be a positive number of seconds, got {timeout!r}")
            self.transfers.session_timeouts[ses.id] = float(timeout)  # (its own steps' limit, not another job's)
        try:
            await self.p2p.connect(parsed)
        except (ValueError, KeyError) as e:
            raise RequestError(f"'connect_peers': {e}") from None
        return {"connected": sorted(parsed), "routes": {str(p): r for p, r in self.p2p.routes.items()}}, []

    async def nccl_ids(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        from transport.p2p import nccl

        count = field(msg, "count", int)
        if not 0 <= count <= 4096:
            raise RequestError(f"'nccl_ids' field 'count' must be 0-4096, got {count}")
        if not nccl.available():
            raise RequestError(f"actor {self.actor_id} cannot use NCCL: cupy.cuda.nccl does not import (install the 'gpu' extra)")
        return {"ids": [nccl.unique_id() for _ in range(count)]}, []

    # ---- programs --------------------------------------------------------------------------------
    async def load_program(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        wire = field(msg, "program", dict)
        instrs = wire.get("instrs")
        pid_given = wire.get("id")  # (a program loaded again under its id replaces the one before)
        guest = not self.ownership.governs(ses.owner)
        # A big Program is counted and decoded beside the loop, which answers meanwhile (a guest's million-instruction
        # Program held it 13 s, past the owner's heartbeat limit, and the owner's job was declared dead; a probe), a
        # guest's one at a time (forty at once stalled the owner 6 s); an unload of its id waits for it (`loading`).
        done = asyncio.get_running_loop().create_future()
        if not isinstance(pid_given, int) or isinstance(pid_given, bool):
            pid_given = None  # (decode_program says what is wrong with it)
        if pid_given is not None:  # (before the first await: an unload right behind it waits)
            ses.loading.setdefault(pid_given, []).append(done)
        try:
            many = isinstance(instrs, list) and len(instrs) > BIG_PROGRAM or len(msg.arrays) > BIG_PROGRAM
            words = await _beside_loop(many, _program_words, instrs) + len(msg.arrays)  # (each constant a word too)
            big = many or words > BIG_PROGRAM_WORDS
            async with self._guest_decodes if guest and big else contextlib.nullcontext():
                self._within_program_quota(ses, pid_given, words, msg)
                try:
                    pid, prog = await _beside_loop(big, decode_program, wire, msg.arrays)
                except ProgramError as e:
                    raise RequestError(f"'load_program': {e}") from None
            made, exes = 0, set()  # bytes its Runs' outputs take, all at once at the most: a guest's step needs room for them
            for ins in prog.instructions:
                if isinstance(ins, Run):
                    self._executable(ses, ins.exe)  # every executable must be compiled (by this session) before the program
                    if len(ins.outputs) != self.cache.num_outputs(ins.exe):  # (a Run pairs them one to one)
                        raise RequestError(f"'load_program': a Run of executable {ins.exe!r} names {len(ins.outputs)} output "
                                           f"buffers, but it returns {self.cache.num_outputs(ins.exe)} values")
                    made += self.cache.output_bytes(ins.exe)
                    exes.add(ins.exe)
                elif isinstance(ins, (Send, Recv)):
                    if guest:
                        raise RequestError(self._not_wired(ses))
                    self._check_peer(ins, "'load_program'")
            self._within_program_quota(ses, pid, words, msg)  # (again: other loads may have been recorded meanwhile)
            # (placed beside the loop when many: 60,000 empty constants held it 27 s, and a job's controller took its
            # actor for dead; a probe)
            prog.consts = await _beside_loop(big, self._consts_to_device, prog.consts)
            if self.sessions.get(ses.id) is not ses:  # (closed while the constants were placed: nothing is kept)
                raise RequestError(f"session {ses.id} closed while program {pid} was loading on actor {self.actor_id}")
            self._within_program_quota(ses, pid, words, msg)  # (and once more, with no await before it is recorded: two
            # loads of a guest placing at once each passed the check alone; a review)
            ses.programs[pid] = prog
            ses.program_words[pid], ses.program_bytes[pid] = words, sum(int(a.nbytes) for a in msg.arrays)
            ses.program_made[pid], ses.program_exes[pid] = made, exes
        finally:
            done.set_result(None)
            waiting = ses.loading.get(pid_given, [])
            if done in waiting:
                waiting.remove(done)
                if not waiting:
                    del ses.loading[pid_given]
        collector.freeze()  # the Program's instructions are kept for the session's life
        return {"program": pid}, []

    def _within_program_quota(self, ses: Session, pid: Any, words: int, msg: Message) -> None:
        """`_within_guest_quota` for a Program of `words` and `msg`'s constants loaded as `pid` (replacing its own)."""
        replaced = (ses.program_bytes.get(pid, 0), ses.program_words.get(pid, 0)) if isinstance(pid, int) else (0, 0)
        self._within_guest_quota(ses, more_bytes=sum(int(a.nbytes) for a in msg.arrays) - replaced[0],
                                 more_words=words - replaced[1])

    async def unload_programs(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """Drop the session's Programs `programs` (a step signature the controller let go), and its executables
        `executables` (optional: those no other signature of the controller uses) unless a Program it still holds
        runs one; steps already running finish first. Ids and keys it does not hold are skipped."""
        ids = int_list(msg, "programs")
        keys = field(msg, "executables", list) if "executables" in msg.header else []
        if len(keys) > MAX_IDS or not all(isinstance(k, str) for k in keys):
            raise RequestError(f"'unload_programs' field 'executables' must be a list of at most {MAX_IDS} executable keys")
        for pid in ids:  # (a load of one still decoding beside the loop is let finish, then unloaded)
            for waiting in list(ses.loading.get(pid, ())):
                await asyncio.shield(waiting)
        gone = [pid for pid in ids if ses.programs.pop(pid, None) is not None]
        for pid in ids:
            for table in (ses.program_words, ses.program_bytes, ses.program_made, ses.program_exes):
                table.pop(pid, None)
        still = set().union(*ses.program_exes.values()) if keys else set()
        freed = sorted(k for k in set(keys) if k in ses.executables and k not in still)
        ses.executables.difference_update(freed)
        running = [t for t in ses.running.values() if not t.done()]
        if running:  # (a step dispatched before may still run them: retired once those steps are over)
            asyncio.ensure_future(self._retire_after(running, freed))
        else:
            self._retire(freed)
        return {"unloaded": gone, "executables": freed}, []

    def _retire(self, keys: Any) -> None:
        """`keys` left a session: those no open session uses are kept among the cache's unused, as a closed session's."""
        in_use = set().union(*(s.executables for s in self.sessions.values()))
        for key in self.cache.retire(set(keys) - in_use):
            self.interpreter.forget(key)

    async def _retire_after(self, running: list[asyncio.Task[Any]], keys: list[str]) -> None:
        await asyncio.wait(running)
        self._retire(keys)

    def _within_guest_quota(self, ses: Session, more_bytes: int = 0, more_words: int = 0) -> None:
        """A RequestError if `ses` is a guest's (its key does not own the daemon's job) and the guests' sessions would
        hold more than their quota: buffer bytes (`--guest-memory-mb`) and, in proportion, loaded Program words. A
        key the operator admitted beside the job's must not take the job's daemon down for lack of memory."""
        if self.ownership.governs(ses.owner):
            return
        guests = [s for s in self.sessions.values() if not self.ownership.governs(s.owner)]
        held = sum(s.buffers.nbytes + sum(s.program_bytes.values()) for s in guests)
        words = sum(sum(s.program_words.values()) for s in guests)
        most_words = self.guest_bytes // (1 << 20) * GUEST_PROGRAM_WORDS_PER_MB
        if held + more_bytes > self.guest_bytes or words + more_words > most_words:
            what = (f"{(held + more_bytes) / 2**20:.1f} MiB of buffers (the limit: {self.guest_bytes / 2**20:.0f} MiB)"
                    if held + more_bytes > self.guest_bytes else
                    f"{words + more_words} instruction words in loaded programs (the limit: {most_words})")
            raise RequestError(f"key {ses.owner!r} does not own actor {self.actor_id}'s job ({self.ownership.describe()}); the "
                               f"sessions of such keys would hold {what} between them: delete buffers, close a mesh, or "
                               "start the daemon with a larger --guest-memory-mb")

    def _check_peer(self, ins: Send | Recv, what: str) -> None:
        """A RequestError unless this actor's data plane is wired to the actor `ins` sends to or receives from (a recv
        from another waited the whole --transfer-timeout)."""
        peer = ins.to_actor if isinstance(ins, Send) else ins.from_actor
        routes = self.p2p.routes if self.p2p is not None else {}
        if peer not in routes:
            raise RequestError(f"{what}: a {'send to' if isinstance(ins, Send) else 'recv from'} actor {peer}, but actor "
                               f"{self.actor_id}'s data plane is not connected to it (connected: {sorted(routes)}"
                               f"{'; started with --p2p none' if self.p2p is None else ''})")

    def _not_wired(self, ses: Session) -> str:
        return (f"actor {self.actor_id}'s data plane is wired for the job of another key ({self.ownership.describe()}); "
                f"key {ses.owner!r} may run single-actor programs here, but not send or receive between actors")

    async def run_program(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        ses.inputs.retire(msg.header.get("shm_inputs"))  # first: a request refused below still retires its segments
        pid, step = field(msg, "program", int), field(msg, "step", int)
        prog = ses.programs.get(pid)
        if prog is None:
            raise RequestError(f"no program {pid} on actor {self.actor_id}; load it first ({sorted(ses.programs)} loaded)")
        self._within_guest_quota(ses, more_bytes=sum(int(a.nbytes) for a in msg.arrays) + ses.program_made.get(pid, 0))
        inputs, outputs = int_list(msg, "inputs"), int_list(msg, "outputs")
        if len(inputs) != len(prog.inputs) or len(outputs) != len(prog.outputs):
            raise RequestError(f"program {pid} takes {len(prog.inputs)} inputs and {len(prog.outputs)} outputs; "
                               f"got {len(inputs)} and {len(outputs)}")
        if any(b < -3 for b in inputs):
            raise RequestError(f"program {pid}: input ids are buffers (>= 0), -1 (inline frame), -2 (shared memory) or -3 "
                               f"(loaded on the actor); got {inputs}")
        loads = msg.header.get("loads", [])
        if not isinstance(loads, list) or len(loads) != sum(b == -3 for b in inputs):
            raise RequestError(f"'run_program' field 'loads' must hold one loader entry per input marked -3 "
                               f"({sum(b == -3 for b in inputs)}), got {loads!r:.200}")
        if loads and not self.ownership.governs(ses.owner):  # (a guest key read the job's data for any step, and its
            # calls beside the job's gave the job wrong batches: a probe)
            raise RequestError(f"a loader call reads the data of the job that owns actor {self.actor_id}, so only its key or an "
                               f"operator may ask for one; this daemon is {self.ownership.describe()}, and the request came "
                               f"from key {ses.owner!r}. Pass the batch from the host, or use daemons of your own")
        for spec in loads:  # all checked before anything starts
            self.loaders.check(spec)
        if sum(b == -1 for b in inputs) != len(msg.arrays):
            raise RequestError(f"{sum(b == -1 for b in inputs)} inputs are marked inline (-1) but {len(msg.arrays)} arrays came")
        notices = msg.header.get("shm_inputs", [])
        if not isinstance(notices, list) or len(notices) != sum(b == -2 for b in inputs):
            raise RequestError(f"'run_program' field 'shm_inputs' must hold one notice per input marked -2 "
                               f"({sum(b == -2 for b in inputs)}), got {notices!r:.200}")
        sync = msg.header.get("sync", False)
        tracing = msg.header.get("trace", False)
        if not isinstance(sync, bool) or not isinstance(tracing, bool):
            raise RequestError("'run_program' fields 'sync' and 'trace' must be bools")
        raw_prologue = msg.header.get("prologue", [])
        if not isinstance(raw_prologue, list) or len(raw_prologue) > MAX_IDS:
            raise RequestError(f"'run_program' field 'prologue' must be a list of at most {MAX_IDS} instructions")
        if raw_prologue and not self.ownership.governs(ses.owner):
            raise RequestError(self._not_wired(ses))
        prologue = []
        for raw in raw_prologue:  # (each checked as it comes: a million bad ones were all decoded first, 9 s on the loop)
            try:
                ins = decode_instruction(raw)
            except ProgramError as e:
                raise RequestError(f"'run_program' prologue: {e}") from None
            if not isinstance(ins, (Send, Recv)):
                raise RequestError("a prologue holds only send and recv instructions")
            prologue.append(ins)
        received = {i.buf for i in prologue if isinstance(i, Recv)}  # copied in from other actors, then read as inputs
        clash = set(outputs) & (set(inputs) | received)
        if clash or len(set(outputs)) != len(outputs):
            raise RequestError(f"program {pid}: an output buffer id is also an input or given twice ({sorted(clash) or outputs})")
        # Check every input before reserving anything or awaiting: a bad id fails the request with nothing
        # left reserved. Then take them all at once, so a delete arriving next cannot pull one away.
        for b in [*(b for b in inputs if b >= 0 and b not in received), *(i.buf for i in prologue if isinstance(i, Send))]:
            ses.buffers.ref(b)
        for ins in prologue:
            self._check_peer(ins, "'run_program' prologue")
        inline = iter(msg.arrays)
        raw_layouts = msg.header.get("inline_layouts")
        if raw_layouts is not None and (not isinstance(raw_layouts, list) or len(raw_layouts) != len(msg.arrays)):
            raise RequestError("'run_program' field 'inline_layouts' must give one layout (or null) per inline array")
        layouts = iter(raw_layouts or [None] * len(msg.arrays))
        try:  # before anything is reserved: a failure here leaves nothing behind
            placed = {i: self._to_device(next(inline), self._layout(next(layouts))) for i, b in enumerate(inputs) if b == -1}
        except Exception as e:
            raise RequestError(f"program {pid}: an inline input cannot be placed on actor {self.actor_id}: {e}") from None
        # Shared-memory inputs are placed now. On CPU (one device) the array aliases the segment without a copy
        # (see `_to_device`), which the controller rewrites once this request is answered: so the reply then
        # waits until the step's last Run has computed (Runs are dispatched asynchronously, and every one before
        # it in the actor's stream is done by then). An input that is also a Program output, or that the Program
        # sends (ZeroMQ may still read a frame after the send is posted), would outlive the request: it is
        # copied, as is every input placed on another platform or over a device mesh.
        copied = set(prog.outputs) | {ins.buf for ins in prog.instructions if isinstance(ins, Send)} if notices else set()
        aliased = False
        for i, notice in marked(inputs, -2, notices):
            view = ses.inputs.read(notice)
            if self.cache.mesh is not None or self.device.platform != "cpu" or prog.inputs[i] in copied:
                view = np.array(view)
            else:
                aliased = True
            try:
                placed[i] = self._to_device(view, self._layout(notice.get("layout")))
            except Exception as e:
                raise RequestError(f"program {pid}: a shared-memory input cannot be placed on actor {self.actor_id}: {e}") from None
        # Loaded leaves come in a worker thread, while the step before still runs (in the session's queue: one call at
        # a time, in step order, at most AHEAD steps ahead); the step waits for them, and lets the queue go on as it ends.
        specs = list(marked(inputs, -3, loads))
        loading, end_loads = [], (lambda: None)
        if specs:
            places = [lambda host, lay=self._layout(spec.get("layout")): self._to_device(host, lay) for _, spec in specs]
            loading, end_loads = queue(self.loaders, [spec for _, spec in specs], [spec.get("step", step) for _, spec in specs],
                                       places, ses.id)
            placed.update({i: f for (i, _), f in zip(specs, loading)})
        try:
            for b in received:
                ses.buffers.reserve(b)
            refs = [placed[i] if b < 0 else ses.buffers.ref(b) for i, b in enumerate(inputs)]
            # The buffers the prologue sends are taken now too: the step's task starts on the loop's next turn, and a
            # delete that came right behind this request (the caller dropped or donated them) is handled before.
            sent = {i.buf: ses.buffers.ref(i.buf) for i in prologue if isinstance(i, Send)}
            for b in outputs:
                ses.buffers.reserve(b)
            key = (pid, step)
            env = BufferTable(f"actor {self.actor_id} program {pid} step {step}", remember_failures=True)
            for b, v in prog.consts.items():
                env.put(b, v)
            trace = StepTrace() if tracing else None
            task = asyncio.get_running_loop().create_task(
                self.interpreter.run_step((ses.id, pid, step), prog, env, refs, prologue, ses.buffers, sync, trace, sent))
        except BaseException:
            end_loads()
            raise
        ses.running[key] = task
        try:
            last = await task
            results = [env.get_now(local) for local in prog.outputs]
        except BaseException as e:
            why = e
            if isinstance(e, asyncio.CancelledError):  # aborted: its own loader, still not returned, is why the others waited
                held = unfinished(loading, self.loaders)
                why = (HeldByLoader if held else StepAborted)(f"program {pid} step {step} was aborted on actor {self.actor_id}" + (
                    f" while it was waiting for its data loader: {held} had not returned (a loader that blocks holds the "
                    "step and the actors that wait for it; give it a timeout of its own)" if held else ""))
                why.loading = held  # type: ignore[attr-defined]  # (this step's own loads: what a timeout names)
            for b in [*outputs, *received]:  # (a prologue receive the step never got to is still reserved)
                ses.buffers.fail(b, why)  # whoever waits for one learns why it will not come
            if why is not e:
                raise why from None
            raise
        finally:
            end_loads()
            ses.running.pop(key, None)
            if self.p2p is not None:
                self.p2p.expire((ses.id, pid, step))  # leftovers go, and whatever still arrives for this step
            ses.last_step_peak_bytes = env.peak_bytes
            env.clear()  # the step's intermediates go now (and with them any shared memory they aliased)
        for b, r in zip(outputs, results):
            ses.buffers.put(b, r)  # (the next step's Runs may be dispatched from here on)
        if aliased and self.stream.ordered and last is not None and not last.is_ready():  # see the inputs above
            try:
                await asyncio.to_thread(jax.block_until_ready, last)
            except Exception:  # a Run failed: its outputs carry the error to whoever reads them
                pass
        reply: dict[str, Any] = {"outputs": [aval_header(r.shape, r.dtype) for r in results]}
        if trace is not None:
            trace.end = now()
            reply["trace"] = trace.to_wire()
        return reply, []

    async def input_shm(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """Accept step arguments in shared-memory segments named `prefix` + a number (see actors/inputs.py)."""
        assert ses is not None
        prefix = msg.header.get("prefix")
        if any(s is not ses and s.inputs.base == prefix for s in self.sessions.values()):  # (a session closed for
            # silence unlinks its prefix's segments: one claiming another's could remove that controller's; a review)
            raise RequestError(f"'input_shm' prefix {prefix!r} is another session's on actor {self.actor_id}")
        return {"prefix": ses.inputs.set_prefix(prefix)}, []

    async def abort(self, ses: Session | None, msg: Message) -> tuple[dict, list]:
        """Cancel the running step (program, step), or every running step of the session when neither is given."""
        assert ses is not None
        if "program" not in msg.header and "step" not in msg.header:
            tasks = list(ses.running.values())
        else:
            task = ses.running.get((field(msg, "program", int), field(msg, "step", int)))
            tasks = [task] if task is not None else []
        for task in tasks:
            task.cancel()
        return {"aborted": bool(tasks), "steps": len(tasks)}, []

    # ---- dispatch --------------------------------------------------------------------------------
    async def handle(self, msg: Message, peer: str | None = None) -> tuple[dict, list]:
        """Serve one request. `peer` is the authenticated client (None without authentication): a session
        answers only the client that opened it."""
        self.requests += 1
        handler = self.handlers.get(msg.op)
        if handler is None:
            raise RequestError(f"unknown op {msg.op!r}; this actor serves {sorted(self.handlers)}")
        if msg.op == "hello":
            return await self.hello(None, msg, peer)
        if msg.op == "ping":  # a controller's keep-alive names its session (a ping that names none is fine too)
            sid = msg.header.get("session")
            ses = self.sessions.get(sid) if isinstance(sid, int) and not isinstance(sid, bool) else None
            if ses is not None and ses.owner == peer:
                ses.last_seen = time.monotonic()
            reply, frames = await handler(None, msg)
            if sid is not None:  # (a controller whose session is gone here takes this actor as lost)
                reply["session_open"] = ses is not None and ses.owner == peer
            return reply, frames
        ses = None if msg.op in SESSIONLESS else self._session_of(msg, peer)
        if msg.op in GOVERNING:
            self._refuse_unless_governing(msg.op, peer)
        return await handler(ses, msg)

    def _session_of(self, msg: Message, peer: str | None) -> Session:
        """The open session a request names, if the key that sent it opened it."""
        sid = msg.header.get("session")
        ses = self.sessions.get(sid) if isinstance(sid, int) and not isinstance(sid, bool) else None
        if ses is None or ses.owner != peer:  # another client's session: as if it did not exist
            raise NoSession(f"'{msg.op}' needs an open session (got session {sid!r}); a controller opens one with "
                            f"'hello' when it connects. This daemon (pid {os.getpid()}, up since "
                            f"{time.strftime('%H:%M:%S', time.localtime(self.started))}) has no such session: it was "
                            f"closed (its controller said nothing for --session-timeout {self.limits.get('session_timeout')} s), "
                            f"or it was opened with an earlier daemon at this address")
        ses.last_seen = time.monotonic()
        return ses


__all__ = ["Actor", "Ownership", "Session"]
