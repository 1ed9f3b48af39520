"""The planner's last passes: put every actor's units in order, infer the transfers between actors, fuse
adjacent units, choose donations, collect the distinct executables and emit one Program per actor. Pure:
each pass gives new units and leaves the units it was given as they were.

    order_units(loop, names, tasks, outside, hidden)      -> OrderedUnits
    infer_step_transfers(ordered)                         -> Transfers
    fuse_units(ordered, transfers, merge)                 -> ActorUnits
    donate_buffers(units, ordered, transfers, num_actors) -> ActorUnits
    collect_templates(units, avals)                       -> Templates
    emit_programs(ordered, units, transfers, num_actors)  -> EmittedPrograms
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from jax.extend.core import Literal

from mpmd.compiler.host_calls import HiddenOutputs
from mpmd.compiler.keys import MbIndex, Outer, OutputHome, ValueKey
from mpmd.compiler.loop_tasks import CanonicalVars, LoopTasks, StepLoop
from mpmd.compiler.outside_loop import OutsideLoop
from mpmd.compiler.program import Program
from mpmd.compiler.programs import Transfers, build_programs, choose_donations, infer_transfers
from mpmd.compiler.units import Unit, fuse
from mpmd.errors import PipelineError
from mpmd.schedules.validation import check_programs


@dataclass(frozen=True)
class OrderedUnits:
    """Every actor's units in program order (the chunks before the loop, its tasks, the chunks after), each
    a single part reading an accumulator's step value as its last `Acc`; the step's interface: its
    arguments' keys and homes, its outputs' keys (a `Literal` for a constant output); the `MbIndex`
    constants the units read; the avals of every key."""

    units: dict[int, list[Unit]]
    arg_keys: list[Outer]
    arg_homes: dict[ValueKey, set[int]]
    out_keys: list[Any]  # per flat output: its key, or the Literal it is
    const_keys: set[ValueKey]
    avals: dict[ValueKey, Any]

    @property
    def step_output_keys(self) -> set[ValueKey]:
        return {k for k in self.out_keys if not isinstance(k, Literal)}


@dataclass(frozen=True)
class ActorUnits:
    """Every actor's units in program order, sealed (each with its inputs and outputs)."""

    units: dict[int, list[Unit]]


Templates = dict[Hashable, tuple[Callable[..., tuple], list[Any]]]


@dataclass(frozen=True)
class EmittedPrograms:
    """One checked Program per actor, and where each flat step output lives."""

    programs: list[Program]
    out_homes: list[OutputHome]


def order_units(loop: StepLoop, names: CanonicalVars, tasks: LoopTasks, outside: OutsideLoop,
                hidden: HiddenOutputs = HiddenOutputs()) -> OrderedUnits:
    """Takes the loop, the canonical names, the loop's tasks, the units outside the loop and the step's host
    callbacks (`hidden`: the passes' own, joined); gives every actor's units in order, with reads of an
    accumulated step value rewired to its last `Acc`, and the step's argument and output keys: its own
    outputs, then the hidden ones its host callbacks read."""
    finals: dict[Any, ValueKey] = dict(tasks.finals)
    per_actor: dict[int, list[Unit]] = defaultdict(list)
    for u in outside.pre:
        per_actor[u.actor].append(u)
    for a in sorted(tasks.units):
        per_actor[a].extend(tasks.units[a])
    for u in outside.post:
        per_actor[u.actor].append(u)
    units = {a: [Unit(u.actor, [dataclasses.replace(p, inputs=[finals.get(k, k) for k in p.inputs]) for p in u.parts])
                 for u in us] for a, us in per_actor.items()}

    invars = loop.jaxpr.invars
    avals: dict[ValueKey, Any] = {**tasks.avals, **outside.avals}
    arg_keys = [Outer(v) for v in invars]
    for v in invars:
        avals[Outer(v)] = v.aval
    arg_homes: dict[ValueKey, set[int]] = {Outer(v): set(outside.need.get(v, set())) for v in invars}
    out_keys: list[Any] = []
    for v in loop.jaxpr.outvars:
        if isinstance(v, Literal) or isinstance(names.resolve(v), Literal):  # (a float0 gradient resolves to its zeros)
            out_keys.append(names.resolve(v))
        elif names.resolve(v) in loop.consts:  # a constant the step closes over and returns as it is
            out_keys.append(Literal(loop.consts[names.resolve(v)], v.aval))
        else:
            out_keys.append(finals.get(Outer(names.resolve(v)), Outer(names.resolve(v))))
    for k, aval in outside.hidden_avals.items():
        avals.setdefault(k, aval)
    out_keys.extend(hidden.keys)
    const_keys = {k for us in units.values() for u in us for part in u.parts for k in part.inputs if isinstance(k, MbIndex)}
    return OrderedUnits(units, arg_keys, arg_homes, out_keys, const_keys, avals)


