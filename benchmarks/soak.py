"""Soak and the cost of authentication, in one run.

1. Soak: 2,000 steps of a small 2-stage 1F1B pipeline (a 2-layer MLP, 4 microbatches) on a local mesh; the
   buffer count and RSS of the controller and of each actor after warm-up and at the end. Whatever grows by
   the step would show here.
2. CURVE cost: the same measurements on an authenticated local mesh (what `RemoteMesh.local` makes) and on an
   unauthenticated one (daemons started with --insecure), alternating between them: the median ping, and a
   64 MiB actor-to-actor transfer over the ``tcp`` route (ZeroMQ frames, which CURVE encrypts) and over the
   ``shm`` route (shared memory; only the notice is encrypted). Reported as ratios secure / insecure.
3. Compile-check cost: for distinct stage blobs (the MLP stage at several widths), the time the child process
   takes to check each (deserialize, read, custom calls, lower) against the daemon's whole compile request;
   and the checker's memory while it is alive.

    python -m benchmarks.soak [--steps 2000] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpmd
from mpmd.compiler.program import Label, Program, Recv, Send
from mpmd.runtime.launch.local import LocalOptions, start_local
from mpmd.testing import make_train_step

_ids = itertools.count(50_000)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def model(params, x):
    x = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
    x = mpmd.pipeline_yield(x)
    return jnp.tanh(x @ params[1]["w"] + params[1]["b"])


def loss(params, mb):
    return jnp.mean((model(params, mb["x"]) - mb["y"]) ** 2)


def make_step(optimizer):
    return make_train_step(loss, optimizer, mpmd.OneFOneB(num_stages=2))


def snapshot(mesh) -> dict[str, tuple[int, float]]:
    gc.collect()
    for i in range(len(mesh)):
        mesh.actor(i).ping()  # flushes the deletes of arrays just collected
    time.sleep(0.2)
    out = {"controller": (0, rss_mib(os.getpid()))}
    for i in range(len(mesh)):
        out[f"actor {i}"] = (mesh.actor(i).stats()["buffers"], rss_mib(mesh.processes[i].proc.pid))
    return out


def soak(steps: int) -> None:
    rng = np.random.default_rng(0)
    width = 64
    params = [{"w": (rng.standard_normal((width, width)) / 8).astype(np.float32), "b": np.zeros(width, np.float32)} for _ in range(2)]
    batch = {"x": rng.standard_normal((4, 16, width)).astype(np.float32), "y": rng.standard_normal((4, 16, width)).astype(np.float32)}
    opt = optax.adam(1e-3)
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        step = mpmd.distributed(make_step(opt), mesh=mesh)
        p, o = params, opt.init(params)
        for _ in range(20):  # warm-up: compile, first allocations, shared-memory pool
            p, o, losses = step(p, o, batch)
        first_loss = float(np.mean(losses.to_numpy()))
        del losses  # as at the end: only parameters and optimizer state are held
        start = snapshot(mesh)
        t = time.perf_counter()
        for _ in range(steps):
            p, o, losses = step(p, o, batch)
        last_loss = float(np.mean(losses.to_numpy()))  # (steps are dispatched ahead: the time ends when the last is done)
        elapsed = time.perf_counter() - t
        del losses
        end = snapshot(mesh)
    print(f"soak: {steps} steps of a 2-stage 1F1B pipeline in {elapsed:.1f} s ({1e3 * elapsed / steps:.2f} ms/step); "
          f"loss {first_loss:.4f} -> {last_loss:.4f}")
    print(f"{'process':12s} {'buffers start':>14s} {'end':>6s} {'RSS MiB start':>14s} {'end':>8s} {'growth':>8s}")
    for name in start:
        (b0, r0), (b1, r1) = start[name], end[name]
        bufs = f"{'-':>14s} {'-':>6s}" if name == "controller" else f"{b0:14d} {b1:6d}"
        print(f"{name:12s} {bufs} {r0:14.1f} {r1:8.1f} {r1 - r0:+8.1f}")


def _transfer(mesh, src_buf: int, nbytes: int) -> float:
    pid = next(_ids)
    mesh.run(mesh.executables.load_program(0, Program(0, [0], [], [Send(0, 1, 0, Label("xfer"))]), pid, []))
    mesh.run(mesh.executables.load_program(1, Program(1, [], [0], [Recv(0, 0, 0, "uint8", (nbytes,), Label("xfer"))]), pid, []))
    out = mesh.new_buffer_id()

    async def go():
        await asyncio.gather(
            mesh.conn(0).request("run_program", {"program": pid, "step": 0, "inputs": [src_buf], "outputs": []}),
            mesh.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": [out]}))

    t = time.perf_counter()
    mesh.run(go())
    dt = time.perf_counter() - t
    mesh.run(mesh.conn(1).request("delete", {"bufs": [out]}))
    return dt


def _mesh(insecure: bool, transport: str) -> mpmd.RemoteMesh:
    local = start_local(2, LocalOptions(insecure=insecure))
    try:
        mesh = mpmd.RemoteMesh(local.endpoints, local.processes, transport=transport, keys=local.keys)
    except BaseException:
        local.cleanup()
        raise
    mesh._tmpdir = local.directory
    return mesh


def curve_cost(reps: int, pings: int = 500) -> None:
    nbytes = 64 << 20
    payload = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    results: dict[tuple[str, str], list[float]] = {}
    for transport in ("tcp", "shm"):
        meshes = {"secure": _mesh(False, transport), "insecure": _mesh(True, transport)}
        try:
            for name, mesh in meshes.items():
                assert mesh.infos[0].header["authenticated"] == (name == "secure")
                assert set(mesh.routes.values()) == {transport}
            bufs = {name: mesh.actor(0).put(payload) for name, mesh in meshes.items()}
            for name, mesh in meshes.items():  # warm: connections, segments, first allocation
                _transfer(mesh, bufs[name].buffers[0], nbytes)
            for _ in range(reps):  # alternate, so drift of the machine hits both alike
                for name, mesh in meshes.items():
                    results.setdefault((name, f"64 MiB {transport}"), []).append(_transfer(mesh, bufs[name].buffers[0], nbytes))
            if transport == "tcp":
                for _ in range(5):
                    for name, mesh in meshes.items():
                        times = [mesh.actor(0).ping() for _ in range(pings // 5)]
                        results.setdefault((name, "ping"), []).extend(times)
            del bufs
        finally:
            for mesh in meshes.values():
                mesh.close()
    print(f"CURVE cost (secure / insecure local mesh, same run, {reps} transfers and {pings} pings each):")
    for what in ("ping", "64 MiB tcp", "64 MiB shm"):
        s, i = results[("secure", what)], results[("insecure", what)]
        if what == "ping":
            a, b = statistics.median(s), statistics.median(i)
            print(f"  ping (median)          {1e6 * a:8.0f} us vs {1e6 * b:8.0f} us   ratio {a / b:.2f}")
        else:
            a, b = min(s), min(i)
            print(f"  transfer {what:13s} {nbytes / a / 2**30:8.2f} GiB/s vs {nbytes / b / 2**30:5.2f} GiB/s   time ratio {a / b:.2f}")


def _stage_blob(width: int) -> bytes:
    from jax import export

    def flat(w1, w2, x):
        def loss(w1, w2):
            return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)

        v, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
        return v, g1, g2

    S = jax.ShapeDtypeStruct
    return bytes(export.export(jax.jit(flat), platforms=["cpu"])(S((width, width), jnp.float32), S((width, width), jnp.float32),
                                                                  S((16, width), jnp.float32)).serialize())


def compile_check_cost(n: int = 6) -> None:
    import hashlib

    from actors.sandbox import BlobChecker

    blobs = [_stage_blob(32 + 16 * i) for i in range(n)]
    checker = BlobChecker()

    async def checks() -> tuple[list[float], float]:
        await checker.start()
        times = []
        for b in blobs:
            t = time.perf_counter()
            await checker.check(b)
            times.append(time.perf_counter() - t)
        rss = rss_mib(checker._proc.pid) if checker._proc is not None else float("nan")
        checker.close()
        return times, rss

    check_times, rss = asyncio.run(checks())
    with mpmd.RemoteMesh.local(num_actors=1) as mesh:
        time.sleep(2)  # the daemon's own checker has started
        compile_times = []
        for b in blobs:
            t = time.perf_counter()
            mesh.run(mesh.conn(0).request("compile", {"digest": hashlib.sha256(b).hexdigest()}, [np.frombuffer(b, np.uint8)]))
            compile_times.append(time.perf_counter() - t)
    c, k = statistics.median(check_times), statistics.median(compile_times)
    print(f"compile check ({n} distinct stage blobs, medians): check {1e3 * c:.0f} ms of a {1e3 * k:.0f} ms compile request "
          f"({100 * c / k:.0f} %); the checker process holds {rss:.0f} MiB while alive (it exits after 60 s without work)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    soak(args.steps)
    curve_cost(args.reps)
    compile_check_cost()


if __name__ == "__main__":
    main()
