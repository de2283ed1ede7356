"""TLX code both fused sublayers' Hopper kernels share (kernels/mlp_sublayer_tlx.py,
kernels/attention_sublayer_tlx.py): a consumer warpgroup's LayerNorm of its 64 rows into a shared-memory
A tile, its residual epilogue, and the store of a [64, D] fp32 accumulator.

Both work in 64-column slices of x: a whole fp32 [64, 256] tile beside its int64 addresses would not
fit a consumer's registers next to the [64, D] accumulator. x has contiguous rows of D elements; rows
with row_ok false load as zeros and are never stored.
"""

from collections.abc import Callable

from .block_attention_tlx import SM90_MAX_SMEM, fits_sm90


def choose_ring(knobs: dict, smem: Callable[[int, int], int], max_stages: int, what: str) -> dict:
    """NUM_STAGES, NUM_CONSUMERS and CONSUMER_REGS of a kernel whose producer warpgroup streams weight
    boxes through a ring of shared-memory slots to one or two consumer warpgroups: two consumers (one's
    elementwise work and stores run while the other's wgmma does) where a ring of two slots fits beside
    them, else one; the deepest ring up to max_stages. knobs' NUM_STAGES / NUM_CONSUMERS override the
    choice; one that does not fit is a ValueError naming `what`. smem(stages, consumers) is the
    program's shared memory in bytes."""
    def fits(stages: int, consumers: int) -> bool:
        return fits_sm90(smem(stages, consumers))

    def deepest(consumers: int) -> int:
        if knobs.get("NUM_STAGES") is not None:
            return knobs["NUM_STAGES"]
        stages = 0
        while stages < max_stages and fits(stages + 1, consumers):
            stages += 1
        return stages

    choices = [knobs["NUM_CONSUMERS"]] if "NUM_CONSUMERS" in knobs else [2, 1]
    consumers = next((c for c in choices if deepest(c) >= 2), choices[-1])
    stages = deepest(consumers)
    cfg = dict(NUM_STAGES=stages, NUM_CONSUMERS=consumers)
    if consumers not in (1, 2) or stages < 1 or not fits(stages, consumers):
        raise ValueError(f"{what} with {cfg} needs {smem(stages, consumers)} B of shared memory (sm_90 allows "
                         f"{SM90_MAX_SMEM}) or is not 1-2 consumers and >= 1 stage")
    # setmaxnreg budget: 64K registers per SM over the producer and consumer warpgroups.
    cfg["CONSUMER_REGS"] = 232 if consumers == 2 else 240
    return cfg


try:
    import triton
    import triton.language as tl
    import triton.language.extra.tlx as tlx

    HAS_TLX = True
except ImportError:  # plain triton (no extra.tlx) or no triton at all: the kernels are unavailable
    HAS_TLX = False

if HAS_TLX:

    @triton.jit
    def _load_x_slice(x_ptr, rows64, row_ok, c, D: tl.constexpr, CHUNK: tl.constexpr):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        return tl.load(x_ptr + rows64[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _layer_norm_to_smem(x_ptr, norm_weight_ptr, norm_bias_ptr, rows64, row_ok, normed_buf, eps,
                            dtype: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr):
        """LN(x) of the 64 rows into normed_buf [64, D] (wgmma's A tile, of dtype), fenced for the
        async proxy; returns the rows' mean and 1/std. Two-pass statistics, then the normalized slices;
        the slices after the first pass come from L2. The caller makes sure no wgmma still reads
        normed_buf."""
        hcols = tl.arange(0, CHUNK)
        row_sum = tl.zeros((64,), dtype=tl.float32)
        for c in tl.static_range(D // CHUNK):
            row_sum += tl.sum(_load_x_slice(x_ptr, rows64, row_ok, c, D, CHUNK), 1)
        mean = row_sum / D
        row_sq = tl.zeros((64,), dtype=tl.float32)
        for c in tl.static_range(D // CHUNK):
            centered = _load_x_slice(x_ptr, rows64, row_ok, c, D, CHUNK) - mean[:, None]
            row_sq += tl.sum(centered * centered, 1)
        rstd = 1.0 / tl.sqrt(row_sq / D + eps)
        for c in tl.static_range(D // CHUNK):
            centered = _load_x_slice(x_ptr, rows64, row_ok, c, D, CHUNK) - mean[:, None]
            weight = tl.load(norm_weight_ptr + c * CHUNK + hcols).to(tl.float32)
            bias = tl.load(norm_bias_ptr + c * CHUNK + hcols).to(tl.float32)
            normed = centered * rstd[:, None] * weight[None, :] + bias[None, :]
            tlx.local_store(tlx.local_slice(normed_buf, [0, c * CHUNK], [64, CHUNK]), normed.to(dtype))
        tlx.fence_async_shared()
        return mean, rstd

    @triton.jit
    def _residual_store(out, staging_buf, x_ptr, y_ptr, rows64, row_ok, D: tl.constexpr, CHUNK: tl.constexpr):
        """y = x + out for the 64 rows, out [64, D] already rounded to the compute dtype (as nn.Linear's
        output is). out goes through staging_buf [64, D], which no wgmma may still read, so that the
        residual is added and stored in 64-column slices."""
        hcols = tl.arange(0, CHUNK)
        tlx.local_store(staging_buf, out)
        for c in tl.static_range(D // CHUNK):
            out_slice = tlx.local_load(tlx.local_slice(staging_buf, [0, c * CHUNK], [64, CHUNK]))
            y = _load_x_slice(x_ptr, rows64, row_ok, c, D, CHUNK) + out_slice.to(tl.float32)
            offs = rows64[:, None] * D + (c * CHUNK + hcols)[None, :]
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _store_fp32_columns(ptr, acc, rows64, row_ok, col0: tl.constexpr, D: tl.constexpr):
        cols = col0 + tl.arange(0, 64)
        tl.store(ptr + rows64[:, None] * D + cols[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _split_columns(acc, WIDTH: tl.constexpr):
        """The left and right column halves of a [64, WIDTH] register tile."""
        return tl.split(tl.permute(tl.reshape(acc, (64, 2, WIDTH // 2)), (0, 2, 1)))

    @triton.jit
    def _store_accumulator(ptr, acc, rows64, row_ok, D: tl.constexpr):
        """A [64, D] fp32 accumulator stored in 64-column slices: a store of the whole tile would need
        [64, D] int64 addresses beside it in registers."""
        if D == 64:
            _store_fp32_columns(ptr, acc, rows64, row_ok, 0, D)
        elif D == 128:
            left, right = _split_columns(acc, 128)
            _store_fp32_columns(ptr, left, rows64, row_ok, 0, D)
            _store_fp32_columns(ptr, right, rows64, row_ok, 64, D)
        else:
            left, right = _split_columns(acc, 256)
            a, b = _split_columns(left, 128)
            _store_fp32_columns(ptr, a, rows64, row_ok, 0, D)
            _store_fp32_columns(ptr, b, rows64, row_ok, 64, D)
            a, b = _split_columns(right, 128)
            _store_fp32_columns(ptr, a, rows64, row_ok, 128, D)
            _store_fp32_columns(ptr, b, rows64, row_ok, 192, D)
