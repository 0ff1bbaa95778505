#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite on CPU (8 fake devices).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec .venv/bin/python -m pytest -q "$@"
