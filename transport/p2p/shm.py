"""Shared-memory payloads between actors on one host.

The sender copies an array into a POSIX shared-memory segment it owns and sends a small ZeroMQ notice
``{"op": "shm", seg, name, size, ino, arrays: [aval]}``. The receiver maps the segment only if its name is the
one that sender's segment number `seg` must have (the sender's prefix comes from the controller, the sender's
identity from its CURVE key; see plane.py), it belongs to this user, and it is the file the sender made (its
inode `ino`: another process of the user could put a file of its own under the name) — so a notice cannot make
the receiver map or unlink anybody else's segment, nor read another's bytes as the activation. It maps each segment once and unlinks the name right after, so nothing
is left in /dev/shm if either side dies; hands out an aligned numpy view
that JAX aliases rather than copies, and marks the segment released only when the last Python reference to
that view is gone — so a segment is never reused while an array still aliases it. The mark is a word in the
segment's control page (the page after its payload area): the sender counts each use of a segment there, and
the receiver writes back the count it saw when its view is gone; the sender reclaims released segments when it
next needs one. (It was a ``{"op": "shm_ack", seg}`` message: one more wake of the sender's event loop per
transfer, on the core its compute runs on. Such a message is still accepted.) Segments
are pooled by power-of-two size class, up to a quarter of /dev/shm per pair (a training loop repeats its
transfers, so after the first step every payload finds a warm segment) and reserved with `posix_fallocate` (a full /dev/shm is an error
at reserve time, not a SIGBUS later).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import stat
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from transport.ratelimit import RateLimitedLog

try:
    import _posixshmem  # CPython's shm_open/shm_unlink, what multiprocessing.shared_memory uses
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

log = logging.getLogger(__name__)
_warn = RateLimitedLog(log)

MIN_SEGMENT = 1 << 16
CONTROL = 4096  # bytes after a segment's payload: [use count (sender), released use count (receiver), closed], uint64 each


def _pool_limit() -> int:
    """Shared memory one (sender, receiver) pair keeps mapped, in use or free for reuse: a quarter of /dev/shm, or
    MPMD_SHM_POOL_MB in the actor's environment (an operator's cap on a shared node: the pool outlives jobs, so a
    daemon keeps what its largest job needed)."""
    given = os.environ.get("MPMD_SHM_POOL_MB")
    if given:
        try:
            mb = float(given)
        except ValueError:
            mb = -1.0
        if 1 <= mb < 1 << 30:
            return int(mb * (1 << 20))
        log.warning("MPMD_SHM_POOL_MB must be a number of MiB from 1 to 2**30, got %r: a quarter of /dev/shm is kept instead", given)
    try:
        st = os.statvfs("/dev/shm")
        return max(1 << 28, st.f_frsize * st.f_blocks // 4)
    except OSError:
        return 4 << 30


POOL_LIMIT = _pool_limit()


# Linux keeps POSIX shared memory as files in /dev/shm, where any user can put a FIFO under a name (an open of one
# blocks until a writer comes: a daemon's event loop froze so; a probe): opened non-blocking, never through a link,
# and only a regular file taken. (macOS's shm objects are not files: its shm_open takes no such flags, and its fstat
# sets no file type.)
_LINUX = sys.platform.startswith("linux")
OPEN_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW if _LINUX else 0


def not_a_segment(st: os.stat_result) -> str:
    """What a shared-memory name's fstat says it is when that is no segment (on Linux: not a regular file; 'a
    FIFO', say), else ''."""
    if not _LINUX or stat.S_ISREG(st.st_mode):
        return ""
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(st.st_mode):
            return word
    return f"a file of mode {st.st_mode:o}"


def refusal(st: os.stat_result, ino: int | None, maker: str) -> str:
    """Why a regular file opened by a segment's name (`st`: its fstat; `not_a_segment` first) is not the segment
    `maker` made with inode `ino` (None: not checked), as the end of a sentence naming it; '' when it is: another
    user's, readable by others, or another file under the name (a same-user process replaced it: its bytes were
    read as ours, silently wrong; a probe) — each reader of a segment checks all of these."""
    if st.st_uid != os.getuid():
        return f"belongs to user {st.st_uid}, not to this process's user"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}; segments must be 600"
    if ino is not None and st.st_ino != ino:
        return f"is not the file {maker} made (another took its name); is something else on this host using mpmd's segment names?"
    return ""


def available() -> bool:
    return _posixshmem is not None


def size_class(nbytes: int) -> int:
    return max(MIN_SEGMENT, 1 << (max(nbytes, 1) - 1).bit_length())


@dataclass
class Segment:
    """A sender's segment: `size` payload bytes, then its control page (the mapping is `size + CONTROL` bytes)."""

    id: int
    name: str
    size: int
    mm: mmap.mmap
    unlinked: bool = False
    uses: int = 0  # how many times it was handed out; the receiver writes this back when it is done with it
    ino: int = 0  # its file's inode, in the notice: the receiver maps only the file this sender made

    @property
    def mapped(self) -> int:
        return self.size + CONTROL

    def control(self) -> memoryview:
        """[uses, released, closed] as a view of three native uint64 words."""
        return memoryview(self.mm)[self.size : self.size + 24].cast("Q")


