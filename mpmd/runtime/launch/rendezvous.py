"""Meshes of daemons that a cluster's scheduler started: wait for their arrivals at a rendezvous, check them,
connect. Nobody types an address.

    srun mpmd-actor --slurm --rendezvous $RDV --authorized-keys ~/.mpmd/keys &          # every task
    mesh = mpmd.RemoteMesh.from_rendezvous(RDV, num_actors=4, keys="~/.mpmd/keys")      # the controller

The rendezvous is a directory every node sees, or ``tcp://HOST:PORT``, which the controller serves while it
waits (for Kubernetes, or clusters without a shared file system). The record each daemon announces, and the
rules that make a rendezvous safe to trust, are in transport/rendezvous.py.

Keys: each daemon makes its control socket's key pair in memory and announces only the public half; it
admits the controllers whose public keys are in its ``--authorized-keys DIR``. The controller authenticates
with that pair (``keys=DIR``, or a `ClientKeys` whose `client` it is) and learns each daemon's public key from
its arrival, so it talks only to the daemon that announced itself there. A TCP rendezvous is itself a CURVE
socket served with the controller's pair and admitting only the job's key, so a stranger on the network can
neither announce a daemon of its own nor read the arrivals.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpmd.errors import IncompatibleActorError, RendezvousError
from mpmd.runtime.arguments import check_count, check_seconds
from transport.auth import Authenticator, AuthKeyError, ClientKeys, KeyPair, configure_server
from transport.control import allow_ipv6, bind_failure
from transport.protocol import PROTOCOL_VERSION
from transport.rendezvous import (
    FAILURE_SKEW,
    FAILURE_WAIT,
    Arrival,
    ClaimedError,
    Failure,
    RendezvousDirectoryError,
    RendezvousFormatError,
    check_directory,
    decode_message,
    encode_message,
    endpoint_alive,
    is_tcp,
    other_scheme,
    read_arrivals,
    read_failures,
)

log = logging.getLogger(__name__)
REPROBE = 2.0  # seconds before an arrival whose endpoint did not answer is tried again


@dataclass(frozen=True)
class ActorFacts:
    """What the controller checks of every actor before it drives them together."""

    actor_id: int
    where: str  # e.g. "node07 (pid 1234)"
    jax_version: str
    platform: str
    protocol: int = PROTOCOL_VERSION


def _platform_name(p: str) -> str:
    return "gpu" if p.lower() in ("gpu", "cuda", "rocm") else p.lower()


def check_compatible(facts: Sequence[ActorFacts], platform: str | None = None) -> None:
    """Refuse actors whose JAX version or protocol differs from this controller's, or whose platform differs
    from `platform` (None: from the other actors'), naming every such actor."""
    import jax

    wrong = [f"actor {f.actor_id} on {f.where} runs JAX {f.jax_version}" for f in facts if f.jax_version != jax.__version__]
    if wrong:
        raise IncompatibleActorError(f"{'; '.join(wrong)}, but this controller runs JAX {jax.__version__}: executables are "
                                     "exported here and deserialized there, so install the same jax (and jaxlib) on every "
                                     "node and the controller")
    wrong = [f"actor {f.actor_id} on {f.where} speaks protocol {f.protocol}" for f in facts if f.protocol != PROTOCOL_VERSION]
    if wrong:
        raise IncompatibleActorError(f"{'; '.join(wrong)}, this controller {PROTOCOL_VERSION}: install the same mpmd everywhere")
    want = _platform_name(platform) if platform else None
    if want is None:
        kinds: dict[str, list[int]] = {}
        for f in facts:
            kinds.setdefault(_platform_name(f.platform), []).append(f.actor_id)
        if len(kinds) > 1:
            raise IncompatibleActorError("the actors run on different platforms (" + "; ".join(
                f"{p}: actors {ids}" for p, ids in sorted(kinds.items())) + "): one mesh needs one platform. Check the "
                "nodes' JAX installs (jax[cuda12] everywhere, or CPU everywhere), or pass platform= to say which is meant")
        return
    wrong = [f"actor {f.actor_id} on {f.where} runs on {f.platform}" for f in facts if _platform_name(f.platform) != want]
    if wrong:
        raise IncompatibleActorError(f"{'; '.join(wrong)}, but platform={platform!r} was asked for: check that node's JAX "
                                     "install and the GPUs its task was given")


def facts_of(arrival: Arrival) -> ActorFacts:
    return ActorFacts(arrival.actor_id, f"{arrival.host} (pid {arrival.pid})", arrival.jax_version, arrival.platform,
                      arrival.protocol)


class RendezvousDaemon:
    """A daemon of a rendezvous mesh, as the mesh sees the daemons it owns: it asks them to shut down when it
    closes (they run elsewhere, so there is nothing to kill or wait for here)."""

    def __init__(self, arrival: Arrival) -> None:
        self.actor_id = arrival.actor_id
        self.arrival = arrival

    def dead_reason(self) -> str | None:
        return None  # another machine's process: only its connection and heartbeats tell

    def stacks(self) -> str:
        a = self.arrival
        return (f"(not available here: it runs on {a.host} as pid {a.pid}; `kill -USR1 {a.pid}` there writes every thread's "
                "stack to its stderr, i.e. to srun's output or the pod's log)")

    def stop(self, timeout: float = 3.0) -> None:
        pass

    # (what the connection says of a lost one: restarted, it announces a new address and key at the rendezvous, which
    # reconnect does not read; a probe followed the reconnect hint into a timeout and a key refusal)
    comeback = ("A daemon of a rendezvous comes back (restarted by its supervisor) at a new address with a new key: a mesh "
                "made with recover=mpmd.Recovery() takes it back from the rendezvous; without, make a new mesh "
                "(mpmd.RemoteMesh.from_rendezvous).")


class AttachedDaemon:
    """A daemon started by hand at a known address (`RemoteMesh.connect(..., shutdown_on_close=True)`): as a
    rendezvous daemon, the mesh asks it to shut down when it closes; nothing here to kill or wait for."""

    def __init__(self, actor_id: int, address: str) -> None:
        self.actor_id = actor_id
        self.address = address

    def dead_reason(self) -> str | None:
        return None  # a process started elsewhere: only its connection and heartbeats tell

    def stacks(self) -> str:
        return (f"(not available here: it was started by hand at {self.address}; `kill -USR1 <its pid>` there writes "
                "every thread's stack to its stderr)")

    def stop(self, timeout: float = 3.0) -> None:
        pass


# ---- waiting for arrivals --------------------------------------------------------------------------
class _Waiting:
    """The arrivals so far, each probed once (its endpoint must accept connections: a record left by a killed
    daemon does not), and what to say if some never come."""

    def __init__(self, where: str, num_actors: int) -> None:
        self.where = where
        self.num_actors = num_actors
        self.live: dict[int, Arrival] = {}
        self.dead: dict[int, Arrival] = {}
        self.extra: dict[int, Arrival] = {}
        self.bad: dict[str, str] = {}
        self.refused: list[str] = []
        self.old_failures: dict[int, Failure] = {}
        self.failures: dict[int, tuple[Failure, float]] = {}  # id -> its latest failure, when this wait first saw it
        self.since = time.time()
        self._probed: dict[str, float] = {}  # instance -> when its endpoint last failed to answer

    def failed(self, failure: Failure, now: bool = False) -> None:
        """A daemon could not start: noted, to stop the wait (`check_failures`) if no daemon takes that id soon. One
        from before this wait began (by FAILURE_SKEW: an earlier job's) is only listed at the end; a TCP message is
        `now`, whatever the daemon's clock says."""
        i = failure.actor_id
        if i >= self.num_actors:
            return
        if not now and failure.time < self.since - FAILURE_SKEW:
            self.old_failures[i] = failure
            return
        held = self.failures.get(i)
        if held is None or held[0] != failure:
            self.failures[i] = (failure, time.monotonic() if held is None else held[1])

    def check_failures(self) -> None:
        """`RendezvousError` with a failed daemon's words once no daemon took its id within FAILURE_WAIT of this
        wait seeing the failure (a wait that ends first says them among what it lists: `timed_out`)."""
        now = time.monotonic()
        for i, (failure, seen) in sorted(self.failures.items()):
            if i in self.live:
                continue
            if now - seen >= FAILURE_WAIT:
                raise RendezvousError(f"{failure.describe()}\n  The rendezvous {self.where} stopped waiting: no daemon took actor "
                                      f"{i}'s place within {now - seen:.0f} s. Fix what it says and start that daemon again, "
                                      f"then this controller (of the {self.num_actors} actors, {len(self.live)} had arrived)")

    def offer(self, arrival: Arrival) -> None:
        i = arrival.actor_id
        if i >= self.num_actors:
            self.extra[i] = arrival
            return
        if self.live.get(i) is not None and self.live[i].instance == arrival.instance:
            return
        failed = self._probed.get(arrival.instance)
        if failed is not None and time.monotonic() - failed < REPROBE:
            return
        if endpoint_alive(arrival.endpoint):
            self.live[i] = arrival
            self.dead.pop(i, None)
            if arrival.world_size is not None and arrival.world_size != self.num_actors:
                raise RendezvousError(
                    f"{arrival.describe()} was started as one of {arrival.world_size} tasks (SLURM_NTASKS), but "
                    f"from_rendezvous waits for num_actors={self.num_actors}: make them agree (srun -n {self.num_actors}, "
                    f"or num_actors={arrival.world_size})")
        else:
            self._probed[arrival.instance] = time.monotonic()
            self.live.pop(i, None)
            self.dead[i] = arrival

    def complete(self) -> bool:
        return len(self.live) == self.num_actors

    def arrivals(self) -> list[Arrival]:
        return [self.live[i] for i in range(self.num_actors)]

    def timed_out(self, timeout: float, notes: Sequence[str] = ()) -> RendezvousError:
        missing = [i for i in range(self.num_actors) if i not in self.live]
        arrived = ", ".join(f"{i} on {a.host}" for i, a in sorted(self.live.items())) or "none"
        lines = [f"only {len(self.live)} of {self.num_actors} actors arrived at the rendezvous {self.where} within {timeout:g} s: "
                 f"missing actor{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} (arrived: {arrived}). Each "
                 "daemon announces itself there once it is ready (mpmd-actor --rendezvous ...): look at the missing ones' "
                 "output (srun's, or the pods' logs), or wait longer (timeout=)"]
        for i, a in sorted(self.dead.items()):
            lines.append(f"actor {i}: only the record of a daemon that is gone ({a.describe()}: nothing answers there)")
        for i, a in sorted(self.extra.items()):
            lines.append(f"{a.describe()} arrived too, but num_actors={self.num_actors}")
        for name, why in sorted(self.bad.items()):
            lines.append(f"{name} was not read: {why}")
        for i, failure in sorted(self.old_failures.items()):
            if i not in self.live and i not in self.failures:
                lines.append(f"an earlier daemon's record (before this wait): {failure.describe()}")
        for i, (failure, _) in sorted(self.failures.items()):
            if i not in self.live:
                lines.append(failure.describe())
        lines += [*self.refused, *notes]
        return RendezvousError("\n  ".join(lines))


def gather(where: str | os.PathLike[str], num_actors: int, timeout: float, keys: Any = None, poll: float = 0.2) -> list[Arrival]:
    """The arrivals of actors 0 .. num_actors-1 at `where` (a directory, or ``tcp://HOST:PORT`` to serve),
    each of a daemon that answers at its endpoint; `RendezvousError` naming the missing ones after `timeout`."""
    num_actors = check_count("num_actors", num_actors)
    check_seconds("timeout", timeout)
    if is_tcp(where):
        server = TcpRendezvous(str(where), keys)
        try:
            return server.gather(num_actors, timeout)
        finally:
            server.close()
    try:
        directory = check_directory(where, create=True)
    except RendezvousDirectoryError as e:
        raise RendezvousError(str(e)) from None
    waiting = _Waiting(str(directory), num_actors)
    deadline = time.monotonic() + timeout
    while True:
        found, waiting.bad = read_arrivals(directory)
        for arrival in found.values():
            waiting.offer(arrival)
        for failure in read_failures(directory).values():
            waiting.failed(failure)
        if waiting.complete():
            _warn_extra(waiting)
            return waiting.arrivals()
        if time.monotonic() >= deadline:
            raise waiting.timed_out(timeout)
        waiting.check_failures()
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def _warn_extra(waiting: _Waiting) -> None:
    for a in waiting.extra.values():
        log.warning("%s is at the rendezvous %s too, but this mesh has %d actors: it is not used", a.describe(), waiting.where,
                    waiting.num_actors)


def _pair_of(keys: Any) -> KeyPair:
    if isinstance(keys, ClientKeys):
        return keys.client
    try:
        return KeyPair.load(keys)
    except AuthKeyError as e:
        raise RendezvousError(f"keys={keys!r}: {e}") from None


class TcpRendezvous:
    """The TCP rendezvous this controller serves while it waits: a ROUTER that takes arrivals. With `keys`
    (a key directory or ClientKeys) it is a CURVE server with the controller's pair, admitting only daemons
    that hold that same pair (the job's key); without, anyone who can reach it (daemons started --insecure)."""

    def __init__(self, address: str, keys: Any = None) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.auth: Authenticator | None = None
        try:
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 2000)  # the last welcome still goes out after close
            self.sock.setsockopt(zmq.MAXMSGSIZE, 256 * 1024)
            if keys is not None:
                pair = _pair_of(keys)
                self.auth = Authenticator(self.ctx, f"the rendezvous at {address}", {pair.public: "daemon"})
                self.auth.start()
                configure_server(self.sock, pair)
            bind = address[:-2] + ":*" if address.endswith(":0") else address
            allow_ipv6(self.sock, bind)
            self.sock.bind(bind)
        except BaseException as e:
            self.close()
            if isinstance(e, zmq.ZMQError):
                raise RendezvousError(f"cannot serve the rendezvous at {address}: {bind_failure(address, e)}") from None
            raise
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.closed = False
        self.fatal: RendezvousError | None = None

    def gather(self, num_actors: int, timeout: float) -> list[Arrival]:
        zmq = self._zmq
        waiting = _Waiting(self.address, num_actors)
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        log.info("serving the rendezvous at %s for %d actors", self.address, num_actors)
        while not waiting.complete():
            left = deadline - time.monotonic()
            if left <= 0:
                refused = self.auth.refused if self.auth is not None else 0  # (the daemon's log said why; this did not: a probe)
                raise waiting.timed_out(timeout, [f"{refused} connection(s) were refused at the handshake: a daemon whose "
                                                  "--rendezvous-key (or --authorized-keys pair) is not this job's tried to arrive"]
                                        if refused else [])
            waiting.check_failures()
            if not poller.poll(min(left, 0.5) * 1000):
                continue
            identity, *frames = self.sock.recv_multipart()
            self.sock.send_multipart([identity, self._answer(frames, waiting)])
            if self.fatal is not None:
                raise self.fatal
        _warn_extra(waiting)
        return waiting.arrivals()

    def _answer(self, frames: list[bytes], waiting: _Waiting) -> bytes:
        try:
            if len(frames) != 1:
                raise RendezvousFormatError(f"expected one frame, got {len(frames)}")
            msg = decode_message(frames[0])
            if msg["op"] == "failed":
                failure = Failure.from_dict(msg.get("failure"))
                waiting.failed(failure, now=True)
                log.warning("the rendezvous at %s: %s", self.address, failure.describe())
                return encode_message("noted")
            if msg["op"] != "arrive":
                raise RendezvousFormatError(f"unknown op {msg['op']!r}")
            arrival = Arrival.from_dict(msg.get("arrival"))
        except RendezvousFormatError as e:
            log.warning("the rendezvous at %s got a malformed message: %s", self.address, e)
            return encode_message("refused", error=f"malformed arrival: {e}")
        held = waiting.live.get(arrival.actor_id)
        if held is not None and held.instance != arrival.instance and endpoint_alive(held.endpoint):
            why = str(ClaimedError(held, self.address))
            waiting.refused.append(f"refused {arrival.describe()}: {why}")
            log.warning("the rendezvous refused %s: %s", arrival.describe(), why)
            return encode_message("refused", error=why)
        try:
            waiting.offer(arrival)
        except RendezvousError as e:  # tell the daemon too, then fail the gather
            self.fatal = e
            return encode_message("refused", error=str(e))
        return encode_message("welcome", actor_id=arrival.actor_id)

    def close(self) -> None:
        if getattr(self, "closed", False):
            return
        self.closed = True
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def client_keys(keys: Any, arrivals: Sequence[Arrival]) -> ClientKeys | None:
    """This controller's pair (from `keys`) and each daemon's public key (from its arrival)."""
    keyed = [a.actor_id for a in arrivals if a.key]
    if not keyed:
        if keys is not None:
            raise RendezvousError("the daemons run without keys (started --insecure: their arrivals carry no public key), "
                                  "but keys= was given: start them with --authorized-keys DIR, or pass no keys")
        return None
    if len(keyed) != len(arrivals):
        plain = [a.actor_id for a in arrivals if not a.key]
        raise RendezvousError(f"actors {keyed} authenticate controllers and actors {plain} run --insecure: start all daemons "
                              "the same way")
    if keys is None:
        raise RendezvousError("the daemons admit only controllers whose public key is in their --authorized-keys DIR: pass "
                              "keys=DIR (the directory `mpmd keys generate DIR` made), or a transport.auth.ClientKeys")
    return ClientKeys(_pair_of(keys), tuple(a.key.encode() for a in arrivals if a.key))


