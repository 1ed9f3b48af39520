"""The primitives, the splitting and placement passes, and the user errors, on jaxprs alone (no processes)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from mpmd.compiler.body import analyse
from mpmd.compiler.inline import inline_calls
from mpmd.compiler.plan import plan_step
from mpmd.compiler.stages import is_marker, split_stages
from mpmd.schedules import Custom, validate
from mpmd.step import DistributedFunction
from tests import models
from tests.test_pipeline import make_step


class FakeMesh:
    """Stands in for a RemoteMesh where only tracing and planning run (no actor is contacted)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_pipeline_yield_is_the_identity_under_jit_grad_vmap_and_jvp():
    f = lambda x: jnp.sin(mpmd.pipeline_yield(x * 2.0)) * 3.0
    g = lambda x: jnp.sin(x * 2.0) * 3.0
    x = jnp.linspace(-1, 1, 5)
    np.testing.assert_array_equal(jax.jit(f)(x), jax.jit(g)(x))
    np.testing.assert_array_equal(jax.grad(lambda x: f(x).sum())(x), jax.grad(lambda x: g(x).sum())(x))
    np.testing.assert_array_equal(jax.vmap(f)(x[:, None]), jax.vmap(g)(x[:, None]))
    np.testing.assert_array_equal(jax.jvp(f, (x,), (jnp.ones_like(x),))[1], jax.jvp(g, (x,), (jnp.ones_like(x),))[1])
    tree = mpmd.pipeline_yield({"a": x, "b": (x, x)})
    assert jax.tree.structure(tree) == jax.tree.structure({"a": x, "b": (x, x)})


def test_the_transpose_of_a_forward_marker_is_a_backward_marker():
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(mpmd.pipeline_yield(x)))))(jnp.ones(3))
    directions = [e.params["direction"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "pipeline_yield"]
    assert directions.count("fwd") >= 1 and directions.count("bwd") == 1


def test_accumulate_grads_under_jit_sums_grads_and_stacks_aux_like_a_python_loop():
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, 8)
    batch = models.regression_batch(rng, 5, 3, 8)
    loss = models.mse_loss(models.mlp)

    def fn(mb):
        v, g = jax.value_and_grad(loss)(params, mb)
        return g, {"loss": v}

    grads, aux = jax.jit(lambda b: mpmd.accumulate_grads(fn, b))(batch)

    @jax.jit  # the same loop written out by hand, compiled the same way
    def by_hand(b):
        want_g, want_l = None, []
        for i in range(5):
            g, a = fn(jax.tree.map(lambda x: x[i], b))
            want_g = g if want_g is None else jax.tree.map(jnp.add, want_g, g)
            want_l.append(a["loss"])
        return want_g, jnp.stack(want_l)

    want_g, want_l = by_hand(batch)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(aux["loss"], want_l, rtol=1e-6)


