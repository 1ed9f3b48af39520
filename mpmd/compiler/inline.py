"""First pass over a traced step or loop body: make every stage marker visible at the top level.

* Nested `jit`/`pjit`/call equations are inlined (markers inside them become visible).
* A `lax.scan` whose body holds markers (a scanned stack of stages: `nnx.scan`, `nn.scan`, a hand-written
  `lax.scan` over stacked per-stage parameters) is unrolled, one iteration after another. The rule: a scan of
  S iterations with a marker at the end of its body gives S stages; what precedes the scan joins the first
  iteration's stage and what follows it (head, loss) the last one's, so the last marker of the last
  iteration (however deep in the body: in a jitted block too; in the backward pass its transpose, the first
  of the first backward iteration) is dropped — unless the next marker belongs to a scan unrolled after this
  one (an encoder stack then a decoder stack, or the next group of a scan of scans: each iteration stays a
  stage, S1 + S2 stages in all; what lies between joins the next scan's first stage). Markers outside the
  scans cut as usual, and one right after a scan (or after an inner scan, in the body of an outer one) takes
  the place of its last marker. Which markers to drop is known only once every marker has been met, so a
  step with such scans is traced twice. (A marker at the start of the body is dropped all the same, which
  merges the last two layers: the rule is for a marker at the end of the body, where users put it.) The
  iterations' stacked outputs (residuals for the backward pass) stay per-iteration values wherever they are
  only sliced again, so no stage waits for another stage's residuals; a marker given them takes them whole.
* A marker inside a construct the compiler cannot cut (`jax.checkpoint`/remat, `lax.cond`/`switch`,
  `while_loop`/`fori_loop`, `custom_vjp`, `shard_map`, ...) is an error that names the construct and says
  where to put the marker instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from mpmd.compiler.eqns import bind_eqn, contains_primitive, sub_jaxprs
from mpmd.errors import PipelineError
from mpmd.primitives import BWD, FWD, accumulate_p, pipeline_yield_p

_CALL_PARAMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}

_CONSTRUCTS = {
    "remat2": ("jax.checkpoint (remat)", "call pipeline_yield on the checkpointed function's result instead: "
               "x = mpmd.pipeline_yield(jax.checkpoint(block)(params, x))"),
    "checkpoint": ("jax.checkpoint (remat)", "call pipeline_yield on the checkpointed function's result instead: "
                   "x = mpmd.pipeline_yield(jax.checkpoint(block)(params, x))"),
    "remat": ("jax.checkpoint (remat)", "call pipeline_yield on the checkpointed function's result instead: "
              "x = mpmd.pipeline_yield(jax.checkpoint(block)(params, x))"),
    "cond": ("lax.cond / lax.switch", "a stage boundary must be unconditional: compute both branches' stage split "
             "outside the cond, or move the marker before or after it"),
    "while": ("lax.while_loop / lax.fori_loop", "unroll the loop (a Python for loop, or lax.scan over stages) or put the "
              "marker after the loop"),
    "custom_vjp_call": ("a jax.custom_vjp function", "call pipeline_yield outside the custom_vjp function"),
    "custom_vjp_call_jaxpr": ("a jax.custom_vjp function", "call pipeline_yield outside the custom_vjp function"),
    "custom_jvp_call": ("a jax.custom_jvp function", "call pipeline_yield outside the custom_jvp function"),
    "shard_map": ("shard_map", "call pipeline_yield outside the shard_map"),
    "xla_pmap": ("pmap", "call pipeline_yield outside the pmap"),
}


def has_marker(jaxpr: Any) -> bool:
    return contains_primitive(jaxpr, pipeline_yield_p)


def _marker_directions(jaxpr: Any) -> set[str]:
    out: set[str] = set()
    for e in jaxpr.eqns:
        if e.primitive is pipeline_yield_p:
            out.add(e.params["direction"])
        for j in sub_jaxprs(e):
            out |= _marker_directions(j)
    return out


class _Stacked:
    """The stacked outputs of an unrolled scan, kept per iteration until something needs the whole array."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self._whole: Any = None

    def whole(self) -> Any:
        if self._whole is None:
            self._whole = jnp.stack(self.items)
        return self._whole


def _value(x: Any) -> Any:
    return x.whole() if isinstance(x, _Stacked) else x


def _read(env: dict[Any, Any], x: Any) -> Any:
    return x.val if isinstance(x, Literal) else env[x]


class _Unroll:
    """One scan being (or having been) unrolled: when it started and ended on the unroller's clock, and the
    marker that would end its stages (its last forward marker; in a transposed scan its first backward one)."""

    def __init__(self, start: int, direction: str | None) -> None:
        self.start, self.end = start, -1
        self.direction = direction  # FWD or BWD when all the body's markers go one way (else no end is dropped)
        self.end_marker: int | None = None


