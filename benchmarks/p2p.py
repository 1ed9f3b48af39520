"""Actor-to-actor transfer throughput (1-256 MiB) over the TCP data plane vs a raw ZeroMQ send of the
same bytes in the same run. The transfer is a Program of one Send and one Recv, run by the real
interpreter on two real daemons; its time includes the request round trip, so small sizes understate.

    python benchmarks/p2p.py
"""

import asyncio
import itertools
import time

import numpy as np

import mpmd
from benchmarks.control_plane import raw_throughput
from mpmd.program import Label, Program, Recv, Send
from transport.protocol import dtype_name

_ids = itertools.count(1)


def transfer_once(mesh, src_buf, nbytes):
    pid = next(_ids)
    send = Program(0, [0], [], [Send(0, 1, 0, Label("xfer"))])
    recv = Program(1, [], [0], [Recv(0, 0, 0, dtype_name(np.uint8), (nbytes,), Label("xfer"))])
    mesh.run(mesh.conn(0).request("load_program", {"program": send.encode(pid, [])}))
    mesh.run(mesh.conn(1).request("load_program", {"program": recv.encode(pid, [])}))
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


def main() -> None:
    with mpmd.RemoteMesh.local(num_actors=2) as mesh:
        print(f"{'size':>8} {'mpmd GiB/s':>10} {'raw GiB/s':>10} {'ratio':>6}")
        for mib in (1, 4, 16, 64, 256):
            n = mib * 1024 * 1024
            payload = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
            src = mesh.actor(0).put(payload)
            best = min(transfer_once(mesh, src.buffers[0], n) for _ in range(4))
            raw = raw_throughput("tcp://127.0.0.1:*", payload, reps=4)
            src.delete()
            print(f"{mib:>5} MiB {n / best / 2**30:10.2f} {raw / 2**30:10.2f} {raw and (n / best) / raw:6.2f}")


if __name__ == "__main__":
    main()
