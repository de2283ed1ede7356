"""The fused attention sublayer, `y = x + Wo · blockattn(rotary(split(Wqkv · LayerNorm(x) + bqkv))) + bo`:
one entry point that validates once and routes by backend name, and the one factory that makes a
kernel backend's ops.

Backends: `reference` (kernels/attention_sublayer_reference.py, the model's unfused PyTorch path), and
`triton` and `tlx` (kernels/attention_sublayer_kernels.py): the same Triton LayerNorm and GEMM kernels
as the fused MLP's "gemms" plan (kernels/sublayer_triton.py), around that name's block-attention
kernel with rotary fused; the triton backend also runs each pass as one kernel per 64-token block
(the "blocks" plan, kernels/attention_sublayer_blocks.py), where `launch` asks for it. Whether one can
run is the same question as for block attention's backend of that name.

What the kernel ops save for the backward, and why (per token, d = d_model, compute dtype):
- saved: the projection q, k, v (3d values: the attention backward reads them, and recomputing them
  is a [d, 3d] GEMM), the attention output (d values: the output projection's weight gradient reads
  it; recomputing it is the attention forward again) and LayerNorm's mean and 1/std (8 bytes).
- recomputed: LN(x), from x and the statistics, inside the LayerNorm-backward kernel that reads x
  anyway; the unfused path saves it (d values).
The weight gradients are GEMMs over all tokens (cuBLAS on a GPU); the LayerNorm-affine and output-bias
gradients come from per-tile partial sums added in a fixed order; the projection bias's gradient is a
column sum: every gradient is bitwise repeatable.
"""

import importlib
from typing import Callable

import torch

from .backend import launch_json
from .blocks import BlockTable
from .dispatch import batch_block_table
from .eager import op_or_eager
from .rotary import Rotary, rotary_tables
from .attention_sublayer_reference import attention_sublayer_reference
from .sublayer_dispatch import (
    SublayerBackend,
    SublayerBackends,
    check_sublayer_inputs,
    check_sublayer_parameters,
    sublayer_compute_dtype,
)

# Fastest first on a GPU; `auto` takes the reference alone on a CPU (the Triton interpreter runs only when named).
ATTENTION_SUBLAYER_KERNELS = ("tlx", "triton")


# A backend's run: (x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, table, cos, sin, num_heads, rotate_v,
# eps, launch) -> y.


def _reference_run(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, table, cos, sin, num_heads, rotate_v, eps,
                   launch):
    return attention_sublayer_reference(x, table, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, num_heads, cos,
                                        sin, rotate_v, eps, compute_dtype=w_qkv.dtype)


REFERENCE_BACKEND = SublayerBackend("reference", lambda x, num_heads, dtype: None, _reference_run)

BACKENDS = SublayerBackends(
    "attention_sublayer", REFERENCE_BACKEND, ATTENTION_SUBLAYER_KERNELS,
    lambda name: importlib.import_module("kernels.attention_sublayer_kernels").kernel_backend(name))
ATTENTION_SUBLAYER_BACKENDS = BACKENDS.names
get_attention_sublayer_backend = BACKENDS.get
check_attention_sublayer_backend = BACKENDS.check


def _validate(x, num_heads, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out) -> None:
    check_sublayer_inputs(x)
    d_model = x.shape[1]
    if num_heads < 1 or d_model % num_heads:
        raise ValueError(f"num_heads={num_heads} must be >= 1 and divide d_model={d_model}")
    shapes = {"norm_weight": (d_model,), "norm_bias": (d_model,), "w_qkv": (3 * d_model, d_model),
              "b_qkv": (3 * d_model,), "w_out": (d_model, d_model), "b_out": (d_model,)}
    check_sublayer_parameters(x, dict(zip(shapes, (norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out))), shapes,
                              f"x [T, {d_model}]")


