"""The fused MLP sublayer: the Triton kernels in the CPU interpreter, judged by kernels.testing.mlp_parity
(the project's one rule), the reference against the unfused nn modules it stands for, the dispatcher's
errors, the custom ops' registrations, and torch.compile. bf16 runs on a GPU only
(tests/test_gpu_parity.py): the interpreter's bf16 tl.dot is wrong.
"""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch import nn  # noqa: E402

from aot_pythons import AOT_PYTHONS, REPO  # noqa: E402
from kernels import check_mlp_backend, mlp_sublayer, mlp_sublayer_reference  # noqa: E402
from kernels.mlp_dispatch import get_mlp_backend  # noqa: E402
from kernels.sublayer_triton import _gelu, _gelu_and_grad  # noqa: E402
from kernels.testing import mlp_parity  # noqa: E402

# x's dtype, the matmuls' dtype: plain fp32 (exact), plain fp16, and fp32 x with fp16 matmuls (autocast's split).
DTYPES = {"fp32": (torch.float32, torch.float32), "fp16": (torch.float16, torch.float16),
          "fp32_x_fp16_matmul": (torch.float32, torch.float16)}


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("tokens", (1, 63, 64, 200))  # one row, a partial tile, one full tile, several + partial
@pytest.mark.parametrize("d_model,hidden", ((32, 64), (64, 256), (64, 96)))  # 96: 32-wide hidden chunks
def test_triton_parity(d_model, hidden, tokens, dtypes):
    x_dtype, compute_dtype = DTYPES[dtypes]
    result = mlp_parity("triton", tokens=tokens, d_model=d_model, hidden=hidden, x_dtype=x_dtype,
                        compute_dtype=compute_dtype)
    assert result.ok, result.summary()


def test_triton_parity_at_the_gpu_configs_width():
    """d_model 256 with the 4x hidden: the width configs/gpu.yaml trains (a [64, 256] accumulator)."""
    result = mlp_parity("triton", tokens=70, d_model=256, hidden=1024, x_dtype=torch.float32,
                        compute_dtype=torch.float16)
    assert result.ok, result.summary()


@triton.jit
def _gelu_kernel(h_ptr, gelu_ptr, gelu_again_ptr, grad_ptr, N, BLOCK: tl.constexpr, TANH_GELU: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(h_ptr + offs, mask=mask, other=0.0)
    gelu, grad = _gelu_and_grad(h, TANH_GELU)
    tl.store(gelu_ptr + offs, _gelu(h, TANH_GELU), mask=mask)
    tl.store(gelu_again_ptr + offs, gelu, mask=mask)
    tl.store(grad_ptr + offs, grad, mask=mask)


@pytest.mark.parametrize("approximate", ("none", "tanh"))
def test_gelu_matches_fp64(approximate):
    """The kernels' GELU and its derivative (kernels/sublayer_triton.py: Φ from tl.erf, or the tanh form)
    against fp64 autograd of F.gelu, over the range where fp32 GELU is not yet 0 or the identity, and the
    edges beyond it. (The interpreter's tanh is the portable one; the GPU's hardware tanh is held to the
    parity rule by the GPU tests.)"""
    h = torch.cat([torch.linspace(-14, 14, 40_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0])])
    gelu, gelu_again, grad = (torch.empty_like(h) for _ in range(3))
    _gelu_kernel[(triton.cdiv(h.numel(), 1024),)](h, gelu, gelu_again, grad, h.numel(), BLOCK=1024,
                                                   TANH_GELU=approximate == "tanh")
    h64 = h.double().requires_grad_()
    gelu64 = torch.nn.functional.gelu(h64, approximate=approximate)
    (grad64,) = torch.autograd.grad(gelu64.sum(), h64)
    scale = h64.detach().abs().clamp(min=1)
    assert ((gelu.double() - gelu64.detach()).abs() / scale).max() < 3e-7
    assert torch.equal(gelu, gelu_again)
    assert ((grad.double() - grad64).abs() / scale).max() < 1e-6
    assert gelu.isfinite().all() and grad.isfinite().all()


