"""SPMD inside every actor: each stage runs sharded over its actor's device mesh exactly as jax.jit would on a
single-process mesh of the same shape (the test process has 4 host devices, see conftest.py)."""

import functools
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd
from mpmd.compiler.program import Run, Send
from mpmd.testing import make_train_step
from tests.test_pipeline import assert_trees_close


def reference(loss, opt, params, specs, batches, shape, batch_spec=None):
    """jax.jit of the undecorated step on a mesh of the per-actor shape in this process."""
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        step = jax.jit(make_train_step(loss, opt, None))
        p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
        o = opt.init(p)
        losses = []
        for b in batches:
            if batch_spec is not None:
                b = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, batch_spec)), b)
            p, o, loss_value = step(p, o, b)
            losses.append(np.asarray(loss_value))
    return jax.device_get(p), jax.device_get(o), losses


def run_mpmd(mesh, loss, opt, params, specs, batches, schedule, batch_spec=None):
    step = mpmd.distributed(make_train_step(loss, opt, schedule), mesh=mesh, in_shardings=(specs, None, batch_spec))
    p, o = params, opt.init(params)
    losses = []
    for i, b in enumerate(batches):
        if i == 1:  # from now on the arguments are the step's own outputs, in the layouts they came out in
            step = mpmd.distributed(make_train_step(loss, opt, schedule), mesh=mesh, in_shardings=(None, None, batch_spec))
        p, o, loss_value = step(p, o, b)
        losses.append(loss_value)
    return step, p, o, [x.to_numpy() for x in losses]


def megatron(params, x):
    """Per stage: a column-parallel then a row-parallel matmul (Megatron's MLP); the boundary is sharded."""
    h = jnp.tanh(x @ params[0]["w1"])
    h = jax.lax.with_sharding_constraint(h, P("data", None, "model"))
    h = mpmd.pipeline_yield(h)  # a sharded activation crosses: half on each device
    x = h @ params[0]["w2"]
    h = jnp.tanh(x @ params[1]["w1"])
    return h @ params[1]["w2"]


def megatron_params(rng, d=16, f=32):
    return [{"w1": (rng.standard_normal((d, f)) / 4).astype(np.float32), "w2": (rng.standard_normal((f, d)) / 6).astype(np.float32)}
            for _ in range(2)]


MEGATRON_SPECS = [{"w1": P(None, "model"), "w2": P("model", None)} for _ in range(2)]


def mse(model):
    return lambda p, mb: jnp.mean((model(p, mb["x"]) - mb["y"]) ** 2)


def batch_of(rng, m=4, b=8, d=16):
    return {"x": rng.standard_normal((m, b, 4, d)).astype(np.float32), "y": rng.standard_normal((m, b, 4, d)).astype(np.float32)}


@pytest.fixture(scope="module")
def mesh_1x2():
    with mpmd.RemoteMesh.local(num_actors=2, devices_per_actor=2, mesh_shape=(1, 2), axis_names=("data", "model")) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def mesh_2x2():
    with mpmd.RemoteMesh.local(num_actors=2, devices_per_actor=4, mesh_shape=(2, 2), axis_names=("data", "model")) as mesh:
        yield mesh


def test_megatron_mlp_on_two_actors_of_two_devices_equals_jit_on_a_1x2_mesh(mesh_1x2):
    rng = np.random.default_rng(0)
    params = megatron_params(rng)
    opt = optax.adamw(1e-2)
    batches = [batch_of(rng) for _ in range(3)]
    rp, ro, rl = reference(mse(megatron), opt, params, MEGATRON_SPECS, batches, (1, 2))
    step, p, o, losses = run_mpmd(mesh_1x2, mse(megatron), opt, params, MEGATRON_SPECS, batches, mpmd.OneFOneB(2))
    for a, b in zip(losses, rl):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert_trees_close(mpmd.fetch(p), rp)
    assert_trees_close(mpmd.fetch(o), ro)
    # parameters keep their layout across steps, and each device holds half of a sharded one
    assert p[0]["w1"].sharding.spec == P(None, "model") and p[1]["w2"].sharding.layout == ("model",)
    assert p[0]["w1"].actors == [0] and p[1]["w1"].actors == [1]


