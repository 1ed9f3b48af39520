"""Actors that share cores: replays where Runs running at once slow each other down.

The replay engines give every actor a device of its own. When more actors than cores run on one host (4
CPU actors on a 2-core machine), the k Runs computing at a moment on c < k cores each progress at c / k of
their own speed (processor sharing). A Run of own time W that ran over [s, e) did W = ∫ min(1, c / k(t)) dt
of work there; its slowdown is (e - s) / that integral. `settle` finds durations consistent with it: replay,
compute each Run's slowdown over its replayed span, stretch its own time by it, and replay again, damped,
until the slowdowns settle. A Run's idle part (the runtime's gap before it computes) is neither stretched nor
counted as load, and transfers are not stretched (the copies are short beside the Runs). The runtime's own
threads (each actor's event loop dispatching Runs, sending and receiving; `Costs.runtime_cpu` per
instruction) load the same cores: their CPU seconds over the step, spread evenly over it, count as that many
more things running (the sum of `actor_loads`; on 4 actors sharing 2 cores with small stages it is more than the Runs' own
work). Serving that load first instead (the Runs sharing what is left) over-predicted the tuner's
interleaved and V-shaped candidates on 4 actors (measured 0.74-0.82x their prediction) where this model did not.
Actors pinned to a core each (`cores` None, `Costs.runtime_cpu` > 0) share it with their own event loop
alone: an actor whose loop uses L CPU seconds over a step of T (`runtime_cpu` x its Runs, Sends and Recvs)
runs its Runs at 1 / (1 + L / T). `cores` at least the number of actors: the plain replay (a core each to
spare, as `fit_costs` reads such a trace).

A trace of actors sharing cores is read the other way (`fit_costs(..., cores=c)`): the integral over each
Run's measured span is the time it would take on a core of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mpmd.schedules.validation import ProgramReplay, TableReplay, replay_programs, replay_table
from transport.program import Program, Recv, Run, Send

ROUNDS = 30  # at most; each round roughly halves the error (stops when no slowdown would move by 1e-5)


def own_times(spans: list[tuple[int, float, float]], cores: int, background: float = 0.0) -> list[float]:
    """For spans (actor, start, end) of Runs that shared `cores` cores, each one's work: the integral over
    its span of min(1, cores / (number running + `background`)), `background` being how many cores the
    runtime's own threads keep busy on average (as that many more things running). An actor's Runs follow one
    another (one at a time)."""
    events = sorted([(s, 1) for _, s, e in spans if e > s] + [(e, -1) for _, s, e in spans if e > s])
    times: list[float] = []
    area: list[float] = []  # the integral of min(1, cores / running) up to each event time
    running, total, last = 0, 0.0, 0.0
    for t, d in events:
        if running:
            total += (t - last) * min(1.0, cores / (running + background))
        if times and times[-1] == t:
            area[-1] = total
        else:
            times.append(t)
            area.append(total)
        running += d
        last = t

    def at(t: float) -> float:  # t is one of the event times
        return area[bisect.bisect_left(times, t)]

    return [at(e) - at(s) if e > s else 0.0 for _, s, e in spans]


def sharing_factors(spans: list[tuple[int, float, float]], cores: int, background: float = 0.0) -> list[float]:
    """How much slower each span's Run ran for sharing `cores` cores (with `background` as in `own_times`): its
    length over its own time (>= 1)."""
    return [(e - s) / w if w > 0 else 1.0 for (_, s, e), w in zip(spans, own_times(spans, cores, background))]


def runtime_loads(programs: list[Program], runtime_cpu: float) -> list[float]:
    """The CPU seconds each actor's event loop spends on its Program: `runtime_cpu` per Run, Send and Recv."""
    return [runtime_cpu * sum(isinstance(ins, (Run, Send, Recv)) for ins in p.instructions) if runtime_cpu else 0.0
            for p in programs]


def background_load(load: float, end: dict[Any, float], extra: float = 0.0) -> float:
    """How many cores `load` CPU seconds of the runtime's own work keep busy on average over a replayed step
    whose Runs end at `end` (replayed from 0), the step lasting `extra` more (its lead and tail: the window
    `fit_costs` reads the load over)."""
    span = max(end.values(), default=0.0) + extra
    return load / span if load > 0 and span > 0 else 0.0


