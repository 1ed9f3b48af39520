"""The asyncio side of the controller: a loop in a background thread, one connection per actor, and a
watchdog that turns a dead or silent actor into `ActorDiedError` within seconds instead of a hang.

An actor is declared dead when its process exits (local actors), when its connection drops while requests
wait (their replies can never come) or stays dropped `DROP_GRACE` seconds (or a fifth of `heartbeat_timeout` if
more) after requests are sent (one that dropped while idle), when it says nothing — not even to pings — for `heartbeat_timeout`
seconds, or when a request of it has waited longer than the actor's own bound on every request (its
``--request-timeout``) plus `heartbeat_timeout`. The error names the actor, its address, what it was serving
and, for a local actor, its stacks (or why there are none); `RemoteMesh.reconnect` takes it back.

Blocking user calls submit a coroutine to the loop and wait for its result (`EventLoopThread.run`); their
awaitable twins await the same coroutine from the caller's own event loop (`EventLoopThread.arun`), so that
loop keeps running while the actors work. Requests to different actors run concurrently. A blocking call
made from a thread that runs an event loop still works (this loop is another thread: no deadlock), but it
stalls that loop for as long as it waits; one that waits long logs, once, that its `_async` twin would not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import zmq.asyncio

from mpmd.errors import ActorDiedError, MpmdError, RemoteError
from transport.auth import ClientKeys
from transport.control import ConnectionLost, ControlClient, HandshakeFailed, RequestTooBig
from transport.protocol import QUEUED_BEHIND_STEPS, Message

log = logging.getLogger(__name__)
T = TypeVar("T")
STALL_WARNING = 0.1  # seconds a blocking call may hold a caller's running event loop before it is logged (once)
_stall_logged = False


def note_blocking(seconds: float, what: str = "a blocking mpmd call") -> None:
    """Log once per process when `what`, called from a thread whose event loop is running, held that loop
    for more than STALL_WARNING seconds: its awaitable twin would have let the loop run meanwhile."""
    global _stall_logged
    if _stall_logged or seconds < STALL_WARNING or asyncio._get_running_loop() is None:
        return
    _stall_logged = True
    log.warning("%s held this thread's running event loop for %.2f s; from a coroutine, await its twin instead "
                "(step.call_async, mpmd.fetch_async, mpmd.ready_async, actor.put_async / run_async, mpmd.save_async, "
                "RemoteMesh.local_async, async with mesh.trace() / mesh.profile(...), ...) so the loop keeps running", what, seconds)


@contextlib.contextmanager
def blocking(what: str) -> Iterator[None]:
    """`note_blocking` for the time the block takes (starting daemons, waiting for a save: no loop round trip)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        note_blocking(time.perf_counter() - t, what)


def close_unstarted(coro: Any) -> None:
    """Close a coroutine that will never run, and the coroutines it was given (`gather([request(...), ...])`):
    closing only the outer one leaves Python to warn "coroutine ... was never awaited" for each inner one."""
    frame = getattr(coro, "cr_frame", None)
    if frame is not None:
        for value in list(frame.f_locals.values()):
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                if asyncio.iscoroutine(inner):
                    inner.close()
    coro.close()


def close_if_unstarted(coro: Any) -> None:
    """`close_unstarted(coro)` if `coro` is a coroutine that never started; one already running is left to whoever
    awaits it (e.g. the puts of a call cancelled part-way: the started ones end with their gather)."""
    if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        close_unstarted(coro)


EXITED_HINT = ("A daemon this mesh started does not come back once it exited: a mesh made with recover=mpmd.Recovery() "
               "replaces it; without, make a new mesh.")  # (recovery.py words it otherwise once a Recovery gave up)
CLOSED_MEANWHILE = ("this RemoteMesh was closed while the request ran (mesh.close or aclose from another thread or task): "
                    "its actors and their data are gone")


