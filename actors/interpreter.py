"""The Program interpreter: one actor's loop over a step's static instruction list (Run, Send, Recv,
Delete). It is deliberately dumb (see STYLE.md): all cleverness lives in the compiler.

A `run` waits only for the buffers it reads; a `recv` is posted as a task at once (arrivals before it wait in
the mailbox); a `send` takes its buffer at once and runs as a task that never blocks the next instruction; a
`del` drops the buffer at once (a send in flight holds its own reference) unless the buffer is still being
received, in which case it waits for that buffer's sends. Runs execute in dispatch order without a round
trip through Python between them (see actors/stream.py); how transfers move bytes is actors/transfers.py.
With ``sync`` set on a run (to measure what overlap buys), every send is instead awaited where it stands,
until its bytes have left the actor, so compute stops while data moves. On CPU (`posts_first`), a Run waits
until the sends of values computed before it are posted: otherwise the copy out of the last Run's result and
the next Run share the actor's core, and the scheduler often lets the Run go first while a peer waits for the
copy (2-actor 1F1B step 126.9 -> 114.4 ms, interleaved A/B runs; MPMD_POST_FIRST=0 turns it off to compare). (Receives stay posted: the compiler
hoists them to the top of a program, and awaiting them there would deadlock a pipeline.)

What the interpreter works on is handed to it: the executable cache, the in-order stream, the transfers over
the data plane, and per step the buffer tables. It knows nothing of requests or sessions: an exception a Run
raises goes on as it was, marked with the Run's label (`failed_task`), which the error reply names as its task.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from actors.buffers import BufferTable, nbytes
from actors.cache import ExecutableCache
from actors.stream import StepTrace, Stream, now
from actors.transfers import StepKey, Transfers
from transport.program import Instruction, Program, Recv, Run, Send

log = logging.getLogger(__name__)
_TASK = "mpmd_task"  # the attribute of an exception that names the Run it came from


def failed_task(e: BaseException) -> str | None:
    """The label of the Run (e.g. ``1F3``) whose execution raised `e`, or None when no Run's did."""
    task = getattr(e, _TASK, None)
    return task if isinstance(task, str) else None


def _mark_task(e: BaseException, label: str) -> None:
    try:
        setattr(e, _TASK, label)
    except (AttributeError, TypeError):  # an exception type without attributes of its own: its reply names no task
        pass


def all_of(futs: list[asyncio.Future[Any]]) -> asyncio.Future[None]:
    """Done when every one of `futs` is, or failed as the first of them to fail (`asyncio.gather` without its
    results: gather wraps and checks each future and runs a callback of ~15 us per transfer, and a step has one
    future per Send and Recv). Every failure is marked retrieved; a cancelled one fails it as cancelled; cancelling
    it (the awaiting task cancelled) cancels every one still going, as gather does."""
    outer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left = len(futs) + 1  # (one more until every future is looked at below)

    def one(f: asyncio.Future[Any] | None) -> None:
        nonlocal left
        left -= 1
        if f is not None:
            exc = asyncio.CancelledError() if f.cancelled() else f.exception()  # (retrieved, even when late)
            if exc is not None:
                if not outer.done():
                    outer.set_exception(exc)
                return
        if left == 0 and not outer.done():
            outer.set_result(None)

    for f in futs:
        if f.done():
            one(f)
        else:
            f.add_done_callback(one)
    one(None)
    if not outer.done():
        outer.add_done_callback(lambda o: [f.cancel() for f in futs] if o.cancelled() else None)
    return outer


