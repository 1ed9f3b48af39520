"""One actor's data plane: ZeroMQ sockets to every peer, and a route per peer (tcp, shm or nccl).

* Each actor binds one ROUTER (on tcp and/or on ipc in a given directory: an ipc-only local mesh needs no
  TCP listener) and keeps one DEALER per peer, dialled at its first send, to the peer's ipc address when
  both share a host, else to its tcp address.
* Authentication (given `keys`, as every daemon not started with --insecure does): the ROUTER is a CURVE
  server and every DEALER a CURVE client, all with this actor's ephemeral key pair. The controller tells
  each actor its peers' public keys (`connect`); the ZAP handler admits only those and names each
  connection by the peer's actor id, which is where a message's sender is taken from (a header's ``src``
  that disagrees is refused). A shared-memory notice is honoured only for a segment whose name is the
  sender's own (its prefix is part of its endpoint, passed on by the controller).
* Bounded: the ROUTER drops connections that send a frame over `max_message_bytes`, and a message whose frames
  pass it together is dropped once read (ZeroMQ's own bound is per frame); arrivals nobody has
  claimed are capped per peer (`ArrivalLimits`; beyond, the sender gets a ``refused`` message); a step's
  leftovers and anything arriving for it later are dropped once it is over (`expire`); arrivals for a key
  the actor does not admit (`admit`, e.g. a closed session) are refused. Log lines about bad input are
  rate-limited.
* The event loop reads the ROUTER (its descriptor is registered with the loop, one message a turn), so an
  arrival reaches the receive waiting for it with no thread hop. Each payload is copied once out of ZeroMQ's
  buffer into a fresh 64-byte-aligned one (under 1 MiB on the loop, bigger ones on a copier thread), so the
  receiver's JAX array aliases it.
* Route ``tcp``: payloads travel as ZeroMQ frames, sent zero-copy from the sender's array.
  Route ``shm`` (same host): payloads of 64 KiB and more go through shared memory (`shm.py`); the ZeroMQ
  message is only a notice. Route ``nccl`` (GPUs): payloads go over NCCL (`nccl.py`); ZeroMQ carries a
  notice that fixes the order both sides post their NCCL calls in.

Messages (protocol framing, ``src`` = sender actor id (informative when authenticated), ``key`` = transfer key):
``data`` (one array frame), ``shm`` (seg, name, size = its mapping: payload and control page; array metadata,
no frame; the receiver marks the segment released in its control page, see shm.py), ``shm_ack`` (seg: the
segment is released; accepted, no longer sent),
``nccl`` (seq; array metadata, no frame), ``refused`` (reason: the receiver dropped that arrival).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from transport.auth import Authenticator, KeyPair, configure_client, configure_server, user_id
from transport.control import HANDSHAKE_MS, allow_ipv6, tcp_endpoint
from transport.p2p import link as links
from transport.p2p import shm
from transport.p2p.base import (
    MAX_KEY_INTS,
    ArrivalLimits,
    Mailbox,
    P2PTransport,
    TransferError,
    aligned_copy,
    aligned_empty,
    computed,
    host_id,
    host_view,
)
from transport.protocol import FRAME_MARGIN_BYTES, ProtocolError, array_specs, aval_header, encode, parse_header
from transport.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

SHM_MIN_BYTES = 1 << 16  # smaller payloads are cheaper as ZeroMQ frames
BIG_PAYLOAD = 1 << 20  # received payloads this big are copied into aligned memory off the event loop
ROUTES = ("tcp", "shm", "nccl")
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024**3
REMEMBER_EXPIRED = 4096  # finished steps whose late arrivals are dropped on sight
# `refused` notices to one peer: at most this many a second (a burst of as many), so that a peer that floods us
# and never reads its notices cannot make them pile up in our send queue; the rest are only counted.
REFUSED_NOTICES_PER_SECOND = 50.0
assert links.MAX_RECORD < BIG_PAYLOAD  # a link's payload is copied out of its read buffer on the loop (_rx_payloads)
RECEIVE_QUEUE = 256  # messages per peer ZeroMQ may hold unread (a step's transfers are claimed as they come)


NCCL_ID_BYTES = 128  # an NCCL unique id (ncclUniqueId), as a list of byte values (signed or not: nccl.communicator fixes the form)


class DataPlane(P2PTransport):
    def __init__(self, actor_id: int, host: str = "127.0.0.1", ipc_dir: str | None = None, nccl_device: Any = None,
                 release_hook: Any = None, *, keys: KeyPair | None = None, tcp: bool = True,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, limits: ArrivalLimits | None = None) -> None:
        """`release_hook`, if given, makes the array library drop references it holds to freed host memory
        (JAX defers them); it runs every 2-32 ms while received shared-memory arrays are still out (and every dispatch does it too).
        `keys`: this actor's key pair; with it every connection is CURVE-authenticated and encrypted (None:
        no authentication, for daemons started with --insecure). `tcp=False` binds ipc only (needs `ipc_dir`)."""
        if not tcp and not ipc_dir:
            raise ValueError(f"actor {actor_id}: a data plane without tcp needs an ipc directory")
        self.actor_id = actor_id
        self._release_hook = release_hook
        self._sweeper: asyncio.Task[None] | None = None
        self._keys = keys
        self._ctx = zmq.Context()
        self._auth: Authenticator | None = None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # Messages ZeroMQ holds for one peer before the loop reads them: past this it stops reading that peer's
        # connection (the sender queues), so a flood is held back at the sender instead of piling up here.
        self._router.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        # (ZeroMQ's bound is per frame, see _rx_one; with CURVE it counts the encrypted frame: the margin)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + FRAME_MARGIN_BYTES)
        self._max_message = max_message_bytes
        self._router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)  # (a stranger's idle connection is dropped)
        if keys is not None:
            self._auth = Authenticator(self._ctx, f"actor {actor_id} data plane")
            self._auth.start()
            configure_server(self._router, keys)
        self._tcp = None
        if tcp:
            allow_ipv6(self._router, endpoint := tcp_endpoint(host, 0))
            self._router.bind(endpoint)
            self._tcp = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc = None
        if ipc_dir:
            self._router.bind(f"ipc://{ipc_dir}/p2p-{actor_id}.sock")
            self._ipc = f"ipc://{ipc_dir}/p2p-{actor_id}.sock"
        self._host = host_id()
        # Our segments are named <prefix><receiver>-<n>; receivers check a notice's name against it.
        self.shm_prefix = f"/mpmd-{os.getpid()}-{secrets.token_hex(4)}-{actor_id}-"
        self._out: dict[int, zmq.Socket] = {}
        self._address: dict[int, str] = {}
        self._peer_keys: dict[int, bytes] = {}
        self._peer_shm: dict[int, str] = {}
        self.routes: dict[int, str] = {}
        self._shm_out: dict[int, shm.ShmSender] = {}
        self._shm_in = shm.ShmReceiver()
        self._nccl_device = nccl_device
        self._nccl: Any = None
        self._gpu: tuple[str | None, bool] | None = None  # (PCI bus id of the NCCL device, NCCL may share it), once asked
        self._mailbox = Mailbox(limits)
        self._expired: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._expired_lengths: set[int] = set()
        self.admit: Callable[[tuple[int, ...]], str | None] | None = None  # why an arrival's key is not welcome, or None
        # the seconds a transfer keyed so may wait (its session's receive limit); bounds an NCCL call's wait (nccl.py)
        self.timeout_of: Callable[[tuple[int, ...]], float] | None = None
        self._warn = RateLimitedLog(log)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._copier = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"p2p-copy-{actor_id}")
        self._notices: dict[int, tuple[float, float]] = {}  # peer -> (refused-notice tokens left, when counted)
        self.counters: Counter[str] = Counter()
        # Same-host links (link.py): peers on this host dial ours; we dial theirs at the first message to them.
        self._listener: links.Listener | None = None
        if links.available():
            try:
                self._listener = links.Listener(actor_id)
            except OSError as e:
                log.warning("actor %d: no same-host link listener (%s); same-host peers use ZeroMQ", actor_id, e)
        self._links_out: dict[int, links.Link] = {}
        self._links_in: dict[int, links.Link] = {}
        self._peer_pid: dict[int, int] = {}
        self._peer_link: dict[int, str] = {}
        self._peer_max: dict[int, int] = {}  # peer -> the most bytes one ZeroMQ frame to it may hold (its --max-message-mb)
        self._no_link: set[int] = set()  # peers whose link failed: ZeroMQ from now on
        self._link_buf = bytearray(links.MAX_RECORD)

    # ---- wiring ----------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        """What peers need to reach this actor; with NCCL also its physical GPU (``gpu``: its PCI bus id) and whether its
        NCCL lets two ranks share one (``gpu_shared``), so the wiring keeps actors on one GPU off the NCCL route, which
        refuses them ("Duplicate GPU detected"; a review)."""
        nccl_ok = self._nccl_ok()
        if nccl_ok and self._gpu is None:
            from transport.p2p import nccl

            self._gpu = (nccl.physical_gpu(self._nccl_device), nccl.shares_gpus())
        gpu, shared = self._gpu if nccl_ok and self._gpu is not None else (None, False)
        return {"tcp": self._tcp, "ipc": self._ipc, "host": self._host, "shm": shm.available(), "nccl": nccl_ok,
                "key": self._keys.public.decode() if self._keys is not None else None, "shm_prefix": self.shm_prefix,
                "link": self._listener.name if self._listener is not None else None, "pid": os.getpid(),
                "gpu": gpu, "gpu_shared": shared}

    def _nccl_ok(self) -> bool:
        if self._nccl_device is None:
            return False
        from transport.p2p import nccl

        return nccl.available()

    async def start(self) -> None:
        if self._loop is None:
            # Arrivals are read on the event loop itself, where the receives that wait for them run: a reader
            # thread cost two GIL handoffs and a loop wake-up per message (a third of a small hop's time here).
            # Payloads of BIG_PAYLOAD bytes or more are taken zero-copy off the socket and copied into aligned
            # memory on a copier thread, so a big one never holds the loop for its memcpy.
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._router.getsockopt(zmq.FD), self._on_readable)
            self._loop.call_soon(self._on_readable)  # anything that came before the reader was added
            if self._listener is not None:
                self._loop.add_reader(self._listener.fileno(), self._on_link_dialled)

    async def connect(self, peers: dict[int, dict[str, Any]]) -> None:
        """Wire this actor to `peers`: {actor id: {address, route, key (the peer's public key; required when this
        plane is authenticated), shm_prefix (for route shm), [nccl_out, nccl_in]}}. Every spec is checked before
        anything changes. Connections are dialled at the first send, so by then every peer knows our key."""
        checked = {peer: self._check_spec(peer, spec) for peer, spec in peers.items() if peer != self.actor_id}
        links = []
        for peer, (route, address, key, prefix, spec) in checked.items():
            if self._address.get(peer) != address or self._peer_keys.get(peer) != key:
                old = self._out.pop(peer, None)
                if old is not None:
                    old.close(linger=0)
                if peer in self._address:  # another process now (restarted): its segments and ours for it are void
                    sender = self._shm_out.pop(peer, None)
                    if sender is not None:
                        sender.close()
                    self._shm_in.forget(peer)
                    self._drop_links(peer)
                    if self._nccl is not None:  # its communicators (and their seq numbers) were the old process's: new
                        self._nccl.drop(peer)  # ones are made below (setup skipped a peer that had a link; a review)
                self._address[peer] = address
                if key is not None:
                    self._peer_keys[peer] = key
                    assert self._auth is not None
                    self._auth.revoke(str(peer))  # a restarted peer has a new key; the old one is no longer it
                    self._auth.admit({key: str(peer)})
            else:  # the same peer as before: a link it dropped meanwhile (a wiring in between that gave it another
                # key: a probe) is tried again. (Its ZeroMQ connection stays: other sessions' transfers may be on it;
                # one whose handshake was refused is dialled again at its next send, see `_post`.)
                self._no_link.discard(peer)
            if prefix is not None:
                self._peer_shm[peer] = prefix
            if spec.get("max_message") is not None:
                self._peer_max[peer] = spec["max_message"]
            else:
                self._peer_max.pop(peer, None)
            self.routes[peer] = route
            if route == "shm" and spec.get("link") is not None:
                if self._peer_link.get(peer) not in (None, spec["link"]):  # another process now
                    self._drop_links(peer)
                self._peer_link[peer], self._peer_pid[peer] = spec["link"], spec["pid"]
            else:
                self._peer_link.pop(peer, None)
                self._peer_pid.pop(peer, None)
            if route == "shm" and peer not in self._shm_out:
                self._shm_out[peer] = shm.ShmSender(f"{self.shm_prefix}{peer}-")
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

    def _check_spec(self, peer: int, spec: dict[str, Any]) -> tuple[str, str, bytes | None, str | None, dict[str, Any]]:
        route, address = spec.get("route", "tcp"), spec.get("address")
        if route not in ROUTES:
            raise ValueError(f"peer {peer}: route must be one of {ROUTES}, got {route!r}")
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"peer {peer}: address must be a tcp:// or ipc:// endpoint, got {address!r} (an actor started "
                             "with --p2p ipc has no tcp endpoint: actors on other hosts cannot reach it)")
        if route == "shm" and not shm.available():
            raise ValueError(f"actor {self.actor_id} cannot use shared memory on this platform")
        if route == "nccl":  # (checked here, before anything changes: the route was set, then a bare KeyError; a probe)
            if not self._nccl_ok():
                raise ValueError(f"peer {peer}: route nccl, but actor {self.actor_id} has no NCCL (a GPU daemon with nccl installed)")
            for field in ("nccl_out", "nccl_in"):
                uid = spec.get(field)
                if (not isinstance(uid, (list, tuple)) or len(uid) != NCCL_ID_BYTES
                        or not all(isinstance(b, int) and not isinstance(b, bool) and -128 <= b < 256 for b in uid)):
                    raise ValueError(f"peer {peer}: route nccl needs '{field}', an NCCL unique id of {NCCL_ID_BYTES} byte values, "
                                     f"got {uid!r:.60}")
        key = None
        if self._keys is not None:
            raw = spec.get("key")
            if not isinstance(raw, str):
                raise ValueError(f"peer {peer}: this actor's data plane is authenticated, so the spec needs the peer's "
                                 f"public 'key' (got {raw!r}); is actor {peer} started with --insecure?")
            key = KeyPair(raw.encode()).public  # validates it
        prefix = spec.get("shm_prefix")
        if prefix is not None and (not isinstance(prefix, str) or not prefix.startswith("/mpmd-") or "/" in prefix[1:]):
            raise ValueError(f"peer {peer}: shm_prefix must look like '/mpmd-...', got {prefix!r}")
        name, pid = spec.get("link"), spec.get("pid")
        if name is not None and (not isinstance(name, str) or not name.startswith("mpmd-link-") or "\0" in name
                                 or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0):
            raise ValueError(f"peer {peer}: a link needs a name 'mpmd-link-...' and an int pid, got {name!r}, {pid!r}")
        most = spec.get("max_message")
        if most is not None and (type(most) is not int or most <= 0):
            raise ValueError(f"peer {peer}: max_message must be a positive int (the bytes one message to it may hold), got {most!r:.40}")
        return route, address, key, prefix, spec

    # ---- sending ---------------------------------------------------------------------------------
    def _dial(self, peer: int) -> zmq.Socket | None:
        address = self._address.get(peer)
        if address is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        # (no routing id of our own: ZeroMQ gives each connection one. Who sent a message is its key's word, never
        # the routing id; a fixed one — the actor id — made a peer's ROUTER drop every message of a restarted actor,
        # for good, while the old process's connection was still there: a dead host's half-open TCP connection, or
        # a killed process's end not yet noticed. Without ROUTER_HANDOVER a second connection under an id is ignored.)
        if self._keys is not None:
            configure_client(sock, self._keys, self._peer_keys[peer])
        allow_ipv6(sock, address)
        sock.connect(address)
        self._out[peer] = sock
        return sock

    def _link_to(self, peer: int) -> links.Link | None:
        """The link to a same-host `peer` (dialled now if need be), or None: ZeroMQ carries its messages."""
        lk = self._links_out.get(peer)
        if lk is not None and not lk.closed:
            return lk
        name = self._peer_link.get(peer)
        if name is None or peer in self._no_link or self._loop is None or self.routes.get(peer) != "shm":
            return None
        try:
            lk = self._links_out[peer] = links.Link.dial(name, self._peer_pid[peer], self._loop)
        except links.LinkError as e:
            self._no_link.add(peer)
            log.warning("actor %d: no link to actor %d on this host (%s); its messages go over ZeroMQ", self.actor_id, peer, e)
            return None
        return lk

    def _link_failed(self, peer: int, lk: links.Link, e: BaseException) -> None:
        lk.close()
        if self._links_out.get(peer) is lk:
            del self._links_out[peer]
        self._no_link.add(peer)
        log.warning("actor %d: the link to actor %d broke (%s); its messages go over ZeroMQ", self.actor_id, peer, e)

    def _drop_links(self, peer: int) -> None:
        """Forget the links of a peer that is now another process (restarted)."""
        for table in (self._links_out, self._links_in):
            lk = table.pop(peer, None)
            if lk is not None:
                lk.close()
        self._no_link.discard(peer)

    def _post(self, peer: int, header: dict[str, Any], arrays: list[np.ndarray] = (), track: bool = False) -> Any:
        """Send one message to `peer`: over its link when it has one (returns None: the bytes have left this
        actor), else over ZeroMQ (returns the tracker when `track`)."""
        header = {**header, "src": self.actor_id}
        lk = self._link_to(peer)
        frames = None
        if lk is not None:
            frames = encode(header, arrays)
            try:
                if lk.post(frames):
                    return None
            except links.LinkError as e:
                self._link_failed(peer, lk, e)
        sock = self._out.get(peer) or self._dial(peer)
        if sock is None:
            raise TransferError(f"actor {self.actor_id} has no route to actor {peer} (key {header.get('key')}); "
                                f"connected: {sorted(self._address)}")
        frames = frames or encode(header, arrays)
        most = self._peer_max.get(peer)
        if most is not None and any(len(f) > most for f in frames):  # (ZeroMQ there would drop the connection unseen,
            # and the receive wait out its session's limit: 300 s by default; a review)
            big = max(len(f) for f in frames)
            raise TransferError(f"actor {self.actor_id} cannot send {header.get('key')} to actor {peer}: {big / 2**20:.1f} MiB "
                                f"in one message, over actor {peer}'s --max-message-mb ({most // 2**20} MiB): start the "
                                "daemons with a larger --max-message-mb, or cut the activation smaller (more microbatches)")
        try:
            # Small frames are copied into ZeroMQ's messages: cheaper than zero-copy's bookkeeping (half the time).
            copy = not track and sum(len(f) for f in frames) < SHM_MIN_BYTES
            try:
                return sock.send_multipart(frames, copy=copy, track=track, flags=zmq.NOBLOCK)
            except zmq.Again:  # (SNDHWM 0: only a socket left with no pipe, its handshake refused, which ZeroMQ does
                # not re-dial: a wiring that gave the peer a wrong key for us had every later session's sends fail until
                # the daemons restarted; a probe. Dialled again, once.)
                self._out.pop(peer, None)
                sock.close(linger=0)
                sock = self._dial(peer)
                assert sock is not None
                return sock.send_multipart(frames, copy=copy, track=track, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise TransferError(f"actor {self.actor_id} could not send to actor {peer}: {e}") from None

    def _post_data(self, peer: int, key: tuple[int, ...], host: np.ndarray, track: bool = False) -> Any:
        """`_post` of a ``data`` message: over a link with a compact header when it can have one."""
        lk = self._link_to(peer)
        if lk is not None:
            frames = links.pack_data(key, host)
            if frames is not None:
                try:
                    if lk.post(frames):
                        return None
                except links.LinkError as e:
                    self._link_failed(peer, lk, e)
        return self._post(peer, {"op": "data", "key": list(key)}, [host], track=track)

    async def send(self, peer: int, key: tuple[int, ...], value: Any, wait: bool = False) -> None:
        route = self.routes.get(peer)
        if route is None:
            raise TransferError(f"actor {self.actor_id} has no route to actor {peer} (key {key}); connected: {sorted(self.routes)}")
        if route == "nccl":
            await self._nccl.send(peer, key, value, wait)
            return
        nbytes = int(value.nbytes)
        self.counters[f"sent_{route}_bytes"] += nbytes
        self.counters["sent_arrays"] += 1
        try:
            if route == "shm" and nbytes >= SHM_MIN_BYTES:
                await self._send_shm(peer, key, value, nbytes)
                return
            ready = getattr(value, "is_ready", None)
            if ready is not None and not ready() and self._link_to(peer) is not None:
                if await self._post_when_ready(peer, {"op": "data", "key": list(key)}, value):
                    return
            host = await host_view(value)
            tracker = self._post_data(peer, key, host, track=wait)
        except TransferError:  # (not sent: a refused send counted as sent; a review)
            self.counters[f"sent_{route}_bytes"] -= nbytes
            self.counters["sent_arrays"] -= 1
            raise
        if wait and tracker is not None and not tracker.done:
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
            notice = {"op": "shm", "key": list(key), "seg": seg.id, "name": seg.name, "size": seg.mapped, "ino": seg.ino,
                      "arrays": [aval_header(value.shape, value.dtype)]}
            if nbytes >= 4 << 20 or (ready is not None and not ready()):
                # Waiting for the value, copying it and (over a link) posting the notice happen in one hop on a
                # copier thread; two copiers take sends in program order, so the first activation out is the first
                # one computed.
                if await self._post_when_ready(peer, notice, value, (sender, seg)):
                    return
            else:
                _fill(sender, seg, value)
            self._post(peer, notice)
        except BaseException:
            sender.give_back(seg.id)
            raise

    async def _post_when_ready(self, peer: int, header: dict[str, Any], value: Any,
                               into: tuple[shm.ShmSender, shm.Segment] | None = None) -> bool:
        """On a copier thread: wait for `value`, copy it (into `into`'s segment, or into the message), and post
        the message over `peer`'s link the moment it is computed, with no hop back to the loop. False when the
        caller must post it (no link, too big for one record, or the link broke; the copy into `into` is done)."""
        lk = self._link_to(peer)
        err = await asyncio.get_running_loop().run_in_executor(self._copier, _post_when_ready, lk,
                                                               {**header, "src": self.actor_id}, value, into)
        if isinstance(err, BaseException):
            self._link_failed(peer, lk, err)
        return err is None

    # ---- receiving -------------------------------------------------------------------------------
    async def recv(self, peer: int, key: tuple[int, ...], timeout: float | None = None) -> Any:
        return await self._mailbox.take(peer, key, timeout)

    def recv_then(self, peer: int, key: tuple[int, ...], timeout: float | None, then: Callable[[asyncio.Future[Any]], None]) -> None:
        """`recv` as a callback: `then(slot)` on the loop when the array (or its error) is in (see Mailbox.take_then)."""
        self._mailbox.take_then(peer, key, timeout, then)

    def send_now(self, peer: int, key: tuple[int, ...], value: Any) -> bool:
        """Post a small, computed value at once, with no task and no await; False when `send` must do it (a big
        or NCCL payload, a value still being computed, or no route)."""
        route = self.routes.get(peer)
        if route is None or route == "nccl":
            return False
        nbytes = getattr(value, "nbytes", None)
        if nbytes is None or nbytes >= SHM_MIN_BYTES or (not isinstance(value, np.ndarray) and not value.is_ready()):
            return False
        host = computed(value)
        if not host.flags.c_contiguous:
            return False
        self.counters[f"sent_{route}_bytes"] += int(nbytes)
        self.counters["sent_arrays"] += 1
        self._post_data(peer, key, host)
        return True

    def abandon(self, predicate) -> int:
        return self._mailbox.drop(predicate)

    def revive(self, prefix: tuple[int, ...]) -> None:
        self._expired.pop(tuple(prefix), None)

    def expire(self, prefix: tuple[int, ...]) -> int:
        n = len(prefix)
        self._expired[tuple(prefix)] = None
        self._expired_lengths.add(n)
        while len(self._expired) > REMEMBER_EXPIRED:
            self._expired.popitem(last=False)
        return self._mailbox.drop(lambda k: tuple(k[:n]) == prefix)

    def _arrive(self, src: int, key: tuple[int, ...], value: Any, nbytes: int) -> None:
        """An arrival, on the event loop: dropped if its step is over, refused if its key is not welcome or its
        sender is over its limits, else handed to its receive (or kept until that is posted)."""
        if any(key[:n] in self._expired for n in self._expired_lengths):
            self.counters["late_dropped"] += 1
            return
        reason = self.admit(key) if self.admit is not None else None
        if reason is None:
            reason = self._mailbox.deliver(src, key, value, nbytes)
        if reason is None:
            return
        self._refuse(src, key, reason)

    def _screen(self, src: int, key: tuple[int, ...], nbytes: int) -> bool:
        """Before a payload is copied out of ZeroMQ's buffer: False (and the arrival dropped or refused) if it would
        not be taken in, so a refused arrival costs no more memory than its header."""
        if any(key[:n] in self._expired for n in self._expired_lengths):
            self.counters["late_dropped"] += 1
            return False
        reason = self.admit(key) if self.admit is not None else None
        if reason is None:
            reason = self._mailbox.would_refuse(src, key, nbytes)
        if reason is None:
            return True
        self._mailbox.refuse(src, key, reason)
        self._refuse(src, key, reason)
        return False

    def _refuse(self, src: int, key: tuple[int, ...], reason: str) -> None:
        self.counters["refused"] += 1
        self._warn.warning("refused", "actor %d: refused transfer %s from actor %d: %s", self.actor_id, key, src, reason)
        now = asyncio.get_running_loop().time() if self._loop is not None else 0.0
        tokens, since = self._notices.get(src, (REFUSED_NOTICES_PER_SECOND, now))
        tokens = min(REFUSED_NOTICES_PER_SECOND, tokens + (now - since) * REFUSED_NOTICES_PER_SECOND)
        if tokens < 1:
            self.counters["refused_unnoticed"] += 1
            self._notices[src] = (tokens, now)
            return
        self._notices[src] = (tokens - 1, now)
        try:
            self._post(src, {"op": "refused", "key": list(key), "reason": reason[:300]})
        except TransferError:
            pass

    def _on_refused(self, src: int, key: tuple[int, ...] | None, reason: str) -> None:
        self.counters["refused_by_peers"] += 1
        self._warn.warning("refused-by-peer", "actor %d: actor %d refused our transfer %s: %s", self.actor_id, src, key, reason)

    def _on_readable(self) -> None:
        """Read one data-plane message, then look for the next in a later turn of the loop, after what this one
        set going (a receive's consumer, a forward's send). The descriptor is edge-triggered: it is looked at
        again until ZeroMQ says nothing is left."""
        sock = self._router
        if self._closing:
            return
        try:
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            self._rx_one(sock)
        except zmq.ZMQError:
            if self._closing:
                return
            log.exception("actor %d: data-plane receive failed", self.actor_id)
            return
        except Exception:  # never let one bad message stop the receiver
            log.exception("actor %d: data-plane receive failed", self.actor_id)
        self._loop.call_soon(self._on_readable)

    def _rx_one(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=False)  # all of one message, in one call (its frames arrive together)
        ident = frames[0]  # the sender's routing id: a claim, not a proof
        authenticated = user_id(ident) if self._keys is not None else None

        def sender(header: dict[str, Any]) -> int:
            claimed = header.get("src")
            if self._keys is not None:
                if authenticated is None or not authenticated.isdigit():
                    raise ProtocolError(f"message over a connection not authenticated as an actor (user id {authenticated!r})")
                if claimed is not None and claimed != int(authenticated):
                    raise ProtocolError(f"message claims to come from actor {claimed!r} but its key is actor {authenticated}'s")
                return int(authenticated)
            if not isinstance(claimed, int) or isinstance(claimed, bool):
                raise ProtocolError("data message has no int 'src'")
            return claimed

        if len(frames) < 2:
            self._bad_message(None, None, authenticated or "no key", ProtocolError("data message has no header frame"))
            return
        total = sum(len(f) for f in frames[2:])  # the arrays (the header frame is bounded as a frame)
        if total > self._max_message:  # (ZeroMQ drops a connection for a frame over the limit, not for many frames under it)
            src = key = None
            try:  # (its header, bounded as a frame, names the transfer: its receive fails now, not at its timeout)
                header = parse_header(frames[1])
                src, key = sender(header), _key_of(header.get("key"))
            except Exception:
                pass
            self._bad_message(src, key, authenticated or "no key", ProtocolError(
                f"a message with {total} bytes of arrays in {len(frames) - 2} frames, over this actor's --max-message-mb "
                f"({self._max_message // 2**20} MiB)"))
            return
        self._on_message(sender, frames[1], [f.buffer for f in frames[2:]], authenticated or "no key")

    # ---- same-host links -------------------------------------------------------------------------
    def _on_link_dialled(self) -> None:
        """A peer on this host dialled our link: kept if the kernel says it is the process the controller named for
        a peer of ours, closed otherwise."""
        while not self._closing:
            got = self._listener.accept()
            if got is None:
                return
            conn, pid, uid = got
            src = next((p for p, q in self._peer_pid.items() if q == pid), None) if uid == os.getuid() else None
            if src is None:
                conn.close()
                self.counters["refused_links"] += 1
                self._warn.warning("refused-link", "actor %d: refused a link from process %d of user %d: not a peer of ours",
                                   self.actor_id, pid, uid)
                continue
            lk = links.Link(conn, self._loop)
            old = self._links_in.pop(src, None)
            if old is not None:
                old.close()
            self._links_in[src] = lk
            self._loop.add_reader(lk.fileno(), self._on_link_readable, src, lk)

    def _on_link_readable(self, src: int, lk: links.Link) -> None:
        """One message from `src`'s link (the descriptor is level-triggered: the loop calls again while more wait)."""
        if self._closing or lk.closed:
            return
        n = lk.read(self._link_buf)
        if n < 0:
            return
        if n == 0:  # the peer closed it (exited, or restarted and dials anew)
            lk.close()
            if self._links_in.get(src) is lk:
                del self._links_in[src]
            return
        if n > len(self._link_buf):
            self._bad_message(src, None, "link", ProtocolError(f"a {n}-byte link record (at most {len(self._link_buf)})"))
            return
        try:
            header, payload = links.split_record(memoryview(self._link_buf), n)
        except ValueError as e:
            self._bad_message(src, None, "link", ProtocolError(str(e)))
            return

        def sender(h: dict[str, Any]) -> int:
            claimed = h.get("src")
            if claimed is not None and claimed != src:
                raise ProtocolError(f"message claims to come from actor {claimed!r} but its link is actor {src}'s")
            return src

        self.counters["link_messages"] += 1
        if header and header[0] == links.COMPACT:
            self._on_compact_data(src, header, payload)
            return
        self._on_message(sender, header, [payload if payload is not None else memoryview(b"")], "link")

    def _on_compact_data(self, src: int, header: memoryview, payload: memoryview | None) -> None:
        """A ``data`` message with a compact header (see link.py), from `src`'s link: `_on_message`'s data case."""
        key = None
        self.counters["compact_messages"] += 1
        try:
            got, dtype, shape = links.parse_data(header)
            if len(got) > MAX_KEY_INTS:
                raise ProtocolError(f"data message needs a key of at most {MAX_KEY_INTS} ints")
            key = got
            # (a link record is smaller than BIG_PAYLOAD: always copied, never left in the reused read buffer)
            self._take_data(src, key, [payload if payload is not None else memoryview(b"")],
                            (dtype, shape, links.data_bytes(dtype, shape)))
        except Exception as e:
            self._bad_message(src, key, "link", e)

    def _take_data(self, src: int, key: tuple[int, ...], payloads: list[Any], spec: tuple[np.dtype, Any, int]) -> None:
        """A data message's one array, its sender and key known: screened before its bytes are copied anywhere,
        then handed to its receive (or kept until that is posted)."""
        if len(payloads) == 1 and not self._screen(src, key, spec[2]):
            return
        (array,) = self._rx_payloads(payloads, [spec])
        self.counters["received_bytes"] += array.nbytes
        if isinstance(array, _Unaligned):
            self._deliver_big(src, key, array)
        else:  # screened just now, in this same turn of the loop: only the mailbox is left to pass
            reason = self._mailbox.deliver(src, key, array, array.nbytes)
            if reason is not None:
                self._refuse(src, key, reason)

    # ---- one message -----------------------------------------------------------------------------
    def _on_message(self, sender: Callable[[dict[str, Any]], int], header_bytes: Any, payloads: list[Any], who: str) -> None:
        """Handle one data-plane message: `sender(header)` says (or refuses) who sent it; `payloads` are its
        array bytes (a link message always brings one, empty when it has no array)."""
        header = src = key = None
        try:
            header = parse_header(header_bytes)
            op = header["op"]
            src = sender(header)
            raw_key = header.get("key")
            key = _key_of(raw_key)
            if op == "shm_ack":
                seg = header.get("seg")
                if not isinstance(seg, int):
                    raise ProtocolError(f"shm_ack needs an int 'seg', got {seg!r}")
                self._released(src, seg)
            elif op == "data":
                specs = array_specs(header)
                if key is None or len(specs) != 1:
                    raise ProtocolError(f"data message needs an int-list 'key' (at most {MAX_KEY_INTS}) and one array, got key "
                                        f"{raw_key!r:.200} and {len(specs)} arrays")
                self._take_data(src, key, payloads, specs[0])
            elif op == "shm":
                if key is None:
                    raise ProtocolError(f"shm notice needs an int-list 'key' (at most {MAX_KEY_INTS}), got {raw_key!r:.200}")
                ((dtype, shape, nbytes),) = array_specs(header)
                seg, name, size, ino = header.get("seg"), header.get("name"), header.get("size"), header.get("ino")
                if not isinstance(seg, int) or not isinstance(size, int) or not isinstance(name, str) or type(ino) is not int:
                    raise ProtocolError("shm notice needs int 'seg', int 'size', str 'name' and int 'ino'")
                prefix = self._peer_shm.get(src)
                if prefix is None or name != f"{prefix}{self.actor_id}-{seg}":
                    raise TransferError(f"actor {self.actor_id} refused a shared-memory notice from actor {src} naming {name!r}: "
                                        "not a segment that actor made for this one")
                try:
                    view = self._shm_in.view(src, seg, name, size, dtype, shape, nbytes, ino=ino)
                except (OSError, ValueError) as e:
                    raise TransferError(f"actor {self.actor_id} could not map shared memory {name} from actor {src}: {e}") from None
                self.counters["received_bytes"] += nbytes
                self._deliver_shm(src, key, view, nbytes)
            elif op == "nccl":
                if key is None or self._nccl is None:
                    raise ProtocolError("nccl notice without key, or this actor has no NCCL links")
                ((dtype, shape, nbytes),) = array_specs(header)
                seq = header.get("seq")
                if not isinstance(seq, int):
                    raise ProtocolError(f"nccl notice needs an int 'seq', got {seq!r}")
                self._nccl.on_notice(src, key, seq, dtype, shape, nbytes)
            elif op == "refused":
                self._on_refused(src, key, str(header.get("reason", ""))[:500])
            else:
                raise ProtocolError(f"unknown data-plane op {op!r}")
        except Exception as e:
            self._bad_message(src, key, who, e)

    def _bad_message(self, src: int | None, key: tuple[int, ...] | None, who: str, e: Exception) -> None:
        """Count and log a message that could not be taken in; its receive, if it names one, fails now."""
        self.counters["bad_messages"] += 1
        self._warn.warning("bad-message", "actor %d: bad data-plane message from %s: %s", self.actor_id,
                           f"actor {src}" if src is not None else f"actor {who} (by its key)" if who.isdigit()
                           else f"an unidentified sender ({who})", e)  # (a forged src from a known key said "unidentified")
        if src is not None and key is not None:  # fail the receive now rather than let it time out
            err = e if isinstance(e, TransferError) else TransferError(f"actor {self.actor_id} got a bad transfer {key} from actor {src}: {e}")
            self._fail(src, key, err)

    def _rx_payloads(self, frames: list[memoryview], specs: list[tuple[np.dtype, list[int], int]]) -> list[Any]:
        if len(frames) != len(specs):
            raise ProtocolError(f"header announces {len(specs)} arrays but {len(frames)} payload frames came")
        arrays = []
        for frame, (dtype, shape, nbytes) in zip(frames, specs):
            got = frame.nbytes
            if got != nbytes:
                raise ProtocolError(f"payload has {got} bytes, {dtype.name}{shape} needs {nbytes}")
            if nbytes == 0:
                arrays.append(np.zeros(shape, dtype))
            elif nbytes >= BIG_PAYLOAD:  # aligned by a copier thread (see `_deliver_big`), not on the loop
                arrays.append(_Unaligned(frame, dtype, shape, nbytes))
            else:  # one copy out of ZeroMQ's buffer, into memory aligned for JAX to alias
                arrays.append(aligned_copy(frame, nbytes).view(dtype).reshape(shape))
        return arrays

    def _deliver_big(self, src: int, key: tuple[int, ...], big: _Unaligned) -> None:
        """Copy a big payload into aligned memory (JAX aliases it) on a copier thread, then hand it over."""

        def copy() -> None:
            try:
                buf = aligned_empty(big.nbytes)
                buf[:] = np.frombuffer(big.frame, np.uint8)
            except BaseException as e:  # (out of memory): the receive fails now instead of timing out
                self._call(self._fail, src, key, TransferError(
                    f"actor {self.actor_id} could not take in transfer {key} ({big.nbytes} bytes) from actor {src}: {e}"))
                return
            finally:
                big.frame = None
            self._call(self._arrive, src, key, buf.view(big.dtype).reshape(big.shape), big.nbytes)

        self._copier.submit(copy)

    def _call(self, fn: Any, *args: Any) -> None:
        if self._loop is not None and not self._closing:
            self._loop.call_soon_threadsafe(fn, *args)

    def _fail(self, src: int, key: tuple[int, ...], err: BaseException) -> None:
        if not any(key[:n] in self._expired for n in self._expired_lengths):
            self._mailbox.fail(src, key, err)

    def _deliver_shm(self, src: int, key: tuple[int, ...], view: np.ndarray, nbytes: int) -> None:
        self._arrive(src, key, view, nbytes)
        del view  # refused or dropped: its segment goes back to the sender now
        if self._release_hook is not None and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """While received shared-memory arrays are out, have JAX drop what it holds of freed ones, so a segment
        goes back to its sender even when no Run is dispatched after its array is gone (every dispatch does this
        too). A backstop, backing off 2 -> 32 ms: each wake of the event loop costs the actor's core 50-250 us on
        this VM (cold caches), and polling at 1 ms while activations stayed stashed woke it ~28 times a step."""
        delay = 0.002
        while self._shm_in.outstanding > 0 and not self._closing:
            await asyncio.sleep(delay)
            self._release_hook()
            delay = min(delay * 2, 0.032)

    def _released(self, peer: int, seg_id: int) -> None:
        sender = self._shm_out.get(peer)
        if sender is not None:
            sender.release(seg_id)

    def stats(self) -> dict[str, Any]:
        out = dict(self.counters)
        out["routes"] = {str(p): r for p, r in sorted(self.routes.items())}
        out["shm_segments"] = sum(s.created for s in self._shm_out.values())
        out["shm_in_use"] = sum(len(s.busy) for s in self._shm_out.values())
        out["unclaimed"] = {str(p): {"arrivals": n, "bytes": b} for p, (n, b) in self._mailbox.unclaimed().items()}
        out["authenticated"] = self._keys is not None
        out["links"] = {"out": sorted(p for p, lk in self._links_out.items() if not lk.closed),
                        "in": sorted(p for p, lk in self._links_in.items() if not lk.closed)}
        if self._auth is not None:
            out["refused_connections"] = self._auth.refused
        return out

    def close(self) -> None:
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._router.getsockopt(zmq.FD))
            except (RuntimeError, ValueError, zmq.ZMQError):  # another thread, or the socket is gone already
                pass
        if self._nccl is not None:
            self._nccl.close()
        for lk in [*self._links_out.values(), *self._links_in.values()]:
            lk.close()
        if self._listener is not None:
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(self._listener.fileno())
                except (RuntimeError, ValueError, OSError):
                    pass
            self._listener.close()
        for sender in self._shm_out.values():
            sender.close()
        self._shm_in.close()
        for sock in self._out.values():
            sock.close(linger=0)
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._copier.shutdown(wait=False, cancel_futures=True)


