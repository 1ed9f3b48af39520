"""The planner's passes over the microbatch loop: find it in the traced step, analyse its body, cut the body
into the schedule's stage tasks, name the step's values canonically, and make one unit per scheduled task.
Pure functions over data (the traced jaxpr is never changed); each is callable alone.

    find_step_loop(outer)                     -> StepLoop
    analyse_loop_body(loop)                   -> LoopBody
    schedule_stages(loop, body, mesh actors)  -> ScheduledStages
    canonical_vars(loop, body)                -> CanonicalVars
    plan_loop_tasks(stages, body, names)      -> LoopTasks
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Var

from mpmd.compiler.body import CONST, VARYING, LoopBody, analyse, constants_needed
from mpmd.compiler.effects import HostCall, check_host_calls, used_vars
from mpmd.compiler.eqns import contains_primitive, eqns_fn, free_inputs, is_var, new_var, var_inputs
from mpmd.compiler.grouping import group_segments
from mpmd.compiler.host_calls import HiddenOutputs, loop_operand, strip_host_calls
from mpmd.compiler.inline import inline_calls, marker_outside_loop
from mpmd.compiler.keys import Acc, AccumulatorMode, MbIndex, Outer, PerMb, RegionKey, TaskTemplate, ValueKey
from mpmd.compiler.program import Label, Task
from mpmd.compiler.stages import (
    StageSplit,
    follow_inputs,
    forward_markers,
    recompute_cheap,
    remat_stages,
    split_backward,
    split_stages,
    unused_markers,
)
from mpmd.compiler.units import Part, Unit, task_function
from mpmd.errors import PipelineError, callers_level
from mpmd.primitives import accumulate_p
from mpmd.schedules import Schedule
from mpmd.schedules.validation import validate_placed


# ---- the loop in the step ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepLoop:
    """The traced step around its one `accumulate_grads` loop: `jaxpr.eqns[index]` is the loop equation."""

    jaxpr: Any  # the step's jaxpr (outer.jaxpr)
    consts: dict[Var, Any]  # the step's constvars -> values
    index: int
    schedule: Schedule | None
    num_microbatches: int
    num_mb_leaves: int
    num_grads: int

    @property
    def eqn(self) -> Any:
        return self.jaxpr.eqns[self.index]

    @property
    def before(self) -> list[Any]:
        return list(self.jaxpr.eqns[: self.index])

    @property
    def after(self) -> list[Any]:
        return list(self.jaxpr.eqns[self.index + 1 :])


def find_loop(jaxpr: Any) -> int:
    """The index of the step's one `accumulate_p` equation; a PipelineError when there is none or several."""
    loops = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is accumulate_p]
    if not loops:
        raise PipelineError("the distributed function never calls mpmd.accumulate_grads; wrap the per-microbatch "
                            "gradient computation in accumulate_grads(fn, batch, schedule=...)")
    if len(loops) > 1:
        raise PipelineError(f"the distributed function calls mpmd.accumulate_grads {len(loops)} times (each iteration of a "
                            "lax.scan or fori_loop around it counts); one loop per step is supported: make one distributed "
                            "call per optimizer step (calls are asynchronous: a Python loop of steps does not wait between them)")
    return loops[0]


def find_step_loop(outer: ClosedJaxpr) -> StepLoop:
    """Takes the traced step; gives its loop and the loop's parameters. Rejects a step without exactly one
    loop, and stage markers outside the loop (PipelineError)."""
    jaxpr = outer.jaxpr
    li = find_loop(jaxpr)
    stray = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "pipeline_yield"]
    if stray:
        raise marker_outside_loop("before" if stray[0] < li else "after")
    p = jaxpr.eqns[li].params
    if contains_primitive(p["body"].jaxpr, accumulate_p):
        raise PipelineError("accumulate_grads is called inside the function given to accumulate_grads; a step has one "
                            "microbatch loop: compute each microbatch's gradients in the outer function (for gradient "
                            "accumulation over more data, give the loop more microbatches)")
    jaxpr, li = _batch_constants_copied(jaxpr, li)
    return StepLoop(jaxpr, dict(zip(jaxpr.constvars, outer.consts)), li, p["schedule"], p["num_microbatches"],
                    p["num_mb_leaves"], p["num_grads"])


