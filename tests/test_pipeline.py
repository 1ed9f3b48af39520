"""Pipelined training steps equal `jax.jit` of the same undecorated step (losses, params, optimizer state)."""

import re
import time

import jax
import numpy as np
import optax
import pytest

import mpmd
from tests import models


def make_step(loss_fn, optimizer, schedule):
    def step(params, opt_state, batch):
        def mb_grads(mb):
            value, grads = jax.value_and_grad(loss_fn)(params, mb)
            return grads, value

        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=schedule)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    return step


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    got_l, got_t = jax.tree.flatten(got, is_leaf=lambda x: isinstance(x, mpmd.RemoteArray))
    want_l, want_t = jax.tree.flatten(want)
    assert got_t == want_t
    for g, w in zip(got_l, want_l):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def run_both(mesh, loss_fn, params, batches, schedule, optimizer=None):
    optimizer = optimizer or optax.adam(1e-2)
    ref = jax.jit(make_step(loss_fn, optimizer, None))
    dist = mpmd.distributed(make_step(loss_fn, optimizer, schedule), mesh=mesh)
    rp, ro = params, optimizer.init(params)
    dp, do = params, optimizer.init(params)
    for batch in batches:
        rp, ro, rl = ref(rp, ro, batch)
        dp, do, dl = dist(dp, do, batch)
        assert_trees_close(dl, rl)
    assert_trees_close(dp, rp)
    assert_trees_close(do, ro)
    return dist, dp


SCHEDULES = [mpmd.GPipe, mpmd.OneFOneB]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.__name__)
def test_two_stage_mlp_matches_jit_over_three_adam_steps(mesh2, schedule):
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2)
    batches = [models.regression_batch(rng, 4, 3, 16) for _ in range(3)]
    dist, dp = run_both(mesh2, models.mse_loss(models.mlp), params, batches, schedule(2))
    # parameters stay on the actor of their stage
    assert dp[0]["w"].actors == [0] and dp[1]["w"].actors == [1]


@pytest.fixture(scope="module")
def mesh4():
    with mpmd.RemoteMesh.local(num_actors=4) as mesh:
        yield mesh


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.__name__)
def test_four_stage_mlp_matches_jit(mesh4, schedule):
    rng = np.random.default_rng(1)
    params = models.mlp_params(rng, 4)
    batches = [models.regression_batch(rng, 6, 2, 16) for _ in range(2)]
    run_both(mesh4, models.mse_loss(models.mlp), params, batches, schedule(4))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.__name__)
def test_skip_connection_from_stage_0_to_stage_2_matches_jit(mesh4, schedule):
    rng = np.random.default_rng(2)
    params = models.skip_params(rng)
    batches = [models.regression_batch(rng, 3, 2, 16) for _ in range(2)]
    dist, _ = run_both(mesh4, models.mse_loss(models.skip_model), params, batches, schedule(3))
    text = dist.program(params, optax.adam(1e-2).init(params), batches[0])
    # stage 0's activation goes straight to actor 2, and its gradient straight back
    assert "SEND" in text and any(" -> a2 " in line for line in text.splitlines() if line.strip().split()[1:2] == ["SEND"]) or " -> a2 " in text
    actor0 = text.split("actor 1:")[0]
    assert "-> a2" in actor0 and "<- a2" in actor0
    # a RECV names the Run that sent the value (every one said "(xfer)": a probe): stage 2's backward, here
    recvs = [line for line in actor0.splitlines() if "RECV" in line and "<- a2" in line]
    assert recvs and all(re.search(r"\((2F\d+\+)?2[BI]\d+\)$", line.strip()) for line in recvs), recvs


def test_a_compiled_step_prints_its_programs_and_reprs_in_one_line(mesh2):
    """`step.compile(...)` echoed in a notebook printed the dataclass: every jaxpr equation of the plan, half a
    megabyte for a small model (a probe). Its repr is one line now, its str the Programs `step.program` prints."""
    rng = np.random.default_rng(1)
    params = models.mlp_params(rng, 2)
    batch = models.regression_batch(rng, 4, 2, 16)
    opt = optax.sgd(0.1)
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    compiled = dist.compile(params, opt.init(params), batch)
    assert re.fullmatch(r"<CompiledStep: StepPlan\(2 actors, 2 stages, 16 tasks in \d+ Runs\), \d+ argument leaves, "
                        r"compiled in [0-9.]+ s; print\(\) it for the Programs>", repr(compiled)), repr(compiled)
    assert str(compiled) == dist.program(params, opt.init(params), batch)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.__name__)
def test_small_transformer_on_two_stages_matches_jit(mesh2, schedule):
    rng = np.random.default_rng(3)
    params = models.transformer_params(rng)
    batches = [models.lm_batch(rng, 4, 2) for _ in range(2)]
    run_both(mesh2, models.lm_loss, params, batches, schedule(2))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.__name__)
