"""NCCL data plane on real GPUs: two local GPU actors, one GPU each (NCCL refuses two ranks on one GPU), and — on
NCCL >= 2.30, which allows it with NCCL_MULTI_RANK_GPU_ENABLE=1 — two actors on GPU 0, so that a one-GPU machine runs
the route too.

Skipped without cupy, without its NCCL library, or without the GPUs a test needs, each with its reason; with
MPMD_REQUIRE_GPU=1 (benchmarks/gpu.sh) a missing cupy, NCCL or GPU fails instead (too few GPUs still skips). Run on a
GPU machine with `pytest -m gpu tests/test_nccl.py`.
"""

import itertools
import os

import ml_dtypes
import numpy as np
import pytest

import mpmd
from tests.test_p2p import run_transfers

pytestmark = pytest.mark.gpu

REQUIRE_GPU = os.environ.get("MPMD_REQUIRE_GPU") == "1"


def _nccl_here() -> tuple[int, int, str | None]:
    """(visible GPUs, NCCL version as nccl.get_version() gives it, why NCCL cannot run here or None)."""
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:
        return 0, 0, f"needs cupy (the 'gpu' extra): {e}"
    if not getattr(nccl, "available", False):  # (cupy imports without libnccl and says so here)
        return 0, 0, "needs NCCL: cupy finds no libnccl (the nvidia-nccl-cu12 wheel)"
    try:
        return cupy.cuda.runtime.getDeviceCount(), int(nccl.get_version()), None
    except Exception as e:
        return 0, 0, f"needs a CUDA GPU: {e}"


GPUS, NCCL_VERSION, NO_NCCL = _nccl_here()


def need(gpus: int, nccl_version: int = 0) -> None:
    """Skip (or, with MPMD_REQUIRE_GPU=1, fail where cupy, NCCL or any GPU is missing) unless this machine has `gpus`
    GPUs and NCCL >= `nccl_version`."""
    if NO_NCCL is not None or GPUS == 0:
        (pytest.fail if REQUIRE_GPU else pytest.skip)(NO_NCCL or "needs a CUDA GPU: cupy sees none")
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} GPUs, {GPUS} here")
    if NCCL_VERSION < nccl_version:
        pytest.skip(f"needs NCCL >= {nccl_version // 10000}.{nccl_version // 100 % 100}, {NCCL_VERSION} here")


needs_two_gpus = pytest.mark.usefixtures("two_gpus")


@pytest.fixture(scope="module")
def two_gpus():
    need(2)


@pytest.fixture(scope="module")
def gpu_mesh(two_gpus):
    with mpmd.RemoteMesh.local(num_actors=2, platform="gpu", transport="nccl") as mesh:
        assert set(mesh.routes.values()) == {"nccl"} and mesh.platform == "gpu"
        yield mesh


@needs_two_gpus
def test_nccl_transfers_are_exact_for_many_dtypes_and_shapes(gpu_mesh):
    rng = np.random.default_rng(0)
    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int8, np.int32, np.bool_]
    shapes = [(), (0,), (1,), (17,), (4, 5, 6), (512, 1024)]
    pairs = []
    for i, (dt, shape) in enumerate(itertools.product(dtypes, shapes)):
        a = (rng.standard_normal(shape) * 4).astype(dt) if dt != np.bool_ else rng.random(shape) > 0.5
        pairs.append((i % 2, 1 - i % 2, i, a))
    for (src, dst, tag, a), b in zip(pairs, run_transfers(gpu_mesh, pairs)):
        assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), (a.dtype, a.shape)


@needs_two_gpus
def test_nccl_many_concurrent_transfers_both_ways_out_of_order(gpu_mesh):
    rng = np.random.default_rng(1)
    tags = rng.permutation(100).tolist()
    pairs = [(t % 2, 1 - t % 2, t, rng.standard_normal((t % 7 + 1, 4096)).astype(np.float32)) for t in tags]
    for (src, dst, tag, a), b in zip(pairs, run_transfers(gpu_mesh, pairs)):
        np.testing.assert_array_equal(b, a)


@needs_two_gpus
def test_a_pipeline_on_gpu_actors_matches_jit(gpu_mesh):
    from tests import models
    from tests.test_pipeline import run_both

    rng = np.random.default_rng(2)
    params = models.mlp_params(rng, 2)
    batches = [models.regression_batch(rng, 4, 2, 16) for _ in range(2)]
    run_both(gpu_mesh, models.mse_loss(models.mlp), params, batches, mpmd.OneFOneB(2))


def test_nccl_between_two_actors_on_one_gpu(monkeypatch):
    """The route on a one-GPU machine: NCCL >= 2.30 lets two ranks share a GPU with NCCL_MULTI_RANK_GPU_ENABLE=1
    (the actors inherit it, and their endpoints say so: the wiring refuses a shared GPU otherwise)."""
    need(1, nccl_version=23000)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (two actors on one GPU)
    rng = np.random.default_rng(3)
    pairs = []
    for i, (dt, shape) in enumerate(itertools.product([np.float32, ml_dtypes.bfloat16, np.int8], [(), (0,), (17,), (256, 1024)])):
        pairs.append((i % 2, 1 - i % 2, i, (rng.standard_normal(shape) * 4).astype(dt)))
    with mpmd.RemoteMesh.local(num_actors=2, platform="gpu", gpu_ids=(0,), transport="nccl") as mesh:
        assert set(mesh.routes.values()) == {"nccl"}
        for (src, dst, tag, a), b in zip(pairs, run_transfers(mesh, pairs)):
            assert b.dtype == a.dtype and b.shape == a.shape and b.tobytes() == a.tobytes(), (a.dtype, a.shape)
