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

Multi-device actors: only device arrays on the actor's first device are handled (one shard).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transport.p2p.base import TransferError
from transport.protocol import PACKED_DTYPES, aval_header

log = logging.getLogger(__name__)

# dtypes cupy (and so DLPack into cupy) can represent; others cross as their raw bytes
CUPY_DTYPES = frozenset(("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
                         "float64", "complex64", "complex128"))


def available() -> bool:
    try:
        from cupy.cuda import nccl  # noqa: F401

        return True
    except Exception:
        return False


def unique_id() -> list[int]:
    from cupy.cuda import nccl

    return [int(c) for c in nccl.get_unique_id()]


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
    seq: itertools.count = field(default_factory=itertools.count)
    expect: int = 0
    notices: dict[int, tuple] = field(default_factory=dict)


async def _until(event: Any) -> None:
    delay = 20e-6
    while not event.done:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1e-3)


class NcclLinks:
    def __init__(self, plane: Any, device: Any) -> None:
        import cupy
        from cupy.cuda import nccl

        self.cp, self.nccl = cupy, nccl
        self.plane = plane
        self.device_id = int(getattr(device, "local_hardware_id", None) or getattr(device, "id", 0) or 0)
        self.out: dict[int, Link] = {}
        self.inn: dict[int, Link] = {}

    def setup(self, links: list[tuple[int, int, list[int]]]) -> None:
        """Create the communicators for (sender, receiver, unique id) links, in the given order. Blocks."""
        me = self.plane.actor_id
        with self.cp.cuda.Device(self.device_id):
            for src, dst, uid in links:
                if (dst if src == me else src) in (self.out if src == me else self.inn):
                    continue
                rank = 0 if src == me else 1
                comm = self.nccl.NcclCommunicator(2, tuple(uid), rank)
                link = Link(comm, self.cp.cuda.Stream(non_blocking=True))
                if rank == 0:
                    self.out[dst] = link
                else:
                    self.inn[src] = link

    async def send(self, peer: int, key: tuple[int, ...], value: Any, wait: bool) -> None:
        link = self.out.get(peer)
        if link is None:
            raise TransferError(f"actor {self.plane.actor_id} has no NCCL link to actor {peer} (key {key})")
        dtype = np.dtype(value.dtype)
        value_bits = as_sent(value) if dtype.name not in CUPY_DTYPES and value.size else value
        if not value_bits.is_ready():
            await asyncio.to_thread(value_bits.block_until_ready)
        nbytes = int(value_bits.nbytes)
        event = None
        with self.cp.cuda.Device(self.device_id):
            # Numbering and posting happen without an await in between, so sends hit the wire in seq order.
            seq = next(link.seq)
            if nbytes:
                buf = self.cp.from_dlpack(value_bits)
                link.comm.send(buf.data.ptr, nbytes, self.nccl.NCCL_UINT8, 1, link.stream.ptr)
                event = self.cp.cuda.Event(disable_timing=True)
                event.record(link.stream)
        self.plane._post(peer, {"op": "nccl", "key": list(key), "seq": seq, "arrays": [aval_header(value.shape, value.dtype)]})
        self.plane.counters["sent_nccl_bytes"] += nbytes
        if event is not None:
            await _until(event)  # the JAX buffer (held by `value_bits`) stays alive until NCCL has read it

    def on_notice(self, src: int, key: tuple[int, ...], seq: int, dtype: np.dtype, shape: list[int], nbytes: int) -> None:
        link = self.inn.get(src)
        if link is None:
            self.plane._mailbox.fail(src, key, TransferError(f"actor {self.plane.actor_id} has no NCCL link from actor {src}"))
            return
        link.notices[seq] = (key, dtype, shape, nbytes)
        while link.expect in link.notices:  # post receives strictly in the sender's order
            key_, dtype_, shape_, nbytes_ = link.notices.pop(link.expect)
            link.expect += 1
            with self.cp.cuda.Device(self.device_id):
                buf = self.cp.empty(nbytes_, self.cp.uint8)
                event = None
                if nbytes_:
                    link.comm.recv(buf.data.ptr, nbytes_, self.nccl.NCCL_UINT8, 0, link.stream.ptr)
                    event = self.cp.cuda.Event(disable_timing=True)
                    event.record(link.stream)
            asyncio.get_running_loop().create_task(self._deliver(src, key_, buf, event, dtype_, shape_))

    async def _deliver(self, src: int, key: tuple[int, ...], buf: Any, event: Any, dtype: np.dtype, shape: list[int]) -> None:
        import jax
        import jax.numpy as jnp

        try:
            if event is not None:
                await _until(event)
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
            try:
                link.comm.destroy()
            except Exception:
                pass
        self.out.clear()
        self.inn.clear()
