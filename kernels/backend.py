"""What a block-attention backend is, and the one factory that makes a kernel backend's custom ops.

Every backend module (kernels/block_attention_{reference,fa2,flex,triton,tlx}.py) exports one
`BACKEND = Backend(...)`; dispatch.py lists the modules and routes to their `run`.

A kernel backend supplies two launchers and gets its ops from `kernel_ops`:

    forward_launcher(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch) -> [out, *residuals]
    backward_launcher(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch,
                      out, *residuals, into=None) -> (dq, dk, dv)

(`into`: three [T, H, D] tensors with one shared stride to write dq, dk, dv into, e.g. the views of
one [T, 3, H, D] gradient that the attention sublayer's QKV projection takes as is; see
`gradient_outputs`.)

A backend whose backward launcher takes `into` also gets packed ops, `<name>_forward_qkv` /
`_backward_qkv`, on one [T, 3, H, D] qkv (a QKV projection's output, viewed): the same launchers on
its three views, the backward writing dq, dk, dv into one dqkv. `block_attention_qkv` calls them, so
autograd hands the projection one gradient instead of stacking three (a copy of dqkv per layer).

`kernel_ops` registers them as `block_attention::<name>_forward` / `_backward` custom ops with fake
(meta) implementations and an autograd formula, so models that call them compile under
torch.compile (the ops are opaque to it, and their data-dependent block count never leaks into a
graph). Eager calls skip the ops' dispatch, which costs more host time than a launch, and run
the same launchers and autograd formula through a torch.autograd.Function (kernels/eager.py
says when). `residuals` are whatever else the backward needs from the forward (FlashAttention's
logsumexp and RNG state); the fused kernels need none, since they recompute P.

`launch` is a backend's launch-setting overrides as canonical JSON ({"fwd": {...}, "bwd": {...}},
"" for the production settings), passed explicitly from `block_attention(..., launch=...)` so a
tuning sweep changes nothing global.
"""

import json
from dataclasses import dataclass
from typing import Callable

import torch

from .blocks import BlockTable
from .eager import op_or_eager


@dataclass(frozen=True)
class Backend:
    name: str
    # How to get it where it is missing: shown by BackendUnavailableError.
    how_to_get: str
    # Why it cannot run at all on this device and software stack, or None if it can.
    unavailable_reason: Callable[[torch.device], str | None]
    # Why it cannot take inputs like q [T, H, D] (dtype, head_dim, device), or None if it can.
    unsupported_reason: Callable[[torch.Tensor], str | None]
    # (q, k, v, table: BlockTable, cos, sin, rotate_v: bool, launch: str) -> out [T, H, D]
    run: Callable[..., torch.Tensor]
    # False: rotary is applied by separate PyTorch ops before `run`, which then gets cos = sin = None.
    fuses_rotary: bool = True
    # Whether `launch` overrides mean anything to it; block_attention refuses them for the others.
    has_launch_settings: bool = False
    # A kernel backend's `kernel_ops` run, whose forward_op/backward_op are its custom ops (the
    # tests opcheck them); `run` may wrap it. None for a backend of plain PyTorch ops.
    ops: Callable[..., torch.Tensor] | None = None

    @property
    def run_qkv(self) -> Callable[..., torch.Tensor] | None:
        """(qkv [T, 3, H, D], table, cos, sin, rotate_v, launch) -> out, with dqkv as one tensor, where
        the backend fuses rotary and has packed ops; None where block_attention_qkv runs `run` on
        qkv's views instead."""
        return getattr(self.ops, "qkv", None) if self.fuses_rotary else None


def no_unsupported_inputs(q: torch.Tensor) -> str | None:
    return None


