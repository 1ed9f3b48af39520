"""RemoteArray behaves like the arrays users pass around, knows its mesh, and sessions keep controllers apart."""

import copy
import gc
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpmd
from tests.wire import wait_until


def test_remote_array_has_the_array_attributes_and_a_useful_repr(mesh2):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    r = mesh2.actor(1).put(a)
    assert (r.shape, r.dtype, r.ndim, r.size, r.nbytes) == (a.shape, a.dtype, a.ndim, a.size, a.nbytes)
    assert repr(r) == "RemoteArray(float32[2, 3, 4], on actor 1)"
    # jnp functions and jax.jit refuse it with JAX's own TypeError, which shows it as str() does: say how to fetch it
    for use in (jnp.mean, jax.jit(lambda x: x * 2)):
        with pytest.raises(TypeError, match=r"on actor 1\) \(held by the actors: mpmd.fetch\(x\) brings it here\)"):
            use(r)
    assert r.block_until_ready() is r
    np.testing.assert_array_equal(np.asarray(r), a)
    np.testing.assert_array_equal(jax.device_get(r), a)
    np.testing.assert_array_equal(jax.device_get({"x": [r]})["x"][0], a)
    assert jax.tree.leaves({"p": r, "q": (r, 1.0)}) == [r, r, 1.0]
    doubled = jax.tree.map(lambda x: x, {"p": r})
    assert doubled["p"] is r


def test_fetch_brings_a_whole_pytree_home_in_one_request_per_actor(mesh2):
    rng = np.random.default_rng(0)
    host = {"a": [rng.standard_normal(3).astype(np.float32) for _ in range(4)], "b": rng.standard_normal((2, 2))}
    remote = {"a": [mesh2.actor(i % 2).put(x) for i, x in enumerate(host["a"])], "b": mesh2.actor(0).put(host["b"]), "c": 7}
    before = [mesh2.conn(a).client.requests_sent for a in range(2)]
    got = mpmd.fetch(remote)
    after = [mesh2.conn(a).client.requests_sent for a in range(2)]
    assert [y - x for x, y in zip(before, after)] == [1, 1]
    assert got["c"] == 7
    for g, w in zip(got["a"], host["a"]):
        np.testing.assert_array_equal(g, w)
    # float64 with x64 off: put gives what jax.device_put gives, float32 (running it under jit then works)
    assert got["b"].dtype == jax.device_put(host["b"]).dtype == np.float32
    np.testing.assert_array_equal(got["b"], host["b"].astype(np.float32))


def test_typed_prng_keys_round_trip_through_an_actor(mesh2):
    keys = jax.random.split(jax.random.key(42), 5)
    r = mesh2.actor(0).put(keys)
    assert r.shape == (5,) and jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key)
    assert "key<fry>[5]" in repr(r)
    back = mpmd.fetch(r)
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(keys))
    with pytest.raises(TypeError, match="mpmd.fetch"):
        np.asarray(r)
    # a jitted function on the actor takes and returns typed keys
    out = mesh2.actor(0).run(jax.jit(lambda k: (jax.random.split(k[0]), jax.random.normal(k[1], (3,)))), r)
    want = jax.jit(lambda k: (jax.random.split(k[0]), jax.random.normal(k[1], (3,))))(keys)
    np.testing.assert_array_equal(jax.random.key_data(mpmd.fetch(out[0])), jax.random.key_data(want[0]))
    np.testing.assert_array_equal(out[1].to_numpy(), np.asarray(want[1]))


