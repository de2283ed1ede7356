"""Pure-PyTorch block attention: the single source of truth for every backend and test.

It gathers the tokens into padded [num_blocks, 64, H, D] tiles, masks the keys past each block's
length, and runs plain softmax attention per tile. Any device, autograd through ordinary ops.
"""

import math

import torch

from .blocks import BLOCK_SIZE, block_table
from .rotary import apply_rotary


def block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rotate_v: bool = False,
    upcast: bool = True,
) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(D)) v inside each 64-token block, returned in q.dtype.

    With `upcast` the math runs in fp32 (fp64 inputs stay fp64); without it, in the input dtype,
    which is the "same-precision PyTorch" yardstick kernel errors are judged against.
    """
    with torch.autocast(q.device.type, enabled=False):  # the truth stays in its own precision
        return _block_attention_padded(q, k, v, offsets, cos, sin, rotate_v, upcast)


def _block_attention_padded(q, k, v, offsets, cos, sin, rotate_v, upcast):
    out_dtype = q.dtype
    compute_dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    if cos is not None:
        q, k = apply_rotary(q.to(compute_dtype), cos, sin), apply_rotary(k.to(compute_dtype), cos, sin)
        if rotate_v:
            v = apply_rotary(v.to(compute_dtype), cos, sin)
    total_tokens, heads, head_dim = q.shape
    out = torch.empty((total_tokens, heads, head_dim), dtype=compute_dtype, device=q.device)
    if total_tokens == 0:
        return out.to(out_dtype)

    block_start, block_len = block_table(offsets, total_tokens)
    real = block_len > 0  # the table's unused tail rows own no tokens
    block_start, block_len = block_start[real], block_len[real]
    lane = torch.arange(BLOCK_SIZE, device=q.device)
    valid = lane[None, :] < block_len[:, None]  # [num_blocks, 64]
    # Padded lanes point at the block's first token; their scores are masked and outputs dropped.
    token = torch.where(valid, block_start[:, None] + lane[None, :], block_start[:, None]).long()

    q_tiles, k_tiles, v_tiles = (x.to(compute_dtype)[token] for x in (q, k, v))  # [nb, 64, H, D]
    scores = torch.einsum("bihd,bjhd->bhij", q_tiles, k_tiles) / math.sqrt(head_dim)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out_tiles = torch.einsum("bhij,bjhd->bihd", probs, v_tiles)
    out = out.index_put((token[valid],), out_tiles[valid])
    return out.to(out_dtype)
