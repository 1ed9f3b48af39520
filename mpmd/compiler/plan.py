"""Turn a traced step (one jaxpr with one `accumulate_p` loop) and a schedule into one Program per actor.

Pure: jaxpr in, `StepPlan` out (executables still as Python functions; `lower` exports them).

Values are named by keys: an outer jaxpr var; ``(body var, mb)`` for a value of microbatch `mb`;
``("mb", leaf, mb)`` for a microbatch slice of a batch leaf; ``("acc", j, mb)`` for gradient j summed up to
microbatch `mb`. A unit is one executable call on one actor; transfers are inferred wherever a unit reads
a key produced on another actor, including between non-adjacent stages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal, Var

from mpmd.compiler.placement import chunk_interface, make_chunks, place_post, place_pre, var_inputs
from mpmd.compiler.stages import StageTask, eqns_fn, inline_calls, split_stages
from mpmd.errors import PipelineError
from mpmd.primitives import accumulate_p
from mpmd.program import Delete, Label, Program, Recv, Run, Send
from mpmd.schedules import Schedule, Task, validate
from transport.protocol import dtype_name


@dataclass
class Unit:
    actor: int
    fn: Callable[..., tuple]
    template: Hashable
    inputs: list[Hashable]
    outputs: list[Hashable]
    label: Label


@dataclass
class StepPlan:
    programs: list[Program]
    units: list[Unit]
    arg_homes: list[set[int]]  # per flat argument: actors that read it
    out_homes: list[tuple[str, Any]]  # per flat output: ("actors", [..]) | ("arg", index) | ("const", value)
    out_avals: list[Any]
    table: list[list[Task]]
    tasks: list[StageTask]
    templates: dict[Hashable, tuple[Callable[..., tuple], list[Any]]] = field(default_factory=dict)

    def __str__(self) -> str:
        return "\n\n".join(str(p) for p in self.programs)


def _aval(key: Hashable, avals: dict[Hashable, Any]) -> Any:
    return avals[key]


def find_loop(jaxpr: Any) -> int:
    loops = [i for i, e in enumerate(jaxpr.eqns) if e.primitive is accumulate_p]
    if not loops:
        raise PipelineError("the distributed function never calls mpmd.accumulate_grads; wrap the per-microbatch "
                            "gradient computation in accumulate_grads(fn, batch, schedule=...)")
    if len(loops) > 1:
        raise PipelineError(f"the distributed function calls mpmd.accumulate_grads {len(loops)} times; one loop per step is supported")
    return loops[0]


def plan_step(outer: ClosedJaxpr, num_mesh_actors: int) -> StepPlan:
    jaxpr = outer.jaxpr
    consts: dict[Any, Any] = dict(zip(jaxpr.constvars, outer.consts))
    constvars = set(jaxpr.constvars)
    li = find_loop(jaxpr)
    stray = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "pipeline_yield"]
    if stray:
        where = "before" if stray[0] < li else "after"
        raise PipelineError(f"pipeline_yield is used {where} accumulate_grads; stage markers belong inside the "
                            "microbatch function passed to accumulate_grads")
    loop = jaxpr.eqns[li]
    p = loop.params
    schedule: Schedule = p["schedule"]
    if schedule is None:
        raise PipelineError("accumulate_grads inside mpmd.distributed needs a schedule, e.g. schedule=mpmd.OneFOneB(num_stages=2)")
    m, n_mb, n_grads = p["num_microbatches"], p["num_mb_leaves"], p["num_grads"]
    body = inline_calls(p["body"])
    n_out = len(body.jaxpr.outvars)
    tasks = split_stages(body, n_out - n_grads)
    n_stages = len(tasks) // 2
    if n_stages != schedule.num_stages:
        raise PipelineError(f"the step marks {n_stages} stages ({n_stages - 1} pipeline_yield markers) but the schedule "
                            f"{schedule} has num_stages={schedule.num_stages}; make them agree")
    if schedule.num_actors > num_mesh_actors:
        raise PipelineError(f"the schedule needs {schedule.num_actors} actors but the mesh has {num_mesh_actors}; "
                            f"start more actors or use fewer stages")
    table = validate(schedule, m)
    stage_actor = [schedule.actor_of(s) for s in range(n_stages)]
    actors = set(range(schedule.num_actors))

    # ---- the loop's interface with the outer jaxpr ----
    body_in = body.jaxpr.invars
    mb_leaf = {v: l for l, v in enumerate(body_in[:n_mb])}
    body_consts: dict[Any, Any] = dict(zip(body.jaxpr.constvars, body.consts))
    const_outer: dict[Var, Var] = {}
    for bv, ov in zip(body_in[n_mb:], loop.invars[n_mb:]):
        if isinstance(ov, Literal):
            body_consts[bv] = ov.val
        else:
            const_outer[bv] = ov
    task_of: dict[Var, StageTask] = {v: t for t in tasks for e in t.eqns for v in e.outvars}
    for j, v in enumerate(body.jaxpr.outvars):
        if not isinstance(v, Var) or v not in task_of:
            what = "gradient" if j < n_grads else "aux output"
            raise PipelineError(f"{what} {j} of the microbatch function is a constant or an unchanged input; "
                                "return values computed from the microbatch")

    def body_key(v: Var, i: int) -> Hashable:
        if v in mb_leaf:
            return ("mb", mb_leaf[v], i)
        if v in const_outer:
            return const_outer[v]
        return (v, i)

    need: dict[Var, set[int]] = defaultdict(set)
    for t in tasks:
        for v in t.inputs:
            if v in mb_leaf:
                need[loop.invars[mb_leaf[v]]].add(stage_actor[t.stage])
            elif v in const_outer:
                need[const_outer[v]].add(stage_actor[t.stage])
    loc: dict[Var, set[int]] = {ov: {stage_actor[task_of[bv].stage]} for ov, bv in zip(loop.outvars, body.jaxpr.outvars)}
    outvars = {v for v in jaxpr.outvars if isinstance(v, Var)}
    post_placed = place_post(jaxpr.eqns[li + 1 :], loc, need, outvars, actors)
    pre_placed = place_pre(jaxpr.eqns[:li], need, outvars, actors)
    pre_chunks = make_chunks(pre_placed, "pre", 0)
    post_chunks = make_chunks(post_placed, "post", len(pre_chunks))

    # ---- units ----
    avals: dict[Hashable, Any] = {}
    units: list[Unit] = []
    reads: dict[Var, int] = defaultdict(int)
    for c in pre_chunks + post_chunks:
        for e in c.eqns:
            for v in set(var_inputs(e)):
                reads[v] += 1
    for v in [*loop.invars, *jaxpr.outvars]:
        if isinstance(v, Var):
            reads[v] += 1

    def chunk_units(chunks: list[Any], kind: str) -> list[Unit]:
        out = []
        for c in chunks:
            own_reads: dict[Var, int] = defaultdict(int)
            for e in c.eqns:
                for v in set(var_inputs(e)):
                    own_reads[v] += 1
            defined = {v for e in c.eqns for v in e.outvars}
            elsewhere = {v for v in defined if reads[v] > own_reads[v]}
            ins, outs = chunk_interface(c, elsewhere, constvars)
            for v in [*ins, *outs]:
                avals[v] = v.aval
            out.append(Unit(c.actor, eqns_fn(c.eqns, ins, outs, consts), (kind, c.seq), list(ins), list(outs), Label(kind)))
        return out

    pre_units = chunk_units(pre_chunks, "pre")
    post_units = chunk_units(post_chunks, "post")

    loop_units: dict[int, list[Unit]] = defaultdict(list)
    # Microbatch slices, on each actor that reads a batch leaf.
    for l in range(n_mb):
        leaf = loop.invars[l]
        mb_aval = body_in[l].aval
        for a in sorted(need.get(leaf, ())):
            keys = [("mb", l, i) for i in range(m)]
            for k in keys:
                avals[k] = mb_aval
            avals[leaf] = leaf.aval
            loop_units[a].append(Unit(a, _unstack(m), ("slice", l), [leaf], keys, Label("slice")))
    # Stage tasks, in schedule order; gradients accumulate in execution order.
    grads_of: dict[int, list[int]] = defaultdict(list)
    for j, v in enumerate(body.jaxpr.outvars[:n_grads]):
        grads_of[id(task_of[v])].append(j)
    by_name = {(t.stage, t.kind): t for t in tasks}
    last_acc: dict[int, int] = {}
    for a, row in enumerate(table):
        for task in row:
            t = by_name[(task.stage, task.kind)]
            i = task.mb
            ins = [body_key(v, i) for v in t.inputs if v not in body_consts]
            in_vars = [v for v in t.inputs if v not in body_consts]
            js = grads_of.get(id(t), [])
            first = [j for j in js if j not in last_acc]
            acc_in = [("acc", j, last_acc[j]) for j in js if j in last_acc]
            outs = [(v, i) for v in t.outputs] + [("acc", j, i) for j in js]
            for v, k in zip(in_vars, ins):
                avals[k] = v.aval
            for v in t.outputs:
                avals[(v, i)] = v.aval
            for j in js:
                avals[("acc", j, i)] = body.jaxpr.outvars[j].aval
            gvars = [body.jaxpr.outvars[j] for j in js]
            fn = _task_fn(t, in_vars, body_consts, gvars, [j in first for j in js])
            loop_units[a].append(Unit(a, fn, ("task", t.stage, t.kind, tuple(j in first for j in js)), ins + acc_in, outs,
                                      Label.of(task)))
            for j in js:
                last_acc[j] = i
    alias: dict[Hashable, Hashable] = {}
    for j in range(n_grads):
        alias[loop.outvars[j]] = ("acc", j, last_acc[j])
    for j in range(n_grads, n_out):
        v = body.jaxpr.outvars[j]
        a = stage_actor[task_of[v].stage]
        keys = [(v, i) for i in range(m)]
        avals[loop.outvars[j]] = loop.outvars[j].aval
        loop_units[a].append(Unit(a, _stack, ("stack", j), keys, [loop.outvars[j]], Label("stack")))

    def resolve(k: Hashable) -> Hashable:
        return alias.get(k, k)

    per_actor: dict[int, list[Unit]] = defaultdict(list)
    for u in pre_units:
        per_actor[u.actor].append(u)
    for a in sorted(loop_units):
        per_actor[a].extend(loop_units[a])
    for u in post_units:
        per_actor[u.actor].append(u)
    for us in per_actor.values():
        for u in us:
            u.inputs = [resolve(k) for k in u.inputs]
            u.outputs = [resolve(k) for k in u.outputs]
            units.append(u)

    arg_homes = [set(need.get(v, set())) if isinstance(v, Var) else set() for v in jaxpr.invars]
    for v, h in zip(jaxpr.invars, arg_homes):
        avals[v] = v.aval
    programs, out_homes = _build_programs(per_actor, jaxpr, arg_homes, resolve, avals, len(table))
    templates: dict[Hashable, tuple[Callable[..., tuple], list[Any]]] = {}
    for u in units:
        templates.setdefault(u.template, (u.fn, [avals[k] for k in u.inputs]))
    return StepPlan(programs, units, arg_homes, out_homes, [v.aval for v in jaxpr.outvars], table, tasks, templates)


def _unstack(m: int) -> Callable[..., tuple]:
    def fn(x: Any) -> tuple:
        return tuple(x[i] for i in range(m))

    return fn


def _stack(*xs: Any) -> tuple:
    return (jnp.stack(xs),)


def _task_fn(t: StageTask, in_vars: list[Var], body_consts: dict[Any, Any], gvars: list[Var], first: list[bool]) -> Callable[..., tuple]:
    base = eqns_fn(t.eqns, in_vars, t.outputs, body_consts)
    g_index = [t.outputs.index(g) for g in gvars]
    n_in = len(in_vars)

    def fn(*args: Any) -> tuple:
        outs = base(*args[:n_in])
        accs = iter(args[n_in:])
        summed = [outs[gi] if f else next(accs) + outs[gi] for gi, f in zip(g_index, first)]
        return (*outs, *summed)

    return fn


def _build_programs(per_actor: dict[int, list[Unit]], jaxpr: Any, arg_homes: list[set[int]], resolve: Callable[[Hashable], Hashable],
                    avals: dict[Hashable, Any], num_actors: int) -> tuple[list[Program], list[tuple[str, Any]]]:
    produced: dict[Hashable, list[int]] = defaultdict(list)
    for k, (v, homes) in enumerate(zip(jaxpr.invars, arg_homes)):
        for a in sorted(homes):
            produced[v].append(a)
    for a, us in sorted(per_actor.items()):
        for u in us:
            for k in u.outputs:
                if a not in produced[k]:
                    produced[k].append(a)
    # Which transfers are needed: (key, src, dst).
    transfers: dict[tuple[Hashable, int], int] = {}  # (key, dst) -> src
    for a, us in per_actor.items():
        for u in us:
            for k in u.inputs:
                if a in produced[k] or (k, a) in transfers:
                    continue
                if not produced[k]:
                    raise PipelineError(f"internal: value {k} read by {u.label} on actor {a} is produced nowhere")
                transfers[(k, a)] = produced[k][0]
    out_homes: list[tuple[str, Any]] = []
    arg_index = {v: i for i, v in enumerate(jaxpr.invars)}
    outputs_on: dict[int, list[Hashable]] = defaultdict(list)
    for v in jaxpr.outvars:
        if isinstance(v, Literal):
            out_homes.append(("const", v.val))
            continue
        k = resolve(v)
        if k in arg_index:
            out_homes.append(("arg", arg_index[k]))
            continue
        homes = produced[k]
        out_homes.append(("actors", list(homes)))
        for a in homes:
            outputs_on[a].append(k)
    tags: dict[tuple[Hashable, int], int] = {key: t for t, key in enumerate(sorted(transfers, key=str))}
    sends_from: dict[tuple[int, Hashable], list[int]] = defaultdict(list)
    for (k, dst), src in transfers.items():
        sends_from[(src, k)].append(dst)
    programs = []
    for a in range(num_actors):
        local: dict[Hashable, int] = {}

        def buf(k: Hashable) -> int:
            if k not in local:
                local[k] = len(local)
            return local[k]

        inputs = [buf(v) for v, homes in zip(jaxpr.invars, arg_homes) if a in homes]
        instrs: list[Any] = []
        for (k, dst), src in sorted(transfers.items(), key=lambda kv: tags[kv[0]]):
            if dst == a:
                av = avals[k]
                instrs.append(Recv(buf(k), src, tags[(k, dst)], dtype_name(av.dtype), tuple(av.shape), Label("xfer")))
        for v, homes in zip(jaxpr.invars, arg_homes):
            if a in homes:
                for dst in sends_from.get((a, v), []):
                    instrs.append(Send(buf(v), dst, tags[(v, dst)], Label("xfer")))
        exes: dict[Hashable, int] = {}
        for u in per_actor.get(a, []):
            exe = exes.setdefault(u.template, len(exes))
            instrs.append(Run(exe, tuple(buf(k) for k in u.inputs), tuple(buf(k) for k in u.outputs), u.label))
            for k in u.outputs:
                for dst in sends_from.get((a, k), []):
                    instrs.append(Send(buf(k), dst, tags[(k, dst)], u.label))
        outputs = [buf(k) for k in outputs_on.get(a, [])]
        prog = Program(a, inputs, outputs, _with_deletes(instrs, set(outputs)), executables=list(exes))
        programs.append(prog)
    return programs, out_homes


def _with_deletes(instrs: list[Any], keep: set[int]) -> list[Any]:
    """Insert a Delete after the last read of every buffer that is not a program output."""
    last: dict[int, int] = {}
    for i, ins in enumerate(instrs):
        if isinstance(ins, Run):
            for b in (*ins.inputs, *ins.outputs):
                last[b] = i
        elif isinstance(ins, (Send, Recv)):
            last[ins.buf] = max(last.get(ins.buf, -1), i)
    after: dict[int, list[int]] = defaultdict(list)
    for b, i in last.items():
        if b not in keep:
            after[i].append(b)
    out: list[Any] = []
    for i, ins in enumerate(instrs):
        out.append(ins)
        if after.get(i):
            out.append(Delete(tuple(sorted(after[i])), ins.label))
    return out


def lower_templates(plan: StepPlan, platform: str) -> dict[Hashable, bytes]:
    """Export every distinct executable of the plan once."""
    from mpmd.lowering import serialize_flat

    out = {}
    for tpl, (fn, in_avals) in plan.templates.items():
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
        out[tpl] = serialize_flat(fn, specs, platform)
    return out
