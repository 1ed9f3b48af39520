"""What verifying a checkpoint costs: `mpmd.restore` (two real daemons, each holding `--mib` MiB in 4 arrays)
and `mpmd.load` (the controller alone), with every byte verified (the default) against `verify=False`, which
skips the SHA-256 of the files and arrays but keeps the manifest's own digest and the dtype/shape checks.
Runs alternate, A B A B, so the machine's noise falls on both; the figures are the ratios of medians and of
bests (target: restore <= 1.2x). Also the save, whose digests are always taken.

    python -m benchmarks.checkpoint [--mib 64] [--repeats 5]
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

import mpmd


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB each actor holds")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = args.mib * 2**20 // 4 // 4  # float32 elements per array, 4 arrays per actor
    host = [[rng.standard_normal(n, dtype=np.float32) for _ in range(4)] for _ in range(2)]
    root = tempfile.mkdtemp(prefix="mpmd-bench-ckpt-")
    try:
        with mpmd.RemoteMesh.local(num_actors=2) as mesh:
            tree = [[mesh.actor(a).put(x) for x in host[a]] for a in range(2)]
            like = [[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in row] for row in host]
            path = os.path.join(root, "ckpt")
            save_s = timed(lambda: mpmd.save(path, tree))
            times: dict[str, list[float]] = {"restore verified": [], "restore unverified": [], "load verified": [],
                                             "load unverified": []}

            def restore(verify: bool) -> None:
                got = mpmd.restore(path, mesh, like=like, verify=verify)
                for row in got:
                    for x in row:
                        x.block_until_ready()
                        x.delete()

            restore(True)  # warm: page cache, orbax imports on the actors
            for _ in range(args.repeats):
                times["restore unverified"].append(timed(lambda: restore(False)))
                times["restore verified"].append(timed(lambda: restore(True)))
                times["load unverified"].append(timed(lambda: mpmd.load(path, verify=False)))
                times["load verified"].append(timed(lambda: mpmd.load(path, verify=True)))
        total = 2 * args.mib
        print(f"checkpoint of {total} MiB (2 actors x {args.mib} MiB, 4 arrays each); save {save_s:.2f} s (digests included)")
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"  {k:20s} median {v:6.3f} s   ({total / v:6.0f} MiB/s; runs {', '.join(f'{t:.3f}' for t in times[k])})")
        best = {k: min(v) for k, v in times.items()}
        print(f"verification cost: restore {med['restore verified'] / med['restore unverified']:.2f}x of medians "
              f"({best['restore verified'] / best['restore unverified']:.2f}x of bests), load "
              f"{med['load verified'] / med['load unverified']:.2f}x ({best['load verified'] / best['load unverified']:.2f}x) "
              "(target: restore <= 1.2x)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
