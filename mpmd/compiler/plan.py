"""Turn a traced step (one jaxpr with one `accumulate_p` loop) and a schedule into one Program per actor.

Pure: jaxpr in, `StepPlan` out (executables still as Python functions; `iter_lowered` exports them).
`plan_step` is a pipeline of named passes, each a pure function with typed input and output, callable alone
(value keys and the other keys are the named types of `mpmd.compiler.keys`):

=========================  ============================================  ======================
pass                       takes                                         gives
=========================  ============================================  ======================
`find_step_loop`           the traced step (ClosedJaxpr)                 `StepLoop`
`analyse_loop_body`        StepLoop                                      `body.LoopBody`
`schedule_stages`          StepLoop, LoopBody, mesh size                 `ScheduledStages`
`canonical_vars`           StepLoop, LoopBody                            `CanonicalVars`
`plan_loop_tasks`          ScheduledStages, LoopBody, CanonicalVars      `LoopTasks`
`place_outside_loop`       StepLoop, LoopBody, CanonicalVars, LoopTasks  `OutsideLoop`
`order_units`              StepLoop, CanonicalVars, LoopTasks,           `OrderedUnits`
                           OutsideLoop, HiddenOutputs
`infer_step_transfers`     OrderedUnits                                  `programs.Transfers`
`fuse_units`               OrderedUnits, Transfers                       `ActorUnits`
`donate_buffers`           ActorUnits, OrderedUnits, Transfers           `ActorUnits`
`collect_templates`        ActorUnits, avals                             `Templates`
`emit_programs`            OrderedUnits, ActorUnits, Transfers           `EmittedPrograms`
=========================  ============================================  ======================

The first five live in `loop_tasks` (with `inline.inline_calls`, `body.analyse` and `stages` doing the
work), `place_outside_loop` in `outside_loop` (`placement`'s rules), the rest in `assemble` (`units.fuse`,
`programs.choose_donations`, `programs.build_programs`): executables and Programs with every transfer
inferred, also between non-adjacent stages and for values several stages share.

Host callbacks: `plan_loop_tasks` and `place_outside_loop` each give the callbacks they took out
(`HiddenOutputs`, operands naming values by key); `plan_step` joins them in that order and numbers the
hidden outputs once, at the end.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jax.extend.core import ClosedJaxpr

from mpmd.compiler.assemble import (
    Templates,
    collect_templates,
    donate_buffers,
    emit_programs,
    fuse_units,
    infer_step_transfers,
    order_units,
)
from mpmd.compiler.effects import HostCall
from mpmd.compiler.host_calls import placed
from mpmd.compiler.keys import OutputHome, ValueKey
from mpmd.compiler.loop_tasks import (
    analyse_loop_body,
    canonical_vars,
    find_loop,
    find_step_loop,
    plan_loop_tasks,
    schedule_stages,
)
from mpmd.compiler.outside_loop import place_outside_loop
from mpmd.compiler.program import Program, Run, Task
from mpmd.compiler.programs import Transfers
from mpmd.compiler.stages import StageSplit
from mpmd.compiler.units import Outer, Unit

__all__ = ["StepPlan", "find_loop", "iter_lowered", "plan_step"]


@dataclass(repr=False)
class StepPlan:
    programs: list[Program]
    arg_homes: list[set[int]]  # per flat argument: actors that read it
    out_homes: list[OutputHome]  # per flat output: ("actors", [..]) | ("arg", index) | ("const", value)
    out_avals: list[Any]
    table: list[list[Task]]
    split: StageSplit
    units: dict[int, list[Unit]]
    transfers: Transfers
    avals: dict[ValueKey, Any]
    templates: Templates = field(default_factory=dict)
    arg_keys: list[ValueKey] = field(default_factory=list)
    out_keys: list[Any] = field(default_factory=list)  # per flat output: its key (or a Literal)
    layouts: dict[ValueKey, Any] = field(default_factory=dict)  # each value's layout over the actor mesh (multi-device actors)
    grouping: tuple[int, ...] | None = None  # marker segments per stage, when the schedule's balance= grouped them
    num_outputs: int = -1  # the step's own outputs come first in out_*; hidden ones (host callbacks' operands) follow
    host_calls: list[HostCall] = field(default_factory=list)  # see mpmd.compiler.effects
    remat: tuple[int, ...] = ()  # the stages whose backward recomputes their forward (the schedule's remat=)
    constrained_outputs: frozenset[int] = frozenset()  # the step's outputs a with_sharding_constraint made (laid out so)

    @property
    def merges_tasks(self) -> bool:
        """Whether some Run does more than one schedule task (the schedule's `fuse` merged them)."""
        return any(len(u.label.tasks) > 1 for units in self.units.values() for u in units)

    def stage_segments(self) -> str:
        """One line saying which marker segments each stage holds ('' without a grouping)."""
        if self.grouping is None:
            return ""
        from mpmd.schedules.balance import groups

        parts = [f"stage {s}: segment{'s' if len(g) > 1 else ''} {g[0]}" + (f"-{g[-1]}" if len(g) > 1 else "")
                 for s, g in enumerate(groups(self.grouping))]
        return f"stages from {sum(self.grouping)} marker segments, grouping {self.grouping}: " + ", ".join(parts)

    def __repr__(self) -> str:
        runs = sum(isinstance(i, Run) for p in self.programs for i in p.instructions)
        return (f"StepPlan({len(self.programs)} actors, {self.split.num_stages} stages, {sum(map(len, self.table))} tasks "
                f"in {runs} Runs)")

    def __str__(self) -> str:
        head = self.stage_segments()
        return (head + "\n\n" if head else "") + "\n\n".join(str(p) for p in self.programs)


def plan_step(outer: ClosedJaxpr, num_mesh_actors: int) -> StepPlan:
    """The step's plan: one Program per actor, for a mesh of `num_mesh_actors` actors."""
    loop = find_step_loop(outer)
    body = analyse_loop_body(loop)
    stages = schedule_stages(loop, body, num_mesh_actors)
    names = canonical_vars(loop, body)
    tasks = plan_loop_tasks(stages, body, names)
    printed = frozenset(k.var for k in tasks.hidden.keys if isinstance(k, Outer))  # step values a task's callback prints
    outside = place_outside_loop(loop, body, names, tasks, stages.num_actors, printed)
    hidden = tasks.hidden.then(outside.hidden)  # the loop's callbacks' values first, then those before and after it
    ordered = order_units(loop, names, tasks, outside, hidden)
    transfers = infer_step_transfers(ordered)
    fused = fuse_units(ordered, transfers, merge=getattr(stages.schedule, "fuse_runs", True))
    final = donate_buffers(fused, ordered, transfers, stages.num_actors)
    templates = collect_templates(final, ordered.avals)
    emitted = emit_programs(ordered, final, transfers, stages.num_actors)
    num_outputs = len(outer.jaxpr.outvars)
    out_avals = [v.aval for v in outer.jaxpr.outvars] + [ordered.avals[k] for k in hidden.keys]
    calls = [c if c.actor >= 0 else placed(c, emitted.out_homes[num_outputs:]) for c in hidden.resolved()]
    return StepPlan(emitted.programs, [ordered.arg_homes[k] for k in ordered.arg_keys], emitted.out_homes, out_avals,
                    stages.table, stages.split, final.units, transfers, ordered.avals, templates, ordered.arg_keys,
                    ordered.out_keys, grouping=stages.grouping, num_outputs=num_outputs,
                    host_calls=sorted(calls, key=lambda c: (c.order, c.actor)),
                    remat=tuple(sorted(getattr(stages.schedule, "remat", ()) or ())))


def iter_lowered(plan: StepPlan, platform: str) -> Iterator[tuple[Hashable, bytes]]:
    """Export every distinct executable of the plan once (wire-form avals: typed keys as key data), one at a
    time, so the caller can ship each while the next is exported."""
    from mpmd.compiler.avals import wire_aval
    from mpmd.compiler.lowering import serialize_flat

    for tpl, (fn, in_avals) in plan.templates.items():
        donate = tpl[-1] if isinstance(tpl, tuple) else ()
        yield tpl, serialize_flat(fn, [wire_aval(a) for a in in_avals], platform, donate)