@pytest.mark.parametrize("caller_shape", [(1, 2), (2, 2), (4,)])
def test_a_step_called_under_the_callers_own_jax_set_mesh_equals_jit(mesh_1x2, caller_shape):
    """Code written for jax.jit runs inside `with jax.set_mesh(mesh)`; the step traced and exported under that
    mesh, so its executables were sized for the caller's devices and the actors refused them ("exported for 2
    devices and is called in a context with 1 devices"), or tracing failed in JAX ("use_abstract_mesh cannot
    change the size of the mesh"; found by a probe). The step runs on its actors' meshes whatever the caller set."""
    rng = np.random.default_rng(0)
    params = megatron_params(rng)
    opt = optax.sgd(0.1)
    batches = [batch_of(rng)]
    rp, ro, rl = reference(mse(megatron), opt, params, MEGATRON_SPECS, batches, (1, 2))
    names = ("data", "model")[: len(caller_shape)] if len(caller_shape) == 2 else ("x",)
    caller = jax.make_mesh(caller_shape, names, axis_types=(AxisType.Auto,) * len(caller_shape))
    with jax.set_mesh(caller):
        step = mpmd.distributed(make_train_step(mse(megatron), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2, in_shardings=(MEGATRON_SPECS, None, None))
        p, o, loss = step(params, opt.init(params), batches[0])
        np.testing.assert_allclose(loss.to_numpy(), rl[0], rtol=1e-5)
    assert_trees_close(mpmd.fetch(p), rp)


def _constrain(how, h, sharding):
    if how == "constraint":
        return jax.lax.with_sharding_constraint(h, sharding)
    return jax.device_put((h, h), (sharding, jax.devices()[0]))[0]  # (two operands, one equation; one a device)


@pytest.mark.parametrize("how", ["constraint", "device_put"])
def test_a_sharding_constraint_over_a_concrete_jax_mesh_of_the_actors_shape_equals_jit_and_another_mesh_is_refused(mesh_1x2, how):
    """`with_sharding_constraint(h, NamedSharding(mesh, spec))` with a jax Mesh of this process, as jax.jit code
    writes it: the export pinned the caller's device count and the actors refused the executable (a probe).
    Over a mesh of the actors' shape and names it is rebound to their mesh; another mesh is a clear error. The same
    for `jax.device_put(h, NamedSharding(mesh, spec))` (inside jax.jit a no-op, its layout left to XLA), in a stage or
    in a function given to mesh.actor(i).run (the actor refused it: "exported for 2 devices and is called in a context
    with 1"; a probe), also beside a target that is a device."""
    rng = np.random.default_rng(0)
    params = megatron_params(rng)
    opt = optax.sgd(0.1)
    batches = [batch_of(rng)]
    rp, ro, rl = reference(mse(megatron), opt, params, MEGATRON_SPECS, batches, (1, 2))

    def model_over(mesh):
        def model(params, x):
            h = jnp.tanh(x @ params[0]["w1"])
            h = _constrain(how, h, NamedSharding(mesh, P("data", None, "model")))
            x = mpmd.pipeline_yield(h) @ params[0]["w2"]
            return jnp.tanh(x @ params[1]["w1"]) @ params[1]["w2"]
        return model

    same = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    step = mpmd.distributed(make_train_step(mse(model_over(same)), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2,
                            in_shardings=(MEGATRON_SPECS, None, None))
    p, o, loss = step(params, opt.init(params), batches[0])
    np.testing.assert_allclose(loss.to_numpy(), rl[0], rtol=1e-5)
    assert_trees_close(mpmd.fetch(p), rp)
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    y = mesh_1x2.actor(0).run(jax.jit(lambda a: _constrain(how, a * 2, NamedSharding(same, P(None, "model")))), x)
    np.testing.assert_array_equal(y.to_numpy(), x * 2)
    other = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    step = mpmd.distributed(make_train_step(mse(model_over(other)), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2)
    said = "with_sharding_constraint" if how == "constraint" else "jax.device_put"  # (advice: what works in a step)
    with pytest.raises(mpmd.PipelineError, match=rf"{said}\(x, NamedSharding\(mesh, .*uses a jax Mesh of shape \(2, 2\) .*\(a mesh "
                                                 r"of shape \(1, 2\) .*write .*with_sharding_constraint\(x, P\('data', None, 'model'\)\)"):
        step(params, opt.init(params), batches[0])


def test_a_shard_map_in_a_stage_equals_jit_with_a_concrete_mesh_of_the_actors_shape_or_none_and_another_is_refused(mesh_1x2):
    """`jax.shard_map(f, mesh=mesh, ...)` with a jax Mesh of this process, as jax.jit code writes it, failed to
    trace: the step traced under the actors' abstract mesh, which lacked the device kind a concrete Mesh's has, and
    shard_map checks that its mesh is the context's (JAX's "The context mesh ... should match the mesh passed to
    shard_map"). A mesh of the actors' shape and names now runs on their mesh, as does a shard_map without mesh=
    (against jax.jit under `jax.set_mesh`); another mesh is a clear error before anything runs."""
    rng = np.random.default_rng(1)
    params = megatron_params(rng)
    opt = optax.sgd(0.1)
    batches = [batch_of(rng)]
    same = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def model_over(mesh):
        def row_parallel(h, w):  # each device: its half of the hidden units, summed over the "model" axis
            return jax.lax.psum(h @ w, "model")

        def model(params, x):
            h = jnp.tanh(x @ params[0]["w1"])
            x = jax.shard_map(row_parallel, **({} if mesh is None else {"mesh": mesh}), in_specs=(P(None, None, "model"), P("model", None)),
                              out_specs=P())(h, params[0]["w2"])
            x = mpmd.pipeline_yield(x)
            return jnp.tanh(x @ params[1]["w1"]) @ params[1]["w2"]
        return model

    for mesh in (same, None):
        with jax.set_mesh(same):  # (jax.jit needs it for the shard_map without mesh=; the step ignores it)
            rp, ro, rl = reference(mse(model_over(mesh)), opt, params, MEGATRON_SPECS, batches, (1, 2))
        step = mpmd.distributed(make_train_step(mse(model_over(mesh)), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2,
                                in_shardings=(MEGATRON_SPECS, None, None))
        p, o, loss = step(params, opt.init(params), batches[0])
        np.testing.assert_allclose(loss.to_numpy(), rl[0], rtol=1e-5)
        assert_trees_close(mpmd.fetch(p), rp)
    for other in (Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
                  Mesh(np.array(jax.devices()[:2]).reshape(2), ("model",), axis_types=(AxisType.Auto,))):
        step = mpmd.distributed(make_train_step(mse(model_over(other)), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2)
        with pytest.raises(mpmd.PipelineError, match=r"shard_map.* jax Mesh .*actors' mesh of shape \(1, 2\).*without mesh="):
            step(params, opt.init(params), batches[0])


def test_a_shard_map_over_a_concrete_mesh_is_refused_for_one_device_actors():
    """One-device actors cannot run a shard_map over two devices: an error naming the mesh, before anything runs."""
    two = Mesh(np.array(jax.devices()[:2]).reshape(2), ("model",), axis_types=(AxisType.Auto,))
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        def loss(params, mb):
            h = jax.shard_map(lambda a: a * 2, mesh=two, in_specs=P("model"), out_specs=P("model"))(mb["x"] @ params[0])
            return jnp.mean((mpmd.pipeline_yield(h) @ params[1] - mb["y"]) ** 2)

        step = mpmd.distributed(make_train_step(loss, optax.sgd(0.1), mpmd.GPipe(2)), mesh=mesh)
        params = [np.ones((4, 4), np.float32), np.ones((4, 2), np.float32)]
        batch = {"x": np.ones((2, 4, 4), np.float32), "y": np.ones((2, 4, 2), np.float32)}
        with pytest.raises(mpmd.PipelineError, match=r"shard_map\(f, mesh=mesh, \.\.\.\) in the step uses a jax Mesh of shape \(2,\).*one device each"):
            step(params, optax.sgd(0.1).init(params), batch)


def test_accumulate_grads_under_jax_jit_on_a_mesh_of_explicit_axes_sums_as_its_loop():
    """The undecorated step is its own reference: under jax.jit on `jax.make_mesh`'s default (Explicit axes) a
    sharded parameter's gradient type carries its sharding (`float32[16,32@model]`), and the loop's zero sums did
    not, so lax.scan refused the carry (a probe). The sums keep the gradient's sharding and equal a Python loop's."""
    mesh = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    w = jax.device_put(rng.standard_normal((16, 32)).astype(np.float32), NamedSharding(mesh, P(None, "model")))
    batch = rng.standard_normal((4, 8, 16)).astype(np.float32)

    def grads_of(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    def step(w, batch):
        return mpmd.accumulate_grads(lambda x: (grads_of(w, x), jnp.sum(x)), batch, schedule=mpmd.GPipe(1))

    with jax.set_mesh(mesh):
        g, sums = jax.jit(step)(w, batch)
        want = functools.reduce(lambda a, b: a + b, [jax.jit(grads_of)(w, batch[i]) for i in range(4)])
    assert g.sharding.spec == P(None, "model")
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(sums), np.stack([np.asarray(jax.jit(jnp.sum)(x)) for x in batch]))


def test_one_device_actors_run_a_model_with_bare_spec_constraints_called_under_the_callers_mesh():
    """A tensor-parallel model (`with_sharding_constraint(h, P('data', None, 'model'))`) called under the caller's
    `jax.set_mesh` works under jax.jit; on one-device actors it failed in JAX ("requires a non-empty mesh in
    context": a probe restoring a tensor-parallel checkpoint onto them). It now traces over the caller's axes,
    each of size 1, and equals jax.jit."""
    rng = np.random.default_rng(0)
    params = megatron_params(rng)
    opt = optax.sgd(0.1)
    batches = [batch_of(rng)]
    rp, ro, rl = reference(mse(megatron), opt, params, MEGATRON_SPECS, batches, (1, 1))
    caller = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with mpmd.RemoteMesh.local(num_actors=2) as mesh, jax.set_mesh(caller):
        step = mpmd.distributed(make_train_step(mse(megatron), opt, mpmd.OneFOneB(2)), mesh=mesh)
        p, o, loss = step(params, opt.init(params), batches[0])
        np.testing.assert_allclose(loss.to_numpy(), rl[0], rtol=1e-5)
        assert_trees_close(mpmd.fetch(p), rp)


def test_explicit_sharding_in_a_stage_is_refused_saying_to_write_a_sharding_constraint(mesh_1x2):
    """Actors build their meshes with automatic axes: `jax.sharding.reshard` (Explicit axes) in a stage raised
    JAX's "cannot contain axis names that are of type Auto"; now an error that says what to write instead."""
    def model(params, x):
        h = jax.sharding.reshard(jnp.tanh(x @ params[0]["w1"]), P(None, None, "model"))
        return jnp.tanh(mpmd.pipeline_yield(h) @ params[0]["w2"] @ params[1]["w1"]) @ params[1]["w2"]

    rng = np.random.default_rng(0)
    params = megatron_params(rng)
    step = mpmd.distributed(make_train_step(mse(model), optax.sgd(0.1), mpmd.OneFOneB(2)), mesh=mesh_1x2)
    with pytest.raises(mpmd.PipelineError, match=r"explicit sharding in the step .*reshard.*write jax.lax.with_sharding_constraint"):
        step(params, optax.sgd(0.1).init(params), batch_of(rng))


def test_a_constraint_over_a_one_device_mesh_is_kept_for_one_device_actors():
    """jax.jit code on a one-device machine may constrain over a 1-device Mesh: it pins nothing one-device
    actors lack, and was refused by the rebinding (a review)."""
    from mpmd.compiler.lowering import rebind_constraints

    one = Mesh(np.array(jax.devices()[:1]).reshape(1), ("x",))
    closed = jax.make_jaxpr(lambda a: jax.lax.with_sharding_constraint(a * 2, NamedSharding(one, P("x"))))(np.ones(4, np.float32))
    assert rebind_constraints(closed, None) is closed


def test_a_host_jax_array_keeps_its_sharding_without_in_shardings_as_under_jit(mesh_1x2):
    """Parameters the user sharded with jax.device_put(NamedSharding(mesh like the actors', spec)) were placed
    replicated when the step had no in_shardings (found by a probe): as jax.jit does, they keep their layout."""
    rng = np.random.default_rng(3)
    params = megatron_params(rng)
    opt = optax.adamw(1e-2)
    batches = [batch_of(rng)]
    rp, ro, rl = reference(mse(megatron), opt, params, MEGATRON_SPECS, batches, (1, 2))
    local = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    held = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(local, s)), params, MEGATRON_SPECS)
    step = mpmd.distributed(make_train_step(mse(megatron), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2)
    p, o, losses = step(held, opt.init(held), batches[0])
    assert p[0]["w1"].sharding.spec == P(None, "model") and p[1]["w2"].sharding.layout == ("model",)
    np.testing.assert_allclose(losses.to_numpy(), rl[0], rtol=1e-5)
    assert_trees_close(mpmd.fetch(p), rp)
    assert_trees_close(mpmd.fetch(o), ro)
    # ... and one committed with another sharding than in_shardings asks is refused, as jax.jit refuses it (it was
    # re-laid out silently: a probe)
    w = held[0]["w1"]
    asked = P("model", None)
    with pytest.raises(ValueError, match="does not match the sharding"):
        jax.jit(lambda a: a * 2, in_shardings=NamedSharding(local, asked))(w)
    one = mpmd.distributed(lambda a, b: mpmd.accumulate_grads(lambda mb: (a * mb.sum(), mb), b, schedule=mpmd.GPipe(1)),
                           mesh=mesh_1x2, in_shardings=(asked, None))
    with pytest.raises(mpmd.PipelineError, match=r"laid out as P\(None, 'model'\) \(a committed jax.Array\) but in_shardings "
                       r"asks for P\('model', None\).*as jax.jit refuses a committed array of another sharding"):
        one(w, np.ones((2, 3), np.float32))
    replicated = jax.device_put(np.asarray(w), NamedSharding(local, P()))
    with pytest.raises(ValueError, match="does not match the sharding"):
        jax.jit(lambda a: a * 2, in_shardings=NamedSharding(local, asked))(replicated)
    with pytest.raises(mpmd.PipelineError, match=r"laid out as P\(\) \(a committed jax.Array\) but in_shardings asks"):
        one(replicated, np.ones((2, 3), np.float32))
    # one committed to a single device of this process is host data to the actors: laid out as asked
    single = jax.device_put(np.asarray(w), jax.devices()[0])
    grads, _ = one(single, np.ones((2, 3), np.float32))
    assert grads.sharding.layout == ("model",)
    np.testing.assert_allclose(grads.to_numpy(), np.asarray(w) * 3 * 2, rtol=1e-6)


def test_data_and_tensor_parallel_mlp_on_two_actors_of_four_devices_equals_jit_on_a_2x2_mesh(mesh_2x2):
    rng = np.random.default_rng(1)
    params = megatron_params(rng)
    opt = optax.adamw(1e-2)
    batches = [batch_of(rng) for _ in range(3)]
    spec = P(None, "data")  # [microbatch, batch, ...]: the batch axis over "data"
    rp, ro, rl = reference(mse(megatron), opt, params, MEGATRON_SPECS, batches, (2, 2), spec)
    _, p, o, losses = run_mpmd(mesh_2x2, mse(megatron), opt, params, MEGATRON_SPECS, batches, mpmd.GPipe(2), spec)
    for a, b in zip(losses, rl):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert_trees_close(mpmd.fetch(p), rp)
    assert_trees_close(mpmd.fetch(o), ro)


def attention_block(p, x, heads):
    b, t, d = x.shape
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[n]) for n in ("q", "k", "v"))
    q = jax.lax.with_sharding_constraint(q, P("data", None, "model", None))  # heads over "model"
    att = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(d // heads)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    out = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(att, -1), v)
    return x + jnp.einsum("bthk,hkd->btd", out, p["o"])


def test_a_transformer_stage_with_attention_heads_sharded_equals_jit(mesh_2x2):
    rng = np.random.default_rng(2)
    d, heads = 16, 4
    params = [{n: (rng.standard_normal((d, heads, d // heads)) / 4).astype(np.float32) for n in "qkv"} for _ in range(2)]
    for s in params:
        s["o"] = (rng.standard_normal((heads, d // heads, d)) / 4).astype(np.float32)
    specs = [{"q": P(None, "model"), "k": P(None, "model"), "v": P(None, "model"), "o": P("model")} for _ in range(2)]

    def model(p, x):
        x = attention_block(p[0], x, heads)
        x = mpmd.pipeline_yield(x)
        return attention_block(p[1], x, heads)

    def loss(p, mb):
        return jnp.mean((model(p, mb["x"]) - mb["y"]) ** 2)

    opt = optax.adamw(1e-2)
    batches = [{"x": rng.standard_normal((4, 2, 8, d)).astype(np.float32), "y": rng.standard_normal((4, 2, 8, d)).astype(np.float32)}
               for _ in range(2)]
    spec = P(None, "data")
    rp, ro, rl = reference(loss, opt, params, specs, batches, (2, 2), spec)
    _, p, o, losses = run_mpmd(mesh_2x2, loss, opt, params, specs, batches, mpmd.OneFOneB(2), spec)
    for a, b in zip(losses, rl):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert_trees_close(mpmd.fetch(p), rp)


def test_the_row_parallel_matmul_holds_an_all_reduce_and_devices_hold_their_shard(mesh_1x2):
    rng = np.random.default_rng(3)
    params = megatron_params(rng)
    opt = optax.sgd(0.1)
    step = mpmd.distributed(make_train_step(mse(megatron), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2,
                            in_shardings=(MEGATRON_SPECS, None, None))
    batch = batch_of(rng)
    compiled = step.compile(params, opt.init(params), batch)
    # the executable of stage 1's forward+backward (actor 1) contracts over the "model" axis: an all-reduce
    prog = compiled.loaded[1]
    run = next(i for i in prog.instructions if isinstance(i, Run) and any(t.stage == 1 and t.kind == "F" for t in i.label.tasks))
    text = mesh_1x2.actor(1).hlo(prog.executables[run.exe])
    assert "all-reduce" in text
    before = mesh_1x2.actor(0).stats()
    p, o, loss_value = step(params, opt.init(params), batch)
    loss_value.block_until_ready()
    w1 = p[0]["w1"]
    after = mesh_1x2.actor(0).stats()
    # w1 is [16, 32] float32 split over 2 devices along its second axis
    assert w1.sharding.layout == (None, "model")
    assert [b - a for a, b in zip(before["device_bytes"], after["device_bytes"])][0] >= 16 * 16 * 4
    # the sharded activation went shard by shard: per microbatch 2 sends of half its bytes
    sends = [i for i in compiled.loaded[0].instructions if isinstance(i, Send)]
    sent = after["p2p"]["sent_arrays"] - before["p2p"]["sent_arrays"]
    assert sent == 2 * len(sends)
    shm_bytes = after["p2p"].get("sent_shm_bytes", 0) - before["p2p"].get("sent_shm_bytes", 0)
    assert shm_bytes == len(sends) * 8 * 4 * 32 * 4  # each activation: [8, 4, 32] float32, in two halves
    np.testing.assert_allclose(loss_value.to_numpy(), reference(mse(megatron), opt, params, MEGATRON_SPECS, [batch], (1, 2))[2][0],
                               rtol=1e-5)


def test_layout_errors_name_the_argument_and_what_to_do(mesh_1x2):
    rng = np.random.default_rng(4)
    params = megatron_params(rng)
    opt = optax.sgd(0.1)
    batch = batch_of(rng)
    bad_axis = [{"w1": P(None, "tensor"), "w2": P("model", None)}, MEGATRON_SPECS[1]]
    step = mpmd.distributed(make_train_step(mse(megatron), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2, in_shardings=(bad_axis, None, None))
    with pytest.raises(mpmd.MpmdError, match=r"args\[0\]\[0\]\['w1'\].*names axis 'tensor'.*\('data', 'model'\)"):
        step(params, opt.init(params), batch)
    odd = megatron_params(rng, f=33)
    step = mpmd.distributed(make_train_step(mse(megatron), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2,
                            in_shardings=(MEGATRON_SPECS, None, None))
    with pytest.raises(mpmd.MpmdError, match=r"size 33 is split over model = 2 devices"):
        step(odd, opt.init(odd), batch)
    step = mpmd.distributed(make_train_step(mse(megatron), opt, mpmd.OneFOneB(2)), mesh=mesh_1x2,
                            in_shardings=([{"w1": P()}, {"w1": P()}], None, None))
    with pytest.raises(mpmd.MpmdError, match=r"in_shardings is not a prefix of the arguments.* at args\[0\]\[0\]") as e:
        step(params, opt.init(params), batch)
    assert len(str(e.value)) < 500 and "array(" not in str(e.value)
    # RemoteMesh.local says what is wrong with its mesh arguments before it starts any daemon (it took 3-4 s: a probe)
    for kw, want in [({"devices_per_actor": 2, "mesh_shape": (2, 2), "axis_names": ("data", "model")},
                      r"mesh_shape \(2, 2\) needs 4 devices per actor, but devices_per_actor is 2"),
                     ({"devices_per_actor": 2, "mesh_shape": (2,), "axis_names": ("a", "b")}, "differ in length"),
                     ({"devices_per_actor": 2, "mesh_shape": (1, 2), "axis_names": ("a", "a")}, "distinct"),
                     ({"devices_per_actor": 2, "axis_names": ("a",)}, "axis_names needs mesh_shape")]:
        t = time.monotonic()
        with pytest.raises((ValueError, mpmd.MpmdError), match=want):
            mpmd.RemoteMesh.local(num_actors=1, **kw)
        assert time.monotonic() - t < 0.5


def test_an_in_shardings_tree_that_is_not_a_prefix_gets_a_short_error_naming_where_it_differs():
    """The error quoted jax's flatten_up_to text, which holds the repr of every array of the argument: 28 KB
    for 100 arrays of 64x64 (found by a probe). It must name where the trees part and how, in a few lines."""
    from mpmd.runtime.sharding import tree_specs

    params = [{f"w{i}": np.zeros((64, 64), np.float32) for i in range(50)} for _ in range(2)]
    args = (params, {}, {"x": np.ones((2, 4, 64), np.float32)})
    cases = [(([{"w0": P()}], None, None), r"at args\[0\], in_shardings has a list of 1 .* the arguments have a list of 2"),
             (([{"w0": P()}, {"w0": P()}], None, None),
              r"at args\[0\]\[0\], in_shardings has a dict of 1 \(\['w0'\]\) .* a dict of 50 \(\['w0'\], \['w1'\], "),
             ((None, None), r"at args, in_shardings has a tuple of 2 .* a tuple of 3")]
    for specs, want in cases:
        with pytest.raises(mpmd.MpmdError, match=r"in_shardings is not a prefix of the arguments' tree: " + want) as e:
            tree_specs(specs, args, "in_shardings")
        assert len(str(e.value)) < 500 and "array(" not in str(e.value)
    with pytest.raises(mpmd.MpmdError, match=r"out_shardings is not a prefix of the outputs' tree: at outputs, "):
        tree_specs((P(), P()), (np.ones(3),), "out_shardings")
    # a prefix still expands to one spec per leaf; one per positional argument may come as a list, as jax.jit takes it
    assert tree_specs(([None, {f"w{i}": P() for i in range(50)}], None, None), args, "in_shardings") == [None] * 50 + [P()] * 50 + [None]
    assert tree_specs([None, None, P("data")], args, "in_shardings") == [None] * 100 + [P("data")]
    # where jax's text says what it got (the arguments' arrays), the error stops before it (a probe: "Expected list,
    # got ([{'w1': array([[ 3.14e-02, ...")
    with pytest.raises(mpmd.MpmdError, match=r"at args\[1\], in_shardings has a list of 1 .* \(Expected list\); give") as e:
        tree_specs((None, [P()], None), (params, ({"a": np.zeros(3)}, np.zeros(2)), None), "in_shardings")
    assert "rray(" not in str(e.value), str(e.value)


def test_an_unconstrained_or_malformed_spec_entry_in_in_shardings_is_refused_naming_the_leaf():
    """P.UNCONSTRAINED gave a bare TypeError ('UnconstrainedSingleton' object is not iterable; a probe)."""
    from mpmd.runtime.sharding import ActorMesh

    am = ActorMesh((1, 2), ("data", "model"))
    with pytest.raises(mpmd.MpmdError, match=r"w1: PartitionSpec P\(None, UNCONSTRAINED\) leaves a dimension UNCONSTRAINED"):
        am.check_spec(P(None, P.UNCONSTRAINED), (4, 4), "w1")
    with pytest.raises(mpmd.MpmdError, match=r"w1: PartitionSpec .* has entry 3; each entry is None, an axis name or a tuple"):
        am.check_spec(P(None, 3), (4, 4), "w1")
    am.check_spec(P(None, ("data", "model")), (4, 4), "w1")
    # an axis used twice is said so, whatever the shape (on one its axis does not divide it read "does not divide"; a probe)
    with pytest.raises(mpmd.MpmdError, match=r"w1: PartitionSpec P\('model', 'model'\) uses axis 'model' twice"):
        am.check_spec(P("model", "model"), (3, 4), "w1")
    with pytest.raises(mpmd.MpmdError, match=r"w1: dimension of size 3 is split over model = 2 devices"):
        am.check_spec(P("model", None), (3, 4), "w1")


def test_a_spec_over_a_mesh_of_other_axis_names_is_refused_with_a_spelling_that_works():
    """A NamedSharding over a jax Mesh named ('x', 'y') was refused with "give the PartitionSpec alone
    (P(None, 'y'))", which then failed on the actors' ('data', 'model') (a probe). The advice is the spec in the
    actors' names, by position when the shapes agree; otherwise it says to use those names."""
    from jax.sharding import Mesh, NamedSharding

    from mpmd.compiler.lowering import rebind_constraints
    from mpmd.runtime.sharding import ActorMesh

    am = ActorMesh((1, 2), ("data", "model"))
    xy = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("x", "y"))
    assert am.in_own_names(P(None, "y"), xy) == P(None, "model") and am.in_own_names(P(("x", "y")), xy) == P(("data", "model"))
    assert am.in_own_names(P("model"), xy) == P("model")  # (already the actors' names)
    other_shape = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("x", "y"))
    assert am.in_own_names(P(None, "y"), other_shape) is None
    with pytest.raises(mpmd.MpmdError, match=r"give the PartitionSpec alone \(P\(None, 'model'\)\)"):
        am.check_spec(NamedSharding(xy, P(None, "y")), (4, 4), "w1")
    with pytest.raises(mpmd.MpmdError, match=r"give a PartitionSpec in the actors' own axis names \('data', 'model'\)"):
        am.check_spec(NamedSharding(other_shape, P(None, "y")), (4, 4), "w1")
    # (P.UNCONSTRAINED names no axis: kept; the advice was built for every constraint and raised TypeError on it,
    # even over a mesh that is the actors' own and is just rebound; a review)
    assert am.in_own_names(P(P.UNCONSTRAINED, "y"), xy) == P(P.UNCONSTRAINED, "model")
    with pytest.raises(mpmd.MpmdError, match=r"give the PartitionSpec alone \(P\(UNCONSTRAINED, 'model'\)\)"):
        am.check_spec(NamedSharding(xy, P(P.UNCONSTRAINED, "y")), (4, 4), "w1")
    own = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    kept = jax.make_jaxpr(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(own, P(P.UNCONSTRAINED, "model"))))(
        np.ones((4, 4), np.float32))
    assert rebind_constraints(kept, am) is not None
    closed = jax.make_jaxpr(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(xy, P(None, "y"))))(np.ones((4, 4), np.float32))
    with pytest.raises(mpmd.PipelineError, match=r"write with_sharding_constraint\(x, P\(None, 'model'\)\)"):
        rebind_constraints(closed, am)


def test_the_embedding_api_puts_and_runs_sharded_arrays(mesh_1x2):
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    r = mesh_1x2.actor(0).put(x, P(None, "model"))
    assert r.sharding.spec == P(None, "model")
    both = mesh_1x2.actor(0).put(x, P("data", "model"))  # (data is of size 1: the same layout, said as a step says it)
    assert both.sharding.spec == P(None, "model") and both.sharding == r.sharding
    np.testing.assert_array_equal(both.to_numpy(), x)
    assert mesh_1x2.actor(0).stats()["device_bytes"][0] >= 8 * 4 * 4
    f = jax.jit(lambda a: (a @ a.T).sum(axis=0))
    out = mesh_1x2.actor(0).run(f, r)
    np.testing.assert_allclose(out.to_numpy(), np.asarray(f(x)), rtol=1e-5)


def test_the_embedding_api_runs_jax_jit_code_as_jax_jit_runs_it_in_the_callers_thread(mesh_2x2):
    """`actor.run` lowered in a worker thread, outside the caller's thread-local JAX configuration, and exported a
    jax.jit's shardings as they were (a probe): under `jax.enable_x64(True)` a float64 result came back float32;
    under `jax.set_mesh(mesh)` a `jax.jit(f, out_shardings=P(...))` said no mesh was set; a jax.jit with
    out_shardings over a Mesh of the actors' shape was refused by the actor ("exported for 4 devices and is called
    in a context with 1 devices"). Each now gives jax.jit's values, dtypes and layouts."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    a = mesh_2x2.actor(1)
    r = a.put(x, P(None, "model"))
    widen = jax.jit(lambda v: v.astype(jnp.float64) * 2)
    with jax.enable_x64(True):
        want = widen(x)
        got = a.run(widen, r)
        assert got.dtype == want.dtype == np.float64
        np.testing.assert_array_equal(mpmd.fetch(got), np.asarray(want))
    hm = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    named = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(hm, P("model", "data")))
    bare = jax.jit(lambda v: v + 1, out_shardings=P("model"))
    got = a.run(named, r)
    assert got.sharding.spec == named(x).sharding.spec == P("model", "data")
    np.testing.assert_array_equal(got.to_numpy(), x * 2)
    with jax.set_mesh(hm):
        want = bare(x)
        got = a.run(bare, r)
    assert got.sharding.spec == want.sharding.spec == P("model")
    np.testing.assert_array_equal(got.to_numpy(), np.asarray(want))
    explicit = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)  # (jax.make_mesh's default)
    with jax.set_mesh(explicit):  # (traced under it as it was, every value typed with its sharding: even v * 2 failed)
        got = a.run(jax.jit(lambda v: v * 2), r)
    assert got.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(got.to_numpy(), x * 2)


def test_a_daemon_builds_the_device_mesh_each_new_job_asks_for_once_the_last_one_closed(tmp_path):
    """A hand-started daemon (as on a cluster) kept the first job's device mesh for good: every later job with
    another shape or other axis names was refused until the daemon restarted (a probe). While a session is
    open its mesh stays (another shape is refused); after the last one closes, the next job builds its own."""
    import json

    from tests.wire import start_daemon, stop_daemon
    from transport.auth import ClientKeys, KeyPair

    server, client = KeyPair.generate(), KeyPair.generate()
    handoff = json.dumps({"server_public": server.public.decode(), "server_secret": server.secret.decode(),
                          "authorized": {client.public.decode(): "controller"}}).encode() + b"\n"
    keys = ClientKeys(client, (server.public,))
    proc, address = start_daemon("--listen", f"ipc://{tmp_path}/a.sock", "--p2p", "none", "--cpu-devices", "4",
                                 "--keys-stdin", stdin=handoff)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    try:
        # (the same executable and layout on two meshes: compiled executables are cached per mesh — a review found
        # the second job given the first one's, which XLA then refused)
        for shape, names, spec in [((2, 2), ("data", "model"), P(None, "model")), ((4, 1), ("data", "model"), P("data")),
                                   ((4,), ("x",), P(None, "x")), ((2, 2), ("x", "y"), P(None, "x")), (None, None, P(None, "data"))]:
            kw = {} if shape is None else {"mesh_shape": shape, "axis_names": names}
            with mpmd.RemoteMesh.connect([address], keys=keys, transport="none", **kw) as mesh:
                y = mesh.actor(0).run(jax.jit(lambda a: jnp.sin(a) * 2), mesh.actor(0).put(x, spec))
                np.testing.assert_allclose(y.to_numpy(), np.sin(x) * 2, rtol=1e-6)
                assert mesh.actor(0).put(x, spec).sharding.spec == spec
                if names == ("data", "model") and shape == (2, 2):  # a second job at once must share the mesh
                    with pytest.raises(mpmd.MpmdError, match=r"already runs a device mesh \{'data': 2, 'model': 2\}"):
                        mpmd.RemoteMesh.connect([address], keys=keys, transport="none", mesh_shape=(4, 1),
                                                axis_names=("data", "model")).close()
    finally:
        stop_daemon(proc)


def test_parameters_keep_their_layout_across_steps_as_under_jit(mesh_2x2):
    """A parameter whose gradient comes out in another layout than its own (w2: P('data', None), its gradient
    P('model', None)) came back replicated after the first step (4x its memory) and in the gradient's layout from the
    second on, where jax.jit keeps the input's every step (a probe; the README says state keeps its layout). An
    output at an argument's pytree path, of its shape and dtype, is laid out as that argument."""
    rng = np.random.default_rng(0)
    d, f = 8, 16
    params = [{"w1": (rng.standard_normal((d, f)) / 3).astype(np.float32), "w2": (rng.standard_normal((f, d)) / 4).astype(np.float32)},
              {"w": (rng.standard_normal((d, d)) / 3).astype(np.float32)}]
    specs = [{"w1": P(None, "model"), "w2": P("data", None)}, {"w": P()}]

    def model(p, x):
        x = jnp.tanh(x @ p[0]["w1"]) @ p[0]["w2"]
        return mpmd.pipeline_yield(x) @ p[1]["w"]

    loss = lambda p, mb: jnp.mean((model(p, mb["x"]) - mb["y"]) ** 2)  # noqa: E731
    opt = optax.adam(1e-2)
    batches = [{"x": rng.standard_normal((2, 4, d)).astype(np.float32), "y": rng.standard_normal((2, 4, d)).astype(np.float32)}
               for _ in range(3)]
    first = mpmd.distributed(make_train_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh_2x2, in_shardings=(specs, None, None))
    rest = mpmd.distributed(make_train_step(loss, opt, mpmd.OneFOneB(2)), mesh=mesh_2x2)
    def canonical(spec):  # (P('data', None) and P('data') lay out alike)
        t = tuple(spec)
        while t and t[-1] is None:
            t = t[:-1]
        return t

    want = jax.tree.map(canonical, specs, is_leaf=lambda x: isinstance(x, P))
    p, o = params, opt.init(params)
    for i, b in enumerate(batches):
        p, o, _ = (first if i == 0 else rest)(p, o, b)
        got = jax.tree.map(lambda x: canonical(x.sharding.spec), p)
        assert got == want, (i, got)
    want_p, _, _ = reference(loss, opt, params, specs, batches, (2, 2))
    assert_trees_close(mpmd.fetch(p), want_p)


def test_a_4_bit_value_on_actors_with_several_devices_is_refused_saying_to_cast_it(mesh_1x2):
    """On an actor with several devices JAX lays a 4-bit array out unpacked where the executables take it packed:
    the step failed on the actor, "compiled for input layouts that disagree" (a probe). It is refused before
    dispatch, saying what to do; a put of one says the same."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)
    q = jnp.asarray(rng.integers(0, 4, size=(4, 4)), jnp.float32).astype(jnp.int4)
    batch = {"x": jnp.asarray(rng.normal(size=(2, 2, 4)), jnp.float32)}

    def step(w, q, batch):
        def loss(w, mb):
            return jnp.mean(mpmd.pipeline_yield(mb["x"] @ w) @ q.astype(jnp.float32))
        return mpmd.accumulate_grads(lambda mb: jax.value_and_grad(loss)(w, mb)[::-1], batch, schedule=mpmd.GPipe(2))

    with pytest.raises(mpmd.PipelineError, match=r"holds int4 values, which actors with several devices cannot take.*cast them to int8"):
        mpmd.distributed(step, mesh=mesh_1x2)(w, q, batch)
    with pytest.raises(mpmd.RemoteError, match=r"int4 arrays on actors with several devices are not supported.*cast to int8"):
        mesh_1x2.actor(0).put(np.asarray(q)).to_numpy()


def test_a_named_sharding_is_taken_over_a_mesh_of_the_actors_shape_and_refused_over_another(mesh_1x2):
    """`actor(i).put(x, NamedSharding(...))` raised a bare TypeError ("object of type 'NamedSharding' has no len()"),
    and in_shardings took a NamedSharding over a (2, 1) mesh on (1, 2) actors as its bare spec, so P('data') came out
    replicated, where with_sharding_constraint refuses it (a probe). One over a mesh of the actors' shape and names
    is its spec there; one over another mesh is refused, saying to pass the PartitionSpec."""
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    same = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    other = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    put = mesh_1x2.actor(0).put(x, NamedSharding(same, P(None, "model")))
    assert put.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(put.to_numpy(), x)
    with pytest.raises(mpmd.MpmdError, match=r"put: NamedSharding\(P\('data',\)\) is over a jax Mesh of shape \(2, 1\).*give the "
                                             r"PartitionSpec alone"):
        mesh_1x2.actor(0).put(x, NamedSharding(other, P("data")))
    step = mpmd.distributed(lambda w, b: mpmd.accumulate_grads(
        lambda mb: jax.value_and_grad(lambda w: jnp.sum(mpmd.pipeline_yield(mb @ w) ** 2))(w)[::-1], b, schedule=mpmd.GPipe(2)),
        mesh=mesh_1x2, in_shardings=(NamedSharding(other, P("data")), None))
    with pytest.raises(mpmd.MpmdError, match=r"in_shardings for args\[0\]: NamedSharding\(P\('data',\)\) is over a jax Mesh"):
        step(np.ones((8, 8), np.float32), np.ones((2, 2, 8), np.float32))


def test_a_constraint_on_the_returned_state_wins_over_the_arguments_layout(mesh_2x2):
    """State keeps its argument's layout unless the step constrains it: host parameters (replicated by default)
    returned through with_sharding_constraint come back laid out as the constraint says, as under jax.jit (a review:
    the kept-layout rule forced them replicated)."""
    rng = np.random.default_rng(1)
    params = [{"w": (rng.standard_normal((8, 8)) / 3).astype(np.float32)}, {"w": (rng.standard_normal((8, 8)) / 3).astype(np.float32)}]
    specs = [{"w": P("data", None)}, {"w": P(None, "model")}]

    def model(p, x):
        return mpmd.pipeline_yield(jnp.tanh(x @ p[0]["w"])) @ p[1]["w"]

    loss = lambda p, mb: jnp.mean((model(p, mb["x"]) - mb["y"]) ** 2)  # noqa: E731
    opt = optax.sgd(0.1)
    train = make_train_step(loss, opt, mpmd.OneFOneB(2))

    def step(p, o, b):
        new_p, new_o, losses = train(p, o, b)
        return jax.lax.with_sharding_constraint(new_p, specs), new_o, losses

    batch = {"x": rng.standard_normal((2, 4, 8)).astype(np.float32), "y": rng.standard_normal((2, 4, 8)).astype(np.float32)}
    p, _, _ = mpmd.distributed(step, mesh=mesh_2x2)(params, opt.init(params), batch)
    assert [x.sharding.spec for x in jax.tree.leaves(p)] == [P("data"), P(None, "model")]


def test_out_shardings_for_an_argument_returned_unchanged_is_said_not_to_apply(mesh_1x2):
    """out_shardings asking a passthrough output (an argument the step returns as it is) for another layout was
    dropped unsaid: the array came back as it went in, and a later step whose in_shardings asked for that layout
    refused it, advising the out_shardings the user had given (a probe). mpmd hands back the argument itself, so
    it warns that the layout is not applied; one asked for as the argument already is says nothing."""
    def step(w, keep, batch):
        def mb(x):
            value, g = jax.value_and_grad(lambda w: jnp.sum(mpmd.pipeline_yield(jnp.tanh(x @ w)) ** 2))(w)
            return g, value
        g, losses = mpmd.accumulate_grads(mb, batch, schedule=mpmd.GPipe(2))
        return w - 0.1 * g, keep, losses

    w = np.ones((8, 8), np.float32) / 8
    batch = np.ones((2, 4, 8), np.float32)
    first = mpmd.distributed(step, mesh=mesh_1x2, in_shardings=(P(None, "model"), None, None))
    w1, _, _ = first(w, np.zeros(2, np.float32), batch)
    assert w1.sharding.spec == P(None, "model")
    relaid = mpmd.distributed(step, mesh=mesh_1x2, out_shardings=(None, P(), None))
    with pytest.warns(UserWarning, match=r"out_shardings for output 1 \(out\[1\]\) is not applied: the step returns those arguments unchanged"):
        _, k_out, _ = relaid(w1, w1, batch)
    assert k_out is w1 and k_out.sharding.spec == P(None, "model")  # (as it came)
    same = mpmd.distributed(step, mesh=mesh_1x2, out_shardings=(None, P(None, "model"), None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same(w1, w1, batch)
    # An out_shardings a dimension does not take names the output (it said only "out_shardings"; a probe).
    uneven = mpmd.distributed(step, mesh=mesh_1x2, out_shardings=(P(None, "model"), None, None))
    with pytest.raises(mpmd.MpmdError, match=r"out_shardings for out\[0\]: dimension of size 3 is split over model = 2"):
        uneven(np.ones((3, 3), np.float32), np.zeros(2, np.float32), np.ones((2, 4, 3), np.float32))


def test_shardings_that_lay_nothing_out_run_on_actors_of_one_device_and_a_spec_is_refused_naming_both_ways(mesh2):
    """in_shardings=(None, None, None) on actors of one device each was refused ("needs actors with several
    devices") where jax.jit takes it: code written for any mesh, e.g. a restore onto one device per actor, broke
    (a probe). None and P() constrain nothing there and run as without; a spec naming an axis is refused, for
    out_shardings too, saying to leave them out."""
    from mpmd.testing import mlp, mlp_params, mse_loss, regression_batch

    rng = np.random.default_rng(3)
    params, opt = mlp_params(rng, num_stages=2, width=8), optax.sgd(0.1)
    batch = regression_batch(rng, 2, 4, 8)
    want = jax.jit(make_train_step(mse_loss(mlp), opt, None), in_shardings=(None, None, None))(params, opt.init(params), batch)
    for shardings in ((None, None, None), (P(), None, P())):
        step = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2, in_shardings=shardings,
                                out_shardings=(None, None, None))
        got = mpmd.fetch(step(params, opt.init(params), batch))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    for kw in ({"in_shardings": (None, None, P("data"))}, {"out_shardings": (None, None, P("data"))}):
        step = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2, **kw)
        with pytest.raises(mpmd.PipelineError, match=rf"{next(iter(kw))} needs actors with several devices.*or leave "
                                                     rf"{next(iter(kw))} out"):
            step(params, opt.init(params), batch)


def test_in_shardings_count_the_arguments_as_jax_jit_does_static_and_unpassed_ones_left_out(mesh_1x2):
    """A probe (2026-12-05): jax.jit takes one in_shardings entry per argument that is not static; mpmd wanted one
    for the static argument too (and refused jit's count with "not a prefix ... a tuple of 2 ... a tuple of 3"),
    and a call passing the batch by keyword wanted one more for the parameter left to its default. Each way the
    step equals jax.jit, parameters laid out as asked."""
    rng = np.random.default_rng(0)
    params = megatron_params(rng)
    opt = optax.sgd(1e-2)
    batches = [batch_of(rng)]
    rp, _, rl = reference(mse(megatron), opt, params, MEGATRON_SPECS, batches, (1, 2))
    inner = make_train_step(mse(megatron), opt, mpmd.OneFOneB(2))

    def scaled(n, p, o, batch, scale=1.0):  # n static, scale left to its default
        return inner(p, o, batch)

    def check(p, o, loss):
        np.testing.assert_allclose(loss.to_numpy(), rl[0], rtol=1e-5)
        assert_trees_close(mpmd.fetch(p), rp)
        assert p[0]["w1"].sharding.spec == P(None, "model") and p[0]["w2"].sharding.layout == ("model",)

    step = mpmd.distributed(scaled, mesh=mesh_1x2, static_argnums=0, in_shardings=(MEGATRON_SPECS, None, None))
    check(*step(3, params, opt.init(params), batches[0]))  # jax.jit's count: the static argument has none
    check(*step(3, params, opt.init(params), batch=batches[0]))  # by keyword: `scale`, unpassed, has none either
    step = mpmd.distributed(scaled, mesh=mesh_1x2, static_argnums=0, in_shardings=(None, MEGATRON_SPECS, None, None))
    check(*step(3, params, opt.init(params), batches[0]))  # one for every position, as before: still taken
    # ... but then never read the other way by a call passing one argument more (it would shift them by one; a review)
    with pytest.raises(mpmd.PipelineError, match=r"in_shardings has 4 entries, read one per position by an earlier call"):
        step(3, params, opt.init(params), batches[0], 2.0)
