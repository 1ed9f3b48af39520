"""How arrays are laid out over an actor's own devices (SPMD inside an actor).

Every actor of a mesh has the same device mesh: `mesh_shape` devices named `axis_names` (jax.jit-style
automatic axes). A layout is a `jax.sharding.PartitionSpec` over those names; `None` means replicated.
PartitionSpecs travel as lists (one entry per dimension: None, an axis name, or a list of names).

    mesh = mpmd.RemoteMesh.local(2, devices_per_actor=4, mesh_shape=(2, 2), axis_names=("data", "model"))
    step = mpmd.distributed(train_step, mesh=mesh, in_shardings=(param_specs, None, P("data")))
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from mpmd.errors import MpmdError


@dataclass(frozen=True)
class ActorMesh:
    """The device mesh every actor of a RemoteMesh builds over its own devices."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axis_names):
            raise MpmdError(f"mesh_shape {self.shape} and axis_names {self.axis_names} differ in length; give one name per axis")
        if any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise MpmdError(f"mesh_shape must be positive ints, got {self.shape}")
        if len(set(self.axis_names)) != len(self.axis_names) or not all(isinstance(n, str) and n for n in self.axis_names):
            raise MpmdError(f"axis_names must be distinct non-empty strings, got {self.axis_names}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def abstract(self) -> AbstractMesh:
        return AbstractMesh(self.shape, self.axis_names, axis_types=(AxisType.Auto,) * len(self.shape))

    def to_wire(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names)}

    def canonical(self, spec: Any) -> Layout:
        """The layout `spec` means on this mesh, in one form, so that two specs placing the same data on the same
        devices are equal (as jax.jit compares shardings): axes of size 1 dropped (they split nothing), a
        one-name tuple written as the name, trailing Nones dropped. `spec` may be a PartitionSpec, a
        NamedSharding, a layout tuple or None (replicated)."""
        sizes = dict(zip(self.axis_names, self.shape))
        entries = []
        for e in as_layout(as_spec(spec)):
            names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
            kept = tuple(n for n in names if sizes.get(n, 2) != 1)  # an unknown name is kept for check_spec to name
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return as_layout(PartitionSpec(*entries))

    def in_own_names(self, spec: PartitionSpec, mesh: Any) -> PartitionSpec | None:
        """`spec`, written for the jax Mesh `mesh`, spelled in this mesh's axis names: as it is when it names only
        axes this mesh has, by position when the two meshes have the same shape; else None (no spelling says it)."""
        # (an entry neither None, a name nor names, e.g. P.UNCONSTRAINED, names no axis: kept as it is)
        entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) if isinstance(e, (tuple, list)) else e
                   for e in spec]
        named = [names for names in entries if isinstance(names, tuple)]
        if all(n in self.axis_names for names in named for n in names):
            return spec
        theirs = tuple(getattr(mesh, "axis_names", ()))
        if tuple(getattr(getattr(mesh, "devices", None), "shape", ())) != tuple(self.shape) or len(theirs) != len(self.axis_names):
            return None
        rename = dict(zip(theirs, self.axis_names))
        if not all(n in rename for names in named for n in names):
            return None
        out = [e if not isinstance(names, tuple) else None if not names else rename[names[0]] if len(names) == 1
               else tuple(rename[n] for n in names) for e, names in zip(spec, entries)]
        return PartitionSpec(*out)

    def spec_advice(self, spec: PartitionSpec, mesh: Any, write: str) -> str:
        """What to write instead of `spec` over the jax Mesh `mesh`: `write` formatted with the re-spelled spec, or,
        when there is none, to spell it in this mesh's axis names."""
        own = self.in_own_names(spec, mesh)
        if own is not None:
            return write.format(own)
        return f"a PartitionSpec in the actors' own axis names {tuple(self.axis_names)} (over {tuple(self.shape)})"

    def equivalent(self, a: Any, b: Any) -> bool:
        """Whether two specs (or layouts) place the same data on the same devices of this mesh."""
        return self.canonical(a) == self.canonical(b)

    def check_spec(self, spec: Any, shape: Sequence[int], what: str) -> None:
        """Refuse a spec naming an axis this mesh lacks, or splitting a dimension its axes do not divide; a
        NamedSharding over a jax Mesh of another shape or other axis names (its spec would mean something else here)."""
        if isinstance(spec, jax.sharding.NamedSharding):
            theirs = (tuple(spec.mesh.axis_names), tuple(spec.mesh.devices.shape))
            if theirs != (tuple(self.axis_names), tuple(self.shape)):
                raise MpmdError(f"{what}: NamedSharding({spec.spec}) is over a jax Mesh of shape {theirs[1]} named {theirs[0]}, "
                                f"but each actor's mesh is {tuple(self.shape)} named {tuple(self.axis_names)}; give "
                                f"{self.spec_advice(spec.spec, spec.mesh, 'the PartitionSpec alone ({})')}, laid out over the "
                                "actors' own devices")
            spec = spec.spec
        elif not isinstance(spec, PartitionSpec):
            spec = as_spec(spec)
        if len(spec) > len(shape):
            raise MpmdError(f"{what}: PartitionSpec {spec} has {len(spec)} entries for an array of rank {len(shape)}")
        sizes = dict(zip(self.axis_names, self.shape))
        used: list[str] = []
        for dim, entry in zip(shape, spec):
            if entry is PartitionSpec.UNCONSTRAINED:
                raise MpmdError(f"{what}: PartitionSpec {spec} leaves a dimension UNCONSTRAINED, which only "
                                "with_sharding_constraint takes; say where each dimension goes (None: not split)")
            if not (entry is None or isinstance(entry, str) or isinstance(entry, tuple) and all(isinstance(n, str) for n in entry)):
                raise MpmdError(f"{what}: PartitionSpec {spec} has entry {entry!r:.60}; each entry is None, an axis name or a "
                                "tuple of axis names")
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            for n in names:
                if n not in sizes:
                    raise MpmdError(f"{what}: PartitionSpec {spec} names axis {n!r}, but the actor mesh has axes "
                                    f"{self.axis_names} (shape {self.shape})")
                if n in used:
                    raise MpmdError(f"{what}: PartitionSpec {spec} uses axis {n!r} twice")
                used.append(n)
        for dim, entry in zip(shape, spec):  # (divisibility after every entry's names: P('d', 'd') was said not to divide)
            names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            k = math.prod(sizes[n] for n in names)
            if dim % k:
                raise MpmdError(f"{what}: dimension of size {dim} is split over {'x'.join(names)} = {k} devices, which does not "
                                f"divide it (PartitionSpec {spec}, array shape {tuple(shape)})")


