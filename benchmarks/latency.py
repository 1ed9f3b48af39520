"""Latency of the data plane and of a latency-bound pipeline, each against its baseline in the same run.

* one hop: a small activation sent by one actor until it is usable on the next — a chain of forwards between
  two actors (each Recv'd buffer is sent straight back), per hop — against a raw ZeroMQ one-way message
  between two fresh processes (half a ping-pong round trip) over ipc://, a Unix socket as the actors' same-host
  routes use (and, for reference, over tcp:// loopback), both pinned to the same two cores;
* a narrow 16-stage MLP on 4 actors (4 stages each, interleaved 1F1B, 4 microbatches): step time against
  jax.jit of the same step in this process.

    python -m benchmarks.latency [--hops 400] [--bytes 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import mpmd
from mpmd.cli.args import positive
from mpmd.compiler.program import Label, Program, Recv, Send
from transport.protocol import dtype_name

_ids = itertools.count(1)

RAW_ECHO = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.PAIR)
where = sys.argv[1]
if where.startswith("tcp://"):
    where = f"{where}:{s.bind_to_random_port(where)}"
else:
    s.bind(where)
print(where, flush=True)
while True:
    m = s.recv()
    if m == b"stop": break
    s.send(m)
"""


def pinned_cores() -> list[int] | None:
    """Two cores to pin both sides of each measurement to (actor 0 / the ping side on the first, actor 1 / the echo
    side on the second, as the pipeline benchmarks pin their actors), or None where fewer than two are ours."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cores[:2] if len(cores) >= 2 else None


def raw_one_way(nbytes: int, n: int = 2000, cores: list[int] | None = None, over: str = "ipc") -> float:
    """Half the median round trip of a raw ZeroMQ PAIR ping-pong between this process and a fresh one (pinned to
    `cores[0]` and `cores[1]` while it runs, when given), `over` "ipc" (a Unix socket in a temporary folder,
    removed after: what the actors' same-host routes ride) or "tcp" (loopback)."""
    import zmq

    tmp = tempfile.mkdtemp(prefix="mpmd-latency-") if over == "ipc" else None
    where = f"ipc://{tmp}/echo.sock" if tmp else "tcp://127.0.0.1"
    echo = subprocess.Popen([sys.executable, "-c", RAW_ECHO, where], stdout=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, {cores[1]})) if cores else None)
    mine = os.sched_getaffinity(0) if cores else None
    if cores:
        os.sched_setaffinity(0, {cores[0]})
    try:
        endpoint = echo.stdout.readline().strip()
        s = zmq.Context.instance().socket(zmq.PAIR)
        s.connect(endpoint)
        msg = bytes(nbytes)
        times = []
        for i in range(n + 200):
            t = time.perf_counter()
            s.send(msg)
            s.recv()
            if i >= 200:
                times.append(time.perf_counter() - t)
        s.send(b"stop")
        s.close(0)
        return statistics.median(times) / 2
    finally:
        if mine is not None:
            os.sched_setaffinity(0, mine)
        try:
            echo.wait(5)
        except subprocess.TimeoutExpired:  # (it never got "stop": this side failed first, and that error is the one to see)
            echo.kill()
            echo.wait()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def chain_programs(hops: int, nbytes: int) -> dict[int, Program]:
    """Actor 0 sends its input to actor 1, which sends it back, `hops` times in all; actor 0 outputs the last."""
    progs = {0: Program(0, [0], []), 1: Program(1, [], [])}
    dt = dtype_name(np.uint8)
    buf = {0: 0, 1: 0}
    for h in range(hops):
        src, dst = h % 2, 1 - h % 2
        progs[src].instructions.append(Send(buf[src], dst, h, Label("xfer")))
        buf[dst] += 1
        progs[dst].instructions.append(Recv(buf[dst], src, h, dt, (nbytes,), Label("xfer")))
    last = hops % 2
    progs[last].outputs = [buf[last]] if hops else [0]
    return progs


def chain_time(mesh: mpmd.RemoteMesh, hops: int, nbytes: int, reps: int = 15) -> float:
    progs = chain_programs(hops, nbytes)
    pid = next(_ids)
    for a, p in progs.items():
        mesh.run(mesh.executables.load_program(a, p, pid, []))
    x = mesh.actor(0).put(np.zeros(nbytes, np.uint8))
    times = []
    for step in range(reps):
        outs = {a: [mesh.new_buffer_id() for _ in p.outputs] for a, p in progs.items()}

        async def go() -> None:
            await asyncio.gather(*(mesh.conn(a).request("run_program", {
                "program": pid, "step": step, "inputs": [x.buffers[0]] if a == 0 else [], "outputs": outs[a]}) for a in progs))

        t = time.perf_counter()
        mesh.run(go())
        times.append(time.perf_counter() - t)
        mesh.run(mesh.conn(hops % 2).request("delete", {"bufs": outs[hops % 2]}))
    return statistics.median(times)


