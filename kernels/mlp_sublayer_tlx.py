"""TLX (Meta's Triton fork) warp-specialized fused MLP sublayer for Hopper (sm_90); see mlp_dispatch.py.

Invariants the kernel relies on:
- x [T, D] (fp32 under autocast, or the compute dtype) with contiguous rows; D = d_model is 64, 128
  or 256 (one wgmma N tile of the output, one TMA box of W1's rows); the hidden width H is a
  multiple of BLOCK_H = 64; the weights W1 [H, D], W2 [D, H] are contiguous in the compute dtype
  (bf16/fp16), so a hidden chunk is the TMA boxes [64, D] of W1 at (h0, 0) and [D, 64] of W2 at (0, h0).
- A persistent grid of programs walks rounds; in a round, each of the NUM_CONSUMERS consumer
  warpgroups takes its own 64-token tile (tile = round_index * NUM_CONSUMERS + consumer), and the
  producer warpgroup streams every hidden chunk's W1 and W2 boxes once through a NUM_STAGES ring
  that both consumers read: the weights cross L2 once per 64 * NUM_CONSUMERS tokens, not per 64.
  A ring slot's empty barrier waits for every consumer (arrive count NUM_CONSUMERS); a consumer
  whose tile lies past T still walks the chunks (all its rows masked), so the phases stay paired.
- The consumer normalizes its tile in registers (fp32), stores LN(x) in the compute dtype to its own
  SMEM tile (wgmma's A of the first product), and keeps the [64, D] fp32 output accumulator in
  registers across the chunks; GELU's input, the pre-activation, is rounded to the compute dtype
  (and saved for the backward) as the Triton kernel does, so both backends compute the same thing.
- Rows >= T are loaded as zeros and never stored.
The backward's token-tile kernel has the same shape (the producer also brings each consumer's saved
pre-activation chunk; dH, GELU's output and dLN leave by TMA or in 64-column slices), then the
Triton LayerNorm-backward kernel and the two weight-gradient GEMMs of mlp_dispatch.py. It runs with
the launch knob {"bwd": {"TRITON_BACKWARD": False}}; by default the backward is the Triton backend's
(kernels/mlp_sublayer_triton.py, its default "gemms" plan; see tlx_mlp_config). That plan's first GEMM
as a warp-specialized TLX kernel (a ring of W2 boxes and pre-activation chunks, two consumers) passed
parity but ran slower than the Triton one in every ring that fits (benchmarks/results/
mlp_tlx_hidden_grad_h{100,200}.md), so it was taken out again; it is in git history at 229f10f.
"""

import functools

import torch

try:
    import triton
    import triton.language as tl
    import triton.language.extra.tlx as tlx

    from triton.tools.tensor_descriptor import TensorDescriptor

    # One GELU (and its derivative) for both backends; LayerNorm's backward is the Triton kernel's.
    from .mlp_sublayer_triton import _backward as _triton_backward
    from .sublayer_triton import _gelu, _gelu_and_grad, layer_norm_backward, tanh_gelu
    from .sublayer_tlx import _layer_norm_to_smem, _load_x_slice, _residual_store, _store_accumulator

    HAS_TLX = True
except ImportError:  # plain triton (no extra.tlx) or no triton at all: the backend is unavailable
    HAS_TLX = False

from .backend import launch_overrides
from .mlp_dispatch import mlp_kernel_ops
from .sublayer_dispatch import SublayerBackend
from .block_attention_tlx import _num_sms
from .sublayer_tlx import choose_ring

SUPPORTED_D_MODELS = (64, 128, 256)
SUPPORTED_COMPUTE_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 64  # one wgmma M tile per consumer warpgroup
BLOCK_H = 64
MAX_STAGES = 4
FWD_KNOBS = ("NUM_STAGES", "NUM_CONSUMERS")
# TRITON_BACKWARD: the backward is the Triton backend's, with its default plan (kernels/mlp_sublayer_triton.py).
BWD_KNOBS = ("NUM_STAGES", "NUM_CONSUMERS", "TRITON_BACKWARD")
# Per consumer, what the compiler adds beyond our buffers (reductions, barriers, alignment), as
# fbtriton 3.7's sm_90 builds allocate it (tests/test_tlx_aot.py holds this model to them).
_SCRATCH_PER_CONSUMER = {64: 384, 128: 384, 256: 624}
# The backward's, larger: dLN's fp32 column slices and dH's column sums go through layout conversions.
_BWD_SCRATCH_PER_CONSUMER = {64: 16548, 128: 16532, 256: 16676}


