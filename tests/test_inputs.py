"""Step arguments from the host: only to the actors that read them, large ones through shared memory on a
local mesh (mpmd.runtime.inputs, actors/inputs.py), and hostile shared-memory notices refused."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from mpmd.errors import MpmdError, PipelineError
from mpmd.runtime import inputs as inputs_module
from mpmd.runtime.inputs import SHM_INPUT_MIN_BYTES, input_stager
from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch
from tests.wire import wait_until
from transport.p2p import shm


def _stats(mesh, a):
    return mesh.actor(a).stats()


def test_host_batch_goes_by_shared_memory_to_the_actors_that_read_it_and_steps_equal_jax_jit(mesh2):
    rng = np.random.default_rng(0)
    width, m, rows = 128, 4, 64  # each batch leaf is 4 * 64 * 128 * 4 bytes = 128 KiB: over the shm threshold
    params = mlp_params(rng, num_stages=2, width=width)
    opt = optax.sgd(1e-2)
    dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    batches = [regression_batch(rng, m, rows, width) for _ in range(5)]
    assert batches[0]["x"].nbytes >= SHM_INPUT_MIN_BYTES

    report = dist.placement(params, opt.init(params), batches[0])
    assert report.arguments["args[2]['x']"] == [0]  # inputs to the first stage only, labels to the last only
    assert report.arguments["args[2]['y']"] == [1]

    p_d, s_d, first = dist(params, opt.init(params), batches[0])  # then parameters and state live on the actors
    before = [_stats(mesh2, a) for a in range(2)]
    p_r, s_r = params, opt.init(params)
    outs = [first]
    for b in batches[1:]:  # dispatched back to back: step k+1's batch is written while step k runs
        p_d, s_d, loss_d = dist(p_d, s_d, b)
        outs.append(loss_d)
    want = []
    for b in batches:
        p_r, s_r, loss_r = ref(p_r, s_r, b)
        want.append(loss_r)
    for got, w in zip(outs, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-5, atol=1e-6)
    for got, w in zip(jax.tree.leaves(mpmd.fetch(p_d)), jax.tree.leaves(p_r)):
        np.testing.assert_allclose(got, np.asarray(w), rtol=1e-5, atol=1e-6)
    after = [_stats(mesh2, a) for a in range(2)]
    stager = input_stager(mesh2)
    sent = [after[a]["shm_inputs"] - before[a]["shm_inputs"] for a in range(2)]
    # One leaf per actor per step: four steps dispatched ahead each have a segment (none went inline).
    assert stager.fallbacks == 0
    assert sent[0] == sent[1] == len(batches) - 1
    for a in range(2):
        assert after[a]["shm_input_bytes"] - before[a]["shm_input_bytes"] == sent[a] * batches[0]["x"].nbytes
    assert len(stager._pools[0]) <= stager.max_segments


def test_input_pool_grows_for_steps_dispatched_ahead_up_to_its_count_and_bytes():
    """The segment pool of one actor (no mesh needed: `_acquire` only makes segments): up to `max_segments`
    busy at once while they fit in `pool_bytes`, always at least MIN_SEGMENTS, then None (that step goes inline)."""
    if not shm.available():
        pytest.skip("no POSIX shared memory here")
    from mpmd.runtime import inputs

    class Owner:  # the stager only keeps a weak reference to its mesh
        pass

    owner = Owner()
    st = inputs.InputStager(owner, max_segments=5, pool_bytes=1 << 40)
    try:
        got = [st._acquire(0, 1 << 16) for _ in range(6)]
        assert all(g is not None for g in got[:5]) and got[5] is None
        got[2].busy = False  # a reply came: its segment is written again, no new one is made
        assert st._acquire(0, 1 << 16) is got[2] and len(st._pools[0]) == 5
    finally:
        st.close()
    size = shm.size_class(1 << 20)
    st = inputs.InputStager(owner, max_segments=8, pool_bytes=4 * size)
    try:
        got = [st._acquire(1, 1 << 20) for _ in range(6)]
        assert [g is not None for g in got] == [True] * 4 + [False] * 2  # the byte budget stops it at 4 of 8
        for g in got[:4]:
            g.busy = False
        big = st._acquire(1, 2 << 20)  # a bigger batch: free segments are closed (and retired) to make room
        assert big is not None and sum(s.size for s in st._pools[1]) <= 4 * size
        assert len(st._retired[1]) == 2 and big.name not in st._retired[1]
    finally:
        st.close()
    st = inputs.InputStager(owner, max_segments=4, pool_bytes=4 * size)
    try:  # no room even with the free segment closed (three big ones busy): None, and the free one is kept
        got = [st._acquire(4, 1 << 20) for _ in range(3)] + [st._acquire(4, 1 << 16)]
        got[3].busy = False
        assert st._acquire(4, 2 << 20) is None and got[3] in st._pools[4] and not st._retired.get(4)
    finally:
        st.close()
    st = inputs.InputStager(owner, max_segments=3, pool_bytes=1 << 40)
    try:  # full by count: a bigger batch replaces a free segment, the pool stays at 3
        got = [st._acquire(3, 1 << 16) for _ in range(3)]
        got[0].busy = False
        assert st._acquire(3, 1 << 20) is not None and len(st._pools[3]) == 3 and st._retired[3] == [got[0].name]
    finally:
        st.close()
    st = inputs.InputStager(owner, max_segments=8, pool_bytes=size)
    try:  # a budget smaller than MIN_SEGMENTS segments still gets MIN_SEGMENTS: running, queued, being written
        got = [st._acquire(2, 1 << 20) for _ in range(inputs.MIN_SEGMENTS + 1)]
        assert [g is not None for g in got] == [True] * inputs.MIN_SEGMENTS + [False]
    finally:
        st.close()


def _tiny(mesh, width=128, m=4, rows=64):
    rng = np.random.default_rng(3)
    params = mlp_params(rng, num_stages=2, width=width)
    opt = optax.sgd(1e-2)
    dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    return dist, ref, params, opt.init(params), regression_batch(rng, m, rows, width)


def test_small_host_arguments_still_go_inline(mesh2):
    dist, ref, params, state, batch = _tiny(mesh2, width=8, m=2, rows=4)
    before = [_stats(mesh2, a)["shm_inputs"] for a in range(2)]
    np.testing.assert_allclose(np.asarray(dist(params, state, batch)[2]), np.asarray(ref(params, state, batch)[2]), rtol=1e-5)
    assert [_stats(mesh2, a)["shm_inputs"] for a in range(2)] == before


def test_a_big_put_to_a_local_actor_goes_by_shared_memory_and_owns_its_copy(mesh2):
    """`actor.put` of a big array went over the encrypted control socket (a 1 GiB put took 7-13 s here and held
    the connection); on a local actor it is written into an input segment and copied out there. The actor's copy
    is its own: the segment is written again by the next put, and each array keeps its values. Puts one after
    another reuse one segment (a fresh 64 MiB one costs ~42 ms of tmpfs pages): one mapping more there, no name
    left in /dev/shm. Small puts, and a put on the controller's own loop, stay inline."""
    a = mesh2.actor(1)
    before, maps = _stats(mesh2, 1)["shm_inputs"], _stats(mesh2, 1)["shm_input_maps"]
    reused = len(input_stager(mesh2).puts.pools.get(1, []))  # (earlier tests' puts on this mesh may have made one)
    # (and one of theirs may have been dropped since, idle, by another actor's put: the first put here tells actor 1
    # to unmap it — one mapping fewer there; the whole suite on one shared mesh met this, 5 == 6)
    retired = len(input_stager(mesh2).puts.told.get(1, []))
    big = [np.full((SHM_INPUT_MIN_BYTES // 4 * 3,), float(k), np.float32) for k in range(12)]  # more puts than segments
    xs = [a.put(v) for v in big]
    small = a.put(np.arange(4, dtype=np.int32))
    assert _stats(mesh2, 1)["shm_inputs"] - before == len(big)
    # one segment for them all (made now, or an earlier one reused), kept mapped there, its name gone from /dev/shm
    made = len(input_stager(mesh2).puts.pools[1]) - reused
    assert made in (0, 1) and max(reused, 1) == len(input_stager(mesh2).puts.pools[1])
    assert _stats(mesh2, 1)["shm_input_maps"] == maps + made - retired and not input_stager(mesh2).puts.told.get(1)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(input_stager(mesh2).prefix(1)[1:])]
    for x, v in zip(xs, big):
        np.testing.assert_array_equal(x.to_numpy(), v)
    np.testing.assert_array_equal(small.to_numpy(), np.arange(4, dtype=np.int32))
    y = a.run(jax.jit(lambda u, w: u + w), xs[3], xs[5])
    np.testing.assert_array_equal(y.to_numpy(), big[3] + big[5])
    bogus = {"name": "/dev-shm-of-someone-else", "offset": 0, "nbytes": 4, "dtype": "float32", "shape": [1]}
    with pytest.raises(mpmd.RemoteError, match=r"shared-memory input '/dev-shm-of-someone-else' refused"):
        mesh2.run(mesh2.conn(1).request("put", {"buf": mesh2.new_buffer_id(), "shm": bogus}))
    key = a.put(jax.random.split(jax.random.key(0), 20000))  # (a typed key array: its key data go the same way)
    assert jnp.array_equal(jax.random.key_data(mpmd.fetch(key)), jax.random.key_data(jax.random.split(jax.random.key(0), 20000)))


def _run(mesh, actor, pid, n_inputs, n_outputs, notice):
    outputs = [mesh.new_buffer_id() for _ in range(n_outputs)]
    fields = {"program": pid, "step": 10_000, "inputs": [-2] * n_inputs, "outputs": outputs, "prologue": [],
              "shm_inputs": [notice] * n_inputs}
    return mesh.run(mesh.conn(actor).request("run_program", fields))


def test_hostile_shm_input_notices_are_refused_and_the_daemon_survives(mesh2):
    dist, ref, params, state, batch = _tiny(mesh2)
    np.testing.assert_allclose(np.asarray(dist(params, state, batch)[2]), np.asarray(ref(params, state, batch)[2]), rtol=1e-5)
    compiled = dist.compile(params, state, batch)
    actor = 0
    prog = compiled.plan.programs[actor]
    pid, n_inputs, n_outputs = compiled.program_ids[actor], len(prog.inputs), len(prog.outputs)
    prefix = input_stager(mesh2).prefix(actor)  # announced to actor 0 by the call above
    own = f"{prefix}{10**9}"  # a segment named as this session's inputs are, made here to point notices at
    mm, ino = shm.create_segment(own, 1 << 16)
    good = {"offset": 0, "nbytes": 128 * 256 * 4, "dtype": "float32", "shape": [128, 256], "ino": ino}
    try:
        cases = [
            # (first: once mapped, a segment is not opened again) a file other than the one the notice's maker made
            # — another process of the user put its own under the name — or no inode at all
            ({**good, "name": own, "ino": ino + 1}, "is not the file the controller made"),
            ({**{k: v for k, v in good.items() if k != "ino"}, "name": own}, "ino must be a non-negative int"),
            ({**good, "name": "/mpmd-in-1-2-0-7"}, "not .* the prefix"),  # another controller's segment
            ({**good, "name": "/psm_foreign"}, "not .* the prefix"),
            ({**good, "name": f"{prefix}../x"}, "not .* the prefix"),
            ({**good, "name": own, "nbytes": 12}, "bytes but the notice says"),  # wrong size for dtype and shape
            ({**good, "name": own, "nbytes": 4, "shape": [1], "offset": 1 << 20}, "outside the segment"),
            ({**good, "name": own}, "outside the segment"),  # 128 KiB announced, the segment holds 64 KiB
            ({**good, "name": own, "offset": 3}, "multiple of 64"),
            ({**good, "name": own, "retire": ["/mpmd-in-1-2-0-7"]}, "'retire' must list"),  # not this session's
            ({**good, "name": own, "retire": [own]}, "'retire' must list"),  # the segment being read
            ({**good, "name": own, "retire": "x"}, "'retire' must list"),
            ({**good, "name": own, "dtype": "object"}, "unknown dtype"),
            ({**good, "name": own, "shape": [-1]}, "non-negative"),
            ({**good, "name": own, "shape": [1] * 70, "nbytes": 4}, "more than 32 dimensions"),  # (numpy's bare error: a probe)
            ("not a map", "must be a map"),
        ]
        for notice, why in cases:
            with pytest.raises(MpmdError, match=why):
                _run(mesh2, actor, pid, n_inputs, n_outputs, notice)
        with pytest.raises(MpmdError, match="cannot change"):
            mesh2.run(mesh2.conn(actor).request("input_shm", {"prefix": "/mpmd-in-1-2-0-"}))
        with pytest.raises(MpmdError, match="must look like"):
            mesh2.run(mesh2.conn(actor).request("input_shm", {"prefix": "/dev/shm/../etc"}))
        with pytest.raises(MpmdError, match="one notice per input"):
            mesh2.run(mesh2.conn(actor).request("run_program", {"program": pid, "step": 10_001, "inputs": [-2] * n_inputs,
                                                                "outputs": [mesh2.new_buffer_id() for _ in range(n_outputs)],
                                                                "prologue": []}))
    finally:
        mm.close()
        shm.unlink(own)
    assert mesh2.actor(actor).ping() is not None  # the daemon is up and still runs steps
    np.testing.assert_allclose(np.asarray(dist(params, state, batch)[2]), np.asarray(ref(params, state, batch)[2]), rtol=1e-5)


def test_actors_load_their_own_batch_leaves_with_a_named_loader_and_steps_equal_jax_jit():
    from mpmd.testing import LOADED_LEAF_SHAPE, synthetic_regression_leaf

    m, rows, width = LOADED_LEAF_SHAPE
    rng = np.random.default_rng(5)
    params = mlp_params(rng, num_stages=2, width=width)
    opt = optax.sgd(1e-2)
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    spec = {"x": jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32), "y": jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32)}
    with mpmd.RemoteMesh.local(2, loaders=["mpmd.testing:synthetic_regression_leaf"]) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        batch = mpmd.loaded_by_actors("mpmd.testing:synthetic_regression_leaf", spec)
        p_d, s_d = params, opt.init(params)
        p_r, s_r = params, opt.init(params)
        losses = []
        for k in range(3):
            p_d, s_d, loss = dist(p_d, s_d, batch)  # call k: each actor loads step k's leaves it reads
            losses.append(loss)
            host = {leaf: synthetic_regression_leaf(k, leaf) for leaf in ("x", "y")}
            p_r, s_r, want = ref(p_r, s_r, host)
            np.testing.assert_allclose(np.asarray(losses[-1]), np.asarray(want), rtol=1e-5, atol=1e-6)
        for got, w in zip(jax.tree.leaves(mpmd.fetch(p_d)), jax.tree.leaves(p_r)):
            np.testing.assert_allclose(got, np.asarray(w), rtol=1e-5, atol=1e-6)
        assert [mesh.actor(a).stats()["loader_calls"] for a in range(2)] == [3, 3]  # x on actor 0, y on actor 1 only

        # A loader the daemons were not told to allow is refused, and they keep running.
        other = mpmd.loaded_by_actors("os:getcwd", spec)
        with pytest.raises(MpmdError, match="not allowed"):
            jax.block_until_ready(dist(p_d, s_d, other)[2])
        wrong = mpmd.loaded_by_actors("mpmd.testing:synthetic_regression_leaf",
                                      {"x": jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.int32), "y": spec["y"]})
        with pytest.raises(MpmdError, match="returned <f4 float32.*traced with int32"):
            np.asarray(mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)(
                params, opt.init(params), wrong)[2])
        np.asarray(dist(p_d, s_d, batch)[2])


