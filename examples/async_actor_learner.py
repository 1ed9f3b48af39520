"""Embed mpmd in an asyncio program: an actor-learner loop where a pipeline-parallel learner trains a small
policy while rollouts of the previous policy run at the same time, in the same event loop.

    python examples/async_actor_learner.py [--iterations 6] [--steps 4] [--envs 256] [--horizon 64]

The learner is a 2-stage policy MLP trained with 1F1B on a 2-actor mesh (`step.call_async`); the rollouts run
on a third actor of their own (`actor.run_async` of a jitted `lax.scan` over the environment). The task is
imitation in the DAgger manner: the policy acts, an expert labels the states it visits, the learner regresses
on them, and the return (minus the policy's squared distance to the expert) rises. A 10 ms ticker coroutine
runs throughout: its largest gap says how responsive the loop stayed. The loop runs twice — rollout then
train, and both at once — and prints what the overlap buys.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpmd
from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss

WIDTH = 32
EXPERT = (np.random.default_rng(7).standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6, help="rollout/train rounds per phase")
    ap.add_argument("--steps", type=int, default=4, help="learner steps per round (on the newest rollouts)")
    ap.add_argument("--envs", type=int, default=256, help="environments stepped together in a rollout")
    ap.add_argument("--horizon", type=int, default=64, help="environment steps per rollout")
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches a learner step's pipeline splits its batch into")
    args = ap.parse_args(argv)
    for flag in ("iterations", "steps", "envs", "horizon", "microbatches"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if (args.envs * args.horizon) % args.microbatches:
        ap.error(f"--microbatches {args.microbatches} must divide the {args.envs} x {args.horizon} transitions of a rollout")
    return args


def make_rollout(horizon: int, microbatches: int):
    """A jitted rollout of `horizon` steps of `envs` environments under the policy: the states visited with
    the expert's actions there (the learner's batch, split in microbatches) and the mean return."""

    @jax.jit
    def rollout(params, s0, key):
        def env_step(s, k):
            a = mlp(params, s)  # the policy (its stage marker is the identity outside a distributed step)
            expert = jnp.tanh(s @ EXPERT)
            reward = -jnp.mean((a - expert) ** 2, axis=-1)
            s_next = jnp.tanh(0.8 * s + 0.5 * a + 0.3 * jax.random.normal(k, s.shape))
            return s_next, (s, expert, reward)

        _, (states, experts, rewards) = jax.lax.scan(env_step, s0, jax.random.split(key, horizon))
        batch = {"x": states.reshape(microbatches, -1, WIDTH), "y": experts.reshape(microbatches, -1, WIDTH)}
        return batch, jnp.mean(jnp.sum(rewards, axis=0))

    return rollout


class Ticker:
    """A coroutine that wakes every 10 ms and records how late it woke (the loop's responsiveness)."""

    def __init__(self) -> None:
        self.largest = 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            self.largest = max(self.largest, now - last - 0.01)
            last = now


async def run(args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(0)
    optimizer = optax.adam(3e-3)
    params = mlp_params(rng, num_stages=2, width=WIDTH)
    opt_state = optimizer.init(params)
    train_step = make_train_step(mse_loss(mlp), optimizer, mpmd.OneFOneB(num_stages=2))
    rollout = make_rollout(args.horizon, args.microbatches)
    s0 = rng.standard_normal((args.envs, WIDTH)).astype(np.float32)
    keys = iter(np.asarray(jax.random.key_data(jax.random.split(jax.random.key(1), 2 * args.iterations + 3))))

    learner_mesh, rollout_mesh = await asyncio.gather(mpmd.RemoteMesh.local_async(num_actors=2),  # started together
                                                      mpmd.RemoteMesh.local_async(num_actors=1, transport="none"))
    async with learner_mesh, rollout_mesh:
        step = mpmd.distributed(train_step, mesh=learner_mesh)
        actor = rollout_mesh.actor(0)

        async def collect(policy):  # rollouts of `policy` (host values) on the rollout actor
            batch, ret = await actor.run_async(rollout, policy, s0, next(keys))
            return await mpmd.fetch_async((batch, ret))

        async def learn(p, o, batch):  # `args.steps` pipeline steps on one batch, awaited until computed
            for _ in range(args.steps):
                p, o, losses = await step.call_async(p, o, batch)
            return await mpmd.ready_async((p, o, losses))

        # warm up (compiles both) and check the learner against jax.jit on the same step
        batch, _ = await collect(params)
        p, o, losses = await step.call_async(params, opt_state, batch)
        want = await asyncio.to_thread(jax.jit(make_train_step(mse_loss(mlp), optimizer, None)), params, opt_state, batch)
        for got, ref in zip(jax.tree.leaves(await mpmd.fetch_async((p, o, losses))), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
        print("the learner's pipeline step equals jax.jit's (parameters, optimizer state, losses)")
        ticker = Ticker()  # from here on, all this loop does is await mpmd

        results = {}
        returns: list[float] = []
        for overlap in (False, True):
            policy = await mpmd.fetch_async(p)
            batch, ret = await collect(policy)
            t = time.perf_counter()
            for _ in range(args.iterations):
                if overlap:  # rollouts of the previous policy while the learner trains on the previous rollouts
                    (p, o, losses), (next_batch, ret) = await asyncio.gather(learn(p, o, batch), collect(policy))
                else:
                    next_batch, ret = await collect(policy)
                    p, o, losses = await learn(p, o, batch)
                batch, policy = next_batch, await mpmd.fetch_async(p)
                returns.append(float(ret))
            results["overlapped" if overlap else "one_after_the_other"] = (time.perf_counter() - t) / args.iterations
            print(f"{'both at once' if overlap else 'rollout, then train'}: {results['overlapped' if overlap else 'one_after_the_other'] * 1e3:.0f} "
                  f"ms a round; return {returns[-args.iterations]:.3f} -> {returns[-1]:.3f}; learner loss "
                  f"{float(np.mean(await mpmd.fetch_async(losses))):.4f}")
    ticker.task.cancel()
    speedup = results["one_after_the_other"] / results["overlapped"]
    print(f"overlapping rollouts with training: {speedup:.2f}x the rounds per second; the event loop's largest stall "
          f"(a 10 ms ticker) was {ticker.largest * 1e3:.1f} ms")
    return {"speedup": speedup, "largest_gap": ticker.largest, "first_return": returns[0], "last_return": returns[-1]}


def main(argv: list[str] | None = None) -> dict[str, float]:
    return asyncio.run(run(parse(argv)))


if __name__ == "__main__":
    main()
