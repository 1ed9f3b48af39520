"""Tensor parallelism inside a pipeline: 2 actors x 2 devices against jax.jit on one (1, 2) mesh.

The model: per stage, `--blocks` Megatron MLP blocks (x + W2 gelu(x W1 + b1): W1 column-parallel over "model",
W2 row-parallel, so every block ends in an all-reduce), 2 stages; AdamW; `--microbatches` microbatches of
`--rows` rows of width `--width`. Three parties run the same undecorated step:

* mpmd: `RemoteMesh.local(2, devices_per_actor=2, mesh_shape=(1, 2))`, 1F1B, parameters laid out with
  `in_shardings` (each stage SPMD over its actor's 2 devices);
* jax.jit in the benchmark process, on a single-process (1, 2) mesh of the per-actor shape (`jax.set_mesh`),
  the same PartitionSpecs;
* and, to split the ratio into runtime cost and pipeline gain, mpmd on one actor of 2 devices running both
  stages (a 2-stage table on one actor, as in benchmarks/efficiency.py; the resources jax.jit has).

This machine has 2 cores, so 2 actors x 2 devices is 4 devices on 2 cores. Each configuration runs in a fresh
benchmark process (XLA reads its flags at start-up):

* `pinned` (the fair one): each actor pinned to its own core (`cpus_per_actor=1`) with
  single-threaded XLA (`--xla_cpu_multi_thread_eigen=false`; the actor's two
  devices share its core); jax.jit pinned to one core with the same flags, i.e. the resources of one actor.
  Ideal mpmd/jit ratio for a 2-stage pipeline on 2 cores: (m+1)/(2m).
* `unpinned`: nothing pinned, XLA's default thread pools everywhere (oversubscribed: each actor's pool
  thinks it has both cores); jax.jit gets both cores. Same total cores, so the ideal ratio is about 1.

Both meshes and the jax.jit step live in one benchmark process per configuration (pinned: every thread of it
on core 0, the mpmd controller's included). After `--warmup` steps each, the three parties run `--rounds`
interleaved rounds of `--steps` steps (this machine's speed drifts by tens of percent over a minute; drift hits
all three alike); step times are medians over all timed steps, each step waited for (mpmd: until every actor
finished it; jax.jit: block_until_ready on all outputs). The run reports how busy other processes kept the
cores meanwhile.

    python -m benchmarks.spmd [--config both|pinned|unpinned] [--width 256] [--hidden 1024] [--blocks 2]
                              [--microbatches 8] [--rows 64] [--rounds 6] [--steps 4] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ONE_CORE_FLAGS = "--xla_cpu_multi_thread_eigen=false"
SIZE_ARGS = ("width", "hidden", "blocks", "microbatches", "rows", "steps", "rounds", "warmup")


# ----------------------------------------------------------------------------------------------- the model


def megatron(params, x):  # noqa: ANN001, ANN201 - a benchmark
    import jax
    from jax.sharding import PartitionSpec as P

    import mpmd

    for s, stage in enumerate(params):
        for blk in stage:
            h = jax.nn.gelu(x @ blk["w1"] + blk["b1"])
            h = jax.lax.with_sharding_constraint(h, P("data", "model"))  # [rows, hidden]: hidden over "model"
            x = x + h @ blk["w2"]  # row-parallel: an all-reduce over "model"
        if s < len(params) - 1:
            x = mpmd.pipeline_yield(x)
    return x


def build(args: argparse.Namespace, schedule):  # noqa: ANN001, ANN201
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from mpmd.testing import make_train_step

    rng = np.random.default_rng(0)
    d, f = args.width, args.hidden
    params = [[{"w1": (rng.standard_normal((d, f)) / np.sqrt(d)).astype(np.float32),
                "b1": np.zeros(f, np.float32),
                "w2": (rng.standard_normal((f, d)) / np.sqrt(f) / args.blocks).astype(np.float32)}
               for _ in range(args.blocks)] for _ in range(2)]
    specs = [[{"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)} for _ in range(args.blocks)] for _ in range(2)]
    batch = {"x": rng.standard_normal((args.microbatches, args.rows, d)).astype(np.float32),
             "y": rng.standard_normal((args.microbatches, args.rows, d)).astype(np.float32)}

    def loss(p, mb):  # noqa: ANN001, ANN202
        return jnp.mean((megatron(p, mb["x"]) - mb["y"]) ** 2)

    opt = optax.adamw(1e-3)
    return make_train_step(loss, opt, schedule), params, specs, batch, opt


# ---------------------------------------------------------------------------------------------- pinning


def pin_all_threads(cores: set[int]) -> None:
    """Pin every thread of this process (os.sched_setaffinity(0) pins only the calling one)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass  # a thread that just exited


