"""FlashAttention-2 baseline: block-diagonal attention as varlen attention over the blocks.

Every 64-token block becomes its own varlen "sequence" (cu_seqlens cut at block boundaries).
flash-attn's `flash_attn_varlen_func` is used when installed; otherwise PyTorch's built-in
FlashAttention-2 (aten::_flash_attention_forward/backward, present on torch 2.11 through 2.14),
wrapped in custom ops so torch.compile treats the data-dependent block count as opaque.
Rotary is applied as separate PyTorch ops first (by the dispatcher), which is all an FA2 user can do.
"""

import math

import torch

from .backend import Backend, kernel_ops
from .blocks import BLOCK_SIZE, BlockTable, block_cu_seqlens

try:
    from flash_attn import flash_attn_varlen_func

    HAS_FLASH_ATTN = True
except ImportError:
    HAS_FLASH_ATTN = False

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def fa2_unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"it needs a CUDA GPU and the tensors are on {device.type}"
    return None


def fa2_unsupported_reason(q: torch.Tensor) -> str | None:
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (FlashAttention-2 takes float16 or bfloat16)"
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (FlashAttention-2 takes multiples of 8 up to 256)"
    return None


def _forward(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch):
    cu_seqlens = block_cu_seqlens(block_start, q.shape[0])
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, BLOCK_SIZE, BLOCK_SIZE, 0.0, False, False, scale=1 / math.sqrt(q.shape[-1])
    )
    # Without dropout the backward never reads the RNG state (the generator's position, different
    # every call); zeroed, the op's outputs are a function of its inputs, as opcheck requires.
    return out, lse, rng_state.zero_(), unused.zero_()


def _fake_residuals(q):
    # logsumexp [H, T] and the (unused, dropout-free) RNG state the backward takes back.
    return [
        q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
        q.new_empty((2,), dtype=torch.uint64),
        q.new_empty((), dtype=torch.uint64),
    ]


def _backward(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch, out, lse, rng_state,
              unused):
    cu_seqlens = block_cu_seqlens(block_start, q.shape[0])
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, BLOCK_SIZE, BLOCK_SIZE, 0.0, False,
        rng_state, unused, scale=1 / math.sqrt(q.shape[-1]),
    )
    return dq, dk, dv


_run_ops = kernel_ops("fa2", _forward, _backward, _fake_residuals)


def _run(q, k, v, table: BlockTable, cos, sin, rotate_v, launch):
    # Rotary was applied by the dispatcher (fuses_rotary=False): FA2 has no rotary of its own.
    if HAS_FLASH_ATTN:
        cu_seqlens = block_cu_seqlens(table.block_start, table.total_tokens)
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, BLOCK_SIZE, BLOCK_SIZE, softmax_scale=1 / math.sqrt(q.shape[-1])
        )
    return _run_ops(q, k, v, table, None, None, False, launch)


HOW_TO_GET = "run on an NVIDIA GPU with a CUDA build of PyTorch (optionally `pip install flash-attn`)"
BACKEND = Backend("fa2", HOW_TO_GET, fa2_unavailable_reason, fa2_unsupported_reason, _run, fuses_rotary=False, ops=_run_ops)
