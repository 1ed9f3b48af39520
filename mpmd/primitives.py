"""The two primitives mpmd adds to JAX, each with all its rules in one place.

`pipeline_yield_p` marks a stage boundary. It is the identity everywhere (impl, lowering, batching); its
JVP marks the tangents too, and the transpose of a tangent marker is a marker with the opposite
direction, so the backward boundaries of every stage come out of autodiff by themselves.

`accumulate_p` is the microbatch loop, visible as one equation when `distributed` traces a step. Its
implementation (and lowering, for plain `jax.jit`) is an ordinary scan: sum the gradients, stack the aux.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

# ---- pipeline_yield ----------------------------------------------------------------------------------
pipeline_yield_p = Primitive("pipeline_yield")
pipeline_yield_p.multiple_results = True

FWD, BWD = "fwd", "bwd"


def _yield_impl(*xs: Any, direction: str) -> list[Any]:
    return list(xs)


def _yield_abstract_eval(*avals: Any, direction: str) -> list[Any]:
    return list(avals)


def _yield_jvp(primals: list[Any], tangents: list[Any], *, direction: str) -> tuple[list[Any], list[Any]]:
    out = pipeline_yield_p.bind(*primals, direction=direction)
    live = [i for i, t in enumerate(tangents) if not isinstance(t, ad.Zero)]
    marked = pipeline_yield_p.bind(*[tangents[i] for i in live], direction=direction) if live else []
    tangents_out = list(tangents)
    for i, t in zip(live, marked):
        tangents_out[i] = t
    return out, tangents_out


def _yield_transpose(cts: list[Any], *xs: Any, direction: str) -> list[Any]:
    live = [i for i, c in enumerate(cts) if not isinstance(c, ad.Zero)]
    flipped = BWD if direction == FWD else FWD
    marked = pipeline_yield_p.bind(*[cts[i] for i in live], direction=flipped) if live else []
    out: list[Any] = [ad.Zero(x.aval) if ad.is_undefined_primal(x) else None for x in xs]
    for i, c in zip(live, marked):
        out[i] = c
    return out


def _yield_batch(args: list[Any], dims: list[Any], *, direction: str) -> tuple[list[Any], list[Any]]:
    return pipeline_yield_p.bind(*args, direction=direction), list(dims)


pipeline_yield_p.def_impl(_yield_impl)
pipeline_yield_p.def_abstract_eval(_yield_abstract_eval)
ad.primitive_jvps[pipeline_yield_p] = _yield_jvp
ad.primitive_transposes[pipeline_yield_p] = _yield_transpose
batching.primitive_batchers[pipeline_yield_p] = _yield_batch
mlir.register_lowering(pipeline_yield_p, lambda ctx, *args, direction: list(args))


# ---- accumulate (the microbatch loop) ----------------------------------------------------------------
accumulate_p = Primitive("mpmd_accumulate")
accumulate_p.multiple_results = True


def _zeros_like_aval(aval: Any) -> Any:
    """Zeros of `aval`'s shape and dtype, and of its sharding where its type carries one (a mesh's Explicit axes:
    the scan's carry must keep the gradient's type, `float32[16,32@model]`)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jnp.zeros(aval.shape, aval.dtype)
    return jnp.zeros(aval.shape, aval.dtype, out_sharding=sharding)


def reference_loop(body: Any, num_grads: int, batch_leaves: list[Any], consts: list[Any]) -> list[Any]:
    """Sum the first `num_grads` outputs of `body` over microbatches and stack the rest (the meaning of
    `accumulate_grads`). `body` is a ClosedJaxpr taking (*microbatch leaves, *consts)."""

    grads = [v.aval for v in body.jaxpr.outvars[:num_grads]]
    summed = [i for i, a in enumerate(grads) if a.dtype != jax.dtypes.float0]  # (float0: an int leaf's "gradient", no data)

    def step(acc: list[Any], mb: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, *mb, *consts)
        return [a + outs[i] for a, i in zip(acc, summed)], outs[num_grads:]

    init = [_zeros_like_aval(grads[i]) for i in summed]
    acc, stacked = jax.lax.scan(step, init, batch_leaves)
    out = [np.zeros(a.shape, jax.dtypes.float0) for a in grads]
    for i, a in zip(summed, acc):
        out[i] = a
    return [*out, *stacked]


