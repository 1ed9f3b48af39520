"""Train a small 2-stage MLP on 2 local CPU actors with 1F1B, and check every step against jax.jit.

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


def train_step(params, opt_state, batch):
    def microbatch_grads(mb):
        value, grads = jax.value_and_grad(loss)(params, mb)
        return grads, value

    grads, losses = mpmd.accumulate_grads(microbatch_grads, batch, schedule=mpmd.OneFOneB(num_stages=NUM_STAGES))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses


def main() -> None:
    rng = np.random.default_rng(0)
    params = [{"w": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), "b": np.zeros(WIDTH, np.float32)}
              for _ in range(NUM_STAGES)]
    teacher = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / np.sqrt(WIDTH)

    def make_batch():
        x = rng.standard_normal((MICROBATCHES, MB_SIZE, WIDTH)).astype(np.float32)
        return {"x": x, "y": np.sin(x @ teacher)}

    reference = jax.jit(train_step)  # the same function, undecorated: the ground truth
    with mpmd.RemoteMesh.local(num_actors=NUM_STAGES) as mesh:
        step = mpmd.distributed(train_step, mesh=mesh)
        p, o = params, optimizer.init(params)
        rp, ro = params, optimizer.init(params)
        for i in range(20):
            batch = make_batch()
            p, o, losses = step(p, o, batch)
            rp, ro, rlosses = reference(rp, ro, batch)
            got, want = losses.to_numpy(), np.asarray(rlosses)
            np.testing.assert_allclose(got, want, rtol=1e-5)
            if i % 4 == 0 or i == 19:
                print(f"step {i:2d}  loss {got.mean():.5f}  (jax.jit: {want.mean():.5f})")
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        print("parameters after 20 steps equal jax.jit's; stage 0 lives on actor", p[0]["w"].actors, "and stage 1 on", p[1]["w"].actors)
        print("\nactor 0's program (first lines):")
        print("\n".join(step.program(p, o, batch).splitlines()[:12]))


if __name__ == "__main__":
    main()
