"""The attention sublayer's "blocks" plan: one Triton kernel per pass, one program per 64-token block.

A token attends only inside its 64-token block, and LayerNorm and the projections are token-local,
so a block's whole sublayer needs only its own rows: the forward reads x and writes y, with LN(x),
the q/k/v projection, rotary and every head's attention on chip; the backward reads dY and x and
writes dX, with the output projection's and the attention's backward and LayerNorm's on chip. Two
products read back rows the same program has just stored (they must be stored anyway, and come
back from L2): the output projection reads the block's attention output, and LN's output gradient
(dQKV · Wqkv, accumulated in fp32) reads its dQKV; so a [64, D] fp32 accumulator is never live
beside LN(x) or a head's temporaries. Register pressure is the limit of this design: at d_model 256
and 8 warps, sm_90 compiles (fbtriton 3.7.4) still spill 256 bytes a thread in the forward and 656
in the backward, where each [64, 256] wgmma A operand (LN(x), dY) is held through the heads. The weights (Wqkv [3D, D], Wo [D, D]) are re-read by
every block, from L2. On the H200 (benchmarks/results/attention_sublayer_h200.md) it passes the parity
rule but runs 2.2x slower than the "gemms" plan: a program goes through its block's stages in series,
with nothing hiding the weights' L2 latency; overlapping them is the warp-specialized TLX design's job.

What still reaches HBM, and why (per token, d = d_model, compute dtype):
- the forward writes q, k, v (3d) and the attention output (d) for the backward, and LN's statistics:
  the backward reads q, k, v rather than recompute a [d, 3d] GEMM per block;
- the backward writes dQKV (3d), LN(x) (d) and dY in the compute dtype (d): the weight gradients
  dWqkv = dQKVᵀ · LN(x) and dWo = dYᵀ · attn are sums over every block, done as two cuBLAS GEMMs
  (a per-block partial of a [3d, d] weight gradient would cost more than the GEMM), and the bias and
  LN-affine gradients come from per-block column sums added in a fixed order: no atomics, so every
  gradient is bitwise repeatable.

Invariants, as kernels/sublayer_triton.py's and kernels/block_attention_triton.py's: blocks from
kernels.blocks.block_table (contiguous rows of one sequence, only the table's first num_blocks real,
every token in exactly one block); rows >= a block's length load as zeros, are never stored and add
nothing to any sum; d_model a power of two from 16 to 256, head_dim 32, 64 or 128; weights
contiguous in nn.Linear's layout and in the compute dtype; LayerNorm, softmax and rotary in fp32.
Roundings follow the unfused path's: q, k, v and the attention output in the compute dtype, the
output projection rounded before the residual.
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from .backend import launch_overrides
from .block_attention_triton import (_INTERPRETED, _INTERPRETER_PROGRAMS, _rotate_item, _softmax_scores,
                                     rotate_pairs)
from .blocks import BLOCK_SIZE
from .sublayer_triton import _layer_norm_backward_rows, _layer_norm_rows, _row_stats, dot_precision, k_chunk, launch


@triton.jit
def _head_rows(w_ptr, first_row, D: tl.constexpr, HEAD_DIM: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Rows first_row .. first_row + HEAD_DIM of an nn.Linear weight W [N, D]: [HEAD_DIM, D], or
    with TRANSPOSE their transpose [D, HEAD_DIM] (the B operand of x · Wᵀ)."""
    cols = tl.arange(0, D)
    w = tl.load(w_ptr + (first_row + tl.arange(0, HEAD_DIM))[:, None] * D + cols[None, :])
    if TRANSPOSE:
        w = tl.trans(w)
    return w


