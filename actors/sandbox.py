"""The compile checker: a serialized executable is taken apart in a child process before the daemon touches it.

Why a child: `jax.export.deserialize` and the MLIR bytecode reader trust their input. One-byte edits of a
real blob made them crash (SIGSEGV) or spin forever in about 1 of 200 cases; in a child that costs the
child, not the daemon, and a hang is bounded by a timeout (the child is killed). What the child does, in
order, is what the daemon would do next — so the daemon itself only ever parses bytes that already parsed:

1. ``jax.export.deserialize`` (flatbuffer), 2. ``mlir_module()`` (StableHLO bytecode -> IR text),
3. read every ``stablehlo.custom_call`` target and compare it with the allow-list: a custom call runs a
   C++ function linked into jaxlib by name, and ``deserialize`` does not check which — host callbacks
   (``xla_python_cpu_callback``) would call into whatever Python object a pointer names,
4. lower ``jax.jit(exp.call)`` for the blob's platforms (the rewriting the daemon's compile starts with) — left
   out where the child compiles the blob next (CPU daemons), since that compile lowers it first.

Between 3 and 4, every custom call's operand and result types (and kernel attributes) are checked against
the form JAX itself writes for that kernel (`actors.signatures`): a kernel trusts them, and a LAPACK call
whose result is smaller than its operand overwrites the heap of whoever runs it.

XLA's own compile of a module that got through all four is left to the daemon (its result cannot leave a
process without pickling); it runs in a thread with a timeout (see cache.py). The child starts in the
background when the daemon starts, checks one blob at a time, exits after a minute without work, and is
replaced after every blob it refuses: fuzzing showed that a reader which rejected bad bytes without
crashing can be left corrupt, so that a later, harmless blob hangs in it.

Allowed targets (`ALLOWED_CUSTOM_CALLS`): the ones JAX itself guarantees stable for `jax.export` (LAPACK and
cuSOLVER/hipSOLVER/cuSPARSE kernels, sharding markers, device placement, ``AllocateBuffer``, the threefry
GPU kernel, Mosaic GPU and TPU kernels, shape assertions), which is also what exporting typical CPU and GPU
programs uses (tests/test_security.py exports linalg, sharding, scan, RNG and convolution programs and checks
each target they use is here). Left out on purpose: Python callbacks and ``tf.call_tf_function``, which run
host code of the controller's choosing, and Pallas kernels (``mosaic_gpu_v2``, ``tpu_custom_call``), which run device
code of the controller's choosing that no type check can vet. ``mpmd-actor --allow-custom-call NAME`` adds one
(trusted as it is: it has no signature in the table).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_LAPACK = [f"lapack_{t}{op}_ffi" for op in ("potrf", "geqrf", "syevd", "heevd", "geev", "gesdd", "getrf", "sytrd", "hetrd",
                                            "gehrd", "gees", "trsm", "gtsv", "orgqr", "ungqr") for t in "sdcz"]
_GPU = [f"{p}{k}" for p in ("cusolver_", "hipsolver_") for k in ("getrf_ffi", "geqrf_ffi", "orgqr_ffi", "potrf_ffi", "syevd_ffi",
                                                                    "gesvd_ffi", "gesvdj_ffi", "gesdd_ffi", "sytrd_ffi")]
ALLOWED_CUSTOM_CALLS = frozenset({
    *_LAPACK, *_GPU,
    "cu_lu_pivots_to_permutation", "hip_lu_pivots_to_permutation", "cusparse_gtsv2_ffi",
    "cu_threefry2x32_ffi", "hip_threefry2x32_ffi",
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement", "AllocateBuffer", "Eigh", "Qr", "ProductOfElementaryHouseholderReflectors", "LuDecomposition",
    "ApproxTopK", "stablehlo.dynamic_approx_top_k", "stablehlo.dynamic_reduce_window", "stablehlo.dynamic_rng_bit_generator",
    "stablehlo.dynamic_top_k", "shape_assertion",
})

# The pretty form `stablehlo.custom_call @name(` (or @"quoted name") and the generic form's attribute.
_TARGET = re.compile(r'stablehlo\.custom_call\s+@(?:"((?:[^"\\]|\\.)*)"|([\w$.\-]+))|call_target_name\s*=\s*"((?:[^"\\]|\\.)*)"')
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call\b")


class BlobRefused(ValueError):
    """A serialized executable the daemon will not compile; the message says why and what to do."""


class Killed(BlobRefused):
    """The compile process was killed from outside (SIGKILL) while it checked or compiled a blob: tried once more."""


def custom_call_targets(module_text: str) -> list[str]:
    """Every custom-call target named in a StableHLO module's text form, in order of appearance. A custom
    call whose target cannot be read is reported as ``<unreadable>`` (and so is never allowed)."""
    targets = [a or b or c for a, b, c in _TARGET.findall(module_text)]
    calls = len(_CUSTOM_CALL.findall(module_text))
    if calls > len(targets):
        targets += ["<unreadable>"] * (calls - len(targets))
    return targets


def disallowed(targets: Iterable[str], allowed: frozenset[str] = ALLOWED_CUSTOM_CALLS) -> list[str]:
    return sorted({t for t in targets if t not in allowed})


@dataclass(frozen=True)
class CheckResult:
    targets: tuple[str, ...]
    platforms: tuple[str, ...]
    seconds: float


_EXIT_NAMES = {-signal.SIGSEGV: "SIGSEGV", -signal.SIGABRT: "SIGABRT", -signal.SIGBUS: "SIGBUS", -signal.SIGKILL: "SIGKILL",
               -signal.SIGILL: "SIGILL", -signal.SIGFPE: "SIGFPE"}


# Blobs one child checks and compiles before a fresh one takes over: JAX's own caches in it keep every blob it
# saw (its RSS grew 73 MB per 1,000 executables, and a job that compiles without a minute's pause never replaced it;
# a probe). The next check after that many starts the fresh child (about a second, once in so many compiles).
RECYCLE_AFTER = 256
START_GRACE = 1.5  # s a compile waits for a busy compile child before another child starts (CheckerPool)


@dataclass(frozen=True)
class EarlyChild:
    """A compile child started at the daemon's start, for `devices` devices (`spawn_early`)."""

    proc: subprocess.Popen[bytes]
    devices: int


