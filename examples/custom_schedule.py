"""Write your own pipeline schedule, prove it deadlock-free, simulate it, draw it, and train with it.

    python examples/custom_schedule.py                 # simulate, draw examples/out/custom_schedule.svg, then train on 2 actors
    python examples/custom_schedule.py --simulate-only

The schedule is a 1F1B with `slack` extra warm-up forwards on every actor but the last: each actor keeps
`slack` more microbatches in flight, so a slow transfer delays the next stage less. With free transfers
it has 1F1B's bubble; with a latency it sits between 1F1B and GPipe, paying `slack` more activations per
actor (no built-in: Eager 1F1B doubles the warm-up, GPipe runs every forward first).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import mpmd
from mpmd.schedules import Task, backward, one_f_one_b


@dataclass(frozen=True)
class SlackOneFOneB(mpmd.Schedule):
    """1F1B whose actor a runs `p-1-a + slack` warm-up forwards (the last actor keeps 1F1B's none)."""

    slack: int = 1

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m, p = num_microbatches, self.num_stages
        out = []
        for s in range(p):
            warm = min(p - 1 - s + (self.slack if s < p - 1 else 0), m)
            out.append(one_f_one_b([Task(s, "F", i) for i in range(m)], [backward(s, i, split=False) for i in range(m)], warm))
        return out


def simulate_and_draw(picture: str) -> None:
    p, m = 4, 8
    mine, ofob = SlackOneFOneB(num_stages=p, slack=1), mpmd.OneFOneB(num_stages=p)
    print(mpmd.schedules.format_table(mpmd.validate(mine, m)))  # raises ScheduleError with the table if it could deadlock
    for costs, what in ((None, "unit costs, free transfers"), (mpmd.Costs(latency=0.5), "transfers of half a forward")):
        a, b = mpmd.simulate(mine, m, costs), mpmd.simulate(ofob, m, costs)
        print(f"{what:28s}  bubble {a.bubble:.4f} (1F1B {b.bubble:.4f})   step {a.step_time:g} (1F1B {b.step_time:g})   "
              f"peak activations {a.peak_activations} (1F1B {b.peak_activations})")
    mpmd.simulate(mine, m, mpmd.Costs(latency=0.5)).draw(picture, title="SlackOneFOneB(4, slack=1), latency 0.5")
    print(f"wrote {picture}")


# ---- run_on_actors: trains with the custom schedule through mpmd.distributed ----------------------
# One stage per actor with fused F/B tasks here; tables with I/W tasks, several stages per actor (looped or
# V-shaped) or another stage -> actor placement run through mpmd.distributed the same way.
def run_on_actors(steps: int = 5) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    width, microbatches, mb_size = 16, 4, 8
    schedule = SlackOneFOneB(num_stages=2, slack=1)

    def model(params, x):
        x = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
        x = mpmd.pipeline_yield(x)  # stage 0 ends here
        return x @ params[1]["w"] + params[1]["b"]

    def loss(params, mb):
        return jnp.mean((model(params, mb["x"]) - mb["y"]) ** 2)

    optimizer = optax.sgd(0.1)

    def train_step(params, opt_state, batch):
        def microbatch_grads(mb):
            value, grads = jax.value_and_grad(loss)(params, mb)
            return grads, value

        grads, losses = mpmd.accumulate_grads(microbatch_grads, batch, schedule=schedule)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    rng = np.random.default_rng(0)
    params = [{"w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), "b": np.zeros(width, np.float32)}
              for _ in range(2)]
    reference = jax.jit(train_step)
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        step = mpmd.distributed(train_step, mesh=mesh)
        p, o = params, optimizer.init(params)
        rp, ro = params, optimizer.init(params)
        for i in range(steps):
            x = rng.standard_normal((microbatches, mb_size, width)).astype(np.float32)
            batch = {"x": x, "y": np.sin(x)}
            p, o, losses = step(p, o, batch)
            rp, ro, want = reference(rp, ro, batch)
            np.testing.assert_allclose(losses.to_numpy(), np.asarray(want), rtol=1e-5)
            print(f"step {i}  loss {losses.to_numpy().mean():.5f}  (jax.jit {np.asarray(want).mean():.5f})")
    print(f"trained {steps} steps with {schedule} on 2 actors; losses equal jax.jit's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate-only", action="store_true", help="do not start actors")
    parser.add_argument("--picture", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "custom_schedule.svg"), help="timeline picture (.svg, or .png with matplotlib)")
    args = parser.parse_args()
    if not args.picture.endswith((".svg", ".png")):  # (checked before the simulation, not after it as a traceback)
        parser.error(f"--picture {args.picture}: a timeline picture is written as .svg or .png")
    if os.path.dirname(args.picture):
        os.makedirs(os.path.dirname(args.picture), exist_ok=True)
    simulate_and_draw(args.picture)
    if not args.simulate_only:
        run_on_actors()


if __name__ == "__main__":
    main()
