"""The programs JAX users write: closed-over values of every dtype, typed PRNG keys, flax nnx dropout,
scanned stacks of stages, stages without parameters, frozen parameters — each equal to `jax.jit` of the
same undecorated step on real daemons."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from tests.test_pipeline import assert_trees_close, make_step


def compare(mesh, step, state, batches, extra=(), steps=None):
    """Run `step(*state, batch, *extra)` under jax.jit and mpmd.distributed for each batch; the first
    len(state) outputs are fed back; every output must agree."""
    ref, dist = jax.jit(step), mpmd.distributed(step, mesh=mesh)
    rs, ds = tuple(state), tuple(state)
    n = len(state)
    for batch in batches:
        r_out = ref(*rs, batch, *extra)
        d_out = dist(*ds, batch, *extra)
        assert_trees_close(mpmd.fetch(d_out[n:]), r_out[n:])
        rs, ds = tuple(r_out[:n]), tuple(d_out[:n])
    assert_trees_close(mpmd.fetch(ds), rs)
    return dist, ds


def mlp2(rng, width=8):
    return [{"w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
             "b": (0.1 * rng.standard_normal(width)).astype(np.float32)} for _ in range(2)]


def batch_of(rng, m=4, b=3, width=8):
    return {"x": rng.standard_normal((m, b, width)).astype(np.float32), "y": rng.standard_normal((m, b, width)).astype(np.float32)}


def test_closed_over_int_bool_uint32_key_and_typed_key_work_as_under_jit(mesh2):
    opt = optax.sgd(0.1)

    def step(params, opt_state, batch, counter, flag, raw_key, typed_key):
        step_key = jax.random.fold_in(raw_key, counter)  # uint32[2], computed in the step
        tkey = jax.random.fold_in(typed_key, counter)  # a typed key computed in the step

        def mb_grads(mb):
            def loss(p):
                h = jnp.tanh(mb["x"] @ p[0]["w"] + p[0]["b"] + counter.astype(jnp.float32) * 0.01)
                h = jnp.where(flag, h, -h)
                h = mpmd.pipeline_yield(h)
                keep = jax.random.bernoulli(step_key, 0.8, h.shape)
                noise = jax.random.normal(tkey, h.shape) * 0.01
                out = jnp.where(keep, h, 0.0) @ p[1]["w"] + p[1]["b"] + noise
                return jnp.mean((out - mb["y"]) ** 2)

            v, g = jax.value_and_grad(loss)(params)
            return g, v

        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=mpmd.OneFOneB(2))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    rng = np.random.default_rng(0)
    params = mlp2(rng)
    extra = (np.int32(3), np.bool_(False), jax.random.PRNGKey(7), jax.random.key(11))
    compare(mesh2, step, (params, opt.init(params)), [batch_of(rng) for _ in range(2)], extra)


def test_typed_keys_in_the_batch_in_the_state_crossing_stages_and_as_outputs(mesh2):
    opt = optax.adam(1e-2)

    def step(params, opt_state, key, batch):
        key, sub = jax.random.split(key)  # a typed key in the state, updated every step

        def mb_grads(mb):
            def loss(p):
                h = jnp.tanh(mb["x"] @ p[0]["w"] + p[0]["b"])
                h, k = mpmd.pipeline_yield((h, mb["key"]))  # a key crosses from stage 0 to stage 1
                mask = jax.random.bernoulli(jax.random.fold_in(k, 1), 0.9, h.shape)
                out = (h * mask) @ p[1]["w"] + p[1]["b"] + 0.01 * jax.random.normal(sub, h.shape)
                return jnp.mean((out - mb["y"]) ** 2)

            v, g = jax.value_and_grad(loss)(params)
            return g, {"loss": v, "key": jax.random.fold_in(mb["key"], 5)}

        grads, aux = mpmd.accumulate_grads(mb_grads, batch, schedule=mpmd.GPipe(2))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, aux

    rng = np.random.default_rng(1)
    params = mlp2(rng)
    batches = []
    for i in range(2):
        b = batch_of(rng)
        b["key"] = jax.random.split(jax.random.key(100 + i), 4)  # one typed key per microbatch
        batches.append(b)
    ref, dist = jax.jit(step), mpmd.distributed(step, mesh=mesh2)
    rs = ds = (params, opt.init(params), jax.random.key(3))
    for b in batches:
        r = ref(*rs, b)
        d = dist(*ds, b)
        np.testing.assert_allclose(d[3]["loss"].to_numpy(), np.asarray(r[3]["loss"]), rtol=1e-5)
        np.testing.assert_array_equal(jax.random.key_data(mpmd.fetch(d[3]["key"])), jax.random.key_data(r[3]["key"]))
        np.testing.assert_array_equal(jax.random.key_data(mpmd.fetch(d[2])), jax.random.key_data(r[2]))
        rs, ds = r[:3], d[:3]
    assert_trees_close(mpmd.fetch(ds[0]), rs[0])


def test_flax_nnx_dropout_with_rngs_trains_in_a_pipeline_like_jit(mesh2):
    """nnx.Dropout in both stages, driven by nnx.Rngs made from a typed key per microbatch (in the batch)."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.3)
            self.l2 = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x, rngs):
            h = self.drop(nnx.relu(self.l1(x)), rngs=rngs)
            h = mpmd.pipeline_yield(h)
            return self.l2(self.drop(h, rngs=rngs))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    opt = optax.adamw(1e-2)

    def step(params, opt_state, batch):
        def mb_grads(mb):
            def loss(p):
                m = nnx.merge(graphdef, p)
                return jnp.mean((m(mb["x"], rngs=nnx.Rngs(dropout=mb["key"])) - mb["y"]) ** 2)

            v, g = jax.value_and_grad(loss)(params)
            return g, v

        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=mpmd.OneFOneB(2))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    rng = np.random.default_rng(2)
    batches = []
    for i in range(3):
        b = batch_of(rng)
        b["key"] = jax.random.split(jax.random.key(i), 4)
        batches.append(b)
    compare(mesh2, step, (params, opt.init(params)), batches)


