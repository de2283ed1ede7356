"""PyTorch FlexAttention as a peer backend: the 64-token block-diagonal pattern as a BlockMask.

What a user of stock PyTorch would write: `flex_attention` compiled, with a BlockMask built from the
batch's BlockTable. It compiles once per token count (dynamic=False), so a model wants few padded
counts (RankingModelConfig.pad_tokens_to). Inside the model's compiled tower it runs outside the
tower's graph (a graph break): traced into that dynamic-shape graph, inductor could not lower the
BlockMask (H200, torch 2.11: "convert FlexibleLayout to FixedLayout first", as in pytorch#134560).
Rotary is applied as separate PyTorch ops first (by the dispatcher), as for fa2. On a CPU FlexAttention has no backward (torch 2.13), so the backend is CUDA only.

The BlockMask's sparse tile is FLEX_TILE = 128 tokens, not our 64: inductor's default sm90 backward
config at head_dim 64-128 uses 128-wide kernel tiles, which must divide the sparse tile, and without
max-autotune it has no other; the mask_mod keeps the attention exact at any tile (block ids compared).
"""

import math

import torch

from .backend import Backend
from .blocks import BLOCK_SIZE, BlockTable

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    HAS_FLEX_ATTENTION = True
    # Compiled (eager it materializes the T x T scores); a compiled model traces through it.
    compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
except ImportError:
    HAS_FLEX_ATTENTION = False

FLEX_TILE = 128
# Token counts compiled_flex_attention may compile for (one each, dynamic=False). Past dynamo's
# default of 8 it would run FlexAttention eagerly, which materializes the T x T scores: 108 GiB at
# 85k tokens (H200, the GPU parity tests' ninth count).
FLEX_RECOMPILE_LIMIT = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def flex_block_mask(table: BlockTable, tile: int = FLEX_TILE):
    """The FlexAttention BlockMask of `table`'s blocks, at sparse tile `tile` (64 or 128).

    Built from the block table, not by create_block_mask, which evaluates mask_mod at all T² token
    pairs; nothing here reads the device. A query tile sees exactly the tokens of the blocks its
    queries are in: one contiguous range of kv tiles, at most its neighbours (a block is at most 64
    tokens), so the pattern is symmetric and the q-side lists equal the kv-side ones (no dense
    transpose and argsort, which from_kv_blocks would do at [tiles, tiles]). At tile 64 a tile that is exactly
    one block is "full" and skips mask_mod; otherwise every listed tile is partial.
    """
    tokens, device = table.total_tokens, table.device
    block_of_token = table.block_of_token()
    block_start, block_len = table.block_start.long(), table.block_len.long()

    def mask_mod(b, h, q_idx, kv_idx):
        return block_of_token[q_idx] == block_of_token[kv_idx]

    tiles = -(-tokens // tile)
    first = torch.arange(tiles, device=device) * tile
    last = (first + tile - 1).clamp(max=tokens - 1)
    first_block, last_block = block_of_token[first], block_of_token[last]
    lo = block_start[first_block] // tile
    hi = (block_start[last_block] + block_len[last_block] - 1) // tile
    # [tiles, tiles] as FlexAttention expects (a row lists kv tiles; entries past its count are never read).
    kv_indices = torch.minimum(lo[:, None] + torch.arange(tiles, device=device), hi[:, None]).to(torch.int32)
    full = (block_start[first_block] == first) & (block_len[first_block] == tile) if tile == BLOCK_SIZE else None
    kv_num_blocks = torch.where(full, 0, hi - lo + 1) if full is not None else hi - lo + 1
    kv_num_blocks = kv_num_blocks.to(torch.int32)
    full_num_blocks = full.to(torch.int32)[None, None] if full is not None else None
    full_indices = kv_indices[None, None] if full is not None else None  # a full tile's first entry is itself
    return BlockMask(
        seq_lengths=(tokens, tokens),
        kv_num_blocks=kv_num_blocks[None, None], kv_indices=kv_indices[None, None],
        full_kv_num_blocks=full_num_blocks, full_kv_indices=full_indices,
        q_num_blocks=kv_num_blocks[None, None], q_indices=kv_indices[None, None],
        full_q_num_blocks=full_num_blocks, full_q_indices=full_indices,
        BLOCK_SIZE=(tile, tile), mask_mod=mask_mod,
    )


def kernel_options(tile: int) -> dict | None:
    """Kernel tiles that divide the sparse tile: inductor's defaults are 128 wide in places."""
    return {"BLOCK_M": tile, "BLOCK_N": tile} if tile < 128 else None


def flex_block_attention(q, k, v, block_mask) -> torch.Tensor:
    """Block attention of q, k, v [T, H, D] through compiled FlexAttention on [1, H, T, D] views, with
    a BlockMask from flex_block_mask (built once per batch by a caller that reuses it)."""

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).unsqueeze(0)

    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
        out = compiled_flex_attention(
            heads_first(q), heads_first(k), heads_first(v), block_mask=block_mask,
            scale=1 / math.sqrt(q.shape[-1]), kernel_options=kernel_options(block_mask.BLOCK_SIZE[0]),
        )
    return out[0].transpose(0, 1)


def flex_unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"it needs a CUDA GPU (FlexAttention has no backward on {device.type}) and the tensors are on {device.type}"
    if not HAS_FLEX_ATTENTION:
        return "this PyTorch has no torch.nn.attention.flex_attention"
    return None


def flex_unsupported_reason(q: torch.Tensor) -> str | None:
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (FlexAttention takes float16, bfloat16 or float32)"
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (this backend takes powers of two from 16)"
    return None


@torch.compiler.disable  # see the module docstring; the compiled flex_attention inside still compiles
def _run(q, k, v, table: BlockTable, cos, sin, rotate_v, launch):
    # Rotary was applied by the dispatcher (fuses_rotary=False).
    return flex_block_attention(q, k, v, flex_block_mask(table))


HOW_TO_GET = "run on an NVIDIA GPU with a CUDA build of PyTorch 2.5 or later"
BACKEND = Backend("flex", HOW_TO_GET, flex_unavailable_reason, flex_unsupported_reason, _run, fuses_rotary=False)
