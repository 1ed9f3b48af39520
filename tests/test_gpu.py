"""Pipelines on a GPU: GPU actors sharing GPU 0 (activations through host memory, the shm route) against jax.jit.

Skipped without an NVIDIA GPU that jax can use (`nvidia-smi` and a jax CUDA plugin) — failed instead with
MPMD_REQUIRE_GPU=1; run on a GPU machine with `pytest -m gpu tests/test_gpu.py` (`benchmarks/gpu.sh` does). The NCCL route needs two GPUs: tests/test_nccl.py.
Every process (this one, for the jax.jit reference, and the actors) shares the GPU, so none preallocates; and fp32
matmuls run at full precision in all of them: XLA's default on a GPU rounds matmul operands to TF32, where a stage
compiled alone may pick other kernels than the whole step, so equal arithmetic needs the full precision. The steps
train with SGD: the kernels a stage's executable picks may still sum in another order than the whole step's (1 ulp),
and Adam's update of a gradient near 0 (m / (sqrt(v) + eps)) makes that a visible difference (one element of 4,096
was 1.4e-3 relative off after two Adam steps on one GPU actor, 2026-12-04), where SGD's stays a rounding.
"""

import importlib.util
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

import mpmd
from tests import models
from tests.test_p2p import run_transfers
from tests.test_pipeline import run_both

pytestmark = pytest.mark.gpu

CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


# Set (benchmarks/gpu.sh does, on a lent GPU machine): a missing GPU or CUDA backend fails these tests instead of
# skipping them (a skip read as a pass there; a review).
REQUIRE_GPU = os.environ.get("MPMD_REQUIRE_GPU") == "1"


def _why_no_cuda_jax() -> str | None:
    """Why there is no NVIDIA driver or jax CUDA plugin here, or None (checked without starting any jax backend)."""
    if shutil.which("nvidia-smi") is None:
        return "needs an NVIDIA GPU (no nvidia-smi here)"
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return None
        except (ImportError, ValueError):
            continue
    return "needs jax with CUDA (jax[cuda12] or jax[cuda13]): no jax CUDA plugin is installed"


NO_GPU = _why_no_cuda_jax()
needs_gpu = pytest.mark.skipif(NO_GPU is not None and not REQUIRE_GPU, reason=NO_GPU or "")


@pytest.fixture(scope="module")
def full_precision():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (the actors inherit it)
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        if NO_GPU is not None:  # (here only with MPMD_REQUIRE_GPU=1)
            pytest.fail(f"MPMD_REQUIRE_GPU=1 and this {NO_GPU}")
        try:
            jax.devices("gpu")
        except RuntimeError as e:  # e.g. JAX_PLATFORMS=cpu on a GPU machine (tests/conftest.py's default)
            (pytest.fail if REQUIRE_GPU else pytest.skip)(f"jax sees no GPU here: {e}")
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="module")
def one_gpu_mesh(full_precision):
    with mpmd.RemoteMesh.local(num_actors=2, platform="gpu", gpu_ids=(0,), transport="shm") as mesh:
        assert mesh.platform == "gpu" and set(mesh.routes.values()) == {"shm"}
        yield mesh


@needs_gpu
@pytest.mark.parametrize("schedule", [mpmd.GPipe(2), mpmd.OneFOneB(2), mpmd.ZeroBubbleH1(2)], ids=lambda s: type(s).__name__)
def test_two_gpu_actors_on_one_gpu_match_jit(one_gpu_mesh, schedule):
    rng = np.random.default_rng(0)
    params = models.mlp_params(rng, 2, width=64)
    batches = [models.regression_batch(rng, 4, 8, 64) for _ in range(3)]
    dist, dp = run_both(one_gpu_mesh, models.mse_loss(models.mlp), params, batches, schedule, optax.sgd(0.1))
    assert dp[0]["w"].actors == [0] and dp[1]["w"].actors == [1]


def one_actor_schedule(m):
    """Both stages on actor 0, one microbatch after another (as benchmarks/efficiency.py's 1-actor step)."""
    order = tuple(t for i in range(m) for t in (f"0F{i}", f"1F{i}", f"1B{i}", f"0B{i}"))
    return mpmd.Custom(num_stages=2, order=(order,), stage_actor=(0, 0))


@needs_gpu
def test_one_gpu_actor_runs_both_stages_like_jit(full_precision):
    rng = np.random.default_rng(1)
    params = models.mlp_params(rng, 2, width=64)
    batches = [models.regression_batch(rng, 4, 8, 64) for _ in range(2)]
    with mpmd.RemoteMesh.local(num_actors=1, platform="gpu") as mesh:
        run_both(mesh, models.mse_loss(models.mlp), params, batches, one_actor_schedule(4), optax.sgd(0.1))


@needs_gpu
def test_gpu_actors_move_arrays_between_them_exactly(one_gpu_mesh):
    rng = np.random.default_rng(2)
    pairs = []
    for i, dt in enumerate([np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.bool_]):
        for shape in [(), (0,), (17,), (4, 5, 6), (256, 1024)]:
            a = rng.random(shape) > 0.5 if dt == np.bool_ else (rng.standard_normal(shape) * 4).astype(dt)
            pairs.append((i % 2, 1 - i % 2, len(pairs), a))
    for (src, dst, tag, a), b in zip(pairs, run_transfers(one_gpu_mesh, pairs)):
        assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), (a.dtype, a.shape)