def thread_affinities(pid: int | str = "self") -> str:
    """The cores each thread of process `pid` may run on, grouped."""
    seen: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            key = ",".join(map(str, sorted(os.sched_getaffinity(int(tid)))))
        except OSError:
            continue
        seen[key] = seen.get(key, 0) + 1
    return ", ".join(f"{n} thread(s) on core(s) {k}" for k, n in sorted(seen.items()))


# ------------------------------------------------------------------------------------------------ timing


class Party:
    """One way of running the step: `first()` compiles and runs it once, `one()` runs one more step and waits
    for it; `times` collects the timed ones."""

    name = ""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.first_s = 0.0

    def warm_up(self, warmup: int) -> None:
        t = time.perf_counter()
        self.first()
        self.first_s = time.perf_counter() - t
        for _ in range(warmup):
            self.one()

    def timed(self, n: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            self.one()
            self.times.append(time.perf_counter() - t)

    def first(self) -> None:
        raise NotImplementedError

    def one(self) -> None:
        raise NotImplementedError


class MpmdParty(Party):
    """The step under mpmd.distributed: 1F1B on 2 actors, or both stages on 1 actor."""

    def __init__(self, args: argparse.Namespace, mesh, schedule) -> None:  # noqa: ANN001
        from jax.sharding import PartitionSpec as P

        import mpmd

        super().__init__()
        self.mesh = mesh
        self.step, self.params, self.specs, self.batch, self.opt = build(args, schedule)
        self.dist = mpmd.distributed(self.step, mesh=mesh, in_shardings=(self.specs, None, P(None, "data")))
        self.state = None

    def first(self) -> None:
        from jax.sharding import PartitionSpec as P

        import mpmd

        out = self.dist(self.params, self.opt.init(self.params), self.batch)
        out[2].block_until_ready()
        self.state = out[:2]
        # from now on the step's own outputs come back in: parameters and optimizer state stay on the actors
        self.dist = mpmd.distributed(self.step, mesh=self.mesh, in_shardings=(None, None, P(None, "data")))

    def one(self) -> None:
        *self.state, losses = self.dist(*self.state, self.batch)
        losses.block_until_ready()

    def report(self) -> dict:
        with self.mesh.trace() as trace:
            self.one()
        runs = {a: sorted((r.end - r.start) * 1e3 for r in x.runs) for a, x in trace.steps[-1].items()}
        return {"summary": trace.summary(), "w1": str(self.state[0][0][0]["w1"].sharding),
                "runs": "; ".join(f"actor {a}: {len(v)} Run(s), median {np.median(v):.1f} ms, {sum(v):.1f} ms in all"
                                  for a, v in sorted(runs.items())),
                "actors": [thread_affinities(p.proc.pid) for p in self.mesh.processes]}


class JitParty(Party):
    """jax.jit of the undecorated step on a single-process (1, 2) mesh."""

    def __init__(self, args: argparse.Namespace) -> None:
        import jax
        from jax.sharding import AxisType, Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        super().__init__()
        step, params, specs, batch, opt = build(args, None)
        self.mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        with jax.set_mesh(self.mesh):
            self.f = jax.jit(step)
            p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(self.mesh, s)), params, specs)
            self.state = (p, opt.init(p))
            self.batch = jax.device_put(batch, NamedSharding(self.mesh, P(None, "data")))

    def first(self) -> None:
        self.one()

    def one(self) -> None:
        import jax

        with jax.set_mesh(self.mesh):
            out = self.f(*self.state, self.batch)
            jax.block_until_ready(out)
        self.state = out[:2]

    def report(self) -> dict:
        return {"w1": str(self.state[0][0][0]["w1"].sharding.spec), "threads": thread_affinities()}