@pytest.mark.parametrize("tokens", (1, 64, 100))
@pytest.mark.parametrize("backend,launch", (("triton", None), ("triton", {"fwd": {"plan": "tiles"},
                                                                           "bwd": {"plan": "tiles"}})))
def test_triton_parity_tanh_gelu(backend, launch, tokens):
    """approximate="tanh" through both plans: each GELU and GELU' site (the tiles kernels, the output GEMM's
    prologue, the hidden-gradient GEMM's epilogue) against the tanh-form references. Hidden 192: the tanh form's
    128-column backward tiles, one whole and one masked."""
    result = mlp_parity(backend, tokens=tokens, d_model=32, hidden=192, x_dtype=torch.float32,
                        compute_dtype=torch.float16, launch=launch, approximate="tanh")
    assert result.ok, result.summary()


def test_tanh_gelu_is_not_the_exact_one():
    """The switch reaches the math: the tanh form's output differs from the exact one's (by ~1e-3 at most),
    so the tanh parity above could not pass on the exact kernels."""
    leaves = _leaves(64, 32, 64, torch.float32)
    exact, tanh = (mlp_sublayer(*leaves, approximate=a, backend="triton") for a in ("none", "tanh"))
    assert not torch.equal(exact, tanh)
    assert torch.allclose(tanh, mlp_sublayer_reference(*leaves, approximate="tanh"), atol=1e-5)


def test_parity_rule_catches_a_wrong_gradient(monkeypatch):
    """The rule is not vacuous: a kernel whose LayerNorm-weight gradient is off by 1% fails it, on that
    gradient alone."""
    import kernels.mlp_dispatch as dispatcher
    import kernels.mlp_sublayer_triton as triton_mlp

    def skewed(*args):
        *gradients, column_parts = triton_mlp._backward(*args)
        skew = torch.tensor([1.01, 1.0, 1.0])[:, None]  # the LN weight's row of the partial sums
        return *gradients, column_parts * skew

    run = dispatcher.mlp_kernel_ops("triton_skewed_for_test", triton_mlp._forward, skewed)
    monkeypatch.setitem(dispatcher.BACKENDS.loaded, "triton", dataclasses.replace(get_mlp_backend("triton"), run=run))
    result = mlp_parity("triton", tokens=100, d_model=32, hidden=64, x_dtype=torch.float32)
    assert {failure.split()[0] for failure in result.failures} == {"dnorm_weight"}


def _leaves(tokens, d_model, hidden, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator) * scale + shift).to(dtype)

    return [draw(tokens, d_model), draw(d_model, scale=0.1, shift=1.0), draw(d_model, scale=0.1),
            draw(hidden, d_model, scale=d_model ** -0.5), draw(hidden, scale=0.1),
            draw(d_model, hidden, scale=hidden ** -0.5), draw(d_model, scale=0.1)]


def _out_and_grads(fn, leaves, grad_y):
    leaves = [x.detach().requires_grad_() for x in leaves]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_y)]


