"""The compiler's side of host callbacks (see `mpmd.compiler.effects` for why they run at the controller):
the passes take callback equations out of every task and out of the code before and after the loop, and
collect, as `HiddenOutputs`, the values those callbacks read — extra step outputs, fetched after the step.

Each pass gives the `HiddenOutputs` it found as part of its result, its calls' operands naming values by key;
`plan_step` joins them in pass order and only then numbers the hidden outputs (`HiddenOutputs.resolved`)."""

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


@dataclasses.dataclass(frozen=True)
class HiddenOutputs:
    """Host calls a pass took out, in its order; an operand ("out", key, row) names the value it reads by its
    key, not yet by its index among the step's hidden outputs (see `resolved`)."""

    calls: tuple[HostCall, ...] = ()

    @property
    def keys(self) -> tuple[ValueKey, ...]:
        """The values the calls read, each once, in the order the calls first read them: the hidden outputs."""
        return tuple(dict.fromkeys(o[1] for c in self.calls for o in c.operands if o[0] == "out"))

    def then(self, later: HiddenOutputs) -> HiddenOutputs:
        """These calls, then `later`'s (a value both read keeps its first place)."""
        return HiddenOutputs(self.calls + later.calls)

    def resolved(self) -> list[HostCall]:
        """The calls with each ("out", key, row) operand as ("out", index of key in `keys`, row), as the
        runtime reads them (`HostCall`)."""
        index = {k: i for i, k in enumerate(self.keys)}
        return [dataclasses.replace(c, operands=tuple(("out", index[o[1]], o[2]) if o[0] == "out" else o for o in c.operands))
                for c in self.calls]


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
                 avals: dict[ValueKey, Any]) -> tuple[Any, ...]:
    """Where a host callback in a task finds its operand `v` of microbatch `mb`: ("const", value) or ("out",
    key of the hidden output, row of a batch leaf or None). Records the key's aval in `avals`."""
    if not is_var(v):
        return ("const", v.val)
    if v in body.consts:
        return ("const", body.consts[v])
    if v in leaf_outer:  # the microbatch itself: its row of the batch leaf
        k: ValueKey = Outer(leaf_outer[v])
        avals.setdefault(k, leaf_outer[v].aval)
        return ("out", k, mb)
    status = body.status.get(v, CONST)
    if status == CONST:  # computed from constants only: evaluate it here
        return ("const", eqns_fn(constants_needed([], [v], body), [], [v], body.consts)()[0])
    k = PerMb(v, mb) if status != INVARIANT else Outer(resolve(v))
    avals.setdefault(k, v.aval)
    return ("out", k, None)


def step_call_operands(eqn: Any, consts: dict[Any, Any], finals: dict[Any, ValueKey],
                       avals: dict[ValueKey, Any]) -> tuple[Any, ...]:
    """The operands of a callback before or after the loop: constants, or ("out", key, None) naming the hidden
    output of a step value. Records the keys' avals in `avals` (the first one seen)."""
    operands: list[Any] = []
    for v in eqn.invars:
        if not is_var(v):
            operands.append(("const", v.val))
        elif v in consts:
            operands.append(("const", consts[v]))
        else:
            k = finals.get(Outer(v), Outer(v))
            avals.setdefault(k, v.aval)
            operands.append(("out", k, None))
    return tuple(operands)


def placed(call: HostCall, homes: list[Any]) -> HostCall:
    """A call before or after the loop runs, for its prefix, where its first operand computed on an actor is
    (`call` resolved: its operands index `homes`, the hidden outputs' homes)."""
    actor = next((homes[o[1]][1][0] for o in call.operands if o[0] == "out" and homes[o[1]][0] == "actors"), 0)
    return dataclasses.replace(call, actor=actor)