def spec_to_wire(spec: PartitionSpec | None) -> list[Any] | None:
    if spec is None:
        return None
    return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def spec_from_wire(wire: Any) -> PartitionSpec | None:
    if wire is None:
        return None
    if not isinstance(wire, list):
        raise ValueError(f"a PartitionSpec travels as a list, got {wire!r:.80}")
    entries = []
    for e in wire:
        if e is None or isinstance(e, str):
            entries.append(e)
        elif isinstance(e, list) and all(isinstance(n, str) for n in e):
            entries.append(tuple(e))
        else:
            raise ValueError(f"bad PartitionSpec entry {e!r:.80}")
    return PartitionSpec(*entries)


def as_spec(spec: Any) -> PartitionSpec | None:
    """A PartitionSpec from what users pass as a sharding: a PartitionSpec, a NamedSharding (its spec; the
    actors lay it out over their own mesh of the same axis names), a layout tuple, or None."""
    if spec is None or isinstance(spec, PartitionSpec):
        return spec
    if isinstance(spec, jax.sharding.NamedSharding):
        return spec.spec
    if isinstance(spec, tuple):
        return PartitionSpec(*spec)
    raise MpmdError(f"a sharding must be a PartitionSpec, a NamedSharding or None, got {type(spec).__name__} ({spec!r:.60})")


