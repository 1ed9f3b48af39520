"""What a value looks like on the actors and on the wire.

Actors hold plain arrays only. A typed PRNG key array (`jax.random.key(0)`: an extended dtype numpy cannot
hold) lives there as its key data (`jax.random.key_data`: uint32 with the key's shape plus the impl's key
shape) and is re-wrapped, with its impl, at the edges: inside every executable that reads or returns it,
and when it is fetched to the controller.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_key(dtype: Any) -> bool:
    """True for a typed PRNG key dtype (`key<fry>` and friends)."""
    try:
        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


def key_impl(dtype: Any) -> Any:
    return dtype._impl  # jax._src.prng.KeyTy keeps its PRNGImpl here


def wire_shape_dtype(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The (shape, dtype) of the plain array an actor holds for a value of this shape and dtype."""
    if is_key(dtype):
        impl = key_impl(dtype)
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl.name)))
        return (*shape, *impl.key_shape), np.dtype(data.dtype)
    return tuple(shape), np.dtype(dtype)


def wire_aval(aval: Any) -> jax.ShapeDtypeStruct:
    shape, dtype = wire_shape_dtype(tuple(aval.shape), aval.dtype)
    return jax.ShapeDtypeStruct(shape, dtype)


def host_value(x: Any) -> Any:
    """A host argument as what JAX would trace it with: a numpy array of the canonical dtype (float64 ->
    float32 unless x64 is on), or a typed key array kept as it is."""
    if is_key(getattr(x, "dtype", None)):
        return x
    a = np.asarray(x)
    if type(x) is int:  # as jax.jit does: a Python int beyond the traced integer type is an error, not wrapped
        want = jax.dtypes.canonicalize_dtype(np.int64)
        if not np.iinfo(want).min <= x <= np.iinfo(want).max:
            raise OverflowError(f"the Python int {x} does not fit in {want} (the dtype JAX traces Python ints with"
                                f"{'' if want == np.int64 else ' while jax_enable_x64 is off'}): pass a numpy array of a wider or "
                                "unsigned dtype, or a float")
    want = jax.dtypes.canonicalize_dtype(a.dtype)
    return a if a.dtype == want else a.astype(want)


def not_numeric(dt: np.dtype) -> bool:
    """Strings, objects and raw/structured records (numpy's void); bfloat16 and float8 are kind 'V' too, but numbers."""
    return dt.kind in "OSU" or issubclass(dt.type, np.void)


def jax_array(value: np.ndarray, weak_type: bool) -> jax.Array:
    """A jax Array of `value`, weakly typed when `weak_type` (as jax.jit returns a Python scalar: an int32 that
    `x * bf16_array` leaves bf16)."""
    if not weak_type:
        return jnp.asarray(value)
    if value.ndim == 0:
        out = jnp.asarray(value.item())  # a Python scalar: weak, of the default dtype (the weak aval's)
        if out.dtype == value.dtype and out.weak_type:
            return out
    try:  # (no public way to make a weak array of any shape)
        from jax._src.lax.lax import _convert_element_type
        return _convert_element_type(value, np.dtype(value.dtype), weak_type=True)
    except Exception:  # a jax without it: strongly typed, as before
        return jnp.asarray(value)


def to_wire(x: Any) -> np.ndarray:
    """A host value (numpy array, jax array, typed key array) as the plain numpy array an actor holds."""
    if is_key(getattr(x, "dtype", None)):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def from_wire(data: np.ndarray, dtype: Any) -> Any:
    """What `to_wire` undoes: a typed key array for a key dtype, else `data` itself."""
    if is_key(dtype):
        return jax.random.wrap_key_data(jnp.asarray(data), impl=key_impl(dtype).name)
    return data


def wrap_in(x: Any, dtype: Any) -> Any:
    """Inside a traced executable: the wire-form input `x` as a value of `dtype`."""
    return jax.random.wrap_key_data(x, impl=key_impl(dtype).name) if is_key(dtype) else x


def unwrap_out(x: Any) -> Any:
    """Inside a traced executable: an output in its wire form."""
    return jax.random.key_data(x) if is_key(getattr(x, "dtype", None)) else x


def dtype_text(dtype: Any) -> str:
    return str(dtype) if is_key(dtype) else np.dtype(dtype).name
