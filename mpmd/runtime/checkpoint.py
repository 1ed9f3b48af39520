"""Checkpoints of state held on actors: `mpmd.save(path, tree)`, `mpmd.restore(path, mesh, like=tree)` and
`mpmd.load(path)`.

    mpmd.save("ckpt", (params, opt_state))                      # each actor writes its own arrays
    params, opt_state = mpmd.restore("ckpt", mesh, like=(params, opt_state))            # any mesh, any layout
    params, opt_state = mpmd.restore("ckpt", mesh, like=(params, opt_state), for_step=step)  # where `step` reads them
    host = mpmd.load("ckpt")                                     # no mesh: numpy arrays

Each actor writes the arrays it holds as one orbax-checkpoint directory, each array whole (one copy of a
replicated array); host leaves (numpy arrays, scalars) are written by the controller. A checkpoint is
committed only when every part is written: parts go to `path/ckpt-<n>.tmp`, with a manifest holding every
array's and every file's SHA-256 (mpmd/runtime/checkpoint_format.py); the directory is renamed to
`path/ckpt-<n>`, and `path/LATEST` then names it (atomically replaced) — a crash during a save leaves the
previous checkpoint loadable, and the next save removes what the crashed one left behind.

Static leaves — functions, strings, and an equinox Module's fields that are not arrays (an activation,
`Dropout.inference`, an int head count), the leaves a distributed step keeps static (mpmd/static_leaves.py) —
are part of the program, not its state: a save does not write them, and `restore`/`load` with `like` take them
from `like` (as `eqx.tree_deserialise_leaves` does); `load` without `like` returns the data alone.

A restore verifies the manifest's own digest, then every part's listing, then every byte each actor reads
before a value reaches a buffer; dtype and shape come from the verified manifest. Anything amiss raises
`mpmd.CheckpointError` naming the checkpoint, actor, file and leaf.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import itertools
import logging
import os
import shutil
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpmd.compiler.avals import dtype_text, from_wire, is_key, jax_array, key_impl, not_numeric, to_wire, wire_shape_dtype
from mpmd.errors import ActorDiedError, CheckpointError, MpmdError, RemoteError, callers_level
from mpmd.runtime.aio import off_loop, watch
from mpmd.runtime.array import RemoteArray
from mpmd.runtime.checkpoint_format import (
    HOST_PART,
    MANIFEST,
    Leaf,
    Manifest,
    check_parts,
    checkpoint_number,
    committed,
    path_entries,
    read_manifest,
)
from mpmd.runtime.checkpoint_placement import Target, dtype_matches, like_shape_dtype, targets
from mpmd.runtime.controller import CLOSED_MEANWHILE, blocking, wait_settled
from mpmd.runtime.sharding import layout_to_spec, layout_wire, remote_sharding
from mpmd.runtime.waiters import waiting_for
from mpmd.static_leaves import hide, reveal
from transport.checkpoint_parts import CheckpointProblem, read_part, write_part

_TMP_FDS: dict[str, int] = {}  # the .tmp directories of saves of this process still being written -> their flock'd fd
_TMP_LOCK = threading.Lock()  # (and `_HANDED_OUT`)

log = logging.getLogger(__name__)


def _is_remote(x: Any) -> bool:
    return isinstance(x, RemoteArray)


_SAVING: dict[str, set[concurrent.futures.Future[Any]]] = {}  # path -> this process's saves into it still writing
_SAVING_LOCK = threading.Lock()


def _track_save(path: str, future: concurrent.futures.Future[Any]) -> None:
    """Note a save into `path` until it ends, so that a restore or load of `path` waits for it (`_wait_for_saves`)."""
    key = os.path.realpath(path)
    with _SAVING_LOCK:
        _SAVING.setdefault(key, set()).add(future)

    def ended(f: concurrent.futures.Future[Any]) -> None:
        with _SAVING_LOCK:
            pending = _SAVING.get(key, set())
            pending.discard(f)
            if not pending:
                _SAVING.pop(key, None)

    future.add_done_callback(ended)


def _wait_for_saves(path: str) -> None:
    """Wait for this process's saves into `path` still writing (`save(..., wait=False)` right before a restore): the
    latest checkpoint is the one they commit, as orbax's CheckpointManager reads after its async saves end."""
    real = os.path.realpath(path)
    with _SAVING_LOCK:  # (and into its parent, for one of its ckpt-<n>: a save's keep= may remove it meanwhile)
        pending = [*_SAVING.get(real, ()), *(_SAVING.get(os.path.dirname(real), ()) if checkpoint_number(os.path.basename(real))
                                             is not None else ())]
    if pending:
        log.info("waiting for %d save(s) into %s to commit before reading it", len(pending), path)
        wait_settled(pending)


class SaveHandle:
    """A save in progress: `wait()` returns the committed directory (or raises the save's error)."""

    def __init__(self, future: concurrent.futures.Future[str], mesh: Any = None) -> None:
        self._future = future
        self._mesh = mesh  # (closed meanwhile: its cancelled write says so)
        self._seen = False  # whether anything has waited for it (else a failure is logged: `_said_if_unseen`)
        self._cleared = concurrent.futures.Future()  # set once a failed save's .tmp directory is gone

    CLEAR_WAIT = 30.0  # seconds a failed save's wait waits for its .tmp directory to be removed before it raises

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        return self._wait(timeout, "SaveHandle.wait")

    def _wait(self, timeout: float | None, what: str) -> str:
        self._seen = True
        with blocking(what):
            try:
                return self._future.result(timeout)
            except concurrent.futures.CancelledError as e:  # (a bare CancelledError when the mesh closed meanwhile)
                if self._mesh is not None and self._mesh.closed:
                    raise CheckpointError(f"{what}: {CLOSED_MEANWHILE}; this save committed nothing") from e
                raise
            except Exception:  # (once its actors answered, its .tmp goes: a failed save waited for leaves none behind;
                # it was still there when the error came, a probe)
                self._wait_cleared()
                raise

    def _wait_cleared(self) -> None:
        """Wait (CLEAR_WAIT seconds at most) until a failed save's .tmp directory is gone — not for a save still
        running (a wait that timed out), nor on the controller loop's own thread or with its mesh closed (the loop
        removes it)."""
        mesh = self._mesh
        if not self._future.done() or self._future.cancelled() or mesh is None or mesh.closed:
            return
        io = getattr(mesh, "_io", None)
        if io is not None and io.on_loop_thread():
            return
        deadline = time.monotonic() + self.CLEAR_WAIT
        while not self._cleared.done() and not mesh.closed and time.monotonic() < deadline:
            concurrent.futures.wait([self._cleared], timeout=0.1)

    def _said_if_unseen(self, path: str) -> SaveHandle:
        """A background save (`wait=False`) that fails before anything waits for it is logged as an error when it
        fails: a training loop that checkpoints every N steps and never waits would otherwise go on believing it
        checkpoints (orbax raises such an error at the next save; here the loop goes on, and says so)."""
        def done(f: concurrent.futures.Future[str]) -> None:
            if not self._seen and not f.cancelled() and (e := f.exception()) is not None:
                log.error("mpmd.save(..., wait=False) into %s failed in the background (nothing had waited for its handle): "
                          "%s: %s", path, type(e).__name__, e)

        self._future.add_done_callback(done)
        return self


