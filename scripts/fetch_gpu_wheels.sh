#!/usr/bin/env bash
# Downloads the wheels the GPU image lacks or has at older versions into .whl/ (git-ignored):
# jax-triton, ml-collections, grain + array-record + portpicker (data paths), tensorboardX
# (train.py), and the pinned flax / orbax-checkpoint (the image has 0.12.10 / 0.12.4 and, by those,
# their dependencies), for `pip install --no-deps --target`; and copies Meta's Triton GDPA peer
# kernel (../shared/peers/ads_mkl_gdpa, run beside ours by bench/kernels.py --peer, never
# vendored) into .peer/ (git-ignored): both for the device tool's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in /.whl/ /.peer/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
peer=${PEER_DIR:-../shared/peers/ads_mkl_gdpa}
[ -d "$peer" ] || peer=../../shared/peers/ads_mkl_gdpa
if [ -d "$peer" ]; then rm -rf .peer && cp -r "$peer" .peer; else echo "no peer folder: skipped"; fi
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do plat+=(--platform "$p"); done
py=${PYTHON:-python3}
for pkg in jax-triton==0.3.1 ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 \
           tensorboardX==2.6.5 portpicker==1.6.0 flax==0.12.12 orbax-checkpoint==0.12.8; do
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" --platform any -d .whl "$pkg"
done
ls -la .whl
