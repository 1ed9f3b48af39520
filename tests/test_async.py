"""The awaitable API from the caller's own event loop (pytest-asyncio, asyncio_mode = "auto"), against real
daemons: every twin equals its blocking form and jax.jit; the caller's loop keeps ticking while steps compile
and run; two meshes step at once under `asyncio.gather`; a cancelled step is aborted on its actors and frees
its buffers; a remote error and `asyncio.timeout` reach the await; a blocking call inside a loop still works."""

import asyncio
import contextlib
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    got, want = jax.tree.leaves(mpmd.fetch(got)), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def training(width=16, seed=0, layers=1):
    """A 2-stage MLP train step (1F1B), its jax.jit reference, parameters, optimizer state and a batch."""
    rng = np.random.default_rng(seed)
    opt = optax.adam(1e-2)
    params = mlp_params(rng, 2, width=width, layers_per_stage=layers)
    step = make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(num_stages=2))
    reference = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    return step, reference, params, opt.init(params), regression_batch(rng, 4, 8, width)


class Ticker:
    """A coroutine that sleeps 10 ms at a time and records how late each wake-up was (its loop's stalls)."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.gaps.append(now - last - 0.01)
            last = now

    async def __aenter__(self) -> "Ticker":
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()

    @property
    def largest(self) -> float:
        return max(self.gaps, default=0.0)


async def test_put_run_fetch_and_ready_twins_equal_their_blocking_forms(mesh2):
    f = jax.jit(lambda p, x: {"h": jnp.tanh(x @ p["w"]), "n": jnp.sum(x**2)})
    rng = np.random.default_rng(1)
    p = {"w": rng.standard_normal((8, 4)).astype(np.float32)}
    x = rng.standard_normal((5, 8)).astype(np.float32)
    actor = mesh2.actor(1)
    rp_async = {"w": await actor.put_async(p["w"])}
    rp = {"w": actor.put(p["w"])}
    assert rp_async["w"].actor == 1 and rp_async["w"].shape == (8, 4)
    out_async = await actor.run_async(f, rp_async, x)
    out = actor.run(f, rp, x)
    assert isinstance(out_async["h"], mpmd.RemoteArray) and out_async["h"].actor == 1
    assert await mpmd.ready_async(out_async) is out_async
    got_async, got = await mpmd.fetch_async(out_async), mpmd.fetch(out)
    want = f(p, x)
    for k in want:
        np.testing.assert_array_equal(got_async[k], got[k])
        np.testing.assert_array_equal(got_async[k], np.asarray(want[k]))
    # host leaves pass through, a fetch begun by copy_to_host_async is used, typed keys come back as keys
    key = jax.random.key(3)
    rk = await actor.put_async(key)
    out["h"].copy_to_host_async()
    tree = await mpmd.fetch_async({"h": out["h"], "host": 7, "key": rk})
    np.testing.assert_array_equal(tree["h"], np.asarray(want["h"]))
    assert tree["host"] == 7 and (jax.random.key_data(tree["key"]) == jax.random.key_data(key)).all()
    assert (await actor.stats_async()).keys() == actor.stats().keys()


async def test_call_async_equals_the_blocking_call_and_jax_jit_over_several_steps(mesh2):
    step, reference, params, opt_state, batch = training()
    blocking, awaited = mpmd.distributed(step, mesh=mesh2), mpmd.distributed(step, mesh=mesh2)
    p, o = params, opt_state
    bp, bo = params, opt_state
    rp, ro = params, opt_state
    for _ in range(3):
        p, o, losses = await awaited.call_async(p, o, batch)
        bp, bo, blosses = blocking(bp, bo, batch)
        rp, ro, rlosses = reference(rp, ro, batch)
        np.testing.assert_array_equal(await mpmd.fetch_async(losses), blosses.to_numpy())
        np.testing.assert_allclose(await mpmd.fetch_async(losses), np.asarray(rlosses), rtol=1e-5)
    assert_trees_close((p, o), (rp, ro))
    assert_trees_close((p, o), mpmd.fetch((bp, bo)), rtol=0, atol=0)


async def test_first_calls_awaited_together_compile_the_step_once(mesh2):
    step, reference, params, opt_state, batch = training(seed=5)
    dist = mpmd.distributed(step, mesh=mesh2)
    outs = await asyncio.gather(*(dist.call_async(params, opt_state, batch) for _ in range(3)))
    assert len(dist._compiled) == 1
    want = reference(params, opt_state, batch)
    for out in outs:
        assert_trees_close(out, want)


async def test_call_async_and_run_async_trace_under_the_callers_per_thread_jax_options(mesh2):
    """The worker thread that traces for an awaiting caller sets the JAX options the caller's thread set (JAX keeps
    them per thread): under `jax.default_prng_impl("rbg")` the step's random bits are rbg's, as under jax.jit, and
    under `jax.numpy_rank_promotion("raise")` an implicit rank promotion is refused (a probe: only x64 reached the
    worker, so the step drew threefry's bits and promoted ranks, cached under the caller's options)."""
    _, _, params, _, batch = training(seed=7)

    def step(params, batch, promote=False):
        grads, losses = mpmd.accumulate_grads(lambda mb: jax.value_and_grad(mse_loss(mlp))(params, mb)[::-1], batch,
                                              schedule=mpmd.OneFOneB(num_stages=2))
        g = grads[0][0]
        extra = jnp.ones((2,) + g.shape) if promote else jax.random.normal(jax.random.key(0), g.shape)
        return g + extra, losses

    noisy = lambda x: x + jax.random.normal(jax.random.key(0), x.shape)  # noqa: E731
    x = np.arange(3, dtype=np.float32)
    with jax.default_prng_impl("rbg"):
        want, want_run = jax.jit(step)(params, batch), jax.jit(noisy)(x)
        got = await mpmd.distributed(step, mesh=mesh2).call_async(params, batch)
        got_run = await mesh2.actor(1).run_async(jax.jit(noisy), x)
    assert_trees_close(got, want)
    np.testing.assert_array_equal(await mpmd.fetch_async(got_run), want_run)
    threefry = jax.jit(lambda p, b: step(p, b))(params, batch)  # (a new function: jax.jit's cache ignores the option)
    assert not np.allclose(want[0], threefry[0])  # (threefry's bits differ: the option mattered)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
            jax.jit(step, static_argnums=2)(params, batch, True)
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
            await mpmd.distributed(functools.partial(step, promote=True), mesh=mesh2).call_async(params, batch)
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
            await mesh2.actor(0).run_async(jax.jit(lambda a, b: a + b), x, np.ones((2, 3), np.float32))
    # ... but not the guard of this thread against others (set again in the worker, it failed every lowering: a review)
    with jax.thread_guard(True):
        twice = lambda a: a * 2  # noqa: E731
        np.testing.assert_array_equal(mesh2.actor(0).run(jax.jit(twice), x).to_numpy(), x * 2)
        np.testing.assert_array_equal(await mpmd.fetch_async(await mesh2.actor(1).run_async(jax.jit(twice), x)), x * 2)
        got = await mpmd.distributed(step, mesh=mesh2).call_async(params, batch)
    assert_trees_close(got[1], want[1])


async def test_save_async_and_restore_async_equal_save_and_restore(mesh2, tmp_path):
    step, _, params, opt_state, batch = training(seed=2)
    dist = mpmd.distributed(step, mesh=mesh2)
    p, o, _ = await dist.call_async(params, opt_state, batch)
    tree = {"p": p, "o": o, "host": np.arange(3, dtype=np.int32)}
    where = await mpmd.save_async(str(tmp_path / "a"), tree)
    assert where.endswith("ckpt-1")
    mpmd.save(str(tmp_path / "b"), tree)
    got_async = await mpmd.restore_async(str(tmp_path / "a"), mesh2, like=tree)
    got = mpmd.restore(str(tmp_path / "b"), mesh2, like=tree)
    assert [x.actors for x in jax.tree.leaves(got_async["p"])] == [x.actors for x in jax.tree.leaves(p)]
    assert_trees_close(got_async, mpmd.fetch(got), rtol=0, atol=0)
    assert_trees_close(got_async, mpmd.fetch(tree), rtol=0, atol=0)


async def test_local_async_connect_async_and_async_with_give_meshes_that_close():
    ticker = Ticker()
    async with ticker:
        async with await mpmd.RemoteMesh.local_async(num_actors=1, transport="none") as mesh:
            x = await mesh.actor(0).put_async(np.arange(4, dtype=np.float32))
            y = await mesh.actor(0).run_async(jax.jit(lambda a: a * 2 + 1), x)
            np.testing.assert_array_equal(await mpmd.fetch_async(y), np.arange(4) * 2 + 1)
            other = await mpmd.RemoteMesh.connect_async(mesh.addresses, keys=mesh.keys, transport="none")
            np.testing.assert_array_equal(await mpmd.fetch_async(await other.actor(0).put_async(np.ones(2))), np.ones(2))
            await other.aclose()
            assert other.closed and not mesh.closed
        assert mesh.closed and all(p.proc.poll() is not None for p in mesh.processes)
    print(f"largest gap of a 10 ms ticker while 1 daemon started and stopped: {ticker.largest * 1e3:.1f} ms")
    assert ticker.largest < 0.5  # starting a daemon is a subprocess and a socket: no stall of the loop


async def test_the_callers_loop_keeps_ticking_while_steps_compile_and_run(mesh2):
    """A loop held by the compile would stall for the whole compile (seconds). What remains are the stalls of
    this 2-core machine itself: while both actors compile, the OS preempts the controller's whole process for
    up to ~40 ms at a time (every thread stops, the GIL is not the cause: a sampling thread stalls with the
    loop), more when CI shares the machine. So the bound is a fraction of the compile, not a scheduler quantum."""
    step, reference, params, opt_state, batch = training(width=32, seed=3, layers=2)
    dist = mpmd.distributed(step, mesh=mesh2)
    quiet = Ticker()  # what this machine alone does to a 10 ms ticker (other processes share its cores)
    async with quiet:
        await asyncio.sleep(1.0)
    ticker = Ticker()
    async with ticker:
        t = time.perf_counter()
        p, o, losses = await dist.call_async(params, opt_state, batch)  # traces, plans, lowers, ships: seconds
        compile_s = time.perf_counter() - t
        compile_gap = ticker.largest
        for _ in range(5):
            p, o, losses = await dist.call_async(p, o, batch)
        got = await mpmd.fetch_async(losses)
    rp, ro = params, opt_state
    for _ in range(6):
        rp, ro, rlosses = reference(rp, ro, batch)
    np.testing.assert_allclose(got, np.asarray(rlosses), rtol=1e-5)
    print(f"10 ms ticker: largest gap {ticker.largest * 1e3:.1f} ms while a step compiled ({compile_s:.1f} s; gap "
          f"{compile_gap * 1e3:.1f} ms) and 6 ran; {quiet.largest * 1e3:.1f} ms with nothing to do")
    assert compile_s > 0.2  # the compile really happened inside the window
    # (a compile of 0.57 s, its executables in the persistent cache, made the quarter 0.14 s, inside the 0.17 s
    # stalls the OS gave the process while CI's daemons compiled: the bound is never under 0.2 s, still far below a
    # held loop's stall, which is the whole local compile)
    assert ticker.largest < min(0.25, max(compile_s / 4, 0.2)) + quiet.largest, (ticker.largest, quiet.largest, compile_s)


@pytest.mark.slow  # (15-20 s: run with the slow ones, see .ci/run)
async def test_two_meshes_stepped_concurrently_with_gather_each_equal_jax_jit():
    meshes = await asyncio.gather(mpmd.RemoteMesh.local_async(num_actors=2), mpmd.RemoteMesh.local_async(num_actors=2))
    try:
        runs = [training(seed=10), training(seed=11)]
        dists = [mpmd.distributed(r[0], mesh=m) for r, m in zip(runs, meshes)]

        async def train(dist, run):
            _, _, p, o, batch = run
            for _ in range(3):
                p, o, losses = await dist.call_async(p, o, batch)
            return await mpmd.fetch_async((p, o, losses))

        results = await asyncio.gather(*(train(d, r) for d, r in zip(dists, runs)))
        for (_, reference, p, o, batch), got in zip(runs, results):
            for _ in range(3):
                p, o, losses = reference(p, o, batch)
            assert_trees_close(got, (p, o, losses))
    finally:
        await asyncio.gather(*(m.aclose() for m in meshes))


def _slow_model(params, x):
    x = jnp.tanh(x @ params[0])
    x = mpmd.pipeline_yield(x)
    return jax.lax.fori_loop(0, 400, lambda i, h: jnp.tanh(h @ params[1]), x)  # stage 1 (actor 1) takes a while


def _slow_training():
    opt = optax.sgd(0.01)
    loss = lambda p, mb: jnp.mean((_slow_model(p, mb["x"]) - mb["y"]) ** 2)
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((256, 256)).astype(np.float32) * 0.05 for _ in range(2)]
    batch = {"x": rng.standard_normal((4, 64, 256)).astype(np.float32), "y": np.zeros((4, 64, 256), np.float32)}
    return (make_train_step(loss, opt, mpmd.OneFOneB(num_stages=2)), jax.jit(make_train_step(loss, opt, None)), params,
            opt.init(params), batch)


async def _until_running(mesh, actor):
    deadline = time.monotonic() + 20
    while (await mesh.actor(actor).stats_async())["running"] == 0:
        assert time.monotonic() < deadline, "the step never started on the actor"
        await asyncio.sleep(0.005)


async def _buffers(mesh):
    return [(await mesh.actor(a).stats_async())["buffers"] for a in range(len(mesh))]


@pytest.fixture(scope="module")
def slow_mesh():
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        step, reference, params, opt_state, batch = _slow_training()
        dist = mpmd.distributed(step, mesh=mesh)
        p, o, losses = dist(params, opt_state, batch)  # compiled and run once
        losses.block_until_ready()
        yield mesh, dist, reference, (p, o), (params, opt_state, batch)


async def test_cancelling_an_awaited_step_aborts_it_frees_its_buffers_and_the_next_step_equals_jit(slow_mesh):
    mesh, dist, reference, (p, o), (params, opt_state, batch) = slow_mesh
    before = await _buffers(mesh)

    async def one_step():
        outs = await dist.call_async(p, o, batch)
        return await mpmd.fetch_async(outs)

    task = asyncio.create_task(one_step())
    await _until_running(mesh, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(await mesh.actor(a).stats_async())["running"] for a in (0, 1)] == [0, 0]
    assert await _buffers(mesh) == before  # the step's intermediates and outputs are gone
    # the next step, from the state the cancelled one started from, equals jax.jit's
    rp, ro, _ = reference(params, opt_state, batch)
    want = reference(rp, ro, batch)
    assert_trees_close(await mpmd.fetch_async(await dist.call_async(p, o, batch)), want)


async def test_cancelled_outputs_say_so_and_an_asyncio_timeout_around_a_twin_raises_timeout_error(slow_mesh):
    mesh, dist, reference, (p, o), (params, opt_state, batch) = slow_mesh
    before = await _buffers(mesh)
    outs = await dist.call_async(p, o, batch)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await mpmd.ready_async(outs)
    assert await _buffers(mesh) == before
    with pytest.raises(mpmd.MpmdError, match=r"step \d+ of step was cancelled"):
        await mpmd.fetch_async(outs[2])
    # A step that reads a cancelled step's outputs says so (it said "holds no buffer N ... never put?"; a probe).
    outs = await dist.call_async(p, o, batch)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await mpmd.ready_async(outs)
    with pytest.raises(mpmd.MpmdError, match=r"read argument .*an output of a step that did not finish: step \d+ of step was "
                                             r"cancelled"):
        await mpmd.fetch_async(await dist.call_async(outs[0], outs[1], batch))
    assert await _buffers(mesh) == before
    async with asyncio.timeout(120):  # a timeout that does not fire changes nothing
        got = await mpmd.fetch_async(await dist.call_async(p, o, batch))
    rp, ro, _ = reference(params, opt_state, batch)
    assert_trees_close(got, reference(rp, ro, batch))
    with pytest.raises(TimeoutError):  # around a compile too: the caller gets control back at once
        async with asyncio.timeout(0.01):
            await mpmd.distributed(_slow_training()[0], mesh=mesh).call_async(p, o, batch)


async def test_a_timeout_in_one_task_leaves_the_step_to_another_task_awaiting_it(slow_mesh):
    """A monitor awaiting the losses under asyncio.timeout aborted the step a learner task was awaiting the new
    params of (the learner was told its await was cancelled, the state lost). The step now goes on while
    another await waits for it; the last waiter's cancellation still aborts. Found by a probe."""
    mesh, dist, reference, (p, o), (params, opt_state, batch) = slow_mesh
    outs = await dist.call_async(p, o, batch)
    learner = asyncio.create_task(mpmd.fetch_async(outs[:2]))
    await asyncio.sleep(0)  # (the learner's fetch has begun)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await mpmd.fetch_async(outs[2])
    rp, ro, _ = reference(params, opt_state, batch)
    want = reference(rp, ro, batch)
    assert_trees_close(await learner, want[:2])
    assert_trees_close(await mpmd.fetch_async(outs[2]), want[2])  # (the monitor's losses are there too)


