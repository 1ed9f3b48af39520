"""Daemons placed and supervised by Ray: `RemoteMesh.ray` on a real local Ray instance (``ray.init(num_cpus=...)``,
loopback only). Skipped, saying so, when the `ray` extra is not installed."""

import time

import jax
import numpy as np
import optax
import pytest

import mpmd
from mpmd import testing
from tests.test_rendezvous import trains_like_jit

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed (pip install -e '.[test]' installs it)")


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of this test module alone: 3 logical CPUs on loopback, no dashboard."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             configure_logging=False, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    yield ray
    ray.shutdown()


def ours() -> tuple[list[str], list[str]]:
    """The named Ray actors and the placement groups (not removed) that an mpmd mesh made."""
    actors = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("mpmd-"))
    groups = sorted(g["name"] for g in ray.util.placement_group_table().values()
                    if g["name"].startswith("mpmd-") and g["state"] != "REMOVED")
    return actors, groups


def settled(deadline: float = 15.0) -> tuple[list[str], list[str]]:
    """What is left once Ray has processed the kills and removals (they are asynchronous in Ray)."""
    end = time.monotonic() + deadline
    left = ours()
    while (left[0] or left[1]) and time.monotonic() < end:
        time.sleep(0.2)
        left = ours()
    return left


def steps(mesh):
    rng = np.random.default_rng(0)
    params = testing.mlp_params(rng, num_stages=2)
    batch = testing.regression_batch(rng, num_microbatches=4, microbatch_size=3, width=16)
    opt = optax.adam(1e-2)
    dist = mpmd.distributed(testing.make_train_step(testing.mse_loss(testing.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
    return params, opt.init(params), batch, dist


@pytest.mark.slow  # (15-20 s: run with the slow ones, see .ci/run)
def test_a_ray_mesh_trains_like_jit_and_closing_leaves_no_ray_actor_or_placement_group(local_ray):
    """Also with batches its actors load (RemoteMesh.ray had no `loaders=`, so loaded_by_actors could not work on
    a Ray mesh; a probe)."""
    fn = "mpmd.testing:synthetic_regression_leaf"
    with mpmd.RemoteMesh.ray(2, startup_timeout=120, loaders=[fn]) as mesh:
        actors, groups = ours()
        assert len(actors) == 2 and len(groups) == 1, (actors, groups)
        assert [mesh.actor(i).info()["actor_id"] for i in range(2)] == [0, 1]
        assert mesh.actor(0).info()["authenticated"] is True  # keys made per mesh; only public halves crossed Ray
        trains_like_jit(mesh)
        spec = {leaf: jax.ShapeDtypeStruct(testing.LOADED_LEAF_SHAPE, np.float32) for leaf in ("x", "y")}
        params = testing.mlp_params(np.random.default_rng(5), num_stages=2, width=testing.LOADED_LEAF_SHAPE[2])
        opt = optax.sgd(1e-2)
        dist = mpmd.distributed(testing.make_train_step(testing.mse_loss(testing.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh)
        got = dist(params, opt.init(params), mpmd.loaded_by_actors(fn, spec))[2]
        host = {leaf: testing.synthetic_regression_leaf(0, leaf) for leaf in ("x", "y")}
        want = jax.jit(testing.make_train_step(testing.mse_loss(testing.mlp), opt, None))(params, opt.init(params), host)[2]
        np.testing.assert_allclose(got.to_numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert settled() == ([], [])


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
def test_a_ray_actor_killed_surfaces_as_actor_died_naming_it_and_close_still_cleans_up(local_ray):
    import asyncio

    # (through the awaitable twin, which the stall warning names: its mesh is a plain one once made)
    mesh = asyncio.run(mpmd.RemoteMesh.ray_async(2, startup_timeout=120, heartbeat_interval=0.5, heartbeat_timeout=4))
    try:
        params, opt_state, batch, dist = steps(mesh)
        dist(params, opt_state, batch)  # compiled and running
        victim = mesh.processes[1]
        ray.kill(victim.handle)  # as when Ray loses the node or the actor
        t0 = time.monotonic()
        with pytest.raises(mpmd.ActorDiedError) as err:
            for _ in range(50):
                out = dist(params, opt_state, batch)
                jax.block_until_ready(mpmd.fetch(out[2]))
        assert time.monotonic() - t0 < 30
        text = str(err.value)
        assert "actor 1" in text and victim.name in text, text
    finally:
        mesh.close()
    assert settled() == ([], [])


def test_a_placement_the_cluster_cannot_hold_fails_naming_what_was_asked_and_leaves_nothing(local_ray):
    with pytest.raises(mpmd.ActorStartError) as err:
        mpmd.RemoteMesh.ray(2, cpus_per_actor=2, placement_strategy="STRICT_PACK", placement_timeout=3)
    text = str(err.value)
    assert "2 bundles" in text and "'CPU': 2" in text and "CPU: 3" in text, text
    assert settled() == ([], [])
    with pytest.raises(ValueError, match="placement_strategy"):
        mpmd.RemoteMesh.ray(2, placement_strategy="ANYWHERE")


def test_an_unknown_keyword_is_refused_before_any_daemon_starts(local_ray):
    with pytest.raises(TypeError, match="unexpected keyword argument.*heartbeat_intervall.*heartbeat_interval"):
        mpmd.RemoteMesh.ray(2, heartbeat_intervall=1.0)
    with pytest.raises(ValueError, match=r"mesh_shape \(2,\) needs 2 devices per actor, but devices_per_actor is 1"):
        mpmd.RemoteMesh.ray(2, mesh_shape=(2,), axis_names=("x",))  # (refused once the daemons had started)
    for bad in (-1, 0, float("nan")):  # (-1 was taken)
        with pytest.raises(ValueError, match="placement_timeout must be a positive, finite number"):
            mpmd.RemoteMesh.ray(2, placement_timeout=bad)
    assert ours() == ([], [])  # nothing was placed


def test_a_daemon_directory_whose_ray_worker_and_daemon_are_gone_is_swept_by_the_next_start_on_its_node():
    """ray.kill takes a Ray actor's daemon with it before either removes its directory (log, data-plane socket):
    a probe found one left per lost actor. The next DaemonHost.start on the node removes those whose recorded
    worker and daemon pids are both gone, and leaves the others (a live pid, or no record: not ours to judge)."""
    import os
    import subprocess
    import tempfile

    from mpmd.runtime.launch.ray import OWNERS, sweep_stale_dirs

    gone = []
    for _ in range(2):
        p = subprocess.Popen(["true"])
        p.wait()
        gone.append(p.pid)
    stale, live, unrecorded = (tempfile.mkdtemp(prefix="mpmd-ray-") for _ in range(3))
    try:
        for d, pids in ((stale, gone), (live, [gone[0], os.getpid()])):
            with open(os.path.join(d, OWNERS), "w") as f:
                f.write(" ".join(map(str, pids)) + "\n")
            open(os.path.join(d, "actor0.log"), "w").close()
        sweep_stale_dirs()
        assert not os.path.exists(stale) and os.path.exists(live) and os.path.exists(unrecorded)
        # a surviving sibling's stop sweeps too: closing a mesh after ray.kill left them until the next mesh (a probe)
        from mpmd.runtime.launch.ray import DaemonHost

        stale = tempfile.mkdtemp(prefix="mpmd-ray-")
        with open(os.path.join(stale, OWNERS), "w") as f:
            f.write(" ".join(map(str, gone)) + "\n")
        DaemonHost().stop()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        import shutil

        for d in (stale, live, unrecorded):
            shutil.rmtree(d, ignore_errors=True)


def test_a_ray_address_naming_no_cluster_fails_fast_instead_of_hanging_in_ray_init(monkeypatch):
    """`ray.init()` with RAY_ADDRESS naming a dead head waits without end; the launcher tries the address first.
    (No Ray instance is started: the check runs before ray.init, against a port nothing listens on.)"""
    import socket

    from mpmd.runtime.launch.ray import _check_ray_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens on it
    t = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(mpmd.ActorStartError, match=rf"RAY_ADDRESS='{address}' names no reachable Ray cluster"):
            _check_ray_address(address)
    assert time.monotonic() - t < 10
    for address in ("", "auto", "local"):
        _check_ray_address(address)  # Ray's own lookup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        _check_ray_address(f"127.0.0.1:{s.getsockname()[1]}")


@pytest.mark.slow  # (~20 s: Ray started for itself; last in this module, as it shuts Ray down)
def test_a_step_after_ray_shutdown_fails_at_once_and_close_starts_no_ray():
    """After ray.shutdown() with a mesh open, the next step's fetch hung for good, and close started a new local Ray
    whose agents outlived the program (a probe): the watchdog's `ray.wait` started it. Now the daemons are lost,
    saying Ray was shut down, and nothing starts Ray again."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             configure_logging=False, runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    mesh = mpmd.RemoteMesh.ray(2)
    try:
        params, state, batch, dist = steps(mesh)
        params, state, losses = dist(params, state, batch)
        losses.block_until_ready()
        ray.shutdown()
        t = time.monotonic()
        with pytest.raises(mpmd.ActorDiedError, match=r"Ray was shut down .* close the mesh and make a new one"):
            mpmd.fetch(dist(params, state, batch))
        assert time.monotonic() - t < 30 and not ray.is_initialized()
    finally:
        t = time.monotonic()
        mesh.close()
        assert time.monotonic() - t < 10 and not ray.is_initialized()
