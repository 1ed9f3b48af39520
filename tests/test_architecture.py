"""The house's rules, read from the code's own imports (with `ast`, no third-party tool): no import circles
inside `mpmd/`, `actors/` or `transport/` (imports under TYPE_CHECKING and inside functions count too), the
wire (`transport/`) imports neither side, and the daemon (`actors/`) never imports the controller (`mpmd/`)."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("mpmd", "actors", "transport")


def module_names() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def imports_of(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """Every module of ours that `name` imports, wherever in the file the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:  # `from pkg import sub` imports the submodule; `from mod import name`, the module
                found.add(f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source)
    return {m for m in found if m in mods and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = module_names()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle_and_passes_a_chain() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_imports_inside_functions_and_under_type_checking(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mpmd.errors import MpmdError\n"
                   "def f():\n    import transport.protocol\n")
    assert imports_of("mpmd.x", src, module_names()) == {"mpmd.errors", "transport.protocol"}


def test_no_package_has_an_import_circle() -> None:
    found = cycles(import_graph())
    assert not found, "import circles (a room that needs a name from a room above takes it as a parameter or a Protocol):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("lower, upper", [("transport", "mpmd"), ("transport", "actors"), ("actors", "mpmd")])
def test_imports_run_one_way_between_packages(lower: str, upper: str) -> None:
    wrong = sorted(f"{a} -> {b}" for a, deps in import_graph().items() if a.split(".")[0] == lower
                   for b in deps if b.split(".")[0] == upper)
    assert not wrong, f"{lower}/ must not import {upper}/:\n" + "\n".join(wrong)


def test_old_module_paths_import_the_moved_modules() -> None:
    import mpmd.mesh
    import mpmd.simulator
    import mpmd.trace
    from mpmd.launchers.rendezvous import connect
    from mpmd.simulator import simulate_programs

    import mpmd

    assert mpmd.simulator is mpmd.schedules.simulator and simulate_programs is mpmd.schedules.simulator.simulate_programs
    assert mpmd.trace.fit_costs is mpmd.observe.trace.fit_costs
    assert mpmd.mesh.RemoteMesh is mpmd.RemoteMesh
    assert connect is mpmd.runtime.launch.rendezvous.connect
    # one module under both names, not a second copy run from the same file (the path finder found the old name's file
    # in the new package first, and the package's `rendezvous` became the copy: a monkeypatch of it missed the other)
    assert sys.modules["mpmd.launchers.rendezvous"] is sys.modules["mpmd.runtime.launch.rendezvous"] is mpmd.runtime.launch.rendezvous