def settle(replay: Callable[[Callable[[Hashable], float]], tuple[dict[Any, float], dict[Any, float]]],
           actor: Callable[[Hashable], int], busy: dict[Hashable, float], idle: dict[Hashable, float], cores: int | None,
           initial: dict[Hashable, float] | None = None, rounds: int = ROUNDS, extra: float = 0.0,
           actor_loads: Sequence[float] = ()) -> dict[Hashable, float]:
    """The slowdown of every Run (a key of `busy`) at the fixed point: `replay(duration)` replays with
    `duration(key)` and returns (start, end) per key; a Run lasts idle + busy * slowdown, its load spans
    [start + idle, end). `initial`: slowdowns to begin from (a nearby fixed point: few `rounds` then suffice).
    `actor_loads[a]`: CPU seconds actor a's event loop uses over the step (the step lasting `extra` beyond the
    last Run's end: see `background_load`). With `cores`, all the loops' CPU loads the shared cores, spread
    over the step evenly; `cores` None: each actor has a core of its own, shared only with its own loop, and
    its Runs progress at 1 / (1 + its load / the step)."""
    load = sum(actor_loads)
    stretch = {k: (initial or {}).get(k, 1.0) for k in busy}
    for _ in range(rounds):
        start, end = replay(lambda k: idle[k] + busy[k] * stretch[k])
        ks = [k for k in busy if k in start]
        if cores is None:
            now = [1.0 + background_load(actor_loads[actor(k)], end, extra) for k in ks]
        else:
            now = sharing_factors([(actor(k), start[k] + idle[k], end[k]) for k in ks], cores, background_load(load, end, extra))
        moved = max((abs(f - stretch[k]) for k, f in zip(ks, now)), default=0.0)
        if moved < 2e-5:  # settled: take the slowdowns this replay gives (the damped step stops short of them)
            stretch.update(zip(ks, now))
            break
        for k, f in zip(ks, now):
            stretch[k] = 0.5 * stretch[k] + 0.5 * f
    return stretch


def replay_programs_shared(programs: list[Program], run_time: Callable[[int, Run], float], transfer_time: Callable[[int, Recv], float],
                           cores: int | None, idle: Callable[[int, Run], float] = lambda a, r: 0.0,
                           initial: dict[tuple[int, int], float] | None = None, rounds: int = ROUNDS,
                           extra: float = 0.0, actor_loads: Sequence[float] = ()) -> tuple[ProgramReplay, dict[tuple[int, int], float]]:
    """`replay_programs` with the actors' Runs sharing `cores` cores (None: each actor's own core shared with its
    own event loop's `actor_loads`; at least one per actor, or no loads: the plain replay). `run_time`
    (then `idle`, its part before computing) is asked once per Run. Returns the replay and each Run's slowdown
    (>= 1), by (actor, index); `initial`, `rounds`, `extra` and `actor_loads` (one per Program) as for `settle`."""
    index = {(a, id(ins)): i for a, p in enumerate(programs) for i, ins in enumerate(p.instructions) if isinstance(ins, Run)}
    total: dict[tuple[int, int], float] = {}
    gaps: dict[tuple[int, int], float] = {}

    def once(a: int, r: Run) -> float:
        k = (a, index[(a, id(r))])
        if k not in total:
            total[k] = run_time(a, r)
            gaps[k] = min(idle(a, r), total[k])
        return total[k]

    rep = replay_programs(programs, once, transfer_time)
    shared = cores is not None and cores < len(programs)
    if rep.stuck or not (shared or (cores is None and any(actor_loads))):
        return rep, {k: 1.0 for k in total}
    busy = {k: total[k] - gaps[k] for k in total}

    def replay(duration: Callable[[Hashable], float]) -> tuple[dict[Any, float], dict[Any, float]]:
        r = replay_programs(programs, lambda a, r: duration((a, index[(a, id(r))])), transfer_time)
        return r.start, r.end

    stretch = settle(replay, lambda k: k[0], busy, gaps, cores if shared else None, initial, rounds, extra, actor_loads)

    def settled(a: int, r: Run) -> float:
        k = (a, index[(a, id(r))])
        return gaps[k] + busy[k] * stretch[k]

    return replay_programs(programs, settled, transfer_time), stretch


def replay_table_shared(table: list[list[Any]], num_stages: int, actor_of: Callable[[int], int], duration: Callable[[Any], float],
                        transfer: Callable[[Any, Any], float], cores: int | None, idle: Callable[[Any], float] = lambda t: 0.0,
                        extra: float = 0.0, actor_loads: Sequence[float] = ()) -> tuple[TableReplay, dict[Any, float]]:
    """`replay_table` with the actors sharing `cores` cores (see `replay_programs_shared`); slowdowns by task."""
    rep = replay_table(table, num_stages, actor_of, duration, transfer)
    tasks = [t for row in table for t in row]
    shared = cores is not None and cores < len(table)
    if rep.stuck or not (shared or (cores is None and any(actor_loads))):
        return rep, {t: 1.0 for t in tasks}
    gaps = {t: min(idle(t), duration(t)) for t in tasks}
    busy = {t: duration(t) - gaps[t] for t in tasks}

    def replay(d: Callable[[Hashable], float]) -> tuple[dict[Any, float], dict[Any, float]]:
        r = replay_table(table, num_stages, actor_of, d, transfer)
        return r.start, r.end

    stretch = settle(replay, lambda t: actor_of(t.stage), busy, gaps, cores if shared else None, extra=extra, actor_loads=actor_loads)
    rep = replay_table(table, num_stages, actor_of, lambda t: gaps[t] + busy[t] * stretch[t], transfer)
    return rep, stretch


__all__ = ["background_load", "own_times", "replay_programs_shared", "replay_table_shared", "runtime_loads", "settle",
           "sharing_factors"]
