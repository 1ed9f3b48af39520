"""The examples a newcomer runs first, run the way they are shipped (shortened)."""

import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_quick_gpt_run_matches_jit_first_and_then_learns(tmp_path):
    pytest.importorskip("flax.nnx")
    gpt = load("gpt")
    plot = tmp_path / "loss.png"
    # --quick with fewer steps; train() asserts the first steps equal jax.jit's on the same inputs: losses, gradients
    # and AdamW's moments (not the parameters: AdamW turns the rounding noise of a zero gradient into +-lr)
    result = gpt.train(gpt.parse(["--quick", "--steps", "60", "--plot", str(plot)]))
    assert result["last"] < result["first"] - 1.0, result  # bytes: from ~4.5 nats to well under 3.5
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 1000


def test_the_minimal_mlp_example_trains_and_matches_jit(capsys):
    load("train_mlp").main()
    assert "losses, gradients and Adam's moments of all 20 steps equal jax.jit's" in capsys.readouterr().out


def test_the_gpt_example_with_tensor_parallel_stages_matches_jit():
    """--tensor-parallel 2: each actor a (1, 2) mesh, attention heads and MLP split Megatron-style inside every
    stage; train() asserts its first steps equal jax.jit of the unsharded step on the same inputs: losses, gradients
    before the optimizer and AdamW's moments, to a tolerance relative to each tree's largest value (the tensor-parallel
    sums change the rounding; the key biases' true gradient is zero, so theirs is pure rounding noise)."""
    pytest.importorskip("flax.nnx")
    gpt = load("gpt")
    result = gpt.train(gpt.parse(["--quick", "--steps", "3", "--tensor-parallel", "2", "--plot", ""]))
    assert np.isfinite(result["last"]), result