async def test_a_timeout_in_one_task_leaves_the_step_to_a_thread_fetching_it_and_to_a_task_awaiting_a_later_step(slow_mesh):
    """Two more waiters a cancelled await did not see (a probe): a thread blocked in the sync `mpmd.fetch` of the
    same step (run_in_executor beside the loop) — the step was aborted under it; and a task awaiting a later step
    that reads this one's outputs — the later step failed with "an output of a step that did not finish". Both
    wait on now, and get jax.jit's values."""
    mesh, dist, reference, (p, o), (params, opt_state, batch) = slow_mesh
    rp, ro, _ = reference(params, opt_state, batch)
    want = reference(rp, ro, batch)
    outs = await dist.call_async(p, o, batch)
    thread = asyncio.get_running_loop().run_in_executor(None, mpmd.fetch, outs[:2])
    await _until_running(mesh, 1)
    await asyncio.sleep(0.01)  # (the thread's fetch has begun)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await mpmd.fetch_async(outs[2])
    assert_trees_close(await thread, want[:2])
    outs = await dist.call_async(p, o, batch)
    later = await dist.call_async(outs[0], outs[1], batch)  # (reads the first one's outputs)
    learner = asyncio.create_task(mpmd.fetch_async(later))
    await asyncio.sleep(0)  # (the learner's fetch has begun)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await mpmd.fetch_async(outs[2])
    assert_trees_close(await learner, reference(*want[:2], batch))


