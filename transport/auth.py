"""CURVE keys and ZAP authentication for mpmd's ZeroMQ sockets (control plane and data plane).

Who holds which key:

* A daemon (``mpmd-actor --server-key FILE --authorized-keys DIR``) serves its control socket as a CURVE
  server with the key pair in FILE, and admits only clients whose public key is a ``*.key`` file in DIR.
  The ZAP handler names each admitted client by its key file's name (its "user id"), and the daemon reads
  that name from every message (ZeroMQ's ``User-Id`` property): who sent a request is proven by a key,
  never by a header field.
* A controller (``RemoteMesh.connect(..., keys=...)``) is a CURVE client: its own key pair plus the public
  key of the daemons it dials (`ClientKeys`).
* The data plane between actors always uses CURVE with keys each daemon makes for itself when it starts
  (ephemeral, never written anywhere). The controller, over the authenticated control plane, tells every
  actor its peers' public keys; an actor admits a data-plane connection only from a key it was told, and
  takes the sender's actor id from that key.
* A local mesh (`RemoteMesh.local`) makes ephemeral keys for itself and its daemons and hands them over a
  pipe, so it is authenticated with no user action and no key ever touches the disk.

Key files are those of pyzmq (``zmq.auth``): ``NAME.key`` holds a public key, ``NAME.key_secret`` the
pair. `generate_key_files` writes the secret one readable by its owner only.

Keys are trusted only from safe files — ssh's StrictModes rule (`check_safe_path`): a key file, after
resolving symlinks, and every directory on its path must be owned by this process's user or root and not
be writable by group or others; a secret key file must not be readable by them either; an
``--authorized-keys`` directory must be safe itself. One exception, for directories *above* the file or
directory named: a root-owned directory with the sticky bit (``/tmp``, mode 1777) is accepted, since no one
else can remove or rename what we own in it (OpenSSH refuses even these; tools that keep state in /tmp, and
pytest's tmp_path, need them). Anything else is refused, naming the file, its owner and its mode.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import re
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from transport.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


class AuthKeyError(ValueError):
    """A key file or key is missing, malformed or unsafe."""


def _check_z85_key(key: bytes, what: str) -> bytes:
    if not isinstance(key, bytes) or len(key) != 40:
        raise AuthKeyError(f"{what} is not a CURVE key (40 z85 characters), got {key!r:.60}")
    try:
        z85.decode(key)
    except Exception:
        raise AuthKeyError(f"{what} is not valid z85: {key!r:.60}") from None
    return key


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _stat(path: Path, cannot: str) -> tuple[os.stat_result, int]:
    """`path`'s stat and permission bits; AuthKeyError("<cannot>: <why>") when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise AuthKeyError(f"{cannot}: {e.strerror}") from None
    return st, stat.S_IMODE(st.st_mode)


def make_private(path: Path, mode: int, chmod: str = "chmod go-w") -> str:
    """What to do about `path` that others may write: `chmod` it — unless it is a directory everyone shares (the
    sticky bit: /tmp), which must stay so (a probe: `--authorized-keys /tmp` was told to run `chmod go-w /tmp`)."""
    if mode & stat.S_ISVTX:
        return f"it is a directory every user shares (sticky, like /tmp): use one of your own in it (`mkdir -m 700 {path}/mine`)"
    return f"run `{chmod} {path}`"


def check_safe_path(path: str | os.PathLike[str], what: str, secret: bool = False, holds: str = "a key") -> Path:
    """Raise AuthKeyError unless `path` (a file or directory, symlinks resolved) and every directory above it
    could have been written only by this user or root (see the module docstring); returns the resolved path."""
    given = Path(path).expanduser()
    real = Path(os.path.realpath(given))
    shown = f"{given}" + (f" (-> {real})" if real != given.absolute() else "")
    st, mode = _stat(real, f"cannot read {what} {shown}")
    if not _trusted_owner(st.st_uid):
        raise AuthKeyError(f"{what} {shown} is owned by {_owner(st.st_uid)}, not by you ({_owner(os.geteuid())}) or root, "
                           f"so another user could have put {holds} there; keys are trusted only from your own files "
                           f"(`chown {_owner(os.geteuid()).split()[0]} {real}`, or make new ones with `mpmd keys generate`)")
    if secret and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthKeyError(f"secret key file {shown} can be read by other users (mode {mode:o}, owner {_owner(st.st_uid)}); "
                           f"run `chmod 600 {real}`")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise AuthKeyError(f"{what} {shown} can be written by other users (mode {mode:o}, owner {_owner(st.st_uid)}), so "
                           f"anyone could have put {holds} there; {make_private(real, mode)}")
    for parent in real.parents:
        pst, pmode = _stat(parent, f"cannot check directory {parent} above {what} {shown}")
        if not _trusted_owner(pst.st_uid):
            raise AuthKeyError(f"directory {parent}, above {what} {shown}, is owned by {_owner(pst.st_uid)}, who could "
                               f"replace what is in it; keep {'keys' if holds == 'a key' else 'it'} under directories owned by you or root")
        if pmode & (stat.S_IWGRP | stat.S_IWOTH) and not (pst.st_uid == 0 and pmode & stat.S_ISVTX):
            raise AuthKeyError(f"directory {parent}, above {what} {shown}, can be written by other users (mode {pmode:o}, "
                               f"owner {_owner(pst.st_uid)}), who could replace what is in it; run `chmod go-w {parent}`")
    return real