def _loaded_setup(seed):
    """Parameters, optimizer, the jax.jit reference step and the loaded leaves' specs of the loader tests."""
    from mpmd.testing import LOADED_LEAF_SHAPE

    params = mlp_params(np.random.default_rng(seed), num_stages=2, width=LOADED_LEAF_SHAPE[2])
    opt = optax.sgd(1e-2)
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    return params, opt, ref, {leaf: jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32) for leaf in ("x", "y")}


def test_a_loop_switching_between_a_step_and_its_with_schedule_twin_loads_each_step_once():
    """Both steps made up front, the loop switching A, A, B, B, A, A: the twin had a copy of the count, so its calls
    loaded steps 0 and 1 again and A came back at 2 — batches trained twice, others never, silently (a probe). One
    count for both; tune's and profile_costs' measuring steps keep counts of their own."""
    from mpmd.testing import synthetic_regression_leaf

    fn = "mpmd.testing:synthetic_regression_leaf"
    params, opt, ref, spec = _loaded_setup(7)
    batch = mpmd.loaded_by_actors(fn, spec)

    def loss_of(k):
        return np.asarray(ref(params, opt.init(params), {leaf: synthetic_regression_leaf(k, leaf) for leaf in ("x", "y")})[2])

    with mpmd.RemoteMesh.local(2, loaders=[fn]) as mesh:
        a = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        b = a.with_schedule(mpmd.GPipe(2))
        for k, step in enumerate((a, a, b, b, a, a)):
            assert step.next_load_step == k
            np.testing.assert_allclose(np.asarray(step(params, opt.init(params), batch)[2]), loss_of(k), rtol=1e-5, atol=1e-6)
        b.next_load_step = 9  # (set on either: both go on from there)
        assert a.next_load_step == 9
        a._variant(mpmd.GPipe(2))(params, opt.init(params), batch)  # (a measuring step's call moves neither on)
        assert (a.next_load_step, b.next_load_step) == (9, 9)


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_the_step_a_call_loads_counts_dispatched_calls_and_can_be_set_and_carries_to_another_schedule():
    """A call refused before it was sent (a deleted argument) used up its step number: the next call loaded step
    2's data, step 1's was never trained on; with_schedule (and so tune's winner) started again at 0; a resumed run
    could not start at its step (a probe). And a step returning a loaded leaf unchanged handed back its
    descriptor, not data: it is refused, saying why."""
    from mpmd.testing import synthetic_regression_leaf

    fn = "mpmd.testing:synthetic_regression_leaf"
    params, opt, ref, spec = _loaded_setup(6)
    batch = mpmd.loaded_by_actors(fn, spec)

    def loss_of(k):  # the loss of one step from `params` on step k's data
        return np.asarray(ref(params, opt.init(params), {leaf: synthetic_regression_leaf(k, leaf) for leaf in ("x", "y")})[2])

    with mpmd.RemoteMesh.local(2, loaders=[fn]) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        run = lambda step: np.asarray(step(params, opt.init(params), batch)[2])  # noqa: E731
        np.testing.assert_allclose(run(dist), loss_of(0), rtol=1e-5, atol=1e-6)
        gone = mesh.actor(0).put(np.asarray(params[0][0]))
        gone.delete()
        with pytest.raises(MpmdError, match="deleted"):
            dist([[gone], params[1]], opt.init(params), batch)
        np.testing.assert_allclose(run(dist), loss_of(1), rtol=1e-5, atol=1e-6)
        assert dist.next_load_step == 2
        dist.next_load_step = 5  # (resuming a run at its step 5)
        np.testing.assert_allclose(run(dist), loss_of(5), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(run(dist.with_schedule(mpmd.GPipe(2))), loss_of(6), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="next_load_step"):
            dist.next_load_step = -1

        def returns_y(p, b):
            def mb_grads(mb):
                return jax.value_and_grad(lambda q: jnp.mean((mlp(q, mb["x"]) - mb["y"]) ** 2))(p)[::-1]

            _, losses = mpmd.accumulate_grads(mb_grads, b, schedule=mpmd.OneFOneB(2))
            return losses, b["y"]

        def hands_y_to_a_callback(p, b):  # (the callback got the descriptor, as a 0-d object array: a review)
            jax.debug.callback(lambda y: None, b["y"])
            return returns_y(p, b)[0]

        for step in (returns_y, hands_y_to_a_callback):
            with pytest.raises(PipelineError, match=r"returns its argument .*\['y'\] as it is, or hands it to a host callback"):
                mpmd.distributed(step, mesh=mesh)(params, {k: v for k, v in batch.items()})
        assert dist.next_load_step == 7  # (the call on another schedule counted on this step's count: one count)


def _big_endian_loader(step, leaf):
    return np.arange(6, dtype=">f4").reshape(2, 3)


def _float64_loader(step, leaf):
    return np.arange(6, dtype=np.float64).reshape(2, 3)  # numpy's default (and jax.random's on a daemon: x64 is on)


def test_a_loader_array_in_the_other_byte_order_or_64_bits_is_taken_as_jax_jit_takes_it():
    """A big-endian .npy was refused, "returned float32[1, 4, 8]; the step was traced with float32[1, 4, 8]"; a float64
    array (a loader using jax.random on the daemon, where x64 is on) was refused where jax.jit takes it as float32;
    and a float64 spec with x64 off named float64 to the daemon while the step ran float32 (a probe)."""
    from actors.loader import Loaders

    loaders = Loaders(["tests.test_inputs:_big_endian_loader", "tests.test_inputs:_float64_loader"])
    for fn in ("tests.test_inputs:_big_endian_loader", "tests.test_inputs:_float64_loader"):
        got = loaders.load(*loaders.check({"fn": fn, "name": "x", "shape": [2, 3], "dtype": "float32"}), 0)
        assert got.dtype == np.dtype(np.float32) and got.dtype.isnative
        np.testing.assert_array_equal(got, np.arange(6).reshape(2, 3))
    with pytest.raises(RuntimeError, match=r"returned >f4 float32\[2, 3\]; the step was traced with int32"):
        loaders.load(*loaders.check({"fn": "tests.test_inputs:_big_endian_loader", "name": "x", "shape": [2, 3], "dtype": "int32"}), 0)
    leaf = mpmd.loaded_by_actors("tests.test_inputs:_float64_loader", np.zeros((2, 3)))
    assert leaf.dtype == (np.dtype(np.float64) if jax.config.jax_enable_x64 else np.dtype(np.float32))


def _loader_that_exits(step, name):
    raise SystemExit(f"no data for step {step}")  # a user's "end of data"


def test_a_loader_raising_system_exit_fails_its_leaf_not_the_daemon():
    """`Loaders.load` runs in a worker thread of the daemon; a SystemExit it let through re-raised in the event
    loop's task and took the daemon down (found by a probe). It must fail the step, naming the loader."""
    from actors.loader import Loaders
    from actors.request import RequestError

    loaders = Loaders(["tests.test_inputs:_loader_that_exits"])
    fn, name, dtype, shape = loaders.check({"fn": "tests.test_inputs:_loader_that_exits", "name": "x", "shape": [2], "dtype": "float32"})
    with pytest.raises(RuntimeError, match=r"_loader_that_exits\(3, 'x'\) failed: SystemExit: no data for step 3"):
        loaders.load(fn, name, dtype, shape, 3)
    # The step a loads entry names is checked with the rest, before any loader of the request runs (a probe).
    for bad in (-1, True, 1.5, "3", None, [1]):
        with pytest.raises(RequestError, match="the step to load must be an int >= 0"):
            loaders.check({"fn": "tests.test_inputs:_loader_that_exits", "name": "x", "shape": [2], "dtype": "float32", "step": bad})


_GATE = threading.Event()


def _loader_that_waits(step, leaf):
    _GATE.wait(30)
    return np.zeros(2, np.float32)


def test_a_step_timed_out_on_a_blocked_loader_names_the_loader_call_it_waits_for():
    """A loader that blocked made the step time out with "program 1 step 0 was still running", as if the step's
    own program hung (found by a probe): the request's timeout message now names the loader calls still running."""
    from actors.daemon import _waiting_on
    from actors.loader import Loaders
    from transport.protocol import Message

    loaders = Loaders(["tests.test_inputs:_loader_that_waits"])
    fn, name, dtype, shape = loaders.check({"fn": "tests.test_inputs:_loader_that_waits", "name": "x", "shape": [2], "dtype": "float32"})
    assert loaders.still_running() is None
    _GATE.clear()
    worker = threading.Thread(target=loaders.load, args=(fn, name, dtype, shape, 7, 5))  # (for session 5)
    worker.start()
    try:
        assert wait_until(lambda: loaders.still_running(5) is not None, 10)
        assert loaders.still_running(6) is None  # another session's step is not told of it
        msg = Message({"op": "run_program", "id": 1, "program": 3, "step": 7}, [])
        said = _waiting_on(msg, loaders.still_running(5))
        assert "program 3 step 7 was waiting for its data loader: tests.test_inputs:_loader_that_waits(7, 'x')" in said
        assert "program 3 step 7 was still running" in _waiting_on(msg, None)
    finally:
        _GATE.set()
        worker.join(30)
    assert loaders.still_running(5) is None


def _labels_that_hang(step, leaf):
    """Loads like `synthetic_regression_leaf`, but the labels (read by the last stage, actor 1) never come in time."""
    from mpmd.testing import synthetic_regression_leaf

    if leaf.endswith("y"):
        time.sleep(60)
    return synthetic_regression_leaf(step, leaf)


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_loader_that_hangs_on_the_last_actor_is_named_not_the_first_actor_left_waiting_for_it():
    """The labels' loader hung on actor 1: the step failed with actor 0's "waited 3 s for xfer from actor 1 and
    nothing came" (or its request timeout), naming no loader — only a loader hung on the actor whose error came
    first was named (a probe). The aborted actor says what it was waiting for, and that is the step's error."""
    from mpmd.testing import LOADED_LEAF_SHAPE, synthetic_regression_leaf

    fn = "tests.test_inputs:_labels_that_hang"
    rng = np.random.default_rng(7)
    params = mlp_params(rng, num_stages=2, width=LOADED_LEAF_SHAPE[2])
    opt = optax.sgd(1e-2)
    spec = {leaf: jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32) for leaf in ("x", "y")}
    with mpmd.RemoteMesh.local(2, loaders=[fn], transfer_timeout=3) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        with pytest.raises(MpmdError, match=r"on actor 1.*was waiting for its data loader: "
                                            r"tests.test_inputs:_labels_that_hang\(0, '(batch\.)?y'\)"):
            dist(params, opt.init(params), mpmd.loaded_by_actors(fn, spec))[2].block_until_ready()
        # the mesh goes on: the same step with the batch from the host equals jax.jit
        batch = {leaf: synthetic_regression_leaf(0, leaf) for leaf in ("x", "y")}
        want = jax.jit(make_train_step(mse_loss(mlp), opt, None))(params, opt.init(params), batch)[2]
        np.testing.assert_allclose(np.asarray(dist(params, opt.init(params), batch)[2]), np.asarray(want), rtol=1e-5, atol=1e-6)


