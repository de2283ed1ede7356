"""The tlx backend's "blocks" plan of the attention sublayer: warp-specialized Hopper (sm_90) kernels,
a 64-token block's whole sublayer per consumer warpgroup; see attention_sublayer_kernels.py.

    y = x + Wo · blockattn(rotary(split(Wqkv · LN(x) + bqkv))) + bo

The Triton "blocks" kernel (attention_sublayer_blocks.py) does the same work with each program going
through its block's stages in series while the weights come from L2 on its critical path. Here a
producer warpgroup streams the weights by TMA through a ring of shared-memory slots ahead of the
consumers, and with two consumers one's softmax and stores run while the other's wgmmas do.

Work per block, in the order of the ring (each weight box is [HEAD_DIM, D], one slot):
- LayerNorm of the block's rows into the consumer's LN(x) tile (the A operand of every projection);
- per head: q, k and v, each LN(x) · (its [HEAD_DIM, D] rows of Wqkv)ᵀ + bias, rounded to the
  compute dtype as the projection's output is, stored to qkv [T, 3D] for the backward; rotated in
  fp32 and rounded once (as block attention does); the 64x64 scores, an exact softmax (one key tile:
  no running max), P · V, divided by the row sums, rounded, stored to attn [T, D] for the backward
  and kept in the consumer's tile of that head;
- the output projection, Σ_head attn_head · (Wo's head columns)ᵀ, from the head tiles and the
  row boxes of Woᵀ (transposed on the host, [D, D]: its head rows are the wgmma B operand as they
  are), into a [64, D] fp32 accumulator live only in this last phase, so the head loop keeps few
  registers; rounded before the residual, as nn.Linear's output is.

Invariants: blocks from kernels.blocks.block_table (contiguous rows of one sequence; only the table's
first num_blocks rows are real); rows >= a block's length load as zeros, are never stored and add
nothing (their keys are masked out of the softmax). Stores are masked tl.stores, never TMA: a partial
block's box would run into the next block's rows. x has contiguous rows of D elements (the launcher
copies otherwise); D is 64, 128 or 256, HEAD_DIM 64 or 128, with what fits in shared memory
(SUPPORTED_SHAPES); weights contiguous in the compute dtype (bf16/fp16); LayerNorm, softmax and
rotary in fp32. Saves what the "gemms" plan's forward saves (y, qkv, attn, mean, rstd), so either
plan's backward runs after it.

The backward kernel has the same ring, with per head a box of Woᵀ's rows and then the head's three
boxes of Wqkv: dAttn = dY · Wo[:, head] (Woᵀ's box transposed in place), rounded as the unfused GEMM's
output; q, k, v read back from qkv and rotated again; P recomputed exactly (one key tile), dP, dS,
then dV = Pᵀ dAttn, dK = dSᵀ q, dQ = dS k, rotated back and stored as dQKV [T, 3D]; and dQKV's
product with Wqkv, LayerNorm's output gradient, accumulated in fp32 over the heads. That accumulator
is live through the heads, which spills at d_model 256 (`ptxas -v` on the AOT build: 968 bytes of
spill stores a thread with rotary; 1,212 before q, k, v were brought in one at a time); the
alternative, reading every head's dQ, dK, dV back after the heads, needs 96 KiB more shared memory
or a barrier between the consumer's own global stores and loads. LayerNorm's backward, dWqkv, dWo and the
bias sums stay the "gemms" plan's kernels (attention_sublayer_kernels.py), which take dQKV and that
fp32 gradient from here.
"""

import functools
import math

import torch

from .attention_sublayer_blocks import _softmax_scale, without_plan
from .backend import launch_overrides
from .block_attention_tlx import _num_sms, fits_sm90
from .blocks import BLOCK_SIZE
from .sublayer_tlx import HAS_TLX, choose_ring

