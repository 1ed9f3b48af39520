"""Step arguments the controller hands this actor through shared memory, when both share a host.

A local controller writes each large host argument of a step (>= 64 KiB) into a POSIX shared-memory
segment it made for this actor alone (mode 600) and puts only a small notice in the encrypted
`run_program` request: ``{name, offset, nbytes, dtype, shape}`` (and ``layout`` on a device mesh). The
segment names all start with a prefix the controller told this actor once, over the authenticated control
plane (op ``input_shm``), followed by a random part the actor added and told it back (names in /dev/shm are
visible to every user: another session naming the same prefix gets another random part); a notice naming anything
else is refused, so a request cannot make the actor map another controller's (or another user's) memory. The actor maps a segment once (read only), unlinks its
name right after — nothing is left in /dev/shm if either side dies — checks every notice against the
segment's bounds and the array's dtype and shape. On CPU the step reads the array where it lies (JAX takes
aligned host memory without a copy), elsewhere it is copied out first. The controller rewrites a segment
only after this request's reply has come, and the reply waits until the step's Runs have computed (see
`run_program` in actors/handlers.py); step k+1's arguments go into another segment while step k runs. A segment the
controller closed (replaced by a bigger one) is named in the next notice's ``retire`` list and unmapped
here, so the mappings a session holds stay bounded.

The other way (a `get` of a large value, `write_output`): the controller names, in the encrypted request, a fresh
segment of its prefix for each value; the actor creates it (mode 600, must not exist yet), copies the value in and
replies with a notice ``{name, ino, nbytes, dtype, shape}`` instead of the bytes; the controller maps it, checks it
is that file, unlinks the name and copies the value out (a 64 MiB get went through ZeroMQ's CURVE at 0.14-0.21
GiB/s). A segment whose reply never came (the get cancelled) or was never read goes when the session ends or the
daemon stops; until then a session's unread ones are bounded by OUTPUT_MAX_BYTES. A get may instead name segments the
controller made and keeps for reuse (``pooled``): making a 64 MiB segment costs ~42 ms of tmpfs pages, copying into
a warm one ~6. Such a segment is mapped here once (read-write; this user's, mode 600, big enough) and kept, up to
OUTPUT_MAPS per session, until the controller says it dropped it (``forget``); it is never unlinked here, the
controller names it once and unlinks the name after its first get (both mappings then hold the memory, which goes
with the last of them). When the mapping is gone here (evicted) and the name with it, the value goes into a fresh
segment of that name as above, and the controller, seeing another inode, reads that one and drops its own.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from actors.request import RequestError
from transport.p2p import shm
from transport.protocol import ProtocolError, array_spec, dtype_name

_PREFIX = re.compile(r"^/mpmd-in-[0-9a-f]+-[0-9a-f]+-[0-9]+-$")  # /mpmd-in-<pid hex>-<token>-<actor>-
ALIGN = 64
MAX_SEGMENTS = 64  # mappings one session may hold; the controller double-buffers, so a handful is plenty
OUTPUT_MIN_BYTES = 64 << 10  # a smaller value a `get` asks for goes in the reply: a segment costs more than its bytes
OUTPUT_MAX_BYTES = 1 << 30  # a session's get segments not yet read by its controller; past it, values go in the reply
OUTPUT_MAPS = 8  # pooled get segments of its controller's a session keeps mapped (the least recently used goes first)


class InputSegments:
    """One session's view of the segments its controller writes step arguments into."""

    def __init__(self, actor_id: int) -> None:
        self.actor_id = actor_id
        self.base: str | None = None  # the prefix the controller named ('input_shm')
        self.prefix: str | None = None  # ... and the random part this actor added: what this session's names start with
        self.maps: dict[str, mmap.mmap] = {}
        self.reads = 0  # arguments read from shared memory (reported by `stats` as shm_inputs)
        self.bytes = 0
        self.outputs = 0  # values a `get` handed back through shared memory
        self.written: dict[str, int] = {}  # get segments made for this session (name -> bytes), until seen read
        self.out_maps: OrderedDict[str, tuple[mmap.mmap, int]] = OrderedDict()  # pooled get segments: (mapping, inode)
        self._lock = threading.Lock()  # (get segments are written in worker threads)
        self._closed = False

    def set_prefix(self, prefix: Any) -> str:
        """Accept segments named `prefix` + a random part this actor adds + a number from now on (once per session;
        the same prefix again is fine, and gets a new random part); returns the whole prefix, which the controller
        names its segments with. The random part binds the names to this session: the controller's own part is
        visible to every user in /dev/shm, and another key's session that named it (for an actor that controller's
        prefix was not yet held on) was served that controller's segments — read by this daemon, which can open
        what that key's user cannot, and unlinked under it (a probe). Only this session's controller hears its
        whole prefix, over the encrypted control plane."""
        if not isinstance(prefix, str) or not _PREFIX.match(prefix):
            raise RequestError(f"'input_shm' field 'prefix' must look like '/mpmd-in-<hex>-<hex>-<actor>-', got {prefix!r}")
        if self.base is not None and prefix != self.base:
            raise RequestError(f"this session's input prefix is already {self.base!r}; it cannot change to {prefix!r}")
        if not shm.available():
            raise RequestError(f"actor {self.actor_id} has no POSIX shared memory; send arguments inline")
        # Announced again (the controller reconnected): it starts its segments afresh, so the old ones go.
        for name in list(self.maps):
            self._unmap(name)
        self._unmap_outputs()
        self.base = prefix
        self.prefix = f"{prefix}{secrets.token_hex(8)}-"
        return self.prefix

    def write_output(self, name: Any, value: np.ndarray, pooled: int = 0) -> dict[str, Any] | None:
        """Copy `value` into a new segment `name` (one of this session's prefix; see the module docstring) and
        return its notice; None when it should go in the reply instead: small, no prefix named, no room in /dev/shm,
        the name taken (another process's doing: never overwritten), or OUTPUT_MAX_BYTES of this session's still
        unread by its controller. `pooled`: `name` is a segment the controller made for reuse, whose file has this
        inode, written in place (made here as a new one when it is gone). Runs in worker threads."""
        if value.nbytes < OUTPUT_MIN_BYTES or not self._ours(name):
            return None
        host = np.ascontiguousarray(value)
        dtype = dtype_name(host.dtype)  # (before the segment: a dtype that cannot travel leaves none behind)
        if pooled:
            got = self._pooled(name, host.nbytes, pooled)
            if got is not None:
                mm, ino = got
                try:
                    if mm.size() < host.nbytes:  # (shrunk since it was mapped: a write past its end kills the process)
                        self.forget_outputs([name])
                        return None
                    np.copyto(np.frombuffer(mm, np.uint8, host.nbytes), host.reshape(-1).view(np.uint8))
                except ValueError:  # (closed meanwhile: another get's thread mapped one more and let this one go)
                    return None
                with self._lock:
                    self.outputs += 1
                return {"name": name, "ino": ino, "nbytes": int(host.nbytes), "dtype": dtype, "shape": list(host.shape)}
        if not self._room_for(value.nbytes):
            return None
        try:
            mm, ino = shm.create_segment(name, host.nbytes)
        except OSError:
            return None
        with self._lock:
            closed = self._closed
            if not closed:
                self.written[name] = host.nbytes
        if closed:  # (the session ended while this get's thread ran: nothing would unlink it)
            mm.close()
            shm.unlink(name)
            return None
        try:
            np.copyto(np.frombuffer(mm, np.uint8, host.nbytes), host.reshape(-1).view(np.uint8))
        except BaseException:
            self.unlink_outputs([name])
            raise
        finally:
            mm.close()
        with self._lock:
            self.outputs += 1
        return {"name": name, "ino": ino, "nbytes": int(host.nbytes), "dtype": dtype, "shape": list(host.shape)}

    def _pooled(self, name: str, nbytes: int, ino: int) -> tuple[mmap.mmap, int] | None:
        """The mapping of the controller's pooled segment `name` (mapped now if it is not yet), None when there is
        none under that name, or it is not one this session may write: not a regular file, another user's, readable
        by others, another file than the controller's (inode `ino`), or smaller than `nbytes`."""
        with self._lock:
            if self._closed:
                return None
            got = self.out_maps.get(name)
            if got is not None and got[1] == ino:
                self.out_maps.move_to_end(name)
                return got
        try:
            # (non-blocking on Linux: a FIFO under the name would freeze the thread in open() until a writer came)
            fd = shm._posixshmem.shm_open(name, os.O_RDWR | shm.OPEN_FLAGS, 0)
        except OSError:
            return None  # (gone: the controller unlinked it after its first get; a new one is made under the name)
        try:
            st = os.fstat(fd)
            if shm.not_a_segment(st) or shm.refusal(st, ino, "the controller") or st.st_size < nbytes:
                return None
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        evicted = []
        with self._lock:
            if self._closed:
                evicted.append(mm)
                got = None
            else:
                old = self.out_maps.pop(name, None)  # (another file under the name before: its mapping goes)
                if old is not None:
                    evicted.append(old[0])
                got = self.out_maps[name] = (mm, st.st_ino)
                while len(self.out_maps) > OUTPUT_MAPS:
                    evicted.append(self.out_maps.popitem(last=False)[1][0])
        for gone in evicted:
            _close_map(gone)
        return got

    def _unmap_outputs(self) -> None:
        """Unmap every pooled get segment (the session ends, or its controller starts its segments afresh)."""
        with self._lock:
            pooled, self.out_maps = list(self.out_maps.values()), OrderedDict()
        for mm, _ in pooled:
            _close_map(mm)

    def forget_outputs(self, names: Any) -> None:
        """Unmap the pooled get segments the controller dropped (its `forget` list; names of this prefix only)."""
        if not isinstance(names, list):
            return
        for name in names:
            with self._lock:
                got = self.out_maps.pop(name, None) if isinstance(name, str) else None
            if got is not None:
                _close_map(got[0])

    def _room_for(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit in OUTPUT_MAX_BYTES of segments written for this session and not yet read (its
        controller unlinks each it reads: a controller that reads none cannot fill /dev/shm past that)."""
        with self._lock:
            if len(self.written) < MAX_SEGMENTS and sum(self.written.values()) + nbytes <= OUTPUT_MAX_BYTES:
                return True
            for name in list(self.written):  # (those read are gone from /dev/shm: forgotten here too, or this grew by a
                # name per fetch for the session's life)
                if not os.path.exists(f"/dev/shm{name}"):
                    del self.written[name]
            return sum(self.written.values()) + nbytes <= OUTPUT_MAX_BYTES

    def unlink_outputs(self, names: Any) -> None:
        """Remove segments written for a get whose reply will not come (cancelled, failed)."""
        for name in names:
            with self._lock:
                mine = self.written.pop(name, None) is not None
            if mine:
                shm.unlink(name)

    def _ours(self, name: Any) -> bool:
        return isinstance(name, str) and self.prefix is not None and name.startswith(self.prefix) and \
            re.fullmatch(r"[0-9]+", name[len(self.prefix):]) is not None

    def retire(self, notices: Any) -> None:
        """Unmap the segments the controller closed, listed in the notices' ``retire`` fields (done first
        thing in a request, so a request refused for another reason still retires them)."""
        if not isinstance(notices, list):
            return  # (the request's own check names this)
        for notice in notices:
            retire = notice.get("retire", []) if isinstance(notice, dict) else []
            if not isinstance(retire, list) or len(retire) > MAX_SEGMENTS or not all(
                    self._ours(r) and r != notice.get("name") for r in retire):
                raise RequestError(f"shared-memory input {notice.get('name')!r}: 'retire' must list other segments of "
                                   f"this session's prefix {self.prefix!r}, got {retire!r:.200}")
            for r in retire:  # closed by the controller: unmapped now, or once the last array reading it is gone
                self._unmap(r)

    def read(self, notice: Any) -> np.ndarray:
        """The array a notice points at: a read-only view of the segment (the caller copies it out)."""
        if not isinstance(notice, dict):
            raise RequestError(f"a shared-memory input notice must be a map, got {type(notice).__name__}")
        name, offset, nbytes = notice.get("name"), notice.get("offset"), notice.get("nbytes")
        dtype_name, shape = notice.get("dtype"), notice.get("shape")
        if self.prefix is None:
            raise RequestError(f"shared-memory input {name!r} refused: this session never named an input prefix ('input_shm')")
        if not self._ours(name):
            raise RequestError(f"shared-memory input {name!r} refused: its name is not {self.prefix!r} + a number, the prefix "
                               "this session's controller announced")
        ino = notice.get("ino")
        for what, v in (("offset", offset), ("nbytes", nbytes), ("ino", ino)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RequestError(f"shared-memory input {name}: {what} must be a non-negative int, got {v!r}")
        if offset % ALIGN:
            raise RequestError(f"shared-memory input {name}: offset {offset} is not a multiple of {ALIGN}")
        if not isinstance(shape, list):
            raise RequestError(f"shared-memory input {name}: shape must be a list of non-negative ints, got {shape!r:.80}")
        try:  # (checked as a frame's array is: 70 dimensions were numpy's bare "maximum supported dimension"; a probe)
            dtype, shape, want = array_spec({"dtype": dtype_name, "shape": shape})
        except (ProtocolError, ValueError, TypeError, KeyError) as e:
            raise RequestError(f"shared-memory input {name}: {str(e).removeprefix('array 0: ')}") from None
        if nbytes != want:
            raise RequestError(f"shared-memory input {name}: {dtype.name}{shape} is {want} bytes but the notice says {nbytes}")
        mm = self._map(name, ino)
        if offset + nbytes > len(mm):
            raise RequestError(f"shared-memory input {name}: bytes {offset}..{offset + nbytes} lie outside the segment "
                               f"({len(mm)} bytes)")
        # Reading a page past the file's end kills the process (SIGBUS): a segment its writer truncated since it was
        # mapped is refused here (a probe's put killed the daemon so). A process of this user that shrinks it while
        # a Run reads it in place still can, as it could kill the daemon outright; faulthandler says so in its log.
        size = mm.size()  # (the file's size now: the mapping keeps a descriptor of it)
        if offset + nbytes > size:
            raise RequestError(f"shared-memory input {name}: bytes {offset}..{offset + nbytes} lie outside the segment, "
                               f"which shrank to {size} bytes after it was mapped (truncated by the process that wrote it)")
        self.reads += 1
        self.bytes += nbytes
        return np.frombuffer(mm, np.uint8, nbytes, offset).view(dtype).reshape(shape)

    def _map(self, name: str, ino: int) -> mmap.mmap:
        mm = self.maps.get(name)
        if mm is not None:
            return mm
        if len(self.maps) >= MAX_SEGMENTS:
            raise RequestError(f"shared-memory input {name}: this session already maps {len(self.maps)} segments (the limit)")
        try:
            # (non-blocking on Linux: a FIFO put under the name froze the daemon's loop in open() until a writer came; a probe)
            fd = shm._posixshmem.shm_open(name, os.O_RDONLY | shm.OPEN_FLAGS, 0)
        except OSError as e:
            raise RequestError(f"shared-memory input {name} cannot be opened on actor {self.actor_id}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            kind = shm.not_a_segment(st)
            if kind:
                raise RequestError(f"shared-memory input {name} is not a shared-memory segment (a regular file) but {kind}; "
                                   "is something else on this host using mpmd's segment names?")
            why = shm.refusal(st, ino, "the controller") or ("is empty" if st.st_size == 0 else "")
            if why:
                raise RequestError(f"shared-memory input {name} {why}")
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            shm._posixshmem.shm_unlink(name)  # mapped on both sides now: the name is no longer needed
        except OSError:
            pass
        self.maps[name] = mm
        return mm

    def _unmap(self, name: str) -> None:
        mm = self.maps.pop(name, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # an array still reads it in place: the mapping goes with the last one
                pass

    def forget(self, name: Any) -> None:
        """Unmap a segment written for one request alone (a put's), once its array is copied out."""
        if isinstance(name, str) and name in self.maps:
            self._unmap(name)

    def sweep(self) -> int:
        """Unlink the segments of this session's prefix still named in /dev/shm: written by a controller that died
        (kill -9) before this actor mapped them, nobody else will (one was left behind for good; a probe). For a
        session closed because its controller went silent. How many were removed."""
        if self.prefix is None or not os.path.isdir("/dev/shm"):
            return 0
        removed = 0
        for name in os.listdir("/dev/shm"):
            if self._ours("/" + name):
                try:
                    shm._posixshmem.shm_unlink("/" + name)
                    removed += 1
                except OSError:
                    pass
        return removed

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.unlink_outputs(list(self.written))  # (those its controller never read: a get abandoned mid-way)
        self._unmap_outputs()
        for mm in self.maps.values():
            try:
                mm.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass
        self.maps.clear()


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # (a write into it still holds a view: the mapping goes with it)
        pass


__all__ = ["InputSegments"]
