"""Measure each marker segment's F, B, I and W time on the actors: `profile_costs(step, *args)`.

The step is compiled with every segment its own stage (`SegmentProfile`: stage s on actor s % p, GPipe's
order, so one microbatch's neighbouring tasks sit on different actors and never fuse into one Run), warmed
up, and traced for three steps, round by round with the variants below (a busy spell lands on all of them); `fit_costs` turns each step's Run durations into per-segment times, and the
median over the steps is kept. A second variant with
split backwards gives I and W. A third puts every segment on one actor, where a microbatch's tasks fuse into
few Runs: what the segments timed one Run each cost beyond that is each Run's own overhead (`run_overhead`;
0.1-0.6 ms per Run on this 2-core VM, as much as a small segment's compute), paid once per stage task after
grouping. What comes back, a `SegmentCosts`, is what `balance=` and `mpmd.tune` read.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from mpmd.compiler.eqns import nbytes
from mpmd.compiler.loop_tasks import analyse_loop_body, find_step_loop
from mpmd.compiler.stages import is_marker, split_stages
from mpmd.observe.trace import fit_costs
from mpmd.schedules.balance import SegmentCosts, SegmentProfile

log = logging.getLogger(__name__)

__all__ = ["profile_costs", "segment_layout"]


def segment_layout(step: Any, *args: Any) -> tuple[int, tuple[float, ...], int, int]:
    """(number of marker segments, bytes each segment's closing marker passes on, microbatches, rows per
    microbatch: the second axis every batch leaf shares, 0 when one has none or they differ, e.g. a
    per-microbatch PRNG key [m] or [m, 2] next to inputs [m, rows, ...]) of the traced step."""
    outer, _ = step.trace(*args)
    loop = find_step_loop(outer)
    body = analyse_loop_body(loop)
    split = split_stages(body)
    out = []
    for s in range(split.num_stages):
        fwd = split.regions.get((s, "F"), [])
        out.append(float(sum(nbytes(v) for v in fwd[-1].outvars)) if fwd and is_marker(fwd[-1]) else 0.0)
    return split.num_stages, tuple(out), loop.num_microbatches, batch_rows(loop)


def batch_rows(loop: Any) -> int:
    """The rows per microbatch of the step loop's batch: the second axis of every batch leaf if they all have the
    same one, else 0 (the first leaf alone could be a key [m, 2] or a context [m, 1, d] beside x [m, rows, d])."""
    leaves = list(loop.eqn.invars[:loop.num_mb_leaves])
    if len(leaves) > 1 and leaves[-1].aval.shape == (loop.num_microbatches,) and leaves[-1].aval.dtype == np.uint32:
        leaves = leaves[:-1]  # the microbatch index accumulate_grads adds for closed-over nnx Rngs (mpmd/api.py)
    second = {tuple(v.aval.shape[1:2]) for v in leaves}
    return int(next(iter(second))[0]) if len(second) == 1 and () not in second else 0


def _traced_costs(step: Any, variants: list[tuple[SegmentProfile, int | None]], args: tuple[Any, ...], steps: int,
                  traced: int = 3, own_core: bool = False) -> list[tuple[Any, set[int]]]:
    """Per (schedule, cores) variant of the step: its costs fitted to `traced` steps, each number the median over the
    steps' own fits (one traced step of small tasks moves 10-30 % on a busy machine), and the segments that ran an I
    task. The variants' traced steps are taken round by round — one of each, then again, each after an untimed step
    of its own — so that a busy spell of a shared machine lands on every variant alike: `run_overhead_of` and
    `split_overhead_of` read differences between them, and variants measured one after the other once read a Run's
    overhead as 2.9 ms where it is about 0 (the variant timed apart ran in a busy spell, the fused one after it),
    which put every prediction of that tune off (3 of 24 candidates within 10 %; 2026-12-06)."""
    from mpmd.runtime.array import wait_ready

    made = [step._variant(schedule) for schedule, _ in variants]  # (counts of their own: the loop's load count stays)
    for variant in made:
        for _ in range(max(1, steps)):
            wait_ready(variant.call_bound(args))
    fits: list[list[Any]] = [[] for _ in variants]
    with_i: list[set[int]] = [set() for _ in variants]
    for _ in range(traced):
        for k, ((schedule, cores), variant) in enumerate(zip(variants, made)):
            wait_ready(variant.call_bound(args))  # (after another variant's step: this one's caches warm again)
            with step.mesh.trace() as t:
                wait_ready(variant.call_bound(args))
            fits[k].append(fit_costs(t, schedule.num_stages, -1, per_run=False, cores=cores, own_core=own_core))
            with_i[k] |= t.stages_with("I")
    return [(median_costs(f), w) for f, w in zip(fits, with_i)]


def median_costs(fits: list[Any]) -> Any:
    """One `Costs` from several fits of the same Programs: each per-stage time, latency, bandwidth, gap, other,
    overhead, lead, tail and runtime CPU the median over the fits, each route's latency and bandwidth the median
    over the fits that measured it, and the samples the Monte Carlo draws (tasks, gaps, hop residuals, factors)
    those of every fit together (the first fit's alone were paired with the medians before; a review) — each still
    measured against its own fit's costs and route lines, which differ from the medians by the fits' spread."""
    import dataclasses
    import statistics

    from mpmd.schedules.montecarlo import Empirical

    if len(fits) == 1:
        return fits[0]
    per_stage = {k: tuple(statistics.median(v) for v in zip(*(getattr(f, k) for f in fits))) for k in ("F", "B", "I", "W")}
    scalars = {k: statistics.median(getattr(f, k) for f in fits) for k in ("latency", "bandwidth", "gap", "other", "overhead", "lead", "tail",
                                                                  "runtime_cpu")}
    routes: dict[tuple[int, int], list[tuple[float, float]]] = {}
    tasks: dict[tuple[int, str], list[float]] = {}
    hops: dict[tuple[int, int], list[float]] = {}
    measured = [f.empirical for f in fits if f.empirical is not None]
    for f in fits:
        for pair, lb in f.routes:
            routes.setdefault(pair, []).append(lb)
    for e in measured:
        for key, v in e.tasks:
            tasks.setdefault(key, []).extend(v)
        for pair, v in e.hops:
            hops.setdefault(pair, []).extend(v)
    pooled = Empirical.of(tasks, [g for e in measured for g in e.gaps], hops, [x for e in measured for x in e.factors]) \
        if measured else None
    medians = tuple(sorted((pair, (statistics.median(l for l, _ in v), statistics.median(b for _, b in v))) for pair, v in routes.items()))
    return dataclasses.replace(fits[0], **per_stage, **scalars, routes=medians, empirical=pooled)


MAX_WARMUP = 1000  # warm-up steps profile_costs and tune take at most


def check_steps(where: str, name: str, steps: Any) -> None:
    """A TypeError or ValueError unless `steps`, the warm-up steps run before the traced ones, is an int >= 1."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise TypeError(f"{where}: {name} (the steps run to warm up before the traced ones) must be an int >= 1, got "
                        f"{type(steps).__name__} {steps!r:.40}")
    if not 1 <= steps <= MAX_WARMUP:  # (2**70 was taken, and ran for good; a probe)
        raise ValueError(f"{where}: {name} (the steps run to warm up before the traced ones) must be 1 to {MAX_WARMUP}, got {steps}")