def party(args: argparse.Namespace) -> None:
    """One configuration, in this (fresh) benchmark process. The two meshes start first (their actors pinned to
    cores 0 and 1, and 0, when pinned); then this process pins all its threads to core 0 (pinned) and the three
    parties run in interleaved rounds, so slow drifts of this machine's speed hit all of them alike."""
    import contextlib

    import mpmd
    from benchmarks.efficiency import one_actor_schedule

    pinned = args.party == "pinned"
    cpus = 1 if pinned else None
    kw = {"devices_per_actor": 2, "mesh_shape": (1, 2), "axis_names": ("data", "model"), "cpus_per_actor": cpus}
    with contextlib.ExitStack() as stack:
        two = stack.enter_context(mpmd.RemoteMesh.local(num_actors=2, **kw))
        one = stack.enter_context(mpmd.RemoteMesh.local(num_actors=1, **kw))
        if pinned:
            pin_all_threads({sorted(os.sched_getaffinity(0))[0]})  # before XLA starts its threads here: they inherit it
        parties = {"mpmd": MpmdParty(args, two, mpmd.OneFOneB(2)), "one": MpmdParty(args, one, one_actor_schedule(args.microbatches)),
                   "jit": JitParty(args)}
        for p in parties.values():
            p.warm_up(args.warmup)
        if pinned:
            pin_all_threads({sorted(os.sched_getaffinity(0))[0]})  # any thread started since
        names = list(parties)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                parties[name].timed(args.steps)
        out = {name: {"step": float(np.median(p.times)), "times": p.times, "first": p.first_s, **p.report()}
               for name, p in parties.items()}
    import jax

    print(json.dumps({"config": args.party, **out, "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
                      "cores": sorted(os.sched_getaffinity(0))}))


def cpu_ticks() -> tuple[int, int]:
    """(busy, steal) clock ticks of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal, steal


def others_share(start: tuple[tuple[int, int], os.times_result, float]) -> tuple[float, float]:
    """Since `start`: the share of this machine's cores that processes outside this benchmark (and its
    children, actors included) kept busy, and the share stolen by the hypervisor."""
    (busy0, steal0), t0, w0 = start
    busy1, steal1 = cpu_ticks()
    t1, w1 = os.times(), time.monotonic()
    hz = os.sysconf("SC_CLK_TCK")
    ours = (t1.user + t1.system + t1.children_user + t1.children_system) - (t0.user + t0.system + t0.children_user + t0.children_system)
    capacity = (w1 - w0) * (os.cpu_count() or 1)
    return max((busy1 - busy0) / hz - ours - (steal1 - steal0) / hz, 0.0) / capacity, (steal1 - steal0) / hz / capacity


def jit_alone(args: argparse.Namespace) -> None:
    """In a fresh process pinned (by taskset) to one core: the pinned jax.jit step's median time."""
    j = JitParty(args)
    j.warm_up(args.warmup)
    j.timed(args.rounds * args.steps)
    print(json.dumps({"jit": float(np.median(j.times))}))


