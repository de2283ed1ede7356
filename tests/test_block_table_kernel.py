"""The Triton block-table build (kernels.blocks.block_table_triton) against the torch one.

The kernel runs on CPU tensors in Triton's interpreter: triton.jit reads TRITON_INTERPRET when the
kernel is first defined, so it is set here before anything builds a Triton table (scripts/test.sh
sets it for the whole run). The sm_90 compile runs in a subprocess without the interpreter.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import subprocess  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from aot_pythons import AOT_PYTHONS  # noqa: E402
from kernels.blocks import (  # noqa: E402
    ROWS_PER_PROGRAM, block_table, block_table_torch, block_table_triton, max_num_blocks, offsets_from_lengths,
)

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
_random = torch.Generator().manual_seed(0)
CASES = {
    "no_sequences": [],
    "one_empty": [0],
    "single_token": [1],
    "partial": [63],
    "full": [64],
    "one_past_full": [65],
    "two_full": [128],
    "long": [1000],
    "empties_anywhere": [0, 1, 0, 0, 63, 64, 0, 65, 128, 1000, 0],
    # Spans many programs, and a search of 13 steps.
    "many_sequences": torch.randint(0, 601, (5000,), generator=_random).tolist(),
    # Tokens in a few sequences among thousands of empty ones: the table is nearly all unused rows.
    "huge_batch_few_tokens": [0] * 9000 + [70] + [0] * 3000 + [1, 64] + [0] * 500,
}


def _torch_table(offsets: torch.Tensor, total_tokens: int):
    block_start, block_len = block_table_torch(offsets, total_tokens)
    return block_start, block_len, torch.count_nonzero(block_len)


def _assert_same_table(got, want):
    for name, g, w in zip(("block_start", "block_len", "num_blocks"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{name}: {g.dtype} {list(g.shape)} vs {w.dtype} {list(w.shape)}")
        assert torch.equal(g, w), f"{name} differs at rows {(g != w).nonzero().flatten()[:10].tolist()}"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_triton_table_equals_torch_table(case, dtype):
    offsets = offsets_from_lengths(CASES[case]).to(dtype)
    total_tokens = sum(CASES[case])
    _assert_same_table(block_table_triton(offsets, total_tokens), _torch_table(offsets, total_tokens))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 300)), max_size=40))
def test_triton_table_equals_torch_table_on_random_batches(lengths):
    offsets = offsets_from_lengths(lengths)
    _assert_same_table(block_table_triton(offsets, sum(lengths)), _torch_table(offsets, sum(lengths)))


def test_table_spans_several_programs():
    """The many_sequences case must exercise the row masking of more than one program."""
    rows = max_num_blocks(sum(CASES["many_sequences"]), len(CASES["many_sequences"]))
    assert rows > 2 * ROWS_PER_PROGRAM and rows % ROWS_PER_PROGRAM != 0


def test_block_table_on_cpu_is_the_torch_table():
    lengths = CASES["empties_anywhere"]
    offsets = offsets_from_lengths(lengths)
    _assert_same_table(block_table(offsets, sum(lengths)).tensors(), _torch_table(offsets, sum(lengths)))


@pytest.mark.parametrize(
    "offsets", [torch.zeros(0, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32), torch.tensor([0.0, 4.0])],
    ids=["empty", "2d", "float"],
)
def test_bad_offsets_are_named(offsets):
    with pytest.raises(ValueError, match="offsets must be a 1-D int32/int64 tensor"):
        block_table_triton(offsets, 4)


def test_fake_shapes_follow_batch_size_and_tokens():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        offsets = torch.empty(11, dtype=torch.int32)
        block_start, block_len, num_blocks = block_table_triton(offsets, 700)
    rows = max_num_blocks(700, 10)
    assert block_start.shape == block_len.shape == (rows,) and num_blocks.shape == ()
    assert block_start.dtype == block_len.dtype == torch.int32 and num_blocks.dtype == torch.int64


def test_opcheck_custom_op():
    """Schema, fake tensors against the real kernel, and tracing with dynamic shapes."""
    lengths = [0, 5, 64, 130, 0]
    torch.library.opcheck(block_table_triton, (offsets_from_lengths(lengths), sum(lengths)))


def test_compiles_fullgraph_with_dynamic_shapes():
    @torch.compile(fullgraph=True, dynamic=True, backend="aot_eager")
    def table(offsets, tokens):
        return block_table_triton(offsets, tokens.shape[0])

    for lengths in ([3, 0, 70], [64, 1, 1, 200, 5]):
        offsets = offsets_from_lengths(lengths)
        got = table(offsets, torch.empty(sum(lengths)))
        _assert_same_table(got, _torch_table(offsets, sum(lengths)))


# Compiles the kernel for sm_90 with the signature a CUDA launch from block_table_triton produces
# (int32 offsets as the callers pass them), then reads its register/stack/local use from the cubin.
_AOT_SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.blocks import BLOCK_SIZE, ROWS_PER_PROGRAM, block_table_triton, block_table_kernel

    kernel = block_table_kernel()
    types = dict(offsets_ptr="*i32", blocks_through_seq_ptr="*i32", block_start_ptr="*i32", block_len_ptr="*i32",
                 num_blocks_ptr="*i64", num_seqs="i32", num_rows="i32", total_tokens="i32", search_steps="i32",
                 BLOCK="constexpr", ROWS="constexpr")
    assert set(types) == set(kernel.arg_names), sorted(set(types) ^ set(kernel.arg_names))
    source = ASTSource(fn=kernel, signature={name: types[name] for name in kernel.arg_names},
                       constexprs=dict(BLOCK=BLOCK_SIZE, ROWS=ROWS_PER_PROGRAM))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    line = next(l for l in usage.splitlines() if "REG:" in l)
    resources = {k: int(v) for k, v in (field.split(":") for field in line.split() if field.split(":")[0] in
                                        ("REG", "STACK", "LOCAL", "SHARED"))}
    try:
        block_table_triton(torch.tensor([0, 3], dtype=torch.int32), 3)
        cpu_error = ""
    except ValueError as exc:
        cpu_error = str(exc)
    ptx = compiled.asm["ptx"]
    json.dump(dict(resources, target=next(l.split()[1] for l in ptx.splitlines() if l.startswith(".target")),
                   ptx_local=ptx.count(".local"), cpu_error=cpu_error), sys.stdout)
    """
)


@pytest.mark.parametrize("python", AOT_PYTHONS)
def test_kernel_compiles_for_sm90_without_spills(python, tmp_path):
    if not AOT_PYTHONS[python]:
        pytest.skip(f"{python.upper()}_PYTHON is not set")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A fresh cache, so the compile really runs rather than replaying an earlier one.
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([AOT_PYTHONS[python], "-c", _AOT_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stderr[-8000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["target"].startswith("sm_90"), result
    assert result["STACK"] == 0 and result["LOCAL"] == 0 and result["ptx_local"] == 0, f"spills: {result}"
    assert 0 < result["REG"] <= 64, f"more registers than a 4-row-per-thread search needs: {result}"
    # Without the interpreter, CPU tensors are refused with the reason, not handed to the GPU launcher.
    assert "needs CUDA tensors" in result["cpu_error"], result
