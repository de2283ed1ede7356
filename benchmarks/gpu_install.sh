#!/usr/bin/env bash
# Installs the GPU image's missing packages from carried files, into /tmp (kept while the
# machine stays warm), in one call instead of one per 49 MB offline part:
#   .gpu/fbtriton_slim.tar.xz  fbtriton 3.7.4 (TLX) for cp312, made by scripts/pack_fbtriton_slim.sh
#   .offline/part0/*.whl       torchrec, fbgemm-gpu-cpu, datasets, tensordict (../shared/offline-gpu/fetch.sh)
#   .whl/*.whl                 jsonargparse and its needs
# Then: export PYTHONPATH=/tmp/site:/tmp/site0
set -euo pipefail
if [[ -f .gpu/fbtriton_slim.tar.xz && ! -f /tmp/site/.fbtriton ]]; then
  mkdir -p /tmp/site && tar xJf .gpu/fbtriton_slim.tar.xz -C /tmp/site && touch /tmp/site/.fbtriton
fi
wheels=$(ls .offline/part0/*.whl .whl/*.whl 2>/dev/null || true)
if [[ -n $wheels && ! -f /tmp/site0/.complete ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site0 $wheels
  touch /tmp/site0/.complete
fi
# What is installed; a folder that this call left out (nothing carried for it) is no error.
(ls -d /tmp/site/*.dist-info /tmp/site0/*.dist-info 2>/dev/null || true) | xargs -r -n1 basename | tr '\n' ' '; echo
