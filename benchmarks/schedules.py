"""Every built-in schedule on the GPT example, predicted and measured side by side.

For each schedule, on 2 actors (pinned one per core, single-threaded XLA) and 4 actors (sharing the
machine's cores when it has fewer): the step time; each actor's bubble measured from a real-run trace; the
simulator's bubble for the same compiled Programs with costs fitted to that very trace (least squares over
every Run's duration, a fused Run lasting the sum of its tasks); their ratio; peak buffer bytes per actor as
the actors report them against the simulator's; and the pipeline efficiency 1 - mean measured bubble. One
picture per schedule: the simulated timeline above the measured one.

Then predictions that are not fitted to the run they predict: the Monte Carlo simulator
(mpmd.schedules.montecarlo: task times, gaps and hop residuals drawn from the trace's own distributions, hops
per route as latency + bytes / bandwidth) predicts each run's step time and bubble; and costs fitted on 1F1B
with m microbatches predict every other schedule and 1F1B with 2m (per-stage costs split evenly when a
schedule has more stages; I = W = B / 2 where the fit saw no split backward) — and, for the schedules that
split the backward, the same costs with I and W taken from ZB-H1's trace (two traced configurations, as the
tuner profiles a fused and a split variant).

    python -m benchmarks.schedules [--actors 2,4] [--out benchmarks/out] [--steps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import statistics
import time

import numpy as np

import mpmd
from mpmd.compiler.program import Run
from mpmd.observe.trace import as_sim_result, fit_costs, measured_bubbles
from mpmd.schedules.draw import draw_stacked
from mpmd.schedules.montecarlo import Empirical, simulate_monte_carlo
from mpmd.schedules.simulator import Costs, simulate_programs

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
    costs = fit_costs(trace, stages, cores=mesh.shared_cores(), own_core=mesh.one_core_each())  # shared or pinned cores: own times
    sim = simulate_programs(programs, costs, name=f"{name} simulated")
    meas = measured_bubbles(trace)
    picture = out / f"{name}-{n}actors.svg"
    draw_stacked([sim, as_sim_result(trace, f"{name} measured")], [f"{name}, {n} actors: simulated (fitted costs)",
                                                                     f"{name}, {n} actors: measured"], str(picture))
    bubble_m = statistics.mean(meas.values())
    mc = simulate_monte_carlo(programs, costs, runs=100)
    w0, w1 = trace.window()
    return {"schedule": name, "actors": n, "stages": stages, "step_ms": statistics.median(times) * 1e3,
            "traced_ms": (w1 - w0) * 1e3, "mc_ms": mc.step_time * 1e3, "mc_bubble": mc.bubble, "bubble_mean": bubble_m,
            "costs": costs, "programs": programs, "microbatches": args.microbatches,
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
    if not all(x.strip().isdigit() and int(x) >= 1 for x in args.actors.split(",")):
        p.error(f"--actors takes actor counts separated by commas, e.g. 2,4, got {args.actors!r}")
    known = {name for n in (int(x) for x in args.actors.split(",")) for name, _ in schedules_for(n)}
    unknown = sorted(set(args.only.split(",")) - known) if args.only else []
    if unknown:  # (they were skipped in silence, and the run exited 0 having measured nothing)
        p.error(f"--only {','.join(unknown)}: not a schedule this benchmark runs; pick from {', '.join(sorted(known))}")
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
                print(f"{name:22s} {n} actors {stages:2d} stages  skipped: --layers {args.layers} is not a multiple of its stages")
                continue
            with mpmd.RemoteMesh.local(num_actors=n, cpus_per_actor=pin) as mesh:
                r = run_one(gpt, mesh, name, n, stages, args, out)
            rows.append(r)
            fmt = lambda v: [round(float(x), 3) for x in v] if isinstance(v, (list, tuple)) else round(float(v), 3)  # noqa: E731
            print(f"{name:22s} {n} actors {stages:2d} stages  step {r['step_ms']:8.2f} ms  bubble measured {fmt(r['bubble_measured'])}  "
                  f"simulated {fmt(r['bubble_simulated'])}  ratio {r['ratio']:.2f}  efficiency {r['efficiency']:.2f}  "
                  f"peak bytes measured {r['peak_measured']} simulated {r['peak_simulated']}", flush=True)
    print(f"\n(pinned one actor per core for up to {cores} actors; more actors share the cores)")
    print("\nMonte Carlo prediction (costs from the run's own trace) vs the traced step:")
    for r in rows:
        print(f"  {r['schedule']:22s} {r['actors']} actors  step predicted {r['mc_ms']:8.2f} ms measured {r['traced_ms']:8.2f} ms "
              f"({r['mc_ms'] / r['traced_ms']:.2f}x)  bubble predicted {r['mc_bubble']:.3f} measured {r['bubble_mean']:.3f}")
    cross_config(gpt, rows, args, out)


def rescaled(costs: Costs, stages: int) -> Costs:
    """`costs` of s stages for a split of the same layers into `stages` (a multiple of s): each new stage costs
    its old stage's share; I = W = B / 2 where the fit saw no split backward. The per-Run `overhead` stays:
    every Run pays it, however little it computes."""
    old = len(costs.F) if isinstance(costs.F, tuple) else 1
    k = stages // old

    def per(v: float | tuple) -> tuple:
        v = v if isinstance(v, tuple) else (float(v),) * old
        return tuple(v[s // k] / k for s in range(stages))

    b = per(costs.B)
    split = any(per(costs.I)) or any(per(costs.W))
    emp = costs.empirical or Empirical()
    tasks = {(st, kind): tuple(x / k for x in xs) for (s0, kind), xs in emp.tasks for st in range(stages) if st // k == s0}
    if not split:
        tasks.update({(st, kind): tuple(x / 2 for x in xs) for (st, kd), xs in list(tasks.items()) if kd == "B" for kind in "IW"})
    return dataclasses.replace(costs, F=per(costs.F), B=b, I=per(costs.I) if split else tuple(x / 2 for x in b),
                               W=per(costs.W) if split else tuple(x / 2 for x in b),
                               empirical=Empirical(tuple(sorted(tasks.items())), emp.gaps, emp.hops))


def cross_config(gpt, rows: list[dict], args: argparse.Namespace, out: pathlib.Path) -> None:  # noqa: ANN001
    """Costs fitted on 1F1B (m microbatches) predict every other schedule, and 1F1B with 2m microbatches."""
    for n in sorted({r["actors"] for r in rows}):
        base = next((r for r in rows if r["actors"] == n and r["schedule"] == "OneFOneB"), None)
        if base is None:
            continue
        print(f"\ncross-configuration, {n} actors: costs fitted on OneFOneB m={base['microbatches']}, predicting")
        targets = [r for r in rows if r["actors"] == n and r is not base]
        args2 = argparse.Namespace(**{**vars(args), "microbatches": 2 * args.microbatches})
        with mpmd.RemoteMesh.local(num_actors=n, cpus_per_actor=1 if n <= len(os.sched_getaffinity(0)) else None) as mesh:
            targets.append(run_one(gpt, mesh, "OneFOneB", n, n, args2, out))
        zb = next((r for r in rows if r["actors"] == n and r["schedule"] == "ZeroBubbleH1"), None)
        both = with_split_from(base["costs"], zb["costs"]) if zb is not None else None
        for r in targets:
            pred = simulate_monte_carlo(r["programs"], rescaled(base["costs"], r["stages"]), runs=100)
            line = (f"  {r['schedule']:22s} m={r['microbatches']:2d}  step predicted {pred.step_time * 1e3:8.2f} ms measured "
                    f"{r['traced_ms']:8.2f} ms ({pred.step_time * 1e3 / r['traced_ms']:.2f}x)  bubble predicted {pred.bubble:.3f} "
                    f"measured {r['bubble_mean']:.3f}")
            if both is not None and r is not zb and splits_backward(r["programs"]):
                p2 = simulate_monte_carlo(r["programs"], rescaled(both, r["stages"]), runs=100)
                line += f"; with I/W from ZB-H1's trace {p2.step_time * 1e3:8.2f} ms ({p2.step_time * 1e3 / r['traced_ms']:.2f}x)"
            print(line, flush=True)


def splits_backward(programs: list) -> bool:
    """Do these Programs run split-backward (I, W) tasks?"""
    return any(t.kind in ("I", "W") for p in programs for ins in p.instructions if isinstance(ins, Run) for t in ins.label.tasks)


def with_split_from(costs: Costs, split: Costs) -> Costs:
    """`costs` (a fit without a split backward) with I and W, and their samples, from `split` (a fit of the
    same stages with one)."""
    emp, other = costs.empirical or Empirical(), split.empirical or Empirical()
    tasks = {k: v for k, v in emp.tasks if k[1] not in ("I", "W")}
    tasks.update({k: v for k, v in other.tasks if k[1] in ("I", "W")})
    return dataclasses.replace(costs, I=split.I, W=split.W, empirical=Empirical(tuple(sorted(tasks.items())), emp.gaps, emp.hops))


if __name__ == "__main__":
    main()
