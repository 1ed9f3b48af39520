"""In-order execution of an actor's Runs, and the per-instruction trace of a step.

On CPU, XLA runs computations dispatched back to back side by side, and they slow each other down (8
memory-bound stages at once ran 1.7x slower than one after another). A GPU queues them on a stream. Here
every executable takes and returns a scalar *order token*: each Run reads the token of the Run dispatched
before it, so XLA starts it the moment that one finishes — one after another like a stream, with no round
trip through Python between them, while the interpreter dispatches ahead as far as its inputs allow.

`StepTrace` records, when asked, what each instruction did and when (the actor's monotonic clock, ns): a
Run's wait for its inputs, its start and its end, each transfer's start, end, peer, bytes and tag; and the CPU
time the actor's event loop used over the step (what the runtime takes, beside the Runs, from cores the
actors share). In a
traced step each Run executes on one tracing thread that stamps its start and, after waiting for it, its end
(exact durations; the interpreter does not dispatch ahead then). It costs nothing when off.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)


def ordered(fn: Callable[..., Sequence[Any]]) -> Callable[..., tuple]:
    """`fn(*args) -> outputs` as `(token, *args) -> (token + 1, *outputs)`: the token makes XLA run calls in
    the order they were dispatched (the token of a call is ready only when the whole call is done)."""

    def with_token(token: Any, *args: Any) -> tuple:
        return (token + jnp.ones((), token.dtype), *fn(*args))

    return with_token


TOKEN_AVAL = jax.ShapeDtypeStruct((), np.int32)

# Whether this process's XLA CPU client runs every one-device computation inline in the calling thread
# (`jax_cpu_enable_async_dispatch` off: `mpmd-actor` under MPMD_CPU_INLINE=1, set by the daemon before JAX's backend
# starts). Then a Run's result is ready when its dispatch returns: no XLA worker thread is woken per Run (on this VM
# the wake-up, an IPI, was about half of a tiny Run's 125-190 us dispatch in an actor of the narrow 16-stage model),
# and its send goes out from the loop at once. What would hold the loop too long goes off it (`INLINE_FLOPS`).
INLINE_CLIENT = False
# With an inline client, a computation XLA counts this many flops for or more is dispatched from the off-loop thread,
# as a long one is with an asynchronous client (~0.1-1 ms of compute here; the thread hop costs ~0.1 ms).
INLINE_FLOPS = 1_000_000

# An executable whose outputs take this much is dispatched from a thread of its own, not the event loop's: XLA's
# CPU client runs a cheap computation (a fill, a broadcast, a copy) inline in the calling thread, and with its
# outputs' pages touched for the first time that took 7.6-9 s for 4 GiB here — the loop answered no heartbeat
# meanwhile, and the controller declared the live actor dead (a probe). A thread hop costs ~0.1 ms: nothing
# beside such outputs.
BIG_OUTPUT_BYTES = 64 << 20

# XLA's CPU client runs a computation whose cost analysis counts fewer flops than this inline in the calling thread,
# when it runs on one device and its inputs are ready (`cheap_computation_` in xla/pjrt/cpu/cpu_client.cc: "less than
# the thread context switch time"; 996 counted flops blocked the caller, 1000 did not).
CHEAP_FLOPS = 1000
# ... though a cheap-counted one may still take long without a loop: XLA counts sin, exp, erf as transcendentals,
# not flops (20 sines over 4M floats: 0 flops, 123 ms inline), and data movement as bytes.
MANY_TRANSCENDENTALS = 10_000_000

# XLA's CPU client lets 32 computations per device be in flight; the call that would make one more waits, in the
# calling thread, until one ends. With this many of the actor's Runs in flight the next is dispatched off the loop
# (the rest of the 32 left to the actor's other computations: transfers' copies, the checks of a step's inputs):
# from the loop, 64 Runs of one actor's stage dispatched back to back (`fuse=False`) held it one Run's time per Run
# past the 32nd, and the live actor was declared dead.
CROWDED = 24

# A dispatch from the event loop that took this much of the loop's CPU (seconds) sends that executable's later calls
# off the loop: a safety net for what XLA runs inline that `goes_off_loop` did not foresee.
SLOW_DISPATCH = 0.02

# An HLO while loop ("%w = (s32[], f32[4]) while(%t), condition=...") or custom call ("custom-call(%a), ...").
_LONG = re.compile(r"\s(?:while|custom-call)\(")


def output_bytes(exe: Any) -> int:
    """The bytes a compiled executable's outputs take (its order token included; 0 where jax does not say, or for
    a dtype numpy has no size of, such as a typed key's)."""
    try:
        return sum(int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize for o in jax.tree.leaves(exe.out_info))
    except (AttributeError, TypeError):
        return 0


