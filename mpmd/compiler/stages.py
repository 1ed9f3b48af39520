"""Cut the loop body's varying equations at the markers into stage tasks. Pure functions.

In ``make_jaxpr(value_and_grad(f))`` all forward equations come before the transposed ones, so the cut is
linear: forward markers end forward stages; backward markers (their transposes) start backward stages.
The equations between the last forward marker and the first backward marker are the last stage's forward
and backward; they are told apart by dataflow (its forward part is what the aux outputs, the loss, need).

A stage whose output has no gradient (a first stage without parameters, a frozen feature extractor) has no
backward marker: its boundary's tangent is symbolically zero. So backward regions are matched to stages by
dataflow, not by counting: a backward region belongs to the latest stage whose forward values it reads.

Then two refinements:
* a backward equation that only feeds gradient sums (e.g. the widening cast of a bf16 weight's cotangent
  back to f32, which JAX puts where the cast was traced: in stage 0) moves to the task that produced its
  inputs when that moves fewer bytes;
* a stage's backward splits into an input-gradient task `I` (what earlier stages wait for) and a
  weight-gradient task `W` (the rest), for schedules that ask for it (zero bubble).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
from jax.extend.core import Var

from mpmd.compiler.body import LoopBody
from mpmd.compiler.eqns import is_var, nbytes, upstream, var_inputs
from mpmd.compiler.multipass import split_by_dataflow
from mpmd.errors import PipelineError, callers_level
from mpmd.primitives import BWD, FWD, pipeline_yield_p

Region = tuple[int, str]  # (stage, kind)


def is_marker(eqn: Any, direction: str | None = None) -> bool:
    return eqn.primitive is pipeline_yield_p and (direction is None or eqn.params["direction"] == direction)


@dataclass
class StageSplit:
    """Which task computes each varying equation: `regions[(stage, kind)]` in program order, kind F or B
    (I and W after `split_backward`)."""

    num_stages: int
    regions: dict[Region, list[Any]]
    region_of: dict[Var, Region] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reindex()

    def reindex(self) -> None:
        self.region_of = {v: r for r, eqns in self.regions.items() for e in eqns for v in e.outvars}

    def order(self, r: Region) -> int:
        """Position of a region in one microbatch's dataflow: F0 < F1 < ... < B_last < ... < B0 (I before W)."""
        s, k = r
        if k == "F":
            return s
        n = self.num_stages
        return n + 2 * (n - 1 - s) + (1 if k == "W" else 0)


def _marker_depth(eqns: list[Any]) -> int:
    """How many forward markers the longest chain of stages crosses (dataflow, not position)."""
    depth: dict[Var, int] = {}
    best = 0
    for e in eqns:
        d = max((depth[v] for v in var_inputs(e) if v in depth), default=0) + (1 if is_marker(e, FWD) else 0)
        best = max(best, d)
        if d:
            for v in e.outvars:
                depth[v] = d
    return best


def forward_markers(body: LoopBody) -> int:
    """How many forward markers the loop body has (every one, whether it ends a stage or not)."""
    return sum(1 for e in body.eqns if is_marker(e, FWD))


def unused_markers(body: LoopBody) -> int:
    """How many forward markers' results nothing reads (`mpmd.pipeline_yield(x)` without `x = `): they end no
    stage, and JAX's autodiff drops their backward half."""
    read = {v for e in body.eqns for v in var_inputs(e)} | {v for v in body.outputs if isinstance(v, Var)}
    read |= {v for v, _ in body.stacked} | set(body.accumulators)
    return sum(1 for e in body.eqns if is_marker(e, FWD) and not any(v in read for v in e.outvars))


