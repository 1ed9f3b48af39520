#!/usr/bin/env bash
# One-shot GPU check for a lent GPU machine (<= 10 minutes): the GPU tests (pipelines on GPU actors against
# jax.jit; real NCCL where two GPUs exist), benchmarks/gpu.py's figures, and a CPU smoke of the compiler on this
# machine's jax; every figure and log goes under $OUT.
#     OUT=/tmp/out bash benchmarks/gpu.sh
# Two ways to get the packages:
# * online: a fresh venv with the GPU extra matching the CUDA driver and jax[cudaN];
# * offline (the lent machines reach no registry): python3 already holds jax with CUDA, cupy and NCCL; what it
#   lacks (pyzmq, pytest-asyncio) comes as wheels in .whl/, made beforehand on a machine with pip:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pyzmq pytest-asyncio
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi || { echo "no GPU here (nvidia-smi failed)"; exit 1; }
if compgen -G ".whl/*.whl" > /dev/null; then
    PY=python3
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mpmd-site .whl/*.whl \
        || { mkdir -p /tmp/mpmd-site && for w in .whl/*.whl; do $PY -m zipfile -e "$w" /tmp/mpmd-site; done; }
    export PYTHONPATH="$PWD:/tmp/mpmd-site${PYTHONPATH:+:$PYTHONPATH}"
else
    cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
    extra=gpu; [ "${cuda_major:-12}" -ge 13 ] && extra=gpu-cuda13
    python3 -m venv .venv-gpu
    .venv-gpu/bin/pip install -q -e ".[test,$extra]" "jax[cuda${cuda_major:-12}]" || .venv-gpu/bin/pip install -q -e ".[test,$extra]"
    PY=.venv-gpu/bin/python
fi
$PY -c "import sys, jax, zmq, mpmd; print(sys.version.split()[0], 'jax', jax.__version__, 'pyzmq', zmq.__version__, jax.devices())"
JAX_PLATFORMS=cuda,cpu timeout 120 $PY -m pytest -q -m gpu tests/test_gpu.py tests/test_nccl.py -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.txt"
timeout 180 $PY -m benchmarks.gpu --out "$OUT" --steps 10 --rounds 3
par=""; $PY -c "import xdist" 2> /dev/null && par="-n 12"        # (pytest-xdist and pytest-timeout where the machine has them)
$PY -c "import pytest_timeout" 2> /dev/null && par="$par --timeout 90"
JAX_PLATFORMS=cpu timeout 200 $PY -m pytest -q -p no:cacheprovider $par tests/test_user_programs.py \
    tests/test_user_programs_3.py tests/test_compiler.py tests/test_static_leaves.py tests/test_pipeline.py tests/test_remat.py \
    tests/test_schedules_run.py tests/test_sums.py tests/test_inputs.py tests/test_spmd.py 2>&1 \
    | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tee "$OUT/cpu-smoke.txt"
echo "done: $(ls "$OUT")"
