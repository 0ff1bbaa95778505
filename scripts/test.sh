#!/usr/bin/env bash
# Sets up .venv, .venv-gpu (the deviceless GPU compiler) and .venv-beam if needed, builds the docs
# site with warnings as errors (scripts/docs.sh: a broken link fails here, in seconds;
# KUNLUN_TEST_DOCS=0 skips it), then runs the whole test suite on CPU (8 fake devices per process).
# Two pytest-xdist workers by default (test files stay whole on one worker, so module fixtures
# run once); KUNLUN_TEST_WORKERS=0 runs serially. Extra arguments go to pytest. The 25 slowest
# tests are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh                 # .venv: the project and its pinned stack
bash scripts/setup.sh --gpu-compile   # .venv-gpu: tests/bench/profiling/test_gpu_target.py compiles there
bash scripts/setup.sh --beam      # .venv-beam: tests/data/ingest/test_ingest_beam.py runs there
if [ "${KUNLUN_TEST_DOCS:-1}" != "0" ]; then
  bash scripts/docs.sh --quiet    # the docs site, warnings as errors (mkdocs build --strict)
fi
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
workers="${KUNLUN_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
exec .venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadfile "$@"
