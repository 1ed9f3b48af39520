"""Actor-to-actor transfers over each data-plane route (ZeroMQ frames, shared memory), driven by hand-written
Programs (Send/Recv only), through the real interpreter and real daemons."""

import itertools
import os
import socket
import time

import jax
import ml_dtypes
import numpy as np
import pytest

import mpmd
from mpmd.compiler.program import Label, Program, Recv, Send, Task
from transport.protocol import dtype_name

_ids = itertools.count(10_000)


@pytest.fixture(scope="module", params=["tcp", "shm"])
def route_mesh(request):
    """A 2-actor mesh whose actors send to each other over one route."""
    with mpmd.RemoteMesh.local(num_actors=2, transport=request.param) as mesh:
        assert set(mesh.routes.values()) == {request.param}
        yield mesh


def transfer_programs(pairs):
    """pairs: list of (src, dst, tag, array). Builds one program per actor of the 2-actor mesh:
    the sender's inputs are its arrays, the receiver's outputs are what it received."""
    progs = {a: Program(a, [], []) for a in (0, 1)}
    for i, (src, dst, tag, arr) in enumerate(pairs):
        sb, rb = 2 * i, 2 * i + 1
        progs[src].inputs.append(sb)
        progs[src].instructions.append(Send(sb, dst, tag, Label("xfer")))
        progs[dst].instructions.insert(0, Recv(rb, src, tag, dtype_name(arr.dtype), arr.shape, Label("xfer")))
        progs[dst].outputs.append(rb)
    return progs


def run_transfers(mesh, pairs, keep=False):
    """Runs the transfers; returns the received arrays as read back from the receivers (and, with `keep`,
    the RemoteArrays holding them, which keep them alive on the actors)."""
    progs = transfer_programs(pairs)
    pid = next(_ids)
    for a, p in progs.items():
        mesh.run(mesh.executables.load_program(a, p, pid, []))
    inputs = {0: [], 1: []}
    outputs = {0: [], 1: []}
    for src, dst, tag, arr in pairs:
        with jax.enable_x64(True):  # put keeps 64-bit dtypes as jax.device_put does, only with x64 on: these test transport
            inputs[src].append(mesh.actor(src).put(arr))
        outputs[dst].append(mesh.new_buffer_id())

    async def go():
        import asyncio

        return await asyncio.gather(*(mesh.conn(a).request("run_program", {
            "program": pid, "step": 0, "inputs": [r.buffers[a] for r in inputs[a]], "outputs": outputs[a]}) for a in (0, 1)))

    mesh.run(go())
    got = {a: [mpmd.RemoteArray(mesh, {a: b}, (), np.float32) for b in outputs[a]] for a in (0, 1)}
    results, held = [], []
    seen = {0: 0, 1: 0}
    for src, dst, tag, arr in pairs:
        r = got[dst][seen[dst]]
        seen[dst] += 1
        results.append(np.array(mesh.get_buffer(dst, r.buffers[dst])))
        held.append(r)
    return (results, held) if keep else results


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64]
SHAPES = [(), (0,), (1,), (3, 0), (17,), (4, 5, 6), (160, 130), (3, 257, 129), (1100, 1024)]  # the last three exceed 64 KiB
# (shm payloads); the last one 1 MiB at every dtype: over tcp it is read zero-copy and aligned off the event loop


def random_array(rng, dt, shape):
    return (rng.standard_normal(shape) * 10).astype(dt) if dt != np.bool_ else rng.random(shape) > 0.5


def test_transfers_are_exact_for_many_dtypes_and_shapes(route_mesh):
    rng = np.random.default_rng(0)
    pairs = []
    for i, (dt, shape) in enumerate(itertools.product(DTYPES, SHAPES)):
        pairs.append((i % 2, 1 - i % 2, i, random_array(rng, dt, shape)))
    for (src, dst, tag, a), b in zip(pairs, run_transfers(route_mesh, pairs)):
        assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), (a.dtype, a.shape)


