"""The ``mpmd`` command.

    mpmd simulate --schedule InterleavedOneFOneB --actors 4 --stages 8 --microbatches 16 \\
                  [--svg out.svg] [--png out.png] [--trace out.json] [--costs F=1,B=2,I=1,W=1]
    mpmd tune --actors 2 --layers 8 [--memory-limit-mib 64] [--verify 3]     # mpmd.tune on the GPT example

Each subcommand is registered by a small function taking argparse's subparsers and setting ``run`` (a
function of the parsed arguments returning the exit code); add a module's registrar to `REGISTRARS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mpmd.cli.args import cannot_write, positive
from mpmd.errors import MpmdError, ScheduleError

Registrar = Callable[[Any], None]  # takes argparse's subparsers object


def _parse_costs(text: str) -> Any:
    from mpmd.schedules.simulator import Costs

    fields = {f.name for f in dataclasses.fields(Costs)} - {"routes", "empirical"}  # (not numbers: fitted from a trace)
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise argparse.ArgumentTypeError(f"{item!r}: write NAME=VALUE with NAME one of {', '.join(sorted(fields))} "
                                             "(per-stage values separated by ':', e.g. F=1:1.5:1)")
        if key in kwargs:
            raise argparse.ArgumentTypeError(f"{key} is given twice in {text!r}; give each cost once (per-stage values "
                                             f"separated by ':', e.g. {key}=1:1.5)")
        try:
            vals = [float(v) for v in value.split(":")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: {value!r} is not a number (or numbers separated by ':')") from None
        kwargs[key] = tuple(vals) if len(vals) > 1 else vals[0]
        if key == "cores" and len(vals) == 1 and vals[0].is_integer():
            kwargs[key] = int(vals[0])
    try:
        return Costs(**kwargs)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_schedule(name: str, actors: int | None, stages: int | None) -> Any:
    """A built-in schedule by class name, from the actor and stage counts the command line gives."""
    from mpmd.schedules import BUILTINS, builtin

    cls = BUILTINS.get(name)
    if cls is None:
        raise ScheduleError(f"unknown schedule {name!r}; built-ins: {', '.join(BUILTINS)}")
    params = set(inspect.signature(cls).parameters) - {"balance", "remat", "fuse"}  # keyword-only and optional
    if issubclass(cls, builtin._VShape):  # V placement: two stages per actor (num_stages= is taken too)
        params = {"num_actors"}
    if params == {"num_stages", "num_actors"}:  # several stages per actor
        if actors is None or stages is None:
            raise ScheduleError(f"{name} needs both --actors and --stages (a multiple of --actors)")
        return cls(num_stages=stages, num_actors=actors)
    if params == {"num_actors"}:  # V placement: two stages per actor
        if actors is None:
            raise ScheduleError(f"{name} needs --actors (it places 2 x actors stages)")
        if stages is not None and stages != 2 * actors:
            raise ScheduleError(f"{name} places 2 stages on each actor: --stages must be 2 x --actors = {2 * actors}, got {stages}")
        return cls(num_actors=actors)
    n = stages if stages is not None else actors
    if n is None:
        raise ScheduleError(f"{name} needs --stages (or --actors: it runs one stage per actor)")
    if actors is not None and actors != n:
        raise ScheduleError(f"{name} runs one stage per actor: --actors and --stages must agree, got {actors} and {n}")
    return cls(num_stages=n)


def _simulate(args: argparse.Namespace) -> int:
    from mpmd.schedules.simulator import simulate
    from mpmd.schedules.validation import format_table

    # The output names checked before any work (an unwritable one failed after the table was printed and the files
    # before it written; two outputs named alike overwrote each other, both "wrote"; a probe).
    named: dict[str, str] = {}
    for flag, path in (("--svg", args.svg), ("--png", args.png), ("--trace", args.trace)):
        if path is None:
            continue
        if not path.strip():  # (`--svg ''` wrote nothing and said nothing; a probe)
            print(f"mpmd simulate: {flag} needs a file name, got {path!r}", file=sys.stderr)
            return 2
        if path == "-":  # (it wrote a file named "-" and said "wrote -": a probe; stdout holds the table)
            print(f"mpmd simulate: {flag} -: give a file name (the table goes to stdout; the picture or trace goes to a file)",
                  file=sys.stderr)
            return 2
        ending = os.path.splitext(path)[1].lower()
        if flag != "--trace" and ending in (".png", ".svg") and ending != "." + flag[2:]:  # (`--svg out.png` wrote SVG into a .png; a probe)
            print(f"mpmd simulate: {flag} {path}: that name ends in {ending}; name it .{flag[2:]} (or use --{ending[1:]})",
                  file=sys.stderr)
            return 2
        same = named.get(os.path.realpath(path))
        if same is not None:
            print(f"mpmd simulate: {same} and {flag} both name {path}; give each output a file of its own", file=sys.stderr)
            return 2
        named[os.path.realpath(path)] = flag
        why = cannot_write(path)
        if why:
            print(f"mpmd simulate: cannot write {flag} {path}: {why}", file=sys.stderr)
            return 2
    try:
        schedule = make_schedule(args.schedule, args.actors, args.stages)
        result = simulate(schedule, args.microbatches, args.costs)
    except ScheduleError as e:
        print(f"mpmd simulate: {e}", file=sys.stderr)
        return 2
    print(f"{schedule!r}, {args.microbatches} microbatches")
    print(format_table(schedule.tasks(args.microbatches)))
    print(result.summary())
    writes = ((args.svg, lambda p: result.draw(p, fmt="svg")), (args.png, lambda p: result.draw(p, fmt="png")),
              (args.trace, result.to_perfetto))
    for path, write in writes:
        if path:
            try:
                write(path)
            except OSError as e:
                print(f"mpmd simulate: cannot write {path}: {e.strerror or e}", file=sys.stderr)
                return 2
            except ImportError as e:  # (a PNG needs matplotlib; the message says so)
                print(f"mpmd simulate: cannot write {path}: {e}", file=sys.stderr)
                return 2
            print(f"wrote {path}")
    return 0


def register_simulate(sub: Any) -> None:
    """``mpmd simulate``: validate a built-in schedule, time it on a cost model, print and draw it."""
    from mpmd.schedules import BUILTINS

    p = sub.add_parser("simulate", help="validate and time a built-in schedule; print its table, bubble and peak activations",
                       description="Validate a built-in schedule and simulate it on a cost model (default: unit costs "
                                   "F=1, B=2, I=W=1, free transfers). Exit code 2 if the schedule cannot run.")
    p.add_argument("--schedule", required=True, choices=list(BUILTINS), help="built-in schedule class")
    p.add_argument("--actors", type=positive(int), help="number of actors")
    p.add_argument("--stages", type=positive(int), help="number of stages (default: one per actor, two per actor for V schedules; interleaved schedules need it)")
    p.add_argument("--microbatches", type=positive(int), required=True, help="number of microbatches")
    p.add_argument("--costs", type=_parse_costs, default=None,
                   help="cost model, e.g. F=1,B=2,I=1,W=1,latency=0.1 (fields of mpmd.Costs; per stage: F=1:1.5)")
    p.add_argument("--svg", help="write the timeline picture as SVG")
    p.add_argument("--png", help="write the timeline picture as PNG (needs matplotlib)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace (JSON)")
    p.set_defaults(run=_simulate)


def register_keys(sub: argparse._SubParsersAction) -> None:
    from mpmd.cli.keys import add_subcommand

    add_subcommand(sub)


def register_tune(sub: argparse._SubParsersAction) -> None:
    from mpmd.cli.tune import add_subcommand

    add_subcommand(sub)


REGISTRARS: list[Registrar] = [register_simulate, register_keys, register_tune]


def build_parser(registrars: Sequence[Registrar] = ()) -> argparse.ArgumentParser:
    """The ``mpmd`` argument parser with every subcommand in `REGISTRARS` (and `registrars`)."""
    parser = argparse.ArgumentParser(prog="mpmd", description="mpmd: MPMD pipeline-parallel training for JAX")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in (*REGISTRARS, *registrars):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpmd`` command; returns the exit code (2 when a subcommand raised an mpmd error or a
    ValueError about its input: the message is printed as ``mpmd COMMAND: ...``, without a traceback)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (MpmdError, ValueError) as e:
        print(f"mpmd {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