def attention_sublayer(
    x: torch.Tensor,
    offsets: torch.Tensor | BlockTable,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    w_qkv: torch.Tensor,
    b_qkv: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
    *,
    num_heads: int,
    rotary: Rotary | None = None,
    eps: float = 1e-5,
    backend: str = "auto",
    check_offsets: bool = True,
    launch: dict | None = None,
) -> torch.Tensor:
    """x + Wo · blockattn(rotary(q, k, v)) + bo with q, k, v = split(Wqkv · LayerNorm(x) + bqkv):
    a pre-norm transformer's attention sublayer over 64-token blocks of jagged sequences.

    x [T, D]; offsets: int32 [B+1] cumulative sequence lengths or the batch's BlockTable (as for
    kernels.block_attention); norm_weight, norm_bias [D]; w_qkv [3D, D], b_qkv [3D] (q, k, v are its
    output's three D-wide thirds, num_heads heads each), w_out [D, D], b_out [D] (nn.Linear layouts,
    so a model passes its parameters as they are). The matmuls and the attention run in the autocast
    dtype when autocast is on (as nn.Linear would), else in the weights' dtype; LayerNorm and
    rotary in fp32; the result has x's dtype. `launch` overrides the block-attention kernel's launch
    settings ({"fwd": {...}, "bwd": {...}}).
    """
    _validate(x, num_heads, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out)
    if offsets.device != x.device:
        raise ValueError(f"offsets are on {offsets.device} and x on {x.device}; they must share a device")
    table = batch_block_table(offsets, x.shape[0], "x", check_offsets)
    device_type = x.device.type
    compute_dtype = sublayer_compute_dtype(x, w_qkv)
    chosen = BACKENDS.resolve(backend, x, num_heads, compute_dtype=compute_dtype)
    if launch and chosen.ops is None:
        raise ValueError(f"the {chosen.name} attention_sublayer backend has no launch settings to override, got {launch}")
    cos = sin = None
    if rotary is not None:
        cos, sin = rotary_tables(rotary, table.offsets, x.shape[0], x.shape[1] // num_heads)
    rotate_v = rotary is not None and rotary.rotate_v
    # Cast outside the ops, as autocast casts nn.Linear's weights: autograd casts their gradients back.
    w_qkv, b_qkv, w_out, b_out = (t.to(compute_dtype) for t in (w_qkv, b_qkv, w_out, b_out))
    with torch.autocast(device_type, enabled=False):
        return chosen.run(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, table, cos, sin, int(num_heads),
                          bool(rotate_v), float(eps), launch_json(launch))


# ----------------------------------------------------------------------------------------------
# The kernel backends' ops
# ----------------------------------------------------------------------------------------------


def attention_sublayer_ops(name: str, forward: Callable, backward: Callable) -> Callable[..., torch.Tensor]:
    """Registers a kernel backend's two launchers as `attention_sublayer::<name>_forward` / `_backward`
    custom ops with fake and autograd implementations; returns its `run`, which eager calls
    (kernels/eager.py) take through an autograd.Function over the same launchers instead.

        forward(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start, block_len, num_blocks,
                cos, sin, num_heads, rotate_v, eps, launch) -> (y, qkv, attn, mean, rstd)
        backward(grad_y, x, norm_weight, norm_bias, w_qkv, w_out, qkv, attn, mean, rstd, block_start,
                 block_len, num_blocks, cos, sin, num_heads, rotate_v, eps, launch)
            -> (dx, dnorm_weight, dnorm_bias, dw_qkv, db_qkv, dw_out, db_out)

    qkv [T, 3D] and attn [T, H, D / H] are in the compute dtype; mean, rstd [T] fp32.
    """
    tensor_inputs = 12  # x .. sin: what the forward op takes before its constants

    @torch.library.custom_op(f"attention_sublayer::{name}_forward", mutates_args=())
    def forward_op(
        x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, w_qkv: torch.Tensor,
        b_qkv: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor, block_start: torch.Tensor,
        block_len: torch.Tensor, num_blocks: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
        num_heads: int, rotate_v: bool, eps: float, launch: str,
    ) -> list[torch.Tensor]:
        return list(forward(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start, block_len,
                            num_blocks, cos, sin, num_heads, rotate_v, eps, launch))

    @forward_op.register_fake
    def _(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, block_start, block_len, num_blocks, cos, sin,
          num_heads, rotate_v, eps, launch):
        tokens, d_model = x.shape
        stats = x.new_empty(tokens, dtype=torch.float32)
        return [torch.empty_like(x, memory_format=torch.contiguous_format),
                x.new_empty(tokens, 3 * d_model, dtype=w_qkv.dtype),
                x.new_empty(tokens, num_heads, d_model // num_heads, dtype=w_qkv.dtype), stats, torch.empty_like(stats)]

    @torch.library.custom_op(f"attention_sublayer::{name}_backward", mutates_args=())
    def backward_op(
        grad_y: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
        w_qkv: torch.Tensor, w_out: torch.Tensor, qkv: torch.Tensor, attn: torch.Tensor, mean: torch.Tensor,
        rstd: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor, num_blocks: torch.Tensor,
        cos: torch.Tensor | None, sin: torch.Tensor | None, num_heads: int, rotate_v: bool, eps: float, launch: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward(grad_y, x, norm_weight, norm_bias, w_qkv, w_out, qkv, attn, mean, rstd, block_start,
                        block_len, num_blocks, cos, sin, num_heads, rotate_v, eps, launch)

    @backward_op.register_fake
    def _(grad_y, x, norm_weight, norm_bias, w_qkv, w_out, qkv, attn, mean, rstd, block_start, block_len, num_blocks,
          cos, sin, num_heads, rotate_v, eps, launch):
        return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(norm_weight),
                torch.empty_like(norm_bias), torch.empty_like(w_qkv), w_qkv.new_empty(w_qkv.shape[0]),
                torch.empty_like(w_out), w_out.new_empty(w_out.shape[0]))

    def setup_context(ctx, inputs, output):
        x, norm_weight, norm_bias, w_qkv, _, w_out, _, block_start, block_len, num_blocks, cos, sin = \
            inputs[:tensor_inputs]
        ctx.num_heads, ctx.rotate_v, ctx.eps, ctx.launch = inputs[tensor_inputs:]
        _, qkv, attn, mean, rstd = output
        ctx.save_for_backward(x, norm_weight, norm_bias, w_qkv, w_out, qkv, attn, mean, rstd, block_start, block_len,
                              num_blocks, cos, sin)
        # The saved tensors among the outputs get no gradient: don't let autograd fill zeros for them.
        ctx.set_materialize_grads(False)

    def backward_formula(ctx, grads, backward_fn=backward_op):
        grad_y = grads[0] if grads[0] is not None else torch.zeros_like(ctx.saved_tensors[0])
        gradients = backward_fn(grad_y, *ctx.saved_tensors, ctx.num_heads, ctx.rotate_v, ctx.eps, ctx.launch)
        # None for the block table, the rotary tables and the constants.
        return (*gradients, *[None] * (tensor_inputs - 7 + 4))

    forward_op.register_autograd(backward_formula, setup_context=setup_context)

    call = op_or_eager(forward_op, forward, setup_context, lambda ctx, grads: backward_formula(ctx, grads, backward))

    def run(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, table: BlockTable, cos, sin, num_heads, rotate_v,
            eps, launch):
        return call((x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out, *table.tensors(), cos, sin), num_heads,
                    rotate_v, eps, launch)

    run.forward_op, run.backward_op = forward_op, backward_op
    return run
