#!/usr/bin/env bash
# Installs what the GPU image lacks from carried files, into /tmp (kept while the machine stays warm).
# A call may carry any of these, each at requirements/gpu.txt's version (checked last); run this at the
# start of every call, it installs what has arrived:
#   .gpu/fbtriton_slim.tar.xz            fbtriton (TLX) for cp312 (scripts/pack_fbtriton_slim.sh)
#   .gpu/fbgemm_gpu_slim.tar.xz.partNN   the CUDA fbgemm-gpu with sm_90 device code only, in pieces that
#   .gpu/fbgemm_gpu_slim.parts           may come over several calls, and how many (scripts/pack_fbgemm_gpu_slim.sh)
#   .gpu/fbgemm_gpu_cpu/*.whl            fbgemm-gpu-cpu, used only where the CUDA build is not installed
#   .whl/*.whl                           torchrec, datasets, tensordict (../shared/offline-gpu/fetch.sh's
#                                        part0), lightning and jsonargparse
# Then: export PYTHONPATH=/tmp/site:/tmp/site0
set -euo pipefail
source scripts/gpu_pins.sh
mkdir -p /tmp/site /tmp/site0 /tmp/fbgemm_pieces
if [[ -f .gpu/fbtriton_slim.tar.xz && ! -f /tmp/site/.fbtriton ]]; then
  tar xJf .gpu/fbtriton_slim.tar.xz -C /tmp/site && touch /tmp/site/.fbtriton
fi
cp .gpu/fbgemm_gpu_slim.tar.xz.part* .gpu/fbgemm_gpu_slim.parts /tmp/fbgemm_pieces/ 2>/dev/null || true
if [[ -f /tmp/fbgemm_pieces/fbgemm_gpu_slim.parts && ! -f /tmp/site/.fbgemm_gpu ]]; then
  expected=$(cat /tmp/fbgemm_pieces/fbgemm_gpu_slim.parts)
  present=$(ls /tmp/fbgemm_pieces/ | grep -c 'fbgemm_gpu_slim.tar.xz.part' || true)
  if [[ $present == "$expected" ]]; then
    rm -rf /tmp/site0/fbgemm_gpu /tmp/site0/fbgemm_gpu_cpu-*.dist-info  # the CPU build must not shadow it
    cat /tmp/fbgemm_pieces/fbgemm_gpu_slim.tar.xz.part* | tar xJf - -C /tmp/site && touch /tmp/site/.fbgemm_gpu
    rm -f /tmp/fbgemm_pieces/*
  else
    echo "fbgemm-gpu: $present of $expected pieces so far"
  fi
fi
if ls .whl/*.whl > /dev/null 2>&1 && [[ ! -f /tmp/site0/.complete ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site0 .whl/*.whl
  touch /tmp/site0/.complete
fi
if ls .gpu/fbgemm_gpu_cpu/*.whl > /dev/null 2>&1 && [[ ! -f /tmp/site/.fbgemm_gpu && ! -d /tmp/site0/fbgemm_gpu ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site0 .gpu/fbgemm_gpu_cpu/*.whl
fi
# What is installed; a folder that this call left out (nothing carried for it) is no error.
(ls -d /tmp/site/*.dist-info /tmp/site0/*.dist-info 2>/dev/null || true) | xargs -r -n1 basename | tr '\n' ' '; echo
for name in fbtriton fbgemm-gpu torchrec lightning datasets tensordict; do
  installed=$(ls -d /tmp/site/"${name//-/_}"-*.dist-info /tmp/site0/"${name//-/_}"-*.dist-info 2>/dev/null | head -1 || true)
  [[ -z $installed || $installed == */"${name//-/_}-$(pin "$name").dist-info" ]] \
    || echo "$(basename "$installed") is not requirements/gpu.txt's $name==$(pin "$name")"
done