def _slow_leaves(step, leaf):
    """Loads like `synthetic_regression_leaf`, taking 0.6 s per call."""
    from mpmd.testing import synthetic_regression_leaf

    time.sleep(0.6)
    return synthetic_regression_leaf(step, leaf)


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_steps_dispatched_ahead_behind_a_slow_loader_are_not_timed_out_for_the_time_they_queued():
    """The daemon's --request-timeout ran from a request's arrival: steps dispatched at once behind a loader of 0.6 s
    a call, with a bound of 2 s, failed from the fourth on as "held by loader" (naming the next step's call, which
    had just started), and a fetch of the last loss timed out (a probe; so did 45 steps of 0.19 s with a bound of 4
    s). A request's time now counts once the steps dispatched before it ended, on the daemon and in the controller's
    watchdog (16 steps outlast bound + heartbeat_timeout: the actor was declared lost; a review); each equals jax.jit."""
    from mpmd.testing import LOADED_LEAF_SHAPE, synthetic_regression_leaf

    fn = "tests.test_inputs:_slow_leaves"
    params = mlp_params(np.random.default_rng(8), num_stages=2, width=LOADED_LEAF_SHAPE[2])
    opt = optax.sgd(1e-2)
    spec = {leaf: jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32) for leaf in ("x", "y")}
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    with mpmd.RemoteMesh.local(2, loaders=[fn], request_timeout=2, heartbeat_timeout=4) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        p, s = params, opt.init(params)
        losses = []
        for _ in range(16):
            p, s, loss = dist(p, s, mpmd.loaded_by_actors(fn, spec))
            losses.append(loss)
        got = [np.asarray(x) for x in losses]
        p_r, s_r = params, opt.init(params)
        for k in range(16):
            p_r, s_r, want = ref(p_r, s_r, {leaf: synthetic_regression_leaf(k, leaf) for leaf in ("x", "y")})
            np.testing.assert_allclose(got[k], np.asarray(want), rtol=1e-5, atol=1e-6)


def _labels_that_fail_in_words_of_an_echo(step, leaf):
    """Loads like `synthetic_regression_leaf`, but the labels' loader (actor 1) fails with a message that reads
    like another actor's echo."""
    from mpmd.testing import synthetic_regression_leaf

    if leaf.endswith("y"):
        raise OSError("the label shard was aborted upstream and nothing came; did not finish within 5 s")
    return synthetic_regression_leaf(step, leaf)


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_the_step_error_is_the_failing_actors_own_even_when_its_words_read_like_an_echo():
    """The step's error was chosen among the actors' errors by their text ("aborted", "nothing came", "did not
    finish within" meant an echo of another actor's trouble), so a user's own error that used those words lost to
    actor 0's abort. Each actor's error now has a name on the wire saying what it is (StepAborted, NothingCame,
    WaitedInVain, HeldByLoader), and the step raises the cause by that name."""
    from mpmd.testing import LOADED_LEAF_SHAPE

    fn = "tests.test_inputs:_labels_that_fail_in_words_of_an_echo"
    params = mlp_params(np.random.default_rng(7), num_stages=2, width=LOADED_LEAF_SHAPE[2])
    opt = optax.sgd(1e-2)
    spec = {leaf: jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32) for leaf in ("x", "y")}
    with mpmd.RemoteMesh.local(2, loaders=[fn], transfer_timeout=3) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        with pytest.raises(mpmd.RemoteError) as e:
            dist(params, opt.init(params), mpmd.loaded_by_actors(fn, spec))[2].block_until_ready()
        assert e.value.actor_id == 1 and "the label shard was aborted upstream" in str(e.value), str(e.value)


_HUNG = threading.Event()


def _loader_that_hangs(step, leaf):
    _HUNG.wait(60)
    return np.zeros(2, np.float32)


def _loader_that_answers(step, leaf):
    return np.full(2, step, np.float32)


_SLOW_CALLS: list[tuple[str, int, float]] = []
_SLOW_GO = threading.Event()


def _loader_not_thread_safe(step, leaf):
    _SLOW_CALLS.append(("start", step, time.monotonic()))
    if step == 0:
        _SLOW_GO.wait(30)  # (the call whose step is aborted while it runs)
    _SLOW_CALLS.append(("end", step, time.monotonic()))
    return np.full(2, step, np.float32)


def test_a_load_whose_step_is_aborted_mid_call_is_waited_for_before_the_next_call():
    """A recovery aborts a survivor's steps; one whose loader call was running ended, and the session's queue went
    on at once: the replay's calls ran beside the abandoned one, and a loader that is not thread-safe (as the README
    allows) failed the replayed step (a probe). The queue now waits for the abandoned call to return first."""
    from actors.loader import Loaders, queue

    slow = "tests.test_inputs:_loader_not_thread_safe"
    loaders = Loaders([slow])
    spec = {"fn": slow, "name": "x", "shape": [2], "dtype": "float32"}
    _SLOW_CALLS.clear()
    _SLOW_GO.clear()

    async def scenario():
        (first,), end_first = queue(loaders, [spec], [0], [lambda a: a], "session")
        while not _SLOW_CALLS:
            await asyncio.sleep(0.01)
        end_first()  # (its step aborted while the call runs)
        (replayed,), end_replayed = queue(loaders, [spec], [1], [lambda a: a], "session")
        await asyncio.sleep(0.3)
        assert [c[:2] for c in _SLOW_CALLS] == [("start", 0)]  # (not begun beside the running call)
        _SLOW_GO.set()
        np.testing.assert_array_equal(await asyncio.wait_for(replayed, 10), np.full(2, 1, np.float32))
        end_replayed()

    try:
        asyncio.run(scenario())
    finally:
        _SLOW_GO.set()
    assert [c[:2] for c in _SLOW_CALLS] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]


