"""Ahead-of-time compile of the TLX kernels for sm_90, on a machine with no GPU.

The compile runs in a subprocess under $TLX_PYTHON (a venv with fbtriton==3.7.4 and torch), since
fbtriton replaces the `triton` module and can't share a process with the dev venv's triton. Each
configuration must produce wgmma + TMA in PTX and HGMMA + UTMALDG in SASS, warp specialization
(setmaxnreg), and fit in 227 KiB of SMEM: a kernel that silently fell back to mma.sync or plain
loads fails here.
"""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from kernels.block_attention_tlx import SM90_MAX_SMEM, SMEM_SLACK
from kernels.tlx_aot import aot_configs

REPO = Path(__file__).resolve().parents[1]
# fbtriton 3.7.4 (TLX_PYTHON) and triton-utlx 3.8.0.post16 on Triton 3.8 (UTLX_PYTHON): each
# is a python whose `triton` has TLX; scripts/test.sh sets both.
TLX_DISTRIBUTIONS = ["TLX_PYTHON", "UTLX_PYTHON"]

_SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    import triton
    from kernels.block_attention_tlx import HAS_TLX
    from kernels.tlx_aot import aot_configs, compile_all
    assert HAS_TLX, "triton.language.extra.tlx did not import under TLX_PYTHON"
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, res in compile_all(aot_configs(tuning_variants=sys.argv[1] == "TLX_PYTHON")).items():
            sass = ""
            if res["cubin"]:
                path = os.path.join(tmp, name + ".cubin")
                with open(path, "wb") as f:
                    f.write(res["cubin"])
                sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
            ptx = res["ptx"]
            summary[name] = dict(
                error=res["error"],
                shared=res["shared"],
                target=next((l.split()[1] for l in ptx.splitlines() if l.startswith(".target")), ""),
                ptx_wgmma=ptx.count("wgmma.mma_async"),
                ptx_tma=ptx.count("cp.async.bulk.tensor"),
                ptx_tma_store=ptx.count("cp.async.bulk.tensor.2d.global.shared"),
                tuning=res["tuning"],
                triton=triton.__version__,
                ptx_setmaxnreg=ptx.count("setmaxnreg"),
                ptx_mma_sync=ptx.count("mma.sync"),
                ptx_tanh_approx=ptx.count("tanh.approx.f32"),
                sass_hgmma=sass.count("HGMMA"),
                sass_utmaldg=sass.count("UTMALDG"),
                sass_utmastg=sass.count("UTMASTG"),
            )
    json.dump(summary, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def aot_compiles(tmp_path_factory):
    """Every distribution's compile, started together: each runs on one core for ~3 minutes, and CI has two.
    {name: (process, stdout path, stderr path)} for the distributions whose python is set."""
    folder = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    started = {}
    for name in TLX_DISTRIBUTIONS:
        if os.environ.get(name):
            out, err = folder / f"{name}.out", folder / f"{name}.err"
            with open(out, "w") as stdout, open(err, "w") as stderr:  # files, not pipes: neither can fill up
                process = subprocess.Popen([os.environ[name], "-c", _SCRIPT, name], cwd=REPO, env=env, stdout=stdout,
                                           stderr=stderr, text=True)
            started[name] = (process, out, err)
    yield started
    for process, _, _ in started.values():
        process.kill()  # a no-op for the finished ones


@pytest.fixture(scope="module", params=TLX_DISTRIBUTIONS)
def aot_summary(request, aot_compiles):
    if request.param not in aot_compiles:
        pytest.skip(f"{request.param} is not set (path to a python whose triton has TLX)")
    process, out, err = aot_compiles[request.param]
    assert process.wait(timeout=1800) == 0, f"AOT subprocess failed:\n{err.read_text()[-8000:]}"
    return request.param, json.loads(out.read_text().strip().splitlines()[-1])


# The tuning variants are the sweeps' (run on the GPU machine's pinned fbtriton): they compile under TLX_PYTHON
# only, which keeps triton-utlx's share of CI's two cores to the kernels that train.
PRODUCTION = {cfg.name for cfg in aot_configs(tuning_variants=False)}


@pytest.mark.parametrize("name", [cfg.name for cfg in aot_configs()])
def test_tlx_kernel_compiles_to_sm90_wgmma_tma(aot_summary, name):
    distribution, summary = aot_summary
    if distribution != "TLX_PYTHON" and name not in PRODUCTION:
        pytest.skip("a tuning variant: compiled under TLX_PYTHON (the pinned fbtriton) only")
    res = summary[name]
    assert res["error"] is None, res["error"]
    assert res["target"].startswith("sm_90"), res["target"]
    assert res["ptx_wgmma"] > 0 and res["sass_hgmma"] > 0, f"no wgmma/HGMMA: {res}"
    assert res["ptx_tma"] > 0 and res["sass_utmaldg"] > 0, f"no TMA loads: {res}"
    assert res["ptx_setmaxnreg"] > 0, f"not warp-specialized (no setmaxnreg): {res}"
    assert res["ptx_mma_sync"] == 0, f"fell back to mma.sync: {res}"
    assert 0 < res["shared"] <= SM90_MAX_SMEM, f"shared memory {res['shared']} B exceeds sm_90's 227 KiB"
    # tlx_config sizes the ring from smem_bytes, so it must never under-count what the compiler
    # allocates. The model is fbtriton 3.7's scratch use (the pinned TLX) and exact there; Triton
    # 3.8 (triton-utlx) needs less scratch, so there it is only an upper bound.
    extra = res["shared"] - res["tuning"]["smem_estimate"]
    assert extra <= SMEM_SLACK, f"SMEM model under-counts by {extra} B (slack {SMEM_SLACK}): {res['tuning']}"
    if res["triton"].startswith("3.7"):
        assert extra >= 0, f"SMEM model over-counts fbtriton 3.7 by {-extra} B: {res['tuning']}"
    # The attention forward stores O by TMA when tuned to; the MLP forward always stores its pre-activation so.
    if res["tuning"].get("O_TMA_STORE") or name.startswith("mlp_"):
        assert res["ptx_tma_store"] > 0 and res["sass_utmastg"] > 0, f"O_TMA_STORE without a TMA store: {res}"
    else:
        assert res["ptx_tma_store"] == 0, f"unexpected TMA store: {res}"
    # The tanh GELU is the special-function unit's instruction, and only where asked for.
    assert (res["ptx_tanh_approx"] > 0) == ("_gelu_tanh" in name), f"tanh.approx.f32 count: {res}"


def test_tlx_module_imports_without_tlx():
    """The dev venv's plain triton has no TLX: the module must import, touch no GPU, and the
    dispatcher must say what is missing and how to get it."""
    import torch

    from kernels import BackendUnavailableError, block_attention
    from kernels import block_attention_tlx as m

    if m.HAS_TLX:
        pytest.skip("this interpreter has TLX installed")
    assert m.BACKEND.name == "tlx" and "fbtriton==3.7.4" in m.BACKEND.how_to_get
    assert not torch.cuda.is_initialized()
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="fbtriton==3.7.4"):
        block_attention(x, x, x, torch.tensor([0, 1], dtype=torch.int32), backend="tlx")


