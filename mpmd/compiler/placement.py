"""Place the step's equations outside the microbatch loop on actors, and group them into units. Pure.

Vars here are canonical (the caller resolves aliases first). Rules:

* **After the loop, placement follows the owner.** An equation runs where its located inputs (gradient
  sums, parameters the loop reads, values placed before) all are: a parameter's update, its optimizer state
  and everything else reading it stay on the actor of the stage that uses it. Inputs located on different
  actors: the equation runs where most of their bytes are — on every such actor when they tie, which is
  how the two halves of a shared weight's gradient are combined once per step and every replica gets the
  same update (a reduction over the owning actors). A `lax.cond` over many leaves (`optax.MultiSteps`) is
  first split into one cond per group of leaves that share no large operand, so each group follows its own
  owner; small operands (the predicate, step counters) are sent to every group.
* Equations reading no located value (an optimizer's step count, a learning-rate schedule) run on every
  actor that needs their results.
* **Before the loop**, an equation runs wherever its results are needed (cheap casts, transposes and
  slices of parameters are recomputed there rather than sent), except a reduction (its result much smaller
  than an input), which runs where that input is, so only its small result moves.
* Consecutive equations on one actor become one unit (one executable), cut only where a unit must wait
  for a value another actor is still computing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.extend.core import ClosedJaxpr, Literal, Var

from mpmd.compiler.eqns import is_var, nbytes, var_inputs

log = logging.getLogger(__name__)

SMALL_BYTES = 1 << 12  # operands this small are sent to every split group (predicates, counters, scalars)
SHRINK = 4  # a "reduction": its result is at least this many times smaller than its largest input


@dataclass
class Chunk:
    actor: int
    phase: str  # "pre" or "post"
    seq: int
    eqns: list[Any] = field(default_factory=list)


def _outs(e: Any) -> list[Var]:
    return [v for v in e.outvars if is_var(v)]


# ---- after the loop ------------------------------------------------------------------------------------
def place_post(post: Sequence[Any], loc: dict[Var, set[int]], need: dict[Var, set[int]], step_outputs: set[Var],
               all_actors: set[int]) -> list[tuple[Any, set[int]]]:
    """Placement of the equations after the loop. `loc` holds where located values live (loop results,
    parameters the loop reads; updated in place); `need` collects which actors need each earlier value
    (updated in place)."""
    placed: dict[int, set[int]] = {}
    for i, e in enumerate(post):
        located = [(v, loc[v]) for v in var_inputs(e) if v in loc]
        if not located:
            continue
        # Small operands (a clipping scale, a step count) do not pin a large one: they are sent where it is. (A
        # global norm summed up on one actor made a tied weight's update run there alone, the other replica's
        # actor receiving the weight every step: a probe.)
        large = [(v, w) for v, w in located if nbytes(v) > SMALL_BYTES] or located
        common = set.intersection(*(set(w) for _, w in large))
        if common:
            where = common
        else:
            weights: dict[int, int] = defaultdict(int)
            for v, w in located:
                for a in w:
                    weights[a] += nbytes(v) + 1
            top = max(weights.values())
            where = {a for a, wt in weights.items() if wt == top}
            moved = [(str(v), sorted(w)) for v, w in located if not w & where]
            log.debug("after the loop, %s runs on actors %s; moving %s", e.primitive.name, sorted(where), moved)
        placed[i] = where
        for v in _outs(e):
            loc[v] = set(where)
    _prune_unread(post, placed, step_outputs, loc)
    _place_floating(post, placed, need, step_outputs, all_actors, loc)
    return [(e, placed[i]) for i, e in enumerate(post) if placed.get(i)]


def _prune_unread(eqns: Sequence[Any], placed: dict[int, set[int]], step_outputs: set[Var], loc: dict[Var, set[int]]) -> None:
    """Drop the actors where a placed equation's results are read by nothing (walking backwards): a partial sum
    placed on every actor whose operands it joined, read on one only, ran on the others for nothing (a Run
    with no outputs). A result some equation reads on another actor keeps every placement, one being its
    source; step outputs and equations without results or with effects keep theirs."""
    read_on: dict[Var, set[int]] = defaultdict(set)
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        where = placed.get(i)
        if where is None:
            continue
        outs = _outs(e)
        if outs and not e.effects and not any(v in step_outputs for v in outs):
            readers = set().union(*(read_on.get(v, set()) for v in outs))
            keep = where & readers
            if keep and readers <= where and keep != where:
                log.debug("after the loop, %s runs on actors %s only (its results are unread on %s)", e.primitive.name,
                          sorted(keep), sorted(where - keep))
                placed[i] = where = keep
                for v in outs:
                    loc[v] = set(keep)
        for v in var_inputs(e):
            read_on[v] |= where


def _place_floating(eqns: Sequence[Any], placed: dict[int, set[int]], need: dict[Var, set[int]], step_outputs: set[Var],
                    all_actors: set[int], loc: dict[Var, set[int]]) -> None:
    """Equations not yet placed run wherever their results are needed (walking backwards); every placed
    equation adds its inputs' needs."""
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        if i not in placed:
            where: set[int] = set()
            for v in _outs(e):
                where |= need.get(v, set())
                if v in step_outputs and not need.get(v):
                    where |= _home_for_output(v, all_actors)
            placed[i] = where
            for v in _outs(e):
                loc[v] = set(where)
        for v in var_inputs(e):
            if v not in loc or not loc[v] >= placed[i]:
                need[v] |= placed[i]


