#!/usr/bin/env bash
# The prepared GPU session (device tool, one H200): `bash scripts/gpu_check.sh [all|kernels|
# train_step]` (default all: up to ~720 s of device time, more than one call may run). Run the
# two parts as two calls back to back (the machine stays warm for 30 s between calls):
#   run(command="bash scripts/gpu_check.sh kernels", carry=[".whl", ".peer"], timeout_s=480)
#   run(command="bash scripts/gpu_check.sh train_step", carry=[".whl"], timeout_s=300)
# Kernel part (up to ~470 s of device time):
#   1. gpu-marked kernel tests (Triton and Pallas numerics on the GPU, the softmax attention's
#      pallas and cudnn backends, banded and full; ~70 s),
#   2. bench/kernels.py --autotune: per shape, times the candidate tiles of the Triton (fwd, dq,
#      dk/dv) and Pallas (fwd) GDPA kernels and of the Pallas sliding-window softmax kernel (fwd,
#      then backward tiles) and keeps the fastest; then checks every backend against the XLA
#      reference at the real shapes and times forward and forward+backward: GDPA self / cross,
#      block attention, sliding-window softmax attention at T 512 and 2048 with w 64 (xla banded,
#      pallas, cudnn LSE merge), with Meta's Triton GDPA forward (PyTorch subprocess) as column
#      meta_triton (~230 s),
#   3. writes tuning.json and backend_table.json for pallas_kernels/ (softmax_attention "swa"
#      entries included; "full" keeps its documented default, cudnn, until a case measures it).
# Train-step part (~240 s): scripts/gpu_train_step.sh (mid, three backends, remat, profile),
#   each run dumping XLA's autotune results (--xla_gpu_dump_autotune_results_to, one file per
#   process), merged into bench/profiling/targets/<name>_device.autotune.pbtxt.
# Both parts first save the device's own topology (its GpuTargetConfig) as
# bench/profiling/targets/<name>_device.topology.pb (<name>: h200, h100). Deviceless compiles
# (bench/profiling/gpu_target.py) use both files when present; commit them.
# Before the run, here (CPU): `bash scripts/fetch_gpu_wheels.sh` (wheels into .whl/, the peer
# kernel into .peer/, both git-ignored).
# Afterwards copy $OUT/tables/{tuning,backend_table}.json into pallas_kernels/ and the
# kernels_*.json and train_step_gpu.json into bench/results/, and commit them.
set -o pipefail
PART=${1:-all}
case "$PART" in all|kernels|train_step) ;; *) echo "usage: $0 [all|kernels|train_step]" >&2; exit 2;; esac
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
TARGETS=bench/profiling/targets
python3 -m bench.profiling.gpu_target --save_device "$TARGETS" 2>&1 | tee -a "$OUT/gpu.txt"
NAME=$(python3 -c "import jax; from bench.profiling.gpu_target import device_name as n
print(n(jax.devices()[0].device_kind))")
train_step() {   # the train-step part, its autotune results merged for deviceless compiles
  bash scripts/gpu_train_step.sh
  python3 -m bench.profiling.gpu_target --merge_autotune "$TARGETS/${NAME}_device.autotune.pbtxt" \
      "$AUTOTUNE_DIR"/*.pbtxt 2>&1 | tee -a "$OUT/gpu.txt"
}
AUTOTUNE_DIR=$(mktemp -d)
export AUTOTUNE_DIR
if [[ $PART == train_step ]]; then
  train_step
  exit 0
fi
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/pallas_kernels \
    2>&1 | tee "$OUT/gpu_tests.log"
PEER=()
[ -f .peer/bench_peer_gdpa.py ] && PEER=(--peer "$PWD/.peer")
timeout 380 python3 bench/kernels.py --autotune --iters 10 --out_dir "$OUT" \
    --write_tables "$OUT/tables" "${PEER[@]}" 2>&1 | tee "$OUT/kernels.log"
[[ $PART == all ]] && train_step
exit 0