_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map the pages now: a first write would fault on each


def _create(name: str, size: int) -> tuple[mmap.mmap, int]:
    """The new segment `name`, mapped, and its file's inode (the receiver checks that what it opens under the name
    is this file: another of the same user could take the name between the unlink and the open)."""
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except AttributeError:  # pragma: no cover - macOS has no posix_fallocate
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=_FLAGS), os.fstat(fd).st_ino
    except BaseException:
        _posixshmem.shm_unlink(name)
        raise
    finally:
        os.close(fd)


def create_segment(name: str, size: int) -> tuple[mmap.mmap, int]:
    """A new segment `name` of `size` bytes (mode 600, reserved now: a full /dev/shm fails here, not later), mapped,
    and its file's inode (for the reader's check that it maps this file)."""
    if _posixshmem is None:
        raise OSError("POSIX shared memory is not available here")
    return _create(name, size)


def unlink(name: str) -> None:
    """Remove a segment's name (its memory goes when the last mapping does); a name already gone is fine."""
    try:
        _posixshmem.shm_unlink(name)
    except OSError:
        pass


class ShmSender:
    """The segments one actor sends to one peer through."""

    _names = itertools.count()

    def __init__(self, prefix: str) -> None:
        """`prefix`: the segments' names are `prefix` + their number; the receiver expects exactly that."""
        if not prefix.startswith("/mpmd-") or "/" in prefix[1:]:
            raise ValueError(f"shared-memory prefix {prefix!r} must look like '/mpmd-...' with no other '/'")
        self.prefix = prefix
        self.free: dict[int, list[Segment]] = {}
        self.free_bytes = 0
        self.busy: dict[int, Segment] = {}
        self.busy_bytes = 0
        self.created = 0

    def has_free(self, nbytes: int) -> bool:
        self.reclaim()
        return bool(self.free.get(size_class(nbytes)))

    def reclaim(self) -> int:
        """Take back the busy segments whose receiver has marked this use of them released; how many."""
        done = []
        for seg in self.busy.values():
            try:
                words = seg.control()
                released = words[1] == seg.uses
                words.release()
            except ValueError:  # closed meanwhile
                continue
            if released:
                done.append(seg.id)
        for seg_id in done:
            self.release(seg_id)
        return len(done)

    def in_flight(self, nbytes: int) -> bool:
        """Is a segment of this size class out with the receiver (and so likely back soon)?"""
        size = size_class(nbytes)
        return any(seg.size == size for seg in self.busy.values())

    def acquire(self, nbytes: int) -> Segment:
        size = size_class(nbytes)
        pool = self.free.get(size)
        if not pool and self.busy and self.reclaim():
            pool = self.free.get(size)
        if pool:
            seg = pool.pop()
            self.free_bytes -= seg.size
        else:
            n = next(self._names)
            name = f"{self.prefix}{n}"
            mm, ino = _create(name, size + CONTROL)
            seg = Segment(n, name, size, mm, ino=ino)
            self.created += 1
        seg.uses += 1
        words = seg.control()
        words[0] = seg.uses  # before the notice goes: the receiver reads it when it maps the payload
        words.release()
        self.busy[seg.id] = seg
        self.busy_bytes += seg.size
        return seg

    def write(self, seg: Segment, src: np.ndarray) -> None:
        """Copy `src`'s bytes to the start of `seg` (may run in a worker thread)."""
        dst = np.frombuffer(seg.mm, np.uint8, src.nbytes)
        np.copyto(dst, src.reshape(-1).view(np.uint8))

    def release(self, seg_id: int) -> None:
        """The receiver has dropped its last view of the segment: it may be reused."""
        seg = self.busy.pop(seg_id, None)
        if seg is None:
            _warn.warning("unknown-ack", "shared-memory ack for unknown segment %s%d", self.prefix, seg_id)
            return
        self.busy_bytes -= seg.size
        seg.unlinked = True  # the receiver mapped it, then unlinked the name
        if self.free_bytes + self.busy_bytes + seg.size <= POOL_LIMIT:
            self.free.setdefault(seg.size, []).append(seg)
            self.free_bytes += seg.size
        else:  # past the pool's limit: never sent again, and its receiver may unmap it (`ShmReceiver.open`)
            try:
                words = seg.control()
                words[2] = 1
                words.release()
            except ValueError:
                pass
            _close(seg)

    def give_back(self, seg_id: int) -> None:
        """The notice for this segment never left: reuse it at once."""
        seg = self.busy.pop(seg_id, None)
        if seg is not None:
            self.busy_bytes -= seg.size
            self.free.setdefault(seg.size, []).append(seg)
            self.free_bytes += seg.size

    def close(self) -> None:
        for seg in [*self.busy.values(), *(s for pool in self.free.values() for s in pool)]:
            if not seg.unlinked:
                try:
                    _posixshmem.shm_unlink(seg.name)
                except OSError:
                    pass
            _close(seg)
        self.busy.clear()
        self.free.clear()
        self.free_bytes = self.busy_bytes = 0