def _devices(exe: Any) -> int:
    """How many devices a compiled executable runs over (1 where jax does not say)."""
    try:
        return max((len(s.device_set) for s in jax.tree.leaves(exe.output_shardings)), default=1)
    except Exception:  # noqa: BLE001 - (not a jax Compiled: judged as one device)
        return 1


def runs_inline_for_long(exe: Any) -> bool:
    """Whether XLA's CPU client may run a compiled executable inline in the calling thread (it counts fewer than
    `CHEAP_FLOPS`) although it may compute for long: it has a while loop, whose body XLA's count takes once
    whatever the trip count, or a custom call, whose work it does not count (LAPACK's: an SVD of a 900 x 40000
    matrix counted 900 flops and ran 3.7 s inline), or many transcendentals, or it reads or writes
    `BIG_OUTPUT_BYTES` or more. Dispatched from the event loop, such a Run held the loop for as long as it ran: a
    stage with a 12 s element-wise `lax.while_loop` answered no heartbeat, the controller declared the live actor
    dead, and a Run that never returns made the daemon deaf to its --request-timeout and to SIGTERM (a probe).
    A computation XLA runs on its own threads returns at once, loop or not: one over several devices always does
    (not judged long here; its big outputs still count, `goes_off_loop`: XLA allocates them in the dispatch, 152 ms
    for 2 GiB over 2 devices), as does one whose inputs are not computed yet (those go through the thread for
    nothing, which costs ~0.1 ms).
    With an inline client (`INLINE_CLIENT`) every one-device computation runs in the calling thread, and one counted at
    `INLINE_FLOPS` or more is judged long too.
    Where jax cannot say (an executable without a cost analysis), its loops and custom calls alone decide."""
    if _devices(exe) > 1:  # (XLA's threads run it: a 3 M-step loop over 2 devices returned in 0.3 ms, ran 10 ms)
        return False
    try:
        cost = exe.cost_analysis()
        if isinstance(cost, (list, tuple)):  # (older jax: one dict per module)
            cost = cost[0] if cost else {}
        if float(cost.get("flops", 0.0)) >= (INLINE_FLOPS if INLINE_CLIENT else CHEAP_FLOPS):
            return INLINE_CLIENT  # (an inline client runs it in the caller, too long for the loop; else XLA's threads do)
        if (float(cost.get("transcendentals", 0.0)) >= MANY_TRANSCENDENTALS
                or float(cost.get("bytes accessed", 0.0)) >= BIG_OUTPUT_BYTES):
            return True
    except Exception:  # noqa: BLE001 - no cost analysis: judged by its loops and custom calls alone
        pass
    try:
        return bool(_LONG.search(exe.as_text()))
    except Exception:  # noqa: BLE001 - no text either: dispatched as any other
        return False


def goes_off_loop(exe: Any, out_bytes: int | None = None) -> bool:
    """Whether an executable is dispatched from a thread of its own on CPU (`Stream.call_off_loop`): its outputs
    (`out_bytes`, when already known) are big (`BIG_OUTPUT_BYTES`) or it runs inline for long
    (`runs_inline_for_long`). Judged once per executable."""
    return (output_bytes(exe) if out_bytes is None else out_bytes) >= BIG_OUTPUT_BYTES or runs_inline_for_long(exe)


