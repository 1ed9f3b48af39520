"""NCCL data plane on real GPUs: two local GPU actors, one GPU each (NCCL refuses two ranks on one GPU).

Skipped without `cupy.cuda.nccl` (the `gpu` extra) or without two visible GPUs; run on a GPU machine with
`pytest -m gpu tests/test_nccl.py`.
"""

import itertools

import ml_dtypes
import numpy as np
import pytest

import mpmd
from tests.test_p2p import run_transfers

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs cupy with NCCL and two GPUs")


@pytest.fixture(scope="module")
def gpu_mesh():
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