def _spawn(devices: int) -> subprocess.Popen[bytes]:
    """Start a compile child (it imports JAX, then says READY) with the daemon's environment: its XLA flags are
    part of the compilation cache's key; on the CPU, with as many devices as the daemon (sharded blobs lower
    only so)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    flags = env.get("XLA_FLAGS", "")
    if devices > 1 and "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return subprocess.Popen([sys.executable, "-m", "actors.sandbox"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def spawn_early(devices: int) -> EarlyChild | None:
    """The first compile child, started before the daemon imports JAX so that the two imports (about a second
    each) run side by side: started when the daemon was ready, the child was still importing when the first
    compile came, which waited for it (0.7 of a cold first step's 1.25 s on 1 actor here, measured 2026-12-06).
    None if it cannot start (the first check starts one and says why)."""
    try:
        return EarlyChild(_spawn(devices), devices)
    except OSError as e:
        log.warning("the compile checker did not start early: %s", e)
        return None


class BlobChecker:
    """Owns the child process; checks one blob at a time; starts a fresh child after a crash, a timeout or
    `idle` seconds without work. (The child is started with `subprocess.Popen`, which forks without running
    Python in the child: forking a process that runs JAX is safe only that way.)"""

    def __init__(self, allowed: frozenset[str] = ALLOWED_CUSTOM_CALLS, timeout: float = 600.0, idle: float = 60.0,
                 devices: int = 1) -> None:
        self.allowed = allowed
        self.timeout = timeout
        self.idle = idle
        self.devices = devices
        self.compile_dir: str | None = None  # the persistent compilation cache the child compiles into (None: no child compiles)
        self._proc: subprocess.Popen[bytes] | None = None
        # Its own threads (starting the child, reading its pipe): a compile never waits for, nor holds, a thread that
        # other requests (get, save, run) need from the event loop's default pool.
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="compile-checker")
        self._lock = asyncio.Lock()
        self._idler: asyncio.TimerHandle | None = None
        self._stage = ""
        self._prewarm: asyncio.Task[None] | None = None
        self._early: subprocess.Popen[bytes] | None = None  # a child started before the daemon imported JAX (adopt)
        self._served = 0  # blobs the current child was given
        self.on_ready: Callable[[], None] | None = None  # called when a child started in the background is up (CheckerPool)
        self.checks = 0
        self.refused = 0
        self.restarts = 0
        self._closed = False

    async def start(self) -> None:
        """Start the child now (it takes about a second to import JAX) so the first compile does not wait."""
        async with self._lock:
            await self._in_thread(self._ensure)
            if self._idler is not None:
                self._idler.cancel()
            self._idler = asyncio.get_running_loop().call_later(self.idle, self._stop_soon)

    async def _start_quietly(self) -> None:
        try:
            await self.start()
        except Exception as e:  # the next check starts it (and reports what goes wrong)
            log.warning("the compile checker did not restart: %s", e)
            return
        if self.on_ready is not None:  # (a check waiting for the pool may take this child now, not after its grace)
            self.on_ready()

    def adopt(self, early: EarlyChild | None) -> None:
        """Take a child `spawn_early` started before the daemon imported JAX, if it was started for as many devices
        as this checker's (else it is stopped): the first `start` reads its READY instead of starting one."""
        if early is None:
            return
        if early.devices != self.devices or self._proc is not None:
            early.proc.kill()
            early.proc.wait()
            return
        self._early = early.proc

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        for attempt in range(2):  # (once more: a child killed from outside as it started failed the step; a soak probe)
            proc, self._early = self._early or _spawn(self.devices), None
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() == b"READY":
                self._proc, self._served = proc, 0
                return proc
            try:  # (its exit, before any kill of ours: at end of output it is exiting; one that said something else is
                # stopped here, and not said to be "killed by signal 9")
                code = proc.wait(5) if not line else proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is None:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"the compile checker did not start: it said {line[:200]!r} instead of READY (stopped)")
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            if attempt:
                raise RuntimeError(f"the compile checker did not start, twice (its process {how}, having said {line[:200]!r})")
            log.warning("the compile checker did not start (its process %s, having said %r); starting it again", how, line[:200])
        raise AssertionError("unreachable")

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def check(self, blob: bytes, compile_spec: dict[str, Any] | None = None) -> CheckResult:
        """Take `blob` apart in the child; raises BlobRefused naming what was wrong. With `compile_spec` (and a
        `compile_dir`), the child then compiles it into the persistent compilation cache, so that the daemon's own
        compile only loads the result: a compile past the timeout is stopped by killing the child, which frees its
        cores at once (a compile thread in the daemon could not be stopped)."""
        async with self._lock:
            if self._idler is not None:
                self._idler.cancel()
            self.checks += 1
            if self._served >= RECYCLE_AFTER and self._proc is not None:  # (its JAX caches hold every blob it saw)
                self._kill()
            try:
                try:
                    return await self._check_and_compile(blob, compile_spec)
                except Killed as e:  # from outside, not by the blob: once more, in a fresh process
                    if self._closed:
                        raise
                    log.warning("%s; checking and compiling it once more in a fresh process", str(e).split(";")[0])
                try:
                    return await self._check_and_compile(blob, compile_spec)
                except Killed:
                    raise BlobRefused(f"the process {self._stage} was killed twice (SIGKILL), most likely by the kernel's "
                                      "out-of-memory killer because compiling this executable takes more memory than is "
                                      "free (see dmesg): give the stage less to compile (split it), free memory, or raise "
                                      "the container's limit; the daemon is unaffected") from None
            except BlobRefused:
                # A reader that choked on bad bytes without crashing may be left corrupt (fuzzing saw later,
                # harmless blobs hang in such a process): the next blob gets a fresh child.
                self.refused += 1
                self._kill()
                self._prewarm = asyncio.get_running_loop().create_task(self._start_quietly())  # the next one starts now
                raise
            except asyncio.CancelledError:  # (its child was killed) the next compile should not wait for a start
                self._prewarm = asyncio.get_running_loop().create_task(self._start_quietly())
                raise
            finally:
                self._served += 1  # (after the work: a child started for this blob counts it)
                self._idler = asyncio.get_running_loop().call_later(self.idle, self._stop_soon)

    async def _check_and_compile(self, blob: bytes, compile_spec: dict[str, Any] | None) -> CheckResult:
        compiles = compile_spec is not None and self.compile_dir is not None
        result = await self._check(blob, compiled_next=compiles)
        if compiles:
            await self._compile(compile_spec)
        return result

    async def _compile(self, spec: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None:
            raise BlobRefused("the compile checker went away before compiling the executable; send it again")
        payload = b"C" + json.dumps({**spec, "cache_dir": self.compile_dir}).encode()
        report = await self._report(
            proc, payload, "compiling it",
            lambda: f"the executable did not compile within {self.timeout:g} s (mpmd-actor --compile-timeout); its compile "
                    "was stopped (the process compiling it was killed, so it uses no cores now). Split the stage, or start "
                    "mpmd-actor with a longer --compile-timeout",
            lambda how: f"the executable was refused: it crashed XLA's compiler ({how}) in the compile process; the daemon "
                        "is unaffected")
        if not report.get("ok"):
            raise BlobRefused(f"the executable did not compile: {report.get('error', 'unknown error')}")

    async def _report(self, proc: subprocess.Popen[bytes], payload: bytes, stage: str, timed_out: Callable[[], str],
                      crashed: Callable[[str], str]) -> dict:
        """The child's report on `payload` (`_exchange` in a thread), within the timeout. The child is stopped when
        the request gives up (its state is unknown, and a compile would run on after nobody waits for it) or the
        timeout passes: then BlobRefused(timed_out()); BlobRefused(crashed(how it exited)) when the child died."""
        exchange = asyncio.ensure_future(self._in_thread(self._exchange, proc, payload, stage))
        try:
            done, _ = await asyncio.wait({exchange}, timeout=self.timeout)
        except asyncio.CancelledError:
            self._kill()
            raise
        if not done:
            self._kill()  # the reading thread sees the pipe close and ends
            await asyncio.wait({exchange})
            self.restarts += 1
            raise BlobRefused(timed_out())
        report = exchange.result()
        if report is None:
            code = await self._in_thread(proc.wait)
            self._proc = None
            self.restarts += 1
            if code == -signal.SIGKILL:  # nothing in the process sends itself SIGKILL: the OOM killer, or kill -9
                raise Killed(f"the process {stage} was killed (SIGKILL: the kernel's out-of-memory killer, or kill -9 — see "
                             "dmesg), which says nothing about the executable; if memory is short, free some or give the "
                             "stage less to compile, and call the step again (the daemon is unaffected)")
            raise BlobRefused(crashed(_EXIT_NAMES.get(code, f"exit code {code}")))
        return report

    def _exchange(self, proc: subprocess.Popen[bytes], blob: bytes, stage: str = "deserializing it") -> dict | None:
        """Send a message (its kind byte first: B a blob to check, b one to check whose compile follows, C that
        compile), read the child's reports; the verdict, or None if the child died (runs in a thread)."""
        assert proc.stdin is not None and proc.stdout is not None
        self._stage = "sending it"
        try:
            proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        self._stage = stage
        while True:
            line = proc.stdout.readline()
            if not line:
                return None
            report = json.loads(line)
            if "stage" not in report:
                return report
            self._stage = report["stage"]

    async def _check(self, blob: bytes, compiled_next: bool = False) -> CheckResult:
        t = time.monotonic()
        proc = await self._in_thread(self._ensure)
        # (the kind byte is always ours: a blob starting with "C" was taken for a compile command, of JSON of the
        # sender's choosing, and its check passed with no custom calls)
        report = await self._report(
            proc, (b"b" if compiled_next else b"B") + blob, "deserializing it",
            lambda: f"the executable was refused: {self._stage} did not finish within {self.timeout:g} s (the checker was "
                    "stopped); the blob is corrupt or hostile, or mpmd-actor --compile-timeout is too short for it",
            lambda how: f"the executable was refused: it crashed the compile checker ({how}) while {self._stage}; the blob "
                        "is corrupt or hostile (the daemon is unaffected)")
        if not report.get("ok"):
            raise BlobRefused(f"the executable was refused while {self._stage}: {report.get('error', 'unknown error')}")
        targets = tuple(report.get("targets", ()))
        bad = disallowed(targets, self.allowed)
        if bad:
            raise BlobRefused(f"the executable calls custom call target{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}, "
                              "which this actor does not allow (custom calls run native code by name; host callbacks "
                              "cannot work remotely). If it is a kernel you trust, start mpmd-actor with "
                              f"--allow-custom-call {bad[0]}")
        wrong = report.get("wrong") or {}
        checked = {t: why for t, why in wrong.items() if t in ALLOWED_CUSTOM_CALLS or t == "<unreadable>"}
        if checked:  # (a target the operator added with --allow-custom-call has no table: it is trusted as it is)
            target, why = next(iter(sorted(checked.items())))
            raise BlobRefused(f"the executable was refused: {why}")
        return CheckResult(targets, tuple(report.get("platforms", ())), time.monotonic() - t)

    @property
    def ready(self) -> bool:
        """Its child is up, waiting for a blob: a check given to it now starts at once (unless one is under way)."""
        return self._proc is not None and self._proc.poll() is None

    def _stop_soon(self) -> None:
        if not self._lock.locked():
            self._kill()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            proc.wait()

    def close(self) -> None:
        self._closed = True  # (a check its kill ends now is not tried again)
        if self._idler is not None:
            self._idler.cancel()
        if self._prewarm is not None:
            self._prewarm.cancel()
        if self._early is not None:  # (adopted, never started: it would exit at its stdin's end, but not at once)
            self._early.kill()
            self._early.wait()
            self._early = None
        self._kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


class CheckerPool:
    """A few checkers (child processes), each checking and compiling one blob at a time: one slow compile
    does not hold up the others, and every compile is bounded and stoppable.

    A check goes to a free checker whose child is up (the first such in order, so the same few stay warm). When
    none is, it waits for whichever comes first — a check under way ending, or a child starting — and takes a free
    checker whose child is down only when there is nothing to wait for: a child's start (importing JAX, ~1.2 s of
    a core here) took longer than the compiles queued behind a warm one. Handed out in turn, the second compile of
    a daemon's life started the second child: 1.7 s for a blob that compiles in 0.22 s, and a 2-actor 1F1B step's
    first call waited 3.5 s for its 4 executables per actor (measured 2026-12-06). A check that has waited
    `start_grace` seconds (default: none on a daemon that may use 4 cores or more, else START_GRACE) starts one more
    child in the background, so that a long or hostile compile does not hold up the others for long."""

    def __init__(self, checkers: Sequence[BlobChecker], start_grace: float | None = None) -> None:
        self.checkers = list(checkers)
        self._free = list(self.checkers)  # in the pool's order
        self._starting: set[BlobChecker] = set()  # free, but their child is being started (a check would wait for it)
        self._changed: asyncio.Event | None = None  # set when a checker comes back or a child is up
        self._starters: set[asyncio.Task[None]] = set()  # background starts under way (all cancelled at close)
        self._start_failed = False  # (a background start failed: none again until a check ends, or it would spin)
        if start_grace is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            start_grace = 0.0 if cores >= 4 else START_GRACE
        self.start_grace = start_grace
        for c in self.checkers:  # (a child re-started after a refused blob wakes a check waiting for the pool)
            c.on_ready = self._notify

    @property
    def compile_dir(self) -> str | None:
        return self.checkers[0].compile_dir

    @compile_dir.setter
    def compile_dir(self, path: str | None) -> None:
        for c in self.checkers:
            c.compile_dir = path

    async def check(self, blob: bytes, compile_spec: dict[str, Any] | None = None) -> CheckResult:
        checker = await self._take()
        try:
            return await checker.check(blob, compile_spec)
        finally:
            self._free.append(checker)
            self._free.sort(key=self.checkers.index)
            self._start_failed = False
            self._notify()

    async def _take(self) -> BlobChecker:
        loop = asyncio.get_running_loop()
        since = loop.time()
        while True:
            free = [c for c in self._free if c not in self._starting]
            pick = next((c for c in free if c.ready), None)
            if pick is None and free and len(self._free) == len(self.checkers) and not self._starting:
                pick = free[0]  # nothing under way to wait for: this check starts the child
            if pick is not None:
                self._free.remove(pick)
                return pick
            timeout = None
            if free and not self._starting and not self._start_failed:
                timeout = since + self.start_grace - loop.time()
                if timeout <= 0:
                    self._start(free[0])
                    timeout = None
            changed = self._changed = self._changed or asyncio.Event()
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except TimeoutError:
                pass

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _start(self, checker: BlobChecker) -> asyncio.Task[None]:
        """Start `checker`'s child in the background; checks waiting for a checker may take it once it is up."""
        self._starting.add(checker)

        async def go() -> None:
            try:
                await checker.start()
            except Exception as e:  # noqa: BLE001 - the check that takes it starts it (and says what goes wrong)
                self._start_failed = True
                log.warning("a compile checker did not start: %s", e)
            finally:
                self._starting.discard(checker)
                self._notify()

        task = asyncio.get_running_loop().create_task(go())
        self._starters.add(task)
        task.add_done_callback(self._starters.discard)
        return task

    async def start(self) -> None:
        """Start the first child now (the others start as said above)."""
        await self._start(self.checkers[0])

    def close(self) -> None:
        for task in list(self._starters):
            task.cancel()
        for c in self.checkers:
            c.close()


def build_executable(exp: Any, donate: tuple[int, ...], in_layouts: list | None, out_layouts: list | None, mesh: Any,
                     device: Any, ordered: bool) -> Any:
    """Compile a deserialized export as the daemon runs it: on `mesh` (None: one device) with its inputs laid out as
    `in_layouts`, inputs `donate`d, and (`ordered`) an order token first. The daemon and the compile child run this
    same function, so that the child's compile is the one the daemon then finds in the compilation cache."""
    return lower_executable(exp, donate, in_layouts, out_layouts, mesh, device, ordered).compile()


def warm_lowering() -> str | None:
    """Lower a tiny export the way `build_executable` lowers a step's, without compiling it. A process's first
    lowering pays ~0.2 s of JAX's one-time work (a 4-layer MLP stage's took 210-390 ms in a fresh process, 8-32 ms
    after this): the first step waited for it twice, in the compile child's check and in the daemon's load. Each
    does it at its start instead, off the first step's path. An optimisation: a failure is returned (None: warmed),
    never raised — the first compile pays for it then."""
    import jax
    import jax.numpy as jnp
    from jax import export

    try:
        blob = export.export(jax.jit(lambda a: (jnp.tanh(a @ a),)))(jax.ShapeDtypeStruct((4, 4), jnp.float32)).serialize()
        exp = export.deserialize(bytearray(blob))
        lower_executable(exp, (), None, None, None, jax.devices()[0], True)
        jax.jit(exp.call).trace(*exp.in_avals).lower(lowering_platforms=tuple(exp.platforms))  # (the check's own lowering)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def lower_executable(exp: Any, donate: tuple[int, ...], in_layouts: list | None, out_layouts: list | None, mesh: Any,
                     device: Any, ordered: bool) -> Any:
    """`build_executable` before its compile: the lowered executable."""
    import jax

    from actors import spmd
    from actors.stream import TOKEN_AVAL
    from actors.stream import ordered as with_token

    def fn(*args: Any) -> tuple:  # its outputs as a flat tuple, whatever tree the export returns (one bare array:
        return tuple(jax.tree.leaves(exp.call(*args)))  # one output, not its rows; the cache counts them so too)

    avals = list(exp.in_avals)
    if any(d >= len(avals) for d in donate):  # (jax.jit ignored them: another executable, the same program)
        raise ValueError(f"donate names input positions {sorted(d for d in donate if d >= len(avals))}, but the executable "
                         f"takes {len(avals)} inputs")
    kwargs: dict[str, Any] = {}
    if mesh is not None:  # on a device mesh every input has a layout (replicated unless said otherwise)
        shard = lambda w: spmd.sharding_of(mesh, spmd.spec_from_wire(w), device)  # noqa: E731
        kwargs["in_shardings"] = tuple(shard(w) for w in (in_layouts if in_layouts is not None else [None] * len(avals)))
        if out_layouts is not None and any(w is not None for w in out_layouts):
            kwargs["out_shardings"] = tuple(None if w is None else shard(w) for w in out_layouts)  # None: XLA chooses
    if ordered:
        fn, avals, donate = with_token(fn), [TOKEN_AVAL, *avals], tuple(d + 1 for d in donate)
        for name in ("in_shardings", "out_shardings"):
            if name in kwargs:
                kwargs[name] = (spmd.sharding_of(mesh, None, device), *kwargs[name])
    with jax.default_device(device):
        return jax.jit(fn, donate_argnums=donate, **kwargs).lower(*avals)


