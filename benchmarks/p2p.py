"""Actor-to-actor transfer throughput, 1-256 MiB, per data-plane route, against a baseline measured in the
same run: a raw ZeroMQ send of the same bytes for ``tcp``, a numpy copy (memcpy) of the same bytes for
``shm``. A transfer is a Program of Sends on actor 0 and Recvs on actor 1, run by the real interpreter on two
real daemons, until the received array is a JAX array on actor 1.

``one``: one transfer per program, so the time includes the run_program request round trip.
``x8``: eight transfers of the array in one program (how a pipeline step moves data), time per transfer.

    python -m benchmarks.p2p [--sizes 1,16,64] [--routes tcp,shm]
"""

import argparse
import asyncio
import itertools
import os
import time

import numpy as np

import mpmd
from benchmarks.control_plane import raw_throughput
from mpmd.cli.args import positive
from mpmd.compiler.program import Label, Program, Recv, Send
from transport.protocol import dtype_name

_ids = itertools.count(1)


def transfer_time(mesh, src_buf: int, nbytes: int, count: int) -> float:
    """Seconds per transfer when `count` transfers of buffer `src_buf` go from actor 0 to actor 1 in one program."""
    pid = next(_ids)
    send = Program(0, [0], [], [Send(0, 1, t, Label("xfer")) for t in range(count)])
    recv = Program(1, [], list(range(count)), [Recv(t, 0, t, dtype_name(np.uint8), (nbytes,), Label("xfer")) for t in range(count)])
    mesh.run(mesh.executables.load_program(0, send, pid, []))
    mesh.run(mesh.executables.load_program(1, recv, pid, []))
    outs = [mesh.new_buffer_id() for _ in range(count)]

    async def go():
        await asyncio.gather(
            mesh.conn(0).request("run_program", {"program": pid, "step": 0, "inputs": [src_buf], "outputs": []}),
            mesh.conn(1).request("run_program", {"program": pid, "step": 0, "inputs": [], "outputs": outs}))

    t = time.perf_counter()
    mesh.run(go())
    dt = time.perf_counter() - t
    mesh.run(mesh.conn(1).request("delete", {"bufs": outs}))
    return dt / count


def memcpy_throughput(payload: np.ndarray, reps: int = 4) -> float:
    dst = np.empty_like(payload)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, payload)
        best = min(best, time.perf_counter() - t)
    return payload.nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64,256", help="MiB, comma-separated")
    ap.add_argument("--routes", default="tcp,shm", help="tcp and/or shm, comma-separated")
    ap.add_argument("--reps", type=positive(int), default=3, help="transfers timed per size (the best is kept)")
    args = ap.parse_args()
    # (checked before any daemon: --sizes x died in a ValueError's traceback, --reps 0 in a min() of nothing)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes takes whole MiB of at least 1, separated by commas (e.g. 1,16,64), got {args.sizes!r}")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if max(sizes) * 2**20 * 10 > memory:  # the payload here, its copy on actor 0, the x8 transfer's eight on actor 1
        ap.error(f"--sizes {max(sizes)}: ten copies of {max(sizes)} MiB are held at once, over this machine's {memory / 2**30:.0f} GiB")
    routes = args.routes.split(",")
    if not set(routes) <= {"tcp", "shm"}:
        ap.error(f"--routes takes tcp and/or shm, separated by commas, got {args.routes!r}")
    print(f"{'route':>5} {'size':>8} {'one GiB/s':>9} {'x8 GiB/s':>9} {'base GiB/s':>10} {'one/base':>8} {'x8/base':>7}  baseline")
    for route in dict.fromkeys(routes):  # (a route named twice runs once)
        with mpmd.RemoteMesh.local(num_actors=2, transport=route) as mesh:
            for mib in sizes:
                n = mib * 1024 * 1024
                payload = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
                src = mesh.actor(0).put(payload)
                one = min(transfer_time(mesh, src.buffers[0], n, 1) for _ in range(args.reps))
                many = min(transfer_time(mesh, src.buffers[0], n, 8) for _ in range(max(1, args.reps - 1)))
                src.delete()
                if route == "tcp":
                    base, what = raw_throughput("tcp://127.0.0.1:*", payload, reps=args.reps + 1), "raw zmq tcp"
                else:
                    base, what = memcpy_throughput(payload), "memcpy"
                g = 2**30
                print(f"{route:>5} {mib:>4} MiB {n / one / g:9.2f} {n / many / g:9.2f} {base / g:10.2f} "
                      f"{n / one / base:8.2f} {n / many / base:7.2f}  {what}", flush=True)


if __name__ == "__main__":
    main()
