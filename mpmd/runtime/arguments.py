"""Checks of a user's counts and durations, shared by the launchers, `RemoteMesh` and `Recovery`: each names the
argument and what it got (True was 1 actor, 1.5 one device, "10" a TypeError from a comparison, NaN or inf a wait
without end: probes found each)."""

from __future__ import annotations

import numbers
from typing import Any


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int, when it is a whole number (not a bool) >= `minimum`; else ValueError naming `name`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r:.40}")
    return int(value)


MAX_SECONDS = 1e9  # (~31 years: a duration past it is no deadline; 2**70 passed, then overflowed msgpack: a probe)


def check_seconds(name: str, value: Any, *, none_ok: bool = False) -> float | None:
    """`value` as a float: a positive, finite number of seconds up to MAX_SECONDS (or None where `none_ok`); else
    ValueError naming `name`. (The float, not a numpy scalar: one crossed the wire and msgpack refused it.)"""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= MAX_SECONDS:
        raise ValueError(f"{name} must be a positive, finite number of seconds{' (or None)' if none_ok else ''} up to "
                         f"{MAX_SECONDS:g}, got {value!r:.40}")
    return float(value)