def _accumulate_impl(*args: Any, body: Any, num_mb_leaves: int, num_grads: int, num_microbatches: int, schedule: Any) -> list[Any]:
    return reference_loop(body, num_grads, list(args[:num_mb_leaves]), list(args[num_mb_leaves:]))


def _accumulate_abstract_eval(*avals: Any, body: Any, num_mb_leaves: int, num_grads: int, num_microbatches: int, schedule: Any) -> list[Any]:
    outs = [v.aval for v in body.jaxpr.outvars]
    avals = [*outs[:num_grads], *(a.update(shape=(num_microbatches, *a.shape)) for a in outs[num_grads:])]
    return avals, body.effects  # the body's callbacks (ordered ones need their token threaded through the loop)


def _reference_fn(body: Any, num_mb_leaves: int, num_grads: int) -> Any:
    return lambda *a: reference_loop(body, num_grads, list(a[:num_mb_leaves]), list(a[num_mb_leaves:]))


def _refuse_when_distributed(transform: str) -> None:
    """A PipelineError while `distributed` traces a step: the loop must reach the compiler as one equation."""
    if _DISTRIBUTED.get():
        from mpmd.errors import PipelineError

        raise PipelineError(f"{transform} of a function that calls mpmd.accumulate_grads cannot be pipelined: the step "
                            "must call the loop itself. Under mpmd.distributed, transform inside the microbatch function "
                            "(vmap / grad of the loss), or run the transformed step under plain jax.jit, where the loop "
                            "is an ordinary scan")


def _accumulate_batch(axis_data: Any, args: list[Any], dims: list[Any], *, body: Any, num_mb_leaves: int, num_grads: int,
                      num_microbatches: int, schedule: Any) -> tuple[list[Any], list[Any]]:
    """vmap of the loop (outside `distributed`): the vmapped scan it stands for, under the same axis (its name:
    a collective over it inside the microbatch function, e.g. `lax.pmean(g, "ensemble")`)."""
    _refuse_when_distributed("jax.vmap")
    outs = jax.vmap(_reference_fn(body, num_mb_leaves, num_grads), in_axes=list(dims), axis_name=axis_data.name,
                    axis_size=axis_data.size, spmd_axis_name=axis_data.spmd_name)(*args)
    return outs, [0] * len(outs)


def _accumulate_jvp(primals: list[Any], tangents: list[Any], *, body: Any, num_mb_leaves: int, num_grads: int,
                    num_microbatches: int, schedule: Any) -> tuple[list[Any], list[Any]]:
    """jvp (and so grad) of the loop (outside `distributed`): the jvp of the scan it stands for."""
    _refuse_when_distributed("jax.grad / jax.jvp (yours, or a library's: optax.lbfgs's line search, say, takes the "
                             "gradient of the value function it is given)")
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    outs, touts = jax.jvp(_reference_fn(body, num_mb_leaves, num_grads), list(primals), tangents)
    return list(outs), list(touts)


accumulate_p.def_impl(_accumulate_impl)
accumulate_p.def_effectful_abstract_eval(_accumulate_abstract_eval)
mlir.register_lowering(accumulate_p, mlir.lower_fun(_accumulate_impl, multiple_results=True))
batching.fancy_primitive_batchers[accumulate_p] = _accumulate_batch
ad.primitive_jvps[accumulate_p] = _accumulate_jvp

_DISTRIBUTED: contextvars.ContextVar[bool] = contextvars.ContextVar("mpmd_tracing_distributed", default=False)


@contextlib.contextmanager
def tracing_distributed() -> Iterator[None]:
    """While active, `distributed` is tracing a step: vmap or jvp of its loop is refused (see above)."""
    token = _DISTRIBUTED.set(True)
    try:
        yield
    finally:
        _DISTRIBUTED.reset(token)
