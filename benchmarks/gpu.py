"""Every GPU figure of the runtime in one run (what `benchmarks/gpu.sh` calls on a lent GPU machine).

* `jax.jit` of an MLP training step on GPU 0, in this process;
* the same step on 1 GPU actor (both stages on one actor): ratio to `jax.jit`;
* a 2-actor 1F1B pipeline with both actors on GPU 0, activations through host memory (shm): its step time
  against `jax.jit` (one GPU cannot speed up: this measures what the hops cost);
* with two GPUs or more: the same pipeline over NCCL, one actor per GPU, against the schedule's ideal.

Figures go to stdout and, as JSON, to `--out/gpu.json`. `--platform cpu` runs the same code on CPU actors
(a dry run of this script on a machine without a GPU).

    python -m benchmarks.gpu --out /tmp/out [--width 2048] [--layers 8] [--microbatches 8] [--rows 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# Three processes share a GPU here (this one and two actors): none may take the default 75 % of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.25")


def gpu_count(platform: str) -> int:
    import jax

    return len([d for d in jax.devices() if d.platform == platform]) if platform != "cpu" else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    p.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--optimizer", default="adam", choices=("sgd", "adam"))
    args = p.parse_args()
    from mpmd.cli.args import cannot_write

    why = cannot_write(args.out, directory=True, parents=True)  # (checked before minutes of work, not after)
    if why:
        p.error(f"--out {args.out}: {why}")
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    import mpmd
    from benchmarks.efficiency import build, measure_mpmd, one_actor_schedule, timed_rounds
    from mpmd.testing import regression_batch

    gpus = gpu_count(args.platform)
    if args.platform == "gpu" and not gpus:  # (it ran the 'gpu' jax.jit reference on the CPU for 2 minutes; a review)
        p.error(f"--platform gpu, but jax sees no GPU ({jax.devices()}): is jax's CUDA plugin installed? "
                "(--platform cpu runs this on CPU actors)")
    figures: dict[str, object] = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
                                  "model": f"{args.layers}-layer {args.width}-wide tanh MLP, {args.microbatches} microbatches of {args.rows}, "
                                           f"{args.optimizer}"}
    os.makedirs(args.out, exist_ok=True)
    figures["gpus"] = gpus

    def save() -> None:
        """gpu.json as far as it goes: written after each section (a hang in a later one lost the earlier figures)."""
        with open(os.path.join(args.out, "gpu.json"), "w") as fh:
            json.dump(figures, fh, indent=1)

    step, params, opt = build(args.width, args.layers, 2, None, args.optimizer)
    batch = regression_batch(np.random.default_rng(1), args.microbatches, args.rows, args.width)
    f = jax.jit(step)
    state = f(params, opt.init(params), batch)[:2]
    jax.block_until_ready(state)

    def jit_round() -> None:
        nonlocal state
        for _ in range(args.steps):
            *state, losses = f(*state, batch)
        jax.block_until_ready(losses)

    jit_round()
    jit_t = timed_rounds(jit_round, args.rounds) / args.steps
    figures["jit_ms"] = jit_t * 1e3
    print(f"{figures['model']} on {args.platform}: jax.jit {jit_t * 1e3:.2f} ms", flush=True)
    save()

    with mpmd.RemoteMesh.local(num_actors=1, platform=args.platform) as one:
        one_t, trace = measure_mpmd(one, one_actor_schedule(args.microbatches), args, os.path.join(args.out, "gpu-one-trace.json"))
    figures["one_actor_ms"], figures["one_actor_vs_jit"] = one_t * 1e3, one_t / jit_t
    print(f"1 actor (both stages): {one_t * 1e3:.2f} ms = {one_t / jit_t:.2f}x jax.jit", flush=True)
    save()
    print(trace.summary(), flush=True)

    shared = {"gpu_ids": (0,)} if args.platform == "gpu" else {}
    with mpmd.RemoteMesh.local(num_actors=2, platform=args.platform, transport="shm", **shared) as two:
        shm_t, trace = measure_mpmd(two, mpmd.OneFOneB(2), args, os.path.join(args.out, "gpu-shm-trace.json"))
    figures["two_actors_one_gpu_shm_ms"], figures["two_actors_one_gpu_shm_vs_jit"] = shm_t * 1e3, shm_t / jit_t
    print(f"2 actors on one device, 1F1B through host memory: {shm_t * 1e3:.2f} ms = {shm_t / jit_t:.2f}x jax.jit", flush=True)
    save()
    print(trace.summary(), flush=True)

    if gpus >= 2:
        with mpmd.RemoteMesh.local(num_actors=2, platform="gpu", transport="nccl") as two:
            nccl_t, trace = measure_mpmd(two, mpmd.OneFOneB(2), args, os.path.join(args.out, "gpu-nccl-trace.json"))
        m = args.microbatches
        ideal = 2 * m / (m + 1)
        figures.update(nccl_ms=nccl_t * 1e3, nccl_speedup=jit_t / nccl_t, nccl_ideal=ideal, nccl_efficiency=jit_t / nccl_t / ideal)
        print(f"2 actors on 2 GPUs, 1F1B over NCCL: {nccl_t * 1e3:.2f} ms: speedup {jit_t / nccl_t:.2f} of ideal {ideal:.2f} "
              f"= efficiency {jit_t / nccl_t / ideal:.2f}", flush=True)
        print(trace.summary(), flush=True)
    else:
        figures["nccl"] = f"skipped: {gpus} GPU(s) visible, the NCCL route needs two"
        print(figures["nccl"], flush=True)

    save()
    print(f"figures in {os.path.join(args.out, 'gpu.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
