"""The daemon's garbage collector: what the actor keeps for its life is frozen out of the collector's reach.

A daemon holds 100-130k Python objects for as long as it lives (JAX's and XLA's Python side, compiled
executables, loaded Programs). CPython's full collection walks every one of them once enough younger objects
have survived two collections, and a step's futures, callbacks and transfer state live long enough to: in a
2,000-hop chain each actor ran a full collection every ~2.5 s, 55-130 ms each — a stall in the middle of a step,
and 19 % of the actor's CPU (perf: gc_collect_main, visit_reachable, visit_decref). `gc.freeze()` moves what
exists now into a generation the collector never walks; the daemon freezes once it is serving and after every
compile and program load, right after a collection (so no garbage is frozen with the keepers), and the full
collections that remain walk only what was made since.

A cycle among frozen objects is not collected while they stay frozen (reference counting still frees all the
rest), so when a session closes — its programs and executables' last users gone — `settle` thaws everything,
collects once and freezes again (one full walk, 55-130 ms on the event loop, once per closing: the other sessions'
steps wait that long, as they waited for every full collection before). MPMD_GC_FREEZE=0 in a daemon's environment leaves the collector as CPython sets it.
"""

from __future__ import annotations

import gc
import os


def enabled() -> bool:
    return os.environ.get("MPMD_GC_FREEZE", "1") != "0"


def freeze() -> None:
    """Collect, then freeze everything that is left (the daemon keeps it: startup, a compile, a program load)."""
    if enabled():
        gc.collect()
        gc.freeze()


def settle() -> None:
    """Thaw, collect everything once (cycles among what was frozen included), freeze again."""
    if enabled():
        gc.unfreeze()
        gc.collect()
        gc.freeze()


__all__ = ["enabled", "freeze", "settle"]
