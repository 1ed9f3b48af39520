"""Checks of a user's counts and durations, shared by the launchers, `RemoteMesh` and `Recovery`: each names the
argument and what it got (True was 1 actor, 1.5 one device, "10" a TypeError from a comparison, NaN or inf a wait
without end: probes found each)."""

from __future__ import annotations

import math
import numbers
from typing import Any


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """`value` as an int, when it is a whole number (not a bool) >= `minimum`; else ValueError naming `name`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r:.40}")
    return int(value)


def check_seconds(name: str, value: Any, *, none_ok: bool = False) -> None:
    """A positive, finite number of seconds (or None where `none_ok`); else ValueError naming `name`."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive, finite number of seconds{' (or None)' if none_ok else ''}, "
                         f"got {value!r:.40}")
