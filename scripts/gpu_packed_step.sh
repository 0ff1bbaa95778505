#!/usr/bin/env bash
# GPU part of issue #38: the packed train step measured on one H200 beside the roofline bound of
# the same (autotuned) program. From the repo root, after `bash scripts/fetch_gpu_wheels.sh`:
#   run(command="bash scripts/gpu_packed_step.sh", carry=[".whl"], timeout_s=540)
# Runs bench/train_step.py (synthetic in-memory batches, --jagged auto: the top bucket's
# capacity) on mid b1024 and b256 packed, prod b1024 packed (train.remat as $PROD_REMAT, the
# policy remat=auto picks for the H200 deviceless) and mid b1024 padded; each capped. Writes ONE
# merged JSON, $OUT/train_step_gpu_packed.json (copy it to bench/results/ and commit it), a log,
# and prints the table (step_ms and pipelined_ms beside bound_ms).
set -o pipefail
OUT=${OUT:-bench/results}
PROD_REMAT=${PROD_REMAT:-none}
mkdir -p "$OUT"
TMP=$(mktemp -d)
LOG="$OUT/train_step_gpu_packed.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
: > "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$LOG"
bench() {   # bench <seconds> <bench args...>
  local limit=$1
  shift
  echo "== bench/train_step.py $*" | tee -a "$LOG"
  timeout "$limit" python3 -m bench.train_step --mesh data=1,fsdp=1 --steps 10 --warmup 2 \
      --out_dir "$TMP" "$@" 2>&1 | grep -v "^[WI][0-9]" | tail -n 12 | tee -a "$LOG"
  echo "== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
bench 120 --config mid --backend auto --batch 1024 --jagged
bench 100 --config mid --backend auto --batch 256 --jagged
bench 180 --config prod --backend auto --batch 1024 --jagged --set "train.remat=$PROD_REMAT"
bench 100 --config mid --backend auto --batch 1024
python3 -m bench.train_step --table "$TMP"/train_step_*.json 2>&1 | tee -a "$LOG"
python3 -m bench.train_step --merge "$TMP" "$OUT/train_step_gpu_packed.json"
