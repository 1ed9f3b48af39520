"""The opt-in inline CPU client (`MPMD_CPU_INLINE=1`): each daemon's XLA CPU client runs a one-device Run in the
calling thread (no worker woken per Run), and what would hold the event loop too long is dispatched from the
off-loop thread instead (`actors.stream.INLINE_FLOPS`). Real daemons, compared with `jax.jit`."""

from __future__ import annotations

import jax
import numpy as np
import optax

import mpmd
from actors import stream
from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch


def _compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def test_with_an_inline_client_a_run_counted_past_inline_flops_goes_off_the_loop_and_a_tiny_one_stays(monkeypatch):
    """With the asynchronous client, a big matmul returns from its dispatch at once (XLA's threads run it): it stays
    on the loop. With the inline client it would run in the loop's thread for as long as it computes: it goes off
    the loop, while a tiny one (a 4-row stage of the narrow model) stays, its dispatch cheaper than a thread hop."""
    big = _compiled(lambda w: w @ w, np.ones((128, 128), np.float32))  # 4.2 M flops
    tiny = _compiled(lambda x, w: x @ w, np.ones((4, 16), np.float32), np.ones((16, 16), np.float32))
    assert tiny.cost_analysis()["flops"] < stream.INLINE_FLOPS <= big.cost_analysis()["flops"]
    assert not stream.goes_off_loop(big) and not stream.goes_off_loop(tiny)
    monkeypatch.setattr(stream, "INLINE_CLIENT", True)
    assert stream.goes_off_loop(big) and not stream.goes_off_loop(tiny)


def test_daemons_started_with_mpmd_cpu_inline_run_inline_and_train_as_jax_jit(monkeypatch):
    """`MPMD_CPU_INLINE=1` in the controller's environment reaches the local daemons: they say so in `info`, and
    three 1F1B steps — the stages' Runs of 2 M flops a layer off the loop, the step's small ones inline on it — equal
    `jax.jit`'s (to Adam's rounding, as every pipeline test here)."""
    monkeypatch.setenv("MPMD_CPU_INLINE", "1")
    rng = np.random.default_rng(0)
    opt = optax.adam(1e-2)
    params = mlp_params(rng, 2, width=128)
    batch = regression_batch(rng, 4, 64, 128)  # 4 microbatches of 64 rows: 2 M flops a layer's forward
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        assert all(mesh.actor(i).info()["cpu_inline"] is True for i in range(2))
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.OneFOneB(num_stages=2)), mesh=mesh)
        state, want = (params, opt.init(params)), (params, opt.init(params))
        for _ in range(3):
            got = dist(*state, batch)
            exp = ref(*want, batch)
            state, want = got[:2], exp[:2]
        for g, w in zip(jax.tree.leaves(mpmd.fetch(got)), jax.tree.leaves(exp)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
