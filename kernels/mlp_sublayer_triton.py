"""Plain-Triton fused MLP sublayer (forward + the backward's token-tile kernel); see mlp_dispatch.py.

Invariants the kernels rely on:
- A program owns BLOCK_M consecutive tokens (rows of x [T, D], D = d_model a power of two, 16..256)
  and walks the hidden width H in BLOCK_H chunks (H a multiple of BLOCK_H): the [BLOCK_M, D] fp32
  accumulator stays in registers and no hidden chunk leaves the chip but the saved pre-activation.
- Rows >= T load as zeros and are never stored; zero rows of grad_y add nothing to any partial sum.
- LayerNorm and GELU run in fp32; the matmul operands are in the compute dtype (the weights' dtype,
  e.g. bf16 under autocast) with fp32 accumulation; x, y, dx keep x's dtype (fp32 under autocast).
- GELU is applied to the pre-activation rounded to the compute dtype, as the unfused path applies
  nn.GELU to nn.Linear's rounded output, and the backward differentiates that same saved value.
- Each program writes its own rows and its own row of the partial sums: no atomics, so every
  output is bitwise repeatable.
"""

import functools
import os
from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from .backend import launch_overrides
from .dispatch import get_backend
from .mlp_dispatch import MlpBackend, mlp_kernel_ops

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D: tl.constexpr):
    """x̂ = (x - mean) * rstd and LN(x) = x̂ * weight + bias of fp32 rows x [M, D]."""
    cols = tl.arange(0, D)
    x_hat = (x - mean[:, None]) * rstd[:, None]
    weight = tl.load(norm_weight_ptr + cols).to(tl.float32)
    bias = tl.load(norm_bias_ptr + cols).to(tl.float32)
    return x_hat, x_hat * weight[None, :] + bias[None, :]


@triton.jit
def _gelu(h):
    return 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))


@triton.jit
def _gelu_grad(h):
    return 0.5 * (1.0 + tl.erf(h * 0.7071067811865476)) + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)


@triton.jit
def _mlp_sublayer_fwd(
    x_ptr, norm_weight_ptr, norm_bias_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
    y_ptr, hidden_ptr, mean_ptr, rstd_ptr,
    T, H, x_stride, eps,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    dtype = w1_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, D)
    hcols = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / D
    centered = x - mean[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / D + eps)
    _, normed = _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D)
    normed = normed.to(dtype)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        # W1 rows h0.. (nn.Linear's [H, D]) and W2 columns h0.. ([D, H]) of this chunk.
        w1 = tl.load(w1_ptr + (h0 + hcols)[:, None] * D + cols[None, :])
        hidden = tl.dot(normed, tl.trans(w1), input_precision=DOT_PRECISION)
        hidden = (hidden + tl.load(b1_ptr + h0 + hcols).to(tl.float32)[None, :]).to(dtype)
        tl.store(hidden_ptr + rows64[:, None] * H + (h0 + hcols)[None, :], hidden, mask=row_ok[:, None])
        activation = _gelu(hidden.to(tl.float32)).to(dtype)
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
    dx_ptr, grad_hidden_ptr, activation_ptr, normed_ptr, db1_parts_ptr, dnw_parts_ptr, dnb_parts_ptr,
    T, H, x_stride, grad_y_stride,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
        tl.store(activation_ptr + hidden_offs, _gelu(hidden).to(dtype), mask=row_ok[:, None])
        w2 = tl.load(w2_ptr + cols[:, None] * H + (h0 + hcols)[None, :])
        grad_activation = tl.dot(grad_out, w2, input_precision=DOT_PRECISION)
        grad_hidden = (grad_activation * _gelu_grad(hidden)).to(dtype)
        tl.store(grad_hidden_ptr + hidden_offs, grad_hidden, mask=row_ok[:, None])
        tl.store(db1_parts_ptr + tile * H + h0 + hcols, tl.sum(grad_hidden.to(tl.float32), 0))
        w1 = tl.load(w1_ptr + (h0 + hcols)[:, None] * D + cols[None, :])
        grad_normed = tl.dot(grad_hidden, w1, grad_normed, input_precision=DOT_PRECISION)
    _layer_norm_backward_rows(grad_normed, x_hat, rstd, grad_y.to(tl.float32), norm_weight_ptr, dx_ptr, dnw_parts_ptr,
                              dnb_parts_ptr, tile, rows64, row_ok, D)


