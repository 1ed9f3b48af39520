"""Schedules: which task each actor runs, in what order.

A schedule is a plain object with `num_stages`, `num_actors`, `actor_of(stage)` and
`tasks(num_microbatches) -> list[list[Task]]` (one ordered list per actor). The compiler only reads that
table, so a new schedule (or a user's own, via `Custom`) needs no compiler change. Text form of a task
follows torch.distributed.pipelining: ``0F3`` is stage 0 forward of microbatch 3, ``1B0`` stage 1 backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpmd.errors import ScheduleError
from transport.program import Task

F, B = "F", "B"


@dataclass(frozen=True)
class Schedule:
    """Base: one stage per actor."""

    num_stages: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ScheduleError(f"{type(self).__name__}: num_stages must be a positive int, got {self.num_stages!r}")

    @property
    def num_actors(self) -> int:
        return self.num_stages

    def actor_of(self, stage: int) -> int:
        return stage

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        raise NotImplementedError


@dataclass(frozen=True)
class GPipe(Schedule):
    """All forwards, then all backwards (Huang et al. 2019)."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m = num_microbatches
        return [[Task(s, F, i) for i in range(m)] + [Task(s, B, i) for i in range(m)] for s in range(self.num_stages)]


@dataclass(frozen=True)
class OneFOneB(Schedule):
    """1F1B (PipeDream-flush): a warm-up of forwards, then one forward and one backward in turn.

    Holds at most `num_stages - stage` microbatches of activations per stage instead of all of them."""

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        m, n = num_microbatches, self.num_stages
        out = []
        for s in range(n):
            warm = min(n - 1 - s, m)
            order = [Task(s, F, i) for i in range(warm)]
            f, b = warm, 0
            while f < m:
                order += [Task(s, F, f), Task(s, B, b)]
                f += 1
                b += 1
            order += [Task(s, B, i) for i in range(b, m)]
            out.append(order)
        return out


@dataclass(frozen=True)
class Custom(Schedule):
    """A schedule given as a table: `order[actor]` is a list of task strings like "0F1" or Task objects,
    for a fixed number of microbatches; `stage_actor[s]` says which actor runs stage s."""

    order: tuple[tuple[str, ...], ...] = ()
    stage_actor: tuple[int, ...] = ()

    @property
    def num_actors(self) -> int:
        return len(self.order)

    def actor_of(self, stage: int) -> int:
        return self.stage_actor[stage] if self.stage_actor else stage

    def tasks(self, num_microbatches: int) -> list[list[Task]]:
        out = []
        for row in self.order:
            tasks = []
            for t in row:
                tasks.append(t if isinstance(t, Task) else Task.parse(t))
            out.append(tasks)
        return out


def format_table(table: list[list[Task]], mark: dict[int, int] | None = None) -> str:
    """The per-actor task table; `mark[actor] = position` highlights where each actor is stuck."""
    lines = []
    for a, row in enumerate(table):
        cells = [f"[{t}]" if mark and mark.get(a) == i else str(t) for i, t in enumerate(row)]
        lines.append(f"actor {a}: " + " ".join(cells))
    return "\n".join(lines)


def validate(schedule: Schedule, num_microbatches: int) -> list[list[Task]]:
    """Check the table is complete and runs to the end; return it. Raises ScheduleError with the table."""
    table = schedule.tasks(num_microbatches)
    n, m = schedule.num_stages, num_microbatches
    if len(table) != schedule.num_actors:
        raise ScheduleError(f"{schedule} gives {len(table)} task lists for {schedule.num_actors} actors")
    expected = {Task(s, k, i) for s in range(n) for k in (F, B) for i in range(m)}
    seen: dict[Task, int] = {}
    for a, row in enumerate(table):
        for t in row:
            if t in seen:
                raise ScheduleError(f"task {t} appears twice (actors {seen[t]} and {a})\n{format_table(table)}")
            if t not in expected:
                raise ScheduleError(f"task {t} is not a task of {n} stages x {m} microbatches\n{format_table(table)}")
            if schedule.actor_of(t.stage) != a:
                raise ScheduleError(f"task {t} is on actor {a} but stage {t.stage} belongs to actor {schedule.actor_of(t.stage)}")
            seen[t] = a
    missing = expected - set(seen)
    if missing:
        raise ScheduleError(f"tasks missing from the schedule: {' '.join(sorted(map(str, missing)))}\n{format_table(table)}")
    # Dry run with unit times: each actor runs its list in order once a task's inputs exist.
    done: set[Task] = set()
    pos = [0] * len(table)

    def ready(t: Task) -> bool:
        if t.kind == F:
            return t.stage == 0 or Task(t.stage - 1, F, t.mb) in done
        prev = Task(t.stage + 1, B, t.mb) if t.stage < n - 1 else Task(t.stage, F, t.mb)
        return prev in done and Task(t.stage, F, t.mb) in done

    progress = True
    while progress:
        progress = False
        for a, row in enumerate(table):
            while pos[a] < len(row) and ready(row[pos[a]]):
                done.add(row[pos[a]])
                pos[a] += 1
                progress = True
    if len(done) != len(expected):
        stuck = {a: pos[a] for a in range(len(table)) if pos[a] < len(table[a])}
        raise ScheduleError(f"schedule deadlocks: every actor waits on another (stuck tasks in brackets)\n{format_table(table, stuck)}")
    return table
