"""What `accumulate_grads` sums, summed as jax.jit's loop sums it: from zeros, one microbatch at a time, in the
value's own dtype (bool adds are `or`, small ints wrap, bf16 rounds every add), on real daemons, bit for bit.
Covers the three ways a sum is formed after the loop (a batch leaf returned as it is, a value that does not
depend on the microbatch, a value both summed and stacked), float0 gradients of int leaves, and a bf16 sum
cast to f32 after the loop (the cast must see the rounded bf16 sum, not XLA's wider one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpmd

W = 4


def _same(got, want):
    got = mpmd.fetch(got)
    gl, gt = jax.tree.flatten(got)
    wl, wt = jax.tree.flatten(want)
    assert gt == wt
    for g, w in zip(gl, wl):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        if w.dtype != jax.dtypes.float0:
            np.testing.assert_array_equal(g, w)


def _tiny_loss(p, x):
    h = mpmd.pipeline_yield(jnp.tanh(x @ p[0]))
    return jnp.mean((h @ p[1]) ** 2)


def test_batch_leaves_of_bool_int8_and_uint8_returned_in_the_summed_part_keep_dtype_and_wrap_like_jit(mesh2):
    def step(p, batch):
        def f(mb):
            v, g = jax.value_and_grad(_tiny_loss)(p, mb["x"])
            return (g, {"mask": mb["mask"], "tok": mb["tok"], "u8": mb["u8"]}), v
        return mpmd.accumulate_grads(f, batch, schedule=mpmd.GPipe(2))

    m = 8
    rng = np.random.default_rng(0)
    p = [jnp.eye(W), jnp.eye(W)]
    batch = {"x": jnp.ones((m, 1, W)), "mask": jnp.asarray(rng.random((m, 3)) < 0.2),
             "tok": jnp.asarray(rng.integers(-128, 128, (m, 3)), jnp.int8),
             "u8": jnp.asarray(rng.integers(0, 256, (m, 3)), jnp.uint8)}
    want = jax.jit(step)(p, batch)
    assert want[0][1]["tok"].dtype == jnp.int8  # (the reference wraps: the sum of 8 int8s overflows)
    _same(mpmd.distributed(step, mesh=mesh2)(p, batch), want)


@pytest.mark.parametrize("m", [120, 200])
def test_values_that_do_not_depend_on_the_microbatch_are_added_m_times_in_their_dtype(mesh2, m):
    """200 microbatches: m itself does not fit in int8; bf16 0.1 added 120 times is 12.5625, not 12.0."""

    def step(p, c8, batch):
        def f(mb):
            v, g = jax.value_and_grad(_tiny_loss)(p, mb["x"])
            extra = {"flag": True, "c8": c8, "bf16": jnp.bfloat16(0.1) * p[0][0, 0].astype(jnp.bfloat16),
                     "f32": p[0][0, 0] * 0.1}
            return (g, extra), v
        return mpmd.accumulate_grads(f, batch, schedule=mpmd.GPipe(2))

    p = [jnp.eye(W), jnp.eye(W)]
    batch = {"x": jnp.ones((m, 1, W))}
    want = jax.jit(step)(p, jnp.int8(3), batch)
    _same(mpmd.distributed(step, mesh=mesh2)(p, jnp.int8(3), batch), want)


def test_a_bf16_value_both_stacked_and_summed_sums_like_jit(mesh2):
    def step(p, batch):
        def f(mb):
            v, g = jax.value_and_grad(_tiny_loss)(p, mb["x"])
            h = (mb["x"][0] * 0.1).astype(jnp.bfloat16)
            return (g, h), (v, h)
        return mpmd.accumulate_grads(f, batch, schedule=mpmd.OneFOneB(2))

    p = [jnp.eye(W) * 0.5, jnp.eye(W)]
    batch = {"x": jnp.asarray(np.random.default_rng(1).normal(size=(64, 1, W)), jnp.float32)}
    want = jax.jit(step)(p, batch)
    _same(mpmd.distributed(step, mesh=mesh2)(p, batch), want)


@pytest.mark.parametrize("used", [False, True])
def test_the_float0_gradient_of_an_int_leaf_is_returned_as_under_jit(mesh2, used):
    def step(p, batch):
        def f(mb):
            def loss(p):
                h = mpmd.pipeline_yield(jnp.tanh(mb @ p["w0"]) * (p["step"] if used else 1))
                return jnp.mean((h @ p["w1"]) ** 2)
            return jax.value_and_grad(loss, allow_int=True)(p)[::-1]
        return mpmd.accumulate_grads(f, batch, schedule=mpmd.GPipe(2))

    p = {"w0": jnp.full((4, 4), 0.1), "w1": jnp.full((4, 2), 0.1), "step": jnp.array(1, jnp.int32)}
    batch = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2, 4)), jnp.float32)
    want = jax.jit(step)(p, batch)
    assert want[0]["step"].dtype == jax.dtypes.float0
    got = mpmd.distributed(step, mesh=mesh2)(p, batch)
    _same(got, want)


@pytest.mark.slow  # (moved out of the default run, 18.5 minutes on this VM on 2026-12-07: .ci/run runs it when time allows)
def test_bf16_gradient_sums_cast_to_f32_after_the_loop_are_the_rounded_sums_like_jit():
    """Three stages, 1F1B: the first actor runs the last backward and the cast after the loop as one
    executable; the cast must read the bf16 sum, rounded, as jax.jit's loop carry is."""
    s = 3

    def model(p, x):
        for i in range(s):
            if i:
                x = mpmd.pipeline_yield(x)
            x = jnp.tanh(x @ p[i]["w"] + p[i]["b"])
        return x

    def step(p, batch):
        def f(mb):
            loss, g = jax.value_and_grad(lambda p: jnp.mean((model(p, mb["x"]) - mb["y"]) ** 2))(p)
            return jax.tree.map(lambda a: a.astype(jnp.bfloat16), g), loss
        g, losses = mpmd.accumulate_grads(f, batch, schedule=mpmd.OneFOneB(s))
        return g, jax.tree.map(lambda a: a.astype(jnp.float32), g)

    ks = jax.random.split(jax.random.key(0), s + 2)
    p = [{"w": jax.random.normal(ks[i], (16, 16)) / 4, "b": jnp.zeros(16)} for i in range(s)]
    batch = {"x": jax.random.normal(ks[s], (4, 4, 16)), "y": jax.random.normal(ks[s + 1], (4, 4, 16))}
    want = jax.jit(step)(p, batch)
    with mpmd.RemoteMesh.local(num_actors=s) as mesh:
        _same(mpmd.distributed(step, mesh=mesh)(p, batch), want)


def test_a_bf16_gradient_with_an_l2_penalty_in_the_loss_is_bit_equal_to_jit(mesh2):
    """grad = data gradient + the penalty's (which does not vary): the sum was pushed through the add (the data
    parts summed, m * the penalty after the loop), 50 of 64 elements up to 2 % off jit in bf16. Found by review."""
    def loss(p, mb):
        h = mpmd.pipeline_yield(jnp.tanh(mb["x"] @ p[0]))
        penalty = 0.5 * sum(jnp.sum(w.astype(jnp.float32) ** 2) for w in p)
        return (jnp.mean((h @ p[1] - mb["y"]) ** 2) + penalty).astype(jnp.bfloat16)

    def step(p, batch):
        return mpmd.accumulate_grads(lambda mb: jax.value_and_grad(loss)(p, mb)[::-1], batch, schedule=mpmd.GPipe(2))

    rng = np.random.default_rng(0)
    p = [jnp.asarray(rng.normal(size=(8, 8)), jnp.bfloat16) for _ in range(2)]
    batch = {k: jnp.asarray(rng.normal(size=(32, 4, 8)), jnp.bfloat16) for k in "xy"}
    _same(mpmd.distributed(step, mesh=mesh2)(p, batch), jax.jit(step)(p, batch))
