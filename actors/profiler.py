"""An actor's half of `mesh.profile(logdir)`: a `jax.profiler` trace of this daemon process, written to a
directory of its own and sent back to the controller as files (the controller writes them under its logdir,
so remote actors' traces land next to the local ones; no path from the network is ever written to here).

| op       | request fields               | reply fields                                  | frames                    |
|----------|------------------------------|-----------------------------------------------|---------------------------|
| profile  | action: "start"              | started: true                                 |                           |
| profile  | action: "stop"               | files: [relative path], host                  | one uint8 frame per file  |

One trace at a time per daemon (JAX's profiler is process-wide): a second start, from any session, is refused
naming the session that holds it. A trace larger than MAX_PROFILE_BYTES is refused with what to do.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from typing import Any

import numpy as np

from actors.request import RequestError

MAX_PROFILE_BYTES = 512 << 20


class ProfileState:
    """Which session's trace runs in this process, and where it is written."""

    def __init__(self) -> None:
        self.session: int | None = None
        self.directory: str | None = None


async def profile(actor: Any, ses: Any, msg: Any) -> tuple[dict, list]:
    """Start (`action: "start"`) or stop and collect (`action: "stop"`) the session `ses`'s trace on `actor`."""
    import jax

    state: ProfileState = actor.profile_state
    action = msg.header.get("action")
    sid = ses.id
    if action == "start":
        if state.session is not None and state.session not in actor.sessions:
            stop_quietly(actor)  # its session is gone (closed or dropped without a stop)
        if state.session is not None:
            raise RequestError(f"actor {actor.actor_id} is already profiling for session {state.session:#x}: JAX's profiler runs one "
                        "trace per process; leave that mesh.profile() block first")
        state.directory = tempfile.mkdtemp(prefix="mpmd-profile-")
        await asyncio.to_thread(jax.profiler.start_trace, state.directory)
        state.session = sid
        return {"started": True}, []
    if action == "stop":
        if state.session is None or state.session != sid:
            raise RequestError(f"actor {actor.actor_id} has no profile running for this session: call profile start first")
        directory = state.directory
        assert directory is not None
        try:
            await asyncio.to_thread(jax.profiler.stop_trace)
            names, frames, total = [], [], 0
            for root, _, files in os.walk(directory):
                for name in sorted(files):
                    path = os.path.join(root, name)
                    total += os.path.getsize(path)
                    if total > MAX_PROFILE_BYTES:
                        raise RequestError(f"actor {actor.actor_id}'s profile is over {MAX_PROFILE_BYTES >> 20} MiB: profile fewer "
                                    "steps inside mesh.profile()")
                    names.append(os.path.relpath(path, directory))
                    frames.append(np.fromfile(path, dtype=np.uint8))
            return {"files": names, "host": socket.gethostname()}, frames
        finally:
            state.session = state.directory = None
            shutil.rmtree(directory, ignore_errors=True)
    raise RequestError(f"'profile' action must be 'start' or 'stop', got {action!r}")


def stop_quietly(actor: Any) -> None:
    """The session that profiles went away: stop its trace so the next one can start."""
    state: ProfileState = actor.profile_state
    if state.session is None:
        return
    import jax

    try:
        jax.profiler.stop_trace()
    except Exception:
        pass
    if state.directory:
        shutil.rmtree(state.directory, ignore_errors=True)
    state.session = state.directory = None
