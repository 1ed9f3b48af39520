"""Small models and training steps that benchmarks, examples and user tests share (not part of the
one-screen API). Everything here is an ordinary JAX program with stage markers.

    step = make_train_step(mse_loss(mlp), optax.adam(1e-3), mpmd.OneFOneB(2))
    params = mlp_params(np.random.default_rng(0), num_stages=2, width=512, layers_per_stage=4)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpmd.api import accumulate_grads, pipeline_yield


def make_train_step(loss_fn: Callable[[Any, Any], Any], optimizer: Any, schedule: Any) -> Callable[..., Any]:
    """`step(params, opt_state, batch) -> (params, opt_state, losses)`: per-microbatch value_and_grad summed
    by `accumulate_grads` under `schedule` (None: the plain loop, for jax.jit), then one optimizer update."""
    import optax

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        def mb_grads(mb: Any) -> Any:
            value, grads = jax.value_and_grad(loss_fn)(params, mb)
            return grads, value

        grads, losses = accumulate_grads(mb_grads, batch, schedule=schedule)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    return step


def mlp_params(rng: np.random.Generator, num_stages: int, width: int = 16,
               layers_per_stage: int | Sequence[int] = 1) -> list[list[np.ndarray]]:
    """Per stage, `layers_per_stage` square weight matrices (one count for all, or one per stage: uneven stages)."""
    counts = [layers_per_stage] * num_stages if isinstance(layers_per_stage, int) else list(layers_per_stage)
    if len(counts) != num_stages:
        raise ValueError(f"layers_per_stage gives {len(counts)} counts for {num_stages} stages")
    return [[(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(k)] for k in counts]


def mlp(params: list[list[Any]], x: Any) -> Any:
    """A tanh MLP, a stage marker after each stage's layers."""
    for s, layers in enumerate(params):
        for w in layers:
            x = jnp.tanh(x @ w)
        if s < len(params) - 1:
            x = pipeline_yield(x)
    return x


def mse_loss(model: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def loss(params: Any, mb: Any) -> Any:
        return jnp.mean((model(params, mb["x"]) - mb["y"]) ** 2)

    return loss


def regression_batch(rng: np.random.Generator, num_microbatches: int, microbatch_size: int, width: int) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((num_microbatches, microbatch_size, width)).astype(np.float32),
            "y": rng.standard_normal((num_microbatches, microbatch_size, width)).astype(np.float32)}


LOADED_LEAF_SHAPE = (4, 16, 32)  # (microbatches, rows, width) of `synthetic_regression_leaf`


def synthetic_regression_leaf(step: int, leaf: str) -> np.ndarray:
    """A data loader for `mpmd.loaded_by_actors` (tests and examples): leaf "x" or "y" of step `step`'s regression
    batch, float32 of `LOADED_LEAF_SHAPE`, the same wherever it is called."""
    seed = 2 * step + ("x", "y").index(leaf)
    return np.random.default_rng(seed).standard_normal(LOADED_LEAF_SHAPE).astype(np.float32)