def test_many_concurrent_transfers_in_both_directions_with_out_of_order_tags(route_mesh):
    rng = np.random.default_rng(1)
    tags = rng.permutation(200).tolist()  # receives are posted in a different order than sends go out
    pairs = [(t % 2, 1 - t % 2, t, rng.standard_normal((t % 7, 64 if t % 3 else 8192)).astype(np.float32)) for t in tags]
    for (src, dst, tag, a), b in zip(pairs, run_transfers(route_mesh, pairs)):
        np.testing.assert_array_equal(b, a)


def test_shared_memory_is_not_reused_while_a_received_array_lives_and_is_reused_after():
    """Received arrays alias the sender's segments (JAX does not copy an aligned host array). Arrays kept alive
    across steps must keep their contents while new transfers go out; once they are deleted, later steps reuse
    the same segments instead of creating new ones."""
    with mpmd.RemoteMesh.local(num_actors=2, transport="shm") as mesh:
        rng = np.random.default_rng(3)
        kept = []
        for step in range(4):  # each step's results stay alive on actor 1 while the next step sends
            arrays = [rng.standard_normal((256, 256)).astype(np.float32) for _ in range(3)]
            got, held = run_transfers(mesh, [(0, 1, t, a) for t, a in enumerate(arrays)], keep=True)
            kept.append((arrays, held))
        for arrays, held in kept:
            for a, r in zip(arrays, held):
                np.testing.assert_array_equal(mesh.get_buffer(1, r.buffers[1]), a)
        created = mesh.actor(0).stats()["p2p"]["shm_segments"]
        assert created == 12  # 4 steps x 3 arrays alive at once: no segment was handed out twice
        del kept, held, r
        import gc

        gc.collect()
        mesh.actor(1).ping()  # the deletes are flushed, the actor acked the segments
        time.sleep(0.2)
        for _ in range(3):
            arrays = [rng.standard_normal((256, 256)).astype(np.float32) for _ in range(3)]
            for a, b in zip(arrays, run_transfers(mesh, [(0, 1, t, a) for t, a in enumerate(arrays)])):
                np.testing.assert_array_equal(b, a)
        assert mesh.actor(0).stats()["p2p"]["shm_segments"] == created  # warm segments reused


def test_routes_follow_the_transport_choice(mesh2):
    assert mesh2.transport == "auto" and mesh2.routes == {(0, 1): "shm", (1, 0): "shm"}  # one host, CPU actors
    with mpmd.RemoteMesh.local(num_actors=3, transport="tcp") as mesh:
        assert mesh.routes == {(i, j): "tcp" for i in range(3) for j in range(3) if i != j}
        assert mesh.actor(0).stats()["p2p"]["routes"] == {"1": "tcp", "2": "tcp"}


def test_a_receive_whose_peer_never_sends_times_out_naming_both_actors_and_the_tag():
    """Actor 0 is alive but its program has no Send: actor 1's receive must fail after the transfer timeout,
    and the actor must serve the next request."""
    with mpmd.RemoteMesh.local(num_actors=2, transfer_timeout=0.5) as mesh:
        pid = next(_ids)
        mesh.run(mesh.executables.load_program(0, Program(0, [], [], []), pid, []))
        recv = Program(1, [], [0], [Recv(0, 0, 7, "float32", (3,), Label.of(Task(0, "F", 2)))])
        mesh.run(mesh.executables.load_program(1, recv, pid, []))
        t = time.monotonic()
        with pytest.raises(mpmd.RemoteError, match=r"actor 1 waited 0.5 s for 0F2 \(tag 7\) from actor 0") as e:
            mesh.run(mesh.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [mesh.new_buffer_id()]}))
        assert e.value.remote_type == "NothingCame" and time.monotonic() - t < 30
        assert mesh.actor(1).ping() > 0


