"""The 64-token block structure of a jagged batch, shared by every backend.

A batch is `total_tokens` rows with int32 `offsets` [B+1] (cumulative sequence lengths). Each
sequence is cut into BLOCK_SIZE-token blocks from its own start, so a block never straddles two
sequences and only a sequence's last block can be partial. Blocks tile the tokens in order.
"""

import collections
import contextlib
import functools
import importlib.util
import weakref
from dataclasses import dataclass

import torch

from .eager import eager_call

BLOCK_SIZE = 64


def offsets_from_lengths(lengths, device: torch.device | str | None = None) -> torch.Tensor:
    """int32 offsets [B+1] (0, then the running sum) from sequence lengths (a list or a tensor)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device).reshape(-1)
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)


def max_num_blocks(total_tokens: int, batch_size: int, block_size: int = BLOCK_SIZE) -> int:
    """An upper bound on the block count known without reading `offsets`: each sequence adds at
    most one partial block to the total_tokens / block_size full ones."""
    return (total_tokens + batch_size * (block_size - 1)) // block_size


def _blocks_through_seq(offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B], in offsets' dtype: how many blocks sequences 0..i own together, the running sum of
    ceil(length / block_size). Row r of the table belongs to the first sequence whose entry is > r."""
    blocks_per_seq = torch.div(offsets.diff() + (block_size - 1), block_size, rounding_mode="floor")
    # cumsum would widen int32 to int64 with an extra cast kernel; the sum is at most the table's
    # row count, so it fits whatever dtype indexes the table.
    return torch.cumsum(blocks_per_seq, 0, dtype=offsets.dtype)


