"""Host callbacks in a step — `jax.debug.print`, `jax.debug.callback`, `io_callback` — taken out of the
executables and run by the controller. Pure, except `run_host_call`, which calls the user's callback.

Why not on the actor: executables travel as `jax.export` bytes, and a host callback is a pointer to a Python
function of the controller process; the actor can neither call it nor (it never unpickles anything from the
network) receive it. So the compiler strips each callback equation from the stage task it belongs to,
makes its operands extra outputs of the task (one value per microbatch, exactly the values the callback
would have seen under `jax.jit`), and records a `HostCall`. When the step's Programs have run, the
controller fetches those values and binds the equation itself — the user's callback runs once per
microbatch, in each actor's program order, its printed lines prefixed with the actor and task
(`[a1 1F3] loss=0.25`), before the step's outputs count as ready.

What cannot run this way is refused before anything is dispatched, with what to write instead:
* an `io_callback` or `pure_callback` whose result the computation reads (the value would have to come back
  from the controller in the middle of a task);
* `jax.debug.breakpoint` (there is no interactive frame to stop in on an actor);
* `jax.debug.inspect_array_sharding` / `visualize_array_sharding` (XLA calls them as it compiles: on the actor);
* a callback nested inside a construct the compiler does not take apart (`lax.scan` / `while_loop` /
  `cond` bodies, `jax.checkpoint`, `custom_vjp`, `shard_map`): its operands are not values of the task.
Callbacks inside `jax.jit`-ted functions and `custom_jvp` functions (e.g. `jax.nn.relu`) are inlined first and
work.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from mpmd.compiler.eqns import SyntheticEqn, bind_eqn, is_var, sub_jaxprs, var_inputs
from mpmd.errors import PipelineError

HOST_CALLS = frozenset({"debug_print", "debug_callback", "io_callback"})
_RESULT_CALLS = frozenset({"io_callback", "pure_callback"})
_CONSTRUCT_NAMES = {"scan": "a lax.scan (or fixed-bound lax.fori_loop) body", "while": "a lax.while_loop / fori_loop body", "cond": "a lax.cond / switch branch",
                    "remat2": "jax.checkpoint", "checkpoint": "jax.checkpoint", "custom_vjp_call": "a jax.custom_vjp function",
                    "custom_vjp_call_jaxpr": "a jax.custom_vjp function", "shard_map": "shard_map"}


@dataclass(frozen=True)
class HostCall:
    """One callback to run at the controller after a step. `operands` name its values: ("out", j, row) is hidden
    step output j (row `row` of it when not None: a microbatch of a batch leaf), ("const", value) a value known
    when compiling. `actor` and `label` say where it ran (the prefix of its printed lines); `order` sorts the
    calls as jax.jit's program would make them (before the loop, the loop microbatch by microbatch, after)."""

    eqn: Any
    operands: tuple[tuple[Any, ...], ...]
    actor: int
    label: str
    order: tuple[int, ...]


def is_host_call(eqn: Any) -> bool:
    return not isinstance(eqn, SyntheticEqn) and eqn.primitive.name in HOST_CALLS


def _describe(eqn: Any) -> str:
    name = eqn.primitive.name
    if name == "debug_print":
        return f"jax.debug.print({eqn.params.get('fmt', '')!r})"
    return {"debug_callback": "jax.debug.callback", "io_callback": "io_callback", "pure_callback": "jax.pure_callback"}.get(name, name)


def _is_breakpoint(eqn: Any) -> bool:
    """jax.debug.breakpoint binds debug_callback with a callback from jax's debugger, wrapped in closures."""
    todo, seen = [eqn.params.get("callback")], 0
    while todo and seen < 16:
        fn = todo.pop()
        seen += 1
        if fn is None:
            continue
        if str(getattr(fn, "__module__", "")).startswith("jax._src.debugger"):
            return True
        inner = getattr(fn, "callback_func", None)
        todo.extend([inner] if inner is not None else [])
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if callable(value):
                todo.append(value)
    return False


def _nested_call(jaxpr: Any) -> Any:
    for e in jaxpr.eqns:
        if e.primitive.name in HOST_CALLS | _RESULT_CALLS | {"inspect_sharding"}:
            return e
        for j in sub_jaxprs(e):
            found = _nested_call(j)
            if found is not None:
                return found
    return None


# (its callback ran on the controller at export with the controller's view, then jax.export failed on its effect: a probe)
_INSPECTS_SHARDING = ("jax.debug.inspect_array_sharding (or visualize_array_sharding) is inside a distributed step: XLA calls "
                      "it as it compiles, and the stages compile on the actors, where no Python callback of this process can "
                      "run. Look at the layouts the step gives instead: `.sharding` of its outputs (RemoteArray.sharding), "
                      "or the compiled stage's HLO (mesh.actor(i).hlo)")