def scan_model(params, x):
    """A scanned stack of stages: stacked per-stage parameters [S, ...], a marker at the end of the body."""

    def block(h, p):
        h = jnp.tanh(h @ p["w"] + p["b"])
        return mpmd.pipeline_yield(h), None

    h, _ = jax.lax.scan(block, x @ params["embed"], params["blocks"])
    return h @ params["head"]


def scan_params(rng, stages=4, width=8):
    return {"embed": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            "blocks": {"w": (rng.standard_normal((stages, width, width)) / np.sqrt(width)).astype(np.float32),
                       "b": (0.1 * rng.standard_normal((stages, width))).astype(np.float32)},
            "head": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)}


def mse(model):
    return lambda p, mb: jnp.mean((model(p, mb["x"]) - mb["y"]) ** 2)


@pytest.fixture(scope="module")
def mesh4():
    with mpmd.RemoteMesh.local(num_actors=4) as mesh:
        yield mesh


def test_a_scanned_stack_of_four_stages_runs_on_four_actors(mesh4):
    rng = np.random.default_rng(3)
    params = scan_params(rng)
    opt = optax.adam(1e-2)
    step = make_step(mse(scan_model), opt, mpmd.OneFOneB(4))
    dist, _ = compare(mesh4, step, (params, opt.init(params)), [batch_of(rng, m=4) for _ in range(2)])
    text = dist.program(params, opt.init(params), batch_of(rng, m=4))
    assert "3F0" in text and "3B0" in text  # four stages (the head joined the last iteration's)


def test_a_scanned_stack_of_big_stacked_parameters_warns_that_it_is_placed_whole_and_a_small_one_does_not(mesh4):
    """A lax.scan over 4 stages of 256 x 256 stacked weights moved 6 MiB per step where the same layers as a list
    moved 0.1 MiB (a probe): a stacked parameter is one leaf, placed whole on one actor. The step is right; the
    compile says what it costs and what to write instead. Small stacks (under 1 MiB) are not warned about."""
    import warnings

    rng = np.random.default_rng(3)
    opt = optax.sgd(1e-2)
    step = mpmd.distributed(make_step(mse(scan_model), opt, mpmd.OneFOneB(4)), mesh=mesh4)
    big = scan_params(rng, width=256)
    with pytest.warns(UserWarning, match=r"a lax.scan unrolled into 4 stages takes its per-stage operands stacked in one "
                                         r"array each \(float32\[4, 256\], float32\[4, 256, 256\]; 1\.0 MiB\).*keep the layers as a list"):
        step.program(big, opt.init(big), batch_of(rng, m=4, width=256))
    small = scan_params(rng)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step.program(small, opt.init(small), batch_of(rng, m=4))
    assert not [w for w in seen if "stacked in one array" in str(w.message)]


