"""Actors that share cores: a replay of compiled Programs where Runs running at once slow each other down.

The replay engines give every actor a device of its own. When more actors than cores run on one host (4
CPU actors on a 2-core machine), k Runs computing at once on c < k cores each progress at c / k of their own
speed. `replay_shared` finds durations consistent with that: replay, measure over each Run's span how many
Runs ran beside it (time-weighted), stretch its duration by max(1, (1 + others) / cores), and replay again,
damped, until the step time settles. Transfers are not stretched (the copies are short beside the Runs).
A trace of actors sharing cores is read the other way (`fit_costs(..., cores=c)`): each Run's measured
duration divided by the same factor over its measured span is what it would take on a core of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from mpmd.schedules.validation import ProgramReplay, replay_programs
from transport.program import Program, Recv, Run

ROUNDS = 12  # fixed-point iterations (the step time moves < 0.1 % after ~8 on the GPT's Programs)


def sharing_factors(spans: list[tuple[int, float, float]], cores: int) -> list[float]:
    """For spans (actor, start, end) of Runs, how much slower each ran for sharing `cores` cores: max(1, (1 +
    the time-weighted mean number of other actors' Runs during it) / cores). An actor's own Runs follow one
    another, so the Runs beside one are all the others: the integral of how many run at once over its span,
    less its own length (a sweep over the starts and ends, then a lookup per span)."""
    events = sorted([(s, 1) for _, s, e in spans if e > s] + [(e, -1) for _, s, e in spans if e > s])
    times, integral = [], []  # the integral of the number running, at each event time
    running, total, last = 0, 0.0, None
    for t, d in events:
        if last is not None:
            total += running * (t - last)
        if times and times[-1] == t:
            integral[-1] = total
        else:
            times.append(t)
            integral.append(total)
        running += d
        last = t

    def area(t: float) -> float:  # the integral up to t, t one of the event times
        return integral[bisect.bisect_left(times, t)]

    return [max(1.0, (1.0 + (area(e) - area(s) - (e - s)) / (e - s)) / cores) if e > s else 1.0 for _, s, e in spans]


def replay_shared(programs: list[Program], run_time: Callable[[int, Run], float], transfer_time: Callable[[int, Recv], float],
                  cores: int | None) -> tuple[ProgramReplay, dict[tuple[int, int], float]]:
    """`replay_programs` with the actors' Runs sharing `cores` cores (None, or at least one per actor: the plain
    replay). `run_time` is asked once per Run. Returns the replay and each Run's stretch factor (>= 1)."""
    index = {(a, id(ins)): i for a, p in enumerate(programs) for i, ins in enumerate(p.instructions) if isinstance(ins, Run)}
    base: dict[tuple[int, int], float] = {}

    def once(a: int, r: Run) -> float:
        k = (a, index[(a, id(r))])
        if k not in base:
            base[k] = run_time(a, r)
        return base[k]

    rep = replay_programs(programs, once, transfer_time)
    stretch = {k: 1.0 for k in base}
    if cores is None or cores >= len(programs) or rep.stuck:
        return rep, stretch
    for _ in range(ROUNDS):
        keys = list(rep.start)
        now = dict(zip(keys, sharing_factors([(k[0], rep.start[k], rep.end[k]) for k in keys], cores)))
        stretch = {k: 0.5 * stretch[k] + 0.5 * now.get(k, 1.0) for k in stretch}
        rep = replay_programs(programs, lambda a, r: base[(a, index[(a, id(r))])] * stretch[(a, index[(a, id(r))])],
                              transfer_time)
    return rep, stretch


__all__ = ["replay_shared", "sharing_factors"]
