#!/usr/bin/env bash
# Demo: set up .venv, generate synthetic ads data (400k train + 80k eval examples, seconds), train
# the tiny Kunlun model on CPU for one pass over it (kunlun/configs/demo.py), evaluate the
# checkpoint on the next time window and print NE / AUC / calibration per surface x task.
# Runs in a few minutes on 2 CPU cores. Output goes to ${DEMO_DIR:-/tmp/kunlun_demo}.
# DEMO_EXAMPLES: train examples (default 400000); DEMO_EPOCHS: passes (default 1);
# DEMO_STEPS: a step count instead of epochs. The demo starts afresh (removing DEMO_DIR's data/
# and work/) only in a folder it made itself (its marker file .kunlun_demo) or the default one.
set -euo pipefail
cd "$(dirname "$0")/.."
for v in DEMO_EXAMPLES DEMO_EPOCHS DEMO_STEPS; do
  if [ -n "${!v:-}" ] && ! [[ "${!v}" =~ ^[1-9][0-9]{0,8}$ ]]; then
    echo "[demo] $v=${!v}: expected a positive integer" >&2; exit 2
  fi
done
DIR="${DEMO_DIR:-/tmp/kunlun_demo}"
MARK="$DIR/.kunlun_demo"
if [ -n "${DEMO_DIR:-}" ] && [ ! -e "$MARK" ] && { [ -e "$DIR/data" ] || [ -e "$DIR/work" ]; }; then
  echo "[demo] $DIR holds data/ or work/ not made by the demo: set DEMO_DIR to a new folder" >&2
  exit 2
fi
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
EXAMPLES="${DEMO_EXAMPLES:-400000}"
PY=.venv/bin/python
mkdir -p "$DIR"
touch "$MARK"
if [ -n "${DEMO_STEPS:-}" ]; then
  LENGTH=(--steps="$DEMO_STEPS" --config.train.epochs=0); WHAT="$DEMO_STEPS steps"
else
  EPOCHS="${DEMO_EPOCHS:-1}"
  LENGTH=(--config.train.epochs="$EPOCHS"); WHAT="$EPOCHS pass(es) over the train split"
fi

have=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_train"])' \
  "$DIR/data/synthetic.json" 2>/dev/null || echo none)
if [ "$have" != "$EXAMPLES" ]; then
  if [ "$have" != none ] || [ -e "$DIR/work" ]; then
    echo "[demo] $DIR holds data of $have train examples, not $EXAMPLES: starting afresh"
    rm -rf "$DIR/data" "$DIR/work"
  fi
  echo "[demo] generating $EXAMPLES synthetic train examples into $DIR/data"
  $PY -m data.synthetic --out "$DIR/data" --preset tiny --num_examples "$EXAMPLES"
fi
echo "[demo] training tiny Kunlun for $WHAT on CPU (workdir $DIR/work; resumes if present)"
$PY train.py --config=kunlun/configs/demo.py --workdir="$DIR/work" --data_dir="$DIR/data" \
  "${LENGTH[@]}"
echo "[demo] evaluating the latest checkpoint on the eval split (the next time window)"
$PY eval.py --workdir="$DIR/work" --out="$DIR/metrics.json" --plots_dir="$DIR/plots"
echo "[demo] NE = log loss / that of always predicting the cell's own base rate (below 1: better"
echo "[demo] than the base rate); bayesNE = the planted teacher's true probabilities (the floor)"
echo "[demo] metrics: $DIR/metrics.json, calibration plots: $DIR/plots, TensorBoard: $DIR/work/tb"