@contextlib.contextmanager
def _path_lock(path: str) -> Any:
    """Held while a save picks its name or commits: saves into one `path` from several threads or processes
    take turns there (an flock on the directory itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _being_written(tmp: str) -> bool:
    """Whether a live save (of any process) holds `tmp`: each save holds an flock on its .tmp directory until it
    ends, so one a killed process left behind is free."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


_HANDED_OUT: dict[tuple[str, int, int], int] = {}  # checkpoint directory (path, device, inode) -> the highest number handed out


def _start(path: str) -> tuple[str, str]:
    """Pick the next checkpoint's name and make its .tmp directory (held until the save ends), first removing
    the .tmp directories that saves killed earlier left behind (not those of saves still being written, in
    this process or another)."""
    os.makedirs(path, exist_ok=True)
    with _TMP_LOCK, _path_lock(path):
        numbers = []
        for d in os.listdir(path):
            n = checkpoint_number(d)
            if n is None:
                continue
            numbers.append(n)
            full = os.path.abspath(os.path.join(path, d))
            if d.endswith(".tmp") and full not in _TMP_FDS and not _being_written(full):
                shutil.rmtree(full, ignore_errors=True)
        # Never a number this process handed out before, even one whose .tmp is gone: a save abandoned by this
        # controller may still be written by an actor that was stopped (SIGSTOP) and resumed, into that name.
        st = os.stat(path)
        # (the directory itself, where it is: one a user removed and made again, or a new one that got a removed
        # one's inode, starts afresh)
        key = (os.path.realpath(path), st.st_dev, st.st_ino)
        number = 1 + max(max(numbers, default=0), _HANDED_OUT.get(key, 0))
        _HANDED_OUT[key] = number
        name = f"ckpt-{number}"
        tmp = os.path.abspath(os.path.join(path, name + ".tmp"))
        os.makedirs(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _TMP_FDS[tmp] = fd
    return name, tmp


def _done_saving(tmp: str) -> None:
    with _TMP_LOCK:
        fd = _TMP_FDS.pop(tmp, None)
    if fd is not None:
        os.close(fd)


def _is_checkpoint(path: str, d: str) -> bool:
    """A committed checkpoint directory `path/d` (its name, and a manifest in it: a user's own `ckpt-7` stays)."""
    return (not d.endswith(".tmp") and checkpoint_number(d) is not None
            and any(os.path.isfile(os.path.join(path, d, f)) for f in (MANIFEST, "meta.json")))


def _commit(path: str, name: str, tmp: str, keep: int) -> str:
    """Rename `tmp` to `path/name`; LATEST names it unless a save started later committed first (LATEST only
    moves forward), and only the `keep` newest checkpoints stay. LATEST's new contents are written (and synced)
    before the rename, so that a disk too full for them commits nothing (it committed the checkpoint and left LATEST
    naming the one before, which a restore of the path then read without a word: a probe); the renames after need
    no room."""
    final = os.path.join(path, name)
    latest_tmp = os.path.join(path, "LATEST.tmp")
    with _path_lock(path):
        done = sorted((d for d in os.listdir(path) if _is_checkpoint(path, d)), key=checkpoint_number)
        ahead = not done or checkpoint_number(done[-1]) < checkpoint_number(name)
        if ahead:
            try:
                with open(latest_tmp, "w") as f:
                    f.write(name)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                with contextlib.suppress(OSError):
                    os.remove(latest_tmp)
                raise  # (the caller removes `tmp` and says nothing was committed)
        os.replace(tmp, final)
        try:
            if ahead:
                os.replace(latest_tmp, os.path.join(path, "LATEST"))
            else:
                log.info("mpmd.save: %s committed after %s, a save started later: LATEST stays %s", final, done[-1], done[-1])
            done = sorted([*done, name], key=checkpoint_number)  # (what the listing above holds now: this one is in)
            for d in done[: max(0, len(done) - keep)]:
                shutil.rmtree(os.path.join(path, d), ignore_errors=True)
        except OSError as e:  # (committed: said so, not as a save that wrote nothing; a review)
            raise CheckpointError(f"mpmd.save into {path}: {final} was committed, but updating LATEST or removing older "
                                  f"checkpoints failed ({e}); read it by its own directory", checkpoint=final) from e
    return final


def _failed_step(path: str, flat: list[tuple[Any, Any]]) -> CheckpointError | None:
    """Why a save of `flat` (path, leaf) pairs failed when a saved array's step failed (an actor then says only
    that the step was aborted): that step's error, naming the leaf; None when every such step succeeded."""
    for p, x in flat:
        ready = getattr(x, "_ready", None) if isinstance(x, RemoteArray) else None
        if ready is not None and ready.done() and not ready.cancelled() and ready.exception() is not None:
            err = ready.exception()
            e = CheckpointError(f"mpmd.save into {path}: {jax.tree_util.keystr(p)} is an output of a step that did not finish: "
                                f"{str(err).splitlines()[0][:500]}; nothing was committed", checkpoint=path, leaf=jax.tree_util.keystr(p))
            e.__cause__ = err
            return e
    return None


def _check_path(where: str, path: Any) -> None:
    """A TypeError naming `where` for a path that is not one (None gave os's bare "expected str, bytes or
    os.PathLike object"; a probe), a ValueError for an empty one (it was the working directory, where `keep`
    pruned: a probe)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: the checkpoint directory must be a path (str or os.PathLike), got {type(path).__name__} "
                        f"{path!r:.60}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{where}: the checkpoint directory must be a str path, got bytes {text!r:.60}: decode it "
                        "(os.fsdecode) if it is UTF-8")
    if not text.strip():
        raise ValueError(f"{where}: the checkpoint directory is an empty name {text!r}; name a directory "
                         "(e.g. 'checkpoints', or '.' for the working directory)")
    try:  # (the actors are told the path as UTF-8 text: a name of other bytes failed deep inside, after its directory
        text.encode("utf-8")  # was made; a probe)
    except UnicodeEncodeError:
        raise ValueError(f"{where}: the checkpoint directory {text!r:.120} is not UTF-8 text (a name of other "
                         "bytes), which the actors could not be told; name a directory whose path is UTF-8") from None


def _check_flag(where: str, name: str, value: Any) -> None:
    """A TypeError naming `name` unless `value` is True or False ("no" was taken for True, 2 passed; a probe)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r:.40}")