class Stream:
    """The order token of one actor: `call(executable, args)` runs it after everything dispatched before."""

    _off_loop_calls: concurrent.futures.ThreadPoolExecutor | None = None

    def __init__(self, device: Any, ordered_calls: bool) -> None:
        self.ordered = ordered_calls
        self._device = device
        self._where: Any = device
        self.token = jax.device_put(np.int32(0), device) if ordered_calls else None
        # Calls off the loop go through a thread on CPU only (a GPU client dispatches asynchronously); while one runs, every
        # other call waits for it (`busy`, then `idle()`): the thread's token must stay the one the next call reads.
        self.offloads = getattr(device, "platform", "cpu") == "cpu"
        self.busy: asyncio.Future[Any] | None = None
        # The tokens of the last CROWDED calls: they end in the order they were dispatched (each reads the one before).
        self._inflight: collections.deque[Any] = collections.deque(maxlen=CROWDED)

    def on_mesh(self, mesh: Any) -> None:
        """Executables now run over a device mesh: the token is replicated over it."""
        if self.ordered:
            self._where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self.token = jax.device_put(np.int32(0), self._where)
            self._inflight.clear()

    def off_mesh(self) -> None:
        """Executables run on the one device again (the mesh went with the last session)."""
        if self.ordered:
            self._where = self._device
            self.token = jax.device_put(np.int32(0), self._device)
            self._inflight.clear()

    def _healthy_token(self) -> Any:
        """The token to order the next call after, replaced by a fresh one when the call that made it failed:
        a failed call's token carries its error, and every later call that read it would fail with that error
        (XLA's "Error dispatching computation: ...", stacking up) long after the failure was reported. A call
        dispatched while a failing one still runs reads its token and fails too, as it was ordered after it."""
        token = self.token
        if token.is_ready():
            try:
                token.block_until_ready()
            except Exception as e:  # reported by whoever waits for that call's outputs (logged: it may be no one)
                log.warning("a computation failed on this actor (%s); the calls after it are ordered anew", str(e)[:300])
                self.token = token = jax.device_put(np.int32(0), self._where)
        return token

    def call(self, exe: Any, args: Sequence[Any]) -> tuple[Any, Sequence[Any]]:
        """Dispatch; returns (what marks this call done, its outputs)."""
        if not self.ordered:
            out = exe(*args)
            return out, out
        token = self._healthy_token()
        out = exe(token, *args)
        if self.token is token:  # (not if a session replaced it meanwhile, `on_mesh`/`off_mesh`, this call off the loop:
            self.token = out[0]  # the token of the old placement would fail every later call)
        self._inflight.append(out[0])
        return out[0], out[1:]

    def call_watched(self, exe: Any, args: Sequence[Any], slow: Callable[[Any, float], None], key: Any) -> tuple[Any, Sequence[Any]]:
        """`call` from the event loop, timing the dispatch's CPU: past `SLOW_DISPATCH` (XLA ran it inline, unforeseen by
        `goes_off_loop`) `slow(key, seconds)` is told, to send the executable's later calls off the loop (CPU, not wall
        time: a loop preempted on a shared core is not slow)."""
        cpu = time.thread_time()
        out = self.call(exe, args)
        if (cpu := time.thread_time() - cpu) > SLOW_DISPATCH:
            slow(key, cpu)
        return out

    def hold(self, running: asyncio.Future[Any]) -> None:
        """A call on a thread (`running`, whose result starts with its token) holds the token until it is done: calls
        dispatched meanwhile wait for it (`idle`). Ordered streams only: an unordered one, a GPU's, has no token, and
        its result would start with the outputs, which the daemon's record of a cut-off call would keep alive."""
        if not self.ordered:
            return
        self.busy = running
        running.add_done_callback(lambda _: setattr(self, "busy", None) if self.busy is running else None)

    def marker(self) -> Any:
        """What marks the last call dispatched done: its order token, or, while a call off the loop is still being
        dispatched, its thread's future (whose result's first item is that call's token; see `call`)."""
        return self.busy or self.token

    def crowded(self) -> bool:
        """Whether `CROWDED` calls are still in flight: the oldest of the last CROWDED is not done."""
        inflight = self._inflight
        return len(inflight) == CROWDED and not inflight[0].is_ready()

    def must_await(self, off: bool) -> bool:
        """Whether a call of an executable goes through `call_awaited` rather than `call`: the thread of a call off
        the loop holds the token, or this call goes off the loop (`off`: `goes_off_loop` of its executable; or too
        many calls are in flight: `crowded`)."""
        return self.busy is not None or (self.offloads and (off or self.crowded()))

    async def call_awaited(self, exe: Any, args: Sequence[Any], off: bool,
                           slow: Callable[[Any, float], None] | None = None, key: Any = None) -> tuple[Any, Sequence[Any]]:
        """`call` once no call off the loop holds the token; one that goes off the loop (see `must_await`) from a
        thread of its own; one on the loop watched as `call_watched` does when `slow` is given."""
        if self.offloads and (off or self.crowded()):
            return await self.call_off_loop(exe, args)
        await self.idle()
        return self.call_watched(exe, args, slow, key) if slow is not None else self.call(exe, args)

    async def call_off_loop(self, exe: Any, args: Sequence[Any]) -> tuple[Any, Sequence[Any]]:
        """`call` from a thread of its own (one for the actor's calls off the loop: `goes_off_loop`), the event loop serving meanwhile (its
        heartbeats too). Calls dispatched meanwhile wait (`idle`) until the thread is done with the token, also when
        the caller of this one is cancelled."""
        await self.idle()
        if Stream._off_loop_calls is None:
            Stream._off_loop_calls = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpmd-off-loop-run")
        done = asyncio.wrap_future(Stream._off_loop_calls.submit(self.call, exe, args))
        self.hold(done)
        return await asyncio.shield(done)

    async def idle(self) -> None:
        """Wait until no call off the loop holds the token (see `call_off_loop`)."""
        while (busy := self.busy) is not None:
            if busy.done():  # (its own callback, which clears `busy`, may not have run yet: awaiting a done future does
                self.busy = None  # not yield, so this loop spun for good and that callback never ran — a probe's two
                continue  # traced steps in flight hung an actor at 100 % CPU)
            try:
                await asyncio.shield(busy)
            except Exception:  # (its caller hears of its failure)
                pass


