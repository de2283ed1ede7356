"""Plain-Triton fused MLP sublayer, in two plans per direction (LaunchConfig.plan); see mlp_dispatch.py.
The LayerNorm kernels and the GEMMs with fused prologues/epilogues that the "gemms" plan runs are
kernels/sublayer_triton.py's, shared with the attention sublayer.

Invariants the kernels rely on:
- "tiles": a program owns BLOCK_M consecutive tokens (rows of x [T, D], D = d_model a power of two,
  16..256) and walks the hidden width H in BLOCK_H chunks (H a multiple of BLOCK_H): the
  [BLOCK_M, D] fp32 accumulator stays in registers and no hidden chunk leaves the chip but the saved
  pre-activation (and, backward, the hidden gradient and GELU's output the weight GEMMs read).
- "gemms": a program owns one [BLOCK_M, BLOCK_N] output tile of a GEMM over the hidden width (or
  BLOCK_M whole rows of y), and the [T, H] activations go through HBM between the GEMMs.
- Rows >= T load as zeros and are never stored; zero rows of grad_y add nothing to any partial sum.
- LayerNorm and GELU run in fp32; the matmul operands are in the compute dtype (the weights' dtype,
  e.g. bf16 under autocast) with fp32 accumulation; x, y, dx keep x's dtype (fp32 under autocast).
- GELU is applied to the pre-activation rounded to the compute dtype, as the unfused path applies
  nn.GELU to nn.Linear's rounded output, and the backward differentiates that same saved value.
- Each program writes its own rows and its own row of the partial sums: no atomics, so every
  output is bitwise repeatable.
"""

