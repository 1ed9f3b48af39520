"""Jaxpr passes on the loop body: inline nested calls, then cut it at the markers into stage tasks.

Pure functions, no I/O. In ``make_jaxpr(value_and_grad(f))`` all forward equations come before the
transposed ones, so the cut is linear: forward markers end forward stages, backward markers (their
transposes) end backward stages. The equations between the last forward marker and the first backward
marker are the last stage's forward and backward; they are told apart by dataflow: its forward part is
what the aux outputs (the loss) need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Literal, Var

from mpmd.errors import PipelineError
from mpmd.primitives import BWD, FWD, pipeline_yield_p

_CALL_PARAMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
                "remat": "jaxpr", "checkpoint": "jaxpr"}


def _read(env: dict[Any, Any], x: Any) -> Any:
    return x.val if isinstance(x, Literal) else env[x]


def eval_eqns(eqns: Sequence[Any], env: dict[Any, Any], inline: bool = False) -> None:
    """Evaluate equations into `env` (vars -> values); with `inline`, call-like equations are entered."""
    for eqn in eqns:
        invals = [_read(env, x) for x in eqn.invars]
        name = eqn.primitive.name
        if inline and name in _CALL_PARAMS and _CALL_PARAMS[name] in eqn.params:
            inner = eqn.params[_CALL_PARAMS[name]]
            if not isinstance(inner, ClosedJaxpr):
                inner = ClosedJaxpr(inner, ())
            outs = eval_closed(inner, invals, inline=True)
        else:
            bind_params = eqn.primitive.get_bind_params(eqn.params)
            subfuns: Sequence[Any] = ()
            if isinstance(bind_params, tuple):  # JAX < 0.8 returns (subfuns, params)
                subfuns, bind_params = bind_params
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o


def eval_closed(closed: ClosedJaxpr, args: Sequence[Any], inline: bool = False) -> list[Any]:
    env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))
    eval_eqns(closed.jaxpr.eqns, env, inline)
    return [_read(env, v) for v in closed.jaxpr.outvars]


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Re-trace `closed` with every nested jit/call inlined, so markers inside them become visible."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: eval_closed(closed, a, inline=True))(*avals)


def eqns_fn(eqns: Sequence[Any], inputs: Sequence[Var], outputs: Sequence[Any], consts: dict[Any, Any]) -> Callable[..., tuple]:
    """A function evaluating `eqns`: flat `inputs` values in, flat `outputs` values out."""
    eqns, inputs, outputs = list(eqns), list(inputs), list(outputs)

    def fn(*args: Any) -> tuple:
        env = dict(consts)
        env.update(zip(inputs, args))
        eval_eqns(eqns, env)
        return tuple(_read(env, v) for v in outputs)

    return fn


@dataclass
class StageTask:
    """The equations of one stage's forward ("F") or backward ("B") task, with what flows in and out."""

    stage: int
    kind: str
    eqns: list[Any]
    inputs: list[Var]
    outputs: list[Var]

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}: {len(self.eqns)} eqns, in {len(self.inputs)}, out {len(self.outputs)}"


def is_marker(eqn: Any, direction: str | None = None) -> bool:
    return eqn.primitive is pipeline_yield_p and (direction is None or eqn.params["direction"] == direction)


def split_stages(body: ClosedJaxpr, num_aux: int) -> list[StageTask]:
    """Cut an inlined loop body at its markers into 2S tasks: [0F, 1F, ..., (S-1)F, 0B, ..., (S-1)B].

    `body` outputs are (grads..., aux...); the last `num_aux` outputs are the aux (loss) values.
    """
    eqns = list(body.jaxpr.eqns)
    fwd = [i for i, e in enumerate(eqns) if is_marker(e, FWD)]
    bwd = [i for i, e in enumerate(eqns) if is_marker(e, BWD)]
    if len(bwd) != len(fwd):
        raise PipelineError(
            f"found {len(fwd)} forward pipeline_yield markers but {len(bwd)} backward ones. Every stage boundary "
            "must lie on the path from the parameters to the loss that jax.grad differentiates; is a marked value unused?"
        )
    if fwd and bwd and max(fwd) > min(bwd):
        raise PipelineError("a pipeline_yield marker appears after the backward pass started; mark stages only in the forward computation")
    n = len(fwd) + 1
    regions: dict[tuple[int, str], list[Any]] = {(s, k): [] for s in range(n) for k in "FB"}
    stage_of_fwd_end = {idx: s for s, idx in enumerate(fwd)}
    bwd_starts = {idx: n - 2 - j for j, idx in enumerate(bwd)}
    current: tuple[int, str] = (0, "F")
    last_region: list[Any] = []
    for i, e in enumerate(eqns):
        if i in bwd_starts:
            current = (bwd_starts[i], "B")
        if current == (n - 1, "F"):
            last_region.append(e)
        else:
            regions[current].append(e)
        if i in stage_of_fwd_end:
            current = (stage_of_fwd_end[i] + 1, "F")
    # The last stage's region: forward = what the aux outputs need; the rest is its backward.
    aux_vars = {v for v in body.jaxpr.outvars[len(body.jaxpr.outvars) - num_aux :] if isinstance(v, Var)}
    needed, fwd_part = set(aux_vars), []
    for e in reversed(last_region):
        if any(v in needed for v in e.outvars):
            fwd_part.append(e)
            needed.update(v for v in e.invars if isinstance(v, Var))
    fwd_ids = {id(e) for e in fwd_part}
    regions[(n - 1, "F")] = [e for e in last_region if id(e) in fwd_ids]
    regions[(n - 1, "B")] = [e for e in last_region if id(e) not in fwd_ids] + regions[(n - 1, "B")]
    order = [(s, "F") for s in range(n)] + [(s, "B") for s in range(n)]
    return _with_interfaces(body, [StageTask(s, k, regions[(s, k)], [], []) for s, k in order])


def _with_interfaces(body: ClosedJaxpr, tasks: list[StageTask]) -> list[StageTask]:
    """Fill each task's inputs (vars it reads but does not define) and outputs (vars it defines that a
    later task or the body's outputs read)."""
    constvars = set(body.jaxpr.constvars)
    defined_in = {}
    for t in tasks:
        for e in t.eqns:
            for v in e.outvars:
                defined_in[v] = t
    read_by: dict[Var, set[int]] = {}
    for ti, t in enumerate(tasks):
        for e in t.eqns:
            for v in e.invars:
                if isinstance(v, Var):
                    read_by.setdefault(v, set()).add(ti)
    body_outs = {v for v in body.jaxpr.outvars if isinstance(v, Var)}
    for ti, t in enumerate(tasks):
        own = {v for e in t.eqns for v in e.outvars}
        seen: set[Var] = set()
        for e in t.eqns:
            for v in e.invars:
                if isinstance(v, Var) and v not in own and v not in constvars and v not in seen:
                    seen.add(v)
                    t.inputs.append(v)
        t.outputs = [v for e in t.eqns for v in e.outvars
                     if isinstance(v, Var) and not _is_drop(v) and (v in body_outs or read_by.get(v, set()) - {ti})]
    return tasks


def _is_drop(v: Any) -> bool:
    return type(v).__name__ == "DropVar"
