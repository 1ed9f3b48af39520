"""Named keys of the step planner: what names a value, a task's region, an executable template, an
accumulator's mode and a step output's home. Pure data, no behaviour.

Values are named by the key types of `mpmd.compiler.units` (re-exported here so the passes import every
key from one place): `Outer(var)`, `PerMb(var, mb)`, `Acc(var, upto)` and `MbIndex(mb)`; `ValueKey` is
their union. The other keys used to be bare tuples:

* `RegionKey(stage, kind)`: the equations one task kind of one stage computes (``StageSplit.regions``'s
  key; a NamedTuple, so it equals the ``(stage, kind)`` tuples `mpmd.compiler.stages` builds);
* `AccumulatorMode(kind, first)`: how a task updates one accumulator ("sum" or "stack"; whether it is the
  accumulator's first microbatch);
* `TaskTemplate(stage, kind, accumulators)` and `ChunkTemplate(phase, seq, actor)`: what a part computes,
  independent of the microbatch: parts with equal templates share one executable;
* `OutputHome(kind, value)`: where a step output lives ("actors" and the actors that hold it, "arg" and the
  index of the argument it is, "const" and its value); a NamedTuple, so callers still unpack it as a pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from mpmd.compiler.units import Acc, MbIndex, Outer, PerMb

__all__ = ["Acc", "AccumulatorMode", "ChunkTemplate", "MbIndex", "Outer", "OutputHome", "PartTemplate", "PerMb", "RegionKey",
           "TaskTemplate", "ValueKey", "VALUE_KEY_TYPES"]

ValueKey = Outer | PerMb | Acc | MbIndex
VALUE_KEY_TYPES: tuple[type, ...] = (Outer, PerMb, Acc, MbIndex)


class RegionKey(NamedTuple):
    """One stage's equations of one task kind (F, B, I or W)."""

    stage: int
    kind: str

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}"


class AccumulatorMode(NamedTuple):
    """How a task updates one accumulator: "sum" adds its microbatch's value to the running sum, "stack"
    writes it at the microbatch's row of an [m, ...] buffer; `first`: no earlier value to read."""

    kind: str
    first: bool


@dataclass(frozen=True)
class TaskTemplate:
    """The executable of a scheduled task, for every microbatch: its stage, kind and accumulator modes."""

    stage: int
    kind: str
    accumulators: tuple[AccumulatorMode, ...]


@dataclass(frozen=True)
class ChunkTemplate:
    """The executable of one chunk of equations before ("pre") or after ("post") the loop on one actor."""

    phase: str
    seq: int
    actor: int


PartTemplate = TaskTemplate | ChunkTemplate


class OutputHome(NamedTuple):
    """Where one flat step output lives: ("actors", [actor, ...]), ("arg", argument index) or ("const", value)."""

    kind: str
    value: Any

    @classmethod
    def on_actors(cls, actors: list[int]) -> OutputHome:
        return cls("actors", actors)

    @classmethod
    def argument(cls, index: int) -> OutputHome:
        return cls("arg", index)

    @classmethod
    def constant(cls, value: Any) -> OutputHome:
        return cls("const", value)
