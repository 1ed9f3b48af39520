"""How a Program's Send and Recv instructions move bytes: each is started on the data plane as a future the
interpreter (actors/interpreter.py) may await or leave running.

A transfer's key is (session, program, step, tag); a sharded one travels shard by shard with the shard's
position appended. Unsharded transfers of an untraced step go without a task of their own: a receive is a
callback on its mailbox slot, and a computed send is posted at once when the data plane can post it directly
(each task turn cost ~20 us of a hop). A receive checks what arrived against the instruction's dtype and
shape and fails its buffer, naming both, when they differ or nothing came within the transfer timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import numpy as np

from actors import spmd
from actors.buffers import BufferTable
from actors.cache import ExecutableCache
from actors.stream import StepTrace, now
from transport.p2p import NothingCame, P2PTransport, TransferError
from transport.program import Instruction, Recv, Send
from transport.protocol import dtype_from_name

StepKey = tuple[int, int, int]  # (session, program, step): what a step's transfers are keyed by, before their tag


def _settle(fut: asyncio.Future[Any], task: asyncio.Future[Any]) -> None:
    """Pass `task`'s outcome on to `fut` (unless `fut` is settled already)."""
    if fut.done():
        return
    if task.cancelled():
        fut.cancel()
    elif task.exception() is not None:
        fut.set_exception(task.exception())
    else:
        fut.set_result(task.result())


