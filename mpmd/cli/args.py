"""Argument types shared by the `mpmd` subcommands (argparse prints the usage and names the flag when one refuses)."""

from __future__ import annotations

import argparse
import os
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


def cannot_write(path: str, directory: bool = False, parents: bool = False) -> str | None:
    """Why an output `path` cannot be written — a file, or with `directory` a directory — checked before the work
    that writes it (an unwritable name failed once the work was done; probes); None when it can. `parents`: its
    missing parent directories will be made (else the folder must exist). A file that exists is written in place:
    its own mode counts, not its folder's (`/dev/stdout`)."""
    if not path.strip():
        return "needs a name"
    if os.path.exists(path) and os.path.isdir(path) != directory:
        return "is a directory" if not directory else "is a file, not a directory"
    folder = os.path.dirname(os.path.abspath(path))
    while parents and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder} is a file, not a directory" if os.path.exists(folder) else f"{folder} is not a directory"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return "is not writable" if os.path.exists(path) else f"{folder} is not writable"
    return None