def test_reference_is_the_unfused_modules():
    """The reference is exactly the model's unfused path (nn.LayerNorm, Linear, GELU, Linear, residual),
    outputs and gradients, in fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    norm, up, down = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(32))
        norm.bias.add_(0.1 * torch.randn(32))
    x, grad_y = torch.randn(50, 32, requires_grad=True), torch.randn(50, 32)
    leaves = [x, norm.weight, norm.bias, up.weight, up.bias, down.weight, down.bias]
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            unfused = x + down(nn.functional.gelu(up(norm(x))))
            fused = mlp_sublayer(*leaves, backend="reference")
        for a, b in zip([unfused, *torch.autograd.grad(unfused, leaves, grad_y)],
                        [fused, *torch.autograd.grad(fused, leaves, grad_y)]):
            assert a.dtype == b.dtype
            assert torch.equal(a, b)


def test_autocast_picks_the_matmul_dtype():
    """Under autocast the kernel's matmuls run in the autocast dtype (as nn.Linear's would), and
    the result and gradients keep the parameters' and x's fp32."""
    leaves = _leaves(40, 32, 64, torch.float32, seed=3)
    grad_y = torch.randn(40, 32)
    with torch.autocast("cpu", dtype=torch.float16):
        fused = _out_and_grads(lambda *x: mlp_sublayer(*x, backend="triton"), leaves, grad_y)
    reference = _out_and_grads(lambda *x: mlp_sublayer_reference(*x, compute_dtype=torch.float16), leaves, grad_y)
    plain_fp32 = _out_and_grads(lambda *x: mlp_sublayer(*x, backend="triton"), leaves, grad_y)
    for got, ref, exact in zip(fused, reference, plain_fp32):
        assert got.dtype == torch.float32
        # fp16 matmul error, not fp32's: the autocast dtype was used.
        assert (got - exact).abs().max() > 1e-6
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_empty_batch():
    leaves = [x.requires_grad_() for x in _leaves(0, 32, 64, torch.float32)]
    for backend in ("triton", "reference"):
        y = mlp_sublayer(*leaves, backend=backend)
        assert y.shape == (0, 32)
        grads = torch.autograd.grad(y, leaves, torch.zeros_like(y))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_bad_inputs_get_clear_errors():
    leaves = _leaves(10, 32, 64, torch.float32)
    x, nw, nb, w1, b1, w2, b2 = leaves
    cases = {
        "x must be \\(total_tokens, d_model\\)": (x[None], nw, nb, w1, b1, w2, b2),
        "w2 has shape \\(64, 32\\)": (x, nw, nb, w1, b1, w2.t(), b2),
        "norm_weight has shape \\(16,\\)": (x, nw[:16], nb, w1, b1, w2, b2),
        "x must be a floating-point tensor": (x.long(), nw, nb, w1, b1, w2, b2),
    }
    for expected, args in cases.items():
        with pytest.raises(ValueError, match=expected):
            mlp_sublayer(*args)
    with pytest.raises(ValueError, match="unknown mlp_sublayer backend 'fa2'"):
        mlp_sublayer(*leaves, backend="fa2")
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="GELU approximate 'erf'.*'none', 'tanh'"):
            mlp_sublayer(*leaves, approximate="erf", backend=backend)
    with pytest.raises(ValueError, match="d_model 24"):
        mlp_sublayer(*_leaves(4, 24, 64, torch.float32), backend="triton")
    with pytest.raises(ValueError, match="bfloat16 on CPU"):
        mlp_sublayer(*_leaves(4, 32, 64, torch.bfloat16), backend="triton")
    with pytest.raises(ValueError, match="unknown Triton mlp_sublayer fwd launch settings"):
        mlp_sublayer(*leaves, backend="triton", launch={"fwd": {"warps": 2}})
    # auto on a CPU is the reference, which has no launch settings.
    with pytest.raises(ValueError, match="no launch settings"):
        mlp_sublayer(*leaves, launch={"fwd": {"num_warps": 2}})


def test_launch_overrides_change_the_tiling_not_the_result():
    leaves = _leaves(100, 32, 64, torch.float32, seed=5)
    grad_y = torch.randn(100, 32)
    default = _out_and_grads(lambda *x: mlp_sublayer(*x, backend="triton"), leaves, grad_y)
    small_tiles = _out_and_grads(lambda *x: mlp_sublayer(*x, backend="triton", launch={
        "fwd": {"block_m": 16}, "bwd": {"block_m": 32}}), leaves, grad_y)
    for a, b in zip(default, small_tiles):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


_SM90_GEMMS_SCRIPT = """
import os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from kernels.mlp_sublayer_triton import _hidden_grad_gemm, launch_config
from kernels.sublayer_triton import _bias_gemm, _residual_gemm
from kernels.tlx_aot import ast_source

bf16 = "*bf16"
# The forward's tiles are the same in both GELU forms, the backward's are not. The first GEMM has no GELU; the
# other two take it in each form.
fwd = launch_config("fwd", 256)
kernels = [(_bias_gemm, dict(a_ptr=bf16, w_ptr=bf16, b_ptr=bf16, out_ptr=bf16, T="i32", N="i32"),
            dict(K=256, BLOCK_M=fwd.block_m, BLOCK_N=fwd.block_n, BLOCK_K=64), fwd)]
