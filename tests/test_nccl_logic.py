"""The NCCL route's own logic — sequence numbering, notices, receives posted in the sender's order, raw-byte
transport of bfloat16/float8, empty arrays — run on CPU with a stand-in for cupy and NCCL.

FAKE, because NCCL cannot run here (no GPU): `fake_cupy` gives host buffers with device-like pointers, and
`FakeComm` moves bytes between the two ranks of a communicator in call order (first send posted, first
receive served), which is NCCL's matching rule for point-to-point calls; it takes its id as cupy 14 does
(bytes) and connects lazily as NCCL does (a rank's first call waits for the peer's). Everything else is real: two
`DataPlane`s with real ZeroMQ sockets and receive threads, the real `NcclLinks` code, JAX arrays in and out.
The same behaviour on real GPUs is checked by tests/test_nccl.py where two GPUs exist.
"""

import asyncio
import ctypes
import gc
import itertools
import secrets
import sys
import tempfile
import threading
import time
import types
import weakref
from collections import deque

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from transport.p2p import DataPlane
from transport.p2p.base import TransferError

WIRES: dict[bytes, deque] = {}
ARRIVED: dict[tuple[bytes, int], threading.Event] = {}  # (communicator, rank): that rank has made its first p2p call
EVENTS_DONE = [True]  # False: NCCL is still at work (events recorded now stay not done until this is True again)
FROM_DLPACK: list = []  # weak references to the buffers NCCL was given to send
STALLED: set[int] = set()  # streams whose NCCL calls never complete: a peer lost mid-transfer (`FakeComm.lost`)
STREAMS = itertools.count(1)


class FakeBuf(np.ndarray):
    @property
    def data(self):  # cupy arrays expose their device pointer as .data.ptr
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


class FakeComm:
    """cupy 14's NcclCommunicator: the id must be bytes (cupy_backends/cuda/libs/nccl.pyx: `bytes commId`), and the
    pair connects lazily, as NCCL does (src/transport.cc, NVIDIA/nccl#1346): a rank's first send/recv returns only once
    the peer has made its first call on the communicator (NCCL waits for ever; 3 s here, then an error)."""

    def __init__(self, ndev, uid, rank):
        if not isinstance(uid, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(uid).__name__})")
        assert ndev == 2 and rank in (0, 1) and len(uid) == 128
        self.uid = uid
        self.wire = WIRES.setdefault(uid, deque())
        self.rank = rank
        self.calls = []
        self.connected = self.aborted = False
        # The peer is lost mid-transfer: calls from now on never complete (NCCL waits for ever), and aborting the
        # communicator does not complete them either: the events recorded after them stay not done.
        self.lost = False

    def _connect(self):
        assert not self.aborted, "a call on an aborted communicator"
        if self.connected:
            return
        ARRIVED.setdefault((self.uid, self.rank), threading.Event()).set()
        if not ARRIVED.setdefault((self.uid, 1 - self.rank), threading.Event()).wait(3.0):
            raise RuntimeError(f"rank {self.rank}'s first p2p call waited 3 s for the peer's (NCCL: for ever)")
        self.connected = True

    def send(self, ptr, count, dtype, peer, stream):
        assert self.rank == 0 and peer == 1, "a link's rank 0 only sends to rank 1"
        self._connect()
        if self.lost:
            STALLED.add(stream)
            return
        self.wire.append(ctypes.string_at(ptr, count))
        self.calls.append(("send", count))

    def recv(self, ptr, count, dtype, peer, stream):
        assert self.rank == 1 and peer == 0, "a link's rank 1 only receives from rank 0"
        self._connect()
        if self.lost:
            STALLED.add(stream)
            return
        deadline = time.monotonic() + 3  # (a real receive waits on its stream for the data; here on the host, a while)
        while not self.wire and time.monotonic() < deadline:
            time.sleep(0.001)
        data = self.wire.popleft()  # NCCL matches by order: this receive takes the oldest send
        assert len(data) == count, f"receive of {count} bytes matched a send of {len(data)}: posted out of order"
        ctypes.memmove(ptr, data, count)
        self.calls.append(("recv", count))

    def abort(self):
        self.aborted = True

    def destroy(self):
        pass


