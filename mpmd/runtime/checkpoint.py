"""Checkpoints of state held on actors: `mpmd.save(path, tree)` / `mpmd.restore(path, mesh, like=tree)`.

    mpmd.save("ckpt", (params, opt_state))                      # each actor writes its own arrays
    params, opt_state = mpmd.restore("ckpt", mesh, like=(params, opt_state))
    await mpmd.save_async("ckpt", tree); tree = await mpmd.restore_async("ckpt", mesh, like=tree)   # in a coroutine

Each actor writes the arrays it holds with orbax-checkpoint (one copy of a replicated array); host leaves
(numpy arrays, scalars) are written by the controller. A checkpoint is committed only when every part is
written: parts go to `path/ckpt-<n>.tmp`, which is renamed to `path/ckpt-<n>`, and `path/LATEST` then names it
(atomically replaced) — a crash during a save leaves the previous checkpoint loadable. `restore` puts every
array back on the actors that held it (a fresh mesh of the same layout), typed PRNG keys included.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
from typing import Any

import jax
import numpy as np

from mpmd.compiler.avals import dtype_text, from_wire, is_key, key_impl, to_wire
from mpmd.errors import MpmdError
from mpmd.runtime.aio import off_loop, watch
from mpmd.runtime.array import RemoteArray

FORMAT = 1


def _leaves(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, RemoteArray))


def _committed(path: str) -> str | None:
    try:
        with open(os.path.join(path, "LATEST")) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(path, name) if name else None


class SaveHandle:
    """A save in progress: `wait()` returns the committed directory (or raises the save's error)."""

    def __init__(self, future: concurrent.futures.Future[str]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        return self._future.result(timeout)


def save(path: str, tree: Any, *, wait: bool = True, keep: int = 1) -> str | SaveHandle:
    """Save a pytree of RemoteArrays (and host values) to directory `path`. Each actor writes its own arrays,
    concurrently with later steps (a step dispatched after this call does not wait for the write); with
    `wait=False` the call returns a `SaveHandle` at once. The `keep` newest checkpoints are kept."""
    leaves, _ = _leaves(tree)
    meshes = {id(x.mesh): x.mesh for x in leaves if isinstance(x, RemoteArray)}
    if len(meshes) > 1:
        raise MpmdError(f"mpmd.save: the tree holds arrays of {len(meshes)} meshes; save each mesh's state separately")
    os.makedirs(path, exist_ok=True)
    n = 1 + max([int(d.split("-")[1].split(".")[0]) for d in os.listdir(path) if d.startswith("ckpt-")] or [0])
    name = f"ckpt-{n}"
    tmp = os.path.join(path, name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta: dict[str, Any] = {"format": FORMAT, "leaves": []}
    host: dict[str, np.ndarray] = {}
    per_actor: dict[int, tuple[list[str], list[int]]] = {}
    for i, x in enumerate(leaves):
        leaf = f"leaf_{i:05d}"
        if isinstance(x, RemoteArray):
            x._check_usable()
            a = x.actor
            names, bufs = per_actor.setdefault(a, ([], []))
            names.append(leaf)
            bufs.append(x.buffers[a])
            meta["leaves"].append({"kind": "remote", "actor": a, "actors": x.actors, "shape": list(x.shape),
                                   "dtype": dtype_text(x.dtype), "key_impl": key_impl(x.dtype).name if is_key(x.dtype) else None})
        else:
            value = np.asarray(to_wire(x))
            host[leaf] = value
            meta["leaves"].append({"kind": "host", "shape": list(np.shape(x) if not hasattr(x, "shape") else x.shape), "dtype": value.dtype.name,
                                   "key_impl": key_impl(x.dtype).name if is_key(getattr(x, "dtype", None)) else None})
    if host:
        np.savez(os.path.join(tmp, "host.npz"), **host)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)

    def commit() -> str:
        final = os.path.join(path, name)
        os.replace(tmp, final)
        with open(os.path.join(path, "LATEST.tmp"), "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(path, "LATEST.tmp"), os.path.join(path, "LATEST"))
        olds = sorted((d for d in os.listdir(path) if d.startswith("ckpt-") and not d.endswith(".tmp") and d != name),
                      key=lambda d: int(d.split("-")[1]))
        for d in olds[: max(0, len(olds) - (keep - 1))]:
            shutil.rmtree(os.path.join(path, d), ignore_errors=True)
        return final

    if not per_actor:
        done: concurrent.futures.Future[str] = concurrent.futures.Future()
        done.set_result(commit())
    else:
        mesh = next(iter(meshes.values()))

        async def write() -> str:
            await asyncio.gather(*(mesh.conn(a).request("save", {"dir": os.path.join(tmp, f"actor-{a}"), "names": names, "bufs": bufs})
                                   for a, (names, bufs) in per_actor.items()))
            return await asyncio.to_thread(commit)

        done = mesh.submit_coroutine(write())
    handle = SaveHandle(done)
    return handle.wait() if wait else handle


async def save_async(path: str, tree: Any, *, keep: int = 1) -> str:
    """Awaitable twin of `save`: the actors write while the caller's event loop runs on; returns the committed
    directory. The save is ordered where it is called (a step dispatched after it does not disturb what it
    writes). Cancelling the await before the actors finish writing abandons the commit: the previous checkpoint
    stays the latest.

        await mpmd.save_async("ckpt", (params, opt_state))
    """
    handle = save(path, tree, wait=False, keep=keep)
    assert isinstance(handle, SaveHandle)
    try:
        return await watch(handle._future)
    except asyncio.CancelledError:
        handle._future.cancel()
        raise


def restore(path: str, mesh: Any, like: Any) -> Any:
    """Load the latest checkpoint in `path` into `mesh`: a tree shaped like `like` (whose leaves may be
    RemoteArrays, arrays or ShapeDtypeStructs: only the structure, shapes and dtypes are used), each array on
    the actors that held it when it was saved."""
    read, out = _restore_plan(path, mesh, like)
    mesh.run(read)
    return out


async def restore_async(path: str, mesh: Any, like: Any) -> Any:
    """Awaitable twin of `restore`: the checkpoint's metadata is read in a worker thread and the actors' reads
    are awaited, so the caller's event loop runs on.

        params, opt_state = await mpmd.restore_async("ckpt", mesh, like=(params, opt_state))
    """
    read, out = await off_loop(lambda: _restore_plan(path, mesh, like))
    await mesh.arun(read)
    return out


def _restore_plan(path: str, mesh: Any, like: Any) -> tuple[Any, Any]:
    """The actors' reads of the latest checkpoint in `path` (a coroutine for the controller loop) and the tree
    they fill."""
    ckpt = _committed(path)
    if ckpt is None:
        raise MpmdError(f"mpmd.restore: no committed checkpoint in {path!r} (no LATEST file); was mpmd.save called there?")
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    leaves, treedef = _leaves(like)
    saved = meta["leaves"]
    if len(saved) != len(leaves):
        raise MpmdError(f"mpmd.restore: {ckpt} holds {len(saved)} arrays but `like` has {len(leaves)} leaves; pass the tree "
                        "that was saved")
    for i, (m, x) in enumerate(zip(saved, leaves)):
        shape = tuple(getattr(x, "shape", np.shape(x)))
        if tuple(m["shape"]) != shape:
            raise MpmdError(f"mpmd.restore: leaf {i} was saved with shape {tuple(m['shape'])}, `like` has {shape}")
    host = dict(np.load(os.path.join(ckpt, "host.npz"))) if os.path.exists(os.path.join(ckpt, "host.npz")) else {}
    need: dict[tuple[int, int], tuple[list[str], list[int]]] = {}  # (reader, writer) -> names, new buffer ids
    out: list[Any] = [None] * len(saved)
    for i, m in enumerate(saved):
        leaf = f"leaf_{i:05d}"
        if m["kind"] == "host":
            v = host[leaf]
            out[i] = from_wire(v, _dtype(m)) if m.get("key_impl") else v
            continue
        if max(m["actors"]) >= len(mesh):
            raise MpmdError(f"mpmd.restore: leaf {i} lived on actors {m['actors']}, but the mesh has {len(mesh)}; restore into a "
                            "mesh of the same layout")
        bufs = {}
        for a in m["actors"]:  # every replica reads the copy its writer saved
            names, ids = need.setdefault((a, m["actor"]), ([], []))
            names.append(leaf)
            ids.append(mesh.new_buffer_id())
            bufs[a] = ids[-1]
        out[i] = RemoteArray(mesh, bufs, tuple(m["shape"]), _dtype(m))

    async def read() -> None:
        await asyncio.gather(*(mesh.conn(a).request("restore", {"dir": os.path.join(ckpt, f"actor-{w}"), "names": names, "bufs": ids})
                               for (a, w), (names, ids) in need.items()))

    return read(), jax.tree.unflatten(treedef, out)


def _dtype(m: dict[str, Any]) -> Any:
    if m.get("key_impl"):
        return jax.random.key(0, impl=m["key_impl"]).dtype
    return np.dtype(m["dtype"])


__all__ = ["SaveHandle", "restore", "restore_async", "save", "save_async"]