class Interpreter:
    """Runs Programs on one actor with its `stream`, the executables in `cache`, and `transfers`."""

    def __init__(self, stream: Stream, cache: ExecutableCache, transfers: Transfers) -> None:
        self.stream = stream
        self.cache = cache
        self.transfers = transfers
        self._out_sizes: dict[Any, list[int]] = {}  # executable key -> bytes of each output
        # On CPU, a Run dispatched while an earlier Run's output is still to be copied out and posted competes
        # with that copy for the actor's core, and the scheduler may let the Run go first for milliseconds while
        # a peer waits. So a Run waits until the sends of values computed before it have left (see `interpret`).
        self.posts_first = transfers.device.platform == "cpu" and os.environ.get("MPMD_POST_FIRST", "1") != "0"

    def forget(self, exe: Any) -> None:
        """The executable `exe` is gone from the cache."""
        self._out_sizes.pop(exe, None)

    async def run_step(self, step_key: StepKey, prog: Program, env: BufferTable, refs: list, prologue: list[Instruction],
                       session_buffers: BufferTable, sync: bool, trace: StepTrace | None = None,
                       sent: dict[int, Any] | None = None) -> Any:
        """One step of `prog` in the step's own table `env`: its inputs are `refs` (values, or futures of
        values still being computed); the `prologue`'s transfers copy arguments between actors, reading and
        writing `session_buffers` (the buffers it sends taken already: `sent`). Returns what marks the step's last Run done (Runs are dispatched
        asynchronously: it may still be computing), or None when nothing can still be running."""
        # The prologue copies arguments between actors; post it before waiting for those arguments.
        transfers = self.transfers.start(step_key, session_buffers, prologue, taken=sent)
        try:
            if trace:  # (each input still being computed or received: when it arrives, whatever is awaited then)
                for local, ref in zip(prog.inputs, refs):
                    if isinstance(ref, asyncio.Future) and not ref.done():
                        ref.add_done_callback(lambda _, local=local: trace.arrivals.setdefault(local, now()))
            for local, ref in zip(prog.inputs, refs):
                env.put(local, await asyncio.shield(ref) if isinstance(ref, asyncio.Future) else ref)
            last = await self.interpret(step_key, env, prog.instructions, sync, trace)
            await asyncio.gather(*transfers)
            return last
        finally:
            for t in transfers:
                t.cancel()

    async def interpret(self, step_key: StepKey, env: BufferTable, instrs: list[Instruction], sync: bool,
                        trace: StepTrace | None = None) -> Any:
        """Execute `instrs` in order over `env`, then wait for every transfer they started. Returns what marks
        the last Run done (None when no Run can still be computing)."""
        sends: dict[int, list[asyncio.Future[None]]] = {}
        recvs: list[asyncio.Future[None]] = []
        inflight: list[asyncio.Future[None]] = []  # sends whose buffer is already dropped from the table
        computed: list[asyncio.Future[None]] = []  # sends of computed values not yet posted (`posts_first`)
        debug = log.isEnabledFor(logging.DEBUG)
        watch = _SendWatch()
        last = None
        try:
            for ins in instrs:
                if debug:
                    log.debug("session %x program %d step %d: %s", *step_key, ins)
                if isinstance(ins, Run):
                    if computed:
                        await asyncio.gather(*computed)
                        computed.clear()
                    t0 = now() if trace else 0
                    args = env.all_now(ins.inputs)
                    if args is None:  # waits only for values still being received
                        args = await watch.inputs(env, ins.inputs)
                    try:
                        if trace:
                            results = await trace.run(self.stream, self.cache.get(ins.exe), args, str(ins.label), t0, now(),
                                                    trace.arrived(ins.inputs))
                        elif self.stream.must_await(off := self.cache.goes_off_loop(ins.exe)):
                            last, results = await self.stream.call_awaited(self.cache.get(ins.exe), args, off,
                                                                           self.cache.send_off_loop, ins.exe)
                        else:
                            last, results = self.stream.call_watched(self.cache.get(ins.exe), args, self.cache.send_off_loop, ins.exe)
                    except Exception as e:
                        _mark_task(e, str(ins.label))
                        raise
                    if ins.donate:  # their buffers now belong to the results
                        env.delete([ins.inputs[d] for d in ins.donate])
                    sizes = self._out_sizes.get(ins.exe)
                    if sizes is None:  # an executable's outputs have the same shapes every time
                        sizes = self._out_sizes[ins.exe] = [nbytes(r) for r in results]
                    for b, r, size in zip(ins.outputs, results, sizes):
                        env.put(b, r, size)
                elif isinstance(ins, (Send, Recv)):
                    t = self.transfers.start_one(step_key, env, ins, sync, trace)
                    if sync and isinstance(ins, Send):
                        await t
                    else:
                        if isinstance(ins, Send):
                            watch.add(t)
                        (sends.setdefault(ins.buf, []) if isinstance(ins, Send) else recvs).append(t)
                        # (a value still being received is not waited for: its peer may be waiting for us)
                        if self.posts_first and isinstance(ins, Send) and env.has_value(ins.buf) and not t.done():
                            computed.append(t)
                else:
                    for b in ins.bufs:
                        pending = sends.pop(b, ())
                        if pending and not env.has_value(b):  # still being received: its sends hold a future
                            await asyncio.gather(*pending)
                        inflight.extend(pending)
                    env.delete(list(ins.bufs))
            await all_of([*(t for ts in sends.values() for t in ts), *inflight, *recvs])
            return last
        except BaseException:
            for t in [*recvs, *inflight, *(t for ts in sends.values() for t in ts)]:
                t.cancel()
            raise


class _SendWatch:
    """The sends of one step, so that a wait for a received value ends with the step's error the moment one of
    them fails (its value's computation failed, say): the peer waiting for that value would otherwise wait out
    the transfer timeout, and this actor with it for the peer's reply."""

    def __init__(self) -> None:
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()  # the first error

    def add(self, t: asyncio.Future[None]) -> None:
        if t.done():
            self._settled(t)
        else:
            t.add_done_callback(self._settled)

    def _settled(self, t: asyncio.Future[None]) -> None:
        if not self.failed.done() and not t.cancelled() and t.exception() is not None:
            self.failed.set_result(t.exception())

    async def inputs(self, env: BufferTable, bufs: list[int]) -> list[Any]:
        """`bufs`' values, waiting for those being received, or the first failure of a send of this step (by
        callbacks alone: no task, and no shared future is ever cancelled)."""
        failed = self.failed
        waiting = [r for r in map(env.ref, bufs) if isinstance(r, asyncio.Future) and not r.done()]
        if waiting and not failed.done():
            woke = asyncio.get_running_loop().create_future()
            remaining = set(waiting)

            def wake(f: asyncio.Future[Any]) -> None:
                remaining.discard(f)
                if not woke.done() and (f is failed or not remaining or f.cancelled() or f.exception() is not None):
                    woke.set_result(None)

            for f in (*waiting, failed):
                f.add_done_callback(wake)
            try:
                await woke
            finally:
                for f in (*waiting, failed):
                    f.remove_done_callback(wake)
        if failed.done():
            raise failed.result()
        return [await env.get(b) for b in bufs]


__all__ = ["Interpreter", "all_of", "failed_task"]