def _home_for_output(v: Var, all_actors: set[int]) -> set[int]:
    """Where a step output nobody else reads is computed: everywhere if small (it may be read anywhere next
    step), else on actor 0."""
    return set(all_actors) if nbytes(v) <= 1 << 16 else {min(all_actors)}


# ---- before the loop -----------------------------------------------------------------------------------
def place_pre(pre: Sequence[Any], need: dict[Var, set[int]], step_outputs: set[Var], all_actors: set[int],
              hints: dict[Var, set[int]]) -> list[tuple[Any, set[int]]]:
    """Placement of the equations before the loop: wherever their results are needed, except reductions,
    which run where their big input is (`hints`: where values naturally are). Updates `need`."""
    hint: dict[Var, set[int]] = dict(hints)
    for e in pre:  # where each value naturally is: with the largest hinted input it is computed from
        ins = [v for v in var_inputs(e) if v in hint]
        if ins:
            big = max(ins, key=nbytes)
            for v in _outs(e):
                hint.setdefault(v, hint[big])
    out = []
    for e in reversed(pre):
        where: set[int] = set()
        for v in _outs(e):
            where |= need.get(v, set())
            if v in step_outputs and not need.get(v):
                where |= hint.get(v) or _home_for_output(v, all_actors)
        if not where:
            continue
        ins = var_inputs(e)
        if ins:
            big = max(ins, key=nbytes)
            out_bytes = sum(nbytes(v) for v in _outs(e))
            if big in hint and out_bytes * SHRINK <= nbytes(big):
                home = hint[big]
                where = (where & home) or {min(home)}
        for v in ins:
            need[v] |= where
        out.append((e, where))
    return out[::-1]


# ---- splitting a cond over many leaves ------------------------------------------------------------------
def _deps(jaxpr: Any) -> list[set[int]]:
    """For each output of `jaxpr`, the input positions it depends on."""
    dep: dict[Any, set[int]] = {v: {i} for i, v in enumerate(jaxpr.invars)}
    for e in jaxpr.eqns:
        d: set[int] = set()
        for v in var_inputs(e):
            d |= dep.get(v, set())
        for v in e.outvars:
            dep[v] = d
    return [set() if isinstance(v, Literal) else set(dep.get(v, set())) for v in jaxpr.outvars]


def split_conds(eqns: Iterable[Any]) -> list[Any]:
    """Each `cond` whose outputs form independent groups (sharing no operand larger than SMALL_BYTES) becomes
    one cond per group; other equations pass through."""
    out: list[Any] = []
    for e in eqns:
        out.extend(_split_cond(e) if e.primitive.name == "cond" else [e])
    return out


def _split_cond(e: Any) -> list[Any]:
    from jax._src.interpreters import partial_eval as pe

    branches = e.params.get("branches")
    if not branches or any(not isinstance(b, ClosedJaxpr) or b.consts for b in branches):
        return [e]
    ops = e.invars[1:]
    n_out = len(e.outvars)
    deps = [set() for _ in range(n_out)]
    for b in branches:
        for j, d in enumerate(_deps(b.jaxpr)):
            deps[j] |= d
    parent = list(range(n_out))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[int, int] = {}
    for j in range(n_out):
        for k in deps[j]:
            if isinstance(ops[k], Literal) or nbytes(ops[k]) <= SMALL_BYTES:
                continue
            if k in owner:
                parent[find(j)] = find(owner[k])
            else:
                owner[k] = j
    groups: dict[int, list[int]] = defaultdict(list)
    for j in range(n_out):
        groups[find(j)].append(j)
    if len(groups) <= 1:
        return [e]
    out = []
    for outs in groups.values():
        used_out = [j in outs for j in range(n_out)]
        used_in = [False] * len(ops)
        for b in branches:
            _, used = pe.dce_jaxpr(b.jaxpr, used_out)
            used_in = [x or y for x, y in zip(used_in, used)]
        new_branches = tuple(ClosedJaxpr(pe.dce_jaxpr(b.jaxpr, used_out, instantiate=used_in)[0], ()) for b in branches)
        invars = [e.invars[0], *(op for op, u in zip(ops, used_in) if u)]
        out.append(e.replace(invars=invars, outvars=[e.outvars[j] for j in outs], params={**e.params, "branches": new_branches}))
    log.debug("split a cond with %d outputs into %d independent conds", n_out, len(out))
    return out


# ---- units ----------------------------------------------------------------------------------------------
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