def gradient_outputs(q: torch.Tensor, into: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv for a backward launcher: `into` checked (shapes and dtype of q; one stride, rows of
    whole heads), or three new tensors."""
    if into is None:
        return tuple(torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    strides = {x.stride() for x in into}
    if (len(into) != 3 or any(x.shape != q.shape or x.dtype != q.dtype or x.device != q.device for x in into)
            or len(strides) != 1 or next(iter(strides))[1:] != (q.shape[2], 1)):
        raise ValueError(f"gradient outputs must be three {tuple(q.shape)} {q.dtype} tensors on {q.device} with one "
                         f"stride (token, {q.shape[2]}, 1); got {[(tuple(x.shape), x.dtype, x.stride()) for x in into]}")
    return tuple(into)


def launch_json(launch: dict | None) -> str:
    """The canonical string form of launch overrides that the ops take ("" = production)."""
    if not launch:
        return ""
    unknown = set(launch) - {"fwd", "bwd"}
    if unknown:
        raise ValueError(f"launch overrides are keyed by pass, 'fwd' and/or 'bwd'; got {sorted(unknown)}")
    return json.dumps({direction: dict(launch[direction]) for direction in sorted(launch)}, sort_keys=True)


def launch_overrides(launch: str, direction: str) -> dict:
    """One pass's overrides from the string form."""
    return json.loads(launch).get(direction, {}) if launch else {}


def kernel_ops(
    name: str,
    forward_launcher: Callable,
    backward_launcher: Callable,
    fake_residuals: Callable[[torch.Tensor], list[torch.Tensor]] = lambda q: [],
    packed: bool = False,
) -> Callable[..., torch.Tensor]:
    """Registers backend `name`'s forward and backward launchers as custom ops with fake and
    autograd implementations; returns its `run(q, k, v, table, cos, sin, rotate_v, launch)`, which
    eager calls (eager_call) take through an autograd.Function over the same launchers instead.
    `packed` (a backward launcher that takes `into`): also the packed ops, as `run.qkv(qkv, table,
    cos, sin, rotate_v, launch)`."""

    @torch.library.custom_op(f"block_attention::{name}_forward", mutates_args=())
    def forward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        block_start: torch.Tensor, block_len: torch.Tensor, num_blocks: torch.Tensor,
        cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool, launch: str,
    ) -> list[torch.Tensor]:
        return list(forward_launcher(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch))

    @forward_op.register_fake
    def _(q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch):
        return [torch.empty_like(q, memory_format=torch.contiguous_format), *fake_residuals(q)]

    @torch.library.custom_op(f"block_attention::{name}_backward", mutates_args=())
    def backward_op(
        grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        block_start: torch.Tensor, block_len: torch.Tensor, num_blocks: torch.Tensor,
        cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool, launch: str,
        saved: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward_launcher(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch,
                                 *saved)

    @backward_op.register_fake
    def _(grad_out, q, k, v, block_start, block_len, num_blocks, cos, sin, rotate_v, launch, saved):
        return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))

    def setup_context(ctx, inputs, output):
        *tensors, rotate_v, launch = inputs
        ctx.save_for_backward(*tensors, *output)
        ctx.rotate_v, ctx.launch, ctx.num_inputs = rotate_v, launch, len(tensors)

    def gradients(ctx, grad_out, backward_fn):
        """The attention inputs' gradients ((dq, dk, dv), or dqkv) and none for the block table and
        the rotary tables (functions of position), from what setup_context saved."""
        saved = ctx.saved_tensors
        inputs, outputs = saved[: ctx.num_inputs], list(saved[ctx.num_inputs:])
        grads = backward_fn(grad_out, *inputs, ctx.rotate_v, ctx.launch, outputs)
        grads = grads if isinstance(grads, tuple) else (grads,)
        # The position tensors (block table and rotary tables, 5) and the two constants get none.
        return (*grads, *[None] * 7)

    forward_op.register_autograd(lambda ctx, grads: gradients(ctx, grads[0], backward_op), setup_context=setup_context)

    # The launcher takes the saved outputs spread out, where backward_op takes them as a list.
    call = op_or_eager(forward_op, forward_launcher, setup_context, lambda ctx, grads: gradients(
        ctx, grads[0], lambda *args: backward_launcher(*args[:-1], *args[-1])))

    def run(q, k, v, table: BlockTable, cos, sin, rotate_v: bool, launch: str) -> torch.Tensor:
        return call((q, k, v, *table.tensors(), cos, sin), bool(rotate_v), launch)

    run.forward_op, run.backward_op = forward_op, backward_op
    # For ops that run this attention inside their own (kernels/attention_sublayer_kernels.py).
    run.forward_launcher, run.backward_launcher = forward_launcher, backward_launcher
    if not packed:
        return run

    def forward_qkv(
        qkv: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor, num_blocks: torch.Tensor,
        cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool, launch: str,
    ) -> list[torch.Tensor]:
        return list(forward_launcher(*qkv.unbind(1), block_start, block_len, num_blocks, cos, sin, rotate_v, launch))

    def backward_qkv(
        grad_out: torch.Tensor, qkv: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor,
        num_blocks: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, rotate_v: bool, launch: str,
        saved: list[torch.Tensor],
    ) -> torch.Tensor:
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        backward_launcher(grad_out, *qkv.unbind(1), block_start, block_len, num_blocks, cos, sin, rotate_v, launch,
                          *saved, into=dqkv.unbind(1))
        return dqkv

    forward_qkv_op = torch.library.custom_op(f"block_attention::{name}_forward_qkv", mutates_args=())(forward_qkv)
    backward_qkv_op = torch.library.custom_op(f"block_attention::{name}_backward_qkv", mutates_args=())(backward_qkv)

    @forward_qkv_op.register_fake
    def _(qkv, block_start, block_len, num_blocks, cos, sin, rotate_v, launch):
        q = qkv[:, 0]
        return [torch.empty_like(q, memory_format=torch.contiguous_format), *fake_residuals(q)]

    @backward_qkv_op.register_fake
    def _(grad_out, qkv, block_start, block_len, num_blocks, cos, sin, rotate_v, launch, saved):
        return torch.empty_like(qkv, memory_format=torch.contiguous_format)

    forward_qkv_op.register_autograd(lambda ctx, grads: gradients(ctx, grads[0], backward_qkv_op),
                                     setup_context=setup_context)
    call_qkv = op_or_eager(forward_qkv_op, forward_qkv, setup_context,
                           lambda ctx, grads: gradients(ctx, grads[0], backward_qkv))

    def run_qkv(qkv, table: BlockTable, cos, sin, rotate_v: bool, launch: str) -> torch.Tensor:
        return call_qkv((qkv, *table.tensors(), cos, sin), bool(rotate_v), launch)

    run.qkv, run.forward_qkv_op, run.backward_qkv_op = run_qkv, forward_qkv_op, backward_qkv_op
    return run