MIN_TASK_SECONDS = 1e-9  # the time a measured task that exists is given at least


def split_overhead_of(i: tuple[float, ...], w: tuple[float, ...], together: Any, cap: float) -> float:
    """One I or W Run's own overhead: what the segments' I and W, timed a Run each, cost beyond the same segments'
    whole backward fused on one actor (`together`), per I and W Run; at most `cap` (the F and B Runs' overhead) and
    the shortest I or W measured. (Taken before as the median over segments of I + W - B, which assumed a split
    backward computes exactly what B does: it came out at 0.03 ms where an F or B Run's was 0.11, so a stage of k
    segments paid k - 1 overheads too many in each I and W, and the split-backward schedules were predicted 5-12 %
    slow beside the others. Recomputed for the 23 candidates of benchmarks.tune's MLP as last measured on a quiet
    machine: measured / simulated spread 1.22 -> 1.19, within 10 % of the median 21 -> 23.)"""
    runs = [x for x in (*i, *w) if x > MIN_TASK_SECONDS]
    if not runs:
        return 0.0
    extra = (sum(i) + sum(w) - sum(together.B)) / len(runs)
    return max(0.0, min(extra, cap, min(runs)))


def run_overhead_of(apart: Any, together: Any, n: int) -> float:
    """One Run's own overhead: what `n` segments timed a Run each (`apart`: F and B per segment) cost beyond the
    same segments fused on one actor (`together`), per Run, at most the shortest F or B measured (every measured
    Run holds one overhead). That difference of two noisy totals came out at 0.87 ms once, above every segment's F
    but one: each segment less the overhead was nothing, every grouping cost the same, and balance= picked a
    stage of 6 segments against one of the head alone, 2.9x slower than "auto" (a probe)."""
    if n <= 1:
        return 0.0
    measured = [x for x in (*apart.F, *apart.B) if x > MIN_TASK_SECONDS]
    extra = (sum(apart.F) + sum(apart.B) - sum(together.F) - sum(together.B)) / (2 * n)
    return max(0.0, min(extra, min(measured, default=0.0)))


