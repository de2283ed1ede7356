"""requirements/gpu.txt is the one list of GPU versions: it parses, it agrees with pyproject.toml where
both pin a package, and the GPU scripts (setup.sh --gpu, gpu_install.sh, the pack scripts) take their
versions from it instead of spelling them out. Whether the list resolves for manylinux cp311/cp312
needs an index, so it is checked by hand (the command is in requirements/gpu.txt), not here."""

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
GPU_LIST = REPO / "requirements" / "gpu.txt"
# The packages whose versions differ from the CPU stack: the CUDA release line the list chooses.
GPU_LINE = ["torch", "fbtriton", "fbgemm-gpu", "torchrec"]
GPU_SCRIPTS = ["setup.sh", "gpu_install.sh", "pack_fbtriton_slim.sh", "pack_fbgemm_gpu_slim.sh"]


def requirements(lines):
    reqs = [Requirement(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    return {req.name.lower(): req for req in reqs}


def gpu_list():
    return requirements(GPU_LIST.read_text().splitlines())


def pin(name, gpu_list_path=GPU_LIST):
    """scripts/gpu_pins.sh's `pin NAME`, as the scripts call it."""
    command = f'source scripts/gpu_pins.sh && GPU_REQUIREMENTS="{gpu_list_path}" && pin {name}'
    return subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True)


def test_gpu_line_is_pinned_exactly_and_carries_no_cpu_builds():
    listed = gpu_list()
    for name in GPU_LINE:
        (spec,) = listed[name].specifier
        assert spec.operator == "==", f"{name} must be pinned with =="
    # fbgemm-gpu-cpu would share the CUDA build's `fbgemm_gpu` module; plain triton, fbtriton's `triton`.
    assert "fbgemm-gpu-cpu" not in listed and "triton" not in listed


def test_shared_pins_agree_with_pyproject():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    cpu = requirements(pyproject["project"]["dependencies"])
    for name, req in gpu_list().items():
        if name in GPU_LINE:
            continue
        assert name in cpu, f"{name} is in requirements/gpu.txt but not in pyproject.toml"
        assert (req.specifier, req.extras) == (cpu[name].specifier, cpu[name].extras), name


def test_pin_reads_the_list_and_names_what_is_missing(tmp_path):
    for name in GPU_LINE:
        result = pin(name)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str(next(iter(gpu_list()[name].specifier)).version)
    other = tmp_path / "gpu.txt"
    other.write_text("torchrec==9.9.9\nfbtriton>=3\n")
    assert pin("torchrec", other).stdout.strip() == "9.9.9"
    missing = pin("fbtriton", other)  # listed, but not pinned exactly
    assert missing.returncode == 2 and "pins no fbtriton==VERSION" in missing.stderr


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_scripts_take_versions_from_the_list(script):
    text = (REPO / "scripts" / script).read_text()
    versions = {name: str(next(iter(gpu_list()[name].specifier)).version) for name in GPU_LINE}
    if script == "setup.sh":
        gpu_path, cpu_path = text.split("exit\nfi\n")
        assert "-r requirements/gpu.txt" in gpu_path and '"fbtriton==$(pin fbtriton)"' in gpu_path
        # The CPU path's TLX compile venv pins fbtriton itself (CI's path stays as it is): the same version.
        assert re.findall(r"fbtriton==([\w.]+)", cpu_path) == [versions["fbtriton"]]
        text = gpu_path
    for name in GPU_LINE:
        spelled = re.findall(rf"\b{name.replace('-', '[-_]')}(?:==|-)\d[\w.]*", text)
        assert not spelled, f"scripts/{script} spells out {spelled}; use $(pin {name})"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_setup_gpu_without_a_driver_exits_2_before_installing(tmp_path):
    for path in ["scripts/setup.sh", "scripts/gpu_pins.sh", "requirements/gpu.txt"]:
        (tmp_path / path).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / path, tmp_path / path)
    # A python3 that records being called: nothing may be installed when the check fails.
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path}/python_ran\nexit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "scripts/setup.sh", "--gpu"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == "setup.sh --gpu: no NVIDIA driver here (nvidia-smi failed)\n"
    assert not (tmp_path / "python_ran").exists() and not (tmp_path / ".venv").exists()
