"""Rotary position embedding, interleaved-pair (GPT-J) convention.

Pairs (x[2i], x[2i+1]) rotate by angle pos * base^(-2i/D):
    (x0, x1) -> (x0*cos - x1*sin, x0*sin + x1*cos)
Every backend takes the per-token tables cos, sin: fp32 [total_tokens, head_dim // 2], so fused
kernels and the separate-op path compute the same function from the same numbers.
"""

from dataclasses import dataclass

import torch

from .blocks import BLOCK_SIZE


@dataclass(frozen=True)
class Rotary:
    """How to rotate q and k (and optionally v) before block attention.

    Positions default to each token's index within its sequence; `within_block` uses the index
    within its 64-token block instead. Either `positions` (int [total_tokens]) or precomputed
    `cos`/`sin` (fp32 [total_tokens, head_dim // 2]) may be given to override both.
    """

    base: float = 10000.0
    within_block: bool = False
    rotate_v: bool = False
    positions: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def token_positions(offsets: torch.Tensor, total_tokens: int, within_block: bool = False) -> torch.Tensor:
    """Index of each token within its sequence (or within its block), int64 [total_tokens]."""
    token = torch.arange(total_tokens, device=offsets.device)
    seq_of_token = torch.searchsorted(offsets.to(torch.int64), token, right=True) - 1
    positions = token - offsets.to(torch.int64)[seq_of_token]
    return positions % BLOCK_SIZE if within_block else positions


def rotary_tables(
    rotary: Rotary, offsets: torch.Tensor, total_tokens: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 (cos, sin) tables, [total_tokens, head_dim // 2], for `rotary` on this batch."""
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    half = head_dim // 2
    if rotary.cos is not None or rotary.sin is not None:
        if rotary.cos is None or rotary.sin is None:
            raise ValueError("Rotary needs both cos and sin, or neither")
        for name, table in (("cos", rotary.cos), ("sin", rotary.sin)):
            if tuple(table.shape) != (total_tokens, half):
                raise ValueError(f"Rotary.{name} must have shape ({total_tokens}, {half}), got {tuple(table.shape)}")
            if table.device != offsets.device:
                raise ValueError(f"Rotary.{name} is on {table.device}, the inputs are on {offsets.device}")
        return rotary.cos.float().contiguous(), rotary.sin.float().contiguous()
    if rotary.positions is not None:
        if tuple(rotary.positions.shape) != (total_tokens,):
            raise ValueError(f"Rotary.positions must have shape ({total_tokens},), got {tuple(rotary.positions.shape)}")
        positions = rotary.positions.to(device=offsets.device, dtype=torch.int64)
        if rotary.within_block:
            positions = positions % BLOCK_SIZE
    else:
        positions = token_positions(offsets, total_tokens, rotary.within_block)
    # fp64 angles: positions reach 1e5+ in long histories, where fp32 products lose the low bits.
    inv_freq = rotary.base ** (-torch.arange(0, head_dim, 2, device=offsets.device, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotates x [T, H, D] by the per-token tables; `inverse` rotates back (the gradient's map).

    Math runs in at least fp32 and the result is cast back to x.dtype once, as a fused kernel would.
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    pairs = x.to(compute_dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c = cos.to(compute_dtype)[:, None, :]
    s = sin.to(compute_dtype)[:, None, :]
    if inverse:
        s = -s
    rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
