"""Plain-Triton block attention (forward + backward) with fused interleaved rotary.

Invariants the kernels rely on:
- A work item is one (64-token block, head); a block comes from kernels.blocks.block_table, so
  its rows are contiguous tokens of one sequence and only a sequence's last block is partial.
  The table has a fixed, shape-derived size (no host sync); its real rows come first, and the
  kernels read their count (num_blocks, on the device) and never visit the unused rows, so every
  item they process has length >= 1. The table is built once per forward and saved for the backward.
- Each query block sees exactly one key block, so the forward is one QK^T, an exact softmax (no
  running max, no rescaling), one PV, and no logsumexp is kept. The backward recomputes P and
  takes Di = rowsum(P * dP) from registers, so it needs no preprocessing pass.
- Rows >= the block's length are loaded as zeros (masked loads) and never stored: zero q/dO rows
  add nothing to dV = P^T dO or dK = dS^T Q, and keys >= length are -inf before the softmax.
- Each item owns its rows of every output, so dq/dk/dv are written once, without atomics, and are
  bitwise deterministic.
- q, k, v (and dq, dk, dv) share a (token, head) stride pair and a contiguous last dim, so they
  can be separate [T, H, D] tensors or the three views of one packed [T, 3, H, D] buffer.
- Launch settings (grid shape, warps, register cap, loop pipelining) are LaunchConfig knobs of the
  one forward and one backward kernel, not copies of them. With the default one-program-per-item
  grid the loop runs once; a persistent grid walks items pid, pid + nprog, ... Consecutive
  programs take the heads of one block, which sit side by side in memory.
"""

import contextlib
import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .blocks import BLOCK_SIZE, counted_block_table

