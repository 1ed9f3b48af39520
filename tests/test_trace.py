"""The real-run trace and asynchronous steps, on real daemons."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from tests import models
from tests.test_pipeline import assert_trees_close, make_step


def test_a_traced_one_f_one_b_step_runs_each_actors_tasks_in_the_schedule_order(mesh2, tmp_path):
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, width=32)
    opt = optax.sgd(0.1)
    schedule = mpmd.OneFOneB(2)
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, schedule), mesh=mesh2)
    batch = models.regression_batch(rng, 6, 4, 32)
    dist(params, opt.init(params), batch)[2].block_until_ready()  # compiled and warm
    with mesh2.trace() as t:
        out = dist(params, opt.init(params), batch)
    assert len(t.steps) == 1
    table = schedule.tasks(6)
    for a in range(2):
        ran = [task for label in t.runs(a) for task in label.split("+") if task[0].isdigit()]
        assert ran == [str(task) for task in table[a]]
        spans = t.steps[-1][a].runs
        assert all(r.waited_from <= r.ready and r.start <= r.end for r in spans)
        assert all(x.end <= y.start + 1e-6 for x, y in zip(spans, spans[1:]))  # one after another
        transfers = t.steps[-1][a].transfers
        assert {x.kind for x in transfers} == {"send", "recv"} and all(x.peer == 1 - a for x in transfers)
    b = t.breakdown()
    for a in range(2):
        parts = b[a].compute + b[a].waiting + b[a].overhead + b[a].idle
        assert b[a].compute > 0 and parts == pytest.approx(b[a].wall, rel=1e-6)
    text = t.summary()
    assert "compute" in text and "waiting for data" in text and "runtime overhead" in text
    path = tmp_path / "trace.json"
    t.to_perfetto(str(path))
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    assert any(e["name"] == "1F0+1B0" or e["name"] == "1F0" for e in events)
    np.testing.assert_allclose(out[2].to_numpy(), jax.jit(make_step(models.mse_loss(models.mlp), opt, None))(
        params, opt.init(params), batch)[2], rtol=1e-5)


def test_k_steps_dispatched_without_fetching_equal_jit(mesh2):
    rng = np.random.default_rng(1)
    params = models.mlp_params(rng, 2)
    opt = optax.adam(1e-2)
    ref = jax.jit(make_step(models.mse_loss(models.mlp), opt, None))
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    batches = [models.regression_batch(rng, 4, 3, 16) for _ in range(6)]
    rp, ro = params, opt.init(params)
    dp, do = params, opt.init(params)
    ref_losses, losses = [], []
    for b in batches:
        rp, ro, rl = ref(rp, ro, b)
        ref_losses.append(rl)
        dp, do, dl = dist(dp, do, b)  # returns at once: nothing fetched until the end
        losses.append(dl)
    for got, want in zip(mpmd.fetch(losses), ref_losses):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(dp, rp)
    assert_trees_close(do, ro)


def test_a_traced_two_actor_gpt_step_runs_the_schedules_table(mesh2):
    from tests.test_examples import load

    nnx = pytest.importorskip("flax.nnx")
    gpt = load("gpt")
    model = gpt.GPT(256, 32, 2, 2, 16, 2, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-3)
    schedule = mpmd.ZeroBubbleH1(2)
    step = mpmd.distributed(gpt.make_step(graphdef, opt, schedule), mesh=mesh2)
    data = np.frombuffer(gpt.corpus(1 << 16), np.uint8)
    batch = next(gpt.batches(data, 4, 2, 16, np.random.default_rng(0)))
    step(params, opt.init(params), batch)[2].block_until_ready()
    with mesh2.trace() as t:
        step(params, opt.init(params), batch)[2].block_until_ready()
    table = schedule.tasks(4)
    for a in range(2):
        ran = [task for label in t.runs(a) for task in label.split("+") if task[0].isdigit()]
        assert ran == [str(x) for x in table[a] if str(x) in set(ran)]
        assert len(ran) >= 2 * 4  # every microbatch's F and backward halves (empty ones are skipped)


def test_a_slowed_stage_shows_up_as_a_larger_measured_bubble_on_the_other_actor():
    """The bubble figures come from the trace: make stage 1 eleven times heavier and actor 0 (stage 0) waits
    longer for its cotangents. Its own mesh: a timing comparison must not share actors with other tests'
    leftover work."""
    from mpmd.observe.trace import measured_bubbles

    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        bubble, waits = _bubbles_with_stage_1_heavier(mesh, measured_bubbles)
    assert bubble[10] > bubble[0] and waits[10] > 2 * waits[0], (bubble, waits)


def _bubbles_with_stage_1_heavier(mesh2, measured_bubbles):

    def make(extra):
        def loss(params, mb):
            h = jnp.tanh(mb["x"] @ params[0]["w"])
            h = mpmd.pipeline_yield(h)
            for _ in range(extra):
                h = jnp.tanh(h @ params[1]["w"])
            return jnp.mean((h @ params[1]["w"] - mb["y"]) ** 2)

        return loss

    rng = np.random.default_rng(3)
    params = [{"w": (rng.standard_normal((256, 256)) / 16).astype(np.float32)} for _ in range(2)]
    batch = {"x": rng.standard_normal((4, 256, 256)).astype(np.float32), "y": rng.standard_normal((4, 256, 256)).astype(np.float32)}
    opt = optax.sgd(0.01)
    bubble, waits = {}, {}
    for extra in (0, 10):
        dist = mpmd.distributed(make_step(make(extra), opt, mpmd.OneFOneB(2)), mesh=mesh2)
        dist(params, opt.init(params), batch)[2].block_until_ready()
        with mesh2.trace() as t:
            dist(params, opt.init(params), batch)[2].block_until_ready()
        bubble[extra] = measured_bubbles(t)[0]
        b0 = t.breakdown()[0]
        waits[extra] = b0.waiting / b0.compute  # actor 0 waiting for stage 1's cotangents, per unit of its own work
    return bubble, waits


def test_mesh_profile_brings_back_a_jax_profiler_trace_per_actor_beside_mpmds_trace(mesh2, tmp_path):
    """jax.profiler runs inside each daemon; its xplane files come back and name each actor; a second
    profile starts cleanly after the first (the daemons' profiler was stopped)."""
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, width=32)
    opt = optax.sgd(0.1)
    opt_state = opt.init(params)
    step = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    batch = models.regression_batch(rng, 4, 4, 32)
    step(params, opt_state, batch)[2].block_until_ready()  # compiled outside the profile
    for run in ("first", "second"):
        with mesh2.profile(tmp_path, run=run) as prof:
            out = step(params, opt_state, batch)
        jax.block_until_ready(mpmd.fetch(out[2]))
        run_dir = tmp_path / "plugins" / "profile" / run
        xplanes = sorted(p.name for p in run_dir.glob("*.xplane.pb"))
        assert xplanes == ["actor0.xplane.pb", "actor1.xplane.pb"], sorted(os.listdir(run_dir))
        assert all((run_dir / x).stat().st_size > 1000 for x in xplanes)
        events = json.loads((tmp_path / f"mpmd_trace_{run}.json").read_text())["traceEvents"]
        assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
        assert prof.trace is not None and len(prof.trace.steps) == 1
