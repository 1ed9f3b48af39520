"""Units: one executable call on one actor. Named value keys, the task and chunk functions, fusion and
donation. Pure.

A value is named by a key:

* `Outer(var)`: a value of the step — an argument, a value before or after the loop, a hoisted invariant,
  a gradient sum (the step-level value of an accumulated body var);
* `PerMb(var, mb)`: a loop-body value of microbatch `mb`;
* `Acc(var, upto)`: the running sum (or, for a stacked aux output, the [m, ...] buffer) of `var` once
  microbatch `upto` has been added;
* `MbIndex(mb)`: the int32 constant `mb`, with which a task slices its microbatch out of a batch leaf.

A unit is a sequence of parts (a task, a chunk of equations); several adjacent parts on one actor fuse into
one executable when that delays nothing (see `fuse`). Its template — what the executable computes, not
which microbatch — decides which units share one compiled executable.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mpmd.compiler.avals import unwrap_out, wrap_in
from mpmd.compiler.program import Label


def _same_kind_eq(self: tuple, other: object) -> bool:
    """Keys of different kinds never compare equal, even over equal fields (PerMb(v, 0) is not Acc(v, 0))."""
    return type(self) is type(other) and tuple.__eq__(self, other)


def _same_kind_ne(self: tuple, other: object) -> bool:
    return not _same_kind_eq(self, other)


def _kind_hash(self: tuple) -> int:
    return hash((type(self).__name__, *self))


class Outer(NamedTuple):
    var: Any


class PerMb(NamedTuple):
    var: Any
    mb: int


class Acc(NamedTuple):
    var: Any
    upto: int


class MbIndex(NamedTuple):
    mb: int


for _key_type in (Outer, PerMb, Acc, MbIndex):
    _key_type.__eq__ = _same_kind_eq  # type: ignore[method-assign,assignment]
    _key_type.__ne__ = _same_kind_ne  # type: ignore[method-assign,assignment]
    _key_type.__hash__ = _kind_hash  # type: ignore[method-assign,assignment]


Key = Hashable


@dataclass
class Part:
    """One function inside a unit: reads `inputs`, writes `outputs` (keys); `template` identifies `fn`."""

    fn: Callable[..., Sequence[Any]]
    inputs: list[Key]
    outputs: list[Key]
    template: Hashable
    label: Label
    sends: bool = False  # some output goes to another actor (filled by the program builder)


@dataclass
class Unit:
    actor: int
    parts: list[Part]
    inputs: list[Key] = field(default_factory=list)
    outputs: list[Key] = field(default_factory=list)
    donate: tuple[int, ...] = ()

    @property
    def label(self) -> Label:
        return Label.fused(tuple(p.label for p in self.parts))

    def seal(self, keep: Callable[[Key], bool]) -> None:
        """Inputs: what the parts read that no earlier part makes; outputs: what later code reads (`keep`)."""
        made: set[Key] = set()
        ins: dict[Key, None] = {}  # (ordered, and a set's lookups: a list's were quadratic in a step's leaves)
        for p in self.parts:
            for k in p.inputs:
                if k not in made:
                    ins.setdefault(k)
            made.update(p.outputs)
        outs = [k for p in self.parts for k in p.outputs if keep(k)]
        self.inputs, self.outputs = list(ins), list(dict.fromkeys(outs))

    def template(self) -> Hashable:
        """Identity of the executable: the parts' templates and how their inputs and outputs are wired."""
        where: dict[Key, tuple] = {k: ("in", i) for i, k in enumerate(self.inputs)}
        wiring = []
        for j, p in enumerate(self.parts):
            wiring.append(tuple(where[k] for k in p.inputs))
            for i, k in enumerate(p.outputs):
                where[k] = ("part", j, i)
        return (tuple(p.template for p in self.parts), tuple(wiring), tuple(where[k] for k in self.outputs), self.donate)

    def function(self, in_avals: Sequence[Any]) -> Callable[..., tuple]:
        """The flat function to export: wire-form arrays in and out (typed keys travel as key data)."""
        parts, inputs, outputs = list(self.parts), list(self.inputs), list(self.outputs)
        dtypes = [a.dtype for a in in_avals]
        read_later = [{k for q in parts[j + 1:] for k in q.inputs} for j in range(len(parts))]

        def fn(*args: Any) -> tuple:
            env = {k: wrap_in(x, d) for k, x, d in zip(inputs, args, dtypes)}
            for p, later in zip(parts, read_later):
                env.update(zip(p.outputs, p.fn(*(env[k] for k in p.inputs))))
                passed = [k for k in p.outputs if k in later and _rounds_in_memory(env[k])]
                env.update(zip(passed, jax.lax.optimization_barrier([env[k] for k in passed])))
            return tuple(unwrap_out(_in_device_memory(env[k])) for k in outputs)

        return fn