def _body(num_stages):
    """The analysed loop body of an MLP's value_and_grad (microbatch leaves first, then the parameters)."""
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, num_stages, 8)
    mb = jax.tree.map(lambda x: x[0], models.regression_batch(rng, 1, 2, 8))
    fn = lambda m, p: jax.value_and_grad(models.mse_loss(models.mlp))(p, m)
    closed = inline_calls(jax.make_jaxpr(lambda m, p: (lambda vg: (vg[1], vg[0]))(fn(m, p)))(mb, params))
    n_mb, n_grads = 2, 2 * num_stages
    return analyse(closed, n_mb, n_grads, 4, list(closed.jaxpr.invars[n_mb:])), closed


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_split_gives_a_forward_and_a_backward_task_per_stage(num_stages):
    body, closed = _body(num_stages)
    split = split_stages(body)
    assert split.num_stages == num_stages
    assert sorted(split.regions) == sorted((s, k) for s in range(num_stages) for k in "FB")
    for (s, k), eqns in split.regions.items():
        assert not any(is_marker(e, "bwd") for e in eqns if k == "F")
    # every varying equation lands in exactly one task
    assert sum(len(e) for e in split.regions.values()) == len(body.eqns)
    # forward task s reads only stage s's parameters (w, b are the body's inputs 2 + 2s, 2 + 2s + 1)
    param_vars = closed.jaxpr.invars[2:]
    for (s, k), eqns in split.regions.items():
        if k == "F":
            reads = {v for e in eqns for v in e.invars if not hasattr(v, "val")}
            used = {i // 2 for i, v in enumerate(param_vars) if v in reads}
            assert used == {s}


def test_the_loss_computation_is_in_the_last_forward_task_not_the_backward():
    body, closed = _body(2)
    split = split_stages(body)
    loss_var = closed.jaxpr.outvars[-1]
    assert loss_var in {v for e in split.regions[(1, "F")] for v in e.outvars}


def _plan(step_fn, args, actors):
    dist = DistributedFunction(step_fn, FakeMesh(actors))
    outer, _ = dist.trace(*args)
    return plan_step(outer, actors)


def test_placement_keeps_each_stage_parameters_and_optimizer_state_on_its_actor():
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 3, 8)
    opt = optax.adam(1e-3)
    batch = models.regression_batch(rng, 4, 2, 8)
    plan = _plan(make_step(models.mse_loss(models.mlp), opt, mpmd.OneFOneB(3)), (params, opt.init(params), batch), 3)
    homes = jax.tree.unflatten(jax.tree.structure((params, opt.init(params), batch)), [sorted(h) for h in plan.arg_homes])
    p_homes, o_homes, b_homes = homes
    assert [p["w"] for p in p_homes] == [[0], [1], [2]]
    assert [m["w"] for m in o_homes[0].mu] == [[0], [1], [2]]
    assert o_homes[0].count == [0, 1, 2]  # a scalar every stage's update reads: replicated, not sent
    assert b_homes == {"x": [0], "y": [2]}
    # every transfer in the loop is between neighbouring stages, and sends match receives
    sends = {(p.actor, i.to_actor, i.tag) for p in plan.programs for i in p.instructions if type(i).__name__ == "Send"}
    recvs = {(i.from_actor, p.actor, i.tag) for p in plan.programs for i in p.instructions if type(i).__name__ == "Recv"}
    assert sends == recvs and all(abs(a - b) == 1 for a, b, _ in sends)


def _step_with(model, schedule, opt=optax.sgd(0.1)):
    return make_step(models.mse_loss(model), opt, schedule)


def _args(num_stages, num_mb=4, opt=optax.sgd(0.1)):
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, num_stages, 8)
    return params, opt.init(params), models.regression_batch(rng, num_mb, 2, 8)


def test_error_when_markers_and_schedule_stages_disagree():
    with pytest.raises(mpmd.PipelineError, match=r"marks 2 stages \(1 pipeline_yield marker\) .*num_stages=3") as e:
        _plan(_step_with(models.mlp, mpmd.GPipe(3)), _args(2), 3)
    assert "beside" not in str(e.value)


def test_a_marker_beside_another_not_after_it_is_named_as_ending_no_stage_and_no_custom_vjp_is_blamed():
    """Two markers, the second on a value computed from the parameters alone (not from the first's value): stages
    follow the data, so both end stage 0. The error counted "1 pipeline_yield marker" for code with two and blamed a
    jax.custom_vjp the program did not have (a probe); it says what the second marker did."""
    def loss(params, mb):
        x = mpmd.pipeline_yield(jnp.tanh(mb["x"] @ params[0]))
        y = mpmd.pipeline_yield(jnp.ones((2, 8)) * params[1][0, 0])
        return jnp.mean((x + y) ** 2)

    def step(params, batch):
        return mpmd.accumulate_grads(lambda mb: jax.value_and_grad(loss)(params, mb)[::-1], batch, schedule=mpmd.OneFOneB(3))

    rng = np.random.default_rng(0)
    params = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2)]
    batch = {"x": rng.standard_normal((4, 2, 8)).astype(np.float32)}
    with pytest.raises(mpmd.PipelineError, match=r"marks 2 stages .*num_stages=3.* 1 more pipeline_yield marker marked a value "
                                                 r"computed beside another marked value, not from it") as e:
        _plan(step, (params, batch), 3)
    assert "custom_vjp" not in str(e.value)