@triton.jit
def _layer_norm_backward_rows(grad_normed, x_hat, rstd, grad_y, norm_weight_ptr, dx_ptr, dnw_parts_ptr, dnb_parts_ptr,
                              tile, rows64, row_ok, D: tl.constexpr):
    """LayerNorm's backward for fp32 rows, plus the residual's gradient: dx̂ = dLN * weight,
    dx = grad_y + rstd (dx̂ - mean(dx̂) - x̂ mean(dx̂ x̂)); the affine's partial sums go to row `tile`."""
    cols = tl.arange(0, D)
    weight = tl.load(norm_weight_ptr + cols).to(tl.float32)
    grad_x_hat = grad_normed * weight[None, :]
    grad_x_hat_mean = tl.sum(grad_x_hat, 1) / D
    grad_x_hat_dot_mean = tl.sum(grad_x_hat * x_hat, 1) / D
    dx = grad_y + rstd[:, None] * (grad_x_hat - grad_x_hat_mean[:, None] - x_hat * grad_x_hat_dot_mean[:, None])
    tl.store(dx_ptr + rows64[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(dnw_parts_ptr + tile * D + cols, tl.sum(grad_normed * x_hat, 0))
    tl.store(dnb_parts_ptr + tile * D + cols, tl.sum(grad_normed, 0))


@triton.jit
def _layer_norm_bwd_tiles(
    grad_normed_ptr, grad_y_ptr, x_ptr, mean_ptr, rstd_ptr, norm_weight_ptr, dx_ptr, dnw_parts_ptr, dnb_parts_ptr,
    T, x_stride, grad_y_stride, D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """LayerNorm's backward alone, for a backward whose tile kernel wrote LN's output gradient (fp32)
    instead of finishing it (kernels/mlp_sublayer_tlx.py)."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + rows64[:, None] * grad_y_stride + cols[None, :], mask=row_ok[:, None], other=0.0)
    grad_normed = tl.load(grad_normed_ptr + rows64[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    x_hat = (x - mean[:, None]) * rstd[:, None]
    _layer_norm_backward_rows(grad_normed, x_hat, rstd, grad_y.to(tl.float32), norm_weight_ptr, dx_ptr, dnw_parts_ptr,
                              dnb_parts_ptr, tile, rows64, row_ok, D)


def layer_norm_backward(grad_normed, grad_y, x, mean, rstd, norm_weight, dx, block_m: int = 64):
    """Launches _layer_norm_bwd_tiles; returns LayerNorm's affine partial sums [tiles, D] (fp32)."""
    tokens, d_model = x.shape
    tiles = triton.cdiv(tokens, block_m)
    dnw_parts = torch.zeros((tiles, d_model), dtype=torch.float32, device=x.device)
    dnb_parts = torch.zeros_like(dnw_parts)
    if tokens:
        args = (grad_normed, grad_y, x, mean, rstd, norm_weight, dx, dnw_parts, dnb_parts, tokens, x.stride(0),
                grad_y.stride(0))
        _launch(_layer_norm_bwd_tiles, tokens, x.device, LaunchConfig(block_m=block_m), args,
                dict(D=d_model, BLOCK_M=block_m))
    return dnw_parts, dnb_parts


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """One program per BLOCK_M tokens, walking the hidden width in BLOCK_H chunks."""

    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 2


@functools.lru_cache(maxsize=None)
def launch_config(direction: str, d_model: int, launch: str = "") -> LaunchConfig:
    overrides = launch_overrides(launch, direction)
    unknown = set(overrides) - {f.name for f in fields(LaunchConfig)}
    if unknown:
        raise ValueError(f"unknown Triton mlp_sublayer {direction} launch settings {sorted(unknown)}; "
                         f"choose from {[f.name for f in fields(LaunchConfig)]}")
    # A [64, 256] fp32 accumulator is 128 registers a thread over 4 warps: give it 8. At d_model 256
    # each program streams all of W1 and W2 (1 MB in bf16) from L2 per tile, so the forward takes
    # 128-token tiles there, faster on the H200; the backward, with more live tiles, did not gain
    # (benchmarks/results/mlp_sublayer_h200.md).
    wide = d_model >= 256
    default = LaunchConfig(block_m=128 if wide and direction == "fwd" else 64, num_warps=8 if wide else 4)
    return replace(default, **overrides)


def block_h(hidden: int) -> int:
    """The widest hidden chunk (64, 32 or 16: tl.dot's minimum) that divides the hidden width."""
    return next(b for b in (64, 32, 16) if hidden % b == 0)


def _constexprs(x: torch.Tensor, w1: torch.Tensor, config: LaunchConfig) -> dict:
    return dict(D=x.shape[1], BLOCK_M=config.block_m, BLOCK_H=block_h(w1.shape[0]),
                # fp32 compute is for exactness (tests): no TF32 rounding.
                DOT_PRECISION="ieee" if w1.dtype == torch.float32 else "tf32")


def _launch(kernel, tokens: int, device: torch.device, config: LaunchConfig, args: tuple, constexprs: dict):
    grid = (triton.cdiv(tokens, config.block_m),)
    if _INTERPRETED or device.type != "cuda":
        kernel[grid](*args, **constexprs)
        return
    with torch.cuda.device(device):
        kernel[grid](*args, **constexprs, num_warps=config.num_warps, num_stages=config.num_stages)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, launch):
    tokens, d_model = x.shape
    hidden_width = w1.shape[0]
    x = _rows_contiguous(x)
    w1, b1, w2, b2, norm_weight, norm_bias = (t.contiguous() for t in (w1, b1, w2, b2, norm_weight, norm_bias))
    y = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    hidden = torch.empty((tokens, hidden_width), dtype=w1.dtype, device=x.device)
    mean = torch.empty(tokens, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if tokens == 0:
        return y, hidden, mean, rstd
    config = launch_config("fwd", d_model, launch)
    args = (x, norm_weight, norm_bias, w1, b1, w2, b2, y, hidden, mean, rstd, tokens, hidden_width, x.stride(0), eps)
    _launch(_mlp_sublayer_fwd, tokens, x.device, config, args, _constexprs(x, w1, config))
    return y, hidden, mean, rstd


def _backward_tiles(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, launch):
    tokens, d_model = x.shape
    hidden_width = w1.shape[0]
    x, grad_y = _rows_contiguous(x), _rows_contiguous(grad_y)
    w1, w2, norm_weight, norm_bias = (t.contiguous() for t in (w1, w2, norm_weight, norm_bias))
    config = launch_config("bwd", d_model, launch)
    tiles = triton.cdiv(tokens, config.block_m)
    dx = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    grad_hidden = torch.empty((tokens, hidden_width), dtype=w1.dtype, device=x.device)
    activation = torch.empty_like(grad_hidden)
    normed = torch.empty((tokens, d_model), dtype=w1.dtype, device=x.device)
    # Zeros: an empty batch has no tiles, and its sums are zero.
    db1_parts = torch.zeros((tiles, hidden_width), dtype=torch.float32, device=x.device)
    dnw_parts = torch.zeros((tiles, d_model), dtype=torch.float32, device=x.device)
    dnb_parts = torch.zeros_like(dnw_parts)
    if tokens:
        args = (grad_y, x, norm_weight, norm_bias, w1, w2, hidden, mean, rstd, dx, grad_hidden, activation, normed,
                db1_parts, dnw_parts, dnb_parts, tokens, hidden_width, x.stride(0), grad_y.stride(0))
        _launch(_mlp_sublayer_bwd_tiles, tokens, x.device, config, args, _constexprs(x, w1, config))
    return dx, grad_hidden, activation, normed, db1_parts, dnw_parts, dnb_parts


_run_ops = mlp_kernel_ops("triton", _forward, _backward_tiles)


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


MLP_BACKEND = MlpBackend("triton", triton_mlp_unsupported_reason, _run_ops, ops=_run_ops)
