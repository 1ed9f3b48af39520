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

— would fail under plain `jax.jit` as well as `distributed`. `lifted(fn)` gives `fn` as a `Lifted`: the
contents of every closure cell (of `fn`, or of a helper function it closes over) that holds nnx graph nodes
(alone, or in a tuple, list or dict) are split together outside the trace and merged once inside it, into
copies whose state values are the outer ones (so gradients and the pipeline see ordinary closed-over values,
and a Module reached from two cells stays one object). While the body is traced the cells hold the copies:
tracing the same step from two threads at once is not supported (nor is it by nnx). `nnx.Rngs` streams
(Dropout's) draw in each microbatch from their key folded with the count and the microbatch's index, and move
on by one count per step (see `Lifted`). The body runs once for every microbatch, so other state it changes
(batch statistics) could not carry from one microbatch to the next: that is refused, naming the variable.
Nothing is imported from flax unless flax is already imported.
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


def _graph_cells(fn: Callable[..., Any], nnx: Any, seen: set[int] | None = None, depth: int = 3) -> list[tuple[Any, Any, str]]:
    """(cell, contents, name) for each closure cell holding nnx graph nodes, of `fn` and of the functions it
    closes over (a helper defined beside it), `depth` levels down."""
    seen = set() if seen is None else seen
    cells = []
    code = getattr(fn, "__code__", None)
    names = code.co_freevars if code is not None else ()
    for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
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
        # (a Variable alone is read across trace levels without complaint: it stays as it is)
        if any(nnx.graph.is_graph_node(n) and not isinstance(n, nnx.Variable) for n in nodes):
            cells.append((cell, value, names[i] if i < len(names) else f"<closure {i}>"))
    return cells


class Lifted:
    """The microbatch function with its closed-over nnx graph nodes re-made in the trace that calls it.

    `uses_rngs`: the nodes hold `nnx.Rngs` streams. Then the body takes the microbatch's index as well
    (`call(mb, index)`) and draws, in microbatch i, from the stream's key folded with its count and then
    with i (the count starting at 0), so every microbatch of every step draws its own numbers; `advance()`,
    called in the step's trace once the body is traced, moves each stream's count on by one (the step must
    return the Module, as under jax.jit, for that to last)."""

    def __init__(self, fn: Callable[..., Any], nnx: Any, cells: list[tuple[Any, Any, str]]) -> None:
        self.fn, self._nnx, self._cells = fn, nnx, cells
        # One split of every cell's contents together: a Module reached from two cells (`model` and
        # `sub = model.block`) stays one object in the body, as it is outside (same Rngs draws, same state).
        self._parts = nnx.split(tuple(value for _, value, _ in cells)) if cells else None
        self._outer_streams = _streams(nnx, tuple(value for _, value, _ in cells)) if cells else []
        self.uses_rngs = bool(self._outer_streams)

    def call(self, mb: Any, index: Any = None) -> Any:
        if not self._cells:
            return self.fn(mb)
        nnx = self._nnx
        graphdef, state = self._parts
        made = nnx.merge(graphdef, state, copy=True)
        for (cell, _, _), value in zip(self._cells, made):
            cell.cell_contents = value
        if index is not None:
            for stream in _streams(nnx, made):
                stream.key[...] = _fold(stream.key[...], stream.count[...], index)
                stream.count[...] = jax.numpy.zeros_like(stream.count[...])
        out = self.fn(mb)
        _refuse_mutation(nnx, made, state, [name for _, _, name in self._cells])
        return out

    def advance(self) -> None:
        for stream in self._outer_streams:
            try:
                stream.count[...] += 1
            except Exception as e:
                if "trace level" not in str(e):
                    raise
                raise PipelineError(
                    f"the microbatch function draws from nnx.Rngs ('{stream.tag}') of a Module made outside the step "
                    "being traced, whose count cannot move on here, so every step would draw the same numbers. Pass "
                    "the Module to the step as an argument and return it, as under jax.jit "
                    f"(nnx said: {str(e).splitlines()[0]})") from e

    def restore(self) -> None:
        for cell, value, _ in self._cells:
            cell.cell_contents = value


def _fold(key: Any, count: Any, index: Any) -> Any:
    """A stream's key folded with its count, then with the microbatch `index`; a stacked stream (the keys of
    a layer stack made with nnx.split_rngs + nnx.vmap: one key and count per layer) key by key."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape:
        one = jax.vmap(lambda k, c: jax.random.fold_in(jax.random.fold_in(k, c), index))
        return one(key.reshape(-1), jax.numpy.broadcast_to(count, key.shape).reshape(-1)).reshape(key.shape)
    return jax.random.fold_in(jax.random.fold_in(key, count), index)


def _streams(nnx: Any, values: tuple[Any, ...]) -> list[Any]:
    """The nnx RngStreams reachable from `values` (graph nodes, alone or in tuples, lists or dicts), each once."""
    out, seen = [], set()
    for _, v in nnx.graph.iter_graph(values):
        if isinstance(v, nnx.RngStream) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


@contextmanager
def lifted(fn: Callable[..., Any]) -> Iterator[Lifted]:
    """`fn` as a `Lifted` (see the module docstring); the cells hold the original objects again when the
    block ends."""
    nnx = _nnx()
    body = Lifted(fn, nnx, _graph_cells(fn, nnx) if nnx is not None else [])
    try:
        yield body
    finally:
        body.restore()


def _refuse_mutation(nnx: Any, node: Any, state: Any, names: list[str]) -> None:
    before = dict(nnx.to_flat_state(state))
    after = dict(nnx.to_flat_state(nnx.state(node)))
    for path, var in after.items():
        # Rng state is set per microbatch by `Lifted.call`. Params are what the body differentiates: nnx.remat
        # and nnx.jit inside it write them back as new (equal) values, and a change would be dropped anyway.
        if isinstance(var, (nnx.RngKey, nnx.RngCount, nnx.Param)):
            continue
        old = before.get(path)
        if old is None or var.get_value() is not old.get_value():
            where = ".".join([names[path[0]], *(str(p) for p in path[1:])])
            raise PipelineError(
                f"the function given to accumulate_grads changes the nnx state {where} "
                f"({type(var).__name__}) of a Module it closes over. It runs once for every microbatch as one "
                "traced body, so a change (batch statistics, a counter) cannot carry from one microbatch to the "
                "next. Keep state changes outside accumulate_grads (e.g. BatchNorm with use_running_average=True "
                "inside, statistics updated after; or return each microbatch's new statistics in the aux output and "
                "average them after the loop, as flax linen's mutable=['batch_stats'] does), or pass what changes per "
                "microbatch in the batch. (nnx.remat or "
                "nnx.jit inside the body write all state back, changed or not: use jax.checkpoint there instead.)")