def save(path: str, tree: Any, *, wait: bool = True, keep: int = 1) -> str | SaveHandle:
    """Save a pytree of RemoteArrays (and host values) to directory `path`. Each actor writes its own arrays,
    concurrently with later steps (a step dispatched after this call does not wait for the write); with
    `wait=False` the call returns a `SaveHandle` at once (a save that fails before anything waits for its handle
    is logged as an error). The `keep` newest checkpoints are kept. Returns the committed checkpoint's directory
    (`path/ckpt-<n>`)."""
    _check_flag("mpmd.save", "wait", wait)
    handle = _save(path, tree, keep)
    return handle._wait(None, "mpmd.save") if wait else handle._said_if_unseen(os.path.abspath(path))


def _save(path: str, tree: Any, keep: int) -> SaveHandle:
    """`save`'s work: the save started (its arguments checked, the host part written), as a handle. The save waits
    for the steps that make what it saves from its call on, as an await of their outputs does: a coroutine's
    cancelled await of such a step (a `wait_for` on its loss timing out) aborted it, and the save failed, "nothing
    was committed", though the README says a step another wait counts on runs on (a probe; see runtime/waiters.py)."""
    making = {id(r): r for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_remote)
              if isinstance(x, RemoteArray) and (r := x._ready) is not None and not r.done()}
    counted = waiting_for(making.values())
    counted.__enter__()
    try:
        handle = _save_counted(path, tree, keep)
    except BaseException:
        counted.__exit__(None, None, None)
        raise
    handle._future.add_done_callback(lambda _: counted.__exit__(None, None, None))
    return handle


