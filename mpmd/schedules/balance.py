"""Balanced stages: group a step's marker segments into a schedule's stages. Pure: costs in, grouping out.

A user may mark more boundaries than the schedule has stages, e.g. a `pipeline_yield` after every layer.
The code between two consecutive markers is a *segment*; a *grouping* says how many consecutive segments
each stage takes, e.g. ``(3, 2, 2, 1)`` for 8 segments on 4 stages. A grouping never cuts inside a segment.

The schedule's `balance` says which grouping the compiler uses:

    balance=None         one segment per stage (the number of markers must match num_stages)
    balance="even"       equal segment counts, larger groups first: 8 segments on 3 stages -> (3, 3, 2)
    balance="auto"       the grouping with the shortest simulated step under the schedule, on costs from
                         XLA's cost analysis of each segment (deterministic, computed while compiling)
    balance=SegmentCosts the same search on given costs, e.g. the actors' measured times
                         (`step.profile_costs(*args)`)
    balance=(3, 2, 2, 1) this grouping

"Shortest simulated step" rather than "equal FLOPs": the slowest stage sets the pace of the pipeline, the
first and last stages carry the embedding, head and loss, an interleaved or V placement sums several stages
on one actor, and a zero-bubble schedule's W tasks fill idle slots; the simulator (`simulate`) sees all that.

    seg = SegmentCosts(F=(4, 4, 2, 1, 1, 1, 1, 2), B=(8, 8, 4, 2, 2, 2, 2, 4))
    best_grouping(OneFOneB(num_stages=4), 8, seg)          # (1, 1, 3, 3): stage loads 12, 12, 12, 12
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mpmd.errors import ScheduleError
from mpmd.schedules.builtin import BALANCE_MODES, Schedule, Task, backward, check_balance
from mpmd.schedules.simulator import MAX_COST, Costs, check_bandwidth_and_cores, is_cost, simulate

__all__ = ["BALANCE_MODES", "SegmentCosts", "SegmentProfile", "best_grouping", "check_balance", "even_grouping", "group_costs",
           "groups", "ranked_groupings", "resolve_grouping", "stage_loads"]

EXHAUSTIVE_MAX = 400  # groupings simulated one by one up to this count; beyond, a min-max start and local moves
SEARCH_MAX = 150  # groupings the local search simulates at most (16 stages x 16 microbatches: ~12 ms each)


@dataclass(frozen=True)
class SegmentCosts:
    """Per-segment task times (seconds, or any one unit), one entry per segment: `F`, `B` (a whole backward),
    and `I`, `W` (the split backward; zeros when unknown, then taken as half of B each); the bytes crossing the
    boundary after each segment (`activation_bytes`, one per segment, the last one unused); and the runtime's
    costs that do not depend on the grouping (`latency`, `bandwidth`, `gap`, `overhead`, `other`, `lead`,
    `tail`, `cores`, as in `Costs`). `source` says where the times come from ("xla cost analysis", "measured on
    the actors").
    `run_overhead`: the part of every task time above that is the cost of running one Run, whatever it computes
    (measured: segments timed one Run each add up to more than the same segments fused into one Run); a stage
    of k segments pays it once per task, not k times, and it does not grow with the microbatch. `split_overhead`:
    the same for the I and W tasks of a split backward (measured as `run_overhead` is: the segments' I and W timed a
    Run each against their whole backward fused on one actor)."""

    F: tuple[float, ...]
    B: tuple[float, ...]
    I: tuple[float, ...] = ()
    W: tuple[float, ...] = ()
    activation_bytes: tuple[float, ...] = ()
    latency: float = 0.0
    bandwidth: float = math.inf
    gap: float = 0.0
    overhead: float = 0.0
    other: float = 0.0
    lead: float = 0.0
    tail: float = 0.0
    cores: int | None = None
    source: str = ""
    microbatch_rows: int = field(default=0, compare=False)
    run_overhead: float = 0.0
    split_overhead: float = 0.0
    rows_exponent: float = 1.0
    rows_exponent_below: float = 0.0  # the same for fewer rows than measured at (0: `rows_exponent` both ways)
    runtime_cpu: float = 0.0  # CPU seconds of an actor's event loop per instruction on its Runs' cores (as in `Costs`)

    def __post_init__(self) -> None:
        for name in ("F", "B", "I", "W", "activation_bytes"):
            got = getattr(self, name)
            if isinstance(got, (str, bytes, Mapping, set, frozenset)) or not hasattr(got, "__iter__") or getattr(got, "ndim", 1) == 0:
                raise ValueError(f"SegmentCosts.{name} must be a sequence with one value per segment, got {got!r:.80}")
            object.__setattr__(self, name, tuple(got))
        n = len(self.F)
        if not n:
            raise ValueError("SegmentCosts.F needs one value per segment, got none")
        for name in ("F", "B", "I", "W", "activation_bytes"):
            v = getattr(self, name)
            if name in ("I", "W", "activation_bytes") and not v:
                v = tuple(b / 2 for b in self.B) if name in ("I", "W") else (0.0,) * n
            if len(v) != n or not all(map(is_cost, v)):
                raise ValueError(f"SegmentCosts.{name} needs {n} finite non-negative values (at most {MAX_COST:g}; one per segment), got "
                                 f"{getattr(self, name)!r:.200}")
            object.__setattr__(self, name, tuple(float(x) for x in v))
        for name in ("latency", "gap", "overhead", "other", "lead", "tail", "run_overhead", "split_overhead", "rows_exponent",
                     "rows_exponent_below", "runtime_cpu"):
            if not is_cost(getattr(self, name)):
                raise ValueError(f"SegmentCosts.{name} must be a finite number >= 0 (at most {MAX_COST:g}), got {getattr(self, name)!r:.80}")
        check_bandwidth_and_cores("SegmentCosts", self.bandwidth, self.cores)

    @property
    def num_segments(self) -> int:
        return len(self.F)

    def scaled(self, factor: float) -> SegmentCosts:
        """The task times for `factor` times the rows per microbatch: less their `run_overhead`, which stays,
        times ``factor ** rows_exponent`` (1: linear; below 1 where bigger matmuls run faster per row, as
        measured by `with_rows_exponent`; `rows_exponent_below` for fewer rows, when measured there too); bytes
        scale linearly, runtime costs not."""
        grow = factor ** (self.rows_exponent_below if factor < 1 and self.rows_exponent_below else self.rows_exponent)

        def scale(v: tuple[float, ...], c: float) -> tuple[float, ...]:
            return tuple(max(x - c, 0.0) * grow + min(x, c) for x in v)

        c, d = self.run_overhead, self.split_overhead
        return replace(self, F=scale(self.F, c), B=scale(self.B, c), I=scale(self.I, d), W=scale(self.W, d),
                       activation_bytes=tuple(x * factor for x in self.activation_bytes))

    def with_rows_exponent(self, other: SegmentCosts) -> SegmentCosts:
        """These costs with the growth with rows fitted from `other`, the same segments measured at another
        number of rows per microbatch: the compute of all segments together (less each task's `run_overhead`,
        the same at any rows) grows as rows ** exponent (clipped to 0.5-1.5; unchanged when the rows are the same
        or unknown). `other` with more rows sets `rows_exponent`, with fewer `rows_exponent_below`: measured on
        both sides, a prediction interpolates instead of extrapolating (small microbatches shrink the compute
        less than linearly: 1.13-1.23x under-predicted at m=8 from m=2 and m=4 alone)."""
        r0, r1 = self.microbatch_rows, other.microbatch_rows
        work = lambda c: sum(max(x - self.run_overhead, 0.0) for x in (*c.F, *c.B))  # noqa: E731 - the overhead is fixed
        if not r0 or not r1 or r0 == r1 or work(self) <= 0 or work(other) <= 0:
            return self
        exponent = min(1.5, max(0.5, math.log(work(other) / work(self)) / math.log(r1 / r0)))
        return replace(self, **{"rows_exponent" if r1 > r0 else "rows_exponent_below": exponent})

    def table(self) -> str:
        """One line per segment: F, B, I, W and the boundary bytes."""
        lines = [f"segment costs ({self.source or 'given'}):", "  seg         F         B         I         W   bytes out"]
        for s in range(self.num_segments):
            lines.append(f"  {s:3d} {self.F[s]:9.3g} {self.B[s]:9.3g} {self.I[s]:9.3g} {self.W[s]:9.3g} {self.activation_bytes[s]:11.0f}")
        if self.run_overhead:
            lines.append(f"  each F, B above includes {self.run_overhead:.3g} (each I, W {self.split_overhead:.3g}) of one Run's own overhead, paid once per stage task")
        if self.rows_exponent != 1.0 or self.rows_exponent_below:
            below = f" (as rows ** {self.rows_exponent_below:.2f} for fewer rows)" if self.rows_exponent_below else ""
            lines.append(f"  measured at {self.microbatch_rows} rows per microbatch; the rest grows as rows ** {self.rows_exponent:.2f}{below}")
        if self.runtime_cpu:
            where = f"the {self.cores} cores the actors share" if self.cores else "each actor's own core"
            lines.append(f"  the actors' event loops use {self.runtime_cpu * 1e3:.3g} ms of CPU (if the times are seconds) per Run, Send "
                         f"and Recv on {where}, beside the Runs")
        return "\n".join(lines)


@dataclass(frozen=True)
class SegmentProfile:
    """A schedule for measuring segment costs: every segment its own stage, stage s on actor s % num_actors
    (neighbours on different actors, so no two of one microbatch's tasks fuse into one Run), each actor running
    all its forwards, microbatch by microbatch, then all its backwards (GPipe's order, deadlock-free on any
    placement). Used by `step.profile_costs`; not a schedule to train with."""

    num_stages: int
    num_actors: int
    split: bool = False
    balance: None = None

    def actor_of(self, stage: int) -> int:
        return stage % self.num_actors

    @property
    def fuse_runs(self) -> bool:
        """Whether the compiler may merge an actor's consecutive tasks into one Run (`compiler.units.fuse`). Not
        with split backwards: a W sends nothing, so the next task of the actor — another microbatch's I, of
        this stage or of the one p stages on — would join its Run, and the fit could not tell the two apart
        (that I fitted to ~0 and the W took its time; a probe). Without split, no two tasks merge anyway
        (each F reads from, and each B sends to, another actor), and on one actor merging is what is measured."""
        return not self.split

    @property
    def min_microbatches(self) -> int:
        return 1

    @property
    def split_backward(self) -> bool:
        return self.split

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        rows: list[list[Task]] = [[] for _ in range(self.num_actors)]
        for i in range(num_microbatches):
            for s in range(self.num_stages):
                rows[self.actor_of(s)].append(Task(s, "F", i))
        for i in range(num_microbatches):
            for s in reversed(range(self.num_stages)):
                rows[self.actor_of(s)].extend(backward(s, i, self.split))
        return rows


def even_grouping(num_segments: int, num_stages: int) -> tuple[int, ...]:
    """Equal segment counts, the larger groups first: (3, 3, 2) for 8 segments on 3 stages."""
    q, r = divmod(num_segments, num_stages)
    return tuple(q + (s < r) for s in range(num_stages))


def groups(grouping: Sequence[int]) -> list[range]:
    """The segments of each stage: (2, 1, 3) -> [range(0, 2), range(2, 3), range(3, 6)]."""
    ends = list(itertools.accumulate(grouping))
    return [range(e - k, e) for k, e in zip(grouping, ends)]


def group_costs(seg: SegmentCosts, grouping: Sequence[int]) -> Costs:
    """The schedule's per-stage `Costs` for a grouping: a stage's task time is the sum over its segments (its
    input gradient chains through them, its weight gradients add up), the bytes after it those of its last
    segment. Split backward: a stage whose input's gradient nothing reads — stage 0, or one whose first segment
    has no I (no parameters before it) — gets no I task from the compiler, so its W costs what its B does,
    the input-gradient chain through its inner segments included."""
    gs = groups(grouping)
    c, d = seg.run_overhead, seg.split_overhead
    i, w, b = _totals(seg.I, d, gs), _totals(seg.W, d, gs), _totals(seg.B, c, gs)
    if i and w:  # a stage that exports no input gradient has no I task: its W runs the whole backward
        none = [k for k, g in enumerate(gs) if k == 0 or seg.I[g[0]] == 0]
        i = tuple(0.0 if k in none else x for k, x in enumerate(i))
        w = tuple(b[k] if k in none else x for k, x in enumerate(w))
    return Costs(F=_totals(seg.F, c, gs), B=b, I=i, W=w,
                 activation_bytes=tuple(seg.activation_bytes[g[-1]] for g in gs), latency=seg.latency, bandwidth=seg.bandwidth,
                 gap=seg.gap, overhead=seg.overhead, other=seg.other, lead=seg.lead, tail=seg.tail, cores=seg.cores,
                 runtime_cpu=seg.runtime_cpu)


def remat_costs(costs: Costs, stages: Sequence[int], split: bool) -> Costs:
    """`costs` (per-stage sequences, as `group_costs` gives) with each remat stage's backward tasks (B, or I and W
    when `split`: both recompute) also paying that stage's forward: `Costs.with_remat`, which `simulate` applies
    to a schedule's own `remat`."""
    return costs.with_remat(stages, len(costs.F) if isinstance(costs.F, tuple) else max(stages, default=-1) + 1, split)


def remat_sets(schedule: Schedule, actors: set[int], forward: Sequence[float], most: int = 16) -> list[tuple[int, ...]]:
    """Sets of stages to remat so that each of `actors` recomputes at least one of its own: cheapest first by
    the `forward` time they recompute, every stage of those actors last. With more than `most` such sets, the
    prefixes of the stages ordered by forward time instead."""
    mine = [s for s in range(schedule.num_stages) if schedule.actor_of(s) in actors]
    covers = lambda t: {schedule.actor_of(s) for s in t} == set(actors)  # noqa: E731
    subsets = [t for k in range(1, len(mine) + 1) for t in itertools.combinations(mine, k) if covers(t)] if len(mine) <= 6 else []
    if not subsets or len(subsets) > most:  # (every subset of many stages would be too many to simulate)
        by_time = sorted(mine, key=lambda s: forward[s])
        subsets = [t for t in (tuple(sorted(by_time[:k])) for k in range(1, len(mine) + 1)) if covers(t)]
    every = tuple(mine)
    return sorted((t for t in subsets if t != every), key=lambda t: (sum(forward[s] for s in t), len(t))) + [every]


def _totals(v: tuple[float, ...], c: float, gs: Sequence[Sequence[int]]) -> tuple[float, ...]:
    """Per group of segments, the time of one task over them: each segment's `v` less the Run overhead `c`,
    plus one overhead per stage task (at most its longest segment's time), not one per segment."""
    return tuple(sum(max(v[k] - c, 0.0) for k in g) + min(c, max((v[k] for k in g), default=0.0)) for g in gs)


def stage_loads(seg: SegmentCosts, grouping: Sequence[int]) -> tuple[float, ...]:
    """Per stage, the compute of one microbatch (F + B over its segments, as `group_costs` counts them)."""
    gs = groups(grouping)
    return tuple(f + b for f, b in zip(_totals(seg.F, seg.run_overhead, gs), _totals(seg.B, seg.run_overhead, gs)))


def _compositions(n: int, k: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        out.append(tuple(b - a for a, b in zip(bounds, bounds[1:])))
    return out


def _min_max(weights: Sequence[float], k: int) -> tuple[int, ...]:
    """The grouping of `weights` into k non-empty consecutive groups with the smallest largest group sum (DP)."""
    n = len(weights)
    pre = [0.0, *itertools.accumulate(weights)]
    best = [[math.inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for g in range(1, k + 1):
        for j in range(g, n + 1):
            for i in range(g - 1, j):
                v = max(best[g - 1][i], pre[j] - pre[i])
                if v < best[g][j]:
                    best[g][j], cut[g][j] = v, i
    sizes, j = [], n
    for g in range(k, 0, -1):
        i = cut[g][j]
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


def best_grouping(schedule: Schedule, num_microbatches: int, seg: SegmentCosts) -> tuple[int, ...]:
    """The grouping of `seg`'s segments into `schedule.num_stages` stages with the shortest simulated step
    (ties: the smaller largest stage load, then the earlier grouping). Every grouping is simulated when there
    are at most EXHAUSTIVE_MAX; otherwise a local search (`_descend`) from the min-max split of per-stage
    compute and from the even split, the better of the two."""
    return _search(schedule, num_microbatches, seg)[0]


def ranked_groupings(schedule: Schedule, num_microbatches: int, seg: SegmentCosts) -> list[tuple[int, ...]]:
    """Groupings by simulated step time, `best_grouping`'s first, then the others it simulated (every one, or
    those the local search visited) fastest first: what to fall back on when the fastest is over a memory limit."""
    best, _, seen = _search(schedule, num_microbatches, seg)  # (`seen` holds every grouping it scored: all, when exhaustive)
    return [best, *sorted((g for g in seen if g != best), key=lambda g: (seen[g], g))]


def _search(schedule: Schedule, num_microbatches: int, seg: SegmentCosts) -> tuple[tuple[int, ...], Any, dict[tuple[int, ...], Any]]:
    """`best_grouping`'s search: (the grouping, the scoring function, every grouping it scored with its score)."""
    n, k = seg.num_segments, schedule.num_stages
    if k > n:
        raise ScheduleError(f"{schedule}: {k} stages but the step has only {segments(n)}; "
                            f"use at most {n} stages or mark more boundaries")
    seen: dict[tuple[int, ...], tuple[float, float]] = {}

    def score(g: tuple[int, ...]) -> tuple[float, float]:
        if g not in seen:
            seen[g] = (round(simulate(schedule, num_microbatches, group_costs(seg, g)).step_time, 12), max(stage_loads(seg, g)))
        return seen[g]

    if math.comb(n - 1, k - 1) <= EXHAUSTIVE_MAX:
        return min(_compositions(n, k), key=score), score, seen
    starts = sorted({_min_max([f + b for f, b in zip(seg.F, seg.B)], k), even_grouping(n, k)})
    return min((_descend(start, score, seen) for start in starts), key=lambda g: (score(g), g)), score, seen


def _descend(current: tuple[int, ...], score: Any, seen: dict[tuple[int, ...], Any]) -> tuple[int, ...]:
    """Local search from `current`: move one segment to a neighbouring stage, or, when no such move helps, to
    any other stage (the stages between shift by one: moving only between neighbours got stuck 5-6 % above the
    best grouping); the first move that shortens the step is taken, until none does or SEARCH_MAX groupings
    have been simulated (`seen`)."""
    k = len(current)

    def moves(adjacent: bool) -> Any:
        for i in range(k):
            for j in ((i - 1, i + 1) if adjacent else range(k)):
                if 0 <= j < k and (abs(i - j) == 1) == adjacent and current[i] > 1:
                    g = list(current)
                    g[i] -= 1
                    g[j] += 1
                    yield tuple(g)

    while len(seen) < SEARCH_MAX:
        base = score(current)
        better = next((g for g in moves(True) if score(g) < base), None)
        if better is None:
            better = next((g for g in moves(False) if score(g) < base), None)
        if better is None:
            return current
        current = better
    return current


def segments(n: int) -> str:
    """"5 segments (4 pipeline_yield markers)", "1 segment (no pipeline_yield marker)"."""
    marks = "no pipeline_yield marker" if n == 1 else f"{n - 1} pipeline_yield marker{'s' * (n != 2)}"
    return f"{n} segment{'s' * (n != 1)} ({marks})"


def check_stage_count(schedule: Schedule, num_segments: int) -> None:
    """Raise unless the balanced `schedule` has at most `num_segments` stages (checked before any table of its
    stages is made: a schedule of 10**9 stages must be refused at once)."""
    k = schedule.num_stages
    if k > num_segments:
        raise ScheduleError(f"{schedule} has {k} stages but the step has only {segments(num_segments)}; use at most "
                            f"{num_segments} stage{'s' * (num_segments != 1)} or mark more boundaries")


def resolve_grouping(schedule: Schedule, num_segments: int, num_microbatches: int, costs: SegmentCosts | None = None) -> tuple[int, ...] | None:
    """The grouping the schedule's `balance` asks for, for a step of `num_segments` segments: None for no
    balance; `costs` (or the balance's own SegmentCosts) are read for "auto"."""
    check_balance(schedule)
    b = getattr(schedule, "balance", None)
    k = schedule.num_stages
    if b is None:
        return None
    check_stage_count(schedule, num_segments)
    if b == "even":
        return even_grouping(num_segments, k)
    if isinstance(b, tuple):
        if sum(b) != num_segments:
            raise ScheduleError(f"{schedule}: balance={b} groups {sum(b)} segments but the step has {segments(num_segments)}; "
                                f"give counts that sum to {num_segments}")
        return b
    seg = b if isinstance(b, SegmentCosts) else costs
    if seg is None:
        raise ScheduleError(f"{schedule}: balance='auto' needs segment costs")
    if seg.num_segments != num_segments:
        raise ScheduleError(f"{schedule}: the balance's SegmentCosts has {seg.num_segments} segments but the step has "
                            f"{num_segments}; profile this step (step.profile_costs(*args)) again")
    if not any(seg.F) and not any(seg.B):
        if seg is not b:  # (XLA found no cost in any segment: no grouping is better, so the plain one)
            return even_grouping(num_segments, k)
        raise ScheduleError(f"{schedule}: the balance's SegmentCosts are all zero (F={seg.F}, B={seg.B}), so every grouping "
                            "would take no time and none is better; give the segments' positive times (step.profile_costs"
                            "(*args) measures them), balance='auto' or balance='even'")
    return best_grouping(schedule, num_microbatches, seg)