class FakeComm13(FakeComm):
    """cupy 13's: the id is a tuple of 128 signed chars (a byte over 127 overflows)."""

    def __init__(self, ndev, uid, rank):
        if not isinstance(uid, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(uid).__name__})")
        if not all(-128 <= b < 128 for b in uid):
            raise OverflowError("value too large to convert to char")
        super().__init__(ndev, bytes(b & 0xFF for b in uid), rank)


def fake_cupy():
    nccl = types.SimpleNamespace(NcclCommunicator=FakeComm, NCCL_UINT8=1, available=True, get_version=lambda: 23203,
                                 get_unique_id=lambda: secrets.token_bytes(128))  # (cupy >= 14 gives bytes)
    current = [0]
    used: list[int] = []

    class Event:
        def __init__(self, disable_timing=False):
            self._done = EVENTS_DONE[0]
            self._stream = None

        @property
        def done(self):
            return (self._done or EVENTS_DONE[0]) and self._stream not in STALLED

        def record(self, stream):
            self._stream = stream.ptr

    class Device:
        def __init__(self, i):
            self.i = i
            used.append(i)

        @property
        def pci_bus_id(self):
            return f"0000:{self.i + 0x10:02X}:00.0"

        def __enter__(self):
            current.append(self.i)
            return self

        def __exit__(self, *a):
            current.pop()
            return False

    def from_dlpack(x):
        # cupy imports device arrays only, and NCCL reads the actor's own device's memory
        assert isinstance(x, jax.Array), f"cupy.from_dlpack of a {type(x).__name__}: not a device array"
        assert {d.id for d in x.devices()} == {current[-1]}, f"an array on {x.devices()} sent from device {current[-1]}"
        buf = np.from_dlpack(x).view(FakeBuf)
        FROM_DLPACK.append(weakref.ref(buf))
        return buf

    cuda = types.SimpleNamespace(nccl=nccl, Event=Event, Device=Device, used=used,
                                 Stream=lambda non_blocking=False: types.SimpleNamespace(ptr=next(STREAMS), synchronize=lambda: None))
    cupy = types.SimpleNamespace(cuda=cuda, uint8=np.uint8, from_dlpack=from_dlpack,
                                 empty=lambda n, dtype: np.empty(n, dtype).view(FakeBuf),
                                 zeros=lambda n, dtype: np.zeros(n, dtype).view(FakeBuf))
    return cupy, cuda, nccl


def stand_in_cupy(monkeypatch):
    """The fake cupy put where `import cupy` finds it; returns its nccl module."""
    cupy, cuda, nccl = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    return nccl


@pytest.fixture
def nccl_pair(monkeypatch):
    nccl = stand_in_cupy(monkeypatch)

    async def make():
        d = tempfile.mkdtemp()
        dev = jax.devices()[0]
        a, b = DataPlane(0, ipc_dir=d, nccl_device=dev), DataPlane(1, ipc_dir=d, nccl_device=dev)
        assert a.endpoint()["nccl"] and b.endpoint()["nccl"]
        await a.start()
        await b.start()
        up, down = list(nccl.get_unique_id()), list(nccl.get_unique_id())
        try:
            await asyncio.gather(
                a.connect({1: {"address": b.endpoint()["ipc"], "route": "nccl", "nccl_out": up, "nccl_in": down}}),
                b.connect({0: {"address": a.endpoint()["ipc"], "route": "nccl", "nccl_out": down, "nccl_in": up}}))
        except BaseException:  # (planes left open hung the next test: their ZeroMQ context's finaliser waits for their sockets)
            a.close()
            b.close()
            raise
        return a, b

    return make


