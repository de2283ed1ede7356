#!/usr/bin/env bash
# Builds, on a fresh checkout with package-index access, every pack the offline GPU machine's calls carry
# (README, "Running on a GPU"); the packs are git-ignored and a new checkout has none:
#   .gpu/fbtriton_slim.tar.xz   fbtriton (TLX), scripts/pack_fbtriton_slim.sh     } call A: ~58 MiB
#   .whl/*.whl                  torchrec, datasets, tensordict, lightning, ...   }
#   .gpu/fbgemm_gpu_cpu/*.whl   fbgemm-gpu-cpu                                   } call B: ~11 MiB
#   .gpu-data/ml1m_raw.tar.xz   MovieLens-1M's raw files (--ml1m; needs .venv)   }
#     bash scripts/pack_gpu.sh [--ml1m]
# The CUDA fbgemm-gpu (sharded tables' fused kernels) is packed apart: scripts/pack_fbgemm_gpu_slim.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_pins.sh
bash ../shared/offline-gpu/fetch.sh
bash scripts/pack_fbtriton_slim.sh
rm -rf .whl .gpu/fbgemm_gpu_cpu && mkdir -p .whl .gpu/fbgemm_gpu_cpu
mv .offline/part0/fbgemm_gpu_cpu-*.whl .gpu/fbgemm_gpu_cpu/
mv .offline/part0/*.whl .whl/
# What the image may lack beside fetch.sh's small wheels, at the versions requirements/gpu.txt pins.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "lightning==$(pin lightning)" "torchmetrics==$(pin torchmetrics)" "jsonargparse>=4.40" docstring-parser typeshed-client
rm -rf .offline
[[ ${1:-} == --ml1m ]] && bash scripts/pack_ml1m.sh
du -sh .gpu/fbtriton_slim.tar.xz .whl .gpu/fbgemm_gpu_cpu .gpu-data 2>/dev/null || true
