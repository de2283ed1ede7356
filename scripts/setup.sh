#!/usr/bin/env bash
# Creates .venv with the pinned CPU stack (and, with --tlx, .venv-tlx holding fbtriton for the
# ahead-of-time sm_90 compile test). Safe to re-run: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check ".[test]"
# torchrec's metadata requires the 500 MB CUDA fbgemm-gpu; fbgemm-gpu-cpu above provides its ops.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
if [[ ${1:-} == --tlx ]]; then
  # Each TLX distribution replaces or extends the `triton` module, so each lives in its own venv,
  # used only to compile the TLX kernels ahead of time for sm_90 (torch: kernels/ imports it).
  python3 -m venv .venv-tlx
  .venv-tlx/bin/python -m pip install -q --disable-pip-version-check fbtriton==3.7.4 numpy torch==2.13.0
  python3 -m venv .venv-utlx
  .venv-utlx/bin/python -m pip install -q --disable-pip-version-check triton-utlx==3.8.0.post16 numpy torch==2.13.0
fi
rm -rf build ./*.egg-info
