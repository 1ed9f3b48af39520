"""A distributed step: trace once per signature, compile to Programs, then one request per actor a call."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import logging
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend.core import Var

from mpmd.compiler.avals import dtype_text, from_wire, host_value, is_key, jax_array, not_numeric, to_wire, wire_shape_dtype
from mpmd.compiler.inline import inline_calls
from mpmd.compiler.lowering import rebind_constraints, tracing_mesh, without_callers_mesh
from mpmd.compiler.plan import StepPlan, iter_lowered, plan_step
from mpmd.compiler.program import Send
from mpmd.errors import ActorDiedError, MpmdError, PipelineError, RemoteError, ScheduleError, callers_level
from mpmd.observe.report import PlacementReport, placement_report
from mpmd.primitives import tracing_distributed
from mpmd.runtime.aio import abortable, as_caller, callers_config, off_loop, start_in_worker, watch
from mpmd.runtime.array import HELD, RemoteArray
from mpmd.runtime.buffers import in_parts
from mpmd.runtime.callbacks import run_host_calls
from mpmd.runtime.controller import note_blocking
from mpmd.runtime.loader import LoadedLeaf, named_in_argument
from mpmd.runtime.sharding import infer_layouts, layout_to_spec, layout_wire, remote_sharding, tree_specs
from mpmd.runtime.waiters import note_upstream
from mpmd.schedules.builtin import not_a_schedule
from mpmd.schedules.override import noting_loops, use_schedule
from mpmd.static_leaves import Static, UnhashableStatic, hide, reveal
from transport.protocol import PACKED_DTYPES, dtype_name

log = logging.getLogger(__name__)
PROGRESS_EVERY = 5.0  # seconds between progress lines of a long compile (INFO on the "mpmd.step" logger)


class Progress:
    """Progress lines for long work: the first after PROGRESS_EVERY seconds, then one every PROGRESS_EVERY."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = self.last = time.perf_counter()

    def tick(self, status: str) -> None:
        t = time.perf_counter()
        if t - self.last >= PROGRESS_EVERY:
            self.last = t
            log.info("%s: %s (%.0f s so far)", self.what, status, t - self.start)


def wait_logged(futures: dict[Any, Any], what: str) -> dict[Any, Any]:
    """Each future's result, logging how many are done every PROGRESS_EVERY seconds while some are not."""
    import concurrent.futures as cf

    progress = Progress("compiling")
    pending = set(futures.values())
    while pending:
        _, pending = cf.wait(pending, timeout=PROGRESS_EVERY, return_when=cf.FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in futures.values()):
            break
        if pending:
            progress.last = 0.0
            progress.tick(f"{len(futures) - len(pending)}/{len(futures)} {what}")
    return {k: f.result() for k, f in futures.items()}


@dataclass(repr=False)
class CompiledStep:
    """A step compiled for one argument signature: its plan and the Programs the actors hold. `str` is the
    Programs (as `step.program(...)` prints them); `repr` one line (the dataclass's own printed every jaxpr
    equation: half a megabyte for a small model)."""

    plan: StepPlan
    program_ids: list[int]
    out_tree: Any
    compile_seconds: float
    arg_paths: list[str]
    loaded: list[Any] = field(default_factory=list)  # the Programs as the actors hold them (Runs name executable keys)
    generation: int = 0  # the mesh's `generation` when the Programs were loaded (a daemon restarted since has none)
    arg_outputs: tuple[int, ...] | None = None  # the argument leaves the step (or a host callback) gets as they are
    users: int = 0  # calls holding it between taking it and dispatching (its Programs are unloaded only when none)
    dropped: bool = False  # let go of (evicted, replaced, or of an older mesh generation): unloaded once `users` is 0
    holder: int | None = None  # its hold on the actors' executables (mpmd.runtime.executables), let go of with it

    def __repr__(self) -> str:
        return (f"<CompiledStep: {self.plan!r}, {len(self.arg_paths)} argument leaves, compiled in {self.compile_seconds:.2f} s; "
                f"print() it for the Programs>")

    def __str__(self) -> str:
        return str(self.plan)


def _refuse_leaked_tracers(closed: Any, name: str) -> None:
    """jax.jit's UnexpectedTracerError for a tracer of an earlier trace the step reads (kept by a side effect: a
    list.append or a global in the loss): make_jaxpr took it for a constant, and it failed later as 'Too many
    leaves for PyTreeDef' at export, or 'value ... produced nowhere' in the compiler (a probe)."""
    leaked = [c for c in closed.consts if isinstance(c, jax.core.Tracer)]
    if leaked:
        raise jax.errors.UnexpectedTracerError(
            f"{name} reads a traced value of an earlier trace ({leaked[0].aval.str_short()}, of a "
            f"{type(leaked[0]).__name__}): a value saved by a side effect (appended to a list, stored in a global or on "
            "an object) while a step or function was traced, used after that trace ended. Return the value from the "
            "step instead (jax.checking_leaks() finds where it escaped)")


def _lays_out(shardings: Any) -> bool:
    """Whether in_shardings / out_shardings lay anything out over devices: a PartitionSpec naming an axis, or a
    sharding object (None leaves and P() constrain nothing on an actor of one device)."""
    from jax.sharding import PartitionSpec

    leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return any(not isinstance(x, PartitionSpec) or any(a is not None for a in x) for x in leaves)


def eager(unknown: bool = True) -> bool:
    """Whether JAX traces nothing here (no jax.jit, grad, vmap, scan, ... under way in this thread); `unknown` on a
    JAX without this internal API (a step's call then relies on its arguments' tracer check; a marker marks)."""
    try:
        from jax._src import core
        return isinstance(core.trace_ctx.trace, core.EvalTrace)
    except (ImportError, AttributeError):
        return unknown


