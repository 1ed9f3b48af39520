"""The microbatch loop's body, taken apart: what depends on the microbatch, what does not, and how the
gradient sums are formed. Pure functions over jaxprs.

* **Constant** equations (iota, literals only: a causal mask from `jnp.tril(jnp.ones(...))`) depend on
  nothing; every executable that reads one recomputes it, so a constant never crosses actors.
* **Invariant** equations read step values but no microbatch data (a mixed-precision cast of the parameters,
  `stop_gradient(params["base"])`, a weight transpose for a tied head): they move out of the loop and run
  once per step, on the actors that use them (loop-invariant code motion).
* **Varying** equations are the stage tasks proper.

The loop sums gradients. Where a gradient is a sum of several per-microbatch parts (`add_any` of the
cotangents of a weight used by several stages), the sum is pushed through it: each part is summed over the
microbatches on its own (on the actor that computes it) and the parts are combined once, after the loop
(`tail`) — equal to the loop's sum to rounding for floats (exact for ints and bools). A float sum with a part
that does not vary (the data gradient plus an L2 penalty's gradient) is not pushed: the loop adds it each
microbatch, as jax.jit does. A gradient that is invariant or a literal zero (a frozen parameter under
`stop_gradient`) is its value added up `m` times (in its dtype, as the loop adds it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var

from mpmd.compiler.eqns import SyntheticEqn, is_var, new_var, substitute, var_inputs
from mpmd.primitives import pipeline_yield_p

CONST, INVARIANT, VARYING = 0, 1, 2

# Linear in each operand, exact to reassociation: sum over microbatches commutes with them.
_SUM_THROUGH = {"add_any", "add", "sub"}
# Stacks gradient parts (each output element is one input element): the sum commutes with it exactly. A scanned
# stack of stages' gradient is `stack` of its iterations' gradients: pushed through, each stage's part is summed on
# its own actor and the stack is made once after the loop (it was made every microbatch, on one actor: each stage
# sent its slice of the gradient there after every microbatch; a probe). Only `stack`, which gradients meet where a
# scan's iterations are stacked: a re-layout of one stage's own gradient (a tied head's `transpose`, a fused qkv
# weight's `concatenate`) stays in the executable that computes it, where XLA fuses it with the ops before it.
_SUM_THROUGH_STACK = {"stack"}


@dataclass
class LoopBody:
    """The loop body after the analysis above. Vars are the body's own; `outer_of` maps a closed-over body
    input to the step value (loop operand) it stands for."""

    eqns: list[Any]  # varying equations, in order (markers included)
    consts: dict[Var, Any]  # body constvars and literal operands -> values
    mb_leaves: dict[Var, int]  # body input -> batch leaf index
    outer_of: dict[Var, Any]  # closed-over body input -> loop operand (outer var)
    status: dict[Var, int]  # CONST / INVARIANT / VARYING per body var
    constant_defs: dict[Var, Any]  # constant var -> its defining equation
    hoisted: list[Any]  # invariant equations, run once per step before the loop
    accumulators: list[Var]  # varying vars summed over microbatches
    stacked: list[tuple[Var, Var]]  # (per-microbatch aux var, var of its stacked [m, ...] value)
    tail: list[Any]  # equations after the loop that form the gradients from the accumulators' sums
    outputs: list[Any]  # per loop output: the var (or Literal) holding its step-level value
    num_microbatches: int
    uses: dict[Var, int] = field(default_factory=dict)


def classify(body: ClosedJaxpr, num_mb_leaves: int) -> tuple[dict[Var, int], dict[Var, Any]]:
    """Status of every body var, and the defining equation of every constant var."""
    jaxpr = body.jaxpr
    status: dict[Var, int] = {v: CONST for v in jaxpr.constvars}
    for i, v in enumerate(jaxpr.invars):
        status[v] = VARYING if i < num_mb_leaves else INVARIANT
    defs: dict[Var, Any] = {}
    for e in jaxpr.eqns:
        ins = [status[v] for v in var_inputs(e)]
        s = max(ins, default=CONST)
        if e.primitive is pipeline_yield_p or e.effects:
            s = VARYING  # markers cut stages; effects (callbacks, prints) run once per microbatch as in the loop
        for v in e.outvars:
            status[v] = s
            if s == CONST:
                defs[v] = e
    return status, defs


def analyse(body: ClosedJaxpr, num_mb_leaves: int, num_grads: int, num_microbatches: int,
            operands: list[Any]) -> LoopBody:
    """`operands` are the loop equation's inputs beyond the batch leaves (outer vars or Literals), in the order
    of the body's inputs after the batch leaves."""
    jaxpr = body.jaxpr
    status, constant_defs = classify(body, num_mb_leaves)
    consts: dict[Var, Any] = dict(zip(jaxpr.constvars, body.consts))
    outer_of: dict[Var, Any] = {}
    for bv, ov in zip(jaxpr.invars[num_mb_leaves:], operands):
        if isinstance(ov, Literal):
            consts[bv] = ov.val
            status[bv] = CONST
        else:
            outer_of[bv] = ov
    mb_leaves = {v: i for i, v in enumerate(jaxpr.invars[:num_mb_leaves])}
    def eqn_status(e: Any) -> int:  # an equation without outputs (a debug print) has the status of what it reads
        if e.outvars:
            return status[e.outvars[0]]
        return VARYING if e.effects else max((status.get(v, CONST) for v in var_inputs(e)), default=CONST)

    varying = [e for e in jaxpr.eqns if eqn_status(e) == VARYING]
    hoisted = [e for e in jaxpr.eqns if e.outvars and eqn_status(e) == INVARIANT]
    uses: dict[Var, int] = defaultdict(int)
    for e in varying:
        for v in set(var_inputs(e)):
            uses[v] += 1
    for v in jaxpr.outvars:
        if isinstance(v, Var):
            uses[v] += 1
    m = num_microbatches
    producer = {v: e for e in varying for v in e.outvars}

    tail: list[Any] = []
    accumulators: list[Var] = []
    sunk: set[int] = set()

    def times_m(x: Any) -> Any:
        """A tail var holding x summed m times (x an invariant or constant var, or a Literal), added in x's
        dtype one microbatch at a time as the loop does (bool adds are `or`, ints wrap, a bf16 sum rounds
        every step); a float0 "gradient" (of an int leaf) is its zeros, as jax gives it."""
        aval = x.aval
        if aval.dtype == jax.dtypes.float0:
            return Literal(np.zeros(aval.shape, jax.dtypes.float0), aval)
        out = new_var(aval)
        if isinstance(x, Literal):
            val = x.val
            tail.append(SyntheticEqn(lambda: [repeated_sum(jnp.full(aval.shape, val, aval.dtype), m)], [], [out], "mpmd_times_m"))
        else:
            tail.append(SyntheticEqn(lambda v: [repeated_sum(v, m)], [x], [out], "mpmd_times_m"))
        return out

    def accumulate(v: Var) -> Var:
        """The var whose step-level value is the sum of v over the microbatches, pushing the sum inward
        (the equations that combine the parts join the tail; tail equations come after their inputs)."""
        e = producer.get(v)
        stack = e is not None and e.primitive.name in _SUM_THROUGH_STACK
        sinkable = (e is not None and (e.primitive.name in _SUM_THROUGH or stack) and uses[v] == 1 and len(e.outvars) == 1
                    and all(getattr(x, "aval", None) is not None and x.aval.dtype == v.aval.dtype
                            and (stack or x.aval.shape == v.aval.shape) for x in e.invars)
                    # a float part that does not vary (an L2 penalty's gradient) is added in the loop, as jax.jit adds
                    # it: summed apart (m * c after the loop) it would round differently (bf16: percent)
                    and (not jnp.issubdtype(v.aval.dtype, jnp.inexact)
                         or all(isinstance(x, Var) and status.get(x, CONST) == VARYING for x in e.invars)))
        if not sinkable:
            if v in mb_leaves:  # a microbatch slice itself: its sum is the batch leaf summed over axis 0
                out = new_var(v.aval)
                tail.append(SyntheticEqn(lambda x: [sequential_sum(x)], [v], [out], "mpmd_sum_leaf"))
                return out
            if v not in accumulators:
                accumulators.append(v)
            return v
        sunk.add(id(e))
        new_in = [times_m(x) if isinstance(x, Literal) or status.get(x, CONST) != VARYING else accumulate(x) for x in e.invars]
        tail.append(e if new_in == list(e.invars) else SyntheticEqn(_bind_fn(e), new_in, list(e.outvars), e.primitive.name))
        return v

    outputs: list[Any] = []
    stacked: list[tuple[Var, Var]] = []
    for j, v in enumerate(jaxpr.outvars):
        if j < num_grads:
            if isinstance(v, Literal) or status[v] != VARYING:
                outputs.append(times_m(v))
            else:
                outputs.append(accumulate(v))
        else:
            aval = v.aval
            if isinstance(v, Var) and v in mb_leaves:
                outputs.append(("leaf", mb_leaves[v]))  # the batch leaf itself
                continue
            out = new_var(aval.update(shape=(m, *aval.shape)))
            if isinstance(v, Literal) or status[v] != VARYING:
                src = [] if isinstance(v, Literal) else [v]
                val = v.val if isinstance(v, Literal) else None
                # (each lambda binds this leaf's value and aval now: a closure would read the loop's last ones)
                fn = (lambda val=val, aval=aval: [jnp.broadcast_to(jnp.asarray(val, aval.dtype), (m, *aval.shape))]
                      ) if val is not None else (lambda x: [jnp.broadcast_to(x, (m, *x.shape))])
                tail.append(SyntheticEqn(fn, src, [out], "mpmd_broadcast_aux"))
            else:
                stacked.append((v, out))
            outputs.append(out)
    outputs = _sum_stacked_gradients(accumulators, stacked, tail, outputs)
    eqns = [e for e in varying if id(e) not in sunk]
    return LoopBody(eqns, consts, mb_leaves, outer_of, status, constant_defs, hoisted, accumulators, stacked, tail, outputs,
                    m, dict(uses))


