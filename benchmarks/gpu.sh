#!/usr/bin/env bash
# One-shot GPU check for a lent GPU machine (< 8 minutes, every step under its own timeout): the GPU tests
# (pipelines on GPU actors against jax.jit; real NCCL where two GPUs exist), benchmarks/gpu.py's figures, and a CPU
# smoke of the compiler on this machine's jax; every figure and log goes under $OUT. Exits 1 if any step failed
# (every status was ignored and it said "done" after "1 failed"; a review).
#     OUT=/tmp/out bash benchmarks/gpu.sh
# Packages, in this order:
# * python3 already holds them all (jax with CUDA, cupy with NCCL, pyzmq, pytest-asyncio, optax, ...): used as is;
# * what it lacks comes as wheels in .whl/, made beforehand on a machine with pip (the lent machines reach no registry):
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pyzmq pytest-asyncio
# * online: a fresh venv with the GPU extra matching the CUDA driver and jax[cudaN]. Offline with neither: it stops.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT" || exit 1
exec > >(tee "$OUT/gpu.log") 2>&1
# MPMD_REQUIRE_GPU: tests/test_gpu.py and tests/test_nccl.py fail, not skip, when the GPU, jax's CUDA backend or
# cupy with NCCL is missing (a skip read as a pass here)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false MPMD_REQUIRE_GPU=1
T="timeout -k 10"  # budget (s): nvidia-smi 10, packages 140 (probes 2 x 20, venv 20, pip 80), check 25, GPU tests 100, figures 110, CPU smoke 90 = 475
rc=0
$T 10 nvidia-smi || { echo "no GPU here (nvidia-smi failed)"; exit 1; }
NEEDED="jax cupy optax ml_dtypes pytest pytest_asyncio zmq"
missing() {  # the modules of $NEEDED that $1 cannot import
    $T 20 "$1" -c "
import importlib.util, sys
print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))" $NEEDED
}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
lack=$(missing python3) || { echo "python3 does not run"; exit 1; }
if [ -n "$lack" ]; then
    echo "python3 lacks: $lack"
    if compgen -G ".whl/*.whl" > /dev/null; then
        $T 80 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mpmd-site .whl/*.whl \
            || { mkdir -p /tmp/mpmd-site && for w in .whl/*.whl; do $T 30 $PY -m zipfile -e "$w" /tmp/mpmd-site; done; }
        export PYTHONPATH="$PYTHONPATH:/tmp/mpmd-site"
    elif $T 10 python3 -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/pip/', timeout=8)" 2> /dev/null; then
        cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
        extra=gpu; [ "${cuda_major:-12}" -ge 13 ] && extra=gpu-cuda13
        $T 20 python3 -m venv .venv-gpu || { echo "cannot make a venv"; exit 1; }
        $T 80 .venv-gpu/bin/pip install -q -e ".[test,$extra]" "jax[cuda${cuda_major:-12}]" \
            || { echo "pip install into .venv-gpu failed (or ran past 80 s)"; exit 1; }
        PY=.venv-gpu/bin/python
    else
        echo "python3 lacks $lack, there is no .whl/ and no package index is reachable: put wheels of them in .whl/ (see the" \
             "top of this script) or run it where pip reaches an index"
        exit 1
    fi
    lack=$(missing $PY)
    [ -z "$lack" ] || { echo "still missing after installing: $lack"; exit 1; }
fi
# up front: every module the steps need imports, and what cupy's NCCL is (a missing libnccl showed only as skips)
$T 25 $PY -c "
import sys, jax, zmq, cupy, optax, ml_dtypes, pytest_asyncio, mpmd
from cupy.cuda import nccl
from transport.p2p import nccl as route
print(sys.version.split()[0], 'jax', jax.__version__, 'pyzmq', zmq.__version__, 'cupy', cupy.__version__, jax.devices())
print('NCCL', nccl.get_version() if getattr(nccl, 'available', False) else 'missing (libnccl)', 'route available:', route.available())
" || { echo "the packages above do not import"; exit 1; }
JAX_PLATFORMS=cuda,cpu $T 100 $PY -m pytest -q -m gpu tests/test_gpu.py tests/test_nccl.py -rs -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu-tests.txt" || rc=1
$T 110 $PY -m benchmarks.gpu --out "$OUT" --steps 10 --rounds 3 || rc=1
par=""; $PY -c "import xdist" 2> /dev/null && par="-n 8"        # (pytest-xdist and pytest-timeout where the machine has them)
$PY -c "import pytest_timeout" 2> /dev/null && par="$par --timeout 60"
JAX_PLATFORMS=cpu $T 90 $PY -m pytest -q -p no:cacheprovider $par tests/test_user_programs.py \
    tests/test_user_programs_3.py tests/test_compiler.py tests/test_static_leaves.py tests/test_pipeline.py tests/test_remat.py \
    tests/test_schedules_run.py tests/test_sums.py tests/test_inputs.py tests/test_spmd.py > "$OUT/cpu-smoke-full.txt" 2>&1 || rc=1
grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/cpu-smoke-full.txt" | tee "$OUT/cpu-smoke.txt"
echo "$([ $rc = 0 ] && echo done || echo "FAILED (a step above)"): $(ls "$OUT")"
exit $rc
