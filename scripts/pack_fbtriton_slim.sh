#!/usr/bin/env bash
# Packs fbtriton at requirements/gpu.txt's version (cp312, the GPU image's Python) into one ~54 MB .gpu/fbtriton_slim.tar.xz
# that fits a single device call (64 MiB), instead of five 49 MB parts: debug symbols stripped
# from libtriton.so (530 -> 174 MB), and the profiler (CUPTI), instrumentation and Blackwell
# ptxas left out; sm_90 compiles do not use them. scripts/gpu_install.sh unpacks it.
#     bash scripts/pack_fbtriton_slim.sh [WHEEL]   # default: reassembled from .offline/part1..5
set -euo pipefail
source "$(dirname "$0")/gpu_pins.sh"
version=$(pin fbtriton)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
wheel=${1:-}
if [[ -z $wheel ]]; then
  wheel=$work/fbtriton-$version-cp312.whl
  cat .offline/part*/fbtriton-"$version"-cp312-*.whl.part.* > "$wheel"
fi
mkdir "$work/site" && (cd "$work/site" && unzip -q "$wheel")
rm -rf "$work"/site/triton/backends/nvidia/lib/cupti "$work"/site/triton/backends/nvidia/lib/cupti-blackwell \
  "$work"/site/triton/backends/nvidia/bin/ptxas-blackwell "$work"/site/triton/instrumentation
strip --strip-unneeded "$work"/site/triton/_C/libtriton.so "$work"/site/triton/_C/libproton.so
mkdir -p .gpu && tar cf - -C "$work/site" . | xz -T0 -6 > .gpu/fbtriton_slim.tar.xz
ls -la .gpu/fbtriton_slim.tar.xz
