"""Train a GPT-style decoder (flax nnx + optax) as a pipeline over local CPU actors.

    python examples/gpt.py --quick                       # about a minute on 2 cores: 2 actors, 1F1B
    python examples/gpt.py --actors 4 --stages 8 --schedule InterleavedOneFOneB --layers 8 --steps 300

Token and position embeddings, pre-LayerNorm causal self-attention blocks with an MLP, an LM head tied to
the token embedding; AdamW with a warm-up/cosine learning rate and global-norm clipping. The text is a
byte-level tokenisation of a corpus generated here (small stories from a fixed grammar: nothing is
downloaded). The first steps are checked against jax.jit of the same step; the loss curve is written to
--plot (examples/out/gpt_loss.png by default); the trained state is saved with mpmd.save and --resume
continues from it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import pathlib
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

import mpmd
from mpmd.cli.args import cannot_write

OUT = pathlib.Path(__file__).resolve().parent / "out"  # what the examples write (ignored by git)


# ---- data: a generated corpus, byte-level tokens ---------------------------------------------------------
def corpus(num_bytes: int, seed: int = 0) -> bytes:
    """Small stories from a fixed grammar: enough structure for a tiny model to learn quickly."""
    rng = np.random.default_rng(seed)
    names = ["anna", "ben", "cleo", "dev", "ella", "finn", "gus", "hana", "ivo", "jade"]
    animals = ["cat", "dog", "fox", "owl", "bee", "cow", "hen", "eel"]
    places = ["the garden", "the river", "the market", "the hill", "the old barn", "the forest"]
    verbs = ["saw", "fed", "chased", "found", "painted", "followed"]
    moods = ["happy", "tired", "curious", "brave", "quiet"]
    out, size = [], 0
    while size < num_bytes:
        n, a, p, v, m = (x[rng.integers(len(x))] for x in (names, animals, places, verbs, moods))
        k = int(rng.integers(2, 9))
        s = (f"{n} went to {p}. {n} {v} a {a} there. the {a} was {m}. "
             f"{n} counted {k} {a}s: " + " ".join(str(i) for i in range(1, k + 1)) + ".\n")
        out.append(s)
        size += len(s)
    return "".join(out).encode()[:num_bytes]


def batches(data: np.ndarray, microbatches: int, rows: int, seq: int, rng: np.random.Generator):
    """Endless [microbatches, rows, seq] token / target windows at random offsets."""
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=(microbatches, rows))
        idx = starts[..., None] + np.arange(seq + 1)
        win = data[idx].astype(np.int32)
        yield {"tokens": win[..., :-1], "targets": win[..., 1:]}


# ---- the model -------------------------------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int, stages: int, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, width)))
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(width, rngs=rngs)
        self.stages = stages

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        mask = nnx.make_causal_mask(tokens)
        per = len(self.blocks) // self.stages
        for i, block in enumerate(self.blocks):
            if i and i % per == 0:
                x = mpmd.pipeline_yield(x)  # the next stage starts here
            x = block(x, mask)
        return self.embed.attend(self.ln_f(x))  # LM head tied to the token embedding


def make_grad_step(graphdef: nnx.GraphDef, schedule: mpmd.Schedule | None):
    """`grad_step(params, batch) -> (grads, loss)`: the pipelined part of a step, before the optimizer: the
    gradients of the mean loss over the microbatches."""

    def loss_fn(params, mb):
        logits = nnx.merge(graphdef, params)(mb["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, mb["targets"]).mean()

    def grad_step(params, batch):
        def mb_grads(mb):
            loss, grads = jax.value_and_grad(loss_fn)(params, mb)
            return grads, loss

        grads, losses = mpmd.accumulate_grads(mb_grads, batch, schedule=schedule)
        m = losses.shape[0]
        grads = jax.tree.map(lambda g: g / m, grads)  # accumulate_grads sums; the loss is a mean over microbatches
        return grads, losses.mean()

    return grad_step


def make_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, schedule: mpmd.Schedule | None):
    grad_step = make_grad_step(graphdef, schedule)

    def step(params, opt_state, batch):
        grads, loss = grad_step(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def tensor_parallel_specs(params):
    """Megatron's layout inside each stage over the actor mesh's "model" axis: attention heads split (query, key,
    value column-parallel, the output projection row-parallel), the MLP's up projection column-parallel and its
    down projection row-parallel; everything else replicated."""
    from jax.sharding import PartitionSpec as P

    def spec(path, leaf):
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]  # not the Variable's .value
        last, layer = names[-1], (names[-2] if len(names) > 1 else "")
        if layer in ("query", "key", "value"):
            return P(None, "model", None) if last == "kernel" else P("model", None)
        if layer == "out" and last == "kernel":
            return P("model", None, None)
        if layer == "up":
            return P(None, "model") if last == "kernel" else P("model")
        if layer == "down" and last == "kernel":
            return P("model", None)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


SCHEDULES = ("GPipe", "OneFOneB", "EagerOneFOneB", "ZeroBubbleH1", "InterleavedOneFOneB", "InterleavedZeroBubble", "ZeroBubbleV",
             "DualPipeV")


def make_schedule(name: str, actors: int, stages: int) -> mpmd.Schedule:
    if name not in SCHEDULES:  # (Custom needs a table of its own: see examples/custom_schedule.py)
        raise SystemExit(f"--schedule {name!r} is not a built-in mpmd schedule; one of {', '.join(SCHEDULES)}")
    cls = getattr(mpmd, name)
    if name in ("ZeroBubbleV", "DualPipeV"):
        return cls(num_actors=actors, num_stages=stages)
    if name in ("InterleavedOneFOneB", "InterleavedZeroBubble"):
        return cls(num_stages=stages, num_actors=actors)
    return cls(num_stages=stages)


PICTURES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps", ".svgz", ".pgf")  # matplotlib's


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a one-minute run: at most 120 steps")
    p.add_argument("--actors", type=int, default=2, help="local actors (daemons), or daemons to wait for with --rendezvous (default %(default)s)")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: one per actor; 2 per actor for V and interleaved schedules)")
    p.add_argument("--schedule", default="OneFOneB", choices=SCHEDULES, metavar="NAME", help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default %(default)s)")
    p.add_argument("--rows", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default %(default)s)")
    p.add_argument("--width", type=int, default=64, help="model width (default %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (the width must be a multiple) (default %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="training steps (the checked ones included) (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warm-up, then cosine decay) (default %(default)s)")
    p.add_argument("--check-steps", type=int, default=2, help="steps checked against jax.jit first")
    p.add_argument("--plot", default=str(OUT / "gpt_loss.png"), help="where to write the loss curve (.png); '' for none")
    p.add_argument("--save", default=None, help="save the trained state here (a directory)")
    p.add_argument("--resume", default=None, help="go on from the state saved here: its data and learning rate pick up at the "
                   "step it was saved at, up to --steps in all (on any actor count or schedule)")
    p.add_argument("--stop-after", type=int, default=None, help="train this many of the --steps steps, then stop (and --save): "
                   "a run that --resume finishes later")
    p.add_argument("--tensor-parallel", type=int, default=1, help="devices per actor for tensor parallelism inside each stage")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the data and their order (default %(default)s)")
    p.add_argument("--rendezvous", default=None, metavar="DIR|tcp://HOST:PORT",
                   help="attach to --actors daemons announced there (srun mpmd-actor --slurm --rendezvous DIR ...) instead of "
                        "starting local ones")
    p.add_argument("--keys", default=None, help="with --rendezvous: the key directory the daemons' --authorized-keys names")
    p.add_argument("--ray", action="store_true", help="start the --actors daemons through Ray (ray.init(address='auto') "
                                                        "on a Ray cluster, else a local Ray)")
    args = p.parse_args(argv)
    for flag in ("actors", "microbatches", "rows", "seq", "layers", "width", "heads", "steps", "tensor_parallel"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.check_steps < 0:
        p.error(f"--check-steps must be 0 or more, got {args.check_steps}")
    if args.stop_after is not None and args.stop_after < 1:
        p.error(f"--stop-after must be at least 1, got {args.stop_after}")
    if args.width % args.heads:
        p.error(f"--width {args.width} must be a multiple of --heads {args.heads} (each head gets width / heads features)")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in PICTURES:
        p.error(f"--plot {args.plot}: name the picture with an ending matplotlib writes ({', '.join(PICTURES)})")
    for flag, path, directory in (("--plot", args.plot, False), ("--save", args.save, True)):
        why = cannot_write(path, directory, parents=True) if path else None
        if why:  # (said before training: an unwritable name failed once the run was over; a probe)
            p.error(f"{flag} {path}: {why}")
    if args.quick:
        args.steps = min(args.steps, 120)
    # (the checked steps are the first of the --steps trained, and of the --stop-after ones)
    args.check_steps = min(args.check_steps, args.steps, args.stop_after or args.steps)
    if args.stages is None:
        args.stages = 2 * args.actors if args.schedule in ("ZeroBubbleV", "DualPipeV", "InterleavedOneFOneB", "InterleavedZeroBubble") else args.actors
    batch_bytes = 2 * 4 * args.microbatches * args.rows * args.seq  # int32 tokens and targets of one step
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if batch_bytes > memory // 8:
        raise SystemExit(f"--microbatches {args.microbatches} x --rows {args.rows} x --seq {args.seq} makes a {batch_bytes / 2**30:.1f} GiB "
                         f"batch per step, over an eighth of this machine's {memory / 2**30:.0f} GiB: use fewer microbatches or rows")
    if args.heads % args.tensor_parallel:
        raise SystemExit(f"--heads {args.heads} must be a multiple of --tensor-parallel {args.tensor_parallel}")
    if args.layers % args.stages:
        raise SystemExit(f"--layers {args.layers} must be a multiple of --stages {args.stages}")
    try:  # the schedule's own checks, as flag errors: stages per actor, the fewest microbatches it runs
        schedule = make_schedule(args.schedule, args.actors, args.stages)
        if schedule.num_actors != args.actors:
            raise mpmd.ScheduleError(f"{schedule} runs on {schedule.num_actors} actors: give --stages {args.actors} (one per actor) "
                                     f"with --actors {args.actors}, or --actors {schedule.num_actors}")
        mpmd.validate(schedule, args.microbatches)
    except (mpmd.ScheduleError, ValueError) as e:
        raise SystemExit(f"--schedule {args.schedule} --stages {args.stages} --actors {args.actors} --microbatches "
                         f"{args.microbatches}: {e}") from None
    return args


# The pipeline sums the same float32 terms as jax.jit in another order (microbatch by microbatch on each stage,
# tensor-parallel partial sums across devices), so the two agree to rounding error, about float32's epsilon
# (1.2e-7) times the square root of the number of terms (~2e3 tokens a step, so ~5e-6) times the largest term.
# The tolerance leaves a factor of 20 over that; a wrong gradient (a missing microbatch, a cotangent sent to the
# wrong stage, a tensor-parallel sum left out) is wrong by a sizeable fraction of the gradient itself.
CHECK_RTOL = 1e-4


def assert_close(got, want, what: str, rtol: float = CHECK_RTOL) -> None:
    """`got` equals `want` leaf by leaf to `rtol` of the largest magnitude in all of `want`.

    The scale is the tree's and not each element's: rounding error follows the largest terms summed, and a value
    that is exactly zero in exact arithmetic comes out as rounding noise of either sign. The GPT has one: the
    attention's key bias, whose gradient is zero (softmax ignores a shift shared by every key); per element,
    its noise would be compared with noise."""
    got_leaves, want_leaves = jax.tree.leaves(got), [np.asarray(w) for w in jax.tree.leaves(want)]
    assert len(got_leaves) == len(want_leaves), (what, len(got_leaves), len(want_leaves))
    scale = max((float(np.max(np.abs(w))) for w in want_leaves if w.size), default=0.0)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * scale, err_msg=f"{what}, leaf {i}")


def check_against_jit(args, graphdef, optimizer, schedule, mesh, step, params, opt_state, stream, shardings):
    """The first --check-steps steps, each compared with jax.jit of the same functions on the same inputs.

    Compared: the step's loss, its gradients before the optimizer, and AdamW's moments after the update (running
    sums of the clipped gradients and of their squares). Not the parameters: AdamW divides the first moment by
    the root of the second, so a gradient that is pure rounding noise (the key bias's, see assert_close) moves
    its parameter by about the learning rate with the noise's sign, which differs from jax.jit's.

    These are training steps: returns the state after them and their losses, which count toward --steps."""
    grad_step = mpmd.distributed(make_grad_step(graphdef, schedule), mesh=mesh, in_shardings=shardings and (shardings[0], None))
    ref_grad_step = jax.jit(make_grad_step(graphdef, None))
    ref_step = jax.jit(make_step(graphdef, optimizer, None))
    losses = []
    for i in range(args.check_steps):
        batch = next(stream)
        host_params, host_opt_state = mpmd.fetch((params, opt_state)) if i else (params, opt_state)
        grads, loss = mpmd.fetch(grad_step(host_params, batch))
        ref_grads, ref_loss = ref_grad_step(host_params, batch)
        assert_close(loss, ref_loss, f"step {i}'s loss")
        assert_close(grads, ref_grads, f"step {i}'s gradients")
        params, opt_state, loss = step(params, opt_state, batch)
        _, ref_opt_state, ref_loss = ref_step(host_params, host_opt_state, batch)
        losses.append(float(mpmd.fetch(loss)))
        assert_close(losses[-1], ref_loss, f"step {i}'s loss (the training step)")
        got_opt_state = mpmd.fetch(opt_state)
        for moment in ("mu", "nu"):
            assert_close(optax.tree_utils.tree_get(got_opt_state, moment), optax.tree_utils.tree_get(ref_opt_state, moment),
                         f"AdamW's {moment} after step {i}")
    print(f"the first {args.check_steps} steps equal jax.jit's (losses, gradients, AdamW's moments)", flush=True)
    return params, opt_state, losses


def open_mesh(args: argparse.Namespace) -> mpmd.RemoteMesh:
    """Local daemons by default; daemons a cluster started (SLURM, Kubernetes) through a rendezvous; or Ray's.
    With --tensor-parallel k each actor is a (1, k) device mesh over ("data", "model")."""
    tp = {"mesh_shape": (1, args.tensor_parallel), "axis_names": ("data", "model")} if args.tensor_parallel > 1 else {}
    if args.rendezvous:
        return mpmd.RemoteMesh.from_rendezvous(args.rendezvous, args.actors, keys=args.keys, timeout=600, **tp)
    if args.ray:
        import ray

        ray.init(address="auto" if os.environ.get("RAY_ADDRESS") else None)
        return mpmd.RemoteMesh.ray(args.actors, devices_per_actor=args.tensor_parallel, **tp)
    return mpmd.RemoteMesh.local(num_actors=args.actors, devices_per_actor=args.tensor_parallel, **tp)


def updates_of(opt_state) -> int:
    """The optimizer steps taken (AdamW's count and its schedule's)."""
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return max(int(mpmd.fetch(count)) for _, count in counts)


def train(args: argparse.Namespace) -> dict[str, float]:
    from tqdm import tqdm

    vocab = 256
    data = np.frombuffer(corpus(2 << 20, args.seed), np.uint8)
    model = GPT(vocab, args.width, args.layers, args.heads, args.seq, args.stages, nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(20, args.steps // 5 + 1), max(args.steps, 2), args.lr / 10)
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)  # no weight decay on LayerNorm scales and biases
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.1, mask=decay_mask))
    schedule = make_schedule(args.schedule, args.actors, args.stages)
    opt_state = optimizer.init(params)
    stream = batches(data, args.microbatches, args.rows, args.seq, np.random.default_rng(args.seed + 1))
    tokens_per_step = args.microbatches * args.rows * args.seq
    with open_mesh(args) as mesh:
        shardings = (tensor_parallel_specs(params), None, None) if args.tensor_parallel > 1 else None
        step = mpmd.distributed(make_step(graphdef, optimizer, schedule), mesh=mesh, in_shardings=shardings)
        if args.resume:  # onto this mesh as the step reads it: a checkpoint of another actor count or schedule too
            sample = next(stream)
            stream = itertools.chain([sample], stream)
            step.compile(params, opt_state, sample)
            params, opt_state = mpmd.restore(args.resume, mesh, like=(params, opt_state), for_step=step)
            done = updates_of(opt_state)  # the steps it had taken: the same batches are skipped, the schedule goes on
            for _ in range(done):
                next(stream)
        else:
            done = 0
        losses: list[float] = []
        if args.check_steps and not args.resume:  # (these are the first of the --steps steps)
            params, opt_state, losses = check_against_jit(args, graphdef, optimizer, schedule, mesh, step, params, opt_state, stream,
                                                          shardings)
        checked = len(losses)
        end = min(args.steps, done + args.stop_after) if args.stop_after is not None else args.steps
        t0 = time.perf_counter()
        bar = tqdm(range(done + checked, end), desc=f"{args.schedule} on {args.actors} actor{'s' if args.actors != 1 else ''}", file=sys.stdout,
                   mininterval=0.5, initial=done + checked, total=args.steps)
        pending = []
        for i in bar:
            params, opt_state, loss = step(params, opt_state, next(stream))
            pending.append(loss)
            if len(pending) >= 5 or i == end - 1:  # fetch the loss every few steps: dispatch never waits
                for value in mpmd.fetch(pending):
                    losses.append(float(value))
                pending = []
                dt = (time.perf_counter() - t0) / (len(losses) - checked)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", step_ms=f"{dt * 1e3:.1f}")
        bar.close()
        updates = updates_of(opt_state)
        if args.save:
            mpmd.save(args.save, (params, opt_state))
            print(f"saved the trained state to {args.save}")
    if not losses:
        print(f"nothing to train: the state had taken {updates} of --steps {args.steps} steps")
        return {"first": math.nan, "last": math.nan, "losses": losses, "updates": updates}
    k = max(1, min(5, len(losses) // 2))  # (first and last k steps, apart)
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    print(f"loss {first:.3f} -> {last:.3f} (means of the first and last {k} steps) over {len(losses)} steps "
          f"({math.log(vocab):.3f} is uniform over bytes)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(losses)
        ax.set(xlabel="step", ylabel="loss", title=f"GPT, {args.schedule}, {args.actors} actors")
        fig.tight_layout()
        pathlib.Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=100)
        print(f"loss curve written to {args.plot}")
    return {"first": first, "last": last, "losses": losses, "updates": updates}


if __name__ == "__main__":
    try:
        train(parse())
    except mpmd.CheckpointError as e:  # (--resume of a missing or other-shaped checkpoint: the message is the answer)
        raise SystemExit(f"examples/gpt.py: {e}") from None
