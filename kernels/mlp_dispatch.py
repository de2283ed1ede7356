"""The fused MLP sublayer, `y = x + W2 · GELU(W1 · LayerNorm(x) + b1) + b2`: one entry point that
validates once and routes by backend name, and the one factory that makes a kernel backend's ops.

The sublayer is token-local, so a kernel can run it per tile of tokens, x read once and y written
once, the 4·d hidden on chip but for one bf16 copy of the pre-activation (the Triton "tiles" plan and
the TLX forward); the Triton "gemms" plan, the default, passes the hidden through HBM between GEMMs
that carry the elementwise work, which ran faster on the H200 at d_model 256.
Backends: `reference` (kernels/mlp_sublayer_reference.py, today's unfused PyTorch path), `triton`
(kernels/mlp_sublayer_triton.py) and `tlx` (kernels/mlp_sublayer_tlx.py); whether a kernel backend
can run on a device is the same question as for block attention's backend of that name.

What the kernels save for the backward, and why (per token, d = d_model, H = 4d hidden):
- saved: the pre-activation W1·LN(x)+b1 in the compute dtype (2H bytes) and LayerNorm's mean and
  1/std (8 bytes). Recomputing the pre-activation would cost 2·d·H FLOPs to save 2H bytes of
  writing and 2H of reading, 2·d/2 = 256 FLOPs a byte at d = 256, above the H200's ridge
  (~125 FLOPs/byte at ~600 TFLOP/s and 4.8 TB/s): storing it is cheaper.
- recomputed: LN(x) from x and the two statistics (x is read by the backward anyway), and
  GELU(pre-activation) and its derivative (elementwise; one erf for both, which bounds the backward's
  epilogue on the H200, or one hardware tanh in the tanh form).
A backend's backward gives dx (through LN's backward), the hidden gradient, GELU's output and LN(x);
the two weight-gradient GEMMs over all tokens run here (cuBLAS on a GPU); bias and LayerNorm-affine
gradients come from per-tile partial sums added in a fixed order, so every gradient is bitwise
repeatable.
"""

import importlib
from typing import Callable

import torch

from .backend import launch_json
from .eager import op_or_eager
from .mlp_sublayer_reference import mlp_sublayer_reference
from .sublayer_dispatch import (
    SublayerBackend,
    SublayerBackends,
    check_gelu_approximate,
    check_sublayer_inputs,
    check_sublayer_parameters,
    sublayer_compute_dtype,
)


# A backend's run: (x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch) -> y.


def _reference_run(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch):
    return mlp_sublayer_reference(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, compute_dtype=w1.dtype,
                                  approximate=approximate)


REFERENCE_BACKEND = SublayerBackend("reference", lambda x, hidden, dtype: None, _reference_run)

BACKENDS = SublayerBackends(
    "mlp_sublayer", REFERENCE_BACKEND, ("tlx", "triton"),
    lambda name: importlib.import_module(f"kernels.mlp_sublayer_{name}").MLP_BACKEND)
# Backend <name> is the module kernels/mlp_sublayer_<name>.py (a kernel backend's exports `MLP_BACKEND`).
MLP_BACKENDS = BACKENDS.names
# Fastest first on a GPU; the reference alone on a CPU (the Triton interpreter runs only when named).
MLP_AUTO_ORDER = BACKENDS.auto_order
get_mlp_backend = BACKENDS.get
check_mlp_backend = BACKENDS.check


def _validate(x, norm_weight, norm_bias, w1, b1, w2, b2) -> None:
    check_sublayer_inputs(x)
    d_model, hidden = x.shape[1], w1.shape[0]
    shapes = {"norm_weight": (d_model,), "norm_bias": (d_model,), "w1": (hidden, d_model), "b1": (hidden,),
              "w2": (d_model, hidden), "b2": (d_model,)}
    check_sublayer_parameters(x, dict(zip(shapes, (norm_weight, norm_bias, w1, b1, w2, b2))), shapes,
                              f"x [T, {d_model}] and w1 [{hidden}, ...]")


def mlp_sublayer(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    *,
    eps: float = 1e-5,
    approximate: str = "none",
    backend: str = "auto",
    launch: dict | None = None,
) -> torch.Tensor:
    """x + W2 · GELU(W1 · LayerNorm(x) + b1) + b2, per token (a pre-norm transformer's MLP sublayer).

    x [T, D]; norm_weight, norm_bias [D] (LayerNorm's affine); w1 [H, D], b1 [H], w2 [D, H], b2 [D]
    (nn.Linear layouts, so a model passes its parameters as they are). The matmuls run in the
    autocast dtype when autocast is on (as nn.Linear would), else in the weights' dtype; LayerNorm
    and GELU in fp32; the result has x's dtype. `approximate` is F.gelu's: "none" (the exact erf form) or
    "tanh", which the kernels compute with the GPU's hardware tanh, far fewer instructions than erf in the
    epilogues that bound them. `launch` overrides a kernel backend's launch settings.
    """
    _validate(x, norm_weight, norm_bias, w1, b1, w2, b2)
    check_gelu_approximate(approximate)
    device_type = x.device.type
    compute_dtype = sublayer_compute_dtype(x, w1)
    chosen = BACKENDS.resolve(backend, x, w1.shape[0], compute_dtype=compute_dtype)
    if launch and chosen.ops is None:
        raise ValueError(f"the {chosen.name} mlp_sublayer backend has no launch settings to override, got {launch}")
    # Cast outside the ops, as autocast casts nn.Linear's weights: autograd casts their gradients back.
    w1, b1, w2, b2 = (t.to(compute_dtype) for t in (w1, b1, w2, b2))
    with torch.autocast(device_type, enabled=False):
        return chosen.run(x, norm_weight, norm_bias, w1, b1, w2, b2, float(eps), approximate, launch_json(launch))


