"""Lower a JAX function for an actor: `jax.export` to serialized StableHLO bytes, once per signature."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def serialize_flat(fn: Callable[..., Sequence[Any]], avals: Sequence[jax.ShapeDtypeStruct], platform: str,
                   donate: Sequence[int] = ()) -> bytes:
    """Export `fn` (flat arrays in, tuple of flat arrays out) for `platform` and serialize it. Inputs at
    `donate` may share their buffer with an output (the actor compiles with the same donation)."""
    exp = export.export(jax.jit(fn, donate_argnums=tuple(donate)), platforms=[export_platform(platform)])(*avals)
    return bytes(exp.serialize())


def aval_of(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def host_array(x: Any) -> Any:
    """`x` as a numpy array of the dtype JAX would trace it with (float64 -> float32 unless x64 is on)."""
    a = np.asarray(x)
    want = jax.dtypes.canonicalize_dtype(a.dtype)
    return a if a.dtype == want else a.astype(want)