@dataclass
class Reannouncement:
    """Replacements from a rendezvous directory: the mesh cannot start a daemon elsewhere, but the cluster's
    supervisor can (SLURM `--requeue`/a restarted task, a Kubernetes pod restarted, a shell loop): a daemon
    that announces itself again under the lost actor's id is the replacement."""

    directory: str
    arrivals: list[Arrival]
    platform: str | None
    owned: bool  # the mesh asks its daemons to shut down at close

    def respawn(self, actor_id: int, timeout: float) -> tuple[str, RendezvousDaemon | None, bytes | None]:
        """Wait up to `timeout` seconds for a new daemon of `actor_id` (another instance than the lost one's, that
        answers at its endpoint, of this JAX and platform); its endpoint, handle and public key."""
        old = self.arrivals[actor_id]
        waiting = _Waiting(self.directory, len(self.arrivals))
        deadline = time.monotonic() + timeout
        while True:
            found, _ = read_arrivals(self.directory)
            a = found.get(actor_id)
            if a is not None and a.instance != old.instance:
                waiting.offer(a)
                if actor_id in waiting.live:
                    check_compatible([facts_of(a)], self.platform)
                    if bool(a.key) != bool(old.key):
                        raise RendezvousError(f"the replacement {a.describe()} {'has' if a.key else 'has no'} keys, unlike the "
                                              "daemon it replaces: start it the same way")
                    self.arrivals[actor_id] = a
                    log.info("actor %d: a replacement announced itself: %s", actor_id, a.describe())
                    return a.endpoint, RendezvousDaemon(a) if self.owned else None, a.key.encode() if a.key else None
            if time.monotonic() >= deadline:
                held = (f". The lost daemon's record still holds the id ({old.describe()}): if that process still exists "
                        "but does not answer (stopped, hung, swapping), a replacement cannot claim the id while it "
                        "accepts connections — kill it (kill -9 its pid on its host) so that the supervisor restarts it"
                        if a is not None and a.instance == old.instance else "")
                raise RendezvousError(f"no new daemon for actor {actor_id} announced itself at the rendezvous {self.directory} "
                                      f"within {timeout:g} s (Recovery(spawn_timeout=...)): the cluster's supervisor must "
                                      f"restart it (srun --requeue, a pod restart, ...) with the same --actor-id{held}")
            time.sleep(0.2)