def check_host_calls(eqns: Iterable[Any], used: set[Any]) -> None:
    """Refuse, before dispatch, the callbacks a step cannot run (module docstring); `used` holds every var
    some equation or output reads."""
    for e in eqns:
        if isinstance(e, SyntheticEqn):
            continue
        name = e.primitive.name
        if name == "inspect_sharding":
            raise PipelineError(_INSPECTS_SHARDING)
        if name == "debug_callback" and _is_breakpoint(e):
            raise PipelineError("jax.debug.breakpoint() is inside a distributed step: a stage runs on an actor, with no "
                                "terminal to stop in. Debug the same function under jax.jit (accumulate_grads runs as a plain "
                                "loop outside mpmd.distributed), or print the values with jax.debug.print")
        if name in _RESULT_CALLS and any(is_var(v) and v in used for v in e.outvars):
            raise PipelineError(
                f"{_describe(e)} returns a value the step computes with; mpmd runs host callbacks at the controller after "
                "the stage that calls them, so their results cannot flow back into the stage. Compute the value with "
                "jax.numpy inside the step, or call the function outside the step and pass its result as an argument "
                "(an io_callback whose result is unused, or jax.debug.callback, runs as under jax.jit)")
        if name == "pure_callback":  # its result is unused: jax.jit would drop it too
            continue
        if name not in HOST_CALLS and name != "mpmd_accumulate":  # the loop body is checked on its own
            for j in sub_jaxprs(e):
                inner = _nested_call(j)
                if inner is not None and inner.primitive.name == "inspect_sharding":
                    raise PipelineError(_INSPECTS_SHARDING)
                if inner is not None:
                    where = _CONSTRUCT_NAMES.get(name, f"a {name!r} equation")
                    raise PipelineError(
                        f"{_describe(inner)} is inside {where} in a distributed step; mpmd runs host callbacks at the "
                        "controller with the values the stage computed, which it can do for callbacks in the stage itself "
                        "(also inside jax.jit-ted functions) but not inside this construct. Move the callback out of it "
                        "(return the value from the construct and print it after), or print it after the step"
                        + (". A runtime check (eqx.error_if, equinox's or checkify's asserts) is such a callback in a cond: "
                           "check the values the step returns instead (e.g. jnp.isfinite of the fetched loss), or run the "
                           "step under jax.jit" if name == "cond" else ""))


def used_vars(eqn_lists: Sequence[Iterable[Any]], outputs: Iterable[Any]) -> set[Any]:
    """Every var the equations read, plus the outputs."""
    used = {v for v in outputs if is_var(v)}
    for eqns in eqn_lists:
        for e in eqns:
            used.update(var_inputs(e))
    return used


def drop_unused_result_calls(eqns: list[Any]) -> list[Any]:
    """The equations without pure_callbacks whose results nobody reads (jax.jit drops them too)."""
    return [e for e in eqns if isinstance(e, SyntheticEqn) or e.primitive.name != "pure_callback"]


def run_host_call(call: HostCall, operands: Sequence[Any]) -> str:
    """Bind the callback equation at the controller on `operands` (host values); what it printed to stdout."""
    out = io.StringIO()
    args = [np.asarray(x) if not hasattr(x, "dtype") or not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for x in operands]
    with _stdout_of_this_thread(out):
        _host_callback(call.eqn)(*args)  # numpy values, as a callback under jax.jit receives them
    return out.getvalue()


class _ByThread:
    """sys.stdout while callbacks run: what a thread running one writes goes to its buffer, what any other thread
    writes to the stream it replaced, at once (contextlib.redirect_stdout took every thread's prints: a server's
    own log lines came out 2 s late, each prefixed as the callback's: a probe). Everything else (encoding, isatty,
    fileno, ...) is the stream's; with no stream (sys.stdout None) other threads' writes go nowhere, as before."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, text: str) -> int:
        buf = _CAPTURES.get(threading.get_ident())
        if buf is not None:
            return buf.write(text)
        return self.inner.write(text) if self.inner is not None else len(text)

    def flush(self) -> None:
        if threading.get_ident() not in _CAPTURES and self.inner is not None:
            self.inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_CAPTURES: dict[int, io.StringIO] = {}
_CAPTURING = threading.Lock()


@contextlib.contextmanager
def _stdout_of_this_thread(out: io.StringIO) -> Any:
    """Send this thread's writes to sys.stdout into `out` while the block runs, other threads' through (one router
    for any number of threads at once, removed with the last unless something replaced sys.stdout meanwhile)."""
    me = threading.get_ident()
    with _CAPTURING:
        if not isinstance(sys.stdout, _ByThread):
            sys.stdout = _ByThread(sys.stdout)
        outer = _CAPTURES.get(me)  # (a capture inside one on the same thread: the outer one's again after it)
        _CAPTURES[me] = out
    try:
        yield out
    finally:
        with _CAPTURING:
            if outer is not None:
                _CAPTURES[me] = outer
            else:
                _CAPTURES.pop(me, None)
            if not _CAPTURES and isinstance(sys.stdout, _ByThread):
                sys.stdout = sys.stdout.inner


def _host_callback(eqn: Any) -> Any:
    """The flat Python callback a callback equation stands for."""
    if eqn.primitive.name != "debug_print":
        return eqn.params["callback"]
    try:  # what debug_print's own implementation calls (jax._src.debugging.debug_print_impl)
        from jax._src.debugging import _format_print_callback, _make_flat_callback

        p = eqn.params
        fmt = functools.partial(_format_print_callback, p["fmt"], dict(p["np_printoptions"]), p["has_placeholders"],
                                p["logging_record"])
        return _make_flat_callback(p["in_tree"], fmt, p["static_args"])
    except (ImportError, KeyError):  # another JAX: bind the equation eagerly (values printed as jax Arrays)
        return lambda *xs: bind_eqn(eqn, list(xs))


def prefixed(call: HostCall, text: str) -> str:
    """Each line of `text` prefixed with where the call ran: `[a1 1F3] ...`."""
    return "".join(f"[a{call.actor} {call.label}] {line}\n" for line in text.splitlines())
