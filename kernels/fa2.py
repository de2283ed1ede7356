"""FlashAttention-2 baseline: block-diagonal attention as varlen attention over the blocks.

Every 64-token block becomes its own varlen "sequence" (cu_seqlens cut at block boundaries).
flash-attn's `flash_attn_varlen_func` is used when installed; otherwise PyTorch's built-in
FlashAttention-2 (aten::_flash_attention_forward/backward, present on torch 2.11 through 2.14),
wrapped in custom ops so torch.compile treats the data-dependent block count as opaque.
Rotary is applied as separate PyTorch ops first, which is all an FA2 user can do.
"""

import math

import torch

from .blocks import BLOCK_SIZE, block_cu_seqlens
from .rotary import apply_rotary

try:
    from flash_attn import flash_attn_varlen_func

    HAS_FLASH_ATTN = True
except ImportError:
    HAS_FLASH_ATTN = False

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def fa2_unsupported_reason(q: torch.Tensor) -> str | None:
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (FlashAttention-2 takes float16 or bfloat16)"
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (FlashAttention-2 takes multiples of 8 up to 256)"
    return None


@torch.library.custom_op("block_attention::fa2_forward", mutates_args=())
def _fa2_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cu_seqlens = block_cu_seqlens(offsets, q.shape[0])
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, BLOCK_SIZE, BLOCK_SIZE, 0.0, False, False, scale=1 / math.sqrt(q.shape[-1])
    )
    return out, lse, rng_state, unused


@_fa2_forward.register_fake
def _(q, k, v, offsets):
    return (
        torch.empty_like(q),
        q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
        q.new_empty((2,), dtype=torch.uint64),
        q.new_empty((), dtype=torch.uint64),
    )


@torch.library.custom_op("block_attention::fa2_backward", mutates_args=())
def _fa2_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_state: torch.Tensor,
    unused: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cu_seqlens = block_cu_seqlens(offsets, q.shape[0])
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, BLOCK_SIZE, BLOCK_SIZE, 0.0, False,
        rng_state, unused, scale=1 / math.sqrt(q.shape[-1]),
    )
    return dq, dk, dv


@_fa2_backward.register_fake
def _(grad_out, q, k, v, out, lse, rng_state, unused, offsets):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, offsets = inputs
    out, lse, rng_state, unused = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, offsets)


def _backward(ctx, grad_out, *_unused_grads):
    q, k, v, out, lse, rng_state, unused, offsets = ctx.saved_tensors
    dq, dk, dv = _fa2_backward(grad_out, q, k, v, out, lse, rng_state, unused, offsets)
    return dq, dk, dv, None


_fa2_forward.register_autograd(_backward, setup_context=_setup_context)


def block_attention_fa2(q, k, v, offsets, cos=None, sin=None, rotate_v=False):
    if cos is not None:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if rotate_v:
            v = apply_rotary(v, cos, sin)
    if HAS_FLASH_ATTN:
        cu_seqlens = block_cu_seqlens(offsets, q.shape[0])
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, BLOCK_SIZE, BLOCK_SIZE, softmax_scale=1 / math.sqrt(q.shape[-1])
        )
    return _fa2_forward(q, k, v, offsets)[0]