class Transfers:
    """Starts Send and Recv instructions on one actor's data plane (`p2p`; None: the actor has none, and
    every transfer fails saying so). `cache` is read for the actor's device mesh, which sharded transfers
    follow; `timeout` is the seconds a receive waits for its peer, unless its session's controller set its own
    (`session_timeouts`: one job's limit is not another's on the same daemons)."""

    def __init__(self, actor_id: int, device: Any, cache: ExecutableCache, p2p: P2PTransport | None, timeout: float) -> None:
        self.actor_id = actor_id
        self.device = device
        self.cache = cache
        self.p2p = p2p
        self.timeout = timeout
        self.session_timeouts: dict[int, float] = {}  # session id -> the receive limit its controller asked for

    def timeout_of(self, key: tuple) -> float:
        """The seconds a receive keyed `key` (session first) waits for its peer."""
        return self.session_timeouts.get(key[0], self.timeout) if key else self.timeout

    def start(self, step_key: StepKey, env: BufferTable, instrs: list[Instruction], sync: bool = False,
              trace: StepTrace | None = None, taken: dict[int, Any] | None = None) -> list[asyncio.Future[None]]:
        """Start the sends and receives in `instrs` (other instructions are skipped), one future each. `taken`:
        the values (or futures) of sent buffers taken from `env` earlier (see Handlers.run_program)."""
        return [self.start_one(step_key, env, ins, sync, trace, taken) for ins in instrs if isinstance(ins, (Send, Recv))]

    def start_one(self, step_key: StepKey, env: BufferTable, ins: Send | Recv, sync: bool = False,
                  trace: StepTrace | None = None, taken: dict[int, Any] | None = None) -> asyncio.Future[None]:
        """Start one Send or Recv; its future."""
        plain = self.p2p is not None and (ins.layout is None or self.cache.mesh is None)
        if isinstance(ins, Send):
            # taken now (or before): a `del` right after the send may drop the buffer from the table
            ref = taken[ins.buf] if taken is not None and ins.buf in taken else env.ref(ins.buf)
            if plain and not sync:
                return self._send_soon(ref, ins.to_actor, (*step_key, ins.tag), ins.label, trace)
            return asyncio.create_task(self._send(ref, ins.to_actor, (*step_key, ins.tag), str(ins.label), sync, trace,
                                                  ins.layout))
        env.reserve(ins.buf)
        if plain:
            return self._recv_soon(env, ins, (*step_key, ins.tag), trace)
        return asyncio.create_task(self._recv(env, ins, (*step_key, ins.tag), trace))

    def _send_soon(self, ref: Any, peer: int, key: tuple, label: Any, trace: StepTrace | None = None) -> asyncio.Future[None]:
        """A Send as a future: posted the moment its value is there (at once if it is), through `_send` only
        for what `send_now` cannot post directly (big, NCCL or still-computing values)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def go(value: Any) -> None:
            if done.done():
                return
            try:
                t0 = now() if trace else 0
                if self.p2p.send_now(peer, key, value):
                    if trace:
                        trace.transfer("send", str(label), peer, int(value.nbytes), t0, now(), key[-1])
                    done.set_result(None)
                    return
            except BaseException as e:
                done.set_exception(e)
                return
            task = loop.create_task(self._send(value, peer, key, str(label), trace=trace))
            task.add_done_callback(lambda t: _settle(done, t))
            done.add_done_callback(lambda d: task.cancel() if d.cancelled() else None)

        if isinstance(ref, asyncio.Future):
            def ready(f: asyncio.Future[Any]) -> None:
                if f.cancelled():
                    done.cancel()
                elif f.exception() is not None:
                    if not done.done():
                        done.set_exception(f.exception())
                else:
                    go(f.result())

            if ref.done():
                ready(ref)
            else:
                ref.add_done_callback(ready)
        else:
            go(ref)
        return done

    def _recv_soon(self, env: BufferTable, ins: Recv, key: tuple, trace: StepTrace | None = None) -> asyncio.Future[None]:
        """A Recv as a future: its array goes into `env` in the callback that receives it (see `_recv`)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        peer, limit = ins.from_actor, self.timeout_of(key)
        t0 = now() if trace else 0

        def fail(e: BaseException) -> None:
            env.fail(ins.buf, e)
            done.set_exception(e)

        def then(slot: asyncio.Future[Any]) -> None:
            if done.done():
                return  # the step was aborted: its handler tells whoever waits for the buffer why
            if slot.cancelled():
                done.cancel()
                return
            exc = slot.exception()
            if exc is not None:
                fail(self._recv_timed_out(peer, ins, limit) if isinstance(exc, TimeoutError) else exc)
                return
            got = slot.result()
            bad = self._recv_mismatch(peer, ins, want, tuple(ins.shape), got)
            if bad is not None:
                fail(bad)
                return
            if isinstance(got, np.ndarray) and (self.device.platform != "cpu" or got.dtype in spmd.SUB_BYTE):
                got = spmd.to_device(got, self.device)
            env.put(ins.buf, got)
            if trace:
                trace.transfer("recv", str(ins.label), peer, int(got.nbytes), t0, now(), ins.tag, ins.buf)
            done.set_result(None)

        try:
            want = dtype_from_name(ins.dtype)
            self.p2p.recv_then(peer, key, limit, then)
        except BaseException as e:
            fail(e)
        return done

    async def _send(self, ref: Any, peer: int, key: tuple, label: str, sync: bool = False, trace: StepTrace | None = None,
                    layout: tuple | None = None) -> None:
        value = await asyncio.shield(ref) if isinstance(ref, asyncio.Future) else ref
        if self.p2p is None:
            raise TransferError(f"actor {self.actor_id} has no data plane to send {label} to actor {peer}")
        t0 = now() if trace else 0
        mesh = self.cache.mesh
        if layout is not None and mesh is not None:
            # Shard by shard, as the receiver expects: each distinct slice from the first device holding it (a
            # value in another layout is laid out first), to the same device there.
            spec = spmd.PartitionSpec(*layout)
            if not isinstance(getattr(value, "sharding", None), spmd.NamedSharding) or value.sharding.spec != spec:
                value = jax.device_put(value, spmd.NamedSharding(mesh, spec))
            shards = spmd.shards_at(value, spmd.distinct_positions(value.shape, mesh, spec))
            await asyncio.gather(*(self.p2p.send(peer, (*key, pos), data, wait=sync) for pos, data in shards))
        else:
            await self.p2p.send(peer, key, value, wait=sync)
        if trace:
            trace.transfer("send", label, peer, int(value.nbytes), t0, now(), key[-1])

    async def _recv(self, env: BufferTable, ins: Recv, key: tuple, trace: StepTrace | None = None) -> None:
        peer, label = ins.from_actor, str(ins.label)
        t0 = now() if trace else 0
        try:
            if self.p2p is None:
                raise TransferError(f"actor {self.actor_id} has no data plane to receive {label} from actor {peer}")
            want = dtype_from_name(ins.dtype)
            mesh = self.cache.mesh
            if ins.layout is not None and mesh is not None:
                spec = spmd.PartitionSpec(*ins.layout)
                positions = spmd.distinct_positions(tuple(ins.shape), mesh, spec)
                shard_shape = spmd.NamedSharding(mesh, spec).shard_shape(tuple(ins.shape))
                parts = await asyncio.gather(*(self._recv_one(peer, (*key, pos), ins, want, shard_shape) for pos in positions))
                got = spmd.assemble(tuple(ins.shape), mesh, spec, dict(zip(positions, parts)))
            else:
                got = await self._recv_one(peer, key, ins, want, tuple(ins.shape))
            # A received host array is ours alone (fresh aligned buffer, or shared memory reused only after the
            # array is gone). On CPU it stays a numpy array: an executable takes it as it is, without a copy
            # (and a forward to the next actor needs no conversion at all); elsewhere it moves to the device.
            if isinstance(got, np.ndarray) and (self.device.platform != "cpu" or got.dtype in spmd.SUB_BYTE):
                got = spmd.to_device(got, self.device)
            env.put(ins.buf, got)
            if trace:
                trace.transfer("recv", label, peer, int(got.nbytes), t0, now(), ins.tag, ins.buf)
        except asyncio.CancelledError:
            raise  # the step was aborted: its handler tells whoever waits for the buffer why (run_program)
        except BaseException as e:
            env.fail(ins.buf, e)
            raise

    async def _recv_one(self, peer: int, key: tuple, ins: Recv, want: np.dtype, shape: tuple[int, ...]) -> Any:
        try:
            got = await self.p2p.recv(peer, key, limit := self.timeout_of(key))
        except TimeoutError:
            raise self._recv_timed_out(peer, ins, limit) from None
        bad = self._recv_mismatch(peer, ins, want, shape, got)
        if bad is not None:
            raise bad
        return got

    def _recv_timed_out(self, peer: int, ins: Recv, limit: float) -> TransferError:
        return NothingCame(
            f"actor {self.actor_id} waited {limit:g} s for {ins.label} (tag {ins.tag}) from actor {peer} "
            f"and nothing came; is actor {peer} stuck? (RemoteMesh(..., transfer_timeout=s) sets this limit)")

    def _recv_mismatch(self, peer: int, ins: Recv, want: np.dtype, shape: tuple[int, ...], got: Any) -> TransferError | None:
        if np.dtype(got.dtype) == want and tuple(got.shape) == tuple(shape):
            return None
        return TransferError(f"actor {self.actor_id} expected {want.name}{list(shape)} from actor {peer} for {ins.label} "
                             f"(tag {ins.tag}), received {np.dtype(got.dtype).name}{list(got.shape)}")


__all__ = ["StepKey", "Transfers"]