def _batch_constants_copied(jaxpr: Any, li: int) -> tuple[Any, int]:
    """A batch leaf the step closes over (a module-level array, not an argument) is a constant of the step, which
    nothing produced where the loop reads it ("internal: ... is produced nowhere": a probe). A copy of it before the
    loop is a value like any other there: computed on the actors that read it, the constant in its executable."""
    from jax._src import core
    from jax._src.lax.lax import copy_p

    loop = jaxpr.eqns[li]
    consts = set(jaxpr.constvars)
    invars, copies = list(loop.invars), []
    for i in range(loop.params["num_mb_leaves"]):
        v = invars[i]
        if not is_var(v) or v in consts:
            invars[i] = new_var(v.aval)
            copies.append(core.new_jaxpr_eqn([v], [invars[i]], copy_p, {}, set(), loop.source_info))
    if not copies:
        return jaxpr, li
    eqns = [*jaxpr.eqns[:li], *copies, loop.replace(invars=invars), *jaxpr.eqns[li + 1 :]]
    return jaxpr.replace(eqns=eqns), li + len(copies)


def analyse_loop_body(loop: StepLoop) -> LoopBody:
    """Takes the step's loop; gives its body with nested calls inlined and its equations classified
    (constant / invariant hoisted out / varying), gradient sums pushed through additions (`body.analyse`)."""
    eqn = loop.eqn
    inner = inline_calls(eqn.params["body"])
    check_host_calls(inner.jaxpr.eqns, used_vars([inner.jaxpr.eqns], inner.jaxpr.outvars))
    check_host_calls(loop.jaxpr.eqns, used_vars([loop.jaxpr.eqns], loop.jaxpr.outvars))
    return analyse(inner, loop.num_mb_leaves, loop.num_grads, loop.num_microbatches, list(eqn.invars[loop.num_mb_leaves :]))


# ---- stages on the schedule ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduledStages:
    """The body's varying equations cut into stage regions, and the schedule's validated task table with the
    placement it was proved with: the schedule's `tasks` and `actor_of` are asked once per trace, and every pass
    after reads these (a user's `actor_of` asked again may answer otherwise: a stage split over two actors)."""

    schedule: Schedule
    table: list[list[Task]]  # per actor: its tasks in order
    split: StageSplit
    grouping: tuple[int, ...] | None = None  # marker segments per stage when the schedule's balance= grouped them
    host_calls: dict[tuple[int, str], list[Any]] = field(default_factory=dict)  # per region: its callbacks, taken out
    placement: tuple[int, ...] = ()  # placement[stage]: its actor, as validate read it (validate_placed)

    @property
    def num_actors(self) -> int:
        return len(self.table)  # (validate gave one row per actor of the schedule's num_actors, read once)

    def actor_of(self, stage: int) -> int:
        return self.placement[stage]


def check_schedule(schedule: Schedule | None, num_stages: int, num_mesh_actors: int, unused: int = 0, markers: int = 0) -> None:
    """A PipelineError unless the schedule exists, has the step's number of stages and fits on the mesh.
    `unused`: markers whose result the step never reads (they mark no stage; said so); `markers`: every forward
    marker, those beside another (not computed from it) marking no stage of their own (said so too)."""
    if schedule is None:
        raise PipelineError("accumulate_grads inside mpmd.distributed needs a schedule, e.g. schedule=mpmd.OneFOneB(num_stages=2)")
    if num_stages != schedule.num_stages:
        raise PipelineError(f"the step marks {num_stages} stage{'s' * (num_stages != 1)} ({num_stages - 1} pipeline_yield "
                            f"marker{'s' * (num_stages != 2)}) but the schedule "
                            f"{schedule} has num_stages={schedule.num_stages}; make them agree (a scanned stack of S "
                            "iterations with a marker in its body gives S stages)"
                            + (f", or group the {num_stages} marker segments into {schedule.num_stages} stages with "
                               f"balance='auto' (or 'even'), e.g. {type(schedule).__name__}(..., balance='auto')"
                               if num_stages > schedule.num_stages else "")
                            + (f". {unused} more pipeline_yield marker{'s' * (unused != 1)} returned a value the step never "
                               "reads, and so marked no stage: write `x = mpmd.pipeline_yield(x)`, then use that x"
                               if unused else "")
                            + (f". {side} more pipeline_yield marker{'s' * (side != 1)} marked a value computed beside "
                               "another marked value, not from it (from the parameters alone, say), and so ended no stage of "
                               "its own: stages follow the data, and a marker ends one where the next stage computes from "
                               "its value" if (side := markers - unused - (num_stages - 1)) > 0 else "")
                            # (JAX differentiates a custom_vjp function through its fwd rule and never traces its
                            # body, so no trace of such a marker is left to name: a probe's was dropped unsaid)
                            + (". (If one of the markers is inside a jax.custom_vjp function: it is not seen under "
                               "grad, as JAX runs its fwd rule, not the function; call pipeline_yield outside it)"
                               if num_stages + unused + max(side, 0) < schedule.num_stages else ""))
    if schedule.num_actors > num_mesh_actors:
        raise PipelineError(
            f"the schedule {schedule} needs {schedule.num_actors} actors but the mesh has {num_mesh_actors}; start more actors, "
            f"use fewer stages, or put several stages on each actor: e.g. "
            + " or ".join(_fitting_schedules(schedule, num_stages, num_mesh_actors))
            + f", or Custom(..., stage_actor=(...)) mapping each stage to one of the {num_mesh_actors} actors")
    if schedule.num_actors < num_mesh_actors and isinstance(schedule, Schedule):  # (left idle unsaid before; a README
        # probe. Not for the measuring placements profile_costs runs, which are no Schedule of the user's)
        idle = list(range(schedule.num_actors, num_mesh_actors))
        warnings.warn(f"the schedule {schedule} runs on {schedule.num_actors} of the mesh's {num_mesh_actors} actors: actor"
                      f"{'s' if len(idle) > 1 else ''} {', '.join(map(str, idle))} get{'' if len(idle) > 1 else 's'} no work in "
                      f"this loop. To use {'them' if len(idle) > 1 else 'it'}, give the schedule {num_mesh_actors} actors (e.g. "
                      + " or ".join(f for f in _fitting_schedules(schedule, num_stages, num_mesh_actors)
                                    if f" each of {num_mesh_actors} actors" in f or "one per actor" in f)
                      + "), or make the mesh smaller (nothing to do for a step meant for some of the actors, an "
                      "evaluation of the first stages say)",
                      stacklevel=callers_level())