def _sum_stacked_gradients(accumulators: list[Var], stacked: list[tuple[Var, Var]], tail: list[Any],
                           outputs: list[Any]) -> list[Any]:
    """A value the microbatch function returns both to be summed (a gradient, or a part of one) and stacked
    (in the aux: `return grads, grads`, `return (grads, loss), loss`) is only stacked in the loop; its sum is
    the stacked value's sum over the microbatches, at the head of the tail (one accumulator has one mode).
    Takes and edits `accumulators` and `tail`; returns the outputs with the sums in place of the values."""
    sums: dict[Var, Var] = {}
    for v, out in stacked:
        if v in accumulators and v not in sums:
            accumulators.remove(v)
            sums[v] = new_var(v.aval)
            tail.insert(len(sums) - 1, SyntheticEqn(lambda x: [sequential_sum(x)], [out], [sums[v]], "mpmd_sum_stacked"))
    if not sums:
        return outputs
    tail[len(sums):] = substitute(tail[len(sums):], lambda x: sums.get(x, x))
    return [sums.get(o, o) if isinstance(o, Var) else o for o in outputs]


def sequential_sum(xs: Any) -> Any:
    """xs summed over axis 0 the way the loop sums a per-microbatch value: from zeros, one slice at a time, in
    xs's dtype (`jnp.sum` would widen bool and small ints and round a bf16 sum once)."""
    return jax.lax.scan(lambda acc, x: (acc + x, None), jnp.zeros(xs.shape[1:], xs.dtype), xs)[0]


def repeated_sum(x: Any, m: int) -> Any:
    """x added to zeros m times in its dtype, one add at a time (not `m * x`: see `sequential_sum`)."""
    return jax.lax.fori_loop(0, m, lambda _, acc: acc + x, jnp.zeros(x.shape, x.dtype))


def _bind_fn(eqn: Any) -> Any:
    from mpmd.compiler.eqns import bind_eqn

    return lambda *xs: bind_eqn(eqn, xs)


def constants_needed(eqns: list[Any], reads: list[Var], body: LoopBody) -> list[Any]:
    """The constant equations (transitively) that produce the constant vars in `reads`, in order."""
    need: list[Any] = []
    seen: set[int] = set()

    def visit(v: Any) -> None:
        e = body.constant_defs.get(v)
        if e is None or id(e) in seen:
            return
        seen.add(id(e))
        for u in var_inputs(e):
            visit(u)
        need.append(e)

    for v in reads:
        if is_var(v):
            visit(v)
    return need