def connect(cls: Any, where: str | os.PathLike[str], num_actors: int, *, timeout: float = 300.0, keys: Any = None,
            platform: str | None = None, shutdown_on_close: bool = True, recover: Any = None, **kwargs: Any) -> Any:
    """`RemoteMesh.from_rendezvous`: gather, check, connect (see there). With `recover` (a `mpmd.Recovery`; a
    directory rendezvous only), a lost actor is replaced by the next daemon that announces itself under its id."""
    if isinstance(where, Path):
        where = str(where)
    if not isinstance(where, (str, os.PathLike)):  # (None met os's bare "expected str, bytes or os.PathLike"; a probe)
        raise TypeError(f"from_rendezvous: where must be a directory every node sees, or 'tcp://HOST:PORT', got "
                        f"{type(where).__name__} {where!r:.60}")
    if isinstance(where, str) and not where.strip():  # (it waited on the working directory: a probe)
        raise ValueError("from_rendezvous needs where=: a directory every node sees, or tcp://HOST:PORT; got ''")
    wrong = other_scheme(where)
    if wrong:
        raise ValueError(wrong)
    if platform is not None and (not isinstance(platform, str) or not platform.strip()):
        raise ValueError(f"platform must be None (whatever the daemons run on) or a JAX platform name such as 'cpu' or "
                         f"'gpu', got {platform!r:.40}")
    params = inspect.signature(cls).parameters  # (before the wait: a misspelt mesh_shap= waited the whole timeout, then
    # said that no actor arrived; a probe)
    unknown = sorted(n for n in kwargs if n in ("addresses", "processes", "keys") or n not in params)
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise TypeError(f"RemoteMesh.from_rendezvous got unexpected keyword argument(s) {', '.join(unknown)} (checked before "
                        f"the wait); besides its own it takes RemoteMesh's: "
                        f"{', '.join(n for n in params if n not in ('addresses', 'processes', 'keys'))}")
    if not is_tcp(where):
        where = os.path.expanduser(where)  # (a recovery reads the directory again, long after: "~/..." as written)
    if recover is not None and is_tcp(where):
        raise ValueError("recover= needs a rendezvous directory: replacements announced at a tcp:// rendezvous are not "
                         "served after the mesh is made (use a directory every node sees)")
    if recover is not None:  # (before the wait, as the keys: said after the whole timeout, or after the daemons stopped)
        from mpmd.runtime.recovery import check_recovery

        check_recovery(recover)
    if keys is not None:
        _pair_of(keys)
    arrivals = gather(where, num_actors, timeout, keys)
    check_compatible([facts_of(a) for a in arrivals], platform)
    ckeys = client_keys(keys, arrivals)
    owned = [RendezvousDaemon(a) for a in arrivals] if shutdown_on_close else []
    log.info("connecting to %d actors from the rendezvous %s: %s", num_actors, where, ", ".join(a.describe() for a in arrivals))
    # The mesh owns the daemons (stops them as it closes) only once it is made and checked: a mistake of the caller's
    # (mesh_shape the daemons' devices cannot hold, a bad recover=) stopped every daemon and emptied the rendezvous, so
    # that the corrected call waited for daemons that were gone (a probe). Until then a failure ends its session only.
    mesh = cls([a.endpoint for a in arrivals], [], keys=ckeys, **kwargs)
    try:
        wrong = [f"actor {a.actor_id}'s endpoint {a.endpoint} is served by a daemon that says it is actor "
                 f"{info.header.get('actor_id')}" for a, info in zip(arrivals, mesh.infos) if info.header.get("actor_id") != a.actor_id]
        if wrong:
            raise RendezvousError("; ".join(wrong) + ": the rendezvous holds records that do not match their daemons")
        if recover is not None:
            from mpmd.runtime.recovery import enable_recovery

            enable_recovery(mesh, recover, Reannouncement(str(where), list(arrivals), platform, shutdown_on_close).respawn)
    except BaseException:
        mesh.close()
        raise
    mesh.own_daemons(owned)
    shared = [a.actor_id for a, info in zip(arrivals, mesh.infos) if (info.header.get("sessions") or 0) > 1]
    if shared:  # (they stay up when this mesh closes: only its own session goes)
        log.warning("the daemons of actors %s at the rendezvous %s already serve another controller's session (another job "
                    "on this rendezvous directory, or a controller that died and whose session has not expired yet); "
                    "this mesh shares them, and closing it stops them only once that other session closes or expires "
                    "(mpmd-actor --session-timeout). Give each job a directory of its own",
                    shared, where)
    return mesh


__all__ = ["ActorFacts", "Reannouncement", "RendezvousDaemon", "TcpRendezvous", "check_compatible", "client_keys", "connect", "gather"]
