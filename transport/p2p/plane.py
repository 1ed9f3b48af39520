"""One actor's data plane: ZeroMQ sockets to every peer, and a route per peer (tcp, shm or nccl).

* Each actor binds one ROUTER (on tcp, and on ipc when given a directory) and keeps one DEALER per peer,
  connected to the peer's ipc address when both share a host, else to its tcp address.
* A dedicated thread owns the ROUTER. It reads each payload straight into a fresh 64-byte-aligned buffer
  (`recv_into`), so the receiver's JAX array aliases it: the only copies are the kernel's.
* Route ``tcp``: payloads travel as ZeroMQ frames, sent zero-copy from the sender's array.
  Route ``shm`` (same host): payloads of 64 KiB and more go through shared memory (`shm.py`); the ZeroMQ
  message is only a notice. Route ``nccl`` (GPUs): payloads go over NCCL (`nccl.py`); ZeroMQ carries a
  notice that fixes the order both sides post their NCCL calls in.

Messages (protocol framing, ``src`` = sender actor id, ``key`` = transfer key):
``data`` (one array frame), ``shm`` (seg, name, size; array metadata, no frame), ``shm_ack`` (seg),
``nccl`` (seq; array metadata, no frame).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from transport.p2p import shm
from transport.p2p.base import Mailbox, P2PTransport, TransferError, aligned_empty, host_id, host_view
from transport.protocol import ProtocolError, array_specs, aval_header, encode, parse_header

log = logging.getLogger(__name__)

SHM_MIN_BYTES = 1 << 16  # smaller payloads are cheaper as ZeroMQ frames
ROUTES = ("tcp", "shm", "nccl")


class DataPlane(P2PTransport):
    def __init__(self, actor_id: int, host: str = "127.0.0.1", ipc_dir: str | None = None, nccl_device: Any = None,
                 release_hook: Any = None) -> None:
        """`release_hook`, if given, makes the array library drop references it holds to freed host memory
        (JAX defers them); it runs every 1-16 ms while received shared-memory arrays are still out."""
        self.actor_id = actor_id
        self._release_hook = release_hook
        self._sweeper: asyncio.Task[None] | None = None
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.bind(f"tcp://{host}:0")
        self._tcp = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc = None
        if ipc_dir:
            self._router.bind(f"ipc://{ipc_dir}/p2p-{actor_id}.sock")
            self._ipc = f"ipc://{ipc_dir}/p2p-{actor_id}.sock"
        self._host = host_id()
        self._out: dict[int, zmq.Socket] = {}
        self._address: dict[int, str] = {}
        self.routes: dict[int, str] = {}
        self._shm_out: dict[int, shm.ShmSender] = {}
        self._shm_in = shm.ShmReceiver()
        self._nccl_device = nccl_device
        self._nccl: Any = None
        self._mailbox = Mailbox()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"p2p-copy-{actor_id}")
        self.counters: Counter[str] = Counter()

    # ---- wiring ----------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        return {"tcp": self._tcp, "ipc": self._ipc, "host": self._host, "shm": shm.available(), "nccl": self._nccl_ok()}

    def _nccl_ok(self) -> bool:
        if self._nccl_device is None:
            return False
        from transport.p2p import nccl

        return nccl.available()

    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._rx_loop, name=f"p2p-rx-{self.actor_id}", daemon=True)
            self._thread.start()

    async def connect(self, peers: dict[int, dict[str, Any]]) -> None:
        links = []
        for peer, spec in peers.items():
            if peer == self.actor_id:
                continue
            route, address = spec.get("route", "tcp"), spec.get("address")
            if route not in ROUTES or not isinstance(address, str):
                raise ValueError(f"peer {peer}: route must be one of {ROUTES} and address a string, got {route!r}, {address!r}")
            if route == "shm" and not shm.available():
                raise ValueError(f"actor {self.actor_id} cannot use shared memory on this platform")
            if self._address.get(peer) != address:
                old = self._out.pop(peer, None)
                if old is not None:
                    old.close(linger=0)
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.IDENTITY, str(self.actor_id).encode())
                sock.connect(address)
                self._out[peer], self._address[peer] = sock, address
            self.routes[peer] = route
            if route == "shm" and peer not in self._shm_out:
                self._shm_out[peer] = shm.ShmSender(self.actor_id, peer)
            if route == "nccl":
                links.append((self.actor_id, peer, spec["nccl_out"]))
                links.append((peer, self.actor_id, spec["nccl_in"]))
        if links:
            from transport.p2p.nccl import NcclLinks

            if self._nccl is None:
                self._nccl = NcclLinks(self, self._nccl_device)
            # Communicators are created in one global order (sorted by (sender, receiver)), so the blocking
            # initialisations of all actors meet pairwise without deadlock.
            await asyncio.to_thread(self._nccl.setup, sorted(links))

    # ---- sending ---------------------------------------------------------------------------------
    def _post(self, peer: int, header: dict[str, Any], arrays: list[np.ndarray] = (), track: bool = False) -> Any:
        sock = self._out.get(peer)
        if sock is None:
            raise TransferError(f"actor {self.actor_id} has no route to actor {peer} (key {header.get('key')}); "
                                f"connected: {sorted(self._out)}")
        header = {**header, "src": self.actor_id}
        try:
            return sock.send_multipart(encode(header, arrays), copy=False, track=track, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransferError(f"actor {self.actor_id} could not send to actor {peer}: {e}") from None

    async def send(self, peer: int, key: tuple[int, ...], value: Any, wait: bool = False) -> None:
        route = self.routes.get(peer)
        if route is None:
            raise TransferError(f"actor {self.actor_id} has no route to actor {peer} (key {key}); connected: {sorted(self.routes)}")
        if route == "nccl":
            await self._nccl.send(peer, key, value, wait)
            return
        nbytes = int(value.nbytes)
        self.counters[f"sent_{route}_bytes"] += nbytes
        if route == "shm" and nbytes >= SHM_MIN_BYTES:
            await self._send_shm(peer, key, value, nbytes)
            return
        host = await host_view(value)
        tracker = self._post(peer, {"op": "data", "key": list(key)}, [host], track=wait)
        if wait and not tracker.done:
            await asyncio.to_thread(tracker.wait)

    async def _send_shm(self, peer: int, key: tuple[int, ...], value: Any, nbytes: int) -> None:
        sender = self._shm_out[peer]
        # A new big segment costs far more (mapping and zeroing its pages) than waiting a little for one the
        # receiver is about to hand back, as happens when one step's sends start right after the last step's.
        waits = 10 if nbytes >= 4 << 20 else 0
        while waits and not sender.has_free(nbytes) and sender.in_flight(nbytes):
            await asyncio.sleep(0.0005)
            waits -= 1
        try:
            seg = sender.acquire(nbytes)
        except OSError as e:  # /dev/shm full: this payload goes as ZeroMQ frames instead
            if not self.counters["shm_fallbacks"]:
                log.warning("actor %d: no shared memory for %d bytes to actor %d (%s); sending such payloads over ZeroMQ",
                            self.actor_id, nbytes, peer, e)
            self.counters["shm_fallbacks"] += 1
            self._post(peer, {"op": "data", "key": list(key)}, [await host_view(value)])
            return
        try:
            ready = getattr(value, "is_ready", None)
            if nbytes >= 4 << 20 or (ready is not None and not ready()):
                # Waiting for the value and copying it happen in one hop on a copier thread; two copiers take
                # sends in program order, so the first activation out is the first one computed.
                await asyncio.get_running_loop().run_in_executor(self._copier, _fill, sender, seg, value)
            else:
                _fill(sender, seg, value)
            self._post(peer, {"op": "shm", "key": list(key), "seg": seg.id, "name": seg.name, "size": seg.size,
                              "arrays": [aval_header(value.shape, value.dtype)]})
        except BaseException:
            sender.give_back(seg.id)
            raise

    def _ack(self, peer: int, seg_id: int) -> None:
        try:
            self._post(peer, {"op": "shm_ack", "seg": seg_id})
        except TransferError as e:
            log.warning("actor %d: could not release shared-memory segment %d of actor %d: %s", self.actor_id, seg_id, peer, e)

    def _ack_threadsafe(self, peer: int, seg_id: int) -> None:
        if self._closing or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._ack, peer, seg_id)
        except RuntimeError:  # the loop is closed: the daemon is exiting
            pass

    # ---- receiving -------------------------------------------------------------------------------
    async def recv(self, peer: int, key: tuple[int, ...]) -> Any:
        return await self._mailbox.take(peer, key)

    def abandon(self, predicate) -> int:
        return self._mailbox.drop(predicate)

    def _rx_loop(self) -> None:
        sock = self._router
        while not self._closing:
            try:
                if not sock.poll(100):
                    continue
                self._rx_one(sock)
            except zmq.ZMQError:
                if self._closing:
                    return
                log.exception("actor %d: data-plane receive failed", self.actor_id)
            except Exception:  # never let one bad message stop the receiver
                log.exception("actor %d: data-plane receive failed", self.actor_id)

    def _rx_one(self, sock: zmq.Socket) -> None:
        sock.recv()  # the sender's identity; the header names the sender
        header = src = key = None
        try:
            if not sock.rcvmore:
                raise ProtocolError("data message has no header frame")
            header = parse_header(sock.recv())
            src, op = header.get("src"), header["op"]
            if not isinstance(src, int) or isinstance(src, bool):
                raise ProtocolError("data message has no int 'src'")
            raw_key = header.get("key")
            key = tuple(raw_key) if isinstance(raw_key, list) and all(isinstance(k, int) for k in raw_key) else None
            if op == "shm_ack":
                self._call(self._released, src, int(header["seg"]))
            elif op == "data":
                arrays = self._rx_payloads(sock, header)
                if key is None or len(arrays) != 1:
                    raise ProtocolError(f"data message needs an int-list 'key' and one array, got key {raw_key!r}")
                self.counters["received_bytes"] += arrays[0].nbytes
                self._call(self._mailbox.deliver, src, key, arrays[0])
            elif op == "shm":
                if key is None:
                    raise ProtocolError(f"shm notice needs an int-list 'key', got {raw_key!r}")
                ((dtype, shape, nbytes),) = array_specs(header)
                seg, name, size = int(header["seg"]), str(header["name"]), int(header["size"])
                try:
                    view = self._shm_in.view(src, seg, name, size, dtype, shape, nbytes, lambda: self._ack_threadsafe(src, seg))
                except (OSError, ValueError) as e:
                    raise TransferError(f"actor {self.actor_id} could not map shared memory {name} from actor {src}: {e}") from None
                self.counters["received_bytes"] += nbytes
                self._call(self._deliver_shm, src, key, view)
            elif op == "nccl":
                if key is None or self._nccl is None:
                    raise ProtocolError("nccl notice without key, or this actor has no NCCL links")
                ((dtype, shape, nbytes),) = array_specs(header)
                self._call(self._nccl.on_notice, src, key, int(header["seq"]), dtype, shape, nbytes)
            else:
                raise ProtocolError(f"unknown data-plane op {op!r}")
        except Exception as e:
            while sock.rcvmore:
                sock.recv()
            log.warning("actor %d: bad data-plane message from %s: %s", self.actor_id, src, e)
            if src is not None and key is not None:  # fail the receive now rather than let it time out
                err = e if isinstance(e, TransferError) else TransferError(f"actor {self.actor_id} got a bad transfer {key} from actor {src}: {e}")
                self._call(self._mailbox.fail, src, key, err)
        else:
            while sock.rcvmore:
                sock.recv()

    def _rx_payloads(self, sock: zmq.Socket, header: dict[str, Any]) -> list[np.ndarray]:
        arrays = []
        for dtype, shape, nbytes in array_specs(header):
            if not sock.rcvmore:
                raise ProtocolError("fewer payload frames than announced arrays")
            if nbytes == 0:
                if len(sock.recv()) != 0:
                    raise ProtocolError(f"payload for empty {dtype.name}{shape} is not empty")
                arrays.append(np.zeros(shape, dtype))
                continue
            buf = aligned_empty(nbytes)
            got = sock.recv_into(buf)
            if got != nbytes:
                raise ProtocolError(f"payload has {got} bytes, {dtype.name}{shape} needs {nbytes}")
            arrays.append(buf.view(dtype).reshape(shape))
        return arrays

    def _call(self, fn: Any, *args: Any) -> None:
        if self._loop is not None and not self._closing:
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver_shm(self, src: int, key: tuple[int, ...], view: np.ndarray) -> None:
        self._mailbox.deliver(src, key, view)
        if self._release_hook is not None and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """While received shared-memory arrays are out, have JAX drop what it holds of freed ones, so each
        segment goes back to its sender as soon as its array is gone (not at some later dispatch)."""
        delay = 0.001
        while self._shm_in.outstanding > 0 and not self._closing:
            await asyncio.sleep(delay)
            before = self._shm_in.outstanding
            self._release_hook()
            # Arrays kept for a while (activations stashed for the backward pass) need no 1 kHz polling.
            delay = 0.001 if self._shm_in.outstanding < before else min(delay * 2, 0.016)

    def _released(self, peer: int, seg_id: int) -> None:
        sender = self._shm_out.get(peer)
        if sender is not None:
            sender.release(seg_id)

    def stats(self) -> dict[str, Any]:
        out = dict(self.counters)
        out["routes"] = {str(p): r for p, r in sorted(self.routes.items())}
        out["shm_segments"] = sum(s.created for s in self._shm_out.values())
        out["shm_in_use"] = sum(len(s.busy) for s in self._shm_out.values())
        return out

    def close(self) -> None:
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._nccl is not None:
            self._nccl.close()
        for sender in self._shm_out.values():
            sender.close()
        self._shm_in.close()
        for sock in self._out.values():
            sock.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()
        self._copier.shutdown(wait=False, cancel_futures=True)


def _fill(sender: shm.ShmSender, seg: shm.Segment, value: Any) -> None:
    """Copy `value` (waiting until it is computed) into `seg`; runs on a copier thread for big payloads."""
    host = np.asarray(value)
    sender.write(seg, host if host.flags.c_contiguous else np.ascontiguousarray(host))