def test_tied_embeddings_on_first_and_last_stage_match_jit(mesh2, schedule):
    rng = np.random.default_rng(4)
    params = models.transformer_params(rng, tied=True)
    batches = [models.lm_batch(rng, 4, 2) for _ in range(3)]
    _, dp = run_both(mesh2, models.lm_loss, params, batches, schedule(2))
    assert set(dp["embed"].actors) >= {0}


def test_a_schedule_with_fuse_false_runs_every_task_alone_and_matches_jit(mesh2):
    """`fuse=False`: no Run does two tasks (1F1B merges the last stage's F and B of a microbatch by default, which
    XLA may compile slower than the two apart: a softmax-head stage 25 % on CPU), and the results are jax.jit's."""
    rng = np.random.default_rng(3)
    params = models.transformer_params(rng)
    batches = [models.lm_batch(rng, 4, 2) for _ in range(2)]
    opt = optax.adam(1e-2)
    merged = mpmd.distributed(make_step(models.lm_loss, opt, mpmd.OneFOneB(2)), mesh=mesh2)
    apart, _ = run_both(mesh2, models.lm_loss, params, batches, mpmd.OneFOneB(2, fuse=False), opt)
    assert merged.compile(params, opt.init(params), batches[0]).plan.merges_tasks
    plan = apart.compile(params, opt.init(params), batches[0]).plan
    assert not plan.merges_tasks
    runs = [i for p in plan.programs for i in p.instructions if type(i).__name__ == "Run"]
    assert sum(len(r.label.tasks) for r in runs) == 16  # every task of 2 stages x 4 microbatches x (F, B) in a Run of its own


def test_one_request_per_actor_per_step(mesh2):
    rng = np.random.default_rng(5)
    params = models.mlp_params(rng, 2)
    opt = optax.adam(1e-2)
    dist = mpmd.distributed(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    batch = models.regression_batch(rng, 4, 3, 16)
    keep = [dist(params, opt.init(params), batch)]
    keep.append(dist(*keep[-1][:2], batch))  # warm: every argument now a RemoteArray from the last step
    while not keep[-1][2].is_ready():  # (asks the actors nothing)
        time.sleep(0.01)
    before = [mesh2.conn(a).client.requests_sent for a in range(2)]
    keep.append(dist(*keep[-1][:2], batch))
    while not keep[-1][2].is_ready():
        time.sleep(0.01)
    after = [mesh2.conn(a).client.requests_sent for a in range(2)]
    assert [b - a for a, b in zip(before, after)] == [1, 1]


def test_transfers_forced_synchronous_give_the_same_results(mesh2):
    """`overlap=False` makes each actor await every send where it stands (to measure what
    overlap buys); the results must still equal jax.jit's."""
    rng = np.random.default_rng(7)
    params = models.mlp_params(rng, 2)
    batches = [models.regression_batch(rng, 4, 3, 16) for _ in range(2)]
    mesh2.overlap = False
    try:
        run_both(mesh2, models.mse_loss(models.mlp), params, batches, mpmd.OneFOneB(2))
    finally:
        mesh2.overlap = True


def test_killing_an_actor_mid_step_fails_the_step_quickly_and_frees_the_other():
    """Actor 1 is SIGKILLed while it computes and actor 0 waits for its gradient: the step must raise
    ActorDiedError naming actor 1 within the heartbeat timeout (not hang until the transfer timeout), and
    actor 0 must have abandoned the step."""
    import os
    import signal
    import threading
    import time

    import jax.numpy as jnp

    def loss(params, mb):
        h = jnp.tanh(mb["x"] @ params[0]["w"])
        h = mpmd.pipeline_yield(h)
        h = jax.lax.fori_loop(0, 3_000_000, lambda i, v: jnp.sin(v) * 0.999 + 1e-3, h @ params[1]["w"])  # long stage 1
        return jnp.mean(h**2)

    rng = np.random.default_rng(3)
    params = [{"w": rng.standard_normal((16, 16)).astype(np.float32) * 0.1} for _ in range(2)]
    batch = {"x": rng.standard_normal((2, 4, 16)).astype(np.float32)}
    opt = optax.sgd(0.1)
    with mpmd.RemoteMesh.local(num_actors=2, heartbeat_timeout=3.0) as mesh:
        dist = mpmd.distributed(make_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh)
        dist.compile(params, opt.init(params), batch)
        pid = mesh.processes[1].proc.pid
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        t = time.monotonic()
        with pytest.raises(mpmd.ActorDiedError, match=r"actor 1 died or stopped answering during step \d+ of step"):
            dist(params, opt.init(params), batch)[2].to_numpy()
        assert time.monotonic() - t < 30
        assert mesh.actor(0).stats()["running"] == 0
