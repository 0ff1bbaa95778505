#!/usr/bin/env bash
# The prepared GPU session (device tool, one H200): gpu-marked kernel tests, then bench/kernels.py
# (correctness at the real shapes + TFLOP/s table). Run from the repo root with
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# after `bash scripts/fetch_gpu_wheels.sh` here. Logs and JSON go to $OUT (default
# bench/results); copy the JSON into bench/results/ and commit it.
set -o pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv \
    2>&1 | tee "$OUT/gpu.txt"
python3 -c "import jax, triton; print(jax.__version__, triton.__version__, jax.devices())" \
    2>&1 | tee -a "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels \
    2>&1 | tee "$OUT/gpu_tests.log"
timeout 300 python3 bench/kernels.py --out_dir "$OUT" 2>&1 | tee "$OUT/kernels.log"