def make_safe_dir(path: str | os.PathLike[str], what: str, holds: str) -> str:
    """`path` as a directory, made (each missing level mode 700, whatever the umask) where it does not exist yet, once
    it and every directory above it could have been written only by this user or root (`check_safe_path`); else
    what it made is removed again and AuthKeyError (or OSError: it could not be made) says why. Returns the path."""
    given = os.path.expanduser(os.fspath(path))
    missing = []  # the directories to make, outermost first
    p = os.path.abspath(given)
    while not os.path.lexists(p):
        missing.insert(0, p)
        p = os.path.dirname(p)
    made = []
    try:
        for p in missing:  # (os.makedirs gives the ones above the last the umask's mode: 775 under umask 002)
            os.mkdir(p, 0o700)
            made.append(p)
        check_safe_path(given, what, holds=holds)  # (it and every directory above: a sticky /tmp passes)
    except (AuthKeyError, OSError):
        for p in reversed(made):
            try:
                os.rmdir(p)
            except OSError:
                pass
        raise
    return given


_KEY_LINE = re.compile(r'^\s*(public|secret)-key\s*=\s*"([^"]*)"', re.MULTILINE)


def _read_key_file(path: Path, what: str, secret: bool) -> tuple[bytes | None, bytes | None]:
    """(public, secret) keys of a checked key file, read from the file that was checked (fstat on the open file)."""
    real = check_safe_path(path, what, secret)
    try:
        # (O_NONBLOCK: opening a FIFO to read waits for a writer — a FIFO named *.key in --authorized-keys hung the
        # daemon's start, and ClientKeys.load, for good; a probe. A regular file reads as without it.)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise AuthKeyError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthKeyError(f"{what} {path} is not a key file (not a regular file: a device, a FIFO, ...); key files "
                               "are the ones `mpmd keys generate DIR` writes")
        if not _trusted_owner(st.st_uid) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or (
                secret and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)):
            raise AuthKeyError(f"{what} {path} changed while it was checked (owner {_owner(st.st_uid)}, mode "
                               f"{stat.S_IMODE(st.st_mode):o}); check who else writes there")
        text = os.read(fd, 1 << 16).decode("utf-8", errors="replace")
    finally:
        os.close(fd)
    found = {k: v.encode() for k, v in _KEY_LINE.findall(text)}
    return found.get("public"), found.get("secret")


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as z85 text (40 bytes each); `secret` is None for a public key alone."""

    public: bytes
    secret: bytes | None = None

    def __post_init__(self) -> None:
        _check_z85_key(self.public, "public key")
        if self.secret is not None:
            _check_z85_key(self.secret, "secret key")

    def __repr__(self) -> str:  # never print a secret key
        return f"KeyPair(public={self.public.decode()!r}{', secret=...' if self.secret else ''})"

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyPair:
        """A key pair from a ``*.key_secret`` file, or from a directory: its one, or ``mpmd.key_secret`` among several."""
        p = Path(path).expanduser()
        if p.is_dir():
            check_safe_path(p, "key directory")
            secrets_ = sorted(p.glob(f"*{SECRET_SUFFIX}"))
            if not secrets_:
                raise AuthKeyError(f"{p} holds no secret key file (*{SECRET_SUFFIX}); make one with `mpmd keys generate {p}`, "
                                   "or name the key file")
            default = p / f"{DEFAULT_KEY_NAME}{SECRET_SUFFIX}"
            if len(secrets_) > 1 and default in secrets_:
                # the directory's own pair (`mpmd keys generate DIR`); the others beside it (`--name alice`) are other
                # identities, used by naming their file (a probe: one more pair made keys=DIR ambiguous)
                secrets_ = [default]
            if len(secrets_) > 1:
                raise AuthKeyError(f"{p} holds {len(secrets_)} secret key files ({[s.name for s in secrets_]}), so which one "
                                   f"to use is ambiguous; name the file, e.g. keys='{secrets_[0]}'")
            p = secrets_[0]
        if not p.is_file():
            raise AuthKeyError(f"no key file at {p} (make one with `mpmd keys generate DIR`)" if not p.exists() else
                               f"{p} is not a key file (not a regular file: a device, a FIFO, ...); name the *{SECRET_SUFFIX} "
                               "file `mpmd keys generate DIR` made")
        try:
            public, secret = _read_key_file(p, "secret key file", secret=True)
        except AuthKeyError as refused:  # a public key file given here (readable by all, as it should be) is a mistake
            try:  # of its own, and so is a file that holds no key at all (`--server-key /etc/passwd` was told to
                held = _read_key_file(p, "key file", secret=False)  # `chmod 600 /etc/passwd`; a probe)
            except AuthKeyError:
                raise refused from None
            if held == (None, None):
                raise AuthKeyError(f"{p} is not a key file: it holds no public-key or secret-key line; name the "
                                   f"*{SECRET_SUFFIX} file `mpmd keys generate DIR` made") from None
            if held[0] is None or held[1] is not None:
                raise refused from None
            public, secret = b"", None
        if secret is None and public is not None:
            pair = p.with_name(p.name[: -len(PUBLIC_SUFFIX)] + SECRET_SUFFIX) if p.name.endswith(PUBLIC_SUFFIX) else None
            hint = f" (here: {pair})" if pair is not None and pair.exists() else ""
            raise AuthKeyError(f"{p} holds only a public key; pass the *{SECRET_SUFFIX} file that holds the pair{hint}, or the "
                               "directory that holds it")
        if public is None:
            raise AuthKeyError(f"cannot read key file {p}: it holds no public-key line (make one with `mpmd keys generate DIR`)")
        return cls(public, secret)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The public key in a ``*.key`` (or ``*.key_secret``) file, if the file is safe (`check_safe_path`)."""
    public, _ = _read_key_file(Path(path).expanduser(), "public key file", secret=False)
    if public is None:
        raise AuthKeyError(f"cannot read public key file {path}: it holds no public-key line")
    return _check_z85_key(public, f"public key in {path}")