def block_table_torch(
    offsets: torch.Tensor, total_tokens: int, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (block_start, block_len), int32 [max_num_blocks], one row per block in token order.

    The table has a fixed size computed from shapes alone, so building it never waits for the
    device: the real blocks come first and the unused rows after them have block_len 0 and
    block_start total_tokens. Kernels skip (or mask away) zero-length blocks. Empty sequences own
    no block. This is the portable build (any device, and the oracle of block_table_triton).
    """
    offsets = offsets.to(torch.int64)
    batch_size = offsets.numel() - 1
    blocks_through_seq = _blocks_through_seq(offsets, block_size)
    first_block_of_seq = torch.nn.functional.pad(blocks_through_seq[:-1], (1, 0))
    row = torch.arange(max_num_blocks(total_tokens, batch_size, block_size), device=offsets.device)
    seq_of_row = torch.searchsorted(blocks_through_seq, row, right=True)
    used = seq_of_row < batch_size
    seq = seq_of_row.clamp(max=max(batch_size - 1, 0))
    block_start = offsets[seq] + (row - first_block_of_seq[seq]) * block_size
    block_len = (offsets[seq + 1] - block_start).clamp(0, block_size)
    block_start = torch.where(used, block_start, total_tokens)
    block_len = torch.where(used, block_len, 0)
    return block_start.to(torch.int32), block_len.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# The CUDA build: one Triton kernel after the prefix sum, instead of ~25 small torch kernels.
# ----------------------------------------------------------------------------------------------

# Checked without importing Triton, so `import kernels` stays free of it; the import happens on the
# first Triton-built table, which is also when triton.jit reads TRITON_INTERPRET.
_HAS_TRITON = importlib.util.find_spec("triton") is not None
# triton.language, bound by block_table_kernel: the kernel looks `tl` up in this module's globals,
# where the interpreter also looks for the module it patches.
tl = None
# Rows one program fills. Each row's binary search is a chain of dependent loads, so a program
# holding several rows per thread keeps several chains in flight.
ROWS_PER_PROGRAM = 512


@functools.cache
def block_table_kernel():
    """The Triton kernel that fills the block table; defined on first use, so that importing this
    module imports no Triton (also what tests compile ahead of time)."""
    global tl
    import triton
    import triton.language as tl  # noqa: F811

    @triton.jit
    def _fill_block_table(
        offsets_ptr, blocks_through_seq_ptr, block_start_ptr, block_len_ptr, num_blocks_ptr,
        num_seqs, num_rows, total_tokens, search_steps,
        BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        # Each row's sequence is the first one whose blocks_through_seq exceeds the row (searchsorted,
        # right=True); the answer lies in [lo, hi], and hi - lo at least halves per step.
        lo = tl.zeros((ROWS,), dtype=tl.int32)
        hi = tl.zeros((ROWS,), dtype=tl.int32) + num_seqs
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            searching = lo < hi
            blocks_through_mid = tl.load(blocks_through_seq_ptr + mid, mask=searching, other=0)
            past_mid = searching & (blocks_through_mid <= rows)
            lo = tl.where(past_mid, mid + 1, lo)
            hi = tl.where(past_mid, hi, mid)
        seq = lo
        # Rows past the last block find no sequence (seq == num_seqs): they are the unused tail.
        used = seq < num_seqs
        first_block = tl.load(blocks_through_seq_ptr + seq - 1, mask=used & (seq > 0), other=0)
        seq_start = tl.load(offsets_ptr + seq, mask=used, other=0)
        seq_end = tl.load(offsets_ptr + seq + 1, mask=used, other=0)
        block_start = seq_start + (rows - first_block) * BLOCK
        # At least 1 for a used row: the search put the row among its sequence's blocks.
        block_len = tl.minimum(seq_end - block_start, BLOCK)
        in_table = rows < num_rows
        tl.store(block_start_ptr + rows, tl.where(used, block_start, total_tokens).to(tl.int32), mask=in_table)
        tl.store(block_len_ptr + rows, tl.where(used, block_len, 0).to(tl.int32), mask=in_table)
        if tl.program_id(0) == 0:
            total_blocks = tl.load(blocks_through_seq_ptr + num_seqs - 1, mask=num_seqs > 0, other=0)
            tl.store(num_blocks_ptr, total_blocks.to(tl.int64))

    return _fill_block_table


def _check_offsets(offsets: torch.Tensor) -> None:
    if offsets.dim() != 1 or offsets.shape[0] < 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"offsets must be a 1-D int32/int64 tensor of B+1 >= 1 cumulative lengths, "
            f"got {offsets.dtype} of shape {list(offsets.shape)}"
        )


def _fill_block_table(offsets: torch.Tensor, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_table_triton's implementation, which eager calls run without the op's dispatch."""
    import triton

    _check_offsets(offsets)
    kernel = block_table_kernel()
    on_cuda = offsets.device.type == "cuda"
    if not on_cuda and not triton.knobs.runtime.interpret:
        raise ValueError(
            f"block_table_triton needs CUDA tensors (or TRITON_INTERPRET=1 set before its first "
            f"use, for CPU tensors); offsets is on {offsets.device}"
        )
    offsets = offsets.contiguous()
    num_seqs = offsets.shape[0] - 1
    num_rows = max_num_blocks(total_tokens, num_seqs)
    block_start = torch.empty(num_rows, dtype=torch.int32, device=offsets.device)
    block_len = torch.empty(num_rows, dtype=torch.int32, device=offsets.device)
    num_blocks = torch.empty((), dtype=torch.int64, device=offsets.device)
    blocks_through_seq = _blocks_through_seq(offsets, BLOCK_SIZE)
    # At least one program, even for an empty table: program 0 writes num_blocks.
    grid = (max(1, -(-num_rows // ROWS_PER_PROGRAM)),)
    # Triton launches on the current device, which need not be offsets' one.
    with torch.cuda.device(offsets.device) if on_cuda else contextlib.nullcontext():
        kernel[grid](
            offsets, blocks_through_seq, block_start, block_len, num_blocks,
            num_seqs, num_rows, total_tokens, num_seqs.bit_length(),
            BLOCK=BLOCK_SIZE, ROWS=ROWS_PER_PROGRAM,
        )
    return block_start, block_len, num_blocks


@torch.library.custom_op("block_attention::block_table", mutates_args=())
def block_table_triton(offsets: torch.Tensor, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_start, block_len, num_blocks) exactly as block_table builds them, from a
    prefix sum and one Triton kernel. num_blocks is an int64 0-dim device tensor. Runs on CUDA
    tensors, or on CPU tensors when Triton's interpreter (TRITON_INTERPRET=1) is on."""
    return _fill_block_table(offsets, total_tokens)


@block_table_triton.register_fake
def _(offsets, total_tokens):
    _check_offsets(offsets)
    num_rows = max_num_blocks(total_tokens, offsets.shape[0] - 1)
    return (
        offsets.new_empty(num_rows, dtype=torch.int32),
        offsets.new_empty(num_rows, dtype=torch.int32),
        offsets.new_empty((), dtype=torch.int64),
    )


@dataclass(frozen=True)
class BlockTable:
    """The 64-token blocks of one jagged batch: built once per batch by `block_table` and passed to
    every `block_attention` call on that batch (each layer, forward and backward), so no call
    rebuilds it. Tensors live on the batch's device; nothing in it needs a host read.

    block_start, block_len: int32 [max_num_blocks(total_tokens, B)], real blocks first, then unused
    rows (length 0). num_blocks: int64 0-dim, how many rows are real, for kernels to stop at.
    """

    offsets: torch.Tensor  # int32 [B+1]
    total_tokens: int
    block_start: torch.Tensor
    block_len: torch.Tensor
    num_blocks: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_start, block_len, num_blocks): what kernel ops take."""
        return self.block_start, self.block_len, self.num_blocks

    def block_of_token(self) -> torch.Tensor:
        """int64 [total_tokens]: the table row holding each token. Blocks tile the tokens in order
        (unused rows start at total_tokens), so token t lives in the last row starting at or before it."""
        tokens = torch.arange(self.total_tokens, device=self.device, dtype=self.block_start.dtype)
        return torch.searchsorted(self.block_start, tokens, right=True) - 1


# The tables of the last few offsets tensors block_table was given, for callers that pass the same
# offsets (not a BlockTable) to every layer. A table is reused only for the same tensor object at
# the same version counter (which every in-place torch op on it bumps) and total_tokens, outside
# CUDA-graph capture (a captured call must launch its build, so a replay rebuilds from new offsets)
# and tracing (kernels/eager.py). Writes that bypass the version counter (through .data, DLPack or a custom kernel)
# are not seen: callers doing those pass a BlockTable.
_RECENT_TABLES_KEPT = 8
_recent_tables: collections.OrderedDict[int, tuple[weakref.ref, int, int, BlockTable]] = collections.OrderedDict()


def _reusable(offsets: torch.Tensor) -> bool:
    if not eager_call(offsets) or offsets.is_inference():  # inference tensors have no version counter
        return False
    return offsets.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def block_table(offsets: torch.Tensor, total_tokens: int | None = None) -> BlockTable:
    """The BlockTable of `offsets` (int32 [B+1]). Pass `total_tokens` (q.shape[0]) so nothing reads
    offsets[-1] back to the host. On CUDA it is one prefix sum and one Triton kernel; elsewhere torch ops.
    The offsets are trusted here: kernels.block_attention checks them (validate_offsets).
    Calls on the same, unmodified offsets tensor return the same table (_recent_tables)."""
    if total_tokens is None:
        total_tokens = int(offsets[-1])
    reusable = _reusable(offsets)
    if reusable:
        recent = _recent_tables.get(id(offsets))
        if recent is not None and recent[0]() is offsets and recent[1:3] == (offsets._version, total_tokens):
            _recent_tables.move_to_end(id(offsets))
            return recent[3]
    table = _build_block_table(offsets, total_tokens)
    if reusable:
        _recent_tables[id(offsets)] = (weakref.ref(offsets), offsets._version, total_tokens, table)
        _recent_tables.move_to_end(id(offsets))
        while len(_recent_tables) > _RECENT_TABLES_KEPT:
            _recent_tables.popitem(last=False)
    return table


def _build_block_table(offsets: torch.Tensor, total_tokens: int) -> BlockTable:
    offsets = offsets.to(torch.int32)
    if offsets.device.type == "cuda" and _HAS_TRITON:
        fill = _fill_block_table if eager_call(offsets) else block_table_triton
        block_start, block_len, num_blocks = fill(offsets, total_tokens)
    else:
        block_start, block_len = block_table_torch(offsets, total_tokens)
        num_blocks = torch.count_nonzero(block_len)
    return BlockTable(offsets, total_tokens, block_start, block_len, num_blocks)


def block_cu_seqlens(block_start: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Offsets of the blocks themselves (int32 [max_num_blocks + 1]): each block as its own
    sequence, which is how varlen kernels such as FlashAttention-2 express block-diagonal
    attention. `block_start` is a BlockTable's; its unused rows become empty sequences at the end."""
    return torch.cat([block_start, block_start.new_full((1,), total_tokens)])