def test_a_scanned_stacks_gradient_is_summed_on_each_stages_actor_and_stacked_once_after_the_loop(mesh4):
    """The gradient of a scanned stack of parameters is `stack` of the iterations' gradients: it was stacked every
    microbatch on one actor, each stage sending it its slice after every microbatch (a probe: 24 weight-sized sends
    per step for 4 stages, 8 microbatches). The microbatch sum is pushed through the stack (exact: it only moves
    elements), so each stage's slice is summed on its own actor and the stack made once, after the loop: no
    weight-sized send inside the loop. Equal to jax.jit, bit for bit with SGD."""
    rng = np.random.default_rng(3)
    opt = optax.sgd(1e-2)
    params = scan_params(rng, width=16)
    step = make_step(mse(scan_model), opt, mpmd.OneFOneB(4))
    batches = [batch_of(rng, m=8, width=16) for _ in range(2)]
    dist, _ = compare(mesh4, step, (params, opt.init(params)), batches)
    text = dist.program(params, opt.init(params), batches[0])
    sends = [line.strip() for line in text.splitlines() if "RECV" in line and "float32[16, 16]" in line]
    # (each once per step: after the loop, or with the last microbatch's task, 7, that ends a stage's sum)
    assert sends and all(line.endswith("(post)") or re.search(r"\(\d+[FBIW]7(\+\S+)?\)$", line) for line in sends), sends
    got = mpmd.fetch(dist(params, opt.init(params), batches[0]))
    want = jax.jit(step)(params, opt.init(params), batches[0])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_two_scanned_stacks_and_a_scan_of_scans_give_a_stage_per_iteration(mesh2):
    """An encoder stack then a decoder stack (a marker in each body), and a scan of 2 groups over a scan of 2
    layers: every iteration is a stage (4), not 3 — only the very last scan's last marker is dropped (each
    scan's was, merging the encoder's last layer with the decoder's first; found by a probe). A marker
    right after a scan still takes the place of the scan's own."""
    from mpmd.compiler.loop_tasks import analyse_loop_body, find_step_loop
    from mpmd.compiler.stages import split_stages

    rng = np.random.default_rng(5)
    w = lambda *s: (rng.standard_normal(s) / 3).astype(np.float32)  # noqa: E731
    params = {"enc": w(2, 8, 8), "dec": w(2, 8, 8), "head": w(8, 8), "nest": w(2, 2, 8, 8)}

    def block(h, w):
        return mpmd.pipeline_yield(jnp.tanh(h @ w)), None

    def two_scans(p, x):
        h, _ = jax.lax.scan(block, x, p["enc"])
        h, _ = jax.lax.scan(block, jnp.sin(h), p["dec"])  # (what lies between joins the decoder's first stage)
        return h @ p["head"]

    def marker_between(p, x):
        h, _ = jax.lax.scan(block, x, p["enc"])
        h, _ = jax.lax.scan(block, mpmd.pipeline_yield(h), p["dec"])
        return h @ p["head"]

    def nested(p, x):
        h, _ = jax.lax.scan(lambda h, ws: (jax.lax.scan(block, h, ws)[0], None), x, p["nest"])
        return h @ p["head"]

    def nested_group_marker(p, x):  # a marker after each layer and after each group: the group's takes the layer's place
        h, _ = jax.lax.scan(lambda h, ws: (mpmd.pipeline_yield(jnp.sin(jax.lax.scan(block, h, ws)[0])), None), x, p["nest"])
        return h @ p["head"]

    jitted = jax.jit(lambda h, w: mpmd.pipeline_yield(jnp.tanh(h @ w)))

    def jitted_blocks(p, x):  # the marker inside a jitted block in the body: still a scan's end (it was not)
        h, _ = jax.lax.scan(block, x, p["enc"])
        h, _ = jax.lax.scan(lambda h, w: (jitted(h, w), None), h, p["dec"])
        return h @ p["head"]

    opt = optax.adam(1e-2)
    for model in (two_scans, marker_between, nested, nested_group_marker, jitted_blocks):
        step = make_step(mse(model), opt, mpmd.InterleavedOneFOneB(4, 2))
        outer, _ = mpmd.distributed(step, mesh=mesh2).trace(params, opt.init(params), batch_of(rng))
        assert split_stages(analyse_loop_body(find_step_loop(outer))).num_stages == 4, model.__name__
    for model in (two_scans, nested, jitted_blocks):
        compare(mesh2, make_step(mse(model), opt, mpmd.InterleavedOneFOneB(4, 2)), (params, opt.init(params)),
                [batch_of(rng) for _ in range(2)])