def smem_bytes(d_model: int, NUM_STAGES: int, NUM_CONSUMERS: int, backward: bool = False, elem_size: int = 2) -> int:
    """Shared memory of one program. Forward: the ring (a W1 and a W2 box per slot); per consumer
    its LN(x) tile and its pre-activation staging tile. Backward: the ring also holds every
    consumer's pre-activation chunk; per consumer its dY tile and the dH and GELU staging tiles.
    Both: compiler scratch per consumer."""
    tile, chunk = BLOCK_M * d_model, BLOCK_M * BLOCK_H
    slot = 2 * BLOCK_H * d_model + (NUM_CONSUMERS * chunk if backward else 0)
    per_consumer = tile + (2 if backward else 1) * chunk
    scratch = (_BWD_SCRATCH_PER_CONSUMER if backward else _SCRATCH_PER_CONSUMER)[d_model]
    return (NUM_STAGES * slot + NUM_CONSUMERS * per_consumer) * elem_size + NUM_CONSUMERS * scratch


def tlx_mlp_config(d_model: int, knob_items: tuple = (), backward: bool = False) -> dict:
    """Constexpr knobs of one direction, as sublayer_tlx.choose_ring picks them; `knob_items` (FWD_KNOBS /
    BWD_KNOBS) override them."""
    return dict(_cached_config(d_model, knob_items, backward))  # a copy: callers may change it


@functools.lru_cache(maxsize=None)
def _cached_config(d_model: int, knob_items: tuple, backward: bool) -> dict:
    knobs = dict(knob_items)
    allowed = BWD_KNOBS if backward else FWD_KNOBS
    unknown = set(knobs) - set(allowed)
    if unknown:
        raise ValueError(f"unknown TLX mlp_sublayer {'bwd' if backward else 'fwd'} tuning knobs {sorted(unknown)}; "
                         f"choose from {allowed}")

    cfg = choose_ring(knobs, lambda stages, consumers: smem_bytes(d_model, stages, consumers, backward), MAX_STAGES,
                      f"TLX mlp_sublayer {'bwd' if backward else 'fwd'} at d_model {d_model}")
    if backward:
        # On by default: at d_model 256 (one consumer fits) the TLX tile kernel ran slower than the
        # Triton one on the H200 (benchmarks/results/mlp_sublayer_h200.md).
        cfg["TRITON_BACKWARD"] = bool(knobs.get("TRITON_BACKWARD", True))
    return cfg