def test_a_segment_another_process_put_under_the_senders_name_is_refused_not_read_as_the_activation(mesh2):
    """A process of the same user unlinked a sender's segment and made one of the same name and size, filled with
    its own bytes, before the receiver opened it: the step computed with them (losses 28.09 against jax.jit's 1.43;
    a probe). The notice carries the inode of the file the sender made, and the receiver maps only that file. The
    sender is a stand-in registered like a real actor (tests/wire.py); the receiving daemon is real."""
    import asyncio

    from tests.wire import FakePeer
    from transport.p2p import shm
    from transport.p2p.shm import CONTROL

    pid = next(_ids)
    peer = FakePeer(mesh2, 1, 7)
    recv = Program(1, [], [0], [Recv(0, 7, 3, "float32", (1024, 64), Label("xfer"))])
    mesh2.run(mesh2.executables.load_program(1, recv, pid, []))
    name, size = f"{peer.prefix}1-2", (1 << 18) + CONTROL
    made, ino = shm.create_segment(name, size)  # the sender's segment (its payload would be the activation)
    made.close()
    shm.unlink(name)
    other, _ = shm.create_segment(name, size)  # another process's, under the same name and size
    other[: 1 << 18] = np.full(1 << 16, 7.0, np.float32).tobytes()
    try:
        peer.send({"op": "shm", "key": [mesh2.session, pid, 0, 3], "seg": 2, "name": name, "size": size, "ino": ino,
                   "arrays": [{"dtype": "float32", "shape": [1024, 64]}]})

        async def go():
            return await mesh2.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [mesh2.new_buffer_id()]})

        with pytest.raises(mpmd.RemoteError, match=f"could not map shared memory {name} from actor 7: .* is not the file actor 7 made"):
            mesh2.run(asyncio.wait_for(go(), 30))
    finally:
        other.close()
        shm.unlink(name)
        peer.close()
    a = np.arange(1 << 16, dtype=np.float32)  # (big enough for shared memory: the real route still delivers)
    np.testing.assert_array_equal(run_transfers(mesh2, [(0, 1, 0, a)])[0], a)


def test_a_bad_data_plane_message_fails_the_receive_and_the_actor_survives(mesh2):
    """A notice naming shared memory that does not exist (or garbage bytes) on an actor's data-plane socket, from
    a peer the actor authenticates (a stand-in registered like a real actor: tests/wire.py): the receive it
    claims to answer fails at once with a clear error; the daemon keeps serving."""
    import asyncio

    from tests.wire import FakePeer

    pid = next(_ids)
    peer = FakePeer(mesh2, 1, 7)  # (first: a Program receiving from an actor the data plane is not wired to is refused)
    recv = Program(1, [], [0], [Recv(0, 7, 3, "float32", (1024, 64), Label("xfer"))])
    mesh2.run(mesh2.executables.load_program(1, recv, pid, []))
    peer.send_raw([b"\x00garbage"])
    name = f"{peer.prefix}1-1"  # the name a segment of this peer's for actor 1 would have; there is none
    peer.send({"op": "shm", "key": [mesh2.session, pid, 0, 3], "seg": 1, "name": name,
               "size": 1 << 18, "ino": 0, "arrays": [{"dtype": "float32", "shape": [1024, 64]}]})

    async def go():
        return await mesh2.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [mesh2.new_buffer_id()]})

    with pytest.raises(mpmd.RemoteError, match=f"could not map shared memory {name} from actor 7"):
        mesh2.run(asyncio.wait_for(go(), 30))
    peer.close()
    a = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(run_transfers(mesh2, [(0, 1, 0, a)])[0], a)


def test_a_transfer_of_the_wrong_shape_fails_naming_both_actors_and_the_tag(mesh2):
    a = np.ones((3, 4), np.float32)
    progs = transfer_programs([(0, 1, 5, a)])
    progs[1].instructions[0] = Recv(1, 0, 5, "float32", (4, 3), Label("xfer"))
    pid = next(_ids)
    for act, p in progs.items():
        mesh2.run(mesh2.executables.load_program(act, p, pid, []))
    src = mesh2.actor(0).put(a)

    async def go():
        import asyncio

        return await asyncio.gather(
            mesh2.conn(0).request("run_program", {"program": pid, "step": 0, "inputs": [src.buffers[0]], "outputs": []}),
            mesh2.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [mesh2.new_buffer_id()]}),
            return_exceptions=True)

    ok, err = mesh2.run(go())
    assert isinstance(err, mpmd.RemoteError) and err.remote_type == "TransferError"
    assert "actor 1 expected float32[4, 3] from actor 0" in str(err) and "tag 5" in str(err)
    assert mesh2.actor(1).ping() > 0


