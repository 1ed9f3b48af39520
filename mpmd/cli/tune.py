"""``mpmd tune``: run `mpmd.tune` on the GPT example (examples/gpt.py, a marker before every block) on local actors.

    mpmd tune --actors 2 --layers 8 --microbatches 8 --rows 4 [--memory-limit-mib 64] [--verify 3]

Prints the candidate table (predicted step time, bubble, peak bytes, why rejected) and, with --verify k, the
top k measured beside their predictions. Needs the repository's examples/ (an editable install) and flax.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import re
from types import ModuleType
from typing import Any

from mpmd.cli.args import positive

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


def load_gpt(path: pathlib.Path = EXAMPLE) -> ModuleType:
    """The GPT example as a module (it is a script, not part of the package)."""
    if not path.exists():
        raise SystemExit(f"mpmd tune needs the GPT example at {path} (an editable install of the repository)")
    spec = importlib.util.spec_from_file_location("gpt_example", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpt_setup(gpt: ModuleType, layers: int, width: int, seq: int, heads: int, microbatches: int, rows: int,
              seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """(step, params, opt_state, batch) of the GPT example with a marker before every block but the first (one
    segment per block; the first also holds the embedding, the last the tied head and the loss). The step
    names OneFOneB(2); tune replaces it."""
    import numpy as np
    import optax
    from flax import nnx

    import mpmd

    model = gpt.GPT(256, width, layers, heads, seq, layers, nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-3)
    step = gpt.make_step(graphdef, opt, mpmd.OneFOneB(2))
    data = np.frombuffer(gpt.corpus(1 << 20, seed), np.uint8)
    batch = next(gpt.batches(data, microbatches, rows, seq, np.random.default_rng(seed)))
    return step, params, opt.init(params), batch


def _count(text: str) -> int:
    """--verify: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (none) or more, got {text}")
    return value