def _in_device_memory(x: Any) -> Any:
    """`x` moved to device memory if the unit made it in host memory: a remat policy that offloads residuals
    (`save_and_offload_only_these_names(..., offload_dst="pinned_host")`) hands the backward task a pinned-host value,
    which the backward's executable, exported for device-memory inputs, refused on the actor (jax.jit ran it; a
    probe). The residual is kept in device memory between the tasks: correct, but not offloaded (see README)."""
    space = getattr(getattr(x, "aval", None), "memory_space", None)
    if space is None or getattr(space, "name", "Device") == "Device":
        return x
    return jax.device_put(x, type(space).Device)


def _rounds_in_memory(x: Any) -> bool:
    """A float narrower than 32 bits: XLA may keep it wider inside one fusion (excess precision), so a value
    one part of a fused unit hands the next goes through an optimization barrier, rounded to its dtype as if
    the parts were separate executables (as jax.jit rounds a loop carry: a bf16 gradient sum then cast)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def task_function(inner: Callable[..., Sequence[Any]], n_in: int, leaf_positions: Sequence[int], n_out: int,
                  accs: Sequence[tuple[str, bool]], num_microbatches: int, needs_index: bool) -> Callable[..., Sequence[Any]]:
    """Wrap `inner` (a task's equations: `n_in` inputs, `n_out` exported values followed by one value per
    accumulator) into the task executable's function. Its inputs are `inner`'s (whole batch leaves [m, ...]
    at `leaf_positions`, sliced here), then the previous value of every accumulator that is not `first`, then
    the microbatch index (when `needs_index`); its outputs are the exported values, then every accumulator's
    new value: ("sum", first) adds the microbatch's value to the running sum, ("stack", first) writes it at
    the microbatch's row of an [m, ...] buffer."""
    leaves = set(leaf_positions)

    def fn(*args: Any) -> Sequence[Any]:
        idx = args[-1] if needs_index else None
        xs = [jax.lax.dynamic_index_in_dim(x, idx, keepdims=False) if i in leaves else x for i, x in enumerate(args[:n_in])]
        outs = list(inner(*xs))
        prev = iter(args[n_in : len(args) - (1 if needs_index else 0)])
        new = []
        for v, (kind, first) in zip(outs[n_out:], accs):
            if kind == "sum":
                new.append(v if first else next(prev) + v)
            else:
                buf = jnp.zeros((num_microbatches, *v.shape), v.dtype) if first else next(prev)
                new.append(jax.lax.dynamic_update_index_in_dim(buf, v, idx, 0))
        return [*outs[:n_out], *new]

    return fn


def fuse(units: list[Unit], received: Callable[[Key], bool], sent: Callable[[Key], bool]) -> list[Unit]:
    """Merge each unit of one actor's ordered list into the one before it when that delays nothing: the
    earlier unit sends nothing to other actors (its results would wait for the later part), and the later one
    reads nothing received from another actor that the earlier one does not already wait for."""
    out: list[Unit] = []
    for u in units:
        if out:
            prev = out[-1]
            prev_waits = {k for k in prev.inputs if received(k)}
            if not any(sent(k) for k in prev.outputs) and all(k in prev_waits or not received(k) for k in u.inputs):
                prev.parts.extend(u.parts)
                prev.seal(lambda k: True)
                continue
        out.append(u)
    return out