def _close(seg: Segment) -> None:
    try:
        seg.mm.close()
    except BufferError:  # a view is still alive somewhere; the mapping goes when it does
        pass


class ShmReceiver:
    """The segments peers send to this actor through, mapped once each."""

    def __init__(self) -> None:
        # Keyed by name too: a restarted peer numbers its segments from 0 again, under a new prefix.
        self.maps: dict[tuple[int, int, str], mmap.mmap] = {}
        self.outstanding = 0  # views handed out whose last reference is not gone yet

    def forget(self, src: int) -> None:
        """Drop the mappings of a peer that is gone (their memory goes when the last view of each does)."""
        for key in [k for k in self.maps if k[0] == src]:
            try:
                self.maps.pop(key).close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass

    def open(self, src: int, seg_id: int, name: str, size: int, ino: int | None = None) -> mmap.mmap:
        mm = self.maps.get((src, seg_id, name))
        if mm is None:
            if not name.startswith("/mpmd-") or "/" in name[1:]:
                raise ValueError(f"shared-memory name {name!r} is not one of ours")
            self._unmap_closed(src)  # (a new segment: the sender may have closed older ones, past its pool's limit)
            fd = _posixshmem.shm_open(name, os.O_RDWR | OPEN_FLAGS, 0o600)
            try:
                st = os.fstat(fd)
                kind = not_a_segment(st)
                if kind:
                    raise ValueError(f"shared-memory segment {name} is not a regular file but {kind}; is something else on this "
                                     "host using mpmd's segment names?")
                why = refusal(st, ino, f"actor {src}")
                if why:
                    raise ValueError(f"shared-memory segment {name} {why}")
                if st.st_size < size:
                    raise ValueError(f"shared-memory segment {name} is smaller than the announced {size} bytes")
                mm = mmap.mmap(fd, size, flags=_FLAGS)
            finally:
                os.close(fd)
                _posixshmem.shm_unlink(name)
            self.maps[(src, seg_id, name)] = mm
        elif len(mm) < size:
            raise ValueError(f"shared-memory segment {seg_id} from actor {src} is {len(mm)} bytes, {size} announced")
        return mm

    def _unmap_closed(self, src: int) -> None:
        """Drop the mappings of `src`'s segments that it marked closed (it never sends them again): their memory
        stayed mapped here for the rest of the session, 80 MiB per 60 transfers of three sizes past the pool's
        limit (a probe)."""
        for key in [k for k in self.maps if k[0] == src]:
            mm = self.maps[key]
            try:
                words = memoryview(mm)[len(mm) - CONTROL : len(mm) - CONTROL + 24].cast("Q")
                closed = words[2] == 1
                words.release()
                if closed:
                    mm.close()  # (its views are gone: the sender closes a segment only once it is released)
                    del self.maps[key]
            except (ValueError, BufferError):  # closed meanwhile, or a view still alive: it goes with the view
                pass

    def view(self, src: int, seg_id: int, name: str, size: int, dtype: np.dtype, shape: list[int], nbytes: int,
             on_release: Callable[[], None] | None = None, ino: int | None = None) -> np.ndarray:
        """An array over the segment (`size`: its mapping, payload and control page); once no reference to it is
        left the segment is marked released for its sender, and `on_release` runs (in any thread)."""
        if size < CONTROL + MIN_SEGMENT:
            raise ValueError(f"shared-memory segment {seg_id} from actor {src}: {size} bytes cannot hold a payload and its control page")
        mm = self.open(src, seg_id, name, size, ino)
        payload = size - CONTROL
        if nbytes > payload:
            raise ValueError(f"{dtype.name}{shape} needs {nbytes} bytes but segment {seg_id} from actor {src} has {payload}")
        words = memoryview(mm)[payload : payload + 16].cast("Q")
        use = words[0]
        words.release()
        root = np.frombuffer(mm, np.uint8, nbytes)
        self.outstanding += 1
        weakref.finalize(root, self._released, mm, payload, use, on_release)
        return root.view(dtype).reshape(shape)

    def _released(self, mm: mmap.mmap, payload: int, use: int, on_release: Callable[[], None] | None) -> None:
        self.outstanding -= 1
        try:
            words = memoryview(mm)[payload : payload + 16].cast("Q")
            words[1] = use  # the sender may reuse the segment from now on
            words.release()
        except ValueError:  # the mapping is closed (the sender is gone)
            pass
        if on_release is not None:
            on_release()

    def close(self) -> None:
        for mm in self.maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self.maps.clear()