def _counts(text: str) -> list[int]:
    """--try-microbatches: comma-separated counts above 0."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated counts above 0, e.g. 2,4,8; got {text!r}")
    return counts


def _limit(text: str) -> float | None:
    """--memory-limit-mib: a number above 0, or 0 for no limit."""
    try:
        if float(text) == 0:
            return None
    except ValueError:
        pass
    try:
        return positive(float)(text)
    except argparse.ArgumentTypeError as e:  # (it said "above 0" alone, where 0 is taken too; a probe)
        raise argparse.ArgumentTypeError(f"{e} (or 0 for no limit)") from None


def _run(args: argparse.Namespace) -> int:
    import mpmd

    if args.width % args.heads:
        args.usage_error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    rows = args.microbatches * args.rows  # (refused before the actors start and measure for minutes: a probe)
    if args.try_microbatches and not any(rows % m == 0 for m in args.try_microbatches):
        args.usage_error(f"--try-microbatches {','.join(map(str, args.try_microbatches))}: none divides the batch's {rows} rows "
                         f"(--microbatches {args.microbatches} x --rows {args.rows}); pass counts that do, e.g. --try-microbatches "
                         f"{','.join([str(m) for m in range(2, rows + 1) if rows % m == 0][:6])}")
    # (a model past this machine's memory ended in a JAX RESOURCE_EXHAUSTED traceback, or took the machine; a probe)
    weights = 12 * args.layers * args.width ** 2 + (256 + args.seq) * args.width  # blocks' attention and 4x MLP, embedding
    need = 4 * weights * 4  # float32 params, AdamW's two moments and the gradients
    from mpmd.runtime.launch.local import host_memory

    memory = host_memory() or {}  # (MemAvailable: free memory less the page cache it can take back; sysconf's is MemFree)
    have = memory.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise SystemExit(f"mpmd tune: a GPT of --layers {args.layers} and --width {args.width} has about {weights / 1e6:,.0f}M "
                         f"parameters: with AdamW's moments and the gradients {need / 2**30:,.1f} GiB, more than this machine's "
                         f"{have / 2**30:,.1f} GiB available; pass a smaller --width or --layers")
    gpt = load_gpt()
    step, params, opt_state, batch = gpt_setup(gpt, args.layers, args.width, args.seq, args.heads, args.microbatches, args.rows)
    pin = 1 if args.actors <= len(os.sched_getaffinity(0)) else None
    limit = int(args.memory_limit_mib * 2**20) if args.memory_limit_mib is not None else None
    import logging
    import sys

    logging.basicConfig(format="mpmd tune: %(message)s", stream=sys.stderr)
    logging.getLogger("mpmd").setLevel(logging.INFO)  # progress: every variant compiled and profiled, as it happens
    how = ("estimating the segments' costs with XLA's cost analysis" if args.xla_costs else
           f"measuring the segments on {args.actors} actors (minutes on a laptop: each profiled variant is compiled first)")
    print(f"mpmd tune: {how}, then simulating every candidate", file=sys.stderr, flush=True)
    with mpmd.RemoteMesh.local(num_actors=args.actors, cpus_per_actor=pin) as mesh:
        try:
            result = mpmd.tune(step, params, opt_state, batch, mesh=mesh, memory_limit=limit, microbatches=args.try_microbatches,
                               costs="xla" if args.xla_costs else None, remat=args.remat)
        except mpmd.MpmdError as e:
            text = _in_cli_words(str(e))
            raise SystemExit(f"mpmd {text}" if text.startswith("tune:") else f"mpmd tune: {text}") from None
        print(result, flush=True)
        if not result.feasible:
            try:
                result.best  # (its error says why nothing fits and what to do, in mpmd.tune's words)
            except mpmd.MpmdError as e:  # (its first line: the table it ends with was printed just above; a probe)
                print(f"mpmd tune: {_in_cli_words(str(e).splitlines()[0])}", file=sys.stderr)
            return 1
        if args.verify:
            result.verify(args.verify)
    return 0


def _in_cli_words(text: str) -> str:
    """mpmd.tune's message in this command's words: its flags, not mpmd.tune's arguments (a probe)."""
    text = re.sub(r"microbatches=\[([\d, ]+)\]", lambda m: "--try-microbatches " + m.group(1).replace(" ", ""), text)
    return text.replace("raise memory_limit", "raise --memory-limit-mib").replace("pass remat=True", "pass --remat").replace(
        "remat=True was tried", "--remat was tried")


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser("tune", help="choose schedule, microbatches and stage grouping for the GPT example (mpmd.tune)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actors", type=positive(int), default=2, help="the number of local actors (daemons) to tune for (default %(default)s)")
    p.add_argument("--layers", type=positive(int), default=8, help="transformer blocks of the GPT example (default %(default)s)")
    p.add_argument("--width", type=positive(int), default=128, help="its model width (default %(default)s)")
    p.add_argument("--seq", type=positive(int), default=64, help="tokens per sequence (default %(default)s)")
    p.add_argument("--heads", type=positive(int), default=4, help="attention heads (width must be a multiple) (default %(default)s)")
    p.add_argument("--microbatches", type=positive(int), default=8, help="microbatches of the batch as given (default: %(default)s)")
    p.add_argument("--rows", type=positive(int), default=4, help="sequences per microbatch of the batch as given (default: %(default)s)")
    p.add_argument("--try-microbatches", type=_counts, default=None, help="comma-separated counts to consider (default: the divisors of the batch's "
                   "microbatches x rows sequences from the actors to 4 x actors x stages per actor, and --microbatches)")
    p.add_argument("--memory-limit-mib", type=_limit, default=None, help="the memory limit per actor, in MiB (0, the default: no limit)")
    p.add_argument("--remat", action="store_true", help="also try remat of the stages of actors over the memory limit")
    p.add_argument("--xla-costs", action="store_true", help="predict from XLA's cost analysis instead of measuring segments")
    p.add_argument("--verify", type=_count, default=0, help="run the top k for real (0: none)")
    p.set_defaults(run=_run, usage_error=p.error)  # (usage_error: exits 2 with the usage, as argparse's own errors)