def test_an_array_of_another_mesh_is_refused_naming_both_meshes_and_adopted_on_request(mesh2):
    f = jax.jit(lambda x: x * 2.0)
    with mpmd.RemoteMesh.local(num_actors=1) as other:
        x = other.actor(0).put(np.arange(4, dtype=np.float32))
        with pytest.raises(mpmd.MpmdError) as e:
            mesh2.actor(0).run(f, x)
        text = str(e.value)
        assert repr(other) in text and repr(mesh2) in text and "mesh.adopt(x)" in text
        step = mpmd.distributed(lambda w, b: mpmd.accumulate_grads(lambda mb: ((), jnp.sum(mb * w)), b,
                                                                   schedule=mpmd.GPipe(1))[1], mesh=mesh2)
        with pytest.raises(mpmd.MpmdError, match=r"argument args\[0\] is RemoteArray.*mesh\.adopt\(x\)"):
            step(x, np.ones((2, 4), np.float32))
        assert not step._compiled  # refused before compiling the step (seconds on a real model), not after
        adopted = mesh2.adopt({"x": x, "host": 3.0})
        assert adopted["host"] == 3.0 and adopted["x"].mesh is mesh2 and adopted["x"].actors == [0]
        np.testing.assert_array_equal(mesh2.actor(0).run(f, adopted["x"]).to_numpy(), np.arange(4) * 2.0)
        # a weakly typed scalar stays weak (it came back strong: bf16 params times it became float32; a probe)
        lr = other.actor(0).run(jax.jit(lambda: 0.5))
        assert lr.weak_type and mesh2.adopt(lr).weak_type
        w = mesh2.actor(0).put(jnp.ones(3, jnp.bfloat16))
        assert mesh2.actor(0).run(jax.jit(lambda w, lr: w * lr), w, mesh2.adopt(lr)).dtype == jnp.bfloat16
    # what a fetch hands out is read-only, as jax.device_get of a jax.Array: changing it changed every later fetch
    # of the array (its cached copy; a probe)
    y = mesh2.actor(0).put(np.arange(4, dtype=np.float32))
    host = jax.device_get(y)
    with pytest.raises(ValueError, match="read-only"):
        host /= 8
    for got in (mpmd.fetch(y), y.to_numpy(), np.asarray(y), mpmd.fetch([y])[0]):
        np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32))
        with pytest.raises(ValueError, match="read-only"):
            got[0] = 7
    mine = np.array(y)  # a copy, writable, as np.array of a jax.Array (it was the read-only fetched view; a review)
    mine[0] = 7
    np.testing.assert_array_equal(y.to_numpy(), np.arange(4, dtype=np.float32))
    # the other mesh is closed now: its arrays are refused, saying so
    with pytest.raises(mpmd.MpmdError, match="closed"):
        mesh2.actor(0).run(f, x)
    with pytest.raises(mpmd.MpmdError, match="closed"):
        x.to_numpy()


def test_two_controllers_on_the_same_daemons_never_see_each_others_buffers(mesh2):
    mine = mesh2.actor(0).put(np.full(3, 1.0, np.float32))
    with mpmd.RemoteMesh.connect(mesh2.addresses, transport="none", keys=mesh2.keys) as second:
        # the second controller names the first one's buffer id on the same daemon: its session has no such buffer
        stolen = mpmd.RemoteArray(second, dict(mine.buffers), mine.shape, mine.dtype)
        with pytest.raises(mpmd.RemoteError, match="holds no buffer"):
            stolen.to_numpy()
        # and both number their buffers from 1 without clashing
        theirs = [second.actor(0).put(np.full(3, 2.0, np.float32)) for _ in range(mine.buffers[0] + 1)]
        assert mine.buffers[0] in {t.buffers[0] for t in theirs}
        np.testing.assert_array_equal(mine.to_numpy(), np.full(3, 1.0))
        np.testing.assert_array_equal(theirs[mine.buffers[0] - 1].to_numpy(), np.full(3, 2.0))
        assert second.actor(0).stats()["buffers"] == len(theirs)
        assert mesh2.actor(0).info()["sessions"] >= 2
        del stolen
    np.testing.assert_array_equal(mine.to_numpy(), np.full(3, 1.0))  # the second controller left it alone
    assert jnp.asarray(mine.to_numpy()).sum() == 3.0