class EventLoopThread:
    """An asyncio loop (uvloop when installed) running in a daemon thread."""

    def __init__(self) -> None:
        _standard_fds_open()
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.stopping = False
        self.loop.set_exception_handler(self._unhandled)
        self._thread = threading.Thread(target=self.loop.run_forever, name="mpmd-controller", daemon=True)
        self._thread.start()
        self.pid = os.getpid()  # (a forked child has no such thread: see `check_process`)

    def check_process(self, coro: Any = None) -> None:
        """Refuse a call from a process forked off the one that made this loop (closing `coro`, never started): its
        thread is not there, and a request handed to it waited for good (a probe: a DataLoader-style worker that read
        a RemoteArray hung)."""
        if os.getpid() != self.pid:
            if coro is not None:
                close_unstarted(coro)
            raise MpmdError(f"this RemoteMesh was made by process {self.pid}; a process forked from it ({os.getpid()}) cannot "
                            "use it (its controller thread and connections stay in the parent): make the mesh after the "
                            "fork, send host values to the child, or start it with multiprocessing's 'spawn' method")

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on this loop and wait for its result (from any thread but this loop's own)."""
        if threading.current_thread() is self._thread:
            close_unstarted(coro)
            raise RuntimeError("mpmd's blocking API cannot be called from its own event loop: a step's host callbacks "
                               "(jax.debug.callback, io_callback) run there, so they cannot fetch a RemoteArray "
                               "(np.asarray, mpmd.fetch) or call a step — pass the value into the step instead; code "
                               "running on that loop awaits the _async twins")
        self.check_process(coro)
        t = time.perf_counter()
        try:
            return result_of(asyncio.run_coroutine_threadsafe(coro, self.loop), timeout)
        finally:
            note_blocking(time.perf_counter() - t)

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro`, run on this loop, from the caller's own event loop (or from this one) without blocking
        it. Cancelling the await cancels `coro` where it runs."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        self.check_process(coro)
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's own cancellation
            # Cancelled over there, not by the caller: the mesh closed under it. A CancelledError would read as the
            # caller's task being cancelled.
            raise MpmdError(CLOSED_MEANWHILE) from None

    def on_loop_thread(self) -> bool:
        """Whether the caller is this loop's own thread."""
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the loop without waiting; a concurrent future of its result."""
        self.check_process(coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def dispatch(self, send: Callable[[], Any], finish: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        """Call `send()` on the loop as soon as it gets there — so what it submits is ordered, in the order
        dispatches are called, ahead of anything submitted after this call — then run `finish(sent)` (a
        coroutine) there. Returns a concurrent future of `finish`'s result, without waiting."""
        self.check_process()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def start() -> None:
            try:
                sent = send()
            except BaseException as e:
                done.set_exception(e)
                return
            task = asyncio.get_running_loop().create_task(finish(sent))

            def settle(t: asyncio.Task[Any]) -> None:
                if t.cancelled():
                    cancel_future(done)
                elif t.exception() is not None:
                    done.set_exception(t.exception())
                else:
                    done.set_result(t.result())

            task.add_done_callback(settle)

        self.call_soon(start)
        return done

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The loop's exception handler: as asyncio's, except that a request's error nobody read because the mesh
        was closing (its daemons stopped under it: "actor 0 died ... exited with code 0") is not printed as a
        traceback (a probe saw them on stderr after a close that raced saves)."""
        if self.stopping and isinstance(context.get("exception"), MpmdError):
            return
        loop.default_exception_handler(context)

    def stop(self) -> None:
        """Cancel what is still pending on the loop (a failed step's bookkeeping, batched deletes), let it
        unwind, then stop and close the loop: a task left pending would be reported at exit ("Task was
        destroyed but it is pending!")."""
        self.stopping = True
        if self.loop.is_running() and threading.current_thread() is not self._thread:
            try:
                asyncio.run_coroutine_threadsafe(_cancel_pending(), self.loop).result(timeout=5)
            except Exception:  # a task that will not unwind in time is abandoned, as before
                pass
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def _standard_fds_open() -> None:
    """Put /dev/null on any of file descriptors 0-2 this process has closed (a job started with <&- >&- 2>&-): else
    the loop's epoll descriptor may become fd 2, and libuv aborts the process (SIGABRT) when it closes it — a run
    that trained well reported as crashed (a probe); and the daemons' logs would take fds 0-1."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


async def _cancel_pending() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class ActorAuthError(MpmdError):
    """This controller and an actor could not authenticate each other (CURVE keys wrong, or on one side only)."""

    def __init__(self, actor_id: int, address: str, why: str) -> None:
        self.actor_id = actor_id
        self.address = address
        super().__init__(f"actor {actor_id} at {address}: {why}. The controller's keys (RemoteMesh.connect(..., keys=...)) "
                         "must be a pair the daemon's --authorized-keys admits, with the daemon's own public key; a daemon "
                         "without keys takes a controller without keys")


def cancel_future(fut: concurrent.futures.Future[Any]) -> None:
    """Cancel a pending concurrent future so that `concurrent.futures.wait` sees it too: `Future.cancel()` alone leaves
    it CANCELLED but not notified, and `wait` waits on it for good (a probe: a fetch_async awaited across aclose on a
    recovering mesh hung, and so did the interpreter's exit)."""
    if fut.cancel():
        fut.set_running_or_notify_cancel()


def wait_settled(futures: Any, timeout: float | None = None) -> None:
    """`concurrent.futures.wait(futures, timeout)`, also for a future another part cancelled with a bare
    `Future.cancel()` (which `wait` never sees settle); timed waits, so a Ctrl-C gets through."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for f in futures:
        while not f.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            concurrent.futures.wait([f], timeout=0.25 if left is None else min(left, 0.25))


def result_of(fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
    """`fut.result(timeout)`, in timed waits when there is no timeout: a Ctrl-C that the kernel hands to another
    of the process's threads (the controller loop, ZeroMQ's) still interrupts the waiting caller within 0.25 s
    (an untimed wait can sleep through it until the result comes)."""
    if timeout is not None:
        return fut.result(timeout)
    while True:
        try:
            return fut.result(0.25)
        except TimeoutError:
            if fut.done():  # (done just after the timed wait gave up, or its own TimeoutError: either way, its result)
                return fut.result()


def _said(x: Any) -> str:
    """A field of an error reply as text: a str as it is, anything else its repr, cut (a reply whose traceback was a
    list ended in an AttributeError inside RemoteError; a probe)."""
    return x if isinstance(x, str) else "" if x is None else repr(x)[:400]


UNOPENED_BOUND = 30.0  # seconds a request may wait for its reply before the session is open (the actor's bounds unknown)


class ActorConnection:
    """Requests to one actor; error replies become `RemoteError`, a lost actor `ActorDiedError`."""

    def __init__(self, actor_id: int, address: str, ctx: zmq.asyncio.Context, alive: Callable[[], str | None] | None,
                 stacks: Callable[[], str] | None = None, session: int = 0, keys: ClientKeys | None = None,
                 comeback: str | None = None):
        self.actor_id = actor_id
        self._comeback = comeback  # how a daemon of this kind comes back, when `reconnect` cannot take it (a rendezvous')
        self.address = address
        self.session = session  # sent with every request: the actor keeps each controller's buffers apart
        self.client = ControlClient(ctx, address, (keys.client, keys.server_key(actor_id)) if keys is not None else None)
        self._alive = alive  # returns a reason string if the actor is known dead (local process exited)
        self._stacks = stacks  # returns what a live but silent local actor's threads are doing
        self._pinging = False
        self.dead: str | None = None
        self.bound: float | None = None  # the actor's own bound on any request (its --request-timeout), from `hello`
        self.compile_bound: float | None = None  # and on a compile (its --compile-timeout and a little)
        self.keepalive: float | None = None  # ping this often when idle, so the actor keeps our session open
        self.opened = False  # our session is open there (from `hello`): an answer without it means it was lost
        self.session_gone = False  # declared lost because the daemon answers without our session

    def describe(self, proc: Any) -> None:
        """Say what `proc` (its daemon's handle: a local process, a rendezvous record) says of a lost or silent
        actor: how it died, its threads' stacks, how it comes back."""
        self._alive, self._stacks, self._comeback = proc.dead_reason, proc.stacks, getattr(proc, "comeback", None)

    @property
    def max_message(self) -> int | None:
        """The most bytes one frame to the actor may hold (its --max-message-mb, from its hello), once known."""
        return self.client.max_frame

    def learn_limits(self, info: dict[str, Any]) -> None:
        """Take the actor's bounds from its `hello` reply: on requests, on compiles, and on a silent session (its
        --session-timeout: an idle controller pings four times within it)."""
        self.bound, self.compile_bound = info.get("request_timeout"), info.get("compile_timeout")
        most = info.get("max_message_bytes")
        self.client.max_frame = most if isinstance(most, int) and most > 0 else None
        timeout = info.get("session_timeout")
        self.keepalive = max(0.05, timeout / 4) if isinstance(timeout, (int, float)) and timeout > 0 else None
        self.opened = True

    def check_size(self, what: str, arrays: Sequence[Any]) -> None:
        """An MpmdError if an array, or the arrays together, are bigger than the daemon takes in one message (its
        --max-message-mb): ZeroMQ would drop the connection for one array over it (the actor would read as lost),
        and the daemon refuses a request whose arrays together are."""
        most = self.max_message
        big = [a for a in arrays if most is not None and getattr(a, "nbytes", 0) > most]
        if big:
            a = big[0]
            raise MpmdError(f"{what}: an array of {a.nbytes / 2**20:.1f} MiB ({getattr(a, 'dtype', '')}"
                            f"{list(getattr(a, 'shape', ()))}) for actor {self.actor_id} is bigger than one message to it may be "
                            f"(its mpmd-actor --max-message-mb {most // 2**20}): start the daemon with a larger "
                            "--max-message-mb, or split the array")
        total = sum(getattr(a, "nbytes", 0) for a in arrays)
        if most is not None and total > most:  # (the daemon refuses a request whose arrays together pass it)
            raise MpmdError(f"{what}: {len(arrays)} arrays of {total / 2**20:.1f} MiB in all for actor {self.actor_id} are more than "
                            f"one message to it may hold (its mpmd-actor --max-message-mb {most // 2**20}): start the daemon "
                            "with a larger --max-message-mb, or pass fewer or smaller arrays at once")

    def _session_lost(self, said: str) -> str:
        """The daemon answers, but without this mesh's session (restarted at the same address, or it closed
        the session): everything this mesh kept there is gone, so the actor is lost (a recovery opens a new
        session there rather than start another daemon)."""
        self.session_gone = True
        return self._declare(f"the daemon there no longer has this mesh's session {self.session}: it was restarted at "
                             f"that address, or it closed the session ({said})")

    def submit(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> Coroutine[Any, Any, Message]:
        """Send a request now (call on the loop thread); await the result for the reply. Error replies become
        `RemoteError`, a lost actor `ActorDiedError`."""
        if self.dead:
            raise ActorDiedError(self.actor_id, self.dead)
        self.check_size(op, arrays)
        try:
            fut = self.client.submit(op, {"session": self.session, **(fields or {})}, arrays)
        except ConnectionLost as e:
            raise ActorDiedError(self.actor_id, str(e)) from None
        except RequestTooBig as e:
            smaller = ("load fewer microbatches or stages into one step (its Program grows with both)" if op == "load_program"
                       else "name fewer buffers or values in one call")
            raise MpmdError(f"actor {self.actor_id}: {e}: " + ("start the daemon with a larger --max-message-mb, or " if e.by_flag else "")
                            + smaller) from None
        return self._finish(fut)

    async def _finish(self, fut: asyncio.Future[Message]) -> Message:
        try:
            msg = await fut
        except ActorDiedError:
            raise
        except HandshakeFailed as e:
            if self.opened:  # it answered with our keys before: another daemon (another key) took its address
                raise ActorDiedError(self.actor_id, self._declare(
                    "the daemon this mesh talked to is gone: what answers at that address now fails the CURVE handshake "
                    f"(a daemon restarted there with another key, or an impostor; {str(e).split(': ', 1)[-1][:200]})")) from None
            raise ActorAuthError(self.actor_id, self.address, str(e).split(": ", 1)[-1]) from None
        except ConnectionLost as e:
            if self.client.closed:
                raise ActorDiedError(self.actor_id, str(e)) from None
            raise ActorDiedError(self.actor_id, await self._lost(str(e), getattr(e, "outstanding", None))) from None
        if msg.op == "error":
            h = msg.header
            if h.get("error") == "NoSession" and self.opened:
                raise ActorDiedError(self.actor_id, self._session_lost(str(h.get("message", ""))[:400]))
            raise RemoteError(self.actor_id, _said(h.get("error", "Error")), _said(h.get("message", "")), _said(h.get("traceback", "")),
                              _said(h.get("task")) or None)
        return msg

    async def request(self, op: str, fields: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> Message:
        return await self.submit(op, fields, arrays)

    async def _lost(self, why: str, outstanding: list[Any] | None) -> str:
        """Why requests to this actor cannot be answered: its exit status when it is a local process that
        exited (which happens as its connection drops), else `why`."""
        for _ in range(10):
            dead = self._alive() if self._alive else None
            if dead:
                return self._declare(dead, outstanding)
            if self._alive is None:
                break
            await asyncio.sleep(0.05)
        return self._explain(why, outstanding)

    def _explain(self, reason: str, outstanding: list[Any] | None = None) -> str:
        if outstanding is None:
            outstanding = sorted(self.client.outstanding.values(), key=lambda o: o.sent)
        doing = [o.describe() for o in outstanding if o.op != "ping"]
        if not getattr(self.client, "ever_connected", True):
            return (f"at {self.address}: no daemon ever answered there ({reason}): nothing listens at that address, or what "
                    "listens is not an mpmd-actor (no ZeroMQ handshake completed), or its host is unreachable or does not "
                    "resolve; check the address and that mpmd-actor runs there")
        text = f"at {self.address}: {reason}"
        if doing:
            text += f"\nit was serving: {'; '.join(doing[:6])}{' ...' if len(doing) > 6 else ''}"
        if self._alive is not None and self._alive():  # (a process this mesh started, exited: reconnect cannot help)
            return text + "\n" + EXITED_HINT
        if self._comeback:
            return text + "\n" + self._comeback
        return text + (f"\nIf it comes back (e.g. after `kill -CONT`, or restarted at the same address), "
                       f"mesh.reconnect({self.actor_id}) talks to it again.")

    def _declare(self, reason: str, outstanding: list[Any] | None = None) -> str:
        if self.dead is None:
            self.dead = self._explain(reason, outstanding)
            self.client.fail_pending(ActorDiedError(self.actor_id, self.dead))
        return self.dead

    def check(self, now: float, interval: float, timeout: float, tick: float) -> None:
        """Called by the watchdog every `tick`: ping a silent actor that owes replies; declare it dead when it
        has exited, when it has been silent so long that it would be past `timeout` before the next tick but one
        (so that it is declared within `timeout` of going silent), or when a request of it is overdue."""
        if self.dead:
            return
        if self.keepalive is not None and now - self.client.last_sent > self.keepalive and not self._pinging:
            # Sent nothing for a while (idle, or waiting on work sent earlier): the actor closes a session it hears
            # nothing of (mpmd-actor --session-timeout), so say something.
            self._pinging = True
            asyncio.get_running_loop().create_task(self._ping())
        if self.client.pending == 0:
            return
        reason = self._alive() if self._alive else None
        silent = self.client.silent(now)
        overdue = self._overdue(now, timeout) if reason is None else None
        dropped = getattr(self.client, "dropped_at", None)
        grace = min(max(DROP_GRACE, timeout / 5), timeout)  # (a longer heartbeat_timeout, for a flaky network, waits longer)
        if reason is None and dropped is not None and now - max(dropped, self.client.waiting_since) > grace:
            # The connection dropped (while idle: nothing was pending to fail then) and has not come back since
            # requests were sent: a daemon that lives keeps its connection, one restarted at the address reconnects
            # in well under a second. Said now instead of after heartbeat_timeout of silence (a probe: 9.7 s for a
            # killed daemon on another host, its message the same as a stopped one's).
            reason = (f"its connection dropped {now - dropped:.1f} s ago and has not come back (requests waited "
                      f"{now - max(dropped, self.client.waiting_since):.1f} s; a daemon that lives keeps its connection): its "
                      "process exited or was killed, or its host became unreachable")
        elif reason is None and silent + 2 * tick > timeout:
            reason = f"no reply or heartbeat for {silent:.1f} s (heartbeat_timeout={timeout:g} s)"
            reason += self._threads()
        elif overdue is not None:
            late, start = overdue
            since = "" if start == late.sent else " since the steps sent before it ended"
            reason = (f"its request {late.describe()} has waited {now - start:.0f} s for a reply{since}, past the actor's "
                      f"own bound of {self._bound(late.op):g} s on it (its --request-timeout or --compile-timeout) plus "
                      f"heartbeat_timeout={timeout:g} s") if self.opened else (
                      f"its request {late.describe()} has waited {now - start:.0f} s for a reply (a daemon answers a new "
                      f"session's first requests within {UNOPENED_BOUND:g} s, plus heartbeat_timeout={timeout:g} s): what "
                      "answers there keeps the connection alive but does not serve; is it an mpmd-actor of this version?")
            reason += self._threads()
        if reason is not None:
            self._declare(reason)
        elif silent > interval and not self._pinging:
            self._pinging = True
            asyncio.get_running_loop().create_task(self._ping())

    def _threads(self) -> str:
        """What a silent local actor's threads are doing, for the reason it is declared dead ('' if unknown)."""
        stacks = self._stacks() if self._stacks is not None else ""
        return f"\nits threads were at:\n{stacks}" if stacks and stacks.strip() else ""

    def _bound(self, op: str) -> float | None:
        if not self.opened:  # (before `hello` is answered the actor's bounds are unknown: a peer that answered pings
            # but never the hello held RemoteMesh.connect for good; a probe)
            return UNOPENED_BOUND
        return (self.compile_bound or self.bound) if op == "compile" else self.bound

    def _overdue(self, now: float, timeout: float) -> tuple[Any, float] | None:
        """The first request waiting past the actor's bound on it plus `timeout`, and since when its bound counts; or
        None. As on the daemon, a request that may wait on the steps sent before it (QUEUED_BEHIND_STEPS) counts
        from when they ended: while one of them has no reply yet, that one is watched instead (a queue of healthy
        steps longer than bound + heartbeat_timeout had a live actor declared lost: a review)."""
        step_before = False
        for o in self.client.outstanding.values():  # (in the order sent)
            start = o.sent
            if o.op in QUEUED_BEHIND_STEPS:
                if step_before:
                    continue
                start = max(start, o.started)
            step_before = step_before or o.op == "run_program"
            bound = self._bound(o.op)
            if bound and now - start > bound + timeout:
                return o, start
        return None

    async def _ping(self) -> None:
        try:
            self._session_kept(await self.client.request("ping", {"session": self.session}))
        except Exception:
            pass
        finally:
            self._pinging = False

    async def answers(self) -> bool:
        """Ping the daemon: whether it answers with this mesh's session open. One that answers without it (restarted,
        or it closed the session) is declared lost; one that does not answer raises ActorDiedError (the watchdog
        declares it within heartbeat_timeout)."""
        return self._session_kept(await self.request("ping", {"session": self.session}))

    def _session_kept(self, reply: Message) -> bool:
        if reply.header.get("session_open") is False and self.opened and not self.dead:
            self._session_lost(f"its pid is {reply.header.get('pid')} now; a ping found no session {self.session}")
            return False
        return True

    def close(self) -> None:
        self.client.close()


DROP_GRACE = 2.0  # seconds (or heartbeat_timeout / 5 if more) a dropped connection may stay down while requests wait


class Watchdog:
    def __init__(self, connections: list[ActorConnection], interval: float, timeout: float) -> None:
        self.connections = connections
        self.interval = interval
        self.timeout = timeout
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        tick = self.interval / 4
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            for _ in range(4):  # let the readers take replies that arrived meanwhile: those are not silence
                await asyncio.sleep(0)
            now = time.monotonic()
            lag = now - last - tick
            last = now
            if lag > self.interval / 2:
                # This loop itself did not run for a while (the caller's thread held the GIL in a long
                # compile, or the machine was swapping): that time says nothing about the actors.
                for c in self.connections:
                    c.client.last_heard = min(now, c.client.last_heard + lag)
                    c.client.waiting_since = min(now, c.client.waiting_since + lag)
                    for o in c.client.outstanding.values():
                        o.sent = min(now, o.sent + lag)
            for c in self.connections:
                c.client.poke()
                c.check(now, self.interval, self.timeout, tick)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