def _fitting_schedules(schedule: Schedule, num_stages: int, num_actors: int) -> list[str]:
    """Schedules, as their reprs with what they do, that run a step of `num_stages` stages on `num_actors` actors:
    the interleaved placement when a divisor of the stages from 2 to `num_actors` spreads them evenly (it needs
    num_stages a multiple of its actors), and one stage per actor with the marker segments grouped
    (balance='auto'), the schedule's own kind where it places one stage per actor. Each is built here, so each
    is a valid schedule."""
    from mpmd.schedules import builtin

    out = []
    actors = max((d for d in range(2, min(num_actors, num_stages - 1) + 1) if num_stages % d == 0), default=None)
    if actors is not None:
        fit = builtin.InterleavedOneFOneB(num_stages=num_stages, num_actors=actors)
        out.append(f"{fit!r} ({fit.per_actor} stages on each of {actors} actors)")
    kinds = (builtin.GPipe, builtin.OneFOneB, builtin.EagerOneFOneB, builtin.ZeroBubbleH1)
    kind = type(schedule) if type(schedule) in kinds else builtin.OneFOneB
    fit = kind(num_stages=num_actors, balance="auto")
    out.append(f"{fit!r} (the step's marker segments grouped into {num_actors} stage{'s' * (num_actors != 1)}, one per actor)")
    return out


def schedule_stages(loop: StepLoop, body: LoopBody, num_mesh_actors: int) -> ScheduledStages:
    """Takes the loop, its analysed body and the mesh's size; gives the stage regions (forward, backward; I
    and W where the schedule splits backwards; inputs followed to their consumer's actor, the forward of
    `remat` stages copied into their backward, cheap values recomputed) and the schedule's table, validated for `num_microbatches`."""
    split, grouping = group_segments(split_stages(body), loop.schedule, body, loop.num_microbatches)
    off = loop.schedule is not None and split.num_stages != loop.schedule.num_stages
    check_schedule(loop.schedule, split.num_stages, num_mesh_actors, unused_markers(body) if off else 0,
                   forward_markers(body) if off else 0)
    schedule = loop.schedule
    assert schedule is not None
    table, placement = validate_placed(schedule, loop.num_microbatches, forward_only=loop.num_grads == 0)  # (evaluation: F tasks are enough)
    actor_of = placement.__getitem__  # (asked once, above: the passes below ask it hundreds of times)
    follow_inputs(split, body, actor_of)
    split_backward(split, {t.stage for row in table for t in row if t.kind in ("I", "W")})
    host_calls = strip_host_calls(split)
    remat_stages(split, body, getattr(schedule, "remat", ()))
    recompute_cheap(split, body, actor_of)
    return ScheduledStages(schedule, table, split, grouping, host_calls, placement)


