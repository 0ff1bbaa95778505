#!/usr/bin/env bash
# Downloads the wheels the GPU image lacks (jax-triton; grain and its small needs are only for
# the data/transfer paths) into .whl/ (git-ignored), for the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do plat+=(--platform "$p"); done
py=${PYTHON:-python3}
for pkg in jax-triton==0.3.1 ml-collections; do
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" --platform any -d .whl "$pkg"
done
ls -la .whl