def _save_counted(path: str, tree: Any, keep: int) -> SaveHandle:
    _check_path("mpmd.save", path)
    path = os.path.abspath(path)  # (the actors are told this path: their working directory may differ)
    if not isinstance(keep, (int, np.integer)) or isinstance(keep, bool):  # ("2" < 1: a bare TypeError; a probe)
        raise CheckpointError(f"mpmd.save: keep must be an int (how many checkpoints to keep), got {type(keep).__name__} "
                              f"{keep!r:.40}", checkpoint=path)
    if keep < 1:
        raise CheckpointError(f"mpmd.save: keep={keep}; keep at least the checkpoint being written (keep >= 1)", checkpoint=path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"mpmd.save: {path!r} is a file; checkpoints go in a directory (it is made if missing)", checkpoint=path)
    flat, treedef = jax.tree_util.tree_flatten_with_path(hide(tree, is_leaf=_is_remote), is_leaf=_is_remote)
    meshes = {id(x.mesh): x.mesh for _, x in flat if isinstance(x, RemoteArray)}
    if len(meshes) > 1:
        raise MpmdError(f"mpmd.save: the tree holds arrays of {len(meshes)} meshes; save each mesh's state separately")
    for p, x in flat:
        if isinstance(x, RemoteArray):
            failed = _failed_step(path, [(p, x)])  # (as it says when the failure comes during the save: the step's own
            if failed is not None:  # error came bare once the controller had seen it, a RemoteError, not this; a probe)
                raise failed
            x._check_usable()
        elif not is_key(getattr(x, "dtype", None)) and not_numeric(np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)):
            raise CheckpointError(f"mpmd.save: leaf {jax.tree_util.keystr(p)} is a {type(x).__name__} ({np.asarray(x).dtype}); a checkpoint "
                                  "holds arrays and numbers (an int past 64 bits is neither: numpy makes it an object; a string "
                                  "is not saved: it is static, taken from `like=` when read): keep other objects out of the saved tree (e.g. save them beside it "
                                  "with json)", checkpoint=path, leaf=jax.tree_util.keystr(p))
    try:
        name, tmp = _start(path)
    except OSError as e:  # (a read-only or full file system, a file where a directory goes: as any save failure)
        raise _unwritable(path, e) from e
    leaves: list[dict[str, Any]] = []
    host: dict[str, np.ndarray] = {}
    per_actor: dict[int, tuple[list[str], list[int]]] = {}  # writer -> names, leaf indices
    # The buffers as the arrays name them at this call: a step right behind that donates them (donate_argnums) empties
    # the arrays before the loop sends this save; the free it queues goes after the save's request, which holds them.
    at_call: dict[int, list[int]] = {}
    mesh = next(iter(meshes.values()), None)
    recovery = getattr(mesh, "recovery", None)
    generation = recovery.generation if recovery is not None else 0  # (counts recoveries started; read before any buffer id)
    for i, (p, x) in enumerate(flat):
        leaf = f"leaf_{i:05d}"
        entry: dict[str, Any] = {"path": jax.tree_util.keystr(p), "entries": path_entries(p), "name": leaf}
        if isinstance(x, RemoteArray):
            a = x.actor
            names, idx = per_actor.setdefault(a, ([], []))
            names.append(leaf)
            idx.append(i)
            at_call.setdefault(a, []).append(x.buffers[a])
            layout = layout_wire(x.sharding.layout) if x.sharding is not None else None
            entry.update(part=f"actor-{a}", shape=list(x.shape), dtype=dtype_text(x.dtype),
                         key_impl=key_impl(x.dtype).name if is_key(x.dtype) else None, saved_actors=x.actors, saved_layout=layout)
        else:
            value = np.array(to_wire(x))  # a copy: the caller may change its array while the save runs
            host[leaf] = value
            dtype = getattr(x, "dtype", value.dtype)
            entry.update(part=HOST_PART, shape=list(np.shape(x) if not hasattr(x, "shape") else x.shape),
                         dtype=dtype_text(dtype) if is_key(dtype) else value.dtype.name,
                         key_impl=key_impl(dtype).name if is_key(dtype) else None, saved_actors=[], saved_layout=None)
        leaves.append(entry)
    saved_by = {"actors": len(mesh) if mesh is not None else 0,
                "actor_mesh": mesh.actor_mesh.to_wire() if mesh is not None and mesh.actor_mesh is not None else None,
                "tree_nodes": treedef.num_nodes}

    def finish(parts: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]], order: dict[str, list[int]]) -> str:
        files = {}
        for part, (arrays, listing) in parts.items():
            files[part] = listing
            for i, desc in zip(order[part], arrays):
                want_shape, want_dtype = wire_shape_dtype(tuple(leaves[i]["shape"]), _leaf_dtype(leaves[i]))
                if list(desc["shape"]) != list(want_shape) or desc["dtype"] != want_dtype.name:
                    raise CheckpointError(f"mpmd.save: {part} wrote {leaves[i]['path']} as {desc['dtype']}{desc['shape']}, expected "
                                          f"{want_dtype.name}{list(want_shape)}", checkpoint=tmp, leaf=leaves[i]["path"])
                leaves[i].update(stored_shape=desc["shape"], stored_dtype=desc["dtype"], sha256=desc["sha256"])
        missing = sorted(part for part in files if not os.path.exists(os.path.join(tmp, part)))
        if missing:  # (nothing of mpmd removes a live save's parts; something else did)
            raise CheckpointError(f"mpmd.save into {path}: part(s) {', '.join(missing)} vanished from {tmp} while the save ran; "
                                  "nothing was committed (is something else writing into this directory?)", checkpoint=tmp)
        manifest = Manifest(tmp, [_leaf(i, m) for i, m in enumerate(leaves)], files, saved_by)
        manifest.write(tmp)
        return _commit(path, name, tmp, keep)

    host_order = {HOST_PART: [int(k.split("_")[1]) for k in host]}

    def write_host() -> dict[str, Any]:
        return {HOST_PART: write_part(os.path.join(tmp, HOST_PART), host)} if host else {}

    def abandon(e: BaseException) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def done_saving() -> None:
        _done_saving(tmp)

    try:  # here, in the caller's thread: orbax in a thread of the controller loop's executor hangs
        host_part = write_host()
    except BaseException as e:
        abandon(e)
        done_saving()
        if _writing_failed(e):
            raise _unwritable(path, e) from e
        raise
    if not per_actor:
        return _finish_sync(lambda: finish(host_part, host_order), abandon, done_saving, path)

    def send(again: bool = False) -> list[Any]:
        """Every actor's save request, sent now, of the buffers the arrays name now (a recovery rebinds them); an
        array donated since the call is saved from the buffers it named then — unless this is the save sent `again`
        after a recovery, which those buffers did not survive."""
        pending = []
        for a in per_actor:  # (before any is sent: an actor already lost makes `write` wait for the recovery first)
            if mesh.conn(a).dead:
                raise ActorDiedError(a, mesh.conn(a).dead)
        try:
            for a, (names, idx) in per_actor.items():
                if again and any(a not in flat[i][1].buffers for i in idx):
                    raise CheckpointError(f"mpmd.save into {path}: an actor was lost while this save ran and a saved array "
                                          "was deleted (donated to a later step) before the mesh recovered, so its value is "
                                          "gone; nothing was committed — save the state you hold now. In a loop with "
                                          "donate_argnums, a save that must survive a loss is waited for (handle.wait(), or "
                                          "save(..., wait=True)) before the step that is donated its arrays", checkpoint=path)
                bufs = [flat[i][1].buffers.get(a, b) for i, b in zip(idx, at_call[a])]
                pending.append(mesh.conn(a).submit("save", {"dir": os.path.join(tmp, f"actor-{a}"), "names": names, "bufs": bufs}))
        except BaseException:
            for p in pending:
                p.close()
            raise
        return [asyncio.ensure_future(p) for p in pending]  # (tasks, made once: several may wait for them)

    async def handed(pending: list[Any]) -> list[Any]:
        return pending

    # Sent by a plain callback on the controller loop, queued now: ahead of any free of these buffers queued after
    # this call (the caller dropping its arrays), as a step's requests are; each actor takes its buffers as the
    # request comes. (From the write coroutine's first turn, one turn later, a free could still overtake it.)
    sent = mesh.dispatch(send, handed)

    replies_now: list[asyncio.Future[Any]] = []  # the actors' replies the save waits for (sent, or sent again)
    committing: list[asyncio.Future[Any]] = []  # the commit (`finish`, in a thread of its own) once it has started

    def send_again() -> list[asyncio.Future[Any]]:
        """The save sent again after a recovery; a replacement lost already is a failed reply (a loss while the
        save runs: it raised ActorDiedError out of the save)."""
        try:
            return send(again=True)
        except ActorDiedError as again_lost:
            gone = asyncio.get_running_loop().create_future()
            gone.set_exception(again_lost)
            return [gone]

    async def write() -> str:
        seen = generation  # (the recoveries started when the save was last sent)
        try:
            replies_now[:] = await asyncio.wrap_future(sent)
        except ActorDiedError as lost:  # lost before the save was sent (nothing was): as a loss while it ran
            if recovery is None:
                raise
            running = recovery._start_recovery(lost)
            if running is not None:
                await asyncio.wait([asyncio.wrap_future(running)])
            if recovery.gave_up is not None:
                recovery._say_gave_up(lost)  # (not the advice to make the mesh with a Recovery: it has one; a probe)
                raise
            log.warning("mpmd.save into %s: an actor was lost before it was sent; the mesh recovered, saving", path)
            seen = recovery.generation
            replies_now[:] = send_again()
        for attempt in itertools.count():
            # Every actor's answer before anything is abandoned: one actor's failure must not delete the
            # directory while another still writes into it. (asyncio.wait: a cancel leaves the replies awaited.)
            await asyncio.wait(replies_now)
            replies = [f.exception() or f.result() for f in replies_now]
            failed = [r for r in replies if isinstance(r, BaseException)]
            if not failed:
                break
            died = next((f for f in failed if isinstance(f, ActorDiedError)), None)
            lost = recovery is not None and (recovery.generation != seen or died is not None)
            if not lost:  # the lost actor's own error, else the failure of the step that made a saved array
                if died is None:  # (that step's error reply may still be on its way: its actor freed the outputs first)
                    steps = {id(r): r for _, x in flat if isinstance(x, RemoteArray) and (r := x._ready) is not None and not r.done()}
                    if steps:
                        waits = [asyncio.ensure_future(watch(r)) for r in steps.values()]
                        await asyncio.wait(waits, timeout=5)
                        for w in waits:  # (read, or given up: an error nobody reads would be logged)
                            w.exception() if w.done() and not w.cancelled() else w.cancel()
                first = next(r for r in replies if isinstance(r, BaseException))
                writer = list(per_actor)[replies.index(first)]
                if mesh.closed:  # (the close's doing: not "actor 0 died ... exited with code 0"; a probe)
                    raise CheckpointError(f"mpmd.save into {path}: {CLOSED_MEANWHILE}; nothing was committed", checkpoint=path) from first
                raise died or _failed_step(path, flat) or _not_written(path, writer, first)
            # An actor lost while the save ran: the recovery aborts the steps the saved arrays came from (the
            # actor's own error names an aborted step) and replays them; then the arrays hold their values
            # again, in new buffers, and the save goes again — after each loss the mesh recovers from (it went
            # again once only, and a second loss lost the checkpoint while the mesh recovered; a probe).
            running = recovery._start_recovery(died) if died is not None else recovery._recovery
            if running is not None:
                await asyncio.wait([asyncio.wrap_future(running)])
            if recovery.gave_up is not None:
                recovery._say_gave_up(failed[0])
                raise failed[0]
            if mesh.closed or attempt >= recovery.config.max_failures:  # (the mesh recovers that many losses at most)
                raise CheckpointError(f"mpmd.save into {path}: " + (f"{CLOSED_MEANWHILE}" if mesh.closed else
                                      f"an actor was lost while this save ran, {attempt + 1} times") + "; nothing was "
                                      f"committed ({str(failed[0]).splitlines()[0][:300]})", checkpoint=path) from failed[0]
            seen = recovery.generation
            log.warning("mpmd.save into %s: an actor was lost while it ran; the mesh recovered, saving again", path)
            for a in per_actor:
                await off_loop(lambda a=a: shutil.rmtree(os.path.join(tmp, f"actor-{a}"), True), own_thread=True)
            replies_now[:] = send_again()
        parts = dict(host_part)
        order = dict(host_order)
        for (a, (_, idx)), r in zip(per_actor.items(), replies):
            parts[f"actor-{a}"] = (r.header["written"], r.header["files"])
            order[f"actor-{a}"] = idx
        try:
            # (a thread of its own, not the interpreter's executor: a save still writing when the script ends commits
            # in the exit hook that closes meshes, after the executors stopped taking work; it failed "cannot schedule
            # new futures after interpreter shutdown" there; a probe)
            # The commit, once started, runs to its end whatever happens to this await; the abandon of a cancelled save
            # waits for it (`committing`) before it removes the .tmp directory — removed beside the rename, the
            # committed directory came out empty and LATEST named it: no checkpoint left (a probe cancelling save_async)
            committing.append(asyncio.ensure_future(off_loop(lambda: finish(parts, order), own_thread=True)))
            committing[0].add_done_callback(lambda f: f.cancelled() or f.exception())  # (read: cancelled, nobody awaits it)
            out = await asyncio.shield(committing[0])
        except Exception as e:
            if _writing_failed(e):
                raise _unwritable(path, e) from e
            raise
        done_saving()
        return out

    def abandon_when_answered() -> None:
        """(On the loop.) A save that ended without a commit — failed or cancelled, even before its first turn —
        may still have actors writing into its .tmp directory: it is removed, and its name freed for the next save,
        only once they have answered (else the next save into `path` took the same name and met the old writes)."""
        def cleanup() -> None:
            try:
                abandon(None)
                done_saving()
            finally:  # (what a failed save's wait waits for: SaveHandle._wait)
                if not handle._cleared.done():
                    handle._cleared.set_result(None)

        def handed(f: concurrent.futures.Future[Any]) -> None:
            tasks = replies_now or (f.result() if not f.cancelled() and f.exception() is None else [])
            asyncio.get_running_loop().create_task(_abandon_after([*tasks, *committing], cleanup))

        sent.add_done_callback(handed)  # (called on the loop: the dispatch settles it there)

    handle = SaveHandle(mesh.submit_coroutine(write()), mesh)
    handle._future.add_done_callback(
        lambda f: mesh._io.call_soon(abandon_when_answered) if f.cancelled() or f.exception() is not None else None)
    mesh.track_save(handle._future)
    _track_save(path, handle._future)
    return handle


