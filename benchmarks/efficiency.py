"""Does pipelining pay? A fair comparison on a machine with few cores.

Every party gets cores of its own and single-threaded XLA (`--xla_cpu_multi_thread_eigen=false`):

* `jax.jit` of the undecorated step, in a fresh process pinned to this process's first core;
* mpmd on one actor pinned to that core running both stages (a 2-stage table on one actor), the controller pinned
  there too while it runs (as `jax.jit` does all its host work on its one core);
* mpmd on two actors pinned to cores 0 and 1, 2-stage 1F1B.

The model: a 512-wide tanh MLP of 8 layers (4 per stage), 8 microbatches of 128 rows, SGD (`--optimizer adam`: the
update moves 4x the bytes, and the first stage's runs after its last backward, on the step's tail). Step times are
medians over rounds of `--steps` back-to-back steps (a training loop that fetches the loss once per round),
so they include everything a user waits for. Every party is kept running and timed round by round, the order rotated
each round (jax.jit, two copies of it at once, 1 actor, 2 actors, 2 actors without keys), so that a slow spell of
this shared machine falls on all of them alike rather than on whichever was measured in it. Then:

    speedup = jit / two actors    ideal = p*m / (m+p-1)    efficiency = speedup / ideal

the cost of security — the same 2-actor step on daemons started with --insecure (no keys: nothing
authenticated, nothing encrypted), as secure / insecure (target <= 1.05x on one host, where the data plane
uses kernel-authenticated links and shared memory, and only the control plane is encrypted) — and the trace
summary of one 2-actor step (compute, waiting for data, runtime overhead, idle per actor). Two
copies of the jax.jit step run on the two cores at once tell how much two busy cores can do here (virtual
machines often share physical cores): the ideal divided by that slowdown is what this machine allows.

    python -m benchmarks.efficiency [--width 512] [--layers 8] [--microbatches 8] [--rows 128] [--optimizer sgd]
                                    [--trace step.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ONE_CORE_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def build(width: int, layers: int, stages: int, schedule, optimizer: str = "sgd"):  # noqa: ANN001 - a benchmark
    import optax

    from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss

    opt = optax.adam(1e-3) if optimizer == "adam" else optax.sgd(1e-3)
    params = mlp_params(np.random.default_rng(0), stages, width, layers // stages)
    return make_train_step(mse_loss(mlp), opt, schedule), params, opt


def timed_rounds(run_round, rounds: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        run_round()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def jit_child(args: argparse.Namespace) -> None:
    """Runs in a fresh process pinned to one core and serves the jax.jit step: each line "round" on stdin runs one
    round of `--steps` steps and answers its seconds per step as a JSON line; end of input ends it."""
    import jax

    from mpmd.testing import regression_batch

    step, params, opt = build(args.width, args.layers, 2, None, args.optimizer)
    batch = regression_batch(np.random.default_rng(1), args.microbatches, args.rows, args.width)
    f = jax.jit(step)
    state = (params, opt.init(params))
    out = f(*state, batch)
    jax.block_until_ready(out)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        s = state
        t = time.perf_counter()
        for _ in range(args.steps):
            s = f(*s, batch)[:2]
        jax.block_until_ready(s)
        print(json.dumps({"jit": (time.perf_counter() - t) / args.steps}), flush=True)


class JitParty:
    """A jax.jit child pinned to `core`, kept alive between rounds (see jit_child)."""

    def __init__(self, args: argparse.Namespace, core: int) -> None:
        cmd, env = _jit_cmd(args, core)
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()  # (compiled and warm)

    def _answer(self) -> dict:
        while True:  # (what else the child prints, a library's notice on stdout say, is passed over)
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"the jax.jit child ended (exit status {self.proc.wait()}); run it alone to see why: "
                                 f"{' '.join(self.proc.args)}")
            if line.startswith("{"):
                return json.loads(line)

    def start_round(self) -> None:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()

    def end_round(self) -> float:
        return self._answer()["jit"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _jit_cmd(args: argparse.Namespace, core: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {ONE_CORE_FLAGS}".strip(), JAX_PLATFORMS="cpu")
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "benchmarks.efficiency", "--jit-child",
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ("width", "layers", "microbatches", "rows", "steps", "rounds", "optimizer"))]
    return cmd, env


def _cores() -> list[int]:
    """The cores this process may use, in order: the local actors pinned one per core take them so (actor i the
    i-th; mpmd/runtime/launch/local.py cpu_sets), and so do the jax.jit children (a literal core 0 and 1 were
    other cores than the actors' under a restricted CPU set; a review)."""
    return sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def process_pinned(cores: set[int]):  # noqa: ANN201
    """Every thread of this process (the controller: its event loop, ZeroMQ's I/O threads, the batch's copier)
    pinned to `cores` inside the block, and to this thread's cores again after: in the 1-actor run the controller
    then shares the one actor's core as jax.jit's host work shares its one core (unpinned, it took 2-3 % of a step of
    CPU on the other core, beside a 5 % target; a review). Threads started inside inherit the pinning."""
    from benchmarks.spmd import pin_all_threads

    mine = os.sched_getaffinity(0)
    pin_all_threads(cores)
    try:
        yield
    finally:
        pin_all_threads(mine)


class MpmdParty:
    """The benchmark's step on `mesh` with `schedule`, warm, run a round at a time (`pinned`: this process's threads
    on those cores while it runs, as in the 1-actor case)."""

    def __init__(self, mesh, schedule, args: argparse.Namespace, pinned: set[int] | None = None) -> None:  # noqa: ANN001
        import mpmd
        from mpmd.testing import regression_batch

        self.mesh, self.args, self.pinned = mesh, args, pinned
        step, params, opt = build(args.width, args.layers, 2, schedule, args.optimizer)
        self.batch = regression_batch(np.random.default_rng(1), args.microbatches, args.rows, args.width)
        self.dist = mpmd.distributed(step, mesh=mesh)
        with self._pinned():
            state = self.dist(params, opt.init(params), self.batch)[:2]
            self.state = self.dist(*state, self.batch)[:2]
            self.state[0][0][0].block_until_ready()

    def _pinned(self):  # noqa: ANN202
        return process_pinned(self.pinned) if self.pinned else contextlib.nullcontext()

    def round(self) -> float:
        """One round of `--steps` steps dispatched back to back, the loss fetched at the end: seconds per step."""
        with self._pinned():
            t = time.perf_counter()
            for _ in range(self.args.steps):
                *self.state, losses = self.dist(*self.state, self.batch)
            losses.block_until_ready()
            return (time.perf_counter() - t) / self.args.steps

    def trace(self, path: str):  # noqa: ANN201
        with self.mesh.trace() as trace:
            *self.state, losses = self.dist(*self.state, self.batch)
        losses.block_until_ready()
        trace.to_perfetto(path)
        return trace


def measure_mpmd(mesh, schedule, args: argparse.Namespace, trace_path: str | None = None):  # noqa: ANN001, ANN201
    """One party alone (benchmarks/gpu.py): the median seconds per step over `--rounds` rounds, and the trace of one
    more step written to `trace_path` (None: no trace)."""
    party = MpmdParty(mesh, schedule, args)
    t = statistics.median(party.round() for _ in range(args.rounds))
    return t, (party.trace(trace_path) if trace_path is not None else None)


def alternated(parties: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each party's seconds per step, round by round, the parties' order rotated each round. A party is a function
    that runs one round and returns its time."""
    names = list(parties)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(parties[n]())
    return times


def insecure_mesh(n: int):  # noqa: ANN201
    """`n` local actors pinned one per core, started with --insecure (no keys anywhere)."""
    import mpmd
    from mpmd.runtime.launch.local import LocalOptions, start_local

    local = start_local(n, LocalOptions(insecure=True, cpus_per_actor=1))
    try:
        mesh = mpmd.RemoteMesh(local.endpoints, local.processes, keys=None)
    except BaseException:
        local.cleanup()
        raise
    mesh._tmpdir = local.directory  # removed with the mesh (as RemoteMesh.local does)
    return mesh


def one_actor_schedule(m: int):  # noqa: ANN201
    import mpmd

    order = tuple(t for i in range(m) for t in (f"0F{i}", f"1F{i}", f"1B{i}", f"0B{i}"))
    return mpmd.Custom(num_stages=2, order=(order,), stage_actor=(0, 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="adam: the update reads and writes 4x the bytes, and the first stage's runs after its last backward")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round (dispatched back to back)")
    p.add_argument("--rounds", type=int, default=7, help="rounds per party, the parties alternated")
    p.add_argument("--trace", default=None, help="write the 2-actor step's Perfetto trace here")
    p.add_argument("--jit-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trace is not None:  # (checked before a minute of measuring: a missing folder failed at the end; a probe)
        from mpmd.cli.args import cannot_write

        why = cannot_write(args.trace)
        if why:
            p.error(f"--trace {args.trace!r}: {why}")
    for flag, least in (("width", 1), ("layers", 2), ("microbatches", 1), ("rows", 1), ("steps", 1), ("rounds", 1)):
        if getattr(args, flag) < least:  # (--layers 1 crashed in an IndexError, --steps 0 in a bare CalledProcessError)
            p.error(f"--{flag} must be at least {least}{' (the 2-stage MLP needs a layer a stage)' if flag == 'layers' else ''}, "
                    f"got {getattr(args, flag)}")
    if args.jit_child:
        jit_child(args)
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this benchmark needs 2 cores (one per actor)")
    import mpmd

    cores = _cores()
    jits: list[JitParty] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [j.close() for j in jits])
        for core in cores[:2]:
            jits.append(JitParty(args, core))
        one = stack.enter_context(mpmd.RemoteMesh.local(num_actors=1, cpus_per_actor=1))
        two = stack.enter_context(mpmd.RemoteMesh.local(num_actors=2, cpus_per_actor=1))
        bare = stack.enter_context(insecure_mesh(2))
        one_p = MpmdParty(one, one_actor_schedule(args.microbatches), args, pinned={cores[0]})
        two_p = MpmdParty(two, mpmd.OneFOneB(2), args)
        bare_p = MpmdParty(bare, mpmd.OneFOneB(2), args)

        def jit_round() -> float:
            jits[0].start_round()
            return jits[0].end_round()

        def corun_round() -> float:  # both copies at once: their mean
            for j in jits:
                j.start_round()
            return float(np.mean([j.end_round() for j in jits]))

        times = alternated({"jit": jit_round, "corun": corun_round, "one": one_p.round, "two": two_p.round,
                            "bare": bare_p.round}, args.rounds)
        trace = two_p.trace(args.trace or "/tmp/mpmd-efficiency-trace.json")
    med = {n: statistics.median(ts) for n, ts in times.items()}
    jit_t, one_t, two_t, bare_t = med["jit"], med["one"], med["two"], med["bare"]
    corun = med["corun"] / jit_t
    s, m = 2, args.microbatches
    ideal = s * m / (m + s - 1)
    speedup = jit_t / two_t
    print(f"{args.layers}-layer {args.width}-wide tanh MLP ({args.optimizer}), {m} microbatches of {args.rows}; each party on its own core(s), "
          "single-threaded XLA")
    print(f"{'jax.jit, 1 core':34s} {jit_t * 1e3:9.2f} ms")
    print(f"{'mpmd, 1 actor (both stages)':34s} {one_t * 1e3:9.2f} ms   ratio to jax.jit {one_t / jit_t:5.2f}")
    print(f"{'mpmd, 2 actors, 1F1B':34s} {two_t * 1e3:9.2f} ms   speedup {speedup:5.2f}   ideal {ideal:5.2f}   "
          f"efficiency {speedup / ideal:5.2f}")
    per_round = [j / t / ideal for j, t in zip(times["jit"], times["two"])]
    print(f"{'':34s} efficiency round by round (jax.jit and 2 actors of the same round): "
          f"{' '.join(f'{e:.2f}' for e in per_round)} (median {statistics.median(per_round):.2f})")
    ceiling = ideal / max(corun, 1.0)  # (two copies measured faster than one is this VM's noise: no ceiling above ideal)
    print(f"{'two copies of jax.jit at once':34s} each {corun:5.2f}x its time alone: this machine's two cores give at most "
          f"{2 / max(corun, 1.0):4.2f}x one core's throughput, so the 1F1B ideal here is {ceiling:4.2f} and efficiency "
          f"against it {speedup / ceiling:5.2f}")
    print(f"{'same, daemons with --insecure':34s} {bare_t * 1e3:9.2f} ms   cost of security (keys / none) {two_t / bare_t:5.2f}x")
    if speedup / ideal > 1.0 or one_t / jit_t < 0.8 or corun < 0.8:  # (more than the ideal, or a party faster than jax.jit
        # alone: the machine was busier while one of them was measured; a newcomer's run on a loaded machine)
        print("\nWARNING: figures beyond what this machine can give (efficiency over 1, or jax.jit slower than mpmd on one "
              "core or than two copies of itself): something else ran on these cores during the run; measure again on a "
              "quiet machine")
    print()
    print(trace.summary())


if __name__ == "__main__":
    main()
