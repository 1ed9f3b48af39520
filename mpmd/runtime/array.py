"""RemoteArray: a handle to an array that lives on one or more actors of one mesh, and `fetch`."""

from __future__ import annotations

import concurrent.futures
from collections import defaultdict
from typing import Any, Protocol

import jax
import numpy as np

from mpmd.compiler.avals import dtype_text, from_wire, is_key, wire_shape_dtype
from mpmd.errors import ActorDiedError, MpmdError
from mpmd.runtime.controller import result_of, wait_settled
from mpmd.runtime.waiters import waiting_for


class BufferOwner(Protocol):
    """What a RemoteArray asks of the mesh that holds its buffers (`RemoteMesh` is one): `buffers` maps actor
    index to buffer id there."""

    @property
    def closed(self) -> bool: ...

    def get_buffer(self, actor: int, buf: int, nbytes: int = 0) -> np.ndarray: ...

    def get_buffer_async(self, actor: int, buf: int, nbytes: int = 0) -> concurrent.futures.Future[np.ndarray]: ...

    def get_buffers(self, bufs: dict[int, list[int]], nbytes: dict[int, list[int]] | None = None) -> dict[int, list[np.ndarray]]: ...

    def wait_buffers(self, bufs: dict[int, list[int]]) -> None: ...

    def delete_buffers(self, buffers: dict[int, int]) -> None: ...

    def release_buffers(self, buffers: dict[int, int]) -> None: ...


HELD = "held by the actors: mpmd.fetch(x) brings it here"  # (in str(x): JAX's errors quote it)