class _Unaligned:
    """A big payload still in ZeroMQ's buffer (not aligned for JAX): copied out by `DataPlane._deliver_big`."""

    __slots__ = ("frame", "dtype", "shape", "nbytes")

    def __init__(self, frame: Any, dtype: np.dtype, shape: tuple[int, ...], nbytes: int) -> None:
        self.frame, self.dtype, self.shape, self.nbytes = frame, dtype, shape, nbytes


def _key_of(raw: Any) -> tuple[int, ...] | None:
    """A data message's transfer key: its header's list of at most MAX_KEY_INTS ints, as a tuple; else None."""
    return tuple(raw) if type(raw) is list and len(raw) <= MAX_KEY_INTS and all(type(k) is int for k in raw) else None


def _fill(sender: shm.ShmSender, seg: shm.Segment, value: Any) -> None:
    """Copy `value` (waiting until it is computed) into `seg`; runs on a copier thread for big payloads."""
    host = computed(value)
    sender.write(seg, host if host.flags.c_contiguous else np.ascontiguousarray(host))


def _post_when_ready(lk: links.Link | None, header: dict[str, Any], value: Any,
                     into: tuple[shm.ShmSender, shm.Segment] | None) -> BaseException | bool | None:
    """On a copier thread: wait for `value`, copy it into a shared-memory segment (`into`; `header` is its
    notice) or into the message itself, and post the message over `lk`. None: posted; True: the caller posts
    it (no link, or too big for one record); a LinkError: the link broke (the caller posts it)."""
    if into is not None:
        _fill(*into, value)
        if lk is None:
            return True
        frames = encode(header)
    else:
        host = computed(value)
        host = host if host.flags.c_contiguous else np.ascontiguousarray(host)
        frames = (links.pack_data(tuple(header["key"]), host) if lk is not None and header["op"] == "data" else None) or encode(header, [host])
    try:
        return None if lk.post(frames) else True
    except links.LinkError as e:
        return e
