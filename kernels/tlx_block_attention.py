"""TLX (Meta's Triton fork) warp-specialized block attention for Hopper (sm_90), fwd + bwd.

Invariants every kernel here relies on:
- q, k, v, grad_out (and the outputs) are contiguous [T, H, D] in fp16/bf16; viewed as 2-D
  [T, H*D] for TMA, so a (64-token block, head) tile is the box [64, D] at (start, h*D).
- D is 64 or 128 (one wgmma N/K tile, TMA row of 128/256 bytes, D/2 rotary pairs).
- cos/sin are contiguous fp32 [T, D/2]; their tile is the box [64, D/2] at (start, 0).
- A block is BLOCK=64 tokens from its sequence's start (kernels.blocks.block_table); only the last
  block of a sequence is partial (len in 1..64). Its TMA tile runs into the next sequence (or TMA's
  zero fill past T): keys >= len are masked out of the softmax, query rows >= len are zeroed out
  of every gradient product, and every global store is a masked tl.store (never TMA), so nothing
  outside the block is read into a result or written.
- Work item = (block, head); a persistent grid of min(#SMs, #items) programs walks items
  pid, pid + nprog, ... One producer warpgroup streams the item's tiles through a NUM_STAGES ring
  of SMEM slots (full/empty mbarrier pair per slot); NUM_CONSUMERS consumer warpgroups take items
  round-robin (item j -> consumer j % NUM_CONSUMERS, slot j % NUM_STAGES). NUM_STAGES is a
  multiple of NUM_CONSUMERS, so each slot always has the same single consumer (empty arrive count 1).
- One 64x64 score tile per item: exact softmax, no running max, no LSE saved; the backward
  recomputes P and gets Di = rowsum(P * dP) from registers. No atomics: each item owns its block's
  rows of dq/dk/dv, so gradients are deterministic.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
    import triton.language.extra.tlx as tlx
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TLX = True
except ImportError:  # plain triton (no extra.tlx) or no triton at all
    HAS_TLX = False

from .blocks import BLOCK_SIZE, block_table

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Largest dynamic shared memory an sm_90 block may opt into (227 KiB).
SM90_MAX_SMEM = 232448


def tlx_config(head_dim: int, rotary: bool, backward: bool) -> dict:
    """Ring depth / consumer count per kernel shape, sized so the SMEM ring fits in 227 KiB.

    Per slot: fwd q,k,v = 3*64*D*2 B, bwd adds dO; rotary adds fp32 cos,sin = 2*64*(D/2)*4 B.
    The bwd also keeps two 64x64 transposed operand tiles (P^T, dS^T) per consumer.
    """
    if not backward:
        # D=128 rotary: 2 x 80 KiB; D=64: 4 x 24 (40 with rotary) KiB.
        stages = 4 if head_dim == 64 else 2
        return dict(NUM_STAGES=stages, NUM_CONSUMERS=2)
    if head_dim == 128 and rotary:
        # 2 x 96 KiB ring + 16 KiB scratch for one consumer; two would not fit.
        return dict(NUM_STAGES=2, NUM_CONSUMERS=1)
    return dict(NUM_STAGES=2, NUM_CONSUMERS=2)


def _consumer_regs(num_consumers: int) -> int:
    # setmaxnreg budget: 64K regs/SM over (1 producer + N consumer) warpgroups of 128 threads; the
    # producer only issues TMA and keeps the remainder (>= 24 regs/thread).
    return 232 if num_consumers == 2 else 240


if HAS_TLX:

    @triton.jit
    def _rope(x, c, s, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INVERSE: tl.constexpr):
        # Interleaved (GPT-J) pairs: x[2i], x[2i+1] rotate by (c_i, s_i); INVERSE uses (c, -s).
        x0, x1 = tl.split(tl.reshape(x.to(tl.float32), (BLOCK, HEAD_DIM // 2, 2)))
        if INVERSE:
            y0 = x0 * c + x1 * s
            y1 = x1 * c - x0 * s
        else:
            y0 = x0 * c - x1 * s
            y1 = x0 * s + x1 * c
        return tl.reshape(tl.join(y0, y1), (BLOCK, HEAD_DIM))

    @triton.jit
    def _item_coords(item, H, block_start_ptr, block_len_ptr):
        blk = item // H
        head = item - blk * H
        start = tl.load(block_start_ptr + blk)
        length = tl.load(block_len_ptr + blk)
        return head, start, length

    @triton.jit
    def _store_tile(ptr, x, start, length, head, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
        # Masked, never TMA: rows >= length belong to the next sequence.
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, HEAD_DIM)
        offs = (start + rows).to(tl.int64)[:, None] * stride_t + (head * HEAD_DIM + cols)[None, :]
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=(rows < length)[:, None])

    @triton.jit
    def _tlx_block_attn_fwd(
        desc_q, desc_k, desc_v, desc_cos, desc_sin,
        out_ptr, block_start_ptr, block_len_ptr,
        num_items, H, stride_t, sm_scale,
        HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
        NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
    ):
        BLOCK: tl.constexpr = 64
        HALF: tl.constexpr = HEAD_DIM // 2
        dtype: tl.constexpr = tlx.dtype_of(desc_q)
        TILE_BYTES: tl.constexpr = BLOCK * HEAD_DIM * tlx.size_of(dtype)
        if ROTARY:
            SLOT_BYTES: tl.constexpr = 3 * TILE_BYTES + 2 * BLOCK * HALF * 4
        else:
            SLOT_BYTES: tl.constexpr = 3 * TILE_BYTES
        tl.static_assert(NUM_STAGES % NUM_CONSUMERS == 0)

        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_local = (num_items - pid + nprog - 1) // nprog

        q_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        k_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        v_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        if ROTARY:
            cos_bufs = tlx.local_alloc((BLOCK, HALF), tl.float32, NUM_STAGES)
            sin_bufs = tlx.local_alloc((BLOCK, HALF), tl.float32, NUM_STAGES)
        fulls = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
        empties = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                for j in range(0, n_local):
                    head, start, length = _item_coords(pid + j * nprog, H, block_start_ptr, block_len_ptr)
                    slot = j % NUM_STAGES
                    phase = (j // NUM_STAGES) & 1
                    # Fresh barriers sit in phase 0, so waiting for parity 1 passes on the first lap.
                    tlx.barrier_wait(empties[slot], phase ^ 1)
                    tlx.barrier_expect_bytes(fulls[slot], SLOT_BYTES)
                    tlx.async_descriptor_load(desc_q, q_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
                    tlx.async_descriptor_load(desc_k, k_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
                    tlx.async_descriptor_load(desc_v, v_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
                    if ROTARY:
                        tlx.async_descriptor_load(desc_cos, cos_bufs[slot], [start, 0], fulls[slot])
                        tlx.async_descriptor_load(desc_sin, sin_bufs[slot], [start, 0], fulls[slot])

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
                cols = tl.arange(0, BLOCK)
                for j in range(cid, n_local, NUM_CONSUMERS):
                    head, start, length = _item_coords(pid + j * nprog, H, block_start_ptr, block_len_ptr)
                    slot = j % NUM_STAGES
                    phase = (j // NUM_STAGES) & 1
                    tlx.barrier_wait(fulls[slot], phase)
                    if ROTARY:
                        c = tlx.local_load(cos_bufs[slot])
                        s = tlx.local_load(sin_bufs[slot])
                        # Rotated q feeds wgmma from registers; rotated k (and v) must be B operands,
                        # so they overwrite their own slot, fenced before the async proxy reads them.
                        q_rot = _rope(tlx.local_load(q_bufs[slot]), c, s, BLOCK, HEAD_DIM, False).to(dtype)
                        k_rot = _rope(tlx.local_load(k_bufs[slot]), c, s, BLOCK, HEAD_DIM, False).to(dtype)
                        tlx.local_store(k_bufs[slot], k_rot)
                        if ROTATE_V:
                            v_rot = _rope(tlx.local_load(v_bufs[slot]), c, s, BLOCK, HEAD_DIM, False).to(dtype)
                            tlx.local_store(v_bufs[slot], v_rot)
                        tlx.fence_async_shared()
                        qk = tlx.async_dot(q_rot, tlx.local_trans(k_bufs[slot]))
                    else:
                        qk = tlx.async_dot(q_bufs[slot], tlx.local_trans(k_bufs[slot]))
                    qk = tlx.async_dot_wait(0, qk)

                    qk = tl.where((cols < length)[None, :], qk * qk_scale, float("-inf"))
                    m = tl.max(qk, 1)  # finite: length >= 1, so every row sees a real key
                    p = tl.math.exp2(qk - m[:, None])
                    l = tl.sum(p, 1)
                    acc = tlx.async_dot(p.to(dtype), v_bufs[slot])
                    acc = tlx.async_dot_wait(0, acc)
                    tlx.barrier_arrive(empties[slot], 1)
                    acc = acc / l[:, None]
                    _store_tile(out_ptr, acc, start, length, head, stride_t, BLOCK, HEAD_DIM)

    @triton.jit
    def _tlx_block_attn_bwd(
        desc_q, desc_k, desc_v, desc_do, desc_cos, desc_sin,
        dq_ptr, dk_ptr, dv_ptr, block_start_ptr, block_len_ptr,
        num_items, H, stride_t, sm_scale,
        HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
        NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
    ):
        BLOCK: tl.constexpr = 64
        HALF: tl.constexpr = HEAD_DIM // 2
        dtype: tl.constexpr = tlx.dtype_of(desc_q)
        TILE_BYTES: tl.constexpr = BLOCK * HEAD_DIM * tlx.size_of(dtype)
        if ROTARY:
            SLOT_BYTES: tl.constexpr = 4 * TILE_BYTES + 2 * BLOCK * HALF * 4
        else:
            SLOT_BYTES: tl.constexpr = 4 * TILE_BYTES
        tl.static_assert(NUM_STAGES % NUM_CONSUMERS == 0)

        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_local = (num_items - pid + nprog - 1) // nprog

        q_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        k_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        v_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        do_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        if ROTARY:
            cos_bufs = tlx.local_alloc((BLOCK, HALF), tl.float32, NUM_STAGES)
            sin_bufs = tlx.local_alloc((BLOCK, HALF), tl.float32, NUM_STAGES)
        # wgmma's A operand is read row-major from SMEM, so P^T and dS^T are written transposed.
        pT_bufs = tlx.local_alloc((BLOCK, BLOCK), dtype, NUM_CONSUMERS)
        dsT_bufs = tlx.local_alloc((BLOCK, BLOCK), dtype, NUM_CONSUMERS)
        fulls = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)
        empties = tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                for j in range(0, n_local):
                    head, start, length = _item_coords(pid + j * nprog, H, block_start_ptr, block_len_ptr)
                    slot = j % NUM_STAGES
                    phase = (j // NUM_STAGES) & 1
                    tlx.barrier_wait(empties[slot], phase ^ 1)
                    tlx.barrier_expect_bytes(fulls[slot], SLOT_BYTES)
                    tlx.async_descriptor_load(desc_q, q_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
                    tlx.async_descriptor_load(desc_k, k_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
                    tlx.async_descriptor_load(desc_v, v_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
                    tlx.async_descriptor_load(desc_do, do_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
                    if ROTARY:
                        tlx.async_descriptor_load(desc_cos, cos_bufs[slot], [start, 0], fulls[slot])
                        tlx.async_descriptor_load(desc_sin, sin_bufs[slot], [start, 0], fulls[slot])

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                qk_scale = sm_scale * 1.4426950408889634
                idx = tl.arange(0, BLOCK)
                pT_buf = pT_bufs[cid]
                dsT_buf = dsT_bufs[cid]
                for j in range(cid, n_local, NUM_CONSUMERS):
                    head, start, length = _item_coords(pid + j * nprog, H, block_start_ptr, block_len_ptr)
                    slot = j % NUM_STAGES
                    phase = (j // NUM_STAGES) & 1
                    tlx.barrier_wait(fulls[slot], phase)
                    q_s = q_bufs[slot]
                    k_s = k_bufs[slot]
                    v_s = v_bufs[slot]
                    do_s = do_bufs[slot]
                    if ROTARY:
                        # Rotated q, k (and v) are operands of several products (B of dK and dQ,
                        # B^T of S and dP), so they replace the raw tiles in the slot.
                        c = tlx.local_load(cos_bufs[slot])
                        s = tlx.local_load(sin_bufs[slot])
                        q_rot = _rope(tlx.local_load(q_s), c, s, BLOCK, HEAD_DIM, False).to(dtype)
                        k_rot = _rope(tlx.local_load(k_s), c, s, BLOCK, HEAD_DIM, False).to(dtype)
                        tlx.local_store(q_s, q_rot)
                        tlx.local_store(k_s, k_rot)
                        if ROTATE_V:
                            v_rot = _rope(tlx.local_load(v_s), c, s, BLOCK, HEAD_DIM, False).to(dtype)
                            tlx.local_store(v_s, v_rot)
                        tlx.fence_async_shared()

                    qk = tlx.async_dot(q_s, tlx.local_trans(k_s))
                    qk = tlx.async_dot_wait(0, qk)
                    key_ok = (idx < length)[None, :]
                    # Rows >= length hold another sequence's q/dO: zero them in P and dS so they
                    # contribute nothing to dV = P^T dO and dK = dS^T Q.
                    valid = (idx < length)[:, None] & key_ok
                    qk = tl.where(key_ok, qk * qk_scale, float("-inf"))
                    m = tl.max(qk, 1)
                    p = tl.math.exp2(qk - m[:, None])
                    p = p / tl.sum(p, 1)[:, None]
                    p = tl.where(valid, p, 0.0)

                    dp = tlx.async_dot(do_s, tlx.local_trans(v_s))
                    dp = tlx.async_dot_wait(0, dp)
                    di = tl.sum(p * dp, 1)
                    ds = tl.where(valid, p * (dp - di[:, None]) * sm_scale, 0.0)
                    ds_lp = ds.to(dtype)

                    tlx.local_store(pT_buf, tl.trans(p.to(dtype)))
                    tlx.local_store(dsT_buf, tl.trans(ds_lp))
                    tlx.fence_async_shared()

                    dv = tlx.async_dot(pT_buf, do_s)
                    dv = tlx.async_dot_wait(0, dv)
                    if ROTARY and ROTATE_V:
                        c = tlx.local_load(cos_bufs[slot])
                        s = tlx.local_load(sin_bufs[slot])
                        dv = _rope(dv, c, s, BLOCK, HEAD_DIM, True)
                    _store_tile(dv_ptr, dv, start, length, head, stride_t, BLOCK, HEAD_DIM)

                    dk = tlx.async_dot(dsT_buf, q_s)
                    dk = tlx.async_dot_wait(0, dk)
                    if ROTARY:
                        c = tlx.local_load(cos_bufs[slot])
                        s = tlx.local_load(sin_bufs[slot])
                        dk = _rope(dk, c, s, BLOCK, HEAD_DIM, True)
                    _store_tile(dk_ptr, dk, start, length, head, stride_t, BLOCK, HEAD_DIM)

                    dq = tlx.async_dot(ds_lp, k_s)
                    dq = tlx.async_dot_wait(0, dq)
                    if ROTARY:
                        c = tlx.local_load(cos_bufs[slot])
                        s = tlx.local_load(sin_bufs[slot])
                        dq = _rope(dq, c, s, BLOCK, HEAD_DIM, True)
                    # Last read of the slot (cos/sin included): hand it back to the producer.
                    tlx.barrier_arrive(empties[slot], 1)
                    _store_tile(dq_ptr, dq, start, length, head, stride_t, BLOCK, HEAD_DIM)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def tlx_unsupported_reason(q: torch.Tensor, cos: torch.Tensor | None = None) -> str | None:
    """Why the TLX backend can't run this case, or None if it can."""
    if not HAS_TLX:
        return (
            "TLX is not installed: `pip uninstall -y triton && pip install fbtriton==3.7.4` "
            "(or `pip install triton-utlx` on Triton 3.8)"
        )
    if q.device.type != "cuda":
        return f"device {q.device} (TLX kernels need a CUDA sm_90 GPU)"
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        return f"compute capability sm_{major}{minor} (the TLX kernels are written for Hopper sm_90)"
    if q.dim() != 3 or q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (TLX kernels take {SUPPORTED_HEAD_DIMS})"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (TLX kernels take float16 or bfloat16)"
    if cos is not None and cos.dtype != torch.float32:
        return f"rotary table dtype {cos.dtype} (TLX kernels take float32 cos/sin)"
    return None


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def _tma_ready(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Contiguous, 16-byte aligned, and at least one block tall (a TMA box may not exceed the
    tensor it tiles; padded rows are zeros and never stored back)."""
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    if x.shape[0] < rows:
        pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
        x = torch.cat([x, pad])
    return x


def _desc_2d(x: torch.Tensor, block_cols: int):
    x2 = x.reshape(x.shape[0], -1)
    return TensorDescriptor(x2, shape=list(x2.shape), strides=[x2.shape[1], 1], block_shape=[BLOCK_SIZE, block_cols])


def _rotary_descs(cos, sin, head_dim):
    if cos is None:
        return None, None
    cos = _tma_ready(cos.float(), BLOCK_SIZE)
    sin = _tma_ready(sin.float(), BLOCK_SIZE)
    return _desc_2d(cos, head_dim // 2), _desc_2d(sin, head_dim // 2)


def _launch_common(q, offsets):
    total_tokens, heads, head_dim = q.shape
    block_start, block_len = block_table(offsets)
    num_items = block_start.numel() * heads
    grid = (max(1, min(_num_sms(q.device), num_items)),)
    return total_tokens, heads, head_dim, block_start, block_len, num_items, grid


def _check_inputs(q, k, v, offsets, cos, sin):
    reason = tlx_unsupported_reason(q, cos)
    if reason is not None:
        raise RuntimeError(f"block_attention_tlx cannot run: {reason}")
    if k.shape != q.shape or v.shape != q.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("q, k, v must share shape [T, H, D] and dtype")
    if offsets.dtype != torch.int32 or offsets.device != q.device:
        raise ValueError("offsets must be int32 on the inputs' device")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if cos is not None and tuple(cos.shape) != (q.shape[0], q.shape[2] // 2):
        raise ValueError(f"cos/sin must be [T, D/2] = {(q.shape[0], q.shape[2] // 2)}, got {tuple(cos.shape)}")


def _tlx_forward_impl(q, k, v, offsets, cos, sin, rotate_v):
    _check_inputs(q, k, v, offsets, cos, sin)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return out
    with torch.cuda.device(q.device):
        T, H, D, block_start, block_len, num_items, grid = _launch_common(q, offsets)
        if num_items == 0:
            return out
        rotary = cos is not None
        cfg = tlx_config(D, rotary, backward=False)
        descs = [_desc_2d(_tma_ready(x, BLOCK_SIZE), D) for x in (q, k, v)]
        desc_cos, desc_sin = _rotary_descs(cos, sin, D)
        _tlx_block_attn_fwd[grid](
            *descs, desc_cos, desc_sin, out, block_start, block_len,
            num_items, H, H * D, 1.0 / math.sqrt(D),
            HEAD_DIM=D, ROTARY=rotary, ROTATE_V=bool(rotate_v and rotary),
            CONSUMER_REGS=_consumer_regs(cfg["NUM_CONSUMERS"]), num_warps=4, num_stages=1, **cfg,
        )
    return out


def _tlx_backward_impl(grad_out, q, k, v, offsets, cos, sin, rotate_v):
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return dq, dk, dv
    with torch.cuda.device(q.device):
        T, H, D, block_start, block_len, num_items, grid = _launch_common(q, offsets)
        if num_items == 0:
            return dq, dk, dv
        rotary = cos is not None
        cfg = tlx_config(D, rotary, backward=True)
        descs = [_desc_2d(_tma_ready(x, BLOCK_SIZE), D) for x in (q, k, v, grad_out.to(q.dtype))]
        desc_cos, desc_sin = _rotary_descs(cos, sin, D)
        _tlx_block_attn_bwd[grid](
            *descs, desc_cos, desc_sin, dq, dk, dv, block_start, block_len,
            num_items, H, H * D, 1.0 / math.sqrt(D),
            HEAD_DIM=D, ROTARY=rotary, ROTATE_V=bool(rotate_v and rotary),
            CONSUMER_REGS=_consumer_regs(cfg["NUM_CONSUMERS"]), num_warps=4, num_stages=1, **cfg,
        )
    return dq, dk, dv


@torch.library.custom_op("block_attention::tlx_fwd", mutates_args=())
def _tlx_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotate_v: bool,
) -> torch.Tensor:
    return _tlx_forward_impl(q, k, v, offsets, cos, sin, rotate_v)


@_tlx_fwd_op.register_fake
def _(q, k, v, offsets, cos, sin, rotate_v):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("block_attention::tlx_bwd", mutates_args=())
def _tlx_bwd_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotate_v: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tlx_backward_impl(grad_out, q, k, v, offsets, cos, sin, rotate_v)


@_tlx_bwd_op.register_fake
def _(grad_out, q, k, v, offsets, cos, sin, rotate_v):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, offsets, cos, sin, rotate_v = inputs
    ctx.save_for_backward(q, k, v, offsets, cos, sin)
    ctx.rotate_v = rotate_v


def _backward(ctx, grad_out):
    q, k, v, offsets, cos, sin = ctx.saved_tensors
    dq, dk, dv = _tlx_bwd_op(grad_out.contiguous(), q, k, v, offsets, cos, sin, ctx.rotate_v)
    # No gradient for the rotary tables (they are position functions, not parameters).
    return dq, dk, dv, None, None, None, None


_tlx_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def block_attention_tlx(q, k, v, offsets, cos=None, sin=None, rotate_v=False):
    """Block attention (64-token blocks, non-causal, scale 1/sqrt(D)) with fused interleaved rotary
    on q, k (and v when rotate_v; the output is then not un-rotated). Hopper + TLX only."""
    return _tlx_fwd_op(q.contiguous(), k.contiguous(), v.contiguous(), offsets, cos, sin, bool(rotate_v))
