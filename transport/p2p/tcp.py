"""TCP data plane over ZeroMQ: each actor binds one ROUTER for incoming data and keeps one DEALER per peer.

Payload frames are sent zero-copy (ZeroMQ keeps a reference to the numpy view until the bytes are on the
wire) and received without a copy (`copy=False`); the receiver's single copy is the move into a JAX array.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import zmq
import zmq.asyncio

from transport.control import bind_router
from transport.p2p.base import Mailbox, P2PTransport, TransferError
from transport.protocol import ProtocolError, decode, encode

log = logging.getLogger(__name__)


class TcpTransport(P2PTransport):
    def __init__(self, actor_id: int, host: str = "127.0.0.1") -> None:
        self.actor_id = actor_id
        self._ctx = zmq.asyncio.Context.instance()
        self._router, self._address = bind_router(self._ctx, f"tcp://{host}:0")
        self._peers: dict[int, zmq.asyncio.Socket] = {}
        self._mailbox = Mailbox()
        self._reader: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self._address

    async def start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            try:
                identity, *frames = await self._router.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                msg = decode(frames)
                src = int(msg.header["src"])
                key = tuple(msg.header["key"])
                if len(msg.arrays) != 1:
                    raise ProtocolError(f"data message carries {len(msg.arrays)} arrays, expected 1")
            except (ProtocolError, KeyError, TypeError, ValueError) as e:
                log.warning("actor %d: dropped malformed data message: %s", self.actor_id, e)
                continue
            self._mailbox.deliver(src, key, msg.arrays[0])

    async def connect(self, peers: dict[int, str]) -> None:
        for peer, address in peers.items():
            if peer == self.actor_id or peer in self._peers:
                continue
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.IDENTITY, str(self.actor_id).encode())
            sock.connect(address)
            self._peers[peer] = sock

    async def send(self, peer: int, key: tuple[int, ...], array: np.ndarray) -> None:
        sock = self._peers.get(peer)
        if sock is None:
            raise TransferError(
                f"actor {self.actor_id} has no connection to actor {peer} (key {key}); connected: {sorted(self._peers)}"
            )
        await sock.send_multipart(encode({"op": "data", "src": self.actor_id, "key": list(key)}, [array]), copy=False)

    async def recv(self, peer: int, key: tuple[int, ...]) -> np.ndarray:
        return await self._mailbox.take(peer, key)

    def abandon(self, predicate) -> int:
        return self._mailbox.drop(predicate)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for sock in self._peers.values():
            sock.close(linger=0)
        self._router.close(linger=0)