def split_stages(body: LoopBody) -> StageSplit:
    eqns = body.eqns
    fwd = [i for i, e in enumerate(eqns) if is_marker(e, FWD)]
    bwd = [i for i, e in enumerate(eqns) if is_marker(e, BWD)]
    if (fwd and bwd and max(fwd) > min(bwd)) or len(bwd) > len(fwd) or _marker_depth(eqns) != len(fwd):
        # several gradients over one microbatch (two jax.grad calls, a vjp called twice, a GAN step): by dataflow
        n, regions = split_by_dataflow(eqns, {v for v, _ in body.stacked}, lambda e: is_marker(e, FWD),
                                       lambda e: is_marker(e, BWD))
        return StageSplit(n, regions)
    n = len(fwd) + 1
    regions: dict[Region, list[Any]] = {(s, k): [] for s in range(n) for k in "FB"}
    first_bwd = bwd[0] if bwd else len(eqns)
    start = 0
    for s, end in enumerate(fwd):
        regions[(s, "F")] = eqns[start : end + 1]
        start = end + 1
    last_region = eqns[start:first_bwd]
    # Forward values by stage: a marker's outputs are the next stage's inputs.
    stage_of: dict[Var, int] = {}
    for s in range(n - 1):
        for e in regions[(s, "F")]:
            for v in e.outvars:
                stage_of[v] = s + 1 if is_marker(e) else s
    aux = {v for v, _ in body.stacked}
    needed, fwd_part = set(aux), set()
    for e in reversed(last_region):
        if any(v in needed for v in e.outvars):
            fwd_part.add(id(e))
            needed.update(var_inputs(e))
    _forward_callbacks(last_region, fwd_part, set(body.accumulators))
    regions[(n - 1, "F")] = [e for e in last_region if id(e) in fwd_part]
    for e in regions[(n - 1, "F")]:
        for v in e.outvars:
            stage_of[v] = n - 1
    last_b = [e for e in last_region if id(e) not in fwd_part]
    if fwd and not bwd:
        _warn_backward_left_to_the_last_stage(last_b, regions[(n - 1, "F")], stage_of, n, [eqns[i] for i in fwd])
    # Backward regions: [first_bwd, bwd[1]), [bwd[1], bwd[2]), ...; each belongs to the latest stage whose
    # forward values it reads (what it differentiates).
    bounds = [*bwd, len(eqns)]
    prev = n - 1
    regions[(n - 1, "B")] = last_b
    for j in range(len(bwd)):
        seg = eqns[bounds[j] : bounds[j + 1]]
        read = [stage_of[v] for e in seg for v in var_inputs(e) if v in stage_of]
        stage = max(read) if read else prev - 1
        if stage >= prev:
            stage = prev - 1
        if stage < 0:
            raise PipelineError("could not match the backward pass to stages: a backward marker region reads forward values of "
                                "a stage whose backward already ran. Mark stage boundaries only on the activations that "
                                "flow from one stage to the next")
        regions[(stage, "B")] = regions[(stage, "B")] + seg
        prev = stage
    return StageSplit(n, regions)


def _warn_backward_left_to_the_last_stage(last_b: list[Any], last_f: list[Any], stage_of: dict[Var, int], n: int,
                                          markers: list[Any]) -> None:
    """No backward marker, yet the last stage's backward reads what earlier stages' forwards computed and the last
    forward does not: earlier stages' backward work (their residuals) left to the last stage's actor. Two causes:
    markers that carry no gradient (on a bool mask or int positions only, while the float activation crosses as a
    plain value: a marker cuts the backward only where a gradient flows through it; a probe), and a marker in a
    jax.custom_vjp's fwd rule: JAX traces the rule inline under grad, so its forward marker cuts, but the bwd rule
    has none. The numbers come out right, but every stage's residuals travel to the last actor and it runs every
    backward (a probe). (Gradients of the last stage alone, or an eval loop, read none: no warning.)"""
    forward_reads = {v for e in last_f for v in var_inputs(e)}
    early = {stage_of[v] for e in last_b for v in var_inputs(e) if stage_of.get(v, n - 1) < n - 1 and v not in forward_reads}
    if not early:
        return
    floats = any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for e in markers for v in var_inputs(e) if hasattr(v.aval, "dtype"))
    why = ("a pipeline_yield inside a jax.custom_vjp function does this (JAX differentiates its fwd rule, whose marker "
           "cuts the forward, while its bwd rule has none): call pipeline_yield outside the custom_vjp function; so do "
           "markers on values no gradient flows through (jax.lax.stop_gradient): mark the activation the next stage "
           "differentiates" if floats else
           "the stage markers carry no float value (a bool mask, int positions), so no gradient flows through them and "
           "they cannot cut the backward pass: mark the float activation that flows on to the next stage (with the "
           "mask beside it: pipeline_yield((x, mask)))")
    warnings.warn(f"the step's backward pass has no stage markers, so the backward work of stage(s) {sorted(early)} "
                  f"runs in the last stage's task, on its actor, with their forward values sent there: {why}",
                  stacklevel=callers_level())


