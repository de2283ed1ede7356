"""The Python interpreters that compile Triton kernels ahead of time for sm_90 in the tests: the dev venv's
upstream Triton, and the TLX distributions the GPU runs the kernels under (fbtriton, triton-utlx), whose
compilers differ in register allocation; scripts/test.sh sets TLX_PYTHON and UTLX_PYTHON."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AOT_PYTHONS = {"dev": sys.executable, "tlx": os.environ.get("TLX_PYTHON"), "utlx": os.environ.get("UTLX_PYTHON")}