def test_hung_loaders_keep_their_own_threads_and_leave_fetches_checkpoints_and_other_loaders_working():
    """Loader calls ran on the event loop's shared worker threads (asyncio.to_thread), which fetches and
    checkpoint saves and restores use too: a few loaders that never returned held every worker, and every
    later save, restore and loaded step on that daemon timed out (found by a probe). Each call now has a thread
    of its own; past MAX_RUNNING unfinished calls a load is refused, naming them."""
    from actors import loader as loader_module
    from actors.loader import Loaders
    from actors.request import RequestError

    hangs, answers = "tests.test_inputs:_loader_that_hangs", "tests.test_inputs:_loader_that_answers"
    loaders = Loaders([hangs, answers])
    spec = {"name": "x", "shape": [2], "dtype": "float32"}

    async def scenario():
        hung = [loaders.start({**spec, "fn": hangs}, k, lambda a: a) for k in range(40)]  # more than any default pool
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 10) == 7  # what fetches and saves run on
        got = await asyncio.wait_for(loaders.start({**spec, "fn": answers}, 3, lambda a: a), 10)
        np.testing.assert_array_equal(got, np.full(2, 3, np.float32))
        assert not any(f.done() for f in hung)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader_module, "MAX_RUNNING", 40)
            with pytest.raises(RequestError, match=r"40 loader calls on this actor have not returned \(.*_loader_that_hangs"):
                loaders.start({**spec, "fn": answers}, 4, lambda a: a)
        _HUNG.set()
        assert [float(a[0]) for a in await asyncio.wait_for(asyncio.gather(*hung), 30)] == [0.0] * 40

    _HUNG.clear()
    try:
        asyncio.run(scenario())
    finally:
        _HUNG.set()
    assert loaders.still_running(any_session=True) is None


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_hand_started_daemon_imports_its_loaders_at_start_from_its_working_directory(tmp_path):
    """The `mpmd-actor` script did not search its working directory (`python -m actors.daemon`, what local meshes
    start, does), and a loader it could not import failed the first step after dispatch (a probe). Loaders are
    imported at start now, the working directory searched: a missing one stops the daemon at once, naming
    PYTHONPATH."""
    (tmp_path / "my_loader_mod.py").write_text("import numpy as np\n\ndef load(step, leaf):\n    return np.zeros(2, np.float32)\n")
    exe = os.path.join(os.path.dirname(sys.executable), "mpmd-actor")
    flags = [exe, "--listen", "tcp://127.0.0.1:0", "--insecure", "--p2p", "none", "--cpu-devices", "1", "--parent-pid", str(os.getpid())]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)
    ok = subprocess.Popen([*flags, "--allow-loader", "my_loader_mod:load"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        line = ok.stdout.readline()
        assert line.startswith("MPMD_ACTOR_READY"), ok.stderr.read()[-2000:] if ok.poll() is not None else line
    finally:
        ok.terminate()
        ok.wait(10)
    bad = subprocess.run([*flags, "--allow-loader", "no_such_module_here:load"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert bad.returncode == 1 and "--allow-loader no_such_module_here:load: cannot import it here" in bad.stderr
    assert "PYTHONPATH" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    typo = subprocess.run([*flags, "--allow-loader", "my_loader_mod:laod"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)  # (it said "cannot import it": a probe)
    assert typo.returncode == 1 and "module my_loader_mod" in typo.stderr and "imported, but has no 'laod'" in typo.stderr, typo.stderr


def test_a_loader_name_must_be_module_colon_function():
    with pytest.raises(ValueError, match="module:function"):
        mpmd.loaded_by_actors("not a name; rm -rf", {"x": np.zeros(3)})
    # The script's own function: in an actor, __main__ is the daemon ("module __main__ (.../actors/daemon.py) imported,
    # but has no 'load'", or the daemon's own `main` taken as the loader: a probe)
    for refused in (lambda: mpmd.loaded_by_actors("__main__:load", {"x": np.zeros(3)}),
                    lambda: mpmd.RemoteMesh.local(2, loaders=["__main__:load"])):
        with pytest.raises(ValueError, match=r"'__main__:load'.*a module the actors can import"):
            refused()
    by_hand = subprocess.run([sys.executable, "-m", "actors.daemon", "--allow-loader", "__main__:main"], capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert by_hand.returncode == 2 and "__main__ is the daemon itself" in by_hand.stderr, by_hand.stderr


_CHATTY_MODULE = """
import os
import numpy as np
import mpmd

depth = int(os.environ.get("CHATTY_TEST_DEPTH", "0"))
os.environ["CHATTY_TEST_DEPTH"] = str(depth + 1)
if depth >= 2:  # (the test's own guard: before the fix, each actor started two more)
    raise ImportError("depth guard of the test")


def load(step, leaf):
    return np.zeros((2, 2), np.float32)


mpmd.RemoteMesh.local(2, loaders=["chatty_unguarded:load"]).close()
"""


def test_a_loader_module_that_starts_a_mesh_when_imported_is_refused_in_the_actor_not_started_again(tmp_path, monkeypatch):
    """A script naming itself as the loader module, with no `if __name__ == "__main__":` guard: each actor imported
    it and started two actors of its own, without end (a probe). The actor's import is refused, saying why."""
    (tmp_path / "chatty_unguarded.py").write_text(_CHATTY_MODULE)
    monkeypatch.chdir(tmp_path)  # (the daemons search their working directory)
    monkeypatch.delenv("CHATTY_TEST_DEPTH", raising=False)
    with pytest.raises(mpmd.ActorStartError, match="starts a mesh when imported.*__name__ == '__main__'"):
        mpmd.RemoteMesh.local(2, loaders=["chatty_unguarded:load"])


def _printing_leaves(step, leaf):
    """Loads like `synthetic_regression_leaf`, printing 40 KB each call."""
    from mpmd.testing import synthetic_regression_leaf

    print(f"loading step {step} {leaf} " + "." * 40_000, flush=True)
    return synthetic_regression_leaf(step, leaf)


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_loader_that_prints_goes_on_past_a_pipes_worth_of_output():
    """The daemon's stdout was the pipe its launcher read the ready line from and then left unread: after 64 KiB of
    a loader's prints, its thread blocked in write() for good and every later step failed as held by the loader (a
    probe). What a daemon prints after its ready line goes to its log; each step equals jax.jit."""
    from mpmd.testing import LOADED_LEAF_SHAPE, synthetic_regression_leaf

    fn = "tests.test_inputs:_printing_leaves"
    params = mlp_params(np.random.default_rng(9), num_stages=2, width=LOADED_LEAF_SHAPE[2])
    opt = optax.sgd(1e-2)
    spec = {leaf: jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32) for leaf in ("x", "y")}
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    with mpmd.RemoteMesh.local(2, loaders=[fn], request_timeout=10) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        p, s, p_r, s_r = params, opt.init(params), params, opt.init(params)
        for k in range(4):  # 160 KB printed on each actor
            p, s, loss = dist(p, s, mpmd.loaded_by_actors(fn, spec))
            p_r, s_r, want = ref(p_r, s_r, {leaf: synthetic_regression_leaf(k, leaf) for leaf in ("x", "y")})
            np.testing.assert_allclose(np.asarray(loss), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_host_argument_read_by_the_steps_last_run_is_not_rewritten_while_that_run_computes(mesh2):
    """A host argument in shared memory is read in place on CPU, and the controller rewrites its segment once
    the step's reply has come. Runs are dispatched asynchronously, so the reply waits for the step's last Run:
    here a heavy last Run reads the host matrix `w` while the very next call (one segment: it is reused at
    once) writes another `w` into the same segment. Every result equals jax.jit's."""
    width = 256  # w is 256 KiB: over the shared-memory threshold

    def step(w, batch):
        def mb(m):
            value, g = jax.value_and_grad(lambda w, m: jnp.mean(jnp.tanh(mpmd.pipeline_yield(m["x"] @ w) @ w)))(w, m)
            return g, value

        grads, losses = mpmd.accumulate_grads(mb, batch, schedule=mpmd.GPipe(2))
        heavy = w
        for _ in range(6):  # the last Run reads w for a while after the others are done
            heavy = jnp.tanh(heavy @ w)
        return w - 0.1 * grads + 1e-3 * heavy, losses

    dist = mpmd.distributed(step, mesh=mesh2)
    ref = jax.jit(step)
    stager = input_stager(mesh2)
    rng = np.random.default_rng(7)
    batch = {"x": rng.standard_normal((2, 4, width)).astype(np.float32)}
    ws = [rng.standard_normal((width, width)).astype(np.float32) / 16 for _ in range(6)]
    np.asarray(dist(ws[0], batch)[0])  # compiled, and the prefixes announced
    saved = stager.max_segments
    stager.max_segments = 1
    from mpmd.runtime import inputs

    with stager._lock:
        for actor, pool in stager._pools.items():
            for seg in pool[1:]:  # closed and retired, as `_acquire` does
                inputs._close(seg)
                stager._retired.setdefault(actor, []).append(seg.name)
            del pool[1:]
    try:
        outs = []
        for w in ws:
            outs.append(dist(w, batch)[0])
            deadline = time.monotonic() + 60
            while any(seg.busy for pool in stager._pools.values() for seg in pool):  # until the reply has come
                assert time.monotonic() < deadline
                time.sleep(0.0002)
        for w, got in zip(ws, outs):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref(w, batch)[0]), rtol=1e-5, atol=1e-6)
    finally:
        stager.max_segments = saved


@pytest.mark.slow  # (moved out of the default run, 18.5 minutes on this VM on 2026-12-07: .ci/run runs it when time allows)
def test_segments_replaced_by_bigger_ones_are_unmapped_on_the_actor():
    """A batch that keeps growing makes the controller replace segments; each replaced one is retired in the next
    notice and unmapped on the actor, so the mappings one session holds stay at the pool's size."""
    with mpmd.RemoteMesh.local(2) as mesh:
        stager = input_stager(mesh)
        stager.max_segments = 3
        for rows in (64, 128, 256, 512, 1024, 2048):  # each batch leaf twice the last: 128 KiB .. 4 MiB
            dist, ref, params, state, batch = _tiny(mesh, width=128, m=4, rows=rows)
            np.testing.assert_allclose(np.asarray(dist(params, state, batch)[2]), np.asarray(ref(params, state, batch)[2]),
                                       rtol=1e-5, atol=1e-6)
        assert all(len(pool) <= 3 for pool in stager._pools.values()) and stager.staged >= 12
        assert [_stats(mesh, a)["shm_input_maps"] for a in range(2)] == [len(stager._pools[a]) for a in range(2)]
        # A controller that reconnects announces its prefix again and starts its segments afresh: the actor
        # lets the old mappings go (they would pin their memory until the session ends).
        mesh.run(mesh.conn(0).request("input_shm", {"prefix": f"{stager._base}0-"}))
        assert _stats(mesh, 0)["shm_input_maps"] == 0


def test_a_caller_far_ahead_waits_for_a_segment_instead_of_sending_batches_inline(mesh2):
    """Ten steps dispatched back to back with three segments per actor: the calls beyond the third wait for a
    reply to free one (backpressure) rather than send their batch inline; every result equals jax.jit's."""
    dist, ref, params, state, batch = _tiny(mesh2)
    np.asarray(dist(params, state, batch)[2])
    stager = input_stager(mesh2)
    saved = stager.max_segments
    stager.max_segments = 3
    with stager._lock:
        for actor, pool in stager._pools.items():  # down to the three this test allows
            for seg in [s for s in pool if not s.busy][3:]:
                inputs_module._close(seg)
                stager._retired.setdefault(actor, []).append(seg.name)
                pool.remove(seg)
    fallbacks, waits = stager.fallbacks, stager.waits
    try:
        rng = np.random.default_rng(11)
        batches = [regression_batch(rng, 4, 64, 128) for _ in range(10)]
        p_d, s_d, p_r, s_r, got, want = params, state, params, state, [], []
        for b in batches:  # (back to back: with jax.jit's step between them, the caller fell behind under load and
            p_d, s_d, loss = dist(p_d, s_d, b)  # never waited — a flaky assertion)
            got.append(loss)
        for b in batches:
            p_r, s_r, w = ref(p_r, s_r, b)
            want.append(w)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        assert stager.fallbacks == fallbacks and stager.waits > waits
        assert all(len(pool) <= 3 for pool in stager._pools.values())
    finally:
        stager.max_segments = saved


def _leaf_by_name(step, leaf):
    """A loader whose data depends on the leaf's name (and the step): two leaves loaded under one name are equal."""
    from mpmd.testing import LOADED_LEAF_SHAPE

    seed = [step, *leaf.encode()]
    return np.random.default_rng(seed).standard_normal(LOADED_LEAF_SHAPE).astype(np.float32)


def test_leaves_wrapped_one_by_one_are_named_by_their_path_in_the_batch_and_steps_equal_jax_jit():
    """`{"x": loaded_by_actors(fn, s), "y": {"t": loaded_by_actors(fn, s)}}` called fn(k, "batch") for both
    leaves (the name came from the spec, whose path is empty), so x and y silently held the same data (found by a
    probe). The loader is told each leaf's path in the batch, "x" and "y.t", as for a spec given whole."""
    from mpmd.testing import LOADED_LEAF_SHAPE

    m, rows, width = LOADED_LEAF_SHAPE
    rng = np.random.default_rng(6)
    params = mlp_params(rng, num_stages=2, width=width)
    opt = optax.sgd(1e-2)

    def loss(p, mb):
        return jnp.mean((mlp(p, mb["x"]) - mb["y"]["t"]) ** 2)

    fn = "tests.test_inputs:_leaf_by_name"
    s = jax.ShapeDtypeStruct(LOADED_LEAF_SHAPE, np.float32)
    batch = {"x": mpmd.loaded_by_actors(fn, s), "y": {"t": mpmd.loaded_by_actors(fn, s)}}
    ref = jax.jit(make_train_step(loss, opt, None))
    with mpmd.RemoteMesh.local(2, loaders=[fn]) as mesh:
        dist = mpmd.distributed(make_train_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh)
        p_d, s_d, p_r, s_r = params, opt.init(params), params, opt.init(params)
        for k in range(2):
            p_d, s_d, got = dist(p_d, s_d, batch)
            host = {"x": _leaf_by_name(k, "x"), "y": {"t": _leaf_by_name(k, "y.t")}}
            assert not np.allclose(host["x"], host["y"]["t"])
            p_r, s_r, want = ref(p_r, s_r, host)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        for g, w in zip(jax.tree.leaves(mpmd.fetch(p_d)), jax.tree.leaves(p_r)):
            np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6)
    # the common case is unchanged: a spec given whole names its leaves by their path in it
    whole = mpmd.loaded_by_actors(fn, {"x": s, "inputs": [s, s]})
    assert [whole["x"].name, *(x.name for x in whole["inputs"])] == ["x", "inputs.0", "inputs.1"]
    assert mpmd.loaded_by_actors(fn, s).name == "batch"


@pytest.mark.parametrize("leaf, shown", [(1.0, "'x' is 1.0 (float)"), ([8, 16], "'x.0' is 8 (int)"), ("f32", "'x' is 'f32' (str)")])
def test_a_spec_leaf_without_shape_and_dtype_is_named_with_what_to_pass(leaf, shown):
    """A float or a list of ints in the spec raised AttributeError: 'float' object has no attribute 'shape'."""
    with pytest.raises(TypeError, match=rf"spec leaf {re.escape(shown)}.*jax\.ShapeDtypeStruct.*or an array"):
        mpmd.loaded_by_actors("mpmd.testing:synthetic_regression_leaf", {"x": leaf})
    ok = mpmd.loaded_by_actors("mpmd.testing:synthetic_regression_leaf", {"x": np.zeros((2, 3), np.int32), "y": np.float32(1)})
    assert (ok["x"].shape, ok["x"].dtype, ok["y"].shape, ok["y"].dtype) == ((2, 3), np.int32, (), np.float32)


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_two_threads_first_steps_at_once_both_equal_jit_and_close_unlinks_what_a_dead_actor_never_read():
    """Two threads' first calls on one mesh each announced the input segments, and the second announcement
    unlinked the segment the first had just staged (the step failed: 'cannot be opened'); and segments an actor
    killed before reading them stayed in /dev/shm after mesh.close() until the mesh was collected (a probe)."""
    import glob
    import os
    import signal
    import threading

    rng = np.random.default_rng(0)
    params = mlp_params(rng, num_stages=2, width=128)
    opt = optax.sgd(1e-2)
    batch = regression_batch(rng, 4, 64, 128)
    want = jax.jit(make_train_step(mse_loss(mlp), opt, None))(params, opt.init(params), batch)[2]
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        dist.compile(params, opt.init(params), batch)
        barrier, got, errors = threading.Barrier(2), [], []

        def first_step() -> None:
            barrier.wait()
            try:
                got.append(np.asarray(dist(params, opt.init(params), batch)[2]))
            except Exception as e:  # (reported below, with the others)
                errors.append(e)

        threads = [threading.Thread(target=first_step) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(got) == 2
        for g in got:
            np.testing.assert_allclose(g, np.asarray(want), rtol=1e-5, atol=1e-6)
        stager = input_stager(mesh)
        mine = f"/dev/shm{stager._base}*"
        os.kill(mesh.processes[0].proc.pid, signal.SIGKILL)
        mesh.processes[0].proc.wait(10)
        with pytest.raises(MpmdError):
            for _ in range(3):  # staged for actor 0, never read: its daemon is gone
                np.asarray(dist(params, opt.init(params), batch)[2])
    assert glob.glob(mine) == [], "mesh.close() left the dead actor's input segments in /dev/shm"


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_full_dev_shm_sends_the_inputs_inline_at_once_says_so_and_steps_equal_jax_jit(monkeypatch, caplog):
    """A container's small /dev/shm made every step fail with a bare 'OSError: [Errno 28] No space left on device'
    (and, once caught, each step waited STAGE_WAIT s for a segment that could never be made). /dev/shm itself is
    not shrunk here (that needs a mount namespace): segment creation in the controller raises the OSError a full
    one raises; the actors' own shared memory is untouched. Found by a probe."""
    import errno

    def no_room(name, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    rng = np.random.default_rng(5)
    params = mlp_params(rng, num_stages=2, width=128)
    opt = optax.sgd(1e-2)
    batches = [regression_batch(rng, 4, 64, 128) for _ in range(3)]
    assert batches[0]["x"].nbytes >= SHM_INPUT_MIN_BYTES
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    monkeypatch.setattr(inputs_module.shm, "create_segment", no_room)
    with mpmd.RemoteMesh.local(num_actors=2) as mesh, caplog.at_level("WARNING", logger="mpmd.runtime.inputs"):
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        state, state_r = (params, opt.init(params)), (params, opt.init(params))
        for b in batches:  # dispatched back to back, as a training loop does
            *state, loss = dist(*state, b)
            *state_r, loss_r = ref(*state_r, b)
            np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_r), rtol=1e-5, atol=1e-6)
        stager = input_stager(mesh)
        assert stager.staged == 0 and stager.waits == 0 and stager.shm_failures >= 1
        assert sum("no room in shared memory (/dev/shm)" in r.getMessage() and "--shm-size" in r.getMessage()
                   for r in caplog.records) == 1  # said once, not every step
        for got, w in zip(jax.tree.leaves(mpmd.fetch(state)), jax.tree.leaves(state_r)):
            np.testing.assert_allclose(got, np.asarray(w), rtol=1e-5, atol=1e-6)


def test_a_small_host_batch_refilled_in_place_right_after_the_call_does_not_change_that_step(mesh2):
    """The call returns before the controller loop sends its requests; a batch under the shared-memory threshold
    goes inline in them, and was sent from the caller's own arrays then: a data loader refilling its numpy buffers
    for the next step changed this one's data (a probe: 9-20 of 10-20 steps computed on the refilled values).
    The controller loop is held busy here while the call returns and the buffers are refilled."""
    dist, ref, params, state, batch = _tiny(mesh2, width=8, m=2, rows=4)
    np.asarray(dist(params, state, batch)[2])  # compiled
    x, y = batch["x"].copy(), batch["y"].copy()
    want = np.asarray(ref(params, state, {"x": x.copy(), "y": y.copy()})[2])
    release = threading.Event()

    async def hold_the_loop():
        release.wait(30)  # (blocks the controller loop thread: nothing is sent meanwhile)

    held = mesh2.submit_coroutine(hold_the_loop())
    try:
        y_seen = y.view()  # (a read-only view of the loader's buffer changes with it all the same)
        y_seen.flags.writeable = False
        losses = dist(params, state, {"x": x, "y": y_seen})[2]
        assert not held.done()  # (the call returned with the loop still held: nothing of it sent yet)
        x[...] = 1e6  # the loader's next batch, into the same buffers
        y[...] = -1e6
    finally:
        release.set()
    held.result(30)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)


def test_a_session_closed_for_silence_unlinks_the_segments_its_controller_never_had_read():
    """A controller killed (kill -9) after writing a segment and before its actor mapped it left the name in /dev/shm
    for good (a probe found one); a session the daemon closes for silence sweeps its own prefix's names, and only
    those."""
    from actors.inputs import InputSegments

    if not shm.available() or not os.path.isdir("/dev/shm"):
        pytest.skip("needs POSIX shared memory in /dev/shm")
    token = os.urandom(4).hex()
    announced = f"/mpmd-in-{os.getpid():x}-{token}-0-"
    seg = InputSegments(0)
    prefix = seg.set_prefix(announced)  # (the announced prefix and the actor's random part)
    other = f"/mpmd-in-{os.getpid():x}-{token}-1-3"  # another actor's: not this session's to remove
    bare = announced + "5"  # the announced prefix without this session's random part: not its own either
    for name in (prefix + "0", prefix + "7", other, bare):
        shm.create_segment(name, 4096)[0].close()
    try:
        assert seg.sweep() == 2
        left = set(os.listdir("/dev/shm"))
        assert (prefix + "0")[1:] not in left and (prefix + "7")[1:] not in left and other[1:] in left and bare[1:] in left
    finally:
        for name in (prefix + "0", prefix + "7", other, bare):
            try:
                shm.unlink(name)
            except OSError:
                pass


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_local_controller_killed_while_its_first_steps_compile_leaves_no_input_segment(tmp_path):
    """A controller killed (kill -9) with three steps dispatched while its actors still compiled: the daemons exited
    with it, but the input segments it had written for those steps stayed in /dev/shm for good (6 names, a probe):
    a daemon whose controller died sweeps its sessions' input segments as it exits."""
    if not shm.available() or not os.path.isdir("/dev/shm"):
        pytest.skip("needs POSIX shared memory in /dev/shm")
    child = tmp_path / "child.py"
    child.write_text(
        "import os, numpy as np, optax, mpmd\n"
        "from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch\n"
        "opt = optax.sgd(0.1)\n"
        "rng = np.random.default_rng(5)\n"
        "batches = [regression_batch(rng, 4, 16, 256) for _ in range(3)]  # 64 KiB leaves: through shared memory\n"
        "mesh = mpmd.RemoteMesh.local(num_actors=2)\n"
        "print(os.getpid(), ' '.join(str(p.proc.pid) for p in mesh.processes), flush=True)\n"
        "step = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)\n"
        "p = mlp_params(np.random.default_rng(0), num_stages=2, width=256)\n"
        "o = opt.init(p)\n"
        "for b in batches:\n"
        "    p, o, _ = step(p, o, b)\n"
        "os.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == -9, proc.stderr[-2000:]
    controller, *daemons = [int(x) for x in proc.stdout.split()]
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{d}") for d in daemons), 30)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"mpmd-in-{controller:x}-")]
    assert not left, left


def test_a_put_let_go_while_the_actor_copies_it_from_shared_memory_leaves_no_buffer(mesh2):
    """A big put is copied out of shared memory in a worker thread; a delete arriving meanwhile (its put cancelled
    or refused on another actor, a review) found nothing to delete, and the copy was then stored for good. The put
    reserves its buffer first, so the delete drops it."""
    from mpmd.runtime.inputs import input_stager

    before = mesh2.actor(0).stats()["buffers"]
    big = np.ones((32, 1 << 20), np.float32)  # 128 MiB: its copy takes a while
    stager = input_stager(mesh2)
    assert stager.wants(0, big.nbytes)
    notice, release = stager.stage_once(0, big)
    buf = mesh2.new_buffer_id()

    async def put_then_delete():  # (both sent now, in this order, on one connection)
        put = asyncio.ensure_future(mesh2.conn(0).submit("put", {"buf": buf, "shm": notice}))
        delete = asyncio.ensure_future(mesh2.conn(0).submit("delete", {"bufs": [buf]}))
        return (await put).header, (await delete).header

    try:
        put, delete = mesh2.run(put_then_delete())
    finally:
        release()
    assert put["nbytes"] == big.nbytes and delete["deleted"] == 1
    assert wait_until(lambda: mesh2.actor(0).stats()["buffers"] == before, 10), mesh2.actor(0).stats()["buffers"]


def test_a_segment_its_writer_truncated_after_the_actor_mapped_it_is_refused_not_read_past_its_end():
    """A same-user client that shrank an input segment (ftruncate) after the actor had mapped it, then named it in
    another put: the copy read pages past the file's end and the daemon died of SIGBUS, saying nothing (found by a
    probe). The actor checks the segment's size now before reading, refuses, and serves on."""
    import mmap

    if not shm.available() or not os.path.isdir("/dev/shm"):
        pytest.skip("needs POSIX shared memory in /dev/shm")
    with mpmd.RemoteMesh.local(1) as mesh:
        prefix = f"/mpmd-in-{os.getpid():x}-{os.urandom(4).hex()}-0-"
        conn = mesh.conn(0)
        prefix = mesh.run(conn.request("input_shm", {"prefix": prefix})).header["prefix"]  # (this session's stager is not
        name = prefix + "0"  # used again; the reply's prefix has the actor's random part)
        seg, ino = shm.create_segment(name, 1 << 20)
        with seg:
            seg[:] = bytes(range(256)) * 4096
            fd = shm._posixshmem.shm_open(name, os.O_RDWR, 0)
            notice = {"name": name, "offset": 0, "nbytes": 1 << 20, "dtype": "uint8", "shape": [1 << 20], "ino": ino}
            try:
                mesh.run(conn.request("put", {"buf": 10**6, "shm": notice}))  # mapped (and its name unlinked) now
                os.ftruncate(fd, mmap.PAGESIZE)
                with pytest.raises(MpmdError, match=f"which shrank to {mmap.PAGESIZE} bytes after it was mapped"):
                    mesh.run(conn.request("put", {"buf": 10**6 + 1, "shm": notice}))
            finally:
                os.close(fd)
        assert mesh.processes[0].proc.poll() is None
        assert _stats(mesh, 0)["buffers"] >= 1  # (the first put's buffer: the daemon and its session live on)


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_put_the_host_has_no_memory_for_is_refused_naming_sizes_and_the_mesh_goes_on(monkeypatch):
    """A 16 GiB put to a local actor went into /dev/shm of a 24 GiB machine (over the daemon's --max-message-mb,
    which only the inline route checks) and on toward the OOM killer (a probe). A put through shared memory needs
    the segment and the actor's copy at once: more than the host's MemAvailable is refused before anything is
    written. The host's memory is stood in for (MemAvailable reported at 1.5x a 1 MiB put): filling this shared
    machine's memory for real is not an option."""
    from mpmd.runtime import inputs

    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    with mpmd.RemoteMesh.local(1) as mesh:
        monkeypatch.setattr(inputs, "host_memory", lambda: {"MemTotal": 1 << 40, "MemAvailable": int(1.5 * x.nbytes)})
        with pytest.raises(MpmdError, match=r"put: an array of 1.0 MiB \(float32\[262144\]\) for actor 0, which shares this "
                                            r"host, needs about twice that in memory.*1.5 MiB available: put it in parts"):
            mesh.actor(0).put(x)
        monkeypatch.setattr(inputs, "host_memory", lambda: {"MemTotal": 1 << 40, "MemAvailable": 2 * x.nbytes})
        y = mesh.actor(0).put(x)  # (twice fits: it goes)
        np.testing.assert_array_equal(y.to_numpy(), x)
        assert mesh.actor(0).stats()["buffers"] == 1
    # A put to several actors of this host writes a segment for each before any actor copies its own: each actor's
    # copy still to come counts (2 actors: 3x the array at least; 2x for each actor's own check let it through).
    with mpmd.RemoteMesh.local(2) as mesh:
        monkeypatch.setattr(inputs, "host_memory", lambda: {"MemTotal": 1 << 40, "MemAvailable": int(2.5 * x.nbytes)})
        with pytest.raises(MpmdError, match=r"for actor 1, which shares this host"):
            mesh.put_replicated(x, [0, 1])
        monkeypatch.setattr(inputs, "host_memory", lambda: {"MemTotal": 1 << 40, "MemAvailable": 4 * x.nbytes})
        z = mesh.put_replicated(x, [0, 1])
        np.testing.assert_array_equal(z.to_numpy(), x)
        assert [mesh.actor(a).stats()["buffers"] for a in (0, 1)] == [1, 1]  # (the refused put left nothing there)


_ONE_AT_A_TIME = threading.Lock()
_LAST_STEP: dict[str, int] = {}


def _serial_ordered_loader(step, leaf):
    """(Runs in the daemon.) `synthetic_regression_leaf`, refusing to be called while another call runs or for an
    earlier step than one it served: what a loader that reads one file handle (seek, then read) or a generator
    silently gets wrong."""
    from mpmd.testing import synthetic_regression_leaf

    if not _ONE_AT_A_TIME.acquire(blocking=False):
        raise RuntimeError("two loader calls ran at once")
    try:
        if step < _LAST_STEP.get(leaf, -1):
            raise RuntimeError(f"step {step} loaded after step {_LAST_STEP[leaf]}")
        _LAST_STEP[leaf] = step
        time.sleep(0.01)
        return synthetic_regression_leaf(step, leaf)
    finally:
        _ONE_AT_A_TIME.release()


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_loop_dispatching_many_steps_ahead_loads_one_call_at_a_time_in_step_order_and_equals_jax_jit():
    """A probe (2026-12-05): README's loop dispatches steps without waiting; each actor started every queued step's
    loader call at once (one thread each): a loader that is not thread-safe gave wrong batches silently, past 64
    calls the next step was refused, and memory held every batch. A session's loads now go one call at a time, in
    step order, at most actors.loader.AHEAD steps ahead."""
    from mpmd.testing import synthetic_regression_leaf

    fn = "tests.test_inputs:_serial_ordered_loader"
    params, opt, ref, spec = _loaded_setup(5)
    with mpmd.RemoteMesh.local(2, loaders=[fn]) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        p, s, losses = params, opt.init(params), []
        for _ in range(24):  # none fetched until all are dispatched
            p, s, loss = dist(p, s, mpmd.loaded_by_actors(fn, spec))
            losses.append(loss)
        got = mpmd.fetch(losses)
        p_r, s_r = params, opt.init(params)
        for k in range(24):
            p_r, s_r, want = ref(p_r, s_r, {leaf: synthetic_regression_leaf(k, leaf) for leaf in ("x", "y")})
            np.testing.assert_allclose(got[k], np.asarray(want), rtol=1e-5, atol=1e-6)
        assert [mesh.actor(a).stats()["loader_calls"] for a in range(2)] == [24, 24]


def _loader_returning_none(step, leaf):
    return None


def test_loader_names_given_as_one_string_and_a_loader_returning_no_array_are_said_plainly():
    """A probe (2026-12-05): `loaders="mydata:load"` was read letter by letter ("a loader is named
    'package.module:function', got 'm'"), and a loader returning None failed with "returned |O object[]"."""
    from actors.loader import Loaders

    with pytest.raises(ValueError, match=r"loaders= is a list of .*got the string 'mydata:load': pass \['mydata:load'\]"):
        mpmd.RemoteMesh.local(1, loaders="mydata:load")
    fn = "tests.test_inputs:_loader_returning_none"
    loaders = Loaders([fn])
    with pytest.raises(RuntimeError, match=r"_loader_returning_none\(0, 'x'\) returned a NoneType, not an array; the step "
                                           r"was traced with float32\[2\]"):
        loaders.load(*loaders.check({"fn": fn, "name": "x", "shape": [2], "dtype": "float32"}), 0)


def test_actor_run_takes_a_host_argument_bigger_than_one_message_through_shared_memory_as_put_does():
    """`actor.run`'s host arguments went inline over the control socket: a 4 MiB one to a daemon started with
    --max-message-mb 1 was refused ("bigger than one message to it may be") where `put` of it, through shared
    memory, worked. They are put as `put` puts them now — sync and awaited — and the temporary copies go after."""
    from tests.wire import start_daemon, stop_daemon

    proc, address = start_daemon("--listen", "tcp://127.0.0.1:0", "--insecure", "--max-message-mb", "1")
    try:
        with mpmd.RemoteMesh.connect([address]) as mesh:
            a = mesh.actor(0)
            big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
            y = a.run(jax.jit(lambda v, s: v * s), big, 2.0)
            np.testing.assert_array_equal(y.to_numpy(), big * 2)

            async def awaited():
                return (await a.run_async(jax.jit(lambda v: v + 1), big)).to_numpy()

            np.testing.assert_array_equal(asyncio.run(awaited()), big + 1)
            assert a.stats()["shm_inputs"] >= 2
            assert wait_until(lambda: a.stats()["buffers"] == 1, 10)  # (y; the two copies of `big` are let go behind)
    finally:
        stop_daemon(proc)


def test_a_fifo_under_an_input_segments_name_is_refused_without_blocking_the_daemon():
    """A FIFO made in /dev/shm under a name a session announced: the actor's shm_open(O_RDONLY) blocked its event
    loop until a writer came, every session's requests and heartbeats with it (a probe held one 45 s). The open does
    not block now, and anything but a regular file is refused, naming what it is; the daemon serves on."""
    if not shm.available() or not os.path.isdir("/dev/shm"):
        pytest.skip("needs POSIX shared memory in /dev/shm")
    with mpmd.RemoteMesh.local(1) as mesh:
        prefix = f"/mpmd-in-{os.getpid():x}-{os.urandom(4).hex()}-0-"
        conn = mesh.conn(0)
        prefix = mesh.run(conn.request("input_shm", {"prefix": prefix})).header["prefix"]
        name = prefix + "5"
        os.mkfifo("/dev/shm" + name, 0o600)
        try:
            notice = {"name": name, "offset": 0, "nbytes": 16, "dtype": "float32", "shape": [4], "ino": 1}
            t = time.monotonic()
            with pytest.raises(MpmdError, match=f"shared-memory input {name} is not a shared-memory segment .* but a FIFO"):
                mesh.run(asyncio.wait_for(conn.request("put", {"buf": 10**6, "shm": notice}), 20))
            assert time.monotonic() - t < 10
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("/dev/shm" + name)
        np.testing.assert_array_equal(mesh.actor(0).put(np.arange(4.0, dtype=np.float32)).to_numpy(), np.arange(4.0))


def _ours_in_dev_shm(mesh, actor):
    return [n for n in os.listdir("/dev/shm") if n.startswith(input_stager(mesh).prefix(actor)[1:])]


def test_a_big_fetch_from_a_local_actor_comes_by_shared_memory_and_equals_what_was_put(mesh2):
    """A 64 MiB get went through ZeroMQ's CURVE at 0.14-0.21 GiB/s. From an actor on this host a large value now
    comes through a segment the actor makes under a name the request gives (`into`); the controller maps it and
    copies the value out. Single fetches, a pytree fetched in one request per actor (large, small, a value named
    twice, typed keys) and a computed result all equal what was put; small values stay in the reply; no name is
    left in /dev/shm."""
    a = mesh2.actor(1)
    before = _stats(mesh2, 1)["shm_outputs"]
    big = np.arange(SHM_INPUT_MIN_BYTES // 2, dtype=np.float32).reshape(-1, 64)
    x, small = a.put(big), a.put(np.arange(5, dtype=np.int16))
    got = x.to_numpy()
    np.testing.assert_array_equal(got, big)
    assert got.dtype == big.dtype and not got.flags.writeable
    np.testing.assert_array_equal(small.to_numpy(), np.arange(5, dtype=np.int16))
    assert _stats(mesh2, 1)["shm_outputs"] == before + 1
    y = a.run(jax.jit(lambda u: (u * 2.0, u.sum())), x)
    keys = a.put(jax.random.split(jax.random.key(3), 20000))
    tree = mpmd.fetch({"x": x, "again": x, "small": small, "y": y, "keys": keys})
    np.testing.assert_array_equal(tree["x"], big)
    np.testing.assert_array_equal(tree["again"], big)
    np.testing.assert_array_equal(tree["small"], np.arange(5, dtype=np.int16))
    np.testing.assert_array_equal(tree["y"][0], big * 2.0)
    np.testing.assert_allclose(tree["y"][1], big.sum(), rtol=1e-6)
    assert jnp.array_equal(jax.random.key_data(tree["keys"]), jax.random.key_data(jax.random.split(jax.random.key(3), 20000)))
    assert _stats(mesh2, 1)["shm_outputs"] == before + 1 + 3  # (x once though named twice, y's first, the keys' data)
    z = a.put(big + 1.0)
    z.copy_to_host_async()  # (what jax.device_get starts with: its result is the next fetch's)
    np.testing.assert_array_equal(np.asarray(z), big + 1.0)
    w = a.put(big + 2.0)
    np.testing.assert_array_equal(asyncio.run(mpmd.fetch_async({"w": w}))["w"], big + 2.0)
    assert _stats(mesh2, 1)["shm_outputs"] == before + 1 + 3 + 2
    assert not _ours_in_dev_shm(mesh2, 1)


def test_hostile_get_segment_names_never_overwrite_a_file_and_a_bad_notice_is_refused_by_the_controller(mesh2):
    """The actor creates a get's segment only under its session's prefix and only if the name is free (O_EXCL):
    a name of another prefix, or one another process holds, gets the value in the reply instead and leaves that
    file as it was. On the controller, a notice for a file that is not the one the actor made (another inode) is
    refused with a clear error, and the name is gone from /dev/shm either way."""
    a = mesh2.actor(0)
    big = np.full((SHM_INPUT_MIN_BYTES // 4,), 7.0, np.float32)
    x = a.put(big)
    x.to_numpy()  # (the prefix is announced to actor 0)
    prefix = input_stager(mesh2).prefix(0)
    taken = f"{prefix}{10**9}"
    mm, ino = shm.create_segment(taken, 1 << 16)
    try:
        for name in (taken, "/mpmd-in-1-2-0-5", "/psm_elsewhere", f"{prefix}../x"):
            reply = mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "into": [name]}))
            assert reply.header["shm"] == [None] and np.array_equal(reply.arrays[0], big)
        assert bytes(mm[:16]) == bytes(16)  # (the file another process holds was not written)
        with pytest.raises(MpmdError, match="one segment name .* per buffer"):
            mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "into": [f"{prefix}{10**9 + 1}", "y"]}))
        fresh = f"{prefix}{10**9 + 2}"
        reply = mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "into": [fresh]}))
        notice = reply.header["shm"][0]
        assert notice["name"] == fresh and not reply.arrays
        with pytest.raises(MpmdError, match="is not the file actor 0 made"):
            inputs_module.read_output(0, {**notice, "ino": notice["ino"] + 1}, fresh)
        assert not os.path.exists(f"/dev/shm{fresh}")
        with pytest.raises(MpmdError, match="bytes but the notice says"):
            inputs_module.read_output(0, {**notice, "nbytes": 3}, fresh)
    finally:
        mm.close()
        shm.unlink(taken)
    np.testing.assert_array_equal(x.to_numpy(), big)
    assert not _ours_in_dev_shm(mesh2, 0)
    assert a.ping() is not None