# ---- canonical names -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CanonicalVars:
    """One name per step value: a closed-over body input and a loop output stand for the step var they
    alias (`resolve`); a batch leaf's body input stands for its whole [m, ...] loop operand (`leaf_outer`)."""

    leaf_outer: dict[Var, Any]  # body input of a batch leaf -> the loop operand (outer var)
    alias: dict[Any, Any]  # var -> the var it stands for (follow until none)

    def resolve(self, v: Any) -> Any:
        while isinstance(v, Var) and v in self.alias:
            v = self.alias[v]
        return v

    def after_loop(self, v: Any) -> Any:
        """The step value `v` stands for in an equation after the loop, where a batch leaf's body input (read
        by the sum of a leaf returned as a gradient) is its whole loop operand."""
        return self.resolve(self.leaf_outer.get(v, v))


def canonical_vars(loop: StepLoop, body: LoopBody) -> CanonicalVars:
    """Takes the loop and its body; gives the aliases that name every value by one canonical var."""
    eqn = loop.eqn
    leaf_outer = {v: eqn.invars[i] for v, i in body.mb_leaves.items()}
    alias: dict[Any, Any] = dict(body.outer_of)
    for ov, out in zip(eqn.outvars, body.outputs):
        alias[ov] = eqn.invars[out[1]] if isinstance(out, tuple) else out
    return CanonicalVars(leaf_outer, alias)


# ---- one unit per scheduled task -----------------------------------------------------------------------
@dataclass(frozen=True)
class RegionPlan:
    """What every task of one region computes: its equations (constants included), the vars it reads, the
    vars other regions read from it (`exported`) and its accumulated or stacked vars (`accs`)."""

    eqns: list[Any]
    in_vars: list[Var]
    exported: list[Var]
    accs: list[Var]


@dataclass(frozen=True)
class LoopTasks:
    """One unit per scheduled task that computes something, per actor in its table order (`units`); the
    avals of every key they name; the last `Acc` of every accumulator under the `Outer` key of its step
    value (`finals`) and the actor that holds it (`acc_home`); the tasks' host callbacks, taken out
    (`hidden`)."""

    units: dict[int, list[Unit]]
    avals: dict[ValueKey, Any]
    finals: dict[Outer, Acc]
    acc_home: dict[Any, int]
    hidden: HiddenOutputs = HiddenOutputs()

    def step_values_read(self) -> dict[Var, set[int]]:
        """Step var -> the actors whose loop tasks read it."""
        need: dict[Var, set[int]] = defaultdict(set)
        for a, us in self.units.items():
            for u in us:
                for k in u.parts[0].inputs:
                    if isinstance(k, Outer):
                        need[k.var].add(a)
        return need


def region_plans(split: StageSplit, body: LoopBody, printed: frozenset[Any] = frozenset()) -> dict[RegionKey, RegionPlan | None]:
    """Takes the stage regions and the body; gives each region's plan (None for one that defines nothing).
    Vars in `printed` (read by a host callback) are exported too."""
    consumers: dict[Var, set[Any]] = defaultdict(set)  # var -> regions that read it without computing it themselves
    for r, eqns in split.regions.items():
        for v in free_inputs(eqns):
            consumers[v].add(r)
    accumulated = set(body.accumulators)
    stacked = {v for v, _ in body.stacked}
    plans: dict[RegionKey, RegionPlan | None] = {}
    for r, eqns in split.regions.items():
        reads = free_inputs(eqns)
        const_eqns = constants_needed(eqns, [v for v in reads if body.status.get(v) == CONST], body)
        body_eqns = [*const_eqns, *eqns]
        in_vars = [v for v in free_inputs(body_eqns) if v not in body.consts]
        own = {v for e in eqns for v in e.outvars if is_var(v)}
        exported = [v for e in eqns for v in e.outvars if is_var(v) and (consumers.get(v, set()) - {r} or v in printed)]
        accs = [v for e in eqns for v in e.outvars if is_var(v) and (v in accumulated or v in stacked)]
        plans[RegionKey(*r)] = RegionPlan(body_eqns, in_vars, exported, accs) if own else None
    return plans


def _program_order(task: Any) -> tuple[int, ...]:
    """Where `task` falls in the loop as jax.jit runs it: microbatch by microbatch, each one's forwards from the
    first stage to the last, then its backwards from the last to the first (a stage's weight gradients after
    its input gradients). Host calls run in this order, as `io_callback(..., ordered=True)` promises."""
    if task.kind == "F":
        return (task.mb, 0, task.stage, 0)
    return (task.mb, 1, -task.stage, 1 if task.kind == "W" else 0)


