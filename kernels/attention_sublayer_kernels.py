"""The attention sublayer's kernel backends, `triton` and `tlx`; see attention_sublayer_dispatch.py.

One plan, as the fused MLP's default ("gemms"): GEMMs whose prologues and epilogues carry the
elementwise work, around a block-attention kernel (the backend's name picks it) that applies rotary
itself. Forward, four kernels and three HBM round trips of activations:
  LayerNorm rows -> LN(x) (compute dtype) and the statistics;
  LN(x) · Wqkvᵀ + bqkv -> qkv [T, 3D] (cuBLAS, bias in its epilogue); q, k, v are its views, read in place;
  block attention (rotary fused) -> attn [T, H, D/H];
  x + attn · Woᵀ + bo -> y, bias and residual in the epilogue (the unfused path's separate add).
Backward: dAttn = dY · Wo and dWo = dYᵀ · attn (cuBLAS), the block attention backward (rotary's
inverse fused) writing dQ, dK, dV side by side as dQKV [T, 3D], dLN = dQKV · Wqkv (cuBLAS), then one
LayerNorm-backward kernel that adds the residual's gradient, writes LN(x) for dWqkv = dQKVᵀ · LN(x)
and sums the LN-affine and output-bias gradients per tile.
Invariants: as kernels/sublayer_triton.py's (d_model a power of two, 16..256) and the block-attention
kernel's (head_dim, dtype, device); the attention kernels need no residuals from their forward.

That is the "gemms" plan, the default. The "blocks" plan runs each pass as one kernel per 64-token
block instead: on the triton backend both passes are Triton kernels (kernels/attention_sublayer_blocks.py);
on the tlx backend both are warp-specialized TLX kernels (kernels/attention_sublayer_tlx.py), the
backward's around the "gemms" plan's LayerNorm-backward kernel and weight-gradient GEMMs. A pass picks it with
launch={"fwd" or "bwd": {"plan": "blocks"}}, and the two passes' plans mix (both save the same
tensors). The default stays "gemms" until a GPU run shows "blocks" faster.
"""

import json

import torch

from .attention_sublayer_blocks import backward_blocks, blocks_launch, forward_blocks, without_plan
from .attention_sublayer_dispatch import attention_sublayer_ops
from .attention_sublayer_tlx import backward_core_tlx, forward_blocks_tlx
from .backend import launch_json, launch_overrides
from .dispatch import get_backend
from .sublayer_dispatch import SublayerBackend
from .sublayer_triton import (
    layer_norm_backward,
    layer_norm_forward,
    residual_gemm,
    rows_contiguous,
)