def measure_corun(args: argparse.Namespace) -> tuple[float, float]:
    """The pinned jax.jit step alone on core 0, then one copy on each of cores 0 and 1 at once: how much two busy
    cores slow each other here (1.0 on independent cores; a pipeline on 2 actors can gain at most 2 / that)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {ONE_CORE_FLAGS}", JAX_PLATFORMS="cpu")

    def cmd(core: int) -> list[str]:
        return ["taskset", "-c", str(core), sys.executable, "-m", "benchmarks.spmd", "--party=jit-alone",
                *(f"--{k}={getattr(args, k)}" for k in SIZE_ARGS)]

    def result(out: str) -> float:
        return json.loads(out.strip().splitlines()[-1])["jit"]

    alone = result(subprocess.run(cmd(0), env=env, capture_output=True, text=True, check=True).stdout)
    procs = [subprocess.Popen(cmd(c), env=env, stdout=subprocess.PIPE, text=True) for c in (0, 1)]
    both = [result(p.communicate()[0]) for p in procs]
    return alone, float(np.mean(both)) / alone


def run_config(args: argparse.Namespace, config: str) -> dict:
    flags = "--xla_force_host_platform_device_count=2"
    if config == "pinned":
        flags += " " + ONE_CORE_FLAGS
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "benchmarks.spmd", f"--party={config}", *(f"--{k}={getattr(args, k)}" for k in SIZE_ARGS)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the {config} benchmark process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("both", "pinned", "unpinned"), default="both")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=2, help="Megatron MLP blocks per stage")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="timed steps per party per round")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs --steps steps of every party, in rotating order")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-corun", action="store_true", help="skip measuring two pinned jax.jit copies at once")
    p.add_argument("--party", choices=("pinned", "unpinned", "jit-alone"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.party == "jit-alone":
        jit_alone(args)
        return
    if args.party:
        party(args)
        return
    cores = sorted(os.sched_getaffinity(0))
    configs = ("pinned", "unpinned") if args.config == "both" else (args.config,)
    if "pinned" in configs and len(cores) < 2:
        raise SystemExit("the pinned configuration needs 2 cores (one per actor)")
    start = (cpu_ticks(), os.times(), time.monotonic())
    load0 = os.getloadavg()[0]
    results = [run_config(args, c) for c in configs]
    corun = measure_corun(args) if "pinned" in configs and not args.no_corun else None
    others, steal = others_share(start)

    m = args.microbatches
    ideal_pinned = (m + 1) / (2 * m)
    print(f"2-stage pipeline, {args.blocks} Megatron MLP block(s) per stage ({args.width} -> {args.hidden} -> {args.width}, "
          f"W1 over 'model', W2 row-parallel), AdamW, {m} microbatches of {args.rows} rows; 1F1B")
    print(f"mpmd: 2 actors x 2 CPU devices, mesh (1, 2) ('data', 'model') each; jax.jit: one (1, 2) mesh in the benchmark "
          f"process. JAX {results[0]['jax']}, {len(cores)} cores ({cores}): 4 devices on {len(cores)} cores.")
    print(f"median of {args.rounds * args.steps} timed steps per party ({args.rounds} interleaved rounds of {args.steps}) "
          f"after {args.warmup} warm-up steps; each step waited for")
    print()
    print(f"{'config':9s} {'jax.jit':>9s} {'mpmd 2 actors':>14s} {'mpmd/jit':>9s} {'ideal':>6s}   "
          f"{'mpmd 1 actor':>13s} {'1 actor/jit':>12s}   {'1st step: jit':>13s} {'mpmd':>6s}")
    for r in results:
        ideal = ideal_pinned if r["config"] == "pinned" else 1.0
        j, d, o = r["jit"], r["mpmd"], r["one"]
        print(f"{r['config']:9s} {j['step'] * 1e3:6.1f} ms {d['step'] * 1e3:11.1f} ms {d['step'] / j['step']:9.2f} {ideal:6.2f}   "
              f"{o['step'] * 1e3:10.1f} ms {o['step'] / j['step']:12.2f}   {j['first']:12.2f}s {d['first']:5.2f}s")
    print()
    print("thread / pin configuration")
    for r in results:
        print(f"  {r['config']}: XLA_FLAGS={r['xla_flags']!r}")
        print(f"    actors: {'; '.join(f'actor {i}: {c}' for i, c in enumerate(r['mpmd']['actors']))}"
              f"{' (cpus_per_actor=1: the daemon adds the single-thread flags)' if r['config'] == 'pinned' else ' (not pinned)'}")
        print(f"    1-actor mesh: {r['one']['actors'][0]}")
        print(f"    jax.jit process: {r['jit']['threads']}")
        print(f"    W1 of stage 0: mpmd {r['mpmd']['w1']}; jax.jit {r['jit']['w1']}")
        rounds = {n: [np.median(r[n]["times"][i:i + args.steps]) * 1e3 for i in range(0, len(r[n]["times"]), args.steps)]
                  for n in ("jit", "mpmd", "one")}
        print("    per-round median ms: " + "; ".join(f"{label} {' '.join(f'{t:.0f}' for t in rounds[n])}"
                                                     for n, label in (("jit", "jit"), ("mpmd", "mpmd 2 actors"), ("one", "1 actor"))))
    print("  ideal: pinned = (m+1)/(2m), 2 cores for mpmd against jax.jit's 1; unpinned ~ 1 (both get the same 2 cores).")
    print("  mpmd 1 actor: both stages on one actor of 2 devices (pinned: one core; the 1-actor table of benchmarks/efficiency.py):")
    print("  what the runtime costs at jax.jit's own resources; 2 actors / 1 actor is what the pipeline buys.")
    print("  The mpmd controller lives in the jax.jit process: pinned, its threads share core 0 with actor 0 (they mostly wait). "
          "On a VM two vCPUs may share a physical core (benchmarks/efficiency.py measures that).")
    if corun is not None:
        alone, slow = corun
        print(f"  two copies of the pinned jax.jit step at once (cores 0 and 1, fresh processes): each {slow:.2f}x its time alone "
              f"({alone * 1e3:.1f} ms): two busy cores give {2 / slow:.2f}x one core here, so the pinned ideal is "
              f"{ideal_pinned * slow:.2f} on this machine")
    busy = "  <-- other work shared the cores: the figures are not clean" if others > 0.05 else ""
    print(f"  machine during the run: other processes kept {others * 100:.0f}% of the cores busy, hypervisor steal "
          f"{steal * 100:.0f}%, 1-min load average {load0:.2f} at start{busy}")
    for r in results:
        print()
        print(f"{r['config']}: one traced mpmd step")
        print(r["mpmd"]["summary"])
        print(f"executables run: 2 actors: {r['mpmd']['runs']}")
        print(f"                 1 actor:  {r['one']['runs']}")


if __name__ == "__main__":
    main()
