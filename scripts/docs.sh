#!/usr/bin/env bash
# Builds the docs site (mkdocs.yml, pages under docs/) into site/ with warnings as errors: a broken
# link, a missing page or heading, or an API reference that does not resolve stops the build.
# Sets up .venv if needed (scripts/setup.sh) and installs pyproject.toml's `docs` extra into it
# when missing or older than pyproject.toml. scripts/test.sh (CI) runs it before the tests.
# Extra arguments go to `mkdocs build` (e.g. --site-dir DIR); `serve` as the first argument runs
# `mkdocs serve` instead (a local preview at http://127.0.0.1:8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
stamp=.venv/.kunlun-docs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
   || ! .venv/bin/python -c 'import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python' 2>/dev/null; then
  echo "[docs] installing the docs extra (mkdocs-material, mkdocstrings) into .venv"
  # the extra's pins, read from pyproject.toml (installing ".[docs]" would reinstall the project)
  mapfile -t pins < <(.venv/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
  .venv/bin/python -m pip install --quiet "${pins[@]}"
  touch "$stamp"
fi
export NO_MKDOCS_2_WARNING=1    # Material's notice about its successor, printed on every build
if [ "${1:-}" = "serve" ]; then
  shift
  exec .venv/bin/python -m mkdocs serve "$@"
fi
exec .venv/bin/python -m mkdocs build --strict "$@"