def profile_costs(step: Any, *args: Any, steps: int = 2, split_backward: bool = True) -> SegmentCosts:
    """Per-segment costs of `step` (a `DistributedFunction`) on these arguments (bound, as
    `DistributedFunction.call_bound` takes them), measured on its mesh's actors
    (see the module docstring). Compiles one or two variants of the step; leaves the arguments as they were."""
    check_steps("profile_costs", "steps", steps)
    n, out_bytes, m, rows = segment_layout(step, *args)
    p = min(len(step.mesh), n)
    log.info("profiling %d segments on %d actors, %d microbatches", n, p, m)
    source = "measured on the actors"
    if p == 1 and n > 1:  # (each stage's tasks fuse into one Run per microbatch on one actor)
        source = "measured on 1 actor: its segments run fused there, so each has an equal share of their total"
        log.warning("profile_costs on a mesh of 1 actor cannot time the %d segments apart (they run fused): each gets an equal "
                    "share of their total; profile on 2 or more actors to balance stages by them", n)
    cores = getattr(step.mesh, "shared_cores", lambda: None)()  # actors sharing this host's cores: fit own times
    own = bool(getattr(step.mesh, "one_core_each", lambda: False)())  # or each on a core of its own, with its loop
    # The segments apart (a Run each), their backward split (I and W apart), and every segment on one actor, where
    # a microbatch's tasks fuse, so that its total is nearly free of per-Run overhead.
    variants = [(SegmentProfile(n, p, split=False), cores), (SegmentProfile(n, 1), None)]
    if split_backward:
        variants.append((SegmentProfile(n, p, split=True), cores))
    (fused, _), (together, _), *split = _traced_costs(step, variants, args, steps, own_core=own)
    i: tuple[float, ...] = ()
    w: tuple[float, ...] = ()
    if split:
        parts, with_i = split[0]
        # A zero I means "no input-gradient task" to the balancer; a segment that has one but whose I always ran
        # fused with another task may fit to zero: it keeps a token time, so that it is not taken for one without.
        i = tuple(max(x, MIN_TASK_SECONDS) if k in with_i else 0.0 for k, x in enumerate(parts.I))
        w = tuple(parts.W)
    run_overhead = run_overhead_of(fused, together, n)
    split_overhead = split_overhead_of(i, w, together, run_overhead)
    return SegmentCosts(F=tuple(fused.F), B=tuple(fused.B), I=i, W=w, activation_bytes=out_bytes, latency=fused.latency,
                        bandwidth=fused.bandwidth, gap=fused.gap, other=fused.other, lead=fused.lead, tail=fused.tail, cores=cores,
                        source=source,
                        microbatch_rows=rows, run_overhead=run_overhead, split_overhead=split_overhead, runtime_cpu=fused.runtime_cpu)
