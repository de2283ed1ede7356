"""Triton building blocks both fused sublayers run (kernels/mlp_sublayer_triton.py,
kernels/attention_sublayer.py): LayerNorm's forward and backward over rows, and GEMMs over token
rows whose prologues and epilogues carry a sublayer's elementwise work.

Invariants the kernels rely on:
- Rows are tokens of x [T, D] (D = d_model, a power of two from 16 to 256, or a GEMM's K dimension
  of that form); rows >= T load as zeros and are never stored, and zero rows add nothing to any sum.
- Weights come in nn.Linear's [N, K] layout, contiguous, in the compute dtype (the matmul operands';
  fp32 accumulation). LayerNorm and GELU run in fp32; x, y, dx keep x's dtype.
- Each program writes its own rows and its own row of any partial sums: no atomics, so every output
  is bitwise repeatable.
"""

import os

import torch
import triton
import triton.language as tl

from .sublayer_dispatch import check_gelu_approximate

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
def _row_stats(x, eps, D: tl.constexpr):
    """LayerNorm's mean and 1/std of fp32 rows x [M, D]."""
    mean = tl.sum(x, 1) / D
    centered = x - mean[:, None]
    return mean, 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / D + eps)


@triton.jit
def _normal_cdf(h):
    return 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))


# tanh.approx.f32, the special-function unit's tanh (one instruction; relative error about 2^-11, below bf16's
# rounding), where libdevice's tanhf and erff are dozens of dependent ALU instructions, and the MLP kernels'
# epilogues are bound by that chain (benchmarks/results/mlp_gelu_h100.md). The interpreter runs no PTX: there
# tanh comes from exp.
_HARDWARE_TANH = tl.constexpr(not _INTERPRETED)


@triton.jit
def _tanh(u):
    if _HARDWARE_TANH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        decay = tl.exp(-2.0 * tl.abs(u))  # in (0, 1]: no overflow
        magnitude = (1.0 - decay) / (1.0 + decay)
        return tl.where(u < 0, -magnitude, magnitude)


@triton.jit
def _gelu_tanh_inner(h):
    return _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))  # sqrt(2 / pi)


@triton.jit
def _gelu(h, TANH_GELU: tl.constexpr):
    if TANH_GELU:
        return 0.5 * h * (1.0 + _gelu_tanh_inner(h))
    else:
        return h * _normal_cdf(h)


@triton.jit
def _gelu_and_grad(h, TANH_GELU: tl.constexpr):
    """GELU(h) and GELU'(h) from one erf or one tanh (the costly part: the backward's epilogues are bound by it)."""
    if TANH_GELU:
        t = _gelu_tanh_inner(h)
        half = 0.5 * (1.0 + t)
        # d/dh of 0.5 h (1 + tanh(u)), u = sqrt(2/pi) (h + 0.044715 h^3), as torch's gelu_backward takes it.
        return h * half, half + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * h * h)
    else:
        cdf = _normal_cdf(h)
        return h * cdf, cdf + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)


def tanh_gelu(approximate: str) -> bool:
    """A kernel's constexpr TANH_GELU for F.gelu's `approximate` (a custom op called directly is checked here)."""
    check_gelu_approximate(approximate)
    return approximate == "tanh"



