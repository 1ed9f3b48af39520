"""What a compiled step puts where and moves each step: `step.placement(*args)`.

    report = train_step.placement(params, opt_state, batch)
    print(report)                       # per argument path: its actors; per kind: transfers and bytes per step
    report.arguments["args[0]['embed']"]  # -> [0, 2]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpmd.compiler.programs import wire_bytes
from mpmd.compiler.units import Acc, Outer, PerMb

KINDS = ("activations", "activation gradients", "parameters", "gradient reductions", "other")


@dataclass(frozen=True)
class Transfer:
    kind: str
    src: int
    dst: int
    nbytes: int
    what: str  # the value, e.g. "per microbatch 3 of 0F" or "after the loop"


@dataclass
class PlacementReport:
    """Where each argument and output lives, and every actor-to-actor transfer of one step, by kind."""

    arguments: dict[str, list[int]]
    outputs: dict[str, list[int]]
    transfers: list[Transfer] = field(default_factory=list)
    stages: str = ""  # which marker segments each stage holds, when the schedule's balance= grouped them

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (number of transfers per step, bytes per step)."""
        out: dict[str, list[int]] = {k: [0, 0] for k in KINDS}
        for t in self.transfers:
            out[t.kind][0] += 1
            out[t.kind][1] += t.nbytes
        return {k: (c, b) for k, (c, b) in out.items()}

    def __str__(self) -> str:
        lines = [self.stages] if self.stages else []
        lines.append("arguments:")
        lines += [f"  {p}: actors {a}" for p, a in self.arguments.items()]
        lines.append("outputs:")
        lines += [f"  {p}: actors {a}" for p, a in self.outputs.items()]
        lines.append("transfers per step:")
        for k, (c, b) in self.by_kind().items():
            lines.append(f"  {k:22s} {c:5d} transfers {b / 2**20:10.3f} MiB")
        return "\n".join(lines)


def placement_report(plan: Any, arg_paths: list[str], out_paths: list[str]) -> PlacementReport:
    args = {k.var for k in plan.arg_keys}
    arguments = {p: sorted(h) for p, h in zip(arg_paths, plan.arg_homes)}
    outputs = {}
    for p, (kind, val) in zip(out_paths, plan.out_homes):
        outputs[p] = sorted(val) if kind == "actors" else ([] if kind == "const" else arguments[arg_paths[val]])
    split = plan.split
    post = _post_values(plan)
    transfers = []
    for (key, dst), src in plan.transfers.source.items():
        nbytes = wire_bytes(plan.avals[key]) if key in plan.avals else 0
        if isinstance(key, PerMb):
            region = split.region_of.get(key.var)
            kind = "activations" if region is None or region[1] == "F" else "activation gradients"
            what = f"microbatch {key.mb}" + (f" of {region[0]}{region[1]}" if region else "")
        elif isinstance(key, Acc):
            kind, what = "gradient reductions", "a gradient sum"
        elif isinstance(key, Outer) and key.var in args:
            kind, what = "parameters", "a step argument"
        elif isinstance(key, Outer) and key in post:
            kind, what = "gradient reductions", "after the loop"
        elif isinstance(key, Outer):
            kind, what = "parameters", "before the loop"
        else:
            kind, what = "other", str(key)
        transfers.append(Transfer(kind, src, dst, nbytes, what))
    stages = plan.stage_segments() if hasattr(plan, "stage_segments") else ""
    return PlacementReport(arguments, outputs, transfers, stages)


def _post_values(plan: Any) -> set[Any]:
    """The keys computed after the loop (outputs of post-loop parts)."""
    return {k for us in plan.units.values() for u in us for p in u.parts if p.label.kind == "post" for k in p.outputs}
