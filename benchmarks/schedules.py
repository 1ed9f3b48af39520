"""Every built-in schedule on the GPT example, predicted and measured side by side.

For each schedule, on 2 actors (pinned one per core, single-threaded XLA) and 4 actors (sharing the
machine's cores when it has fewer): the step time; each actor's bubble measured from a real-run trace; the
simulator's bubble for the same compiled Programs with costs fitted to that very trace (least squares over
every Run's duration, a fused Run lasting the sum of its tasks); their ratio; peak buffer bytes per actor as
the actors report them against the simulator's; and the pipeline efficiency 1 - mean measured bubble. One
picture per schedule: the simulated timeline above the measured one.

    python -m benchmarks.schedules [--actors 2,4] [--out benchmarks/out] [--steps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import statistics
import time

import numpy as np

import mpmd
from mpmd.observe.trace import as_sim_result, fit_costs, measured_bubbles
from mpmd.schedules.draw import draw_stacked
from mpmd.schedules.simulator import simulate_programs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def gpt_module():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def schedules_for(n: int) -> list[tuple[str, int]]:
    """(schedule name, stages) for n actors."""
    return [("GPipe", n), ("OneFOneB", n), ("EagerOneFOneB", n), ("ZeroBubbleH1", n), ("InterleavedOneFOneB", 2 * n),
            ("InterleavedZeroBubble", 2 * n), ("ZeroBubbleV", 2 * n), ("DualPipeV", 2 * n)]


def run_one(gpt, mesh, name: str, n: int, stages: int, args: argparse.Namespace, out: pathlib.Path) -> dict:  # noqa: ANN001
    import optax
    from flax import nnx

    model = gpt.GPT(256, args.width, args.layers, 4, args.seq, stages, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-3)
    schedule = gpt.make_schedule(name, n, stages)
    step = mpmd.distributed(gpt.make_step(graphdef, opt, schedule), mesh=mesh)
    data = np.frombuffer(gpt.corpus(1 << 20), np.uint8)
    stream = gpt.batches(data, args.microbatches, args.rows, args.seq, np.random.default_rng(0))
    batch = next(stream)
    state = step(params, opt.init(params), batch)[:2]
    state = step(*state, batch)[:2]
    jax_leaf = state[0]
    mpmd.fetch(jax_leaf)
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(args.steps):
            *state, loss = step(*state, batch)
        loss.block_until_ready()
        times.append((time.perf_counter() - t) / args.steps)
    with mesh.trace() as trace:
        *state, loss = step(*state, batch)
    loss.block_until_ready()
    measured_peak = [mesh.actor(a).stats()["last_step_peak_bytes"] for a in range(n)]
    programs = step.compile(*state, batch).plan.programs
    sim = simulate_programs(programs, fit_costs(trace, stages), name=f"{name} simulated")
    meas = measured_bubbles(trace)
    picture = out / f"{name}-{n}actors.svg"
    draw_stacked([sim, as_sim_result(trace, f"{name} measured")], [f"{name}, {n} actors: simulated (fitted costs)",
                                                                     f"{name}, {n} actors: measured"], str(picture))
    bubble_m = statistics.mean(meas.values())
    return {"schedule": name, "actors": n, "stages": stages, "step_ms": statistics.median(times) * 1e3,
            "bubble_measured": [round(meas[a], 3) for a in sorted(meas)], "bubble_simulated": [round(b, 3) for b in sim.bubble_per_actor],
            "ratio": bubble_m / sim.bubble if sim.bubble > 0 else float("nan"), "peak_measured": measured_peak,
            "peak_simulated": list(sim.peak_bytes or []), "efficiency": 1 - bubble_m, "picture": str(picture)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actors", default="2,4")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default=None, help="comma-separated schedule names")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpt = gpt_module()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for n in (int(x) for x in args.actors.split(",")):
        pin = 1 if n <= cores else None
        for name, stages in schedules_for(n):
            if args.only and name not in args.only.split(","):
                continue
            if args.layers % stages:
                continue
            with mpmd.RemoteMesh.local(num_actors=n, cpus_per_actor=pin) as mesh:
                r = run_one(gpt, mesh, name, n, stages, args, out)
            rows.append(r)
            print(f"{name:22s} {n} actors {stages:2d} stages  step {r['step_ms']:8.2f} ms  bubble measured {r['bubble_measured']}  "
                  f"simulated {r['bubble_simulated']}  ratio {r['ratio']:.2f}  efficiency {r['efficiency']:.2f}  "
                  f"peak bytes measured {r['peak_measured']} simulated {r['peak_simulated']}", flush=True)
    print(f"\n(pinned one actor per core for up to {cores} actors; more actors share the cores)")


if __name__ == "__main__":
    main()