@triton.jit
def _layer_norm_fwd_rows(
    x_ptr, norm_weight_ptr, norm_bias_ptr, normed_ptr, mean_ptr, rstd_ptr, T, x_stride, eps,
    D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """LN(x) in normed_ptr's dtype (the next GEMM's operand) and the statistics the backward reuses."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    mean, rstd = _row_stats(x, eps, D)
    _, normed = _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D)
    tl.store(normed_ptr + rows64[:, None] * D + cols[None, :], normed.to(normed_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _gemm_tile(a_ptr, b_ptr, T, N, K: tl.constexpr, B_IS_NK: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] fp32 tile of A [T, K] · B, B being Wᵀ of an nn.Linear
    weight W [N, K] (B_IS_NK) or a [K, N] matrix itself; with its rows, columns and their masks.
    The column tiles of one row tile are consecutive programs: they run side by side and read
    their A rows from L2, not HBM."""
    column_tiles = tl.cdiv(N, BLOCK_N)
    tile_m = tl.program_id(0) // column_tiles
    tile_n = tl.program_id(0) % column_tiles
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    ncols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ncol_ok = ncols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows64[:, None] * K + ks[None, :], mask=row_ok[:, None], other=0.0)
        if B_IS_NK:
            b = tl.load(b_ptr + ncols[None, :] * K + ks[:, None], mask=ncol_ok[None, :], other=0.0)
        else:
            b = tl.load(b_ptr + ks[:, None] * N + ncols[None, :], mask=ncol_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc, tile_m, rows64, row_ok, ncols, ncol_ok


@triton.jit
def _bias_gemm(
    a_ptr, w_ptr, b_ptr, out_ptr, T, N,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of A · Wᵀ + b (an nn.Linear: the MLP's pre-activation, the
    attention's q, k, v), rounded to the compute dtype."""
    dtype = w_ptr.dtype.element_ty
    acc, _, rows64, row_ok, ncols, ncol_ok = _gemm_tile(a_ptr, w_ptr, T, N, K, True, BLOCK_M, BLOCK_N, BLOCK_K,
                                                        DOT_PRECISION)
    out = (acc + tl.load(b_ptr + ncols, mask=ncol_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
    tl.store(out_ptr + rows64[:, None] * N + ncols[None, :], out, mask=row_ok[:, None] & ncol_ok[None, :])


@triton.jit
def _residual_gemm(
    a_ptr, w_ptr, b_ptr, x_ptr, y_ptr, T, K, x_stride,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GELU_PROLOGUE: tl.constexpr,
    TANH_GELU: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """BLOCK_M whole rows of y = x + (act(A) · Wᵀ + b), A [T, K], W [D, K]: with GELU_PROLOGUE, GELU
    runs on A as it loads (the MLP's pre-activation), so its output never reaches HBM (all D columns
    in one program: once per element); the residual is the epilogue's."""
    dtype = w_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, D)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        # BLOCK_K divides K (k_chunk): no column mask.
        a = tl.load(a_ptr + rows64[:, None] * K + ks[None, :], mask=row_ok[:, None], other=0.0)
        if GELU_PROLOGUE:
            a = _gelu(a.to(tl.float32), TANH_GELU).to(dtype)
        w = tl.load(w_ptr + cols[None, :] * K + ks[:, None])  # Wᵀ [K, N]
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    # The linear's output is rounded to the compute dtype before the residual, as nn.Linear's is.
    out = (acc + tl.load(b_ptr + cols).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], (x + out).to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _layer_norm_backward_rows(grad_normed, x_hat, rstd, grad_y, norm_weight_ptr, dx_ptr, rows64, row_ok, D: tl.constexpr):
    """LayerNorm's backward for fp32 rows, plus the residual's gradient: dx̂ = dLN * weight,
    dx = grad_y + rstd (dx̂ - mean(dx̂) - x̂ mean(dx̂ x̂)), stored. Returns the rows' column sums of
    dLN * x̂, dLN and grad_y: their share of the LN weight's, LN bias's and the output linear's bias's
    gradients."""
    cols = tl.arange(0, D)
    weight = tl.load(norm_weight_ptr + cols).to(tl.float32)
    grad_x_hat = grad_normed * weight[None, :]
    grad_x_hat_mean = tl.sum(grad_x_hat, 1) / D
    grad_x_hat_dot_mean = tl.sum(grad_x_hat * x_hat, 1) / D
    dx = grad_y + rstd[:, None] * (grad_x_hat - grad_x_hat_mean[:, None] - x_hat * grad_x_hat_dot_mean[:, None])
    tl.store(dx_ptr + rows64[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None])
    return tl.sum(grad_normed * x_hat, 0), tl.sum(grad_normed, 0), tl.sum(grad_y, 0)


@triton.jit
def _store_column_parts(column_parts_ptr, tile, sums, D: tl.constexpr):
    """Row `tile` of the [tiles, 3, D] partial sums (LN weight, LN bias, output bias), added in a fixed order later."""
    cols = tl.arange(0, D)
    for i in tl.static_range(3):
        tl.store(column_parts_ptr + (tile * 3 + i) * D + cols, sums[i])


@triton.jit
def _layer_norm_bwd_tiles(
    grad_normed_ptr, grad_y_ptr, x_ptr, mean_ptr, rstd_ptr, norm_weight_ptr, norm_bias_ptr, dx_ptr, normed_ptr,
    column_parts_ptr, T, x_stride, grad_y_stride,
    D: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, STORE_NORMED: tl.constexpr,
):
    """LayerNorm's backward alone, for a backward that computed LN's output gradient outside the
    token tiles, over CHUNKS blocks of BLOCK_M rows (one row of partial sums per program); with
    STORE_NORMED it also writes LN(x) in normed_ptr's dtype (the first weight gradient's operand), from the x it reads anyway."""
    tile = tl.program_id(0)
    cols = tl.arange(0, D)
    sums = (tl.zeros((D,), tl.float32), tl.zeros((D,), tl.float32), tl.zeros((D,), tl.float32))
    for chunk in range(CHUNKS):
        rows = (tile * CHUNKS + chunk) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        grad_y = tl.load(grad_y_ptr + rows64[:, None] * grad_y_stride + cols[None, :], mask=row_ok[:, None], other=0.0)
        grad_normed = tl.load(grad_normed_ptr + rows64[:, None] * D + cols[None, :], mask=row_ok[:, None],
                              other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        if STORE_NORMED:
            x_hat, normed = _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D)
            tl.store(normed_ptr + rows64[:, None] * D + cols[None, :], normed.to(normed_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
        else:
            x_hat = (x - mean[:, None]) * rstd[:, None]
        chunk_sums = _layer_norm_backward_rows(grad_normed, x_hat, rstd, grad_y.to(tl.float32), norm_weight_ptr, dx_ptr,
                                               rows64, row_ok, D)
        sums = (sums[0] + chunk_sums[0], sums[1] + chunk_sums[1], sums[2] + chunk_sums[2])
    _store_column_parts(column_parts_ptr, tile, sums, D)


# Rows a LayerNorm program takes at a time: its fp32 rows are D wide, so few rows keep them in
# registers; the backward's programs take LAYER_NORM_BWD_CHUNKS such blocks, for fewer partial sums,
# over 2 warps, faster than 4 on the H200 at configs/gpu.yaml's shape (benchmarks/results/mlp_sublayer_h200.md).
# 4 blocks, not 8: twice the programs, faster on an H100 at that shape, and the same rows a program computes at a
# time, so the same dx (benchmarks/results/sublayer_kernel_sweeps_h100.md).
LAYER_NORM_ROWS = 16
LAYER_NORM_BWD_CHUNKS = 4
LAYER_NORM_BWD_WARPS = 2


def layer_norm_backward(grad_normed, grad_y, x, mean, rstd, norm_weight, norm_bias, dx, normed=None):
    """Launches _layer_norm_bwd_tiles (writing LN(x) into `normed` too when given); returns the
    partial sums [tiles, 3, D] (fp32) of the LN weight's, LN bias's and output bias's gradients."""
    tokens, d_model = x.shape
    tiles = triton.cdiv(tokens, LAYER_NORM_ROWS * LAYER_NORM_BWD_CHUNKS)
    # Zeros: an empty batch has no tiles, and its sums are zero.
    column_parts = torch.zeros((tiles, 3, d_model), dtype=torch.float32, device=x.device)
    if tokens:
        args = (grad_normed, grad_y, x, mean, rstd, norm_weight, norm_bias, dx, dx if normed is None else normed,
                column_parts, tokens, x.stride(0), grad_y.stride(0))
        launch(_layer_norm_bwd_tiles, tiles, x.device, args,
               dict(D=d_model, BLOCK_M=LAYER_NORM_ROWS, CHUNKS=LAYER_NORM_BWD_CHUNKS, STORE_NORMED=normed is not None),
               num_warps=LAYER_NORM_BWD_WARPS)
    return column_parts



# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def launch(kernel, programs: int, device: torch.device, args: tuple, constexprs: dict, num_warps: int = 4,
           num_stages: int = 2) -> None:
    """One program per `programs`, on the tensors' GPU (Triton launches on the current device), or
    in the interpreter, which takes no warp or stage counts."""
    grid = (programs,)
    if _INTERPRETED or device.type != "cuda":
        kernel[grid](*args, **constexprs)
        return
    with torch.cuda.device(device):
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_precision(compute_dtype: torch.dtype) -> str:
    # fp32 compute is for exactness (tests): no TF32 rounding.
    return "ieee" if compute_dtype == torch.float32 else "tf32"


def k_chunk(k: int) -> int:
    """The widest K chunk (64, 32 or 16: tl.dot's minimum) that divides k."""
    return next(b for b in (64, 32, 16) if k % b == 0)


def layer_norm_forward(x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LN(x) [T, D] in out_dtype, and its fp32 mean and 1/std [T] (the backward recomputes LN(x) from them)."""
    tokens, d_model = x.shape
    normed = torch.empty((tokens, d_model), dtype=out_dtype, device=x.device)
    mean = torch.empty(tokens, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if tokens:
        launch(_layer_norm_fwd_rows, triton.cdiv(tokens, LAYER_NORM_ROWS), x.device,
               (x, norm_weight, norm_bias, normed, mean, rstd, tokens, x.stride(0), eps),
               dict(D=d_model, BLOCK_M=LAYER_NORM_ROWS))
    return normed, mean, rstd


def bias_gemm(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, block_m: int, block_n: int,
              num_warps: int, num_stages: int) -> torch.Tensor:
    """a [T, K] · weightᵀ + bias (weight [N, K], contiguous, in the compute dtype), in that dtype."""
    tokens, k = a.shape
    n = weight.shape[0]
    out = torch.empty((tokens, n), dtype=weight.dtype, device=a.device)
    if tokens:
        programs = triton.cdiv(tokens, block_m) * triton.cdiv(n, block_n)
        launch(_bias_gemm, programs, a.device, (a, weight, bias, out, tokens, n),
               dict(K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(64, k),
                    DOT_PRECISION=dot_precision(weight.dtype)), num_warps, num_stages)
    return out


def residual_gemm(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                  gelu_prologue: str | None, block_m: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """x + (act(a) · weightᵀ + bias), a [T, K] contiguous, weight [D, K]: [T, D] in x's dtype. act is GELU
    with F.gelu's `approximate` gelu_prologue, or none at all for None."""
    tokens, k = a.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens:
        gelu = gelu_prologue is not None
        launch(_residual_gemm, triton.cdiv(tokens, block_m), x.device, (a, weight, bias, x, y, tokens, k, x.stride(0)),
               dict(D=x.shape[1], BLOCK_M=block_m, BLOCK_K=k_chunk(k), GELU_PROLOGUE=gelu,
                    TANH_GELU=gelu and tanh_gelu(gelu_prologue), DOT_PRECISION=dot_precision(weight.dtype)),
               num_warps, num_stages)
    return y