def test_repeated_big_fetches_reuse_one_pooled_segment_and_a_lost_mapping_heals(monkeypatch):
    """Each large fetch from a local actor made a fresh segment (~42 ms of tmpfs pages for 64 MiB, the most of a
    fetch's time). The controller now keeps the segments for the next gets: many fetches of one size go through one
    segment, each value equal to what was put, and no name stays in /dev/shm. When the actor no longer maps a
    pooled segment (dropped there), it writes into a fresh one of that name: the controller reads that one (another
    inode) and drops its own, and the next fetch makes a new pooled one. A segment held by a get that was cancelled
    is not reused, and the actor is told to forget it at the next get; one idle past OUTPUT_IDLE is dropped by the
    next get (the pool holds /dev/shm's memory)."""
    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        a = mesh.actor(0)
        stager = input_stager(mesh)
        values = [np.full((SHM_INPUT_MIN_BYTES // 4 * 3,), float(k), np.float32) for k in range(5)]
        xs = [a.put(v) for v in values]
        before = _stats(mesh, 0)["shm_outputs"]
        for x, v in zip(xs, values):
            np.testing.assert_array_equal(x.to_numpy(), v)
            assert not _ours_in_dev_shm(mesh, 0)
        pool = stager.gets.pools[0]
        assert len(pool) == 1 and not pool[0].busy and _stats(mesh, 0)["shm_outputs"] == before + 5
        first = pool[0]
        np.testing.assert_array_equal(mpmd.fetch({"a": xs[0], "b": xs[1]})["b"], values[1])  # two at once: two segments
        assert len(pool) == 2 and first in pool

        with stager._lock:  # the actor drops its mapping of `first` (as when it evicts it), the pool here keeps it
            stager.gets.told[0] = [first.name]
        got = mpmd.fetch({"a": xs[2], "b": xs[3]})
        np.testing.assert_array_equal(got["a"], values[2])
        np.testing.assert_array_equal(got["b"], values[3])
        assert first not in pool and first.name in stager.gets.told[0]  # (read from the actor's own; then dropped)
        np.testing.assert_array_equal(xs[4].to_numpy(), values[4])
        assert 0 not in stager.gets.told and len(pool) >= 1 and not _ours_in_dev_shm(mesh, 0)

        fn = jax.jit(lambda u: jnp.sort(jnp.sin(jnp.arange(1 << 22, dtype=jnp.float32) * u[0]))[:u.size])
        slow = a.run(fn, xs[1])
        lease = stager.output_lease(0, [slow.nbytes])
        held = lease.segments[lease.names[0]]

        async def cancelled() -> None:
            t = asyncio.ensure_future(mesh.buffers._get(0, [slow.buffers[0]], lease))
            await asyncio.sleep(0.05)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t

        mesh.run(cancelled())
        assert held not in pool and held.name in stager.gets.told[0]
        np.testing.assert_array_equal(slow.to_numpy(), np.asarray(fn(values[1])))
        assert 0 not in stager.gets.told and a.ping() is not None
        # An error reply may come while the actor's thread still writes (a request that timed out there): the
        # segments that get held are dropped, not reused (a review).
        free = [s.name for s in pool]
        with pytest.raises(MpmdError):
            mesh.buffers.get(0, 10**9, nbytes=values[0].nbytes)  # (no such buffer: an error reply)
        assert len(pool) == len(free) - 1 and set(free) - {s.name for s in pool} <= set(stager.gets.told[0])
        np.testing.assert_array_equal(xs[0].to_numpy(), values[0])
        idle = list(pool)
        monkeypatch.setattr(inputs_module, "OUTPUT_IDLE", 0.0)
        np.testing.assert_array_equal(xs[0].to_numpy(), values[0])
        assert idle and not {s.name for s in idle} & {s.name for s in pool} and set(stager.gets.told[0]) == {s.name for s in idle}


def test_a_put_segment_dropped_here_is_unmapped_on_the_actor_by_the_next_put():
    """A reused put segment the controller drops (its put was cancelled, or it sat idle) stays mapped on the actor
    until told: the next put's notice retires it there, so the actor's mappings stay bounded."""
    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        a, stager = mesh.actor(0), input_stager(mesh)
        v = np.full((SHM_INPUT_MIN_BYTES // 4 * 3,), 2.0, np.float32)
        maps = _stats(mesh, 0)["shm_input_maps"]
        np.testing.assert_array_equal(a.put(v).to_numpy(), v)
        (seg,) = stager.puts.pools[0]
        assert _stats(mesh, 0)["shm_input_maps"] == maps + 1
        with stager._lock:
            stager.puts.drop(0, seg)
        assert stager.puts.told[0] == [seg.name]
        np.testing.assert_array_equal(a.put(v + 1).to_numpy(), v + 1)
        assert 0 not in stager.puts.told and seg not in stager.puts.pools[0] and len(stager.puts.pools[0]) == 1
        assert _stats(mesh, 0)["shm_input_maps"] == maps + 1  # (the new one mapped, the dropped one gone)
        assert not _ours_in_dev_shm(mesh, 0)


def test_a_pooled_get_segment_name_the_actor_may_not_write_gets_the_value_in_the_reply(mesh2):
    """A get may name a segment the controller made for reuse (`pooled`: its inode): the actor writes into it in
    place only when it is a regular file of its own user with mode 600, big enough, and that inode; anything else
    under such a name (readable by others, too small, another file) is left as it was and the value comes in the
    reply. Bad `pooled` and `forget` fields are refused naming them."""
    a = mesh2.actor(0)
    big = np.full((SHM_INPUT_MIN_BYTES // 4,), 5.0, np.float32)
    x = a.put(big)
    x.to_numpy()  # (the prefix is announced)
    prefix = input_stager(mesh2).prefix(0)
    open_name, small_name, other_name = (f"{prefix}{10**9 + k}" for k in (7, 8, 9))
    mm_open, ino_open = shm.create_segment(open_name, 1 << 20)
    os.chmod(f"/dev/shm{open_name}", 0o644)
    mm_small, ino_small = shm.create_segment(small_name, 4096)
    mm_other, ino_other = shm.create_segment(other_name, 1 << 20)
    try:
        for name, ino in ((open_name, ino_open), (small_name, ino_small), (other_name, ino_other + 1)):
            reply = mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "into": [name], "pooled": [ino]}))
            assert reply.header["shm"] == [None] and np.array_equal(reply.arrays[0], big)
        assert bytes(mm_open[:16]) == bytes(mm_small[:16]) == bytes(mm_other[:16]) == bytes(16)
        reply = mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "into": [other_name], "pooled": [ino_other]}))
        assert reply.header["shm"][0]["ino"] == ino_other and np.array_equal(np.frombuffer(mm_other, np.float32, big.size), big)
        for bad in (["yes"], [True], [-1]):
            with pytest.raises(MpmdError, match="'pooled' must list one inode"):
                mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "into": [open_name], "pooled": bad}))
        with pytest.raises(MpmdError, match="'forget' must list at most"):
            mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "forget": "all"}))
    finally:
        mesh2.run(mesh2.conn(0).request("get", {"bufs": [x.buffers[0]], "forget": [other_name]}))
        for mm, name in ((mm_open, open_name), (mm_small, small_name), (mm_other, other_name)):
            mm.close()
            shm.unlink(name)
    np.testing.assert_array_equal(x.to_numpy(), big)
    assert a.ping() is not None