def now() -> int:
    return time.monotonic_ns()


class StepTrace:
    """What one step did on one actor, instruction by instruction (times in ns on the actor's clock).

    events: ["run", label, waited_from, inputs_ready, started, done]
            ["send", label, peer, nbytes, start, done, tag]
            ["recv", label, peer, nbytes, posted, arrived, tag]
    run_arrivals: per run event, in order, when the last of the Run's inputs that came this step (received, or
            handed in by the step's request) arrived, 0 when none did. `inputs_ready` is when the interpreter saw
            them there, later when it reached the Run late (posting the sends before it), and a simulator's gap
            counts from the arrival. (A list of its own in the record, not a 7th field of the run event: a
            controller that does not read it unpacks the events as before.)
    """

    _executor: concurrent.futures.ThreadPoolExecutor | None = None

    def __init__(self) -> None:
        self.start = now()
        self.end = 0
        self.events: list[list[Any]] = []
        self.run_arrivals: list[int] = []
        self.arrivals: dict[int, int] = {}  # buffer -> when it arrived this step (received, or an input handed in)
        self._cpu0 = time.thread_time()  # made on the event loop's thread: the runtime's own CPU (not XLA's threads')

    def arrived(self, bufs: Sequence[int]) -> int:
        """When the last of `bufs` that arrived this step did (0: none did)."""
        return max((self.arrivals.get(b, 0) for b in bufs), default=0)

    async def run(self, stream: Stream, exe: Any, args: Sequence[Any], label: str, waited_from: int, ready: int,
                  arrived: int = 0) -> Sequence[Any]:
        """Execute one Run on the tracing thread, timing it exactly; returns its outputs."""
        if StepTrace._executor is None:
            StepTrace._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpmd-traced-run")

        def timed() -> tuple[Any, Sequence[Any], int, int]:
            t0 = now()
            done, outs = stream.call(exe, args)
            jax.block_until_ready(done)
            return done, outs, t0, now()

        # The tracing thread holds the token while it runs, as a call off the loop does (`Stream.call_off_loop`):
        # a call dispatched meanwhile (an `actor.run`, say) waits for it instead of reading the token before it.
        await stream.idle()
        running = asyncio.wrap_future(StepTrace._executor.submit(timed))
        stream.hold(running)
        _, outs, t0, t1 = await asyncio.shield(running)
        self.events.append(["run", label, waited_from, ready, t0, t1])
        self.run_arrivals.append(arrived)
        return outs

    def transfer(self, kind: str, label: str, peer: int, nbytes: int, start: int, end: int, tag: int, buf: int | None = None) -> None:
        """A Send or Recv done; a Recv's `buf` arrived at `end`."""
        self.events.append([kind, label, peer, nbytes, start, end, tag])
        if buf is not None:
            self.arrivals[buf] = end

    def to_wire(self) -> dict[str, Any]:
        """The step's record; `cpu`: the CPU seconds the actor's event loop used from its start to now (called
        on the loop's thread: receiving, sending, interpreting; a traced step's Runs execute on the tracing thread)."""
        return {"start": self.start, "end": self.end, "events": self.events, "run_arrivals": self.run_arrivals,
                "cpu": time.thread_time() - self._cpu0}
