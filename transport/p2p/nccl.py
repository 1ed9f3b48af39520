"""NCCL payloads between GPU actors (`cupy.cuda.nccl`, from the ``gpu`` extra).

One communicator per direction of each actor pair: rank 0 only sends, rank 1 only receives, each on its
own CUDA stream, so transfers in both directions never wait on each other or on compute. NCCL matches
point-to-point calls by order, not by tag, so the sender numbers its sends on a link (``seq``) and posts
a ZeroMQ notice ``{"op": "nccl", key, seq, arrays: [aval]}`` with each; the receiver posts its
`ncclRecv`s strictly in ``seq`` order as the notices arrive (into a fresh device buffer), whether or not
its program has reached the matching Recv yet — the result waits in the mailbox like any arrival.

Arrays cross as raw bytes (any dtype, bfloat16 and float8 included). The sender exports the JAX buffer
with DLPack (no copy) once it is computed; the receiver hands its buffer to JAX with DLPack (no host
copy). Completion is an event recorded on the link's stream after the call.

Each link is connected when it is made (`setup`): NCCL connects a pair lazily, at its first send/recv, and that call
blocks the host until the peer makes its own first call (NVIDIA/nccl#1346), which on the event loop deadlocked the
first transfer of every link (its notice went out only after the send returned; a review).

Values not on the actor's device (host numpy shards of a multi-device actor, an array on another of its devices) are
put there first; an array spread over several devices crosses only when fully replicated (one copy).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transport.p2p.base import TransferError
from transport.protocol import PACKED_DTYPES, aval_header

log = logging.getLogger(__name__)

# The seconds a transfer waits for NCCL to complete it when the plane has no `timeout_of` (mpmd-actor
# --transfer-timeout's default): a call on a link whose peer is lost never completes.
WAIT_LIMIT = 300.0

# dtypes cupy (and so DLPack into cupy) can represent; others cross as their raw bytes
CUPY_DTYPES = frozenset(("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
                         "float64", "complex64", "complex128"))


def available() -> bool:
    """cupy's NCCL bindings and the NCCL library itself: since cupy v9 `from cupy.cuda import nccl` imports without
    the library and says so in `nccl.available` (True was said on a machine without libnccl; a review)."""
    try:
        from cupy.cuda import nccl
    except Exception:
        return False
    return bool(getattr(nccl, "available", False))


def unique_id() -> list[int]:
    """A fresh NCCL unique id as 128 byte values 0-255 (cupy >= 14 gives bytes, cupy 13 a tuple of signed chars)."""
    from cupy.cuda import nccl

    return [int(c) & 0xFF for c in nccl.get_unique_id()]


def communicator(nccl: Any, uid: Sequence[int], rank: int) -> Any:
    """Rank `rank` of the two-rank communicator of unique id `uid` (byte values, signed or not: the one place their
    form is fixed). Blocks until the other rank joins."""
    raw = bytes(int(b) & 0xFF for b in uid)
    try:  # cupy >= 14 takes `bytes commId` and refuses a tuple (cupy_backends/cuda/libs/nccl.pyx; a review)
        return nccl.NcclCommunicator(2, raw, rank)
    except TypeError as first:  # cupy < 14: a tuple of signed chars (a byte over 127 as is: OverflowError)
        try:
            return nccl.NcclCommunicator(2, tuple(b - 256 if b > 127 else b for b in raw), rank)
        except TypeError:  # (neither form: the first error is the one that says why)
            raise first from None


def device_index(device: Any) -> int:
    """The CUDA ordinal of a jax device in this process (`is not None`: an `or` chain took GPU 0's local_hardware_id 0
    for missing and used its global id instead; a review)."""
    for name in ("local_hardware_id", "id"):
        index = getattr(device, name, None)
        if index is not None:
            return int(index)
    return 0


def physical_gpu(device: Any) -> str | None:
    """Which physical GPU `device` is — its PCI bus id — or None if unknown. (Every actor sees its GPUs from 0 on,
    under its own CUDA_VISIBLE_DEVICES, so the ordinal cannot tell two actors on one GPU from two on two.)"""
    try:
        import cupy

        return str(cupy.cuda.Device(device_index(device)).pci_bus_id)
    except Exception:
        return None


def shares_gpus() -> bool:
    """This NCCL lets two ranks use one GPU: NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 (otherwise it refuses them:
    "Duplicate GPU detected", or ncclInvalidUsage from 2.30 on)."""
    if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        return False
    try:
        from cupy.cuda import nccl

        return int(nccl.get_version()) >= 23000
    except Exception:
        return False


def as_sent(value: Any) -> Any:
    """A device array of a dtype cupy lacks as the bytes NCCL carries (uint8 or wider unsigned ints): bfloat16 and the
    8-bit floats bitcast; a 4- or 2-bit array (packed on the device) widened to one byte per element, as its numpy
    form holds it (bitcasting it raised "4 * 4 != 8"; a review)."""
    import jax
    import jax.numpy as jnp

    dtype = np.dtype(value.dtype)
    if dtype.name in PACKED_DTYPES:
        if dtype.name == "float4_e2m1fn":
            return jax.lax.bitcast_convert_type(value, jnp.uint4).astype(jnp.uint8)
        wide = jnp.int8 if dtype.name.startswith("int") else jnp.uint8
        return jax.lax.bitcast_convert_type(value.astype(wide), jnp.uint8)
    return jax.lax.bitcast_convert_type(value, np.dtype(f"uint{8 * dtype.itemsize}"))


def as_received(raw: Any, dtype: np.dtype, shape: Sequence[int]) -> Any:
    """`as_sent` undone: `raw` (uint8, the bytes that arrived) as an array of `dtype` and `shape`."""
    import jax
    import jax.numpy as jnp

    if dtype.name in PACKED_DTYPES:
        if dtype.name == "float4_e2m1fn":
            return jax.lax.bitcast_convert_type(raw.astype(jnp.uint4), dtype).reshape(shape)
        if dtype.name.startswith("int"):
            raw = jax.lax.bitcast_convert_type(raw, jnp.int8)
        return raw.astype(dtype).reshape(shape)
    if dtype.itemsize > 1:
        raw = raw.reshape(*shape, dtype.itemsize)
    return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)


@dataclass
class Link:
    comm: Any
    stream: Any
    sent: int = 0  # the next send's seq
    expect: int = 0
    notices: dict[int, tuple] = field(default_factory=dict)
    # (event, buffers...) of calls NCCL may still read or write: held here until the event is done, so a task cancelled
    # while it waits does not free a buffer under NCCL (a review)
    pending: list[tuple] = field(default_factory=list)
    uid: bytes = b""  # the unique id it was made with: a wiring that gives another makes a new link (`setup`)
    closed: str | None = None  # why its communicator was aborted (`_drop_link`): its transfers end at once

    def hold(self, *entry: Any) -> None:
        self.release()
        self.pending.append(entry)

    def release(self) -> None:
        """Forget the calls NCCL is done with (kept, the last buffers of a link stayed alive until its next transfer,
        beyond their Delete: one activation per link direction more at the peak; a review)."""
        self.pending = [p for p in self.pending if not p[0].done]


def _drop_link(table: dict[int, Link], peer: int, link: Link, why: str) -> None:
    """Abort `link` and forget it as `peer`'s in `table` (if it is still the one there); `why` ends the transfers
    still waiting on it (`_until`)."""
    if table.get(peer) is link:
        del table[peer]
    if link.closed is None:
        link.closed = why
        _abort(link.comm)


async def _until(event: Any, link: Link, limit: float | None) -> None:
    """Wait for `event`, a call's completion on `link` (polled: a CUDA event has no awaitable form). TransferError
    as soon as the link is closed — its communicator aborted: the event may never complete, and what it would say
    of the bytes is not to be trusted — or once `limit` seconds have passed: NCCL waits for a lost peer for ever.
    (Unbounded, a transfer on an aborted or stalled link polled for ever, holding its buffer and its step; a review.)"""
    loop = asyncio.get_running_loop()
    deadline = None if limit is None else loop.time() + limit
    delay = 20e-6
    while True:
        if link.closed is not None:
            raise TransferError(f"its NCCL link was closed before the transfer completed ({link.closed})")
        if event.done:
            return
        if deadline is not None and loop.time() >= deadline:
            raise TransferError(f"NCCL had not completed it after {limit:g} s (a lost or stuck peer: NCCL waits for ever)")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1e-3)


class NcclLinks:
    def __init__(self, plane: Any, device: Any) -> None:
        import cupy
        from cupy.cuda import nccl

        self.cp, self.nccl = cupy, nccl
        self.plane = plane
        self.device = device
        self.device_id = device_index(device)
        self.out: dict[int, Link] = {}
        self.inn: dict[int, Link] = {}

    def setup(self, links: list[tuple[int, int, list[int]]]) -> None:
        """Create and connect the communicators for (sender, receiver, unique id) links, in the given order. Blocks."""
        me = self.plane.actor_id
        with self.cp.cuda.Device(self.device_id):
            for src, dst, uid in links:
                peer, table = (dst, self.out) if src == me else (src, self.inn)
                raw = bytes(int(b) & 0xFF for b in uid)
                old = table.get(peer)
                if old is not None and old.uid == raw:
                    continue
                if old is not None:  # (every wiring hands out fresh ids, to both sides of a pair alike: a link one side
                    # dropped after a failed call, or a restarted peer's, is made anew on both; kept, the side without
                    # one blocked in NCCL's init for good, waiting for a peer that kept its old link; a review)
                    _drop_link(table, peer, old, f"actor {me} was wired to actor {peer} again")
                rank = 0 if src == me else 1
                comm = communicator(self.nccl, uid, rank)
                link = Link(comm, self.cp.cuda.Stream(non_blocking=True), uid=raw)
                try:
                    self._connect(link, rank)
                except BaseException:
                    _abort(comm)
                    raise
                if rank == 0:
                    self.out[dst] = link
                else:
                    self.inn[src] = link

    def _connect(self, link: Link, rank: int) -> None:
        """One 1-byte transfer on a new link, waited for: NCCL connects a pair at its first send/recv, which blocks the
        host until the peer's first call (NVIDIA/nccl#1346; src/transport.cc). Both sides get here right after the
        communicator is made, in the same global order and off the event loop, so that first call happens now and
        never on the loop, where a send blocked before its notice went out (a review)."""
        probe = self.cp.zeros(1, self.cp.uint8)
        if rank == 0:
            link.comm.send(probe.data.ptr, 1, self.nccl.NCCL_UINT8, 1, link.stream.ptr)
        else:
            link.comm.recv(probe.data.ptr, 1, self.nccl.NCCL_UINT8, 0, link.stream.ptr)
        link.stream.synchronize()

    def drop(self, peer: int) -> None:
        """Abort and forget the links with `peer` (another process now: a restart); the next `setup` makes new ones,
        numbered from 0 again. Transfers still waiting on them fail at once."""
        for table in (self.out, self.inn):
            link = table.get(peer)
            if link is not None:
                _drop_link(table, peer, link, f"actor {peer} is another process now: a restart")

    def _no_link(self, what: str) -> TransferError:
        return TransferError(f"actor {self.plane.actor_id} has no NCCL link {what}: none was made, or a transfer on it failed or "
                             "stalled and it was closed (see the error of that step); a pair's NCCL links are made when the "
                             "mesh wires its data plane (at its start, and for an actor restarted and reconnected): make the "
                             "mesh again, or use transport='shm' or 'tcp'")

    def _closed(self, table: dict[int, Link], peer: int, link: Link, what: str, cause: str) -> TransferError:
        """Abort `link` after `what` (a call on it) failed; the error to raise, `cause` after "failed"."""
        _drop_link(table, peer, link, f"{what} failed{cause}")
        return TransferError(f"actor {self.plane.actor_id}: {what} failed{cause}; the link is closed until the actors are "
                             "wired again")

    def _limit(self, key: tuple[int, ...]) -> float | None:
        """The seconds a transfer keyed `key` may wait for NCCL: the receive limit of its session
        (`DataPlane.timeout_of`, set by the daemon), else `WAIT_LIMIT`."""
        timeout_of = getattr(self.plane, "timeout_of", None)
        return WAIT_LIMIT if timeout_of is None else timeout_of(key)

    def _on_device(self, value: Any, key: tuple[int, ...]) -> Any:
        """`value` as one array on this actor's device: NCCL reads device memory. Host arrays (a multi-device actor
        sends host numpy shards: actors/spmd.py) and arrays on another device are put there; an array spread over
        several devices only when fully replicated (DLPack exports one shard, while its nbytes is the whole; a review)."""
        import jax

        if not isinstance(value, jax.Array):
            return jax.device_put(np.asarray(value), self.device)
        devices = value.devices()
        if len(devices) > 1:
            if not value.is_fully_replicated:
                raise TransferError(f"actor {self.plane.actor_id}: the NCCL route sends one device's array, and {key} is split over "
                                    f"{len(devices)} devices ({value.sharding}); send it replicated, or use transport='shm'/'tcp'")
            value = next((s.data for s in value.addressable_shards if s.device == self.device), value.addressable_shards[0].data)
        return value if value.devices() == {self.device} else jax.device_put(value, self.device)

    async def send(self, peer: int, key: tuple[int, ...], value: Any, wait: bool) -> None:
        if peer not in self.out:
            raise self._no_link(f"to actor {peer} (key {key})")
        value = self._on_device(value, key)
        dtype = np.dtype(value.dtype)
        value_bits = as_sent(value) if dtype.name not in CUPY_DTYPES and value.size else value
        if not value_bits.is_ready():
            await asyncio.to_thread(value_bits.block_until_ready)
        link = self.out.get(peer)  # (again: dropped meanwhile, by a restart of the peer)
        if link is None:
            raise self._no_link(f"to actor {peer} (key {key})")
        nbytes = int(value_bits.nbytes)
        event = None
        with self.cp.cuda.Device(self.device_id):
            buf = self.cp.from_dlpack(value_bits) if nbytes else None
            # The notice goes first, so the receiver posts its receive whatever the send does; numbering, notice and
            # send happen without an await in between, so sends hit the wire in seq order. A notice that fails
            # consumes no number (it had wedged the link: the receiver waited for that seq for ever; a review).
            self.plane._post(peer, {"op": "nccl", "key": list(key), "seq": link.sent, "arrays": [aval_header(value.shape, value.dtype)]})
            link.sent += 1
            if nbytes:
                try:
                    link.comm.send(buf.data.ptr, nbytes, self.nccl.NCCL_UINT8, 1, link.stream.ptr)
                    event = self.cp.cuda.Event(disable_timing=True)
                    event.record(link.stream)
                except Exception as e:  # its receive is posted and never matched: the link is no use now
                    raise self._closed(self.out, peer, link, f"NCCL send {key} to actor {peer}", f" ({e})") from None
                link.hold(event, value_bits, buf)  # the JAX buffer stays alive until NCCL has read it
        self.plane.counters["sent_nccl_bytes"] += nbytes
        if event is not None:
            try:
                await _until(event, link, self._limit(key))
            except TransferError as e:  # (the calls after it on the link's stream would wait behind it: closed)
                raise self._closed(self.out, peer, link, f"NCCL send {key} to actor {peer}", f": {e}") from None
            link.release()

    def on_notice(self, src: int, key: tuple[int, ...], seq: int, dtype: np.dtype, shape: list[int], nbytes: int) -> None:
        link = self.inn.get(src)
        if link is None:
            self.plane._mailbox.fail(src, key, self._no_link(f"from actor {src} (key {key})"))
            return
        link.notices[seq] = (key, dtype, shape, nbytes)
        while link.expect in link.notices:  # post receives strictly in the sender's order
            key_, dtype_, shape_, nbytes_ = link.notices.pop(link.expect)
            link.expect += 1
            with self.cp.cuda.Device(self.device_id):
                buf = self.cp.empty(nbytes_, self.cp.uint8)
                event = None
                if nbytes_:
                    try:
                        link.comm.recv(buf.data.ptr, nbytes_, self.nccl.NCCL_UINT8, 0, link.stream.ptr)
                    except Exception as e:  # the sends after it would land in the wrong receives: the link is no use now
                        raise self._closed(self.inn, src, link, f"NCCL receive {key_} from actor {src}", f" ({e})") from None
                    event = self.cp.cuda.Event(disable_timing=True)
                    event.record(link.stream)
                    link.hold(event, buf)  # (NCCL writes it until the event: not freed by a cancelled _deliver)
            asyncio.get_running_loop().create_task(self._deliver(src, key_, buf, event, dtype_, shape_, link))

    async def _deliver(self, src: int, key: tuple[int, ...], buf: Any, event: Any, dtype: np.dtype, shape: list[int],
                       link: Link) -> None:
        import jax
        import jax.numpy as jnp

        try:
            if event is not None:
                try:
                    await _until(event, link, self._limit(key))
                except TransferError as e:  # (the receives after it on the link's stream would wait behind it: closed)
                    _drop_link(self.inn, src, link, f"NCCL receive {key} from actor {src} did not complete")
                    raise TransferError(f"{e}; the link is closed until the actors are wired again") from None
                link.release()
            if buf.size == 0:
                value = jnp.zeros(shape, dtype)
            elif dtype.name in CUPY_DTYPES:
                value = jax.dlpack.from_dlpack(buf.view(dtype).reshape(shape))
            else:  # bfloat16, float8, 4-bit: cupy has no such dtype; rebuilt from the bytes on the device
                value = as_received(jax.dlpack.from_dlpack(buf), dtype, shape)
            self.plane.counters["received_bytes"] += buf.size
            self.plane._arrive(src, key, value, int(buf.size))
        except Exception as e:
            self.plane._mailbox.fail(src, key, TransferError(f"actor {self.plane.actor_id}: NCCL receive {key} from actor {src} failed: {e}"))

    def close(self) -> None:
        for link in [*self.out.values(), *self.inn.values()]:
            link.closed = "the data plane closed"
            try:
                link.comm.destroy()
            except Exception:
                pass
        self.out.clear()
        self.inn.clear()


def _abort(comm: Any) -> None:
    """End a communicator whose peer is gone or whose calls may never be matched (ncclCommAbort: destroy may wait)."""
    try:
        (comm.abort if hasattr(comm, "abort") else comm.destroy)()
    except Exception:
        pass
