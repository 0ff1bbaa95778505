#!/usr/bin/env bash
# The prepared GPU session (device tool, one H200). Kernel part (~240 s of device time):
#   1. gpu-marked kernel tests (Triton and Pallas numerics on the GPU; ~60 s),
#   2. bench/kernels.py --autotune: per shape, times the candidate tiles of the Triton (fwd, dq,
#      dk/dv) and Pallas (fwd) GDPA kernels and keeps the fastest; then checks every backend
#      against the XLA reference at the real shapes and times forward and forward+backward,
#      with Meta's Triton GDPA forward (PyTorch subprocess) as column meta_triton (~150 s),
#   3. writes tuning.json and backend_table.json for pallas_kernels/.
# Before the run, here (CPU): `bash scripts/fetch_gpu_wheels.sh` (wheels into .whl/, the peer
# kernel into .peer/, both git-ignored). Run from the repo root with
#   run(command="bash scripts/gpu_check.sh", carry=[".whl", ".peer"], timeout_s=480)
# Afterwards copy $OUT/tables/{tuning,backend_table}.json into pallas_kernels/ and the
# kernels_*.json into bench/results/, and commit them.
set -o pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
# JAX must not grab 75% of the GPU: the peer benchmark's PyTorch shares it.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv \
    2>&1 | tee "$OUT/gpu.txt"
python3 -c "import jax, triton; print(jax.__version__, triton.__version__, jax.devices())" \
    2>&1 | tee -a "$OUT/gpu.txt"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels \
    2>&1 | tee "$OUT/gpu_tests.log"
PEER=()
[ -f .peer/bench_peer_gdpa.py ] && PEER=(--peer "$PWD/.peer")
timeout 300 python3 bench/kernels.py --autotune --iters 10 --out_dir "$OUT" \
    --write_tables "$OUT/tables" "${PEER[@]}" 2>&1 | tee "$OUT/kernels.log"
