#!/usr/bin/env bash
# Creates .venv from a Python >= 3.12 and installs the project (with dev extras).
# Idempotent: re-running only reinstalls when pyproject.toml changed or the venv came from
# another checkout.
# --beam: also (or only, with VENV=.venv-beam) a second venv .venv-beam with the `beam` extra:
# apache-beam caps numpy / pyarrow / protobuf below the main stack, so it gets its own
# (`python -m data.ingest --runner beam` and tests/data/ingest/test_ingest_beam.py use it).
# --gpu-compile: a third venv .venv-gpu, the project plus the deviceless XLA:GPU compiler
# (bench --target h200/h100 on a CPU-only host, bench/profiling/gpu_target.py): jax-cuda12-pjrt
# and jax-cuda12-plugin at jaxlib's version plus nvidia-cuda-nvcc-cu12 (ptxas, libdevice), all
# --no-deps (no CUDA runtime wheels; ~240 MB download). Its own venv: with the CUDA plugin
# installed, every `import jax` logs "Could not find cuda drivers" lines on a CPU-only host.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  ""|--gpu-compile|--beam) ;;
  *) echo "scripts/setup.sh: unknown option '$1' (none, --gpu-compile or --beam)" >&2; exit 2;;
esac
if [ "${1:-}" = "--gpu-compile" ]; then
  VENV="${VENV:-.venv-gpu}"
  VENV="$VENV" bash "$0"
  ver="$("$VENV/bin/python" -c 'import jaxlib; print(jaxlib.__version__)')"
  if ! "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("jax_plugins.xla_cuda12") and u.find_spec("nvidia.cuda_nvcc") else 1)' 2>/dev/null; then
    echo "[setup] installing the deviceless GPU compiler (jax-cuda12 $ver, nvcc) into $VENV"
    "$VENV/bin/python" -m pip install --quiet --no-deps "jax-cuda12-pjrt==$ver" \
      "jax-cuda12-plugin==$ver" nvidia-cuda-nvcc-cu12
  fi
  exit
fi
if [ "${1:-}" = "--beam" ]; then
  VENV=.venv-beam EXTRAS="beam,dev" bash "$0"
  exit
fi
VENV="${VENV:-.venv}"
EXTRAS="${EXTRAS:-dev}"

find_python() {
  for cand in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -rV); do
      p="$(pyenv root)/versions/$v/bin/python"
      [ -x "$p" ] && { echo "$p"; return 0; }
    done
  fi
  for p in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    [ -x "$p" ] && { echo "$p"; return 0; }
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
  PY="$(find_python)" || {
    echo "ERROR: kunlun-jax needs Python >= 3.12 (jax 0.11.2 does not support older versions)." >&2
    echo "Install python3.12 (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
    exit 1
  }
  echo "[setup] creating $VENV with $PY ($("$PY" --version))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

# The stamp holds the checkout the editable install points at: a venv carried from another
# checkout (or a moved one) would import that checkout's code outside this one and run its
# console commands through a stale interpreter path, so it is reinstalled here.
stamp="$VENV/.kunlun-installed"
here="$(pwd -P)"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$here" ]; then
  echo "[setup] installing kunlun-jax and its pinned dependencies into $VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install --quiet -e ".[$EXTRAS]"
  echo "$here" > "$stamp"
fi
"$VENV/bin/python" -c 'import jax; assert jax.__version__ == "0.11.2", jax.__version__' || {
  echo "ERROR: expected jax 0.11.2 in $VENV" >&2; exit 1; }