def test_a_failing_stage_aborts_the_step_on_every_actor_and_the_mesh_stays_usable(mesh2):
    """A stage that raises (here: an input never put) must not leave the other actor waiting forever."""
    import jax
    import optax

    from tests import models
    from tests.test_pipeline import make_step

    rng = np.random.default_rng(2)
    params = models.mlp_params(rng, 2)
    opt = optax.sgd(0.1)
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    batch = models.regression_batch(rng, 4, 2, 16)
    p, o, first = dist(params, opt.init(params), batch)
    first.block_until_ready()
    bogus = jax.tree.map(lambda x: x, p)
    bogus[1]["w"] = mpmd.RemoteArray(mesh2, {1: 424242}, p[1]["w"].shape, np.float32)
    out = dist(bogus, o, batch)  # returns at once; the step fails on actor 1, which reads the missing argument
    with pytest.raises(mpmd.RemoteError, match=r"(?s)actor 1, during step \d+ of step: .*no buffer 424242"):
        out[2].to_numpy()
    assert all(mesh2.actor(a).stats()["running"] == 0 for a in (0, 1))
    p2, o2, losses = dist(p, o, batch)
    assert np.isfinite(losses.to_numpy()).all()
    # a failed step whose outputs nobody fetches: its error surfaces at the next call instead
    dist(bogus, o, batch)
    import time

    time.sleep(0.5)
    with pytest.raises(mpmd.RemoteError, match="no buffer 424242"):
        dist(p, o, batch)
    assert np.isfinite(dist(p, o, batch)[2].to_numpy()).all()


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_segments_a_sender_closes_past_its_pool_limit_are_unmapped_by_the_receiver_too(monkeypatch):
    """Past its pool's limit a sender closes a released segment; the receiver kept its mapping for the rest of the
    session: 20 more segments and 80 MiB mapped per 60 transfers alternating three sizes (a probe). It now unmaps
    the segments their sender marked closed, so its mappings stay as few as the sender's pool."""
    import gc
    import os

    from transport.p2p import shm

    monkeypatch.setattr(shm, "POOL_LIMIT", 4 << 20)  # (a quarter of /dev/shm otherwise: GiBs)
    sender, receiver = shm.ShmSender(f"/mpmd-test{os.getpid()}-closed-"), shm.ShmReceiver()
    try:
        for i in range(60):
            n = (1 << 20, 2 << 20, 3 << 20)[i % 3]  # three size classes, 7 MiB together: past the limit
            seg = sender.acquire(n)
            sender.write(seg, np.full(n, i % 251, np.uint8))
            view = receiver.view(0, seg.id, seg.name, seg.mapped, np.dtype(np.uint8), [n], n)
            assert view[0] == view[-1] == i % 251
            del view
            gc.collect()
            sender.reclaim()
        assert sender.created >= 20  # (the pool cannot keep all three sizes: segments are closed and made anew)
        assert len(receiver.maps) <= 4, len(receiver.maps)
    finally:
        sender.close()
        receiver.close()


