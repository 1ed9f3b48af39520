"""Same-host links (transport/p2p/link.py): data-plane messages between two actors of one host over a Unix
SEQPACKET connection, authenticated by the kernel's word on the peer's process id. Real sockets, real
DataPlanes (two in this process, so both have this process's id), and a real stranger process."""

import asyncio
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import zmq

from transport.auth import KeyPair
from transport.p2p import link as links
from transport.p2p.plane import DataPlane

pytestmark = pytest.mark.skipif(not links.available(), reason="links need Linux (abstract Unix names, SEQPACKET)")


async def pair(route="shm", keys=True):
    """Two started, connected DataPlanes (actors 0 and 1) on `route`, CURVE keys on."""
    d = tempfile.mkdtemp()
    ka, kb = (KeyPair.generate(), KeyPair.generate()) if keys else (None, None)
    a, b = DataPlane(0, ipc_dir=d, keys=ka, tcp=False), DataPlane(1, ipc_dir=d, keys=kb, tcp=False)
    await a.start()
    await b.start()

    def spec(ep):
        return {"address": ep["ipc"], "route": route, "key": ep["key"], "shm_prefix": ep["shm_prefix"],
                "link": ep["link"], "pid": ep["pid"]}

    await asyncio.gather(a.connect({1: spec(b.endpoint())}), b.connect({0: spec(a.endpoint())}))
    return a, b


def test_same_host_messages_travel_over_the_link_exactly_and_zeromq_carries_none():
    rng = np.random.default_rng(0)
    cases = [np.float32(3.5), np.zeros((0, 3), np.int8), rng.standard_normal(256).astype(np.float32),
             rng.integers(0, 255, 60_000, dtype=np.uint8),  # just under the shared-memory threshold: inline on the link
             rng.standard_normal((256, 512)).astype(np.float32)]  # 512 KiB: shared memory, notice on the link

    async def go():
        a, b = await pair()
        try:
            got = []
            for i, x in enumerate(cases):
                recv = asyncio.ensure_future(b.recv(0, (1, 0, i), 10))
                await a.send(1, (1, 0, i), x)
                got.append(np.array(await recv))
            back = asyncio.ensure_future(a.recv(1, (1, 1, 0), 10))
            await b.send(0, (1, 1, 0), cases[2])
            got_back = np.array(await back)
            await asyncio.sleep(0.05)
            return got, got_back, a.stats(), b.stats()
        finally:
            a.close()
            b.close()

    got, got_back, sa, sb = asyncio.run(go())
    for x, y in zip(cases, got):
        assert y.dtype == np.asarray(x).dtype and y.shape == np.asarray(x).shape
        np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(got_back, cases[2])
    assert sa["links"] == {"out": [1], "in": [1]} and sb["links"] == {"out": [0], "in": [0]}
    # Every message each way (data, shm notices, and the shm acks coming back) went over the links.
    assert sb["link_messages"] >= len(cases) and sa["link_messages"] >= 1
    assert sa.get("bad_messages", 0) == sb.get("bad_messages", 0) == 0


def test_messages_posted_faster_than_the_receiver_reads_arrive_all_and_in_order():
    """The receiver's loop is busy while 400 x 16 KiB are posted (far more than a socket buffer holds): the rest
    wait in the link's backlog and are sent when the socket has room."""

    async def go():
        a, b = await pair()
        try:
            xs = [np.full(4096, i, np.float32) for i in range(400)]
            for i, x in enumerate(xs):  # no await between posts: neither loop runs meanwhile
                assert a.send_now(1, (2, 0, i), x)
            got = [np.array(await b.recv(0, (2, 0, i), 10)) for i in range(len(xs))]
            return xs, got
        finally:
            a.close()
            b.close()

    xs, got = asyncio.run(go())
    for x, y in zip(xs, got):
        np.testing.assert_array_equal(x, y)


STRANGER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("\\0" + sys.argv[1])
try:
    s.sendmsg([b"\\x05\\x00\\x00\\x00", b"hello"])
    print("closed" if s.recv(10) == b"" else "open")
except (BrokenPipeError, ConnectionResetError):  # the actor had closed it already
    print("closed")
