"""Pipeline runtime figures, each a ratio measured in one run.

* step time of a compute-bound MLP on 1 actor vs `jax.jit` of the same step in this process;
* dispatch overhead per `Run` instruction (a step of many tiny tasks, per instruction);
* the first distributed step (trace, compile, run) vs the first `jax.jit` call, both with cold caches, right after
  the actors started (`--settle S`: S seconds later, once their start has finished — the compile child up, JAX's
  lowering warmed — as after a user's model and data setup); and the first call of a 2-stage 1F1B step on 2
  actors (several executables per actor) vs `jax.jit`'s of the same step;
* a 2-stage 1F1B step vs the schedule's ideal (sum of one stage's compute, from the 1-actor run).

    python -m benchmarks.pipeline [--settle 0]
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpmd
from benchmarks.efficiency import timed_rounds
from tests.test_pipeline import make_step


def make(num_stages, width, depth_per_stage, schedule):
    def model(params, x):
        for s in range(num_stages):
            for w in params[s]:
                x = jnp.tanh(x @ w)
            if s < num_stages - 1:
                x = mpmd.pipeline_yield(x)
        return x

    def loss(params, mb):
        return jnp.mean((model(params, mb["x"]) - mb["y"]) ** 2)

    opt = optax.sgd(1e-3)
    step = make_step(loss, opt, schedule)

    rng = np.random.default_rng(0)
    params = [[(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(depth_per_stage)]
              for _ in range(num_stages)]
    return step, params, opt


timed = timed_rounds  # the median wall time of `reps` calls


def bench_vs_jit(mesh, width, depth, mbs, mb_size, reps=5):
    """Step times, and each side's first call (trace + compile + one step) with cold caches on both sides: the
    actors' persistent compilation cache is a fresh directory (`main`), this process has none, each side traces
    its own copy of the step, and mpmd goes first, so what JAX keeps in this process between them favours
    `jax.jit` (the figure had been taken with mpmd's persistent cache warm and jax.jit's cold; a review)."""
    step, params, opt = make(1, width, depth, mpmd.GPipe(1))
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((mbs, mb_size, width)).astype(np.float32),
             "y": rng.standard_normal((mbs, mb_size, width)).astype(np.float32)}
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(0)))  # (this process's backend up before either is timed)
    dist = mpmd.distributed(step, mesh=mesh)
    t = time.perf_counter()
    out = dist(params, opt.init(params), batch)
    out[2].to_numpy()
    dist_compile = time.perf_counter() - t
    ref = jax.jit(make(1, width, depth, mpmd.GPipe(1))[0])  # (its own copy: no trace of the same function shared)
    t = time.perf_counter()
    jax.block_until_ready(ref(params, opt.init(params), batch))
    jit_compile = time.perf_counter() - t
    p, o = out[0], out[1]
    jit_t = timed(lambda: jax.block_until_ready(ref(params, opt.init(params), batch)), reps)

    def one():
        r = dist(p, o, batch)
        r[2].to_numpy()

    dist_t = timed(one, reps)
    return jit_t, dist_t, jit_compile, dist_compile, dist.compile(p, o, batch).plan


def dispatch_per_run(mesh, n: int = 400, reps: int = 15) -> tuple[float, float]:
    """What the actor's interpreter adds per Run: the time of one run_program request whose Program chains
    n + 1 tiny Runs (x -> x + 1 on 4 floats) minus that of a Program of 1 Run, over n."""
    import itertools
    import statistics

    from mpmd.compiler.program import Delete, Label, Program, Run

    blob, _ = mesh.executables.lower(lambda x: x + 1, [jax.ShapeDtypeStruct((4,), np.float32)], mesh.platform)
    exe = mesh.run(mesh.executables.ensure_compiled(0, blob))
    x = mesh.actor(0).put(np.zeros(4, np.float32))
    ids = itertools.count(1 << 20)

    def program(k: int) -> int:
        ins = []
        for i in range(k):
            ins.append(Run(0, (i,), (i + 1,), Label("tiny")))
            if i:
                ins.append(Delete((i,)))
        pid = next(ids)
        mesh.run(mesh.executables.load_program(0, Program(0, [0], [k], ins, executables=[exe]), pid, [exe]))
        return pid

    def timed_program(pid: int) -> float:
        times = []
        for step in range(reps):
            out = mesh.new_buffer_id()

            async def go() -> None:
                await mesh.conn(0).request("run_program", {"program": pid, "step": step, "inputs": [x.buffers[0]], "outputs": [out]})
                await mesh.conn(0).request("wait", {"bufs": [out]})

            t = time.perf_counter()
            mesh.run(go())
            times.append(time.perf_counter() - t)
            mesh.run(mesh.conn(0).request("delete", {"bufs": [out]}))
        return statistics.median(times)

    short, long = program(1), program(n + 1)
    timed_program(short), timed_program(long)  # warm
    t1, tn = timed_program(short), timed_program(long)
    return (tn - t1) / n, t1


def main(settle: float = 0.0) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as cache, mpmd.RemoteMesh.local(num_actors=2, cache_dir=cache) as mesh:
        time.sleep(settle)
        one = mpmd.RemoteMesh.connect(mesh.addresses[:1], transport="none", keys=mesh.keys)
        jit_t, dist_t, jit_c, dist_c, _ = bench_vs_jit(one, width=512, depth=4, mbs=4, mb_size=256)
        print(f"compute-bound step (1 actor, 512x512 MLP x4, 4 mbs of 256): jax.jit {jit_t * 1e3:.1f} ms, "
              f"mpmd {dist_t * 1e3:.1f} ms, ratio {dist_t / jit_t:.3f}")
        print(f"first step (trace + compile + run; cold caches both sides; {settle:g} s after the actors started): "
              f"jax.jit {jit_c:.2f} s, mpmd {dist_c:.2f} s, ratio {dist_c / jit_c:.2f}")
        per_run, whole = dispatch_per_run(one)
        print(f"dispatch: {per_run * 1e6:.1f} µs per Run instruction (a program of 401 chained tiny Runs vs one of 1, "
              f"in one request; the 1-Run step's round trip {whole * 1e6:.0f} µs)")
        one.close()
        # 2 stages on 2 actors vs the ideal from the per-stage compute.
        width, depth, mbs, mb_size = 512, 2, 8, 256
        step2, params2, opt = make(2, width, depth, mpmd.OneFOneB(2))
        rng = np.random.default_rng(2)
        batch = {"x": rng.standard_normal((mbs, mb_size, width)).astype(np.float32),
                 "y": rng.standard_normal((mbs, mb_size, width)).astype(np.float32)}
        dist2 = mpmd.distributed(step2, mesh=mesh)
        t = time.perf_counter()
        out = dist2(params2, opt.init(params2), batch)
        out[2].to_numpy()
        first2 = time.perf_counter() - t
        ref2 = jax.jit(make(2, width, depth, mpmd.OneFOneB(2))[0])  # (its own copy, traced afresh)
        t = time.perf_counter()
        jax.block_until_ready(ref2(params2, opt.init(params2), batch))
        jit_first2 = time.perf_counter() - t
        print(f"first call of the 2-stage 1F1B step on 2 actors (an executable per task kind and actor, compiled in "
              f"the actors' compile children): jax.jit {jit_first2:.2f} s, mpmd {first2:.2f} s, ratio {first2 / jit_first2:.2f}")
        t2 = timed(lambda: dist2(out[0], out[1], batch)[2].to_numpy(), 5)
        step1, params1, _ = make(1, width, depth, mpmd.GPipe(1))  # one stage's work, on one actor
        one = mpmd.RemoteMesh.connect(mesh.addresses[:1], transport="none", keys=mesh.keys)
        d1 = mpmd.distributed(step1, mesh=one)
        o1 = d1(params1, opt.init(params1), batch)
        o1[2].to_numpy()
        t1 = timed(lambda: d1(o1[0], o1[1], batch)[2].to_numpy(), 5)
        ideal = t1 * (mbs + 2 - 1) / mbs  # S=2: (M + S - 1) slots of one stage's per-microbatch time
        print(f"2-stage 1F1B on 2 actors ({mbs} mbs): {t2 * 1e3:.1f} ms; one stage alone {t1 * 1e3:.1f} ms; "
              f"ideal {ideal * 1e3:.1f} ms; ratio to ideal {t2 / ideal:.2f} (2 cores here: actors share them)")
        one.close()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settle", type=float, default=0.0, help="seconds between the actors' start and the first step")
    settle = p.parse_args().settle
    if not 0 <= settle <= 600:  # (nan too)
        p.error(f"--settle takes seconds from 0 to 600, got {settle}")
    main(settle)
