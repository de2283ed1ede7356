"""The 64-token block structure of a jagged batch, shared by every backend.

A batch is `total_tokens` rows with int32 `offsets` [B+1] (cumulative sequence lengths). Each
sequence is cut into BLOCK_SIZE-token blocks from its own start, so a block never straddles two
sequences and only a sequence's last block can be partial. Blocks tile the tokens in order.
"""

import torch

BLOCK_SIZE = 64


def offsets_from_lengths(lengths, device: torch.device | str | None = None) -> torch.Tensor:
    """int32 offsets [B+1] (0, then the running sum) from sequence lengths (a list or a tensor)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device).reshape(-1)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def max_num_blocks(total_tokens: int, batch_size: int, block_size: int = BLOCK_SIZE) -> int:
    """An upper bound on the block count known without reading `offsets`: each sequence adds at
    most one partial block to the total_tokens / block_size full ones."""
    return (total_tokens + batch_size * (block_size - 1)) // block_size


def block_table(
    offsets: torch.Tensor, total_tokens: int | None = None, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (block_start, block_len), int32 [max_num_blocks], one row per block in token order.

    The table has a fixed size computed from shapes alone, so building it never waits for the
    device: the real blocks come first and the unused rows after them have block_len 0 and
    block_start total_tokens. Kernels skip (or mask away) zero-length blocks. Empty sequences own
    no block. Pass `total_tokens` (q.shape[0]) to avoid reading offsets[-1] back to the host.
    """
    if total_tokens is None:
        total_tokens = int(offsets[-1])
    offsets = offsets.to(torch.int64)
    batch_size = offsets.numel() - 1
    seq_lens = offsets[1:] - offsets[:-1]
    blocks_per_seq = (seq_lens + block_size - 1) // block_size
    blocks_before_next_seq = torch.cumsum(blocks_per_seq, 0)
    row = torch.arange(max_num_blocks(total_tokens, batch_size, block_size), device=offsets.device)
    seq_of_row = torch.searchsorted(blocks_before_next_seq, row, right=True)
    used = seq_of_row < batch_size
    seq = seq_of_row.clamp(max=max(batch_size - 1, 0))
    index_in_seq = row - (blocks_before_next_seq[seq] - blocks_per_seq[seq])
    block_start = offsets[seq] + index_in_seq * block_size
    block_len = (offsets[seq + 1] - block_start).clamp(0, block_size)
    block_start = torch.where(used, block_start, total_tokens)
    block_len = torch.where(used, block_len, 0)
    return block_start.to(torch.int32), block_len.to(torch.int32)


def counted_block_table(
    offsets: torch.Tensor, total_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_start, block_len, num_blocks): the fixed-size table plus, as a device scalar, how
    many of its rows are real, so persistent kernels stop at the real blocks without a host read."""
    block_start, block_len = block_table(offsets, total_tokens)
    return block_start, block_len, torch.count_nonzero(block_len)


def block_cu_seqlens(offsets: torch.Tensor, total_tokens: int | None = None, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Offsets of the blocks themselves (int32 [max_num_blocks + 1]): each block as its own
    sequence, which is how varlen kernels such as FlashAttention-2 express block-diagonal
    attention. The unused rows of the block table become empty sequences at the end."""
    total = int(offsets[-1]) if total_tokens is None else total_tokens
    block_start, _ = block_table(offsets, total, block_size)
    return torch.cat([block_start, block_start.new_full((1,), total)])