def test_nccl_route_delivers_exact_arrays_in_both_directions_out_of_order(nccl_pair):
    rng = np.random.default_rng(0)
    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int8, np.int64, np.bool_, np.complex64]
    shapes = [(), (0,), (3,), (4, 5), (2, 0, 3), (64, 33)]
    cases = []
    for i, (dt, shape) in enumerate(itertools.product(dtypes, shapes)):
        host = (rng.standard_normal(shape) * 4).astype(dt) if dt != np.bool_ else rng.random(shape) > 0.5
        cases.append((i % 2, (7, 0, i), host))

    async def go():
        a, b = await nccl_pair()
        planes = {0: a, 1: b}
        try:
            order = rng.permutation(len(cases))  # receives are awaited in another order than the sends go out
            recvs = {i: asyncio.ensure_future(planes[1 - cases[i][0]].recv(cases[i][0], cases[i][1])) for i in order}
            await asyncio.gather(*(planes[src].send(1 - src, key, jnp.asarray(host)) for src, key, host in cases))
            got = {i: await asyncio.wait_for(f, 30) for i, f in recvs.items()}
            sends = [c for c in a._nccl.out[1].comm.calls] + [c for c in b._nccl.out[0].comm.calls]
            assert all(kind == "send" for kind, _ in sends)
            return got
        finally:
            a.close()
            b.close()

    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # as in the daemon: int64/float64 arrays stay 64-bit
    try:
        got = asyncio.run(go())
    finally:
        jax.config.update("jax_enable_x64", x64)
    for i, (src, key, host) in enumerate(cases):
        value = got[i]
        assert isinstance(value, jax.Array)
        out = np.asarray(value)
        assert out.dtype == host.dtype and out.shape == host.shape and out.tobytes() == host.tobytes(), (host.dtype, host.shape)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4", "int2", "uint2", "float4_e2m1fn"])
def test_dtypes_cupy_lacks_go_over_nccl_as_bytes_and_come_back_exact(name):
    """What an NCCL link sends for a dtype cupy has no name for, and how the receiver rebuilds it, run here on CPU
    (the link itself needs two GPUs): a 4-bit array (packed on the device) could not be bitcast to bytes ("4 * 4 !=
    8"; a review), so a GPU pipeline with an int4 activation failed halfway through its step."""
    import jax.numpy as jnp

    from transport.p2p.nccl import as_received, as_sent

    dtype = np.dtype(name)
    values = np.asarray(np.arange(-4, 4) if name.startswith("int") else np.arange(8) % 4, np.float32).astype(dtype).reshape(2, 4)
    sent = as_sent(jnp.asarray(values))
    assert sent.dtype == np.uint8 or np.dtype(sent.dtype).kind == "u"
    raw = jnp.asarray(np.asarray(sent).view(np.uint8).reshape(-1))  # (the bytes NCCL carries, as cupy's uint8 buffer)
    got = as_received(raw, dtype, (2, 4))
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), values.astype(np.float32))


def test_an_nccl_spec_with_a_malformed_unique_id_is_refused_before_anything_changes(monkeypatch):
    """route nccl's ids are checked with the rest of the spec (the route was set, then the ids failed deep in NCCL's
    setup or as a bare KeyError; a probe): each must be 128 byte values. (cupy stood in for, as above.)"""
    nccl = stand_in_cupy(monkeypatch)

    async def go():
        d = tempfile.mkdtemp()
        a = DataPlane(0, ipc_dir=d, nccl_device=jax.devices()[0])
        await a.start()
        try:
            good = list(nccl.get_unique_id())
            for bad in ([1] * 5, [300] * 128, ["x"] * 128, None, [True] * 128):
                spec = {"address": f"ipc://{d}/nobody", "route": "nccl", "nccl_out": bad, "nccl_in": good}
                with pytest.raises(ValueError, match=r"peer 1: route nccl needs 'nccl_out', an NCCL unique id of 128 byte values"):
                    await a.connect({1: spec})
                assert 1 not in a.routes
        finally:
            a.close()

    asyncio.run(go())


def test_the_unique_id_reaches_cupy_in_the_form_its_version_takes(monkeypatch):
    """cupy >= 14 gives and takes the id as bytes and refuses a tuple (`NcclCommunicator(2, tuple(uid), rank)`
    failed: "expected bytes, got tuple"; a review); cupy 13 takes a tuple of signed chars, where a byte over 127
    overflows. Ids travel as 128 ints, 0-255 (or -128-127 from a cupy 13 actor): both reach either cupy."""
    from transport.p2p import nccl as n

    nccl = stand_in_cupy(monkeypatch)
    raw = bytes(range(128, 256))
    assert n.unique_id() != list(nccl.get_unique_id()) and all(0 <= b < 256 for b in n.unique_id())
    monkeypatch.setattr(nccl, "get_unique_id", lambda: tuple(b - 256 if b > 127 else b for b in raw))  # (cupy 13's)
    assert n.unique_id() == list(raw)
    for cls in (FakeComm, FakeComm13):
        for uid in (list(raw), [b - 256 for b in raw]):
            comm = n.communicator(types.SimpleNamespace(NcclCommunicator=cls), uid, 0)
            assert comm.uid == raw, cls