def test_error_when_the_schedule_needs_more_actors_than_the_mesh_has():
    with pytest.raises(mpmd.PipelineError, match="needs 4 actors but the mesh has 2"):
        _plan(_step_with(models.mlp, mpmd.GPipe(4)), _args(4), 2)


def test_error_when_microbatch_axes_disagree():
    params, opt_state, batch = _args(2)
    batch["y"] = batch["y"][:3]
    with pytest.raises(mpmd.PipelineError, match=r"disagree on the number of microbatches.*\[3, 4\] \(batch\['x'\]: 4, batch\['y'\]: 3\)"):
        _plan(_step_with(models.mlp, mpmd.GPipe(2)), (params, opt_state, batch), 2)


def test_error_when_a_batch_leaf_has_no_microbatch_axis():
    params, opt_state, batch = _args(2)
    batch["y"] = np.float32(1.0)
    batch["n"] = 3
    with pytest.raises(mpmd.PipelineError, match=r"leading microbatch axis; 2 of 3 have none \(batch\['n'\]: shape \(\), batch\['y'\]: shape \(\)\)"):
        _plan(_step_with(models.mlp, mpmd.GPipe(2)), (params, opt_state, batch), 2)


def test_a_marker_inside_a_custom_vjp_function_is_named_as_a_cause_of_too_few_stages():
    """Under grad JAX runs a custom_vjp function's fwd rule and never traces the function itself, so a marker in its
    body leaves no trace; the error blamed the schedule alone (a probe). It names custom_vjp as a cause now."""
    @jax.custom_vjp
    def two(w0, w1, x):
        return jnp.tanh(mpmd.pipeline_yield(jnp.tanh(x @ w0)) @ w1)

    two.defvjp(lambda w0, w1, x: jax.vjp(lambda a, b, c: jnp.tanh(jnp.tanh(c @ a) @ b), w0, w1, x), lambda vjp, g: vjp(g))

    def step(params, batch):
        def mb(mb):
            value, grads = jax.value_and_grad(lambda p: jnp.mean(two(p[0], p[1], mb["x"]) ** 2))(params)
            return grads, value
        return mpmd.accumulate_grads(mb, batch, schedule=mpmd.OneFOneB(2))

    params = [np.eye(8, dtype=np.float32)] * 2
    with pytest.raises(mpmd.PipelineError, match=r"marks 1 stage \(0 pipeline_yield markers\).*inside a jax.custom_vjp function: it is not seen"):
        _plan(step, (params, {"x": np.ones((2, 4, 8), np.float32)}), 2)


