"""The fair comparison as someone outside the project would write it: no helper of this repository's benchmarks.

Two `mpmd-actor` daemons started by hand as the README's "daemons started by hand" section says — pinned with
`taskset -c 0` / `-c 1`, single-threaded XLA, CURVE keys made with `mpmd keys generate` — reached with
`RemoteMesh.connect`; a model of its own (GELU layers with biases, Adam, the loss averaged in the step) and a
training loop that fetches the loss every step; `jax.jit` of the same step in a fresh process pinned to core 0.

    speedup = jit / mpmd    efficiency = speedup / ideal
    ideal = (every task's time summed: one actor doing it all) / (the schedule's step by mpmd.simulate), each
            layer's F = 1, B = 2 (I = W = 1), transfers free: p*m / (m+p-1) for GPipe and 1F1B, more for ZB-H1

    python -m benchmarks.third_party [--width 512] [--layers 6] [--rows 96] [--microbatches 8] [--schedule OneFOneB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

FLAGS = "--xla_cpu_multi_thread_eigen=false"


def build(args: argparse.Namespace, schedule):  # noqa: ANN001, ANN201 - a benchmark
    import jax
    import jax.numpy as jnp
    import optax

    import mpmd

    rng = np.random.default_rng(0)
    w = args.width
    params = [{"w": jnp.asarray(rng.standard_normal((w, w), dtype=np.float32) / np.sqrt(w)), "b": jnp.zeros((w,), jnp.float32)}
              for _ in range(args.layers)]
    opt = optax.adam(1e-3)

    def loss_fn(params, mb):  # noqa: ANN001, ANN202
        x = mb["x"]
        for i, p in enumerate(params):
            x = jax.nn.gelu(x @ p["w"] + p["b"])
            if i == args.layers // 2 - 1:
                x = mpmd.pipeline_yield(x)
        return jnp.mean((x - mb["y"]) ** 2)

    def step(params, opt_state, batch):  # noqa: ANN001, ANN202
        def mb_grads(mb):  # noqa: ANN001, ANN202
            loss, grads = jax.value_and_grad(loss_fn)(params, mb)
            return grads, loss

        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=schedule)
        grads = jax.tree.map(lambda g: g / args.microbatches, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jnp.mean(losses)

    shape = (args.microbatches, args.rows, w)
    batch = {"x": rng.standard_normal(shape, dtype=np.float32), "y": rng.standard_normal(shape, dtype=np.float32)}
    return step, params, opt.init(params), batch


def median_time(one_step, steps: int, warmup: int = 5) -> float:  # noqa: ANN001
    for _ in range(warmup):
        one_step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def jit_child(args: argparse.Namespace) -> None:
    import jax

    step, params, opt_state, batch = build(args, None)
    f = jax.jit(step)
    state = [params, opt_state]

    def one() -> None:
        state[0], state[1], loss = f(state[0], state[1], batch)
        loss.block_until_ready()

    print(json.dumps(median_time(one, args.steps)))


def usable_schedules() -> dict[str, object]:
    """The built-in schedules that run this 2-stage model on 2 actors, as `main` builds them: {name: schedule}."""
    from mpmd.errors import ScheduleError
    from mpmd.schedules import BUILTINS

    out = {}
    for name, cls in BUILTINS.items():
        try:
            schedule = cls(num_stages=2)
        except ScheduleError:  # (the interleaved ones need num_actors=: with 2 stages on 2 actors they are 1F1B)
            continue
        if schedule.num_actors == 2:  # (the V-shaped ones put 2 stages on 1 actor)
            out[name] = schedule
    return out


def ideal_speedup(schedule, layers: int, m: int) -> float:  # noqa: ANN001
    """One actor's time for every task over the schedule's simulated step, each layer costing F = 1, B = 2
    (I = W = 1), transfers free: the speedup a perfect runtime would reach on this split of the layers."""
    import mpmd

    per = (layers // 2, layers - layers // 2)  # the layers of each stage: the model yields after layer layers // 2 - 1
    costs = mpmd.Costs(F=per, B=tuple(2 * x for x in per), I=per, W=per)
    return 3 * layers * m / mpmd.simulate(schedule, m, costs).step_time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=6, help="split into 2 stages after layer layers // 2")
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedule", default="OneFOneB", help="a built-in schedule of 2 stages on 2 actors (OneFOneB, EagerOneFOneB, GPipe, "
                                                          "ZeroBubbleH1)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (after 5 untimed)")
    p.add_argument("--jit-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    # Checked before any daemon starts: --steps 0 died in a bare CalledProcessError, an unknown --schedule in an
    # AttributeError after the daemons and a whole jax.jit child had run.
    for flag, least in (("width", 1), ("layers", 2), ("rows", 1), ("microbatches", 1), ("steps", 1)):
        if getattr(args, flag) < least:
            p.error(f"--{flag} must be at least {least}{' (a layer for each of the 2 stages)' if flag == 'layers' else ''}, "
                    f"got {getattr(args, flag)}")
    if args.jit_child:
        return jit_child(args)
    import mpmd

    usable = usable_schedules()
    if args.schedule not in usable:
        p.error(f"--schedule {args.schedule}: not a built-in schedule of 2 stages on 2 actors; pick one of {', '.join(usable)}")
    try:
        ideal = ideal_speedup(usable[args.schedule], args.layers, args.microbatches)
    except mpmd.ScheduleError as e:
        p.error(f"--schedule {args.schedule} --microbatches {args.microbatches}: {e}")

    bin_dir = os.path.dirname(sys.executable)
    work = tempfile.mkdtemp(prefix="mpmd-third-party-")
    keys = os.path.join(work, "keys")
    subprocess.run([os.path.join(bin_dir, "mpmd"), "keys", "generate", keys], check=True, capture_output=True)
    env = dict(os.environ, XLA_FLAGS=FLAGS, JAX_PLATFORMS="cpu")
    daemons, addresses = [], []
    try:
        for i in range(2):
            d = subprocess.Popen(["taskset", "-c", str(i), os.path.join(bin_dir, "mpmd-actor"), "--listen", "tcp://127.0.0.1:0",
                                  "--actor-id", str(i), "--server-key", os.path.join(keys, "mpmd.key_secret"),
                                  "--authorized-keys", keys], stdout=subprocess.PIPE, text=True, env=env)
            daemons.append(d)
            addresses.append(d.stdout.readline().split()[1])  # "MPMD_ACTOR_READY <endpoint> <p2p endpoint>"
        cmd = ["taskset", "-c", "0", sys.executable, "-m", "benchmarks.third_party", "--jit-child",
               *(f"--{k}={getattr(args, k)}" for k in ("width", "layers", "rows", "microbatches", "steps"))]
        jit_t = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        with mpmd.RemoteMesh.connect(addresses, keys=keys) as mesh:
            step, params, opt_state, batch = build(args, usable[args.schedule])
            dist = mpmd.distributed(step, mesh=mesh)
            state = [params, opt_state]

            def one() -> None:
                state[0], state[1], loss = dist(state[0], state[1], batch)
                mpmd.fetch(loss)

            t = median_time(one, args.steps)
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    m, first = args.microbatches, args.layers // 2
    print(f"{args.layers}-layer {args.width}-wide GELU MLP, Adam, {m} microbatches of {args.rows}, {args.schedule}; "
          "hand-started daemons pinned with taskset, CURVE keys")
    if args.layers % 2:
        print(f"(--layers {args.layers} does not split evenly into 2 stages: {first} and {args.layers - first} layers; "
              "the ideal counts the uneven split)")
    print(f"jax.jit (1 core) {jit_t * 1e3:.2f} ms   mpmd (2 actors) {t * 1e3:.2f} ms   speedup {jit_t / t:.3f}   "
          f"ideal {ideal:.3f} ({args.schedule}, simulated, per-layer F=1 B=2)   efficiency {jit_t / t / ideal:.3f}")


if __name__ == "__main__":
    main()
