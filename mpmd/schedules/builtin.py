"""Schedules: which stage lives on which actor, and the order in which each actor runs its tasks.

A task is one stage's work on one microbatch, written as in torch.distributed.pipelining: ``0F3`` is stage
0's forward of microbatch 3, ``1B0`` stage 1's fused backward, ``2I1`` / ``2W1`` the two halves of a split
backward (I: the input gradient the previous stage waits for; W: the weight gradient, which nothing waits
for and which zero-bubble schedules move into the idle slots). A stage uses either B or I and W.

A schedule is a `Schedule`: `num_stages`, `num_actors`, `actor_of(stage)`, and `tasks(num_microbatches)`,
one ordered list per actor. The compiler only reads that table, so a new schedule needs no compiler change.
`validate(schedule, m)` proves a table complete and deadlock-free (or raises `ScheduleError` showing the
table with the offending task in brackets); `mpmd.simulate(schedule, m)` times it.

Built-ins, with their bubble under unit costs (F=1, B=2, I=W=1, free transfers) on p actors with m
microbatches, v stages per actor, and the microbatch activations actor a holds at its peak:

    GPipe(num_stages)                          stage s on actor s   (p-1)/(m+p-1)                  m
    OneFOneB(num_stages)                       stage s on actor s   (p-1)/(m+p-1)                  p-a
    EagerOneFOneB(num_stages)                  stage s on actor s   as 1F1B; hides slow transfers  2(p-a)-1
    InterleavedOneFOneB(num_stages, num_actors)  s on s % p         (p-1)/(v*m+p-1), m >= p        (v-1)q + 2(p-1-a) + 1 *
    ZeroBubbleH1(num_stages)                   stage s on actor s   (p-1)/(3m+p-1), m >= p         p (1F1B's peak)
    InterleavedZeroBubble(num_stages, num_actors)  s on s % p       (p-1)/(3vm+p-1), m >= p
    ZeroBubbleV(num_actors)                    V: a and 2p-1-a      (p-1)/(6m+p-1), m >= 2p-1      at most 2p
    DualPipeV(num_actors)                      V: a and 2p-1-a      (p-1)/(6m+p-1), needs m >= 2p

The zero-bubble ones idle only the p-1 units of the pipeline fill on every actor.
* at most vm. q = ceil(m / max(1, m // p)) is the number of microbatches in the first round of the interleaved
  order: p when p divides m, all m when m < 2p (one round: p < m < 2p holds more than m = 2p does), between p and
  2p - 1 otherwise.

Writing your own, way 1 — a table, `Custom`, for one number of microbatches (any stage -> actor map):

    two_stage = mpmd.Custom(num_stages=2, order=(
        ("0F0", "0F1", "0B0", "0B1"),          # actor 0 runs stage 0
        ("1F0", "1B0", "1F1", "1B1"),          # actor 1 runs stage 1
    ))
    split = mpmd.Custom(num_stages=2, order=(("0F0", "0I0", "0W0"), ("1F0", "1I0", "1W0")))

Way 2 — a subclass that builds the table for any number of microbatches:

    @dataclass(frozen=True)
    class LateOneFOneB(mpmd.Schedule):
        '''1F1B with one extra warm-up forward per actor.'''
        def tasks(self, m):
            out = []
            for s in range(self.num_stages):
                warm = min(self.num_stages - s, m)
                fwd = [Task(s, "F", i) for i in range(m)]
                bwd = [[Task(s, "B", i)] for i in range(m)]
                out.append(one_f_one_b(fwd, bwd, warm))
            return out

Override `actor_of` (and `num_actors`) for another placement, `min_microbatches` if the order needs a
minimum. `one_f_one_b` and `backward` are the helpers the built-ins use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from itertools import zip_longest

from mpmd.errors import ScheduleError
from mpmd.schedules.validation import (
    MAX_TABLE_TASKS,
    SCHEDULE_ATTRIBUTES,
    check_programs,
    format_table,
    is_count,
    replay_table,
    schedule_lacks,
    validate,
)
from transport.program import TASK_KINDS, Task


def not_a_schedule(value: object) -> str | None:
    """What is wrong with `value` as a schedule (None: it is one: a `Schedule`, or any object with a schedule's
    num_stages, num_actors, actor_of and tasks, as `mpmd.schedules.validation.Schedule` reads it): the text after "got"."""
    if isinstance(value, Schedule):
        return None
    if isinstance(value, type):
        return f"the class {value.__name__}: make one, e.g. {value.__name__}(num_stages=2)"
    lacks = schedule_lacks(value)
    if not lacks:
        return None
    if len(lacks) < len(SCHEDULE_ATTRIBUTES) - 1:  # (close to one: say what it lacks)
        return f"{type(value).__name__} {value!r:.80}, which lacks {', '.join(lacks)} (subclass mpmd.Schedule to write one)"
    return f"{type(value).__name__} {value!r:.80}"

__all__ = ["Custom", "DualPipeV", "EagerOneFOneB", "GPipe", "InterleavedOneFOneB", "InterleavedZeroBubble", "OneFOneB",
           "Schedule", "Task", "ZeroBubbleH1", "ZeroBubbleV", "backward", "check_programs", "format_table", "one_f_one_b",
           "validate", "BUILTINS"]

Row = list[Task]


def _positive(owner: object, name: str, value: object) -> int:
    """`value` as an int (a numpy integer too), or a ScheduleError unless it is an integer >= 1."""
    if not is_count(value) or value < 1:
        raise ScheduleError(f"{type(owner).__name__}: {name} must be a positive int, got {value!r}")
    return int(value)


BALANCE_MODES = ("auto", "even")


def as_counts(balance: object) -> object:
    """A `balance` given as a list or a 1-d numpy / jax array of segment counts as the tuple of them; anything
    else as it is (`check_balance` judges it)."""
    if isinstance(balance, list) or getattr(balance, "ndim", None) == 1:
        return tuple(balance.tolist() if hasattr(balance, "tolist") else balance)
    return balance


def check_balance(schedule: object) -> None:
    """A ScheduleError unless `schedule.balance` is None, "auto", "even", segment costs (`SegmentCosts`) or a
    tuple of positive segment counts, one per stage (see `mpmd.schedules.balance`)."""
    b = getattr(schedule, "balance", None)
    if b is None or hasattr(b, "num_segments") or (isinstance(b, str) and b in BALANCE_MODES):
        return
    n = getattr(schedule, "num_stages", 0)
    if isinstance(b, tuple) and len(b) == n and all(is_count(k) and k >= 1 for k in b):
        return
    raise ScheduleError(f"{type(schedule).__name__}: balance must be None, 'auto', 'even', segment costs (step.profile_costs(...)) "
                        f"or a tuple of {n} positive segment counts (one per stage, e.g. {tuple([2] * n)}), got {b!r}")


@dataclass(frozen=True, repr=False)
class Schedule:
    """Base class: `num_stages` stages, one per actor, and `tasks(m)` giving each actor's order. Subclass it
    (frozen dataclass) and override `tasks`, and `actor_of`/`num_actors` for another placement.

    `balance` (keyword only) lets the step mark more boundaries than stages: "auto" groups consecutive marker
    segments into the stages that give the shortest simulated step, "even" by equal counts, a tuple gives the
    counts (see `mpmd.schedules.balance`); None (default) wants one marker per stage boundary.

    `remat` (keyword only): stages whose forward is recomputed in their backward, as `jax.checkpoint` would:
    between a microbatch's F and B such a stage keeps only its inputs, not its activations, and its B computes
    the forward again first (memory for time; `mpmd.tune` tries it where the memory limit demands).

    `fuse` (keyword only, default True): whether the compiler may merge an actor's consecutive tasks into one Run
    where that delays nothing (e.g. the last stage's F and B of a microbatch in 1F1B): one dispatch instead of
    several, and XLA compiles the merged tasks as one program, which may run faster or slower than the tasks apart
    (measured on CPU, 2026-12-06: a stage ending in an 8192-word softmax head, F+B 25 % slower merged; MLP and conv
    stages 5-15 % faster). `mpmd.tune`, calibrating, measures its winner both ways when its plan merges tasks."""

    num_stages: int
    balance: object = field(default=None, kw_only=True, repr=False)
    remat: tuple[int, ...] = field(default=(), kw_only=True, repr=False)
    fuse: bool = field(default=True, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_stages", _positive(self, "num_stages", self.num_stages))
        object.__setattr__(self, "balance", as_counts(self.balance))
        check_balance(self)
        if isinstance(self.balance, tuple):  # (counts given as numpy integers kept as ints)
            object.__setattr__(self, "balance", tuple(map(int, self.balance)))
        check_remat(self)
        check_fuse(self)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"{type(self).__name__}({shown}{options_tail(self)})"

    @property
    def num_actors(self) -> int:
        """How many actors the schedule uses."""
        return self.num_stages

    def actor_of(self, stage: int) -> int:
        """The actor that runs `stage`: the same answer at every call (`validate` asks each stage twice and refuses
        an answer that changed; a step and `simulate` use the answers validate proved the table with)."""
        return stage

    def stages_of(self, actor: int) -> list[int]:
        """The stages `actor` runs, in increasing order."""
        return [s for s in range(self.num_stages) if self.actor_of(s) == actor]

    @property
    def min_microbatches(self) -> int:
        """The fewest microbatches the order works with."""
        return 1

    @property
    def split_backward(self) -> bool:
        """True when the table uses I and W tasks instead of B."""
        return any(t.kind in ("I", "W") for row in self.tasks(self.min_microbatches) for t in row)

    @property
    def fuse_runs(self) -> bool:
        """Whether the compiler may merge an actor's consecutive tasks into one Run where that delays nothing
        (read by the compiler from any schedule object, True when it has none; a profiling schedule that must
        time every task apart says False): the `fuse` option."""
        return self.fuse

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        """One ordered task list per actor for `num_microbatches` microbatches."""
        raise NotImplementedError(f"{type(self).__name__} must define tasks(num_microbatches)")


def options_tail(schedule: Schedule) -> str:
    """The keyword options that differ from their defaults, as a repr's tail: ", balance=..., remat=(...)"."""
    out = ""
    b = schedule.balance
    if b is not None:
        segments = getattr(b, "F", None)
        out += f", balance=<costs of {len(segments)} segments>" if isinstance(segments, tuple) else f", balance={b!r}"
    if schedule.remat:
        out += f", remat={schedule.remat!r}"
    if not schedule.fuse:
        out += ", fuse=False"
    return out


def check_fuse(schedule: Schedule) -> None:
    """`fuse` must be True or False (a numpy bool is taken as one)."""
    f = schedule.fuse
    if type(f).__module__ == "numpy" and type(f).__name__ in ("bool", "bool_"):
        f = f.item()
    if not isinstance(f, bool):
        raise ScheduleError(f"{type(schedule).__name__}: fuse must be True or False (whether the compiler may merge an "
                            f"actor's consecutive tasks into one Run), got {type(f).__name__} {f!r:.40}")
    object.__setattr__(schedule, "fuse", f)


def check_remat(schedule: Schedule) -> None:
    """`remat` must be a tuple of distinct stage indices of the schedule; normalised to a sorted tuple."""
    r = schedule.remat
    if getattr(r, "ndim", None) == 1 and hasattr(r, "tolist"):  # a numpy array of stage indices, as balance= takes
        r = r.tolist()
    if isinstance(r, list):
        r = tuple(r)
    if not isinstance(r, tuple) or not all(map(is_count, r)):
        raise ScheduleError(f"{type(schedule).__name__}: remat must be a tuple of stage indices, got {schedule.remat!r}")
    r = tuple(map(int, r))
    bad = [s for s in r if not 0 <= s < schedule.num_stages]
    if bad or len(set(r)) != len(r):
        raise ScheduleError(f"{type(schedule).__name__}: remat names stages {list(r)}; each must appear once and lie in "
                         f"0..{schedule.num_stages - 1}")
    object.__setattr__(schedule, "remat", tuple(sorted(r)))


def backward(stage: int, mb: int, split: bool) -> Row:
    """A whole backward: ``[B]``, or ``[I, W]`` back to back when `split`."""
    return [Task(stage, "I", mb), Task(stage, "W", mb)] if split else [Task(stage, "B", mb)]


def one_f_one_b(fwd: Row, bwd: list[Row], warmup: int) -> Row:
    """`warmup` forwards, then one forward and one backward group in turn, then the remaining backward groups."""
    order = list(fwd[:warmup])
    for f, b in zip_longest(fwd[warmup:], bwd):
        order += ([f] if f is not None else []) + (b or [])
    return order


def _zero_bubble(fwd: Row, inputs: Row, warmup: int, lag: int) -> Row:
    """1F1B with B split: `warmup` forwards, then F and I in turn, then the remaining I; every I is followed by
    the W of the I `lag` places earlier, and the Ws still owed run at the end. Those late Ws fill the
    cool-down bubble; `lag` more microbatches stay alive for them."""
    weights = [Task(t.stage, "W", t.mb) for t in inputs]
    order = list(fwd[:warmup])
    for k, (f, i) in enumerate(zip_longest(fwd[warmup:], inputs)):
        order += ([f] if f is not None else []) + [i]
        if k >= lag:
            order.append(weights[k - lag])
    return order + weights[max(0, len(inputs) - lag):]


@dataclass(frozen=True, repr=False)
class GPipe(Schedule):
    """All forwards, then all backwards (Huang et al. 2019): bubble (p-1)/(m+p-1), every microbatch's
    activations alive at once."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m = num_microbatches
        return [[Task(s, "F", i) for i in range(m)] + [Task(s, "B", i) for i in range(m)] for s in range(self.num_stages)]


@dataclass(frozen=True, repr=False)
class OneFOneB(Schedule):
    """1F1B (PipeDream-flush, Narayanan et al. 2019): `p-1-a` warm-up forwards on actor a, then one forward and
    one backward in turn. GPipe's bubble, but actor a holds at most `p-a` microbatches of activations."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m, n = num_microbatches, self.num_stages
        return [one_f_one_b([Task(s, "F", i) for i in range(m)], [backward(s, i, False) for i in range(m)], min(n - 1 - s, m))
                for s in range(n)]


@dataclass(frozen=True, repr=False)
class EagerOneFOneB(Schedule):
    """JaxPP's Eager 1F1B: 1F1B with twice the warm-up, `2(p-1-a)` forwards on actor a, so each actor runs ahead
    by `p-1-a` more forwards and its sends overlap compute instead of stalling the next stage when transfers
    are slow. Same bubble as 1F1B with free transfers; holds up to `2(p-a)-1` microbatches."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m, n = num_microbatches, self.num_stages
        return [one_f_one_b([Task(s, "F", i) for i in range(m)], [backward(s, i, False) for i in range(m)], min(2 * (n - 1 - s), m))
                for s in range(n)]


@dataclass(frozen=True, repr=False)
class _Looped(Schedule):
    """Several stages per actor, placed circularly: stage s on actor s % num_actors."""

    num_actors: int = None  # type: ignore[assignment]  # required; a default only because the base has a property here

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_actors is None:  # (not 0: `num_actors=0` said it was not given; a probe)
            raise ScheduleError(f"{type(self).__name__} needs num_actors=, the number of actors its stages are spread over, e.g. "
                                f"{type(self).__name__}(num_stages=8, num_actors=4)")
        object.__setattr__(self, "num_actors", _positive(self, "num_actors", self.num_actors))
        if self.num_stages % self.num_actors:
            below, above = self.num_stages // self.num_actors * self.num_actors, (self.num_stages // self.num_actors + 1) * self.num_actors
            raise ScheduleError(f"{type(self).__name__}: num_stages={self.num_stages} is not a multiple of num_actors={self.num_actors}; "
                                "each actor holds the same number of stages, so use num_stages="
                                + (f"{below} or {above}" if below else f"{above}"))

    @property
    def per_actor(self) -> int:
        """v, the number of stages each actor holds."""
        return self.num_stages // self.num_actors

    def actor_of(self, stage: int) -> int:
        return stage % self.num_actors

    def _rounds(self, m: int) -> list[range]:
        # Megatron's order: microbatches go through an actor's stages in rounds, round 0 through its first stage,
        # then round 0 through its second stage, ..., then round 1. Rounds hold p microbatches when p divides m;
        # otherwise m is split into m // p rounds as evenly as possible, larger rounds first (a round smaller
        # than p, or a small round before a big one, can deadlock the warm-up count below).
        r = max(1, m // self.num_actors)
        sizes = [m // r + (i < m % r) for i in range(r)]
        return [range(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(r)]

    def _order(self, a: int, m: int, kind: str) -> Row:
        v, p = self.per_actor, self.num_actors
        chunks = range(v) if kind == "F" else range(v - 1, -1, -1)
        return [Task(c * p + a, kind, i) for group in self._rounds(m) for c in chunks for i in group]

    def _warmup(self, a: int, m: int, hops: int) -> int:
        # The last actor starts its first backward once round 0 has gone through all its earlier stages;
        # every actor before it runs `hops` more forwards per actor of distance.
        p = self.num_actors
        return min((self.per_actor - 1) * len(self._rounds(m)[0]) + hops * (p - 1 - a), self.per_actor * m)


@dataclass(frozen=True, repr=False)
class InterleavedOneFOneB(_Looped):
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): v = num_stages / num_actors stages per actor,
    stage s on actor s % num_actors; microbatches go through an actor's stages in rounds of p (when p does
    not divide m, m // p rounds as even as possible, the larger first: the first round holds q =
    ceil(m / (m // p)) microbatches, up to 2p - 1; one round of m when m < p); warm-up `(v-1)*q + 2*(p-1-a)`
    forwards on actor a (at most v*m), then one forward and one backward in turn. Bubble (p-1)/(v*m+p-1) for
    m >= p; actor a holds at most `(v-1)*q + 2*(p-1-a) + 1` microbatch-stages of activations (v*m at most),
    so a count of microbatches that p does not divide costs memory: m = 6 on 4 actors holds more than m = 8."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m = num_microbatches
        return [one_f_one_b(self._order(a, m, "F"), [[t] for t in self._order(a, m, "B")], self._warmup(a, m, 2))
                for a in range(self.num_actors)]


@dataclass(frozen=True, repr=False)
class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into I and W.
    Actor a runs 1F1B's `p-1-a` warm-up forwards, then F and I in turn, each I followed by the W `a` places
    earlier; the Ws held back run in the cool-down, where 1F1B idles. With F = I = W the idle time per actor
    is p-1, a third of 1F1B's 3(p-1); no actor holds more than p microbatches, 1F1B's peak."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m, n = num_microbatches, self.num_stages
        return [_zero_bubble([Task(s, "F", i) for i in range(m)], [Task(s, "I", i) for i in range(m)], min(n - 1 - s, m), s)
                for s in range(n)]


@dataclass(frozen=True, repr=False)
class InterleavedZeroBubble(_Looped):
    """ZB-H1 on the interleaved placement (the ZB paper's ZB1P with several stages per actor): Megatron's
    interleaved order with one forward of warm-up per actor of distance, `(v-1)*p + (p-1-a)`, I in place of B,
    and each actor's Ws held back by `a` places to fill the cool-down."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m = num_microbatches
        return [_zero_bubble(self._order(a, m, "F"), self._order(a, m, "I"), self._warmup(a, m, 1), a) for a in range(self.num_actors)]


@dataclass(frozen=True, repr=False)
class _VShape(Schedule):
    """The V placement: 2 * num_actors stages, actor a holding stages a and 2*num_actors-1-a, so the first and
    the last stage share actor 0 and every actor does the same work. Given as `num_actors=k` or `num_stages=2k`."""

    def __init__(self, num_actors: int | None = None, *, num_stages: int | None = None, balance: object = None,
                 remat: tuple[int, ...] = (), fuse: bool = True) -> None:
        # `num_stages=` too, as every other schedule is given: twice the actors, so it must be even.
        name = type(self).__name__
        if num_stages is not None:
            stages = _positive(self, "num_stages", num_stages)
            if stages % 2:
                raise ScheduleError(f"{name} places 2 stages on each actor (the V), so num_stages must be even; got "
                                    f"{stages}. Pass num_actors=k for 2k stages.")
            if num_actors is not None and 2 * _positive(self, "num_actors", num_actors) != stages:
                raise ScheduleError(f"{name}(num_actors={num_actors}, num_stages={num_stages}): the V has 2 stages per "
                                    f"actor, so num_stages must be 2 * num_actors; pass one of them")
            num_actors = stages // 2
        elif num_actors is None:
            raise ScheduleError(f"{name} needs num_actors (it has 2 stages per actor), e.g. {name}(num_actors=2)")
        object.__setattr__(self, "num_stages", 2 * _positive(self, "num_actors", num_actors))
        object.__setattr__(self, "balance", as_counts(balance))
        object.__setattr__(self, "remat", remat)
        object.__setattr__(self, "fuse", fuse)
        check_balance(self)
        if isinstance(self.balance, tuple):
            object.__setattr__(self, "balance", tuple(map(int, self.balance)))
        check_remat(self)
        check_fuse(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_actors={self.num_actors}{options_tail(self)})"

    @property
    def num_actors(self) -> int:
        return self.num_stages // 2

    def actor_of(self, stage: int) -> int:
        return stage if stage < self.num_actors else self.num_stages - 1 - stage


@dataclass(frozen=True, init=False, repr=False)
class ZeroBubbleV(_VShape):
    """ZB-V (Qi et al. 2024, section 6): the V placement with split backwards. Actor a warms up with
    `2(p-a)-1` forwards of its first stage, then alternates its two stages so that each I can start as soon
    as the stage after it has sent its cotangent; Ws fill the gaps. With F = I = W it has no bubble in the
    steady state and holds at most 2p microbatch-stages of activations, like 1F1B's p stages of double size.
    Below 2p - 1 microbatches (the V never fills) a W moves after the task behind it where that shortens the step."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        table = [_zbv_actor(self.num_actors, a, num_microbatches) for a in range(self.num_actors)]
        if num_microbatches < 2 * self.num_actors - 1:  # the V never fills: some Ws stand before an I the step waits on
            table = _defer_ws(table, self.num_stages, self.actor_of)
        return table


def _defer_ws(table: list[Row], num_stages: int, actor_of: Callable[[int], int]) -> list[Row]:
    """`table` with a W moved past the task after it wherever that shortens the step with F = I = W (ZB-V's premise),
    one move at a time until none does (a W feeds no other task, so a later W never deadlocks). At m < 2p - 1 the
    order built for a full V ran a W before an I on the critical path: 10 units where 9 do at m=1 on 2 actors."""
    def length(t: list[Row]) -> float:
        end = replay_table(t, num_stages, actor_of).end
        return max(end.values(), default=0.0) if len(end) == sum(map(len, t)) else float("inf")  # (all ran)

    best = length(table)
    moved = True
    while moved:
        moved = False
        for a, row in enumerate(table):
            for i in range(len(row) - 1):
                if row[i].kind == "W" and row[i + 1].kind != "W":
                    cand = [list(r) for r in table]
                    cand[a][i], cand[a][i + 1] = row[i + 1], row[i]
                    got = length(cand)
                    if got < best - 1e-9:
                        table, best, moved = cand, got, True
                        break
            if moved:
                break
    return table


def _zbv_actor(p: int, a: int, m: int) -> Row:
    first, last = a, 2 * p - 1 - a
    count = {(s, k): 0 for s in (first, last) for k in "FIW"}
    order: Row = []

    def emit(stage: int, *kinds: str) -> None:
        for k in kinds:
            i = count[(stage, k)]
            count[(stage, k)] += 1
            order.append(Task(stage, k, i))

    # Enough forwards that the V's turn (actor p-1's first stage feeding its second) is reached: at least 2p-1
    # microbatches enter; microbatches beyond m are dropped at the end (their tasks and dependencies all go).
    n = max(m, 2 * p - 1)
    for _ in range(2 * (p - a) - 1):
        emit(first, "F")
    for _ in range(a):
        emit(last, "F")
        emit(first, "F")
    for _ in range(p - a):
        emit(last, "F", "I", "W")
    while count[(first, "F")] < n or count[(last, "F")] < count[(first, "F")]:
        if count[(first, "F")] < n:
            emit(first, "F")
        emit(first, "I", "W")
        emit(last, "F", "I", "W")
    for _ in range(a):
        emit(first, "I")
        emit(last, "I")
    for _ in range(p - a):
        emit(first, "I")
        order.append(Task(first, "W", count[(first, "W")]))
        count[(first, "W")] += 1
    for stage in (last, first):
        while count[(stage, "W")] < n:
            emit(stage, "W")
    return [t for t in order if t.mb < m]


@dataclass(frozen=True, init=False, repr=False)
class DualPipeV(_VShape):
    """DeepSeek's DualPipeV (DeepSeek-V3 report; github.com/deepseek-ai/DualPipe) on the V placement. In its
    main phase every actor pairs a forward of one stage with a backward of the other, which DualPipe runs
    overlapped (one chunk's compute hiding the other's communication); here the pair is two adjacent tasks
    (``F`` then ``I W``). A backward whose W is postponed runs its I alone and its W later, oldest first,
    where the actor would otherwise idle. Needs at least 2p microbatches."""

    @property
    def min_microbatches(self) -> int:
        return 2 * self.num_actors

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        if num_microbatches < self.min_microbatches:
            raise ScheduleError(f"{self!r} needs at least {self.min_microbatches} microbatches (2 x num_actors), got {num_microbatches}")
        return [_dualpipev_actor(self.num_actors, a, num_microbatches) for a in range(self.num_actors)]


def _dualpipev_actor(p: int, a: int, m: int) -> Row:
    stage = (a, 2 * p - 1 - a)  # the actor's chunk 0 and chunk 1
    nxt = {(c, k): 0 for c in (0, 1) for k in "FI"}
    held: list[Task] = []  # Ws postponed, run oldest first
    order: Row = []

    def f(c: int) -> None:
        order.append(Task(stage[c], "F", nxt[(c, "F")]))
        nxt[(c, "F")] += 1

    def b(c: int, hold: bool = False) -> None:
        i = nxt[(c, "I")]
        nxt[(c, "I")] += 1
        order.append(Task(stage[c], "I", i))
        (held if hold else order).append(Task(stage[c], "W", i))

    def w() -> None:
        if held:
            order.append(held.pop(0))

    for _ in range(2 * (p - a - 1)):  # 1: chunk-0 forwards
        f(0)
    for _ in range(a + 1):  # 2: both chunks' forwards
        f(0)
        f(1)
    for _ in range(p - a - 1):  # 3: chunk-1 backward with its W right after, then a chunk-1 forward
        b(1, hold=True)
        w()
        f(1)
    for i in range(m - 2 * p + a + 1):  # 4: the main phase, forward of one chunk beside backward of the other
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - a - 1):  # 5
        b(1)
        f(1)
        b(0)
    hold = False  # 6: backward pairs; from the middle on, Ws are postponed
    for i in range(a + 1):
        hold = hold or (i == (a + 1) // 2 and a % 2 == 1)
        b(1, hold)
        hold = hold or (i == (a + 1) // 2 and a % 2 == 0)
        b(0, hold)
    for _ in range(p - a - 1):  # 7: a postponed W, then a chunk-0 backward
        w()
        b(0, hold=True)
    while held:  # 8
        w()
    return order


BUILTINS: dict[str, type[Schedule]] = {c.__name__: c for c in (GPipe, OneFOneB, EagerOneFOneB, InterleavedOneFOneB, ZeroBubbleH1,
                                                              InterleavedZeroBubble, ZeroBubbleV, DualPipeV)}


@dataclass(frozen=True)
class Custom(Schedule):
    """A schedule written as a table: `order[actor]` lists that actor's tasks in order, as strings like ``"0F1"``
    or `Task`s (F, B, or I and W), for one number of microbatches (None, an idle slot as in torch's pipeline_order, is
    left out: an actor waits for its inputs by itself); `stage_actor[s]` is the actor of stage s (default: stage s on
    actor s).

        mpmd.Custom(num_stages=4, order=(("0F0", "3F0", "3B0", "0B0"), ("1F0", "2F0", "2B0", "1B0")),
                    stage_actor=(0, 1, 1, 0))
    """

    order: tuple[tuple[str | Task, ...], ...] = ()
    stage_actor: tuple[int, ...] = ()
    written_table = True  # (not a field) runs exactly the microbatches it names: validation leaves tasks(m) to say so

    def __post_init__(self) -> None:
        super().__post_init__()
        example = "e.g. order=(('0F0', '0B0'), ('1F0', '1B0'))"
        if isinstance(self.order, (str, bytes)) or not isinstance(self.order, Iterable):
            raise ScheduleError(f"Custom: order must be one sequence of tasks per actor, {example}; got {self.order!r:.80}")
        if isinstance(self.order, Mapping):  # (iterating it would read its keys as the rows)
            raise ScheduleError(f"Custom: order must be a sequence of rows in actor order (row a is actor a's tasks), not a "
                                f"{type(self.order).__name__}; e.g. order=tuple(rows[a] for a in sorted(rows)); got {self.order!r:.80}")
        order = [row if isinstance(row, (str, bytes, Task)) or not isinstance(row, Iterable) else tuple(row) for row in self.order]
        for i, row in enumerate(order):  # (generators taken as they are: each is read once)
            if not isinstance(row, tuple):
                raise ScheduleError(f"Custom: order[{i}] must be actor {i}'s sequence of tasks, {example}; got {row!r:.80}")
        def parsed(i: int, j: int, t: object) -> Task:
            try:
                return t if isinstance(t, Task) else Task.parse(t)
            except ValueError as e:
                raise ScheduleError(f"Custom: order[{i}][{j}] (actor {i}'s task {j}): {e}") from None

        # (None: an idle slot, as torch.distributed.pipelining's pipeline_order writes bubbles; an actor waits for its
        # inputs by itself, so it is left out)
        rows = tuple(tuple(parsed(i, j, t) for j, t in enumerate(row) if t is not None) for i, row in enumerate(order))
        for i, row in enumerate(rows):
            for t in row:
                if not (t.kind in TASK_KINDS and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (t.stage, t.mb))):
                    raise ScheduleError(f"Custom: order[{i}] holds Task({t.stage!r}, {t.kind!r}, {t.mb!r}); a task's stage and "
                                        f"microbatch are ints >= 0 and its kind one of {', '.join(TASK_KINDS)}")
        object.__setattr__(self, "order", rows)
        placement = () if self.stage_actor is None else self.stage_actor  # (None: the default, stage s on actor s)
        if isinstance(placement, (str, bytes, Mapping)) or not isinstance(placement, Iterable):
            raise ScheduleError(f"Custom: stage_actor must be a sequence with one actor per stage, e.g. stage_actor=(0, 1, 1, 0) "
                                f"(or left out: stage s on actor s); got {placement!r:.80}")
        object.__setattr__(self, "stage_actor", tuple(placement))
        if not rows:
            raise ScheduleError("Custom needs order=, one tuple of tasks per actor, e.g. order=(('0F0', '0B0'), ('1F0', '1B0'))")
        named = sorted({t.stage for row in rows for t in row})
        if is_count(self.num_stages) and (missing := sorted(set(range(self.num_stages)) - set(named))):
            raise ScheduleError(f"Custom: num_stages={self.num_stages}, but the table has no task of stage"
                                f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} (it names stages "
                                f"{', '.join(map(str, named))}); pass the number of stages the table holds or add the missing "
                                f"stages' tasks\n{format_table([list(r) for r in rows])}")
        mbs = {t.mb for row in rows for t in row}
        if (is_count(self.num_stages) and (1 + max(mbs, default=0)) * self.num_stages > MAX_TABLE_TASKS // 3
                and len(mbs) < 1 + max(mbs)):  # (a table this large naming every microbatch gets the size limit's message)
            i, j, t = max(((i, j, t) for i, row in enumerate(rows) for j, t in enumerate(row)), key=lambda x: x[2].mb)
            raise ScheduleError(f"Custom: order[{i}][{j}] ({t}) names microbatch {t.mb}, but the table's tasks name "
                                f"{len(mbs)} microbatch{'es' if len(mbs) > 1 else ''}: a table runs microbatches 0 .. its "
                                f"highest, each one's every task written out (a typo?)")
        if self.stage_actor and len(self.stage_actor) != self.num_stages:
            raise ScheduleError(f"Custom: stage_actor has {len(self.stage_actor)} entries for num_stages={self.num_stages}; give one actor per stage")

    def __repr__(self) -> str:
        placement = f", stage_actor={self.stage_actor}" if self.stage_actor else ""
        # (a digest of the table: two tables of one shape read apart, e.g. as rows of mpmd.tune's table)
        table = hashlib.sha256(" ".join(",".join(map(str, row)) for row in self.order).encode()).hexdigest()[:6]
        return f"Custom(num_stages={self.num_stages}, {len(self.order)} actors{placement}, table {table}{options_tail(self)})"

    @property
    def num_actors(self) -> int:
        return len(self.order)

    def actor_of(self, stage: int) -> int:
        return self.stage_actor[stage] if self.stage_actor else stage

    @property
    def min_microbatches(self) -> int:
        return 1 + max((t.mb for row in self.order for t in row), default=0)

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        table = [list(row) for row in self.order]
        n = self.min_microbatches
        if num_microbatches != n:
            raise ScheduleError(f"{self!r} is a table for {n} microbatch{'es' if n > 1 else ''} (its tasks go up to microbatch {n - 1}), but "
                                f"{num_microbatches} were asked for; use {n} microbatch{'es' if n > 1 else ''} or write the table for "
                                f"{num_microbatches}\n{format_table(table)}")
        return table
