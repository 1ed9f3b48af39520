"""Train a small 2-stage MLP on 2 local CPU actors with 1F1B, and check every step against jax.jit.

Each step is checked on the same inputs as jax.jit's: its losses, its gradients (before the optimizer) and
Adam's moments after the update. Not the parameters: Adam divides by the gradient's running scale, which
magnifies rounding differences in small gradients; what is compared is what both compute alike.

    python examples/train_mlp.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpmd

NUM_STAGES, WIDTH, MICROBATCHES, MB_SIZE = 2, 32, 4, 16


def block(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def model(params, x):
    x = block(params[0], x)
    x = mpmd.pipeline_yield(x)  # stage 0 ends here
    return x @ params[1]["w"] + params[1]["b"]


def loss(params, mb):
    return jnp.mean((model(params, mb["x"]) - mb["y"]) ** 2)


optimizer = optax.adam(3e-2)


def grad_step(params, batch):
    """The pipelined part of a step: per-microbatch gradients summed, per-microbatch losses stacked."""

    def microbatch_grads(mb):
        value, grads = jax.value_and_grad(loss)(params, mb)
        return grads, value

    return mpmd.accumulate_grads(microbatch_grads, batch, schedule=mpmd.OneFOneB(num_stages=NUM_STAGES))


def train_step(params, opt_state, batch):
    grads, losses = grad_step(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses


# The actors sum the same float32 terms as jax.jit in another order (microbatch by microbatch, stage by stage):
# the results differ by rounding error, about float32's epsilon (1.2e-7) times the square root of the number of
# terms (here hundreds) times the largest term. 1e-4 of the largest value leaves a wide margin over that and
# still catches a wrong gradient, which is off by a sizeable part of the gradient itself.
def assert_close(got, want, what, rtol=1e-4):
    want = [np.asarray(w) for w in jax.tree.leaves(want)]
    scale = max(float(np.max(np.abs(w))) for w in want)  # rounding error follows the largest terms, not each element
    for g, w in zip(jax.tree.leaves(got), want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * scale, err_msg=what)


def main() -> None:
    rng = np.random.default_rng(0)
    params = [{"w": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), "b": np.zeros(WIDTH, np.float32)}
              for _ in range(NUM_STAGES)]
    teacher = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / np.sqrt(WIDTH)

    def make_batch():
        x = rng.standard_normal((MICROBATCHES, MB_SIZE, WIDTH)).astype(np.float32)
        return {"x": x, "y": np.sin(x @ teacher)}

    ref_grads, ref_step = jax.jit(grad_step), jax.jit(train_step)  # the same functions, undecorated: the ground truth
    with mpmd.RemoteMesh.local(num_actors=NUM_STAGES) as mesh:
        grads_on_actors = mpmd.distributed(grad_step, mesh=mesh)
        step = mpmd.distributed(train_step, mesh=mesh)
        p, o = params, optimizer.init(params)
        for i in range(20):
            batch = make_batch()
            hp, ho = mpmd.fetch((p, o))  # this step's inputs, for jax.jit
            grads, losses = mpmd.fetch(grads_on_actors(hp, batch))
            want_grads, want_losses = ref_grads(hp, batch)
            assert_close(losses, want_losses, f"step {i}: losses")
            assert_close(grads, want_grads, f"step {i}: gradients")
            p, o, losses = step(p, o, batch)
            _, want_o, want_losses = ref_step(hp, ho, batch)
            got, want = losses.to_numpy(), np.asarray(want_losses)
            assert_close(got, want, f"step {i}: the training step's losses")
            got_o = mpmd.fetch(o)
            for moment in ("mu", "nu"):
                assert_close(optax.tree_utils.tree_get(got_o, moment), optax.tree_utils.tree_get(want_o, moment), f"step {i}: Adam's {moment}")
            if i % 4 == 0 or i == 19:
                print(f"step {i:2d}  loss {got.mean():.5f}  (jax.jit: {want.mean():.5f})")
        print("losses, gradients and Adam's moments of all 20 steps equal jax.jit's; stage 0 lives on actor", p[0]["w"].actors,
              "and stage 1 on", p[1]["w"].actors)
        print("\nactor 0's program (first lines):")
        print("\n".join(step.program(p, o, batch).splitlines()[:12]))


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # --help
    main()
