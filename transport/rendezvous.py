"""The rendezvous: how a daemon that a cluster's scheduler started (SLURM, Kubernetes, a shell loop) tells
the controller where it is, so that nobody types an address list.

A daemon publishes one *arrival* once its sockets are bound: its actor id, control endpoint, the public key
of its control socket, and what the controller must check before driving it (JAX version, platform, device
count, protocol version). Arrivals hold public data only; never a secret. Both sides import this module:
it is the one codec of the record, of the file layout and of the TCP rendezvous messages.

**File rendezvous** (a directory on a file system every node sees: a shared home or scratch)::

    DIR/actor-<id>.json        one arrival per actor id, written whole (a temporary file, then a hard link)

The directory must belong to the user and be writable by nobody else (`check_directory`, as ssh checks
``~/.ssh``): whoever can write there could announce a daemon of theirs as one of ours. A daemon claims its id
with a hard link, which fails if the name exists (atomic on local file systems and NFS); it then looks at
the holder: one whose endpoint still accepts connections is a live daemon (the newcomer is refused, naming
it), one whose endpoint is dead is a leftover of a killed daemon and is replaced. A daemon removes its own
arrival when it exits (`withdraw`).

**TCP rendezvous** (served by the controller: Kubernetes, or no shared file system): a ZeroMQ ROUTER that
the controller binds as a CURVE server; a daemon dials it as a CURVE client and sends its arrival. Both
hold the job's key pair (``mpmd keys generate DIR``), so neither side can be impersonated on the network.

| from       | message (msgpack map)                             | meaning                                        |
|------------|---------------------------------------------------|------------------------------------------------|
| daemon     | ``{"v": 1, "op": "arrive", "arrival": {...}}``    | here I am (the arrival as in the file)         |
| controller | ``{"v": 1, "op": "welcome", "actor_id": id}``     | taken                                          |
| controller | ``{"v": 1, "op": "refused", "error": text}``      | not taken (e.g. the id is held by a live daemon); |
|            |                                                   | the daemon exits with that text                |
| daemon     | ``{"v": 1, "op": "failed", "failure": {...}}``    | I could not start (the failure as in the file) |
| controller | ``{"v": 1, "op": "noted"}``                       | read                                           |

**A daemon that cannot start** (no devices for its ``--platform``, its port taken, a loader it cannot import) once
it knows its rendezvous says so there before it exits — ``DIR/failed-<id>.json`` or the ``failed`` message — so that
the controller stops waiting soon and shows the daemon's own words, rather than its whole timeout and then
"missing actor N" (a probe): once no daemon has taken that id within `FAILURE_WAIT` of the controller seeing the
failure (a supervisor's restart, or a job run again in the same directory, whose daemon's claim removes the record,
is taken instead). A record from before the wait began (by more than `FAILURE_SKEW`) is an earlier job's: it is only
listed if the wait times out.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import msgpack

from transport.auth import AuthKeyError, check_safe_path, make_private
from transport.protocol import PROTOCOL_VERSION

RENDEZVOUS_VERSION = 1
MAX_ARRIVAL_BYTES = 64 * 1024
_REQUIRED = ("actor_id", "endpoint", "key", "host", "pid", "jax_version", "platform", "devices")


class RendezvousFormatError(ValueError):
    """An arrival record or rendezvous message is malformed."""


class RendezvousDirectoryError(ValueError):
    """The rendezvous directory cannot be used safely (not ours, writable by others, not a directory)."""


class ClaimedError(RuntimeError):
    """Another live daemon holds this actor id."""

    def __init__(self, holder: Arrival, where: str) -> None:
        self.holder = holder
        super().__init__(f"actor id {holder.actor_id} is already held by a live daemon: {holder.describe()}, "
                         f"registered at {where} {time.strftime('%H:%M:%S', time.localtime(holder.started))}. Two daemons "
                         f"were given the same id: give each its own (--actor-id, or one SLURM task each), or stop that daemon")


@dataclass(frozen=True)
class Arrival:
    """What a daemon tells the rendezvous about itself."""

    actor_id: int
    endpoint: str  # the control endpoint the controller dials
    key: str | None  # z85 public key of the control socket (None: a daemon started --insecure)
    host: str  # its hostname
    pid: int
    jax_version: str
    platform: str  # jax.devices()[0].platform
    devices: int
    p2p: str | None = None  # its data-plane endpoint (informational: the controller learns it from `hello`)
    world_size: int | None = None  # how many actors its launcher started (SLURM_NTASKS), when it knows
    job: str | None = None  # its launcher's job id (SLURM_JOB_ID), when it has one
    protocol: int = PROTOCOL_VERSION
    started: float = 0.0  # time.time() of the arrival
    instance: str = ""  # random: tells this daemon's arrival from an earlier one of the same id

    def __post_init__(self) -> None:
        ints = {"actor_id": self.actor_id, "pid": self.pid, "devices": self.devices, "protocol": self.protocol}
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RendezvousFormatError(f"arrival field {name} must be a non-negative integer, got {value!r}")
        for name in ("endpoint", "host", "jax_version", "platform"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RendezvousFormatError(f"arrival field {name} must be a non-empty string, got {getattr(self, name)!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://")):
            raise RendezvousFormatError(f"arrival endpoint must be tcp://HOST:PORT or ipc://PATH, got {self.endpoint!r}")
        for name in ("key", "p2p", "job", "instance"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise RendezvousFormatError(f"arrival field {name} must be a string, got {value!r}")
        if self.key is not None and len(self.key) != 40:
            raise RendezvousFormatError(f"arrival key must be a z85 CURVE public key (40 characters), got {self.key!r:.60}")
        if self.world_size is not None and (not isinstance(self.world_size, int) or self.world_size < 1):
            raise RendezvousFormatError(f"arrival world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.started, (int, float)):
            raise RendezvousFormatError(f"arrival started must be a time, got {self.started!r}")

    @classmethod
    def new(cls, **kw: Any) -> Arrival:
        """An arrival stamped now, with a fresh instance token."""
        return cls(**kw, started=time.time(), instance=secrets.token_hex(8))

    def describe(self) -> str:
        return f"actor {self.actor_id} on {self.host} (pid {self.pid}, {self.endpoint})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Arrival:
        if not isinstance(d, dict):
            raise RendezvousFormatError(f"an arrival is a map, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        missing = [name for name in _REQUIRED if name not in d]
        if missing:
            raise RendezvousFormatError(f"arrival lacks {missing}")
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:
            raise RendezvousFormatError(f"bad arrival: {e}") from None

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> Arrival:
        if len(data) > MAX_ARRIVAL_BYTES:
            raise RendezvousFormatError(f"an arrival of {len(data)} bytes (the limit is {MAX_ARRIVAL_BYTES})")
        try:
            return cls.from_dict(json.loads(data))
        except (ValueError, UnicodeDecodeError) as e:
            if isinstance(e, RendezvousFormatError):
                raise
            raise RendezvousFormatError(f"not JSON: {e}") from None


FAILURE_WAIT = 30.0  # s the controller waits, after it sees a daemon's failure, for another daemon to take that id
FAILURE_SKEW = 10.0  # s: a failure record from longer than this before the controller began waiting is an earlier job's


@dataclass(frozen=True)
class Failure:
    """What a daemon that could not start tells the rendezvous: its id, where it ran, and its own message."""

    actor_id: int
    host: str
    pid: int
    error: str
    time: float  # time.time() of the failure

    def __post_init__(self) -> None:
        for name in ("actor_id", "pid"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RendezvousFormatError(f"failure field {name} must be a non-negative integer, got {value!r}")
        for name in ("host", "error"):
            if not isinstance(getattr(self, name), str):
                raise RendezvousFormatError(f"failure field {name} must be a string, got {getattr(self, name)!r:.60}")
        if not isinstance(self.time, (int, float)) or isinstance(self.time, bool) or not 0 <= self.time < 2**40:
            # (NaN, inf or 1e20 passed, and describe()'s localtime raised from inside the controller's wait; a review)
            raise RendezvousFormatError(f"failure time must be a time (seconds since 1970), got {self.time!r:.40}")

    @classmethod
    def new(cls, actor_id: int, error: str) -> Failure:
        return cls(actor_id=actor_id, host=socket.gethostname(), pid=os.getpid(), error=error[:4000], time=time.time())

    def describe(self) -> str:
        return (f"actor {self.actor_id} could not start (pid {self.pid} on {self.host}, "
                f"{time.strftime('%H:%M:%S', time.localtime(self.time))}): {self.error}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Failure:
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise RendezvousFormatError(f"a failure is a map of {sorted(f.name for f in fields(cls))}, got {d!r:.100}")
        return cls(**d)


# ---- the TCP rendezvous messages ------------------------------------------------------------------
def encode_message(op: str, **body: Any) -> bytes:
    return msgpack.packb({"v": RENDEZVOUS_VERSION, "op": op, **body}, use_bin_type=True)


def decode_message(frame: bytes) -> dict[str, Any]:
    """A rendezvous message as a map with "op"; raises RendezvousFormatError on anything else."""
    if len(frame) > MAX_ARRIVAL_BYTES:
        raise RendezvousFormatError(f"a rendezvous message of {len(frame)} bytes (the limit is {MAX_ARRIVAL_BYTES})")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types; none of them may escape as anything else
        raise RendezvousFormatError(f"not a msgpack message: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise RendezvousFormatError("a rendezvous message is a map with an 'op'")
    if msg.get("v") != RENDEZVOUS_VERSION:
        raise RendezvousFormatError(f"rendezvous version {msg.get('v')!r} (expected {RENDEZVOUS_VERSION}): "
                                    "the daemon and the controller run different mpmd versions")
    return msg


# ---- the file rendezvous ---------------------------------------------------------------------------
def is_tcp(where: str | os.PathLike[str]) -> bool:
    """Whether a rendezvous is a TCP one (``tcp://HOST:PORT``) rather than a directory."""
    return isinstance(where, str) and where.startswith("tcp://")


def other_scheme(where: Any) -> str | None:
    """Why `where` is no rendezvous when it reads as a URL of another scheme (http://, TCP://), else None: taken
    as a directory, "http://h:1" made ./http:/h:1 and was waited on for the whole timeout (a probe)."""
    if isinstance(where, str) and "://" in where and not is_tcp(where) and where.split("://", 1)[0].replace("+", "").isalnum():
        return (f"a rendezvous is a directory every node sees or tcp://HOST:PORT (lowercase), got {where!r:.80}")
    return None


def arrival_path(directory: str | os.PathLike[str], actor_id: int) -> Path:
    return Path(directory) / f"actor-{actor_id}.json"


def check_directory(directory: str | os.PathLike[str], create: bool = True) -> Path:
    """The rendezvous directory, made (mode 700) if missing and `create`; refuses one that is not a directory,
    not owned by this user, or writable by group or others."""
    d = Path(directory).expanduser()
    if create:
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise RendezvousDirectoryError(f"cannot make the rendezvous directory {d}: {e}") from None
    try:
        st = d.stat()
    except OSError as e:
        raise RendezvousDirectoryError(f"rendezvous directory {d}: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RendezvousDirectoryError(f"rendezvous {d} is not a directory")
    if st.st_uid != os.getuid():
        raise RendezvousDirectoryError(f"rendezvous directory {d} belongs to uid {st.st_uid}, not to this user "
                                       f"(uid {os.getuid()}): use a directory of your own, e.g. under $HOME")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RendezvousDirectoryError(f"rendezvous directory {d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), "
                                       f"who could announce a daemon of theirs as one of this job's: "
                                       + make_private(d, st.st_mode, "chmod 700"))
    try:  # (and every directory above it, as ssh checks ~/.ssh: under a directory others may write, the whole directory
        # could be swapped for another job's, a symlink to it say, and this job would take that job's daemons; a probe)
        check_safe_path(d, "rendezvous directory", holds="another job's rendezvous directory")
    except AuthKeyError as e:
        raise RendezvousDirectoryError(str(e)) from None
    return d


def failure_path(directory: str | os.PathLike[str], actor_id: int) -> Path:
    return Path(directory) / f"failed-{actor_id}.json"


def record_failure(directory: str | os.PathLike[str], failure: Failure) -> None:
    """Write `failure` as its id's failure record (replacing an earlier one), whole: a temporary file, then a rename."""
    d = Path(directory)
    tmp = d / f".failed-{failure.actor_id}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, json.dumps(failure.to_dict(), sort_keys=True).encode() + b"\n")
    finally:
        os.close(fd)
    try:
        os.replace(tmp, failure_path(d, failure.actor_id))
    except OSError:
        os.unlink(tmp)
        raise


def read_failures(directory: str | os.PathLike[str]) -> dict[int, Failure]:
    """Every readable failure record in `directory` (one another user wrote, or not a regular file, is passed over)."""
    found: dict[int, Failure] = {}
    with os.scandir(directory) as entries:
        names = sorted(e.name for e in entries if e.name.startswith("failed-") and e.name.endswith(".json"))
    for name in names:
        try:
            failure = Failure.from_dict(json.loads(_read_own_file(Path(directory) / name)))
        except (OSError, ValueError, UnicodeDecodeError):  # (RendezvousFormatError is a ValueError)
            continue
        if name == failure_path("", failure.actor_id).name:
            found[failure.actor_id] = failure
    return found


def clear_failure(directory: str | os.PathLike[str], actor_id: int) -> None:
    try:
        os.unlink(failure_path(directory, actor_id))
    except OSError:
        pass


def _read_own_file(path: Path) -> bytes:
    """A regular file of this user's, at most MAX_ARRIVAL_BYTES + 1 of it, opened without blocking or following a
    symlink (a FIFO under an arrival's name held the controller and the daemon past every timeout; a probe)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RendezvousFormatError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): remove it")
        if st.st_uid != os.getuid():
            raise RendezvousFormatError(f"{path} was written by uid {st.st_uid}, not this user")
        return os.read(fd, MAX_ARRIVAL_BYTES + 1)
    finally:
        os.close(fd)


def read_arrival(path: Path) -> Arrival:
    """One arrival file; refuses one written by another user, or anything but a regular file (see _read_own_file)."""
    return Arrival.from_json(_read_own_file(path))


def read_arrivals(directory: str | os.PathLike[str]) -> tuple[dict[int, Arrival], dict[str, str]]:
    """Every arrival in `directory`: ({actor id: arrival}, {file name: why it was not read})."""
    found: dict[int, Arrival] = {}
    bad: dict[str, str] = {}
    with os.scandir(directory) as entries:
        names = sorted(e.name for e in entries if e.name.startswith("actor-") and e.name.endswith(".json"))
    for name in names:
        try:
            arrival = read_arrival(Path(directory) / name)
        except FileNotFoundError:
            continue  # withdrawn meanwhile
        except (OSError, RendezvousFormatError) as e:
            bad[name] = str(e)
            continue
        if name != f"actor-{arrival.actor_id}.json":
            bad[name] = f"it announces actor {arrival.actor_id}"
            continue
        found[arrival.actor_id] = arrival
    return found, bad


def claim(directory: str | os.PathLike[str], arrival: Arrival, probe_timeout: float = 1.0) -> bool:
    """Publish `arrival` as the holder of its actor id. Raises `ClaimedError` when a live daemon holds the
    id; replaces the arrival of a dead one (returns True then: the caller may say so)."""
    d = Path(directory)
    final = arrival_path(d, arrival.actor_id)
    tmp = d / f".actor-{arrival.actor_id}.{arrival.instance}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, arrival.to_json())
        os.fsync(fd)
    finally:
        os.close(fd)
    replaced = False
    try:
        for _ in range(2):
            try:
                os.link(tmp, final)  # fails if the name exists: the claim is exclusive
                clear_failure(d, arrival.actor_id)  # (an earlier daemon's of this id: this one started)
                return replaced
            except FileExistsError:
                pass
            try:
                st = os.stat(final)
                holder = read_arrival(final)
            except FileNotFoundError:
                continue  # withdrawn meanwhile: try again
            except (OSError, RendezvousFormatError):
                holder = None  # a torn or foreign file: not a live daemon's
            # (A holder on our host at our own endpoint is a predecessor: we listen there now — a daemon restarted at
            # a fixed address, as a StatefulSet pod is, keeps its hostname — so a probe would only reach ourselves.)
            predecessor = holder is not None and holder.endpoint == arrival.endpoint and holder.host == arrival.host
            if holder is not None and not predecessor and endpoint_alive(holder.endpoint, probe_timeout):
                raise ClaimedError(holder, str(d))
            try:
                if os.stat(final).st_ino == st.st_ino:  # still the dead one (not a fresh claim made meanwhile)
                    os.unlink(final)
                    replaced = True
            except FileNotFoundError:
                pass
        try:
            holder = read_arrival(final)
        except (OSError, RendezvousFormatError) as e:
            raise RendezvousFormatError(f"could not claim {final}: another daemon keeps replacing it ({e})") from None
        raise ClaimedError(holder, str(d))
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def withdraw(directory: str | os.PathLike[str], arrival: Arrival) -> bool:
    """Remove `arrival` from the directory if it is still there as ours (a later daemon's is left alone)."""
    path = arrival_path(directory, arrival.actor_id)
    try:
        if read_arrival(path).instance != arrival.instance:
            return False
        os.unlink(path)
        return True
    except (OSError, RendezvousFormatError):
        return False


def process_running(pid: int) -> bool:
    """Whether process `pid` of this host exists and has not exited (a zombie has; another user's counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def endpoint_alive(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections at a ZeroMQ tcp:// or ipc:// endpoint (a plain connect, then close)."""
    try:
        if endpoint.startswith("ipc://"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = endpoint[len("ipc://") :]
        elif endpoint.startswith("tcp://"):
            host, port = endpoint[len("tcp://") :].rsplit(":", 1)
            host = host.strip("[]")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            target = (host, int(port))
        else:
            return False
    except (ValueError, OSError):
        return False
    s.settimeout(timeout)
    try:
        s.connect(target)
        return True
    except OSError:  # refused, no such socket, unreachable, timed out: nobody serves there now
        return False
    finally:
        s.close()


__all__ = ["Arrival", "ClaimedError", "RENDEZVOUS_VERSION", "RendezvousDirectoryError", "RendezvousFormatError", "arrival_path",
           "check_directory", "claim", "decode_message", "encode_message", "endpoint_alive", "is_tcp", "other_scheme", "read_arrival",
           "read_arrivals", "withdraw"]