if HAS_TLX:
    import triton
    import triton.language as tl
    import triton.language.extra.tlx as tlx
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .attention_sublayer_blocks import _rotated_back, _store_head_gradients
    from .block_attention_triton import _load_rotary, _rotate_item, rotate_pairs
    from .sublayer_tlx import _layer_norm_to_smem, _residual_store, _store_accumulator

SUPPORTED_COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
MAX_STAGES = 6
KNOBS = ("NUM_STAGES", "NUM_CONSUMERS")
# Per consumer, what the compiler adds beyond our buffers (layout conversions of the masked stores and
# reductions; the backward's transposes and accumulator stores take more), at most what fbtriton 3.7's
# sm_90 builds allocate (tests/test_tlx_aot.py holds this model to them).
_SCRATCH_PER_CONSUMER = 8192
_BWD_SCRATCH_PER_CONSUMER = 16516


def smem_bytes(d_model: int, head_dim: int, NUM_STAGES: int, NUM_CONSUMERS: int, backward: bool = False,
               elem_size: int = 2) -> int:
    """Shared memory of one program: the ring (one [head_dim, d_model] weight box per slot) and per
    consumer its tiles and compiler scratch. Forward: the LN(x) tile (later the output projection's
    staging tile), the head's q, k and v, one attention-output tile per head. Backward: the dY tile,
    the head's q, k, v (later dQ, dK, dV) and dAttn tiles, and Pᵀ and dSᵀ."""
    box = head_dim * d_model
    if backward:
        per_consumer = BLOCK_SIZE * d_model + 4 * BLOCK_SIZE * head_dim + 2 * BLOCK_SIZE * BLOCK_SIZE
    else:
        per_consumer = BLOCK_SIZE * d_model + 3 * BLOCK_SIZE * head_dim + BLOCK_SIZE * d_model
    scratch = _BWD_SCRATCH_PER_CONSUMER if backward else _SCRATCH_PER_CONSUMER
    return (NUM_STAGES * box + NUM_CONSUMERS * per_consumer) * elem_size + NUM_CONSUMERS * scratch


def _fits(d_model: int, head_dim: int, stages: int, consumers: int, backward: bool) -> bool:
    return fits_sm90(smem_bytes(d_model, head_dim, stages, consumers, backward))


# (d_model, head_dim) pairs whose one-consumer programs with two-slot rings fit in shared memory, both ways.
SUPPORTED_SHAPES = tuple((d, h) for d in (64, 128, 256) for h in (64, 128)
                         if h <= d and _fits(d, h, 2, 1, False) and _fits(d, h, 2, 1, True))


def tlx_attention_sublayer_config(d_model: int, head_dim: int, knob_items: tuple = (), backward: bool = False) -> dict:
    """Constexpr knobs of one direction, as sublayer_tlx.choose_ring picks them; `knob_items` (KNOBS)
    override them."""
    return dict(_cached_config(d_model, head_dim, knob_items, backward))  # a copy: callers may change it


@functools.lru_cache(maxsize=None)
def _cached_config(d_model: int, head_dim: int, knob_items: tuple, backward: bool) -> dict:
    direction = "bwd" if backward else "fwd"
    knobs = dict(knob_items)
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise ValueError(f"unknown attention_sublayer tlx 'blocks' {direction} launch settings {sorted(unknown)}; "
                         f"choose from {list(KNOBS)}")

    return choose_ring(knobs, lambda stages, consumers: smem_bytes(d_model, head_dim, stages, consumers, backward),
                       MAX_STAGES, f"the tlx attention_sublayer 'blocks' {direction} at d_model {d_model}, "
                       f"head_dim {head_dim}")