assert launch_config("fwd", 256, "", "tanh") == fwd
for approximate in ("none", "tanh"):
    bwd = launch_config("bwd", 256, "", approximate)
    tanh = approximate == "tanh"
    kernels += [
        (_residual_gemm, dict(a_ptr=bf16, w_ptr=bf16, b_ptr=bf16, x_ptr="*fp32", y_ptr="*fp32", T="i32", K="i32",
                              x_stride="i32"), dict(D=256, BLOCK_M=fwd.block_m, BLOCK_K=64, GELU_PROLOGUE=True,
                                                    TANH_GELU=tanh), fwd),
        (_hidden_grad_gemm, dict(grad_out_ptr=bf16, w2_ptr=bf16, hidden_ptr=bf16, grad_hidden_ptr=bf16,
                                 activation_ptr=bf16, db1_parts_ptr="*fp32", T="i32", H="i32"),
         dict(D=256, BLOCK_M=bwd.block_m, BLOCK_N=bwd.block_n, BLOCK_K=64, TANH_GELU=tanh), bwd),
    ]
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for fn, signature, constexprs, config in kernels:
    source = ast_source(fn, signature, dict(constexprs, DOT_PRECISION="tf32"),
                        [name for name in signature if name.endswith("_ptr")])
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    ptx = compiled.asm["ptx"]
    assert "wgmma" in ptx, fn.__name__
    # The tanh GELU is the special-function unit's one instruction, and only where asked for.
    assert ("tanh.approx.f32" in ptx) == constexprs.get("TANH_GELU", False), fn.__name__
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    stack = next(int(field.split(":")[1]) for field in usage.split() if field.startswith("STACK:"))
    print(fn.__name__, constexprs.get("TANH_GELU"), "stack", stack, "ok")
"""


@pytest.mark.parametrize("python", AOT_PYTHONS)
def test_gemms_compile_for_sm90(python, tmp_path):
    """The "gemms" plan's three Triton GEMMs at their default tiles, with GELU in both forms, compile for an H100/H200
    (sm_90, wgmma) at configs/gpu.yaml's width, as a GPU run would (a process without the interpreter), under the dev
    venv's Triton and the TLX distributions' (which the GPU runs). The hidden-gradient GEMM, the backward's largest
    kernel, spills no registers at its default tiles: its epilogue's per-element 64-bit offsets spilled 312 bytes at
    64 x 128 in the tanh form under fbtriton before they became a 64-bit tile start plus 32-bit offsets."""
    import subprocess

    if not AOT_PYTHONS[python]:
        pytest.skip(f"{python.upper()}_PYTHON is not set")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([AOT_PYTHONS[python], "-c", _SM90_GEMMS_SCRIPT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.endswith(" ok")]
    assert len(lines) == 5, proc.stdout
    hidden_grad = [line for line in lines if line.startswith("_hidden_grad_gemm")]
    assert len(hidden_grad) == 2 and all(" stack 0 ok" in line for line in hidden_grad), proc.stdout


@pytest.mark.parametrize("tokens", (1, 100, 300))
def test_plans_agree(tokens):
    """The "gemms" plans (GEMMs with the elementwise work in their prologues and epilogues, cuBLAS,
    LayerNorm kernels) compute what the "tiles" plans (token-tile kernels) do, in fp32 up to
    summation order; tokens and a hidden width that are not multiples of the tiles leave masked edges."""
    leaves = _leaves(tokens, 32, 48, torch.float32, seed=9)
    grad_y = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(10))
    tiles = _out_and_grads(lambda *x: mlp_sublayer(*x, backend="triton", launch={
        "fwd": {"plan": "tiles"}, "bwd": {"plan": "tiles"}}), leaves, grad_y)
    gemm_tiles = {"plan": "gemms", "block_m": 64, "block_n": 32}
    gemms = _out_and_grads(lambda *x: mlp_sublayer(*x, backend="triton", launch={
        "fwd": gemm_tiles, "bwd": gemm_tiles}), leaves, grad_y)
    for a, b in zip(gemms, tiles):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown Triton mlp_sublayer bwd plan 'fused'"):
        mlp_sublayer(*leaves, backend="triton", launch={"bwd": {"plan": "fused"}})


@pytest.mark.parametrize("dtypes", ("fp16", "fp32_x_fp16_matmul"))
def test_triton_parity_tiles_plans(dtypes):
    """The "tiles" plans by the project's rule (the parity matrix above runs the default "gemms")."""
    x_dtype, compute_dtype = DTYPES[dtypes]
    for tokens in (1, 200):
        result = mlp_parity("triton", tokens=tokens, d_model=64, hidden=96, x_dtype=x_dtype,
                            compute_dtype=compute_dtype, launch={"fwd": {"plan": "tiles"}, "bwd": {"plan": "tiles"}})
        assert result.ok, result.summary()