# ----------------------------------------------------------------------------------------------
# The kernel backends' ops
# ----------------------------------------------------------------------------------------------


def mlp_kernel_ops(name: str, forward: Callable, backward: Callable) -> Callable[..., torch.Tensor]:
    """Registers a kernel backend's two launchers as `mlp_sublayer::<name>_forward` / `_backward`
    custom ops with fake and autograd implementations; returns its `run`, which eager calls
    (kernels/eager.py) take through an autograd.Function over the same launchers instead.

        forward(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch) -> (y, hidden, mean, rstd)
        backward(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate, launch)
            -> (dx, grad_out, grad_hidden, activation, normed, db1_parts, column_parts)

    grad_out: grad_y in the compute dtype; hidden, grad_hidden, activation: [T, H] in it; normed:
    LN(x) [T, D] in it; db1_parts [tiles, H] and column_parts [tiles, 3, D] (the LN weight's, LN
    bias's and b2's gradients): fp32 partial sums, added here in one fixed order.
    """

    @torch.library.custom_op(f"mlp_sublayer::{name}_forward", mutates_args=())
    def forward_op(
        x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, w1: torch.Tensor,
        b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, eps: float, approximate: str, launch: str,
    ) -> list[torch.Tensor]:
        return list(forward(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch))

    @forward_op.register_fake
    def _(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch):
        tokens = x.shape[0]
        stats = x.new_empty(tokens, dtype=torch.float32)
        return [torch.empty_like(x, memory_format=torch.contiguous_format),
                x.new_empty(tokens, w1.shape[0], dtype=w1.dtype), stats, torch.empty_like(stats)]

    def gradients(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate, launch):
        dx, grad_out, grad_hidden, activation, normed, db1_parts, column_parts = backward(
            grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate, launch)
        compute_dtype = w1.dtype
        # The weight gradients are sums over every token: two GEMMs over the whole batch.
        dw1 = grad_hidden.t() @ normed
        dw2 = grad_out.t() @ activation
        # Copies: a custom op's outputs may not be views of one another.
        dnw, dnb, db2 = column_parts.sum(0).unbind(0)
        return (dx, dnw.to(norm_weight.dtype, copy=True), dnb.to(norm_bias.dtype, copy=True), dw1,
                db1_parts.sum(0).to(compute_dtype), dw2, db2.to(compute_dtype, copy=True))

    @torch.library.custom_op(f"mlp_sublayer::{name}_backward", mutates_args=())
    def backward_op(
        grad_y: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
        w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, hidden: torch.Tensor, mean: torch.Tensor,
        rstd: torch.Tensor, eps: float, approximate: str, launch: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return gradients(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate, launch)

    @backward_op.register_fake
    def _(grad_y, x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd, eps, approximate, launch):
        return (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(norm_weight),
                torch.empty_like(norm_bias), torch.empty_like(w1), torch.empty_like(b1), torch.empty_like(w2),
                w2.new_empty(w2.shape[0]))

    def setup_context(ctx, inputs, output):
        x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch = inputs
        _, hidden, mean, rstd = output
        ctx.save_for_backward(x, norm_weight, norm_bias, w1, b1, w2, hidden, mean, rstd)
        ctx.eps, ctx.approximate, ctx.launch = eps, approximate, launch
        # The saved tensors among the outputs get no gradient: don't let autograd fill [T, H] zeros for them.
        ctx.set_materialize_grads(False)

    def backward_formula(ctx, grads, backward_fn=backward_op):
        grad_y = grads[0] if grads[0] is not None else torch.zeros_like(ctx.saved_tensors[0])
        dx, dnw, dnb, dw1, db1, dw2, db2 = backward_fn(grad_y, *ctx.saved_tensors, ctx.eps, ctx.approximate, ctx.launch)
        return dx, dnw, dnb, dw1, db1, dw2, db2, None, None, None

    forward_op.register_autograd(backward_formula, setup_context=setup_context)

    call = op_or_eager(forward_op, forward, setup_context, lambda ctx, grads: backward_formula(ctx, grads, gradients))

    def run(x, norm_weight, norm_bias, w1, b1, w2, b2, eps, approximate, launch):
        return call((x, norm_weight, norm_bias, w1, b1, w2, b2), eps, approximate, launch)

    run.forward_op, run.backward_op = forward_op, backward_op
    return run