class _Unroller:
    """Evaluates equations under a JAX trace, inlining calls and unrolling scans that hold markers. Every
    marker met is recorded in `met` as (direction, the scans unrolling around it); those whose position in
    that order is in `drop` are evaluated as the identity (see the module docstring and `_scan_ends_to_drop`)."""

    def __init__(self, drop: frozenset[int] = frozenset(), step: bool = False) -> None:
        self.drop = drop
        self.step = step  # evaluating a whole step, around its microbatch loop (not the loop's body)
        self.past_loop = False  # (a step's) accumulate_grads evaluated already
        self.met: list[tuple[str, tuple[_Unroll, ...]]] = []
        self.unrolls: list[_Unroll] = []
        self._open: list[_Unroll] = []  # the scans being unrolled around the equation evaluated now
        self._clock = 0  # ticks at every scan's start and end

    def eval_jaxpr(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            invals = [_read(env, x) for x in eqn.invars]
            name = eqn.primitive.name
            if eqn.primitive is pipeline_yield_p:
                self.met.append((eqn.params["direction"], tuple(self._open)))
                vals = [_value(x) for x in invals]  # (a scan's stacked outputs, or its inputs' cotangents, marked whole)
                outs = vals if len(self.met) - 1 in self.drop else bind_eqn(eqn, vals)
            elif name in _CALL_PARAMS and _CALL_PARAMS[name] in eqn.params and name not in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
                inner = eqn.params[_CALL_PARAMS[name]]
                closed = inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ())
                outs = self.eval_jaxpr(closed.jaxpr, closed.consts, invals)
            elif name == "scan" and has_marker(eqn.params["jaxpr"].jaxpr):
                outs = self._unroll_scan(eqn, invals)
            else:
                if name != "mpmd_accumulate" and any(contains_primitive(j, accumulate_p) for j in sub_jaxprs(eqn)):
                    what = _CONSTRUCTS.get(name, (f"a {name!r} equation",))[0]  # (it blamed a marker in it; a probe)
                    raise PipelineError(f"mpmd.accumulate_grads is called inside {what}, so the microbatch loop cannot be "
                                        "pipelined: call it at the top level of the step (a condition or remat goes inside "
                                        "the microbatch function, or around the step under plain jax.jit)")
                if name != "mpmd_accumulate" and any(has_marker(j) for j in sub_jaxprs(eqn)):
                    if self.step:  # (a model evaluated after the loop, in a cond or a line search's while_loop, was told
                        # to move its marker out of the cond: then refused as used after accumulate_grads; a probe)
                        raise marker_outside_loop("after" if self.past_loop else "before")
                    what, fix = _CONSTRUCTS.get(name, (f"a {name!r} equation", "move the marker outside it"))
                    raise PipelineError(f"a pipeline_yield marker is inside {what}, which the compiler cannot cut into "
                                        f"stages; {fix}")
                outs = bind_eqn(eqn, [_value(x) for x in invals])
                self.past_loop = self.past_loop or name == "mpmd_accumulate"
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [_read(env, v) for v in jaxpr.outvars]

    def _unroll_scan(self, eqn: Any, invals: list[Any]) -> list[Any]:
        p = eqn.params
        body: ClosedJaxpr = p["jaxpr"]
        n, reverse = p["length"], p["reverse"]
        nc, ncarry = _scan_operand_counts(p)
        consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        directions = _marker_directions(body.jaxpr)
        order = list(range(n))[::-1] if reverse else list(range(n))
        me = _Unroll(self._clock, next(iter(directions)) if len(directions) == 1 else None)
        self._clock += 1
        self.unrolls.append(me)
        self._open.append(me)
        if me.direction == FWD:
            _warn_stacked_operands(xs, n)
        ys: list[list[Any]] = [[] for _ in range(len(body.jaxpr.outvars) - ncarry)]
        for t in order:
            x_t = [x.items[t] if isinstance(x, _Stacked) else jax.lax.index_in_dim(_value(x), t, keepdims=False) for x in xs]
            first = len(self.met)
            outs = self.eval_jaxpr(body.jaxpr, body.consts, [*consts, *carry, *x_t])
            # The last forward iteration's last marker (in a transposed scan, the first backward iteration's first
            # marker), however deep in the body, would cut off the head: it may be dropped (module docstring).
            mine = [k for k in range(first, len(self.met)) if self.met[k][0] == me.direction]
            if mine and t == order[-1] and me.direction == FWD:
                me.end_marker = mine[-1]
            elif mine and t == order[0] and me.direction == BWD:
                me.end_marker = mine[0]
            carry = [_value(c) for c in outs[:ncarry]]
            for j, y in enumerate(outs[ncarry:]):
                ys[j].append(_value(y))
        self._open.pop()
        me.end = self._clock
        self._clock += 1
        if reverse:
            for y in ys:
                y.reverse()
        return [*carry, *(_Stacked(y) for y in ys)]


STACKED_WARN_BYTES = 1 << 20  # a scan's stacked per-stage operands from this size on are warned about


