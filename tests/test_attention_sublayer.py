"""The fused attention sublayer: the Triton backend in the CPU interpreter, judged by
kernels.testing.attention_sublayer_parity (the project's one rule), the reference against the unfused
modules it stands for, the dispatcher's errors, the custom ops' registrations, and torch.compile.
bf16 and the tlx backend run on a GPU only (tests/test_gpu_parity.py)."""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from kernels import (  # noqa: E402
    BackendUnavailableError,
    Rotary,
    attention_sublayer,
    attention_sublayer_reference,
    block_attention,
    block_table,
    check_attention_sublayer_backend,
)
from kernels.attention_sublayer_dispatch import get_attention_sublayer_backend  # noqa: E402
from kernels.testing import attention_sublayer_parity  # noqa: E402

# x's dtype, the matmuls' dtype: plain fp32 (exact), plain fp16, and fp32 x with fp16 matmuls (autocast's split).
DTYPES = {"fp32": (torch.float32, torch.float32), "fp16": (torch.float16, torch.float16),
          "fp32_x_fp16_matmul": (torch.float32, torch.float16)}
ROTARY = {"none": None, "qk": Rotary(), "qkv": Rotary(rotate_v=True)}
# The Triton backend's plans (kernels/attention_sublayer_kernels.py): GEMMs around the attention
# kernel, and one kernel per 64-token block (kernels/attention_sublayer_blocks.py).
PLANS = {"gemms": None, "blocks": {"fwd": {"plan": "blocks"}, "bwd": {"plan": "blocks"}}}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_triton_parity(dtypes, rotary, plan):
    """Ragged lengths with an empty sequence, one token, both sides of a block edge and several blocks."""
    x_dtype, compute_dtype = DTYPES[dtypes]
    result = attention_sublayer_parity("triton", x_dtype=x_dtype, compute_dtype=compute_dtype, rotary=ROTARY[rotary],
                                       launch=PLANS[plan])
    assert result.ok, result.summary()


@pytest.mark.parametrize("plan", PLANS)
def test_triton_parity_at_the_gpu_configs_width(plan):
    """d_model 256 in 4 heads of 64: configs/gpu.yaml's layer (the output GEMM's [rows, 256] accumulator)."""
    result = attention_sublayer_parity("triton", lengths=(70, 3), num_heads=4, head_dim=64, x_dtype=torch.float32,
                                       compute_dtype=torch.float16, rotary=Rotary(), launch=PLANS[plan])
    assert result.ok, result.summary()


@pytest.mark.parametrize("launch", [{"fwd": {"plan": "blocks"}}, {"bwd": {"plan": "blocks", "num_warps": 4}}],
                         ids=["blocks_fwd_only", "blocks_bwd_only"])
def test_the_plans_mix_and_each_runs_its_kernels(launch, monkeypatch):
    """Either pass alone on the per-block kernel, the other on the GEMMs (both save the same tensors),
    judged by the rule at head_dim 128; and the per-block launcher is the one that ran."""
    import kernels.attention_sublayer_kernels as sublayer_kernels

    calls = []
    for name in ("forward_blocks", "backward_blocks"):
        launcher = getattr(sublayer_kernels, name)
        monkeypatch.setattr(sublayer_kernels, name, lambda *a, _name=name, _launcher=launcher: (
            calls.append(_name), _launcher(*a))[1])
    result = attention_sublayer_parity("triton", lengths=(130, 5), num_heads=1, head_dim=128, x_dtype=torch.float16,
                                       rotary=Rotary(rotate_v=True), launch=launch)
    assert result.ok, result.summary()
    # Two forward-and-backward runs (the rule checks they are bitwise equal).
    assert calls == ["forward_blocks" if "fwd" in launch else "backward_blocks"] * 2


def test_parity_rule_catches_a_wrong_gradient(monkeypatch):
    """The rule is not vacuous: a kernel whose projection-bias gradient is off by 1% fails it, on that
    gradient alone."""
    import kernels.attention_sublayer_dispatch as dispatcher
    import kernels.attention_sublayer_kernels as sublayer_kernels

    forward, backward = sublayer_kernels._launchers("triton")

    def skewed(*args):
        dx, dnw, dnb, dw_qkv, db_qkv, dw_out, db_out = backward(*args)
        return dx, dnw, dnb, dw_qkv, db_qkv * 1.01, dw_out, db_out

    run = dispatcher.attention_sublayer_ops("triton_skewed_for_test", forward, skewed)
    monkeypatch.setitem(dispatcher.BACKENDS.loaded, "triton", dataclasses.replace(get_attention_sublayer_backend("triton"),
                                                                          run=run))
    result = attention_sublayer_parity("triton", lengths=(100,), x_dtype=torch.float32)
    assert {failure.split()[0] for failure in result.failures} == {"db_qkv"}


