"""An actor's half of a checkpoint: it writes the arrays it holds, and reads them back, with orbax-checkpoint
(which writes to a temporary directory and commits it atomically). The controller (mpmd/runtime/checkpoint.py) names
the directory, the arrays and the buffer ids, and commits the whole checkpoint once every actor is done.

| op        | request fields                                      | reply fields         |
|-----------|-----------------------------------------------------|----------------------|
| save      | dir, names: [str], bufs: [buf]                      | nbytes               |
| restore   | dir, names: [str], bufs: [buf] (new ids)            | outputs: [{dtype, shape}] |
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np

from actors.request import RequestError, field, int_list
from transport.protocol import Message, aval_header


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def _write(directory: str, arrays: dict[str, Any]) -> None:
    ckpt = _checkpointer()
    ckpt.save(os.path.abspath(directory), arrays)
    ckpt.wait_until_finished()


def _read(directory: str, names: list[str], device: Any) -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp

    path = os.path.abspath(directory)
    meta = ocp.StandardCheckpointer().metadata(path)
    tree = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
    sharding = jax.sharding.SingleDeviceSharding(device)
    missing = [n for n in names if n not in tree]
    if missing:
        raise ValueError(f"checkpoint {path} holds no arrays {missing[:5]}")
    # orbax restores a directory's whole tree; a replica reading its writer's directory keeps what it needs
    target = {n: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding) for n, m in tree.items()}
    got = _checkpointer().restore(path, target)
    return {n: got[n] for n in names}


def _names(msg: Message) -> tuple[str, list[str], list[int]]:
    directory = field(msg, "dir", str)
    names = field(msg, "names", list)
    bufs = int_list(msg, "bufs")
    if len(names) != len(bufs) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise RequestError("checkpoint 'names' must be identifiers, one per buffer")
    return directory, names, bufs


async def save(actor: Any, ses: Any, msg: Any) -> tuple[dict, list]:
    """Write the buffers `bufs` as arrays `names` into the orbax directory `dir` (once they are computed)."""
    directory, names, bufs = _names(msg)
    refs = [ses.buffers.ref(b) for b in bufs]  # taken now: a delete arriving next must not pull them away
    values = [await asyncio.shield(r) if isinstance(r, asyncio.Future) else r for r in refs]
    await asyncio.to_thread(_write, directory, dict(zip(names, values)))
    return {"nbytes": int(sum(int(np.asarray(v).nbytes) for v in values))}, []


async def restore(actor: Any, ses: Any, msg: Any) -> tuple[dict, list]:
    """Read arrays `names` from the orbax directory `dir` into new buffers `bufs`."""
    directory, names, bufs = _names(msg)
    for b in bufs:
        ses.buffers.reserve(b)
    try:
        got = await asyncio.to_thread(_read, directory, names, actor.device)
    except BaseException as e:
        for b in bufs:
            ses.buffers.fail(b, e)
        raise
    for n, b in zip(names, bufs):
        ses.buffers.put(b, got[n])
    return {"outputs": [aval_header(got[n].shape, got[n].dtype) for n in names]}, []
