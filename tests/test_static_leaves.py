"""Leaves that are not data travel in the step's signature (mpmd/static_leaves.py): a function or a string
among the arguments, and — as under `eqx.filter_jit` — every non-array leaf of an equinox Module. Each step
is compared with jax.jit of the same step with those leaves closed over (or with eqx.filter_jit)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpmd
from mpmd.static_leaves import Static, hide, reveal
from tests.test_pipeline import assert_trees_close
from tests.test_user_programs import batch_of, mlp2


def _two_layers(params, opt_state, batch, first, schedule, opt=optax.sgd(0.1)):
    """An SGD step of a 2-stage MLP whose first layer's output goes through `first` (Python, at trace time)."""
    def mb_grads(mb):
        def loss(p):
            h = first(mb["x"] @ p[0]["w"] + p[0]["b"])
            h = mpmd.pipeline_yield(h)
            return jnp.mean((h @ p[1]["w"] + p[1]["b"] - mb["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return grads, value

    grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=schedule)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses


def _step(params, opt_state, batch, act):
    return _two_layers(params, opt_state, batch, act, mpmd.OneFOneB(2))


def test_a_function_argument_is_static_and_a_new_function_recompiles_like_a_new_static_argnum(mesh2):
    rng = np.random.default_rng(0)
    params, batch = mlp2(rng), batch_of(rng)
    opt_state = optax.sgd(0.1).init(params)
    dist = mpmd.distributed(_step, mesh=mesh2)
    for act in (jnp.tanh, jax.nn.relu, jnp.tanh):
        got = dist(params, opt_state, batch, act)
        want = jax.jit(functools.partial(_step, act=act))(params, opt_state, batch)
        assert_trees_close(mpmd.fetch(got), want)
    assert len(dist._compiled) == 2  # tanh, relu; tanh again is a cache hit
    assert not any("[3]" in p for p in dist.compile(params, opt_state, batch, jnp.tanh).arg_paths)


def test_functions_and_strings_in_the_outputs_come_back_as_they_went_in(mesh2):
    rng = np.random.default_rng(1)
    params, batch = mlp2(rng), batch_of(rng)
    opt = optax.sgd(0.1)
    config = {"act": jnp.tanh, "name": "run-7"}

    def step(params, opt_state, batch, config):
        new_params, opt_state, losses = _step(params, opt_state, batch, config["act"])
        return new_params, opt_state, losses, config

    got = mpmd.distributed(step, mesh=mesh2)(params, opt.init(params), batch, config)
    assert got[3]["act"] is jnp.tanh and got[3]["name"] == "run-7"
    assert_trees_close(mpmd.fetch(got[:3]), jax.jit(functools.partial(_step, act=jnp.tanh))(params, opt.init(params), batch))


def test_static_values_key_by_equality_and_unhashable_ones_by_identity():
    a, b = [1], [1]
    assert jax.tree.structure(hide({"x": "s"})) == jax.tree.structure(hide({"x": "s"}))
    assert jax.tree.structure(hide({"x": "s"})) != jax.tree.structure(hide({"x": "t"}))
    sa, sb = jax.tree.structure(Static(a)), jax.tree.structure(Static(b))
    assert sa != sb and sa == jax.tree.structure(Static(a))  # lists are unhashable: compared by identity
    hash(sa)
    tree = {"f": jnp.tanh, "x": np.ones(2), "n": 3}
    hidden = hide(tree)
    assert len(jax.tree.leaves(hidden)) == 2  # outside an equinox Module a Python number stays data, as under jax.jit
    assert reveal(hidden)["f"] is jnp.tanh


def test_an_equinox_model_with_activations_dropout_and_int_fields_trains_like_filter_jit(mesh2):
    """equinox is not a dependency of mpmd, only of its tests (the `test` extra installs it)."""
    import equinox as eqx

    class Block(eqx.Module):
        mlp: eqx.nn.MLP
        drop: eqx.nn.Dropout
        heads: int  # not marked static: eqx.filter_jit keeps it static all the same

        def __call__(self, x, key):
            x = self.drop(self.mlp(x), key=key)
            return x.reshape(self.heads, -1).sum(0)

    class Model(eqx.Module):
        a: Block
        b: eqx.nn.MLP

        def __call__(self, x, key):
            return self.b(mpmd.pipeline_yield(self.a(x, key)))[0]

    k = jax.random.split(jax.random.PRNGKey(0), 2)
    model = Model(Block(eqx.nn.MLP(8, 16, 16, 2, key=k[0]), eqx.nn.Dropout(0.1), 2), eqx.nn.MLP(8, 1, 16, 2, key=k[1]))
    opt = optax.adam(1e-2)
    rng = np.random.default_rng(2)
    batch = {"x": rng.normal(size=(4, 6, 8)).astype(np.float32), "y": rng.normal(size=(4, 6)).astype(np.float32),
             "key": jax.random.split(jax.random.PRNGKey(1), 4)}

    def step(model, opt_state, batch):
        def mb_grads(mb):
            @eqx.filter_value_and_grad
            def loss(m):
                keys = jax.random.split(mb["key"], mb["x"].shape[0])
                return jnp.mean((jax.vmap(m)(mb["x"], keys) - mb["y"]) ** 2)

            value, grads = loss(model)
            return grads, value

        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=mpmd.OneFOneB(2))
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, losses

    ref, dist = eqx.filter_jit(step), mpmd.distributed(step, mesh=mesh2)
    r = d = (model, opt.init(eqx.filter(model, eqx.is_array)))
    for _ in range(3):
        r_out, d_out = ref(*r, batch), dist(*d, batch)
        assert d_out[0].a.mlp.activation is model.a.mlp.activation and d_out[0].a.heads == 2
        got, want = eqx.filter(mpmd.fetch(d_out), eqx.is_array), eqx.filter(r_out, eqx.is_array)
        assert_trees_close(got, want)
        r, d = r_out[:2], d_out[:2]
    # inference mode is a new static value: a new compile, dropout off, still equal to filter_jit
    inference = eqx.nn.inference_mode(d[0])
    got = dist(inference, d[1], batch)[2]
    np.testing.assert_allclose(mpmd.fetch(got), ref(eqx.nn.inference_mode(r[0]), r[1], batch)[2], rtol=1e-5, atol=1e-6)


def _scaled_step(params, opt_state, batch, scale, train):
    def first(z):
        if train:  # a Python bool: only a static argument can steer Python control flow
            return jnp.tanh(z) * scale
        return jnp.tanh(z)

    return _two_layers(params, opt_state, batch, first, mpmd.GPipe(2))


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_static_argnums_and_argnames_steer_python_control_flow_like_jax_jit(mesh2, how):
    rng = np.random.default_rng(3)
    params, batch = mlp2(rng), batch_of(rng)
    opt_state = optax.sgd(0.1).init(params)
    kw = {"static_argnums": (4,)} if how == "argnums" else {"static_argnames": "train"}
    ref = jax.jit(_scaled_step, **kw)
    dist = mpmd.distributed(_scaled_step, mesh=mesh2, **kw)
    for train in (True, False):
        got = dist(params, opt_state, batch, np.float32(0.5), train=train)  # by keyword, bound to its position
        assert_trees_close(mpmd.fetch(got), ref(params, opt_state, batch, np.float32(0.5), train))
    assert len(dist._compiled) == 2


def test_unhashable_static_arguments_and_unknown_names_are_refused_naming_them(mesh2):
    with pytest.raises(mpmd.PipelineError, match="static_argnames names 'training'.*its parameters"):
        mpmd.distributed(_scaled_step, mesh=mesh2, static_argnames="training")
    # a position the step does not have is refused as jax.jit refuses it (else it would silently mark nothing)
    with pytest.raises(ValueError, match=r"only accepts 5 positional"):
        jax.jit(_scaled_step, static_argnums=7)
    for nums in (7, (4, -6)):
        with pytest.raises(mpmd.PipelineError, match=r"static_argnums=.*_scaled_step takes 5 arguments.*names none"):
            mpmd.distributed(_scaled_step, mesh=mesh2, static_argnums=nums)
    with pytest.raises(mpmd.PipelineError, match=r"donate_argnums=\[5\]"):
        mpmd.distributed(_scaled_step, mesh=mesh2, donate_argnums=5)
    with pytest.raises(mpmd.PipelineError, match=r"static_argnames must be parameter names .* got 3; positions go in static_argnums"):
        mpmd.distributed(_scaled_step, mesh=mesh2, static_argnames=3)
    rng = np.random.default_rng(4)
    params, batch = mlp2(rng), batch_of(rng)
    dist = mpmd.distributed(_scaled_step, mesh=mesh2, static_argnums=(3, 4))
    with pytest.raises(mpmd.PipelineError, match=r"static argument args\[3\] is a list, which is not hashable"):
        dist(params, optax.sgd(0.1).init(params), batch, [0.5], True)
    with pytest.raises(mpmd.PipelineError, match="cannot bind the arguments of _scaled_step"):
        dist(params, optax.sgd(0.1).init(params), batch, 0.5, True, bogus=1)


def test_keywords_skipping_a_defaulted_parameter_bind_and_a_dtype_class_is_static(mesh2):
    rng = np.random.default_rng(5)
    params, batch = mlp2(rng), batch_of(rng)
    opt = optax.sgd(0.1)

    def step(params, opt_state=None, batch=None, dtype=np.float32):
        out = _step(params, opt_state, batch, jnp.tanh)
        return (*out[:2], out[2].astype(dtype))

    dist = mpmd.distributed(step, mesh=mesh2)
    want = jax.jit(functools.partial(step, dtype=np.float16))(params, opt.init(params), batch)
    got = dist(params, batch=batch, opt_state=opt.init(params), dtype=np.float16)  # a class among the arguments
    assert np.asarray(mpmd.fetch(got[2])).dtype == np.float16
    assert_trees_close(mpmd.fetch(got), want, rtol=1e-3, atol=1e-3)


def _kwonly_step(params, opt_state, batch, *, scale, train=True):
    return _scaled_step(params, opt_state, batch, scale, train)


def test_keyword_only_parameters_bind_by_name_and_can_be_static_like_jax_jit(mesh2):
    """`def step(params, opt_state, batch, *, scale, train=True)` with static_argnames='train', as jax.jit
    takes it: a required keyword-only data argument, a defaulted static one steering Python control flow."""
    rng = np.random.default_rng(6)
    params, batch = mlp2(rng), batch_of(rng)
    opt_state = optax.sgd(0.1).init(params)
    ref = jax.jit(_kwonly_step, static_argnames="train")
    dist = mpmd.distributed(_kwonly_step, mesh=mesh2, static_argnames="train")
    for kwargs in ({"scale": np.float32(0.5)}, {"scale": np.float32(0.5), "train": False}, {"train": True, "scale": np.float32(2.0)}):
        assert_trees_close(mpmd.fetch(dist(params, opt_state, batch, **kwargs)), ref(params, opt_state, batch, **kwargs))
    assert len(dist._compiled) == 2  # train=True and train=False; scale is data
    with pytest.raises(mpmd.PipelineError, match="cannot bind the arguments of _kwonly_step.*scale"):
        dist(params, opt_state, batch)  # the required keyword-only one is missing


def _defaults_step(params, opt_state, batch, scale=0.5, *, train=True, reps=2):
    def first(z):
        z = jnp.tile(z, (1, reps))[:, : z.shape[1]]  # reps: a shape (a Python int, never traced under jax.jit)
        return jnp.tanh(z) * scale if train else jnp.tanh(z)  # train: Python control flow

    return _two_layers(params, opt_state, batch, first, mpmd.OneFOneB(2))


def test_parameters_the_call_leaves_at_their_defaults_stay_python_values_as_under_jax_jit(mesh2):
    """A call with keyword arguments, or a step with keyword-only parameters, bound the call with every default
    applied, so a default the call did not pass was traced: `if train:` raised TracerBoolConversionError and
    `reps` as a shape a TypeError, where jax.jit keeps unpassed defaults as the function's own Python values
    (a probe; functools.partial(step, scale=...) hit it too). Passed values are arguments, as under jax.jit."""
    rng = np.random.default_rng(8)
    params, batch = mlp2(rng), batch_of(rng)
    opt_state = optax.sgd(0.1).init(params)
    dist = mpmd.distributed(_defaults_step, mesh=mesh2)
    for kwargs in ({}, {"scale": np.float32(0.25)}):
        assert_trees_close(mpmd.fetch(dist(params, opt_state, batch, **kwargs)), jax.jit(_defaults_step)(params, opt_state, batch, **kwargs))
    static = dict(static_argnames=("train", "reps"))  # passed, they are arguments: static ones, as jax.jit needs them
    for kwargs in ({"train": False}, {"reps": 3, "scale": np.float32(0.25)}):
        assert_trees_close(mpmd.fetch(mpmd.distributed(_defaults_step, mesh=mesh2, **static)(params, opt_state, batch, **kwargs)),
                           jax.jit(_defaults_step, **static)(params, opt_state, batch, **kwargs))
    partial = functools.partial(_defaults_step, scale=np.float32(2.0))
    assert_trees_close(mpmd.fetch(mpmd.distributed(partial, mesh=mesh2)(params, opt_state, batch)),
                       jax.jit(partial)(params, opt_state, batch))


def test_a_partials_array_and_remote_array_keywords_are_arguments_of_the_step(mesh2):
    """functools.partial(step, opt_state=x) makes `opt_state` a keyword-only parameter whose default holds arrays:
    it stays an argument of the step (a RemoteArray there is the step's own state on the actors), as it was before
    unpassed Python defaults were left to the function (a review found it refused then)."""
    rng = np.random.default_rng(9)
    params, batch = mlp2(rng), batch_of(rng)
    opt_state = optax.sgd(0.1).init(params)
    ref = jax.jit(_step, static_argnums=3)
    rp, ro, _ = ref(params, opt_state, batch, jnp.tanh)
    dp, do, _ = mpmd.distributed(_step, mesh=mesh2, static_argnums=3)(params, opt_state, batch, jnp.tanh)  # RemoteArrays
    want = ref(rp, ro, batch, jnp.tanh)
    for fixed, state in ((rp, ro), (dp, do)):
        step = mpmd.distributed(functools.partial(_step, params=fixed, act=jnp.tanh), mesh=mesh2)
        assert_trees_close(mpmd.fetch(step(opt_state=state, batch=batch)), want)


def test_arguments_for_var_keywords_are_refused_naming_them(mesh2):
    def step(params, opt_state, batch, **extra):
        return _step(params, opt_state, batch, jnp.tanh)

    rng = np.random.default_rng(7)
    params, batch = mlp2(rng), batch_of(rng)
    with pytest.raises(mpmd.PipelineError, match=r"\['bonus'\] of step go to its \*\*kwargs"):
        mpmd.distributed(step, mesh=mesh2)(params, optax.sgd(0.1).init(params), batch, bonus=1)


def test_an_equinox_models_static_fields_are_not_saved_and_come_back_from_like(mesh2, tmp_path):
    """mpmd.save writes data only: an activation, `Dropout.p`/`inference` and an int field are the program, as
    under `eqx.filter_jit` (they came back as arrays, and the restored model no longer traced; the activation
    was refused). restore/load take them from `like`, as `eqx.tree_deserialise_leaves` does."""
    import equinox as eqx

    class Net(eqx.Module):
        mlp: eqx.nn.MLP
        drop: eqx.nn.Dropout
        heads: int
        b: eqx.nn.Linear

        def __call__(self, x, key):
            h = self.drop(self.mlp(x), key=key).reshape(self.heads, -1).sum(0)
            return self.b(mpmd.pipeline_yield(h))

    def step(model, batch):
        def f(mb):
            keys = jax.random.split(mb["key"], mb["x"].shape[0])
            v, g = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(mb["x"], keys) - mb["y"]) ** 2))(model)
            return g, v

        g, losses = mpmd.accumulate_grads(f, batch, schedule=mpmd.OneFOneB(2))
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, g)), losses

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    model = Net(eqx.nn.MLP(4, 8, 8, 1, key=k[0]), eqx.nn.Dropout(0.1), 2, eqx.nn.Linear(4, 2, key=k[1]))
    rng = np.random.default_rng(3)
    batch = {"x": rng.normal(size=(2, 3, 4)).astype(np.float32), "y": rng.normal(size=(2, 3, 2)).astype(np.float32),
             "key": jax.random.split(k[2], 2)}
    dist = mpmd.distributed(step, mesh=mesh2)
    trained, _ = dist(model, batch)
    mpmd.save(str(tmp_path / "c"), trained)
    back = mpmd.restore(str(tmp_path / "c"), mesh2, like=trained)
    assert (back.drop.p, back.drop.inference, back.heads) == (0.1, False, 2) and back.mlp.activation is model.mlp.activation
    host = mpmd.load(str(tmp_path / "c"), like=model)
    assert (host.drop.p, host.drop.inference, host.heads) == (0.1, False, 2)
    assert_trees_close(eqx.filter(host, eqx.is_array), eqx.filter(mpmd.fetch(trained), eqx.is_array))
    want = eqx.filter_jit(step)(mpmd.fetch(trained), batch)
    assert_trees_close(eqx.filter(mpmd.fetch(dist(back, batch)), eqx.is_array), eqx.filter(want, eqx.is_array))
    assert sorted(mpmd.load(str(tmp_path / "c"))) == ["b", "mlp"]  # without `like`: the data alone (no drop, no heads)