class RemoteArray:
    """A handle to an array held by actors of one `RemoteMesh`. The data stays there until it is fetched
    (`np.asarray(x)`, `x.to_numpy()`, `jax.device_get(x)`, `mpmd.fetch(tree)`).

    `actors` lists the actors holding a copy (usually one); `buffers` maps each to its buffer id there. It has
    `shape`, `dtype`, `ndim`, `size`, `nbytes` like a jax.Array, is a leaf for `jax.tree` utilities, and can be
    passed back to the step or `actor(i).run` of its own mesh. Dropping the last reference frees the remote
    buffers (batched, asynchronously); `delete()` frees them now.
    """

    __slots__ = ("__weakref__", "_host", "_ready", "_vid", "buffers", "copied", "donated_to", "donation_lost", "dtype", "mesh", "shape", "sharding",
                 "weak_type")

    def __init__(self, mesh: BufferOwner, buffers: dict[int, int], shape: tuple[int, ...], dtype: Any, sharding: Any = None,
                 ready: concurrent.futures.Future[Any] | None = None, weak_type: bool = False) -> None:
        self.mesh = mesh
        self.buffers = dict(buffers)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype if is_key(dtype) else np.dtype(dtype)
        self.sharding = sharding  # how each actor holds it over its devices (None: on one device)
        self._host: concurrent.futures.Future[np.ndarray] | None = None
        self._ready = ready  # the dispatch of the step that makes it (None: made already)
        self._vid = 0  # its value id in the mesh's recovery log (mpmd.runtime.recovery; 0: none yet)
        self.donated_to: str | None = None  # the step it was donated to (donate_argnums), once it was
        self.donation_lost = False  # that step's call_async was cancelled after its dispatch: its outputs never came
        # Weakly typed, as jax.jit's output of `lr * 0.99` for a Python-float lr is: passed back to a step it
        # stays weak, so `w - lr * g` keeps a bf16 `w` bf16 (jax's type promotion).
        self.weak_type = bool(weak_type)
        self.copied = False  # `copy.deepcopy` handed it out as its own copy: a step's donate_argnums leaves it alone

    @property
    def actors(self) -> list[int]:
        return sorted(self.buffers)

    @property
    def actor(self) -> int:
        """The (first) actor holding this array."""
        return self.actors[0]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        shape, dtype = wire_shape_dtype(self.shape, self.dtype)
        return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def is_deleted(self) -> bool:
        """Whether the array was deleted (or donated), as `jax.Array.is_deleted()` (a method there too: code written
        for JAX called it and met "'bool' object is not callable"; a probe)."""
        return not self.buffers

    def deleted_why(self) -> str:
        """What happened to a deleted array, said to whoever reads it."""
        if self.donated_to is not None and self.donation_lost:
            return (f"{self!r} was donated to {self.donated_to} (donate_argnums), whose call_async was cancelled after the "
                    "step was dispatched: the step was aborted and its outputs never reached the caller, so the state this "
                    "array held is gone (restore it from a checkpoint). A timeout belongs on the awaits of a donating "
                    "step's outputs (fetch_async, ready_async: they do not abort it), not on its call_async")
        if self.donated_to is not None:
            return (f"{self!r} was donated to {self.donated_to} (donate_argnums): its buffer went to that step's outputs; "
                    "use those, or leave it out of donate_argnums")
        return f"{self!r} was deleted; its data is gone"

    def _check_usable(self) -> None:
        if not self.buffers:
            recovery = getattr(self.mesh, "recovery", None)
            why = recovery.why_gone(self) if recovery is not None else None
            if why:  # (lost with an actor: an output of a step that failed says that step's error)
                self._raise_step_error()
            raise MpmdError(why or self.deleted_why())
        if self.mesh.closed:
            raise MpmdError(f"{self!r} belongs to {self.mesh!r}, which is closed; its data is gone")
        self._raise_step_error()
        getattr(self.mesh, "check_not_replaced", lambda x, what: None)(self, "this array")

    def _failed_fetch(self, error: BaseException) -> None:
        """A fetch of this array failed with `error`. Raises the clearer error when its mesh closed meanwhile. When
        the error is the loss of an actor holding it, the step that makes it fails of that same loss, which the
        caller now sees: its next call does not raise it again (other failures are left for the step's own error
        to be raised, by the fetch or by the next call)."""
        closed = self.mesh.closed
        if self._ready is not None and (closed or (isinstance(error, ActorDiedError) and error.actor_id in self.actors)):
            self._ready.seen = True
        if closed:
            raise MpmdError(f"{self!r} belongs to {self.mesh!r}, which was closed before the fetch could end; its data "
                            "is gone") from error
        if not self.buffers:  # deleted meanwhile — donated to a step another thread called: said as reading it after
            self._check_usable()  # would say it, not as the actor's "holds no buffer N ... never put?" (a probe)

    def _step_error_first(self) -> None:
        """After the actor's note that this array's buffer never came (a failed step's output): raise the step's
        own error instead, once the step has ended (waiting up to 30 s)."""
        if self._ready is not None:
            try:
                self._ready.result(timeout=30)
            except Exception:
                self._raise_step_error()

    def _step_failed(self) -> bool:
        """Whether the step that makes this array failed or was aborted (its actors freed the buffers it names)."""
        r = self._ready
        return r is not None and r.done() and (r.cancelled() or r.exception() is not None)

    def _raise_step_error(self) -> None:
        """If the step that makes this array failed, raise its error (once seen, the step's next call does not)."""
        r = self._ready
        if r is not None and r.done() and r.cancelled():  # (exception() of a cancelled future raises CancelledError)
            raise MpmdError(f"{self!r} is the output of a step that was cancelled before it ended; its data never came "
                            "(call the step again)")
        if r is not None and r.done() and r.exception() is not None:
            r.seen = True
            raise r.exception()

    def _wire(self) -> np.ndarray:
        """The array as the actors hold it (key data for a key array)."""
        with waiting_for([self._ready]):  # (a coroutine's cancelled await of the same step does not abort it)
            return self._wire_waited()

    def _wire_waited(self) -> np.ndarray:
        if self._ready is not None and getattr(self._ready, "host_calls", False):
            wait_settled([self._ready])  # a step's callbacks print before any of its values is seen
        before, host = dict(self.buffers), self._host
        try:
            if host is not None:  # (begun by copy_to_host_async, as jax.device_get does: recovered from alike; a probe)
                return result_of(host)
            self._check_usable()
            return self.mesh.get_buffer(self.actor, self.buffers[self.actor], self.nbytes)
        except MpmdError as e:
            self.drop_failed_host()
            if _recovered(self.mesh, e, self._ready) and self.buffers and self.buffers != before:
                return self.mesh.get_buffer(self.actor, self.buffers[self.actor], self.nbytes)  # rebound by the recovery
            self._failed_fetch(e)
            self._step_error_first()
            raise

    def drop_failed_host(self) -> None:
        """Forget a fetch begun by `copy_to_host_async` that failed: the next read asks the actors again (it was
        kept, and every later read of the array raised its error, even once the mesh had recovered; a probe)."""
        host = self._host
        if host is not None and host.done() and (host.cancelled() or host.exception() is not None):
            self._host = None

    def to_numpy(self) -> np.ndarray:
        """Fetch the array to the controller (waits for the computation that produces it). The result is a
        read-only view of the received bytes (no copy); use `np.array(r)` for a writable copy. A typed PRNG
        key array has no numpy form: fetch it with `mpmd.fetch(x)` (a jax key array)."""
        if is_key(self.dtype):
            raise TypeError(f"{self!r} holds typed PRNG keys, which numpy cannot represent; use mpmd.fetch(x) for a "
                            "jax key array, or jax.random.key_data inside the step for its raw bits")
        return self._wire()

    def fetch(self) -> Any:
        """The value on the controller: a numpy array, or a jax key array for typed PRNG keys."""
        return from_wire(self._wire(), self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.to_numpy()
        if copy:  # (np.array(x) asks for a copy, and takes what comes back as one: the read-only fetched view was it)
            return np.array(a, dtype=dtype, copy=True)
        return a.astype(dtype) if dtype is not None else a

    def item(self, *args: Any) -> Any:
        """The element as a Python scalar (fetched), as `numpy.ndarray.item`."""
        return self.to_numpy().item(*args)

    def tolist(self) -> Any:
        """The array as nested Python lists (fetched)."""
        return self.to_numpy().tolist()

    # Python conversions fetch, as numpy's do (a size-1 array only): `float(loss)`, `f"{loss:.3f}"`, `if done:`.
    def __float__(self) -> float:
        return float(self.to_numpy())

    def __int__(self) -> int:
        return int(self.to_numpy())

    def __complex__(self) -> complex:
        return complex(self.to_numpy())

    def __round__(self, ndigits: int | None = None) -> Any:  # (as numpy's: round(x) of a 0-d array fetches; a probe)
        return round(self.to_numpy()[()] if not self.shape else self.to_numpy(), ndigits)

    def __bool__(self) -> bool:
        return bool(self.to_numpy())

    def __index__(self) -> int:
        return self.to_numpy().__index__()

    def __format__(self, spec: str) -> str:
        return format(self.to_numpy(), spec) if spec else str(self)

    def __str__(self) -> str:
        # (what print, f-strings and JAX's "is not a valid JAX type" error show: `jnp.mean(x)` and `jax.jit(f)(x)`
        # of a RemoteArray then say how to use it here; repr stays short for containers)
        return f"{self!r} ({HELD})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object (a 0-d RemoteArray)")
        return self.shape[0]

    # A RemoteArray is immutable: a copy is the array itself. One copied is no longer donated (donate_argnums
    # would delete the copy with it), as jax.jit keeps a donated buffer it cannot reuse.
    def __copy__(self) -> RemoteArray:
        self.copied = True
        return self

    def __deepcopy__(self, memo: Any) -> RemoteArray:
        return self.__copy__()

    def __reduce__(self) -> Any:
        raise TypeError(f"{self!r} lives on its actors and cannot be pickled: mpmd.fetch(tree) it for its values "
                        "(or mpmd.save the tree for a checkpoint)")

    __hash__ = object.__hash__  # (by identity, as before `==` was refused)
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """numpy's ufuncs and operators (`np.isfinite(x)`, `np.add(x, 1)`, `np.ones(3) + x`) are refused as `x + 1`
        is (they fetched silently once; then numpy's bare "does not support ufuncs"; a probe)."""
        raise TypeError(f"numpy's {getattr(ufunc, '__name__', ufunc)} cannot run on {self!r}: it lives on its actors. Inside a "
                        "step, pass it as an argument of the distributed step; outside, fetch it first (np.asarray(x) or "
                        "mpmd.fetch(x)) and compute on the result")

    def __iter__(self) -> Any:
        raise TypeError(f"{self!r} lives on its actors and cannot be iterated here: fetch it first (np.asarray(x) or mpmd.fetch(x))")

    def _no_math(self, *_: Any) -> Any:
        raise TypeError(f"{self!r} lives on its actors: arithmetic, indexing and comparisons do not run on the controller. "
                        "Inside a step, pass it as an argument of the distributed step (closing over it does not work); "
                        "outside, fetch it first (np.asarray(x) or mpmd.fetch(x)) and compute on the result")

    def __getattr__(self, name: str) -> Any:
        # (only for names the class lacks: jax.Array's methods and properties — `.mean()`, `.T`, `.astype` — get the
        # reason and what to do; other names, and the protocols copy, pickle and numpy probe, a plain AttributeError)
        if not name.startswith("_") and hasattr(jax.Array, name):
            raise AttributeError(
                f"{self!r} has no .{name} here: it lives on its actors, and jax.Array's methods do not run on the "
                "controller. Inside a step, pass it as an argument of the distributed step; outside, fetch it first "
                f"(np.asarray(x) or mpmd.fetch(x)) and call .{name} on the result")
        raise AttributeError(f"'RemoteArray' object has no attribute {name!r}")

    def copy_to_host_async(self) -> None:
        """Start fetching the array (what `jax.device_get` calls first); the next fetch uses the result."""
        if self._host is None:
            self._check_usable()
            self._host = self.mesh.get_buffer_async(self.actor, self.buffers[self.actor], self.nbytes)

    def is_ready(self) -> bool:
        """Whether the step making it has finished on every actor (without asking them)."""
        return self._ready is None or self._ready.done()

    def block_until_ready(self) -> RemoteArray:
        """Wait until the actors have computed this array (without fetching it); returns it. Raises the error
        of the step that makes it, if that failed."""
        with waiting_for([self._ready]):  # (a coroutine's cancelled await of the same step does not abort it)
            return self._block_until_ready()

    def _block_until_ready(self) -> RemoteArray:
        self._check_usable()
        if self._ready is not None:
            try:
                result_of(self._ready)
            except Exception:
                self._raise_step_error()
                raise
        try:
            self.mesh.wait_buffers({a: [b] for a, b in self.buffers.items()})
        except MpmdError as e:
            before = dict(self.buffers)
            if not (_recovered(self.mesh, e, self._ready) and self.buffers and self.buffers != before):
                raise
            self.mesh.wait_buffers({a: [b] for a, b in self.buffers.items()})  # rebound by the recovery
        return self

    def delete(self) -> None:
        """Free the remote buffers now (waits for the actors to confirm). Reading it afterwards raises, even where a
        value was fetched before (`jax.device_get` keeps one)."""
        buffers, self.buffers, self._host = self.buffers, {}, None
        if buffers and not self.mesh.closed:
            self.mesh.delete_buffers(buffers)

    def __del__(self) -> None:
        buffers = getattr(self, "buffers", None)
        if buffers:
            try:
                self.mesh.release_buffers(buffers)
            except Exception:
                pass

    def __repr__(self) -> str:
        if not self.buffers:  # (lost with its actors, when a recovery could not put it back: it read 'deleted'; a probe)
            lost = getattr(getattr(self.mesh, "recovery", None), "lost_with", lambda x: None)(self)
            where = f"lost with actor{'s' * (len(lost) > 1)} {','.join(map(str, lost))}" if lost else "deleted"
        else:
            where = f"on actor{'s' if len(self.buffers) > 1 else ''} {','.join(map(str, self.actors))}"
        sharding = f", sharding={self.sharding}" if self.sharding is not None else ""
        return f"RemoteArray({dtype_text(self.dtype)}{list(self.shape)}, {where}{sharding})"


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "divmod", "pow", "matmul", "and", "or", "xor", "lshift",
            "rshift"):
    setattr(RemoteArray, f"__{_op}__", RemoteArray._no_math)
    setattr(RemoteArray, f"__r{_op}__", RemoteArray._no_math)