if HAS_TLX:

    @triton.jit
    def _block_rounds(num_blocks_ptr, NUM_CONSUMERS: tl.constexpr):
        """(program, programs, rounds, blocks): a round takes NUM_CONSUMERS blocks. Every partition
        computes the same count from the same device scalar, so producer and consumers agree on the
        boxes and the barrier phases stay paired."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        num_blocks = tl.load(num_blocks_ptr).to(tl.int32)
        num_groups = tl.cdiv(num_blocks, NUM_CONSUMERS)
        return pid, nprog, tl.maximum(tl.cdiv(num_groups - pid, nprog), 0), num_blocks

    @triton.jit
    def _round_block(r, pid, nprog, cid, num_blocks, block_start_ptr, block_len_ptr, NUM_CONSUMERS: tl.constexpr):
        """A consumer's block of round r: its first token, length, row mask and int64 rows. A block past
        the last (the second consumer's, when the blocks are odd) has no rows: every load masked and
        nothing stored, while its consumer still walks its boxes so the phases stay paired."""
        blk = (pid + r * nprog) * NUM_CONSUMERS + cid
        real = blk < num_blocks
        start = tl.load(block_start_ptr + blk, mask=real, other=0)
        length = tl.load(block_len_ptr + blk, mask=real, other=0)
        idx = tl.arange(0, 64)
        return start, length, idx < length, (start + idx).to(tl.int64)

    @triton.jit
    def _alloc_weight_ring(dtype: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_STAGES: tl.constexpr,
                           NUM_CONSUMERS: tl.constexpr):
        """The ring of weight boxes both kernels stream, and each slot's full and empty barrier: every
        consumer reads every box, so a slot is free once all of them have arrived."""
        return (tlx.local_alloc((HEAD_DIM, D), dtype, NUM_STAGES),
                tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1),
                tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=NUM_CONSUMERS))

    @triton.jit
    def _load_weight_boxes(desc_w_qkv, desc_w_out_t, w_bufs, fulls, empties, num_blocks_ptr, D: tl.constexpr,
                           HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_STAGES: tl.constexpr,
                           NUM_CONSUMERS: tl.constexpr, BACKWARD: tl.constexpr):
        """The producer partition: every round's 4 * HEADS weight boxes, in the order the consumers take
        them. Forward: each head's q, k, v rows of Wqkv, then Woᵀ's head rows of every head. Backward:
        per head, Woᵀ's head rows, then its q, k, v rows of Wqkv."""
        BOXES: tl.constexpr = 4 * HEADS
        BOX_BYTES: tl.constexpr = HEAD_DIM * D * tlx.size_of(tlx.dtype_of(desc_w_qkv))
        pid, nprog, n_rounds, num_blocks = _block_rounds(num_blocks_ptr, NUM_CONSUMERS)
        for k in range(0, n_rounds * BOXES):
            box = k % BOXES
            if BACKWARD:
                head = box // 4
                part = box - 4 * head - 1  # -1: Woᵀ; 0, 1, 2: q, k, v
            else:
                head = tl.where(box < 3 * HEADS, box // 3, box - 3 * HEADS)
                part = tl.where(box < 3 * HEADS, box - 3 * (box // 3), -1)
            slot = k % NUM_STAGES
            # Fresh barriers sit in phase 0, so waiting for parity 1 passes on the first lap.
            tlx.barrier_wait(empties[slot], ((k // NUM_STAGES) & 1) ^ 1)
            tlx.barrier_expect_bytes(fulls[slot], BOX_BYTES)
            if part < 0:
                tlx.async_descriptor_load(desc_w_out_t, w_bufs[slot], [head * HEAD_DIM, 0], fulls[slot])
            else:
                tlx.async_descriptor_load(desc_w_qkv, w_bufs[slot], [part * D + head * HEAD_DIM, 0], fulls[slot])

    @triton.jit
    def _saved_tile_to_smem(buf, ptrs, cos_ptr, sin_ptr, start, row_ok, ROTATE: tl.constexpr, HEAD_DIM: tl.constexpr):
        """A saved [64, HEAD_DIM] q, k or v tile (rows >= length as zeros) into buf, with ROTATE rotated in
        fp32 and rounded once, as the forward rotated it."""
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        if ROTATE:
            cos, sin = _load_rotary(cos_ptr, sin_ptr, start, row_ok, 64, HEAD_DIM)
            tile = rotate_pairs(tile.to(tl.float32), cos, sin, 64, HEAD_DIM, False).to(tile.dtype)
        tlx.local_store(buf, tile)

    @triton.jit
    def _next_box(w_bufs, fulls, k, NUM_STAGES: tl.constexpr):
        """A consumer's box k: its ring slot, once the producer has filled it."""
        slot = k % NUM_STAGES
        tlx.barrier_wait(fulls[slot], (k // NUM_STAGES) & 1)
        return w_bufs[slot], slot

    @triton.jit
    def _head_projection(normed_buf, w_bufs, fulls, empties, k, b_qkv_ptr, first_row, dtype: tl.constexpr,
                         HEAD_DIM: tl.constexpr, NUM_STAGES: tl.constexpr):
        """LN(x) · W[first_row : first_row + HEAD_DIM]ᵀ + b[...] from ring box k, rounded to the compute
        dtype as the projection's output is; the slot goes back to the producer once read."""
        w_buf, slot = _next_box(w_bufs, fulls, k, NUM_STAGES)
        acc = tlx.async_dot(normed_buf, tlx.local_trans(w_buf))
        acc = tlx.async_dot_wait(0, acc)
        tlx.barrier_arrive(empties[slot], 1)
        bias = tl.load(b_qkv_ptr + first_row + tl.arange(0, HEAD_DIM)).to(tl.float32)
        return (acc + bias[None, :]).to(dtype)

    @triton.jit
    def _store_rows(ptr, tile, rows64, row_ok, row_width, first_col, HEAD_DIM: tl.constexpr):
        offs = rows64[:, None] * row_width + (first_col + tl.arange(0, HEAD_DIM))[None, :]
        tl.store(ptr + offs, tile, mask=row_ok[:, None])

    @triton.jit
    def _tlx_attention_sublayer_fwd(
        desc_w_qkv, desc_w_out_t, x_ptr, norm_weight_ptr, norm_bias_ptr, b_qkv_ptr, b_out_ptr, cos_ptr, sin_ptr,
        block_start_ptr, block_len_ptr, num_blocks_ptr, y_ptr, qkv_ptr, attn_ptr, mean_ptr, rstd_ptr,
        eps, qk_scale,
        D: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
        NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
    ):
        BLOCK: tl.constexpr = 64
        CHUNK: tl.constexpr = 64
        dtype: tl.constexpr = tlx.dtype_of(desc_w_qkv)
        BOXES: tl.constexpr = 4 * HEADS  # per block: q, k, v rows of each head, then Woᵀ's head rows

        w_bufs, fulls, empties = _alloc_weight_ring(dtype, D, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS)
        normed_bufs = tlx.local_alloc((BLOCK, D), dtype, NUM_CONSUMERS)
        qkv_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, 3 * NUM_CONSUMERS)
        attn_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, HEADS * NUM_CONSUMERS)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                _load_weight_boxes(desc_w_qkv, desc_w_out_t, w_bufs, fulls, empties, num_blocks_ptr, D, HEADS,
                                   HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, False)

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                idx = tl.arange(0, BLOCK)
                normed_buf = normed_bufs[cid]
                q_buf = qkv_bufs[3 * cid]
                k_buf = qkv_bufs[3 * cid + 1]
                v_buf = qkv_bufs[3 * cid + 2]
                pid, nprog, n_rounds, num_blocks = _block_rounds(num_blocks_ptr, NUM_CONSUMERS)
                for r in range(0, n_rounds):
                    start, length, row_ok, rows64 = _round_block(r, pid, nprog, cid, num_blocks, block_start_ptr,
                                                                 block_len_ptr, NUM_CONSUMERS)
                    # The previous block's wgmmas were all waited: the LN(x) tile is free.
                    mean, rstd = _layer_norm_to_smem(x_ptr, norm_weight_ptr, norm_bias_ptr, rows64, row_ok,
                                                     normed_buf, eps, dtype, D, CHUNK)
                    tl.store(mean_ptr + rows64, mean, mask=row_ok)
                    tl.store(rstd_ptr + rows64, rstd, mask=row_ok)

                    k0 = r * BOXES
                    for head in tl.static_range(HEADS):
                        col = head * HEAD_DIM
                        q = _head_projection(normed_buf, w_bufs, fulls, empties, k0 + 3 * head, b_qkv_ptr, col,
                                             dtype, HEAD_DIM, NUM_STAGES)
                        _store_rows(qkv_ptr, q, rows64, row_ok, 3 * D, col, HEAD_DIM)
                        k = _head_projection(normed_buf, w_bufs, fulls, empties, k0 + 3 * head + 1, b_qkv_ptr,
                                             D + col, dtype, HEAD_DIM, NUM_STAGES)
                        _store_rows(qkv_ptr, k, rows64, row_ok, 3 * D, D + col, HEAD_DIM)
                        v = _head_projection(normed_buf, w_bufs, fulls, empties, k0 + 3 * head + 2, b_qkv_ptr,
                                             2 * D + col, dtype, HEAD_DIM, NUM_STAGES)
                        _store_rows(qkv_ptr, v, rows64, row_ok, 3 * D, 2 * D + col, HEAD_DIM)
                        if ROTARY:
                            q, k, v, cos, sin = _rotate_item(q, k, v, cos_ptr, sin_ptr, start, row_ok, BLOCK,
                                                             HEAD_DIM, ROTATE_V)
                        # The previous head's wgmmas have finished reading these tiles (each was waited).
                        tlx.local_store(q_buf, q)
                        tlx.local_store(k_buf, k)
                        tlx.local_store(v_buf, v)
                        tlx.fence_async_shared()
                        scores = tlx.async_dot(q_buf, tlx.local_trans(k_buf))
                        scores = tlx.async_dot_wait(0, scores)
                        scores = tl.where((idx < length)[None, :], scores * qk_scale, float("-inf"))
                        # One key tile: an exact softmax, no running max. A real block has length >= 1,
                        # so every row's max is finite.
                        m = tl.max(scores, 1)
                        p = tl.math.exp2(scores - m[:, None])
                        row_sum = tl.sum(p, 1)
                        out = tlx.async_dot(p.to(dtype), v_buf)
                        out = tlx.async_dot_wait(0, out)
                        out = (out * (1.0 / row_sum)[:, None]).to(dtype)  # 64 reciprocals, as block attention
                        _store_rows(attn_ptr, out, rows64, row_ok, D, col, HEAD_DIM)
                        tlx.local_store(attn_bufs[cid * HEADS + head], out)
                    tlx.fence_async_shared()

                    # The accumulator starts at the output bias: no [D] bias vector live beside the
                    # finished [64, D] accumulator.
                    b_out = tl.load(b_out_ptr + tl.arange(0, D)).to(tl.float32)
                    acc = tl.zeros((BLOCK, D), dtype=tl.float32) + b_out[None, :]
                    for head in tl.static_range(HEADS):
                        w_buf, slot = _next_box(w_bufs, fulls, k0 + 3 * HEADS + head, NUM_STAGES)
                        acc = tlx.async_dot(attn_bufs[cid * HEADS + head], w_buf, acc)
                        acc = tlx.async_dot_wait(0, acc)
                        tlx.barrier_arrive(empties[slot], 1)
                    # The output projection, rounded before the residual as nn.Linear's output is, staged
                    # through the LN(x) tile (no wgmma reads it any more).
                    _residual_store(acc.to(dtype), normed_buf, x_ptr, y_ptr, rows64, row_ok, D, CHUNK)

    @triton.jit
    def _tlx_attention_sublayer_bwd(
        desc_w_qkv, desc_w_out_t, grad_out_ptr, qkv_ptr, cos_ptr, sin_ptr,
        block_start_ptr, block_len_ptr, num_blocks_ptr, grad_qkv_ptr, grad_normed_ptr,
        sm_scale, qk_scale,
        D: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
        NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
    ):
        """Every block's dQKV [T, 3D] (rotary's inverse applied) and dLN = dQKV · Wqkv [T, D] in fp32, from
        dY in the compute dtype (grad_out [T, D]) and the saved q, k, v: per head, dAttn = dY · Wo[:, head]
        (rounded as the unfused GEMM's output), the attention's backward, and dQ, dK, dV's products with
        the head's rows of Wqkv added into dLN's accumulator. Rows >= a block's length have zero dY, so
        they add nothing to dV, dK or dLN."""
        BLOCK: tl.constexpr = 64
        dtype: tl.constexpr = tlx.dtype_of(desc_w_qkv)
        BOXES: tl.constexpr = 4 * HEADS  # per head: Woᵀ's head rows, then the head's q, k, v rows of Wqkv

        w_bufs, fulls, empties = _alloc_weight_ring(dtype, D, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS)
        grad_out_bufs = tlx.local_alloc((BLOCK, D), dtype, NUM_CONSUMERS)
        # Per consumer: q, k, v (dQ, dK, dV once the attention's products have read them) and dAttn.
        head_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, 4 * NUM_CONSUMERS)
        # wgmma's A operand is read row-major from SMEM, so Pᵀ and dSᵀ are written transposed.
        t_bufs = tlx.local_alloc((BLOCK, BLOCK), dtype, 2 * NUM_CONSUMERS)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                _load_weight_boxes(desc_w_qkv, desc_w_out_t, w_bufs, fulls, empties, num_blocks_ptr, D, HEADS,
                                   HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, True)

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                idx = tl.arange(0, BLOCK)
                slice_cols = tl.arange(0, 64)
                grad_out_buf = grad_out_bufs[cid]
                q_buf = head_bufs[4 * cid]
                k_buf = head_bufs[4 * cid + 1]
                v_buf = head_bufs[4 * cid + 2]
                grad_attn_buf = head_bufs[4 * cid + 3]
                p_t_buf = t_bufs[2 * cid]
                ds_t_buf = t_bufs[2 * cid + 1]
                pid, nprog, n_rounds, num_blocks = _block_rounds(num_blocks_ptr, NUM_CONSUMERS)
                for r in range(0, n_rounds):
                    start, length, row_ok, rows64 = _round_block(r, pid, nprog, cid, num_blocks, block_start_ptr,
                                                                 block_len_ptr, NUM_CONSUMERS)
                    # dY into the consumer's A tile, in 64-column slices (rows >= length as zeros). The previous
                    # block's wgmmas were all waited: every tile is free.
                    for c in tl.static_range(D // 64):
                        offs = rows64[:, None] * D + (c * 64 + slice_cols)[None, :]
                        grad_out = tl.load(grad_out_ptr + offs, mask=row_ok[:, None], other=0.0)
                        tlx.local_store(tlx.local_slice(grad_out_buf, [0, c * 64], [BLOCK, 64]), grad_out)
                    tlx.fence_async_shared()

                    acc = tl.zeros((BLOCK, D), dtype=tl.float32)
                    k0 = r * BOXES
                    for head in tl.static_range(HEADS):
                        col = head * HEAD_DIM
                        w_buf, slot = _next_box(w_bufs, fulls, k0 + 4 * head, NUM_STAGES)
                        grad_attn = tlx.async_dot(grad_out_buf, tlx.local_trans(w_buf))
                        grad_attn = tlx.async_dot_wait(0, grad_attn)
                        tlx.barrier_arrive(empties[slot], 1)
                        tlx.local_store(grad_attn_buf, grad_attn.to(dtype))
                        # q, k, v read back one at a time, each rotated again straight into its tile, so
                        # few [64, HEAD_DIM] tiles are live beside dLN's accumulator.
                        offs = rows64[:, None] * (3 * D) + (col + tl.arange(0, HEAD_DIM))[None, :]
                        _saved_tile_to_smem(q_buf, qkv_ptr + offs, cos_ptr, sin_ptr, start, row_ok, ROTARY, HEAD_DIM)
                        _saved_tile_to_smem(k_buf, qkv_ptr + offs + D, cos_ptr, sin_ptr, start, row_ok, ROTARY,
                                            HEAD_DIM)
                        _saved_tile_to_smem(v_buf, qkv_ptr + offs + 2 * D, cos_ptr, sin_ptr, start, row_ok,
                                            ROTARY and ROTATE_V, HEAD_DIM)
                        tlx.fence_async_shared()

                        scores = tlx.async_dot(q_buf, tlx.local_trans(k_buf))
                        scores = tlx.async_dot_wait(0, scores)
                        scores = tl.where((idx < length)[None, :], scores * qk_scale, float("-inf"))
                        p = tl.math.exp2(scores - tl.max(scores, 1)[:, None])
                        p = p / tl.sum(p, 1)[:, None]
                        dp = tlx.async_dot(grad_attn_buf, tlx.local_trans(v_buf))
                        dp = tlx.async_dot_wait(0, dp)
                        ds = (p * (dp - tl.sum(p * dp, 1)[:, None]) * sm_scale).to(dtype)
                        tlx.local_store(p_t_buf, tl.trans(p.to(dtype)))
                        tlx.local_store(ds_t_buf, tl.trans(ds))
                        tlx.fence_async_shared()
                        dv = tlx.async_dot(p_t_buf, grad_attn_buf)
                        dv = tlx.async_dot_wait(0, dv)
                        dk = tlx.async_dot(ds_t_buf, q_buf)
                        dk = tlx.async_dot_wait(0, dk)
                        dq = tlx.async_dot(ds, k_buf)
                        dq = tlx.async_dot_wait(0, dq)
                        if ROTARY:
                            # cos/sin again (from L2) rather than held through the attention's products.
                            cos, sin = _load_rotary(cos_ptr, sin_ptr, start, row_ok, BLOCK, HEAD_DIM)
                            dq, dk, dv = _rotated_back(dq, dk, dv, cos, sin, BLOCK, HEAD_DIM, ROTATE_V)
                        dq, dk, dv = _store_head_gradients(grad_qkv_ptr, offs, dq, dk, dv, row_ok, D, dtype)
                        # dLN += dQ · Wq[head rows] + dK · Wk[...] + dV · Wv[...], from the q, k, v tiles
                        # (every wgmma reading them was waited), in fp32 over all heads: one rounding less
                        # than the unfused path's, as the Triton kernels do.
                        tlx.local_store(q_buf, dq)
                        tlx.local_store(k_buf, dk)
                        tlx.local_store(v_buf, dv)
                        tlx.fence_async_shared()
                        for part in tl.static_range(3):
                            w_buf, slot = _next_box(w_bufs, fulls, k0 + 4 * head + 1 + part, NUM_STAGES)
                            acc = tlx.async_dot(head_bufs[4 * cid + part], w_buf, acc)
                            acc = tlx.async_dot_wait(0, acc)
                            tlx.barrier_arrive(empties[slot], 1)
                    _store_accumulator(grad_normed_ptr, acc, rows64, row_ok, D)


def tlx_blocks_unsupported_reason(d_model: int, head_dim: int, compute_dtype: torch.dtype) -> str | None:
    if (d_model, head_dim) not in SUPPORTED_SHAPES:
        return (f"d_model {d_model} in heads of {head_dim} (the tlx 'blocks' kernels take (d_model, head_dim) in "
                f"{SUPPORTED_SHAPES}: larger weight boxes and tiles do not fit in shared memory)")
    if compute_dtype not in SUPPORTED_COMPUTE_DTYPES:
        return f"compute dtype {compute_dtype} (the tlx 'blocks' kernels' matmuls take float16 or bfloat16)"
    return None


def _checked_config(d_model: int, num_heads: int, compute_dtype: torch.dtype, launch: str, direction: str) -> dict:
    reason = tlx_blocks_unsupported_reason(d_model, d_model // num_heads, compute_dtype)
    if reason is not None:
        raise ValueError(f"attention_sublayer backend 'tlx' with plan 'blocks' cannot take {reason}; use the "
                         f"default 'gemms' plan")
    overrides = without_plan(launch_overrides(launch, direction))
    return tlx_attention_sublayer_config(d_model, d_model // num_heads, tuple(sorted(overrides.items())),
                                         backward=direction == "bwd")


def _launch(kernel, w_qkv, w_out, block_start, args: tuple, num_heads: int, cos, rotate_v, cfg: dict) -> None:
    """Runs `kernel` on the weights' TMA descriptors, then `args`. Woᵀ's rows h * head_dim ... are head h's
    columns of Wo: boxes of one shape with Wqkv's, each a wgmma B operand as it lies (or transposed)."""
    d_model = w_qkv.shape[1]
    head_dim = d_model // num_heads
    w_out_t = w_out.t().contiguous()
    box = [head_dim, d_model]
    grid = max(1, min(_num_sms(w_qkv.device), triton.cdiv(block_start.numel(), cfg["NUM_CONSUMERS"])))
    with torch.cuda.device(w_qkv.device):
        kernel[(grid,)](
            TensorDescriptor(w_qkv, shape=list(w_qkv.shape), strides=[d_model, 1], block_shape=box),
            TensorDescriptor(w_out_t, shape=list(w_out_t.shape), strides=[d_model, 1], block_shape=box),
            *args, D=d_model, HEADS=num_heads, HEAD_DIM=head_dim, ROTARY=cos is not None,
            ROTATE_V=cos is not None and bool(rotate_v), num_warps=4, num_stages=1, **cfg,
        )


def forward_blocks_tlx(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start, block_len, num_blocks, cos,
                       sin, num_heads, rotate_v, eps, launch):
    """(y, qkv, attn, mean, rstd), as attention_sublayer_blocks.forward_blocks returns them."""
    tokens, d_model = x.shape
    head_dim = d_model // num_heads
    cfg = _checked_config(d_model, num_heads, w_qkv.dtype, launch, "fwd")
    x = x.contiguous()
    y = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    qkv = torch.empty((tokens, 3 * d_model), dtype=w_qkv.dtype, device=x.device)
    attn = torch.empty((tokens, num_heads, head_dim), dtype=w_qkv.dtype, device=x.device)
    mean = torch.empty(tokens, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if tokens and block_start.numel():
        args = (x, norm_weight, norm_bias, b_qkv, b_out, cos, sin, block_start, block_len, num_blocks, y, qkv, attn,
                mean, rstd, eps, _softmax_scale(head_dim) * math.log2(math.e))
        _launch(_tlx_attention_sublayer_fwd, w_qkv, w_out, block_start, args, num_heads, cos, rotate_v, cfg)
    return y, qkv, attn, mean, rstd


def backward_core_tlx(grad_out, qkv, w_qkv, w_out, block_start, block_len, num_blocks, cos, sin, num_heads, rotate_v,
                      launch):
    """(dQKV [T, 3D] in the compute dtype, dLN [T, D] in fp32) from dY in the compute dtype (grad_out [T, D]):
    what the "gemms" backward gets from dAttn's GEMM, the block-attention backward and dLN's GEMM, in one
    kernel."""
    tokens, d_model = grad_out.shape
    head_dim = d_model // num_heads
    cfg = _checked_config(d_model, num_heads, w_qkv.dtype, launch, "bwd")
    grad_qkv = torch.empty((tokens, 3 * d_model), dtype=w_qkv.dtype, device=grad_out.device)
    grad_normed = torch.empty((tokens, d_model), dtype=torch.float32, device=grad_out.device)
    if tokens and block_start.numel():
        scale = _softmax_scale(head_dim)
        args = (grad_out.contiguous(), qkv.contiguous(), cos, sin, block_start, block_len, num_blocks, grad_qkv,
                grad_normed, scale, scale * math.log2(math.e))
        _launch(_tlx_attention_sublayer_bwd, w_qkv, w_out, block_start, args, num_heads, cos, rotate_v, cfg)
    return grad_qkv, grad_normed