def plan_loop_tasks(stages: ScheduledStages, body: LoopBody, names: CanonicalVars) -> LoopTasks:
    """Takes the scheduled stages, the body and the canonical names; gives one unit per scheduled task, in
    each actor's table order, reading `Outer` step values, `PerMb` values of its microbatch and the previous
    `Acc` of each accumulator it adds to, and writing `PerMb` and `Acc` values. Each task's host callbacks
    become `HostCall`s in the result's `hidden`, reading hidden outputs (the values each microbatch gave them)."""
    printed = frozenset(v for calls in stages.host_calls.values() for e in calls for v in var_inputs(e))
    plans = region_plans(stages.split, body, printed)
    stacked = {v for v, _ in body.stacked}
    m = body.num_microbatches
    avals: dict[ValueKey, Any] = {}
    first_seen: set[Any] = set()
    last: dict[Any, int] = {}
    units: dict[int, list[Unit]] = defaultdict(list)
    calls: list[HostCall] = []
    for row in stages.table:
        for pos, task in enumerate(row):
            for j, e in enumerate(stages.host_calls.get((task.stage, task.kind), ())):
                operands = [loop_operand(v, task.mb, body, names.leaf_outer, names.resolve, avals) for v in e.invars]
                calls.append(HostCall(e, tuple(operands), stages.actor_of(task.stage), str(Label.of(task)), (1, *_program_order(task), j)))
            info = plans.get(RegionKey(task.stage, task.kind))
            if info is None:
                continue
            i = task.mb
            a = stages.actor_of(task.stage)
            keys: list[ValueKey] = []
            leaf_pos = []
            for pos, v in enumerate(info.in_vars):
                if v in names.leaf_outer:
                    keys.append(Outer(names.leaf_outer[v]))
                    leaf_pos.append(pos)
                    avals[keys[-1]] = names.leaf_outer[v].aval
                elif body.status.get(v, CONST) == VARYING:
                    keys.append(PerMb(v, i))
                    avals[keys[-1]] = v.aval
                else:
                    keys.append(Outer(names.resolve(v)))
                    avals[keys[-1]] = v.aval
            modes: list[AccumulatorMode] = []
            acc_in: list[ValueKey] = []
            acc_out: list[ValueKey] = []
            for v in info.accs:
                first = v not in first_seen
                first_seen.add(v)
                mode = AccumulatorMode("stack" if v in stacked else "sum", first)
                modes.append(mode)
                if not first:
                    acc_in.append(Acc(v, last[v]))
                acc_out.append(Acc(v, i))
                avals[Acc(v, i)] = v.aval.update(shape=(m, *v.aval.shape)) if mode.kind == "stack" else v.aval
                last[v] = i
            needs_index = bool(leaf_pos) or any(mode.kind == "stack" for mode in modes)
            inner = eqns_fn(info.eqns, info.in_vars, [*info.exported, *info.accs], body.consts)
            fn = task_function(inner, len(info.in_vars), leaf_pos, len(info.exported), modes, m, needs_index)
            inputs = [*keys, *acc_in, *([MbIndex(i)] if needs_index else [])]
            if needs_index:
                avals[MbIndex(i)] = jax.ShapeDtypeStruct((), "int32")
            outputs = [*(PerMb(v, i) for v in info.exported), *acc_out]
            for v in info.exported:
                avals[PerMb(v, i)] = v.aval
            part = Part(fn, inputs, outputs, TaskTemplate(task.stage, task.kind, tuple(modes)), Label.of(task))
            units[a].append(Unit(a, [part]))
    finals, acc_home = _accumulator_finals(units, body)
    return LoopTasks(units, avals, finals, acc_home, HiddenOutputs(tuple(calls)))


def _accumulator_finals(units: dict[int, list[Unit]], body: LoopBody) -> tuple[dict[Outer, Acc], dict[Any, int]]:
    """The last Acc of every accumulator (under the Outer key of its step-level var) and its actor."""
    finals: dict[Outer, Acc] = {}
    acc_home: dict[Any, int] = {}
    for a, us in units.items():
        for u in us:
            for k in u.parts[0].outputs:
                if isinstance(k, Acc):
                    finals[Outer(k.var)] = k
                    acc_home[k.var] = a
    # (One accumulator may stack into several step values: the microbatch function returns one value twice.)
    moved = {v: (finals.pop(Outer(v)), acc_home.pop(v)) for v in {v for v, _ in body.stacked if Outer(v) in finals}}
    for v, out in body.stacked:
        if v in moved:
            finals[Outer(out)], acc_home[out] = moved[v]
    return finals, acc_home