def test_an_unhashable_static_leaf_is_refused_naming_it_not_reused_stale_when_changed_in_place(mesh2):
    """A leaf kept static that cannot be hashed — a SimpleNamespace config in an equinox Module, a callable object
    that is an unfrozen dataclass — was keyed by identity: changed in place, the next call reused the old compile and
    computed with the old value, silently (a probe: eager 0.33, mpmd 0.12). `eqx.filter_jit` and jax.jit's static
    arguments refuse such values; so does a step, naming the leaf."""
    import dataclasses
    import types

    import equinox as eqx

    class Scaled(eqx.Module):
        w: jax.Array
        cfg: types.SimpleNamespace

    @dataclasses.dataclass
    class Act:  # (eq=True without frozen: __hash__ is None)
        slope: float

        def __call__(self, x):
            return self.slope * x

    rng = np.random.default_rng(5)
    params, batch = mlp2(rng), batch_of(rng)
    opt_state = optax.sgd(0.1).init(params)
    with pytest.raises(ValueError, match="Non-hashable static arguments"):  # (what eqx.filter_jit says)
        eqx.filter_jit(lambda m: m.w * m.cfg.scale)(Scaled(jnp.ones(2), types.SimpleNamespace(scale=1.0)))
    dist = mpmd.distributed(lambda m, p, s, b: _step(p, s, b, jnp.tanh) + (m.w * 2,), mesh=mesh2)
    with pytest.raises(mpmd.PipelineError, match=r"args\[0\]\.cfg is a SimpleNamespace, which is not hashable.*frozen dataclass"):
        dist(Scaled(jnp.ones(2), types.SimpleNamespace(scale=1.0)), params, opt_state, batch)
    with pytest.raises(mpmd.PipelineError, match=r"args\[3\] is an Act, which is not hashable"):
        mpmd.distributed(_step, mesh=mesh2)(params, opt_state, batch, Act(2.0))
    frozen = dataclasses.make_dataclass("Frozen", [("slope", float)], frozen=True,
                                        namespace={"__call__": lambda self, x: self.slope * x})
    got = mpmd.distributed(_step, mesh=mesh2)(params, opt_state, batch, frozen(2.0))  # (hashable: static, keyed by value)
    assert_trees_close(mpmd.fetch(got), jax.jit(_step, static_argnums=3)(params, opt_state, batch, frozen(2.0)))