def infer_step_transfers(ordered: OrderedUnits) -> Transfers:
    """Takes the ordered units; gives the transfers: which actor sends each value each other actor reads
    (the first actor that produces it, or holds it as an argument)."""
    return infer_transfers(ordered.units, ordered.arg_homes, ordered.const_keys)


def _copy(units: dict[int, list[Unit]]) -> dict[int, list[Unit]]:
    """New units with the same parts (which sealing, fusing and donating never change), so a pass leaves the
    units it was given as they were."""
    return {a: [dataclasses.replace(u, parts=list(u.parts)) for u in us] for a, us in units.items()}


def fuse_units(ordered: OrderedUnits, transfers: Transfers, merge: bool = True) -> ActorUnits:
    """Takes the ordered units and the transfers; gives every actor's units with each merged into the one
    before it where that delays nothing (`units.fuse`; not with `merge` False: a Run per unit, as a schedule
    that times each task apart asks), sealed so that a unit's outputs are what a later unit, another actor or
    the step's caller reads."""
    per_actor = _copy(ordered.units)
    for us in per_actor.values():
        for u in us:
            u.seal(lambda k: True)
    for a, us in per_actor.items():
        if merge:
            per_actor[a] = fuse(us, lambda k, a=a: transfers.received(k, a), lambda k, a=a: bool(transfers.sent_from(k, a)))
    reads: dict[ValueKey, int] = defaultdict(int)
    for us in per_actor.values():
        for u in us:
            for part in u.parts:
                for k in part.inputs:
                    reads[k] += 1
    step_outputs = ordered.step_output_keys
    for us in per_actor.values():
        for u in us:
            internal: dict[ValueKey, int] = defaultdict(int)
            for part in u.parts:
                for k in part.inputs:
                    internal[k] += 1
            u.seal(lambda k, internal=internal: k in step_outputs or reads[k] > internal[k])
    return ActorUnits(per_actor)


def donate_buffers(units: ActorUnits, ordered: OrderedUnits, transfers: Transfers, num_actors: int) -> ActorUnits:
    """Takes the fused units; gives them with `donate` set: each Run reuses the buffer of an input it reads
    last, never a step argument or output, an `MbIndex` constant, or a value sent or received
    (`programs.choose_donations`)."""
    per_actor = {a: [dataclasses.replace(u) for u in us] for a, us in units.units.items()}
    never = set(ordered.arg_keys) | ordered.step_output_keys | ordered.const_keys
    protected: dict[int, set[ValueKey]] = defaultdict(set)
    for a in range(num_actors):
        protected[a] |= never
    for (k, dst), src in transfers.source.items():
        protected[src].add(k)
        protected[dst].add(k)
    choose_donations(per_actor, ordered.avals, protected)
    return ActorUnits(per_actor)


def collect_templates(units: ActorUnits, avals: dict[ValueKey, Any]) -> Templates:
    """Takes the final units and the avals; gives each distinct executable (unit template) once, with its
    flat function and its input avals."""
    templates: Templates = {}
    for us in units.units.values():
        for u in us:
            tpl = u.template()
            if tpl not in templates:
                in_avals = [avals[k] for k in u.inputs]
                templates[tpl] = (u.function(in_avals), in_avals)
    return templates


def emit_programs(ordered: OrderedUnits, units: ActorUnits, transfers: Transfers, num_actors: int) -> EmittedPrograms:
    """Takes the step's interface, the final units and the transfers; gives one Program per actor (its Runs,
    Sends, Recvs and Deletes), checked for unmatched transfers and deadlock, and each output's home."""
    output_keys: dict[int, list[ValueKey]] = defaultdict(list)
    out_homes: list[OutputHome] = []
    arg_index = {k: i for i, k in enumerate(ordered.arg_keys)}
    for k in ordered.out_keys:
        if isinstance(k, Literal):
            out_homes.append(OutputHome.constant(k.val))
        elif k in arg_index:
            out_homes.append(OutputHome.argument(arg_index[k]))
        else:
            homes = transfers.producers.get(k, [])
            if not homes:
                raise PipelineError(f"internal: step output {k} is computed nowhere")
            out_homes.append(OutputHome.on_actors(list(homes)))
            for a in homes:
                output_keys[a].append(k)
    programs = build_programs(units.units, num_actors, ordered.arg_keys, ordered.arg_homes, output_keys, ordered.avals,
                              transfers, {})
    check_programs(programs)  # the Programs' own dependency graph: every Recv matched, no actor waits forever
    return EmittedPrograms(programs, out_homes)
