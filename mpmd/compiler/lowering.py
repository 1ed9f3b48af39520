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
    with without_callers_mesh():
        exp = export.export(jax.jit(fn, donate_argnums=tuple(donate)), platforms=[export_platform(platform)])(*avals)
    return bytes(exp.serialize())


def aval_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def host_array(x: Any) -> Any:
    """`x` as a numpy array of the dtype JAX would trace it with (float64 -> float32 unless x64 is on)."""
    a = np.asarray(x)
    want = jax.dtypes.canonicalize_dtype(a.dtype)
    return a if a.dtype == want else a.astype(want)
