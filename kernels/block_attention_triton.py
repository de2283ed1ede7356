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
- One kernel runs both passes (BACKWARD selects one at compile time), so they walk, load and
  rotate items one way. Launch settings (warps, register cap) are LaunchConfig knobs per pass,
  not copies of the kernel. The grid has one program per (block, head) item, so the grid-stride
  loop runs once on a GPU; the CPU interpreter runs a few programs that each walk several items.
  Consecutive programs take the heads of one block, which sit side by side in memory.
"""

import functools
import math
import os
from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from .backend import Backend, gradient_outputs, kernel_ops, launch_overrides
from .blocks import BLOCK_SIZE

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
def _load_item(
    item, rows, q_ptr, k_ptr, v_ptr, block_start_ptr, block_len_ptr, heads, stride_t, stride_h,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Work item `item`, the (block, head) pair it names: its head, start token, length, row mask,
    and its q, k, v tiles with rows >= length as zeros. `rows` is tl.arange(0, BLOCK), made by the
    kernel before its item loop: made here, it would move in the compiled code."""
    blk = item // heads
    head = item - blk * heads
    start = tl.load(block_start_ptr + blk)
    length = tl.load(block_len_ptr + blk)
    row_ok = rows < length
    offs = _tile_offsets(start, head, stride_t, stride_h, BLOCK, HEAD_DIM)
    q = tl.load(q_ptr + offs, mask=row_ok[:, None], other=0.0)
    k = tl.load(k_ptr + offs, mask=row_ok[:, None], other=0.0)
    v = tl.load(v_ptr + offs, mask=row_ok[:, None], other=0.0)
    return head, start, length, row_ok, q, k, v