import functools
from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from .backend import launch_overrides
from .dispatch import get_backend
from .mlp_dispatch import mlp_kernel_ops
from .sublayer_dispatch import SublayerBackend
from .sublayer_triton import (
    _gelu,
    _gelu_and_grad,
    _gemm_tile,
    _layer_norm_backward_rows,
    _layer_norm_rows,
    _row_stats,
    _store_column_parts,
    bias_gemm,
    dot_precision,
    k_chunk,
    launch,
    layer_norm_backward,
    layer_norm_forward,
    residual_gemm,
    rows_contiguous,
    tanh_gelu,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _mlp_sublayer_fwd(
    x_ptr, norm_weight_ptr, norm_bias_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
    y_ptr, hidden_ptr, mean_ptr, rstd_ptr,
    T, H, x_stride, eps,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TANH_GELU: tl.constexpr,
):
    dtype = w1_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, D)
    hcols = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    mean, rstd = _row_stats(x, eps, D)
    _, normed = _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D)
    normed = normed.to(dtype)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        # W1 rows h0.. (nn.Linear's [H, D]) and W2 columns h0.. ([D, H]) of this chunk.
        w1 = tl.load(w1_ptr + (h0 + hcols)[:, None] * D + cols[None, :])
        hidden = tl.dot(normed, tl.trans(w1), input_precision=DOT_PRECISION)
        hidden = (hidden + tl.load(b1_ptr + h0 + hcols).to(tl.float32)[None, :]).to(dtype)
        tl.store(hidden_ptr + rows64[:, None] * H + (h0 + hcols)[None, :], hidden, mask=row_ok[:, None])
        activation = _gelu(hidden.to(tl.float32), TANH_GELU).to(dtype)
        w2 = tl.load(w2_ptr + cols[:, None] * H + (h0 + hcols)[None, :])
        acc = tl.dot(activation, tl.trans(w2), acc, input_precision=DOT_PRECISION)
    # The second linear's output is rounded to the compute dtype before the residual, as nn.Linear's is.
    out = (acc + tl.load(b2_ptr + cols).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    y = x + out
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _mlp_sublayer_bwd_tiles(
    grad_y_ptr, x_ptr, norm_weight_ptr, norm_bias_ptr, w1_ptr, w2_ptr, hidden_ptr, mean_ptr, rstd_ptr,
    dx_ptr, grad_hidden_ptr, activation_ptr, normed_ptr, db1_parts_ptr, column_parts_ptr,
    T, H, x_stride, grad_y_stride,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TANH_GELU: tl.constexpr,
):
    dtype = w1_ptr.dtype.element_ty
    tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, D)
    hcols = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + rows64[:, None] * grad_y_stride + cols[None, :], mask=row_ok[:, None], other=0.0)
    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    # Recomputed from x and the saved statistics, bit-identical to the forward's.
    x_hat, normed = _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D)
    normed = normed.to(dtype)
    tl.store(normed_ptr + rows64[:, None] * D + cols[None, :], normed, mask=row_ok[:, None])
    # The second linear saw its output rounded to the compute dtype; its gradient is taken in it too.
    grad_out = grad_y.to(dtype)
    grad_normed = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hidden_offs = rows64[:, None] * H + (h0 + hcols)[None, :]
        hidden = tl.load(hidden_ptr + hidden_offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        activation, gelu_grad = _gelu_and_grad(hidden, TANH_GELU)
        tl.store(activation_ptr + hidden_offs, activation.to(dtype), mask=row_ok[:, None])
        w2 = tl.load(w2_ptr + cols[:, None] * H + (h0 + hcols)[None, :])
        grad_activation = tl.dot(grad_out, w2, input_precision=DOT_PRECISION)
        grad_hidden = (grad_activation * gelu_grad).to(dtype)
        tl.store(grad_hidden_ptr + hidden_offs, grad_hidden, mask=row_ok[:, None])
        tl.store(db1_parts_ptr + tile * H + h0 + hcols, tl.sum(grad_hidden.to(tl.float32), 0))
        w1 = tl.load(w1_ptr + (h0 + hcols)[:, None] * D + cols[None, :])
        grad_normed = tl.dot(grad_hidden, w1, grad_normed, input_precision=DOT_PRECISION)
    sums = _layer_norm_backward_rows(grad_normed, x_hat, rstd, grad_y.to(tl.float32), norm_weight_ptr, dx_ptr, rows64,
                                     row_ok, D)
    _store_column_parts(column_parts_ptr, tile, sums, D)


@triton.jit
def _hidden_grad_gemm(
    grad_out_ptr, w2_ptr, hidden_ptr, grad_hidden_ptr, activation_ptr, db1_parts_ptr,
    T, H,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TANH_GELU: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of dH = (dY · W2) * GELU'(pre-activation), with dH's column sums
    (b1's gradient) and GELU's output (dW2's operand for cuBLAS) from the same epilogue: the [T, H] product
    of the first GEMM never reaches HBM, and the saved pre-activation is read once here."""
    dtype = w2_ptr.dtype.element_ty
    acc, tile_m, _, row_ok, hcols, hcol_ok = _gemm_tile(grad_out_ptr, w2_ptr, T, H, D, False, BLOCK_M, BLOCK_N,
                                                        BLOCK_K, DOT_PRECISION)
    # Loaded after the matmul, not before: held across it, it cost registers and ran slower on the H200.
    # A 64-bit tile start and 32-bit offsets in it: 64-bit offsets per element took two registers each and
    # made the 64 x 128 tile spill (tests/test_mlp_sublayer.py::test_gemms_compile_for_sm90).
    tile_start = tile_m.to(tl.int64) * BLOCK_M * H
    offs = tl.arange(0, BLOCK_M)[:, None] * H + hcols[None, :]
    ok = row_ok[:, None] & hcol_ok[None, :]
    hidden = tl.load(hidden_ptr + tile_start + offs, mask=ok, other=0.0).to(tl.float32)
    activation, gelu_grad = _gelu_and_grad(hidden, TANH_GELU)
    tl.store(activation_ptr + tile_start + offs, activation.to(dtype), mask=ok)
    grad_hidden = (acc * gelu_grad).to(dtype)
    tl.store(grad_hidden_ptr + tile_start + offs, grad_hidden, mask=ok)
    tl.store(db1_parts_ptr + tile_m * H + hcols, tl.sum(grad_hidden.to(tl.float32), 0), mask=hcol_ok)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """How one direction runs. Plan "tiles": one program per block_m tokens walks the hidden width
    in BLOCK_H chunks, the hidden activations never leaving the chip. Plan "gemms": GEMMs over
    [block_m, block_n] output tiles whose prologues and epilogues carry the elementwise work."""

    plan: str = "tiles"
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2


PLANS = ("tiles", "gemms")
# Forward "gemms": LayerNorm rows, then LN(x)·W1ᵀ + b1 (the saved pre-activation), then a GEMM that
# applies GELU to its A operand as it loads and adds b2 and the residual in its epilogue.
# Backward "gemms": dH = (dY·W2) * GELU' from one GEMM whose epilogue also writes GELU's output (dW2's
# operand) and b1's partial sums, LN's output gradient dH·W1 from cuBLAS, then LayerNorm's backward. dW2 from
# a split-K Triton GEMM applying GELU to the pre-activation as it loads (no GELU output written) ran slower on
# an H100: 0.32-0.36 ms against cuBLAS's 0.137, to save the hidden-gradient GEMM 0.076 ms
# (benchmarks/results/mlp_sublayer_weight_grad_h100.md); it was removed.
# Backward "tiles" keeps LN's [block_m, D] fp32 output gradient on chip across the hidden chunks; at
# d_model 256 that accumulator limits an SM to two tiles, each streaming all of W1 and W2 from L2:
# it ran 2.4x slower than the compiled unfused backward (benchmarks/results/mlp_sublayer_h200.md).
# Defaults: "gemms" both ways, faster on the H200 at d_model 256 (benchmarks/results/mlp_sublayer_h200.md).
DEFAULT_PLAN = {"fwd": "gemms", "bwd": "gemms"}


@functools.lru_cache(maxsize=None)
def launch_config(direction: str, d_model: int, launch: str = "", approximate: str = "none") -> LaunchConfig:
    overrides = launch_overrides(launch, direction)
    allowed = [f.name for f in fields(LaunchConfig)]
    unknown = set(overrides) - set(allowed)
    if unknown:
        raise ValueError(f"unknown Triton mlp_sublayer {direction} launch settings {sorted(unknown)}; "
                         f"choose from {allowed}")
    plan = overrides.get("plan", DEFAULT_PLAN[direction])
    if plan not in PLANS:
        raise ValueError(f"unknown Triton mlp_sublayer {direction} plan {plan!r}; choose one of {PLANS}")
    if plan == "gemms":
        # A GEMM's tiles, a 3-deep pipeline of its K steps. The forward's: 128 x 128 over 8 warps.
        # The backward's: 64 rows over 4 warps: with K = d_model its epilogue (GELU and its derivative)
        # outweighs its matmul, and small programs overlap more of them (64-row tiles beat 128-row ones on
        # the H200, benchmarks/results/mlp_sublayer_h200.md's rounds). 128 columns in GELU's tanh form, faster
        # on an H100 and in the step (mlp_tanh_tiles_h100.md, profile_step_bwd_tiles_64x128_h100.md); exact GELU's
        # longer epilogue spills at 128 columns under fbtriton and ran slower there (mlp_exact_tiles_h100.md), so
        # it keeps 64.
        wide = direction == "fwd"
        default = LaunchConfig(plan=plan, block_m=128 if wide else 64,
                               block_n=128 if wide or tanh_gelu(approximate) else 64,
                               num_warps=8 if wide else 4, num_stages=3)
    else:
        # A [64, 256] fp32 accumulator is 128 registers a thread over 4 warps: give it 8. At d_model
        # 256 each program streams all of W1 and W2 (1 MB in bf16) from L2 per tile, so the forward
        # takes 128-token tiles there, faster on the H200; the backward, with more live tiles, did
        # not gain (benchmarks/results/mlp_sublayer_h200.md).
        wide = d_model >= 256
        default = LaunchConfig(plan=plan, block_m=128 if wide and direction == "fwd" else 64,
                               num_warps=8 if wide else 4)
    return replace(default, **overrides)


def _constexprs(x: torch.Tensor, w1: torch.Tensor, config: LaunchConfig, approximate: str) -> dict:
    return dict(D=x.shape[1], BLOCK_M=config.block_m, BLOCK_H=k_chunk(w1.shape[0]), DOT_PRECISION=dot_precision(w1.dtype),
                TANH_GELU=tanh_gelu(approximate))


def _launch(kernel, programs: int, device: torch.device, config: LaunchConfig, args: tuple, constexprs: dict):
    launch(kernel, programs, device, args, constexprs, config.num_warps, config.num_stages)


def _forward(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch):
    tokens, d_model = x.shape
    hidden_width = w1.shape[0]
    x = rows_contiguous(x)
    w1, b1, w2, b2, norm_weight, norm_bias = (t.contiguous() for t in (w1, b1, w2, b2, norm_weight, norm_bias))
    config = launch_config("fwd", d_model, launch, approximate)
    launch_config("bwd", d_model, launch, approximate)  # a bad backward setting fails here, not in the backward pass
    if config.plan == "gemms":
        normed, mean, rstd = layer_norm_forward(x, norm_weight, norm_bias, eps, w1.dtype)
        hidden = bias_gemm(normed, w1, b1, config.block_m, config.block_n, config.num_warps, config.num_stages)
        # GELU runs on the saved pre-activation as the output GEMM loads it.
        y = residual_gemm(hidden, w2, b2, x, approximate, config.block_m, config.num_warps, config.num_stages)
        return y, hidden, mean, rstd
    y = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    hidden = torch.empty((tokens, hidden_width), dtype=w1.dtype, device=x.device)
    mean = torch.empty(tokens, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if tokens:
        args = (x, norm_weight, norm_bias, w1, b1, w2, b2, y, hidden, mean, rstd, tokens, hidden_width, x.stride(0), eps)
        _launch(_mlp_sublayer_fwd, triton.cdiv(tokens, config.block_m), x.device, config, args,
                _constexprs(x, w1, config, approximate))
    return y, hidden, mean, rstd


def _backward(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate, launch):
    x, grad_y = rows_contiguous(x), rows_contiguous(grad_y)
    w1, w2, norm_weight, norm_bias = (t.contiguous() for t in (w1, w2, norm_weight, norm_bias))
    config = launch_config("bwd", x.shape[1], launch, approximate)
    plan = _backward_gemms if config.plan == "gemms" else _backward_tiles
    return plan(grad_y, x, norm_weight, norm_bias, w1, w2, hidden, mean, rstd, config, approximate)


def _hidden_grad(grad_out, w2, hidden, config, approximate):
    """dH = (dY · W2) * GELU'(pre-activation), GELU's output and dH's per-tile column sums, by _hidden_grad_gemm."""
    tokens, d_model = grad_out.shape
    hidden_width = w2.shape[1]
    grad_hidden = torch.empty((tokens, hidden_width), dtype=w2.dtype, device=grad_out.device)
    activation = torch.empty_like(grad_hidden)
    row_tiles = triton.cdiv(tokens, config.block_m)
    db1_parts = torch.zeros((row_tiles, hidden_width), dtype=torch.float32, device=grad_out.device)
    if tokens:
        args = (grad_out, w2, hidden, grad_hidden, activation, db1_parts, tokens, hidden_width)
        constexprs = dict(D=d_model, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=min(64, d_model),
                          DOT_PRECISION=dot_precision(w2.dtype), TANH_GELU=tanh_gelu(approximate))
        _launch(_hidden_grad_gemm, row_tiles * triton.cdiv(hidden_width, config.block_n), grad_out.device, config,
                args, constexprs)
    return grad_hidden, activation, db1_parts


def _backward_gemms(grad_y, x, norm_weight, norm_bias, w1, w2, hidden, mean, rstd, config, approximate):
    tokens, d_model = x.shape
    # The second linear's output was rounded to the compute dtype; its gradient is taken in it too.
    grad_out = grad_y.to(w1.dtype).contiguous()
    grad_hidden, activation, db1_parts = _hidden_grad(grad_out, w2, hidden, config, approximate)
    # LN's output gradient in the compute dtype, as autograd of the unfused path's bf16 linear gives it.
    grad_normed = grad_hidden @ w1
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    normed = torch.empty((tokens, d_model), dtype=w1.dtype, device=x.device)
    column_parts = layer_norm_backward(grad_normed, grad_y, x, mean, rstd, norm_weight, norm_bias, dx, normed)
    return dx, grad_out, grad_hidden, activation, normed, db1_parts, column_parts


def _backward_tiles(grad_y, x, norm_weight, norm_bias, w1, w2, hidden, mean, rstd, config, approximate):
    tokens, d_model = x.shape
    hidden_width = w1.shape[0]
    tiles = triton.cdiv(tokens, config.block_m)
    dx = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    grad_hidden = torch.empty((tokens, hidden_width), dtype=w1.dtype, device=x.device)
    activation = torch.empty_like(grad_hidden)
    normed = torch.empty((tokens, d_model), dtype=w1.dtype, device=x.device)
    # Zeros: an empty batch has no tiles, and its sums are zero.
    db1_parts = torch.zeros((tiles, hidden_width), dtype=torch.float32, device=x.device)
    column_parts = torch.zeros((tiles, 3, d_model), dtype=torch.float32, device=x.device)
    if tokens:
        args = (grad_y, x, norm_weight, norm_bias, w1, w2, hidden, mean, rstd, dx, grad_hidden, activation, normed,
                db1_parts, column_parts, tokens, hidden_width, x.stride(0), grad_y.stride(0))
        _launch(_mlp_sublayer_bwd_tiles, tiles, x.device, config, args, _constexprs(x, w1, config, approximate))
    return dx, grad_y.to(w1.dtype), grad_hidden, activation, normed, db1_parts, column_parts


_run_ops = mlp_kernel_ops("triton", _forward, _backward)


def triton_mlp_unsupported_reason(x: torch.Tensor, hidden: int, compute_dtype: torch.dtype) -> str | None:
    d_model = x.shape[1]
    if d_model < 16 or d_model > 256 or d_model & (d_model - 1):
        return f"d_model {d_model} (the Triton kernels take a power of two from 16 to 256)"
    if hidden % 16:
        return f"hidden width {hidden} (the Triton kernels take a multiple of 16)"
    if compute_dtype not in SUPPORTED_DTYPES or x.dtype not in SUPPORTED_DTYPES:
        return f"dtypes x {x.dtype}, compute {compute_dtype} (the Triton kernels take float16, bfloat16 or float32)"
    # The device rules (interpreter, bf16 on CPU) are block attention's Triton backend's.
    return get_backend("triton").unsupported_reason(x.new_empty(0, 1, 32, dtype=compute_dtype))


MLP_BACKEND = SublayerBackend("triton", triton_mlp_unsupported_reason, _run_ops, ops=_run_ops)
