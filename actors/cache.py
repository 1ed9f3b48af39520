"""Compiled-executable cache keyed by the content hash of a serialized `jax.export` blob and how it is
compiled (donated inputs; with a device mesh, its inputs' and outputs' layouts).

The same blob compiles once per actor and way; JAX's persistent compilation cache (when the daemon is given a
cache directory) also makes a restarted daemon skip XLA compilation.

Only checked bytes reach the compiler: a blob must come with the SHA-256 digest of its bytes (checked before
anything else), is taken apart and its custom calls checked in a child process first (`actors.sandbox`),
and its compile is bounded by a timeout.

Where XLA compiles (CPU daemons): in that child too, into a private persistent compilation cache; the daemon's
own compile then only loads what the child wrote (measured: a 22 s compile loads in 0.9 s). A compile past
`--compile-timeout` is stopped by killing the child, so an abandoned compile frees its cores at once; a few
children (`CheckerPool`) compile side by side, with threads of their own, never the event loop's default pool
that `get`, `save` and `run` use. Identical blobs in flight share one compile; a blob whose compile timed out
is refused at once for `RETRY_AFTER` seconds rather than started again. (GPU daemons compile in a thread of
the daemon, bounded by the request only: the child has no GPU.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
from jax import export

from actors import spmd
from actors.sandbox import BlobChecker, BlobRefused, CheckerPool, build_executable
from actors.stream import goes_off_loop, output_bytes

log = logging.getLogger(__name__)
RETRY_AFTER = 30.0  # seconds a blob whose compile timed out is refused without compiling it again


class UnknownExecutableError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown executable"


def content_hash(blob: bytes | memoryview) -> str:
    return hashlib.sha256(blob).hexdigest()[:32]


def digest(blob: bytes | memoryview) -> str:
    """What a `compile` request carries beside its blob: the SHA-256 of the bytes, in hex."""
    return hashlib.sha256(blob).hexdigest()


KEPT_UNUSED = 256  # executables no open session uses that a daemon keeps for the next job (mpmd-actor --kept-executables)
CLEAR_JAX_CACHES_AFTER = 64  # executables dropped between two clears of JAX's own caches (`ExecutableCache.retire`)


class ExecutableCache:
    """`ordered`: every executable takes and returns an order token first (see actors/stream.py). Executables no
    open session uses any more (`retire`) are kept, the `kept_unused` most recently retired, for a job that
    compiles them again; older ones are dropped (a daemon serving job after job grew by every job's executables:
    0.17 MB each, a probe)."""

    def __init__(self, device: Any, checker: BlobChecker | CheckerPool | None = None, compile_timeout: float = 600.0,
                 ordered: bool = False) -> None:
        self._device = device
        self._checker = checker
        # Loading a compiled executable (or compiling one, on GPUs) runs here, never in the default pool.
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="compile")
        self._timed_out: dict[str, float] = {}
        self._ordered = ordered
        self.mesh: Any = None  # the actor's device mesh, once the controller names one
        self.compile_timeout = compile_timeout
        self._compiled: dict[str, Any] = {}
        self._out_bytes: dict[str, int] = {}
        self._off_loop: dict[str, bool] = {}
        self._unused: OrderedDict[str, None] = OrderedDict()  # retired keys, oldest first
        self.kept_unused = KEPT_UNUSED
        self._compiling: dict[str, asyncio.Future[Any]] = {}
        self._dropped = 0  # executables dropped since JAX's caches were last cleared
        self._busy = 0  # compile threads running `_compile` now (one abandoned by a timeout or a cancel included)
        self._busy_lock = threading.Lock()
        self.compiles = 0
        # called on the loop after each new executable (it went into the persistent compilation cache): the daemon
        # bounds that directory with it (actors/compile_cache.py)
        self.on_compiled: Callable[[], None] | None = None
        self.hits = 0
        self.refused = 0
        self.check_seconds = 0.0

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, blob: bytes, donate: tuple[int, ...], in_layouts: list | None, out_layouts: list | None, mesh: Any) -> Any:
        with self._busy_lock:
            self._busy += 1
        try:
            exp = export.deserialize(bytearray(blob))
            compiled = build_executable(exp, donate, in_layouts, out_layouts, mesh, self._device, self._ordered)
            out = output_bytes(compiled)  # (read here, not on the loop: a big module's cost analysis takes ~30 ms)
            return compiled, out, goes_off_loop(compiled, out)
        finally:
            with self._busy_lock:
                self._busy -= 1

    def _spec(self, donate: tuple[int, ...], in_layouts: list | None, out_layouts: list | None, mesh_: Any) -> dict[str, Any] | None:
        """What the compile child needs to compile a blob exactly as `_compile` will (None: compile here)."""
        if self._checker is None or getattr(self._device, "platform", "cpu") != "cpu":
            return None
        mesh = None
        if mesh_ is not None:
            mesh = {"shape": list(mesh_.devices.shape), "axis_names": list(mesh_.axis_names)}
        return {"donate": list(donate), "in_layouts": in_layouts, "out_layouts": out_layouts, "mesh": mesh, "ordered": self._ordered}

    def num_outputs(self, key: str) -> int:
        """How many values an executable returns (without the order token)."""
        return self.get(key).out_tree.num_leaves - (1 if self._ordered else 0)

    def out_layouts(self, key: str) -> list[Any]:
        """The layouts XLA chose for an executable's outputs (wire form), without the order token."""
        outs = list(self.get(key).output_shardings)
        if self._ordered:
            outs = outs[1:]
        return [spmd.spec_to_wire(getattr(s, "spec", None)) or [] for s in outs]

    async def compile(self, blob: bytes | memoryview, expected_digest: str | None = None, donate: tuple[int, ...] = (),
                      in_layouts: list | None = None, out_layouts: list | None = None) -> tuple[str, bool]:
        """Compile `blob` (or find it cached), letting the inputs at `donate` share buffers with outputs and, on a
        device mesh, taking inputs laid out as `in_layouts` (outputs as `out_layouts` where given, else as XLA
        chooses). Returns (key, was_cached). With a checker, `expected_digest` must be the blob's `digest`."""
        if self._checker is not None or expected_digest is not None:
            got = hashlib.sha256(blob).hexdigest()
            if expected_digest != got:
                self.refused += 1
                raise BlobRefused(f"the executable's digest does not match its bytes ('digest' {expected_digest!r:.80}, "
                                  f"the {len(blob)} bytes hash to {got}); a compile request carries the SHA-256 of its blob")
        mesh = self.mesh  # (read once: the mesh goes with the last session, and a later job may build another)
        how = "" if mesh is None else "-m" + hashlib.sha256(json.dumps([list(mesh.devices.shape), list(mesh.axis_names)]).encode()).hexdigest()[:12]
        if donate:
            how += "-d" + ".".join(map(str, donate))
        if in_layouts is not None or out_layouts is not None:
            how += "-l" + hashlib.sha256(json.dumps([in_layouts, out_layouts]).encode()).hexdigest()[:16]
        key = content_hash(blob) + how
        if key in self._compiled:
            self.hits += 1
            return key, True
        if key in self._compiling:
            self.hits += 1
            await asyncio.shield(self._compiling[key])
            return key, True
        when = self._timed_out.get(key)
        if when is not None and time.monotonic() - when < RETRY_AFTER:
            self.refused += 1
            raise BlobRefused(f"this executable did not compile within {self.compile_timeout:g} s "
                              f"{time.monotonic() - when:.0f} s ago (mpmd-actor --compile-timeout), so it is not compiled again "
                              f"for {RETRY_AFTER:g} s; split the stage, or start mpmd-actor with a longer --compile-timeout")
        fut = asyncio.get_running_loop().create_future()
        self._compiling[key] = fut
        try:
            data = bytes(blob)
            spec = self._spec(tuple(donate), in_layouts, out_layouts, mesh)
            if self._checker is not None:
                try:
                    result = await self._checker.check(data, spec)
                except BlobRefused as e:
                    self.refused += 1
                    if "did not compile within" in str(e):
                        self._remember_timeout(key)
                    raise
                self.check_seconds += result.seconds
            loop = asyncio.get_running_loop()
            try:  # (after a compile in the child: a load from the compilation cache)
                compiled, out, off = await asyncio.wait_for(loop.run_in_executor(
                    self._threads, self._compile, data, tuple(donate), in_layouts, out_layouts, mesh), self.compile_timeout)
            except TimeoutError:
                self._remember_timeout(key)
                log.warning("executable %s did not compile within %g s; its compile thread is left running", key, self.compile_timeout)
                raise BlobRefused(f"the executable did not compile within {self.compile_timeout:g} s (mpmd-actor "
                                  "--compile-timeout); XLA is still working on it in the background") from None
            self._compiled[key] = compiled
            self._out_bytes[key], self._off_loop[key] = out, off
            self.compiles += 1
            fut.set_result(compiled)
            log.debug("compiled executable %s", key)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                fut.cancel()  # whoever waits for the same blob learns its compile was abandoned
            else:
                fut.set_exception(e)
                fut.exception()
            raise
        finally:
            self._compiling.pop(key, None)
        if self.on_compiled is not None:  # (after the compile's outcome is settled: a failing hook is not the compile's)
            try:
                self.on_compiled()
            except Exception:  # noqa: BLE001 - the executable is compiled and cached whatever the hook does
                log.exception("the hook after a new executable failed")
        return key, False

    def _remember_timeout(self, key: str) -> None:
        now = time.monotonic()
        self._timed_out = {k: t for k, t in self._timed_out.items() if now - t < RETRY_AFTER}
        self._timed_out[key] = now

    def retire(self, keys: Any) -> list[str]:
        """`keys` are used by no open session now: keep them among the unused, dropping the oldest past
        `kept_unused`; returns the keys dropped."""
        for key in keys:
            if key in self._compiled:
                self._unused[key] = None
                self._unused.move_to_end(key)
        dropped = []
        while len(self._unused) > self.kept_unused:
            key, _ = self._unused.popitem(last=False)
            self._compiled.pop(key, None)
            self._out_bytes.pop(key, None)
            self._off_loop.pop(key, None)
            dropped.append(key)
        self._dropped += len(dropped)
        if self._dropped >= CLEAR_JAX_CACHES_AFTER and not self._busy:  # (no compile thread lowers now, an abandoned one included)
            # JAX's own caches (abstract evaluation, lowering) keep every deserialized export in their keys, bounded
            # only by their LRU sizes: the daemon grew 5-12 KB per executable compiled and dropped, past this cap (a
            # probe). The executables in use are held here (Compiled objects), not there, and a call already running
            # keeps its own cache entry; other threads may still run executables or put arrays meanwhile, which only
            # retrace the daemon's few helper functions (from the persistent cache), once per so many drops.
            self._dropped = 0
            jax.clear_caches()
        return dropped

    @property
    def unused(self) -> list[str]:
        """The executables no open session uses, oldest first (kept for a later job)."""
        return list(self._unused)

    def claim(self, key: str) -> None:
        """A session uses `key` (again): it is not among the unused."""
        self._unused.pop(key, None)

    def output_bytes(self, key: str) -> int:
        """The bytes an executable's outputs take (read once per executable: a key names one compiled program)."""
        got = self._out_bytes.get(key)
        if got is None:
            got = self._out_bytes[key] = output_bytes(self.get(key))
        return got

    def goes_off_loop(self, key: str) -> bool:
        """Whether an executable is dispatched off the event loop on CPU (`actors.stream.goes_off_loop`; judged once
        per executable, when it compiles, or `send_off_loop` after a slow dispatch)."""
        got = self._off_loop.get(key)
        if got is None:
            got = self._off_loop[key] = goes_off_loop(self.get(key))
        return got

    def send_off_loop(self, key: str, seconds: float) -> None:
        """A dispatch of `key` from the event loop took `seconds` (XLA ran it inline, unforeseen): its later calls go
        off the loop."""
        if not self._off_loop.get(key) and key in self._compiled:
            self._off_loop[key] = True
            log.info("executable %s held the event loop %.0f ms in its dispatch; its calls go through a thread from now on", key, seconds * 1e3)

    def get(self, key: str) -> Any:
        try:
            return self._compiled[key]
        except KeyError:
            raise UnknownExecutableError(
                f"no executable {key!r} on this actor ({len(self._compiled)} cached); send it with 'compile' first"
            ) from None