def test_custom_ops_pass_opcheck():
    """Schemas, fake (meta) implementations against the real kernels, and autograd registration."""
    leaves = _leaves(70, 32, 64, torch.float32, seed=4)
    ops = get_mlp_backend("triton").ops
    for args in (leaves, [x.clone().requires_grad_() for x in leaves]):
        torch.library.opcheck(ops.forward_op, (*args, 1e-5, "none", ""))
    y, hidden, mean, rstd = ops.forward_op(*leaves, 1e-5, "tanh", "")
    x, nw, nb, w1, b1, w2, b2 = leaves
    torch.library.opcheck(ops.backward_op, (torch.randn_like(y), x, nw, nb, w1, b1, w2, hidden, mean, rstd, 1e-5,
                                            "tanh", ""))


def test_public_api_compiles_without_graph_breaks():
    leaves = _leaves(70, 32, 64, torch.float32, seed=6)
    grad_y = torch.randn(70, 32)
    check_mlp_backend("triton", "cpu")  # imports the backend before compiling, as train.py does

    def sublayer(*x):
        return mlp_sublayer(*x, backend="triton")

    compiled = torch.compile(sublayer, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    for a, b in zip(_out_and_grads(compiled, leaves, grad_y), _out_and_grads(sublayer, leaves, grad_y)):
        assert torch.equal(a, b)


def test_layer_norm_backward_kernel_matches_autograd():
    """The standalone LayerNorm-backward kernel (the TLX backward's second pass): dx (with the
    residual's grad_y) and the affine's partial sums, against autograd of F.layer_norm, fp32."""
    from kernels.sublayer_triton import layer_norm_backward

    generator = torch.Generator().manual_seed(11)
    tokens, d_model = 100, 64
    x = torch.randn(tokens, d_model, generator=generator) * 2 + 1
    weight, bias = 1 + 0.1 * torch.randn(d_model, generator=generator), 0.1 * torch.randn(d_model, generator=generator)
    grad_normed, grad_y = torch.randn(tokens, d_model, generator=generator), torch.randn(tokens, d_model, generator=generator)
    mean = x.mean(1)
    rstd = torch.rsqrt(x.var(1, unbiased=False) + 1e-5)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    normed = nn.functional.layer_norm(leaves[0], (d_model,), leaves[1], leaves[2], 1e-5)
    dx_ref, dw_ref, db_ref = torch.autograd.grad(normed, leaves, grad_normed)
    for store_normed in (False, True):
        dx = torch.empty_like(x)
        written = torch.full_like(x, float("nan")) if store_normed else None
        dnw, dnb, grad_y_sum = layer_norm_backward(grad_normed, grad_y, x, mean, rstd, weight, bias, dx,
                                                   written).sum(0)
        torch.testing.assert_close(dx, dx_ref + grad_y, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dnw, dw_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dnb, db_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_y_sum, grad_y.sum(0), rtol=1e-5, atol=1e-5)
        if store_normed:
            torch.testing.assert_close(written, normed.detach(), rtol=1e-5, atol=1e-5)


def test_tlx_configs_fit_and_knobs_are_checked():
    """Every TLX configuration fits sm_90's shared memory (the AOT test holds the model to the
    compiler), d_model 256's backward takes one consumer to keep a two-slot ring, and unknown or
    impossible knobs are refused with the reason."""
    from kernels.mlp_sublayer_tlx import SUPPORTED_D_MODELS, smem_bytes, tlx_mlp_config
    from kernels.block_attention_tlx import SM90_MAX_SMEM

    for d_model in SUPPORTED_D_MODELS:
        for backward in (False, True):
            cfg = tlx_mlp_config(d_model, backward=backward)
            assert cfg["NUM_STAGES"] >= 2
            assert smem_bytes(d_model, cfg["NUM_STAGES"], cfg["NUM_CONSUMERS"], backward) <= SM90_MAX_SMEM
    assert tlx_mlp_config(256, backward=True)["NUM_CONSUMERS"] == 1
    with pytest.raises(ValueError, match="unknown TLX mlp_sublayer fwd tuning knobs"):
        tlx_mlp_config(256, (("TRITON_BACKWARD", True),))
    with pytest.raises(ValueError, match="needs .* B of shared memory"):
        tlx_mlp_config(256, (("NUM_STAGES", 4),))


def test_benchmark_runs_variants_on_cpu(tmp_path):
    """benchmarks/bench_sublayer.py end to end at a tiny shape: every row timed and checked
    against the unfused path, a --variant row labelled as given and run with its launch settings."""
    import json

    from benchmarks import bench_sublayer

    out = tmp_path / "mlp"
    bench_sublayer.main(["--out", str(out), "--device", "cpu", "--tokens", "80", "--d-model", "32", "--hidden",
                             "64", "--dtype", "float32", "--impls", "unfused_eager", "triton", "--warmup-ms", "1",
                             "--rep-ms", "1", "--variant", "triton_tiles_bwd", "triton",
                             '{"bwd": {"plan": "tiles"}}', "--variant", "bad_plan", "triton",
                             '{"bwd": {"plan": "nope"}}'])
    rows = {row["impl"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"unfused_eager", "triton", "triton_tiles_bwd", "bad_plan"}
    for name in ("unfused_eager", "triton", "triton_tiles_bwd"):
        assert "error" not in rows[name] and rows[name]["fwd+bwd_ms"] > 0 and rows[name]["check_rel_err"] < 1e-5
    assert rows["triton_tiles_bwd"]["backend"] == "triton"
    assert rows["triton_tiles_bwd"]["launch"] == {"bwd": {"plan": "tiles"}}
    assert "unknown Triton mlp_sublayer bwd plan 'nope'" in rows["bad_plan"]["error"]
    assert "triton_tiles_bwd" in out.with_suffix(".md").read_text()


def test_benchmark_takes_the_tanh_gelu(tmp_path):
    """--mlp-gelu tanh reaches every row: the kernel row agrees with the tanh-form unfused row to fp32 rounding
    (an exact-GELU row differs by far more), and the report says which GELU ran."""
    import json

    from benchmarks import bench_sublayer

    out = tmp_path / "mlp_tanh"
    bench_sublayer.main(["--out", str(out), "--device", "cpu", "--tokens", "80", "--d-model", "32", "--hidden", "64",
                         "--dtype", "float32", "--impls", "unfused_eager", "triton", "--warmup-ms", "1", "--rep-ms", "1",
                         "--mlp-gelu", "tanh"])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["shape"]["gelu"] == "tanh"
    assert all("error" not in row and row["check_rel_err"] < 1e-6 for row in report["rows"])
    assert "GELU in its tanh form" in out.with_suffix(".md").read_text()


def test_eager_calls_skip_the_custom_ops():
    """Eager calls run the launchers through an autograd.Function (the ops' dispatch costs host
    time); what traces (here make_fx) still sees the custom ops. Same bits either way: see
    test_public_api_compiles_without_graph_breaks."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves = [t.requires_grad_() for t in _leaves(70, 32, 64, torch.float32, seed=6)]

    def ops_called(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            fn()
        return {e.name for e in profiler.events() if e.name.startswith("mlp_sublayer::")}

    def forward_backward():
        y = mlp_sublayer(*leaves, backend="triton")
        torch.autograd.grad(y.sum(), leaves)

    assert ops_called(forward_backward) == set()
    assert ops_called(lambda: mlp_sublayer(*[t.detach() for t in leaves], backend="triton")) == set()
    graph = make_fx(lambda *t: mlp_sublayer(*t, backend="triton"))(*[t.detach() for t in leaves])
    assert "mlp_sublayer.triton_forward" in str(graph.code)