def test_a_marker_taking_a_scans_stacked_outputs_or_per_layer_inputs_trains_like_jit(mesh2):
    """The per-layer hidden states a scan stacks, marked with the last state before a head that reads them all,
    and per-layer inputs made in stage 0, marked and scanned over: the marker was handed the unrolled scan's
    internal per-iteration list (TypeError 'interpreting argument to pipeline_yield'; the second in the
    backward pass only; found by a probe)."""
    rng = np.random.default_rng(6)
    w = lambda *s: (rng.standard_normal(s) / 3).astype(np.float32)  # noqa: E731
    params = {"enc": w(3, 8, 8), "head": w(8, 8), "emb": w(3, 8, 8)}

    def stacked_outputs(p, x):
        def body(h, w):
            h = mpmd.pipeline_yield(jnp.tanh(h @ w))
            return h, h
        h, hiddens = jax.lax.scan(body, x, p["enc"])
        h, hiddens = mpmd.pipeline_yield((h, hiddens))  # takes the place of the scan's last marker: 4 stages
        return (h + hiddens.mean(0)) @ p["head"]

    def per_layer_inputs(p, x):
        extra = mpmd.pipeline_yield(jnp.einsum("bi,lij->lbj", x, p["emb"]))  # stage 0 makes one input per layer
        h, _ = jax.lax.scan(lambda h, wx: (mpmd.pipeline_yield(jnp.tanh(h @ wx[0] + wx[1])), None), x, (p["enc"], extra))
        return h @ p["head"]

    opt = optax.adam(1e-2)
    for model in (stacked_outputs, per_layer_inputs):
        compare(mesh2, make_step(mse(model), opt, mpmd.InterleavedOneFOneB(4, 2)), (params, opt.init(params)),
                [batch_of(rng) for _ in range(2)])


def contiguous_two_per_actor(num_microbatches):
    """4 stages on 2 actors (stages 0, 1 on actor 0; 2, 3 on actor 1), forwards then backwards."""
    m = num_microbatches
    rows = []
    for stages in ((0, 1), (2, 3)):
        fwd = [f"{s}F{i}" for i in range(m) for s in stages]
        bwd = [f"{s}B{i}" for i in range(m) for s in reversed(stages)]
        rows.append(tuple(fwd + bwd))
    return mpmd.Custom(num_stages=4, order=tuple(rows), stage_actor=(0, 0, 1, 1))


def test_a_scanned_stack_of_four_stages_runs_on_two_actors_two_stages_each(mesh2):
    rng = np.random.default_rng(4)
    params = scan_params(rng)
    opt = optax.adam(1e-2)
    step = make_step(mse(scan_model), opt, contiguous_two_per_actor(3))
    compare(mesh2, step, (params, opt.init(params)), [batch_of(rng, m=3) for _ in range(2)])


