#!/usr/bin/env bash
# Demo: set up .venv, generate tiny synthetic ads data, train the tiny Kunlun model on CPU,
# evaluate the checkpoint and print NE / AUC / calibration per surface x task.
# Runs in a few minutes on 2 CPU cores. Output goes to ${DEMO_DIR:-/tmp/kunlun_demo}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
DIR="${DEMO_DIR:-/tmp/kunlun_demo}"
STEPS="${DEMO_STEPS:-300}"
PY=.venv/bin/python

if [ ! -f "$DIR/data/schema.json" ]; then
  echo "[demo] generating tiny synthetic data into $DIR/data"
  $PY -m data.synthetic --out "$DIR/data" --preset tiny
fi
echo "[demo] training tiny Kunlun for $STEPS steps on CPU (workdir $DIR/work; resumes if present)"
$PY train.py --config=kunlun/configs/tiny.py --workdir="$DIR/work" --data_dir="$DIR/data" \
  --steps="$STEPS" --config.train.log_every=50
echo "[demo] evaluating the latest checkpoint on the eval split (the next time window)"
$PY eval.py --workdir="$DIR/work" --out="$DIR/metrics.json" --plots_dir="$DIR/plots"
echo "[demo] metrics: $DIR/metrics.json, calibration plots: $DIR/plots, TensorBoard: $DIR/work/tb"
