"""The 64-token block structure of a jagged batch, shared by every backend.

A batch is `total_tokens` rows with int32 `offsets` [B+1] (cumulative sequence lengths). Each
sequence is cut into BLOCK_SIZE-token blocks from its own start, so a block never straddles two
sequences and only a sequence's last block can be partial. Blocks tile the tokens in order.
"""

import torch

BLOCK_SIZE = 64


def block_table(offsets: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (block_start, block_len), int32 [num_blocks], one row per block in token order.

    Empty sequences own no block. The number of blocks depends on the values of `offsets`, so this
    synchronizes with the device once; kernels call it inside their custom op, where that is allowed.
    """
    offsets = offsets.to(torch.int64)
    seq_lens = offsets[1:] - offsets[:-1]
    blocks_per_seq = (seq_lens + block_size - 1) // block_size
    seq_of_block = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=offsets.device), blocks_per_seq)
    first_block_of_seq = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    index_in_seq = torch.arange(seq_of_block.numel(), device=offsets.device) - first_block_of_seq[seq_of_block]
    block_start = offsets[seq_of_block] + index_in_seq * block_size
    block_len = torch.minimum(offsets[seq_of_block + 1] - block_start, torch.tensor(block_size, device=offsets.device))
    return block_start.to(torch.int32), block_len.to(torch.int32)


def block_cu_seqlens(offsets: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Offsets of the blocks themselves (int32 [num_blocks+1]): each block as its own sequence,
    which is how varlen kernels such as FlashAttention-2 express block-diagonal attention."""
    block_start, _ = block_table(offsets, block_size)
    total = offsets[-1:].to(torch.int32)
    return torch.cat([block_start, total])