@triton.jit
def _rotate_item(
    q, k, v, cos_ptr, sin_ptr, start, row_ok, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTATE_V: tl.constexpr,
):
    """An item's q, k (and with ROTATE_V v) tiles rotated in fp32 and rounded back once, and the
    item's cos/sin, with which the backward rotates the gradients back."""
    dtype = q.dtype
    cos, sin = _load_rotary(cos_ptr, sin_ptr, start, row_ok, BLOCK, HEAD_DIM)
    q = rotate_pairs(q.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
    k = rotate_pairs(k.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
    if ROTATE_V:
        v = rotate_pairs(v.to(tl.float32), cos, sin, BLOCK, HEAD_DIM, False).to(dtype)
    return q, k, v, cos, sin


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
def _block_attention(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, do_ptr, out_ptr, dk_ptr, dv_ptr, block_start_ptr, block_len_ptr,
    num_blocks_ptr, heads, stride_t, stride_h, do_stride_t, do_stride_h, out_stride_t, out_stride_h,
    sm_scale, qk_scale,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, ROTATE_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BACKWARD: tl.constexpr,
):
    """The forward (out_ptr: O) or, with BACKWARD, the backward (do_ptr: dO; out_ptr, dk_ptr, dv_ptr:
    dQ, dK, dV, which share out_stride_*) of every (block, head) item. One kernel for both passes,
    so they walk the items, load and rotate them and take the softmax one way; the other pass's
    arguments are None."""
    dtype = q_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK)
    # Only the table's first num_blocks rows are real, so every item visited has length >= 1.
    num_items = tl.load(num_blocks_ptr).to(tl.int32) * heads
    # num_stages=1: nothing to pipeline in a loop that runs once per program on a GPU.
    for item in tl.range(tl.program_id(0), num_items, tl.num_programs(0), num_stages=1):
        head, start, length, row_ok, q, k, v = _load_item(
            item, rows, q_ptr, k_ptr, v_ptr, block_start_ptr, block_len_ptr, heads, stride_t, stride_h, BLOCK, HEAD_DIM)
        if BACKWARD:
            do_offs = _tile_offsets(start, head, do_stride_t, do_stride_h, BLOCK, HEAD_DIM)
            do = tl.load(do_ptr + do_offs, mask=row_ok[:, None], other=0.0)
        if ROTARY:
            # The backward's are recomputed from the raw inputs, bit-identical to the forward's.
            q, k, v, cos, sin = _rotate_item(q, k, v, cos_ptr, sin_ptr, start, row_ok, BLOCK, HEAD_DIM, ROTATE_V)
        p, row_sum = _softmax_scores(q, k, length, qk_scale, BLOCK, DOT_PRECISION)
        if BACKWARD:
            p = p / row_sum[:, None]
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            di = tl.sum(p * dp, 1)
            ds = (p * (dp - di[:, None]) * sm_scale).to(dtype)
            grad_offs = _tile_offsets(start, head, out_stride_t, out_stride_h, BLOCK, HEAD_DIM)

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
            tl.store(out_ptr + grad_offs, dq.to(dtype), mask=row_ok[:, None])
        else:
            # P in the input dtype for the PV product, as FlashAttention does; normalize after.
            out = tl.dot(p.to(dtype), v, input_precision=DOT_PRECISION) / row_sum[:, None]
            out_offs = _tile_offsets(start, head, out_stride_t, out_stride_h, BLOCK, HEAD_DIM)
            tl.store(out_ptr + out_offs, out.to(dtype), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchConfig:
    """How one kernel is launched: one program per (block, head) item. The kernels are memory-bound:
    what counts is how many programs stay resident per SM, so that one's loads overlap another's
    compute (H200 sweeps of persistent grids and loop pipelining found nothing faster;
    benchmarks/NOTES_triton.md)."""

    num_warps: int = 4
    # Registers per thread for ptxas (None: its choice). Resident programs = 64K / (regs * threads).
    maxnreg: int | None = None


# Production launch settings per (pass, head_dim, rotary): 4 warps, and a register cap where sm_90
# compiles show it buys a resident program without spilling (fwd D=128: 141 -> 128 registers,
# 3 -> 4 programs/SM; fwd D=64 rotary: 164 -> 124, 3 -> 4). benchmarks/NOTES_triton.md has the table.
_LAUNCH_CONFIGS = {
    (direction, head_dim, rotary): LaunchConfig()
    for direction in ("fwd", "bwd") for head_dim in SUPPORTED_HEAD_DIMS for rotary in (False, True)
} | {("fwd", 128, False): LaunchConfig(maxnreg=128), ("fwd", 64, True): LaunchConfig(maxnreg=128)}


@functools.lru_cache(maxsize=None)
def launch_config(direction: str, head_dim: int, rotary: bool, launch: str = "") -> LaunchConfig:
    """The LaunchConfig the `direction` ("fwd" or "bwd") kernel runs with, given overrides `launch`
    (kernels.backend.launch_json form; "" = production)."""
    overrides = launch_overrides(launch, direction)
    unknown = set(overrides) - {f.name for f in fields(LaunchConfig)}
    if unknown:
        raise ValueError(f"unknown Triton {direction} launch settings {sorted(unknown)}; "
                         f"choose from {[f.name for f in fields(LaunchConfig)]}")
    return replace(_LAUNCH_CONFIGS[(direction, head_dim, rotary)], **overrides)


@functools.lru_cache(maxsize=None)
def _launch_kwargs(direction: str, head_dim: int, dtype: torch.dtype, rotary: bool, rotate_v: bool, launch: str,
                   on_gpu: bool) -> dict:
    """The kernel's constexprs and launch options for one kind of call, built once."""
    kwargs = dict(
        BLOCK=BLOCK_SIZE, HEAD_DIM=head_dim, ROTARY=rotary, ROTATE_V=rotary and rotate_v,
        # fp32 inputs are for exactness (tests), so no TF32 rounding; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", BACKWARD=direction == "bwd",
    )
    config = launch_config(direction, head_dim, rotary, launch)
    if on_gpu:
        kwargs["num_warps"] = config.num_warps
        if config.maxnreg is not None:
            kwargs["maxnreg"] = config.maxnreg
    return kwargs


def _shared_strides(tensors: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    strides = {x.stride()[:2] for x in tensors}
    if len(strides) != 1 or any(x.stride(-1) != 1 for x in tensors):
        raise ValueError(f"q, k, v (and their gradients) must share strides with a contiguous last dim, got {strides}")
    return strides.pop()


def _launch(direction: str, q, k, v, cos, sin, grad_out, outs: tuple, block_start, block_len, num_blocks,
            sm_scale, qk_scale, rotate_v: bool, launch: str) -> None:
    """Runs `direction`'s pass of the kernel over up to one program per (block, head) row of the
    table; the kernel itself reads how many are real. `outs` is (O,) or (dQ, dK, dV); grad_out and
    sm_scale are the backward's (None in the forward). The interpreter runs a few programs, so each
    loops over several items."""
    heads = q.shape[1]
    stride_t, stride_h = _shared_strides((q, k, v))
    out_stride_t, out_stride_h = _shared_strides(outs)
    do_stride_t, do_stride_h = (None, None) if grad_out is None else grad_out.stride()[:2]
    dk, dv = outs[1:] if len(outs) == 3 else (None, None)
    on_gpu = q.device.type == "cuda" and not _INTERPRETED
    kwargs = _launch_kwargs(direction, q.shape[2], q.dtype, cos is not None, rotate_v, launch, on_gpu)
    max_items = block_start.shape[0] * heads
    grid = (max_items,) if on_gpu else (min(max_items, _INTERPRETER_PROGRAMS),)
    args = (q, k, v, cos, sin, grad_out, outs[0], dk, dv, block_start, block_len, num_blocks, heads, stride_t, stride_h,
            do_stride_t, do_stride_h, out_stride_t, out_stride_h, sm_scale, qk_scale)
    if not on_gpu:
        _block_attention[grid](*args, **kwargs)
        return
    # Triton launches on the current device, which need not be the tensors' one.
    with torch.cuda.device(q.device):
        _block_attention[grid](*args, **kwargs)


def _forward(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch):
    total_tokens, heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if total_tokens == 0 or heads == 0:
        return [out]
    _launch("fwd", q, k, v, cos, sin, None, (out,), block_start, block_len, num_blocks,
            None, math.log2(math.e) / math.sqrt(head_dim), rotate_v, launch)
    return [out]


def _backward(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch, out, into=None):
    total_tokens, heads, head_dim = q.shape
    dq, dk, dv = gradient_outputs(q, into)
    if total_tokens == 0 or heads == 0:
        return dq, dk, dv
    grad_out = grad_out.to(q.dtype)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    sm_scale = 1.0 / math.sqrt(head_dim)
    _launch("bwd", q, k, v, cos, sin, grad_out, (dq, dk, dv), block_start, block_len, num_blocks,
            sm_scale, sm_scale * math.log2(math.e), rotate_v, launch)
    return dq, dk, dv


_run_ops = kernel_ops("triton", _forward, _backward, packed=True)


def _run(q, k, v, table, cos, sin, rotate_v, launch):
    # The kernels take one (token, head) stride pair for q, k and v. Inputs whose strides differ
    # are copied here, outside the op, so autograd saves the copies and the backward copies nothing.
    if len({x.stride() for x in (q, k, v)}) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _run_ops(q, k, v, table, cos, sin, rotate_v, launch)


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------


def triton_unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cpu" and _INTERPRETED:
        return None  # the interpreter runs the same kernels on CPU tensors, for tests
    if device.type != "cuda":
        return f"it needs a CUDA GPU and the tensors are on {device.type} (or TRITON_INTERPRET=1 for the slow CPU interpreter)"
    return None


def triton_unsupported_reason(q: torch.Tensor) -> str | None:
    """Why the Triton backend can't run inputs like `q` [T, H, D], or None if it can."""
    dtype, head_dim, device = q.dtype, q.shape[-1], q.device
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (the Triton kernels take float16, bfloat16 or float32)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (the Triton kernels take {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if device.type == "cpu":
        if not _INTERPRETED:
            return (
                "CPU tensors without the Triton interpreter: set TRITON_INTERPRET=1 before "
                "kernels.block_attention_triton is first imported"
            )
        if dtype == torch.bfloat16:
            return "bfloat16 on CPU (the Triton interpreter's bfloat16 tl.dot is wrong); use float16 or float32"
    elif device.type != "cuda":
        return f"device {device} (the Triton kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)"
    return None


HOW_TO_GET = "run on a GPU Triton supports with `pip install triton`, or set TRITON_INTERPRET=1 on CPU"
BACKEND = Backend(
    "triton", HOW_TO_GET, triton_unavailable_reason, triton_unsupported_reason, _run, has_launch_settings=True,
    ops=_run_ops,
)