def test_a_segment_comes_back_through_its_control_page_only_once_the_receivers_view_is_gone():
    """transport/p2p/shm.py in one process: the receiver's last view going marks that use of the segment
    released in the segment's control page, and only then does the sender reclaim it (no message); a release
    of an earlier use does not free a later one."""
    import gc
    import os

    from transport.p2p import shm

    sender, receiver = shm.ShmSender(f"/mpmd-test{os.getpid()}-"), shm.ShmReceiver()
    try:
        data = np.arange(1 << 14, dtype=np.float32)  # 64 KiB
        seg = sender.acquire(data.nbytes)
        sender.write(seg, data)
        view = receiver.view(1, seg.id, seg.name, seg.mapped, np.dtype(np.float32), [1 << 14], data.nbytes)
        np.testing.assert_array_equal(view, data)
        assert sender.reclaim() == 0 and seg.id in sender.busy  # the view lives: not back
        alias = view[3:]
        del view
        gc.collect()
        assert sender.reclaim() == 0 and receiver.outstanding == 1  # a slice of it still lives
        del alias
        gc.collect()
        assert receiver.outstanding == 0 and sender.reclaim() == 1 and not sender.busy
        again = sender.acquire(data.nbytes)
        assert again is seg and seg.uses == 2  # the same segment, its second use
        second = receiver.view(1, seg.id, seg.name, seg.mapped, np.dtype(np.float32), [1 << 14], data.nbytes)
        words = seg.control()
        words[1] = 1  # what the receiver wrote for the first use: not a release of this one
        words.release()
        assert sender.reclaim() == 0
        del second
        gc.collect()
        assert sender.reclaim() == 1
        with pytest.raises(ValueError, match="control page"):
            receiver.view(1, seg.id, seg.name, 1024, np.dtype(np.float32), [4], 16)
    finally:
        receiver.close()
        sender.close()


def test_daemons_listening_on_ipv6_run_a_step_over_a_tcp_data_plane_like_jit():
    """--listen tcp://[::1]:0 stopped the daemon with "No such device": no ZeroMQ socket was told it may speak
    IPv6 (a probe). Control and data plane now bind and connect on IPv6 hosts."""
    import optax

    from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch
    from tests.wire import start_daemon, stop_daemon

    if not socket.has_ipv6:
        pytest.skip("this host has no IPv6")
    procs = [start_daemon("--listen", "tcp://[::1]:0", "--actor-id", str(i), "--insecure") for i in range(2)]
    try:
        assert all(address.startswith("tcp://[::1]:") for _, address in procs)
        with mpmd.RemoteMesh.connect([address for _, address in procs], transport="tcp") as mesh:
            assert mesh.routes == {(0, 1): "tcp", (1, 0): "tcp"}
            rng = np.random.default_rng(0)
            params, batch, opt = mlp_params(rng, num_stages=2, width=8), regression_batch(rng, 4, 2, 8), optax.sgd(0.1)
            got = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)(params, opt.init(params), batch)
            want = jax.jit(make_train_step(mse_loss(mlp), opt, None))(params, opt.init(params), batch)
            for g, w in zip(jax.tree.leaves(mpmd.fetch(got)), jax.tree.leaves(want)):
                np.testing.assert_allclose(g, np.asarray(w), rtol=1e-6, atol=1e-7)
    finally:
        for proc, _ in procs:
            stop_daemon(proc)


def test_a_program_receiving_from_an_actor_the_data_plane_is_not_wired_to_is_refused_at_load(mesh2):
    """A Program with a recv from actor 55 loaded, and its step waited the whole --transfer-timeout (300 s by default)
    to say "is actor 55 stuck?", while a send to it failed at once (a probe): both are refused at load."""
    for ins in (Recv(0, 55, 3, "float32", (4,), Label("xfer")), Send(0, 55, 3, Label("xfer"))):
        with pytest.raises(mpmd.RemoteError, match=r"'load_program': a (recv from|send to) actor 55, but actor 1's data plane is "
                                                   r"not connected to it \(connected: \[0"):
            mesh2.run(mesh2.executables.load_program(1, Program(1, [0] if isinstance(ins, Send) else [], [] if isinstance(ins, Send) else [0],
                                                                [ins]), next(_ids), []))
    a = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(run_transfers(mesh2, [(0, 1, 0, a)])[0], a)