for _op in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge", "eq", "ne", "getitem"):
    setattr(RemoteArray, f"__{_op}__", RemoteArray._no_math)


def _recovered(mesh: Any, error: BaseException, ready: Any) -> bool:
    """Whether `mesh` recovered from the failure behind `error` (a mesh made with recover=...: its arrays may
    have been rebound to restored buffers)."""
    recovery = getattr(mesh, "recovery", None)
    return recovery is not None and recovery.settle(error, ready)


def _by_actor(arrays: list[RemoteArray], indices: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for x, i in zip(arrays, indices):
        out[x.actor].append(i)
    return out


def wait_ready(tree: Any) -> Any:
    """Wait until the RemoteArrays of a pytree are computed, without fetching them (other leaves, such as a
    step's static outputs, need no wait): one array per step that makes them, since a step's outputs are done
    together. Returns `tree`; raises the error of a step that failed."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, RemoteArray))
    one_per_step = {id(x._ready): x for x in leaves if isinstance(x, RemoteArray)}
    for x in one_per_step.values():
        x.block_until_ready()
    return tree


def fetch(tree: Any) -> Any:
    """Bring every RemoteArray of a pytree to the controller in one round trip per actor (other leaves stay
    as they are). Returns numpy arrays (jax key arrays for typed PRNG keys), in the same tree.

        params_np = mpmd.fetch(params)
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, RemoteArray))
    with waiting_for({id(x._ready): x._ready for x in leaves if isinstance(x, RemoteArray)}.values()):
        return _fetch(leaves, treedef)  # (a coroutine's cancelled await of the same steps does not abort them)