def _numeric(dtype: Any) -> bool:
    """Whether `dtype` is a numpy number type (a typed PRNG key's, `key<fry>`, is none: numpy cannot read it; an
    nnx.scan of Dropout blocks stacks their keys, and the warning's count crashed the compile; the full test run)."""
    try:
        return np.issubdtype(np.dtype(dtype), np.number)
    except TypeError:
        return False


def _warn_stacked_operands(xs: list[Any], n: int) -> None:
    """Warn when a forward scan unrolled into `n` stages takes per-stage operands stacked in one array (`xs` that
    are not the per-iteration outputs of an earlier unrolled scan) of `STACKED_WARN_BYTES` or more: a stacked
    parameter is one leaf, held whole by every actor that reads it (4 stages of 256 x 256, 8 microbatches: 3.2 MiB
    moved per step where the same layers as a list move 0.2 MiB; 9 MiB before the gradient's stack was made after
    the loop, `body._SUM_THROUGH_STACK`)."""
    whole = [x for x in xs if not isinstance(x, _Stacked) and hasattr(x, "shape") and _numeric(x.dtype)]
    nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in whole)
    if nbytes < STACKED_WARN_BYTES:
        return
    shapes = ", ".join(f"{np.dtype(x.dtype).name}{list(x.shape)}" for x in whole[:4]) + (", ..." if len(whole) > 4 else "")
    warnings.warn(f"a lax.scan unrolled into {n} stages takes its per-stage operands stacked in one array each ({shapes}; "
                  f"{nbytes / 2**20:.1f} MiB): a stacked parameter is one leaf, so every actor that runs one of its stages "
                  "holds and updates the whole stack (and its optimizer state), and receives the other stages' slices of "
                  "its gradient each step (`step.placement(...)` shows the transfers). The step is right, only slower "
                  "and bigger: for each stage's parameters to stay on its actor, keep the layers as a list of per-layer "
                  "trees and loop over them in Python (a marker after each layer) instead of scanning a stack (flax's "
                  "nn.scan / nnx.scan stack them likewise)", stacklevel=2)


def _scan_operand_counts(params: dict[str, Any]) -> tuple[int, int]:
    """How many of a scan equation's operands are consts and how many carry (the rest are xs): `num_consts` and
    `num_carry` up to jax 0.10; from jax 0.11 the groups of the FlatTree `ft_in` (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _scan_ends_to_drop(met: list[tuple[str, tuple[_Unroll, ...]]], unrolls: list[_Unroll]) -> frozenset[int]:
    """Of the markers met (in order), the scan ends to drop. A forward scan's end stays only when the next
    forward marker belongs to a scan unrolled after it ended (a second stack); it is dropped when nothing
    follows, or a marker outside any later scan does (an explicit marker, or one of a scan around it, takes its
    place). A backward end mirrors that: it stays only when the backward marker before it belongs to a scan
    that ended before this one started (the backward pass meets the transposed scans in reverse)."""
    drop = set()
    for u in unrolls:
        k = u.end_marker
        if k is None:
            continue
        if u.direction == FWD:
            near = next((around for d, around in met[k + 1:] if d == FWD), None)
            keep = near is not None and any(v.start > u.end for v in near)
        else:
            near = next((around for d, around in reversed(met[:k]) if d == BWD), None)
            keep = near is not None and any(v.end < u.start for v in near)
        if not keep:
            drop.add(k)
    return frozenset(drop)


def marker_outside_loop(where: str) -> PipelineError:
    """The error for a stage marker used `where` ("before" or "after") a step's accumulate_grads."""
    instead = ("; to evaluate the model on the updated parameters (a loss after the update), do it in a step of its "
               "own on the same mesh: mpmd.accumulate_grads(lambda mb: ((), loss(params, mb)), batch, schedule=...) "
               "pipelines forward tasks only, and the parameters stay on the actors between the two steps"
               if where == "after" else
               "; to run a model with markers on the inputs first, call it inside that function (on each microbatch)")
    return PipelineError(f"pipeline_yield is used {where} accumulate_grads; stage markers belong inside the "
                         f"microbatch function passed to accumulate_grads{instead}")


def inline_calls(closed: ClosedJaxpr, step: bool = False) -> ClosedJaxpr:
    """Re-trace `closed` with every nested call inlined and every scan holding markers unrolled. `step`: `closed` is
    a whole step (its microbatch loop bound as it is): a marker met there is outside the loop, and refused so."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in closed.jaxpr.invars]

    def traced(unroller: _Unroller) -> ClosedJaxpr:
        def fn(*args: Any) -> list[Any]:
            return [_value(o) for o in unroller.eval_jaxpr(closed.jaxpr, closed.consts, args)]

        return jax.make_jaxpr(fn)(*avals)

    step = step and contains_primitive(closed.jaxpr, accumulate_p)  # (without a loop, no marker is before or after it)
    first = _Unroller(step=step)
    out = traced(first)
    drop = _scan_ends_to_drop(first.met, first.unrolls)
    return traced(_Unroller(drop, step)) if drop else out