async def test_a_timeout_on_a_steps_loss_leaves_the_step_to_a_save_of_its_outputs_under_way(slow_mesh, tmp_path):
    """A save of a step's outputs under way is a wait for that step too (a probe): a `wait_for` on the step's loss that
    timed out aborted the step, the save failed "nothing was committed" and the state was gone — with `save_async`
    in a task, `save(wait=False)` and a blocking `save` in a thread alike. The save counts as a waiter from its call
    on (mpmd/runtime/waiters.py): the step runs on, the checkpoint commits jax.jit's values."""
    mesh, dist, reference, (p, o), (params, opt_state, batch) = slow_mesh
    rp, ro, _ = reference(params, opt_state, batch)
    want = reference(rp, ro, batch)
    from mpmd.runtime.waiters import waiters

    for how in ("task", "handle", "thread"):
        outs = await dist.call_async(p, o, batch)
        path = str(tmp_path / how)
        if how == "task":
            saving = asyncio.create_task(mpmd.save_async(path, outs[:2]))
            await asyncio.sleep(0)  # (the save has been called)
        elif how == "thread":
            saving = asyncio.ensure_future(asyncio.to_thread(mpmd.save, path, outs[:2]))
            while waiters(outs[2]._ready) < 1:  # (until the thread's save has been called and counts)
                await asyncio.sleep(0.001)
        else:
            handle = mpmd.save(path, outs[:2], wait=False)
        await _until_running(mesh, 1)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await mpmd.fetch_async(outs[2])
        committed = await saving if how != "handle" else await asyncio.to_thread(handle.wait)
        assert committed.startswith(path)
        assert_trees_close(mpmd.load(path), want[:2])
        assert_trees_close(await mpmd.fetch_async(outs[:2]), want[:2])


