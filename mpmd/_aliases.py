"""The import paths of mpmd before its modules moved into rooms (`mpmd.simulator`, `mpmd.trace`, `mpmd.mesh`,
...), kept working: each old name imports the module that now holds it, the same module object, so
``from mpmd.simulator import simulate_programs`` and ``mpmd.trace.fit_costs`` go on meaning what they did.
New code should import from the new places (the README's Layout section lists them)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

OLD_TO_NEW = {
    "mpmd.validation": "mpmd.schedules.validation",
    "mpmd.simulator": "mpmd.schedules.simulator",
    "mpmd.draw": "mpmd.schedules.draw",
    "mpmd.mesh": "mpmd.runtime.mesh",
    "mpmd.controller": "mpmd.runtime.controller",
    "mpmd.array": "mpmd.runtime.array",
    "mpmd.sharding": "mpmd.runtime.sharding",
    "mpmd.wiring": "mpmd.runtime.wiring",
    "mpmd.checkpoint": "mpmd.runtime.checkpoint",
    "mpmd.launch": "mpmd.runtime.launch.local",
    "mpmd.launchers": "mpmd.runtime.launch",
    "mpmd.trace": "mpmd.observe.trace",
    "mpmd.profile": "mpmd.observe.profile",
    "mpmd.report": "mpmd.observe.report",
    "mpmd.keys_cli": "mpmd.cli.keys",
    "mpmd.lowering": "mpmd.compiler.lowering",
    "mpmd.avals": "mpmd.compiler.avals",
    "mpmd.program": "mpmd.compiler.program",
}


def new_name(old: str) -> str | None:
    """Where an old module path lives now (submodules of an old package too), or None."""
    for prefix, target in OLD_TO_NEW.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:  # already executed under its new name
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        # First, not last: an old package's path is the new package's (`mpmd.launchers` is `mpmd.runtime.launch`), so the
        # path finder, asked first, found `mpmd.launchers.rendezvous` as a file there and ran it again as a second module
        # — and set it as the package's `rendezvous`, apart from the one in use (a test's monkeypatch missed it).
        sys.meta_path.insert(0, _AliasFinder())