def test_a_first_stage_without_parameters_has_no_backward_and_matches_jit(mesh4):
    """Stage 0 only preprocesses (fixed features): its output has no gradient, so no backward marker."""
    feats = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)

    def model(params, x):
        h = jnp.sin(x @ feats)  # stage 0: no parameters
        h = mpmd.pipeline_yield(h)
        h = jnp.tanh(h @ params[0]["w"] + params[0]["b"])
        h = mpmd.pipeline_yield(h)
        return h @ params[1]["w"] + params[1]["b"]

    rng = np.random.default_rng(6)
    params = mlp2(rng)
    opt = optax.adam(1e-2)
    compare(mesh4, make_step(mse(model), opt, mpmd.OneFOneB(3)), (params, opt.init(params)), [batch_of(rng) for _ in range(2)])


def test_a_frozen_scalar_under_stop_gradient_gets_a_zero_gradient_and_matches_jit(mesh2):
    def model(params, x):
        h = jnp.tanh(x @ params["s0"]["w"]) * jax.lax.stop_gradient(params["scale"])
        h = mpmd.pipeline_yield(h)
        return h @ params["s1"]["w"]

    rng = np.random.default_rng(7)
    p = mlp2(rng)
    params = {"s0": {"w": p[0]["w"]}, "s1": {"w": p[1]["w"]}, "scale": np.float32(1.5)}
    opt = optax.adam(1e-2)
    compare(mesh2, make_step(mse(model), opt, mpmd.GPipe(2)), (params, opt.init(params)), [batch_of(rng) for _ in range(2)])


def test_a_step_refuses_arrays_of_another_mesh_and_of_a_closed_mesh_naming_the_argument(mesh2):
    rng = np.random.default_rng(8)
    params = mlp2(rng)
    opt = optax.sgd(0.1)
    dist = mpmd.distributed(make_step(mse(lambda p, x: mpmd.pipeline_yield(jnp.tanh(x @ p[0]["w"])) @ p[1]["w"]), opt,
                                      mpmd.GPipe(2)), mesh=mesh2)
    batch = batch_of(rng)
    with mpmd.RemoteMesh.local(num_actors=2) as other:
        foreign = other.actor(1).put(params[1]["w"])
        bad = [dict(params[0]), {"w": foreign, "b": params[1]["b"]}]
        with pytest.raises(mpmd.MpmdError) as e:
            dist(bad, opt.init(params), batch)
        assert "args[0][1]['w']" in str(e.value) and repr(other) in str(e.value) and "mesh.adopt" in str(e.value)
        adopted = mesh2.adopt(bad)
        p, _, losses = dist(adopted, opt.init(params), batch)
        assert np.isfinite(losses.to_numpy()).all()
    with pytest.raises(mpmd.MpmdError, match=r"args\[0\]\[1\]\['w'\].*closed"):
        dist(bad, opt.init(params), batch)
    # a deleted array is named by its path too
    p[0]["w"].delete()
    with pytest.raises(mpmd.MpmdError, match=r"argument args\[0\]\[0\]\['w'\]: RemoteArray\(.*\) was deleted; its data is gone"):
        dist(p, opt.init(params), batch)


@pytest.mark.slow  # (moved out of the default run, 18.5 minutes on this VM on 2026-12-07: .ci/run runs it when time allows)
def test_a_step_called_after_its_mesh_closed_with_a_step_in_flight_says_the_mesh_is_closed():
    """The step in flight when the mesh closed failed because of the close: the next call says the mesh is
    closed (it raised that step's error instead — a bare CancelledError, or 'actor 0 died ... exited with code 0')."""
    rng = np.random.default_rng(9)
    params = mlp2(rng)
    opt = optax.sgd(0.1)
    batch = batch_of(rng)
    for _ in range(2):
        mesh = mpmd.RemoteMesh.local(num_actors=2)
        dist = mpmd.distributed(make_step(mse(lambda p, x: mpmd.pipeline_yield(jnp.tanh(x @ p[0]["w"])) @ p[1]["w"]), opt,
                                          mpmd.GPipe(2)), mesh=mesh)
        mpmd.fetch(dist(params, opt.init(params), batch))
        in_flight = dist(params, opt.init(params), batch)
        mesh.close()
        with pytest.raises(mpmd.MpmdError, match="RemoteMesh is closed"):
            dist(params, opt.init(params), batch)
        with pytest.raises(mpmd.MpmdError, match="closed"):
            mpmd.fetch(in_flight)


