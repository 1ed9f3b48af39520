"""Argument and output leaves that are not data: they travel in the step's signature, not to the actors.

`jax.jit` takes arrays and refuses a function among its arguments; an equinox user hands the whole model to
`eqx.filter_jit`, which keeps every leaf that is not an array (activation functions, `Dropout.inference`,
an `int` head count, a string) static. A distributed step does the same so that such models can be passed as
they are:

* a function (anything callable without a ``shape``) or a string, anywhere in the arguments, is static;
* inside an equinox `Module`, every leaf that is not an array (Python numbers and bools included) is static,
  as under `eqx.filter_jit`; outside one, a Python number stays a traced scalar, as under `jax.jit`.

A static leaf becomes a childless pytree node that carries its value as aux data, so the flattened leaves are
the data alone and the treedef (the compile cache's key) holds the static values: a new function or a new
`Dropout.inference` recompiles, like a new `static_argnums` value under `jax.jit`. A step's static leaf must be
hashable, as `eqx.filter_jit` and jax.jit's static arguments require: one keyed by identity (a `SimpleNamespace`
config, a dataclass that is not frozen) and changed in place reused the old compile, silently (a probe). Outputs are treated the
same way (`eqx.apply_updates(model, updates)` returns the model's functions), and `reveal` restores them.
"""

from __future__ import annotations

import sys
from typing import Any

import jax


class _Key:
    """A static value as aux data: equal when identical or (hashable and) equal; unhashable ones by identity."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Any) -> None:
        self.value = value
        try:
            self._hash = hash((type(value), value))
        except TypeError:
            self._hash = None

    def __hash__(self) -> int:
        return self._hash if self._hash is not None else id(self.value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Key):
            return NotImplemented
        if self.value is other.value:
            return True
        if self._hash is None or other._hash is None or type(self.value) is not type(other.value):
            return False
        try:
            return bool(self.value == other.value)
        except Exception:  # an __eq__ that raises: not the same value
            return False

    def __repr__(self) -> str:
        return f"static({self.value!r:.60})"


class Static:
    """A leaf kept out of the data: a pytree node with no children whose value is its aux data."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(Static, lambda s: ((), _Key(s.value)), lambda key, _: Static(key.value))


def _is_data(x: Any) -> bool:
    """An array or something that becomes one (a RemoteArray, a loaded leaf, a tracer, a numpy scalar); not a
    class such as `np.float32` (which has `shape` and `dtype` attributes too)."""
    return not isinstance(x, type) and hasattr(x, "shape") and hasattr(x, "dtype")


def _static_anywhere(x: Any) -> bool:
    return isinstance(x, (str, type)) or (callable(x) and not _is_data(x))


class UnhashableStatic(TypeError):
    """`hide(..., hashable=True)` met a static leaf that cannot be hashed (`.value`)."""

    def __init__(self, value: Any) -> None:
        super().__init__(f"static leaf {type(value).__name__} is not hashable")
        self.value = value


def hide(tree: Any, is_leaf: Any = None, hashable: bool = False) -> Any:
    """`tree` with its static leaves as `Static` nodes (see the module docstring); `is_leaf` as for jax.tree.
    `hashable`: raise UnhashableStatic for a static leaf that cannot be hashed (a step's arguments, whose static
    values key its compile cache: keyed by identity, one changed in place reused the old compile)."""
    eqx = sys.modules.get("equinox")
    module = getattr(eqx, "Module", None)

    def static(x: Any) -> Static:
        if hashable:
            try:
                hash(x)
            except TypeError:
                raise UnhashableStatic(x) from None
        return Static(x)

    def inside_module(x: Any) -> Any:  # (a ShapeDtypeStruct field is no array to eqx.is_array either: static)
        return x if _is_data(x) and not isinstance(x, jax.ShapeDtypeStruct) else static(x)

    def leaf(x: Any) -> Any:
        if module is not None and isinstance(x, module):
            return jax.tree.map(inside_module, x, is_leaf=is_leaf)
        return static(x) if _static_anywhere(x) else x

    def stop(x: Any) -> bool:
        return (is_leaf is not None and is_leaf(x)) or (module is not None and isinstance(x, module))

    return jax.tree.map(leaf, tree, is_leaf=stop)


def reveal(tree: Any) -> Any:
    """`tree` with each `Static` node replaced by its value."""
    return jax.tree.map(lambda x: x.value if isinstance(x, Static) else x, tree, is_leaf=lambda x: isinstance(x, Static))


__all__ = ["Static", "UnhashableStatic", "hide", "reveal"]