SUPPORTED_HEAD_DIMS = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# triton.jit decides at decoration time whether kernels run in the CPU interpreter.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Programs the interpreter runs (sequentially); more than one exercises the persistent loop.
_INTERPRETER_PROGRAMS = 3


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def rotate_pairs(x, cos, sin, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INVERSE: tl.constexpr):
    """Interleaved pairs (x[2i], x[2i+1]) of fp32 x [BLOCK, D] rotated by (cos_i, sin_i) [BLOCK, D/2];
    INVERSE rotates by -angle, which is also the transpose map the gradient needs."""
    x0, x1 = tl.split(tl.reshape(x, (BLOCK, HEAD_DIM // 2, 2)))
    if INVERSE:
        y0 = x0 * cos + x1 * sin
        y1 = x1 * cos - x0 * sin
    else:
        y0 = x0 * cos - x1 * sin
        y1 = x0 * sin + x1 * cos
    return tl.reshape(tl.join(y0, y1), (BLOCK, HEAD_DIM))


@triton.jit
def _tile_offsets(start, head, stride_t, stride_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    # int64 rows: a packed [T, 3, H, D] buffer passes 2^31 elements at a few million tokens.
    return (start + rows).to(tl.int64)[:, None] * stride_t + (head * stride_h + cols)[None, :]


@triton.jit
def _load_rotary(cos_ptr, sin_ptr, start, row_ok, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM // 2)
    offs = (start + rows).to(tl.int64)[:, None] * (HEAD_DIM // 2) + cols[None, :]
    cos = tl.load(cos_ptr + offs, mask=row_ok[:, None], other=0.0)
    sin = tl.load(sin_ptr + offs, mask=row_ok[:, None], other=0.0)
    return cos, sin


@triton.jit
def _softmax_scores(q, k, length, qk_scale, BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Unnormalized exp2 scores of one 64x64 tile and their row sums; keys >= length get 0."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where((tl.arange(0, BLOCK) < length)[None, :], s, float("-inf"))
    # Finite: length >= 1, so every row sees at least one real key.
    m = tl.max(s, 1)
    p = tl.math.exp2(s - m[:, None])
    return p, tl.sum(p, 1)


@triton.jit
def _block_attention_fwd(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, block_start_ptr, block_len_ptr, num_blocks_ptr,
    heads, stride_t, stride_h, out_stride_t, out_stride_h, qk_scale,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    dtype = q_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK)
    # Only the table's first num_blocks rows are real, so every item visited has length >= 1.
    num_items = tl.load(num_blocks_ptr).to(tl.int32) * heads
    for item in tl.range(tl.program_id(0), num_items, tl.num_programs(0), num_stages=LOOP_STAGES):
        blk = item // heads
        head = item - blk * heads
        start = tl.load(block_start_ptr + blk)
        length = tl.load(block_len_ptr + blk)
        # No branch around the body: Triton's loop pipeliner (LOOP_STAGES > 1) only prefetches
        # loads that sit directly in the loop.
        row_ok = rows < length
        offs = _tile_offsets(start, head, stride_t, stride_h, BLOCK, HEAD_DIM)
        q = tl.load(q_ptr + offs, mask=row_ok[:, None], other=0.0)
        k = tl.load(k_ptr + offs, mask=row_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=row_ok[:, None], other=0.0)
        if ROTARY:
            cos, sin = _load_rotary(cos_ptr, sin_ptr, start, row_ok, BLOCK, HEAD_DIM)
            q = rotate_pairs(q.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
            k = rotate_pairs(k.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
            if ROTATE_V:
                v = rotate_pairs(v.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
        p, row_sum = _softmax_scores(q, k, length, qk_scale, BLOCK, DOT_PRECISION)
        # P in the input dtype for the PV product, as FlashAttention does; normalize after.
        out = tl.dot(p.to(dtype), v, input_precision=DOT_PRECISION) / row_sum[:, None]
        out_offs = _tile_offsets(start, head, out_stride_t, out_stride_h, BLOCK, HEAD_DIM)
        tl.store(out_ptr + out_offs, out.to(dtype), mask=row_ok[:, None])


@triton.jit
def _block_attention_bwd(
    q_ptr, k_ptr, v_ptr, do_ptr, cos_ptr, sin_ptr, dq_ptr, dk_ptr, dv_ptr, block_start_ptr, block_len_ptr,
    num_blocks_ptr, heads, stride_t, stride_h, do_stride_t, do_stride_h, grad_stride_t, grad_stride_h,
    sm_scale, qk_scale,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    dtype = q_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK)
    num_items = tl.load(num_blocks_ptr).to(tl.int32) * heads
    for item in tl.range(tl.program_id(0), num_items, tl.num_programs(0), num_stages=LOOP_STAGES):
        blk = item // heads
        head = item - blk * heads
        start = tl.load(block_start_ptr + blk)
        length = tl.load(block_len_ptr + blk)
        row_ok = rows < length
        offs = _tile_offsets(start, head, stride_t, stride_h, BLOCK, HEAD_DIM)
        q = tl.load(q_ptr + offs, mask=row_ok[:, None], other=0.0)
        k = tl.load(k_ptr + offs, mask=row_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=row_ok[:, None], other=0.0)
        do_offs = _tile_offsets(start, head, do_stride_t, do_stride_h, BLOCK, HEAD_DIM)
        do = tl.load(do_ptr + do_offs, mask=row_ok[:, None], other=0.0)
        if ROTARY:
            # Recomputed from the raw inputs, bit-identical to the forward's rotated tiles.
            cos, sin = _load_rotary(cos_ptr, sin_ptr, start, row_ok, BLOCK, HEAD_DIM)
            q = rotate_pairs(q.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
            k = rotate_pairs(k.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
            if ROTATE_V:
                v = rotate_pairs(v.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
        p, row_sum = _softmax_scores(q, k, length, qk_scale, BLOCK, DOT_PRECISION)
        p = p / row_sum[:, None]
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        di = tl.sum(p * dp, 1)
        ds = (p * (dp - di[:, None]) * sm_scale).to(dtype)
        grad_offs = _tile_offsets(start, head, grad_stride_t, grad_stride_h, BLOCK, HEAD_DIM)

        dv = tl.dot(tl.trans(p.to(dtype)), do, input_precision=DOT_PRECISION)
        if ROTATE_V:
            dv = rotate_pairs(dv, cos, sin, BLOCK, HEAD_DIM, True)
        tl.store(dv_ptr + grad_offs, dv.to(dtype), mask=row_ok[:, None])
        dk = tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION)
        if ROTARY:
            dk = rotate_pairs(dk, cos, sin, BLOCK, HEAD_DIM, True)
        tl.store(dk_ptr + grad_offs, dk.to(dtype), mask=row_ok[:, None])
        dq = tl.dot(ds, k, input_precision=DOT_PRECISION)
        if ROTARY:
            dq = rotate_pairs(dq, cos, sin, BLOCK, HEAD_DIM, True)
        tl.store(dq_ptr + grad_offs, dq.to(dtype), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchConfig:
    """How one kernel is launched. The kernels are memory-bound: what counts is how many bytes each
    SM keeps in flight, i.e. how many programs are resident and whether loads overlap compute."""

    num_warps: int = 4
    # False: one program per (block, head) item; as programs finish, the hardware starts fresh ones,
    # so the resident programs drift out of phase and one's loads overlap another's compute.
    # True: an occupancy-sized grid whose programs loop over the items.
    persistent: bool = False
    # Software pipelining of the persistent loop (1 = off); >1 lets Triton prefetch the next
    # item's tiles into shared memory (cp.async) while this one computes. Ignored unless persistent.
    loop_stages: int = 1
    # Registers per thread for ptxas (None: its choice). Resident programs = 64K / (regs * threads).
    maxnreg: int | None = None


# Production launch settings per (pass, head_dim, rotary): one program per item, 4 warps, and a
# register cap where sm_90 compiles show it buys a resident program without spilling (fwd D=128:
# 141 -> 128 registers, 3 -> 4 programs/SM; fwd D=64 rotary: 164 -> 124, 3 -> 4).
# benchmarks/NOTES_triton.md has the register table; gpu_check_triton.py --sweep times alternatives.
_LAUNCH_CONFIGS = {
    (direction, head_dim, rotary): LaunchConfig()
    for direction in ("fwd", "bwd") for head_dim in SUPPORTED_HEAD_DIMS for rotary in (False, True)
} | {("fwd", 128, False): LaunchConfig(maxnreg=128), ("fwd", 64, True): LaunchConfig(maxnreg=128)}
# Field overrides applied on top, per pass, by `launch_overrides` (the GPU sweep's variants).
_OVERRIDES: dict[str, dict] = {"fwd": {}, "bwd": {}}
# Programs per SM of each compiled persistent kernel, from its registers and shared memory.
_OCCUPANCY: dict[tuple, int] = {}


def launch_config(direction: str, head_dim: int, rotary: bool) -> LaunchConfig:
    """The LaunchConfig the `direction` ("fwd" or "bwd") kernel runs with."""
    return replace(_LAUNCH_CONFIGS[(direction, head_dim, rotary)], **_OVERRIDES[direction])


@contextlib.contextmanager
def launch_overrides(fwd: dict | None = None, bwd: dict | None = None):
    """Within the block, launches use these LaunchConfig fields instead of the production ones."""
    saved = {key: dict(value) for key, value in _OVERRIDES.items()}
    _OVERRIDES["fwd"], _OVERRIDES["bwd"] = dict(fwd or {}), dict(bwd or {})
    try:
        yield
    finally:
        _OVERRIDES.update(saved)


def _occupancy(compiled, device: torch.device) -> int:
    """How many programs of `compiled` fit on one SM at once. A persistent grid larger than that
    would run its last programs as a second wave, so the grid is sized from this, not guessed."""
    compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    num_warps = compiled.metadata.num_warps
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in 256-register units
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // (compiled.metadata.shared + 1024)
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads))


def _launch(kernel, direction: str, max_items: int, device: torch.device, args: tuple, constexprs: dict) -> None:
    """Runs `kernel` over up to `max_items` (block, head) items as its LaunchConfig says; the
    kernel itself reads how many items are real. The interpreter runs a few programs, so each
    loops over several items."""
    config = launch_config(direction, constexprs["HEAD_DIM"], constexprs["ROTARY"])
    constexprs = dict(constexprs, LOOP_STAGES=config.loop_stages if config.persistent else 1)
    if _INTERPRETED or device.type != "cuda":
        kernel[(min(max_items, _INTERPRETER_PROGRAMS),)](*args, **constexprs)
        return
    options = dict(num_warps=config.num_warps)
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Triton launches on the current device, which need not be the tensors' one.
    with torch.cuda.device(index):
        grid = max_items
        if config.persistent:
            key = (kernel, index, args[0].dtype, *constexprs.items(), *options.items())
            if key not in _OCCUPANCY:
                _OCCUPANCY[key] = _occupancy(kernel.warmup(*args, grid=(1,), **constexprs, **options), device)
            num_sms = torch.cuda.get_device_properties(index).multi_processor_count
            grid = min(max_items, num_sms * _OCCUPANCY[key])
        kernel[(grid,)](*args, **constexprs, **options)


def _shared_strides(tensors: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    strides = {x.stride()[:2] for x in tensors}
    if len(strides) != 1 or any(x.stride(-1) != 1 for x in tensors):
        raise ValueError(f"q, k, v (and their gradients) must share strides with a contiguous last dim, got {strides}")
    return strides.pop()


def _kernel_constexprs(q: torch.Tensor, rotary: bool, rotate_v: bool) -> dict:
    return dict(
        BLOCK=BLOCK_SIZE, HEAD_DIM=q.shape[-1], ROTARY=rotary, ROTATE_V=rotary and rotate_v,
        # fp32 inputs are for exactness (tests), so no TF32 rounding; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _launch_forward(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, out) -> None:
    total_tokens, heads, head_dim = q.shape
    if total_tokens == 0 or heads == 0:
        return
    stride_t, stride_h = _shared_strides((q, k, v))
    args = (
        q, k, v, cos, sin, out, block_start, block_len, num_blocks,
        heads, stride_t, stride_h, out.stride(0), out.stride(1), math.log2(math.e) / math.sqrt(head_dim),
    )
    _launch(_block_attention_fwd, "fwd", block_start.numel() * heads, q.device, args,
            _kernel_constexprs(q, cos is not None, rotate_v))


def _launch_backward(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, dq, dk, dv) -> None:
    total_tokens, heads, head_dim = q.shape
    if total_tokens == 0 or heads == 0:
        return
    stride_t, stride_h = _shared_strides((q, k, v))
    grad_stride_t, grad_stride_h = _shared_strides((dq, dk, dv))
    grad_out = grad_out.to(q.dtype)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    sm_scale = 1.0 / math.sqrt(head_dim)
    args = (
        q, k, v, grad_out, cos, sin, dq, dk, dv, block_start, block_len, num_blocks,
        heads, stride_t, stride_h, grad_out.stride(0), grad_out.stride(1),
        grad_stride_t, grad_stride_h, sm_scale, sm_scale * math.log2(math.e),
    )
    _launch(_block_attention_bwd, "bwd", block_start.numel() * heads, q.device, args,
            _kernel_constexprs(q, cos is not None, rotate_v))


# ----------------------------------------------------------------------------------------------
# Custom ops and autograd: separate q, k, v, and one packed [T, 3, H, D] qkv buffer
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("block_attention::triton_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    block_start: torch.Tensor, block_len: torch.Tensor, num_blocks: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool,
) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_forward(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, out)
    return out


@_forward_op.register_fake
def _(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v):
    return q.new_empty(q.shape)


@torch.library.custom_op("block_attention::triton_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    block_start: torch.Tensor, block_len: torch.Tensor, num_blocks: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    _launch_backward(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, dq, dk, dv)
    return dq, dk, dv


@_backward_op.register_fake
def _(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


@torch.library.custom_op("block_attention::triton_qkv_forward", mutates_args=())
def _qkv_forward_op(
    qkv: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor, num_blocks: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool,
) -> torch.Tensor:
    q, k, v = qkv.unbind(1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_forward(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, out)
    return out


@_qkv_forward_op.register_fake
def _(qkv, block_start, block_len, num_blocks, cos, sin, rotate_v):
    return qkv.new_empty((qkv.shape[0], qkv.shape[2], qkv.shape[3]))


@torch.library.custom_op("block_attention::triton_qkv_backward", mutates_args=())
def _qkv_backward_op(
    grad_out: torch.Tensor, qkv: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor,
    num_blocks: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool,
) -> torch.Tensor:
    # The kernel writes dq, dk, dv straight into their slots of the packed gradient.
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _launch_backward(grad_out, *qkv.unbind(1), block_start, block_len, num_blocks, cos, sin, rotate_v, *dqkv.unbind(1))
    return dqkv


@_qkv_backward_op.register_fake
def _(grad_out, qkv, block_start, block_len, num_blocks, cos, sin, rotate_v):
    return qkv.new_empty(qkv.shape)


def _setup_forward(ctx, inputs, output):
    *tensors, rotate_v = inputs
    ctx.save_for_backward(*tensors)
    ctx.rotate_v = rotate_v


def _forward_backward(ctx, grad_out):
    dq, dk, dv = _backward_op(grad_out, *ctx.saved_tensors, ctx.rotate_v)
    # Neither the block table nor the rotary tables (functions of position) get a gradient.
    return dq, dk, dv, None, None, None, None, None, None


def _setup_qkv_forward(ctx, inputs, output):
    *tensors, rotate_v = inputs
    ctx.save_for_backward(*tensors)
    ctx.rotate_v = rotate_v


def _qkv_forward_backward(ctx, grad_out):
    return _qkv_backward_op(grad_out, *ctx.saved_tensors, ctx.rotate_v), None, None, None, None, None, None


_forward_op.register_autograd(_forward_backward, setup_context=_setup_forward)
_qkv_forward_op.register_autograd(_qkv_forward_backward, setup_context=_setup_qkv_forward)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def _unsupported_reason(dtype: torch.dtype, head_dim: int, device: torch.device) -> str | None:
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (the Triton kernels take float16, bfloat16 or float32)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (the Triton kernels take {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if device.type == "cpu":
        if not _INTERPRETED:
            return (
                "CPU tensors without the Triton interpreter: set TRITON_INTERPRET=1 before "
                "kernels.triton_block_attention is first imported"
            )
        if dtype == torch.bfloat16:
            return "bfloat16 on CPU (the Triton interpreter's bfloat16 tl.dot is wrong); use float16 or float32"
    elif device.type != "cuda":
        return f"device {device} (the Triton kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)"
    return None


def triton_unsupported_reason(q: torch.Tensor) -> str | None:
    """Why the Triton backend can't run inputs like `q` [T, H, D], or None if it can."""
    return _unsupported_reason(q.dtype, q.shape[-1], q.device)


def _check_rotary(cos, sin, total_tokens: int, head_dim: int, device: torch.device) -> None:
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if cos is None:
        return
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (total_tokens, head_dim // 2) or table.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 [{total_tokens}, {head_dim // 2}] (tokens, head_dim/2), "
                f"got {table.dtype} {list(table.shape)}"
            )
        if table.device != device or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {device}, got device {table.device}, strides {table.stride()}")


def _raise_if_unsupported(dtype: torch.dtype, head_dim: int, device: torch.device) -> None:
    reason = _unsupported_reason(dtype, head_dim, device)
    if reason is not None:
        raise ValueError(f"the Triton block attention backend does not support {reason}")


def block_attention_triton(q, k, v, offsets, cos=None, sin=None, rotate_v=False):
    """Block attention of q, k, v [T, H, D] (64-token blocks, scale 1/sqrt(D)) with interleaved
    rotary of q, k (and v if rotate_v) by fp32 cos/sin [T, D/2] fused into the kernels.

    Inputs are validated by kernels.dispatch.block_attention; this checks only what the kernels
    assume beyond that."""
    _raise_if_unsupported(q.dtype, q.shape[-1], q.device)
    _check_rotary(cos, sin, q.shape[0], q.shape[-1], q.device)
    if len({x.stride() for x in (q, k, v)}) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _forward_op(q, k, v, *counted_block_table(offsets.to(torch.int32), q.shape[0]), cos, sin, bool(rotate_v))


def block_attention_qkv_triton(x, w_qkv, offsets, heads, cos=None, sin=None, rotate_v=False):
    """Projection fused with block attention: qkv = x @ w_qkv viewed as [T, 3, heads, D], then
    rotary and attention. x: [T, d_in]; w_qkv: [d_in, 3 * heads * D]; returns [T, heads, D].

    The backward produces the packed dQKV [T, 3, heads, D] in one buffer, so dx = dQKV @ w_qkv^T
    and dw = x^T @ dQKV are two plain matmuls (autograd of the projection)."""
    if x.dim() != 2 or w_qkv.dim() != 2 or x.shape[1] != w_qkv.shape[0]:
        raise ValueError(f"x [T, d_in] @ w_qkv [d_in, 3*heads*D] needs matching d_in, got {list(x.shape)} and {list(w_qkv.shape)}")
    if heads < 1 or w_qkv.shape[1] % (3 * heads):
        raise ValueError(f"w_qkv's {w_qkv.shape[1]} columns are not 3 * heads * head_dim for heads = {heads}")
    if x.dtype != w_qkv.dtype or x.device != w_qkv.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and w_qkv ({w_qkv.dtype}, {w_qkv.device}) must share dtype and device")
    total_tokens, head_dim = x.shape[0], w_qkv.shape[1] // (3 * heads)
    _raise_if_unsupported(x.dtype, head_dim, x.device)
    _check_rotary(cos, sin, total_tokens, head_dim, x.device)
    if offsets.dim() != 1 or offsets.device != x.device:
        raise ValueError(f"offsets must be 1-D on {x.device}, got shape {list(offsets.shape)} on {offsets.device}")
    if not torch.compiler.is_compiling() and int(offsets[-1]) != total_tokens:
        raise ValueError(f"offsets[-1] = {int(offsets[-1])} must equal x's {total_tokens} tokens")
    qkv = (x @ w_qkv).view(total_tokens, 3, heads, head_dim)
    return _qkv_forward_op(qkv, *counted_block_table(offsets.to(torch.int32), total_tokens), cos, sin, bool(rotate_v))