def _forward_callbacks(region: list[Any], fwd_part: set[int], accumulators: set[Var]) -> None:
    """A callback without outputs (a debug print) in the last stage runs in its forward task, with what it
    alone reads (`out.mean()`), unless that is part of a gradient's computation. In place."""
    producer = {v: e for e in region for v in e.outvars}

    def closure(roots: list[Any]) -> set[int]:
        return upstream(roots, producer, lambda e: id(e) in fwd_part)

    gradient = closure([producer[v] for v in accumulators if v in producer])
    for e in region:
        if not any(is_var(v) for v in e.outvars) and id(e) not in fwd_part:
            reads = closure([e])
            if not reads & gradient:
                fwd_part.update(reads)


def follow_inputs(split: StageSplit, body: LoopBody, actor_of: Any) -> None:
    """Move backward equations that only feed gradient sums to the task holding most of their input bytes
    (never earlier than their inputs in one microbatch's dataflow). In place."""
    from mpmd.compiler.body import INVARIANT

    position = {id(e): i for i, e in enumerate(body.eqns)}
    consumers: dict[Var, list[int]] = {}
    for eqns in split.regions.values():
        for e in eqns:
            for v in set(var_inputs(e)):
                consumers.setdefault(v, []).append(id(e))
    accumulated = set(body.accumulators)
    backward = sorted(((r, e) for r, eqns in split.regions.items() if r[1] != "F" for e in eqns), key=lambda re: position[id(re[1])])
    tail: set[int] = set()
    for _, e in reversed(backward):
        if is_marker(e) or any(body.status.get(v) == INVARIANT for v in var_inputs(e)):
            continue  # markers stay; an equation reading a step value (a parameter) stays where that value is
        outs = [v for v in e.outvars if type(v).__name__ != "DropVar"]
        if outs and all((v in accumulated or consumers.get(v)) and all(c in tail for c in consumers.get(v, ())) for v in outs):
            tail.add(id(e))
    moved = False
    for r, e in backward:
        if id(e) not in tail:
            continue
        r = split.region_of[e.outvars[0]]
        producers = {split.region_of[v] for v in var_inputs(e) if v in split.region_of}
        if not producers:
            continue
        earliest = max(split.order(p) for p in producers)
        candidates = {p for p in producers if split.order(p) >= earliest} | {r}

        def cost(c: Region) -> int:
            a = actor_of(c[0])
            return sum(nbytes(v) for v in var_inputs(e) if v in split.region_of and actor_of(split.region_of[v][0]) != a)

        best = min(candidates, key=lambda c: (cost(c), c != r))
        if best != r:
            split.regions[r].remove(e)
            split.regions[best].append(e)
            for v in e.outvars:
                split.region_of[v] = best
            moved = True
    if moved:
        for key, eqns in split.regions.items():
            split.regions[key] = sorted(eqns, key=lambda e: position[id(e)])


def split_backward(split: StageSplit, stages: set[int]) -> None:
    """Cut the B task of each stage in `stages` into I (what other stages' backward tasks read, and what that
    needs) and W (the rest). In place."""
    for s in stages:
        b = split.regions.pop((s, "B"), [])
        own = {v for e in b for v in e.outvars}
        exported = set()
        for r, eqns in split.regions.items():
            if r[1] == "F" or r[0] == s:
                continue
            for e in eqns:
                exported.update(v for v in var_inputs(e) if v in own)
        needed, i_ids = set(exported), set()
        for e in reversed(b):
            if any(v in needed for v in e.outvars):
                i_ids.add(id(e))
                needed.update(var_inputs(e))
        split.regions[(s, "I")] = [e for e in b if id(e) in i_ids]
        split.regions[(s, "W")] = [e for e in b if id(e) not in i_ids]
    split.reindex()