async def test_a_timeout_on_a_donating_steps_output_leaves_the_step_running_and_a_cancelled_call_says_the_state_is_gone(slow_mesh):
    """With donate_argnums, a timeout around fetching the loss aborted the step: the new parameters raised "was
    cancelled" and the old ones "was donated ... use those" — a timeout on a loss took the whole training state.
    A step that was donated its inputs now runs on when an await of its outputs is cancelled (its outputs are the
    state's only copy). A call_async cancelled after its dispatch still aborts the step (the caller never got its
    outputs); the donated arrays then say so instead of pointing at outputs that do not exist. Found by a probe."""
    mesh, _, reference, (p, o), (params, opt_state, batch) = slow_mesh
    step = mpmd.distributed(_slow_training()[0], mesh=mesh, donate_argnums=(0, 1))
    p0, o0, _ = await dist_call(step, *mpmd.fetch((p, o)), batch)  # (compiled, and arrays of its own to donate)
    p1, o1, losses = await step.call_async(p0, o0, batch)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1e-6):
            await mpmd.fetch_async(losses)
    rp, ro, _ = reference(params, opt_state, batch)
    rp, ro, _ = reference(rp, ro, batch)
    want = reference(rp, ro, batch)
    assert_trees_close(await mpmd.fetch_async((p1, o1, losses)), want)  # the step ran on: nothing was lost
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(1e-6):  # (the call returns once dispatched: cancelled after it, as a timeout is)
            await step.call_async(p1, o1, batch)
    assert all(x.is_deleted() for x in p1)
    with pytest.raises(mpmd.MpmdError, match=r"donated to step \(donate_argnums\), whose call_async was cancelled after the "
                                             r"step was dispatched.*the state this array held is gone"):
        await mpmd.fetch_async(p1[0])
    assert [(await mesh.actor(a).stats_async())["running"] for a in (0, 1)] == [0, 0]


async def dist_call(step, *args):
    outs = await step.call_async(*args)
    await mpmd.ready_async(outs)
    return outs


