"""Monte Carlo simulation of compiled Programs on costs measured as distributions, not means.

A pipeline's step time is set by its critical path, and the slow Runs, dispatch gaps and hops that land on
it cost the step what they cost: a model that charges every Run and hop its mean misses them (measured here:
bubbles 0.91-1.83x the mean model's). `Empirical` keeps what a trace measured — every single-task Run's
duration per (stage, kind), every Run's duration over its fitted one (the spread of Runs doing several tasks:
most of 1F1B's), every gap between could-start and start, every hop's time beyond its route's fitted
``latency + bytes / bandwidth`` — and `simulate_monte_carlo` replays the Programs `runs` times, each Run and
hop drawing from those samples (a fixed seed: the same answer every time), and reports the mean.

A traced 2-actor 1F1B step replayed with its own Runs' durations, gaps and hops is the step; with every Run
at its fitted mean instead it ended 0-7 % early (this VM's Runs of one task vary by +-15 % from one to the
next, and the slow ones on the critical path are not made up by fast ones elsewhere).

    costs = fit_costs(trace, num_stages)                 # carries costs.empirical and costs.routes
    mc = simulate_monte_carlo(programs, costs, runs=200)
    mc.step_time, mc.bubble, mc.p90
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpmd.errors import PipelineError, ScheduleError
from mpmd.schedules.sharing import replay_programs_shared, runtime_loads
from mpmd.schedules.validation import check_programs, is_count, stages_without_input_grad
from transport.program import Program, Recv, Run, Task
from transport.protocol import dtype_from_name

Samples = tuple[float, ...]


@dataclass(frozen=True)
class Empirical:
    """Measured samples (seconds). `tasks`: ((stage, kind), durations of Runs doing just that task);
    `gaps`: a Run's start minus when it could have started; `hops`: ((src, dst), each hop's time minus its
    route's fitted latency + bytes / bandwidth); `factors`: each Run's duration over the one its fitted costs
    give it (drawn as measured for Runs doing several tasks and tasks without samples; without factors,
    each of a fused Run's tasks draws from its samples). Tuples of pairs, so that `Costs` stays hashable."""

    tasks: tuple[tuple[tuple[int, str], Samples], ...] = ()
    gaps: Samples = ()
    hops: tuple[tuple[tuple[int, int], Samples], ...] = ()
    factors: Samples = ()

    def task_samples(self) -> dict[tuple[int, str], Samples]:
        return dict(self.tasks)

    def hop_residuals(self) -> dict[tuple[int, int], Samples]:
        return dict(self.hops)

    @classmethod
    def of(cls, tasks: Mapping[tuple[int, str], list[float]], gaps: list[float],
           hops: Mapping[tuple[int, int], list[float]], factors: Sequence[float] = ()) -> Empirical:
        return cls(tuple(sorted((k, tuple(v)) for k, v in tasks.items() if v)), tuple(gaps),
                   tuple(sorted((k, tuple(v)) for k, v in hops.items() if v)), tuple(factors))


@dataclass(frozen=True)
class MonteCarloResult:
    """What `runs` replays found: the mean step time and bubble (what to predict with), their spread."""

    step_time: float
    bubble: float
    bubble_per_actor: tuple[float, ...]
    step_times: tuple[float, ...]

    @property
    def p90(self) -> float:
        s = sorted(self.step_times)
        return s[min(len(s) - 1, int(0.9 * len(s)))]

    @property
    def stdev(self) -> float:
        return statistics.pstdev(self.step_times) if len(self.step_times) > 1 else 0.0


def _recv_bytes(recv: Recv) -> int:
    return math.prod(recv.shape) * dtype_from_name(recv.dtype).itemsize


def _centred(tasks: dict[tuple[int, str], Samples], costs: Any) -> dict[tuple[int, str], Samples]:
    """Each (stage, kind)'s samples scaled so that their mean is the cost's own figure for it (its shape kept).

    The samples are the Runs that did that task alone (warm-up and cool-down); `fit_costs` fits the means over
    every Run, fused ones included, and a task inside a fused Run may take longer or shorter than alone. The
    mean is the fit's; the spread around it is what the samples show."""
    out = {}
    for (stage, kind), xs in tasks.items():
        mean = statistics.fmean(xs)
        want = costs.task_time(Task(stage, kind, 0))
        out[(stage, kind)] = tuple(x * want / mean for x in xs) if mean > 0 and want > 0 else xs
    return out


MAX_RUNS = 10_000  # replays one call makes at most


def simulate_monte_carlo(programs: list[Program], costs: Any, runs: int = 100, seed: int = 0) -> MonteCarloResult:
    """Replay `programs` `runs` times on `costs` (an `mpmd.Costs`), drawing each Run's task times (centred on
    the costs' own means), its gap and each hop's residual from `costs.empirical` where it has samples (else the
    costs' own numbers; a Run doing several tasks, or a task without samples: its costs' time times a drawn
    factor, where the empirical has factors: their mean may be above 1, the slow Runs a robust fit left out of its
    means), and hops' base times from `costs.routes` per (sender, receiver) where given. Deterministic for a given `seed`."""
    if not is_count(runs) or not 1 <= runs <= MAX_RUNS:  # (10**6 ran on for minutes; a probe)
        raise ValueError(f"simulate_monte_carlo: runs must be an int from 1 to {MAX_RUNS} (how many replays), got {runs!r:.40}")
    if not isinstance(programs, (list, tuple)) or not programs:
        raise ScheduleError(f"simulate_monte_carlo: programs must be a list of Programs, one per actor, got {programs!r:.80}")
    if not all(hasattr(costs, m) for m in ("check_stages", "check_actors", "run_time", "route_time")):  # (None or a dict
        # met "'NoneType' object has no attribute 'check_actors'"; a probe. mpmd.Costs is the simulator's: not imported here)
        raise ScheduleError(f"simulate_monte_carlo: costs must be mpmd.Costs (e.g. mpmd.Costs(F=1, B=2) or fit_costs(trace, "
                            f"num_stages)), got {type(costs).__name__}")
    stages, num_stages = stages_without_input_grad(programs)  # (their W runs the whole backward: it costs I + W,
    try:  # (as simulate_programs: per-stage values for another number of stages, or a route past the programs' actors,
        # were taken silently; a probe)
        if num_stages:
            costs.check_stages(num_stages)
        costs.check_actors(len(programs))
    except ValueError as e:
        raise ScheduleError(f"simulate_monte_carlo: {e}") from None
    if stages:                                                # as in every other simulator)
        costs = costs.without_input_grad(stages, num_stages)
    emp = getattr(costs, "empirical", None) or Empirical()
    tasks, hops, gaps = _centred(emp.task_samples(), costs), emp.hop_residuals(), emp.gaps
    # The factors as measured, not scaled to mean 1: the fit's means are robust, the Runs slowest against them left
    # out, and the factors bring them back (their mean 1.01-1.05 over a traced step's fused Runs; scaled to 1, every
    # schedule's step was predicted 1-4 % short of its held-out steps).
    if not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in emp.factors):  # (they scale Runs as they are)
        raise ScheduleError("simulate_monte_carlo: costs.empirical.factors must be finite numbers above 0 (each a Run's "
                            f"measured over fitted duration), got {tuple(emp.factors)!r:.80}")
    factors = tuple(emp.factors)
    rng = random.Random(seed)
    cores = getattr(costs, "cores", None)
    loads = runtime_loads(programs, getattr(costs, "runtime_cpu", 0.0))
    near = None  # with shared cores: every draw's fixed point starts from the mean model's (a few rounds then do)
    if cores is not None or any(loads):
        near = replay_programs_shared(programs, lambda a, r: costs.run_time(r.label),
                                      lambda a, r: costs.route_time(r.from_actor, a, _recv_bytes(r)), cores, lambda a, r: costs.gap,
                                      extra=costs.lead + costs.tail, actor_loads=loads)[1]
    step_times: list[float] = []
    bubbles: list[list[float]] = []
    for _ in range(runs):
        drawn_gap: dict[tuple[int, int], float] = {}

        def run_time(a: int, r: Run) -> float:
            key = (a, id(r))
            g = rng.choice(gaps) if gaps else costs.gap
            drawn_gap[key] = g
            one = (r.label.tasks[0].stage, r.label.tasks[0].kind) if r.label.kind == "task" and len(r.label.tasks) == 1 else None
            if one in tasks:
                return g + rng.choice(tasks[one]) + costs.overhead
            if r.label.kind == "task" and r.label.tasks:
                if factors:
                    return g + (sum(costs.task_time(t) for t in r.label.tasks) + costs.overhead) * rng.choice(factors)
                draws = (rng.choice(tasks[(t.stage, t.kind)]) if (t.stage, t.kind) in tasks else costs.task_time(t) for t in r.label.tasks)
                return g + sum(draws) + costs.overhead
            return g + costs.other + costs.overhead

        def transfer_time(a: int, r: Recv) -> float:
            base = costs.route_time(r.from_actor, a, _recv_bytes(r))
            res = hops.get((r.from_actor, a))
            return max(0.0, base + rng.choice(res)) if res else base

        rep, _ = replay_programs_shared(programs, run_time, transfer_time, cores, lambda a, r: drawn_gap[(a, id(r))], initial=near,
                                        rounds=4, extra=costs.lead + costs.tail, actor_loads=loads)
        if rep.stuck:
            check_programs(programs)
            raise PipelineError("internal: programs got stuck on a cost model but not on unit costs")
        step = max(rep.end.values(), default=0.0) + costs.lead + costs.tail  # idle for every actor (see Costs)
        step_times.append(step)
        per = []
        for a, prog in enumerate(programs):
            busy = sum(rep.end[(a, i)] - rep.start[(a, i)] - drawn_gap.get((a, id(ins)), 0.0)
                       for i, ins in enumerate(prog.instructions) if isinstance(ins, Run) and (a, i) in rep.end)
            per.append(1.0 - busy / step if step > 0 else 0.0)
        bubbles.append(per)
    per_actor = tuple(statistics.fmean(b[a] for b in bubbles) for a in range(len(programs)))
    return MonteCarloResult(statistics.fmean(step_times), statistics.fmean(per_actor) if per_actor else 0.0, per_actor,
                            tuple(step_times))


__all__ = ["Empirical", "MonteCarloResult", "simulate_monte_carlo"]