def test_a_marker_in_a_custom_vjp_fwd_rule_is_warned_of_and_plain_steps_are_not():
    """A marker at the end of a custom_vjp's fwd rule cuts the forward (JAX traces the rule inline under grad), but
    the bwd rule has none: every stage's backward ran in the last stage's task, all residuals sent there, without a
    word (a probe; the numbers were right). Warned of now, naming the stages; a step whose gradients are the last
    stage's alone, or a plain MLP, has no backward of earlier stages there and is not."""
    import warnings

    @jax.custom_vjp
    def block(x, w):
        return mpmd.pipeline_yield(jnp.tanh(x @ w))

    def block_fwd(x, w):
        h = jnp.tanh(x @ w)
        return mpmd.pipeline_yield(h), (x, w, h)

    def block_bwd(res, g):
        x, w, h = res
        gh = g * (1 - h ** 2)
        return gh @ w.T, x.T @ gh

    block.defvjp(block_fwd, block_bwd)

    def loss(params, mb):
        x = mb["x"]
        for w in params[:-1]:
            x = block(x, w)
        return jnp.mean((x @ params[-1] - mb["y"]) ** 2)

    def plain(params, mb):
        x = mb["x"]
        for w in params[:-1]:
            x = mpmd.pipeline_yield(jnp.tanh(x @ w))
        return jnp.mean((x @ params[-1] - mb["y"]) ** 2)

    def step_of(argnums, loss=loss):
        def step(params, batch):
            return mpmd.accumulate_grads(lambda mb: jax.value_and_grad(lambda *p: loss(list(p), mb), argnums)(*params)[::-1],
                                         batch, schedule=mpmd.InterleavedOneFOneB(4, 2))
        return step

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((16, 16)) / 4).astype(np.float32) for _ in range(4)]
    batch = {"x": rng.standard_normal((4, 8, 16)).astype(np.float32), "y": rng.standard_normal((4, 8, 16)).astype(np.float32)}
    with pytest.warns(UserWarning, match=r"the backward work of stage\(s\) \[0, 1, 2\] runs in the last stage's task.*custom_vjp") as rec:
        _plan(step_of((0, 1, 2, 3)), (params, batch), 2)
    assert rec[0].filename == __file__  # (the caller's line, not one inside mpmd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(step_of((3,), plain), (params, batch), 2)  # (the head's gradient alone: nothing of stages 0-2 in the backward)
        _plan(step_of((0, 1, 2, 3), plain), (params, batch), 2)
        _plan(_step_with(models.mlp, mpmd.OneFOneB(2)), _args(2), 2)