async def test_steps_chained_after_a_failed_one_name_the_first_failure_once(slow_mesh):
    """Each step after a failed one quoted the error of the one before it, which quoted its own: after ~1,700
    steps of a loop that only dispatched, one message was 250 KB (found by the soak benchmark)."""
    mesh, dist, reference, (p, o), (params, opt_state, batch) = slow_mesh
    before = await _buffers(mesh)
    outs = await dist.call_async(p, o, batch)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await mpmd.ready_async(outs)  # cancelled: its outputs are gone
    # (the error surfaces at the first fetch, or at the next call once a failed step has ended unseen: either)
    with pytest.raises(mpmd.MpmdError) as e:
        for _ in range(8):
            outs = await dist.call_async(outs[0], outs[1], batch)
        await mpmd.fetch_async(outs[2])
    text = str(e.value)
    assert text.count("did not finish") == 1 and text.count("of step was cancelled") == 1 and len(text) < 1000, text[:3000]
    assert await _buffers(mesh) == before


async def test_a_remote_error_is_raised_by_the_await_naming_the_actor_and_the_step(mesh2):
    step, _, params, opt_state, batch = training(seed=4)
    dist = mpmd.distributed(step, mesh=mesh2)
    p, o, losses = await dist.call_async(params, opt_state, batch)
    await mpmd.ready_async(losses)
    bogus = jax.tree.map(lambda x: x, p)
    bogus[1][0] = mpmd.RemoteArray(mesh2, {1: 424242}, p[1][0].shape, np.float32)
    outs = await dist.call_async(bogus, o, batch)
    with pytest.raises(mpmd.RemoteError, match=r"(?s)actor 1, during step \d+ of step: .*no buffer 424242") as e:
        await mpmd.ready_async(outs)
    assert e.value.actor_id == 1
    with pytest.raises(mpmd.RemoteError, match="no buffer 424242"):
        await mpmd.fetch_async(outs[2])
    p2, o2, losses2 = await dist.call_async(p, o, batch)  # the mesh is usable after
    assert np.isfinite(await mpmd.fetch_async(losses2)).all()


async def test_a_run_that_fails_on_an_actor_is_named_by_its_task_in_the_remote_error(mesh2):
    """A stage-1 parameter whose buffer on actor 1 is not of the shape the step was compiled for: the first Run of
    actor 1's Program that reads it fails there, and the error names that Run's label as its task."""
    from mpmd.compiler.program import Run

    step, _, params, opt_state, batch = training(seed=5)
    dist = mpmd.distributed(step, mesh=mesh2)
    p, o, losses = await dist.call_async(params, opt_state, batch)
    await mpmd.ready_async(losses)
    target = p[1][0]
    assert target.actors == [1]
    wrong = await mesh2.actor(1).put_async(np.zeros(3, np.float32))
    bogus = jax.tree.map(lambda x: x, p)
    bogus[1][0] = mpmd.RemoteArray(mesh2, wrong.buffers, target.shape, target.dtype)  # claims the parameter's shape
    wrong.buffers = {}  # the bogus handle owns the buffer now
    # the Run that reads it: actor 1's Program takes the step's arguments it reads, in argument order
    plan = dist.compile(bogus, o, batch).plan
    leaves = jax.tree.leaves((bogus, o, batch), is_leaf=lambda x: isinstance(x, mpmd.RemoteArray))
    k = next(i for i, x in enumerate(leaves) if x is bogus[1][0])
    read_by_1 = [i for i, homes in enumerate(plan.arg_homes) if 1 in homes]
    local = plan.programs[1].inputs[read_by_1.index(k)]
    label = next(str(ins.label) for ins in plan.programs[1].instructions if isinstance(ins, Run) and local in ins.inputs)
    outs = await dist.call_async(bogus, o, batch)
    with pytest.raises(mpmd.RemoteError) as e:
        await mpmd.ready_async(outs)
    assert e.value.actor_id == 1 and e.value.task == label, str(e.value)
    assert f"actor 1, task {label}" in str(e.value)
    p2, o2, losses2 = await dist.call_async(p, o, batch)  # the mesh is usable after
    assert np.isfinite(await mpmd.fetch_async(losses2)).all()


async def test_a_blocking_call_inside_a_running_loop_works_and_a_long_one_names_the_twins(mesh2, caplog, monkeypatch):
    """The controller's loop is its own thread, so a blocking call from a coroutine cannot deadlock: it holds
    the caller's loop only while it waits, and one that held it long is logged (once) naming the twins. (Any hold
    counts as long here: a compile of shapes an earlier test compiled takes ~0.08 s, under the 0.1 s it takes to be
    logged, and the fresh-clone run, in that order, logged nothing.)"""
    from mpmd.runtime import controller

    monkeypatch.setattr(controller, "_stall_logged", False)
    monkeypatch.setattr(controller, "STALL_WARNING", 0.0)
    step, reference, params, opt_state, batch = training(seed=6)
    dist = mpmd.distributed(step, mesh=mesh2)
    with caplog.at_level(logging.WARNING, logger="mpmd"):
        p, o, losses = dist(params, opt_state, batch)  # compiles: holds this loop for a while
        got = mpmd.fetch((p, o, losses))
    assert_trees_close(got, reference(params, opt_state, batch))
    assert any("call_async" in r.getMessage() and "fetch_async" in r.getMessage() for r in caplog.records), caplog.text
    x = mesh2.actor(0).put(np.ones(3, np.float32))  # quick blocking calls just work
    np.testing.assert_array_equal(await mpmd.fetch_async(x), x.to_numpy())


