"""The planner's pass over the step's equations outside the microbatch loop: place the equations before it
(and the invariants hoisted out of it) and after it (the gradients' tail, the optimizer update) on actors,
and make a unit of each chunk of them. Pure: data in, data out; the rules are `mpmd.compiler.placement`'s.

    place_outside_loop(loop, body, names, tasks, num_actors, printed) -> OutsideLoop
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from jax.extend.core import Var

from mpmd.compiler.body import CONST, LoopBody, constants_needed
from mpmd.compiler.effects import HostCall, is_host_call
from mpmd.compiler.eqns import eqns_fn, free_inputs, is_var, substitute
from mpmd.compiler.host_calls import HiddenOutputs, step_call_operands
from mpmd.compiler.keys import ChunkTemplate, Outer, ValueKey
from mpmd.compiler.loop_tasks import CanonicalVars, LoopTasks, StepLoop
from mpmd.compiler.placement import Chunk, make_chunks, place_post, place_pre, split_conds
from mpmd.compiler.program import Label
from mpmd.compiler.units import Part, Unit


@dataclass(frozen=True)
class OutsideLoop:
    """The units before the loop (`pre`) and after it (`post`), one per chunk, in chunk order; which actors
    need each step value (`need`: the step arguments' homes come from it); the avals of the keys the units
    name; the host callbacks before and after the loop, taken out (`hidden`: they run at the controller) and
    the avals of the step values they read (`hidden_avals`)."""

    pre: list[Unit]
    post: list[Unit]
    need: dict[Var, set[int]]
    avals: dict[ValueKey, Any]
    hidden: HiddenOutputs = HiddenOutputs()
    hidden_avals: dict[ValueKey, Any] = field(default_factory=dict)


def place_outside_loop(loop: StepLoop, body: LoopBody, names: CanonicalVars, tasks: LoopTasks, num_actors: int,
                       printed: frozenset[Any] = frozenset()) -> OutsideLoop:
    """Takes the loop, its body, the canonical names and the loop's tasks; gives the placed equations before
    and after the loop as units (after the loop placement follows the owner: the accumulators' actors and the
    actors whose tasks read a parameter), and where every step value is needed. Host callbacks are taken out
    (`hidden`, reading an accumulated value as its last `Acc`); what they read, like the step values in
    `printed` (read by the loop's callbacks), is kept as a step output."""
    jaxpr = loop.jaxpr
    step_outputs = {r for r in map(names.resolve, jaxpr.outvars) if isinstance(r, Var)} | set(printed)
    all_actors = set(range(num_actors))
    loop_need = tasks.step_values_read()
    pre = substitute([*loop.before, *body.hoisted], names.resolve)
    post = split_conds(substitute([*body.tail, *loop.after], names.after_loop))
    host_calls = [(phase, i, e) for phase, eqns in (("pre", pre), ("post", post)) for i, e in enumerate(eqns) if is_host_call(e)]
    pre, post = [e for e in pre if not is_host_call(e)], [e for e in post if not is_host_call(e)]
    step_outputs |= {v for _, _, e in host_calls for v in e.invars if is_var(v)}  # computed, kept and fetched
    args = set(jaxpr.invars)
    arg_hints = {v: w for v, w in loop_need.items() if v in args}
    # A first placement of the equations before the loop says where the arguments the loop reads live,
    # which is where the equations after the loop that read them run.
    provisional = defaultdict(set, {k: set(v) for k, v in loop_need.items()})
    place_pre(pre, provisional, step_outputs, all_actors, arg_hints)
    loc: dict[Var, set[int]] = {v: set(w) for v, w in provisional.items() if v in args and w}
    loc.update({v: {a} for v, a in tasks.acc_home.items()})
    need: dict[Var, set[int]] = defaultdict(set, {k: set(v) for k, v in loop_need.items()})
    post_placed = place_post(post, loc, need, step_outputs, all_actors)
    pre_placed = place_pre(pre, need, step_outputs, all_actors, arg_hints)
    consts = {**loop.consts, **body.consts}
    pre_chunks = make_chunks(pre_placed, "pre", 0)
    post_chunks = make_chunks(post_placed, "post", len(pre_chunks))
    avals: dict[ValueKey, Any] = {}
    pre_units = [Unit(c.actor, [chunk_part(c, body, consts, avals)]) for c in pre_chunks]
    post_units = [Unit(c.actor, [chunk_part(c, body, consts, avals)]) for c in post_chunks]
    hidden_avals: dict[ValueKey, Any] = {}
    finals: dict[Any, ValueKey] = dict(tasks.finals)
    calls = tuple(HostCall(e, step_call_operands(e, loop.consts, finals, hidden_avals), -1, phase, (0 if phase == "pre" else 2, i))
                  for phase, i, e in host_calls)
    return OutsideLoop(pre_units, post_units, need, avals, HiddenOutputs(calls), hidden_avals)


def chunk_part(c: Chunk, body: LoopBody, consts: dict[Any, Any], avals: dict[ValueKey, Any]) -> Part:
    """A part for one chunk of placed equations; its outputs are all it defines (the unit's interface is
    trimmed later to what others read). Records the avals of its keys in `avals`."""
    reads = free_inputs(c.eqns)
    const_eqns = constants_needed(c.eqns, [v for v in reads if body.status.get(v) == CONST], body)
    eqns = [*const_eqns, *c.eqns]
    ins = [v for v in free_inputs(eqns) if v not in consts]
    outs = [v for e in c.eqns for v in e.outvars if is_var(v)]
    for v in [*ins, *outs]:
        avals[Outer(v)] = v.aval
    fn = eqns_fn(eqns, ins, outs, consts)
    return Part(fn, [Outer(v) for v in ins], [Outer(v) for v in outs], ChunkTemplate(c.phase, c.seq, c.actor), Label(c.phase))
