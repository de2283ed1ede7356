"""TLX (Meta's Triton fork) warp-specialized block attention for Hopper (sm_90), fwd + bwd.

Invariants every kernel here relies on:
- q, k, v, grad_out (and the outputs) are contiguous [T, H, D] in fp16/bf16; viewed as 2-D
  [T, H*D] for TMA, so a (64-token block, head) tile is the box [64, D] at (start, h*D).
- D is 64 or 128 (one wgmma N/K tile, TMA row of 128/256 bytes, D/2 rotary pairs).
- cos/sin are contiguous fp32 [T, D/2]; the producer loads an item's [64, D/2] boxes by TMA into
  its ring slot with the 16-bit tiles, so they are prefetched with them (on the H200 the rotary
  passes ran faster than with consumers loading them into registers:
  benchmarks/results/sweep_tlx_rotary_h200.log).
- A block is BLOCK=64 tokens from its sequence's start (kernels.blocks.block_table); only the last
  block of a sequence is partial (len in 1..64). Its TMA tile runs into the next sequence (or TMA's
  zero fill past T): keys >= len are masked out of the softmax, query rows >= len are zeroed out
  of every gradient product, and a partial block is stored by a masked tl.store, so nothing
  outside the block is read into a result or written. Only full blocks may be stored by TMA.
- The block table has a fixed number of rows (sync-free); the real blocks come first and
  num_blocks (a device scalar every partition reads) says how many, so unused rows cost nothing.
- Work item = (block, head); a persistent grid of min(#SMs, #rows * H) programs walks items
  pid, pid + nprog, ... below num_blocks * H. One producer warpgroup streams the item's tiles
  through a NUM_STAGES ring of SMEM slots (full/empty mbarrier pair per slot); NUM_CONSUMERS
  consumer warpgroups take items round-robin (item j -> consumer j % NUM_CONSUMERS, slot j % NUM_STAGES). NUM_STAGES is a
  multiple of NUM_CONSUMERS, so each slot always has the same single consumer (empty arrive count 1).
- One 64x64 score tile per item: exact softmax, no running max, no LSE saved; the backward
  recomputes P and gets Di = rowsum(P * dP) from registers; dQ = dS K takes dS as a bf16 hi + lo pair
  (fp32-accurate). No atomics: each item owns its block's
  rows of dq/dk/dv, so gradients are deterministic.
"""

import functools
import itertools
import math

import torch

try:
    import triton
    import triton.language as tl
    import triton.language.extra.tlx as tlx
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .block_attention_triton import rotate_pairs  # one rotary tile helper for both kernels

    HAS_TLX = True
    # Triton 3.8's layouts put a conversion between the rotated pairs' join and the reshape that
    # fbtriton 3.7 fuses away (smem_bytes).
    _ROTARY_JOIN_SCRATCH = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)
except ImportError:  # plain triton (no extra.tlx) or no triton at all
    HAS_TLX = False
    _ROTARY_JOIN_SCRATCH = False

from .backend import Backend, gradient_outputs, kernel_ops, launch_overrides
from .blocks import BLOCK_SIZE

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Largest dynamic shared memory an sm_90 block may opt into (227 KiB).
SM90_MAX_SMEM = 232448
# Left free for what the compiler adds beyond our buffers (mbarriers, alignment padding).
SMEM_SLACK = 1024


def fits_sm90(nbytes: int) -> bool:
    """Whether a program modelled at nbytes of shared memory fits an sm_90 block, with SMEM_SLACK kept free."""
    return nbytes + SMEM_SLACK <= SM90_MAX_SMEM


# More slots than this stop helping: 8 items in flight per SM already cover HBM latency.
MAX_STAGES = 8

