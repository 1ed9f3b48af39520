"""Proofs that an order can run: `validate` for a schedule's task table, `check_programs` for compiled Programs.

Both proofs are replays. Each actor works through its list in order and an item waits only for its inputs,
so whether the whole list finishes does not depend on how long anything takes: replaying once with any
positive durations either runs every item (the order cannot deadlock) or stops with every unfinished
actor waiting on an input that can never come. The simulator (`mpmd.simulate`) replays with a cost
model's durations through the same two engines, `replay_table` and `replay_programs`.

Task dependencies (stage s of n, microbatch i): ``F(s,i)`` needs ``F(s-1,i)``; ``B(s,i)`` / ``I(s,i)``
need ``F(s,i)`` and the backward of stage s+1 (``B`` or ``I``, whichever that stage uses; the last stage
needs only its ``F``); ``W(s,i)`` needs ``I(s,i)``.

Program semantics (`transport.program`): a `Recv` is posted and a `Send` queued without blocking; a `Run`
waits until each input exists on its actor — after the Run that outputs it, or after its Recv once the
matching Send (same sender, receiver and tag) has been reached on the sender and the sent buffer exists
there; program inputs and constants exist from the start; `Delete` never blocks.
"""

from __future__ import annotations

import numbers
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mpmd.errors import PipelineError, ScheduleError
from transport.program import TASK_KINDS, Delete, Instruction, Program, Recv, Run, Send, Task

Table = list[list[Task]]


SCHEDULE_ATTRIBUTES = ("num_stages", "num_actors", "actor_of", "tasks")  # (min_microbatches: 1, split_backward: the table's, if absent)


def schedule_lacks(value: object) -> list[str]:
    """The attributes of a schedule (`Schedule` below) that `value` lacks: the one duck-typing rule for schedules."""
    return [a for a in SCHEDULE_ATTRIBUTES if not hasattr(value, a) or (a in ("actor_of", "tasks") and not callable(getattr(value, a)))]


class Schedule(Protocol):
    """What a proof reads of a schedule (`mpmd.schedules.Schedule` has it; so may any object of the user's, which
    may leave out min_microbatches (then 1) and split_backward (then whatever its table does))."""

    num_stages: int

    @property
    def num_actors(self) -> int: ...

    @property
    def min_microbatches(self) -> int: ...

    @property
    def split_backward(self) -> bool: ...

    def actor_of(self, stage: int) -> int: ...

    def tasks(self, num_microbatches: int) -> list[list[Task]]: ...


def format_table(table: Table, mark: dict[int, int] | None = None, notes: dict[int, str] | None = None) -> str:
    """The per-actor task table, one line per actor; ``mark[actor] = position`` puts that task in brackets
    and ``notes[actor]`` is appended to the actor's line."""
    lines = []
    for a, row in enumerate(table):
        cells = [f"[{t}]" if mark and mark.get(a) == i else str(t) for i, t in enumerate(row)]
        line = f"actor {a}: " + " ".join(cells)
        if notes and a in notes:
            line += f"    <- {notes[a]}"
        lines.append(line)
    return "\n".join(lines)


def split_stages(table: Table) -> set[int]:
    """The stages whose backward the table splits into I and W."""
    return {t.stage for row in table for t in row if t.kind in ("I", "W")}


def stages_without_input_grad(programs: Sequence[Program]) -> tuple[set[int], int]:
    """The stages the compiled `programs` give W tasks but no I task (no input gradient to export: stage 0, or a
    stage nothing before it has parameters), and the number of stages (0 when no Run has a task)."""
    tasks = [t for prog in programs for ins in prog.instructions if isinstance(ins, Run) for t in ins.label.tasks]
    if not tasks:
        return set(), 0
    has_i = {t.stage for t in tasks if t.kind == "I"}
    return {t.stage for t in tasks if t.kind == "W"} - has_i, max(t.stage for t in tasks) + 1


def task_inputs(t: Task, num_stages: int, split: set[int]) -> list[Task]:
    """The tasks `t` waits for (see the module docstring); `split` holds the stages that use I/W."""
    if t.kind == "F":
        return [Task(t.stage - 1, "F", t.mb)] if t.stage > 0 else []
    if t.kind == "W":
        return [Task(t.stage, "I", t.mb)]
    deps = [Task(t.stage, "F", t.mb)]
    if t.stage < num_stages - 1:
        deps.append(Task(t.stage + 1, "I" if t.stage + 1 in split else "B", t.mb))
    return deps