def is_replicated(spec: PartitionSpec | None) -> bool:
    return spec is None or all(e is None for e in spec)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, jax.sharding.NamedSharding))


def _children(x: Any, is_leaf: Any) -> list[tuple[Any, Any]] | None:
    """`x`'s (key, child) pairs one level down; None for a leaf."""
    if is_leaf(x):
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if len(flat) == 1 and flat[0][0] == () and flat[0][1] is x:
        return None
    return [(path[0], child) for path, child in flat]


def _shape_of(x: Any, is_leaf: Any = _is_spec) -> str:
    """A short description of a tree node: "a dict of 50 (['w0'], ['w1'], ['w10'], ['w11'], ...)", "a leaf (ndarray)"."""
    if x is None:
        return "None"
    kids = _children(x, is_leaf)
    if kids is None:
        return f"a leaf ({type(x).__name__})"
    keys = [jax.tree_util.keystr((k,)) for k, _ in kids]
    shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
    return f"a {type(x).__name__} of {len(keys)} ({shown})"[:160]


def _first_mismatch(specs: Any, args: Any, is_remote: Any, path: str) -> tuple[str, str, str] | None:
    """(where, what the sharding tree has there, what the argument tree has) of the first node where `specs`
    is not a prefix of `args`; None where none is found (jax's check is the judge)."""
    if _is_spec(specs):
        return None
    spec_kids, arg_kids = _children(specs, _is_spec), _children(args, is_remote)
    if spec_kids is None or arg_kids is None or type(specs) is not type(args) or [k for k, _ in spec_kids] != [k for k, _ in arg_kids]:
        return path, _shape_of(specs), _shape_of(args, is_remote)
    for (k, s), (_, a) in zip(spec_kids, arg_kids):
        found = _first_mismatch(s, a, is_remote, path + jax.tree_util.keystr((k,)))
        if found is not None:
            return found
    return None


def tree_specs(specs: Any, args: Any, what: str) -> list[PartitionSpec | None]:
    """Per flat leaf of `args`, its PartitionSpec from `specs` (a prefix pytree of PartitionSpec / None, like
    jax.jit's in_shardings). Raises MpmdError naming the mismatch."""
    from mpmd.runtime.array import RemoteArray

    is_remote = lambda x: isinstance(x, RemoteArray)  # noqa: E731
    if isinstance(specs, list) and isinstance(args, tuple) and len(specs) == len(args):
        specs = tuple(specs)  # one per positional argument, as a list: jax.jit takes that too
    spec_leaves, spec_tree = jax.tree.flatten(
        specs, is_leaf=lambda x: x is None or isinstance(x, (PartitionSpec, jax.sharding.NamedSharding)))
    try:
        subtrees = spec_tree.flatten_up_to(args)
    except (ValueError, TypeError) as e:  # (jax's text holds the repr of every array: tens of KB for a model)
        root = "args" if what.startswith("in") else "outputs"
        where = _first_mismatch(specs, args, is_remote, root) or (root, _shape_of(specs), _shape_of(args, is_remote))
        noun = "arguments" if root == "args" else "outputs"
        # e.g. "List arity mismatch: 2 != 1"; not what it got (the repr of the arguments' arrays)
        jax_says = re.split(r",? got\b", (str(e).split(";")[0].splitlines() or [""])[0])[0][:100].strip(" (")
        raise MpmdError(f"{what} is not a prefix of the {noun}' tree: at {where[0]}, {what} has {where[1]} where the "
                        f"{noun} have {where[2]} ({jax_says}); give a PartitionSpec or None per {noun[:-1]}, or a tree of "
                        f"them shaped like the {noun[:-1]} (a prefix of it)") from None
    expanded = [s for s, sub in zip(spec_leaves, subtrees) for _ in jax.tree.leaves(sub, is_leaf=is_remote)]
    leaves = jax.tree.leaves(args, is_leaf=is_remote)
    if len(expanded) != len(leaves):
        raise MpmdError(f"{what} gives {len(expanded)} shardings for {len(leaves)} array leaves")
    for s in expanded:
        if s is not None and not isinstance(s, (PartitionSpec, jax.sharding.NamedSharding)):
            raise MpmdError(f"{what} must hold PartitionSpecs, NamedShardings or None, got {type(s).__name__} ({s!r:.60})")
    return [s if isinstance(s, jax.sharding.NamedSharding) else as_spec(s) for s in expanded]  # (check_spec judges a mesh)


