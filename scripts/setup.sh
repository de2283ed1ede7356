#!/usr/bin/env bash
# Creates .venv with the pinned CPU stack (and, with --tlx, .venv-tlx holding fbtriton for the
# ahead-of-time sm_90 compile test). Safe to re-run: pip skips what is already installed.
# With --gpu (an H100/H200 with network access), .venv holds the CUDA stack of requirements/gpu.txt
# instead: torch 2.11 (cu130), fbtriton (TLX) in place of torch's triton, the CUDA fbgemm-gpu, torchrec.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --gpu ]]; then
  # The CUDA fbgemm-gpu loads the driver's libnvidia-ml at import: check before ~8 GB of downloads.
  nvidia-smi > /dev/null 2>&1 || { echo "setup.sh --gpu: no NVIDIA driver here (nvidia-smi failed)" >&2; exit 2; }
  source scripts/gpu_pins.sh
  python3 -m venv .venv
  pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
  # A CPU .venv's fbgemm-gpu-cpu writes the same `fbgemm_gpu` package as the CUDA build.
  .venv/bin/python -m pip uninstall -q -y fbgemm-gpu-cpu
  "${pip[@]}" -r requirements/gpu.txt
  # fbtriton and torch's triton write the same `triton` package: drop both, then put fbtriton back alone.
  .venv/bin/python -m pip uninstall -q -y triton fbtriton
  "${pip[@]}" --no-deps "fbtriton==$(pin fbtriton)"
  .venv/bin/python -c "import torch, triton.language.extra.tlx, torchrec, fbgemm_gpu; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '(TLX) | torchrec', torchrec.__version__)"
  exit
fi
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