def test_get_segments_no_controller_reads_are_bounded_and_gone_when_the_daemon_stops(monkeypatch):
    """A get's segments are the actor's to clean up until the controller reads them: a controller that never reads
    them (killed, or hostile) cannot fill /dev/shm past OUTPUT_MAX_BYTES per session (values then come in the reply),
    the names the actor remembers are forgotten once read (or they grew by one per fetch), and what is left goes
    when the daemon stops (a probe found one left in /dev/shm after the mesh closed)."""
    from actors import inputs as actor_inputs

    monkeypatch.setattr(actor_inputs, "OUTPUT_MAX_BYTES", 3 * actor_inputs.OUTPUT_MIN_BYTES)
    segs = actor_inputs.InputSegments(0)
    prefix = segs.set_prefix(f"/mpmd-in-{os.getpid():x}-{os.urandom(4).hex()}-0-")
    value = np.arange(actor_inputs.OUTPUT_MIN_BYTES // 4, dtype=np.float32)
    try:
        notices = [segs.write_output(f"{prefix}{k}", value) for k in range(4)]
        assert [n is not None for n in notices] == [True, True, True, False]  # (the fourth past the bound: inline)
        assert segs.write_output(f"{prefix}9", value[:10]) is None  # (small: inline)
        shm.unlink(notices[0]["name"])  # read by the controller: room for one more, and forgotten here
        assert segs.write_output(f"{prefix}4", value) is not None and f"{prefix}0" not in segs.written
        assert segs.write_output(f"{prefix}5", value) is None  # (1, 2 and 4 still unread)
        for k in (1, 2, 4):
            shm.unlink(f"{prefix}{k}")
        monkeypatch.setattr(actor_inputs, "OUTPUT_MAX_BYTES", 1 << 30)
        for k in range(6, 6 + 3 * actor_inputs.MAX_SEGMENTS):  # (read at once each time: the remembered names stay few)
            n = segs.write_output(f"{prefix}{k}", value)
            shm.unlink(n["name"])
        assert len(segs.written) <= actor_inputs.MAX_SEGMENTS
    finally:
        segs.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix[1:])]
    assert segs.write_output(f"{prefix}1000", value) is None  # (after the session's end: a get's thread still running)
    assert not os.path.exists(f"/dev/shm{prefix}1000")

    for kill in (False, True):  # a daemon stopped cleanly unlinks them; one killed leaves them to the mesh's close
        with mpmd.RemoteMesh.local(num_actors=1) as mesh:
            x = mesh.actor(0).put(np.ones(1 << 16, np.float32))
            x.to_numpy()
            name = f"{input_stager(mesh).prefix(0)}{10**9}"
            reply = mesh.run(mesh.conn(0).request("get", {"bufs": [x.buffers[0]], "into": [name]}))
            assert reply.header["shm"][0]["name"] == name and os.path.exists(f"/dev/shm{name}")
            if kill:
                os.kill(mesh.processes[0].proc.pid, signal.SIGKILL)
                mesh.processes[0].proc.wait(10)
        assert not os.path.exists(f"/dev/shm{name}")