def test_the_first_send_on_each_link_does_not_wait_for_the_peers_first_call(nccl_pair):
    """NCCL connects a pair at its first send/recv, which blocks the host until the peer makes its own first call
    (NVIDIA/nccl#1346). The send ran on the event loop and its notice — what makes the peer post its receive — went
    out after it: every link's first transfer hung (a review). The links are connected when made, off the loop."""

    async def go():
        a, b = await nccl_pair()
        try:
            got = asyncio.ensure_future(b.recv(0, (1,)))
            await asyncio.wait_for(a.send(1, (1,), jnp.arange(4.0)), 10)
            back = asyncio.ensure_future(a.recv(1, (2,)))
            await asyncio.wait_for(b.send(0, (2,), jnp.arange(3)), 10)
            return np.asarray(await asyncio.wait_for(got, 10)), np.asarray(await asyncio.wait_for(back, 10))
        finally:
            a.close()
            b.close()

    got, back = asyncio.run(go())
    np.testing.assert_array_equal(got, np.arange(4.0))
    np.testing.assert_array_equal(back, np.arange(3))


def test_nccl_is_unavailable_when_cupy_imports_without_the_library(monkeypatch):
    """`from cupy.cuda import nccl` imports without libnccl since cupy v9 (it sets `nccl.available = False`):
    `available()` said True there, and the wiring picked a route that could not work (a review)."""
    from transport.p2p import nccl as n

    nccl = stand_in_cupy(monkeypatch)
    assert n.available()
    monkeypatch.setattr(nccl, "available", False)
    assert not n.available()
    monkeypatch.delattr(nccl, "available")
    assert not n.available()
    plane = DataPlane(0, ipc_dir=tempfile.mkdtemp(), nccl_device=jax.devices()[0])
    try:
        assert plane.endpoint()["nccl"] is False and plane.endpoint()["gpu"] is None
    finally:
        plane.close()