def test_python_conversions_fetch_as_numpy_does_and_arithmetic_says_to_fetch_or_pass_the_array(mesh2):
    """`float(loss)`, `f"{loss:.3f}"`, `loss.item()` failed with TypeErrors about RemoteArray; closing over a
    RemoteArray in a step failed with "unsupported operand type(s) for @: 'LinearizeTracer' and 'RemoteArray'"."""
    x = mesh2.actor(0).put(np.float32(2.5))
    n = mesh2.actor(1).put(np.int32(3))
    v = mesh2.actor(1).put(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert float(x) == 2.5 and int(x) == 2 and x.item() == 2.5 and complex(x) == 2.5
    assert f"{x:.3f}" == "2.500" and f"{n:04d}" == "0003" and f"{v}" == str(v) == f"{v!r} (held by the actors: mpmd.fetch(x) brings it here)"
    assert bool(x) and not bool(mesh2.actor(0).put(np.float32(0))) and list(range(10))[n] == 3
    assert v.tolist() == [[0, 1, 2], [3, 4, 5]] and len(v) == 2 and v.item(4) == 4.0
    with pytest.raises(ValueError):
        bool(v)  # (as numpy: ambiguous)
    with pytest.raises(TypeError):
        len(x)
    with pytest.raises(TypeError, match="cannot be iterated here: fetch it first"):
        list(v)
    np.testing.assert_array_equal(np.asarray(v) + 1, np.arange(6).reshape(2, 3) + 1)  # fetched, then computed
    for op in (lambda: x + 1, lambda: 1 - x, lambda: -x, lambda: v[0], lambda: x < 3, lambda: v @ v, lambda: x == 2.5,
               lambda: x != 0, lambda: 0 == x, lambda: np.ones(3) + x,
               lambda: np.float32(2) * x, lambda: np.arange(3) == x,  # (numpy on the left fetched silently)
               lambda: np.isfinite(x), lambda: np.add(v, 1), lambda: np.log(x)):  # (numpy's bare "does not support ufuncs")
        with pytest.raises(TypeError, match="lives on its actors.*pass it as an argument.*fetch it first"):
            op()  # (`x == 0` was silently False whatever x held: object identity)
    assert x is not None and {x: 1}[x] == 1 and x in {x}  # hashed by identity, as before
    with pytest.raises(TypeError, match="cannot be pickled: mpmd.fetch"):
        pickle.dumps(x)

    w = mesh2.actor(1).put(np.ones((4, 2), np.float32))

    def step(p, batch):
        def mb(b):
            value, g = jax.value_and_grad(lambda p: jnp.sum(mpmd.pipeline_yield(b @ p) @ w))(p)
            return g, value
        return mpmd.accumulate_grads(mb, batch, schedule=mpmd.GPipe(2))

    with pytest.raises(TypeError, match="pass it as an argument of the distributed step"):
        mpmd.distributed(step, mesh=mesh2)(np.ones((4, 4), np.float32), np.ones((2, 2, 4), np.float32))


def _sgd_step(w, batch):
    """A 2-stage SGD step (GPipe) that a test donates its weights to."""
    def mb(b):
        value, g = jax.value_and_grad(lambda w: jnp.sum(mpmd.pipeline_yield(jnp.tanh(b @ w[0])) @ w[1]))(w)
        return g, value
    g, losses = mpmd.accumulate_grads(mb, batch, schedule=mpmd.GPipe(2))
    return [a - 0.1 * b for a, b in zip(w, g)], losses


def _sgd_state():
    return [np.full((4, 4), 0.25, np.float32), np.ones((4, 2), np.float32)], np.ones((2, 2, 4), np.float32)


def test_a_deep_copy_of_a_steps_output_is_the_same_immutable_array_and_survives_a_donating_step(mesh2):
    """`best = copy.deepcopy(params)` failed ("cannot pickle '_thread.RLock'"). A RemoteArray is immutable,
    so its copy is itself; a step that donates it then leaves it alone, so the copy still reads."""
    step, w, batch = _sgd_step, *_sgd_state()
    dist = mpmd.distributed(step, mesh=mesh2, donate_argnums=0)
    out, _ = dist(w, batch)
    best = copy.deepcopy({"params": out})
    assert best["params"][0] is out[0]
    again, _ = dist(out, batch)  # donates `out`, which is also `best`
    want = jax.jit(step)(w, batch)[0]
    for b, o, wv in zip(best["params"], out, want):
        assert not b.is_deleted() and not o.is_deleted()
        np.testing.assert_allclose(np.asarray(b), np.asarray(wv), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(again[0]), np.asarray(jax.jit(step)(want, batch)[0][0]), rtol=1e-6)


def test_a_fetch_overtaken_by_a_step_donating_its_array_says_it_was_donated(mesh2, monkeypatch):
    """A thread fetching params while another donated them to the next step got the actor's "holds no buffer N ...
    was it deleted or never put?" (91 of 200 tries; a probe): the fetch had found the array usable, then the step's
    dispatch deleted it and freed its buffer. It says what reading a donated array says. (The other thread's timing
    is stood in for: the step is called between the fetch's check and its request, by wrapping `get_buffers`.)"""
    step, w, batch = _sgd_step, *_sgd_state()
    dist = mpmd.distributed(step, mesh=mesh2, donate_argnums=0)
    out, _ = dist(w, batch)
    mpmd.fetch(out)
    later = []
    real = mesh2.get_buffers

    def overtaken(bufs, *sizes):
        if not later:
            later.append(dist(out, batch))  # (the other thread's call, donating `out`)
            later[0][1].block_until_ready()
        return real(bufs, *sizes)

    monkeypatch.setattr(mesh2, "get_buffers", overtaken)
    with pytest.raises(mpmd.MpmdError, match=r"was donated to _sgd_step \(donate_argnums\)"):
        mpmd.fetch(out)
    monkeypatch.undo()
    want = jax.jit(step)(jax.jit(step)(w, batch)[0], batch)[0]
    for got, wv in zip(mpmd.fetch(later[0][0]), want):
        np.testing.assert_allclose(got, np.asarray(wv), rtol=1e-6)


def _twice_step(w, v, batch):
    """A 2-stage step whose stage 0 reads w[0] and v[0]: `_twice_step(x, x, batch)` reads one array at two leaves."""
    def mb(b):
        value, g = jax.value_and_grad(lambda w: jnp.sum(mpmd.pipeline_yield(jnp.tanh(b @ w[0]) * jnp.sum(v[0])) @ w[1]))(w)
        return g, value
    g, losses = mpmd.accumulate_grads(mb, batch, schedule=mpmd.GPipe(2))
    return [a - 0.1 * b for a, b in zip(w, g)], losses


@pytest.mark.parametrize("donate", [(), (0, 1)])
def test_one_array_at_two_leaves_held_by_the_other_actor_is_copied_once_and_freed_with_it(mesh2, donate):
    """`step(x, x, batch)`, donating both or neither, with x held by actor 1 and read by stage 0 on actor 0 at both
    leaves: each leaf made its own copy on actor 0 and the second's id replaced the first's in the array, so the
    first copy stayed on actor 0 for good (2 buffers a call here; a probe). One copy is made and read at both
    leaves; the results are jax.jit's of the same arguments (jax.jit itself refuses a buffer donated twice; here the
    step's arguments are never handed to its executables, so reading one twice is safe); a donated array is deleted
    once, and afterwards the actors hold what they held before."""
    w, _ = _sgd_state()
    batch = np.ones((2, 2, 4), np.float32)
    dist = mpmd.distributed(_twice_step, mesh=mesh2, donate_argnums=donate)
    gc.collect()
    before = [mesh2.actor(a).stats()["buffers"] for a in range(2)]
    x = [mesh2.actor(1).put(v) for v in w]
    new, losses = dist(x, x, batch)
    want = jax.jit(_twice_step)(w, w, batch)
    for got, wv in zip(jax.tree.leaves(mpmd.fetch((new, losses))), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, np.asarray(wv), rtol=1e-6)
    assert [v.is_deleted() for v in x] == [bool(donate)] * 2
    if not donate:
        assert sorted(x[0].buffers) == [0, 1]  # (the copy kept for the next call)
    del x, new, losses
    gc.collect()
    held = lambda: [mesh2.actor(a).stats()["buffers"] for a in range(2)]  # noqa: E731
    assert wait_until(lambda: held() == before, 10), (held(), before)


def test_jax_array_methods_on_a_remote_array_say_to_fetch_it_first_and_the_protocols_still_work(mesh2):
    x = mesh2.actor(0).put(np.arange(6, dtype=np.float32).reshape(2, 3))
    for name in ("mean", "T", "astype", "reshape", "at", "real", "sum"):
        with pytest.raises(AttributeError, match=rf"has no \.{name} here: it lives on its actors.*mpmd\.fetch\(x\)"):
            getattr(x, name)
    assert not hasattr(x, "mean") and not hasattr(x, "no_such_thing")
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        x.no_such_thing  # noqa: B018
    # what numpy, copy and jax.device_get look up keeps working
    np.testing.assert_array_equal(np.asarray(x), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert copy.copy(x) is x
    np.testing.assert_array_equal(jax.device_get(x), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_an_output_of_a_cancelled_step_says_so_instead_of_raising_cancelled_error(mesh2):
    """The future a RemoteArray waits on can end cancelled (its dispatch's task cancelled on the loop): reading
    the array raised the bare `CancelledError` that `Future.exception()` raises for a cancelled future — which
    reads as the caller's own cancellation. It says the step was cancelled. (The cancelled step is stood in for by
    a cancelled future on a real step's output: no public call leaves an output of a cancelled step to read.)"""
    import concurrent.futures

    def step(w, batch):
        def mb(b):
            value, g = jax.value_and_grad(lambda w: jnp.sum(mpmd.pipeline_yield(jnp.tanh(b @ w[0])) @ w[1]))(w)
            return g, value
        return mpmd.accumulate_grads(mb, batch, schedule=mpmd.GPipe(2))

    w = [np.full((4, 4), 0.25, np.float32), np.ones((4, 2), np.float32)]
    g, _ = mpmd.distributed(step, mesh=mesh2)(w, np.ones((2, 2, 4), np.float32))
    g[0]._ready.result(timeout=60)
    cancelled = concurrent.futures.Future()
    assert cancelled.cancel()
    g[0]._ready = cancelled
    with pytest.raises(mpmd.MpmdError, match="step that was cancelled"):
        np.asarray(g[0])
    np.testing.assert_allclose(np.asarray(g[1]), np.asarray(jax.jit(step)(w, np.ones((2, 2, 4), np.float32))[0][1]), rtol=1e-6)


def test_a_mesh_copies_as_itself_and_a_mesh_step_or_tune_result_refuses_pickling_saying_why(mesh2):
    """copy.copy(mesh) made a shallow copy sharing the controller loop; its close() shut the original's down
    ("Event loop is closed" on the next fetch). Deep copies and pickles of a mesh, a step or a TuneResult said
    "cannot pickle '_io.BufferedWriter' object". And round() of a 0-d RemoteArray had no __round__ (a probe)."""
    import optax

    from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch

    x = mesh2.actor(0).put(np.full((), 2.6, np.float32))
    assert copy.copy(mesh2) is mesh2 and copy.deepcopy(mesh2) is mesh2
    with pytest.raises(TypeError, match="connection to running daemons and cannot be pickled.*RemoteMesh.connect"):
        pickle.dumps(mesh2)
    rng = np.random.default_rng(0)
    params, opt = mlp_params(rng, num_stages=2, width=8), optax.sgd(0.1)
    step = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    again = copy.copy(step)  # (a shallow copy still works: the same function, mesh and compiled steps)
    assert again.fn is step.fn and again.mesh is mesh2
    # ... also once the original is collected (its Programs were unloaded from the actors: "no program 1"; a probe)
    original = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(2)), mesh=mesh2)
    original(params, opt.init(params), regression_batch(rng, 2, 4, 8))[2].block_until_ready()
    alone = copy.copy(original)
    del original
    gc.collect()
    alone(params, opt.init(params), regression_batch(rng, 2, 4, 8))[2].block_until_ready()
    for bad in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied: make it again with mpmd.distributed"):
            bad(step)
    batch = regression_batch(rng, 2, 4, 8)
    result = mpmd.tune(step, params, opt.init(params), batch, mesh=mesh2, costs="xla", microbatches=[2])
    assert copy.copy(result).best is result.best
    for bad in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match="TuneResult holds the distributed steps"):
            bad(result)
    assert round(x) == round(np.float32(2.6)) == 3 and round(x, 1) == round(np.float32(2.6), 1)
    np.testing.assert_allclose(mpmd.fetch(x), 2.6)  # (the mesh is still open and serving)


