"""Same-host links: data-plane messages between two actors on one host without ZeroMQ's I/O threads.

A ZeroMQ message from one actor to another is handed to the sender's I/O thread, encrypted, written, read by
the receiver's I/O thread, decrypted and signalled to the receiver's loop: two extra threads per hop, and on a
core that also runs the sender's next computation the sender's I/O thread waits behind it (a hop took over
1 ms that way). A link is a Unix SEQPACKET connection instead: the sending thread's `sendmsg` puts the whole
message in the receiver's socket and wakes the receiver's event loop directly.

Who is on the other end is the kernel's word, not a key: every actor listens on an abstract-namespace name
(Linux; nothing in the file system), and both ends check the other's credentials (`SO_PEERCRED`: process id
and user) against the process id the controller announced for that peer over the authenticated control
plane. Bytes on a link never leave the kernel, so they need no encryption — the same reasoning as the shared
memory segments, which only this user's processes can map (see shm.py). Messages too big for one record,
or to a peer without a link, go over ZeroMQ as before.

A record is ``<u32 header length> <header> <payload bytes>`` (one array at most). The header is msgpack (see
protocol.py), except for the one message every hop sends: a ``data`` message's header may be compact — its first
byte 0xC1 (a byte msgpack never uses), then the protocol version, the dtype's index in COMPACT_DTYPES,
the key's length and the rank, then the key and the shape as little-endian int64s (`pack_data` and `parse_data`;
packing and parsing it cost ~1 us against ~9 us for the msgpack map).
"""

from __future__ import annotations

import collections
import os
import secrets
import socket
import struct
import sys
import threading
from typing import Any

import numpy as np

from transport.protocol import ALLOWED_DTYPES, MAX_BYTES, MAX_DIMS, PROTOCOL_VERSION, ProtocolError

MAX_RECORD = 1 << 17  # bytes of one message (header + payload); bigger ones travel over ZeroMQ
SEND_BUFFER = 1 << 20  # asked of the kernel per link (it may give less: net.core.wmem_max)
_LEN = struct.Struct("<I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
COMPACT = 0xC1  # first byte of a compact data header ("never used" in msgpack, so no msgpack header starts with it)
_COMPACT_HEAD = struct.Struct("<5B")  # 0xC1, protocol version, dtype index, key length, rank
# A compact header's dtype is its index here: part of the wire format (a change needs a new PROTOCOL_VERSION).
COMPACT_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
                  "float64", "complex64", "complex128", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3", "float8_e3m4",
                  "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4",
                  "int2", "uint2")  # (numbered for good: one this ml_dtypes lacks keeps its number, unused)
_DTYPES = [ALLOWED_DTYPES.get(name) for name in COMPACT_DTYPES]
_DTYPE_INDEX = {dt: i for i, dt in enumerate(_DTYPES) if dt is not None}
_INTS: dict[int, struct.Struct] = {}  # count -> Struct of that many int64s


def available() -> bool:
    """Links need Linux (abstract Unix socket names, SEQPACKET); MPMD_LINKS=0 in an actor's environment turns
    them off (every message then goes over ZeroMQ, as across hosts)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SOCK_SEQPACKET") and os.environ.get("MPMD_LINKS", "1") != "0"


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket, as the kernel recorded them."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


class LinkError(OSError):
    """A link could not be made or used; the caller falls back to ZeroMQ."""


class Listener:
    """Where peers on this host dial this actor's links: an abstract Unix name, random per process."""

    def __init__(self, actor_id: int) -> None:
        self.name = f"mpmd-link-{os.getpid()}-{secrets.token_hex(8)}-{actor_id}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.bind("\0" + self.name)
            self.sock.listen(128)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, int, int] | None:
        """A new connection with its peer's (pid, uid), or None if none is waiting."""
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        pid, uid = peer_credentials(conn)
        return conn, pid, uid

    def close(self) -> None:
        self.sock.close()


