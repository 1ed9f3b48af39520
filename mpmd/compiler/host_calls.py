"""The compiler's side of host callbacks (see `mpmd.compiler.effects` for why they run at the controller):
the passes take callback equations out of every task and out of the code before and after the loop, and
collect, as `HiddenOutputs`, the values those callbacks read — extra step outputs, fetched after the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mpmd.compiler.body import CONST, INVARIANT, LoopBody, constants_needed
from mpmd.compiler.effects import HostCall, is_host_call
from mpmd.compiler.eqns import eqns_fn, is_var
from mpmd.compiler.keys import ValueKey
from mpmd.compiler.stages import StageSplit
from mpmd.compiler.units import Outer, PerMb


class HiddenOutputs:
    """Extra step outputs: the values host callbacks read, each once (`keys`), and the calls reading them."""

    def __init__(self) -> None:
        self.keys: list[ValueKey] = []
        self.calls: list[HostCall] = []

    def index(self, k: ValueKey) -> int:
        if k not in self.keys:
            self.keys.append(k)
        return self.keys.index(k)


def strip_host_calls(split: StageSplit) -> dict[tuple[int, str], list[Any]]:
    """Take the host callback equations out of every task's region (they run at the controller); gives them
    per region, in order."""
    out: dict[tuple[int, str], list[Any]] = {}
    for r, eqns in split.regions.items():
        calls = [e for e in eqns if is_host_call(e)]
        if calls:
            out[r] = calls
            split.regions[r] = [e for e in eqns if not is_host_call(e)]
    split.reindex()
    return out


def loop_operand(v: Any, mb: int, body: LoopBody, leaf_outer: dict[Any, Any], resolve: Callable[[Any], Any],
                 avals: dict[ValueKey, Any], hidden: HiddenOutputs) -> tuple[Any, ...]:
    """Where a host callback in a task finds its operand `v` of microbatch `mb`: ("const", value) or ("out",
    hidden output index, row of a batch leaf or None)."""
    if not is_var(v):
        return ("const", v.val)
    if v in body.consts:
        return ("const", body.consts[v])
    if v in leaf_outer:  # the microbatch itself: its row of the batch leaf
        k: ValueKey = Outer(leaf_outer[v])
        avals.setdefault(k, leaf_outer[v].aval)
        return ("out", hidden.index(k), mb)
    status = body.status.get(v, CONST)
    if status == CONST:  # computed from constants only: evaluate it here
        return ("const", eqns_fn(constants_needed([], [v], body), [], [v], body.consts)()[0])
    k = PerMb(v, mb) if status != INVARIANT else Outer(resolve(v))
    avals.setdefault(k, v.aval)
    return ("out", hidden.index(k), None)


def step_call_operands(eqn: Any, consts: dict[Any, Any], finals: dict[Any, ValueKey], avals: dict[ValueKey, Any],
                       hidden: HiddenOutputs) -> tuple[Any, ...]:
    """The operands of a callback before or after the loop: constants, or hidden outputs of step values."""
    operands: list[Any] = []
    for v in eqn.invars:
        if not is_var(v):
            operands.append(("const", v.val))
        elif v in consts:
            operands.append(("const", consts[v]))
        else:
            k = finals.get(Outer(v), Outer(v))
            avals.setdefault(k, v.aval)
            operands.append(("out", hidden.index(k), None))
    return tuple(operands)


def placed(call: HostCall, homes: list[Any]) -> HostCall:
    """A call before or after the loop runs, for its prefix, where its first operand computed on an actor is."""
    actor = next((homes[o[1]][1][0] for o in call.operands if o[0] == "out" and homes[o[1]][0] == "actors"), 0)
    return dataclasses.replace(call, actor=actor)