def test_a_shape_dtype_struct_field_of_an_equinox_module_is_static_as_under_filter_jit(mesh2):
    import equinox as eqx

    class Act(eqx.Module):
        gain: jax.Array
        out: jax.ShapeDtypeStruct  # (eqx.is_array says False: static under eqx.filter_jit; it was refused)

        def __call__(self, h):
            return (jnp.tanh(h) * self.gain).astype(self.out.dtype)

    rng = np.random.default_rng(7)
    params, batch = mlp2(rng), batch_of(rng)
    args = (Act(jnp.float32(1.5), jax.ShapeDtypeStruct((), jnp.float32)), params, optax.sgd(0.1).init(params), batch)
    got = mpmd.distributed(lambda a, p, s, b: _step(p, s, b, a), mesh=mesh2)(*args)
    assert_trees_close(mpmd.fetch(got), eqx.filter_jit(lambda a, p, s, b: _step(p, s, b, a))(*args))


def test_an_error_while_tracing_names_the_steps_function_and_parameter_as_jax_jit_does(mesh2):
    """A Python bool argument is traced (as under jax.jit) and then used in an `if`: JAX's error named mpmd's inner
    `flat` and `xs[3]` (a probe); it names the step and its parameter, as jax.jit's does."""
    def train_step(params, opt_state, batch, training):
        return _step(params, opt_state, batch, jnp.tanh if training else jnp.sin)

    rng = np.random.default_rng(6)
    params, batch = mlp2(rng), batch_of(rng)
    args = (params, optax.sgd(0.1).init(params), batch, True)
    with pytest.raises(jax.errors.TracerBoolConversionError) as ref:
        jax.jit(train_step)(*args)
    with pytest.raises(jax.errors.TracerBoolConversionError) as got:
        mpmd.distributed(train_step, mesh=mesh2)(*args)
    for e in (ref, got):
        assert "tracing the function train_step at" in str(e.value) and "the value of the argument training" in str(e.value)