SUPPORTED_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The output GEMM's tiles: the fused MLP forward's (kernels/mlp_sublayer_triton.py, tuned on the H200 at
# d_model 256): 128 rows over 8 warps, a 3-deep pipeline of K steps.
BLOCK_M, NUM_WARPS, NUM_STAGES = 128, 8, 3
PLANS = ("gemms", "blocks")


def _plan(launch: str, direction: str) -> str:
    """The plan `direction` runs under launch overrides `launch`."""
    plan = launch_overrides(launch, direction).get("plan", "gemms")
    if plan not in PLANS:
        raise ValueError(f"unknown attention_sublayer {direction} plan {plan!r}; choose one of {PLANS}")
    return plan


def _attention_launch(launch: str) -> str:
    """The overrides the block-attention kernel takes: `launch` without the sublayer's plan keys."""
    if not launch:
        return launch
    return launch_json({direction: without_plan(overrides) for direction, overrides in json.loads(launch).items()})


def _launchers(attention: str):
    """The forward and backward of the attention sublayer around block-attention backend `attention`'s kernels."""
    attention_ops = get_backend(attention).ops

    def forward(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start, block_len, num_blocks, cos, sin,
                num_heads, rotate_v, eps, launch):
        tokens, d_model = x.shape
        x = rows_contiguous(x)
        norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out = (
            t.contiguous() for t in (norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out))
        if _plan(launch, "fwd") == "blocks":
            if attention == "tlx":
                return forward_blocks_tlx(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start,
                                          block_len, num_blocks, cos, sin, num_heads, rotate_v, eps, launch)
            return forward_blocks(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start, block_len,
                                  num_blocks, cos, sin, num_heads, rotate_v, eps, blocks_launch(launch, "fwd"))
        launch = _attention_launch(launch)
        normed, mean, rstd = layer_norm_forward(x, norm_weight, norm_bias, eps, w_qkv.dtype)
        # cuBLAS with its bias epilogue (one rounding, as F.linear): faster here than the Triton
        # bias GEMM, 0.129 against 0.190 ms on the H200 at configs/gpu.yaml's shape (attention_sublayer_h200.md).
        qkv = torch.addmm(b_qkv, normed, w_qkv.t())
        q, k, v = qkv.view(tokens, 3, num_heads, d_model // num_heads).unbind(1)
        attn = attention_ops.forward_launcher(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v,
                                              launch)[0]
        y = residual_gemm(attn.view(tokens, d_model), w_out, b_out, x, None, BLOCK_M, NUM_WARPS, NUM_STAGES)
        return y, qkv, attn, mean, rstd

    def backward(grad_y, x, norm_weight, norm_bias, w_qkv, w_out, qkv, attn, mean, rstd, block_start, block_len,
                 num_blocks, cos, sin, num_heads, rotate_v, eps, launch):
        tokens, d_model = x.shape
        compute_dtype = w_qkv.dtype
        x, grad_y = rows_contiguous(x), rows_contiguous(grad_y)
        norm_weight, norm_bias, w_qkv, w_out = (t.contiguous() for t in (norm_weight, norm_bias, w_qkv, w_out))
        plan = _plan(launch, "bwd")
        if plan == "blocks" and attention != "tlx":
            return backward_blocks(grad_y, x, norm_weight, norm_bias, w_qkv, w_out, qkv, attn, mean, rstd, block_start,
                                   block_len, num_blocks, cos, sin, num_heads, rotate_v, eps,
                                   blocks_launch(launch, "bwd"))
        # The output projection's output was rounded to the compute dtype; its gradient is taken in it too.
        grad_out = grad_y.to(compute_dtype).contiguous()
        dw_out = grad_out.t() @ attn.view(tokens, d_model)
        if plan == "blocks":
            # The tlx backend's per-block kernel: dAttn, the attention's backward and dLN in one pass.
            grad_qkv, grad_normed = backward_core_tlx(grad_out, qkv, w_qkv, w_out, block_start, block_len, num_blocks,
                                                      cos, sin, num_heads, rotate_v, launch)
        else:
            launch = _attention_launch(launch)
            grad_attn = grad_out @ w_out
            q, k, v = qkv.view(tokens, 3, num_heads, d_model // num_heads).unbind(1)
            # The attention backward writes dq, dk, dv into one [T, 3D] gradient, as autograd's unbind
            # gives the unfused path, so LN's output gradient is one GEMM over K = 3D rounded once (three
            # products added would round three times), with no copy to stack them.
            grad_qkv = torch.empty((tokens, 3 * d_model), dtype=compute_dtype, device=x.device)
            attention_ops.backward_launcher(grad_attn.view(q.shape), q, k, v, block_start, block_len, num_blocks, cos,
                                            sin, rotate_v, launch, attn,
                                            into=grad_qkv.view(tokens, 3, *q.shape[1:]).unbind(1))
            grad_normed = grad_qkv @ w_qkv
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        normed = torch.empty((tokens, d_model), dtype=compute_dtype, device=x.device)
        column_parts = layer_norm_backward(grad_normed, grad_y, x, mean, rstd, norm_weight, norm_bias, dx, normed)
        dw_qkv = grad_qkv.t() @ normed
        db_qkv = grad_qkv.sum(0, dtype=torch.float32).to(compute_dtype)
        # Copies: a custom op's outputs may not be views of one another.
        dnorm_weight, dnorm_bias, db_out = column_parts.sum(0).unbind(0)
        return (dx, dnorm_weight.to(norm_weight.dtype, copy=True), dnorm_bias.to(norm_bias.dtype, copy=True), dw_qkv,
                db_qkv, dw_out, db_out.to(compute_dtype, copy=True))

    return forward, backward


def _unsupported_reason(attention: str):
    def reason(x: torch.Tensor, num_heads: int, compute_dtype: torch.dtype) -> str | None:
        d_model = x.shape[1]
        if d_model < 16 or d_model > 256 or d_model & (d_model - 1):
            return f"d_model {d_model} (the Triton LayerNorm and GEMM kernels take a power of two from 16 to 256)"
        if x.dtype not in SUPPORTED_X_DTYPES:
            return f"x dtype {x.dtype} (the kernels take float16, bfloat16 or float32)"
        # The attention kernel's rules (dtype, head_dim, device) on q, k, v like the projection's.
        return get_backend(attention).unsupported_reason(x.new_empty(0, num_heads, d_model // num_heads,
                                                                     dtype=compute_dtype))

    return reason


def kernel_backend(name: str) -> SublayerBackend:
    """Backend `name` (triton or tlx): its ops registered once, on first use."""
    run = attention_sublayer_ops(name, *_launchers(name))
    return SublayerBackend(name, _unsupported_reason(name), run, ops=run)
