#!/usr/bin/env bash
# The test command (README, CI): sets up both venvs, then runs the whole suite on the CPU.
# TRITON_INTERPRET=1 must be set before triton is first imported, so it is set for the whole run:
# Triton kernels then execute in the interpreter on CPU tensors. The TLX ahead-of-time compile
# test runs fbtriton (.venv-tlx) and triton-utlx (.venv-utlx) in subprocesses, without the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tlx
export TRITON_INTERPRET=1 TLX_PYTHON="$PWD/.venv-tlx/bin/python" UTLX_PYTHON="$PWD/.venv-utlx/bin/python"
exec .venv/bin/python -m pytest "$@"