def narrow_pipeline(width: int = 16, stages: int = 16, actors: int = 4, m: int = 4, reps: int = 20) -> tuple[float, float]:
    import jax
    import optax

    from mpmd.testing import make_train_step, mlp, mlp_params, mse_loss, regression_batch

    opt = optax.sgd(1e-2)
    params = mlp_params(np.random.default_rng(0), stages, width)
    batch = regression_batch(np.random.default_rng(1), m, 4, width)
    ref = jax.jit(make_train_step(mse_loss(mlp), opt, None))
    jax.block_until_ready(ref(params, opt.init(params), batch))
    t_jit = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(ref(params, opt.init(params), batch))
        t_jit.append(time.perf_counter() - t)
    with mpmd.RemoteMesh.local(num_actors=actors) as mesh:
        dist = mpmd.distributed(make_train_step(mse_loss(mlp), opt, mpmd.InterleavedOneFOneB(stages, actors)), mesh=mesh)
        state = dist(params, opt.init(params), batch)[:2]
        state[0][0][0].block_until_ready()
        t_mpmd = []
        for _ in range(reps):
            t = time.perf_counter()
            out = dist(*state, batch)
            out[2].block_until_ready()
            t_mpmd.append(time.perf_counter() - t)
            state = out[:2]
        with mesh.trace() as trace:
            dist(*state, batch)[2].block_until_ready()
        print(trace.summary())
    return statistics.median(t_jit), statistics.median(t_mpmd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hops", type=positive(int), default=400, help="hops in the timed chain (beyond the 1-hop chain subtracted)")
    p.add_argument("--bytes", type=positive(int), default=1024, help="bytes of the activation sent")
    p.add_argument("--rounds", type=positive(int), default=5, help="alternating rounds of hop and raw baseline")
    args = p.parse_args()  # (counts above 0, before any daemon: --hops 0 died in a ZeroDivisionError, --rounds 0 in a StatisticsError)
    # The hop and its baseline are measured round by round, alternating, and each round's ratio is taken: this
    # VM's speed drifts by 2x within minutes (raw ZeroMQ one-way 48-130 us in one hour), more than what is measured.
    # Both sides pinned alike: the actors to a core each (cpus_per_actor=1), the raw ping and echo to the same two
    # cores. Unpinned, this VM's raw one-way ran 26 us in one spell and 41-76 us in others (the two processes on one
    # core or on two), and the ratio followed it.
    # The baseline rides ipc:// (a Unix socket) as both routes measured do between local actors (the same-host link:
    # a Unix SEQPACKET socket; transport="tcp": ZeroMQ over ipc://); tcp:// loopback is printed beside it for reference.
    cores = pinned_cores()
    pinned = f"both pinned to cores {cores}" if cores else "unpinned"
    for transport, what in (("auto", "same-host link (kernel-authenticated, default)"), ("tcp", "ZeroMQ ipc, CURVE")):
        raws: dict[str, list[float]] = {"ipc": [], "tcp": []}
        hops = []
        with mpmd.RemoteMesh.local(num_actors=2, transport=transport, cpus_per_actor=1 if cores else None) as mesh:
            for _ in range(args.rounds):
                for over in raws:
                    raws[over].append(raw_one_way(args.bytes, n=500, cores=cores, over=over))
                base = chain_time(mesh, 1, args.bytes, reps=7)
                hops.append((chain_time(mesh, args.hops + 1, args.bytes, reps=7) - base) / args.hops)
        hop = statistics.median(hops)
        print(f"one hop of {args.bytes} B over {what}, actor to actor (send until usable on the next): {hop * 1e6:7.1f} us "
              f"(median of {args.rounds} rounds, alternating with the baselines; {pinned})")
        for over, label in (("ipc", "ipc:// (Unix socket, like for like)"), ("tcp", "tcp:// loopback (for reference)")):
            # Two ratios, as they differ: the ratio of the medians printed beside it, and the median of each round's
            # own ratio (hop / raw of the same round: the VM's drift between rounds cancels in it).
            raw = statistics.median(raws[over])
            ratios = [h / r for h, r in zip(hops, raws[over])]
            print(f"  vs raw ZeroMQ one-way over {label:35s} {raw * 1e6:6.1f} us: ratio of medians {hop / raw:5.2f}; "
                  f"median of the rounds' ratios {statistics.median(ratios):5.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    jit_t, mpmd_t = narrow_pipeline()
    print(f"narrow 16-stage MLP on 4 actors (interleaved 1F1B, 4 microbatches): {mpmd_t * 1e3:7.2f} ms per step vs jax.jit "
          f"{jit_t * 1e3:6.2f} ms ({mpmd_t / jit_t:5.1f}x)")


if __name__ == "__main__":
    main()