def test_nonsense_arguments_are_refused_up_front_naming_what_is_wrong(mesh2):
    """What users get wrong before anything runs: each gets an error naming the argument (they failed later, with
    internal errors: 'NoneType has no len()', a string taken for a one-actor mesh, ''str' has no attribute
    num_stages'...)."""
    rng = np.random.default_rng(10)
    params, batch = mlp2(rng), batch_of(rng)
    opt = optax.sgd(0.1)
    model = lambda p, x: mpmd.pipeline_yield(jnp.tanh(x @ p[0]["w"])) @ p[1]["w"]  # noqa: E731
    good = make_step(mse(model), opt, mpmd.GPipe(2))
    for mesh in (None, "x", 2):
        with pytest.raises(TypeError, match="needs the RemoteMesh"):
            mpmd.distributed(good, mesh=mesh)
    with pytest.raises(TypeError, match="must be a function"):
        mpmd.distributed(5, mesh=mesh2)
    for schedule, what in (("1f1b", "got str"), (mpmd.OneFOneB, "the class OneFOneB")):
        with pytest.raises(mpmd.PipelineError, match=what):
            mpmd.distributed(make_step(mse(model), opt, schedule), mesh=mesh2)(params, opt.init(params), batch)
    with pytest.raises(mpmd.PipelineError, match=r"192 of 192 have none \(batch\['x'\]\[0\]\[0\]\[0\]: shape \(\), .* \.\.\.\): .* \(a Python list in a batch"):
        mpmd.distributed(good, mesh=mesh2)(params, opt.init(params), {"x": batch["x"].tolist(), "y": batch["y"].tolist()})
    with pytest.raises(mpmd.PipelineError, match=r"args\[2\]\['x'\].*dtype=object"):
        mpmd.distributed(good, mesh=mesh2)(params, opt.init(params), {**batch, "x": np.array([object()] * 4)})
    for strings in (np.array(["double"]), np.array([b"ab", b"c"])):  # (traced as str192: wrong results, silently)
        with pytest.raises(mpmd.PipelineError, match=rf"args\[2\]\['mode'\].*dtype {strings.dtype}.*static argument"):
            mpmd.distributed(good, mesh=mesh2)(params, opt.init(params), {**batch, "mode": strings})
    def returns_an_object(params, opt_state, batch):
        return {"loss": good(params, opt_state, batch)[2], "note": object()}

    with pytest.raises(mpmd.PipelineError, match=r"returns_an_object returned <object.*at output\['note'\]"):
        mpmd.distributed(returns_an_object, mesh=mesh2)(params, opt.init(params), batch)
    for order in (None, "0F0", ("0F0", "0B0")):
        with pytest.raises(mpmd.ScheduleError, match="order"):
            mpmd.Custom(2, order=order)
    for kwargs, what in ((dict(schedules=[mpmd.OneFOneB]), "the class OneFOneB"), (dict(schedules="OneFOneB"), "non-empty list"),
                         (dict(schedules=[]), "non-empty list"), (dict(schedules=["Nope"]), "unknown schedule 'Nope'"),
                         (dict(memory_limit="lots"), "memory_limit"), (dict(memory_limit=-1), "memory_limit"),
                         (dict(microbatches=[0, 2]), "microbatches"), (dict(memory_limit=float("nan")), "memory_limit")):
        with pytest.raises(mpmd.PipelineError, match=what):
            mpmd.tune(good, params, opt.init(params), batch, mesh=mesh2, **kwargs)


def test_buffer_calls_on_a_closed_mesh_raise_and_leave_no_coroutine_unawaited():
    """put, put_async, get_buffers and wait_buffers on a closed mesh raised the right error, and Python then warned
    "coroutine 'ActorConnection.request' was never awaited" for each request they had made (found by a probe)."""
    import asyncio
    import gc
    import warnings

    mesh = mpmd.RemoteMesh.local(num_actors=2)
    mesh.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in (lambda: mesh.actor(0).put(np.ones(3, np.float32)),
                     lambda: asyncio.run(mesh.actor(0).put_async(np.ones(3, np.float32))),
                     lambda: mesh.get_buffers({0: [1]}), lambda: mesh.wait_buffers({0: [1], 1: [2]})):
            with pytest.raises(mpmd.MpmdError, match="RemoteMesh is closed"):
                call()
            gc.collect()
    assert not [str(w.message) for w in caught if "never awaited" in str(w.message)]