def _fetch(leaves: list[Any], treedef: Any) -> Any:
    wanted: dict[tuple[Any, int], list[int]] = defaultdict(list)  # (mesh, actor) -> leaf indices
    for i, x in enumerate(leaves):
        if isinstance(x, RemoteArray) and x._ready is not None and getattr(x._ready, "host_calls", False):
            wait_settled([x._ready])  # a step's callbacks print before any of its values is seen
        if isinstance(x, RemoteArray) and x._host is None:
            x._check_usable()
            wanted[(x.mesh, x.actor)].append(i)
    got: dict[int, np.ndarray] = {}
    by_mesh: dict[Any, dict[int, list[int]]] = defaultdict(dict)
    for (mesh, a), idx in wanted.items():
        by_mesh[mesh][a] = idx
    for mesh, per_actor in by_mesh.items():
        bufs = {a: [leaves[i].buffers[a] for i in idx] for a, idx in per_actor.items()}
        try:
            arrays = mesh.get_buffers(bufs, {a: [leaves[i].nbytes for i in idx] for a, idx in per_actor.items()})
        except MpmdError as e:  # a lost actor the mesh recovered from: the arrays were rebound, read them again
            recovered = _recovered(mesh, e, None)
            if recovered:  # (one the recovery could not put back says so, not the loss it recovered from)
                for idx in per_actor.values():
                    for i in idx:
                        leaves[i]._check_usable()
            if not recovered:
                failed = [leaves[i] for idx in per_actor.values() for i in idx]
                for x in failed:
                    x._failed_fetch(e)
                for x in failed:
                    # (the loss of an actor holding it is the one to raise; anything else an actor said of a failed
                    # step's output, e.g. "aborted", gives way to the step's own error: a probe saw StepAborted)
                    if not (isinstance(e, ActorDiedError) and e.actor_id in x.actors):
                        x._step_error_first()
                raise
            per_actor = _by_actor([leaves[i] for idx in per_actor.values() for i in idx],
                                  [i for idx in per_actor.values() for i in idx])
            arrays = mesh.get_buffers({a: [leaves[i].buffers[a] for i in idx] for a, idx in per_actor.items()},
                                      {a: [leaves[i].nbytes for i in idx] for a, idx in per_actor.items()})
        for a, idx in per_actor.items():
            got.update(zip(idx, arrays[a]))
    out = [from_wire(got[i] if i in got else x._wire(), x.dtype) if isinstance(x, RemoteArray) else x for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)
