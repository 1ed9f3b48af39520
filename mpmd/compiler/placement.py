"""Place the step's equations outside the microbatch loop on actors, and group them into units.

Pure functions over jaxprs. Rules:
* Inputs of the loop (parameters, the batch) go to the actors whose stage tasks read them.
* Before the loop, an equation runs on every actor that needs its result (cheap casts and reshapes are
  recomputed rather than sent).
* After the loop, an equation that reads a loop result (a gradient, a loss) runs on one actor: where most
  of those bytes already are, so each stage updates its own parameters and optimizer state. Equations
  that read no loop result (an optimizer's step count) run on every actor that needs them.
* Consecutive equations on one actor become one unit (one executable), cut only where a unit must wait
  for a value another actor is still computing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend.core import Var


def nbytes(v: Any) -> int:
    aval = v.aval
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def var_inputs(eqn: Any) -> list[Var]:
    return [v for v in eqn.invars if isinstance(v, Var)]


@dataclass
class Chunk:
    actor: int
    phase: str  # "pre" or "post"
    seq: int
    eqns: list[Any] = field(default_factory=list)


def place_post(post: list[Any], loc: dict[Var, set[int]], need: dict[Var, set[int]], outvars: set[Var], all_actors: set[int]) -> list[tuple[Any, set[int]]]:
    """Placement of the equations after the loop. `loc` holds where loop results live (updated in place);
    `need` collects which actors need each earlier value (updated in place)."""
    anchored: set[Var] = set(loc)
    placed: dict[int, set[int]] = {}
    for i, e in enumerate(post):
        weights: dict[int, int] = defaultdict(int)
        for v in var_inputs(e):
            if v in anchored:
                for a in loc[v]:
                    weights[a] += nbytes(v) + 1
        if weights:
            best = min(weights, key=lambda a: (-weights[a], a))
            placed[i] = {best}
            for v in e.outvars:
                anchored.add(v)
                loc[v] = {best}
    for i in reversed(range(len(post))):
        e = post[i]
        if i not in placed:
            where: set[int] = set()
            for v in e.outvars:
                where |= need.get(v, set())
                if v in outvars and not need.get(v):
                    where |= all_actors
            placed[i] = where
            for v in e.outvars:
                loc[v] = set(where)
        for v in var_inputs(e):
            if v not in anchored or v not in loc:
                need[v] |= placed[i]
    return [(e, placed[i]) for i, e in enumerate(post) if placed[i]]


def place_pre(pre: list[Any], need: dict[Var, set[int]], outvars: set[Var], all_actors: set[int]) -> list[tuple[Any, set[int]]]:
    """Placement of the equations before the loop: wherever their results are needed (recomputed there)."""
    out = []
    for e in reversed(pre):
        where: set[int] = set()
        for v in e.outvars:
            where |= need.get(v, set())
            if v in outvars and not need.get(v):
                where |= all_actors
        if where:
            for v in var_inputs(e):
                need[v] |= where
            out.append((e, where))
    return out[::-1]


def make_chunks(placed: Iterable[tuple[Any, set[int]]], phase: str, start_seq: int) -> list[Chunk]:
    """Group placed equations into per-actor chunks, closing a chunk when another actor needs one of its
    values before it is complete."""
    open_: dict[int, Chunk] = {}
    closed: list[Chunk] = []
    defined_in_open: dict[Var, set[int]] = defaultdict(set)
    seq = [start_seq]

    def close(a: int) -> None:
        c = open_.pop(a, None)
        if c is not None and c.eqns:
            closed.append(c)
            for e in c.eqns:
                for v in e.outvars:
                    defined_in_open[v].discard(a)

    for e, where in placed:
        for a in sorted(where):
            for v in var_inputs(e):
                owners = defined_in_open.get(v, set())
                if owners and a not in owners:
                    for b in list(owners):
                        close(b)
                    close(a)
            c = open_.get(a)
            if c is None:
                c = open_[a] = Chunk(a, phase, seq[0])
                seq[0] += 1
            c.eqns.append(e)
            for v in e.outvars:
                defined_in_open[v].add(a)
    for a in list(open_):
        close(a)
    return sorted(closed, key=lambda c: c.seq)


def chunk_interface(chunk: Chunk, read_elsewhere: set[Var], constvars: set[Var]) -> tuple[list[Var], list[Var]]:
    own: set[Var] = set()
    inputs: list[Var] = []
    for e in chunk.eqns:
        for v in var_inputs(e):
            if v not in own and v not in constvars and v not in inputs:
                inputs.append(v)
        own.update(e.outvars)
    outputs = [v for e in chunk.eqns for v in e.outvars if v in read_elsewhere]
    return inputs, outputs
