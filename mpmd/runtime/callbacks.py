"""Run a step's host callbacks (`jax.debug.print`, `jax.debug.callback`, `io_callback`) at the controller once
its Programs have run: fetch the values they read (hidden outputs of the step, one request per actor) and
bind each callback in order, its printed lines prefixed with actor and task. Why they run here and not on
the actors: see mpmd/compiler/effects.py."""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from mpmd.compiler.avals import from_wire, host_value
from mpmd.compiler.effects import HostCall, prefixed, run_host_call
from mpmd.runtime.array import RemoteArray


async def run_host_calls(mesh: Any, calls: Sequence[HostCall], hidden: Sequence[Any]) -> None:
    """Fetch `hidden` (RemoteArrays of this step, or host values) and run `calls` (sorted by actor and program
    order) on them, in a worker thread, one after another. Output goes to the current `sys.stdout`."""
    values: list[Any] = [x if isinstance(x, RemoteArray) else host_value(x) for x in hidden]
    wanted: dict[int, list[int]] = defaultdict(list)
    where: dict[int, tuple[int, int]] = {}
    for j, x in enumerate(hidden):
        if isinstance(x, RemoteArray):
            a = x.actors[0]
            where[j] = (a, len(wanted[a]))
            wanted[a].append(x.buffers[a])
    actors = list(wanted)
    replies = await asyncio.gather(*(mesh.conn(a).request("get", {"bufs": wanted[a]}) for a in actors))
    arrays = {a: r.arrays for a, r in zip(actors, replies)}
    for j, (a, i) in where.items():
        values[j] = from_wire(arrays[a][i], hidden[j].dtype)

    def run_all() -> None:
        for call in calls:
            operands = [op[1] if op[0] == "const" else values[op[1]] if op[2] is None else values[op[1]][op[2]]
                        for op in call.operands]
            text = run_host_call(call, operands)
            if text:
                sys.stdout.write(prefixed(call, text))
        sys.stdout.flush()

    # In a worker thread, in order (awaited here, and the next step's after this one's): on the controller loop a slow
    # callback held every request of the mesh, heartbeats and other steps included, until it returned (a probe).
    await asyncio.to_thread(run_all)
