#!/usr/bin/env bash
# Installs what the GPU image lacks from carried files, into /tmp (kept while the machine stays warm).
# Each call may carry any of these; run this at the start of every call, it installs what arrived:
#   .gpu/fbtriton_slim.tar.xz           fbtriton 3.7.4 (TLX) for cp312 (scripts/pack_fbtriton_slim.sh) -> /tmp/site
#   .gpu/fbgemm_gpu_slim.tar.xz.partNN  the CUDA fbgemm-gpu 1.6.0, sm_90 device code only, in pieces
#                                       (scripts/pack_fbgemm_gpu_slim.sh) -> /tmp/site once all have arrived
#   .offline/part0/*.whl                torchrec, datasets, tensordict, fbgemm-gpu-cpu (../shared/offline-gpu/fetch.sh)
#   .whl/*.whl                          jsonargparse (LightningCLI) and lightning 2.6.6, as CI pins them
# Then: export PYTHONPATH=/tmp/site:/tmp/site0
set -euo pipefail
mkdir -p /tmp/site /tmp/site0 /tmp/fbgemm_pieces
if [[ -f .gpu/fbtriton_slim.tar.xz && ! -f /tmp/site/.fbtriton ]]; then
  tar xJf .gpu/fbtriton_slim.tar.xz -C /tmp/site && touch /tmp/site/.fbtriton
fi
# The CUDA fbgemm replaces the CPU one; its pieces may arrive over several calls.
for piece in .gpu/fbgemm_gpu_slim.tar.xz.part*; do
  [[ -f $piece ]] && cp "$piece" /tmp/fbgemm_pieces/
done
if [[ -f .gpu/fbgemm_gpu_slim.parts && ! -f /tmp/site/.fbgemm_gpu ]]; then
  cp .gpu/fbgemm_gpu_slim.parts /tmp/fbgemm_pieces/
fi
if [[ -f /tmp/fbgemm_pieces/fbgemm_gpu_slim.parts && ! -f /tmp/site/.fbgemm_gpu ]]; then
  expected=$(cat /tmp/fbgemm_pieces/fbgemm_gpu_slim.parts)
  present=$(ls /tmp/fbgemm_pieces/fbgemm_gpu_slim.tar.xz.part* 2>/dev/null | wc -l)
  if [[ $present == "$expected" ]]; then
    rm -rf /tmp/site0/fbgemm_gpu /tmp/site0/fbgemm_gpu_cpu*  # the CPU build must not shadow it
    cat /tmp/fbgemm_pieces/fbgemm_gpu_slim.tar.xz.part* | tar xJf - -C /tmp/site && touch /tmp/site/.fbgemm_gpu
  else
    echo "fbgemm-gpu: $present of $expected pieces so far"
  fi
fi
wheels=$(ls .offline/part0/*.whl .whl/*.whl 2>/dev/null || true)
if [[ -n $wheels && ! -f /tmp/site0/.complete ]]; then
  if [[ -f /tmp/site/.fbgemm_gpu ]]; then wheels=$(echo "$wheels" | grep -v fbgemm_gpu_cpu || true); fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site0 $wheels
  touch /tmp/site0/.complete
fi
# What is installed; a folder that this call left out (nothing carried for it) is no error.
(ls -d /tmp/site/*.dist-info /tmp/site0/*.dist-info 2>/dev/null || true) | xargs -r -n1 basename | tr '\n' ' '; echo