def test_a_peer_segment_name_that_is_not_a_regular_file_is_refused():
    """A FIFO (or anything but a regular file) under a segment name a peer announced is refused at open, naming it,
    before any mapping (the input side blocked on one; a probe); its name is removed as a segment's would be."""
    from transport.p2p import shm

    if not shm.available() or not os.path.isdir("/dev/shm"):
        pytest.skip("needs POSIX shared memory in /dev/shm")
    name = f"/mpmd-test{os.getpid()}-fifo-0"
    os.mkfifo("/dev/shm" + name, 0o600)
    try:
        with pytest.raises(ValueError, match=f"shared-memory segment {name} is not a regular file"):
            shm.ShmReceiver().open(1, 0, name, 4096)
        assert not os.path.exists("/dev/shm" + name)
    finally:
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)


def test_a_restarted_actor_is_heard_while_its_old_process_is_still_connected():
    """Real DataPlanes in this process: actor 1's old incarnation keeps its connection to actor 0 open (a dead
    host's half-open TCP connection stays until the kernel gives up on it; a killed process's end is noticed a
    moment later) while its replacement, wired in with a new key, sends. Each dialled with its actor id as
    ZeroMQ routing id, and actor 0's ROUTER ignored every message of the second connection under that id, for
    good: the replacement's transfers never came (this also made a security test flake, its fake peer dialling
    as actor 7 right after the previous test's had closed)."""
    import asyncio
    import tempfile

    from transport.auth import KeyPair
    from transport.p2p.plane import DataPlane

    def spec(p):
        ep = p.endpoint()
        return {"address": ep["ipc"], "route": "tcp", "key": ep["key"]}  # (ZeroMQ: the route a link does not take)

    async def go():
        d = tempfile.mkdtemp()
        a = DataPlane(0, ipc_dir=d, keys=KeyPair.generate(), tcp=False)
        old = DataPlane(1, ipc_dir=d, keys=KeyPair.generate(), tcp=False)
        new = None
        try:
            await a.start()
            await old.start()
            await asyncio.gather(a.connect({1: spec(old)}), old.connect({0: spec(a)}))
            got = asyncio.ensure_future(a.recv(1, (1, 0, 0), 10))
            await old.send(0, (1, 0, 0), np.arange(3, dtype=np.float32))
            assert np.array(await got).tolist() == [0, 1, 2]
            new = DataPlane(1, ipc_dir=tempfile.mkdtemp(), keys=KeyPair.generate(), tcp=False)
            await new.start()
            await asyncio.gather(a.connect({1: spec(new)}), new.connect({0: spec(a)}))  # (as a recovery rewires)
            got = asyncio.ensure_future(a.recv(1, (1, 0, 1), 10))
            await new.send(0, (1, 0, 1), np.arange(4, dtype=np.float32))
            return np.array(await got).tolist()
        finally:
            for p in (a, old, new):
                if p is not None:
                    p.close()

    assert asyncio.run(go()) == [0, 1, 2, 3]


def test_the_shared_memory_pool_of_a_pair_is_capped_by_mpmd_shm_pool_mb(monkeypatch, caplog):
    """The pool outlives jobs (a daemon keeps what its largest job needed, up to a quarter of /dev/shm per pair: ~6 GB
    on a 24 GB node; a probe): MPMD_SHM_POOL_MB caps it; a value that is no size is said and the default kept."""
    from transport.p2p import shm

    default = shm._pool_limit()
    monkeypatch.setenv("MPMD_SHM_POOL_MB", "64")
    assert shm._pool_limit() == 64 << 20
    for bad in ("0", "lots", "-5", "nan", "inf", "1e10"):
        monkeypatch.setenv("MPMD_SHM_POOL_MB", bad)
        with caplog.at_level("WARNING"):
            assert shm._pool_limit() == default
        assert f"MPMD_SHM_POOL_MB must be a number of MiB from 1 to 2**30, got {bad!r}" in caplog.text