def _bf16_grads(p, b, schedule):
    """Gradients and losses of a 2-stage bf16 model whose loss is computed in float32."""
    def mbf(mb):
        def loss(p):
            h = mpmd.pipeline_yield(jnp.tanh(mb @ p[0]))
            return jnp.mean((h @ p[1]).astype(jnp.float32) ** 2)
        l, g = jax.value_and_grad(loss)(p)
        return g, l
    return mpmd.accumulate_grads(mbf, b, schedule=schedule)


def test_a_python_number_argument_is_weakly_typed_as_under_jit(mesh2):
    """`w - lr * g` with a Python float `lr` keeps bf16 weights bf16 under jax.jit (a Python number is weakly
    typed); a numpy float32 `lr` is not weak and promotes them to float32. The step must do the same and
    compile the two apart (they give different programs)."""
    def step(p, b, lr):
        g, l = _bf16_grads(p, b, mpmd.GPipe(2))
        return [w - lr * gw for w, gw in zip(p, g)], l

    p = [jnp.full((4, 4), 0.1, jnp.bfloat16), jnp.full((4, 2), 0.1, jnp.bfloat16)]
    b = jnp.ones((2, 3, 4), jnp.bfloat16)
    dist = mpmd.distributed(step, mesh=mesh2)
    for lr in (0.1, np.float32(0.1), jnp.asarray(0.1), jnp.float32(0.1)):
        ref = jax.jit(step)(p, b, lr)
        out = mpmd.fetch(dist(p, b, lr))
        assert [w.dtype for w in out[0]] == [w.dtype for w in ref[0]], type(lr)
        assert_trees_close(out, ref)
    assert [w.dtype for w in ref[0]] == [jnp.float32] * 2 and len(dist._compiled) == 2  # weak bf16, strong f32


def test_a_weakly_typed_output_fed_back_stays_weak_as_under_jit(mesh2):
    """A step returning `lr * 0.99` of a Python-float lr: jax.jit's output is weak, so the next step's
    `w - lr * g` keeps bf16 weights bf16. The RemoteArray handed back must be weak too (it came back strong
    float32, and the weights turned float32 from the second step on)."""
    def step(p, lr, b):
        g, _ = _bf16_grads(p, b, mpmd.OneFOneB(2))
        return [w - lr * gw for w, gw in zip(p, g)], lr * 0.99, lr * jnp.float32(2)

    p = [jnp.full((4, 4), 0.1, jnp.bfloat16), jnp.full((4, 2), 0.1, jnp.bfloat16)]
    b = jnp.ones((2, 3, 4), jnp.bfloat16)
    dist = mpmd.distributed(step, mesh=mesh2)
    r = d = (p, 0.1)
    for _ in range(3):
        ref, out = jax.jit(step)(*r, b), dist(*d, b)
        assert [x.weak_type for x in out[1:]] == [x.weak_type for x in ref[1:]] == [True, False]
        got = mpmd.fetch(out)
        assert [w.dtype for w in got[0]] == [w.dtype for w in ref[0]] == [jnp.bfloat16] * 2
        assert_trees_close(got, ref)
        r, d = ref[:2], out[:2]


def test_a_python_int_argument_past_int32_raises_overflow_as_under_jit(mesh2):
    def step(b, offset):
        g, _ = mpmd.accumulate_grads(lambda mb: jax.value_and_grad(lambda w: mpmd.pipeline_yield(mb * w).sum())(1.0)[::-1], b,
                                     schedule=mpmd.GPipe(2))
        return g + offset

    b = np.ones((2, 3), np.float32)
    with pytest.raises(OverflowError):
        jax.jit(step)(b, 2**31 + 5)
    with pytest.raises(OverflowError, match=r"argument args\[1\]: the Python int 2147483653 does not fit in int32"):
        mpmd.distributed(step, mesh=mesh2)(b, 2**31 + 5)
    np.testing.assert_allclose(mpmd.fetch(mpmd.distributed(step, mesh=mesh2)(b, 2**31 - 1)), jax.jit(step)(b, 2**31 - 1))