def test_a_fetch_whose_segment_cannot_be_read_comes_in_the_reply_and_the_next_ones_too(monkeypatch, caplog):
    """A daemon of another user on this host makes segments this controller cannot open (mode 600): the fetch is
    asked again inline, says so once, and later fetches from that actor skip shared memory (a large fetch failed
    there where it had worked inline; a review). Stood in for by a read that fails the way that one would."""
    calls = []
    real = inputs_module.OutputLease.read

    def unreadable(lease, notice, name):
        calls.append(name)
        real(lease, notice, name)  # (the segment is read as usual; then it is refused)
        raise MpmdError(f"actor {lease.actor}'s reply to a fetch pointed at shared memory that cannot be read: [Errno 13] "
                        "Permission denied")

    monkeypatch.setattr(inputs_module.OutputLease, "read", unreadable)
    big = np.arange(1 << 16, dtype=np.float32)
    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        x = mesh.actor(0).put(big)
        with caplog.at_level("WARNING"):
            np.testing.assert_array_equal(x.to_numpy(), big)
            np.testing.assert_array_equal(mpmd.fetch(x), big)
        assert len(calls) == 1 and "come in the reply from now on" in caplog.text
        assert mesh.actor(0).stats()["shm_outputs"] == 1
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(input_stager(mesh).prefix(0)[1:])]


def test_segments_to_retire_are_told_again_only_under_the_actors_prefix_of_now():
    """A put's `retire` list, put back when its request failed, could hold names of the actor's prefix before a
    reconnect gave it another random part; the actor refuses a put that lists names outside its session's prefix, so
    every later put through a reused segment failed the same way until the mesh closed (a review). Names told again
    are those under the prefix the actor has now."""
    from mpmd.runtime.inputs import InputStager

    class Mesh:  # (the stager keeps only a weak reference; prefixes need no actor)
        pass

    mesh = Mesh()
    stager = InputStager(mesh)
    before = f"{stager.prefix(0)}{'a' * 16}-"
    stager._prefixes[0] = now = f"{stager.prefix(0)}{'b' * 16}-"
    assert stager._current(0, [f"{before}3", f"{now}4"]) == [f"{now}4"]
