"""Data loaded where it is read: each actor calls a named loader function for the batch leaves its stages read.

    # mydata.py, importable on every actor's host:
    def load(step: int, leaf: str) -> np.ndarray:     # leaf: "x", "y", ... (the leaf's path in the batch)
        return np.load(f"/data/{leaf}/{step:06d}.npy")

    mesh = mpmd.RemoteMesh.local(2, loaders=["mydata:load"])   # daemons: mpmd-actor --allow-loader mydata:load
    batch = mpmd.loaded_by_actors("mydata:load", {"x": jax.ShapeDtypeStruct((8, 32, 512), np.float32),
                                                  "y": jax.ShapeDtypeStruct((8, 32, 512), np.float32)})
    for k in range(steps):
        params, opt_state, loss = train_step(params, opt_state, batch)   # call k loads step k on the actors

In place of host arrays, a step takes `LoadedLeaf`s: a function name, the leaf's name, its shape and dtype.
Only that (and the step number, which counts the calls of the distributed function) crosses the control
plane; each actor whose Programs read a leaf imports the function by name — never unpickles anything — and
calls ``fn(step, leaf)`` in a worker thread while its previous step still runs. A daemon calls only the
functions on its ``--allow-loader`` list (a local mesh passes `loaders=`), and checks what comes back
against the declared shape and dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from transport.protocol import LOADER_NAME as _NAME
from transport.protocol import leaf_name_problem


@dataclass(frozen=True)
class LoadedLeaf:
    """One batch leaf an actor loads itself: ``fn(step, name)`` must return a `dtype` array of `shape`, a fresh
    one each call (on CPU an aligned array is used in place, without a copy)."""

    fn: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def wire(self) -> dict[str, Any]:
        from transport.protocol import dtype_name

        return {"fn": self.fn, "name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype)}


def check_loader_name(fn: str) -> str:
    """`fn` if it names a function as "package.module:function"; ValueError otherwise."""
    if not isinstance(fn, str) or not _NAME.match(fn):
        raise ValueError(f"a loader is named 'package.module:function', got {fn!r}")
    if fn.split(":", 1)[0] == "__main__":  # (the daemon's __main__ is its own module: a probe got "no 'load'" in daemon.py)
        raise ValueError(f"a loader cannot be named {fn!r}: an actor's __main__ is the daemon, not your script. Put the "
                         "function in a module the actors can import (e.g. mydata.py beside your script: 'mydata:load')")
    return fn


def check_loader_names(loaders: Any) -> tuple[str, ...]:
    """A mesh's `loaders=`: a list of names (each checked); a single string is refused, not read letter by letter."""
    if isinstance(loaders, (str, bytes)):
        raise ValueError(f"loaders= is a list of 'package.module:function' names; got the string {loaders!r:.80}: pass "
                         f"[{loaders!r:.80}]")
    if not isinstance(loaders, (list, tuple)):  # (5 met a bare "'int' object is not iterable"; a probe)
        raise TypeError(f"loaders= is a list of 'package.module:function' names, got {type(loaders).__name__} {loaders!r:.80}")
    return tuple(check_loader_name(fn) for fn in loaders)


def leaf_name(path: Any) -> str:
    """A pytree key path as a loader's leaf name: its keys joined by dots ("x", "inputs.0"); "" for no keys.
    ValueError for one that could leave a loader's directory (a key "../x": `leaf_name_problem`)."""
    name = ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    problem = leaf_name_problem(name)
    if problem:
        raise ValueError(f"loaded_by_actors: {problem}")
    return name


def loaded_by_actors(fn: str, spec: Any) -> Any:
    """A pytree like `spec` (of `jax.ShapeDtypeStruct` or arrays, for their shape and dtype) whose leaves the
    actors load themselves with the function `fn` ("module:function"); pass it where the step takes its batch.
    A leaf's name is its path in the batch joined by dots ("x", "inputs.0"): the step names each leaf by where
    it finds it in its argument (`named_in_argument`), so ``{"x": loaded_by_actors(fn, s), "y": ...}`` loads
    "x" and "y"; until then, and for a leaf that is the whole argument, by its path in `spec` ("batch" if none)."""
    check_loader_name(fn)
    flat, treedef = jax.tree_util.tree_flatten_with_path(spec)
    leaves = []
    for path, leaf in flat:
        name = leaf_name(path) or "batch"
        try:
            # (its dtype as jax.jit takes an array of it: float64 is float32 unless x64 is on)
            shape, dtype = tuple(int(d) for d in leaf.shape), np.dtype(jax.dtypes.canonicalize_dtype(leaf.dtype))
        except (AttributeError, TypeError, ValueError):
            shape = dtype = None
        if dtype is None or getattr(leaf, "dtype", None) is None:
            raise TypeError(f"loaded_by_actors: spec leaf {name!r} is {leaf!r:.60} ({type(leaf).__name__}), which has no "
                            "shape and dtype: pass a jax.ShapeDtypeStruct (e.g. jax.ShapeDtypeStruct((8, 32), np.float32)) "
                            "or an array of the leaf's shape and dtype (a list or tuple in the spec is a node: its "
                            "elements are the leaves)")
        leaves.append(LoadedLeaf(fn, name, shape, dtype))
    return jax.tree.unflatten(treedef, leaves)


def named_in_argument(leaf: LoadedLeaf, path: Any) -> LoadedLeaf:
    """`leaf` named by `path`, its key path in the step's argument tuple: the keys after the argument's
    position, joined by dots — the leaf's path in the batch; unchanged when it is the whole argument."""
    name = leaf_name(tuple(path)[1:])
    return leaf if not name or name == leaf.name else dataclasses.replace(leaf, name=name)


__all__ = ["LoadedLeaf", "check_loader_name", "check_loader_names", "leaf_name", "loaded_by_actors", "named_in_argument"]
