"""Where each array of a checkpoint goes when it is restored onto a mesh — which need not be the mesh that saved
it (another number of actors, another schedule or stage -> actor map, another device mesh per actor).

The answer, per leaf, in this order:
  1. `for_step=step`: the actors the compiled step reads that argument on, in the layout it was compiled for
     (its `in_shardings`, or the layout its arguments had);
  2. a `like` leaf that is a RemoteArray of the same mesh (e.g. a fresh init on the new mesh): its actors and
     its layout;
  3. otherwise the actors that held it when it was saved, when the mesh has them, in its saved layout when that
     fits the new actors' device mesh (else replicated over their devices); a host leaf stays on the host.
A leaf with no answer (it lived on actor 3, the mesh has 2) is a CheckpointError saying what to pass.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from mpmd.compiler.avals import dtype_text, is_key
from mpmd.errors import CheckpointError, MpmdError, callers_level
from mpmd.runtime.array import RemoteArray
from mpmd.runtime.checkpoint_format import HOST_PART, Leaf
from mpmd.runtime.sharding import Layout, as_layout, layout_from_wire


@dataclass(frozen=True)
class Target:
    """Where one leaf is restored: on `actors` laid out as `layout` (None: actors with one device each), or on
    the host when `actors` is empty."""

    actors: tuple[int, ...]
    layout: Layout | None


def like_shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype a `like` leaf stands for: a RemoteArray, jax or numpy array, ShapeDtypeStruct or
    Python scalar."""
    if isinstance(x, (RemoteArray, jax.ShapeDtypeStruct)) or hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(int(d) for d in x.shape), x.dtype
    a = np.asarray(x)
    return tuple(a.shape), a.dtype


def dtype_matches(like: Any, leaf: Leaf, weak: bool = False) -> bool:
    """Whether a `like` dtype is the saved one: equal, or what JAX makes of it (a float64 host array is float32
    to a step without x64, and so is the saved value it produced). Never a cast of another precision. `weak`: the
    `like` leaf is weakly typed (a Python number, or what a step makes of one): a saved Python number (a 0-d
    int64 / float64) matches the dtype JAX gives it."""
    if is_key(like) or leaf.key_impl:
        return dtype_text(like) == leaf.dtype
    like = np.dtype(like)
    if like.name == leaf.dtype:
        return True
    try:
        if weak and leaf.shape == () and np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(leaf.dtype))) == like:
            return True
        return np.dtype(jax.dtypes.canonicalize_dtype(like)).name == leaf.dtype
    except TypeError:
        return False


def _prefixes(arg_paths: list[str]) -> list[str]:
    """What a saved tree may be of a step's arguments: its leading arguments as a tuple ("args"), or one of them."""
    count = 1 + max((int(p[5:p.index("]")]) for p in arg_paths if p.startswith("args[")), default=-1)
    return ["args", *(f"args[{i}]" for i in range(count))]


def step_homes(step: Any, mesh: Any, paths: list[str], shapes: list[tuple[int, ...]]) -> list[Target | None]:
    """Per `like` leaf (its path in the saved tree, a keystr), where the compiled `step` reads that argument: a
    Target, or None for a leaf the step does not read. The saved tree is the step's leading arguments (saved as
    a tuple) or one of its arguments (saved alone: `mpmd.save(path, state)` for `step(state, batch)`)."""
    if not hasattr(step, "mesh") or not hasattr(step, "_compiled"):  # (a str was told it was "of another mesh"; a probe)
        raise CheckpointError(f"for_step must be a step made with mpmd.distributed (compiled for the arguments restored), "
                              f"got {type(step).__name__} {step!r:.60}")
    if getattr(step, "mesh", None) is not mesh:
        raise CheckpointError(f"for_step={step!r:.80} is a distributed step of another mesh than the one restored into; pass the "
                              "step made with mpmd.distributed(..., mesh=mesh) for this mesh")
    compiled = list(getattr(step, "_compiled", {}).items())
    for sig, c in reversed(compiled):  # the latest signature whose arguments these leaves are
        index = {p: k for k, p in enumerate(c.arg_paths)}
        for prefix in _prefixes(c.arg_paths):
            full = [prefix + p for p in paths]
            if not all(p in index and tuple(sig[1][index[p]][0]) == s for p, s in zip(full, shapes)):
                continue
            out: list[Target | None] = []
            for p in full:
                k = index[p]
                homes = tuple(sorted(c.plan.arg_homes[k]))
                layout = c.plan.layouts.get(c.plan.arg_keys[k]) if mesh.actor_mesh is not None else None
                out.append(Target(homes, layout if layout is not None or mesh.actor_mesh is None else ()) if homes else None)
            return out
    name = getattr(step, "__name__", "the step")
    saved = f"{paths[:3]}{'...' if len(paths) > 3 else ''}"
    how = ("The checkpoint must hold the step's leading arguments as a tuple (mpmd.save(path, (arg0, arg1, ...))) or one of "
           "its arguments as it is (mpmd.save(path, arg0))")
    if not compiled:
        raise CheckpointError(f"for_step: {name} is not compiled yet; call step.compile(*args) (host arrays of the right shapes "
                              f"will do) or run it once first. {how}")
    args = compiled[-1][1].arg_paths
    raise CheckpointError(f"for_step: the saved leaves {saved} (with their shapes) are not arguments of {name} as it is compiled "
                          f"(its argument leaves: {args[:3]}{'...' if len(args) > 3 else ''}). {how}; a tree saved another way "
                          "(a dict of params and opt_state, say) restores without for_step: where like's RemoteArrays of this "
                          "mesh live, else on the actors that saved it")