def test_allow_int_gradients_of_an_int_leaf_run_under_jit_and_on_the_actors_alike(mesh2):
    """`jax.value_and_grad(..., allow_int=True)` gives an int leaf a float0 'gradient': the undecorated step
    (the reference, under jax.jit) must accept it like the pipeline does, not try to add float0 arrays."""
    def step(p, b):
        def mbf(mb):
            def loss(p):
                h = mpmd.pipeline_yield(jnp.tanh(mb @ p["w0"]) * p["n"])
                return jnp.mean((h @ p["w1"]) ** 2)
            l, g = jax.value_and_grad(loss, allow_int=True)(p)
            return g, l
        g, l = mpmd.accumulate_grads(mbf, b, schedule=mpmd.GPipe(2))
        return g["w0"], g["w1"], l

    p = {"w0": jnp.full((4, 4), 0.1), "w1": jnp.full((4, 2), 0.1), "n": jnp.array(3, jnp.int32)}
    b = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2, 4)), jnp.float32)
    ref = jax.jit(step)(p, b)
    assert_trees_close(mpmd.fetch(mpmd.distributed(step, mesh=mesh2)(p, b)), ref)
    g_int = jax.jit(lambda p, b: mpmd.accumulate_grads(
        lambda mb: (jax.grad(lambda p: jnp.sum(mb @ p["w0"]) * p["n"], allow_int=True)(p), ()), b, schedule=mpmd.GPipe(1))[0])(p, b)
    assert g_int["n"].dtype == jax.dtypes.float0 and g_int["n"].shape == ()


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_donated_state_trains_like_jit_and_is_freed_on_the_actors(mesh2, how):
    """`mpmd.distributed(step, donate_argnums=(0, 1))`, as users write jax.jit: the same values as jax.jit, the
    donated RemoteArrays deleted (reading one raises, as a donated jax.Array does), and the actors' buffer count
    flat across steps while the caller still holds every old state (without donation it grows each step)."""
    from tests.wire import wait_until

    rng = np.random.default_rng(5)
    params = [{"w": rng.normal(size=(8, 8)).astype(np.float32) * 0.3} for _ in range(2)]
    batch = rng.normal(size=(4, 3, 8)).astype(np.float32)
    opt = optax.adam(1e-2)

    def step(params, opt_state, batch):
        def mbf(mb):
            def loss(p):
                return jnp.mean(mpmd.pipeline_yield(jnp.tanh(mb @ p[0]["w"])) @ p[1]["w"] ** 2)
            v, g = jax.value_and_grad(loss)(params)
            return g, v
        g, losses = mpmd.accumulate_grads(mbf, batch, schedule=mpmd.OneFOneB(2))
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    donate = {"donate_argnums": (0, 1)} if how == "argnums" else {"donate_argnames": ("params", "opt_state")}
    dist = mpmd.distributed(step, mesh=mesh2, **donate)
    ref = jax.jit(step)
    r = d = (params, opt.init(params))
    held, counts = [], []
    for i in range(4):
        r_out, d_out = ref(*r, batch), dist(*d, batch)
        assert_trees_close(mpmd.fetch(d_out), r_out)
        if i:
            assert all(x.is_deleted() for x in jax.tree.leaves(d)), "the donated state must be deleted"
            held.append(d)  # the caller keeps the old state objects: donation freed them all the same
        counts.append(sum(mesh2.actor(a).stats()["buffers"] for a in (0, 1)))
        r, d = r_out[:2], d_out[:2]
    # (frees are asynchronous: wait for them) the state of one step, not of four: nothing held grew it
    assert wait_until(lambda: sum(mesh2.actor(a).stats()["buffers"] for a in (0, 1)) <= counts[0], 10), counts
    with pytest.raises(mpmd.MpmdError, match=r"was donated to step \(donate_argnums\)"):
        mpmd.fetch(held[0])
    with pytest.raises(mpmd.PipelineError, match="donate_argnames names 'parms'"):
        mpmd.distributed(step, mesh=mesh2, donate_argnames="parms")
