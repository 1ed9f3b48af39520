"""Control plane: ping latency and put/get throughput, each against raw ZeroMQ in the same run.

    python -m benchmarks.control_plane
"""

import statistics
import threading
import time

import numpy as np
import zmq

import mpmd

N_PING, SIZE = 2000, 64 * 1024 * 1024


def raw_ping(endpoint: str) -> float:
    """Median round trip of a synchronous DEALER/ROUTER echo with no framework around it."""
    ctx = zmq.Context.instance()
    srv = ctx.socket(zmq.ROUTER)
    srv.bind(endpoint)
    ep = srv.getsockopt_string(zmq.LAST_ENDPOINT)

    def echo():
        for _ in range(N_PING + 100):
            srv.send_multipart(srv.recv_multipart())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    cli = ctx.socket(zmq.DEALER)
    cli.connect(ep)
    times = []
    for i in range(N_PING + 100):
        t0 = time.perf_counter()
        cli.send(b"ping")
        cli.recv()
        if i >= 100:
            times.append(time.perf_counter() - t0)
    t.join()
    cli.close(0)
    srv.close(0)
    return statistics.median(times)


def raw_throughput(endpoint: str, payload: np.ndarray, reps: int = 5) -> float:
    """Bytes/s of a zero-copy send of `payload` to a receiver that takes it without copying."""
    ctx = zmq.Context.instance()
    rx = ctx.socket(zmq.PULL)
    rx.bind(endpoint)
    ep = rx.getsockopt_string(zmq.LAST_ENDPOINT)
    tx = ctx.socket(zmq.PUSH)
    tx.connect(ep)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        tx.send(payload, copy=False)
        rx.recv(copy=False)
        best = min(best, time.perf_counter() - t0)
    tx.close(0)
    rx.close(0)
    return payload.nbytes / best


def main() -> None:
    payload = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8)
    rows = []
    for kind in ("ipc", "tcp"):
        with mpmd.RemoteMesh.local(num_actors=1, address=kind, transport="none") as mesh:
            actor = mesh.actor(0)
            for _ in range(100):
                actor.ping()
            ping = statistics.median(actor.ping() for _ in range(N_PING))
            raw = raw_ping("ipc:///tmp/mpmd-bench-raw.sock" if kind == "ipc" else "tcp://127.0.0.1:*")
            put_t, get_t = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                r = actor.put(payload)
                put_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                r.to_numpy()
                get_t.append(time.perf_counter() - t0)
                r.delete()
            raw_bw = raw_throughput("ipc:///tmp/mpmd-bench-bw.sock" if kind == "ipc" else "tcp://127.0.0.1:*", payload)
            put_bw, get_bw = SIZE / min(put_t), SIZE / min(get_t)
            rows.append((kind, ping * 1e6, raw * 1e6, put_bw, get_bw, raw_bw))
    print(f"{'transport':>9} {'ping µs':>8} {'raw µs':>7} {'ratio':>6} | {'put GiB/s':>9} {'get GiB/s':>9} {'raw GiB/s':>9} {'put %':>6} {'get %':>6}")
    for kind, ping, raw, put_bw, get_bw, raw_bw in rows:
        g = 1024**3
        print(f"{kind:>9} {ping:8.0f} {raw:7.0f} {ping / raw:6.2f} | {put_bw / g:9.2f} {get_bw / g:9.2f} {raw_bw / g:9.2f} "
              f"{100 * put_bw / raw_bw:5.0f}% {100 * get_bw / raw_bw:5.0f}%")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