def remat_stages(split: StageSplit, body: LoopBody, stages: Sequence[int]) -> int:
    """For each stage in `stages`, copy into its backward tasks (B, or I and W) the forward equations that
    compute what they read of the forward, from the forward's own inputs: the stage's activations then live
    only within a task, and between F and B only what F reads (its input activation, batch leaves) is kept —
    `jax.checkpoint` of the stage. A forward equation that adds to an accumulator or a stacked output, or a
    marker, or one whose values other tasks read too (they must have one producer), is not copied (what it
    gives is still kept). In place; returns how many equations were copied."""
    summed = set(body.accumulators) | {v for v, _ in body.stacked}
    readers: dict[Var, set[Region]] = {}
    for r, eqns in split.regions.items():
        for e in eqns:
            for v in var_inputs(e):
                readers.setdefault(v, set()).add(r)
    copied = 0
    for s in stages:
        mine = {(s, k) for k in ("F", "B", "I", "W")}
        fwd = split.regions.get((s, "F"), [])
        made = {v: e for e in fwd for v in e.outvars if is_var(v)}
        for kind in ("B", "I", "W"):
            eqns = split.regions.get((s, kind))
            if not eqns:
                continue
            own = {v for e in eqns for v in e.outvars}
            chosen = upstream((made[v] for e in eqns for v in var_inputs(e) if v in made and v not in own), made,
                              lambda e: is_marker(e) or any(v in summed or readers.get(v, set()) - mine for v in e.outvars))
            if chosen:
                copied += len(chosen)
                split.regions[(s, kind)] = [*(e for e in fwd if id(e) in chosen), *eqns]
    return copied


# Elementwise and shape-only primitives: recomputing them where they are read costs less than a transfer.
CHEAP = frozenset({
    "add", "sub", "mul", "neg", "max", "min", "abs", "sign", "not", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge",
    "select_n", "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota", "copy", "copy_p",
    "stop_gradient", "clamp", "floor", "ceil", "round", "shift_left", "shift_right_logical", "shift_right_arithmetic",
})
RECOMPUTE_MAX_BYTES = 4 << 20


def recompute_cheap(split: StageSplit, body: LoopBody, actor_of: Any) -> int:
    """Where a task reads a cheap value (elementwise or shape-only, at most RECOMPUTE_MAX_BYTES) that another
    actor computes, and everything it is computed from is already on the reader's actor for that microbatch
    (its own earlier tasks' values, batch leaves it reads), recompute it there instead of receiving it each
    microbatch. In place; returns how many equations were duplicated."""
    from mpmd.compiler.body import INVARIANT

    position = {id(e): i for i, e in enumerate(body.eqns)}
    producer = {v: e for eqns in split.regions.values() for e in eqns for v in e.outvars}
    leaves_on: dict[int, set[Var]] = {}
    invariants_on: dict[int, set[Var]] = {}
    for r, eqns in split.regions.items():
        a = actor_of(r[0])
        for e in eqns:
            for v in var_inputs(e):
                if v in body.mb_leaves:
                    leaves_on.setdefault(a, set()).add(v)
                elif body.status.get(v) == INVARIANT:
                    invariants_on.setdefault(a, set()).add(v)
    summed = set(body.accumulators) | {v for v, _ in body.stacked}
    duplicated = 0
    for r in sorted(split.regions, key=split.order):
        a = actor_of(r[0])
        own = {v for e in split.regions[r] for v in e.outvars}
        added: list[Any] = []

        def available(v: Var, depth: int) -> bool:
            if v in own or body.status.get(v) == 0:
                return True
            if v in body.mb_leaves:
                return v in leaves_on.get(a, ())
            if body.status.get(v) == INVARIANT:
                return v in invariants_on.get(a, ())
            src = split.region_of.get(v)
            if src is not None and actor_of(src[0]) == a and split.order(src) <= split.order(r):
                return True
            e = producer.get(v)
            if (e is None or depth > 4 or e.primitive.name not in CHEAP or nbytes(v) > RECOMPUTE_MAX_BYTES
                    or any(u in summed for u in e.outvars)):
                return False
            if all(available(u, depth + 1) for u in var_inputs(e)):
                added.append(e)
                own.update(e.outvars)
                return True
            return False

        for e in list(split.regions[r]):
            for v in var_inputs(e):
                src = split.region_of.get(v)
                if src is not None and actor_of(src[0]) != a:
                    available(v, 0)
        if added:
            duplicated += len(added)
            split.regions[r] = sorted([*split.regions[r], *added], key=lambda e: position[id(e)])
    return duplicated
