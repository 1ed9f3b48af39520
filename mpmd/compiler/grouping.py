"""Group marker segments into stages: the pass between `stages.split_stages` and the rest. Pure functions.

`split_stages` cuts the loop body at every `pipeline_yield`, giving one F and one B region per *segment*.
When the schedule asks for fewer stages with `balance=` (see `mpmd.schedules.balance`), `group_segments`
merges consecutive segments' regions into stages: a stage's F is its segments' forwards in order, its B their
backwards in program order (the later segment's first). Markers inside a stage stay as identity equations;
nothing is ever cut inside a segment. For balance="auto" each segment's cost comes from XLA's cost analysis
of its forward, backward and (for split-backward schedules) I and W equations, lowered alone:

    time = flops / FLOPS_PER_SECOND + bytes accessed / BYTES_PER_SECOND

a rough single-core CPU model: only ratios between segments matter for the grouping.
"""

from __future__ import annotations

from typing import Any

import jax

from mpmd.compiler.body import LoopBody
from mpmd.compiler.eqns import eqns_fn, free_inputs, is_var, nbytes, spec_of
from mpmd.compiler.lowering import without_callers_mesh
from mpmd.compiler.stages import StageSplit, is_marker, split_backward
from mpmd.errors import PipelineError, ScheduleError
from mpmd.schedules.balance import SegmentCosts, check_stage_count, groups, resolve_grouping
from mpmd.schedules.validation import declared_split_backward, users_call

__all__ = ["FLOPS_PER_SECOND", "BYTES_PER_SECOND", "group_segments", "merge_segments", "xla_segment_costs"]

FLOPS_PER_SECOND = 2e10
BYTES_PER_SECOND = 1e10


def merge_segments(split: StageSplit, grouping: tuple[int, ...], body: LoopBody) -> StageSplit:
    """A new StageSplit with one stage per group of consecutive segments (F regions concatenated, B regions in
    program order). `split` is left as it was."""
    if sum(grouping) != split.num_stages:
        raise PipelineError(f"internal: grouping {grouping} covers {sum(grouping)} segments, the step has {split.num_stages}")
    position = {id(e): i for i, e in enumerate(body.eqns)}
    regions: dict[tuple[int, str], list[Any]] = {}
    for g, segs in enumerate(groups(grouping)):
        for kind in {k for (_, k) in split.regions}:
            eqns = [e for s in segs for e in split.regions.get((s, kind), [])]
            regions[(g, kind)] = sorted(eqns, key=lambda e: position.get(id(e), 0))
    return StageSplit(len(grouping), regions)


def _region_cost(eqns: list[Any]) -> tuple[float, float]:
    """(flops, bytes accessed) of a region lowered alone: its free inputs in, every value it makes out."""
    if not eqns:
        return 0.0, 0.0
    inputs = free_inputs(eqns)
    outputs = [v for e in eqns for v in e.outvars if is_var(v)]
    fn = eqns_fn(eqns, inputs, outputs, {})
    try:
        with without_callers_mesh():
            got = jax.jit(fn).lower(*[spec_of(v) for v in inputs]).cost_analysis()
    except Exception as e:  # a region XLA cannot cost alone: fall back on its output bytes
        raise PipelineError(f"balance='auto': XLA's cost analysis of a segment failed ({e}); pass measured costs instead: "
                            "balance=step.profile_costs(*args)") from None
    if isinstance(got, (list, tuple)):
        got = got[0] if got else {}
    got = got or {}
    return float(got.get("flops", 0.0)), float(got.get("bytes accessed", 0.0))


def xla_segment_costs(split: StageSplit, body: LoopBody, with_split_backward: bool = True) -> SegmentCosts:
    """Per segment: F, B (and I, W) times from XLA's cost analysis (see the module docstring), and the bytes
    its closing marker hands to the next segment."""
    n = split.num_stages

    def seconds(eqns: list[Any]) -> float:
        flops, nbytes_ = _region_cost(eqns)
        return flops / FLOPS_PER_SECOND + nbytes_ / BYTES_PER_SECOND

    f = tuple(seconds(split.regions.get((s, "F"), [])) for s in range(n))
    b = tuple(seconds(split.regions.get((s, "B"), [])) for s in range(n))
    i: tuple[float, ...] = ()
    w: tuple[float, ...] = ()
    if with_split_backward:
        copy = StageSplit(n, {k: list(v) for k, v in split.regions.items()})
        split_backward(copy, set(range(n)))
        i = tuple(seconds(copy.regions.get((s, "I"), [])) for s in range(n))
        w = tuple(seconds(copy.regions.get((s, "W"), [])) for s in range(n))
    out_bytes = []
    for s in range(n):
        fwd = split.regions.get((s, "F"), [])
        out_bytes.append(float(sum(nbytes(v) for v in fwd[-1].outvars)) if fwd and is_marker(fwd[-1]) else 0.0)
    return SegmentCosts(F=f, B=b, I=i, W=w, activation_bytes=tuple(out_bytes), source="xla cost analysis")


def group_segments(split: StageSplit, schedule: Any, body: LoopBody, num_microbatches: int) -> tuple[StageSplit, tuple[int, ...] | None]:
    """The stage split the schedule's `balance` asks for, and its grouping (None: one segment per stage, as
    without balance). Raises PipelineError for a grouping that does not fit the step."""
    if schedule is None or getattr(schedule, "balance", None) is None:
        return split, None
    costs = None
    try:
        check_stage_count(schedule, split.num_stages)
    except ScheduleError as e:
        raise PipelineError(str(e)) from None
    if schedule.balance == "auto":
        try:  # (its own answer, else its table's: what a user's schedule raises comes back naming it)
            split_bwd = declared_split_backward(schedule, type(schedule).__name__)
            if split_bwd is None:
                least = max(1, getattr(schedule, "min_microbatches", 1))
                split_bwd = any(t.kind in ("I", "W") for row in users_call(type(schedule).__name__, f"tasks({least})", schedule.tasks, least)
                                for t in row)
        except ScheduleError as e:
            raise PipelineError(str(e)) from e
        costs = xla_segment_costs(split, body, with_split_backward=split_bwd)
    try:
        grouping = resolve_grouping(schedule, split.num_stages, num_microbatches, costs)
    except ScheduleError as e:
        raise PipelineError(str(e)) from None
    assert grouping is not None
    return merge_segments(split, grouping, body), grouping