def test_tuning_knobs_are_checked():
    from kernels.block_attention_tlx import tlx_config

    assert tlx_config(64, False, backward=False, overrides={"NUM_STAGES": 2})["NUM_STAGES"] == 2
    with pytest.raises(ValueError, match="unknown TLX bwd tuning knobs \\['O_TMA_STORE'\\]"):
        tlx_config(64, False, backward=True, overrides={"O_TMA_STORE": True})


_DESCRIPTOR_SCRIPT = textwrap.dedent(
    """
    import math
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor
    from kernels.block_attention_tlx import _tma_desc
    packed = torch.zeros(200, 3, 2, 64, dtype=torch.bfloat16)
    cases = [
        (torch.zeros(130, 2, 64, dtype=torch.float16), 64),  # contiguous q
        (packed[:, 1], 64),  # k as a view of a packed projection: strided rows, no copy
        (torch.zeros(130, 32), 32),  # an fp32 cos table
        (torch.zeros(10, 2, 64, dtype=torch.bfloat16), 64),  # fewer rows than a block: padded copy
        (torch.zeros(131 * 128 + 1, dtype=torch.float16)[1:].view(131, 2, 64), 64),  # misaligned: copied
    ]
    for x, cols in cases * 2:  # the second round reuses the first round's validated descriptors
        fast = _tma_desc(x, cols)
        base = fast.base
        assert base.data_ptr() % 16 == 0 and base.shape[0] >= 64
        assert (base is x) == (x.shape[0] >= 64 and x.data_ptr() % 16 == 0), "copied when it need not be, or not when it must"
        full = TensorDescriptor(base, shape=[base.shape[0], math.prod(base.shape[1:])], strides=[base.stride(0), 1],
                                block_shape=[64, cols])
        assert vars(fast).keys() == vars(full).keys(), (vars(fast).keys(), vars(full).keys())
        for key, value in vars(full).items():
            assert (vars(fast)[key] is value) if key == "base" else vars(fast)[key] == value, key
    print("ok")
    """
)


@pytest.mark.parametrize("distribution", TLX_DISTRIBUTIONS)
def test_tma_descriptors_skip_only_a_repeated_validation(distribution):
    """The TLX launcher's descriptors copy one Triton validated: each must equal the descriptor
    TensorDescriptor builds for the same tensor, in every TLX Triton (a version that derives state
    in __post_init__ would fail here). Then the host-overhead benchmark's CPU mode runs the TLX
    backend's whole Python path up to its (stubbed) launches."""
    tlx_python = os.environ.get(distribution)
    if not tlx_python:
        pytest.skip(f"{distribution} is not set (path to a python whose triton has TLX)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([tlx_python, "-c", _DESCRIPTOR_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]
    proc = subprocess.run([tlx_python, "benchmarks/host_profile.py", "--cpu", "--backends", "tlx"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "error" not in proc.stdout, proc.stdout + proc.stderr[-4000:]
    assert "dispatcher_table_fwd_bwd" in proc.stdout, proc.stdout