def load_authorized_keys(directory: str | os.PathLike[str]) -> dict[bytes, str]:
    """{public key: name} for every ``NAME.key`` file in `directory` (the clients a daemon admits)."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise AuthKeyError(f"--authorized-keys {d} is not a directory of *{PUBLIC_SUFFIX} files")
    check_safe_path(d, "authorized-keys directory")  # (itself: no sticky-bit exception, anyone could add a key)
    keys = {load_public_key(f): f.name[: -len(PUBLIC_SUFFIX)] for f in sorted(d.glob(f"*{PUBLIC_SUFFIX}"))}
    if not keys:
        raise AuthKeyError(f"{d} holds no *{PUBLIC_SUFFIX} files, so no controller could connect; copy the controller's "
                           f"public key there (`mpmd keys generate DIR` writes one)")
    return keys


DEFAULT_KEY_NAME = "mpmd"  # `mpmd keys generate DIR` writes DIR/mpmd.key and DIR/mpmd.key_secret


def generate_key_files(directory: str | os.PathLike[str], name: str = DEFAULT_KEY_NAME, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new key pair as ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (mode 600). Returns both paths."""
    if not name or "/" in name or name.startswith("."):
        raise AuthKeyError(f"key name {name!r} must be a plain file name")
    d = Path(directory).expanduser()
    made = [p for p in (d, *d.parents) if not p.exists()]
    d.mkdir(parents=True, exist_ok=True)
    for p in reversed(made):  # (never writable by others whatever the umask: under umask 000 it was 777, which every
        os.chmod(p, stat.S_IMODE(p.stat().st_mode) & ~0o022)  # daemon then refused; a stricter umask's 700 stays)
    public_path, secret_path = d / f"{name}{PUBLIC_SUFFIX}", d / f"{name}{SECRET_SUFFIX}"
    for p in (public_path, secret_path):  # (before either is written: no pair is left half new)
        if p.is_symlink():
            raise AuthKeyError(f"{p} is a symbolic link (to {os.readlink(p)}); a key file is written only as a file of its own "
                               "(--force wrote the secret key into the link's target): remove the link, or pick another directory")
    if not overwrite:
        for p in (public_path, secret_path):
            if p.exists():
                raise AuthKeyError(f"{p} exists; pick another name or directory, or overwrite it on purpose (`mpmd keys generate --force`; overwrite=True)")
    pair = KeyPair.generate()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    body = f'metadata\ncurve\n    public-key = "{pair.public.decode()}"\n'
    _write(public_path, f"#   ZeroMQ CURVE public key, made by mpmd on {stamp}\n\n{body}", 0o644, overwrite)
    assert pair.secret is not None
    _write(secret_path, f"#   ZeroMQ CURVE **secret** key, made by mpmd on {stamp}: do not share it\n\n{body}"
                        f'    secret-key = "{pair.secret.decode()}"\n', 0o600, overwrite)
    return public_path, secret_path


