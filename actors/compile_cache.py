"""The bound on a daemon's persistent compilation cache directory (`mpmd-actor --cache-max-mb`).

Every executable a daemon compiles is written into its compilation cache (by the compile child or by XLA in the
daemon), and JAX's own bound on that directory needs a package mpmd does not depend on (filelock). A daemon prunes
the directory at its start (`prune_compile_cache`) and, while it lives, every `PRUNE_EVERY` new executables
(`CompileCacheBound`): pruned only at start, a daemon serving job after job for days grew it without bound until
it restarted (a review).

Only the standard library here: the daemon imports this module before JAX.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

log = logging.getLogger(__name__)

CACHE_PRUNE_AGE = 3600.0  # s: an entry written or read more recently may be in use by another daemon sharing the cache
EMPTY_AGE = 60.0  # s: an empty entry older than this is a failed write's leftover (see prune_compile_cache)
PRUNE_EVERY = 8  # new executables between two prunes while a daemon lives (each prune reads the whole directory)


def prune_compile_cache(path: str, max_bytes: int, now: float | None = None) -> int:
    """Bound a compilation cache directory: while its files take more than `max_bytes`, remove the least recently
    used ones (by access time, else modification time) not touched for CACHE_PRUNE_AGE seconds — so never one
    being written now, nor one read in the last hour where the file system records reads (under `relatime` or
    `noatime` it may not: an entry pruned while wanted is compiled again, JAX's read of a vanished file a miss).
    Empty files untouched for EMPTY_AGE seconds go whatever the bound: a write that failed (a full disk) leaves them,
    every later read of one fails and recompiles, and being young they outlived the hour (a probe). Files named with
    a leading dot (a daemon's lock on its private directory) are not entries and stay. Without it the cache grew by
    ~30 KB for every new step signature, for good (a probe: 13,824 files). Returns the bytes removed."""
    now = time.time() if now is None else now
    entries = []
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.name.startswith("."):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if st.st_size == 0 and now - st.st_mtime >= EMPTY_AGE:  # (not one being written now)
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass
                    continue
                entries.append((max(st.st_atime, st.st_mtime), st.st_size, e.path))
    except OSError:
        return 0
    total = sum(size for _, size, _ in entries)
    removed = 0
    for used, size, p in sorted(entries):
        if total - removed <= max_bytes or now - used < CACHE_PRUNE_AGE:
            break
        try:
            os.unlink(p)
            removed += size
        except FileNotFoundError:  # (another daemon pruning beside this one took it: counted, or each would go on)
            removed += size
        except OSError:
            pass
    return removed


class CompileCacheBound:
    """Keeps the compilation cache at `path` within `max_bytes` while the daemon lives: `wrote()` (on the event
    loop, after each new executable) starts a prune every `every` calls, in a thread of its own — a prune reads
    the whole directory, which must not stall the loop — and at most one at a time (a call while one runs is
    counted toward the next)."""

    def __init__(self, path: str, max_bytes: int, every: int = PRUNE_EVERY) -> None:
        if every < 1:
            raise ValueError(f"a compile cache is pruned every `every` >= 1 new executables, got {every}")
        self.path = path
        self.max_bytes = max_bytes
        self.every = every
        self.removed = 0  # bytes removed while the daemon lived
        self._writes = 0
        self._thread: threading.Thread | None = None

    def wrote(self) -> None:
        """A new executable went into the cache: prune it if this is the `every`-th since the last prune."""
        self._writes += 1
        if self._writes < self.every or (self._thread is not None and self._thread.is_alive()):
            return
        self._writes = 0
        self._thread = threading.Thread(target=self._prune, name="compile-cache-prune", daemon=True)
        self._thread.start()

    def _prune(self) -> None:
        try:
            removed = prune_compile_cache(self.path, self.max_bytes)
        except Exception:  # noqa: BLE001 - a failed prune must not end the daemon: the next one tries again
            log.exception("pruning the compilation cache %s failed", self.path)
            return
        if removed:
            self.removed += removed
            log.info("removed %.1f MiB of least recently used entries from the compilation cache %s (over its bound of %.1f MiB)",
                     removed / 2**20, self.path, self.max_bytes / 2**20)

    def join(self, timeout: float | None = None) -> None:
        """Wait for a prune under way (tests; a daemon need not)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)


__all__ = ["CACHE_PRUNE_AGE", "EMPTY_AGE", "PRUNE_EVERY", "CompileCacheBound", "prune_compile_cache"]
