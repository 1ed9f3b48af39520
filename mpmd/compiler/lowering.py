"""Lower a JAX function for an actor: `jax.export` to serialized StableHLO bytes, once per signature."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax import export

_PLATFORM_NAMES = {"gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "cpu": "cpu", "tpu": "tpu"}


def export_platform(device_platform: str) -> str:
    """Map a device's platform name (as `jax.devices()[0].platform` says) to `jax.export`'s name."""
    try:
        return _PLATFORM_NAMES[device_platform]
    except KeyError:
        raise ValueError(f"cannot lower for actor platform {device_platform!r}; known: {sorted(_PLATFORM_NAMES)}") from None


@contextlib.contextmanager
def without_callers_mesh() -> Iterator[None]:
    """Trace and export as if no `jax.set_mesh(...)` / `jax.sharding.use_mesh(...)` were in force here: a step
    runs on its actors' devices and resolves bare PartitionSpecs against their mesh, so a mesh the caller set
    for their own `jax.jit` code (its device count above all) must not leak into the executables (an actor
    refused them: "exported for 2 devices and is called in a context with 1 devices")."""
    set_mesh, sharding = getattr(jax, "set_mesh", None), jax.sharding
    if set_mesh is None or not hasattr(sharding, "get_mesh") or (sharding.get_abstract_mesh().empty and sharding.get_mesh().empty):
        yield  # (none set; or an older JAX without these contexts)
        return
    with set_mesh(None):
        yield


def serialize_flat(fn: Callable[..., Sequence[Any]], avals: Sequence[jax.ShapeDtypeStruct], platform: str,
                   donate: Sequence[int] = ()) -> bytes:
    """Export `fn` (flat arrays in, tuple of flat arrays out) for `platform` and serialize it. Inputs at
    `donate` may share their buffer with an output (the actor compiles with the same donation)."""
    with without_callers_mesh(), innermost_locations():
        exp = export.export(jax.jit(fn, donate_argnums=tuple(donate)), platforms=[export_platform(platform)])(*avals)
    return bytes(exp.serialize())


def innermost_locations() -> Any:
    """Each op's source location as its innermost frame only (the line that made it), not the stack up to the
    caller: the actors cache executables by the blob's hash, and a step traced from another line (a second
    `mpmd.distributed` of the same function, a signature traced again) exported other bytes — every executable
    compiled again, the kept ones never hit (a probe). A null context where this JAX has no such setting."""
    from jax._src import config as jax_config

    limit = getattr(jax_config, "traceback_in_locations_limit", None)
    return limit(1) if limit is not None else contextlib.nullcontext()


def aval_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def host_array(x: Any) -> Any:
    """`x` as a numpy array of the dtype JAX would trace it with (float64 -> float32 unless x64 is on)."""
    a = np.asarray(x)
    want = jax.dtypes.canonicalize_dtype(a.dtype)
    return a if a.dtype == want else a.astype(want)


def trace_mesh(actor_mesh: Any, platform: str | None) -> Any:
    """The abstract mesh a step is traced under (`actor_mesh`, an ActorMesh, seen from here): the one a jax `Mesh`
    of this process's devices in that shape has when they are of the actors' platform, so that code written for
    `jax.jit` on such a Mesh — `shard_map(f, mesh=mesh, ...)` checks that its mesh is the context's — traces as
    it does there (`rebind_constraints` then puts the actors' mesh in its place); else the bare abstract mesh."""
    from jax.sharding import AxisType, Mesh

    devices = jax.devices()
    if platform is None or devices[0].platform != platform or len(devices) < actor_mesh.size:
        return actor_mesh.abstract
    grid = np.array(devices[: actor_mesh.size], dtype=object).reshape(actor_mesh.shape)
    return Mesh(grid, tuple(actor_mesh.axis_names), axis_types=(AxisType.Auto,) * len(actor_mesh.shape)).abstract_mesh


def tracing_mesh(actor_mesh: Any, caller: Any, platform: str | None) -> Any:
    """The abstract mesh a function for the actors is traced under (None: none): the actors' (`trace_mesh`) when
    they have several devices each, so `with_sharding_constraint(x, P(...))` resolves against it as under
    `jax.set_mesh`; else, when the caller set a mesh (`caller`: their abstract mesh), its axes each of size 1 (one
    device each: P('model') splits nothing there)."""
    if actor_mesh is not None:
        return trace_mesh(actor_mesh, platform)
    if caller is not None and not caller.empty:
        names = tuple(caller.axis_names)
        return jax.sharding.AbstractMesh((1,) * len(names), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    return None


def rebind_constraints(closed: Any, actor_mesh: Any, traced_under: Any = None, jit_shardings: bool = False) -> Any:
    """`closed` (a traced step) with every `with_sharding_constraint`, `jax.device_put(x, NamedSharding(...))` (to
    device memory: a no-op inside jax.jit, made one here) and `shard_map` over a concrete jax `Mesh` —
    written for the caller's own devices, as `jax.jit` code does — rebound to the actors' mesh (`actor_mesh`, an
    ActorMesh; None for one device each; `traced_under`: the abstract mesh the step was traced under, by default
    the actors') when that mesh has the same axis names and shape: the executables run on the actors' devices,
    and a concrete mesh pinned them to the caller's device count (the actors refused them). Any other concrete
    mesh is an error naming it and what to write instead (a bare PartitionSpec, or shard_map without `mesh=`,
    resolves against each actor's mesh). `jit_shardings`: a nested jax.jit's in_shardings and out_shardings too
    (`actor.run`'s; a step inlines its nested calls, and theirs with them)."""
    from jax.extend.core import ClosedJaxpr
    from jax.sharding import Mesh, NamedSharding

    abstract = traced_under if traced_under is not None else actor_mesh.abstract if actor_mesh is not None else None

    def rebound(mesh: Any, what: str, instead: Callable[[], str]) -> Any:
        """`mesh` as the actors' abstract mesh; `mesh` itself if it pins nothing; else a PipelineError."""
        if not isinstance(mesh, Mesh):
            return mesh
        shape = tuple(mesh.devices.shape)
        if actor_mesh is None and mesh.size == 1:
            return mesh  # (one device: it pins nothing the actors lack)
        if actor_mesh is not None and tuple(mesh.axis_names) == tuple(actor_mesh.axis_names) and shape == tuple(actor_mesh.shape):
            return abstract
        where = "one device each" if actor_mesh is None else f"a mesh of shape {tuple(actor_mesh.shape)} named {tuple(actor_mesh.axis_names)}"
        from mpmd.errors import PipelineError

        it = "the function mesh.actor(i).run was given" if jit_shardings else "the step"
        raise PipelineError(f"{what} in {it} uses a jax Mesh of shape {shape} named {tuple(mesh.axis_names)}, but it "
                            f"runs on the actors' devices ({where}): write {instead()}, or give the actors that mesh "
                            "(RemoteMesh.local(..., mesh_shape=..., axis_names=...))")

    def fix(sharding: Any, where: str = "with_sharding_constraint(x, {})", advice: str | None = None) -> Any:
        mesh = getattr(sharding, "mesh", None)
        if not isinstance(sharding, NamedSharding) or not isinstance(mesh, Mesh):
            return sharding
        write = (advice or where) + " (a bare PartitionSpec resolves against each actor's mesh)"

        def instead() -> str:  # (only when refused: said in the actors' axis names where it can be)
            return actor_mesh.spec_advice(sharding.spec, mesh, write) if actor_mesh is not None else write.format(sharding.spec)

        new = rebound(mesh, where.format(f"NamedSharding(mesh, {sharding.spec})"), instead)
        return sharding if new is mesh else NamedSharding(new, sharding.spec, memory_kind=sharding.memory_kind)

    def param(p: Any) -> Any:
        if isinstance(p, ClosedJaxpr):
            j = jaxpr(p.jaxpr)
            return p if j is p.jaxpr else ClosedJaxpr(j, p.consts)
        if type(p).__name__ == "Jaxpr":
            return jaxpr(p)
        if isinstance(p, tuple) and p:
            items = tuple(param(x) for x in p)
            return p if all(a is b for a, b in zip(items, p)) else items
        return p

    def jaxpr(j: Any) -> Any:
        eqns, changed = [], False
        for e in j.eqns:
            params = {k: param(v) for k, v in e.params.items()}
            if e.primitive.name == "sharding_constraint":
                params["sharding"] = fix(params["sharding"])
            elif jit_shardings and e.primitive.name in ("jit", "pjit"):  # (a jax.jit's in_shardings / out_shardings)
                for k in ("in_shardings", "out_shardings"):
                    if isinstance(params.get(k), tuple):
                        fixed = tuple(fix(x, f"jax.jit(f, {k}={{}})") for x in params[k])
                        if any(a is not b for a, b in zip(fixed, params[k])):
                            params[k] = fixed
            elif e.primitive.name == "device_put" and isinstance(params.get("devices"), tuple):
                # (`jax.device_put(x, NamedSharding(mesh, spec))`, device memory: inside jax.jit it lowers to nothing, but
                # its concrete mesh reached the export and the actor refused it, "exported for 4 devices and is called
                # in a context with 1"; a probe. A mesh of the actors' shape: left to XLA as jax.jit leaves it)
                targets = tuple(None if isinstance(t, NamedSharding) and t.memory_kind in (None, "device") and fix(
                    t, "jax.device_put(x, {})", "jax.lax.with_sharding_constraint(x, {})") is not t else t for t in params["devices"])
                if any(a is not b for a, b in zip(targets, params["devices"])):
                    params["devices"] = targets
            elif e.primitive.name == "shard_map" and isinstance(params.get("mesh"), Mesh):
                params["mesh"] = rebound(params["mesh"], "shard_map(f, mesh=mesh, ...)",
                                         lambda: "jax.shard_map(f, in_specs=..., out_specs=...) without mesh= (it takes each actor's mesh)")
            if any(params[k] is not v for k, v in e.params.items()):
                e, changed = e.replace(params=params), True
            eqns.append(e)
        return j.replace(eqns=eqns) if changed else j

    return param(closed)
