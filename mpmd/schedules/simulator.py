"""Run a schedule or compiled Programs on a cost model: step time, bubble, peak memory, timeline, pictures.

    r = mpmd.simulate(mpmd.OneFOneB(num_stages=4), 8)                 # unit costs: F=1, B=2, I=W=1
    r.step_time, r.bubble, r.peak_activations                         # 33.0, 0.2727..., (4, 3, 2, 1)
    r.to_perfetto("1f1b.json"); r.draw("1f1b.svg")

    costs = Costs(F=(1.0, 1.2), B=2.5, latency=1e-4, bandwidth=10e9, activation_bytes=4 << 20)
    mpmd.simulate(schedule, 16, costs)

A task starts when its actor is free and its inputs exist; an input from another actor arrives
`latency + bytes / bandwidth` after it was made (no link contention is modelled). The bubble of an actor
is the fraction of the step it is idle; `SimResult.bubble` is the mean over actors, so GPipe and 1F1B give
(p-1)/(m+p-1) on p actors with m microbatches under unit costs.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpmd.errors import PipelineError, ScheduleError
from mpmd.schedules.draw import draw_timeline, kind_of
from mpmd.schedules.montecarlo import Empirical
from mpmd.schedules.sharing import replay_programs_shared, replay_table_shared, runtime_loads
from mpmd.schedules.validation import (
    Schedule,
    check_programs,
    is_count,
    split_stages,
    stages_without_input_grad,
    task_inputs,
    validate_placed,
)
from transport.program import TASK_KINDS, Delete, Label, Program, Recv, Run, Task
from transport.protocol import dtype_from_name

PerStage = float | Sequence[float]


MAX_COST = 1e100  # the largest time (or byte count) a cost model takes: sums of millions of them stay finite


def is_cost(x: object) -> bool:
    """A real number, finite, >= 0 and at most MAX_COST (NaN or infinity in a cost would time every schedule as
    nan or 0; a finite cost near float's range adds up to infinity over a step, then nan)."""
    try:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and 0 <= float(x) <= MAX_COST
    except OverflowError:  # an int past float's range
        return False


def check_bandwidth_and_cores(owner: str, bandwidth: object, cores: object) -> None:
    """A ValueError naming `owner`'s field unless `bandwidth` is a number > 0 (inf: free) and `cores` a positive int
    or None."""
    if cores is not None and (not is_count(cores) or cores < 1):
        raise ValueError(f"{owner}.cores must be a positive int or None, got {cores!r:.80}")
    if not (isinstance(bandwidth, numbers.Real) and not isinstance(bandwidth, bool) and bandwidth > 0):
        raise ValueError(f"{owner}.bandwidth must be > 0 bytes per second (math.inf: free), got {bandwidth!r:.80}")


def _plain(x: object) -> object:
    """A numpy or JAX array (or scalar) as Python numbers: a 0-d one (what jnp.mean returns) as its number, a 1-d
    one as a list; anything else as it is."""
    return x.tolist() if hasattr(x, "ndim") and hasattr(x, "tolist") else x


def _overflow(what: str) -> ScheduleError:
    return ScheduleError(f"{what}: the cost model's times add up past the largest float (the step time would be inf); "
                         f"give costs in a unit that keeps every time and the step below {MAX_COST:g}")


_COST_KEY = re.compile(r"^(\d*)([FBIW])(\d*)$")


def _checked_routes(routes: object) -> tuple[tuple[tuple[int, int], tuple[float, float]], ...]:
    """`Costs.routes` as a tuple of ((src, dst), (latency, bandwidth)), or a ValueError naming the bad entry
    (fitted routes are not capped at MAX_COST: a trace says what it says; only finite, and bandwidth > 0)."""
    want = "((src, dst), (latency, bandwidth)) per actor pair, e.g. (((0, 1), (5e-5, 2e9)),)"
    if isinstance(routes, (str, bytes, Mapping)) or not hasattr(routes, "__iter__"):
        raise ValueError(f"Costs.routes must be a sequence of {want}, got {routes!r:.80}")
    out = []
    for r in routes:
        try:
            (src, dst), (latency, bandwidth) = r
        except (TypeError, ValueError):
            raise ValueError(f"Costs.routes: each entry must be {want}, got {r!r:.80}") from None
        latency, bandwidth = _plain(latency), _plain(bandwidth)
        real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731
        if not (is_count(src) and is_count(dst) and src >= 0 and dst >= 0 and src != dst):
            raise ValueError(f"Costs.routes: a route joins two different actors (ints >= 0), got {(src, dst)!r:.80}")
        if not (real(latency) and math.isfinite(latency) and latency >= 0) or not (real(bandwidth) and bandwidth > 0):
            raise ValueError(f"Costs.routes: route {src}->{dst} needs a finite latency >= 0 and a bandwidth > 0 bytes per second, "
                             f"got ({latency!r:.40}, {bandwidth!r:.40})")
        out.append(((int(src), int(dst)), (float(latency), float(bandwidth))))
    return tuple(out)


@dataclass(frozen=True)
class Costs:
    """A cost model, in seconds (or any one unit). Task times `F`, `B`, `I`, `W` are one number for every
    stage or a sequence with one per stage. A transfer between actors takes `latency + bytes / bandwidth`
    (or its pair's own latency and bandwidth in `routes`, as `fit_costs` measures them per pair);
    a schedule's transfers carry `activation_bytes` (the activation or cotangent crossing the boundary after
    each stage; a number or one per stage), a Program's the bytes of its Recv's dtype and shape. `overhead`
    is added to every Run (as busy time); `gap` is idle time before every Run starts (the runtime's dispatch
    and argument handling: not compute, so it counts toward the bubble); Runs of a step phase (pre, post,
    stack, ...) cost `other`. `lead` is idle time before any actor can start its first Run (the step's request
    and inputs arriving) and `tail` idle time after the last Run ends (the last sends, the replies): both add to
    the step and to every actor's bubble. `cores`: how many cores the actors share when they share one host's
    CPU (fewer cores than actors: Runs running at once slow each other down, see mpmd.schedules.sharing);
    None, each actor has its own. `runtime_cpu`: the CPU seconds each actor's event loop spends per
    instruction (each Run dispatched, each Send, each Recv) on the cores its Runs use: with `cores`, the
    shared ones; without (None), each actor's own core (CPU actors pinned to one core each: `fit_costs` reads
    it from a trace only then; on a GPU, or where a loop has a core to spare, leave it 0; `cores` at least the
    number of actors: not charged). The
    default is the unit model F=1, B=2, I=W=1 with free transfers."""

    F: PerStage = 1.0
    B: PerStage = 2.0
    I: PerStage = 1.0
    W: PerStage = 1.0
    latency: float = 0.0
    bandwidth: float = math.inf
    activation_bytes: PerStage = 0.0
    overhead: float = 0.0
    other: float = 0.0
    gap: float = 0.0
    lead: float = 0.0
    tail: float = 0.0
    cores: int | None = None
    runtime_cpu: float = 0.0
    routes: tuple[tuple[tuple[int, int], tuple[float, float]], ...] = ()  # ((src, dst), (latency, bandwidth)) per actor pair
    empirical: Empirical | None = None  # measured samples, for simulate_monte_carlo (mpmd.schedules.montecarlo)

    def __post_init__(self) -> None:
        for name in ("F", "B", "I", "W", "activation_bytes"):
            v = _plain(getattr(self, name))
            many = hasattr(v, "__iter__") and not isinstance(v, (str, bytes))
            vals = list(v) if many else [v]
            if isinstance(v, (Mapping, set, frozenset)) or not vals or not all(map(is_cost, vals)):  # (a dict's keys are no costs)
                raise ValueError(f"Costs.{name} must be a finite non-negative number (at most {MAX_COST:g}) or a sequence of them "
                                 f"(one per stage), got {v!r:.80}")
            object.__setattr__(self, name, tuple(float(x) for x in vals) if many else float(v))
        for name in ("latency", "overhead", "other", "gap", "lead", "tail", "runtime_cpu"):
            v = _plain(getattr(self, name))
            if not is_cost(v):
                raise ValueError(f"Costs.{name} must be a finite number >= 0 (at most {MAX_COST:g}), got {v!r:.80}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "bandwidth", _plain(self.bandwidth))
        check_bandwidth_and_cores("Costs", self.bandwidth, self.cores)
        object.__setattr__(self, "routes", _checked_routes(self.routes))
        most = max(self.activation_bytes) if isinstance(self.activation_bytes, tuple) else self.activation_bytes
        try:
            slow = most / self.bandwidth > MAX_COST
        except OverflowError:
            slow = True
        if slow:
            raise ValueError(f"Costs: a transfer of activation_bytes={most:g} at bandwidth={self.bandwidth:g} bytes per second takes "
                             f"more than {MAX_COST:g}; give a larger bandwidth or fewer bytes (math.inf bandwidth: free transfers)")

    def with_remat(self, stages: Sequence[int], num_stages: int, split: bool = True) -> Costs:
        """These costs with the backward tasks of each of `stages` also paying that stage's forward: remat, as
        `jax.checkpoint`, computes the forward again in the backward. B pays it, and with `split` (the default:
        a stage uses B or I and W, so changing all three is right for both) I and W too, a split backward's two
        Runs both recomputing; a stage without an I task (I = 0) recomputes in its W. The changed fields come
        back as per-stage sequences of `num_stages` entries."""
        if not stages:
            return self
        remat = set(stages)
        fwd = [self._per_stage("F", s) for s in range(num_stages)]

        def plus(name: str, only_where_positive: bool = False) -> tuple[float, ...]:
            vals = [self._per_stage(name, s) for s in range(num_stages)]
            return tuple(x + (fwd[s] if s in remat and (x > 0 or not only_where_positive) else 0.0) for s, x in enumerate(vals))

        out = copy.copy(self)  # (not `replace`: a sum may pass MAX_COST, which only given costs must not)
        object.__setattr__(out, "B", plus("B"))
        if split:
            object.__setattr__(out, "I", plus("I", only_where_positive=True))
            object.__setattr__(out, "W", plus("W"))
        return out

    def without_input_grad(self, stages: Sequence[int], num_stages: int) -> Costs:
        """These costs for a step whose `stages` split their backward but export no input gradient (stage 0,
        or a stage nothing before it has parameters): the compiler gives them no I task, their W runs the
        whole backward, so I costs nothing and W costs I + W. Idempotent; the changed fields come back as
        per-stage sequences of `num_stages` entries. (`group_costs` and `fit_costs` give such stages I = 0
        already: unchanged.)"""
        moved = [s for s in set(stages) if self._per_stage("I", s) > 0]
        if not moved:
            return self
        i = [self._per_stage("I", s) for s in range(num_stages)]
        w = [self._per_stage("W", s) for s in range(num_stages)]
        for s in moved:
            i[s], w[s] = 0.0, i[s] + w[s]
        out = copy.copy(self)  # (as with_remat: the sum may pass MAX_COST)
        object.__setattr__(out, "I", tuple(i))
        object.__setattr__(out, "W", tuple(w))
        return out

    def _per_stage(self, name: str, stage: int) -> float:
        v = getattr(self, name)
        if isinstance(v, tuple):
            if not 0 <= stage < len(v):
                raise ValueError(f"Costs.{name} gives {len(v)} per-stage values but stage {stage} was asked for; give one per stage")
            return v[stage]
        return float(v)

    def task_time(self, task: Task) -> float:
        """How long `task` runs (without the per-Run overhead)."""
        return self._per_stage(task.kind, task.stage)

    def run_time(self, label: Label) -> float:
        """How long a Run of `label` takes, the gap before it included: its tasks (a phase Run: `other`) plus
        the per-Run overhead."""
        if label.kind == "task" and label.tasks:
            return self.gap + sum(self.task_time(t) for t in label.tasks) + self.overhead
        return self.gap + self.other + self.overhead

    def transfer_time(self, nbytes: float) -> float:
        """How long `nbytes` take from one actor to another."""
        return self.latency + nbytes / self.bandwidth

    def route_time(self, src: int, dst: int, nbytes: float) -> float:
        """How long `nbytes` take from actor `src` to `dst`: that pair's fitted route if `routes` has it."""
        for pair, (latency, bandwidth) in self.routes:
            if pair == (src, dst):
                return latency + nbytes / bandwidth
        return self.transfer_time(nbytes)

    def check_actors(self, num_actors: int) -> None:
        """Raise ValueError unless every route joins two of `num_actors` actors (0 to num_actors - 1): a route past
        them (routes fitted on a trace of more actors) would be ignored, and the costs would not be the ones given."""
        for (src, dst), _ in self.routes:
            if max(src, dst) >= num_actors:
                raise ValueError(f"Costs.routes has route {src}->{dst}, but there are {num_actors} actors (0 to {num_actors - 1}); "
                                 "give routes between those actors only (costs fitted on a trace of more actors: "
                                 "dataclasses.replace(costs, routes=...) without the others)")

    def check_stages(self, num_stages: int) -> None:
        """Raise ValueError unless every per-stage sequence has `num_stages` entries."""
        for name in ("F", "B", "I", "W", "activation_bytes"):
            v = getattr(self, name)
            if isinstance(v, tuple) and len(v) != num_stages:
                hint = (f", or costs.split_stages({num_stages}) to cut each of its {len(v)} stages into {num_stages // len(v)} "
                        "of equal cost" if num_stages > len(v) and num_stages % len(v) == 0 else "")
                raise ValueError(f"Costs.{name} has {len(v)} per-stage values for {num_stages} stages; give one per stage or one "
                                 f"number{hint}")

    def split_stages(self, num_stages: int) -> Costs:
        """These costs of s stages for the same layers cut into `num_stages` (a multiple of s), e.g. costs fitted on a
        1F1B trace of 2 stages to predict an interleaved schedule of 4 or 8 on the same actors: each new stage's F, B, I,
        W and task samples are its old stage's divided by num_stages / s (its layers' share, taken as equal); its
        activation bytes, the per-Run `overhead` (every Run pays it, however little it computes), gaps, hops and
        routes stay as they were. The split is a guess where stages are uneven inside: fit a trace of the
        configuration itself for a closer one."""
        import dataclasses

        counts = {len(v) for v in (self.F, self.B, self.I, self.W, self.activation_bytes) if isinstance(v, tuple)}
        if len(counts) != 1:
            raise ValueError("Costs.split_stages: " + ("the costs give one number for every stage, which holds for any number "
                             "of stages as it is: nothing to split" if not counts else
                             f"the per-stage sequences have {sorted(counts)} entries: give the same number for each"))
        (old,) = counts
        if not is_count(num_stages) or num_stages < old or num_stages % old:
            raise ValueError(f"Costs.split_stages: num_stages must be a multiple of the costs' {old} stages, got {num_stages!r:.40}")
        k = num_stages // old

        def per(v: PerStage, share: float) -> PerStage:
            return tuple(v[s // k] * share for s in range(num_stages)) if isinstance(v, tuple) else v * share

        emp = self.empirical
        if emp is not None:
            emp = dataclasses.replace(emp, tasks=tuple(sorted(((st, kind), tuple(x / k for x in xs)) for (s0, kind), xs in emp.tasks
                                                              for st in range(s0 * k, (s0 + 1) * k))))
        return dataclasses.replace(self, F=per(self.F, 1 / k), B=per(self.B, 1 / k), I=per(self.I, 1 / k), W=per(self.W, 1 / k),
                                   activation_bytes=per(self.activation_bytes, 1.0), empirical=emp)

    @classmethod
    def from_timings(cls, timings: Mapping[str | tuple[str, int], float], num_stages: int | None = None, **kwargs: float) -> Costs:
        """Costs from measured seconds. Keys: a kind for every stage (``"F"``), a stage's kind (``"2F"`` or
        ``("F", 2)``), or one task (``"2F3"``; several microbatches of a stage's kind are averaged). Stage
        entries need `num_stages`; stages without one fall back to the kind's entry, else the unit default.
        Other keyword arguments (latency, bandwidth, ...) pass through.

            Costs.from_timings({"F": 0.010, "1F": 0.013, "B": 0.021}, num_stages=2, latency=2e-4)
        """
        every: dict[str, float] = {}
        samples: dict[tuple[str, int], list[float]] = {}
        if not isinstance(timings, Mapping):
            raise ValueError(f"timings must be a mapping like {{'F': 0.01, '1B': 0.02}}, got {type(timings).__name__}")
        if num_stages is not None and (not is_count(num_stages) or num_stages < 1):
            raise ValueError(f"num_stages must be a positive int, got {num_stages!r:.40}")
        num_stages = None if num_stages is None else int(num_stages)
        for key, sec in timings.items():
            if isinstance(key, tuple):
                if len(key) != 2 or not is_count(key[1]) or key[1] < 0:
                    raise ValueError(f"timing key {key!r:.60}: a tuple key is (kind, stage), like ('F', 2)")
                kind, stage, mb = key[0], int(key[1]), ""
            elif not isinstance(key, str):
                raise ValueError(f"timing key {key!r:.60} is a {type(key).__name__}; keys are a kind ('F'), a stage's kind "
                                 "('2F' or ('F', 2)) or a task ('2F3')")
            else:
                m = _COST_KEY.match(key.strip())
                if m is None:
                    raise ValueError(f"timing key {key!r} is not a kind ('F'), a stage's kind ('2F') or a task ('2F3')")
                stage, kind, mb = (int(m.group(1)) if m.group(1) else None), m.group(2), m.group(3)
                if mb and stage is None:
                    raise ValueError(f"timing key {key!r}: a task key needs its stage, like '0F3'")
            if kind not in TASK_KINDS:
                raise ValueError(f"timing key {key!r}: kind must be one of {', '.join(TASK_KINDS)}")
            sec = _plain(sec)
            if not is_cost(sec):
                raise ValueError(f"timing {key!r}: {sec!r:.40} is not a finite number of seconds >= 0")
            if stage is None:
                every[kind] = float(sec)
            else:
                if num_stages is not None and stage >= num_stages:
                    raise ValueError(f"timing key {key!r} names stage {stage}, but num_stages={num_stages}")
                samples.setdefault((kind, stage), []).append(float(sec))
        fields: dict[str, PerStage] = dict(every)
        if samples:
            if num_stages is None:
                raise ValueError("per-stage timings need num_stages= to know how many stages there are")
            for kind in {k for k, _ in samples}:
                base = every.get(kind, getattr(cls, kind))
                fields[kind] = tuple(sum(samples[(kind, s)]) / len(samples[(kind, s)]) if (kind, s) in samples else base
                                     for s in range(num_stages))
        return cls(**fields, **kwargs)  # type: ignore[arg-type]


Span = tuple[float, float, str]


@dataclass(frozen=True)
class SimResult:
    """What a simulation found. `timeline[actor]` lists (start, end, label) of everything the actor ran, labels
    like ``0F3`` (``1F3+1B3`` for a fused Run, ``pre``/``post`` for step phases); `transfers` lists
    (from actor, to actor, start, arrival, label)."""

    step_time: float
    bubble_per_actor: tuple[float, ...]
    peak_activations: tuple[int, ...]
    timeline: tuple[tuple[Span, ...], ...]
    transfers: tuple[tuple[int, int, float, float, str], ...] = ()
    peak_bytes: tuple[int, ...] | None = None
    name: str = ""

    @property
    def num_actors(self) -> int:
        return len(self.timeline)

    @property
    def bubble(self) -> float:
        """Mean idle fraction over actors."""
        return sum(self.bubble_per_actor) / len(self.bubble_per_actor) if self.bubble_per_actor else 0.0

    def summary(self) -> str:
        """A few lines: step time, bubble per actor and overall, peak activations (and bytes)."""
        lines = [f"{self.name}: step time {self.step_time:.7g}, bubble {self.bubble:.4f}",
                 "bubble per actor:   " + "  ".join(f"a{a} {b:.4f}" for a, b in enumerate(self.bubble_per_actor))]
        if self.peak_activations:  # (empty: not known, as for a measured step: `as_sim_result`)
            lines.append("peak activations:   " + "  ".join(f"a{a} {n}" for a, n in enumerate(self.peak_activations)))
        if self.peak_bytes is not None:
            lines.append("peak bytes:         " + "  ".join(f"a{a} {n}" for a, n in enumerate(self.peak_bytes)))
        return "\n".join(lines)

    def to_perfetto(self, path: str) -> None:
        """Write a Chrome / Perfetto trace (JSON, times in microseconds taking one cost unit as one second): one
        track per actor, one complete event per task named like ``0F3``, transfers as flow arrows."""
        events: list[dict[str, object]] = [{"ph": "M", "pid": 0, "name": "process_name", "args": {"name": self.name or "mpmd simulation"}}]
        for a, spans in enumerate(self.timeline):
            events.append({"ph": "M", "pid": 0, "tid": a, "name": "thread_name", "args": {"name": f"actor {a}"}})
            events.append({"ph": "M", "pid": 0, "tid": a, "name": "thread_sort_index", "args": {"sort_index": a}})
            for s, e, label in spans:
                events.append({"ph": "X", "pid": 0, "tid": a, "name": label, "cat": kind_of(label), "ts": s * 1e6, "dur": (e - s) * 1e6,
                               "args": {"start": s, "end": e}})
        # A flow event binds to the slice enclosing its time on its track: the arrow starts just inside the end of the
        # task that sent and ends just inside the start of the one that reads (at the send's end and the arrival
        # it bound to the next task or to none: 0 of 16 arrows started on their task in a 1F1B trace; a probe).
        spans = [{label: (s, e) for s, e, label in row} for row in self.timeline]
        for k, (src, dst, s, e, label) in enumerate(self.transfers):
            sent, _, read = label.partition("->")
            read = read if read in spans[dst] else re.sub(r"^(\d+)I(\d+)$", r"\1W\2", read)  # (a stage without I: its W)
            if sent in spans[src]:
                a, b = spans[src][sent]
                s = b - min(0.01 * (b - a), 1e-6)
            if read in spans[dst]:
                a, b = spans[dst][read]
                e = a + min(0.01 * (b - a), 1e-6)
            events.append({"ph": "s", "pid": 0, "tid": src, "id": k, "name": f"xfer {label}", "cat": "xfer", "ts": s * 1e6})
            events.append({"ph": "f", "pid": 0, "tid": dst, "id": k, "name": f"xfer {label}", "cat": "xfer", "ts": e * 1e6, "bp": "e"})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def draw(self, path: str, title: str | None = None, fmt: str | None = None) -> None:
        """Write a timeline picture: SVG (no dependency) for a path ending in .svg, PNG via matplotlib for one
        ending in .png; `fmt` ("svg" or "png") names the format of a path with another ending."""
        draw_timeline(self, path, title, fmt)


def _peak_activations(rows: Sequence[Sequence[Task]]) -> tuple[int, ...]:
    # A stage's microbatch is alive from its F until its B (or W when split). An actor runs its tasks one at a
    # time, so counting along its order is counting over time.
    peaks = []
    for row in rows:
        live = peak = 0
        for t in row:
            if t.kind == "F":
                live += 1
                peak = max(peak, live)
            elif t.kind in ("B", "W"):
                live -= 1
        peaks.append(peak)
    return tuple(peaks)


def _result(name: str, spans: list[list[Span]], rows: list[list[Task]], transfers: list[tuple[int, int, float, float, str]],
            peak_bytes: tuple[int, ...] | None = None, costs: Costs | None = None, stash: bool = True) -> SimResult:
    """`stash` False: nothing is kept for a backward (an evaluation loop): no activations at their peak."""
    lead, tail = (costs.lead, costs.tail) if costs is not None else (0.0, 0.0)
    if lead:
        spans = [[(s + lead, e + lead, label) for s, e, label in row] for row in spans]
        transfers = [(a, b, s + lead, e + lead, label) for a, b, s, e, label in transfers]
    step = max((e for row in spans for _, e, _ in row), default=0.0) + tail
    if not math.isfinite(step):
        raise _overflow(name or "simulation")
    bubbles = tuple(1.0 - sum(e - s for s, e, _ in row) / step if step > 0 else 0.0 for row in spans)
    peaks = _peak_activations(rows) if stash else tuple(0 for _ in rows)
    return SimResult(step, bubbles, peaks, tuple(tuple(r) for r in spans), tuple(transfers), peak_bytes, name)


def simulate(schedule: Schedule, num_microbatches: int, costs: Costs | None = None, forward_only: bool = False) -> SimResult:
    """Validate `schedule` for `num_microbatches` (raising `ScheduleError` if it cannot run) and time it on
    `costs` (default: unit costs F=1, B=2, I=W=1, free transfers). The backward tasks of the schedule's `remat`
    stages also pay their stage's forward (`Costs.with_remat`), as the balancer and `mpmd.tune` count them.
    `forward_only`: a loop that computes no gradients (evaluation), as `validate` takes it: a table of F tasks
    alone will do, and a schedule's backward tasks are left out (the compiled step runs none), as is their
    stash: no activation is kept for a backward.

        mpmd.simulate(mpmd.GPipe(num_stages=4), 8).bubble   # 3/11 = (p-1)/(m+p-1)
    """
    if costs is None:
        costs = Costs()
    elif not isinstance(costs, Costs):
        raise ScheduleError(f"costs must be mpmd.Costs (e.g. mpmd.Costs(F=1, B=2) or Costs.from_timings({{...}})), got "
                            f"{type(costs).__name__}")
    table, placement = validate_placed(schedule, num_microbatches, forward_only=forward_only)
    actor_of = placement.__getitem__  # (the placement validate proved, asked once: not actor_of again for every hop)
    if forward_only:  # (it timed GPipe's backward too, and counted every microbatch stashed; a probe)
        table = [[t for t in row if t.kind == "F"] for row in table]
    try:
        costs.check_stages(schedule.num_stages)
        costs.check_actors(len(table))  # (validate read num_actors once: one row per actor)
    except ValueError as e:
        raise ScheduleError(f"{schedule}: {e}") from None
    # remat stages (`schedule.remat`) recompute their forward in their backward: those tasks pay it too, as the
    # balancer and mpmd.tune count them (`balance.remat_costs`)
    split = split_stages(table)
    # stage 0 exports no input gradient: a compiled step gives it no I task, its W does the whole backward
    costs = costs.without_input_grad({0} & split, schedule.num_stages)
    costs = costs.with_remat(tuple(getattr(schedule, "remat", ()) or ()), schedule.num_stages)

    def transfer(src: Task, dst: Task) -> float:
        boundary = min(src.stage, dst.stage)  # F(s-1)->F(s) and B(s+1)->B(s) cross the boundary after the lower stage
        return costs.route_time(actor_of(src.stage), actor_of(dst.stage),
                                costs._per_stage("activation_bytes", boundary))

    edges = [(d, t) for row in table for t in row for d in task_inputs(t, schedule.num_stages, split)
             if actor_of(d.stage) != actor_of(t.stage)]
    # the runtime's CPU: a Run per task, a Send and a Recv per edge between actors (a compiled step has a few
    # more: its phase Runs and the arguments' transfers, which simulate_programs counts)
    ghost = lambda t: t.kind == "I" and t.stage == 0 and 0 in split  # noqa: E731  (no Run: see without_input_grad above)
    loads = [costs.runtime_cpu * sum(not ghost(t) for t in row) for row in table]
    for d, t in edges:
        loads[actor_of(d.stage)] += costs.runtime_cpu
        loads[actor_of(t.stage)] += costs.runtime_cpu
    run, _ = replay_table_shared(table, schedule.num_stages, actor_of,
                                 lambda t: 0.0 if ghost(t) else costs.gap + costs.task_time(t) + costs.overhead,
                                 transfer, costs.cores, lambda t: 0.0 if ghost(t) else costs.gap, costs.lead + costs.tail, loads)
    spans = [[(run.start[t] + costs.gap, run.end[t], str(t)) for t in row if not ghost(t)] for row in table]
    transfers = [(actor_of(d.stage), actor_of(t.stage), run.end[d], run.end[d] + transfer(d, t), f"{d}->{t}")
                 for d, t in edges]
    return _result(str(schedule), spans, table, transfers, costs=costs, stash=not forward_only)


def _recv_bytes(recv: Recv) -> int:
    return math.prod(recv.shape) * dtype_from_name(recv.dtype).itemsize


def _part_spans(costs: Costs, label: Label, start: float, stretch: float = 1.0) -> list[Span]:
    """A Run's span cut into one span per part (a fused Run does several tasks, and maybe a step phase, one
    after another); phases that take no time on this cost model are left out. `stretch`: the Run ran that
    much slower (actors sharing cores; the gap before it is not stretched). A step phase fused into a task Run
    (`pre+0F0`, `0B3+post`) takes no time of its own, as `Costs.run_time` times that Run (and `fit_costs` folds its
    time into the task's): drawn at `other`, it overlapped the actor's next Run and gave a negative bubble (a probe)."""
    parts = label.parts or ((tuple(map(str, label.tasks)) or (label.kind,)))
    phase = 0.0 if label.kind == "task" and label.tasks else costs.other
    out, t = [], start + costs.gap
    for i, p in enumerate(parts):
        d = ((costs.task_time(Task.parse(p)) if p[0].isdigit() else phase) + (costs.overhead if i == 0 else 0.0)) * stretch
        if d > 0 or p[0].isdigit():
            out.append((t, t + d, p))
        t += d
    return out or [(start + costs.gap, t, str(label))]


def without_input_grad(programs: Sequence[Program], costs: Costs) -> Costs:
    """`costs` with the stages the programs give W tasks but no I task (no input gradient to export: see
    `Costs.without_input_grad`) charging their whole backward to W."""
    stages, num_stages = stages_without_input_grad(programs)
    return costs.without_input_grad(stages, num_stages) if stages else costs


def simulate_programs(programs: list[Program], costs: Costs | None = None, name: str = "programs") -> SimResult:
    """Time compiled Programs (one per actor) on `costs`: a Run costs the sum of its label's tasks (plus
    `overhead`; phase Runs cost `other`, a phase fused into a task Run nothing of its own), a transfer `latency + bytes / bandwidth` with bytes from the Recv's
    dtype and shape. `peak_bytes` (None when no program has `buffer_bytes`) comes from `Program.buffer_bytes`: a buffer lives from the Run that makes it
    (its start) or the arrival of its Recv until its Delete (or a Run that donates it) or the end; inputs and
    constants from the start. Raises `PipelineError` if the programs cannot run (see `check_programs`), and
    `ScheduleError` for costs that are not a `Costs`, give per-stage values for another number of stages or routes
    between actors past the programs'."""
    if costs is None:
        costs = Costs()
    elif not isinstance(costs, Costs):  # (a dict met "'dict' object has no attribute 'cores'"; a probe)
        raise ScheduleError(f"simulate_programs: costs must be mpmd.Costs (e.g. mpmd.Costs(F=1, B=2)), got {type(costs).__name__}")
    if not isinstance(programs, (list, tuple)) or not programs:  # (an empty list came out as a step of 0; a probe)
        raise ScheduleError(f"{name}: programs must be a list of Programs, one per actor, got {programs!r:.80}")
    _, num_stages = stages_without_input_grad(programs)
    try:  # (3 per-stage values for 2 stages were taken silently, where `simulate` refuses them; a probe)
        if num_stages:
            costs.check_stages(num_stages)
        costs.check_actors(len(programs))
    except ValueError as e:
        raise ScheduleError(f"{name}: {e}") from None
    costs = without_input_grad(programs, costs)
    run, stretch = replay_programs_shared(programs, lambda a, r: costs.run_time(r.label),
                                          lambda a, r: costs.route_time(r.from_actor, a, _recv_bytes(r)), costs.cores,
                                          lambda a, r: costs.gap, extra=costs.lead + costs.tail,
                                          actor_loads=runtime_loads(programs, costs.runtime_cpu))
    if run.stuck:
        check_programs(programs)  # raises, naming who waits for what: getting stuck does not depend on the costs
        raise PipelineError("internal: programs got stuck on a cost model but not on unit costs")
    spans: list[list[Span]] = []
    rows: list[list[Task]] = []
    transfers = []
    peaks = []
    for a, prog in enumerate(programs):
        spans.append([span for i, ins in enumerate(prog.instructions) if isinstance(ins, Run)
                      for span in _part_spans(costs, ins.label, run.start[(a, i)], stretch.get((a, i), 1.0))])
        rows.append([t for ins in prog.instructions if isinstance(ins, Run) for t in ins.label.tasks])
        # (time, instruction, bytes): at one instant, in program order — a Delete after a Run of no length (an optimizer
        # update costed at 0) frees the old state after the Run made the new one, as on the actor (freed first, the two
        # never coexisted: a peak 1.5x under the actor's; a probe); within one instruction, frees first (a donation)
        events: list[tuple[float, int, int]] = [(0.0, -1, prog.buffer_bytes.get(b, 0)) for b in {*prog.inputs, *prog.consts}]
        born: dict[int, float] = {b: 0.0 for b in {*prog.inputs, *prog.consts}}
        for i, ins in enumerate(prog.instructions):
            if isinstance(ins, Run):
                for pos in ins.donate:
                    b = ins.inputs[pos]
                    if b in born:
                        events.append((run.start[(a, i)], i, -prog.buffer_bytes.get(b, 0)))
                        del born[b]
                for b in ins.outputs:
                    born[b] = run.start[(a, i)]
                    events.append((run.start[(a, i)], i, prog.buffer_bytes.get(b, 0)))
            elif isinstance(ins, Recv):
                t = run.ready[(a, i)]
                born[ins.buf] = t
                events.append((t, i, prog.buffer_bytes.get(ins.buf, 0)))
                transfers.append((ins.from_actor, a, t - costs.route_time(ins.from_actor, a, _recv_bytes(ins)), t, str(ins.label)))
            elif isinstance(ins, Delete):
                for b in ins.bufs:
                    if b in born:
                        events.append((max(run.reached[(a, i)], born.pop(b)), i, -prog.buffer_bytes.get(b, 0)))
        live = peak = 0
        for _, _, delta in sorted(events):
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    known = any(p.buffer_bytes for p in programs)  # without the compiler's sizes, peak bytes are unknown, not 0
    return _result(name, spans, rows, transfers, tuple(peaks) if known else None, costs)