def _write(path: Path, text: str, mode: int, overwrite: bool) -> None:
    """Write a key file, never through a symbolic link (overwriting one wrote the secret key into its target)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if overwrite else os.O_EXCL)
    fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ClientKeys:
    """What a controller needs to reach authenticated daemons: its own key pair and the daemons' public
    key (one for all of them, or one per actor)."""

    client: KeyPair
    servers: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if self.client.secret is None:
            raise AuthKeyError("a controller needs its secret key too (a *.key_secret file)")
        if not self.servers:
            raise AuthKeyError("ClientKeys needs the daemons' public key")
        for i, k in enumerate(self.servers):
            _check_z85_key(k, f"server key {i}")

    def __repr__(self) -> str:
        return f"ClientKeys(client={self.client!r}, servers={[s.decode() for s in self.servers]})"

    def server_key(self, actor: int) -> bytes:
        if len(self.servers) == 1:
            return self.servers[0]
        if not 0 <= actor < len(self.servers):
            raise AuthKeyError(f"no server key for actor {actor}: {len(self.servers)} given")
        return self.servers[actor]

    @classmethod
    def of(cls, keys: Any) -> ClientKeys:
        """Accept a ClientKeys, a ``*.key_secret`` file or a directory with one: with a path, the same pair is
        the controller's key and the daemons' key (``mpmd keys generate DIR`` once, the same DIR everywhere)."""
        if isinstance(keys, ClientKeys):
            return keys
        if isinstance(keys, (str, os.PathLike)):
            pair = KeyPair.load(keys)
            return cls(pair, (pair.public,))
        raise TypeError(f"keys must be a ClientKeys or the path of a key directory or *.key_secret file, got {type(keys).__name__}")

    @classmethod
    def load(cls, client: str | os.PathLike[str], servers: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> ClientKeys:
        """The controller's pair from `client` (a *.key_secret file or a directory with one) and the daemons'
        public key(s) from `servers` (*.key files: one for all actors, or one per actor)."""
        paths = [servers] if isinstance(servers, (str, os.PathLike)) else list(servers)
        return cls(KeyPair.load(client), tuple(load_public_key(p) for p in paths))


def configure_server(sock: zmq.Socket, pair: KeyPair) -> None:
    """Make `sock` a CURVE server with `pair` (call before bind). Clients are then vetted by the context's ZAP handler."""
    assert pair.secret is not None
    sock.curve_server = True
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public


def configure_client(sock: zmq.Socket, pair: KeyPair, server_public: bytes) -> None:
    """Make `sock` a CURVE client of the server whose public key is `server_public` (call before connect)."""
    assert pair.secret is not None
    sock.curve_publickey = pair.public
    sock.curve_secretkey = pair.secret
    sock.curve_serverkey = server_public


def user_id(frame: Any) -> str | None:
    """The ZAP user id of the connection a received frame came over (None: not authenticated)."""
    try:
        value = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return value or None


class Authenticator(ThreadAuthenticator):
    """The ZAP handler of one ZeroMQ context: admits a CURVE client only if its public key is one it was given,
    and names the connection by that key's user id. Runs in its own thread, so a busy event loop does not
    stall handshakes. Refusals are logged, rate-limited."""

    def __init__(self, context: zmq.Context, what: str, keys: Mapping[bytes, str] | None = None) -> None:
        super().__init__(context, log=logging.getLogger("zmq.auth"))
        self.what = what
        self._keys: dict[bytes, str] = dict(keys or {})
        self._lock = threading.Lock()
        self._address = ""
        self.refused = 0
        self._warn = RateLimitedLog(log, interval=10.0, burst=3)

    def start(self) -> None:
        super().start()
        self.configure_curve_callback("*", self)

    def admit(self, keys: Mapping[bytes, str]) -> None:
        """Also admit these {public key: user id}; a key given again gets its new user id."""
        with self._lock:
            self._keys.update(keys)

    def revoke(self, user: str) -> None:
        with self._lock:
            self._keys = {k: u for k, u in self._keys.items() if u != user}

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        with self._lock:
            ok = key in self._keys
        if not ok:
            self.refused += 1
            self._warn.warning("refused", "%s: refused a connection from %s with an unknown CURVE key %s",
                               self.what, self._address or "?", key.decode(errors="replace"))
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        with self._lock:
            return self._keys.get(z85.encode(client_public_key), "")


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint can be reached only from this machine (ipc, inproc, loopback tcp)."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if ";" in host:  # "tcp://source;dest": what is bound is the part after ';'
        host = host.split(";", 1)[1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or a host name: reachable from outside as far as we can tell


__all__ = ["AuthKeyError", "Authenticator", "ClientKeys", "KeyPair", "check_safe_path", "configure_client", "configure_server",
           "generate_key_files", "is_loopback", "load_authorized_keys", "load_public_key", "user_id"]
