"""Stage tasks by dataflow, for loop bodies that take several gradients over one microbatch. Pure.

`stages.split_stages` cuts one forward and one backward pass by position. A body with several passes — an
actor-critic step calling `jax.grad` once per loss (each call traces its own forward), a GAN step, a
`jax.vjp` whose backward is called twice, an auxiliary loss on a sub-network — interleaves forward and
backward markers, so position says little. Here every equation gets a stage and a kind from dataflow:

* **kind**: an equation downstream of a backward marker is backward; of the others, what a forward marker
  or a per-microbatch aux output (the loss) needs is forward; the rest (the last stage's backward, residuals
  only a backward reads, a backward pass that crosses no marker) is backward. A forward marker downstream of
  a backward marker (a second forward that reads the first gradient) cannot be pipelined and is refused.
* **stage**: the latest stage among what it reads — but for a gradient's epilogue (a backward equation no backward
  marker reads, a norm over every stage's gradients say), the stage whose backward runs last among the backward
  values it reads (the lowest); a forward marker's outputs belong to the next stage, a backward marker's to the
  previous one (it starts that stage's backward). An equation that reads no staged
  value (it reads only parameters, the microbatch or constants) joins its consumers: the earliest stage of
  its forward consumers, the latest of its backward ones.

So each stage's forward task holds every pass's forward of that stage, and its backward task the sum of the
cotangents of every pass that reach it. A backward equation that reads a value another stage's backward
computes later in the same microbatch (a second cotangent computed from the first gradient) is refused with
what to write instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from mpmd.compiler.eqns import is_var, nbytes, upstream, var_inputs
from mpmd.errors import PipelineError, callers_level

Region = tuple[int, str]

ONE_VJP = ("sum the losses into one scalar and take one gradient (jax.grad of the sum gives each parameter the sum of "
           "both gradients), or take both gradients with one jax.vjp of a function returning both losses and call its "
           "backward once with a cotangent per loss")


def split_by_dataflow(eqns: Sequence[Any], aux: set[Any], is_fwd: Callable[[Any], bool],
                      is_bwd: Callable[[Any], bool]) -> tuple[int, dict[Region, list[Any]]]:
    """The number of stages and each region's equations (in program order); see the module docstring."""
    producer = {v: e for e in eqns for v in e.outvars if is_var(v)}
    downstream_of_bwd: set[int] = set()
    tainted: set[Any] = set()
    for e in eqns:
        if is_bwd(e) or any(v in tainted for v in var_inputs(e)):
            downstream_of_bwd.add(id(e))
            tainted.update(v for v in e.outvars if is_var(v))
    for e in eqns:
        if is_fwd(e) and id(e) in downstream_of_bwd:
            raise PipelineError("a forward pass in the microbatch function reads the result of an earlier backward pass (a "
                                "pipeline_yield marker runs on values computed from a gradient), so its forward cannot run "
                                "before that backward in a pipeline schedule; compute the second forward from the "
                                f"parameters and the microbatch only, or {ONE_VJP}. A gradient of a gradient across the "
                                "markers (a gradient penalty, a Hessian-vector product) has this shape and cannot be "
                                "pipelined: take the inner gradient where no pipeline_yield lies between its input and its "
                                "output (within one stage), or run that step under plain jax.jit")
    forward = upstream([e for e in eqns if is_fwd(e)] + [producer[v] for v in aux if v in producer], producer,
                       lambda e: id(e) in downstream_of_bwd)
    fwd_vars = {v for e in eqns if id(e) in forward for v in e.outvars}
    for e in eqns:  # a callback without outputs (a debug print) runs in the forward when it reads only forward values
        if not any(is_var(v) for v in e.outvars) and id(e) not in downstream_of_bwd:
            if all(v in fwd_vars or v not in producer for v in var_inputs(e)):
                forward.add(id(e))

    cotangent = upstream([e for e in eqns if is_bwd(e)], producer)  # (what backward markers read, and what that reads)
    moved: dict[int, dict[Any, int]] = {}  # stage -> its backward's arrays a gradient's epilogue reads on an earlier stage (bytes)
    stage_of: dict[Any, int] = {}
    own: dict[int, int | None] = {}
    for e in eqns:
        read = [stage_of[v] for v in var_inputs(e) if v in stage_of]
        s = max(read) if read else None
        if is_fwd(e):
            own[id(e)], out = s or 0, (s or 0) + 1
        elif is_bwd(e):
            own[id(e)] = out = max((s if s is not None else 1) - 1, 0)
        elif id(e) in forward:
            own[id(e)] = out = s
        elif id(e) in cotangent:
            own[id(e)] = out = s
        else:  # a gradient's epilogue (nothing a backward marker reads): it runs in the backward that comes last among
            # those it reads, the lowest stage's (the latest stage's was taken before, and a value computed from every
            # stage's gradient — a global norm, a clip — went to the last stage's backward, which runs first: refused
            # as unorderable; a probe)
            back = [stage_of[v] for v in var_inputs(e) if v in stage_of and id(producer[v]) not in forward]
            own[id(e)] = out = min(back) if back else s
            for v in var_inputs(e):  # (arrays of a later stage's backward that this moves to an earlier stage's actor)
                if out is not None and stage_of.get(v, -1) > out and id(producer[v]) not in forward and getattr(v.aval, "ndim", 0):
                    moved.setdefault(stage_of[v], {})[v] = nbytes(v)
        if out is not None:
            for v in e.outvars:
                stage_of[v] = out
    n = max([*stage_of.values(), *(s for s in own.values() if s is not None)], default=0) + 1
    consumers: dict[Any, list[Any]] = {}
    for e in eqns:
        for v in set(var_inputs(e)):
            consumers.setdefault(v, []).append(e)
    for e in reversed(eqns):  # floating equations join their consumers
        if own[id(e)] is not None:
            continue
        cons = [c for v in e.outvars for c in consumers.get(v, ()) if own.get(id(c)) is not None]
        if id(e) in forward:
            fc = [own[id(c)] for c in cons if id(c) in forward]
            own[id(e)] = min(fc) if fc else 0
        else:
            bc = [own[id(c)] for c in cons if id(c) not in forward]
            own[id(e)] = max(bc) if bc else 0

    if moved:
        warnings.warn(f"the microbatch function computes a value of several stages' gradients (a norm, a clip: "
                      f"{_size(sum(b for vs in moved.values() for b in vs.values()))} of stage(s) {sorted(moved)} per microbatch), which is known only "
                      "once the lowest of them has its gradient — its backward runs last — so those gradients go to that "
                      "stage's actor every microbatch, and their accumulators and optimizer state with them. To keep each "
                      "stage's gradient on its own actor, clip the accumulated gradient after accumulate_grads (e.g. "
                      "optax.clip_by_global_norm in the optimizer) rather than each microbatch's", stacklevel=callers_level())

    regions: dict[Region, list[Any]] = {(s, k): [] for s in range(n) for k in "FB"}
    region_of: dict[Any, Region] = {}
    for e in eqns:
        r = (own[id(e)], "F" if id(e) in forward else "B")
        regions[r].append(e)
        for v in e.outvars:
            region_of[v] = r

    def order(r: Region) -> int:
        return r[0] if r[1] == "F" else n + (n - 1 - r[0])

    for r, es in regions.items():
        for e in es:
            for v in var_inputs(e):
                src = region_of.get(v)
                if src is not None and order(src) > order(r):
                    raise PipelineError(
                        f"the microbatch function takes several gradients, and the backward of stage {r[0]} reads a value "
                        f"that the backward of stage {src[0]} computes later in the same microbatch (a cotangent computed "
                        "from an earlier gradient, e.g. vjp_fn(g(vjp_fn(ct)[0]))), which no pipeline schedule can order; "
                        f"{ONE_VJP}")
    return n, regions


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"