def test_markers_on_values_no_gradient_flows_through_are_warned_of_as_such_not_as_a_custom_vjp():
    """A marker on a bool mask alone, the float activation crossing as a plain value: no gradient flows through the
    marker, so it cannot cut the backward, and stage 0's backward runs on the last actor (the numbers right). The
    warning blamed a jax.custom_vjp the program did not have (a probe); it says what the markers carry and what to
    mark instead. Marking the activation with its mask warns of nothing."""
    import warnings

    def masked(params, mb):
        x = jnp.tanh(mb["x"] @ params[0])
        mask = mpmd.pipeline_yield(x[:, 0] > 0)
        return jnp.mean(jnp.where(mask[:, None], x @ params[1], 0.0) ** 2)

    def both(params, mb):
        x, mask = mpmd.pipeline_yield((jnp.tanh(mb["x"] @ params[0]), mb["x"][:, 0] > 0))
        return jnp.mean(jnp.where(mask[:, None], x @ params[1], 0.0) ** 2)

    def step_of(loss):
        def step(params, batch):
            return mpmd.accumulate_grads(lambda mb: jax.value_and_grad(loss)(params, mb)[::-1], batch,
                                         schedule=mpmd.OneFOneB(2))
        return step

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((8, 8)) / 3).astype(np.float32) for _ in range(2)]
    batch = {"x": rng.standard_normal((4, 3, 8)).astype(np.float32)}
    with pytest.warns(UserWarning, match=r"stage\(s\) \[0\] runs in the last stage's task.*the stage markers carry no float "
                                         r"value.*mark the float activation that flows on to the next stage") as rec:
        _plan(step_of(masked), (params, batch), 2)
    assert not any("custom_vjp" in str(w.message) for w in rec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(step_of(both), (params, batch), 2)


def test_error_when_the_step_has_no_accumulate_grads():
    def step(params, opt_state, batch):
        return jax.grad(models.mse_loss(models.mlp))(params, jax.tree.map(lambda x: x[0], batch))

    with pytest.raises(mpmd.PipelineError, match="never calls mpmd.accumulate_grads"):
        _plan(step, _args(2), 2)


def test_error_when_accumulate_grads_is_nested_names_the_nesting():
    """It blamed the markers ("the step marks 1 stages (0 pipeline_yield markers)"), found by a probe."""
    grad_fn = jax.grad(models.mse_loss(models.mlp))

    def step(params, opt_state, batch):
        def per_microbatch(mb):
            one = jax.tree.map(lambda a: a[None], mb)
            return mpmd.accumulate_grads(lambda m: (grad_fn(params, m), 0.0), one, schedule=mpmd.GPipe(2))
        return mpmd.accumulate_grads(per_microbatch, batch, schedule=mpmd.GPipe(2))

    with pytest.raises(mpmd.PipelineError, match="accumulate_grads is called inside the function given to accumulate_grads"):
        _plan(step, _args(2), 2)


@pytest.mark.parametrize("wrap", ["cond", "checkpoint"])
def test_error_when_accumulate_grads_is_inside_a_cond_or_remat_names_the_loop(wrap):
    """The loop inside lax.cond or jax.checkpoint was refused for 'a pipeline_yield marker inside lax.cond' (the
    markers of its body): the user wrote no marker there (a probe). The loop is named now."""
    inner = _step_with(models.mlp, mpmd.GPipe(2))

    def step(params, opt_state, batch):
        if wrap == "cond":
            return jax.lax.cond(True, inner, inner, params, opt_state, batch)
        return jax.checkpoint(inner)(params, opt_state, batch)

    what = {"cond": r"lax.cond / lax.switch", "checkpoint": r"jax.checkpoint \(remat\)"}[wrap]
    with pytest.raises(mpmd.PipelineError, match=rf"accumulate_grads is called inside {what}, so the microbatch loop cannot be pipelined"):
        _plan(step, _args(2), 2)


def test_error_when_a_marker_is_outside_accumulate_grads():
    inner = _step_with(models.mlp, mpmd.GPipe(2))

    def step(params, opt_state, batch):
        params = mpmd.pipeline_yield(params)
        return inner(params, opt_state, batch)

    with pytest.raises(mpmd.PipelineError, match="pipeline_yield is used before accumulate_grads.*call it inside that function"):
        _plan(step, _args(2), 2)

    def evaluated_after(params, opt_state, batch):  # (a loss on the updated parameters: said what to write instead)
        new_params, new_state, losses = inner(params, opt_state, batch)
        return new_params, new_state, models.mse_loss(models.mlp)(new_params, jax.tree.map(lambda a: a[0], batch))

    with pytest.raises(mpmd.PipelineError, match=r"pipeline_yield is used after accumulate_grads.*a step of its own.*"
                                                 r"accumulate_grads\(lambda mb: \(\(\), loss\(params, mb\)\)"):
        _plan(evaluated_after, _args(2), 2)


@pytest.mark.parametrize("where", ["cond after", "while_loop after", "cond before"])
def test_a_model_evaluated_outside_accumulate_grads_inside_a_cond_or_loop_is_refused_as_outside_the_loop(where):
    """A loss every k steps under lax.cond, or a line search's while_loop (optax.lbfgs), after the loop: the error
    blamed the cond or loop and said to move the marker out of it, which only led to the refusal of a marker after
    accumulate_grads (a probe). It says that refusal at once."""
    inner = _step_with(models.mlp, mpmd.GPipe(2))
    loss = models.mse_loss(models.mlp)

    def step(params, opt_state, batch):
        first = jax.tree.map(lambda a: a[0], batch)
        if where == "cond before":
            jax.lax.cond(True, lambda: loss(params, first), lambda: 0.0)
        new_params, new_state, losses = inner(params, opt_state, batch)
        if where == "cond after":
            return new_params, new_state, jax.lax.cond(True, lambda: loss(new_params, first), lambda: 0.0)
        if where == "while_loop after":
            lr = jax.lax.while_loop(lambda lr: loss(jax.tree.map(lambda p: p * lr, new_params), first) > 1.0, lambda lr: lr / 2, 1.0)
            return new_params, new_state, lr
        return new_params, new_state, losses

    when = where.split()[1]
    with pytest.raises(mpmd.PipelineError, match=rf"pipeline_yield is used {when} accumulate_grads; stage markers belong inside"):
        _plan(step, _args(2), 2)

    def no_loop(params, opt_state, batch):  # (no accumulate_grads at all: no marker is before or after it; a review)
        return jax.lax.cond(True, lambda: loss(params, jax.tree.map(lambda a: a[0], batch)), lambda: 0.0)

    with pytest.raises(mpmd.PipelineError) as e:
        _plan(no_loop, _args(2), 2)
    assert "accumulate_grads;" not in str(e.value) and re.search(r"inside lax.cond|never calls mpmd.accumulate_grads", str(e.value))


def test_error_when_accumulate_grads_has_no_schedule_inside_distributed():
    with pytest.raises(mpmd.PipelineError, match="needs a schedule"):
        _plan(_step_with(models.mlp, None), _args(2), 2)


def test_a_deadlocking_custom_schedule_is_rejected_with_the_table():
    bad = Custom(num_stages=2, order=(("0F0", "0B0", "0F1", "0B1"), ("1F0", "1F1", "1B0", "1B1")))
    with pytest.raises(mpmd.ScheduleError, match=r"deadlocks(.|\n)*actor 0: 0F0 \[0B0\]"):
        validate(bad, 2)


def test_a_schedule_missing_a_task_is_rejected():
    bad = Custom(num_stages=2, order=(("0F0", "0B0"), ("1F0",)))
    with pytest.raises(mpmd.ScheduleError, match="missing from the schedule: 1B0"):
        validate(bad, 1)


@pytest.mark.parametrize("schedule", [mpmd.GPipe, mpmd.OneFOneB])
@pytest.mark.parametrize("stages, microbatches", [(1, 1), (2, 1), (2, 5), (4, 3), (4, 8)])
def test_builtin_schedules_are_complete_and_deadlock_free(schedule, stages, microbatches):
    table = validate(schedule(stages), microbatches)
    assert sum(map(len, table)) == 2 * stages * microbatches


def test_one_f_one_b_keeps_at_most_num_stages_minus_stage_microbatches_in_flight():
    for s, row in enumerate(mpmd.OneFOneB(4).tasks(8)):
        live = peak = 0
        for t in row:
            live += 1 if t.kind == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - s


def _two_stage(model):
    return _step_with(model, mpmd.GPipe(2))


def test_error_for_a_marker_inside_jax_checkpoint_names_remat_and_the_fix():
    def model(params, x):
        def block(p, x):
            return mpmd.pipeline_yield(jnp.tanh(x @ p["w"]))

        x = jax.checkpoint(block)(params[0], x)
        return x @ params[1]["w"]

    with pytest.raises(mpmd.PipelineError, match=r"inside jax.checkpoint \(remat\).*pipeline_yield\(jax.checkpoint\(block\)"):
        _plan(_two_stage(model), _args(2), 2)


def test_error_for_a_marker_inside_lax_cond_names_the_construct():
    def model(params, x):
        x = jax.lax.cond(x.sum() > 0, lambda x: mpmd.pipeline_yield(jnp.tanh(x)), lambda x: mpmd.pipeline_yield(x), x @ params[0]["w"])
        return x @ params[1]["w"]

    with pytest.raises(mpmd.PipelineError, match=r"inside lax.cond / lax.switch"):
        _plan(_two_stage(model), _args(2), 2)


def test_error_when_the_schedule_needs_more_actors_suggests_several_stages_per_actor():
    with pytest.raises(mpmd.PipelineError, match=r"needs 4 actors but the mesh has 2.*several stages on each actor"):
        _plan(_step_with(models.mlp, mpmd.GPipe(4)), _args(4), 2)


def test_accumulate_grads_says_it_sums_when_fn_returns_the_wrong_shape():
    with pytest.raises(mpmd.PipelineError, match=r"must return \(grads, aux\)"):
        jax.make_jaxpr(lambda b: mpmd.accumulate_grads(lambda mb: mb["x"].sum(), b))({"x": jnp.ones((2, 3))})