def _child() -> None:
    """The child's loop: 8-byte length, blob in; JSON lines out (stage reports, then the verdict)."""
    import jax
    from jax import export

    from actors.signatures import SignatureChecker, SignatureError, parse_custom_calls

    signatures = SignatureChecker()

    def say(**report: object) -> None:
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()

    inp = sys.stdin.buffer
    jax.config.update("jax_enable_x64", True)  # as the daemon runs (it is part of the compilation cache's key)
    warm_lowering()  # (while the daemon starts: the first blob's check and compile need not pay for it)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    exp: Any = None  # the last blob that passed its checks: the one a compile command compiles
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        (n,) = struct.unpack("<Q", head)
        message = inp.read(n)
        kind, blob = message[:1], message[1:]
        if kind == b"C":
            try:
                _compile_in_child(exp, json.loads(blob))
                say(ok=True)
            except Exception as e:
                say(ok=False, error=f"{type(e).__name__}: {str(e)[:1000]}")
            continue
        exp = None
        try:
            exp = export.deserialize(bytearray(blob))
            say(stage="reading its StableHLO")
            text = exp.mlir_module()
            targets = custom_call_targets(text)
            say(stage="checking its custom calls' types")
            wrong: dict[str, str] = {}
            try:
                for call in parse_custom_calls(text):
                    try:
                        signatures.check_call(call, tuple(exp.platforms))
                    except SignatureError as e:
                        wrong.setdefault(call.target, str(e)[:1500])
            except SignatureError as e:
                wrong["<unreadable>"] = str(e)[:1500]
            if kind != b"b":  # (a compile that follows lowers it for the daemon's platform first: ~10 ms saved per blob)
                say(stage="lowering it")  # harmless whatever the targets: nothing runs; the parent judges them
                jax.jit(exp.call).trace(*exp.in_avals).lower(lowering_platforms=tuple(exp.platforms))
            say(ok=True, targets=sorted(set(targets)), platforms=list(exp.platforms), wrong=wrong)
        except Exception as e:
            exp = None
            say(ok=False, error=f"{type(e).__name__}: {str(e)[:1000]}")


def _compile_in_child(exp: Any, spec: dict[str, Any]) -> None:
    """Compile the checked export `exp` as the daemon will (`spec`: donate, layouts, mesh, ordered) into the
    persistent compilation cache at spec["cache_dir"]."""
    import jax

    from actors import spmd

    if exp is None:
        raise ValueError("no checked blob to compile")
    jax.config.update("jax_compilation_cache_dir", spec["cache_dir"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    mesh = spec.get("mesh")
    device = jax.devices()[0]
    built = spmd.build_mesh(jax.devices(), mesh["shape"], mesh["axis_names"]) if mesh else None
    build_executable(exp, tuple(spec.get("donate", ())), spec.get("in_layouts"), spec.get("out_layouts"), built, device,
                     bool(spec.get("ordered")))


if __name__ == "__main__":
    _child()