class Link:
    """One connected link (either end). `post` may be called from any thread; reading is the owner's loop's."""

    def __init__(self, sock: socket.socket, loop: Any) -> None:
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        except OSError:
            pass
        self.sock = sock
        self.loop = loop
        self.closed = False
        self._lock = threading.Lock()
        self._backlog: collections.deque[list[Any]] = collections.deque()  # messages the socket had no room for
        self._writing = False

    @classmethod
    def dial(cls, name: str, expect_pid: int, loop: Any) -> Link:
        """Connect to the listener `name`, which must be process `expect_pid` of this user."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect("\0" + name)
            pid, uid = peer_credentials(sock)
            if pid != expect_pid or uid != os.getuid():
                raise LinkError(f"link {name} is served by process {pid} of user {uid}, not by process {expect_pid} of "
                                f"user {os.getuid()}")
        except OSError as e:
            sock.close()
            raise LinkError(f"could not dial link {name}: {e}") from None
        return cls(sock, loop)

    def fileno(self) -> int:
        return self.sock.fileno()

    def post(self, frames: list[Any]) -> bool:
        """Send one message (`frames`: the msgpack header, then at most one payload) as one record. False, with
        nothing sent, when it is too big for a record; LinkError when the link is broken."""
        if len(frames) > 2:
            return False
        size = _LEN.size + sum(memoryview(f).nbytes for f in frames)
        if size > MAX_RECORD:
            return False
        record = [_LEN.pack(len(frames[0])), *frames]
        with self._lock:
            if self.closed:
                raise LinkError("the link is closed")
            if not self._backlog:
                try:
                    self.sock.sendmsg(record)
                    return True
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError as e:
                    raise LinkError(str(e)) from None
            # No room now: keep a copy (the caller may reuse its buffers) and let the loop send it when there is.
            self._backlog.append([bytes(f) for f in record])
            if not self._writing:
                self._writing = True
                self.loop.call_soon_threadsafe(self._arm)
        return True

    def _arm(self) -> None:
        if not self.closed:
            self.loop.add_writer(self.sock.fileno(), self._flush)

    def _flush(self) -> None:
        with self._lock:
            while self._backlog and not self.closed:
                try:
                    self.sock.sendmsg(self._backlog[0])
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    self._backlog.clear()
                    break
                self._backlog.popleft()
            self._writing = False
        try:
            self.loop.remove_writer(self.sock.fileno())
        except (ValueError, OSError):
            pass

    def read(self, buf: bytearray) -> int:
        """Read one record into `buf`; its size (more than len(buf): it was cut short), 0 when the peer has
        closed the link, -1 when nothing is waiting."""
        try:
            return self.sock.recv_into(buf, len(buf), socket.MSG_TRUNC)
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError:
            return 0

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._backlog.clear()
        try:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
        except (ValueError, OSError, RuntimeError, AttributeError):
            pass
        self.sock.close()


def _ints(n: int) -> struct.Struct:
    s = _INTS.get(n)
    if s is None:
        s = _INTS[n] = struct.Struct(f"<{n}q")
    return s


def pack_data(key: tuple[int, ...], host: np.ndarray) -> list[Any] | None:
    """The frames of a ``data`` message carrying `host` (C-contiguous) under `key`, with a compact header; None
    when it cannot have one (a dtype off the wire, a key or shape of more than 255 numbers or beyond int64)."""
    index = _DTYPE_INDEX.get(host.dtype)
    shape = host.shape
    if index is None or len(key) > 255 or len(shape) > MAX_DIMS or host.dtype.byteorder == ">":
        return None
    try:
        header = _COMPACT_HEAD.pack(COMPACT, PROTOCOL_VERSION, index, len(key), len(shape)) + _ints(len(key) + len(shape)).pack(*key, *shape)
    except struct.error:
        return None
    return [header, memoryview(host.reshape(-1).view(np.uint8)) if host.size else b""]


def parse_data(header: memoryview) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...]]:
    """(key, dtype, shape) of a compact data header; ProtocolError when it is malformed (the shape is checked by
    `data_bytes`, once the key is known: a bad shape fails that key's receive)."""
    if len(header) < _COMPACT_HEAD.size:
        raise ProtocolError(f"a compact data header of {len(header)} bytes")
    _, version, index, nkey, ndim = _COMPACT_HEAD.unpack_from(header)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (expected {PROTOCOL_VERSION})")
    if index >= len(_DTYPES) or _DTYPES[index] is None or ndim > MAX_DIMS:
        raise ProtocolError(f"a compact data header with dtype index {index} and rank {ndim}")
    ints = _ints(nkey + ndim)
    if len(header) != _COMPACT_HEAD.size + ints.size:
        raise ProtocolError(f"a compact data header of {len(header)} bytes for a {nkey}-number key and rank {ndim}")
    values = ints.unpack_from(header, _COMPACT_HEAD.size)
    return values[:nkey], _DTYPES[index], values[nkey:]


def data_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """The payload bytes of `dtype` `shape`; ProtocolError for a negative dimension or more than numpy can hold
    (as protocol.array_spec: a zero-size array's other dimensions count too)."""
    nbytes = bound = dtype.itemsize
    for d in shape:
        if d < 0:
            raise ProtocolError(f"bad shape {list(shape)}")
        nbytes *= d
        bound *= d or 1
    if bound > MAX_BYTES:
        raise ProtocolError(f"{dtype.name}{list(shape)} would take more than {MAX_BYTES} bytes")
    return nbytes


def split_record(buf: memoryview, n: int) -> tuple[memoryview, memoryview | None]:
    """(header bytes, payload bytes or None) of a record of `n` bytes in `buf`; ValueError if malformed."""
    if n < _LEN.size or n > len(buf):
        raise ValueError(f"a link record of {n} bytes (at least {_LEN.size}, at most {len(buf)})")
    (hlen,) = _LEN.unpack_from(buf, 0)
    if _LEN.size + hlen > n:
        raise ValueError(f"a link record announces a {hlen}-byte header but has {n - _LEN.size} bytes")
    header = buf[_LEN.size : _LEN.size + hlen]
    payload = buf[_LEN.size + hlen : n] if n > _LEN.size + hlen else None
    return header, payload