Layout = tuple  # a PartitionSpec as a tuple of entries; () is replicated


def as_layout(spec: PartitionSpec | None) -> Layout:
    """A PartitionSpec as a tuple without trailing Nones (P('model', None) and P('model') are one layout)."""
    entries = list(spec) if spec is not None else []
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def layout_to_spec(layout: Layout | None) -> PartitionSpec | None:
    return None if layout is None else PartitionSpec(*layout)


def layout_wire(layout: Layout | None) -> list[Any] | None:
    return None if layout is None else spec_to_wire(PartitionSpec(*layout))


def layout_from_wire(wire: Any) -> Layout:
    spec = spec_from_wire(wire)
    return as_layout(spec)


async def infer_layouts(units: dict[int, list[Any]], known: dict[Any, Layout], constraints: dict[Any, Layout],
                        compile_unit: Any) -> tuple[dict[tuple[int, int], str], dict[Any, Layout]]:
    """Compile every unit with its inputs' layouts, wave by wave: a unit whose inputs' layouts are all known is
    compiled (on its actor, all such units at once), XLA chooses its outputs' layouts (or `constraints` fixes
    them: the step's out_shardings), and those become known for the units that read them. Returns each
    unit's executable key ((actor, index in that actor's list) -> key) and every value's layout.

    `compile_unit(actor, unit, in_layouts, out_layouts) -> (exe key, chosen out layouts)` is a coroutine."""
    import asyncio

    known = dict(known)
    pending = {(a, i) for a, us in units.items() for i in range(len(us))}
    exe: dict[tuple[int, int], str] = {}
    cache: dict[Any, Any] = {}
    while pending:
        ready = sorted(p for p in pending if all(k in known for k in units[p[0]][p[1]].inputs))
        if not ready:
            missing = {k for a, i in pending for k in units[a][i].inputs if k not in known}
            raise MpmdError(f"internal: cannot infer the layouts of {len(missing)} values (a cycle between units?)")

        async def one(a: int, i: int) -> None:
            u = units[a][i]
            ins = tuple(known[k] for k in u.inputs)
            outs = tuple(constraints.get(k) for k in u.outputs)
            key = (a, u.template(), ins, outs)
            if key not in cache:
                cache[key] = asyncio.ensure_future(compile_unit(a, u, ins, outs))
            exe_key, chosen = await cache[key]
            exe[(a, i)] = exe_key
            for k, lay in zip(u.outputs, chosen):
                known.setdefault(k, lay)

        await asyncio.gather(*(one(a, i) for a, i in ready))
        pending -= set(ready)
    return exe, known


@dataclass(frozen=True)
class RemoteSharding:
    """How a RemoteArray is laid out over each of its actors' devices: `spec` over the actor `mesh`."""

    spec: PartitionSpec
    mesh: ActorMesh

    @property
    def layout(self) -> Layout:
        return as_layout(self.spec)

    def __repr__(self) -> str:
        return f"{self.spec} over {dict(zip(self.mesh.axis_names, self.mesh.shape))}"


def remote_sharding(layout: Layout | None, mesh: ActorMesh | None) -> RemoteSharding | None:
    if layout is None or mesh is None:
        return None
    return RemoteSharding(PartitionSpec(*layout), mesh)
