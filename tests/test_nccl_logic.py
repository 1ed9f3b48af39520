"""The NCCL route's own logic — sequence numbering, notices, receives posted in the sender's order, raw-byte
transport of bfloat16/float8, empty arrays — run on CPU with a stand-in for cupy and NCCL.

FAKE, because NCCL cannot run here (no GPU): `FakeCupy` gives host buffers with device-like pointers, and
`FakeComm` moves bytes between the two ranks of a communicator in call order (first send posted, first
receive served), which is NCCL's matching rule for point-to-point calls. Everything else is real: two
`DataPlane`s with real ZeroMQ sockets and receive threads, the real `NcclLinks` code, JAX arrays in and out.
The same behaviour on real GPUs is checked by tests/test_nccl.py where two GPUs exist.
"""

import asyncio
import ctypes
import itertools
import sys
import tempfile
import types
from collections import deque

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from transport.p2p import DataPlane

WIRES: dict[tuple, deque] = {}


class FakeBuf(np.ndarray):
    @property
    def data(self):  # cupy arrays expose their device pointer as .data.ptr
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


class FakeComm:
    def __init__(self, ndev, uid, rank):
        assert ndev == 2 and rank in (0, 1)
        self.wire = WIRES.setdefault(tuple(uid), deque())
        self.rank = rank
        self.calls = []

    def send(self, ptr, count, dtype, peer, stream):
        assert self.rank == 0 and peer == 1, "a link's rank 0 only sends to rank 1"
        self.wire.append(ctypes.string_at(ptr, count))
        self.calls.append(("send", count))

    def recv(self, ptr, count, dtype, peer, stream):
        assert self.rank == 1 and peer == 0, "a link's rank 1 only receives from rank 0"
        data = self.wire.popleft()  # NCCL matches by order: this receive takes the oldest send
        assert len(data) == count, f"receive of {count} bytes matched a send of {len(data)}: posted out of order"
        ctypes.memmove(ptr, data, count)
        self.calls.append(("recv", count))

    def destroy(self):
        pass


def fake_cupy():
    ids = itertools.count()
    nccl = types.SimpleNamespace(NcclCommunicator=FakeComm, NCCL_UINT8=1,
                                 get_unique_id=lambda: tuple([next(ids) % 256] * 128))

    class Event:
        done = True

        def __init__(self, disable_timing=False):
            pass

        def record(self, stream):
            pass

    class Device:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cuda = types.SimpleNamespace(nccl=nccl, Event=Event, Device=Device,
                                 Stream=lambda non_blocking=False: types.SimpleNamespace(ptr=0))
    cupy = types.SimpleNamespace(cuda=cuda, uint8=np.uint8,
                                 empty=lambda n, dtype: np.empty(n, dtype).view(FakeBuf),
                                 from_dlpack=lambda x: np.from_dlpack(x).view(FakeBuf))
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
        await asyncio.gather(
            a.connect({1: {"address": b.endpoint()["ipc"], "route": "nccl", "nccl_out": up, "nccl_in": down}}),
            b.connect({0: {"address": a.endpoint()["ipc"], "route": "nccl", "nccl_out": down, "nccl_in": up}}))
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
