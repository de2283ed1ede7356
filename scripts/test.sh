#!/usr/bin/env bash
# The test command (README, CI): sets up both venvs, then runs the whole suite on the CPU.
# TRITON_INTERPRET=1 must be set before triton is first imported, so it is set for the whole run:
# Triton kernels then execute in the interpreter on CPU tensors. The TLX ahead-of-time compile
# test runs fbtriton (.venv-tlx) and triton-utlx (.venv-utlx) in subprocesses, without the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tlx
export TRITON_INTERPRET=1 TLX_PYTHON="$PWD/.venv-tlx/bin/python" UTLX_PYTHON="$PWD/.venv-utlx/bin/python"
# Test files run in parallel, one worker per core up to 4 (TEST_WORKERS overrides; 0 runs them in this process).
# A file stays on one worker, so its module fixtures are built once; each worker's torch gets an equal share
# of the cores, since two workers' default thread pools on the same cores slow each other down.
workers=${TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
if (( workers > 1 )); then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / workers ))}
  exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"