@dataclass(frozen=True)
class TableReplay:
    """When each task ran; `stuck[actor]` is the position of the first task an actor could never start."""

    start: dict[Task, float]
    end: dict[Task, float]
    stuck: dict[int, int]


def replay_table(table: Table, num_stages: int, actor_of: Callable[[int], int],
                 duration: Callable[[Task], float] = lambda t: 1.0,
                 transfer: Callable[[Task, Task], float] = lambda src, dst: 0.0) -> TableReplay:
    """Run the table: each actor starts its next task once the previous one ended and every input has
    ended (plus `transfer(input, task)` when the input ran on another actor)."""
    split = split_stages(table)
    start: dict[Task, float] = {}
    end: dict[Task, float] = {}
    pos = [0] * len(table)
    clock = [0.0] * len(table)
    # A worklist: an actor is looked at again only when the task it waits for has ended (a pass over every actor
    # per wave was quadratic in the stages: 4,000 stages of GPipe took 169 s; a probe). Each task's times depend
    # only on its actor's previous task and its inputs, so the order actors are looked at in changes nothing.
    waiting: dict[Task, list[int]] = {}
    ready_actors = list(range(len(table)))
    while ready_actors:
        a = ready_actors.pop()
        row = table[a]
        while pos[a] < len(row):
            t = row[pos[a]]
            deps = task_inputs(t, num_stages, split)
            missing = next((d for d in deps if d not in end), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(a)
                break
            ready = [end[d] + (transfer(d, t) if actor_of(d.stage) != a else 0.0) for d in deps]
            start[t] = max([clock[a], *ready])
            end[t] = clock[a] = start[t] + duration(t)
            pos[a] += 1
            ready_actors.extend(waiting.pop(t, ()))
    stuck = {a: pos[a] for a, row in enumerate(table) if pos[a] < len(row)}
    return TableReplay(start, end, stuck)


def _fail(problem: str, table: Table, mark: dict[int, int] | None = None, notes: dict[int, str] | None = None) -> ScheduleError:
    return ScheduleError(f"{problem}\n{format_table(table, mark, notes)}")


# Tasks a table may hold, counted as 3 per microbatch-stage (F, and B or I and W): 66,666 microbatch-stages, e.g.
# 64 stages x 1024 microbatches. Validating and simulating grow with the tasks (a 2-core machine: 3-6 s at the cap;
# 1000 x 1000 took 6 minutes and gigabytes).
MAX_TABLE_TASKS = 200_000


def users_call(name: str, call: str, method: Callable[[int], Any], arg: int) -> Any:
    """A schedule's own method called: what it raises (but a ScheduleError) comes back a ScheduleError naming the
    schedule and the call, the user's exception chained with its traceback (a TypeError in a user's tasks() read
    as a wrong return type and lost its line; a KeyError came out bare; a probe)."""
    try:
        return method(arg)
    except ScheduleError:
        raise
    except Exception as e:
        raise _raised(name, call, e) from e


def declared_split_backward(schedule: Any, name: str) -> bool | None:
    """`schedule.split_backward` (None where the schedule has none: its table decides), what it raises a
    ScheduleError that says so: the Schedule base class reads it from `tasks(min_microbatches)`, and a subclass
    whose tasks() refuses that count failed with its own bare exception, naming a count the caller never asked for
    (a probe; `hasattr` would have swallowed an AttributeError and skipped the check)."""
    if not (hasattr(type(schedule), "split_backward") or "split_backward" in getattr(schedule, "__dict__", {})):
        return None
    try:
        return bool(schedule.split_backward)
    except ScheduleError:
        raise
    except Exception as e:
        least = getattr(schedule, "min_microbatches", 1)
        raise ScheduleError(
            f"{name}.split_backward raised {type(e).__name__}: {e} (the Schedule base class reads it from "
            f"tasks(min_microbatches) = tasks({least!r}): set min_microbatches to the fewest microbatches tasks() takes, "
            "or define split_backward; the exception above says where)") from e


MISSING_SHOWN = 12  # tasks named in a "tasks missing" error (the rest counted, summarised per stage and kind)


def missing_tasks(missing: set[Task], m: int) -> str:
    """What a "tasks missing" error says: how many, the first `MISSING_SHOWN`, and per stage and kind the
    microbatches whose task is missing (all of them, or a count): a table missing 20,000 tasks printed them all on
    one line of 137,837 characters (a probe)."""
    ordered = sorted(missing)
    if len(ordered) <= MISSING_SHOWN:
        return " ".join(map(str, ordered))
    by: dict[tuple[int, str], int] = {}
    for t in ordered:
        by[t.stage, t.kind] = by.get((t.stage, t.kind), 0) + 1
    groups = [f"stage {s} {k}: {'every microbatch' if c == m else f'{c} of {m} microbatches'}" for (s, k), c in sorted(by.items())]
    shown = "; ".join(groups[:MISSING_SHOWN]) + (f"; and {len(groups) - MISSING_SHOWN} more stages and kinds" if len(groups) > MISSING_SHOWN else "")
    return f"{len(ordered)} tasks, {' '.join(map(str, ordered[:MISSING_SHOWN]))} ... ({shown})"


def _raised(name: str, call: str, e: Exception) -> ScheduleError:
    return ScheduleError(f"{name}.{call} raised {type(e).__name__}: {e} (the exception above says where)")


def is_count(x: object) -> bool:
    """An integer (Python's or numpy's: `numbers.Integral`), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def validate(schedule: Schedule, num_microbatches: int, forward_only: bool = False) -> Table:
    """Check that `schedule`'s table for `num_microbatches` is complete, placed consistently and cannot
    deadlock; return it. Raises `ScheduleError` naming the problem, with the table and the offending tasks
    in brackets. `forward_only` (a loop that computes no gradients: evaluation): only the F tasks must be
    there (a table of F tasks alone is complete; backward tasks in it are checked as usual).

        table = validate(mpmd.OneFOneB(num_stages=4), 8)
    """
    return validate_placed(schedule, num_microbatches, forward_only)[0]


def validate_placed(schedule: Schedule, num_microbatches: int, forward_only: bool = False) -> tuple[Table, tuple[int, ...]]:
    """`validate`, also giving the placement it proved the table with: `placement[stage]` is `actor_of(stage)`,
    asked once per stage (and once more, to refuse a schedule whose answers change from call to call). Whoever
    goes on to use the table reads the placement from this tuple, not from `actor_of` again: a user's method
    could answer otherwise later (a counter, a random draw), and a stage would then be split over two actors."""
    lacks = [] if isinstance(schedule, type) else schedule_lacks(schedule)
    if isinstance(schedule, type) or lacks:
        what = f"the class {schedule.__name__}" if isinstance(schedule, type) else f"{type(schedule).__name__} {schedule!r:.60}"
        missing = f" (it lacks {', '.join(lacks)})" if lacks else ""
        raise ScheduleError(f"expected a schedule such as mpmd.OneFOneB(num_stages=2), got {what}{missing}; subclass mpmd.Schedule "
                            "to write one")
    name, m, n = str(schedule), num_microbatches, schedule.num_stages
    if not is_count(m) or m < 1:
        raise ScheduleError(f"{name}: the number of microbatches must be a positive int, got {m!r}")
    if not is_count(n) or n < 1:
        raise ScheduleError(f"{name}: num_stages must be a positive int, got {n!r}")
    m, n = int(m), int(n)  # (numpy integers taken as ints)
    if m * n > MAX_TABLE_TASKS // 3:  # (F, B or I and W: three tasks per stage and microbatch at most)
        raise ScheduleError(f"{name} with {m} microbatches: {m} x {n} stages is more than a schedule table holds here "
                            f"({MAX_TABLE_TASKS // 3:,} microbatch-stages: validating and simulating more takes more than a "
                            f"few seconds, and minutes past a million); use fewer, larger microbatches or fewer stages"
                            + (f" (at most {MAX_TABLE_TASKS // 3 // n:,} microbatches with {n} stages)" if MAX_TABLE_TASKS // 3 >= n else "")
                            + ". To compare schedules at that "
                            "scale, simulate fewer microbatches: once the pipeline is full, the step time grows by about the same "
                            "amount with every microbatch")
    need, p = getattr(schedule, "min_microbatches", 1), schedule.num_actors
    if not is_count(need):
        raise ScheduleError(f"{name}: min_microbatches must be an int, got {need!r:.40}")
    if not is_count(p) or p < 1:
        raise ScheduleError(f"{name}: num_actors must be a positive int, got {p!r:.40}")
    if m < need and not getattr(schedule, "written_table", False):  # (a written table's tasks(m) says what it runs)
        raise ScheduleError(f"{name} needs at least {need} microbatches, got {m}; split the batch into {need} or more "
                            "microbatches, or pick a schedule that needs fewer")
    placed = []
    for s in range(n):
        a = users_call(name, f"actor_of({s})", schedule.actor_of, s)
        if not is_count(a) or not 0 <= a < p:
            raise ScheduleError(f"{name} places stage {s} on actor {a!r}, but its actors are 0..{p - 1}; " + (
                f"stage_actor[{s}] must name one of the table's {p} rows" if getattr(schedule, "stage_actor", None) else
                "actor_of(stage) must return an actor below num_actors"))
        placed.append(int(a))  # (a numpy integer taken as an int)
    placement = tuple(placed)
    again = tuple(users_call(name, f"actor_of({s})", schedule.actor_of, s) for s in range(n))
    if again != placement:
        s = next(s for s in range(n) if again[s] != placement[s])
        raise ScheduleError(f"{name}.actor_of({s}) answered {placement[s]}, then {again[s]!r:.40} when asked again; a stage lives on "
                            "one actor: actor_of must give the same answer at every call (compute it from the schedule's own "
                            "fields, not from a counter, a random draw or state that changes)")
    actor_of = placement.__getitem__
    rows = users_call(name, f"tasks({m})", schedule.tasks, m)
    try:
        table = [list(row) for row in rows]
    except ScheduleError:
        raise
    except TypeError as e:  # (chained: a generator's own TypeError is raised here too, and its line is the user's)
        raise ScheduleError(f"{name}.tasks({m}) must return one list of Tasks per actor ({e})") from e
    except Exception as e:  # (a tasks() written as a generator runs here)
        raise _raised(name, f"tasks({m})", e) from e
    if len(table) != p:
        used = 1 + max(placement)
        hint = (f" (num_actors defaults to num_stages: a schedule whose actor_of puts its {n} stages on {used} actors "
                f"overrides num_actors too, to return {used})" if len(table) == used < p == n else "")
        raise ScheduleError(f"{name}.tasks({m}) gives {len(table)} task lists for its {p} actors; return one list per "
                            f"actor{hint}")
    seen: dict[Task, tuple[int, int]] = {}
    home: dict[int, tuple[int, int]] = {}  # stage -> where its first task sits
    for a, row in enumerate(table):
        for i, t in enumerate(row):
            if not isinstance(t, Task):
                raise _fail(f"{name}.tasks({m}) must give Task objects, but actor {a}'s task {i} is a {type(t).__name__} "
                            f"{t!r:.40}" + (f" (mpmd.Task.parse({t!r:.20}) makes one)" if isinstance(t, str) else ""), table, {a: i})
            for field, v in (("stage", t.stage), ("microbatch", t.mb)):
                if not is_count(v):
                    raise _fail(f"{name}.tasks({m}): actor {a}'s task {i} has {field} {v!r:.40}; a Task's stage and "
                                "microbatch are ints", table, {a: i})
            if t.kind not in TASK_KINDS or not (0 <= t.stage < n and 0 <= t.mb < m):
                raise _fail(f"{t!s} on actor {a} is not a task of {n} stages x {m} microbatches (kinds F, B, I, W); "
                            f"tasks are stage, kind, microbatch like '0F3', with stage < {n} and microbatch < {m}",
                            table, {a: i})
            if t in seen:
                raise _fail(f"task {t} appears twice (actor {seen[t][0]} position {seen[t][1]}, and actor {a} position {i}); "
                            "each task runs exactly once", table, {a: i})
            seen[t] = (a, i)
            b, j = home.setdefault(t.stage, (a, i))
            if b != a:  # (the task marked: the one off actor_of's actor, not always the later one; a probe)
                stray = {b: j} if actor_of(t.stage) == a else {a: i}
                raise _fail(f"stage {t.stage} has tasks on two actors ({table[b][j]} on actor {b}, {t} on actor {a}); a stage "
                            f"lives on one actor, actor_of({t.stage}) = {actor_of(t.stage)}", table, stray)
    for s, (a, i) in sorted(home.items()):
        if actor_of(s) != a:
            raise _fail(f"task {table[a][i]} is on actor {a} but stage {s} belongs to actor {actor_of(s)} "
                        f"(actor_of({s})); move stage {s}'s tasks there or change the placement", table, {a: i})
    split = split_stages(table)
    declared = declared_split_backward(schedule, name)
    if declared is not None and bool(split) != declared:
        raise _fail(f"{name}.split_backward is {declared} but its table {'uses' if split else 'has no'} I/W tasks; "
                    "make split_backward return whether tasks() splits backwards (the Schedule base class reads it from "
                    "tasks(min_microbatches): a table splits backwards for every microbatch count, or for none)", table)
    for t, (a, i) in seen.items():
        if t.kind == "B" and t.stage in split:
            other = next(u for u in seen if u.stage == t.stage and u.kind in ("I", "W"))
            raise _fail(f"stage {t.stage} mixes a fused backward ({t}) with split ones ({other}); a stage uses either B "
                        "or I and W for every microbatch", table, {a: i})
        if t.kind == "I" and Task(t.stage, "W", t.mb) not in seen:
            raise _fail(f"task {t} has no {Task(t.stage, 'W', t.mb)}: every input-gradient half I needs its weight-gradient "
                        "half W", table, {a: i})
    backward = {t.stage for t in seen if t.kind != "F"}  # (forward_only: a stage without backward tasks needs none)
    if forward_only and backward:  # (but a backward reads the next stage's: every later stage needs one too)
        backward |= set(range(min(backward), n))
    kinds = {s: ("F",) if forward_only and s not in backward else ("F", "I", "W") if s in split else ("F", "B") for s in range(n)}
    expected = {Task(s, k, i) for s in range(n) for k in kinds[s] for i in range(m)}
    missing = expected - set(seen)
    if missing:
        hint = ("; this loop computes no gradients (evaluation): leave its backward tasks out, or give each stage after "
                "one with backward tasks its backward too" if forward_only and any(t.kind != "F" for t in missing) else "")
        raise _fail(f"tasks missing from the schedule: {missing_tasks(missing, m)}{hint}", table)
    _prove_table(table, n, actor_of)
    return table, placement


def _prove_table(table: Table, n: int, actor_of: Callable[[int], int]) -> None:
    run = replay_table(table, n, actor_of)
    if not run.stuck:
        return
    split = split_stages(table)
    where = {t: (a, i) for a, row in enumerate(table) for i, t in enumerate(row)}
    notes: dict[int, str] = {}
    for a, i in run.stuck.items():
        t = table[a][i]
        d = next(d for d in task_inputs(t, n, split) if d not in run.end)
        b, j = where[d]
        if b == a:
            if t.kind == "W":
                problem = f"task {t} on actor {a} comes before its {d}, which actor {a} runs later (position {j}); a W needs its I"
            else:
                problem = f"task {t} on actor {a} comes before {d}, which it needs and which actor {a} runs later (position {j})"
            raise _fail(f"{problem}: {t} can never start; put {d} before it", table, {a: i}, {a: f"{t} needs {d}, later on this actor"})
        notes[a] = f"{t} waits for {d} on actor {b}"
    raise _fail("schedule deadlocks: each unfinished actor waits for a task on another (stuck tasks in brackets)", table,
                run.stuck, notes)


# ---------------------------------------------------------------- compiled Programs


@dataclass(frozen=True)
class _Source:
    """Where a buffer read at some instruction comes from on its actor: program input/const, a Run, or a Recv."""

    kind: str  # "input", "run", "recv"
    index: int = -1  # instruction index of the Run/Recv


@dataclass(frozen=True)
class ProgramReplay:
    """When each instruction ran: `start`/`end` per (actor, index) for Runs, `reached` for every instruction
    the actor got to; `ready[(actor, index)]` is when a Recv's buffer arrived; `stuck[actor]` is the index of
    the Run an actor could never start."""

    start: dict[tuple[int, int], float]
    end: dict[tuple[int, int], float]
    reached: dict[tuple[int, int], float]
    ready: dict[tuple[int, int], float]
    stuck: dict[int, int]


def format_programs(programs: list[Program], mark: dict[int, int] | None = None, notes: dict[int, str] | None = None) -> str:
    """Each actor's instruction list, one line per instruction; ``mark[actor] = index`` flags one with ``>``."""
    out = []
    for a, prog in enumerate(programs):
        lines = [f"actor {a}: inputs {prog.inputs} outputs {prog.outputs}" + (f" consts {sorted(prog.consts)}" if prog.consts else "")]
        for i, ins in enumerate(prog.instructions):
            flag = mark is not None and mark.get(a) == i
            note = f"    <-- {notes[a]}" if flag and notes and a in notes else ""
            lines.append(f"  {'>' if flag else ' '} {i:3d}  {ins}{note}")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _reads(ins: Instruction) -> tuple[int, ...]:
    if isinstance(ins, Run):
        return ins.inputs
    if isinstance(ins, Send):
        return (ins.buf,)
    return ()


def _link(programs: list[Program]) -> tuple[list[dict[int, dict[int, _Source]]], dict[tuple[int, int], tuple[int, int]]]:
    """Static checks; per actor, for each instruction, the source of every buffer it reads; and each Recv's
    matching Send: (receiver, recv index) -> (sender, send index)."""
    p = len(programs)
    sources: list[dict[int, dict[int, _Source]]] = []

    def fail(problem: str, a: int, i: int) -> PipelineError:
        return PipelineError(f"{problem}\n{format_programs(programs, {a: i})}")

    sends: dict[tuple[int, int, int], deque[int]] = defaultdict(deque)
    recvs: dict[tuple[int, int, int], deque[int]] = defaultdict(deque)
    for a, prog in enumerate(programs):
        if prog.actor != a:
            raise PipelineError(f"program {a} of the list says it is actor {prog.actor}'s; pass one program per actor, in actor order")
        made = {b: _Source("input") for b in (*prog.inputs, *prog.consts)}
        later = {b: i for i, ins in reversed(list(enumerate(prog.instructions)))
                 for b in (ins.outputs if isinstance(ins, Run) else (ins.buf,) if isinstance(ins, Recv) else ())}
        deleted: dict[int, int] = {}
        src: dict[int, dict[int, _Source]] = {}
        for i, ins in enumerate(prog.instructions):
            reads = _reads(ins)
            for b in reads:
                if b not in made:
                    if b in deleted:
                        why = f"it was deleted (or donated to a Run) at instruction {deleted[b]}"
                    elif b in later and later[b] > i:
                        why = f"it is only made later, at instruction {later[b]}, so this can never run"
                    else:
                        why = "nothing produces it (no program input, constant, Run output or Recv)"
                    raise fail(f"actor {a} instruction {i} ({ins}) reads buffer b{b}, but {why}", a, i)
            src[i] = {b: made[b] for b in reads}
            if isinstance(ins, Run):
                for d in ins.donate:  # (the actor deletes a donated input: its buffer now holds an output)
                    if 0 <= d < len(ins.inputs) and ins.inputs[d] not in ins.outputs:
                        made.pop(ins.inputs[d], None)
                        deleted[ins.inputs[d]] = i
                for b in ins.outputs:
                    made[b] = _Source("run", i)
            elif isinstance(ins, Recv):
                if not 0 <= ins.from_actor < p or ins.from_actor == a:
                    raise fail(f"actor {a} instruction {i} receives from actor {ins.from_actor}; peers are the other actors of 0..{p - 1}", a, i)
                made[ins.buf] = _Source("recv", i)
                recvs[(ins.from_actor, a, ins.tag)].append(i)
            elif isinstance(ins, Send):
                if not 0 <= ins.to_actor < p or ins.to_actor == a:
                    raise fail(f"actor {a} instruction {i} sends to actor {ins.to_actor}; peers are the other actors of 0..{p - 1}", a, i)
                sends[(a, ins.to_actor, ins.tag)].append(i)
            elif isinstance(ins, Delete):
                for b in ins.bufs:
                    made.pop(b, None)
                    deleted[b] = i
        sources.append(src)
    match: dict[tuple[int, int], tuple[int, int]] = {}
    for key in sorted(set(sends) | set(recvs)):
        src_a, dst_a, tag = key
        s_list, r_list = sends.get(key, deque()), recvs.get(key, deque())
        while s_list and r_list:
            match[(dst_a, r_list.popleft())] = (src_a, s_list.popleft())
        if r_list:
            raise fail(f"actor {dst_a} instruction {r_list[0]} receives tag #{tag} from actor {src_a}, but actor {src_a} has no "
                       f"matching SEND -> a{dst_a} #{tag}", dst_a, r_list[0])
        if s_list:
            raise fail(f"actor {src_a} instruction {s_list[0]} sends tag #{tag} to actor {dst_a}, but actor {dst_a} has no "
                       f"matching RECV <- a{src_a} #{tag}", src_a, s_list[0])
    return sources, match


def replay_programs(programs: list[Program], run_time: Callable[[int, Run], float] = lambda a, r: 1.0,
                    transfer_time: Callable[[int, Recv], float] = lambda a, r: 0.0) -> ProgramReplay:
    """Run compiled Programs with `run_time(actor, run)` per Run and `transfer_time(receiver, recv)` from the
    moment a transfer can start (Send reached, sent buffer ready, Recv posted) to its arrival. Raises
    `PipelineError` (with the marked listing) for reads of buffers nothing produces and unmatched transfers;
    a deadlock leaves `stuck` non-empty (`check_programs` turns it into an error)."""
    sources, match = _link(programs)
    start: dict[tuple[int, int], float] = {}
    end: dict[tuple[int, int], float] = {}
    reached: dict[tuple[int, int], float] = {}
    ready: dict[tuple[int, int], float] = {}
    pos = [0] * len(programs)
    clock = [0.0] * len(programs)

    def buffer_ready(a: int, s: _Source) -> float | None:
        if s.kind == "input":
            return 0.0
        if s.kind == "run":
            return end.get((a, s.index))
        key = (a, s.index)
        if key not in ready:
            b, j = match[key]
            if (b, j) not in reached:
                return None
            sent = buffer_ready(b, sources[b][j][programs[b].instructions[j].buf])
            if sent is None:
                return None
            ready[key] = max(reached[key], reached[(b, j)], sent) + transfer_time(a, programs[a].instructions[s.index])
        return ready[key]

    progress = True
    while progress:
        progress = False
        for a, prog in enumerate(programs):
            while pos[a] < len(prog.instructions):
                i = pos[a]
                ins = prog.instructions[i]
                if isinstance(ins, Run):
                    times = [buffer_ready(a, sources[a][i][b]) for b in ins.inputs]
                    if any(t is None for t in times):
                        break
                    start[(a, i)] = max([clock[a], *times])  # type: ignore[list-item]
                    end[(a, i)] = clock[a] = start[(a, i)] + run_time(a, ins)
                reached[(a, i)] = clock[a] if not isinstance(ins, Run) else start[(a, i)]
                pos[a] += 1
                progress = True
    # Recvs whose data arrives after the last Run on their actor still complete.
    for a, prog in enumerate(programs):
        for i, ins in enumerate(prog.instructions):
            if isinstance(ins, Recv) and (a, i) in reached:
                buffer_ready(a, _Source("recv", i))
    stuck = {a: pos[a] for a, prog in enumerate(programs) if pos[a] < len(prog.instructions)}
    return ProgramReplay(start, end, reached, ready, stuck)


def check_programs(programs: list[Program]) -> None:
    """Prove that compiled Programs (one per actor, in actor order) run to the end: every buffer a Run or
    Send reads is produced before it, every Recv has its Send and vice versa, and no Run waits forever.
    Raises `PipelineError` listing every actor's instructions with the stuck (or offending) one marked and
    what it waits for, from whom."""
    if isinstance(programs, (str, bytes)) or not hasattr(programs, "__len__") or not all(isinstance(x, Program) for x in programs):
        got = type(programs).__name__ if not hasattr(programs, "__len__") else f"{[type(x).__name__ for x in programs][:4]}"
        raise PipelineError(f"check_programs takes a list of Programs, one per actor in actor order (as a compiled step's "
                            f"`programs` holds them), got {got}")
    run = replay_programs(programs)
    if not run.stuck:
        return
    sources, match = _link(programs)
    notes = {}
    for a, i in run.stuck.items():
        ins = programs[a].instructions[i]
        for b in ins.inputs:  # type: ignore[union-attr]
            s = sources[a][i][b]
            if s.kind == "recv" and (a, s.index) not in run.ready:
                peer, j = match[(a, s.index)]
                recv = programs[a].instructions[s.index]
                if (peer, j) in run.reached:
                    why = f"actor {peer} reached SEND #{recv.tag} (instruction {j}) but the buffer it sends never exists there"
                else:
                    why = f"actor {peer} never reaches its SEND #{recv.tag} (instruction {j})"
                    if peer in run.stuck:
                        why += f": it is stuck at instruction {run.stuck[peer]}"
                notes[a] = f"stuck: waits for b{b} from actor {peer} (#{recv.tag}); {why}"
                break
    raise PipelineError("compiled programs deadlock: every unfinished actor waits for a buffer that can never arrive "
                        f"(stuck instructions marked >)\n{format_programs(programs, run.stuck, notes)}")