def _layer(d_model=64, num_heads=2, seed=0):
    torch.manual_seed(seed)
    norm, qkv, out = nn.LayerNorm(d_model), nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(d_model))
        norm.bias.add_(0.1 * torch.randn(d_model))
    return norm, qkv, out


def _leaves(tokens, d_model=64, dtype=torch.float32, seed=0):
    norm, qkv, out = _layer(d_model, seed=seed)
    x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(seed))
    return [t.detach().to(dtype) for t in (x, norm.weight, norm.bias, qkv.weight, qkv.bias, out.weight, out.bias)]


def _out_and_grads(fn, leaves, grad_y):
    leaves = [x.detach().requires_grad_() for x in leaves]
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, grad_y)]


def test_reference_is_the_unfused_modules():
    """The reference is exactly the model's unfused path (nn.LayerNorm, Linear, block attention's
    reference backend with rotary, Linear, residual), outputs and gradients, in fp32 and under
    bf16 autocast."""
    norm, qkv, out = _layer()
    offsets = torch.tensor([0, 5, 70, 90], dtype=torch.int32)
    x, grad_y = torch.randn(90, 64, requires_grad=True), torch.randn(90, 64)
    leaves = [x, norm.weight, norm.bias, qkv.weight, qkv.bias, out.weight, out.bias]
    rotary = Rotary(rotate_v=True)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            q, k, v = qkv(norm(x)).view(90, 3, 2, 32).unbind(1)
            attn = block_attention(q, k, v, offsets, rotary=rotary, backend="reference")
            unfused = x + out(attn.reshape(90, 64))
            fused = attention_sublayer(x, offsets, *leaves[1:], num_heads=2, rotary=rotary, backend="reference")
        for a, b in zip([unfused, *torch.autograd.grad(unfused, leaves, grad_y)],
                        [fused, *torch.autograd.grad(fused, leaves, grad_y)]):
            assert a.dtype == b.dtype
            assert torch.equal(a, b)


def test_autocast_picks_the_matmul_dtype():
    """Under autocast the kernels' matmuls and attention run in the autocast dtype (as the unfused
    path's would), and the result and gradients keep the parameters' and x's fp32."""
    leaves = _leaves(80, seed=3)
    offsets = torch.tensor([0, 80], dtype=torch.int32)
    grad_y = torch.randn(80, 64)

    def fused(*x):
        return attention_sublayer(x[0], offsets, *x[1:], num_heads=2, backend="triton")

    with torch.autocast("cpu", dtype=torch.float16):
        half = _out_and_grads(fused, leaves, grad_y)
    reference = _out_and_grads(lambda *x: attention_sublayer_reference(x[0], offsets, *x[1:], 2,
                                                                       compute_dtype=torch.float16), leaves, grad_y)
    plain_fp32 = _out_and_grads(fused, leaves, grad_y)
    for got, ref, exact in zip(half, reference, plain_fp32):
        assert got.dtype == torch.float32
        # fp16 matmul error, not fp32's: the autocast dtype was used.
        assert (got - exact).abs().max() > 1e-6
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_empty_batch():
    leaves = [x.requires_grad_() for x in _leaves(0)]
    for offsets in (torch.tensor([0], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32)):
        for backend, launch in (("triton", None), ("triton", PLANS["blocks"]), ("reference", None)):
            y = attention_sublayer(leaves[0], offsets, *leaves[1:], num_heads=2, rotary=Rotary(), backend=backend,
                                   launch=launch)
            assert y.shape == (0, 64)
            grads = torch.autograd.grad(y, leaves, torch.zeros_like(y))
            assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_a_block_table_and_offsets_give_the_same_bits():
    """A model builds the BlockTable once per batch and passes it to every layer."""
    leaves = _leaves(130, seed=2)
    offsets = torch.tensor([0, 1, 130], dtype=torch.int32)
    by_offsets = attention_sublayer(leaves[0], offsets, *leaves[1:], num_heads=2, backend="triton")
    by_table = attention_sublayer(leaves[0], block_table(offsets, 130), *leaves[1:], num_heads=2, backend="triton")
    assert torch.equal(by_offsets, by_table)