async def save_async(path: str, tree: Any, *, keep: int = 1) -> str:
    """Awaitable twin of `save`: the actors write while the caller's event loop runs on; returns the committed
    directory. The save is ordered where it is called (a step dispatched after it does not disturb what it
    writes). Cancelling the await before the actors finish writing abandons the commit: the previous checkpoint
    stays the latest; once the commit has started it runs to its end (the new checkpoint is whole and the latest).

        await mpmd.save_async("ckpt", (params, opt_state))
    """
    handle = _save(path, tree, keep)  # (awaited here: its error is this coroutine's, not logged)
    try:
        return await watch(handle._future)
    except asyncio.CancelledError:
        handle._future.cancel()
        raise
    except Exception:  # (as `save`: a failed save leaves no .tmp behind once it has said so)
        if handle._mesh is not None and not handle._mesh.closed:
            await asyncio.wait([asyncio.wrap_future(handle._cleared)], timeout=SaveHandle.CLEAR_WAIT)
        raise


async def _abandon_after(replies: list[asyncio.Future[Any]], cleanup: Any) -> None:
    """`cleanup()` once every reply has come (or failed): an abandoned save's actors may still be writing."""
    try:
        if replies:
            await asyncio.wait(replies)
    finally:
        cleanup()


def _writing_failed(e: BaseException) -> bool:
    """Whether `e`, raised while writing a checkpoint's files, is the place failing them (a full or read-only disk,
    a file size limit, something in the way): an OSError, or what orbax and tensorstore raise for it (a ValueError
    or another plain Exception, e.g. "RESOURCE_EXHAUSTED: Error writing ..."), not mpmd's own errors nor the
    interpreter shutting down ("cannot schedule new futures after interpreter shutdown")."""
    return isinstance(e, Exception) and not isinstance(e, MpmdError) and not (
        isinstance(e, RuntimeError) and "shutdown" in str(e))


def _unwritable(path: str, e: BaseException) -> CheckpointError:
    said = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {str(e)[:1000]}"
    return CheckpointError(f"mpmd.save into {path}: could not write here ({said}); nothing was committed and the previous "
                           "checkpoint, if any, stays the latest", checkpoint=path)