IN_TRANSFORMATION = ("a distributed step was called inside a JAX transformation (jax.jit, jax.grad, jax.vmap, lax.scan, "
                     "...), which cannot run its actors. Call the step outside any transformation; to transform the "
                     "computation, transform the undecorated function (jax.jit(fn) runs the same step on this process)")


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _spec(x: Any, path: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, RemoteArray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
    if isinstance(x, LoadedLeaf):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if isinstance(x, jax.core.Tracer):
        raise PipelineError(f"argument {path} is a JAX tracer ({type(x).__name__}): {IN_TRANSFORMATION}")
    # A Python number is weakly typed, as under jax.jit (`w - lr * g` keeps bf16 w bf16), and so is a jax.Array
    # made from one; numpy values are not.
    weak = (type(x) in (int, float, complex)) or bool(getattr(x, "weak_type", False) and isinstance(x, jax.Array))
    given = type(x).__name__
    if isinstance(x, Iterator) and not hasattr(x, "__array__"):
        # (np.asarray made it a 0-d object array and the hint said dtype=object: a generator is no array to convert)
        raise PipelineError(f"argument {path} is {_a(given)}, which is not a valid JAX type: a distributed step takes arrays "
                            "(and pytrees of them), not iterators; take the step's values from it first, e.g. "
                            "np.stack(list(it)) for a batch of [microbatches, ...], or next(it) for one")
    if isinstance(x, jax.ShapeDtypeStruct):  # (jax.jit's .lower takes one; host_value made it an object array)
        raise PipelineError(f"argument {path} is a ShapeDtypeStruct ({x.dtype}{list(x.shape)}): a shape without values, "
                            "and a distributed step (its compile too) takes the values it is called with: pass an array "
                            "of that shape, e.g. np.zeros(s.shape, s.dtype)")
    if isinstance(x, range):  # (as jax.jit: numpy would make it an int array)
        raise PipelineError(f"argument {path} is a range, which is not a valid JAX type: pass np.arange(...) (or the "
                            "range as a static argument)")
    original = x
    try:
        x = host_value(x)
        if not is_key(x.dtype) and x.dtype.kind in "mM":  # (jax.jit refuses datetimes; they reached the step's arithmetic; a probe)
            raise TypeError(f"a numpy array of dtype {x.dtype} (dates and times) holds no numbers JAX can use: encode it "
                            "as numbers, e.g. x.astype(np.int64) (units since the epoch)")
        if not is_key(x.dtype) and not x.dtype.isnative:  # (jax.jit refuses it; lowering failed inside, with no path; a probe)
            raise TypeError(f"a numpy array of non-native byte order ({x.dtype.str}): JAX takes arrays in this machine's "
                            "order; pass x.astype(x.dtype.newbyteorder('='))")
        if x.dtype == np.dtype(object) and not isinstance(original, np.ndarray):  # (numpy made an object array of it)
            raise TypeError("a step takes arrays, numbers, and pytrees (lists, tuples, dicts, dataclasses registered with "
                            "jax.tree_util) of them")
        if x.dtype == np.dtype(object):  # (canonicalize_dtype lets it through; jax.jit refuses it)
            raise TypeError("a numpy array of Python objects (dtype=object) holds no numbers JAX can use: build it with "
                            "a numeric dtype, e.g. np.asarray(x, np.float32), or stack its elements with np.stack")
        if not is_key(x.dtype) and not_numeric(x.dtype):  # (canonicalize_dtype lets strings through too)
            raise TypeError(f"a numpy array of dtype {x.dtype} holds no numbers JAX can use: pass it as a static argument "
                            "(static_argnums / static_argnames: a hashable value such as a str or a tuple), or encode it as numbers")
        if not is_key(x.dtype):
            jax.dtypes.canonicalize_dtype(x.dtype)
    except OverflowError as e:  # (jax.jit raises OverflowError too)
        raise OverflowError(f"argument {path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise PipelineError(f"argument {path} is {_a(given)}, which is not a valid JAX type: {e}") from None
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, weak_type=weak)


def _tree_paths(treedef: Any) -> list[Any]:
    dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    return [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _is_remote(x: Any) -> bool:
    return isinstance(x, RemoteArray)


def _parameters(fn: Callable[..., Any]) -> tuple[list[str], list[str]]:
    """(positional parameter names, keyword-only parameter names) of `fn`. A step's compiled form takes one
    tuple of arguments: the positional ones, then the keyword-only ones in signature order. With *args the
    positions of keyword-only parameters are not fixed: none are counted (they stay refused, see `bind`)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return [], []
    positional = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return positional, []
    return positional, [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _static_argnums(fn: Callable[..., Any], argnums: Any, argnames: Any, what: str = "static") -> frozenset[int]:
    """jax.jit's static_argnums and static_argnames (or donate_argnums and donate_argnames) as one set of
    positions (names through fn's signature; a keyword-only parameter's position comes after the positional
    ones, see `_parameters`)."""
    if not isinstance(argnums, int) and argnums is not None and not isinstance(argnums, (list, tuple, set, frozenset, range)):
        raise PipelineError(f"{what}_argnums must be ints (argument positions), got {argnums!r:.60}")  # (1.5: "'float' object
        # is not iterable"; a probe)
    nums = {argnums} if isinstance(argnums, int) else set(argnums or ())
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise PipelineError(f"{what}_argnums must be ints (argument positions), got {argnums!r}")
    if not isinstance(argnames, str) and not (isinstance(argnames, (list, tuple, set, frozenset)) and all(
            isinstance(n, str) for n in argnames)) and argnames is not None:  # (3: "'int' object is not iterable"; a probe)
        raise PipelineError(f"{what}_argnames must be parameter names (a str, or a sequence of them), got {argnames!r:.60}; "
                            f"positions go in {what}_argnums")
    names = [argnames] if isinstance(argnames, str) else list(argnames or ())
    if names:
        positional, kwonly = _parameters(fn)
        params = positional + kwonly
        for name in names:
            if name not in params:
                raise PipelineError(f"{what}_argnames names {name!r}, which is not a parameter of "
                                    f"{getattr(fn, '__name__', 'the step')} (its parameters: {params})")
            nums.add(params.index(name))
    try:
        sig = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # (no signature to read: a position past a call's arguments marks nothing there)
        sig = None
    if sig is not None and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig):
        positional, kwonly = _parameters(fn)
        count = len(positional) + len(kwonly)
        wrong = sorted(i for i in nums if not -count <= i < count)
        if wrong:  # (as jax.jit: a position the step does not have would silently mark nothing)
            raise PipelineError(f"{what}_argnums={sorted(nums)}: {getattr(fn, '__name__', 'the step')} takes {count} "
                                f"argument{'s' * (count != 1)} ({', '.join(positional + kwonly) or 'none'}), so position"
                                f"{'s' * (len(wrong) != 1)} {wrong} name{'s' * (len(wrong) == 1)} none of them; count from 0")
    return frozenset(nums)


def _no_remote_bound(fn: Any) -> None:
    """A PipelineError when `fn` is a functools.partial (jax.tree_util.Partial too) binding a RemoteArray by position:
    the step cannot send it to its actors from there (one bound by keyword is an argument, `bind`)."""
    while isinstance(fn, functools.partial):
        for k, a in enumerate(fn.args):
            if any(_is_remote(x) for x in jax.tree.leaves(a, is_leaf=_is_remote)):
                raise PipelineError(f"mpmd.distributed: {type(fn).__name__}({getattr(fn.func, '__name__', 'f')}, ...) binds a "
                                    f"RemoteArray as its positional argument {k}: its value is on the actors, which the step "
                                    "can only reach through its arguments; pass it as an argument of the step, or bind it "
                                    "by keyword (functools.partial(f, name=x))")
        fn = fn.func


class _Default:
    """A parameter the call did not pass (see `DistributedFunction.bind`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<its default>"


DEFAULT = _Default()


def _static_arg(i: int, value: Any) -> Static:
    if any(_is_remote(x) for x in jax.tree.leaves(value, is_leaf=_is_remote)):  # (hashable by identity: a compile each)
        raise PipelineError(f"static argument args[{i}] holds a RemoteArray: a static argument is a Python value the "
                            "step is compiled for, not data; leave it out of static_argnums (it is then an argument like "
                            "any array)")
    try:
        hash(value)
    except TypeError:
        raise PipelineError(f"static argument args[{i}] is a {type(value).__name__}, which is not hashable: static arguments "
                            "key the compile cache, as under jax.jit (pass a tuple, or a frozen dataclass)") from None
    return Static(value)


def _unhashable_leaf(args: tuple[Any, ...], value: Any) -> PipelineError:
    """The error for an argument leaf kept static (not an array: mpmd/static_leaves.py) that cannot be hashed."""
    flat, _ = jax.tree_util.tree_flatten_with_path(hide(args, _is_remote), is_leaf=lambda x: isinstance(x, Static))
    where = next((f"args{jax.tree_util.keystr(p)}" for p, x in flat if isinstance(x, Static) and x.value is value), "an argument leaf")
    return PipelineError(
        f"{where} is {_a(type(value).__name__)}, which is not hashable: a leaf that is not an array (in an equinox "
        "Module, or a callable anywhere) is static, as under eqx.filter_jit, and static values key the compile "
        "cache — by identity, a value changed in place would reuse the old compile. Make it hashable (a frozen "
        "dataclass, a tuple, a NamedTuple), or pass what changes as an array")


def arg_paths(args: tuple[Any, ...]) -> list[str]:
    """Each flat argument's pytree path, as jax.jit names them: `params['blocks'][3]['w']`; `args` with its static
    leaves hidden (DistributedFunction._hidden), which have none."""
    flat, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_remote)
    out = []
    for path, _ in flat:
        text = jax.tree_util.keystr(path)  # "[0]['w']": the position in the argument tuple comes first
        out.append(f"args{text}")
    return out


def _host_layout(am: Any, x: jax.Array, shape: tuple[int, ...], replicated: Any = None) -> Any:
    """The layout of a jax.Array sharded over a mesh like every actor's (the same axis names and sizes; `replicated`
    when it is replicated over it), else None."""
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or dict(getattr(mesh, "shape", {})) != dict(zip(am.axis_names, am.shape)):
        return None
    layout = am.canonical(sharding.spec)
    try:
        am.check_spec(layout_to_spec(layout), shape, "")
    except (MpmdError, ValueError):
        return None
    return layout or replicated


def _variables(tree: Any) -> list[tuple[str, Any, Any]]:
    """(path, Variable, its value) for every flax nnx Variable in `tree` (none when flax is not imported)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return []
    try:
        found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    except Exception:  # (a tree jax cannot walk is reported where the step's arguments are read)
        return []
    return [(jax.tree_util.keystr(p), v, v.get_value()) for p, v in found if isinstance(v, nnx.Variable)]


def _named(path: str, names: list[str]) -> str:
    """A path into the step's argument tuple ('[0].a.kernel') with the parameter's name ('model.a.kernel')."""
    head, _, rest = path.partition("]")
    i = int(head[1:]) if head[1:].isdigit() else -1
    return f"{names[i]}{rest}" if 0 <= i < len(names) else path


def _warn_lost_updates(fn: Any, names: list[str], before: list[tuple[str, Any, Any]], outs: list[Any]) -> None:
    """Warn when the step set nnx Variables of its arguments in place (`optimizer.update(model, grads)`) and returned
    none of the new values: as under jax.jit, such updates do not outlive the step (nnx.jit writes them back)."""
    returned = {id(x) for x in outs}
    rng_state = getattr(sys.modules.get("flax.nnx"), "RngState", ())
    # (a Variable holding no arrays, e.g. optax's MaskedNode in a masked-out slot that each update replaces with a
    # new one, loses nothing: a probe saw the warning for optax.multi_transform over nnx Params)
    now = [(path, var.get_value(), old, isinstance(var, rng_state)) for path, var, old in before
           if jax.tree.leaves(var.get_value()) or jax.tree.leaves(old)]
    # A step that changes nothing but random streams' counts (an eval step: they move on in eval mode too) trains
    # nothing to lose; beside other updates (a train step returning only its Params), a lost count repeats masks.
    trains = any(new is not old for _, new, old, rng in now if not rng)
    lost = [_named(path, names) for path, new, old, rng in now if new is not old and id(new) not in returned and (trains or not rng)]
    if lost:
        name = getattr(fn, "__name__", "the step")
        warnings.warn(f"{name} updates {len(lost)} nnx Variable(s) of its arguments in place (e.g. {', '.join(lost[:3])}) but "
                      "does not return their new values: as under jax.jit, those updates are lost when the step returns, so "
                      "the next call starts from the old values. Return the updated state (e.g. nnx.state(model), "
                      "nnx.state(optimizer)) and nnx.update the objects with it, or pass and return nnx.split state "
                      "(nnx.jit writes in-place updates back; jax.jit and mpmd.distributed do not)", UserWarning, stacklevel=callers_level())


class _Interrupted(Exception):
    """A compile was interrupted in its own thread (KeyboardInterrupt, SystemExit): a thread waiting for it
    compiles itself rather than fail of it."""


def _is_jitted(fn: Any) -> bool:
    """Whether `fn` is what jax.jit returns (a cache of traces whose `__wrapped__` is the function itself)."""
    return type(fn).__name__ == "PjitFunction" and callable(getattr(fn, "__wrapped__", None))


def _actor_mesh_error(e: ValueError, am: Any, traced_under: Any) -> PipelineError | None:
    """A PipelineError saying what to write for JAX's errors about the mesh a step traced under (None: another error)."""
    where = (f"its actors' mesh of shape {tuple(am.shape)} named {tuple(am.axis_names)}" if am is not None else
             "its actors' one device each" + (f" (traced over the axes {tuple(traced_under.axis_names)}, each of size 1)"
                                              if traced_under is not None else ""))
    text = str(e).split("\n")[0]
    if "should match the mesh passed to shard_map" in text:
        return PipelineError(f"a shard_map in the step was given a jax Mesh other than {where} ({text}; the actors' axes are "
                             "AxisType.Auto, so a Mesh of Explicit axes, jax.make_mesh's default, differs in them too): write "
                             "jax.shard_map(f, in_specs=..., out_specs=...) without mesh= (it takes each actor's mesh), or give "
                             "the actors that mesh (RemoteMesh.local(..., mesh_shape=..., axis_names=...))")
    if "of type Auto" in text and "axis name" in text:
        return PipelineError(f"explicit sharding in the step ({text}): the step runs on {where}, whose axes are automatic "
                             "(AxisType.Auto, as jax.jit's were before Explicit axes); jax.sharding.reshard and out_sharding= "
                             "naming mesh axes need Explicit axes, which actors do not build: write "
                             "jax.lax.with_sharding_constraint(x, spec) instead (the same layout)")
    return None


def _warn_debug_checks() -> None:
    """A warning (at the caller's line, once there by Python's default filter) when jax_debug_nans / _infs is on:
    the actors do not check what a step computes."""
    checks = [f for f in ("jax_debug_nans", "jax_debug_infs") if getattr(jax.config, f, False)]
    if checks:
        warnings.warn(f"{' and '.join(checks)} is set, but the actors do not check the values this step computes (a NaN "
                      "is returned, not raised): check what you fetch (jnp.isfinite(loss)), or run the step under "
                      "jax.jit to find where a NaN appears", stacklevel=callers_level())


MAX_SIGNATURES = 128  # argument signatures a distributed function keeps compiled (and loaded on its actors)


def _kept_layouts(plan: StepPlan, out_tree: Any, sig: Any) -> dict[Any, Any]:
    """State keeps its layout across steps: each output made on the actors at the pytree path of an argument of its
    shape and dtype (`params` returned where `params` came in) is laid out as that argument, as jax.jit's sharding
    propagation keeps it (XLA chose the update's layout alone: a parameter came back replicated, then in its
    gradient's layout; a probe). Not for a replicated argument (a host value's default layout) nor for an output a
    with_sharding_constraint makes: those go as XLA and the constraint say (a review)."""
    treedef, specs, layouts = sig[:3]
    if layouts is None:
        return {}

    def paths(tree: Any) -> list[tuple]:
        return [k for k, _ in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(tree, list(range(tree.num_leaves))))[0]]

    args = {p: (spec[0], spec[1], lay) for p, spec, lay in zip(paths(treedef), specs, layouts)}
    out = {}
    for i, (path, (kind, _), key, aval) in enumerate(zip(paths(out_tree), plan.out_homes, plan.out_keys, plan.out_avals)):
        arg = args.get(path)
        if (kind == "actors" and arg is not None and arg[2] != () and i not in plan.constrained_outputs
                and tuple(aval.shape) == tuple(arg[0]) and dtype_text(aval.dtype) == arg[1]):
            out[key] = arg[2]  # (not a replicated one, which host values take by default, nor one the step constrains)
    return out


def _unload(mesh: Any, compiled: list[CompiledStep]) -> None:
    """`compiled`'s Programs go from the actors (any thread; nothing once the mesh is gone or without one)."""
    unload = getattr(mesh, "unload_programs", None)
    if unload is not None and compiled:
        unload(sorted({pid for c in compiled for pid in c.program_ids}), [c.holder for c in compiled if c.holder is not None])


def _unload_all(mesh_ref: Any, compiled: dict[Any, CompiledStep]) -> None:
    """A distributed function is gone: every Program of its signatures goes from the actors."""
    _unload(mesh_ref(), list(compiled.values()))


class ShallowCopyOnly:
    """A copy.copy is shallow (the same mesh, the same compiled steps); a deep copy or a pickle raises a TypeError
    saying `_not_pickled()` (they said "cannot pickle '_io.BufferedWriter' object"; a probe)."""

    def _not_pickled(self) -> str:
        raise NotImplementedError

    def __copy__(self) -> Any:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        # The copy shares what the original holds (a step's compiled Programs, unloaded from the actors when the
        # original is collected: a copy whose original was dropped failed every call with "no program 1"; a probe).
        new.__dict__["_copied_from"] = self.__dict__.get("_copied_from", self)
        return new

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(self._not_pickled())

    def __reduce__(self) -> Any:
        raise TypeError(self._not_pickled())


try:  # (imported once, not on every call: the key is computed per call)
    from jax._src.config import trace_context as _trace_context
except ImportError:
    _trace_context = None


def _jax_context() -> Any:
    """JAX's configuration a trace depends on (x64, default PRNG implementation, promotion rules, ...), as jax.jit keys
    its cache by: a step compiled under one ran unchanged under another (`with jax.enable_x64(True):` gave the old
    program's float32; threefry_partitionable its old random bits; a probe). These contexts are per thread."""
    return _trace_context() if _trace_context is not None else jax.config.jax_enable_x64  # (a JAX without it: x64 at least)


class LoadCount:
    """The calls a step has dispatched (a recovery's replays and calls refused before they are sent are not
    counted): the step number its `mpmd.loaded_by_actors` leaves are loaded for. Shared by the steps
    `with_schedule` makes; callers in several threads."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self._lock = threading.Lock()

    def take(self) -> int:
        """The number for a call being dispatched (the next call gets the one after)."""
        with self._lock:
            self.value += 1
            return self.value - 1

    def give_back(self, taken: int) -> None:
        """A call that took `taken` was not sent: the next call loads it — unless another has taken one since."""
        with self._lock:
            if self.value == taken + 1:
                self.value = taken

    def set(self, value: int) -> None:
        with self._lock:
            self.value = value


class DistributedFunction(ShallowCopyOnly):
    """What `mpmd.distributed` returns. Call it like the original function."""

    def __init__(self, fn: Callable[..., Any], mesh: Any, in_shardings: Any = None, out_shardings: Any = None,
                 static_argnums: Any = (), static_argnames: Any = (), donate_argnums: Any = (), donate_argnames: Any = ()) -> None:
        if not callable(fn):
            raise TypeError(f"mpmd.distributed: the step must be a function, got {type(fn).__name__} {fn!r:.80}")
        schedule = None
        if isinstance(fn, DistributedFunction):  # a decorated step, distributed again (another mesh, other shardings):
            # its own function, with these options (as jax.jit of a jitted function) — and the schedule with_schedule
            # set, which is the step's, not an option of the call (it went back to the loop's own; a probe)
            fn, schedule = fn.fn, fn.schedule
        if mesh is None or isinstance(mesh, (str, bytes, int, float)) or not hasattr(type(mesh), "__len__"):
            raise TypeError(f"mpmd.distributed(..., mesh=...) needs the RemoteMesh the step runs on (e.g. "
                            f"mpmd.RemoteMesh.local(num_actors=2)), got {type(mesh).__name__} {mesh!r:.80}")
        self.fn = fn
        self.mesh = mesh
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.static_argnums = _static_argnums(fn, static_argnums, static_argnames)
        self.donate_argnums = _static_argnums(fn, donate_argnums, donate_argnames, "donate")
        self._positional, self._kwonly = _parameters(fn)
        n = len(self._positional) + len(self._kwonly)
        both = sorted({i % n for i in self.static_argnums if -n <= i < n} & {i % n for i in self.donate_argnums if -n <= i < n}
                      if n else self.static_argnums & self.donate_argnums)
        if both:  # (as jax.jit refuses: a static argument is no buffer to donate)
            raise PipelineError(f"mpmd.distributed: argument(s) {both} are both static and donated (static_argnums/names "
                                "and donate_argnums/names); a static argument holds no buffer to donate: name it in one")
        _no_remote_bound(fn)
        # the signatures compiled, least recently called first; past MAX_SIGNATURES the oldest is let go, its
        # Programs unloaded from the actors (each held ~4 MiB here and up to ~0.6 MiB on an actor for good; a probe)
        self._compiled: collections.OrderedDict[Any, CompiledStep] = collections.OrderedDict()
        try:  # (and all of them once this function is gone: tune's candidates, a step made per call)
            weakref.finalize(self, _unload_all, weakref.ref(mesh), self._compiled).atexit = False
        except TypeError:  # (a mesh stand-in that takes no weak reference)
            pass
        self._compiling: dict[Any, Any] = {}  # signature -> future of the compile under way (in any thread)
        self._async_compiles: dict[Any, Any] = {}  # signature -> the worker compiling it for call_async's callers
        self._compile_lock = threading.RLock()  # (callers in several threads: one compile per signature)
        self._cancelled: set[int] = set()  # steps aborted because their await was cancelled
        self._step = itertools.count()
        self._count = LoadCount()  # the calls dispatched: what loaders load (shared with the steps with_schedule makes)
        self._last_load = -1
        self.schedule: Any = schedule  # replaces the schedule the step names (see with_schedule)
        self._shardings_reading: str | None = None  # how a tuple of in_shardings is counted, once decided (`_per_argument`)
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__

    def _not_pickled(self) -> str:
        return (f"{self!r} holds its mesh (a connection to running daemons) and its compiled Programs, so it cannot be "
                "pickled or deep-copied: make it again with mpmd.distributed(fn, mesh=...) where it is needed")

    def __repr__(self) -> str:
        schedule = f", schedule={self.schedule}" if self.schedule is not None else ""
        return (f"<mpmd.distributed {getattr(self.fn, '__qualname__', type(self.fn).__name__)} on {self.mesh!r}{schedule}, "
                f"{len(self._compiled)} signature{'s' * (len(self._compiled) != 1)} compiled>")

    def _hidden(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """`args` with the static arguments and static leaves as Static nodes (mpmd/static_leaves.py)."""
        if self.static_argnums:
            n = len(args)
            static = {i % n for i in self.static_argnums if -n <= i < n}
            args = tuple(_static_arg(i, a) if i in static else a for i, a in enumerate(args))
        if any(a is DEFAULT for a in args):  # (a parameter not passed: static, its default is the function's)
            args = tuple(Static(a) if a is DEFAULT else a for a in args)
        try:
            return hide(args, _is_remote, hashable=True)
        except UnhashableStatic as e:
            raise _unhashable_leaf(args, e.value) from None

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The call's arguments as the one tuple a compiled step takes: keyword arguments bound to their
        positions in the step's signature, then its keyword-only parameters in order; a parameter the call does
        not pass is `DEFAULT` there (static: the function takes its own default, a Python value that is no
        argument, as under jax.jit)."""
        io = getattr(self.mesh, "_io", None)
        if io is not None:  # (a forked child: said now; tracing a new signature there hung in JAX's lowering; a probe)
            io.check_process()
        if not eager() and not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            # (arguments all constants: no tracer says it (`_spec` names the first); the step ran while jax.jit traced)
            raise PipelineError(f"{getattr(self.fn, '__name__', 'the step')}: {IN_TRANSFORMATION}")
        if not kwargs and not self._kwonly:
            return args
        name = getattr(self.fn, "__name__", "the step")
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise PipelineError(f"cannot bind the arguments of {name}: {e}") from None
        named = {*self._positional, *self._kwonly}
        extra = sorted(e for k, v in bound.arguments.items() if k not in named
                       for e in (v if bound.signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD else [k]))
        if extra:  # (named: the keyword ones; *args alone is taken, by position)
            said = [k for k in extra if bound.signature.parameters.get(k) is None
                    or bound.signature.parameters[k].kind is not inspect.Parameter.VAR_POSITIONAL] or extra
            raise PipelineError(f"argument(s) {said} of {name} go to its **kwargs or follow *args: a distributed step "
                                "takes named parameters (positional or keyword-only); name them, or close over them")
        got, params = bound.arguments, bound.signature.parameters
        static = {[*self._positional, *self._kwonly][i] for i in self.static_argnums if -len(named) <= i < len(named)}

        def unpassed(k: str) -> Any:
            # A static one is its default (the same Python value, the same compiled step as when passed); one holding
            # arrays (functools.partial(step, w=x), x a RemoteArray too) is an argument, as it was given to the step.
            default = params[k].default
            return default if k in static or any(_is_remote(x) or hasattr(x, "shape") for x in
                                                 jax.tree.leaves(default, is_leaf=_is_remote)) else DEFAULT

        return tuple(got[k] if k in got else unpassed(k) for k in [*self._positional, *self._kwonly])

    def _invoke(self, args: tuple[Any, ...], fn: Any = None) -> Any:
        """Call the step's function (or `fn` in its place) on the tuple `bind` made (keyword-only parameters by
        name; a `DEFAULT` left out, so that the function's own default applies)."""
        fn = self.fn if fn is None else fn
        n = len(self._positional)
        if not self._kwonly and not any(a is DEFAULT for a in args):
            return fn(*args)
        given = 0  # the leading positional arguments passed; a later one passed goes by name after a DEFAULT
        while given < min(n, len(args)) and args[given] is not DEFAULT:
            given += 1
        by_name = {k: v for k, v in zip([*self._positional[given:], *self._kwonly], args[given:]) if v is not DEFAULT}
        return fn(*args[:given], **by_name)

    @staticmethod
    def jax_context() -> Any:
        """This thread's JAX config context, as the compile cache keys by it (what a recovery logs with each call)."""
        return _jax_context()

    def _signature(self, args: tuple[Any, ...], context: Any = None) -> tuple[Any, list[Any], list[jax.ShapeDtypeStruct]]:
        """(the compile cache's key, the data leaves, their specs); static leaves are in the key's treedef. `context`:
        the JAX config context to key by (default: this thread's; a recovery's replay gives the logged call's)."""
        args = self._hidden(args)
        leaves, treedef = jax.tree.flatten(args, is_leaf=_is_remote)
        if any(isinstance(x, LoadedLeaf) for x in leaves):  # a loader is told the leaf's path in the batch
            keys = [k for k, _ in jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_remote)[0]]
            leaves = [named_in_argument(x, k) if isinstance(x, LoadedLeaf) else x for x, k in zip(leaves, keys)]
        paths = arg_paths(args)
        for x, path in zip(leaves, paths):
            if isinstance(x, RemoteArray) and x.mesh is not self.mesh and hasattr(self.mesh, "check_owned"):
                self.mesh.check_owned(x, f"argument {path}")  # (before a compile, not after it)
        specs = [_spec(x, path) for x, path in zip(leaves, paths)]
        layouts = self._arg_layouts(args, leaves, paths, specs)
        key = (treedef, tuple((s.shape, dtype_text(s.dtype), s.weak_type) for s in specs), layouts,
               _jax_context() if context is None else context)
        return key, leaves, specs

    def _per_argument(self, args: tuple[Any, ...]) -> Any:
        """`in_shardings` with an entry for every position of `args` (the bound tuple, its static arguments and the
        parameters the call did not pass hidden as Static): as jax.jit counts them, a sequence gives one entry per
        argument that is not static (a None goes in at each static position), and parameters the call left to their
        defaults need none (`step(w, batch=b)` of `f(w, batch, scale=1.0)`: two entries, as for `step(w, b)`). A
        sequence with an entry for every position is taken as it is."""
        given = self.in_shardings
        if not isinstance(given, (tuple, list)):
            return given
        n = len(args)
        static = {i % n for i in self.static_argnums if -n <= i < n}
        free = [i for i in range(n) if i not in static]
        unpassed = {i for i in free if isinstance(args[i], Static) and args[i].value is DEFAULT}
        if len(given) == n and not static and not unpassed:
            return given
        if len(given) == n:
            reading, at = "one per position", dict(enumerate(given))
        elif len(given) == len(free):
            reading, at = "one per argument not static", dict(zip(free, given))
        elif len(given) == len(free) - len(unpassed):
            reading, at = "one per argument not static", dict(zip([i for i in free if i not in unpassed], given))
        else:
            return given  # (tree_specs says how it does not fit)
        # One reading for every call: a tuple read one way for one call and the other for a call passing one more
        # argument would lay the arguments out shifted by one, silently (a review).
        if self._shardings_reading not in (None, reading):
            raise PipelineError(f"in_shardings has {len(given)} entries, read {self._shardings_reading} by an earlier call; this "
                                f"call's {n} arguments ({len(static)} static) would read them {reading}, shifted: give "
                                "in_shardings one entry per argument that is not static, as jax.jit counts them")
        self._shardings_reading = reading
        return tuple(at.get(i) for i in range(n))

    def _arg_layouts(self, args: tuple[Any, ...], leaves: list[Any], paths: list[str], specs: list[Any]) -> tuple | None:
        """Per argument leaf, its layout over the actor mesh (None when actors have one device each)."""
        am = getattr(self.mesh, "actor_mesh", None)
        if am is None:
            # (all None, or P(): no constraint on one device, as jax.jit takes them; a spec of out_shardings was
            # dropped unsaid here)
            for name, given in (("in_shardings", self.in_shardings), ("out_shardings", self.out_shardings)):
                if _lays_out(given):
                    raise PipelineError(f"{name} needs actors with several devices: make the mesh with devices_per_actor=N "
                                        f"(and mesh_shape=..., axis_names=...), or leave {name} out (or None) for actors of "
                                        "one device each")
            return None
        user = tree_specs(self._per_argument(args), args, "in_shardings") if self.in_shardings is not None else [None] * len(leaves)
        out = []
        for x, u, path, spec in zip(leaves, user, paths, specs):
            held = am.canonical(x.sharding.layout) if isinstance(x, RemoteArray) and x.sharding is not None else None
            if held is None and isinstance(x, jax.Array) and (u is None or getattr(x, "committed", False)):
                # a host jax.Array keeps its sharding, as under jax.jit; one committed to a mesh like the actors' (sharded
                # or replicated) otherwise than in_shardings asks is refused, as jax.jit refuses it: it was re-laid out (a
                # probe). One on a single device of this process is host data to the actors, laid out as asked.
                held = _host_layout(am, x, spec.shape, replicated=None if u is None else ())
            if u is not None:  # compared as jax.jit compares shardings: the same data on the same devices
                am.check_spec(u, spec.shape, f"in_shardings for {path}")
                if held is not None and am.canonical(u) != held:
                    raise PipelineError(
                        f"argument {path} is laid out as {layout_to_spec(held)}{'' if isinstance(x, RemoteArray) else ' (a committed jax.Array)'}"
                        f"{' on its actors' if isinstance(x, RemoteArray) else ''} but in_shardings asks for {u} "
                        f"(over the actor mesh {dict(zip(am.axis_names, am.shape))}), as jax.jit refuses a committed array of "
                        "another sharding; give the step that made it out_shardings laying it out as asked, pass "
                        "in_shardings None for this argument (it keeps its own layout), or pass the host value mpmd.fetch(x)")
                out.append(am.canonical(u))
            else:
                out.append(held if held is not None else ())
        return tuple(out)

    def trace(self, *args: Any) -> Any:
        """The step's jaxpr (with nested calls inlined) for these arguments."""
        _, leaves, specs = self._signature(args)
        treedef = jax.tree.structure(self._hidden(args), is_leaf=_is_remote)
        out_box: list[Any] = []
        unwrapped: list[Any] = []  # the function jax.jit wrapped, traced in its place when jit's cache holds another schedule

        def flat(*xs: Any) -> list[Any]:
            given = reveal(jax.tree.unflatten(treedef, xs))
            before = _variables(given)
            out = self._invoke(given, unwrapped[-1] if unwrapped else None)
            leaves_out, tree = jax.tree.flatten(hide(out))
            _warn_lost_updates(self.fn, [*self._positional, *self._kwonly], before, leaves_out)
            for k, x in enumerate(leaves_out):
                if not isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
                    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(hide(out))[0][k][0])
                    raise PipelineError(f"{getattr(self.fn, '__name__', 'the step')} returned {x!r:.60} ({type(x).__name__}) at "
                                        f"output{path}: a step returns arrays, numbers and pytrees of them (as under "
                                        "jax.jit); compute it from arrays, or return it some other way")
            out_box.append(tree)
            return leaves_out

        # Traced with the arguments' structure and the step's own signature, so that what JAX says while tracing
        # names the user's function and parameters ("the argument train"), not flat's xs[3] (a probe).
        def structured(*a: Any) -> list[Any]:
            return flat(*jax.tree.leaves(a))

        functools.update_wrapper(structured, self.fn, updated=())  # (its name, and __wrapped__ for its signature)
        spec_args = jax.tree.unflatten(treedef, specs)

        am = getattr(self.mesh, "actor_mesh", None)
        caller = jax.sharding.get_abstract_mesh()
        with use_schedule(self.schedule) if self.schedule is not None else contextlib.nullcontext(), without_callers_mesh(), \
                tracing_distributed():
            traced_under = tracing_mesh(am, caller, getattr(self.mesh, "platform", None))
            for again in (False, True):
                try:
                    with jax.sharding.use_abstract_mesh(traced_under) if traced_under is not None else contextlib.nullcontext(), \
                            noting_loops() as seen:
                        closed = jax.make_jaxpr(functools.partial(structured) if again else structured)(*spec_args)  # (a new function:
                        # make_jaxpr keeps its traces too)
                except ValueError as e:
                    err = _actor_mesh_error(e, am, traced_under)
                    if err is None:
                        raise
                    raise err from None
                except TypeError as e:  # (JAX's "is not a valid JAX type" naming it by its str; jnp's "requires ndarray
                    # or scalar arguments, got <class '...RemoteArray'>")
                    if (HELD in str(e) or "RemoteArray" in str(e)) and "pass it as an argument" not in str(e):
                        raise PipelineError(f"{getattr(self.fn, '__name__', 'the step')}: a RemoteArray reached JAX inside "
                                            "the step without being one of its arguments (closed over, a global, or held "
                                            "by a functools.partial): its value is on the actors, which the step reaches "
                                            f"through its arguments only; pass it as an argument of the step ({e})") from e
                    raise
                _refuse_leaked_tracers(closed, getattr(self.fn, '__name__', 'the step'))
                closed = inline_calls(rebind_constraints(closed, am, traced_under), step=True)
                from mpmd.primitives import accumulate_p

                held = [e.params["schedule"] for e in closed.jaxpr.eqns if e.primitive is accumulate_p]
                if not held or seen:  # (no loop: said later; a loop accumulate_grads traced now: as asked)
                    break
                # A cache of traces around the loop handed back one made before, under whatever schedule was in
                # force then: the step given as jax.jit(f) (a probe: with_schedule and every candidate of tune ran
                # the first schedule under another's name; and a plain step traced after with_schedule ran that one).
                # Once more with the function jax.jit wraps: the same jaxpr once calls are inlined, as they are here.
                if not again and _is_jitted(self.fn):
                    unwrapped.append(self.fn.__wrapped__)
                    continue
                if self.schedule is not None and any(h is not self.schedule for h in held):
                    stale = next(h for h in held if h is not self.schedule)
                    raise PipelineError(
                        f"the step's accumulate_grads ran with {stale!r}, not {self.schedule!r} as asked (with_schedule, "
                        "tune, profile_costs): a cache of traces around it (a jitted function holding the loop) reused a "
                        "trace made with the other schedule; call the loop's function undecorated inside the step, or "
                        "pass the undecorated step to mpmd.distributed (it compiles the step itself)")
                break  # (a jitted helper holding the loop, traced before with no override: as it was then)
        return closed, out_box[-1]

    def _cached(self, sig: Any) -> CompiledStep | None:
        """The compiled step for `sig`, unless a daemon was restarted under the mesh since (mesh.reconnect to a new
        daemon: the Programs it held are gone); then it is compiled and loaded again."""
        hit = self._compiled.get(sig)
        if hit is not None and hit.generation != getattr(self.mesh, "generation", 0):
            with self._compile_lock:
                if self._compiled.get(sig) is hit:  # (another thread may have dropped it already)
                    self._compiled.pop(sig, None)
                    self._drop([hit])  # (the actors that were not restarted still hold its Programs)
            return None
        if hit is not None:
            try:
                self._compiled.move_to_end(sig)
            except KeyError:  # (another thread let it go meanwhile: the caller takes it under the lock, `_take`)
                pass
        return hit

    def _take(self, sig: Any, args: tuple[Any, ...]) -> CompiledStep:
        """The compiled step for `sig` (compiling it if need be), held for one call until `_let_go`: a signature
        let go meanwhile (more than MAX_SIGNATURES called at once from other threads) keeps its Programs loaded
        until this call is dispatched. (It was unloaded at once: "no program 1 on actor 0"; a probe.)"""
        while True:
            with self._compile_lock:
                hit = self._cached(sig)
                if hit is not None:
                    hit.users += 1
                    return hit
            t = time.perf_counter()
            self.compile_bound(args, sig)
            note_blocking(time.perf_counter() - t, f"compiling {getattr(self.fn, '__name__', 'a step')}")

    def _compile_as_caller(self, args: tuple[Any, ...], sig: Any, local: dict[str, Any]) -> CompiledStep:
        """`compile_bound` in a worker thread for a caller whose signature is `sig`, traced under the JAX options
        the caller's thread set for itself (`callers_config`: x64, matmul precision, rank promotion, ..., which
        `sig` is keyed by; the worker traced without them: a probe)."""
        with as_caller(local):
            return self.compile_bound(args, sig)

    def _let_go(self, compiled: CompiledStep) -> None:
        """One call holding `compiled` has dispatched (or failed to)."""
        with self._compile_lock:
            compiled.users -= 1
            unload = compiled.dropped and compiled.users == 0
        if unload:
            _unload(self.mesh, [compiled])

    def _drop(self, olds: list[CompiledStep]) -> None:
        """`olds` are let go of (called with `_compile_lock` held): their Programs are unloaded from the actors now,
        or by the last call holding one (`_let_go`), behind that call's dispatch."""
        for old in olds:
            old.dropped = True
            if old.users == 0:
                _unload(self.mesh, [old])

    def compile(self, *args: Any, **kwargs: Any) -> CompiledStep:
        """Trace, plan and ship the Programs for these arguments, given as to the step itself (done by the
        first call automatically). On a recovering mesh an actor lost meanwhile is recovered from and the compile
        done again, as a call is."""
        return self._compile_recovering(self.bind(args, kwargs))

    def _compile_recovering(self, args: tuple[Any, ...]) -> CompiledStep:
        recovery = getattr(self.mesh, "recovery", None)
        return recovery.compile(self, args) if recovery is not None else self.compile_bound(args)

    def compile_bound(self, args: tuple[Any, ...], sig: Any = None) -> CompiledStep:
        """`compile` of arguments already bound (`bind`): once per signature, however many threads ask at once
        (the others wait for the compile under way: each would trace, compile and ship a Program of its own).
        `sig`: the caller's signature, when this runs in another thread (its JAX config context is the caller's:
        the worker's own keyed it apart, and call_async under `jax.enable_x64(True)` waited for it for good; a review)."""
        sig = self._signature(args)[0] if sig is None else sig
        try:
            for _ in range(3):  # (again when a daemon was replaced while it compiled, as the call does)
                compiled = self._cached(sig) or self._compile_once(sig, args)
                if compiled.generation == getattr(self.mesh, "generation", 0):
                    break
        except (ActorDiedError, concurrent.futures.CancelledError) as e:  # (the mesh closed meanwhile: say so)
            getattr(self.mesh, "raise_if_closed_meanwhile", lambda e: None)(e)
            raise
        return compiled

    def _compile_once(self, sig: Any, args: tuple[Any, ...]) -> CompiledStep:
        """`_compile_now` in this thread, or the result of the same signature's compile under way in another
        (a trace error reaches every caller; a compile interrupted in its thread is started again by a waiter)."""
        while True:
            with self._compile_lock:
                done = self._cached(sig)  # (compiled by another thread since the caller looked: not a second time)
                if done is not None:
                    return done
                running = self._compiling.get(sig)
                if running is None:
                    mine = self._compiling[sig] = concurrent.futures.Future()
            if running is None:
                break
            try:
                return running.result()
            except _Interrupted:
                continue
        try:
            compiled = self._compile_now(sig, args)
        except BaseException as e:
            mine.set_exception(e if isinstance(e, Exception) else _Interrupted())
            raise
        finally:
            with self._compile_lock:
                self._compiling.pop(sig, None)
        mine.set_result(compiled)
        return compiled

    def _compile_now(self, sig: Any, args: tuple[Any, ...]) -> CompiledStep:
        """Trace, plan, lower and ship the step for `args` (signature `sig`), here and now."""
        generation = getattr(self.mesh, "generation", 0)
        t0 = time.perf_counter()
        outer, out_tree = self.trace(*args)
        plan = plan_step(outer, len(self.mesh))
        made_by = {v: e.primitive.name for e in outer.jaxpr.eqns for v in e.outvars}
        plan.constrained_outputs = frozenset(i for i, v in enumerate(outer.jaxpr.outvars)  # (see _kept_layouts)
                                             if isinstance(v, Var) and made_by.get(v) == "sharding_constraint")
        if getattr(self.mesh, "transport", None) == "none" and any(
                isinstance(ins, Send) for prog in plan.programs for ins in prog.instructions):
            raise PipelineError(f"this step sends values between its {len(self.mesh)} actors, but the mesh was made with "
                                "transport='none' (no data plane): make it with transport='auto' (the default)")
        t1 = time.perf_counter()
        ids = [self.mesh.executables.new_program_id()] * len(plan.programs)  # one id: transfer keys (program, step, tag) must agree
        holder = self.mesh.executables.new_holder()
        try:
            loaded = self._lower_and_ship(plan, ids, sig[2], out_tree, holder=holder, arg_sig=sig)
        except BaseException:  # (Ctrl-C, or an actor's refusal, after some Programs were loaded: they go again)
            getattr(self.mesh, "unload_programs", lambda ids, holders: None)(sorted(set(ids)), [holder])
            raise
        compiled = CompiledStep(plan, ids, out_tree, time.perf_counter() - t0, arg_paths(self._hidden(args)), loaded, generation,
                                holder=holder)
        with self._compile_lock:
            olds = [old] if (old := self._compiled.get(sig)) is not None else []
            self._compiled[sig] = compiled
            while len(self._compiled) > MAX_SIGNATURES:
                olds.append(self._compiled.popitem(last=False)[1])
            self._drop(olds)
        n, a = len(plan.templates), len(plan.programs)
        log.info("compiled step: planned in %.2f s; %d executable%s lowered here, compiled on %d actor%s in parallel; %.2f s in all",
                 t1 - t0, n, "s" if n != 1 else "", a, "s" if a != 1 else "", compiled.compile_seconds)
        return compiled

    def _lower_and_ship(self, plan: StepPlan, ids: list[int], arg_layouts: tuple | None, out_tree: Any,
                        lowered: list[tuple[Any, bytes]] | None = None, holder: int | None = None, arg_sig: Any = None) -> list[Any]:
        """Export each distinct executable once, here, and have every actor that runs it start compiling it at
        once (actors compile while the next one is exported); then load the Programs. With multi-device
        actors, executables are compiled wave by wave with their inputs' layouts (see mpmd.runtime.sharding). Returns
        how many executables were exported. `lowered`: the plan's (template, blob) pairs, exported already; `holder`:
        the signature's hold on its executables (`Executables.new_holder`); `arg_sig`: the signature (its argument
        tree and specs: state keeps its layout, `_kept_layouts`)."""
        mesh = self.mesh
        if arg_layouts is not None:
            return self._lower_and_ship_sharded(plan, ids, arg_layouts, out_tree, lowered, holder, arg_sig)
        users: dict[Any, list[int]] = {}
        for prog in plan.programs:
            for t in prog.executables:
                users.setdefault(t, []).append(prog.actor)
        keys: dict[tuple[int, Any], Any] = {}
        progress = Progress(f"lowering {len(plan.templates)} executables for {len(plan.programs)} actors")
        for i, (tpl, blob) in enumerate(lowered if lowered is not None else iter_lowered(plan, mesh.platform)):
            for a in users.get(tpl, ()):
                keys[(a, tpl)] = mesh.submit_coroutine(mesh.executables.ensure_compiled(a, blob, tpl[-1], holder=holder))
            progress.tick(f"lowered executable {i + 1}/{len(plan.templates)}")
        exe_keys = wait_logged(keys, "executables compiled on the actors")
        import dataclasses

        programs = [dataclasses.replace(p, executables=[exe_keys[(p.actor, t)] for t in p.executables]) for p in plan.programs]

        async def load() -> None:
            await asyncio.gather(*(mesh.executables.load_program(p.actor, p, pid, p.executables) for p, pid in zip(programs, ids)))

        mesh.run(load())
        return programs

    def _lower_and_ship_sharded(self, plan: StepPlan, ids: list[int], arg_layouts: tuple, out_tree: Any,
                                lowered: list[tuple[Any, bytes]] | None = None, holder: int | None = None,
                                arg_sig: Any = None) -> list[Any]:
        mesh = self.mesh
        packed = sorted({getattr(a.dtype, "name", "") for a in plan.avals.values()} & PACKED_DTYPES)
        if packed:
            raise PipelineError(f"this step holds {', '.join(packed)} values, which actors with several devices cannot take "
                                "(JAX lays them out unpacked where the executables take them packed): cast them to int8 (or "
                                "uint8) before the step and pipeline_yield, and back where they are used")
        blobs = dict(lowered if lowered is not None else iter_lowered(plan, mesh.platform))
        known: dict[Any, Any] = dict(zip(plan.arg_keys, arg_layouts))
        for us in plan.units.values():
            for u in us:
                for k in u.inputs:
                    if type(k).__name__ == "MbIndex":
                        known[k] = ()
        constraints: dict[Any, Any] = {}
        if self.out_shardings is not None:
            am = mesh.actor_mesh
            out_specs = tree_specs(self.out_shardings, jax.tree.unflatten(out_tree, list(range(out_tree.num_leaves))), "out_shardings")
            kept_as_given = []
            paths = [f"out{jax.tree_util.keystr(p)}" for p in _tree_paths(out_tree)]
            for j, ((kind, val), key, spec, aval) in enumerate(zip(plan.out_homes, plan.out_keys, out_specs, plan.out_avals)):
                if kind == "actors" and spec is not None:  # (the output named: a probe's error said only "out_shardings")
                    am.check_spec(spec, aval.shape, f"out_shardings for {paths[j]}" if j < len(paths) else "out_shardings")
                    constraints[key] = am.canonical(spec)
                elif kind == "arg" and spec is not None and am.canonical(spec) != am.canonical(arg_layouts[val]):
                    kept_as_given.append(j)
            if kept_as_given:  # (it was dropped unsaid, and a later step's in_shardings then refused the array; a probe)
                warnings.warn(f"out_shardings for output{'s' * (len(kept_as_given) > 1)} {', '.join(map(str, kept_as_given))} "
                              f"({', '.join(paths[j] for j in kept_as_given if j < len(paths))}) is not applied: the step returns those arguments unchanged, and mpmd hands back each "
                              "argument itself, laid out as it came (jax.jit would copy it into the layout asked for). Lay "
                              "the argument out so where it is made (in_shardings, or the out_shardings of the step that "
                              "made it), or return a value computed from it", stacklevel=callers_level())

        if arg_sig is not None:
            for key, lay in _kept_layouts(plan, out_tree, arg_sig).items():
                constraints.setdefault(key, lay)

        async def compile_unit(a: int, u: Any, ins: tuple, outs: tuple) -> tuple[str, list[Any]]:
            tpl = u.template()
            return await mesh.executables.ensure_compiled(a, blobs[tpl], tpl[-1], ins, outs, holder)

        exe, layouts = mesh.run(infer_layouts(plan.units, known, constraints, compile_unit))
        programs = [with_layouts(p, [exe[(p.actor, i)] for i in range(len(plan.units.get(p.actor, [])))], layouts)
                    for p in plan.programs]
        plan.layouts = layouts

        async def load() -> None:
            await asyncio.gather(*(mesh.executables.load_program(p.actor, p, pid, p.executables) for p, pid in zip(programs, ids)))

        mesh.run(load())
        return programs

    def placement(self, *args: Any, **kwargs: Any) -> PlacementReport:
        """Where each argument and output of the step lives (per pytree path), and what moves between actors in
        one step, by kind (activations, activation gradients, parameters, gradient reductions, other)."""
        compiled = self._compile_recovering(self.bind(args, kwargs))
        out_paths = [f"out{jax.tree_util.keystr(p)}" for p in _tree_paths(compiled.out_tree)]
        return placement_report(compiled.plan, compiled.arg_paths, out_paths)

    def simulate(self, *args: Any, costs: Any = None, **kwargs: Any) -> Any:
        """Time this step's compiled Programs for these arguments (given as to the step) on a cost model
        (`mpmd.Costs`; default unit costs F=1, B=2, I=W=1, free transfers): step time, bubble per actor, peak
        activation bytes, timeline, pictures. The backward of a stage the schedule remats pays its forward again,
        as `mpmd.simulate(schedule)` counts it."""
        from mpmd.schedules.simulator import Costs, simulate_programs, without_input_grad

        if costs is not None and not isinstance(costs, Costs):
            raise ScheduleError(f"step.simulate: costs must be mpmd.Costs (e.g. mpmd.Costs(F=1, B=2)), got {type(costs).__name__} "
                                f"{costs!r:.80}")
        plan = self.compile(*args, **kwargs).plan
        costs = costs if costs is not None else Costs()
        try:
            costs.check_stages(plan.split.num_stages)
        except ValueError as e:  # (per-segment costs of a grouped step: group them, or let balance= use them)
            raise ScheduleError(f"step.simulate: {e} (this step's schedule runs {plan.split.num_stages} stages)") from None
        costs = without_input_grad(plan.programs, costs).with_remat(plan.remat, plan.split.num_stages)
        return simulate_programs(plan.programs, costs, name=getattr(self.fn, "__name__", "step"))

    def with_schedule(self, schedule: Any) -> DistributedFunction:
        """The same step on the same mesh with `schedule` in place of the one its `accumulate_grads` names
        (compiled afresh on first call), e.g. `step.with_schedule(mpmd.ZeroBubbleH1(4, balance="auto"))`."""
        if (hint := not_a_schedule(schedule)) is not None:
            raise PipelineError(f"with_schedule: schedule must be a schedule such as mpmd.OneFOneB(num_stages=2) "
                                f"(see mpmd.schedules), got {hint}")
        other = self._variant(schedule)
        # (one count for both: a loop that switches between them loads each step once. A copy of the count made the
        # switch back load again what the other had loaded: 0, 1, 0, 1, 2, 3 over A, A, B, B, A, A; a probe)
        other._count = self._count
        return other

    def _variant(self, schedule: Any) -> DistributedFunction:
        """`with_schedule`'s step with a count of its own, from this one's now: what tune and profile_costs measure
        with (their calls must not move the training loop's count on)."""
        other = DistributedFunction(self.fn, self.mesh, self.in_shardings, self.out_shardings, self.static_argnums,
                                    donate_argnums=self.donate_argnums)
        other.schedule = schedule
        other._count = LoadCount(self._count.value)  # (its first call loads the step this one would load next)
        return other

    @property
    def next_load_step(self) -> int:
        """The step number the next call's actor-loaded leaves (`mpmd.loaded_by_actors`) are loaded for: the
        calls dispatched so far, unless set. Set it to go on where a run stopped (resuming from a checkpoint:
        ``step.next_load_step = steps_done``). The steps `with_schedule` makes, and `mpmd.tune`'s, share it with
        this one: a call of any of them moves it on for all."""
        return self._count.value

    @next_load_step.setter
    def next_load_step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"next_load_step is a step number (an int >= 0), got {value!r:.40}")
        self._count.set(int(value))

    def profile_costs(self, *args: Any, steps: int = 2, split_backward: bool = True, **kwargs: Any) -> Any:
        """Measure every marker segment on the actors: the step is compiled with each segment its own stage
        (placed round-robin over the mesh's actors so no two fuse), run `steps` times to warm up, then traced;
        F, B (and, with `split_backward`, I and W from a second traced variant) per segment are fitted to the
        Run durations. Returns `mpmd.schedules.balance.SegmentCosts`, usable as `balance=` of any schedule and
        by `mpmd.tune`. The arguments (given as to the step) are not changed (the variant's outputs are dropped)."""
        from mpmd.observe.segments import profile_costs

        return profile_costs(self, *self.bind(args, kwargs), steps=steps, split_backward=split_backward)

    def program(self, *args: Any, **kwargs: Any) -> str:
        """The per-actor instruction lists for these arguments (given as to the step), one line per instruction."""
        return str(self.compile(*args, **kwargs).plan)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """On a class, a method: `trainer.step(params, batch)` calls the step with `trainer` as its first argument,
        as jax.jit's methods do (`self` static with `static_argnums=0`; it was not bound: a probe)."""
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Dispatch one step and return its outputs at once, as RemoteArrays (like jax.jit's asynchronous
        dispatch): the next call is sent while this one runs, and an error surfaces at the first fetch or
        `block_until_ready()` of an output, or at the next call, naming the step. From a coroutine, await
        `call_async` instead: a first call compiles, which would hold the caller's event loop. On a mesh made with
        `recover=mpmd.Recovery(...)` the call is logged and a lost actor is recovered from (mpmd.runtime.recovery)."""
        args = self.bind(args, kwargs)
        out = self.call_bound(args)
        self._donate(args, out)
        return out

    def _donate(self, args: tuple[Any, ...], out: Any, done: Any = None) -> list[RemoteArray]:
        """As jax.jit's donate_argnums: the RemoteArrays of the donated arguments are deleted once the step is
        dispatched (their buffers freed behind it, as when the last reference goes); using one again raises.
        One the step returns as it is stays (jax.jit hands the donated buffer to that output). Returns the arrays
        deleted; when there are some, the step's `done` future says so (`donating`): a cancelled await of its
        outputs does not abort it (`mpmd.runtime.aio.abort_unfinished`), its outputs being the state's only copy."""
        if not self.donate_argnums:
            return []
        gone = []
        n = len(args)
        donated = [args[i % n] for i in sorted(self.donate_argnums) if -n <= i < n and (i % n) not in self.static_argnums]
        kept = {id(x) for x in jax.tree.leaves(out, is_leaf=_is_remote) if isinstance(x, RemoteArray)}
        for x in jax.tree.leaves(donated, is_leaf=_is_remote):
            if isinstance(x, RemoteArray) and x.mesh is self.mesh and id(x) not in kept and x.buffers and not x.copied:
                buffers, x.buffers = x.buffers, {}
                x.donated_to = getattr(self.fn, "__name__", "a step")
                self.mesh.release_buffers(buffers)
                gone.append(x)
        if gone and done is None:  # (the step's done future: that of an output it made, not one it passed through)
            given = {id(x) for x in jax.tree.leaves(args, is_leaf=_is_remote)}
            done = next((x._ready for x in jax.tree.leaves(out, is_leaf=_is_remote)
                         if isinstance(x, RemoteArray) and id(x) not in given and x._ready is not None), None)
        if gone and done is not None:
            done.donating = True
        return gone

    def call_bound(self, args: tuple[Any, ...]) -> Any:
        """`__call__` of arguments already bound to the one tuple a compiled step takes (`bind`): what the
        tuner and the profiler, which hold the arguments so, call."""
        _warn_debug_checks()
        self._raise_unseen_error()
        recovery = getattr(self.mesh, "recovery", None)
        if recovery is not None:
            return recovery.call(self, args)
        return self._call(args)

    def _call(self, args: tuple[Any, ...], on_failure: Callable[[BaseException], Any] | None = None,
              sent: list[Any] | None = None, load_step: int | None = None, room: bool = True, context: Any = None,
              replay: bool = False) -> Any:
        """Dispatch one step (see `__call__`). `on_failure(error)`: a coroutine run on the loop when the step
        fails; True means the step was recovered (its outputs were rebound: it ends normally). `sent` collects
        the step's run_program futures (so that a recovery can wait for them). `room` False: dispatch without
        waiting for fewer steps in flight (a recovery's replay, or a caller that waited before taking a lock the
        recovery needs: the failed steps in flight end only once the recovery has run). `context`: see `_signature`.
        `replay`: a recovery's replay of a logged step (not traced as a step of the caller's: counted)."""
        sig, leaves, _ = self._signature(args, context)
        compiled = self._take(sig, args)
        try:
            return self._dispatch(compiled, sig, leaves, on_failure, sent, load_step=load_step, room=room, replay=replay)[0]
        finally:
            self._let_go(compiled)

    def _dispatch(self, compiled: CompiledStep, sig: Any, leaves: list[Any], on_failure: Callable[[BaseException], Any] | None = None,
                  sent: list[Any] | None = None, may_wait: bool = True, load_step: int | None = None,
                  room: bool = True, replay: bool = False) -> tuple[Any, Any]:
        """Send one step (through the controller loop, in call order); its outputs and its done future (see
        `_call` for `on_failure` and `sent`). `may_wait`: the calling thread may wait for a shared-memory input
        segment when the caller is many steps ahead (not on a caller's event loop). `load_step`: the call number
        its actor-loaded leaves are loaded for (a recovery's replay of call k loads call k's data; default: the
        next call number)."""
        mesh, plan = self.mesh, compiled.plan
        if may_wait and room:
            mesh.wait_for_room()  # (a loop that only dispatches waits for the actors here, as under jax.jit)
        arg_outputs = compiled.arg_outputs
        if arg_outputs is None:
            arg_outputs = compiled.arg_outputs = tuple(v for kind, v in plan.out_homes if kind == "arg")  # (host callbacks' too)
        for k in arg_outputs:
            if isinstance(leaves[k], LoadedLeaf):
                raise PipelineError(f"{getattr(self.fn, '__name__', 'the step')} returns its argument {compiled.arg_paths[k]} as it "
                                    "is, or hands it to a host callback, and it is a leaf the actors load themselves "
                                    "(mpmd.loaded_by_actors): its value never reaches this controller. Use something computed "
                                    "from it instead, or call the loader here")
        step = next(self._step)
        # (the call count, not `step`: a replay draws step numbers of its own, and must not shift later loads; a
        # call refused before it is sent loads nothing, and the next call loads what it would have)
        load = self._count.take() if load_step is None else load_step  # (the number only: _prepare may wait)
        try:
            requests, replicas, outs = self._prepare(compiled, leaves, step, sig[2], may_wait, load)
        except BaseException:
            if load_step is None:
                self._count.give_back(load)
            raise
        self._last_load = load
        # Arguments that earlier steps still make: if this step fails because one of those did, that is its error.
        upstream = [(compiled.arg_paths[k], x._ready) for k, x in enumerate(leaves)
                    if isinstance(x, RemoteArray) and x._ready is not None
                    and not (x._ready.done() and not x._ready.cancelled() and x._ready.exception() is None)]
        trace = mesh.active_trace
        if trace is not None and replay:  # (a replay of an earlier step is not one of the steps the trace was asked for)
            trace.count("replayed")
            trace = None
        # The values the step's host callbacks read (never handed to the caller) exist before the step is sent,
        # so its finish has them whenever it gets to them.
        hidden = [self._output(plan, j, outs[j], leaves, None) for j in range(plan.num_outputs, len(plan.out_homes))]

        def send() -> list[asyncio.Future[Any]]:
            futures = self._send(requests, trace)
            if sent is not None:
                sent.extend(futures)
            return futures

        reconnects = getattr(mesh, "reconnects", 0)  # (as dispatched: see `_raise_unseen_error`)
        done = mesh.dispatch(send, lambda futures: self._finish(futures, compiled, replicas, step, trace, hidden, on_failure,
                                                                upstream))
        results: list[Any] = []
        try:  # (a KeyboardInterrupt here, before the outputs own their buffers, left them on the actors until close)
            done.reconnects = reconnects
            done.host_calls = bool(plan.host_calls)  # fetching an output waits for the step's callbacks (RemoteArray._wire)
            abortable(done, lambda: mesh.submit_coroutine(self._abort(done, compiled, step, outs)))
            note_upstream(done, [ready for _, ready in upstream])  # (awaiting this step keeps those from being aborted)
            self._last = (step, done)
            for j in range(plan.num_outputs):
                results.append(self._output(plan, j, outs[j], leaves, done))
        except BaseException:
            for j in range(len(results), plan.num_outputs):
                if outs[j]:
                    mesh.release_buffers(outs[j])
            raise
        if trace is not None:
            trace.expect(done)
        return reveal(jax.tree.unflatten(compiled.out_tree, results)), done

    def _output(self, plan: StepPlan, j: int, ids: dict[int, int], leaves: list[Any], ready: Any) -> Any:
        """Flat step output `j`: a RemoteArray of buffers `ids` made by the step `ready` (None: not handed to
        the caller), the argument it returns, or its constant value."""
        kind, val = plan.out_homes[j]
        if kind == "actors":
            aval = plan.out_avals[j]
            sharding = remote_sharding(plan.layouts.get(plan.out_keys[j]), self.mesh.actor_mesh)
            return RemoteArray(self.mesh, ids, aval.shape, aval.dtype, sharding, ready=ready, weak_type=aval.weak_type)
        # As under jax.jit: an argument returned as it is, or a constant, comes back as a jax Array of its traced
        # dtype (a Python float an f32 Array, a float64 numpy array with x64 off an f32 one), not as the object given.
        dtype = plan.out_avals[j].dtype
        if kind == "arg" and (isinstance(leaves[val], (RemoteArray, LoadedLeaf)) or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                              or (isinstance(leaves[val], jax.Array) and leaves[val].dtype == dtype)):
            return leaves[val]
        value = np.asarray(leaves[val] if kind == "arg" else val, dtype=dtype)
        # (a host callback's operands stay numpy)
        return jax_array(value, plan.out_avals[j].weak_type) if j < plan.num_outputs else value

    async def call_async(self, *args: Any, **kwargs: Any) -> Any:
        """Awaitable twin of `step(*args)`, for the caller's own event loop: dispatches the step the same way
        and returns its RemoteArrays once the actors' requests are sent. A first call per signature traces,
        plans and lowers in a worker thread (calls awaiting the same signature share that compile), so the
        caller's loop runs on meanwhile. Await the outputs with `mpmd.ready_async` / `mpmd.fetch_async`;
        cancelling either while the step runs aborts the step on its actors (its buffers are freed; later
        steps run as before) — unless the step was donated its inputs (its outputs are then the state's only
        copy: it runs on, to the actors' --request-timeout at most) — and a remote error is raised there, naming
        actor and task.

            params, opt_state, losses = await train_step.call_async(params, opt_state, batch)
            print(await mpmd.fetch_async(losses))

        On a recovering mesh the call goes through the recovery's log, like `step(*args)`, in a worker thread; cancelled
        before its compile ended, it is not dispatched (the compile is kept).
        """
        _warn_debug_checks()
        self._raise_unseen_error()
        args = self.bind(args, kwargs)
        recovery = getattr(self.mesh, "recovery", None)
        if recovery is not None:
            cancelled = threading.Event()
            try:
                outs = await off_loop(lambda: recovery.call(self, args, cancelled))
            except asyncio.CancelledError:
                cancelled.set()  # a compile or a recovery under way runs on; the step is not dispatched
                raise
            self._donate(args, outs)  # (as `step(*args)` does after the recovery's call: donate_argnums did nothing here)
            return outs
        sig, leaves, _ = self._signature(args)
        while True:
            with self._compile_lock:  # (held from here to its dispatch: see `_take`)
                compiled = self._cached(sig)
                if compiled is not None:
                    compiled.users += 1
                    break
                running = self._async_compiles.get(sig)  # (awaiting calls share one worker; compile_bound threads too)
                if running is None:
                    running = self._async_compiles[sig] = start_in_worker(self._compile_as_caller, args, sig,
                                                                          callers_config())
                    running.add_done_callback(lambda f: self._async_compiles.pop(sig, None) if self._async_compiles.get(sig) is f else None)
            await watch(running)  # (compile_bound compiles again if a daemon was replaced meanwhile)
        try:
            await self.mesh.wait_for_room_async()
            outs, done = self._dispatch(compiled, sig, leaves, may_wait=False)  # (this is the caller's loop)
        finally:
            self._let_go(compiled)
        donated = self._donate(args, outs, done)
        try:
            await self.mesh.arun(asyncio.sleep(0))  # queued behind the dispatch: its requests have left when this runs
        except asyncio.CancelledError:
            for x in donated:  # (their state went into outputs the caller never got: said when they are read)
                x.donation_lost = True
            await watch(done.mpmd_abort())
            raise
        return outs

    async def _abort(self, done: Any, compiled: CompiledStep, step: int, outs: list[dict[int, int]]) -> None:
        """On the controller loop: abort `step` wherever it still runs (its await was cancelled), wait for its
        end, and free its outputs if it did not complete (an actor that finished first made some)."""
        if done.done():
            return
        mesh = self.mesh
        self._cancelled.add(step)
        done.seen = True  # the caller cancelled it: the next call does not raise its error again
        await asyncio.gather(*(mesh.conn(a).request("abort", {"program": pid, "step": step})
                               for a, pid in enumerate(compiled.program_ids) if not mesh.conn(a).dead), return_exceptions=True)
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            per_actor: dict[int, list[int]] = {}
            for ids in outs:
                for a, b in ids.items():
                    per_actor.setdefault(a, []).append(b)
            await asyncio.gather(*(mesh.conn(a).request("delete", {"bufs": part}) for a, bufs in per_actor.items()
                                   if not mesh.conn(a).dead for part in in_parts(bufs)), return_exceptions=True)

    def _raise_unseen_error(self) -> None:
        if getattr(self.mesh, "closed", False):  # (a step in flight when it closed failed for that reason alone)
            raise MpmdError("this RemoteMesh is closed: a distributed step runs on the mesh it was made for; make a new "
                            "mesh and mpmd.distributed(fn, mesh=new_mesh)")
        last = getattr(self, "_last", None)
        if (last is not None and last[1].done() and not last[1].cancelled() and last[1].exception() is not None
                and not getattr(last[1], "seen", False)):
            last[1].seen = True
            if isinstance(last[1].exception(), ActorDiedError) and getattr(last[1], "reconnects", 0) != getattr(
                    self.mesh, "reconnects", 0):  # (lost before a mesh.reconnect: the caller has seen a loss and mended it;
                return  # the next step raised the old "died ... kill -CONT resumes it" again; a probe)
            raise last[1].exception()

    def _prepare(self, compiled: CompiledStep, leaves: list[Any], step: int, layouts: tuple | None,
                 may_wait: bool = True, load_step: int | None = None) -> tuple[list[dict[str, Any]], list[Any], list[dict[int, int]]]:
        """The run_program request of every actor, the argument replicas it makes, and every output's buffer ids."""
        mesh, plan = self.mesh, compiled.plan
        n = len(plan.programs)
        inputs: list[list[int]] = [[] for _ in range(n)]
        inline: list[list[np.ndarray]] = [[] for _ in range(n)]
        inline_layouts: list[list[Any]] = [[] for _ in range(n)]
        prologue: list[list[list[Any]]] = [[] for _ in range(n)]
        replicas: list[tuple[RemoteArray, int, int]] = []
        # (one copy per array and actor: an array at two leaves — `step(params, params, batch)`, or twice in a pytree
        # — made two, and the second's id overwrote the first's in x.buffers: that buffer stayed on the actor for good)
        copying: dict[tuple[int, int], int] = {}
        paths = compiled.arg_paths
        host: list[list[tuple[int, np.ndarray, Any]]] = [[] for _ in range(n)]  # (slot in inputs, value, layout) per actor
        borrowed: dict[int, list[Any]] = {}  # id -> [host value that is the caller's memory, its copy] (_stage_host_args)
        loads: list[list[dict[str, Any]]] = [[] for _ in range(n)]  # leaves each actor loads itself (mpmd.runtime.loader)
        for k, (x, homes) in enumerate(zip(leaves, plan.arg_homes)):
            if isinstance(x, LoadedLeaf):
                for a in sorted(homes):
                    inputs[a].append(-3)
                    loads[a].append({**x.wire(), "layout": layout_wire(layouts[k]) if layouts is not None else None,
                                     "step": step if load_step is None else load_step})
                continue
            wire = None if isinstance(x, RemoteArray) else to_wire(host_value(x))
            if wire is not None and not isinstance(x, jax.Array) and not (wire is not x and wire.flags.owndata):
                borrowed[id(wire)] = [wire, None]  # (not made here, nor immutable: its owner may write it after the call)
            for a in sorted(homes):  # only the actors whose Programs read this argument get it
                if wire is not None:
                    host[a].append((len(inputs[a]), wire, layout_wire(layouts[k]) if layouts is not None else None))
                    inputs[a].append(-1)
                    continue
                mesh.check_owned(x, f"argument {paths[k]}")
                if not any(b < n for b in x.buffers):
                    self._copy_in(x, a, paths[k], n)
                if a in x.buffers:
                    inputs[a].append(x.buffers[a])
                elif (id(x), a) in copying:  # (this array again: its copy made by this request)
                    inputs[a].append(copying[id(x), a])
                else:  # copy it actor-to-actor first, in the same request, and keep the copy for next time
                    src = min(b for b in x.buffers if b < n)  # (an actor this step sends a request to)
                    buf, tag = mesh.new_buffer_id(), -(k + 1) * n - a
                    shape, dtype = wire_shape_dtype(x.shape, x.dtype)
                    prologue[src].append(["send", x.buffers[src], a, tag, "arg"])
                    prologue[a].append(["recv", buf, src, tag, dtype_name(dtype), list(shape), "arg"])
                    inputs[a].append(buf)
                    replicas.append((x, a, buf))
                    copying[id(x), a] = buf
        staged = [self._stage_host_args(a, host[a], inputs[a], inline[a], inline_layouts[a], borrowed, may_wait) for a in range(n)]
        try:  # (before anything is sent: one actor's request refused would leave the others' steps waiting for it)
            for a in range(n):
                mesh.conn(a).check_size(f"a host argument of {getattr(self.fn, '__name__', 'the step')}", inline[a])
        except MpmdError:
            for lease in staged:
                if lease is not None:
                    lease[1]()
            raise
        for x, a, buf in replicas:  # the next step (maybe sent before this one ends) reads the copy
            x.buffers[a] = buf
        outs: list[dict[int, int]] = []
        per_actor_out: list[list[int]] = [[] for _ in range(n)]
        for kind, val in plan.out_homes:
            ids = {}
            if kind == "actors":
                for a in val:
                    ids[a] = mesh.new_buffer_id()
                    per_actor_out[a].append(ids[a])
            outs.append(ids)
        requests = []
        for a, pid in enumerate(compiled.program_ids):
            fields = {"program": pid, "step": step, "inputs": inputs[a], "outputs": per_actor_out[a], "prologue": prologue[a],
                      "sync": not mesh.overlap}
            if layouts is not None:
                fields["inline_layouts"] = inline_layouts[a]
            request: dict[str, Any] = {"fields": fields, "arrays": inline[a]}
            if staged[a] is not None:
                fields["shm_inputs"], request["release"] = staged[a]
            if loads[a]:
                fields["loads"] = loads[a]
            requests.append(request)
        return requests, replicas, outs

    def _copy_in(self, x: RemoteArray, a: int, path: str, n: int) -> None:
        """`x` lives only on actors this step has no Program on (e.g. parameters a 4-actor train step left on
        actors 2 and 3, passed to an eval step on actors 0 and 1): copy it to actor `a` through the controller,
        once (waiting for the step that makes it), and keep the copy as one of its replicas for the next steps. (The
        one fetch blocks the dispatching thread: under `call_async`, the caller's event loop, once per array.)"""
        mesh = self.mesh
        log.info("argument %s lives only on actor(s) %s, which this step (on actors 0-%d) does not use: copying it to "
                 "actor %d through the controller", path, x.actors, n - 1, a)
        spec = x.sharding.spec if x.sharding is not None else None
        # (mesh.get_buffer, not x.fetch(): a lost actor must raise here, not start a recovery and wait for it — a
        # recovering mesh dispatches under the lock its recovery takes; its caller recovers and calls again)
        value = from_wire(mesh.get_buffer(x.actor, x.buffers[x.actor]), x.dtype)
        copy = mesh.put_replicated(value, [a], spec)
        x.buffers.update(copy.buffers)  # (x frees it with its other buffers)
        copy.buffers = {}

    def _stage_host_args(self, a: int, host: list[tuple[int, np.ndarray, Any]], inputs: list[int], inline: list[np.ndarray],
                         inline_layouts: list[Any], borrowed: dict[int, list[Any]], may_wait: bool = True,
                         ) -> tuple[list[dict[str, Any]], Callable[[], None]] | None:
        """Actor `a`'s host arguments: the large ones into shared memory when `a` shares this host (their input
        slots become -2; see mpmd.runtime.inputs), the rest inline. The notices and the segment's release, or None.

        The call returns before its requests leave (the loop thread sends them), so an inline value that is the
        caller's memory (`borrowed`: a numpy batch a data loader refills in place for the next step, a read-only view
        of one) is copied now, once for all actors, as the copy into shared memory is: the step computes on the values
        it was called with."""
        from mpmd.runtime.inputs import STAGE_WAIT, input_stager

        stager = input_stager(self.mesh) if host else None
        big = [(slot, v, lay) for slot, v, lay in host if stager.wants(a, v.nbytes)] if stager is not None else []
        lease = stager.stage(a, [v for _, v, _ in big], [lay for _, _, lay in big], STAGE_WAIT if may_wait else 0.0) if big else None
        shared = {slot for slot, _, _ in big} if lease is not None else set()
        for slot, v, lay in host:
            if slot in shared:
                inputs[slot] = -2
            else:
                mine = borrowed.get(id(v))
                if mine is not None:
                    if mine[1] is None:
                        mine[1] = np.array(v, copy=True)
                    v = mine[1]
                inline.append(v)
                inline_layouts.append(lay)
        return lease

    def _send(self, requests: list[dict[str, Any]], trace: Any) -> list[asyncio.Future[Any]]:
        """Submit every actor's run_program (on the loop thread, before anything submitted after this step)."""
        mesh = self.mesh
        futures = []
        for a, req in enumerate(requests):
            fields = {**req["fields"], "trace": True} if trace is not None else req["fields"]
            try:
                futures.append(asyncio.ensure_future(mesh.conn(a).submit("run_program", fields, req["arrays"])))
            except MpmdError as e:  # a dead actor: this step fails like one that reached it
                failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                failed.set_exception(e)
                futures.append(failed)
            release = req.get("release")
            if release is not None:  # its shared-memory inputs were copied out once the actor answers
                futures[-1].add_done_callback(lambda _, release=release: release())
        return futures

    async def _finish(self, futures: list[asyncio.Future[Any]], compiled: CompiledStep, replicas: list[Any], step: int,
                      trace: Any, hidden: list[Any], on_failure: Callable[[BaseException], Any] | None = None,
                      upstream: Sequence[tuple[str, Any]] = ()) -> None:
        """Wait for the step (`_wait_step`), then run its host callbacks, if it has any, on `hidden` (the values
        they read: the step's hidden outputs), after the previous step's callbacks and before this step counts
        as done."""
        calls = compiled.plan.host_calls
        if not calls:
            record = await self._wait_step(futures, compiled, replicas, step, trace, on_failure, upstream)
            if record is not None:
                trace.add_step(step, record, self.mesh.clock_offsets())
            return
        # Taken before the first await: the steps' finishes start in dispatch order, so their callbacks chain in it.
        previous = getattr(self, "_host_calls_done", None)
        mine = self._host_calls_done = asyncio.get_running_loop().create_future()
        try:
            record = await self._wait_step(futures, compiled, replicas, step, trace, on_failure, upstream)
            if previous is not None:
                await previous
            try:
                await run_host_calls(self.mesh, calls, hidden)
            except BaseException as e:
                if trace is not None:  # (a step whose callback failed is no step to fit costs to: counted, not recorded)
                    trace.count("failed")
                if isinstance(e, MpmdError):
                    raise name_step(e, step, getattr(self.fn, "__name__", "step")) from None
                raise
            if record is not None:
                trace.add_step(step, record, self.mesh.clock_offsets())
        finally:
            mine.set_result(None)  # resolved however this step ends: the next step's callbacks never wait forever

    async def _wait_step(self, futures: list[asyncio.Future[Any]], compiled: CompiledStep, replicas: list[Any], step: int,
                         trace: Any, on_failure: Callable[[BaseException], Any] | None = None,
                         upstream: Sequence[tuple[str, Any]] = ()) -> dict[int, Any] | None:
        """Wait for the step's requests. If one fails: the step is abandoned everywhere, argument copies it
        made are forgotten, and the error is raised naming the step (or saying it was cancelled) — unless
        `on_failure` recovers it. Returns the actors' trace records when a trace is active and the step ran (the
        caller adds them once its host callbacks, if any, have run too), else None."""
        try:
            await self._wait_all(futures, compiled, step)
        except BaseException as e:
            for x, a, buf in replicas:  # a copy that never arrived must not be read again
                if x.buffers.get(a) == buf:
                    x.buffers.pop(a, None)
            name = getattr(self.fn, "__name__", "step")
            if step in self._cancelled:
                self._cancelled.discard(step)
                if trace is not None:
                    trace.count("failed")
                raise MpmdError(f"step {step} of {name} was cancelled (its await was cancelled) and aborted on the actors; "
                                "its outputs are gone") from None
            recovered = False
            try:
                recovered = on_failure is not None and isinstance(e, Exception) and await on_failure(e)
            finally:  # (also when the recovery gives up; its actors' records are lost with it: counted, so said)
                if trace is not None:
                    trace.count("recovered" if recovered else "failed")
            if recovered:
                return None  # recovered: the step was replayed and its outputs rebound
            if not isinstance(e, ActorDiedError):  # (a lost actor is this step's own error, with its type)
                await self._raise_upstream_error(upstream, step, name)
            raise name_step(e, step, name) from None
        self._cancelled.discard(step)  # (an abort that came after the step ended changed nothing)
        return {a: f.result().header.get("trace") for a, f in enumerate(futures)} if trace is not None else None

    async def _raise_upstream_error(self, upstream: Sequence[tuple[str, Any]], step: int, name: str) -> None:
        """This step failed: if an earlier step whose outputs it reads did not finish (cancelled, failed), that is
        the cause, raised naming the argument. Waits for those steps to end, 30 s at most in all."""
        by_step = {id(ready): (path, ready) for path, ready in reversed(upstream)}  # each step once (its first argument)
        if not by_step or getattr(self.mesh, "closed", False):
            return
        waits = [asyncio.wrap_future(r) for _, r in by_step.values()]
        for w in waits:  # (read here, or asyncio logs "exception was never retrieved"; the step's own error is raised)
            w.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.wait(waits, timeout=30)
        for path, ready in by_step.values():
            if ready.done() and not ready.cancelled() and ready.exception() is not None:
                # The first failure, said once: a step after a failed one fails with it, and so does the next (the
                # message quoted the one before it, which quoted its own: 250 KB after 1,700 steps).
                cause = ready.exception()
                root = getattr(cause, "mpmd_first_failure", cause)
                err = MpmdError(f"step {step} of {name} read argument {path}, an output of a step that did not finish: {root}")
                err.mpmd_first_failure = root
                raise err from None

    async def _wait_all(self, requests: list[asyncio.Future[Any]], compiled: CompiledStep, step: int) -> None:
        done, pending = await asyncio.wait(requests, return_when=asyncio.FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if not failed:
            return
        if pending and min(_echo_rank(f.exception()) for f in failed) >= _ECHOES["WaitedInVain"]:
            # Only timeouts of waits so far: every actor's request has the same bound, so the actor that was computing
            # (its StillComputing, the cause) answers within moments — aborted at once, it said only "aborted", and a
            # probe's five steps were blamed on actor 0's wait for actor 1, never naming actor 1.
            await asyncio.wait(pending, timeout=ECHO_GRACE)
            pending = {f for f in pending if not f.done()}
        # One actor failed: the others may wait forever on its transfers, so abandon the step everywhere.
        for a, (req, pid) in enumerate(zip(requests, compiled.program_ids)):
            if req in pending and not self.mesh.conn(a).dead:
                try:
                    await self.mesh.conn(a).request("abort", {"program": pid, "step": step})
                except MpmdError:
                    pass
        await asyncio.gather(*pending, return_exceptions=True)
        errors = [f.exception() for f in requests if f.done() and not f.cancelled() and f.exception() is not None]
        raise min(errors, key=_echo_rank)  # (min keeps the first of a rank: the order the actors are numbered in)


# The cause, not its echoes, by the name each actor's error has on the wire (actors/request.py, transport/p2p):
# a lost actor; an error of its own; an actor held by its own data loader, or still computing when its bound ran out,
# for which the others timed out ("nothing came from actor 1", blaming neither; probes); a timeout waiting on another
# actor; last, a step only aborted.
_ECHOES = {"StillComputing": 2, "HeldByLoader": 2, "WaitedInVain": 3, "NothingCame": 3, "StepAborted": 4}
ECHO_GRACE = 1.0  # s the other actors' requests are given to end on their own after a wait timed out (see _wait_all)


def _echo_rank(e: BaseException) -> int:
    """How far `e`, one actor's error of a failed step, is from being the step's cause (0 = surely the cause)."""
    if isinstance(e, ActorDiedError):
        return 0
    return _ECHOES.get(getattr(e, "remote_type", ""), 1)


def with_layouts(prog: Any, unit_exes: list[str], layouts: dict[Any, Any]) -> Any:
    """`prog` with each Run naming its own executable (one per unit: a template compiled for its inputs'
    layouts) and each Recv the layout its value arrives in."""
    import dataclasses

    from mpmd.compiler.program import Recv, Run, Send

    keys: list[str] = []
    instrs = []
    runs = iter(unit_exes)
    for ins in prog.instructions:
        if isinstance(ins, Run):
            k = next(runs)
            if k not in keys:
                keys.append(k)
            ins = dataclasses.replace(ins, exe=keys.index(k))
        elif isinstance(ins, (Recv, Send)):  # both sides agree how the value travels: shard by shard, in its layout
            lay = layouts.get(prog.buffer_keys.get(ins.buf))
            ins = dataclasses.replace(ins, layout=tuple(lay) if lay is not None else ())  # () is replicated: one shard
        instrs.append(ins)
    return dataclasses.replace(prog, instructions=instrs, executables=keys)


def name_step(e: BaseException, step: int, name: str) -> BaseException:
    """The same error, saying which step it broke (an asynchronous step's error surfaces later, elsewhere)."""
    where = f"step {step} of {name}"
    if isinstance(e, ActorDiedError):
        out: BaseException = ActorDiedError(e.actor_id, e.why, where)
    elif isinstance(e, RemoteError):
        out = RemoteError(e.actor_id, e.remote_type, e.remote_message, e.remote_traceback, e.task, where)
    elif isinstance(e, MpmdError):
        out = type(e)(f"during {where}: {e}")
    else:
        return e
    out.__cause__ = e.__cause__
    return out


__all__ = ["DistributedFunction", "PipelineError"]
