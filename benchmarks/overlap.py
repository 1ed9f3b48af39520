"""Does compute overlap transfers? A 2-actor pipeline whose transfer time is comparable to its compute.

Actor 0 runs M microbatches of a stage f (compute c per microbatch) and sends each output (an S MiB
activation, transfer t) to actor 1, which takes a few elements of it. The same Programs run in two modes,
alternating step by step: with overlap (sends run in the background, receives are posted at step start)
and with transfers forced synchronous (`RemoteMesh(overlap=False)`: each send is awaited where it stands,
until its bytes have left actor 0). c and t are measured alone first, and the stage's work is tuned so
that c is close to t; the best step of each mode is reported.

    ratio = step time with overlap / step time synchronous    ideal = max(c, t) / (c + t)

    python -m benchmarks.overlap [--mib 16] [--microbatches 8] [--routes shm,tcp] [--rounds 9]
"""

import argparse
import asyncio
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

import mpmd
from mpmd.compiler.program import Delete, Label, Program, Recv, Run, Send, Task

_ids = itertools.count(1)


def stage(x, reps):
    """Compute-bound work (one fused kernel of sines over the first 1024 * reps elements), then one pass over
    x to make the activation."""
    small = x[: min(x.shape[0], 1024 * reps)]
    for _ in range(8):
        small = jnp.sin(small) + 0.5
    return x * (1.0 + 1e-6 * jnp.mean(small))


def consume(y):
    return (y[:8].sum(),)  # cheap, so that the receiver does not compete with the sender for the two cores


class Bench:
    def __init__(self, mesh, nbytes: int, microbatches: int) -> None:
        self.mesh, self.m = mesh, microbatches
        self.n = nbytes // 4
        x = np.random.default_rng(0).standard_normal(self.n).astype(np.float32)
        self.x = mesh.actor(0).put(x)
        self.consume = self._exe(1, jax.jit(consume), jax.ShapeDtypeStruct((self.n,), np.float32))

    def _exe(self, actor, fn, *avals):
        blob, _ = self.mesh.executables.lower(fn, avals, "cpu")
        return self.mesh.run(self.mesh.executables.ensure_compiled(actor, blob))

    def stage_exe(self, reps: int) -> str:
        return self._exe(0, jax.jit(lambda x: (stage(x, reps),)), jax.ShapeDtypeStruct((self.n,), np.float32))

    def load(self, progs: dict[int, Program], exes: dict[int, list[str]]) -> int:
        pid = next(_ids)
        for a, p in progs.items():
            self.mesh.run(self.mesh.executables.load_program(a, p, pid, exes.get(a, [])))
        return pid

    def time_step(self, pid: int, progs: dict[int, Program], sync: bool, step: int) -> float:
        mesh = self.mesh
        outs = {a: [mesh.new_buffer_id() for _ in p.outputs] for a, p in progs.items()}

        async def go():
            await asyncio.gather(*(mesh.conn(a).request("run_program", {
                "program": pid, "step": step, "inputs": [self.x.buffers[0]] if p.inputs else [], "outputs": outs[a],
                "sync": sync}) for a, p in progs.items()))

        t = time.perf_counter()
        mesh.run(go())
        last = max(a for a in outs if outs[a])  # a step returns once dispatched: read its last result to finish it
        mesh.run(mesh.conn(last).request("get", {"buf": outs[last][-1]}))
        dt = time.perf_counter() - t
        for a, bufs in outs.items():
            if bufs:
                mesh.run(mesh.conn(a).request("delete", {"bufs": bufs}))
        return dt

    def run(self, progs: dict[int, Program], exes: dict[int, list[str]], sync: bool, reps: int = 5) -> float:
        pid = self.load(progs, exes)
        return min(self.time_step(pid, progs, sync, step) for step in range(reps))

    def programs(self, compute: bool, transfer: bool) -> dict[int, Program]:
        """Actor 0: [Run f(x) -> y_i; Send y_i; Del y_i] x M. Actor 1: [Recv y_i; Run sum(y_i); Del y_i] x M.
        Without transfers, actor 0 sums its last y itself, so that the step has a result to wait for."""
        n, lab = self.n, Label.of(Task(0, "F", 0))
        p0 = Program(0, [0], [])
        p1 = Program(1, [], [])
        for i in range(self.m):
            y = 1 + i
            p0.instructions.append(Run(0, (0,), (y,), lab) if compute else None)
            if transfer:
                p0.instructions.append(Send(y if compute else 0, 1, i, lab))
                r, s = 1000 + i, 2000 + i
                p1.instructions += [Recv(r, 0, i, "float32", (n,), lab), Run(0, (r,), (s,), Label.of(Task(1, "F", 0))), Delete((r,), lab)]
                p1.outputs.append(s)
            if compute:
                p0.instructions.append(Delete((y,), lab))
        p0.instructions = [ins for ins in p0.instructions if ins is not None]
        if not transfer:
            p0.instructions.insert(-1, Run(1, (self.m,), (9999,), Label.of(Task(1, "F", 0))))
            p0.outputs.append(9999)
        return {0: p0, 1: p1} if transfer else {0: p0}


def measure(route: str, mib: int, microbatches: int, rounds: int) -> None:
    with mpmd.RemoteMesh.local(num_actors=2, transport=route) as mesh:
        b = Bench(mesh, mib << 20, microbatches)
        exes1 = {1: [b.consume]}
        t = b.run(b.programs(compute=False, transfer=True), exes1, sync=True) / microbatches
        # Tune the stage so that compute per microbatch is close to the transfer time.
        consume0 = b._exe(0, jax.jit(consume), jax.ShapeDtypeStruct((b.n,), np.float32))
        def compute_time(reps):
            return b.run(b.programs(compute=True, transfer=False), {0: [b.stage_exe(reps), consume0]}, sync=False) / microbatches

        c1, c256 = compute_time(1), compute_time(256)
        per_rep = max((c256 - c1) / 255, 1e-7)
        reps = min(4096, max(1, round((t - c1) / per_rep)))
        for _ in range(3):  # refine: the loop's cost is close to linear in reps
            c = compute_time(reps)
            if abs(c - t) < 0.15 * t:
                break
            reps = min(4096, max(1, round(reps + (t - c) / per_rep)))
            print(f"  tuning: c {c * 1e3:.2f} ms for {reps} sines", flush=True)
        exes = {0: [b.stage_exe(reps), consume0], **exes1}
        c = b.run(b.programs(compute=True, transfer=False), exes, sync=False) / microbatches
        progs = b.programs(compute=True, transfer=True)
        pid = b.load(progs, exes)
        times: dict[bool, list[float]] = {False: [], True: []}
        for step in range(rounds):  # alternate, so that both modes see the same machine
            for sync in (False, True):
                times[sync].append(b.time_step(pid, progs, sync, 2 * step + sync))
        over, sync = min(times[False]), min(times[True])
        ideal = max(c, t) / (c + t)
        print(f"{route:>5} {mib:>4} MiB x{microbatches}  c {c * 1e3:6.2f} ms  t {t * 1e3:6.2f} ms  "
              f"overlap {over * 1e3:7.1f} ms  sync {sync * 1e3:7.1f} ms  ratio {over / sync:5.2f}  ideal {ideal:5.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--routes", default="shm,tcp")
    ap.add_argument("--rounds", type=int, default=9, help="steps per mode (alternating); the best of each is reported")
    args = ap.parse_args()
    for route in args.routes.split(","):
        measure(route, args.mib, args.microbatches, args.rounds)


if __name__ == "__main__":
    main()
