"""The real-run trace and asynchronous steps, on real daemons."""

import json

import jax
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