# Tuning knobs, per direction. Defaults are chosen in tlx_config; a sweep overrides them through
# block_attention(..., launch={"fwd": {...}, "bwd": {...}}). A value may be an int/bool or a
# {head_dim: value} dict.
FWD_KNOBS = ("NUM_STAGES", "NUM_CONSUMERS", "O_TMA_STORE")
BWD_KNOBS = ("NUM_STAGES", "NUM_CONSUMERS", "SHARED_T_TILE")
# Layout knobs tlx_config picks by ring depth when not given: the deepest ring up to
# ENOUGH_SLOTS_PER_CONSUMER wins, ties go to the first value listed. The fwd prefers a TMA store
# of O (async, off the consumer's critical path); the bwd prefers separate P^T and dS^T tiles (no
# wait between dV and the dS^T store). H200 (benchmarks/results/sweep_tlx*_h200.log): the two O
# stores timed alike at equal depth; one shared tile was a little slower at D=64 plain (3 slots per
# consumer against 2), but separate tiles were much slower at D=64 rotary (1 slot per consumer)
# and at D=128 rotary (1 consumer).
_DEPTH_CHOSEN = {"fwd": {"O_TMA_STORE": (True, False)}, "bwd": {"SHARED_T_TILE": (False, True)}}
# Ring slots per consumer beyond which depth bought nothing on the H200: 2 and 4 slots per
# consumer timed alike in the fwd, while 1 was slower than 2 in the D=64 bwd
# (benchmarks/results/sweep_tlx_h200.log).
ENOUGH_SLOTS_PER_CONSUMER = 2
# Consumer counts tried in order (the first that fits wins); (2, 1) where not listed. The plain
# D=128 fwd ran faster with one consumer on the H200, while one consumer was slower with rotary and
# at D=64 (benchmarks/results/sweep_tlx_d128_h200.log, sweep_tlx_h200.log).
_CONSUMER_ORDER = {("fwd", 128, False): (1, 2)}
def smem_bytes(head_dim: int, rotary: bool, backward: bool, NUM_STAGES: int, NUM_CONSUMERS: int,
               O_TMA_STORE: bool = False, SHARED_T_TILE: bool = False, elem_size: int = 2) -> int:
    """Shared memory of one program: the ring plus per-consumer tiles and compiler scratch.

    Per slot: fwd q,k,v = 3*64*D*2 B, bwd adds dO; with rotary also the item's fp32 cos/sin
    (2*64*D/2*4 B). Per consumer: the fwd with O_TMA_STORE stages a 64xD tile of O; the bwd
    keeps two 64x64 transposed operand tiles (P^T, dS^T; one with SHARED_T_TILE). Triton adds one
    layout-conversion scratch per consumer for a masked store from registers, 8 KiB (measured on the AOT builds;
    tests/test_tlx_aot.py holds this model to them), which the fwd's O staging tile replaces;
    Triton 3.8 (triton-utlx) also needs 4 KiB of it for the fwd's rotary, to reshape the joined pairs.
    """
    tile = BLOCK_SIZE * head_dim * elem_size
    rotary_tiles = 2 * BLOCK_SIZE * (head_dim // 2) * 4 if rotary else 0
    slot = (4 if backward else 3) * tile + rotary_tiles
    if backward:
        t_tiles = 1 if SHARED_T_TILE else 2
        per_consumer = t_tiles * BLOCK_SIZE * BLOCK_SIZE * elem_size + 8192
    else:
        scratch = 8192 if not O_TMA_STORE else 4096 if rotary and _ROTARY_JOIN_SCRATCH else 0
        per_consumer = (tile if O_TMA_STORE else 0) + scratch
    return NUM_STAGES * slot + NUM_CONSUMERS * per_consumer


def config_smem_bytes(head_dim: int, rotary: bool, backward: bool, cfg: dict) -> int:
    """smem_bytes of a tlx_config result."""
    layout = {k: cfg[k] for k in ("O_TMA_STORE", "SHARED_T_TILE") if k in cfg}
    return smem_bytes(head_dim, rotary, backward, cfg["NUM_STAGES"], cfg["NUM_CONSUMERS"], **layout)


def _resolve_knob(value, head_dim: int):
    return value[head_dim] if isinstance(value, dict) else value


def tlx_config(head_dim: int, rotary: bool, backward: bool, overrides: dict | None = None) -> dict:
    """Constexpr knobs of one kernel shape: the overrides (FWD_KNOBS / BWD_KNOBS) on top of the defaults.

    Defaults: two consumer warpgroups (one's softmax runs while the other's wgmma does) where two
    fit, else one; the layout knobs of _DEPTH_CHOSEN by ring depth; NUM_STAGES as deep as fits in
    227 KiB, as a multiple of NUM_CONSUMERS, at most MAX_STAGES.
    """
    direction = "bwd" if backward else "fwd"
    overrides = overrides or {}
    allowed = BWD_KNOBS if backward else FWD_KNOBS
    unknown = set(overrides) - set(allowed)
    if unknown:
        raise ValueError(f"unknown TLX {direction} tuning knobs {sorted(unknown)}; choose from {allowed}")
    knobs = tuple(sorted((k, _resolve_knob(v, head_dim)) for k, v in overrides.items()))
    # A copy: callers may add to it.
    return dict(_cached_config(head_dim, rotary, backward, knobs))


@functools.lru_cache(maxsize=None)
def _cached_config(head_dim: int, rotary: bool, backward: bool, knob_items: tuple) -> dict:
    direction = "bwd" if backward else "fwd"
    knobs = dict(knob_items)

    def fits(stages: int, consumers: int, layout: dict) -> bool:
        return fits_sm90(smem_bytes(head_dim, rotary, backward, stages, consumers, **layout))

    def deepest_ring(consumers: int, layout: dict) -> int:
        # The deepest fitting ring, 0 if not even one slot per consumer fits, or the one asked for.
        if knobs.get("NUM_STAGES") is not None:
            return knobs["NUM_STAGES"]
        stages = 0
        while stages + consumers <= MAX_STAGES and fits(stages + consumers, consumers, layout):
            stages += consumers
        return stages

    choices = [dict(zip(_DEPTH_CHOSEN[direction], values)) for values in itertools.product(
        *[[knobs[k]] if k in knobs else v for k, v in _DEPTH_CHOSEN[direction].items()])]
    for consumers in [knobs["NUM_CONSUMERS"]] if "NUM_CONSUMERS" in knobs else _CONSUMER_ORDER.get(
            (direction, head_dim, rotary), (2, 1)):
        # max() keeps the first of equally good layouts: the preferred one.
        layout = max(choices, key=lambda c: min(deepest_ring(consumers, c), ENOUGH_SLOTS_PER_CONSUMER * consumers))
        stages = deepest_ring(consumers, layout)
        if stages and fits(stages, consumers, layout):
            break
    cfg = dict(NUM_CONSUMERS=consumers, NUM_STAGES=stages, **{k: bool(v) for k, v in layout.items()})
    if consumers not in (1, 2) or stages < 1 or stages % consumers:
        raise ValueError(f"{direction} config {cfg}: NUM_CONSUMERS must be 1 or 2 and NUM_STAGES a positive "
                         "multiple of it (each slot must always go to the same consumer)")
    if not fits(stages, consumers, layout):
        need = smem_bytes(head_dim, rotary, backward, stages, consumers, **layout)
        raise ValueError(f"{direction} config {cfg} at head_dim {head_dim}{' with rotary' if rotary else ''} needs "
                         f"{need} B of shared memory; sm_90 allows {SM90_MAX_SMEM}")
    cfg["CONSUMER_REGS"] = _consumer_regs(consumers)
    return cfg


def _consumer_regs(num_consumers: int) -> int:
    # setmaxnreg budget: 64K regs/SM over (1 producer + N consumer) warpgroups of 128 threads; the
    # producer only issues TMA and keeps the remainder (>= 24 regs/thread).
    return 232 if num_consumers == 2 else 240


if HAS_TLX:
    # The kernels' tile rows: kernels.blocks' block size, a global constexpr the jitted code may read.
    BLOCK = tl.constexpr(BLOCK_SIZE)

    @triton.jit
    def _num_local_items(num_blocks_ptr, H):
        # Every partition computes the same trip count from the same device scalar, so the
        # producer and consumers agree on which items exist and the barrier phases stay paired.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        num_items = tl.load(num_blocks_ptr).to(tl.int32) * H
        return pid, nprog, tl.maximum((num_items - pid + nprog - 1) // nprog, 0)

    @triton.jit
    def _item_coords(item, H, block_start_ptr, block_len_ptr):
        blk = item // H
        head = item - blk * H
        start = tl.load(block_start_ptr + blk)
        length = tl.load(block_len_ptr + blk)
        return head, start, length

    @triton.jit
    def _alloc_ring(dtype: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr,
                    ROTARY: tl.constexpr, WITH_DO: tl.constexpr):
        """The ring both kernels stream items through: NUM_STAGES slots of 64-token q, k, v tiles (and
        dO, the backward's, WITH_DO), with ROTARY the fp32 cos/sin rows, and each slot's full and empty
        barrier. The tiles a kernel doesn't use are None: returned as constexprs, since a variable
        assigned None can't be returned. NUM_STAGES is a multiple of NUM_CONSUMERS, so each slot
        always goes to the same consumer."""
        tl.static_assert(NUM_STAGES % NUM_CONSUMERS == 0)
        HALF: tl.constexpr = HEAD_DIM // 2
        q_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        k_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        v_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES)
        return (
            q_bufs, k_bufs, v_bufs,
            tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_STAGES) if WITH_DO else tl.constexpr(None),
            # In the backward, the item's cos/sin serve the rotations of q, k (and v) and, read
            # again from the slot, the epilogues of dQ, dK (and dV).
            tlx.local_alloc((BLOCK, HALF), tl.float32, NUM_STAGES) if ROTARY else tl.constexpr(None),
            tlx.local_alloc((BLOCK, HALF), tl.float32, NUM_STAGES) if ROTARY else tl.constexpr(None),
            tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1),
            tlx.alloc_barriers(num_barriers=NUM_STAGES, arrive_count=1),
        )

    @triton.jit
    def _load_items(desc_q, desc_k, desc_v, desc_do, desc_cos, desc_sin, q_bufs, k_bufs, v_bufs, do_bufs, cos_bufs,
                    sin_bufs, fulls, empties, block_start_ptr, block_len_ptr, num_blocks_ptr, H,
                    NUM_STAGES: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr):
        """The producer partition: item j of this program waits for ring slot j % NUM_STAGES to be
        free, then TMA-loads its q, k, v tiles, its dO tile (the backward's: do_bufs is None in the
        forward) and, with ROTARY, its cos/sin rows into the slot, whose full barrier expects them all."""
        TILE_BYTES: tl.constexpr = BLOCK * HEAD_DIM * tlx.size_of(tlx.dtype_of(desc_q))
        SLOT_BYTES: tl.constexpr = (3 + (do_bufs is not None)) * TILE_BYTES + (BLOCK * HEAD_DIM * 4 if ROTARY else 0)
        pid, nprog, n_local = _num_local_items(num_blocks_ptr, H)
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
            if do_bufs is not None:
                tlx.async_descriptor_load(desc_do, do_bufs[slot], [start, head * HEAD_DIM], fulls[slot])
            if ROTARY:
                tlx.async_descriptor_load(desc_cos, cos_bufs[slot], [start, 0], fulls[slot])
                tlx.async_descriptor_load(desc_sin, sin_bufs[slot], [start, 0], fulls[slot])

    @triton.jit
    def _next_item(j, pid, nprog, H, block_start_ptr, block_len_ptr, fulls, NUM_STAGES: tl.constexpr):
        """A consumer's item j of this program: its head, start and length, and its ring slot, once
        the producer has filled it."""
        head, start, length = _item_coords(pid + j * nprog, H, block_start_ptr, block_len_ptr)
        slot = j % NUM_STAGES
        tlx.barrier_wait(fulls[slot], (j // NUM_STAGES) & 1)
        return head, start, length, slot

    @triton.jit
    def _rotate_in_place(buf, cos, sin, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
        # fp32 math, one rounding back to the tile's 16-bit dtype (as the reference does).
        x = tlx.local_load(buf)
        tlx.local_store(buf, rotate_pairs(x.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(x.dtype))

    @triton.jit
    def _store_tile(ptr, x, start, length, head, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
        # Masked, not TMA: rows >= length belong to the next sequence.
        rows = tl.arange(0, BLOCK)
        cols = tl.arange(0, HEAD_DIM)
        offs = (start + rows).to(tl.int64)[:, None] * stride_t + (head * HEAD_DIM + cols)[None, :]
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=(rows < length)[:, None])

    @triton.jit
    def _tlx_block_attn_fwd(
        desc_q, desc_k, desc_v, desc_o, desc_cos, desc_sin,
        out_ptr, block_start_ptr, block_len_ptr, num_blocks_ptr,
        H, stride_t, sm_scale,
        HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
        NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
        O_TMA_STORE: tl.constexpr,
    ):
        dtype: tl.constexpr = tlx.dtype_of(desc_q)
        q_bufs, k_bufs, v_bufs, _, cos_bufs, sin_bufs, fulls, empties = _alloc_ring(
            dtype, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, ROTARY, False)
        if O_TMA_STORE:
            # Per-consumer staging of O, outside the ring so a slot is released right after PV
            # instead of after the TMA engine has read O out of it.
            o_bufs = tlx.local_alloc((BLOCK, HEAD_DIM), dtype, NUM_CONSUMERS)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                _load_items(desc_q, desc_k, desc_v, None, desc_cos, desc_sin, q_bufs, k_bufs, v_bufs, None, cos_bufs,
                            sin_bufs, fulls, empties, block_start_ptr, block_len_ptr, num_blocks_ptr, H, NUM_STAGES,
                            HEAD_DIM, ROTARY)

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
                cols = tl.arange(0, BLOCK)
                pid, nprog, n_local = _num_local_items(num_blocks_ptr, H)
                for j in range(cid, n_local, NUM_CONSUMERS):
                    head, start, length, slot = _next_item(j, pid, nprog, H, block_start_ptr, block_len_ptr, fulls,
                                                           NUM_STAGES)
                    if ROTARY:
                        c = tlx.local_load(cos_bufs[slot])
                        s = tlx.local_load(sin_bufs[slot])
                        # wgmma reads its B operands (k, v) from SMEM, and a register A operand would
                        # go through a conversion scratch tile: the rotated tiles overwrite their
                        # own slot, fenced before the async proxy reads them.
                        _rotate_in_place(q_bufs[slot], c, s, BLOCK, HEAD_DIM)
                        _rotate_in_place(k_bufs[slot], c, s, BLOCK, HEAD_DIM)
                        if ROTATE_V:
                            _rotate_in_place(v_bufs[slot], c, s, BLOCK, HEAD_DIM)
                        tlx.fence_async_shared()
                    qk = tlx.async_dot(q_bufs[slot], tlx.local_trans(k_bufs[slot]))
                    qk = tlx.async_dot_wait(0, qk)

                    qk = tl.where((cols < length)[None, :], qk * qk_scale, float("-inf"))
                    m = tl.max(qk, 1)  # finite: length >= 1, so every row sees a real key
                    p = tl.math.exp2(qk - m[:, None])
                    l = tl.sum(p, 1)
                    acc = tlx.async_dot(p.to(dtype), v_bufs[slot])
                    acc = tlx.async_dot_wait(0, acc)
                    tlx.barrier_arrive(empties[slot], 1)
                    acc = acc * (1.0 / l)[:, None]  # 64 reciprocals, not 64x128 divisions
                    if O_TMA_STORE:
                        # The previous item's store must have read the staging tile first.
                        tlx.async_descriptor_store_wait(0)
                        tlx.local_store(o_bufs[cid], acc.to(dtype))
                        if length == BLOCK:
                            tlx.fence_async_shared()
                            tlx.async_descriptor_store(desc_o, o_bufs[cid], [start, head * HEAD_DIM])
                        else:
                            # Reading O back from the staging tile is the register-layout change a
                            # coalesced masked store needs, without a second 16 KiB scratch tile.
                            o = tlx.local_load(o_bufs[cid])
                            _store_tile(out_ptr, o, start, length, head, stride_t, BLOCK, HEAD_DIM)
                    else:
                        _store_tile(out_ptr, acc, start, length, head, stride_t, BLOCK, HEAD_DIM)
                if O_TMA_STORE:
                    # SMEM must outlive the last store's read of it.
                    tlx.async_descriptor_store_wait(0)

    @triton.jit
    def _tlx_block_attn_bwd(
        desc_q, desc_k, desc_v, desc_do, desc_cos, desc_sin,
        dq_ptr, dk_ptr, dv_ptr, block_start_ptr, block_len_ptr, num_blocks_ptr,
        H, stride_t, sm_scale,
        HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
        NUM_STAGES: tl.constexpr, NUM_CONSUMERS: tl.constexpr, CONSUMER_REGS: tl.constexpr,
        SHARED_T_TILE: tl.constexpr,
    ):
        dtype: tl.constexpr = tlx.dtype_of(desc_q)
        # wgmma's A operand is read row-major from SMEM, so P^T and dS^T are written transposed,
        # each into its own tile or, with SHARED_T_TILE, one after the other into one tile.
        T_TILES: tl.constexpr = 1 if SHARED_T_TILE else 2
        t_bufs = tlx.local_alloc((BLOCK, BLOCK), dtype, NUM_CONSUMERS * T_TILES)
        q_bufs, k_bufs, v_bufs, do_bufs, cos_bufs, sin_bufs, fulls, empties = _alloc_ring(
            dtype, HEAD_DIM, NUM_STAGES, NUM_CONSUMERS, ROTARY, True)

        with tlx.async_tasks():
            with tlx.async_task("default"):
                _load_items(desc_q, desc_k, desc_v, desc_do, desc_cos, desc_sin, q_bufs, k_bufs, v_bufs, do_bufs,
                            cos_bufs, sin_bufs, fulls, empties, block_start_ptr, block_len_ptr, num_blocks_ptr, H,
                            NUM_STAGES, HEAD_DIM, ROTARY)

            with tlx.async_task(num_warps=4, registers=CONSUMER_REGS, replicate=NUM_CONSUMERS):
                cid: tl.constexpr = tlx.async_task_replica_id()
                qk_scale = sm_scale * 1.4426950408889634
                idx = tl.arange(0, BLOCK)
                pT_buf = t_bufs[cid * T_TILES]
                dsT_buf = t_bufs[cid * T_TILES + T_TILES - 1]
                pid, nprog, n_local = _num_local_items(num_blocks_ptr, H)
                for j in range(cid, n_local, NUM_CONSUMERS):
                    head, start, length, slot = _next_item(j, pid, nprog, H, block_start_ptr, block_len_ptr, fulls,
                                                           NUM_STAGES)
                    row_ok = idx < length
                    q_s = q_bufs[slot]
                    k_s = k_bufs[slot]
                    v_s = v_bufs[slot]
                    do_s = do_bufs[slot]
                    if ROTARY:
                        cos_buf = cos_bufs[slot]
                        sin_buf = sin_bufs[slot]
                        c = tlx.local_load(cos_buf)
                        s = tlx.local_load(sin_buf)
                        # Rotated q, k (and v) are operands of several products (B of dK and dQ,
                        # B^T of S and dP), so they replace the raw tiles in the slot.
                        _rotate_in_place(q_s, c, s, BLOCK, HEAD_DIM)
                        _rotate_in_place(k_s, c, s, BLOCK, HEAD_DIM)
                        if ROTATE_V:
                            _rotate_in_place(v_s, c, s, BLOCK, HEAD_DIM)
                        tlx.fence_async_shared()

                    qk = tlx.async_dot(q_s, tlx.local_trans(k_s))
                    qk = tlx.async_dot_wait(0, qk)
                    key_ok = row_ok[None, :]
                    # Rows >= length hold another sequence's q/dO: zero them in P and dS so they
                    # contribute nothing to dV = P^T dO and dK = dS^T Q.
                    valid = row_ok[:, None] & key_ok
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
                    # dS = hi + lo in two 16-bit tiles: dQ = hi K + lo K (fp32 accumulation) keeps
                    # dS's fp32 precision, so dQ's error is little more than its one rounding to
                    # bf16 (FA2 rounds dS once before dQ = dS K). The extra wgmma is free here.
                    ds_lo = (ds - ds_lp.to(tl.float32)).to(dtype)

                    tlx.local_store(pT_buf, tl.trans(p.to(dtype)))
                    if not SHARED_T_TILE:
                        tlx.local_store(dsT_buf, tl.trans(ds_lp))
                    tlx.fence_async_shared()

                    # dQ first, so the lo tile dies before the other two accumulators are live.
                    dq = tlx.async_dot(ds_lp, k_s)
                    dq = tlx.async_dot(ds_lo, k_s, dq)
                    dq = tlx.async_dot_wait(0, dq)
                    if ROTARY:
                        dq = rotate_pairs(dq, tlx.local_load(cos_buf), tlx.local_load(sin_buf), BLOCK, HEAD_DIM, True)
                    _store_tile(dq_ptr, dq, start, length, head, stride_t, BLOCK, HEAD_DIM)

                    dv = tlx.async_dot(pT_buf, do_s)
                    dv = tlx.async_dot_wait(0, dv)
                    if SHARED_T_TILE:
                        # dV's wgmma has finished reading P^T (waited above): dS^T may take its place.
                        tlx.local_store(dsT_buf, tl.trans(ds_lp))
                        tlx.fence_async_shared()
                    if ROTARY and ROTATE_V:
                        dv = rotate_pairs(dv, tlx.local_load(cos_buf), tlx.local_load(sin_buf), BLOCK, HEAD_DIM, True)
                    _store_tile(dv_ptr, dv, start, length, head, stride_t, BLOCK, HEAD_DIM)

                    dk = tlx.async_dot(dsT_buf, q_s)
                    dk = tlx.async_dot_wait(0, dk)
                    if ROTARY:
                        dk = rotate_pairs(dk, tlx.local_load(cos_buf), tlx.local_load(sin_buf), BLOCK, HEAD_DIM, True)
                    # Last read of the slot: hand it back to the producer.
                    tlx.barrier_arrive(empties[slot], 1)
                    _store_tile(dk_ptr, dk, start, length, head, stride_t, BLOCK, HEAD_DIM)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def tlx_unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"it needs a CUDA GPU, an sm_90 Hopper (H100/H200), and the tensors are on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"it needs an sm_90 Hopper GPU and {torch.cuda.get_device_name(device)} is sm_{major}{minor}"
    if not HAS_TLX:
        return "TLX (triton.language.extra.tlx) is not installed"
    return None


def tlx_unsupported_reason(q: torch.Tensor) -> str | None:
    """Why the TLX backend can't take inputs like q [T, H, D] on an sm_90 GPU, or None if it can."""
    if q.dim() != 3 or q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (TLX kernels take {SUPPORTED_HEAD_DIMS})"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (TLX kernels take float16 or bfloat16)"
    return None


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def _rows_contiguous(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether each x[t] of x [T, ...] is contiguous, from the shape and strides alone (x[0].is_contiguous()
    would make a view per call)."""
    expected = 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# One TensorDescriptor per (dtype, row, pitch, block_cols), validated by Triton and kept without
# its tensor: a call's descriptor is a copy with its own base and row count, skipping the
# validation (__post_init__), which costs more host time than the launch. Nothing it checks
# changes with the base or the row count beyond what _tma_desc ensures: a 16-byte aligned base
# and at least one block of rows.
_VALIDATED_DESCRIPTORS: dict[tuple, "TensorDescriptor"] = {}


def _descriptor(x: torch.Tensor, row: int, pitch: int, block_cols: int) -> "TensorDescriptor":
    """TensorDescriptor(x, shape=[T, row], strides=[pitch, 1], block_shape=[64, block_cols])."""
    key = (x.dtype, row, pitch, block_cols)
    validated = _VALIDATED_DESCRIPTORS.get(key)
    if validated is None:
        validated = TensorDescriptor(x, shape=[x.shape[0], row], strides=[pitch, 1], block_shape=[BLOCK_SIZE, block_cols])
        validated.base = None
        _VALIDATED_DESCRIPTORS[key] = validated
    descriptor = object.__new__(TensorDescriptor)  # no __init__: no __post_init__
    descriptor.__dict__.update(validated.__dict__, base=x, shape=[x.shape[0], row])
    return descriptor


def _tma_desc(x: torch.Tensor, block_cols: int):
    """TMA descriptor of [64, block_cols] boxes over x [T, ...] viewed as 2-D [T, row]. Rows may be
    strided, as q, k and v are when they are views of one packed qkv projection, so those take no
    copy; TMA needs each row's elements contiguous, a 16-byte aligned base and row pitch, and at
    least one block of rows (a box may not exceed the tensor it tiles). Anything else is copied
    (padding rows are zeros and never stored back)."""
    shape, strides = x.shape, x.stride()
    row = math.prod(shape[1:])
    if (not _rows_contiguous(shape, strides) or strides[0] * x.element_size() % 16 or x.data_ptr() % 16
            or shape[0] < BLOCK_SIZE):
        x = x.contiguous()
        if x.data_ptr() % 16:  # a contiguous view at a misaligned offset: only a fresh copy is aligned
            x = x.clone()
        if x.shape[0] < BLOCK_SIZE:
            x = torch.cat([x, x.new_zeros((BLOCK_SIZE - x.shape[0], *x.shape[1:]))])
    return _descriptor(x, row, x.stride(0), block_cols)


def _rotary_descs(cos, sin):
    """TMA descriptors of the cos/sin tables' [64, D/2] boxes, or (None, None) without rotary."""
    if cos is None:
        return None, None
    return tuple(_tma_desc(t, t.shape[1]) for t in (cos, sin))


def _grid(q: torch.Tensor, block_start: torch.Tensor) -> tuple[int]:
    return (max(1, min(_num_sms(q.device), block_start.shape[0] * q.shape[1])),)


@functools.lru_cache(maxsize=None)
def _launch_kwargs(backward: bool, head_dim: int, rotary: bool, rotate_v: bool, launch: str) -> dict:
    """The constexprs and launch options of one kind of call, built once."""
    cfg = tlx_config(head_dim, rotary, backward=backward, overrides=launch_overrides(launch, "bwd" if backward else "fwd"))
    return dict(HEAD_DIM=head_dim, ROTARY=rotary, ROTATE_V=rotate_v and rotary, num_warps=4, num_stages=1, **cfg)


def _launch(kernel, tiles: tuple, outs: tuple, block_start, block_len, num_blocks, cos, sin, rotate_v, launch,
            backward: bool) -> None:
    """Runs `kernel` on the TMA descriptors of `tiles` (q, k, v, then O or dO) and of the rotary
    tables, writing `outs` (O, or dQ, dK, dV: one token stride, each row's heads contiguous)."""
    q = tiles[0]
    T, H, D = q.shape
    kwargs = _launch_kwargs(backward, D, cos is not None, bool(rotate_v), launch)
    with torch.cuda.device(q.device):
        kernel[_grid(q, block_start)](
            *[_tma_desc(x, D) for x in tiles], *_rotary_descs(cos, sin), *outs, block_start, block_len, num_blocks,
            H, outs[0].stride(0), 1.0 / math.sqrt(D), **kwargs,
        )


def _forward(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or q.shape[1] == 0 or block_start.shape[0] == 0:
        return [out]
    # O's descriptor tiles the (padded, if T < 64) output; only full blocks are TMA-stored, and
    # those lie inside [0, T), so the padding is never written.
    _launch(_tlx_block_attn_fwd, (q, k, v, out), (out,), block_start, block_len, num_blocks, cos, sin, rotate_v,
            launch, backward=False)
    return [out]


def _backward(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch, out, into=None):
    dq, dk, dv = gradient_outputs(q, into)
    if q.shape[0] == 0 or q.shape[1] == 0 or block_start.shape[0] == 0:
        return dq, dk, dv
    if grad_out.dtype != q.dtype:
        grad_out = grad_out.to(q.dtype)
    _launch(_tlx_block_attn_bwd, (q, k, v, grad_out), (dq, dk, dv), block_start, block_len, num_blocks, cos, sin,
            rotate_v, launch, backward=True)
    return dq, dk, dv


# The block table comes in built (once per batch), and is saved for the backward by the op's
# autograd, so the backward never rebuilds it.
_run_ops = kernel_ops("tlx", _forward, _backward, packed=True)

HOW_TO_GET = ("run on an sm_90 GPU (H100/H200) with TLX: `pip uninstall -y triton && pip install fbtriton==3.7.4`, "
              "or `pip install triton-utlx==3.8.0.post16` with Triton 3.8 / torch 2.14")
BACKEND = Backend("tlx", HOW_TO_GET, tlx_unavailable_reason, tlx_unsupported_reason, _run_ops, has_launch_settings=True,
                  ops=_run_ops)