@triton.jit
def _head_cols(w_ptr, first_col, D: tl.constexpr, HEAD_DIM: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Columns first_col .. first_col + HEAD_DIM of a weight W [D, D]: [D, HEAD_DIM], or with
    TRANSPOSE their transpose [HEAD_DIM, D]."""
    rows = tl.arange(0, D)
    w = tl.load(w_ptr + rows[:, None] * D + (first_col + tl.arange(0, HEAD_DIM))[None, :])
    if TRANSPOSE:
        w = tl.trans(w)
    return w


@triton.jit
def _head_projection(normed, w_ptr, b_ptr, first_row, D: tl.constexpr, HEAD_DIM: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """normed · W[first_row : first_row + HEAD_DIM]ᵀ + b[...]: one head's q, k or v slice of the
    projection, rounded to the weight's dtype as the projection's output is."""
    acc = tl.dot(normed, _head_rows(w_ptr, first_row, D, HEAD_DIM, True), input_precision=DOT_PRECISION)
    bias = tl.load(b_ptr + first_row + tl.arange(0, HEAD_DIM)).to(tl.float32)
    return (acc + bias[None, :]).to(w_ptr.dtype.element_ty)


@triton.jit
def _rotated_back(dq, dk, dv, cos, sin, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTATE_V: tl.constexpr):
    """A head's fp32 gradients of the rotated q, k (and with ROTATE_V v) taken back through rotary."""
    dq = rotate_pairs(dq, cos, sin, BLOCK, HEAD_DIM, True)
    dk = rotate_pairs(dk, cos, sin, BLOCK, HEAD_DIM, True)
    if ROTATE_V:
        dv = rotate_pairs(dv, cos, sin, BLOCK, HEAD_DIM, True)
    return dq, dk, dv


@triton.jit
def _store_head_gradients(grad_qkv_ptr, offs, dq, dk, dv, row_ok, D: tl.constexpr, dtype: tl.constexpr):
    """A head's dq, dk, dv rounded to the compute dtype and stored at their columns of dQKV [T, 3D] (offs:
    the head's q columns); returns the rounded tiles."""
    dq, dk, dv = dq.to(dtype), dk.to(dtype), dv.to(dtype)
    tl.store(grad_qkv_ptr + offs, dq, mask=row_ok[:, None])
    tl.store(grad_qkv_ptr + offs + D, dk, mask=row_ok[:, None])
    tl.store(grad_qkv_ptr + offs + 2 * D, dv, mask=row_ok[:, None])
    return dq, dk, dv


@triton.jit
def _block_rows(block_start_ptr, block_len_ptr, blk, BLOCK: tl.constexpr):
    """Block `blk` of the table: its first token, length, token indices and row mask."""
    start = tl.load(block_start_ptr + blk)
    length = tl.load(block_len_ptr + blk)
    rows = tl.arange(0, BLOCK)
    return start, length, (start + rows).to(tl.int64), rows < length


@triton.jit
def _rows_times_weight(a_ptr, w_ptr, tokens, row_ok, K: tl.constexpr, N: tl.constexpr, K_CHUNK: tl.constexpr,
                       W_IS_NK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A[tokens] · B in fp32, A [T, K] contiguous (masked rows as zeros), B = Wᵀ of a weight W [N, K]
    (W_IS_NK) or W [K, N] itself, over K in K_CHUNK steps."""
    cols = tl.arange(0, N)
    acc = tl.zeros((tokens.shape[0], N), dtype=tl.float32)
    for k0 in range(0, K, K_CHUNK):
        ks = k0 + tl.arange(0, K_CHUNK)
        a = tl.load(a_ptr + tokens[:, None] * K + ks[None, :], mask=row_ok[:, None], other=0.0)
        if W_IS_NK:
            w = tl.load(w_ptr + cols[None, :] * K + ks[:, None])
        else:
            w = tl.load(w_ptr + ks[:, None] * N + cols[None, :])
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _attention_sublayer_fwd_blocks(
    x_ptr, norm_weight_ptr, norm_bias_ptr, w_qkv_ptr, b_qkv_ptr, w_out_ptr, b_out_ptr, cos_ptr, sin_ptr,
    block_start_ptr, block_len_ptr, num_blocks_ptr, y_ptr, qkv_ptr, attn_ptr, mean_ptr, rstd_ptr,
    x_stride, eps, qk_scale,
    D: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROTARY: tl.constexpr,
    ROTATE_V: tl.constexpr, DOT_PRECISION: tl.constexpr, K_CHUNK: tl.constexpr,
):
    """y = x + Wo · blockattn(rotary(split(Wqkv · LN(x) + bqkv))) + bo for every block, and what the
    backward reads: q, k, v (qkv [T, 3D]), the attention output (attn [T, D]) and LN's statistics."""
    dtype = w_qkv_ptr.dtype.element_ty
    cols = tl.arange(0, D)
    head_cols = tl.arange(0, HEAD_DIM)
    for blk in tl.range(tl.program_id(0), tl.load(num_blocks_ptr), tl.num_programs(0), num_stages=1):
        start, length, tokens, row_ok = _block_rows(block_start_ptr, block_len_ptr, blk, BLOCK)
        x = tl.load(x_ptr + tokens[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        mean, rstd = _row_stats(x, eps, D)
        tl.store(mean_ptr + tokens, mean, mask=row_ok)
        tl.store(rstd_ptr + tokens, rstd, mask=row_ok)
        normed = _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D)[1].to(dtype)
        for head in range(HEADS):
            # q, k, v of this head: three [BLOCK, HEAD_DIM] slices of the projection, rounded as its output is.
            qkv_offs = tokens[:, None] * (3 * D) + (head * HEAD_DIM + head_cols)[None, :]
            q = _head_projection(normed, w_qkv_ptr, b_qkv_ptr, head * HEAD_DIM, D, HEAD_DIM, DOT_PRECISION)
            k = _head_projection(normed, w_qkv_ptr, b_qkv_ptr, D + head * HEAD_DIM, D, HEAD_DIM, DOT_PRECISION)
            v = _head_projection(normed, w_qkv_ptr, b_qkv_ptr, 2 * D + head * HEAD_DIM, D, HEAD_DIM, DOT_PRECISION)
            tl.store(qkv_ptr + qkv_offs, q, mask=row_ok[:, None])
            tl.store(qkv_ptr + qkv_offs + D, k, mask=row_ok[:, None])
            tl.store(qkv_ptr + qkv_offs + 2 * D, v, mask=row_ok[:, None])
            if ROTARY:
                # cos/sin loaded per head (from L2): held through the heads, they cost registers the kernel spills.
                q, k, v, cos, sin = _rotate_item(q, k, v, cos_ptr, sin_ptr, start, row_ok, BLOCK, HEAD_DIM, ROTATE_V)
            p, row_sum = _softmax_scores(q, k, length, qk_scale, BLOCK, DOT_PRECISION)
            out = (tl.dot(p.to(dtype), v, input_precision=DOT_PRECISION) / row_sum[:, None]).to(dtype)
            tl.store(attn_ptr + tokens[:, None] * D + (head * HEAD_DIM + head_cols)[None, :], out, mask=row_ok[:, None])
        # The output projection reads the block's attention rows back (from L2) once every head has
        # stored them: LN(x) and the projection's fp32 accumulator are never live at once.
        tl.debug_barrier()
        acc = _rows_times_weight(attn_ptr, w_out_ptr, tokens, row_ok, D, D, K_CHUNK, True, DOT_PRECISION)
        # The linear's output is rounded to the compute dtype before the residual, as nn.Linear's is.
        linear = (acc + tl.load(b_out_ptr + cols).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        # x again (from L2) rather than held in registers through the heads.
        x = tl.load(x_ptr + tokens[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(y_ptr + tokens[:, None] * D + cols[None, :], (x + linear).to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _attention_sublayer_bwd_blocks(
    grad_y_ptr, x_ptr, norm_weight_ptr, norm_bias_ptr, w_qkv_ptr, w_out_ptr, qkv_ptr, mean_ptr, rstd_ptr,
    cos_ptr, sin_ptr, block_start_ptr, block_len_ptr, num_blocks_ptr,
    dx_ptr, grad_out_ptr, grad_qkv_ptr, normed_ptr, column_parts_ptr, qkv_column_parts_ptr,
    x_stride, grad_y_stride, sm_scale, qk_scale,
    D: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROTARY: tl.constexpr,
    ROTATE_V: tl.constexpr, DOT_PRECISION: tl.constexpr, K_CHUNK: tl.constexpr,
):
    """Every block's backward: dX (with the residual's dY), and for the weight gradients dY in the
    compute dtype (grad_out [T, D]), dQKV [T, 3D], LN(x) [T, D], and per-block column sums: row `blk`
    of column_parts [blocks, 3, D] (LN weight, LN bias, output bias) and of qkv_column_parts
    [blocks, 3D] (the projection's bias)."""
    dtype = w_qkv_ptr.dtype.element_ty
    cols = tl.arange(0, D)
    head_cols = tl.arange(0, HEAD_DIM)
    for blk in tl.range(tl.program_id(0), tl.load(num_blocks_ptr), tl.num_programs(0), num_stages=1):
        start, length, tokens, row_ok = _block_rows(block_start_ptr, block_len_ptr, blk, BLOCK)
        # The output projection's output was rounded to the compute dtype; its gradient is taken in it too.
        grad_out = tl.load(grad_y_ptr + tokens[:, None] * grad_y_stride + cols[None, :], mask=row_ok[:, None],
                           other=0.0).to(dtype)
        tl.store(grad_out_ptr + tokens[:, None] * D + cols[None, :], grad_out, mask=row_ok[:, None])
        for head in range(HEADS):
            qkv_offs = tokens[:, None] * (3 * D) + (head * HEAD_DIM + head_cols)[None, :]
            q = tl.load(qkv_ptr + qkv_offs, mask=row_ok[:, None], other=0.0)
            k = tl.load(qkv_ptr + qkv_offs + D, mask=row_ok[:, None], other=0.0)
            v = tl.load(qkv_ptr + qkv_offs + 2 * D, mask=row_ok[:, None], other=0.0)
            # The attention output's gradient, dY · Wo[:, head's columns], rounded as the unfused GEMM's is.
            grad_attn = tl.dot(grad_out, _head_cols(w_out_ptr, head * HEAD_DIM, D, HEAD_DIM, False),
                               input_precision=DOT_PRECISION).to(dtype)
            if ROTARY:
                # cos/sin loaded per head (from L2): held through the heads, they cost registers the kernel spills.
                q, k, v, cos, sin = _rotate_item(q, k, v, cos_ptr, sin_ptr, start, row_ok, BLOCK, HEAD_DIM, ROTATE_V)
            p, row_sum = _softmax_scores(q, k, length, qk_scale, BLOCK, DOT_PRECISION)
            p = p / row_sum[:, None]
            dp = tl.dot(grad_attn, tl.trans(v), input_precision=DOT_PRECISION)
            ds = (p * (dp - tl.sum(p * dp, 1)[:, None]) * sm_scale).to(dtype)
            dv = tl.dot(tl.trans(p.to(dtype)), grad_attn, input_precision=DOT_PRECISION)
            dk = tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION)
            dq = tl.dot(ds, k, input_precision=DOT_PRECISION)
            if ROTARY:
                dq, dk, dv = _rotated_back(dq, dk, dv, cos, sin, BLOCK, HEAD_DIM, ROTATE_V)
            dq, dk, dv = _store_head_gradients(grad_qkv_ptr, qkv_offs, dq, dk, dv, row_ok, D, dtype)
            # Rows >= length are zero in all three (their dY rows are), so the sums take every row.
            parts_offs = tl.cast(blk, tl.int64) * (3 * D) + head * HEAD_DIM + head_cols
            tl.store(qkv_column_parts_ptr + parts_offs, tl.sum(dq.to(tl.float32), 0))
            tl.store(qkv_column_parts_ptr + parts_offs + D, tl.sum(dk.to(tl.float32), 0))
            tl.store(qkv_column_parts_ptr + parts_offs + 2 * D, tl.sum(dv.to(tl.float32), 0))
        # LN's output gradient, dQKV · Wqkv in fp32 (the unfused path rounds it once more), from the
        # block's dQKV rows read back (from L2) once every head has stored them.
        tl.debug_barrier()
        grad_normed = _rows_times_weight(grad_qkv_ptr, w_qkv_ptr, tokens, row_ok, 3 * D, D, K_CHUNK, False,
                                         DOT_PRECISION)
        # LayerNorm's backward last, so that x and dY in fp32 are not held through the heads.
        x = tl.load(x_ptr + tokens[:, None] * x_stride + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + tokens, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + tokens, mask=row_ok, other=0.0)
        x_hat, normed = _layer_norm_rows(x, norm_weight_ptr, norm_bias_ptr, mean, rstd, D)
        tl.store(normed_ptr + tokens[:, None] * D + cols[None, :], normed.to(dtype), mask=row_ok[:, None])
        grad_y = tl.load(grad_y_ptr + tokens[:, None] * grad_y_stride + cols[None, :], mask=row_ok[:, None],
                         other=0.0).to(tl.float32)
        # Masked rows: x̂ = (0 - 0) * 0 = 0 there, so they add nothing to the sums either.
        sums = _layer_norm_backward_rows(grad_normed, x_hat, rstd, grad_y, norm_weight_ptr, dx_ptr, tokens, row_ok, D)
        for i in tl.static_range(3):
            tl.store(column_parts_ptr + (tl.cast(blk, tl.int64) * 3 + i) * D + cols, sums[i])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlocksLaunch:
    """How a "blocks" kernel is launched: one program per block of the table (its fixed, shape-derived
    size; programs past num_blocks find no block), `num_warps` each."""

    num_warps: int = 8


def without_plan(overrides: dict) -> dict:
    """One pass's launch overrides but the sublayer's "plan" key: what the plan's own kernels take."""
    return {key: value for key, value in overrides.items() if key != "plan"}


def blocks_launch(launch: str, direction: str) -> BlocksLaunch:
    """The direction's settings from `launch` (kernels.backend.launch_json form), its "plan" key aside."""
    overrides = without_plan(launch_overrides(launch, direction))
    unknown = set(overrides) - {f.name for f in fields(BlocksLaunch)}
    if unknown:
        raise ValueError(f"unknown attention_sublayer 'blocks' {direction} launch settings {sorted(unknown)}; "
                         f"choose from {[f.name for f in fields(BlocksLaunch)]}")
    return replace(BlocksLaunch(), **overrides)


def _programs(block_start: torch.Tensor) -> int:
    # The interpreter runs programs one after another: a few, each looping over several blocks.
    return min(block_start.numel(), _INTERPRETER_PROGRAMS) if _INTERPRETED else block_start.numel()


def _softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)  # written as block attention's launcher writes it: the same bits


def _constexprs(d_model: int, num_heads: int, dtype: torch.dtype, rotary: bool, rotate_v: bool) -> dict:
    return dict(D=d_model, HEADS=num_heads, HEAD_DIM=d_model // num_heads, BLOCK=BLOCK_SIZE, ROTARY=rotary,
                ROTATE_V=rotary and rotate_v, DOT_PRECISION=dot_precision(dtype), K_CHUNK=k_chunk(d_model))


def forward_blocks(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start, block_len, num_blocks, cos,
                   sin, num_heads, rotate_v, eps, settings: BlocksLaunch):
    """(y, qkv, attn, mean, rstd), as kernels/attention_sublayer_kernels.py's forward returns them."""
    tokens, d_model = x.shape
    head_dim = d_model // num_heads
    y = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    qkv = torch.empty((tokens, 3 * d_model), dtype=w_qkv.dtype, device=x.device)
    attn = torch.empty((tokens, num_heads, head_dim), dtype=w_qkv.dtype, device=x.device)
    mean = torch.empty(tokens, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if tokens:
        rotary = cos is not None
        args = (x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, cos, sin, block_start, block_len, num_blocks,
                y, qkv, attn, mean, rstd, x.stride(0), eps, _softmax_scale(head_dim) * math.log2(math.e))
        launch(_attention_sublayer_fwd_blocks, _programs(block_start), x.device, args,
               _constexprs(d_model, num_heads, w_qkv.dtype, rotary, rotate_v), settings.num_warps, 1)
    return y, qkv, attn, mean, rstd


def backward_blocks(grad_y, x, norm_weight, norm_bias, w_qkv, w_out, qkv, attn, mean, rstd, block_start, block_len,
                    num_blocks, cos, sin, num_heads, rotate_v, eps, settings: BlocksLaunch):
    """(dx, dnorm_weight, dnorm_bias, dw_qkv, db_qkv, dw_out, db_out), as attention_sublayer_kernels.py's backward."""
    tokens, d_model = x.shape
    head_dim = d_model // num_heads
    compute_dtype = w_qkv.dtype
    dx = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    grad_out = torch.empty((tokens, d_model), dtype=compute_dtype, device=x.device)
    grad_qkv = torch.empty((tokens, 3 * d_model), dtype=compute_dtype, device=x.device)
    normed = torch.empty((tokens, d_model), dtype=compute_dtype, device=x.device)
    # Zeros: the table's unused rows (and an empty batch) have no block, and their sums are zero.
    blocks = block_start.numel()
    column_parts = torch.zeros((blocks, 3, d_model), dtype=torch.float32, device=x.device)
    qkv_column_parts = torch.zeros((blocks, 3 * d_model), dtype=torch.float32, device=x.device)
    if tokens:
        rotary = cos is not None
        scale = _softmax_scale(head_dim)
        args = (grad_y, x, norm_weight, norm_bias, w_qkv, w_out, qkv, mean, rstd, cos, sin, block_start, block_len,
                num_blocks, dx, grad_out, grad_qkv, normed, column_parts, qkv_column_parts, x.stride(0),
                grad_y.stride(0), scale, scale * math.log2(math.e))
        launch(_attention_sublayer_bwd_blocks, _programs(block_start), x.device, args,
               _constexprs(d_model, num_heads, compute_dtype, rotary, rotate_v), settings.num_warps, 1)
    dw_qkv = grad_qkv.t() @ normed
    dw_out = grad_out.t() @ attn.view(tokens, d_model)
    # Copies: a custom op's outputs may not be views of one another.
    dnorm_weight, dnorm_bias, db_out = column_parts.sum(0).unbind(0)
    return (dx, dnorm_weight.to(norm_weight.dtype, copy=True), dnorm_bias.to(norm_bias.dtype, copy=True), dw_qkv,
            qkv_column_parts.sum(0).to(compute_dtype), dw_out, db_out.to(compute_dtype, copy=True))
