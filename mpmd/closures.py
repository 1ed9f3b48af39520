"""flax nnx Modules that a microbatch function closes over, made anew inside its own trace.

`accumulate_grads` traces the microbatch function on its own (once, for every microbatch), a trace level
below the step's. flax nnx refuses to extract a graph node (a Module, an Optimizer, Rngs) made at another
level ("Cannot extract graph node from different trace level"), so the way nnx users write a step —

    def train_step(model, optimizer, batch):
        def mb_grads(mb):
            loss, grads = nnx.value_and_grad(loss_fn)(model, mb)
            return grads, loss
        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=...)
        optimizer.update(model, grads)
        return model, optimizer, losses

— would fail under plain `jax.jit` as well as `distributed`. `lifted(fn)` returns `fn` with each closure cell
(of `fn`, or of a helper function it closes over) that holds nnx graph nodes (alone, or in a tuple, list or
dict) split outside the trace and merged into fresh
copies inside it, whose state values are the outer ones (so gradients and the pipeline see them as ordinary
closed-over values). The body runs once for every microbatch, so state it mutates (an `Rngs` counter, batch
statistics) could not carry from one microbatch to the next: that is refused, naming the variable. Nothing is
imported from flax unless flax is already imported.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax

from mpmd.errors import PipelineError


def _nnx() -> Any:
    flax = sys.modules.get("flax")
    if flax is None:
        return None
    try:
        from flax import nnx
    except Exception:  # an old flax without nnx: nothing of it can be closed over
        return None
    return nnx


def _graph_cells(fn: Callable[..., Any], nnx: Any, seen: set[int] | None = None, depth: int = 3) -> list[tuple[Any, Any]]:
    """(cell, contents) for each closure cell holding nnx graph nodes, of `fn` and of the functions it closes
    over (a helper defined beside it), `depth` levels down."""
    seen = set() if seen is None else seen
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        if id(cell) in seen:
            continue
        seen.add(id(cell))
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing function)
            continue
        if isinstance(value, types.FunctionType):
            if depth > 1:
                cells += _graph_cells(value, nnx, seen, depth - 1)
            continue
        nodes = jax.tree.leaves(value, is_leaf=nnx.graph.is_graph_node) if isinstance(value, (tuple, list, dict)) else [value]
        if any(nnx.graph.is_graph_node(n) for n in nodes):
            cells.append((cell, value))
    return cells


@contextmanager
def lifted(fn: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """`fn`, whose closed-over nnx graph nodes are re-made in whatever trace calls it (see the module
    docstring); the cells hold the original objects again when the block ends."""
    nnx = _nnx()
    cells = _graph_cells(fn, nnx) if nnx is not None else []
    if not cells:
        yield fn
        return
    split = [(cell, value, jax.tree.map(lambda n: nnx.split(n) if nnx.graph.is_graph_node(n) else n, value,
                                        is_leaf=nnx.graph.is_graph_node)) for cell, value in cells]

    def run(*args: Any, **kwargs: Any) -> Any:
        made = []
        for cell, _, parts in split:
            def merge(n: Any) -> Any:
                if isinstance(n, tuple) and len(n) == 2 and isinstance(n[0], nnx.graph.GraphDef):
                    node = nnx.merge(n[0], n[1], copy=True)
                    made.append((node, n[1]))
                    return node
                return n
            cell.cell_contents = jax.tree.map(merge, parts, is_leaf=lambda n: isinstance(n, tuple) and len(n) == 2
                                              and isinstance(n[0], nnx.graph.GraphDef))
        out = fn(*args, **kwargs)
        for node, state in made:
            _refuse_mutation(nnx, node, state)
        return out

    try:
        yield run
    finally:
        for cell, value, _ in split:
            cell.cell_contents = value


def _refuse_mutation(nnx: Any, node: Any, state: Any) -> None:
    before = dict(nnx.to_flat_state(state))
    after = dict(nnx.to_flat_state(nnx.state(node)))
    for path, var in after.items():
        old = before.get(path)
        new_value = var.get_value() if hasattr(var, "get_value") else var.value
        old_value = None if old is None else (old.get_value() if hasattr(old, "get_value") else old.value)
        if old is None or new_value is not old_value:
            where = ".".join(str(p) for p in path)
            raise PipelineError(
                f"the function given to accumulate_grads changes the nnx state {type(node).__name__}.{where} "
                f"({type(var).__name__}) of a Module it closes over. It runs once for every microbatch as one "
                "traced body, so a change (an Rngs counter, batch statistics) cannot carry from one microbatch to "
                "the next. Keep state changes outside accumulate_grads, or pass what changes per microbatch in the "
                "batch (e.g. a PRNG key per microbatch, with nnx.Rngs made from it inside the loss).")
