"""Executables and Programs on actors: lower a function once, ship its blob to an actor once per way of
compiling it, and ship Programs. The actor compiles and caches by content hash (actors/cache.py); this side
remembers what each actor has so that a step's second call sends nothing but the call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpmd.compiler.avals import unwrap_out, wire_aval, wrap_in
from mpmd.compiler.inline import inline_calls
from mpmd.compiler.lowering import rebind_constraints, serialize_flat, without_callers_mesh
from mpmd.compiler.program import Program, encode_program
from mpmd.errors import MpmdError
from mpmd.runtime.controller import ActorConnection
from mpmd.runtime.sharding import layout_from_wire, layout_wire
from transport.protocol import MAX_IDS

LOWERED_KEPT = 256  # functions `actor.run` keeps lowered (the most recently run)
RUN_KEPT = 64  # executables `actor.run` keeps compiled on each actor (the most recently run)


async def _quietly(request: Any) -> None:
    try:
        await request
    except Exception:  # noqa: BLE001 - an actor lost or replaced meanwhile holds none of it any more
        pass


class Executables:
    """What this controller has lowered, and what each actor has compiled for it."""

    def __init__(self, conns: list[ActorConnection]) -> None:
        self._conns = conns  # the mesh's list: a reconnect replaces an entry in place
        # (the last LOWERED_KEPT functions run: a loop of `actor.run(jax.jit(lambda ...))`, a new function each
        # time, kept every one and its blob for the mesh's life; a probe)
        self._lowered: collections.OrderedDict[Any, tuple[bytes, Any]] = collections.OrderedDict()
        self.compiled: list[dict[tuple, Any]] = [{} for _ in conns]
        self._program_ids = itertools.count(1)
        # Which step signatures (holders, `new_holder`) use each executable of each actor (`actor.run`'s: the runs
        # under way, and the last RUN_KEPT run, `for_run`). One no holder uses any more is let go of, here and in the actor's session (`release`): a session
        # that kept seeing new shapes grew by every signature's executables (0.17 MB each) until it ended.
        self._holders: dict[tuple[int, str], set[int]] = {}
        self._held_by: dict[int, set[tuple[int, str]]] = {}
        self._kept: set[tuple[int, str]] = set()
        self._holder_ids = itertools.count(1)
        self._open: set[int] = set()  # holders not yet released (a compile may answer after its signature's release)
        # compiles asked of an actor and not yet answered, per (actor, way of compiling): an executable let go of
        # meanwhile is not unloaded while another signature's compile of it is under way (the actor would add it for
        # that compile, then drop it: the second signature's Program named an executable its session lacked)
        self._asked: collections.Counter[tuple[int, tuple]] = collections.Counter()
        # `actor.run`'s executables: the last RUN_KEPT run on each actor, each with a holder of its own (a loop of
        # `actor.run(jax.jit(lambda ...))` compiled a new one every call, kept in the actor's session for good)
        self._recent_runs: list[collections.OrderedDict[str, int]] = [collections.OrderedDict() for _ in conns]

    def forget(self, actor: int) -> None:
        """The actor was replaced by a new daemon: it has compiled nothing of ours."""
        self.compiled[actor] = {}
        self._holders = {k: v for k, v in self._holders.items() if k[0] != actor}
        self._kept = {k for k in self._kept if k[0] != actor}
        for kept in self._recent_runs[actor].values():  # (the holders of what the old daemon had: nothing now)
            self._open.discard(kept)
            self._held_by.pop(kept, None)
        self._recent_runs[actor] = collections.OrderedDict()

    def new_holder(self) -> int:
        """A token for one step signature's executables (`ensure_compiled(..., holder=)`, `release`)."""
        holder = next(self._holder_ids)
        self._open.add(holder)
        return holder

    def release(self, holder: int) -> dict[int, list[str]]:
        """`holder` (a step signature let go) uses its executables no more: those nobody else holds are forgotten
        here (compiled again when next needed) and returned per actor, for the actors to let go of (on the
        controller loop, in order with `ensure_compiled`, so a compile under way holds what it found)."""
        gone: dict[int, list[str]] = {}
        self._open.discard(holder)
        for ak in self._held_by.pop(holder, ()):
            users = self._holders.get(ak)
            if users is None or holder not in users:  # (held before the actor was replaced: that one is gone)
                continue
            users.discard(holder)
            if not users and ak not in self._kept:
                if any(self._asked[(ak[0], how)] for how, v in self.compiled[ak[0]].items() if (v if isinstance(v, str) else v[0]) == ak[1]):
                    continue  # (another signature's compile of it is under way: that one holds it once answered)
                del self._holders[ak]
                gone.setdefault(ak[0], []).append(ak[1])
        for actor, keys in gone.items():
            dead = set(keys)
            self.compiled[actor] = {h: v for h, v in self.compiled[actor].items() if (v if isinstance(v, str) else v[0]) not in dead}
        return gone

    async def ensure_compiled(self, actor: int, blob: bytes, donate: tuple[int, ...] = (), in_layouts: tuple | None = None,
                              out_layouts: tuple | None = None, holder: int | None = None) -> Any:
        """Ship `blob` to `actor` unless it has it compiled this way; returns the actor's executable key. The
        actor compiles it letting the inputs at `donate` share their buffers with outputs. With `in_layouts`
        (multi-device actors: one layout per input; `out_layouts` fixes some outputs', None lets XLA choose)
        it returns (key, the layouts of every output). `holder`: the step signature that uses it (None: kept for
        good)."""
        digest = hashlib.sha256(blob).hexdigest()
        how = (digest, donate, in_layouts, out_layouts)  # (by digest: the blob itself was kept once per key, for good)
        known = self.compiled[actor].get(how)
        if known is None:
            fields: dict[str, Any] = {"digest": digest, "donate": list(donate)}
            if in_layouts is not None:
                fields["in_layouts"] = [layout_wire(x) for x in in_layouts]
                fields["out_layouts"] = [layout_wire(x) for x in (out_layouts or ())]
            self._asked[(actor, how)] += 1
            try:
                msg = await self._conns[actor].request("compile", fields, [np.frombuffer(blob, np.uint8)])
            finally:
                self._asked[(actor, how)] -= 1
                if not self._asked[(actor, how)]:
                    del self._asked[(actor, how)]
            key = msg.header["exe"]
            known = key if in_layouts is None else (key, [layout_from_wire(w) for w in msg.header["out_layouts"]])
            self.compiled[actor][how] = known
        ak = (actor, known if isinstance(known, str) else known[0])
        if holder is None:
            self._kept.add(ak)
        else:
            self._holders.setdefault(ak, set()).add(holder)
            self._held_by.setdefault(holder, set()).add(ak)
            if holder not in self._open:  # its signature failed to compile on another actor and was let go of while
                # this compile ran: what it made here is let go of too (it stayed in the session for good; a probe)
                self._unload(self.release(holder))
        return known

    async def for_run(self, actor: int, blob: bytes, in_layouts: tuple | None = None,
                      out_layouts: tuple | None = None) -> tuple[Any, int]:
        """`ensure_compiled` for `actor.run`: returns (what ensure_compiled returns, a holder the caller keeps while its
        run is under way and gives back with `done_running`). The last RUN_KEPT executables run on each actor stay
        compiled; an older one is let go of once no run under way holds it (compiled again if run again)."""
        holder = self.new_holder()
        try:
            known = await self.ensure_compiled(actor, blob, (), in_layouts, out_layouts, holder=holder)
        except BaseException:
            self.done_running(holder)
            raise
        key = known if isinstance(known, str) else known[0]
        recent = self._recent_runs[actor]
        if key in recent:
            recent.move_to_end(key)
        else:
            kept = recent[key] = self.new_holder()
            self._holders.setdefault((actor, key), set()).add(kept)
            self._held_by.setdefault(kept, set()).add((actor, key))
            while len(recent) > RUN_KEPT:
                self.done_running(recent.popitem(last=False)[1])
        return known, holder

    def done_running(self, holder: int) -> None:
        """Give back a holder of `for_run`: what nobody holds any more is unloaded from its actor."""
        self._unload(self.release(holder))

    def _unload(self, gone: dict[int, list[str]]) -> None:
        """Have each actor let go of the executables `gone` (`release`'s answer), the request sent now, on the loop: in
        order with any compile asked after it (sent a loop turn later, a compile of the same executable asked
        meanwhile went first, and the late unload took from the session what that compile had just put back; a review)."""
        for actor, keys in gone.items():
            try:
                sent = self._conns[actor].submit("unload_programs", {"programs": [], "executables": keys})
            except Exception:  # noqa: BLE001 - an actor lost or replaced meanwhile holds none of it any more
                continue
            asyncio.ensure_future(_quietly(sent))

    async def load_program(self, actor: int, program: Program, program_id: int, exe_keys: list[str]) -> None:
        """Ship one actor's Program (its Runs naming `exe_keys[i]` for executable i), constants as frames."""
        wire = encode_program(program, program_id, exe_keys)
        if len(wire["consts"]) > MAX_IDS:  # (the daemon's refusal said to split a request the user cannot: a review)
            raise MpmdError(f"the step's program on actor {actor} holds {len(wire['consts'])} constants (arrays the step "
                            f"closes over), more than the {MAX_IDS} one request carries; pass such arrays to the step as "
                            "arguments, or stack them into fewer arrays")
        await self._conns[actor].request("load_program", {"program": wire}, [program.consts[c] for c in wire["consts"]])

    def new_program_id(self) -> int:
        return next(self._program_ids)

    def lower(self, fn: Callable[..., Any], args: Sequence[Any], platform: str, traced_under: Any = None,
              actor_mesh: Any = None, callers_mesh: Any = None) -> tuple[bytes, Any]:
        """Export `fn` for these argument shapes once; returns (blob, (output treedef, output avals, the outputs'
        layouts a jax.jit's out_shardings give them or None: `_jit_out_layouts`)). The
        executable takes and returns arrays in their wire form (typed keys as key data). `fn` is traced under the
        abstract mesh `traced_under` (lowering.tracing_mesh) and with jax_enable_x64 as this thread has it; a
        concrete jax Mesh of the actors' shape in it is read as theirs (`rebind_constraints`, as a step's). A
        `callers_mesh` (the concrete mesh the caller set) of the actors' axes and shape is traced under instead,
        as jax.jit would be (`jax.jit(f, out_shardings=P(...))` needs a concrete one)."""
        if callers_mesh is not None and (actor_mesh is None or getattr(callers_mesh, "empty", True) or tuple(
                callers_mesh.axis_names) != tuple(actor_mesh.axis_names) or tuple(callers_mesh.devices.shape) != tuple(actor_mesh.shape)):
            callers_mesh = None
        elif callers_mesh is not None:  # (its axes Auto, as the actors' mesh's: jax.make_mesh's default Explicit axes
            # typed every traced value with its sharding, and even `jax.jit(lambda v: v * 2)` failed; a review)
            callers_mesh = jax.sharding.Mesh(callers_mesh.devices, callers_mesh.axis_names,
                                             axis_types=(jax.sharding.AxisType.Auto,) * len(callers_mesh.axis_names))
        leaves, treedef = jax.tree.flatten(args)
        avals = tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, weak_type=bool(getattr(x, "weak_type", False))) for x in leaves)
        key = (fn, treedef, avals, platform, traced_under, callers_mesh, bool(jax.config.jax_enable_x64))
        hit = self._lowered.get(key)
        if hit is not None:
            try:
                self._lowered.move_to_end(key)
            except KeyError:  # (another thread evicted it meanwhile: it was lowered, and that is what counts)
                pass
        else:
            out_tree_box: list[Any] = []
            # Traced here with the arguments' weak types, as jax.jit traces them (`bf16_array * 2.0` stays bf16, an
            # int8 wraps: the exported executable takes plain arrays, and gave float32, int32; a probe): the jaxpr
            # has promotion resolved, and says which outputs are weak.
            try:
                with without_callers_mesh(), (jax.set_mesh(callers_mesh) if callers_mesh is not None else
                                              jax.sharding.use_abstract_mesh(traced_under) if traced_under is not None
                                              else contextlib.nullcontext()):
                    closed, out_shapes = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(treedef, xs)), return_shape=True)(*avals)
                closed = rebind_constraints(closed, actor_mesh, traced_under, jit_shardings=True)
                out_layouts = _jit_out_layouts(closed, actor_mesh)
                if actor_mesh is not None:  # (a jax.jit's shardings over the actors' mesh exported the executable for
                    closed = inline_calls(closed)  # all its devices, which an actor's checker refused: its out_shardings
                    # are kept as the layouts the actor compiles the outputs for, as a step's out_shardings are)
            except ValueError as e:
                if "Non-hashable static arguments" not in str(e):
                    raise
                raise MpmdError("mesh.actor(i).run takes every argument as an array; a jitted function's static arguments "
                                "(static_argnums / static_argnames) cannot be passed to it: bind them first, "
                                "run(functools.partial(f, n=3), x) or run(jax.jit(functools.partial(f, n=3)), x)") from None
            out_specs, out_tree = jax.tree.flatten(out_shapes)

            def flat(*xs: Any) -> tuple[Any, ...]:
                args = [wrap_in(x, a.dtype) for x, a in zip(xs, avals)]
                out_leaves = [jnp.asarray(o) for o in jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)]
                out_tree_box.append((out_tree, [jax.ShapeDtypeStruct(o.shape, o.dtype, weak_type=bool(getattr(s, "weak_type", False)))
                                                for o, s in zip(out_leaves, out_specs)], out_layouts))
                return tuple(unwrap_out(o) for o in out_leaves)

            try:
                blob = serialize_flat(flat, [wire_aval(a) for a in avals], platform)
            except NotImplementedError as e:
                if "host_callbacks" not in str(e):
                    raise
                raise MpmdError(f"mesh.actor(i).run cannot send a function that calls back to Python (jax.debug.print, "
                                f"jax.pure_callback, io_callback: {e}); leave the callback out, or run it in a step "
                                "(mpmd.distributed), whose stages call back to the controller") from None
            hit = self._lowered[key] = (blob, out_tree_box[0])
            while len(self._lowered) > LOWERED_KEPT:
                self._lowered.popitem(last=False)
        return hit


def _jit_out_layouts(closed: Any, actor_mesh: Any) -> tuple | None:
    """The layouts over the actors' mesh that a function run whole by one jax.jit (`actor.run(jax.jit(f,
    out_shardings=...), x)`) gives its outputs (None each where it leaves them to XLA), or None: one device each, or
    not one jax.jit."""
    from jax.sharding import NamedSharding

    eqns = closed.jaxpr.eqns
    if actor_mesh is None or len(eqns) != 1 or eqns[0].primitive.name not in ("jit", "pjit"):
        return None
    if list(eqns[0].outvars) != list(closed.jaxpr.outvars):
        return None
    layouts = tuple(actor_mesh.canonical(s.spec) if isinstance(s, NamedSharding) else None
                    for s in eqns[0].params.get("out_shardings", ()))
    return layouts if len(layouts) == len(closed.jaxpr.outvars) and any(x is not None for x in layouts) else None
