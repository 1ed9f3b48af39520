"""The user-facing pipeline API: `pipeline_yield`, `accumulate_grads`, `distributed`."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from mpmd.closures import Lifted, lifted
from mpmd.errors import PipelineError
from mpmd.primitives import FWD, accumulate_p, pipeline_yield_p
from mpmd.schedules.builtin import Schedule, not_a_schedule
from mpmd.schedules.override import note_loop, schedule_override
from mpmd.step import DistributedFunction, eager  # at import, not at the first `distributed`: importing it holds the GIL ~1 s


def pipeline_yield(x: Any) -> Any:
    """Mark the end of a pipeline stage: everything computed before (since the previous marker) is one
    stage, everything after is the next. The identity under `jit`, `grad`, `vmap`; works on pytrees.

        x = block(params[0], x)
        x = mpmd.pipeline_yield(x)   # stage 0 ends here
        x = block(params[1], x)
    """
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        raise PipelineError("pipeline_yield got an empty pytree; pass the activations that flow to the next stage")
    if not any(isinstance(v, jax.core.Tracer) for v in leaves) and eager(unknown=False):
        return x  # called eagerly: the identity, the very object (binding would turn a Python 3 into a jax literal)
    return jax.tree.unflatten(treedef, pipeline_yield_p.bind(*leaves, direction=FWD))


def accumulate_grads(fn: Callable[[Any], tuple[Any, Any]], batch: Any, schedule: Schedule | None = None) -> tuple[Any, Any]:
    """Call `fn(microbatch) -> (grads, aux)` on each microbatch, sum the grads, stack the aux.

    Every leaf of `batch` has a leading microbatch axis of the same length. Outside `distributed` this is
    an ordinary loop (a `lax.scan`) with exactly that meaning, so the undecorated step is its own
    reference; inside `distributed`, `schedule` (e.g. `OneFOneB(num_stages=2)`) says how the stages of
    `fn`, cut at its `pipeline_yield` markers, run on the actors. A schedule set by
    `mpmd.schedules.override.use_schedule` (what `mpmd.tune` and `step.with_schedule` do) replaces it.
    """
    if not callable(fn):
        raise PipelineError(f"accumulate_grads(fn, batch, schedule=...): fn must be the per-microbatch function, got "
                            f"{type(fn).__name__} {fn!r:.80}")
    if schedule is not None and (hint := not_a_schedule(schedule)) is not None:
        raise PipelineError(f"accumulate_grads: schedule must be a schedule such as mpmd.OneFOneB(num_stages=2) "
                            f"(see mpmd.schedules), got {hint}")
    schedule = schedule_override() or schedule
    note_loop(schedule)
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves:
        raise PipelineError("accumulate_grads got an empty batch; pass arrays with a leading microbatch axis")
    sizes = {tuple(getattr(l, "shape", ()))[:1] for l in leaves}
    if any(len(s) == 0 for s in sizes):
        paths = jax.tree_util.tree_flatten_with_path(batch)[0]
        bad = [f"batch{jax.tree_util.keystr(k)}: {type(l).__name__ if not hasattr(l, 'shape') else 'shape ()'}"
               for k, l in paths if not tuple(getattr(l, "shape", ()))]
        in_lists = jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, (list, tuple)))
        lists = (" (a Python list in a batch is a pytree of its elements: pass np.asarray(the_list))"
                 if any(isinstance(x, (list, tuple)) for x in in_lists) else "")
        raise PipelineError(f"every batch leaf needs a leading microbatch axis; {len(bad)} of {len(leaves)} "
                            f"{'has' if len(bad) == 1 else 'have'} none ({', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}): "
                            f"pass constants by closure, not in the batch{lists}")
    if len(sizes) != 1:
        paths = jax.tree_util.tree_flatten_with_path(batch)[0]
        which = ", ".join(f"batch{jax.tree_util.keystr(k)}: {getattr(l, 'shape', ())[0]}" for k, l in paths[:8])
        raise PipelineError(f"batch leaves disagree on the number of microbatches (leading axis): {sorted(s[0] for s in sizes)} "
                            f"({which}{' ...' if len(paths) > 8 else ''}); give every leaf the same leading axis")
    m = next(iter(sizes))[0]
    if m < 1:
        raise PipelineError("the batch has 0 microbatches (its leaves' leading axis is 0): give at least one, shaped "
                            "[microbatches, rows per microbatch, ...], e.g. x.reshape(m, -1, *x.shape[1:])")
    mb_specs = [jax.ShapeDtypeStruct(l.shape[1:], l.dtype) for l in leaves]
    out_tree: list[Any] = []
    with lifted(fn) as lifted_fn:  # closed-over flax nnx Modules are re-made inside the body's own trace
        if lifted_fn.uses_rngs:  # their Rngs draw per microbatch: the body takes the microbatch's index too
            leaves = [*leaves, jax.numpy.arange(m, dtype=np.uint32)]  # (traced: made in the step, like any value)
            mb_specs = [*mb_specs, jax.ShapeDtypeStruct((), np.uint32)]
        closed = _trace_body(lifted_fn, treedef, mb_specs, out_tree)
        lifted_fn.advance()
    body, consts = _close_over_inputs(closed)
    g_tree, aux_tree, n_grads = out_tree[-1]
    outs = accumulate_p.bind(*leaves, *consts, body=body, num_mb_leaves=len(leaves), num_grads=n_grads,
                             num_microbatches=m, schedule=schedule)
    return jax.tree.unflatten(g_tree, outs[:n_grads]), jax.tree.unflatten(aux_tree, outs[n_grads:])


def _check_returned(out: tuple[Any, Any], fn: Lifted) -> None:
    """A PipelineError naming the leaf of (grads, aux) that is no array or number (a str in the aux failed as JAX's
    'function flat_fn at mpmd/api.py:95 ... returned a value of type str at output component [3]': a probe)."""
    for part, tree in (("grads", out[0]), ("aux", out[1])):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not (isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)) or hasattr(x, "__jax_array__")):
                _refuse_returned(fn, f"{part}{jax.tree_util.keystr(path)}", x)


def _refuse_returned(fn: Lifted, where: str, x: Any) -> None:
    name = getattr(getattr(fn, "fn", None), "__name__", "the function")
    name = f" ({name})" if name not in ("<lambda>", "the function") else ""
    raise PipelineError(f"the function given to accumulate_grads{name} returned {x!r:.60} ({type(x).__name__}) at {where}: "
                        "it returns (grads, aux), pytrees of arrays and numbers (as a function under jax.jit does); return "
                        "it some other way, or compute it from arrays")


def _trace_body(fn: Lifted, treedef: Any, mb_specs: list[Any], out_tree: list[Any]) -> ClosedJaxpr:
    """The microbatch function as a jaxpr over the flat microbatch leaves (and the microbatch's index, last,
    when `fn.uses_rngs`); appends its output trees to `out_tree`."""

    def flat_fn(*mb_leaves: Any) -> list[Any]:
        if fn.uses_rngs:
            out = fn.call(jax.tree.unflatten(treedef, mb_leaves[:-1]), mb_leaves[-1])
        else:
            out = fn.call(jax.tree.unflatten(treedef, mb_leaves))
        if not isinstance(out, tuple) or len(out) != 2:
            raise PipelineError(f"the function given to accumulate_grads must return (grads, aux); got {type(out).__name__}")
        g, aux = jax.tree.flatten(out[0]), jax.tree.flatten(out[1])
        _check_returned(out, fn)
        out_tree.append((g[1], aux[1], len(g[0])))
        return [*g[0], *aux[0]]

    try:
        return jax.make_jaxpr(flat_fn)(*mb_specs)
    except Exception as e:  # nnx raises ValueError or flax.errors.TraceContextError (a mutation), naming the level
        if "different trace level" not in str(e):
            raise
        if "Rng" in str(e).split("different trace level")[0]:  # "Cannot mutate RngCount from a different trace level"
            # Rngs state split off outside and merged inside the loss: a Dropout there advances a count that
            # belongs to the outer trace (jax.lax.scan raises the same).
            raise PipelineError(
                "the function given to accumulate_grads advances a flax nnx Rngs stream (a Dropout, or rngs() "
                "called) whose state was made outside it: nnx.merge(graphdef, params, rest) inside the loss with "
                "`rest` (holding the RngCount) from an nnx.split outside, and nnx refuses to mutate it from the "
                "microbatch function's own trace. Close over the Module and take its gradient with nnx "
                "(`def mb(mb): return nnx.value_and_grad(loss)(model, mb)[::-1]`: nnx carries the count), or give "
                "the Dropout its key per call from the microbatch (`self.drop(x, rngs=nnx.Rngs(dropout=key))`, say "
                f"with `key = jax.random.fold_in(base, mb['index'])`). nnx said: {str(e).splitlines()[0]}") from e
        written = re.search(r"Cannot mutate (\w+) from a different trace level", str(e))
        if written:  # e.g. "Cannot mutate BatchStat from a different trace level"
            # State split off outside and merged inside the loss without copy=True: nnx.merge reuses the outer
            # Variables, and a BatchNorm in training mode (or any Variable written) mutates them (a probe).
            raise PipelineError(
                f"the function given to accumulate_grads writes a flax nnx {written.group(1)} "
                "whose Variable belongs to state made outside it: nnx.merge(graphdef, params, state) reuses the "
                "Variables it is given (they live in the outer trace) and nnx refuses to write them from the microbatch "
                "function's own trace. Merge copies inside the loss: `nnx.merge(graphdef, params, state, copy=True)`, "
                "and return the new state (`nnx.state(model, nnx.BatchStat)`) as aux; or close over the Module and "
                f"take its gradient with nnx. nnx said: {str(e).splitlines()[0]}") from e
        # A Module reached other than through a closure cell (a global, an attribute of self, a partial, a
        # closure more than 3 functions deep): nnx refuses graph nodes made outside the body's own trace.
        raise PipelineError(
            "the function given to accumulate_grads uses a flax nnx Module made outside it that it does not close "
            "over (it reaches it through a global, an attribute of `self`, functools.partial, or a closure more "
            "than 3 functions deep), and nnx refuses graph nodes from another trace level (the microbatch function "
            "is traced on its own). Close over the Module in the function itself "
            "(`def mb(mb): return nnx.value_and_grad(loss)(model, mb)[::-1]`), or pass its state functionally: "
            "`graphdef, params = nnx.split(model, nnx.Param)` outside, `nnx.merge(graphdef, params)` inside the "
            f"loss (as examples/gpt.py does). nnx said: {str(e).splitlines()[0]}") from e


def _close_over_inputs(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """Turn every traced value the function closes over (of any dtype: floats, ints, bools, typed keys —
    `jax.closure_convert` hoists only floats) into an explicit input after the microbatch leaves; concrete
    constants stay constants. Returns the body and the values to pass for those inputs."""
    from jax.core import Tracer

    jaxpr = closed.jaxpr
    traced = [isinstance(c, Tracer) for c in closed.consts]
    keep_vars = [v for v, t in zip(jaxpr.constvars, traced) if not t]
    keep_vals = [c for c, t in zip(closed.consts, traced) if not t]
    lifted_vars = [v for v, t in zip(jaxpr.constvars, traced) if t]
    lifted_vals = [c for c, t in zip(closed.consts, traced) if t]
    body = jaxpr.replace(constvars=keep_vars, invars=[*jaxpr.invars, *lifted_vars])
    return ClosedJaxpr(body, keep_vals), lifted_vals


def distributed(fn: Callable[..., Any] | None = None, *, mesh: Any, in_shardings: Any = None, out_shardings: Any = None,
                static_argnums: Any = (), static_argnames: Any = (), donate_argnums: Any = (), donate_argnames: Any = ()) -> Any:
    """Decorator: run a training step as an MPMD pipeline on `mesh`'s actors.

    The step must call `accumulate_grads` once, with a schedule. It is traced once per input signature
    and compiled into one Program per actor; each call then sends one request per actor and returns
    `RemoteArray`s at once (parameters and optimizer state stay on the actors and can be passed straight back).

    With multi-device actors, `in_shardings` / `out_shardings` are pytrees (prefixes of the arguments /
    outputs) of `PartitionSpec` over the actor mesh's axis names, or None (replicated, or the layout the
    array already has), like jax.jit's; `with_sharding_constraint(x, PartitionSpec(...))` inside the step
    refers to the actor mesh too. Every stage task is compiled for its inputs' layouts, so XLA inserts the
    collectives jax.jit would.

    `static_argnums` / `static_argnames` are jax.jit's: those arguments (hashable) key the compile cache and
    reach the step as Python values. Functions and strings among the arguments, and every non-array leaf of an
    equinox Module (as under `eqx.filter_jit`), are static without being named.

    `donate_argnums` / `donate_argnames` are jax.jit's too: the RemoteArrays passed there are deleted once the
    step is dispatched (their actor memory freed behind it), so `params, opt_state = step(params, opt_state,
    batch)` holds one copy of the state; reading a donated array again raises.

        @mpmd.distributed(mesh=mesh)
        def train_step(params, opt_state, batch): ...
    """
    if fn is None:
        return lambda f: DistributedFunction(f, mesh, in_shardings, out_shardings, static_argnums, static_argnames,
                                             donate_argnums, donate_argnames)
    return DistributedFunction(fn, mesh, in_shardings, out_shardings, static_argnums, static_argnames, donate_argnums, donate_argnames)
