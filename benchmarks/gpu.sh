#!/usr/bin/env bash
# One-shot GPU check for a lent GPU machine (<= 10 minutes): installs the GPU extra matching the CUDA driver,
# runs the real-NCCL tests and benchmarks/gpu.py, and writes every figure and log under $OUT.
#     OUT=/tmp/out bash benchmarks/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
nvidia-smi || { echo "no GPU here (nvidia-smi failed)"; exit 1; }
cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
extra=gpu; [ "${cuda_major:-12}" -ge 13 ] && extra=gpu-cuda13
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e ".[test,$extra]" "jax[cuda${cuda_major:-12}]" || .venv-gpu/bin/pip install -q -e ".[test,$extra]"
.venv-gpu/bin/python -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 240 .venv-gpu/bin/python -m pytest -q -m gpu tests/test_nccl.py -rs | tee "$OUT/nccl-tests.txt"
timeout 300 .venv-gpu/bin/python -m benchmarks.gpu --out "$OUT"
echo "done: $(ls "$OUT")"
