"""Evaluating lists of jaxpr equations, and the small helpers every pass shares. Pure functions, no I/O.

The passes move equations between the loop body and the step (before or after the loop), and between
tasks; they never rebuild a JAX jaxpr. An equation list plus an environment (var -> value) is all an
executable needs: `eqns_fn` turns one into a Python function that `jax.export` then traces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var


def is_var(x: Any) -> bool:
    return isinstance(x, Var) and not is_drop(x)


def is_drop(v: Any) -> bool:
    return type(v).__name__ == "DropVar"


def var_inputs(eqn: Any) -> list[Var]:
    return [v for v in eqn.invars if isinstance(v, Var)]


def upstream(roots: Iterable[Any], producer: dict[Any, Any], stop: Callable[[Any], bool] = lambda e: False) -> set[int]:
    """The ids of the equations `roots` and of every equation they read from (`producer`: var -> equation),
    not entering (nor counting) an equation for which `stop(eqn)` holds."""
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        e = todo.pop()
        if id(e) in seen or stop(e):
            continue
        seen.add(id(e))
        todo.extend(producer[v] for v in var_inputs(e) if v in producer)
    return seen


def nbytes(v: Any) -> int:
    """Bytes of a value of `v`'s aval (typed keys count their key data)."""
    return aval_nbytes(v.aval)


def aval_nbytes(aval: Any) -> int:
    """Bytes of a value of `aval` (typed keys count their key data)."""
    from mpmd.compiler.avals import wire_shape_dtype

    shape, dtype = wire_shape_dtype(tuple(aval.shape), aval.dtype)
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


class _SyntheticPrimitive:
    def __init__(self, name: str) -> None:
        self.name = name
        self.multiple_results = True

    def __repr__(self) -> str:
        return self.name


@dataclass(eq=False)
class SyntheticEqn:
    """An equation the compiler makes up (e.g. "times the number of microbatches"): `fn(*invals) -> outs`.
    Placement passes see it like any equation (invars, outvars, primitive.name)."""

    fn: Callable[..., Sequence[Any]]
    invars: list[Any]
    outvars: list[Var]
    name: str = "mpmd_synthetic"
    effects: frozenset = frozenset()

    @property
    def primitive(self) -> _SyntheticPrimitive:
        return _SyntheticPrimitive(self.name)

    @property
    def params(self) -> dict[str, Any]:
        return {}


def new_var(aval: Any) -> Var:
    """A fresh variable of `aval` (for values the compiler introduces)."""
    from jax._src import core

    return core.Var(aval)


def substitute(eqns: list[Any], resolve: Callable[[Any], Any]) -> list[Any]:
    """The equations with every input var `v` replaced by `resolve(v)` (equations that read none unchanged)."""
    out = []
    for e in eqns:
        new_in = [resolve(v) if isinstance(v, Var) else v for v in e.invars]
        if new_in == list(e.invars):
            out.append(e)
        elif isinstance(e, SyntheticEqn):
            out.append(SyntheticEqn(e.fn, new_in, e.outvars, e.name))
        else:
            out.append(e.replace(invars=new_in))
    return out


def read(env: dict[Any, Any], x: Any) -> Any:
    return x.val if isinstance(x, Literal) else env[x]


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Apply one equation to values (tracers or arrays); always a list of outputs."""
    if isinstance(eqn, SyntheticEqn):
        return list(eqn.fn(*invals))
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # JAX < 0.8 returns (subfuns, params)
        subfuns, bind_params = bind_params
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def eval_eqns(eqns: Iterable[Any], env: dict[Any, Any]) -> None:
    for eqn in eqns:
        outs = bind_eqn(eqn, [read(env, x) for x in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            env[v] = o


def eqns_fn(eqns: Sequence[Any], inputs: Sequence[Var], outputs: Sequence[Any], consts: dict[Any, Any]) -> Callable[..., tuple]:
    """A function evaluating `eqns`: flat `inputs` values in, flat `outputs` values out."""
    eqns, inputs, outputs = list(eqns), list(inputs), list(outputs)

    def fn(*args: Any) -> tuple:
        env = dict(consts)
        env.update(zip(inputs, args))
        eval_eqns(eqns, env)
        return tuple(read(env, v) for v in outputs)

    return fn


def free_inputs(eqns: Sequence[Any], exclude: set[Any] = frozenset()) -> list[Var]:
    """Vars the equations read but do not define (first-read order), minus `exclude`."""
    own: set[Any] = set()
    seen: set[Any] = set()
    out: list[Var] = []
    for e in eqns:
        for v in var_inputs(e):
            if v not in own and v not in seen and v not in exclude:
                seen.add(v)
                out.append(v)
        own.update(e.outvars)
    return out


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs nested in an equation's params (branches, bodies, called functions)."""
    out = []
    for p in eqn.params.values() if not isinstance(eqn, SyntheticEqn) else ():
        items = p if isinstance(p, (tuple, list)) else [p]
        for it in items:
            if isinstance(it, ClosedJaxpr):
                out.append(it.jaxpr)
            elif type(it).__name__ == "Jaxpr":
                out.append(it)
    return out


def contains_primitive(jaxpr: Any, prim: Any) -> bool:
    for e in jaxpr.eqns:
        if e.primitive is prim or any(contains_primitive(j, prim) for j in sub_jaxprs(e)):
            return True
    return False


def spec_of(v: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(v.aval.shape), v.aval.dtype)
