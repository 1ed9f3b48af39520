"""An actor's half of a checkpoint: it writes the arrays it holds as one orbax-checkpoint directory (a "part")
and reads arrays back from any part — its own or another actor's — verifying every byte against the digests
the controller took from the checkpoint's verified manifest (mpmd/runtime/checkpoint_format.py) before a
single value reaches a buffer.

Arrays are written as host (numpy) arrays in their full logical shape, whatever their layout over this
actor's devices, so a part is readable by plain orbax-checkpoint and restorable onto any device mesh: a
reader lays each array out over its own devices as the controller asks (`layouts`).

| op        | request fields                                                    | reply fields                             |
|-----------|-------------------------------------------------------------------|------------------------------------------|
| save      | dir, names: [str], bufs: [buf]                                    | nbytes, written: [{shape, dtype, sha256}], files: {path: {size, sha256}} |
| restore   | dir, names: [str], bufs: [buf] (new ids), expect: [{shape, dtype, sha256}], files: {path: {size, sha256}}, layouts: [layout or null], verify: bool | outputs: [{dtype, shape}], or problem: {file, leaf, why} (the buffers then fail) |

(Not `arrays`: that header field announces a message's array frames, transport/protocol.py.) A `restore` whose files or arrays disagree with `expect`/`files` answers with `problem` (not an error reply)
so that the controller can raise `mpmd.CheckpointError` naming the checkpoint, this actor, the file and the
leaf; the new buffers are failed with the same text.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np

from actors import spmd
from actors.request import RequestError, field, int_list
from transport.checkpoint_parts import CheckpointProblem, read_part, write_part
from transport.protocol import Message, ProtocolError, array_spec, aval_header

# orbax-checkpoint keeps process-wide state (temporary names, commit signals): two parts written at once in one
# process failed (FileExistsError on its temporary directory, NOT_FOUND from its zarr driver) or hung in its signal
# barrier (six saves of one state gathered at once). So this daemon reads and writes one part at a time; the
# others wait here, holding no worker thread.
_ORBAX: asyncio.Lock | None = None
_ORBAX_THREAD = threading.Lock()  # also held by the thread itself: a cancelled request's thread runs on to its end


def _orbax() -> asyncio.Lock:
    global _ORBAX
    if _ORBAX is None:
        _ORBAX = asyncio.Lock()
    return _ORBAX


def _alone(fn: Any) -> Any:
    with _ORBAX_THREAD:
        return fn()


def _names(msg: Message) -> tuple[str, list[str], list[int]]:
    directory = field(msg, "dir", str)
    names = field(msg, "names", list)
    bufs = int_list(msg, "bufs")
    if len(names) != len(bufs) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise RequestError("checkpoint 'names' must be identifiers, one per buffer")
    return directory, names, bufs


def _expectations(msg: Message, names: list[str]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], list[Any], bool]:
    n = len(names)
    expect = field(msg, "expect", list)
    files = field(msg, "files", dict)
    layouts = msg.header.get("layouts") or [None] * n
    verify = msg.header.get("verify", True)
    if len(expect) != n or not all(isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
                                   and isinstance(e.get("sha256"), str) for e in expect):
        raise RequestError("'restore' field 'expect' must give {shape, dtype, sha256} per name")
    for i, e in enumerate(expect):  # (dtype 'foo' blamed orbax, 'object' reached np.zeros: a probe)
        try:
            array_spec(e, i)
        except ProtocolError as err:
            raise RequestError(f"'restore' field 'expect', entry {i} ({names[i]!r:.40}): {str(err).removeprefix(f'array {i}: ')}") from None
    if not all(isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
               for k, v in files.items()):
        raise RequestError("'restore' field 'files' must map each file to {size, sha256}")
    if not isinstance(layouts, list) or len(layouts) != n:
        raise RequestError("'restore' field 'layouts' must give one layout (or null) per name")
    if not isinstance(verify, bool):
        raise RequestError("'restore' field 'verify' must be a bool")
    return expect, files, layouts, verify


async def save(actor: Any, ses: Any, msg: Any) -> tuple[dict, list]:
    """Write the buffers `bufs` as arrays `names` into the orbax directory `dir` (once they are computed);
    reply with each array's digest and every file's."""
    directory, names, bufs = _names(msg)
    refs = [ses.buffers.ref(b) for b in bufs]  # taken now: a delete arriving next must not pull them away
    values = [await asyncio.shield(r) if isinstance(r, asyncio.Future) else r for r in refs]

    # whole host arrays (a sharded value's shards gathered): the part fits any mesh that reads it
    async with _orbax():
        arrays, files = await asyncio.to_thread(_alone, lambda: write_part(directory, {n: np.asarray(v) for n, v in zip(names, values)}))
    return {"nbytes": int(sum(int(np.prod(a["shape"], dtype=np.int64)) * np.dtype(a["dtype"]).itemsize for a in arrays)),
            "written": arrays, "files": files}, []


async def restore(actor: Any, ses: Any, msg: Any) -> tuple[dict, list]:
    """Read arrays `names` from the orbax directory `dir`, verify them, and lay each out over this actor's
    devices as `layouts` says (replicated when null) in new buffers `bufs`."""
    directory, names, bufs = _names(msg)
    expect, files, layouts, verify = _expectations(msg, names)
    mesh = actor.cache.mesh
    specs = []
    for lay in layouts:
        if lay is not None and mesh is None:
            raise RequestError(f"actor {actor.actor_id} has no device mesh, so nothing can be laid out over its devices")
        try:
            specs.append(spmd.spec_from_wire(lay))
        except ValueError as e:
            raise RequestError(str(e)) from None
    for b in bufs:
        ses.buffers.reserve(b)

    def read() -> list[Any]:
        got = read_part(directory, names, expect, files, verify)
        if mesh is not None:
            return [spmd.put(got[n], mesh, s, actor.device) for n, s in zip(names, specs)]
        return [spmd.to_device(got[n], actor.device) for n in names]

    def error(e: BaseException) -> BaseException:  # what a reader of the buffers gets
        return RequestError(f"restore from {directory}: {e.why}") if isinstance(e, CheckpointProblem) else e

    async def read_one_at_a_time() -> list[Any]:
        async with _orbax():
            return await asyncio.to_thread(_alone, read)

    try:
        values = await ses.buffers.produce(bufs, read_one_at_a_time(), error)
    except CheckpointProblem as e:
        return {"problem": e.wire()}, []
    return {"outputs": [aval_header(v.shape, v.dtype) for v in values]}, []