async def test_starting_local_daemons_inside_a_running_loop_is_logged_naming_the_twin(caplog, monkeypatch):
    """RemoteMesh.local held the caller's loop 1.2-1.6 s starting its daemons and logged nothing: only requests
    on the controller's loop were timed (a probe)."""
    from mpmd.runtime import controller

    monkeypatch.setattr(controller, "_stall_logged", False)
    with caplog.at_level(logging.WARNING, logger="mpmd"):
        with mpmd.RemoteMesh.local(num_actors=1, transport="none") as mesh:
            assert mesh.actor(0).ping() > 0
    said = [r.getMessage() for r in caplog.records if "held this thread's running event loop" in r.getMessage()]
    assert said and said[0].startswith("RemoteMesh.local held") and "RemoteMesh.local_async" in said[0], caplog.text


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
async def test_a_remote_transfer_error_is_raised_by_the_await_naming_the_actors_and_the_step():
    """Actor 0 gives up waiting for a gradient from the slow stage 1 (transfer_timeout 0.3 s): the await raises
    the actor's error, naming the actor that waited, the step, and the actor whose value never came. (On a loaded
    machine actor 1 may give up first, waiting for a forward activation: then the names are the other way round.)"""
    import re

    step, _, params, opt_state, batch = _slow_training()
    async with await mpmd.RemoteMesh.local_async(num_actors=2, transfer_timeout=0.3) as mesh:
        outs = await mpmd.distributed(step, mesh=mesh).call_async(params, opt_state, batch)
        pattern = r"(?s)on actor (\d), during step 0 of step: .*waited 0.3 s for .* from actor (\d)"
        with pytest.raises(mpmd.RemoteError, match=pattern) as e:
            await mpmd.fetch_async(outs)
        waiter, sender = (int(g) for g in re.search(pattern, str(e.value)).groups())
        assert {waiter, sender} == {0, 1} and e.value.actor_id == waiter
        assert [(await mesh.actor(a).stats_async())["running"] for a in (0, 1)] == [0, 0]


@pytest.mark.slow  # (15-20 s: run with the slow ones, see .ci/run)
@pytest.mark.parametrize("wait", ["fetch_async", "ready_async"])
async def test_a_fetch_in_flight_when_the_mesh_closes_says_the_mesh_closed_not_that_an_actor_died_or_was_cancelled(wait):
    """`await mesh.aclose()` while a fetch_async (or ready_async: a probe) of a step's output runs: the wait raises
    MpmdError saying the mesh closed (it raised a bare CancelledError — which reads as the caller's task cancelled —
    or 'actor 0 died ... exited with code 0'), and the next call says the mesh is closed."""
    step, _, params, opt_state, batch = training()
    for _ in range(3):
        mesh = await mpmd.RemoteMesh.local_async(num_actors=2)
        dist = mpmd.distributed(step, mesh=mesh)
        p, o, losses = await dist.call_async(params, opt_state, batch)
        for _ in range(4):
            p, o, losses = await dist.call_async(p, o, batch)
        fetch = asyncio.create_task(getattr(mpmd, wait)(losses))
        await asyncio.sleep(0.01)
        await mesh.aclose()
        with pytest.raises(mpmd.MpmdError, match="closed") as e:
            await fetch
        assert not isinstance(e.value, mpmd.ActorDiedError)
        with pytest.raises(mpmd.MpmdError, match="RemoteMesh is closed"):
            await dist.call_async(p, o, batch)


async def test_aclose_while_a_first_call_compiles_says_the_mesh_was_closed_not_that_an_actor_died():
    """A probe closed the mesh while a first `call_async` compiled: the call raised ActorDiedError ("actor 0
    died ... exited with code 0; mesh.reconnect(0) talks to it again") or a bare CancelledError, by timing. Here
    the compile's requests are held on the controller loop until the close (which stops the loop under them)."""
    step, _, params, state, batch = training()
    mesh = await mpmd.RemoteMesh.local_async(num_actors=2)
    dist = mpmd.distributed(step, mesh=mesh)
    held = []

    async def never_compiled(*args, **kwargs):  # (on the controller loop)
        held.append(time.monotonic())
        await asyncio.sleep(3600)

    mesh.executables.ensure_compiled = never_compiled
    call = asyncio.create_task(dist.call_async(params, state, batch))
    while not held or time.monotonic() - held[-1] < 1.0:  # (every executable lowered and sent to compile)
        await asyncio.sleep(0.01)
    await mesh.aclose()
    with pytest.raises(mpmd.MpmdError, match="this RemoteMesh was closed while the request ran") as e:
        await asyncio.wait_for(call, 60)
    assert not isinstance(e.value, mpmd.ActorDiedError), e.value


async def test_an_actor_lost_to_the_meshs_own_close_says_closed_and_the_callers_cancel_stays_a_cancel(mesh2):
    """The actor "dies" (its daemon exits) because another task closed the mesh: mesh.run and mesh.arun say the mesh
    was closed. The actor's exit is simulated (an ActorDiedError raised once `closed` is set, as the close's
    shutdown makes the daemons exit): a real exit races with the loop's own stop, which the test above covers."""
    from mpmd.errors import ActorDiedError

    async def dies_as_the_mesh_closes():
        mesh2.closed = True
        raise ActorDiedError(0, "process exited with code 0")

    try:
        with pytest.raises(mpmd.MpmdError, match="this RemoteMesh was closed while the request ran") as e:
            await mpmd.runtime.aio.off_loop(lambda: mesh2.run(dies_as_the_mesh_closes()))
        assert not isinstance(e.value, ActorDiedError) and isinstance(e.value.__cause__, ActorDiedError)
    finally:
        mesh2.closed = False
    try:
        with pytest.raises(mpmd.MpmdError, match="this RemoteMesh was closed while the request ran"):
            await mesh2.arun(dies_as_the_mesh_closes())
    finally:
        mesh2.closed = False
    with pytest.raises(ActorDiedError, match="exited with code 3"):  # (open: a real loss stays one)
        async def dies():
            raise ActorDiedError(0, "process exited with code 3")
        await mesh2.arun(dies())
    # The caller's own cancellation is a CancelledError, not "closed".
    task = asyncio.create_task(mesh2.arun(asyncio.sleep(30)))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.slow  # (moved out of the default run, over 15 minutes on this VM: .ci/run runs it when time allows)