def test_bad_inputs_get_clear_errors():
    leaves = _leaves(10)
    x, nw, nb, w_qkv, b_qkv, w_out, b_out = leaves
    offsets = torch.tensor([0, 4, 10], dtype=torch.int32)
    cases = {
        "x must be \\(total_tokens, d_model\\)": (x[None], nw, nb, w_qkv, b_qkv, w_out, b_out),
        "w_qkv has shape \\(64, 192\\)": (x, nw, nb, w_qkv.t(), b_qkv, w_out, b_out),
        "b_out has shape \\(32,\\)": (x, nw, nb, w_qkv, b_qkv, w_out, b_out[:32]),
        "x must be a floating-point tensor": (x.long(), nw, nb, w_qkv, b_qkv, w_out, b_out),
    }
    for expected, args in cases.items():
        with pytest.raises(ValueError, match=expected):
            attention_sublayer(args[0], offsets, *args[1:], num_heads=2)
    with pytest.raises(ValueError, match="num_heads=3 must be >= 1 and divide d_model=64"):
        attention_sublayer(x, offsets, *leaves[1:], num_heads=3)
    with pytest.raises(ValueError, match="offsets\\[-1\\] = 9 must equal total_tokens = 10"):
        attention_sublayer(x, torch.tensor([0, 9], dtype=torch.int32), *leaves[1:], num_heads=2)
    with pytest.raises(ValueError, match="the BlockTable covers 12 tokens and x has 10"):
        attention_sublayer(x, block_table(torch.tensor([0, 12], dtype=torch.int32), 12), *leaves[1:], num_heads=2)
    with pytest.raises(ValueError, match="unknown attention_sublayer backend 'fa2'"):
        attention_sublayer(x, offsets, *leaves[1:], num_heads=2, backend="fa2")
    with pytest.raises(ValueError, match="d_model 24"):
        attention_sublayer(*_leaves(4, d_model=24)[:1], torch.tensor([0, 4], dtype=torch.int32), *_leaves(4, 24)[1:],
                           num_heads=2, backend="triton")
    with pytest.raises(ValueError, match="bfloat16 on CPU"):
        bf16 = _leaves(4, dtype=torch.bfloat16)
        attention_sublayer(bf16[0], torch.tensor([0, 4], dtype=torch.int32), *bf16[1:], num_heads=2, backend="triton")
    with pytest.raises(ValueError, match="head_dim 8"):  # the attention kernel's rule
        attention_sublayer(x, offsets, *leaves[1:], num_heads=8, backend="triton")
    with pytest.raises(BackendUnavailableError, match="block_attention backend 'tlx' cannot run here"):
        attention_sublayer(x, offsets, *leaves[1:], num_heads=2, backend="tlx")
    # auto on a CPU is the reference, which has no launch settings.
    with pytest.raises(ValueError, match="no launch settings"):
        attention_sublayer(x, offsets, *leaves[1:], num_heads=2, launch={"fwd": {"num_warps": 2}})


def test_launch_overrides_reach_the_attention_kernel():
    leaves = _leaves(100, seed=5)
    offsets = torch.tensor([0, 100], dtype=torch.int32)
    with pytest.raises(ValueError, match="launch"):
        attention_sublayer(leaves[0], offsets, *leaves[1:], num_heads=2, backend="triton",
                           launch={"fwd": {"no_such_setting": 1}})