def test_actor_run_types_python_numbers_and_weak_arrays_as_jax_jit_does(mesh2):
    """A probe (2026-12-05): actor.run traced every argument strongly typed: `bf16_array * 2.0` came back float32,
    `int8_array * 100` int32 (200, 300 where jax.jit wraps to -56, 44), and outputs were never weak, so passing
    one back promoted again."""
    import functools

    run = mesh2.actor(0).run
    mul = jax.jit(lambda a, s: a * s)
    for a, s in ((jnp.arange(4, dtype=jnp.bfloat16), 2.0), (np.arange(4, dtype=np.int8), 100), (np.ones(3, np.float32), 3)):
        want = mul(a, s)
        got = run(mul, a, s)
        assert got.dtype == want.dtype and got.weak_type == want.weak_type
        np.testing.assert_array_equal(got.to_numpy(), np.asarray(want))
    scale = jax.jit(lambda s: s * 0.99)
    out, want = run(scale, 0.1), scale(0.1)
    assert out.weak_type and want.weak_type and out.dtype == want.dtype
    bf = jnp.ones(3, jnp.bfloat16)
    assert run(mul, bf, out).dtype == mul(bf, want).dtype == jnp.bfloat16  # a weak output passed back stays weak
    # put as jax.device_put: a big-endian float64 is float32 with x64 off (it stayed float64, and run refused it)
    be = np.arange(6, dtype=">f8").reshape(2, 3)
    x = mesh2.actor(0).put(be)
    assert x.dtype == jax.device_put(be.astype("<f8")).dtype == np.float32
    np.testing.assert_array_equal(run(jax.jit(lambda v: v * 2), x).to_numpy(), be * 2)
    with pytest.raises(mpmd.MpmdError, match=r"put takes one array \(or a number\), got dict .*jax.tree.map"):
        mesh2.actor(0).put({"a": np.ones(2)})
    with pytest.raises(mpmd.MpmdError, match=r"static arguments .* cannot be passed to it: bind them first"):
        run(jax.jit(lambda a, n: a * n, static_argnums=1), np.ones(2, np.float32), 3)
    np.testing.assert_array_equal(run(jax.jit(functools.partial(lambda a, n: a * n, n=3)), np.ones(2, np.float32)).to_numpy(), [3, 3])