async def test_cancelled_run_async_and_put_async_leave_no_buffer_on_the_actor():
    """A `run_async` or `put_async` cancelled after its request went left the buffers it made on the actor for good
    (no RemoteArray was made to free them: 61 after 200 cancels; a probe). They are freed behind the request."""
    import gc

    async with await mpmd.RemoteMesh.local_async(num_actors=1) as mesh:
        a = mesh.actor(0)
        rx = await a.put_async(np.ones((256, 256), np.float32))
        f = jax.jit(lambda v: jnp.tanh(v @ v) @ v)
        await mpmd.fetch_async(await a.run_async(f, rx))  # (lowered and compiled)
        gc.collect()
        before = (await a.stats_async())["buffers"]
        t0 = time.perf_counter()
        del_ = await a.run_async(f, rx)
        took = time.perf_counter() - t0
        del del_
        big = np.ones((512, 512), np.float32)
        cancelled = 0
        for i in range(40):
            task = asyncio.create_task(a.run_async(f, rx) if i % 2 else a.put_async(big))
            await asyncio.sleep(took * 1.5 * i / 40)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                cancelled += 1
            del task
        gc.collect()
        deadline = time.monotonic() + 10
        while (await a.stats_async())["buffers"] != before and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (await a.stats_async())["buffers"] == before and cancelled > 0


async def test_a_run_async_with_a_big_host_argument_whose_compile_fails_leaves_nothing_and_warns_nothing(monkeypatch):
    """`run` puts its host arguments as `put` does (a big one through shared memory), staged before the compile: one
    whose compile failed, or timed out, closed the puts' gather unstarted, and each put inside it said "coroutine ...
    was never awaited" (a review). Closed one by one now: no warning, no segment, no buffer left. (The actor's
    refusal of the compile is stood in for — an exception from `for_run` — as a real one cannot be timed to come
    after the staging here.)"""
    import gc
    import warnings

    async with await mpmd.RemoteMesh.local_async(num_actors=1) as mesh:
        a = mesh.actor(0)
        big = np.ones((256, 1024), np.float32)  # 1 MiB

        async def refused(*args, **kwargs):
            raise mpmd.MpmdError("refused (a stand-in)")

        monkeypatch.setattr(mesh.executables, "for_run", refused)
        before = set(os.listdir("/dev/shm"))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for k in range(3):
                with pytest.raises(mpmd.MpmdError, match="a stand-in"):
                    await a.run_async(jax.jit(lambda v, k=k: v * k), big, big)
            gc.collect()
        assert not [w for w in said if "never awaited" in str(w.message)], [str(w.message) for w in said]
        assert (await a.stats_async())["buffers"] == 0
        assert not {f for f in set(os.listdir("/dev/shm")) - before if f.startswith(f"mpmd-in-{os.getpid():x}-")}


async def test_mesh_starts_abandoned_under_a_timeout_do_not_hold_up_another_meshs_first_call(mesh2, tmp_path):
    """Eight `from_rendezvous_async` waits abandoned under `asyncio.timeout` kept running (Python cannot stop a
    thread) in the runtime's shared pool of eight workers, and a first `call_async` on a healthy mesh, which compiles
    in that pool, waited for them (20 s; a probe). A mesh's start waits in a thread of its own. (The abandoned waits
    last 60 s and the call is given 40: room for a first compile on a slow VM — 12 s was too little in two fresh-clone
    runs on one — short of the 60 it would wait.)"""
    for _ in range(8):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.1):
                await mpmd.RemoteMesh.from_rendezvous_async(str(tmp_path), 2, timeout=60)
    step, reference, params, opt_state, batch = training(width=12)
    dist = mpmd.distributed(step, mesh=mesh2)
    got = await asyncio.wait_for(dist.call_async(params, opt_state, batch), 40)  # (compiled in a worker)
    assert_trees_close(await mpmd.fetch_async(got), reference(params, opt_state, batch))


def test_a_step_future_cancelled_when_the_controller_loop_stops_is_seen_settled_by_wait():
    """The loop's stop cancels a dispatched step's task, and the step's concurrent future was cancelled with a bare
    `Future.cancel()`: CANCELLED but never notified, so `concurrent.futures.wait` (a fetch_async's wait for the steps
    it reads, on a recovering mesh) waited for good, and the interpreter could not exit (found by a probe: a
    fetch_async awaited across aclose). The same wait for a future cancelled elsewhere returns (`wait_settled`)."""
    import concurrent.futures

    from mpmd.runtime.controller import EventLoopThread, wait_settled

    io = EventLoopThread()

    async def forever(sent):
        await asyncio.Event().wait()

    done = io.dispatch(lambda: None, forever)
    time.sleep(0.1)
    io.stop()
    finished, _ = concurrent.futures.wait([done], timeout=2)
    assert done.cancelled() and finished == {done}
    bare = concurrent.futures.Future()
    bare.cancel()  # (as another part of the code, or a user's, may)
    t = time.monotonic()
    wait_settled([bare])
    assert time.monotonic() - t < 1


def _with_callback(callback):
    """A 2-stage step (grads, losses) whose losses go to `callback` on the controller; its parameters and batch."""
    def step(params, batch):
        g, losses = mpmd.accumulate_grads(lambda mb: jax.value_and_grad(mse_loss(mlp))(params, mb)[::-1], batch,
                                          schedule=mpmd.OneFOneB(2))
        jax.debug.callback(callback, losses)
        return g, losses

    rng = np.random.default_rng(0)
    return step, mlp_params(rng, 2, 16, 16), regression_batch(rng, 4, 2, 16)


