"""The examples a newcomer runs first, run the way they are shipped (shortened)."""

import importlib.util
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_quick_gpt_run_matches_jit_first_and_then_learns(tmp_path):
    pytest.importorskip("flax.nnx")
    gpt = load("gpt")
    plot = tmp_path / "loss.png"
    # --quick with fewer steps; train() asserts the first steps equal jax.jit's on the same inputs: losses, gradients
    # and AdamW's moments (not the parameters: AdamW turns the rounding noise of a zero gradient into +-lr)
    result = gpt.train(gpt.parse(["--quick", "--steps", "60", "--plot", str(plot)]))
    assert result["last"] < result["first"] - 1.0, result  # bytes: from ~4.5 nats to well under 3.5
    assert len(result["losses"]) == result["updates"] == 60  # the checked steps are the first of --steps (were 2 more)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 1000


def test_the_minimal_mlp_example_trains_and_matches_jit(capsys):
    load("train_mlp").main()
    assert "losses, gradients and Adam's moments of all 20 steps equal jax.jit's" in capsys.readouterr().out


@pytest.mark.slow
def test_the_gpt_example_resumes_a_checkpoint_of_4_actors_on_2(tmp_path):
    """--save on 4 actors (1F1B), --resume on 2 (interleaved: 2 stages each): restore places each array where the
    resumed step reads it (it refused before: "saved from actors [2], but this mesh has 2 actors"; a probe).
    And the resumed run goes on where the saved one stopped (its data and learning rate restarted from the first
    step before; a probe): 3 steps then 3 resumed give the losses of 6 steps in one run, to rounding."""
    pytest.importorskip("flax.nnx")
    gpt = load("gpt")
    small = ["--stages", "4", "--layers", "4", "--width", "32", "--steps", "6", "--check-steps", "0", "--plot", ""]
    whole = gpt.train(gpt.parse([*small, "--actors", "2", "--schedule", "InterleavedOneFOneB"]))
    saved = gpt.train(gpt.parse([*small, "--actors", "4", "--stop-after", "3", "--save", str(tmp_path / "ck")]))
    resumed = gpt.train(gpt.parse([*small, "--actors", "2", "--schedule", "InterleavedOneFOneB", "--resume", str(tmp_path / "ck")]))
    assert saved["updates"] == 3 and resumed["updates"] == 6 and len(resumed["losses"]) == 3
    np.testing.assert_allclose(saved["losses"] + resumed["losses"], whole["losses"], rtol=2e-5)


@pytest.mark.slow
def test_the_gpt_example_with_tensor_parallel_stages_matches_jit():
    """--tensor-parallel 2: each actor a (1, 2) mesh, attention heads and MLP split Megatron-style inside every
    stage; train() asserts its first steps equal jax.jit of the unsharded step on the same inputs: losses, gradients
    before the optimizer and AdamW's moments, to a tolerance relative to each tree's largest value (the tensor-parallel
    sums change the rounding; the key biases' true gradient is zero, so theirs is pure rounding noise)."""
    pytest.importorskip("flax.nnx")
    gpt = load("gpt")
    result = gpt.train(gpt.parse(["--quick", "--steps", "3", "--tensor-parallel", "2", "--plot", ""]))
    assert np.isfinite(result["last"]), result


@pytest.mark.slow
def test_the_async_actor_learner_example_learns_while_rollouts_overlap_training(capsys):
    """Small settings; run() asserts its learner's first step equals jax.jit's, then trains twice (rollout then
    train, and both at once in one event loop) and reports the overlap and the loop's largest stall."""
    result = load("async_actor_learner").main(["--iterations", "3", "--steps", "3", "--envs", "64", "--horizon", "16"])
    out = capsys.readouterr().out
    assert "the learner's pipeline step equals jax.jit's" in out and "largest stall" in out
    assert result["last_return"] > result["first_return"], result  # the policy approaches the expert
    assert result["speedup"] > 0 and result["largest_gap"] >= 0


@pytest.mark.parametrize("flags, said", [
    (["--stages", "3", "--layers", "6"], "runs on 3 actors: give --stages 2"),
    (["--schedule", "ZeroBubbleV", "--stages", "2"], r"num_stages must be 2 \* num_actors"),
    (["--schedule", "DualPipeV", "--microbatches", "2"], "needs at least 4 microbatches"),
    (["--schedule", "InterleavedOneFOneB", "--stages", "3", "--layers", "6"], "not a multiple of num_actors=2"),
])
def test_gpt_flags_a_schedule_cannot_run_stop_with_its_reason_before_any_actor_starts(flags, said):
    """They ended in a traceback of 10-20 frames once the actors had started (a newcomer probe)."""
    gpt = load("gpt")
    with pytest.raises(SystemExit, match=said):
        gpt.parse(flags)
    assert gpt.make_schedule("ZeroBubbleV", 2, 4).num_stages == 4  # (--stages reaches the V schedules too)


def test_gpt_output_names_that_cannot_be_written_stop_before_training(tmp_path, capsys):
    """`--save` naming a file, `--plot` naming a directory or a path under a file: each failed only once the run
    was over (and `--plot DIR` said it wrote DIR while matplotlib wrote DIR.png; a newcomer probe)."""
    gpt = load("gpt")
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for flags, said in ((["--save", str(a_file)], "is a file, not a directory"),
                        (["--plot", str(tmp_path)], r"name the picture with an ending matplotlib writes \(\.png, \.svg"),
                        (["--plot", str(a_file / "loss.png")], "is a file, not a directory"),
                        (["--save", str(a_file / "ckpt")], "is a file, not a directory")):
        with pytest.raises(SystemExit):
            gpt.parse(flags)
        assert re.search(said, capsys.readouterr().err), flags
    args = gpt.parse(["--save", str(tmp_path / "new" / "ckpt"), "--plot", str(tmp_path / "pics" / "loss.svg")])
    assert args.save.endswith("ckpt") and args.plot.endswith("loss.svg")