if HAS_TLX:

    @triton.jit
    def _num_rounds(T, NUM_CONSUMERS: tl.constexpr):
        """(program, programs, rounds): a round takes NUM_CONSUMERS tiles. Every partition computes
        the same count, so producer and consumers agree on the chunks."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        num_groups = tl.cdiv(tl.cdiv(T, 64), NUM_CONSUMERS)
        return pid, nprog, tl.maximum(tl.cdiv(num_groups - pid, nprog), 0)

    @triton.jit
    def _load_weight_chunk(desc_w1, desc_w2, w1_bufs, w2_bufs, fulls, empties, k, num_chunks,
                           SLOT_BYTES: tl.constexpr, NUM_STAGES: tl.constexpr, CHUNK: tl.constexpr):
        """The producer's step k: waits for ring slot k % NUM_STAGES to be free, then loads hidden chunk
        k % num_chunks's W1 box [CHUNK, D] and W2 box [D, CHUNK] into it. The slot's full barrier expects
        SLOT_BYTES, so a caller may add loads of its own to the slot."""
        h0 = (k % num_chunks) * CHUNK
        slot = k % NUM_STAGES
        phase = (k // NUM_STAGES) & 1
        # Fresh barriers sit in phase 0, so waiting for parity 1 passes on the first lap.
        tlx.barrier_wait(empties[slot], phase ^ 1)
        tlx.barrier_expect_bytes(fulls[slot], SLOT_BYTES)
        tlx.async_descriptor_load(desc_w1, w1_bufs[slot], [h0, 0], fulls[slot])
        tlx.async_descriptor_load(desc_w2, w2_bufs[slot], [0, h0], fulls[slot])

    @triton.jit
    def _first_product(normed_buf, w1_bufs, fulls, k, NUM_STAGES: tl.constexpr):
        """Ring step k's first product LN(x) · W1[chunk]ᵀ, issued once its slot is full (not waited)."""
        tlx.barrier_wait(fulls[k % NUM_STAGES], (k // NUM_STAGES) & 1)
        return tlx.async_dot(normed_buf, tlx.local_trans(w1_bufs[k % NUM_STAGES]))

    @triton.jit
    def _activation_and_second_product(hidden, acc, b1_ptr, w2_buf, hidden_buf, desc_hidden, row0, c,
                                       dtype: tl.constexpr, CHUNK: tl.constexpr, TANH_GELU: tl.constexpr):
        """Chunk c's bias and GELU on the first product's fp32 result, then (issued, not waited) the
        second product into acc; the rounded pre-activation leaves by TMA while that runs."""
        b1 = tl.load(b1_ptr + c * CHUNK + tl.arange(0, CHUNK)).to(tl.float32)
        hidden = (hidden + b1[None, :]).to(dtype)
        activation = _gelu(hidden.to(tl.float32), TANH_GELU).to(dtype)
        acc = tlx.async_dot(activation, tlx.local_trans(w2_buf), acc)
        # TMA writes no row past T; the previous chunk's store has had a chunk's time to read the tile.
        tlx.async_descriptor_store_wait(0)
        tlx.local_store(hidden_buf, hidden)
        tlx.fence_async_shared()
        tlx.async_descriptor_store(desc_hidden, hidden_buf, [row0, c * CHUNK])
        return acc

    @triton.jit
    def _load_hidden_chunks(desc_hidden, hidden_bufs, fulls, slot, first_tile, h0,
                            NUM_CONSUMERS: tl.constexpr, BLOCK: tl.constexpr):
        """The producer's loads of every consumer's pre-activation chunk h0 into ring slot `slot` (its full
        barrier's expected bytes count them); consumer c's tile is first_tile + c. Rows past T arrive as zeros
        (TMA's fill) and are never stored."""
        for c in tl.static_range(NUM_CONSUMERS):
            tlx.async_descriptor_load(desc_hidden, hidden_bufs[slot * NUM_CONSUMERS + c],
                                      [(first_tile + c) * BLOCK, h0], fulls[slot])

    @triton.jit
    def _ring_producer(desc_w1, desc_w2, desc_hidden, w1_bufs, w2_bufs, hidden_bufs, fulls, empties, T, H,
                       SLOT_BYTES: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        """Both MLP kernels' producer: for each round's tiles and hidden chunk, the chunk's weight boxes and,
        in the backward kernel (desc_hidden not None), every consumer's pre-activation chunk into the next
        ring slot; SLOT_BYTES counts them all."""
        pid, nprog, n_rounds = _num_rounds(T, NUM_CONSUMERS)
        num_chunks = H // CHUNK
        for k in range(0, n_rounds * num_chunks):
            _load_weight_chunk(desc_w1, desc_w2, w1_bufs, w2_bufs, fulls, empties, k, num_chunks, SLOT_BYTES,
                               NUM_STAGES, CHUNK)
            if desc_hidden is not None:
                r = k // num_chunks
                _load_hidden_chunks(desc_hidden, hidden_bufs, fulls, k % NUM_STAGES,
                                    (pid + r * nprog) * NUM_CONSUMERS, (k % num_chunks) * CHUNK, NUM_CONSUMERS, BLOCK)

    @triton.jit
    def _hidden_grad_epilogue(grad_act, hidden, grad_hidden_buf, activation_buf, desc_grad_hidden, desc_activation,
                              db1_parts_ptr, tile, c, T, H, dtype: tl.constexpr, BLOCK: tl.constexpr,
                              CHUNK: tl.constexpr, TANH_GELU: tl.constexpr):
        """Chunk c of a consumer's tile from dG = dY W2[:, chunk] and the pre-activation (fp32): dH and GELU's
        output staged in SMEM (dH stays there as a wgmma operand) and stored by TMA, dH's column sums into
        row `tile` of b1's partial sums."""
        hcols = tl.arange(0, CHUNK)
        row0 = tile * BLOCK
        activation, gelu_grad = _gelu_and_grad(hidden, TANH_GELU)
        grad_hidden = (grad_act * gelu_grad).to(dtype)
        # The previous chunk's stores have read the staging tiles.
        tlx.async_descriptor_store_wait(0)
        tlx.local_store(grad_hidden_buf, grad_hidden)
        tlx.local_store(activation_buf, activation.to(dtype))
        tlx.fence_async_shared()
        tlx.async_descriptor_store(desc_grad_hidden, grad_hidden_buf, [row0, c * CHUNK])
        tlx.async_descriptor_store(desc_activation, activation_buf, [row0, c * CHUNK])
        # Zero rows of dY (past T) give zero rows of dH, so the column sums need no row mask; a tile wholly
        # past T (the second consumer's, when the tiles are odd) has no row of partial sums to write.
        tl.store(db1_parts_ptr + tile * H + c * CHUNK + hcols, tl.sum(grad_hidden.to(tl.float32), 0),
                 mask=(hcols < CHUNK) & (row0 < T))

    @triton.jit
    def _tlx_mlp_sublayer_fwd(
        desc_w1, desc_w2, desc_hidden, x_ptr, norm_weight_ptr, norm_bias_ptr, b1_ptr, b2_ptr,
        y_ptr, mean_ptr, rstd_ptr,
        T, H, eps,
        D: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
        TANH_GELU: tl.constexpr,
    ):
        BLOCK: tl.constexpr = 64
        CHUNK: tl.constexpr = 64
        dtype: tl.constexpr = tlx.dtype_of(desc_w1)
        SLOT_BYTES: tl.constexpr = 2 * CHUNK * D * tlx.size_of(dtype)

        w1_bufs = tlx.local_alloc((CHUNK, D), dtype, NUM_STAGES)
        w2_bufs = tlx.local_alloc((D, CHUNK), dtype, NUM_STAGES)
        normed_bufs = tlx.local_alloc((BLOCK, D), dtype, NUM_CONSUMERS)
        # Each consumer's pre-activation chunk on its way out by TMA: a masked tl.store's [64, 64]
        # int64 addresses would not fit beside the [64, D] accumulator.
        hidden_bufs = tlx.local_alloc((BLOCK, CHUNK), dtype, NUM_CONSUMERS)
        fulls = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
        empties = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=NUM_CONSUMERS)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                _ring_producer(desc_w1, desc_w2, None, w1_bufs, w2_bufs, None, fulls, empties, T, H, SLOT_BYTES,
                               NUM_STAGES, NUM_CONSUMERS, BLOCK, CHUNK)

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                cols = tl.arange(0, D)
                normed_buf = normed_bufs[cid]
                hidden_buf = hidden_bufs[cid]
                pid, nprog, n_rounds = _num_rounds(T, NUM_CONSUMERS)
                num_chunks = H // CHUNK
                for r in range(0, n_rounds):
                    row0 = ((pid + r * nprog) * NUM_CONSUMERS + cid) * BLOCK
                    rows = row0 + tl.arange(0, BLOCK)
                    row_ok = rows < T
                    rows64 = rows.to(tl.int64)
                    # The previous tile's wgmmas have finished reading the LN(x) tile (each was waited).
                    mean, rstd = _layer_norm_to_smem(x_ptr, norm_weight_ptr, norm_bias_ptr, rows64, row_ok, normed_buf,
                                                     eps, dtype, D, CHUNK)
                    tl.store(mean_ptr + rows, mean, mask=row_ok)
                    tl.store(rstd_ptr + rows, rstd, mask=row_ok)

                    acc = tl.zeros((BLOCK, D), dtype=tl.float32)
                    k0 = r * num_chunks
                    # Chunk c's second product runs on the tensor cores while the other consumer's GELU runs.
                    # (Issuing chunk c + 1's first product before chunk c's GELU, within one consumer, spilled at
                    # d_model 256 and ran slower in both GELU forms on an H100: benchmarks/results/mlp_gelu_h100.md,
                    # the PIPELINE rows; that knob is in git history at 5d59620.)
                    for c in range(0, num_chunks):
                        slot = (k0 + c) % NUM_STAGES
                        hidden = tlx.async_dot_wait(0, _first_product(normed_buf, w1_bufs, fulls, k0 + c, NUM_STAGES))
                        acc = _activation_and_second_product(
                            hidden, acc, b1_ptr, w2_bufs[slot], hidden_buf, desc_hidden, row0, c, dtype, CHUNK,
                            TANH_GELU)
                        acc = tlx.async_dot_wait(0, acc)
                        tlx.barrier_arrive(empties[slot], 1)

                    # The second linear's output, rounded to the compute dtype before the residual as
                    # nn.Linear's is, staged through the LN(x) tile (no wgmma reads it any more).
                    out = (acc + tl.load(b2_ptr + cols).to(tl.float32)[None, :]).to(dtype)
                    _residual_store(out, normed_buf, x_ptr, y_ptr, rows64, row_ok, D, CHUNK)
                # SMEM must outlive the last store's read of it.
                tlx.async_descriptor_store_wait(0)

    @triton.jit
    def _tlx_mlp_sublayer_bwd(
        desc_w1, desc_w2, desc_hidden, desc_grad_hidden, desc_activation,
        grad_y_ptr, x_ptr, norm_weight_ptr, norm_bias_ptr, mean_ptr, rstd_ptr,
        grad_normed_ptr, normed_ptr, db1_parts_ptr,
        T, H, grad_y_stride,
        D: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
        TANH_GELU: tl.constexpr,
    ):
        """The backward's token-tile kernel: per 64-token tile, LN(x) (for dW1's GEMM), and per hidden
        chunk dG = dY W2[:, chunk], dH = dG GELU'(pre-activation), GELU(pre-activation) (for dW2's
        GEMM), dLN += dH W1[chunk, :]. dLN leaves in fp32; LayerNorm's backward is a second kernel."""
        BLOCK: tl.constexpr = 64
        CHUNK: tl.constexpr = 64
        dtype: tl.constexpr = tlx.dtype_of(desc_w1)
        SLOT_BYTES: tl.constexpr = (2 * CHUNK * D + NUM_CONSUMERS * BLOCK * CHUNK) * tlx.size_of(dtype)

        w1_bufs = tlx.local_alloc((CHUNK, D), dtype, NUM_STAGES)
        w2_bufs = tlx.local_alloc((D, CHUNK), dtype, NUM_STAGES)
        # Each slot also holds every consumer's pre-activation chunk (the producer loads them by TMA).
        hidden_bufs = tlx.local_alloc((BLOCK, CHUNK), dtype, NUM_STAGES * NUM_CONSUMERS)
        grad_y_bufs = tlx.local_alloc((BLOCK, D), dtype, NUM_CONSUMERS)
        # dH is staged for its TMA store and is also wgmma's A operand of dLN; GELU's output is staged
        # for its store.
        grad_hidden_bufs = tlx.local_alloc((BLOCK, CHUNK), dtype, NUM_CONSUMERS)
        activation_bufs = tlx.local_alloc((BLOCK, CHUNK), dtype, NUM_CONSUMERS)
        fulls = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
        empties = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=NUM_CONSUMERS)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                _ring_producer(desc_w1, desc_w2, desc_hidden, w1_bufs, w2_bufs, hidden_bufs, fulls, empties, T, H,
                               SLOT_BYTES, NUM_STAGES, NUM_CONSUMERS, BLOCK, CHUNK)

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                hcols = tl.arange(0, CHUNK)
                grad_y_buf = grad_y_bufs[cid]
                grad_hidden_buf = grad_hidden_bufs[cid]
                activation_buf = activation_bufs[cid]
                pid, nprog, n_rounds = _num_rounds(T, NUM_CONSUMERS)
                num_chunks = H // CHUNK
                for r in range(0, n_rounds):
                    tile = (pid + r * nprog) * NUM_CONSUMERS + cid
                    row0 = tile * BLOCK
                    rows = row0 + tl.arange(0, BLOCK)
                    row_ok = rows < T
                    rows64 = rows.to(tl.int64)
                    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
                    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
                    for c in tl.static_range(D // CHUNK):
                        # LN(x) recomputed from the saved statistics as the forward computed it, for
                        # dW1's GEMM; dY rounded to the compute dtype (the second linear's output was),
                        # into this consumer's A tile of dG.
                        centered = _load_x_slice(x_ptr, rows64, row_ok, c, D, CHUNK) - mean[:, None]
                        weight = tl.load(norm_weight_ptr + c * CHUNK + hcols).to(tl.float32)
                        bias = tl.load(norm_bias_ptr + c * CHUNK + hcols).to(tl.float32)
                        normed = centered * rstd[:, None] * weight[None, :] + bias[None, :]
                        offs = rows64[:, None] * D + (c * CHUNK + hcols)[None, :]
                        tl.store(normed_ptr + offs, normed.to(dtype), mask=row_ok[:, None])
                        grad_y = tl.load(grad_y_ptr + rows64[:, None] * grad_y_stride + (c * CHUNK + hcols)[None, :],
                                         mask=row_ok[:, None], other=0.0)
                        tlx.local_store(tlx.local_slice(grad_y_buf, [0, c * CHUNK], [BLOCK, CHUNK]), grad_y.to(dtype))
                    tlx.fence_async_shared()

                    acc = tl.zeros((BLOCK, D), dtype=tl.float32)
                    for c in range(0, num_chunks):
                        k = r * num_chunks + c
                        slot = k % NUM_STAGES
                        tlx.barrier_wait(fulls[slot], (k // NUM_STAGES) & 1)
                        grad_act = tlx.async_dot(grad_y_buf, w2_bufs[slot])
                        hidden = tlx.local_load(hidden_bufs[slot * NUM_CONSUMERS + cid]).to(tl.float32)
                        grad_act = tlx.async_dot_wait(0, grad_act)
                        _hidden_grad_epilogue(grad_act, hidden, grad_hidden_buf, activation_buf, desc_grad_hidden,
                                              desc_activation, db1_parts_ptr, tile, c, T, H, dtype, BLOCK, CHUNK,
                                              TANH_GELU)
                        acc = tlx.async_dot(grad_hidden_buf, w1_bufs[slot], acc)
                        acc = tlx.async_dot_wait(0, acc)
                        tlx.barrier_arrive(empties[slot], 1)
                    _store_accumulator(grad_normed_ptr, acc, rows64, row_ok, D)
                tlx.async_descriptor_store_wait(0)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _forward(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch):
    tokens, d_model = x.shape
    hidden_width = w1.shape[0]
    x = x.contiguous()
    w1, b1, w2, b2, norm_weight, norm_bias = (t.contiguous() for t in (w1, b1, w2, b2, norm_weight, norm_bias))
    y = torch.empty((tokens, d_model), dtype=x.dtype, device=x.device)
    # At least one tile of rows: a TMA box may not exceed the tensor it tiles (the extra rows are
    # never written, and the view below drops them).
    hidden_rows = torch.empty((max(tokens, BLOCK_M), hidden_width), dtype=w1.dtype, device=x.device)
    hidden = hidden_rows[:tokens]
    mean = torch.empty(tokens, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if tokens == 0:
        return y, hidden, mean, rstd
    overrides = launch_overrides(launch, "fwd")
    cfg = tlx_mlp_config(d_model, tuple(sorted(overrides.items())))
    groups = triton.cdiv(triton.cdiv(tokens, BLOCK_M), cfg["NUM_CONSUMERS"])
    grid = max(1, min(_num_sms(x.device), groups))
    with torch.cuda.device(x.device):
        desc_w1 = TensorDescriptor(w1, shape=list(w1.shape), strides=[w1.stride(0), 1], block_shape=[BLOCK_H, d_model])
        desc_w2 = TensorDescriptor(w2, shape=list(w2.shape), strides=[w2.stride(0), 1], block_shape=[d_model, BLOCK_H])
        desc_hidden = TensorDescriptor(hidden_rows, shape=[tokens, hidden_width], strides=[hidden_width, 1],
                                       block_shape=[BLOCK_M, BLOCK_H])
        _tlx_mlp_sublayer_fwd[(grid,)](
            desc_w1, desc_w2, desc_hidden, x, norm_weight, norm_bias, b1, b2, y, mean, rstd, tokens, hidden_width, eps,
            D=d_model, TANH_GELU=tanh_gelu(approximate), num_warps=4, num_stages=1, **cfg,
        )
    return y, hidden, mean, rstd


def _backward(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate, launch):
    tokens, d_model = x.shape
    hidden_width = w1.shape[0]
    overrides = launch_overrides(launch, "bwd")
    cfg = tlx_mlp_config(d_model, tuple(sorted(overrides.items())), backward=True)
    # A host-side choice, not a kernel constexpr: taken out before cfg reaches a launch.
    if cfg.pop("TRITON_BACKWARD"):
        return _triton_backward(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate,
                                "")
    x, grad_y = x.contiguous(), grad_y.contiguous()
    w1, w2, norm_weight, norm_bias = (t.contiguous() for t in (w1, w2, norm_weight, norm_bias))
    device, dtype = x.device, w1.dtype
    # At least one tile of rows under every TMA-tiled tensor (a box may not exceed its tensor).
    rows = max(tokens, BLOCK_M)
    hidden = _padded_rows(hidden)
    grad_hidden_rows = torch.empty((rows, hidden_width), dtype=dtype, device=device)
    activation_rows = torch.empty_like(grad_hidden_rows)
    normed = torch.empty((tokens, d_model), dtype=dtype, device=device)
    grad_normed = torch.empty((tokens, d_model), dtype=torch.float32, device=device)
    db1_parts = torch.zeros((triton.cdiv(tokens, BLOCK_M), hidden_width), dtype=torch.float32, device=device)
    dx = torch.empty((tokens, d_model), dtype=x.dtype, device=device)
    if tokens:
        groups = triton.cdiv(triton.cdiv(tokens, BLOCK_M), cfg["NUM_CONSUMERS"])
        with torch.cuda.device(device):
            chunk = dict(shape=[tokens, hidden_width], strides=[hidden_width, 1], block_shape=[BLOCK_M, BLOCK_H])
            descs = (
                TensorDescriptor(w1, shape=list(w1.shape), strides=[w1.stride(0), 1], block_shape=[BLOCK_H, d_model]),
                TensorDescriptor(w2, shape=list(w2.shape), strides=[w2.stride(0), 1], block_shape=[d_model, BLOCK_H]),
                TensorDescriptor(hidden, **chunk), TensorDescriptor(grad_hidden_rows, **chunk),
                TensorDescriptor(activation_rows, **chunk),
            )
            _tlx_mlp_sublayer_bwd[(max(1, min(_num_sms(device), groups)),)](
                *descs, grad_y, x, norm_weight, norm_bias, mean, rstd, grad_normed, normed, db1_parts,
                tokens, hidden_width, grad_y.stride(0), D=d_model, TANH_GELU=tanh_gelu(approximate), num_warps=4,
                num_stages=1, **cfg,
            )
    column_parts = layer_norm_backward(grad_normed, grad_y, x, mean, rstd, norm_weight, norm_bias, dx)
    return dx, grad_y.to(dtype), grad_hidden_rows[:tokens], activation_rows[:tokens], normed, db1_parts, column_parts


def _padded_rows(t: torch.Tensor) -> torch.Tensor:
    """t [T, H] with contiguous rows and at least one tile of them: a TMA box may not exceed the tensor it
    tiles (the added rows are zeros, read as rows past T are)."""
    tokens, width = t.shape
    if tokens < BLOCK_M:
        return torch.cat([t, t.new_zeros(BLOCK_M - tokens, width)])
    return t if t.stride(0) == width and t.stride(1) == 1 else t.contiguous()


_run_ops = mlp_kernel_ops("tlx", _forward, _backward)


def tlx_mlp_unsupported_reason(x: torch.Tensor, hidden: int, compute_dtype: torch.dtype) -> str | None:
    d_model = x.shape[1]
    if d_model not in SUPPORTED_D_MODELS:
        return f"d_model {d_model} (the TLX kernel takes {SUPPORTED_D_MODELS})"
    if hidden % BLOCK_H:
        return f"hidden width {hidden} (the TLX kernel takes a multiple of {BLOCK_H})"
    if compute_dtype not in SUPPORTED_COMPUTE_DTYPES:
        return f"compute dtype {compute_dtype} (the TLX kernel's matmuls take float16 or bfloat16)"
    if x.dtype not in SUPPORTED_X_DTYPES:
        return f"x dtype {x.dtype}"
    return None


MLP_BACKEND = SublayerBackend("tlx", tlx_mlp_unsupported_reason, _run_ops, ops=_run_ops)