def test_a_message_over_the_receivers_max_message_fails_its_receive_at_once_and_a_sender_knowing_the_limit_refuses_it():
    """A data message over the receiver's --max-message-mb: dropped there, its receive used to wait out its timeout
    (300 s in a session; a review). Of many frames each under the limit, the receiver reads the transfer its header
    names and fails that receive now; one frame over it ZeroMQ drops unseen, so the sender, told each peer's limit
    by the wiring, refuses to send it, naming the flag."""
    import asyncio
    import tempfile

    import zmq
    import zmq.asyncio

    from transport.p2p.base import TransferError
    from transport.p2p.plane import DataPlane
    from transport.protocol import encode

    async def go():
        a = DataPlane(0, ipc_dir=tempfile.mkdtemp())
        b = DataPlane(1, ipc_dir=tempfile.mkdtemp(), max_message_bytes=1 << 20)
        sock = None
        try:
            await a.start()
            await b.start()
            ea, eb = a.endpoint(), b.endpoint()
            await a.connect({1: {"address": eb["tcp"], "route": "tcp", "max_message": 1 << 20}})  # (b's, as the wiring says it)
            await b.connect({0: {"address": ea["tcp"], "route": "tcp"}})
            recv = asyncio.ensure_future(b.recv(0, (1, 2, 3), 60))
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(eb["tcp"])
            part = np.zeros(600 << 10, np.uint8)  # three frames of 0.6 MiB: 1.8 MiB in all
            await sock.send_multipart([encode({"op": "data", "src": 0, "key": [1, 2, 3], "arrays": [
                {"dtype": "uint8", "shape": [600 << 10]}]})[0], *(part.tobytes() for _ in range(3))])
            start = time.monotonic()
            with pytest.raises(TransferError, match=r"over this actor's --max-message-mb \(1 MiB\)"):
                await recv
            waited = time.monotonic() - start
            with pytest.raises(TransferError, match=r"cannot send \[1, 2, 4\] to actor 1: 2.0 MiB in one message, over actor 1's "
                                                    r"--max-message-mb \(1 MiB\)"):
                await a.send(1, (1, 2, 4), np.zeros(1 << 19, np.float32))
            assert a.stats()["sent_arrays"] == 0  # (refused: not counted as sent)
            got = asyncio.ensure_future(b.recv(0, (1, 2, 5), 10))  # (a message that fits still goes)
            await a.send(1, (1, 2, 5), np.arange(4, dtype=np.float32))
            assert a.stats()["sent_arrays"] == 1 and a.stats()["sent_tcp_bytes"] == 16
            return waited, np.array(await got).tolist()
        finally:
            if sock is not None:
                sock.close()
            a.close()
            b.close()

    waited, got = asyncio.run(go())
    assert waited < 10 and got == [0, 1, 2, 3]


def test_an_encrypted_frame_of_exactly_the_receivers_max_message_arrives():
    """CURVE makes a frame 33 bytes longer on the wire, and ZeroMQ checks MAXMSGSIZE there: a 1 MiB activation to a
    peer whose --max-message-mb is 1 passed the sender's check and was dropped unseen (a review). The routers allow
    the encryption's margin beyond the limit they announce."""
    import asyncio
    import tempfile

    from transport.auth import KeyPair
    from transport.p2p.plane import DataPlane

    async def go():
        a = DataPlane(0, ipc_dir=tempfile.mkdtemp(), keys=KeyPair.generate())
        b = DataPlane(1, ipc_dir=tempfile.mkdtemp(), keys=KeyPair.generate(), max_message_bytes=1 << 20)
        try:
            await a.start()
            await b.start()
            ea, eb = a.endpoint(), b.endpoint()
            await a.connect({1: {"address": eb["tcp"], "route": "tcp", "key": eb["key"], "max_message": 1 << 20}})
            await b.connect({0: {"address": ea["tcp"], "route": "tcp", "key": ea["key"]}})
            x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB exactly
            got = asyncio.ensure_future(b.recv(0, (1, 2, 3), 20))
            await a.send(1, (1, 2, 3), x)
            return np.array_equal(np.array(await got), x)
        finally:
            a.close()
            b.close()

    assert asyncio.run(go())