async def test_fetch_async_returns_a_steps_values_after_its_host_callbacks_ran_as_fetch_does():
    """mpmd.fetch waits for a step's callbacks before any of its values is seen (its prints come first); fetch_async
    returned the values while a 0.4 s jax.debug.callback still ran on the controller (a probe)."""
    ran = []

    def sink(x):
        time.sleep(0.4)
        ran.append(np.asarray(x))

    step, params, batch = _with_callback(sink)
    async with await mpmd.RemoteMesh.local_async(num_actors=2) as mesh:
        dist = mpmd.distributed(step, mesh=mesh)
        for _ in range(2):
            n = len(ran)
            _, losses = await dist.call_async(params, batch)
            got = await mpmd.fetch_async(losses)
            assert len(ran) == n + 1 and np.array_equal(ran[-1], got)


@pytest.mark.slow  # (moved out of the default run, 18.5 minutes on this VM on 2026-12-07: .ci/run runs it when time allows)
async def test_async_with_mesh_trace_waits_for_the_steps_in_flight_off_the_callers_loop():
    """`with mesh.trace()` waits for the steps dispatched before it (and, leaving, for the traced ones): from a
    coroutine it held the caller's loop 5.6 s behind three slow steps, silently (a probe). `async with` waits in a
    worker thread; the trace holds the step traced inside, and only it. Two blocks entering at once: the second is
    refused (both traced, each clearing the other's trace: a review); one whose await is cancelled while it waits
    leaves the mesh not tracing once it would have entered (it stayed tracing for good: a review)."""
    step, params, batch = _with_callback(lambda x: time.sleep(1.0))
    want = jax.jit(lambda p, b: mpmd.accumulate_grads(lambda mb: jax.value_and_grad(mse_loss(mlp))(p, mb)[::-1], b))(params, batch)
    quiet = Ticker()  # what this machine alone does to a 10 ms ticker
    async with quiet:
        await asyncio.sleep(0.5)
    async with await mpmd.RemoteMesh.local_async(num_actors=2) as mesh:
        dist = mpmd.distributed(step, mesh=mesh)
        await mpmd.fetch_async(await dist.call_async(params, batch))  # (compiled)
        await dist.call_async(params, batch)  # in flight as the block starts
        async with Ticker() as ticker:
            t0 = time.perf_counter()
            async with mesh.trace() as t:
                entered = time.perf_counter() - t0
                got = await dist.call_async(params, batch)
        assert entered > 0.5 and ticker.largest < 0.3 + quiet.largest, (entered, ticker.largest, quiet.largest)  # (held: ~1 s)
        assert len(t.steps) == 1 and sorted(t.steps[0]) == [0, 1]
        assert_trees_close(await mpmd.fetch_async(got), want)

        await dist.call_async(params, batch)  # two blocks entering behind it at once
        entering = [asyncio.ensure_future(mesh.trace().__aenter__()) for _ in range(2)]
        done = await asyncio.gather(*entering, return_exceptions=True)
        refused = [d for d in done if isinstance(d, mpmd.MpmdError)]
        assert len(refused) == 1 and "already tracing" in str(refused[0]), done
        assert mesh.active_trace is next(d for d in done if not isinstance(d, BaseException))
        mesh.active_trace = None

        await dist.call_async(params, batch)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(mesh.trace().__aenter__(), 0.2)  # gives up while it waits for the step
        deadline = time.monotonic() + 10
        while (mesh.active_trace is not None or mesh.trace_claimed is not None) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert mesh.active_trace is None and mesh.trace_claimed is None
        async with mesh.trace() as t:  # (it said 'already tracing' for good)
            got = await dist.call_async(params, batch)
        assert len(t.steps) == 1


async def test_a_save_async_cancelled_while_it_commits_still_commits_whole(mesh2, tmp_path, monkeypatch):
    """A probe (2026-12-07): a save_async cancelled (asyncio.wait_for) 34-52 ms in, while its commit ran in its thread,
    had the abandon remove the .tmp directory beside the commit's rename: LATEST named an empty checkpoint and, with
    keep=1, the good one before it was pruned — nothing could be loaded. Once the commit has started it runs to its end
    and the abandon waits for it; here the commit is slowed so that the cancel surely lands inside it."""
    import threading

    from mpmd.runtime import checkpoint as checkpoint_module

    commit, entered = checkpoint_module._commit, threading.Event()

    def slow_commit(*args, **kwargs):
        entered.set()
        time.sleep(0.5)
        return commit(*args, **kwargs)

    path = str(tmp_path / "ck")
    first = {"x": mesh2.actor(0).put(np.arange(4.0)), "y": mesh2.actor(1).put(np.ones(3))}
    await mpmd.save_async(path, first)
    monkeypatch.setattr(checkpoint_module, "_commit", slow_commit)
    second = {"x": mesh2.actor(0).put(np.arange(4.0) * 7), "y": mesh2.actor(1).put(np.ones(3) * 7)}
    saving = asyncio.ensure_future(mpmd.save_async(path, second))
    assert await asyncio.to_thread(entered.wait, 60)
    saving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await saving
    for _ in range(100):  # (the commit ends in its thread)
        if len([d for d in os.listdir(path) if d.startswith("ckpt-")]) == 1 and not any(d.endswith(".tmp") for d in os.listdir(path)):
            break
        await asyncio.sleep(0.05)
    got = mpmd.load(path)
    np.testing.assert_array_equal(got["x"], np.arange(4.0) * 7)
    np.testing.assert_array_equal(got["y"], np.ones(3) * 7)
