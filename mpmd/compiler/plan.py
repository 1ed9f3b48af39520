"""Turn a traced step (one jaxpr with one `accumulate_p` loop) and a schedule into one Program per actor.

Pure: jaxpr in, `StepPlan` out (executables still as Python functions; `iter_lowered` exports them).
The passes, in order (each a pure function in its own module):

1. `inline.inline_calls`: inline nested calls, unroll scans over stages, reject markers the compiler
   cannot cut;
2. `body.analyse`: constant / invariant / varying equations, invariants hoisted out of the loop, gradient
   sums pushed through additions;
3. `stages.split_stages` (+ `follow_inputs`, `split_backward`): which task computes each equation;
4. tasks of the schedule's table -> units on actors; `placement`: the equations before and after the loop;
5. `units.fuse`, `programs.choose_donations`, `programs.build_programs`: executables and Programs with
   every transfer inferred, also between non-adjacent stages and for values several stages share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Literal, Var

from mpmd.compiler.body import CONST, INVARIANT, LoopBody, analyse, constants_needed
from mpmd.compiler.effects import HostCall, check_host_calls, is_host_call, used_vars
from mpmd.compiler.eqns import SyntheticEqn, eqns_fn, free_inputs, is_var, var_inputs
from mpmd.compiler.inline import inline_calls
from mpmd.compiler.placement import make_chunks, place_post, place_pre, split_conds
from mpmd.compiler.program import Label, Program, Task
from mpmd.compiler.programs import Transfers, build_programs, choose_donations, infer_transfers
from mpmd.compiler.stages import StageSplit, follow_inputs, recompute_cheap, split_backward, split_stages
from mpmd.compiler.units import Acc, Key, MbIndex, Outer, Part, PerMb, Unit, fuse, task_function
from mpmd.errors import PipelineError
from mpmd.primitives import accumulate_p
from mpmd.schedules import Schedule, validate
from mpmd.schedules.validation import check_programs


@dataclass
class StepPlan:
    programs: list[Program]
    arg_homes: list[set[int]]  # per flat argument: actors that read it
    out_homes: list[tuple[str, Any]]  # per flat output: ("actors", [..]) | ("arg", index) | ("const", value)
    out_avals: list[Any]
    table: list[list[Task]]
    split: StageSplit
    units: dict[int, list[Unit]]
    transfers: Transfers
    avals: dict[Key, Any]
    templates: dict[Hashable, tuple[Callable[..., tuple], list[Any]]] = field(default_factory=dict)
    arg_keys: list[Key] = field(default_factory=list)
    out_keys: list[Any] = field(default_factory=list)  # per flat output: its key (or a Literal)
    layouts: dict[Key, Any] = field(default_factory=dict)  # each value's layout over the actor mesh (multi-device actors)
    num_outputs: int = -1  # the step's own outputs come first in out_*; hidden ones (host callbacks' operands) follow
    host_calls: list[HostCall] = field(default_factory=list)  # see mpmd.compiler.effects

    def __str__(self) -> str:
        return "\n\n".join(str(p) for p in self.programs)


def find_loop(jaxpr: Any) -> int:
    loops = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is accumulate_p]
    if not loops:
        raise PipelineError("the distributed function never calls mpmd.accumulate_grads; wrap the per-microbatch "
                            "gradient computation in accumulate_grads(fn, batch, schedule=...)")
    if len(loops) > 1:
        raise PipelineError(f"the distributed function calls mpmd.accumulate_grads {len(loops)} times; one loop per step is supported")
    return loops[0]


def _substitute(eqns: list[Any], resolve: Callable[[Any], Any]) -> list[Any]:
    """The equations with every input var replaced by its canonical var."""
    out = []
    for e in eqns:
        new_in = [resolve(v) if isinstance(v, Var) else v for v in e.invars]
        if new_in == list(e.invars):
            out.append(e)
        elif isinstance(e, SyntheticEqn):
            out.append(SyntheticEqn(e.fn, new_in, e.outvars, e.name))
        else:
            out.append(e.replace(invars=new_in))
    return out


def _check_schedule(schedule: Schedule | None, num_stages: int, num_mesh_actors: int) -> None:
    if schedule is None:
        raise PipelineError("accumulate_grads inside mpmd.distributed needs a schedule, e.g. schedule=mpmd.OneFOneB(num_stages=2)")
    if num_stages != schedule.num_stages:
        raise PipelineError(f"the step marks {num_stages} stages ({num_stages - 1} pipeline_yield markers) but the schedule "
                            f"{schedule} has num_stages={schedule.num_stages}; make them agree (a scanned stack of S "
                            "iterations with a marker in its body gives S stages)")
    if schedule.num_actors > num_mesh_actors:
        raise PipelineError(
            f"the schedule {schedule} needs {schedule.num_actors} actors but the mesh has {num_mesh_actors}; start more actors, "
            f"use fewer stages, or put several stages on each actor: e.g. InterleavedOneFOneB(num_stages={schedule.num_stages}, "
            f"num_actors={num_mesh_actors}) or Custom(..., stage_actor=(...)) mapping each stage to one of the "
            f"{num_mesh_actors} actors")


def plan_step(outer: ClosedJaxpr, num_mesh_actors: int) -> StepPlan:
    jaxpr = outer.jaxpr
    outer_consts: dict[Any, Any] = dict(zip(jaxpr.constvars, outer.consts))
    li = find_loop(jaxpr)
    stray = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "pipeline_yield"]
    if stray:
        where = "before" if stray[0] < li else "after"
        raise PipelineError(f"pipeline_yield is used {where} accumulate_grads; stage markers belong inside the "
                            "microbatch function passed to accumulate_grads")
    loop = jaxpr.eqns[li]
    p = loop.params
    schedule: Schedule | None = p["schedule"]
    m, n_mb, n_grads = p["num_microbatches"], p["num_mb_leaves"], p["num_grads"]
    body = inline_calls(p["body"])
    check_host_calls(body.jaxpr.eqns, used_vars([body.jaxpr.eqns], body.jaxpr.outvars))
    check_host_calls(jaxpr.eqns, used_vars([jaxpr.eqns], jaxpr.outvars))
    lb = analyse(body, n_mb, n_grads, m, list(loop.invars[n_mb:]))
    split = split_stages(lb)
    _check_schedule(schedule, split.num_stages, num_mesh_actors)
    assert schedule is not None
    table = validate(schedule, m)
    num_actors = schedule.num_actors
    actor_of = schedule.actor_of
    follow_inputs(split, lb, actor_of)
    split_backward(split, {t.stage for row in table for t in row if t.kind in ("I", "W")})
    loop_calls = _strip_host_calls(split)
    recompute_cheap(split, lb, actor_of)

    # ---- canonical vars -----------------------------------------------------------------------------
    leaf_outer = {v: loop.invars[i] for v, i in lb.mb_leaves.items()}
    alias: dict[Any, Any] = dict(lb.outer_of)
    for ov, out in zip(loop.outvars, lb.outputs):
        alias[ov] = loop.invars[out[1]] if isinstance(out, tuple) else out

    def resolve(v: Any) -> Any:
        while isinstance(v, Var) and v in alias:
            v = alias[v]
        return v

    avals: dict[Key, Any] = {}
    hidden = _HiddenOutputs()
    loop_units = _loop_units(split, lb, table, actor_of, leaf_outer, resolve, avals, loop_calls, hidden)
    finals: dict[Key, Key] = {}  # Outer(step-level var of an accumulator) -> its last Acc key
    acc_home: dict[Any, int] = {}
    for a, us in loop_units.items():
        for u in us:
            for k in u.parts[0].outputs:
                if isinstance(k, Acc):
                    finals[Outer(k.var)] = k
                    acc_home[k.var] = a
    for v, out in lb.stacked:
        if Outer(v) in finals:
            finals[Outer(out)] = finals.pop(Outer(v))
            acc_home[out] = acc_home.pop(v)

    # ---- before and after the loop ----------------------------------------------------------------------
    step_outputs = {resolve(v) for v in jaxpr.outvars if isinstance(v, Var)}
    step_outputs |= {k.var for k in hidden.keys if isinstance(k, Outer)}  # step values a task's callback prints
    all_actors = set(range(num_actors))
    loop_need: dict[Var, set[int]] = defaultdict(set)
    for a, us in loop_units.items():
        for u in us:
            for k in u.parts[0].inputs:
                if isinstance(k, Outer):
                    loop_need[k.var].add(a)
    pre = _substitute([*jaxpr.eqns[:li], *lb.hoisted], resolve)
    post = split_conds(_substitute([*lb.tail, *jaxpr.eqns[li + 1 :]], resolve))
    step_calls = [(phase, i, e) for phase, eqns in (("pre", pre), ("post", post)) for i, e in enumerate(eqns) if is_host_call(e)]
    pre, post = [e for e in pre if not is_host_call(e)], [e for e in post if not is_host_call(e)]
    step_outputs |= {v for _, _, e in step_calls for v in e.invars if is_var(v)}  # computed, kept and fetched
    args = set(jaxpr.invars)
    provisional = defaultdict(set, {k: set(v) for k, v in loop_need.items()})
    place_pre(pre, provisional, step_outputs, all_actors, {v: w for v, w in loop_need.items() if v in args})
    loc: dict[Var, set[int]] = {v: set(w) for v, w in provisional.items() if v in args and w}
    loc.update({v: {a} for v, a in acc_home.items()})
    need: dict[Var, set[int]] = defaultdict(set, {k: set(v) for k, v in loop_need.items()})
    post_placed = place_post(post, loc, need, step_outputs, all_actors)
    pre_placed = place_pre(pre, need, step_outputs, all_actors, {v: w for v, w in loop_need.items() if v in args})
    consts = {**outer_consts, **lb.consts}
    pre_chunks = make_chunks(pre_placed, "pre", 0)
    post_chunks = make_chunks(post_placed, "post", len(pre_chunks))
    chunk_parts = _chunk_parts([*pre_chunks, *post_chunks], lb, consts, avals)

    # ---- units per actor, in order --------------------------------------------------------------------
    per_actor: dict[int, list[Unit]] = defaultdict(list)
    for c, part in chunk_parts:
        if c.phase == "pre":
            per_actor[c.actor].append(Unit(c.actor, [part]))
    for a in sorted(loop_units):
        per_actor[a].extend(loop_units[a])
    for c, part in chunk_parts:
        if c.phase == "post":
            per_actor[c.actor].append(Unit(c.actor, [part]))
    for us in per_actor.values():
        for u in us:
            for part in u.parts:
                part.inputs = [finals.get(k, k) for k in part.inputs]

    arg_keys = [Outer(v) for v in jaxpr.invars]
    for v in jaxpr.invars:
        avals[Outer(v)] = v.aval
    arg_homes = {Outer(v): set(need.get(v, set())) for v in jaxpr.invars}
    out_keys: list[Any] = []
    for v in jaxpr.outvars:
        out_keys.append(v if isinstance(v, Literal) else finals.get(Outer(resolve(v)), Outer(resolve(v))))
    for phase, i, e in step_calls:
        operands = []
        for v in e.invars:
            if not is_var(v):
                operands.append(("const", v.val))
            elif v in outer_consts:
                operands.append(("const", outer_consts[v]))
            else:
                k = finals.get(Outer(v), Outer(v))
                avals.setdefault(k, v.aval)
                operands.append(("out", hidden.index(k), None))
        hidden.calls.append(HostCall(e, tuple(operands), -1, phase, (0 if phase == "pre" else 2, i)))
    out_keys.extend(hidden.keys)
    const_keys = {k for us in per_actor.values() for u in us for part in u.parts for k in part.inputs if isinstance(k, MbIndex)}
    transfers = infer_transfers(per_actor, arg_homes, const_keys)
    step_out_set = {k for k in out_keys if not isinstance(k, Literal)}

    # ---- fusion, interfaces, donation -----------------------------------------------------------------
    reads: dict[Key, int] = defaultdict(int)
    for us in per_actor.values():
        for u in us:
            u.seal(lambda k: True)
    for a, us in per_actor.items():
        per_actor[a] = fuse(us, lambda k, a=a: transfers.received(k, a), lambda k, a=a: bool(transfers.sent_from(k, a)))
    for us in per_actor.values():
        for u in us:
            for part in u.parts:
                for k in part.inputs:
                    reads[k] += 1
    for us in per_actor.values():
        for u in us:
            internal: dict[Key, int] = defaultdict(int)
            for part in u.parts:
                for k in part.inputs:
                    internal[k] += 1
            u.seal(lambda k, internal=internal: k in step_out_set or reads[k] > internal[k])
    protected: dict[int, set[Key]] = defaultdict(set)
    for a in range(num_actors):
        protected[a] |= set(arg_keys) | step_out_set | const_keys
        for (k, dst), src in transfers.source.items():
            protected[src].add(k)
            protected[dst].add(k)
    choose_donations(per_actor, avals, protected)

    templates: dict[Hashable, tuple[Callable[..., tuple], list[Any]]] = {}
    for us in per_actor.values():
        for u in us:
            tpl = u.template()
            if tpl not in templates:
                in_avals = [avals[k] for k in u.inputs]
                templates[tpl] = (u.function(in_avals), in_avals)
    output_keys: dict[int, list[Key]] = defaultdict(list)
    out_homes: list[tuple[str, Any]] = []
    arg_index = {Outer(v): i for i, v in enumerate(jaxpr.invars)}
    for k in out_keys:
        if isinstance(k, Literal):
            out_homes.append(("const", k.val))
        elif k in arg_index:
            out_homes.append(("arg", arg_index[k]))
        else:
            homes = transfers.producers.get(k, [])
            if not homes:
                raise PipelineError(f"internal: step output {k} is computed nowhere")
            out_homes.append(("actors", list(homes)))
            for a in homes:
                output_keys[a].append(k)
    programs = build_programs(per_actor, num_actors, arg_keys, arg_homes, output_keys, avals, transfers, {})
    check_programs(programs)  # the Programs' own dependency graph: every Recv matched, no actor waits forever
    out_avals = [v.aval for v in jaxpr.outvars] + [avals[k] for k in hidden.keys]
    calls = [c if c.actor >= 0 else _placed(c, out_homes[len(jaxpr.outvars):]) for c in hidden.calls]
    return StepPlan(programs, [arg_homes[k] for k in arg_keys], out_homes, out_avals, table, split, dict(per_actor), transfers,
                    avals, templates, arg_keys, out_keys, num_outputs=len(jaxpr.outvars),
                    host_calls=sorted(calls, key=lambda c: (c.order[0], c.actor, c.order[1:])))


class _HiddenOutputs:
    """Extra step outputs: the values host callbacks read (fetched after the step, see mpmd.compiler.effects)."""

    def __init__(self) -> None:
        self.keys: list[Key] = []
        self.calls: list[HostCall] = []

    def index(self, k: Key) -> int:
        if k not in self.keys:
            self.keys.append(k)
        return self.keys.index(k)


def _strip_host_calls(split: StageSplit) -> dict[tuple[int, str], list[Any]]:
    """Take the host callback equations out of every task (they run at the controller); per region, in order."""
    out: dict[tuple[int, str], list[Any]] = {}
    for r, eqns in split.regions.items():
        calls = [e for e in eqns if is_host_call(e)]
        if calls:
            out[r] = calls
            split.regions[r] = [e for e in eqns if not is_host_call(e)]
    split.reindex()
    return out


def _placed(call: HostCall, homes: list[tuple[str, Any]]) -> HostCall:
    """A call before or after the loop runs, for its prefix, where its first operand computed on an actor is."""
    import dataclasses

    actor = next((homes[o[1]][1][0] for o in call.operands if o[0] == "out" and homes[o[1]][0] == "actors"), 0)
    return dataclasses.replace(call, actor=actor)


def _loop_units(split: StageSplit, lb: LoopBody, table: list[list[Task]], actor_of: Callable[[int], int], leaf_outer: dict[Var, Any],
                resolve: Callable[[Any], Any], avals: dict[Key, Any], loop_calls: dict[tuple[int, str], list[Any]],
                hidden: _HiddenOutputs) -> dict[int, list[Unit]]:
    """One unit per scheduled task that computes something, in each actor's table order; the host callbacks
    of each task become HostCalls reading hidden outputs (the values each microbatch gave them)."""
    consumers: dict[Var, set] = defaultdict(set)  # var -> regions that read it without computing it themselves
    for r, eqns in split.regions.items():
        for v in free_inputs(eqns):
            consumers[v].add(r)
    accumulated = set(lb.accumulators)
    stacked = {v for v, _ in lb.stacked}
    m = lb.num_microbatches
    plans: dict[tuple[int, str], Any] = {}
    printed = {v for calls in loop_calls.values() for e in calls for v in var_inputs(e)}

    def plan_region(r: tuple[int, str]) -> Any:
        if r in plans:
            return plans[r]
        eqns = split.regions.get(r, [])
        reads = free_inputs(eqns)
        const_eqns = constants_needed(eqns, [v for v in reads if lb.status.get(v) == CONST], lb)
        body_eqns = [*const_eqns, *eqns]
        in_vars = [v for v in free_inputs(body_eqns) if v not in lb.consts]
        own = {v for e in eqns for v in e.outvars if is_var(v)}
        exported = [v for e in eqns for v in e.outvars if is_var(v) and (consumers.get(v, set()) - {r} or v in printed)]
        accs = [v for e in eqns for v in e.outvars if is_var(v) and (v in accumulated or v in stacked)]
        plans[r] = (body_eqns, in_vars, exported, accs) if own else None
        return plans[r]

    first_seen: set[Any] = set()
    last: dict[Any, int] = {}
    units: dict[int, list[Unit]] = defaultdict(list)
    for a_row, row in enumerate(table):
        for pos, task in enumerate(row):
            kind = task.kind
            r = (task.stage, kind)
            for j, e in enumerate(loop_calls.get(r, ())):
                operands = [_loop_operand(v, task.mb, lb, leaf_outer, resolve, avals, hidden) for v in e.invars]
                hidden.calls.append(HostCall(e, tuple(operands), actor_of(task.stage), str(Label.of(task)), (1, pos, j)))
            info = plan_region(r)
            if info is None:
                continue
            body_eqns, in_vars, exported, accs = info
            i = task.mb
            a = actor_of(task.stage)
            keys: list[Key] = []
            leaf_pos = []
            for pos, v in enumerate(in_vars):
                if v in leaf_outer:
                    keys.append(Outer(leaf_outer[v]))
                    leaf_pos.append(pos)
                    avals[keys[-1]] = leaf_outer[v].aval
                elif lb.status.get(v, CONST) == 2:
                    keys.append(PerMb(v, i))
                    avals[keys[-1]] = v.aval
                else:
                    keys.append(Outer(resolve(v)))
                    avals[keys[-1]] = v.aval
            flags = []
            acc_in: list[Key] = []
            acc_out: list[Key] = []
            for v in accs:
                first = v not in first_seen
                first_seen.add(v)
                kind_acc = "stack" if v in stacked else "sum"
                flags.append((kind_acc, first))
                if not first:
                    acc_in.append(Acc(v, last[v]))
                acc_out.append(Acc(v, i))
                avals[Acc(v, i)] = v.aval.update(shape=(m, *v.aval.shape)) if kind_acc == "stack" else v.aval
                last[v] = i
            needs_index = bool(leaf_pos) or any(k == "stack" for k, _ in flags)
            inner = eqns_fn(body_eqns, in_vars, [*exported, *accs], lb.consts)
            fn = task_function(inner, len(in_vars), leaf_pos, len(exported), flags, m, needs_index)
            inputs = [*keys, *acc_in, *([MbIndex(i)] if needs_index else [])]
            if needs_index:
                avals[MbIndex(i)] = jax.ShapeDtypeStruct((), "int32")
            outputs = [*(PerMb(v, i) for v in exported), *acc_out]
            for v in exported:
                avals[PerMb(v, i)] = v.aval
            template = ("task", task.stage, kind, tuple(flags))
            part = Part(fn, inputs, outputs, template, Label.of(task))
            units[a].append(Unit(a, [part]))
    return units


def _loop_operand(v: Any, mb: int, lb: LoopBody, leaf_outer: dict[Var, Any], resolve: Callable[[Any], Any],
                  avals: dict[Key, Any], hidden: _HiddenOutputs) -> tuple[Any, ...]:
    """Where a host callback in a task finds operand `v` of microbatch `mb`."""
    if not is_var(v):
        return ("const", v.val)
    if v in lb.consts:
        return ("const", lb.consts[v])
    if v in leaf_outer:  # the microbatch itself: its row of the batch leaf
        k: Key = Outer(leaf_outer[v])
        avals.setdefault(k, leaf_outer[v].aval)
        return ("out", hidden.index(k), mb)
    status = lb.status.get(v, CONST)
    if status == CONST:  # computed from constants only: evaluate it here
        return ("const", eqns_fn(constants_needed([], [v], lb), [], [v], lb.consts)()[0])
    k = PerMb(v, mb) if status != INVARIANT else Outer(resolve(v))
    avals.setdefault(k, v.aval)
    return ("out", hidden.index(k), None)


def _chunk_parts(chunks: list[Any], lb: LoopBody, consts: dict[Any, Any], avals: dict[Key, Any]) -> list[tuple[Any, Part]]:
    """A part per chunk of placed equations before or after the loop; its outputs are all it defines (the
    unit's interface is trimmed to what others read later)."""
    out = []
    for c in chunks:
        reads = free_inputs(c.eqns)
        const_eqns = constants_needed(c.eqns, [v for v in reads if lb.status.get(v) == CONST], lb)
        eqns = [*const_eqns, *c.eqns]
        ins = [v for v in free_inputs(eqns) if v not in consts]
        outs = [v for e in c.eqns for v in e.outvars if is_var(v)]
        for v in [*ins, *outs]:
            avals[Outer(v)] = v.aval
        fn = eqns_fn(eqns, ins, outs, consts)
        out.append((c, Part(fn, [Outer(v) for v in ins], [Outer(v) for v in outs], (c.phase, c.seq, c.actor), Label(c.phase))))
    return out


def iter_lowered(plan: StepPlan, platform: str) -> Iterator[tuple[Hashable, bytes]]:
    """Export every distinct executable of the plan once (wire-form avals: typed keys as key data), one at a
    time, so the caller can ship each while the next is exported."""
    from mpmd.compiler.avals import wire_aval
    from mpmd.compiler.lowering import serialize_flat

    for tpl, (fn, in_avals) in plan.templates.items():
        donate = tpl[-1] if isinstance(tpl, tuple) else ()
        yield tpl, serialize_flat(fn, [wire_aval(a) for a in in_avals], platform, donate)