def test_plans_get_clear_errors():
    from kernels.attention_sublayer_kernels import _plan

    leaves = _leaves(100, seed=5)
    offsets = torch.tensor([0, 100], dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown attention_sublayer fwd plan 'tiles'; choose one of"):
        attention_sublayer(leaves[0], offsets, *leaves[1:], num_heads=2, backend="triton",
                           launch={"fwd": {"plan": "tiles"}})
    with pytest.raises(ValueError, match="unknown attention_sublayer 'blocks' fwd launch settings \\['maxnreg'\\]"):
        attention_sublayer(leaves[0], offsets, *leaves[1:], num_heads=2, backend="triton",
                           launch={"fwd": {"plan": "blocks", "maxnreg": 128}})
    assert _plan('{"bwd": {"plan": "blocks"}}', "fwd") == "gemms"
    # The tlx backend has no GPU here: its 'blocks' kernels' checks, host-side, directly.
    from kernels.attention_sublayer_tlx import tlx_attention_sublayer_config, tlx_blocks_unsupported_reason

    assert tlx_blocks_unsupported_reason(256, 64, torch.bfloat16) is None
    assert "do not fit in shared memory" in tlx_blocks_unsupported_reason(256, 128, torch.bfloat16)
    assert "float16 or bfloat16" in tlx_blocks_unsupported_reason(256, 64, torch.float32)
    with pytest.raises(ValueError, match="unknown attention_sublayer tlx 'blocks' fwd launch settings \\['num_warps'\\]"):
        tlx_attention_sublayer_config(256, 64, (("num_warps", 4),))
    with pytest.raises(ValueError, match="needs .* B of shared memory"):
        tlx_attention_sublayer_config(256, 64, (("NUM_CONSUMERS", 2), ("NUM_STAGES", 3)))
    with pytest.raises(ValueError, match="unknown attention_sublayer tlx 'blocks' bwd launch settings"):
        tlx_attention_sublayer_config(256, 64, (("plan", "blocks"),), backward=True)


def _op_args(tokens=70, seed=4):
    leaves = _leaves(tokens, seed=seed)
    table = block_table(torch.tensor([0, 20, tokens], dtype=torch.int32), tokens)
    return leaves, table


def test_custom_ops_pass_opcheck():
    """Schemas, fake (meta) implementations against the real kernels, and autograd registration."""
    from kernels.rotary import rotary_tables

    leaves, table = _op_args()
    cos, sin = rotary_tables(Rotary(), table.offsets, 70, 32)
    ops = get_attention_sublayer_backend("triton").ops
    blocks = '{"bwd": {"plan": "blocks"}, "fwd": {"plan": "blocks"}}'
    for launch in ("", blocks):
        for args in (leaves, [x.clone().requires_grad_() for x in leaves]):
            torch.library.opcheck(ops.forward_op, (*args, *table.tensors(), cos, sin, 2, False, 1e-5, launch))
        y, qkv, attn, mean, rstd = ops.forward_op(*leaves, *table.tensors(), None, None, 2, False, 1e-5, launch)
        x, nw, nb, w_qkv, b_qkv, w_out, b_out = leaves
        torch.library.opcheck(ops.backward_op, (torch.randn_like(y), x, nw, nb, w_qkv, w_out, qkv, attn, mean, rstd,
                                                *table.tensors(), None, None, 2, False, 1e-5, launch))


def test_public_api_compiles_without_graph_breaks():
    leaves, table = _op_args(seed=6)
    grad_y = torch.randn(70, 64)
    check_attention_sublayer_backend("triton", "cpu")  # imports the backend before compiling, as train.py does

    def sublayer(*x):
        return attention_sublayer(x[0], table, *x[1:], num_heads=2, rotary=Rotary(), backend="triton")

    compiled = torch.compile(sublayer, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    for a, b in zip(_out_and_grads(compiled, leaves, grad_y), _out_and_grads(sublayer, leaves, grad_y)):
        assert torch.equal(a, b)


def test_eager_calls_skip_the_custom_ops():
    """Eager calls run the launchers through an autograd.Function (the ops' dispatch costs host
    time); what traces (here make_fx) still sees the custom ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, table = _op_args(seed=6)
    leaves = [t.requires_grad_() for t in leaves]

    def call(*t):
        return attention_sublayer(t[0], table, *t[1:], num_heads=2, backend="triton")

    def ops_called(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            fn()
        return {e.name for e in profiler.events() if e.name.startswith("attention_sublayer::")}

    assert ops_called(lambda: torch.autograd.grad(call(*leaves).sum(), leaves)) == set()
    assert ops_called(lambda: call(*[t.detach() for t in leaves])) == set()
    graph = make_fx(call)(*[t.detach() for t in leaves])
    assert "attention_sublayer.triton_forward" in str(graph.code)


def test_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/bench_sublayer.py --sublayer attention end to end at a tiny shape: the unfused layer
    (on the Triton attention kernel), the fused op and its per-block plan as a variant row timed, each
    checked against the unfused path."""
    import json

    from benchmarks import bench_sublayer

    out = tmp_path / "attention"
    bench_sublayer.main(["--sublayer", "attention", "--out", str(out), "--device", "cpu", "--tokens", "200",
                         "--d-model", "64", "--num-heads", "2", "--dtype", "float32", "--unfused-attn", "triton",
                         "--impls", "unfused_eager", "triton", "--warmup-ms", "1", "--rep-ms", "1",
                         "--variant", "triton_blocks", "triton", '{"fwd": {"plan": "blocks"}, "bwd": {"plan": "blocks"}}'])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["sublayer"] == "attention" and report["shape"]["num_heads"] == 2
    rows = {row["impl"]: row for row in report["rows"]}
    assert set(rows) == {"unfused_eager", "triton", "triton_blocks"}
    assert rows["triton_blocks"]["launch"] == {"fwd": {"plan": "blocks"}, "bwd": {"plan": "blocks"}}
    for row in rows.values():
        assert "error" not in row and row["fwd+bwd_ms"] > 0 and row["check_rel_err"] < 1e-5
    assert out.with_suffix(".md").read_text().startswith("# Attention sublayer")


_SM90_COMPILE = '''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.attention_sublayer_blocks import _attention_sublayer_bwd_blocks, _attention_sublayer_fwd_blocks

def source(fn, num_heads, d_model, rotary, rotate_v, x_dtype, dtype):
    fp32 = ("mean_ptr", "rstd_ptr", "cos_ptr", "sin_ptr", "column_parts_ptr", "qkv_column_parts_ptr")
    x_like = ("x_ptr", "y_ptr", "dx_ptr", "grad_y_ptr", "norm_weight_ptr", "norm_bias_ptr")
    ints = dict(block_start_ptr="*i32", block_len_ptr="*i32", num_blocks_ptr="*i64")
    signature = {n: ints.get(n, "*fp32" if n in fp32 else f"*{x_dtype}" if n in x_like else f"*{dtype}")
                 for n in fn.arg_names if n.endswith("_ptr")}
    signature.update({n: "i32" for n in ("x_stride", "grad_y_stride") if n in fn.arg_names})
    signature.update({n: "fp32" for n in ("eps", "qk_scale", "sm_scale") if n in fn.arg_names})
    constexprs = dict(D=d_model, HEADS=num_heads, HEAD_DIM=d_model // num_heads, BLOCK=64, ROTARY=rotary,
                      ROTATE_V=rotate_v, DOT_PRECISION="tf32", K_CHUNK=64)
    if not rotary:  # a None argument is a constexpr at launch time
        signature.update(cos_ptr="constexpr", sin_ptr="constexpr")
        constexprs.update(cos_ptr=None, sin_ptr=None)
    signature.update({n: "constexpr" for n in constexprs if n not in signature})
    assert set(signature) == set(fn.arg_names), set(signature) ^ set(fn.arg_names)
    divisible = [n for n in signature if n.endswith("_ptr") and signature[n] != "constexpr"]
    return ASTSource(fn=fn, signature={n: signature[n] for n in fn.arg_names}, constexprs=constexprs,
                     attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})

results = {}
for fn in (_attention_sublayer_fwd_blocks, _attention_sublayer_bwd_blocks):
    for num_heads, d_model, rotary, rotate_v, x_dtype, dtype in json.loads(sys.argv[1]):
        name = f"{fn.__name__}_H{num_heads}_D{d_model}_rotary{int(rotary)}{int(rotate_v)}_{x_dtype}_{dtype}"
        compiled = triton.compile(source(fn, num_heads, d_model, rotary, rotate_v, x_dtype, dtype),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=1))
        ptx = compiled.asm["ptx"]
        results[name] = dict(wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"),
                             shared=compiled.metadata.shared)
json.dump(results, sys.stdout)
'''


def test_the_per_block_kernels_compile_for_sm90():
    """The interpreter runs code that the compiler rejects (it once accepted a helper whose two
    branches returned different shapes), so the per-block kernels are compiled for sm_90 here, with
    no GPU, at the shapes the model and the GPU parity run: each must use wgmma and fit in SMEM."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from kernels.block_attention_tlx import SM90_MAX_SMEM

    shapes = [(4, 256, True, False, "fp32", "bf16"), (2, 256, True, True, "bf16", "bf16"),
              (1, 64, False, False, "fp16", "fp16")]
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE, json.dumps(shapes)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(proc.stdout)
    assert len(results) == 2 * len(shapes)
    for name, result in results.items():
        assert result["wgmma"] > 0 and result["mma_sync"] == 0, (name, result)
        assert 0 < result["shared"] <= SM90_MAX_SMEM, (name, result)