def _not_written(path: str, actor: int, e: BaseException) -> BaseException:
    """An actor's failure to write its part of a save, as the save's CheckpointError (its remote error chained)."""
    if not isinstance(e, RemoteError):
        return e
    err = CheckpointError(f"mpmd.save into {path}: actor {actor} could not write its part: {e.remote_type}: "
                          f"{e.remote_message[:1000]}; nothing was committed and the previous checkpoint, if any, stays "
                          "the latest", checkpoint=path, actor=actor)
    err.__cause__ = e
    return err


def _finish_sync(run: Any, abandon: Any, done_saving: Any, path: str = "") -> SaveHandle:
    future: concurrent.futures.Future[str] = concurrent.futures.Future()
    try:
        future.set_result(run())
    except BaseException as e:
        abandon(e)
        future.set_exception(_unwritable(path, e) if _writing_failed(e) else e)
    finally:
        done_saving()
    return SaveHandle(future)


def _leaf_dtype(m: dict[str, Any]) -> Any:
    return jax.random.key(0, impl=m["key_impl"]).dtype if m.get("key_impl") else np.dtype(m["dtype"])


def _leaf(i: int, m: dict[str, Any]) -> Leaf:
    return Leaf(i, m["path"], m["entries"], tuple(m["shape"]), m["dtype"], m["key_impl"], m["part"], m["name"],
                tuple(m["stored_shape"]), m["stored_dtype"], m["sha256"], tuple(m["saved_actors"]), m["saved_layout"])


READ_AGAIN = 3  # times a load or restore reads the newer checkpoint when the one it read was replaced meanwhile


def _latest(path: str) -> str | None:
    try:
        return committed(os.path.abspath(path))
    except Exception:  # noqa: BLE001 - (no committed checkpoint now: the caller's own error says what it met)
        return None


def _reading(path: str, read: Callable[[Manifest], Any]) -> Any:
    """`read(manifest)` of the checkpoint `path` names, read again from the newer one when a save with `keep=` (in
    another process, or a thread of this one) committed a newer checkpoint and removed the one being read meanwhile:
    that failed as "the checkpoint is damaged or was edited" or as a bare FileNotFoundError, of a checkpoint nothing
    had damaged (a probe: 60 of 2,400 loads beside a trainer saving with keep=1). After READ_AGAIN such replacements,
    a CheckpointError that says so."""
    for attempt in itertools.count():
        before = _latest(path)
        try:
            return read(_open(path))
        except ActorDiedError:
            raise
        except Exception as e:
            after = _latest(path)
            if before is None or after is None or after == before:
                raise  # (not replaced: the error stands. Replaced, it is read again, whether or not it was removed yet:
                # a save's removal of older ones is under way while their directories are still there)
            if attempt >= READ_AGAIN:
                raise CheckpointError(f"{before} was removed while it was read, {attempt + 1} times in a row: saves with "
                                      f"keep= into {path} replace checkpoints faster than they can be read; read one "
                                      f"they keep (keep=2 or more), or read again (the last read failed: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})", checkpoint=before) from e
            log.info("reading %s: it was replaced by %s while it was read (a save with keep=); reading that", before, after)


def _open(path: str) -> Manifest:
    """The committed checkpoint's verified manifest, its parts' listings checked (after this process's saves into
    `path` still writing have ended)."""
    _check_path("mpmd.load / mpmd.restore", path)
    _wait_for_saves(path)
    m = read_manifest(committed(os.path.abspath(path)))  # (the actors are told this path: their working directory may differ)
    check_parts(m)
    return m