"""


def test_a_stranger_process_that_dials_an_actors_link_is_refused_and_the_actor_carries_on():
    async def go():
        a, b = await pair()
        try:
            name = b.endpoint()["link"]
            out = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", STRANGER, name],
                                          capture_output=True, text=True, timeout=30)
            recv = asyncio.ensure_future(b.recv(0, (3, 0, 0), 10))
            await a.send(1, (3, 0, 0), np.arange(5.0))
            return out, np.array(await recv), b.stats()
        finally:
            a.close()
            b.close()

    out, got, sb = asyncio.run(go())
    assert out.returncode == 0 and out.stdout.strip() == "closed", out.stderr
    np.testing.assert_array_equal(got, np.arange(5.0))
    assert sb["refused_links"] == 1 and sb.get("bad_messages", 0) == 0


def test_dialling_a_link_served_by_another_process_than_announced_fails():
    listener = links.Listener(7)
    try:
        with pytest.raises(links.LinkError, match="not by process 1 "):
            links.Link.dial(listener.name, 1, None)
        with pytest.raises(links.LinkError, match="could not dial"):
            links.Link.dial("mpmd-link-nobody-listens-here", 1, None)
    finally:
        listener.close()


def test_a_message_too_big_for_one_record_is_left_to_zeromq():
    listener = links.Listener(8)
    import os

    lk = links.Link.dial(listener.name, os.getpid(), None)
    try:
        assert lk.post([b"h", memoryview(bytes(100))])
        assert not lk.post([b"h", memoryview(bytes(links.MAX_RECORD))])  # nothing sent: the caller uses ZeroMQ
        assert not lk.post([b"h", b"a", b"b"])  # a record carries one array at most
    finally:
        lk.close()
        listener.close()


@pytest.mark.parametrize("bad", [{"link": "/tmp/x", "pid": 5}, {"link": "mpmd-link-1", "pid": "5"},
                                 {"link": "mpmd-link-1", "pid": None}, {"link": "mpmd-link-\x001", "pid": 5},
                                 {"link": "mpmd-link-1", "pid": True}])
def test_a_peer_spec_with_a_bad_link_is_refused_before_anything_changes(bad):
    async def go():
        d = tempfile.mkdtemp()
        a = DataPlane(0, ipc_dir=d, tcp=False)
        try:
            with pytest.raises(ValueError, match="link"):
                await a.connect({1: {"address": f"ipc://{d}/x.sock", "route": "shm", "shm_prefix": "/mpmd-x-", **bad}})
            return a.routes
        finally:
            a.close()

    assert asyncio.run(go()) == {}


def test_a_tcp_route_uses_no_link():
    async def go():
        a, b = await pair(route="tcp")
        try:
            recv = asyncio.ensure_future(b.recv(0, (4, 0, 0), 10))
            await a.send(1, (4, 0, 0), np.arange(3))
            return np.array(await recv), a.stats(), b.stats()
        finally:
            a.close()
            b.close()

    got, sa, sb = asyncio.run(go())
    np.testing.assert_array_equal(got, np.arange(3))
    assert sa["links"] == sb["links"] == {"out": [], "in": []} and "link_messages" not in sb


def test_a_data_message_goes_with_a_compact_header_that_carries_every_dtype_shape_and_key_exactly():
    """`pack_data` and `parse_data` against the array itself, for every wire dtype; then end to end over a link."""
    from transport.protocol import ALLOWED_DTYPES

    assert set(ALLOWED_DTYPES) <= set(links.COMPACT_DTYPES)  # every wire dtype has a compact number
    rng = np.random.default_rng(3)
    cases = [np.array(rng.integers(0, 100, size), dt) for dt in ALLOWED_DTYPES.values()
             for size in [(), (0, 5), (3, 1, 2), (7,)]]
    cases.append(np.arange(24, dtype=">i4").reshape(2, 3, 4))  # big-endian: no compact header (msgpack's converts it)
    key = (2**62 + 5, 9, 123456789, 3, 0, 1)
    for x in cases[:-1]:
        header, payload = links.pack_data(key, x)
        assert header[0] == links.COMPACT
        got_key, dt, shape = links.parse_data(memoryview(header))
        assert (got_key, dt, shape, links.data_bytes(dt, shape)) == (key, x.dtype, x.shape, x.nbytes)
        assert bytes(payload) == x.tobytes()
    assert links.pack_data(key, cases[-1]) is None
    assert links.pack_data((2**63,), np.zeros(3)) is None  # beyond int64: the msgpack header takes it

    async def go():
        a, b = await pair()
        try:
            got = []
            for i, x in enumerate(cases):
                recv = asyncio.ensure_future(b.recv(0, (4, 0, i), 10))
                assert a.send_now(1, (4, 0, i), x) or await a.send(1, (4, 0, i), x) is None
                got.append(await recv)
            return got, b.stats()
        finally:
            a.close()
            b.close()

    got, sb = asyncio.run(go())
    for x, y in zip(cases, got):
        assert y.dtype == x.dtype.newbyteorder("=") and y.shape == x.shape and (y.size == 0 or y.ctypes.data % 64 == 0)
        np.testing.assert_array_equal(y, x)
    assert sb["link_messages"] == len(cases) and sb.get("bad_messages", 0) == 0
    assert sb["compact_messages"] == len(cases) - 1  # all but the big-endian one, which msgpack's header carried


def _compact(version=None, index=0, nkey=4, ndim=1, ints=(1, 0, 7, 0, 3)):
    import struct

    from transport.protocol import PROTOCOL_VERSION

    head = struct.pack("<5B", links.COMPACT, PROTOCOL_VERSION if version is None else version, index, nkey, ndim)
    return head + struct.pack(f"<{len(ints)}q", *ints)


@pytest.mark.parametrize("record, fails_key", [
    ((_compact(version=1), b"\0\0\0"), None),  # another protocol version
    ((_compact(index=250), b"\0\0\0"), None),  # no such dtype
    ((_compact(ndim=33, ints=(1, 0, 7, 0) + (1,) * 33), b"\0"), None),  # rank beyond numpy's
    ((_compact()[:-3], b"\0\0\0"), None),  # truncated
    ((_compact(ints=(1, 0, 7, 0, -3)), b""), (1, 0, 7, 0)),  # negative dimension
    ((_compact(), b"\0\0"), (1, 0, 7, 0)),  # payload shorter than the shape needs
    ((_compact(nkey=17, ints=(1,) * 17 + (3,)), b"\0\0\0"), None),  # key longer than any transfer's
    ((_compact(ints=(1, 0, 7, 0, 2**61)), b"\0"), (1, 0, 7, 0)),  # more bytes than anything can hold
])
def test_a_malformed_compact_header_is_counted_fails_its_receive_at_once_and_the_link_carries_on(record, fails_key):
    async def go():
        a, b = await pair()
        try:
            waiting = asyncio.ensure_future(b.recv(0, (1, 0, 7, 0), 30))
            await asyncio.sleep(0)
            assert a._link_to(1).post(list(record))
            ok = asyncio.ensure_future(b.recv(0, (5, 0, 0), 10))
            assert a.send_now(1, (5, 0, 0), np.arange(3.0))
            after = np.array(await ok)
            try:
                outcome = await asyncio.wait_for(waiting, 0.5)
            except Exception as e:  # noqa: BLE001 - which one is the point
                outcome = e
            return outcome, after, b.stats()
        finally:
            a.close()
            b.close()

    outcome, after, sb = asyncio.run(go())
    np.testing.assert_array_equal(after, np.arange(3.0))
    assert sb["bad_messages"] == 1
    if fails_key is not None:  # the key was read: its receive fails now, naming the sender
        assert "from actor 0" in str(outcome) and not isinstance(outcome, TimeoutError), outcome
    else:  # nothing in it can be trusted: the receive is left to its own timeout
        assert isinstance(outcome, TimeoutError), outcome


@pytest.mark.parametrize("route", ["shm", "tcp"])
def test_a_wiring_with_a_wrong_peer_key_breaks_that_wiring_only(route):
    """connect_peers told actor 0 a wrong key for actor 1 (a hostile or mistaken controller): actor 0 refused actor
    1's handshake, and dropped the link. The next, correct wiring changed nothing on actor 1 (the same spec as
    before), so its refused connection, which ZeroMQ does not re-dial, and its broken link stayed: every later
    session's sends from 1 to 0 failed ('Resource temporarily unavailable') until the daemons restarted (a probe).
    A new wiring now tries both again."""

    async def go():
        a, b = await pair(route)
        good = {"address": b.endpoint()["ipc"], "route": route, "key": b.endpoint()["key"], "shm_prefix": b.endpoint()["shm_prefix"],
                "link": b.endpoint()["link"], "pid": b.endpoint()["pid"]}
        try:
            x = np.arange(6, dtype=np.float32)
            if route == "shm":  # (the link, which actor 0 drops at the wrong wiring; over ZeroMQ, a connection made
                # before it would outlive it: the connection must first be made under the wrong key)
                recv = asyncio.ensure_future(a.recv(1, (1, 0, 0), 10))
                await b.send(0, (1, 0, 0), x)
                np.testing.assert_array_equal(np.array(await recv), x)  # wired right: 1 -> 0 works
            await a.connect({1: {**good, "key": KeyPair.generate().public.decode()}})  # the wrong key for actor 1
            recv = asyncio.ensure_future(a.recv(1, (1, 1, 0), 1.5))
            await b.send(0, (1, 1, 0), x)
            with pytest.raises(TimeoutError):  # (actor 0 refused actor 1's handshake: the message is lost)
                await recv
            # That session ends (its step failed); the refusal has reached actor 1's socket by the next one, which
            # is left with no pipe (it lingers a second or two here: the next session's send would race it).
            deadline = time.monotonic() + 10
            while b._out[0].poll(0, zmq.POLLOUT) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not b._out[0].poll(0, zmq.POLLOUT)
            # the next session wires both right: actor 1's spec for actor 0 is what it was
            spec_a = {"address": a.endpoint()["ipc"], "route": route, "key": a.endpoint()["key"],
                      "shm_prefix": a.endpoint()["shm_prefix"], "link": a.endpoint()["link"], "pid": a.endpoint()["pid"]}
            await asyncio.gather(a.connect({1: good}), b.connect({0: spec_a}))
            for i in range(3):
                recv = asyncio.ensure_future(a.recv(1, (2, 0, i), 10))
                await b.send(0, (2, 0, i), x + i)
                np.testing.assert_array_equal(np.array(await recv), x + i)
        finally:
            a.close()
            b.close()

    asyncio.run(go())


def test_a_refused_nccl_wiring_changes_nothing():
    """route 'nccl' without its unique ids (or on an actor with no NCCL) set the route, then failed on a bare
    KeyError ('nccl_out'): the next step's send found no NCCL link, an AttributeError (a probe). Checked with the
    rest of the spec now, before anything changes."""

    async def go():
        a, b = await pair("shm")
        try:
            spec = {"address": b.endpoint()["ipc"], "route": "nccl", "key": b.endpoint()["key"]}
            with pytest.raises(ValueError, match="route nccl, but actor 0 has no NCCL"):
                await a.connect({1: spec})
            assert a.routes[1] == "shm"
            x = np.arange(3, dtype=np.float32)
            recv = asyncio.ensure_future(b.recv(0, (1, 0, 0), 10))
            await a.send(1, (1, 0, 0), x)
            np.testing.assert_array_equal(np.array(await recv), x)
        finally:
            a.close()
            b.close()

    asyncio.run(go())


@pytest.mark.parametrize("route", ["shm", "tcp"])
def test_a_rewiring_with_the_same_specs_loses_no_transfer_in_flight(route):
    """A daemon's data plane serves every session on it: a second job of the same key attaching, or a recovery's
    rewiring, sends connect_peers with the specs unchanged. Closing and re-dialling unchanged peers' connections then
    (a fix for a refused handshake) dropped transfers in flight and sends right behind it (a review: 4 of 12 lost).
    Nothing is dropped: the connections stay."""

    async def go():
        a, b = await pair(route)

        def spec(ep):
            return {"address": ep["ipc"], "route": route, "key": ep["key"], "shm_prefix": ep["shm_prefix"], "link": ep["link"],
                    "pid": ep["pid"]}

        try:
            xs = [np.full(1 << 20, i, np.float32) for i in range(12)]  # 4 MiB each
            recvs = [asyncio.ensure_future(a.recv(1, (1, 0, i), 20)) for i in range(12)]
            for i, x in enumerate(xs):
                await b.send(0, (1, 0, i), x)
                if i % 4 == 3:  # rewired, the same specs, while the earlier sends are still on their way
                    await asyncio.gather(a.connect({1: spec(b.endpoint())}), b.connect({0: spec(a.endpoint())}))
            for x, r in zip(xs, recvs):
                np.testing.assert_array_equal(np.asarray(await r), x)
        finally:
            a.close()
            b.close()

    asyncio.run(go())
