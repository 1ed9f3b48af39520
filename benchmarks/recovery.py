"""What transparent recovery (mpmd.Recovery) costs, on the GPT of examples/gpt.py (2 local actors, 1F1B):

* steady state: step time with snapshots every 10 steps vs without, on the same mesh and actors, in
  interleaved blocks (a ratio; target <= 1.05);
* a lost actor: time from SIGKILL to the next completed step, and where it goes — detection (kill to the
  start of the recovery), spawn (the replacement daemon up and connected, data plane rewired), reload
  (programs shipped and compiled there: the persistent compilation cache is warm after the first run),
  restore (the snapshot put back on every actor), replay (the logged steps since the snapshot), and the rest
  (the interrupted step itself finishing).

    python -m benchmarks.recovery [--blocks 6] [--block-steps 20]

Measured 2026-12-01 on the shared 2-core machine (GPT width 64, 4 layers, 2.5 MiB of state, ~95-140 ms/step):
* load ~3: ratio 1.052 (median of 8 ABBA pairs; blocks vary +-8%); recovery 5.3 s from SIGKILL to the next
  completed step: detection 0.05, spawn 1.9, reload 2.4, restore 0.07, replay of 6 steps 0.9 s.
* load ~13 (six other engineers' tests): ratio 0.97-1.18 between runs (noise of +-15% per block); recovery
  10.8-20.8 s, spawn 3.9-5.9 s and reload 5-10 s: a new daemon's import of JAX and its compile checker's
  (actors/sandbox.py: a child process that imports JAX before it checks the first blob) take the time;
  XLA itself loads from the persistent compilation cache.
The log's own cost on the controller: ~0.3 ms of CPU per call for this 200-leaf state (2-6 ms of wall time
when the controller's thread waits for the GIL); the snapshot's is the copy of its bytes, in the background.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import numpy as np
import optax
from flax import nnx

import mpmd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPT, batches, corpus, make_step  # noqa: E402


def setup(width: int = 64, layers: int = 4, seq: int = 64):
    data = np.frombuffer(corpus(1 << 20), np.uint8)
    model = GPT(256, width, layers, 4, seq, 2, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optax.adamw(1e-3)
    step = make_step(graphdef, optimizer, mpmd.OneFOneB(num_stages=2))
    return step, params, optimizer.init(params), batches(data, 4, 8, seq, np.random.default_rng(1))


def run_block(dist, state, stream, steps: int) -> tuple[float, tuple]:
    """Seconds per step over `steps` steps, fetching the loss every 5 steps (as examples/gpt.py does)."""
    p, o = state
    pending = []
    t = time.perf_counter()
    for i in range(steps):
        p, o, loss = dist(p, o, next(stream))
        pending.append(loss)
        if len(pending) == 5 or i == steps - 1:
            mpmd.fetch(pending)
            pending = []
    return (time.perf_counter() - t) / steps, (p, o)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=6, help="pairs of blocks with and without snapshots")
    ap.add_argument("--block-steps", type=int, default=20)
    ap.add_argument("--snapshot-every", type=int, default=10)
    args = ap.parse_args(argv)
    for flag in ("blocks", "block_steps", "snapshot_every"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    step, params, opt_state, stream = setup()
    with mpmd.RemoteMesh.local(num_actors=2, recover=mpmd.Recovery(snapshot_every=args.snapshot_every)) as mesh:
        dist = mpmd.distributed(step, mesh=mesh)
        manager = mesh.recovery
        state = (params, opt_state)
        _, state = run_block(dist, state, stream, 10)  # compile and warm up
        with_s, without_s, ratios = [], [], []
        for b in range(args.blocks):  # ABBA order: drift in the machine's load falls on both alike
            pair = {}
            for snapshots in ((False, True) if b % 2 == 0 else (True, False)):
                mesh.recovery = manager if snapshots else None
                pair[snapshots], state = run_block(dist, state, stream, args.block_steps)
            mesh.recovery = manager
            without_s.append(pair[False])
            with_s.append(pair[True])
            ratios.append(pair[True] / pair[False])
        ratio = statistics.median(ratios)
        calls = [manager.call_seconds, manager.calls]
        print("per block (ms/step) without:", " ".join(f"{t * 1e3:.0f}" for t in without_s), " with:",
              " ".join(f"{t * 1e3:.0f}" for t in with_s))
        nbytes = sum(np.asarray(x).nbytes for x in __import__("jax").tree.leaves(mpmd.fetch(state)))
        print(f"steady state: {statistics.median(without_s) * 1e3:.1f} ms/step without snapshots, "
              f"{statistics.median(with_s) * 1e3:.1f} ms/step with one every {args.snapshot_every} steps "
              f"({nbytes / 2**20:.1f} MiB of state): ratio {ratio:.3f} (median of {len(ratios)} pairs); the log and snapshot "
              f"bookkeeping cost {calls[0] / max(calls[1], 1) * 1e3:.2f} ms per call on the controller")

        # A lost actor: kill actor 1 while a step runs, time until that step's loss arrives.
        p, o = state
        for _ in range(args.snapshot_every // 2):  # halfway between snapshots: that many steps to replay
            p, o, _ = dist(p, o, next(stream))
        mpmd.fetch(o)
        p, o, loss = dist(p, o, next(stream))
        t0 = time.monotonic()
        os.kill(mesh.processes[1].proc.pid, signal.SIGKILL)
        loss.to_numpy()
        total = time.monotonic() - t0
        r = manager.last_report
        parts = {"detection": r["started"] - t0, **{k: r[k] for k in ("drain", "spawn", "reload", "restore", "replay")}}
        parts["rest"] = total - sum(parts.values())
        print(f"recovery: {total:.1f} s from SIGKILL to the next completed step ({mesh.recoveries} recovery, "
              f"{r['steps replayed']} steps replayed): " + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()))


if __name__ == "__main__":
    main()