def test_actors_on_one_gpu_are_kept_off_nccl(monkeypatch):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and transport='auto' chose NCCL for the actors
    of RemoteMesh.local(gpu_ids=(0,)), which share GPU 0 (a review). Each data plane names its GPU (PCI bus id: every
    actor sees its own as GPU 0); 'auto' sends between two on one GPU through shm, 'nccl' refuses saying what to do."""
    from mpmd.runtime.wiring import choose_routes

    stand_in_cupy(monkeypatch)
    plane = DataPlane(0, ipc_dir=tempfile.mkdtemp(), nccl_device=jax.devices()[0])
    try:
        ep = plane.endpoint()
    finally:
        plane.close()
    assert ep["nccl"] and ep["gpu"] == "0000:10:00.0" and ep["gpu_shared"] is False
    other = {**ep, "gpu": "0000:11:00.0"}
    assert set(choose_routes("auto", [ep, other]).values()) == {"nccl"}
    assert set(choose_routes("auto", [ep, dict(ep)]).values()) == {"shm"}
    assert set(choose_routes("auto", [ep, {**ep, "host": "elsewhere"}]).values()) == {"nccl"}  # (bus ids are per host)
    with pytest.raises(ValueError, match=r"actors 0 and 1 share one GPU \(0000:10:00.0\).*transport='shm'.*gpu_ids"):
        choose_routes("nccl", [ep, dict(ep)])
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")  # NCCL >= 2.30 (the fake's: 2.32) lets them share it
    plane = DataPlane(0, ipc_dir=tempfile.mkdtemp(), nccl_device=jax.devices()[0])
    try:
        shared = plane.endpoint()
    finally:
        plane.close()
    assert shared["gpu_shared"] is True
    assert set(choose_routes("nccl", [shared, dict(shared)]).values()) == {"nccl"}
    assert set(choose_routes("auto", [shared, dict(shared)]).values()) == {"shm"}


@pytest.mark.parametrize("host", [np.arange(6, dtype=np.float32), np.arange(6).astype(ml_dtypes.bfloat16)], ids=["f32", "bf16"])
def test_host_arrays_and_arrays_on_another_device_go_over_nccl(nccl_pair, host):
    """A multi-device actor sends host numpy shards (actors/transfers.py -> actors/spmd.py): the NCCL sender called
    `.is_ready()` on the numpy array (AttributeError; a review). They are put on the actor's device first, as is an
    array on another of its devices (NCCL reads the actor's device)."""

    async def go():
        a, b = await nccl_pair()
        try:
            r1, r2 = asyncio.ensure_future(b.recv(0, (1, 2, 3))), asyncio.ensure_future(b.recv(0, (1, 2, 4)))
            await a.send(1, (1, 2, 3), host)
            await a.send(1, (1, 2, 4), jax.device_put(host, jax.devices()[1]))
            return await asyncio.wait_for(r1, 10), await asyncio.wait_for(r2, 10)
        finally:
            a.close()
            b.close()

    for got in asyncio.run(go()):
        assert np.asarray(got).dtype == host.dtype and np.asarray(got).tobytes() == host.tobytes()


def test_an_array_split_over_devices_is_refused_and_a_replicated_one_crosses_once(nccl_pair):
    """`cp.from_dlpack` of an array spread over several devices exported one shard while nbytes was the whole (a
    review): the receiver read past it. A split array is refused with why; a replicated one sends one copy."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    split = jax.device_put(np.arange(8.0), NamedSharding(mesh, PartitionSpec("x")))
    replicated = jax.device_put(np.arange(8.0), NamedSharding(mesh, PartitionSpec()))

    async def go():
        a, b = await nccl_pair()
        try:
            with pytest.raises(TransferError, match=r"split over 2 devices"):
                await a.send(1, (1,), split)
            r = asyncio.ensure_future(b.recv(0, (2,)))
            await a.send(1, (2,), replicated)
            return await asyncio.wait_for(r, 10)
        finally:
            a.close()
            b.close()

    np.testing.assert_array_equal(np.asarray(asyncio.run(go())), np.arange(8.0))


def test_a_restarted_peer_gets_new_nccl_links(monkeypatch):
    """A peer that restarted (a new process: its address changed) kept its old communicator and seq numbers here:
    `connect` dropped only its shm links, and `setup` skipped a peer that had an NCCL link (a review)."""
    nccl = stand_in_cupy(monkeypatch)

    async def wire(a, b):
        up, down = list(nccl.get_unique_id()), list(nccl.get_unique_id())
        await asyncio.gather(
            a.connect({1: {"address": b.endpoint()["ipc"], "route": "nccl", "nccl_out": up, "nccl_in": down}}),
            b.connect({0: {"address": a.endpoint()["ipc"], "route": "nccl", "nccl_out": down, "nccl_in": up}}))

    async def go():
        dev = jax.devices()[0]
        a, b = DataPlane(0, ipc_dir=tempfile.mkdtemp(), nccl_device=dev), DataPlane(1, ipc_dir=tempfile.mkdtemp(), nccl_device=dev)
        try:
            await a.start()
            await b.start()
            await wire(a, b)
            r = asyncio.ensure_future(b.recv(0, (4,)))
            await a.send(1, (4,), jnp.arange(2.0))
            await asyncio.wait_for(r, 10)
            old = a._nccl.out[1].comm
            b.close()
            b = DataPlane(1, ipc_dir=tempfile.mkdtemp(), nccl_device=dev)  # actor 1 again: a new process, a new address
            await b.start()
            await asyncio.wait_for(wire(a, b), 20)
            assert a._nccl.out[1].comm is not old and old.aborted
            r = asyncio.ensure_future(b.recv(0, (5,)))
            await a.send(1, (5,), jnp.arange(4.0))  # (seq 0 on the new link: the new process expects 0)
            return await asyncio.wait_for(r, 10)
        finally:
            a.close()
            b.close()

    np.testing.assert_array_equal(np.asarray(asyncio.run(go())), np.arange(4.0))


def test_a_failed_notice_consumes_no_sequence_number_and_a_failed_send_closes_its_link(nccl_pair, monkeypatch):
    """The sender numbered a transfer and enqueued its NCCL send, then posted its notice: when the notice failed,
    the receiver waited for that number for ever and every later transfer on the link hung behind it (a review).
    The notice goes first and a number is used only once it has gone; a send NCCL refuses after its notice went out
    (its receive is posted, never to be matched) closes the link, so later sends fail at once."""

    async def go():
        a, b = await nccl_pair()
        try:
            post = a._post

            def fails(peer, header, *args, **kw):
                raise TransferError("no route (stand-in)")

            monkeypatch.setattr(a, "_post", fails)
            with pytest.raises(TransferError, match="stand-in"):
                await a.send(1, (1,), jnp.arange(3.0))
            monkeypatch.setattr(a, "_post", post)
            r = asyncio.ensure_future(b.recv(0, (2,)))
            await a.send(1, (2,), jnp.arange(5.0))
            got = await asyncio.wait_for(r, 10)
            comm = a._nccl.out[1].comm
            monkeypatch.setattr(comm, "send", lambda *args: (_ for _ in ()).throw(RuntimeError("NCCL error (stand-in)")))
            with pytest.raises(TransferError, match=r"NCCL send \(3,\) to actor 1 failed .*stand-in.*closed"):
                await a.send(1, (3,), jnp.arange(5.0))
            assert comm.aborted
            with pytest.raises(TransferError, match="no NCCL link to actor 1"):
                await a.send(1, (4,), jnp.arange(5.0))
            # Wired again (fresh ids, as every wiring hands out): both sides make the link anew. The receiver had kept
            # its old one and skipped it, and the sender blocked in NCCL's init for good, waiting for it (a review).
            from cupy.cuda import nccl

            up, down = list(nccl.get_unique_id()), list(nccl.get_unique_id())
            kept = b._nccl.inn[0]
            await asyncio.wait_for(asyncio.gather(
                a.connect({1: {"address": b.endpoint()["ipc"], "route": "nccl", "nccl_out": up, "nccl_in": down}}),
                b.connect({0: {"address": a.endpoint()["ipc"], "route": "nccl", "nccl_out": down, "nccl_in": up}})), 20)
            assert b._nccl.inn[0] is not kept and kept.comm.aborted
            r = asyncio.ensure_future(b.recv(0, (5,)))
            await a.send(1, (5,), jnp.arange(4.0))
            np.testing.assert_array_equal(np.asarray(await asyncio.wait_for(r, 10)), np.arange(4.0))
            assert a._nccl.out[1].pending == []  # (released once NCCL is done: not kept until the next transfer)
            return got
        finally:
            a.close()
            b.close()

    np.testing.assert_array_equal(np.asarray(asyncio.run(go())), np.arange(5.0))


def test_a_cancelled_send_keeps_its_buffer_until_nccl_is_done_with_it(nccl_pair):
    """A send cancelled while it waited for its event dropped the buffer NCCL was still reading (a review): the
    link holds it until the event is done."""

    async def go():
        a, b = await nccl_pair()
        try:
            EVENTS_DONE[0] = False
            FROM_DLPACK.clear()
            task = asyncio.ensure_future(a.send(1, (1,), jnp.arange(1000.0) + 1))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            del task
            for _ in range(5):  # (the loop lets go of the cancelled task's last references)
                await asyncio.sleep(0.01)
            gc.collect()
            alive = [r() is not None for r in FROM_DLPACK]
            EVENTS_DONE[0] = True
            r = asyncio.ensure_future(b.recv(0, (2,)))
            await a.send(1, (2,), jnp.arange(3.0))  # (a later call lets go of what NCCL is done with)
            await asyncio.wait_for(r, 10)
            gc.collect()
            return alive, FROM_DLPACK[0]() is None
        finally:
            EVENTS_DONE[0] = True
            a.close()
            b.close()

    alive, freed = asyncio.run(go())
    assert alive == [True] and freed


def test_nccl_transfers_on_a_dropped_link_fail_at_once_naming_peer_and_key(nccl_pair):
    """A transfer whose NCCL call never completes (its peer lost mid-transfer) polled its event for ever, and still
    did once its link was dropped and the communicator aborted (a restarted peer, a failed call): the receive hung
    (with no limit) or waited out its whole limit, and the send never returned (a review). Both end at once now."""

    async def go():
        a, b = await nccl_pair()
        try:
            b._nccl.inn[0].comm.lost = True  # (b's receive is posted and never completes)
            r = asyncio.ensure_future(b.recv(0, (7, 1)))  # (no mailbox limit: only the route can end it)
            await asyncio.wait_for(a.send(1, (7, 1), jnp.arange(4.0)), 10)
            while not b._nccl.inn[0].pending:  # (the notice has come and the receive is posted)
                await asyncio.sleep(0.01)
            b._nccl.drop(0)  # (as `connect` does for a restarted peer)
            with pytest.raises(TransferError, match=r"actor 1: NCCL receive \(7, 1\) from actor 0 failed: its NCCL link "
                                                    r"was closed before the transfer completed \(actor 0 is another process"):
                await asyncio.wait_for(r, 30)  # (generous: before, it never ended)
            comm = a._nccl.out[1].comm
            comm.lost = True  # (a's send is enqueued and never completes)
            s = asyncio.ensure_future(a.send(1, (7, 2), jnp.arange(4.0)))
            while not a._nccl.out[1].pending:
                await asyncio.sleep(0.01)
            a._nccl.drop(1)
            with pytest.raises(TransferError, match=r"actor 0: NCCL send \(7, 2\) to actor 1 failed: its NCCL link was closed"):
                await asyncio.wait_for(s, 30)
            assert comm.aborted
        finally:
            a.close()
            b.close()

    asyncio.run(go())


def test_an_nccl_transfer_that_never_completes_fails_at_its_limit_and_closes_the_link(nccl_pair):
    """NCCL waits for a lost peer for ever, and nothing aborted the link: a send waited for ever, and a receive's
    delivery polled for ever (its buffer held, every later receive on the link queued behind it; a review). Each
    waits at most its session's limit (`DataPlane.timeout_of`, which the daemon sets), then fails naming peer and
    key and closes the link, so later transfers fail at once until the actors are wired again."""

    async def go():
        a, b = await nccl_pair()
        a.timeout_of = b.timeout_of = lambda key: 0.2
        try:
            comm = b._nccl.inn[0].comm
            comm.lost = True
            r = asyncio.ensure_future(b.recv(0, (3, 1)))  # (no mailbox limit: the route's own limit ends it)
            await asyncio.wait_for(a.send(1, (3, 1), jnp.arange(4.0)), 10)
            with pytest.raises(TransferError, match=r"actor 1: NCCL receive \(3, 1\) from actor 0 failed: NCCL had not "
                                                    r"completed it after 0.2 s .*the link is closed until the actors are wired again"):
                await asyncio.wait_for(r, 30)
            assert comm.aborted and 0 not in b._nccl.inn
            comm = a._nccl.out[1].comm
            comm.lost = True
            with pytest.raises(TransferError, match=r"actor 0: NCCL send \(3, 2\) to actor 1 failed: NCCL had not completed "
                                                    r"it after 0.2 s .*the link is closed until the actors are wired again"):
                await asyncio.wait_for(a.send(1, (3, 2), jnp.arange(4.0)), 30)
            assert comm.aborted
            with pytest.raises(TransferError, match=r"no NCCL link to actor 1 \(key .*\): none was made, or a transfer on it failed or stalled and it was closed.*make the mesh again"):
                await a.send(1, (3, 3), jnp.arange(4.0))
        finally:
            a.close()
            b.close()

    asyncio.run(go())


def test_gpu_0_is_used_when_its_local_hardware_id_is_0(monkeypatch):
    """`local_hardware_id or id` took GPU 0's local id 0 for missing and used the global id (a review)."""
    from transport.p2p.nccl import NcclLinks

    stand_in_cupy(monkeypatch)
    links = NcclLinks(types.SimpleNamespace(actor_id=0), types.SimpleNamespace(local_hardware_id=0, id=3))
    assert links.device_id == 0
    links.setup([])
    assert sys.modules["cupy.cuda"].used == [0]