def targets(leaves: list[Leaf], like: list[Any], mesh: Any, for_step: Any = None, checkpoint: str | None = None) -> list[Target]:
    """Per saved leaf, where it is restored (see the module docstring). `like` RemoteArrays of another mesh say
    nothing of where to put a leaf here: without `for_step`, that is warned of (they were taken silently for this
    mesh's and ignored; a probe). A deleted one of this mesh (the state a failed or donated step took, restored
    from a checkpoint as that error says) leaves its leaf where it was saved, as a host leaf does."""
    am = mesh.actor_mesh
    from_step: list[Target | None] = [None] * len(leaves)
    if for_step is not None:
        paths = [leaf.path for leaf in leaves]
        from_step = step_homes(for_step, mesh, paths, [leaf.shape for leaf in leaves])
    out = []
    elsewhere: list[str] = []
    for leaf, x, t in zip(leaves, like, from_step):
        if t is not None:
            out.append(t)
        elif isinstance(x, RemoteArray) and x.mesh is mesh and not x.is_deleted():
            held = x.sharding.layout if x.sharding is not None else (() if am is not None else None)
            out.append(Target(tuple(x.actors), held))
        elif leaf.part == HOST_PART:
            out.append(Target((), None))
        else:
            if isinstance(x, RemoteArray) and x.mesh is not mesh and for_step is None:
                elsewhere.append(leaf.path)
            if max(leaf.saved_actors) >= len(mesh):
                raise CheckpointError(
                    f"mpmd.restore: checkpoint {checkpoint}: leaf {leaf.path} was saved from actors {list(leaf.saved_actors)}, "
                    f"but this mesh has {len(mesh)} actors, so mpmd cannot guess where it goes: pass for_step=step (the "
                    "compiled step that will read it) or like= a tree of RemoteArrays on this mesh (e.g. a fresh init) whose "
                    "placement says where each leaf goes"
                    + (" (like's are of another mesh)" if isinstance(x, RemoteArray) and x.mesh is not mesh else ""),
                    checkpoint=checkpoint, leaf=leaf.path)
            out.append(Target(leaf.saved_actors, _saved_layout(leaf, am)))
    if elsewhere:
        warnings.warn(f"mpmd.restore: checkpoint {checkpoint}: like's RemoteArrays at {elsewhere[:3]}"
                      f"{' ...' if len(elsewhere) > 3 else ''} are of another mesh, so they say nothing of where those leaves go "
                      "here: each goes back to the actors that saved it; pass for_step=step, or like= RemoteArrays of this mesh",
                      stacklevel=callers_level())
    return out


def _saved_layout(leaf: Leaf, am: Any) -> Layout | None:
    if am is None:
        return None
    if leaf.saved_layout is None:
        return ()
    try:
        layout = layout_from_wire(leaf.saved_layout)
        am.check_spec(jax.sharding.PartitionSpec(*layout), leaf.shape, f"leaf {leaf.path}")
    except (MpmdError, ValueError):
        return ()  # that layout names axes these actors lack (or does not divide): replicated here
    return as_layout(jax.sharding.PartitionSpec(*layout))


__all__ = ["Target", "dtype_matches", "like_shape_dtype", "targets"]