def _match(m: Manifest, like: Any, what: str) -> tuple[list[Any], Any]:
    """`like`'s data leaves, checked against the manifest: same paths, shapes and dtypes. Returns (leaves, treedef:
with `like`'s static leaves as `Static` nodes, to `reveal` after unflattening)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(hide(like, is_leaf=_is_remote), is_leaf=_is_remote)
    what = f"{what}: checkpoint {m.directory}"
    if len(flat) != len(m.leaves):  # (naming the first path that differs: e.g. an optimizer chain grown by one transform)
        paths = [jax.tree_util.keystr(p) for p, _ in flat]
        k = next((i for i, (a, b) in enumerate(zip(paths, m.leaves)) if a != b.path), min(len(paths), len(m.leaves)))
        where = (f"; the first that differs is leaf {k}: `like` has {paths[k] if k < len(paths) else 'nothing'}, the "
                 f"checkpoint {m.leaves[k].path if k < len(m.leaves) else 'nothing'}")
        raise CheckpointError(f"{what} holds {len(m.leaves)} arrays but `like` has {len(flat)} leaves{where}; pass a tree "
                              "shaped like the one that was saved", checkpoint=m.directory,
                              leaf=m.leaves[k].path if k < len(m.leaves) else None)
    out = []
    for (p, x), leaf in zip(flat, m.leaves):
        path = jax.tree_util.keystr(p)
        if path != leaf.path:
            raise CheckpointError(f"{what}: `like` leaf {len(out)} is at {path}, the checkpoint's is at {leaf.path}; pass a tree with "
                                  "the saved structure", checkpoint=m.directory, leaf=leaf.path)
        shape, dtype = like_shape_dtype(x)
        if shape != leaf.shape:
            raise CheckpointError(f"{what}: leaf {leaf.path} was saved with shape {leaf.shape}, `like` has {shape}",
                                  checkpoint=m.directory, leaf=leaf.path)
        if not dtype_matches(dtype, leaf, weak=_weak(x)):
            raise CheckpointError(f"{what}: leaf {leaf.path} was saved as {leaf.dtype}, `like` has "
                                  f"{_python_number(x) or dtype_text(dtype)}; mpmd does not "
                                  f"cast a checkpoint: pass `like` with dtype {leaf.dtype} (and cast after restoring if you mean to)",
                                  checkpoint=m.directory, leaf=leaf.path)
        out.append(x)
    saved_nodes = m.saved_by.get("tree_nodes")
    if isinstance(saved_nodes, int) and saved_nodes != treedef.num_nodes:
        warnings.warn(f"{what}: the saved tree had {saved_nodes} nodes, `like` has {treedef.num_nodes}: every array matched by path, "
                      "shape and dtype, but they differ in nodes that hold no array (an optimizer state's EmptyState, a None, an "
                      "empty dict): is `like` the tree that was saved (the same optax chain, say)?", stacklevel=callers_level())
    return out, treedef


def _python_number(x: Any) -> str:
    """'a Python float (weakly typed)' for a Python number `like` leaf (its numpy dtype, float64, is not what JAX
    makes of it; a probe), else ''."""
    return f"a Python {type(x).__name__} (weakly typed)" if type(x) in (bool, int, float, complex) else ""


def _read_host(m: Manifest, part: str, verify: bool) -> dict[str, np.ndarray]:
    """Every array of one part, read and verified here."""
    leaves = [leaf for leaf in m.leaves if leaf.part == part]
    try:
        return read_part(os.path.join(m.directory, part), [x.name for x in leaves], [x.expect() for x in leaves], m.parts[part], verify)
    except CheckpointProblem as e:
        raise _problem(m, part, None, e.wire()) from None


def _some(paths: list[str], room: int = 200) -> str:
    """`paths` joined, as many whole ones as fit in about `room` characters, then how many more (a path cut in half
    read "... [1][1][2].co)"; a probe)."""
    said: list[str] = []
    for p in paths:
        if said and sum(len(x) + 2 for x in said) + len(p) > room:
            return ", ".join(said) + f" ... ({len(paths) - len(said)} more)"
        said.append(p)
    return ", ".join(said)


def _problem(m: Manifest, part: str, actor: int | None, p: dict[str, Any]) -> CheckpointError:
    leaf = next((x.path for x in m.leaves if x.part == part and x.name == p.get("leaf")), None)
    file = f"{part}/{p['file']}" if p.get("file") and p["file"] != "." else part
    who = f"actor {actor}" if actor is not None else "the controller"
    names = f", leaf {leaf}" if leaf else f" (part {part} holds {_some([x.path for x in m.leaves if x.part == part])})"
    return CheckpointError(f"checkpoint {m.directory}: {who} found {file}{names}: {p.get('why')}; the checkpoint is damaged or was "
                           "edited after the save: restore an earlier one", checkpoint=m.directory, actor=actor, file=file, leaf=leaf)


def restore(path: str, mesh: Any, like: Any, *, for_step: Any = None, verify: bool = True) -> Any:
    """Load the latest checkpoint in `path` into `mesh` — any mesh: it need not be the one that saved it. Returns
    a tree shaped like `like` (whose leaves may be RemoteArrays, arrays or ShapeDtypeStructs; its paths, shapes
    and dtypes must be the saved ones). Each array goes where `for_step` (a compiled distributed step, and
    `like` its leading arguments as a tuple, or one of its arguments saved alone) reads it, else where a `like` RemoteArray of this mesh is, else to the actors
    that held it when saved (see mpmd/runtime/checkpoint_placement.py). Every byte is verified first;
    `verify=False` skips the digests (for measuring what they cost) but never the manifest's own or the
    dtype and shape checks. Raises `mpmd.CheckpointError` naming the checkpoint, actor, file and leaf.
    On a mesh with `recover=`, an actor lost while it reads is replaced and the restore reads again, once."""
    if not hasattr(mesh, "actor_mesh"):
        raise TypeError(f"mpmd.restore(path, mesh, like): mesh must be the mpmd.RemoteMesh to load into, got "
                        f"{type(mesh).__name__} {mesh!r:.60}; to read a checkpoint into host arrays without actors, use "
                        "mpmd.load(path, like)")
    _check_flag("mpmd.restore", "verify", verify)
    recovery = getattr(mesh, "recovery", None)

    def read(m: Manifest) -> Any:
        return _restore(m, mesh, like, for_step, verify)

    try:
        return _reading(path, read)
    except ActorDiedError as e:
        if recovery is None or not recovery.recover_now(e):
            raise
    log.warning("mpmd.restore from %s: an actor was lost while it read; the mesh recovered, reading again", path)
    return _reading(path, read)


def _restore(m: Manifest, mesh: Any, like: Any, for_step: Any, verify: bool) -> Any:
    like_leaves, treedef = _match(m, like, "mpmd.restore")
    where = targets(m.leaves, like_leaves, mesh, for_step, checkpoint=m.directory)
    am = mesh.actor_mesh
    out: list[Any] = [None] * len(m.leaves)
    host = _read_host(m, HOST_PART, verify) if HOST_PART in m.parts else {}
    need: dict[tuple[int, str], list[tuple[Leaf, int, Any]]] = defaultdict(list)  # (reader, part) -> leaf, buffer, layout
    for leaf, t in zip(m.leaves, where):
        if leaf.part == HOST_PART:
            like_leaf = like_leaves[leaf.index]
            value = _as_jax_number(from_wire(host[leaf.name], leaf.jax_dtype), like_leaf)
            if t.actors:
                out[leaf.index] = mesh.put_replicated(value, list(t.actors), _spec(t))
                out[leaf.index].weak_type = _weak(like_leaf)
            elif isinstance(like_leaf, jax.Array) and isinstance(value, np.ndarray):
                out[leaf.index] = jax_array(value, _weak(like_leaf))  # (a jax Array where `like` has one, weak as it is)
            else:
                out[leaf.index] = _as_like(like_leaf, value)
            continue
        bufs = {}
        for a in t.actors:
            bufs[a] = mesh.new_buffer_id()
            need[(a, leaf.part)].append((leaf, bufs[a], t.layout))
        out[leaf.index] = RemoteArray(mesh, bufs, leaf.shape, leaf.jax_dtype, remote_sharding(t.layout, am),
                                      weak_type=_weak(like_leaves[leaf.index]))  # (as `like` has it)

    async def read() -> list[Any]:
        return list(await asyncio.gather(*(mesh.conn(a).request("restore", {
            "dir": os.path.join(m.directory, part), "names": [x.name for x, _, _ in items], "bufs": [b for _, b, _ in items],
            "expect": [x.expect() for x, _, _ in items], "files": m.parts[part],
            "layouts": [layout_wire(lay) for _, _, lay in items], "verify": verify}) for (a, part), items in need.items())))

    try:
        replies = mesh.run(read())
        for ((a, part), _), r in zip(need.items(), replies):
            if r.header.get("problem") is not None:
                raise _problem(m, part, a, r.header["problem"])
        recovery = getattr(mesh, "recovery", None)
        if recovery is not None:  # a lost actor must not take the restored values with it: kept for a replay
            recovery.adopt([x for x in out if isinstance(x, RemoteArray)])
    except BaseException:
        for x in out:
            if isinstance(x, RemoteArray):
                try:
                    x.delete()
                except Exception:
                    pass
        raise
    return reveal(jax.tree.unflatten(treedef, out))


async def restore_async(path: str, mesh: Any, like: Any, *, for_step: Any = None, verify: bool = True) -> Any:
    """Awaitable twin of `restore`: the checkpoint is read and verified in a worker thread, so the caller's
    event loop runs on. Cancelling the await deletes what the restore made once it ends.

        params, opt_state = await mpmd.restore_async("ckpt", mesh, like=(params, opt_state))
    """
    return await off_loop(lambda: restore(path, mesh, like, for_step=for_step, verify=verify), abandoned=_drop)


def _drop(tree: Any) -> None:
    for x in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, RemoteArray)):
        if isinstance(x, RemoteArray):
            x.delete()


def _weak(like: Any) -> bool:
    """Whether a `like` leaf is weakly typed to JAX: a Python number, or an array that is."""
    return type(like) in (int, float, complex) or bool(getattr(like, "weak_type", False))


def _as_jax_number(value: Any, like: Any) -> Any:
    """A saved Python number (a 0-d int64 / float64) restored into a weakly typed jax array `like` (what a step
    makes of the number: int32 / float32 without x64) as that dtype; anything else as it is (a Python number
    `like` gets the saved number itself: `_as_like`)."""
    if isinstance(like, jax.Array) and getattr(like, "weak_type", False) and isinstance(value, np.ndarray) and value.shape == () and not is_key(value.dtype):
        with np.errstate(over="ignore"):
            out = value.astype(jax.dtypes.canonicalize_dtype(value.dtype))
        # (a float rounds, as JAX rounds it, but stays finite; an int must fit)
        if (out != value) if not np.issubdtype(value.dtype, np.inexact) else (np.isfinite(value) and not np.isfinite(out)):
            raise CheckpointError(f"a saved {value.dtype} {value.item()} does not fit the {out.dtype} of its `like` (JAX without "
                                  f"x64 holds no {value.dtype}): pass a Python number or a numpy {value.dtype} in `like` for it")
        return out
    return value


def _as_like(like: Any, value: Any) -> Any:
    """A host value as `like` holds it: a Python number where `like` has one (saved as a 0-d int64/float64 array;
    a numpy one would be strongly typed to a step, so `w - lr * g` would no longer keep bf16 `w` bf16)."""
    if type(like) in (bool, int, float, complex) and isinstance(value, np.ndarray) and value.shape == ():
        return type(like)(value.item())
    return value


def _loaded(like: Any, value: Any) -> Any:
    """`load`'s value for a `like` leaf: as `like` holds it (`_as_like`), and a weakly typed jax Array where `like` has
    a weakly typed array (a jax Array or RemoteArray): a numpy one would be strongly typed to the next step (`w - lr * w`
    of bf16 `w` and a weak `lr` went float32 after a load; a probe)."""
    value = _as_like(like, _as_jax_number(value, like))
    if type(like) not in (bool, int, float, complex) and _weak(like) and isinstance(value, np.ndarray):
        return jax_array(value, True)
    return value


def _spec(t: Target) -> Any:
    return layout_to_spec(t.layout) if t.layout is not None else None


def load(path: str, like: Any = None, *, verify: bool = True) -> Any:
    """The latest checkpoint in `path` as host values, with no mesh and no daemons: numpy arrays (jax key arrays
    for typed PRNG keys), every byte verified. With `like`, in `like`'s tree (its paths, shapes and dtypes must
    be the saved ones); without, in nested dicts and lists rebuilt from the saved paths (a namedtuple's or
    dataclass's fields as a dict, a tuple as a list, an element that held no arrays as None in its place). A Python
    number where `like` has one comes back a Python number, and a weakly typed jax Array where `like` has a weakly
    typed array. `verify=False` skips hashing the files' bytes (the
    manifest's names, sizes, dtypes and shapes are still checked).

        params, opt_state = mpmd.load("ckpt", like=(params, opt_state))
        state = mpmd.load("ckpt")          # e.g. [{'w': array(...), 'b': ...}, ...]
    """
    _check_flag("mpmd.load", "verify", verify)
    return _reading(path, lambda m: _load(m, like, verify))


def _load(m: Manifest, like: Any, verify: bool) -> Any:
    values: dict[int, Any] = {}
    for part in sorted(m.parts):
        got = _read_host(m, part, verify)
        for leaf in m.leaves:
            if leaf.part == part:
                values[leaf.index] = from_wire(got[leaf.name], leaf.jax_dtype)
    flat = [values[i] for i in range(len(m.leaves))]
    if like is not None:
        like_leaves, treedef = _match(m, like, "mpmd.load")
        return reveal(jax.tree.unflatten(treedef, [_loaded(x, v) for x, v in zip(like_leaves, flat)]))
    return _rebuild([leaf.entries for leaf in m.leaves], flat, m.directory)


def _rebuild(entries: list[list[list[Any]]], values: list[Any], directory: str | None = None) -> Any:
    """Nested dicts and lists from each leaf's path entries."""
    if len(entries) == 1 and not entries[0]:
        return values[0]
    root: dict[Any, Any] = {}
    budget = [64 * len(values) + 1024]  # list slots all lists may take (a forged manifest's positions cost no bytes)
    for path, v in zip(entries, values):
        node = root
        for kind, key in path[:-1]:
            node = node.setdefault((kind, key), {})
        node[tuple(path[-1])] = v

    def finish(node: Any) -> Any:
        if not isinstance(node, dict) or not node or not all(isinstance(k, tuple) and len(k) == 2 for k in node):
            return node
        if all(kind in ("index", "flat") for kind, _ in node):
            # (positions kept: an element that held no arrays — None, optax's EmptyState, () — is None here)
            if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for _, i in node):
                size = max(i for _, i in node) + 1
                budget[0] -= size
                if budget[0] < 0:
                    raise CheckpointError(f"mpmd.load: checkpoint {directory}: its leaf paths name list positions up to {size - 1} "
                                          f"for {len(values)} arrays; load it with like= (a tree shaped as the one saved)",
                                          checkpoint=directory)
                out: list[Any] = [None] * size
                for (_, i), v in node.items():
                    out[i] = finish(v)
                return out
            return [finish(node[k]) for k in sorted(node, key=lambda k: k[1])]
        return {key: finish(v) for (_, key), v in node.items()}

    return finish(root)


__all__ = ["SaveHandle", "load", "restore", "restore_async", "save", "save_async"]
