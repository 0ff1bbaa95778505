#!/usr/bin/env bash
# GPU part of the train-step measurement (issue 11), for one H200; meant to be called from
# scripts/gpu_check.sh (which installs .whl/ first) or alone from the repo root:
#   run(command="bash scripts/gpu_train_step.sh", carry=[".whl"], timeout_s=330)
# after `bash scripts/fetch_gpu_wheels.sh` here. Runs bench/train_step.py on the `mid` config
# with synthetic in-memory batches (no dataset, no grain):
#   1-3. batch 1024, no remat: model.backend xla / pallas / triton (MFU, memory, launches);
#        the triton run also traces 3 steps and groups device time by named scope;
#   4.   batch 4096 with remat (train.remat=full: one Kunlun layer at a time) and
#        train.microbatches=2 (what the CPU compiled-memory analysis shows to fit), triton.
# Every run is capped (timeout) so one failure cannot eat the budget; about 200 s in all on the
# H200 (the mid step compiled and ran 16 steps in ~35 s there). With $AUTOTUNE_DIR set, each
# run dumps XLA's autotune results there (scripts/gpu_check.sh merges them for deviceless
# compiles). Writes ONE merged JSON,
# $OUT/train_step_gpu.json (copy it to bench/results/ and commit it), and a log.
set -o pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
TMP=$(mktemp -d)
LOG="$OUT/train_step_gpu.log"
if [[ ":${PYTHONPATH:-}:" != *":/tmp/site:"* ]] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
: > "$LOG"

RUN=0
bench() {   # bench <seconds> <bench args...>
  local limit=$1 flags=${XLA_FLAGS:-}
  shift
  RUN=$((RUN + 1))     # $AUTOTUNE_DIR (scripts/gpu_check.sh): one autotune dump per process
  [[ -n ${AUTOTUNE_DIR:-} ]] &&
    flags+=" --xla_gpu_dump_autotune_results_to=$AUTOTUNE_DIR/run$RUN.pbtxt"
  echo "== bench/train_step.py $*" | tee -a "$LOG"
  XLA_FLAGS=$flags timeout "$limit" python3 -m bench.train_step --config mid --mesh data=1,fsdp=1 \
      --steps 10 --warmup 2 --out_dir "$TMP" "$@" 2>&1 | tail -n 25 | tee -a "$LOG"
  echo "== exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}

bench 60 --backend xla --batch 1024
bench 50 --backend pallas --batch 1024
bench 60 --backend triton --batch 1024 --profile --profile_steps 3
bench 70 --backend triton --batch 4096 --set train.remat=full --set train.microbatches=2

python3 -m bench.train_step --table "$TMP"/train_step_*.json 2>&1 | tee -a "$LOG"
python3 -m bench.train_step --merge "$TMP" "$OUT/train_step_gpu.json"
