"""Argument types shared by the `mpmd` subcommands (argparse prints the usage and names the flag when one refuses)."""

from __future__ import annotations

import argparse
from typing import Any


def positive(kind: type) -> Any:
    """An argparse type: a number of `kind` above 0 (argparse prints the usage and the message otherwise)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not value > 0 or value == float("inf"):  # (nan and inf too)
            raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse names in "invalid ... value"
    return parse
